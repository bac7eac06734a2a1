"""An RL tenant's settings (:class:`~mlora_lab.spec.RL`) and its reward functions.

check_rl_fields(ctx, t)    every field of ``t.rl`` (no file read), and what two of them say together
check_rewards(ctx, t, columns)   the reward functions imported in a short-lived worker process (the
                           notebook never imports the user's file itself, so an edited file is seen
                           anew and a module that hangs cannot hang it): each exists, is callable,
                           takes TRL's arguments, and names no argument the data rows lack
"""

from __future__ import annotations

from typing import Any

from mlora_lab.rl.rewards import inspect_rewards, parse_reward
from mlora_lab.spec import MAX_REWARDS, RL, FieldInfo, Tenant, fields_info
from mlora_lab.text import brief, is_finite, is_int
from mlora_lab.validate.context import Context, got


def check_rl_fields(ctx: Context, t: Tenant) -> bool:
    """``t.rl``'s fields against their :class:`~mlora_lab.spec.FieldInfo`, then: a weight per reward,
    a completion that fits ``seq_len`` after at least one prompt token, and no ``eval_data`` (an RL
    tenant is measured by its rewards)."""
    from mlora_lab.validate.fields import check_field  # (fields calls this module for the rl field)

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
            ok[name] = _rewards(ctx, t, value, label)
        elif info.kind == "numbers":
            ok[name] = _numbers(ctx, t, value, info, label)
        elif info.kind == "texts":
            ok[name] = _texts(ctx, t, value, info, label)
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
    seq_len = ctx.spec.seq_len
    if ok["max_new_tokens"] and is_int(seq_len) and rl.max_new_tokens >= seq_len:
        ctx.say(
            t,
            "rl",
            f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in seq_len={seq_len}; "
            "prompt and completion together fit seq_len",
        )
    if t.eval_data is not None:
        ctx.say(t, "eval_data", "an RL tenant has no eval_data (it is measured by its rewards); remove it")
    return len(ctx.out) == before


def check_rewards(ctx: Context, t: Tenant, columns: set[str] | None) -> None:
    """Import ``t``'s reward functions in a worker process and check them against the data's columns
    (``None``: unknown, because the data has problems of its own)."""
    rl = t.rl
    if not isinstance(rl, RL) or not _rewards(None, t, rl.reward, "rl.reward"):
        return
    for found in inspect_rewards(rl.rewards):
        for problem in [found] if isinstance(found, str) else found.problems(columns):
            ctx.say(t, "rl", problem)


def _rewards(ctx: Context | None, t: Tenant, v: Any, label: str) -> bool:
    """One reward reference or a non-empty list of at most :data:`MAX_REWARDS` (``ctx=None``: only
    whether it is good)."""
    items = [v] if isinstance(v, str) else v
    problems = []
    if not isinstance(items, list | tuple) or not items:
        problems.append(f"{label} must be 'module:function', 'file.py:function' or a list of them ({got(v)})")
    elif len(items) > MAX_REWARDS:
        problems.append(f"{label} has {len(items)} reward functions (at most {MAX_REWARDS})")
    else:
        problems += [why for why in map(parse_reward, items) if isinstance(why, str)]
    if ctx is not None:
        for problem in problems:
            ctx.say(t, "rl", problem)
    return not problems


def _numbers(ctx: Context, t: Tenant, v: Any, info: FieldInfo, label: str) -> bool:
    if v is None and info.optional:
        return True
    if isinstance(v, list | tuple) and v and all(is_finite(x) for x in v):
        return True
    ctx.say(
        t,
        "rl",
        f"{label} must be a non-empty list of finite numbers{' or null' if info.optional else ''} ({got(v)})",
    )
    return False


def _texts(ctx: Context, t: Tenant, v: Any, info: FieldInfo, label: str) -> bool:
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x for x in v):
        ctx.say(t, "rl", f"{label} must be a list of non-empty strings ({got(v)})")
    elif info.max is not None and len(v) > info.max:
        ctx.say(t, "rl", f"{label} has {len(v):,} entries (at most {info.max:g})")
    elif any(len(x) > 1000 for x in v):
        ctx.say(
            t, "rl", f"{label}: {brief(next(x for x in v if len(x) > 1000))} is longer than 1000 characters"
        )
    else:
        return True
    return False
