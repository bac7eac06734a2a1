"""Is the job still there? A run's state from status.json, the job's process and its engine, together.

status.json is written by the job (and by the launcher before the job starts). A job killed from
outside (SIGKILL, the OOM killer, a reboot, Slurm or Ray cancelling it or losing a node) cannot write its
end: only the side that watches can find it out. This module finds it out in two explicit steps:

    live = Liveness(run_dir, process)   # process: the Popen when this process started the job
    verdict = live.verdict()            # reads status.json, checks the process, asks the engine; writes nothing
    live.record(verdict)                # writes the end it found into status.json (if there is one)
    live.reconcile()                    # both

Reading a state never writes it: ``Run.status`` is a verdict; ``Run.reconcile()`` (called by
``wait()``, ``stop()``, ``mlora-lab status`` and the dashboard's refresh) records it, so the next
reader, in this process or another, finds the end written down and the engine is asked no more.

A local run (no ``launcher_job`` in status.json) that says it is starting or running is checked against
its process (pid, start time, host: :class:`~mlora_lab.rundir.ProcessIdentity`): if the process is gone,
the run ``failed`` (this process started it and saw it exit) or is ``lost`` (it ended unseen); its last
checkpoint can be resumed. A run on another host is believed as its status file says.

A run an engine runs (status.json's ``launcher_job``: Slurm, Ray, ...) is checked against that engine,
whichever it is: ``registry.get(ref.kind).status(ref)``, an
:class:`~mlora_lab.lab.launchers.base.EngineJob`, at most once a second per :class:`Liveness`. It has
ended only when the engine says its job has: rank 0 writes the end seconds before the workers, the
torchrun agents and the engine's own processes (``srun``, slurmstepd, Ray's workers) have exited, and the
job stays running in the engine until they have; meanwhile the run reads ``running``.
:meth:`Liveness.wait` (``Run.wait``, ``Run.stop``) therefore returns only when nothing of the job is left.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlora_lab.lab.launchers import registry
from mlora_lab.lab.launchers.base import EngineJob, LauncherError
from mlora_lab.lab.launchers.local import LocalLauncher, job_ref
from mlora_lab.lab.records.logs import read_log
from mlora_lab.rundir import RunDir, RunDirError, RunState, Status, control, read_status, update_status
from mlora_lab.rundir.status import JOB_MODULE, JobRef, ProcessIdentity

ENGINE_MAX_AGE_S = 1.0
"""An engine is asked about a job at most this often (a dashboard reads the state every second)."""
ENGINE_CONFIRM_S = 60.0
"""How long :meth:`Liveness.wait` goes on asking an engine that cannot be asked (a slurmctld or Ray head
that does not answer) whether the job of a run that says it ended has ended, before it says that it
cannot tell."""


@dataclass(frozen=True)
class Ending:
    """An end of the run that status.json does not say yet, found by watching: the job's process is
    gone without a final state, or its engine ended the job."""

    state: RunState
    error: str | None
    ended: float
    launcher_state: str | None = None
    """The engine's final word on the job (a run an engine runs): once recorded, it is not asked again."""


@dataclass(frozen=True)
class Verdict:
    """A run's state now, and why it is there."""

    state: RunState
    error: str | None = None
    """Why it failed, was lost or stopped (status.json's, or the :attr:`ending`'s)."""
    waiting: str | None = None
    """The engine's words about a job that waits in its queue or is still ending, or why the engine
    could not be asked."""
    ending: Ending | None = None
    """The end to record in status.json (None: the file already says what there is to say)."""
    confirmed: bool = True
    """False: an engine's run's final state as only its run directory says it, because the engine could
    not be asked (:attr:`waiting` says why); :meth:`Liveness.wait` goes on asking."""
    unasked: LauncherError | None = None
    """Why the engine could not be asked (with :attr:`confirmed` False), in the engine's own error type."""


