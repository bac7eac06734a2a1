"""Agent tenants of the RL driver (``rl.env`` / ``rl.tools``): a generation is ``B·k·G`` episodes played at once
(:mod:`mlora_lab.agents.rollouts`), scored, and trained as one row each, token-exactly: the model's tokens are the
sampler's ids, the loss covers them alone, and the importance ratio is against the sampler's log-probs
(:mod:`mlora_lab.rl.trajectory`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mlora_lab.job.agree import describe
from mlora_lab.job.drivers.rl.generation import Generation, generation_seed, sampler_logps
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.grpo import advantages, combine_rewards, reward_problem
from mlora_lab.rl.rewards import RewardBatch, RewardResult, RewardWorker, shown_reward
from mlora_lab.rundir import EventKind, EventRow
from mlora_lab.rundir.agents import remove_agents, write_agents

if TYPE_CHECKING:  # (the agents' endpoint loads starlette: only a job with agent tenants does)
    from mlora_lab.agents.rollouts import Played, Rollouts


class AgentParts:
    """The RL driver's agent tenants (a mixin of :class:`~mlora_lab.job.drivers.rl.driver.RLDriver`: it uses the
    driver's engine, pool, recorder, reward workers, ``_watch``, ``_reference`` and ``_any_running``)."""

    rollouts: Rollouts | None
    workers: dict[str, RewardWorker]

    def _rollouts(self) -> Rollouts:
        from mlora_lab.agents.rollouts import Rollouts

        if self.rollouts is None:
            self.rollouts = Rollouts(
                self.engine.model,
                self.engine.tokenizer,
                self.spec.seq_len,
                self.pool.is_main,
                self.comm.broadcast_object,
                self._any_running if self.comm.mesh is not None else None,
                on_keys=self._harness_keys,
                sampler=self.sampler(),  # (with rollout ranks, every wave is sampled there)
            )
        return self.rollouts

    def _harness_keys(self, base_url: str | None, keys: dict[str, str]) -> None:
        """Rank 0: the harness tenants' endpoint and keys, for the notebook (``run.agent_endpoint``), in the
        run's ``agents.json`` (0600; none without a run directory), removed when the endpoint stops."""
        if self.recorder.run is None:
            return
        if base_url is None:
            remove_agents(self.recorder.run)
        else:
            write_agents(self.recorder.run, base_url, keys)

    def _play(self, tenants: list[TenantRun]) -> dict[str, str]:
        """A new generation for each agent tenant of ``tenants``: ``batch_size·grad_accum`` examples, ``group_size``
        episodes of each, played at once (:mod:`mlora_lab.agents.rollouts`: every waiting turn of every tenant in
        one batched generation), then scored: the env's own rewards, and the tenant's reward functions over each
        whole conversation. Each episode trains as one row; its group's advantages are today's."""
        from mlora_lab.agents.rollouts import RolloutJob

        for t in tenants:
            self._template_check(t)
        jobs, drawn = [], {}
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            drawn[t.name] = f.stream.take(t.spec.batch_size * t.spec.grad_accum)
            rows = [f.prompts[p] for p in drawn[t.name]]
            examples = [
                ({"prompt": r.prompt} if not r.chat else {"messages": r.prompt}) | r.columns for r in rows
            ]
            seeds = [generation_seed(t.spec.seed, f.generations, b) for b in range(len(rows))]
            jobs.append(RolloutJob(t.name, rl, f.generations, examples, seeds, rl.group_size))
        try:
            played = self._rollouts().play(jobs)
        except Exception as e:
            return {t.name: f"its episodes' generation raised {describe(e)}" for t in tenants}
        scored = self._conversation_rewards(
            [t for t in tenants if isinstance(played[t.name], list)], drawn, played
        )
        failed, made = {}, []
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            f.generations += 1
            got = played[t.name]
            if isinstance(got, str):
                failed[t.name] = f"EnvError: {got}"
                continue
            columns, names, weights = [], [], []
            if rl.own_reward:  # (the env's, or the harness program's)
                columns.append(
                    [math.nan if p.trajectory.reward is None else float(p.trajectory.reward) for p in got]
                )
                names.append("env")
                weights.append(1.0)
            if rl.rewards:
                by_fn = scored.get(t.name)
                if isinstance(by_fn, str):
                    failed[t.name] = f"RewardError: {by_fn}"
                    continue
                columns += [list(col) for col in zip(*by_fn.rewards, strict=True)]
                names += [shown_reward(r) for r in rl.rewards]
                weights += rl.reward_weights if rl.reward_weights is not None else [1.0] * len(rl.rewards)
            per_function = torch.tensor(columns, dtype=torch.float64).T.reshape(len(got), len(columns))
            why = reward_problem(per_function, weights, rl.group_size, rl.scale_rewards, names)
            if why is not None:
                failed[t.name] = f"RewardError: {why}"
                continue
            R = combine_rewards(per_function, weights)
            A, stats = advantages(R, rl.group_size, rl.scale_rewards)
            trajectories = [p.trajectory for p in got]
            g = Generation(
                index=f.generations - 1,
                prompts=drawn[t.name],
                group_size=rl.group_size,
                tokens=[
                    [tok for s in tr.segments if s.source == "model" for tok in s.tokens]
                    for tr in trajectories
                ],
                truncated=[tr.truncated for tr in trajectories],
                rewards=R.float(),
                advantages=A.float(),
                per_function=per_function,
                logged=agent_metrics(got) | (scored[t.name].metrics if rl.rewards else {}),
                extra={
                    k: v
                    for k, v in (scored[t.name].extra if rl.rewards else {}).items()
                    if len(v) == len(got)
                },
                trajectories=trajectories,
                version=t.step,
                off_policy=True,
                episodes=[
                    {
                        "messages": list(p.trajectory.turns),
                        "turns": p.turns,
                        "stop": p.stop,
                        "parts": {k: [float(a), float(w)] for k, (a, w) in p.parts.items()},
                        "forks": p.forks,
                    }
                    for p in got
                ],
            )
            g.build(f.prompts, rl.mask_truncated_completions)
            g.old_logps = sampler_logps(g)
            f.current = g
            self._watch(t, g, stats)
            self._said_agent(t, got)
            made.append(t)
        with_ref = [t for t in made if t.spec.rl.beta > 0]
        if with_ref:
            self._reference(with_ref)
        return failed

    def _conversation_rewards(
        self, tenants: list[TenantRun], drawn: dict[str, list[int]], played: dict[str, Any]
    ) -> dict[str, RewardResult | str]:
        """Each agent tenant's reward functions over its episodes' conversations (``completions``: the messages
        from the model's first answer on; ``completion_ids``: the model's tokens), on rank 0, broadcast."""
        tenants = [t for t in tenants if t.spec.rl.rewards]
        if not tenants:
            return {}
        if not self.pool.is_main:
            return self._score([])
        calls = []
        for t in tenants:
            f, rl = t.feed, t.spec.rl
            rows = [f.prompts[p] for p in drawn[t.name] for _ in range(rl.group_size)]
            episodes = played[t.name]
            completions = []
            for p in episodes:
                messages = list(p.trajectory.turns)
                first = next(
                    (k for k, m in enumerate(messages) if m.get("role") == "assistant"), len(messages)
                )
                completions.append(messages[first:])
            keys = sorted({k for r in rows for k in r.columns})
            batch = RewardBatch(
                prompts=[r.prompt for r in rows],
                completions=completions,
                completion_ids=[
                    [x for s in p.trajectory.segments if s.source == "model" for x in s.tokens]
                    for p in episodes
                ],
                columns={k: [r.columns.get(k) for r in rows] for k in keys},
                state={"global_step": t.step, "max_steps": t.spec.max_steps},
            )
            calls.append((t, batch))
        return self._score(calls)

    def _template_check(self, t: TenantRun) -> None:
        """Once per tenant, before its first episodes: a chat template that is not append-only (a later turn's
        rendering changes an earlier one's tokens, as templates that drop earlier reasoning do) makes the turns
        fork; a tools tenant whose template ignores ``tools`` never shows the model its tools. Either is said in a
        ``warning`` row (the episodes still run: the ledger forks rather than trains on re-rendered tokens)."""
        from mlora_lab.agents import chat

        checked: set[str] = self.__dict__.setdefault("_templates_checked", set())
        if t.name in checked:
            return
        checked.add(t.name)
        tok, said = self.engine.tokenizer, []
        try:
            if not chat.prefix_preserving(tok):
                said.append(
                    "the tokenizer's chat template is not append-only (rendering a later turn changes the tokens of "
                    "an earlier one): its episodes' turns will fork, and only each episode's last branch trains"
                )
            if t.spec.rl.tools and not chat.supports_tools(tok):
                said.append(
                    "the tokenizer's chat template does not render tools=: the model is never shown its tools' "
                    "schemas (give the base a tool-calling template)"
                )
        except Exception as e:  # (a template that cannot render a probe conversation: its turns will say so)
            said.append(f"the tokenizer's chat template could not be checked: {describe(e)}")
        for message in said:
            print(f"[warning] tenant {t.name}: {message}", flush=True)
            self.recorder.log(
                EventRow(step=self.recorder.step, event=EventKind.WARNING, message=message, tenant=t.name)
            )

    def _said_agent(self, t: TenantRun, played: list[Played]) -> None:
        """Episodes cut to ``seq_len`` or forked (the program rewrote its history: only the last branch trains)
        are said, in a ``warning`` row: never silently."""
        cut = sum(p.cut for p in played)
        forked = sum(p.forks > 0 for p in played)
        said = []
        if cut:
            said.append(
                f"{cut} of its {len(played)} episodes were longer than seq_len={self.spec.seq_len} and were cut to "
                "it (their tokens past it are not trained)"
            )
        if forked:
            said.append(
                f"{forked} of its {len(played)} episodes sent a conversation that does not extend the one they were "
                "answered in (a rewritten history, or a chat template that is not append-only): only each one's "
                "last branch trains"
            )
        for message in said:
            print(f"[warning] tenant {t.name}: {message}", flush=True)
            self.recorder.log(
                EventRow(step=self.recorder.step, event=EventKind.WARNING, message=message, tenant=t.name)
            )


def agent_metrics(played: Sequence[Played]) -> dict[str, float]:
    """A generation's episode statistics (``agent/turns``, ``agent/forks``, ``agent/cut``: means over its
    episodes) and the mean of each reward part its env named (``rewards/<part>/mean``, unweighted)."""
    n = max(len(played), 1)
    out = {
        "agent/turns": sum(p.turns for p in played) / n,
        "agent/forks": sum(p.forks for p in played) / n,
        "agent/cut": sum(p.cut for p in played) / n,
    }
    parts: dict[str, list[float]] = {}
    for p in played:
        for name, (score, _weight) in p.parts.items():
            parts.setdefault(name, []).append(float(score))
    return out | {f"rewards/{k}/mean": sum(v) / len(v) for k, v in parts.items()}
