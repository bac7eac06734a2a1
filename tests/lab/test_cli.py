"""End to end: the real CLI and launcher start torchrun on a tiny model and write the run directory;
the follower that shows a run in a terminal or a log."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import peft
import psutil
import pytest
import transformers

import mlora_lab as ml
from mlora_lab.lab.cli import follow
from mlora_lab.rundir import (
    EventKind,
    EventRow,
    MetricsWriter,
    RunDir,
    TenantRow,
    TenantState,
    TrainRow,
    read_status,
    update_status,
)
from mlora_lab.rundir.status import JOB_MODULE

slow = pytest.mark.slow  # every test that starts a job


def cli(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlora_lab.lab.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def job_json(tmp_path: Path, base: str, make_data, **overrides) -> Path:
    make_data("reverse", name="alice")
    make_data("chat", name="bob")
    job = {
        "base_model": base,
        "tenants": [
            {
                "name": "alice",
                "data": "alice.jsonl",
                "rank": 4,
                "target_modules": ["q_proj", "v_proj"],
                "lr": 0.005,
                "max_steps": 6,
                "batch_size": 2,
            },
            {
                "name": "bob",
                "data": "bob.jsonl",
                "rank": 8,
                "alpha": 8,
                "target_modules": ["o_proj", "down_proj"],
                "lr": 0.001,
                "max_steps": 4,
                "batch_size": 3,
                "grad_accum": 2,
            },
        ],
        "seq_len": 64,
        "max_tenants": 4,
        "max_rank": 16,
        "save_every": 3,
    }
    job.update(overrides)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return path


@slow
def test_run_end_to_end(tmp_path, llama_path, make_data):
    job_json(tmp_path, llama_path, make_data)
    proc = cli("run", "job.json", "--workdir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert "alice" in proc.stdout and "final loss" in proc.stdout
    followed = proc.stdout.split("\n\n")[0].splitlines()  # what the follower printed, before the summary
    assert len(followed) <= 12, followed  # changes and a few progress lines, never one per poll
    assert followed[0] == f"run directory: {run_dir}"
    assert any(line.endswith("run finished") for line in followed)
    assert any(line.endswith("tenant bob finished") for line in followed)
    assert any("steps 10/10 (100%)" in line for line in followed), "a last progress line"
    status = read_status(run_dir)
    assert status.state == "finished" and status.ended >= status.started
    spec = ml.JobSpec.load(run_dir / "job.json")
    assert Path(spec.tenants[0].data).is_absolute()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"train", "system", "tenant"}
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["tenant_step"] for r in train if r["tenant"] == "alice"] == [1, 2, 3, 4, 5, 6]
    assert [r["tenant_step"] for r in train if r["tenant"] == "bob"] == [1, 2, 3, 4]
    assert set(train[0]) >= {"step", "tenant", "tenant_step", "loss", "tokens", "lr", "grad_norm", "time"}
    # rows and tokens trained on so far: alice 6 steps x 2 rows, bob 4 steps x 3 rows x 2 micro-batches
    assert [r["rows_seen"] for r in train if r["tenant"] == "alice"] == [2, 4, 6, 8, 10, 12]
    assert [r["rows_seen"] for r in train if r["tenant"] == "bob"] == [6, 12, 18, 24]
    bob = [r for r in train if r["tenant"] == "bob"]
    assert [r["tokens_seen"] for r in bob] == [sum(r["tokens"] for r in bob[: i + 1]) for i in range(4)]
    system = [r for r in rows if r["kind"] == "system"]
    assert all(r["rank"] == 0 and r["mem_bytes"] > 0 and r["tokens_per_s"] > 0 for r in system)
    # CPU use is read from the kernel's CPU-time counters, which tick every 10 ms: a step shorter than a tick
    # can read 0. Every row has a figure and the job as a whole used CPU; a CPU job has no GPU figure.
    assert all(
        r["cpu_percent"] is not None and r["cpu_percent"] >= 0 and r["gpu_util"] is None for r in system
    )
    assert any(r["cpu_percent"] > 0 for r in system)
    states = [(r["tenant"], r["state"]) for r in rows if r["kind"] == "tenant"]
    assert ("alice", "finished") in states and ("bob", "finished") in states
    assert "done after" in (run_dir / "logs" / "rank0.log").read_text()
    assert any((run_dir / "checkpoints").glob("step_*/tensors.safetensors"))
    # adapters are standard PEFT directories
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_path)
    model = peft.PeftModel.from_pretrained(base, str(run_dir / "adapters" / "alice"))
    assert model.peft_config["default"].r == 4
    # status and the Run API agree
    run = ml.attach(run_dir)
    assert run.status == "finished"
    assert set(run.metrics()["tenant"]) == {"alice", "bob"}
    run.tag("smoke")
    proc = cli("status", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0 and "finished" in proc.stdout and "tags: smoke" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("tenant"))
    assert header.split()[:2] == ["tenant", "state"] and "final loss" in header and "reason" not in header
    assert next(line for line in proc.stdout.splitlines() if "alice" in line).split()[:2] == [
        "alice",
        "finished",
    ]


@slow
def test_bad_job_starts_nothing(tmp_path, llama_path, make_data):
    job = job_json(tmp_path, llama_path, make_data)
    spec = json.loads(job.read_text())
    spec["tenants"][0]["rank"] = 0
    spec["tenants"][1]["name"] = "../evil"
    spec["tenants"][1]["target_modules"] = ["nope_proj"]
    spec["tenants"][1]["data"] = "missing.jsonl"
    job.write_text(json.dumps(spec))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    proc = cli("run", "job.json", "--workdir", "runs", cwd=tmp_path)
    assert proc.returncode == 2
    for fragment in ("rank", "../evil", "nope_proj", "missing.jsonl", "q_proj"):
        assert fragment in proc.stderr, fragment
    assert not (tmp_path / "runs").exists()
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


@slow
def test_demo_runs(tmp_path):
    proc = cli("demo", "--workdir", str(tmp_path / "demo"), "--steps", "12", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for tenant in ("reverse", "upper", "count"):
        assert tenant in proc.stdout
        assert (
            next((tmp_path / "demo" / "runs").iterdir()) / "adapters" / tenant / "adapter_config.json"
        ).is_file()
    assert (tmp_path / "demo" / "loss_curves.png").stat().st_size > 10_000


@slow
def test_demo_runs_with_moe_tenants_on_two_processes(tmp_path):
    """``mlora-lab demo --moe --nproc 2``: the MoE demo under torchrun on two processes (FSDP2), its
    tenants adapting the packed experts too."""
    proc = cli(
        "demo",
        "--moe",
        "--nproc",
        "2",
        "--workdir",
        str(tmp_path / "demo"),
        "--steps",
        "6",
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "demo" / "runs").iterdir())
    config = json.loads((run_dir / "adapters" / "reverse" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    run = ml.attach(run_dir)
    assert run.spec.parallel.nproc == 2
    assert {r["rank"] for r in run.rows() if r["kind"] == "system"} == {0, 1}


def long_spec(tmp_path: Path, base: str, make_data) -> ml.JobSpec:
    tenants = [ml.Tenant(name="slow", data=make_data("text"), rank=4, max_steps=100_000, batch_size=2)]
    return ml.JobSpec(
        base_model=base, tenants=tenants, seq_len=64, max_rank=8, output_dir=str(tmp_path / "run")
    )


def wait_for_training(run: ml.Run, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["kind"] == "train" for r in run.rows()):
        assert run.status in ("starting", "running"), run.logs(0)
        assert time.monotonic() < deadline, "no training step within the timeout"
        time.sleep(0.3)


@slow
def test_stop_is_graceful(tmp_path, llama_path, make_data):
    run = ml.launch(long_spec(tmp_path, llama_path, make_data))
    wait_for_training(run)
    assert run.stop(timeout=120) == "stopped"
    assert run.adapter_path("slow").is_dir()
    assert any((run.path / "checkpoints").glob("step_*/tensors.safetensors"))
    assert read_status(run.path).process.alive() is False


@slow
def test_killed_rank_marks_run_failed(tmp_path, llama_path, make_data):
    run = ml.launch(long_spec(tmp_path, llama_path, make_data))
    wait_for_training(run)
    launcher = psutil.Process(read_status(run.path).pid)
    workers = [p for p in launcher.children(recursive=True) if JOB_MODULE in " ".join(p.cmdline())]
    assert workers, "the trainer runs as a child of torchrun"
    os.kill(workers[0].pid, 9)
    assert run.wait(timeout=60) == "failed"
    assert run.error
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


@slow
def test_local_launcher_script(tmp_path, llama_path, make_data):
    job_json(tmp_path, llama_path, make_data, output_dir="out")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ["bash", str(root / "launchers" / "local.sh"), "job.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_status(tmp_path / "out").state == "finished"
    assert (tmp_path / "out" / "adapters" / "bob" / "adapter_model.safetensors").is_file()


# -- the follower: a line per change, bounded progress ---------------------------------------------


def fake_run(tmp_path: Path, state: str = "running", steps: dict[str, int] | None = None) -> ml.Run:
    """A run directory as a job on another host would leave it (no process here to check)."""
    steps = steps or {"a": 100, "b": 50}
    run = RunDir(tmp_path / "run").create()
    tenants = [ml.Tenant(name=n, data=f"{n}.jsonl", max_steps=m) for n, m in steps.items()]
    ml.JobSpec(base_model="model", tenants=tenants).to_json(run.job)
    update_status(run.root, state=state, pid=1, pid_start_time=1.0, host="another-host", started=time.time())
    return ml.attach(run.root)


def train_like_a_job(run: ml.Run, pause: float = 0.0) -> None:
    """Rows of a 100-step job: a starts and finishes, b fails half-way, one event; then the run ends."""
    writer = MetricsWriter(run.dir.metrics)
    for name in ("a", "b"):
        writer.write(TenantRow(step=0, tenant=name, state=TenantState.RUNNING))
    for step in range(1, 101):
        writer.write(
            TrainRow(
                step=step,
                tenant="a",
                tenant_step=step,
                loss=2.0 - step / 100,
                tokens=9,
                lr=0.1,
                grad_norm=1.0,
            )
        )
        if step < 25:
            writer.write(
                TrainRow(step=step, tenant="b", tenant_step=step, loss=3.0, tokens=9, lr=0.1, grad_norm=1.0)
            )
        if step == 1:  # the second running row of a tenant (its optimiser memory) is no change
            writer.write(TenantRow(step=1, tenant="a", state=TenantState.RUNNING, optimizer_bytes=8))
        if step == 25:
            writer.write(TenantRow(step=25, tenant="b", state=TenantState.FAILED, reason="non-finite loss"))
        if step == 50:
            writer.write(EventRow(step=50, event=EventKind.SAVE_FAILED, message="disk full"))
        time.sleep(pause)
    writer.write(TenantRow(step=100, tenant="a", state=TenantState.FINISHED))
    writer.close()
    update_status(run.path, state="finished", ended=time.time())


def test_follow_of_a_finished_run_prints_its_changes_once_and_one_progress_line(tmp_path):
    run = fake_run(tmp_path)
    train_like_a_job(run)
    out = io.StringIO()
    assert follow(run, out=out, poll=0.01) == "finished"
    lines = [re.sub(r"^\[\d\d:\d\d\] ", "", line) for line in out.getvalue().splitlines()]
    assert lines == [
        f"run directory: {run.path}",
        "tenant a running",
        "tenant b running",
        "tenant b failed: non-finite loss",
        "save_failed at step 50: disk full",
        "tenant a finished",
        "run finished",  # after the rows: the job writes them before its final state
        "tenant steps 124/124 (100%)  a 100/100 1.000 | b 24/50 3.000",  # b failed: its 24 steps are its share
    ]


def test_follow_of_a_live_run_without_a_terminal_prints_bounded_progress(tmp_path):
    run = fake_run(tmp_path)
    job = threading.Thread(target=train_like_a_job, args=(run, 0.01))
    job.start()
    out = io.StringIO()
    try:
        assert follow(run, out=out, poll=0.005) == "finished"
    finally:
        job.join()
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if "steps " in line]
    changes = [line for line in lines if "steps " not in line]
    assert 2 <= len(progress) <= 11, progress  # every 10 % of the steps at most (the run takes ~1 s)
    assert progress[-1].endswith("steps 124/124 (100%)  a 100/100 1.000 | b 24/50 3.000")
    assert len(changes) == 8 and changes[1].endswith("run running") and changes[-1].endswith("run finished")
    assert sum("tenant b failed: non-finite loss" in line for line in lines) == 1


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_follow_on_a_terminal_draws_one_bar_and_prints_changes_above_it(tmp_path):
    run = fake_run(tmp_path)
    job = threading.Thread(target=train_like_a_job, args=(run, 0.005))
    job.start()
    out = Terminal()
    try:
        assert follow(run, out=out, poll=0.005) == "finished"
    finally:
        job.join()
    text = out.getvalue()
    assert "\r" in text, "the progress bar redraws in place"
    lines = text.split("\n")
    assert len(lines) <= 12, lines  # the changes and the bar, not a line per poll
    assert any(line.rstrip().endswith("tenant b failed: non-finite loss") for line in lines)
    assert "124/124" in text.rsplit("\r", 1)[-1] and "a 100/100 1.000" in text


def test_resume_names_a_planted_log_link_in_one_line(tmp_path, llama_path):
    """``mlora-lab resume`` of a run whose logs/launcher.log was replaced by a symlink: one line naming
    the link (no traceback), exit status 2, the file it leads to untouched, and nothing started."""
    from test_reliability import resumable_run

    root = resumable_run(llama_path, tmp_path)
    victim = tmp_path / "victim.log"
    victim.write_text("original\n")
    (root / "logs" / "launcher.log").symlink_to(victim)
    proc = cli("resume", str(root), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launcher.log is a symbolic link" in proc.stderr and "Traceback" not in proc.stderr
    assert victim.read_text() == "original\n" and read_status(root).state == "stopped"


def test_follow_of_a_served_run_shows_its_clients_steps_done_with_no_total(tmp_path):
    """A Tinker client's tenant has no goal: the progress line shows the tenant steps done (``owner-1 52``),
    never ``52/9007199254740991`` nor a share of a total."""
    from mlora_lab.spec.fields import MAX_COUNT
    from mlora_lab.spec.parts import ClientModel

    run = RunDir(tmp_path / "run").create()
    client = ClientModel(model_id="ab12:train:0", owner="owner")
    tenants = [
        ml.Tenant(name="a", data="a.jsonl", max_steps=10),
        ml.Tenant(name="owner-1", data="", client=client, max_steps=MAX_COUNT),
    ]
    ml.JobSpec(base_model="model", tenants=tenants, service=ml.Service()).to_json(run.job)
    update_status(
        run.root, state="running", pid=1, pid_start_time=1.0, host="another-host", started=time.time()
    )
    writer = MetricsWriter(run.metrics)
    for step in range(1, 53):
        for name in ("a", "owner-1") if step <= 10 else ("owner-1",):
            writer.write(
                TrainRow(step=step, tenant=name, tenant_step=step, loss=1.0, tokens=9, lr=0.1, grad_norm=1.0)
            )
    writer.write(TenantRow(step=10, tenant="a", state=TenantState.FINISHED))
    writer.close()
    update_status(run.root, state="stopped", ended=time.time())
    out = io.StringIO()
    assert follow(ml.attach(run.root), out=out, poll=0.01) == "stopped"
    last = out.getvalue().splitlines()[-1]
    assert last.endswith("tenant steps 62  a 10/10 1.000 | owner-1 52 1.000"), last
    assert str(MAX_COUNT) not in out.getvalue() and "%" not in last


@slow
def test_a_job_json_with_a_preference_tenant_runs_and_shows_its_margins(tmp_path, llama_path, make_data):
    """``"pref": {...}`` in job.json (the names of ``ml.Preference``, TRL's): the CLI runs the DPO tenant beside an
    SFT one, and ``status`` shows its last accuracy and margin; a misspelt key is refused naming the key."""
    rows = [
        {"prompt": f"Say something {i}.", "chosen": " Thank you kindly!", "rejected": " no" + "." * (i + 1)}
        for i in range(6)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pref = {"name": "dpo", "data": "pairs.jsonl", "rank": 4, "max_steps": 3, "batch_size": 2, "lr": 0.01}
    job_json(tmp_path, llama_path, make_data, save_every=0)
    job = json.loads((tmp_path / "job.json").read_text())
    job["tenants"] = [job["tenants"][0], {**pref, "pref": {"beta": 0.5, "loss_type": "sigmoid"}}]
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = cli("run", "job.json", "--workdir", "runs", cwd=tmp_path, env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert ml.JobSpec.load(run_dir / "job.json").tenants[1].pref == ml.Preference(
        beta=0.5, loss_type="sigmoid"
    )
    proc = cli("status", str(run_dir), cwd=tmp_path, env={"COLUMNS": "200"})
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("tenant"))
    assert "rewards/accuracies" in header and "rewards/margins" in header, proc.stdout
    job["tenants"][1]["pref"] = {"bta": 0.5}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = cli("run", "job.json", "--workdir", "bad", cwd=tmp_path)
    assert proc.returncode != 0 and "pref: unknown field 'bta' (did you mean 'beta'?)" in proc.stderr
    assert not (tmp_path / "bad").exists()
