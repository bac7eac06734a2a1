"""The dashboard, ``compare`` and the plotting helpers they share, on run directories whose metrics rows
are written here directly (no job is launched: fast, and every case is exact)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
import warnings
import zlib
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib.backend_bases import MouseEvent

import mlora_lab as ml
from mlora_lab.lab import plotting
from mlora_lab.lab.dashboard import Dashboard
from mlora_lab.lab.dashboard.table import COLUMNS
from mlora_lab.lab.plotting import PALETTE, Ema, ema, series_colour, thin, thin_with_breaks
from mlora_lab.lab.records.series import gap_breaks
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import (
    EventKind,
    EventRow,
    HeldoutRow,
    MetricsWriter,
    RunDir,
    SystemRow,
    TenantRow,
    TrainRow,
    update_status,
)
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant

T0 = 1.8e9


# -- run directories written by hand -------------------------------------------------------------------


def make_run(
    root: Path, tenants=("a", "b"), max_steps: int = 100, state: str = "running", name: str | None = ""
) -> RunDir:
    """A run directory with job.json and status.json, as a launch leaves it (no process: a status
    without a pid is taken as it is written). The job is named like its directory (``name=""``), or
    ``name``, or (None) by default, from its tenants."""
    run = RunDir(root).create()
    data = root / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    tenants = [Tenant(name=t, data=str(data), max_steps=max_steps) for t in tenants]
    spec = JobSpec(
        base_model=str(root),
        tenants=tenants,
        max_tenants=max(8, len(tenants)),
        name=root.name if name == "" else name,
    )
    if name is None:
        spec = spec.resolved(root)
    spec.to_json(run.job)
    update_status(root, state=state, started=time.time() - 60)
    return run


def write(run: RunDir, *rows) -> None:
    w = MetricsWriter(run.metrics)
    for r in rows:
        w.write(r)
    w.close()


def steps(tenants, first: int, last: int, t0: float = T0, dt: float = 1.0, loss=None, **extra) -> list:
    """Train rows for steps first..last of each tenant, one logged step per ``dt`` seconds."""
    loss = loss or (lambda s, i: 3.0 / (1 + 0.05 * s) + 0.01 * i)
    return [
        TrainRow(
            step=s,
            tenant=t,
            tenant_step=s,
            loss=loss(s, i),
            tokens=100,
            lr=1e-3,
            grad_norm=1.0,
            time=t0 + s * dt,
            **extra,
        )
        for s in range(first, last + 1)
        for i, t in enumerate(tenants)
    ]


def system(
    first: int, last: int, t0: float = T0, dt: float = 1.0, rank: int = 0, mib: float = 1000.0, **extra
):
    return [
        SystemRow(
            step=s,
            rank=rank,
            mem_bytes=int((mib + (s % 3) * 0.01 * mib) * 2**20),
            peak_mem_bytes=0,
            step_time=0.1,
            tokens_per_s=1000.0,
            time=t0 + s * dt,
            **extra,
        )
        for s in range(first, last + 1)
    ]


def dash_of(*roots: Path, **kw) -> Dashboard:
    kw.setdefault("interactive", False)
    dash = Dashboard([Run(r) for r in roots], **kw)
    dash.refresh()
    return dash


def png_size(data: bytes) -> tuple[int, int]:
    import io

    image = matplotlib.image.imread(io.BytesIO(data), format="png")
    return image.shape[1], image.shape[0]


# -- plotting helpers -------------------------------------------------------------------------------


def test_incremental_ema_equals_the_whole_series():
    rng = np.random.default_rng(0)
    values = rng.normal(size=700)
    values[[5, 300]] = np.nan  # a non-finite loss is logged as null
    cache = Ema()
    for end in (1, 2, 50, 51, 60, 400, 401, 700):  # small appends go point by point, big ones in one pass
        got = cache(values[:end], 0.9)
        np.testing.assert_allclose(got, ema(values[:end], 0.9), rtol=1e-10)
    assert cache(values, 0.5) is not None and np.allclose(cache(values, 0.5), ema(values, 0.5))  # new factor
    assert list(ema(np.array([1.0, 1.0, 1.0]), 0.9)) == [1.0, 1.0, 1.0]
    assert ema(np.array([0.0, 10.0]), 0.5)[1] == pytest.approx(10 * 0.5 / 0.75)


def test_thinning_bounds_points_and_keeps_spikes_and_the_last_point():
    x = np.arange(10_000, dtype=float)
    y = np.sin(x / 300)
    y[4321] = 50.0  # a spike that every-k-th-point thinning would drop
    tx, ty = thin(x, y, 100)
    assert len(tx) <= 100 and tx[-1] == 9_999 and tx[0] == 0
    assert 50.0 in ty
    assert np.all(np.diff(tx) > 0)
    assert len(thin(x[:50], y[:50], 100)[0]) == 50  # a short series is drawn as it is


def test_lines_break_across_gaps_and_resumes_also_after_thinning():
    t = np.r_[np.arange(0, 100.0), np.arange(1000, 1100.0)]  # logged every second, then a stop until 1000 s
    breaks = gap_breaks(t)
    assert np.flatnonzero(breaks).tolist() == [100]
    assert np.flatnonzero(gap_breaks(np.arange(10.0), resumes=[4.5])).tolist() == [5]  # a resumed event
    x, y = thin_with_breaks(t, t, breaks, 40)
    assert len(x) <= 43 and np.isnan(y).sum() == 1
    i = int(np.flatnonzero(np.isnan(y))[0])
    assert x[i - 1] == 99 and x[i + 1] == 1000  # the last point before the gap and the first after it


def test_colours_come_from_the_run_name_and_the_tenants_place_alone():
    start = zlib.crc32(b"quickstart") % 10
    assert series_colour("quickstart", 0) == PALETTE[start]  # nothing else decides it
    tenants = [series_colour("quickstart", i) for i in range(20)]
    assert len(set(tenants)) == 20, "a run's tenants never share a colour"
    assert set(tenants[:10]) == set(PALETTE[:10]) and set(tenants[10:]) == set(PALETTE[10:])
    assert series_colour("quickstart", 20) == tenants[0]
    others = {series_colour(f"run{i}", 0) for i in range(40)}
    assert len(others) == 10, "each run starts its tenants at its own place in the palette"


def test_log_axis_has_readable_ticks_grid_and_unclipped_labels(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([1, 2, 3], [0.62, 1.1, 1.8])
    plotting.style_axes(ax, ylabel="a long y label that needs room", xlabel="step")
    plotting.set_log_y(ax, True)
    plotting.fit_layout(fig)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi and t.get_text()]
    assert len(labels) >= 4, labels  # inside one decade: 0.8, 1, 1.2, ... not just "10^0"
    assert all("$" not in s for s in labels)  # plain numbers
    assert any(line.get_visible() for line in ax.get_ygridlines())
    renderer = fig.canvas.get_renderer()
    box = ax.yaxis.label.get_window_extent(renderer)
    assert box.x0 >= 0 and box.y0 >= 0 and box.y1 <= fig.bbox.height  # not clipped


def test_robust_limits_ignore_a_spike():
    values = np.r_[np.linspace(1, 2, 500), 1e4]
    lo, hi = plotting.robust_ylim([values])
    assert 0.9 < lo < 1.1 and 1.9 < hi < 2.2


# -- states and labels (issue 13, defect 3) ----------------------------------------------------------------


def test_after_stop_tenants_read_stopped_not_running(tmp_path):
    run = make_run(tmp_path / "r")
    write(
        run,
        TenantRow(step=0, tenant="a", state="running"),
        TenantRow(step=0, tenant="b", state="running"),
        *steps(["a", "b"], 1, 5),
    )
    dash = dash_of(run.root)
    assert all("running" in r.info.value for r in dash.progress_rows.values())
    update_status(run.root, state="stopped", ended=time.time())
    dash.refresh()
    assert "<b>stopped</b>" in dash.status.value
    infos = [r.info.value for r in dash.progress_rows.values()]
    assert all("stopped" in i and "running" not in i for i in infos), infos
    assert dash.stop_button.disabled and dash.stop_button.description == "run stopped"
    assert dash.stop_button.button_style == "", "an ended run's button is quiet, not red"


def test_a_quarantined_tenant_keeps_a_finished_run_from_looking_green(tmp_path):
    run = make_run(tmp_path / "r", state="finished")
    long_reason = "loss became NaN at step 3 (grad norm inf); quarantined " + "x" * 400
    write(
        run,
        *steps(["a", "b"], 1, 3),
        TenantRow(step=3, tenant="b", state="failed", reason=long_reason),
        TenantRow(step=3, tenant="a", state="finished"),
    )
    dash = dash_of(run.root)
    assert "finished · 1 tenant failed" in dash.status.value
    assert plotting_green() not in dash.status.value
    row = dash.progress_rows[("r", "b")]
    # the reason has its own lines, wrapped, whole (and in its tooltip); the bar keeps its width
    assert row.reason.layout.display != "none" and long_reason in row.reason.value
    assert "white-space:pre-wrap" in row.reason.value and f"title='{long_reason}'" in row.reason.value
    assert row.bar.layout.width == row.bar.layout.min_width == "200px"
    assert long_reason not in row.info.value
    assert dash.progress_rows[("r", "a")].reason.layout.display == "none"


def plotting_green() -> str:
    from mlora_lab.lab.dashboard.figures import GREEN

    return GREEN


def test_a_tenant_with_one_point_is_drawn_as_a_dot(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a"], 1, 1), *steps(["b"], 1, 200))
    dash = dash_of(run.root)
    lines = dash.loss.lines
    assert (
        lines[(("r", "a"), "main")].get_marker() == "o" and len(lines[(("r", "a"), "main")].get_xdata()) == 1
    )
    assert lines[(("r", "b"), "main")].get_marker() in ("", "None")


# -- memory (defects 4 and 6) ---------------------------------------------------------------------------


def test_tenant_memory_bars_are_the_latest_rows_adapter_plus_optimiser(tmp_path):
    run = make_run(tmp_path / "r")
    write(
        run,
        TenantRow(step=0, tenant="a", state="running", adapter_bytes=2 * 2**20),
        TenantRow(step=0, tenant="b", state="running", adapter_bytes=2**20),
    )
    dash = dash_of(run.root)
    adapter, optim = dash.system.bars
    assert [b.get_width() for b in adapter] == [2.0, 1.0] and [b.get_width() for b in optim] == [0.0, 0.0]
    # the trainer writes a second row once the tenant's AdamW state exists
    write(
        run,
        TenantRow(step=1, tenant="a", state="running", adapter_bytes=2 * 2**20, optimizer_bytes=4 * 2**20),
    )
    dash.refresh()
    dash.redraw(["system"])
    adapter, optim = dash.system.bars
    assert [b.get_width() for b in adapter] == [2.0, 1.0] and [b.get_width() for b in optim] == [4.0, 0.0]
    assert optim[0].get_x() == 2.0  # stacked: optimiser after adapter


def test_memory_axis_starts_at_zero_and_breaks_across_a_stop_and_resume(tmp_path):
    run = make_run(tmp_path / "r")
    resumed_at = T0 + 1000.5
    write(
        run,
        *steps(["a"], 1, 30),
        *system(1, 30),
        EventRow(step=30, event=EventKind.RESUMED, message="from step_30", time=resumed_at),
        *steps(["a"], 31, 60, t0=T0 + 1000 - 30),
        *system(31, 60, t0=T0 + 1000 - 30),
    )
    dash = dash_of(run.root)
    ax = dash.system.mem_ax
    assert ax.get_ylim()[0] == 0, "1 % jitter must not fill the axis"
    assert "range 1,000–1,020" in ax.get_title()
    (line,) = [ln for ln in ax.get_lines() if ln.get_visible()]
    y = np.asarray(line.get_ydata(), dtype=float)
    assert np.isnan(y).sum() == 1, "one break, at the resume: no diagonal across the gap"
    # the loss against time breaks there too; against steps it is continuous
    dash.x_axis.value = "relative time"
    main = dash.loss.lines[(("r", "a"), "main")]
    assert np.isnan(np.asarray(main.get_ydata(), dtype=float)).sum() == 1
    dash.x_axis.value = "tenant step"
    assert not np.isnan(np.asarray(main.get_ydata(), dtype=float)).any()


def test_utilisation_is_drawn_when_logged_and_says_not_logged_otherwise(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a"], 1, 5), *system(1, 5))
    dash = dash_of(run.root)
    text = dash.system.util_ax._lab_placeholder
    assert text.get_visible() and "not logged" in text.get_text()
    write(run, *system(6, 9, cpu_percent=180.0, gpu_util=None), *system(6, 9, rank=1, cpu_percent=90.0))
    dash.refresh()
    dash.redraw(["system"])
    assert not dash.system.util_ax._lab_placeholder.get_visible()
    drawn = {k for k, ln in dash.system.sets[dash.system.util_ax].lines.items() if ln.get_visible()}
    assert drawn == {("r", 0, "cpu_percent"), ("r", 1, "cpu_percent")}
    assert dash.system.util_ax.get_ylim() == (0.0, pytest.approx(180 * 1.08))


# -- axes (defects 5, 7, 8) --------------------------------------------------------------------------


def test_empty_axes_wait_for_the_first_step_without_ticks(tmp_path):
    run = make_run(tmp_path / "r")
    dash = dash_of(run.root)
    ax = dash.loss.ax
    assert not ax.axison and ax._lab_placeholder.get_visible()
    assert "waiting for the first step" in ax._lab_placeholder.get_text()
    write(run, *steps(["a"], 1, 3))
    dash.refresh()
    assert ax.axison and not ax._lab_placeholder.get_visible()


def test_log_y_in_the_dashboard_has_ticks_and_grid(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 60))
    dash = dash_of(run.root, logy=True)
    ax = dash.loss.ax
    dash.loss_fig.canvas.draw()
    lo, hi = ax.get_ylim()
    labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi and t.get_text()]
    assert ax.get_yscale() == "log" and len(labels) >= 4, labels
    assert any(gl.get_visible() for gl in ax.get_ygridlines())
    box = ax.yaxis.label.get_window_extent(dash.loss_fig.canvas.get_renderer())
    assert box.x0 >= 0, "the y label is inside the figure"


def test_pngs_are_rendered_at_twice_their_display_size(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a"], 1, 5), *system(1, 5))
    dash = dash_of(run.root)
    for fig, image in ((dash.loss_fig, dash.loss_plot), (dash.system_fig, dash.system_plot)):
        w, h = fig.get_size_inches() * plotting.DISPLAY_DPI
        assert image.width == str(int(w))
        assert png_size(image.value) == (int(2 * w), int(2 * h))


# -- x axes, smoothing, outliers -------------------------------------------------------------------------


def test_x_axis_choices(tmp_path):
    run = make_run(tmp_path / "r")
    rows = steps(["a"], 1, 10, dt=2.0)
    for r in rows:
        r.step += 100  # global steps differ from the tenant's own
    write(run, *rows)
    dash = dash_of(run.root, smoothing=0.0)
    line = dash.loss.lines[(("r", "a"), "main")]
    expected = {
        "tenant step": np.arange(1, 11),
        "global step": np.arange(101, 111),
        "tokens": np.arange(1, 11) * 100,
        "relative time": np.arange(0, 20, 2),
        "wall time": (T0 + np.arange(1, 11) * 2) / 86400,
    }
    for x, values in expected.items():
        dash.x_axis.value = x
        np.testing.assert_allclose(line.get_xdata(), values)
        assert dash.loss.ax.get_xlabel() == plotting.X_LABELS[x]
    # a job that logs cumulative tokens_seen: exact even when log_every skips steps
    run2 = make_run(tmp_path / "r2")
    write(
        run2,
        *[
            TrainRow(
                step=s,
                tenant="a",
                tenant_step=s,
                loss=1.0,
                tokens=100,
                lr=1e-3,
                grad_norm=1.0,
                time=T0 + s,
                tokens_seen=s * 300,
            )
            for s in (3, 6, 9)
        ],
    )
    assert dash_of(run2.root).feeds["r2"].xy("a", "loss", "tokens")[0].tolist() == [900, 1800, 2700]


def test_smoothing_keeps_the_raw_data_and_outliers_can_be_ignored(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a"], 1, 200, loss=lambda s, i: 1000.0 if s == 100 else 2.0 - s / 200))
    dash = dash_of(run.root, smoothing=0.8)
    lines = dash.loss.lines
    raw, main = lines[(("r", "a"), "raw")], lines[(("r", "a"), "main")]
    assert raw.get_visible() and raw.get_alpha() < 0.5 and max(raw.get_ydata()) == 1000.0
    assert max(main.get_ydata()) < 1000.0
    assert dash.loss.ax.get_ylim()[1] > 1000
    dash.outliers.value = True
    assert dash.loss.ax.get_ylim()[1] < 10, "the spike no longer sets the scale"
    assert raw.get_visible()
    dash.smoothing.value = 0.0
    assert not raw.get_visible() and max(main.get_ydata()) == 1000.0  # unsmoothed: the one line is the data


# -- several runs -----------------------------------------------------------------------------------------


def test_a_workdir_view_lists_sorts_filters_and_overlays_runs(tmp_path):
    from mlora_lab.rundir.labels import update_labels

    work = tmp_path / "runs"
    r1 = make_run(work / "20260101-000000-aaaaaa", tenants=("a", "b"), state="finished")
    r2 = make_run(work / "20260102-000000-bbbbbb", tenants=("a", "c"))
    r3 = make_run(work / "20260103-000000-cccccc", tenants=("z",), state="failed")
    write(r1, *steps(["a", "b"], 1, 30))
    write(r2, *steps(["a", "c"], 1, 10, loss=lambda s, i: 0.5))
    update_labels(r1.root, add=["baseline"], note="first try")
    dash = Dashboard(work, interactive=False)
    dash.refresh()
    assert dash.table.box.layout.display != "none"
    assert dash.chosen == [r2.root.name], "the live run is shown first"
    rows = [
        row.name for row in (dash.table.rows[n] for n in dash.feeds) if row.box in dash.table.body.children
    ]
    assert len(rows) == 3
    cells = dash.table.rows[r1.root.name].cells.value
    best = min(plotting.best_smoothed(np.array([r.loss for r in steps([t], 1, 30)])) for t in "ab")
    assert "baseline" in cells and ">30<" in cells and f">{best:.4f}<" in cells  # tags, step, best loss
    # the run directory's whole name in a cell of its own, wide enough for it; a gap before every next cell
    assert f"font-family:monospace'>{r1.root.name}</span>" in cells
    assert cells.count("padding-right:10px") == len(COLUMNS) - 1, "every column but usage (no run served)"
    assert dict(COLUMNS)["id"] >= 7.5 * len("20261129-003243-2679c1") + 10
    dash.table.filter.value = "baseline"
    assert dash.table.body.children == (dash.table.rows[r1.root.name].box,)
    dash.table.filter.value = "z"  # a tenant name
    assert dash.table.body.children == (dash.table.rows[r3.root.name].box,)
    dash.table.filter.value = ""
    dash.table.state_filter.value = "finished"
    assert dash.table.body.children == (dash.table.rows[r1.root.name].box,)
    dash.table.state_filter.value = "any state"
    dash.table.sort_by.value = "global step"
    assert dash.table.body.children[0] is dash.table.rows[r1.root.name].box  # most steps first
    dash.table.sort_desc.value = False
    assert dash.table.body.children[-1] is dash.table.rows[r1.root.name].box
    # tick a second run: both overlay, labelled "run / tenant", one colour per (run, tenant)
    dash.table.rows[r1.root.name].check.value = True
    assert set(dash.chosen) == {r1.root.name, r2.root.name}
    labels = [label for label, _ in dash.tenants.options]
    assert f"{r1.root.name} / a" in labels and f"{r2.root.name} / a" in labels
    visible = [
        ln
        for ln in dash.loss.ax.get_lines()
        if ln.get_visible() and ln.get_label() not in ("_raw", "_heldout")
    ]
    assert len(visible) == 4 and len({ln.get_color() for ln in visible}) == 4
    assert f"{r2.root.name} / c" in dash.loss.legend.value
    # a new run launched into the workdir appears at the next look
    make_run(work / "20260104-000000-dddddd", tenants=("n",))
    dash.model._rescanned = 0
    dash.refresh()
    assert "20260104-000000-dddddd" in dash.feeds


def header_cells(header: str) -> list[tuple[str, int]]:
    """(text, width in px) of each cell of the runs table's header."""
    import re

    return [(t, int(w)) for w, t in re.findall(r"width:(\d+)px;[^>]*><b>([^<]*)</b>", header)]


