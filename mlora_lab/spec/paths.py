"""Where a spec's paths point: relative paths made absolute against the directory of the file that names
them (``job.json``, ``sweep.json``), and written back relative to it, so a run directory that is copied or
moved still reads its own files.

    resolve_path(path, base)          a relative path (``~`` expanded) joined to ``base``; anything else kept
    resolve_model_path(value, base)   the same, except that a Hub id stays one unless a local path of its name exists
    resolve_reward(ref, base)         ``"file.py:function"`` with its file resolved; ``"module:function"`` kept
    resolve_tenant_paths(t, base)     a tenant's data, held-out data, init adapter and reward files, in place
    relative_tenant_paths(d, here)    a tenant's dict, its data files below ``here`` written relative to it
    path_str(value)                   ``os.PathLike`` -> ``str`` (what the dataclasses store)

Nothing here reads the disk but :func:`resolve_model_path` (whether a local directory shadows a Hub id), and
nothing names a dataclass: a tenant is anything with the fields :class:`TenantPaths` lists, so
:mod:`mlora_lab.spec.tenant` and :mod:`mlora_lab.spec.job` import this module, never the other way round.
Light contract: no torch.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from mlora_lab.hub import HUB_ID
from mlora_lab.spec.parts import RL

TENANT_FILES = ("data", "heldout_data")
"""A tenant's fields that name rows: what :func:`relative_tenant_paths` writes relative to ``job.json``."""


class TenantPaths(Protocol):
    """What :func:`resolve_tenant_paths` reads and sets of a tenant (:class:`~mlora_lab.spec.tenant.Tenant`)."""

    data: Any
    heldout_data: Any
    init_adapter: Any
    rl: Any


def path_str(value: Any) -> Any:
    """``os.PathLike`` -> ``str`` (so ``pathlib.Path`` arguments serialise); anything else unchanged."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def resolve_path(path: Any, base: str) -> Any:
    """``path`` (a string, ``~`` expanded) made absolute against ``base`` and normalised; an absolute path is
    only expanded, and anything that is not a non-empty string (``None``, rows held in memory) is kept."""
    if not isinstance(path, str) or not path:
        return path
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base, expanded))


def resolve_model_path(value: Any, base: str) -> Any:
    """:func:`resolve_path`, except that a Hub id (``org/name``) stays one unless a local path of that name
    exists (relative to ``base``): as in transformers, a local directory wins."""
    resolved = resolve_path(value, base)
    if isinstance(value, str) and HUB_ID.fullmatch(value) and not os.path.exists(resolved):
        return value
    return resolved


def resolve_reward(ref: Any, base: str) -> Any:
    """A reward ``"path/to/file.py:function"`` with a relative file made absolute against ``base``; a
    ``"module:function"`` (no ``/`` and no ``.py``) and anything else are kept."""
    if not isinstance(ref, str):
        return ref
    target, sep, function = ref.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if not sep or not target or not is_file:
        return ref
    return f"{resolve_path(target, base)}:{function}"


def resolve_tenant_paths(t: TenantPaths, base: str) -> None:
    """Make ``t``'s relative paths (data, heldout_data, init_adapter, reward files) absolute against ``base``,
    in place (what :meth:`~mlora_lab.spec.job.JobSpec.resolved` does to each tenant; ``sweep.json``'s base
    tenant too)."""
    t.data = resolve_path(t.data, base)
    t.heldout_data = resolve_path(t.heldout_data, base)
    t.init_adapter = resolve_model_path(t.init_adapter, base)
    if isinstance(t.rl, RL):
        t.rl.reward = (
            resolve_reward(t.rl.reward, base)
            if isinstance(t.rl.reward, str)
            else [resolve_reward(r, base) for r in t.rl.reward]
            if isinstance(t.rl.reward, list)
            else t.rl.reward
        )
        if isinstance(t.rl.env, str):  # (an agent's env and tools are named as reward functions are)
            t.rl.env = resolve_reward(t.rl.env, base)
        if isinstance(t.rl.tools, list):
            t.rl.tools = [resolve_reward(f, base) if isinstance(f, str) else f for f in t.rl.tools]


def relative_tenant_paths(t: Any, here: str) -> None:
    """A tenant's dict with its ``data`` / ``heldout_data`` below ``here`` (a file's directory) made relative to
    it, in place: a run directory that is copied or moved reads its own copy of the rows written into it.
    (An evaluation's dict too: its ``data`` is a tenant's.) Anything but a dict is left as it is."""
    for key in TENANT_FILES:
        if isinstance(t, dict) and isinstance(t.get(key), str):
            t[key] = relative_below(t[key], here)


def relative_below(path: str, base: str) -> str:
    """``path`` relative to ``base`` when it is an absolute path below ``base`` (lexically), else as it is."""
    if not os.path.isabs(path):
        return path
    try:
        if os.path.commonpath([os.path.normpath(path), base]) != base:
            return path
    except ValueError:  # (different drives)
        return path
    return os.path.relpath(os.path.normpath(path), base)
