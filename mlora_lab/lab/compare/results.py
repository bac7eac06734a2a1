"""Comparing tenants and runs: the runs table, summary tables and overlay plots.

All of it reads run directories only (metrics.jsonl, job.json, status.json, labels.json). The
hyperparameter figure of sweeps, drawn from :func:`summary`, is :mod:`mlora_lab.lab.compare.hparams`; the
side-by-side generations of the saved adapters are :mod:`mlora_lab.lab.compare.generations`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from mlora_lab.lab.plotting import (
    DRAWING,
    EXPORT_DPI,
    LINESTYLES,
    LabFigure,
    best_smoothed,
    cut_note,
    drawable,
    ema,
    marker_for,
    placeholder,
    plain,
    robust_ylim,
    run_name,
    run_titles,
    series_label,
    set_log_y,
    set_x_axis,
    shorten,
    style_axes,
    thin_with_breaks,
)
from mlora_lab.lab.records.series import (
    METRICS,
    PREFERENCE_METRICS,
    RL_METRICS,
    X_AXES,
    RunSeries,
    to_datetimes,
)
from mlora_lab.lab.records.usage import latest_usage, usage_totals
from mlora_lab.lab.runs.attach import RunLike, as_runs
from mlora_lab.lab.runs.run import DEFAULT_WORKDIR, Run
from mlora_lab.lab.tables import FittedFrame, Shown, cut, decimals, general, minute, missing, whole
from mlora_lab.rundir import (
    EvalMetricRow,
    RowKind,
    RunDirError,
    TrainRow,
    read_labels,
    read_status,
    shown_tenant_state,
)
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.tenant import Tenant

SUMMARY_COLUMNS = [
    "tenant",
    "state",
    "steps",
    "max_steps",
    "final_loss",
    "best_smoothed_loss",
    "eval_loss",
    "best_eval_loss",
    "reward",
    "first_loss",
    "rewards/accuracies",
    "rewards/margins",
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
PREFERENCE_SHOWN = ("rewards/accuracies", "rewards/margins")
"""What :func:`summary` shows of a preference tenant (``Tenant.pref``): its latest of these two of
:data:`~mlora_lab.lab.records.series.PREFERENCE_METRICS`, under TRL's names."""
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

USAGE_SHOWN = ("tokens_trained", "tokens_sampled", "busy_s")
"""A served run's usage totals in the runs table (:mod:`mlora_lab.lab.records.usage`; ``svc.usage()`` has them all)."""
RUNS_COLUMNS = [
    "run",
    "name",
    "state",
    "tenants",
    "global_step",
    "best_smoothed_loss",
    "best_reward",
    *USAGE_SHOWN,
    "tags",
    "note",
    "started",
    "path",
    "problem",
]
COUNTS = ("steps", "max_steps", "rank", "warmup", "batch_size", "grad_accum", "rows", "tokens", "global_step")
"""Columns of whole numbers: pandas' nullable ``Int64``, so a count that one row lacks (a tenant that failed
before its first step has no ``rows``) does not turn the column into floats (``1234.0``)."""


class RunsFrame(FittedFrame):
    """:func:`runs`' table: a DataFrame of every column, shown fitted (:mod:`mlora_lab.lab.tables`): each run
    on one line, short headers, a run's usage, tags, note and problem only where some run has them, its path
    left to the frame (``run`` names its directory)."""

    VIEW = (
        Shown("run", "run", keep=10),
        Shown("name", "name", cut(24), keep=3),
        Shown("state", "state", keep=9),
        Shown("tenants", "tenants", cut(30), keep=5),
        Shown("global_step", "step", whole, keep=7),
        Shown("best_smoothed_loss", "best loss", decimals(), keep=6, optional=True),
        Shown("best_reward", "best reward", decimals(), keep=6, optional=True),
        Shown("tokens_trained", "trained", whole, keep=2, optional=True),
        Shown("tokens_sampled", "sampled", whole, keep=2, optional=True),
        Shown("busy_s", "busy s", decimals(1), keep=1, optional=True),
        Shown("tags", "tags", cut(30), keep=4, optional=True),
        Shown("note", "note", cut(40), keep=1, optional=True),
        Shown("started", "started", minute, keep=5),
        Shown("problem", "problem", cut(60), keep=8, optional=True),
    )
    HIDDEN = frozenset({"path"})


