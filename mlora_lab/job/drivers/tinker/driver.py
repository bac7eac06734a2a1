"""The service driver: training clients of the Tinker API drive their tenants request by request.

Third driver of the training loop (after file data and RL, :mod:`mlora_lab.job.drivers.base`). The HTTP thread
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
(:meth:`~mlora_lab.job.drivers.base.Driver.after_step`: its datums' results are gathered from every process).
With ``max_step_tokens``, a step takes forward/backward requests until their datums hold that many input
tokens (at least one request); the rest wait for the next steps, and the models take turns to go first.
Such a next step starts at once, with what has come meanwhile (it waits for no gather).

    save_weights_for_sampler   a **snapshot** of the tenant's adapter, at its place in the model's ``seq_id``
                      order, and ``asample``: every waiting sample in ONE batched generation
                      (:mod:`mlora_lab.job.drivers.tinker.snapshots`, which also shares the slots between snapshots and
                      training clients)
    save_weights      ``save_state``, and ``load_weights``: into the model, or a new model from the state
                      (:mod:`mlora_lab.job.drivers.tinker.saved_states`)

A client that goes away (its session finished, or no heartbeat nor request for ``session_timeout_s``; the
SDK heartbeats every 10 s) has its tenants saved (``adapters/<tenant>``) and paused, not lost; a paused
tenant whose session shows life again (a request naming its model) goes on where it stopped; a checkpoint is
written only after that is looked at (:mod:`mlora_lab.job.drivers.tinker.sessions`).

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
    files       a saved state's or snapshot's tensors are gathered on every process and written by rank 0
                alone; rank 0 reads a state and broadcasts it (:mod:`mlora_lab.job.drivers.tinker.saved_states`)
    samples     every process runs every sample request, its decode steps kept in step with the others
                (:mod:`mlora_lab.job.drivers.tinker.snapshots`)

Only rank 0 settles futures.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example
from mlora_lab.job.agree import agree
from mlora_lab.job.drivers.base import Driver, JobParts, Plan, StepResult
from mlora_lab.job.drivers.tinker.saved_states import SavedStates, saved_model
from mlora_lab.job.drivers.tinker.sessions import GONE, SessionWatch, apply_changes
from mlora_lab.job.drivers.tinker.snapshots import Snapshots
from mlora_lab.job.metering import Meter
from mlora_lab.job.tenants import TenantRun
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.lora.targets import output_layer_names, storable_targets
from mlora_lab.rundir import TenantState
from mlora_lab.rundir.service import reserved_model_names, served_base_name
from mlora_lab.service import losses, wire
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.work import ErrorCategory, Kind, Result, Work
from mlora_lab.spec.fields import MAX_COUNT
from mlora_lab.spec.job import Tenant
from mlora_lab.spec.parts import ClientModel
from mlora_lab.text import brief

ATTENTION = (".self_attn.", ".attention.", ".attn.", ".self_attention.")
"""A module path holding one of these is an attention projection (``train_attn``); other linear layers of
the blocks are the MLP's (``train_mlp``, experts included)."""


def tinker_targets(
    model: MultiLoRAModel,
    train_attn: bool,
    train_mlp: bool,
    train_unembed: bool,
    slot_modules: list[str] | None = None,
) -> tuple[list[str], list[str]]:
    """What a Tinker ``LoraConfig`` selects in ``model``: the full names of the slotted linear layers, and
    the packed expert parameters (an MoE block's MLP, with ``train_mlp``) as PEFT ``target_parameters``
    suffixes; ``ValueError`` when it asks for a part that has no adapter slot in this job (its
    ``slot_modules``)."""
    heads = set(output_layer_names(model.model))
    chosen, missing = [], []
    slotted = model.expert_parameters
    experts = slotted if train_mlp else []
    parts = (("attention", "train_attn", train_attn), ("MLP", "train_mlp", train_mlp))
    for part, flag, wanted in (*parts, ("output layer", "train_unembed", train_unembed)):
        names = [n for n in model.layers if _part(n, heads) == part]
        if wanted and not names and not (part == "MLP" and experts):
            missing.append((part, flag))
        chosen += names if wanted else []
    if missing:
        flags = " and ".join(f"{flag}=False" for _, flag in missing)
        raise ValueError(
            f"this job has no adapter slots on the {' or '.join(p for p, _ in missing)} (its slot_modules "
            f"{brief(slot_modules)}); create the client with {flags}, or serve a job whose "
            "slot_modules cover them (leave slot_modules unset: a served job then slots every linear "
            "layer and the output layer)"
        )
    # (the shortest suffixes that name them all: what the tenant's adapter_config.json says, as PEFT writes)
    return chosen, storable_targets(experts, slotted) if experts else []


