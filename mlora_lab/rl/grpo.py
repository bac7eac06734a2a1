"""GRPO, as TRL 1.16.0's ``GRPOTrainer`` computes it: advantages from rewards, and the policy loss.

Every formula here is a line of ``trl/trainer/grpo_trainer.py`` (TRL 1.16.0, cited as ``:NNNN``) or of
``trl/trainer/utils.py`` (``utils:NNNN``), done with the same torch operations in the same order, so that
``tests/rl/test_rl_loss.py`` can call TRL's own ``_compute_loss`` on the same tensors and find the same loss
and gradient. What TRL does around them (generation, vLLM, reward models, entropy masks, multi-objective
"normalize_then_sum", the entropy bonus, MoE aux loss) is not here; its off-policy corrections are (below).

Rewards → advantages (``_generate_and_score_completions``, :2756-2830), for ``N = B·G`` completions,
``G`` per prompt, completion ``j`` of prompt ``b`` at row ``b·G + j`` (TRL's ``repeat_interleave`` order):

* a reward function that returns ``None`` gives NaN (:1630); :func:`combine_rewards` sums the weighted
  functions ignoring NaN, ``R_i = nansum_f w_f·r_{i,f}`` (:2763), and a row where *every* function gave
  NaN is NaN (unscorable, :2759 and :2764);
* ``μ_b = nanmean_j R_{b,j}`` (:2765); ``σ`` = :func:`nanstd` (the ``n − 1`` std over the non-NaN values,
  utils:1021) per group for ``scale_rewards="group"`` or ``"none"`` (:2770), over the whole batch for
  ``"batch"`` (:2777);
* ``A_i = (R_i − μ_b) / (σ + 1e-4)``, or ``R_i − μ_b`` for ``"none"`` (:2785-2787); NaN advantages (an
  unscorable row; every row of a group with fewer than two scorable completions, whose σ is NaN) become 0
  (:2810).

Policy loss (``_compute_loss``, :3020-3290), for ``n`` completions padded to ``T`` tokens, log-probs
``ℓ, ℓ_old, ℓ_ref [n, T]``, mask ``m [n, T]``, advantages ``A [n]``:

* ``ℓ_old = sg(ℓ)`` when not given (:3066, one update per generation: the ratio is 1, its gradient is not);
* ratio ``ρ_{i,t} = exp(ℓ − ℓ_old)`` (``"token"``) or ``ρ_i = exp(Σ_t m(ℓ − ℓ_old) / max(Σ_t m, 1))``
  (``"sequence"``, GSPO) (:3083-3095);
* per-token loss ``L`` (:3109-3135):

  - grpo, bnpo, dr_grpo, dapo, luspo: ``L = −min(ρ̃·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)`` with
    ``ρ̃ = min(ρ, δ)`` when ``delta`` is set (INTELLECT-2's two-sided clip), else ``ρ̃ = ρ``;
  - cispo: ``L = −sg(min(ρ, ε_high))·A·ℓ``;
  - sapo: ``L = −(4/τ)·σ(τ(ρ − 1))·A`` with ``τ = τ_pos`` where ``A > 0``, else ``τ_neg``;
  - vespo: ``L = −φ_i·A·ℓ`` with ``φ_i = sg(exp(λ + k·log w − λ·w))``,
    ``log w = clamp(Σ_t m·clamp(ℓ − ℓ_old, −20, 20), log 1e-8, 20)`` and ``(k, λ)`` the positive pair
    where ``A ≥ 0``, else the negative one (``get_gamma_weights``, :2972-3018);

* plus ``β·KL`` with ``KL = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1`` (the k3 estimator), times ``ρ`` when
  ``use_bias_correction_kl`` (TRL's default) (:3098-3105, :3149-3150).

Off-policy corrections, for ``ℓ_s [n, T]`` the **sampler's** log-probs of the same tokens (what drew them: vLLM
in TRL, this project's sampler, an agent's endpoint; its top-k/top-p filtering and its numerics make it differ
from the trainer's ``ℓ_old``):

* the sampling importance ratio (``vllm_importance_sampling_correction``, :2660-2703;
  :func:`sampling_is_ratio`), ``d = nan_to_num(m·(ℓ_old − ℓ_s), nan=0)`` (a token the sampler could not score
  is not corrected), with ``[C_min, C_max]`` the clip bounds (``None``: ``∓∞``) and four modes:

  - ``token_truncate``: ``w_{i,t} = clamp(exp(d_{i,t}), C_min, C_max)``   ``[n, T]``
  - ``token_mask``: ``w_{i,t} = exp(d_{i,t})``, 0 where it lies outside ``[C_min, C_max]``   ``[n, T]``
  - ``sequence_truncate``: ``w_i = clamp(exp(Σ_t d_{i,t}), C_min, C_max)``   ``[n, 1]``
  - ``sequence_mask`` (TRL's default): ``w_i = exp(Σ_t d_{i,t})``, 0 outside ``[C_min, C_max]``   ``[n, 1]``;

  TRL computes it once per generation from ``ℓ_old`` (the trainer's log-probs when the completions were drawn)
  and keeps it for every update of that generation; ``ρ`` stays ``π_θ/π_old``, so with ``ℓ_old`` a stale
  sampler's this is also AReaL's decoupled PPO (``ρ`` against the proximal policy, ``w`` the behaviour
  correction);
* the off-policy sequence mask (``off_policy_mask_threshold`` δ, DeepSeek-V3.2's OPSM, :2945-2970;
  :func:`off_policy_mask`): ``M_i = 1`` if ``A_i ≥ 0`` or ``Σ_t m·nan_to_num(ℓ_s − sg(ℓ)) / max(Σ_t m, 1) ≤ δ``,
  else 0 (a negative-advantage sequence the policy has drifted far from is dropped), ``[n, 1]``; ``ℓ_s`` is
  the sampler's log-probs when known, else ``ℓ_old`` (:3073);
* where they enter (:3137-3150): ``L ← L·M``, then ``L ← L·w`` (not for vespo, whose φ takes ``w`` inside:
  ``log w_i += Σ_t clamp(log w_{i,t}, log 1e-8, 20)``, :2999-3002), then ``+ β·KL``.

TRL logs, per generation (:2860-2895): ``sampling/sampling_logp_difference/{mean,max}`` of ``|ℓ_old − ℓ_s|``
over the masked tokens the sampler scored, and ``sampling/importance_sampling_ratio/{min,mean,max}`` of ``w``
(over the masked tokens at token level, over every sequence at sequence level).

The reduction (:3153-3183) is written for how this project trains: every process backpropagates its
micro-batch's loss and the gradients are **summed** over micro-batches and processes (as the file-data
driver does for SFT). ``K`` is the number of micro-batches so summed into one optimiser step (processes ×
accumulation steps), ``S`` the number of completions in all of them, ``N`` their completion tokens:

==============================  ==========================================================  =====================
loss_type                       this micro-batch's loss                                     TRL's normaliser
==============================  ==========================================================  =====================
grpo, sapo                      ``Σ_i (Σ_t m·L / max(Σ_t m, 1)) / S``                        ``.mean() / GA``
luspo                           ``Σ_i Σ_t m·L / S``                                          ``.mean() / GA``
dr_grpo                         ``Σ m·L / (S · max_completion_length)``                      ``/ (B·L_max) / GA``
bnpo                            ``Σ m·L / max(Σ m, 1) / K`` (the local token mean, as TRL)   ``/ max(Σ m, 1) / GA``
dapo (TRL's default), cispo,    ``Σ m·L / max(N, 1)``                                        ``num_items_in_batch``
vespo                                                                                        ``/ P · GA / spg``
==============================  ==========================================================  =====================

TRL's trainer *averages* the gradients of its ``P`` processes (DDP), so its loss on one process is ``P``
times this one when ``K = P·GA``, ``S = K·per_device_batch`` and ``N = num_items_in_batch·GA /
steps_per_generation`` (the window's token count when ``steps_per_generation = GA``, TRL's default); on
one process they are equal. Passing the true global ``S`` and ``N`` (and not TRL's "every micro-batch has
``per_device_batch`` rows") keeps the sum exact when a tenant's rows split unevenly over processes.

Logged metrics (:3254-3288) come back as ``[sum, count]`` pairs, which add up over micro-batches and
processes as TRL's ``global_masked_mean`` reduces them (:3259); :func:`masked_means` divides. A minimum or
maximum (:data:`MIN_METRICS`, :data:`MAX_METRICS`) comes back as ``[extreme, count]`` instead (``±∞`` where
nothing was counted): over micro-batches :func:`combine_metrics` takes the min or max of the extremes and adds
the counts; over processes a caller max-reduces ``−min`` and ``max`` and sum-reduces the rest. The sampling
means are global means over every token (or sequence) of the generation, where TRL averages each process's
mean: the same on one process.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO-style min(ρA, clip(ρ)A) family (:3112)
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # :2666-2703
STD_EPS = 1e-4  # :2787, added to σ before dividing
RATIO_METRIC = "sampling/importance_sampling_ratio"
LOGP_DIFF_METRIC = "sampling/sampling_logp_difference"
MIN_METRICS = (f"{RATIO_METRIC}/min",)
"""Metrics that come back as ``[minimum, count]`` (``+∞`` when nothing was counted)."""
MAX_METRICS = (f"{RATIO_METRIC}/max", f"{LOGP_DIFF_METRIC}/max")
"""Metrics that come back as ``[maximum, count]`` (``−∞`` when nothing was counted)."""


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of ``x`` ignoring NaN, with Bessel's ``n − 1`` (TRL utils:1021-1052).

    ``σ = sqrt(nanmean((x − nanmean(x))²) · c / (c − 1))`` with ``c`` the count of non-NaN values, over ``dim``
    (all of ``x`` when None, giving a 0-d tensor); NaN where ``c < 2``.
    """
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """One reward per completion from several weighted reward functions (TRL :2759-2764).

    ``per_function [N, F]`` holds function ``f``'s reward for completion ``i``, NaN where it returned None.
    Returns ``R [N]``: ``R_i = Σ_f w_f·r_{i,f}`` over the functions that scored ``i`` (``nansum``), and NaN
    where none did — such a completion stays out of its group's mean and std and gets advantage 0.
    """
    # (the weights in the rewards' own dtype: the job combines in float64, where 1e20 x 1e20 still holds)
    dtype = per_function.dtype if per_function.is_floating_point() else torch.float32
    weights = torch.as_tensor(weights, dtype=dtype)
    problems = []
    if per_function.ndim != 2:
        problems.append(
            f"per_function must be [completions, functions], got shape {tuple(per_function.shape)}"
        )
    elif not per_function.is_floating_point():
        problems.append(f"per_function must be floating point (NaN marks None), got {per_function.dtype}")
    if weights.ndim != 1:
        problems.append(f"weights must be one per function, got shape {tuple(weights.shape)}")
    elif per_function.ndim == 2 and weights.numel() != per_function.shape[1]:
        problems.append(f"{weights.numel()} weights for {per_function.shape[1]} reward functions")
    elif not torch.isfinite(weights).all():
        problems.append(f"weights must be finite, got {weights.tolist()}")
    if problems:
        raise ValueError("combine_rewards: " + "; ".join(problems))
    unscorable = torch.isnan(per_function).all(dim=1)
    rewards = (per_function * weights.to(per_function.device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    return rewards


@dataclass(frozen=True)
class RewardStats:
    """What TRL logs about a generation's rewards (:2828-2830), as 0-d tensors (no device sync here).

    ``reward``: the mean of the scorable rewards; ``reward_std``: their :func:`nanstd`;
    ``frac_reward_zero_std``: the fraction of completions whose σ is 0 — with ``"group"``/``"none"`` scaling
    the fraction of groups where every completion scored the same (which learn nothing), with ``"batch"``
    1 or 0.
    """

    reward: torch.Tensor
    reward_std: torch.Tensor
    frac_reward_zero_std: torch.Tensor


def advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, RewardStats]:
    """Group-normalised advantages of ``rewards [B·G]`` (G = ``group_size`` consecutive completions per
    prompt; NaN = unscorable), TRL :2762-2810 with ``multi_objective_aggregation="sum_then_normalize"``.

    ``A_i = (R_i − μ_b) / (σ + 1e-4)`` with ``μ_b`` the NaN-ignoring mean of the prompt's group and ``σ`` the
    group's :func:`nanstd` (``"group"``, TRL's default) or the batch's (``"batch"``); ``"none"`` leaves out the
    division. NaN advantages become 0. Returns ``(A [B·G], RewardStats)``.
    """
    problems = []
    if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool):
        problems.append(f"group_size must be an integer, got {group_size!r}")
    elif group_size < 2:
        problems.append(
            f"group_size must be at least 2 (GRPO compares completions of a prompt), got {group_size}"
        )
    if scale_rewards not in SCALE_REWARDS:
        problems.append(f"unknown scale_rewards {scale_rewards!r}; known: {', '.join(SCALE_REWARDS)}")
    if rewards.ndim != 1:
        problems.append(f"rewards must be 1-D [prompts × group_size], got shape {tuple(rewards.shape)}")
    elif not rewards.is_floating_point():
        problems.append(f"rewards must be floating point (NaN marks unscorable), got {rewards.dtype}")
    elif rewards.numel() == 0:
        problems.append("rewards is empty")
    elif isinstance(group_size, numbers.Integral) and group_size >= 2 and rewards.numel() % group_size:
        problems.append(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if problems:
        raise ValueError("advantages: " + "; ".join(problems))

    g = int(group_size)
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)  # :2765-2766
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)  # :2777
    else:  # "none" keeps σ only to count the groups with σ = 0 (:2768)
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)  # :2770-2771
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + STD_EPS)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))  # :2788
    adv = torch.nan_to_num(adv, nan=0.0)  # :2810
    stats = RewardStats(
        reward=torch.nanmean(rewards),
        reward_std=nanstd(rewards),
        frac_reward_zero_std=is_std_zero.float().mean(),
    )
    return adv, stats


