"""Is the job still there? A run's state from status.json, the job's process and Slurm, together.

status.json is written by the job (and by the launcher before the job starts). A job killed from
outside (SIGKILL, the OOM killer, a reboot, Slurm cancelling it or losing a node) cannot write its
end: only the side that watches can find it out. This module finds it out in two explicit steps:

    live = Liveness(run_dir, process)   # process: the Popen when this process started the job
    verdict = live.verdict()            # reads status.json, checks the process, asks Slurm; writes nothing
    live.record(verdict)                # writes the end it found into status.json (if there is one)
    live.reconcile()                    # both

Reading a state never writes it: ``Run.status`` is a verdict; ``Run.reconcile()`` (called by
``wait()``, ``stop()``, ``mlora-lab status`` and the dashboard's refresh) records it, so the next
reader, in this process or another, finds the end written down and Slurm is asked no more.

A run that says it is starting or running is checked against its process (pid, start time, host:
:class:`~mlora_lab.rundir.ProcessIdentity`): if the process is gone, the run ``failed`` (this process
started it and saw it exit) or is ``lost`` (it ended unseen); its last checkpoint can be resumed. A
run on another host is believed as its status file says. A Slurm run is checked against Slurm
(:mod:`mlora_lab.lab.slurm.cluster`), at most once a second per :class:`Liveness`, and has ended only when
Slurm says its job has: rank 0 writes the end seconds before the workers, the torchrun agents, ``srun``
and the steps' slurmstepd have exited, and the job stays RUNNING in Slurm until they have; meanwhile
the run reads ``running``. :meth:`Liveness.wait` (``Run.wait``, ``Run.stop``) therefore returns only
when nothing of the job is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlora_lab.lab.records.logs import read_log
from mlora_lab.lab.slurm import cluster as slurm
from mlora_lab.rundir import RunDir, RunDirError, RunState, Status, control, read_status, update_status
from mlora_lab.rundir.status import JOB_MODULE, is_job_command

SLURM_MAX_AGE_S = 1.0
"""Slurm is asked about a job at most this often (a dashboard reads the state every second)."""
SLURM_CONFIRM_S = 60.0
"""How long :meth:`Liveness.wait` goes on asking a Slurm that cannot be asked (a slurmctld that does
not answer) whether the job of a run that says it ended has ended, before it says that it cannot tell."""


@dataclass(frozen=True)
class Ending:
    """An end of the run that status.json does not say yet, found by watching: the job's process is
    gone without a final state, or Slurm ended the job."""

    state: RunState
    error: str | None
    ended: float
    slurm_state: str | None = None
    """Slurm's final ``JobState`` of the job (a Slurm run only): once recorded, Slurm is not asked again."""


@dataclass(frozen=True)
class Verdict:
    """A run's state now, and why it is there."""

    state: RunState
    error: str | None = None
    """Why it failed, was lost or stopped (status.json's, or the :attr:`ending`'s)."""
    waiting: str | None = None
    """Slurm's words about a job that waits in its queue or is still ending, or why Slurm could not
    be asked."""
    ending: Ending | None = None
    """The end to record in status.json (None: the file already says what there is to say)."""
    confirmed: bool = True
    """False: a Slurm run's final state as only its run directory says it, because Slurm could not
    be asked (:attr:`waiting` says why); :meth:`Liveness.wait` goes on asking."""


