"""``status.json``: the run's state and the identity of the process that runs it.

A pid alone is not an identity: after the job ends (or the machine reboots) the number is reused by
an unrelated process, and signalling it would kill a stranger. So the job's process is recorded as
``pid`` + its start time + ``host``, and a process counts as the job only if all three match and its
command line is a training job's. Anything else means the job's process is gone: the run is ``lost``
(its last checkpoint can be resumed), never "running".

The start time that identifies is the kernel's own: clock ticks since boot (``pid_start_ticks``,
``/proc/<pid>/stat`` field 22), within one boot (``pid_boot_id``). It never changes while the process
lives. The wall-clock start (``pid_start_time``, psutil's ``create_time()``) is *derived*, boot time +
ticks, and the kernel's boot time moves (it is recomputed from a wall clock that NTP adjusts): a live
job's derived start was seen a whole second from the recorded one, and the job was called ``lost`` and
left running. The wall-clock value is kept for people and for records without ticks (written before
ticks were, or where there is no ``/proc``), which are compared within :data:`WALL_CLOCK_SLACK_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlora_lab.rundir import legacy
from mlora_lab.rundir.files import RunDir, RunDirError, TextEnum, atomic_write_json, with_spare

JOB_MODULE = "mlora_lab.job"
"""The module a job's processes run (``python -m mlora_lab.job RUN_DIR``): every process of a job (the
torchrun agent and its workers) has it in its command line."""

TORCHRUN_MODULE = "mlora_lab.job.torchrun"
"""The module a job's torchrun agent runs: ``torch.distributed.run`` itself, started with the garbage
collector off while it imports (:mod:`mlora_lab.job.torchrun`)."""

JOB_MODULES = (JOB_MODULE, "mlora_lab.train")
"""Job modules of this and earlier versions (a job started before the job moved to ``mlora_lab.job`` ran
``mlora_lab.train``; a run directory it left must still be recognised as running)."""


def is_job_command(cmdline: list[str]) -> bool:
    """Whether a process's command line is that of a training job's process."""
    line = " ".join(cmdline)
    return any(module in line for module in JOB_MODULES)


class RunState(TextEnum):
    """States of a run. ``queued`` waits for resources; the last four are final."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"

    @property
    def final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset({RunState.FINISHED, RunState.FAILED, RunState.STOPPED, RunState.LOST})


def this_host() -> str:
    return socket.gethostname()


WALL_CLOCK_SLACK_S = 2.0
"""How far a process's wall-clock start may be from a record that has no clock ticks. On Linux the
wall-clock start is boot time + ticks, and the boot time moves (1 s was seen on a live job); a pid
reused within two seconds *and* running a training job's command line is not a plausible stranger."""


def start_ticks(pid: int) -> int | None:
    """The start of process ``pid`` in clock ticks since boot: ``/proc/<pid>/stat`` field 22 (None
    without ``/proc``, or when the process is gone). The command name (field 2) is in parentheses and
    may itself hold spaces and ``)``, so the fields are counted after the *last* ``)``."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 1 :].split()
    # fields[0] is field 3 (the state): field 22 is fields[19]
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; None without it): clock ticks since boot
    identify a process within one boot only."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel knows it: pid, start and host. The start is ``start_ticks`` (clock
    ticks since boot, of the boot ``boot_id``) where the kernel gives it, which never moves;
    ``start_time`` (seconds since the epoch) is the wall-clock reading of it, compared only when
    there are no ticks (a record from before they were kept, or a system without ``/proc``)."""

    pid: int
    start_time: float | None
    host: str
    start_ticks: int | None = None
    boot_id: str | None = None

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of the running process ``pid`` on this host (None if it is already gone)."""
        try:
            wall = psutil.Process(pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        ticks = start_ticks(pid)
        return cls(pid, wall, this_host(), ticks, boot_id() if ticks is not None else None)

    def alive(self) -> bool | None:
        """True if this process still runs (same pid, same start, a training job's command line);
        False if it is gone; None if it ran on another host (this machine cannot tell)."""
        if self.host != this_host():
            return None
        try:
            p = psutil.Process(self.pid)
            if not self._same_start(p):
                return False  # the pid now belongs to another process
            if p.status() == psutil.STATUS_ZOMBIE:
                return False
            return is_job_command(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    def _same_start(self, p: psutil.Process) -> bool:
        if self.start_ticks is not None:
            now = start_ticks(self.pid)
            if now is not None:
                # another boot restarts the count: its ticks say nothing about this process
                return now == self.start_ticks and (self.boot_id is None or self.boot_id == boot_id())
        if self.start_time is None:
            return False  # nothing to compare with: never take a stranger for the job
        return abs(p.create_time() - self.start_time) <= WALL_CLOCK_SLACK_S


def process_fields(identity: ProcessIdentity | None) -> dict[str, Any]:
    """The :class:`Status` fields that record ``identity`` (``update_status(run, **process_fields(me))``);
    all None for ``None`` (no process: a run
    being resumed, or a job whose process was gone before it could be recorded)."""
    if identity is None:
        return dict.fromkeys(("pid", "pid_start_time", "pid_start_ticks", "pid_boot_id", "host"))
    return {
        "pid": identity.pid,
        "pid_start_time": identity.start_time,
        "pid_start_ticks": identity.start_ticks,
        "pid_boot_id": identity.boot_id,
        "host": identity.host,
    }


@dataclass(frozen=True)
class JobRef:
    """Which job of which engine runs a run: ``kind`` is the launcher's name (``slurm``, ``ray``, ...),
    ``id`` the engine's own id of the job (a Slurm job id, a Ray job's submission id), as text.
    status.json records it as ``launcher_job`` (``{"kind": ..., "id": ...}``)."""

    kind: str
    id: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "id": self.id}

    @classmethod
    def from_dict(cls, d: Any) -> JobRef:
        """From status.json's ``launcher_job``: ``kind`` and ``id`` (text) are required, other keys (a later
        version's) are ignored; ``ValueError`` otherwise."""
        if not (isinstance(d, dict) and isinstance(d.get("kind"), str) and isinstance(d.get("id"), str)):
            raise ValueError(f"launcher_job must be {{'kind': str, 'id': str}}, got {str(d)[:120]}")
        return cls(d["kind"], d["id"])


