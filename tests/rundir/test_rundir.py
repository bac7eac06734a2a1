"""The run directory as a protocol, attacked: crafted control messages, pickles planted as checkpoints,
stale pids, stray and rewritten files, symlinks, races for one directory."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from mlora_lab.rundir import (
    CheckpointError,
    CompletionRow,
    ControlError,
    ControlResult,
    EventKind,
    EventRow,
    HeldoutRow,
    MetricsReader,
    MetricsWriter,
    ProcessIdentity,
    Row,
    RowKind,
    RunDir,
    RunDirError,
    RunLock,
    RunState,
    Status,
    SystemRow,
    TenantRow,
    TenantState,
    TrainRow,
    atomic_directory,
    checkpoint,
    control,
    read_status,
    update_status,
)
from mlora_lab.rundir.rows import truncate_after
from mlora_lab.spec.job import JobSpec


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "run").create()


# -- control messages: data, never paths ------------------------------------------------------------


def queue(run: RunDir, name: str, content: bytes | str) -> Path:
    path = run.control / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def test_send_makes_library_ids_and_the_job_reads_them_back(run):
    msg_id = control.send(run.root, "pause", name="alice")
    assert len(msg_id) == 32 and int(msg_id, 16) >= 0
    (item,) = control.incoming(run.root)
    assert item.problem is None and item.message.id == msg_id and item.message.name == "alice"


@pytest.mark.parametrize(
    "crafted_id",
    [
        "../../x",
        "/tmp/evil",
        "../../other_run/job",
        "a" * 31,
        "A" * 32,
        "g" * 32,
        "0" * 32 + "/..",
        "",
        "..",
        "\x00" * 32,
    ],
)
def test_a_crafted_message_id_never_becomes_a_path(run, tmp_path, crafted_id):
    """The id inside a message cannot steer where the result goes: the file is rejected with its
    reason and nothing is written outside the run (another run's job.json stays as it was)."""
    other = RunDir(tmp_path / "other_run").create()
    other.job.write_text('{"untouched": true}')
    before = {p for p in tmp_path.rglob("*") if p.is_file()}
    name = f"{time.time_ns():020d}-{'0' * 32}.json"
    queue(run, name, json.dumps({"id": crafted_id, "op": "pause", "name": "a"}))
    (item,) = control.incoming(run.root)
    assert item.message is None and "id" in item.problem
    control.reject(run.root, item, step=0)
    assert other.job.read_text() == '{"untouched": true}'
    created = {p for p in tmp_path.rglob("*") if p.is_file()} - before
    assert all(run.root in p.parents for p in created), created
    assert "differs" in (run.control / "rejected" / f"{name}.reason").read_text()
    with pytest.raises(ValueError, match="not a control message id"):
        control.read_result(run.root, crafted_id)


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("0001-x.json", "{}", "file name"),
        ("../escape.json", "{}", None),  # not even listed: only direct children are read
        (f"{1:020d}-{'a' * 32}.json", b"\xff\xfe not utf-8", "UTF-8"),
        (f"{2:020d}-{'b' * 32}.json", "{not json", "not valid JSON"),
        (f"{3:020d}-{'c' * 32}.json", "[" * 100_000 + "]" * 100_000, "JSON"),
        (f"{4:020d}-{'d' * 32}.json", json.dumps({"id": "d" * 32, "op": "explode"}), "'op'"),
        (f"{5:020d}-{'e' * 32}.json", json.dumps({"id": "e" * 32, "op": "remove", "name": ["a"]}), "name"),
        (
            f"{6:020d}-{'f' * 32}.json",
            json.dumps({"id": "f" * 32, "op": "remove", "name": "../../x"}),
            "name",
        ),
        (f"{7:020d}-{'1' * 32}.json", json.dumps({"id": "1" * 32, "op": "add", "tenant": "alice"}), "tenant"),
        (
            f"{8:020d}-{'2' * 32}.json",
            json.dumps({"id": "2" * 32, "op": "pause", "name": "a", "x": 1}),
            "unknown",
        ),
        (f"{9:020d}-{'3' * 32}.json", " " * (2 << 20), "bytes"),
        # JSON parses it, but passing it between ranks (pickled) would overflow the stack
        (
            f"{10:020d}-{'4' * 32}.json",
            '{"id": "' + "4" * 32 + '", "op": "add", "tenant": {"name": ' + "[" * 500 + "]" * 500 + "}}",
            "nested",
        ),
    ],
)
def test_hostile_message_files_are_rejected_with_a_reason(run, name, content, reason):
    if name.startswith(".."):
        (run.root / "escape.json").write_text("{}")
        assert control.incoming(run.root) == []
        return
    queue(run, name, content)
    (item,) = control.incoming(run.root)
    assert item.message is None and reason in item.problem, item.problem
    control.reject(run.root, item, step=3)
    assert not (run.control / name).exists()
    assert (run.control / "rejected" / name).exists()
    if item.msg_id:  # a well-formed id gets an answer, so a waiting caller learns why
        with pytest.raises(ControlError, match="rejected"):
            control.wait_result(run.root, item.msg_id, timeout=1)


def test_symlinked_message_is_rejected_and_its_target_untouched(run, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"id": "9" * 32, "op": "pause", "name": "a"}))
    name = f"{1:020d}-{'9' * 32}.json"
    (run.control / name).symlink_to(secret)
    (item,) = control.incoming(run.root)
    assert item.message is None and "regular file" in item.problem
    control.reject(run.root, item, step=0)
    assert secret.read_text().startswith("{") and (run.control / "rejected" / name).is_symlink()


def test_a_replayed_id_is_rejected_and_its_result_kept(run):
    msg_id = control.send(run.root, "pause", name="a")
    (item,) = control.incoming(run.root)
    control.finish(run.root, control.claim(run.root, item), control.ControlResult(msg_id, True, None, 4))
    replay = sorted((run.control / "done").iterdir())[0].read_bytes()
    queue(run, f"{time.time_ns():020d}-{msg_id}.json", replay)
    (again,) = control.incoming(run.root)
    assert again.message is None and "duplicate" in again.problem
    control.reject(run.root, again, step=9)
    assert control.read_result(run.root, msg_id).ok and control.read_result(run.root, msg_id).step == 4