LOSSES = ("final_loss", "best_smoothed_loss", "first_loss")


class SummaryFrame(FittedFrame):
    """:func:`summary`'s table: a DataFrame of every column, shown fitted (:mod:`mlora_lab.lab.tables`):
    losses and rewards with 4 decimals (never in scientific notation for a tiny value), counts as whole
    numbers, settings as written; the eval, reward and preference columns only where some tenant has them,
    and, for tenants that all learn from rewards, their rewards without their losses (a GRPO loss says
    nothing of how well a tenant does: its reward does)."""

    VIEW = (
        Shown("run", "run", keep=11),
        Shown("tenant", "tenant", keep=12),
        Shown("state", "state", keep=10),
        Shown("steps", "steps", whole, keep=9),
        Shown("max_steps", "max steps", whole, keep=4),
        Shown("final_loss", "final loss", decimals(), keep=8),
        Shown("best_smoothed_loss", "best loss", decimals(), keep=8),
        Shown("eval_loss", "held-out loss", decimals(), keep=7, optional=True),
        Shown("best_eval_loss", "best held-out", decimals(), keep=4, optional=True),
        Shown("reward", "reward", decimals(), keep=8, optional=True),
        Shown("first_loss", "first loss", decimals(), keep=3),
        Shown("rewards/accuracies", "rewards/accuracies", decimals(), keep=7, optional=True),
        Shown("rewards/margins", "rewards/margins", decimals(), keep=7, optional=True),
        Shown("lr", "lr", general, keep=6),
        Shown("rank", "rank", whole, keep=6),
        Shown("alpha", "alpha", general, keep=3),
        Shown("schedule", "schedule", keep=2),
        Shown("warmup", "warmup", whole, keep=1),
        Shown("dropout", "dropout", general, keep=1),
        Shown("batch_size", "batch", whole, keep=2),
        Shown("grad_accum", "accum", whole, keep=1),
        Shown("targets", "targets", cut(30), keep=2),
        Shown("rows", "rows", whole, keep=2, optional=True),
        Shown("tokens", "tokens", whole, keep=3),
        Shown("time_s", "time s", decimals(1), keep=2),
        Shown("reason", "reason", cut(60), keep=7, optional=True),
    )

    def view(self) -> list[Shown]:
        shown = super().view()
        if _all_rl(self):
            shown = [s for s in shown if s.column not in LOSSES]
        return shown


def _all_rl(table: pd.DataFrame) -> bool:
    """Whether every tenant of ``table`` that trained has a reward (so all learn from rewards)."""
    if "reward" not in table or "steps" not in table:
        return False
    trained = table[pd.to_numeric(table["steps"], errors="coerce").fillna(0) > 0]
    return len(trained) > 0 and bool(trained["reward"].notna().all())


