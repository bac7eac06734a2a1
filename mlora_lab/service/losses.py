"""Tinker's built-in losses, as the service computes them from one forward of the shared base.

The ``tinker`` SDK (0.38.0) names the losses (``types/loss_fn_type.py``) but documents no formula; the
formulas are Tinker's public docs, https://tinker-docs.thinkingmachines.ai/losses (the same text as
``thinking-machines-lab/tinker-cookbook:docs/losses.mdx``), mapped in the project's notes on the protocol
(§4). A ``forward_backward`` request carries a loss name, a ``loss_fn_config`` of floats and, per datum,
``loss_fn_inputs``: tensors of shape ``[N]``, ``N`` the datum's target positions (its ``model_input``
length), position ``t`` holding what the model should predict after ``model_input[: t + 1]``.

Per datum, over target positions ``t``:

* ``lp_t``: the learner's log-prob of ``target_tokens[t]`` (with grad; also what the request returns as the
  datum's ``logprobs`` output);
* ``q_t = loss_fn_inputs["logprobs"][t]``: the sampler's log-prob of the same token;
* ``A_t = advantages[t]``, ``w_t = weights[t]``;
* ``r_t = exp(lp_t − q_t)``, ``clip(r) = min(max(r, lo), hi)`` with ``lo``/``hi`` the config's
  ``clip_low_threshold``/``clip_high_threshold`` (ratio bounds, not ε: the docs fix ε_low = ε_high = 0.2,
  so the defaults are 0.8 and 1.2); ``sg`` is stop-gradient (``detach``).

Every loss is a **sum over tokens and over datums, never normalised** (the returned metric is ``loss:sum``,
and the SDK sums it over chunks):

===================  ===================================  ===========================  ===================================
loss_fn              per-token loss ``ℓ_t``               ``∂L/∂lp_t``                 loss_fn_config (default)
===================  ===================================  ===========================  ===================================
cross_entropy        ``−lp_t·w_t``                        ``−w_t``                     none
importance_sampling  ``−r_t·A_t``                         ``−r_t·A_t``                 none
ppo                  ``−min(r_t·A_t, clip(r_t)·A_t)``     ``−r_t·A_t``, or 0 (below)   ``clip_low_threshold`` (0.8),
                                                                                       ``clip_high_threshold`` (1.2)
cispo                ``−sg(clip(r_t))·lp_t·A_t``          ``−clip(r_t)·A_t``           as ppo
gspo                 ``−min(s_t·A_t, clip(s_t)·A_t)``     ``−s·A_t``, or 0 (below)     as ppo
dro                  ``−(lp_t·A_t − ½·β·(lp_t − q_t)²)``  ``−A_t + β·(lp_t − q_t)``    ``beta`` (required: see below)
===================  ===================================  ===========================  ===================================

``gspo`` (GSPO, Zheng et al. 2025, in the GSPO-token form of Tinker's docs,
https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo) clips one ratio per datum, the geometric mean of
its token ratios over the positions ``M`` that its ``sequence_ratio_mask`` input marks (``≠ 0``):
``s = exp(Σ_{t∈M}(lp_t − q_t) / |M|)`` (``s = 1`` when ``M`` is empty), carried by every token with its own
log-prob's gradient, ``s_t = sg(s)·exp(lp_t − sg(lp_t))`` (value ``s``, ``∂s_t/∂lp_t = s``). The mask is
required: Tinker's docs give no default, and a guess (every position? those with ``A_t ≠ 0``?) would change
``s`` silently.

``ppo``'s gradient is 0 where the clipped term is the min and constant: ``r_t > hi`` with ``A_t > 0``, or
``r_t < lo`` with ``A_t < 0`` (the ratio moved past the bound in the direction the advantage favours).
Elsewhere the two terms are equal (``lo ≤ r_t ≤ hi``) or the unclipped one is the min, and it is ``−r_t·A_t``.
``gspo``'s likewise with ``s`` for ``r_t``: one ratio for the whole datum, so a sequence whose ratio moved
past a bound stops moving as a whole.

``cross_entropy`` takes any real weights, negative ones too: the SDK's ``forward_backward_custom`` sends
``weights = −∂C/∂lp`` for the user's loss ``C``, so that the gradient of ``Σ −lp·w`` is the user's gradient.
The same identity holds for every loss here (``cross_entropy`` with ``w = −∂L/∂lp`` has ``L``'s gradient),
which is how the tests check them. Without ``weights`` it weighs every position 1 (the cookbook always
sends them; the SDK does not say). ``dro``'s ``beta`` has no documented default (the docs' example uses
0.05), so a request without it is refused rather than given a guess.

The other names the SDK knows (``stable_reinforce``, ``custom``) are refused as a user error, as are input
keys a loss does not read (the SDK's dtype table also lists per-token ``clip_low_threshold`` and
``clip_high_threshold``; neither is supported — thresholds go in ``loss_fn_config``). :func:`validate` checks a whole request before any of it runs and raises one
:class:`LossInputError` naming every problem; the server answers it with ``category: "user"``.

Metrics, keyed ``name:reduction`` as the SDK merges them over chunks (``lib/chunked_fwdbwd_helpers.py``):

* ``loss:sum``: ``L`` (every loss; the SDK's custom-loss path pops it from ``cross_entropy``'s answer);
* ``clipped:sum`` and ``tokens:sum`` (``ppo``, ``cispo``, ``gspo``): of the positions with ``A_t ≠ 0``, those
  whose ratio (``gspo``: its datum's ``s``) lies outside ``[lo, hi]``, and all of them — their quotient is the
  clip fraction.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro")
TINKER_LOSS_FNS = (*LOSS_FNS, "stable_reinforce", "custom")  # types/loss_fn_type.py

# loss_fn → (required inputs, optional inputs)
INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ()),
    "ppo": (("target_tokens", "logprobs", "advantages"), ()),
    "cispo": (("target_tokens", "logprobs", "advantages"), ()),
    "gspo": (("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"), ()),
    "dro": (("target_tokens", "logprobs", "advantages"), ()),
}
# loss_fn → {config key: default}; None: required (no documented default)
CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
}
# what the SDK sends (types/datum.py: int64 tokens, float32 values); float64 is accepted from in-process callers
INPUT_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "target_tokens": (torch.int64,),
    "weights": (torch.float32, torch.float64),
    "logprobs": (torch.float32, torch.float64),
    "advantages": (torch.float32, torch.float64),
    "sequence_ratio_mask": (torch.float32, torch.float64),
}
MAX_PROBLEMS = 20  # a hostile request of 10⁴ bad datums gets a readable message, not a megabyte


class LossInputError(ValueError):
    """A request's loss, config or inputs are wrong: the client's fault (Tinker's ``category: "user"``)."""


def _name_problem(loss_fn: object) -> str | None:
    if loss_fn in LOSS_FNS:
        return None
    supported = ", ".join(LOSS_FNS)
    if loss_fn in TINKER_LOSS_FNS:
        return f"loss_fn {loss_fn!r} is not supported by this server; supported: {supported}"
    return f"unknown loss_fn {loss_fn!r}; supported: {supported}"


def config_problems(loss_fn: object, config: Mapping[str, object]) -> tuple[list[str], dict[str, float]]:
    """The problems of a loss name and its ``loss_fn_config``, and the config with its defaults filled in.

    A key the loss does not read, a value that is not a finite number, ``lo < 0``, ``lo > hi``, ``beta < 0``
    and ``dro`` without ``beta`` are problems; so is the name itself when it is not in :data:`LOSS_FNS`
    (then the config is not checked further and the returned config is empty).
    """
    name_problem = _name_problem(loss_fn)
    if name_problem is not None:
        return [name_problem], {}
    allowed = CONFIG[loss_fn]
    problems = []
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes none"
        problems.append(
            f"loss_fn_config keys {', '.join(map(repr, unknown))} are unknown to {loss_fn} ({takes})"
        )
    resolved: dict[str, float] = {}
    for key, default in allowed.items():
        value = config.get(key, default)
        if value is None:
            problems.append(
                f"{loss_fn} needs loss_fn_config {key!r}: Tinker documents no default for it "
                "(its docs' example uses 0.05)"
            )
        elif isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            problems.append(f"loss_fn_config {key!r} must be a finite number, got {value!r}")
        else:
            resolved[key] = float(value)
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and lo < 0:
        problems.append(f"clip_low_threshold must be ≥ 0 (a ratio bound, e.g. 0.8), got {lo!r}")
    if lo is not None and hi is not None and lo > hi:
        problems.append(f"clip_low_threshold {lo!r} is above clip_high_threshold {hi!r}")
    if resolved.get("beta", 0.0) < 0:
        problems.append(f"beta must be ≥ 0, got {resolved['beta']!r}")
    return problems, resolved


def input_problems(
    loss_fn: object, inputs: Mapping[str, object], num_targets: int, vocab_size: int | None = None
) -> list[str]:
    """The problems of one datum's ``loss_fn_inputs`` for ``loss_fn``, ``num_targets`` its target positions.

    Missing or unknown keys (when the loss is known), a value that is not a tensor of shape
    ``[num_targets]`` with the dtype of :data:`INPUT_DTYPES`, non-finite values, and ``target_tokens``
    outside ``[0, vocab_size)`` (when ``vocab_size`` is given). Reads every value once (a device sync for
    tensors not on the CPU: call it on the decoded request, before moving it).
    """
    problems = []
    if loss_fn in INPUTS:
        required, optional = INPUTS[loss_fn]
        missing = [k for k in required if k not in inputs]
        if missing:
            problems.append(f"missing {', '.join(missing)} ({loss_fn} needs {', '.join(required)})")
        unknown = sorted(set(inputs) - set(required) - set(optional))
        if unknown:
            takes = ", ".join((*required, *optional))
            hint = (
                "; clip thresholds go in loss_fn_config"
                if {"clip_low_threshold", "clip_high_threshold"} & set(unknown)
                else ""
            )
            problems.append(f"unknown inputs {', '.join(unknown)} ({loss_fn} takes {takes}{hint})")
    for key, value in inputs.items():
        if key not in INPUT_DTYPES:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key} must be a tensor, got {type(value).__name__}")
            continue
        if tuple(value.shape) != (num_targets,):
            problems.append(f"{key} has shape {list(value.shape)}, expected [{num_targets}] (one per target)")
        dtypes = INPUT_DTYPES[key]
        if value.dtype not in dtypes:
            problems.append(f"{key} must be {' or '.join(str(d) for d in dtypes)}, got {value.dtype}")
        elif value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                problems.append(f"{key} has {bad} non-finite values (NaN or ±inf)")
        elif value.numel():
            low, high = int(value.min()), int(value.max())
            if low < 0 or (vocab_size is not None and high >= vocab_size):
                bounds = f"[0, {vocab_size})" if vocab_size is not None else "≥ 0"
                problems.append(f"{key} must be token ids in {bounds}, got values from {low} to {high}")
    return problems


