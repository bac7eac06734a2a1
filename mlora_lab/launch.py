"""Launching jobs in the background and following them: the notebook and CLI side of a run.

This side never imports the training loop: it writes the run directory and control messages, starts
torchrun as a background process in its own session (a notebook interrupt does not reach it; a stop
reaches every rank through the process group), and reads status.json, metrics.jsonl and logs/.

    run = launch(spec)        # validates first: a bad spec raises SpecError and starts nothing
    run.wait()
    run.metrics()             # pandas DataFrame of train/eval rows

A run directory has one owner: a launch or resume holds its lock (``.lock``) while it checks the
directory and starts the job, and the job's rank 0 holds it while it runs. Launching into a directory
that holds a run is refused (resume it instead); of two launches racing for one directory, one wins.
Single-node jobs rendezvous on 127.0.0.1 only (:mod:`mlora_lab.rendezvous`).

``launcher="slurm"`` submits the job to Slurm instead (:mod:`mlora_lab.slurm`: one torchrun agent per
node); the :class:`Run` then follows Slurm as well as the run directory: ``queued`` with Slurm's reason
while the job waits, and ``failed`` with Slurm's reason when Slurm cancels it, times it out or loses a
node (a job killed from outside cannot say so itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import psutil

from mlora_lab import slurm as slurm_cmd  # (`slurm` is launch()'s options argument)
from mlora_lab.bases import resolve_base
from mlora_lab.rendezvous import loopback_env, single_node_torchrun_args
from mlora_lab.rundir import (
    MetricsReader,
    Op,
    RowKind,
    RunDir,
    RunDirError,
    RunLabels,
    RunLock,
    RunState,
    Status,
    TenantState,
    atomic_write_json,
    atomic_write_text,
    checkpoint,
    control,
    read_labels,
    read_status,
    update_labels,
    update_status,
)
from mlora_lab.rundir.control import ControlError
from mlora_lab.rundir.status import JOB_MODULE, ProcessIdentity, is_job_command, this_host
from mlora_lab.search import Sweep
from mlora_lab.slurm import SlurmError, SlurmJob, SlurmOptions
from mlora_lab.spec import JobSpec, Parallel, SpecError, Tenant
from mlora_lab.threads import omp_threads, thread_env
from mlora_lab.validate import problems as spec_problems
from mlora_lab.validate import sweep_problems, sweep_slot_modules, tenant_problems

DEFAULT_WORKDIR = "runs"
LAUNCHERS = ("local", "slurm")
MULTI_NODE = (
    "launch it with launcher='slurm' (ml.launch(spec, launcher='slurm', slurm=ml.SlurmOptions(...)), or "
    "`mlora-lab run job.json --launcher slurm`), or start launchers/multinode.sh on every node"
)


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _run_root(spec: JobSpec, workdir: str | Path) -> Path:
    """The run directory: ``output_dir``, else a new directory under ``workdir``."""
    out = spec.output_dir
    return Path(out if isinstance(out, str) and out else Path(workdir) / new_run_id()).absolute()


def _directory_problem(root: Path) -> str | None:
    """Why ``root`` cannot take a new run (None if it can: it is missing, or empty)."""
    if not root.exists():
        return None
    if not root.is_dir():
        return f"output_dir {str(root)!r} exists and is not a directory"
    if RunDir(root).is_run():
        return (
            f"{root} already holds a run; continue it with ml.resume({str(root)!r}) (or `mlora-lab resume`), "
            "or choose another output_dir"
        )
    if any(p.name != ".lock" for p in root.iterdir()):
        return f"output_dir {str(root)!r} is not empty; give a new or empty directory for the run"
    return None


def _launcher_problems(
    launcher: str | None, parallel: Any, options: SlurmOptions | None, root: Path, resume: bool = False
) -> list[str]:
    """Problems of running a job laid out as ``parallel`` with ``launcher`` (and its Slurm options):
    an unknown launcher, several nodes on the local one, Slurm options that do not fit. Slurm itself
    is asked too (``sbatch --test-only`` of the script that would be submitted), so a partition or
    account it refuses is reported before anything is created."""
    if launcher is not None and launcher not in LAUNCHERS:
        return [f"unknown launcher {launcher!r}; known: {', '.join(LAUNCHERS)}"]
    p = parallel if isinstance(parallel, Parallel) else Parallel()
    nnodes, nproc = p.nnodes, p.nproc
    if launcher != "slurm":
        if options is not None:
            return [
                f"Slurm options were given, but the launcher is {launcher or 'none'!r}; use launcher='slurm'"
            ]
        if launcher == "local" and nnodes != 1:
            return [f"parallel.nnodes = {nnodes}: the local launcher runs on this machine only; {MULTI_NODE}"]
        return []
    options = options if options is not None else SlurmOptions()
    if not isinstance(options, SlurmOptions):
        return [f"slurm= takes an ml.SlurmOptions, not {type(options).__name__}"]
    problems = options.problems(nnodes, nproc)
    if (problem := slurm_cmd.run_dir_problem(root)) is not None:
        problems.append(problem)
    if shutil.which("sbatch") is None:
        problems.append("the slurm launcher needs Slurm's commands (sbatch, scontrol, scancel) on PATH")
    if not problems:
        script = slurm_cmd.render_script(options, root, nnodes, nproc, RunDir(root).slurm_script, resume)
        if (refused := slurm_cmd.test_submit(script)) is not None:
            problems.append(refused)
    return problems


def prepare_run(
    spec: JobSpec,
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str | None = None,
    lock: RunLock | None = None,
    slurm_options: SlurmOptions | None = None,
    sweep: Sweep | None = None,
) -> RunDir:
    """Validate ``spec``, the launcher (and its Slurm options) and the run directory (one
    :class:`~mlora_lab.spec.SpecError` listing every problem; nothing is created then), and create the
    run directory with ``job.json`` (paths made absolute) and a ``starting`` status. ``launcher=None``:
    the caller starts the processes itself (``launchers/``, on one node or many). With ``lock``, it is
    left held for the caller. With ``sweep`` (:func:`mlora_lab.sweeps.sweep`), the job runs that search
    over tenant slots: it is checked with every value it can give a trial, and written as ``sweep.json``."""
    spec = spec.resolved(Path.cwd())
    root = _run_root(spec, workdir)
    if sweep is not None:
        sweep = dataclasses.replace(
            sweep, base=dataclasses.replace(spec, tenants=[sweep.base]).resolved(Path.cwd()).tenants[0]
        )
        spec = dataclasses.replace(spec, slot_modules=sweep_slot_modules(spec, sweep))
        problems = sweep_problems(spec, sweep)
    else:
        problems = spec_problems(spec)
    if (problem := _directory_problem(root)) is not None:
        problems.append(problem)
    problems += _launcher_problems(launcher, spec.parallel, slurm_options, root)
    if problems:
        raise SpecError(problems)
    run = RunDir(root)
    owner = lock or RunLock(run)
    try:
        owner.acquire()
    except RunDirError as e:
        raise SpecError([str(e)]) from None
    try:
        if (problem := _directory_problem(root)) is not None:  # another launch got here first
            raise SpecError([problem])
        run.create()
        spec.to_json(run.job)
        if sweep is not None:
            atomic_write_json(run.sweep, sweep.to_dict())
        if launcher == "slurm":
            atomic_write_json(run.slurm_options, (slurm_options or SlurmOptions()).to_dict())
        update_status(run.root, state=RunState.STARTING, started=time.time(), launcher=launcher)
    except BaseException:
        owner.release()
        raise
    if lock is None:
        owner.release()
    return run


def torchrun_command(spec: JobSpec, run_dir: Path, resume: bool = False) -> list[str]:
    """The torchrun command line for a single-node job: a rendezvous that listens on 127.0.0.1 only
    and picks free ports, so several runs can go at once. Multi-node jobs use ``launchers/``."""
    return [
        sys.executable, "-m", "torch.distributed.run", *single_node_torchrun_args(spec.parallel.nproc),
        "-m", JOB_MODULE, str(run_dir),
    ] + (["--resume"] if resume else [])  # fmt: skip


# Jobs this process started, with the threads they were given: the next job's threads leave room for them.
_started: list[tuple[subprocess.Popen, int]] = []


def _job_env(nproc: int) -> dict[str, str]:
    """The environment of a job's processes: ours, plus ``OMP_NUM_THREADS`` (unless set: see
    :mod:`mlora_lab.threads`; jobs started from here that still run count as busy cores), quiet
    tokenizers and the loopback rendezvous settings."""
    _started[:] = [(p, n) for p, n in _started if p.poll() is None]
    env = dict(os.environ)
    env.update(thread_env(nproc, busy=sum(n for _, n in _started), environ=env))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in loopback_env().items():
        env.setdefault(key, value)
    return env


def _start(run_dir: RunDir, spec: JobSpec, resume: bool = False) -> Run:
    """Start torchrun for ``run_dir`` (whose lock the caller holds) and record its process. A GGUF
    base is converted first (once; mlora_lab.bases), so its errors come before any process starts and
    the ranks find it ready."""
    resolve_base(spec.base_model)
    env = _job_env(spec.parallel.nproc)
    with open(run_dir.logs / "launcher.log", "ab") as log:
        proc = subprocess.Popen(
            torchrun_command(spec, run_dir.root, resume),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: Ctrl-C in the notebook does not reach the job
            env=env,
        )
    _started.append((proc, spec.parallel.nproc * omp_threads(env.get("OMP_NUM_THREADS"))))
    me = ProcessIdentity.of(proc.pid)
    update_status(run_dir.root, pid=proc.pid, pid_start_time=me.start_time if me else None, host=this_host())
    return Run(run_dir.root, process=proc)


def _submit(run_dir: RunDir, spec: JobSpec, options: SlurmOptions, resume: bool = False) -> Run:
    """Write the batch script into the run directory and submit it (the caller holds the lock). A
    GGUF base is converted here first, once, as for a local job. The run is ``queued`` with the job
    id in status.json; if sbatch refuses after all, the run is marked failed and :class:`SlurmError`
    says why."""
    resolve_base(spec.base_model)
    p = spec.parallel
    script = slurm_cmd.render_script(options, run_dir.root, p.nnodes, p.nproc, run_dir.slurm_script, resume)
    atomic_write_text(run_dir.slurm_script, script)  # the record; Slurm gets the text itself
    try:
        job_id = slurm_cmd.submit(script)
    except SlurmError as e:
        update_status(run_dir.root, state=RunState.FAILED, ended=time.time(), error=str(e))
        raise
    update_status(
        run_dir.root, state=RunState.QUEUED, launcher="slurm", slurm_job_id=job_id, slurm_state=None
    )
    return Run(run_dir.root)


def launch(
    spec: JobSpec,
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str = "local",
    slurm: SlurmOptions | None = None,
    sweep: Sweep | None = None,
) -> Run:
    """Start ``spec`` in the background and return its :class:`Run` at once.

    ``launcher="local"``: torchrun on this machine. ``launcher="slurm"``: one Slurm job of
    ``parallel.nnodes`` nodes (``slurm``: partition, time, GPUs, ... as :class:`~mlora_lab.slurm.SlurmOptions`),
    submitted with ``sbatch``; the run directory must then be on a filesystem every node sees at the
    same path (``workdir`` or ``output_dir`` on NFS/Lustre/GPFS, not /tmp), and so must this Python
    and its packages. Everything is checked first: a bad spec, launcher or option raises
    :class:`~mlora_lab.spec.SpecError` naming every problem, and nothing is created or submitted."""
    spec = spec.resolved(Path.cwd())
    root = _run_root(spec, workdir)
    lock = RunLock(RunDir(root))
    run_dir = prepare_run(dataclasses.replace(spec, output_dir=str(root)), workdir, launcher, lock=lock,
                          slurm_options=slurm, sweep=sweep)  # fmt: skip
    try:
        if launcher == "slurm":
            return _submit(run_dir, JobSpec.load(run_dir.job), slurm or SlurmOptions())
        return _start(run_dir, JobSpec.load(run_dir.job))
    finally:
        lock.release()


def resume(
    run_dir: str | Path,
    nproc: int | None = None,
    fsdp: int | None = None,
    ep: int | None = None,
    tp: int | None = None,
    launcher: str | None = None,
    nnodes: int | None = None,
    slurm: SlurmOptions | None = None,
) -> Run:
    """Continue a stopped, failed or lost run from its latest intact checkpoint, in the background.

    ``nproc``/``nnodes``/``fsdp``/``ep``/``tp`` change the layout (checkpoints hold full tensors, so any
    layout works). Given any of them, the run's ``tp`` and ``ep`` are kept where they still divide the
    new world (else 1) and ``fsdp`` defaults to ``world / tp``. ``launcher``: ``local`` or ``slurm``
    (default: the one the run was launched with); a Slurm resume reuses the run's Slurm options unless
    ``slurm`` gives new ones. Every problem is reported before anything changes.
    """
    run = RunDir(Path(run_dir).absolute())
    if not run.is_run():
        raise RunDirError(f"{run.root}: not a run directory (no job.json)")
    spec = JobSpec.load(run.job)
    lock = RunLock(run)
    lock.acquire()
    try:
        try:
            state = Run(run.root).status
        except RunDirError:  # a corrupt status.json: no job holds the lock we hold, so none runs
            state = RunState.LOST
        if not state.final:
            raise RuntimeError(f"{run.root} is {state.value}; stop it first")
        path, skipped = checkpoint.latest_intact(run.checkpoints)
        if path is None:
            why = "".join(f"; {p.name}: {reason}" for p, reason in skipped)
            raise FileNotFoundError(f"{run.root}: no intact checkpoint to resume from{why}")
        for damaged, reason in skipped:
            warnings.warn(f"{damaged.name} is damaged ({reason}); resuming from {path.name}", stacklevel=2)
        try:
            before = read_status(run.root)
        except RunDirError:  # corrupt (see above): the launcher it was launched with is unknown
            before = None
        launcher = launcher or (before.launcher if before and before.launcher in LAUNCHERS else "local")
        if launcher == "slurm" and slurm is None and run.slurm_options.is_file():
            slurm = _read_slurm_options(run)
        changed = any(v is not None for v in (nproc, fsdp, ep, tp, nnodes))
        if changed:
            p = spec.parallel
            p.nproc = nproc or p.nproc
            p.nnodes = nnodes or p.nnodes
            p.tp = tp or (p.tp if p.world_size % p.tp == 0 else 1)
            p.fsdp = fsdp or p.world_size // p.tp
            p.ep = ep or (p.ep if (p.world_size // p.tp) % p.ep == 0 else 1)
        problems = spec_problems(spec) if changed else []
        problems += _launcher_problems(launcher, spec.parallel, slurm, run.root, resume=True)
        if problems:
            raise SpecError(problems)
        if changed:
            spec.to_json(run.job)
        control.clear_stop(run.root)
        update_status(run.root, state=RunState.STARTING, pid=None, pid_start_time=None, host=None, ended=None,
                      error=None, launcher=launcher, slurm_job_id=None, slurm_state=None)  # fmt: skip
        if launcher == "slurm":
            options = slurm or SlurmOptions()
            atomic_write_json(run.slurm_options, options.to_dict())
            started = _submit(run, spec, options, resume=True)
        else:
            started = _start(run, spec, resume=True)
        return attach_started(started)
    finally:
        lock.release()


def _read_slurm_options(run: RunDir) -> SlurmOptions:
    """The Slurm options the run was launched with. Its ``setup`` lines and ``python`` run as shell on
    the nodes, so the file is trusted only if it is yours and nobody else can write it."""
    path = run.slurm_options
    try:
        st = path.stat(follow_symlinks=False)
    except OSError as e:
        raise SpecError([f"{path}: cannot be read ({e}); pass slurm=ml.SlurmOptions(...)"]) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SpecError([
            f"{path} is not a file of yours that only you can write, so its setup lines are not run; "
            "pass slurm=ml.SlurmOptions(...) to resume"
        ])  # fmt: skip
    try:
        return SlurmOptions.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise SpecError(
            [f"{run.slurm_options}: cannot be read ({e}); pass slurm=ml.SlurmOptions(...)"]
        ) from None


def attach_started(run: Run) -> Run:
    """``run`` as the handle its directory calls for (a :class:`~mlora_lab.sweeps.SweepRun` for a
    search), keeping the process it was started with."""
    if not run.dir.sweep.is_file():
        return run
    from mlora_lab.sweeps import SweepRun

    return SweepRun(run.path, process=run._process)


def attach(run_dir: str | Path) -> Run:
    """A :class:`Run` for an existing run directory (after a kernel restart, or a finished run)."""
    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise RunDirError(f"{run_dir}: no such directory")
    if not run.is_run():
        raise RunDirError(f"{run_dir}: not a run directory (no job.json)")
    if run.sweep.is_file():
        from mlora_lab.sweeps import SweepRun

        return SweepRun(run.root)
    return Run(run.root)


RUNS_COLUMNS = ["run", "state", "tenants", "steps", "best_loss", "tags", "note", "started", "path", "problem"]


def runs(workdir: str | Path = DEFAULT_WORKDIR) -> pd.DataFrame:
    """One row per run directory under ``workdir``: id, state, tenants (comma-joined names), global
    steps, ``best_loss`` (the lowest train loss of any tenant; None before the first step), ``tags``
    (comma-joined, in the order they were added: ``table[table.tags.str.contains("baseline")]``),
    ``note`` and start time. A run whose files cannot be read is listed as ``broken``, with the reason
    in ``problem``; unreadable labels leave its tags and note empty and say why in ``problem``."""
    rows = []
    for job in sorted(Path(workdir).glob("*/job.json")):
        row = {"run": job.parent.name, "path": str(job.parent), "problem": None}
        try:
            run = Run(job.parent)
            status = read_status(job.parent)
            metrics = run.rows()
            losses = [r["loss"] for r in metrics if r["kind"] == RowKind.TRAIN and r["loss"] is not None]
            row |= {
                "state": run.status.value,
                "tenants": ", ".join(t.name for t in run.spec.tenants),
                "steps": max((r["step"] for r in metrics), default=0),
                "best_loss": min(losses, default=None),
                "started": pd.to_datetime(status.started if status else None, unit="s"),
            }
        except (RunDirError, SpecError, OSError) as e:
            row |= {"state": "broken", "tenants": None, "steps": None, "started": pd.NaT, "problem": str(e)}
        try:
            labels = read_labels(job.parent)
            row |= {"tags": ", ".join(labels.tags), "note": labels.note}
        except RunDirError as e:
            row["problem"] = "; ".join(p for p in (row["problem"], str(e)) if p)
        rows.append(row)
    return pd.DataFrame(rows, columns=RUNS_COLUMNS)


class Request:
    """A control message sent to a run's job (add, remove, pause or resume of a tenant), followed
    from the notebook. The job applies messages at step boundaries; before its first step (while it
    loads the model) it has not looked at the queue yet.

    ``status``: ``waiting`` (the job is still starting), ``queued`` (it will be applied at the next
    step boundary), ``applying``, ``applied``, ``refused`` (``result.error`` says why), or
    ``unanswered`` (the run ended before applying it)."""

    def __init__(self, run: Run, msg_id: str, op: Op, tenant: str) -> None:
        self.run, self.id, self.op, self.tenant = run, msg_id, op, tenant

    def __repr__(self) -> str:
        return f"Request({self.op.value} {self.tenant!r}: {self.status})"

    @property
    def result(self) -> control.ControlResult | None:
        """The job's answer (None until it has applied or refused the message)."""
        return control.read_result(self.run.path, self.id)

    @property
    def done(self) -> bool:
        """True once the job has answered (applied or refused)."""
        return self.result is not None

    @property
    def status(self) -> str:
        """Where the request is now (see the class docstring)."""
        state = self.run.status  # first: a message answered while we look is then seen below
        stage = control.stage(self.run.path, self.id)
        if stage == "answered":
            return "applied" if self.result.ok else "refused"
        if stage == "applying":
            return "applying"
        if state.final or stage == "unknown":  # (unknown: someone deleted the queued file)
            return "unanswered"
        return "waiting" if state in (RunState.QUEUED, RunState.STARTING) else "queued"

    def wait(self, timeout: float = 120, quiet: bool = False) -> control.ControlResult:
        """Block until the job answers (at most ``timeout`` seconds); returns the result, raises
        :class:`~mlora_lab.rundir.ControlError` if the job refused the message or ended first. Unless
        ``quiet``, says in one line what it is waiting for once it has waited a second (the job may
        still be loading its model), and once more if that changes."""
        said: set[str] = set()

        def on_wait(seconds: float) -> None:
            if quiet:
                return
            state = self.run.status
            what = (
                f"waiting for the job to start (loading the model) before it can {self._doing}..."
                if state in (RunState.QUEUED, RunState.STARTING)
                else f"waiting for the job to {self._doing} at its next step boundary..."
            )
            if what not in said:
                said.add(what)
                print(what, flush=True)

        return control.wait_result(
            self.run.path, self.id, timeout, is_alive=lambda: not self.run.status.final, on_wait=on_wait
        )

    @property
    def _doing(self) -> str:
        return f"{self.op.value} tenant {self.tenant!r}"  # "add tenant 'x'", "pause tenant 'x'", ...


