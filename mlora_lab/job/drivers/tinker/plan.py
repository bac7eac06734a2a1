"""The request plan: which of the clients' requests a step runs, the step's rows, and their answers.

Part of the service driver (:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`), which hands it the
requests rank 0 took from the inbox (:meth:`RequestPlan.take`) and composes the step around it.

A step takes the waiting requests once none has come for :data:`GATHER_QUIET_S` (or the first has waited
:data:`GATHER_MAX_S`), so that requests sent together share it; a request that comes while the loop idles
wakes it at once. A model's requests run in ``seq_id`` order (:meth:`RequestPlan.select`): in one step a
model takes its waiting forward/backward requests up to and including its first optim_step; what follows
waits for the next step (it must see the new weights); a save or load runs at its place in that order, before
the step (after the forward/backward requests before it: then it waits for the next step). With
``max_step_tokens``, a step takes forward/backward requests until their datums hold that many input tokens
(at least one request); the rest wait for the next steps, and the models take turns to go first. Such a next
step starts at once, with what has come meanwhile (it waits for no gather).

A datum is a row of the step: input ``x [N]`` + one more position, labels ``[-, y_0 … y_{N-1}]``
(``y = target_tokens``), so the loop's per-token loss ``ℓ [N]`` gives ``lp_t = −ℓ_t = log p(y_t | x_{≤t})``,
the logprobs the client gets back; the request's loss is Tinker's sum over its datums
(:mod:`mlora_lab.service.losses`); ``forward`` (forward-only) rows take part in the forward and add nothing
to the backward. An optim_step sets the request's ``AdamParams`` on the tenant's AdamW for the step (torch
AdamW: lr, betas, eps, decoupled weight decay; clipping when ``grad_clip_norm`` > 0).

Results are settled at the end of their step: an optim_step's after the optimiser step (or its failure: a
quarantined tenant fails its waiting requests), a forward/backward's once the step is over
(:meth:`RequestPlan.answer`). On several processes a tenant's datums are split over the data-parallel ranks
as the file-data rows are (rank ``d`` of ``D`` takes datums ``d, d + D, …``); each process keeps its
datums' logprobs, loss and metrics, and after the step one gather brings them to rank 0, which puts the
logprobs in datum order and sums ``loss:sum`` and the other metrics over the datums, in datum order.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example
from mlora_lab.job.drivers.base import Plan, StepResult
from mlora_lab.job.engine import Engine
from mlora_lab.job.metering import Meter
from mlora_lab.job.tenants import TenantPool, TenantRun
from mlora_lab.rundir import TenantState
from mlora_lab.service import losses, wire
from mlora_lab.service.work import ErrorCategory, Inbox, Kind, Result, Work

GATHER_QUIET_S = 0.02
"""A step takes the waiting requests once none has come for this long. Requests sent together (a client's
optim_step right behind its forward_backward, several clients' at the same moment) reach the job a few to
some tens of milliseconds apart; taken at the first, each would make a step of its own (measured on a
small model: two clients in lock-step shared none of their steps)."""

GATHER_MAX_S = 0.1
"""... or once the first of them has waited this long (a steady stream of requests holds no step back)."""

SAVES_AND_LOADS = (Kind.SAVE_FOR_SAMPLER, Kind.SAVE_WEIGHTS, Kind.LOAD_WEIGHTS)
"""The requests that run at their place in the model's order, before the step (not rows of it)."""


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
class Pending:
    """What a tenant runs in this step: its forward/backward requests (with their datums' lengths), the
    optim_step that ends it, if any, and which of their datums are this process's rows."""

    forwards: list[tuple[Work, list[int]]] = field(default_factory=list)
    optim: Work | None = None
    local: list[tuple[int, int]] = field(default_factory=list)  # (request, datum) of each row here, in order


Settle = Callable[[Work, Result], None]
"""Answers a request (rank 0 holds the futures: a no-op elsewhere)."""


class RequestPlan:
    """The clients' requests taken and not run yet, each model's in its ``seq_id`` order, and the step made
    of them (see the module docstring).

    ``engine``: the job's (its vocabulary, this process's share of the datums, the gather of the answers);
    ``pool``: the job's tenants; ``names``: model id -> tenant, shared with the sessions that make them;
    ``inbox``: rank 0's (None elsewhere); ``meter``: what each key's requests cost; ``settle``: answers a
    request; ``max_step_tokens``: the input tokens a step's datums may hold (None: no cap)."""

    def __init__(
        self,
        engine: Engine,
        pool: TenantPool,
        names: Mapping[str, str],
        inbox: Inbox | None,
        meter: Meter,
        settle: Settle,
        max_step_tokens: int | None = None,
    ) -> None:
        self.engine, self.comm, self.pool, self.names = engine, engine.comm, pool, names
        self.inbox, self.meter, self.settle = inbox, meter, settle
        self.max_step_tokens = max_step_tokens
        self.queues: dict[str, deque[Work]] = {}  # model id -> its requests taken, not run yet
        self.step_work: dict[str, Pending] = {}  # tenant -> what it runs in the current step
        self.waiting_optim: dict[str, Work] = {}  # tenant -> its optim_step, until the step settles it
        # request id -> datum -> (logprobs, loss, metrics) of this process's datums of the current step
        self.scored: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]] = {}
        self._first = 0  # which model goes first in the next step (they take turns)

    def open(self, model_id: str) -> None:
        """A model's queue: its requests are taken from now on (the order models go first in: when opened)."""
        self.queues[model_id] = deque()

    def next_seq_id(self, model_id: str) -> int | None:
        """Rank 0: the seq_id of the model's first request not run yet (taken but waiting, or the inbox's)."""
        if self.inbox is None:
            return None
        queue = self.queues.get(model_id)
        waiting = [w.seq_id for w in queue or () if w.seq_id is not None]
        return min(waiting) if waiting else self.inbox.next_seq_id(model_id)

    def take(self) -> list[Work]:
        """Rank 0: the waiting requests, once none has come for a moment (none waits out a gather when a full
        step left requests behind). A sample with no seed gets one here, from torch's generator, so that every
        process draws the same tokens."""
        assert self.inbox is not None, "rank 0 takes the requests"
        while not self._left_over() and (wait := self.inbox.gather_wait(GATHER_QUIET_S, GATHER_MAX_S)):
            time.sleep(wait)
        works = []
        for work in self.inbox.take():
            s = work.body
            if work.kind is Kind.SAMPLE and s.seed is None and s.temperature > 0:
                seed = int(torch.randint(0, 2**63 - 1, ()))
                work = dataclasses.replace(work, body=dataclasses.replace(s, seed=seed))
            works.append(work)
        return works

    def add(self, work: Work) -> None:
        """An ordered request of a model (forward/backward, optim_step, save or load) joins its queue."""
        if work.model_id in self.queues:
            self.queues[work.model_id].append(work)
        else:
            self.settle(work, Result(error=f"no model {work.model_id!r} on this server"))

    def select(self, save_or_load: Callable[[Work, TenantRun], None]) -> bool:
        """Each running model's part of this step, from its queue in ``seq_id`` order (a save or load handed
        to ``save_or_load`` at its place); a failed or removed tenant's requests fail, a paused one's wait.
        Whether the step trains anything."""
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
            pending = Pending()
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
                elif work.kind in SAVES_AND_LOADS:
                    if pending.forwards:  # it must come after them (and their step): next step
                        break
                    save_or_load(queue.popleft(), t)
                else:  # an optim_step (the only other kind queued): it ends the tenant's part of this step
                    pending.optim = queue.popleft()
                    break
            if pending.forwards or pending.optim is not None:
                self.step_work[name] = pending
        return bool(self.step_work)

    def plan(self) -> Plan | None:
        """The step :meth:`select` chose: this process's rows of each tenant, metered, and the tenants an
        optim_step completes (their AdamW set from its request); None when it trains nothing."""
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
        self.meter.began()  # (the step's time, shared out by answer)
        return Plan(tenants=tenants, rows=rows, complete=complete)

    def loss(self, t: TenantRun, token_loss: torch.Tensor) -> torch.Tensor:
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

    def stepped(self, t: TenantRun, result: StepResult) -> None:
        """``t``'s optimiser step ran: its optim_step is answered."""
        work = self.waiting_optim.pop(t.name, None)
        if work is not None:
            metrics = {"grad_norm:max": result.grad_norm, "learning_rate:max": result.lr}
            self.settle(work, Result(json={"metrics": metrics}))

    def answer(self) -> None:
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
        if self.inbox is not None:  # (rank 0)
            for work in works:
                self.settle(work, forward_answer(work, everyone))

    def settle_failed(self) -> None:
        """Requests of tenants the last step quarantined fail with the tenant's reason."""
        for name, work in list(self.waiting_optim.items()):
            t = self.pool.tenants.get(name)
            if t is None or t.state is TenantState.FAILED:
                del self.waiting_optim[name]
                why = t.reason if t is not None else "it is gone"
                self._fail(work, f"the model's step failed: {why}")

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

    def _fail(self, work: Work, why: str) -> None:
        self.settle(work, Result(error=why, category=ErrorCategory.USER))


def step_tokens(step_work: Mapping[str, Pending]) -> dict[tuple[str, str | None], int]:
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