def test_m5_the_runs_table_fits_a_notebook_one_line_a_run(tmp_path):
    """m5: the runs table was 1,460 px wide: in a notebook narrower than that each row wrapped onto two
    lines, and headers such as "best loss (smoothed)" were cut. It fits 960 px (a laptop's JupyterLab with
    its side bar open), every header whole (bold text at 7.5 px a character), each row held on one line (a
    narrower output scrolls); the usage column only when a shown run served clients (m10: a run whose
    tenants all learn from rewards shows its best reward there, not a GRPO loss)."""
    from test_rl_lab import rl_steps

    from mlora_lab.lab.dashboard.table import GAP
    from mlora_lab.rundir import UsageRow

    work = tmp_path / "runs"
    sft = make_run(work / "20260101-000000-aaaaaa", tenants=("a", "b"), state="finished")
    rl = make_run(work / "20260102-000000-bbbbbb", tenants=("grpo",), state="finished")
    write(sft, *steps(["a", "b"], 1, 30))
    write(rl, *rl_steps("grpo", 1, 8, reward=lambda s: s / 10))
    dash = Dashboard(work, interactive=False)
    dash.refresh()
    header = dash.table.header.value
    cells = header_cells(header)
    assert [t for t, _ in cells][:5] == ["run", "id", "state", "tenants", "step"] and "usage" not in header
    assert 30 + sum(w for _, w in cells) <= 960, cells  # (30: the checkbox's place)
    for text, width in cells:
        assert len(text) * 7.5 + GAP <= width, f"header {text!r} is cut at {width} px"
    for html in (header, *(row.cells.value for row in dash.table.rows.values())):
        assert html.startswith("<div style='white-space:nowrap"), "a row never wraps"
    assert ">reward 0.664<" in dash.table.rows[rl.root.name].cells.value, "its best smoothed reward"
    served = make_run(work / "20260103-000000-cccccc", tenants=("owner-1",))
    write(served, UsageRow(step=1, key="k", tenant="owner-1", tokens_trained=10, tokens_forward=0,
                           tokens_sampled=5, busy_s=0.5, requests=1))  # fmt: skip
    dash.model._rescanned = 0
    dash.refresh()
    assert "usage" in [t for t, _ in header_cells(dash.table.header.value)], "a served run's usage"


