"""Checkpointing a job: what its resumable state is, and how it is saved and restored.

A checkpoint holds, for every tenant, everything needed to continue exactly, in full (gathered) form,
so it can be resumed on any number of processes: its spec, adapter, optimiser and schedule state,
counters, data cursor, the accumulation window with its gradient so far; and for the job, the global
step, the removed tenants and the RNG state. The files and their format (JSON + safetensors, checksums,
atomic commit) are :mod:`mlora_lab.rundir.checkpoint`'s.

Rank 0 writes; rank 0 also picks the checkpoint to resume from (the newest intact one, skipping
damaged ones, with the reasons) and every rank reads that one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mlora_lab.data import Example
from mlora_lab.rundir import TenantState, checkpoint

if TYPE_CHECKING:
    from mlora_lab.train import Trainer

CHECKPOINTS_KEPT = 2


class Checkpointer:
    """Saves and restores one :class:`~mlora_lab.train.Trainer`'s state under ``checkpoints/``."""

    def __init__(self, trainer: Trainer, keep: int = CHECKPOINTS_KEPT) -> None:
        self.trainer = trainer
        self.keep = keep

    def tenant_state(self, name: str) -> dict[str, Any]:
        """Everything needed to continue tenant ``name`` exactly, gathered in full (the same whatever the
        sharding): spec, adapter, optimiser and schedule, data cursor, counters, the accumulation
        window with its gradient so far. A collective: every process calls it."""
        tr = self.trainer
        io = tr.model.io
        t = tr.tenants[name]
        partial_grads = None
        if t.micro:  # mid-window: keep the gradient accumulated so far, summed over the ranks
            partial_grads = [io.gather(p, i, io.grad_sum(p)[i]) for p, i in t.optimizer.slices]
        window_loss = t.window_loss.reshape(1) if t.window_loss is not None else torch.zeros(1)
        return {
            "spec": t.spec.to_dict(),
            "adapter": tr.model.tenant_tensors(name),
            "optimizer": t.optimizer.state_dict(gather=io.gather),
            "stream": t.stream.state_dict(),
            "state": t.state.value,
            "reason": t.reason,
            "step": t.step,
            "micro": t.micro,
            "window": [[[ex.input_ids, ex.labels, ex.position_ids] for ex in rows] for rows in t.window],
            "window_tokens": t.window_tokens,
            "window_loss": float(tr.comm.sum_over_dp(window_loss)[0]),
            "partial_grads": partial_grads,
            "tokens_seen": t.tokens_seen,
        }

    def state(self) -> dict[str, Any]:
        """The job's resumable state, gathered in full. A collective: every process calls it."""
        tr = self.trainer
        state = {
            "global_step": tr.global_step,
            "world_size": tr.dist.world_size,
            "removed": sorted(tr.removed),
            "rng": torch.get_rng_state(),
            "tenants": {name: self.tenant_state(name) for name in tr.tenants},
        }
        if tr.search is not None:
            state["search"] = tr.search.state()
        return state

    def save(self) -> Path | None:
        """Write ``checkpoints/step_<N>`` (rank 0) and drop all but the newest ``keep``. A collective.
        A failed write (a full disk) raises on rank 0 and leaves every earlier checkpoint intact."""
        tr = self.trainer
        state = self.state()
        if tr.run is None or not tr.dist.is_main:
            return None
        folder = tr.run.inside(tr.run.checkpoints)  # never through a symlink planted in its place
        path = checkpoint.write_checkpoint(folder, tr.global_step, state)
        checkpoint.prune(folder, self.keep)
        return path

    def choose(self) -> tuple[Path | None, list[tuple[str, str]]]:
        """The checkpoint to resume from, as rank 0 found it: the newest intact one, and the newer
        damaged ones skipped, ``(name, why)``. A collective."""
        tr = self.trainer
        found: tuple[str | None, list[tuple[str, str]]] = (None, [])
        if tr.run is not None and tr.dist.is_main:
            path, skipped = checkpoint.latest_intact(tr.run.checkpoints)
            found = (path.name if path else None, [(p.name, why) for p, why in skipped])
        name, skipped = tr.comm.broadcast_object(found)
        return (tr.run.checkpoints / name if name else None), skipped

    def read(self, path: Path) -> dict[str, Any]:
        return checkpoint.read_checkpoint(path)

    def restore(self, state: dict[str, Any]) -> None:
        """Put ``state`` (from :meth:`read`) back into the trainer, whose tenants already hold slots."""
        tr = self.trainer
        tr.global_step = state["global_step"]
        torch.set_rng_state(state["rng"])
        for name, s in state["tenants"].items():
            if name in tr.tenants:  # (else it could not be started this time; its row says why)
                self.restore_tenant(name, s)

    def restore_tenant(self, name: str, s: dict[str, Any], whole: bool = True) -> None:
        """Put one tenant's saved state ``s`` (:meth:`tenant_state`) into tenant ``name``, which holds a
        slot of the same shape. ``whole=False`` (PBT's exploit) takes only the training state (adapter,
        optimiser and schedule, step): the tenant keeps its own data cursor, counters and name."""
        tr = self.trainer
        io = tr.model.io
        t = tr.tenants[name]
        tr.model.set_tenant_tensors(name, s["adapter"])
        t.optimizer.load_state_dict(s["optimizer"], scatter=io.scatter)
        t.step = s["step"]
        if not whole:
            return
        t.stream.load_state_dict(s["stream"])
        t.state, t.reason, t.micro = TenantState(s["state"]), s["reason"], s["micro"]
        t.window = [[_example(row) for row in rows] for rows in s["window"]]
        t.window_tokens, t.tokens_seen = s["window_tokens"], s["tokens_seen"]
        # The saved loss is the sum over all processes: rank 0 carries it, the others restart at 0.
        t.window_loss = torch.tensor(s["window_loss"] if tr.comm.dp_rank == 0 else 0.0, device=tr.device)
        if s["partial_grads"] is not None:
            for (p, i), g in zip(t.optimizer.slices, s["partial_grads"]):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                part = io.scatter(p, i, g)
                # the saved sum goes to one of the processes it will be summed over again
                io.local(p.grad)[i].copy_(part if io.first_copy(p) else torch.zeros_like(part))


def _example(saved: list) -> Example:
    """A window row as saved: ``[input_ids, labels, position_ids]`` (``None`` unless packed; checkpoints
    written before packing existed have no third entry)."""
    ids, labels, *rest = saved
    positions = rest[0] if rest else None
    return Example(list(ids), list(labels), None if positions is None else list(positions))
