"""Hub ids in a spec (``base_model``, ``tokenizer``, ``init_adapter``): fetched before the checks that read them.

Validation runs in the notebook's process before anything starts, so this is where a Hub id is downloaded,
once, into the Hub cache (:func:`mlora_lab.hub.fetch`, with ``huggingface_hub``'s progress bars); the checks
after it read the cached snapshot like any local directory. An id that cannot be had is one problem naming it
(not on the Hub, gated, or offline and not cached), and the checks that would read it are skipped.
"""

from __future__ import annotations

import dataclasses

from mlora_lab import hub
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief
from mlora_lab.validate.context import Context


def fetch_hub_ids(ctx: Context, tenants: list[Tenant]) -> list[Tenant]:
    """Download the spec's Hub ids and point ``ctx.spec`` (a copy) at their snapshots; the tenants, with
    theirs. A failed one is said, and left empty so that no later check reports it again."""
    s = ctx.spec
    changes: dict[str, str] = {}
    # (the revision is the base's; a tokenizer of another repository is read at its main)
    ids = {field: value for field in ("base_model", "tokenizer") if hub.is_hub_id(value := getattr(s, field))}
    uses = [f for f in ids if s.revision is not None and (f == "base_model" or s.tokenizer == s.base_model)]
    said = next((i for i, p in enumerate(ctx.out) if p.tenant is None and p.field == "revision"), None)
    why = hub.revision_problem(s.revision)
    if uses and (said is not None or why is not None):
        # one problem for a revision that is none: the field check's (empty, a line break, ...) or, for what
        # it lets through (a space, "..", a character Git refuses), this one; it names the ids it is the
        # revision of, none of which is asked for
        named = ", ".join(dict.fromkeys(ids[f] for f in uses))
        whose = f"(the Hub revision of {' and '.join(uses)} {named}: not asked for)"
        if said is not None:
            ctx.out[said] = dataclasses.replace(ctx.out[said], message=f"{ctx.out[said].message} {whose}")
        else:
            ctx.say(None, "revision", f"revision {brief(s.revision)} {why} {whose}")
        changes.update(dict.fromkeys(uses, ""))  # ("": skipped by the checks that read it)
    for field, value in ids.items():
        if field in changes:
            continue
        path, why = _fetch(ctx, value, s.revision if field in uses else None)
        if why is not None:
            ctx.say(None, field, f"{field} {why}")
        changes[field] = "" if path is None else str(path)  # ("": skipped by the checks that read it)
    out = []
    for t in tenants:
        if hub.is_hub_id(t.init_adapter):
            path, why = _fetch(ctx, t.init_adapter, None, adapter=True)
            if why is not None:
                ctx.say(t, "init_adapter", f"init_adapter {why}")
            t = dataclasses.replace(t, init_adapter="" if path is None else str(path))
        out.append(t)
    if changes or out != tenants:
        ctx.spec = dataclasses.replace(s, **changes, tenants=out)
    return out


def _fetch(
    ctx: Context, repo_id: str, revision: str | None, adapter: bool = False
) -> tuple[str | None, str | None]:
    """:func:`mlora_lab.hub.fetch`, remembered by the validation cache once it succeeded."""
    key = (repo_id, revision, adapter)
    if ctx.cache is not None and key in ctx.cache.hub:
        return ctx.cache.hub[key], None
    path, why = hub.fetch(repo_id, revision, adapter=adapter)
    if path is not None and ctx.cache is not None:
        ctx.cache.hub[key] = str(path)
    return (None if path is None else str(path)), why
