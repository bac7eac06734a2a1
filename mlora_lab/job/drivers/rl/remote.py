"""The RL driver's side of the rollout ranks (``Parallel.rollout_ranks``, :mod:`mlora_lab.job.rollout`): what it
sends them (each tenant's adapter where they hold an older version, then the generations due, dealt whole), what it
takes back (completions fill the generations waiting for them; a refused adapter fails its tenant), the sampler it
offers the job's other generations (agents' turns, evaluations, a served job's requests), and the shares of time
rank 0's system rows report. Every trainer runs the same calls in the same order (adapters are read on all of
them: under FSDP a collective); rank 0 alone holds the link and waits for answers, then gives them to the others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mlora_lab.job.drivers.rl.generation import RLFeed, Sampled
from mlora_lab.job.rollout import (
    AdapterRefused,
    AdapterUpdate,
    DropAdapter,
    RolloutLink,
    Samples,
    SampleWork,
    adapter_config,
    tensors_digest,
)
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.rewards import RewardError
from mlora_lab.rundir import TenantState
from mlora_lab.sampling import Completion, SampleRequest

if TYPE_CHECKING:
    from mlora_lab.job.drivers.base import JobParts
    from mlora_lab.parallel import Roles


class Remote:
    """Rollout ranks, from the trainers' side (a mixin of :class:`~.driver.RLDriver`: uses its engine, pool and
    comm; :class:`~.drawing.Drawing` calls :meth:`_send`, :meth:`_poll` and :meth:`_answered`)."""

    def __init__(self, parts: JobParts) -> None:
        super().__init__(parts)  # type: ignore[call-arg]
        # rollout ranks (Parallel.rollout_ranks): they sample; rank 0 holds the link to them
        roles = parts.roles
        self.rollout_ranks = roles.rollout_ranks if roles is not None else 0
        self.link = self.make_link(roles) if self.rollout_ranks and self.pool.is_main else None
        # rank 0: the link's receiving thread fills the generations it answers (their rewards start at once, on
        # their tenant's thread); what the loop reads of them, and the refusals, under this lock
        self.lock = threading.Lock()
        self.closing = threading.Event()  # (the job ends: rewards still waiting for a generation give up)
        if self.link is not None:
            self.link.on_reply = self._arrived
        # (every trainer) the adapter version each rollout rank holds, by tenant (a sampler snapshot's: its digest)
        self.sent: dict[str, int | str] = {}
        self.tickets = 0  # (every trainer) works sent so far; generations sent so far (their rollout rank)
        self.dealt = 0
        # rank 0: ticket → the generations it fills (tenant, generation, where its completions start in the answer)
        self.awaited: dict[int, list[tuple[TenantRun, Sampled, int]]] = {}
        self.refused: dict[str, str] = {}  # rank 0: tenants whose adapter a rollout rank refused, with why
        self.direct: dict[int, Samples | None] = {}  # rank 0: remote_sample's tickets and, once come, answers
        self.idle_s = 0.0  # rank 0: seconds the trainers waited for generations still being sampled
        self._shares_at = (time.monotonic(), 0.0, 0.0)  # (when, busy, idle) at the last system row

    def make_link(self, roles: Roles) -> RolloutLink:
        """Rank 0's link to the rollout ranks (a seam: the tests link to a rollout server in their own process)."""
        return RolloutLink(roles)

    # -- how many to sample ------------------------------------------------------------------------
    def _send(
        self,
        tenants: list[TenantRun],
        requests: list[SampleRequest],
        made: list[tuple[TenantRun, Sampled, int]],
    ) -> None:
        """The rollout ranks sample ``made`` (every trainer keeps them as waiting for their answer): each tenant's
        adapter first, where a rollout rank holds an older version (every trainer reads it: under FSDP a
        collective), then the generations, whole, dealt round robin, one :class:`~mlora_lab.job.rollout.SampleWork`
        per rollout rank (one rollout rank: the one batch the trainers would have sampled)."""
        for t in tenants:
            if self.sent.get(t.name) != t.step:
                tensors = self.engine.model.tenant_tensors(t.name)
                if self.link is not None:
                    update = AdapterUpdate(
                        t.name, t.step, adapter_config(t.spec), tensors, tensors_digest(tensors)
                    )
                    self.link.send_all(update)
                self.sent[t.name] = t.step
        works: dict[int, list[tuple[TenantRun, Sampled, int]]] = {}
        for t, s, first in made:
            works.setdefault(self.dealt % self.rollout_ranks, []).append((t, s, first))
            self.dealt += 1
        for j, parts in works.items():
            ticket, self.tickets = self.tickets, self.tickets + 1
            mine, fills, answers = [], [], 0
            for t, s, first in parts:
                fills.append((t, s, answers))  # (where its completions start in the answer)
                mine += requests[first : first + len(s.prompts)]
                answers += len(s.prompts) * t.spec.rl.group_size
                s.ticket = ticket
                t.feed.ahead.append(s)
            if self.link is not None:
                with self.lock:
                    self.awaited[ticket] = fills
                self.link.send(j, SampleWork(ticket, mine))

    def _poll(self, until: Sampled | None = None) -> None:
        """Rank 0: take the rollout ranks' answers that came (waiting until ``until`` is answered, if given):
        completions fill their generations; a refused adapter fails its tenant at the next plan; a work that
        failed, or a link that broke, fails the tenants that waited on it."""
        assert self.link is not None
        start = time.perf_counter()
        try:
            self._poll_until(until)
        finally:
            if until is not None:
                self.idle_s += time.perf_counter() - start

    def _poll_until(self, until: Sampled | None) -> None:
        assert self.link is not None
        while True:
            # (its answer comes through the receiving thread, which sets its event: wait on that, and take
            # what comes through the queue, refusals and a broken link, as it comes)
            if until is not None and until.ticket is not None:
                until.arrived.wait(0.005)
            for _, reply in self.link.replies(timeout=0.0):
                if isinstance(reply, Samples):
                    self._answered(reply)
                elif isinstance(reply, AdapterRefused):
                    self.refused.setdefault(reply.tenant, reply.why)
                elif reply is None:  # (the link broke: nothing more will come)
                    with self.lock:
                        for ticket in [*self.awaited, *(k for k, v in self.direct.items() if v is None)]:
                            self._answered(Samples(ticket, error=self.link.failed))
            if until is None or until.ticket is None:
                return

    def _arrived(self, reply: object) -> bool:
        """On the link's receiving thread: an answer to generations sent (not a :meth:`remote_sample` call's)
        fills them at once, so their rewards start while the loop trains. True when it took the answer."""
        if not isinstance(reply, Samples):
            return False
        with self.lock:
            if reply.ticket not in self.awaited:
                return False
            self._answered(reply)
        return True

    def _answered(self, reply: Samples) -> None:
        if reply.ticket in self.direct:  # (a remote_sample call waits for it)
            self.direct[reply.ticket] = reply
            return
        fills = self.awaited.pop(reply.ticket, [])
        for t, s, first in fills:
            if reply.error is not None:
                why = f"its generation {s.index} failed on a rollout rank: {reply.error}"
                self.refused.setdefault(t.name, why)
                s.fill([], [], [], error=why)
                continue
            got = reply.completions[first : first + len(s.prompts) * t.spec.rl.group_size]
            s.fill(
                [list(c.tokens) for c in got],
                [list(c.sampling_logprobs) for c in got],
                [c.stop_reason == "length" for c in got],
            )

    def sampler(self) -> Callable[..., list[Completion]] | None:
        """What samples for the job's other generations (agents' turns, judges, ``JobSpec.evals``): with rollout
        ranks :meth:`remote_sample`; ``None``: the trainers' own model (:func:`~mlora_lab.sampling.sample`)."""
        return self.remote_sample if self.rollout_ranks else None

    def remote_sample(self, model: Any, requests: Sequence[SampleRequest], **_: Any) -> list[Completion]:
        """:func:`~mlora_lab.sampling.sample`'s answer, sampled on a rollout rank (every trainer calls it, with
        the same requests; ``model`` and the local-sampling options are not used): each tenant named sent its
        adapter as of now where a rollout rank holds an older version (every trainer reads it: under FSDP a
        collective), the requests sent as one work, rank 0 waits for the answer and gives it to every trainer."""
        model = self.engine.model
        for name in sorted({r.tenant for r in requests if r.tenant is not None}):
            t = self.pool.tenants.get(name)
            if t is not None and t.state is TenantState.RUNNING:  # (a tenant: its version is its step)
                if self.sent.get(name) != t.step:
                    tensors = model.tenant_tensors(name)
                    if self.link is not None:
                        update = AdapterUpdate(
                            name, t.step, adapter_config(t.spec), tensors, tensors_digest(tensors)
                        )
                        self.link.send_all(update)
                    self.sent[name] = t.step
                continue
            # (another adapter in a slot, a served job's sampler snapshot: known by its tensors' digest)
            tensors = model.tenant_tensors(name)
            digest = tensors_digest(tensors)
            if self.sent.get(name) != digest:
                if self.link is not None:
                    ta = model.tenants[name]
                    config = {
                        "rank": ta.rank,
                        "alpha": ta.alpha,
                        "target_modules": ta.target_modules,
                        "target_parameters": list(ta.target_parameters),
                        "use_rslora": ta.use_rslora,
                    }
                    self.link.send_all(AdapterUpdate(name, -1, config, tensors, digest))
                self.sent[name] = digest
        ticket, self.tickets = self.tickets, self.tickets + 1
        j, self.dealt = self.dealt % self.rollout_ranks, self.dealt + 1
        answer: list[Completion] | str | None = None
        if self.link is not None:
            self.direct[ticket] = None
            self.link.send(j, SampleWork(ticket, list(requests)))
            start = time.perf_counter()
            while self.direct[ticket] is None:
                for _, reply in self.link.replies(timeout=None):
                    if isinstance(reply, Samples):
                        self._answered(reply)
                    elif isinstance(reply, AdapterRefused):
                        self.refused.setdefault(reply.tenant, reply.why)
                    elif reply is None:
                        with self.lock:
                            for k in [*self.awaited, *(k for k, v in self.direct.items() if v is None)]:
                                self._answered(Samples(k, error=self.link.failed))
            self.idle_s += time.perf_counter() - start
            reply = self.direct.pop(ticket)
            assert reply is not None
            answer = reply.error if reply.error is not None else reply.completions
        answer = self.comm.broadcast_object(answer)
        if isinstance(answer, str):
            raise RuntimeError(f"sampling on a rollout rank failed: {answer}")
        return answer  # type: ignore[return-value]

    def _settle(self) -> None:
        """Every generation sent to a rollout rank is answered, on every trainer (a checkpoint keeps them
        whole): rank 0 waits for the answers and gives them to the other trainers."""
        if not self.rollout_ranks:
            return
        pending = [(t, s) for t in self.pool.running() if isinstance(t.feed, RLFeed) for s in t.feed.ahead]
        pending = [(t, s) for t, s in pending if s.ticket is not None]
        if self.link is not None:
            for _, s in pending:
                self._poll(until=s)
        answers = self.comm.broadcast_object([(s.tokens, s.logps, s.truncated) for _, s in pending])
        for (_, s), got in zip(pending, answers):
            s.fill(*got)

    def system_shares(self) -> dict[str, float]:
        """Rank 0, a job with rollout ranks: their busy share and the trainers' idle share since the last call
        (a rollout rank's seconds of sampling count when its answer comes)."""
        if self.link is None:
            return {}
        at, busy, idle = self._shares_at
        now, busy_now = time.monotonic(), sum(self.link.busy_s)
        self._shares_at = (now, busy_now, self.idle_s)
        span = max(now - at, 1e-9)
        return {
            "rollout_busy": min((busy_now - busy) / (span * self.rollout_ranks), 1.0),
            "trainer_idle": min((self.idle_s - idle) / span, 1.0),
        }

    def before_checkpoint(self) -> None:
        self._settle()
        super().before_checkpoint()  # type: ignore[misc]

    def refusals(self, names: set[str]) -> dict[str, str]:
        """Rank 0's refusals (a rollout rank refused the tenant's adapter, or failed its generation) of ``names``,
        on every trainer (a collective)."""
        with self.lock:
            mine = {n: w for n, w in self.refused.items() if n in names}
        return self.comm.broadcast_object(mine)  # type: ignore[return-value]

    def _score_when_sampled(self, worker: Any, t: TenantRun, s: Sampled) -> Any:
        """On ``t``'s reward thread: ``s``'s rewards, once a rollout rank answered it (its failure, said)."""
        while not s.arrived.wait(0.5):
            if self.closing.is_set():
                raise RewardError("the job ended before its generation was sampled")
        if s.error is not None:
            raise RewardError(s.error)
        return worker(self._batch(t, s))

    def _drop_adapter(self, name: str) -> None:
        """A tenant that stopped running: the rollout ranks free its slot (a later resume sends it again)."""
        if self.sent.pop(name, None) is not None and self.link is not None:
            self.link.send_all(DropAdapter(name))
        with self.lock:
            self.refused.pop(name, None)
