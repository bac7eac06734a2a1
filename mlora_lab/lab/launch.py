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

Launchers are called by name only (:mod:`mlora_lab.lab.launchers.registry`): ``local`` (torchrun here),
``slurm``, ``ray``, or any registered one. Each launcher's options come as the keyword of its name
(``slurm=ml.SlurmOptions(...)``, ``ray=ml.RayOptions(...)``), must be of its ``options_type``, and are
recorded in the run directory (``RunDir.launcher_options``), where a resume finds them again. A launch is
four steps, each one function here:

    check      spec, run directory and launcher (its options, and the engine asked) -> SpecError
    prepare    the run directory: job.json, in-memory rows, sweep.json, the options, ``starting``
    submit     launcher.submit(...) -> JobRef; an engine's job recorded as ``queued`` in status.json
    handle     the run's handle (with the process, when this Python started it)

An engine's run then follows its engine as well as the run directory
(:mod:`mlora_lab.lab.launchers.liveness`): ``queued`` with the engine's reason while the job waits, and
``failed`` with its words when the engine cancels it, times it out or loses a node (a job killed from
outside cannot say so itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from mlora_lab import hub
from mlora_lab.bases import GGUFBaseError, is_gguf, resolve_base
from mlora_lab.lab.launchers import registry
from mlora_lab.lab.launchers.base import Launcher, LauncherError
from mlora_lab.lab.launchers.liveness import Liveness
from mlora_lab.lab.launchers.local import started_process
from mlora_lab.lab.runs import tenant_data
from mlora_lab.lab.runs.attach import handle_for
from mlora_lab.lab.runs.run import DEFAULT_WORKDIR, Run
from mlora_lab.lab.runs.served import ServedRun
from mlora_lab.rundir import (
    RunDir,
    RunDirError,
    RunLock,
    RunState,
    atomic_write_json,
    control,
    read_status,
    update_status,
)
from mlora_lab.rundir.files import link_message
from mlora_lab.rundir.service import remove_endpoint
from mlora_lab.rundir.status import process_fields
from mlora_lab.search import Sweep
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Parallel, Service
from mlora_lab.text import error_line, show_path
from mlora_lab.validate import job_of_sweep, sweep_problems, sweep_slot_modules
from mlora_lab.validate import problems as spec_problems


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


def given_options(**options: Any) -> dict[str, Any]:
    """The launchers' options a caller gave (``slurm=...``, ``ray=...``, ...), without the ones left None."""
    return {name: value for name, value in options.items() if value is not None}


def refuse_unknown_keywords(func: str, options: dict[str, Any]) -> None:
    """Every keyword in ``options`` (what ``**options`` of :func:`launch`, :func:`resume` or ``ml.sweep``
    caught) must name a launcher, whose options it gives: any other is a misspelt argument (``wrkdir=``),
    a ``TypeError`` as Python's own for a function without ``**``, naming the launchers that take options."""
    for name in options:
        if registry.unknown(name) is not None:
            raise TypeError(
                f"{func}() got an unexpected keyword argument {name!r} (launchers take their options as "
                f"{', '.join(f'{n}=...' for n in registry.with_options())})"
            )


def launcher_problems(
    launcher: str | None, spec: JobSpec, options: dict[str, Any], root: Path, resume: bool = False
) -> list[str]:
    """Problems of running ``spec`` with ``launcher`` (None: the caller starts the processes itself) and
    the launchers' ``options`` given: an unknown launcher, options given for another launcher or not of
    the launcher's ``options_type``, and what the launcher itself finds (:meth:`Launcher.check`: several
    nodes on the local one, Slurm options that do not fit, a partition Slurm refuses, a Ray cluster
    without enough nodes, ...), the engine asked before anything is created."""
    if launcher is not None and (problem := registry.unknown(launcher)) is not None:
        return [problem]
    problems = []
    for name in options:
        if registry.unknown(name) is not None:
            takes = ", ".join(f"{n}=" for n in registry.with_options())
            problems.append(f"{name}= names no launcher; launchers take their options as {takes}")
        elif name != launcher:
            problems.append(
                f"{name.capitalize()} options were given, but the launcher is {launcher or 'none'!r}; "
                f"use launcher={name!r}"
            )
    if problems or launcher is None:
        return problems
    try:
        engine = registry.get(launcher)
    except LauncherError as e:
        return [str(e)]
    value, kind = options.get(launcher), engine.options_type
    if value is not None and (kind is None or not isinstance(value, kind)):
        takes = f"takes an ml.{kind.__name__}" if kind is not None else "takes no options"
        return [f"{launcher}= {takes}, not {type(value).__name__}"]
    if not isinstance(spec.parallel, Parallel):  # (its own problem is reported: check the default layout)
        spec = dataclasses.replace(spec, parallel=Parallel())
    return engine.check(spec, value, root, resume)


def _record_options(run: RunDir, engine: Launcher, options: Any) -> None:
    """The launcher's options (its defaults when none were given) as JSON in the run directory, which a
    resume reads again (:func:`read_options`); nothing for a launcher that takes none."""
    kind = engine.options_type
    if kind is not None:
        options = options if options is not None else kind()
        atomic_write_json(run.launcher_options(engine.name), options.to_dict())


def read_options(run: RunDir, launcher: str) -> Any:
    """The options of ``launcher`` the run was launched with. Their setup lines, interpreter or
    environment may run as shell on the nodes (Slurm's ``setup`` and ``python``), so the file is trusted
    only if it is yours and nobody else can write it."""
    engine = registry.get(launcher)
    path, kind = run.launcher_options(launcher), engine.options_type
    again = f"pass {launcher}=ml.{kind.__name__ if kind is not None else 'Options'}(...)"
    try:
        st = path.stat(follow_symlinks=False)
    except OSError as e:
        raise SpecError([f"{path}: cannot be read ({e}); {again}"]) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise SpecError(
            [
                f"{path} is not a file of yours that only you can write, so its setup lines are not run; "
                f"{again} to resume"
            ]
        )
    try:
        return kind.from_dict(json.loads(path.read_text()))  # type: ignore[union-attr]
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise SpecError([f"{path}: cannot be read ({e}); {again}"]) from None


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
    sweep: Sweep | None = None,
    options: dict[str, Any] | None = None,
) -> RunDir:
    """Validate ``spec``, the launcher (and the launchers' ``options``: ``{"slurm": SlurmOptions(...)}``)
    and the run directory (one :class:`~mlora_lab.spec.fields.SpecError` listing every problem; nothing
    is created then), and create the run directory with ``job.json`` (paths made absolute), the
    launcher's options and a ``starting`` status. Tenant rows held in memory (a DataFrame, a list of
    dicts, a datasets.Dataset) are read once, validated, and written into the run directory
    (``data/<tenant>/train.jsonl``, :mod:`~mlora_lab.lab.runs.tenant_data`), which job.json then names
    (relative to itself: a copied run directory reads its own copy). ``launcher=None``: the caller starts
    the processes itself (``launchers/``, on one node or many). With ``lock``, it is left held for the
    caller. With ``sweep`` (:func:`mlora_lab.lab.sweeps.sweep`), the job runs that search over tenant
    slots: it is checked with every value it can give a trial, and written as ``sweep.json``. With a
    launcher, a GGUF base is converted before the directory is created (a file that cannot be converted
    is a SpecError too). If writing the run's files fails half-way (a full disk), a run that has its
    job.json is marked ``failed`` with the cause."""
    options = options or {}
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
    problems += launcher_problems(launcher, spec, options, root)
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
        if launcher is not None:
            _record_options(run, registry.get(launcher), options.get(launcher))
        update_status(run.root, state=RunState.STARTING, started=time.time(), launcher=launcher)
    except BaseException as e:
        if run.is_run() and not isinstance(e, SpecError):
            _fail_start(run, e)
        owner.release()
        raise
    if lock is None:
        owner.release()
    return run


