"""The driver seam: where the training loop takes its work from.

The loop (:meth:`~mlora_lab.job.trainer.Trainer.step`) knows how to run one mixed-tenant step and
nothing about where the rows come from::

    plans  = [d.plan() for d in drivers]                      # each driver: its tenants' rows
    batch  = engine.forward(rows of every plan)               # one forward of the shared base
    L      = Σ_t  driver(t).loss(t, ℓ[rows of t], labels)     # each tenant's loss from its rows
    L.backward()                                              # gradients reach only each tenant's slot
    for t in the plans' complete tenants:                     # agreed on every rank: clip by t's own
        AdamW step of t (or quarantine if NaN/inf or raised)  #   norm, quarantine the non-finite
        driver(t).stepped(t, result)                          # counters, rows, finishing
    for d of the plans: d.after_step()                        # what waits on the whole step (answers)

A **driver** owns the tenants it :meth:`~Driver.accepts` and, for each, a :class:`~.tenants.Feed` (its
per-tenant state, saved in checkpoints). Per step it returns a :class:`Plan`: which of its running
tenants take part (the same list on every process), this process's rows of each, which ones complete a
window with this step (their optimiser steps after the backward), and which raised while preparing
(quarantined on every process). Its :meth:`~Driver.loss` turns a tenant's per-token losses
``ℓ [n, T-1]`` (fp32 cross entropy of each next token, 0 where the label is ignored; ``-ℓ`` is the
token's log-probability) into the tenant's loss on this process, a scalar whose gradient summed over
the processes is the tenant's gradient.

The first driver is :class:`~.filedata.FileData` (SFT rows from a tenant's data file); the second is
:class:`~.rl.RLDriver` (GRPO tenants: generations, rewards, and a plan that names the temperature their
logits are scored at). Another driver (requests of a training service) is added beside them in
:mod:`mlora_lab.job.drivers.default`, not by editing the loop.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mlora_lab.data import Example
from mlora_lab.job.engine import Engine
from mlora_lab.job.recorder import Recorder
from mlora_lab.job.tenants import Feed, TenantPool, TenantRun
from mlora_lab.rundir import TrainRow
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant

if TYPE_CHECKING:
    from mlora_lab.parallel import Roles


@dataclass
class Plan:
    """One driver's share of a step."""

    tenants: list[TenantRun]  # taking part in this step (the same list on every process)
    rows: dict[str, list[Example]]  # this process's rows of each (a tenant may have none here)
    complete: list[str] = field(default_factory=list)  # whose optimiser steps after this backward
    failed: dict[str, str] = field(default_factory=dict)  # whose part raised here, with why
    # whose logits are divided by a temperature before the loss (an RL tenant scores at its sampling one)
    temperatures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """A tenant's optimiser step: its loss over the window (summed over the processes), the learning
    rate it used and its gradient norm before clipping."""

    loss: float
    lr: float
    grad_norm: float


@dataclass(frozen=True)
class JobParts:
    """What a driver may be built with: the job's spec and its shared parts."""

    spec: JobSpec
    engine: Engine
    pool: TenantPool
    recorder: Recorder
    wake: threading.Event = field(default_factory=threading.Event)
    """Set by a driver whose work comes from another thread (a served request) when some arrives: the loop,
    idle, wakes at once instead of at its next idle poll."""
    roles: Roles | None = None
    """The job's trainers and rollout ranks (``Parallel.rollout_ranks``; ``None``: every process trains)."""


