"""The drivers: how tenants get their rows and their steps (see :mod:`.base`, the seam the training loop calls).

- :mod:`.base`: the :class:`~.base.Driver` protocol, its plans and results, and what a driver is given;
- :mod:`.files`: tenants whose rows come from their data (SFT, the default);
- :mod:`.rl`: RL tenants, which sample their rows and score them with rewards (GRPO);
- :mod:`.preference`: preference tenants, which learn from pairs against a cached reference (DPO's family);
- :mod:`.tinker`: tenants driven by Tinker SDK clients over HTTP (a served job);
- :mod:`.default`: the drivers a job runs with, in order of precedence.

A driver never imports another (a wall in ``tests/test_layering.py``): they meet only in the job's list.
"""
