"""Comparing tenants and runs: the runs table, summary tables, overlay plots, and side-by-side generations.

All of it reads run directories only (metrics.jsonl, job.json, adapters/); generations load the
saved PEFT adapters into one multi-tenant model and decode every adapter's completions in one batch
(the one thing here that needs torch: it is imported then).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from mlora_lab.lab.handles import attach
from mlora_lab.lab.plotting import (
    DISPLAY_DPI,
    DRAWING,
    EXPORT_DPI,
    LINESTYLES,
    best_smoothed,
    category_label,
    cut_note,
    drawable,
    ema,
    figure_png,
    marker_for,
    placeholder,
    plain,
    robust_ylim,
    run_name,
    run_titles,
    series_label,
    set_categories,
    set_log_x,
    set_log_y,
    set_x_axis,
    shorten,
    style_axes,
    thin_with_breaks,
)
from mlora_lab.lab.run import DEFAULT_WORKDIR, Run
from mlora_lab.lab.series import METRICS, RL_METRICS, X_AXES, RunSeries, to_datetimes
from mlora_lab.lab.trials import results
from mlora_lab.rundir import (
    RowKind,
    RunDirError,
    TenantRow,
    TrainRow,
    read_labels,
    read_status,
    shown_tenant_state,
)
from mlora_lab.spec import Tenant
from mlora_lab.specbase import SpecError

SUMMARY_COLUMNS = [
    "tenant",
    "state",
    "steps",
    "max_steps",
    "final_loss",
    "best_loss",
    "eval_loss",
    "best_eval_loss",
    "reward",
    "first_loss",
    "lr",
    "rank",
    "alpha",
    "schedule",
    "warmup",
    "dropout",
    "batch_size",
    "grad_accum",
    "targets",
    "rows",
    "tokens",
    "time_s",
    "reason",
]
"""What people run :func:`summary` for comes first (a notebook shows the first and last ten columns of a
wide table and hides the middle behind "…"): state, steps, losses; then the settings."""
SETTINGS = (
    "rank",
    "alpha",
    "targets",
    "lr",
    "schedule",
    "warmup",
    "dropout",
    "batch_size",
    "grad_accum",
    "max_steps",
)
BROKEN = "broken"
"""The state :func:`runs` lists a run in whose files cannot be read (no run is ever in it)."""

RunLike = Run | str | Path

RUNS_COLUMNS = [
    "run",
    "name",
    "state",
    "tenants",
    "global_step",
    "best_loss",
    "tags",
    "note",
    "started",
    "path",
    "problem",
]


def runs(workdir: str | Path = DEFAULT_WORKDIR) -> pd.DataFrame:
    """One row per run directory under ``workdir``: ``run`` (its directory's name), ``name`` (the job's
    ``JobSpec.name``), state, tenants (comma-joined names), ``global_step`` (the job's step: one per
    batch, whichever tenants took part), ``best_loss`` (the lowest smoothed train loss of any tenant:
    the EMA the dashboard draws, factor :data:`~mlora_lab.lab.plotting.SMOOTHING`, so one lucky batch
    cannot set it; None before the first step), ``tags`` (comma-joined, in the order they were added:
    ``table[table.tags.str.contains("baseline")]``), ``note`` (cut past
    :data:`~mlora_lab.lab.plotting.NOTE_CHARS` characters) and start time. A run whose files cannot be
    read is listed as ``broken`` (its ``state``), with the reason in ``problem``; unreadable labels leave
    its tags and note empty and say why in ``problem``."""
    rows = []
    for job in sorted(Path(workdir).glob("*/job.json")):
        row = {"run": job.parent.name, "path": str(job.parent), "problem": None}
        try:
            run = Run(job.parent)
            status = read_status(job.parent)
            metrics = run.typed_rows()
            losses: dict[str, list[float]] = {}
            for r in metrics:
                if isinstance(r, TrainRow) and r.loss is not None:
                    losses.setdefault(r.tenant, []).append(r.loss)
            best = [b for v in losses.values() if (b := best_smoothed(np.array(v))) is not None]
            row |= {
                "name": run.spec.name,
                "state": run.status.value,
                "tenants": ", ".join(t.name for t in run.spec.tenants),
                "global_step": max((r.step for r in metrics), default=0),
                "best_loss": min(best, default=None),
                "started": to_datetimes(status.started if status else None),
            }
        except (RunDirError, SpecError, OSError) as e:
            row |= {
                "state": BROKEN,
                "tenants": None,
                "global_step": None,
                "started": pd.NaT,
                "problem": str(e),
            }
        try:
            labels = read_labels(job.parent)
            row |= {"tags": ", ".join(labels.tags), "note": cut_note(labels.note)}
        except RunDirError as e:
            row["problem"] = "; ".join(p for p in (row["problem"], str(e)) if p)
        rows.append(row)
    return pd.DataFrame(rows, columns=RUNS_COLUMNS)


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


def _as_runs(runs: RunLike | Sequence[RunLike]) -> list[Run]:
    if isinstance(runs, (Run, str, Path)):
        runs = [runs]
    return [r if isinstance(r, Run) else attach(r) for r in runs]


def summary(runs: RunLike | Sequence[RunLike]) -> pd.DataFrame:
    """One row per tenant (per run; a ``run`` column first when there are several), settings next to
    results:

    - ``state``: the tenant's state now (``pending``, ``running``, ``paused``, ``finished``,
      ``removed``, ``failed``, ``refused``; a tenant the job was still training when the run stopped,
      failed or was lost shows the run's state) and ``reason`` (why it failed or was refused);
    - its results first (a notebook hides the middle columns of a wide table): ``steps`` (the tenant's
      own optimiser steps) of ``max_steps``, ``final_loss`` (its last logged train loss), ``best_loss``
      (the lowest point of its smoothed train loss: the EMA the dashboard draws, factor
      :data:`~mlora_lab.lab.plotting.SMOOTHING`; one lucky batch cannot set it), ``eval_loss`` (the last)
      and ``best_eval_loss``, ``reward`` (an RL tenant's latest logged mean reward; NaN for an SFT
      tenant), ``first_loss``;
    - its settings: ``lr``, ``rank``, ``alpha``, ``schedule``, ``warmup`` (steps), ``dropout``,
      ``batch_size``, ``grad_accum``, ``targets`` (target modules, then target parameters, comma-joined);
    - ``rows`` of its data and target ``tokens`` trained on, ``time_s`` from its first to its last logged
      step, and ``reason``.

    Tenants added while the job ran are included, also those the job refused or has not added yet
    (their settings are those their ``add`` message sent). ``rows`` is None for runs written before
    rows were counted."""
    runs = _as_runs(runs)
    out = []
    for run in runs:
        run_state = run.status
        last: dict[str, TenantRow] = {}  # each tenant's latest tenant row
        for r in run.typed_rows():
            if isinstance(r, TenantRow):
                last[r.tenant] = r
        df = run.metrics()
        for name, t in run.tenant_specs().items():
            train = df[(df["kind"] == RowKind.TRAIN) & (df["tenant"] == name)] if len(df) else df
            evals = df[(df["kind"] == RowKind.EVAL) & (df["tenant"] == name)] if len(df) else df
            row = last.get(name)
            # cumulative since train rows carry it (exact also with log_every > 1); older runs: the sum
            tokens = _last_count(train, "tokens_seen")
            if tokens is None:
                tokens = int(train["tokens"].sum()) if len(train) else 0
            out.append(
                {
                    "run": run.path.name,
                    "tenant": name,
                    "state": shown_tenant_state(row.state if row else None, run_state),
                    **_settings(t),
                    "steps": int(train["tenant_step"].max()) if len(train) else 0,
                    "first_loss": train["loss"].iloc[0] if len(train) else None,
                    "final_loss": train["loss"].iloc[-1] if len(train) else None,
                    "best_loss": best_smoothed(train["loss"].to_numpy(dtype=float)) if len(train) else None,
                    "eval_loss": evals["loss"].iloc[-1] if len(evals) else None,
                    "best_eval_loss": evals["loss"].min() if len(evals) else None,
                    "reward": _last_value(train, "reward"),
                    "rows": _last_count(train, "rows_seen"),
                    "tokens": tokens,
                    "time_s": _seconds(train["time"]),
                    "reason": row.reason if row else None,
                }
            )
    columns = (["run"] if len(runs) > 1 else []) + SUMMARY_COLUMNS
    return pd.DataFrame(out)[columns] if out else pd.DataFrame(columns=columns)


def _seconds(times: pd.Series) -> float:
    """Seconds from the first to the last of ``times`` (NaN when a time could not be read)."""
    if not len(times):
        return 0.0
    span = times.iloc[-1] - times.iloc[0]
    return float("nan") if pd.isna(span) else span.total_seconds()


def _title(run: Run) -> str:
    """A run's name (``JobSpec.name``; its directory's when job.json cannot be read)."""
    try:
        return run.spec.name or run.path.name
    except SpecError:
        return run.path.name


def _settings(t: Tenant | None) -> dict:
    """A tenant's settings for :func:`summary` (all None when its configuration is not on record)."""
    if t is None:
        return dict.fromkeys(SETTINGS)
    return {
        "rank": t.rank,
        "alpha": t.alpha,
        "targets": ",".join([*t.target_modules, *t.target_parameters]),
        "lr": t.lr,
        "schedule": t.schedule,
        "warmup": t.warmup_steps,
        "dropout": t.dropout,
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "max_steps": t.max_steps,
    }