@dataclass(frozen=True)
class Status:
    """The content of ``status.json``."""

    state: RunState
    pid: int | None = None
    pid_start_time: float | None = None
    """The job process's start, seconds since the epoch (derived: it moves with the boot time)."""
    pid_start_ticks: int | None = None
    """Its start in clock ticks since boot (``/proc/<pid>/stat`` field 22): what identifies it. None in
    a status.json written before ticks were kept, or without ``/proc``."""
    pid_boot_id: str | None = None
    """The boot that ``pid_start_ticks`` counts from."""
    host: str | None = None
    started: float | None = None
    ended: float | None = None
    error: str | None = None
    launcher: str | None = None
    """The launcher's name (``local``, ``slurm``, ``ray``; None: started by hand, from ``launchers/``)."""
    launcher_job: JobRef | None = None
    """The engine's job that runs it (a Slurm job, a Ray job). None for a local run: its process (the
    ``pid`` fields) is its record. Read from a launcher's old field (:mod:`~mlora_lab.rundir.legacy`:
    ``slurm_job_id``) in a status.json written before it."""
    launcher_state: str | None = None
    """The engine's final word on that job, once the notebook side has seen it (Slurm's COMPLETED,
    CANCELLED, TIMEOUT, ...; Ray's SUCCEEDED, FAILED, STOPPED); None while it is queued or runs, after
    which the engine is not asked again. Read from ``slurm_state`` in an older status.json."""

    @property
    def slurm_job_id(self) -> int | None:
        """The Slurm job that runs it (None: not a Slurm run). Also written to status.json as
        ``slurm_job_id`` until :data:`~mlora_lab.rundir.legacy.REMOVAL`, for scripts that read it there."""
        return self._old_fields().get("slurm_job_id")

    @property
    def slurm_state(self) -> str | None:
        """Slurm's final word on that job (:attr:`launcher_state` of a Slurm run; None otherwise, or while
        it is queued or runs). Also written to status.json as ``slurm_state`` until the removal date."""
        return self._old_fields().get("slurm_state")

    def _old_fields(self) -> dict[str, Any]:
        ref = self.launcher_job
        if ref is None:
            return {}
        return legacy.status_fields(ref.kind, ref.id, self.launcher_state)

    @property
    def process(self) -> ProcessIdentity | None:
        """The recorded job process (None before it started, or when the record is incomplete)."""
        if self.pid is None or self.host is None:
            return None
        if self.pid_start_time is None and self.pid_start_ticks is None:
            return None
        return ProcessIdentity(
            self.pid, self.pid_start_time, self.host, self.pid_start_ticks, self.pid_boot_id
        )

    def to_dict(self) -> dict[str, Any]:
        """status.json's object: the fields, and an engine's old fields beside the new ones
        (:func:`~mlora_lab.rundir.legacy.status_fields`: a Slurm run's ``slurm_job_id`` and
        ``slurm_state``, until :data:`~mlora_lab.rundir.legacy.REMOVAL`)."""
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return d | self._old_fields()

    @classmethod
    def from_dict(cls, d: Any, where: str = "status.json") -> Status:
        """Parse ``status.json``'s object; :class:`RunDirError` naming the problem otherwise. An older
        file's ``slurm_job_id``/``slurm_state`` (:mod:`~mlora_lab.rundir.legacy`) are read as
        ``launcher_job`` (``JobRef("slurm", id)``) and ``launcher_state`` where the newer fields are absent."""
        if not isinstance(d, dict):
            raise RunDirError(f"{where}: not a JSON object")
        try:
            state = RunState(d.get("state"))
        except ValueError:
            known = ", ".join(s.value for s in RunState)
            raise RunDirError(
                f"{where}: unknown state {str(d.get('state'))[:40]!r} (known: {known})"
            ) from None
        kinds = {
            "pid": int,
            "pid_start_time": float,
            "pid_start_ticks": int,
            "pid_boot_id": str,
            "host": str,
            "started": float,
            "ended": float,
            "error": str,
            "launcher": str,
            "launcher_state": str,
        }
        old_keys = legacy.old_status_keys()
        values: dict[str, Any] = {}
        for key, kind in (kinds | old_keys).items():
            v = d.get(key)
            if not _of_type(v, kind):
                raise RunDirError(f"{where}: {key} has the wrong type ({type(v).__name__})")
            if key in kinds:
                values[key] = float(v) if kind is float and v is not None else v
        job = d.get("launcher_job")
        if job is not None:
            try:
                values["launcher_job"] = JobRef.from_dict(job)
            except ValueError as e:
                raise RunDirError(f"{where}: {e}") from None
        elif (old := legacy.job_from_old_fields(d)) is not None:
            values["launcher_job"] = JobRef(old[0], old[1])
            values["launcher_state"] = values["launcher_state"] or old[2]
        return cls(state=state, **values)


