"""The job's evaluations (``JobSpec.evals``, :class:`~mlora_lab.spec.parts.Eval`).

check_eval_fields(ctx)   each evaluation's fields, names unique and usable as folders, its models among the
                         base and the tenants (any name when tenants may join later), its metrics references
check_eval_files(ctx)    its rows read as prompt rows (named evaluation rows), its metrics imported in a worker process and checked
                         against the rows' columns (as an RL tenant's reward functions are)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from mlora_lab.evals.metrics import BUILTINS, metric_ref
from mlora_lab.rl.prompts import EVAL_ROWS
from mlora_lab.rl.rewards import inspect_rewards, parse_reward
from mlora_lab.rundir.evals import NAME
from mlora_lab.rundir.files import atomic_write_bytes
from mlora_lab.sources import RewardSnapshot, memory_kind, reward_in_memory, source_name
from mlora_lab.spec.fields import MAX_REWARDS, fields_info
from mlora_lab.spec.parts import Eval
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, error_line
from mlora_lab.validate.context import Context, got
from mlora_lab.validate.fields import check_field


def _evals(ctx: Context) -> list[Eval]:
    evals = ctx.spec.evals
    if not isinstance(evals, list | tuple):
        ctx.say(None, "evals", f"evals must be a list of Eval ({got(evals)})")
        return []
    out = []
    for i, e in enumerate(evals):
        if isinstance(e, Eval):
            out.append(e)
        else:
            ctx.say(None, "evals", f"evals[{i}] must be an Eval ({got(e)})")
    return out


def check_eval_fields(ctx: Context) -> list[Eval]:
    """Every evaluation's fields; returns those whose fields are good (their files are checked next)."""
    good, seen = [], set()
    s = ctx.spec
    tenants = [t.name for t in s.tenants if isinstance(t, Tenant)] if isinstance(s.tenants, list) else []
    may_join = s.stay_up is True or s.service is not None
    for e in _evals(ctx):
        before = len(ctx.out)
        where = f"evaluation {e.name!r}" if isinstance(e.name, str) else "an evaluation"
        if not isinstance(e.name, str) or not NAME.fullmatch(e.name):
            ctx.say(
                None, "evals", f"{where}: name must be letters, digits, '.', '_', '-' (it names a folder)"
            )
        elif e.name in seen:
            ctx.say(None, "evals", f"two evaluations are called {e.name!r}: give each its own name")
        seen.add(e.name)
        for name, info in fields_info(Eval):
            value = getattr(e, name)
            if name in ("name", "data"):
                continue
            if name == "metrics":
                _check_metrics(ctx, where, value)
            elif name == "models":
                _check_models(ctx, where, value, tenants, may_join)
            else:
                check_field(ctx, None, "evals", value, info, label=f"{where}: {name}")
        if e.data is None or (isinstance(e.data, str) and not e.data):
            ctx.say(None, "evals", f"{where}: data names its prompt rows (a file, a DataFrame, rows...)")
        if len(ctx.out) == before:
            good.append(e)
    return good


def _check_metrics(ctx: Context, where: str, value: Any) -> None:
    if not isinstance(value, list | tuple) or not value:
        ctx.say(None, "evals", f"{where}: metrics must be a non-empty list ({got(value)})")
        return
    if len(value) > MAX_REWARDS:
        ctx.say(None, "evals", f"{where}: {len(value)} metrics (at most {MAX_REWARDS})")
    for m in value:
        if reward_in_memory(m) or (isinstance(m, str) and m in BUILTINS):
            continue
        why = parse_reward(m)
        if isinstance(why, str):
            ctx.say(
                None, "evals", f"{where}: {why.replace('a reward', 'a metric').replace('reward ', 'metric ')}"
            )


def _check_models(ctx: Context, where: str, value: Any, tenants: list[str], may_join: bool) -> None:
    if value is None:
        return
    if not isinstance(value, list | tuple) or not all(isinstance(m, str) and m for m in value) or not value:
        ctx.say(
            None,
            "evals",
            f"{where}: models must be a non-empty list of names, or null for all ({got(value)})",
        )
        return
    unknown = [m for m in value if m != "base" and m not in tenants]
    if unknown and not may_join:
        ctx.say(
            None,
            "evals",
            f"{where}: models {', '.join(map(repr, unknown))} are neither 'base' nor a tenant "
            f"(tenants: {', '.join(tenants) or 'none'})",
        )


def metric_refs(e: Eval, folder: Path) -> list[str]:
    """``e``'s metrics as references a worker imports: built-ins by their module, functions pickled into
    ``folder`` (what a launch does into the run, and validation into a temporary folder)."""
    refs = []
    for i, m in enumerate(e.metrics):
        if isinstance(m, str):
            refs.append(metric_ref(m))
        else:
            snap = m if isinstance(m, RewardSnapshot) else RewardSnapshot.of(m)
            path = folder / f"{i}-{snap.name}.pkl"
            atomic_write_bytes(path, snap.data, root=folder)
            refs.append(f"{path}:{snap.name}")
    return refs


def check_eval_files(ctx: Context, evals: list[Eval]) -> None:
    """Each evaluation's rows (prompt rows, as an RL tenant's) and its metrics against their columns."""
    from mlora_lab.data import scan_source  # the data module imports torch

    for e in evals:
        where = f"evaluation {e.name!r}"
        report = scan_source(e.data, prompts=EVAL_ROWS)
        for problem in report.problems:
            ctx.say(None, "evals", f"{where}: {problem}")
        if not report.problems and report.n_rows == 0:
            ctx.say(None, "evals", f"{where}: {source_name(e.data)} has no rows")
        columns = None if report.problems else report.columns | {"reference"}
        with tempfile.TemporaryDirectory(prefix="mlora_metrics_") as tmp:
            try:
                refs = metric_refs(e, Path(tmp))
            except Exception as err:
                ctx.say(
                    None, "evals", f"{where}: a metric cannot be pickled for the worker: {error_line(err)}"
                )
                continue
            for found in inspect_rewards(refs):
                for problem in [found] if isinstance(found, str) else found.problems(columns):
                    ctx.say(None, "evals", f"{where}: {problem}")
        if memory_kind(e.data) is None and not isinstance(e.data, str) and not hasattr(e.data, "repo_id"):
            ctx.say(None, "evals", f"{where}: data must be a file path or rows ({brief(e.data)})")
