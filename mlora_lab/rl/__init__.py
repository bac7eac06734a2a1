"""Reinforcement learning maths: GRPO's group-normalised advantages and its clipped policy loss.

Pure torch, no processes or devices: the RL driver calls these per tenant per step and does the
reductions over processes itself (:mod:`mlora_lab.rl.grpo` says which counts to pass).
"""

from __future__ import annotations

from mlora_lab.rl.grpo import (
    LOSS_TYPES,
    SCALE_REWARDS,
    RewardStats,
    advantages,
    combine_rewards,
    masked_means,
    nanstd,
    policy_loss,
)

__all__ = [
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "RewardStats",
    "advantages",
    "combine_rewards",
    "masked_means",
    "nanstd",
    "policy_loss",
]