def client_tenant_name(info: ModelInfo, free: Callable[[str], bool]) -> str:
    """The name of the tenant a client's model becomes, the first ``free`` one (the same on every process: it
    depends on ``info`` and the names taken alone): its ``user_metadata["name"]`` made safe (each run of
    other characters becomes ``-``; at most 64 characters), then ``-2``, ``-3``...; without one, its key's
    name and the first count free (``alice-1``, ``alice-2``...): a dashboard says whose it is, never an
    opaque id alone. (A name the OpenAI endpoint gives the base, ``base``, is never free: ``base-2``.)"""
    wanted = re.sub(r"[^A-Za-z0-9._-]+", "-", info.name or "").strip(".-")[:64]
    if wanted:
        if free(wanted):
            return wanted
        return next(f"{wanted}-{k}" for k in itertools.count(2) if free(f"{wanted}-{k}"))
    owner = re.sub(r"[^A-Za-z0-9._-]+", "-", info.owner).strip(".-")[:80] or "client"
    return next(f"{owner}-{k}" for k in itertools.count(1) if free(f"{owner}-{k}"))


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
    window_weight: float | None = 0.0
    """What the window's summed loss is divided by for its mean per token (its requests'
    :func:`~mlora_lab.service.losses.token_weight`, summed); None once a request has no such mean."""
    next_seq_id: Callable[[], int | None] = lambda: None
    """The seq_id of the model's first request not run yet (rank 0 knows it; None elsewhere)."""
    restored_seq_id: int | None = None
    """What a checkpoint said :attr:`next_seq_id` was (a resumed job starts the model's inbox there)."""

    def state_dict(self) -> dict[str, Any]:
        return {"service_model_id": self.model_id, "service_next_seq_id": self.next_seq_id()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model_id = state["service_model_id"]
        self.restored_seq_id = state.get("service_next_seq_id")

    def add(self, fb: wire.ForwardBackward, lengths: list[int]) -> None:
        """A request that trains (not forward-only) joins the window."""
        weight = losses.token_weight(fb.loss_fn, [d.inputs for d in fb.data], lengths)
        self.window_tokens += sum(lengths)
        self.window_requests += 1
        self.window_weight = (
            None if weight is None or self.window_weight is None else self.window_weight + weight
        )

    def reset(self) -> None:
        self.window_tokens = self.window_requests = 0
        self.window_weight = 0.0


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


@dataclass
class _Orders:
    """What rank 0 decided at a step boundary, the same on every process once broadcast."""

    pauses: dict[str, str]  # tenant -> why: its client went away
    resumes: list[str]  # tenants whose client is back
    works: list[Work]  # the requests taken from the inbox, in its order


class ServiceDriver(Driver):
    """Tenants of Tinker training clients (see the module docstring). ``state`` is the service's shared
    state (:class:`~mlora_lab.service.state.ServiceState`): its inbox, futures and model registry, on rank 0;
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
        if state is not None and state.tokenizer is None:
            state.tokenizer = parts.engine.tokenizer  # (the OpenAI endpoint's text in and out)
        if self.main != (state is not None):
            raise ValueError("the service's state belongs to rank 0, and only to it")
        if state is not None:
            state.inbox.arrived = parts.wake  # a request wakes the idle loop at once
        self.watch = SessionWatch(session_timeout_s)  # (rank 0's: clients gone away, or back)
        self.state, self.lora_alpha = state, float(lora_alpha)
        service = parts.spec.service  # (the names the OpenAI endpoint gives the base: no client's tenant's)
        self.reserved = reserved_model_names(
            served_base_name(service and service.model_name, parts.spec.base_model)
        )
        folder = None if checkpoints is None else Path(checkpoints)  # (rank 0 alone writes there)
        self.snapshots = Snapshots(parts.engine, parts.spec.max_tenants, folder, self.main)
        self.states = SavedStates(parts.engine, folder, self.main, self.lora_alpha)
        self.meter = Meter()  # (what each key's requests cost: rank 0 writes it, metering.py)
        self.comm = parts.engine.comm
        self.names: dict[str, str] = {}  # model id -> tenant name
        self.queues: dict[str, deque[Work]] = {}  # model id -> its requests taken, not run yet
        self.step_work: dict[str, _Pending] = {}  # tenant -> what it runs in the current step
        self.waiting_optim: dict[str, Work] = {}  # tenant -> its optim_step, until the step settles it
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
            info = ModelInfo(
                c.model_id,
                c.owner,
                self.state.base_model,
                t.spec.rank,
                c.seed,
                c.train_attn,
                c.train_mlp,
                c.train_unembed,
            )
            waiting = t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE)
            self.state.restore_model(info, t.feed.restored_seq_id or 1, alive=not waiting)

    def waiting(self) -> bool:
        return True  # clients may send requests at any time

    # -- in the job's checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``service``: the unnamed sampler snapshots (every process holds them) and rank 0's sessions and
        sampling sessions, so that a resumed job's clients sample from what they saved before the stop."""
        registry = (
            {**self.state.registry(self.snapshots.by_key), **self.meter.state_dict()} if self.main else {}
        )
        return {"service": {"snapshots": self.snapshots.state_dict(), **registry}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("service")
        if not isinstance(saved, dict):  # (a checkpoint of a job that was not served, or older)
            return
        snapshots = saved.get("snapshots")
        left_out = self.snapshots.load_state_dict(snapshots if isinstance(snapshots, dict) else {})
        if self.main:
            n, m = self.state.restore_registry(saved), self.meter.load_state_dict(saved)
            left_out += [f"{n} session(s) of the wrong shape are left out"] if n else []
            left_out += [f"{m} usage total(s) of the wrong shape are left out"] if m else []
            for why in left_out:
                print(f"resume: {why}", flush=True)

    # -- a step's plan ---------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        if self._restored:
            self._restore_models()
        self._settle_failed()
        self._publish_models()
        # (every process runs what rank 0 took, in its order: every forward is a collective)
        orders: _Orders = self.comm.broadcast_object(self._orders() if self.main else None)  # type: ignore[assignment]
        apply_changes(self.pool, orders.pauses, orders.resumes)
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
            if t is None or t.state is TenantState.FAILED:  # no later request of its can run: say why
                why = f"quarantined: {t.reason}" if t is not None else "removed from the job"
                while queue:
                    self._fail(queue.popleft(), f"model {model_id!r} (tenant {name!r}) was {why}")
            if t is None or t.state is not TenantState.RUNNING:  # (paused: they wait until it runs again)
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
                        losses.validate(
                            fb.loss_fn,
                            fb.config,
                            [d.inputs for d in fb.data],
                            lengths,
                            vocab_size=self.engine.vocab_rows,
                        )
                    except losses.LossInputError as e:
                        self._fail(work, str(e))
                        continue
                    pending.forwards.append((work, lengths))
                    tokens += sum(lengths)
                elif work.kind in (Kind.SAVE_FOR_SAMPLER, Kind.SAVE_WEIGHTS, Kind.LOAD_WEIGHTS):
                    if pending.forwards:  # it must come after them (and their step): next step
                        break
                    self._save_or_load(queue.popleft(), t)
                else:  # an optim_step (the only other kind queued): it ends the tenant's part of this step
                    pending.optim = queue.popleft()
                    break
            if pending.forwards or pending.optim is not None:
                self.step_work[name] = pending
        if samples:
            metered_sample(self.snapshots, self.meter, self.names, samples, self._settle)
        for row in self.meter.rows(self.recorder.step, idle=not self.step_work) if self.main else ():
            self.recorder.log(row)
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
                only, n = work.body.forward_only, sum(lengths)
                self.meter.add(
                    work.owner, t.name, trained=0 if only else n, forward=n if only else 0, requests=1
                )
                if not only:
                    t.feed.add(work.body, lengths)
            if pending.optim is not None:
                self.meter.add(pending.optim.owner, t.name, requests=1)
                _set_adam(t, pending.optim.body)
                self.waiting_optim[t.name] = pending.optim
                complete.append(t.name)
        self.meter.began()  # (the step's time, shared out by after_step)
        return Plan(tenants=tenants, rows=rows, complete=complete)

    def _orders(self) -> _Orders:
        """Rank 0: the sessions' changes and the waiting requests. A sample with no seed gets one here, from
        torch's generator, so that every process draws the same tokens."""
        pauses, resumes = self.watch.changes(self.state, self.pool, self.names)
        works = []
        # (requests a full step left behind run now, with whatever has come: none waits out a gather)
        while not self._left_over() and (wait := self.state.inbox.gather_wait(GATHER_QUIET_S, GATHER_MAX_S)):
            time.sleep(wait)
        for work in self.state.inbox.take():
            s = work.body
            if work.kind is Kind.SAMPLE and s.seed is None and s.temperature > 0:
                seed = int(torch.randint(0, 2**63 - 1, ()))
                work = dataclasses.replace(work, body=dataclasses.replace(s, seed=seed))
            works.append(work)
        return _Orders(pauses, resumes, works)

    def _left_over(self) -> bool:
        """Whether a running tenant has requests taken in an earlier step and not run yet (``max_step_tokens``
        left them for the next steps)."""
        for model_id, queue in self.queues.items():
            t = self.pool.tenants.get(self.names[model_id])
            if queue and t is not None and t.state is TenantState.RUNNING:
                return True
        return False

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
        model, reserved = self.engine.model, self.reserved
        name = client_tenant_name(
            info, lambda n: not self.pool.name_taken(n) and n not in model.tenants and n not in reserved
        )
        try:
            targets, experts = tinker_targets(
                self.engine.model,
                info.train_attn,
                info.train_mlp,
                info.train_unembed,
                self.engine.slot_modules,
            )
        except ValueError as e:
            self._fail(work, str(e))
            return None
        client = ClientModel(
            model_id, info.owner, info.seed, info.train_attn, info.train_mlp, info.train_unembed
        )
        tenant = Tenant(
            name=name,
            data="",
            rank=info.rank,
            alpha=self.lora_alpha,
            target_modules=targets,
            target_parameters=experts,
            lr=1e-4,
            weight_decay=0.0,
            max_grad_norm=None,
            batch_size=1,
            max_steps=MAX_COUNT,
            seed=0 if info.seed is None else int(info.seed),
            dropout=0.0,
            client=client,
        )
        self.names[model_id] = name
        # (a loaded snapshot gives its slot to a training client; it loads again when sampled)
        self.snapshots.free_slots(1)
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

    def tenant_of(self, model_id: str) -> str:
        """The tenant a client's model is (``KeyError`` for a model this job has not made)."""
        return self.names[model_id]

    def before_checkpoint(self) -> None:
        """The clients that had gone away by now are paused before the checkpoint keeps their tenants (their
        sessions that made no model forgotten): a resumed job must not take them for live ones. On every
        process (rank 0 decides; pausing saves: a collective)."""
        changes = self.watch.changes(self.state, self.pool, self.names, now=True) if self.main else None
        pauses, resumes = self.comm.broadcast_object(changes)
        apply_changes(self.pool, pauses, resumes)

    def _publish_models(self) -> None:
        """Rank 0: tell the HTTP side what the OpenAI endpoint lists and samples: the tenants holding a slot,
        and the named sampler snapshots (before a snapshot's save is answered: its client may list it next)."""
        if not self.main:
            return
        tenants = [n for n in self.pool.tenants if n in self.engine.model.tenants]
        snaps = [k for k, v in self.snapshots.by_key.items() if k.startswith("tinker://") and v is not None]
        with self.state.lock:
            self.state.tenant_names, self.state.snapshot_paths = tenants, snaps

    # -- snapshots and saved states, at their place in the model's order ------------------------------
    def _save_or_load(self, work: Work, t: TenantRun) -> None:
        """A sampler snapshot of ``t`` (:class:`~mlora_lab.job.drivers.tinker.snapshots.Snapshots`), or its training state
        saved or loaded (:class:`~mlora_lab.job.drivers.tinker.saved_states.SavedStates`). A path that is not one fails its
        request alone, alike on every process (checked before any collective; the HTTP side refuses it first)."""
        try:
            if work.kind is Kind.SAVE_FOR_SAMPLER:
                result = self.snapshots.save(work, t.name)
            elif work.kind is Kind.SAVE_WEIGHTS:
                info = self.state.models.get(work.model_id) if self.main else None
                result = self.states.save(work, t, info)
            else:
                result = self.states.load(work, t)
        except ValueError as e:
            result = Result(error=str(e))
        if work.kind is Kind.SAVE_FOR_SAMPLER:
            self._publish_models()
        if result is not None:
            self._settle(work, result)

    def _create_from_state(self, work: Work) -> None:
        """``create_training_client_from_state``: a new model with the saved LoRA settings, then the load."""
        try:
            state = self.states.read(work.body.path)
        except ValueError as e:  # (not a checkpoint path: see _save_or_load)
            state = str(e)
        if isinstance(state, str):
            self._fail(work, state)
            return
        t = self._create(work, saved_model(work, state, self.spec.base_model))
        if t is None:
            return
        self.states.restore(t, state, work.body.optimizer)
        answer = {"path": work.body.path, "type": "load_weights", "model_id": work.model_id}
        self._settle(work, Result(json=answer))

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
        # (every log_every-th step, as the other drivers; its loss is Tinker's sum: said so, with its mean)
        mean = result.loss / f.window_weight if f.window_weight else None
        self.log_train(t, result, f.window_tokens, loss_reduction="sum", loss_per_token=mean)
        f.reset()

    def after_step(self) -> None:
        """Answer the step's forward/backward requests: every process's datums' results, gathered on rank 0
        (one collective), in datum order; ``loss:sum`` and the other metrics summed over the datums in that
        order, as one process sums them. (TP ranks hold the same datums: either copy will do.)"""
        works = [work for p in self.step_work.values() for work, _ in p.forwards]
        self.meter.ended(step_tokens(self.step_work))
        scored, self.scored = self.scored, {}
        if not works:  # (the same on every process)
            return
        mine = {
            rid: {
                i: (lp.float().cpu(), v.cpu(), {k: float(x) for k, x in m.items()})
                for i, (lp, v, m) in got.items()
            }
            for rid, got in scored.items()
        }
        everyone = self.comm.gather_objects(mine)
        if self.main:
            for work in works:
                self._settle(work, forward_answer(work, everyone))

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


def metered_sample(
    snapshots: Snapshots,
    meter: Meter,
    tenants: Mapping[str, str],
    samples: list[Work],
    settle: Callable[[Work, Result], None],
) -> None:
    """Every waiting sample in one generation (:meth:`~mlora_lab.job.drivers.tinker.snapshots.Snapshots.sample`), metered:
    its requests' generated tokens and its time, by (key, tenant of the snapshot: ``tenants`` maps model ids
    to tenants; None for the base model)."""
    meter.began()
    tokens: dict[tuple[str, str | None], int] = {}
    for work, n in snapshots.sample(samples, settle):
        source = work.model_id or (work.body.model_path or "").removeprefix("tinker://").split("/")[0]
        key = (
            work.owner,
            getattr(work.body, "tenant", None) or tenants.get(source),
        )  # (OpenAI: a tenant itself)
        tokens[key] = tokens.get(key, 0) + n
        meter.add(*key, sampled=n, requests=1)
    meter.ended(tokens)


def step_tokens(step_work: Mapping[str, _Pending]) -> dict[tuple[str, str | None], int]:
    """(key, tenant) -> the input tokens of a step's datums: how its time is shared out (metering)."""
    out: dict[tuple[str, str | None], int] = {}
    for name, pending in step_work.items():
        for work, lengths in pending.forwards:
            out[(work.owner, name)] = out.get((work.owner, name), 0) + sum(lengths)
        if pending.optim is not None:
            out.setdefault((pending.optim.owner, name), 0)
    return out


def forward_answer(work: Work, everyone: list[Any]) -> Result:
    """A forward/backward request's answer from every process's results of its datums (``everyone``: each
    process's ``{request id: {datum: (logprobs, loss, metrics)}}``): the logprobs in datum order, and
    ``loss:sum`` and the other metrics summed over the datums in that order, as one process sums them."""
    got: dict[int, tuple] = {}
    for part in everyone:
        got |= part.get(work.request_id, {})
    fb: wire.ForwardBackward = work.body
    if len(got) != len(fb.data):  # (cannot happen: every datum is some process's row)
        missing = len(fb.data) - len(got)
        return Result(error=f"{missing} datum(s) were not computed", category=ErrorCategory.SERVER)
    per_datum, loss_sum, metrics = [], torch.zeros(()), {}
    for i in range(len(fb.data)):
        lp, value, m = got[i]
        per_datum.append(lp)
        loss_sum = loss_sum + value
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    metrics["loss:sum"] = float(loss_sum)
    return Result(proto=wire.forward_backward_output(per_datum, metrics))


def _row(d: wire.Datum) -> Example:
    """A datum as a row of the step: ``x`` and one more position, labels ``[-, y_0, …, y_{N-1}]`` (the
    extra input token is never predicted from; its logits are not used)."""
    targets = d.inputs["target_tokens"].reshape(-1).tolist()
    return Example([*d.tokens, targets[-1]], [IGNORE_INDEX, *targets])


def _set_adam(t: TenantRun, params: Any) -> None:
    """The request's AdamParams on the tenant's AdamW for the coming step (the schedule is constant)."""
    p = _params(params)
    opt = t.optimizer
    opt.set_hyperparameters(lr=p["learning_rate"], weight_decay=p["weight_decay"])
    group = opt.optimizer.param_groups[0]
    group["betas"], group["eps"] = (p["beta1"], p["beta2"]), p["eps"]
    opt.max_grad_norm = p["grad_clip_norm"] if p["grad_clip_norm"] > 0 else None


def _params(params: Any) -> Mapping[str, float]:
    keys = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    if isinstance(params, Mapping):
        return {k: float(params[k]) for k in keys}
    return {k: float(getattr(params, k)) for k in keys}