def _submit(run: RunDir, launcher: str, spec: JobSpec, options: Any, resume: bool = False) -> Run:
    """Hand the prepared ``run`` (whose lock the caller holds; a GGUF base is converted already) to its
    launcher, record what it started, and return the run's handle. An engine that queues the job (Slurm,
    Ray) has it recorded as ``launcher_job`` with the run ``queued``; a local job's process is recorded
    by the launcher itself. The caller marks the run failed if this raises (sbatch refuses after all,
    the process cannot be started)."""
    engine = registry.get(launcher)
    remove_endpoint(run)  # (a served run's, left by a job that was killed: the new job writes its own)
    try:
        ref = engine.submit(run, spec, options, resume)
    except LauncherError as e:  # the engine refused after all: the run's error is its own words (sbatch's)
        with contextlib.suppress(OSError):
            update_status(run.root, state=RunState.FAILED, ended=time.time(), error=str(e))
        raise
    if getattr(engine, "queues", True):
        try:
            update_status(run.root, state=RunState.QUEUED, launcher_job=ref, launcher_state=None)
        except BaseException:
            # a job nobody could follow (no launcher_job recorded) must not run on: end it, as local.py
            # ends a process whose identity it cannot record
            with contextlib.suppress(Exception):
                engine.kill(ref)
            raise
    return handle_for(run.root, process=started_process(ref))