class Liveness:
    """Watches one run directory: its status file, the job process this Python process started (if
    it did: ``process``), and the job's Slurm job (asked at most once per :data:`SLURM_MAX_AGE_S`)."""

    def __init__(self, run_dir: str | os.PathLike, process: subprocess.Popen | None = None) -> None:
        self.dir = RunDir(Path(run_dir).absolute())
        self.process = process
        self._slurm_seen: tuple[float, int, slurm.SlurmJob | slurm.SlurmError | None] | None = None

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
        """The run's state as its files, its process and Slurm say together; writes nothing.

        :class:`~mlora_lab.rundir.RunDirError` if status.json is corrupt."""
        status = read_status(self.dir.root)
        if status is None:
            return Verdict(RunState.STARTING)
        if status.slurm_job_id is not None and status.slurm_state is None:
            return self._slurm_verdict(status)
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
        if end.slurm_state is not None:
            fields["slurm_state"] = end.slurm_state
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

    # -- Slurm ------------------------------------------------------------------------------------
    def slurm_job(self) -> slurm.SlurmJob | None:
        """What Slurm says of the run's job now (None: not a Slurm run, or Slurm forgot the job)."""
        status = read_status(self.dir.root)
        if status is None or status.slurm_job_id is None:
            return None
        return slurm.query(status.slurm_job_id)

    def _ask_slurm(self, job_id: int) -> slurm.SlurmJob | slurm.SlurmError | None:
        """:func:`~mlora_lab.lab.slurm.cluster.query` at most once per :data:`SLURM_MAX_AGE_S`."""
        now = time.monotonic()
        seen = self._slurm_seen
        if seen is None or seen[1] != job_id or now - seen[0] > SLURM_MAX_AGE_S:
            try:
                answer: slurm.SlurmJob | slurm.SlurmError | None = slurm.query(job_id)
            except slurm.SlurmError as e:
                answer = e
            self._slurm_seen = seen = (now, job_id, answer)
        return seen[2]

    def _slurm_verdict(self, status: Status) -> Verdict:
        """The state of a Slurm run whose end Slurm has not confirmed yet.

        Pending in Slurm: ``queued``. Running: as the run directory says (``starting`` until rank 0
        writes ``running``). Ended: COMPLETED keeps the state the job wrote (``failed`` if it wrote
        none); any other end (cancelled, timed out, a node lost, out of memory, preempted) is
        ``failed`` with Slurm's reason, even when the job managed a graceful save on Slurm's SIGTERM,
        unless it was this side that asked for the stop. The end comes with Slurm's state to record,
        so that Slurm is asked no more. If Slurm cannot be asked (no Slurm commands here), the status
        file is believed."""
        job = self._ask_slurm(status.slurm_job_id)
        if isinstance(job, slurm.SlurmError):
            return Verdict(status.state, status.error, waiting=str(job), confirmed=not status.state.final)
        if job is not None and job.pending:
            return Verdict(RunState.QUEUED, status.error, waiting=job.describe())
        if job is not None and not job.final:
            if status.state is RunState.QUEUED:
                return Verdict(RunState.STARTING, status.error)
            if status.state.final:
                # Rank 0 writes the end before its process, the torchrun agents, srun and the batch
                # step have exited (seconds on a quiet cluster; longer if one hangs): the job is over
                # when Slurm says so. (Also a save on Slurm's own SIGTERM: Slurm's verdict follows.)
                return Verdict(
                    RunState.RUNNING,
                    waiting=f"the job wrote '{status.state.value}', but {job.describe()}: its processes "
                    "are still ending",
                )
            return Verdict(status.state, status.error)
        status = read_status(self.dir.root) or status  # the job may have written its end just now
        if job is None:  # Slurm forgot the job (it ended more than MinJobAge ago)
            slurm_state = "UNKNOWN"
            if status.state.final:
                state, error = status.state, status.error
            else:
                state, error = (
                    RunState.LOST,
                    f"Slurm no longer knows job {status.slurm_job_id} and the job never wrote a final "
                    "state; resume it from its last checkpoint",
                )
        else:
            slurm_state = job.state
            if job.clean:
                if status.state.final:
                    state, error = status.state, status.error
                else:
                    tail = " | ".join(read_log(self.dir, rank=None, tail=5).strip().splitlines())
                    state = RunState.FAILED
                    error = f"{job.describe()}, but the job never wrote a final state; last log lines: {tail}"
            elif status.state is RunState.STOPPED and control.stop_requested(self.dir.root):
                state, error = status.state, status.error  # our stop, ended by scancel after its timeout
            else:
                own = (
                    f"; the job said: {status.error}"
                    if status.error and status.state is RunState.FAILED
                    else ""
                )
                state, error = RunState.FAILED, f"{job.describe()}{own}; resume it from its last checkpoint"
        ending = Ending(state, error, ended=status.ended or time.time(), slurm_state=slurm_state)
        return Verdict(state, error, ending=ending)

    # -- waiting for the end ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, poll: float = 0.5) -> Verdict:
        """Reconcile every ``poll`` seconds until the run has ended, or ``timeout`` seconds have passed;
        the last verdict (recorded). A Slurm run has ended only when Slurm says its job has: nothing of
        it is left then (no srun, slurmstepd, torchrun agent or worker); until then its verdict is not
        final (``waiting`` says what Slurm says).

        :class:`~mlora_lab.lab.slurm.cluster.SlurmError` when the run directory says the run ended but Slurm
        could not be asked whether its job has, for :data:`SLURM_CONFIRM_S` or until ``timeout``: the
        end is unconfirmed, and the error says why."""
        deadline = None if timeout is None else time.monotonic() + timeout
        unsure_since: float | None = None
        while True:
            verdict = self.reconcile()
            if verdict.state.final and verdict.confirmed:
                self._wait_gone(deadline)
                return verdict
            now = time.monotonic()
            unsure_since = None if verdict.confirmed else (now if unsure_since is None else unsure_since)
            unsure = unsure_since is not None and now - unsure_since > SLURM_CONFIRM_S
            if unsure or (deadline is not None and now > deadline):
                if not verdict.confirmed:
                    raise slurm.SlurmError(
                        f"the run directory says the run is {verdict.state.value}, but Slurm cannot say "
                        f"whether its job has ended: {verdict.waiting}"
                    )
                return verdict
            time.sleep(poll)

    def _wait_gone(self, deadline: float | None, most: float = 30.0) -> None:
        """A job writes its end, then its processes exit (the last writes, the agent reaping its workers): on
        this machine, wait until the process status.json names (the torchrun agent) is gone, so that a
        handle's ``wait`` returns when nothing of the job is left, as a Slurm run's does. At most ``most``
        seconds, or until ``deadline``; nothing for a process this machine cannot see."""
        end = time.monotonic() + most
        if deadline is not None:
            end = min(end, deadline)
        while time.monotonic() < end:
            try:
                status = read_status(self.dir.root)
            except (RunDirError, OSError):
                return
            if status is None or status.launcher == "slurm" or self._alive(status) is not True:
                return
            time.sleep(0.05)

    # -- ending the job -----------------------------------------------------------------------------
    def signal_stop(self) -> None:
        """Ask the job for a graceful stop by SIGTERM rather than by the stop file: on a full disk the
        file cannot be written, and a signal needs no space. Each rank turns SIGTERM into the same
        stop as the file's (the ranks agree on it at the next step boundary: finish the step,
        checkpoint, save, exit). The recorded process is checked first (same pid, start time, host:
        a stale pid is never signalled). :class:`~mlora_lab.rundir.RunDirError` saying why when the
        job cannot be signalled from here (it runs on another host; a Slurm job: see the message)."""
        status = read_status(self.dir.root)
        if status is not None and status.slurm_job_id is not None and status.slurm_state is None:
            raise RunDirError(
                f"{self.dir.root}: the stop file cannot be written (is the disk full?) and this Python does "
                f"not signal Slurm job {status.slurm_job_id} itself; free some space and stop again, or "
                "run.kill() to cancel it without a final save"
            )
        if self.process is not None and self.process.poll() is None:
            pid = self.process.pid
        elif status is not None and status.process is not None and status.process.alive():
            pid = status.process.pid
        else:
            where = f" (it runs on {status.host})" if status is not None and status.host else ""
            raise RunDirError(
                f"{self.dir.root}: the stop file cannot be written (is the disk full?) and the job's "
                f"process cannot be signalled from here{where}; free some space and stop again"
            )
        terminate_job(pid)

    def kill(self, timeout: float = 120) -> None:
        """SIGKILL every process of the job, after checking that the recorded process still is the
        job (same pid, start time and host): a stale pid is never signalled. A Slurm job is killed and
        cancelled (:func:`~mlora_lab.lab.slurm.cluster.kill`: SIGKILL to every process of its steps on every
        node, then ``scancel``), and this waits
        until Slurm says it has ended (:class:`~mlora_lab.lab.slurm.cluster.SlurmError` with Slurm's state
        if it has not after ``timeout`` seconds). A run that was not final is then ``stopped`` (error
        ``killed``)."""
        status = read_status(self.dir.root)
        if status is not None and status.slurm_job_id is not None and status.slurm_state is None:
            self._cancel_slurm(status, timeout)
            return
        if self.process is not None and self.process.poll() is None:
            kill_job(self.process.pid)
        elif status is not None and status.process is not None and status.process.alive():
            kill_job(status.process.pid)
        if status is not None and not status.state.final:
            with contextlib.suppress(OSError):
                update_status(self.dir.root, state=RunState.STOPPED, ended=time.time(), error="killed")

    def _cancel_slurm(self, status: Status, timeout: float = 120) -> None:
        """SIGKILL every process of the job and cancel it (:func:`~mlora_lab.lab.slurm.cluster.kill`), wait
        until Slurm says it has ended, then record Slurm's final state (and ``stopped`` if the run was
        not final). :class:`~mlora_lab.lab.slurm.cluster.SlurmError` with Slurm's state if it has not ended by
        ``timeout``: nothing is recorded then, so the next verdict asks Slurm again."""
        job_id = status.slurm_job_id
        queued = self.verdict().state is RunState.QUEUED
        try:
            slurm.kill(job_id)
        except slurm.SlurmError:  # scancel refuses a job that ended meanwhile ("Invalid job id")
            if (job := slurm.query(job_id)) is not None and not job.final:
                raise
        deadline = time.monotonic() + timeout
        while (job := slurm.query(job_id)) is not None and not job.final:
            if time.monotonic() > deadline:
                raise slurm.SlurmError(
                    f"scancel {job_id}: {job.describe()} still, {timeout:.0f} s after it was cancelled"
                )
            time.sleep(0.5)
        status = read_status(self.dir.root) or status
        fields: dict[str, Any] = {"slurm_state": job.state if job is not None else "UNKNOWN"}
        if not status.state.final:
            what = "cancelled while queued" if queued else "killed"
            fields |= {"state": RunState.STOPPED, "ended": time.time(), "error": f"{what} (scancel {job_id})"}
        with contextlib.suppress(OSError):
            update_status(self.dir.root, **fields)


def terminate_job(pid: int) -> None:
    """SIGTERM every rank of the job whose process (the torchrun agent, or a job started without
    torchrun) is ``pid``: the ranks are the agent's descendants that run the job's module. The agent
    itself is left alone (signalled, it would give its workers only 30 s before killing them); when it
    has no rank yet, it gets the signal itself."""
    try:
        agent = psutil.Process(pid)
        ranks = [p for p in agent.children(recursive=True) if is_job_command(_cmdline(p))]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return
    for p in ranks or [agent]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(signal.SIGTERM)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def kill_job(pid: int) -> None:
    """SIGKILL a job's whole process tree: the torchrun agent ``pid`` and all its descendants.

    The tree is listed *before* anything is killed: torchrun starts each worker in a session of its
    own (``start_new_session=True``), so killing the agent's process group misses the workers, and
    once the agent is dead they are orphans no longer found among its children. A job that
    ``launch()`` started leads its own session, so its group goes too (anything else it spawned)."""
    try:
        proc = psutil.Process(pid)
        tree = [*proc.children(recursive=True), proc]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    psutil.wait_procs(tree, timeout=10)
