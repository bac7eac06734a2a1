"""Starting jobs in the background: :func:`launch`, :func:`resume` and :func:`prepare_run`.

This side never imports the job: it writes the run directory and starts torchrun (``python -m``
:data:`~mlora_lab.rundir.status.JOB_MODULE`) as a background process in its own session (a notebook
interrupt does not reach it; a stop reaches every rank through the process group), and returns the
run's handle (:func:`~mlora_lab.lab.runs.attach.handle_for`: a ``Run``, or a ``SweepRun`` for a search).

    run = launch(spec)        # validates first: a bad spec raises SpecError and starts nothing
    run.wait()

A run directory has one owner: a launch or resume holds its lock (``.lock``) while it checks the
directory and starts the job, and the job's rank 0 holds it while it runs. Launching into a directory
that holds a run is refused (resume it instead); of two launches racing for one directory, one wins.
Single-node jobs rendezvous on 127.0.0.1 only (:mod:`mlora_lab.rendezvous`).

Everything that can be checked is checked before the run directory is created (a GGUF base is
converted then too); a resume names every symlink planted where the job writes before it changes
anything, and torchrun's output goes to ``logs/launcher.log`` through no link
(:func:`~mlora_lab.rundir.guarded_open`). Whatever fails once the directory exists, before the job
says ``running`` (the process cannot be started, its pid cannot be recorded), ends the run ``failed``
with the cause: a run is never left ``starting`` for ever.

``launcher="slurm"`` submits the job to Slurm instead (:mod:`mlora_lab.lab.slurm.cluster`: one torchrun agent
per node); the run then follows Slurm as well as the run directory (:mod:`mlora_lab.lab.launchers.liveness`):
``queued`` with Slurm's reason while the job waits, and ``failed`` with Slurm's reason when Slurm
cancels it, times it out or loses a node (a job killed from outside cannot say so itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from mlora_lab import hub
from mlora_lab.bases import GGUFBaseError, is_gguf, resolve_base
from mlora_lab.lab.launchers.liveness import Liveness, kill_job
from mlora_lab.lab.launchers.threads import omp_threads, thread_env
from mlora_lab.lab.records.logs import LAUNCHER_LOG
from mlora_lab.lab.runs import tenant_data
from mlora_lab.lab.runs.attach import handle_for
from mlora_lab.lab.runs.run import DEFAULT_WORKDIR, Run
from mlora_lab.lab.runs.served import ServedRun
from mlora_lab.lab.slurm import cluster as slurm_cmd  # (`slurm` is launch()'s options argument)
from mlora_lab.lab.slurm.cluster import SlurmError, SlurmOptions
from mlora_lab.rundir import (
    RunDir,
    RunDirError,
    RunLock,
    RunState,
    atomic_write_json,
    atomic_write_text,
    control,
    guarded_open,
    read_status,
    update_status,
)
from mlora_lab.rundir.files import link_message
from mlora_lab.rundir.service import remove_endpoint
from mlora_lab.rundir.status import JOB_MODULE, TORCHRUN_MODULE, ProcessIdentity, process_fields, this_host
from mlora_lab.search import Sweep
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Parallel, Service
from mlora_lab.text import error_line, show_path
from mlora_lab.validate import job_of_sweep, sweep_problems, sweep_slot_modules
from mlora_lab.validate import problems as spec_problems

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


def _convert_base(spec: JobSpec) -> None:
    """A GGUF base converted now (once: :func:`~mlora_lab.bases.resolve_base`), before anything of the
    run is created or changed; :class:`~mlora_lab.spec.fields.SpecError` naming the file if it cannot be."""
    if not is_gguf(spec.base_model):
        return
    try:
        resolve_base(spec.base_model)
    except GGUFBaseError as e:
        raise SpecError([f"base_model {e}"]) from None
    except Exception as e:
        why = f"{type(e).__name__}: {error_line(e)}"
        raise SpecError([f"base_model {show_path(spec.base_model)}: cannot be converted ({why})"]) from None


def _pin_revision(spec: JobSpec) -> JobSpec:
    """A Hub base's revision made the commit validation downloaded (job.json records it): every process of
    the run, and a resume on another day, reads that snapshot, whatever the branch points at by then."""
    if not hub.is_hub_id(spec.base_model):
        return spec
    commit = hub.commit_of(hub.local(spec.base_model, spec.revision))
    if commit is None or commit == spec.revision:
        return spec
    return dataclasses.replace(spec, revision=commit)


def _fail_start(run: RunDir, exc: BaseException) -> None:
    """The run could not be started: ``failed`` with the cause (unless it already says how it ended).
    On a disk too full even for that, the run stays as it was."""
    try:
        status = read_status(run.root)
    except RunDirError:
        status = None
    if status is not None and status.state.final:
        return
    error = f"the job could not be started: {type(exc).__name__}: {error_line(exc, limit=600)}"
    with contextlib.suppress(OSError):
        update_status(run.root, state=RunState.FAILED, ended=time.time(), error=error)


def prepare_run(
    spec: JobSpec,
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str | None = None,
    lock: RunLock | None = None,
    slurm_options: SlurmOptions | None = None,
    sweep: Sweep | None = None,
) -> RunDir:
    """Validate ``spec``, the launcher (and its Slurm options) and the run directory (one
    :class:`~mlora_lab.spec.fields.SpecError` listing every problem; nothing is created then), and create the
    run directory with ``job.json`` (paths made absolute) and a ``starting`` status. Tenant rows held in
    memory (a DataFrame, a list of dicts, a datasets.Dataset) are read once, validated, and written into
    the run directory (``data/<tenant>/train.jsonl``, :mod:`~mlora_lab.lab.runs.tenant_data`), which job.json
    then names (relative to itself: a copied run directory reads its own copy). ``launcher=None``:
    the caller starts the processes itself (``launchers/``, on one node or many). With ``lock``, it is
    left held for the caller. With ``sweep`` (:func:`mlora_lab.lab.sweeps.sweep`), the job runs that search
    over tenant slots: it is checked with every value it can give a trial, and written as ``sweep.json``.
    With a launcher, a GGUF base is converted before the directory is created (a file that cannot be
    converted is a SpecError too). If writing the run's files fails half-way (a full disk), a run that
    has its job.json is marked ``failed`` with the cause."""
    # Rows held in memory (a DataFrame, ...) are read once, here: what is validated is what is written.
    spec = tenant_data.freeze_all(spec.resolved(Path.cwd()))
    root = _run_root(spec, workdir)
    if sweep is not None:
        base = dataclasses.replace(spec, tenants=[sweep.base]).resolved(Path.cwd()).tenants[0]
        sweep = dataclasses.replace(sweep, base=tenant_data.freeze(base))
        spec = dataclasses.replace(spec, slot_modules=sweep_slot_modules(spec, sweep))
        problems = sweep_problems(spec, sweep)
    else:
        problems = spec_problems(spec)
    if (problem := _directory_problem(root)) is not None:
        problems.append(problem)
    problems += _launcher_problems(launcher, spec.parallel, slurm_options, root)
    if problems:
        raise SpecError(problems)
    spec = _pin_revision(spec)
    if launcher is not None:
        _convert_base(spec)
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
        spec = tenant_data.write_evals(run, tenant_data.write_all(run, spec))
        spec.to_json(run.job)
        if sweep is not None:
            sweep = dataclasses.replace(sweep, base=tenant_data.write_data(run, sweep.base))
            sweep.write(run.sweep)
        if launcher == "slurm":
            atomic_write_json(run.slurm_options, (slurm_options or SlurmOptions()).to_dict())
        update_status(run.root, state=RunState.STARTING, started=time.time(), launcher=launcher)
    except BaseException as e:
        if run.is_run() and not isinstance(e, SpecError):
            _fail_start(run, e)
        owner.release()
        raise
    if lock is None:
        owner.release()
    return run


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


# Jobs this process started, with the threads they were given: the next job's threads leave room for them.
_started: list[tuple[subprocess.Popen, int]] = []


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


def _start(run_dir: RunDir, spec: JobSpec, resume: bool = False) -> Run:
    """Start torchrun for ``run_dir`` (whose lock the caller holds; a GGUF base is converted already)
    and record its process. Its output goes to ``logs/launcher.log``, never through a link planted
    there or at ``logs/``. A process whose pid cannot be recorded is ended again (the caller marks the
    run failed): nothing could tell later whether it still runs."""
    env = job_env(spec.parallel.nproc)
    remove_endpoint(run_dir)  # (a served run's, left by a job that was killed: the new job writes its own)
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
        # a job gone already is still recorded by its pid: this handle then reads its exit
        me = ProcessIdentity.of(proc.pid) or ProcessIdentity(proc.pid, None, this_host())
        update_status(run_dir.root, **process_fields(me))
    except BaseException:
        kill_job(proc.pid)
        raise
    return handle_for(run_dir.root, process=proc)


def _submit(run_dir: RunDir, spec: JobSpec, options: SlurmOptions, resume: bool = False) -> Run:
    """Write the batch script into the run directory and submit it (the caller holds the lock; a GGUF
    base is converted already, as for a local job). The run is ``queued`` with the job id in
    status.json; if sbatch refuses after all, the run is marked failed and :class:`SlurmError` says why."""
    p = spec.parallel
    remove_endpoint(run_dir)  # (as for a local job)
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
    return handle_for(run_dir.root)


def launch(
    spec: JobSpec,
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str = "local",
    slurm: SlurmOptions | None = None,
    sweep: Sweep | None = None,
) -> Run:
    """Start ``spec`` in the background and return its :class:`Run` at once.

    ``launcher="local"``: torchrun on this machine. ``launcher="slurm"``: one Slurm job of
    ``parallel.nnodes`` nodes (``slurm``: partition, time, GPUs, ... as :class:`~mlora_lab.lab.slurm.cluster.SlurmOptions`),
    submitted with ``sbatch``; the run directory must then be on a filesystem every node sees at the
    same path (``workdir`` or ``output_dir`` on NFS/Lustre/GPFS, not /tmp), and so must this Python
    and its packages. Everything is checked first: a bad spec, launcher or option raises
    :class:`~mlora_lab.spec.fields.SpecError` naming every problem, and nothing is created or submitted. If the
    job cannot be started or submitted after all, the run is ``failed`` with the cause and the error
    is raised."""
    spec = spec.resolved(Path.cwd())
    root = _run_root(spec, workdir)
    lock = RunLock(RunDir(root))
    run_dir = prepare_run(
        dataclasses.replace(spec, output_dir=str(root)),
        workdir,
        launcher,
        lock=lock,
        slurm_options=slurm,
        sweep=sweep,
    )
    try:
        if launcher == "slurm":
            return _submit(run_dir, JobSpec.load(run_dir.job), slurm or SlurmOptions())
        return _start(run_dir, JobSpec.load(run_dir.job))
    except BaseException as e:
        _fail_start(run_dir, e)
        raise
    finally:
        lock.release()


def serve(spec: JobSpec, **launch_kwargs: Any) -> ServedRun:
    """:func:`launch` ``spec`` with the Tinker service on (``spec.service``, or
    :class:`~mlora_lab.spec.parts.Service` defaults: loopback, a free port) and return its
    :class:`~mlora_lab.lab.runs.served.ServedRun` at once::

        svc = ml.serve(spec)
        tc = svc.client().create_lora_training_client(base_model=svc.base_model, rank=8)

    ``svc.base_url`` waits for the job to load its model and listen. ``launch_kwargs`` go to :func:`launch`.
    The job stays up until it is stopped (``svc.stop()``); ``spec.tenants`` may be empty."""
    service = spec.service if spec.service is not None else Service()
    run = launch(dataclasses.replace(spec, service=service), **launch_kwargs)
    return run if isinstance(run, ServedRun) else ServedRun(run.path, process=run.process)


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
    ``slurm`` gives new ones. Every problem is reported before anything changes, a symlink planted
    where the job writes (``logs/``, a log, ``control/``, ...) included; a GGUF base is converted then
    too. If the job cannot be started after all, the run is ``failed`` with the cause.
    """
    from mlora_lab.rundir import checkpoint  # (the codec loads torch: a resume starts a job anyway)

    run = RunDir(Path(run_dir).absolute())
    if not run.is_run():
        raise RunDirError(f"{run.root}: not a run directory (no job.json)")
    spec = JobSpec.load(run.job)
    lock = RunLock(run)
    lock.acquire()
    try:
        try:
            state = Liveness(run.root).verdict().state
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
        # a base setting changed in job.json since (quantize, dtype) is held back, as the job holds it back
        held_back = checkpoint.hold_back_base(spec, checkpoint.read_base(path))
        for said in held_back:
            warnings.warn(said, stacklevel=2)
        try:
            before = read_status(run.root)
        except RunDirError:  # corrupt (see above): the launcher it was launched with is unknown
            before = None
        launcher = launcher or (before.launcher if before and before.launcher in LAUNCHERS else "local")
        if launcher == "slurm" and slurm is None and run.slurm_options.is_file():
            slurm = read_slurm_options(run)
        changed = any(v is not None for v in (nproc, fsdp, ep, tp, nnodes))
        if changed:
            p = spec.parallel
            p.nproc = nproc or p.nproc
            p.nnodes = nnodes or p.nnodes
            p.tp = tp or (p.tp if p.world_size % p.tp == 0 else 1)
            p.fsdp = fsdp or p.world_size // p.tp
            p.ep = ep or (p.ep if (p.world_size // p.tp) % p.ep == 0 else 1)
        sweep = Sweep.from_dict(json.loads(run.sweep.read_text("utf-8"))) if run.sweep.is_file() else None
        problems = spec_problems(spec if sweep is None else job_of_sweep(spec, sweep)) if changed else []
        problems += _launcher_problems(launcher, spec.parallel, slurm, run.root, resume=True)
        problems += [link_message(link, run.root) for link in run.links()]
        if problems:
            raise SpecError(problems)
        _convert_base(spec)
        if changed or held_back:
            spec.to_json(run.job)
        control.clear_stop(run.root)
        update_status(
            run.root,
            state=RunState.STARTING,
            **process_fields(None),
            ended=None,
            error=None,
            launcher=launcher,
            slurm_job_id=None,
            slurm_state=None,
        )
        try:
            if launcher == "slurm":
                options = slurm or SlurmOptions()
                atomic_write_json(run.slurm_options, options.to_dict())
                return _submit(run, spec, options, resume=True)
            return _start(run, spec, resume=True)
        except BaseException as e:
            _fail_start(run, e)
            raise
    finally:
        lock.release()


def read_slurm_options(run: RunDir) -> SlurmOptions:
    """The Slurm options the run was launched with. Its ``setup`` lines and ``python`` run as shell on
    the nodes, so the file is trusted only if it is yours and nobody else can write it."""
    path = run.slurm_options
    try:
        st = path.stat(follow_symlinks=False)
    except OSError as e:
        raise SpecError([f"{path}: cannot be read ({e}); pass slurm=ml.SlurmOptions(...)"]) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SpecError(
            [
                f"{path} is not a file of yours that only you can write, so its setup lines are not run; "
                "pass slurm=ml.SlurmOptions(...) to resume"
            ]
        )
    try:
        return SlurmOptions.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise SpecError(
            [f"{run.slurm_options}: cannot be read ({e}); pass slurm=ml.SlurmOptions(...)"]
        ) from None
