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

from mlora_lab.evals.scores import bootstrap, per_example
from mlora_lab.lab.handles import RunLike, as_runs
from mlora_lab.rundir.evals import EvalExample, EvalMeta, list_evals, read_eval


class Evaluation:
    """One evaluation: models × examples × samples, each completion with every metric's score."""

    def __init__(self, meta: EvalMeta, rows: list[EvalExample], folder: Path | None = None) -> None:
        self.meta, self.rows, self.folder = meta, rows, folder
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
        return (
            f"<Evaluation {self.name!r}: {len(self.models)} models × {self.meta.examples} examples"
            f" × {self.meta.num_samples} samples, metrics {', '.join(self.metrics)}{where}>"
        )

    # -- tables ----------------------------------------------------------------------------------
    def examples(self) -> pd.DataFrame:
        """One row per example, model and sample: ``example, model, sample, prompt, completion``, a column
        per metric (NaN: not scored), the example's other columns (its reference, ...), ``tokens`` and
        ``stop_reason``."""
        extra = list(dict.fromkeys(k for r in self.rows for k in r.columns))
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
            )
            for r in self.rows
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
        when ``num_samples > 1``, and ``n`` (examples). A row per model, in the evaluation's order."""
        table: dict[str, Any] = {"n": [self.meta.examples] * len(self.models)}
        for metric, values in self.per_example().items():
            mean, low, high, _ = bootstrap(values, resamples, confidence, seed)
            table[metric], table[f"{metric}_low"], table[f"{metric}_high"] = mean, low, high
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
        """The eval table widget (:class:`~mlora_lab.lab.evaltable.EvalTable`): the chosen models' outputs
        side by side with their scores and their change from a reference column, filters, sorting, the
        leaderboard and exports to CSV and HTML."""
        from mlora_lab.lab.evaltable import EvalTable

        return EvalTable(self, **kwargs)

    def plot(self, metric: str | None = None, ax: Any = None) -> Any:
        """A leaderboard: a bar per model for ``metric`` (default every metric, grouped), with its bootstrap
        interval as error bars. Returns the matplotlib ``Figure``."""
        from mlora_lab.lab.plotting import PALETTE, LabFigure

        metrics = [metric] if metric is not None else self.metrics
        scores = self.scores()
        if ax is None:
            fig = LabFigure(figsize=(max(4.0, 1.2 * len(self.models) * max(1, len(metrics))), 3.2))
            ax = fig.add_subplot(1, 1, 1)
        else:
            fig = ax.figure
        width = 0.8 / max(1, len(metrics))
        x = np.arange(len(self.models))
        for j, m in enumerate(metrics):
            mean = scores[m].to_numpy(dtype=float)
            err = np.vstack(
                [mean - scores[f"{m}_low"].to_numpy(float), scores[f"{m}_high"].to_numpy(float) - mean]
            )
            ax.bar(x + (j - (len(metrics) - 1) / 2) * width, mean, width, yerr=np.nan_to_num(err), capsize=3,
                   label=m, color=PALETTE[j % len(PALETTE)])  # fmt: skip
        values = scores[[m for m in metrics] + [f"{m}_high" for m in metrics]].to_numpy(dtype=float)
        finite = values[np.isfinite(values)]
        if finite.size and finite.min() >= 0 and finite.max() <= 1:  # (a share: its whole range)
            ax.set_ylim(0, 1.05)
        ax.set_xticks(x, self.models, rotation=20, ha="right")
        ax.set_ylabel("score (95% bootstrap interval)")
        ax.set_title(f"evaluation {self.name!r}: {self.meta.examples} examples")
        if len(metrics) > 1:
            ax.legend(frameon=False, fontsize="small")
        return fig


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
