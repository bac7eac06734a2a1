"""Mirroring runs to the trackers people keep their runs in (``report_to``; :mod:`mlora_lab.trackers`).

Every check reads back what was written with the tracker's own reader: TensorBoard event files through
tensorboard's ``EventAccumulator``, W&B offline runs through ``wandb leet inspect --json`` (the reader of
W&B's transaction log that ships with wandb), trackio's store through trackio's ``Api`` and storage
(in a child process: trackio reads its folder once, at import). Expected values are the run's own rows.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlora_lab as ml
from mlora_lab import trackers
from mlora_lab.job.trainer import Trainer
from mlora_lab.lab.cli import main as cli_main
from mlora_lab.rundir import (
    EventKind,
    EventRow,
    HeldoutRow,
    MetricsReader,
    SystemRow,
    TenantRow,
    TenantState,
    TrainRow,
)
from mlora_lab.spec.fields import SpecError
from mlora_lab.trackers import backends, mirror_run, report_to_problems, requested
from mlora_lab.trackers.points import JOB, Log, Note, RowMapper, job_title
from mlora_lab.validate import problems
from tests.conftest import task_rows, write_jsonl

slow = pytest.mark.slow
WANDB_CLI = Path(sys.executable).parent / "wandb"


# -- readers: each tracker's own ----------------------------------------------------------------------


def tb(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in tb(folder).Scalars(tag)]


def tb_hparams(folder: Path) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = tb(folder).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    out = {}
    for k, v in info.hparams.items():
        out[k] = getattr(v, v.WhichOneof("kind"))
    return out


def tb_texts(folder: Path, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in tb(folder).Tensors(tag)]


def wandb_runs(folder: Path) -> dict[str, dict]:
    """Every W&B offline run under ``folder`` by name: ``run`` (its record: config, group, job_type) and
    ``history`` (each logged row, with its step), read by wandb's own transaction-log reader."""
    out: dict[str, dict] = {}
    for path in sorted(folder.rglob("run-*.wandb")):
        done = subprocess.run(
            [str(WANDB_CLI), "leet", "inspect", str(path), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr
        records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        run = next(r["run"] for r in records if r["type"] == "run")
        history = [
            {**r["history"]["item"], "step": r["history"]["step"]["num"]}
            for r in records
            if r["type"] == "history"
        ]
        summary: dict = {}
        for r in records:
            if r["type"] == "summary":
                summary.update(r["summary"].get("update", {}))
        entry = out.setdefault(run["display_name"], {"run": run, "history": [], "summary": {}, "files": []})
        entry["history"] += history
        entry["summary"].update(summary)
        entry["files"].append(path)
    return out


TRACKIO_READER = """
import json, os, sys
os.environ["TRACKIO_DIR"] = sys.argv[1]
import trackio
from trackio.sqlite_storage import SQLiteStorage
out = {}
for run in trackio.Api().runs(sys.argv[2]):
    out[run.name] = {"config": run.config, "logs": SQLiteStorage.get_logs(sys.argv[2], run.name)}
print("ANSWER" + json.dumps(out, default=str))
"""


def trackio_runs(folder: Path, project: str = "mlora_lab") -> dict[str, dict]:
    """Every trackio run of ``project`` in the store at ``folder``: its config and logged rows."""
    done = subprocess.run(
        [sys.executable, "-c", TRACKIO_READER, str(folder), project],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("ANSWER"))[6:])


# -- the runs mirrored -------------------------------------------------------------------------------


def job_spec(base: str, folder: Path, **kw) -> ml.JobSpec:
    """Two tenants of different rank, lr and length; alice is evaluated."""
    alice = ml.Tenant(
        name="alice",
        data=write_jsonl(folder / "alice.jsonl", task_rows("reverse", 12)),
        heldout_data=write_jsonl(folder / "alice_eval.jsonl", task_rows("reverse", 4)),
        rank=4,
        lr=1e-2,
        max_steps=4,
        batch_size=2,
    )
    bob = ml.Tenant(
        name="bob",
        data=write_jsonl(folder / "bob.jsonl", task_rows("upper", 12)),
        rank=8,
        lr=5e-3,
        max_steps=6,
        batch_size=3,
        target_modules=["q_proj", "k_proj", "v_proj"],
    )
    return ml.JobSpec(
        base_model=base, tenants=[alice, bob], seq_len=48, max_rank=8, max_tenants=4, heldout_every=2, **kw
    )


def train(spec: ml.JobSpec, run_dir: Path) -> list:
    """The job in this process (rank 0 of one); its rows as written."""
    trainer = Trainer(spec, run_dir=run_dir)
    trainer.train()
    trainer.close()
    return MetricsReader(run_dir / "metrics.jsonl").poll()


def title(run_dir: Path) -> str:
    """What the run's tracker runs are called (its directory's name, or the job's name where it has one)."""
    return job_title(ml.JobSpec.load(run_dir / "job.json"), run_dir)


def train_rows(rows: list, tenant: str) -> list[TrainRow]:
    return [r for r in rows if isinstance(r, TrainRow) and r.tenant == tenant]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, llama_path) -> tuple[Path, list]:
    """A run trained without trackers, mirrored after the fact by the tests that use it."""
    folder = tmp_path_factory.mktemp("finished")
    run_dir = folder / "run-finished"
    rows = train(job_spec(llama_path, folder), run_dir)
    return run_dir, rows


