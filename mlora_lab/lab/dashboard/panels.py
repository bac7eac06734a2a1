"""The dashboard's figures as one: the loss figure, the tabs' lr + grad-norm and system figures, RL
tenants' views (:mod:`.rl`), preference tenants' (:mod:`.preference`) and the evaluations' scores
(:mod:`.evals`), sharing one hover readout and one smoother; which of them to redraw when (only what
changed: the loss figure at once, the tabs' figures at a slower pace), their x axis, the readout of a
point, and following the data again after a zoom.

Built with the view's model and the drawing lock (:data:`~mlora_lab.lab.plotting.DRAWING`, which the
figures' canvases take for a browser's frame request); the callers hold that lock around every draw.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure

from mlora_lab.lab.dashboard.evals import EvalViews
from mlora_lab.lab.dashboard.figures import Hover, LossFigure, OptimFigure, Panel, Scene, Smoother
from mlora_lab.lab.dashboard.model import ViewModel
from mlora_lab.lab.dashboard.preference import PreferenceViews
from mlora_lab.lab.dashboard.rl import RLViews
from mlora_lab.lab.dashboard.system import SystemFigure

TAB_EVERY_S = 2.0
"""The tabs' figures (system, lr & grad norm) are redrawn at most this often while a run goes, the tab
shown or not: a tab picked while a later cell blocks (``run.wait()``) reaches the kernel only when that
cell ends, so a figure drawn only once its tab is picked would stay empty meanwhile."""


class Panels:
    """The figures of one view: :attr:`loss`, :attr:`optim` and :attr:`system` (made at once, on the x
    axis ``x``), :attr:`rl_views` and :attr:`preference_views` (each made when a run first has such rows)."""

    def __init__(self, model: ViewModel, interactive: bool, lock: threading.RLock, x: str) -> None:
        self.model = model
        self.hover, smoother = Hover(), Smoother()
        self.loss = LossFigure(interactive, lock, self.hover, smoother)
        self.optim = OptimFigure(interactive, lock, self.hover, smoother)
        self.system = SystemFigure(interactive, lock, self.hover, smoother)
        self.rl_views = RLViews(interactive, lock, self.hover, smoother)
        """The reward panel and the recent samples of RL tenants (made when a run first has RL rows)."""
        self.preference_views = PreferenceViews(interactive, lock, self.hover, smoother)
        """The margins and accuracies of preference tenants (made when a run first has their rows)."""
        self.eval_views = EvalViews(interactive, lock, self.hover, smoother)
        """The evaluations' scores (made when a run first has an evaluation row, ``JobSpec.evals``)."""
        self._drawn: dict[str, tuple] = {}
        self._tab_drawn: dict[str, float] = {}
        self.set_x(x)

    def all(self) -> tuple[Panel, ...]:
        """Every figure made so far."""
        return (
            self.loss,
            self.optim,
            self.system,
            *self.rl_views.panels(),
            *self.preference_views.panels(),
            *self.eval_views.panels(),
        )

    @property
    def readouts(self) -> dict[Figure, W.HTML]:
        """The hover readout under each figure."""
        return {panel.fig: panel.readout for panel in self.all()}

    def set_x(self, x: str) -> None:
        for panel in self.all():
            panel.set_x(x)

    def follow(self) -> None:
        """Undo zooming and panning: every axes follows its data again."""
        for panel in self.all():
            panel.follow()

    def update(self, scene: Scene, shown: str | None, force: bool = False) -> None:
        """Redraw the figures whose data or settings changed: the loss figure at once, the tabs' figures
        at most every :data:`TAB_EVERY_S` (``shown``, the tab's figure on screen, at once when ``force``d
        by a control)."""
        versions = tuple(view.series.version for view in self.model.runs.values())
        settings = (scene.x, scene.smoothing, scene.logy, scene.outliers, scene.several)
        version = (tuple(scene.picked), versions, *settings)
        if force or self._drawn.get("loss") != version:
            self.loss.draw(scene)
            self.loss.show()
            self._drawn["loss"] = version
        self.rl_views.update(scene, self.model, force)  # (an SFT-only view: two flags read, nothing drawn)
        self.preference_views.update(scene, force)  # (without preference tenants: a counter per run read)
        self.eval_views.update(scene, force)  # (without evaluations: a counter per run read)
        now = time.monotonic()
        for name, panel in (("system", self.system), ("optim", self.optim)):
            if not force and self._drawn.get(name) == version:
                continue
            due = name not in self._tab_drawn or now - self._tab_drawn[name] >= TAB_EVERY_S
            if (force and shown == name) or due or not self.model.going:
                panel.draw(scene)
                panel.show()
                self._drawn[name] = version
                self._tab_drawn[name] = now

    def redraw(self, scene: Scene, figures: Sequence[str]) -> None:
        """Redraw these figures now (``loss``, ``optim``, ``system``; ``reward``, ``preference`` and ``evals``
        once shown)."""
        panels = {"loss": self.loss, "optim": self.optim, "system": self.system}
        if self.rl_views.figure is not None:
            panels["reward"] = self.rl_views.figure
        if self.preference_views.figure is not None:
            panels["preference"] = self.preference_views.figure
        if self.eval_views.figure is not None:
            panels["evals"] = self.eval_views.figure
        for name in figures:
            panels[name].draw(scene)
            panels[name].show()

    def exported(self, scene: Scene) -> list[tuple[str, Figure]]:
        """Every figure drawn for ``scene``, by the name its files get (``reward`` with RL tenants,
        ``preference`` with preference tenants)."""
        for panel in self.all():
            panel.draw(scene)
        drawn = [("loss", self.loss.fig), ("optim", self.optim.fig), ("system", self.system.fig)]
        if self.rl_views.figure is not None and self.model.rewarded(scene.chosen):
            drawn.append(("reward", self.rl_views.figure.fig))
        if self.preference_views.figure is not None and self.preference_views.shown:
            drawn.append(("preference", self.preference_views.figure.fig))
        if self.eval_views.figure is not None and self.eval_views.shown:
            drawn.append(("evals", self.eval_views.figure.fig))
        return drawn

    def readout_at(self, ax: Any, x_px: float, y_px: float, radius_px: float = 25.0) -> str | None:
        """The drawn point nearest to display position ``(x_px, y_px)`` in ``ax``, as text
        ``series · x-label x · y`` (None when no point is within ``radius_px`` pixels), and the axes'
        highlight moved onto it."""
        panel = next(p for p in self.all() if ax.figure is p.fig)
        return self.hover.readout_at(ax, x_px, y_px, panel.x, radius_px)
