"""Rows a tenant holds in memory, into the run directory: what a launch, a sweep and ``run.add_tenant`` do
before job.json (or a control message) names the tenant's data.

    tenant = freeze(tenant)             # each in-memory source read once, into a Snapshot (validated next)
    tenant = write_data(run, tenant)    # each snapshot written as data/<tenant>/<split>.jsonl, and named

A DataFrame (a list of dicts, a datasets.Dataset) is read exactly once, when it is frozen: the rows
validated are the rows written, and the job and every resume read that file, whatever the notebook does
with the DataFrame afterwards. Paths and values that are no source are left as they are (the validator
reports those).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlora_lab.rl.rewards import reward_names
from mlora_lab.rundir import RunDir, atomic_write_bytes
from mlora_lab.rundir.evals import eval_dir
from mlora_lab.sources import RewardSnapshot, memory_kind, reward_in_memory, snapshot
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL, Eval
from mlora_lab.spec.tenant import Tenant

SPLITS = {"data": "train", "heldout_data": "eval"}
"""The tenant fields that hold rows, and the name of the file each is written to (``data/<tenant>/eval.jsonl``
for the held-out rows: the run directory's layout keeps the name older runs have)."""


def freeze(tenant: Any) -> Any:
    """``tenant`` with each in-memory source replaced by its :class:`~mlora_lab.sources.Snapshot`, and each
    reward function held in memory by its :class:`~mlora_lab.sources.RewardSnapshot` (pickled now: one that
    cannot be is left for the validator to name), its ``rl.reward_names`` filled from the functions when not
    given (:func:`~mlora_lab.rl.rewards.reward_names`); the same tenant when it holds none; anything that is
    not a Tenant as it is."""
    if not isinstance(tenant, Tenant):
        return tenant
    changes: dict[str, Any] = {
        name: snapshot(getattr(tenant, name)) for name in SPLITS if memory_kind(getattr(tenant, name))
    }
    rl = tenant.rl
    if isinstance(rl, RL) and _well_formed(rl) and any(reward_in_memory(v) for _, _, v in rl.functions):
        changes["rl"] = dataclasses.replace(
            rl.with_functions([(role, i, _pickled(v)) for role, i, v in rl.functions]),
            # (named while they are functions: a pickle's name cannot tell two lambdas apart)
            reward_names=rl.reward_names
            if rl.reward_names is not None or not rl.rewards
            else reward_names(rl.rewards),
        )
    return dataclasses.replace(tenant, **changes) if changes else tenant


def _well_formed(rl: RL) -> bool:
    """Whether ``rl``'s function fields have their shapes (else validation names them; nothing is pickled)."""
    return isinstance(rl.tools, list | tuple) and (
        rl.reward is None or isinstance(rl.reward, list | tuple | str) or reward_in_memory(rl.reward)
    )


def _pickled(reward: Any) -> Any:
    if not reward_in_memory(reward) or isinstance(reward, RewardSnapshot):
        return reward
    try:
        return RewardSnapshot.of(reward)
    except Exception:  # (the validator says why: it tries again)
        return reward


def freeze_all(spec: JobSpec) -> JobSpec:
    """``spec`` with every tenant :func:`frozen <freeze>`, and every evaluation's rows and metrics held in
    memory frozen the same way."""
    if isinstance(spec.evals, list) and spec.evals:
        spec = dataclasses.replace(spec, evals=[_freeze_eval(e) for e in spec.evals])
    if not isinstance(spec.tenants, list):
        return spec
    frozen = [freeze(t) for t in spec.tenants]
    same = all(a is b for a, b in zip(frozen, spec.tenants))
    return spec if same else dataclasses.replace(spec, tenants=frozen)


def _freeze_eval(e: Any) -> Any:
    if not isinstance(e, Eval):
        return e
    data = snapshot(e.data) if memory_kind(e.data) else e.data
    metrics = [_pickled(m) for m in e.metrics] if isinstance(e.metrics, list | tuple) else e.metrics
    return dataclasses.replace(e, data=data, metrics=metrics)


def write_evals(run: RunDir, spec: JobSpec) -> JobSpec:
    """``spec`` with each evaluation's in-memory rows written into ``<run>/evals/<name>/data.jsonl`` and its
    pickled metrics into ``<run>/evals/<name>/metrics/`` (the evaluation keeps what it was scored with)."""
    if not isinstance(spec.evals, list) or not spec.evals:
        return spec
    out = []
    for e in spec.evals:
        if not isinstance(e, Eval):
            out.append(e)
            continue
        folder = eval_dir(run.root, e.name)
        data = e.data
        if memory_kind(data):
            atomic_write_bytes(folder / "data.jsonl", snapshot(data).jsonl(), root=run.root)
            data = str(folder / "data.jsonl")
        metrics = []
        for i, m in enumerate(e.metrics):
            if isinstance(m, RewardSnapshot):
                path = folder / "metrics" / f"{i}-{m.name}.pkl"
                atomic_write_bytes(path, m.data, root=run.root)
                m = f"{path}:{m.name}"
            metrics.append(m)
        out.append(dataclasses.replace(e, data=data, metrics=metrics))
    return dataclasses.replace(spec, evals=out)


def write_data(run: RunDir, tenant: Any) -> Any:
    """``tenant`` with each in-memory source written into ``run`` (``data/<name>/train.jsonl`` and
    ``eval.jsonl``, atomically, through no link planted there) and replaced by that file's path. The
    tenant must have passed validation: its name names a directory and every row reads."""
    if not isinstance(tenant, Tenant):
        return tenant
    changes = {}
    for name, split in SPLITS.items():
        value = getattr(tenant, name)
        if memory_kind(value) is None:
            continue
        path = run.tenant_data(tenant.name, split)
        atomic_write_bytes(path, snapshot(value).jsonl(), root=run.root)
        changes[name] = str(path)
    rl = tenant.rl
    if (
        isinstance(rl, RL)
        and _well_formed(rl)
        and any(isinstance(v, RewardSnapshot) for _, _, v in rl.functions)
    ):
        refs = []
        for role, i, v in rl.functions:  # (an agent's env and tools are pickled as reward functions are)
            if isinstance(v, RewardSnapshot):
                path = run.reward(tenant.name, i, v.name, role=role)
                atomic_write_bytes(path, v.data, root=run.root)
                v = f"{path}:{v.name}"
            refs.append((role, i, v))
        changes["rl"] = rl.with_functions(refs)
    return dataclasses.replace(tenant, **changes) if changes else tenant


def write_all(run: RunDir, spec: JobSpec) -> JobSpec:
    """``spec`` with every tenant's in-memory sources written into ``run`` (:func:`write_data`)."""
    if not isinstance(spec.tenants, list):
        return spec
    return dataclasses.replace(spec, tenants=[write_data(run, t) for t in spec.tenants])
