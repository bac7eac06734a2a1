"""The service driver: training clients of the Tinker API drive their tenants request by request.

Third driver of the training loop (after file data and RL, :mod:`mlora_lab.job.driver`). The HTTP thread
(:mod:`mlora_lab.service.app`) only queues :class:`~mlora_lab.service.work.Work`; at each step boundary this
driver takes what may run (:meth:`~mlora_lab.service.work.Inbox.take`: every model's requests in ``seq_id``
order) and turns it into one mixed-tenant step, so the requests of every client that wait at the same moment
share one forward and one backward of the base:

    create_model      a tenant in a free slot: rank r, alpha ``lora_alpha`` (Tinker has none: a job setting),
                      LoRA on the attention (``train_attn``) and MLP (``train_mlp``) projections and on the
                      output layer (``train_unembed``), PEFT's initialisation from the client's seed
    forward_backward  its datums are rows of the step: input ``x [N]`` + one more position, labels
                      ``[-, y_0 … y_{N-1}]`` (``y = target_tokens``), so the loop's per-token loss ``ℓ [N]``
                      gives ``lp_t = −ℓ_t = log p(y_t | x_{≤t})``, the logprobs the client gets back; the
                      request's loss is Tinker's sum over its datums (:mod:`mlora_lab.service.losses`);
                      ``forward`` (forward-only) rows take part in the forward and add nothing to the backward
    optim_step        the tenant's AdamW step after the backward, with the request's ``AdamParams``
                      (torch AdamW: lr, betas, eps, decoupled weight decay; clipping when ``grad_clip_norm``
                      > 0, by torch's rule): gradients of every ``forward_backward`` since the last
                      optim_step are summed, as in Tinker

A step takes the waiting requests once none has come for :data:`GATHER_QUIET_S` (or the first has waited
:data:`GATHER_MAX_S`), so that requests sent together share it; a request that comes while the loop idles
wakes it at once. A model's requests run in ``seq_id`` order: in one step a model takes its waiting
forward/backward requests
up to and including its first optim_step; what follows waits for the next step (it must see the new
weights). Results are settled at the end of their step: an optim_step's after the optimiser step (or its
failure: a quarantined tenant fails its waiting requests), a forward/backward's once the step is over
(:meth:`~mlora_lab.job.driver.Driver.after_step`: its datums' results are gathered from every process).
With ``max_step_tokens``, a step takes forward/backward requests until their datums hold that many input
tokens (at least one request); the rest wait for the next steps, and the models take turns to go first.

    save_weights_for_sampler   a **snapshot**: the tenant's adapter as it is now, copied into a slot of its
                      own (no optimiser; later steps of the tenant do not change it), at its place in
                      the model's ``seq_id`` order; named (``tinker://<model>/sampler_weights/<name>``) or
                      not (a sampling session of the SDK's ``save_weights_and_get_sampling_client``)
    asample           the samples of every client waiting at a step boundary, in ONE batched generation
                      (:func:`mlora_lab.sampling.sample`: each row with its snapshot's adapter, or the
                      base alone; a KV cache; seeds; stop strings and token ids; per-token logprobs always,
                      the prompt's when asked)

    save_weights      ``save_state``: ``<checkpoints>/weights/<model>/<name>/`` in the checkpoint format (JSON
                      + safetensors, never a pickle; complete or absent), holding the adapter, the AdamW
                      state and the client's LoRA settings, and ``adapter/`` beside them, a PEFT adapter
                      directory; answered ``tinker://<model>/weights/<name>``
    load_weights      into the model (``load_state``: the weights, a fresh AdamW; ``..._with_optimizer``:
                      its state too), or a new model from it (``create_training_client_from_state``:
                      the load is that model's first request)

A client that goes away (its session finished, or no heartbeat nor request for ``session_timeout_s``; the
SDK heartbeats every 10 s) has its tenants saved (``adapters/<tenant>``) and paused, not lost; a paused
tenant whose session shows life again (a request naming its model) goes on where it stopped.

**On several processes** (fsdp, tp, ep under torchrun), rank 0 alone serves HTTP and holds the inbox, the
futures and the keys; the other processes build this driver with no service state and follow rank 0, so
that every process runs the same plan in the same order (every forward is a collective):

    orders      at each step boundary rank 0 takes the inbox (a sample without a seed gets one drawn
                here) and decides which clients went away or came back; one broadcast hands these orders
                to every process, which all apply them: creates (``agree``), pauses (the adapter saved:
                a gather), snapshots (their tensors gathered everywhere), states (see below), samples
    rows        a tenant's datums of the step (its requests' in ``seq_id`` order, then datum order) are
                split over the data-parallel ranks as the file-data rows are: rank ``d`` of ``D`` takes
                datums ``d, d + D, …`` (the TP ranks of one data-parallel rank the same ones); a process
                may have none of a tenant's datums. Its loss there is the sum of its datums' Tinker losses,
                so the gradients summed over the data-parallel ranks are the request's
    answers     each process keeps its datums' logprobs, loss and metrics; after the step one gather brings
                them to rank 0, which puts the logprobs in datum order and sums ``loss:sum`` and the other
                metrics over the datums, in datum order (what one process computes)
    files       a saved state's or snapshot's tensors are gathered on every process (``TensorIO``) and
                written by rank 0 alone; rank 0 reads a state and broadcasts it (or why it cannot be
                read), and says whether a save may go ahead (its folder exists already or not), so a
                request fails alike on every process
    samples     every process runs every sample request (same seeds: the same tokens), its decode steps
                kept in step with the others (``any_running``), as the RL driver generates

Only rank 0 settles futures.

Snapshots and slots. A sampler snapshot keeps the adapter's tensors (in memory, on every process; a named
one is also a PEFT folder) and is loaded into a free slot when it is sampled from. Snapshots and training
clients share ``max_tenants``: a training client being created, or a batch sampling from snapshots that are
not loaded, unloads the snapshots sampled least recently. A model keeps its :data:`SESSION_SNAPSHOTS` most
recent unnamed snapshots (``save_weights_and_get_sampling_client``, once per step of an RL loop); its
``kind="inflight"`` saves share one target, which each such save moves on for every inflight session.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example
from mlora_lab.job.agree import agree
from mlora_lab.job.driver import Driver, JobParts, Plan, StepResult
from mlora_lab.job.tenants import TenantRun
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.lora.targets import output_layer_names
from mlora_lab.rundir import TenantState, TrainRow, checkpoint
from mlora_lab.rundir.checkpoint import CheckpointError, read_checkpoint, write_state_dir
from mlora_lab.rundir.service import saved_folder
from mlora_lab.sampling import SampleRequest, default_stop_ids, sample
from mlora_lab.service import losses, wire
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.work import ErrorCategory, Kind, Result, Work
from mlora_lab.spec import Tenant
from mlora_lab.specbase import MAX_COUNT
from mlora_lab.specparts import ClientModel

GONE = "its client sent no heartbeat nor request"
"""The start of the reason a tenant of a client that went away is paused with."""

STATE_FORMAT = "mlora_lab.service.state/1"
"""What a saved Tinker state says it is (a checkpoint-format directory of another kind is refused)."""

ATTENTION = (".self_attn.", ".attention.", ".attn.", ".self_attention.")
"""A module path holding one of these is an attention projection (``train_attn``); other linear layers of
the blocks are the MLP's (``train_mlp``, experts included)."""


