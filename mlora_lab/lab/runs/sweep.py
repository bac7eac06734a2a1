"""The handle of a run whose job runs a search: :class:`SweepRun` (``ml.sweep`` returns one, and
``ml.attach`` / ``ml.resume`` do for a run directory with a ``sweep.json``)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from mlora_lab.lab.records import trials
from mlora_lab.lab.runs.run import Run
from mlora_lab.search import Search, Sweep


class SweepRun(Run):
    """A :class:`~mlora_lab.lab.runs.run.Run` whose job runs a search: the trials, their results and the best.

    The decisions are the job's; this side only reads ``sweep.json`` and ``search.json``
    (:mod:`mlora_lab.lab.records.trials`)."""

    @property
    def sweep(self) -> Sweep:
        """The search as launched (``sweep.json``)."""
        return trials.read_sweep(self.dir)

    @property
    def search(self) -> Search | None:
        """The search's state as the job last wrote it (None before its first decision)."""
        return trials.read_search(self.dir)

    def trial_name(self, trial_id: int) -> str:
        return trials.trial_name(self.sweep, trial_id)

    def results(self) -> pd.DataFrame:
        """One row per trial, best first (:func:`mlora_lab.lab.records.trials.results`): ``trial``, ``tenant``,
        ``state``, one column per searched setting, ``steps``, ``rung``, ``objective``, ``best``,
        ``parent``, ``reason`` and ``adapter``."""
        return trials.results(self.dir)

    def trials(self) -> pd.DataFrame:
        """:meth:`results` in trial order."""
        table = self.results()
        return table.sort_values("trial").reset_index(drop=True) if not table.empty else table

    def decisions(self) -> pd.DataFrame:
        """Every decision so far: ``step`` (global), ``trial``, ``action`` (start, promote, prune,
        finish, exploit, fail) and ``why``."""
        return trials.decisions(self.dir)

    def best(self) -> dict[str, Any] | None:
        """The best trial: the one that trained furthest with the best objective there (None before any
        trial reported): ``trial``, ``tenant``, ``config``, ``objective`` and ``adapter`` (a PEFT
        directory, or None if not saved yet)."""
        return trials.best(self.dir)

    def dashboard(self, refresh_s: float = 1.0, **kwargs: Any) -> Any:
        """The run's live dashboard with the trials table (state, config, rung, objective) and the
        config → objective panels under it, both refreshed until the run ends. ``kwargs`` go to
        :class:`~mlora_lab.lab.dashboard.Dashboard`."""
        from mlora_lab.lab.dashboard.sweep import SweepBoard

        return SweepBoard(self, super().dashboard(refresh_s=refresh_s, **kwargs), refresh_s)
