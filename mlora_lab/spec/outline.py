"""A job file's outline: what views need of it, read without building (or validating) its tenants.

The dashboard and the command line's progress line read a run's ``job.json`` on every refresh that meets a
tenant they did not know; a file naming a million tenants takes about a second to outline, where building
and validating its :class:`~mlora_lab.spec.tenant.Tenant` objects takes ten. Light contract, as the spec.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from mlora_lab.spec.fields import MAX_COUNT, SpecError
from mlora_lab.spec.job import default_name
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import read_json, show_path

_MAX_STEPS = next(f.default for f in dataclasses.fields(Tenant) if f.name == "max_steps")
_OUTLINES: dict[str, tuple[tuple[int, int, int], Outline]] = {}  # Outline.read's, oldest first


@dataclass(frozen=True)
class Outline:
    """What views need of a job file, read without building (or validating) its tenants: the run's
    name and each tenant's step goal (:func:`step_goal`), in the file's order."""

    name: str
    goals: dict[str, int | None]

    @classmethod
    def read(cls, path: str | os.PathLike) -> Outline:
        """The outline of a ``job.json``; ``SpecError`` when it is not a JSON object. A tenant entry that
        is not an object with a string ``name`` is left out (:meth:`JobSpec.load` names such problems);
        a field left out has its default, as in :class:`Tenant`. Reading a million tenants' file takes
        about a second, where building them takes ten. It is remembered while the file is unchanged (its
        size, modification time and inode), for views that read it on every refresh: callers share it."""
        path = os.path.abspath(os.fsdecode(os.fspath(path)))
        try:
            st = os.stat(path)
            stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = None
        hit = _OUTLINES.get(path)
        if hit is not None and stamp is not None and hit[0] == stamp:
            return hit[1]
        out = cls._read(path)
        if stamp is not None:
            _OUTLINES[path] = (stamp, out)
            while len(_OUTLINES) > 64:
                _OUTLINES.pop(next(iter(_OUTLINES)))
        return out

    @classmethod
    def _read(cls, path: str) -> Outline:
        d, why = read_json(path, "a job file")
        if why or not isinstance(d, dict):
            raise SpecError(f"{show_path(path)}: {why or 'the top level must be a JSON object'}")
        default = _MAX_STEPS
        goals: dict[str, int | None] = {}
        tenants = d.get("tenants")
        for t in tenants if isinstance(tenants, list) else ():
            if isinstance(t, dict) and isinstance(name := t.get("name"), str):
                goal = t.get("max_steps", default)
                ok = t.get("client") is None and type(goal) is int and goal < MAX_COUNT
                goals[name] = goal if ok else None
        name = d.get("name")
        if not isinstance(name, str) or not name:
            # ("serve": stay_up's old name, read here without the warning a load gives)
            serving = d.get("serve") is True or d.get("stay_up") is True or d.get("service") is not None
            name = default_name(list(goals), serving)
        return cls(name, goals)