def test_stop_asks_each_chosen_live_run_and_says_which(tmp_path):
    roots = [make_run(tmp_path / n).root for n in ("one", "two", "three")]
    done = make_run(tmp_path / "done", state="finished").root
    dash = dash_of(*roots, done)
    dash.choose(["one", "two", "done"])
    assert dash.stop_button.description == "Stop 2 runs" and not dash.stop_button.disabled
    dash.stop_button.click()
    assert [(r / "control" / "stop").exists() for r in (*roots, done)] == [True, True, False, False]
    assert dash.stop_button.disabled and dash.stop_button.description == "Stopping 2 runs…"
    dash.choose(["three", "done"])
    assert dash.stop_button.description == "Stop three" and not dash.stop_button.disabled
    update_status(roots[0], state="stopped")
    dash.choose(["one"])
    dash.refresh()
    assert dash.stop_button.description == "run stopped" and dash.stop_button.disabled
    assert dash_of(roots[2]).stop_button.description == "Stop"  # one run shown: no name needed


def test_colours_are_the_same_in_the_dashboard_and_in_compare(tmp_path):
    roots = [make_run(tmp_path / n).root for n in ("x", "y")]
    for r in roots:
        write(RunDir(r), *steps(["a", "b"], 1, 5))
    dash = dash_of(*roots)
    fig = ml.compare([Run(r) for r in roots])
    drawn = {ln.get_label(): ln.get_color() for ln in fig.axes[0].lines if not ln.get_label().startswith("_")}
    for key in dash.picked():
        assert drawn[dash.label(key)] == dash.colour(key)
    assert len(set(drawn.values())) == 4


def test_compare_warns_naming_runs_without_the_metric(tmp_path):
    with_eval, without = make_run(tmp_path / "with_eval"), make_run(tmp_path / "without")
    write(with_eval, *steps(["a"], 1, 4), HeldoutRow(step=4, tenant="a", loss=1.5, time=T0 + 4))
    write(without, *steps(["a"], 1, 4))
    with pytest.warns(UserWarning, match=r"no 'eval_loss' values in run\(s\) without"):
        fig = ml.compare([with_eval.root, without.root], metric="eval_loss")
    (line,) = [ln for ln in fig.axes[0].lines if not ln.get_label().startswith("_")]
    assert line.get_label() == "with_eval / a" and line.get_marker() == "o"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ml.compare([with_eval.root, without.root], metric="loss")
    with pytest.raises(ValueError, match="unknown x axis"):
        ml.compare(with_eval.root, x="epochs")


def test_compare_log_axis_smoothing_and_png(tmp_path):
    from IPython.core.formatters import DisplayFormatter

    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 40), HeldoutRow(step=20, tenant="a", loss=1.0, time=T0 + 20))
    fig = ml.compare(run.root, smoothing=0.6, logy=True, x="global step")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "global step"
    assert len([ln for ln in ax.lines if ln.get_label() == "_raw"]) == 2  # the raw values stay drawn
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    assert len([t for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi and t.get_text()]) >= 3
    data, metadata = DisplayFormatter().format(fig)
    assert "image/png" in data and metadata["image/png"] == {"width": 640, "height": 360}  # shown at 1x ...
    assert png_size(data["image/png"]) == (1280, 720)  # ... rendered at 2x
    path = tmp_path / "losses.svg"
    from mlora_lab.lab.compare.results import plot_losses

    plot_losses(run.root, path)
    assert path.read_text().lstrip().startswith("<?xml")
    evals = [ln for ln in plot_losses(run.root).axes[0].lines if ln.get_label() == "_heldout"]
    assert len(evals) == 1 and evals[0].get_xdata().tolist() == [20]


# -- logs, export --------------------------------------------------------------------------------------------


def test_log_tail_per_rank_highlights_errors(tmp_path):
    run = make_run(tmp_path / "r")
    (run.logs / "rank0.log").write_text("".join(f"step {i}\n" for i in range(100)))
    (run.logs / "rank1.log").write_text("ok\nTraceback (most recent call last):\nRuntimeError: boom\n")
    dash = dash_of(run.root)
    dash.tabs.selected_index = 2
    assert [label for label, _ in dash.logs.source.options] == ["rank 0", "rank 1"]
    shown = dash.logs.view.value
    assert "step 99" in shown and "step 59" not in shown and "step 60" in shown  # the last 40 lines
    dash.logs.source.value = str(run.logs / "rank1.log")
    assert "font-weight:bold'>RuntimeError: boom" in dash.logs.view.value
    assert "font-weight:bold'>ok" not in dash.logs.view.value
    with open(run.logs / "rank1.log", "a") as f:
        f.write("later line\n")
    dash.refresh()
    assert "later line" in dash.logs.view.value


