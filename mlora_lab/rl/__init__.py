"""Reinforcement learning for tenants: reward functions (:mod:`.rewards`, run in a worker process)."""
