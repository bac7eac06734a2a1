"""How the lab draws: one module for the dashboard and for ``ml.compare`` / ``plot_losses`` (the data they
draw is :mod:`mlora_lab.lab.series`).

Drawing helpers, shared so that a plot looks the same wherever it is made:

- :data:`PALETTE` and :class:`Colours`: one colour per ``run/tenant``, the same in every figure
  (see :class:`Colours` for the rule); :func:`run_name`: a run's name in a view (unique, even when two
  workdirs hold runs of the same name);
- :func:`ema` / :class:`Ema`: TensorBoard's bias-corrected smoothing, whole or incremental;
- :func:`thin`: at most ``max_points`` per line, keeping each bucket's min and max (spikes stay);
- :func:`with_breaks` / :func:`thin_with_breaks`: lines never join points across a stop → resume gap
  (:func:`~mlora_lab.lab.series.gap_breaks` finds them);
- :func:`style_axes`, :func:`set_log_y`, :func:`robust_ylim`, :func:`placeholder`, :func:`fit_layout`:
  grid on linear and log axes, readable log ticks on narrow ranges, y-limits that ignore outliers,
  a "waiting…" text instead of empty ticks, margins measured so that no label is clipped;
- :func:`figure_png` (2x the display resolution: sharp on high-DPI screens) and :func:`figure_svg`.

Nothing here uses pyplot: figures are ``matplotlib.figure.Figure`` objects with an explicit canvas.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine

# matplotlib's tab10, then ten darker tones: hex, so HTML widgets and plots share one colour per series.
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#e6550d", "#756bb1", "#636363",
]  # fmt: skip

DISPLAY_DPI = 80
"""Figures are laid out at this resolution (a 9-inch figure is 720 CSS pixels wide) ..."""
EXPORT_DPI = 2 * DISPLAY_DPI
"""... and rendered to PNG at twice it, shown at the display size: sharp on high-DPI screens."""

X_LABELS = {
    "tenant step": "tenant step",
    "global step": "global step",
    "tokens": "target tokens seen",
    "wall time": "wall time",
    "relative time": "seconds since the run started",
}
"""The label of each x axis (:data:`~mlora_lab.lab.series.X_AXES`)."""
FEW_POINTS = 25
"""A series with at most this many points is drawn with markers: a single point is a dot, not nothing."""


# -- colours ------------------------------------------------------------------------------------------


def series_key(run: str, tenant: str) -> str:
    """The name a series is known by everywhere (colours, labels): ``"<run dir name>/<tenant>"``."""
    return f"{run}/{tenant}"


def run_name(path: Path, taken: dict[str, Path]) -> str:
    """A run's name in a view (labels, colours, the runs table): its directory's name, unless another
    run of the view (``taken``: name -> path) already has it, then ``<parent>/<name>`` (and a number,
    if need be). The same directory always gets the name it already has. Records the name in ``taken``."""
    path = Path(path).absolute()
    for name, other in taken.items():
        if other == path:
            return name
    name = path.name
    if name in taken:
        name = f"{path.parent.name}/{path.name}"
    base, k = name, 2
    while name in taken:
        name, k = f"{base} ({k})", k + 1
    taken[name] = path
    return name


class Colours:
    """One colour per series key (``run/tenant``), stable across figures.

    A key's colour is ``PALETTE[crc32(key) % 10]`` (matplotlib's ten clearly different tab10 colours):
    the same in the dashboard, in ``ml.compare`` and in next week's notebook, whatever else is drawn.
    Within one figure two keys must not share a colour, so when the hashed colour is taken by a key
    assigned earlier, the next free tab10 colour is used, and once all ten are taken the ten darker
    tones (``PALETTE[10:]``) in the same way. Series are assigned in the order they are listed: runs in
    the given order, each run's tenants in job.json order, then tenants added later; past 20 series
    colours repeat.
    """

    def __init__(self) -> None:
        self._of: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        colour = self._of.get(key)
        if colour is None:
            start = zlib.crc32(key.encode()) % 10
            taken = set(self._of.values())
            candidates = [PALETTE[base + (start + k) % 10] for base in (0, 10) for k in range(10)]
            colour = next((c for c in candidates if c not in taken), PALETTE[start])
            self._of[key] = colour
        return colour

    def __contains__(self, key: str) -> bool:
        return key in self._of

    def items(self) -> Iterable[tuple[str, str]]:
        return self._of.items()


# -- smoothing and thinning ---------------------------------------------------------------------------


def ema(values: np.ndarray, smoothing: float) -> np.ndarray:
    """Exponential moving average with bias correction (TensorBoard's smoothing; 0 = raw values):
    ``s_i = sum_j w^(i-j) v_j / sum_j w^(i-j)`` with ``w = smoothing``. Missing values (NaN) add
    nothing but the weights still decay over them."""
    values = np.asarray(values, dtype=float)
    if smoothing <= 0 or len(values) == 0:
        return values
    return pd.Series(values).ewm(alpha=1 - smoothing, adjust=True).mean().to_numpy()


class Ema:
    """:func:`ema` of an append-only series, extended with only the new points at each call.

    ``num_i = w num_(i-1) + v_i`` and ``den_i = w den_(i-1) + 1`` (NaN: ``+ 0`` to both), ``s_i =
    num_i / den_i``: the state of the bias-corrected average is two numbers, so a refresh costs the new
    points, not the whole series."""

    def __init__(self) -> None:
        self.smoothing = -1.0
        self.out = np.empty(0)
        self._num = self._den = 0.0

    def __call__(self, values: np.ndarray, smoothing: float) -> np.ndarray:
        n, done = len(values), len(self.out)
        if smoothing <= 0:
            return values
        if smoothing != self.smoothing or n < done or n - done > 256:
            # A new factor, a series that was reset, or a big batch of rows: one vectorised pass.
            self.out = ema(values, smoothing)
            self.smoothing = smoothing
            finite = np.isfinite(values)
            # den_n = sum over finite v_j of w^(n-1-j); num_n = s_n * den_n
            powers = smoothing ** np.arange(n - 1, -1, -1, dtype=float)
            self._den = float(powers[finite].sum())
            self._num = float(self.out[-1] * self._den) if n and self._den > 0 else 0.0
            return self.out
        if n == done:
            return self.out
        new = np.empty(n - done)
        w, num, den = smoothing, self._num, self._den
        for i, v in enumerate(values[done:].tolist()):
            finite = v == v and v not in (math.inf, -math.inf)
            num = w * num + (v if finite else 0.0)
            den = w * den + (1.0 if finite else 0.0)
            new[i] = num / den if den > 0 else math.nan
        self._num, self._den = num, den
        self.out = np.concatenate([self.out, new])
        return self.out


def thin_indices(y: np.ndarray, max_points: int) -> np.ndarray | None:
    """Indices of at most ``max_points`` points that keep the shape of ``y``: the series is cut into
    ``max_points // 2 - 1`` buckets and each keeps its lowest and highest point (so a spike survives
    thinning, as it would not with every k-th point); the first and last points are always kept.
    None when nothing needs thinning."""
    n = len(y)
    if n <= max_points:
        return None
    buckets = max(1, max_points // 2 - 1)
    size = math.ceil(n / buckets)
    full = (n // size) * size
    finite = np.isfinite(y)
    lo_src = np.where(finite, y, np.inf)  # a NaN is never a bucket's extreme
    hi_src = np.where(finite, y, -np.inf)
    starts = np.arange(0, full, size)
    parts = [np.array([0, n - 1])]
    if full:
        parts += [
            starts + lo_src[:full].reshape(-1, size).argmin(axis=1),
            starts + hi_src[:full].reshape(-1, size).argmax(axis=1),
        ]
    if full < n:
        parts += [full + np.array([lo_src[full:].argmin(), hi_src[full:].argmax()])]
    return np.unique(np.concatenate(parts))


def thin(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points of ``(x, y)`` (see :func:`thin_indices`), always keeping the last one."""
    idx = thin_indices(np.asarray(y, dtype=float), max_points)
    return (x, y) if idx is None else (x[idx], y[idx])


