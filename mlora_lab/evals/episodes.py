"""An evaluation of agent environments: every chosen model plays the environment on every example, ``k``
episodes each, every waiting turn of every model sampled in one batched generation; then each episode is
scored by its environment's own reward and by the metrics over its whole conversation.

Given ``E`` examples, ``M`` models (the base, tenants of one :class:`~mlora_lab.lora.MultiLoRAModel`) and
``k = num_samples``, :func:`run_episodes` plays ``E·M·k`` episodes with the training's own machinery
(:class:`~mlora_lab.agents.rollouts.Rollouts` on one process): a :class:`~mlora_lab.agents.rollouts.RolloutJob`
per model, whose env worker calls the loopback endpoint with ``model=<its column>`` (``"base"`` samples with no
adapter); each wave takes the turns of every model's episodes waiting at once and samples them together, so
``M`` models of ``T`` turns need about ``T`` generations, not ``M·T``. Episode ``j`` of example ``e`` draws
its first turn with seed ``seed + e`` and sample index ``j`` in every model (later turns: a hash of both,
:func:`~mlora_lab.agents.endpoint.turn_seed`), so the models meet the same draws.

Scores, per episode, in this order:

- ``env``: the environment's own reward (a rollout function's return; none in the tool loop, whose episodes the
  metrics score), and ``env/<part>``: each part of its rubric (its score, unweighted), NaN where an episode
  had none;
- each metric, called as the RL driver calls reward functions on agent tenants: ``completions`` are the
  conversations from the model's first answer on (lists of messages), ``completion_ids`` the model's tokens,
  the example's columns by name, in one isolated :class:`~mlora_lab.rl.rewards.RewardWorker` call.

Each row's ``completion`` is the conversation after the prompt as text (:func:`conversation_text`); its
``columns`` hold the episode (:data:`EPISODE_COLUMN`: messages, turns, stop, rubric parts, forks).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlora_lab.evals.metrics import PEER_COLUMNS
from mlora_lab.rl.rewards import RewardBatch, RewardWorker
from mlora_lab.rundir.evals import EvalExample
from mlora_lab.text import brief

if TYPE_CHECKING:  # (the lab reads EPISODE_COLUMN without loading torch, which generate imports)
    from mlora_lab.evals.generate import EvalPrompt

ENV_COLUMN = "env"
"""The score column of the environment's own reward (the RL driver's name for it); its rubric's parts are
``env/<part>``."""
EPISODE_COLUMN = "episode"
"""The row column that holds each episode: ``{"messages", "turns", "stop", "parts", "forks"}``
(:data:`EPISODE_KEYS`). Saved among the row's columns; :class:`~mlora_lab.lab.evals.evaluation.Evaluation`
takes it out of them (an episode is its row's own, not its example's)."""
GATHER = {"gather_s": 1.0, "quiet_s": 0.1, "most_s": 1.0}
"""How long each wave may wait for the models' turns (:meth:`~mlora_lab.agents.endpoint.AgentEndpoint.take`:
until every episode still playing has its turn waiting, at most ``gather_s``): longer than a job's waves (an
evaluation waits on nothing else), so that every model's episodes, whose env workers answer at their own pace,
share the generations."""
EPISODE_KEYS = frozenset({"messages", "turns", "stop", "parts", "forks"})


def is_episode(value: Any) -> bool:
    """Whether ``value`` is an episode as :func:`run_episodes` keeps it in a row's :data:`EPISODE_COLUMN`."""
    return isinstance(value, dict) and value.keys() == EPISODE_KEYS


class EpisodeEvalError(RuntimeError):
    """An environment that failed for one of the models (it raised, hung, returned garbage, never called the
    model): the evaluation stops, naming the environment, the model and why."""


def conversation_text(messages: Sequence[dict[str, Any]]) -> str:
    """A conversation as text, a block per message: ``"<role>: <content>"``, an assistant's tool calls as
    ``name(arguments)`` lines after its content, a tool's result as ``"tool <name>: <content>"``."""
    blocks = []
    for m in messages:
        role = str(m.get("role", ""))
        content = m.get("content")
        if isinstance(content, list):  # (OpenAI content parts: their texts)
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines = [str(content)] if content else []
        for call in m.get("tool_calls") or ():
            fn = call.get("function", call) if isinstance(call, dict) else {}
            args = fn.get("arguments", "")
            args = args if isinstance(args, str) else json.dumps(args)
            lines.append(f"{fn.get('name', '?')}({args})")
        head = f"tool {m['name']}" if role == "tool" and m.get("name") else role
        blocks.append(f"{head}: " + "\n".join(lines))
    return "\n\n".join(blocks)


