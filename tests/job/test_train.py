"""Training-loop semantics: accumulation, counters, schedules, clipping, evaluation, checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mlora_lab.job.trainer import Trainer
from mlora_lab.optim import TenantOptimizer
from mlora_lab.rundir import (
    HELDOUT_KIND,
    HeldoutRow,
    MetricsReader,
    MetricsWriter,
    atomic_write_text,
    checkpoint,
)
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant


def spec_for(base: str, tenants: list[Tenant], **kw) -> JobSpec:
    return JobSpec(base_model=base, tenants=tenants, seq_len=64, max_rank=16, max_tenants=4, **kw)


def test_grad_accum_equals_one_big_batch(llama_path, make_data):
    """k micro-batches of b rows give the step of one batch of k*b rows: the loss is the mean over
    the whole window's target tokens, not a mean of per-micro-batch means."""
    data = make_data("reverse", 12)
    common = dict(name="t", data=data, rank=4, lr=1e-2, max_steps=3, shuffle=False, max_grad_norm=None)
    accum = Trainer(spec_for(llama_path, [Tenant(batch_size=2, grad_accum=3, **common)]))
    accum.train()
    big = Trainer(spec_for(llama_path, [Tenant(batch_size=6, grad_accum=1, **common)]))
    big.train()
    assert accum.global_step == 9 and big.global_step == 3
    assert accum.losses("t") == pytest.approx(big.losses("t"), abs=1e-6)
    for m, (A, B) in accum.model.tenant_tensors("t").items():
        A2, B2 = big.model.tenant_tensors("t")[m]
        torch.testing.assert_close(A, A2, atol=1e-6, rtol=0)
        torch.testing.assert_close(B, B2, atol=1e-6, rtol=0)


def test_counters_and_cursors_move_only_when_a_tenant_trains(llama_path, make_data):
    short = Tenant(name="short", data=make_data("reverse", 10), rank=4, batch_size=3, max_steps=2)
    long = Tenant(name="long", data=make_data("text", 10), rank=4, batch_size=2, max_steps=7)
    trainer = Trainer(spec_for(llama_path, [short, long]))
    trainer.train()
    s, lg = trainer.tenants["short"], trainer.tenants["long"]
    assert (s.step, s.state) == (2, "finished") and (lg.step, lg.state) == (7, "finished")
    assert (
        s.feed.stream.state_dict()["cursor"] == 6 and s.feed.stream.epoch == 0
    )  # 2 steps x 3 rows, nothing more
    assert (
        lg.feed.stream.state_dict()["cursor"] == 4 and lg.feed.stream.epoch == 1
    )  # 14 rows = one epoch of 10 + 4
    assert trainer.global_step == 7
    train_rows = [r for r in trainer.history if r["kind"] == "train"]
    assert [r["tenant_step"] for r in train_rows if r["tenant"] == "short"] == [1, 2]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", lambda s: min(1.0, s / 3)),
        ("linear", lambda s: s / 3 if s < 3 else max(0.0, (10 - s) / 7)),
        ("cosine", lambda s: s / 3 if s < 3 else 0.5 * (1 + math.cos(math.pi * (s - 3) / 7))),
    ],
)
def test_schedules_with_warmup(schedule, expected, llama_path, make_data):
    t = Tenant(
        name="s", data=make_data("text"), rank=2, lr=0.1, schedule=schedule, warmup_steps=3, max_steps=10
    )
    trainer = Trainer(spec_for(llama_path, [t]))
    trainer.train()
    lrs = [r["lr"] for r in trainer.history if r["kind"] == "train"]
    assert lrs == pytest.approx([0.1 * expected(s) for s in range(10)], abs=1e-9)


def test_tenant_optimizer_is_torch_adamw_with_per_tenant_clipping():
    """Updating views of a slot tensor equals torch.optim.AdamW + clip_grad_norm_ on plain tensors."""
    torch.manual_seed(0)
    slot = torch.nn.Parameter(torch.randn(3, 4, 5))
    plain = torch.nn.Parameter(slot.detach()[1, :2].clone())
    ours = TenantOptimizer(
        [(slot, (1, slice(0, 2)))], lr=0.1, weight_decay=0.1, max_grad_norm=0.5, max_steps=5
    )
    ref = torch.optim.AdamW([plain], lr=0.1, weight_decay=0.1, foreach=False)
    for _ in range(4):
        g = torch.randn(3, 4, 5)
        slot.grad = g.clone()
        plain.grad = g[1, :2].clone()
        norm = ours.step()
        ref_norm = torch.nn.utils.clip_grad_norm_([plain], 0.5)
        ref.step()
        ours.zero_grad()
        assert float(norm) == pytest.approx(float(ref_norm))
        assert slot.grad[1, :2].abs().sum() == 0 and slot.grad[0].abs().sum() > 0  # only its own part
    torch.testing.assert_close(slot.detach()[1, :2], plain.detach(), atol=1e-6, rtol=0)
    assert ours.state_bytes() == 2 * plain.numel() * 4


