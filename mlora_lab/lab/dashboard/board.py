"""The live dashboard: one view over one run, several runs, or every run of a workdir.

    run = ml.launch(spec)
    run.dashboard()                          # = ml.Dashboard([run]).start(); returns at once
    ml.Dashboard([run_a, run_b]).start()     # overlay two runs' tenants, labelled "run / tenant"
    ml.Dashboard("runs").start()             # a table of the workdir's runs; tick the ones to plot

It refreshes from the run directories in a background thread (the kernel stays free: :mod:`.refresher`)
and only reads them (metrics.jsonl incrementally, status.json, labels.json, logs/), writing nothing but
control messages (Stop), the end of a run it found dead (:mod:`mlora_lab.lab.launchers.liveness`) and exports. It
works the same for a run launched a minute ago, one attached after a kernel restart, or one that
finished yesterday.

What it shows: a header per run (state, step, tokens/s, elapsed, ETA); with several runs a sortable,
filterable runs table to pick from (:mod:`.table`); per tenant a progress row (state, loss, elapsed,
ETA, the reason of a failure: :mod:`.progress`); the loss (train lines, smoothed over a faded raw
line, and eval dots) against the tenant step, the global step, tokens seen, the wall clock or the
time since the run started; for RL tenants their reward, and their latest sampled completions with
their rewards (:mod:`.rl`: shown only when a run has RL rows); for preference tenants their reward
margins and accuracies (:mod:`.preference`: shown only when a run has such rows); tabs with memory per
rank, CPU/GPU utilisation, throughput and each tenant's adapter + optimiser memory (:mod:`.system`); learning rate
and gradient norm (:mod:`.figures`); a live tail of each rank's log; export of the figures (PNG, SVG)
and of the shown tenants' metrics (CSV) (:mod:`.outputs`). What it shows is computed without widgets
(:mod:`.model`), and its figures are redrawn together (:mod:`.panels`).

Figures are interactive (zoom, pan, and a readout of the point under the cursor) when ipympl is
installed (``interactive=None``, the default), and PNG images otherwise or with ``interactive=False``
(for nbclient, Voila or an exported notebook: every frontend shows them).
"""

from __future__ import annotations

import base64
import contextlib
import html
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as W
import pandas as pd

from mlora_lab.lab.dashboard.controls import Controls
from mlora_lab.lab.dashboard.figures import AMBER, Scene
from mlora_lab.lab.dashboard.model import Key, RunView, Shown, TenantShown, ViewModel
from mlora_lab.lab.dashboard.outputs import ExportTab, LogTab, default_export_dir, export_files
from mlora_lab.lab.dashboard.panels import Panels
from mlora_lab.lab.dashboard.progress import TenantProgress, header_html
from mlora_lab.lab.dashboard.refresher import Refresher
from mlora_lab.lab.dashboard.table import RunsTable
from mlora_lab.lab.plotting import DISPLAY_DPI, DRAWING, figure_png, fit_layout, series_label
from mlora_lab.lab.records.series import X_AXES, RunSeries
from mlora_lab.rundir import RunDir, control, name_problem

log = logging.getLogger(__name__)

MAX_SERIES = 100
"""A view offers, draws and shows progress rows for at most this many (run, tenant) series (a metrics
file may name a million tenants): the first ones, in the runs' order, and says so."""
SYSTEM_TAB, OPTIM_TAB, LOGS_TAB, EXPORT_TAB = range(4)


def ipympl_available() -> bool:
    try:
        import ipympl.backend_nbagg  # noqa: F401
    except ImportError:
        return False
    return True


