"""The tenants of a job: who holds which slot, in which state, and everything needed to continue each.

A tenant's life (:class:`~mlora_lab.rundir.TenantState`): ``pending`` → ``running`` ⇄ ``paused`` →
``finished``, or ``removed``; ``failed`` when quarantined (its loss or gradient went NaN/inf, its update
would not be finite or its weights diverged, or its own part of a step raised), when it could not start,
or when a resume held it back (it no longer fits its checkpoint: its saved state is kept). Every change of
state writes a ``tenant`` row with the tenant's adapter and optimiser memory.

:class:`TenantPool` is the one place that fills and frees slots: control messages, the in-job search
and the job's start all go through it, and every change that fills a slot is a :class:`~.agree.Change`
prepared on every rank and agreed (:func:`~.agree.agree`). It knows nothing of where a tenant's rows
come from: that is its driver's :class:`Feed`, kept on the tenant and saved with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mlora_lab import hub
from mlora_lab.job.agree import Change, agree, describe
from mlora_lab.job.engine import Engine
from mlora_lab.job.recorder import Recorder
from mlora_lab.optim import TenantOptimizer, build_optimizer
from mlora_lab.rundir import EventKind, RunDir, TenantRow, TenantState, checkpoint
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant


class Feed(Protocol):
    """A driver's per-tenant state (a tenant's data order and accumulation window, say), saved and
    restored with the tenant. Its ``state_dict`` keys sit beside the pool's in the tenant's checkpoint
    entry, so they must not reuse the pool's keys (:data:`POOL_KEYS`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def reset(self) -> None:
        """Forget the window being accumulated (the tenant was quarantined)."""


FeedFor = Callable[[Tenant], Feed]
"""Makes a tenant's :class:`Feed` (reads and tokenizes its data, say); may raise, touching no slot."""

FIXED_ON_RESUME = ("rank", "alpha", "use_rslora", "target_modules", "target_parameters")
"""Tenant settings a resume cannot change: they make the adapter's shape and scale."""


def _plain(value: Any) -> Any:
    """A setting as JSON holds it (tuples as lists), for comparing job.json with a checkpoint."""
    return list(value) if isinstance(value, tuple | list) else value


POOL_KEYS = (
    "spec",
    "adapter",
    "optimizer",
    "state",
    "reason",
    "step",
    "window_loss",
    "partial_grads",
    "tokens_seen",
)
"""The keys of a tenant's checkpoint entry that the pool writes (its feed writes the others)."""


@dataclass
class TenantRun:
    """A tenant's live training state: spec, optimiser, counters, its loss and gradient since its last
    optimiser step, and its driver's :class:`Feed`."""

    spec: Tenant
    optimizer: TenantOptimizer
    feed: Any  # a Feed
    state: TenantState = TenantState.PENDING
    reason: str | None = None
    step: int = 0  # optimiser steps taken
    tokens_seen: int = 0
    window_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # this process's share
    accumulating: bool = False  # a backward reached it since its last optimiser step

    @property
    def name(self) -> str:
        return self.spec.name

    def new_window(self) -> None:
        """An optimiser step (or a quarantine) ends the window: loss and gradients start again."""
        self.window_loss = torch.zeros((), device=self.window_loss.device)
        self.accumulating = False