def test_heldout_rows_and_checkpoint(llama_path, make_data, tmp_path):
    t = Tenant(
        name="e", data=make_data("upper"), heldout_data=make_data("upper", 5, name="ev"), rank=4, max_steps=4
    )
    trainer = Trainer(spec_for(llama_path, [t], heldout_every=2, save_every=2), run_dir=tmp_path / "run")
    trainer.train()
    evals = [r for r in trainer.history if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 4]
    assert all(r["loss"] > 0 for r in evals)
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000002", "step_00000004"]
    state = checkpoint.read_checkpoint(ckpts[-1])
    assert state["tenants"]["e"]["step"] == 4
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_a_job_json_with_the_old_names_runs_and_resumes(llama_path, make_data, tmp_path):
    """A job.json an older version wrote (``eval_data``, ``eval_every``, ``serve``) loads with one warning as
    the same spec, trains, and resumes from its checkpoint exactly where the job under the new names goes:
    the same train and held-out losses (1e-6); the job.json and checkpoint it writes name the new fields. (An
    older version's checkpoint, its tenants under the old names too: tests/rundir/test_compat.py.)"""
    tenant = Tenant(
        name="e", data=make_data("upper"), heldout_data=make_data("upper", 5, name="ev"), rank=4, max_steps=6
    )
    new = spec_for(llama_path, [tenant], heldout_every=2, name="e")
    old = new.to_dict()
    old["eval_every"], old["serve"] = old.pop("heldout_every"), old.pop("stay_up")
    old["tenants"][0]["eval_data"] = old["tenants"][0].pop("heldout_data")
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps(old))

    def load() -> JobSpec:
        with pytest.warns(DeprecationWarning, match="'eval_every', 'serve' and 'eval_data'") as caught:
            spec = JobSpec.load(run / "job.json")
        assert len([w for w in caught if w.category is DeprecationWarning]) == 1, "one warning per load"
        return spec

    assert load() == new
    straight = Trainer(new)
    straight.train()
    first = Trainer(load(), run_dir=run)
    for _ in range(3):
        first.step()
    first.save_checkpoint()
    first.close()
    saved = checkpoint.read_checkpoint(sorted((run / "checkpoints").glob("step_*"))[-1])
    assert (
        "heldout_data" in saved["tenants"]["e"]["spec"] and "eval_data" not in saved["tenants"]["e"]["spec"]
    )
    assert "heldout_every" in json.loads((run / "job.json").read_text()), "the job writes the new names"
    (run / "job.json").write_text(json.dumps(old))  # (as the older version left it)
    again = Trainer(load(), run_dir=run, resume=True)
    again.train()
    assert again.global_step == straight.global_step == 6
    assert again.losses("e")[-1] == pytest.approx(straight.losses("e")[-1], abs=1e-6)

    def heldout(trainer: Trainer) -> list[tuple[int, float]]:
        return [
            (r["step"], r["loss"]) for r in trainer.history if r["kind"] == HELDOUT_KIND and r["step"] > 3
        ]

    assert [s for s, _ in heldout(again)] == [4, 6, 6]
    assert [v for _, v in heldout(again)] == pytest.approx([v for _, v in heldout(straight)], abs=1e-6)


def test_metrics_reader_never_parses_a_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(HeldoutRow(step=1, tenant="a", loss=1.0))
    reader = MetricsReader(path)
    assert [r.step for r in reader.poll()] == [1]
    with open(path, "a") as f:
        f.write('{"kind": "eval", "step": 2, "tenant": "a", "lo')  # a row being written
    assert reader.poll() == []
    with open(path, "a") as f:
        f.write('ss": 2.0, "time": 0}\n')
    assert [r.step for r in reader.poll()] == [2]
    assert len(reader.rows) == 2
    writer.close()


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    atomic_write_text(tmp_path / "status.json", "{}")
    atomic_write_text(tmp_path / "status.json", '{"state": "running"}')
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]
    assert "running" in (tmp_path / "status.json").read_text()


def test_a_memory_row_counts_the_optimiser_from_the_first_step(llama_path, make_data):
    """Tenant rows are written on state changes; the AdamW state appears at a tenant's first
    optimiser step, so a second ``running`` row then carries it (two fp32 moments per adapter value:
    2 x the adapter's bytes; AdamW's step counters are scalars and not counted)."""
    t = Tenant(name="t", data=make_data("reverse", 12), rank=4, batch_size=2, grad_accum=2, max_steps=3)
    trainer = Trainer(spec_for(llama_path, [t]))

    def memory_rows() -> list[dict]:
        return [r for r in trainer.history if r["kind"] == "tenant"]

    (first,) = memory_rows()
    assert (first["state"], first["optimizer_bytes"], first["local_optimizer_bytes"]) == ("running", 0, 0)
    assert first["adapter_bytes"] > 0
    trainer.step()  # half of the first accumulation window: no optimiser step yet
    assert len(memory_rows()) == 1
    trainer.step()  # the window completes: the first AdamW step
    second = memory_rows()[-1]
    assert second["state"] == "running" and second["step"] == 2
    assert second["optimizer_bytes"] == 2 * second["adapter_bytes"] > 0
    measured = trainer.tenants["t"].optimizer.state_bytes()
    assert second["local_optimizer_bytes"] == measured == 2 * second["local_adapter_bytes"]
    trainer.train()
    assert [r["state"] for r in memory_rows()] == ["running", "running", "finished"]
    assert memory_rows()[-1]["optimizer_bytes"] == second["optimizer_bytes"]


