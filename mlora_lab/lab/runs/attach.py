"""Which handle a run directory calls for: :func:`attach`.

A run directory is followed with a :class:`~mlora_lab.lab.runs.run.Run`, or with a kind of handle made for
what its job does. :data:`HANDLE_KINDS` lists those kinds, each with the file that marks a run directory
as its kind; :func:`attach` (and a launch or resume, through it) picks the first that matches. Adding a
kind is a line here: the ``Run`` handle itself knows none of them. :func:`as_runs` gives the handles of
what the comparing functions take (:mod:`mlora_lab.lab.compare.results`: a handle, a run directory, or a list).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlora_lab.lab.runs.run import Run
from mlora_lab.lab.runs.served import ServedRun
from mlora_lab.lab.runs.sweep import SweepRun
from mlora_lab.rundir import RunDir, RunDirError
from mlora_lab.rundir.service import is_served


@dataclass(frozen=True)
class HandleKind:
    """A kind of run directory and the handle that follows it."""

    name: str
    marks: Callable[[RunDir], bool]
    """True for a run directory of this kind."""
    handle: type[Run]


HANDLE_KINDS: tuple[HandleKind, ...] = (
    HandleKind("sweep", lambda run: run.sweep.is_file(), SweepRun),  # a search inside the job
    HandleKind("service", is_served, ServedRun),  # the job serves the Tinker API
)


def handle_for(run_dir: str | os.PathLike, process: subprocess.Popen | None = None) -> Run:
    """The handle of the run directory's kind (a plain :class:`~mlora_lab.lab.runs.run.Run` when it is of
    none), following ``process`` when this process started its job."""
    run = RunDir(Path(run_dir).absolute())
    kind = next((k for k in HANDLE_KINDS if k.marks(run)), None)
    return (kind.handle if kind is not None else Run)(run.root, process=process)


def attach(run_dir: str | os.PathLike) -> Run:
    """A :class:`~mlora_lab.lab.runs.run.Run` for an existing run directory (after a kernel restart, or a
    finished run); a :class:`~mlora_lab.lab.runs.sweep.SweepRun` for a run that searches, a
    :class:`~mlora_lab.lab.runs.served.ServedRun` for one that serves the Tinker API."""
    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise RunDirError(f"{run_dir}: no such directory")
    if not run.is_run():
        raise RunDirError(f"{run_dir}: not a run directory (no job.json)")
    return handle_for(run.root)


RunLike = Run | str | Path
"""A run as the comparing functions take it: its handle, or its directory."""


def as_runs(runs: RunLike | Sequence[RunLike]) -> list[Run]:
    """The handles of one run or of a list of them (a run directory: its :func:`attach` handle)."""
    if isinstance(runs, (Run, str, Path)):
        runs = [runs]
    return [r if isinstance(r, Run) else attach(r) for r in runs]