def test_export_writes_figures_and_the_shown_tenants_metrics(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 10), *system(1, 10))
    dash = dash_of(run.root)
    dash.tenants.value = [("r", "a")]
    assert dash.exporter.folder.value == str(run.root / "exports")
    dash.exporter.figures_button.click()
    files = sorted(p.name for p in (run.root / "exports").iterdir())
    assert len(files) == 6 and all(n.endswith(("png", "svg")) for n in files)
    assert "wrote 6 files" in dash.exporter.message.value and files[0] in dash.exporter.message.value
    png = next((run.root / "exports").glob("*-loss.png")).read_bytes()
    assert png_size(png) == (1440, 576)
    dash.exporter.csv_button.click()
    (csv,) = (run.root / "exports").glob("*-metrics.csv")
    import pandas as pd

    df = pd.read_csv(csv)
    assert set(df["tenant"]) == {"a"} and len(df) == 10 and df.columns[0] == "run"
    assert not any(p.name.startswith(".") for p in (run.root / "exports").iterdir()), (
        "no temporary files left"
    )
    # several runs: next to them
    other = make_run(tmp_path / "s")
    assert dash_of(run.root, other.root).exporter.folder.value == str(tmp_path / "exports")


def append_unsafe_tenant_rows(run: RunDir) -> int:
    """Rows written by hand whose tenant cannot name a directory; how many."""
    bad = ["../../etc", "a/b", ".", "..", "x y", ""]
    with open(run.metrics, "a") as f:
        for t in bad:
            f.write(
                json.dumps({"kind": "train", "step": 11, "tenant": t, "tenant_step": 1, "loss": 1.0})[:-1]
            )
            f.write(', "tokens": 1, "lr": 0.001, "grad_norm": 1.0, "time": 1.8e9}\n')
        f.write(json.dumps({"kind": "tenant", "step": 11, "tenant": "../x", "state": "running"}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": 11, "tenant": "a/../../b", "loss": 1.0}) + "\n")
    return len(bad) + 2


def with_an_adapter(run: RunDir, tenant: str) -> None:
    (run.adapters / tenant).mkdir(parents=True)
    (run.adapters / tenant / "adapter_config.json").write_text("{}")


def test_DR5_a_row_naming_an_unsafe_tenant_is_skipped_by_the_runs_dashboard(tmp_path):
    """DR5 / D3: one hand-written row whose tenant is ``../../etc`` (or ``.``, ``a/b``, ...) no longer makes
    ``ml.Dashboard([run])`` raise: the row is skipped with a warning naming the file and line, and the
    dashboard, its export tab, ``ml.summary`` and ``run.metrics()`` show the run's real tenants."""
    from mlora_lab.lab.compare.results import summary

    run = make_run(tmp_path / "r", state="finished")
    write(run, *steps(["a", "b"], 1, 10))
    with_an_adapter(run, "a")
    n = append_unsafe_tenant_rows(run)
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl line \d+: skipped .*not a safe name") as caught:
        dash = ml.Dashboard([Run(run.root)], interactive=False)
        dash.refresh()
    assert len([w for w in caught if "not a safe name" in str(w.message)]) == n
    assert not dash.problem.value
    assert dash.model.keys(dash.chosen) == [("r", "a"), ("r", "b")]
    assert [v for _, v in dash.exporter.adapter.options] == [(run, "a")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert sorted(summary(Run(run.root))["tenant"]) == ["a", "b"]
        assert set(Run(run.root).metrics()["tenant"]) == {"a", "b"}


def test_D3d_a_row_naming_an_unsafe_tenant_does_not_break_the_folders_dashboard(tmp_path):
    """D3d: the dashboard of a whole folder (its export tab asks for an adapter folder per tenant shown)
    builds, lists every run and offers the saved adapters, with a run holding such rows among them."""
    work = tmp_path / "runs"
    good = make_run(work / "20260101-000000-aaaaaa", tenants=("a",), state="finished")
    bad = make_run(work / "20260102-000000-bbbbbb", tenants=("a", "b"), state="finished")
    write(good, *steps(["a"], 1, 5))
    write(bad, *steps(["a", "b"], 1, 5))
    with_an_adapter(bad, "b")
    append_unsafe_tenant_rows(bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dash = Dashboard(work, interactive=False)
        dash.refresh()
        dash.table.rows[good.root.name].check.value = True
        assert set(dash.chosen) == {good.root.name, bad.root.name}
        runs = ml.runs(work)
    assert any("not a safe name" in str(w.message) for w in caught)
    assert not dash.problem.value and len(dash.table.rows) == 2
    assert sorted(k for k in dash.model.keys(dash.chosen)) == [
        (good.root.name, "a"),
        (bad.root.name, "a"),
        (bad.root.name, "b"),
    ]
    assert [v for _, v in dash.exporter.adapter.options] == [(bad, "b")]
    assert len(runs) == 2


def test_D3d_a_job_json_naming_an_unsafe_tenant_does_not_break_the_export_tab(tmp_path):
    """D3d: job.json edited by hand to name a tenant ``../evil`` (the job would refuse it; the views read
    job.json's names): the folder's dashboard builds, and its export tab offers only adapters that can be
    in the run's ``adapters/`` (a name that cannot name a folder has none)."""
    work = tmp_path / "runs"
    run = make_run(work / "r", tenants=("a", "b"), state="finished")
    job = json.loads(run.job.read_text())
    job["tenants"][0]["name"] = "../evil"
    run.job.write_text(json.dumps(job))
    write(run, *steps(["b"], 1, 5))
    with_an_adapter(run, "b")
    dash = Dashboard(work, interactive=False)
    dash.refresh()
    assert not dash.problem.value
    assert [v for _, v in dash.exporter.adapter.options] == [(run, "b")]


# -- the model: what a view shows, without a widget ------------------------------------------------------

MODEL_WITHOUT_WIDGETS = """
import sys, time
from mlora_lab.lab.dashboard.model import Unreadable, ViewModel
from mlora_lab.rundir import RunState, TenantState

work = sys.argv[1]
model = ViewModel.of(work)
assert model.poll()
live, done, broken = (model.runs[n] for n in ("live", "done", "broken"))
assert (live.state, done.state, broken.state) == (RunState.RUNNING, RunState.STOPPED, Unreadable.BROKEN)
assert model.live(list(model.runs)) == ["broken", "live"] and model.going  # an unreadable run may still go
assert live.tenant_state("a") is TenantState.RUNNING and done.tenant_state("a") is RunState.STOPPED
assert live.eta() is not None and 35 <= live.eta() <= 45 and done.eta() is None  # 40 steps left at 1 step/s
assert model.keys(["live"]) == [("live", "a")] and list(model.metrics([("live", "a")])["step"]) == list(range(1, 11))
assert not model.poll(), "nothing new"
assert "ipywidgets" not in sys.modules
print("model ok")
"""


def test_the_view_model_needs_no_widget(tmp_path):
    """What a dashboard shows (states, an unreadable run, tenants' states once their run ended, ETAs,
    the metrics it exports) comes from a model that imports no ipywidgets (checked in a fresh process)."""
    import subprocess
    import sys

    work = tmp_path / "runs"
    live, done, broken = (
        make_run(work / n, tenants=("a",), max_steps=50) for n in ("live", "done", "broken")
    )
    write(live, *steps(["a"], 1, 10, t0=time.time() - 20))
    write(done, TenantRow(step=0, tenant="a", state="running"), *steps(["a"], 1, 3))
    update_status(done.root, state="stopped")
    broken.status.write_text("{half")
    out = subprocess.run(
        [sys.executable, "-c", MODEL_WITHOUT_WIDGETS, str(work)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "model ok" in out.stdout, out.stdout + out.stderr


# -- live refresh, interactive figures, display -------------------------------------------------------------


def test_refreshes_in_the_background_until_the_run_ends(tmp_path):
    run = make_run(tmp_path / "r", max_steps=50)
    write(run, *steps(["a"], 1, 10, t0=time.time() - 20))
    dash = Dashboard(Run(run.root), interactive=False, refresh_s=0.05).start()
    assert dash.live
    assert "ETA" in dash.status.value and "ETA 40 s" in dash.progress_rows[("r", "a")].info.value
    write(run, *steps(["a"], 11, 20, t0=time.time() - 20))
    deadline = time.monotonic() + 10
    while dash.feeds["r"].tenants["a"].step < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dash.feeds["r"].tenants["a"].step == 20
    update_status(run.root, state="finished", ended=time.time())
    while dash.live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dash.live and "finished" in dash.status.value


def test_a_rewritten_metrics_file_starts_the_view_over(tmp_path):
    from mlora_lab.rundir.rows import truncate_after

    run = make_run(tmp_path / "r")
    write(run, *steps(["a"], 1, 20))
    dash = dash_of(run.root)
    truncate_after(run.metrics, 10)  # what a resume from step 10 does
    write(run, *steps(["a"], 11, 12, t0=T0 + 500))
    dash.refresh()
    assert dash.feeds["r"].tenants["a"].step == 12 and len(dash.feeds["r"].tenants["a"].train) == 12


def test_interactive_figures_zoom_pan_and_hover(tmp_path):
    pytest.importorskip("ipympl")
    from ipympl.backend_nbagg import Canvas

    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 50))
    dash = dash_of(run.root, interactive=None, smoothing=0.0)
    assert isinstance(dash.loss_plot, Canvas) and dash.loss_plot.toolbar is not None
    assert dash.follow_button.layout.display != "none"
    ax = dash.loss.ax
    dash.loss_plot.draw()  # what the browser asks for (under the dashboard's lock)
    # hover: the point nearest the cursor, named
    px, py = ax.transData.transform((20, 3.0 / (1 + 0.05 * 20)))
    event = MouseEvent("motion_notify_event", dash.loss_plot, px + 2, py - 1)
    dash.loss_plot.callbacks.process("motion_notify_event", event)
    assert dash.readouts[dash.loss_fig].value.startswith("<b>a</b> · tenant step 20 · 1.5")
    assert dash.hover.highlights[ax].get_visible()
    far = MouseEvent("motion_notify_event", dash.loss_plot, 1, 1)
    dash.loss_plot.callbacks.process("motion_notify_event", far)
    assert dash.readouts[dash.loss_fig].value == ""
    # a zoom (the toolbar sets limits with autoscaling off) survives refreshes with new rows
    ax.set_xlim(10, 20)
    write(run, *steps(["a", "b"], 51, 80))
    dash.refresh()
    assert ax.get_xlim() == (10, 20)
    dash.follow()
    assert ax.get_xlim()[1] >= 80


def test_interactive_frames_are_pngs_before_the_browser_answers(tmp_path, monkeypatch):
    """Under Run All the kernel handles no message from the browser while a later cell blocks in
    ``run.wait()``; every frame the refresh thread pushes meanwhile must still be an image the browser
    can decode (ipympl 0.10 sent the raw RGBA buffer until the browser's "initialized" was handled)."""
    import base64
    import json as _json

    pytest.importorskip("ipympl")
    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 20))
    dash = dash_of(run.root, interactive=True)
    canvas = dash.loss_plot
    assert canvas.syncing_data_url, "no browser has answered: the canvas still keeps its static copy"
    frames = []
    monkeypatch.setattr(canvas, "send", lambda content, buffers=None: frames.append((content, buffers)))
    write(run, *steps(["a", "b"], 21, 40))
    dash.refresh()  # what the refresh thread does: a frame of the pixels that changed
    write(run, *steps(["a", "b"], 41, 60))
    dash.refresh()
    binary = [b for content, b in frames if _json.loads(content["data"])["type"] == "binary"]
    assert len(binary) == 2
    for (buffer,) in binary:
        assert bytes(buffer[:8]) == b"\x89PNG\r\n\x1a\n", "a frame the browser cannot decode"
        assert png_size(bytes(buffer)) == (720, 288)
    assert canvas._current_image_mode == "diff"
    # the static copy is the whole figure, not the last diff
    whole = base64.b64decode(canvas._data_url)
    assert png_size(whole) == (720, 288)
    image = matplotlib.image.imread(__import__("io").BytesIO(whole), format="png")
    assert image[..., 3].min() == 1.0, "every pixel of the static copy is opaque"


def test_every_tab_is_drawn_without_being_picked(tmp_path, monkeypatch):
    """Picking a tab reaches the kernel only once a blocking cell ends: the tabs' figures are drawn in
    the background whether their tab is shown or not (at most every TAB_EVERY_S while a run goes)."""
    from mlora_lab.lab.dashboard import board, panels

    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 20))
    dash = dash_of(run.root)
    assert dash.tabs.selected_index == board.SYSTEM_TAB
    lr_lines = [line for line in dash.optim.lr_ax.get_lines() if line.get_visible()]
    assert len(lr_lines) == 2 and all(len(line.get_xdata()) == 20 for line in lr_lines)
    # while the run goes, the hidden tab follows at its own pace, not at every refresh
    monkeypatch.setattr(panels, "TAB_EVERY_S", 3600.0)
    write(run, *steps(["a", "b"], 21, 30))
    dash.refresh()
    assert len(dash.optim.lr_ax.get_lines()[0].get_xdata()) == 20
    assert len(dash.loss.ax.get_lines()[0].get_xdata()) == 30
    monkeypatch.setattr(panels, "TAB_EVERY_S", 0.0)
    dash.refresh()
    assert len(dash.optim.lr_ax.get_lines()[0].get_xdata()) == 30


