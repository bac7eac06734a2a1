"""An evaluation's numbers: per-example scores and their bootstrap intervals (numpy only: the job logs
them between steps, the lab shows them in tables).

Example ``e``'s score by model ``m`` for a metric is the mean of its samples' scores (``None``, not scored,
left out); a model's score is the mean over the examples it has one for. Its interval is the percentile
bootstrap over examples: ``B`` resamples of the ``E`` examples with replacement, the SAME resamples for every
model (paired: two models' intervals come from the same draws), and the ``(1 - c)/2`` and ``(1 + c)/2``
percentiles of the resampled means.

Means are taken in float64 and scaled, ``mean(x) = s · mean(x / s)`` with ``s`` a power of two near
``max |x|`` when that is past 2**1000: the mean of finite scores lies between the smallest and the largest
of them, so it is finite, where a plain sum of two scores of 1e308 is already inf (and the percentiles of
infs are NaN). A model whose mean or interval is still not
a finite number (a score of inf, which the metrics' worker refuses but an evaluation made in memory may
hold) is a named failure of that metric (:func:`failures`), never a silent NaN.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from mlora_lab.rundir.evals import EvalExample

_BIG = 2.0**1000
"""Scores up to here are averaged as they are: fewer than 2**23 of them cannot sum past float64's largest
number (about 2**1024)."""


def _scale(top: np.ndarray) -> np.ndarray:
    """What to divide scores by, from their largest ``|score|``: 1 below :data:`_BIG` (the results are
    then bit for bit the plain ones), else a power of two that brings it below 2 (dividing by one only
    moves exponents: exact); inf kept (an infinite score: the mean is not finite, a failure)."""
    exponent = np.frexp(np.where(np.isfinite(top), top, 1.0))[1]  # top = f * 2**exponent, 0.5 <= f < 1
    power = np.ldexp(1.0, np.maximum(exponent - 1, 0))
    return np.where(np.isinf(top), top, np.where(np.isfinite(top) & (top >= _BIG), power, 1.0))


def scaled_mean(values: np.ndarray, axis: int) -> np.ndarray:
    """``nanmean(values, axis)`` that cannot overflow: each slice scaled by its largest ``|value|`` first
    (:func:`_scale`; NaN ignored; a slice of NaN only is NaN; a slice holding an inf is not finite)."""
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # ("mean of empty slice", "all-NaN slice")
        scale = _scale(np.nanmax(np.abs(values), axis=axis, keepdims=True))
        return np.squeeze(np.nanmean(values / scale, axis=axis, keepdims=True) * scale, axis=axis)


def per_example(rows: Sequence[EvalExample], models: Sequence[str], metric: str, examples: int) -> np.ndarray:
    """``[models, examples]``: each example's mean score over its samples (NaN: none scored; an infinite
    score is kept, so that its model's result fails by name rather than leave it out unseen)."""
    index = {m: i for i, m in enumerate(models)}
    cells: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        v = r.scores.get(metric)
        if v is not None and not math.isnan(v) and r.model in index:
            cells.setdefault((index[r.model], r.example), []).append(float(v))
    out = np.full((len(models), examples), np.nan)
    for (m, e), scores in cells.items():
        total = sum(scores)  # (inf or NaN: an infinite score, or a sum past the largest float)
        if math.isfinite(total):
            out[m, e] = total / len(scores)
        elif not all(map(math.isfinite, scores)):
            out[m, e] = math.inf
        else:  # (finite scores whose sum overflows: rare, so the scaled mean only here)
            out[m, e] = scaled_mean(np.array(scores), axis=0)
    return out


def bootstrap(
    values: np.ndarray, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(mean, low, high, n)`` per row of ``values [models, examples]`` (NaN ignored; ``n`` the examples
    scored), the interval by the paired percentile bootstrap of the module docstring, in float64 and
    scaled (:func:`_scale`: the percentiles interpolate between numbers below 2, and the results are at
    most a model's largest ``|score|``)."""
    values = np.asarray(values, dtype=np.float64)
    models, examples = values.shape
    n = (~np.isnan(values)).sum(axis=1)
    if examples == 0:
        empty = np.full(models, np.nan)
        return empty, empty.copy(), empty.copy(), n
    draws = np.random.default_rng(seed).integers(0, examples, size=(resamples, examples))
    tail = (1 - confidence) / 2 * 100
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # ("mean of empty slice": a model with no score)
        scale = _scale(np.nanmax(np.abs(values), axis=1))
        unit = values / scale[:, None]  # [models, examples], each |value| <= 1
        mean = np.nanmean(unit, axis=1) * scale
        boot = np.nanmean(unit[:, draws], axis=2)  # [models, resamples]
        low = np.nanpercentile(boot, tail, axis=1) * scale
        high = np.nanpercentile(boot, 100 - tail, axis=1) * scale
    return mean, low, high, n


def failures(
    metric: str,
    models: Sequence[str],
    mean: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    n: np.ndarray,
) -> dict[str, str]:
    """``{model: why}`` for each model with scores (``n > 0``) whose mean or interval (:func:`bootstrap`'s)
    is not a finite number: that metric failed for that model. A model without scores is not a failure
    (its NaN means "none scored")."""
    out = {}
    for i, model in enumerate(models):
        got = (float(mean[i]), float(low[i]), float(high[i]))
        if n[i] > 0 and not all(math.isfinite(v) for v in got):
            out[model] = (
                f"metric {metric!r} failed for model {model!r}: its mean over {int(n[i])} examples "
                f"({got[0]:.6g}, interval {got[1]:.6g} to {got[2]:.6g}) is not a finite number "
                "(a score is infinite)"
            )
    return out
