"""Evaluations: adapters compared by what they do (:func:`mlora_lab.evaluate`).

:mod:`~mlora_lab.evals.metrics` holds the built-in metrics (TRL's reward signature, so any reward is a
metric); :mod:`~mlora_lab.evals.generate` generates every model's completions in one batch and scores them.
The saved format is :mod:`mlora_lab.rundir.evals`'s; the tables and figures are the lab's
(:mod:`mlora_lab.lab.evals.evaluation`).
"""

from mlora_lab.evals import metrics

__all__ = ["metrics"]
