"""The training job: many LoRA tenants, one frozen base, mixed-tenant batches.

Run by torchrun (``mlora-lab run job.json`` does this for you)::

    torchrun --nproc-per-node 2 --rdzv-backend mlora-loopback -m mlora_lab.train runs/<id>   # reads runs/<id>/job.json
    torchrun --nproc-per-node 1 --rdzv-backend mlora-loopback -m mlora_lab.train runs/<id> --resume

or in-process, for tests and notebooks::

    trainer = Trainer(JobSpec.load("job.json"), run_dir=None)
    trainer.train()

The story of one global step (:meth:`Trainer.step`):

1. every running tenant contributes its next ``batch_size`` rows (a tenant with ``grad_accum = k``
   draws its whole window of ``k * batch_size`` rows at the start of the window and counts its target
   tokens ``N_t`` there, so that k micro-batches give exactly the gradient of one big batch); with
   ``packing`` a row is up to ``seq_len`` tokens of whole documents of the tenant (:func:`~mlora_lab.data.pack`);
   with ``D`` data-parallel processes, process ``d`` takes rows ``d, d + D, ...`` of each tenant's share;
2. the local rows are collated into one right-padded batch, tenant by tenant, and the base runs once
   (with activation checkpointing, every k-th decoder block recomputes its activations in the
   backward; the loss is computed in chunks from the final hidden states: :mod:`mlora_lab.memory`);
3. tenant ``t``'s loss on a process is ``sum(token CE over its local rows) / N_t`` (``N_t`` counts the
   whole window, on every process, so summing gradients over processes gives exactly the one-process
   gradient) and we back-propagate ``sum_t L_t``; each row only sees its own tenant's slot, so
   ``dL/dslot_t = dL_t/dslot_t``;
4. a tenant whose window is complete takes one AdamW step (own schedule, own clipping by its own
   global gradient norm), and its step counter and data cursor move; the others keep accumulating.
   Nothing moves for a tenant that did not train.

Faults stay with the tenant or request that caused them: a tenant whose loss or gradient is NaN/inf,
or whose own part of a step raises, is quarantined (state ``failed``, with the reason) while the
others go on exactly as without it; a control message that cannot be applied is refused with its
reason (:mod:`mlora_lab.control_handler`). Saving and restoring is :mod:`mlora_lab.checkpointer`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
import transformers

from mlora_lab.bases import resolve_base
from mlora_lab.checkpointer import Checkpointer
from mlora_lab.control_handler import Change, ControlHandler, describe
from mlora_lab.data import IGNORE_INDEX, Batch, Example, TenantStream, check_vocab, collate, load_examples
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.memory import (
    causal_lm_token_loss,
    checkpoint_blocks,
    chunk_tokens_for,
    hidden_states,
    output_layer,
    token_loss,
)
from mlora_lab.optim import TenantOptimizer, build_optimizer, step_many
from mlora_lab.parallel import (
    Collectives,
    DistInfo,
    ParallelDims,
    init_distributed,
    parallelize,
    shutdown_distributed,
)
from mlora_lab.rundir import (
    ControlMessage,
    EvalRow,
    EventKind,
    EventRow,
    MetricsWriter,
    Op,
    ProcessIdentity,
    Row,
    RowKind,
    RunDir,
    RunDirError,
    RunLock,
    RunState,
    SystemRow,
    TenantRow,
    TenantState,
    TrainRow,
    checkpoint,
    control,
    read_status,
    rows,
    update_status,
)
from mlora_lab.rundir.status import this_host
from mlora_lab.search_job import SearchController, read_sweep
from mlora_lab.spec import JobSpec, SpecError, Tenant, effective_slot_modules
from mlora_lab.validate import problems as spec_problems
from mlora_lab.validate import tenant_problems

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SaveError(RuntimeError):
    """The job's final adapters or checkpoint could not be written (e.g. the disk is full)."""


@dataclass
class TenantRun:
    """A tenant's live training state: its data order, optimiser, counters and accumulation window."""

    spec: Tenant
    stream: TenantStream
    optimizer: TenantOptimizer
    eval_examples: list[Example] = field(default_factory=list)
    state: TenantState = TenantState.PENDING
    step: int = 0  # optimiser steps taken
    micro: int = 0  # micro-batches done in the current accumulation window
    window: list[list[Example]] = field(default_factory=list)
    window_tokens: int = 0
    window_loss: torch.Tensor | None = None  # this process's share of the window's loss
    tokens_seen: int = 0
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


