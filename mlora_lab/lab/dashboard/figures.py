"""The dashboard's figures: the loss, the learning rate and gradient norm (here), and the system tab
(:mod:`.system`), drawn from a :class:`Scene` (what to draw), never from the widgets themselves.

Figures are built with matplotlib's object API, never pyplot, and redrawn by changing line data, not
by new artists. They are interactive (zoom, pan, and a readout of the point under the cursor) on an
ipympl canvas, or PNG images (``interactive=False``: nbclient, Voila, an exported notebook).
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ipywidgets as W
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from mlora_lab.lab.dashboard.model import Key
from mlora_lab.lab.plotting import (
    DISPLAY_DPI,
    LINESTYLES,
    Ema,
    drawable,
    figure_png,
    fit_layout,
    marker_for,
    placeholder,
    plain,
    robust_ylim,
    set_log_y,
    set_x_axis,
    style_axes,
    thin_with_breaks,
)
from mlora_lab.lab.records.series import RunSeries

RED, AMBER, GREEN, GREY, INK = "#c0392b", "#b9770e", "#27ae60", "#7f8c8d", "#2c3e50"
CSS_STYLES = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dashed"}
"""matplotlib's line styles as CSS borders (the HTML legend)."""
POINT_BUDGET = 40_000
"""Points drawn per axes in all (see :meth:`Scene.points`)."""
WAITING = "waiting for the first step…"


