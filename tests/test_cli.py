"""End to end: the real CLI and launcher start torchrun on a tiny model and write the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import peft
import psutil
import pytest
import transformers

import mlora_lab as ml
from mlora_lab.rundir import read_status

pytestmark = pytest.mark.slow


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlora_lab.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def job_json(tmp_path: Path, base: str, make_data, **overrides) -> Path:
    make_data("reverse", name="alice")
    make_data("chat", name="bob")
    job = {
        "base_model": base,
        "tenants": [
            {"name": "alice", "data": "alice.jsonl", "rank": 4, "target_modules": ["q_proj", "v_proj"],
             "lr": 0.005, "max_steps": 6, "batch_size": 2},
            {"name": "bob", "data": "bob.jsonl", "rank": 8, "alpha": 8, "target_modules": ["o_proj", "down_proj"],
             "lr": 0.001, "max_steps": 4, "batch_size": 3, "grad_accum": 2},
        ],
        "seq_len": 64, "max_tenants": 4, "max_rank": 16, "save_every": 3,
    }  # fmt: skip
    job.update(overrides)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return path


def test_run_end_to_end(tmp_path, llama_path, make_data):
    job_json(tmp_path, llama_path, make_data)
    proc = cli("run", "job.json", "--workdir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert "alice" in proc.stdout and "final_loss" in proc.stdout
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
    system = [r for r in rows if r["kind"] == "system"]
    assert all(r["rank"] == 0 and r["mem_bytes"] > 0 and r["tokens_per_s"] > 0 for r in system)
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
    proc = cli("status", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0 and "finished" in proc.stdout


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


def test_demo_runs(tmp_path):
    proc = cli("demo", "--workdir", str(tmp_path / "demo"), "--steps", "12", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for tenant in ("reverse", "upper", "count"):
        assert tenant in proc.stdout
        assert (
            next((tmp_path / "demo" / "runs").iterdir()) / "adapters" / tenant / "adapter_config.json"
        ).is_file()
    assert (tmp_path / "demo" / "loss_curves.png").stat().st_size > 10_000


def test_demo_runs_with_moe_tenants(tmp_path):
    proc = cli(
        "demo", "--moe", "--workdir", str(tmp_path / "demo"), "--steps", "6", cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "demo" / "runs").iterdir())
    config = json.loads((run_dir / "adapters" / "reverse" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


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


def test_stop_is_graceful(tmp_path, llama_path, make_data):
    run = ml.launch(long_spec(tmp_path, llama_path, make_data))
    wait_for_training(run)
    assert run.stop(timeout=120) == "stopped"
    assert run.adapter_path("slow").is_dir()
    assert any((run.path / "checkpoints").glob("step_*/tensors.safetensors"))
    assert read_status(run.path).process.alive() is False


def test_killed_rank_marks_run_failed(tmp_path, llama_path, make_data):
    run = ml.launch(long_spec(tmp_path, llama_path, make_data))
    wait_for_training(run)
    launcher = psutil.Process(read_status(run.path).pid)
    workers = [p for p in launcher.children(recursive=True) if "mlora_lab.train" in " ".join(p.cmdline())]
    assert workers, "the trainer runs as a child of torchrun"
    os.kill(workers[0].pid, 9)
    assert run.wait(timeout=60) == "failed"
    assert run.error
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


def test_local_launcher_script(tmp_path, llama_path, make_data):
    job_json(tmp_path, llama_path, make_data, output_dir="out")
    root = Path(__file__).resolve().parents[1]
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
