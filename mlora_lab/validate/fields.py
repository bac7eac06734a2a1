"""Every field's type and range, from its :class:`~mlora_lab.spec.fields.FieldInfo` (the metadata
the forms build their inputs from); no file is read.

    check_job_fields(ctx)        the JobSpec's own fields (parallel and tenants are checked apart)
    check_tenant_fields(ctx, t)  a Tenant's fields, and the rules that tie two of them together
    check_field(ctx, ...)        one value against its FieldInfo: what the two above (and parallel) use

``report_to`` is checked by :func:`mlora_lab.trackers.report_to_problems`: an unknown tracker, or one
whose package is not installed here (naming the pip extra that installs it).
"""

from __future__ import annotations

import os
from typing import Any

from mlora_lab.lora.targets import ALL_LINEAR
from mlora_lab.sources import memory_kind, source_type_problem
from mlora_lab.spec.fields import (
    MAX_NAME_LEN,
    MAX_ROWS,
    MAX_TARGETS,
    SAFE_NAME,
    FieldInfo,
    field_info,
    fields_info,
)
from mlora_lab.spec.job import JobSpec, valid_targets
from mlora_lab.spec.parts import RL, ClientModel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, is_finite, is_int, path_problem
from mlora_lab.trackers import report_to_problems
from mlora_lab.validate.agents import check_agent, check_agent_field
from mlora_lab.validate.context import Context, bound, got, usable_path
from mlora_lab.validate.pref import check_pref_fields
from mlora_lab.validate.rl import (
    check_importance_sampling,
    check_numbers,
    check_reward_names,
    check_reward_refs,
    check_texts,
)
from mlora_lab.validate.tenants import check_name


def check_job_fields(ctx: Context) -> None:
    """The job's fields (``parallel``, ``service`` and ``tenants`` are checked part by part, in their own phases),
    and an ``output_dir`` that exists as something other than a directory."""
    s = ctx.spec
    for name, info in fields_info(JobSpec):
        if info.kind not in ("tenants", "parallel", "service", "evals"):
            check_field(ctx, None, name, getattr(s, name), info)
    out = s.output_dir
    if usable_path(out) and os.path.exists(out) and not os.path.isdir(out):
        ctx.say(None, "output_dir", f"output_dir {brief(out)} exists and is not a directory")
    if isinstance(s.slot_modules, list | tuple) and not s.slot_modules:  # (the job would fail at start)
        ctx.say(
            None,
            "slot_modules",
            "slot_modules is empty: no layer could take an adapter; leave it unset (the tenants' targets; "
            "in a served job or one without tenants, every linear layer) or name the layers",
        )


def check_tenant_fields(ctx: Context, t: Tenant) -> None:
    """The tenant's fields, then what two of them say together: something to adapt, and a sane number
    of rows per optimizer step."""
    ok = {}
    for name, info in fields_info(Tenant):
        if info.kind == "rl":
            ok[name] = check_rl_fields(ctx, t)
        elif info.kind == "pref":
            ok[name] = check_pref_fields(ctx, t, check_field)
        elif info.kind == "client":
            ok[name] = check_client_fields(ctx, t)
        elif name == "data" and isinstance(t.client, ClientModel):
            ok[name] = t.data == ""  # (a client's tenant has no data: its client sends the rows)
            if not ok[name]:
                ctx.say(
                    t, "data", "a tenant driven by a Tinker client has no data (its client sends the rows)"
                )
        else:
            ok[name] = check_field(ctx, t, name, getattr(t, name), info)
    if ok["target_modules"] and ok["target_parameters"] and not t.target_modules and not t.target_parameters:
        ctx.say(t, "target_modules", "target_modules and target_parameters are both empty; nothing to adapt")
    if ok["batch_size"] and ok["grad_accum"] and t.batch_size * t.grad_accum > MAX_ROWS:
        ctx.say(
            t,
            "batch_size",
            f"batch_size*grad_accum = {t.batch_size}*{t.grad_accum} = {t.batch_size * t.grad_accum:,} "
            f"rows per optimizer step is more than {MAX_ROWS:,} (2**20); lower batch_size or grad_accum",
        )


def check_client_fields(ctx: Context, t: Tenant) -> bool:
    """``t.client``'s fields; a client's tenant is supervised by its client (no ``rl``, no ``heldout_data``), and
    only a served job (``service``) has clients."""
    c = t.client
    if c is None:
        return True
    if not isinstance(c, ClientModel):
        ctx.say(
            t,
            "client",
            f"client must be a Tinker model (an object with 'model_id' and 'owner') or null ({got(c)})",
        )
        return False
    before = len(ctx.out)
    for name, info in fields_info(ClientModel):
        check_field(ctx, t, "client", getattr(c, name), info, label=f"client.{name}")
    if t.rl is not None:
        ctx.say(
            t, "rl", "a tenant driven by a Tinker client has no rl settings (its client computes its losses)"
        )
    if t.heldout_data is not None:
        ctx.say(t, "heldout_data", "a tenant driven by a Tinker client has no heldout_data; remove it")
    if ctx.spec.service is None:
        ctx.say(t, "client", "a tenant driven by a Tinker client needs a served job (service settings)")
    return len(ctx.out) == before


