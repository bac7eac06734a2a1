"""Gradient homes (mlora_lab.lora.homes): a layer's tenants' gradients written into their arena rows by one
copy, changing nothing of what a job computes."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from mlora_lab.job.trainer import Trainer
from mlora_lab.lora import homes
from mlora_lab.lora.model import TensorIO
from mlora_lab.optim import TenantOptimizer, sq_norms, step_many
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant

SHAPES = [(2, 5), (3, 2)]


def tenant(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in SHAPES]


def test_rows_are_taken_given_back_and_the_arena_grows_keeping_a_gradient_being_accumulated():
    arena = homes.Arena(tuple(SHAPES), torch.float32, torch.device("cpu"))
    leaves = [tenant(k) for k in range(3)]
    first = arena.join(leaves[0])
    assert arena.buffer.shape == (1, 16) and first[0].row == 0
    assert [homes.grown(n) for n in (1, 2, 4, 8, 64)] == [2, 3, 5, 10, 80]
    leaves[0][1].grad = first[1].view
    first[1].view.copy_(torch.arange(6.0).view(3, 2))  # a gradient being accumulated, in its home
    arena.join(leaves[1])
    third = arena.join(leaves[2])
    assert arena.buffer.shape == (3, 16) and third[0].row == 2  # 1 -> 2 -> 3 rows
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
    assert homes.spot([leaves[1][0], leaves[0][0], leaves[2][0]]) is None, "rows out of order"
    assert homes.spot([leaves[0][0], leaves[1][1], leaves[2][0]]) is None, "not one tensor of the layout"
    assert homes.spot([leaves[0][0], torch.zeros(2, 5), leaves[2][0]]) is None, "a leaf without a home"
    assert all(ls[0].grad is None for ls in leaves)
    found = homes.spot([ls[0] for ls in leaves])
    assert found is not None
    homes.put(d, [ls[0] for ls in leaves], found)
    for k, ls in enumerate(leaves):
        assert ls[0].grad is ls[0]._grad_home.view
        torch.testing.assert_close(ls[0].grad, d[k], rtol=0, atol=0)
        torch.testing.assert_close(arena.row(k)[:10], d[k].reshape(-1), rtol=0, atol=0)
    assert homes.spot([ls[0] for ls in leaves]) is None, "gradients already there: accumulated, not copied"


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
        assert homes.spot([other]) is None


@pytest.mark.parametrize("accum", [1, 2])
def test_a_job_computes_the_same_with_and_without_homes(llama_path, make_data, monkeypatch, accum):
    """Three rank-4 tenants (one arena; buckets of consecutive rows: factors stacked as views, homes taken)
    and a rank-8 one (its own arena and bucket), with gradient accumulation or without: four steps give bit
    for bit the losses and adapters of the same job with every layer's factors stacked by copying and every
    gradient gathered tensor by tensor."""

    def job() -> Trainer:
        tenants = [
            Tenant(name=f"t{i}", data=make_data("reverse" if i % 2 else "text", 12, name=f"t{i}"), rank=8 if i == 3 else 4, lr=1e-2,
                   batch_size=2, grad_accum=accum, max_steps=4, seed=i, max_grad_norm=0.5)
            for i in range(4)
        ]  # fmt: skip
        return Trainer(JobSpec(base_model=llama_path, tenants=tenants, seq_len=64, max_rank=8, max_tenants=4))

    taken = []
    put = homes.put

    def counted(d, leaves, found):
        taken.append(len(leaves))
        put(d, leaves, found)

    views = []
    stacked = homes.stacked

    def counted_views(tensors):
        views.append(stacked(tensors))
        return views[-1]

    monkeypatch.setattr(homes, "put", counted)
    monkeypatch.setattr(homes, "stacked", counted_views)
    with_homes = job()
    with_homes.train()
    # steps 2-4 (the rows are taken at the first optimiser step) put A's and B's gradients of both buckets
    # (t0-t2; t3) of every layer into their homes, from each step's first micro-batch (a second one adds)
    assert len(taken) == 3 * 2 * 2 * len(with_homes.model.layers) and sum(taken) == 2 * len(taken)
    assert any(v is not None for v in views), "the factors of tenants in consecutive rows were not stacked"
    opt = with_homes.tenants["t0"].optimizer
    monkeypatch.setattr(homes, "spot", lambda leaves: None)
    monkeypatch.setattr(homes, "stacked", lambda tensors: None)
    gathered = job()
    gathered.train()
    for name in ("t0", "t1", "t2", "t3"):
        assert with_homes.losses(name) == gathered.losses(name)
        for m, (A, B) in with_homes.model.tenant_tensors(name).items():
            A2, B2 = gathered.model.tenant_tensors(name)[m]
            assert torch.equal(A, A2) and torch.equal(B, B2)
    assert opt._homes is None, "a finished tenant gives its row back"


def test_weights_rows_grow_keeping_the_same_tensors_and_a_gone_tenant_gives_its_row_back():
    arena = homes.Weights(tuple(SHAPES), torch.float32, torch.device("cpu"))
    values = [tenant(k) for k in range(3)]
    tensors = [arena.join(v) for v in values]
    assert arena.buffer.shape == (3, 16)  # 1 -> 2 -> 3 rows
    for made, value in zip(tensors, values):
        for t, v in zip(made, value):
            assert t.is_leaf and t.requires_grad and t.grad_fn is None
            assert t.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
            torch.testing.assert_close(t, v, rtol=0, atol=0)
    first = tensors[0][0]
    (first * 2).sum().backward()
    torch.testing.assert_close(first.grad, torch.full_like(first, 2.0))
    kept = tensors[1][1]
    del tensors[1], made, t
    gc.collect()
    assert arena.rows[1] is not None, "one of its tensors is still held: its row stays"
    del kept
    gc.collect()
    assert arena.rows[1] is None, "its tensors are gone: its row is free"
    again = arena.join(tenant(7))
    assert again[0].data_ptr() == arena.buffer[1].data_ptr(), "the free row is taken again"


def test_the_factors_of_consecutive_rows_stack_as_a_view_and_anything_else_by_copying():
    arena = homes.Weights(tuple(SHAPES), torch.float32, torch.device("cpu"))
    tensors = [arena.join(tenant(k)) for k in range(4)]
    A = [t[0] for t in tensors]
    view = homes.stacked(A)
    assert view is not None and not view.requires_grad
    assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr(), "no copy"
    torch.testing.assert_close(view, torch.stack(A), rtol=0, atol=0)
    assert homes.stacked(A[1:3]) is not None, "any run of consecutive rows"
    assert homes.stacked([A[1], A[0], A[2]]) is None, "out of order"
    assert homes.stacked([A[0], A[2]]) is not None, "equally spaced rows are a view too"
    assert homes.stacked([A[0], tensors[1][1], A[2]]) is None, "another tensor of the layout"
    assert homes.stacked([A[0].detach().t(), A[1].detach().t()]) is None, "not contiguous"
    loose = [torch.randn(2, 5) for _ in range(3)]
    assert homes.stacked(loose) is None or torch.equal(homes.stacked(loose), torch.stack(loose))


def test_an_optimiser_follows_its_tenants_weights_when_their_rows_move():
    """A tenant's optimiser made before its arena grows steps the tensors where they are after it, as an
    optimiser over plain copies of them does, and keeps nothing of the old buffer."""
    first = TensorIO().new_many([(None, t.detach()) for t in tenant(0)])
    plain = [t.detach().clone().requires_grad_() for t in first]
    opt, ref = (TenantOptimizer([(t, ()) for t in ts], lr=1e-2) for ts in (first, plain))
    more = []  # tenants of the same layout, until its arena grows
    while first[0].data_ptr() == opt._flat.data_ptr() and len(more) < 64:
        more.append(TensorIO().new_many([(None, t.detach()) for t in tenant(len(more) + 1)]))
    assert first[0].data_ptr() != opt._flat.data_ptr(), "the rows moved"
    for step in range(3):
        for ts in (first, plain):
            for j, t in enumerate(ts):
                t.grad = torch.full_like(t, float(step + j + 1))
        for o in (opt, ref):
            assert step_many([(o, float(sq_norms([o]).sqrt()))]) == {}
            o.zero_grad()
    assert opt.flat and opt._flat.data_ptr() == first[0].data_ptr()
    assert all(h.data_ptr() == t.data_ptr() for h, t in zip(opt.params, first)), "stand-ins follow"
    for a, b in zip(first, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_layers_kept_homes_follow_the_arena_when_it_changes():
    """The grouped backward keeps the homes it found for a layer's bucket (the layer's memo) and puts the
    next step's gradients there without looking at each leaf again, until any arena changes: here between two
    backwards the arena grows (another tenant joins: every row moves) and then a tenant leaves. Every
    gradient equals the one autograd computes without homes, and sits in its home where the home is now."""
    from mlora_lab.lora.layer import segmented_lora

    torch.manual_seed(0)
    IN, OUT, R, T = 5, 3, 2, 4
    shapes = [(R, IN), (OUT, R)]
    tenants = [[torch.randn(*s) for s in shapes] for _ in range(3)]
    arena = homes.Arena(tuple(shapes), torch.float32, torch.device("cpu"))
    joined = [arena.join(ls) for ls in tenants]
    factors = [t for ls in tenants for t in ls]
    plan = tuple((2 * k, (), 2 * k + 1, (), 2 * k, 2 * k + 2, 0.5 + k) for k in range(3))
    memo: dict = {}

    def gradients(memo_: dict | None, factors_: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
        """The factors' gradients, and whether each was in its home (where that home is now)."""
        x = torch.randn(6, T, IN, generator=torch.Generator().manual_seed(1))
        y = torch.randn(6, T, OUT, generator=torch.Generator().manual_seed(2))
        segmented_lora(x, y.clone(), plan, factors_, memo_).square().sum().backward()
        grads = [f.grad.clone() for f in factors_]
        home = getattr(factors_[0], "_grad_home", None)
        at_home = [home is not None and f.grad is getattr(f, "_grad_home", home).view for f in factors_]
        for f, there in zip(factors_, at_home):
            assert (
                not there or f.grad.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
            )
            f.grad = None
        return grads, at_home

    plain = [f.detach().clone().requires_grad_() for f in factors]
    expected, _ = gradients(None, plain)
    for change in ("first", "kept", "grown", "left"):
        if change == "grown":
            arena.join([torch.randn(*s).requires_grad_() for s in shapes])  # (3 -> 4 rows: every row moves)
        elif change == "left":  # (the third tenant: the bucket's gradients go to .grad as plain tensors)
            arena.leave(joined.pop())
        got, at_home = gradients(memo, [f.requires_grad_() for f in factors])
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
        assert all(at_home) if change != "left" else not any(at_home), change
        assert memo, "the homes were kept"


