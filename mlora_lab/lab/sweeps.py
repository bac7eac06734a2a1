"""Hyperparameter search in one job, from the notebook: ``ml.sweep`` launches it, :class:`SweepRun` follows it.

    space = {"lr": ml.loguniform(1e-4, 1e-2), "rank": ml.choice(4, 8, 16),
             "target_modules": ml.choice(["q_proj", "v_proj"], "all-linear")}
    sweep = ml.sweep(spec, space, ml.ASHA(n=16, min_steps=20, eta=3), budget=180)   # returns at once
    sweep.dashboard()          # the run's live dashboard and the trials table
    sweep.results()            # one row per trial: config, state, rung, objective
    sweep.best()               # {"trial", "tenant", "config", "objective", "adapter"}

The trials are tenants of one job (the base tenant, ``spec.tenants[0]`` unless ``base`` is given, with a
trial's configuration): no process start, model load or idle device between trials. The decisions are
the job's; this side only reads ``sweep.json`` and ``search.json`` (:class:`~mlora_lab.lab.runs.sweep.SweepRun`).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlora_lab.lab.launch import launch, refuse_unknown_keywords
from mlora_lab.lab.runs.run import DEFAULT_WORKDIR
from mlora_lab.lab.runs.sweep import SweepRun
from mlora_lab.search import Objective, Strategy, Sweep, asha_warning, dist_from_dict
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant


def objective_reference(objective: str | Callable) -> str:
    """The name the job imports an objective by: a built-in metric's name, ``"module:function"``, or a
    function defined in an importable module (not in a notebook: the job could not import it)."""
    if isinstance(objective, str):
        return objective
    module, name = getattr(objective, "__module__", None), getattr(objective, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise SpecError(
            [
                f"objective {name or objective!r} is defined in the notebook; the job imports its objective, "
                "so define it in a module on the job's Python path (or use 'eval_loss' / 'train_loss')"
            ]
        )
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    if found is not objective:
        raise SpecError([f"objective {module}:{name} cannot be imported back by that name"])
    return f"{module}:{name}"


def sweep(
    spec: JobSpec,
    space: dict[str, Any],
    strategy: Strategy,
    budget: int | None = None,
    *,
    base: Tenant | None = None,
    seed: int = 0,
    objective: str | Callable = "eval_loss",
    mode: str = "min",
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str = "local",
    slurm: Any = None,
    **options: Any,
) -> SweepRun:
    """Launch one job that searches ``space`` with ``strategy`` and return its :class:`SweepRun` at once.

    ``base``: the tenant every trial starts from (default ``spec.tenants[0]``, which then is not trained
    itself; the job's other tenants train alongside the trials). ``budget``: the most tenant steps a
    trial trains (default: the base tenant's ``max_steps``). ``objective``: ``"eval_loss"`` (the held-out loss:
    the base needs ``heldout_data``; else the train loss is used), ``"train_loss"``, or a function of a trial's
    metrics rows defined in an importable module; ``mode`` ``"min"`` or ``"max"``. The job's free slots
    (``max_tenants`` minus its other tenants) are the trials running at once. Every value the space
    can give a trial is checked before anything starts (:func:`~mlora_lab.validate.sweep_problems`).
    ``launcher`` and its options (``slurm=ml.SlurmOptions(...)``, ``ray=ml.RayOptions(...)``) as for
    :func:`~mlora_lab.lab.launch.launch`."""
    refuse_unknown_keywords("sweep", options)
    tenants = list(spec.tenants)
    if base is None:
        if not tenants:
            raise SpecError(["ml.sweep needs a base tenant: base=ml.Tenant(...) or the job's first tenant"])
        base = tenants.pop(0)
    space = {name: dist_from_dict(d) for name, d in space.items()}
    budget = base.max_steps if budget is None else budget
    note = asha_warning(strategy, budget)
    if note is not None:  # a valid search that will not do what its settings suggest: say so before it runs
        warnings.warn(note, stacklevel=2)
    plan = Sweep(
        base=base,
        space=space,
        strategy=strategy,
        budget=budget,
        seed=seed,
        objective=Objective(objective_reference(objective), mode),
    )
    named = dataclasses.replace(spec, tenants=tenants, name=spec.name or f"{base.name} sweep")
    run = launch(named, workdir, launcher, slurm=slurm, sweep=plan, **options)
    # (its directory has a sweep.json: the launch already handed back a SweepRun, mlora_lab.lab.runs.attach)
    return run if isinstance(run, SweepRun) else SweepRun(run.path, process=run.process)