def check_rl_fields(ctx: Context, t: Tenant) -> bool:
    """``t.rl``'s fields against their :class:`~mlora_lab.spec.fields.FieldInfo`, then: a weight per reward,
    a completion that fits ``seq_len`` after at least one prompt token, no ``heldout_data`` (an RL
    tenant is measured by its rewards), and, for now, ``grad_accum`` 1 (one generation per optimizer
    step: what the RL driver, :mod:`mlora_lab.job.drivers.rl`, trains)."""
    rl = t.rl
    if rl is None:
        return True
    if not isinstance(rl, RL):
        ctx.say(t, "rl", f"rl must be RL settings (an object with at least 'reward') or null ({got(rl)})")
        return False
    before = len(ctx.out)
    ok = {}
    for name, info in fields_info(RL):
        value = getattr(rl, name)
        label = f"rl.{name}"
        if info.kind == "rewards":
            if value is None and name == "reward":
                ok[name] = rl.own_reward
                if not ok[name]:
                    ctx.say(t, "rl", "rl.reward is required (the functions that score completions), unless rl.env "
                            "gives each episode's reward (or a harness program does: rl.harness)")  # fmt: skip
            else:
                ok[name] = check_reward_refs(ctx, t, value, label)
        elif info.kind in ("function", "functions", "mapping"):
            ok[name] = check_agent_field(ctx, t, value, info, label)
        elif info.kind == "numbers":
            ok[name] = check_numbers(ctx, t, value, info, label)
        elif info.kind == "texts":
            ok[name] = check_texts(ctx, t, value, info, label)
        else:
            ok[name] = check_field(ctx, t, "rl", value, info, label=label)
    weights = rl.reward_weights
    if ok["reward"] and ok["reward_weights"] and weights is not None and len(weights) != len(rl.rewards):
        ctx.say(
            t,
            "rl",
            f"rl.reward_weights has {len(weights)} weights for {len(rl.rewards)} reward functions; "
            "give one weight per function",
        )
    if ok["reward"] and ok["reward_names"]:
        check_reward_names(ctx, t)
    check_importance_sampling(ctx, t, ok)
    seq_len = ctx.spec.seq_len
    if ok["max_new_tokens"] and is_int(seq_len) and rl.max_new_tokens >= seq_len:
        ctx.say(
            t,
            "rl",
            f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in seq_len={seq_len}; "
            "prompt and completion together fit seq_len",
        )
    if t.heldout_data is not None:
        ctx.say(
            t, "heldout_data", "an RL tenant has no heldout_data (it is measured by its rewards); remove it"
        )
    if rl.agent or rl.env_args or rl.max_staleness:
        check_agent(ctx, t, ok)
    return len(ctx.out) == before


def check_field(
    ctx: Context, owner: Tenant | None, field: str, value: Any, info: FieldInfo, label: str = ""
) -> bool:
    """``value`` of ``field`` checked against its :class:`FieldInfo`; whether it passed. ``label``
    is how messages name the field (``parallel.nproc``), ``field`` by default."""
    label = label or field
    if value is None and info.optional:
        return True
    kind = info.kind
    if kind == "int":
        if info.bool_ok and isinstance(value, bool):
            return True
        hi, hi_name = info.max, ""
        at_most = getattr(ctx.spec, info.at_most, None) if info.at_most else None
        # a bad bound (max_rank=0) is reported on its own field; this one keeps its own bounds
        if is_int(at_most) and field_info(JobSpec, info.at_most).allows(at_most):
            hi, hi_name = at_most, f"{info.at_most}={at_most}"
        return _int(ctx, owner, field, value, info.min, hi, hi_name, label)
    if kind in ("float", "log-float"):
        return _num(ctx, owner, field, value, info, label)
    if kind == "bool":
        return _bool(ctx, owner, field, value, label)
    if kind == "choice":
        return _one_of(ctx, owner, field, value, info.choices, label)
    if kind in ("path", "dir"):
        return _path(ctx, owner, field, value, info, label)
    if kind == "targets":
        return _str_list(ctx, owner, field, value, union=field == "slot_modules", label=label)
    if kind == "pair":
        if not (isinstance(value, tuple | list) and len(value) == 2):
            ctx.say(owner, field, f"{label} must be a pair of numbers {info.rule()} ({got(value)})")
            return False
        return all([_num(ctx, owner, field, v, info, f"{label}[{i}]") for i, v in enumerate(value)])
    if kind == "name":
        return check_name(ctx, value)
    if kind == "trackers":
        problems = report_to_problems(value)
        for problem in problems:
            ctx.say(owner, field, problem)
        return not problems
    if kind == "id":
        return _id(ctx, owner, field, value, label)
    if kind == "text":
        return _text(ctx, owner, field, value, info, label)
    raise ValueError(f"field {field!r} has kind {kind!r}, which has no check")