def after_prompt(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages from the model's first answer on: what an agent tenant's reward functions are given as a
    completion (the RL driver's ``completions``)."""
    first = next((k for k, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return list(messages[first:])


def run_episodes(
    model: Any,
    tokenizer: Any,
    examples: Sequence[EvalPrompt],
    models: Sequence[str],
    metrics: Sequence[str],
    *,
    env: str | None,
    tools: Sequence[str] = (),
    env_args: dict[str, Any] | None = None,
    names: Sequence[str] | None = None,
    num_samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    max_turns: int = 8,
    turn_timeout_s: float = 60.0,
    rollout_timeout_s: float = 600.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    seq_len: int | None = None,
    timeout_s: float = 60.0,
    cwd: str | os.PathLike | None = None,
    baselines: Sequence[str] = (),
    shown_env: str | None = None,
) -> tuple[list[EvalExample], list[str]]:
    """Play and score: ``models`` are the columns, ``"base"`` or adapters of ``model`` of those names; ``env``
    (a rollout function's reference) or ``tools`` (tool functions' references: the built-in tool loop), as an
    agent tenant's ``rl.env``/``rl.tools``; ``metrics``: reward references scored under ``names`` (default
    :func:`~mlora_lab.evals.generate.metric_names`) over the conversations. ``temperature=0`` is greedy.
    ``seq_len``: the longest episode kept whole (default the model's context).

    Returns ``(rows, score names)``: an :class:`EvalExample` per model, example and sample (model by model),
    and the score columns (``env``, ``env/<part>``... then ``names``). An environment that fails for a model
    raises :class:`EpisodeEvalError` naming it (``shown_env``: how; default ``env``)."""
    import torch

    from mlora_lab.agents.rollouts import RolloutJob, Rollouts
    from mlora_lab.evals.generate import metric_names
    from mlora_lab.spec.parts import RL

    names = list(names) if names is not None else metric_names(metrics)
    config = getattr(getattr(model, "model", model), "config", None)
    seq_len = seq_len or int(getattr(config, "max_position_embeddings", 0) or 2048)
    rl = RL(
        env=env,
        env_args=dict(env_args or {}),
        tools=list(tools),
        temperature=float(temperature),
        max_new_tokens=max_new_tokens,
        stop=list(stop),
        max_turns=max_turns,
        turn_timeout_s=turn_timeout_s,
        rollout_timeout_s=rollout_timeout_s,
        group_size=num_samples,
    )
    data = [({"messages": ex.prompt} if ex.chat else {"prompt": ex.prompt}) | ex.columns for ex in examples]
    jobs = [RolloutJob(m, rl, 0, data, [seed + e for e in range(len(examples))], num_samples) for m in models]
    rollouts = Rollouts(
        model, tokenizer, seq_len, main=True, broadcast=lambda x: x, cwd=cwd, gather=dict(GATHER)
    )
    try:
        failed = rollouts.start(jobs)  # (every model's worker up first: their first turns batch together)
        if not failed:
            with torch.no_grad():
                played = rollouts.play(jobs)
            failed = {m: got for m, got in played.items() if isinstance(got, str)}
    finally:
        rollouts.close()
    what = shown_env or (f"env {brief(env)}" if env is not None else "the tool loop")
    if failed:
        raise EpisodeEvalError(
            f"{what} failed for " + "; ".join(f"model {m!r}: {why}" for m, why in failed.items())
        )

    out: list[EvalExample] = []
    conversations, ids, prompts = [], [], []
    columns: dict[str, list[Any]] = {k: [] for ex in examples for k in ex.columns}
    parts: list[str] = []
    own = env is not None
    for m in models:
        for i, p in enumerate(played[m]):  # type: ignore[union-attr]
            e, j = divmod(i, num_samples)
            ex = examples[e]
            messages = list(p.trajectory.turns)
            said = after_prompt(messages)
            model_ids = [x for s in p.trajectory.segments if s.source == "model" for x in s.tokens]
            conversations.append(said)
            ids.append(model_ids)
            prompts.append(ex.prompt)
            for k in columns:
                columns[k].append(ex.columns.get(k))
            scores: dict[str, float | None] = {}
            if own:
                r = p.trajectory.reward
                scores[ENV_COLUMN] = None if r is None or not math.isfinite(r) else float(r)
            for part, (score, _) in p.parts.items():
                parts.append(part)
                scores[f"{ENV_COLUMN}/{part}"] = float(score)
            episode = {
                "messages": messages,
                "turns": p.turns,
                "stop": p.stop,
                "parts": {k: [float(a), float(w)] for k, (a, w) in p.parts.items()},
                "forks": p.forks,
            }
            out.append(
                EvalExample(
                    example=e,
                    model=m,
                    sample=j,
                    prompt=ex.prompt,
                    completion=conversation_text(said),
                    scores=scores,
                    columns={**ex.columns, EPISODE_COLUMN: episode},
                    tokens=len(model_ids),
                    stop_reason=p.stop,
                )
            )
    env_names = ([ENV_COLUMN] if own else []) + [f"{ENV_COLUMN}/{x}" for x in dict.fromkeys(parts)]
    for row in out:  # (an episode without a part of another's rubric: not scored on it)
        row.scores = {n: row.scores.get(n) for n in env_names}
    if metrics and out:
        if baselines:
            made = {(r.model, r.example, r.sample): c for r, c in zip(out, conversations, strict=True)}
            columns[PEER_COLUMNS[0]] = [r.model for r in out]
            columns[PEER_COLUMNS[1]] = [
                {b: made[(b, r.example, r.sample)] for b in baselines if (b, r.example, r.sample) in made}
                for r in out
            ]
        worker = RewardWorker(list(metrics), timeout_s=timeout_s, cwd=cwd)
        try:
            result = worker(
                RewardBatch(
                    prompts,
                    conversations,
                    ids,
                    columns,
                    {"global_step": 0, "max_steps": 0},
                    scores_may_be_missing=True,
                )
            )
        finally:
            worker.close()
        for row, values in zip(out, result.rewards, strict=True):
            row.scores |= {n: (None if math.isnan(v) else v) for n, v in zip(names, values, strict=True)}
    return out, env_names + (names if metrics else [])
