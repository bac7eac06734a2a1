"""Gradient homes (mlora_lab.lora.homes): a layer's tenants' gradients written into their arena rows by one
copy, changing nothing of what a job computes."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from mlora_lab.job.trainer import Trainer
from mlora_lab.lora import homes
from mlora_lab.spec import JobSpec, Tenant

SHAPES = [(2, 5), (3, 2)]


def tenant(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in SHAPES]


def test_rows_are_taken_given_back_and_the_arena_doubles_keeping_a_gradient_being_accumulated():
    arena = homes.Arena(tuple(SHAPES), torch.float32, torch.device("cpu"))
    leaves = [tenant(k) for k in range(3)]
    first = arena.join(leaves[0])
    assert arena.buffer.shape == (1, 16) and first[0].row == 0
    leaves[0][1].grad = first[1].view
    first[1].view.copy_(torch.arange(6.0).view(3, 2))  # a gradient being accumulated, in its home
    arena.join(leaves[1])
    third = arena.join(leaves[2])
    assert arena.buffer.shape == (4, 16) and third[0].row == 2  # 1 -> 2 -> 4 rows
    assert leaves[0][1].grad is first[1].view, "the .grad follows its home into the new buffer"
    assert leaves[0][1].grad.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    torch.testing.assert_close(leaves[0][1].grad, torch.arange(6.0).view(3, 2), rtol=0, atol=0)
    assert all(leaf._grad_home.row == 2 for leaf in leaves[2])
    arena.leave(third)
    assert not hasattr(leaves[2][0], "_grad_home") and arena.rows[2] is None
    assert arena.join(tenant(9))[0].row == 2, "a free row is taken again"
    for homes_ in [h for h in arena.rows if h is not None]:
        arena.leave(homes_)
    assert arena.buffer.numel() == 0 and arena.rows == [], "no tenant left: nothing kept"


def test_a_bucket_goes_home_by_one_copy_only_when_its_leaves_are_consecutive_rows_without_gradients():
    arena = homes.Arena(tuple(SHAPES), torch.float32, torch.device("cpu"))
    leaves = [tenant(k) for k in range(3)]
    for ls in leaves:
        arena.join(ls)
    d = torch.randn(3, *SHAPES[0])
    assert not homes.take(d, [leaves[1][0], leaves[0][0], leaves[2][0]]), "rows out of order"
    assert not homes.take(d, [leaves[0][0], leaves[1][1], leaves[2][0]]), "not one tensor of the layout"
    assert not homes.take(d, [leaves[0][0], torch.zeros(2, 5), leaves[2][0]]), "a leaf without a home"
    assert all(ls[0].grad is None for ls in leaves)
    assert homes.take(d, [ls[0] for ls in leaves])
    for k, ls in enumerate(leaves):
        assert ls[0].grad is ls[0]._grad_home.view
        torch.testing.assert_close(ls[0].grad, d[k], rtol=0, atol=0)
        torch.testing.assert_close(arena.row(k)[:10], d[k].reshape(-1), rtol=0, atol=0)
    assert not homes.take(d, [ls[0] for ls in leaves]), "gradients already there: accumulated, not copied"


def test_a_copy_or_a_pickle_of_a_leaf_has_no_home():
    arena = homes.Arena(tuple(SHAPES), torch.float32, torch.device("cpu"))
    leaves = tenant(0)
    arena.join(leaves)
    buffer = io.BytesIO()
    torch.save(leaves[0], buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(leaves[0]), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(other, leaves[0], rtol=0, atol=0)
        assert other._grad_home is None
        assert not homes.take(torch.zeros(1, 2, 5), [other])


@pytest.mark.parametrize("accum", [1, 2])
def test_a_job_computes_the_same_with_and_without_homes(llama_path, make_data, monkeypatch, accum):
    """Three rank-4 tenants (one arena; buckets of consecutive rows: homes taken) and a rank-8 one (its own
    arena and bucket), with gradient accumulation or without: four steps give bit for bit the losses and
    adapters of the same job with every gradient gathered tensor by tensor."""

    def job() -> Trainer:
        tenants = [
            Tenant(name=f"t{i}", data=make_data("reverse" if i % 2 else "text", 12, name=f"t{i}"), rank=8 if i == 3 else 4, lr=1e-2,
                   batch_size=2, grad_accum=accum, max_steps=4, seed=i, max_grad_norm=0.5)
            for i in range(4)
        ]  # fmt: skip
        return Trainer(JobSpec(base_model=llama_path, tenants=tenants, seq_len=64, max_rank=8, max_tenants=4))

    taken = []
    take = homes.take

    def counted(d, leaves):
        taken.append(take(d, leaves))
        return taken[-1]

    monkeypatch.setattr(homes, "take", counted)
    with_homes = job()
    with_homes.train()
    assert any(taken), "the homes were used"
    opt = with_homes.tenants["t0"].optimizer
    monkeypatch.setattr(homes, "take", lambda d, leaves: False)
    gathered = job()
    gathered.train()
    for name in ("t0", "t1", "t2", "t3"):
        assert with_homes.losses(name) == gathered.losses(name)
        for m, (A, B) in with_homes.model.tenant_tensors(name).items():
            A2, B2 = gathered.model.tenant_tensors(name)[m]
            assert torch.equal(A, A2) and torch.equal(B, B2)
    assert opt._homes is None, "a finished tenant gives its row back"