@dataclass(frozen=True)
class Scene:
    """What the figures draw now: the series picked, the runs chosen, and the controls' settings."""

    feeds: Mapping[str, RunSeries]
    picked: list[Key]
    chosen: list[str]
    x: str
    smoothing: float
    logy: bool
    outliers: bool
    max_points: int
    label: Callable[[Key], str]
    colour: Callable[[Key], str]

    @property
    def several(self) -> bool:
        return len(self.chosen) > 1

    def style(self, run: str) -> str:
        """A run's line style: solid with one run shown, else one per run in the order chosen (runs of
        the same name share colours: a notebook run twice)."""
        return LINESTYLES[self.chosen.index(run) % len(LINESTYLES)] if self.several else "-"

    def points(self, lines: int) -> int:
        """Points per drawn line: ``max_points``, less when many lines share a figure (drawing costs
        about as much per point as the budget allows; 200 per line still shows each curve's shape)."""
        return max(200, min(self.max_points, POINT_BUDGET // max(1, lines)))


class LineSet:
    """The line artists of one axes, made once per series and then only given new data."""

    def __init__(self, ax: Axes) -> None:
        self.ax = ax
        self.lines: dict[tuple, Line2D] = {}

    def __getitem__(self, key: tuple) -> Line2D:
        return self.lines[key]

    def get(self, key: tuple, **style: Any) -> Line2D:
        line = self.lines.get(key)
        if line is None:
            (line,) = self.ax.plot([], [], **style)
            self.lines[key] = line
        return line

    def show_only(self, keys: set[tuple]) -> list[Line2D]:
        for key, line in self.lines.items():
            line.set_visible(key in keys)
        return [line for key, line in self.lines.items() if key in keys]

    def visible(self, role: str | None = None) -> list[Line2D]:
        """The visible lines (of one role: the last part of their key, ``main``, ``raw``, ``eval``)."""
        return [
            line
            for key, line in self.lines.items()
            if line.get_visible() and (role is None or key[-1] == role)
        ]


class Smoother:
    """One incremental EMA per series (:class:`~mlora_lab.lab.plotting.Ema`); a run whose metrics
    were rewritten (a resume) starts afresh."""

    def __init__(self) -> None:
        self._emas: dict[tuple, Ema] = {}

    def __call__(
        self, feed: RunSeries, key: tuple, metric: str, values: np.ndarray, smoothing: float
    ) -> np.ndarray:
        cache_key = (key, metric, feed.epoch)
        cache = self._emas.get(cache_key)
        if cache is None:
            cache = self._emas[cache_key] = Ema()
        return cache(values, smoothing)


class Hover:
    """The readout of the point under the cursor: which series each drawn line is, and a highlight
    marker per axes."""

    def __init__(self) -> None:
        self.names: dict[Line2D, str] = {}
        self.highlights: dict[Axes, Any] = {}

    def name(self, line: Line2D, text: str) -> None:
        self.names[line] = text

    def hide(self, fig: Figure) -> None:
        """A highlight belongs to the drawing it was made on."""
        for ax in fig.axes:
            if ax in self.highlights:
                self.highlights[ax].set_visible(False)

    def readout_at(self, ax: Axes, x_px: float, y_px: float, x: str, radius_px: float = 25.0) -> str | None:
        """The drawn point nearest to display position ``(x_px, y_px)`` in ``ax`` (whose x axis is
        ``x``), as text ``series · x-label x · y``; None when no point is within ``radius_px`` pixels.
        Also moves the axes' highlight marker onto it."""
        best = None
        for line in ax.get_lines():
            if not line.get_visible() or line not in self.names:
                continue
            xy = np.column_stack([np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)])
            ok = np.isfinite(xy).all(axis=1)
            if not ok.any():
                continue
            xy = xy[ok]
            d = np.hypot(*(ax.transData.transform(xy) - (x_px, y_px)).T)
            i = int(d.argmin())
            if d[i] <= radius_px and (best is None or d[i] < best[0]):
                best = (d[i], line, xy[i])
        highlight = self.highlights.get(ax)
        if best is None:
            if highlight is not None:
                highlight.set_visible(False)
            return None
        _, line, (px, py) = best
        if highlight is None:  # a scatter: collections do not count in relim, so it never moves the limits
            highlight = ax.scatter([], [], s=60, facecolors="none", edgecolors="black", zorder=5)
            self.highlights[ax] = highlight
        highlight.set_offsets([[px, py]])
        highlight.set_visible(True)
        xlabel = ax.get_xlabel() or "x"
        xtext = time.strftime("%H:%M:%S", time.localtime(px * 86400.0)) if x == "wall time" else f"{px:,.6g}"
        return f"<b>{html.escape(self.names[line])}</b> · {html.escape(xlabel)} {xtext} · {py:.6g}"


def png_of_rgba(buffer: np.ndarray) -> bytes:
    """A PNG of an Agg pixel buffer (``[h, w]`` uint32, one RGBA pixel each)."""
    from PIL import Image

    pixels = buffer.view(np.uint8).reshape((*buffer.shape, 4))
    with io.BytesIO() as png:
        Image.fromarray(pixels).save(png, format="png", compress_level=1)
        return png.getvalue()


def interactive_canvas(fig: Figure, lock: threading.RLock) -> W.DOMWidget:
    """An ipympl canvas for ``fig`` (zoom, pan, mouse events) that draws under ``lock``: the refresh
    thread changes line data while the frontend asks the kernel's main thread for a new image."""
    from ipympl.backend_nbagg import Canvas, FigureManager

    class LockedCanvas(Canvas):
        def draw(self) -> None:
            with self.lab_lock:
                super().draw()

        def send_binary(self, data: bytes) -> None:
            """Send one frame (``data``: a PNG, the whole figure or the pixels that changed).

            ipympl 0.10 sends the raw RGBA buffer instead of ``data`` until the kernel has handled the
            frontend's ``initialized`` message: a frame no browser can decode, so the figure stays an
            empty box. Under Run All that message waits behind the cell that blocks (``run.wait()``), so
            every frame the refresh thread pushes meanwhile was lost. Here the frame is always the PNG,
            and the static copy (``_data_url``, for frontends without a live kernel) is kept up to date
            the way ipympl means to."""
            if getattr(self, "syncing_data_url", False):
                full = data if self._current_image_mode == "full" else png_of_rgba(self._last_buff)
                self._data_url = base64.b64encode(full).decode("ascii")
            self.send({"data": json.dumps({"type": "binary"})}, buffers=[data])

    canvas = LockedCanvas(fig)
    canvas.lab_lock = lock
    FigureManager(canvas, 0)  # ipympl's toolbar lives on the manager
    # The frontend sizes its canvas when the kernel answers its "initialized" message, which waits
    # while a cell runs (a dashboard displayed just before ``run.wait()``): give the size now, so the
    # frames pushed from the refresh thread have a canvas to land on.
    _, _, width, height = fig.bbox.bounds
    canvas.manager.resize(width, height)
    canvas.header_visible = False
    canvas.footer_visible = False  # the dashboard's readout names the series, not just x and y
    canvas.toolbar_position = "left"  # ipympl's default: it fades in over the figure's left edge on hover
    return canvas


class Panel:
    """One figure of the dashboard: its axes' line sets, and the widget that shows it (an ipympl
    canvas, or a PNG image rendered at twice the display size)."""

    def __init__(
        self, size: tuple[float, float], interactive: bool, lock: threading.RLock, hover: Hover
    ) -> None:
        self.fig = Figure(figsize=size, dpi=DISPLAY_DPI)
        self.interactive = interactive
        self.hover = hover
        self.sets: dict[Axes, LineSet] = {}
        if interactive:
            self.widget = interactive_canvas(self.fig, lock)
        else:
            FigureCanvasAgg(self.fig)
            self.widget = W.Image(
                format="png", width=str(int(size[0] * DISPLAY_DPI)), layout=W.Layout(max_width="100%")
            )
        self.readout = W.HTML(layout=W.Layout(min_height="1.4em"))
        self.x = "tenant step"  # the x axis drawn last (the readout names its values)
        if interactive:
            self.fig.canvas.mpl_connect("motion_notify_event", lambda event: self.on_motion(event, lock))

    def on_motion(self, event: Any, lock: threading.RLock) -> None:
        """The readout follows the cursor (and the highlight, from one axes to the next)."""
        with lock:
            ax = event.inaxes
            text = self.hover.readout_at(ax, event.x, event.y, self.x) if ax is not None else None
            for other in self.fig.axes:
                if other is not ax and other in self.hover.highlights:
                    self.hover.highlights[other].set_visible(False)
            value = text or ""
            if self.readout.value != value:
                self.readout.value = value
                event.canvas.draw_idle()

    def set_x(self, x: str) -> None:
        """Label and tick the x axes for one of :data:`~mlora_lab.lab.records.series.X_AXES`."""
        for ax in self.fig.axes:
            set_x_axis(ax, x)

    def axes(self, *args: Any, **kwargs: Any) -> Any:
        """``fig.subplots(*args, **kwargs)``, each axes with a line set."""
        axes = self.fig.subplots(*args, **kwargs)
        for ax in np.ravel(axes):
            self.sets[ax] = LineSet(ax)
        return axes

    def show(self) -> None:
        self.hover.hide(self.fig)
        fit_layout(self.fig)
        if self.interactive:
            # draw() renders here and pushes the new frame to the frontend (ipympl's refresh_all); the
            # draw_idle() handshake would wait for the kernel to be idle, so a figure would freeze
            # while a later cell blocks (``run.wait()``), exactly when a live view matters.
            self.widget.draw()
        else:
            self.widget.value = figure_png(self.fig)

    def follow(self) -> None:
        """Undo zooming and panning: every axes follows its data again."""
        for ax in self.fig.axes:
            ax.set_autoscale_on(True)

    def autoscale(self, ax: Axes, outliers: bool, from_zero: bool = False) -> None:
        """Fit the axes to the visible lines, unless the user zoomed or panned it (matplotlib turns
        autoscaling off for an axis the toolbar moved): a refresh must not undo a zoom."""
        if not (ax.get_autoscalex_on() or ax.get_autoscaley_on()):
            return
        ax.relim(visible_only=True)
        ax.autoscale_view()
        if not ax.get_autoscaley_on():
            return
        lines = self.sets[ax].visible()
        if outliers:
            log = ax.get_yscale() == "log"
            lo_x, hi_x = ax.get_xlim()
            shown = []
            # the raw values decide: a spike's smoothed echo is part of the outlier, not of the curve
            for line in self.sets[ax].visible("raw") or lines:
                xs, ys = np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)
                shown.append(ys[(xs >= lo_x) & (xs <= hi_x)])
            lim = robust_ylim(shown, log=log)
            if lim is not None:
                ax.set_ylim(lim, auto=None)
        if from_zero and lines:
            finite = [np.nanmax(line.get_ydata()) for line in lines if np.isfinite(line.get_ydata()).any()]
            ax.set_ylim(0, max(max(finite, default=1.0) * 1.08, 1e-9), auto=None)

    def train_lines(
        self, ax: Axes, scene: Scene, smoother: Smoother, key: Key, metric: str, smooth: bool, points: int
    ) -> tuple[set, int]:
        """Draw one tenant's ``metric`` on ``ax``: the raw values faded under the smoothed ones (when
        smoothing), thinned, broken across gaps on time axes, with markers when there are few points.
        Returns the keys of the lines drawn and the number of points."""
        feed, colour, label = scene.feeds[key[0]], scene.colour(key), scene.label(key)
        lines = self.sets[ax]
        xs, ys, breaks = feed.xy(key[1], metric, scene.x)
        ys = drawable(ys)  # (a loss of 1e308 is drawn at 1e300; the smoothing sees what is drawn)
        s = scene.smoothing if smooth else 0.0
        shown: set[tuple] = set()
        if not len(xs):
            return shown, 0
        style = scene.style(key[0])
        line = lines.get((key, "main"), color=colour, linewidth=1.5, markersize=3)
        smoothed = smoother(feed, key, metric, ys, s) if s > 0 else ys
        line.set_data(*thin_with_breaks(xs, drawable(smoothed), breaks, points))
        line.set_marker(marker_for(len(xs)))
        line.set_linestyle(style)
        line.set_label(plain(label))
        self.hover.name(line, label + (" (smoothed)" if s > 0 else ""))
        shown.add((key, "main"))
        if s > 0 and len(xs) > 1:  # smoothing never hides the data: the raw line stays, faded
            raw = lines.get((key, "raw"), color=colour, linewidth=0.8, alpha=0.25, label="_raw")
            raw.set_linestyle(style)
            raw.set_data(*thin_with_breaks(xs, ys, breaks, points))
            self.hover.name(raw, label + " (raw)")
            shown.add((key, "raw"))
        return shown, len(xs)


