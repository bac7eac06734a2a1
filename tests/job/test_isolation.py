"""Fault isolation inside one job: whatever a request or a tenant carries, only that request or tenant
fails, and the other tenants train exactly as they would without it."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_jsonl
from hostile import payload_files, queue_hostile

import mlora_lab as ml
from mlora_lab.job.agree import Change
from mlora_lab.job.checkpointer import Checkpointer
from mlora_lab.job.control import ControlHandler
from mlora_lab.job.trainer import SaveError, Trainer
from mlora_lab.parallel import Collectives, ParallelDims
from mlora_lab.rundir import ControlError, RunDir, TenantState, checkpoint, control


def long_text_rows(n: int = 16, seed: int = 0) -> list[dict]:
    """Text rows longer than any test seq_len: every row is cut to seq_len, so every batch has the
    same padded length whatever tenants share it, and comparisons can be exact."""
    words = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road"]
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(words) for _ in range(40))} for _ in range(n)]


def good_tenants(tmp_path: Path, **kw) -> list[ml.Tenant]:
    a = ml.Tenant(
        name="a",
        data=write_jsonl(tmp_path / "a.jsonl", long_text_rows(seed=1)),
        rank=4,
        lr=5e-3,
        batch_size=2,
        target_modules=["q_proj", "v_proj"],
        seed=1,
        **kw,
    )
    b = ml.Tenant(
        name="b",
        data=write_jsonl(tmp_path / "b.jsonl", long_text_rows(seed=2)),
        rank=8,
        lr=2e-3,
        batch_size=3,
        target_modules=["q_proj", "down_proj"],
        seed=2,
        **kw,
    )
    return [a, b]


def job(base: str, tenants: list[ml.Tenant], **kw) -> ml.JobSpec:
    kw = {
        "seq_len": 10,
        "max_rank": 8,
        "max_tenants": 6,
        "slot_modules": ["q_proj", "v_proj", "down_proj"],
        **kw,
    }
    return ml.JobSpec(base_model=base, tenants=tenants, **kw)


def test_hundreds_of_hostile_requests_leave_the_other_tenants_exact(llama_path, tmp_path):
    """~180 hostile adds, bad remove/pause/resume and every kind of malformed message file, queued
    before the first step of an in-process job: each one is answered (refused with a reason, or
    accepted), nothing is stuck at ``pending``, and tenants a and b train exactly as without them."""
    good = good_tenants(tmp_path, max_steps=6)
    reference = Trainer(job(llama_path, good))
    reference.train()

    trainer = Trainer(job(llama_path, good), run_dir=tmp_path / "run")
    files = payload_files(tmp_path / "payloads", llama_path)
    template = ml.Tenant(
        name="t", data=good[0].data, rank=4, max_steps=2, target_modules=["q_proj"]
    ).to_dict()
    ids, raw = queue_hostile(trainer.run.root, template, files, random.Random(0), n=180)
    trainer.train()

    for g in good:
        assert trainer.tenants[g.name].state is TenantState.FINISHED
        assert trainer.losses(g.name) == pytest.approx(reference.losses(g.name), abs=1e-6)
        got, want = trainer.model.tenant_tensors(g.name), reference.model.tenant_tensors(g.name)
        assert max((got[m][i] - want[m][i]).abs().max().item() for m in got for i in (0, 1)) <= 1e-6
    results = {i: control.read_result(trainer.run.root, i) for i in ids}
    assert all(r is not None for r in results.values()), "every message is answered"
    refused = [r for r in results.values() if not r.ok]
    assert len(refused) >= len(ids) - 6 and all(r.error for r in refused)
    rejected = trainer.run.control / "rejected"
    assert all((rejected / f"{name}.reason").is_file() for name in raw), "every bad file is rejected with why"
    assert not [p for p in trainer.run.control.iterdir() if p.name.endswith(".json")], "the queue is empty"
    assert not (tmp_path / "payloads" / "PWNED").exists(), "no pickle was loaded"
    states: dict[str, list[str]] = {}
    for r in trainer.history:
        if r["kind"] == "tenant":
            states.setdefault(r["tenant"], []).append(r["state"])
    assert all(s[-1] != "pending" for s in states.values()), "no tenant is left pending"
    # (the second running row carries the tenant's optimiser memory, from its first step on)
    assert states["a"] == states["b"] == ["running", "running", "finished"]
    assert [t.name for t in ml.JobSpec.load(trainer.run.job).tenants][:2] == ["a", "b"]
    # the tenants the job accepted on purpose (an inf in an init adapter, a 5 MB line) never hurt a or b;
    # the non-finite one is quarantined with its reason (a huge lr is refused at the add now)
    quarantined = [n for n, t in trainer.tenants.items() if t.state is TenantState.FAILED]
    assert "h7" in quarantined and all("non-finite" in trainer.tenants[n].reason for n in quarantined)


def test_a_refused_add_is_recorded_as_refused_and_the_name_is_free_again(llama_path, make_data, tmp_path):
    a = ml.Tenant(name="a", data=make_data("text"), rank=4, max_steps=2)
    trainer = Trainer(job(llama_path, [a]), run_dir=tmp_path / "run")
    bad = control.send(trainer.run.root, "add", tenant={**a.to_dict(), "name": "c", "rank": 99})
    clash = control.send(trainer.run.root, "add", tenant={**a.to_dict(), "name": "A"})
    trainer.train()
    with pytest.raises(ControlError, match="rank"):
        control.wait_result(trainer.run.root, bad)
    with pytest.raises(ControlError, match=r"only in case|already exists"):
        control.wait_result(trainer.run.root, clash)
    rows = [(r["tenant"], r["state"]) for r in trainer.history if r["kind"] == "tenant"]
    assert ("c", "refused") in rows and not any(name == "A" for name, _ in rows)
    assert ("a", "refused") not in rows, "a refusal never changes an existing tenant's state"
    trainer.apply_control({"op": "add", "tenant": {**a.to_dict(), "name": "c"}})  # the name was never taken
    assert trainer.tenants["c"].state is TenantState.RUNNING


def test_a_tenant_whose_step_raises_is_quarantined_like_a_nan_tenant(llama_path, tmp_path):
    good = good_tenants(tmp_path, max_steps=5)
    bad = ml.Tenant(name="bad", data=good[0].data, rank=4, max_steps=5, target_modules=["q_proj"])
    reference = Trainer(job(llama_path, good))
    reference.train()
    trainer = Trainer(job(llama_path, [*good, bad]))

    class Exploding(list):  # its rows blow up when the step takes them, from step 3 on
        def __getitem__(self, i):
            if trainer.global_step >= 2:
                raise MemoryError("cannot allocate 1 TiB")
            return super().__getitem__(i)

    stream = trainer.tenants["bad"].feed.stream
    stream.examples = Exploding(stream.examples)
    trainer.train()
    t = trainer.tenants["bad"]
    assert t.state is TenantState.FAILED and "MemoryError" in t.reason and t.step == 2
    for g in good:
        assert trainer.losses(g.name) == pytest.approx(reference.losses(g.name), abs=1e-6)


def test_an_optimiser_step_that_raises_quarantines_only_its_tenant(llama_path, tmp_path):
    good = good_tenants(tmp_path, max_steps=4)
    reference = Trainer(job(llama_path, good))
    reference.train()
    trainer = Trainer(job(llama_path, good))
    opt = trainer.tenants["b"].optimizer

    def explode(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access")

    # tenants step together (mlora_lab.optim.step_many); what fails in one tenant's part stays its own
    opt._items = explode  # (what step_many asks each tenant for: its tensors, gradients and AdamW state)
    trainer.train()
    assert (
        trainer.tenants["b"].state is TenantState.FAILED and "illegal memory" in trainer.tenants["b"].reason
    )
    assert trainer.losses("a") == pytest.approx(reference.losses("a"), abs=1e-6)


def test_a_huge_learning_rate_fails_only_its_tenant(llama_path, tmp_path):
    """lr=1e38 (job.json as the Trainer takes it, unchecked) overflowed the optimiser step every tenant
    shares and ended the job for all. Now that tenant is quarantined at its first step with why, a tenant
    whose weights diverge (weight_decay=1e34 multiplies them by -1e32) too, and the others train exactly
    as without them; an add carrying such an lr is refused before it reaches a slot."""
    good = good_tenants(tmp_path, max_steps=3)
    reference = Trainer(job(llama_path, good))
    reference.train()
    common = dict(data=good[0].data, rank=4, max_steps=3, target_modules=["q_proj"])
    huge = ml.Tenant(name="huge", lr=1e38, **common)
    decay = ml.Tenant(name="decay", lr=1e-2, weight_decay=1e34, **common)
    trainer = Trainer(job(llama_path, [*good, huge, decay]), run_dir=tmp_path / "run")
    add = control.send(trainer.run.root, "add", tenant={**huge.to_dict(), "name": "huge2"})
    trainer.train()
    t = trainer.tenants["huge"]
    assert t.state is TenantState.FAILED and t.step == 0, (t.state, t.reason)
    assert "non-finite update" in t.reason and "lr=1e+38" in t.reason and "tenant step 1" in t.reason
    d = trainer.tenants["decay"]
    assert d.state is TenantState.FAILED and "diverged" in d.reason and "tenant step 1" in d.reason
    for g in good:
        assert trainer.tenants[g.name].state is TenantState.FINISHED
        assert trainer.losses(g.name) == pytest.approx(reference.losses(g.name), abs=1e-6)
        got, want = trainer.model.tenant_tensors(g.name), reference.model.tenant_tensors(g.name)
        assert max((got[m][i] - want[m][i]).abs().max().item() for m in got for i in (0, 1)) <= 1e-6
    with pytest.raises(ControlError, match=r"lr must be in \(0, 10\] \(got 1e\+38\)"):
        control.wait_result(trainer.run.root, add)


class FakeComm(Collectives):
    """One process pretending another process answered ``other`` (None = fine)."""

    def __init__(self, other: str | None) -> None:
        super().__init__(ParallelDims(1), None, torch.device("cpu"))
        self.other = other

    def gather_objects(self, obj):
        return [obj, self.other]


def test_control_handler_refuses_any_exception_and_undoes_when_another_rank_failed(tmp_path):
    run = RunDir(tmp_path / "run").create()
    log: list[str] = []

    def prepare(msg):
        if msg.name == "boom":
            raise ZeroDivisionError("division by zero")  # not a type anyone would list in advance
        return Change(
            commit=lambda: log.append(f"commit {msg.name}"), undo=lambda: log.append(f"undo {msg.name}")
        )

    refused = []
    controls = SimpleNamespace(prepare=prepare, refused=lambda m, e: refused.append(e))
    handler = ControlHandler(run, FakeComm(None), True, controls)
    ok, boom = control.send(run.root, "pause", name="ok"), control.send(run.root, "pause", name="boom")
    results = handler.poll(step=3)
    assert [r.ok for r in results] == [True, False] and log == ["commit ok"]
    assert (
        "ZeroDivisionError" in control.read_result(run.root, boom).error
        and control.read_result(run.root, ok).ok
    )
    quiet = SimpleNamespace(prepare=prepare, refused=lambda m, e: None)
    other_failed = ControlHandler(run, FakeComm("MemoryError: on rank 1"), True, quiet)
    third = control.send(run.root, "pause", name="third")
    (result,) = other_failed.poll(step=4)
    assert not result.ok and "another process" in result.error and "rank 1" in result.error
    assert log == ["commit ok", "undo third"], "the rank that prepared it takes it back"
    assert not result.ok and control.read_result(run.root, third).step == 4


def test_checkpointer_falls_back_from_a_truncated_checkpoint_and_says_so(llama_path, tmp_path):
    good = good_tenants(tmp_path, max_steps=8)
    straight = Trainer(job(llama_path, good))
    straight.train()
    first = Trainer(job(llama_path, good, save_every=2), run_dir=tmp_path / "run")
    for _ in range(4):
        first.step()
        if first.global_step % 2 == 0:
            first.save(final=False)
    first.close()
    newest = tmp_path / "run" / "checkpoints" / "step_00000004" / "tensors.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])
    assert isinstance(first.checkpointer, Checkpointer)
    again = Trainer(job(llama_path, good, save_every=2), run_dir=tmp_path / "run", resume=True)
    assert again.global_step == 2
    events = [r for r in again.history if r["kind"] == "event"]
    assert events[0]["event"] == "checkpoint_skipped" and "step_00000004" in events[0]["message"]
    again.train()
    for g in good:
        assert again.losses(g.name)[-1] == pytest.approx(straight.losses(g.name)[-1], abs=1e-6)


def test_save_every_writes_adapters_and_pausing_everyone_keeps_the_job(llama_path, make_data, tmp_path):
    a = ml.Tenant(name="a", data=make_data("text"), rank=4, max_steps=6)
    trainer = Trainer(job(llama_path, [a], save_every=2), run_dir=tmp_path / "run")
    saved_at = []
    save = trainer.pool.save_adapter
    trainer.pool.save_adapter = lambda name: (saved_at.append(trainer.global_step), save(name))[1]
    trainer.step()
    trainer.step()
    trainer.apply_control({"op": "pause", "name": "a"})

    def resume_later():
        time.sleep(1.5)
        control.send(trainer.run.root, "resume", name="a")

    threading.Thread(target=resume_later).start()
    trainer.train(idle_s=0.1)  # a non-serve job whose only tenant is paused waits, not ends
    assert trainer.tenants["a"].state is TenantState.FINISHED and trainer.tenants["a"].step == 6
    assert 4 in saved_at, f"save_every=2 saved adapters at steps {saved_at}"


def test_relative_paths_of_a_runtime_add_resolve_against_the_run_and_survive_resume(llama_path, tmp_path):
    good = good_tenants(tmp_path, max_steps=3)
    trainer = Trainer(job(llama_path, good, save_every=1), run_dir=tmp_path / "run")
    write_jsonl(tmp_path / "run" / "mine.jsonl", long_text_rows(seed=5))
    msg = control.send(
        trainer.run.root, "add", tenant={**good[0].to_dict(), "name": "rel", "data": "mine.jsonl"}
    )
    trainer.step()
    trainer.poll()
    assert control.read_result(trainer.run.root, msg).ok
    saved = ml.JobSpec.load(tmp_path / "run" / "job.json").tenant("rel").data
    assert saved == str(tmp_path / "run" / "mine.jsonl")
    trainer.save(final=False)
    again = Trainer(ml.JobSpec.load(tmp_path / "run" / "job.json"), run_dir=tmp_path / "run", resume=True)
    assert again.tenants["rel"].state is TenantState.RUNNING


def test_run_api_sends_absolute_paths(llama_path, tmp_path, monkeypatch):
    """``Run.add_tenant`` validates paths against the caller's working directory and sends them
    absolute, so the job reads exactly the files that were validated."""
    run_dir = tmp_path / "run"
    trainer = Trainer(job(llama_path, good_tenants(tmp_path, max_steps=1)), run_dir=run_dir)
    (run_dir / "status.json").write_text(json.dumps({"state": "running"}))
    elsewhere = tmp_path / "notebook"
    elsewhere.mkdir()
    write_jsonl(elsewhere / "mine.jsonl", long_text_rows(seed=7))
    monkeypatch.chdir(elsewhere)
    run = ml.Run(run_dir)
    run._alive = lambda status: True
    run.add_tenant(ml.Tenant(name="rel", data="mine.jsonl", rank=4, target_modules=["q_proj"]), wait=False)
    (item,) = control.incoming(run_dir)
    assert item.message.tenant["data"] == str(elsewhere / "mine.jsonl")
    trainer.close()


def test_a_job_json_tenant_that_cannot_start_fails_alone(llama_path, tmp_path):
    """Resuming after a tenant's data file vanished: that tenant fails with why; the others resume."""
    good = good_tenants(tmp_path, max_steps=4)
    first = Trainer(job(llama_path, good, save_every=1), run_dir=tmp_path / "run")
    first.step()
    first.save(final=False)
    first.close()
    Path(good[1].data).unlink()
    again = Trainer(ml.JobSpec.load(tmp_path / "run" / "job.json"), run_dir=tmp_path / "run", resume=True)
    assert list(again.tenants) == ["a"] and "could not start" in again.unstarted["b"]
    again.train()
    assert again.tenants["a"].state is TenantState.FINISHED
    rows = [r for r in again.history if r["kind"] == "tenant" and r["tenant"] == "b"]
    assert rows[-1]["state"] == "failed" and "not found" in rows[-1]["reason"]