def _last_count(train: pd.DataFrame, column: str) -> int | None:
    """The latest value of a cumulative count column (None when no row carries it)."""
    if column not in train:
        return None
    values = train[column].dropna()
    return int(values.iloc[-1]) if len(values) else None


def _last_value(train: pd.DataFrame, column: str) -> float:
    """The latest finite value of a column; NaN when no row has one (an SFT tenant's ``reward``: NaN, not
    None, so that the column is a float column in every table, even one of SFT tenants only)."""
    values = pd.to_numeric(train[column], errors="coerce").dropna() if column in train else ()
    return float(values.iloc[-1]) if len(values) else float("nan")


COMPARE_POINTS = 4000
"""Points per line in a comparison figure: longer series are thinned, keeping each bucket's min and max."""


def compare(
    runs: RunLike | Sequence[RunLike],
    metric: str = "loss",
    tenants: Sequence[str] | None = None,
    smoothing: float = 0.0,
    logy: bool = False,
    figsize: tuple[float, float] = (8, 4.5),
    x: str = "tenant step",
    ignore_outliers: bool = False,
) -> Figure:
    """Overlay ``metric`` of tenants across runs.

    ``metric`` is one of ``loss``, ``eval_loss``, ``lr``, ``grad_norm``, ``tokens``, or what RL tenants
    log (:data:`~mlora_lab.lab.series.RL_METRICS`: ``reward``, ``reward_std``, ``completion_len``, ``kl``,
    ``clip_ratio``; SFT tenants have none and are not drawn for them); ``x`` one of
    ``tenant step`` (default), ``global step``, ``tokens`` (the tenant's target tokens seen so far),
    ``wall time``, ``relative time`` (seconds since the run's first row); ``tenants`` limits the
    tenants drawn (default: all). Each (run, tenant) has its own colour, the same as in the dashboard
    and in every other figure (:class:`mlora_lab.lab.plotting.Colours`), and each run its own line style.
    ``smoothing`` is an EMA factor in [0, 1): the smoothed line is drawn over the raw values, which stay
    visible, faded. ``logy`` uses a log y axis with readable ticks on any range; ``ignore_outliers``
    sets the y-limits from the 1st-99th percentile of the values. Lines are broken where a run was
    stopped and resumed (on time axes), and a series of a few points has markers.

    A run with no value of ``metric`` for the tenants asked (no eval rows for ``eval_loss``, say) is
    left out with a warning naming it; an RL metric that no run has at all (no RL tenant) is a
    ``ValueError`` naming the metrics they have.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
    if x not in X_AXES:
        raise ValueError(f"unknown x axis {x!r}; choose from {', '.join(X_AXES)}")
    runs = _as_runs(runs)
    fig = LabFigure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    missing = _overlay(ax, runs, metric, tenants, smoothing, x)
    if missing:
        which = f" of tenants {list(tenants)}" if tenants is not None else ""
        warnings.warn(
            f"compare: no {metric!r} values{which} in run(s) {', '.join(missing)}; they are not in the figure",
            stacklevel=2,
        )
    taken: dict[str, Path] = {}
    titles = run_titles([(_title(r), run_name(r.path, taken)) for r in runs])
    names = ", ".join(shorten(name, 40) for name in titles)
    style_axes(ax, ylabel=metric, title=plain(shorten(f"{metric}: {names}", 120)), size=9)
    _finish(ax, logy, ignore_outliers, f"no {metric!r} values to draw")
    return fig


def _overlay(
    ax: Axes,
    runs: Sequence[Run],
    metric: str,
    tenants: Sequence[str] | None,
    smoothing: float,
    x: str,
    with_eval: bool = False,
) -> list[str]:
    """Draw ``metric`` of every (run, tenant) on ``ax`` (and, ``with_eval``, the eval loss as dots);
    returns the names of the runs that had no value to draw. Colours are the tenants' own
    (:meth:`~mlora_lab.lab.series.RunSeries.colour`), each run has its line style, labels are
    ``run / tenant`` with the run's title (:func:`~mlora_lab.lab.plotting.run_titles`)."""
    taken: dict[str, Path] = {}
    feeds = [RunSeries(run.dir, run_name(run.path, taken)) for run in runs]
    for feed in feeds:
        feed.poll()
    if metric in RL_METRICS and not any(feed.has(metric) for feed in feeds):
        # one error rather than a warning per run and an empty figure: nothing could be drawn
        have = [m for m in METRICS if any(m in feed.metric_names() for feed in feeds)]
        raise ValueError(
            f"no {metric!r} values in these runs (only RL tenants, Tenant.rl, log {', '.join(RL_METRICS)}; "
            f"kl only with beta > 0); choose from {have}"
        )
    titles = run_titles([(feed.title, feed.name) for feed in feeds])
    set_x_axis(ax, x)
    missing = []
    for i, (feed, title) in enumerate(zip(feeds, titles)):
        style = LINESTYLES[i % len(LINESTYLES)]
        drew = False
        for name in feed.tenants:
            if tenants is not None and name not in tenants:
                continue
            xs, ys, breaks = feed.xy(name, metric, x)
            ys = drawable(ys)
            if not np.isfinite(ys).any():
                continue
            drew = True
            colour = feed.colour(name)
            label = series_label(None if len(feeds) == 1 else title, name)
            is_eval = metric == "eval_loss"
            marker = "o" if is_eval else marker_for(len(xs))
            if smoothing > 0 and len(xs) > 1:  # the raw values stay visible under the smoothed line
                (raw,) = ax.plot(
                    *thin_with_breaks(xs, ys, breaks, COMPARE_POINTS),
                    linestyle=style,
                    color=colour,
                    alpha=0.25,
                    linewidth=0.8,
                    label="_raw",
                )
                raw.lab_role = "raw"
            (line,) = ax.plot(
                *thin_with_breaks(xs, drawable(ema(ys, smoothing)), breaks, COMPARE_POINTS),
                linestyle=style,
                marker=marker,
                markersize=3,
                color=colour,
                linewidth=1.4,
                label=plain(label),
            )
            line.lab_role = "main"
            if with_eval:
                ex, ey, ebreaks = feed.xy(name, "eval_loss", x)
                if len(ex):
                    (dots,) = ax.plot(
                        *thin_with_breaks(ex, drawable(ey), ebreaks, COMPARE_POINTS),
                        "o",
                        color=colour,
                        markersize=4,
                        label="_eval",
                    )
                    dots.lab_role = "eval"
        if not drew:
            missing.append(feed.name)
    return missing