class LossFigure(Panel):
    """Train loss (smoothed over its faded raw values) and held-out loss (dots) of every picked tenant,
    with an HTML legend above it (:attr:`legend`)."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        super().__init__((9, 3.6), interactive, lock, hover)
        self.ax = self.axes(1, 1)
        self.lines = self.sets[self.ax]
        self.smoother = smoother
        self.legend = W.HTML()
        style_axes(self.ax, ylabel="loss (lines: train, dots: held-out)")

    def draw(self, scene: Scene) -> None:
        self.x = scene.x
        shown: set[tuple] = set()
        points = 0
        per_line = scene.points(len(scene.picked) * (2 if scene.smoothing > 0 else 1))
        for key in scene.picked:
            got, n = self.train_lines(
                self.ax, scene, self.smoother, key, "loss", smooth=True, points=per_line
            )
            shown |= got
            points += n
            hx, hy, hbreaks = scene.feeds[key[0]].xy(key[1], "eval_loss", scene.x)
            if len(hx):
                style = {
                    "marker": "o",
                    "linestyle": "--",
                    "linewidth": 0.8,
                    "markersize": 4,
                    "label": "_heldout",
                }
                line = self.lines.get((key, "heldout"), color=scene.colour(key), **style)
                line.set_data(*thin_with_breaks(hx, drawable(hy), hbreaks, per_line))
                self.hover.name(line, scene.label(key) + " (held-out)")
                shown.add((key, "heldout"))
        self.lines.show_only(shown)
        placeholder(self.ax, None if points else WAITING)
        set_log_y(self.ax, scene.logy)
        self.autoscale(self.ax, scene.outliers)
        self._update_legend(
            [(self.lines[(k, "main")], scene.label(k)) for k in scene.picked if (k, "main") in shown]
        )

    @contextlib.contextmanager
    def legend_in_figure(self) -> Iterator[None]:
        """A picture of the loss figure (export, the notebook's static copy) has no HTML next to it:
        it gets a real legend for as long as it is rendered."""
        mains = [line for key, line in self.lines.lines.items() if key[1] == "main" and line.get_visible()]
        legend = None
        if mains:
            legend = self.ax.legend(
                handles=mains[:20], fontsize=8, ncol=1 + len(mains[:20]) // 6, loc="upper right"
            )
        try:
            yield
        finally:
            if legend is not None:
                legend.remove()

    def _update_legend(self, mains: list[tuple[Line2D, str]]) -> None:
        """The loss plot's legend, as HTML above it: drawing ten legend entries into the figure costs as
        much as drawing all its lines (text is slow to render at 2x), and an HTML legend never covers
        data. Exports put a real legend into the figure (:meth:`legend_in_figure`)."""
        items = "".join(
            f"<span style='white-space:nowrap;margin-right:12px'><span style='display:inline-block;width:18px;"
            f"height:0;vertical-align:middle;border-top:3px {CSS_STYLES.get(line.get_linestyle(), 'solid')} "
            f"{line.get_color()}'></span> {html.escape(label)}</span>"
            for line, label in mains
        )
        value = (
            f"<div style='font-size:12px;line-height:1.6'>{items}<span style='color:{GREY}'>· faded: raw values · "
            "dots: eval</span></div>"
            if mains
            else ""
        )
        if self.legend.value != value:
            self.legend.value = value


class OptimFigure(Panel):
    """Learning rate and gradient norm (before clipping) of every picked tenant."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        super().__init__((9, 2.7), interactive, lock, hover)
        self.lr_ax, self.grad_ax = self.axes(1, 2)
        self.smoother = smoother
        style_axes(self.lr_ax, title="learning rate")
        style_axes(self.grad_ax, title="gradient norm (before clipping)")

    def draw(self, scene: Scene) -> None:
        self.x = scene.x
        for ax, metric, smooth in ((self.lr_ax, "lr", False), (self.grad_ax, "grad_norm", True)):
            shown: set[tuple] = set()
            points = 0
            per_line = scene.points(len(scene.picked) * (2 if smooth and scene.smoothing > 0 else 1))
            for key in scene.picked:
                got, n = self.train_lines(
                    ax, scene, self.smoother, key, metric, smooth=smooth, points=per_line
                )
                shown |= got
                points += n
            self.sets[ax].show_only(shown)
            placeholder(ax, None if points else WAITING)
            self.autoscale(ax, scene.outliers and metric == "grad_norm")
