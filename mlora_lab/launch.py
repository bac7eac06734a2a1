"""Launching jobs in the background and following them: the notebook and CLI side of a run.

This side never imports the training loop: it writes the run directory and control messages, starts
torchrun as a background process in its own session (a notebook interrupt does not reach it; a stop
reaches every rank through the process group), and reads status.json, metrics.jsonl and logs/.

    run = launch(spec)        # validates first: a bad spec raises SpecError and starts nothing
    run.wait()
    run.metrics()             # pandas DataFrame of train/eval rows
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import psutil

from mlora_lab import control
from mlora_lab.control import ControlError
from mlora_lab.rundir import FINAL_STATES, MetricsReader, RunDir, read_status, update_status
from mlora_lab.spec import JobSpec, SpecError, Tenant, tenant_problems

DEFAULT_WORKDIR = "runs"


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def prepare_run(spec: JobSpec, workdir: str | Path = DEFAULT_WORKDIR) -> RunDir:
    """Validate ``spec`` (raising :class:`~mlora_lab.spec.SpecError` listing every problem) and create
    the run directory with ``job.json`` (paths made absolute) and a ``starting`` status."""
    spec = spec.resolved(Path.cwd()).validate()
    root = Path(spec.output_dir) if spec.output_dir else Path(workdir) / new_run_id()
    run = RunDir(root.absolute()).create()
    spec.to_json(run.job)
    update_status(run.root, state="starting", pid=None, started=time.time(), ended=None, error=None)
    return run


def torchrun_command(spec: JobSpec, run_dir: Path, resume: bool = False) -> list[str]:
    """The torchrun command line for a single-node job (``--standalone`` picks a free rendezvous port,
    so several runs can go at once). Multi-node jobs use ``launchers/``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.parallel.nproc),
        "--max-restarts", "0",
        "-m", "mlora_lab.train", str(run_dir),
    ] + (["--resume"] if resume else [])  # fmt: skip


def _start(run_dir: RunDir, spec: JobSpec, resume: bool = False) -> Run:
    if spec.parallel.nnodes != 1:
        raise ValueError(
            "launch() starts single-node jobs; for nnodes > 1 use launchers/multinode.sh or slurm.sbatch"
        )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, spec.parallel.nproc))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with open(run_dir.logs / "launcher.log", "ab") as log:
        proc = subprocess.Popen(
            torchrun_command(spec, run_dir.root, resume),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: Ctrl-C in the notebook does not reach the job
            env=env,
        )
    update_status(run_dir.root, pid=proc.pid)
    return Run(run_dir.root, process=proc)


def launch(spec: JobSpec, workdir: str | Path = DEFAULT_WORKDIR) -> Run:
    """Start ``spec`` under torchrun in the background and return its :class:`Run` at once."""
    run_dir = prepare_run(spec, workdir)
    return _start(run_dir, JobSpec.load(run_dir.job))