def _counts(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its :data:`COUNTS` columns as ``Int64`` (a column holding anything but whole numbers
    and missing values is left as it is)."""
    for column in COUNTS:
        if column in table and table[column].dtype != "Int64":
            values = [None if missing(v) else v for v in table[column].tolist()]
            if all(v is None or _whole(v) for v in values):
                table[column] = pd.array([v if v is None else int(v) for v in values], dtype="Int64")
    return table


def _whole(v: object) -> bool:
    return (
        isinstance(v, int | float | np.integer | np.floating)
        and not isinstance(v, bool)
        and float(v).is_integer()
    )


def runs(workdir: str | Path = DEFAULT_WORKDIR) -> pd.DataFrame:
    """One row per run directory under ``workdir``: ``run`` (its directory's name), ``name`` (the job's
    ``JobSpec.name``), state, tenants (comma-joined names), ``global_step`` (the job's step: one per
    batch, whichever tenants took part), ``best_smoothed_loss`` (the lowest smoothed train loss of any tenant
    that learns from data: the EMA the dashboard draws, factor :data:`~mlora_lab.lab.plotting.SMOOTHING`, so
    one lucky batch cannot set it; None before the first step, and for a run whose tenants all learn from
    rewards, whose loss says nothing of how well they do), ``best_reward`` (the highest smoothed mean reward
    of any RL tenant; None without one), ``tags`` (comma-joined, in the order they were added:
    ``table[table.tags.str.contains("baseline")]``), ``note`` (cut past
    :data:`~mlora_lab.lab.plotting.NOTE_CHARS` characters) and start time; a served run's usage so far,
    ``tokens_trained``, ``tokens_sampled`` and ``busy_s`` (its clients' requests, every key's: None for a
    run that served none). A run whose files cannot be
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
            rewards: dict[str, list[float]] = {}  # (an RL tenant's: None where a generation had none)
            for r in metrics:
                if isinstance(r, TrainRow):
                    if r.reward is not None or r.tenant in rewards:
                        rewards.setdefault(r.tenant, []).append(np.nan if r.reward is None else r.reward)
                    if r.loss is not None:
                        losses.setdefault(r.tenant, []).append(r.loss)
            best = [
                b
                for t, v in losses.items()
                if t not in rewards and (b := best_smoothed(np.array(v))) is not None
            ]
            best_rewards = [-b for v in rewards.values() if (b := best_smoothed(-np.array(v))) is not None]
            used = usage_totals(latest_usage(metrics)) or {}
            row |= {
                "name": run.spec.name,
                "state": run.status.value,
                "tenants": ", ".join(t.name for t in run.spec.tenants),
                "global_step": max((r.step for r in metrics), default=0),
                "best_smoothed_loss": min(best, default=None),
                "best_reward": max(best_rewards, default=None),
                **{c: used.get(c) for c in USAGE_SHOWN},
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
    return RunsFrame(_counts(pd.DataFrame(rows, columns=RUNS_COLUMNS)))


def summary(runs: RunLike | Sequence[RunLike]) -> pd.DataFrame:
    """One row per tenant (per run; a ``run`` column first when there are several), settings next to
    results:

    - ``state``: the tenant's state now (``pending``, ``running``, ``paused``, ``finished``,
      ``removed``, ``failed``, ``refused``; a tenant the job was still training when the run stopped,
      failed or was lost shows the run's state) and ``reason`` (why it failed or was refused);
    - its results first (a notebook hides the middle columns of a wide table): ``steps`` (the tenant's
      own optimiser steps) of ``max_steps``, ``final_loss`` (its last logged train loss), ``best_smoothed_loss``
      (the lowest point of its smoothed train loss: the EMA the dashboard draws, factor
      :data:`~mlora_lab.lab.plotting.SMOOTHING`; one lucky batch cannot set it), ``eval_loss`` and
      ``best_eval_loss`` (the held-out loss: the last and the lowest of its ``eval`` rows), ``reward`` (an
      RL tenant's latest logged mean reward; NaN for an SFT tenant), ``first_loss``, and a preference
      tenant's (``Tenant.pref``) latest ``rewards/accuracies`` and ``rewards/margins`` as TRL's DPOTrainer
      logs them (the share of the window's pairs whose chosen answer the adapter prefers over the rejected
      one more than the reference does, and the mean of that difference in implicit rewards; NaN for
      other tenants);
    - its settings: ``lr``, ``rank``, ``alpha``, ``schedule``, ``warmup`` (steps), ``dropout``,
      ``batch_size``, ``grad_accum``, ``targets`` (target modules, then target parameters, comma-joined);
    - ``rows`` of its data and target ``tokens`` trained on, ``time_s`` from its first to its last logged
      step, and ``reason``.

    Tenants added while the job ran are included, also those the job refused or has not added yet
    (their settings are those their ``add`` message sent). ``rows`` is missing (``<NA>``: counts are
    nullable integers) for runs written before rows were counted and for tenants with no step.

    A :class:`SummaryFrame`: every column is in the frame; it shows itself fitted (4 decimals, whole counts,
    the reward instead of the losses of tenants that all learn from rewards)."""
    runs = as_runs(runs)
    out = []
    for run in runs:
        run_state = run.status
        last = run.last_tenant_rows()
        df = run.metrics()
        scores = _last_eval_scores(run)
        for name, t in run.tenant_specs().items():
            train = df[(df["kind"] == RowKind.TRAIN) & (df["tenant"] == name)] if len(df) else df
            heldout = df[(df["kind"] == RowKind.HELDOUT) & (df["tenant"] == name)] if len(df) else df
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
                    "best_smoothed_loss": best_smoothed(train["loss"].to_numpy(dtype=float))
                    if len(train)
                    else None,
                    "eval_loss": heldout["loss"].iloc[-1] if len(heldout) else None,
                    "best_eval_loss": heldout["loss"].min() if len(heldout) else None,
                    "reward": _last_value(train, "reward"),
                    **{m: _last_value(train, m) for m in PREFERENCE_SHOWN},
                    "rows": _last_count(train, "rows_seen"),
                    "tokens": tokens,
                    "time_s": _seconds(train["time"]) if "time" in train else 0.0,  # (no rows: no column)
                    "reason": row.reason if row else None,
                    **scores.get(name, {}),
                }
            )
    columns = (["run"] if len(runs) > 1 else []) + SUMMARY_COLUMNS
    extra = sorted({k for r in out for k in r if k.startswith("eval/")})
    return SummaryFrame(_counts(pd.DataFrame(out)[columns + extra]) if out else pd.DataFrame(columns=columns))