def launch(
    spec: JobSpec,
    workdir: str | Path = DEFAULT_WORKDIR,
    launcher: str | None = "local",
    slurm: Any = None,
    sweep: Sweep | None = None,
    *,
    ray: Any = None,
    **options: Any,
) -> Run:
    """Start ``spec`` in the background and return its :class:`Run` at once.

    ``launcher="local"``: torchrun on this machine. ``launcher="slurm"``: one Slurm job of
    ``parallel.nnodes`` nodes (``slurm``: partition, time, GPUs, ... as
    :class:`~mlora_lab.lab.slurm.cluster.SlurmOptions`), submitted with ``sbatch``. ``launcher="ray"``:
    one torchrun agent per node of a Ray cluster (``ray``: its ``RayOptions``). Any registered launcher
    takes its options as the keyword of its name (:mod:`mlora_lab.lab.launchers.registry`). On an engine
    of several machines the run directory must be on a filesystem every node sees at the same path
    (``workdir`` or ``output_dir`` on NFS/Lustre/GPFS, not /tmp), and so must this Python and its
    packages. Everything is checked first: a bad spec, launcher or option raises
    :class:`~mlora_lab.spec.fields.SpecError` naming every problem, and nothing is created or submitted.
    If the job cannot be started or submitted after all, the run is ``failed`` with the cause and the
    error is raised."""
    refuse_unknown_keywords("launch", options)
    launcher = launcher if launcher is not None else "local"  # (None was the local launcher, as before)
    spec = spec.resolved(Path.cwd())
    root = _run_root(spec, workdir)
    given = given_options(slurm=slurm, ray=ray, **options)
    lock = RunLock(RunDir(root))
    spec = dataclasses.replace(spec, output_dir=str(root))
    run = prepare_run(spec, workdir, launcher, lock=lock, sweep=sweep, options=given)
    try:
        return _submit(run, launcher, JobSpec.load(run.job), given.get(launcher))
    except BaseException as e:
        _fail_start(run, e)
        raise
    finally:
        lock.release()


