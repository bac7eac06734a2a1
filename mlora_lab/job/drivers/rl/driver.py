"""The RL driver itself (see :mod:`mlora_lab.job.drivers.rl` for the maths)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mlora_lab.data import IGNORE_INDEX, TenantStream
from mlora_lab.job.drivers.base import Driver, JobParts, Plan, StepResult
from mlora_lab.job.drivers.rl.agents import AgentParts
from mlora_lab.job.drivers.rl.drawing import Drawing
from mlora_lab.job.drivers.rl.generation import (
    Generation,
    RLFeed,
    completion_index,
    prompts_digest,
    read_prompts,
    sampler_logps,
)
from mlora_lab.job.drivers.rl.remote import Remote
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.grpo import (
    CLIPPED,
    LOGP_DIFF_METRIC,
    MIN_METRICS,
    RATIO_METRIC,
    RewardStats,
    nanstd,
    policy_loss,
)
from mlora_lab.rl.rewards import (
    RewardWorker,
    reward_names,
)
from mlora_lab.rundir import CompletionRow, EpisodeRecord, EventKind, EventRow
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant

if TYPE_CHECKING:  # (the agents' endpoint loads starlette: only a job with agent tenants does)
    from mlora_lab.agents.rollouts import Rollouts


class RLDriver(AgentParts, Drawing, Remote, Driver):
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
            self._drop_scoring(name)
        if self.rollouts is not None:  # (and its env worker)
            self.rollouts.close(keep=[t.name for t in active] or ["(none)"])
        running = {t.name for t in self.pool.running()}
        for name in [
            n
            for n in self.sent
            if n not in self.engine.model.tenants or (n in self.pool and n not in running)
        ]:
            self._drop_adapter(
                name
            )  # (its slot freed, or a tenant that stopped: the rollout ranks free theirs)
        if not active:
            return None
        # (the same on every process) single-turn tenants sample what is due, agents play between windows
        failed = self._singles([t for t in active if not t.spec.rl.agent])
        agents = [t for t in active if t.spec.rl.agent and t.feed.current is None]
        failed |= self._play(agents) if agents else {}
        active = [t for t in active if t.name not in self.held]  # (their generation is not ready: next step)
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
        self.closing.set()  # (rewards still waiting for a generation to be sampled give up)
        for name in list(self.workers):
            self.workers.pop(name).close()
            self._drop_scoring(name)
        if self.rollouts is not None:
            self.rollouts.close()
        if self.link is not None:  # (the rollout ranks leave their loops, and the job ends together)
            self.link.close()

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
        correct = rl.importance_sampling_correction
        # (an agent's episodes: the ratio is against the sampler's log-probs from the first step on; with the
        # sampling correction, against the trainer's at the first step, the sampler's entering through w)
        sampled = g.iteration > 0 or (g.off_policy and not correct)
        old = g.old_logps[local, :L].to(logps.device) if sampled and g.old_logps is not None else None
        ref = g.ref_logps[local, :L].to(logps.device) if rl.beta > 0 else None
        behaviour = None  # ℓ_s [n, L]: the sampler's log-probs, for the correction and the off-policy mask
        if correct or rl.off_policy_mask_threshold is not None:
            try:
                behaviour = sampler_logps(g)[local, :L].to(logps.device)
            except ValueError:  # (a generation restored from before they were kept: nothing to correct by)
                behaviour = (old if old is not None else logps).detach()
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
            importance_sampling_level=rl.importance_sampling_level,
            sampler_logps=behaviour,
            importance_sampling_correction=correct,
            importance_sampling_mode=rl.importance_sampling_mode,
            importance_sampling_clip_min=rl.importance_sampling_clip_min,
            importance_sampling_clip_max=rl.importance_sampling_clip_max,
            off_policy_mask_threshold=rl.off_policy_mask_threshold,
        )
        clip_key = "cispo_clip_ratio" if rl.loss_type == "cispo" else "clip_ratio/region_mean"
        for i, key in enumerate(("kl", clip_key)):
            if key in metrics:
                g.stats[2 * i : 2 * i + 2] += metrics[key].detach().double().cpu()
        if correct:  # (g.stats[4:]: SAMPLING_SUMS' pairs, then SAMPLING_EXTREMES, a minimum negated)
            g.stats = with_sampling_stats(g.stats)
            here = torch.cat(
                [metrics[k] for k in SAMPLING_SUMS]
                + [(-1 if k in MIN_METRICS else 1) * metrics[k][:1] for k in SAMPLING_EXTREMES]
            )
            here = here.detach().double().cpu()
            g.stats[4:8] += here[:4]
            g.stats[8:] = torch.maximum(g.stats[8:], here[4:])
        if (
            rl.num_iterations > 1 and g.iteration == 0 and (correct or not g.off_policy)
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
        # (kl sum, kl count, clipped sum, clipped count[, the sampling correction's sums, its extremes])
        if rl.importance_sampling_correction:  # (on every process alike, whatever rows each had)
            stats = with_sampling_stats(g.stats)
            totals = torch.cat([self.comm.sum_over_dp(stats[:8]), self.comm.max_over_world(stats[8:])])
        else:
            totals = self.comm.sum_over_dp(g.stats[:4])
        g.stats = torch.zeros(4, dtype=torch.float64)
        if (
            rl.num_iterations > 1
            and g.iteration == 0
            and (rl.importance_sampling_correction or not g.off_policy)
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
            extra=(
                reward_metrics(g, ["env"] * rl.own_reward + reward_names(rl.rewards, rl.reward_names))
                # (how many optimiser steps older the adapter that sampled it is than the one this step trained)
                | ({"staleness": float(t.step - 1 - g.version)} if rl.max_staleness else {})
                | sampling_extra(totals)
            )
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
                    adapter_version=g.version,
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


SAMPLING_SUMS = (f"{LOGP_DIFF_METRIC}/mean", f"{RATIO_METRIC}/mean")
"""The sampling correction's ``[sum, count]`` metrics, at ``Generation.stats[4:8]`` within a window."""
SAMPLING_EXTREMES = (f"{RATIO_METRIC}/min", f"{RATIO_METRIC}/max", f"{LOGP_DIFF_METRIC}/max")
"""Its extremes, at ``Generation.stats[8:11]`` (the minimum negated, so that all three reduce by max; −∞ until a
token is counted)."""


