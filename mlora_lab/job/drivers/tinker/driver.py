"""The service driver: training clients of the Tinker API drive their tenants request by request.

Third driver of the training loop (after file data and RL, :mod:`mlora_lab.job.drivers.base`). The HTTP thread
(:mod:`mlora_lab.service.app`) only queues :class:`~mlora_lab.service.work.Work`; at each step boundary this
driver takes what may run (:meth:`~mlora_lab.service.work.Inbox.take`: every model's requests in ``seq_id``
order) and turns it into one mixed-tenant step, so the requests of every client that wait at the same moment
share one forward and one backward of the base. It composes four parts, each built with what it needs:

    sessions          the clients' models: ``create_model`` (a tenant in a free slot), the models a resumed
                      job brings back, and clients that go away (their tenants saved and paused, not lost)
                      and come back (:class:`~mlora_lab.job.drivers.tinker.sessions.Sessions`)
    requests          the request plan: each model's requests in ``seq_id`` order, the step they make
                      (``forward_backward``: rows of the step, Tinker's losses; ``optim_step``: the tenant's
                      AdamW step after the backward, with the request's ``AdamParams``; gradients of every
                      ``forward_backward`` since the last optim_step summed, as in Tinker), and their answers
                      (:class:`~mlora_lab.job.drivers.tinker.plan.RequestPlan`)
    states            ``save_weights`` (``save_state``) and ``load_weights``: into the model, or a new model
                      from the state (:class:`~mlora_lab.job.drivers.tinker.saved_states.SavedStates`)
    snapshots         ``save_weights_for_sampler``: a **snapshot** of the tenant's adapter, at its place in the
                      model's ``seq_id`` order, and ``asample``: every waiting sample in ONE batched
                      generation (:class:`~mlora_lab.job.drivers.tinker.snapshots.Snapshots`, which also
                      shares the slots between snapshots and training clients)

A step, in order: the models a resume brought back registered again; the requests of tenants the last step
quarantined failed; the tenants and named snapshots published to the OpenAI endpoint; rank 0's orders
(clients gone away or back, the requests taken) broadcast and applied; the models made; each running
model's part of the step chosen, its saves and loads run at their place; every waiting sample in one
generation; the usage rows written; then the step's rows (None: the step trains nothing).

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlora_lab.job.drivers.base import Driver, JobParts, Plan, StepResult
from mlora_lab.job.drivers.tinker.plan import RequestPlan, ServiceFeed
from mlora_lab.job.drivers.tinker.saved_states import SavedStates
from mlora_lab.job.drivers.tinker.sessions import Sessions, apply_changes
from mlora_lab.job.drivers.tinker.snapshots import Snapshots
from mlora_lab.job.metering import Meter
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rundir.service import reserved_model_names, served_base_name
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.work import Kind, Result, Work
from mlora_lab.spec.tenant import Tenant


@dataclass
class Orders:
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
        self.main = parts.pool.is_main
        if state is not None and state.tokenizer is None:
            state.tokenizer = parts.engine.tokenizer  # (the OpenAI endpoint's text in and out)
        if self.main != (state is not None):
            raise ValueError("the service's state belongs to rank 0, and only to it")
        if state is not None:
            state.inbox.arrived = parts.wake  # a request wakes the idle loop at once
        self.state, self.lora_alpha, self.comm = state, float(lora_alpha), parts.engine.comm
        service = parts.spec.service  # (the names the OpenAI endpoint gives the base: no client's tenant's)
        reserved = reserved_model_names(
            served_base_name(service and service.model_name, parts.spec.base_model)
        )
        folder = None if checkpoints is None else Path(checkpoints)  # (rank 0 alone writes there)
        self.snapshots = Snapshots(parts.engine, parts.spec.max_tenants, folder, self.main)
        self.states = SavedStates(parts.engine, folder, self.main, self.lora_alpha)
        self.meter = Meter()  # (what each key's requests cost: rank 0 writes it, metering.py)
        self.sessions = Sessions(
            parts.engine,
            parts.pool,
            state,
            self.snapshots,
            self._settle,
            self.lora_alpha,
            session_timeout_s,
            reserved,
        )
        self.requests = RequestPlan(
            parts.engine,
            parts.pool,
            self.sessions.names,
            state.inbox if state is not None else None,
            self.meter,
            self._settle,
            max_step_tokens,
        )

    def use_sampler(self, sampler: Callable[..., Any]) -> None:
        """With rollout ranks, the clients' sampling requests (and the OpenAI endpoint's) are sampled there."""
        self.snapshots.sampler = sampler

    def accepts(self, tenant: Tenant) -> bool:
        return tenant.client is not None or tenant.name in self.sessions.names.values()

    def feed(self, tenant: Tenant) -> ServiceFeed:
        """The feed of a tenant :meth:`_create` is making, or of a client's tenant a resumed job brings back
        from ``job.json`` (registered again under its model id, its queue open; its inbox opens once the
        checkpoint said where its client's requests go on)."""
        model_id, restored = self.sessions.model_of(tenant)
        if restored:
            self.requests.open(model_id)
        return ServiceFeed(model_id, next_seq_id=lambda: self.requests.next_seq_id(model_id))

    def tenant_of(self, model_id: str) -> str:
        """The tenant a client's model is (``KeyError`` for a model this job has not made)."""
        return self.sessions.names[model_id]

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

    def before_checkpoint(self) -> None:
        self.sessions.before_checkpoint()

    # -- a step's plan ---------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        if self.sessions.restored:
            self.sessions.restore_models()
        self.requests.settle_failed()
        self.sessions.publish()
        # (every process runs what rank 0 took, in its order: every forward is a collective)
        mine = Orders(*self.sessions.changes(), self.requests.take()) if self.main else None
        orders: Orders = self.comm.broadcast_object(mine)  # type: ignore[assignment]
        apply_changes(self.pool, orders.pauses, orders.resumes)
        samples: list[Work] = []
        for work in orders.works:
            if work.kind is Kind.CREATE_MODEL:
                self._create(work)
            elif work.kind is Kind.SAMPLE:
                samples.append(work)
            elif work.kind is Kind.LOAD_WEIGHTS and work.body.create:
                result = self.states.create_from(work, self._create, self.spec.base_model)
                if result is not None:
                    self._settle(work, result)
            else:
                self.requests.add(work)
        trains = self.requests.select(self._save_or_load)
        if samples:
            metered_sample(self.snapshots, self.meter, self.sessions.names, samples, self._settle)
        for row in self.meter.rows(self.recorder.step, idle=not trains) if self.main else ():
            self.recorder.log(row)
        return self.requests.plan()

    def _create(self, work: Work, info: ModelInfo | None = None) -> TenantRun | None:
        """A tenant for the model ``info`` describes (``work.body`` by default), its requests' queue open;
        None (the request failed, saying why) if it cannot be made."""
        t = self.sessions.create(work, self.feed, info)
        if t is not None:
            self.requests.open(t.feed.model_id)
        return t

    def _save_or_load(self, work: Work, t: TenantRun) -> None:
        """A sampler snapshot of ``t`` (:class:`~mlora_lab.job.drivers.tinker.snapshots.Snapshots`), or its
        training state saved or loaded (:class:`~mlora_lab.job.drivers.tinker.saved_states.SavedStates`), at
        its place in the model's order. A path that is not one fails its request alone, alike on every
        process (checked before any collective; the HTTP side refuses it first)."""
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
            self.sessions.publish()
        if result is not None:
            self._settle(work, result)

    # -- the loss, and after the optimiser step --------------------------------------------------
    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.requests.loss(t, token_loss)

    def stepped(self, t: TenantRun, result: StepResult) -> None:
        f: ServiceFeed = t.feed
        # (every log_every-th step, as the other drivers; its loss is Tinker's sum: said so, with its mean)
        mean = result.loss / f.window_weight if f.window_weight else None
        # the row first, then the optim_step's answer: a client that reads the run after its answer finds the row
        self.log_train(t, result, f.window_tokens, loss_reduction="sum", loss_per_token=mean)
        self.requests.stepped(t, result)
        f.reset()

    def after_step(self) -> None:
        self.requests.answer()

    def _settle(self, work: Work, result: Result) -> None:
        """``work``'s answer (rank 0 holds the futures; the other processes ran it with rank 0)."""
        if self.main:
            self.state.futures.settle(work.request_id, result)


def metered_sample(
    snapshots: Snapshots,
    meter: Meter,
    tenants: Mapping[str, str],
    samples: list[Work],
    settle: Callable[[Work, Result], None],
) -> None:
    """Every waiting sample in one generation (:meth:`~mlora_lab.job.drivers.tinker.snapshots.Snapshots.sample`),
    metered: its requests' generated tokens and its time, by (key, tenant of the snapshot: ``tenants`` maps
    model ids to tenants; None for the base model)."""
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