# -- report_to as transformers takes it, and checked before launch ------------------------------------


def test_report_to_is_taken_as_transformers_takes_it():
    assert requested(None) == requested("none") == requested(["none"]) == requested([]) == []
    assert requested("all") == requested(["all"]) == ["tensorboard", "trackio", "wandb"]  # all installed here
    assert requested("wandb") == ["wandb"]
    assert requested(("all",)) == requested("all") and requested(("trackio",)) == ["trackio"]
    assert requested(["wandb", "tensorboard", "wandb"]) == ["wandb", "tensorboard"]
    assert report_to_problems(["tensorbord"]) == [
        "report_to: unknown tracker 'tensorbord' (did you mean 'tensorboard'?); "
        "known: tensorboard, trackio, wandb, 'all' or 'none'"
    ]
    assert report_to_problems(["all", "wandb"]) == [
        "report_to: 'all' stands alone, not in a list with other trackers"
    ]
    assert report_to_problems(3) == [
        "report_to must be a tracker name, a list of them, 'all' or 'none' (got 3 of type int)"
    ]
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        requested("mlflow")


def test_a_tracker_that_is_not_installed_is_refused_before_launch(monkeypatch, llama_path, tmp_path):
    spec = job_spec(llama_path, tmp_path, report_to=["tensorboard", "wandb"], project="my/project")
    assert [(p.field, p.message) for p in problems(spec)] == [
        ("project", "project must be 1-100 characters from A-Z a-z 0-9 . _ - (got 'my/project' of type str)")
    ]
    spec.project = "my-project"
    assert problems(spec) == []
    # wandb's package looked up under a name nothing installs: what a machine without it sees
    monkeypatch.setitem(trackers.MODULES, "wandb", "wandb_is_not_installed_here")
    found = problems(spec)
    assert [(p.field, p.message) for p in found] == [
        (
            "report_to",
            "report_to: wandb is not installed here; pip install 'mlora_lab[wandb]' "
            "(or 'mlora_lab[trackers]' for tensorboard, trackio, wandb)",
        )
    ]
    with pytest.raises(SpecError, match=r"pip install 'mlora_lab\[wandb\]'"):
        ml.launch(spec, workdir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    for name in ("tensorboard", "trackio"):
        monkeypatch.setitem(trackers.MODULES, name, f"{name}_is_not_installed_here")
    spec.report_to = "all"
    assert [p.message for p in problems(spec)] == [
        "report_to='all' but none of tensorboard, trackio, wandb is installed; pip install 'mlora_lab[trackers]'"
    ]
    spec.report_to = "none"
    assert problems(spec) == []


def test_report_settings_round_trip_through_job_json(tmp_path):
    spec = ml.JobSpec(
        base_model="m",
        tenants=[],
        report_to=["tensorboard"],
        report_group="job",
        logging_dir="tb_logs",
        project="lora-sweeps",
    )
    spec.to_json(tmp_path / "job.json")
    back = ml.JobSpec.load(tmp_path / "job.json")
    assert (back.report_to, back.report_group, back.project) == (["tensorboard"], "job", "lora-sweeps")
    assert back.logging_dir == str(tmp_path / "tb_logs")  # relative to job.json, as every path
    old = {
        k: v
        for k, v in spec.to_dict().items()
        if k not in ("report_to", "report_group", "logging_dir", "project")
    }
    legacy = ml.JobSpec.from_dict(old)  # a job.json written before these fields: nothing reported
    assert (legacy.report_to, legacy.report_group, legacy.logging_dir) == ([], "tenant", None)


# -- the mapping ---------------------------------------------------------------------------------------


def test_rows_become_metrics_on_the_tenant_step_or_the_global_step():
    rows = [
        TenantRow(step=0, tenant="a", state=TenantState.RUNNING, adapter_bytes=100),
        TrainRow(step=1, tenant="a", tenant_step=1, loss=2.5, tokens=10, lr=1e-3, grad_norm=float("nan")),
        TrainRow(step=2, tenant="b", tenant_step=1, loss=3.0, tokens=7, lr=2e-3, grad_norm=0.5, rows_seen=4),
        TrainRow(step=3, tenant="a", tenant_step=2, loss=2.0, tokens=10, lr=1e-3, grad_norm=0.25),
        HeldoutRow(step=3, tenant="a", loss=2.2),
        SystemRow(step=3, rank=1, mem_bytes=5, peak_mem_bytes=6, step_time=0.5, tokens_per_s=40.0),
        TenantRow(step=4, tenant="a", state=TenantState.FAILED, reason="loss is nan"),
        EventRow(step=4, event=EventKind.RESUMED, message="from step_3"),
    ]
    by_tenant = RowMapper("tenant")
    assert [item for r in rows for item in by_tenant.items(r)] == [
        Log("a", 0, {"tenant/adapter_bytes": 100, "tenant/optimizer_bytes": 0}),
        Note("a", 0, "tenant/state", "running"),
        Log(
            "a",
            1,  # the tenant's own step; the job's is a value; a NaN grad norm is left out
            {"train/loss": 2.5, "train/tokens": 10, "train/learning_rate": 1e-3, "train/global_step": 1},
        ),
        Log(
            "b",
            1,
            {
                "train/loss": 3.0,
                "train/tokens": 7,
                "train/learning_rate": 2e-3,
                "train/grad_norm": 0.5,
                "train/rows_seen": 4,
                "train/global_step": 2,
            },
        ),
        Log(
            "a",
            2,
            {
                "train/loss": 2.0,
                "train/tokens": 10,
                "train/learning_rate": 1e-3,
                "train/grad_norm": 0.25,
                "train/global_step": 3,
            },
        ),
        Log("a", 2, {"eval/loss": 2.2}),  # at a's latest tenant step
        Log(
            JOB,
            3,
            {
                "system/mem_bytes/rank1": 5,
                "system/peak_mem_bytes/rank1": 6,
                "system/step_time/rank1": 0.5,
                "system/tokens_per_s/rank1": 40.0,
            },
        ),
        Log("a", 2, {"tenant/adapter_bytes": 0, "tenant/optimizer_bytes": 0}),
        Note("a", 2, "tenant/state", "failed: loss is nan"),
        Note(JOB, 4, "events", "resumed: from step_3"),
    ]
    by_job = RowMapper("job")
    items = [item for r in rows for item in by_job.items(r)]
    assert {item.key for item in items} == {JOB}
    assert items[2] == Log(
        JOB,
        1,
        {"train/loss/a": 2.5, "train/tokens/a": 10, "train/learning_rate/a": 1e-3, "train/tenant_step/a": 1},
    )
    assert items[5] == Log(JOB, 3, {"eval/loss/a": 2.2})
    assert items[8] == Note(JOB, 4, "tenant/state/a", "failed: loss is nan")
    resumed = RowMapper("tenant")  # a resumed job learns each tenant's step from the rows before
    resumed.seed(rows[3])
    assert resumed.items(rows[4]) == [Log("a", 2, {"eval/loss": 2.2})]


# -- live, from the job's rank 0 -----------------------------------------------------------------------


def test_a_job_mirrors_every_row_live_one_tracker_run_per_tenant(llama_path, tmp_path):
    spec = job_spec(llama_path, tmp_path, report_to=["tensorboard", "wandb"])
    run_dir = tmp_path / "run-live"
    rows = train(spec, run_dir)
    assert not [r for r in rows if isinstance(r, EventRow)], "no tracker failed"
    board = run_dir / "trackers" / "tensorboard"  # inside the run directory: nothing left it
    assert sorted(p.name for p in board.iterdir()) == ["job", "tenants"]
    assert sorted(p.name for p in (board / "tenants").iterdir()) == ["alice", "bob"]
    for name, tenant in (("alice", spec.tenants[0]), ("bob", spec.tenants[1])):
        mine = train_rows(rows, name)
        assert len(mine) == tenant.max_steps
        folder = board / "tenants" / name
        # float32 summaries of the rows' float64 values
        assert tb_scalars(folder, "train/loss") == [
            (r.tenant_step, pytest.approx(r.loss, rel=1e-6)) for r in mine
        ]
        assert tb_scalars(folder, "train/global_step") == [(r.tenant_step, r.step) for r in mine]
        assert tb_scalars(folder, "train/learning_rate") == [
            (r.tenant_step, pytest.approx(r.lr, rel=1e-6)) for r in mine
        ]
        hp = tb_hparams(folder)
        assert (hp["rank"], hp["lr"], hp["job.seq_len"]) == (tenant.rank, pytest.approx(tenant.lr), 48)
        assert hp["target_modules"] == json.dumps(tenant.target_modules)
        assert tb_texts(folder, "tenant/state")[-1][1] == "finished"
    # eval rows carry the global step: they land on alice's tenant step at that moment
    step_of = {r.step: r.tenant_step for r in train_rows(rows, "alice")}
    evals = [r for r in rows if isinstance(r, HeldoutRow)]
    assert evals and tb_scalars(board / "tenants" / "alice", "eval/loss") == [
        (step_of[max(s for s in step_of if s <= r.step)], pytest.approx(r.loss, rel=1e-6)) for r in evals
    ]
    system = [r for r in rows if isinstance(r, SystemRow)]
    assert tb_scalars(board / "job", "system/step_time/rank0") == [
        (r.step, pytest.approx(r.step_time, rel=1e-6)) for r in system
    ]

    job = title(run_dir)  # the directory's name, "run-live", unless the job has a name of its own
    runs = wandb_runs(run_dir / "trackers" / "wandb")
    assert sorted(runs) == [job, f"{job}/alice", f"{job}/bob"]
    for name, tenant in (("alice", spec.tenants[0]), ("bob", spec.tenants[1])):
        run = runs[f"{job}/{name}"]
        assert (run["run"]["run_group"], run["run"]["job_type"]) == (job, "tenant")
        config = run["run"]["config"]["update"]
        assert (config["rank"], config["lr"], config["name"]) == (tenant.rank, tenant.lr, name)
        history = {h["step"]: h for h in run["history"]}
        mine = train_rows(rows, name)
        assert [(s, h["train/loss"]) for s, h in sorted(history.items()) if "train/loss" in h] == [
            (r.tenant_step, r.loss)
            for r in mine  # W&B keeps the float64 values exactly
        ]
        assert all(history[r.tenant_step]["train/global_step"] == r.step for r in mine)
        assert run["summary"]["tenant/state"] == "finished"
    assert runs[job]["run"]["job_type"] == "job"


def test_a_failing_tracker_is_said_once_and_the_job_goes_on(llama_path, tmp_path, monkeypatch):
    """A tracker that raises at its third row is dropped with one ``tracker_failed`` event; the other
    tracker gets every row, and every tenant trains to its end. A ``trackers/tensorboard`` symlink
    planted in the run directory is refused the same way: nothing is written where it points."""
    real = backends.BACKENDS["wandb"]

    class Breaks(real):  # W&B itself, until it raises at its third row
        calls = 0

        def log(self, key, step, values):
            type(self).calls += 1
            if type(self).calls == 3:
                raise ConnectionError("the tracker's server went away")
            super().log(key, step, values)

    monkeypatch.setitem(backends.BACKENDS, "wandb", Breaks)
    run_dir = tmp_path / "run-breaks"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "trackers").mkdir(parents=True)
    (run_dir / "trackers" / "tensorboard").symlink_to(elsewhere)
    spec = job_spec(llama_path, tmp_path, report_to=["tensorboard", "wandb", "trackio"])
    monkeypatch.delenv("TRACKIO_DIR", raising=False)  # its default: inside the run directory
    rows = train(spec, run_dir)
    events = [(r.event, r.message) for r in rows if isinstance(r, EventRow)]
    assert [e for e, _ in events] == [EventKind.TRACKER_FAILED, EventKind.TRACKER_FAILED], events
    assert (
        events[0][1].startswith("tensorboard failed (LinkRefused: ")
        and "trackers/tensorboard is a symbolic link" in events[0][1]
    )
    assert events[1][1] == (
        "wandb failed (ConnectionError: the tracker's server went away); no more rows go to it, "
        "and training goes on"
    )
    assert len(train_rows(rows, "alice")) == 4 and len(train_rows(rows, "bob")) == 6
    assert not any(elsewhere.iterdir())
    # trackio, still mirroring, has every row (its store was imported here, so it is read in a child)
    store, job = trackio_runs(run_dir / "trackers" / "trackio"), title(run_dir)
    logs = [x for x in store[f"{job}/bob"]["logs"] if "train/loss" in x]
    assert [(x["step"], x["train/loss"]) for x in logs] == [
        (r.tenant_step, r.loss) for r in train_rows(rows, "bob")
    ]
    assert store[f"{job}/bob"]["config"]["rank"] == 8
    # (both: a failure is said on the training loop's thread at its next row, by when trackio's job run is open)
    assert [x["events"] for x in store[job]["logs"] if "events" in x] == [
        f"tracker_failed: {m}" for _, m in events
    ]


