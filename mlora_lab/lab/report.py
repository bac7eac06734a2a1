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
    EXPORT_DPI,
    Colours,
    ema,
    figure_png,
    marker_for,
    placeholder,
    robust_ylim,
    run_name,
    series_key,
    set_log_y,
    set_x_axis,
    style_axes,
    thin_with_breaks,
)
from mlora_lab.lab.run import DEFAULT_WORKDIR, Run
from mlora_lab.lab.series import METRICS, X_AXES, RunSeries
from mlora_lab.rundir import (
    RowKind,
    RunDirError,
    TenantRow,
    TrainRow,
    read_labels,
    read_status,
    shown_tenant_state,
)
from mlora_lab.spec import SpecError, Tenant

SUMMARY_COLUMNS = [
    "tenant",
    "state",
    "rank",
    "alpha",
    "targets",
    "lr",
    "schedule",
    "warmup",
    "dropout",
    "batch_size",
    "grad_accum",
    "steps",
    "max_steps",
    "first_loss",
    "final_loss",
    "best_loss",
    "eval_loss",
    "best_eval_loss",
    "rows",
    "tokens",
    "time_s",
    "reason",
]
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
LINESTYLES = ["-", "--", ":", "-."]

RunLike = Run | str | Path

RUNS_COLUMNS = ["run", "state", "tenants", "steps", "best_loss", "tags", "note", "started", "path", "problem"]


