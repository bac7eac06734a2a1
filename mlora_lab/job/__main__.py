"""Entry point of a training process: ``python -m mlora_lab.job RUN_DIR [--resume]``, started by torchrun::

    torchrun --nproc-per-node 2 --rdzv-backend mlora-loopback -m mlora_lab.job runs/<id>

Takes the run directory's lock (rank 0: one job per directory), redirects the process's output to
``logs/rank<R>.log`` (never through a link planted there: a log that cannot be opened fails the run,
saying why in status.json), watches the torchrun agent (a worker whose agent was killed exits instead
of training on as an orphan), turns SIGTERM/SIGINT into a graceful stop (finish the step, checkpoint,
save, exit: ``Run.stop()`` sends it when the disk is too full for the stop file), keeps some disk
space in reserve for its last status (``.spare``), re-checks job.json, records the run's state in
status.json, and trains. A served job (``JobSpec.service``) also serves the Tinker API while it trains, from
rank 0 (:class:`~mlora_lab.job.drivers.tinker.job_service.JobService`: its driver first, the server up once the job is assembled,
down when the job ends; the other ranks' service drivers follow rank 0's).
"""

from __future__ import annotations

# ruff: noqa: E402 (the collector goes off before the imports below)
import gc

# A job's start makes millions of objects that live as long as it does (torch's and transformers'
# modules, the model). The collector's passes over them while they are made cost ~15 % of a process's
# start (importing this module: 9.3 s -> 7.9 s of CPU on the lab machine) and find nothing to free, so
# it is off while they are made, and they are frozen out of its later passes (:func:`main`).
gc.disable()

import argparse
import contextlib
import io
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from mlora_lab.job.drivers.default import DEFAULT_DRIVERS
from mlora_lab.job.search import read_sweep
from mlora_lab.job.trainer import Trainer
from mlora_lab.parallel import (
    exit_process,
    init_distributed,
    leave_together,
    shutdown_distributed,
    split_roles,
)
from mlora_lab.rundir import (
    ProcessIdentity,
    RunDir,
    RunDirError,
    RunLock,
    RunState,
    guarded_open,
    read_status,
    update_status,
)
from mlora_lab.rundir.files import reserve_spare
from mlora_lab.rundir.status import process_fields, this_host
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.text import error_line
from mlora_lab.validate import job_of_sweep, problems

gc.enable()  # (and off again in main() until the job is built)

if TYPE_CHECKING:
    from mlora_lab.job.drivers.tinker.job_service import JobService


class LogStream(io.TextIOBase):
    """A job's stdout/stderr: a line that cannot be written (the disk is full) is dropped, never
    raised, so a full disk does not turn the next ``print`` into the end of a shared job."""

    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "w", buffering=1, errors="backslashreplace")

    def write(self, s: str) -> int:
        with contextlib.suppress(OSError):
            self._f.write(s)
        return len(s)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def writable(self) -> bool:
        return True