def resume(
    run_dir: str | Path,
    nproc: int | None = None,
    fsdp: int | None = None,
    ep: int | None = None,
    tp: int | None = None,
) -> Run:
    """Continue a stopped or failed run from its latest complete checkpoint, in the background.

    ``nproc``/``fsdp``/``ep``/``tp`` change the layout (checkpoints hold full tensors, so any layout
    works). Given ``nproc``, the run's ``tp`` and ``ep`` are kept where they still divide the new world
    (else 1) and ``fsdp`` defaults to ``nproc / tp``.
    """
    run = RunDir(Path(run_dir).absolute())
    spec = JobSpec.load(run.job)
    if not any((p / "meta.json").is_file() for p in run.checkpoints.glob("step_*")):
        raise FileNotFoundError(f"{run.root}: no complete checkpoint to resume from")
    if Run(run.root).status in ("starting", "running"):
        raise RuntimeError(f"{run.root} is still running; stop it first")
    if any(v is not None for v in (nproc, fsdp, ep, tp)):
        p = spec.parallel
        p.nproc = nproc or p.nproc
        p.tp = tp or (p.tp if p.world_size % p.tp == 0 else 1)
        p.fsdp = fsdp or p.world_size // p.tp
        p.ep = ep or (p.ep if (p.world_size // p.tp) % p.ep == 0 else 1)
        spec.validate()
        spec.to_json(run.job)
    (run.control / "stop").unlink(missing_ok=True)
    update_status(run.root, state="starting", pid=None, ended=None, error=None)
    return _start(run, spec, resume=True)


def attach(run_dir: str | Path) -> Run:
    """A :class:`Run` for an existing run directory (after a kernel restart, or a finished run)."""
    run = RunDir(run_dir)
    if not run.job.is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no job.json)")
    return Run(run.root)


def runs(workdir: str | Path = DEFAULT_WORKDIR) -> pd.DataFrame:
    """One row per run directory under ``workdir``: id, state, tenants, steps, started."""
    rows = []
    for job in sorted(Path(workdir).glob("*/job.json")):
        run = Run(job.parent)
        spec = run.spec
        rows.append(
            {
                "run": job.parent.name,
                "state": run.status,
                "tenants": ", ".join(t.name for t in spec.tenants),
                "steps": run.global_step,
                "started": pd.to_datetime(read_status(job.parent).get("started"), unit="s"),
                "path": str(job.parent),
            }
        )
    return pd.DataFrame(rows, columns=["run", "state", "tenants", "steps", "started", "path"])


class Run:
    """Handle on one run directory; every method only reads files or writes control messages."""

    def __init__(self, run_dir: str | Path, process: subprocess.Popen | None = None) -> None:
        self.dir = RunDir(Path(run_dir).absolute())
        self._process = process
        self._reader = MetricsReader(self.dir.metrics)
        self._tables: dict[tuple[str, ...], tuple[int, pd.DataFrame | None]] = {}

    def __repr__(self) -> str:
        return f"Run({str(self.dir.root)!r}, status={self.status!r})"

    @property
    def path(self) -> Path:
        return self.dir.root

    @property
    def spec(self) -> JobSpec:
        return JobSpec.load(self.dir.job)

    # -- state ---------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """ "starting" | "running" | "finished" | "failed" | "stopped"."""
        status = read_status(self.dir.root)
        state = status.get("state") or "starting"
        if state in FINAL_STATES or self._alive(status.get("pid")):
            return state
        # The launcher is gone but nobody wrote a final state: the job died (killed, OOM, ...).
        # Re-read first: the trainer may have written its final state just now.
        state = read_status(self.dir.root).get("state") or "starting"
        if state in FINAL_STATES:
            return state
        update_status(self.dir.root, state="failed", ended=time.time(), error=self._death_reason())
        return "failed"

    @property
    def error(self) -> str | None:
        return read_status(self.dir.root).get("error")

    def _alive(self, pid: int | None) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        if not pid:
            return False
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _death_reason(self) -> str:
        code = self._process.poll() if self._process is not None else None
        tail = self.logs(rank=None, tail=5).strip().splitlines()
        return f"job exited (code {code}) without a final status; last log lines: {' | '.join(tail)}"

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> str:
        """Block until the run ends (or ``timeout`` seconds pass) and return its state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.status) not in FINAL_STATES:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll)
        if self._process is not None and state in FINAL_STATES:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=30)
        return state

    def stop(self, timeout: float = 60) -> str:
        """Graceful stop: the job finishes its step, checkpoints, saves adapters and exits.
        After ``timeout`` seconds the whole process group is killed."""
        if self.status in FINAL_STATES:
            return self.status
        (self.dir.control / "stop").write_text(str(time.time()))
        state = self.wait(timeout)
        if state not in FINAL_STATES:
            self.kill()
            state = self.wait(10)
        return state

    def kill(self) -> None:
        """SIGKILL every process of the job (its own process group)."""
        pid = read_status(self.dir.root).get("pid")
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        if read_status(self.dir.root).get("state") not in FINAL_STATES:
            update_status(self.dir.root, state="stopped", ended=time.time(), error="killed")

    # -- live tenant lifecycle (control messages, applied by the job at a step boundary) ------
    def add_tenant(self, tenant: Tenant, wait: bool = True, timeout: float = 120) -> None:
        """Add ``tenant`` to the running job. It is validated here first (against the job's model,
        ``max_rank``, slots and existing names): a bad tenant raises and nothing is sent."""
        spec = self.spec
        problems = tenant_problems(spec, tenant)
        if tenant.name in {t.name for t in spec.tenants}:
            problems.append(f"tenant {tenant.name!r}: a tenant of that name already exists in this run")
        holding = [t.name for t in spec.tenants if self.tenant_state(t.name) != "removed"]
        if len(holding) >= spec.max_tenants:
            problems.append(f"no free slot: max_tenants={spec.max_tenants} are taken by {holding}")
        if problems:
            raise SpecError(problems)
        self._control("add", wait, timeout, tenant=tenant.to_dict())

    def remove_tenant(self, name: str, wait: bool = True, timeout: float = 120) -> None:
        """Remove a tenant: its final adapter is saved, its slot cleared and its optimiser dropped."""
        self._check_known(name)
        self._control("remove", wait, timeout, name=name)

    def pause_tenant(self, name: str, wait: bool = True, timeout: float = 120) -> None:
        """Stop training a tenant for now (it keeps its slot, optimiser state and data cursor)."""
        self._check_known(name)
        self._control("pause", wait, timeout, name=name)

    def resume_tenant(self, name: str, wait: bool = True, timeout: float = 120) -> None:
        """Continue training a paused tenant."""
        self._check_known(name)
        self._control("resume", wait, timeout, name=name)

    def tenant_state(self, name: str) -> str | None:
        """The tenant's latest state: pending, running, paused, finished, removed or failed."""
        events = [r for r in self.rows() if r["kind"] == "tenant" and r["tenant"] == name]
        return events[-1]["state"] if events else None

    def _check_known(self, name: str) -> None:
        names = [t.name for t in self.spec.tenants]
        if name not in names:
            raise KeyError(f"no tenant {name!r} in this run; tenants: {names}")

    def _control(self, op: str, wait: bool, timeout: float, **payload) -> None:
        if self.status in FINAL_STATES:
            raise ControlError(f"the run is {self.status}; control messages need a running job")
        msg_id = control.send(self.dir.root, op, **payload)
        if wait:
            control.wait_result(
                self.dir.root, msg_id, timeout, is_alive=lambda: self.status not in FINAL_STATES
            )

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
        """All metrics rows so far (read incrementally)."""
        self._reader.poll()
        return self._reader.rows

    def _table(self, kinds: tuple[str, ...]) -> pd.DataFrame:
        """Rows of ``kinds`` as a DataFrame, extended incrementally: each call converts only the rows
        that arrived since the last one (the DataFrame of the earlier rows is kept)."""
        rows = self.rows()
        seen, frame = self._tables.get(kinds, (0, None))
        new = [r for r in rows[seen:] if r["kind"] in kinds]
        if new or frame is None:
            part = _frame(new)
            frame = part if frame is None or not len(frame) else pd.concat([frame, part], ignore_index=True)
        self._tables[kinds] = (len(rows), frame)
        return frame.copy(deep=False)

    def metrics(self) -> pd.DataFrame:
        """Train and eval rows: one row per tenant per logged step."""
        return self._table(("train", "eval"))

    def system_metrics(self) -> pd.DataFrame:
        """Per-rank memory, step time and throughput rows."""
        return self._table(("system",))

    def tenant_events(self) -> pd.DataFrame:
        """Tenant state changes and per-tenant adapter memory."""
        return self._table(("tenant",))

    def dashboard(self, refresh_s: float = 1.0):
        """A live ipywidgets dashboard of this run (refreshes in the background until the run ends)."""
        from mlora_lab.dashboard import Dashboard

        return Dashboard(self, refresh_s=refresh_s).start()

    @property
    def global_step(self) -> int:
        return max((r.get("step", 0) for r in self.rows()), default=0)


def _frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if "time" in df:
        df["time"] = pd.to_datetime(df["time"], unit="s")
    return df
