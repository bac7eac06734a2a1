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

from mlora_lab.rundir import RunDir, atomic_write_bytes
from mlora_lab.sources import memory_kind, snapshot
from mlora_lab.spec import JobSpec, Tenant

SPLITS = {"data": "train", "eval_data": "eval"}
"""The tenant fields that hold rows, and the name of the file each is written to."""


def freeze(tenant: Any) -> Any:
    """``tenant`` with each in-memory source replaced by its :class:`~mlora_lab.sources.Snapshot` (the
    same tenant when it holds none; anything that is not a Tenant as it is)."""
    if not isinstance(tenant, Tenant):
        return tenant
    changes = {name: snapshot(getattr(tenant, name)) for name in SPLITS if memory_kind(getattr(tenant, name))}
    return dataclasses.replace(tenant, **changes) if changes else tenant


def freeze_all(spec: JobSpec) -> JobSpec:
    """``spec`` with every tenant :func:`frozen <freeze>`."""
    if not isinstance(spec.tenants, list):
        return spec
    frozen = [freeze(t) for t in spec.tenants]
    same = all(a is b for a, b in zip(frozen, spec.tenants))
    return spec if same else dataclasses.replace(spec, tenants=frozen)


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
    return dataclasses.replace(tenant, **changes) if changes else tenant


def write_all(run: RunDir, spec: JobSpec) -> JobSpec:
    """``spec`` with every tenant's in-memory sources written into ``run`` (:func:`write_data`)."""
    if not isinstance(spec.tenants, list):
        return spec
    return dataclasses.replace(spec, tenants=[write_data(run, t) for t in spec.tenants])
