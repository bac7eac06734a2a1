"""Slurm as the engine of multi-node jobs: the batch script, submission, and what Slurm says of a job.

One Slurm job is one mlora_lab job. Its batch script asks for ``parallel.nnodes`` nodes with one task
each, and ``srun`` starts one torchrun agent per node; the agents meet in torchrun's c10d rendezvous,
hosted by the first node of the allocation, and start ``parallel.nproc`` workers each (one per GPU)::

    sbatch --parsable RUN_DIR/slurm.sbatch          (what ml.launch(spec, launcher="slurm") does)
      └─ batch script on the first node
           └─ srun: one task per node ──► torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
                                              └─ P × python -m mlora_lab.job RUN_DIR

Everything the nodes share goes through the run directory, which must therefore be on a filesystem
every node mounts at the same path (NFS, Lustre, GPFS, ...): ``job.json``, checkpoints, adapters,
``metrics.jsonl``, control messages and every rank's log. So the notebook follows a Slurm job exactly
as it follows a local one, and adds :func:`query` (``scontrol show job``) for what only Slurm knows:
that the job still waits in the queue, and why; or that Slurm cancelled it, timed it out or lost a
node, which a job killed from outside cannot write down itself.

Job states (``JobState``) fall into three groups here: :data:`PENDING_STATES` (the run is ``queued``,
with Slurm's reason: Resources, Priority, ...), :data:`ACTIVE_STATES` (the run directory says how far
it got) and :data:`FINAL_STATES`; only ``COMPLETED`` is a clean end. The script never lets Slurm
requeue the job (``--no-requeue``): a requeued batch script would start the run over from step 0 in
a directory that already holds it; a run that lost a node is resumed from its checkpoint instead.

This module imports no torch: the notebook side uses it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlora_lab.lab.launchers.base import LauncherError
from mlora_lab.lab.slurm.sbatch_args import read_line, script_options, variable_option
from mlora_lab.rundir.status import JOB_MODULE, TORCHRUN_MODULE
from mlora_lab.text import brief

__all__ = [
    "ACTIVE_STATES",
    "FINAL_STATES",
    "PENDING_STATES",
    "SlurmError",
    "SlurmJob",
    "SlurmOptions",
    "cancel",
    "kill",
    "query",
    "render_script",
    "run_dir_problem",
    "sbatch_environment",
    "signal_steps",
    "steps",
    "submit",
    "test_submit",
]

PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
ACTIVE_STATES = frozenset(
    {"CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT"}
)
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)

# What a final state means, in words (the reason a run that ended so is reported as failed).
_MEANING = {
    "CANCELLED": "was cancelled (scancel, or an administrator)",
    "FAILED": "failed",
    "TIMEOUT": "reached its time limit",
    "NODE_FAIL": "lost a node",
    "OUT_OF_MEMORY": "ran out of memory",
    "PREEMPTED": "was preempted",
    "BOOT_FAIL": "could not boot its nodes",
    "DEADLINE": "reached its deadline",
    "SPECIAL_EXIT": "ended with a special exit",
    "REVOKED": "was revoked",
}

# sbatch options (by sbatch's own name; abbreviations and short forms are read as sbatch reads them) that
# an ``extra`` entry may not give: the node and task counts follow parallel.nnodes; the log, working
# directory, requeue policy and name are part of the run directory's contract; some change how sbatch
# answers the launcher; and some are SlurmOptions fields. Each with why.
_NODES = "nodes"
_OWN_OPTIONS: dict[str, str] = {
    **dict.fromkeys(
        (
            "nodes",
            "ntasks",
            "ntasks-per-node",
            "ntasks-per-core",
            "ntasks-per-socket",
            "ntasks-per-gpu",
            "ntasks-per-tres",
        ),
        _NODES,
    ),
    **dict.fromkeys(
        ("output", "error", "open-mode"),
        "the job's output is appended to logs/launcher.log in the run directory, where the run reads it",
    ),
    "chdir": "the job runs in its run directory",
    **dict.fromkeys(
        ("requeue", "no-requeue"),
        "a run is never requeued: a requeued script would start it over from step 0 (resume it instead)",
    ),
    "job-name": "the job is named after its run",
    "wrap": "the job runs the launcher's batch script",
    "parsable": "the launcher submits with sbatch --parsable and reads the job id from its answer",
    "test-only": "the job would never be submitted (the launcher asks sbatch --test-only itself first)",
    "wait": "sbatch would not answer the launcher until the job ended",
    **dict.fromkeys(("help", "usage", "version"), "sbatch would print it and submit nothing"),
    "array": "an array job would run the same run directory several times at once",
    **dict.fromkeys(
        ("clusters", "cluster"), "the launcher follows the job on this cluster (scontrol, scancel)"
    ),
}
_FIELD_OPTIONS = {
    "partition": "partition",
    "time": "time",
    "account": "account",
    "cpus-per-task": "cpus_per_task",
    "gpus-per-node": "gpus_per_node",
    "gpus": "gpus_per_node",
    "gpus-per-task": "gpus_per_node",
}

# Slurm's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; "UNLIMITED"/"INFINITE" for no limit.
_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)")
_NAME = re.compile(r"[A-Za-z0-9_.,+@%-]{1,128}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_EXTRA = 32


class SlurmError(LauncherError):
    """A Slurm command failed (its own message is in the text)."""


@dataclass
class SlurmOptions:
    """What a Slurm job asks for, besides its nodes (``parallel.nnodes``, one task per node).

    ``partition``/``account``/``time`` are passed to ``sbatch`` when given (else the cluster's defaults
    apply); ``time`` is in a Slurm format (``"30"`` minutes, ``"04:00:00"``, ``"1-12:00:00"``).
    ``gpus_per_node``: GPUs per node (0: none; set ``parallel.nproc`` to the same number, one rank per
    GPU, and install a CUDA build of torch). ``cpus_per_task``: CPU cores per node for its agent and
    workers (``OMP_NUM_THREADS`` is set to ``cpus_per_task / nproc``). ``extra``: further sbatch options,
    exactly one per entry, its value after ``=`` or a space (``"--constraint=a100"``, ``"-C a100"``,
    ``"--qos=high"``); each entry becomes one ``#SBATCH`` line, read as sbatch reads it (abbreviations,
    short and bundled options, quotes, ``#`` comments: :mod:`mlora_lab.lab.slurm.sbatch_args`), and an entry
    that gives an option the launcher sets (nodes and tasks, output, error, chdir, requeue, job name,
    wrap, array, cluster, ...) or a field of these options (partition, time, account, cpus, GPUs) is
    refused, however it is spelled. ``setup``: shell lines the batch script runs before
    ``srun`` (``"module load cuda/12.4"``). ``python``: the interpreter on the nodes (default: this
    one, which the nodes must see at the same path). ``rdzv_port``: the rendezvous port on the first
    node (default: 20000 + job id mod 20000, so jobs sharing a node rarely collide)."""

    partition: str | None = None
    time: str | None = None
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    account: str | None = None
    extra: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    python: str | None = None
    rdzv_port: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> SlurmOptions:
        """Build from a dict (unknown keys raise ``ValueError``)."""
        if isinstance(d, SlurmOptions):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"Slurm options must be a JSON object, not {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown Slurm options: {', '.join(map(str, unknown))[:200]}")
        return cls(**d)

    def problems(self, nnodes: int, nproc: int) -> list[str]:
        """Every problem of these options for a job of ``nnodes`` × ``nproc`` ranks (empty: none).
        Each value goes into the batch script, so nothing may carry a line break or a control
        character, and names must be plain Slurm names."""
        out: list[str] = []
        for key in ("partition", "account"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, str) and _NAME.fullmatch(v)):
                out.append(
                    f"slurm.{key} must be a Slurm name (letters, digits, _ . , + @ % -), got {brief(v)}"
                )
        if self.time is not None and not (isinstance(self.time, str) and _TIME.fullmatch(self.time)):
            out.append(
                f"slurm.time must be a Slurm time limit such as '30' (minutes), '04:00:00' or '1-12:00:00', "
                f"got {brief(self.time)}"
            )
        if not _is_int(self.gpus_per_node) or not 0 <= self.gpus_per_node <= 64:
            out.append(
                f"slurm.gpus_per_node must be a whole number from 0 to 64, got {brief(self.gpus_per_node)}"
            )
        elif self.gpus_per_node and _is_int(nproc) and nproc > self.gpus_per_node:
            out.append(
                f"parallel.nproc = {nproc} processes per node but slurm.gpus_per_node = {self.gpus_per_node}: "
                "run one process per GPU (nproc <= gpus_per_node)"
            )
        if self.cpus_per_task is not None and (
            not _is_int(self.cpus_per_task) or not 1 <= self.cpus_per_task <= 4096
        ):
            out.append(
                f"slurm.cpus_per_task must be a whole number from 1 to 4096, got {brief(self.cpus_per_task)}"
            )
        if self.rdzv_port is not None and (
            not _is_int(self.rdzv_port) or not 1024 <= self.rdzv_port <= 65535
        ):
            out.append(f"slurm.rdzv_port must be a port from 1024 to 65535, got {brief(self.rdzv_port)}")
        if self.python is not None and not (
            isinstance(self.python, str) and self.python and not _CONTROL.search(self.python)
        ):
            out.append(f"slurm.python must be the path of a Python interpreter, got {brief(self.python)}")
        out += self._line_problems("extra", self.extra, nnodes)
        out += self._line_problems("setup", self.setup, nnodes)
        return out

    def _line_problems(self, key: str, lines: Any, nnodes: int) -> list[str]:
        if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
            return [f"slurm.{key} must be a list of strings, got {brief(lines)}"]
        if len(lines) > MAX_EXTRA:
            return [f"slurm.{key} has {len(lines)} entries; at most {MAX_EXTRA}"]
        out = []
        for line in lines:
            if _CONTROL.search(line) or len(line) > 1000:
                out.append(
                    f"slurm.{key} entry {brief(line)} has a line break or control character (or is too long)"
                )
            elif key == "extra":
                out += _extra_problems(line, nnodes)
        return out

    def sbatch_lines(self, nnodes: int, job_name: str, log: Path, chdir: Path) -> list[str]:
        """The ``#SBATCH`` lines of the batch script (options validated by :meth:`problems`)."""
        opts = [
            f"--job-name={job_name}",
            f"--nodes={nnodes}",
            "--ntasks-per-node=1",
            "--no-requeue",
            f"--output={log}",
            "--open-mode=append",
            f"--chdir={chdir}",
        ]
        if self.partition:
            opts.append(f"--partition={self.partition}")
        if self.account:
            opts.append(f"--account={self.account}")
        if self.time:
            opts.append(f"--time={self.time}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.gpus_per_node:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        return [f"#SBATCH {o}" for o in opts + list(self.extra)]


def run_dir_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot be a Slurm job's directory (None if it can): it goes into ``#SBATCH``
    lines, in which sbatch splits words at whitespace, reads quotes and backslashes, starts a comment
    at ``#``, and reads ``%`` as a filename pattern (``%j``)."""
    text = str(run_dir)
    bad = sorted({c for c in text if c.isspace() or c in "#%\"'\\" or _CONTROL.match(c)})
    if bad:
        return (
            f"the run directory {text[:200]!r} holds {''.join(bad)!r}: a Slurm job's directory must not "
            "contain whitespace, quotes, backslashes, '#' or '%' (it goes into #SBATCH --output/--chdir)"
        )
    return None


def _extra_problems(entry: str, nnodes: int) -> list[str]:
    """Problems of one ``extra`` entry, read as sbatch reads the ``#SBATCH`` line it becomes
    (:func:`sbatch_args.read_line`: words, abbreviations, short options, values): it must give exactly
    one option, with its value after ``=`` or a space, and not one the launcher sets or does not allow."""
    where = f"slurm.extra entry {brief(entry)}"
    reading = read_line(entry)
    out = [f"{where}: {problem}" for problem in reading.problems]
    if not reading.words and not reading.problems:
        out.append(f"{where} is empty: give one sbatch option per entry, or leave the entry out")
    if len(reading.given) > 1:
        out.append(
            f"{where} holds {len(reading.given)} options ({', '.join(g.spelled for g in reading.given[:10])}): "
            "give one sbatch option per entry (its value after '=' or a space)"
        )
    seen = set()
    for given in reading.given:
        name = given.option.canonical if given.option is not None else None
        if name in seen or (name not in _OWN_OPTIONS and name not in _FIELD_OPTIONS):
            continue
        seen.add(name)
        read_as = "" if given.spelled == f"--{name}" else f" (sbatch reads {given.spelled!r} as --{name})"
        if name in _FIELD_OPTIONS:
            out.append(f"{where} sets --{name}{read_as}: use SlurmOptions.{_FIELD_OPTIONS[name]} instead")
        elif _OWN_OPTIONS[name] == _NODES:
            out.append(
                f"{where} sets --{name}{read_as}, but the node count comes from parallel.nnodes "
                f"(= {nnodes}) with one task per node: change parallel.nnodes instead"
            )
        else:
            out.append(
                f"{where} sets --{name}{read_as}, which the launcher sets itself: {_OWN_OPTIONS[name]}"
            )
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The batch script. Everything inserted is either validated (the #SBATCH lines, setup) or quoted.
SCRIPT = """\
#!/usr/bin/env bash
# mlora_lab job {run_name}: one torchrun agent per node, c10d rendezvous on the first node.
# Written by ml.launch(..., launcher="slurm"); resubmit by hand with: sbatch {script}
{sbatch_lines}
set -euo pipefail
{setup}
HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
# the first node's address as Slurm knows it (NodeAddr: its hostname, or an IP address)
HEAD_ADDR="$(scontrol show node "$HEAD_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)"
RDZV_PORT={rdzv_port}
CPUS="${{SLURM_CPUS_PER_TASK:-$(nproc)}}"
export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( CPUS / {nproc} > 0 ? CPUS / {nproc} : 1 ))}}"
export TOKENIZERS_PARALLELISM=false MLORA_SLURM_JOB_ID="$SLURM_JOB_ID"
echo "slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous at $HEAD_ADDR:$RDZV_PORT"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\
  {python} -m {torchrun_module} \\
  --nnodes "$SLURM_NNODES" --nproc-per-node {nproc} \\
  --rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT" --rdzv-id "mlora-$SLURM_JOB_ID" \\
  --max-restarts 0 \\
  -m {job_module} {run_dir}{resume}
"""


def render_script(
    options: SlurmOptions, run_dir: Path, nnodes: int, nproc: int, script: Path, resume: bool = False
) -> str:
    """The batch script of a job of ``nnodes`` × ``nproc`` ranks on ``run_dir`` (``options`` already
    validated). ``script`` is where it will be written (named in its header)."""
    run_dir = Path(run_dir)
    port = str(options.rdzv_port) if options.rdzv_port else "$(( 20000 + SLURM_JOB_ID % 20000 ))"
    return SCRIPT.format(
        run_name=run_dir.name,
        script=shlex.quote(str(script)),
        sbatch_lines="\n".join(
            options.sbatch_lines(
                nnodes, f"mlora-{run_dir.name}"[:64], run_dir / "logs" / "launcher.log", run_dir
            )
        ),
        setup="\n".join(options.setup),
        rdzv_port=port,
        nproc=int(nproc),
        python=shlex.quote(options.python or sys.executable),
        job_module=JOB_MODULE,
        torchrun_module=TORCHRUN_MODULE,
        run_dir=shlex.quote(str(run_dir)),
        resume=" --resume" if resume else "",
    )


def sbatch_environment(script: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to run sbatch in for ``script``: ``environ`` (default: this process's) without
    the ``SBATCH_*`` input variables of the options the script gives or the launcher owns. sbatch reads
    those variables after the script, so ``SBATCH_REQUEUE=1`` or ``SBATCH_OUTPUT=...`` exported in a
    shell would override the script's ``--no-requeue`` and ``--output``; the others stay (an
    ``SBATCH_ACCOUNT`` default applies where the options set no account)."""
    environ = os.environ if environ is None else environ
    given = script_options(script) | set(_OWN_OPTIONS)
    return {k: v for k, v in environ.items() if variable_option(k) not in given}


def _command(
    args: list[str], timeout: float = 30, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a Slurm command; :class:`SlurmError` if it is missing or cannot be run."""
    if shutil.which(args[0]) is None:
        raise SlurmError(
            f"{args[0]} not found on PATH: Slurm's commands must be installed where the job is launched"
        )
    feed: dict[str, Any] = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, **feed)
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{' '.join(args[:2])} did not answer within {timeout:.0f} s (is slurmctld up?)"
        ) from None


def submit(script: str) -> int:
    """``sbatch --parsable`` of the script's text (given on stdin, so what is submitted is what was
    rendered, whatever happens to a copy on disk): the new job's id. :class:`SlurmError` with sbatch's
    message if Slurm refuses the job (unknown partition, a limit, ...)."""
    proc = _command(["sbatch", "--parsable"], timeout=60, stdin=script, env=sbatch_environment(script))
    out = proc.stdout.strip()
    if proc.returncode != 0 or not out:
        raise SlurmError(f"sbatch refused the job: {(proc.stderr or out).strip()[:2000]}")
    job_id = out.split(";", 1)[0]  # --parsable: "id" or "id;cluster"
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {out[:200]!r}, not a job id")
    return int(job_id)


def test_submit(script: str) -> str | None:
    """Ask Slurm whether it would take ``script`` (``sbatch --test-only``: nothing is submitted); None
    if it would, else sbatch's reason (an unknown partition or account, a limit, ...)."""
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="mlora-test-") as f:
        f.write(script)
        f.flush()
        try:
            proc = _command(["sbatch", "--test-only", f.name], timeout=60, env=sbatch_environment(script))
        except SlurmError as e:
            return str(e)
    if proc.returncode != 0:
        return f"Slurm would refuse the job: {proc.stderr.strip().removeprefix('sbatch: error: ')[:1000]}"
    return None


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says of one job (``scontrol show job``)."""

    job_id: int
    state: str
    """``JobState``: PENDING, RUNNING, COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL, ..."""
    reason: str | None = None
    """``Reason``: why it waits (Resources, Priority, ...) or why it ended (NonZeroExitCode, ...)."""
    exit_code: str | None = None
    """``ExitCode``: ``code:signal`` of the batch script."""
    nodes: str | None = None
    """``NodeList`` (empty while pending)."""

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def clean(self) -> bool:
        """The job ended and its batch script succeeded."""
        return self.state == "COMPLETED"

    def describe(self) -> str:
        """One sentence of why the job ended or waits: ``Slurm job 12 reached its time limit (TIMEOUT,
        reason TimeLimit, exit code 0:15, nodes node[1-2])``."""
        what = _MEANING.get(self.state, "is " + self.state.lower().replace("_", " "))
        if self.pending:
            what = "is waiting in the queue"
        details = [self.state]
        if self.reason and self.reason != "None":
            details.append(f"reason {self.reason}")
        if self.final and self.exit_code and self.exit_code != "0:0":
            details.append(f"exit code {self.exit_code}")
        if self.nodes and self.nodes != "(null)":
            details.append(f"nodes {self.nodes}")
        return f"Slurm job {self.job_id} {what} ({', '.join(details)})"


def query(job_id: int) -> SlurmJob | None:
    """Slurm's record of ``job_id``, or None when Slurm no longer knows it (ended longer ago than the
    cluster's ``MinJobAge``). :class:`SlurmError` when Slurm cannot be asked."""
    proc = _command(["scontrol", "show", "job", "-o", str(int(job_id))])
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmError(f"scontrol show job {job_id}: {proc.stderr.strip()[:500]}")
    fields = _fields(proc.stdout)
    state = fields.get("JobState", "").split("+")[0]
    if not state:
        raise SlurmError(f"scontrol show job {job_id}: no JobState in {proc.stdout[:200]!r}")
    return SlurmJob(int(job_id), state, fields.get("Reason"), fields.get("ExitCode"), fields.get("NodeList"))