def _finish(ax: Axes, logy: bool, ignore_outliers: bool, empty: str) -> None:
    """Scale, limits, legend, and a note instead of empty ticks when nothing was drawn."""
    set_log_y(ax, logy)
    mains = [line for line in ax.lines if getattr(line, "lab_role", None) == "main"]
    if not mains:
        placeholder(ax, empty)
        return
    if ignore_outliers:
        lim = robust_ylim([line.get_ydata() for line in ax.lines], log=logy)
        if lim is not None:
            ax.set_ylim(lim)
    ax.legend(handles=mains, fontsize=8, ncol=1 + len(mains) // 12)


def plot_losses(run: RunLike, path: str | Path | None = None, smoothing: float = 0.0) -> Figure:
    """Train loss (lines) and eval loss (dots) of every tenant of a run, against the tenant step;
    saved to ``path`` if given (the format from its suffix: ``.png`` at twice the display resolution,
    ``.svg``, ``.pdf``)."""
    (run,) = _as_runs(run)
    fig = LabFigure(figsize=(8, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _overlay(ax, [run], "loss", None, smoothing, "tenant step", with_eval=True)
    style_axes(ax, ylabel="loss (lines: train, dots: eval)", title=plain(shorten(_title(run), 80)), size=9)
    _finish(ax, False, False, "no steps logged yet")
    if path is not None:
        with DRAWING:
            fig.savefig(path, dpi=EXPORT_DPI)
    return fig


HPARAMS = (
    "lr",
    "rank",
    "alpha",
    "dropout",
    "warmup",
    "batch_size",
    "grad_accum",
    "max_steps",
    "targets",
    "schedule",
)
"""Settings :func:`hparams` can put on an axis (the ``summary()`` columns of the same names); a sweep's
searched settings can be named too."""
LOG_HPARAMS = frozenset({"lr"})
"""Settings searched on a log scale: their axes are logarithmic."""
SUMMARY_OF_FIELD = {"target_modules": "targets", "warmup_steps": "warmup"}
"""A Tenant field's column in :func:`summary` where the names differ."""


class HParamsFigure(LabFigure):
    """:func:`hparams`' figure: a PNG wherever it is shown, and shown live (ipympl) a readout under it that
    names the point under the cursor (run / tenant, its settings, its metric)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.points: list[tuple[Axes, np.ndarray, list[str]]] = []
        """Per axes, its points in data coordinates (``[n, 2]``) and what each one is."""

    def point_at(self, ax: Axes, x_px: float, y_px: float, radius_px: float = 12.0) -> str | None:
        """What the point nearest display position ``(x_px, y_px)`` in ``ax`` is (None: none within
        ``radius_px``)."""
        best = None
        for owner, xy, texts in self.points:
            if owner is not ax or not len(xy):
                continue
            ok = np.isfinite(xy).all(axis=1)
            if not ok.any():
                continue
            d = np.hypot(*(ax.transData.transform(xy[ok]) - (x_px, y_px)).T)
            i = int(d.argmin())
            if d[i] <= radius_px and (best is None or d[i] < best[0]):
                best = (d[i], np.flatnonzero(ok)[i], texts)
        return None if best is None else best[2][best[1]]

    def _ipython_display_(self) -> None:
        import base64

        from IPython.display import display

        png, size = self._repr_png_()
        data = {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(self)}
        try:
            import ipympl.backend_nbagg  # noqa: F401
            import ipywidgets as W

            from mlora_lab.lab.dashboard.figures import interactive_canvas
        except ImportError:
            display(data, raw=True, metadata={"image/png": size})
            return
        import html

        canvas = interactive_canvas(self, DRAWING)
        readout = W.HTML(layout=W.Layout(min_height="1.4em"))

        def on_motion(event: Any) -> None:
            text = self.point_at(event.inaxes, event.x, event.y) if event.inaxes is not None else None
            readout.value = html.escape(text or "")

        canvas.mpl_connect("motion_notify_event", on_motion)
        canvas.draw()
        box = W.VBox([canvas, readout])
        data |= box._repr_mimebundle_() or {}
        display(data, raw=True, metadata={"image/png": size})


def _hparams_table(runs: Sequence[Run]) -> tuple[pd.DataFrame, list[str]]:
    """:func:`summary` of ``runs`` (with a ``run`` column), each trial of a sweep with the settings it
    was given (from the sweep's record: its tenant may not be in job.json), and the names of the
    settings the sweeps searched."""
    table = summary(runs)
    if "run" not in table:
        table.insert(0, "run", runs[0].path.name if runs else "")
    searched: list[str] = []
    for run in runs:
        if not run.dir.sweep.is_file():
            continue
        try:
            trials = results(run.dir)
        except RunDirError:
            continue
        config = [c for c in trials.columns if c not in TRIAL_COLUMNS]
        for key in config:
            column = SUMMARY_OF_FIELD.get(key, key)
            searched.append(column)
            if column not in table:
                table[column] = None
            table[column] = table[column].astype(object)
            values = trials[key]
            if column == "targets":  # (the summary's spelling: "q_proj,v_proj")
                values = values.map(lambda v: v.replace(", ", ",") if isinstance(v, str) else v)
            by_tenant = dict(zip(trials["tenant"], values))
            mine = (table["run"] == run.path.name) & table["tenant"].isin(by_tenant)
            table.loc[mine, column] = table.loc[mine, "tenant"].map(by_tenant)
    return table, list(dict.fromkeys(searched))


TRIAL_COLUMNS = frozenset(
    {"trial", "tenant", "state", "steps", "rung", "objective", "best", "parent", "reason", "adapter"}
)
"""The columns of a sweep's results that are not a searched setting."""


def _is_number(column: pd.Series) -> bool:
    values = column.dropna()
    return bool(len(values)) and all(isinstance(v, int | float | np.integer | np.floating) for v in values)


def hparams(
    runs: RunLike | Sequence[RunLike],
    metric: str = "eval_loss",
    params: Sequence[str] | None = None,
    kind: str = "scatter",
    figsize: tuple[float, float] | None = None,
) -> Figure:
    """Hyperparameters next to results, for sweeps: every tenant of ``runs`` as one point (``kind=
    "scatter"``: one panel per setting, the setting on x and the tenant's best ``metric`` on y) or one
    line (``kind="parallel"``: parallel coordinates, an axis per setting and a last one for the metric,
    lines coloured by the metric, best darkest).

    ``metric`` is ``eval_loss`` (the lowest eval loss the tenant reached) or ``loss`` (the lowest point
    of its smoothed train loss); tenants without it are left out, with a warning naming them.
    ``params`` are ``summary()`` columns from :data:`HPARAMS` or settings a sweep searched; by default
    every one that differs between the tenants shown (a setting all tenants share explains nothing).
    Numbers are drawn on their value (``lr`` on a log axis), other settings (``targets``, ``schedule``)
    as categories. A sweep's trials carry the settings they were given. Colours are the tenants'
    colours of every other figure (:func:`mlora_lab.lab.plotting.series_colour`). Shown live (ipympl),
    the point under the cursor is named under the figure: run / tenant, its settings and its metric
    (``fig.point_at(ax, x, y)`` gives the same text).
    """
    if kind not in ("scatter", "parallel"):
        raise ValueError(f"kind must be 'scatter' or 'parallel', got {kind!r}")
    column = {"eval_loss": "best_eval_loss", "loss": "best_loss"}.get(metric)
    if column is None:
        raise ValueError(f"metric must be 'eval_loss' or 'loss', got {metric!r}")
    runs = _as_runs(runs)
    table, searched = _hparams_table(runs)
    known = list(dict.fromkeys([*HPARAMS, *searched]))
    unknown = [p for p in params or () if p not in known]
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}"
        )
    missing = table[table[column].isna()]
    if len(missing):
        warnings.warn(
            f"hparams: no {metric} for "
            + ", ".join(f"{r.run}/{r.tenant}" for r in missing.itertuples())
            + (" (give the tenants eval_data, and eval_every in the job)" if metric == "eval_loss" else ""),
            stacklevel=2,
        )
    table = table[table[column].notna()].reset_index(drop=True)
    if params is None:
        params = [p for p in known if p in table and table[p].dropna().astype(str).nunique() > 1]
    params = list(params)
    fig = HParamsFigure(
        figsize=figsize or ((4 + 2.6 * max(1, len(params)), 3.6) if kind == "scatter" else (9, 4))
    )
    if not len(table) or not params:
        ax = fig.add_subplot(1, 1, 1)
        why = f"no tenant has {metric}" if not len(table) else "every tenant has the same settings"
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666")
        ax.set_axis_off()
        return fig
    feeds = {run.path.name: RunSeries(run.dir) for run in runs}
    titles = dict(zip(feeds, run_titles([(f.title, name) for name, f in feeds.items()])))
    colours = [feeds[r.run].colour(r.tenant) for r in table.itertuples()]
    names = [series_label(titles[r.run] if len(runs) > 1 else None, r.tenant) for r in table.itertuples()]
    y = drawable(table[column].to_numpy(dtype=float))
    texts = [
        f"{name} · "
        + " · ".join(f"{p} {_shown(v)}" for p in params if not pd.isna(v := table.at[i, p]))
        + f" · best {metric} {y[i]:.4g}"
        for i, name in enumerate(names)
    ]
    numeric = {p: _is_number(table[p]) for p in params}
    categories = {p: sorted({str(v) for v in table[p].dropna()}) for p in params if not numeric[p]}

    def position(p: str) -> np.ndarray:
        if numeric[p]:
            return drawable(pd.to_numeric(table[p], errors="coerce").to_numpy(dtype=float))
        index = {c: i for i, c in enumerate(categories[p])}
        return np.array([index.get(str(v), np.nan) if not pd.isna(v) else np.nan for v in table[p]], float)

    best = int(np.nanargmin(y))
    if kind == "scatter":
        axes = fig.subplots(1, len(params), sharey=True, squeeze=False)[0]
        for ax, p in zip(axes, params):
            x = position(p)
            ax.scatter(x, y, c=colours, s=36, edgecolors="white", linewidths=0.5, zorder=3)
            ax.scatter(
                [x[best]], [y[best]], s=140, facecolors="none", edgecolors="#222", linewidths=1.2, zorder=4
            )
            fig.points.append((ax, np.column_stack([x, y]), texts))
            if p in LOG_HPARAMS and numeric[p]:
                set_log_x(ax)
            if not numeric[p]:
                set_categories(ax, categories[p])
            style_axes(ax, xlabel=plain(p), ylabel=f"best {metric}" if ax is axes[0] else None)
        axes[0].annotate(
            f"best: {plain(names[best])}",
            xy=(0.02, 0.98),
            xycoords="axes fraction",
            va="top",
            fontsize=8,
            color="#222",
        )
    else:
        import matplotlib as mpl

        ax = fig.add_subplot(1, 1, 1)
        axis_names = [*params, f"best {metric}"]
        raw = [position(p) for p in params] + [y]
        scaled = []
        for name, v in zip(axis_names, raw):
            if name in categories:
                k = len(categories[name])
                scaled.append(v / (k - 1) if k > 1 else np.full_like(v, 0.5))
                continue
            v = np.log10(v) if name in LOG_HPARAMS else v
            lo, hi = np.nanmin(v), np.nanmax(v)
            scaled.append((v - lo) / (hi - lo) if hi > lo else np.full_like(v, 0.5))
        cmap = mpl.colormaps["viridis_r"]
        lo, hi = np.nanmin(y), np.nanmax(y)
        norm = mpl.colors.Normalize(lo, hi if hi > lo else lo + 1)
        xs = np.arange(len(axis_names))
        order = np.argsort(-y)  # the best last, drawn on top
        for i in order:
            ax.plot(xs, [s[i] for s in scaled], color=cmap(norm(y[i])), linewidth=1.6, alpha=0.9)
        fig.points.append((ax, np.column_stack([np.full(len(y), xs[-1]), scaled[-1]]), texts))
        for j, (name, v) in enumerate(zip(axis_names, raw)):
            ax.axvline(j, color="#999", linewidth=0.8)
            if name in categories:
                k = len(categories[name])
                for c, label in enumerate(categories[name]):
                    at = c / (k - 1) if k > 1 else 0.5
                    ax.text(j + 0.03, at, category_label(label), va="center", fontsize=7, color="#555")
                continue
            lo_v, hi_v = np.nanmin(v), np.nanmax(v)
            ax.text(j, -0.06, f"{lo_v:.3g}", ha="center", va="top", fontsize=7, color="#555")
            ax.text(j, 1.06, f"{hi_v:.3g}", ha="center", va="bottom", fontsize=7, color="#555")
        ax.set_xticks(xs, [plain(n) for n in axis_names], fontsize=8)
        ax.set_yticks([])
        ax.set_ylim(-0.15, 1.15)
        ax.set_xlim(-0.3, len(axis_names) - 0.7)
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"best {metric}", pad=0.02)
    fig.suptitle(f"hyperparameters → best {metric} ({len(table)} tenants)", fontsize=10)
    return fig  # LabFigure's constrained layout places the panels, the colorbar and the title


def _shown(v: Any) -> str:
    """A setting's value in a readout."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


Prompt = str | Sequence[Mapping[str, str]]
"""A prompt for :func:`compare_generations`: plain text, or a chat as ``[{"role": ..., "content": ...}, ...]``."""


def compare_generations(
    run: RunLike,
    prompts: Sequence[Prompt],
    tenants: Sequence[str] | None = None,
    max_new_tokens: int = 24,
    include_base: bool = True,
    chat: bool | None = None,
) -> pd.DataFrame:
    """Greedy completions of the same prompts by each saved adapter (and the base), in ONE
    mixed-tenant batch: a row per prompt, a column per adapter.

    Each tenant is fed the prompts the way it was trained (the rendering code is the training data's
    own, :mod:`mlora_lab.data`):

    - a prompt given as a message list (``[{"role": "user", "content": "..."}, ...]``) is rendered
      with the tokenizer's chat template plus the assistant's generation prompt
      (``add_generation_prompt=True``), as a ``messages`` training row is, for every column;
    - a plain string is rendered that way for a **chat tenant**, as ``[{"role": "user", "content":
      prompt}]``, and otherwise fed as it is (tokenized with the tokenizer's BOS, as a ``prompt`` row).
      ``chat=None`` (the default) decides per tenant from its training data: a chat tenant is one
      whose ``data`` file holds only ``messages`` rows (a file that also has ``text`` or
      ``prompt``/``completion`` rows taught plain prompts too; a file that can no longer be read
      counts as plain, with a warning). ``chat=True`` / ``chat=False`` decides for every tenant;
    - the base is fed as the tenants are: if some tenants are chat tenants and others not, there are
      two base columns, ``base`` (plain) and ``base (chat)``.

    Rendering a chat needs the tokenizer's chat template; without one this raises ``ValueError``
    saying so (pass ``chat=False`` to feed plain strings as they are). The exact texts fed are in
    ``result.attrs["inputs"]`` (``{column: [text per prompt]}``) and the rendering used per column in
    ``result.attrs["chat"]``.
    """
    import torch
    import transformers

    from mlora_lab import data
    from mlora_lab.bases import no_progress_bars, resolve_base
    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.spec import effective_slot_modules

    if isinstance(prompts, str) or not prompts:
        raise ValueError(
            "compare_generations: prompts must be a non-empty list (of strings or message lists)"
        )
    (run,) = _as_runs(run)
    spec = run.spec
    picked = [t for t in spec.tenants if tenants is None or t.name in tenants]
    names = [t.name for t in picked]
    base_path = str(resolve_base(spec.base_model))  # a GGUF base: its converted copy
    tok_path = spec.tokenizer or base_path
    tok = transformers.AutoTokenizer.from_pretrained(tok_path)
    tok.padding_side = "left"  # generation appends on the right
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def trained_on_chat(t) -> bool:
        report = data.scan_source(t.data)
        if not report.kinds:
            warnings.warn(
                f"compare_generations: cannot tell how tenant {t.name!r} was trained ({'; '.join(report.problems[:1])}); "
                "feeding plain prompts as they are (pass chat=True for chat rendering)",
                stacklevel=3,
            )
        return report.kinds == {"messages"}

    modes: dict[str, bool] = {}
    for t in picked:
        modes[t.name] = trained_on_chat(t) if chat is None else bool(chat)
    columns: list[tuple[str, str | None, bool]] = []  # (column, tenant or None = base, chat rendering)
    if include_base:
        used = sorted(set(modes.values())) or [bool(chat)]
        columns += [("base (chat)" if m and len(used) > 1 else "base", None, m) for m in used]
    columns += [(n, n, modes[n]) for n in names]

    if not getattr(tok, "chat_template", None):
        chatty = [t for _, t, m in columns if m and t is not None]
        if chat or chatty or any(_as_messages(p) is not None for p in prompts):
            if chat:
                why = "chat=True renders every prompt with the chat template"
            elif chatty:
                why = (
                    f"tenant(s) {', '.join(map(repr, chatty))} were trained on 'messages' rows, so prompts "
                    "are rendered for them with the chat template"
                )
            else:
                why = "prompts given as messages are rendered with the chat template"
            raise ValueError(
                f"compare_generations: {why}, but the tokenizer at {tok_path} has no chat template; "
                "give plain-string prompts with chat=False to feed them as they are"
            )

    def fed_as(prompt: Prompt, as_chat: bool) -> tuple[str, bool]:
        """``(text, add_special_tokens)``: how training would tokenize this prompt for a column."""
        messages = _as_messages(prompt)
        if messages is None and not as_chat:
            return prompt, True  # a prompt/completion row's prompt: with the tokenizer's BOS
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        return data.render_chat(
            tok, messages, add_generation_prompt=True
        ), False  # the template adds BOS itself

    fed = {c: [fed_as(p, m) for p in prompts] for c, _, m in columns}
    rows = [data.encode(tok, text, special) for c, _, _ in columns for text, special in fed[c]]
    width = max((len(r) for r in rows), default=0)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1

    with no_progress_bars():  # a widget per load in a notebook: noise for a load done on the user's behalf
        base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    # The job's own slots: they cover every adapter it saved (one may target the output layer).
    mm = MultiLoRAModel(
        base,
        max_tenants=max(1, len(names)),
        max_rank=spec.max_rank,
        slot_modules=effective_slot_modules(spec),
    )
    for name in names:
        mm.load_adapter(name, run.adapter_path(name))
    mm.eval()
    rows_tenants = [t for _, t, _ in columns for _ in prompts]  # column-major: contiguous segments
    with torch.no_grad():
        out = mm.generate(
            input_ids,
            tenants=rows_tenants,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    table = {"prompt": list(prompts)}
    for j, (c, _, _) in enumerate(columns):
        table[c] = texts[j * len(prompts) : (j + 1) * len(prompts)]
    result = pd.DataFrame(table)
    result.attrs["inputs"] = {c: [text for text, _ in fed[c]] for c, _, _ in columns}
    result.attrs["chat"] = {c: m for c, _, m in columns}
    return result


def _as_messages(prompt: Prompt) -> list[dict[str, str]] | None:
    """A chat prompt as a list of ``{"role", "content"}`` dicts; ``None`` for a plain string."""
    if isinstance(prompt, str):
        return None
    ok = isinstance(prompt, Sequence) and len(prompt) > 0
    ok = ok and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )
    if not ok:
        raise ValueError(
            "compare_generations: a prompt is a string or a non-empty list of {'role': str, 'content': str} "
            f"messages, got {prompt!r:.80}"
        )
    return [dict(m) for m in prompt]
