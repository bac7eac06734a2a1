"""Checks of a sweep (:class:`~mlora_lab.search.Sweep`) before it starts: the search itself, the job
with the base tenant as a trial, and the tenant every choice and both ends of every range would give.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlora_lab.search import is_eval_score
from mlora_lab.spec.fields import Problem
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Eval
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import is_int
from mlora_lab.validate.context import ValidationCache, capped
from mlora_lab.validate.validator import Validator


def _representative_configs(space: dict[str, Any]) -> list[dict[str, Any]]:
    """Configurations that between them take every choice and both ends of every range, each field
    varied from the first configuration (for checking every value a search can give a tenant)."""
    from mlora_lab.search import Choice

    def values(d: Any) -> list[Any]:
        if isinstance(d, Choice):
            return [list(v) if isinstance(v, tuple) else v for v in d.values]
        return [d.low, d.high]

    first = {name: values(d)[0] for name, d in space.items()}
    configs = [first]
    for name, d in space.items():
        for v in values(d)[1:]:
            configs.append({**first, name: v})
    return configs[:64]


def sweep_slot_modules(spec: JobSpec, sweep: Any) -> list[str]:
    """The slot modules a sweep's job needs: the union of the job's tenants', the base tenant's and
    every ``target_modules`` choice of the space (unless the job names its own)."""
    if spec.slot_modules is not None:
        return list(spec.slot_modules)
    names: list[str] = []
    targets = [t.target_modules for t in spec.tenants] + [sweep.base.target_modules]
    space_targets = sweep.space.get("target_modules")
    if space_targets is not None and hasattr(space_targets, "values"):
        targets += [list(v) for v in space_targets.values]
    for group in targets:
        for name in group if isinstance(group, list | tuple) else [group]:
            if name not in names:
                names.append(name)
    return names


def sweep_problems(spec: JobSpec, sweep: Any, cache: ValidationCache | None = None) -> list[Problem]:
    """Every problem of running ``sweep`` (a :class:`~mlora_lab.search.Sweep`) in the job ``spec``, at
    once: the search itself (:func:`~mlora_lab.search.search_problems`), its objective function (imported:
    it must be a Python function), the job with the base tenant as a trial, and the tenant every choice and
    both ends of every range would give (a rank above ``max_rank``, an lr past the bound, target modules the
    model lacks, a data file that cannot be read, ...)."""
    from mlora_lab.search import search_problems

    slots = (spec.max_tenants if is_int(spec.max_tenants) else 0) - (
        len(spec.tenants) if isinstance(spec.tenants, list) else 0
    )
    max_rank = spec.max_rank if is_int(spec.max_rank) else 0
    out = [
        Problem(None, "search", p)
        for p in search_problems(sweep.space, sweep.strategy, sweep.budget, sweep.objective, slots, max_rank)
    ]
    if not sweep.objective.problems():
        try:  # what the job will call: a Python function of a trial's rows (never sys:exit or a class)
            sweep.objective.function()
        except ValueError as e:
            out.append(Problem(None, "objective", str(e)))
    metric = sweep.objective.metric
    if is_eval_score(metric):
        named = [e.name for e in spec.evals if isinstance(e, Eval)] if isinstance(spec.evals, list) else []
        if metric.split("/")[1] not in named:
            out.append(
                Problem(None, "objective", f"objective {metric!r}: the job has no evaluation "
                        f"{metric.split('/')[1]!r} (JobSpec.evals: {', '.join(named) or 'none'})")
            )  # fmt: skip
    out += [Problem(None, "search", p) for p in sweep.nested_problems()]
    if any(p.field == "search" for p in out):
        return out
    validator = Validator(cache or ValidationCache())
    configs = _representative_configs(sweep.space)
    job = dataclasses.replace(spec, slot_modules=sweep_slot_modules(spec, sweep))
    first = sweep.trial_tenant(0, configs[0])
    out += validator.problems(dataclasses.replace(job, tenants=[*spec.tenants, first]))
    seen = {str(p) for p in out}
    for i, config in enumerate(configs[1:], start=1):
        for p in validator.tenant_problems(job, sweep.trial_tenant(i, config)):
            text = str(p).replace(f"trial {sweep.prefix}{i:03d}", "a trial")
            if text not in seen:  # the same problem from several values is said once
                seen.add(text)
                out.append(p)
    return capped(out)


def job_of_sweep(spec: JobSpec, sweep: Any) -> JobSpec:
    """The job of a sweep's run directory as it is checked again when it starts or resumes: job.json lists
    each trial the job started (the notebook's views read a trial's settings there), but trials take the
    sweep's slots and were checked with the sweep at launch (:func:`sweep_problems`). So only the job's own
    tenants are checked (an ASHA search of 6 trials on 3 slots is not "6 tenants but max_tenants=3"), and
    the job may have none: it waits for its trials."""
    tenants = spec.tenants
    if isinstance(tenants, list):
        tenants = [
            t
            for t in tenants
            if not (isinstance(t, Tenant) and isinstance(t.name, str) and sweep.trial_id(t.name) is not None)
        ]
    return dataclasses.replace(spec, tenants=tenants, stay_up=True)
