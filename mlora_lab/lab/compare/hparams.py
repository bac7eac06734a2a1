"""Hyperparameters next to results, for sweeps: :func:`hparams` draws every tenant of some runs as a
point per setting (a scatter panel each) or as a line across the settings (parallel coordinates), its
y the best value of a metric it reached, read from :func:`~mlora_lab.lab.compare.results.summary` and a sweep's
record of the settings each trial was given (:mod:`mlora_lab.lab.records.trials`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from mlora_lab.lab.compare.results import summary
from mlora_lab.lab.plotting import (
    DRAWING,
    LabFigure,
    category_label,
    drawable,
    plain,
    run_titles,
    series_label,
    set_categories,
    set_log_x,
    style_axes,
)
from mlora_lab.lab.records.series import RunSeries
from mlora_lab.lab.records.trials import results
from mlora_lab.lab.runs.attach import RunLike, as_runs
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import RunDirError

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
"""A Tenant field's column in :func:`~mlora_lab.lab.compare.results.summary` where the names differ."""


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
    """:func:`~mlora_lab.lab.compare.results.summary` of ``runs`` (with a ``run`` column), each trial of a sweep
    with the settings it was given (from the sweep's record: its tenant may not be in job.json), and
    the names of the settings the sweeps searched."""
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
    mode: str | None = None,
) -> Figure:
    """Hyperparameters next to results, for sweeps: every tenant of ``runs`` as one point (``kind=
    "scatter"``: one panel per setting, the setting on x and the tenant's best ``metric`` on y) or one
    line (``kind="parallel"``: parallel coordinates, an axis per setting and a last one for the metric,
    lines coloured by the metric, best darkest).

    ``metric`` is ``eval_loss`` (the lowest held-out loss the tenant reached), ``loss`` (the lowest point
    of its smoothed train loss) or an evaluation's score ``eval/<name>/<metric>`` (its latest,
    ``JobSpec.evals``; ``mode="max"`` by default: more is better, give ``mode="min"`` for an error rate);
    tenants without it are left out, with a warning naming them.
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
    column = {"eval_loss": "best_eval_loss", "loss": "best_smoothed_loss"}.get(metric)
    score = isinstance(metric, str) and metric.startswith("eval/")
    if score:
        column = metric  # (summary's column: each tenant's latest score)
    if column is None:
        raise ValueError(
            f"metric must be 'eval_loss', 'loss' or an evaluation's 'eval/<name>/<metric>', got {metric!r}"
        )
    mode = mode or ("max" if score else "min")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    word = "latest" if score else "best"
    runs = as_runs(runs)
    table, searched = _hparams_table(runs)
    known = list(dict.fromkeys([*HPARAMS, *searched]))
    unknown = [p for p in params or () if p not in known]
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}"
        )
    if column not in table:
        table[column] = np.nan
    missing = table[table[column].isna()]
    if len(missing):
        warnings.warn(
            f"hparams: no {metric} for "
            + ", ".join(f"{r.run}/{r.tenant}" for r in missing.itertuples())
            + (
                " (give the tenants heldout_data, and heldout_every in the job)"
                if metric == "eval_loss"
                else ""
            ),
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
        + f" · {word} {metric} {y[i]:.4g}"
        for i, name in enumerate(names)
    ]
    numeric = {p: _is_number(table[p]) for p in params}
    categories = {p: sorted({str(v) for v in table[p].dropna()}) for p in params if not numeric[p]}

    def position(p: str) -> np.ndarray:
        if numeric[p]:
            return drawable(pd.to_numeric(table[p], errors="coerce").to_numpy(dtype=float))
        index = {c: i for i, c in enumerate(categories[p])}
        return np.array([index.get(str(v), np.nan) if not pd.isna(v) else np.nan for v in table[p]], float)

    best = int(np.nanargmin(y) if mode == "min" else np.nanargmax(y))
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
            style_axes(ax, xlabel=plain(p), ylabel=f"{word} {metric}" if ax is axes[0] else None)
        # (above the panel, not inside it, where it sat on the points of the top-left corner)
        axes[0].set_title(f"best (ringed): {plain(names[best])}", loc="left", fontsize=8, color="#222")
    else:
        import matplotlib as mpl

        ax = fig.add_subplot(1, 1, 1)
        axis_names = [*params, f"{word} {metric}"]
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
        cmap = mpl.colormaps["viridis_r" if mode == "min" else "viridis"]
        lo, hi = np.nanmin(y), np.nanmax(y)
        norm = mpl.colors.Normalize(lo, hi if hi > lo else lo + 1)
        xs = np.arange(len(axis_names))
        order = np.argsort(-y if mode == "min" else y)  # the best last, drawn on top
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
        fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"{word} {metric}", pad=0.02)
    fig.suptitle(f"hyperparameters → {word} {metric} ({len(table)} tenants)", fontsize=10)
    return fig  # LabFigure's constrained layout places the panels, the colorbar and the title


def _shown(v: Any) -> str:
    """A setting's value in a readout."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)
