"""A search's trials as its run directory records them: ``sweep.json`` (the search as launched) and
``search.json`` (its state, written by the job's rank 0). Read only; used by the sweep's handle
(:class:`~mlora_lab.lab.runs.sweep.SweepRun`) and by its view (:mod:`mlora_lab.lab.dashboard.sweep`)."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd

from mlora_lab.rundir import RunDir, RunDirError
from mlora_lab.search import Search, Sweep


def read_sweep(run: RunDir) -> Sweep:
    """The search as launched (``sweep.json``); :class:`~mlora_lab.rundir.RunDirError` if unreadable."""
    try:
        return Sweep.read(run.sweep)
    except (OSError, ValueError) as e:
        raise RunDirError(f"{run.sweep}: cannot be read ({e})") from None


def read_search(run: RunDir) -> Search | None:
    """The search's state as the job last wrote it (None before its first decision)."""
    try:
        return Search.from_dict(json.loads(run.search.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        raise RunDirError(f"{run.search}: cannot be read ({e})") from None


def trial_name(sweep: Sweep, trial_id: int) -> str:
    """The tenant name of a trial in the job."""
    return f"{sweep.prefix}{trial_id:03d}"


def _adapter(run: RunDir, name: str) -> str | None:
    path = run.adapters / name
    return str(path) if (path / "adapter_config.json").is_file() else None


def results(run: RunDir) -> pd.DataFrame:
    """One row per trial, best first (failed ones last): ``trial``, ``tenant``, ``state`` (waiting, running,
    paused, pruned, finished, failed), one column per searched setting, ``steps`` (the furthest step it
    reported at), ``rung`` (ASHA), ``objective`` (there), ``best`` (its best reported), ``parent``
    (PBT: the member it last copied), ``reason`` and ``adapter`` (its saved adapter, if any)."""
    search, sweep = read_search(run), read_sweep(run)
    try:
        trials = search.trials if search is not None else sweep.search().trials
    except ValueError as e:  # a search that cannot be set up (a grid too large to run, say)
        raise RunDirError(f"{run.sweep}: {e}") from None
    rows = []
    for t in trials:
        name = trial_name(sweep, t.id)
        settings = {k: (", ".join(v) if isinstance(v, list | tuple) else v) for k, v in t.config.items()}
        rows.append(
            {
                "trial": t.id,
                "tenant": name,
                "state": t.state,
                **settings,
                "steps": max(t.results, default=0),
                "rung": t.rung,
                "objective": search.final_value(t) if search else None,
                "best": search.best_value(t) if search else None,
                "parent": t.parent,
                "reason": t.reason,
                "adapter": _adapter(run, name),
            }
        )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    ascending = sweep.objective.mode == "min"
    # failed trials last: however far one got, it is not a result (best() never picks it either)
    table["_failed"] = table["state"] == "failed"
    order = ["_failed", "steps", "objective"]
    table = table.sort_values(order, ascending=[True, False, ascending], na_position="last", kind="stable")
    return table.drop(columns="_failed").reset_index(drop=True)


def decisions(run: RunDir) -> pd.DataFrame:
    """Every decision so far: ``step`` (global), ``trial``, ``action`` (start, promote, prune,
    finish, exploit, fail) and ``why``."""
    search = read_search(run)
    return pd.DataFrame(search.decisions if search else [], columns=["step", "trial", "action", "why"])


def best(run: RunDir) -> dict[str, Any] | None:
    """The best trial: the one that trained furthest with the best objective there (None before any
    trial reported): ``trial``, ``tenant``, ``config``, ``objective``, ``steps`` and ``adapter`` (a
    PEFT directory, or None if not saved yet)."""
    search = read_search(run)
    t = search.best_trial() if search is not None else None
    if t is None:
        return None
    name = trial_name(read_sweep(run), t.id)
    adapter = run.adapters / name
    return {
        "trial": t.id,
        "tenant": name,
        "config": dict(t.config),
        "objective": search.final_value(t),
        "steps": max(t.results),
        "adapter": adapter if (adapter / "adapter_config.json").is_file() else None,
    }
