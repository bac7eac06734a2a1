"""An evaluation's work: every model's completions of every example in one batched generation, then every
metric over all of them in one call of the metrics' worker.

Given ``E`` examples, ``M`` models (the base, tenants of one :class:`~mlora_lab.lora.MultiLoRAModel`) and
``k = num_samples``, :func:`run_eval` makes ``E × M`` sampling requests of ``k`` samples each and hands them
to :func:`mlora_lab.sampling.sample` at once: the base computes once per token for all ``E·M·k`` rows, and
each row gets only its own adapter's delta (the base's rows get none). The metrics then score the
``E·M·k`` completions in one :class:`~mlora_lab.rl.rewards.RewardWorker` call, with the checks and the
isolation of reward functions (a metric that raises, hangs or returns the wrong count fails the evaluation
with its name, and cannot take the caller down).

No pandas here: the job runs the same work between steps (evaluations during training); the lab turns
its :class:`~mlora_lab.rundir.evals.EvalExample` rows into tables.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlora_lab.data import DataError, encode_prompt, read_rows
from mlora_lab.evals.metrics import PEER_COLUMNS, text_of
from mlora_lab.rl.prompts import EVAL_ROWS, chat_prompt
from mlora_lab.rl.rewards import RewardBatch, RewardWorker, parse_reward
from mlora_lab.rundir.evals import EvalExample
from mlora_lab.sampling import Completion, SampleRequest, sample
from mlora_lab.sources import source_name


@dataclass
class EvalPrompt:
    """One example: its prompt as given, its token ids, and its other columns (the metrics' arguments)."""

    prompt: Any
    ids: list[int]
    columns: dict[str, Any]

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def read_examples(source: Any, tokenizer: Any, limit: int | None = None) -> list[EvalPrompt]:
    """An evaluation's examples from any tenant data source: rows with ``prompt`` (a text, or TRL's
    conversational list of messages) or ``messages`` and any other columns, read and checked as prompt
    rows are (:func:`mlora_lab.data.read_rows`, named :data:`~mlora_lab.rl.prompts.EVAL_ROWS`: one ``DataError``, "bad evaluation
    data", naming every bad row).

    A ``messages`` row that ends with the assistant's turn (a supervised chat row) is asked the turns
    before it, and the assistant's answer becomes its ``reference`` column (unless it has one); so does a
    preference row's ``chosen`` answer (TRL's ``{"prompt", "chosen", "rejected"}``, texts or conversations:
    the prompt is asked, ``chosen`` and ``rejected`` stay columns). A column named as one of
    :data:`~mlora_lab.evals.metrics.PEER_COLUMNS` is refused (the evaluation passes those itself).
    ``limit``: the first ``limit`` rows only."""
    try:
        rows = read_rows(source, prompts=EVAL_ROWS)
    except DataError as e:
        raise DataError(e.problems, header=f"bad evaluation data {source_name(source)}") from None
    taken = [
        f"{source_name(source)} row {i}: column {k!r} has a name the evaluation itself passes every metric "
        f"function ({', '.join(PEER_COLUMNS)}): rename the column"
        for i, row in enumerate(rows)
        for k in PEER_COLUMNS
        if k in row
    ]
    if taken:
        raise DataError(taken, header=f"bad evaluation data {source_name(source)}")
    out = []
    for row in rows[:limit]:
        row = dict(row)
        chat = chat_prompt(row)
        if row.get("messages") is not None and chat and chat[-1].get("role") == "assistant" and len(chat) > 1:
            row.setdefault("reference", chat[-1].get("content", ""))
            row["messages"] = chat[:-1]
        if row.get("chosen") is not None and row.get("prompt") is not None:
            row.setdefault("reference", text_of(row["chosen"]))
        prompt, _, ids = encode_prompt(row, tokenizer)
        columns = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        out.append(EvalPrompt(prompt, ids, columns))
    return out


def metric_names(refs: Sequence[str]) -> list[str]:
    """The score column of each metric: its function's name (``exact_match``), numbered when two metrics
    share one (``score``, ``score_2``)."""
    names: list[str] = []
    for ref in refs:
        parsed = parse_reward(ref)
        base = parsed.function if not isinstance(parsed, str) else str(ref)
        base = base.removesuffix(".pkl")
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def run_eval(
    model: Any,
    tokenizer: Any,
    examples: Sequence[EvalPrompt],
    models: Sequence[tuple[str, str | None]],
    metrics: Sequence[str],
    *,
    names: Sequence[str] | None = None,
    num_samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    stop: Sequence[str] = (),
    step: int | None = None,
    timeout_s: float = 60.0,
    cwd: str | os.PathLike | None = None,
    any_running: Callable[[bool], bool] | None = None,
    sampler: Callable[..., list[Completion]] | None = None,
    baselines: Sequence[str] = (),
) -> list[EvalExample]:
    """Generate and score: ``models`` are ``(column, tenant of model or None for the base)``; ``metrics``
    are reward references (``"module:function"``, ``"file.py:function"``, a pickled function's file),
    scored under ``names`` (default :func:`metric_names`). Returns an :class:`EvalExample` per example,
    model and sample, model by model. ``temperature=0`` is greedy (then every sample is the same; ask
    ``num_samples > 1`` with a temperature for pass@k). A seeded request draws the same tokens whatever
    else is in the batch (:func:`mlora_lab.sampling.row_seed`), so an evaluation is reproducible.
    ``any_running``: :func:`mlora_lab.sampling.sample`'s, when several processes generate together.
    ``baselines``: columns of ``models`` whose completions the metrics compare others with
    (:class:`~mlora_lab.evals.metrics.WinRate`); then every metric call also gets, per completion, the
    :data:`~mlora_lab.evals.metrics.PEER_COLUMNS`: ``eval_model`` (its model's column) and
    ``eval_completions`` (``{baseline: its completion of the same example and sample}``)."""
    names = list(names) if names is not None else metric_names(metrics)
    requests = [
        SampleRequest(
            prompt=ex.ids,
            tenant=tenant,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_strings=tuple(stop),
            seed=seed + e,  # (the same example gets the same draws in every model's rows)
        )
        for _, tenant in models
        for e, ex in enumerate(examples)
    ]
    completions = (sampler or sample)(model, requests, tokenizer=tokenizer, any_running=any_running)
    out: list[EvalExample] = []
    texts, ids, prompts = [], [], []
    columns: dict[str, list[Any]] = {k: [] for ex in examples for k in ex.columns}
    for c in completions:
        m, e = divmod(c.request, len(examples))
        ex = examples[e]
        text = tokenizer.decode(c.tokens, skip_special_tokens=True)
        texts.append(text)
        ids.append(list(c.tokens))
        prompts.append(ex.prompt)
        for k in columns:
            columns[k].append(ex.columns.get(k))
        out.append(
            EvalExample(
                example=e,
                model=models[m][0],
                sample=c.index,
                prompt=ex.prompt,
                completion=text,
                scores={},
                columns=ex.columns,
                tokens=len(c.tokens),
                stop_reason=c.stop_reason,
            )
        )
    if metrics and out and baselines:
        made = {(r.model, r.example, r.sample): t for r, t in zip(out, texts, strict=True)}
        columns[PEER_COLUMNS[0]] = [r.model for r in out]
        columns[PEER_COLUMNS[1]] = [
            {b: made[(b, r.example, r.sample)] for b in baselines if (b, r.example, r.sample) in made}
            for r in out
        ]
    if metrics and out:
        # as TRL hands a chat prompt's completion to its reward functions: the assistant's message
        fed = [
            [{"role": "assistant", "content": t}] if examples[r.example].chat else t
            for t, r in zip(texts, out)
        ]
        worker = RewardWorker(list(metrics), timeout_s=timeout_s, cwd=cwd)
        try:
            result = worker(
                RewardBatch(
                    prompts,
                    fed,
                    ids,
                    columns,
                    {"global_step": step or 0, "max_steps": step or 0},
                    scores_may_be_missing=True,
                )
            )
        finally:
            worker.close()
        for row, values in zip(out, result.rewards, strict=True):
            row.scores = {n: (None if math.isnan(v) else v) for n, v in zip(names, values, strict=True)}
    return out