class Dashboard:
    """A live view over one or several runs (see the module docstring).

    ``runs``: a ``Run``, a run directory, a list of them, or a workdir (every run under it is offered in
    the runs table and new ones appear as they are launched; the live ones, or else the newest, are
    plotted first). Tick runs in the table to overlay them.

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
        runs: Any,
        refresh_s: float = 1.0,
        interactive: bool | None = None,
        x: str = "tenant step",
        smoothing: float = 0.6,
        logy: bool = False,
        ignore_outliers: bool = False,
        max_points: int = 800,
        export_dir: str | os.PathLike | None = None,
    ) -> None:
        if x not in X_AXES:
            raise ValueError(f"unknown x axis {x!r}; choose from {', '.join(X_AXES)}")
        self.model = ViewModel.of(runs)
        self.workdir = self.model.workdir
        self.max_points = max_points
        self.interactive = ipympl_available() if interactive is None else bool(interactive)
        # the lab's one drawing lock: this view's state and figures, and every other figure in the process
        self._lock = DRAWING
        self._quiet = 0  # > 0 while the dashboard itself changes widgets: observers do not redraw
        self._handles: list[Any] = []
        self._stopping: set[str] = set()
        self.progress_rows: dict[Key, TenantProgress] = {}

        self.status = W.HTML()
        self.refresher = Refresher(self.refresh, refresh_s, self._going, self._final_pictures, log)
        self.problem = self.refresher.problem
        """Why the last refresh failed (the view goes on refreshing), or that one failed earlier."""
        self.capped = W.HTML()
        """Says so when a view has more tenants than it shows (:data:`MAX_SERIES`)."""
        self.table = RunsTable(self._on_tick)
        self.controls = Controls(
            x,
            smoothing,
            logy,
            ignore_outliers,
            self.interactive,
            self._quieted,
            on_change=self._changed,
            on_x=self._on_x,
            on_follow=self.follow,
            on_stop=self.stop_runs,
        )
        c = self.controls  # the widgets a notebook may set from code, on the dashboard itself
        self.tenants, self.x_axis, self.smoothing, self.logy = c.tenants, c.x_axis, c.smoothing, c.logy
        self.outliers, self.follow_button, self.stop_button = c.outliers, c.follow_button, c.stop_button
        self.progress = W.VBox(layout=W.Layout(max_height="300px", overflow="auto"))
        self.panels = Panels(self.model, self.interactive, self._lock, x)
        p = self.panels  # the figures a notebook reaches on the dashboard itself
        self.loss, self.optim, self.system = p.loss, p.optim, p.system
        self.rl_views, self.eval_views, self.hover = p.rl_views, p.eval_views, p.hover
        self.preference_views = p.preference_views
        # a new scale re-fits y even where the user zoomed (before the redraw)
        self.logy.observe(lambda _: self.loss.ax.set_autoscaley_on(True), names="value")
        self.logs = LogTab(self._quieted)
        self.exporter = ExportTab(export_dir, self.export)
        self.tabs = W.Tab(
            children=[
                W.VBox([self.system.widget, self.system.readout]),
                W.VBox([self.optim.widget, self.optim.readout]),
                self.logs.box,
                self.exporter.box,
            ]
        )
        for i, title in enumerate(("system", "lr & grad norm", "logs", "export")):
            self.tabs.set_title(i, title)
        self.tabs.observe(lambda _: self._on_tab(), names="selected_index")
        self.logs.source.observe(lambda _: self._update_log(force=True), names="value")
        figure = [self.loss.legend, self.loss.widget, self.loss.readout]
        self.widget = W.VBox(
            [
                self.status,
                self.problem,
                self.table.box,
                c.box,
                self.capped,
                self.progress,
                *figure,
                self.eval_views.box,
                self.rl_views.box,
                self.preference_views.box,
                self.tabs,
            ]
        )
        for view in self.model.runs.values():
            self.table.add(view)
        with self._quieted():
            self.model.poll(self._lock)
            live = [n for n, v in self.model.runs.items() if v.state is not None and not v.final]
            names = list(self.model.runs)
            self._set_chosen(names if self.workdir is None else (live or names[-1:]))

    # -- what the model holds, by run name ------------------------------------------------------------
    @property
    def feeds(self) -> dict[str, RunSeries]:
        """Each offered run's series, by run name."""
        return {name: view.series for name, view in self.model.runs.items()}

    @property
    def states(self) -> dict[str, Shown | None]:
        """Each offered run's state, by run name."""
        return {name: view.state for name, view in self.model.runs.items()}

    readouts = property(lambda self: self.panels.readouts, doc="The hover readout under each figure.")
    refresh_s = property(
        lambda self: self.refresher.refresh_s,
        lambda self, s: setattr(self.refresher, "refresh_s", s),
        doc="Seconds between refreshes.",
    )
    loss_fig = property(lambda self: self.loss.fig)
    loss_plot = property(lambda self: self.loss.widget)
    optim_fig = property(lambda self: self.optim.fig)
    optim_plot = property(lambda self: self.optim.widget)
    system_fig = property(lambda self: self.system.fig)
    system_plot = property(lambda self: self.system.widget)

    # -- display and lifecycle -------------------------------------------------------------------
    def bundle(self) -> tuple[dict, dict]:
        """The widget, plus a PNG of the loss figure for frontends without widgets (nbconvert, GitHub,
        a notebook executed headless): the live view where it can run, a picture everywhere else."""
        data = dict(self.widget._repr_mimebundle_() or {})
        with self._lock:
            self.loss.draw(self._scene())
            with self.loss.legend_in_figure():
                fit_layout(self.loss.fig)
                png = figure_png(self.loss.fig)
        data["image/png"] = base64.b64encode(png).decode("ascii")
        data["text/plain"] = repr(self)
        w, h = self.loss.fig.get_size_inches() * DISPLAY_DPI
        return data, {"image/png": {"width": int(w), "height": int(h)}}

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if self.refresher.idle:
            self.start()  # a displayed dashboard is a live one (``ml.Dashboard(...)`` as a cell's value)
        data, metadata = self.bundle()
        self._handles.append(display(data, raw=True, metadata=metadata, display_id=True))

    def __repr__(self) -> str:
        runs = ", ".join(f"{n}: {self.model.runs[n].state or '?'}" for n in self.chosen) or "no run chosen"
        return f"Dashboard({runs})"

    def start(self) -> Dashboard:
        """Refresh in a background thread until every run has ended (a workdir view: until
        :meth:`stop`), and return the dashboard."""
        self.refresher.start()
        return self

    def stop(self) -> None:
        """Stop refreshing (the runs themselves are not touched)."""
        self.refresher.stop()

    @property
    def live(self) -> bool:
        """True while the background refresh runs."""
        return self.refresher.live

    def _going(self) -> bool:
        """Whether more can change: a workdir view's until it is stopped (new runs may come), else while
        a run goes."""
        if self.workdir is not None:
            return not self.refresher.stopped
        return self.model.going

    def _final_pictures(self) -> None:
        # every run has ended: the displayed output gets a final picture (frontends that keep the
        # PNG, such as an exported notebook, then show the finished curves)
        for handle in self._handles:
            with contextlib.suppress(Exception):
                data, metadata = self.bundle()
                handle.update(data, raw=True, metadata=metadata)

    @contextlib.contextmanager
    def _quieted(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # -- runs -------------------------------------------------------------------------------------
    @property
    def chosen(self) -> list[str]:
        """The names of the runs being plotted."""
        return self.table.chosen

    def choose(self, names: Sequence[str]) -> None:
        """Plot these runs (names as in the runs table: the run directories' names)."""
        unknown = [n for n in names if n not in self.model.runs]
        if unknown:
            raise KeyError(f"no run {unknown} in this dashboard; runs: {list(self.model.runs)}")
        self._set_chosen(list(names))
        self._changed()

    def _set_chosen(self, names: Sequence[str]) -> None:
        with self._quieted():
            for n, row in self.table.rows.items():
                row.check.value = n in names
        self._update_picker()
        self.exporter.follow([self.model.runs[n].path for n in self.chosen], self._adapters())
        self._update_stop()

    def _adapters(self) -> list[tuple[str, tuple[RunDir, str]]]:
        """The shown tenants that have a saved adapter, for the export tab. A name that cannot name a folder
        (a job.json edited by hand; the job refuses it) has none, and is not asked for one."""
        out = []
        for key in self.picked():
            run = self.model.runs[key[0]]
            if (
                name_problem(key[1]) is None
                and (run.liveness.dir.adapter(key[1]) / "adapter_config.json").is_file()
            ):
                out.append((self.label(key), (run.liveness.dir, key[1])))
        return out

    def _on_tick(self, name: str) -> None:
        if self._quiet:
            return
        with self._lock:
            self._update_picker()
            self.exporter.follow([self.model.runs[n].path for n in self.chosen], self._adapters())
            self._update_stop()
        self._changed()

    # -- refresh ----------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read new rows and redraw what changed; returns False once nothing more can change (every
        run has ended; a workdir view keeps looking for new runs)."""
        if self.model.due_rescan():
            with self._lock:
                self.model.rescan()
                for view in self.model.runs.values():
                    self.table.add(view)
        self.model.poll(self._lock)
        with self._lock:
            self._update_picker()
            # the rows before the header: the browser applies widget updates in the order sent, so a
            # header that says the run ended never shows beside a row still saying "running"
            self._update_progress()
            self._update_header()
            self._update_stop()
            if len(self.model.runs) > 1 or self.workdir is not None:
                self.table.box.layout.display = ""
                self.table.render()
            self._redraw()
            if self.tabs.selected_index == LOGS_TAB:
                self._update_log()
        return self._going()

    def _changed(self) -> None:
        """A control changed: update and redraw at once (not at the next refresh)."""
        if self._quiet:
            return
        try:
            with self._lock:
                self._update_progress()
                self._update_header()
                self._redraw(force=True)
        except Exception as e:  # (in the kernel's widget callback: say it where it is seen)
            self.refresher.say_failure("redraw", e)

    # -- header, tenants, progress, stop -----------------------------------------------------------
    def picked(self) -> list[Key]:
        """The (run, tenant) pairs being drawn."""
        chosen = set(self.chosen)
        return [
            k for k in self.tenants.value if k[0] in chosen and k[1] in self.model.runs[k[0]].series.tenants
        ]

    def label(self, key: Key) -> str:
        """A series' name in legends, progress rows and readouts: the tenant, or ``run / tenant`` when
        several runs are shown (the run's title: its job's name), at most
        :data:`~mlora_lab.lab.plotting.LABEL_CHARS` characters (the run's title is shortened first)."""
        several = len(self.chosen) > 1
        return series_label(self.model.runs[key[0]].title if several else None, key[1])

    def colour(self, key: Key) -> str:
        """A series' colour (:func:`~mlora_lab.lab.plotting.series_colour`: its run's name and its place
        in the run, whatever else is shown)."""
        return self.model.colour(key)

    @property
    def colors(self) -> dict[Key, str]:
        """The colour of every series drawn so far."""
        return {k: self.colour(k) for k in self.controls.known}

    def tenant_state(self, key: Key) -> TenantShown | None:
        """The state a tenant is shown in (:meth:`~mlora_lab.lab.dashboard.model.RunView.tenant_state`)."""
        return self.model.runs[key[0]].tenant_state(key[1])

    def _update_picker(self) -> None:
        self.model.retitle(self.chosen)
        keys = self.model.keys(self.chosen, limit=MAX_SERIES)
        self.controls.offer(keys, self.label)
        total = self.model.count(self.chosen)
        capped = (
            f"<span style='color:{AMBER}'>showing the first {len(keys):,} of {total:,} tenants (the view draws "
            f"at most {MAX_SERIES}); pick others with <code>ml.compare(run, tenants=[...])</code></span>"
            if total > len(keys)
            else ""
        )
        if self.capped.value != capped:
            self.capped.value = capped

    def _update_header(self) -> None:
        views: list[RunView] = [self.model.runs[n] for n in self.chosen or list(self.model.runs)[:1]]
        lines = [header_html(view) for view in views]
        if not self.model.runs:
            lines.append(f"no runs in {html.escape(str(self.workdir))} yet")
        value = "<br>".join(lines)
        if self.status.value != value:
            self.status.value = value

    def _update_progress(self) -> None:
        keys = self.picked()
        for key in keys:
            view = self.model.runs[key[0]]
            tenant = view.series.tenants[key[1]]
            row = self.progress_rows.get(key)
            if row is None:
                row = self.progress_rows[key] = TenantProgress(
                    self.label(key), self.colour(key), tenant.max_steps
                )
            row.rename(self.label(key), self.colour(key))
            row.update(tenant, view.tenant_state(key[1]), view.series.resumes)
        children = tuple(self.progress_rows[k].box for k in keys)
        if self.progress.children != children:
            self.progress.children = children

    def _update_stop(self) -> None:
        ended = {str(self.model.runs[n].state or "?") for n in self.chosen}
        self.controls.show_stop(
            self.model.live(self.chosen),
            len(self.chosen),
            ended,
            self._stopping,
            title=lambda n: self.model.runs[n].title or n,
        )

    def stop_runs(self) -> list[str]:
        """Ask every chosen live run to stop gracefully (each job checkpoints, then exits); returns
        their names. This is what the Stop button does."""
        live = self.model.live(self.chosen)
        for name in live:
            control.request_stop(self.model.runs[name].path)
        self._stopping.update(live)
        self._update_stop()
        return live

    # -- drawing ----------------------------------------------------------------------------------
    def _scene(self) -> Scene:
        return Scene(
            feeds=self.feeds,
            picked=self.picked(),
            chosen=self.chosen,
            x=self.x_axis.value,
            smoothing=self.smoothing.value,
            logy=self.logy.value,
            outliers=self.outliers.value,
            max_points=self.max_points,
            label=self.label,
            colour=self.colour,
        )

    def _redraw(self, force: bool = False) -> None:
        """Redraw what changed (:meth:`~mlora_lab.lab.dashboard.panels.Panels.update`)."""
        shown = {SYSTEM_TAB: "system", OPTIM_TAB: "optim"}.get(self.tabs.selected_index)
        self.panels.update(self._scene(), shown, force)

    def redraw(self, figures: Sequence[str] = ("loss", "optim", "system")) -> None:
        """Redraw these figures now (``loss``, ``optim``, ``system``; ``reward``, ``preference`` once
        shown)."""
        with self._lock:
            self.panels.redraw(self._scene(), figures)

    def _on_tab(self) -> None:
        with self._lock:
            self._redraw()
            if self.tabs.selected_index == LOGS_TAB:
                self._update_log(force=True)

    def _on_x(self, x: str) -> None:
        self.panels.set_x(x)
        self.follow(redraw=False)
        self._changed()

    def follow(self, redraw: bool = True) -> None:
        """Undo zooming and panning: every axes follows its data again."""
        self.panels.follow()
        if redraw:
            self._changed()

    def readout_at(self, ax: Any, x_px: float, y_px: float, radius_px: float = 25.0) -> str | None:
        """The drawn point nearest to display position ``(x_px, y_px)`` in ``ax``, as text
        ``series · x-label x · y`` (None when no point is within ``radius_px`` pixels), and the axes'
        highlight moved onto it."""
        return self.panels.readout_at(ax, x_px, y_px, radius_px)

    # -- logs and export --------------------------------------------------------------------------
    def _update_log(self, force: bool = False) -> None:
        self.logs.update([(n, self.model.runs[n].liveness.dir) for n in self.chosen], force=force)

    def export(
        self, folder: str | Path | None = None, figures: bool = True, metrics: bool = True
    ) -> list[Path]:
        """Write the figures (``loss``, ``optim``, ``system``, and ``reward`` with RL tenants: PNG at twice
        the display resolution and SVG) and the shown tenants' train and eval rows (CSV with a ``run``
        column) into ``folder`` (default: the export folder field, see the class docstring), each file
        atomically; names start with the time, so exports never overwrite each other. Returns the files
        written."""
        if folder is None:
            default = default_export_dir([self.model.runs[n].path for n in self.chosen])
            folder = self.exporter.folder.value or default
        if folder is None:
            raise ValueError("no run chosen: nothing to export")
        with self._lock:
            drawn = self.panels.exported(self._scene()) if figures else []
            legend = self.loss.legend_in_figure() if figures else contextlib.nullcontext()
            with legend:
                return export_files(Path(folder), drawn, self.metrics() if metrics else None)

    def metrics(self) -> pd.DataFrame:
        """The train and eval rows of the shown tenants, with a ``run`` column first."""
        with self._lock:
            return self.model.metrics(self.picked())
