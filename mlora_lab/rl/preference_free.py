"""Reference-free and unpaired preference losses, as TRL 1.16.0's ``ORPOTrainer``, ``CPOTrainer`` (CPO, SimPO,
AlphaPO) and ``KTOTrainer`` compute them.

Every formula is a line of TRL 1.16.0, done with the same torch operations in the same order, so that
``tests/rl/test_preference_free.py`` finds each trainer's own ``compute_loss`` loss, LoRA gradients and logged
metrics on the same batch. Lines are cited as ``orpo:NNN`` (``trl/experimental/orpo/orpo_trainer.py``),
``cpo:NNN`` (``trl/experimental/cpo/cpo_trainer.py``) and ``kto:NNNN`` (``trl/trainer/kto_trainer.py``).
Nothing here knows processes, devices, tokenisation or where the reference log-probs come from.

Per-token log-probs ``ℓ_t`` ``[B, T]`` are the next-token log-probs of a row (``ℓ_t = log p(x_{t+1} | x_{≤t})``)
and a mask ``m`` ``[B, T]`` is aligned with them (``mask[:, 1:]`` of a mask over the tokens).

**ORPO** (no reference; orpo:670-702, :799-848). With the completions' *average* log-probs
``ā = Σ_t m_t ℓ_t / Σ_t m_t`` (:func:`masked_logps` with ``average=True``), cast to float32 as TRL does:

    log_odds = (ā_w − ā_l) − (log(1 − e^{ā_w}) − log(1 − e^{ā_l}))
    loss     = NLL_w − β · mean_B(log σ(log_odds))

``NLL_w`` is the token mean of ``−ℓ_t`` over the chosen rows' *prompt and completion* (every attended token
after the first, :func:`token_mean_nll` over ``attention_mask[:, 1:]``), pooled over the batch.

**CPO / SimPO / AlphaPO** (no reference; cpo:678-750, :842-890). ``ℓ`` is the completion's log-prob sum
(sigmoid, hinge) or average (ipo, simpo; :data:`CPO_AVERAGED_LOSS_TYPES`). The reward is ``r = ℓ``, or with
AlphaPO's ``α ≠ 0`` ``r = (1 − p^{−α})/α``, ``p = e^ℓ``. With ``z = r_w − r_l`` and label smoothing ``ε``:

==========  ======================================================================
sigmoid     ``−(1−ε) log σ(βz) − ε log σ(−βz)`` (CPO)
simpo       the same with ``z − γ/β`` for ``z`` (SimPO's target margin ``γ``)
hinge       ``relu(1 − βz)``
ipo         ``(z − 1/(2β))²``
==========  ======================================================================

``loss = mean_B(L) + λ·NLL_w`` with ``λ = cpo_alpha`` and ``NLL_w`` the token mean of ``−ℓ_t`` over the chosen
rows' *completions* pooled over the batch (TRL skips it, and logs 0, when ``λ = 0``). AlphaPO is TRL's
``loss_type="alphapo"``: simpo with ``cpo_alpha = 0`` and ``alpha ≠ 0``.

**KTO** (unpaired rows with a reference, kto:1370-1548). ``n`` rows with labels ``y_i`` (desirable or not),
``u_i = ℓ_i − ℓ^ref_i`` from completion log-prob sums. The KL estimate, from each row's prompt with another
row's completion (TRL rotates the completions within the batch, :func:`mlora_lab.rl.pairs.kl_completion_ids`):
``z₀ = max(0, mean_n(ℓ'_i − ℓ'^ref_i))`` without gradient (0 for ``apo_zero_unpaired``). Per row:

=====================  =========================================  ======================================
loss type              desirable (weight ``λ_D``)                 undesirable (weight ``λ_U``)
=====================  =========================================  ======================================
kto                    ``1 − σ(β(u − z₀))``                        ``1 − σ(β(z₀ − u))``
apo_zero_unpaired      ``1 − σ(βu)``                               ``σ(βu)``
=====================  =========================================  ======================================

``loss = nanmean(λ_D·L_D ‖ λ_U·L_U)`` over all ``n`` rows (desirable first).

Metrics carry TRL's names: ORPO's :data:`ORPO_METRICS`, CPO's :data:`CPO_METRICS`, KTO's :data:`KTO_METRICS`
(the reward of a row is ``β·r``, ``β·ℓ`` for ORPO, ``β·u`` for KTO). Left out everywhere: ``logits/chosen``,
``logits/rejected`` (means over TRL's own padded logits, or its fused head's), KTO's ``entropy`` and
``num_tokens``: they describe the forward, not the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# CPO_LOSS_TYPES (cpo:735-736, what CPOTrainer.cpo_loss accepts) and KTO_LOSS_TYPES (KTOConfig.loss_type's
# choices) are the spec's: one list for the engine and the checks of job.json
from mlora_lab.spec.parts import CPO_LOSS_TYPES, KTO_LOSS_TYPES

# cpo:850, the loss types fed average (not summed) completion log-probs
CPO_AVERAGED_LOSS_TYPES = ("ipo", "simpo")
_REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_METRICS = (*_REWARD_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
CPO_METRICS = (*_REWARD_METRICS, "nll_loss")
KTO_METRICS = (
    "kl",
    "rewards/chosen",
    "logps/chosen",
    "rewards/rejected",
    "logps/rejected",
    "rewards/margins",
)


def masked_logps(token_logps: torch.Tensor, mask: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """``[B]``: ``Σ_t m_t ℓ_t``, or with ``average`` ``Σ_t m_t ℓ_t / Σ_t m_t``, of ``[B, T]`` per-token log-probs
    and their mask (TRL's ``get_batch_logps``, orpo:705-743, cpo:752-792). A row whose mask is empty averages to
    NaN, as in TRL."""
    mask = mask.bool()
    summed = (token_logps * mask).sum(-1)
    return summed / mask.sum(-1) if average else summed


def token_mean_nll(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d: ``−Σ_{b,t} m_{b,t} ℓ_{b,t} / Σ_{b,t} m_{b,t}``, the mean NLL of every masked token of the batch pooled
    (``nn.CrossEntropyLoss`` over flattened rows with ignored labels, orpo:779-800, cpo:826-845). Pass the chosen
    rows only: their ``attention_mask[:, 1:]`` for ORPO (prompt and completion), their completion mask for CPO."""
    mask = mask.to(token_logps.dtype)
    return -(token_logps * mask).sum() / mask.sum()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − e^x)`` for ``x < 0``, branching at ``−log 2`` against cancellation (orpo:87-91)."""
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _shape_problems(batch: torch.Size, named: dict[str, torch.Tensor | None]) -> list[str]:
    problems = [] if len(batch) == 1 else [f"expected [B] log-probs, got shape {tuple(batch)}"]
    for name, t in named.items():
        if t is not None and t.shape != batch:
            problems.append(f"{name} has shape {tuple(t.shape)}, expected {tuple(batch)}")
    return problems


def check_orpo_options(*, beta: float) -> list[str]:
    """Every problem with ORPO's options at once (empty when they make sense)."""
    if not beta >= 0:  # β weighs the odds-ratio term; β < 0 would reward the rejected completion
        return [f"beta must be ≥ 0 (0 leaves only the NLL), got {beta!r}"]
    return []


