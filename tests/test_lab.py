"""The notebook side: Run handles, concurrent runs, dashboard and comparisons (no browser needed)."""

from __future__ import annotations

import json
import os
import time

import matplotlib.figure
import pytest

import mlora_lab as ml
from mlora_lab.dashboard import Dashboard, ema, thin
from mlora_lab.demo import task_rows, write_jsonl
from mlora_lab.rundir import update_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tiny_models, tmp_path_factory):
    """A small finished run with two tenants, eval data and checkpoints."""
    work = tmp_path_factory.mktemp("lab")
    base = tiny_models("llama")
    tenants = [
        ml.Tenant(name="rev", data=write_jsonl(work / "rev.jsonl", task_rows("reverse", 32, 0)),
                  eval_data=write_jsonl(work / "rev_eval.jsonl", task_rows("reverse", 6, 1)), rank=4, lr=1e-2,
                  max_steps=8),
        ml.Tenant(name="up", data=write_jsonl(work / "up.jsonl", task_rows("upper", 32, 0)), rank=8, lr=5e-3,
                  target_modules=["q_proj", "k_proj", "v_proj"], max_steps=6),
    ]  # fmt: skip
    spec = ml.JobSpec(base_model=base, tenants=tenants, seq_len=48, max_rank=8, eval_every=4, save_every=4)
    run = ml.launch(spec, workdir=work / "runs")
    assert run.wait(300) == "finished", run.logs(0)
    return run


def test_run_handle_and_runs_table(finished_run):
    run = ml.attach(finished_run.path)
    assert run.status == "finished"
    m = run.metrics()
    assert set(m["kind"]) == {"train", "eval"} and set(m["tenant"]) == {"rev", "up"}
    assert len(m[(m["kind"] == "train") & (m["tenant"] == "rev")]) == 8
    assert set(run.system_metrics()["rank"]) == {0}
    assert "done after" in run.logs(rank=0, tail=3)
    assert run.adapter_path("up").is_dir()
    with pytest.raises(FileNotFoundError):
        run.adapter_path("nobody")
    table = ml.runs(run.path.parent)
    assert list(table["state"]) == ["finished"] and table["tenants"][0] == "rev, up"
    assert table["steps"][0] == 8


def test_summary_compare_and_generations(finished_run):
    s = ml.summary(finished_run)
    assert list(s["tenant"]) == ["rev", "up"]
    assert (s["steps"] == s["max_steps"]).all()
    assert s.loc[0, "eval_loss"] > 0 and s.loc[0, "final_loss"] < s.loc[0, "first_loss"]
    fig = ml.compare([finished_run, finished_run.path], metric="loss", smoothing=0.5, logy=True)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes[0].lines) == 4 and fig.axes[0].get_yscale() == "log"
    assert fig._repr_png_()[:4] == b"\x89PNG"
    assert len(ml.compare(finished_run, metric="eval_loss", tenants=["rev"]).axes[0].lines) == 1
    with pytest.raises(ValueError, match="unknown metric"):
        ml.compare(finished_run, metric="accuracy")
    gens = ml.compare_generations(finished_run, ["reverse: red cat\n", "upper: sun\n"], max_new_tokens=4)
    assert list(gens.columns) == ["prompt", "base", "rev", "up"] and len(gens) == 2


def test_dashboard_on_a_finished_run(finished_run):
    dash = finished_run.dashboard()
    assert not dash.live, "a finished run is drawn once, then the dashboard stops refreshing"
    assert "finished" in dash.status.value
    assert dash.loss_plot.value[:4] == b"\x89PNG" and dash.system_plot.value[:4] == b"\x89PNG"
    labels = {name: label.value for name, (bar, label) in dash._bars.items()}
    assert labels["rev"].startswith("8/8 · finished") and dash._bars["rev"][0].value == 8
    before = dash.loss_plot.value
    dash.logy.value = True  # controls redraw at once
    assert dash.loss_plot.value != before
    dash.tenants.value = ("up",)
    assert dash.colors["rev"] != dash.colors["up"]


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


def test_two_runs_at_once_and_live_dashboard(tiny_models, tmp_path):
    """Two jobs launched together each get their own rendezvous port and process group; a dashboard
    refreshes while its run goes and stops by itself when the run ends."""
    base = tiny_models("llama")
    data = write_jsonl(tmp_path / "d.jsonl", task_rows("upper", 32, 0))
    runs = [
        ml.launch(ml.JobSpec(base_model=base, tenants=[ml.Tenant(name=f"t{i}", data=data, rank=4, max_steps=30)],
                             seq_len=48, max_rank=8), workdir=tmp_path / "runs")
        for i in range(2)
    ]  # fmt: skip
    dash = runs[0].dashboard(refresh_s=0.2)
    pid = runs[1]._process.pid
    assert os.getpgid(pid) != os.getpgid(0), "the job has its own process group (notebook interrupts miss it)"
    assert [r.wait(300) for r in runs] == ["finished", "finished"]
    deadline = time.monotonic() + 10
    while dash.live and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not dash.live
    assert dash.state.tenant_step["t0"] == 30


def test_ema_and_thinning():
    import numpy as np

    assert list(ema(np.array([1.0, 1.0, 1.0]), 0.9)) == [1.0, 1.0, 1.0]
    assert ema(np.array([0.0, 10.0]), 0.5)[1] == pytest.approx(10 * 0.5 / 0.75)
    x, _ = thin(np.arange(10_000), np.arange(10_000), 100)
    assert len(x) <= 100 and x[-1] == 9_999


def test_metrics_rows_stay_json(finished_run):
    for line in (finished_run.path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert row["kind"] in {"train", "eval", "system", "tenant"}
