"""The job's evaluations (``JobSpec.evals``): run between two steps, every ``every`` global steps and once
when training ends.

An evaluation is :func:`mlora_lab.evals.generate.run_eval`'s work inside the job: the base and every tenant
whose adapter is loaded (or the evaluation's ``models``) complete its prompts in ONE batched generation on
the job's own model, then rank 0 scores the completions in the evaluation's metrics worker. Every process
runs the same requests with the same seeds (under FSDP, TP and EP every forward is a collective), kept in
step by an ``any_running`` all-reduce, as the RL driver generates. Rank 0 then logs one
:class:`~mlora_lab.rundir.EvalMetricRow` per model and metric (its mean over the examples and the bootstrap
interval, :mod:`mlora_lab.evals.scores`) and keeps the latest completions and scores in
``<run>/evals/<name>/``.

An evaluation that fails (a metric that raises, hangs or returns the wrong count) never stops training: an
``eval_failed`` event row says why, and it is tried again at its next step. A model whose mean for a metric
is not a finite number (:func:`mlora_lab.evals.scores.failures`) logs its row without a value, and an
``eval_failed`` event names that metric and model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from mlora_lab.evals.generate import EvalPrompt, metric_names, read_examples, run_eval
from mlora_lab.evals.metrics import metric_ref
from mlora_lab.evals.scores import bootstrap, failures, per_example
from mlora_lab.job.agree import describe
from mlora_lab.job.recorder import Recorder
from mlora_lab.parallel import Collectives
from mlora_lab.rundir import EvalMetricRow, EventKind, RunDir, TenantState
from mlora_lab.rundir.evals import EvalMeta, write_eval
from mlora_lab.spec.parts import Eval


class JobEvals:
    """The evaluations of one job (every process holds one; rank 0 scores and writes)."""

    def __init__(
        self,
        evals: list[Eval],
        engine: Any,
        comm: Collectives,
        recorder: Recorder,
        run: RunDir | None,
        is_main: bool,
    ) -> None:
        self.evals = [e for e in evals if isinstance(e, Eval)]
        self.engine, self.comm, self.recorder, self.run, self.is_main = engine, comm, recorder, run, is_main
        self.sampler: Callable[..., Any] | None = (
            None  # (a job with rollout ranks samples there: its RL driver's)
        )
        self._examples: dict[str, list[EvalPrompt]] = {}
        self._last: dict[str, int] = {}  # the global step each one last ran at

    def due(self, step: int) -> list[Eval]:
        return [e for e in self.evals if e.every and step % e.every == 0 and self._last.get(e.name) != step]

    def after_step(self, step: int, states: dict[str, TenantState]) -> None:
        """Run the evaluations due at global step ``step`` (a collective: every process calls it)."""
        for e in self.due(step):
            self.run_one(e, step, states)

    def finish(self, step: int, states: dict[str, TenantState]) -> None:
        """Run every evaluation that has not run at this last step (a collective)."""
        for e in self.evals:
            if self._last.get(e.name) != step:
                self.run_one(e, step, states)

    def models(self, e: Eval, states: dict[str, TenantState]) -> list[tuple[str, str | None]]:
        """``(column, tenant)`` of the models ``e`` evaluates now: the base, then the tenants whose adapter
        is loaded (not a quarantined one), in the job's order, or those of ``e.models`` that are."""
        loaded = set(self.engine.model.tenants)
        here = [n for n, s in states.items() if n in loaded and s is not TenantState.FAILED]
        names = ["base", *here] if e.models is None else [m for m in e.models if m == "base" or m in here]
        return [(m, None if m == "base" else m) for m in names]

    def run_one(self, e: Eval, step: int, states: dict[str, TenantState]) -> None:
        """Evaluation ``e`` at global step ``step``: on every process the same generation, then rank 0
        scores, logs and saves it."""
        self._last[e.name] = step
        started = time.monotonic()
        try:
            if e.name not in self._examples:
                examples = read_examples(e.data, self.engine.tokenizer, e.limit)
                self._examples[e.name] = examples
            examples = self._examples[e.name]
            models = self.models(e, states)
            refs = [metric_ref(m) for m in e.metrics]
            any_running = self._any_running if self.comm.mesh is not None else None
            with torch.no_grad():
                rows = run_eval(
                    self.engine.model,
                    self.engine.tokenizer,
                    examples,
                    models,
                    refs if self.is_main else [],  # (rank 0 scores; the others only generate)
                    names=metric_names(refs),
                    num_samples=e.num_samples,
                    temperature=e.temperature,
                    top_p=e.top_p,
                    max_new_tokens=e.max_new_tokens,
                    seed=step,
                    stop=(),
                    step=step,
                    timeout_s=e.timeout_s,
                    any_running=any_running,
                    sampler=self.sampler,  # (a job with rollout ranks: there)
                )
            why = None
        except Exception as err:
            rows, why = [], f"evaluation {e.name!r} at step {step} raised {describe(err)}"
        why = self.comm.broadcast_object(why)  # (rank 0's scoring may fail alone)
        if not self.is_main:
            return
        if why is not None:
            self.recorder.event(EventKind.EVAL_FAILED, why)
            return
        names = [m for m, _ in models]
        metrics = metric_names(refs)
        for metric in metrics:
            mean, low, high, n = bootstrap(per_example(rows, names, metric, len(examples)), seed=step)
            failed = failures(metric, names, mean, low, high, n)
            for i, model in enumerate(names):
                value, lo, hi = _finite(mean[i]), _finite(low[i]), _finite(high[i])
                row = EvalMetricRow(
                    step=step, model=model, eval=e.name, metric=metric, value=value, low=lo, high=hi
                )
                row.n = int(n[i])
                self.recorder.log(row)
            for why in failed.values():  # (its row holds no value: the event says why)
                self.recorder.event(EventKind.EVAL_FAILED, f"evaluation {e.name!r} at step {step}: {why}")
        if self.run is not None:
            meta = EvalMeta(
                name=e.name, models=names, metrics=metrics, data=str(e.data), examples=len(examples)
            )
            meta.num_samples, meta.temperature, meta.top_p = e.num_samples, e.temperature, e.top_p
            meta.max_new_tokens, meta.seed, meta.step = e.max_new_tokens, step, step
            meta.seconds = time.monotonic() - started
            try:
                write_eval(self.run.root, meta, rows)
            except OSError as err:  # (a full disk: the rows above were logged; training goes on)
                self.recorder.event(EventKind.EVAL_FAILED, f"evaluation {e.name!r}: saving it failed ({err})")

    def _any_running(self, running: bool) -> bool:
        """Whether a sampling row still runs on any process (the all-reduce that keeps decode steps in step)."""
        return bool(self.comm.sum_over_world(torch.tensor([float(running)]))[0] > 0)


def _finite(v: float) -> float | None:
    return float(v) if v == v and abs(v) != float("inf") else None
