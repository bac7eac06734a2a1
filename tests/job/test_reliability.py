"""Nothing lost: one owner per run directory, graceful stops, truthful status and intact checkpoints on
a full disk; readers and the command line that never break on bad or rewritten files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import torch
from conftest import not_ours, write_jsonl
from test_isolation import good_tenants, job, long_text_rows

import mlora_lab as ml
from mlora_lab.job.trainer import SaveError, Trainer
from mlora_lab.lab import cli
from mlora_lab.lab.launch import prepare_run
from mlora_lab.rundir import RunState, TenantState, checkpoint, control, read_status, update_status
from mlora_lab.spec.job import JobSpec
from mlora_lab.validate import problems as spec_problems

# -- one owner per run directory ------------------------------------------------------------------------


def test_launching_into_a_directory_that_holds_a_run_is_refused(llama_path, tmp_path):
    spec = job(llama_path, good_tenants(tmp_path, max_steps=1), output_dir=str(tmp_path / "run"))
    run = prepare_run(spec)
    before = run.job.read_bytes()
    with pytest.raises(ml.SpecError, match=r"already holds a run; continue it with ml.resume"):
        ml.launch(spec)
    assert run.job.read_bytes() == before
    other = tmp_path / "not_empty"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ml.SpecError, match="not empty"):
        prepare_run(job(llama_path, good_tenants(tmp_path, max_steps=1), output_dir=str(other)))
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("round_", range(4))
def test_two_launches_racing_for_one_directory_exactly_one_wins(llama_path, tmp_path, round_):
    spec = job(llama_path, good_tenants(tmp_path, max_steps=1), output_dir=str(tmp_path / "run"))
    spec_problems(spec)  # warm the validation caches so both threads reach the directory together
    barrier, outcomes = threading.Barrier(2), []

    def go():
        barrier.wait()
        try:
            outcomes.append(prepare_run(spec))
        except ml.SpecError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [o for o in outcomes if not isinstance(o, Exception)]
    lost = [o for o in outcomes if isinstance(o, Exception)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert any(why in str(lost[0]) for why in ("already holds a run", "in use", "not empty")), lost[0]


def test_multi_node_settings_for_a_local_launch_start_nothing(llama_path, tmp_path):
    tenants = good_tenants(tmp_path, max_steps=1)
    tenants[0].rank = 0
    spec = job(
        llama_path, tenants, parallel=ml.Parallel(nproc=1, nnodes=2, fsdp=2), output_dir=str(tmp_path / "r")
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ml.SpecError) as err:
        ml.launch(spec)
    assert "nnodes = 2" in str(err.value) and "multinode.sh" in str(err.value) and "rank" in str(err.value)
    assert not (tmp_path / "r").exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# -- the training process stays lean ----------------------------------------------------------------------


def test_training_processes_never_import_the_notebook_side(llama_path, tmp_path):
    run = prepare_run(job(llama_path, good_tenants(tmp_path, max_steps=2), output_dir=str(tmp_path / "run")))
    out = tmp_path / "modules.json"
    script = (
        "import json, sys; from mlora_lab.job.__main__ import main; rc = main([sys.argv[1]]); "
        "json.dump({'rc': rc, 'loaded': sorted(m for m in ('pandas', 'matplotlib', 'ipywidgets') "
        "if m in sys.modules)}, open(sys.argv[2], 'w'))"
    )
    subprocess.run([sys.executable, "-c", script, str(run.root), str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["rc"] == 0 and not_ours(result["loaded"]) == [], result
    assert read_status(run.root).state == "finished"


# -- the command line: one clear line, no traceback ----------------------------------------------------------


def cli_error(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip(), err
    return err


def test_cli_says_one_clear_line_for_bad_files(tmp_path, capsys, llama_path):
    assert "not found" in cli_error(capsys, "run", str(tmp_path / "missing.json"))
    (tmp_path / "latin1.json").write_bytes(b'{"base_model": "\xe9"}')
    assert "UTF-8" in cli_error(capsys, "run", str(tmp_path / "latin1.json"))
    (tmp_path / "adir.json").mkdir()
    assert "directory" in cli_error(capsys, "run", str(tmp_path / "adir.json"))
    assert "not a run directory" in cli_error(capsys, "status", str(tmp_path))
    assert "not a run directory" in cli_error(capsys, "stop", str(tmp_path))
    assert "no such directory" in cli_error(capsys, "status", str(tmp_path / "nope"))
    assert "not a run directory" in cli_error(capsys, "resume", str(tmp_path))
    run = prepare_run(job(llama_path, good_tenants(tmp_path, max_steps=1), output_dir=str(tmp_path / "run")))
    run.status.write_text("{corrupt")
    assert "status.json: corrupt" in cli_error(capsys, "status", str(run.root))
    run.status.write_text('{"state": "finished"}')
    run.job.write_text("[1, 2]")
    assert "job.json" in cli_error(capsys, "status", str(run.root))


def test_runs_lists_the_good_runs_and_marks_the_broken_ones(llama_path, tmp_path):
    work = tmp_path / "runs"
    for name in ("good", "bad_status", "bad_job"):
        prepare_run(job(llama_path, good_tenants(tmp_path, max_steps=1), output_dir=str(work / name)))
    (work / "bad_status" / "status.json").write_text('{"state": ')
    (work / "bad_job" / "job.json").write_bytes(b"\xff\xfe")
    table = ml.runs(work).set_index("run")
    assert table.loc["good", "state"] == "starting" and pd.isna(table.loc["good", "problem"])
    assert table.loc["bad_status", "state"] == "broken" and "corrupt" in table.loc["bad_status", "problem"]
    assert table.loc["bad_job", "state"] == "broken" and "job.json" in table.loc["bad_job", "problem"]


# -- a full disk ------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs) that the test can fill; needs root, as CI has."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> None:
    """Use every free byte of ``disk``."""
    with open(disk / "filler", "ab", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)


def test_a_full_disk_loses_nothing_already_saved(llama_path, tmp_path, small_disk):
    """On a full disk a periodic save fails without ending the job and leaves every earlier
    checkpoint and adapter intact; the final save fails loudly (the run does not claim results)."""
    good = good_tenants(tmp_path, max_steps=6)
    trainer = Trainer(job(llama_path, good, save_every=1), run_dir=small_disk / "run")
    for _ in range(2):
        trainer.step()
        trainer.save(final=False)
    adapter_before = (small_disk / "run" / "adapters" / "a" / "adapter_model.safetensors").read_bytes()
    fill(small_disk)
    trainer.step()
    trainer.save(final=False)  # does not raise
    events = [r for r in trainer.history if r["kind"] == "event"]
    assert events[-1]["event"] == "save_failed" and "No space left" in events[-1]["message"]
    ckpts = checkpoint.checkpoint_dirs(small_disk / "run" / "checkpoints")
    assert [c.name for c in ckpts] == ["step_00000001", "step_00000002"]
    for c in ckpts:
        checkpoint.verify(c)
    assert (
        small_disk / "run" / "adapters" / "a" / "adapter_model.safetensors"
    ).read_bytes() == adapter_before
    assert not [p for p in (small_disk / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    trainer.step()  # training goes on
    assert trainer.tenants["a"].step == 4
    with pytest.raises(SaveError, match="No space left"):
        trainer.save(final=True)
    (small_disk / "filler").unlink()
    trainer.save(final=True)  # room again: everything is saved
    assert (
        checkpoint.read_checkpoint(checkpoint.latest_intact(small_disk / "run" / "checkpoints")[0])[
            "global_step"
        ]
        == 4
    )


def test_a_job_that_runs_out_of_disk_never_claims_success(llama_path, tmp_path, small_disk):
    """The real job process on a disk that fills up mid-run: it ends without a traceback taking down
    anything else, status.json is intact and says failed (or the run reads lost), and every checkpoint
    on disk is intact."""
    good = good_tenants(tmp_path, max_steps=12)
    run = prepare_run(job(llama_path, good, save_every=1, output_dir=str(small_disk / "run")))
    proc = subprocess.Popen([sys.executable, "-m", "mlora_lab.job", str(run.root)])
    try:
        deadline = time.monotonic() + 120
        while not checkpoint.checkpoint_dirs(run.checkpoints):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        fill(small_disk)
        assert proc.wait(timeout=180) == 1
    finally:
        proc.kill()
    state = ml.attach(run.root).status
    assert state in (RunState.FAILED, RunState.LOST), state
    if state is RunState.FAILED:
        assert "could not save" in read_status(run.root).error
    for c in checkpoint.checkpoint_dirs(run.checkpoints):
        checkpoint.verify(c)


# -- graceful on SIGINT, followers that survive a rewritten metrics file ------------------------------------


@pytest.mark.slow
def test_sigint_is_as_graceful_as_sigterm(llama_path, tmp_path):
    run = ml.launch(
        job(llama_path, good_tenants(tmp_path, max_steps=100_000), output_dir=str(tmp_path / "r"))
    )
    deadline = time.monotonic() + 120
    while not any(r["kind"] == "train" for r in run.rows()):
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.2)
    agent = psutil.Process(read_status(run.path).pid)
    for p in agent.children(recursive=True):
        if "mlora_lab.job" in " ".join(p.cmdline()):
            p.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends every rank
    assert run.wait(timeout=120) == "stopped", run.logs(0)
    assert run.adapter_path("a").is_dir()
    step = checkpoint.read_checkpoint(checkpoint.latest_intact(run.path / "checkpoints")[0])["global_step"]
    assert step >= 1 and "KeyboardInterrupt" not in run.logs(0, tail=None)


@pytest.mark.slow
def test_cli_resume_follows_a_metrics_file_the_resume_rewrites(llama_path, tmp_path):
    """Killed after its last checkpoint, a job has rows the resume drops and logs again: the
    ``mlora-lab resume`` follower notices the rewritten file and follows the job to the end."""
    good = good_tenants(tmp_path, max_steps=10)
    run = ml.launch(job(llama_path, good, save_every=4, output_dir=str(tmp_path / "r")))
    deadline = time.monotonic() + 180
    while run.global_step < 6:
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.05)
    run.kill()
    assert run.wait(30).final
    assert max(r["step"] for r in run.rows()) > 4, "there are rows after the checkpoint"
    proc = subprocess.run(
        [sys.executable, "-m", "mlora_lab.lab.cli", "resume", str(run.path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "final loss" in proc.stdout
    rows = [r for r in ml.attach(run.path).rows() if r["kind"] == "train"]
    steps = [(r["tenant"], r["tenant_step"]) for r in rows]
    assert len(steps) == len(set(steps)) and ("a", 10) in steps and ("b", 10) in steps
    events = [r for r in ml.attach(run.path).rows() if r["kind"] == "event"]
    assert events and events[-1]["event"] == "resumed"


def test_a_deleted_metrics_file_is_recreated_by_the_job(llama_path, tmp_path):
    good = good_tenants(tmp_path, max_steps=4)
    trainer = Trainer(job(llama_path, good), run_dir=tmp_path / "run")
    trainer.step()
    (tmp_path / "run" / "metrics.jsonl").unlink()
    trainer.train()
    rows = ml.attach(tmp_path / "run").rows()
    assert rows[0]["kind"] == "event" and rows[0]["event"] == "metrics_recreated"
    assert [r["tenant_step"] for r in rows if r["kind"] == "train" and r["tenant"] == "a"] == [2, 3, 4]
    assert ml.Run(tmp_path / "run").tenant_state("a") is TenantState.FINISHED


def test_a_corrupt_line_in_metrics_is_skipped_by_every_reader(llama_path, tmp_path):
    trainer = Trainer(job(llama_path, good_tenants(tmp_path, max_steps=2)), run_dir=tmp_path / "run")
    trainer.step()
    with open(tmp_path / "run" / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind": "train", "tenant": 1}\n\xde\xad\n')
    trainer.train()
    run = ml.attach(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl line \d+: skipped"):
        table = run.metrics()
    assert list(table[table["tenant"] == "a"]["tenant_step"]) == [1, 2]
    assert ml.summary(run).set_index("tenant").loc["a", "steps"] == 2
    write_jsonl(tmp_path / "unused.jsonl", long_text_rows())


@pytest.mark.slow
def test_a_launched_job_listens_on_loopback_only(llama_path, tmp_path):
    """``ml.launch`` starts torchrun on the loopback rendezvous: while a 2-process job trains, every
    socket any of its processes listens on is bound to 127.0.0.1."""
    import ipaddress

    spec = job(
        llama_path,
        good_tenants(tmp_path, max_steps=100_000),
        parallel=ml.Parallel(nproc=2, fsdp=2),
        output_dir=str(tmp_path / "r"),
    )
    run = ml.launch(spec)
    deadline = time.monotonic() + 120
    while not any(r["kind"] == "train" for r in run.rows()):
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.2)
    agent = psutil.Process(read_status(run.path).pid)
    listening = [
        (p.pid, c.laddr.ip, c.laddr.port)
        for p in [agent, *agent.children(recursive=True)]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert run.stop(timeout=120) == "stopped"
    assert listening and all(ipaddress.ip_address(ip).is_loopback for _, ip, _ in listening), listening


def job_workers(run_dir: Path) -> list[psutil.Process]:
    """Every live ``mlora_lab.job`` process of ``run_dir`` on this machine, found by command line
    (torchrun starts each worker in a session of its own, so it is nobody's child once its agent dies)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "mlora_lab.job" in cmd and str(run_dir) in cmd:
            found.append(p)
    return found


def wait_gone(run_dir: Path, timeout: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := job_workers(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def training_on_two_ranks(llama_path: str, tmp_path: Path) -> ml.Run:
    """A 2-process FSDP2 job with no end in sight, once it has taken a couple of steps."""
    good = good_tenants(tmp_path, max_steps=100_000)
    run = ml.launch(
        job(llama_path, good, output_dir=str(tmp_path / "r"), parallel=ml.Parallel(nproc=2, fsdp=2))
    )
    deadline = time.monotonic() + 180
    while run.global_step < 2:
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.1)
    return run


@pytest.mark.slow
def test_kill_leaves_no_worker_behind(llama_path, tmp_path):
    """``run.kill()`` ends the workers too: torchrun puts them in sessions of their own, out of reach of
    a kill of the agent's process group (they used to train on as orphans)."""
    run = training_on_two_ranks(llama_path, tmp_path)
    assert len(job_workers(run.path)) >= 2  # the agent (its command line names the module too) and 2 workers
    run.kill()
    assert not wait_gone(run.path, timeout=15), "workers outlived run.kill()"
    assert ml.attach(run.path).status == "stopped"


@pytest.mark.slow
def test_workers_end_when_their_agent_is_killed(llama_path, tmp_path):
    """SIGKILL of the torchrun agent alone (the OOM killer, a careless kill -9): the workers notice that
    their parent is gone and exit, and the run reads as failed or lost, never running."""
    run = training_on_two_ranks(llama_path, tmp_path)
    os.kill(read_status(run.path).pid, signal.SIGKILL)
    assert not wait_gone(run.path, timeout=30), "workers outlived their agent"
    assert "the torchrun agent" in run.logs(0) + run.logs(1)
    assert ml.attach(run.path).status in ("failed", "lost")


# -- links planted in a run: refused, and said in the run's error (issue 22) -----------------------------


def resumable_run(llama_path, tmp_path: Path) -> Path:
    """A stopped run with one checkpoint (trained in this process), ready for ``ml.resume``."""
    good = good_tenants(tmp_path, max_steps=3)
    run = prepare_run(job(llama_path, good, output_dir=str(tmp_path / "r")))
    trainer = Trainer(JobSpec.load(run.job), run_dir=run.root)
    trainer.step()
    trainer.save_checkpoint()
    trainer.close()
    update_status(run.root, state=RunState.STOPPED, ended=time.time())
    return run.root


@pytest.mark.parametrize("planted", ["logs/launcher.log", "logs"])
def test_resume_never_appends_through_a_planted_log_link(llama_path, tmp_path, planted):
    """A symlink planted at logs/launcher.log (or at logs/) of a stopped run: the resume refuses it,
    naming the link, before it changes anything or starts a process; the file the link leads to keeps
    its content (the launcher used to append torchrun's output to it)."""
    root = resumable_run(llama_path, tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "launcher.log").write_text("original\n")
    link = root / planted
    if link.is_dir():
        for p in link.iterdir():
            p.unlink()
        link.rmdir()
    link.symlink_to(victim if planted == "logs" else victim / "launcher.log")
    with pytest.raises(ml.SpecError, match=r"logs.* is a symbolic link"):
        ml.resume(root)
    assert (victim / "launcher.log").read_text() == "original\n" and len(list(victim.iterdir())) == 1
    status = read_status(root)
    assert status.state is RunState.STOPPED and status.pid is None


def test_a_refused_rank_log_link_is_the_runs_error(llama_path, tmp_path):
    """logs/rank0.log planted as a symlink whose target's name holds a newline: the job refuses to
    write through it, says so in the run's error (status.json, ``run.error``), and no line of the name
    reaches any output as a line of its own."""
    run = prepare_run(job(llama_path, good_tenants(tmp_path, max_steps=2), output_dir=str(tmp_path / "r")))
    injected = "INJECTED: a whole line of the attacker's choosing"
    victim = tmp_path / f"victim\n{injected}"
    (run.logs / "rank0.log").symlink_to(victim)
    proc = subprocess.run(
        [sys.executable, "-m", "mlora_lab.job", str(run.root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert injected not in output.splitlines() and not victim.exists()
    status = read_status(run.root)
    assert status.state is RunState.FAILED, (status, output[-2000:])
    assert "rank0.log" in status.error and "symbolic link" in status.error and "\n" not in status.error
    assert ml.attach(run.root).error == status.error


def test_a_run_that_cannot_start_is_failed_with_the_cause(llama_path, tmp_path, monkeypatch):
    """Anything that goes wrong between creating the run directory and the job writing ``running``
    (here: the process cannot be started) ends the run ``failed`` with the cause, never ``starting``
    for ever."""
    from mlora_lab.lab.launchers import local as launcher

    def no_process(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(launcher.subprocess, "Popen", no_process)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        ml.launch(job(llama_path, good_tenants(tmp_path, max_steps=2), output_dir=str(tmp_path / "r")))
    status = read_status(tmp_path / "r")
    assert status.state is RunState.FAILED and "Cannot allocate memory" in status.error
    assert ml.attach(tmp_path / "r").status is RunState.FAILED


# -- a full disk: said in status, and stop needs no space (issue 22) -------------------------------------


def test_status_json_is_written_on_a_full_disk_and_the_disk_stays_full(small_disk):
    """The job keeps some space allocated (``.spare``): on a full disk, status.json (a save failure
    while the run goes on, or the run's end) is still written, again and again, and what the spare
    freed is taken back at once (the disk stays full: nothing else fills the room it made)."""
    from mlora_lab.rundir import RunDir, record_problem
    from mlora_lab.rundir.files import SPARE, reserve_spare

    run = RunDir(small_disk / "run").create()
    update_status(run.root, state=RunState.RUNNING)
    assert reserve_spare(run.root) == 256 << 10
    fill(small_disk)
    for i in range(5):
        record_problem(run.root, f"saving failed at step {i}: No space left on device")
        assert read_status(run.root).error.startswith(f"saving failed at step {i}")
        with pytest.raises(OSError, match="No space left"):
            control.request_stop(run.root)  # the room the spare made is taken back
    record_problem(run.root, None)
    assert read_status(run.root).error is None and read_status(run.root).state is RunState.RUNNING
    update_status(run.root, state=RunState.FAILED, error="rank 0: SaveError: could not save")
    assert read_status(run.root).state is RunState.FAILED
    assert (run.root / SPARE).stat().st_size > 200 << 10
    record_problem(run.root, "too late")  # a final state and its error are never touched
    assert read_status(run.root).error == "rank 0: SaveError: could not save"


def test_another_writer_taking_the_room_the_spare_made_does_not_cost_the_last_status(small_disk):
    """A served job on a full disk once ended ``failed`` with "exited (code 1) without a final status":
    the whole spare was freed for one status write, another writer of the disk filled that room before
    the spare was taken back, and the run's last status then found no spare. The spare is freed a piece
    at a time: a thief that takes the first piece leaves the next one for the status."""
    from mlora_lab.rundir import RunDir
    from mlora_lab.rundir.files import (
        SPARE,
        SPARE_BYTES,
        SPARE_PIECE,
        atomic_write_json,
        reserve_spare,
        with_spare,
    )

    run = RunDir(small_disk / "run").create()
    update_status(run.root, state=RunState.RUNNING)
    assert reserve_spare(run.root) == SPARE_BYTES
    fill(small_disk)
    tries = []

    def write_status_after_a_thief():
        tries.append(len(tries))
        if len(tries) == 2:
            fill(small_disk)  # another writer takes the piece the spare just freed
        atomic_write_json(run.status, {"state": "failed", "error": "could not save"}, root=run.root)

    with_spare(run.root, write_status_after_a_thief)
    assert len(tries) == 3 and read_status(run.root).state is RunState.FAILED
    assert (run.root / SPARE).stat().st_size >= SPARE_BYTES - 2 * SPARE_PIECE - (8 << 10)
    update_status(run.root, error="still said")  # and again, on the same full disk
    assert read_status(run.root).error == "still said"


def test_a_full_disk_is_said_in_status_and_stop_needs_no_space(llama_path, tmp_path, small_disk, monkeypatch):
    """A launched job on a disk that fills up: while every save fails, the run still reads ``running``
    and says why in status.json, ``run.error`` and the dashboard's header; ``run.stop()`` on the full
    disk stops it gracefully (a signal instead of the control file it cannot write), and the run ends
    saying what it could not save rather than ``killed``.

    The job's ranks are frozen (SIGSTOP) from the second fill until the stop's signal is sent: a job
    that trains frees room now and then (a failed save's temporary files, a piece of its spare while it
    writes status.json), so a disk filled beside it is full only for a moment, and the stop file once
    found room (no signal sent: the test asked nothing)."""
    from mlora_lab.lab.dashboard import Dashboard
    from mlora_lab.rundir.status import is_job_command

    good = good_tenants(tmp_path, max_steps=100_000)
    run = ml.launch(job(llama_path, good, save_every=1, output_dir=str(small_disk / "run")))
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not checkpoint.checkpoint_dirs(run.path / "checkpoints"):
            assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
            time.sleep(0.1)
        fill(small_disk)
        deadline = time.monotonic() + 120
        while "No space left" not in (read_status(run.path).error or ""):
            assert run.status == "running" and time.monotonic() < deadline, run.logs(0)
            time.sleep(0.2)
        assert run.status == "running" and "saving failed" in run.error
        dash = Dashboard([run], interactive=False)
        dash.refresh()
        assert "No space left" in dash.status.value
        agent = psutil.Process(run.liveness.process.pid)
        ranks += [p for p in agent.children(recursive=True) if is_job_command(p.cmdline())]
        assert ranks
        for p in ranks:
            p.suspend()
        signalled = []
        signal_stop = run.liveness.signal_stop

        def signal_then_thaw() -> None:
            signal_stop()
            signalled.append(True)
            for p in ranks:
                p.resume()

        monkeypatch.setattr(run.liveness, "signal_stop", signal_then_thaw)
        fill(small_disk)  # again: a save that failed meanwhile may have freed its temporary files' space
        with pytest.raises(OSError):
            control.request_stop(run.path)  # the disk is full indeed
        state = run.stop(timeout=120)
    finally:
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.resume()
        run.kill()
    assert signalled, "the stop went through the control file, not a signal"
    assert state.final and run.error != "killed", (state, run.error, run.logs(0))
    assert state is RunState.STOPPED or "could not save" in run.error, (state, run.error)


# -- resume: a tenant that no longer fits its checkpoint is named, held and never lost -----------------------


def stopped_at_step_2(llama_path: str, tmp_path: Path, **kw) -> tuple[Path, list[ml.Tenant]]:
    """A run of tenants a and b (4 steps each) with checkpoints at steps 1 and 2, as a stop leaves it."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    good = good_tenants(tmp_path, max_steps=4)
    trainer = Trainer(job(llama_path, good, **kw), run_dir=tmp_path / "run")
    for _ in range(2):
        trainer.step()
        trainer.save(final=False)
    trainer.close()
    return tmp_path / "run", good


def resume_in_process(run: Path) -> Trainer:
    trainer = Trainer(ml.JobSpec.load(run / "job.json"), run_dir=run, resume=True)
    trainer.train()
    trainer.close()
    return trainer


def edit_job(run: Path, **fields) -> None:
    d = json.loads((run / "job.json").read_text())
    d["tenants"][0].update(fields)
    (run / "job.json").write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("fewer_rows", "its training data changed since the checkpoint (5 rows now, 16 then"),
        ("same_count_other_rows", "its training data changed since the checkpoint (16 rows now, 16 then"),
        ("rank", "job.json gives it rank=8 where its checkpoint has rank=4"),
        ("targets", "job.json gives it target_modules=['q_proj'] where its checkpoint has target_modules"),
    ],
)
def test_a_tenant_that_no_longer_fits_its_checkpoint_is_named_held_and_resumed_once_put_back(
    llama_path, tmp_path, change, why
):
    """Resuming after a tenant's data changed (fewer rows, or as many with other content: that one
    resumed silently) or its rank or targets changed in job.json gave a message naming no tenant, or
    none at all. Now that tenant is held back with why, naming it; the others resume; its state stays in
    every checkpoint, and once the change is undone a resume continues it from there."""
    run, good = stopped_at_step_2(llama_path, tmp_path)
    data = Path(good[0].data)
    original = data.read_bytes()
    if change == "fewer_rows":
        write_jsonl(data, long_text_rows(5, seed=1))
    elif change == "same_count_other_rows":
        write_jsonl(data, long_text_rows(16, seed=7))
    elif change == "rank":
        edit_job(run, rank=8)
    else:
        edit_job(run, target_modules=["q_proj"])
    adapter = (run / "adapters" / "a" / "adapter_model.safetensors").read_bytes()
    resumed = resume_in_process(run)
    assert "a" not in resumed.tenants and resumed.tenants["b"].state is TenantState.FINISHED
    reason = resumed.unstarted["a"]
    assert reason.startswith("could not be resumed: ") and why in reason, reason
    rows = [r for r in resumed.history if r["kind"] == "tenant" and r["tenant"] == "a"]
    assert rows[-1]["state"] == "failed" and why in rows[-1]["reason"]
    assert (run / "adapters" / "a" / "adapter_model.safetensors").read_bytes() == adapter, "not written over"
    # put right: the next resume continues a from its checkpointed step 2 to its end
    data.write_bytes(original)
    edit_job(run, rank=4, target_modules=["q_proj", "v_proj"])
    again = resume_in_process(run)
    assert again.tenants["a"].state is TenantState.FINISHED and again.tenants["a"].step == 4
    steps = [r["tenant_step"] for r in again.history if r["kind"] == "train" and r["tenant"] == "a"]
    assert steps == [3, 4]


def test_a_renamed_tenant_does_not_train_beside_its_old_name(llama_path, tmp_path):
    """Renaming a tenant in job.json before a resume trained both: the new name from scratch and the
    old one from the checkpoint. The old one is held (its state kept, the rename suggested); only the
    tenants job.json lists train."""
    run, _ = stopped_at_step_2(llama_path, tmp_path)
    edit_job(run, name="a2")
    resumed = resume_in_process(run)
    assert sorted(resumed.tenants) == ["a2", "b"]
    assert "job.json no longer lists it (renamed to 'a2'?)" in resumed.unstarted["a"]
    saved = checkpoint.read_checkpoint(checkpoint.latest_intact(run / "checkpoints")[0])
    assert saved["tenants"]["a"]["step"] == 2, "a's state is kept in the checkpoints"


def test_Q6_a_base_setting_changed_in_job_json_is_held_back_on_resume(llama_path, tmp_path):
    """Q6: the base's ``dtype`` (as its ``quantize``, tests/test_quantize.py) edited in job.json before a
    resume was taken silently: the adapters then went on over another base. It is held back, as a changed
    rank is: the resume keeps the checkpoint's setting, says so (a ``warning`` event and the log), puts
    job.json back, and continues as if never cut; a resume with job.json untouched says nothing."""
    run, _ = stopped_at_step_2(llama_path, tmp_path)
    straight, _ = stopped_at_step_2(llama_path, tmp_path / "straight")
    d = json.loads((run / "job.json").read_text())
    assert d["dtype"] == "auto"
    d["dtype"] = "bfloat16"
    (run / "job.json").write_text(json.dumps(d))
    resumed = resume_in_process(run)
    assert resumed.spec.dtype == "auto" and json.loads((run / "job.json").read_text())["dtype"] == "auto"
    assert resumed.model.model.get_input_embeddings().weight.dtype == torch.float32
    (warning,) = [r for r in resumed.history if r["kind"] == "event" and r["event"] == "warning"]
    assert "dtype='bfloat16' is held back" in warning["message"] and "dtype='auto'" in warning["message"]
    untouched = resume_in_process(straight)
    assert not [r for r in untouched.history if r["kind"] == "event" and r["event"] == "warning"]
    assert untouched.losses("a") == resumed.losses("a") and untouched.losses("b") == resumed.losses("b")


def recommit(path: Path, edit) -> None:
    """Change a checkpoint's state.json and write checksums that match it (a crafted checkpoint)."""
    state = json.loads((path / "state.json").read_text())
    edit(state)
    (path / "state.json").write_text(json.dumps(state))
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["state.json"] = {
        "bytes": (path / "state.json").stat().st_size,
        "sha256": checkpoint._digest(path / "state.json"),
    }
    (path / "meta.json").write_text(json.dumps(meta))


def rename_a(state: dict, to: str) -> None:
    state["tenants"][to] = state["tenants"].pop("a")
    state["tenants"][to]["spec"]["name"] = to


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda s: rename_a(s, "../.."), "tenant name '../..' is not a safe name"),
        (lambda s: s.update(global_step=1e30), "global_step must be a whole number from 0 to 2**53-1"),
        (lambda s: s["tenants"]["a"].update(step=-3), "tenant 'a': step must be a whole number"),
        (lambda s: s["tenants"]["a"]["spec"].update(name="b"), "does not hold its own spec"),
    ],
)
def test_a_crafted_checkpoint_is_refused_and_the_previous_one_used(llama_path, tmp_path, edit, why):
    """A checkpoint's checksums show it is the one written, not that its content is sane: tenant names
    (``../..`` trained until the final save) and steps (global_step 1e30 gave a bare TypeError) are
    checked on load; such a checkpoint is skipped, saying why, for the previous intact one."""
    run, _ = stopped_at_step_2(llama_path, tmp_path)
    newest = checkpoint.checkpoint_dirs(run / "checkpoints")[-1]
    assert newest.name == "step_00000002"
    recommit(newest, edit)
    resumed = Trainer(ml.JobSpec.load(run / "job.json"), run_dir=run, resume=True)
    skipped = [r for r in resumed.history if r["kind"] == "event" and r["event"] == "checkpoint_skipped"]
    assert skipped and why in skipped[0]["message"] and "step_00000002" in skipped[0]["message"]
    assert resumed.global_step == 1 and sorted(resumed.tenants) == ["a", "b"]
    resumed.train()
    assert not (run / "adapters" / ".." / "..").resolve().joinpath("adapter_config.json").exists()
    (older,) = [c for c in checkpoint.checkpoint_dirs(run / "checkpoints") if c != newest]
    recommit(older, edit)  # every one crafted: nothing to resume from
    with pytest.raises(FileNotFoundError, match=re.escape(why)):
        Trainer(ml.JobSpec.load(run / "job.json"), run_dir=run, resume=True)


def test_one_mode_policy_for_the_run_directory(llama_path, tmp_path):
    """Adapter weights were written 0600 (safetensors) while their config followed the umask. Every file
    of a run is 0644 and every directory 0755, less the umask: readable by others under umask 022, by
    nobody else under 077."""
    for mask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o077, 0o600, 0o700)):
        old = os.umask(mask)
        try:
            run, _ = stopped_at_step_2(llama_path, tmp_path / f"umask{mask:o}")
        finally:
            os.umask(old)
        found = {p: p.stat().st_mode & 0o777 for p in run.rglob("*") if not p.is_symlink()}
        files = {p.relative_to(run): m for p, m in found.items() if p.is_file() and p.name != ".lock"}
        dirs = {p.relative_to(run): m for p, m in found.items() if p.is_dir()}
        assert Path("adapters/a/adapter_model.safetensors") in files and Path("job.json") in files
        assert {m for m in files.values()} == {file_mode}, {str(p): oct(m) for p, m in files.items()}
        assert {m for m in dirs.values()} == {dir_mode}, {str(p): oct(m) for p, m in dirs.items()}
