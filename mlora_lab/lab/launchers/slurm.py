"""The ``slurm`` launcher: the :class:`~mlora_lab.lab.launchers.base.Launcher` over Slurm's commands.

Everything Slurm-specific is known in :mod:`mlora_lab.lab.slurm` (the options, the batch script,
sbatch's reading of ``#SBATCH`` lines, Slurm's answers); this module only adapts it to the seam:

    check   SlurmOptions.problems + the run directory's path + Slurm's commands on PATH +
            ``sbatch --test-only`` of the very script that would be submitted
    submit  the batch script written to RUN_DIR/slurm.sbatch (the record) and given to ``sbatch
            --parsable`` on stdin          -> JobRef("slurm", "<job id>")
    status  ``scontrol show job``            -> EngineJob (PENDING...: pending; COMPLETED: clean)
    stop    SIGTERM to the job's steps (the torchrun agents pass it to the ranks: a graceful stop)
    kill    SIGKILL to every process of its steps, ``scancel``, then wait until Slurm says it ended
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

from mlora_lab.lab.launchers.base import EngineJob
from mlora_lab.lab.slurm import cluster
from mlora_lab.lab.slurm.cluster import SlurmError, SlurmJob, SlurmOptions
from mlora_lab.rundir import RunDir, atomic_write_text
from mlora_lab.rundir.status import JobRef
from mlora_lab.spec.job import JobSpec


class SlurmLauncher:
    """One Slurm job of ``parallel.nnodes`` nodes, one torchrun agent per node (:mod:`mlora_lab.lab.slurm.cluster`)."""

    name: ClassVar[str] = "slurm"
    options_type: ClassVar[type | None] = SlurmOptions
    queues: ClassVar[bool] = True

    def check(self, spec: JobSpec, options: Any, run_dir: Path, resume: bool = False) -> list[str]:
        """The options' problems for this layout, a run directory sbatch would misread, Slurm's commands
        missing; and if none, Slurm itself is asked (``sbatch --test-only`` of the script that would be
        submitted), so a partition or account it refuses is reported before anything is created."""
        options = options if options is not None else SlurmOptions()
        p = spec.parallel
        problems = options.problems(p.nnodes, p.nproc)
        if (problem := cluster.run_dir_problem(run_dir)) is not None:
            problems.append(problem)
        if shutil.which("sbatch") is None:
            problems.append("the slurm launcher needs Slurm's commands (sbatch, scontrol, scancel) on PATH")
        if not problems:
            script = cluster.render_script(
                options, run_dir, p.nnodes, p.nproc, RunDir(run_dir).slurm_script, resume
            )
            if (refused := cluster.test_submit(script)) is not None:
                problems.append(refused)
        return problems

    def submit(self, run_dir: RunDir, spec: JobSpec, options: Any = None, resume: bool = False) -> JobRef:
        """Write the batch script into the run directory and submit it; the job's id. :class:`SlurmError`
        with sbatch's words if Slurm refuses it after all."""
        options = options if options is not None else SlurmOptions()
        p = spec.parallel
        script = cluster.render_script(options, run_dir.root, p.nnodes, p.nproc, run_dir.slurm_script, resume)
        atomic_write_text(run_dir.slurm_script, script)  # the record; Slurm gets the text itself
        return JobRef(self.name, str(cluster.submit(script)))

    def status(self, ref: JobRef) -> EngineJob | None:
        """``scontrol show job`` of ``ref`` (None: Slurm forgot it, ended longer ago than ``MinJobAge``)."""
        job = cluster.query(job_id(ref))
        return engine_job(job) if job is not None else None

    def stop(self, ref: JobRef) -> None:
        """SIGTERM to every process of the job's steps (:func:`~mlora_lab.lab.slurm.cluster.signal_steps`)."""
        cluster.signal_steps(job_id(ref), "TERM")

    def kill(self, ref: JobRef, timeout: float = 120) -> EngineJob | None:
        """SIGKILL every process of the job and cancel it (:func:`~mlora_lab.lab.slurm.cluster.kill`),
        then wait until Slurm says it has ended; :class:`SlurmError` with Slurm's state if it has not by
        ``timeout``. A job that ended meanwhile (scancel refuses it) is simply its end."""
        number = job_id(ref)
        try:
            cluster.kill(number)
        except SlurmError:  # scancel refuses a job that ended meanwhile ("Invalid job id")
            if (job := cluster.query(number)) is not None and not job.final:
                raise
        deadline = time.monotonic() + timeout
        while (job := cluster.query(number)) is not None and not job.final:
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"scancel {number}: {job.describe()} still, {timeout:.0f} s after it was cancelled"
                )
            time.sleep(0.5)
        return engine_job(job) if job is not None else None

    def kill_words(self, ref: JobRef) -> str:
        """How a kill of ``ref`` is named in the run's error: ``scancel 42`` (``killed (scancel 42)``,
        ``cancelled while queued (scancel 42)``: the words users have matched on since before the seam)."""
        return f"scancel {ref.id}"


def job_id(ref: JobRef) -> int:
    """The Slurm job id a ``slurm`` JobRef holds; :class:`SlurmError` if it holds none."""
    if ref.kind != SlurmLauncher.name or not ref.id.isdigit():
        raise SlurmError(f"{ref.kind} job {ref.id!r} is not a Slurm job")
    return int(ref.id)


def engine_job(job: SlurmJob) -> EngineJob:
    """Slurm's record as the seam's: its JobState, its one sentence (:meth:`SlurmJob.describe`)."""
    return EngineJob(job.state, job.describe(), pending=job.pending, final=job.final, clean=job.clean)


def slurm_job(ref: JobRef | None) -> SlurmJob | None:
    """What Slurm says of ``ref`` now, in Slurm's own terms (None: not a Slurm job, or Slurm forgot it)."""
    if ref is None or ref.kind != SlurmLauncher.name:
        return None
    return cluster.query(job_id(ref))