def _of_type(v: Any, kind: type) -> bool:
    """None, or a ``kind`` (an int counts as a float; a bool is never a number)."""
    if v is None:
        return True
    if isinstance(v, bool):
        return False
    return isinstance(v, int | float) if kind is float else isinstance(v, kind)


def read_status(run_dir: str | Path) -> Status | None:
    """``status.json`` (None when it does not exist yet); :class:`RunDirError` if it is corrupt."""
    path = RunDir(run_dir).status
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        d = json.loads(text)
    except ValueError as e:
        raise RunDirError(
            f"{path}: corrupt ({e}); the job writes it atomically, so something else did"
        ) from None
    return Status.from_dict(d, str(path))


def write_status(run_dir: str | Path, status: Status) -> Status:
    """Write ``status.json`` atomically. On a full disk the job's spare allocation (``.spare``, see
    :func:`~mlora_lab.rundir.files.reserve_spare`) makes room for it."""
    run = RunDir(run_dir)
    with_spare(run.root, lambda: atomic_write_json(run.status, status.to_dict(), root=run.root))
    return status


def update_status(run_dir: str | Path, **fields: Any) -> Status:
    """Merge ``fields`` (names of :class:`Status` fields) into ``status.json``, atomically."""
    try:
        current = read_status(run_dir)
    except RunDirError:
        current = None  # a corrupt status is replaced by the truth we are writing now
    if "state" in fields:
        fields["state"] = RunState(fields["state"])
    base = current or Status(state=fields.get("state", RunState.STARTING))
    return write_status(run_dir, dataclasses.replace(base, **fields))


def record_problem(run_dir: str | Path, problem: str | None) -> None:
    """Say ``problem`` in the ``error`` of a run that goes on (a save that failed: the run still
    trains, and every earlier checkpoint is intact), or clear it (``None``: saving works again). Only
    while status.json says ``running``: a final state and its error are never touched, and a run
    directory without a status (a job started by hand, in-process) gets none. On a full disk the
    job's spare allocation makes room for it; if even that fails, the problem stays unsaid (the
    job's rows and its log still have it)."""
    try:
        current = read_status(run_dir)
    except (RunDirError, OSError):
        return
    if current is None or current.state is not RunState.RUNNING or current.error == problem:
        return
    with contextlib.suppress(OSError):
        write_status(run_dir, dataclasses.replace(current, error=problem))


def shown_tenant_state(tenant_state: str | None, run_state: str) -> str:
    """What a tenant's state is *now*, for tables and dashboards.

    A tenant's rows record its own life (``pending`` → ``running`` → ``finished``, ...), but a job that
    stops, fails or is lost writes no row for the tenants it was still training: their last row says
    ``running``. Once the run is final, a tenant that was still ``pending``/``running``/``paused`` is
    shown with the run's state (``stopped``, ``failed``, ``lost``); ``finished``, ``removed``,
    ``failed`` (quarantined) and ``refused`` tenants keep their own. A tenant with no row yet is
    ``pending`` while the run goes.
    """
    state = tenant_state or "pending"
    run_state = RunState(run_state)
    if run_state.final and state in ("pending", "running", "paused"):
        return run_state.value if run_state != RunState.FINISHED else state
    return state
