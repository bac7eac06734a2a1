"""An agent tenant's settings (``rl.env``, ``rl.tools``, ``rl.env_args``; :mod:`mlora_lab.agents`), checked with
every other problem of the spec, before any process starts.

check_agent_field(ctx, t, value, info, label)   the agent fields' own kinds: ``function`` (one optional function;
                                                ``rl.env`` may be a verifiers env: ``"verifiers:<taskset id>"``, a
                                                ``Taskset`` or an ``Env``),
                                                ``functions`` (a list, maybe empty), ``mapping`` (JSON keyword
                                                arguments)
check_agent(ctx, t, ok)                         what the fields mean together: tools
                                                with schemas and distinct names, sampling the trainer can
                                                score exactly, the OpenAI client the episodes call the job with
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

from mlora_lab.rl.rewards import parse_reward
from mlora_lab.sources import RewardSnapshot, reward_in_memory, verifiers_object
from mlora_lab.spec.fields import FieldInfo
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import error_line
from mlora_lab.validate.context import Context, got

VERIFIERS_PREFIX = "verifiers:"
"""``rl.env = "verifiers:<taskset id>"``: a verifiers 0.4 environment (:mod:`mlora_lab.agents.vf_harness`)."""


def function_problem(v: Any, label: str) -> str | None:
    if label == "rl.env" and ((isinstance(v, str) and v.startswith(VERIFIERS_PREFIX)) or verifiers_object(v)):
        return _verifiers_problem(v, label)
    if reward_in_memory(v):
        return None
    if not isinstance(v, str):
        return f"{label} must be 'module:function', 'file.py:function' or a function ({got(v)})"
    why = parse_reward(v)
    return f"{label}: {why}" if isinstance(why, str) else None


def _verifiers_problem(v: Any, label: str) -> str | None:
    """What is wrong with a verifiers env: a taskset id that is not one, or verifiers missing (the env worker
    imports the taskset and names what fails there)."""
    if isinstance(v, str) and not v.removeprefix(VERIFIERS_PREFIX).strip():
        return f"{label} {v!r} names no taskset: write '{VERIFIERS_PREFIX}<taskset id>'"
    if importlib.util.find_spec("verifiers") is None:
        return f"{label} is a verifiers environment and verifiers is not installed: pip install 'mlora_lab[agents]'"
    return None


def check_agent_field(ctx: Context, t: Tenant, value: Any, info: FieldInfo, label: str) -> bool:
    """``value`` of an agent field of ``t.rl`` against its kind; whether it passed."""
    problems: list[str] = []
    if info.kind == "function":
        if value is not None:
            problems += [p for p in [function_problem(value, label)] if p]
    elif info.kind == "functions":
        if not isinstance(value, list | tuple):
            problems.append(f"{label} must be a list of functions ({got(value)})")
        elif info.max is not None and len(value) > info.max:
            problems.append(f"{label} has {len(value)} functions (at most {info.max:g})")
        else:
            problems += [p for i, v in enumerate(value) if (p := function_problem(v, f"{label}[{i}]"))]
    elif info.kind == "mapping":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problems.append(f"{label} must be an object with text keys ({got(value)})")
        else:
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                problems.append(f"{label} must hold JSON values only: {error_line(e)}")
    for problem in problems:
        ctx.say(t, "rl", problem)
    return not problems


def check_agent(ctx: Context, t: Tenant, ok: dict[str, bool]) -> None:
    """The agent fields of ``t.rl`` together, and ``max_staleness`` with them (``ok``: which fields passed their
    own checks)."""
    rl = t.rl
    if ok.get("env_args") and rl.env_args and rl.env is None:
        ctx.say(t, "rl", "rl.env_args are the keyword arguments of rl.env, and there is no rl.env")
    if ok.get("max_staleness") and rl.max_staleness:
        if rl.agent:
            ctx.say(
                t,
                "rl",
                f"rl.max_staleness={rl.max_staleness}: an agent tenant's episodes are played when its window "
                "starts (sampling them ahead is not offered yet); leave max_staleness at 0",
            )
        elif ok.get("top_p") and ok.get("top_k") and (rl.top_p < 1 or rl.top_k):
            ctx.say(
                t,
                "rl",
                f"rl.max_staleness={rl.max_staleness} samples with every token allowed (top_p=1, top_k=0; got "
                f"top_p={rl.top_p:g}, top_k={rl.top_k}): a stale generation's ratio is taken against the "
                "sampler's log-probs, which equal the trainer's log_softmax(z / temperature) only then",
            )
    if not rl.agent:
        return
    if rl.harness is True and (rl.env is not None or rl.tools):
        given = " and ".join(
            x for x, on in (("rl.env", rl.env is not None), ("rl.tools", bool(rl.tools))) if on
        )
        ctx.say(
            t,
            "rl",
            f"rl.harness is on and {given} given: a harness tenant's episodes are played by an outside program "
            "(it has no env and no tools of the job's); turn harness off or remove them",
        )
    if ok.get("top_p") and ok.get("top_k") and (rl.top_p < 1 or rl.top_k):
        ctx.say(
            t,
            "rl",
            f"an agent tenant samples with every token allowed (top_p=1, top_k=0; got top_p={rl.top_p:g}, "
            f"top_k={rl.top_k}): its importance ratio is taken against the sampler's log-probs, which equal "
            "the trainer's log_softmax(z / temperature) only then",
        )
    if importlib.util.find_spec("openai") is None and rl.harness is not True:  # (a harness's program calls)
        ctx.say(
            t,
            "rl",
            "an agent tenant's episodes call the job through the openai client, which is not installed: "
            "pip install 'mlora_lab[openai]'",
        )
    verifiers = (isinstance(rl.env, str) and rl.env.startswith(VERIFIERS_PREFIX)) or verifiers_object(rl.env)
    if verifiers and isinstance(rl.tools, list | tuple) and rl.tools:
        ctx.say(
            t,
            "rl",
            "rl.tools are not used by a verifiers environment (rl.env): its tools are its taskset's toolsets; "
            "remove rl.tools",
        )
    if isinstance(rl.tools, list | tuple) and rl.tools:  # (a bad reference among them is named on its own)
        check_tools(ctx, t, [f for f in rl.tools if reward_in_memory(f) or isinstance(f, str)])


def check_tools(ctx: Context, t: Tenant, tools: list[Any]) -> None:
    """Tools held in memory (a notebook's functions) get their JSON schemas now, so a tool without type hints or
    a docstring is named before launch; tools named by reference are imported by the tenant's env worker, which
    names what fails to import. Two tools of one name would be one tool to the model."""
    from transformers.utils import get_json_schema

    names: list[str] = []
    for i, fn in enumerate(tools):
        if isinstance(fn, RewardSnapshot):
            names.append(fn.name)
            continue
        if isinstance(fn, str):
            ref = parse_reward(fn)
            names.append(getattr(ref, "function", fn))
            continue
        try:
            names.append(get_json_schema(fn)["function"]["name"])
        except Exception as e:
            ctx.say(
                t,
                "rl",
                f"rl.tools[{i}] {getattr(fn, '__name__', fn)!r} has no tool schema (type hints on every argument "
                f"and a Google-style docstring with an Args section): {error_line(e)}",
            )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        ctx.say(
            t,
            "rl",
            f"rl.tools has two tools named {', '.join(map(repr, twice))}: the model could not tell them apart",
        )