def redirect_output(run: RunDir, rank: int) -> None:
    """Send this process's stdout and stderr (Python and C level) to rank ``rank``'s log, never through
    a symlink planted at ``logs/`` or at the log (:class:`~mlora_lab.rundir.LinkRefused`)."""
    fd = guarded_open(run.root, run.log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = LogStream(1)
    sys.stderr = LogStream(2)


def record_failure(run: RunDir, error: str) -> None:
    """Mark the run failed with ``error``, unless a rank has already said why it failed (the first
    error is the cause; the others follow from it). On a disk too full even for that, say so in
    the log: status.json keeps its last, intact content, and the notebook side sees the job gone."""
    try:
        current = read_status(run.root)
    except RunDirError:
        current = None
    if current is not None and current.state is RunState.FAILED:
        return
    try:
        update_status(run.root, state=RunState.FAILED, ended=time.time(), error=error)
    except OSError as e:
        print(f"status.json not updated: {e}", flush=True)


def job_process() -> ProcessIdentity | None:
    """The process that stands for the whole job on this node: the torchrun agent (this worker's
    parent) under torchrun, else this process."""
    return ProcessIdentity.of(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid())


def exit_with_agent(poll_s: float = 1.0) -> None:
    """Under torchrun, end this worker when its agent is gone (SIGKILLed, or killed by the OOM killer).

    The agent stops its workers itself when it can; killed outright, it cannot, and torchrun has put
    each worker in a session of its own, so nothing else reaches them: they would go on training as
    orphans, holding the run directory and the device. A daemon thread watches the parent pid."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_s)
        print(f"the torchrun agent (pid {agent}) is gone: this worker exits", flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="mlora-agent-watch", daemon=True).start()


def quiet_progress_bars() -> None:
    """No progress bars in a training process: its output is a log file, where transformers' "Loading
    weights" and "Writing model shards" and huggingface_hub's downloads are walls of carriage returns."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun: ``python -m mlora_lab.job RUN_DIR [--resume]``."""
    parser = argparse.ArgumentParser(description="mlora_lab training job (started by torchrun)")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from the latest intact checkpoint")
    args = parser.parse_args(argv)
    gc.disable()  # until the job is built: see the top of this module
    run = RunDir(args.run_dir)
    rank = int(os.environ.get("RANK", 0))
    exit_with_agent()
    lock = RunLock(run)
    if rank == 0:
        # One job per run directory: a launch hands the lock over within seconds; a second job on
        # the same directory never gets it, and leaves that directory's status and logs alone.
        try:
            lock.acquire(timeout=60)
        except (RunDirError, OSError) as e:
            print(f"not starting: {e}", flush=True)
            return 1
    try:
        redirect_output(run, rank)
    except OSError as e:  # a link planted at logs/ or at the log (LinkRefused), a full disk
        error = f"rank {rank}: cannot write its log: {error_line(e, limit=600)}"
        print(error, file=sys.stderr, flush=True)  # (torchrun's output: logs/launcher.log)
        record_failure(run, error)
        lock.release()
        return 1
    if rank == 0:
        reserve_spare(run.root)
    node = os.environ.get("SLURMD_NODENAME")  # under Slurm: the node as the cluster names it
    where = (
        f"Slurm node {node} (host {this_host()}, job {os.environ.get('SLURM_JOB_ID')})"
        if node
        else this_host()
    )
    print(f"[rank {rank}] pid {os.getpid()} on {where}", flush=True)
    trainer: Trainer | None = None
    service: JobService | None = None
    signalled = False

    def on_signal(signum, frame):  # graceful stop: finish the step, checkpoint, save, exit
        nonlocal signalled
        signalled = True
        if trainer is not None:
            trainer.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # Ctrl-C in a terminal reaches every rank: as graceful
    dist = None
    quiet_progress_bars()
    try:
        dist = init_distributed()
        spec = JobSpec.load(run.job)
        # job.json may have been edited since the launch. (A sweep's trials are checked with the sweep:
        # the job itself is checked for its own tenants, and may have none.)
        sweep = read_sweep(run)
        found = problems(job_of_sweep(spec, sweep) if sweep is not None else spec, files=False)
        if found:
            raise SpecError(found)
        roles = split_roles(dist, spec.parallel.rollout_ranks) if dist.world_size > 1 else None
        if roles is not None and roles.trainer is None:  # a rollout rank: it samples for the RL tenants
            from mlora_lab.job.rollout import serve_rollouts

            server = serve_rollouts(spec, dist, roles)
            leave_together()
            print(
                f"[rank {dist.rank}] rollout rank {roles.rollout_index}: done after sampling {server.works} "
                f"batches in {server.busy_s:.1f} s",
                flush=True,
            )
            return 0
        if dist.is_main:
            update_status(
                run.root,
                state=RunState.RUNNING,
                **process_fields(job_process()),
                error=None,
                ended=None,
            )
        drivers = DEFAULT_DRIVERS
        if spec.service is not None:
            # (imported here: the HTTP server and the tinker SDK cost a job that serves nothing ~1.4 s of start)
            from mlora_lab.job.drivers.tinker.job_service import JobService, follower_drivers

            if dist.is_main:  # rank 0 serves; the others follow its service driver's orders
                service = JobService(spec, run)
            drivers = (
                service.drivers(drivers) if service is not None else follower_drivers(spec, run, drivers)
            )
        info = roles.trainer if roles is not None else dist
        trainer = Trainer(spec, run.root, info, resume=args.resume, drivers=drivers, roles=roles)
        gc.freeze()  # the start's objects: never scanned again (each pass over them would find nothing)
        gc.enable()
        if service is not None:
            service.start()
        trainer.stop_requested |= signalled
        trainer.train()
        trainer.close()
        leave_together()
        if service is not None:  # (before the final state: a reader that sees it finds no endpoint)
            service.stop()
        if dist.is_main:
            state = RunState.STOPPED if trainer.stop_requested else RunState.FINISHED
            update_status(run.root, state=state, ended=time.time())
        print(f"[rank {dist.rank}] done after {trainer.global_step} steps", flush=True)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        record_failure(run, f"rank {rank}: {type(exc).__name__}: {exc}")
        return 1
    finally:
        gc.enable()  # (a job that failed while it was built)
        if service is not None:
            service.stop()
        shutdown_distributed()
        lock.release()


if __name__ == "__main__":
    exit_process(main())  # (not sys.exit: see exit_process)
