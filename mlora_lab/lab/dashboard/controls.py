"""The dashboard's controls: the tenants to draw, the x axis, smoothing, log y, outliers, follow
(undo zoom), and the Stop button, which names what it stops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as W

from mlora_lab.lab.dashboard.model import Key
from mlora_lab.lab.plotting import shorten
from mlora_lab.lab.records.series import X_AXES

ENDED_ICONS = {"finished": "check", "stopped": "stop", "failed": "times", "lost": "question"}
"""The Stop button's icon once the runs shown have ended, by how they ended."""


class Controls:
    """The control widgets (:attr:`box`); ``on_change`` is called when one changes what is drawn,
    ``on_x`` with the new x axis, ``on_follow`` / ``on_stop`` when their buttons are pressed.
    ``quieted()`` (a context manager) is entered while the dashboard itself sets a widget."""

    def __init__(
        self,
        x: str,
        smoothing: float,
        logy: bool,
        outliers: bool,
        interactive: bool,
        quieted: Callable[[], Any],
        on_change: Callable[[], None],
        on_x: Callable[[str], None],
        on_follow: Callable[[bool], None],
        on_stop: Callable[[], None],
    ) -> None:
        self._quieted = quieted
        self._known: set[Key] = set()
        self.tenants = W.SelectMultiple(
            options=[], rows=6, description="tenants", layout=W.Layout(width="340px")
        )
        self.all_button = W.Button(description="all", layout=W.Layout(width="60px"))
        self.none_button = W.Button(description="none", layout=W.Layout(width="60px"))
        self.all_button.on_click(lambda _: self.pick_all(True))
        self.none_button.on_click(lambda _: self.pick_all(False))
        self.x_axis = W.Dropdown(options=list(X_AXES), value=x, description="x axis")
        self.smoothing = W.FloatSlider(value=smoothing, min=0.0, max=0.99, step=0.01, description="smoothing")
        self.logy = W.ToggleButton(
            value=logy, description="log y", icon="line-chart", layout=W.Layout(width="90px")
        )
        self.outliers = W.ToggleButton(
            value=outliers,
            description="ignore outliers",
            icon="compress",
            tooltip="y-limits from the 1st-99th percentile of what is shown",
            layout=W.Layout(width="140px"),
        )
        self.follow_button = W.Button(
            description="follow",
            icon="refresh",
            tooltip="undo zoom and pan: follow the data",
            layout=W.Layout(width="90px", display="" if interactive else "none"),
        )
        self.follow_button.on_click(lambda _: on_follow(True))
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(lambda _: on_stop())
        self._on_change = on_change
        # a new outlier rule re-fits y even where the user zoomed (before the redraw)
        self.outliers.observe(lambda _: on_follow(False), names="value")
        for w in (self.tenants, self.smoothing, self.logy, self.outliers):
            w.observe(lambda _: on_change(), names="value")
        self.x_axis.observe(lambda change: on_x(change["new"]), names="value")
        pick = W.HBox([self.all_button, self.none_button], layout=W.Layout(margin="0 0 0 90px"))
        settings = [self.x_axis, self.smoothing, W.HBox([self.logy, self.outliers, self.follow_button])]
        self.box = W.HBox([W.VBox([self.tenants, pick]), W.VBox([*settings, self.stop_button])])

    def offer(self, keys: Sequence[Key], label: Callable[[Key], str]) -> None:
        """Offer these series in the tenants list; those offered for the first time start picked."""
        options = [(label(k), k) for k in keys]
        if list(self.tenants.options) == options:
            return
        old = set(self.tenants.value)
        value = [k for k in keys if k in old or k not in self._known]
        self._known.update(keys)
        with self._quieted():
            self.tenants.options = options
            self.tenants.value = value
            self.tenants.rows = min(10, max(3, len(options)))

    @property
    def known(self) -> set[Key]:
        """Every series offered so far."""
        return self._known

    def pick_all(self, on: bool) -> None:
        with self._quieted():
            self.tenants.value = [k for _, k in self.tenants.options] if on else []
        self._on_change()

    def show_stop(
        self,
        live: list[str],
        chosen: int,
        ended: set[str],
        stopping: set[str],
        title: Callable[[str], str] = str,
    ) -> None:
        """Name what Stop stops: the run (one run shown), ``Stop <run>`` (one live run among several
        shown, by its ``title``) or ``Stop <n> runs``; once asked, ``Stopping…`` until they end; with
        none live, a quiet disabled button saying how they ended (``ended`` holds the chosen runs'
        states): ``run finished``."""
        if not live:  # nothing to stop: a quiet, disabled button that says how the run ended, not a red one
            state = next(iter(ended)) if len(ended) == 1 else "ended"
            self.stop_button.button_style = ""
            self.stop_button.icon = ENDED_ICONS.get(state, "stop")
            self.stop_button.description = f"run {state}" if len(ended) == 1 else "runs ended"
            self.stop_button.disabled = True
            self.stop_button.tooltip = "nothing to stop: " + (
                f"the run is {state}" if len(ended) == 1 else "every run shown has ended"
            )
            return
        self.stop_button.button_style = "danger"
        self.stop_button.icon = "stop"
        if set(live) <= stopping:
            description, disabled = ("Stopping…" if len(live) == 1 else f"Stopping {len(live)} runs…"), True
        elif len(live) == 1:
            description, disabled = ("Stop" if chosen == 1 else f"Stop {shorten(title(live[0]), 30)}"), False
        else:
            description, disabled = f"Stop {len(live)} runs", False
        self.stop_button.description = description
        self.stop_button.disabled = disabled
        self.stop_button.tooltip = "graceful stop (checkpoint, then exit) of " + ", ".join(map(title, live))
