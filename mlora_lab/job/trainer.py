"""The training job: many LoRA tenants, one frozen base, mixed-tenant batches.

Run by torchrun (``mlora-lab run job.json`` does this for you; see :mod:`mlora_lab.job.__main__`)::

    torchrun --nproc-per-node 2 --rdzv-backend mlora-loopback -m mlora_lab.job runs/<id>   # reads runs/<id>/job.json
    torchrun --nproc-per-node 1 --rdzv-backend mlora-loopback -m mlora_lab.job runs/<id> --resume

or in-process, for tests and notebooks::

    trainer = Trainer(JobSpec.load("job.json"), run_dir=None)
    trainer.train()

The :class:`Trainer` composes; it holds no tenant logic of its own. Its set-up phases build each part
with what that part needs: the parallel layout and :class:`~mlora_lab.parallel.Collectives`; the
:class:`~.engine.Engine` (the base with its slots, the one forward); the :class:`~.recorder.Recorder`
(metrics rows); the :class:`~.tenants.TenantPool` (slots and tenant lifecycle); the drivers (where each
tenant's work comes from: :mod:`~.driver`); the control handler; a search, if the run is a sweep; the
:class:`~.checkpointer.Checkpointer`. Then it restores or starts the tenants.

The story of one global step (:meth:`Trainer.step`):

1. every driver plans its running tenants' share of the step (:class:`~.driver.Plan`): for the file-data
   driver, each tenant's next ``batch_size`` rows of its window, this process's share of them;
2. the rows of every plan go through the base once (:meth:`~.engine.Engine.forward`): per-token losses
   ``ℓ [B, T-1]``, each row under its own tenant's adapter;
3. each tenant's driver makes its loss ``L_t`` from its rows' ``ℓ``, and we back-propagate ``Σ_t L_t``;
   each row only sees its own tenant's slot, so ``∂L/∂slot_t = ∂L_t/∂slot_t``;
4. each tenant whose window is complete takes one AdamW step (own schedule, own clipping by its own
   global gradient norm); a tenant whose loss or gradient is NaN/inf, whose update would not be finite
   (lr=1e38) or whose weights diverge with it, or whose own part of the step raised, is quarantined
   instead, on every process, and the others go on exactly as without it (:func:`~mlora_lab.optim.step_many`);
5. each driver that planned hears that the step is over (:meth:`~.driver.Driver.after_step`, on every
   process: the service driver gathers its requests' answers there).
"""

from __future__ import annotations

import copy
import math
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlora_lab import optim
from mlora_lab.job.agree import Change
from mlora_lab.job.checkpointer import Checkpointer
from mlora_lab.job.control import ControlHandler, Controls
from mlora_lab.job.drivers.base import Driver, DriverFactory, Drivers, JobParts, Plan, StepResult
from mlora_lab.job.drivers.default import DEFAULT_DRIVERS
from mlora_lab.job.engine import Engine
from mlora_lab.job.evals import JobEvals
from mlora_lab.job.recorder import Recorder
from mlora_lab.job.search import SearchController, read_sweep
from mlora_lab.job.tenants import TenantPool, TenantRun
from mlora_lab.parallel import Collectives, DistInfo, ParallelDims, Roles
from mlora_lab.rundir import ControlMessage, EventKind, RunDir, TenantState, checkpoint, control, rows
from mlora_lab.spec.job import JobSpec


class SaveError(RuntimeError):
    """The job's final adapters or checkpoint could not be written (e.g. the disk is full)."""


