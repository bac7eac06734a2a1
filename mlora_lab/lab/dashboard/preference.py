"""The dashboard's view of preference tenants (``Tenant.pref``: DPO and its kin, as TRL's DPOTrainer
computes them).

With the implicit rewards ``r_c = beta (log pi(y_c|x) - log pi_ref(y_c|x))`` of the chosen answer and ``r_r``
of the rejected one, a tenant's train rows log per window the means over its pairs of ``r_c - r_r``
(``rewards/margins``) and of ``[r_c > r_r]`` (``rewards/accuracies``). Both start at 0 when the policy is
the reference; a growing margin and an accuracy towards 1 say the adapter prefers the chosen answers more
than the reference does, in a scale that does not depend on the loss type (``ml.compare`` draws the other
four, ``logps/chosen`` among them: a margin can also grow while both answers lose probability).

- :class:`PreferenceFigure`: each picked preference tenant's margin (smoothed over its faded raw values, like
  the loss) and accuracy against the view's x axis, in the tenant's colour;
- :class:`PreferenceViews`: the figure, made when a chosen run first has a preference tenant's train row,
  shown only while one has, and redrawn only when such rows arrived or a setting changed. A view of other
  runs never builds it; each refresh reads one counter per chosen run for it.
"""

from __future__ import annotations

import threading

import ipywidgets as W
import numpy as np

from mlora_lab.lab.dashboard.figures import WAITING, Hover, Panel, Scene, Smoother
from mlora_lab.lab.plotting import placeholder, style_axes

NO_PREFERENCE_PICKED = "no preference tenant picked"
"""What the panel says when the tenants picked have no preference tenant (the runs have one)."""


class PreferenceFigure(Panel):
    """``rewards/margins`` and ``rewards/accuracies`` of every picked preference tenant (others have none:
    not drawn)."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        super().__init__((12, 2.7), interactive, lock, hover)
        self.margins_ax, self.accuracies_ax = self.axes(1, 2)
        self.smoother = smoother
        style_axes(self.margins_ax, ylabel="rewards/margins")
        style_axes(self.accuracies_ax, ylabel="rewards/accuracies")

    def draw(self, scene: Scene) -> None:
        self.x = scene.x
        keys = [k for k in scene.picked if scene.feeds[k[0]].tenants[k[1]].preference]
        per_line = scene.points(len(keys) * (2 if scene.smoothing > 0 else 1))
        for ax, metric in ((self.margins_ax, "rewards/margins"), (self.accuracies_ax, "rewards/accuracies")):
            shown: set[tuple] = set()
            points = 0
            for key in keys:
                got, _ = self.train_lines(ax, scene, self.smoother, key, metric, smooth=True, points=per_line)
                shown |= got
                # (a window without a pair logs None: NaN, counted as no point)
                points += int(np.isfinite(scene.feeds[key[0]].xy(key[1], metric, scene.x)[1]).sum())
            self.sets[ax].show_only(shown)
            placeholder(ax, None if points else NO_PREFERENCE_PICKED if not keys else WAITING)
            # (a margin may be negative: its axes fit the data; an accuracy is a share, from 0)
            self.autoscale(ax, scene.outliers, from_zero=ax is self.accuracies_ax)


class PreferenceViews:
    """The preference figure, made on first need (see the module docstring); ``box`` is what the dashboard
    places under the loss figure."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        self.box = W.VBox(layout=W.Layout(display="none"))
        self.figure: PreferenceFigure | None = None
        self._make = (interactive, lock, hover, smoother)
        self._drawn: tuple | None = None

    def panels(self) -> tuple[Panel, ...]:
        """The figure once it exists (for the dashboard's x axis, zoom reset, readout, export)."""
        return (self.figure,) if self.figure is not None else ()

    @property
    def shown(self) -> bool:
        return self.box.layout.display != "none"

    def update(self, scene: Scene, force: bool = False) -> bool:
        """Show and redraw the figure for ``scene``; returns whether it was redrawn. Hidden while no chosen
        run has a preference tenant's row; redrawn when such rows arrived, or what is picked or a setting
        changed, or ``force``."""
        versions = tuple(
            (scene.feeds[run].epoch, scene.feeds[run].preference_version) for run in scene.chosen
        )
        if not any(v for _, v in versions):
            if self.shown:
                self.box.layout.display = "none"
            return False
        settings = (scene.x, scene.smoothing, scene.outliers, tuple(scene.chosen))
        version = (tuple(scene.picked), versions, settings)
        if not force and version == self._drawn and self.shown:
            return False
        if self.figure is None:
            self.figure = PreferenceFigure(*self._make)
            self.figure.set_x(scene.x)
            self.box.children = (self.figure.widget, self.figure.readout)
        self.figure.draw(scene)
        self.figure.show()
        self.box.layout.display = ""
        self._drawn = version
        return True
