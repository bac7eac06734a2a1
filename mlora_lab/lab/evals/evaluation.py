"""An evaluation's results as tables and a figure: :class:`Evaluation`, what :func:`mlora_lab.evaluate` returns
and :func:`load_evaluation` reads back from a run.

Scores are :mod:`mlora_lab.evals.scores`' (each example's mean over its samples, the mean over examples, a
paired percentile bootstrap over examples: the same numbers the job logs for its evaluations). With ``k = num_samples > 1`` and a metric whose scores are all 0 or 1, ``pass@k`` is the
unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` averaged over examples, with ``n``
samples of which ``c`` passed (here ``k = n``: whether any passed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mlora_lab.evals.episodes import EPISODE_COLUMN, is_episode
from mlora_lab.evals.scores import bootstrap, failures, per_example
from mlora_lab.lab.runs.attach import RunLike, as_runs
from mlora_lab.rundir.evals import EvalExample, EvalMeta, list_evals, read_eval


class Evaluation:
    """One evaluation: models × examples × samples, each completion with every metric's score."""

    def __init__(self, meta: EvalMeta, rows: list[EvalExample], folder: Path | None = None) -> None:
        self.meta, self.folder = meta, folder
        self.rows, self.episodes = _episodes_apart(rows)
        """``rows``, and each one's episode (an environment's evaluation: ``{"messages", "turns", "stop",
        "parts", "forks"}``; ``None`` for a completion), which the rows keep among their columns when saved."""
        self._per_example: dict[str, np.ndarray] | None = None  # (the rows never change: made once)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def models(self) -> list[str]:
        return list(self.meta.models)

    @property
    def metrics(self) -> list[str]:
        return list(self.meta.metrics)

    def __repr__(self) -> str:
        where = f", saved in {self.folder}" if self.folder else ""
        left = self.meta.left_out
        left = f"; left out: {', '.join(f'{t} (failed)' for t in left)}" if left else ""
        return (
            f"<Evaluation {self.name!r}: {len(self.models)} models × {self.meta.examples} examples"
            f" × {self.meta.num_samples} samples, metrics {', '.join(self.metrics)}{where}{left}>"
        )

    # -- tables ----------------------------------------------------------------------------------
    def examples(self) -> pd.DataFrame:
        """One row per example, model and sample: ``example, model, sample, prompt, completion``, a column
        per metric (NaN: not scored), the example's other columns (its reference, ...), ``tokens`` and
        ``stop_reason``, and for an environment's evaluation ``episode`` (its row's: messages, turns, stop,
        rubric parts, forks; the completion is its conversation after the prompt as text)."""
        extra = list(dict.fromkeys(k for r in self.rows for k in r.columns))
        episodes = any(e is not None for e in self.episodes)
        records = [
            (
                r.example,
                r.model,
                r.sample,
                r.prompt,
                r.completion,
                *(_num(r.scores.get(m)) for m in self.metrics),
                *(r.columns.get(k) for k in extra),
                r.tokens,
                r.stop_reason,
                *([episode] if episodes else []),
            )
            for r, episode in zip(self.rows, self.episodes, strict=True)
        ]
        columns = [
            "example",
            "model",
            "sample",
            "prompt",
            "completion",
            *self.metrics,
            *extra,
            "tokens",
            "stop_reason",
            *([EPISODE_COLUMN] if episodes else []),
        ]
        return pd.DataFrame.from_records(records, columns=columns)

    def per_example(self) -> dict[str, np.ndarray]:
        """``{metric: [models, examples]}``: each example's mean score over its samples (NaN: none). Made once:
        the tables, the figure and every change of the eval table's controls read it."""
        if self._per_example is None:
            self._per_example = {
                m: per_example(self.rows, self.models, m, self.meta.examples) for m in self.metrics
            }
        return self._per_example

    def scores(self, resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
        """Models × metrics: each metric's mean, with its bootstrap interval as ``<metric>_low`` and
        ``<metric>_high`` (:func:`mlora_lab.evals.scores.bootstrap`), ``pass@k`` columns for 0/1 metrics
        when ``num_samples > 1``, and ``n`` (examples). A row per model, in the evaluation's order.

        A model whose mean or interval for a metric is not a finite number (an infinite score) failed that
        metric: its three numbers are NaN and a ``<metric>_failed`` column (there only when one failed)
        says why (:func:`mlora_lab.evals.scores.failures`), and is empty (NA) for the other models."""
        table: dict[str, Any] = {"n": [self.meta.examples] * len(self.models)}
        for metric, values in self.per_example().items():
            mean, low, high, n = bootstrap(values, resamples, confidence, seed)
            failed = failures(metric, self.models, mean, low, high, n)
            for model in failed:
                i = self.models.index(model)
                mean[i] = low[i] = high[i] = np.nan
            table[metric], table[f"{metric}_low"], table[f"{metric}_high"] = mean, low, high
            if failed:
                table[f"{metric}_failed"] = [failed.get(m) for m in self.models]
            k = self.meta.num_samples
            if k > 1 and self._binary(metric):
                table[f"{metric}_pass@{k}"] = self._pass_at_k(metric, k)
        return pd.DataFrame(table, index=pd.Index(self.models, name="model"))

    def _binary(self, metric: str) -> bool:
        values = {r.scores.get(metric) for r in self.rows} - {None}
        return bool(values) and values <= {0.0, 1.0}

    def _pass_at_k(self, metric: str, k: int) -> list[float]:
        from math import comb

        out = []
        for model in self.models:
            rows = [r for r in self.rows if r.model == model and r.scores.get(metric) is not None]
            by_example: dict[int, list[float]] = {}
            for r in rows:
                by_example.setdefault(r.example, []).append(float(r.scores[metric]))
            values = []
            for scores in by_example.values():
                n_, c = len(scores), int(sum(scores))
                values.append(1.0 - comb(n_ - c, k) / comb(n_, k) if n_ >= k else float(c > 0))
            out.append(float(np.mean(values)) if values else float("nan"))
        return out

    def compare(self, a: str, b: str, metric: str | None = None) -> pd.DataFrame:
        """Example by example, model ``a`` against ``b``: the prompt, both completions (the first sample),
        each metric's two scores (means over samples) and ``<metric>_delta = b - a``; disagreements first
        (the largest ``|delta|`` of ``metric``, default the first metric), then by example."""
        for m in (a, b):
            if m not in self.models:
                raise KeyError(f"no model {m!r} in evaluation {self.name!r}; models: {self.models}")
        metric = metric or (self.metrics[0] if self.metrics else None)
        if metric is not None and metric not in self.metrics:
            raise KeyError(f"no metric {metric!r} in evaluation {self.name!r}; metrics: {self.metrics}")
        first = {(r.model, r.example): r for r in self.rows if r.sample == 0}
        prompts = {r.example: r.prompt for r in self.rows}
        per = self.per_example()
        ia, ib = self.models.index(a), self.models.index(b)
        table: dict[str, Any] = {
            "example": list(range(self.meta.examples)),
            "prompt": [prompts.get(e) for e in range(self.meta.examples)],
            a: [getattr(first.get((a, e)), "completion", None) for e in range(self.meta.examples)],
            b: [getattr(first.get((b, e)), "completion", None) for e in range(self.meta.examples)],
        }
        if a == b:
            table[f"{b} (again)"] = table.pop(b)
        for m, values in per.items():
            table[f"{m}_{a}"], table[f"{m}_{b}"] = values[ia], values[ib]
            table[f"{m}_delta"] = values[ib] - values[ia]
        frame = pd.DataFrame(table)
        if metric is not None:
            order = frame[f"{metric}_delta"].abs().fillna(-1.0)
            frame = frame.assign(_order=order).sort_values(["_order", "example"], ascending=[False, True])
            frame = frame.drop(columns="_order").reset_index(drop=True)
        return frame

    def table(self, **kwargs: Any) -> Any:
        """The eval table widget (:class:`~mlora_lab.lab.evals.table.EvalTable`): the chosen models' outputs
        side by side with their scores and their change from a reference column, filters, sorting, the
        leaderboard and exports to CSV and HTML."""
        from mlora_lab.lab.evals.table import EvalTable

        return EvalTable(self, **kwargs)

    def plot(self, metric: str | None = None, ax: Any = None) -> Any:
        """A leaderboard: per metric (``metric``, default every one) an axes with a bar per model (a colour
        per model, the same in every axes) and its bootstrap interval as error bars, the axes laid out in
        a grid (:func:`leaderboard_grid`); a model whose result failed (:meth:`scores`' ``_failed``) is
        marked "failed" where its bar would be. With ``ax``, every metric's bars are grouped in that one
        axes. Returns the matplotlib ``Figure``."""
        from mlora_lab.lab.plotting import LabFigure

        metrics = [metric] if metric is not None else self.metrics
        scores = self.scores()
        if ax is not None:
            self._bars(ax, scores, metrics)
            ax.set_title(f"evaluation {self.name!r}: {self.meta.examples} examples")
            return ax.figure
        rows, cols, size = leaderboard_grid(len(self.models), len(metrics))
        fig = LabFigure(figsize=size)
        for k, m in enumerate(metrics):
            axes = fig.add_subplot(rows, cols, k + 1)
            self._bars(axes, scores, [m])
            axes.set_title(m)
            if k % cols:  # (the first column's label names them all)
                axes.set_ylabel("")
        fig.suptitle(f"evaluation {self.name!r}: {self.meta.examples} examples")
        return fig

    def _bars(self, ax: Any, scores: pd.DataFrame, metrics: list[str]) -> None:
        """``metrics``' bars in ``ax``: one metric a bar per model in the model's colour; several grouped
        by model, a colour per metric with a legend."""
        from mlora_lab.lab.plotting import PALETTE

        width = 0.8 / max(1, len(metrics))
        x = np.arange(len(self.models))
        for j, m in enumerate(metrics):
            mean = scores[m].to_numpy(dtype=float)
            err = np.vstack(
                [mean - scores[f"{m}_low"].to_numpy(float), scores[f"{m}_high"].to_numpy(float) - mean]
            )
            at = x + (j - (len(metrics) - 1) / 2) * width
            colors = (
                [PALETTE[i % len(PALETTE)] for i in range(len(self.models))]
                if len(metrics) == 1
                else PALETTE[j % len(PALETTE)]
            )
            ax.bar(at, np.nan_to_num(mean), width, yerr=np.nan_to_num(err), capsize=3, label=m, color=colors)
            failed = scores.get(f"{m}_failed")
            for i, model in enumerate(self.models):
                if failed is not None and isinstance(failed[model], str):
                    ax.text(at[i], 0, "failed", rotation=90, ha="center", va="bottom", color="#c0392b",
                            fontsize="small")  # fmt: skip
        values = scores[[m for m in metrics] + [f"{m}_high" for m in metrics]].to_numpy(dtype=float)
        finite = values[np.isfinite(values)]
        if finite.size and finite.min() >= 0 and finite.max() <= 1:  # (a share: its whole range)
            ax.set_ylim(0, 1.05)
        ax.set_xticks(x, self.models, rotation=20 if len(self.models) <= 8 else 60, ha="right")
        ax.set_ylabel("score (95% bootstrap interval)")
        if len(metrics) > 1:
            ax.legend(frameon=False, fontsize="small")


LEADERBOARD_MAX_WIDTH = 13.0
"""A leaderboard figure's widest (inches): about a notebook's width at its display resolution."""


def leaderboard_grid(models: int, metrics: int) -> tuple[int, int, tuple[float, float]]:
    """``(rows, cols, (width, height))`` of a leaderboard of ``metrics`` axes with ``models`` bars each:
    an axes is ``1 + 0.5·models`` inches wide (3 to 7), as many side by side as fit in
    :data:`LEADERBOARD_MAX_WIDTH` (at most 3), the rest in more rows of 2.9 inches. So 6 models × 3 metrics
    is one row of three 4-inch axes, 7 metrics three rows, 30 models one axes a row."""
    axes_width = min(7.0, max(3.0, 1.0 + 0.5 * models))
    cols = max(1, min(metrics, 3, int(LEADERBOARD_MAX_WIDTH // axes_width)))
    rows = -(-max(1, metrics) // cols)
    return rows, cols, (cols * axes_width, 0.4 + 2.9 * rows)


def _episodes_apart(rows: list[EvalExample]) -> tuple[list[EvalExample], list[dict[str, Any] | None]]:
    """``(rows, episodes)``: each row without its episode among its columns (the eval table shows an example's
    columns once per example; an episode is its row's own), and that episode (``None``: none)."""
    import msgspec

    if not any(is_episode(r.columns.get(EPISODE_COLUMN)) for r in rows):
        return rows, [None] * len(rows)
    out, episodes = [], []
    for r in rows:
        episode = r.columns.get(EPISODE_COLUMN)
        if not is_episode(episode):
            out.append(r)
            episodes.append(None)
            continue
        columns = {k: v for k, v in r.columns.items() if k != EPISODE_COLUMN}
        out.append(msgspec.structs.replace(r, columns=columns))
        episodes.append(episode)
    return out, episodes


def _num(v: float | None) -> float:
    return float("nan") if v is None else float(v)


def load_evaluation(run: RunLike, name: str) -> Evaluation:
    """Evaluation ``name`` saved in ``run`` (``<run>/evals/<name>/``): the same tables after a restart."""
    (r,) = as_runs(run)
    meta, rows = read_eval(r.path, name)
    return Evaluation(meta, rows, folder=Path(r.path) / "evals" / name)


def evaluations(run: RunLike | str | os.PathLike) -> list[str]:
    """The names of ``run``'s saved evaluations, oldest first."""
    (r,) = as_runs(run)
    return list_evals(r.path)