def orpo_loss(
    chosen_logps_mean: torch.Tensor,
    rejected_logps_mean: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one batch of ``B`` pairs, as TRL 1.16.0's ``ORPOTrainer.get_batch_loss_metrics``.

    ``chosen_logps_mean``, ``rejected_logps_mean`` ``[B]``: the policy's average completion log-probs
    (:func:`masked_logps` with ``average=True``, with gradient; each < 0, or ``log(1 − e^ā)`` is infinite);
    ``chosen_nll`` 0-d: :func:`token_mean_nll` of the chosen rows over their prompt and completion. ``beta`` is
    ORPO's λ (``ORPOConfig.beta``, its default). ``loss = NLL_w − β·mean_B(log σ(log_odds))``; the log-odds are
    computed in float32 as TRL does (orpo:691-692), whatever the inputs' dtype.

    Metrics (orpo:853-869), detached 0-d: :data:`ORPO_METRICS`, with ``rewards/* = β·ā``, ``nll_loss = NLL_w``,
    ``log_odds_ratio = mean_B(log σ(log_odds))`` and ``log_odds_chosen = mean_B(log_odds)`` (TRL's names, as
    swapped as they look). Raises ``ValueError`` listing every problem of the options and inputs.
    """
    problems = check_orpo_options(beta=beta) + _shape_problems(
        chosen_logps_mean.shape, {"rejected_logps_mean": rejected_logps_mean}
    )
    if chosen_nll.dim() != 0:
        problems.append(f"chosen_nll must be 0-d, got shape {tuple(chosen_nll.shape)}")
    if problems:
        raise ValueError("orpo_loss: " + "; ".join(problems))

    # orpo:691-702, in float32 (TRL casts whatever the model's dtype)
    chosen, rejected = chosen_logps_mean.float(), rejected_logps_mean.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    losses = beta * ratio
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    loss = chosen_nll - losses.mean()  # orpo:848

    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        # the metrics' log-probs are TRL's before the float32 cast (orpo:859-860)
        "logps/chosen": chosen_logps_mean.detach().mean(),
        "logps/rejected": rejected_logps_mean.detach().mean(),
        "nll_loss": chosen_nll.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    }
    return loss, metrics


def check_cpo_options(
    loss_type: str,
    *,
    beta: float,
    label_smoothing: float,
    cpo_alpha: float,
) -> list[str]:
    """Every problem with CPO's options at once (empty when they make sense). Stricter than ``CPOTrainer``,
    which only warns that hinge and ipo ignore ``label_smoothing``."""
    problems = []
    if loss_type == "alphapo":
        problems.append("alphapo is loss_type='simpo' with cpo_alpha=0 and alpha ≠ 0 (as CPOConfig maps it)")
    elif loss_type not in CPO_LOSS_TYPES:
        problems.append(f"unknown loss type {loss_type!r}; offered: {', '.join(CPO_LOSS_TYPES)}")
    if not beta > 0:  # simpo and ipo divide by β; β = 0 makes every loss constant
        problems.append(f"beta must be > 0, got {beta!r}")
    if loss_type in ("hinge", "ipo") and label_smoothing != 0:
        problems.append(f"{loss_type} ignores label_smoothing (got {label_smoothing!r}); set it to 0")
    elif not 0 <= label_smoothing < 0.5:  # at 0.5 the loss no longer tells chosen from rejected
        problems.append(f"label_smoothing must lie in [0, 0.5), got {label_smoothing!r}")
    if not cpo_alpha >= 0:
        problems.append(f"cpo_alpha (the NLL term's weight) must be ≥ 0, got {cpo_alpha!r}")
    return problems


def cpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_nll: torch.Tensor | None = None,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one batch of ``B`` pairs, as TRL 1.16.0's ``CPOTrainer.get_batch_loss_metrics``.

    ``chosen_logps``, ``rejected_logps`` ``[B]``: the policy's completion log-probs (with gradient), summed for
    sigmoid and hinge, averaged for :data:`CPO_AVERAGED_LOSS_TYPES` (:func:`masked_logps`). ``chosen_nll`` 0-d:
    :func:`token_mean_nll` of the chosen rows' completions, needed when ``cpo_alpha ≠ 0``. ``simpo_gamma`` counts
    for simpo only; ``alpha ≠ 0`` is AlphaPO's reward for every loss type. Defaults are ``CPOConfig``'s.

    ``loss = mean_B(L) + cpo_alpha·NLL_w`` (the module's table). Metrics (cpo:893-912), detached 0-d:
    :data:`CPO_METRICS` with ``rewards/* = β·r`` and ``nll_loss = NLL_w`` (0 when ``cpo_alpha = 0``). Raises
    ``ValueError`` listing every problem of the options and inputs.
    """
    problems = check_cpo_options(loss_type, beta=beta, label_smoothing=label_smoothing, cpo_alpha=cpo_alpha)
    problems += _shape_problems(chosen_logps.shape, {"rejected_logps": rejected_logps})
    if cpo_alpha != 0 and chosen_nll is None:
        problems.append("cpo_alpha ≠ 0 needs chosen_nll")
    if chosen_nll is not None and chosen_nll.dim() != 0:
        problems.append(f"chosen_nll must be 0-d, got shape {tuple(chosen_nll.shape)}")
    if problems:
        raise ValueError("cpo_loss: " + "; ".join(problems))

    # cpo:697-709
    if alpha != 0.0:
        chosen_r = (1 - torch.exp(chosen_logps).pow(-alpha)) / alpha
        rejected_r = (1 - torch.exp(rejected_logps).pow(-alpha)) / alpha
    else:
        chosen_r, rejected_r = chosen_logps, rejected_logps
    logits = chosen_r - rejected_r

    # cpo:715-737
    if loss_type in ("simpo", "sigmoid"):
        if loss_type == "simpo":
            logits = logits - simpo_gamma / beta
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo
        losses = (logits - 1 / (2 * beta)) ** 2

    # cpo:842-843: TRL's NLL is a float32 zero, not computed, when its weight is 0
    nll = torch.zeros((), device=chosen_logps.device) if cpo_alpha == 0 else chosen_nll
    loss = losses.mean() + cpo_alpha * nll  # cpo:890

    chosen_rewards, rejected_rewards = beta * chosen_r.detach(), beta * rejected_r.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
        "nll_loss": nll.detach(),
    }
    return loss, metrics


def check_kto_options(
    loss_type: str,
    *,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> list[str]:
    """Every problem with KTO's options at once (empty when they make sense). ``KTOTrainer`` checks only the
    loss type; it also warns when the weights do not balance the dataset's labels (KTO paper Eq. 8), a property
    of the data that is left to the caller."""
    problems = []
    if loss_type not in KTO_LOSS_TYPES:
        problems.append(f"unknown loss type {loss_type!r}; offered: {', '.join(KTO_LOSS_TYPES)}")
    if not beta > 0:  # every loss is a sigmoid of β·(…): β = 0 makes it constant
        problems.append(f"beta must be > 0, got {beta!r}")
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not weight >= 0:
            problems.append(f"{name} must be ≥ 0, got {weight!r}")
    if desirable_weight == 0 and undesirable_weight == 0:
        problems.append("desirable_weight and undesirable_weight are both 0: nothing would be learnt")
    return problems


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl_logps: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    *,
    loss_type: str = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one batch of ``n`` unpaired rows, as TRL 1.16.0's ``KTOTrainer._compute_loss``.

    ``kl`` (0-d, already clamped at 0): the batch's KL estimate ``z₀`` when it was computed elsewhere (over a
    batch shared by several processes, each holding some of its rows); ``kl_logps`` and ``ref_kl_logps`` are
    then not needed, and a process may hold a single row.

    ``logps`` ``[n]``: the policy's completion log-prob sums (with gradient); ``ref_logps`` ``[n]`` the
    reference's; ``labels`` ``[n]`` bool, True for a desirable completion. ``kl_logps``, ``ref_kl_logps``
    ``[n]``: the policy's and reference's log-prob sums of the mismatched completions (KTO's KL rows, the batch's
    own completions rotated by one; needed for ``kto``, which needs ``n > 1`` as TRL refuses a batch of one, whose
    KL row is its own row). Defaults are ``KTOConfig``'s.

    The KL estimate ``z₀ = max(0, mean_n(ℓ' − ℓ'^ref))`` is this batch's (TRL averages it over processes
    before the clamp, kto:1443-1444). ``loss = nanmean(λ_D·L_D ‖ λ_U·L_U)``, the module's table.

    Metrics (kto:1484-1546), detached 0-d: ``kl = z₀`` always; ``rewards/chosen = Σ_D β u / n_D`` and
    ``logps/chosen = Σ_D ℓ / n_D`` only when the batch has desirable rows; ``rewards/rejected``, ``logps/rejected``
    likewise; ``rewards/margins`` the difference of the two when both are there (TRL logs nothing for an absent
    side). Raises ``ValueError`` listing every problem of the options and inputs.
    """
    problems = check_kto_options(
        loss_type, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight
    )
    problems += _shape_problems(
        logps.shape,
        {"ref_logps": ref_logps, "labels": labels, "kl_logps": kl_logps, "ref_kl_logps": ref_kl_logps},
    )
    if labels.dtype != torch.bool:
        problems.append(f"labels must be bool, got {labels.dtype}")
    calculate_kl = loss_type != "apo_zero_unpaired" and kl is None  # kto:815 (or given)
    if calculate_kl and (kl_logps is None or ref_kl_logps is None):
        problems.append(f"{loss_type} needs kl_logps and ref_kl_logps (the mismatched completions')")
    if calculate_kl and logps.dim() == 1 and logps.shape[0] <= 1:  # kto:844-847
        problems.append(f"{loss_type} needs more than one row (a single row's KL row is the row itself)")
    if problems:
        raise ValueError("kto_loss: " + "; ".join(problems))

    chosen_idx = torch.nonzero(labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~labels, as_tuple=False).view(-1)
    chosen_logps, rejected_logps = logps.index_select(0, chosen_idx), logps.index_select(0, rejected_idx)
    ref_chosen_logps = ref_logps.index_select(0, chosen_idx)
    ref_rejected_logps = ref_logps.index_select(0, rejected_idx)

    # kto:1442-1445
    if calculate_kl:
        kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    elif kl is None or loss_type == "apo_zero_unpaired":
        kl = torch.zeros(1, device=logps.device)
    else:
        kl = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach()

    # kto:1447-1482; an absent side contributes nothing (TRL's empty tensors)
    empty = logps.new_empty(0)
    chosen_losses = rejected_losses = chosen_rewards = rejected_rewards = empty
    if chosen_idx.numel():
        chosen_logratios = chosen_logps - ref_chosen_logps
        if loss_type == "kto":
            chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
        else:
            chosen_losses = 1 - F.sigmoid(beta * chosen_logratios)
        chosen_rewards = beta * chosen_logratios.detach()
    if rejected_idx.numel():
        rejected_logratios = rejected_logps - ref_rejected_logps
        if loss_type == "kto":
            rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
        else:
            rejected_losses = F.sigmoid(beta * rejected_logratios)
        rejected_rewards = beta * rejected_logratios.detach()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    loss = losses.nanmean()  # kto:1548

    metrics = {"kl": kl.reshape(())}
    if chosen_idx.numel():
        metrics["rewards/chosen"] = chosen_rewards.nansum() / chosen_idx.numel()
        metrics["logps/chosen"] = chosen_logps.detach().nansum() / chosen_idx.numel()
    if rejected_idx.numel():
        metrics["rewards/rejected"] = rejected_rewards.nansum() / rejected_idx.numel()
        metrics["logps/rejected"] = rejected_logps.detach().nansum() / rejected_idx.numel()
    if chosen_idx.numel() and rejected_idx.numel():
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics
