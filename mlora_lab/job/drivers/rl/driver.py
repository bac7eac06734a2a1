"""The RL driver itself (see :mod:`mlora_lab.job.drivers.rl` for the maths)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mlora_lab.data import IGNORE_INDEX, TenantStream
from mlora_lab.job.agree import describe
from mlora_lab.job.drivers.base import Driver, JobParts, Plan, StepResult
from mlora_lab.job.drivers.rl.agents import AgentParts
from mlora_lab.job.drivers.rl.generation import (
    Generation,
    RLFeed,
    completion_index,
    generation_seed,
    prompts_digest,
    read_prompts,
)
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.grpo import (
    CLIPPED,
    RewardStats,
    advantages,
    combine_rewards,
    nanstd,
    policy_loss,
    reward_problem,
)
from mlora_lab.rl.prompts import as_completion
from mlora_lab.rl.rewards import (
    RewardBatch,
    RewardError,
    RewardResult,
    RewardWorker,
    reward_names,
    shown_reward,
)
from mlora_lab.rundir import CompletionRow, EpisodeRecord, EventKind, EventRow
from mlora_lab.sampling import Completion, SampleRequest, sample
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant

if TYPE_CHECKING:  # (the agents' endpoint loads starlette: only a job with agent tenants does)
    from mlora_lab.agents.rollouts import Rollouts


class RLDriver(AgentParts, Driver):
    """RL tenants: generations, rewards, GRPO's loss (see the module docstring)."""

    def __init__(self, parts: JobParts) -> None:
        super().__init__(parts)
        self.comm = parts.engine.comm
        self.workers: dict[str, RewardWorker] = {}  # rank 0: one per RL tenant that is running
        self.rollouts: Rollouts | None = None  # agent tenants' endpoint and env workers (made at the first)

    def accepts(self, tenant: Tenant) -> bool:
        return tenant.rl is not None

    def feed(self, tenant: Tenant) -> RLFeed:
        e = self.engine
        prompts = read_prompts(tenant, e.tokenizer, self.spec.seq_len, e.vocab_rows)
        # (the stream's "examples" are the prompts' indices: it only counts and orders them)
        indices: list[Any] = list(range(len(prompts)))
        stream = TenantStream(indices, seed=tenant.seed, shuffle=tenant.shuffle)
        return RLFeed(prompts, stream, tenant.rl.mask_truncated_completions, digest=prompts_digest(prompts))

    def _mine(self, tenants: Sequence[TenantRun]) -> list[TenantRun]:
        return [t for t in tenants if isinstance(t.feed, RLFeed)]

    # -- a step's plan ---------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        active = self._mine(self.pool.running())
        for name in [n for n in self.workers if n not in {t.name for t in active}]:
            self.workers.pop(name).close()  # finished, failed, paused or removed: its worker is not needed
        if self.rollouts is not None:  # (and its env worker)
            self.rollouts.close(keep=[t.name for t in active] or ["(none)"])
        if not active:
            return None
        starting = [t for t in active if t.feed.current is None]  # the same on every process
        failed = self._generate(starting) if starting else {}
        rows = {}
        for t in active:
            f: RLFeed = t.feed
            if t.name not in failed:
                g = f.current
                rows[t.name] = [g.rows[i] for i in self._local(t, f.micro)]
            f.micro += 1  # (the micro-batch the loss below is of: micro - 1)
        temperatures = {t.name: t.spec.rl.temperature for t in active}  # TRL: log_softmax(z / temperature)
        complete = [t.name for t in active if t.feed.micro == t.spec.grad_accum]  # the same on every process
        return Plan(tenants=active, rows=rows, complete=complete, failed=failed, temperatures=temperatures)

    def close(self) -> None:
        """The job is over: every reward and env worker is killed, with what its functions started, and the
        agents' endpoint closed."""
        for name in list(self.workers):
            self.workers.pop(name).close()
        if self.rollouts is not None:
            self.rollouts.close()

    def _watch(self, t: TenantRun, g: Generation, stats: RewardStats) -> None:
        """A tenant that trains on nothing is said so, in a ``warning`` row (the dashboard shows it with the
        tenant; once a streak): every group scored alike for :data:`FLAT_GENERATIONS` generations in a row
        (GRPO learns from the differences within a group: its advantages are all 0; said "converged" when that
        reward is the best the tenant has had, :func:`converged`), or every completion masked (cut at
        ``max_new_tokens`` with ``mask_truncated_completions``: no token carries loss)."""
        f, rl = t.feed, t.spec.rl
        f.flat = f.flat + 1 if float(stats.frac_reward_zero_std) >= 1.0 else 0
        f.masked = f.masked + 1 if g.n_tokens == 0 else 0
        mean = float(stats.reward)
        if math.isfinite(mean):
            low, high = f.reward_range or (mean, mean)
            f.reward_range = (min(low, mean), max(high, mean))
        said = []
        if f.flat == FLAT_GENERATIONS:
            flat = (
                f"every group of its last {FLAT_GENERATIONS} generations scored one reward for all its "
                f"{rl.group_size} completions (mean {mean:.4g}"
            )
            if converged(mean, f.reward_range):
                said.append(
                    f"{flat}, the best it has had): it has converged, and with advantages of 0 it learns nothing "
                    "more; stop it, or give it harder prompts or a reward that tells its completions apart."
                )
            else:
                said.append(
                    f"{flat}): its advantages are 0 and it learns nothing; a reward that tells its completions "
                    "apart (or a higher temperature) would give it something to learn from."
                )
        if f.masked == 1:
            said.append(
                f"every completion of generation {g.index} was cut at max_new_tokens={rl.max_new_tokens} and "
                "mask_truncated_completions masks them all: this step trains on no token; raise "
                "max_new_tokens or turn mask_truncated_completions off"
            )
        for message in said:
            print(f"[warning] tenant {t.name}: {message}", flush=True)
            self.recorder.log(
                EventRow(step=self.recorder.step, event=EventKind.WARNING, message=message, tenant=t.name)
            )

    def _local(self, t: TenantRun, m: int) -> list[int]:
        """This process's completions of micro-batch ``m`` of ``t``'s generation (indices into it)."""
        part = t.feed.current.micro(m, t.spec.grad_accum)
        return [part[i] for i in self.engine.local_rows(range(len(part)))]

    def _generate(self, tenants: list[TenantRun]) -> dict[str, str]:
        """A new generation for each of ``tenants``: agent tenants play their episodes (:meth:`_play`), the
        others sample one completion per group member. Returns the tenants that failed, with why (the same on
        every process)."""
        agents = [t for t in tenants if t.spec.rl.agent]
        plain = [t for t in tenants if not t.spec.rl.agent]
        failed = self._sample(plain) if plain else {}
        return failed | (self._play(agents) if agents else {})

    def _sample(self, tenants: list[TenantRun]) -> dict[str, str]:
        """A new generation for each of ``tenants``: one batched sampling, rewards, advantages, rows (and
        the reference log-probs where ``beta > 0``). Returns the tenants that failed, with why (the same
        on every process)."""
        requests: list[SampleRequest] = []
        drawn: dict[str, list[int]] = {}
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            drawn[t.name] = f.stream.take(t.spec.batch_size * t.spec.grad_accum)
            for b, p in enumerate(drawn[t.name]):
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
        any_running = self._any_running if self.comm.mesh is not None else None
        try:
            completions = sample(
                self.engine.model, requests, tokenizer=self.engine.tokenizer, any_running=any_running
            )
        except Exception as e:
            why = f"its generation raised {describe(e)}"
            return {t.name: why for t in tenants}
        by_tenant: dict[str, list[Completion]] = {t.name: [] for t in tenants}
        for c in completions:
            by_tenant[requests[c.request].tenant].append(c)

        scored = self._rewards(tenants, drawn, by_tenant)
        failed = {}
        made = []
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            got = scored[t.name]
            f.generations += 1
            if isinstance(got, str):
                failed[t.name] = f"RewardError: {got}"  # (the loop says "its step raised ...")
                continue
            weights = rl.reward_weights if rl.reward_weights is not None else [1.0] * len(rl.rewards)
            # (in float64: a reward of 1e308, or 1e20 weighted by 1e20, is a number there, not inf)
            per_function = torch.tensor(got.rewards, dtype=torch.float64)
            names = [shown_reward(r) for r in rl.rewards]
            why = reward_problem(per_function, weights, rl.group_size, rl.scale_rewards, names)
            if why is not None:  # never advantages of 0 in silence: the tenant's fault, named
                failed[t.name] = f"RewardError: {why}"
                continue
            R = combine_rewards(per_function, weights)
            A, stats = advantages(R, rl.group_size, rl.scale_rewards)
            R, A = R.float(), A.float()  # (A is finite in float32: reward_problem checked)
            cs = by_tenant[t.name]
            g = Generation(
                index=f.generations - 1,
                prompts=drawn[t.name],
                group_size=rl.group_size,
                tokens=[list(c.tokens) for c in cs],
                truncated=[c.stop_reason == "length" for c in cs],
                rewards=R,
                advantages=A,
                per_function=per_function,
                logged=got.metrics,
                extra={k: v for k, v in got.extra.items() if len(v) == len(cs)},
            )
            g.build(f.prompts, rl.mask_truncated_completions)
            f.current = g
            self._watch(t, g, stats)
            made.append(t)
        with_ref = [t for t in made if t.spec.rl.beta > 0]
        if with_ref:
            self._reference(with_ref)
        return failed

    def _any_running(self, running: bool) -> bool:
        """Whether a sampling row still runs on any process (an all-reduce: every process calls it after
        every decode step, so all run the same forwards)."""
        return bool(self.comm.sum_over_world(torch.tensor([float(running)]))[0] > 0)

    def _rewards(
        self, tenants: list[TenantRun], drawn: dict[str, list[int]], by_tenant: dict[str, list[Completion]]
    ) -> dict[str, RewardResult | str]:
        """Each tenant's rewards (``rewards [N][F]``, NaN: none; and what its functions logged), or why its
        call failed: computed on rank 0 (every tenant's batch submitted before any answer is awaited),
        broadcast to every process."""
        if not self.pool.is_main:
            return self._score([])
        tok = self.engine.tokenizer
        calls = []
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            rows = [f.prompts[p] for p in drawn[t.name] for _ in range(rl.group_size)]
            texts = [tok.decode(c.tokens, skip_special_tokens=True) for c in by_tenant[t.name]]
            keys = sorted({k for r in rows for k in r.columns})
            batch = RewardBatch(
                prompts=[r.prompt for r in rows],
                completions=[as_completion(r.prompt, x) for r, x in zip(rows, texts)],
                completion_ids=[list(c.tokens) for c in by_tenant[t.name]],
                columns={k: [r.columns.get(k) for r in rows] for k in keys},
                state={"global_step": t.step, "max_steps": t.spec.max_steps},
            )
            calls.append((t, batch))
        return self._score(calls)

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
            rl = t.spec.rl
            worker = self.workers.get(t.name)
            if worker is None:
                worker = self.workers[t.name] = RewardWorker(rl.rewards, timeout_s=rl.reward_timeout_s)
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

    def _reference(self, tenants: list[TenantRun]) -> None:
        """``beta > 0``: each generation's completion log-probs under the base model alone (at the tenant's
        temperature, as TRL's reference): one forward of their rows with no adapter per temperature
        (every process its share; a collective), gathered into ``[N, L]``."""
        for temperature in sorted({t.spec.rl.temperature for t in tenants}):
            self._reference_at(temperature, [t for t in tenants if t.spec.rl.temperature == temperature])

    @torch.no_grad()
    def _reference_at(self, temperature: float, tenants: list[TenantRun]) -> None:
        local = {t.name: self.engine.local_rows(range(len(t.feed.current))) for t in tenants}
        groups = [(None, [t.feed.current.rows[i] for i in local[t.name]]) for t in tenants]
        _, token_loss = self.engine.forward(groups, {None: temperature})
        start = 0
        for t in tenants:
            g, mine = t.feed.current, local[t.name]
            ref = torch.zeros(len(g), g.max_len, dtype=torch.float32)
            if mine:
                index, valid = completion_index(g, mine, token_loss.device)
                part = -token_loss[start : start + len(mine)].gather(1, index) * valid
                ref[mine, : part.shape[1]] = part.float().cpu()
            start += len(mine)
            g.ref_logps = self.comm.sum_over_dp(ref).float()

    # -- the loss --------------------------------------------------------------------------------
    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """GRPO's loss of this process's rows of ``t``'s generation (:func:`~mlora_lab.rl.grpo.policy_loss`
        with the window's counts: every completion and completion token on every process)."""
        g: Generation = t.feed.current
        rl: RL = t.spec.rl
        local = self._local(t, t.feed.micro - 1)
        index, valid = completion_index(g, local, token_loss.device)
        logps = -token_loss.gather(1, index)  # [n, L]
        mask = valid & (labels[:, 1:].gather(1, index) != IGNORE_INDEX)
        L = logps.shape[1]
        # (an agent's episodes: the ratio is against the sampler's log-probs from the first step on)
        sampled = g.iteration > 0 or g.trajectories is not None
        old = g.old_logps[local, :L].to(logps.device) if sampled and g.old_logps is not None else None
        ref = g.ref_logps[local, :L].to(logps.device) if rl.beta > 0 else None
        loss, metrics = policy_loss(
            logps,
            old,
            g.advantages[local].to(logps.device),
            mask,
            loss_type=rl.loss_type,
            epsilon_low=rl.epsilon,
            epsilon_high=rl.epsilon_high,
            beta=rl.beta,
            ref_logps=ref,
            max_completion_length=rl.max_new_tokens,
            num_sequences=len(g),
            num_tokens=float(g.n_tokens),
            num_micro_batches=self.comm.dp_size * t.spec.grad_accum,
        )
        clip_key = "cispo_clip_ratio" if rl.loss_type == "cispo" else "clip_ratio/region_mean"
        for i, key in enumerate(("kl", clip_key)):
            if key in metrics:
                g.stats[2 * i : 2 * i + 2] += metrics[key].detach().double().cpu()
        if (
            rl.num_iterations > 1 and g.iteration == 0 and g.trajectories is None
        ):  # later ratios: against these
            if g.old_local is None:
                g.old_local = torch.zeros(len(g), g.max_len, dtype=torch.float32)
            if local:
                g.old_local[local, : logps.shape[1]] = logps.detach().float().cpu()
        return loss

    # -- after its optimiser step ----------------------------------------------------------------
    def stepped(self, t: TenantRun, result: StepResult) -> None:
        """Counters, the kept old log-probs, rows; the next window draws a new generation once this one
        had its ``num_iterations`` steps. Collectives (called on every process, tenant by tenant)."""
        f: RLFeed = t.feed
        g: Generation = f.current
        rl: RL = t.spec.rl
        f.micro = 0
        totals = self.comm.sum_over_dp(g.stats)  # (kl sum, kl count, clipped sum, clipped count)
        g.stats = torch.zeros(4, dtype=torch.float64)
        if (
            rl.num_iterations > 1 and g.iteration == 0 and g.trajectories is None
        ):  # later ratios: against these
            old = g.old_local if g.old_local is not None else torch.zeros(len(g), g.max_len)
            g.old_logps, g.old_local = self.comm.sum_over_dp(old).float(), None
        g.iteration += 1
        t.tokens_seen += g.n_tokens
        self._log(t, g, result, totals)
        if g.iteration >= rl.num_iterations:
            f.current = None
        if t.step >= t.spec.max_steps:
            self.pool.finish(t)

    def _log(self, t: TenantRun, g: Generation, result: StepResult, totals: torch.Tensor) -> None:
        rl: RL = t.spec.rl
        scored = g.rewards[~torch.isnan(g.rewards)]
        row = self.log_train(
            t,
            result,
            g.n_tokens,
            rows_seen=t.feed.prompts_taken(),
            tokens_seen=t.tokens_seen,
            reward=float(scored.mean()) if len(scored) else None,
            reward_std=float(nanstd(g.rewards)) if len(scored) > 1 else None,
            completion_len=sum(map(len, g.tokens)) / len(g),
            kl=float(totals[0] / max(float(totals[1]), 1.0)) if rl.beta > 0 else None,
            clip_ratio=float(totals[2] / max(float(totals[3]), 1.0))
            if rl.loss_type in (*CLIPPED, "cispo")
            else None,
            extra=reward_metrics(g, ["env"] * rl.own_reward + reward_names(rl.rewards, rl.reward_names))
            or None,
        )
        if row is None:  # (not a step log_every logs: its completions are not logged either)
            return
        tok = self.engine.tokenizer
        G = g.group_size
        # one completion per prompt first, then the prompts' second ones, ...
        order = [b * G + j for j in range(G) for b in range(len(g.prompts))][: rl.log_completions]
        for i in order:
            reward = float(g.rewards[i])
            self.recorder.log(
                CompletionRow(
                    step=self.recorder.step,
                    tenant=t.name,
                    tenant_step=t.step,
                    prompt=t.feed.prompts[g.prompts[i // G]].text,
                    completion=g.completion_text(i, tok),
                    reward=reward if math.isfinite(reward) else None,
                    extra={k: v[i] for k, v in g.extra.items()} or None,
                    episode=None if g.episodes is None else EpisodeRecord(**g.episodes[i]),
                )
            )


FLAT_GENERATIONS = 5
"""Generations in a row whose every group scored alike before an RL tenant is warned it learns nothing."""


def converged(mean: float, reward_range: tuple[float, float] | None) -> bool:
    """Whether flat rewards of ``mean`` are a tenant's best, reached by learning: at the top of the range of its
    generations' mean rewards (within float rounding), and above its bottom (flat from the start is not)."""
    if reward_range is None or not math.isfinite(mean):
        return False
    low, high = reward_range
    tol = 1e-6 * max(1.0, abs(mean))
    return mean >= high - tol and mean > low + tol


def reward_metrics(g: Generation, names: Sequence[str]) -> dict[str, float | None]:
    """A generation's ``rewards/<fn>/mean`` and ``rewards/<fn>/std`` of each reward function (over the
    completions it scored; ``fn`` its name, :func:`~mlora_lab.rl.rewards.reward_names`), as TRL logs them,
    then what the functions logged with ``log_metric``."""
    out: dict[str, float | None] = {}
    if g.per_function is not None:
        for f, key in enumerate(names):
            col = g.per_function[:, f]
            scored = col[~torch.isnan(col)]
            out[f"rewards/{key}/mean"] = float(scored.mean()) if len(scored) else None
            out[f"rewards/{key}/std"] = float(nanstd(col)) if len(scored) > 1 else None
    return out | dict(g.logged)