class Driver(ABC):
    """A source of work for the training loop (see the module docstring)."""

    def __init__(self, parts: JobParts) -> None:
        self.spec, self.engine, self.pool, self.recorder = (
            parts.spec,
            parts.engine,
            parts.pool,
            parts.recorder,
        )

    @abstractmethod
    def accepts(self, tenant: Tenant) -> bool:
        """Whether this driver feeds ``tenant``."""

    @abstractmethod
    def feed(self, tenant: Tenant) -> Feed:
        """``tenant``'s per-tenant state, ready to train (reads its inputs). May raise: no slot is touched."""

    @abstractmethod
    def plan(self) -> Plan | None:
        """This step's work for this driver's running tenants; ``None`` when it has none now."""

    @abstractmethod
    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Tenant ``t``'s loss on this process from its rows' per-token losses ``token_loss`` [n, T-1]
        and their labels [n, T] (in the order the plan gave the rows)."""

    def stepped(self, t: TenantRun, result: StepResult) -> None:  # noqa: B027 (a hook: may do nothing)
        """``t`` took an optimiser step (its counter ``t.step`` already moved)."""

    def log_train(self, t: TenantRun, result: StepResult, tokens: int, **more: Any) -> TrainRow | None:
        """The one place a driver writes ``t``'s train row for the step it just took: every
        ``JobSpec.log_every``-th tenant step and its last (``max_steps``), with the step's loss, lr, gradient
        norm and ``tokens``, and what the driver adds (``more``: counts, an RL tenant's reward, ...). The row
        written, or ``None`` on a step that is not logged."""
        if t.step % self.spec.log_every and t.step != t.spec.max_steps:
            return None
        row = TrainRow(
            step=self.recorder.step,
            tenant=t.name,
            tenant_step=t.step,
            loss=result.loss,
            tokens=tokens,
            lr=result.lr,
            grad_norm=result.grad_norm,
            **more,
        )
        self.recorder.log(row)
        return row

    def after_step(self) -> None:  # noqa: B027 (a hook: may do nothing)
        """The step this driver planned is over (its backward and optimiser steps done). Called on every
        process, driver by driver, whatever rows a process had (:meth:`loss` is called only for a tenant
        with rows here), so it may be a collective."""

    def heldout_losses(self, only: Sequence[str] | None = None) -> dict[str, float]:
        """Held-out losses of this driver's tenants (their ``heldout_data``; or of those ``only``). A
        collective."""
        return {}

    def waiting(self) -> bool:
        """Whether work may still come with none of its tenants running (a service waiting for requests)."""
        return False

    def sampler(self) -> Callable[..., Any] | None:
        """What samples for the job's generations outside this driver's own (``JobSpec.evals``), in
        :func:`~mlora_lab.sampling.sample`'s signature: a job with rollout ranks samples there; ``None`` (the
        default): the training processes' own model."""
        return None

    def use_sampler(self, sampler: Callable[..., Any]) -> None:  # noqa: B027 (a hook: may do nothing)
        """The job samples its generations with ``sampler`` (another driver's :meth:`sampler`: a job with rollout
        ranks samples there); a driver that samples for requests of its own takes it."""

    def system_shares(self) -> dict[str, float]:
        """What this driver adds to rank 0's system row (``rollout_busy``, ``trainer_idle``: shares of the time
        since the previous row), on rank 0 when a system row is written; none by default."""
        return {}

    def before_checkpoint(self) -> None:  # noqa: B027 (a hook: may do nothing)
        """A checkpoint is about to be taken (before any part's state is read): bring the tenants' states up
        to date (a served job pauses the tenants of clients that went away). On every process: it may be a
        collective."""

    def state_dict(self) -> dict[str, Any]:
        """What this driver keeps beyond its tenants' feeds, for the job's checkpoint: a dict of its own
        top-level keys (none by default). Called on every process; rank 0's is written."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (a hook: may do nothing)
        """Take this driver's keys of a checkpoint's state (the whole state; older ones may lack them)."""

    def close(self) -> None:  # noqa: B027 (a hook: may do nothing)
        """The job is over (finished or stopped): end whatever this driver started (processes, threads)."""


DriverFactory = Callable[[JobParts], Driver]


class Drivers:
    """The job's drivers, in order of precedence: a tenant belongs to the first that accepts it."""

    def __init__(self, drivers: Sequence[Driver]) -> None:
        self.all = list(drivers)

    def __iter__(self) -> Iterator[Driver]:
        return iter(self.all)

    def of(self, tenant: Tenant) -> Driver:
        for d in self.all:
            if d.accepts(tenant):
                return d
        raise ValueError(f"no driver of this job takes tenant {tenant.name!r}")

    def feed(self, tenant: Tenant) -> Feed:
        """The :data:`~.tenants.FeedFor` of the pool: ``tenant``'s feed, made by its driver."""
        return self.of(tenant).feed(tenant)

    def heldout_losses(self, only: Sequence[str] | None = None) -> dict[str, float]:
        """Held-out losses of every driver's tenants (or of those ``only``). A collective."""
        out: dict[str, float] = {}
        for d in self.all:
            out |= d.heldout_losses(only)
        return out