def test_a_layers_kept_stacks_see_updates_and_follow_the_weights_when_they_move():
    """Stacks of a layer's factors that are views of their weights rows are kept in the layer's memo: they
    see every in-place update of the factors (an optimiser step) and are made again once the rows move (the
    buffer grows); a stack that is a copy (tenants out of row order) is never kept. Every output and gradient
    equals the one computed without a memo."""
    from mlora_lab.lora.layer import segmented_lora

    torch.manual_seed(0)
    IN, OUT, R, T = 5, 3, 2, 4
    shapes = [(R, IN), (OUT, R)]
    made = [homes.weights([torch.randn(*s) for s in shapes]) for _ in range(3)]
    x = torch.randn(6, T, IN)

    def run(factors: list[torch.Tensor], memo: dict | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        plan = tuple((2 * k, (), 2 * k + 1, (), 2 * k, 2 * k + 2, 0.5 + k) for k in range(len(factors) // 2))
        out = segmented_lora(x, torch.zeros(6, T, OUT), plan, factors, memo)
        out.square().sum().backward()
        grads = [f.grad.clone() for f in factors]
        for f in factors:
            f.grad = None
        return out.detach(), grads

    def check(factors: list[torch.Tensor], memo: dict) -> None:
        plain = [f.detach().clone().requires_grad_() for f in factors]
        out, grads = run(factors, memo)
        ref, ref_grads = run(plain, None)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for g, e in zip(grads, ref_grads):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)

    factors = [t for ts in made for t in ts]
    memo: dict = {}
    check(factors, memo)
    assert any(k[0] == "stacks" for k in memo), "views kept"
    with torch.no_grad():
        for f in factors:
            f.mul_(1.5)  # (an optimiser's in-place step)
    check(factors, memo)
    before = factors[0].data_ptr()
    while factors[0].data_ptr() == before:  # more tenants of the layout until the buffer grows
        made.append(homes.weights([torch.randn(*s) for s in shapes]))
    with torch.no_grad():
        for f in factors:
            f.add_(0.25)  # (a step after the move: a view of the old buffer would not see it)
    check(factors, memo)
    shuffled, other = [*made[1], *made[0], *made[2]], {}
    check(shuffled, other)
    assert not any(k[0] == "stacks" for k in other), "a copy is never kept"
