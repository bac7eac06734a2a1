"""A search's view: the run's dashboard, the trials table, and config → objective panels
(``sweep.dashboard()``). Reads the run directory only (:mod:`mlora_lab.lab.records.trials`)."""

from __future__ import annotations

import html
import logging
import threading
import time
from typing import Any

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure

from mlora_lab.lab.dashboard.figures import RED
from mlora_lab.lab.launchers.liveness import Liveness
from mlora_lab.lab.plotting import drawable, figure_png, plain, set_categories, set_log_x
from mlora_lab.lab.records import trials
from mlora_lab.rundir import RunDirError
from mlora_lab.text import error_line

log = logging.getLogger(__name__)

LOG_SETTINGS = frozenset({"lr"})
"""Settings drawn on a log axis."""


def trials_html(run: Any) -> str:
    """The trials table (:func:`mlora_lab.lab.records.trials.results`, without the adapter paths) as HTML."""
    try:
        table = trials.results(Liveness.of(run).dir).drop(columns=["adapter"], errors="ignore")
    except RunDirError as e:
        return f"<i>{e}</i>"
    if table.empty:
        return "<i>no trials yet</i>"
    return table.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="", border=0)


class SweepBoard:
    """A sweep's view: the run's :class:`~mlora_lab.lab.dashboard.Dashboard` (``.board``), the trials
    table (``.trials``, an ipywidgets HTML) and the config → objective panels (``.scatter``), which a
    daemon thread refreshes every ``2 × refresh_s`` seconds until the run ends.

    ``run``: the sweep's run directory (or its ``SweepRun``)."""

    def __init__(self, run: Any, board: Any, refresh_s: float = 1.0) -> None:
        self.liveness = Liveness.of(run)
        self.run, self.board = run, board
        self.trials = W.HTML(value=trials_html(self.liveness))
        self.scatter = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.problem = W.HTML()
        """Why the last refresh failed (it goes on refreshing)."""
        self._failed: set[str] = set()
        self._shown: tuple | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._follow, args=(refresh_s,), name="mlora-sweep", daemon=True
        )
        self._thread.start()

    def _follow(self, refresh_s: float) -> None:
        while not self._stop.is_set():
            final = False
            try:
                final = self.liveness.verdict().state.final
                self.refresh()
                if self.problem.value:
                    self.problem.value = ""
            except Exception as e:  # a refresh that fails is said and logged; the view goes on
                what = f"{type(e).__name__}: {error_line(e)}"
                if what not in self._failed:
                    self._failed.add(what)
                    log.warning("the sweep view's refresh failed: %s", what, exc_info=True)
                self.problem.value = (
                    f"<pre style='color:{RED};white-space:pre-wrap'>sweep view refresh failed at "
                    f"{time.strftime('%H:%M:%S')}: {html.escape(what)}\nit keeps refreshing</pre>"
                )
            if final:
                return
            self._stop.wait(2 * refresh_s)

    def refresh(self) -> None:
        """Update the table, and the scatter when a trial reported since it was drawn (one refresh at a
        time: the follower thread and a caller may both call it)."""
        with self._lock:
            value = trials_html(self.liveness)
            if self.trials.value != value:
                self.trials.value = value
            search = trials.read_search(self.liveness.dir)
            seen = tuple((t.id, len(t.results)) for t in search.trials) if search is not None else None
            if seen != self._shown and search is not None and any(t.results for t in search.trials):
                self.scatter.value = self._scatter_png()
                self._shown = seen

    def _scatter_png(self) -> bytes:
        """Config → objective: each trial at its setting and its objective at its furthest step, one
        panel per searched setting (``lr`` on a log axis with readable ticks on any range; settings
        that are not numbers, such as ``target_modules``, as categories), the best ringed."""
        table = trials.results(self.liveness.dir).dropna(subset=["objective"]).reset_index(drop=True)
        sweep = trials.read_sweep(self.liveness.dir)
        names = list(sweep.space)
        fig = Figure(figsize=(3.2 * len(names), 2.6), layout="constrained")
        axes = fig.subplots(1, len(names), squeeze=False)[0]
        y = drawable(table["objective"].to_numpy(dtype=float))
        for ax, name in zip(axes, names):
            values = table[name]
            numeric = values.map(lambda v: isinstance(v, int | float) and not isinstance(v, bool)).all()
            if numeric:
                x = drawable(values.to_numpy(dtype=float))
            else:
                categories = sorted({str(v) for v in values})
                x = np.array([categories.index(str(v)) for v in values], dtype=float)
            dots = ax.scatter(x, y, c=table["steps"], cmap="viridis", s=28)
            ax.scatter(x[:1], y[:1], s=120, facecolors="none", edgecolors="red")
            if name in LOG_SETTINGS and numeric and (x[np.isfinite(x)] > 0).all():
                set_log_x(ax)
            ax.set_xlabel(plain(name))
            ax.tick_params(axis="x", labelrotation=20, labelsize=7)
            if not numeric:
                set_categories(ax, categories)
        # (the metric alone on the y axis, whose label "<metric> (colour: steps)" ran past the figure's
        # height; the colours are a colour bar's)
        axes[0].set_ylabel(plain(sweep.objective.metric))
        if names:
            fig.colorbar(dots, ax=list(axes), label="steps", pad=0.01)
        return figure_png(fig)

    def stop(self) -> None:
        self._stop.set()
        self.board.stop()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.board)
        display(W.VBox([self.problem, self.trials, self.scatter]))