def test_without_ipympl_figures_are_images(tmp_path, monkeypatch):
    import ipywidgets as W

    from mlora_lab.lab.dashboard import board

    monkeypatch.setattr(board, "ipympl_available", lambda: False)
    dash = Dashboard(Run(make_run(tmp_path / "r").root))
    assert isinstance(dash.loss_plot, W.Image) and dash.follow_button.layout.display == "none"


def test_display_carries_a_png_for_frontends_without_widgets(tmp_path):
    run = make_run(tmp_path / "r", state="finished")
    write(run, *steps(["a"], 1, 5))
    dash = Dashboard(run.root, interactive=True)
    data, metadata = dash.bundle()
    assert "application/vnd.jupyter.widget-view+json" in data
    import base64

    assert png_size(base64.b64decode(data["image/png"])) == (1440, 576)
    assert metadata["image/png"] == {"width": 720, "height": 288}
    assert dash.loss.ax.get_legend() is None, "the legend drawn for the picture is gone again"


@pytest.mark.slow
def test_a_notebook_executed_headless_keeps_a_picture(tmp_path):
    """nbclient (no browser) runs a notebook that shows a dashboard: the saved output has the widget
    and a PNG for viewers without widgets."""
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    run = make_run(tmp_path / "r", state="finished")
    write(run, *steps(["a", "b"], 1, 20))
    nb = new_notebook(
        cells=[new_code_cell(f"import mlora_lab as ml\nml.Dashboard({str(run.root)!r}).start()")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert not [o for o in outputs if o.output_type == "error"], outputs
    mimes = {k for o in outputs for k in o.get("data", {})}
    assert {"image/png", "application/vnd.jupyter.widget-view+json"} <= mimes
    assert json.dumps(nb.metadata.get("widgets", {}))  # widget state is saved with the notebook


def test_two_runs_with_the_same_directory_name_stay_apart(tmp_path):
    a, b = make_run(tmp_path / "a" / "same"), make_run(tmp_path / "b" / "same")
    write(a, *steps(["t"], 1, 3))
    write(b, *steps(["t"], 1, 5))
    dash = dash_of(a.root, b.root, a.root)  # the same directory twice is one run
    assert list(dash.feeds) == ["same", "b/same"]
    assert [dash.feeds[n].tenants["t"].step for n in dash.feeds] == [3, 5]
    # both jobs are named "same": one colour (a notebook run again keeps its colours), told apart by
    # their labels and line styles
    assert dash.colour(("same", "t")) == dash.colour(("b/same", "t"))
    assert [dash.label(k) for k in dash.picked() if k[1] == "t"] == ["same / t", "same · b/same / t"]
    styles = {ln.get_linestyle() for ln in dash.loss.lines.visible("main")}
    assert styles == {"-", "--"}


def sweep_run(root: Path, lrs: dict[str, float], ranks: dict[str, int], best: dict[str, float]) -> RunDir:
    """A finished sweep written by hand: tenant -> lr, rank and the eval losses it logged (min = best)."""
    run = RunDir(root).create()
    data = root / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    tenants = [Tenant(name=t, data=str(data), lr=lrs[t], rank=ranks[t], alpha=16, max_steps=4) for t in lrs]
    JobSpec(base_model=str(root), tenants=tenants, max_tenants=8, max_rank=64).to_json(run.job)
    update_status(root, state="finished", started=time.time() - 60)
    rows = steps(list(lrs), 1, 4)
    for t, b in best.items():
        rows += [
            HeldoutRow(step=2, tenant=t, loss=b + 0.5, time=T0 + 2),
            HeldoutRow(step=4, tenant=t, loss=b, time=T0 + 4),
        ]
    write(run, *rows)
    return run


def test_hyperparameters_next_to_results(tmp_path):
    """summary() has the best eval loss; hparams() puts every tenant at (setting, best eval loss), on a log
    axis for lr, only for the settings that differ, marks the best, and warns about tenants without
    eval rows; the parallel-coordinates view has an axis per setting plus the metric."""
    from mlora_lab.lab.compare.hparams import hparams
    from mlora_lab.lab.compare.results import summary

    lrs = {"a": 1e-4, "b": 1e-3, "c": 1e-2, "d": 3e-3}
    ranks = {"a": 4, "b": 8, "c": 16, "d": 8}
    run = sweep_run(tmp_path / "r", lrs, ranks, best={"a": 2.0, "b": 1.0, "c": 3.0})
    table = summary(str(run.root)).set_index("tenant")
    assert table.loc["b", "best_eval_loss"] == 1.0 and table.loc["b", "eval_loss"] == 1.0
    assert pd.isna(table.loc["d", "best_eval_loss"])
    with pytest.warns(UserWarning, match=r"no eval_loss for r/d"):
        fig = hparams(str(run.root))
    axes = fig.axes
    assert [ax.get_xlabel() for ax in axes] == ["lr", "rank"], "alpha is the same for all: no panel"
    assert axes[0].get_xscale() == "log" and axes[1].get_xscale() == "linear"
    points = axes[0].collections[0].get_offsets()
    assert sorted(map(tuple, points.tolist())) == [(1e-4, 2.0), (1e-3, 1.0), (1e-2, 3.0)]
    best_ring = axes[0].collections[1].get_offsets().tolist()
    assert best_ring == [[1e-3, 1.0]], "the best tenant is ringed"
    # the best named above the panel, never over its points
    assert axes[0].get_title(loc="left") == "best (ringed): b" and not axes[0].texts
    with pytest.warns(UserWarning):
        par = hparams(str(run.root), kind="parallel", params=["lr", "rank", "alpha"])
    ax = par.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lr", "rank", "alpha", "best eval_loss"]
    assert len(ax.lines) == 3 + 4, "a line per tenant with an eval loss, and a vertical axis per column"
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        hparams(str(run.root), params=["momentum"])


# -- issue 22: the notebook side, as a new user and an attacker tried it ------------------------------


def test_a_failed_refresh_is_shown_and_logged_and_the_view_goes_on(tmp_path, monkeypatch, caplog):
    """One refresh that raises (a label matplotlib could not parse, say) must not end the live view."""
    run = make_run(tmp_path / "r")
    write(run, *steps(["a"], 1, 5, t0=time.time() - 10))
    dash = Dashboard([Run(run.root)], refresh_s=0.05, interactive=False)
    real_draw, broken = dash.loss.draw, {"left": 2}

    def draw(scene):
        if broken["left"]:
            broken["left"] -= 1
            raise ValueError("Unknown symbol: \\frac, found '\\'")
        real_draw(scene)

    monkeypatch.setattr(dash.loss, "draw", draw)
    with caplog.at_level("WARNING", logger="mlora_lab.lab.dashboard.board"):
        dash.start()
        deadline = time.monotonic() + 20
        while broken["left"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broken["left"] == 0 and dash.live, "the view refreshes on after a failed refresh"
        write(run, *steps(["a"], 6, 9, t0=time.time() - 10))

        # the axes' own list of lines (the refresh thread may add one while it is read: a dict would raise)
        def drawn() -> list[int]:
            return [len(ln.get_xdata()) for ln in dash.loss.ax.get_lines() if ln.get_label() == "a"]

        # until the refresh that read them has drawn them: the first whole refresh renders every figure,
        # seconds on a loaded machine, so no fixed pause is long enough
        while not ("recovered" in dash.problem.value and drawn() == [9]) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert dash.feeds["r"].tenants["a"].step == 9 and dash.live
    assert "Unknown symbol" in dash.problem.value and "recovered" in dash.problem.value
    assert len([r for r in caplog.records if "Unknown symbol" in r.getMessage()]) == 1, "logged once"
    (line,) = dash.loss.lines.visible("main")
    assert len(line.get_xdata()) == 9, "drawn again after the failure"
    update_status(run.root, state="finished", ended=time.time())
    while dash.live and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert not dash.live


MATHTEXT = r"cost $\frac{1}{$ vs $5"
"""A run name with an even number of dollars that matplotlib's mathtext cannot parse."""


def test_every_figure_is_drawn_and_laid_out_under_the_one_drawing_lock(tmp_path, monkeypatch):
    """matplotlib is not thread-safe, and a notebook draws from two threads: a live dashboard's refresh
    thread and the main thread. Notebook 05 once printed "the dashboard's refresh failed: ValueError:
    ... ParseException: exception raised in parse action (at char 0)": the dashboard's last refresh
    drew while ``ml.compare`` drew in the next cell, and mathtext's one parser keeps its state on
    itself. Every draw and layout pass of the lab, in whichever thread, holds ``plotting.DRAWING``:
    the refresh thread's, a browser's frame request on an ipympl canvas, ``compare``'s picture,
    ``plot_losses``' file and the dashboard's export."""
    import threading

    from IPython.core.formatters import DisplayFormatter
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    from mlora_lab.lab.compare.results import plot_losses

    unlocked: list[str] = []
    threads: set[str] = set()

    def held_elsewhere() -> bool:
        free = []

        def probe() -> None:  # (an RLock is released by the thread that took it)
            if plotting.DRAWING.acquire(blocking=False):
                plotting.DRAWING.release()
                free.append(True)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return not free

    def checked(method):
        def wrapper(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            if not held_elsewhere():
                unlocked.append(f"{method.__qualname__} in thread {threading.current_thread().name}")
            return method(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(Figure, "draw", checked(Figure.draw))
    monkeypatch.setattr(ConstrainedLayoutEngine, "execute", checked(ConstrainedLayoutEngine.execute))
    run = make_run(tmp_path / "r", max_steps=40)
    write(run, *steps(["a", "b"], 1, 10, t0=time.time() - 20), *system(1, 10, t0=time.time() - 20))
    dash = Dashboard(Run(run.root), interactive=False, refresh_s=0.05, logy=True).start()
    write(run, *steps(["a", "b"], 11, 20, t0=time.time() - 10))
    deadline = time.monotonic() + 20
    while dash.feeds["r"].tenants["a"].step < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    update_status(run.root, state="finished", ended=time.time())
    while dash.live and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dash.live and dash.feeds["r"].tenants["a"].step == 20
    fig = ml.compare(run.root, logy=True)
    data, _ = DisplayFormatter().format(fig)
    assert "image/png" in data
    plot_losses(run.root, tmp_path / "losses.png")
    dash.exporter.figures_button.click()
    assert "wrote 6 files" in dash.exporter.message.value
    if importlib.util.find_spec("ipympl") is not None:
        live = dash_of(run.root, interactive=None)
        live.loss_plot.draw()  # what a browser's request for a frame runs, in the kernel's main thread
    assert threads == {"mlora-dashboard", "MainThread"} and not unlocked, unlocked


def test_no_label_is_parsed_as_mathtext(tmp_path):
    """Run names (free text) and a sweep's categorical values reach legends, tick labels, titles and
    annotations: every one is shown literally, never parsed as mathtext (which raised)."""
    from mlora_lab.lab.compare.hparams import hparams
    from mlora_lab.lab.compare.results import plot_losses

    roots = []
    for k, name in enumerate((MATHTEXT, "$x$ plain")):
        run = make_run(tmp_path / f"r{k}", name=name)
        write(
            run,
            *steps(["a", "b"], 1, 6),
            TenantRow(step=1, tenant="a", state="running", adapter_bytes=2**20, optimizer_bytes=2**21),
            SystemRow(
                step=1, rank=0, mem_bytes=2**30, peak_mem_bytes=2**30, step_time=1, tokens_per_s=9, time=T0
            ),
            HeldoutRow(step=6, tenant="a", loss=1.0, time=T0 + 6),
            HeldoutRow(step=6, tenant="b", loss=2.0, time=T0 + 6),
        )
        roots.append(run.root)
    dash = dash_of(*roots)
    written = dash.export(tmp_path / "exports")  # loss with a legend, optim, system with tenant bars
    assert len(written) == 7 and not dash.problem.value
    assert MATHTEXT in dash.loss.legend.value.replace("&#x27;", "'").replace("&amp;", "&")
    bars = [t.get_text() for t in dash.system.bars_ax.get_yticklabels()]
    assert any(r"\$\frac" in t for t in bars), bars
    for fig in (
        ml.compare([Run(r) for r in roots]),
        plot_losses(Run(roots[0])),
        hparams([str(r) for r in roots]),
    ):
        fig._repr_png_()
    single = dash_of(roots[0])
    single.export(tmp_path / "one")
    assert MATHTEXT in single.status.value.replace("&#x27;", "'").replace("&amp;", "&")


def test_one_colour_per_run_and_tenant_in_every_view_and_after_a_rerun(tmp_path):
    """The same (run, tenant) has the same colour in the single-run dashboard, the multi-run dashboard
    (whatever else is shown, in any order), ml.compare, ml.hparams, and in a run of the same notebook made
    later (another directory, the same job name)."""
    from mlora_lab.lab.compare.hparams import hparams

    first = make_run(tmp_path / "20260101-000000-aaaaaa", tenants=("a", "b", "c"), name="quickstart")
    again = make_run(tmp_path / "20260102-000000-bbbbbb", tenants=("a", "b", "c"), name="quickstart")
    other = make_run(tmp_path / "20260103-000000-cccccc", tenants=("x", "a"), name="sweep")
    for run in (first, again, other):
        tenants = json.loads(run.job.read_text())["tenants"]
        write(run, *steps([t["name"] for t in tenants], 1, 5))
    solo = {k[1]: c for k, c in dash_of(first.root).colors.items()}
    assert len(set(solo.values())) == 3
    for roots in ((first.root, other.root), (other.root, first.root), (other.root, again.root, first.root)):
        dash = dash_of(*roots)
        for key in dash.picked():
            if key[0] in (first.root.name, again.root.name):
                assert dash.colour(key) == solo[key[1]], (roots, key)
    assert {k[1]: c for k, c in dash_of(again.root).colors.items()} == solo
    fig = ml.compare([Run(other.root), Run(first.root)])
    drawn = {
        ln.get_label(): ln.get_color() for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")
    }
    assert {t: drawn[f"quickstart / {t}"] for t in "abc"} == solo
    write(first, *[HeldoutRow(step=5, tenant=t, loss=1.0 + i, time=T0 + 5) for i, t in enumerate("abc")])
    points = hparams(str(first.root), params=["max_steps"], metric="eval_loss").axes[0].collections[0]
    assert [matplotlib.colors.to_hex(c) for c in points.get_facecolors()] == [solo[t] for t in "abc"]


def test_run_names_label_every_view_and_long_ones_keep_the_tenant(tmp_path):
    long = "a hyperparameter study of rank and learning rate on the spanish task, second try"
    one = make_run(tmp_path / "20260101-000000-aaaaaa", tenants=("spanish", "french"), name=long)
    two = make_run(tmp_path / "20260102-000000-bbbbbb", tenants=("spanish", "french"), name=None)
    for run in (one, two):
        write(run, *steps(["spanish", "french"], 1, 3))
    assert json.loads(two.job.read_text())["name"] == "spanish+french", "a readable default"
    dash = dash_of(one.root, two.root)
    labels = [dash.label(k) for k in dash.picked()]
    assert all(len(label) <= 48 for label in labels), labels
    assert [label.rsplit(" / ", 1)[1] for label in labels] == ["spanish", "french", "spanish", "french"]
    assert labels[0].startswith("a hyperparameter") and "…" in labels[0]
    assert labels[2] == "spanish+french / spanish"
    assert "20260101-000000-aaaaaa" not in "".join(labels), "labels are names, not timestamps"
    assert "spanish+french" in dash.status.value and "a hyperparameter study" in dash.status.value
    cells = dash.table.rows[two.root.name].cells.value
    assert ">spanish+french<" in cells
    legend = [ln.get_label() for ln in ml.compare([Run(one.root), Run(two.root)]).axes[0].get_lines()]
    assert "spanish+french / french" in legend


def test_tenant_states_agree_with_the_run_after_a_stop(tmp_path):
    """run.tenant_states() says what summary, status and the dashboard say: a tenant the job was still
    training when the run stopped reads stopped (also through ml.attach)."""
    from mlora_lab.rundir import RunState, TenantState

    run = make_run(tmp_path / "r", tenants=("a", "b", "c"))
    write(
        run,
        TenantRow(step=0, tenant="a", state="running"),
        TenantRow(step=0, tenant="b", state="running"),
        TenantRow(step=0, tenant="c", state="running"),
        TenantRow(step=3, tenant="c", state="finished"),
        *steps(["a", "b"], 1, 5),
    )
    assert Run(run.root).tenant_states() == {
        "a": TenantState.RUNNING,
        "b": TenantState.RUNNING,
        "c": TenantState.FINISHED,
    }
    update_status(run.root, state="stopped", ended=time.time())
    for handle in (Run(run.root), ml.attach(run.root)):
        states = handle.tenant_states()
        assert states == {"a": RunState.STOPPED, "b": RunState.STOPPED, "c": TenantState.FINISHED}
        assert handle.tenant_state("a") == "stopped"
    summary = ml.summary(Run(run.root)).set_index("tenant")["state"].to_dict()
    assert {t: str(s) for t, s in states.items()} == summary


def test_hparams_shows_categorical_settings_and_names_points_on_hover(tmp_path):
    """target_modules (a sweep's decisive setting) and schedule are drawn as categories, and the point
    under the cursor is named: run / tenant, its settings, its metric."""
    from mlora_lab.lab.compare.hparams import hparams

    run = RunDir(tmp_path / "r").create()
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    configs = {
        "qv": dict(target_modules=["q_proj", "v_proj"], lr=1e-3, schedule="constant"),
        "all": dict(target_modules=["all-linear"], lr=2e-3, schedule="cosine"),
        "qkvo": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lr=1e-3, schedule="cosine"),
    }
    tenants = [Tenant(name=n, data=str(data), **c) for n, c in configs.items()]
    JobSpec(base_model=str(tmp_path), tenants=tenants, name="study").to_json(run.job)
    update_status(run.root, state="finished", started=time.time() - 60)
    write(
        run,
        *steps(list(configs), 1, 3),
        *[
            HeldoutRow(step=3, tenant=t, loss=v, time=T0 + 3)
            for t, v in (("qv", 2.0), ("all", 1.0), ("qkvo", 1.5))
        ],
    )
    fig = hparams(str(run.root))
    names = [ax.get_xlabel() for ax in fig.axes]
    assert names == ["lr", "targets", "schedule"], names
    targets = fig.axes[1]
    ticks = [t.get_text() for t in targets.get_xticklabels()]
    assert ticks == ["all-linear", "q_proj,k_proj,v_proj,o_proj", "q_proj,v_proj"]
    xy = targets.collections[0].get_offsets()
    assert sorted(map(tuple, np.asarray(xy).tolist())) == [(0.0, 1.0), (1.0, 1.5), (2.0, 2.0)]
    fig._repr_png_()  # (draws: the transforms below are the drawn ones)
    px, py = targets.transData.transform((1.0, 1.5))
    text = fig.point_at(targets, px + 1, py)
    assert text.startswith("qkvo · ") and "targets q_proj,k_proj,v_proj,o_proj" in text
    assert "schedule cosine" in text and "best eval_loss 1.5" in text
    assert fig.point_at(targets, 0, 0) is None
    par = hparams(str(run.root), kind="parallel")
    assert [t.get_text() for t in par.axes[0].get_xticklabels()] == [
        "lr",
        "targets",
        "schedule",
        "best eval_loss",
    ]


def test_log_lr_ticks_stay_readable_inside_one_decade(tmp_path):
    """An lr searched over less than a decade (3e-4 .. 2e-3): a handful of plain, apart tick labels, not
    a pile of minor ones."""
    from mlora_lab.lab.compare.hparams import hparams

    lrs = {"a": 3e-4, "b": 5e-4, "c": 1e-3, "d": 2e-3}
    run = sweep_run(tmp_path / "r", lrs, dict.fromkeys(lrs, 8), best={t: 1.0 + i for i, t in enumerate(lrs)})
    fig = hparams(str(run.root), params=["lr"])
    fig._repr_png_()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    shown = [
        t
        for t in (*ax.get_xticklabels(), *ax.get_xticklabels(minor=True))
        if t.get_text() and lo <= t.get_position()[0] <= hi
    ]
    assert 2 <= len(shown) <= 8, [t.get_text() for t in shown]
    boxes = sorted((t.get_window_extent().x0, t.get_window_extent().x1) for t in shown)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(boxes)), "tick labels overlap"


def test_summary_puts_what_people_run_it_for_first(tmp_path):
    """A notebook shows the first and last columns of a wide table and hides the middle behind "…": the
    state, steps and losses come before the settings; best_smoothed_loss is the smoothed curve's lowest point."""
    from mlora_lab.lab.compare.results import summary

    run = make_run(tmp_path / "r", tenants=("a",))
    losses = [3.0, 2.0, 0.1, 2.0, 1.8, 1.7]  # one lucky batch at step 3
    write(
        run,
        *[
            TrainRow(
                step=i + 1,
                tenant="a",
                tenant_step=i + 1,
                loss=v,
                tokens=10,
                lr=1e-3,
                grad_norm=1.0,
                time=T0 + i,
            )
            for i, v in enumerate(losses)
        ],
    )
    table = summary(Run(run.root))
    shown = table.to_text(width=100).splitlines()[0]  # (what a narrow terminal shows: the least needed go)
    at = [shown.index(column) for column in ("state", "steps", "final loss", "best loss")]
    assert at == sorted(at) and "held-out loss" not in shown, shown  # (no eval rows: no held-out columns)
    assert (
        " ".join(table.columns[:8])
        == "tenant state steps max_steps final_loss best_smoothed_loss eval_loss best_eval_loss"
    )
    assert table.loc[0, "best_smoothed_loss"] == pytest.approx(plotting.ema(np.array(losses), 0.6).min())
    assert table.loc[0, "best_smoothed_loss"] > 1.0, "one lucky batch does not set it"


def test_the_views_say_which_step_and_what_the_cpu_percent_means(tmp_path):
    run = make_run(tmp_path / "r", state="finished")
    write(
        run,
        *steps(["a", "b"], 1, 4),
        SystemRow(
            step=4,
            rank=0,
            mem_bytes=2**30,
            peak_mem_bytes=2**30,
            step_time=1.0,
            tokens_per_s=10.0,
            cpu_percent=250.0,
            time=T0 + 4,
        ),
    )
    dash = dash_of(run.root)
    assert "· global step 4" in dash.status.value
    assert "one core" in dash.system.util_ax.get_title()
    assert dash.stop_button.description == "run finished" and dash.stop_button.icon == "check"
    assert dash.stop_button.button_style != "danger"


def test_extreme_but_well_typed_rows_break_no_view(tmp_path):
    """time 1e12 (year 33658) and losses of ±1e308 are valid JSON numbers: the tables, the summary and
    every figure on every x axis go on (the time is NaT in tables; a loss is drawn clipped)."""
    from mlora_lab.lab.compare.results import summary

    run = make_run(tmp_path / "r")
    rows = steps(["a", "b"], 1, 6)
    rows += [
        TrainRow(
            step=7, tenant="a", tenant_step=7, loss=1e308, tokens=10, lr=1e-3, grad_norm=1e308, time=1e12
        ),
        TrainRow(
            step=7, tenant="b", tenant_step=7, loss=-1e308, tokens=10, lr=1e-3, grad_norm=1.0, time=T0 + 7
        ),
        HeldoutRow(step=7, tenant="a", loss=1e308, time=T0 + 7),
        SystemRow(
            step=7,
            rank=0,
            mem_bytes=2**62,
            peak_mem_bytes=2**62,
            step_time=1.0,
            tokens_per_s=1e308,
            time=1e12,
        ),
    ]
    write(run, *rows)
    m = Run(run.root).metrics()
    assert len(m) == 15 and pd.isna(m["time"].iloc[12]) and m["time"].iloc[0].year == 2027
    assert len(Run(run.root).system_metrics()) == 1
    table = summary(Run(run.root)).set_index("tenant")
    assert table.loc["a", "final_loss"] == 1e308 and np.isnan(table.loc["a", "time_s"])
    dash = dash_of(run.root)
    for x in ("tenant step", "global step", "tokens", "wall time", "relative time"):
        dash.x_axis.value = x
        for logy in (False, True):
            dash.logy.value = logy  # (a control's change redraws the figures shown)
        dash.export(tmp_path / "exports")  # every figure, as PNG and SVG (log y)
    assert not dash.problem.value
    (ya,) = [ln for k, ln in dash.loss.lines.lines.items() if k == ((run.root.name, "a"), "main")]
    assert np.nanmax(ya.get_ydata()) <= 1e300 and np.isfinite(dash.loss.ax.get_ylim()).all()
    for metric in ("loss", "eval_loss", "grad_norm"):
        ml.compare(Run(run.root), metric=metric, logy=True)._repr_png_()
    ml.runs(tmp_path)


def test_a_million_tenants_do_not_hang_the_view(tmp_path):
    """A metrics file naming very many tenants: the view reads it in seconds, offers, draws and shows
    progress for at most MAX_SERIES of them, and says so."""
    from mlora_lab.lab.dashboard import board

    n = 20_000
    run = make_run(tmp_path / "r", tenants=("a",))
    with open(run.metrics, "w") as f:  # written directly: MetricsWriter would take a while
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "kind": "train",
                        "step": 1,
                        "tenant": f"t{i}",
                        "tenant_step": 1,
                        "loss": 1.0,
                        "tokens": 1,
                        "lr": 1e-3,
                        "grad_norm": 1.0,
                        "time": T0 + 1,
                    }
                )
                + "\n"
            )
    t0 = time.monotonic()
    dash = dash_of(run.root)
    dash.refresh()
    took = time.monotonic() - t0
    assert len(dash.feeds["r"].tenants) == n + 1
    assert len(dash.tenants.options) == board.MAX_SERIES and len(dash.progress.children) == board.MAX_SERIES
    assert f"of {n + 1:,} tenants" in dash.capped.value
    # the first MAX_SERIES offered are job.json's "a" and t0..t98: "a" has logged no step, so no line
    assert len(dash.loss.lines.visible("main")) == board.MAX_SERIES - 1
    assert len(dash.table.rows["r"].cells.value) < 10_000
    assert took < 60, f"{took:.0f} s"


