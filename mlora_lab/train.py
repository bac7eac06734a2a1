"""The training job: many LoRA tenants, one frozen base, mixed-tenant batches.

Run by torchrun (``mlora-lab run job.json`` does this for you)::

    torchrun --standalone --nproc-per-node 2 -m mlora_lab.train runs/<id>            # reads runs/<id>/job.json
    torchrun --standalone --nproc-per-node 1 -m mlora_lab.train runs/<id> --resume   # continue from its checkpoint

or in-process, for tests and notebooks::

    trainer = Trainer(JobSpec.load("job.json"), run_dir=None)
    trainer.train()

The story of one global step (:meth:`Trainer.step`):

1. every running tenant contributes its next ``batch_size`` rows (a tenant with ``grad_accum = k``
   draws its whole window of ``k * batch_size`` rows at the start of the window and counts its target
   tokens ``N_t`` there, so that k micro-batches give exactly the gradient of one big batch);
   with ``D`` data-parallel processes, process ``d`` takes rows ``d, d + D, ...`` of each tenant's share;
2. the local rows are collated into one right-padded batch, tenant by tenant, and the base runs once;
3. tenant ``t``'s loss on a process is ``sum(token CE over its local rows) / N_t`` (``N_t`` counts the
   whole window, on every process, so summing gradients over processes gives exactly the one-process
   gradient) and we back-propagate ``sum_t L_t``; each row only sees its own tenant's slot, so
   ``dL/dslot_t = dL_t/dslot_t``;
4. a tenant whose window is complete takes one AdamW step (own schedule, own clipping by its own
   global gradient norm), and its step counter and data cursor move; the others keep accumulating.
   Nothing moves for a tenant that did not train.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
import transformers

from mlora_lab import control
from mlora_lab.data import IGNORE_INDEX, DataError, Example, TenantStream, collate, load_examples
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.lora.peft_io import AdapterError
from mlora_lab.optim import TenantOptimizer, build_optimizer
from mlora_lab.parallel import (
    Collectives,
    DistInfo,
    ParallelDims,
    init_distributed,
    parallelize,
    shutdown_distributed,
)
from mlora_lab.rundir import (
    MetricsWriter,
    RunDir,
    atomic_write_json,
    atomic_write_text,
    read_status,
    update_status,
)
from mlora_lab.spec import JobSpec, SpecError, Tenant, effective_slot_modules, tenant_problems

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINTS_KEPT = 2


@dataclass
class TenantRun:
    """A tenant's live training state: its data order, optimiser, counters and accumulation window."""

    spec: Tenant
    stream: TenantStream
    optimizer: TenantOptimizer
    eval_examples: list[Example] = field(default_factory=list)
    state: str = "pending"
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
        self.spec = spec
        self.dist = dist or DistInfo()
        self.device = self.dist.device
        self.run = RunDir(run_dir).create() if run_dir is not None else None
        self.history: list[dict] = []  # every metrics row, also kept in memory
        self.global_step = 0
        self.stop_requested = False
        torch.manual_seed(spec.seed)

        # Parallel layout: one place decides it; the model below stays plain until parallelize().
        p = spec.parallel
        self.dims = ParallelDims(self.dist.world_size, fsdp=p.fsdp, tp=p.tp, ep=p.ep)
        mesh = self.dims.build_mesh(self.device.type)
        self.comm = Collectives(self.dims, mesh, self.device)

        tok_path = spec.tokenizer or spec.base_model
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tok_path)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        base = transformers.AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=DTYPES[spec.dtype])
        base.to(self.device)
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
        parallelize(self.model, self.dims, mesh, self.device.type)

        checkpoint = self._latest_checkpoint() if resume else None
        if resume and checkpoint is None:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint in {self.run.checkpoints if self.run else None}"
            )
        if self.run is not None and self.dist.is_main and checkpoint is not None:
            self._truncate_metrics(int(checkpoint.name.split("_")[-1]))
        self.metrics = MetricsWriter(self.run.metrics) if self.run and self.dist.is_main else None
        self.tenants: dict[str, TenantRun] = {}
        self.removed: set[str] = set()  # names of tenants removed while the job ran (never reused)
        saved = (
            torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=False)
            if checkpoint
            else None
        )
        for tenant in spec.tenants:
            if saved is not None and tenant.name in saved.get("removed", []):
                self.removed.add(tenant.name)
                continue
            # a tenant added after the last checkpoint has no state in it: it starts afresh
            self.add_tenant(tenant, log=saved is None or tenant.name not in saved["tenants"])
        if checkpoint is not None:
            self.load_checkpoint(checkpoint, saved)

    # -- tenants -------------------------------------------------------------------------------
    def add_tenant(self, tenant: Tenant, log: bool = True) -> TenantRun:
        """Fill a free slot with ``tenant`` (from its ``init_adapter`` or PEFT's default init)."""
        init = None
        if tenant.init_adapter:
            _, init = self.model.read_peft_adapter(tenant.init_adapter)
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
        examples = load_examples(tenant.data, self.tokenizer, self.spec.seq_len)
        evals = load_examples(tenant.eval_data, self.tokenizer, self.spec.seq_len) if tenant.eval_data else []
        run = TenantRun(
            spec=tenant,
            stream=TenantStream(examples, seed=tenant.seed, shuffle=tenant.shuffle),
            optimizer=build_optimizer(
                self.model.tenant_slices(tenant.name),
                tenant,
                local=self.model.io.local,
                copies=self.model.io.copies,
            ),
            eval_examples=evals,
            state="running",
        )
        self.tenants[tenant.name] = run
        if log:
            self._log_tenant(run)
        return run

    def _set_state(self, run: TenantRun, state: str, reason: str | None = None) -> None:
        run.state, run.reason = state, reason
        self._log_tenant(run)

    def _log_tenant(self, run: TenantRun) -> None:
        """A ``tenant`` row: state, and the tenant's adapter + optimiser bytes (full and on this rank)."""
        if run.name not in self.model.tenants:  # removed: its slot and optimiser are gone
            self._log("tenant", step=self.global_step, tenant=run.name, state=run.state, adapter_bytes=0,
                      optimizer_bytes=0, local_adapter_bytes=0, local_optimizer_bytes=0, reason=run.reason)  # fmt: skip
            return
        adapter = self.model.adapter_bytes(run.name)
        optimizer_local = run.optimizer.state_bytes()
        self._log(
            "tenant",
            step=self.global_step,
            tenant=run.name,
            state=run.state,
            adapter_bytes=adapter,
            optimizer_bytes=2 * adapter if run.step else 0,  # AdamW: two moments once it has stepped
            local_adapter_bytes=sum(self.model.io.local(p.data)[i].nbytes for p, i in run.optimizer.slices),
            local_optimizer_bytes=optimizer_local,
            reason=run.reason,
        )

    # -- the loop ------------------------------------------------------------------------------
    def train(self, idle_s: float = 0.5) -> None:
        """Run global steps until every tenant is done (or a stop is requested). In serve mode the
        job then idles, polling for control messages every ``idle_s`` seconds, until stopped."""
        self.model.train()
        self._poll_control()
        while not self.stop_requested:
            if self.step():
                if self.spec.eval_every and self.global_step % self.spec.eval_every == 0:
                    self.evaluate()
                if self.spec.save_every and self.global_step % self.spec.save_every == 0:
                    self.save_checkpoint()
            elif self.spec.serve:
                time.sleep(idle_s)  # nothing to train: wait cheaply for new tenants
            else:
                break
            self._poll_control()
        if not self.stop_requested and any(t.eval_examples for t in self.tenants.values()):
            self.evaluate()
        self.save_adapters()
        if self.spec.save_every or self.stop_requested:
            self.save_checkpoint()

    def step(self) -> bool:
        """One global step over every running tenant; False when none is left."""
        active = [t for t in self.tenants.values() if t.state == "running"]
        if not active:
            return False
        t0 = time.perf_counter()
        groups: list[tuple[str | None, list[Example]]] = []
        for t in active:
            if t.micro == 0:
                bs, k = t.spec.batch_size, t.spec.grad_accum
                rows = t.stream.take(bs * k)
                t.window = [rows[i * bs : (i + 1) * bs] for i in range(k)]
                t.window_tokens = sum(ex.n_target for ex in rows)
                t.window_loss = torch.zeros((), device=self.device)
            groups.append((t.name, self._my_rows(t.window[t.micro])))
        if not any(rows for _, rows in groups):
            # This process got no rows: it still runs forward/backward for the collectives.
            groups = [(None, [Example([self.pad_id, self.pad_id], [IGNORE_INDEX, IGNORE_INDEX])])]
        batch = collate(groups, self.pad_id).to(self.device)

        self.model.set_segments(batch.segments, batch.num_rows)
        logits = self.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        token_loss = causal_lm_token_loss(logits, batch.labels)  # [B, T-1], 0 on ignored tokens
        total = token_loss.sum() * 0.0  # keeps every process's graph connected even without rows
        for name, start, end in batch.segments:
            if name is None:
                continue
            t = self.tenants[name]
            loss_t = token_loss[start:end].sum() / max(t.window_tokens, 1)
            t.window_loss += loss_t.detach()
            total = total + loss_t
        total.backward()

        self.global_step += 1
        stepping = []
        for t in active:
            t.micro += 1
            if t.micro == t.spec.grad_accum:
                stepping.append(t)
        if stepping:
            self._optimizer_steps(stepping)
        self._log_system(time.perf_counter() - t0, int(batch.attention_mask.sum()))
        return True

    def _my_rows(self, rows: list[Example]) -> list[Example]:
        """This data-parallel process's share of a tenant's micro-batch."""
        return rows[self.comm.dp_rank :: self.comm.dp_size]

    def _optimizer_steps(self, stepping: list[TenantRun]) -> None:
        """One optimiser step for each tenant whose window is complete (two small collectives in all:
        the tenants' squared gradient norms over shards, their losses over data-parallel ranks)."""
        for t in stepping:
            t.optimizer.bind()
        sq = self.comm.sum_over_world(torch.stack([t.optimizer.local_sq_norm() for t in stepping]))
        losses = self.comm.sum_over_dp(torch.stack([t.window_loss for t in stepping]))
        for t, t_sq, loss in zip(stepping, sq, losses):
            if not (torch.isfinite(t_sq) and torch.isfinite(loss)):
                self._quarantine(
                    t, "loss" if not torch.isfinite(loss) else "gradient norm", float(loss), float(t_sq)
                )
                continue
            lr = t.optimizer.lr
            grad_norm = t.optimizer.step(grad_norm=t_sq.sqrt(), rebind=False)
            t.optimizer.zero_grad()
            t.step += 1
            t.micro = 0
            t.tokens_seen += t.window_tokens
            if t.step % self.spec.log_every == 0 or t.step == t.spec.max_steps:
                self._log(
                    "train",
                    step=self.global_step,
                    tenant=t.name,
                    tenant_step=t.step,
                    loss=float(loss),
                    tokens=t.window_tokens,
                    lr=lr,
                    grad_norm=float(grad_norm),
                )
            if t.step >= t.spec.max_steps:
                self.save_adapter(t.name)
                self._set_state(t, "finished")

    def _quarantine(self, t: TenantRun, what: str, loss: float, sq_norm: float) -> None:
        """A tenant whose loss or gradients are NaN/inf stops training; nothing of it reached any
        other tenant (separate slots, separate rows), so the others go on exactly as without it."""
        t.optimizer.zero_grad()
        t.micro = 0
        reason = (
            f"non-finite {what} at tenant step {t.step + 1} (global step {self.global_step}): "
            f"loss={loss}, grad_norm={sq_norm**0.5 if sq_norm >= 0 else sq_norm}"
        )
        self._set_state(t, "failed", reason)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean target-token loss of each tenant's eval set, computed in mixed-tenant batches."""
        was_training = self.model.training
        self.model.eval()
        names = [n for n, t in self.tenants.items() if t.eval_examples]
        sums = torch.zeros(len(names), 2, dtype=torch.float64)  # (loss sum, target tokens) per tenant
        cursors = dict.fromkeys(names, 0)
        while any(cursors[n] < len(self.tenants[n].eval_examples) for n in names):
            groups = []
            for n in names:
                t, c = self.tenants[n], cursors[n]
                groups.append((n, self._my_rows(t.eval_examples[c : c + t.spec.batch_size])))
                cursors[n] = c + t.spec.batch_size
            if not any(rows for _, rows in groups):
                groups = [(None, [Example([self.pad_id, self.pad_id], [IGNORE_INDEX, IGNORE_INDEX])])]
            batch = collate(groups, self.pad_id).to(self.device)
            self.model.set_segments(batch.segments, batch.num_rows)
            logits = self.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            token_loss = causal_lm_token_loss(logits, batch.labels)
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
            self._log("eval", step=self.global_step, tenant=n, loss=loss)
        return losses

    # -- saving ----------------------------------------------------------------------------------
    def save_adapter(self, name: str) -> Path | None:
        """Write ``adapters/<name>`` as a PEFT directory: full tensors gathered on every process
        (a collective), written once, by rank 0, atomically."""
        tensors = self.model.tenant_tensors(name)
        if self.run is None or not self.dist.is_main:
            return None
        return self.model.save_adapter(name, self.run.adapter(name), self.spec.base_model, tensors=tensors)

    def save_adapters(self) -> None:
        for name in self.tenants:
            self.save_adapter(name)

    def checkpoint_state(self) -> dict:
        """Everything needed to continue exactly, in full (gathered) form: adapters, optimisers and
        schedules, counters, data cursors, accumulation windows with their gradients so far, RNG.
        A collective: every process calls it."""
        io = self.model.io
        tenants = {}
        for name, t in self.tenants.items():
            partial_grads = None
            if t.micro:  # mid-window: keep the gradient accumulated so far
                partial_grads = [
                    io.gather(p, i, io.local(p.grad)[i]) if p.grad is not None else None
                    for p, i in t.optimizer.slices
                ]
            tenants[name] = {
                "spec": t.spec.to_dict(),
                "adapter": self.model.tenant_tensors(name),
                "optimizer": t.optimizer.state_dict(gather=io.gather),
                "stream": t.stream.state_dict(),
                "state": t.state,
                "reason": t.reason,
                "step": t.step,
                "micro": t.micro,
                "window": [[(ex.input_ids, ex.labels) for ex in rows] for rows in t.window],
                "window_tokens": t.window_tokens,
                "window_loss": float(self.comm.sum_over_dp(t.window_loss.reshape(1))[0])
                if t.window_loss is not None
                else 0.0,
                "partial_grads": partial_grads,
                "tokens_seen": t.tokens_seen,
            }
        return {
            "global_step": self.global_step,
            "world_size": self.dist.world_size,
            "removed": sorted(self.removed),
            "rng": torch.get_rng_state(),
            "tenants": tenants,
        }

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step_<N>`` under a temporary name, then rename: a directory named
        ``step_*`` is always complete (resume never reads a half-written one)."""
        state = self.checkpoint_state()
        if self.run is None or not self.dist.is_main:
            return None
        final = self.run.checkpoints / f"step_{self.global_step:08d}"
        tmp = self.run.checkpoints / f".tmp-step_{self.global_step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(state, tmp / "state.pt")
        atomic_write_json(tmp / "meta.json", {"global_step": self.global_step, "tenants": list(self.tenants)})
        with open(tmp / "state.pt", "rb") as f:
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(self.run.checkpoints.glob("step_*"))[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _latest_checkpoint(self) -> Path | None:
        if self.run is None:
            return None
        done = [p for p in sorted(self.run.checkpoints.glob("step_*")) if (p / "meta.json").is_file()]
        return done[-1] if done else None

    def load_checkpoint(self, path: Path, state: dict | None = None) -> None:
        """Restore the state written by :meth:`save_checkpoint` (any world size)."""
        if state is None:
            state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        io = self.model.io
        self.global_step = state["global_step"]
        torch.set_rng_state(state["rng"])
        for name, s in state["tenants"].items():
            t = self.tenants.get(name)
            if t is None:
                raise ValueError(f"checkpoint {path} holds tenant {name!r}, which job.json does not list")
            self.model.set_tenant_tensors(name, s["adapter"])
            t.optimizer.load_state_dict(s["optimizer"], scatter=io.scatter)
            t.stream.load_state_dict(s["stream"])
            t.state, t.reason, t.step, t.micro = s["state"], s["reason"], s["step"], s["micro"]
            t.window = [[Example(list(ids), list(lab)) for ids, lab in rows] for rows in s["window"]]
            t.window_tokens, t.tokens_seen = s["window_tokens"], s["tokens_seen"]
            # The saved loss is the sum over all processes: rank 0 carries it, the others restart at 0.
            t.window_loss = torch.tensor(
                s["window_loss"] if self.comm.dp_rank == 0 else 0.0, device=self.device
            )
            if s["partial_grads"] is not None:
                for (p, i), g in zip(t.optimizer.slices, s["partial_grads"]):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    io.local(p.grad)[i].copy_(io.scatter(p, i, g))
        self._log(
            "event",
            step=self.global_step,
            event="resumed",
            checkpoint=path.name,
            world_size=self.dist.world_size,
        )

    def _truncate_metrics(self, step: int) -> None:
        """Drop rows logged after the checkpoint we resume from (they will be logged again)."""
        import json

        path = self.run.metrics
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        keep = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a row cut off by a crash
            if row.get("step", 0) <= step:
                keep.append(line)
        atomic_write_text(path, "".join(line + "\n" for line in keep))

    # -- control and logging ---------------------------------------------------------------------
    def _poll_control(self) -> None:
        """Apply queued control messages at this step boundary, on every rank at the same step:
        rank 0 reads them and broadcasts them. A stop (file or SIGTERM on any rank) is agreed too."""
        if self.run is None:
            return
        messages: list[tuple[str, dict | str]] = []
        if self.dist.is_main:
            messages = [(str(p), m) for p, m in control.pending(self.run.root)]
        messages = self.comm.broadcast_object(messages)
        stop = (self.run.control / "stop").exists() or self.stop_requested
        if self.dims.world_size > 1:
            stop = bool(self.comm.sum_over_dp(torch.tensor([float(stop)]))[0] > 0)
        self.stop_requested = stop
        for path, msg in messages:
            if isinstance(msg, str):
                ok, error = False, msg
            else:
                try:
                    self.apply_control(msg)
                    ok, error = True, None
                except (ValueError, KeyError, RuntimeError, OSError, SpecError, DataError, AdapterError) as e:
                    ok, error = False, f"{msg.get('op')}: {e}"
            if self.dist.is_main:
                msg_id = msg.get("id") if isinstance(msg, dict) else None
                control.finish(self.run.root, Path(path), msg_id, ok, error, self.global_step)
                if error:
                    print(f"control message rejected: {error}", flush=True)

    def apply_control(self, msg: dict) -> None:
        """``add`` / ``remove`` / ``pause`` / ``resume`` one tenant; raises (changing nothing) if not possible."""
        op = msg["op"]
        if op == "add":
            tenant = Tenant.from_dict(msg["tenant"])
            if tenant.name in self.tenants or tenant.name in self.removed:
                raise ValueError(f"a tenant named {tenant.name!r} already exists in this run")
            problems = [p for p in tenant_problems(self.spec, tenant) if p]
            if problems:
                raise SpecError(problems)
            self._log("tenant", step=self.global_step, tenant=tenant.name, state="pending", adapter_bytes=0,
                      optimizer_bytes=0, local_adapter_bytes=0, local_optimizer_bytes=0, reason=None)  # fmt: skip
            try:
                self.add_tenant(tenant)
            except Exception:
                self.tenants.pop(tenant.name, None)
                if tenant.name in self.model.tenants:
                    self.model.remove_tenant(tenant.name)
                raise
            self.spec.tenants.append(tenant)
            if self.dist.is_main:  # job.json lists every tenant the run has had (for resume and attach)
                self.spec.to_json(self.run.job)
            return
        name = msg.get("name")
        t = self.tenants.get(name)
        if t is None:
            known = sorted(self.tenants)
            detail = " (it was removed)" if name in self.removed else f"; tenants: {known}"
            raise KeyError(f"no tenant {name!r} in this run{detail}")
        if op == "remove":
            self.save_adapter(name)  # its final adapter, before the slot is cleared
            t.optimizer.zero_grad()
            self.model.remove_tenant(name)
            del self.tenants[name]
            self.removed.add(name)
            t.state, t.reason = "removed", None
            self._log_tenant(t)
        elif op == "pause":
            if t.state != "running":
                raise ValueError(f"tenant {name!r} is {t.state}, not running")
            self._set_state(t, "paused")
        elif op == "resume":
            if t.state != "paused":
                raise ValueError(f"tenant {name!r} is {t.state}, not paused")
            self._set_state(t, "running")

    def _log(self, kind: str, **row) -> None:
        row = {"kind": kind, **row, "time": time.time()}
        self.history.append(row)
        if self.metrics is not None:
            self.metrics.write(**row)

    def _log_system(self, step_time: float, tokens: int) -> None:
        if self.global_step % self.spec.log_every:
            return
        mem, peak = memory_bytes(self.device)
        per_rank = self.comm.gather_objects((mem, peak, step_time, tokens))
        total_tokens = sum(r[3] for r in per_rank)
        for rank, (mem, peak, step_time, _) in enumerate(per_rank):
            self._log(
                "system",
                step=self.global_step,
                rank=rank,
                mem_bytes=mem,
                peak_mem_bytes=peak,
                step_time=step_time,
                tokens_per_s=total_tokens / step_time if step_time > 0 else 0.0,
            )

    def losses(self, tenant: str) -> list[float]:
        """Per-step training losses of ``tenant`` (from the in-memory history)."""
        return [r["loss"] for r in self.history if r["kind"] == "train" and r["tenant"] == tenant]

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def causal_lm_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross entropy ``[B, T-1]`` (fp32), 0 where ``labels[:, 1:]`` is ignored."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return loss.view(shift_labels.shape)


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(current, peak) memory of this process: torch.cuda figures on GPU, RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss, max(peak, rss)


def _redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr (Python and C level) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun: ``python -m mlora_lab.train RUN_DIR [--resume]``."""
    parser = argparse.ArgumentParser(description="mlora_lab training job (started by torchrun)")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    rank = int(os.environ.get("RANK", 0))
    _redirect_output(run.log(rank))
    trainer = None

    def on_sigterm(signum, frame):  # graceful stop: finish the step, checkpoint, save, exit
        if trainer is not None:
            trainer.stop_requested = True

    signal.signal(signal.SIGTERM, on_sigterm)
    dist = None
    try:
        dist = init_distributed()
        spec = JobSpec.load(run.job)
        if dist.is_main:
            # Jobs started by launchers/ (not launch()) have no pid yet: record this node's torchrun agent.
            pid = read_status(run.root).get("pid") or os.getppid()
            update_status(run.root, state="running", pid=pid, error=None, ended=None)
        trainer = Trainer(spec, run.root, dist, resume=args.resume)
        trainer.train()
        trainer.close()
        if dist.is_main:
            state = "stopped" if trainer.stop_requested else "finished"
            update_status(run.root, state=state, ended=time.time())
        print(f"[rank {dist.rank}] done after {trainer.global_step} steps", flush=True)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        if read_status(run.root).get("state") != "failed":  # keep the first rank's error
            update_status(
                run.root,
                state="failed",
                ended=time.time(),
                error=f"rank {rank}: {type(exc).__name__}: {exc}",
            )
        return 1
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
