"""The live dashboard: one view over one run, several runs, or every run of a workdir.

    run = ml.launch(spec)
    run.dashboard()                          # = ml.Dashboard([run]).start(); returns at once
    ml.Dashboard([run_a, run_b]).start()     # overlay two runs' tenants, labelled "run / tenant"
    ml.Dashboard("runs").start()             # a table of the workdir's runs; tick the ones to plot

It refreshes from the run directories in a background thread (the kernel stays free) and only reads
them (metrics.jsonl incrementally, status.json, labels.json, logs/), writing nothing but control
messages (Stop) and exports. It works the same for a run launched a minute ago, one attached after a
kernel restart, or one that finished yesterday.

What it shows: a header per run (state, step, tokens/s, elapsed, ETA); with several runs a sortable,
filterable runs table to pick from; per tenant a progress row (state, loss, elapsed, ETA, the reason
of a failure); the loss (train lines, smoothed over a faded raw line, and eval dots) against the
tenant step, the global step, tokens seen, the wall clock or the time since the run started; tabs
with memory per rank, CPU/GPU utilisation, throughput and each tenant's adapter + optimiser memory;
learning rate and gradient norm; a live tail of each rank's log; export of the figures (PNG, SVG)
and of the shown tenants' metrics (CSV).

Figures are interactive (zoom, pan, and a readout of the point under the cursor) when ipympl is
installed (``interactive=None``, the default), and PNG images otherwise or with ``interactive=False``
(for nbclient, Voila or an exported notebook: every frontend shows them). Either way they are built
with matplotlib's object API, never pyplot, and redrawn by changing line data, not by new artists.
"""

from __future__ import annotations

import base64
import contextlib
import html
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as W
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from mlora_lab.launch import Run, attach
from mlora_lab.plotting import (
    DISPLAY_DPI,
    PALETTE,
    TIME_AXES,
    X_AXES,
    Colours,
    Ema,
    RunSeries,
    ema,
    figure_png,
    figure_svg,
    fit_layout,
    gap_breaks,
    marker_for,
    placeholder,
    robust_ylim,
    run_name,
    series_key,
    set_log_y,
    set_x_axis,
    style_axes,
    thin,
    thin_with_breaks,
)
from mlora_lab.rundir import (
    FINAL_STATES,
    RowKind,
    RunDirError,
    RunState,
    Status,
    atomic_write_bytes,
    control,
    read_status,
    shown_tenant_state,
)

__all__ = ["PALETTE", "Dashboard", "ema", "thin"]  # PALETTE/ema/thin: re-exported from mlora_lab.plotting

RunLike = Run | str | Path
Key = tuple[str, str]  # (run name, tenant)

RED, AMBER, GREEN, GREY, INK = "#c0392b", "#b9770e", "#27ae60", "#7f8c8d", "#2c3e50"
STATE_COLOURS = {
    RunState.FAILED: RED, RunState.LOST: RED, RunState.FINISHED: GREEN, RunState.STOPPED: GREY,
    "failed": RED, "refused": RED, "finished": GREEN, "stopped": GREY, "removed": GREY, "paused": AMBER,
    "lost": RED, "broken": RED,
}  # fmt: skip
ERROR_LINE = re.compile(r"Traceback|Error|error:|Exception|\bFAILED\b|Killed")
LOG_LINES = 40
SYSTEM_EVERY_S = 2.0  # the system tab changes slowly: redraw it at most this often while a run goes
RESCAN_EVERY_S = 5.0  # a workdir view looks for new runs (and re-reads tags) this often
MAX_BARS = 20
POINT_BUDGET = 40_000  # points drawn per axes in all (see Dashboard._points)
SORT_KEYS = ("started", "run", "state", "steps", "best loss", "tenants")


def _duration(seconds: float | None) -> str:
    """``42 s``, ``3:05``, ``1:02:03``; ``?`` when unknown."""
    if seconds is None or not np.isfinite(seconds):
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _runs_of(runs: RunLike | Sequence[RunLike]) -> tuple[list[Run], Path | None]:
    """The runs to offer and, for a workdir, the directory to watch for new ones."""
    if isinstance(runs, Run):
        return [runs], None
    if isinstance(runs, (str, Path)):
        path = Path(runs)
        if (path / "job.json").is_file():
            return [attach(path)], None
        if not path.is_dir():
            raise RunDirError(f"{path}: neither a run directory nor a workdir of runs")
        return [], path
    return [r if isinstance(r, Run) else attach(r) for r in runs], None


def _tail(path: Path, lines: int = LOG_LINES, max_bytes: int = 64 << 10) -> str:
    """The last ``lines`` lines of a text file, reading at most its last ``max_bytes``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _labels_of(path: Path) -> tuple[str, str]:
    """A run's tags (comma-joined) and note; empty when it has none or they cannot be read."""
    try:
        from mlora_lab.rundir.labels import read_labels
    except ImportError:  # an older mlora_lab without labels
        return "", ""
    try:
        labels = read_labels(path)
    except (RunDirError, OSError):
        return "", ""
    return ", ".join(labels.tags), labels.note


def _ipympl_available() -> bool:
    try:
        import ipympl.backend_nbagg  # noqa: F401
    except ImportError:
        return False
    return True


def _interactive_canvas(fig: Figure, lock: threading.RLock) -> W.DOMWidget:
    """An ipympl canvas for ``fig`` (zoom, pan, mouse events) that draws under ``lock``: the refresh
    thread changes line data while the frontend asks the kernel's main thread for a new image."""
    from ipympl.backend_nbagg import Canvas, FigureManager

    class LockedCanvas(Canvas):
        def draw(self) -> None:
            with self.lab_lock:
                super().draw()

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


class _Lines:
    """The line artists of one axes, made once per series and then only given new data."""

    def __init__(self, ax: Any) -> None:
        self.ax = ax
        self.lines: dict[tuple, Line2D] = {}

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


class _RunRow:
    """One row of the runs table: a checkbox and the run's cells."""

    def __init__(self, name: str, on_tick: Any) -> None:
        self.check = W.Checkbox(value=False, indent=False, layout=W.Layout(width="28px"))
        self.check.observe(on_tick, names="value")
        self.cells = W.HTML()
        self.box = W.HBox([self.check, self.cells], layout=W.Layout(align_items="center"))
        self.name = name


class _TenantRow:
    """A tenant's progress row: name, bar and numbers on one line of fixed widths, and the reason of a
    failure below it, cut to one line with the whole text in its tooltip (a long reason never
    squeezes the bar)."""

    def __init__(self, label: str, colour: str, max_steps: int | None) -> None:
        self.label = None
        self.name = W.HTML(layout=W.Layout(width="220px", min_width="220px"))
        self.bar = W.IntProgress(value=0, min=0, max=max(1, max_steps or 1),
                                 layout=W.Layout(width="200px", min_width="200px"))  # fmt: skip
        self.bar.style.bar_color = colour
        self.info = W.HTML(layout=W.Layout(width="460px", min_width="200px"))
        self.reason = W.HTML(layout=W.Layout(width="880px", max_width="100%", display="none"))
        self.box = W.VBox([W.HBox([self.name, self.bar, self.info]), self.reason])
        self.rename(label, colour)

    def rename(self, label: str, colour: str) -> None:
        """Show another label (``tenant`` becomes ``run / tenant`` when a second run is chosen)."""
        if label != self.label:
            self.label = label
            swatch = f"<span style='display:inline-block;width:10px;height:10px;background:{colour};margin-right:4px'></span>"
            self.name.value = (
                f"<div title='{html.escape(label, quote=True)}' style='white-space:nowrap;overflow:hidden;"
                f"text-overflow:ellipsis'>{swatch}<b style='color:{colour}'>{html.escape(label)}</b></div>"
            )