class TenantPool:
    """The job's tenants and their slots in ``engine.model``; every lifecycle change goes through here."""

    def __init__(
        self, spec: JobSpec, engine: Engine, recorder: Recorder, run: RunDir | None, is_main: bool
    ) -> None:
        self.spec, self.engine, self.recorder = spec, engine, recorder
        self.run, self.is_main = run, is_main
        self.model, self.comm = engine.model, engine.comm
        self.tenants: dict[str, TenantRun] = {}
        self.removed: set[str] = set()  # names of tenants removed while the job ran (never reused)
        self.unstarted: dict[str, str] = {}  # job.json tenants that could not be started, with why
        self.unrecorded: set[str] = set()  # tenants job.json could not be updated with (a full disk)
        # Saved states of tenants a resume could not restore (job.json or their data no longer fit the
        # checkpoint): kept in every checkpoint, so a later resume restores them once that is put right.
        self.held: dict[str, dict[str, Any]] = {}

    # -- reading -----------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self.tenants

    def __getitem__(self, name: str) -> TenantRun:
        return self.tenants[name]

    def __iter__(self) -> Iterator[TenantRun]:
        return iter(list(self.tenants.values()))

    def running(self) -> list[TenantRun]:
        return [t for t in self.tenants.values() if t.state is TenantState.RUNNING]

    def any_paused(self) -> bool:
        return any(t.state is TenantState.PAUSED for t in self.tenants.values())

    def states(self) -> dict[str, TenantState]:
        """Each tenant's state, in the order they started."""
        return {name: t.state for name, t in self.tenants.items()}

    @property
    def free_slots(self) -> int:
        return self.spec.max_tenants - len(self.model.tenants)

    def check_free_slot(self) -> None:
        """Raise (the one "no free slot" refusal) when every slot is taken."""
        if self.free_slots <= 0:
            raise ValueError(f"no free slot: all max_tenants={self.spec.max_tenants} slots are taken")

    def name_taken(self, name: str) -> bool:
        """Names are unique up to case (adapters/<name> must not collide on any filesystem)."""
        taken = {n.lower() for n in (*self.tenants, *self.removed, *self.unstarted)}
        return name.lower() in taken

    def lookup(self, name: str) -> TenantRun:
        """The tenant ``name``, or a ``KeyError`` that says why there is none."""
        t = self.tenants.get(name)
        if t is not None:
            return t
        if name in self.removed:
            raise KeyError(f"no tenant {name!r} in this run (it was removed)")
        if name in self.unstarted:
            raise KeyError(f"tenant {name!r} could not be started ({self.unstarted[name]})")
        raise KeyError(f"no tenant {name!r} in this run; tenants: {sorted(self.tenants)}")

    # -- filling a slot ----------------------------------------------------------------------------
    def add(self, tenant: Tenant, feed_for: FeedFor) -> TenantRun:
        """Fill a free slot with ``tenant`` (from its ``init_adapter`` or PEFT's default init), running.
        Everything that can fail (reading the adapter and the data) happens before the slot is touched;
        if anything fails, the slot is freed again and the exception propagates. Writes no row."""
        init = (
            self.model.read_peft_adapter(hub.resolve(tenant.init_adapter))[1] if tenant.init_adapter else None
        )
        feed = feed_for(tenant)
        self.model.add_tenant(
            tenant.name,
            rank=tenant.rank,
            alpha=tenant.alpha,
            target_modules=tenant.target_modules,
            target_parameters=tenant.target_parameters,
            use_rslora=tenant.use_rslora,
            dropout=tenant.dropout,
            seed=tenant.seed,
            init=init,
        )
        try:
            io = self.model.io
            optimizer = build_optimizer(
                self.model.tenant_slices(tenant.name), tenant, local=io.local, copies=io.copies
            )
        except Exception:
            self.model.remove_tenant(tenant.name)
            raise
        run = TenantRun(spec=tenant, optimizer=optimizer, feed=feed, state=TenantState.RUNNING)
        run.window_loss = torch.zeros((), device=self.engine.device)
        self.tenants[tenant.name] = run
        return run

    def drop(self, name: str) -> None:
        """Forget a tenant that was added but is not kept (its slot is cleared)."""
        run = self.tenants.pop(name, None)
        if run is not None:
            run.optimizer.release()
        if name in self.model.tenants:
            self.model.remove_tenant(name)

    def start(self, tenant: Tenant, feed_for: FeedFor, log: bool) -> None:
        """Start a job.json tenant (agreed by every rank); if it cannot start on some process (its data
        file vanished since launch, say), it is left out on all of them, marked failed with why, and the
        job goes on."""

        def prepare() -> Change:
            run = self.add(tenant, feed_for)
            return Change(
                commit=lambda: self.log_tenant(run) if log else None, undo=lambda: self.drop(tenant.name)
            )

        refusal = agree(self.comm, prepare)
        if refusal is None:
            return
        reason = f"could not start: {refusal.error}"
        self.unstarted[tenant.name] = reason
        print(f"tenant {tenant.name!r} {reason}", flush=True)
        self.recorder.log(
            TenantRow(step=self.recorder.step, tenant=tenant.name, state=TenantState.FAILED, reason=reason)
        )

    def prepare_add(self, tenant: Tenant, feed_for: FeedFor, saved: dict[str, Any] | None = None) -> Change:
        """First phase of putting ``tenant`` into a free slot for an ``add`` message or a search trial:
        fresh, or with ``saved`` (:meth:`tenant_state`, a trial that waited for a promotion). Committing
        records it in job.json (which lists every tenant the run has had) and writes its row."""
        self.check_free_slot()
        run = self.add(tenant, feed_for)
        if saved is not None:
            try:
                self.load_tenant_state(tenant.name, saved)
            except Exception:
                self.drop(tenant.name)
                raise
            run.state, run.reason = TenantState.RUNNING, None

        def commit() -> None:
            self.removed.discard(tenant.name)  # a trial coming back takes its own name again
            self.record(tenant)
            self.log_tenant(run)

        return Change(commit=commit, undo=lambda: self.drop(tenant.name))

    def record(self, tenant: Tenant) -> None:
        """List ``tenant`` in the job's spec and job.json (rank 0), if it is not there yet."""
        if any(t.name == tenant.name for t in self.spec.tenants):
            return
        self.spec.tenants.append(tenant)
        self.unrecorded.add(tenant.name)
        if self.run is not None and self.is_main:
            try:
                self.spec.to_json(self.run.job)
            except OSError as e:  # the tenant is in the next checkpoint anyway; resume restores it
                print(f"job.json not updated for tenant {tenant.name!r}: {e}", flush=True)
                return
        self.unrecorded.clear()  # (a write holds every tenant of the spec: those that failed before too)

    # -- changing state ----------------------------------------------------------------------------
    def set_state(self, t: TenantRun, state: TenantState, reason: str | None = None) -> None:
        t.state, t.reason = state, reason
        self.log_tenant(t)

    def prepare_pause(self, name: str, pause: bool) -> Change:
        """First phase of a pause (``pause=True``) or a resume: the tenant must be running (paused)."""
        t = self.lookup(name)
        before, after = (
            (TenantState.RUNNING, TenantState.PAUSED) if pause else (TenantState.PAUSED, TenantState.RUNNING)
        )
        if t.state is not before:
            raise ValueError(f"tenant {name!r} is {t.state.value}, not {before.value}")
        return Change(commit=lambda: self.set_state(t, after))

    def prepare_remove(self, name: str) -> Change:
        """First phase of a removal: its final adapter is saved (a collective) before the slot is cleared."""
        t = self.lookup(name)
        self.save_adapter(name)
        return Change(commit=lambda: self._remove(t))

    def _remove(self, t: TenantRun) -> None:
        t.optimizer.release()
        self.model.remove_tenant(t.name)
        del self.tenants[t.name]
        self.removed.add(t.name)
        self.set_state(t, TenantState.REMOVED)

    def quarantine(self, t: TenantRun, why: str) -> None:
        """A tenant whose loss or gradients are NaN/inf, or whose step raised, stops training; nothing
        of it reached any other tenant (separate slots, separate rows), so the others go on exactly as
        without it."""
        t.optimizer.release()
        t.new_window()
        t.feed.reset()
        reason = f"{why} (tenant step {t.step + 1}, global step {self.recorder.step})"
        self.set_state(t, TenantState.FAILED, reason)

    def finish(self, t: TenantRun) -> None:
        """``t`` trained its last step: save its adapter (a collective) and mark it finished."""
        self.save_adapter_logged(t.name)
        t.optimizer.release()
        self.set_state(t, TenantState.FINISHED)

    def release(self, name: str, state: TenantState | None, reason: str | None) -> None:
        """Free a search trial's slot (it finished, or waits for a promotion with its state kept by the
        search); with ``state``, a tenant row says so."""
        t = self.tenants.pop(name)
        t.optimizer.release()
        self.model.remove_tenant(name)
        self.removed.add(name)
        if state is not None:
            t.state, t.reason = state, reason
            self.recorder.log(TenantRow(step=self.recorder.step, tenant=name, state=state, reason=reason))

    def set_hyperparameters(self, t: TenantRun, settings: dict[str, Any]) -> None:
        """New optimiser settings for a running tenant (PBT's explore): its optimiser and its spec."""
        t.optimizer.set_hyperparameters(**settings)
        t.spec = dataclasses.replace(t.spec, **settings)

    def log_tenant(self, t: TenantRun) -> None:
        """A ``tenant`` row: state, and the tenant's adapter + optimiser bytes (full and on this rank)."""
        row = TenantRow(step=self.recorder.step, tenant=t.name, state=t.state, reason=t.reason)
        if t.name in self.model.tenants:  # else removed: its slot and optimiser are gone
            adapter = self.model.adapter_bytes(t.name)
            row.adapter_bytes = adapter
            row.optimizer_bytes = 2 * adapter if t.step else 0  # AdamW: two moments once it has stepped
            row.local_adapter_bytes = sum(
                self.model.io.local(p.data)[i].nbytes for p, i in t.optimizer.slices
            )
            row.local_optimizer_bytes = t.optimizer.state_bytes()
        self.recorder.log(row)

    # -- saving ------------------------------------------------------------------------------------
    def save_adapter(self, name: str) -> Path | None:
        """Write ``adapters/<name>`` as a PEFT directory (a collective; rank 0 writes, atomically)."""
        path = self.run.adapter(name) if self.run is not None and self.is_main else None
        return self.engine.save_adapter(name, path)

    def save_adapter_logged(self, name: str) -> None:
        """Save one tenant's adapter as it finishes; a failure (a full disk) is an event, not the end
        of the job (the final save tries again)."""
        try:
            self.save_adapter(name)
        except checkpoint.WRITE_ERRORS as e:
            self.recorder.event(
                EventKind.SAVE_FAILED, f"adapter of {name!r} at step {self.recorder.step}: {e}"
            )

    # -- state: Stateful -------------------------------------------------------------------------
    def tenant_state(self, name: str) -> dict[str, Any]:
        """Everything needed to continue tenant ``name`` exactly, gathered in full (the same whatever the
        sharding): spec, adapter, optimiser and schedule, counters, the gradient and loss accumulated
        since its last optimiser step, and its feed's state. A collective: every process calls it."""
        io = self.model.io
        t = self.tenants[name]
        partial_grads = None
        if t.accumulating:  # mid-window: keep the gradient accumulated so far, summed over the ranks
            partial_grads = [io.gather(p, i, io.grad_sum(p)[i]) for p, i in t.optimizer.slices]
        return {
            **t.feed.state_dict(),
            "spec": t.spec.to_dict(),
            "adapter": self.model.tenant_tensors(name),
            "optimizer": t.optimizer.state_dict(gather=io.gather),
            "state": t.state.value,
            "reason": t.reason,
            "step": t.step,
            "window_loss": float(self.comm.sum_over_dp(t.window_loss.reshape(1))[0]),
            "partial_grads": partial_grads,
            "tokens_seen": t.tokens_seen,
        }

    def load_tenant_state(self, name: str, s: dict[str, Any], whole: bool = True) -> None:
        """Put one tenant's saved state ``s`` (:meth:`tenant_state`) into tenant ``name``, which holds a
        slot of the same shape. ``whole=False`` (PBT's exploit) takes only the training state (adapter,
        optimiser and schedule, step): the tenant keeps its own data cursor, counters and name."""
        io = self.model.io
        t = self.tenants[name]
        self.model.set_tenant_tensors(name, s["adapter"])
        t.optimizer.load_state_dict(s["optimizer"], scatter=io.scatter)
        t.step = s["step"]
        if not whole:
            return
        t.feed.load_state_dict(s)
        t.state, t.reason, t.tokens_seen = TenantState(s["state"]), s["reason"], s["tokens_seen"]
        # The saved loss is the sum over all processes: rank 0 carries it, the others restart at 0. It
        # belongs to a window in progress; with none (checkpoints before the re-housing kept the last
        # finished window's loss there) the next window starts from 0.
        t.accumulating = s["partial_grads"] is not None
        loss = s["window_loss"] if t.accumulating and self.comm.dp_rank == 0 else 0.0
        t.window_loss = torch.tensor(loss, device=self.engine.device)
        if s["partial_grads"] is not None:
            for (p, i), g in zip(t.optimizer.slices, s["partial_grads"]):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                part = io.scatter(p, i, g)
                # the saved sum goes to one of the processes it will be summed over again
                io.local(p.grad)[i].copy_(part if io.first_copy(p) else torch.zeros_like(part))

    def state_dict(self) -> dict[str, Any]:
        """``{"removed", "tenants", "unrecorded"}``: every tenant's :meth:`tenant_state` (and the saved
        state of each tenant held back at a resume), and the tenants job.json could not be updated with.
        A collective."""
        live = {n: self.tenant_state(n) for n in self.tenants}
        return {
            "removed": sorted(self.removed),
            "tenants": {**self.held, **live},
            "unrecorded": sorted(self.unrecorded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the tenants of ``state`` that hold a slot now (one that could not be started this time
        has a row that says why). A tenant whose saved state does not fit what it is now (job.json changed
        its rank or targets, its data changed since the checkpoint, ...) is not resumed: it is held back
        with why, naming it, and the others resume. Every process decides the same (agreed)."""
        # (``unrecorded`` is not read back: job.json, loaded at the start, lists every tenant of the spec)
        for name, s in state["tenants"].items():
            if name in self.unstarted and name not in self.held:  # could not start now (its data is gone?):
                self.held[name] = s  # its state waits in the checkpoints, as a held-back tenant's does
        names = [n for n in state["tenants"] if n in self.tenants]
        errors: dict[str, str] = {}
        for name in names:
            try:
                self.check_resumable(self.tenants[name], state["tenants"][name])
                self.load_tenant_state(name, state["tenants"][name])
            except Exception as e:  # whatever a tenant's own state does, it is that tenant's failure
                errors[name] = describe(e)
        if not names:
            return
        flags = self.comm.sum_over_world(torch.tensor([float(n in errors) for n in names]))
        for name, flag in zip(names, flags):
            if flag > 0:
                self.drop(name)  # (its adapters/<name> keeps its last save: nothing is written over it)
                why = errors.get(name, "its state could not be restored on another process")
                self.hold(name, state["tenants"][name], f"could not be resumed: {why}")

    @staticmethod
    def check_resumable(t: TenantRun, saved: dict[str, Any]) -> None:
        """``ValueError`` when ``t`` (as job.json now gives it) cannot take its checkpoint's state: the
        adapter's shape and scale (rank, alpha, rsLoRA, targets) are fixed for the life of a tenant."""
        spec = saved.get("spec")
        if not isinstance(spec, dict):
            return
        changed = [
            f"{f}={getattr(t.spec, f)!r} where its checkpoint has {f}={spec[f]!r}"
            for f in FIXED_ON_RESUME
            if f in spec and _plain(getattr(t.spec, f)) != _plain(spec[f])
        ]
        if changed:
            raise ValueError(
                f"job.json gives it {'; '.join(changed)}: a resumed tenant keeps its adapter's shape (put "
                "job.json back to resume it, or train the new settings as a new tenant)"
            )

    def hold(self, name: str, saved: dict[str, Any], reason: str) -> None:
        """Keep ``name``'s saved state (in every checkpoint) without a slot, and say why: a ``failed`` row
        and a log line that name it. A later resume restores it once what was wrong is put right."""
        self.held[name] = saved
        self.unstarted[name] = reason
        print(f"tenant {name!r} {reason}", flush=True)
        self.recorder.log(
            TenantRow(step=self.recorder.step, tenant=name, state=TenantState.FAILED, reason=reason)
        )

    def start_unlisted(self, saved: dict[str, Any], listed: set[str], feed_for: FeedFor) -> None:
        """On resume: the checkpoint's tenants that job.json does not list. One the job could not record in
        job.json (a full disk) is restored from the checkpoint and recorded now; one that job.json no longer
        lists (renamed or deleted by hand) is held back, saying so, not trained beside its new name.
        (Checkpoints from before ``unrecorded`` existed restore all of them.)"""
        unrecorded = saved.get("unrecorded")
        new = sorted(listed - set(saved["tenants"]) - self.removed)
        for name, s in saved["tenants"].items():
            if name in listed or name in self.tenants or name in self.unstarted:
                continue
            if unrecorded is None or name in unrecorded:
                tenant = Tenant.from_dict(s["spec"])
                self.record(tenant)
                self.start(tenant, feed_for, log=False)
                continue
            hint = f" (renamed to {', '.join(map(repr, new))}?)" if new else ""
            self.hold(
                name,
                s,
                f"not resumed: job.json no longer lists it{hint}; a tenant keeps its name for the life of a "
                "run. Its state stays in the checkpoints and its adapter in adapters/; list it in job.json "
                "again to resume it, or train a copy under another name that starts from its adapter "
                "(init_adapter)",
            )
