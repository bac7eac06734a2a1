"""Rollout ranks (``Parallel.rollout_ranks = k``): the last ``k`` processes of a job hold the frozen base and
every RL tenant's adapter, and do the RL tenants' sampling while the other processes train.

::

    trainers (ranks 0 … T−1)                         rollout rank j (rank T + j)
    ───────────────────────                          ──────────────────────────
    plan(): a tenant's generation is due             loop:
      rank 0 ──down[j]──▶ AdapterUpdate(v)  ─────▶     check its digest; swap the tenant's adapter whole
      rank 0 ──down[j]──▶ SampleWork(ticket) ────▶     sample(model, requests)   (one batch, its own seeds)
      … the trainers train other windows …
      rank 0 ◀──up[j]─── Samples(ticket) ◀───────      reply (tokens, sampler log-probs, stop reasons)
    a window that needs the generation waits for it

**Versions.** Messages to a rollout rank are handled in the order they were sent, so the requests that follow
``AdapterUpdate(tenant, v)`` are sampled with exactly version ``v`` of the adapter: the rule of
:mod:`mlora_lab.job.drivers.rl.drawing` (a generation is sampled with the adapter of the step it was due at)
holds whatever the timing, and a job with rollout ranks draws what the same job without draws (one rollout
rank: the same batches, so the same tokens; several: each gets whole generations, round robin).

**In memory.** Adapters go over the job's process group (``send_object_list`` on two groups of the two ranks,
one per direction: :class:`~mlora_lab.parallel.Roles`), never through a file. An update carries the SHA-256 of
its tensors' bytes; a rollout rank that finds another (a corrupt transfer), or tensors that do not fit the
tenant's slot, keeps the adapter it had and answers :class:`AdapterRefused`: that tenant alone is quarantined.

**Threads on rank 0.** One sender and one receiver per rollout rank (blocking sends and receives, each on its
own group), and queues between them and the training loop: the loop never waits on a rollout rank except for
a generation it needs now.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mlora_lab.job.agree import describe
from mlora_lab.sampling import Completion, SampleRequest, sample

if TYPE_CHECKING:
    from mlora_lab.parallel import DistInfo, Roles
    from mlora_lab.spec.job import JobSpec

Tensors = dict[str, tuple[torch.Tensor, torch.Tensor]]


# -- the messages (rank 0 → a rollout rank) ---------------------------------------------------------
@dataclass
class AdapterUpdate:
    """Version ``version`` (the tenant's optimiser steps) of ``tenant``'s adapter, whole: ``tensors`` in
    :meth:`~mlora_lab.lora.model.MultiLoRAModel.tenant_tensors`' layout, ``config`` the arguments of
    ``add_tenant`` (rank, alpha, targets), ``digest`` :func:`tensors_digest` of the tensors as sent."""

    tenant: str
    version: int
    config: dict[str, Any]
    tensors: Tensors
    digest: str


@dataclass
class DropAdapter:
    """``tenant`` stopped (finished, failed, paused, removed): its slot is freed."""

    tenant: str


@dataclass
class SampleWork:
    """Sample ``requests`` in one batch (each with its tenant's adapter as last updated) and answer ``ticket``."""

    ticket: int
    requests: list[SampleRequest]


@dataclass
class Stop:
    """The job is over: answer :class:`Bye` and leave the loop."""


# -- the answers (a rollout rank → rank 0) ----------------------------------------------------------
@dataclass
class Samples:
    """``ticket``'s completions (:class:`~mlora_lab.sampling.Completion`, as ``sample`` gives them: tokens, the
    model's and the sampler's log-probs, stop reason, and what the requests asked besides); or ``error``, why
    its sampling failed. ``busy_s``: the seconds it took."""

    ticket: int
    completions: list[Completion] = field(default_factory=list)
    error: str | None = None
    busy_s: float = 0.0


@dataclass
class AdapterRefused:
    """An :class:`AdapterUpdate` that was not applied (the rollout rank kept the adapter it had)."""

    tenant: str
    version: int
    why: str


@dataclass
class Bye:
    """The rollout rank left its loop; ``busy_s``: its seconds of sampling in all."""

    index: int
    busy_s: float


def tensors_digest(tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    """SHA-256 over an adapter's tensors (sorted module names, then each tensor's dtype, shape and bytes)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        for t in tensors[name]:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def adapter_config(tenant: Any) -> dict[str, Any]:
    """What a rollout rank needs to give ``tenant`` (a :class:`~mlora_lab.spec.tenant.Tenant`) a slot."""
    return {
        "rank": tenant.rank,
        "alpha": tenant.alpha,
        "target_modules": tenant.target_modules,
        "target_parameters": list(tenant.target_parameters),
        "use_rslora": tenant.use_rslora,
    }


# -- rank 0's side -------------------------------------------------------------------------------------
class RolloutLink:
    """Rank 0's link to the rollout ranks: :meth:`send` queues a message for one of them (a sender thread per
    rank sends in order), :meth:`replies` gives what they answered (a receiver thread per rank)."""

    def __init__(self, roles: Roles) -> None:
        self.roles = roles
        self.k = roles.rollout_ranks
        self.outboxes: list[queue.Queue] = [queue.Queue() for _ in range(self.k)]
        self.inbox: queue.Queue = queue.Queue()
        self.busy_s = [0.0] * self.k  # each rollout rank's sampling seconds so far (from its answers)
        self.failed: str | None = None  # a link that broke: why (every tenant on it then fails)
        # called on the receiving thread with each answer first: True when it took it (not queued for replies())
        self.on_reply: Callable[[object], bool] | None = None
        self._threads = []
        for j in range(self.k):
            for target, name in ((self._send_loop, "send"), (self._receive_loop, "receive")):
                thread = threading.Thread(
                    target=target, args=(j,), name=f"mlora-rollout-{name}-{j}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def send(self, j: int, message: object) -> None:
        self.outboxes[j].put(message)

    def send_all(self, message: object) -> None:
        for j in range(self.k):
            self.send(j, message)

    def _send_loop(self, j: int) -> None:
        dst = self.roles.rollout_rank(j)
        while True:
            message = self.outboxes[j].get()
            try:
                dist.send_object_list([message], dst=dst, group=self.roles.down[j])
            except Exception as e:  # (the rollout rank died: every reply that was owed is lost)
                self.failed = f"rollout rank {j} (rank {dst}) could not be reached: {describe(e)}"
                self.inbox.put((j, None))
                return
            if isinstance(message, Stop):
                return

    def _receive_loop(self, j: int) -> None:
        src = self.roles.rollout_rank(j)
        while True:
            box: list[object] = [None]
            try:
                dist.recv_object_list(box, src=src, group=self.roles.up[j])
            except Exception as e:
                self.failed = f"rollout rank {j} (rank {src}) stopped answering: {describe(e)}"
                self.inbox.put((j, None))
                return
            reply = box[0]
            if isinstance(reply, Samples):
                self.busy_s[j] += reply.busy_s
            if self.on_reply is not None and self.on_reply(reply):
                continue
            self.inbox.put((j, reply))
            if isinstance(reply, Bye):
                return

    def replies(self, timeout: float | None = 0.0) -> list[tuple[int, object]]:
        """What the rollout ranks answered since the last call: waits up to ``timeout`` seconds for the first
        (``None``: until one comes), then takes every answer already there."""
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 60.0) -> None:
        """Tell every rollout rank to stop and wait for its goodbye (or ``timeout_s``)."""
        self.send_all(Stop())
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))


# -- a rollout rank's side ------------------------------------------------------------------------------
class RolloutServer:
    """A rollout rank: the base and the RL tenants' adapters, sampling what rank 0 sends (see the module
    docstring)."""

    def __init__(self, spec: JobSpec, info: DistInfo, roles: Roles) -> None:
        from mlora_lab.job.engine import Engine  # (the model: as a single process builds it)
        from mlora_lab.parallel import Collectives, ParallelDims

        self.roles, self.index = roles, roles.rollout_index
        assert self.index is not None
        dims = ParallelDims(1)
        self.engine = Engine.build(spec, dims, None, Collectives(dims, None, info.device))
        self.engine.model.eval()
        self.versions: dict[str, int] = {}
        self.busy_s = 0.0
        self.works = 0  # works sampled

    def _reply(self, message: object) -> None:
        dist.send_object_list([message], dst=0, group=self.roles.up[self.index])

    def serve(self) -> None:
        """Handle rank 0's messages in order until :class:`Stop`."""
        down = self.roles.down[self.index]
        while True:
            box: list[object] = [None]
            dist.recv_object_list(box, src=0, group=down)
            message = box[0]
            if isinstance(message, Stop):
                self._reply(Bye(self.index, self.busy_s))
                return
            if isinstance(message, AdapterUpdate):
                why = self.update(message)
                if why is not None:
                    self._reply(AdapterRefused(message.tenant, message.version, why))
            elif isinstance(message, DropAdapter):
                if message.tenant in self.versions:
                    self.engine.model.remove_tenant(message.tenant)
                    del self.versions[message.tenant]
            elif isinstance(message, SampleWork):
                self._reply(self.work(message))

    def update(self, u: AdapterUpdate) -> str | None:
        """Swap ``u.tenant``'s adapter for ``u``'s tensors, whole, or say why not (the old one stays)."""
        if tensors_digest(u.tensors) != u.digest:
            return f"its adapter (version {u.version}) reached rollout rank {self.index} corrupted (digest mismatch)"
        bad = [
            k for k, (a, b) in u.tensors.items() if not (torch.isfinite(a).all() and torch.isfinite(b).all())
        ]
        if bad:
            return f"its adapter (version {u.version}) has non-finite values in {', '.join(sorted(bad)[:3])}"
        model = self.engine.model
        try:
            if u.tenant not in self.versions:
                model.add_tenant(u.tenant, init=u.tensors, **u.config)
            else:  # (every tensor checked against its slot first: a swap is whole or not at all)
                held = model.tenant_tensors(u.tenant)
                if set(held) != set(u.tensors) or any(
                    held[k][i].shape != u.tensors[k][i].shape for k in held for i in (0, 1)
                ):
                    return f"its adapter (version {u.version}) does not fit its slot on rollout rank {self.index}"
                model.set_tenant_tensors(u.tenant, u.tensors)
        except Exception as e:
            return f"its adapter (version {u.version}) could not be loaded on rollout rank {self.index}: {describe(e)}"
        self.versions[u.tenant] = u.version
        return None

    @torch.no_grad()
    def work(self, w: SampleWork) -> Samples:
        start = time.perf_counter()
        missing = sorted(
            {r.tenant for r in w.requests if r.tenant is not None and r.tenant not in self.versions}
        )
        if missing:
            return Samples(
                w.ticket, error=f"rollout rank {self.index} holds no adapter of {', '.join(missing)}"
            )
        try:
            out = sample(self.engine.model, w.requests, tokenizer=self.engine.tokenizer)
        except Exception as e:
            return Samples(w.ticket, error=f"its generation raised {describe(e)}")
        busy = time.perf_counter() - start
        self.busy_s += busy
        self.works += 1
        return Samples(w.ticket, out, busy_s=busy)


def serve_rollouts(spec: JobSpec, info: DistInfo, roles: Roles) -> RolloutServer:
    """A rollout rank's whole life: build the model, sample what rank 0 sends until it says stop."""
    server = RolloutServer(spec, info, roles)
    server.serve()
    return server
