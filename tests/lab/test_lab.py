"""The notebook side: Run handles, concurrent runs, dashboard and comparisons (no browser needed)."""

from __future__ import annotations

import json
import os
import re
import time

import matplotlib.figure
import pandas as pd
import pytest

import mlora_lab as ml
from mlora_lab.lab.compare.results import SUMMARY_COLUMNS
from mlora_lab.lab.dashboard import Dashboard
from mlora_lab.lab.demo import task_rows, write_jsonl
from mlora_lab.lab.plotting import best_smoothed, ema, thin
from mlora_lab.rundir import RunLabels, update_status

slow = pytest.mark.slow  # every test that launches a job (the generations' prompt rendering needs none)
# The tests of the finished run go to one xdist worker: a module fixture is made once per worker.
on_one_worker = pytest.mark.xdist_group("lab_finished_run")


@pytest.fixture(scope="module")
def finished_run(tiny_models, tmp_path_factory):
    """A small finished run with two tenants, eval data and checkpoints."""
    work = tmp_path_factory.mktemp("lab")
    base = tiny_models("llama")
    tenants = [
        ml.Tenant(
            name="rev",
            data=write_jsonl(work / "rev.jsonl", task_rows("reverse", 32, 0)),
            heldout_data=write_jsonl(work / "rev_eval.jsonl", task_rows("reverse", 6, 1)),
            rank=4,
            lr=1e-2,
            max_steps=8,
        ),
        ml.Tenant(
            name="up",
            data=write_jsonl(work / "up.jsonl", task_rows("upper", 32, 0)),
            rank=8,
            lr=5e-3,
            target_modules=["q_proj", "k_proj", "v_proj"],
            max_steps=6,
        ),
    ]
    spec = ml.JobSpec(base_model=base, tenants=tenants, seq_len=48, max_rank=8, heldout_every=4, save_every=4)
    run = ml.launch(spec, workdir=work / "runs")
    assert run.wait(300) == "finished", run.logs(0)
    return run


@slow
@on_one_worker
def test_run_handle_and_runs_table(finished_run):
    run = ml.attach(finished_run.path)
    assert run.status == "finished"
    m = run.metrics()
    assert set(m["kind"]) == {"train", "eval"} and set(m["tenant"]) == {"rev", "up"}
    assert len(m[(m["kind"] == "train") & (m["tenant"] == "rev")]) == 8
    assert set(run.system_metrics()["rank"]) == {0}
    assert "done after" in run.logs(rank=0, tail=3)
    assert "Loading weights" not in run.logs(rank=0), "no progress bars in a job's log"
    assert run.adapter_path("up").is_dir()
    with pytest.raises(FileNotFoundError):
        run.adapter_path("nobody")
    table = ml.runs(run.path.parent)
    assert list(table["state"]) == ["finished"] and table["tenants"][0] == "rev, up"
    assert table["global_step"][0] == 8
    train = m[m["kind"] == "train"]
    best = min(best_smoothed(train[train["tenant"] == t]["loss"].to_numpy()) for t in ("rev", "up"))
    assert table["best_smoothed_loss"][0] == pytest.approx(best) and best > train["loss"].min()


@slow
@on_one_worker
def test_summary_compare_and_generations(finished_run):
    s = ml.summary(finished_run)
    assert list(s["tenant"]) == ["rev", "up"] and list(s["state"]) == ["finished", "finished"]
    assert (s["steps"] == s["max_steps"]).all()
    assert list(s["rows"]) == [8 * 4, 6 * 4] and list(s["targets"]) == [
        "q_proj,v_proj",
        "q_proj,k_proj,v_proj",
    ]
    assert s.loc[0, "eval_loss"] > 0 and s.loc[0, "final_loss"] < s.loc[0, "first_loss"]
    fig = ml.compare([finished_run, finished_run.path], metric="loss", smoothing=0.5, logy=True)
    assert isinstance(fig, matplotlib.figure.Figure)
    mains = [line for line in fig.axes[0].lines if not line.get_label().startswith("_")]
    assert len(mains) == 4 and len(fig.axes[0].lines) == 8, "smoothed lines over their faded raw values"
    assert fig.axes[0].get_yscale() == "log"
    assert fig._repr_png_()[0][:4] == b"\x89PNG"
    assert len(ml.compare(finished_run, metric="eval_loss", tenants=["rev"]).axes[0].lines) == 1
    with pytest.raises(ValueError, match="unknown metric"):
        ml.compare(finished_run, metric="accuracy")
    gens = ml.compare_generations(finished_run, ["reverse: red cat\n", "upper: sun\n"], max_new_tokens=4)
    assert list(gens.columns) == ["prompt", "base", "rev", "up"] and len(gens) == 2


