"""An RL tenant's settings (:class:`~mlora_lab.spec.parts.RL`) and its reward functions.

check_reward_refs / check_numbers / check_texts   RL's own field kinds (``validate.fields.check_rl_fields``
                           checks ``t.rl`` field by field with them; no file is read)
check_reward_names(ctx, t)   ``rl.reward_names`` against the rewards (one each, usable as column names)
check_importance_sampling(ctx, t, ok)   the ratio's level against the loss type, the sampling correction's
                       bounds and mode together (what TRL 1.16 refuses, and what it only warns about)
check_rewards(ctx, t, columns, samples)   the reward functions imported in a short-lived worker process (the
                       notebook never imports the user's file itself, so an edited file is seen
                       anew and a module that hangs cannot hang it): each exists, is callable,
                       takes TRL's arguments, and names no argument the data rows lack
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlora_lab.rl.prompts import as_completion, chat_prompt
from mlora_lab.rl.rewards import RewardBatch, inspect_rewards, parse_reward
from mlora_lab.rundir.files import atomic_write_bytes
from mlora_lab.sources import RewardSnapshot, reward_in_memory
from mlora_lab.spec.fields import MAX_REWARDS, FieldInfo
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import HIDDEN, brief, error_line, is_finite
from mlora_lab.validate.context import Context, got

SAMPLE_COMPLETION = "The answer is 42."
"""The completion reward functions are called with once at validation (in its prompt's shape)."""


def check_rewards(ctx: Context, t: Tenant, columns: set[str] | None, samples: Sequence[dict] = ()) -> None:
    """Import ``t``'s reward functions in a worker process and check them against the data's columns
    (``None``: unknown, because the data has problems of its own). A function held in memory is pickled
    (as a launch will) and unpickled there: one that cannot travel to the worker is said so now. With the
    columns known, each function is also called once on each of ``samples`` (the first row of each prompt
    shape in the data, a text prompt and a chat, as the data's scan found them: ``SourceReport.samples``)
    with :data:`SAMPLE_COMPLETION` in that shape, so a type mismatch (TRL's ``think_format_reward`` on text
    prompts) is refused now, not at the first step."""
    rl = t.rl
    if not isinstance(rl, RL) or not check_reward_refs(None, t, rl.reward, "rl.reward"):
        return
    with tempfile.TemporaryDirectory(prefix="mlora_rewards_") as tmp:
        refs = []
        for i, r in enumerate(rl.rewards):
            if reward_in_memory(r):
                try:
                    snap = r if isinstance(r, RewardSnapshot) else RewardSnapshot.of(r)
                except Exception as e:
                    ctx.say(
                        t,
                        "rl",
                        f"reward function {brief(r)} cannot be pickled for the reward worker: {error_line(e)}",
                    )
                    continue
                path = Path(tmp) / f"{i}-{snap.name}.pkl"
                atomic_write_bytes(path, snap.data, root=tmp)
                r = f"{path}:{snap.name}"
            refs.append(r)
        probes = _probes(ctx, t, samples) if columns is not None else []
        for found in inspect_rewards(refs, probes=probes):
            for problem in [found] if isinstance(found, str) else found.problems(columns):
                ctx.say(t, "rl", problem)


def _probes(ctx: Context, t: Tenant, samples: Sequence[dict]) -> list[tuple[RewardBatch, str]]:
    """A one-row batch of each of ``samples`` (prompt rows of ``t``'s data), with :data:`SAMPLE_COMPLETION`
    as TRL would pass it, and what it is (``"a text prompt of the data"``)."""
    ids = [0]
    if ctx.tok is not None:
        with contextlib.suppress(Exception):
            ids = list(ctx.tok(SAMPLE_COMPLETION, add_special_tokens=False)["input_ids"]) or ids
    out = []
    for row in samples:
        prompt = chat_prompt(row) or row["prompt"]
        batch = RewardBatch(
            prompts=[prompt],
            completions=[as_completion(prompt, SAMPLE_COMPLETION)],
            completion_ids=[ids],
            columns={k: [v] for k, v in row.items() if k not in ("prompt", "messages")},
            state={"global_step": 0, "max_steps": t.max_steps},
        )
        out.append((batch, f"a {'text' if isinstance(prompt, str) else 'chat'} prompt of the data"))
    return out


def check_reward_refs(ctx: Context | None, t: Tenant, v: Any, label: str) -> bool:
    """One reward (a reference, or a function held in memory) or a non-empty list of at most
    :data:`MAX_REWARDS` (``ctx=None``: only whether it is good)."""
    items = [v] if isinstance(v, str) or reward_in_memory(v) else v
    problems = []
    if not isinstance(items, list | tuple) or not items:
        problems.append(
            f"{label} must be 'module:function', 'file.py:function', a function, or a list of them ({got(v)})"
        )
    elif len(items) > MAX_REWARDS:
        problems.append(f"{label} has {len(items)} reward functions (at most {MAX_REWARDS})")
    else:
        problems += [
            why for why in (parse_reward(x) for x in items if not reward_in_memory(x)) if isinstance(why, str)
        ]
    if ctx is not None:
        for problem in problems:
            ctx.say(t, "rl", problem)
    return not problems


def check_numbers(ctx: Context, t: Tenant, v: Any, info: FieldInfo, label: str) -> bool:
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


def check_texts(ctx: Context, t: Tenant, v: Any, info: FieldInfo, label: str) -> bool:
    if v is None and info.optional:
        return True
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


def check_reward_names(ctx: Context, t: Tenant) -> None:
    """``rl.reward_names`` (a list of texts already) against the rewards: one per function, each a column
    name (not blank, no '/': the columns are ``rewards/<name>/mean``, no hidden character), all distinct."""
    rl = t.rl
    names = rl.reward_names
    if names is None:
        return
    if len(names) != len(rl.rewards):
        ctx.say(
            t,
            "rl",
            f"rl.reward_names has {len(names)} names for {len(rl.rewards)} reward functions; give one name "
            "per function",
        )
    for name in names:
        why = (
            "is blank"
            if not name.strip()
            else "holds a '/' (the columns are rewards/<name>/mean)"
            if "/" in name
            else "holds a hidden character"
            if HIDDEN.search(name)
            else None
        )
        if why:
            ctx.say(t, "rl", f"rl.reward_names: {brief(name)} {why}")
    twice = sorted({n for n in names if names.count(n) > 1})
    for name in twice:
        ctx.say(t, "rl", f"rl.reward_names names two functions {brief(name)}; give each its own")


SEQUENCE_SUMMED = ("bnpo", "dr_grpo", "dapo", "cispo")
"""Loss types that sum per-token terms: at ``importance_sampling_level="sequence"`` they weigh each sequence by
its length instead of GSPO's per-sequence objective (TRL 1.16 warns, ``GRPOTrainer.__init__``)."""


def check_importance_sampling(ctx: Context, t: Tenant, ok: dict[str, bool]) -> None:
    """The importance-ratio settings together, each field already checked alone (``ok[name]``: it passed).
    Stricter than TRL, which only warns where a setting computes something other than its method: ``luspo``
    at token level, a length-summed loss at sequence level. As GRPOConfig: ``C_min < C_max``, and a truncating
    mode with the correction on needs a bound."""
    rl = t.rl
    level_ok, loss_ok = ok.get("importance_sampling_level"), ok.get("loss_type")
    if level_ok and loss_ok:
        if rl.loss_type == "luspo" and rl.importance_sampling_level != "sequence":
            ctx.say(
                t,
                "rl",
                "rl.loss_type='luspo' scales each sequence's loss by its length on a sequence-level ratio: set "
                "rl.importance_sampling_level='sequence' (the LUSPO paper's setup; at 'token' it is "
                "another method)",
            )
        if rl.importance_sampling_level == "sequence" and rl.loss_type in SEQUENCE_SUMMED:
            ctx.say(
                t,
                "rl",
                f"rl.loss_type={rl.loss_type!r} sums per-token terms, so at rl.importance_sampling_level="
                "'sequence' it weighs each sequence by its length instead of GSPO's per-sequence objective: "
                "use loss_type='grpo' for GSPO, or importance_sampling_level='token'",
            )
    lo, hi = rl.importance_sampling_clip_min, rl.importance_sampling_clip_max
    bounds_ok = ok.get("importance_sampling_clip_min") and ok.get("importance_sampling_clip_max")
    if bounds_ok and lo is not None and hi is not None and not lo < hi:
        ctx.say(
            t,
            "rl",
            f"rl.importance_sampling_clip_min={lo} must be below rl.importance_sampling_clip_max={hi}",
        )
    if (
        bounds_ok
        and ok.get("importance_sampling_mode")
        and ok.get("importance_sampling_correction")
        and rl.importance_sampling_correction
        and rl.importance_sampling_mode.endswith("_truncate")
        and lo is None
        and hi is None
    ):
        ctx.say(
            t,
            "rl",
            f"rl.importance_sampling_mode={rl.importance_sampling_mode!r} clips the sampling ratio: give "
            "rl.importance_sampling_clip_max or rl.importance_sampling_clip_min",
        )