def test_a_tracker_that_hangs_is_taken_out_and_never_holds_a_step_up(llama_path, tmp_path, monkeypatch):
    """A tracker whose fourth call never returns: the training loop only queues rows (the trackers run on
    a thread of their own), the hung call is given up after ``CALL_TIMEOUT_S`` (1 s here) with one
    ``tracker_failed`` event, and the other tracker gets every row."""
    import threading
    import time

    from mlora_lab.trackers import mirror

    monkeypatch.setattr(mirror, "CALL_TIMEOUT_S", 1.0)
    forever = threading.Event()

    class Hangs:  # a tracker (standing in for W&B) whose server stops answering at its fourth row
        calls = 0

        def __init__(self, where) -> None:
            pass

        def destination(self) -> str:
            return "nowhere"

        def start(self, run) -> None:
            pass

        def log(self, key, step, values) -> None:
            type(self).calls += 1
            if type(self).calls == 4:
                forever.wait()  # (never set)

        def note(self, key, step, tag, text) -> None:
            pass

        def add_config(self, key, step, config) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setitem(backends.BACKENDS, "wandb", Hangs)
    run_dir = tmp_path / "run-hangs"
    spec = job_spec(llama_path, tmp_path, report_to=["wandb", "tensorboard"])
    start = time.monotonic()
    rows = train(spec, run_dir)
    assert time.monotonic() - start < 120
    events = [(r.event, r.message) for r in rows if isinstance(r, EventRow)]
    assert events == [
        (
            EventKind.TRACKER_FAILED,
            "wandb failed (TimeoutError: no answer in 1 s); no more rows go to it, and training goes on",
        )
    ], events
    assert len(train_rows(rows, "alice")) == 4 and len(train_rows(rows, "bob")) == 6
    assert list((run_dir / "trackers" / "tensorboard").rglob("events.out.tfevents.*")), "tensorboard wrote"