def test_a_message_interrupted_by_a_crash_is_answered_and_never_replayed(run):
    msg_id = control.send(run.root, "remove", name="a")
    (item,) = control.incoming(run.root)
    control.claim(run.root, item)  # the job claimed it, then died
    assert control.interrupted(run.root, step=7) == [msg_id]
    assert control.incoming(run.root) == [] and not any((run.control / "applying").iterdir())
    with pytest.raises(ControlError, match="interrupted"):
        control.wait_result(run.root, msg_id, timeout=1)


def test_wait_result_reports_a_dead_job_and_refuses_bad_ids(run):
    msg_id = control.send(run.root, "pause", name="a")
    with pytest.raises(ControlError, match="ended before"):
        control.wait_result(run.root, msg_id, timeout=5, is_alive=lambda: False)
    with pytest.raises(ValueError):
        control.wait_result(run.root, "../../job", timeout=1)


# -- checkpoints: nothing unpickles; damage is found and skipped -------------------------------------


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['MLORA_PWNED']}",))


def test_a_pickled_checkpoint_is_refused_without_running_it(tmp_path, monkeypatch):
    """A crafted ``state.pt`` (a pickle that runs a command when loaded) is never unpickled: the
    checkpoint is refused with a clear reason, and the command never runs."""
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("MLORA_PWNED", str(pwned))
    ckpts = tmp_path / "checkpoints"
    step = ckpts / "step_00000005"
    step.mkdir(parents=True)
    (step / "state.pt").write_bytes(pickle.dumps({"global_step": 5, "x": _Evil()}))
    (step / "meta.json").write_text('{"global_step": 5}')  # what the old format had
    path, skipped = checkpoint.latest_intact(ckpts)
    assert path is None and "pickle" in skipped[0][1] and "can run code" in skipped[0][1]
    with pytest.raises(CheckpointError):
        checkpoint.read_checkpoint(step)
    # the same payload smuggled inside the new format's files is just bytes that fail to parse
    good = checkpoint.write_checkpoint(ckpts, 6, {"a": torch.ones(2)})
    (good / "state.json").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match=r"checksum|bytes"):
        checkpoint.read_checkpoint(good)
    assert not pwned.exists()


def test_checkpoint_round_trip_and_refusal_of_non_json_state(tmp_path):
    rng = torch.get_rng_state()
    tree = {
        "step": 3,
        "opt": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(3, 4)[:, :2]}},
        "window": [[[1, 2, 3], [-100, 2, 3]]],
        "loss": float("nan"),
        "rng": rng,
        "name": None,
    }
    back = checkpoint.read_checkpoint(checkpoint.write_checkpoint(tmp_path, 3, tree))
    assert back["opt"][0]["exp_avg"].equal(tree["opt"][0]["exp_avg"]) and back["rng"].equal(rng)
    assert back["window"] == tree["window"] and back["loss"] != back["loss"]
    with pytest.raises(TypeError, match="only JSON values and tensors"):
        checkpoint.write_checkpoint(tmp_path, 4, {"x": object()})
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step_00000003"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directory left"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "meta"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    for step in (2, 4):
        checkpoint.write_checkpoint(tmp_path, step, {"step": step, "w": torch.full((64,), float(step))})
    newest = tmp_path / "step_00000004"
    tensors = newest / "tensors.safetensors"
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-1] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif damage == "delete":
        tensors.unlink()
    else:
        (newest / "meta.json").write_text("{garbage")
    path, skipped = checkpoint.latest_intact(tmp_path)
    assert path.name == "step_00000002" and checkpoint.read_checkpoint(path)["step"] == 2
    assert [p.name for p, _ in skipped] == ["step_00000004"] and skipped[0][1]


# -- status: a pid is not an identity ----------------------------------------------------------------


@pytest.fixture
def stranger():
    """An unrelated process (not a training job) whose pid a stale status.json might name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_identity_needs_pid_start_time_host_and_a_job_command_line(stranger):
    me = ProcessIdentity.of(stranger.pid)
    assert me is not None and me.alive() is False, "a live process that is not a job is not the job"
    assert ProcessIdentity(stranger.pid, me.start_time - 1000, me.host).alive() is False
    assert ProcessIdentity(stranger.pid, me.start_time, "another-host").alive() is None


def test_a_stale_pid_makes_the_run_lost_and_stop_never_signals_it(tmp_path, stranger):
    """After a reboot the recorded pid belongs to someone else: the run reads ``lost`` (resumable),
    and ``stop``/``kill`` leave the stranger alone."""
    from mlora_lab.lab.runs.run import Run

    run = RunDir(tmp_path / "run").create()
    run.job.write_text("{}")
    me = ProcessIdentity.of(os.getpid())
    update_status(
        run.root, state="running", pid=stranger.pid, pid_start_time=time.time() - 3600, host=me.host
    )
    r = Run(run.root)
    assert r.status == RunState.LOST and "resume" in r.error
    assert read_status(run.root).state is RunState.RUNNING, "reading the state writes nothing"
    assert r.reconcile() == RunState.LOST
    assert read_status(run.root).state is RunState.LOST and "resume" in read_status(run.root).error
    update_status(run.root, state="running", error=None)
    r.kill()
    assert r.stop(timeout=1) in (RunState.LOST, RunState.STOPPED)
    assert stranger.poll() is None, "the unrelated process survived"
    assert psutil.Process(stranger.pid).status() != psutil.STATUS_ZOMBIE


@pytest.fixture
def job_like():
    """A process whose command line is a training job's (it names ``mlora_lab.job``) and that trains
    nothing: a live job as far as the identity check can tell."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "mlora_lab.job"], start_new_session=True
    )
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def boot_time_moves(monkeypatch):
    """The kernel's boot time moves forward by 1 s (as it did under a live served job): every
    wall-clock start derived from it (psutil's ``create_time()``) moves with it."""

    def move(by: float = 1.0) -> None:
        import psutil._pslinux as pslinux

        moved = psutil.boot_time() + by
        monkeypatch.setattr(pslinux, "boot_time", lambda: moved)
        monkeypatch.setattr(psutil, "boot_time", lambda: moved)

    return move


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="clock ticks since boot need /proc")
def test_M1_a_moved_boot_time_leaves_a_live_job_running_and_stoppable(tmp_path, job_like, boot_time_moves):
    """M1: the job's identity is its start in clock ticks since boot, which never moves: after the
    boot time moved by a second, the live job is ``running`` (not ``lost``), and ``stop`` signals it."""
    from mlora_lab.lab.runs.run import Run
    from mlora_lab.rundir.status import process_fields

    run = RunDir(tmp_path / "run").create()
    run.job.write_text("{}")
    me = ProcessIdentity.of(job_like.pid)
    update_status(run.root, state="running", **process_fields(me))
    recorded = json.loads(run.status.read_text())
    assert isinstance(recorded["pid_start_ticks"], int) and recorded["pid_boot_id"]
    boot_time_moves(1.0)
    assert abs(psutil.Process(job_like.pid).create_time() - me.start_time) >= 0.99, "the boot time moved"
    assert read_status(run.root).process.alive() is True
    r = Run(run.root)
    assert r.status == RunState.RUNNING and r.reconcile() == RunState.RUNNING
    r.kill()
    assert job_like.wait(timeout=30) is not None, "the live job was signalled"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="clock ticks since boot need /proc")
