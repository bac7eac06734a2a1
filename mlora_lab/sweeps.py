"""Hyperparameter search in one job, from the notebook: ``ml.sweep`` launches it, :class:`SweepRun` follows it.

    space = {"lr": ml.loguniform(1e-4, 1e-2), "rank": ml.choice(4, 8, 16),
             "target_modules": ml.choice(["q_proj", "v_proj"], "all-linear")}
    sweep = ml.sweep(spec, space, ml.ASHA(n=16, min_steps=20, eta=3), budget=180)   # returns at once
    sweep.dashboard()          # the run's live dashboard and the trials table
    sweep.results()            # one row per trial: config, state, rung, objective
    sweep.best()               # {"trial", "tenant", "config", "objective", "adapter"}

The trials are tenants of one job (the base tenant, ``spec.tenants[0]`` unless ``base`` is given, with a
trial's configuration): no process start, model load or idle device between trials. The decisions are
the job's (:mod:`mlora_lab.search_job`); this side only reads ``sweep.json`` and ``search.json``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from mlora_lab.launch import DEFAULT_WORKDIR, Run, launch
from mlora_lab.rundir import RunDirError
from mlora_lab.search import Objective, Search, Strategy, Sweep, dist_from_dict
from mlora_lab.slurm import SlurmOptions
from mlora_lab.spec import JobSpec, SpecError, Tenant

__all__ = ["SweepBoard", "SweepRun", "objective_reference", "sweep"]


def objective_reference(objective: str | Callable) -> str:
    """The name the job imports an objective by: a built-in metric's name, ``"module:function"``, or a
    function defined in an importable module (not in a notebook: the job could not import it)."""
    if isinstance(objective, str):
        return objective
    module, name = getattr(objective, "__module__", None), getattr(objective, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise SpecError([
            f"objective {name or objective!r} is defined in the notebook; the job imports its objective, so "
            "define it in a module on the job's Python path (or use 'eval_loss' / 'train_loss')"
        ])  # fmt: skip
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    if found is not objective:
        raise SpecError([f"objective {module}:{name} cannot be imported back by that name"])
    return f"{module}:{name}"


def sweep(
    spec: JobSpec,
    space: dict[str, Any],
    strategy: Strategy,
    budget: int | None = None,
    *,
    base: Tenant | None = None,
    seed: int = 0,
    objective: str | Callable = "eval_loss",
    mode: str = "min",
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str = "local",
    slurm: SlurmOptions | None = None,
) -> SweepRun:
    """Launch one job that searches ``space`` with ``strategy`` and return its :class:`SweepRun` at once.

    ``base``: the tenant every trial starts from (default ``spec.tenants[0]``, which then is not trained
    itself; the job's other tenants train alongside the trials). ``budget``: the most tenant steps a
    trial trains (default: the base tenant's ``max_steps``). ``objective``: ``"eval_loss"`` (the base
    needs ``eval_data``; else the train loss is used), ``"train_loss"``, or a function of a trial's
    metrics rows defined in an importable module; ``mode`` ``"min"`` or ``"max"``. The job's free slots
    (``max_tenants`` minus its other tenants) are the trials running at once. Every value the space
    can give a trial is checked before anything starts (:func:`~mlora_lab.validate.sweep_problems`)."""
    tenants = list(spec.tenants)
    if base is None:
        if not tenants:
            raise SpecError(["ml.sweep needs a base tenant: base=ml.Tenant(...) or the job's first tenant"])
        base = tenants.pop(0)
    space = {name: dist_from_dict(d) for name, d in space.items()}
    plan = Sweep(
        base=base,
        space=space,
        strategy=strategy,
        budget=base.max_steps if budget is None else budget,
        seed=seed,
        objective=Objective(objective_reference(objective), mode),
    )
    run = launch(dataclasses.replace(spec, tenants=tenants), workdir, launcher, slurm=slurm, sweep=plan)
    return SweepRun(run.path, process=run._process)


class SweepRun(Run):
    """A :class:`~mlora_lab.launch.Run` whose job runs a search: the trials, their results and the best."""

    @property
    def sweep(self) -> Sweep:
        """The search as launched (``sweep.json``)."""
        try:
            return Sweep.from_dict(json.loads(self.dir.sweep.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise RunDirError(f"{self.dir.sweep}: cannot be read ({e})") from None

    @property
    def search(self) -> Search | None:
        """The search's state as the job last wrote it (None before its first decision)."""
        try:
            return Search.from_dict(json.loads(self.dir.search.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as e:
            raise RunDirError(f"{self.dir.search}: cannot be read ({e})") from None

    def trial_name(self, trial_id: int) -> str:
        return f"{self.sweep.prefix}{trial_id:03d}"

    def results(self) -> pd.DataFrame:
        """One row per trial, best first: ``trial``, ``tenant``, ``state`` (waiting, running, paused,
        pruned, finished, failed), one column per searched setting, ``steps`` (the furthest step it
        reported at), ``rung`` (ASHA), ``objective`` (there), ``best`` (its best reported), ``parent``
        (PBT: the member it last copied), ``reason`` and ``adapter`` (its saved adapter, if any)."""
        search, sweep = self.search, self.sweep
        trials = search.trials if search is not None else sweep.search().trials
        rows = []
        for t in trials:
            name = self.trial_name(t.id)
            adapter = self.dir.adapters / name
            rows.append({
                "trial": t.id, "tenant": name, "state": t.state,
                **{k: (", ".join(v) if isinstance(v, list | tuple) else v) for k, v in t.config.items()},
                "steps": max(t.results, default=0), "rung": t.rung,
                "objective": search.final_value(t) if search else None,
                "best": search.best_value(t) if search else None,
                "parent": t.parent, "reason": t.reason,
                "adapter": str(adapter) if (adapter / "adapter_config.json").is_file() else None,
            })  # fmt: skip
        table = pd.DataFrame(rows)
        if table.empty:
            return table
        ascending = sweep.objective.mode == "min"
        return table.sort_values(["steps", "objective"], ascending=[False, ascending], na_position="last",
                                 kind="stable").reset_index(drop=True)  # fmt: skip

    def trials(self) -> pd.DataFrame:
        """:meth:`results` in trial order."""
        table = self.results()
        return table.sort_values("trial").reset_index(drop=True) if not table.empty else table

    def decisions(self) -> pd.DataFrame:
        """Every decision so far: ``step`` (global), ``trial``, ``action`` (start, promote, prune,
        finish, exploit, fail) and ``why``."""
        search = self.search
        return pd.DataFrame(search.decisions if search else [], columns=["step", "trial", "action", "why"])

    def best(self) -> dict[str, Any] | None:
        """The best trial: the one that trained furthest with the best objective there (None before any
        trial reported): ``trial``, ``tenant``, ``config``, ``objective`` and ``adapter`` (a PEFT
        directory, or None if not saved yet)."""
        search = self.search
        t = search.best_trial() if search is not None else None
        if t is None:
            return None
        name = self.trial_name(t.id)
        adapter = self.dir.adapters / name
        return {
            "trial": t.id, "tenant": name, "config": dict(t.config), "objective": search.final_value(t),
            "steps": max(t.results), "adapter": adapter if (adapter / "adapter_config.json").is_file() else None,
        }  # fmt: skip

    def dashboard(self, refresh_s: float = 1.0, **kwargs) -> SweepBoard:
        """The run's live dashboard with the trials table (state, config, rung, objective) under it,
        both refreshed until the run ends. ``kwargs`` go to :class:`~mlora_lab.dashboard.Dashboard`."""
        return SweepBoard(self, super().dashboard(refresh_s=refresh_s, **kwargs), refresh_s)

    def _trials_html(self) -> str:
        try:
            table = self.results().drop(columns=["adapter"], errors="ignore")
        except RunDirError as e:
            return f"<i>{e}</i>"
        if table.empty:
            return "<i>no trials yet</i>"
        return table.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="", border=0)


class SweepBoard:
    """A sweep's view: the run's :class:`~mlora_lab.dashboard.Dashboard` (``.board``) and the trials
    table (``.trials``, an ipywidgets HTML), which a daemon thread refreshes every ``2 × refresh_s``
    seconds until the run ends."""

    def __init__(self, run: SweepRun, board: Any, refresh_s: float = 1.0) -> None:
        import ipywidgets as W

        self.run, self.board = run, board
        self.trials = W.HTML(value=run._trials_html())
        self.scatter = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self._shown: tuple | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._follow, args=(refresh_s,), name="mlora-sweep", daemon=True
        )
        self._thread.start()

    def _follow(self, refresh_s: float) -> None:
        while not self._stop.is_set():
            final = self.run.status.final
            self.refresh()
            if final:
                return
            self._stop.wait(2 * refresh_s)

    def refresh(self) -> None:
        """Update the table, and the scatter when a trial reported since it was drawn (one refresh at a
        time: the follower thread and a caller may both call it)."""
        with self._lock:
            value = self.run._trials_html()
            if self.trials.value != value:
                self.trials.value = value
            search = self.run.search
            seen = tuple((t.id, len(t.results)) for t in search.trials) if search is not None else None
            if seen != self._shown and search is not None and any(t.results for t in search.trials):
                self.scatter.value = self._scatter_png()
                self._shown = seen

    def _scatter_png(self) -> bytes:
        """Config → objective: each trial at its setting and its objective at its furthest step, one
        panel per searched setting (``lr`` on a log axis), the best ringed."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure

        from mlora_lab.plotting import figure_png

        table = self.run.results().dropna(subset=["objective"])
        names = list(self.run.sweep.space)
        fig = Figure(figsize=(3.2 * len(names), 2.6), layout="constrained")
        axes = fig.subplots(1, len(names), squeeze=False)[0]
        for ax, name in zip(axes, names):
            x = table[name].astype(str) if table[name].dtype == object else table[name]
            ax.scatter(x, table["objective"], c=table["steps"], cmap="viridis", s=28)
            ax.scatter(x.iloc[:1], table["objective"].iloc[:1], s=120, facecolors="none", edgecolors="red")
            if name == "lr":
                ax.set_xscale("log")
            ax.set_xlabel(name)
            ax.tick_params(axis="x", labelrotation=20, labelsize=7)
        axes[0].set_ylabel(f"{self.run.sweep.objective.metric} (colour: steps)")
        return figure_png(fig)

    def stop(self) -> None:
        self._stop.set()
        self.board.stop()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.board)
        display(self.trials)
        display(self.scatter)