def test_a_tracker_missing_where_the_job_runs_is_said_and_the_job_trains(llama_path, tmp_path, monkeypatch):
    """Checked on the machine that launched it, run on one without wandb (another node's environment):
    one ``tracker_failed`` event naming the extra, and the job trains as without trackers."""
    spec = job_spec(llama_path, tmp_path, report_to=["wandb"])
    monkeypatch.setitem(trackers.MODULES, "wandb", "wandb_is_not_installed_here")
    rows = train(spec, tmp_path / "run-missing")
    assert [(r.event, r.message) for r in rows if isinstance(r, EventRow)] == [
        (
            EventKind.TRACKER_FAILED,
            "report_to: wandb is not installed here; pip install 'mlora_lab[wandb]' "
            "(or 'mlora_lab[trackers]' for tensorboard, trackio, wandb); no rows are mirrored (training goes on)",
        )
    ]
    assert len(train_rows(rows, "alice")) == 4 and len(train_rows(rows, "bob")) == 6
    assert not (tmp_path / "run-missing" / "trackers").exists()


def test_a_resumed_job_continues_its_tracker_runs(llama_path, tmp_path):
    """A job resumed from its step-2 checkpoint logs steps 3.. again: each TensorBoard run keeps every
    step once (the restart marker drops what the crashed job wrote after the checkpoint), on the
    tenant's own steps (learnt from the rows before the checkpoint), with the resumed job's values."""
    spec = job_spec(llama_path, tmp_path, report_to=["tensorboard"])
    run_dir = tmp_path / "run-resumed"
    first = Trainer(spec, run_dir=run_dir)
    for _ in range(4):  # the job dies after step 4, its last checkpoint at step 2
        first.step()
        if first.global_step == 2:
            first.save(final=False)
    first.close()
    logged = MetricsReader(run_dir / "metrics.jsonl").poll()
    assert max(r.step for r in logged) == 4
    again = Trainer(ml.JobSpec.load(run_dir / "job.json"), run_dir=run_dir, resume=True)
    again.train()
    again.close()
    rows = MetricsReader(run_dir / "metrics.jsonl").poll()
    assert [r.event for r in rows if isinstance(r, EventRow)] == [EventKind.RESUMED]
    board = run_dir / "trackers" / "tensorboard"
    for name in ("alice", "bob"):
        mine = train_rows(rows, name)
        assert [r.tenant_step for r in mine] == list(range(1, len(mine) + 1))
        assert tb_scalars(board / "tenants" / name, "train/loss") == [
            (r.tenant_step, pytest.approx(r.loss, rel=1e-6)) for r in mine
        ]
    system = [r for r in rows if isinstance(r, SystemRow)]
    assert [s for s, _ in tb_scalars(board / "job", "system/mem_bytes/rank0")] == [r.step for r in system]
    assert [text for _, text in tb_texts(board / "job", "events")] == [
        "resumed: " + next(r.message for r in rows if isinstance(r, EventRow))
    ]


