"""Packing (``JobSpec.packing``): documents of one tenant share rows, each computed as if alone."""

from __future__ import annotations

import random

import pytest
import torch

from mlora_lab.data import (
    IGNORE_INDEX,
    PACK_PATIENCE,
    Example,
    TenantStream,
    collate,
    pack,
    pack_rows,
    padding_waste,
)
from mlora_lab.job.trainer import Trainer
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import TYPICAL_TARGETS

ARCHS = ["llama", "qwen2", "phi3", "gpt_neox", "qwen3_moe"]
TOL = 1e-5


def doc(n: int, start: int = 10, prompt: int = 0) -> Example:
    ids = list(range(start, start + n))
    return Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def test_pack_restarts_positions_and_drops_each_first_label():
    row = pack([doc(3, 10, prompt=1), doc(2, 20)])
    assert row.input_ids == [10, 11, 12, 20, 21]
    assert row.position_ids == [0, 1, 2, 0, 1]
    # the second document's first token is never predicted from the first one's last token
    assert row.labels == [IGNORE_INDEX, 11, 12, IGNORE_INDEX, 21]
    assert row.n_target == doc(3, 10, prompt=1).n_target + doc(2, 20).n_target


def test_collate_gives_positions_only_when_packed():
    plain = collate([("a", [doc(3), doc(5)])], pad_id=0)
    assert plain.position_ids is None
    mixed = collate([("a", [pack([doc(2), doc(3)])]), ("b", [doc(4)])], pad_id=0)
    assert mixed.position_ids.tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 0]]  # padding: its own run


def test_pack_rows_best_fit_decreasing_with_patience():
    lengths = [5, 4, 3, 3, 2, 6]
    rows, left = pack_rows([(i, 0) for i in range(6)], lengths, rows=2, seq_len=8)
    # longest first, each into the row it fills best: 6+2 and 5+3; 4 and the other 3 wait
    assert rows == [[5, 4], [0, 2]] and left == [(1, 1), (3, 1)]
    assert all(sum(lengths[i] for i in r) <= 8 for r in rows)
    # a document that has waited PACK_PATIENCE calls goes before longer new ones
    rows, left = pack_rows([(3, PACK_PATIENCE), (5, 0), (0, 0)], lengths, rows=1, seq_len=8)
    assert rows == [[3, 0]] and left == [(5, 1)]


