"""An evaluation's numbers: per-example scores and their bootstrap intervals (numpy only: the job logs
them between steps, the lab shows them in tables).

Example ``e``'s score by model ``m`` for a metric is the mean of its samples' scores (``None``, not scored,
left out); a model's score is the mean over the examples it has one for. Its interval is the percentile
bootstrap over examples: ``B`` resamples of the ``E`` examples with replacement, the SAME resamples for every
model (paired: two models' intervals come from the same draws), and the ``(1 - c)/2`` and ``(1 + c)/2``
percentiles of the resampled means.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from mlora_lab.rundir.evals import EvalExample


def per_example(rows: Sequence[EvalExample], models: Sequence[str], metric: str, examples: int) -> np.ndarray:
    """``[models, examples]``: each example's mean score over its samples (NaN: none scored)."""
    index = {m: i for i, m in enumerate(models)}
    total = np.zeros((len(models), examples))
    count = np.zeros((len(models), examples))
    for r in rows:
        v = r.scores.get(metric)
        if v is not None and np.isfinite(v) and r.model in index:
            total[index[r.model], r.example] += v
            count[index[r.model], r.example] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def bootstrap(
    values: np.ndarray, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(mean, low, high, n)`` per row of ``values [models, examples]`` (NaN ignored; ``n`` the examples
    scored), the interval by the paired percentile bootstrap of the module docstring."""
    models, examples = values.shape
    n = np.isfinite(values).sum(axis=1)
    if examples == 0:
        empty = np.full(models, np.nan)
        return empty, empty.copy(), empty.copy(), n
    draws = np.random.default_rng(seed).integers(0, examples, size=(resamples, examples))
    tail = (1 - confidence) / 2 * 100
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # ("mean of empty slice": a model with no score)
        mean = np.nanmean(values, axis=1)
        boot = np.nanmean(values[:, draws], axis=2)  # [models, resamples]
        low = np.nanpercentile(boot, tail, axis=1)
        high = np.nanpercentile(boot, 100 - tail, axis=1)
    return mean, low, high, n