def _fields(line: str) -> dict[str, str]:
    """``Key=value`` pairs of one ``scontrol -o`` line (values of the keys read here hold no spaces)."""
    return dict(m.groups() for m in re.finditer(r"(?:^|\s)([A-Za-z]+)=(\S*)", line))


def cancel(job_id: int, signal: str | None = None) -> None:
    """``scancel`` the job (Slurm sends SIGTERM, then SIGKILL after ``KillWait``); with ``signal``,
    send that signal to every process of the job instead (``--full``: the batch script too)."""
    args = ["scancel", str(int(job_id))]
    if signal:
        args[1:1] = ["--full", f"--signal={signal}"]
    proc = _command(args)
    if proc.returncode != 0 and "already completing or completed" not in proc.stderr:
        raise SlurmError(f"scancel {job_id}: {proc.stderr.strip()[:500]}")


def signal_steps(job_id: int, signal: str) -> None:
    """Send ``signal`` to every process of the job's steps (``scancel --signal=SIG JOB``, without
    ``--full``: the batch shell is spared, so it goes on waiting for ``srun``). SIGTERM so reaches the
    torchrun agents, which pass it to their workers: each rank then stops as its stop file would make
    it (finish the step, checkpoint, save, exit)."""
    proc = _command(["scancel", f"--signal={signal}", str(int(job_id))])
    if proc.returncode != 0 and "already completing or completed" not in proc.stderr:
        raise SlurmError(f"scancel --signal={signal} {job_id}: {proc.stderr.strip()[:500]}")