def test_train_rows_count_the_rows_and_tokens_seen(llama_path, make_data):
    """``rows_seen`` and ``tokens_seen`` are cumulative, so they stay exact when ``log_every`` skips
    steps; a step's rows cross into the next epoch as the data does."""
    t = Tenant(name="t", data=make_data("reverse", 10), rank=4, batch_size=3, max_steps=5)
    trainer = Trainer(spec_for(llama_path, [t], log_every=2))
    trainer.train()
    train = [r for r in trainer.history if r["kind"] == "train"]
    assert [(r["tenant_step"], r["rows_seen"]) for r in train] == [(2, 6), (4, 12), (5, 15)]
    assert train[-1]["tokens_seen"] == trainer.tenants["t"].tokens_seen > 0
    assert train[0]["tokens_seen"] < train[1]["tokens_seen"] < train[2]["tokens_seen"]
    system = [r for r in trainer.history if r["kind"] == "system"]
    assert [r["step"] for r in system] == [2, 4]
    assert all(r["cpu_percent"] > 0 and r["gpu_util"] is None for r in system)


def test_packed_rows_seen_counts_documents(llama_path, make_data, monkeypatch):
    from mlora_lab.data import TenantStream

    packed: list = []
    take_packed = TenantStream.take_packed

    def spy(self, rows, seq_len):
        out = take_packed(self, rows, seq_len)
        packed.append(out)
        return out

    monkeypatch.setattr(TenantStream, "take_packed", spy)
    t = Tenant(name="t", data=make_data("reverse", 12), rank=4, batch_size=2, max_steps=3)
    trainer = Trainer(spec_for(llama_path, [t], packing=True))
    trainer.train()
    documents = [sum(row.position_ids.count(0) for row in rows) for rows in packed]  # a document starts at 0
    train = [r for r in trainer.history if r["kind"] == "train"]
    assert [r["rows_seen"] for r in train] == [sum(documents[: i + 1]) for i in range(3)]
    assert documents[0] > 2, "several documents share a packed row"


def test_passes_are_cut_between_whole_tenants_within_the_token_budget():
    """``pass_plan`` over ``(rows, longest row)`` per tenant: consecutive passes whose padded tokens
    (rows × longest) fit; a tenant too big for any pass alone; a tenant without rows rides along."""
    from mlora_lab.job.engine import pass_plan

    sizes = [(2, 10), (3, 10), (0, 0), (1, 40), (4, 5), (1, 5)]
    assert pass_plan(sizes, 10**6) == [[0, 1, 2, 3, 4, 5]]
    assert pass_plan(sizes, 50) == [[0, 1, 2], [3], [4, 5]]  # 5 x 10; 1 x 40; 5 x 5
    assert pass_plan(sizes, 1) == [[0], [1, 2], [3], [4], [5]]
    assert pass_plan(sizes, 60) == [[0, 1, 2], [3], [4, 5]]  # (5 + 1) x 40 > 60
    assert pass_plan([(0, 0), (0, 0)], 1) == [[0, 1]]


def test_max_pass_tokens_is_checked_with_the_other_settings(llama_path, make_data):
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.validate import problems

    t = Tenant(name="t", data=make_data("reverse"))
    assert problems(JobSpec(base_model=llama_path, tenants=[t], max_pass_tokens=512)) == []
    found = problems(JobSpec(base_model=llama_path, tenants=[t], max_pass_tokens=0, seq_len=-1))
    assert {p.field for p in found} >= {"max_pass_tokens", "seq_len"}, found
    spec = JobSpec(base_model=llama_path, tenants=[t], max_pass_tokens=512)
    assert JobSpec.from_dict(spec.to_dict()).max_pass_tokens == 512


def test_an_unset_pass_budget_is_one_pass_but_in_a_served_job_on_a_cpu(llama_path, make_data):
    """``max_pass_tokens=None``: one pass, except for a job that serves on a CPU (1,024 padded tokens a pass:
    a served step holds however many clients wait at once); a number is kept."""
    from mlora_lab.job.engine import SERVED_CPU_PASS_TOKENS, Engine
    from mlora_lab.parallel import Collectives, ParallelDims
    from mlora_lab.spec.parts import Service

    t = Tenant(name="t", data=make_data("reverse"))
    assert Trainer(spec_for(llama_path, [t])).engine.max_pass_tokens is None
    assert Trainer(spec_for(llama_path, [t], max_pass_tokens=7)).engine.max_pass_tokens == 7
    dims = ParallelDims(world_size=1)
    comm = Collectives(dims, None, torch.device("cpu"))
    served = spec_for(llama_path, [], service=Service(), slot_modules=["q_proj"])
    assert Engine.build(served, dims, None, comm).max_pass_tokens == SERVED_CPU_PASS_TOKENS == 1024
    served.max_pass_tokens = 4096
    assert Engine.build(served, dims, None, comm).max_pass_tokens == 4096