def reward_problem(
    per_function: torch.Tensor,
    weights: Sequence[float],
    group_size: int,
    scale_rewards: str,
    names: Sequence[str],
) -> str | None:
    """Why a generation's rewards cannot train (None: they can), naming the reward function at fault.

    ``per_function [N, F]`` (float64, NaN = none) and ``weights`` as :func:`combine_rewards` takes them,
    ``names[f]`` function ``f`` as messages show it. A weighted reward that is not finite (``1e308 × 2``), a
    standard deviation that is not (rewards near ``1e200``: their squares overflow), or advantages past
    float32 (the loss's dtype) would all end as advantages of 0, a tenant that trains on nothing in silence:
    each is a fault of the tenant instead."""
    rewards = combine_rewards(per_function, weights)
    w = torch.as_tensor(weights, dtype=per_function.dtype)
    inf = torch.isinf(rewards).nonzero().flatten()
    if len(inf):
        i = int(inf[0])
        terms = (per_function[i] * w).abs().nan_to_num(nan=0.0)
        f = int(terms.argmax())
        return (
            f"the weighted reward of completion {i} is {float(rewards[i])}: reward {names[f]} gave "
            f"{float(per_function[i, f]):.4g} × weight {float(w[f]):.4g}, past what a float holds; scale the "
            "rewards or reward_weights down"
        )
    g = int(group_size)
    std = nanstd(rewards) if scale_rewards == "batch" else nanstd(rewards.view(-1, g), dim=1)
    overflow = torch.isinf(std.reshape(-1)).nonzero().flatten()
    if len(overflow):
        where = "of the batch" if scale_rewards == "batch" else f"of prompt {int(overflow[0])}'s group"
        largest = float(rewards.abs().nan_to_num(nan=0.0).max())
        return (
            f"the standard deviation of the rewards {where} overflows (rewards up to {largest:.4g} from "
            f"{', '.join(names)}): their squares pass what a float holds; scale the rewards down"
        )
    adv, _ = advantages(rewards, g, scale_rewards)
    if not torch.isfinite(adv.float()).all():
        return (
            f"the advantages pass what float32 (the loss's) holds (scale_rewards={scale_rewards!r}, rewards up "
            f"to {float(rewards.abs().nan_to_num(nan=0.0).max()):.4g}); scale the rewards down"
        )
    return None


