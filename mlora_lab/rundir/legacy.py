"""The names an engine's run had in its run directory before the launcher seam (issue 49), in one table.

Slurm was the only engine then, and its run directory named it: the launcher's options in ``slurm.json``,
the job in status.json's ``slurm_job_id`` (an int) and Slurm's final word in ``slurm_state``. The seam
names any engine's (``<launcher>_options.json``; ``launcher_job = {"kind", "id"}`` and ``launcher_state``),
and keeps the old names where outside readers and older runs hold them::

    launcher   options file    status.json's job id / state (read and, until REMOVAL, written too)
    slurm      slurm.json      slurm_job_id (int) / slurm_state

A status.json written before the seam has only the old fields: they are read as ``launcher_job`` and
``launcher_state``. Until :data:`REMOVAL` a Slurm run's status.json also carries the old fields beside the
new ones (scripts outside mlora_lab read them); the options file keeps its name for good (a resume of an
older run reads it there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REMOVAL = "mlora_lab 0.3 (or 2027-06-01, whichever comes first)"
"""When status.json stops carrying the old fields beside the new ones (they are still read after it)."""


@dataclass(frozen=True)
class LegacyNames:
    """One launcher's names from before the seam."""

    options_file: str
    """The file its options are recorded in, in the run directory (instead of ``<launcher>_options.json``)."""
    job_id: str
    """status.json's field of its job's id, an int (``launcher_job.id`` as a number)."""
    job_state: str
    """status.json's field of the engine's final word (``launcher_state``)."""


LEGACY: dict[str, LegacyNames] = {"slurm": LegacyNames("slurm.json", "slurm_job_id", "slurm_state")}
"""launcher name -> its names from before the seam."""


def options_file(launcher: str) -> str:
    """The name of the file that records ``launcher``'s options in a run directory."""
    names = LEGACY.get(launcher)
    return names.options_file if names is not None else f"{launcher}_options.json"


def status_fields(kind: str | None, job_id: str | None, state: str | None) -> dict[str, Any]:
    """The old status.json fields of an engine's job (``kind``: the launcher, ``job_id``: the engine's id
    as text, ``state``: its final word), ``{}`` for a launcher without any or an id that is no number."""
    names = LEGACY.get(kind) if kind is not None else None
    if names is None or job_id is None or not job_id.isdigit():
        return {}
    return {names.job_id: int(job_id), names.job_state: state}


def old_status_keys() -> dict[str, type]:
    """Every old status.json field, with the type its value must have."""
    return {key: kind for n in LEGACY.values() for key, kind in ((n.job_id, int), (n.job_state, str))}


def job_from_old_fields(d: dict[str, Any]) -> tuple[str, str, str | None] | None:
    """``(launcher, id as text, final word)`` from a status.json object's old fields (None: it has none)."""
    for launcher, names in LEGACY.items():
        if d.get(names.job_id) is not None:
            return launcher, str(d[names.job_id]), d.get(names.job_state)
    return None