def steps(job_id: int) -> list[str]:
    """The ids of the job's steps that Slurm still runs (``scontrol show step``): ``"12.batch"``,
    ``"12.0"`` (the ``srun`` of the torchrun agents), ...; empty once the job has none or has ended."""
    proc = _command(["scontrol", "-o", "show", "step", str(int(job_id))])
    if proc.returncode != 0:  # "Invalid job id specified", "Job step 12. not found": no step runs
        return []
    return re.findall(r"(?:^|\s)StepId=(\d+\.\w+)", proc.stdout)


def kill(job_id: int) -> None:
    """End the job now: SIGKILL every process of its ``srun`` steps on every node, then cancel it.

    ``scancel --signal=KILL JOB`` does not do that on a running job: Slurm takes it as a cancel, kills
    the batch shell and sends the steps SIGTERM, then SIGKILL only ``KillWait`` seconds later (measured
    on Slurm 22.05: the torchrun agents got SIGTERM and passed it to the workers, which saved and wrote
    ``stopped`` themselves, while ``srun`` lived on, orphaned). A step signalled on its own
    (``scancel --signal=KILL JOB.STEP``) is SIGKILLed at once by its slurmstepd, its whole process
    tree: the torchrun agent and its workers. Then ``srun`` returns, the batch script ends, and the
    ``scancel`` of the job ends whatever is left (a job still queued or in its ``setup`` lines)."""
    for step in steps(job_id):
        if step.split(".", 1)[1].isdigit():  # not the batch (or extern) step: the cancel ends those
            _command(["scancel", "--signal=KILL", step])  # (a step that ended meanwhile is refused)
    cancel(job_id)
