"""How an RL tenant's generations are drawn and scored, and how far ahead (``rl.max_staleness``).

**When a generation is sampled.** A tenant at optimiser step ``n`` whose current generation started at step
``n₀`` (``n₀ = n`` between windows) and holds ``q`` generations sampled ahead would start the next one at step
``n₀ + (q + 1)·μ`` (``μ = rl.num_iterations``; ``n₀ + q·μ`` when it has no current one). It is sampled *now*,
with adapter version ``n``, when ::

    n₀ + (q + 1)·μ − n  ≤  s = rl.max_staleness         (and it would start before max_steps)

so a generation's first step is at most ``s`` optimiser steps after the adapter that sampled it: its
staleness. ``s = 0`` samples exactly when a window starts: today's on-policy step, bit for bit. The rule
depends on the tenant's own steps only, so a tenant samples the same tokens with the same adapters alone or
beside others, and a resume (which keeps the generations sampled ahead, :class:`~.generation.Sampled`) equals
an uninterrupted run.

**Rewards in flight.** A generation's rewards are submitted to its tenant's reward worker as soon as it is
sampled (rank 0; one thread per tenant keeps its calls in order) and read when its window starts, so with
``s > 0`` a slow reward computes while this tenant's previous windows and every other tenant train. A reward
whose judge asks the job (``ml.Judge`` without ``base_url``) needs the job to answer it, so it is computed
when its window starts, while every process serves the judge's turns.

**The ratio of a stale generation** is against the sampler's own log-probs from its first step (TRL's
``AsyncGRPOTrainer``: ``π_θ / π_sampler``, clipped); with ``importance_sampling_correction`` the trainer's
log-probs at the window's start are the ratio's "old" and the sampler's enter the truncated IS weight
(:mod:`mlora_lab.rl.grpo`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from mlora_lab.job.agree import describe
from mlora_lab.job.drivers.rl.generation import Generation, Sampled, generation_seed, sampler_logps
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.grpo import advantages, combine_rewards, reward_problem
from mlora_lab.rl.prompts import as_completion
from mlora_lab.rl.rewards import RewardBatch, RewardError, RewardResult, RewardWorker, shown_reward
from mlora_lab.sampling import SampleRequest, sample

if TYPE_CHECKING:
    from mlora_lab.job.drivers.base import JobParts


class Drawing:
    """The RL driver's generations of single-turn tenants: sampled (ahead, within ``max_staleness``), scored
    (rewards in flight), made into the windows' :class:`~.generation.Generation` (a mixin of
    :class:`~.driver.RLDriver`: uses its engine, pool, comm, reward workers, ``_watch`` and ``_reference``)."""

    def __init__(self, parts: JobParts) -> None:
        super().__init__(parts)  # type: ignore[call-arg]
        # rank 0: each tenant's rewards in flight, by generation index, and the thread that computes them in order
        self.scoring: dict[str, dict[int, Future]] = {}
        self.scorers: dict[str, ThreadPoolExecutor] = {}
        self.held: set[str] = set()  # tenants that sit this step out, their next generation not ready yet

    def _due(self, t: TenantRun) -> int:
        """How many generations ``t`` samples now (the module docstring's rule)."""
        f, rl = t.feed, t.spec.rl
        mu, s = rl.num_iterations, rl.max_staleness
        start = t.step - (f.current.iteration if f.current is not None else 0)  # n₀
        q = len(f.ahead) + (f.current is not None)  # generations held (the next one starts q·μ after n₀)
        n = 0
        while start + (q + n) * mu - t.step <= s and start + (q + n) * mu < t.spec.max_steps:
            n += 1
        if f.current is None and not f.ahead and n == 0:  # (never none to train on: one at least)
            n = 1
        return n

    def _singles(self, tenants: list[TenantRun]) -> dict[str, str]:
        """Single-turn tenants: sample what is due, submit its rewards, and give each tenant between windows its
        next generation. Returns the tenants that failed, with why (the same on every process)."""
        failed: dict[str, str] = {}
        if self.rollout_ranks:  # (a rollout rank that refused a tenant's adapter: that tenant alone fails)
            if self.link is not None:
                self._poll()
            names = {t.name for t in tenants}
            failed |= {n: f"RolloutError: {why}" for n, why in self.refusals(names).items()}
            tenants = [t for t in tenants if t.name not in failed]
        due = {t.name: self._due(t) for t in tenants}
        failed |= self._draw([t for t in tenants if due[t.name]], due)
        live = [t for t in tenants if t.name not in failed]
        if self.pool.is_main:
            if self.link is not None:
                self._poll()
            for t in live:
                self._submit(t)
        return failed | self._take(self._ready([t for t in live if t.feed.current is None]))

    def _ready(self, tenants: list[TenantRun]) -> list[TenantRun]:
        """Of ``tenants`` (between windows), those whose next generation starts now. A tenant that samples ahead
        (``max_staleness > 0``) or on rollout ranks and whose generation is still being sampled or scored sits
        this step out (:attr:`held`), so it does not hold the others back: its results are its own whenever it
        trains. Unless nothing else would train: then the first waits (rank 0 decides; every process agrees)."""
        self.held: set[str] = set()
        flexible = [t for t in tenants if t.spec.rl.max_staleness > 0 or self.rollout_ranks]
        if not flexible or self.spec.lockstep:  # (lockstep: they wait, and a run repeats bit for bit)
            return tenants
        names = None
        if self.pool.is_main:
            ready = [t for t in tenants if t not in flexible or self._sampled_and_scored(t)]
            waiting = {t.name for t in tenants}
            if not ready and not any(t.name not in waiting for t in self.pool.running()):
                # (nothing else would train: wait for the first that is ready, then up to GATHER_S more for the
                # others, so that tenants whose generations come together keep training in one batch)
                start, until = time.perf_counter(), None
                while len(ready) < len(tenants) and (until is None or time.perf_counter() < until):
                    time.sleep(0.002)
                    if self.link is not None:
                        self._poll()
                    for t in tenants:
                        self._submit(t)
                    ready = [t for t in tenants if self._sampled_and_scored(t)]
                    if ready and until is None:
                        until = time.perf_counter() + GATHER_S
                self.idle_s += time.perf_counter() - start
            names = [t.name for t in ready]
        names = self.comm.broadcast_object(names)
        self.held = {t.name for t in tenants} - set(names)
        return [t for t in tenants if t.name in names]

    def _sampled_and_scored(self, t: TenantRun) -> bool:
        """Rank 0: whether ``t``'s oldest generation ahead is sampled and its rewards are in (or computed when it
        starts: a judge that asks the job)."""
        s = t.feed.ahead[0]
        if s.ticket is not None:
            return False
        future = self.scoring.get(t.name, {}).get(s.index)
        return future is None or future.done()

    # -- sampling ----------------------------------------------------------------------------------
    def _draw(self, tenants: list[TenantRun], due: dict[str, int]) -> dict[str, str]:
        """``due[t]`` new generations of each of ``tenants`` in ONE batched sampling (every request with its own
        adapter and seed), each kept as :class:`~.generation.Sampled` at the end of its tenant's ``ahead``."""
        if not tenants:
            return {}
        requests: list[SampleRequest] = []
        made: list[tuple[TenantRun, Sampled, int]] = []  # (tenant, its new generation, its first request)
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            for _ in range(due[t.name]):
                drawn = f.stream.take(t.spec.batch_size * t.spec.grad_accum)
                made.append((t, Sampled(f.generations, t.step, drawn, [], [], []), len(requests)))
                for b, p in enumerate(drawn):
                    requests.append(
                        SampleRequest(
                            prompt=f.prompts[p].ids,
                            tenant=t.name,
                            num_samples=rl.group_size,
                            max_new_tokens=rl.max_new_tokens,
                            temperature=rl.temperature,
                            top_p=rl.top_p,
                            top_k=rl.top_k or None,
                            stop_strings=tuple(rl.stop),
                            seed=generation_seed(t.spec.seed, f.generations, b),
                        )
                    )
                f.generations += 1
        if self.rollout_ranks:
            self._send(tenants, requests, made)
            return {}
        any_running = self._any_running if self.comm.mesh is not None else None
        try:
            completions = sample(
                self.engine.model, requests, tokenizer=self.engine.tokenizer, any_running=any_running
            )
        except Exception as e:
            why = f"its generation raised {describe(e)}"
            return {t.name: why for t in tenants}
        owner = {}
        for _, s, first in made:
            owner.update({r: s for r in range(first, first + len(s.prompts))})
        for c in completions:  # (in request order, then sample order: TRL's b·G + j)
            s = owner[c.request]
            s.tokens.append(list(c.tokens))
            s.logps.append(list(c.sampling_logprobs))
            s.truncated.append(c.stop_reason == "length")
        for t, s, _ in made:
            t.feed.ahead.append(s)
        return {}

    def _any_running(self, running: bool) -> bool:
        """Whether a sampling row still runs on any process (an all-reduce: every process calls it after
        every decode step, so all run the same forwards)."""
        return bool(self.comm.sum_over_world(torch.tensor([float(running)]))[0] > 0)

    # -- rewards -----------------------------------------------------------------------------------
    def _batch(self, t: TenantRun, s: Sampled) -> RewardBatch:
        """The reward functions' inputs for ``s`` (TRL's: every completion with its prompt and columns)."""
        f, rl = t.feed, t.spec.rl
        tok = self.engine.tokenizer
        rows = [f.prompts[p] for p in s.prompts for _ in range(rl.group_size)]
        texts = [tok.decode(c, skip_special_tokens=True) for c in s.tokens]
        keys = sorted({k for r in rows for k in r.columns})
        return RewardBatch(
            prompts=[r.prompt for r in rows],
            completions=[as_completion(r.prompt, x) for r, x in zip(rows, texts)],
            completion_ids=[list(c) for c in s.tokens],
            columns={k: [r.columns.get(k) for r in rows] for k in keys},
            state={"global_step": s.version, "max_steps": t.spec.max_steps},
        )

    def _worker(self, t: TenantRun) -> RewardWorker:
        worker = self.workers.get(t.name)
        if worker is None:
            rl = t.spec.rl
            worker = self.workers[t.name] = RewardWorker(rl.rewards, timeout_s=rl.reward_timeout_s)
        return worker

    def _submit(self, t: TenantRun, also: Sequence[Sampled] = ()) -> None:
        """Rank 0: every generation ``t`` holds ahead whose rewards are not in flight yet goes to its worker's
        thread, in order (after a resume: those the checkpoint kept). A worker whose judge asks the job is left
        for :meth:`_take` (its answers need every process serving)."""
        flying = self.scoring.setdefault(t.name, {})
        if self.rollout_ranks:
            with self.lock:
                if t.name in self.refused:  # (it fails at its next plan: nothing of it is scored any more)
                    return
        for s in [*also, *t.feed.ahead]:
            if s.index in flying:  # (in flight already)
                continue
            worker = self._worker(t)
            if t.name not in self.scorers:  # (its first call: the hello says whether a judge asks the job)
                try:
                    worker.ensure()
                except RewardError as e:
                    flying[s.index] = _failed(str(e))
                    continue
                self.scorers[t.name] = ThreadPoolExecutor(1, thread_name_prefix=f"mlora-rewards-{t.name}")
            if worker.asks_the_job:
                return
            if s.ticket is not None:  # (still being sampled on a rollout rank: its rewards wait for it there)
                flying[s.index] = self.scorers[t.name].submit(self._score_when_sampled, worker, t, s)
            else:
                flying[s.index] = self.scorers[t.name].submit(worker, self._batch(t, s))

    def _drop_scoring(self, name: str) -> None:
        """A tenant that stopped running: its rewards in flight are forgotten (its worker is being closed, which
        ends the call its thread is in) and its thread let go."""
        for future in self.scoring.pop(name, {}).values():
            future.cancel()
        scorer = self.scorers.pop(name, None)
        if scorer is not None:
            scorer.shutdown(wait=False, cancel_futures=True)

    def _take(self, tenants: list[TenantRun]) -> dict[str, str]:
        """Each of ``tenants`` (between windows) starts its oldest generation sampled ahead: its rewards (waited
        for on rank 0, broadcast), advantages, training rows, reference log-probs where ``beta > 0``. Returns the
        tenants that failed, with why (the same on every process)."""
        if not tenants:
            return {}
        taken = {t.name: t.feed.ahead.pop(0) for t in tenants}
        got: dict[str, RewardResult | str] = {}
        judged: list[tuple[TenantRun, RewardBatch]] = []
        if self.rollout_ranks:  # (rank 0 waits for what it still needs; every trainer gets the completions)
            if self.link is not None:
                for t in tenants:
                    self._poll(until=taken[t.name])
                    self._submit(t, [taken[t.name]])
            names = [t.name for t in tenants]
            answers = self.comm.broadcast_object(
                [(taken[n].tokens, taken[n].logps, taken[n].truncated) for n in names]
            )
            for n, answer in zip(names, answers):
                taken[n].fill(*answer)
            got |= {n: f"RolloutError: {why}" for n, why in self.refusals(set(names)).items()}
        if self.pool.is_main:
            for t in tenants:
                if t.name in got:
                    continue
                future = self.scoring.get(t.name, {}).pop(taken[t.name].index, None)
                if future is None:  # (a judge that asks the job: computed now, below)
                    judged.append((t, self._batch(t, taken[t.name])))
                    continue
                try:
                    got[t.name] = future.result()
                except RewardError as e:
                    got[t.name] = str(e)
                except (
                    Exception
                ) as e:  # (the worker was closed under its thread: said as the tenant's failure)
                    got[t.name] = describe(e)
        got = self.comm.broadcast_object(got)
        got |= self._score(judged)
        failed = {}
        made = []
        for t in tenants:
            result = got[t.name]
            if isinstance(result, str):  # (the loop says "its step raised ...")
                failed[t.name] = result if result.startswith("RolloutError: ") else f"RewardError: {result}"
                continue
            why = self._generation(t, taken[t.name], result)
            if why is not None:  # never advantages of 0 in silence: the tenant's fault, named
                failed[t.name] = f"RewardError: {why}"
                continue
            made.append(t)
        with_ref = [t for t in made if t.spec.rl.beta > 0]
        if with_ref:
            self._reference(with_ref)
        return failed

    def _generation(self, t: TenantRun, s: Sampled, got: RewardResult) -> str | None:
        """``s`` with its rewards made into ``t``'s current generation (advantages, rows); or why its rewards
        cannot train."""
        f, rl = t.feed, t.spec.rl
        weights = rl.reward_weights if rl.reward_weights is not None else [1.0] * len(rl.rewards)
        # (in float64: a reward of 1e308, or 1e20 weighted by 1e20, is a number there, not inf)
        per_function = torch.tensor(got.rewards, dtype=torch.float64)
        names = [shown_reward(r) for r in rl.rewards]
        why = reward_problem(per_function, weights, rl.group_size, rl.scale_rewards, names)
        if why is not None:
            return why
        R = combine_rewards(per_function, weights)
        A, stats = advantages(R, rl.group_size, rl.scale_rewards)
        R, A = R.float(), A.float()  # (A is finite in float32: reward_problem checked)
        g = Generation(
            index=s.index,
            prompts=s.prompts,
            group_size=rl.group_size,
            tokens=s.tokens,
            sampled_logps=s.logps,
            version=s.version,
            off_policy=rl.max_staleness > 0,
            truncated=s.truncated,
            rewards=R,
            advantages=A,
            per_function=per_function,
            logged=got.metrics,
            extra={k: v for k, v in got.extra.items() if len(v) == len(s.tokens)},
        )
        g.build(f.prompts, rl.mask_truncated_completions)
        if g.off_policy:  # (TRL's AsyncGRPO: the ratio is against the sampler from the first step)
            g.old_logps = sampler_logps(g)
        f.current = g
        self._watch(t, g, stats)
        return None

    def _score(self, calls: Sequence[tuple[TenantRun, RewardBatch]]) -> dict[str, RewardResult | str]:
        """Each call's rewards (``RewardResult``), or why it failed, on every process: computed on rank 0, every
        tenant's batch submitted to its reward worker before any answer is awaited, then broadcast. While they
        compute, a worker whose judge asks the job (:attr:`~mlora_lab.rl.rewards.RewardWorker.asks_the_job`: an
        ``ml.Judge`` with no ``base_url``) is answered by the job itself: its requests reach the agents' endpoint,
        which every process serves in batched waves (the base or any running tenant as the judge) until every
        answer is in. ``calls`` is rank 0's (the other processes pass none and follow)."""
        if not self.pool.is_main:
            if self.comm.broadcast_object(None):  # (rank 0 serves its judges meanwhile: follow its waves)
                self._rollouts().serve(None)
            return self.comm.broadcast_object(None)  # type: ignore[return-value]
        out: dict[str, RewardResult | str] = {}
        sent = []
        for t, batch in calls:
            worker = self._worker(t)
            try:
                worker.ensure()
                if worker.asks_the_job:
                    names = [x.name for x in self.pool.running()]
                    batch.endpoint = self._rollouts().judges(lambda names=names: names)
                worker.submit(batch)
                sent.append(t)
            except RewardError as e:
                out[t.name] = str(e)

        def collect() -> None:
            for t in sent:
                try:
                    out[t.name] = self.workers[t.name].result()
                except RewardError as e:
                    out[t.name] = str(e)

        judged = any(self.workers[t.name].asks_the_job for t in sent)
        if self.comm.broadcast_object(judged):
            thread = threading.Thread(target=collect, name="mlora-rewards", daemon=True)
            thread.start()
            self._rollouts().serve(thread.is_alive)
            thread.join()
        else:
            collect()
        return self.comm.broadcast_object(out)  # type: ignore[return-value]


GATHER_S = 0.02
"""When every waiting tenant's generation is late and nothing else would train, how long the loop waits past the
first that is ready for the others: generations sampled together stay trained together."""


def _failed(why: str) -> Future:
    """A future already failed with ``RewardError(why)``."""
    future: Future = Future()
    future.set_exception(RewardError(why))
    return future
