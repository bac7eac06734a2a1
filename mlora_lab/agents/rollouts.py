"""One generation of every agent tenant starting a window: their episodes, played at once, every waiting turn of
every tenant sampled in one batched generation.

For each agent tenant ``t`` with ``B`` prompts and groups of ``G``, episode ``i = b·G + j`` (member ``j`` of
prompt ``b``) is registered at the endpoint as trajectory ``"<t>/<g>/<b>/<j>"`` and handed to ``t``'s env worker
(its own process: :mod:`mlora_lab.agents.envs`). Then, until every worker has answered::

    rank 0      polls each worker (never blocking: a worker that failed, hung past its deadline or answered
                garbage fails its tenant alone), takes the turns waiting at the endpoint (those arriving together:
                :meth:`~mlora_lab.agents.endpoint.AgentEndpoint.take`)
    broadcast   the wave's sampling requests (every process runs every forward: FSDP, TP and EP are collectives)
    all         sample(wave)                       one generation, each row with its tenant's adapter
    rank 0      answers each turn (the capture records its ids and the sampler's log-probs)

A **harness** tenant (``rl.harness``) has no worker: its episodes are published at the endpoint for an outside
program to claim, play and reward (:mod:`mlora_lab.agents.endpoint`); the loop serves its turns as any other
and waits until each of them has its reward, or fails the tenant ``rollout_timeout_s`` after publishing.

Each episode's trajectory is then its ledger (:mod:`mlora_lab.agents.ledger`) cut to ``seq_len``, with the
worker's reward, its parts and the conversation, broadcast to every process. An episode that never called the
model has nothing to train: its tenant fails, with the reason (as a reward function that returns nothing does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.agents.endpoint import AgentEndpoint, Expected, TenantTurns, Turn
from mlora_lab.agents.envs import EnvConfig, EnvError, EnvWorker, Episode, EpisodeResult
from mlora_lab.agents.ledger import trajectory_of
from mlora_lab.rl.trajectory import MODEL, Segment, Trajectory
from mlora_lab.sampling import sample
from mlora_lab.spec.parts import RL


@dataclass
class RolloutJob:
    """An agent tenant's generation to play: its examples in order (prompt ``b``), the first-turn seed of each,
    its group size."""

    tenant: str
    rl: RL
    generation: int
    examples: list[dict[str, Any]]
    seeds: list[int]
    group_size: int

    def tid(self, b: int, j: int) -> str:
        return f"{self.tenant}/{self.generation}/{b}/{j}"


@dataclass
class Played:
    """One episode, played: its trajectory (tokens, masks, the sampler's log-probs, the reward its env gave) and
    what its env said of it."""

    trajectory: Trajectory
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    stop: str = ""
    turns: int = 0
    forks: int = 0
    cut: bool = False  # longer than seq_len: cut to it (with its masks)


def _wire(p: Played) -> dict[str, Any]:
    t = p.trajectory
    return {
        "segments": [
            (s.source, list(s.tokens), None if s.logprobs is None else list(s.logprobs)) for s in t.segments
        ],
        "reward": t.reward,
        "truncated": t.truncated,
        "turns_messages": t.turns,
        "parts": p.parts,
        "metrics": p.metrics,
        "stop": p.stop,
        "turns": p.turns,
        "forks": p.forks,
        "cut": p.cut,
    }


def _unwire(d: dict[str, Any]) -> Played:
    segments = [
        Segment(src, tuple(toks), None if lps is None else tuple(lps)) for src, toks, lps in d["segments"]
    ]
    t = Trajectory(segments, d["reward"], None, d["truncated"], d["turns_messages"])
    return Played(t, d["parts"], d["metrics"], d["stop"], d["turns"], d["forks"], d["cut"])


class Rollouts:
    """The agent tenants' endpoint and env workers (rank 0) and the wave loop (every process).

    ``broadcast(obj)``: rank 0's ``obj`` on every process (identity on one process); ``any_running``: the decode
    steps' agreement hook of :func:`~mlora_lab.sampling.sample` (``None`` on one process)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        seq_len: int,
        main: bool,
        broadcast: Callable[[Any], Any],
        any_running: Callable[[bool], bool] | None = None,
        cwd: str | os.PathLike | None = None,
        on_keys: Callable[[str | None, dict[str, str]], None] | None = None,
        gather: dict[str, float] | None = None,
        sampler: Callable[..., list[Any]] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.seq_len, self.main = model, tokenizer, int(seq_len), main
        self.sampler = (
            sampler  # (a job with rollout ranks samples every wave there; None: this process samples)
        )
        # (an episode may grow past seq_len, up to what the model can attend to: trained cut, with a warning)
        config = getattr(getattr(model, "model", model), "config", None)
        self.context = max(self.seq_len, int(getattr(config, "max_position_embeddings", 0) or 0))
        self.broadcast, self.any_running, self.cwd = broadcast, any_running, cwd
        self.on_keys = on_keys
        """Rank 0, when a harness tenant is first registered: ``on_keys(base_url, {tenant: key})`` of every
        harness tenant (the RL driver writes the run's ``agents.json``); ``on_keys(None, {})`` when the endpoint
        stops."""
        self.gather = dict(gather or {})
        """How long a wave gathers turns: :meth:`~mlora_lab.agents.endpoint.AgentEndpoint.take`'s ``quiet_s`` and
        ``most_s`` (its defaults: a job, whose steps wait on the episodes); an evaluation, waiting on nothing
        else, gathers longer so that more episodes' turns share each generation."""
        self.endpoint: AgentEndpoint | None = None
        self.workers: dict[str, EnvWorker] = {}

    def close(self, keep: Sequence[str] = ()) -> None:
        """Stop the env workers of tenants not in ``keep`` (all of them, and the endpoint, when ``keep`` is empty)."""
        for name in [n for n in self.workers if n not in keep]:
            self.workers.pop(name).close()
        if not keep and self.endpoint is not None:
            published = self.endpoint.keys()
            self.endpoint.stop()
            self.endpoint = None
            if published and self.on_keys is not None:  # (the endpoint is gone: so are its keys)
                self.on_keys(None, {})

    def _endpoint(self) -> AgentEndpoint:
        """The endpoint, started at its first use (rank 0)."""
        if self.endpoint is None:
            self.endpoint = AgentEndpoint(self.tokenizer, self.context)
            self.endpoint.start()
        return self.endpoint

    def _worker(self, job: RolloutJob) -> EnvWorker | None:
        """The tenant's env worker (``None`` for a harness tenant: an outside program plays its episodes)."""
        self._endpoint()
        assert self.endpoint is not None
        rl = job.rl
        harness = rl.harness is True
        known = set(self.endpoint.keys())
        turns = TenantTurns(rl.max_new_tokens, rl.temperature, tuple(rl.stop), harness)
        key = self.endpoint.tenant(job.tenant, turns)
        if harness:
            keys = self.endpoint.keys()
            if self.on_keys is not None and set(keys) != known:
                self.on_keys(self.endpoint.url, keys)  # type: ignore[arg-type]
            return None
        worker = self.workers.get(job.tenant)
        if worker is None:
            config = EnvConfig(
                env=rl.env,
                tools=list(rl.tools),
                env_args=dict(rl.env_args),
                base_url=self.endpoint.url,
                api_key=key,
                model=job.tenant,
                max_turns=rl.max_turns,
                turn_timeout_s=rl.turn_timeout_s,
                rollout_timeout_s=rl.rollout_timeout_s,
            )
            worker = self.workers[job.tenant] = EnvWorker(config, cwd=self.cwd)
        return worker

    def start(self, jobs: Sequence[RolloutJob]) -> dict[str, str]:
        """Rank 0: start the env workers of ``jobs`` together and wait until each has loaded its env (answered an
        empty batch), so that their first turns reach one wave: a worker's start (its imports) takes longer than
        a wave waits for turns, which would give an evaluation's models their first turns alone. Returns why a
        job's worker could not start (its env does not load: :meth:`play` would fail it the same way)."""
        failed: dict[str, str] = {}
        starting: dict[str, EnvWorker] = {}
        for job in jobs:
            try:
                worker = self._worker(job)
                if worker is not None:
                    worker.submit([])
                    starting[job.tenant] = worker
            except EnvError as e:
                failed[job.tenant] = str(e)
        while starting:  # (each poll keeps the worker's start deadline: this ends)
            for name in list(starting):
                try:
                    done = starting[name].poll() is not None
                except EnvError as e:
                    failed[name], done = str(e), True
                if done:
                    del starting[name]
            time.sleep(0.01 if starting else 0)
        return failed

    def play(self, jobs: Sequence[RolloutJob]) -> dict[str, list[Played] | str]:
        """Every job's episodes (in order ``b·G + j``), or why its tenant failed; the same on every process."""
        results: dict[str, list[EpisodeResult] | str] = {}
        pending: dict[str, EnvWorker] = {}
        published: dict[str, tuple[list[str], float, float]] = {}  # harness: its ids, published at, deadline
        if self.main:
            for job in jobs:
                try:
                    worker = self._worker(job)
                    episodes = []
                    for b, (example, seed) in enumerate(zip(job.examples, job.seeds, strict=True)):
                        for j in range(job.group_size):
                            self.endpoint.expect(job.tid(b, j), Expected(job.tenant, seed, j))  # type: ignore[union-attr]
                            episodes.append(Episode(job.tid(b, j), example))
                    if worker is None:
                        self.endpoint.publish(job.tenant, [(e.trajectory_id, e.example) for e in episodes])  # type: ignore[union-attr]
                        now = time.monotonic()
                        ids = [e.trajectory_id for e in episodes]
                        published[job.tenant] = (ids, now, now + job.rl.rollout_timeout_s)
                    else:
                        worker.submit(episodes)
                        pending[job.tenant] = worker
                except EnvError as e:
                    results[job.tenant] = str(e)

        def waiting() -> bool:
            for name in list(pending):
                try:
                    got = pending[name].poll()
                except EnvError as e:
                    got = str(e)
                for tid in pending[name].take_ended():  # (no wave waits for an episode that ended)
                    self.endpoint.ended(tid)  # type: ignore[union-attr]
                if got is not None:
                    results[name] = got
                    del pending[name]
            for name in list(published):
                got = self._rewarded(*published[name])
                if got is not None:
                    results[name] = got
                    del published[name]
            return bool(pending or published)

        self.serve(
            waiting if self.main else None, lambda: {n for n, r in results.items() if isinstance(r, str)}
        )
        wired: dict[str, Any] | None = None
        if self.main:
            wired = {}
            for job in jobs:
                got = results.get(job.tenant)
                if not isinstance(got, list) and self.endpoint is not None:  # (its ledgers are not needed)
                    for b in range(len(job.examples)):
                        for j in range(job.group_size):
                            self.endpoint.finish(job.tid(b, j))
                played = self._played(job, got) if isinstance(got, list) else got or "its env gave no answer"
                wired[job.tenant] = played if isinstance(played, str) else [_wire(p) for p in played]
        return unwire(self.broadcast(wired))

    def serve(self, waiting: Callable[[], bool] | None, failed: Callable[[], set[str]] = set) -> None:
        """Answer the endpoint's turns in waves, every process in step, until ``waiting()`` (rank 0's: called
        before each wave; ``None`` on the other processes, which follow rank 0) says nothing is waited for any
        more. Each wave: rank 0 takes the turns waiting now (those of ``failed()`` tenants are refused), every
        process samples them in one batched generation, rank 0 answers each."""
        while True:
            turns: list[Turn] = []
            order = None
            if self.main:
                assert waiting is not None
                still = waiting()
                turns = self.endpoint.take(**self.gather) if still and self.endpoint is not None else []
                bad = failed()
                for turn in [x for x in turns if x.request.tenant in bad]:  # (a failed env's last turns)
                    turn.settle(RuntimeError("the tenant's env failed"))
                turns = [x for x in turns if x.request.tenant not in bad or x.trajectory is None]
                order = ([x.request for x in turns], not still)
            requests, finished = self.broadcast(order)
            if requests:
                try:
                    completions = (self.sampler or sample)(
                        self.model, requests, tokenizer=self.tokenizer, any_running=self.any_running
                    )
                except Exception as e:
                    for turn in turns:
                        turn.settle(e)
                    raise
                for turn, c in zip(turns, sorted(completions, key=lambda c: c.request), strict=False):
                    turn.settle(c)
            if finished:
                return

    def judges(self, models: Callable[[], Collection[str]]) -> tuple[str, str]:
        """The endpoint (started if it is not) and the judges' key: what a reward worker whose judge asks the job
        is sent (``RewardBatch.endpoint``); ``models()``: the tenants a judge may ask besides the base."""
        endpoint = self._endpoint()
        return endpoint.url, endpoint.judge_key(models)  # type: ignore[return-value]

    def _rewarded(self, ids: list[str], start: float, deadline: float) -> list[EpisodeResult] | str | None:
        """A harness tenant's published episodes as results once each has its reward; why it fails once the
        deadline has passed without; ``None`` while it waits."""
        got = self.endpoint.rewards(ids)  # type: ignore[union-attr]
        if len(got) == len(ids):
            return [
                EpisodeResult(
                    tid,
                    r["reward"],
                    {k: (float(s), float(w)) for k, (s, w) in r["parts"].items()},
                    r["metrics"],
                    r["messages"],
                    r["turns"],
                    r["stop"],
                )
                for tid, r in ((tid, got[tid]) for tid in ids)
            ]
        if time.monotonic() < deadline:
            return None
        return (
            f"{len(ids) - len(got)} of {len(ids)} episodes got no reward in {deadline - start:g} s "
            "(rl.rollout_timeout_s): is its harness program running?"
        )

    def _played(self, job: RolloutJob, results: list[EpisodeResult]) -> list[Played] | str:
        """The job's episodes as trajectories (rank 0: the ledgers are here), or why they cannot be trained."""
        by_id = {r.trajectory_id: r for r in results}
        out: list[Played] = []
        problems: list[str] = []
        for b in range(len(job.examples)):
            for j in range(job.group_size):
                tid = job.tid(b, j)
                led = self.endpoint.finish(tid) if self.endpoint is not None else None
                r = by_id.get(tid)
                if r is None:
                    problems.append(f"episode {tid} got no result from the env")
                    continue
                if led is None or not any(s.source == MODEL for s in led.segments):
                    problems.append(
                        f"episode {tid} never had an answer from the model (the env called no turn)"
                    )
                    continue
                t = trajectory_of(led, self.seq_len, r.reward)
                cut = led.n_tokens > self.seq_len
                out.append(Played(t, dict(r.parts), dict(r.metrics), r.stop, led.turns, led.forks, cut))
        if problems:
            return "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        return out


def unwire(got: dict[str, Any]) -> dict[str, list[Played] | str]:
    """:meth:`Rollouts.play`'s broadcast answer as :class:`Played` episodes."""
    return {k: v if isinstance(v, str) else [_unwire(d) for d in v] for k, v in got.items()}