def test_M1_ticks_and_boot_tell_a_stranger_from_the_job(job_like):
    """M1: another start (ticks) or another boot is another process, whatever the wall clock says."""
    from mlora_lab.rundir.status import start_ticks

    me = ProcessIdentity.of(job_like.pid)
    assert me.start_ticks == start_ticks(job_like.pid) and me.alive() is True
    assert dataclasses.replace(me, start_ticks=me.start_ticks + 1).alive() is False
    assert dataclasses.replace(me, boot_id="another-boot").alive() is False


def test_M1_a_crafted_command_name_does_not_shift_the_fields(tmp_path):
    """M1: the command name (field 2) of ``/proc/<pid>/stat`` may hold ``) `` and digits; field 22 is
    counted after the last ``)``."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    from mlora_lab.rundir.status import start_ticks

    odd = tmp_path / "x) 1 2 3 (y"
    odd.symlink_to(shutil.which("sleep"))
    proc = subprocess.Popen([str(odd), "60"], start_new_session=True)
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        assert ") 1 2 3 (" in stat, "the command name holds the crafted text"
        since_boot = psutil.Process(proc.pid).create_time() - psutil.boot_time()
        assert start_ticks(proc.pid) / os.sysconf("SC_CLK_TCK") == pytest.approx(since_boot, abs=0.02)
    finally:
        proc.kill()
        proc.wait()


def test_M1_a_status_without_ticks_still_reads_after_the_boot_time_moved(tmp_path, job_like, boot_time_moves):
    """M1: a status.json written before ticks were kept (only the wall-clock start) is still read, and
    its job is still found after a 1 s move of the boot time; 1000 s off is another process."""
    run = RunDir(tmp_path / "run").create()
    me = ProcessIdentity.of(job_like.pid)
    run.status.write_text(
        json.dumps({"state": "running", "pid": me.pid, "pid_start_time": me.start_time, "host": me.host})
    )
    old = read_status(run.root).process
    assert old is not None and old.start_ticks is None
    boot_time_moves(1.0)
    assert old.alive() is True
    assert ProcessIdentity(me.pid, me.start_time - 1000, me.host).alive() is False


def test_corrupt_or_foreign_status_gives_a_clear_error(run):
    run.status.write_text("{half")
    with pytest.raises(RunDirError, match="corrupt"):
        read_status(run.root)
    run.status.write_text('{"state": "hacked"}')
    with pytest.raises(RunDirError, match="unknown state"):
        read_status(run.root)
    run.status.write_text('{"state": "running", "pid": "1; rm -rf /"}')
    with pytest.raises(RunDirError, match="pid"):
        read_status(run.root)
    update_status(run.root, state="failed", error="x")  # the truth replaces a corrupt file
    assert read_status(run.root) == Status(state=RunState.FAILED, error="x")


# -- metrics: readers never break; the writer survives deletion --------------------------------------


def test_reader_skips_corrupt_and_foreign_lines_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(HeldoutRow(step=1, tenant="a", loss=1.0))
    with open(path, "ab") as f:
        f.write(b"\x00\xff garbage\n")
        f.write(b'{"kind": "train", "step": "one"}\n')  # JSON, but not a train row
        f.write(b'{"hello": "world"}\n')
        f.write(b"[1, 2]\n")
    writer.write(HeldoutRow(step=2, tenant="a", loss=0.5))
    reader = MetricsReader(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = reader.poll()
    assert rows == [
        HeldoutRow(step=1, tenant="a", loss=1.0, time=rows[0].time),
        HeldoutRow(step=2, tenant="a", loss=0.5, time=rows[1].time),
    ]
    messages = [str(w.message) for w in caught]
    assert [m.split(" line ")[1].split(":")[0] for m in messages] == ["2", "3", "4", "5"], messages
    assert all(str(path) in m for m in messages) and reader.skipped == 4


UNSAFE_TENANTS = ["../../etc", "a/b", "x y", "", ".", "..", "n" * 101, "caf\u00e9"]


def unsafe_tenant_rows(step: int = 9) -> list[dict]:
    """Rows written by hand whose tenant (or evaluated model) is not a safe name: one of each kind."""
    rows = [
        {"kind": "train", "step": step, "tenant": bad, "tenant_step": 1, "loss": 1.0, "tokens": 1}
        | {"lr": None, "grad_norm": None, "time": 1.0}
        for bad in UNSAFE_TENANTS
    ]
    rows += [
        {"kind": "eval", "step": step, "tenant": "../x", "loss": 1.0, "time": 1.0},
        {"kind": "tenant", "step": step, "tenant": "../x", "state": "running", "time": 1.0},
        {"kind": "event", "step": step, "event": "warning", "tenant": "a/b", "time": 1.0},
        {"kind": "completion", "step": step, "tenant": "..", "tenant_step": 1, "prompt": "p"}
        | {"completion": "c", "reward": None, "time": 1.0},
        {"kind": "eval_metric", "step": step, "model": "../base", "eval": "e", "metric": "m", "value": 1.0},
        {"kind": "usage", "step": step, "key": "k", "tenant": "x/y", "tokens_trained": 1}
        | {"tokens_forward": 0, "tokens_sampled": 0, "busy_s": 0.0, "requests": 1},
    ]
    return rows


def test_D3_a_row_whose_tenant_is_not_a_safe_name_is_skipped_and_reported(tmp_path):
    """D3: a row written by hand naming a tenant that cannot name a directory (``../../etc``, ``.``, ...)
    is no row: every reader skips it with a warning naming file, line and field, as any malformed row."""
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(HeldoutRow(step=1, tenant="a", loss=1.0))
    bad = unsafe_tenant_rows()
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in bad)
    writer.write(HeldoutRow(step=2, tenant="b.c_d-9", loss=0.5))
    reader = MetricsReader(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = reader.poll()
    assert [(r.step, r.tenant) for r in rows] == [(1, "a"), (2, "b.c_d-9")]
    messages = [str(w.message) for w in caught]
    assert reader.skipped == len(bad) == len(messages)
    assert all("is not a safe name" in m and str(path) in m for m in messages), messages[:2]
    assert "its model is not a safe name" in messages[-2] and "its tenant" in messages[-1]
    for r in bad:
        with pytest.raises(ValueError, match="not a safe name"):
            Row.from_dict(r)


def test_no_text_makes_a_row_or_a_file_unwritable(run):
    """A reason quoting hostile input may hold a lone surrogate (not valid UTF-8): it is escaped."""
    writer = MetricsWriter(run.metrics)
    writer.write(
        TenantRow(step=1, tenant="x", state=TenantState.REFUSED, reason="no such file: '\ud800.jsonl'")
    )
    (row,) = MetricsReader(run.metrics).poll()
    assert row.state is TenantState.REFUSED and "\\ud800" in row.reason
    item = control.Incoming(queue(run, f"{1:020d}-{'5' * 32}.json", "{"), None, "bad \udcff name", "5" * 32)
    control.reject(run.root, item, step=0)
    assert "\\udcff" in (run.control / "rejected" / f"{1:020d}-{'5' * 32}.json.reason").read_text()


def test_reader_notices_a_rewritten_or_replaced_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in range(1, 6):
        writer.write(
            TrainRow(step=step, tenant="a", tenant_step=step, loss=1.0, tokens=3, lr=0.1, grad_norm=1.0)
        )
    reader = MetricsReader(path)
    assert len(reader.poll()) == 5 and reader.generation == 0
    truncate_after(path, 2)  # what a resume does: drop rows after its checkpoint
    rows = reader.poll()
    assert reader.generation == 1 and [r.step for r in reader.rows] == [1, 2] and rows == reader.rows
    with open(path, "w") as f:  # truncated in place, same inode
        f.write("")
    reader.poll()
    assert reader.generation == 2 and reader.rows == []


def test_rows_are_typed_and_every_kind_round_trips(tmp_path):
    """The reader gives each line's typed row (the writer's own rows, equal field by field); a field a
    newer writer added is dropped; a row of a layout seen before is still checked for its enum values;
    a bad line is skipped with a warning that names the field."""
    path = tmp_path / "metrics.jsonl"
    written = [
        TrainRow(
            step=1,
            tenant="a",
            tenant_step=1,
            loss=2.0,
            tokens=3,
            lr=0.1,
            grad_norm=1.0,
            rows_seen=2,
            tokens_seen=3,
        ),
        HeldoutRow(step=1, tenant="a", loss=1.5),
        SystemRow(step=1, rank=0, mem_bytes=1, peak_mem_bytes=2, step_time=0.1, tokens_per_s=30.0),
        TenantRow(step=1, tenant="a", state="paused", adapter_bytes=10, reason="asked"),
        EventRow(step=1, event=EventKind.RESUMED, message="from step_1"),
    ]
    writer = MetricsWriter(path)
    for row in written:
        writer.write(row)
    writer.close()
    rows = MetricsReader(path).poll()
    assert rows == written and rows[3].state is TenantState.PAUSED and rows[4].event is EventKind.RESUMED
    assert [Row.from_dict(json.loads(line)) for line in path.read_text().splitlines()] == written
    assert [r.to_dict() for r in rows] == [json.loads(line) for line in path.read_text().splitlines()]
    newer = {**written[1].to_dict(), "perplexity": 4.5}
    assert Row.from_dict(newer) == written[1] and "perplexity" in newer  # (the dict is left as it was)
    with open(path, "a") as f:  # the layout of the tenant row above, with a state no tenant is ever in
        f.write(json.dumps({**written[3].to_dict(), "state": "hacked"}) + "\n")
    reader = MetricsReader(path)
    with pytest.warns(
        RuntimeWarning,
        match=r"line 6: skipped \(not a metrics row: Invalid enum value 'hacked' - at `\$.state`\)",
    ):
        assert reader.poll() == written
    with pytest.raises(ValueError, match=r"Invalid value 'secret' - at `\$.kind`"):
        Row.from_dict({"kind": "secret"})


def test_writer_recreates_a_deleted_file_and_never_follows_a_symlink(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(HeldoutRow(step=1, tenant="a", loss=1.0))
    path.unlink()
    writer.write(HeldoutRow(step=2, tenant="a", loss=1.0))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["event", "eval"] and rows[0]["event"] == EventKind.METRICS_RECREATED
    writer.close()
    target = tmp_path / "bashrc"
    target.write_text("original\n")
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(OSError):
        MetricsWriter(path)
    assert target.read_text() == "original\n"


# -- the layout: names and symlinks cannot lead outside ----------------------------------------------


def test_names_and_planted_symlinks_cannot_lead_outside_the_run(tmp_path):
    run = RunDir(tmp_path / "run").create()
    for bad in ("../x", "/etc", "..", "a/b", "", "x" * 101, "\x00"):
        with pytest.raises(RunDirError):
            run.adapter(bad)
    assert run.adapter("alice-1.v2") == (run.adapters / "alice-1.v2").resolve()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rmdir(run.adapters)
    run.adapters.symlink_to(outside)
    with pytest.raises(RunDirError, match="outside"):
        run.adapter("alice")
    with pytest.raises(RunDirError, match="outside"):
        run.create()


def test_atomic_directory_leaves_the_old_one_on_failure(tmp_path):
    target = tmp_path / "adapter"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(OSError), atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("new, half")
        raise OSError(28, "No space left on device")
    assert (target / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_files_into_a_users_folder_never_removes_or_overwrites_what_it_did_not_write(tmp_path):
    """EX1 / EX3's mechanism (:func:`~mlora_lab.rundir.files.files_into`, what a merge writes through): the
    folder's own files stay; a name it holds is refused (before anything moves) unless ``replace``, and then a
    folder of that name still is; ``stale`` files of an earlier write go; ``last`` comes last; a name that
    appears while the block writes is never overwritten, and what the call moved in goes again."""
    from mlora_lab.rundir.files import files_into, run_holding

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with files_into(folder, last="config.json") as tmp:
        (tmp / "config.json").write_text("1")
        (tmp / "model.bin").write_text("1")
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "notes.txt": "mine",
        "config.json": "1",
        "model.bin": "1",
    }
    with pytest.raises(FileExistsError, match=r"already holds config\.json"), files_into(folder) as tmp:
        (tmp / "config.json").write_text("2")
        (tmp / "new.bin").write_text("2")
    assert not (folder / "new.bin").exists() and (folder / "config.json").read_text() == "1"
    with files_into(folder, replace=True, stale=lambda n: n.endswith(".bin"), last="config.json") as tmp:
        (tmp / "config.json").write_text("3")
        (tmp / "other.bin").write_text("3")
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "notes.txt": "mine",
        "config.json": "3",
        "other.bin": "3",
    }
    with (
        pytest.raises(FileExistsError, match=r"already holds late\.txt"),
        files_into(tmp_path / "new") as tmp,
    ):
        (tmp / "a.txt").write_text("a")
        (tmp / "late.txt").write_text("ours")
        (tmp_path / "new" / "late.txt").write_text("someone's")  # (appears while the block writes)
    assert {p.name: p.read_text() for p in (tmp_path / "new").iterdir()} == {"late.txt": "someone's"}
    (folder / "sub").mkdir()
    with pytest.raises(IsADirectoryError, match="sub is a folder"), files_into(folder, replace=True) as tmp:
        (tmp / "sub").write_text("x")
    assert (folder / "sub").is_dir() and not [p for p in folder.iterdir() if p.name.startswith(".")]
    run = RunDir(tmp_path / "run").create()
    JobSpec(base_model="m", tenants=[]).to_json(run.job)
    assert run_holding(run.root / "adapters" / "a" / "x") == run.root and run_holding(folder) is None
    JobSpec(base_model="m", tenants=[]).to_json(folder / "job.json")  # (a project's own job file: no run)
    assert run_holding(folder / "merged") is None
    (folder / "status.json").write_text("{}")
    assert run_holding(folder / "merged") == folder


# -- one owner per run directory -----------------------------------------------------------------------


def test_the_lock_has_one_holder_and_dies_with_it(tmp_path):
    run = RunDir(tmp_path / "run")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mlora_lab.rundir import RunDir, RunLock; "
            "RunLock(RunDir(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)",
            str(run.root),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match="in use"):
            RunLock(run).acquire(timeout=0.3)
        assert RunLock(run).is_held_elsewhere()
        holder.send_signal(signal.SIGKILL)  # however it ends, the kernel drops the lock
        holder.wait()
        with RunLock(run) as lock:
            assert lock.held
    finally:
        holder.kill()
        holder.wait()


def test_a_non_finite_metric_is_written_as_null_and_read_back(run):
    writer = MetricsWriter(run.metrics)
    writer.write(HeldoutRow(step=1, tenant="a", loss=float("nan")))
    writer.write(
        TrainRow(step=1, tenant="a", tenant_step=1, loss=2.0, tokens=3, lr=0.1, grad_norm=float("inf"))
    )
    rows = MetricsReader(run.metrics).poll()
    assert (
        [type(r) for r in rows] == [HeldoutRow, TrainRow]
        and rows[0].loss is None
        and rows[1].grad_norm is None
    )


# -- labels: tags and a note ---------------------------------------------------------------------------


def test_labels_are_validated_kept_in_order_and_tolerate_a_missing_file(tmp_path):
    from mlora_lab.rundir import RunLabels, read_labels, update_labels

    run = RunDir(tmp_path / "run").create()
    run.job.write_text("{}")
    assert read_labels(run.root) == RunLabels() and not run.labels.exists()
    assert update_labels(run.root, add=["baseline", "lr-1e-3", "baseline"]).tags == ("baseline", "lr-1e-3")
    labels = update_labels(
        run.root, add=["rslora"], remove=["lr-1e-3", "never-there"], note="first try\nq/v only"
    )
    assert labels == RunLabels(("baseline", "rslora"), "first try\nq/v only") == read_labels(run.root)
    assert json.loads(run.labels.read_text()) == {
        "tags": ["baseline", "rslora"],
        "note": "first try\nq/v only",
    }
    with pytest.raises(ValueError) as e:  # every bad tag at once, and nothing written
        update_labels(run.root, add=["ok", "two words", "a,b", "", "x" * 41, 7], note="n" * 5000)
    for fragment in ("'two words'", "'a,b'", "empty", "41 characters", "int", "5000 characters"):
        assert fragment in str(e.value), fragment
    assert read_labels(run.root).tags == ("baseline", "rslora")
    assert [p.name for p in run.root.iterdir() if p.name.startswith(".labels.json")] == [], "no temp files"
    with pytest.raises(RunDirError, match="not a run directory"):
        update_labels(tmp_path, add=["x"])


def test_corrupt_labels_give_a_clear_error_and_are_not_overwritten(tmp_path):
    from mlora_lab.rundir import read_labels, update_labels

    run = RunDir(tmp_path / "run").create()
    run.job.write_text("{}")
    for content, needle in (
        ("{not json", "corrupt"),
        ('{"tags": "a"}', "not a list"),
        ('{"tags": ["a b"]}', "whitespace"),
        ('{"note": 3}', "not a string"),
    ):
        run.labels.write_text(content)
        with pytest.raises(RunDirError, match=needle):
            read_labels(run.root)
        with pytest.raises(RunDirError, match=needle):
            update_labels(run.root, add=["x"])
        assert run.labels.read_text() == content


def test_concurrent_tagging_keeps_every_tag(tmp_path):
    """Two notebooks tagging one run at once: the read-modify-write is locked, no tag is lost."""
    import threading

    from mlora_lab.rundir import read_labels, update_labels

    run = RunDir(tmp_path / "run").create()
    run.job.write_text("{}")

    def tag(prefix: str) -> None:
        for i in range(15):
            update_labels(run.root, add=[f"{prefix}{i}"])

    threads = [threading.Thread(target=tag, args=(p,)) for p in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(read_labels(run.root).tags) == sorted(f"{p}{i}" for p in "ab" for i in range(15))


def test_old_rows_without_the_newer_fields_are_read(tmp_path):
    """Files written before rows_seen/tokens_seen and cpu_percent/gpu_util existed stay readable."""
    path = tmp_path / "metrics.jsonl"
    train = {"kind": "train", "step": 1, "tenant": "a", "tenant_step": 1, "loss": 1.0, "tokens": 5, "lr": 0.1}
    system = {"kind": "system", "step": 1, "rank": 0, "mem_bytes": 1, "peak_mem_bytes": 1, "step_time": 0.1}
    old = [{**train, "grad_norm": 1.0, "time": 1.0}, {**system, "tokens_per_s": 50.0, "time": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = MetricsReader(path).poll()
    assert rows == [
        TrainRow(step=1, tenant="a", tenant_step=1, loss=1.0, tokens=5, lr=0.1, grad_norm=1.0, time=1.0),
        SystemRow(step=1, rank=0, mem_bytes=1, peak_mem_bytes=1, step_time=0.1, tokens_per_s=50.0, time=1.0),
    ]
    assert rows[0].rows_seen is None and rows[1].cpu_percent is None  # not recorded then
    rl = dict.fromkeys(("reward", "reward_std", "completion_len", "kl", "clip_ratio"))  # (RL tenants' fields)
    rl |= {"extra": None, "loss_reduction": None, "loss_per_token": None}  # (and a Tinker client's: a sum)
    assert rows[0].to_dict() == {**old[0], "rows_seen": None, "tokens_seen": None, **rl}
    writer = MetricsWriter(path)
    writer.write(
        SystemRow(
            step=2, rank=0, mem_bytes=1, peak_mem_bytes=1, step_time=0.1, tokens_per_s=5.0, cpu_percent=180.5
        )
    )
    writer.write(
        TrainRow(
            step=2,
            tenant="a",
            tenant_step=2,
            loss=1.0,
            tokens=5,
            lr=0.1,
            grad_norm=1.0,
            rows_seen=4,
            tokens_seen=10,
        )
    )
    writer.close()
    new = MetricsReader(path).poll()[2:]
    assert new[0].cpu_percent == 180.5 and new[0].gpu_util is None
    assert (new[1].rows_seen, new[1].tokens_seen) == (4, 10)
    path.write_text(json.dumps({**old[0], "rows_seen": "4"}) + "\n")
    with pytest.warns(RuntimeWarning, match=r"Expected `int \| null`, got `str` - at `\$.rows_seen`"):
        assert MetricsReader(path).poll() == []


def test_stage_and_sent_tenants_follow_a_message_through_the_job(run):
    send = control.send(run.root, "add", tenant={"name": "x", "data": "x.jsonl", "rank": 4})
    later = control.send(run.root, "add", tenant={"name": "y", "data": "y.jsonl"})
    control.send(run.root, "pause", name="x")
    queue(run, "00000000000000000001-broken.json", "{")
    assert control.stage(run.root, send) == "queued"
    assert control.stage(run.root, "0" * 32) == "unknown"
    assert control.sent_tenants(run.root) == {
        "x": control.SentTenant({"name": "x", "data": "x.jsonl", "rank": 4}, answered=False),
        "y": control.SentTenant({"name": "y", "data": "y.jsonl"}, answered=False),
    }
    item = next(i for i in control.incoming(run.root) if i.msg_id == send)
    claimed = control.claim(run.root, item)
    assert control.stage(run.root, send) == "applying"
    control.finish(run.root, claimed, ControlResult(send, False, "add: rank", 3))
    assert control.stage(run.root, send) == "answered" and control.stage(run.root, later) == "queued"
    assert control.sent_tenants(run.root)["x"].answered is True
    with pytest.raises(ValueError, match="not a control message id"):
        control.stage(run.root, "../x")


# -- every writer: never through a link (issue 22) ----------------------------------------------------------


def _plant(run: RunDir, name: str, target: Path) -> None:
    """Replace ``name`` (a folder or a file of the run) by a symlink to ``target``."""
    path = run.root / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target, target_is_directory=target.is_dir())


def _export_default(run: RunDir) -> None:
    from matplotlib.figure import Figure

    from mlora_lab.lab.dashboard.outputs import default_export_dir, export_files

    export_files(default_export_dir([run.root]), [("loss", Figure())], None)


FOLDER_WRITERS = {
    "control/ (a message)": ("control", lambda run: control.send(run.root, "pause", name="a")),
    "control/ (a stop)": ("control", lambda run: control.request_stop(run.root)),
    "control/results/": (
        "control/results",
        lambda run: control.write_result(run.root, ControlResult("a" * 32, True, None, 1)),
    ),
    "exports/ (the dashboard's default)": ("exports", _export_default),
    "adapters/ (a link that stays inside)": ("adapters", lambda run: run.adapter("alice")),
    "checkpoints/": ("checkpoints", lambda run: run.inside(run.checkpoints / "step_00000001")),
}


@pytest.mark.parametrize("case", sorted(FOLDER_WRITERS))
def test_no_writer_goes_through_a_folder_replaced_by_a_link(tmp_path, case):
    """A folder of the run replaced by a symlink (to a folder outside, or to another folder of the run):
    every writer refuses it with an error naming the link, and writes nothing anywhere (issue 22:
    control/ and exports/ were followed, links inside the run were allowed)."""
    folder, write = FOLDER_WRITERS[case]
    run = RunDir(tmp_path / "run").create()
    outside = tmp_path / "outside"
    outside.mkdir()
    target = run.root / "elsewhere" if "inside" in case else outside
    target.mkdir(exist_ok=True)
    _plant(run, folder, target)
    with pytest.raises(RunDirError, match="symbolic link"):
        write(run)
    assert not any(outside.iterdir()) and not any(target.iterdir())


@pytest.mark.parametrize("name", ["status.json", "job.json", "labels.json", "control/stop"])
def test_a_file_replaced_by_a_link_is_never_followed(tmp_path, name):
    """A file of the run replaced by a symlink: an atomic write replaces the link (labels, which are
    read before they are written, refuse it); the file it pointed to is untouched either way."""
    from mlora_lab.rundir import update_labels

    run = RunDir(tmp_path / "run").create()
    if name != "job.json":
        JobSpec(base_model="m", tenants=[]).to_json(run.job)
    victim = tmp_path / "victim"
    victim.write_text('{"tags": ["planted"], "note": ""}')
    _plant(run, name, victim)
    writes = {
        "status.json": lambda: update_status(run.root, state=RunState.STARTING),
        "job.json": lambda: JobSpec(base_model="m", tenants=[]).to_json(run.job),
        "control/stop": lambda: control.request_stop(run.root),
    }
    if name == "labels.json":
        with pytest.raises(RunDirError, match="symbolic link"):
            update_labels(run.root, add=["x"])
    else:
        writes[name]()
        assert not (run.root / name).is_symlink()
    assert victim.read_text() == '{"tags": ["planted"], "note": ""}'


ALLOWED_WRITERS = {
    # (file, call): why it may write without the run directory's guard (mlora_lab/rundir/files.py)
    ("mlora_lab/rundir/checkpoint.py", "write_text"): "inside the fresh directory of atomic_directory",
    ("mlora_lab/rundir/checkpoint.py", "save_file"): "inside the fresh directory of atomic_directory",
    ("mlora_lab/lora/peft_io.py", "save_pretrained"): "inside the fresh directory of atomic_directory",
    ("mlora_lab/lora/peft_io.py", "save_file"): "inside the fresh directory of atomic_directory",
    ("mlora_lab/bases.py", "mkdtemp"): "the GGUF cache (no run directory): a private new directory",
    ("mlora_lab/bases.py", "save_pretrained"): "the GGUF cache: inside that private new directory",
    ("mlora_lab/bases.py", "rename"): "the GGUF cache: that directory renamed into place",
    ("mlora_lab/bases.py", "mkdir"): "the GGUF cache's own folder (MLORA_LAB_CACHE or ~/.cache)",
    ("mlora_lab/tiny.py", "mkdir"): "tiny test models, in a folder the caller names",
    ("mlora_lab/tiny.py", "save_pretrained"): "tiny test models, in a folder the caller names",
    ("mlora_lab/lab/demo.py", "mkdir"): "the demo's data, in the folder the caller names",
    ("mlora_lab/lab/demo.py", "write_text"): "the demo's data, in the folder the caller names",
    ("mlora_lab/lab/compare/results.py", "savefig"): "plot_losses(path=...): a file the caller names",
    ("mlora_lab/lab/plotting.py", "savefig"): "into an in-memory buffer",
    (
        "mlora_lab/trackers/backends.py",
        "mkdir",
    ): "a tracker folder the user names (logging_dir, its variable)",
    (
        "mlora_lab/lab/slurm/cluster.py",
        "NamedTemporaryFile",
    ): "a private temporary file for sbatch --test-only",
    (
        "mlora_lab/lab/exports.py",
        "save_pretrained",
    ): "run.merge: inside the temporary folder of files_into",
    (
        "mlora_lab/lab/exports.py",
        "mkdtemp",
    ): "run.export: a private directory for the GGUF writer, moved atomically",
}
WRITER_CALLS = {
    "write_text",
    "write_bytes",
    "savefig",
    "to_csv",
    "to_parquet",
    "save_file",
    "save_pretrained",
    "mkstemp",
    "mkdtemp",
    "NamedTemporaryFile",
    "mkdir",
    "makedirs",
    "replace",
    "rename",
    "copy",
    "copyfile",
    "copy2",
    "copytree",
    "move",
    "symlink",
    "link",
    "save",
}
OWNED_CALLS = {
    **dict.fromkeys(("replace", "rename", "link", "symlink", "makedirs"), "os"),
    **dict.fromkeys(("copy", "copyfile", "copy2", "copytree", "move"), "shutil"),
    "save": "torch",
}


def _writers(path: Path) -> set[str]:
    """Calls in ``path`` that create or write files: the names above (those of OWNED_CALLS only on
    their module: ``os.replace``, ``shutil.copy``; ``to_csv`` only with a target), ``open`` in a
    writing mode and ``os.open`` with writing flags."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if name == "open" and owner in (None, "io", "builtins"):
            mode = (
                node.args[1]
                if len(node.args) > 1
                else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                found.add("open")
        elif name == "open" and owner == "os":
            flags = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if flags & {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}:
                found.add("os.open")
        elif name in OWNED_CALLS and owner != OWNED_CALLS[name]:
            continue  # dict.copy, str.replace, a widget's rename...
        elif name in ("to_csv", "to_parquet") and not node.args:
            continue
        elif name in WRITER_CALLS:
            found.add(name)
    return found


def test_every_file_the_package_writes_goes_through_the_guard():
    """Only mlora_lab/rundir/files.py opens, creates or renames files (no-follow, inside the run
    directory); every other writer is listed here with the reason it may write on its own."""
    root = Path(__file__).resolve().parents[2]
    found = set()
    for path in sorted((root / "mlora_lab").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel != "mlora_lab/rundir/files.py":
            found |= {(rel, call) for call in _writers(path)}
    unguarded = sorted(found - set(ALLOWED_WRITERS))
    assert not unguarded, f"writers that bypass mlora_lab/rundir/files.py: {unguarded}"
    stale = sorted(set(ALLOWED_WRITERS) - found)
    assert not stale, f"allowed writers that no longer exist (remove them from the list): {stale}"


def test_rows_frame_keeps_row_order_kinds_and_types(tmp_path):
    """The lab's DataFrame of typed rows: the rows in file order across kinds, ``kind`` first and each
    kind's fields in order (kinds as they first appear), NaN where a kind lacks a field or a float was
    not finite (null), enums as their text, ints kept as ints when every value is one."""
    from mlora_lab.lab.records.series import rows_frame

    path = tmp_path / "metrics.jsonl"
    written = [
        HeldoutRow(step=1, tenant="a", loss=3.0, time=10.0),
        TrainRow(step=1, tenant="a", tenant_step=1, loss=2.0, tokens=3, lr=0.1, grad_norm=None, time=11.0),
        TenantRow(step=1, tenant="b", state="failed", reason="non-finite loss", time=12.0),
        TrainRow(
            step=2, tenant="a", tenant_step=2, loss=float("nan"), tokens=4, lr=0.1, grad_norm=1.0, time=13.0
        ),
        HeldoutRow(step=2, tenant="a", loss=2.5, time=14.0),
    ]
    writer = MetricsWriter(path)
    for row in written:
        writer.write(row)
    writer.close()
    rows = MetricsReader(path).poll()
    df = rows_frame(rows)
    assert list(df["kind"]) == ["eval", "train", "tenant", "train", "eval"]
    assert list(df.columns[:5]) == ["kind", "step", "tenant", "loss", "time"]
    assert list(df.columns[5:]) == [
        "tenant_step",
        "tokens",
        "lr",
        "grad_norm",
        "rows_seen",
        "tokens_seen",
        "reward",
        "reward_std",
        "completion_len",
        "kl",
        "clip_ratio",
        "loss_reduction",
        "loss_per_token",
        "state",
        "adapter_bytes",
        "optimizer_bytes",
        "local_adapter_bytes",
        "local_optimizer_bytes",
        "reason",
    ]
    assert list(df["step"]) == [1, 1, 1, 2, 2] and df["step"].dtype == "int64"
    assert df["loss"].isna().tolist() == [
        False,
        False,
        True,
        True,
        False,
    ]  # a tenant row has none; NaN was null
    assert df.loc[[0, 1, 4], "loss"].tolist() == [3.0, 2.0, 2.5]
    assert df["state"].tolist()[2] == "failed" and type(df["state"].tolist()[2]) is str
    assert df["grad_norm"].isna().tolist() == [True, True, True, False, True]
    assert [t.timestamp() for t in df["time"]] == [10.0, 11.0, 12.0, 13.0, 14.0]
    one = rows_frame([r for r in rows if r.kind == "train"])
    assert one["tokens"].dtype == "int64" and list(one.columns)[:4] == [
        "kind",
        "step",
        "tenant",
        "tenant_step",
    ]
    assert rows_frame([]).empty


def test_completion_rows_round_trip_and_sit_beside_the_others_in_a_frame(tmp_path):
    """An RL tenant's sampled completions (a row kind of their own) are written, read back typed, and kept
    apart from the train rows in a frame (a reader that does not know them skips nothing else)."""
    from mlora_lab.lab.records.series import rows_frame

    path = tmp_path / "metrics.jsonl"
    sample = CompletionRow(
        step=3, tenant="a", tenant_step=3, prompt="say \u00e9\n", completion=" ok", reward=None
    )
    train = TrainRow(
        step=3,
        tenant="a",
        tenant_step=3,
        loss=0.1,
        tokens=8,
        lr=0.1,
        grad_norm=1.0,
        reward=0.5,
        reward_std=0.25,
        completion_len=4.0,
        kl=None,
        clip_ratio=0.0,
    )
    writer = MetricsWriter(path)
    writer.write(train)
    writer.write(sample)
    writer.close()
    rows = MetricsReader(path).poll()
    assert rows == [train, sample] and rows[1].kind is RowKind.COMPLETION
    df = rows_frame(rows)
    assert list(df["kind"]) == ["train", "completion"]
    assert df["reward"].tolist()[0] == 0.5 and df["completion"].tolist()[1] == " ok"


def test_the_held_out_rows_old_names_are_still_given():
    """``RowKind.EVAL`` is ``RowKind.HELDOUT`` (an enum alias: one member, listed once); ``EvalRow`` is
    ``HeldoutRow`` with one DeprecationWarning naming the new name and the removal date, at the line that
    names it, however it is imported."""
    import mlora_lab.rundir as rundir_package
    from mlora_lab.rundir import RowKind
    from mlora_lab.rundir import rows as rows_module
    from mlora_lab.spec.renames import REMOVAL

    assert RowKind.EVAL is RowKind.HELDOUT and RowKind("eval") is RowKind.HELDOUT
    assert [k for k in RowKind if k.value == "eval"] == [RowKind.HELDOUT]
    for get in (
        lambda: rundir_package.EvalRow,
        lambda: rows_module.EvalRow,
        lambda: __import__("mlora_lab.rundir", fromlist=["EvalRow"]).EvalRow,
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert get() is HeldoutRow
        (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert "mlora_lab.rundir.EvalRow: deprecated, use HeldoutRow" in str(w.message)
        assert REMOVAL in str(w.message) and w.filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from mlora_lab.rundir import EvalRow
    assert EvalRow is HeldoutRow and len(caught) == 1 and caught[0].filename == __file__
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchRow'"):
        rows_module.NoSuchRow  # noqa: B018