class Run:
    """Handle on one run directory; every method only reads files or writes control messages."""

    def __init__(self, run_dir: str | Path, process: subprocess.Popen | None = None) -> None:
        self.dir = RunDir(Path(run_dir).absolute())
        self._process = process
        self._reader = MetricsReader(self.dir.metrics)
        self._tables: dict[tuple[RowKind, ...], tuple[int, int, pd.DataFrame | None]] = {}
        self._slurm_seen: tuple[float, int, SlurmJob | SlurmError | None] | None = None

    def __repr__(self) -> str:
        try:
            state = self.status.value
        except (RunDirError, OSError) as e:
            state = f"unreadable: {e}"
        return f"Run({str(self.dir.root)!r}, status={state!r})"

    @property
    def path(self) -> Path:
        return self.dir.root

    @property
    def spec(self) -> JobSpec:
        return JobSpec.load(self.dir.job)

    # -- state ---------------------------------------------------------------------------------
    @property
    def status(self) -> RunState:
        """``queued`` | ``starting`` | ``running`` | ``finished`` | ``failed`` | ``stopped`` | ``lost``.

        A run that says it is starting or running is checked against its process (pid, start time,
        host): if that process is gone, the run ``failed`` (we started it and saw it exit) or is
        ``lost`` (it ended unseen, e.g. killed or the machine restarted); its last checkpoint can be
        resumed. A run on another host is reported as its status file says. A Slurm run is checked
        against Slurm (:meth:`_slurm_status`); :attr:`reason` says why it waits or ended."""
        status = read_status(self.dir.root)
        if status is None:
            return RunState.STARTING
        if status.slurm_job_id is not None and status.slurm_state is None:
            return self._slurm_status(status)
        if status.state.final or self._alive(status) is not False:
            return status.state
        # The job's process is gone but nobody wrote a final state. Re-read first: the job may have
        # written its final state just now.
        status = read_status(self.dir.root) or status
        if status.state.final:
            return status.state
        if self._process is not None:
            state, error = RunState.FAILED, self._death_reason()
        else:
            where = f"pid {status.pid}" + (f" on {status.host}" if status.host else "")
            state, error = (
                RunState.LOST,
                (
                    f"the job's process ({where}) is gone and never wrote a final state (killed, out of memory, "
                    "or the machine restarted); resume it from its last checkpoint"
                ),
            )
        with contextlib.suppress(OSError):  # a full disk: report the truth without recording it
            update_status(self.dir.root, state=state, ended=time.time(), error=error)
        return state

    @property
    def error(self) -> str | None:
        status = read_status(self.dir.root)
        return status.error if status else None

    @property
    def reason(self) -> str | None:
        """Why the run is where it is: Slurm's words while it waits in the queue ("Slurm job 12 is
        waiting in the queue (PENDING, reason Resources)"), the error of a run that failed, was lost
        or killed; None otherwise."""
        state = self.status
        if state is RunState.QUEUED:
            seen = self._slurm_seen[2] if self._slurm_seen else None
            return seen.describe() if isinstance(seen, SlurmJob) else str(seen) if seen else None
        return self.error

    @property
    def slurm_job(self) -> SlurmJob | None:
        """What Slurm says of this run's job now (None: not a Slurm run, or Slurm forgot the job)."""
        status = read_status(self.dir.root)
        if status is None or status.slurm_job_id is None:
            return None
        return slurm_cmd.query(status.slurm_job_id)

    def _ask_slurm(self, job_id: int, max_age: float = 1.0) -> SlurmJob | SlurmError | None:
        """``slurm_cmd.query`` at most once per ``max_age`` seconds (dashboards read the status often)."""
        now = time.monotonic()
        if self._slurm_seen is None or self._slurm_seen[1] != job_id or now - self._slurm_seen[0] > max_age:
            try:
                seen: SlurmJob | SlurmError | None = slurm_cmd.query(job_id)
            except SlurmError as e:
                seen = e
            self._slurm_seen = (now, job_id, seen)
        return self._slurm_seen[2]

    def _slurm_status(self, status: Status) -> RunState:
        """The state of a Slurm run whose end Slurm has not confirmed yet.

        Pending in Slurm: ``queued``. Running: as the run directory says (``starting`` until rank 0
        writes ``running``). Ended: COMPLETED keeps the state the job wrote (``failed`` if it wrote
        none); any other end (cancelled, timed out, a node lost, out of memory, preempted) is
        ``failed`` with Slurm's reason, even when the job managed a graceful save on Slurm's
        SIGTERM, unless it was this side that asked for the stop. The verdict and Slurm's state are
        written to status.json, so Slurm is asked no more. If Slurm cannot be asked (no Slurm
        commands here), the status file is believed."""
        job = self._ask_slurm(status.slurm_job_id)
        if isinstance(job, SlurmError):
            return status.state
        if job is not None and job.pending:
            return RunState.QUEUED
        if job is not None and not job.final:
            if status.state is RunState.QUEUED:
                return RunState.STARTING
            if status.state is RunState.STOPPED and not control.stop_requested(self.dir.root):
                return RunState.RUNNING  # Slurm signalled it (scancel, time limit): its verdict follows
            return status.state
        status = read_status(self.dir.root) or status  # the job may have written its end just now
        if job is None:  # Slurm forgot the job (it ended more than MinJobAge ago)
            slurm_state = "UNKNOWN"
            if status.state.final:
                state, error = status.state, status.error
            else:
                state, error = (
                    RunState.LOST,
                    (
                        f"Slurm no longer knows job {status.slurm_job_id} and the job never wrote a final state; "
                        "resume it from its last checkpoint"
                    ),
                )
        else:
            slurm_state = job.state
            if job.clean:
                state, error = (
                    (status.state, status.error)
                    if status.state.final
                    else (
                        RunState.FAILED,
                        f"{job.describe()}, but the job never wrote a final state; last log lines: "
                        + " | ".join(self.logs(rank=None, tail=5).strip().splitlines()),
                    )
                )
            elif status.state is RunState.STOPPED and control.stop_requested(self.dir.root):
                state, error = status.state, status.error  # our stop, ended by scancel after its timeout
            else:
                own = (
                    f"; the job said: {status.error}"
                    if status.error and status.state is RunState.FAILED
                    else ""
                )
                state, error = RunState.FAILED, f"{job.describe()}{own}; resume it from its last checkpoint"
        with contextlib.suppress(OSError):
            update_status(self.dir.root, state=state, error=error, ended=status.ended or time.time(),
                          slurm_state=slurm_state)  # fmt: skip
        return state

    def _alive(self, status: Status) -> bool | None:
        """Is the job's process alive? None when this machine cannot tell (another host) or nothing
        was started yet (a directory prepared for ``launchers/``)."""
        if self._process is not None:
            return self._process.poll() is None
        identity = status.process
        if identity is not None:
            return identity.alive()
        if status.pid is None:
            return None
        try:  # a status without the process's start time: trust the pid only if it is a job
            p = psutil.Process(status.pid)
            return p.status() != psutil.STATUS_ZOMBIE and is_job_command(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    def _death_reason(self) -> str:
        code = self._process.poll() if self._process is not None else None
        tail = self.logs(rank=None, tail=5).strip().splitlines()
        return f"job exited (code {code}) without a final status; last log lines: {' | '.join(tail)}"

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> RunState:
        """Block until the run ends (or ``timeout`` seconds pass) and return its state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (state := self.status).final:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll)
        if self._process is not None and state.final:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=30)
        return state

    def stop(self, timeout: float = 60) -> RunState:
        """Graceful stop: the job finishes its step, checkpoints, saves adapters and exits.
        After ``timeout`` seconds the job's processes are killed."""
        if (state := self.status).final:
            return state
        if state is RunState.QUEUED:  # nothing runs yet: take it out of Slurm's queue
            self.kill()
            return self.status
        control.request_stop(self.dir.root)
        state = self.wait(timeout)
        if not state.final:
            self.kill()
            state = self.wait(10)
        return state

    def kill(self) -> None:
        """SIGKILL every process of the job, after checking that the recorded process still is the
        job (same pid, start time and host): a stale pid is never signalled. A Slurm job is cancelled
        (``scancel``: SIGKILL to every process on every node, then the job is ended), and this waits
        until Slurm says it has ended."""
        status = read_status(self.dir.root)
        if status is not None and status.slurm_job_id is not None and status.slurm_state is None:
            self._cancel_slurm(status)
            return
        if self._process is not None and self._process.poll() is None:
            _kill_job(self._process.pid)
        elif status is not None and status.process is not None and status.process.alive():
            _kill_job(status.process.pid)
        if status is not None and not status.state.final:
            with contextlib.suppress(OSError):
                update_status(self.dir.root, state=RunState.STOPPED, ended=time.time(), error="killed")

    def _cancel_slurm(self, status: Status, timeout: float = 120) -> None:
        job_id = status.slurm_job_id
        queued = self.status is RunState.QUEUED
        slurm_cmd.cancel(job_id, signal="KILL")
        slurm_cmd.cancel(job_id)
        deadline = time.monotonic() + timeout
        while (job := slurm_cmd.query(job_id)) is not None and not job.final and time.monotonic() < deadline:
            time.sleep(0.5)
        status = read_status(self.dir.root) or status
        ended: dict[str, Any] = {"slurm_state": job.state if job is not None else "UNKNOWN"}
        if not status.state.final:
            what = "cancelled while queued" if queued else "killed"
            ended |= {"state": RunState.STOPPED, "ended": time.time(), "error": f"{what} (scancel {job_id})"}
        with contextlib.suppress(OSError):
            update_status(self.dir.root, **ended)

    # -- live tenant lifecycle (control messages, applied by the job at a step boundary) ------
    def add_tenant(self, tenant: Tenant, wait: bool = True, timeout: float = 120) -> Request:
        """Add ``tenant`` to the running job. It is validated here first (against the job's model,
        ``max_rank``, slots and existing names): a bad tenant raises and nothing is sent. Its paths
        are made absolute here, so the job reads the files that were validated.

        ``wait=True`` blocks until the job has added it (or raises ``ControlError`` with the job's
        reason); a job that is still loading its model picks messages up only once it runs, and the
        wait says so in one line. ``wait=False`` returns at once: the :class:`Request` has ``.status``,
        ``.done``, ``.result`` and ``.wait(timeout)``."""
        spec = self.spec
        tenant = dataclasses.replace(spec, tenants=[tenant]).resolved(Path.cwd()).tenants[0]
        problems = tenant_problems(spec, tenant)
        states = self.tenant_states()
        holding = [t.name for t in spec.tenants if states.get(t.name) is not TenantState.REMOVED]
        if len(holding) >= spec.max_tenants:
            problems.append(f"no free slot: max_tenants={spec.max_tenants} are taken by {holding}")
        if problems:
            raise SpecError(problems)
        return self._control(Op.ADD, tenant.name, wait, timeout, tenant=tenant.to_dict())

    def remove_tenant(self, name: str, wait: bool = True, timeout: float = 120) -> Request:
        """Remove a tenant: its final adapter is saved, its slot cleared and its optimiser dropped.
        ``wait`` as for :meth:`add_tenant`."""
        self._check_known(name)
        return self._control(Op.REMOVE, name, wait, timeout, name=name)

    def pause_tenant(self, name: str, wait: bool = True, timeout: float = 120) -> Request:
        """Stop training a tenant for now (it keeps its slot, optimiser state and data cursor)."""
        self._check_known(name)
        return self._control(Op.PAUSE, name, wait, timeout, name=name)

    def resume_tenant(self, name: str, wait: bool = True, timeout: float = 120) -> Request:
        """Continue training a paused tenant."""
        self._check_known(name)
        return self._control(Op.RESUME, name, wait, timeout, name=name)

    def tenant_state(self, name: str) -> TenantState | None:
        """The tenant's latest state: pending, running, paused, finished, removed, failed or refused."""
        return self.tenant_states().get(name)

    def tenant_states(self) -> dict[str, TenantState]:
        """Every tenant's latest state as its rows say (one pass over the rows), in the order the
        tenants first appear. A tenant the job was still training when it stopped or failed says
        ``running``: :func:`~mlora_lab.rundir.shown_tenant_state` gives the state to show."""
        return {r["tenant"]: TenantState(r["state"]) for r in self.rows() if r["kind"] == RowKind.TENANT}

    def tenant_specs(self) -> dict[str, Tenant | None]:
        """Every tenant the run has, had or was asked to add, in order: job.json's (the job records
        there each tenant it accepts), then those only the rows or control messages know: a refused
        add, one that is still queued or being added, one whose job.json update failed. Their
        configuration is the one their ``add`` message sent (None if that message is gone)."""
        specs: dict[str, Tenant | None] = {t.name: t for t in self.spec.tenants}
        sent = control.sent_tenants(self.dir.root)
        live = [n for n in self.tenant_states() if n not in specs]
        if not self.status.final:  # still on its way into the job: shown as pending
            live += [n for n, s in sent.items() if not s.answered and n not in specs and n not in live]
        for name in live:
            specs[name] = None
            if name in sent:
                with contextlib.suppress(SpecError):
                    specs[name] = Tenant.from_dict(sent[name].tenant)
        return specs

    def _check_known(self, name: str) -> None:
        names = [t.name for t in self.spec.tenants]
        if name not in names:
            raise KeyError(f"no tenant {name!r} in this run; tenants: {names}")

    def _control(self, op: Op, subject: str, wait: bool, timeout: float, **payload) -> Request:
        if (state := self.status).final:
            raise ControlError(f"the run is {state.value}; control messages need a running job")
        request = Request(self, control.send(self.dir.root, op, **payload), op, subject)
        if wait:
            request.wait(timeout)
        return request

    # -- labels (tags and a note; the job never reads them) ---------------------------------------
    @property
    def labels(self) -> RunLabels:
        """The run's tags and note (:class:`~mlora_lab.rundir.RunLabels`)."""
        return read_labels(self.dir.root)

    def tag(self, *tags: str) -> tuple[str, ...]:
        """Add tags (1-40 characters, no whitespace or comma; at most 32 per run); returns them all.
        They are shown, comma-joined, in :func:`runs`."""
        return update_labels(self.dir.root, add=tags).tags

    def untag(self, *tags: str) -> tuple[str, ...]:
        """Take tags away (absent ones are ignored); returns those left."""
        return update_labels(self.dir.root, remove=tags).tags

    def note(self, text: str) -> None:
        """Set the run's note (free text, up to 4000 characters; ``""`` clears it)."""
        update_labels(self.dir.root, note=text)

    # -- outputs -------------------------------------------------------------------------------
    def logs(self, rank: int | None = 0, tail: int | None = 50) -> str:
        """The last ``tail`` lines of rank ``rank``'s log (``None``: the launcher's log)."""
        path = self.dir.logs / "launcher.log" if rank is None else self.dir.log(rank)
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-tail:] if tail else lines)

    def adapter_path(self, tenant: str) -> Path:
        """The PEFT adapter directory of ``tenant``'s latest save."""
        path = self.dir.adapter(tenant)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter saved yet for tenant {tenant!r} in {self.dir.root}")
        return path

    def rows(self) -> list[dict]:
        """All metrics rows so far (read incrementally; after the file was rewritten, e.g. by a
        resume, the rows of the new file)."""
        self._reader.poll()
        return self._reader.rows

    def rows_since(self, cursor: tuple[int, int] = (0, 0)) -> tuple[list[dict], tuple[int, int]]:
        """Rows that arrived since ``cursor`` (returned by the previous call; ``(0, 0)`` = from the
        start) and the new cursor. If metrics.jsonl was rewritten since (a resume drops the rows
        after its checkpoint), every row of the new file: followers start over rather than break."""
        rows = self.rows()
        generation, seen = cursor
        if generation != self._reader.generation:
            seen = 0
        return rows[seen:], (self._reader.generation, len(rows))

    def _table(self, kinds: tuple[RowKind, ...]) -> pd.DataFrame:
        """Rows of ``kinds`` as a DataFrame, extended incrementally: each call converts only the rows
        that arrived since the last one (the DataFrame of the earlier rows is kept, unless the file
        was rewritten since)."""
        rows = self.rows()
        generation, seen, frame = self._tables.get(kinds, (self._reader.generation, 0, None))
        if generation != self._reader.generation:
            seen, frame = 0, None
        new = [r for r in rows[seen:] if r["kind"] in kinds]
        if new or frame is None:
            part = _frame(new)
            frame = part if frame is None or not len(frame) else pd.concat([frame, part], ignore_index=True)
        self._tables[kinds] = (self._reader.generation, len(rows), frame)
        return frame.copy(deep=False)

    def metrics(self) -> pd.DataFrame:
        """Train and eval rows: one row per tenant per logged step."""
        return self._table((RowKind.TRAIN, RowKind.EVAL))

    def system_metrics(self) -> pd.DataFrame:
        """Per-rank memory, step time and throughput rows."""
        return self._table((RowKind.SYSTEM,))

    def tenant_events(self) -> pd.DataFrame:
        """Tenant state changes and per-tenant adapter memory."""
        return self._table((RowKind.TENANT,))

    def events(self) -> pd.DataFrame:
        """Job events: resumed, a damaged checkpoint skipped, a save that failed, ..."""
        return self._table((RowKind.EVENT,))

    def dashboard(self, refresh_s: float = 1.0, **kwargs):
        """A live ipywidgets dashboard of this run (refreshes in the background until the run ends):
        ``ml.Dashboard([run])``; ``kwargs`` go to :class:`~mlora_lab.dashboard.Dashboard`."""
        from mlora_lab.dashboard import Dashboard

        return Dashboard([self], refresh_s=refresh_s, **kwargs).start()

    @property
    def global_step(self) -> int:
        return max((r.get("step", 0) for r in self.rows()), default=0)


def _kill_job(pid: int) -> None:
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


def _frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "time" in df:
        df["time"] = pd.to_datetime(df["time"], unit="s")
    return df
