"""A preference tenant's settings and rows (``Tenant.pref``, :class:`~mlora_lab.spec.parts.Preference`).

    check_pref_fields(ctx, t)   every field, the loss options together (TRL's own refusals), and what a
                                preference tenant cannot be beside: RL, a Tinker client, packing
    check_pairs(ctx, t)         every problem of every row of its data, read as preference pairs

The options are checked by :func:`mlora_lab.rl.preference.check_options`, the engine's own list of what TRL
1.16's ``DPOTrainer`` refuses, so that validation and training never disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlora_lab.sources import memory_kind
from mlora_lab.spec.fields import FieldInfo, fields_info
from mlora_lab.spec.parts import (
    CPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    METHOD_FIELDS,
    PREFERENCE_LOSS_TYPES,
    Preference,
)
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, is_finite
from mlora_lab.validate.context import Context, got, usable_path


def check_pref_fields(ctx: Context, t: Tenant, check_field: Any) -> bool:
    """``t.pref``'s fields (``check_field``: the validator's field check), then the options together. Whether
    it passed."""
    pref = t.pref
    if pref is None:
        return True
    if not isinstance(pref, Preference):
        ctx.say(
            t,
            "pref",
            f"pref must be preference settings (an object, e.g. {{'beta': 0.1}}) or null ({got(pref)})",
        )
        return False
    before = len(ctx.out)
    ok: dict[str, bool] = {}
    for name, info in fields_info(Preference):
        value, label = getattr(pref, name), f"pref.{name}"
        if name == "loss_type":
            ok[name] = _loss_types(ctx, t, value, label, pref.method)
        elif name == "loss_weights":
            ok[name] = _weights(ctx, t, value, info, label)
        else:
            ok[name] = check_field(ctx, t, "pref", value, info, label=label)
    if all(ok.values()):
        for problem in _option_problems(pref):
            ctx.say(t, "pref", f"pref: {problem}")
        if pref.method == "kto" and pref.loss_types == ["kto"] and t.batch_size == 1:
            ctx.say(
                t,
                "batch_size",
                "KTO's KL estimate pairs each row's prompt with another row's completion of its micro-batch: "
                "batch_size must be at least 2 (TRL refuses 1 too), or use loss_type 'apo_zero_unpaired'",
            )
    if is_finite(t.dropout) and t.dropout > 0:
        ctx.say(
            t,
            "dropout",
            f"dropout = {t.dropout:g} in a preference tenant: TRL's preference trainers turn dropout off "
            "(disable_dropout=True), so that the policy and its reference differ by the adapter alone; set it to 0",
        )
    if t.rl is not None:
        ctx.say(t, "pref", "a tenant learns from rewards (rl) or from preference pairs (pref), not both")
    if t.client is not None:
        ctx.say(
            t,
            "pref",
            "a tenant driven by a Tinker client has no pref settings (its client computes its losses)",
        )
    if pref.reference == "init_adapter" and t.init_adapter is None:  # (None: "base" without an init adapter)
        ctx.say(
            t,
            "pref",
            "pref.reference = 'init_adapter' needs the tenant's init_adapter (the adapter it starts from, "
            "frozen as the reference); give one, or use reference 'base'",
        )
    if t.heldout_data is not None and pref.method == "kto":
        ctx.say(
            t,
            "heldout_data",
            "a KTO tenant has no heldout_data yet (its held-out loss needs a KL estimate of its own): its progress "
            "is its rewards/margins and kl; remove it",
        )
    if ctx.spec.packing:
        ctx.say(
            t,
            "pref",
            "packing joins rows into one sequence, but a preference tenant's pair is two sequences scored "
            "apart: turn packing off in a job with preference tenants",
        )
    return len(ctx.out) == before


def _option_problems(pref: Preference) -> list[str]:
    """The options together, by the engine's own checks (they import torch), and what does not apply to the
    method (a reference for ORPO or CPO, several loss types outside DPO, ...)."""
    from mlora_lab.rl import preference, preference_free

    if pref.method == "dpo":
        return _unused(pref) + preference.check_options(
            pref.loss_types,
            pref.loss_weights,
            beta=pref.beta,
            label_smoothing=pref.label_smoothing,
            f_divergence=pref.f_divergence_type,
            ld_alpha=pref.ld_alpha,
        )
    problems = []
    if pref.method == "kto":
        if len(pref.loss_types) > 1:
            problems.append("kto takes one loss_type (a list of them is DPO's)")
        else:
            problems += preference_free.check_kto_options(
                pref.loss_types[0],
                beta=pref.beta,
                desirable_weight=pref.desirable_weight,
                undesirable_weight=pref.undesirable_weight,
            )
    elif pref.method == "orpo":
        problems += preference_free.check_orpo_options(beta=pref.beta)
        if pref.loss_types != ["sigmoid"]:
            problems.append(
                f"orpo has one loss, its odds ratio: leave loss_type unset (got {pref.loss_type!r})"
            )
    else:
        if len(pref.loss_types) > 1:
            problems.append("cpo takes one loss_type (a list of them is DPO's)")
        else:
            problems += preference_free.check_cpo_options(
                pref.loss_types[0],
                beta=pref.beta,
                label_smoothing=pref.label_smoothing,
                cpo_alpha=pref.cpo_alpha,
            )
    return problems + _unused(pref)


def _unused(pref: Preference) -> list[str]:
    """The fields set (not at their default) that ``pref.method`` does not read (:data:`METHOD_FIELDS`)."""
    reads = {"method", "loss_type", "beta", *METHOD_FIELDS.get(pref.method, ())}
    unused = [
        f.name
        for f in dataclasses.fields(Preference)
        if f.name not in reads and getattr(pref, f.name) != f.default
    ]
    if not unused:
        return []
    whose = {n: [m for m, names in METHOD_FIELDS.items() if n in names] for n in unused}
    said = "; ".join(f"{n} is {' and '.join(whose[n]) or 'no method'}'s" for n in unused)
    return [
        f"{pref.method} does not read {', '.join(unused)} ({said}): leave {'them' if len(unused) > 1 else 'it'} unset"
    ]


def _loss_types(ctx: Context, t: Tenant, v: Any, label: str, method: Any = "dpo") -> bool:
    if v is None:  # (the method's default)
        return True
    values = v if isinstance(v, list | tuple) else [v]
    if not values or not all(isinstance(x, str) and x for x in values):
        ctx.say(t, "pref", f"{label} must be a loss type or a non-empty list of them ({got(v)})")
        return False
    method = method if isinstance(method, str) else "dpo"  # (a hostile method is its own field's problem)
    offered, whose = {
        "cpo": (CPO_LOSS_TYPES, "CPOTrainer"),
        "kto": (KTO_LOSS_TYPES, "KTOTrainer"),
    }.get(method, (PREFERENCE_LOSS_TYPES, "DPOTrainer"))
    unknown = [x for x in values if x not in offered]
    if unknown and method != "orpo":  # (orpo's one loss: said with the options)
        ctx.say(
            t,
            "pref",
            f"{label}: unknown loss type(s) {', '.join(brief(x) for x in unknown)}; offered (TRL 1.16's "
            f"{whose}): {', '.join(offered)}",
        )
        return False
    if len(set(values)) != len(values):
        ctx.say(t, "pref", f"{label} names a loss type twice ({', '.join(values)}); weigh it instead")
        return False
    return True


def _weights(ctx: Context, t: Tenant, v: Any, info: FieldInfo, label: str) -> bool:
    if v is None:
        return True
    if isinstance(v, list | tuple) and v and all(is_finite(x) and not isinstance(x, bool) for x in v):
        return True
    ctx.say(t, "pref", f"{label} must be a non-empty list of finite numbers or null ({got(v)})")
    return False


def check_pairs(ctx: Context, t: Tenant) -> None:
    """Every problem of the preference tenant's ``data`` and ``heldout_data`` rows
    (:func:`mlora_lab.rl.pairs.scan_pairs`)."""
    from mlora_lab.rl.pairs import scan_pairs  # (the rl package imports torch)

    for name in ("data", "heldout_data"):
        source = getattr(t, name)
        if source is None or (memory_kind(source) is None and not usable_path(source)):
            continue  # (a type or path problem, reported with the fields)
        path = source if isinstance(source, str) else None
        for problem in scan_pairs(source, unpaired=getattr(t.pref, "method", None) == "kto")[0]:
            ctx.say(t, name, f"{name}: {problem}", path=path)
