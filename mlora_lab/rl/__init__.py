"""Reinforcement learning for tenants, engine side (nothing here knows processes or devices):

- :mod:`mlora_lab.rl.grpo`: GRPO's group-normalised advantages and clipped policy loss, equal to TRL
  1.16.0's (the RL driver calls them per tenant per step and does the reductions over processes itself;
  the module says which counts to pass);

Import the submodules themselves: this package imports nothing, so that the reward worker and the
checks before launch, which need no torch, do not load it.
"""
