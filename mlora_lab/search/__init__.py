"""Hyperparameter search inside one job: the search space, the strategies and their decisions.

Tenants are the trials. A search decides, at step boundaries, which trial starts in a free tenant slot,
which one stops, which one continues, and (PBT) which one takes over another's weights. This module is
the decision engine only: pure Python, seeded, no torch, its whole state JSON; the job applies its
actions to tenant slots (:mod:`mlora_lab.job.search`) and the notebook reads its state.

Strategies (``budget`` = the most tenant steps any trial trains, ``R``):

* :class:`Grid` / :class:`Random` ``(n)``: every trial trains ``R`` steps; trials start as slots free up.
* :class:`ASHA` ``(n, min_steps=r, eta=η)``: asynchronous successive halving (Li et al., "A System for
  Massively Parallel Hyperparameter Tuning", MLSys 2020, Algorithm 2). Rungs at ``r, rη, rη², …`` tenant
  steps, capped by ``R`` (the top rung). A trial trains to its rung and reports the objective there.
  Whenever a slot is free, ``get_job`` looks from the highest rung down for a trial in the top
  ``⌊|rung k| / η⌋`` of rung ``k`` that was not promoted from it yet, and promotes the best such trial to
  rung ``k + 1`` (it continues from where it stopped, its state kept while it waited); if none, a new
  trial starts at rung 0. Nobody waits for a rung to fill. A trial that is never promoted is *pruned*.
* :class:`PBT` ``(population, interval)``: population-based training (Jaderberg et al. 2017) with
  truncation selection. Every ``interval`` tenant steps a member reports; if its latest objective is in
  the bottom ``quantile`` of the population's latest objectives, it *exploits* a member drawn from the
  top ``quantile`` (copies its adapter, optimiser state and step) and *explores* (each searched value
  multiplied by a factor drawn from ``perturb``, clipped to its range; a choice resampled with
  probability ``resample``). Only optimiser settings can be searched by PBT (weights are copied between
  members, so their shapes must agree).

The objective is ``eval_loss`` (the held-out loss: a trial with ``heldout_data`` is measured when it reports), ``train_loss``
(the mean of its last ``window`` logged train losses) or ``"module:function"``, a function of the
trial's metrics rows the job imports; ``mode`` is ``min`` or ``max``.

Determinism: the configurations come from ``random.Random(seed)``, and every decision is a function of
the reports in the order they arrive (the job reports in trial order at each step boundary), so the
same seed and the same metrics give the same trials and the same decisions, also across a stop and
resume (the state, the generator's included, is in every checkpoint).
"""

from __future__ import annotations

from mlora_lab.search.engine import Action, ActionOp, Search, Trial, TrialState
from mlora_lab.search.space import (
    ASHA,
    MAX_TRIALS,
    PBT,
    PBT_SEARCHABLE,
    SEARCHABLE,
    Choice,
    Distribution,
    Grid,
    IntUniform,
    LogUniform,
    Objective,
    Random,
    Strategy,
    Uniform,
    asha_reach,
    asha_rungs,
    asha_warning,
    choice,
    dist_from_dict,
    dist_to_dict,
    grid_size,
    is_eval_score,
    loguniform,
    randint,
    search_problems,
    space_from_dict,
    space_to_dict,
    strategy_from_dict,
    strategy_to_dict,
    uniform,
)
from mlora_lab.search.sweep import Sweep

__all__ = [
    "ASHA",
    "MAX_TRIALS",
    "PBT",
    "PBT_SEARCHABLE",
    "SEARCHABLE",
    "Action",
    "ActionOp",
    "Choice",
    "Distribution",
    "Grid",
    "IntUniform",
    "LogUniform",
    "Objective",
    "Random",
    "Search",
    "Strategy",
    "Sweep",
    "Trial",
    "TrialState",
    "Uniform",
    "asha_reach",
    "asha_rungs",
    "asha_warning",
    "choice",
    "dist_from_dict",
    "dist_to_dict",
    "grid_size",
    "is_eval_score",
    "loguniform",
    "randint",
    "search_problems",
    "space_from_dict",
    "space_to_dict",
    "strategy_from_dict",
    "strategy_to_dict",
    "uniform",
]
