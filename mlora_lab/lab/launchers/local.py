"""The ``local`` launcher: torchrun on this machine, as a background process in its own session.

    python -m mlora_lab.job.torchrun <loopback rendezvous> --nproc-per-node P -m mlora_lab.job RUN_DIR
        (stdout and stderr appended to RUN_DIR/logs/launcher.log)

A notebook interrupt does not reach the job (its own session); a stop reaches every rank through the
process group. Single-node jobs rendezvous on 127.0.0.1 only (:mod:`mlora_lab.rendezvous`), on free
ports, so several runs go at once.

A local job *is* its process: status.json records the torchrun agent's identity (pid, start in clock
ticks, boot, host: :class:`~mlora_lab.rundir.status.ProcessIdentity`), not a ``launcher_job``, and the
liveness watches that process itself (the one this Python started is polled, exit code and all, which
no engine could tell). The :class:`~mlora_lab.rundir.status.JobRef` :meth:`LocalLauncher.submit` returns
carries the same identity as text (``pid:ticks:boot:start@host``), so that :meth:`~LocalLauncher.status`,
:meth:`~LocalLauncher.stop` and :meth:`~LocalLauncher.kill` act on that process only, never on a stranger
that reused its pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import psutil

from mlora_lab.lab.launchers.base import EngineJob, LauncherError
from mlora_lab.lab.launchers.threads import omp_threads, thread_env
from mlora_lab.lab.records.logs import LAUNCHER_LOG
from mlora_lab.rundir import RunDir, guarded_open, update_status
from mlora_lab.rundir.service import remove_endpoint
from mlora_lab.rundir.status import (
    JOB_MODULE,
    TORCHRUN_MODULE,
    JobRef,
    ProcessIdentity,
    is_job_command,
    process_fields,
    this_host,
)
from mlora_lab.spec.job import JobSpec

MULTI_NODE = (
    "launch it with an engine that spans machines (ml.launch(spec, launcher='slurm', "
    "slurm=ml.SlurmOptions(...)), or launcher='ray', ray=ml.RayOptions(...); on the command line "
    "`mlora-lab run job.json --launcher slurm`), or start launchers/multinode.sh on every node"
)

# Jobs this process started, with the threads they were given: the next job's threads leave room for them.
_started: list[tuple[subprocess.Popen, int]] = []


class LocalLauncher:
    """torchrun on this machine (one node): :class:`~mlora_lab.lab.launchers.base.Launcher` ``local``."""

    name: ClassVar[str] = "local"
    options_type: ClassVar[type | None] = None
    queues: ClassVar[bool] = False
    """The job is a process started here, watched by its identity: no queue, no ``launcher_job``."""

    def check(self, spec: JobSpec, options: Any, run_dir: Path, resume: bool = False) -> list[str]:
        """One node only (``parallel.nnodes == 1``)."""
        nnodes = spec.parallel.nnodes
        if nnodes != 1:
            return [f"parallel.nnodes = {nnodes}: the local launcher runs on this machine only; {MULTI_NODE}"]
        return []

    def submit(self, run_dir: RunDir, spec: JobSpec, options: Any = None, resume: bool = False) -> JobRef:
        """Start torchrun for ``run_dir`` (whose lock the caller holds; a GGUF base is converted already)
        and record its process in status.json. Its output goes to ``logs/launcher.log``, never through a
        link planted there or at ``logs/``. A process whose pid cannot be recorded is ended again (the
        caller marks the run failed): nothing could tell later whether it still runs."""
        env = job_env(spec.parallel.nproc)
        remove_endpoint(
            run_dir
        )  # (a served run's, left by a job that was killed: the new job writes its own)
        log = guarded_open(run_dir.root, run_dir.logs / LAUNCHER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            proc = subprocess.Popen(
                torchrun_command(spec, run_dir.root, resume),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: Ctrl-C in the notebook does not reach the job
                env=env,
            )
        finally:
            os.close(log)
        _started.append((proc, spec.parallel.nproc * omp_threads(env.get("OMP_NUM_THREADS"))))
        try:
            # a job gone already is still recorded by its pid: its handle then reads its exit
            me = ProcessIdentity.of(proc.pid) or ProcessIdentity(proc.pid, None, this_host())
            update_status(run_dir.root, **process_fields(me))
        except BaseException:
            kill_job(proc.pid)
            raise
        return job_ref(me)

    def status(self, ref: JobRef) -> EngineJob | None:
        """RUNNING while the process of ``ref`` runs; EXITED (final) once it is gone, clean only if this
        Python started it and saw it exit with 0; None for a process on another host (this machine
        cannot tell)."""
        me = identity_of(ref)
        alive = me.alive()
        if alive is None:
            return None
        if alive:
            return EngineJob("RUNNING", f"the job's process (pid {me.pid}) runs")
        code = next((p.poll() for p, _ in _started if p.pid == me.pid), None)
        how = f"exited (code {code})" if code is not None else "is gone"
        return EngineJob("EXITED", f"the job's process (pid {me.pid}) {how}", final=True, clean=code == 0)

    def stop(self, ref: JobRef) -> None:
        """SIGTERM the job's ranks (:func:`terminate_job`), if its recorded process still is the job."""
        me = identity_of(ref)
        if me.alive():
            terminate_job(me.pid)

    def kill(self, ref: JobRef, timeout: float = 120) -> EngineJob | None:
        """SIGKILL the job's whole process tree (:func:`kill_job`), if its recorded process still is the
        job, and wait until it is gone."""
        me = identity_of(ref)
        if me.alive():
            kill_job(me.pid)
        deadline = time.monotonic() + timeout
        while me.alive():
            if time.monotonic() > deadline:
                raise LauncherError(f"pid {me.pid} still runs {timeout:.0f} s after SIGKILL")
            time.sleep(0.05)
        return self.status(ref)