@slow
@on_one_worker
def test_dashboard_on_a_finished_run(finished_run):
    dash = finished_run.dashboard(interactive=False)
    assert not dash.live, "a finished run is drawn once, then the dashboard stops refreshing"
    assert "finished" in dash.status.value
    assert dash.loss_plot.value[:4] == b"\x89PNG" and dash.system_plot.value[:4] == b"\x89PNG"
    rev, up = (finished_run.path.name, "rev"), (finished_run.path.name, "up")
    row = dash.progress_rows[rev]
    assert re.sub("<[^>]+>", "", row.info.value).startswith("8/8 · finished") and row.bar.value == 8
    # the job's memory rows reached the bars: adapter + optimiser of each tenant
    assert [b.get_width() > 0 for b in dash.system.bars[0]] == [True, True]
    before = dash.loss_plot.value
    dash.logy.value = True  # controls redraw at once
    assert dash.loss_plot.value != before
    dash.tenants.value = (up,)
    shown = [key for key, row in dash.progress_rows.items() if row.box in dash.progress.children]
    assert shown == [up]
    assert dash.colors[rev] != dash.colors[up]


@slow
@on_one_worker
def test_dashboard_shows_a_failed_rank(finished_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(finished_run.path, copy)
    update_status(copy, state="failed", error="rank 0: RuntimeError: boom")
    with open(copy / "logs" / "rank0.log", "a") as f:
        f.write("Traceback (most recent call last):\nRuntimeError: boom\n")
    dash = Dashboard(ml.attach(copy))
    dash.refresh()
    assert "failed" in dash.status.value and "RuntimeError: boom" in dash.status.value


@slow
def test_two_runs_at_once_and_live_dashboard(tiny_models, tmp_path):
    """Two jobs launched together each get their own rendezvous port and process group; a dashboard
    refreshes while its run goes and stops by itself when the run ends."""
    base = tiny_models("llama")
    data = write_jsonl(tmp_path / "d.jsonl", task_rows("upper", 32, 0))
    runs = [
        ml.launch(
            ml.JobSpec(
                base_model=base,
                tenants=[ml.Tenant(name=f"t{i}", data=data, rank=4, max_steps=30)],
                seq_len=48,
                max_rank=8,
            ),
            workdir=tmp_path / "runs",
        )
        for i in range(2)
    ]
    dash = runs[0].dashboard(refresh_s=0.2)
    pid = runs[1].process.pid
    assert os.getpgid(pid) != os.getpgid(0), "the job has its own process group (notebook interrupts miss it)"
    assert [r.wait(300) for r in runs] == ["finished", "finished"]
    deadline = time.monotonic() + 10
    while dash.live and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not dash.live
    assert dash.feeds[runs[0].path.name].tenants["t0"].step == 30


def test_summary_has_each_tenants_state_settings_and_the_tenants_added_live(tiny_models, tmp_path):
    """Settings next to results, the state each tenant is in now (a tenant still training when the
    run stopped shows ``stopped``), and tenants that are in no job.json: refused, or still queued."""
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.lab.launch import prepare_run
    from mlora_lab.rundir import control

    data = write_jsonl(tmp_path / "rev.jsonl", task_rows("reverse", 16, 0))
    done = ml.Tenant(name="done", data=data, rank=4, batch_size=2, max_steps=3)
    long = ml.Tenant(
        name="long",
        data=data,
        rank=8,
        alpha=8,
        target_modules=["q_proj", "k_proj"],
        schedule="cosine",
        warmup_steps=2,
        batch_size=2,
        grad_accum=2,
        max_steps=50,
    )
    spec = ml.JobSpec(
        base_model=tiny_models("llama"),
        tenants=[done, long],
        seq_len=48,
        max_rank=8,
        log_every=2,
        output_dir=str(tmp_path / "runs" / "r1"),
    )
    run = ml.attach(prepare_run(spec).root)
    update_status(run.path, state="running")
    trainer = Trainer(ml.JobSpec.load(run.dir.job), run_dir=run.path)  # the job, in this process
    for _ in range(4):
        trainer.step()
    live = ml.Tenant(name="live", data=data, rank=4, lr=1e-3, max_steps=5)
    run.add_tenant(live, wait=False)
    control.send(run.path, "add", tenant={**live.to_dict(), "name": "huge", "rank": 99})
    trainer.poll()  # live is added, huge refused (rank > max_rank)
    trainer.step()
    control.send(run.path, "add", tenant={**live.to_dict(), "name": "later", "lr": 5e-4})  # not picked up yet

    s = ml.summary(run).set_index("tenant")
    assert list(s.columns) == [c for c in SUMMARY_COLUMNS if c != "tenant"]
    assert list(s.index) == ["done", "long", "live", "huge", "later"]
    assert list(s["state"]) == ["finished", "running", "running", "refused", "pending"]
    assert "rank" in s.loc["huge", "reason"] and s.loc["huge", "rank"] == 99, "its settings are its message's"
    assert s.loc["later", "lr"] == 5e-4 and s.loc["later", "steps"] == 0
    assert s.loc[
        "long", ["targets", "schedule", "warmup", "batch_size", "grad_accum", "max_steps"]
    ].tolist() == ["q_proj,k_proj", "cosine", 2, 2, 2, 50]
    # log_every=2 skips rows, yet rows and tokens are exact (the rows carry running totals)
    assert s.loc["long", "steps"] == 2 and s.loc["long", "rows"] == 2 * 2 * 2
    assert s.loc["done", "rows"] == 3 * 2 and s.loc["done", "tokens"] == trainer.tenants["done"].tokens_seen
    assert pd.isna(s.loc["live", "rows"]), "live has taken one step, not a logged one"

    update_status(run.path, state="stopped")  # the job ended without a row for the tenants it trained
    s = ml.summary(run).set_index("tenant")
    assert s["state"].to_dict() == {
        "done": "finished",
        "long": "stopped",
        "live": "stopped",
        "huge": "refused",
    }


def test_runs_table_shows_tags_note_and_best_smoothed_loss(tmp_path):
    from mlora_lab.rundir import MetricsWriter, RunDir, TrainRow

    runs_dir = tmp_path / "runs"
    for name, losses in (("r1", [2.0, 1.5, None]), ("r2", [])):
        run = RunDir(runs_dir / name).create()
        ml.JobSpec(base_model="m", tenants=[ml.Tenant(name="a", data="a.jsonl")]).to_json(run.job)
        update_status(run.root, state="finished", started=1.0)
        writer = MetricsWriter(run.metrics)
        for i, loss in enumerate(losses):  # a non-finite loss is null in metrics.jsonl
            writer.write(
                TrainRow(step=i + 1, tenant="a", tenant_step=i + 1, loss=loss, tokens=1, lr=0.1, grad_norm=1)
            )
        writer.close()
    r1 = ml.attach(runs_dir / "r1")
    assert r1.tag("baseline", "q-v", "baseline") == ("baseline", "q-v")
    r1.note("first try\nlr too high?")
    assert r1.untag("q-v", "absent") == ("baseline",)
    assert r1.labels == RunLabels(("baseline",), "first try\nlr too high?")
    with pytest.raises(ValueError, match="whitespace"):
        r1.tag("two words")
    table = ml.runs(runs_dir).set_index("run")
    assert list(table.columns) == [
        "name",
        "state",
        "tenants",
        "global_step",
        "best_smoothed_loss",
        "best_reward",  # (of RL tenants: None here)
        "tokens_trained",  # (a served run's usage: None here)
        "tokens_sampled",
        "busy_s",
        "tags",
        "note",
        "started",
        "path",
        "problem",
    ]
    # best_smoothed_loss: the lowest point of the smoothed loss (EMA 0.6: 2.0, then (0.6*2 + 1.5) / 1.6), not a
    # lucky step's raw value; a job without a name gets one from its tenants
    assert table.loc["r1", ["name", "best_smoothed_loss", "tags", "note", "global_step"]].tolist() == [
        "a",
        pytest.approx((0.6 * 2.0 + 1.5) / 1.6),
        "baseline",
        "first try\nlr too high?",
        3,
    ]
    assert (
        pd.isna(table.loc["r2", "best_smoothed_loss"])
        and table.loc["r2", "tags"] == ""
        and table.loc["r2", "note"] == ""
    )
    (runs_dir / "r2" / "labels.json").write_text("{")  # a broken labels file: the run is still listed
    table = ml.runs(runs_dir).set_index("run")
    assert table.loc["r2", "state"] == "finished" and "corrupt" in table.loc["r2", "problem"]


def test_a_relative_runs_folder_keeps_tags_and_notes(tmp_path, monkeypatch):
    """``ml.runs("runs")`` and a run attached by a relative path read and write the same labels as by an
    absolute one (a relative run directory put them at runs/x/runs/x/labels.json, and the table lost them)."""
    from mlora_lab.rundir import RunDir

    monkeypatch.chdir(tmp_path)
    run = RunDir("runs/r1").create()
    ml.JobSpec(base_model="m", tenants=[ml.Tenant(name="a", data="a.jsonl")]).to_json(run.job)
    update_status(run.root, state="finished", started=1.0)
    ml.attach("runs/r1").tag("quickstart")
    ml.attach(tmp_path / "runs" / "r1").note("three tenants")
    assert (tmp_path / "runs" / "r1" / "labels.json").is_file() and not (
        tmp_path / "runs" / "r1" / "runs"
    ).exists()
    for folder in ("runs", tmp_path / "runs"):
        row = ml.runs(folder).set_index("run").loc["r1"]
        assert (row["tags"], row["note"]) == ("quickstart", "three tenants")


NO_TORCH = """
import runpy, sys
from pathlib import Path

run_dir = sys.argv[1]
import mlora_lab.rundir
assert "torch" not in sys.modules, "import mlora_lab.rundir loaded torch"
import mlora_lab as ml
run = ml.attach(run_dir)
assert len(run.metrics()) == 3 and run.status == "finished"
assert "torch" not in sys.modules, "ml.attach(run_dir).metrics() loaded torch"
sys.argv = ["mlora-lab", "status", run_dir]
try:
    runpy.run_module("mlora_lab.lab.cli", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
assert "torch" not in sys.modules, "mlora-lab status RUN_DIR loaded torch"
print("no torch")
"""


def test_reading_a_run_loads_no_torch(tmp_path):
    """The notebook side reads a run without torch (2-3 s to import): ``import mlora_lab.rundir``,
    ``ml.attach(run_dir).metrics()`` and ``mlora-lab status RUN_DIR``, checked in a fresh process."""
    import subprocess
    import sys

    from mlora_lab.rundir import MetricsWriter, RunDir, TenantRow, TenantState, TrainRow

    run = RunDir(tmp_path / "run").create()
    ml.JobSpec(base_model="m", tenants=[ml.Tenant(name="a", data="a.jsonl", max_steps=3)]).to_json(run.job)
    update_status(run.root, state="finished", started=1.0, ended=2.0)
    writer = MetricsWriter(run.metrics)
    for step in (1, 2, 3):
        writer.write(
            TrainRow(step=step, tenant="a", tenant_step=step, loss=1.0, tokens=4, lr=0.1, grad_norm=1)
        )
    writer.write(TenantRow(step=3, tenant="a", state=TenantState.FINISHED))
    writer.close()
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(run.root)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "no torch" in out.stdout, out.stdout + out.stderr
    assert "a " in out.stdout and "finished" in out.stdout  # the status command printed its summary


def test_ema_and_thinning():
    import numpy as np

    assert list(ema(np.array([1.0, 1.0, 1.0]), 0.9)) == [1.0, 1.0, 1.0]
    assert ema(np.array([0.0, 10.0]), 0.5)[1] == pytest.approx(10 * 0.5 / 0.75)
    x, _ = thin(np.arange(10_000), np.arange(10_000), 100)
    assert len(x) <= 100 and x[-1] == 9_999


@slow
@on_one_worker
def test_metrics_rows_stay_json(finished_run):
    for line in (finished_run.path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["kind"] in {"train", "eval", "system", "tenant"}


def test_summary_of_a_run_without_train_rows_lists_its_tenants(tmp_path):
    """A run that logged nothing yet (or never will): one row per tenant, no KeyError on the missing columns."""
    from mlora_lab.rundir import RunDir

    run = RunDir(tmp_path / "r1").create()
    ml.JobSpec(base_model="m", tenants=[ml.Tenant(name="a", data="a.jsonl")]).to_json(run.job)
    update_status(run.root, state="failed", started=1.0)
    row = ml.summary(ml.attach(run.root)).set_index("tenant").loc["a"]
    assert (row["steps"], row["tokens"], row["time_s"]) == (0, 0, 0.0) and row["final_loss"] is None


@slow
def test_an_attached_handles_wait_returns_once_the_job_has_exited(tiny_models, tmp_path):
    """``ml.attach(path).wait()`` (a handle that did not start the job) returns when the job's process is
    gone, not as soon as it has written its end."""
    import psutil

    from mlora_lab.rundir import read_status

    rows = write_jsonl(tmp_path / "rev.jsonl", task_rows("reverse", 8, 0))
    spec = ml.JobSpec(
        base_model=tiny_models("llama"),
        tenants=[ml.Tenant(name="a", data=rows, rank=4, max_steps=2)],
        seq_len=32,
    )
    run = ml.launch(spec, workdir=tmp_path / "runs")
    other = ml.attach(run.path)
    assert other.wait(300) == "finished", run.logs(0)
    status = read_status(run.path)
    assert status.process is not None and status.process.alive() is False, "the job's agent has exited"
    run.wait(60)
    assert not psutil.pid_exists(status.pid) or psutil.Process(status.pid).status() == psutil.STATUS_ZOMBIE


@slow
@on_one_worker
def test_a_runs_evaluation_is_saved_and_read_back(finished_run):
    """ml.evaluate on a run: its tenants and the base, saved in evals/<name>/ and read back the same."""
    from test_evaluate import ROWS, long_words

    from mlora_lab.rundir.evals import list_evals

    ev = ml.evaluate(finished_run, ROWS[:2], ["exact_match", long_words], max_new_tokens=4, name="smoke")
    assert ev.models == ["base", "rev", "up"] and ev.folder == finished_run.path / "evals" / "smoke"
    assert "smoke" in ml.evaluations(finished_run) and list_evals(finished_run.path)[-1] == "smoke"
    back = ml.load_evaluation(finished_run.path, "smoke")
    assert back.meta == ev.meta and back.examples().equals(ev.examples())
    assert (ev.folder / "metrics").is_dir(), "the notebook's metric is kept with the evaluation"
    with pytest.raises(FileNotFoundError, match=r"has no evaluation 'other'.*'smoke'"):
        ml.load_evaluation(finished_run, "other")


def test_m5_the_runs_table_shows_each_run_on_one_line(tmp_path):
    """m5: ``ml.runs()`` wrapped every row onto two lines (a terminal's text into blocks of columns; a
    notebook's cells, the path and the start time, onto two lines) and cut its headers. It shows the columns
    people read, each run on one line: in a terminal as many as fit its width (the least needed dropped
    and named), in a notebook every cell unwrapped; the frame keeps every column."""
    from test_dashboard import make_run, steps, write

    from mlora_lab.lab.compare.results import RUNS_COLUMNS
    from mlora_lab.rundir.labels import update_labels

    work = tmp_path / "runs"
    r1 = make_run(
        work / "20260101-000000-aaaaaa", tenants=("alice", "bob"), state="finished", name="sweep-lr"
    )
    make_run(work / "20260102-000000-bbbbbb", tenants=("a", "c"))
    write(r1, *steps(["alice", "bob"], 1, 30))
    update_labels(r1.root, add=["baseline"], note="first try\nwith a note on two lines, longer than a cell")
    table = ml.runs(work)
    assert list(table.columns) == RUNS_COLUMNS and table["global_step"].tolist() == [30, 0]
    text = table.to_text(width=80).splitlines()
    assert max(map(len, text)) <= 80 and len(text) == 1 + 2 + 1, (
        text
    )  # header, a line per run, what is left out
    header = text[0].split()
    assert header[:6] == ["run", "state", "tenants", "step", "best", "loss"] and header[-1] == "started", (
        header
    )
    assert text[-1].startswith("(not shown, to fit: ") and "path" not in text[-1], (
        "the path is the run's folder"
    )
    wide = table.to_text(width=200).splitlines()
    assert len(wide) == 3 and all(c in wide[0] for c in ("name", "tags", "note")) and "path" not in wide[0]
    assert "first try with a note on two lines" in wide[1] and "sweep-lr" in wide[1]
    html = table._repr_html_()
    assert "white-space: nowrap" in html and ">best loss</th>" in html and str(work) not in html
    assert html.count("<tr") == 2 + 1 and ">2026-" in html and "00:00:00" not in html, (
        "started: to the minute"
    )
    assert "trained" not in wide[0] and "problem" not in wide[0], "a column no run has a value in is left out"
    assert repr(table) == table.to_text(), "what a terminal shows"
    assert type(table[table["state"] == "running"]) is type(table), "a filtered table shows itself alike"


def test_m10_the_summary_shows_small_numbers_and_counts_as_people_write_them(tmp_path):
    """m10: one loss of −1.5e-08 printed the whole column in scientific notation, and ``rows`` was a float
    (``6.0``) when a tenant failed before its first step. Counts are nullable integers, and the summary shows
    losses with 4 decimals (a tiny one is 0.0000), counts whole, a missing value as ``–``."""
    from test_dashboard import make_run, write

    from mlora_lab.rundir import TenantRow, TenantState, TrainRow

    run = make_run(tmp_path / "r", tenants=("a", "b"), state="finished")
    rows = [
        TrainRow(step=s, tenant="a", tenant_step=s, loss=loss, tokens=10, lr=2e-5, grad_norm=1.0,
                 rows_seen=2 * s, tokens_seen=10 * s)
        for s, loss in ((1, 2.5), (2, -1.5e-08), (3, 0.75))
    ]  # fmt: skip
    failed = TenantRow(step=1, tenant="b", state=TenantState.FAILED, reason="its step was NaN")
    write(run, *rows, failed)
    table = ml.summary(ml.attach(run.root)).set_index("tenant")
    assert (
        str(table["rows"].dtype) == "Int64"
        and table.loc["a", "rows"] == 6
        and pd.isna(table.loc["b", "rows"])
    )
    assert table["steps"].tolist() == [3, 0] and str(table["steps"].dtype) == "Int64"
    table.loc["a", "final_loss"] = -1.5e-08  # (the smallest value of the column)
    text = table.to_text(width=250)
    html = table._repr_html_()
    for shown in (text, html):
        assert "e-08" not in shown and "e+00" not in shown and "0.0000" in shown, shown
        assert "6.0" not in shown and "0.0002" in shown and "its step was NaN" in shown
    line_a = next(line for line in text.splitlines() if line.startswith("a "))
    assert " 6 " in line_a and "2.5000" in line_a
    # the terminal's summary (mlora-lab status, and the end of mlora-lab run) is the same table
    from mlora_lab.lab.cli import summary_text

    write(run, TrainRow(step=4, tenant="a", tenant_step=4, loss=-1.5e-08, tokens=10, lr=2e-5, grad_norm=1.0))
    status = summary_text(ml.attach(run.root))
    assert "e-08" not in status and "0.0000" in status and "its step was NaN" in status, status
    assert "final loss" in status.splitlines()[0] and "reward" not in status, status


def test_m10_a_run_whose_tenants_learn_from_rewards_shows_their_reward_not_their_loss(tmp_path):
    """m10: an RL-only run's "best smoothed loss" means nothing (a GRPO loss says nothing of how well a tenant
    does). ``ml.runs`` has ``best_reward`` (the highest smoothed mean reward) and no best loss for it; its
    summary shows the reward and leaves out the losses (they stay in the frame); a mixed run's best loss is
    its SFT tenants'."""
    from test_dashboard import make_run, steps, write
    from test_rl_lab import rl_steps

    work = tmp_path / "runs"
    rl = make_run(work / "rl", tenants=("grpo",), state="finished")
    write(rl, *rl_steps("grpo", 1, 6, reward=lambda s: s / 10))
    mixed = make_run(work / "mixed", tenants=("sft", "grpo"), state="finished")
    write(mixed, *steps(["sft"], 1, 6, loss=lambda s, i: 3.0), *rl_steps("grpo", 1, 6))
    table = ml.runs(work).set_index("run")
    assert pd.isna(table.loc["rl", "best_smoothed_loss"]) and table.loc["rl", "best_reward"] > 0.4
    assert table.loc["mixed", "best_smoothed_loss"] == pytest.approx(3.0), (
        "the SFT tenant's, not the GRPO loss"
    )
    assert "best reward" in table.to_text(width=200).splitlines()[0]
    summary = ml.summary(ml.attach(rl.root))
    shown = summary.to_text(width=250).splitlines()[0]
    assert "reward" in shown and "loss" not in shown, shown
    assert summary.loc[0, "final_loss"] == pytest.approx(0.06), "the frame keeps every column"
    assert "best loss" in ml.summary(ml.attach(mixed.root)).to_text(width=250).splitlines()[0]