def _int(
    ctx: Context,
    owner: Tenant | None,
    field: str,
    v: Any,
    lo: float | None,
    hi: float | None,
    hi_name: str = "",
    label: str = "",
) -> bool:
    label = label or field
    if not is_int(v):
        ctx.say(owner, field, f"{label} must be an integer ({got(v)})")
    elif lo is not None and v < lo:
        ctx.say(owner, field, f"{label} must be >= {bound(lo)} (got {brief(v)})")
    elif hi is not None and v > hi:
        ctx.say(owner, field, f"{label} must be <= {hi_name or bound(hi)} (got {brief(v)})")
    else:
        return True
    return False


def _num(ctx: Context, owner: Tenant | None, field: str, v: Any, info: FieldInfo, label: str = "") -> bool:
    """A finite real number within ``info``'s bounds."""
    label = label or field
    if not is_finite(v):
        ctx.say(owner, field, f"{label} must be a finite number ({got(v)})")
    elif not info.allows(v):
        rule = info.rule() + (f" (or null for {info.null_means})" if info.null_means else "")
        ctx.say(owner, field, f"{label} must be {rule} (got {brief(v)})")
    else:
        return True
    return False


def _text(ctx: Context, owner: Tenant | None, field: str, v: Any, info: FieldInfo, label: str = "") -> bool:
    """A line of text people read (a run's name): 1 to ``info.max`` printable characters (no line
    break, control character or lone surrogate: it is shown in labels and messages)."""
    label = label or field
    if not isinstance(v, str):
        ctx.say(owner, field, f"{label} must be a string ({got(v)})")
    elif not v.strip():
        null = f"null for {info.null_means}" if info.null_means else "null"  # (each field's own meaning)
        ctx.say(owner, field, f"{label} is empty; give one, or {null}")
    elif info.max is not None and len(v) > info.max:
        ctx.say(owner, field, f"{label} is {len(v):,} characters long (at most {bound(info.max)})")
    elif not v.isprintable():
        ctx.say(owner, field, f"{label} {brief(v)} holds a line break or another unprintable character")
    else:
        return True
    return False


def _bool(ctx: Context, owner: Tenant | None, field: str, v: Any, label: str = "") -> bool:
    if isinstance(v, bool):
        return True
    ctx.say(owner, field, f"{label or field} must be true or false ({got(v)})")
    return False


def _path(ctx: Context, owner: Tenant | None, field: str, v: Any, info: FieldInfo, label: str = "") -> bool:
    """A string that can name a file or directory (``None`` allowed when ``info.optional``); for a
    ``path`` field (a tenant's data), rows held in memory too (:mod:`mlora_lab.sources`)."""
    label = label or field
    what = "a directory" if info.kind == "dir" else "a file"
    if info.kind == "path":  # a tenant's data: a file, or rows held in memory (read in the files phase)
        if memory_kind(v) is not None:
            return True
        why = source_type_problem(v)
        if why is not None and v is not None:
            ctx.say(owner, field, f"{label} {why}")
            return False
    if isinstance(v, str) and v == "":
        ctx.say(owner, field, f"{label} is empty; give the path of {what}")
        return False
    if not isinstance(v, str):
        kind = "a non-empty string or null" if info.optional else "a non-empty string"
        ctx.say(owner, field, f"{label} must be {kind} ({got(v)})")
        return False
    why = path_problem(v)
    if why:
        ctx.say(owner, field, f"{label} path {why}")
        return False
    return True


def _id(ctx: Context, owner: Tenant | None, field: str, v: Any, label: str = "") -> bool:
    """A short name (a W&B / trackio project): 1 to ``MAX_NAME_LEN`` characters of ``[A-Za-z0-9._-]``."""
    label = label or field
    if isinstance(v, str) and 0 < len(v) <= MAX_NAME_LEN and SAFE_NAME.fullmatch(v):
        return True
    ctx.say(owner, field, f"{label} must be 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ - ({got(v)})")
    return False


def _one_of(
    ctx: Context, owner: Tenant | None, field: str, v: Any, choices: tuple[str, ...], label: str = ""
) -> bool:
    if isinstance(v, str) and v in choices:
        return True
    ctx.say(owner, field, f"{label or field} must be one of {', '.join(choices)} (got {brief(v)})")
    return False


def _str_list(
    ctx: Context, owner: Tenant | None, field: str, v: Any, union: bool = False, label: str = ""
) -> bool:
    label = label or field
    if valid_targets(v, union):
        return True
    strings = isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v)
    if isinstance(v, list | tuple) and len(v) > MAX_TARGETS:
        ctx.say(owner, field, f"{label} has {len(v):,} entries (at most {MAX_TARGETS:,})")
    elif strings and any(len(x) > 1000 for x in v):
        ctx.say(owner, field, f"{label}: every entry must be at most 1000 characters (a module name)")
    elif strings:
        # PEFT reads "all-linear" only as the whole value; in a list it is one more module name, which
        # matches nothing, so ["all-linear", "q_proj"] would silently adapt q_proj alone.
        ctx.say(
            owner,
            field,
            f"{label}: '{ALL_LINEAR}' must be the only entry (got {brief(list(v))}); with other names "
            "PEFT would read it as a module name that matches nothing",
        )
    else:
        ctx.say(owner, field, f"{label} must be a list of non-empty strings ({got(v)})")
    return False