def test_checkpoint_holds_no_pickle(llama_path, tmp_path):
    trainer = Trainer(
        job(llama_path, good_tenants(tmp_path, max_steps=2), save_every=1), run_dir=tmp_path / "run"
    )
    trainer.train()
    (ckpt,) = checkpoint.checkpoint_dirs(tmp_path / "run" / "checkpoints")[-1:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "state.json", "tensors.safetensors"]
    assert checkpoint.read_checkpoint(ckpt)["tenants"]["a"]["step"] == 2


@pytest.mark.slow
def test_fuzz_a_serving_two_rank_job(llama_path, tmp_path):
    """A serving 2-process job (FSDP2) takes ~400 hostile messages and tenant specs in bursts while
    tenants a and b train: it stays up, answers every one, and a and b end exactly as in a 2-process
    run that never saw them (losses and adapters within 1e-5 of one process)."""
    from mlora_lab.lora import read_adapter

    good = good_tenants(tmp_path, max_steps=16)
    two = ml.Parallel(nproc=2, fsdp=2)
    files = payload_files(tmp_path / "payloads", llama_path)
    template = ml.Tenant(
        name="t", data=good[0].data, rank=4, max_steps=3, target_modules=["q_proj"]
    ).to_dict()
    run = ml.launch(
        job(llama_path, good, parallel=two, stay_up=True, max_tenants=12, output_dir=str(tmp_path / "served"))
    )
    rng = random.Random(1)
    ids, raw = [], []
    deadline = time.monotonic() + 600
    for burst in range(4):
        while run.global_step < 2 * burst + 1:  # bursts land at different points of training
            assert run.status == "running" or run.status == "starting", run.logs(0)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        i, r = queue_hostile(run.path, template, files, rng, n=60, prefix=f"x{burst}_")
        ids += i
        raw += r
    for msg_id in ids:
        while control.read_result(run.path, msg_id) is None:
            assert run.status == "running", run.logs(0)
            assert time.monotonic() < deadline, "a message was never answered"
            time.sleep(0.2)
    while {run.tenant_state("a"), run.tenant_state("b")} != {TenantState.FINISHED}:
        assert run.status == "running" and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.2)
    assert run.status == "running", "the job survived everything"
    assert run.stop(timeout=120) == "stopped"
    # the same job without the messages, here on one process (2 ranks equal 1 within 1e-5: test_distributed)
    reference = Trainer(job(llama_path, good))
    reference.train()

    def losses(r: ml.Run, name: str) -> list[float]:
        return [row["loss"] for row in r.rows() if row["kind"] == "train" and row["tenant"] == name]

    for name in ("a", "b"):
        assert losses(run, name) == pytest.approx(reference.losses(name), abs=1e-5)
        got, want = read_adapter(run.adapter_path(name))[1], reference.model.tenant_tensors(name)
        assert set(got) == set(want)
        assert max((got[m][i] - want[m][i]).abs().max().item() for m in got for i in (0, 1)) <= 1e-5
    assert len(ids) + len(raw) >= 400
    assert all((run.path / "control" / "rejected" / f"{n}.reason").is_file() for n in raw)
    assert not [p for p in (run.path / "control").iterdir() if p.name.endswith(".json")]
    last: dict[str, str] = {}
    for row in run.rows():
        if row["kind"] == "tenant":
            last[row["tenant"]] = row["state"]
    assert "pending" not in last.values()
    # each burst carried a valid tenant whose init adapter holds an inf: accepted, quarantined in training
    assert all(last[f"x{burst}_7"] == "failed" for burst in range(4)), {
        k: v for k, v in last.items() if "_7" in k
    }
    assert sum(1 for i in ids if not control.read_result(run.path, i).ok) >= len(ids) - 12
    assert not (tmp_path / "payloads" / "PWNED").exists()