def with_breaks(x: np.ndarray, y: np.ndarray, breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` with a NaN point inserted before every point where ``breaks`` is True: matplotlib
    does not draw a line through a NaN, so the segments stay apart."""
    where = np.flatnonzero(breaks)
    if not len(where):
        return x, y
    return (
        np.insert(np.asarray(x, dtype=float), where, np.nan),
        np.insert(np.asarray(y, dtype=float), where, np.nan),
    )


def thin_with_breaks(
    x: np.ndarray, y: np.ndarray, breaks: np.ndarray | None, max_points: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`thin`, then :func:`with_breaks`: the points on both sides of a gap are kept, so thinning
    never joins two segments."""
    idx = thin_indices(np.asarray(y, dtype=float), max_points)
    if breaks is None or not breaks.any():
        return (x, y) if idx is None else (x[idx], y[idx])
    if idx is None:
        return with_breaks(x, y, breaks)
    starts = np.flatnonzero(breaks)
    idx = np.union1d(idx, np.concatenate([starts - 1, starts]))
    # a kept point starts a new segment if a break lies between it and the previous kept point
    seg = np.cumsum(breaks)[idx]
    return with_breaks(x[idx], y[idx], np.r_[False, np.diff(seg) > 0])


# -- axes ---------------------------------------------------------------------------------------------


class LogTicks(ticker.Locator):
    """Major ticks for a log y axis that stay readable on any range: decades when the data spans
    three or more, 1-2-5 steps across one to three, and "nice" linear steps inside less than one
    decade (where plain decade ticks give one or two labels, or none)."""

    def __call__(self) -> Sequence[float]:
        vmin, vmax = self.axis.get_view_interval()
        return self.tick_values(vmin, vmax)

    def tick_values(self, vmin: float, vmax: float) -> Sequence[float]:
        vmin, vmax = sorted((vmin, vmax))
        if not (vmin > 0 and np.isfinite(vmax)):
            return ticker.LogLocator().tick_values(max(vmin, 1e-12), max(vmax, 1e-11))
        decades = math.log10(vmax / vmin)
        if decades >= 3:
            return ticker.LogLocator(base=10).tick_values(vmin, vmax)
        if decades >= 1:
            return ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)).tick_values(vmin, vmax)
        locs = ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(vmin, vmax)
        return [v for v in locs if v > 0]


def _plain_number(value: float, _pos: int | None = None) -> str:
    return f"{value:.4g}"


def set_log_y(ax: Axes, log: bool) -> None:
    """Switch the y axis between linear and log, with :class:`LogTicks`, plain-number labels, no minor
    labels, and the grid kept (changing the scale resets locators and the grid)."""
    if (ax.get_yscale() == "log") == log:
        return
    ax.set_yscale("log" if log else "linear")
    if log:
        ax.yaxis.set_major_locator(LogTicks())
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_plain_number))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.grid(True, which="major", alpha=0.3)


def style_axes(
    ax: Axes, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None, size: int = 8
) -> None:
    """The lab's look: a light grid, small ticks, labels and title in one place."""
    ax.grid(True, which="major", alpha=0.3)
    ax.tick_params(labelsize=size)
    if xlabel is not None:
        ax.set_xlabel(xlabel, fontsize=size + 1)
    if ylabel is not None:
        ax.set_ylabel(ylabel, fontsize=size + 1)
    if title is not None:
        ax.set_title(title, fontsize=size + 1)


def set_x_axis(ax: Axes, x: str) -> None:
    """Label and tick the x axis for one of :data:`X_AXES` (clock times for wall time)."""
    import matplotlib.dates as mdates

    ax.set_xlabel(X_LABELS[x], fontsize=9)
    if x == "wall time":
        local = datetime.datetime.now().astimezone().tzinfo  # clock times as the user's clock shows them
        locator = mdates.AutoDateLocator(minticks=3, maxticks=7, tz=local)
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=local))
    else:
        ax.xaxis.set_major_locator(
            ticker.MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=x != "relative time")
        )
        fmt = ticker.ScalarFormatter(useMathText=True)
        fmt.set_powerlimits((-3, 6))
        ax.xaxis.set_major_formatter(fmt)


def robust_ylim(
    values: Iterable[np.ndarray], log: bool = False, q: float = 1.0
) -> tuple[float, float] | None:
    """y-limits that ignore outliers: the ``q``-th to ``(100 - q)``-th percentile of the values, plus a
    5 % margin (in log space on a log axis). None when there is nothing to go by."""
    parts = [np.asarray(v, dtype=float) for v in values]
    data = np.concatenate(parts) if parts else np.empty(0)
    data = data[np.isfinite(data)]
    if log:
        data = np.log10(data[data > 0])
    if len(data) < 2:
        return None
    lo, hi = np.percentile(data, [q, 100 - q])
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 0.05
    lo, hi = lo - pad, hi + pad
    return (10**lo, 10**hi) if log else (float(lo), float(hi))


def placeholder(ax: Axes, text: str | None) -> None:
    """Show ``text`` in the middle of an axes that has nothing to draw yet, without ticks or frame
    (an empty axes otherwise shows meaningless ±0.04 ticks); ``None`` brings the axes back."""
    label = getattr(ax, "_lab_placeholder", None)
    if text is None:
        if label is not None and label.get_visible():
            label.set_visible(False)
            ax.set_axis_on()
        return
    if label is None:
        label = ax.text(
            0.5, 0.5, "", transform=ax.transAxes, ha="center", va="center", color="#7f8c8d", fontsize=10
        )
        ax._lab_placeholder = label
    label.set_text(text)
    label.set_visible(True)
    ax.set_axis_off()


def marker_for(n: int) -> str:
    """A marker for a series of ``n`` points: dots when there are few, so one point is visible."""
    return "o" if n <= FEW_POINTS else ""


def _layout_key(fig: Figure) -> tuple:
    """What decides the margins: per axes its labels, whether it has a title (its text changes, e.g. a
    range in it, do not move the margins), scale and the longest y tick label."""
    key = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        fmt, locs = ax.yaxis.get_major_formatter(), ax.yaxis.get_majorticklocs()
        lo, hi = ax.get_ylim()
        shown = [v for v in locs if min(lo, hi) <= v <= max(lo, hi)]
        try:
            widest = max((len(s) for s in fmt.format_ticks(shown)), default=0)
        except (ValueError, TypeError):
            widest = -1
        key.append(
            (
                ax.get_xlabel(),
                ax.get_ylabel(),
                bool(ax.get_title()),
                ax.get_yscale(),
                widest,
                ax.axison,
                ax.get_xscale(),
                type(ax.xaxis.get_major_formatter()).__name__,
            )
        )
    return tuple(key)


def fit_layout(fig: Figure) -> None:
    """Lay the figure out with matplotlib's constrained layout so that no tick label, axis label or
    title is clipped, but only when something that decides the margins changed (a label, the scale,
    the width of the y tick labels): the layout pass costs as much as drawing the lines, and a live
    dashboard redraws every second."""
    key = _layout_key(fig)
    if getattr(fig, "_lab_layout_key", None) != key:
        ConstrainedLayoutEngine(h_pad=0.04, w_pad=0.04, hspace=0.06, wspace=0.04).execute(fig)
        fig._lab_layout_key = _layout_key(fig)  # the layout pass may itself change tick locations


@contextlib.contextmanager
def _detached(fig: Figure) -> Iterator[None]:
    """Saving at another dpi resizes the figure for a moment, and a figure with a manager (an ipympl
    canvas in a notebook) forwards each resize to the browser: the live plot would jump. Without its
    manager the figure resizes only in memory."""
    canvas = fig.canvas
    manager = getattr(canvas, "manager", None)
    canvas.manager = None
    try:
        yield
    finally:
        canvas.manager = manager


def figure_png(fig: Figure, dpi: int = EXPORT_DPI) -> bytes:
    """The figure as PNG at ``dpi`` (default: twice the display resolution). Compression level 1: a
    live dashboard renders every second, and level 6 costs more time than it saves in bytes."""
    buf = io.BytesIO()
    with _detached(fig):
        fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def figure_svg(fig: Figure) -> bytes:
    """The figure as SVG (text kept as text, so it stays editable)."""
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}), _detached(fig):
        fig.savefig(buf, format="svg")
    return buf.getvalue()