def runs(workdir: str | Path = DEFAULT_WORKDIR) -> pd.DataFrame:
    """One row per run directory under ``workdir``: id, state, tenants (comma-joined names), global
    steps, ``best_loss`` (the lowest train loss of any tenant; None before the first step), ``tags``
    (comma-joined, in the order they were added: ``table[table.tags.str.contains("baseline")]``),
    ``note`` and start time. A run whose files cannot be read is listed as ``broken`` (its ``state``),
    with the reason in ``problem``; unreadable labels leave its tags and note empty and say why in ``problem``."""
    rows = []
    for job in sorted(Path(workdir).glob("*/job.json")):
        row = {"run": job.parent.name, "path": str(job.parent), "problem": None}
        try:
            run = Run(job.parent)
            status = read_status(job.parent)
            metrics = run.typed_rows()
            losses = [r.loss for r in metrics if isinstance(r, TrainRow) and r.loss is not None]
            row |= {
                "state": run.status.value,
                "tenants": ", ".join(t.name for t in run.spec.tenants),
                "steps": max((r.step for r in metrics), default=0),
                "best_loss": min(losses, default=None),
                "started": pd.to_datetime(status.started if status else None, unit="s"),
            }
        except (RunDirError, SpecError, OSError) as e:
            row |= {"state": BROKEN, "tenants": None, "steps": None, "started": pd.NaT, "problem": str(e)}
        try:
            labels = read_labels(job.parent)
            row |= {"tags": ", ".join(labels.tags), "note": labels.note}
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
    - its settings: ``rank``, ``alpha``, ``targets`` (target modules, then target parameters,
      comma-joined), ``lr``, ``schedule``, ``warmup`` (steps), ``dropout``, ``batch_size``, ``grad_accum``,
      ``max_steps``;
    - its results: ``steps`` taken, first/final/best train loss, last and best eval loss, ``rows`` of its data
      and target ``tokens`` trained on, and ``time_s`` from its first to its last logged step.

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
                    "best_loss": train["loss"].min() if len(train) else None,
                    "eval_loss": evals["loss"].iloc[-1] if len(evals) else None,
                    "best_eval_loss": evals["loss"].min() if len(evals) else None,
                    "rows": _last_count(train, "rows_seen"),
                    "tokens": tokens,
                    "time_s": (train["time"].iloc[-1] - train["time"].iloc[0]).total_seconds()
                    if len(train)
                    else 0.0,
                    "reason": row.reason if row else None,
                }
            )
    columns = (["run"] if len(runs) > 1 else []) + SUMMARY_COLUMNS
    return pd.DataFrame(out)[columns] if out else pd.DataFrame(columns=columns)


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

    ``metric`` is one of ``loss``, ``eval_loss``, ``lr``, ``grad_norm``, ``tokens``; ``x`` one of
    ``tenant step`` (default), ``global step``, ``tokens`` (the tenant's target tokens seen so far),
    ``wall time``, ``relative time`` (seconds since the run's first row); ``tenants`` limits the
    tenants drawn (default: all). Each (run, tenant) has its own colour, the same as in the dashboard
    and in every other figure (:class:`mlora_lab.lab.plotting.Colours`), and each run its own line style.
    ``smoothing`` is an EMA factor in [0, 1): the smoothed line is drawn over the raw values, which stay
    visible, faded. ``logy`` uses a log y axis with readable ticks on any range; ``ignore_outliers``
    sets the y-limits from the 1st-99th percentile of the values. Lines are broken where a run was
    stopped and resumed (on time axes), and a series of a few points has markers.

    A run with no value of ``metric`` for the tenants asked (no eval rows for ``eval_loss``, say) is
    left out with a warning naming it.
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
    style_axes(ax, ylabel=metric, title=f"{metric}: " + ", ".join(r.path.name for r in runs), size=9)
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
    returns the names of the runs that had no value to draw."""
    taken: dict[str, Path] = {}
    feeds = [RunSeries(run.dir, run_name(run.path, taken)) for run in runs]
    colours = Colours()
    for feed in feeds:
        feed.poll()
        for name in feed.tenants:  # colours follow the listing order, as in the dashboard
            colours(series_key(feed.name, name))
    set_x_axis(ax, x)
    missing = []
    for i, feed in enumerate(feeds):
        style = LINESTYLES[i % len(LINESTYLES)]
        drew = False
        for name in feed.tenants:
            if tenants is not None and name not in tenants:
                continue
            xs, ys, breaks = feed.xy(name, metric, x)
            if not np.isfinite(ys).any():
                continue
            drew = True
            colour = colours(series_key(feed.name, name))
            label = name if len(feeds) == 1 else f"{feed.name} / {name}"
            is_eval = metric == "eval_loss"
            marker = "o" if is_eval else marker_for(len(xs))
            if smoothing > 0 and len(xs) > 1:  # the raw values stay visible under the smoothed line
                ax.plot(
                    *thin_with_breaks(xs, ys, breaks, COMPARE_POINTS),
                    linestyle=style,
                    color=colour,
                    alpha=0.25,
                    linewidth=0.8,
                    label="_raw",
                )
            ax.plot(
                *thin_with_breaks(xs, ema(ys, smoothing), breaks, COMPARE_POINTS),
                linestyle=style,
                marker=marker,
                markersize=3,
                color=colour,
                linewidth=1.4,
                label=label,
            )
            if with_eval:
                ex, ey, ebreaks = feed.xy(name, "eval_loss", x)
                if len(ex):
                    ax.plot(
                        *thin_with_breaks(ex, ey, ebreaks, COMPARE_POINTS),
                        "o",
                        color=colour,
                        markersize=4,
                        label="_eval",
                    )
        if not drew:
            missing.append(feed.name)
    return missing


def _finish(ax: Axes, logy: bool, ignore_outliers: bool, empty: str) -> None:
    """Scale, limits, legend, and a note instead of empty ticks when nothing was drawn."""
    set_log_y(ax, logy)
    mains = [line for line in ax.lines if not line.get_label().startswith("_")]
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
    style_axes(ax, ylabel="loss (lines: train, dots: eval)", title=run.path.name, size=9)
    _finish(ax, False, False, "no steps logged yet")
    if path is not None:
        fig.savefig(path, dpi=EXPORT_DPI)
    return fig


HPARAMS = ("lr", "rank", "alpha", "dropout", "warmup", "batch_size", "grad_accum", "max_steps")
"""Numeric settings :func:`hparams` can put on an axis (the ``summary()`` columns of the same names)."""
LOG_HPARAMS = frozenset({"lr"})
"""Settings searched on a log scale: their axes are logarithmic."""


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

    ``metric`` is ``eval_loss`` (the lowest eval loss the tenant reached) or ``loss`` (its lowest train
    loss); tenants without it are left out, with a warning naming them. ``params`` are ``summary()``
    columns from :data:`HPARAMS`; by default every one that differs between the tenants shown (a setting
    all tenants share explains nothing). ``lr`` is drawn on a log axis. Colours are the tenants'
    colours of every other figure (:class:`mlora_lab.lab.plotting.Colours`).
    """
    if kind not in ("scatter", "parallel"):
        raise ValueError(f"kind must be 'scatter' or 'parallel', got {kind!r}")
    column = {"eval_loss": "best_eval_loss", "loss": "best_loss"}.get(metric)
    if column is None:
        raise ValueError(f"metric must be 'eval_loss' or 'loss', got {metric!r}")
    unknown = [p for p in params or () if p not in HPARAMS]
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; choose from {', '.join(HPARAMS)}"
        )
    runs = _as_runs(runs)
    table = summary(runs)
    if "run" not in table:
        table.insert(0, "run", runs[0].path.name if runs else "")
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
        params = [p for p in HPARAMS if table[p].dropna().nunique() > 1]
    params = list(params)
    fig = LabFigure(
        figsize=figsize or ((4 + 2.6 * max(1, len(params)), 3.6) if kind == "scatter" else (9, 4))
    )
    if not len(table) or not params:
        ax = fig.add_subplot(1, 1, 1)
        why = f"no tenant has {metric}" if not len(table) else "every tenant has the same settings"
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666")
        ax.set_axis_off()
        return fig
    colours = Colours()
    keys = [series_key(r.run, r.tenant) for r in table.itertuples()]
    y = table[column].to_numpy(dtype=float)
    if kind == "scatter":
        axes = fig.subplots(1, len(params), sharey=True, squeeze=False)[0]
        for ax, p in zip(axes, params):
            x = table[p].to_numpy(dtype=float)
            ax.scatter(x, y, c=[colours(k) for k in keys], s=36, edgecolors="white", linewidths=0.5, zorder=3)
            best = int(np.nanargmin(y))
            ax.scatter(
                [x[best]], [y[best]], s=140, facecolors="none", edgecolors="#222", linewidths=1.2, zorder=4
            )
            if p in LOG_HPARAMS:
                ax.set_xscale("log")
            style_axes(ax, xlabel=p, ylabel=f"best {metric}" if ax is axes[0] else None)
        axes[0].annotate(
            f"best: {keys[best]}",
            xy=(0.02, 0.98),
            xycoords="axes fraction",
            va="top",
            fontsize=8,
            color="#222",
        )
    else:
        import matplotlib as mpl

        ax = fig.add_subplot(1, 1, 1)
        names = [*params, f"best {metric}"]
        raw = [table[p].to_numpy(dtype=float) for p in params] + [y]
        scaled = []
        for name, v in zip(names, raw):
            v = np.log10(v) if name in LOG_HPARAMS else v
            lo, hi = np.nanmin(v), np.nanmax(v)
            scaled.append((v - lo) / (hi - lo) if hi > lo else np.full_like(v, 0.5))
        cmap = mpl.colormaps["viridis_r"]
        lo, hi = np.nanmin(y), np.nanmax(y)
        norm = mpl.colors.Normalize(lo, hi if hi > lo else lo + 1)
        xs = np.arange(len(names))
        order = np.argsort(-y)  # the best last, drawn on top
        for i in order:
            ax.plot(xs, [s[i] for s in scaled], color=cmap(norm(y[i])), linewidth=1.6, alpha=0.9)
        for j, v in enumerate(raw):
            ax.axvline(j, color="#999", linewidth=0.8)
            lo_v, hi_v = np.nanmin(v), np.nanmax(v)
            ax.text(j, -0.06, f"{lo_v:.3g}", ha="center", va="top", fontsize=7, color="#555")
            ax.text(j, 1.06, f"{hi_v:.3g}", ha="center", va="bottom", fontsize=7, color="#555")
        ax.set_xticks(xs, names, fontsize=8)
        ax.set_yticks([])
        ax.set_ylim(-0.15, 1.15)
        ax.set_xlim(-0.3, len(names) - 0.7)
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"best {metric}", pad=0.02)
    fig.suptitle(f"hyperparameters → best {metric} ({len(table)} tenants)", fontsize=10)
    return fig  # LabFigure's constrained layout places the panels, the colorbar and the title


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
        report = data.scan_jsonl(t.data)
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