# -- after the fact ----------------------------------------------------------------------------------


def test_report_mirrors_a_finished_run_as_one_job_run(finished):
    """``ml.report`` (in a child process) with ``group="job"``: one tracker run on the global step,
    each tenant's metrics under its name; trackio writes inside the run directory by default. Sent
    again, trackio adds no row and TensorBoard shows each step once."""
    run_dir, rows = finished
    where = ml.report(run_dir, to=["trackio", "tensorboard"], group="job")
    assert where == {
        "trackio": str(run_dir / "trackers" / "trackio"),
        "tensorboard": str(run_dir / "trackers" / "tensorboard"),
    }
    store, job = trackio_runs(run_dir / "trackers" / "trackio"), title(run_dir)
    assert list(store) == [job]
    config, logs = store[job]["config"], store[job]["logs"]
    assert (config["tenants.alice.rank"], config["tenants.bob.lr"], config["seq_len"]) == (4, 5e-3, 48)
    for name in ("alice", "bob"):
        mine = train_rows(rows, name)
        assert [(x["step"], x[f"train/loss/{name}"]) for x in logs if f"train/loss/{name}" in x] == [
            (r.step, r.loss) for r in mine
        ]
        assert [x[f"train/tenant_step/{name}"] for x in logs if f"train/tenant_step/{name}" in x] == [
            r.tenant_step for r in mine
        ]
        assert tb_scalars(run_dir / "trackers" / "tensorboard" / "job", f"train/loss/{name}") == [
            (r.step, pytest.approx(r.loss, rel=1e-6)) for r in mine
        ]
    evals = [r for r in rows if isinstance(r, HeldoutRow)]
    assert [(x["step"], x["eval/loss/alice"]) for x in logs if "eval/loss/alice" in x] == [
        (r.step, r.loss) for r in evals
    ]
    assert ml.report(run_dir, to=["trackio", "tensorboard"], group="job") == where
    assert trackio_runs(run_dir / "trackers" / "trackio")[job]["logs"] == logs
    assert [s for s, _ in tb_scalars(run_dir / "trackers" / "tensorboard" / "job", "train/loss/alice")] == [
        r.step for r in train_rows(rows, "alice")
    ]


