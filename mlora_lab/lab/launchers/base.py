"""The launcher seam: what an engine that runs jobs (this machine, Slurm, Ray) does for the lab.

A launcher starts a prepared run directory's job on its engine and answers for it afterwards. The lab
(``ml.launch``, ``ml.resume``, a run's liveness, the CLI) calls launchers by name through
:mod:`mlora_lab.lab.launchers.registry` and never branches on which one it holds:

    problems = launcher.check(spec, options, run_dir)         # before anything is created
    ref = launcher.submit(run_dir, spec, options, resume)     # -> JobRef, status.json's launcher_job
    launcher.status(ref)                                      # -> EngineJob | None (the engine forgot it)
    launcher.stop(ref)                                        # a graceful stop, by the engine's means
    launcher.kill(ref, timeout)                               # returns when the engine says it ended

The job itself is the same on every engine: torchrun agents (one per node) running
``python -m mlora_lab.job <run_dir>``, which write the run directory. A launcher only places the agents
and says what the engine knows that the job cannot write itself: that it waits in a queue (and why),
or that the engine ended it (cancelled, timed out, a node lost).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from mlora_lab.rundir import RunDir
from mlora_lab.rundir.status import JobRef
from mlora_lab.spec.job import JobSpec


class LauncherError(RuntimeError):
    """An engine's command or API failed, or the engine cannot be asked (its own words are in the text)."""


@dataclass(frozen=True)
class EngineJob:
    """What an engine says of one job now.

    ``state`` is the engine's own word (Slurm's ``JobState``: PENDING, RUNNING, COMPLETED, TIMEOUT, ...;
    Ray's: PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED); status.json records the final one as
    ``launcher_state``, after which the engine is not asked again. ``words`` is one sentence for a person
    (``Slurm job 12 is waiting in the queue (PENDING, reason Resources)``)."""

    state: str
    words: str
    pending: bool = False
    """It waits for resources (queued): the run reads ``queued`` with :attr:`words`."""
    final: bool = False
    """It has ended: nothing of it is left on any node."""
    clean: bool = False
    """It ended because its processes exited by themselves with success (not cancelled, killed, lost)."""


@runtime_checkable
class Launcher(Protocol):
    """An engine that runs jobs. Implementations are stateless: everything about a job is in its
    :class:`JobRef` and its run directory, so any process (a notebook, the CLI, a later session) can
    follow a job another one submitted."""

    name: ClassVar[str]
    """Its name in the registry, in ``launch(launcher=...)`` and ``--launcher``."""
    options_type: ClassVar[type | None]
    """The type of its options (``SlurmOptions``, ``RayOptions``; None: it takes none), given as the
    keyword of the launcher's name (``ml.launch(spec, launcher="ray", ray=ml.RayOptions(...))``). A
    launch records them with ``to_dict()`` in ``RunDir.launcher_options(name)``; a resume reads them
    back with ``options_type.from_dict(...)``; ``options_type()`` are its defaults."""
    queues: ClassVar[bool]
    """True (an engine: Slurm, Ray): the lab records the JobRef ``submit`` returns as status.json's
    ``launcher_job``, the run reads ``queued`` until the engine starts it, and the liveness asks
    :meth:`status` until the engine gives its final word. False (``local`` only): the job is a process
    started here, which ``submit`` records itself (the ``pid`` fields) and the liveness watches by its
    identity. Taken as True when a launcher does not say."""

    def check(self, spec: JobSpec, options: Any, run_dir: Path, resume: bool = False) -> list[str]:
        """Every problem of running ``spec`` (laid out as ``spec.parallel``) with ``options`` in
        ``run_dir`` on this engine, the engine asked where it can be (a partition Slurm refuses, a Ray
        cluster without enough nodes); nothing is created. Empty: none."""
        ...

    def submit(self, run_dir: RunDir, spec: JobSpec, options: Any, resume: bool = False) -> JobRef:
        """Start (or queue) the job of the prepared ``run_dir``; returns at once. :class:`LauncherError`
        if the engine refuses after all (the caller marks the run failed)."""
        ...

    def status(self, ref: JobRef) -> EngineJob | None:
        """What the engine says of ``ref`` now; None when it no longer knows it. :class:`LauncherError`
        when the engine cannot be asked."""
        ...

    def stop(self, ref: JobRef) -> None:
        """Ask the job to stop gracefully by the engine's means (the run directory's stop file is the
        first way; this is the second, for a full disk). Returns at once."""
        ...

    def kill(self, ref: JobRef, timeout: float = 120) -> EngineJob | None:
        """End the job now, without a final save, and return when the engine says it has ended (its
        last word, or None if it forgot the job); :class:`LauncherError` if it has not by ``timeout``.
        A killed run's error is ``killed (<words>)`` (``cancelled while queued (<words>)``), the words
        being the launcher's optional ``kill_words(ref)`` (Slurm's ``scancel 42``), else ``Ray job r1``."""
        ...
