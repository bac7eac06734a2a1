"""Evaluations during training (``JobSpec.evals``): they run between steps in one batched generation of the
base and every tenant, log ``eval_metric`` rows, keep their latest table in the run, and give what
``ml.evaluate`` gives on the same adapters afterwards."""

from __future__ import annotations

import json

import pytest
from conftest import task_rows, write_jsonl

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.lab.launch import prepare_run
from mlora_lab.rundir import EvalMetricRow, EventKind, EventRow
from mlora_lab.spec.job import JobSpec
from mlora_lab.validate import problems

PROMPTS = [
    {"prompt": "reverse: red cat\n", "answer": "tac der"},
    {"prompt": "upper: sun\n", "answer": "SUN"},
    {"prompt": "reverse: dog\n", "answer": "god"},
]


def word_count(prompts, completions, **kwargs):
    """A notebook's metric (pickled into the run at launch)."""
    return [float(len(c.split())) for c in completions]


def two_tenants(tmp_path, steps: int = 4) -> list[ml.Tenant]:
    return [
        ml.Tenant(name="rev", data=write_jsonl(tmp_path / "rev.jsonl", task_rows("reverse", 16)), rank=4,
                  lr=1e-2, batch_size=2, max_steps=steps, target_modules=["q_proj", "v_proj"]),
        ml.Tenant(name="up", data=write_jsonl(tmp_path / "up.jsonl", task_rows("upper", 16)), rank=8,
                  lr=5e-3, batch_size=2, max_steps=steps - 1, target_modules=["q_proj", "v_proj"]),
    ]  # fmt: skip


def test_evaluations_while_training_log_rows_and_equal_ml_evaluate_after(llama_path, tmp_path):
    quick = ml.Eval(name="quick", data=PROMPTS, metrics=["exact_match", "contains", word_count], every=2,
                    max_new_tokens=5)  # fmt: skip
    base_only = ml.Eval(name="base-only", data=write_jsonl(tmp_path / "p.jsonl", PROMPTS), metrics=["contains"],
                        models=["base", "up"], max_new_tokens=3)  # fmt: skip
    spec = JobSpec(base_model=llama_path, tenants=two_tenants(tmp_path), seq_len=32, max_rank=8,
                   evals=[quick, base_only], output_dir=str(tmp_path / "run"))  # fmt: skip
    run = prepare_run(spec)
    written = json.loads(run.job.read_text())["evals"]
    assert written[0]["data"] == "evals/quick/data.jsonl"  # rows held in memory: written into the run
    assert written[0]["metrics"][2].endswith("word_count.pkl:word_count")
    trainer = Trainer(JobSpec.load(run.job), run_dir=run.root)
    trainer.train()
    trainer.close()

    rows = [r for r in trainer.history if isinstance(r, EvalMetricRow)]
    assert not [r for r in trainer.history if isinstance(r, EventRow) and r.event is EventKind.EVAL_FAILED]
    quick_rows = [r for r in rows if r.eval == "quick"]
    assert sorted({r.step for r in quick_rows}) == [2, 4]  # every 2 steps; the last step (4) once
    assert {(r.model, r.metric) for r in quick_rows if r.step == 2} == {
        (m, k) for m in ("base", "rev", "up") for k in ("exact_match", "contains", "word_count")
    }
    assert all(r.n == len(PROMPTS) and r.low <= r.value <= r.high for r in quick_rows)
    assert {(r.step, r.model) for r in rows if r.eval == "base-only"} == {(4, "base"), (4, "up")}
    logged = [r for r in ml.attach(run.root).rows() if isinstance(r, EvalMetricRow)]
    assert logged == rows  # (in metrics.jsonl as in the job's memory)

    # the table the job kept at its last step = ml.evaluate on the adapters it saved, with the same seed
    kept = ml.load_evaluation(run.root, "quick")
    assert kept.meta.step == 4 and kept.models == ["base", "rev", "up"]
    after = ml.evaluate(run.root, PROMPTS, ["exact_match", "contains", word_count], max_new_tokens=5, seed=4,
                        save=False)  # fmt: skip
    assert after.examples().completion.tolist() == kept.examples().completion.tolist()
    assert after.scores().round(12).equals(kept.scores().round(12))
    last = {(r.model, r.metric): r.value for r in quick_rows if r.step == 4}
    for model in kept.models:
        for metric in kept.metrics:
            assert last[model, metric] == pytest.approx(kept.scores().loc[model, metric], nan_ok=True)

    # the lab reads them: a table, ml.compare's curves (the base's too), ml.summary's latest scores
    handle = ml.attach(run.root)
    table = handle.eval_metrics()
    assert len(table) == len(rows) and set(table["eval"]) == {"quick", "base-only"}
    fig = ml.compare(handle, metric="eval/quick/word_count", x="global step")
    drawn = {
        line.get_label(): list(line.get_xdata()) for line in fig.axes[0].lines if line.lab_role == "main"
    }
    assert drawn == {"base": [2, 4], "rev": [2, 4], "up": [2, 4]}
    dash = ml.Dashboard([handle], interactive=False)
    try:
        dash.refresh()
        assert dash.eval_views.shown and dash.eval_views.figure.widget.value[:4] == b"\x89PNG"
        axes = dash.eval_views.figure.by_series
        assert list(axes) == ["eval/base-only/contains", "eval/quick/contains", "eval/quick/exact_match"]
        quick = axes["eval/quick/contains"]
        assert sorted(line.get_label() for line in quick.lines if line.get_visible()) == ["base", "rev", "up"]
        assert "(+1 more)" in axes["eval/quick/exact_match"].get_ylabel()  # (word_count: a fourth score)
    finally:
        dash.stop()
    summary = ml.summary(handle).set_index("tenant")
    assert summary.loc["rev", "eval/quick/word_count"] == last["rev", "word_count"]
    fig = ml.hparams(handle, metric="eval/quick/word_count")  # (more is better: the highest is ringed)
    top = summary["eval/quick/word_count"].idxmax()
    assert fig.axes[0].get_title(loc="left") == f"best (ringed): {top}"
    assert fig.axes[0].get_ylabel() == "latest eval/quick/word_count"
    assert summary.loc["up", "eval/base-only/contains"] == next(
        r.value for r in rows if r.eval == "base-only" and r.model == "up"
    )