def test_a_huge_note_is_not_shown_whole(tmp_path):
    run = make_run(tmp_path / "runs" / "r")
    note = "x" * (50 * 2**20)
    run.labels.write_text(json.dumps({"tags": ["t"], "note": note}))
    dash = Dashboard(tmp_path / "runs", interactive=False)
    dash.refresh()
    cells = dash.table.rows["r"].cells.value
    assert len(cells) < 20_000 and "52,428,800 characters" in dash.model.runs["r"].labels[1]
    table = ml.runs(tmp_path / "runs")
    assert len(table["note"][0]) < 5_000 and table["tags"][0] == "t"


def test_a_served_runs_open_ended_tenants_show_steps_done_and_its_usage(tmp_path):
    """A Tinker client's tenant has no goal (its ``max_steps`` is the largest count): its row shows the steps
    it took, never ``52/9007199254740991``, no bar that would read as done, and no ETA (nor does the run's
    header); the runs table shows the run's usage (tokens trained and sampled, per key in the tooltip)."""
    from mlora_lab.rundir import UsageRow
    from mlora_lab.spec.fields import MAX_COUNT

    work = tmp_path / "runs"
    run = make_run(work / "served", tenants=("owner-1",), max_steps=MAX_COUNT)
    other = make_run(work / "plain", tenants=("a",), state="finished")
    write(
        run,
        TenantRow(step=0, tenant="owner-1", state="running"),
        *steps(["owner-1"], 1, 52, t0=time.time() - 60),
    )
    write(
        run,
        UsageRow(step=52, key="alice", tenant="owner-1", tokens_trained=1200, tokens_forward=0,
                 tokens_sampled=0, busy_s=3.5, requests=104),
        UsageRow(step=52, key="bob", tenant=None, tokens_trained=0, tokens_forward=0, tokens_sampled=34_000,
                 busy_s=1.25, requests=7),
    )  # fmt: skip
    write(other, *steps(["a"], 1, 3))
    dash = Dashboard(work, interactive=False)
    dash.refresh()
    info = dash.progress_rows[("served", "owner-1")]
    assert "52 steps" in info.info.value and str(MAX_COUNT) not in info.info.value
    assert "ETA" not in info.info.value and info.bar.layout.visibility == "hidden"
    assert "ETA" not in dash.status.value
    cells = dash.table.rows["served"].cells.value
    assert "1.2k trained · 34.0k sampled" in cells and "bob: 0 trained, 34,000 sampled" in cells
    assert "–" in dash.table.rows["plain"].cells.value
    table = ml.runs(work).set_index("run")
    assert table.loc["served", ["tokens_trained", "tokens_sampled", "busy_s"]].tolist() == [
        1200,
        34_000,
        4.75,
    ]
    assert table.loc["plain", ["tokens_trained"]].isna().all()


