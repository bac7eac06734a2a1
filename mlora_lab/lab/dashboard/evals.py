"""The dashboard's view of the job's evaluations (``JobSpec.evals``): their scores as curves beside the loss.

:class:`EvalFigure` draws one axes per evaluation score ``eval/<name>/<metric>`` (at most
:data:`MAX_AXES`, the first in name order; a note says how many more), each picked tenant's score in its
colour against the view's x axis, and the base model's as a grey dashed line (what the adapters are
measured against). :class:`EvalViews` makes it when a chosen run first has an evaluation row, shows it only
while one has, and redraws it only when evaluation rows arrived or a setting changed (a run's
``eval_version``), so a view without evaluations pays nothing for it.
"""

from __future__ import annotations

import threading

import ipywidgets as W
import numpy as np

from mlora_lab.lab.dashboard.figures import GREY, Hover, Panel, Scene, Smoother
from mlora_lab.lab.plotting import drawable, marker_for, placeholder, plain, style_axes, thin_with_breaks

MAX_AXES = 3
"""Evaluation scores drawn side by side at most (``ml.compare(run, metric="eval/<name>/<metric>")`` draws any)."""


def eval_series(scene: Scene) -> list[str]:
    """The evaluation scores (``eval/<name>/<metric>``) the chosen runs have, in name order."""
    names: set[str] = set()
    for run in scene.chosen:
        feed = scene.feeds[run]
        names.update(feed.base_evals)
        for s in feed.tenants.values():
            names.update(m for m in s.named if m.startswith("eval/"))
    return sorted(names)


class EvalFigure(Panel):
    """One axes per evaluation score, for the series it was made with."""

    def __init__(
        self, series: list[str], interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother
    ) -> None:
        shown = series[:MAX_AXES]
        super().__init__((12, 2.7), interactive, lock, hover)
        self.series = series
        axes = self.axes(1, len(shown), squeeze=False)[0]
        self.by_series = dict(zip(shown, axes))
        for name, ax in self.by_series.items():
            more = f" (+{len(series) - MAX_AXES} more)" if len(series) > MAX_AXES and ax is axes[-1] else ""
            style_axes(ax, ylabel=name.removeprefix("eval/") + more)
        self.smoother = smoother

    def draw(self, scene: Scene) -> None:
        self.x = scene.x
        for name, ax in self.by_series.items():
            lines = self.sets[ax]
            shown: set[tuple] = set()
            keys = [k for k in scene.picked if name in scene.feeds[k[0]].tenants[k[1]].named]
            per_line = scene.points(len(keys) + len(scene.chosen))
            for key in keys:
                got, _ = self.train_lines(ax, scene, self.smoother, key, name, smooth=False, points=per_line)
                shown |= got
            for run in scene.chosen:  # the base's score: what the adapters are measured against
                feed = scene.feeds[run]
                xs, ys, breaks = feed.xy("base", name, scene.x)
                if not len(xs):
                    continue
                line = lines.get(((run, "base"), "main"), color=GREY, linewidth=1.2, linestyle="--")
                line.set_data(*thin_with_breaks(xs, drawable(ys), breaks, per_line))
                line.set_marker(marker_for(len(xs)))
                label = f"{run} / base" if scene.several else "base"
                line.set_label(plain(label))
                self.hover.name(line, label)
                shown.add(((run, "base"), "main"))
            lines.show_only(shown)
            drawn = any(np.isfinite(line.get_ydata()).any() for line in lines.visible())
            placeholder(ax, None if drawn else "no score yet for the tenants picked")
            self.autoscale(ax, scene.outliers)


class EvalViews:
    """The evaluation figure, made on first need; ``box`` is what the dashboard places under the loss."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        self.box = W.VBox(layout=W.Layout(display="none"))
        self.figure: EvalFigure | None = None
        self._make = (interactive, lock, hover, smoother)
        self._drawn: tuple | None = None

    def panels(self) -> tuple[Panel, ...]:
        return (self.figure,) if self.figure is not None else ()

    @property
    def shown(self) -> bool:
        return self.box.layout.display != "none"

    def update(self, scene: Scene, force: bool = False) -> bool:
        """Show and redraw the figure for ``scene`` (see the module docstring); whether it was redrawn."""
        versions = tuple(scene.feeds[run].eval_version for run in scene.chosen)
        if not any(versions):
            if self.shown:
                self.box.layout.display = "none"
            return False
        version = (tuple(scene.picked), versions, scene.x, scene.outliers, tuple(scene.chosen))
        if not force and version == self._drawn and self.shown:
            return False
        series = eval_series(scene)
        if self.figure is None or self.figure.series != series:  # (a new score: new axes)
            self.figure = EvalFigure(series, *self._make)
            self.figure.set_x(scene.x)
            self.box.children = (self.figure.widget, self.figure.readout)
        self.figure.draw(scene)
        self.figure.show()
        self.box.layout.display = ""
        self._drawn = version
        return True