def test_a_run_of_an_earlier_release_can_be_mirrored(tmp_path):
    """``tests/data/run_v1``: a run directory written before ``report_to`` existed (its job.json has no
    such field); mirrored elsewhere (nothing is written into it)."""
    run_dir = Path(__file__).parents[1] / "data" / "run_v1" / "run"
    rows = MetricsReader(run_dir / "metrics.jsonl").poll()
    assert "report_to" not in json.loads((run_dir / "job.json").read_text())
    where = mirror_run(run_dir, "tensorboard", logging_dir=tmp_path / "out")
    assert where == {"tensorboard": str(tmp_path / "out" / "tensorboard")}
    for name in ("a", "b"):
        assert tb_scalars(tmp_path / "out" / "tensorboard" / "tenants" / name, "train/loss") == [
            (r.tenant_step, pytest.approx(r.loss, rel=1e-6)) for r in train_rows(rows, name)
        ]
    assert not (run_dir / "trackers").exists()


def test_a_tenant_name_that_cannot_name_a_folder_is_left_out(tmp_path):
    """A hand-written metrics.jsonl naming tenant ``../../escape``: its rows are left out (TensorBoard's
    runs are folders), said (the reader skips such a row as malformed, D3), and nothing is written
    outside the trackers' folder."""
    run_dir = tmp_path / "deep" / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "run_v1" / "run", run_dir)
    hostile = {"kind": "train", "step": 9, "tenant": "../../escape", "tenant_step": 1, "loss": 1.0}
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**hostile, "tokens": 1, "lr": 0.1, "grad_norm": 0.1, "time": 0.0}) + "\n")
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl line \d+: skipped .*tenant is not a safe name"):
        mirror_run(run_dir, "tensorboard")
    assert not list(tmp_path.rglob("escape"))
    board = run_dir / "trackers" / "tensorboard"
    assert sorted(p.name for p in (board / "tenants").iterdir()) == ["a", "b"]
    rows = MetricsReader(run_dir / "metrics.jsonl").poll()
    assert tb_scalars(board / "tenants" / "a", "train/loss") == [
        (r.tenant_step, pytest.approx(r.loss, rel=1e-6)) for r in train_rows(rows, "a")
    ]