def with_sampling_stats(stats: torch.Tensor) -> torch.Tensor:
    """A window's stats with room for the sampling correction's (``[11]``: the four of every tenant, then the
    sums at 0 and the extremes at −∞), as they are if they have it already."""
    if len(stats) >= 11:
        return stats
    fresh = torch.tensor([0.0] * 4 + [-math.inf] * 3, dtype=torch.float64)
    return torch.cat([stats[:4].double(), fresh])


def sampling_extra(totals: torch.Tensor) -> dict[str, float]:
    """The sampling correction's metrics, named as TRL logs them (``sampling/importance_sampling_ratio/{min,
    mean,max}``, ``sampling/sampling_logp_difference/{mean,max}``), from a step's reduced stats (``totals
    [11]``; none when ``[4]``: no correction). Where nothing was counted, 0, as TRL."""
    if len(totals) < 11:
        return {}
    out = {}
    for i, key in enumerate(SAMPLING_SUMS):
        total, count = float(totals[4 + 2 * i]), float(totals[5 + 2 * i])
        out[key] = total / max(count, 1.0)
    counts = {RATIO_METRIC: float(totals[7]), LOGP_DIFF_METRIC: float(totals[5])}
    for i, key in enumerate(SAMPLING_EXTREMES):
        value = float(totals[8 + i]) * (-1 if key in MIN_METRICS else 1)
        out[key] = value if counts[key.rsplit("/", 1)[0]] > 0 else 0.0
    return {k: out[k] for k in sorted(out)}
