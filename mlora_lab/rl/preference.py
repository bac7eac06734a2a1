"""Preference optimisation (DPO and its family), as TRL 1.16.0's ``DPOTrainer`` computes the loss.

Every formula is a line of ``trl/trainer/dpo_trainer.py`` (TRL 1.16.0, cited as ``:NNNN``), done with the
same torch operations in the same order, so that ``tests/rl/test_preference.py`` finds TRL's own
``DPOTrainer.compute_loss`` loss, LoRA gradients and logged metrics on the same batch. Nothing here knows
processes, devices, tokenisation or where the reference log-probs come from (for a LoRA tenant: the base
with the tenant's delta off, as TRL's PEFT ``ref_model=None`` case).

Shapes: ``B`` pairs; per-token tensors are ``[B, T]`` (chosen and rejected may be padded to different
``T``), zero-or-anything outside their completion mask ``m`` (it is multiplied in).

Sequence log-probs (:1300-1315, :1339-1346), :func:`sequence_logps`: ``ℓ = Σ_t m_t·ℓ_t``; with ``ld_alpha``
(LD-DPO) the first ``s = min(|y_w|, |y_l|)`` completion tokens of each pair count fully and the tail
beyond them by ``α``: ``ℓ = Σ_{pos ≤ s} ℓ_t + α·Σ_{pos > s} ℓ_t``.

With ``u_w = ℓ_w − ℓ^ref_w`` and ``u_l = ℓ_l − ℓ^ref_l`` (the log-ratios), the f-divergence's scores
``g = f'(exp u)`` (:1353-1381): reverse_kl ``g = u``; forward_kl ``g = 1 − e^{−u}``; js_divergence
``g = log 2 + log σ(u)``; alpha_divergence ``g = (e^{(α−1)u} − 1)/(α − 1)`` (``(α−1)u`` clamped at 80 in
float32, reverse_kl when ``|α − 1| < 1e-6``). ``Δ = g_w − g_l``. Per pair, for each loss type (:1386-1513):

==============  ====================================================================================
sigmoid         ``−log σ(βΔ)`` (DPO)
hinge           ``relu(1 − βΔ)`` (SLiC)
ipo             ``(g_w/n_w − g_l/n_l − 1/(2β))²``, ``n`` = completion tokens, clamped ≥ 1 (IPO, per token)
exo_pair        ``σ(βΔ)(log σ(βΔ) − log(1−ε)) + σ(−βΔ)(log σ(−βΔ) − log ε)``, ``ε`` = label smoothing > 0
nca_pair        ``−log σ(βu_w) − ½ log σ(−βu_w) − ½ log σ(−βu_l)``
robust          ``(−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)``
bco_pair        ``−log σ(βu_w) − log σ(−βu_l)``
sppo_hard       ``(u_w − 1/(2β))² + (u_l + 1/(2β))²``
aot             ``d = sort(ℓ_w − ℓ_l) − sort(ℓ^ref_w − ℓ^ref_l)`` over the batch,
                ``−(1−ε) log σ(βd) − ε log σ(−βd)``
aot_unpaired    the same with ``d = sort(u_w) − sort(u_l)``
apo_zero        ``1 − σ(βu_w) + σ(βu_l)``
apo_down        ``σ(βu_w) + 1 − σ(β(u_w − u_l))``
discopop        ``z = βΔ``, ``ρ = σ(z/τ)``: ``−log σ(z)·(1 − ρ) + e^{−z}·ρ``
sft             ``−mean`` of the chosen completions' per-token log-probs (one value for the batch)
sigmoid_norm    ``−log σ(β(g_w/n_w − g_l/n_l))``
==============  ====================================================================================

RPO (TRL's former ``rpo_alpha``) is ``loss_types=("sigmoid", "sft")``, ``loss_weights=(1, α)``, as TRL 1.16
writes it. ``loss = Σ_k w_k · mean_pairs(L_k · c)`` with ``c = 1`` or WPO's pair weight ``c = ω_w·ω_l``
(:func:`wpo_weights`, :1518-1526). A non-reverse_kl f-divergence is allowed only for
:data:`F_DIVERGENCE_LOSS_TYPES` (:810-816: the f-DPO reparameterisation's ``β log Z(x)`` term cancels
only in the chosen−rejected difference).

Metrics (:1571-1591), means over the ``B`` pairs of this batch (TRL logs the mean of its micro-batches'
means): ``rewards/chosen = β u_w``, ``rewards/rejected = β u_l``, ``rewards/accuracies = [βu_w > βu_l]``,
``rewards/margins = β(u_w − u_l)``, ``logps/chosen = ℓ_w``, ``logps/rejected = ℓ_l`` (after LD-DPO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mlora_lab.spec.parts import F_DIVERGENCES, PREFERENCE_LOSS_TYPES

# TRL's names, owned by the spec (the contract job.json is checked against): one list for both
LOSS_TYPES = PREFERENCE_LOSS_TYPES
# :810, the loss types a non-default f-divergence generalises
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
# :819, losses that sort the pairs, which would misalign WPO's per-pair weights
SORTING_LOSS_TYPES = ("aot", "aot_unpaired")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def sequence_logps(
    chosen_token_logps: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_token_logps: torch.Tensor,
    rejected_mask: torch.Tensor,
    *,
    ld_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ℓ_w [B], ℓ_l [B])`` from per-token log-probs ``[B, T_w]``, ``[B, T_l]`` and their completion masks
    (1 on the completion's tokens, aligned with the log-probs, i.e. TRL's ``completion_mask[:, 1:]``).

    Without ``ld_alpha``: ``ℓ = Σ_t m_t·ℓ_t`` (:1304). With it (LD-DPO, :1306-1315): a completion token's
    position ``p_t = Σ_{t' ≤ t} m_{t'}``; the pair's shared length ``s = min(Σm_w, Σm_l)``;
    ``ℓ = Σ_{1 ≤ p_t ≤ s} m_t ℓ_t + α·Σ_{p_t > s} m_t ℓ_t``, so a longer answer's extra tokens weigh ``α``.
    Call it for the policy's and the reference's log-probs alike (TRL uses the same masks for both).
    """
    # the masks in the log-probs' dtype, so that a float32 sum stays a float32 sum, as TRL's
    chosen_mask, rejected_mask = (
        chosen_mask.to(chosen_token_logps.dtype),
        rejected_mask.to(rejected_token_logps.dtype),
    )
    chosen_token_logps = chosen_token_logps * chosen_mask
    rejected_token_logps = rejected_token_logps * rejected_mask
    if ld_alpha is None:
        return chosen_token_logps.sum(dim=1), rejected_token_logps.sum(dim=1)
    chosen_lens, rejected_lens = chosen_mask.sum(dim=1).long(), rejected_mask.sum(dim=1).long()
    shared_lens = torch.minimum(chosen_lens, rejected_lens).unsqueeze(1)

    def weighted(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = mask.cumsum(dim=1)
        shared = (token_logps * ((pos > 0) & (pos <= shared_lens))).sum(dim=1)
        tail = (token_logps * (pos > shared_lens)).sum(dim=1)
        return shared + ld_alpha * tail

    return weighted(chosen_token_logps, chosen_mask), weighted(rejected_token_logps, rejected_mask)


def wpo_weights(
    token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """WPO's per-sequence weight ``ω = exp(Σ_t m_t(ℓ_t − log Σ_v p_{t,v}²) / max(Σ_t m_t, 1))`` ``[n]``,
    without gradient (Eq. 2 of the WPO paper, :1518-1524): the sequence's probability under the policy,
    per token, relative to the policy's own "sampling" of it. ``token_logps``, ``log_sum_sq_probs`` and
    ``mask`` are ``[n, T]``; ``log_sum_sq_probs = logsumexp(2·log_softmax(z))`` of the next-token logits
    ``z``. A pair's weight is ``ω_w·ω_l`` (``pair_weights`` of :func:`preference_loss`)."""
    lengths = mask.sum(dim=1).clamp_min(1)
    with torch.no_grad():
        aligned = (token_logps - log_sum_sq_probs) * mask
    return torch.exp(aligned.sum(dim=1) / lengths)


def check_options(
    loss_types: Sequence[str],
    loss_weights: Sequence[float] | None,
    *,
    beta: float,
    label_smoothing: float,
    f_divergence: str,
    ld_alpha: float | None = None,
    weighted: bool = False,
) -> list[str]:
    """Every problem with these options at once (empty when TRL's ``DPOTrainer`` would accept them)."""
    problems = []
    if not loss_types:
        problems.append(f"loss_types is empty; offered: {', '.join(LOSS_TYPES)}")
    unknown = [t for t in loss_types if t not in LOSS_TYPES]
    if unknown:
        problems.append(
            f"unknown loss type(s) {', '.join(map(repr, unknown))}; offered: {', '.join(LOSS_TYPES)}"
        )
    if loss_weights is not None and len(loss_weights) != len(loss_types):
        problems.append(f"{len(loss_weights)} loss_weights for {len(loss_types)} loss_types")
    if not beta > 0:  # every loss divides by β or scales by it; β = 0 makes the rewards 0
        problems.append(f"beta must be > 0, got {beta!r}")
    if f_divergence not in F_DIVERGENCES:
        problems.append(f"unknown f_divergence {f_divergence!r}; offered: {', '.join(F_DIVERGENCES)}")
    elif f_divergence != "reverse_kl":
        others = [t for t in loss_types if t not in F_DIVERGENCE_LOSS_TYPES]
        if others:
            problems.append(
                f"f_divergence={f_divergence!r} applies only to {', '.join(F_DIVERGENCE_LOSS_TYPES)}, "
                f"not {', '.join(others)}"
            )
    if "exo_pair" in loss_types and not 0 < label_smoothing < 1:
        problems.append(
            f"exo_pair needs 0 < label_smoothing < 1 (the EXO paper uses 1e-3), got {label_smoothing!r}"
        )
    if "robust" in loss_types and not 0 <= label_smoothing < 0.5:
        problems.append(f"robust needs 0 ≤ label_smoothing < 0.5, got {label_smoothing!r}")
    if ld_alpha is not None and not 0 <= ld_alpha <= 1:
        problems.append(f"ld_alpha must lie in [0, 1], got {ld_alpha!r}")
    if weighted and any(t in SORTING_LOSS_TYPES for t in loss_types):
        problems.append(
            f"WPO weighting does not apply to {', '.join(SORTING_LOSS_TYPES)} (they sort the pairs)"
        )
    return problems


def _scores(logratios: torch.Tensor, f_divergence: str, f_alpha: float) -> torch.Tensor:
    """``g = f'(exp u)`` of the f-divergence (:1353-1379)."""
    if f_divergence == "reverse_kl":
        return logratios
    if f_divergence == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if abs(f_alpha - 1.0) < 1e-6:  # alpha_divergence's limit α → 1 is reverse_kl
        return logratios
    coef = 1.0 / (f_alpha - 1.0)
    t = (f_alpha - 1.0) * logratios
    clamp_max = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}.get(t.dtype, 80.0)
    return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) * coef


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    loss_types: Sequence[str] = ("sigmoid",),
    loss_weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    discopop_tau: float = 0.05,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    chosen_token_logps: torch.Tensor | None = None,
    chosen_mask: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one batch of ``B`` pairs, as TRL 1.16.0's ``DPOTrainer._compute_loss``.

    ``chosen_logps``, ``rejected_logps`` ``[B]``: the policy's sequence log-probs (:func:`sequence_logps`,
    with gradient); ``ref_*`` ``[B]`` the reference's (no gradient needed). The formulas are the module's
    table. Defaults are ``DPOConfig``'s. Needed only by some loss types:

    - ``chosen_tokens``, ``rejected_tokens`` ``[B]``: completion token counts (ipo, sigmoid_norm; TRL counts
      the unshifted ``completion_mask``);
    - ``chosen_token_logps``, ``chosen_mask`` ``[B, T]``: the chosen completions' per-token log-probs and
      mask (sft: their token mean, before any ``ld_alpha``);
    - ``pair_weights`` ``[B]``: WPO's ``ω_w·ω_l`` (:func:`wpo_weights`), multiplied into every loss type.

    ``loss`` is a 0-d tensor: ``Σ_k w_k·mean_B(L_k)``; metrics are detached 0-d means over the pairs
    (:data:`METRICS`). Raises ``ValueError`` listing every problem of the options and inputs.
    """
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    problems = check_options(
        loss_types,
        loss_weights,
        beta=beta,
        label_smoothing=label_smoothing,
        f_divergence=f_divergence,
        weighted=pair_weights is not None,
    )
    needs_counts = [t for t in loss_types if t in ("ipo", "sigmoid_norm")]
    if needs_counts and (chosen_tokens is None or rejected_tokens is None):
        problems.append(
            f"{', '.join(needs_counts)} need chosen_tokens and rejected_tokens (completion lengths)"
        )
    if "sft" in loss_types and (chosen_token_logps is None or chosen_mask is None):
        problems.append("sft needs chosen_token_logps and chosen_mask")
    batch = chosen_logps.shape
    if len(batch) != 1:
        problems.append(f"chosen_logps must be [B], got shape {tuple(batch)}")
    for name, t in (
        ("rejected_logps", rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
        ("chosen_tokens", chosen_tokens),
        ("rejected_tokens", rejected_tokens),
        ("pair_weights", pair_weights),
    ):
        if t is not None and t.shape != batch:
            problems.append(f"{name} has shape {tuple(t.shape)}, expected {tuple(batch)}")
    if problems:
        raise ValueError("preference_loss: " + "; ".join(problems))

    # :1350-1383
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = _scores(chosen_logratios, f_divergence, f_alpha)
    rejected_scores = _scores(rejected_logratios, f_divergence, f_alpha)
    delta_score = chosen_scores - rejected_scores

    loss = 0.0
    for loss_type, loss_weight in zip(loss_types, loss_weights, strict=True):
        per_sequence_loss = _per_pair(
            loss_type,
            beta=beta,
            label_smoothing=label_smoothing,
            discopop_tau=discopop_tau,
            delta_score=delta_score,
            chosen_scores=chosen_scores,
            rejected_scores=rejected_scores,
            chosen_logratios=chosen_logratios,
            rejected_logratios=rejected_logratios,
            logps=(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps),
            tokens=(chosen_tokens, rejected_tokens),
            chosen_token_logps=chosen_token_logps,
            chosen_mask=chosen_mask,
        )
        if pair_weights is not None:
            per_sequence_loss = per_sequence_loss * pair_weights
        loss = loss + per_sequence_loss.mean() * loss_weight

    # :1571-1591
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }
    return loss, metrics


def _per_pair(
    loss_type: str,
    *,
    beta: float,
    label_smoothing: float,
    discopop_tau: float,
    delta_score: torch.Tensor,
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    logps: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tokens: tuple[torch.Tensor | None, torch.Tensor | None],
    chosen_token_logps: torch.Tensor | None,
    chosen_mask: torch.Tensor | None,
) -> torch.Tensor:
    """``L [B]`` of one loss type (:1387-1513, TRL's operations in TRL's order)."""
    z = beta * delta_score
    if loss_type == "sigmoid":
        return -F.logsigmoid(z)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type in ("ipo", "sigmoid_norm"):
        chosen_tokens, rejected_tokens = tokens
        chosen_avg = chosen_scores / chosen_tokens.to(chosen_scores.dtype).clamp(min=1.0)
        rejected_avg = rejected_scores / rejected_tokens.to(rejected_scores.dtype).clamp(min=1.0)
        if loss_type == "ipo":
            return (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
        return -F.logsigmoid(beta * (chosen_avg - rejected_avg))
    if loss_type == "exo_pair":
        epsilon = torch.tensor(label_smoothing, device=z.device)
        log_pw, log_pl = torch.log1p(-epsilon), torch.log(epsilon)
        return torch.sigmoid(z) * (F.logsigmoid(z) - log_pw) + torch.sigmoid(-z) * (F.logsigmoid(-z) - log_pl)
    if loss_type == "nca_pair":
        chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
        return (
            -F.logsigmoid(chosen_rewards)
            - 0.5 * F.logsigmoid(-chosen_rewards)
            - 0.5 * F.logsigmoid(-rejected_rewards)
        )
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(z)
        flipped = -label_smoothing * F.logsigmoid(-z)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-(beta * rejected_logratios))
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type in SORTING_LOSS_TYPES:
        if loss_type == "aot":
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps = logps
            a, b = chosen_logps - rejected_logps, ref_chosen_logps - ref_rejected_logps
        else:
            a, b = chosen_logratios, rejected_logratios
        delta = torch.sort(a, dim=0)[0] - torch.sort(b, dim=0)[0]
        return (
            -F.logsigmoid(beta * delta) * (1 - label_smoothing)
            - F.logsigmoid(-beta * delta) * label_smoothing
        )
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_logratios) + (
            1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
        )
    if loss_type == "discopop":
        modulation = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation
    # sft (:1496-1503): one token mean for the batch, repeated per pair so that the mean over pairs is it
    batch_loss = -chosen_token_logps[chosen_mask.bool()].mean()
    return batch_loss.expand(chosen_token_logps.size(0))