def test_completion_rows_are_mirrored_as_one_table_per_step(tmp_path):
    """An RL tenant's sampled completions (completion rows): one Markdown table per tenant step under
    ``completions`` (its cells on one line, ``|`` escaped), at the step they were sampled for; the last
    step's table too, which no later row flushes."""
    from mlora_lab.rundir import CompletionRow, MetricsWriter

    def done(step: int, text: str, reward: float | None) -> CompletionRow:
        return CompletionRow(
            step=step, tenant="a", tenant_step=step, prompt=f"say {step}", completion=text, reward=reward
        )

    rows = [
        done(1, "red | blue", 0.5),
        done(1, "two\nlines", None),
        TrainRow(step=1, tenant="a", tenant_step=1, loss=2.0, tokens=3, lr=0.1, grad_norm=1.0),
        done(2, "green", 1.0),
    ]
    mapper = RowMapper("job")
    notes = [i for r in rows for i in mapper.items(r) if isinstance(i, Note)] + mapper.flush()
    assert [(n.key, n.step, n.tag) for n in notes] == [(JOB, 1, "completions/a"), (JOB, 2, "completions/a")]
    assert notes[0].text.splitlines() == [
        "| reward | prompt | completion |",
        "|---|---|---|",
        "| 0.5 | say 1 | red \\| blue |",
        "| – | say 1 | two ⏎ lines |",
    ]
    run_dir = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "run_v1" / "run", run_dir)
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    for r in rows:
        writer.write(r)
    writer.close()
    mirror_run(run_dir, "tensorboard", group="tenant")
    texts = tb_texts(run_dir / "trackers" / "tensorboard" / "tenants" / "a", "completions")
    assert [step for step, _ in texts] == [1, 2] and "| 1 | say 2 | green |" in texts[1][1]


