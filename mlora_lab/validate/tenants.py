"""Tenant names and the set of tenants: a name is a safe directory name; the set is not empty (unless
the job waits for tenants), fits ``max_tenants``, and holds no name twice, even up to case (on macOS
and Windows ``adapters/alice`` and ``adapters/Alice`` are one directory). No file is read.
"""

from __future__ import annotations

import collections
from typing import Any

from mlora_lab.spec.fields import MAX_NAME_LEN, SAFE_NAME, Problem
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, is_int
from mlora_lab.validate.context import Context, case_problem, got, tenant_problem


def check_name(ctx: Context, name: Any) -> bool:
    """A tenant's name: a string of 1 to ``MAX_NAME_LEN`` characters of ``[A-Za-z0-9._-]``, not ``.``
    or ``..`` (it becomes ``adapters/<name>/``); whether it is one."""
    if not isinstance(name, str):
        ctx.say(None, "name", f"tenant name must be a string ({got(name)})")
        return False
    why = ""
    if not name:
        why = "it is empty"
    elif name in (".", ".."):
        why = f"{name!r} is not allowed"
    elif len(name) > MAX_NAME_LEN:
        why = f"it is {len(name):,} characters long (at most {MAX_NAME_LEN})"
    elif not SAFE_NAME.fullmatch(name):
        bad = "".join(sorted({c for c in name if not SAFE_NAME.fullmatch(c)}))
        why = f"it contains {brief(bad)}"
    if why:
        ctx.add(
            tenant_problem(
                name,
                "name",
                f"name is not a safe directory name ({why}); "
                f"use 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ -",
            )
        )
    return not why


def check_tenant_set(ctx: Context, tenants: list[Any]) -> None:
    """The tenants as a set: at least one (or ``serve``, or a ``service``), at most ``max_tenants``, unique names, and no
    two names equal up to case."""
    s = ctx.spec
    if not tenants and s.stay_up is not True and s.service is None:
        ctx.say(
            None,
            "tenants",
            "no tenants: add at least one, set stay_up=true to wait for tenants, or serve the Tinker API (service)",
        )
    if is_int(s.max_tenants) and len(tenants) > s.max_tenants:
        ctx.say(
            None,
            "max_tenants",
            f"{len(tenants)} tenants but max_tenants={brief(s.max_tenants)}; raise max_tenants",
        )
    names = [t.name for t in tenants if isinstance(t, Tenant) and isinstance(t.name, str)]
    counts = collections.Counter(names)  # not names.count(): quadratic in a hostile tenant list
    for dup in sorted(n for n, c in counts.items() if c > 1):
        ctx.say(
            None, "tenants", f"tenant name {brief(dup)} is used {counts[dup]} times; names must be unique"
        )
    # Equal up to case: two directories on a case-sensitive filesystem, one on macOS / Windows.
    first: dict[str, str] = {}
    for name in counts:
        other = first.setdefault(name.lower(), name)
        if other != name:
            ctx.add(case_problem(name, other))


def existing_name_problems(job: JobSpec, tenant: Tenant) -> list[Problem]:
    """Problems of ``tenant``'s name in the running job ``job``: names are never reused (job.json lists
    every tenant the run has had, removed ones included), and a name equal up to case collides with
    that tenant's adapter directory."""
    out: list[Problem] = []
    if not (isinstance(tenant.name, str) and isinstance(job.tenants, list)):
        return out
    for other in job.tenants:
        name = other.name if isinstance(other, Tenant) else None
        if name == tenant.name:
            out.append(
                Problem(
                    tenant.name,
                    "name",
                    "a tenant of that name already exists in this run (names are never reused)",
                )
            )
        elif isinstance(name, str) and name.lower() == tenant.name.lower():
            out.append(case_problem(tenant.name, name, existing=True))
    return out