class Dashboard:
    """A live view over one or several runs (see the module docstring).

    ``runs``: a :class:`~mlora_lab.launch.Run`, a run directory, a list of them, or a workdir (every run
    under it is offered in the runs table and new ones appear as they are launched; the live ones, or
    else the newest, are plotted first). Tick runs in the table to overlay them.

    Options: ``refresh_s`` (seconds between refreshes), ``interactive`` (None: ipympl figures when
    ipympl is installed, else PNG; False: PNG), ``x`` (one of ``tenant step``, ``global step``,
    ``tokens``, ``wall time``, ``relative time``), ``smoothing`` (EMA factor in [0, 1); the raw values
    stay drawn, faded, underneath), ``logy``, ``ignore_outliers`` (y-limits from the 1st-99th
    percentile of what is shown), ``max_points`` (per drawn line; longer series are thinned keeping
    each bucket's min and max) and ``export_dir`` (where Export writes; default: the run's
    ``exports/`` folder for one run, ``exports/`` next to the runs for several).

    ``start()`` begins refreshing in the background and returns the dashboard; ``refresh()`` refreshes
    once; ``stop()`` stops refreshing (the runs are not touched); ``export()`` writes the figures and
    metrics; ``choose(names)`` picks the runs to plot.
    """

    def __init__(
        self,
        runs: RunLike | Sequence[RunLike],
        refresh_s: float = 1.0,
        interactive: bool | None = None,
        x: str = "tenant step",
        smoothing: float = 0.6,
        logy: bool = False,
        ignore_outliers: bool = False,
        max_points: int = 800,
        export_dir: str | Path | None = None,
    ) -> None:
        if x not in X_AXES:
            raise ValueError(f"unknown x axis {x!r}; choose from {', '.join(X_AXES)}")
        offered, self.workdir = _runs_of(runs)
        self.refresh_s = refresh_s
        self.max_points = max_points
        self.interactive = _ipympl_available() if interactive is None else bool(interactive)
        self._lock = threading.RLock()
        self._quiet = 0  # > 0 while the dashboard itself changes widgets: observers do not redraw
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._handles: list[Any] = []
        self.feeds: dict[str, RunSeries] = {}
        self._paths: dict[str, Path] = {}  # run name -> its directory
        self.states: dict[str, str] = {}
        self._status: dict[str, Status | None] = {}
        self._labels: dict[str, tuple[str, str]] = {}
        self._labels_read = 0.0
        self._rescanned = time.monotonic()
        self.colours = Colours()
        self._emas: dict[tuple, Ema] = {}
        self._known_keys: set[Key] = set()
        self._drawn: dict[str, tuple] = {}
        self._system_drawn = 0.0
        self._hover: dict[Line2D, str] = {}
        self._stopping: set[str] = set()

        self._build_widgets(x, smoothing, logy, ignore_outliers, export_dir)
        self._build_figures()
        for run in offered:
            self._add_run(run)
        if self.workdir is not None:
            self._rescan()
        with self._quieted():
            self._poll()
            live = [n for n in self.feeds if n in self.states and self.states[n] not in FINAL_STATES]
            default = list(self.feeds) if self.workdir is None else (live or list(self.feeds)[-1:])
            self._set_chosen(default)

    # -- construction ----------------------------------------------------------------------------
    def _build_widgets(self, x: str, smoothing: float, logy: bool, outliers: bool, export_dir: Any) -> None:
        self.status = W.HTML()
        # runs table (shown when more than one run is offered)
        self.run_filter = W.Text(placeholder="filter: run, tenant or tag", layout=W.Layout(width="240px"))
        self.state_filter = W.Dropdown(options=["any state", "running", "finished", "failed", "stopped", "lost", "starting"],
                                       layout=W.Layout(width="130px"))  # fmt: skip
        self.sort_by = W.Dropdown(options=list(SORT_KEYS), value="started", description="sort by",
                                  layout=W.Layout(width="210px"))  # fmt: skip
        self.sort_desc = W.ToggleButton(value=True, description="descending", icon="sort-amount-desc",
                                        layout=W.Layout(width="130px"))  # fmt: skip
        self._table_header = W.HTML(self._row_html(None))
        self._table_rows = W.VBox(layout=W.Layout(max_height="240px", overflow="auto"))
        self._run_rows: dict[str, _RunRow] = {}
        for w in (self.run_filter, self.state_filter, self.sort_by, self.sort_desc):
            w.observe(lambda _: self._render_table(), names="value")
        self.sort_desc.observe(self._on_sort_direction, names="value")
        self.runs_box = W.VBox(
            [W.HBox([self.run_filter, self.state_filter, self.sort_by, self.sort_desc]), self._table_header,
             self._table_rows],
            layout=W.Layout(display="none", border="1px solid #ddd", padding="4px", margin="4px 0"),
        )  # fmt: skip
        # controls
        self.tenants = W.SelectMultiple(options=[], rows=6, description="tenants",
                                        layout=W.Layout(width="340px"))  # fmt: skip
        self.all_button = W.Button(description="all", layout=W.Layout(width="60px"))
        self.none_button = W.Button(description="none", layout=W.Layout(width="60px"))
        self.all_button.on_click(lambda _: self._pick_all(True))
        self.none_button.on_click(lambda _: self._pick_all(False))
        self.x_axis = W.Dropdown(options=list(X_AXES), value=x, description="x axis")
        self.smoothing = W.FloatSlider(value=smoothing, min=0.0, max=0.99, step=0.01, description="smoothing")
        self.logy = W.ToggleButton(
            value=logy, description="log y", icon="line-chart", layout=W.Layout(width="90px")
        )
        self.outliers = W.ToggleButton(value=outliers, description="ignore outliers", icon="compress",
                                       tooltip="y-limits from the 1st-99th percentile of what is shown",
                                       layout=W.Layout(width="140px"))  # fmt: skip
        self.follow_button = W.Button(description="follow", icon="refresh", tooltip="undo zoom and pan: follow the data",
                                      layout=W.Layout(width="90px", display="" if self.interactive else "none"))  # fmt: skip
        self.follow_button.on_click(lambda _: self.follow())
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop)
        # a new scale or outlier rule re-fits y even where the user zoomed (before the redraw)
        self.logy.observe(lambda _: self._loss_ax.set_autoscaley_on(True), names="value")
        self.outliers.observe(lambda _: self.follow(redraw=False), names="value")
        for w in (self.tenants, self.smoothing, self.logy, self.outliers):
            w.observe(lambda _: self._changed(), names="value")
        self.x_axis.observe(self._on_x, names="value")
        controls = W.HBox([
            W.VBox([self.tenants, W.HBox([self.all_button, self.none_button], layout=W.Layout(margin="0 0 0 90px"))]),
            W.VBox([self.x_axis, self.smoothing, W.HBox([self.logy, self.outliers, self.follow_button]),
                    self.stop_button]),
        ])  # fmt: skip
        self.progress = W.VBox(layout=W.Layout(max_height="300px", overflow="auto"))
        self._progress_rows: dict[Key, _TenantRow] = {}
        # logs and export tabs
        self.log_rank = W.Dropdown(options=[], description="log")
        self.log_rank.observe(lambda _: self._update_log(force=True), names="value")
        self.log_view = W.HTML()
        self._log_shown: tuple | None = None
        self.export_dir = W.Text(value=str(export_dir) if export_dir else "", description="folder",
                                 layout=W.Layout(width="640px"))  # fmt: skip
        self._export_dir_given = export_dir is not None
        self.export_figures_button = W.Button(description="Save figures (PNG + SVG)", icon="image",
                                              layout=W.Layout(width="220px"))  # fmt: skip
        self.export_csv_button = W.Button(
            description="Save metrics (CSV)", icon="table", layout=W.Layout(width="180px")
        )
        self.export_figures_button.on_click(lambda _: self._export_clicked(figures=True))
        self.export_csv_button.on_click(lambda _: self._export_clicked(figures=False))
        self.export_message = W.HTML()
        self._controls = controls

    def _build_figures(self) -> None:
        self.loss_fig, self.loss_plot = self._figure((9, 3.6))
        self._loss_ax = self.loss_fig.add_subplot(1, 1, 1)
        style_axes(self._loss_ax, ylabel="loss (lines: train, dots: eval)")
        self.optim_fig, self.optim_plot = self._figure((9, 2.7))
        self._lr_ax, self._grad_ax = self.optim_fig.subplots(1, 2)
        style_axes(self._lr_ax, title="learning rate")
        style_axes(self._grad_ax, title="gradient norm (before clipping)")
        self.system_fig, self.system_plot = self._figure((9, 4.8))
        (self._mem_ax, self._util_ax), (self._tput_ax, self._bars_ax) = self.system_fig.subplots(2, 2)
        style_axes(self._mem_ax, title="memory per rank (MiB)")
        style_axes(self._util_ax, title="utilisation (%): GPU solid, CPU dashed")
        style_axes(self._tput_ax, title="tokens / s")
        style_axes(self._bars_ax, title="adapter + optimiser per tenant (MiB)")
        for ax in self.loss_fig.axes + self.optim_fig.axes + [self._mem_ax, self._util_ax, self._tput_ax]:
            set_x_axis(ax, self.x_axis.value if ax.figure is not self.system_fig else "relative time")
        self._panels = {
            ax: _Lines(ax) for ax in (*self.loss_fig.axes, *self.optim_fig.axes, *self.system_fig.axes)
        }
        self._bar_keys: list[Key] | None = None
        self._bar_artists: tuple = ()
        self._highlights = {}
        self.readouts = {fig: W.HTML(layout=W.Layout(min_height="1.4em")) for fig in self._figures()}
        self.legend = W.HTML()
        if self.interactive:
            for fig in self._figures():
                fig.canvas.mpl_connect("motion_notify_event", self._on_motion)
        system_tab = W.VBox([self.system_plot, self.readouts[self.system_fig]])
        optim_tab = W.VBox([self.optim_plot, self.readouts[self.optim_fig]])
        logs_tab = W.VBox([self.log_rank, self.log_view])
        export_tab = W.VBox([
            W.HTML("Writes the three figures (PNG at 2x and SVG) or the shown tenants' train and eval rows (CSV, a "
                   "<code>run</code> column first) into the folder, atomically; the default folder is the run's "
                   "<code>exports/</code>, or <code>exports/</code> next to the runs when several are shown."),
            self.export_dir, W.HBox([self.export_figures_button, self.export_csv_button]), self.export_message,
        ])  # fmt: skip
        self.tabs = W.Tab(children=[system_tab, optim_tab, logs_tab, export_tab])
        for i, title in enumerate(("system", "lr & grad norm", "logs", "export")):
            self.tabs.set_title(i, title)
        self.tabs.observe(lambda _: self._on_tab(), names="selected_index")
        self.widget = W.VBox([
            self.status, self.runs_box, self._controls, self.progress, self.legend, self.loss_plot,
            self.readouts[self.loss_fig], self.tabs,
        ])  # fmt: skip

    def _figure(self, size: tuple[float, float]) -> tuple[Figure, W.DOMWidget]:
        fig = Figure(figsize=size, dpi=DISPLAY_DPI)
        if self.interactive:
            return fig, _interactive_canvas(fig, self._lock)
        FigureCanvasAgg(fig)
        # rendered at 2x (figure_png) and shown at the figure's display size: sharp on high-DPI screens
        return fig, W.Image(
            format="png", width=str(int(size[0] * DISPLAY_DPI)), layout=W.Layout(max_width="100%")
        )

    def _figures(self) -> tuple[Figure, Figure, Figure]:
        return self.loss_fig, self.optim_fig, self.system_fig

    # -- display and lifecycle -------------------------------------------------------------------
    def _bundle(self) -> tuple[dict, dict]:
        """The widget, plus a PNG of the loss figure for frontends without widgets (nbconvert, GitHub,
        a notebook executed headless): the live view where it can run, a picture everywhere else."""
        data = dict(self.widget._repr_mimebundle_() or {})
        with self._lock:
            self._draw_loss()
            with self._legend_in_figure():
                fit_layout(self.loss_fig)
                png = figure_png(self.loss_fig)
        data["image/png"] = base64.b64encode(png).decode("ascii")
        data["text/plain"] = repr(self)
        w, h = self.loss_fig.get_size_inches() * DISPLAY_DPI
        return data, {"image/png": {"width": int(w), "height": int(h)}}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if self._thread is None and not self._stop_event.is_set():
            self.start()  # a displayed dashboard is a live one (``ml.Dashboard(...)`` as a cell's value)
        data, metadata = self._bundle()
        self._handles.append(display(data, raw=True, metadata=metadata, display_id=True))

    def __repr__(self) -> str:
        runs = ", ".join(f"{n}: {self.states.get(n, '?')}" for n in self.chosen) or "no run chosen"
        return f"Dashboard({runs})"

    def start(self) -> Dashboard:
        """Refresh in a background thread until every run has ended (a workdir view: until
        :meth:`stop`), and return the dashboard."""
        if self.refresh() and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlora-dashboard", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing (the runs themselves are not touched)."""
        self._stop_event.set()

    @property
    def live(self) -> bool:
        """True while the background refresh runs."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop_event.wait(self.refresh_s):
            try:
                going = self.refresh()
            except Exception as e:  # a broken refresh must say so, not die silently
                self.status.value += (
                    f"<pre style='color:{RED}'>dashboard refresh failed: {html.escape(repr(e))}</pre>"
                )
                return
            if not going:
                break
        self._final_snapshot()

    def _final_snapshot(self) -> None:
        """Once every run has ended, give the displayed output a final picture (frontends that keep
        the PNG, such as an exported notebook, then show the finished curves)."""
        for handle in self._handles:
            with contextlib.suppress(Exception):
                data, metadata = self._bundle()
                handle.update(data, raw=True, metadata=metadata)

    @contextlib.contextmanager
    def _quieted(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # -- runs -------------------------------------------------------------------------------------
    def _add_run(self, run: Run) -> None:
        name = run_name(run.path, self._paths)  # two runs/ folders may each hold a run of the same name
        if name in self.feeds:
            return
        self.feeds[name] = RunSeries(run, name)
        self._run_rows[name] = _RunRow(name, lambda change, n=name: self._on_tick(n, change))

    def _rescan(self) -> None:
        """A workdir view: offer runs that appeared since the last look."""
        self._rescanned = time.monotonic()
        known = {feed.run.path for feed in self.feeds.values()}
        for job in sorted(self.workdir.glob("*/job.json")):
            if job.parent.absolute() not in known:
                with contextlib.suppress(RunDirError, OSError):
                    self._add_run(attach(job.parent))

    @property
    def chosen(self) -> list[str]:
        """The names of the runs being plotted."""
        return [n for n, row in self._run_rows.items() if row.check.value]

    def choose(self, names: Sequence[str]) -> None:
        """Plot these runs (names as in the runs table: the run directories' names)."""
        unknown = [n for n in names if n not in self.feeds]
        if unknown:
            raise KeyError(f"no run {unknown} in this dashboard; runs: {list(self.feeds)}")
        with self._quieted():
            self._set_chosen(list(names))
        self._changed()

    def _set_chosen(self, names: Sequence[str]) -> None:
        with self._quieted():
            for n, row in self._run_rows.items():
                row.check.value = n in names
        self._update_picker()
        self._update_export_dir()
        self._update_stop()

    def _on_tick(self, name: str, change: dict) -> None:
        if self._quiet:
            return
        with self._lock:
            self._update_picker()
            self._update_export_dir()
            self._update_stop()
        self._changed()

    # -- refresh ----------------------------------------------------------------------------------
    def _poll(self) -> bool:
        """Read new rows and states of every offered run; True if anything changed."""
        changed = False
        for name, feed in self.feeds.items():
            try:
                state = feed.run.status.value
                self._status[name] = read_status(feed.run.path)
            except (RunDirError, OSError):
                state = "broken"
            changed |= self.states.get(name) != state
            self.states[name] = state
            with self._lock:
                changed |= bool(feed.poll())
        if time.monotonic() - self._labels_read > RESCAN_EVERY_S:
            self._labels_read = time.monotonic()
            for name, feed in self.feeds.items():
                labels = _labels_of(feed.run.path)
                changed |= self._labels.get(name) != labels
                self._labels[name] = labels
        return changed

    def refresh(self) -> bool:
        """Read new rows and redraw what changed; returns False once nothing more can change (every
        run has ended; a workdir view keeps looking for new runs)."""
        if self.workdir is not None and time.monotonic() - self._rescanned > RESCAN_EVERY_S:
            with self._lock:
                self._rescan()
        self._poll()
        with self._lock:
            self._update_picker()
            self._update_header()
            self._update_progress()
            self._update_stop()
            if len(self.feeds) > 1 or self.workdir is not None:
                self.runs_box.layout.display = ""
                self._render_table()
            self._redraw()
            if self.tabs.selected_index == 2:
                self._update_log()
        if self.workdir is not None:
            return not self._stop_event.is_set()
        return any(s not in FINAL_STATES for s in self.states.values())

    def _changed(self) -> None:
        """A control changed: update and redraw at once (not at the next refresh)."""
        if self._quiet:
            return
        with self._lock:
            self._update_header()
            self._update_progress()
            self._redraw(force=True)

    # -- header, progress, stop ----------------------------------------------------------------------
    def _keys(self) -> list[Key]:
        """Every (run, tenant) of the chosen runs, in order."""
        return [(n, t) for n in self.chosen for t in self.feeds[n].tenants]

    def picked(self) -> list[Key]:
        """The (run, tenant) pairs being drawn."""
        chosen = set(self.chosen)
        return [k for k in self.tenants.value if k[0] in chosen and k[1] in self.feeds[k[0]].tenants]

    def label(self, key: Key) -> str:
        """A series' name in legends and readouts: ``run / tenant`` when several runs are shown."""
        return f"{key[0]} / {key[1]}" if len(self.chosen) > 1 else key[1]

    def colour(self, key: Key) -> str:
        """A series' colour (see :class:`~mlora_lab.plotting.Colours`)."""
        return self.colours(series_key(*key))

    @property
    def colors(self) -> dict[Key, str]:
        """The colour of every series drawn so far."""
        return {k: self.colour(k) for k in self._known_keys}

    def _update_picker(self) -> None:
        keys = self._keys()
        options = [(self.label(k), k) for k in keys]
        for k in keys:
            self.colour(k)  # colours are assigned in listing order (runs, then tenants)
        if list(self.tenants.options) == options:
            return
        old = set(self.tenants.value)
        value = [k for k in keys if k in old or k not in self._known_keys]  # new tenants start shown
        self._known_keys.update(keys)
        with self._quieted():
            self.tenants.options = options
            self.tenants.value = value
            self.tenants.rows = min(10, max(3, len(options)))

    def _pick_all(self, on: bool) -> None:
        with self._quieted():
            self.tenants.value = [k for _, k in self.tenants.options] if on else []
        self._changed()

    def _run_state_html(self, name: str) -> str:
        state = self.states.get(name, "?")
        feed = self.feeds[name]
        failed = [t for t, s in feed.tenants.items() if s.state in ("failed", "refused")]
        colour = STATE_COLOURS.get(state, INK)
        text = state
        if failed and state not in ("failed", "lost", "broken"):
            # a quarantined tenant must not hide behind a green "finished"
            n = len(failed)
            text += f" · {n} tenant{'s' if n > 1 else ''} failed"
            colour = AMBER if len(failed) < len(feed.tenants) else RED
        return f"<span style='color:{colour}'><b>{html.escape(text)}</b></span>"

    def _update_header(self) -> None:
        lines = []
        for name in self.chosen or list(self.feeds)[:1]:
            feed, state = self.feeds[name], self.states.get(name, "?")
            text = f"<b>{html.escape(name)}</b> — {self._run_state_html(name)} · step {feed.global_step}"
            if feed.tokens_per_s is not None:
                text += f" · {feed.tokens_per_s:,.0f} tokens/s"
            status = self._status.get(name)
            if status is not None and status.started:
                end = status.ended if state in FINAL_STATES and status.ended else time.time()
                text += f" · {_duration(end - status.started)}"
            if state not in FINAL_STATES:
                etas = [
                    s.timing(feed.resumes)[1] for t, s in feed.tenants.items()
                    if self.tenant_state((name, t)) == "running"
                ]  # fmt: skip
                etas = [e for e in etas if e is not None]
                if etas:  # the run ends with its slowest running tenant
                    text += f" · ETA {_duration(max(etas))}"
            if state == "queued" and (reason := feed.run.reason):  # Slurm: why it waits (Resources, ...)
                text += f" · {html.escape(reason)}"
            if state in ("failed", "lost"):
                text += self._failure_html(feed.run)
            lines.append(text)
        if not self.feeds:
            lines.append(f"no runs in {html.escape(str(self.workdir))} yet")
        value = "<br>".join(lines)
        if self.status.value != value:
            self.status.value = value

    @staticmethod
    def _failure_html(run: Run) -> str:
        error = run.error or ""
        rank = error.split(":")[0].replace("rank", "").strip() if error.startswith("rank") else "0"
        tail = run.logs(int(rank) if rank.isdigit() else 0, tail=6)
        return (
            f"<pre style='color:{RED};white-space:pre-wrap;margin:2px 0'>{html.escape(error)}\n"
            f"{html.escape(tail)}</pre>"
        )

    def _update_progress(self) -> None:
        keys = self.picked()
        for key in keys:
            if key not in self._progress_rows:
                tenant = self.feeds[key[0]].tenants[key[1]]
                self._progress_rows[key] = _TenantRow(self.label(key), self.colour(key), tenant.max_steps)
            self._update_progress_row(key)
        children = tuple(self._progress_rows[k].box for k in keys)
        if self.progress.children != children:
            self.progress.children = children

    def tenant_state(self, key: Key) -> str:
        """The state a tenant is shown in: its own (from its latest tenant row), or its run's once the
        run ended while it was still going (:func:`~mlora_lab.rundir.shown_tenant_state`)."""
        tenant, run_state = self.feeds[key[0]].tenants[key[1]], self.states.get(key[0], "running")
        # a tenant with steps but no tenant row yet (an older job logs none at the start) is running
        own = tenant.state or ("running" if len(tenant.train) else None)
        return shown_tenant_state(own, run_state) if run_state != "broken" else (own or "?")

    def _update_progress_row(self, key: Key) -> None:
        row, feed = self._progress_rows[key], self.feeds[key[0]]
        tenant = feed.tenants[key[1]]
        row.rename(self.label(key), self.colour(key))
        state = self.tenant_state(key)
        if tenant.max_steps and row.bar.max != tenant.max_steps:
            row.bar.max = tenant.max_steps
        row.bar.value = min(tenant.step, row.bar.max)
        colour = STATE_COLOURS.get(state)
        shown = f"<span style='color:{colour}'>{state}</span>" if colour else state
        text = f"{tenant.step}/{tenant.max_steps if tenant.max_steps else '?'} · {shown}"
        if tenant.last_loss is not None:
            text += f" · loss {tenant.last_loss:.4f}"
        elapsed, eta = tenant.timing(feed.resumes)
        if elapsed:
            text += f" · {_duration(elapsed)}"
        if eta is not None and state == "running":
            text += f" · ETA {_duration(eta)}"
        if row.info.value != text:
            row.info.value = text
        reason = tenant.reason or ""
        if reason:
            value = (
                f"<div title='{html.escape(reason, quote=True)}' style='color:{RED};white-space:nowrap;overflow:hidden;"
                f"text-overflow:ellipsis;padding-left:226px'>{html.escape(reason)}</div>"
            )
            if row.reason.value != value:
                row.reason.value = value
        row.reason.layout.display = "" if reason else "none"

    def _live(self) -> list[str]:
        """The chosen runs that have not ended."""
        return [n for n in self.chosen if n in self.states and self.states[n] not in FINAL_STATES]

    def _update_stop(self) -> None:
        """The Stop button names what it stops: the run (one run shown), ``Stop <run>`` (one live run
        among several shown) or ``Stop <n> runs``; once asked, ``Stopping…`` until they end."""
        live = self._live()
        if not live:
            states = {self.states.get(n, "?") for n in self.chosen}
            description, disabled = (states.pop() if len(states) == 1 else "ended"), True
        elif set(live) <= self._stopping:
            description, disabled = ("Stopping…" if len(live) == 1 else f"Stopping {len(live)} runs…"), True
        elif len(live) == 1:
            description, disabled = ("Stop" if len(self.chosen) == 1 else f"Stop {live[0]}"), False
        else:
            description, disabled = f"Stop {len(live)} runs", False
        self.stop_button.description = description
        self.stop_button.disabled = disabled
        self.stop_button.tooltip = (
            ("graceful stop (checkpoint, then exit) of " + ", ".join(live)) if live else ""
        )

    def stop_runs(self) -> list[str]:
        """Ask every chosen live run to stop gracefully (each job checkpoints, then exits); returns
        their names. This is what the Stop button does."""
        live = self._live()
        for name in live:
            control.request_stop(self.feeds[name].run.path)
        self._stopping.update(live)
        self._update_stop()
        return live

    def _on_stop(self, _button: W.Button) -> None:
        self.stop_runs()

    # -- runs table -------------------------------------------------------------------------------
    @staticmethod
    def _row_html(values: dict | None) -> str:
        widths = (("run", 220), ("state", 170), ("tenants", 190), ("steps", 60), ("best loss", 75),
                  ("started", 110), ("tags", 170))  # fmt: skip
        cells = []
        for col, width in widths:
            if values is None:
                text, title = f"<b>{col}</b>", col
            else:
                text, title = values[col], values.get(f"{col}_title", "")
            cells.append(
                f"<span title='{html.escape(str(title), quote=True)}' style='display:inline-block;width:{width}px;"
                f"white-space:nowrap;overflow:hidden;text-overflow:ellipsis;vertical-align:middle'>{text}</span>"
            )
        pad = "" if values is not None else "<span style='display:inline-block;width:30px'></span>"
        return pad + "".join(cells)

    def _row_values(self, name: str) -> dict[str, Any]:
        feed, status = self.feeds[name], self._status.get(name)
        tags, note = self._labels.get(name, ("", ""))
        names = list(feed.tenants)
        best = [s.best_loss for s in feed.tenants.values() if s.best_loss is not None]
        started = status.started if status is not None and status.started else None
        return {
            "run": f"<b>{html.escape(name)}</b>", "run_title": f"{name}\n{note}".strip(),
            "state": self._run_state_html(name), "state_title": self.states.get(name, "?"),
            "tenants": html.escape(f"{len(names)}: {', '.join(names)}"), "tenants_title": ", ".join(names),
            "steps": str(feed.global_step), "best loss": f"{min(best):.4f}" if best else "–",
            "started": time.strftime("%m-%d %H:%M", time.localtime(started)) if started else "–",
            "tags": html.escape(tags), "tags_title": f"{tags}\n{note}".strip(),
            "_sort": {"run": name, "state": self.states.get(name, ""), "steps": feed.global_step,
                      "best loss": min(best) if best else float("inf"), "started": started or 0.0,
                      "tenants": len(names)},
            "_text": " ".join([name, *names, tags, note]).lower(),
        }  # fmt: skip

    def _render_table(self) -> None:
        rows = []
        text = self.run_filter.value.strip().lower()
        state = self.state_filter.value
        for name, row in self._run_rows.items():
            values = self._row_values(name)
            cells = self._row_html(values)
            if row.cells.value != cells:
                row.cells.value = cells
            if text and text not in values["_text"]:
                continue
            if state != "any state" and self.states.get(name) != state:
                continue
            rows.append((values["_sort"][self.sort_by.value], name))
        rows.sort(reverse=self.sort_desc.value)
        children = tuple(self._run_rows[n].box for _, n in rows)
        if self._table_rows.children != children:
            self._table_rows.children = children

    def _on_sort_direction(self, change: dict) -> None:
        self.sort_desc.description = "descending" if change["new"] else "ascending"
        self.sort_desc.icon = "sort-amount-desc" if change["new"] else "sort-amount-asc"

    # -- drawing ----------------------------------------------------------------------------------
    def _ema(self, key: Key, metric: str, values: np.ndarray, smoothing: float) -> np.ndarray:
        # one incremental EMA per series; a run whose metrics were rewritten (resume) starts afresh
        feed = self.feeds[key[0]]
        cache_key = (key, metric, feed.epoch)
        cache = self._emas.get(cache_key)
        if cache is None:
            cache = self._emas[cache_key] = Ema()
        return cache(values, smoothing)

    def _redraw(self, force: bool = False) -> None:
        """Redraw the loss figure and the visible tab's figure if their data or settings changed."""
        version = (tuple(self.picked()), tuple(f.version for f in self.feeds.values()), self.x_axis.value,
                   self.smoothing.value, self.logy.value, self.outliers.value, len(self.chosen) > 1)  # fmt: skip
        tab = self.tabs.selected_index
        if force or self._drawn.get("loss") != version:
            self._draw_loss()
            self._show(self.loss_fig, self.loss_plot)
            self._drawn["loss"] = version
        if tab == 1 and (force or self._drawn.get("optim") != version):
            self._draw_optim()
            self._show(self.optim_fig, self.optim_plot)
            self._drawn["optim"] = version
        if tab == 0 and (force or self._drawn.get("system") != version):
            final = all(s in FINAL_STATES for s in self.states.values())
            if force or final or time.monotonic() - self._system_drawn > SYSTEM_EVERY_S:
                self._draw_system()
                self._show(self.system_fig, self.system_plot)
                self._drawn["system"] = version
                self._system_drawn = time.monotonic()

    def redraw(self) -> None:
        """Redraw every figure now."""
        with self._lock:
            self._draw_loss()
            self._draw_optim()
            self._draw_system()
            for fig, widget in zip(self._figures(), (self.loss_plot, self.optim_plot, self.system_plot)):
                self._show(fig, widget)

    def _show(self, fig: Figure, widget: W.DOMWidget) -> None:
        for ax in fig.axes:  # a hover highlight belongs to the previous drawing
            if ax in self._highlights:
                self._highlights[ax].set_visible(False)
        fit_layout(fig)
        if self.interactive:
            # draw() renders here and pushes the new frame to the frontend (ipympl's refresh_all); the
            # draw_idle() handshake would wait for the kernel to be idle, so a figure would freeze
            # while a later cell blocks (``run.wait()``), exactly when a live view matters.
            widget.draw()
        else:
            widget.value = figure_png(fig)

    def _on_tab(self) -> None:
        with self._lock:
            self._redraw()
            if self.tabs.selected_index == 2:
                self._update_log(force=True)

    def _on_x(self, change: dict) -> None:
        for ax in (*self.loss_fig.axes, *self.optim_fig.axes):
            set_x_axis(ax, change["new"])
        for ax in (self._mem_ax, self._util_ax, self._tput_ax):
            set_x_axis(
                ax, change["new"] if change["new"] in ("wall time", "global step") else "relative time"
            )
        self.follow(redraw=False)
        self._changed()

    def follow(self, redraw: bool = True) -> None:
        """Undo zooming and panning: every axes follows its data again."""
        for fig in self._figures():
            for ax in fig.axes:
                ax.set_autoscale_on(True)
        if redraw:
            self._changed()

    def _autoscale(self, ax: Any, outliers: bool, from_zero: bool = False) -> None:
        """Fit the axes to the visible lines, unless the user zoomed or panned it (matplotlib turns
        autoscaling off for an axis the toolbar moved): a refresh must not undo a zoom."""
        if not (ax.get_autoscalex_on() or ax.get_autoscaley_on()):
            return
        ax.relim(visible_only=True)
        ax.autoscale_view()
        if not ax.get_autoscaley_on():
            return
        lines = [line for line in self._panels[ax].lines.values() if line.get_visible()]
        if outliers:
            log = ax.get_yscale() == "log"
            lo_x, hi_x = ax.get_xlim()
            shown = []
            # the raw values decide: a spike's smoothed echo is part of the outlier, not of the curve
            for line in [line for line in lines if line.get_label() == "_raw"] or lines:
                xs, ys = np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)
                shown.append(ys[(xs >= lo_x) & (xs <= hi_x)])
            lim = robust_ylim(shown, log=log)
            if lim is not None:
                ax.set_ylim(lim, auto=None)
        if from_zero and lines:
            top = max((np.nanmax(line.get_ydata()) for line in lines if np.isfinite(line.get_ydata()).any()),
                      default=1.0)  # fmt: skip
            ax.set_ylim(0, max(top * 1.08, 1e-9), auto=None)

    def _points(self, lines: int) -> int:
        """Points per drawn line: ``max_points``, less when many lines share a figure (drawing costs
        about as much per point as the budget allows; 200 per line still shows each curve's shape)."""
        return max(200, min(self.max_points, POINT_BUDGET // max(1, lines)))

    def _train_lines(
        self, ax: Any, key: Key, metric: str, smooth: bool, label: str, points: int
    ) -> tuple[set, int]:
        """Draw one tenant's ``metric`` on ``ax``: the raw values faded under the smoothed ones (when
        smoothing), thinned, broken across gaps on time axes, with markers when there are few points."""
        feed, colour, x = self.feeds[key[0]], self.colour(key), self.x_axis.value
        panel = self._panels[ax]
        xs, ys, breaks = feed.xy(key[1], metric, x)
        s = self.smoothing.value if smooth else 0.0
        shown: set[tuple] = set()
        if not len(xs):
            return shown, 0
        line = panel.get((key, "main"), color=colour, linewidth=1.5, markersize=3)
        line.set_data(*thin_with_breaks(xs, self._ema(key, metric, ys, s) if s > 0 else ys, breaks, points))
        line.set_marker(marker_for(len(xs)))
        line.set_label(label)
        self._hover[line] = label + (" (smoothed)" if s > 0 else "")
        shown.add((key, "main"))
        if s > 0 and len(xs) > 1:  # smoothing never hides the data: the raw line stays, faded
            raw = panel.get((key, "raw"), color=colour, linewidth=0.8, alpha=0.25, label="_raw")
            raw.set_data(*thin_with_breaks(xs, ys, breaks, points))
            self._hover[raw] = label + " (raw)"
            shown.add((key, "raw"))
        return shown, len(xs)

    def _draw_loss(self) -> None:
        ax, panel = self._loss_ax, self._panels[self._loss_ax]
        shown: set[tuple] = set()
        points = 0
        picked = self.picked()
        per_line = self._points(len(picked) * (2 if self.smoothing.value > 0 else 1))
        for key in picked:
            label = self.label(key)
            got, n = self._train_lines(ax, key, "loss", smooth=True, label=label, points=per_line)
            shown |= got
            points += n
            ex, ey, ebreaks = self.feeds[key[0]].xy(key[1], "eval_loss", self.x_axis.value)
            if len(ex):
                line = panel.get((key, "eval"), color=self.colour(key), marker="o", linestyle="--", linewidth=0.8,
                                 markersize=4, label="_eval")  # fmt: skip
                line.set_data(*thin_with_breaks(ex, ey, ebreaks, per_line))
                self._hover[line] = label + " (eval)"
                shown.add((key, "eval"))
        visible = panel.show_only(shown)
        placeholder(ax, None if points else "waiting for the first step…")
        set_log_y(ax, self.logy.value)
        self._autoscale(ax, self.outliers.value)
        self._update_legend([line for line in visible if line.get_label() not in ("_raw", "_eval")])

    @contextlib.contextmanager
    def _legend_in_figure(self) -> Iterator[None]:
        """A picture of the loss figure (export, the notebook's static copy) has no HTML next to it:
        it gets a real legend for as long as it is rendered."""
        ax = self._loss_ax
        mains = [
            ax_line
            for key, ax_line in self._panels[ax].lines.items()
            if key[1] == "main" and ax_line.get_visible()
        ]
        legend = (
            ax.legend(handles=mains[:20], fontsize=8, ncol=1 + len(mains[:20]) // 6, loc="upper right")
            if mains
            else None
        )
        try:
            yield
        finally:
            if legend is not None:
                legend.remove()

    def _update_legend(self, mains: list[Line2D]) -> None:
        """The loss plot's legend, as HTML above it: drawing ten legend entries into the figure costs as
        much as drawing all its lines (text is slow to render at 2x), and an HTML legend never covers
        data. Exports put a real legend into the figure (:meth:`export`)."""
        items = "".join(
            f"<span style='white-space:nowrap;margin-right:12px'><span style='display:inline-block;width:18px;"
            f"height:3px;vertical-align:middle;background:{line.get_color()}'></span> {html.escape(line.get_label())}"
            "</span>"
            for line in mains
        )
        value = (
            f"<div style='font-size:12px;line-height:1.6'>{items}<span style='color:{GREY}'>· faded: raw values · "
            "dots: eval</span></div>"
            if mains
            else ""
        )
        if self.legend.value != value:
            self.legend.value = value

    def _draw_optim(self) -> None:
        for ax, metric, smooth in ((self._lr_ax, "lr", False), (self._grad_ax, "grad_norm", True)):
            shown: set[tuple] = set()
            points = 0
            picked = self.picked()
            per_line = self._points(len(picked) * (2 if smooth and self.smoothing.value > 0 else 1))
            for key in picked:
                got, n = self._train_lines(
                    ax, key, metric, smooth=smooth, label=self.label(key), points=per_line
                )
                shown |= got
                points += n
            self._panels[ax].show_only(shown)
            placeholder(ax, None if points else "waiting for the first step…")
            self._autoscale(ax, self.outliers.value and metric == "grad_norm")

    def _system_x(self) -> str:
        x = self.x_axis.value
        return x if x in ("wall time", "global step") else "relative time"

    def _draw_system(self) -> None:
        x = self._system_x()
        several = len(self.chosen) > 1
        mem, util, tput = self._panels[self._mem_ax], self._panels[self._util_ax], self._panels[self._tput_ax]
        shown: dict[Any, set] = {self._mem_ax: set(), self._util_ax: set(), self._tput_ax: set()}
        util_points = 0
        mem_range: list[float] = []
        per_line = self._points(sum(len(self.feeds[n].system) for n in self.chosen) * 2)
        for name in self.chosen:
            feed = self.feeds[name]
            for rank, columns in sorted(feed.system.items()):
                cols = columns.arrays()
                xs = feed.system_x(cols, x)
                breaks = gap_breaks(cols["time"], feed.resumes) if x in TIME_AXES else None
                label = f"{name} / rank {rank}" if several else f"rank {rank}"
                colour = self.colours(f"{name}/rank {rank}") if several else PALETTE[rank % len(PALETTE)]
                mib = cols["mem"] / 2**20
                line = mem.get((name, rank), color=colour, linewidth=1.2, label=label)
                line.set_data(*thin_with_breaks(xs, mib, breaks, per_line))
                line.set_marker(marker_for(len(xs)))
                self._hover[line] = label
                shown[self._mem_ax].add((name, rank))
                if len(mib):
                    mem_range += [float(np.nanmin(mib)), float(np.nanmax(mib))]
                for field, style in (("gpu_util", "-"), ("cpu_percent", "--")):
                    ys = cols[field]
                    if not np.isfinite(ys).any():
                        continue
                    util_points += int(np.isfinite(ys).sum())
                    what = "GPU" if field == "gpu_util" else "CPU"
                    line = util.get((name, rank, field), color=colour, linestyle=style, linewidth=1.0,
                                    label=f"{label} {what}")  # fmt: skip
                    line.set_data(*thin_with_breaks(xs, ys, breaks, per_line))
                    self._hover[line] = f"{label} {what} %"
                    shown[self._util_ax].add((name, rank, field))
                if rank == 0:
                    tps = cols["tokens_per_s"]
                    tcolour = self.colours(f"{name}/tokens") if several else "#555555"
                    smooth = self._ema((name, "#rank0"), "tokens_per_s", tps, max(self.smoothing.value, 0.5))
                    line = tput.get(
                        (name, "main"), color=tcolour, linewidth=1.4, label=name if several else "tokens/s"
                    )
                    line.set_data(*thin_with_breaks(xs, smooth, breaks, per_line))
                    line.set_marker(marker_for(len(xs)))
                    self._hover[line] = f"{name} tokens/s (smoothed)"
                    raw = tput.get((name, "raw"), color=tcolour, linewidth=0.7, alpha=0.25, label="_raw")
                    raw.set_data(*thin_with_breaks(xs, tps, breaks, per_line))
                    self._hover[raw] = f"{name} tokens/s (raw)"
                    shown[self._tput_ax] |= {(name, "main"), (name, "raw")}
        for ax, keys in shown.items():
            self._panels[ax].show_only(keys)
        placeholder(self._mem_ax, None if shown[self._mem_ax] else "waiting for the first step…")
        self._autoscale(self._mem_ax, False, from_zero=True)  # from 0: 1 % jitter must not look like a leak
        title = "memory per rank (MiB)"
        if mem_range:
            title += f" · range {min(mem_range):,.0f}–{max(mem_range):,.0f}"
        self._mem_ax.set_title(title, fontsize=9)
        legend_key = tuple(sorted(map(str, shown[self._mem_ax])))
        if 0 < len(legend_key) <= 8 and getattr(self._mem_ax, "_lab_legend_key", None) != legend_key:
            self._mem_ax.legend(fontsize=7, loc="lower right")
            self._mem_ax._lab_legend_key = legend_key
        if util_points:
            placeholder(self._util_ax, None)
            self._autoscale(self._util_ax, False, from_zero=True)
            if self._util_ax.get_autoscaley_on():
                self._util_ax.set_ylim(0, max(100.0, self._util_ax.get_ylim()[1]), auto=None)
        else:
            logged = any(len(c) for n in self.chosen for c in self.feeds[n].system.values())
            placeholder(self._util_ax, "utilisation not logged\n(system rows without cpu_percent / gpu_util)"
                        if logged else "waiting for the first step…")  # fmt: skip
        placeholder(self._tput_ax, None if shown[self._tput_ax] else "waiting for the first step…")
        self._autoscale(self._tput_ax, False, from_zero=True)
        self._draw_bars()

    def _draw_bars(self) -> None:
        """Each picked tenant's memory, adapter (solid) + optimiser (hatched), from its latest tenant row."""
        ax = self._bars_ax
        sizes = {}
        for key in self.picked():
            t = self.feeds[key[0]].tenants[key[1]]
            if t.adapter_bytes or t.optimizer_bytes:
                sizes[key] = (t.adapter_bytes / 2**20, t.optimizer_bytes / 2**20)
        order = list(sizes)
        keys = sorted(sorted(sizes, key=lambda k: -sum(sizes[k]))[:MAX_BARS], key=order.index)  # the biggest
        if keys != self._bar_keys:  # other tenants: new bars (rare); numeric positions, so no stale labels
            for artist in self._bar_artists:
                artist.remove()
            ys, colours = np.arange(len(keys)), [self.colour(k) for k in keys]
            adapter = ax.barh(ys, [sizes[k][0] for k in keys], color=colours)
            optim = ax.barh(ys, [sizes[k][1] for k in keys], left=[sizes[k][0] for k in keys], color=colours,
                            alpha=0.4, hatch="//")  # fmt: skip
            ax.set_yticks(ys, [self.label(k) for k in keys])
            if keys:
                ax.set_ylim(len(keys) - 0.5, -0.5)  # the first tenant on top
            self._bar_artists = (adapter, optim)
            self._bar_keys = keys
        else:
            adapter, optim = self._bar_artists
            for k, a, o in zip(keys, adapter, optim):
                a.set_width(sizes[k][0])
                o.set_x(sizes[k][0])
                o.set_width(sizes[k][1])
        title = "adapter + optimiser (hatched) per tenant (MiB)"
        if len(sizes) > MAX_BARS:
            title += f" · top {MAX_BARS} of {len(sizes)}"
        ax.set_title(title, fontsize=9)
        placeholder(ax, None if keys else "no tenant memory logged yet")
        if keys:
            ax.set_xlim(0, max(sum(sizes[k]) for k in keys) * 1.08 or 1.0)

    # -- hover readout ------------------------------------------------------------------------------
    def readout_at(self, ax: Any, x_px: float, y_px: float, radius_px: float = 25.0) -> str | None:
        """The drawn point nearest to display position ``(x_px, y_px)`` in ``ax``, as text
        ``series · x-label x · y``; None when no point is within ``radius_px`` pixels. Also moves the
        axes' highlight marker onto it."""
        best = None
        for line in ax.get_lines():
            if not line.get_visible() or line not in self._hover:
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
        highlight = self._highlights.get(ax)
        if best is None:
            if highlight is not None:
                highlight.set_visible(False)
            return None
        _, line, (px, py) = best
        if highlight is None:  # a scatter: collections do not count in relim, so it never moves the limits
            highlight = self._highlights[ax] = ax.scatter([], [], s=60, facecolors="none", edgecolors="black",
                                                          zorder=5)  # fmt: skip
        highlight.set_offsets([[px, py]])
        highlight.set_visible(True)
        xlabel = ax.get_xlabel() or "x"
        x = self._system_x() if ax.figure is self.system_fig else self.x_axis.value
        xtext = time.strftime("%H:%M:%S", time.localtime(px * 86400.0)) if x == "wall time" else f"{px:,.6g}"
        return f"<b>{html.escape(self._hover[line])}</b> · {html.escape(xlabel)} {xtext} · {py:.6g}"

    def _on_motion(self, event: Any) -> None:
        fig = event.canvas.figure
        with self._lock:
            text = self.readout_at(event.inaxes, event.x, event.y) if event.inaxes is not None else None
            for ax in fig.axes:  # the highlight follows the cursor from one axes to the next
                if ax is not event.inaxes and ax in self._highlights:
                    self._highlights[ax].set_visible(False)
            readout = self.readouts[fig]
            value = text or ""
            if readout.value != value:
                readout.value = value
                event.canvas.draw_idle()

    # -- logs -------------------------------------------------------------------------------------
    def _update_log(self, force: bool = False) -> None:
        options = []
        for name in self.chosen:
            logs = self.feeds[name].run.dir.logs
            paths = sorted(logs.glob("rank*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
            if (logs / "launcher.log").exists():
                paths.append(logs / "launcher.log")
            for path in paths:
                what = "launcher" if path.stem == "launcher" else f"rank {path.stem[4:]}"
                options.append((f"{name} / {what}" if len(self.chosen) > 1 else what, str(path)))
        if list(self.log_rank.options) != options:
            current = self.log_rank.value
            with self._quieted():
                self.log_rank.options = options
                self.log_rank.value = (
                    current if current in dict(options).values() else (options[0][1] if options else None)
                )
        path = self.log_rank.value
        if path is None:
            self.log_view.value = "<i>no logs yet</i>"
            return
        try:
            stat = Path(path).stat()
            mark = (path, stat.st_size, stat.st_mtime_ns)
        except OSError:
            mark = (path, None, None)
        if mark == self._log_shown and not force:
            return
        self._log_shown = mark
        lines = []
        for line in _tail(Path(path)).splitlines():
            text = html.escape(line)
            if ERROR_LINE.search(line):  # errors stand out in a long tail
                text = f"<span style='color:{RED};font-weight:bold'>{text}</span>"
            lines.append(text)
        self.log_view.value = (
            "<pre style='max-height:420px;overflow:auto;font-size:12px;line-height:1.3;margin:0;"
            f"white-space:pre-wrap'>{chr(10).join(lines) or '<i>empty</i>'}</pre>"
        )

    # -- export -----------------------------------------------------------------------------------
    def _default_export_dir(self) -> Path | None:
        paths = [self.feeds[n].run.path for n in self.chosen]
        if not paths:
            return None
        if len(paths) == 1:
            return paths[0] / "exports"
        return Path(os.path.commonpath(paths)) / "exports"  # runs of one workdir: <workdir>/exports

    def _update_export_dir(self) -> None:
        if not self._export_dir_given:
            default = self._default_export_dir()
            self.export_dir.value = str(default) if default else ""

    def export(
        self, folder: str | Path | None = None, figures: bool = True, metrics: bool = True
    ) -> list[Path]:
        """Write the figures (``loss``, ``optim``, ``system``: PNG at twice the display resolution and
        SVG) and the shown tenants' train and eval rows (CSV with a ``run`` column) into ``folder``
        (default: the export folder field, see the class docstring), each file atomically; names start
        with the time, so exports never overwrite each other. Returns the files written."""
        if folder is None:
            folder = self.export_dir.value or self._default_export_dir()
        if folder is None:
            raise ValueError("no run chosen: nothing to export")
        folder = Path(folder)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if folder.is_dir() and any(folder.glob(f"{stamp}-*")):  # a second export within the second
            stamp += f"-{time.monotonic_ns() % 10**6:06d}"
        written = []
        with self._lock:
            if figures:
                self._draw_loss()
                self._draw_optim()
                self._draw_system()
                with self._legend_in_figure():
                    for name, fig in zip(("loss", "optim", "system"), self._figures()):
                        fit_layout(fig)
                        for suffix, data in (("png", figure_png(fig)), ("svg", figure_svg(fig))):
                            path = folder / f"{stamp}-{name}.{suffix}"
                            atomic_write_bytes(path, data)
                            written.append(path)
            if metrics:
                path = folder / f"{stamp}-metrics.csv"
                atomic_write_bytes(path, self.metrics().to_csv(index=False).encode())
                written.append(path)
        return written

    def metrics(self) -> pd.DataFrame:
        """The train and eval rows of the shown tenants, with a ``run`` column first."""
        picked: dict[str, set[str]] = {}
        for run, tenant in self.picked():
            picked.setdefault(run, set()).add(tenant)
        frames = []
        for run, tenants in picked.items():
            with self._lock:
                rows = [r for r in self.feeds[run].rows if r["kind"] in (RowKind.TRAIN, RowKind.EVAL)
                        and r["tenant"] in tenants]  # fmt: skip
            if rows:
                df = pd.DataFrame(rows)
                df.insert(0, "run", run)
                df["time"] = pd.to_datetime(df["time"], unit="s")
                frames.append(df)
        return (
            pd.concat(frames, ignore_index=True)
            if frames
            else pd.DataFrame(columns=["run", "kind", "tenant"])
        )

    def _export_clicked(self, figures: bool) -> None:
        try:
            written = self.export(figures=figures, metrics=not figures)
        except (OSError, ValueError) as e:
            self.export_message.value = (
                f"<span style='color:{RED}'>export failed: {html.escape(str(e))}</span>"
            )
            return
        names = "".join(f"<li><code>{html.escape(str(p))}</code></li>" for p in written)
        self.export_message.value = (
            f"wrote {len(written)} file{'s' if len(written) > 1 else ''}:<ul>{names}</ul>"
        )