def tinker_targets(
    model: MultiLoRAModel, train_attn: bool, train_mlp: bool, train_unembed: bool
) -> list[str]:
    """The full names of the slotted layers of ``model`` a Tinker ``LoraConfig`` selects; ``ValueError``
    when it asks for a part that has no adapter slot in this job (the job's ``slot_modules``)."""
    heads = set(output_layer_names(model.model))
    chosen, missing = [], []
    for part, wanted in (("attention", train_attn), ("MLP", train_mlp), ("output layer", train_unembed)):
        names = [n for n in model.layers if _part(n, heads) == part]
        if wanted and not names:
            missing.append(part)
        chosen += names if wanted else []
    if missing:
        raise ValueError(
            f"this job has no adapter slots on the {' or '.join(missing)} (its slot_modules); "
            f"create the client with train_{'unembed' if missing == ['output layer'] else 'attn/mlp'}=False, "
            "or serve a job whose slot_modules cover it"
        )
    return chosen


def _part(name: str, heads: set[str]) -> str:
    if name in heads:
        return "output layer"
    return "attention" if any(a in f".{name}." for a in ATTENTION) else "MLP"


@dataclass
class ServiceFeed:
    """A service tenant's per-tenant state: its model id, the current window's counters, and (checkpointed)
    the ``seq_id`` its client's next request to run has, so that a resumed job takes the client's requests
    on from there."""

    model_id: str
    window_tokens: int = 0
    window_requests: int = 0
    next_seq_id: Callable[[], int | None] = lambda: None
    """The seq_id of the model's first request not run yet (rank 0 knows it; None elsewhere)."""
    restored_seq_id: int | None = None
    """What a checkpoint said :attr:`next_seq_id` was (a resumed job starts the model's inbox there)."""

    def state_dict(self) -> dict[str, Any]:
        return {"service_model_id": self.model_id, "service_next_seq_id": self.next_seq_id()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model_id = state["service_model_id"]
        self.restored_seq_id = state.get("service_next_seq_id")

    def reset(self) -> None:
        self.window_tokens = self.window_requests = 0


@dataclass
class _Pending:
    """What a tenant runs in this step: its forward/backward requests (with their datums' lengths), the
    optim_step that ends it, if any, and which of their datums are this process's rows."""

    forwards: list[tuple[Work, list[int]]] = field(default_factory=list)
    optim: Work | None = None
    local: list[tuple[int, int]] = field(default_factory=list)  # (request, datum) of each row here, in order


GATHER_QUIET_S = 0.02
"""A step takes the waiting requests once none has come for this long. Requests sent together (a client's
optim_step right behind its forward_backward, several clients' at the same moment) reach the job a few to
some tens of milliseconds apart; taken at the first, each would make a step of its own (measured on a
small model: two clients in lock-step shared none of their steps)."""

GATHER_MAX_S = 0.1
"""... or once the first of them has waited this long (a steady stream of requests holds no step back)."""

SESSION_SNAPSHOTS = 8
"""Unnamed sampler snapshots kept per model (the most recent saves; named ones are all kept)."""


@dataclass(eq=False)
class _Snapshot:
    """A sampler snapshot: the adapter's full tensors when it was saved (on every process) and its LoRA
    shape, and the slot it is loaded in now (None: unloaded to make room; loaded again when sampled)."""

    model_id: str
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    alpha: float
    modules: tuple[str, ...]
    use_rslora: bool
    named: bool
    slot: str | None = None
    used: int = 0


@dataclass
class _Orders:
    """What rank 0 decided at a step boundary, the same on every process once broadcast."""

    pauses: dict[str, str]  # tenant -> why: its client went away
    resumes: list[str]  # tenants whose client is back
    works: list[Work]  # the requests taken from the inbox, in its order


class ServiceDriver(Driver):
    """Tenants of Tinker training clients (see the module docstring). ``state`` is the service's shared
    state (:class:`~mlora_lab.service.app.ServiceState`): its inbox, futures and model registry, on rank 0;
    ``None`` on every other process (it follows rank 0's orders)."""

    def __init__(
        self,
        parts: JobParts,
        state: Any,
        lora_alpha: float = 32.0,
        checkpoints: str | Path | None = None,
        session_timeout_s: float = 60.0,
        max_step_tokens: int | None = None,
    ) -> None:
        super().__init__(parts)
        self.max_step_tokens = max_step_tokens
        self._first = 0  # which model goes first in the next step (they take turns)
        self.main = parts.pool.is_main
        if self.main != (state is not None):
            raise ValueError("the service's state belongs to rank 0, and only to it")
        if state is not None:
            state.inbox.arrived = parts.wake  # a request wakes the idle loop at once
        self.session_timeout_s = float(session_timeout_s)
        self._watched = 0.0
        self.state, self.lora_alpha = state, float(lora_alpha)
        self.checkpoints = None if checkpoints is None else Path(checkpoints)  # (rank 0 alone writes there)
        self.comm = parts.engine.comm
        self.names: dict[str, str] = {}  # model id -> tenant name
        self.queues: dict[str, deque[Work]] = {}  # model id -> its requests taken, not run yet
        self.step_work: dict[str, _Pending] = {}  # tenant -> what it runs in the current step
        self.waiting_optim: dict[str, Work] = {}  # tenant -> its optim_step, until the step settles it
        # tinker:// path or sampling session id -> its snapshot (a model's inflight sessions share one)
        self.snapshots: dict[str, _Snapshot] = {}
        self._uses = (
            itertools.count()
        )  # (when a snapshot was last sampled from: the least recent leaves first)
        self._snapshot_ids = itertools.count()
        self._restored: list[str] = []  # clients' tenants a resume brought back, to register on rank 0
        # request id -> datum -> (logprobs, loss, metrics) of this process's datums of the current step
        self.scored: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]] = {}

    def accepts(self, tenant: Tenant) -> bool:
        return tenant.client is not None or tenant.name in self.names.values()

    def feed(self, tenant: Tenant) -> ServiceFeed:
        """The feed of a tenant :meth:`_create` is making, or of a client's tenant a resumed job brings back
        from ``job.json`` (registered again under its model id; :meth:`_restore_models` opens its inbox once
        the checkpoint said where its client's requests go on)."""
        if tenant.name not in self.names.values():
            assert tenant.client is not None
            self.names[tenant.client.model_id] = tenant.name
            self.queues[tenant.client.model_id] = deque()
            self._restored.append(tenant.name)
        model_id = next(m for m, n in self.names.items() if n == tenant.name)
        return ServiceFeed(model_id, next_seq_id=lambda: self._next_seq_id(model_id))

    def _next_seq_id(self, model_id: str) -> int | None:
        """Rank 0: the seq_id of the model's first request not run yet (taken but waiting, or the inbox's)."""
        if not self.main:
            return None
        queue = self.queues.get(model_id)
        waiting = [w.seq_id for w in queue or () if w.seq_id is not None]
        return min(waiting) if waiting else self.state.inbox.next_seq_id(model_id)

    def _restore_models(self) -> None:
        """Rank 0, the first step of a resumed job: the clients' models its checkpoint brought back are
        registered again (their ids and owners: the keys that made them reach them and their saved states),
        their inboxes open at the seq_id their clients go on from, and each client's session is watched
        again: a client that does not come back within the session timeout has its tenant saved and paused
        (one paused already waits for a request of its client)."""
        restored, self._restored = self._restored, []
        if not self.main:
            return
        for name in restored:
            t = self.pool.tenants.get(name)
            if t is None or t.spec.client is None:
                continue
            c = t.spec.client
            info = ModelInfo(c.model_id, c.owner, self.state.base_model, t.spec.rank, c.seed, c.train_attn,
                             c.train_mlp, c.train_unembed)  # fmt: skip
            waiting = t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE)
            self.state.restore_model(info, t.feed.restored_seq_id or 1, alive=not waiting)

    def waiting(self) -> bool:
        return True  # clients may send requests at any time

    # -- a step's plan ---------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        if self._restored:
            self._restore_models()
        self._settle_failed()
        # (every process runs what rank 0 took, in its order: every forward is a collective)
        orders: _Orders = self.comm.broadcast_object(self._orders() if self.main else None)  # type: ignore[assignment]
        self._apply_sessions(orders)
        samples: list[Work] = []
        for work in orders.works:
            if work.kind is Kind.CREATE_MODEL:
                self._create(work)
            elif work.kind is Kind.SAMPLE:
                samples.append(work)
            elif work.kind is Kind.LOAD_WEIGHTS and work.body.create:
                self._create_from_state(work)
            elif work.model_id in self.queues:
                self.queues[work.model_id].append(work)
            else:
                self._fail(work, f"no model {work.model_id!r} on this server")
        self.step_work = {}
        models = list(self.queues)
        if self.max_step_tokens is not None and models:  # the models take turns to go first
            self._first = (self._first + 1) % len(models)
            models = models[self._first :] + models[: self._first]
        tokens = 0  # input tokens of the step's datums so far
        for model_id in models:
            queue = self.queues[model_id]
            name = self.names[model_id]
            t = self.pool.tenants.get(name)
            if t is None or t.state is not TenantState.RUNNING:
                continue
            pending = _Pending()
            while queue:
                work = queue[0]
                if work.kind is Kind.FORWARD_BACKWARD:
                    fb: wire.ForwardBackward = work.body
                    lengths = [len(d.tokens) for d in fb.data]
                    if self._full(tokens, sum(lengths)):  # it and the model's later requests: next step
                        break
                    queue.popleft()
                    try:  # (a request that cannot be computed fails alone, before the step)
                        losses.validate(fb.loss_fn, fb.config, [d.inputs for d in fb.data], lengths,
                                        vocab_size=self.engine.vocab_rows)  # fmt: skip
                    except losses.LossInputError as e:
                        self._fail(work, str(e))
                        continue
                    pending.forwards.append((work, lengths))
                    tokens += sum(lengths)
                elif work.kind in (Kind.SAVE_FOR_SAMPLER, Kind.SAVE_WEIGHTS, Kind.LOAD_WEIGHTS):
                    if pending.forwards:  # it must come after them (and their step): next step
                        break
                    {Kind.SAVE_FOR_SAMPLER: self._snapshot, Kind.SAVE_WEIGHTS: self._save_state,
                     Kind.LOAD_WEIGHTS: self._load_state}[work.kind](queue.popleft(), t)  # fmt: skip
                else:  # an optim_step (the only other kind queued): it ends the tenant's part of this step
                    pending.optim = queue.popleft()
                    break
            if pending.forwards or pending.optim is not None:
                self.step_work[name] = pending
        if samples:
            self._sample(samples)
        if not self.step_work:
            return None
        tenants = [self.pool[n] for n in self.step_work]
        rows: dict[str, list[Example]] = {}
        complete = []
        for t in tenants:
            pending = self.step_work[t.name]
            datums = [
                (k, i) for k, (work, _) in enumerate(pending.forwards) for i in range(len(work.body.data))
            ]
            pending.local = self.engine.local_rows(datums)  # (this data-parallel rank's share, as FileData's)
            rows[t.name] = [_row(pending.forwards[k][0].body.data[i]) for k, i in pending.local]
            for work, lengths in pending.forwards:
                if not work.body.forward_only:
                    t.feed.window_tokens += sum(lengths)
                    t.feed.window_requests += 1
            if pending.optim is not None:
                self._set_adam(t, pending.optim.body)
                self.waiting_optim[t.name] = pending.optim
                complete.append(t.name)
        return Plan(tenants=tenants, rows=rows, complete=complete)

    def _orders(self) -> _Orders:
        """Rank 0: the sessions' changes and the waiting requests. A sample with no seed gets one here, from
        torch's generator, so that every process draws the same tokens."""
        pauses, resumes = self._watch_sessions()
        works = []
        while (wait := self.state.inbox.gather_wait(GATHER_QUIET_S, GATHER_MAX_S)) > 0:
            time.sleep(wait)
        for work in self.state.inbox.take():
            s = work.body
            if work.kind is Kind.SAMPLE and s.seed is None and s.temperature > 0:
                seed = int(torch.randint(0, 2**63 - 1, ()))
                work = dataclasses.replace(work, body=dataclasses.replace(s, seed=seed))
            works.append(work)
        return _Orders(pauses, resumes, works)

    def _full(self, tokens: int, more: int) -> bool:
        """Whether a step holding ``tokens`` input tokens has no room for ``more`` (``max_step_tokens``; a
        step always takes its first request)."""
        return self.max_step_tokens is not None and tokens > 0 and tokens + more > self.max_step_tokens

    def _create(self, work: Work, info: Any = None) -> TenantRun | None:
        """A tenant for the model ``info`` describes (``work.body`` by default); None (the request failed,
        saying why) if it cannot be made."""
        info = info or work.body
        model_id = info.model_id
        if model_id in self.names:
            self._fail(work, f"model {model_id!r} exists already")
            return None
        name = model_id.replace(":", "-")
        try:
            targets = tinker_targets(self.engine.model, info.train_attn, info.train_mlp, info.train_unembed)
        except ValueError as e:
            self._fail(work, str(e))
            return None
        client = ClientModel(
            model_id, info.owner, info.seed, info.train_attn, info.train_mlp, info.train_unembed
        )
        tenant = Tenant(name=name, data="", rank=info.rank, alpha=self.lora_alpha, target_modules=targets,
                        lr=1e-4, weight_decay=0.0, max_grad_norm=None, batch_size=1, max_steps=MAX_COUNT,
                        seed=0 if info.seed is None else int(info.seed), dropout=0.0, client=client)  # fmt: skip
        self.names[model_id] = name
        self._free_slots(
            1
        )  # (a loaded snapshot gives its slot to a training client; it loads again when sampled)
        refusal = agree(self.comm, lambda: self.pool.prepare_add(tenant, self.feed))
        if refusal is not None:
            del self.names[model_id]
            self._fail(work, f"cannot create the model: {refusal.error}")
            return None
        self.queues[model_id] = deque()
        if self.main:
            with self.state.lock:  # (the HTTP thread reads the registry under it)
                self.state.models[model_id] = info
            self.state.inbox.start_model(model_id)
        if work.kind is Kind.CREATE_MODEL:
            self._settle(work, Result(json={"model_id": model_id, "type": "create_model"}))
        return self.pool[name]

    def _watch_sessions(self) -> tuple[dict[str, str], list[str]]:
        """Rank 0: the tenants of clients that went away (to pause, with why) and those whose client is back
        (to resume). Looked at once a second."""
        now = time.time()
        pauses: dict[str, str] = {}
        resumes: list[str] = []
        if now - self._watched < 1.0:
            return pauses, resumes
        self._watched = now
        with self.state.lock:
            sessions = [(s.finished, s.last_seen, list(s.model_ids)) for s in self.state.sessions.values()]
        for finished, seen, models in sessions:
            gone = finished or now - seen > self.session_timeout_s
            for model_id in models:
                t = self.pool.tenants.get(self.names.get(model_id, ""))
                if t is None:
                    continue
                if gone and t.state is TenantState.RUNNING:
                    pauses[t.name] = "its client finished its session" if finished else GONE
                elif not gone and t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE):
                    resumes.append(t.name)
        return pauses, resumes

    def _apply_sessions(self, orders: _Orders) -> None:
        """Pause (after saving: a collective) the tenants of clients that went away; resume those whose
        client is back."""
        for name, why in orders.pauses.items():
            self.pool.save_adapter_logged(name)
            self.pool.set_state(self.pool[name], TenantState.PAUSED, f"{why} (adapter saved)")
        for name in orders.resumes:
            self.pool.set_state(self.pool[name], TenantState.RUNNING)

    # -- training state ----------------------------------------------------------------------------
    def _folder(self, path: str) -> Path | None:
        """Where the checkpoint ``path`` (``tinker://…``) lives (None: this server saves nothing)."""
        return None if self.checkpoints is None else saved_folder(self.checkpoints, path)

    def _save_state(self, work: Work, t: TenantRun) -> None:
        save = work.body
        path = f"tinker://{work.model_id}/weights/{save.name}"
        folder = self._folder(path)
        refusal = None
        if folder is None:
            refusal = "this server keeps no saved states (it runs without a run directory)"
        elif self.main and folder.exists() and not save.overwrite:
            refusal = f"{path} exists already (save with overwrite=True to replace it)"
        if folder is not None:  # (rank 0 sees the folder: every process refuses with it, or gathers with it)
            refusal = self.comm.broadcast_object(refusal)
        if refusal is not None:
            self._fail(work, str(refusal))
            return
        io = self.engine.model.io
        adapter = self.engine.model.tenant_tensors(t.name)  # (gathers: collectives)
        optimizer = t.optimizer.state_dict(gather=io.gather)
        if not self.main:
            return
        info = self.state.models[work.model_id]
        lora = {k: getattr(info, k) for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed")}
        tree = {
            "format": STATE_FORMAT,
            "model_id": work.model_id,
            "lora": {**lora, "alpha": self.lora_alpha},
            "adapter": adapter,
            "optimizer": optimizer,
            "step": t.step,
        }

        def peft_folder(tmp: Path) -> None:
            self.engine.model.save_adapter(t.name, tmp / "adapter", self.engine.base_path, tensors=adapter)

        try:
            write_state_dir(folder, t.step, tree, beside=peft_folder)
        except checkpoint.WRITE_ERRORS as e:
            self._fail(work, f"could not save {path}: {e}", ErrorCategory.SERVER)
            return
        self._settle(work, Result(json={"path": path, "type": "save_weights"}))

    def _read_state(self, work: Work) -> dict[str, Any] | None:
        """The saved state ``work`` names, read by rank 0 and broadcast (or why it cannot be read: then the
        request failed, and None)."""
        state: dict[str, Any] | str | None = None
        if self.main:
            folder = self._folder(work.body.path)
            try:
                if folder is None or not folder.exists():
                    raise CheckpointError(f"no saved state {work.body.path} on this server")
                state = read_checkpoint(folder)
                if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
                    raise CheckpointError(f"{work.body.path} is not a saved state of this service")
            except (CheckpointError, ValueError, OSError) as e:  # (rank 0 must reach the broadcast)
                state = str(e)
        state = self.comm.broadcast_object(state)  # type: ignore[assignment]
        if isinstance(state, str):
            self._fail(work, state)
            return None
        return state

    def _load_state(self, work: Work, t: TenantRun) -> None:
        """``load_state``: the saved weights (and, asked, the AdamW state; else a fresh one) into ``t``."""
        state = self._read_state(work)
        if state is None:
            return
        mine = self.engine.model.tenant_tensors(t.name)
        theirs = state["adapter"]
        if set(mine) != set(theirs) or any(mine[k][0].shape != theirs[k][0].shape for k in mine):
            self._fail(work, f"{work.body.path} has another LoRA shape (rank or layers) than this model")
            return
        self._restore(t, state, work.body.optimizer)
        self._settle(work, Result(json={"path": work.body.path, "type": "load_weights"}))

    def _create_from_state(self, work: Work) -> None:
        """``create_training_client_from_state``: a new model with the saved LoRA settings, then the load."""
        state = self._read_state(work)
        if state is None:
            return
        lora = state["lora"]
        info = ModelInfo(work.model_id, work.body.owner, self.spec.base_model, int(lora["rank"]), lora["seed"],
                         bool(lora["train_attn"]), bool(lora["train_mlp"]), bool(lora["train_unembed"]))  # fmt: skip
        t = self._create(work, info)
        if t is None:
            return
        self._restore(t, state, work.body.optimizer)
        answer = {"path": work.body.path, "type": "load_weights", "model_id": work.model_id}
        self._settle(work, Result(json=answer))

    def _restore(self, t: TenantRun, state: dict[str, Any], optimizer: bool) -> None:
        self.engine.model.set_tenant_tensors(t.name, state["adapter"])
        t.optimizer.zero_grad()
        if optimizer:
            t.optimizer.load_state_dict(state["optimizer"], scatter=self.engine.model.io.scatter)
        else:
            t.optimizer.optimizer.state.clear()  # AdamW starts again: no moments, step 0

    # -- sampling ----------------------------------------------------------------------------------
    def _snapshot(self, work: Work, t: TenantRun) -> None:
        """Keep ``t``'s adapter, as it is now, under the request's name: a frozen snapshot (named, or the
        sampling session of ``save_weights_and_get_sampling_client``), or the model's inflight target, which
        this save updates for every inflight session of the model."""
        save = work.body
        key = save.sampling_session_id or f"tinker://{work.model_id}/sampler_weights/{save.name}"
        if key in self.snapshots and not save.overwrite:
            self._fail(work, f"{key} exists already (save with overwrite=True to replace it)")
            return
        model = self.engine.model
        adapter = model.tenants[t.name]
        tensors = model.tenant_tensors(t.name)  # (full tensors, on every process)
        target = self.snapshots.get(f"inflight {work.model_id}") if save.inflight else self.snapshots.get(key)
        if target is not None:  # overwritten, or the inflight target moves on: in place, in its slot too
            target.tensors = tensors
            if target.slot is not None:
                model.set_tenant_tensors(target.slot, tensors)
        else:
            target = _Snapshot(work.model_id, tensors, adapter.rank, adapter.alpha, tuple(adapter.modules),
                               adapter.use_rslora, named=save.name is not None)  # fmt: skip
        if save.inflight:
            self.snapshots[f"inflight {work.model_id}"] = target
        self.snapshots[key] = target
        self._forget_old_sessions(work.model_id)
        folder = self._folder(key) if save.name else None
        if folder is not None:  # a named snapshot is also a PEFT adapter directory (svc.local_path)
            try:  # (the tenant's adapter, which the snapshot is a copy of now: gathered, written by rank 0)
                self.engine.save_adapter(t.name, folder if self.main else None)
            except checkpoint.WRITE_ERRORS as e:
                self._fail(work, f"could not save {key}: {e}", ErrorCategory.SERVER)
                return
        if save.sampling_session_id:
            answer = {"sampling_session_id": save.sampling_session_id, "type": "save_weights_for_sampler"}
        else:
            answer = {"path": key, "type": "save_weights_for_sampler"}
        self._settle(work, Result(json=answer))

    def _forget_old_sessions(self, model_id: str) -> None:
        """A model keeps the snapshots of its :data:`SESSION_SNAPSHOTS` most recent unnamed sampler saves (an
        RL loop saves one per step): older ones are dropped, and sampling from them fails saying so."""
        keys = [k for k, snap in self.snapshots.items()
                if snap.model_id == model_id and not snap.named and not k.startswith("inflight ")]  # fmt: skip
        for k in keys[:-SESSION_SNAPSHOTS]:
            snap = self.snapshots.pop(k)
            if snap.slot is not None and all(other is not snap for other in self.snapshots.values()):
                self.engine.model.remove_tenant(snap.slot)
                snap.slot = None

    def _free_slots(self, wanted: int, keep: set[int] = frozenset()) -> int:
        """Unload least recently sampled snapshots (not those in ``keep``, by id) until ``wanted`` slots are
        free or none is left to unload; the free slots."""
        model = self.engine.model
        loaded = sorted({id(s): s for s in self.snapshots.values() if s.slot is not None and id(s) not in keep}
                        .values(), key=lambda s: s.used)  # fmt: skip
        while self.spec.max_tenants - len(model.tenants) < wanted and loaded:
            snap = loaded.pop(0)
            model.remove_tenant(snap.slot)
            snap.slot = None
        return self.spec.max_tenants - len(model.tenants)

    def _load_snapshots(self, snaps: list[_Snapshot]) -> set[int]:
        """Put ``snaps`` in slots (evicting others, least recently sampled first); the ids of those that
        could not get one (every slot holds a training client or a snapshot this batch samples)."""
        need = {id(s): s for s in snaps}
        missing = [s for s in need.values() if s.slot is None]
        free = self._free_slots(len(missing), keep=set(need))
        failed = set()
        for snap in missing:
            if free <= 0:
                failed.add(id(snap))
                continue
            snap.slot = f"snapshot.{next(self._snapshot_ids)}"
            self.engine.model.add_tenant(snap.slot, rank=snap.rank, alpha=snap.alpha, target_modules=list(snap.modules),
                                         use_rslora=snap.use_rslora, init=snap.tensors)  # fmt: skip
            free -= 1
        for snap in need.values():
            snap.used = next(self._uses)
        return failed

    def _sample(self, works: list[Work]) -> None:
        """Every waiting sample request in one batched generation (on every process: its forwards are
        collectives); each future gets its sequences. The snapshots sampled from are loaded into free slots
        first (a snapshot not sampled from lately may have been unloaded to make room)."""
        requests, taken = [], []
        eos = default_stop_ids(self.engine.model, self.engine.tokenizer)
        sources: list[_Snapshot | None] = []
        for work in works:
            s = work.body
            # a snapshot's sampling session (its work names the model), a saved snapshot, or the base model
            source = s.sampling_session_id if work.model_id is not None else s.model_path
            if source is not None and source not in self.snapshots:
                self._fail(work, f"no sampler snapshot {source!r} on this server (an unnamed one is kept for "
                                 f"the {SESSION_SNAPSHOTS} most recent saves of its model)")  # fmt: skip
                continue
            sources.append(None if source is None else self.snapshots[source])
            taken.append(work)
        failed = self._load_snapshots([s for s in sources if s is not None])
        kept = []
        for work, snap in zip(taken, sources):
            if snap is not None and id(snap) in failed:
                self._fail(work, f"no free slot to sample from its snapshot: the job's max_tenants="
                                 f"{self.spec.max_tenants} slots hold training clients and the snapshots sampled "
                                 "with it; try again, or serve with a larger max_tenants")  # fmt: skip
                continue
            s = work.body
            ids = list(s.stop_token_ids)
            # ``stop`` absent: the model's end-of-sequence; ``stop: []``: nothing stops a sample but its
            # length; stop strings or ids: those and the end-of-sequence
            stops = ids + eos if (s.stop_at_eos or s.stop_strings or ids) else []
            requests.append(
                SampleRequest(
                    prompt=s.prompt,
                    tenant=None if snap is None else snap.slot,
                    num_samples=s.num_samples,
                    max_new_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=None if s.top_k < 1 else s.top_k,
                    stop_token_ids=tuple(dict.fromkeys(stops)),
                    stop_strings=tuple(s.stop_strings),
                    seed=s.seed,
                    prompt_logprobs=s.prompt_logprobs,
                )
            )
            kept.append(work)
        taken = kept
        if not requests:
            return
        any_running = self._any_running if self.comm.mesh is not None else None
        try:
            done = sample(
                self.engine.model, requests, tokenizer=self.engine.tokenizer, any_running=any_running
            )
        except ValueError as e:  # (checked by the HTTP side already; a request it let through fails alone)
            for work in taken:
                self._fail(work, f"sampling failed: {e}")
            return
        for i, work in enumerate(taken):
            mine = [c for c in done if c.request == i]
            sequences = [wire.Sampled(c.tokens, c.logprobs, stopped=c.stop_reason != "length") for c in mine]
            prompt = mine[0].prompt_logprobs if requests[i].prompt_logprobs else None
            self._settle(work, Result(proto=wire.sample_response(sequences, prompt)))

    def _any_running(self, running: bool) -> bool:
        """Whether a sampling row still runs on any process (an all-reduce after every decode step)."""
        return bool(self.comm.sum_over_world(torch.tensor([float(running)]))[0] > 0)

    def _set_adam(self, t: TenantRun, params: Any) -> None:
        """The request's AdamParams on the tenant's AdamW for the coming step (the schedule is constant)."""
        p = _params(params)
        opt = t.optimizer
        opt.set_hyperparameters(lr=p["learning_rate"], weight_decay=p["weight_decay"])
        group = opt.optimizer.param_groups[0]
        group["betas"], group["eps"] = (p["beta1"], p["beta2"]), p["eps"]
        opt.max_grad_norm = p["grad_clip_norm"] if p["grad_clip_norm"] > 0 else None

    # -- the loss ----------------------------------------------------------------------------------
    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each of this process's datums of ``t``: its Tinker loss and logprobs (kept for its request's
        answer, after the step); the tenant's loss here is the sum of the losses of the datums of requests
        that are not forward-only."""
        pending = self.step_work[t.name]
        total = token_loss.sum() * 0.0
        for r, (k, i) in enumerate(pending.local):
            work, lengths = pending.forwards[k]
            fb: wire.ForwardBackward = work.body
            lp = -token_loss[r, : lengths[i]]
            value, metrics = losses.datum_loss(fb.loss_fn, lp, fb.data[i].inputs, fb.config)
            self.scored.setdefault(work.request_id, {})[i] = (lp.detach(), value.detach(), metrics)
            if not fb.forward_only:
                total = total + value
        return total

    # -- after its optimiser step --------------------------------------------------------------------
    def stepped(self, t: TenantRun, result: StepResult) -> None:
        work = self.waiting_optim.pop(t.name, None)
        if work is not None:
            metrics = {"grad_norm:max": result.grad_norm, "learning_rate:max": result.lr}
            self._settle(work, Result(json={"metrics": metrics}))
        f: ServiceFeed = t.feed
        self.recorder.log(TrainRow(step=self.recorder.step, tenant=t.name, tenant_step=t.step, loss=result.loss,
                                   tokens=f.window_tokens, lr=result.lr, grad_norm=result.grad_norm))  # fmt: skip
        f.reset()

    def after_step(self) -> None:
        """Answer the step's forward/backward requests: every process's datums' results, gathered on rank 0
        (one collective), in datum order; ``loss:sum`` and the other metrics summed over the datums in that
        order, as one process sums them. (TP ranks hold the same datums: either copy will do.)"""
        works = [work for p in self.step_work.values() for work, _ in p.forwards]
        scored, self.scored = self.scored, {}
        if not works:  # (the same on every process)
            return
        mine = {
            rid: {i: (lp.float().cpu(), v.cpu(), {k: float(x) for k, x in m.items()}) for i, (lp, v, m) in got.items()}
            for rid, got in scored.items()
        }  # fmt: skip
        everyone = self.comm.gather_objects(mine)
        if not self.main:
            return
        for work in works:
            got: dict[int, tuple] = {}
            for part in everyone:
                got |= part.get(work.request_id, {})  # type: ignore[union-attr]
            fb: wire.ForwardBackward = work.body
            if len(got) != len(fb.data):  # (cannot happen: every datum is some process's row)
                self._fail(
                    work, f"{len(fb.data) - len(got)} datum(s) were not computed", ErrorCategory.SERVER
                )
                continue
            per_datum, loss_sum, metrics = [], torch.zeros(()), {}
            for i in range(len(fb.data)):
                lp, value, m = got[i]
                per_datum.append(lp)
                loss_sum = loss_sum + value
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + v
            metrics["loss:sum"] = float(loss_sum)
            self._settle(work, Result(proto=wire.forward_backward_output(per_datum, metrics)))

    def _settle_failed(self) -> None:
        """Requests of tenants the last step quarantined fail with the tenant's reason."""
        for name, work in list(self.waiting_optim.items()):
            t = self.pool.tenants.get(name)
            if t is None or t.state is TenantState.FAILED:
                del self.waiting_optim[name]
                why = t.reason if t is not None else "it is gone"
                self._fail(work, f"the model's step failed: {why}", ErrorCategory.USER)

    def _settle(self, work: Work, result: Result) -> None:
        """``work``'s answer (rank 0 holds the futures; the other processes ran it with rank 0)."""
        if self.main:
            self.state.futures.settle(work.request_id, result)

    def _fail(self, work: Work, why: str, category: ErrorCategory = ErrorCategory.USER) -> None:
        self._settle(work, Result(error=why, category=category))


def _row(d: wire.Datum) -> Example:
    """A datum as a row of the step: ``x`` and one more position, labels ``[-, y_0, …, y_{N-1}]`` (the
    extra input token is never predicted from; its logits are not used)."""
    targets = d.inputs["target_tokens"].reshape(-1).tolist()
    return Example([*d.tokens, targets[-1]], [IGNORE_INDEX, *targets])


def _params(params: Any) -> Mapping[str, float]:
    keys = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    if isinstance(params, Mapping):
        return {k: float(params[k]) for k in keys}
    return {k: float(getattr(params, k)) for k in keys}
