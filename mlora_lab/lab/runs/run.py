"""The handle on one run: :class:`Run` reads the run directory and writes control messages.

    run = ml.launch(spec)        # (mlora_lab.lab.launch) or ml.attach("runs/<id>")
    run.status                   # the state now (read, never written: see mlora_lab.lab.launchers.liveness)
    run.wait(); run.stop()       # ... these record what they find
    run.metrics()                # pandas DataFrame of train and held-out (eval) rows (RL tenants: reward, kl, ...)
    run.completions()            # RL tenants' sampled completions with their rewards
    run.add_tenant(ml.Tenant(...)); run.pause_tenant("alice")

Every method only reads the run directory (status.json, metrics.jsonl through the one typed reader,
logs/, labels.json) or writes control messages the job applies at a step boundary. This module imports
no view and no launcher: :meth:`Run.dashboard` is one call down into :mod:`mlora_lab.lab.dashboard`,
which works on the run directory (``os.fspath(run)``) and this run's :class:`~mlora_lab.lab.launchers.liveness.Liveness`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd

from mlora_lab.lab.launchers.base import EngineJob
from mlora_lab.lab.launchers.liveness import Liveness
from mlora_lab.lab.records.logs import read_log
from mlora_lab.lab.records.series import rows_frame
from mlora_lab.lab.runs import tenant_data
from mlora_lab.lab.runs.agents import AgentHarness
from mlora_lab.rundir import (
    ControlError,
    MetricsReader,
    Op,
    Row,
    RowKind,
    RunDir,
    RunDirError,
    RunLabels,
    RunState,
    TenantRow,
    TenantState,
    control,
    read_labels,
    read_status,
    shown_tenant_state,
    update_labels,
)
from mlora_lab.rundir.files import TextEnum
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant

TENANT_STATES = frozenset(s.value for s in TenantState)

DEFAULT_WORKDIR = "runs"
"""Where a launch puts its run directory (``<workdir>/<run id>``) unless the spec has an ``output_dir``."""


class RequestState(TextEnum):
    """Where a control message is: ``waiting`` (the job is still starting), ``queued`` (it will be
    applied at the next step boundary), ``applying``, ``applied``, ``refused`` (the result says why),
    or ``unanswered`` (the run ended before applying it)."""

    WAITING = "waiting"
    QUEUED = "queued"
    APPLYING = "applying"
    APPLIED = "applied"
    REFUSED = "refused"
    UNANSWERED = "unanswered"


class Request:
    """A control message sent to a run's job (add, remove, pause or resume of a tenant), followed
    from the notebook. The job applies messages at step boundaries; before its first step (while it
    loads the model) it has not looked at the queue yet.

    ``status``: a :class:`RequestState` (``result.error`` says why a message was refused)."""

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
    def status(self) -> RequestState:
        """Where the request is now."""
        state = self.run.status  # first: a message answered while we look is then seen below
        stage = control.stage(self.run.path, self.id)
        if stage == "answered":
            return RequestState.APPLIED if self.result.ok else RequestState.REFUSED
        if stage == "applying":
            return RequestState.APPLYING
        if state.final or stage == "unknown":  # (unknown: someone deleted the queued file)
            return RequestState.UNANSWERED
        return RequestState.WAITING if state in (RunState.QUEUED, RunState.STARTING) else RequestState.QUEUED

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


class Run(AgentHarness):
    """Handle on one run directory; every method only reads files or writes control messages (and, for harness
    tenants, talks to the job's agents' endpoint: :class:`~mlora_lab.lab.runs.agents.AgentHarness`).

    ``process``: the job's torchrun process when this Python process started it (a launch), so that
    a job that dies without writing its end reads ``failed`` with its exit code rather than ``lost``."""

    def __init__(self, run_dir: str | os.PathLike, process: subprocess.Popen | None = None) -> None:
        self.dir = RunDir(Path(run_dir).absolute())
        self.liveness = Liveness(self.dir.root, process)
        self._reader = MetricsReader(self.dir.metrics)
        self._tables: dict[tuple[RowKind, ...], tuple[int, int, pd.DataFrame | None]] = {}

    def __repr__(self) -> str:
        try:
            state = self.status.value
        except (RunDirError, OSError) as e:
            state = f"unreadable: {e}"
        return f"Run({str(self.dir.root)!r}, status={state!r})"

    def __fspath__(self) -> str:
        return str(self.dir.root)

    @property
    def path(self) -> Path:
        return self.dir.root

    @property
    def process(self) -> subprocess.Popen | None:
        """The job's torchrun process, if this Python process started it."""
        return self.liveness.process

    @property
    def spec(self) -> JobSpec:
        return JobSpec.load(self.dir.job)

    # -- state ---------------------------------------------------------------------------------
    @property
    def status(self) -> RunState:
        """``queued`` | ``starting`` | ``running`` | ``finished`` | ``failed`` | ``stopped`` | ``lost``.

        The state as status.json, the job's process and Slurm say together
        (:meth:`~mlora_lab.lab.launchers.liveness.Liveness.verdict`): a run whose process is gone without a final
        state reads ``failed`` (this process started it and saw it exit) or ``lost``; its last checkpoint
        can be resumed. Reading it writes nothing; :meth:`reconcile` records it. :attr:`reason` says why
        a run waits or ended."""
        return self.liveness.verdict().state

    def reconcile(self) -> RunState:
        """:attr:`status`, recorded in status.json when the run ended unseen (its process is gone,
        or Slurm ended or forgot its job): later readers find it written, and Slurm is not asked
        again. ``wait()``, ``stop()``, ``mlora-lab status`` and the dashboard call it."""
        return self.liveness.reconcile().state

    @property
    def error(self) -> str | None:
        """Why the run failed, was lost or was killed (None otherwise)."""
        return self.liveness.verdict().error

    @property
    def reason(self) -> str | None:
        """Why the run is where it is: Slurm's words while it waits in the queue ("Slurm job 12 is
        waiting in the queue (PENDING, reason Resources)") or while its job is still ending ("the job
        wrote 'stopped', but Slurm job 12 is running (RUNNING, ...): its processes are still ending"),
        the error of a run that failed, was lost or killed; None otherwise."""
        verdict = self.liveness.verdict()
        return verdict.waiting if not verdict.state.final and verdict.waiting else verdict.error

    @property
    def engine_job(self) -> EngineJob | None:
        """What the run's engine (Slurm, Ray, ...) says of its job now, in the seam's terms (None: a local
        run, or the engine forgot the job)."""
        return self.liveness.engine_job()

    @property
    def slurm_job(self) -> Any:
        """Deprecated (use :attr:`engine_job`, any engine's job in the seam's terms): what Slurm says of
        this run's job now, in Slurm's own terms, a :class:`~mlora_lab.lab.slurm.cluster.SlurmJob` (None:
        not a Slurm run, or Slurm forgot the job); :class:`~mlora_lab.lab.slurm.cluster.SlurmError` when
        Slurm cannot be asked. Given until mlora_lab 0.3 (or 2027-06-01), with a ``DeprecationWarning``."""
        from mlora_lab.lab.launchers.slurm import slurm_job  # (Slurm's machinery: only when asked)
        from mlora_lab.spec.renames import REMOVAL, warn_old

        warn_old(
            "Run.slurm_job: deprecated, use Run.engine_job (what any engine, Slurm or Ray, says of the "
            f"run's job: an EngineJob). The old name is read until {REMOVAL}, then refused"
        )
        status = read_status(self.dir.root)
        return slurm_job(status.launcher_job if status is not None else None)

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> RunState:
        """Block until the run ends (or ``timeout`` seconds pass) and return its state (recorded:
        :meth:`reconcile`). A Slurm run ends when Slurm says its job has ended, not when the job
        writes its end: nothing of the job is left then (:meth:`~mlora_lab.lab.launchers.liveness.Liveness.wait`).
        After a timeout the state is not final and :attr:`reason` says what Slurm says;
        :class:`~mlora_lab.lab.launchers.base.LauncherError` (``SlurmError`` for Slurm) if the run says it ended but its engine cannot be asked
        whether its job has."""
        state = self.liveness.wait(timeout, poll).state
        if self.process is not None and state.final:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        return state

    def stop(self, timeout: float = 60) -> RunState:
        """Graceful stop: the job finishes its step, checkpoints, saves adapters and exits.
        After ``timeout`` seconds the job's processes are killed. Returns once the run has ended (a
        Slurm run: once Slurm says its job has ended, as :meth:`wait`); the state is not final only if
        even the kill could not end it (:attr:`reason` says why), and a Slurm job that scancel has not
        ended within two minutes raises :class:`~mlora_lab.lab.launchers.base.LauncherError` (``SlurmError``) with Slurm's state.
        On a disk too full for the stop file, the job is sent SIGTERM instead (:meth:`~mlora_lab.lab.launchers.liveness.Liveness.signal_stop`)."""
        if (state := self.reconcile()).final:
            return self.wait(timeout)  # (at once, unless Slurm could not confirm the end yet)
        if state is RunState.QUEUED:  # nothing runs yet: take it out of Slurm's queue
            self.kill()
            return self.reconcile()
        try:
            control.request_stop(self.dir.root)
        except OSError:  # a full disk has no room for the stop file: a signal needs none
            self.liveness.signal_stop()
        state = self.wait(timeout)
        if not state.final:
            self.kill()
            state = self.wait(10)
        return state

    def kill(self) -> None:
        """SIGKILL every process of the job (:meth:`~mlora_lab.lab.launchers.liveness.Liveness.kill`: a stale
        pid is never signalled; a Slurm job is cancelled and waited for)."""
        self.liveness.kill()

    # -- live tenant lifecycle (control messages, applied by the job at a step boundary) ------
    def add_tenant(self, tenant: Tenant, wait: bool = True, timeout: float = 120) -> Request:
        """Add ``tenant`` to the running job. It is validated here first (against the job's model,
        ``max_rank``, slots and existing names): a bad tenant raises and nothing is sent. Its paths
        are made absolute here, so the job reads the files that were validated; rows it holds in memory
        (a DataFrame, ...) are read once, validated and written into the run directory
        (``data/<tenant>/train.jsonl``), and the job reads that file.

        ``wait=True`` blocks until the job has added it (or raises ``ControlError`` with the job's
        reason); a job that is still loading its model picks messages up only once it runs, and the
        wait says so in one line. ``wait=False`` returns at once: the :class:`Request` has ``.status``,
        ``.done``, ``.result`` and ``.wait(timeout)``."""
        from mlora_lab.validate import tenant_problems  # (checks the model's config: not at attach)

        spec = self.spec
        tenant = dataclasses.replace(spec, tenants=[tenant]).resolved(Path.cwd()).tenants[0]
        tenant = tenant_data.freeze(tenant)
        problems = tenant_problems(spec, tenant)
        states = self.tenant_states()
        holding = [t.name for t in spec.tenants if states.get(t.name) is not TenantState.REMOVED]
        if len(holding) >= spec.max_tenants:
            problems.append(f"no free slot: max_tenants={spec.max_tenants} are taken by {holding}")
        if problems:
            raise SpecError(problems)
        tenant = tenant_data.write_data(self.dir, tenant)
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

    def tenant_state(self, name: str) -> TenantState | RunState | None:
        """The tenant's state now (:meth:`tenant_states`); None when no row names it yet."""
        return self.tenant_states().get(name)

    def last_tenant_rows(self) -> dict[str, TenantRow]:
        """Each tenant's latest ``tenant`` row (its state as the job last wrote it, with the reason), in the
        order the tenants first appear in the rows."""
        return {r.tenant: r for r in self.typed_rows() if isinstance(r, TenantRow)}

    def tenant_states(self) -> dict[str, TenantState | RunState]:
        """Every tenant's state now, in the order the tenants first appear in the rows: pending,
        running, paused, finished, removed, failed or refused as its latest row says, except that once
        the run has ended (stopped, failed, lost) a tenant its job was still training shows the run's
        state, as :func:`~mlora_lab.lab.compare.results.summary`, ``mlora-lab status`` and the dashboard do
        (:func:`~mlora_lab.rundir.shown_tenant_state`: the job writes no row for those tenants when it
        stops)."""
        own = {name: r.state for name, r in self.last_tenant_rows().items()}
        run_state = self.status
        if not run_state.final:
            return own
        out: dict[str, TenantState | RunState] = {}
        for name, state in own.items():
            shown = shown_tenant_state(state, run_state)
            out[name] = TenantState(shown) if shown in TENANT_STATES else RunState(shown)
        return out

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
        They are shown, comma-joined, in :func:`~mlora_lab.lab.compare.results.runs`."""
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
        return read_log(self.dir, rank, tail)

    def adapter_path(self, tenant: str) -> Path:
        """The PEFT adapter directory of ``tenant``'s latest save."""
        path = self.dir.adapter(tenant)
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter saved yet for tenant {tenant!r} in {self.dir.root}")
        return path

    def merge(
        self, tenant: str, out_dir: str | os.PathLike, dtype: Any = None, overwrite: bool = False
    ) -> Path:
        """``tenant``'s latest adapter merged into the base model, saved with the tokenizer as a plain
        transformers model in ``out_dir`` (:func:`~mlora_lab.lab.exports.merge`; ``dtype``: of the merged
        weights, default the base's own): a new or empty folder outside every run directory (or in this run's
        ``exports/``); ``overwrite=True`` also takes a folder holding files, replacing only those a merge
        writes. :class:`~mlora_lab.lab.exports.ExportError` (a ``ValueError``) says why a folder is refused."""
        from mlora_lab.lab.exports import merge

        spec = self.spec
        return merge(
            self.adapter_path(tenant), spec.base_model, out_dir, tokenizer=spec.tokenizer, dtype=dtype,
            revision=spec.revision, overwrite=overwrite,
        )  # fmt: skip

    def export(
        self,
        tenant: str,
        format: str = "gguf",
        path: str | os.PathLike | None = None,
        overwrite: bool = False,
    ) -> Path:
        """``tenant``'s latest adapter in another format: ``"gguf"``, a LoRA adapter llama.cpp (and Ollama)
        loads (:func:`~mlora_lab.lab.exports.export_gguf`), written to ``path`` (default:
        ``<run>/exports/<tenant>.gguf``, replacing an earlier export there). A path in a run directory (but
        its ``exports/``) is refused, and an existing file elsewhere is replaced only with ``overwrite=True``."""
        from mlora_lab.lab.exports import export_gguf

        if format != "gguf":
            raise ValueError(f"unknown export format {format!r}; known: 'gguf' (merged models: run.merge)")
        out = Path(path) if path is not None else self.dir.root / "exports" / f"{tenant}.gguf"
        return export_gguf(
            self.adapter_path(tenant),
            self.spec.base_model,
            out,
            revision=self.spec.revision,
            overwrite=overwrite,
        )

    def push_to_hub(self, tenant: str, repo_id: str, private: bool = True, token: str | None = None) -> str:
        """Upload ``tenant``'s latest adapter to the Hub repository ``repo_id`` (private unless
        ``private=False``; :func:`~mlora_lab.lab.exports.push_to_hub`); the commit's URL."""
        from mlora_lab.lab.exports import push_to_hub

        return push_to_hub(self.adapter_path(tenant), repo_id, private=private, token=token)

    def typed_rows(self) -> list[Row]:
        """All metrics rows so far, typed (:class:`~mlora_lab.rundir.TrainRow`, ...), read
        incrementally; after the file was rewritten (a resume), the rows of the new file."""
        self._reader.poll()
        return self._reader.rows

    def rows(self) -> list[Row]:
        """All metrics rows so far, typed (:meth:`typed_rows`): a :class:`~mlora_lab.rundir.TrainRow` per train
        row, ... Each also reads as the JSON object it was (``row["loss"]``, ``row.get("tenant")``);
        ``row.to_dict()`` is that object."""
        return self.typed_rows()

    def rows_since(self, cursor: tuple[int, int] = (0, 0)) -> tuple[list[Row], tuple[int, int]]:
        """Typed rows that arrived since ``cursor`` (returned by the previous call; ``(0, 0)`` = from
        the start) and the new cursor. If metrics.jsonl was rewritten since (a resume drops the rows
        after its checkpoint), every row of the new file: followers start over rather than break."""
        rows = self.typed_rows()
        generation, seen = cursor
        if generation != self._reader.generation:
            seen = 0
        return rows[seen:], (self._reader.generation, len(rows))

    def _table(self, kinds: tuple[RowKind, ...]) -> pd.DataFrame:
        """Rows of ``kinds`` as a DataFrame, extended incrementally: each call converts only the rows
        that arrived since the last one (the DataFrame of the earlier rows is kept, unless the file
        was rewritten since)."""
        rows = self.typed_rows()
        generation, seen, frame = self._tables.get(kinds, (self._reader.generation, 0, None))
        if generation != self._reader.generation:
            seen, frame = 0, None
        new = [r for r in rows[seen:] if r.kind in kinds]
        if new or frame is None:
            part = rows_frame(new)
            frame = part if frame is None or not len(frame) else pd.concat([frame, part], ignore_index=True)
        self._tables[kinds] = (self._reader.generation, len(rows), frame)
        return frame.copy(deep=False)

    def metrics(self) -> pd.DataFrame:
        """Train and held-out loss (kind ``eval``) rows: one row per tenant per logged step (an RL tenant's train
        rows also have ``reward, reward_std, completion_len, kl, clip_ratio``; NaN for an SFT tenant)."""
        return self._table((RowKind.TRAIN, RowKind.HELDOUT))

    def eval_metrics(self) -> pd.DataFrame:
        """The scores of the job's evaluations (``JobSpec.evals``): ``step, model, eval, metric, value, low,
        high, n, time``, a row per model and metric each time one ran (``model`` is ``base`` for the base)."""
        return self._table((RowKind.EVAL_METRIC,))

    def system_metrics(self) -> pd.DataFrame:
        """Per-rank memory, step time and throughput rows."""
        return self._table((RowKind.SYSTEM,))

    def tenant_events(self) -> pd.DataFrame:
        """Tenant state changes and per-tenant adapter memory."""
        return self._table((RowKind.TENANT,))

    def events(self) -> pd.DataFrame:
        """Job events: resumed, a damaged checkpoint skipped, a save that failed, ..."""
        return self._table((RowKind.EVENT,))

    def completions(self) -> pd.DataFrame:
        """RL tenants' sampled completions: ``step, tenant, tenant_step, prompt, completion, reward, time``,
        ``rl.log_completions`` of them per tenant per logged step (their rewards per step are the
        ``reward`` columns of :meth:`metrics`)."""
        return self._table((RowKind.COMPLETION,))

    @property
    def global_step(self) -> int:
        return max((r.step for r in self.typed_rows()), default=0)

    def dashboard(self, refresh_s: float = 1.0, **kwargs: Any) -> Any:
        """A live ipywidgets dashboard of this run (refreshes in the background until the run ends):
        ``ml.Dashboard([run])``; ``kwargs`` go to :class:`~mlora_lab.lab.dashboard.Dashboard`."""
        from mlora_lab.lab.dashboard import Dashboard

        return Dashboard([self], refresh_s=refresh_s, **kwargs).start()