class Trainer:
    """``setup`` (in ``__init__``) → ``train``; one object per job and process."""

    def __init__(
        self,
        spec: JobSpec,
        run_dir: str | Path | None = None,
        dist: DistInfo | None = None,
        resume: bool = False,
    ) -> None:
        # The job's own copy: tenants added while it runs (and its slot modules) are recorded in it,
        # never in the caller's spec.
        self.spec = spec = copy.deepcopy(spec)
        self.dist = dist or DistInfo()
        self.device = self.dist.device
        self.run = RunDir(run_dir).create() if run_dir is not None else None
        self.history: list[dict] = []  # every metrics row, also kept in memory
        self.global_step = 0
        self.stop_requested = False
        self.metrics: MetricsWriter | None = None
        self._write_errors: set[str] = set()
        torch.manual_seed(spec.seed)

        # Parallel layout: one place decides it; the model below stays plain until parallelize().
        p = spec.parallel
        self.dims = ParallelDims(self.dist.world_size, fsdp=p.fsdp, tp=p.tp, ep=p.ep)
        mesh = self.dims.build_mesh(self.device.type)
        self.comm = Collectives(self.dims, mesh, self.device)

        # A GGUF base is converted once into a cached transformers directory (mlora_lab.bases); the
        # launcher has usually done it before the processes started, so here it is found ready.
        self.base_path = str(resolve_base(spec.base_model))
        tok_path = spec.tokenizer or self.base_path
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tok_path)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        base = transformers.AutoModelForCausalLM.from_pretrained(self.base_path, dtype=DTYPES[spec.dtype])
        base.to(self.device)
        self.vocab_rows = base.get_input_embeddings().weight.shape[0]  # before any sharding
        # Slots are fixed for the life of the job: record them, so tenants added later are checked
        # against the layers that really have slots.
        spec.slot_modules = slot_modules = effective_slot_modules(spec)
        if self.run is not None and self.dist.is_main:
            spec.to_json(self.run.job)
        slot_parameters = sorted({p for t in spec.tenants for p in t.target_parameters})
        self.model = MultiLoRAModel(
            base, max_tenants=spec.max_tenants, max_rank=spec.max_rank, slot_modules=slot_modules,
            slot_parameters=slot_parameters, wrap_experts=self.dims.ep > 1,
        )  # fmt: skip
        # Checkpoint blocks before FSDP wraps them: its hooks stay outside the recomputed region.
        checkpoint_blocks(self.model.model, int(spec.activation_checkpointing))
        parallelize(self.model, self.dims, mesh, self.device.type, self.comm.dp_group)
        # The loss is computed from the output layer's input in chunks (mlora_lab.memory); models
        # whose forward post-processes the logits keep the full-logits loss.
        self._head = output_layer(self.model.model)
        self._chunk_tokens = chunk_tokens_for(self.vocab_rows)

        self.tenants: dict[str, TenantRun] = {}
        self.removed: set[str] = set()  # names of tenants removed while the job ran (never reused)
        self.unstarted: dict[str, str] = {}  # job.json tenants that could not be started, with why
        self.checkpointer = Checkpointer(self)
        self.search: SearchController | None = None
        self.control = ControlHandler(
            self.run, self.comm, self.dist.is_main, prepare=self.prepare_control, on_refused=self._log_refused
        )

        saved = None
        if resume:
            path, skipped = self.checkpointer.choose()
            if path is None:
                why = "".join(f"\n  {name}: {reason}" for name, reason in skipped)
                where = self.run.checkpoints if self.run else None
                raise FileNotFoundError(f"--resume: no intact checkpoint in {where}{why}")
            saved = self.checkpointer.read(path)
            if self.run is not None and self.dist.is_main:
                rows.truncate_after(self.run.metrics, saved["global_step"])
        if self.run is not None and self.dist.is_main:
            self.metrics = MetricsWriter(self.run.metrics)
        if saved is not None:
            self.global_step = saved["global_step"]
            for name, reason in skipped:
                self._event(EventKind.CHECKPOINT_SKIPPED, f"{name} is damaged and was skipped: {reason}")

        in_checkpoint = saved["tenants"] if saved is not None else {}
        self.removed = set(saved["removed"]) if saved is not None else set()
        # A sweep's trials are started, paused and restored by its search (mlora_lab.search_job); on
        # resume the job starts only those that held a slot in the checkpoint.
        sweep = read_sweep(self.run.root) if self.run is not None else None
        if sweep is not None:
            self.search = SearchController(self, sweep, saved.get("search") if saved is not None else None)
        not_in_slots = self.search.not_in_slots() if self.search is not None else set()
        for tenant in spec.tenants:
            if tenant.name not in self.removed and tenant.name not in not_in_slots:
                # a tenant added after the last checkpoint has no state in it: it starts afresh
                self._start_tenant(tenant, log=tenant.name not in in_checkpoint)
        for name, s in in_checkpoint.items():  # in the checkpoint, but job.json could not record it
            if name not in self.tenants and name not in self.unstarted:
                tenant = Tenant.from_dict(s["spec"])
                self.spec.tenants.append(tenant)
                self._start_tenant(tenant, log=False)
        if saved is not None:
            self.checkpointer.restore(saved)
            self._event(EventKind.RESUMED, f"from {path.name} on {self.dist.world_size} process(es)")
        self.control.start(self.global_step)
        # CPU and GPU use are measured from here (setup excluded) to each system row
        self._cpu, self._gpu = CpuMeter(), GpuMeter(self.device)

    # -- tenants -------------------------------------------------------------------------------
    def add_tenant(self, tenant: Tenant, log: bool = True) -> TenantRun:
        """Fill a free slot with ``tenant`` (from its ``init_adapter`` or PEFT's default init).
        Everything that can fail (reading files, tokenizing) happens before the slot is touched; if
        anything fails, the slot is freed again and the exception propagates."""
        init = self.model.read_peft_adapter(tenant.init_adapter)[1] if tenant.init_adapter else None
        examples = load_examples(tenant.data, self.tokenizer, self.spec.seq_len)
        evals = load_examples(tenant.eval_data, self.tokenizer, self.spec.seq_len) if tenant.eval_data else []
        check_vocab(examples, self.vocab_rows, tenant.data)  # no row of it may index past the embedding
        check_vocab(evals, self.vocab_rows, tenant.eval_data or "")
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
            optimizer = build_optimizer(
                self.model.tenant_slices(tenant.name),
                tenant,
                local=self.model.io.local,
                copies=self.model.io.copies,
            )
        except Exception:
            self.model.remove_tenant(tenant.name)
            raise
        run = TenantRun(
            spec=tenant,
            stream=TenantStream(examples, seed=tenant.seed, shuffle=tenant.shuffle),
            optimizer=optimizer,
            eval_examples=evals,
            state=TenantState.RUNNING,
        )
        self.tenants[tenant.name] = run
        if log:
            self._log_tenant(run)
        return run

    def _drop(self, name: str) -> None:
        """Forget a tenant that was added but is not kept (its slot is cleared)."""
        run = self.tenants.pop(name, None)
        if run is not None:
            run.optimizer.zero_grad()
        if name in self.model.tenants:
            self.model.remove_tenant(name)

    def _start_tenant(self, tenant: Tenant, log: bool) -> None:
        """Start a job.json tenant; if it cannot start on some process (its data file vanished
        since launch, say), it is left out on all of them, marked failed with why, and the job goes on."""
        error = None
        try:
            self.add_tenant(tenant, log=False)
        except Exception as e:
            error = describe(e)
        first = next((e for e in self.comm.gather_objects(error) if e), None)
        if first is None:
            if log:
                self._log_tenant(self.tenants[tenant.name])
            return
        self._drop(tenant.name)
        reason = f"could not start: {first}"
        self.unstarted[tenant.name] = reason
        print(f"tenant {tenant.name!r} {reason}", flush=True)
        self._log(
            TenantRow(step=self.global_step, tenant=tenant.name, state=TenantState.FAILED, reason=reason)
        )

    def _set_state(self, run: TenantRun, state: TenantState, reason: str | None = None) -> None:
        run.state, run.reason = state, reason
        self._log_tenant(run)

    def _log_tenant(self, run: TenantRun) -> None:
        """A ``tenant`` row: state, and the tenant's adapter + optimiser bytes (full and on this rank)."""
        row = TenantRow(step=self.global_step, tenant=run.name, state=run.state, reason=run.reason)
        if run.name in self.model.tenants:  # else removed: its slot and optimiser are gone
            adapter = self.model.adapter_bytes(run.name)
            row.adapter_bytes = adapter
            row.optimizer_bytes = 2 * adapter if run.step else 0  # AdamW: two moments once it has stepped
            row.local_adapter_bytes = sum(
                self.model.io.local(p.data)[i].nbytes for p, i in run.optimizer.slices
            )
            row.local_optimizer_bytes = run.optimizer.state_bytes()
        self._log(row)

    def _name_taken(self, name: str) -> bool:
        """Names are unique up to case (adapters/<name> must not collide on any filesystem)."""
        taken = {n.lower() for n in (*self.tenants, *self.removed, *self.unstarted)}
        return name.lower() in taken

    # -- the loop ------------------------------------------------------------------------------
    def train(self, idle_s: float = 0.5) -> None:
        """Run global steps until every tenant is done (or a stop is requested). In serve mode, or
        while some tenant is paused, the job then idles, polling for control messages every
        ``idle_s`` seconds, until there is work again or it is stopped."""
        self.model.train()
        self._poll_control()
        self._poll_search()
        while not self.stop_requested:
            if self.step():
                if self.spec.eval_every and self.global_step % self.spec.eval_every == 0:
                    self.evaluate()
                if self.spec.save_every and self.global_step % self.spec.save_every == 0:
                    self.save(final=False)
            elif self.spec.serve or any(t.state is TenantState.PAUSED for t in self.tenants.values()):
                time.sleep(idle_s)  # nothing to train now: wait cheaply for new or resumed tenants
            elif not (self.search is not None and self.search.active):
                break
            self._poll_control()
            self._poll_search()
        if not self.stop_requested and any(t.eval_examples for t in self.tenants.values()):
            self.evaluate()
        self.save(final=True)

    def step(self) -> bool:
        """One global step over every running tenant; False when none is left."""
        active = [t for t in self.tenants.values() if t.state is TenantState.RUNNING]
        if not active:
            return False
        t0 = time.perf_counter()
        failed: dict[str, str] = {}  # tenants whose own part of this step raised here, with why
        groups: list[tuple[str | None, list[Example]]] = []
        for t in active:
            try:
                if t.micro == 0:
                    bs, k = t.spec.batch_size, t.spec.grad_accum
                    if self.spec.packing:  # bs rows of seq_len tokens, each full of whole documents
                        t.window = [t.stream.take_packed(bs, self.spec.seq_len) for _ in range(k)]
                    else:
                        rows_ = t.stream.take(bs * k)
                        t.window = [rows_[i * bs : (i + 1) * bs] for i in range(k)]
                    t.window_tokens = sum(ex.n_target for rows_ in t.window for ex in rows_)
                    t.window_loss = torch.zeros((), device=self.device)
                groups.append((t.name, self._my_rows(t.window[t.micro])))
            except Exception as e:
                failed[t.name] = describe(e)
        batch, token_loss = self._forward(groups)
        total = token_loss.sum() * 0.0  # keeps every process's graph connected even without rows
        for name, start, end in batch.segments:
            if name is None:
                continue
            t = self.tenants[name]
            loss_t = token_loss[start:end].sum() / max(t.window_tokens, 1)
            t.window_loss += loss_t.detach()
            total = total + loss_t
        if total.requires_grad:  # (a single process whose rows all failed has nothing to train)
            total.backward()

        self.global_step += 1
        for t in active:
            t.micro += 1
        self._optimizer_steps(active, failed)
        self._log_system(time.perf_counter() - t0, int(batch.attention_mask.sum()))
        return True

    def _forward(self, groups: Sequence[tuple[str | None, list[Example]]]) -> tuple[Batch, torch.Tensor]:
        """Collate ``groups`` into one batch, run the base with every row's LoRA, and return the batch
        and the per-token loss ``[B, T-1]`` (fp32, 0 on ignored tokens). A process with no rows still
        runs one padding row, so that it takes part in every collective of the forward/backward."""
        if not any(rows_ for _, rows_ in groups):
            groups = [(None, [Example([self.pad_id, self.pad_id], [IGNORE_INDEX, IGNORE_INDEX])])]
        batch = collate(groups, self.pad_id).to(self.device)
        self.model.set_segments(batch.segments, batch.num_rows)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
        if batch.position_ids is not None:  # packed rows: documents are told apart by their positions
            inputs["position_ids"] = batch.position_ids
            del inputs["attention_mask"]  # (transformers reads packing only without a 2-D mask)
        if self._head is None:
            return batch, causal_lm_token_loss(self.model.model(**inputs).logits, batch.labels)
        with hidden_states(self._head):
            hidden = self.model.model(**inputs).logits  # [B, T, H]: the output layer's input
        # Chunks follow tenants only where the output layer has their LoRA; else any rows share one
        groups = [g for g in batch.segments if g[0] is not None and self._head_slotted(g[0])]
        return batch, token_loss(hidden, batch.labels, self._project, groups, self._chunk_tokens)

    def _head_slotted(self, tenant: str) -> bool:
        """Whether the output layer carries ``tenant``'s LoRA."""
        ranks = getattr(self._head, "ranks", None)
        return ranks is not None and ranks[self.model.tenants[tenant].slot] > 0

    def _project(self, tenant: str | None, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of ``h`` [n, H], rows of ``tenant`` (its slot, if the output layer has
        one), for the chunked loss."""
        slots = [] if tenant is None else [(self.model.tenants[tenant].slot, 0, h.shape[0])]
        with self.model.routed(slots, h.shape[0]):
            return self._head(h)

    def _my_rows(self, rows_: list[Example]) -> list[Example]:
        """This data-parallel process's share of a tenant's micro-batch."""
        return rows_[self.comm.dp_rank :: self.comm.dp_size]

    def _optimizer_steps(self, active: list[TenantRun], failed: dict[str, str]) -> None:
        """One optimiser step for each tenant whose window is complete.

        One all-reduce over every process carries, per active tenant, its squared gradient norm (for
        clipping) and a flag for "its part of the step raised somewhere", so every process quarantines
        the same tenants; one more sums the window losses over the data-parallel ranks. With several
        processes, a last tiny all-reduce agrees on optimiser steps that raised."""
        complete = [t.name for t in active if t.micro == t.spec.grad_accum]  # the same on every process
        ready = {name for name in complete if name not in failed}
        # Gradients are summed over the data-parallel ranks here, once per window and only for the
        # tenants that step: one flat all-reduce per group (mlora_lab.parallel).
        self.model.reduce_gradients(complete)
        local = torch.zeros(len(active), 2, dtype=torch.float64)
        for i, t in enumerate(active):
            if t.name in ready:
                t.optimizer.bind()
                local[i, 0] = t.optimizer.local_sq_norm()
            local[i, 1] = float(t.name in failed)
        agreed = self.comm.sum_over_world(local)
        stepping, sq = [], {}
        for t, (sq_t, flag) in zip(active, agreed):
            if flag > 0:
                self._quarantine(t, f"its step raised {failed.get(t.name, 'an error on another process')}")
            elif t.name in ready:
                stepping.append(t)
                sq[t.name] = sq_t
        losses = self.comm.sum_over_dp(torch.stack([t.window_loss for t in stepping])) if stepping else []
        finite = []
        for t, loss in zip(stepping, losses):
            if not (torch.isfinite(sq[t.name]) and torch.isfinite(loss)):
                what = "loss" if not torch.isfinite(loss) else "gradient norm"
                self._quarantine(
                    t, f"non-finite {what}: loss={float(loss)}, grad_norm={float(sq[t.name]) ** 0.5}"
                )
                continue
            finite.append((t, float(loss), t.optimizer.lr, float(sq[t.name].sqrt().float())))
        # every tenant's AdamW step in a few multi-tensor calls (mlora_lab.optim.step_many)
        errors = step_many([(t.optimizer, sq[t.name].sqrt()) for t, *_ in finite])
        raised = {finite[i][0].name: why for i, why in errors.items()}
        done = [item for i, item in enumerate(finite) if i not in errors]
        if self.dims.world_size > 1 and stepping:
            flags = self.comm.sum_over_world(torch.tensor([float(t.name in raised) for t in stepping]))
            raised |= {
                t.name: raised.get(t.name, "an error on another process")
                for t, f in zip(stepping, flags)
                if f
            }
        for t, loss, lr, grad_norm in done:
            if t.name in raised:
                continue
            t.optimizer.zero_grad()
            t.step += 1
            t.micro = 0
            t.tokens_seen += t.window_tokens
            if t.step % self.spec.log_every == 0 or t.step == t.spec.max_steps:
                self._log(TrainRow(step=self.global_step, tenant=t.name, tenant_step=t.step, loss=loss,
                                   tokens=t.window_tokens, lr=lr, grad_norm=grad_norm,
                                   rows_seen=_rows_taken(t.stream), tokens_seen=t.tokens_seen))  # fmt: skip
            if t.step == 1 and t.spec.max_steps > 1:
                # Its AdamW state exists from its first step on: a memory row says so (a tenant that
                # finishes now gets its final row just below).
                self._log_tenant(t)
            if t.step >= t.spec.max_steps:
                self._save_adapter_logged(t.name)
                self._set_state(t, TenantState.FINISHED)
        for t in stepping:
            if t.name in raised:
                self._quarantine(t, f"its optimiser step raised {raised[t.name]}")

    def _quarantine(self, t: TenantRun, why: str) -> None:
        """A tenant whose loss or gradients are NaN/inf, or whose step raised, stops training; nothing
        of it reached any other tenant (separate slots, separate rows), so the others go on exactly as
        without it."""
        t.optimizer.zero_grad()
        t.micro = 0
        reason = f"{why} (tenant step {t.step + 1}, global step {self.global_step})"
        self._set_state(t, TenantState.FAILED, reason)

    @torch.no_grad()
    def evaluate(self, only: list[str] | None = None) -> dict[str, float]:
        """Mean target-token loss of each tenant's eval set (or of the tenants ``only``), computed in
        mixed-tenant batches. A collective: every process calls it with the same tenants."""
        was_training = self.model.training
        self.model.eval()
        # a quarantined tenant's loss is NaN by definition: it is not evaluated
        names = [
            n for n, t in self.tenants.items()
            if t.eval_examples and t.state is not TenantState.FAILED and (only is None or n in only)
        ]  # fmt: skip
        sums = torch.zeros(len(names), 2, dtype=torch.float64)  # (loss sum, target tokens) per tenant
        cursors = dict.fromkeys(names, 0)
        while any(cursors[n] < len(self.tenants[n].eval_examples) for n in names):
            groups = []
            for n in names:
                t, c = self.tenants[n], cursors[n]
                groups.append((n, self._my_rows(t.eval_examples[c : c + t.spec.batch_size])))
                cursors[n] = c + t.spec.batch_size
            batch, token_loss = self._forward(groups)
            n_tokens = (batch.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
            for n, start, end in batch.segments:
                if n is not None:
                    i = names.index(n)
                    sums[i, 0] += float(token_loss[start:end].sum())
                    sums[i, 1] += int(n_tokens[start:end].sum())
        sums = self.comm.sum_over_dp(sums)
        self.model.train(was_training)
        losses = {n: float(sums[i, 0] / max(sums[i, 1], 1)) for i, n in enumerate(names)}
        for n, loss in losses.items():
            self._log(EvalRow(step=self.global_step, tenant=n, loss=loss))
        return losses

    # -- saving ----------------------------------------------------------------------------------
    def save_adapter(self, name: str) -> Path | None:
        """Write ``adapters/<name>`` as a PEFT directory: full tensors gathered on every process
        (a collective), written once, by rank 0, atomically."""
        tensors = self.model.tenant_tensors(name)
        if self.run is None or not self.dist.is_main:
            return None
        path = self.run.adapter(name)
        return self.model.save_adapter(name, path, self.base_path, tensors=tensors)

    def save_adapters(self) -> None:
        for name in self.tenants:
            self.save_adapter(name)

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step_<N>`` (see :class:`~mlora_lab.checkpointer.Checkpointer`)."""
        return self.checkpointer.save()

    def _save_adapter_logged(self, name: str) -> None:
        """Save one tenant's adapter as it finishes; a failure (a full disk) is an event, not the end
        of the job (the final save tries again)."""
        try:
            self.save_adapter(name)
        except checkpoint.WRITE_ERRORS as e:
            self._event(EventKind.SAVE_FAILED, f"adapter of {name!r} at step {self.global_step}: {e}")

    def save(self, final: bool) -> None:
        """Save every adapter and, when checkpointing (``save_every``, or a stop), a checkpoint.

        A periodic save that fails (a full disk, say) is recorded as an ``event`` row and training
        goes on: every earlier checkpoint is intact, and the shared job keeps its tenants. A final
        save that fails raises :class:`SaveError` naming what was not saved, so the run ends
        ``failed`` rather than claiming a result it does not have."""
        problems = []
        for name in list(self.tenants):
            try:
                self.save_adapter(name)
            except checkpoint.WRITE_ERRORS as e:
                problems.append(f"adapter of {name!r}: {e}")
        if self.spec.save_every or self.stop_requested or not final:
            try:
                self.save_checkpoint()
            except checkpoint.WRITE_ERRORS as e:
                problems.append(f"checkpoint at step {self.global_step}: {e}")
        if not problems:
            return
        message = "; ".join(problems)
        if final:
            raise SaveError(f"could not save: {message}")
        self._event(EventKind.SAVE_FAILED, message)

    # -- control and logging ---------------------------------------------------------------------
    def _poll_control(self) -> None:
        """Apply queued control messages at this step boundary, on every rank at the same step, and
        agree on a stop (the stop file, or SIGTERM/SIGINT on any rank)."""
        if self.run is None:
            return
        self.control.poll(self.global_step)
        stop = control.stop_requested(self.run.root) or self.stop_requested
        if self.dims.world_size > 1:
            stop = bool(self.comm.sum_over_world(torch.tensor([float(stop)]))[0] > 0)
        self.stop_requested = stop

    def apply_control(self, msg: dict | ControlMessage) -> None:
        """Apply one control message right now, in this process (prepare + commit); raises, changing
        nothing, if it cannot be applied. The job itself goes through :class:`ControlHandler`."""
        if isinstance(msg, dict):
            msg_id = control.new_message_id()
            msg = ControlMessage.parse({**msg, "id": msg_id}, msg_id)
        self.prepare_control(msg).commit()

    def prepare_control(self, msg: ControlMessage) -> Change:
        """First phase of a control message (see :mod:`mlora_lab.control_handler`): check and do
        everything that can fail; raise, changing nothing, if it cannot be done."""
        if msg.op is Op.ADD:
            return self._prepare_add(msg.tenant)
        name = msg.name
        t = self.tenants.get(name)
        if t is None:
            if name in self.removed:
                raise KeyError(f"no tenant {name!r} in this run (it was removed)")
            if name in self.unstarted:
                raise KeyError(f"tenant {name!r} could not be started ({self.unstarted[name]})")
            raise KeyError(f"no tenant {name!r} in this run; tenants: {sorted(self.tenants)}")
        if msg.op is Op.REMOVE:
            self.save_adapter(name)  # its final adapter, before the slot is cleared (a collective)
            return Change(commit=lambda: self._remove(t))
        wanted = {
            Op.PAUSE: (TenantState.RUNNING, TenantState.PAUSED),
            Op.RESUME: (TenantState.PAUSED, TenantState.RUNNING),
        }
        before, after = wanted[msg.op]
        if t.state is not before:
            raise ValueError(f"tenant {name!r} is {t.state.value}, not {before.value}")
        return Change(commit=lambda: self._set_state(t, after))

    def _poll_search(self) -> None:
        if self.search is not None:
            self.search.poll()

    def start_trial(self, tenant: Tenant, saved: dict | None = None) -> Change:
        """First phase of putting a search trial's tenant into a free slot: fresh, or with ``saved``
        (:meth:`Checkpointer.tenant_state`, a trial that waited for a promotion). Like an ``add``
        message, except that the name is the search's own and may already be in job.json (a trial
        started before a resume, or a paused one)."""
        if len(self.model.tenants) >= self.spec.max_tenants:
            raise ValueError(f"no free slot: all max_tenants={self.spec.max_tenants} slots are taken")
        run = self.add_tenant(tenant, log=False)
        if saved is not None:
            self.checkpointer.restore_tenant(tenant.name, saved)

        def commit() -> None:
            self.removed.discard(tenant.name)
            if not any(t.name == tenant.name for t in self.spec.tenants):
                self.spec.tenants.append(tenant)
                if self.run is not None and self.dist.is_main:
                    try:
                        self.spec.to_json(self.run.job)
                    except OSError as e:
                        print(f"job.json not updated for trial {tenant.name!r}: {e}", flush=True)
            run.state, run.reason = TenantState.RUNNING, None
            self._log_tenant(run)

        return Change(commit=commit, undo=lambda: self._drop(tenant.name))

    def release_slot(self, name: str, state: TenantState | None, reason: str | None) -> None:
        """Free a search trial's slot (it finished, or waits for a promotion with its state kept by
        the search); with ``state``, a tenant row says so."""
        t = self.tenants.pop(name)
        t.optimizer.zero_grad()
        self.model.remove_tenant(name)
        self.removed.add(name)
        if state is not None:
            t.state, t.reason = state, reason
            self._log(TenantRow(step=self.global_step, tenant=name, state=state, reason=reason))

    def _remove(self, t: TenantRun) -> None:
        t.optimizer.zero_grad()
        self.model.remove_tenant(t.name)
        del self.tenants[t.name]
        self.removed.add(t.name)
        self._set_state(t, TenantState.REMOVED)

    def _prepare_add(self, d: dict) -> Change:
        """Validate and add a tenant sent by ``add``. Relative paths in it are relative to the run
        directory, as in job.json (the Run API sends absolute paths), so they resolve the same way
        on resume."""
        tenant = Tenant.from_dict(d)
        if self.run is not None:
            tenant = dataclasses.replace(self.spec, tenants=[tenant]).resolved(self.run.root).tenants[0]
        problems = tenant_problems(self.spec, tenant)  # names too: job.json lists every tenant the run had
        if problems:
            raise SpecError(problems)
        if len(self.model.tenants) >= self.spec.max_tenants:
            raise ValueError(f"no free slot: all max_tenants={self.spec.max_tenants} slots are taken")
        self._log(TenantRow(step=self.global_step, tenant=tenant.name, state=TenantState.PENDING))
        run = self.add_tenant(tenant, log=False)

        def commit() -> None:
            self.spec.tenants.append(tenant)
            if self.run is not None and self.dist.is_main:  # job.json lists every tenant the run has had
                try:
                    self.spec.to_json(self.run.job)
                except OSError as e:  # the tenant is in the next checkpoint anyway; resume restores it
                    print(f"job.json not updated for tenant {tenant.name!r}: {e}", flush=True)
            self._log_tenant(run)

        return Change(commit=commit, undo=lambda: self._drop(tenant.name))

    def _log_refused(self, msg: ControlMessage, error: str) -> None:
        """A refused ``add`` gets a tenant row in state ``refused`` (never left at ``pending``),
        unless its name belongs to a tenant of this run (whose state must not change)."""
        name = msg.subject
        if msg.op is Op.ADD and name is not None and not self._name_taken(name):
            self._log(TenantRow(step=self.global_step, tenant=name, state=TenantState.REFUSED, reason=error))

    def _log(self, row: Row) -> None:
        self.history.append(row.to_dict())
        if self.metrics is None:
            return
        try:
            self.metrics.write(row)
        except OSError as e:  # e.g. a full disk: training goes on; say so once per kind of error
            if str(e) not in self._write_errors:
                self._write_errors.add(str(e))
                print(f"metrics.jsonl: cannot write ({e}); rows are kept in memory", flush=True)

    def _event(self, event: EventKind, message: str) -> None:
        print(f"[{event.value}] {message}", flush=True)
        self._log(EventRow(step=self.global_step, event=event, message=message))

    def _log_system(self, step_time: float, tokens: int) -> None:
        if self.global_step % self.spec.log_every:
            return
        mem, peak = memory_bytes(self.device)
        cpu, gpu = self._cpu.percent(), self._gpu.utilization()
        per_rank = self.comm.gather_objects((mem, peak, step_time, tokens, cpu, gpu))
        total_tokens = sum(r[3] for r in per_rank)
        for rank, (mem, peak, step_time, _, cpu, gpu) in enumerate(per_rank):
            self._log(SystemRow(step=self.global_step, rank=rank, mem_bytes=mem, peak_mem_bytes=peak,
                                step_time=step_time, tokens_per_s=total_tokens / step_time if step_time > 0 else 0.0,
                                cpu_percent=cpu, gpu_util=gpu))  # fmt: skip

    def losses(self, tenant: str) -> list[float]:
        """Per-step training losses of ``tenant`` (from the in-memory history)."""
        return [r["loss"] for r in self.history if r["kind"] == RowKind.TRAIN and r["tenant"] == tenant]

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def _rows_taken(stream: TenantStream) -> int:
    """Rows (documents, when packed) of a tenant's data that went into its batches so far: every row
    the stream handed out, less those drawn for packing that still wait for a place in a row. Read
    from the stream's own position, so it survives a resume exactly."""
    waiting = len(stream.state_dict()["pending"])
    return stream.epoch * len(stream) + stream.cursor - waiting


class CpuMeter:
    """CPU used by this process and its live children between two calls of :meth:`percent`."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._times = self._tree_times()
        self._at = time.monotonic()

    def _tree_times(self) -> dict[int, float]:
        """CPU seconds (user + system) of this process and each live descendant, by pid."""
        times = {}
        with contextlib.suppress(psutil.Error):
            procs = [self._me, *self._me.children(recursive=True)]
            for p in procs:
                with contextlib.suppress(psutil.Error):  # a child may exit while we look
                    t = p.cpu_times()
                    times[p.pid] = t.user + t.system
        return times

    def percent(self) -> float | None:
        """Percent of one core used since the previous call (or since this meter was made)."""
        times, now = self._tree_times(), time.monotonic()
        # a child born since the previous call used all of its time inside the interval
        used = sum(max(t - self._times.get(pid, 0.0), 0.0) for pid, t in times.items())
        elapsed, self._times, self._at = now - self._at, times, now
        return 100.0 * used / elapsed if elapsed > 0 else None


class GpuMeter:
    """GPU utilisation of this process's device (``torch.cuda.utilization``, through NVML); ``None``
    on CPU, and from the first failure on (no ``pynvml``, no NVML driver) without trying again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._available = device.type == "cuda"

    def utilization(self) -> float | None:
        if not self._available:
            return None
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:  # pynvml missing, or NVML not usable here: the field stays empty
            self._available = False
            return None


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(current, peak) memory of this process: torch.cuda figures on GPU, RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss, max(peak, rss)


class _LogStream(io.TextIOBase):
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


def _redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr (Python and C level) to ``path`` (never through a
    symlink planted there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = _LogStream(1)
    sys.stderr = _LogStream(2)


def _job_process() -> ProcessIdentity | None:
    """The process that stands for the whole job on this node: the torchrun agent (this worker's
    parent) under torchrun, else this process."""
    return ProcessIdentity.of(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid())


def _exit_with_agent(poll_s: float = 1.0) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun: ``python -m mlora_lab.train RUN_DIR [--resume]``."""
    parser = argparse.ArgumentParser(description="mlora_lab training job (started by torchrun)")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from the latest intact checkpoint")
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    rank = int(os.environ.get("RANK", 0))
    _redirect_output(run.log(rank))
    _exit_with_agent()
    node = os.environ.get("SLURMD_NODENAME")  # under Slurm: the node as the cluster names it
    where = (
        f"Slurm node {node} (host {this_host()}, job {os.environ.get('SLURM_JOB_ID')})"
        if node
        else this_host()
    )
    print(f"[rank {rank}] pid {os.getpid()} on {where}", flush=True)
    trainer: Trainer | None = None
    signalled = False

    def on_signal(signum, frame):  # graceful stop: finish the step, checkpoint, save, exit
        nonlocal signalled
        signalled = True
        if trainer is not None:
            trainer.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # Ctrl-C in a terminal reaches every rank: as graceful
    lock = RunLock(run)
    if rank == 0:
        # One job per run directory: a launch hands the lock over within seconds; a second job on
        # the same directory never gets it, and leaves that directory's status alone.
        try:
            lock.acquire(timeout=60)
        except (RunDirError, OSError) as e:
            print(f"not starting: {e}", flush=True)
            return 1
    dist = None
    try:
        dist = init_distributed()
        spec = JobSpec.load(run.job)
        # job.json may have been edited since the launch. (A sweep's job may have no tenant of its own:
        # its trials come from the search, so it is checked as a job that waits for tenants.)
        check = dataclasses.replace(spec, serve=True) if run.sweep.is_file() else spec
        problems = spec_problems(check, files=False)
        if problems:
            raise SpecError(problems)
        if dist.is_main:
            me = _job_process()
            update_status(run.root, state=RunState.RUNNING, pid=me.pid if me else None,
                          pid_start_time=me.start_time if me else None, host=me.host if me else None,
                          error=None, ended=None)  # fmt: skip
        trainer = Trainer(spec, run.root, dist, resume=args.resume)
        trainer.stop_requested |= signalled
        trainer.train()
        trainer.close()
        if dist.is_main:
            state = RunState.STOPPED if trainer.stop_requested else RunState.FINISHED
            update_status(run.root, state=state, ended=time.time())
        print(f"[rank {dist.rank}] done after {trainer.global_step} steps", flush=True)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        try:
            current = read_status(run.root)
        except RunDirError:
            current = None
        if current is None or current.state is not RunState.FAILED:  # keep the first rank's error
            try:
                update_status(run.root, state=RunState.FAILED, ended=time.time(),
                              error=f"rank {rank}: {type(exc).__name__}: {exc}")  # fmt: skip
            except OSError as e:  # a full disk: status.json keeps its last (intact) content and the
                print(f"status.json not updated: {e}", flush=True)  # notebook side sees the job gone
        return 1
    finally:
        shutdown_distributed()
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