def _last_eval_scores(run: Run) -> dict[str, dict[str, float | None]]:
    """``{tenant: {"eval/<name>/<metric>": its latest score}}`` from the run's evaluations (``JobSpec.evals``)."""
    out: dict[str, dict[str, float | None]] = {}
    for r in run.typed_rows():
        if isinstance(r, EvalMetricRow):
            out.setdefault(r.model, {})[r.series] = r.value
    return out


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


KIND_METRICS = {
    **dict.fromkeys(
        RL_METRICS, f"only RL tenants, Tenant.rl, log {', '.join(RL_METRICS)}; kl only with beta > 0"
    ),
    **dict.fromkeys(
        PREFERENCE_METRICS, f"only preference tenants, Tenant.pref, log {', '.join(PREFERENCE_METRICS)}"
    ),
}
"""The metrics only one kind of tenant logs, and what :func:`compare` says when no tenant of the runs has
one (an SFT tenant has none of them)."""
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

    ``metric`` is one of ``loss``, ``eval_loss``, ``lr``, ``grad_norm``, ``tokens``, an evaluation's score
    ``eval/<name>/<metric>`` (``JobSpec.evals``; the base model is drawn too, as ``base``), or what RL tenants
    log (:data:`~mlora_lab.lab.records.series.RL_METRICS`: ``reward``, ``reward_std``, ``completion_len``, ``kl``,
    ``clip_ratio``), or what preference tenants (``Tenant.pref``) log, as TRL's DPOTrainer names them
    (:data:`~mlora_lab.lab.records.series.PREFERENCE_METRICS`: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; other tenants have none
    of these two kinds and are not drawn for them); ``x`` one of
    ``tenant step`` (default), ``global step``, ``tokens`` (the tenant's target tokens seen so far),
    ``wall time``, ``relative time`` (seconds since the run's first row); ``tenants`` limits the
    tenants drawn (default: all). Each (run, tenant) has its own colour, the same as in the dashboard
    and in every other figure (:class:`mlora_lab.lab.plotting.Colours`), and each run its own line style.
    ``smoothing`` is an EMA factor in [0, 1): the smoothed line is drawn over the raw values, which stay
    visible, faded. ``logy`` uses a log y axis with readable ticks on any range; ``ignore_outliers``
    sets the y-limits from the 1st-99th percentile of the values. Lines are broken where a run was
    stopped and resumed (on time axes), and a series of a few points has markers.

    A run with no value of ``metric`` for the tenants asked (no held-out rows for ``eval_loss``, say) is
    left out with a warning naming it; an RL or preference metric that no run has at all (no tenant of that
    kind) is a ``ValueError`` naming the metrics they have.
    """
    if metric not in METRICS and not metric.startswith("eval/"):
        raise ValueError(
            f"unknown metric {metric!r}; choose from {sorted(METRICS)} or an evaluation's 'eval/<name>/<metric>'"
        )
    if x not in X_AXES:
        raise ValueError(f"unknown x axis {x!r}; choose from {', '.join(X_AXES)}")
    runs = as_runs(runs)
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
    with_heldout: bool = False,
) -> list[str]:
    """Draw ``metric`` of every (run, tenant) on ``ax`` (and, ``with_heldout``, the held-out loss as dots);
    returns the names of the runs that had no value to draw. Colours are the tenants' own
    (:meth:`~mlora_lab.lab.records.series.RunSeries.colour`), each run has its line style, labels are
    ``run / tenant`` with the run's title (:func:`~mlora_lab.lab.plotting.run_titles`)."""
    taken: dict[str, Path] = {}
    feeds = [RunSeries(run.dir, run_name(run.path, taken)) for run in runs]
    for feed in feeds:
        feed.poll()
    kind = KIND_METRICS.get(metric)
    if kind is not None and not any(feed.has(metric) for feed in feeds):
        # one error rather than a warning per run and an empty figure: nothing could be drawn
        have = [m for m in METRICS if any(m in feed.metric_names() for feed in feeds)]
        raise ValueError(f"no {metric!r} values in these runs ({kind}); choose from {have}")
    titles = run_titles([(feed.title, feed.name) for feed in feeds])
    set_x_axis(ax, x)
    missing = []
    for i, (feed, title) in enumerate(zip(feeds, titles)):
        style = LINESTYLES[i % len(LINESTYLES)]
        drew = False
        names = [
            *feed.tenants,
            *(["base"] if metric in feed.base_evals else []),
        ]  # (evaluations score the base)
        for name in names:
            if tenants is not None and name not in tenants:
                continue
            xs, ys, breaks = feed.xy(name, metric, x)
            ys = drawable(ys)
            if not np.isfinite(ys).any():
                continue
            drew = True
            colour = feed.colour(name)
            label = series_label(None if len(feeds) == 1 else title, name)
            is_heldout = metric == "eval_loss"  # (a point per measurement: dots)
            marker = "o" if is_heldout else marker_for(len(xs))
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
            if with_heldout:
                hx, hy, hbreaks = feed.xy(name, "eval_loss", x)
                if len(hx):
                    (dots,) = ax.plot(
                        *thin_with_breaks(hx, drawable(hy), hbreaks, COMPARE_POINTS),
                        "o",
                        color=colour,
                        markersize=4,
                        label="_heldout",
                    )
                    dots.lab_role = "heldout"
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
    """Train loss (lines) and held-out loss (dots) of every tenant of a run, against the tenant step;
    saved to ``path`` if given (the format from its suffix: ``.png`` at twice the display resolution,
    ``.svg``, ``.pdf``)."""
    (run,) = as_runs(run)
    fig = LabFigure(figsize=(8, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _overlay(ax, [run], "loss", None, smoothing, "tenant step", with_heldout=True)
    style_axes(
        ax, ylabel="loss (lines: train, dots: held-out)", title=plain(shorten(_title(run), 80)), size=9
    )
    _finish(ax, False, False, "no steps logged yet")
    if path is not None:
        with DRAWING:
            fig.savefig(path, dpi=EXPORT_DPI)
    return fig