def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    importance_sampling_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's sequence weight ``φ_i [n, 1]`` (TRL ``get_gamma_weights``, :2972-3018).

    ``log w_i = clamp(Σ_t m·clamp(ℓ − ℓ_old, −20, 20) + Σ_t clamp(log w^s_{i,t}, log 1e-8, 20), log 1e-8, 20)``
    with ``w^s`` the sampling ratio ``importance_sampling_ratio`` (``[n, T]`` or ``[n, 1]``; its sum left out when
    None), ``φ = exp(λ + k·log w − λ·w)`` (so ``φ(1) = 1``) with ``(k, λ)`` by the sign of ``A [n, 1]``;
    non-finite φ become 0. No gradient flows through φ: it only scales ``A·∇ℓ``.
    """
    with torch.no_grad():
        lower = math.log(1e-8)
        seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
        if importance_sampling_ratio is not None:  # log w = log(π_θ/π_old) + log(π_old/π_sampler)
            log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower, 20.0)
            seq_log_ratio = seq_log_ratio + torch.sum(log_is_ratio, dim=-1, keepdim=True)
        log_w = torch.clamp(seq_log_ratio, lower, 20.0)
        w = torch.exp(log_w)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
        log_phi = lam + k * log_w - lam * w
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def importance_sampling_problems(
    mode: object, clip_min: object, clip_max: object, threshold: object = None, loss_type: object = None
) -> list[str]:
    """Every problem of the sampling-correction settings at once (GRPOConfig's checks, :1152-1171 of its file,
    and ``GRPOTrainer``'s vespo check, :936): ``mode`` one of :data:`IS_MODES`; the bounds finite numbers or
    None with ``C_min < C_max``; at least one bound for a ``*_truncate`` mode; vespo only with a ``token_*``
    mode (its φ sums the ratio's logs per token); ``threshold`` (OPSM's δ) a finite number or None."""
    problems = []
    if mode not in IS_MODES:
        problems.append(f"unknown importance_sampling_mode {mode!r}; known: {', '.join(IS_MODES)}")
    bounds = {"importance_sampling_clip_min": clip_min, "importance_sampling_clip_max": clip_max}
    good = {}
    for name, v in bounds.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            problems.append(f"{name} must be a finite number ≥ 0 or None, got {v!r}")
        else:
            good[name] = float(v)
    if len(good) == 2 and not good["importance_sampling_clip_min"] < good["importance_sampling_clip_max"]:
        problems.append(
            f"importance_sampling_clip_min ({clip_min}) must be below importance_sampling_clip_max ({clip_max})"
        )
    if mode in ("token_truncate", "sequence_truncate") and clip_min is None and clip_max is None:
        problems.append(
            f"importance_sampling_mode {mode!r} truncates the ratio: give a clip_min or a clip_max"
        )
    if loss_type == "vespo" and mode in IS_MODES and not str(mode).startswith("token_"):
        problems.append(
            f"vespo takes the sampling ratio per token: importance_sampling_mode must be token_truncate or "
            f"token_mask, got {mode!r}"
        )
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold)
    ):
        problems.append(f"off_policy_mask_threshold must be a finite number or None, got {threshold!r}")
    return problems


@torch.no_grad()
def sampling_is_ratio(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """The sampling importance ratio ``w`` (TRL's ``vllm_importance_sampling_ratio``, :2660-2703): ``[n, T]``
    for the ``token_*`` modes, ``[n, 1]`` for the ``sequence_*`` ones (the module docstring gives the four).

    ``old_logps [n, T]``: the trainer's log-probs of the sampled tokens when they were drawn (``ℓ_old``);
    ``sampler_logps [n, T]``: the sampler's (``ℓ_s``; NaN where it gave none); ``mask [n, T]``: 1 on the
    completion tokens that train. Settings and defaults are GRPOConfig's ``vllm_importance_sampling_*``.
    A constant of the loss: no gradient.
    """
    problems = importance_sampling_problems(mode, clip_min, clip_max)
    if problems:
        raise ValueError("sampling_is_ratio: " + "; ".join(problems))
    diff = (old_logps - sampler_logps) * mask
    diff = torch.nan_to_num(diff, nan=0.0)  # a token the sampler could not score: ratio 1
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


def sampling_metrics(
    old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What TRL logs of the sampling correction (:2860-2895), as this micro-batch's detached pairs:
    ``[sum, count]`` for the means, ``[extreme, count]`` for :data:`MIN_METRICS` and :data:`MAX_METRICS`.

    ``|ℓ_old − ℓ_s|`` over the masked tokens the sampler scored (not NaN); ``w`` (:func:`sampling_is_ratio`)
    over the masked tokens (``[n, T]``) or over every sequence (``[n, 1]``). Nothing syncs the device.
    """
    with torch.no_grad():
        m = mask.bool()
        delta = torch.abs(old_logps - sampler_logps)
        scored = m & ~torch.isnan(delta)
        delta = torch.where(scored, delta, torch.zeros_like(delta))
        seen = m if ratio.shape[-1] != 1 else torch.ones_like(ratio, dtype=torch.bool)  # (:2874-2877)
        r = ratio
        inf = torch.tensor(math.inf, dtype=r.dtype, device=r.device)

        def pair(value: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            return torch.stack([value.to(torch.float64), count.to(torch.float64)])

        n_delta, n_ratio = scored.sum(), seen.sum()
        return {
            f"{LOGP_DIFF_METRIC}/mean": pair(delta.sum(), n_delta),
            f"{LOGP_DIFF_METRIC}/max": pair(torch.where(scored, delta, -inf).amax(), n_delta),
            f"{RATIO_METRIC}/min": pair(torch.where(seen, r, inf).amin(), n_ratio),
            f"{RATIO_METRIC}/mean": pair(torch.where(seen, r, 0.0).sum(), n_ratio),
            f"{RATIO_METRIC}/max": pair(torch.where(seen, r, -inf).amax(), n_ratio),
        }


def off_policy_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``M [n, 1]`` (TRL ``get_off_policy_mask``, :2945-2970), in
    ``mask``'s dtype: 1 (keep) where ``A ≥ 0`` or the sequence's mean ``nan_to_num(ℓ_s − sg(ℓ))`` over its
    masked tokens is at most ``threshold``, else 0. ``advantages [n, 1]`` (or ``[n]``), the rest ``[n, T]``."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    kl_div = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)  # (a NaN token is no evidence)
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (avg_seq_kl <= threshold)).to(dtype=mask.dtype)


def masked_means(totals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sum / max(count, 1)`` of each ``[sum, count]`` pair of :func:`policy_loss`'s metrics, once they have
    been added over micro-batches and processes (TRL's ``global_masked_mean``, :3259-3265); a
    :data:`MIN_METRICS` or :data:`MAX_METRICS` pair gives its extreme, 0 where nothing was counted (TRL's value
    for an empty batch, :2878-2884)."""
    out = {}
    for name, pair in totals.items():
        if name in MIN_METRICS or name in MAX_METRICS:
            out[name] = torch.where(pair[1] > 0, pair[0], torch.zeros_like(pair[0]))
        else:
            out[name] = pair[0] / pair[1].clamp(min=1.0)
    return out


def combine_metrics(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Two micro-batches' metric pairs as one: sums and counts added, a :data:`MIN_METRICS` or
    :data:`MAX_METRICS` extreme the min or max of the two (a key in one only is kept as it is)."""
    out = dict(a)
    for name, pair in b.items():
        if name not in out:
            out[name] = pair
        elif name in MIN_METRICS:
            out[name] = torch.stack([torch.minimum(out[name][0], pair[0]), out[name][1] + pair[1]])
        elif name in MAX_METRICS:
            out[name] = torch.stack([torch.maximum(out[name][0], pair[0]), out[name][1] + pair[1]])
        else:
            out[name] = out[name] + pair
    return out


def _shape_problems(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> list[str]:
    if t is None or tuple(t.shape) == shape:
        return []
    return [f"{name} has shape {tuple(t.shape)}, expected {shape}"]


def _check(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logps: torch.Tensor | None,
    loss_type: str,
    importance_sampling_level: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    delta: float | None,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    max_completion_length: int | None,
    num_sequences: int | None,
    num_tokens: float | torch.Tensor | None,
    num_micro_batches: int,
    sampler_logps: torch.Tensor | None = None,
    importance_sampling_correction: bool = False,
    importance_sampling_mode: str = "sequence_mask",
    importance_sampling_clip_min: float | None = None,
    importance_sampling_clip_max: float | None = 3.0,
    off_policy_mask_threshold: float | None = None,
) -> None:
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"unknown loss_type {loss_type!r}; known: {', '.join(LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        problems.append(
            f"unknown importance_sampling_level {importance_sampling_level!r}; "
            f"known: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if logps.ndim != 2 or not logps.is_floating_point():
        problems.append(
            f"logps must be a floating [completions, tokens] tensor, got {logps.dtype} {tuple(logps.shape)}"
        )
    else:
        n, t = logps.shape
        problems += _shape_problems("old_logps", old_logps, (n, t))
        problems += _shape_problems("mask", mask, (n, t))
        problems += _shape_problems("ref_logps", ref_logps, (n, t))
        problems += _shape_problems("sampler_logps", sampler_logps, (n, t))
        problems += _shape_problems("advantages", advantages, (n,))
        if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < t):
            problems.append(
                f"dr_grpo normalises by max_completion_length, which must be given and at least the {t} "
                f"completion tokens here, got {max_completion_length!r}"
            )
    if not beta >= 0:
        problems.append(f"beta must be ≥ 0, got {beta!r}")
    elif beta != 0 and ref_logps is None:
        problems.append(f"beta={beta} needs ref_logps (the reference model's log-probs)")
    if not epsilon_low >= 0:
        problems.append(f"epsilon_low must be ≥ 0, got {epsilon_low!r}")
    if not epsilon_high > 0:
        problems.append(f"epsilon_high must be > 0, got {epsilon_high!r}")
    if delta is not None:
        if loss_type not in CLIPPED:
            problems.append(
                f"delta caps the ratio of the clipped losses ({', '.join(CLIPPED)}), not {loss_type!r}"
            )
        elif not delta > 0:
            problems.append(f"delta must be > 0, got {delta!r}")
    if loss_type == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        problems.append(
            f"sapo temperatures must be > 0, got pos={sapo_temperature_pos!r} neg={sapo_temperature_neg!r}"
        )
    if not isinstance(num_micro_batches, numbers.Integral) or num_micro_batches < 1:
        problems.append(f"num_micro_batches must be an integer ≥ 1, got {num_micro_batches!r}")
    elif num_micro_batches > 1 and num_tokens is None and loss_type in ("dapo", "cispo", "vespo"):
        problems.append(
            f"{loss_type} normalises by the completion tokens of all {num_micro_batches} micro-batches: "
            "pass num_tokens"
        )
    if num_sequences is not None and (not isinstance(num_sequences, numbers.Integral) or num_sequences < 1):
        problems.append(f"num_sequences must be an integer ≥ 1, got {num_sequences!r}")
    if isinstance(num_tokens, numbers.Real) and not num_tokens >= 0:
        problems.append(f"num_tokens must be ≥ 0, got {num_tokens!r}")
    if importance_sampling_correction:
        if sampler_logps is None:
            problems.append("importance_sampling_correction needs sampler_logps (the sampler's log-probs)")
        problems += importance_sampling_problems(
            importance_sampling_mode,
            importance_sampling_clip_min,
            importance_sampling_clip_max,
            off_policy_mask_threshold,
            loss_type,
        )
    elif off_policy_mask_threshold is not None:
        problems += importance_sampling_problems("sequence_mask", None, None, off_policy_mask_threshold)
    if problems:
        raise ValueError("policy_loss: " + "; ".join(problems))


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    use_bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_micro_batches: int = 1,
    sampler_logps: torch.Tensor | None = None,
    importance_sampling_correction: bool = False,
    importance_sampling_mode: str = "sequence_mask",
    importance_sampling_clip_min: float | None = None,
    importance_sampling_clip_max: float | None = 3.0,
    off_policy_mask_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's policy loss of one micro-batch (TRL 1.16.0 ``_compute_loss``, :3020-3290; the module docstring
    gives every formula and reduction).

    ``logps [n, T]`` (with grad), ``old_logps [n, T]`` (None: one update per generation), ``advantages [n]``,
    ``mask [n, T]`` (bool or integer; 1 on completion tokens), ``ref_logps [n, T]`` (needed when
    ``beta ≠ 0``). Settings and defaults are TRL's ``GRPOConfig``'s: ``loss_type`` (``"dapo"``),
    ``epsilon_low`` (``epsilon``, 0.2), ``epsilon_high`` (``epsilon_low`` when None), ``beta`` (0),
    ``delta``, ``importance_sampling_level``, ``use_bias_correction_kl``, the sapo temperatures and the vespo
    ``k``/``λ``. TRL warns (and so should a caller's validation) about luspo at ``"token"`` level, vespo at
    ``"sequence"`` level and bnpo/dr_grpo/dapo/cispo at ``"sequence"`` level; they compute all the same.

    The normalisers are counts over the ``num_micro_batches`` micro-batches (all processes, all accumulation
    steps) whose gradients are summed into one optimiser step: ``num_sequences`` completions (default
    ``n · num_micro_batches``), ``num_tokens`` completion tokens (default ``Σ mask``, only allowed for one
    micro-batch; clamped to ≥ 1), and ``max_completion_length`` for dr_grpo.

    Off-policy corrections (the module docstring's formulas): ``sampler_logps [n, T]`` are the sampler's
    log-probs of the completions (NaN where it gave none); with ``importance_sampling_correction`` (TRL's
    ``use_vllm and vllm_importance_sampling_correction``) the loss is weighted by :func:`sampling_is_ratio` of
    ``old_logps`` (``sg(logps)`` when None: the first update of a generation) against them, with
    ``importance_sampling_mode`` and the clip bounds (GRPOConfig's ``vllm_importance_sampling_*`` defaults);
    ``off_policy_mask_threshold`` (δ) applies :func:`off_policy_mask`, against ``sampler_logps`` when given,
    else ``old_logps``.

    Returns ``(loss, metrics)``: the 0-d loss, and detached ``[sum, count]`` pairs named as TRL logs them —
    ``kl`` (when ``beta ≠ 0``), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``
    (clipped losses), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, and with the correction
    :func:`sampling_metrics`' five — for :func:`masked_means` (and :func:`combine_metrics` over micro-batches).
    A count is the number of masked tokens, or of sequences for a per-sequence quantity (``"sequence"`` level,
    φ).
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    _check(
        logps,
        old_logps,
        advantages,
        mask,
        ref_logps,
        loss_type,
        importance_sampling_level,
        epsilon_low,
        epsilon_high,
        beta,
        delta,
        sapo_temperature_pos,
        sapo_temperature_neg,
        max_completion_length,
        num_sequences,
        num_tokens,
        num_micro_batches,
        sampler_logps,
        importance_sampling_correction,
        importance_sampling_mode,
        importance_sampling_clip_min,
        importance_sampling_clip_max,
        off_policy_mask_threshold,
    )
    n = logps.shape[0]
    adv = advantages.unsqueeze(1)  # [n, 1]
    old_logps = logps.detach() if old_logps is None else old_logps
    is_ratio = None  # w: [n, T] or [n, 1]
    if importance_sampling_correction:
        is_ratio = sampling_is_ratio(
            old_logps,
            sampler_logps,
            mask,
            importance_sampling_mode,
            importance_sampling_clip_min,
            importance_sampling_clip_max,
        )
    opsm = None  # M: [n, 1]
    if off_policy_mask_threshold is not None:  # (:3066-3081: the sampler's log-probs when known)
        behaviour = sampler_logps if sampler_logps is not None else old_logps
        opsm = off_policy_mask(adv, logps, behaviour, mask, off_policy_mask_threshold)
    log_ratio = logps - old_logps  # [n, T]
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: the mean log-ratio of the sequence, [n, 1]
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_weights)  # ρ: [n, T] or [n, 1]

    if beta != 0.0:
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:  # the ratio's gradient makes it the unbiased reverse-KL gradient
            per_token_kl = per_token_kl * ratio

    if loss_type == "cispo":
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps
    elif loss_type in CLIPPED:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)  # TRL's clip metrics below see this capped ratio too
        per_token_loss = -torch.min(ratio * adv, clipped * adv)
    elif loss_type == "sapo":
        temperatures = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures) * adv
    else:  # vespo
        phi = gamma_weights(
            adv, log_ratio, mask, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, is_ratio
        )
        per_token_loss = -phi * adv * logps
    if opsm is not None:
        per_token_loss = per_token_loss * opsm
    if is_ratio is not None and loss_type != "vespo":  # (vespo's φ took it)
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    sequences = n * num_micro_batches if num_sequences is None else num_sequences
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / sequences
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (sequences * max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).sum() / sequences
    else:  # dapo, cispo, vespo
        if num_tokens is None:
            tokens = mask.sum()
        elif torch.is_tensor(num_tokens):
            tokens = num_tokens
        else:  # a 0-d float64 tensor keeps a fractional count exact and does not promote the loss's dtype
            tokens = torch.tensor(float(num_tokens), dtype=torch.float64, device=logps.device)
        loss = (per_token_loss * mask).sum() / tokens.clamp(min=1.0)

    def totals(x: torch.Tensor) -> torch.Tensor:  # TRL :3259-3265, before the reduce over processes
        if x.shape[1] == 1:  # one value per sequence: every sequence counts, masked or not
            total, count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            total, count = (x * mask).sum(), mask.sum()
        return torch.stack([total, count.to(total.dtype)]).detach()

    metrics = {}
    if beta != 0.0:
        metrics["kl"] = totals(per_token_kl)
    if loss_type in CLIPPED:
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = totals(low.float())
        metrics["clip_ratio/high_mean"] = totals(high.float())
        metrics["clip_ratio/region_mean"] = totals((low | high).float())
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = totals(((ratio > epsilon_high) & (adv > 0)).float())
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = totals(phi)
    if is_ratio is not None:
        metrics |= sampling_metrics(old_logps, sampler_logps, mask, is_ratio)
    return loss, metrics
