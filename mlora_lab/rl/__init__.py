"""Reinforcement learning for tenants, engine side (nothing here knows processes or devices):

- :mod:`mlora_lab.rl.grpo`: GRPO's group-normalised advantages and clipped policy loss, equal to TRL
  1.16.0's (the RL driver calls them per tenant per step and does the reductions over processes itself;
  the module says which counts to pass);
- :mod:`mlora_lab.rl.preference`: the DPO family's losses (TRL 1.16.0's ``DPOTrainer`` loss types,
  f-divergences, LD-DPO, WPO) and TRL's reward metrics, from sequence log-probs of a pair batch;
- :mod:`mlora_lab.rl.preference_free`: the losses without a pair's reference or without pairs, as TRL 1.16.0's
  trainers compute them: ORPO's odds ratio, CPO's (with SimPO and AlphaPO), KTO's unpaired loss with its KL
  estimate, and each trainer's metrics;
- :mod:`mlora_lab.rl.preference_ref`: a pair's reference log-probs from the shared base (the tenant's delta
  off, or its init adapter), computed once per row and cached by row id;
- :mod:`mlora_lab.rl.pairs`: preference rows (paired, implicit prompt, KTO's unpaired; text or chat)
  recognised with every problem named, and tokenized and collated exactly as TRL 1.16.0's trainers do;
- :mod:`mlora_lab.rl.trajectory`: multi-turn trajectories (the model's sampled tokens with the sampler's log-probs,
  the environment's rendered ones) as loop rows, and the model tokens' log-probs gathered for GRPO's loss;
- :mod:`mlora_lab.rl.rewards`: reward functions with TRL's signature, imported and called in a worker
  process of their own per tenant (:mod:`mlora_lab.rl.reward_worker`), with a timeout; a failing
  reward fails only its tenant's call, with the reason.

Import the submodules themselves: this package imports nothing, so that the reward worker and the
checks before launch, which need no torch, do not load it.
"""