def test_report_refuses_bad_arguments_with_every_problem(finished):
    run_dir, _ = finished
    with pytest.raises(ValueError) as e:
        ml.report(run_dir, to=["tensorbord"], group="everyone", project="a b")
    text = str(e.value)
    assert "did you mean 'tensorboard'" in text and "group must be one of tenant, job" in text
    assert "project must be 1-100 characters" in text
    with pytest.raises(SpecError, match="say which trackers"):
        mirror_run(run_dir)  # the run asked for none, and none was named
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        ml.report(run_dir / "nothing", to="tensorboard")


def test_cli_report(finished, tmp_path, capsys):
    run_dir, rows = finished
    out = tmp_path / "logs"
    assert cli_main(["report", str(run_dir), "--to", "tensorboard,wandb", "--logging-dir", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"tensorboard: {out / 'tensorboard'}",
        f"wandb: {out / 'wandb'}",
    ]
    bob = train_rows(rows, "bob")
    assert tb_scalars(out / "tensorboard" / "tenants" / "bob", "train/loss") == [
        (r.tenant_step, pytest.approx(r.loss, rel=1e-6)) for r in bob
    ]
    history = wandb_runs(out / "wandb")[f"{title(run_dir)}/bob"]["history"]
    assert [(h["step"], h["train/loss"]) for h in history if "train/loss" in h] == [
        (r.tenant_step, r.loss) for r in bob
    ]
    assert cli_main(["report", str(run_dir), "--to", "mlflow"]) == 2
    assert "unknown tracker 'mlflow'" in capsys.readouterr().err


# -- a real job under torchrun -------------------------------------------------------------------------


@slow
def test_a_launched_job_mirrors_to_every_installed_tracker(llama_path, tmp_path):
    spec = job_spec(llama_path, tmp_path, report_to="all", report_group="tenant", project="lab-test")
    run = ml.launch(spec, workdir=tmp_path / "runs")
    assert run.wait(600) == "finished", run.logs(0)
    rows = MetricsReader(run.path / "metrics.jsonl").poll()
    assert not [r for r in rows if isinstance(r, EventRow)], run.logs(0)
    name = title(run.path)
    folder = run.path / "trackers"
    assert sorted(p.name for p in folder.iterdir()) == ["tensorboard", "trackio", "wandb"]
    alice = train_rows(rows, "alice")
    assert tb_scalars(folder / "tensorboard" / "tenants" / "alice", "train/loss") == [
        (r.tenant_step, pytest.approx(r.loss, rel=1e-6)) for r in alice
    ]
    wb = wandb_runs(folder / "wandb")[f"{name}/alice"]
    assert wb["run"]["project"] == "lab-test"
    assert [(h["step"], h["train/loss"]) for h in wb["history"] if "train/loss" in h] == [
        (r.tenant_step, r.loss) for r in alice
    ]
    store = trackio_runs(folder / "trackio", "lab-test")
    assert sorted(store) == sorted([name, f"{name}/alice", f"{name}/bob"])
    logs = store[f"{name}/alice"]["logs"]
    assert [(x["step"], x["train/loss"]) for x in logs if "train/loss" in x] == [
        (r.tenant_step, r.loss) for r in alice
    ]
    assert all(math.isfinite(x["train/loss"]) for x in logs if "train/loss" in x)