def serve(spec: JobSpec, **launch_kwargs: Any) -> ServedRun:
    """:func:`launch` ``spec`` with the Tinker service on (``spec.service``, or
    :class:`~mlora_lab.spec.parts.Service` defaults: loopback, a free port) and return its
    :class:`~mlora_lab.lab.runs.served.ServedRun` at once::

        svc = ml.serve(spec)
        tc = svc.client().create_lora_training_client(base_model=svc.base_model, rank=8)

    ``svc.base_url`` waits for the job to load its model and listen. ``launch_kwargs`` go to :func:`launch`
    (``launcher="slurm", slurm=...``, ``launcher="ray", ray=...``). The job stays up until it is stopped
    (``svc.stop()``); ``spec.tenants`` may be empty."""
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
    slurm: Any = None,
    *,
    ray: Any = None,
    **options: Any,
) -> Run:
    """Continue a stopped, failed or lost run from its latest intact checkpoint, in the background.

    ``nproc``/``nnodes``/``fsdp``/``ep``/``tp`` change the layout (checkpoints hold full tensors, so any
    layout works). Given any of them, the run's ``tp`` and ``ep`` are kept where they still divide the
    new world (else 1) and ``fsdp`` defaults to ``world / tp``. ``launcher``: ``local``, ``slurm``,
    ``ray``, ... (default: the one the run was launched with); it reuses the options the run recorded
    for that launcher unless new ones are given (``slurm=...``, ``ray=...``). Every problem is reported
    before anything changes, a symlink planted where the job writes (``logs/``, a log, ``control/``, ...)
    included; a GGUF base is converted then too. If the job cannot be started after all, the run is
    ``failed`` with the cause.
    """
    refuse_unknown_keywords("resume", options)
    run = RunDir(Path(run_dir).absolute())
    if not run.is_run():
        raise RunDirError(f"{run.root}: not a run directory (no job.json)")
    lock = RunLock(run)
    lock.acquire()
    try:
        spec, held_back, before = _resumable(run)
        launcher = launcher or (
            before.launcher if before and not registry.unknown(before.launcher) else "local"
        )
        given = given_options(slurm=slurm, ray=ray, **options)
        if (
            launcher not in given
            and not registry.unknown(launcher)
            and run.launcher_options(launcher).is_file()
        ):
            # (a launcher that cannot be loaded here: launcher_problems names it with the others)
            with contextlib.suppress(LauncherError):
                given[launcher] = read_options(run, launcher)
        changed = _relayout(spec, nproc=nproc, nnodes=nnodes, fsdp=fsdp, ep=ep, tp=tp)
        sweep = Sweep.from_dict(json.loads(run.sweep.read_text("utf-8"))) if run.sweep.is_file() else None
        problems = spec_problems(spec if sweep is None else job_of_sweep(spec, sweep)) if changed else []
        problems += launcher_problems(launcher, spec, given, run.root, resume=True)
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
            launcher_job=None,
            launcher_state=None,
        )
        try:
            _record_options(run, registry.get(launcher), given.get(launcher))
            return _submit(run, launcher, spec, given.get(launcher), resume=True)
        except BaseException as e:
            _fail_start(run, e)
            raise
    finally:
        lock.release()


def _resumable(run: RunDir) -> tuple[JobSpec, list[str], Any]:
    """The spec to resume ``run`` with (a base setting changed in job.json since, quantize or dtype, held
    back as the job holds it back, each said in a warning), what was held back, and the run's status
    before (None if corrupt). Raises if the run still goes (``RuntimeError``) or has no intact
    checkpoint (``FileNotFoundError``); a damaged newer checkpoint is warned of and skipped."""
    from mlora_lab.rundir import checkpoint  # (the codec loads torch: a resume starts a job anyway)

    spec = JobSpec.load(run.job)
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
        warnings.warn(f"{damaged.name} is damaged ({reason}); resuming from {path.name}", stacklevel=3)
    held_back = checkpoint.hold_back_base(spec, checkpoint.read_base(path))
    for said in held_back:
        warnings.warn(said, stacklevel=3)
    try:
        before = read_status(run.root)
    except RunDirError:  # corrupt (see above): the launcher it was launched with is unknown
        before = None
    return spec, held_back, before


def _relayout(spec: JobSpec, **given: int | None) -> bool:
    """Change ``spec.parallel`` to the layout ``given`` (nproc, nnodes, fsdp, ep, tp; None: not given),
    keeping ``tp`` and ``ep`` where they still divide the new world (else 1), ``fsdp`` defaulting to
    ``world / tp``. False (nothing changed) when none is given."""
    if all(v is None for v in given.values()):
        return False
    p = spec.parallel
    p.nproc = given["nproc"] or p.nproc
    p.nnodes = given["nnodes"] or p.nnodes
    p.tp = given["tp"] or (p.tp if p.trainers % p.tp == 0 else 1)
    p.fsdp = given["fsdp"] or max(p.trainers // p.tp, 1)
    p.ep = given["ep"] or (p.ep if (p.trainers // p.tp) % p.ep == 0 else 1)
    return True