def validate(
    loss_fn: object,
    config: Mapping[str, object],
    data: Sequence[Mapping[str, object]],
    num_targets: Sequence[int],
    vocab_size: int | None = None,
) -> dict[str, float]:
    """Check a whole request at once; return its config with defaults, or raise one :class:`LossInputError`.

    ``data[i]`` is datum ``i``'s ``loss_fn_inputs`` and ``num_targets[i]`` its target positions (its
    ``model_input`` length). The error names every problem (:func:`config_problems`, then
    :func:`input_problems` per datum, as ``datum i: …``), the first :data:`MAX_PROBLEMS` of them.
    """
    problems, resolved = config_problems(loss_fn, config)
    if len(data) != len(num_targets):
        problems.append(f"{len(data)} datums' inputs for {len(num_targets)} datums")
    for i, (inputs, n) in enumerate(zip(data, num_targets)):
        problems += [f"datum {i}: {p}" for p in input_problems(loss_fn, inputs, n, vocab_size)]
    if problems:
        more = len(problems) - MAX_PROBLEMS
        shown = problems[:MAX_PROBLEMS] + ([f"and {more} more"] if more > 0 else [])
        raise LossInputError("invalid loss request: " + "; ".join(shown))
    return resolved


def datum_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, object],
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``L = Σ_t ℓ_t`` for one datum (see the module docstring), and its metrics.

    ``logprobs [N]``: the learner's ``lp`` (with grad); ``inputs``: the datum's ``loss_fn_inputs`` as
    tensors ``[N]`` (``inputs["logprobs"]`` is the sampler's ``q``), checked beforehand by :func:`validate`;
    ``config``: the ``loss_fn_config`` (defaults filled in here; a bad one raises :class:`LossInputError`).

    The maths is elementwise, so a batch works too: ``logprobs`` and ``inputs`` padded to ``[B, T]`` and
    ``mask [B, T]`` (bool) true on the real positions gives the sum over the batch's datums. The padding
    must hold finite values (zeros will do): a masked position adds nothing, but an infinite one would
    still poison the gradient.

    Returns ``L`` (0-d, with grad, in the promoted dtype of ``logprobs`` and ``inputs``, on the device of
    ``logprobs``: the inputs are moved there) and the metrics as detached 0-d tensors (``float(v)`` each
    when answering; nothing here syncs the device).
    """
    problems, cfg = config_problems(loss_fn, config)
    if problems:
        raise LossInputError(f"{loss_fn!r} loss: " + "; ".join(problems))
    lp = logprobs
    # (the request's inputs arrive on the CPU; the learner's logprobs are on the job's device)
    inputs = {k: v.to(lp.device, non_blocking=True) for k, v in inputs.items()}
    if mask is not None:
        mask = mask.to(lp.device)
    clipped = None
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        per_token = -lp if weights is None else -lp * weights
    else:
        q, adv = inputs["logprobs"], inputs["advantages"]
        if loss_fn == "dro":
            per_token = -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2)
        elif loss_fn == "gspo":
            in_ratio = inputs["sequence_ratio_mask"] != 0
            if mask is not None:
                in_ratio = in_ratio & mask
            # s = exp(mean_{t∈M} sg(lp_t) − q_t), one per datum (the last dimension); 1 where M is empty
            log_s = torch.where(in_ratio, lp.detach() - q, torch.zeros_like(q)).sum(-1, keepdim=True)
            log_s = log_s / in_ratio.sum(-1, keepdim=True).clamp(min=1)
            ratio = torch.exp(log_s + lp - lp.detach())  # s_t: the value s, lp_t's own gradient
            lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
            per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
            clipped = (ratio.detach() < lo) | (ratio.detach() > hi)
        else:
            ratio = torch.exp(lp - q)  # r [N]
            if loss_fn == "importance_sampling":
                per_token = -ratio * adv
            else:
                lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
                clipped_ratio = ratio.clamp(lo, hi)
                if loss_fn == "ppo":
                    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
                else:  # cispo: the clipped ratio is a fixed weight on the policy gradient
                    per_token = -clipped_ratio.detach() * lp * adv
                clipped = (ratio.detach() < lo) | (ratio.detach() > hi)
    if mask is not None:
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = per_token.sum()
    metrics = {"loss:sum": loss.detach()}
    if clipped is not None:
        counted = inputs["advantages"] != 0
        if mask is not None:
            counted = counted & mask
        metrics["clipped:sum"] = (clipped & counted).sum().to(loss.dtype)
        metrics["tokens:sum"] = counted.sum().to(loss.dtype)
    return loss, metrics


def token_weight(
    loss_fn: str, data: Sequence[Mapping[str, torch.Tensor]], num_targets: Sequence[int]
) -> float | None:
    """What a request's ``loss:sum`` is divided by to give its mean per token: ``Σ w`` over its datums'
    positions for ``cross_entropy`` (``w = 1`` without ``weights``), so that ``Σ w·(−lp) / Σ w`` is the mean
    ``−log p`` of the trained tokens for 0/1 weights, whatever scale the client gave them (a batch's
    weights of ``1/n`` sum to 1: its ``loss:sum`` is already that mean). ``None`` for the other losses (a
    sum of ratio-weighted advantages has no such mean) and for weights that are negative (the SDK's custom
    loss sends ``w = −∂C/∂lp``) or sum to 0."""
    if loss_fn != "cross_entropy":
        return None
    total = 0.0
    for inputs, n in zip(data, num_targets):
        weights = inputs.get("weights")
        if weights is None:
            total += n
        elif bool((weights < 0).any()):
            return None
        else:
            total += float(weights.sum())
    return total if total > 0 else None