def test_every_problem_of_an_evaluation_is_named_at_once(llama_path, tmp_path):
    bad = [
        ml.Eval(name="a/b", data=PROMPTS, metrics=[], every=-1),
        ml.Eval(name="x", data=write_jsonl(tmp_path / "bad.jsonl", [{"text": "no prompt"}]), metrics=["regex"],
                models=["nobody"]),
        ml.Eval(name="x", data=PROMPTS, metrics=["no_such_module:fn"]),
    ]  # fmt: skip
    spec = JobSpec(base_model=llama_path, tenants=two_tenants(tmp_path), seq_len=32, max_rank=8, evals=bad)
    found = "\n".join(str(p) for p in problems(spec))
    for part in (
        "evaluation 'a/b': name must be",
        "evaluation 'a/b': metrics must be a non-empty list",
        "evaluation 'a/b': every must be >= 0",
        "models 'nobody' are neither 'base' nor a tenant",
        "two evaluations are called 'x'",
    ):
        assert part in found, found


def test_ev6_an_evaluations_rows_without_a_prompt_are_refused_as_evaluation_rows(llama_path, tmp_path):
    """EV6: a job's evaluation data without a prompt was refused as "an RL row needs 'prompt'"; the problem
    now names the evaluation and says they are evaluation rows."""
    bad = ml.Eval(
        name="x", data=write_jsonl(tmp_path / "bad.jsonl", [{"text": "no prompt"}]), metrics=["contains"]
    )
    spec = JobSpec(base_model=llama_path, tenants=two_tenants(tmp_path), seq_len=32, max_rank=8, evals=[bad])
    found = [str(p) for p in problems(spec)]
    assert any("evaluation 'x'" in p and "line 1: an evaluation row needs 'prompt'" in p for p in found), (
        found
    )
    assert not any("RL" in p or "reward" in p for p in found), found


def test_a_failing_metric_never_stops_training(llama_path, tmp_path):
    """A metric that raises fails its evaluation, each time, as an ``eval_failed`` event naming it; the tenants
    train to their end, and another evaluation of the same job still logs its rows."""
    bad = tmp_path / "bad.py"
    bad.write_text("def broken(prompts, completions, **kw):\n    raise ValueError('no such thing')\n")
    evals = [
        ml.Eval(name="bad", data=PROMPTS, metrics=[f"{bad}:broken"], every=1, max_new_tokens=2),
        ml.Eval(name="good", data=PROMPTS, metrics=["contains"], every=2, max_new_tokens=2),
    ]
    spec = JobSpec(base_model=llama_path, tenants=two_tenants(tmp_path, steps=2), seq_len=32, max_rank=8,
                   evals=evals, output_dir=str(tmp_path / "run"))  # fmt: skip
    run = prepare_run(spec)
    trainer = Trainer(JobSpec.load(run.job), run_dir=run.root)
    trainer.train()
    trainer.close()
    failed = [r for r in trainer.history if isinstance(r, EventRow) and r.event is EventKind.EVAL_FAILED]
    assert [r.step for r in failed] == [1, 2]
    assert all("'bad'" in r.message and "no such thing" in r.message for r in failed)
    assert trainer.tenants["rev"].step == 2 and trainer.tenants["up"].step == 1
    good = [r for r in trainer.history if isinstance(r, EvalMetricRow) and r.eval == "good"]
    assert {r.step for r in good} == {2} and {r.model for r in good} == {"base", "rev", "up"}
    assert not (run.root / "evals" / "bad" / "meta.json").exists()


def huge(prompts, completions, **kwargs):
    """A metric near float64's largest number (1.8e308): two of its scores sum past it."""
    return [1.5e308 if "red" in p else 1e308 for p in prompts]


def test_ev4c_a_metric_near_the_largest_float_logs_its_finite_mean_and_interval(llama_path, tmp_path):
    """EV4c: the job logged a metric of 1e308 as no value (its mean overflowed to inf, its interval NaN); the
    mean is now taken scaled, so the row holds the finite mean and interval."""
    e = ml.Eval(name="big", data=PROMPTS, metrics=[huge], every=1, max_new_tokens=2)
    spec = JobSpec(base_model=llama_path, tenants=two_tenants(tmp_path, steps=2)[:1], seq_len=32, max_rank=8,
                   evals=[e], output_dir=str(tmp_path / "run"))  # fmt: skip
    run = prepare_run(spec)
    trainer = Trainer(JobSpec.load(run.job), run_dir=run.root)
    trainer.train()
    trainer.close()
    assert not [r for r in trainer.history if isinstance(r, EventRow) and r.event is EventKind.EVAL_FAILED]
    rows = [r for r in trainer.history if isinstance(r, EvalMetricRow)]
    assert {(r.step, r.model) for r in rows} == {(s, m) for s in (1, 2) for m in ("base", "rev")}
    want = (1.5 + 2 * 1.0) / 3 * 1e308
    for r in rows:
        assert r.value == pytest.approx(want, rel=1e-12) and r.n == len(PROMPTS), r
        assert 1e308 <= r.low <= r.value <= r.high <= 1.5e308, r