def job_ref(me: ProcessIdentity) -> JobRef:
    """The local launcher's JobRef of the job whose process is ``me``: what :meth:`LocalLauncher.stop`,
    :meth:`~LocalLauncher.kill` and :meth:`~LocalLauncher.status` act on (the liveness stops and kills a
    local run through them)."""
    return JobRef(LocalLauncher.name, identity_id(me))


def identity_id(me: ProcessIdentity) -> str:
    """A process identity as a JobRef's id: ``pid:ticks:boot:start@host`` (an unknown part empty)."""
    parts = (me.pid, me.start_ticks, me.boot_id, me.start_time)
    return ":".join("" if v is None else str(v) for v in parts) + f"@{me.host}"


def identity_of(ref: JobRef) -> ProcessIdentity:
    """The process identity a local JobRef's id holds (:func:`identity_id`); LauncherError if it holds none."""
    try:
        head, host = ref.id.split("@", 1)
        pid, ticks, boot, start = head.split(":")
        return ProcessIdentity(
            int(pid), float(start) if start else None, host, int(ticks) if ticks else None, boot or None
        )
    except ValueError:
        raise LauncherError(f"{ref.id!r} is not a local job's process identity") from None


def started_process(ref: JobRef) -> subprocess.Popen | None:
    """The process this Python started for ``ref`` (None if another one did, or it is another engine's)."""
    if ref.kind != LocalLauncher.name:
        return None
    pid = identity_of(ref).pid
    return next((p for p, _ in _started if p.pid == pid), None)


def torchrun_command(spec: JobSpec, run_dir: Path, resume: bool = False) -> list[str]:
    """The torchrun command line for a single-node job: a rendezvous that listens on 127.0.0.1 only
    and picks free ports, so several runs can go at once. Multi-node jobs use ``launchers/``."""
    from mlora_lab.rendezvous import single_node_torchrun_args  # (torch: only when a job starts)

    torchrun = [
        sys.executable,
        "-m",
        TORCHRUN_MODULE,  # torch.distributed.run, started with the collector off while it imports
        *single_node_torchrun_args(spec.parallel.nproc),
    ]
    return [*torchrun, "-m", JOB_MODULE, str(run_dir), *(["--resume"] if resume else [])]


def job_env(nproc: int) -> dict[str, str]:
    """The environment of a job's processes: ours, plus ``OMP_NUM_THREADS`` (unless set: see
    :mod:`mlora_lab.lab.launchers.threads`; jobs started from here that still run count as busy cores), quiet
    tokenizers and the loopback rendezvous settings."""
    from mlora_lab.rendezvous import loopback_env

    _started[:] = [(p, n) for p, n in _started if p.poll() is None]
    env = dict(os.environ)
    env.update(thread_env(nproc, busy=sum(n for _, n in _started), environ=env))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in loopback_env().items():
        env.setdefault(key, value)
    return env


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