def test_a_tenant_with_tokens_the_model_cannot_embed_fails_alone(tiny_models, tmp_path):
    """Qwen2's tokenizer class adds ``<|endoftext|>`` (id 512) to a 512-row vocabulary: a tenant whose
    text holds it would index past the embedding of the shared forward. It fails alone, with why;
    the job and its other tenant go on."""
    base = tiny_models("qwen2")
    rows = [{"text": f"<|endoftext|> {r['text']}"} for r in long_text_rows(seed=3)]
    poisoned = ml.Tenant(
        name="p", data=write_jsonl(tmp_path / "p.jsonl", rows), rank=4, target_modules=["q_proj"]
    )
    good = good_tenants(tmp_path, max_steps=3)[0]
    trainer = Trainer(job(base, [good, poisoned]), run_dir=tmp_path / "run")
    assert list(trainer.tenants) == ["a"] and "cannot embed" in trainer.unstarted["p"]
    trainer.train()
    assert trainer.tenants["a"].state is TenantState.FINISHED
    msg = control.send(trainer.run.root, "add", tenant={**poisoned.to_dict(), "name": "p2"})
    trainer.poll()
    with pytest.raises(ControlError, match="cannot embed"):
        control.wait_result(trainer.run.root, msg)


def test_folders_replaced_under_a_running_job_never_lead_it_outside(llama_path, tmp_path):
    """A stray symlink planted in the run while the job runs (control/done, control/results,
    checkpoints/ leading elsewhere) or control/ replaced by a file: the job writes nothing outside
    the run, says what it could not do, and its tenants train to the end."""
    import os
    import shutil

    good = good_tenants(tmp_path, max_steps=4)
    trainer = Trainer(job(llama_path, good, save_every=1), run_dir=tmp_path / "run")
    run = trainer.run
    trainer.step()
    outside = tmp_path / "outside"
    outside.mkdir()
    for folder in (run.control / "done", run.control / "results", run.checkpoints):
        shutil.rmtree(folder, ignore_errors=True)
        folder.symlink_to(outside)
    msg = control.send(run.root, "pause", name="zz")
    for _ in range(2):
        trainer.step()
        trainer.poll()
        trainer.save(final=False)
    assert not any(outside.iterdir()), sorted(outside.iterdir())
    events = [r["message"] for r in trainer.history if r["kind"] == "event"]
    assert any(f"{run.checkpoints} is a symbolic l" in m for m in events), events
    # the message is applied (refused: no tenant zz) and filed under rejected/ (a real folder); its answer
    # cannot be written (results/ leads outside), which the job's log says instead
    assert (run.control / "rejected" / f"{msg}.json").name in {
        p.name.split("-", 1)[1] for p in (run.control / "rejected").glob("*.json")
    }
    assert not (outside / f"{msg}.json").exists()
    shutil.rmtree(run.control)
    run.control.write_text("not a folder")
    with pytest.raises(
        SaveError, match="checkpoints is a symbolic link"
    ):  # the final checkpoint has nowhere to go
        trainer.train()
    assert all(trainer.tenants[g.name].state is TenantState.FINISHED for g in good)
    assert all((run.adapters / g.name / "adapter_model.safetensors").is_file() for g in good)
    assert not any(outside.iterdir()) and not os.path.islink(run.adapters)
