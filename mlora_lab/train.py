"""The training job: many LoRA tenants, one frozen base, mixed-tenant batches.

Run by torchrun (``mlora-lab run job.json`` does this for you)::

    torchrun --nproc_per_node 1 -m mlora_lab.train runs/<id>        # reads runs/<id>/job.json

or in-process, for tests and notebooks::

    trainer = Trainer(JobSpec.load("job.json"), run_dir=None)
    trainer.train()

The story of one global step (:meth:`Trainer.step`):

1. every running tenant contributes its next ``batch_size`` rows (a tenant with ``grad_accum = k``
   draws its whole window of ``k * batch_size`` rows at the start of the window and counts its target
   tokens ``N_t`` there, so that k micro-batches give exactly the gradient of one big batch);
2. the rows are collated into one right-padded batch, tenant by tenant, and the base runs once;
3. tenant ``t``'s loss is ``L_t = sum(token CE over its rows) / N_t`` and we back-propagate
   ``sum_t L_t``; since each row only sees its own tenant's slot, ``dL/dslot_t = dL_t/dslot_t``;
4. a tenant whose window is complete takes one AdamW step (own schedule, own clipping), and its
   step counter and data cursor move; the others keep accumulating. Nothing moves for a tenant
   that did not train.
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

from mlora_lab.data import IGNORE_INDEX, Example, TenantStream, collate, load_examples
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.lora.model import ALL_LINEAR
from mlora_lab.lora.peft_io import read_adapter
from mlora_lab.optim import TenantOptimizer, build_optimizer
from mlora_lab.parallel import DistInfo, init_distributed, shutdown_distributed
from mlora_lab.rundir import MetricsWriter, RunDir, atomic_write_json, update_status
from mlora_lab.spec import JobSpec, Tenant

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
    window_loss: torch.Tensor | None = None
    tokens_seen: int = 0
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


class Trainer:
    """``setup`` (in ``__init__``) → ``train`` → ``finish``; one object per job and process."""

    def __init__(
        self, spec: JobSpec, run_dir: str | Path | None = None, dist: DistInfo | None = None
    ) -> None:
        self.spec = spec
        self.dist = dist or DistInfo()
        self.device = self.dist.device
        self.run = RunDir(run_dir).create() if run_dir is not None else None
        self.metrics = MetricsWriter(self.run.metrics) if self.run and self.dist.is_main else None
        self.history: list[dict] = []  # every metrics row, also kept in memory
        self.global_step = 0
        self.stop_requested = False
        torch.manual_seed(spec.seed)

        tok_path = spec.tokenizer or spec.base_model
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tok_path)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        base = transformers.AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=DTYPES[spec.dtype])
        base.to(self.device)
        slot_modules = spec.slot_modules or sorted({m for t in spec.tenants for m in t.target_modules})
        if ALL_LINEAR in slot_modules:
            slot_modules = ALL_LINEAR
        self.model = MultiLoRAModel(
            base, max_tenants=spec.max_tenants, max_rank=spec.max_rank, slot_modules=slot_modules
        )
        self.tenants: dict[str, TenantRun] = {}
        for tenant in spec.tenants:
            self.add_tenant(tenant)

    # -- tenants -------------------------------------------------------------------------------
    def add_tenant(self, tenant: Tenant) -> TenantRun:
        """Fill a free slot with ``tenant`` (from its ``init_adapter`` or PEFT's default init)."""
        init = None
        if tenant.init_adapter:
            _, init = read_adapter(tenant.init_adapter)
        self.model.add_tenant(
            tenant.name,
            rank=tenant.rank,
            alpha=tenant.alpha,
            target_modules=tenant.target_modules,
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
            optimizer=build_optimizer(self.model.tenant_slices(tenant.name), tenant),
            eval_examples=evals,
        )
        self.tenants[tenant.name] = run
        self._set_state(run, "running")
        return run

    def _set_state(self, run: TenantRun, state: str, reason: str | None = None) -> None:
        run.state, run.reason = state, reason
        self._log(
            "tenant",
            step=self.global_step,
            tenant=run.name,
            state=state,
            adapter_bytes=self.model.adapter_bytes(run.name),
            optimizer_bytes=run.optimizer.state_bytes(),
            reason=reason,
        )

    # -- the loop ------------------------------------------------------------------------------
    def train(self) -> None:
        """Run global steps until every tenant has finished (or a stop is requested)."""
        self.model.train()
        while not self.stop_requested and self.step():
            if self.spec.eval_every and self.global_step % self.spec.eval_every == 0:
                self.evaluate()
            if self.spec.save_every and self.global_step % self.spec.save_every == 0:
                self.save_checkpoint()
            self._poll_control()
        if any(t.eval_examples for t in self.tenants.values()):
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
        groups = []
        for t in active:
            if t.micro == 0:
                bs, k = t.spec.batch_size, t.spec.grad_accum
                rows = t.stream.take(bs * k)
                t.window = [rows[i * bs : (i + 1) * bs] for i in range(k)]
                t.window_tokens = sum(ex.n_target for ex in rows)
                t.window_loss = torch.zeros((), device=self.device)
            groups.append((t.name, t.window[t.micro]))
        batch = collate(groups, self.pad_id).to(self.device)

        self.model.set_segments(batch.segments, batch.num_rows)
        logits = self.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        token_loss = causal_lm_token_loss(logits, batch.labels)  # [B, T-1], 0 on ignored tokens
        total = logits.new_zeros((), dtype=torch.float32)
        for name, start, end in batch.segments:
            t = self.tenants[name]
            loss_t = token_loss[start:end].sum() / max(t.window_tokens, 1)
            t.window_loss += loss_t.detach()
            total = total + loss_t
        total.backward()

        self.global_step += 1
        for t in active:
            t.micro += 1
            if t.micro == t.spec.grad_accum:
                self._optimizer_step(t)
        self._log_system(time.perf_counter() - t0, int(batch.attention_mask.sum()))
        return True

    def _optimizer_step(self, t: TenantRun) -> None:
        lr = t.optimizer.lr
        grad_norm = t.optimizer.step()
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
                loss=float(t.window_loss),
                tokens=t.window_tokens,
                lr=lr,
                grad_norm=float(grad_norm),
            )
        if t.step >= t.spec.max_steps:
            self.save_adapter(t.name)
            self._set_state(t, "finished")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean target-token loss of each tenant's eval set, computed in mixed-tenant batches."""
        was_training = self.model.training
        self.model.eval()
        sums = {n: 0.0 for n, t in self.tenants.items() if t.eval_examples}
        counts = dict.fromkeys(sums, 0)
        cursors = dict.fromkeys(sums, 0)
        while any(cursors[n] < len(self.tenants[n].eval_examples) for n in sums):
            groups = []
            for n in sums:
                t, c = self.tenants[n], cursors[n]
                groups.append((n, t.eval_examples[c : c + t.spec.batch_size]))
                cursors[n] = c + t.spec.batch_size
            batch = collate(groups, self.pad_id).to(self.device)
            self.model.set_segments(batch.segments, batch.num_rows)
            logits = self.model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            token_loss = causal_lm_token_loss(logits, batch.labels)
            n_tokens = (batch.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
            for n, start, end in batch.segments:
                sums[n] += float(token_loss[start:end].sum())
                counts[n] += int(n_tokens[start:end].sum())
        self.model.train(was_training)
        losses = {n: sums[n] / max(counts[n], 1) for n in sums}
        for n, loss in losses.items():
            self._log("eval", step=self.global_step, tenant=n, loss=loss)
        return losses

    # -- saving ----------------------------------------------------------------------------------
    def save_adapter(self, name: str) -> Path | None:
        if self.run is None or not self.dist.is_main:
            return None
        return self.model.save_adapter(name, self.run.adapter(name), self.spec.base_model)

    def save_adapters(self) -> None:
        for name in self.tenants:
            self.save_adapter(name)

    def checkpoint_state(self) -> dict:
        """Everything needed to continue exactly: adapters, optimisers, counters, cursors, RNG."""
        return {
            "global_step": self.global_step,
            "rng": torch.get_rng_state(),
            "tenants": {
                name: {
                    "spec": t.spec.to_dict(),
                    "adapter": self.model.tenant_tensors(name),
                    "optimizer": t.optimizer.state_dict(),
                    "stream": t.stream.state_dict(),
                    "state": t.state,
                    "step": t.step,
                    "tokens_seen": t.tokens_seen,
                }
                for name, t in self.tenants.items()
            },
        }

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step_<N>`` under a temporary name, then rename (only complete ones count)."""
        if self.run is None or not self.dist.is_main:
            return None
        if any(t.micro for t in self.tenants.values()):
            # Mid-window gradients are not part of a checkpoint; save at the next window boundary.
            return None
        final = self.run.checkpoints / f"step_{self.global_step:08d}"
        tmp = self.run.checkpoints / f".tmp-step_{self.global_step:08d}"
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(self.checkpoint_state(), tmp / "state.pt")
        atomic_write_json(tmp / "meta.json", {"global_step": self.global_step, "tenants": list(self.tenants)})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(self.run.checkpoints.glob("step_*"))[:-CHECKPOINTS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    # -- control and logging ---------------------------------------------------------------------
    def _poll_control(self) -> None:
        if self.run is not None and (self.run.control / "stop").exists():
            self.stop_requested = True

    def _log(self, kind: str, **row) -> None:
        row = {"kind": kind, **row, "time": time.time()}
        self.history.append(row)
        if self.metrics is not None:
            self.metrics.write(**row)

    def _log_system(self, step_time: float, tokens: int) -> None:
        if self.global_step % self.spec.log_every:
            return
        mem, peak = memory_bytes(self.device)
        self._log(
            "system",
            step=self.global_step,
            rank=self.dist.rank,
            mem_bytes=mem,
            peak_mem_bytes=peak,
            step_time=step_time,
            tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
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
    """Entry point for torchrun: ``python -m mlora_lab.train RUN_DIR``."""
    parser = argparse.ArgumentParser(description="mlora_lab training job (started by torchrun)")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    rank = int(os.environ.get("RANK", 0))
    _redirect_output(run.log(rank))
    dist = init_distributed()
    trainer = None

    def on_sigterm(signum, frame):  # graceful stop: finish the step, checkpoint, save, exit
        if trainer is not None:
            trainer.stop_requested = True

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        spec = JobSpec.load(run.job)
        if dist.is_main:
            update_status(run.root, state="running", started=time.time())
        trainer = Trainer(spec, run.root, dist)
        trainer.train()
        trainer.close()
        if dist.is_main:
            state = "stopped" if trainer.stop_requested else "finished"
            update_status(run.root, state=state, ended=time.time())
        print(f"[rank {dist.rank}] done after {trainer.global_step} steps", flush=True)
        return 0
    except BaseException as exc:
        traceback.print_exc()
        if dist.is_main:
            update_status(
                run.root,
                state="failed",
                ended=time.time(),
                error=f"rank {dist.rank}: {type(exc).__name__}: {exc}",
            )
        return 1
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