class Liveness:
    """Watches one run directory: its status file, the job process this Python process started (if
    it did: ``process``), and the job's engine job (asked at most once per :data:`ENGINE_MAX_AGE_S`)."""

    def __init__(self, run_dir: str | os.PathLike, process: subprocess.Popen | None = None) -> None:
        self.dir = RunDir(Path(run_dir).absolute())
        self.process = process
        self._seen: tuple[float, JobRef, EngineJob | LauncherError | None] | None = None

    @classmethod
    def of(cls, run: Any) -> Liveness:
        """The liveness of ``run``: its own when it carries one (a ``Run`` does, with the process it
        was started with), else a new one for the run directory ``os.fspath(run)`` names."""
        if isinstance(run, Liveness):
            return run
        own = getattr(run, "liveness", None)
        return own if isinstance(own, Liveness) else cls(os.fspath(run))

    def __fspath__(self) -> str:
        return str(self.dir.root)

    # -- the verdict ------------------------------------------------------------------------------
    def verdict(self) -> Verdict:
        """The run's state as its files, its process and its engine say together; writes nothing.

        :class:`~mlora_lab.rundir.RunDirError` if status.json is corrupt."""
        status = read_status(self.dir.root)
        if status is None:
            return Verdict(RunState.STARTING)
        if status.launcher_job is not None and status.launcher_state is None:
            return self._engine_verdict(status, status.launcher_job)
        if status.state.final or self._alive(status) is not False:
            return Verdict(status.state, status.error)
        # The job's process is gone but nobody wrote a final state. Re-read first: the job may have
        # written its final state just now.
        status = read_status(self.dir.root) or status
        if status.state.final:
            return Verdict(status.state, status.error)
        if self._ours(status):
            state, error = RunState.FAILED, self._death_reason()
        else:
            where = f"pid {status.pid}" + (f" on {status.host}" if status.host else "")
            state, error = (
                RunState.LOST,
                f"the job's process ({where}) is gone and never wrote a final state (killed, out of "
                "memory, or the machine restarted); resume it from its last checkpoint",
            )
        return Verdict(state, error, ending=Ending(state, error, ended=time.time()))

    def record(self, verdict: Verdict) -> None:
        """Write the verdict's :attr:`~Verdict.ending` into status.json (nothing when it has none).
        A full disk: the verdict stays true, only unrecorded."""
        end = verdict.ending
        if end is None:
            return
        fields: dict[str, Any] = {"state": end.state, "error": end.error, "ended": end.ended}
        if end.launcher_state is not None:
            fields["launcher_state"] = end.launcher_state
        with contextlib.suppress(OSError):
            update_status(self.dir.root, **fields)

    def reconcile(self) -> Verdict:
        """:meth:`verdict`, recorded."""
        verdict = self.verdict()
        self.record(verdict)
        return verdict

    def _alive(self, status: Status) -> bool | None:
        """Is the job's process alive? None when this machine cannot tell (another host) or nothing
        was started yet (a directory prepared for ``launchers/``)."""
        if self._ours(status):
            return self.process.poll() is None  # type: ignore[union-attr]
        identity = status.process
        if identity is not None:
            return identity.alive()
        if status.pid is None:
            return None
        try:  # a status without the process's start time: trust the pid only if it is a job
            p = psutil.Process(status.pid)
            return p.status() != psutil.STATUS_ZOMBIE and JOB_MODULE in " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    def _ours(self, status: Status) -> bool:
        """Whether the run's job is the process this handle started. Not once another job took the run over
        (resumed from another handle or the command line: status.json names its process, or none yet while
        it starts): then the status file is believed, as for a handle that started nothing."""
        return self.process is not None and status.pid == self.process.pid

    def _death_reason(self) -> str:
        code = self.process.poll() if self.process is not None else None
        tail = read_log(self.dir, rank=None, tail=5).strip().splitlines()
        return f"job exited (code {code}) without a final status; last log lines: {' | '.join(tail)}"

    # -- the engine -------------------------------------------------------------------------------
    def engine_job(self) -> EngineJob | None:
        """What the run's engine says of its job now (None: a local run, or the engine forgot the job).
        :class:`~mlora_lab.lab.launchers.base.LauncherError` when the engine cannot be asked."""
        status = read_status(self.dir.root)
        if status is None or status.launcher_job is None:
            return None
        return registry.for_job(status.launcher_job).status(status.launcher_job)

    def _ask(self, ref: JobRef) -> EngineJob | LauncherError | None:
        """``registry.for_job(ref).status(ref)`` at most once per :data:`ENGINE_MAX_AGE_S`; the
        engine's error when it cannot be asked (or its launcher is not registered or cannot be loaded
        here: an engine registered in another process)."""
        now = time.monotonic()
        seen = self._seen
        if seen is None or seen[1] != ref or now - seen[0] > ENGINE_MAX_AGE_S:
            try:
                answer: EngineJob | LauncherError | None = registry.for_job(ref).status(ref)
            except LauncherError as e:
                answer = e
            self._seen = seen = (now, ref, answer)
        return seen[2]

    def _engine_verdict(self, status: Status, ref: JobRef) -> Verdict:
        """The state of a run an engine runs, whose end the engine has not confirmed yet.

        Pending in the engine: ``queued`` with its words. Running: as the run directory says
        (``starting`` until rank 0 writes ``running``). Ended cleanly (its processes exited by
        themselves with success): the state the job wrote (``failed`` if it wrote none). Any other end
        (cancelled, timed out, a node lost, out of memory, preempted, stopped by the engine) is
        ``failed`` with the engine's words, even when the job managed a graceful save on the engine's
        SIGTERM, unless it was this side that asked for the stop. The end comes with the engine's final
        state to record, so that it is asked no more. If the engine cannot be asked, the status file is
        believed (unconfirmed when it says the run ended)."""
        job = self._ask(ref)
        if isinstance(job, LauncherError):
            return Verdict(
                status.state,
                status.error,
                waiting=str(job),
                confirmed=not status.state.final,
                unasked=job,
            )
        if job is not None and job.pending:
            return Verdict(RunState.QUEUED, status.error, waiting=job.words)
        if job is not None and not job.final:
            if status.state is RunState.QUEUED:
                return Verdict(RunState.STARTING, status.error)
            if status.state.final:
                # Rank 0 writes the end before its process, the torchrun agents and the engine's own
                # processes have exited (seconds on a quiet cluster; longer if one hangs): the job is over
                # when the engine says so. (Also a save on the engine's own SIGTERM: its verdict follows.)
                return Verdict(
                    RunState.RUNNING,
                    waiting=f"the job wrote '{status.state.value}', but {job.words}: its processes "
                    "are still ending",
                )
            return Verdict(status.state, status.error)
        status = read_status(self.dir.root) or status  # the job may have written its end just now
        if job is None:  # the engine forgot the job (Slurm: it ended more than MinJobAge ago)
            engine_state = "UNKNOWN"
            if status.state.final:
                state, error = status.state, status.error
            else:
                state, error = (
                    RunState.LOST,
                    f"{engine_name(ref)} no longer knows job {ref.id} and the job never wrote a final "
                    "state; resume it from its last checkpoint",
                )
        else:
            engine_state = job.state
            if job.clean:
                if status.state.final:
                    state, error = status.state, status.error
                else:
                    tail = " | ".join(read_log(self.dir, rank=None, tail=5).strip().splitlines())
                    state = RunState.FAILED
                    error = f"{job.words}, but the job never wrote a final state; last log lines: {tail}"
            elif status.state is RunState.STOPPED and control.stop_requested(self.dir.root):
                state, error = status.state, status.error  # our stop, ended by the engine after its timeout
            else:
                own = (
                    f"; the job said: {status.error}"
                    if status.error and status.state is RunState.FAILED
                    else ""
                )
                state, error = RunState.FAILED, f"{job.words}{own}; resume it from its last checkpoint"
        ending = Ending(state, error, ended=status.ended or time.time(), launcher_state=engine_state)
        return Verdict(state, error, ending=ending)

    # -- waiting for the end ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, poll: float = 0.5) -> Verdict:
        """Reconcile every ``poll`` seconds until the run has ended, or ``timeout`` seconds have passed;
        the last verdict (recorded). A run an engine runs has ended only when the engine says its job
        has: nothing of it is left then (no srun, slurmstepd, torchrun agent or worker); until then its
        verdict is not final (``waiting`` says what the engine says).

        :class:`~mlora_lab.lab.launchers.base.LauncherError` (the engine's own kind: ``SlurmError`` for
        Slurm) when the run directory says the run ended but the engine could not be asked whether its
        job has, for :data:`ENGINE_CONFIRM_S` or until ``timeout``: the end is unconfirmed, and the error
        says why."""
        deadline = None if timeout is None else time.monotonic() + timeout
        unsure_since: float | None = None
        while True:
            verdict = self.reconcile()
            if verdict.state.final and verdict.confirmed:
                self._wait_gone(deadline)
                return verdict
            now = time.monotonic()
            unsure_since = None if verdict.confirmed else (now if unsure_since is None else unsure_since)
            unsure = unsure_since is not None and now - unsure_since > ENGINE_CONFIRM_S
            if unsure or (deadline is not None and now > deadline):
                if not verdict.confirmed:
                    ref = read_status(self.dir.root).launcher_job  # (unconfirmed: an engine's run)
                    raise type(verdict.unasked or LauncherError())(
                        f"the run directory says the run is {verdict.state.value}, but "
                        f"{engine_name(ref)} cannot say whether its job has ended: {verdict.waiting}"
                    )
                return verdict
            time.sleep(poll)

    def _wait_gone(self, deadline: float | None, most: float = 30.0) -> None:
        """A job writes its end, then its processes exit (the last writes, the agent reaping its workers): on
        this machine, wait until the process status.json names (the torchrun agent) is gone, so that a
        handle's ``wait`` returns when nothing of the job is left, as an engine's run's does. At most
        ``most`` seconds, or until ``deadline``; nothing for a process this machine cannot see (nor for
        an engine's run: the engine said its job ended)."""
        end = time.monotonic() + most
        if deadline is not None:
            end = min(end, deadline)
        while time.monotonic() < end:
            try:
                status = read_status(self.dir.root)
            except (RunDirError, OSError):
                return
            if status is None or status.launcher_job is not None or self._alive(status) is not True:
                return
            time.sleep(0.05)

    # -- ending the job -----------------------------------------------------------------------------
    def _engine_ref(self, status: Status | None) -> JobRef | None:
        """The engine's job of a run whose end the engine has not given yet (None: a local run, or over)."""
        if status is None or status.launcher_job is None or status.launcher_state is not None:
            return None
        return status.launcher_job

    def signal_stop(self) -> None:
        """Ask the job for a graceful stop by a signal rather than by the stop file: on a full disk the
        file cannot be written, and a signal needs no space. Each rank turns SIGTERM into the same
        stop as the file's (the ranks agree on it at the next step boundary: finish the step,
        checkpoint, save, exit). A local job's recorded process is checked first (same pid, start
        time, host: a stale pid is never signalled); an engine's job is stopped by the engine's means
        (:meth:`~mlora_lab.lab.launchers.base.Launcher.stop`: Slurm signals its steps).
        :class:`~mlora_lab.rundir.RunDirError` saying why when the job cannot be signalled from here
        (it runs on another host)."""
        status = read_status(self.dir.root)
        if (ref := self._engine_ref(status)) is not None:
            registry.for_job(ref).stop(ref)
            return
        if (ref := self._local_ref(status)) is None:
            where = f" (it runs on {status.host})" if status is not None and status.host else ""
            raise RunDirError(
                f"{self.dir.root}: the stop file cannot be written (is the disk full?) and the job's "
                f"process cannot be signalled from here{where}; free some space and stop again"
            )
        registry.get(LocalLauncher.name).stop(ref)

    def kill(self, timeout: float = 120) -> None:
        """SIGKILL every process of the job, after checking that the recorded process still is the
        job (same pid, start time and host): a stale pid is never signalled. An engine's job is ended
        by its launcher (:meth:`~mlora_lab.lab.launchers.base.Launcher.kill`: for Slurm, SIGKILL to every
        process of its steps on every node, then ``scancel``), which returns when the engine says it has
        ended (:class:`~mlora_lab.lab.launchers.base.LauncherError` with the engine's state if it has not
        after ``timeout`` seconds). A run that was not final is then ``stopped`` (error ``killed``)."""
        status = read_status(self.dir.root)
        if (ref := self._engine_ref(status)) is not None:
            self._kill_engine_job(ref, timeout)
            return
        if (local := self._local_ref(status)) is not None:
            registry.get(LocalLauncher.name).kill(local, timeout)
        if status is not None and _killed_by_us(status, read_status(self.dir.root)):
            with contextlib.suppress(OSError):
                update_status(self.dir.root, state=RunState.STOPPED, ended=time.time(), error="killed")

    def _local_ref(self, status: Status | None) -> JobRef | None:
        """A local job's live process as the ``local`` launcher's JobRef, which stops and kills it (one
        implementation of "never signal a stale pid"): the process this Python started while it runs,
        else the one status.json records if it still is the job; None when neither runs here."""
        if self.process is not None and self.process.poll() is None:
            me = ProcessIdentity.of(self.process.pid)
            if me is not None:
                return job_ref(me)
        if status is not None and status.process is not None and status.process.alive():
            return job_ref(status.process)
        return None

    def _kill_engine_job(self, ref: JobRef, timeout: float = 120) -> None:
        """End the engine's job (its launcher's ``kill`` returns once the engine says it ended), then
        record the engine's final state (and ``stopped`` if the run was not final). The launcher's error
        if it has not ended by ``timeout``: nothing is recorded then, so the next verdict asks again."""
        before = read_status(self.dir.root)
        queued = self.verdict().state is RunState.QUEUED
        engine = registry.for_job(ref)
        job = engine.kill(ref, timeout)
        status = read_status(self.dir.root)
        fields: dict[str, Any] = {"launcher_state": job.state if job is not None else "UNKNOWN"}
        if status is not None and _killed_by_us(before, status):
            what = "cancelled while queued" if queued else "killed"
            said = getattr(
                engine, "kill_words", None
            )  # (optional: Slurm's "scancel 42", words users match on)
            how = said(ref) if callable(said) else job_words(ref)
            fields |= {"state": RunState.STOPPED, "ended": time.time(), "error": f"{what} ({how})"}
        with contextlib.suppress(OSError):
            update_status(self.dir.root, **fields)


def _killed_by_us(before: Status | None, after: Status | None) -> bool:
    """Whether a kill ended the run, so that it is recorded ``stopped``: it was not final before the kill,
    and after it is not final either, or is ``failed``. A SIGKILL reaches the ranks one by one (each
    node's tree in turn): rank 0, still alive while another rank's process is gone, sees its collective
    fail and writes ``failed`` in the moment before its own SIGKILL; that failure is the kill's echo,
    not the run's end. A ``finished`` (or ``stopped``) written before the kill landed stays."""
    if after is None or (before is not None and before.state.final):
        return False
    return not after.state.final or after.state is RunState.FAILED


def engine_name(ref: JobRef | None) -> str:
    """How the run's engine is named in a sentence: ``Slurm``, ``Ray`` (its launcher's name, capitalised)."""
    return ref.kind.capitalize() if ref is not None else "the engine"


def job_words(ref: JobRef) -> str:
    """The engine's job in a few words: ``Slurm job 42``."""
    return f"{engine_name(ref)} job {ref.id}"
