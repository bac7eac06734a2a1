"""How the lab draws: one module for the dashboard and for ``ml.compare`` / ``plot_losses`` (the data they
draw is :mod:`mlora_lab.lab.records.series`).

Drawing helpers, shared so that a plot looks the same wherever it is made:

- :data:`PALETTE` and :func:`series_colour`: one colour per (run, tenant), the same in every figure and
  every time the notebook runs; :func:`run_name`: a run's key in a view (unique, even when two workdirs
  hold runs of the same name); :func:`run_titles`, :func:`series_label`: what labels call runs and
  series; :func:`plain`: user text that matplotlib never parses as mathtext; :func:`category_label`,
  :func:`set_categories`: a setting's values on a category axis;
- :func:`ema` / :class:`Ema`: TensorBoard's bias-corrected smoothing, whole or incremental;
- :func:`thin`: at most ``max_points`` per line, keeping each bucket's min and max (spikes stay);
- :func:`with_breaks` / :func:`thin_with_breaks`: lines never join points across a stop → resume gap
  (:func:`~mlora_lab.lab.records.series.gap_breaks` finds them);
- :func:`style_axes`, :func:`set_log_y`, :func:`robust_ylim`, :func:`placeholder`, :func:`fit_layout`:
  grid on linear and log axes, readable log ticks on narrow ranges, y-limits that ignore outliers,
  a "waiting…" text instead of empty ticks, margins measured so that no label is clipped;
- :func:`figure_png` (2x the display resolution: sharp on high-DPI screens) and :func:`figure_svg`;
  :class:`LabFigure`: the figure ``ml.compare``, ``plot_losses`` and ``ml.hparams`` return, shown as a PNG;
- :data:`DRAWING`: the one lock under which every figure of the lab is laid out and drawn.

Nothing here uses pyplot: figures are ``matplotlib.figure.Figure`` objects with an explicit canvas.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import math
import re
import threading
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

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

LINESTYLES = ["-", "--", ":", "-."]
"""One per run where a figure shows several (solid for the first)."""

DISPLAY_DPI = 80
"""Figures are laid out at this resolution (a 9-inch figure is 720 CSS pixels wide) ..."""
EXPORT_DPI = 2 * DISPLAY_DPI
"""... and rendered to PNG at twice it, shown at the display size: sharp on high-DPI screens."""

DRAWING = threading.RLock()
"""Every figure the lab lays out or draws, in any thread, is drawn under this lock. matplotlib is not
thread-safe, and a notebook draws from two threads at once: a live dashboard's refresh thread, and the
main thread (``ml.compare`` or a second dashboard's ipympl canvas, while the first refreshes). Drawing
shares state across figures: mathtext's one parser keeps its state stack on itself, and a tick label
parsed in one thread while another parses failed as "ParseException: exception raised in parse action
(at char 0)". Re-entrant: a dashboard holds it around a refresh that draws several figures."""

X_LABELS = {
    "tenant step": "tenant step",
    "global step": "global step",
    "tokens": "target tokens seen",
    "wall time": "wall time",
    "relative time": "seconds since the run started",
}
"""The label of each x axis (:data:`~mlora_lab.lab.records.series.X_AXES`)."""
FEW_POINTS = 25
"""A series with at most this many points is drawn with markers: a single point is a dot, not nothing."""


# -- colours ------------------------------------------------------------------------------------------


def series_key(run: str, tenant: str) -> str:
    """The name a series is known by in messages: ``"<run>/<tenant>"``."""
    return f"{run}/{tenant}"


def run_name(path: Path, taken: dict[str, Path]) -> str:
    """A run's key in a view (``dash.choose``, the runs table's rows): its directory's name, unless another
    run of the view (``taken``: key -> path) already has it, then ``<parent>/<name>`` (and a number,
    if need be). The same directory always gets the key it already has. Records the key in ``taken``.
    (What labels show is the run's title: :func:`run_titles`.)"""
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


RUN_ID = re.compile(r"(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})-[0-9a-f]{6}")
"""A run directory named by a launch (``20261125-185851-94644c``)."""


def run_titles(runs: Sequence[tuple[str, str]]) -> list[str]:
    """What labels call each of ``runs`` (``(name, key)`` pairs: the job's ``JobSpec.name`` and the run's
    key in the view, :func:`run_name`): the name, and where two runs shown together share it (a
    notebook run twice), the time its directory was made (``quickstart · 11-25 18:58:51``), else its
    key."""
    counts = Counter(name for name, _ in runs)
    titles = []
    for name, key in runs:
        if counts[name] > 1 and key != name:
            m = RUN_ID.fullmatch(Path(key).name)
            name = f"{name} · " + (f"{m[2]}-{m[3]} {m[4]}:{m[5]}:{m[6]}" if m else key)
        titles.append(name)
    seen: Counter[str] = Counter()
    out = []
    for title in titles:  # the same second twice: numbered
        seen[title] += 1
        out.append(title if titles.count(title) == 1 else f"{title} #{seen[title]}")
    return out


def shorten(text: str, limit: int) -> str:
    """``text`` cut in the middle to at most ``limit`` characters (``"a-long…name"``): both ends stay,
    which is where runs and trials differ."""
    if len(text) <= limit:
        return text
    if limit < 3:
        return text[:limit]
    head = limit // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


LABEL_CHARS = 48
"""A series' label (``run / tenant``) is at most this long: the run's title is shortened first."""


def series_label(run_title: str | None, tenant: str, limit: int = LABEL_CHARS) -> str:
    """A series' label in legends, progress rows and readouts: ``tenant`` when one run is shown
    (``run_title`` None), else ``run / tenant``; the run's title is cut in the middle so that the
    label fits in ``limit`` characters, and the tenant's name only once the title is down to 12."""
    if run_title is None:
        return shorten(tenant, limit)
    room = limit - 3 - len(tenant)
    if room >= min(12, len(run_title)):
        return f"{shorten(run_title, room)} / {tenant}"
    title = shorten(run_title, 12)
    return f"{title} / {shorten(tenant, limit - 3 - len(title))}"


NOTE_CHARS = 4000
"""A run's note is shown up to this many characters (what ``run.note`` accepts)."""


def cut_note(note: str, limit: int = NOTE_CHARS) -> str:
    """A note as the lab shows it: whole up to ``limit`` characters, else its start and how long it is
    (a hand-written labels.json may hold megabytes)."""
    if len(note) <= limit:
        return note
    return f"{note[:limit]}… (cut: the note is {len(note):,} characters long)"


def plain(text: object) -> str:
    """User text (a run's or tenant's name, a setting's value) as matplotlib shows it literally: every
    ``$`` escaped, so an even number of them is never parsed as mathtext (which may raise, and the
    figure with it)."""
    return str(text).replace("$", r"\$")


CATEGORY_CHARS = 40
"""A setting's value on a category axis (``target_modules``, ``schedule``) is shown whole up to this many
characters: four projections (``q_proj,k_proj,v_proj,o_proj``) are what tells two trials apart, and a
cut in their middle hid exactly that; past it (a hand-written list of every layer) it is cut in the
middle, and the point's readout has it whole."""


def category_label(value: object, limit: int = CATEGORY_CHARS) -> str:
    """A setting's value as a category's tick label: plain text (:func:`plain`), at most ``limit``
    characters (:data:`CATEGORY_CHARS`)."""
    return plain(shorten(str(value), limit))


def set_categories(ax: Axes, categories: Sequence[object]) -> None:
    """Put ``categories`` (the values of a setting that is not a number: ``target_modules``,
    ``schedule``) on the x axis at 0, 1, ..., each labelled :func:`category_label`, slanted and ending
    under its tick: long labels (four projections) then lie side by side instead of running into the
    next one."""
    ax.set_xticks(range(len(categories)), [category_label(c) for c in categories])
    ax.set_xlim(-0.5, len(categories) - 0.5)
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
        label.set_rotation_mode("anchor")


def series_colour(run: str, index: int) -> str:
    """The colour of tenant number ``index`` of the run named ``run`` (``JobSpec.name``), the same in the
    dashboard (one run or several), in ``ml.compare``, ``ml.hparams`` and after the notebook is run again.

    ``PALETTE[(crc32(run) + index) % 10]`` (matplotlib's ten clearly different tab10 colours), in the
    darker tones (``PALETTE[10:]``) for tenants 10-19, repeating from tenant 20: a run's tenants never
    share a colour (up to 20), each run starts its tenants at its own place in the palette, and
    nothing but the run's name and the tenant's place in its run (job.json's order, then tenants in the
    order they first appear in the metrics) decides it: not what else a figure shows, nor in which
    order. Runs of the same name (a notebook run again) get the same colours: figures that show them
    together tell them apart by line style and label."""
    start = zlib.crc32(run.encode("utf-8", "surrogatepass")) % 10
    return PALETTE[(start + index) % 10 + 10 * ((index // 10) % 2)]


MAX_DRAWN = 1e300
"""Values are drawn clipped to ±this: matplotlib's limits overflow past ~1e307 (a loss of 1e308 made
the whole figure fail), and a spike of 1e300 is still a spike."""


def drawable(values: np.ndarray) -> np.ndarray:
    """``values`` as a figure can draw them: floats, clipped to ±:data:`MAX_DRAWN`; NaN and ±inf stay
    gaps (matplotlib never joins a line through them)."""
    v = np.asarray(values, dtype=float)
    finite = np.isfinite(v)
    if finite.all() and (not len(v) or np.abs(v).max() <= MAX_DRAWN):
        return v
    return np.where(finite, np.clip(v, -MAX_DRAWN, MAX_DRAWN), np.nan)


# -- smoothing and thinning ---------------------------------------------------------------------------


SMOOTHING = 0.6
"""The smoothing the dashboard draws with by default, and that ``best_smoothed_loss`` columns use."""


def best_smoothed(values: np.ndarray, smoothing: float = SMOOTHING) -> float | None:
    """The lowest point of the smoothed curve (:func:`ema` with ``smoothing``): a train loss's "best",
    which one lucky batch cannot set (the raw minimum can). None without a finite value."""
    v = drawable(values)
    if not np.isfinite(v).any():
        return None
    return float(np.nanmin(ema(v, smoothing)))


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


def set_log_x(ax: Axes) -> None:
    """A log x axis whose ticks stay readable on any range (:class:`LogTicks`: inside one decade, e.g. an
    lr searched from 3e-4 to 2e-3, plain steps instead of a pile of minor labels)."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogTicks())
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(_plain_number))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


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
    """Label and tick the x axis for one of :data:`X_AXES` (clock times for wall time).

    The x limits start over at (0, 1): limits left from another axis mean nothing on this one, and an
    axes with no drawable point on it (a system row stamped in the year 33658 is NaN on the wall clock)
    would keep them: 1e12 seconds taken as days is past the dates matplotlib can tick, and the whole
    figure failed."""
    import matplotlib.dates as mdates

    ax.set_xlim(0, 1, auto=None)  # (auto=None: a zoom's autoscale-off, or on, is left as it is)
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
    with DRAWING:
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
    with DRAWING, _detached(fig):
        fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def figure_svg(fig: Figure) -> bytes:
    """The figure as SVG (text kept as text, so it stays editable)."""
    import matplotlib

    buf = io.BytesIO()
    with DRAWING, matplotlib.rc_context({"svg.fonttype": "none"}), _detached(fig):
        fig.savefig(buf, format="svg")
    return buf.getvalue()


class LabFigure(Figure):
    """A matplotlib Figure that shows itself in notebooks as a PNG without pyplot state (so it is
    displayed once, also in kernels where the inline backend was never activated). The PNG is rendered
    at twice the display resolution and shown at the display size (sharp on high-DPI screens); the
    figure uses constrained layout, so no label is clipped. ``savefig(path)`` writes any format
    (``.svg`` for vector graphics)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("layout", "constrained")
        kwargs.setdefault("dpi", DISPLAY_DPI)
        super().__init__(*args, **kwargs)

    def _repr_png_(self) -> tuple[bytes, dict[str, int]]:
        w, h = self.get_size_inches() * DISPLAY_DPI
        return figure_png(self), {"width": int(w), "height": int(h)}