def test_m12_a_tinker_clients_loss_reads_as_a_sum_with_its_mean_a_token_beside_it(tmp_path):
    """m12: a Tinker client's train rows hold its ``loss:sum`` (281.2 for a batch of a few hundred tokens), which
    read as divergence next to the other tenants' means: its progress row names it a sum and shows the mean a
    token beside it (none for a loss that has no such mean); the other tenants' rows read as before."""
    run = make_run(tmp_path / "served", tenants=("owner-1", "owner-2", "a"))
    write(
        run,
        *steps(["owner-1"], 1, 2, loss=lambda s, i: 281.2, loss_reduction="sum", loss_per_token=0.5274),
        *steps(["owner-2"], 1, 2, loss=lambda s, i: -0.03, loss_reduction="sum"),
        *steps(["a"], 1, 2, loss=lambda s, i: 0.61),
    )
    dash = dash_of(run.root)
    assert "loss:sum 281.2 (0.5274 a token)" in dash.progress_rows[("served", "owner-1")].info.value
    rl = dash.progress_rows[("served", "owner-2")].info.value
    assert "loss:sum -0.03" in rl and "a token" not in rl
    plain = dash.progress_rows[("served", "a")].info.value
    assert "loss 0.6100" in plain and "loss:sum" not in plain


def test_the_metrics_csv_export_is_spreadsheet_safe(tmp_path):
    """EV12c, the dashboard's side: its metrics CSV (tenant rows carry free text: a quarantine reason) is
    written as the eval table's is: a text cell that would start a formula gets a leading ``'``, numbers stay
    numbers, a lone carriage return stays inside its cell."""
    import csv

    import pandas as pd

    from mlora_lab.lab.dashboard.outputs import export_files

    frame = pd.DataFrame(
        {
            "tenant": ["a", "b"],
            "loss": [-0.5, 1.25],
            "reason": ['=HYPERLINK("http://x","y")', "line\rbreak"],
            "=SUM(A1)": ["@cmd", "-2.5"],
        }
    )
    (path,) = export_files(tmp_path / "exports", [], frame)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["tenant", "loss", "reason", "'=SUM(A1)"]
    assert rows[1] == ["a", "-0.5", '\'=HYPERLINK("http://x","y")', "'@cmd"]
    assert rows[2] == ["b", "1.25", "line\rbreak", "-2.5"]