def test_take_packed_loses_nothing_and_resumes_exactly():
    """Rows hold whole documents, at most seq_len tokens; what was placed plus what waits is exactly
    what was drawn from the stream (nothing lost, nothing twice); no document waits long; a stream
    restored from state_dict continues identically."""
    rng = random.Random(0)
    examples = [doc(rng.randint(2, 30), start=i * 40) for i in range(50)]
    stream = TenantStream(examples, seed=3)
    placed = []
    for call in range(12):
        if call == 5:
            state = stream.state_dict()
        rows = stream.take_packed(3, 32)
        assert 1 <= len(rows) <= 3 and all(len(r) <= 32 for r in rows)
        for r in rows:
            placed += [r.input_ids[i] // 40 for i, p in enumerate(r.position_ids) if p == 0]
        assert all(w <= 2 * PACK_PATIENCE for _, w in stream.state_dict()["pending"])
    waiting = [i for i, _ in stream.state_dict()["pending"]]
    drawn = TenantStream(examples, seed=3).take(len(placed) + len(waiting))
    assert sorted(placed + waiting) == sorted(ex.input_ids[0] // 40 for ex in drawn)
    assert len(placed) > len(examples)  # more than one pass
    again, replay = TenantStream(examples, seed=3), TenantStream(examples, seed=3)
    again.load_state_dict(state)
    replay.load_state_dict(state)
    for _ in range(7):
        a, b = again.take_packed(3, 32), replay.take_packed(3, 32)
        assert [(x.input_ids, x.labels, x.position_ids) for x in a] == [
            (x.input_ids, x.labels, x.position_ids) for x in b
        ]


def test_packing_wastes_less_padding():
    rng = random.Random(1)
    examples = [doc(rng.randint(20, 500)) for _ in range(400)]
    padded, packed = [], []
    plain, stream = TenantStream(examples, seed=0), TenantStream(examples, seed=0)
    for _ in range(50):
        padded.append(padding_waste(plain.take(4)))
        packed.append(padding_waste(stream.take_packed(4, 512)))
    assert sum(packed) / len(packed) < 0.05 < sum(padded) / len(padded)


def _loss_and_grads(trainer: Trainer, groups) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Each tenant's mean target-token loss (as a training step computes it), and the gradients."""
    trainer.model.zero_grad(set_to_none=True)
    batch, token_loss = trainer.engine.forward(groups)
    tokens = {name: sum(ex.n_target for ex in rows) for name, rows in groups}
    means = {name: token_loss[s:e].sum() / tokens[name] for name, s, e in batch.segments}
    sum(means.values()).backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_tenant_tensors() if p.grad is not None}
    return {k: float(v.detach()) for k, v in means.items()}, grads


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_unpacked(arch, tiny_models, make_data):
    """The same documents, packed (two tenants, never sharing a row) or one per row: each tenant's
    loss and every slot gradient agree to 1e-5 (positions restart, no attention across documents)."""
    targets = TYPICAL_TARGETS[arch]
    tenants = [
        Tenant(name="a", data=make_data("reverse"), rank=4, target_modules=targets, seed=1),
        Tenant(name="b", data=make_data("chat"), rank=8, target_modules=targets[:2], seed=2),
    ]
    trainer = Trainer(JobSpec(base_model=tiny_models(arch), tenants=tenants, seq_len=64, max_rank=8))
    with torch.no_grad():  # B != 0, so the adapters take part in the forward too
        g = torch.Generator().manual_seed(0)
        for name in trainer.model.tenants:
            for B, _ in list(trainer.model.tenant_slices(name))[1::2]:
                B.normal_(0, 0.05, generator=g)
    trainer.model.train()
    docs = {n: trainer.tenants[n].feed.stream.take(6) for n in ("a", "b")}
    unpacked = [(n, d) for n, d in docs.items()]
    packed = [("a", [pack(docs["a"][:4]), pack(docs["a"][4:])]), ("b", [pack(docs["b"])])]
    loss_u, grads_u = _loss_and_grads(trainer, unpacked)
    loss_p, grads_p = _loss_and_grads(trainer, packed)
    assert loss_p == pytest.approx(loss_u, abs=TOL, rel=0)
    assert set(grads_u) == set(grads_p) and grads_u
    for name in grads_u:
        torch.testing.assert_close(grads_p[name], grads_u[name], atol=TOL, rtol=0, msg=name)


def test_packed_job_trains_and_resumes_exactly(llama_path, make_data, tmp_path):
    """packing=True: rows are full of whole documents, loss falls, and a checkpoint taken mid-window
    (packed rows and documents waiting to be placed) resumes exactly."""
    tenants = [
        Tenant(name="a", data=make_data("reverse", 40), rank=4, target_modules=["q_proj", "v_proj"],
               lr=1e-2, batch_size=2, grad_accum=2, max_steps=8),
        Tenant(name="b", data=make_data("text", 40), rank=8, target_modules=["all-linear"], lr=5e-3,
               batch_size=1, max_steps=8),
    ]  # fmt: skip
    spec = dict(
        base_model=llama_path,
        tenants=tenants,
        seq_len=48,
        max_rank=8,
        packing=True,
        slot_modules=["all-linear"],
    )
    straight = Trainer(JobSpec(**spec))
    straight.train()
    for t in ("a", "b"):
        losses = straight.losses(t)
        assert len(losses) == 8 and losses[-1] < losses[0]
    first = Trainer(JobSpec(**spec), run_dir=tmp_path / "run")
    for _ in range(3):
        first.step()
    assert first.tenants["a"].feed.micro == 1  # mid-window
    window = first.tenants["a"].feed.window
    assert all(len(r) <= 48 for rows in window for r in rows) and any(
        r.position_ids.count(0) > 1 for rows in window for r in rows
    )
    first.save_checkpoint()
    first.close()
    again = Trainer(JobSpec(**spec), run_dir=tmp_path / "run", resume=True)
    again.train()
    for t in ("a", "b"):
        assert again.losses(t)[-1] == pytest.approx(straight.losses(t)[-1], abs=1e-6)
        for m, (A, B) in straight.model.tenant_tensors(t).items():
            A2, B2 = again.model.tenant_tensors(t)[m]
            torch.testing.assert_close(A2, A, atol=1e-6, rtol=0)
            torch.testing.assert_close(B2, B, atol=1e-6, rtol=0)