class Trainer:
    """One job on one process: set-up (in ``__init__``) → :meth:`train`."""

    def __init__(
        self,
        spec: JobSpec,
        run_dir: str | Path | None = None,
        dist: DistInfo | None = None,
        resume: bool = False,
        drivers: Sequence[DriverFactory] = DEFAULT_DRIVERS,
        roles: Roles | None = None,
    ) -> None:
        # The job's own copy: tenants added while it runs (and its slot modules) are recorded in it,
        # never in the caller's spec.
        self.spec = spec = copy.deepcopy(spec)
        self.dist = dist or DistInfo()
        self.run = RunDir(run_dir).create() if run_dir is not None else None
        self.stop_requested = False
        torch.manual_seed(spec.seed)
        self.comm, mesh = self._layout()
        self.checkpointer = Checkpointer(self.run, self.comm, self.dist.is_main)
        # The checkpoint is chosen before the base is built: the base it records is the one to build
        # (a quantize or dtype changed in job.json since is held back, as a changed rank is)
        self._resumed = self.checkpointer.latest() if resume else None
        saved_base = self._resumed[1].get("base") if self._resumed and self._resumed[1] else None
        self._held_back = checkpoint.hold_back_base(spec, saved_base)
        self.engine = Engine.build(spec, self.dims, mesh, self.comm)
        self._record_slots()
        self.recorder = Recorder(self.run, self.comm, self.dist.is_main, spec.log_every)
        self.pool = TenantPool(spec, self.engine, self.recorder, self.run, self.dist.is_main)
        self.wake = threading.Event()
        parts = JobParts(spec, self.engine, self.pool, self.recorder, self.wake, roles)
        self.drivers = Drivers([make(parts) for make in drivers])
        controls = Controls(self.pool, self.drivers.feed, self.run)
        self.control = ControlHandler(self.run, self.comm, self.dist.is_main, controls)
        self.evals = JobEvals(spec.evals, self.engine, self.comm, self.recorder, self.run, self.dist.is_main)
        sampler = next((s for d in self.drivers if (s := d.sampler()) is not None), None)
        if sampler is not None:  # (rollout ranks: the job's every generation is sampled there)
            self.evals.sampler = sampler
            for d in self.drivers:
                d.use_sampler(sampler)
        self.search: SearchController | None = None
        self._start_tenants(resume)
        self.control.start(self.global_step)
        self.recorder.start_meters()

    # -- set-up phases -----------------------------------------------------------------------------
    def _layout(self) -> tuple[Collectives, Any]:
        """The parallel layout: one place decides it; the model stays plain until the engine applies it."""
        p = self.spec.parallel
        self.dims = ParallelDims(self.dist.world_size, fsdp=p.fsdp, tp=p.tp, ep=p.ep)
        mesh = self.dims.build_mesh(self.dist.device.type)
        return Collectives(self.dims, mesh, self.dist.device, self.dist.group), mesh

    def _record_slots(self) -> None:
        """Slots are fixed for the life of the job: record them in job.json, so tenants added later are
        checked against the layers that really have slots."""
        self.spec.slot_modules = list(self.engine.slot_modules)
        if self.run is not None and self.dist.is_main:
            self.spec.to_json(self.run.job)

    def _start_tenants(self, resume: bool) -> None:
        """Fill the slots: from the newest intact checkpoint whose state passes its checks (``resume``),
        else job.json's tenants fresh. A sweep's trials are started, paused and restored by its search; on
        resume the job starts only those that held a slot in the checkpoint. A tenant that no longer fits
        its checkpoint (its data, rank or targets changed, job.json renamed it) is held back by the pool,
        named, and the others resume."""
        saved, skipped = None, []
        if resume:
            assert self._resumed is not None
            path, saved, skipped = self._resumed
            if path is None:
                why = "".join(f"\n  {name}: {reason}" for name, reason in skipped)
                where = self.run.checkpoints if self.run else None
                raise FileNotFoundError(f"--resume: no intact checkpoint in {where}{why}")
            if self.run is not None and self.dist.is_main:
                rows.truncate_after(self.run.metrics, saved["global_step"])
        self.recorder.open()
        if saved is not None:
            self.recorder.step = saved["global_step"]
            for name, reason in skipped:
                self.recorder.event(
                    EventKind.CHECKPOINT_SKIPPED, f"{name} is damaged and was skipped: {reason}"
                )
            self.pool.removed = set(saved["removed"])
            for said in self._held_back:
                if self.dist.is_main:
                    print(said, flush=True)
                self.recorder.event(EventKind.WARNING, said)
        sweep = read_sweep(self.run) if self.run is not None else None
        if sweep is not None:
            self.search = SearchController(
                sweep,
                self.pool,
                self.drivers.feed,
                self.recorder,
                self.comm,
                self.drivers.heldout_losses,
                self.run,
                self.dist.is_main,
                saved.get("search") if saved is not None else None,
            )
        not_in_slots = self.search.not_in_slots() if self.search is not None else set()
        in_checkpoint = saved["tenants"] if saved is not None else {}
        for tenant in self.spec.tenants:
            if tenant.name not in self.pool.removed and tenant.name not in not_in_slots:
                # a tenant added after the last checkpoint has no state in it: it starts afresh
                self.pool.start(tenant, self.drivers.feed, log=tenant.name not in in_checkpoint)
        if saved is not None:  # its tenants that job.json does not list (not recorded, or renamed by hand)
            self.pool.start_unlisted(saved, {t.name for t in self.spec.tenants}, self.drivers.feed)
            self.checkpointer.load(saved, self.parts())
            self.recorder.event(EventKind.RESUMED, f"from {path.name} on {self.dist.world_size} process(es)")

    # -- the parts -------------------------------------------------------------------------------
    def parts(self) -> dict[str, Any]:
        """The job's ``Stateful`` parts, as the checkpointer saves them."""
        parts: dict[str, Any] = {"job": self, "tenants": self.pool}
        if self.search is not None:
            parts["search"] = self.search
        for i, driver in enumerate(self.drivers):  # (what a driver keeps beyond its tenants' feeds)
            parts[f"driver {i}"] = driver
        return parts

    def state_dict(self) -> dict[str, Any]:
        """The job's own state: its global step, the world size it ran on, the RNG state, and the base it
        trains over (:data:`~mlora_lab.rundir.checkpoint.BASE_SETTINGS`: a resume keeps it)."""
        return {
            "global_step": self.global_step,
            "world_size": self.dist.world_size,
            "rng": torch.get_rng_state(),
            "base": checkpoint.base_settings(self.spec),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recorder.step = state["global_step"]
        torch.set_rng_state(state["rng"])

    @property
    def global_step(self) -> int:
        return self.recorder.step

    @property
    def model(self):
        """The :class:`~mlora_lab.lora.MultiLoRAModel` (base + slots)."""
        return self.engine.model

    @property
    def tenants(self) -> dict[str, TenantRun]:
        return self.pool.tenants

    @property
    def unstarted(self) -> dict[str, str]:
        return self.pool.unstarted

    @property
    def history(self) -> list[rows.Row]:
        return self.recorder.history

    def losses(self, tenant: str) -> list[float]:
        """Per-step training losses of ``tenant`` (from the in-memory rows)."""
        return self.recorder.losses(tenant)

    # -- the loop ----------------------------------------------------------------------------------
    def train(self, idle_s: float = 0.5) -> None:
        """Run global steps until every tenant is done (or a stop is requested). In serve mode, while
        some tenant is paused, or while a driver or the search may still bring work, the job then idles,
        polling for control messages every ``idle_s`` seconds, until there is work again or it is stopped; a
        driver's work that comes from another thread (a served request) wakes it at once (:attr:`wake`)."""
        self.model.train()
        self.poll()
        while not self.stop_requested:
            if self.step():
                if self.spec.heldout_every and self.global_step % self.spec.heldout_every == 0:
                    self.heldout_losses()
                self.evals.after_step(self.global_step, self.pool.states())
                if self.spec.save_every and self.global_step % self.spec.save_every == 0:
                    self.save(final=False)
            elif self.spec.stay_up or self.pool.any_paused() or any(d.waiting() for d in self.drivers):
                # nothing to train now: wait cheaply for new or resumed tenants, or a driver's new work
                # (cleared before the next plan takes the work: what comes after that sets it again)
                self.wake.wait(idle_s)
                self.wake.clear()
            elif not (self.search is not None and self.search.active):
                break
            self.poll()
        if not self.stop_requested:
            self.heldout_losses()  # (of the tenants that have held-out data)
            self.evals.finish(self.global_step, self.pool.states())
        self.save(final=True)

    def step(self) -> bool:
        """One global step over every running tenant of every driver; False when there is none."""
        plans = [(d, p) for d in self.drivers if (p := d.plan()) is not None]
        if not plans:
            return False
        t0 = time.perf_counter()
        owner = {t.name: d for d, p in plans for t in p.tenants}
        groups = [(t.name, p.rows.get(t.name, [])) for _, p in plans for t in p.tenants]
        temperatures: dict[str | None, float] = {n: v for _, p in plans for n, v in p.temperatures.items()}
        if self.dims.world_size == 1 and not any(rows for _, rows in groups):
            # nothing to compute (a service client's optim_step alone: its rows ran in an earlier step); the
            # padding row that keeps several processes' collectives in step is not needed on one
            tokens, tenants = 0, 0
        else:
            raised: dict[str, str] = {}
            tokens, tenants = self._forward_backward(groups, temperatures, owner, raised)
            for _, p in plans:  # (quarantined with the step's other failures, agreed over the processes)
                p.failed |= {t.name: raised[t.name] for t in p.tenants if t.name in raised}
        self.recorder.step += 1
        for t in owner:
            self.pool[t].accumulating = True
        self._optimizer_steps(plans, owner)
        for d, _ in plans:
            d.after_step()
        self.recorder.system(time.perf_counter() - t0, tokens, tenants, self._shares)
        return True

    def _shares(self) -> dict[str, float]:
        """Rank 0's system row's shares of time (a job with rollout ranks: their busy share, the trainers'
        idle share), from the drivers that know them."""
        out: dict[str, float] = {}
        for d in self.drivers:
            out |= d.system_shares()
        return out

    def _forward_backward(
        self,
        groups: list[tuple[str, list]],
        temperatures: dict[str | None, float],
        owner: dict[str, Driver],
        raised: dict[str, str],
    ) -> tuple[int, int]:
        """One forward of every group's rows, each tenant's loss from its driver, one backward; the tokens
        of the batch and how many tenants had rows in it. A driver's loss that raises for a tenant leaves
        that tenant out of the backward and says why in ``raised`` (the step then quarantines it: the job
        and the other tenants go on). With a pass budget (``spec.max_pass_tokens``; a
        served job's on a CPU when unset) the groups run in
        several such passes of whole tenants (:meth:`~.engine.Engine.passes`): a tenant's loss is made from
        the same rows either way and its gradient comes from its one pass, so the update is the same, with
        one pass's activations alive at a time."""
        tokens, tenants = 0, set()
        for part in self.engine.passes(groups):
            batch, token_loss = self.engine.forward(part, temperatures)
            total = token_loss.sum() * 0.0  # keeps every process's graph connected even without rows
            for name, start, end in batch.segments:
                if name is None:
                    continue
                t = self.pool[name]
                try:
                    loss_t = owner[name].loss(t, token_loss[start:end], batch.labels[start:end])
                except Exception as e:  # (its own failure; the traceback goes to the job's log)
                    traceback.print_exc()
                    raised[name] = f"in its loss: {type(e).__name__}: {str(e)[:500]}"
                    continue
                t.window_loss += loss_t.detach()
                total = total + loss_t
            if total.requires_grad:  # (a single process whose rows all failed has nothing to train)
                total.backward()
            tokens += int(batch.attention_mask.sum())
            tenants |= {name for name, start, end in batch.segments if name is not None and end > start}
            del batch, token_loss, total  # (this pass's activations go before the next pass's forward)
        return tokens, len(tenants)

    def _optimizer_steps(self, plans: list[tuple[Driver, Plan]], owner: dict[str, Driver]) -> None:
        """One optimiser step for each tenant whose window is complete.

        One all-reduce over every process carries, per tenant of the step, its squared gradient norm
        (for clipping) and a flag for "its part of the step raised somewhere", so every process
        quarantines the same tenants; one more sums the window losses over the data-parallel ranks.
        With several processes, a last tiny all-reduce agrees on optimiser steps that raised."""
        active = [t for _, p in plans for t in p.tenants]
        complete = [n for _, p in plans for n in p.complete]  # the same on every process
        failed = {n: why for _, p in plans for n, why in p.failed.items()}
        ready = {name for name in complete if name not in failed}
        # Gradients are summed over the data-parallel ranks here, once per window and only for the
        # tenants that step: one flat all-reduce per group (mlora_lab.parallel).
        self.model.reduce_gradients(complete)
        # every number below is read in one go (a host sync a step, not one per tenant)
        norms = optim.sq_norms([t.optimizer for t in active if t.name in ready])
        sq_local = iter(norms.tolist())
        local = [[next(sq_local) if t.name in ready else 0.0, float(t.name in failed)] for t in active]
        agreed = self.comm.sum_over_world(torch.tensor(local, dtype=torch.float64)).tolist() if active else []
        stepping, sq = [], {}
        for t, (sq_t, flag) in zip(active, agreed):
            if flag > 0:
                self.pool.quarantine(
                    t, f"its step raised {failed.get(t.name, 'an error on another process')}"
                )
            elif t.name in ready:
                stepping.append(t)
                sq[t.name] = sq_t
        losses = (
            self.comm.sum_over_dp(torch.stack([t.window_loss for t in stepping])).tolist() if stepping else []
        )
        finite = []
        for t, loss in zip(stepping, losses):
            if not (math.isfinite(sq[t.name]) and math.isfinite(loss)):
                what = "loss" if not math.isfinite(loss) else "gradient norm"
                norm = sq[t.name] ** 0.5
                self.pool.quarantine(t, f"non-finite {what}: loss={loss}, grad_norm={norm}")
                continue
            finite.append((t, StepResult(loss, t.optimizer.lr, float(np.float32(math.sqrt(sq[t.name]))))))
        # every tenant's AdamW step in a few multi-tensor calls (mlora_lab.optim.step_many)
        errors = optim.step_many([(t.optimizer, math.sqrt(sq[t.name])) for t, _ in finite])
        # (a step refused or diverged on one process: with sharded slots each process checks its part)
        raised = {finite[i][0].name: why for i, why in errors.items()}
        if self.dims.world_size > 1 and stepping:
            flags = self.comm.sum_over_world(torch.tensor([float(t.name in raised) for t in stepping]))
            raised |= {
                t.name: raised.get(t.name, "failed on another process") for t, f in zip(stepping, flags) if f
            }
        for t, result in finite:
            if t.name in raised:
                continue
            t.optimizer.zero_grad()
            t.step += 1
            t.new_window()
            owner[t.name].stepped(t, result)
            if t.step == 1 and t.state is TenantState.RUNNING:
                # Its AdamW state exists from its first step on: a memory row says so (a tenant that
                # finished with this step got its final row already).
                self.pool.log_tenant(t)
        for t in stepping:
            if t.name in raised:
                self.pool.quarantine(t, f"its optimiser step {raised[t.name]}")

    def heldout_losses(self, only: Sequence[str] | None = None) -> dict[str, float]:
        """Held-out losses of every tenant with ``heldout_data`` (or of those ``only``), logged as the run
        directory's ``eval`` rows. A collective. (The evaluations, ``spec.evals``, are :attr:`evals`'.)"""
        return self.drivers.heldout_losses(only)

    # -- control ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """At a step boundary, on every rank: apply queued control messages, let the search decide, and
        agree on a stop (the stop file, or SIGTERM/SIGINT on any rank)."""
        if self.run is not None:
            self.control.poll(self.global_step)
            stop = control.stop_requested(self.run.root) or self.stop_requested
            if self.dims.world_size > 1:
                stop = bool(self.comm.sum_over_world(torch.tensor([float(stop)]))[0] > 0)
            self.stop_requested = stop
        if self.search is not None:
            self.search.poll()

    def apply_control(self, msg: dict | ControlMessage) -> None:
        """Apply one control message right now, in this process (prepare + commit); raises, changing
        nothing, if it cannot be applied. The job itself goes through :class:`~.control.ControlHandler`."""
        if isinstance(msg, dict):
            msg_id = control.new_message_id()
            msg = ControlMessage.parse({**msg, "id": msg_id}, msg_id)
        change: Change = self.control.controls.prepare(msg)
        change.commit()

    # -- saving ----------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step_<N>`` (see :class:`~.checkpointer.Checkpointer`). A collective."""
        for driver in self.drivers:  # (the tenants' states as of now: a served job's clients that went away)
            driver.before_checkpoint()
        return self.checkpointer.save(self.global_step, self.parts())

    def save(self, final: bool) -> None:
        """Save every adapter and, when checkpointing (``save_every``, or a stop), a checkpoint.

        A periodic save that fails (a full disk, say) is recorded as an ``event`` row and training
        goes on: every earlier checkpoint is intact, and the shared job keeps its tenants. A final
        save that fails raises :class:`SaveError` naming what was not saved, so the run ends
        ``failed`` rather than claiming a result it does not have."""
        problems = []
        for name in list(self.pool.tenants):
            try:
                self.pool.save_adapter(name)
            except checkpoint.WRITE_ERRORS as e:
                problems.append(f"adapter of {name!r}: {e}")
        if self.spec.save_every or self.stop_requested or not final:
            try:
                self.save_checkpoint()
            except checkpoint.WRITE_ERRORS as e:
                problems.append(f"checkpoint at step {self.global_step}: {e}")
        if not problems:
            self.recorder.save_problem(None)  # saving works (again): status.json says no more that it fails
            return
        message = "; ".join(problems)
        if final:
            raise SaveError(f"could not save: {message}")
        self.recorder.event(EventKind.SAVE_FAILED, message)

    def close(self) -> None:
        """The job is over: its drivers end what they started (an RL tenant's reward worker and what its
        functions started), then its rows are closed."""
        for driver in self.drivers:
            driver.close()
        self.recorder.close()
