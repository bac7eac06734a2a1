"""Every tenant's AdamW step at once (mlora_lab.optim.step_many) equals each tenant's own step."""

from __future__ import annotations

import torch

from mlora_lab.lora.model import TensorIO
from mlora_lab.optim import TenantOptimizer, sq_norms, step_many, tiling


def tenant_tensors(seed: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def shapes(i: int) -> list[tuple[int, int]]:
    return [(3, 5), (7, 3)] if i % 2 else [(2, 4), (4, 2), (6, 2)]


def optimizers(settings) -> list[TenantOptimizer]:
    out = []
    for i, kw in enumerate(settings):
        out.append(TenantOptimizer([(t, ()) for t in tenant_tensors(i, shapes(i))], **kw))
    return out


def flat_optimizers(settings) -> list[TenantOptimizer]:
    """The tenants of :func:`optimizers`, each one's tensors tiling one buffer, as the model makes them."""
    out = []
    for i, kw in enumerate(settings):
        tiled = TensorIO().new_many([(None, t.detach()) for t in tenant_tensors(i, shapes(i))])
        out.append(TenantOptimizer([(t, ()) for t in tiled], **kw))
    return out


def give_grads(opts: list[TenantOptimizer], step: int, skip: tuple[int, int] | None = None) -> None:
    """The same random gradients for the same tenant and step, whoever holds it (``skip``: tenant k's
    tensor j gets none)."""
    for k, o in enumerate(opts):
        g = torch.Generator().manual_seed(100 * step + k)
        for j, (p, _) in enumerate(o.slices):
            grad = torch.randn(p.shape, generator=g) * (k + 1)
            p.grad = None if skip == (k, j) else grad


def step_all(opts: list[TenantOptimizer]) -> None:
    norms = sq_norms(opts).sqrt().tolist()
    assert step_many(list(zip(opts, norms))) == {}
    for o in opts:
        o.zero_grad()


SETTINGS = [
    dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, schedule="cosine", warmup_steps=2, max_steps=6),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, max_grad_norm=None, schedule="linear", max_steps=6),
    dict(lr=1e-3, weight_decay=0.0, max_grad_norm=100.0),
]


def test_step_many_equals_each_tenant_stepping_alone():
    alone, together = optimizers(SETTINGS), optimizers(SETTINGS)
    for step in range(5):
        for k, (a, b) in enumerate(zip(alone, together)):
            g = torch.Generator().manual_seed(100 * step + k)
            for (p, _), (q, _) in zip(a.slices, b.slices):
                p.grad = torch.randn(p.shape, generator=g) * (k + 1)
                q.grad = p.grad.clone()
        norms = []
        for a in alone:
            a.bind()
            norm = a.local_sq_norm().sqrt()
            norms.append(norm)
            a.step(grad_norm=norm, rebind=False)
        for b in together:
            b.bind()
        assert step_many([(b, n) for b, n in zip(together, norms)]) == {}
        for a, b in zip(alone, together):
            assert a.lr == b.lr  # the schedules moved alike
            for (p, _), (q, _) in zip(a.slices, b.slices):
                assert torch.equal(p, q), "bit for bit"
            sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
            for i in sa:
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(sa[i][key], sb[i][key]), key


def test_a_tenant_whose_step_cannot_be_set_up_is_reported_and_the_others_step():
    opts = optimizers(SETTINGS)
    before = [[p.detach().clone() for p, _ in o.slices] for o in opts]
    for o in opts:
        for p, _ in o.slices:
            p.grad = torch.ones_like(p)
        o.bind()

    def broken(handle):
        raise RuntimeError("no state for you")

    opts[1]._adamw_state = broken
    errors = step_many([(o, torch.tensor(1.0)) for o in opts])
    assert list(errors) == [1] and "no state for you" in errors[1]
    assert all(torch.equal(p, b) for (p, _), b in zip(opts[1].slices, before[1])), "left untouched"
    # (the first tenant is at step 0 of its warmup: lr 0)
    assert all(not torch.equal(p, b) for (p, _), b in zip(opts[2].slices, before[2])), "the others stepped"


def test_a_step_that_would_overflow_is_not_taken_and_the_others_step_exactly():
    """lr=1e38 makes AdamW's step size lr/(1-β1) = 1e39, beyond float32: one such scalar in the shared
    multi-tensor calls raised for every tenant. Now that tenant's step is refused before anything moves,
    with why, and the others step bit for bit as without it."""
    alone, together = optimizers(SETTINGS), optimizers(SETTINGS)
    huge = TenantOptimizer([(t, ()) for t in tenant_tensors(9, [(3, 4), (4, 3)])], lr=1e38)
    steppers = [together[0], huge, *together[1:]]
    before = [p.detach().clone() for p, _ in huge.slices]
    for o in [*alone, *steppers]:
        for k, (p, _) in enumerate(o.slices):
            p.grad = torch.full_like(p, 0.5 + k)
        o.bind()
    for a in alone:
        a.step(grad_norm=torch.tensor(2.0), rebind=False)
    errors = step_many([(o, torch.tensor(2.0)) for o in steppers])
    assert list(errors) == [1] and "non-finite update" in errors[1] and "lr=1e+38" in errors[1], errors
    assert all(torch.equal(p, b) for (p, _), b in zip(huge.slices, before)), "its weights did not move"
    for a, b in zip(alone, together):
        for (p, _), (q, _) in zip(a.slices, b.slices):
            assert torch.equal(p, q), "the others stepped bit for bit"


def test_weights_that_diverge_are_reported():
    """A finite update that leaves a weight non-finite or past MAX_WEIGHT (weight_decay=1e34 multiplies
    the weights by 1 - lr·wd = -1e32) is a diverged tenant; the others are not."""
    opts = optimizers(SETTINGS[2:] * 3)
    opts[1] = TenantOptimizer([(t, ()) for t in tenant_tensors(5, [(2, 3)])], lr=1e-2, weight_decay=1e34)
    for o in opts:
        for p, _ in o.slices:
            p.grad = torch.ones_like(p)
        o.bind()
    errors = step_many([(o, torch.tensor(1.0)) for o in opts])
    assert list(errors) == [1] and "diverged" in errors[1], errors
    from mlora_lab.optim import MAX_WEIGHT

    assert max(p.abs().max().item() for p, _ in opts[1].slices) > MAX_WEIGHT
    assert all(p.abs().max().item() < 10 for o in (opts[0], opts[2]) for p, _ in o.slices)


def test_strided_views_and_whole_tensors_step_together_as_each_alone():
    """Tenants whose matrices are strided views of a shared tensor (``B[t, :, :r]``, which the fused
    kernel mis-updates) step through the multi-tensor path, beside tenants stepped by the fused kernel,
    each bit for bit as alone."""

    def build():
        g = torch.Generator().manual_seed(7)
        shared = torch.randn(3, 6, 4, generator=g).requires_grad_()
        strided = [
            TenantOptimizer([(shared, (t, slice(None), slice(None, 2 + t)))], **SETTINGS[t]) for t in (0, 1)
        ]
        return shared, strided + optimizers(SETTINGS[2:])

    (sa, alone), (sb, together) = build(), build()
    assert not alone[0].params[0].is_contiguous() and alone[2].optimizer.defaults["fused"]
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for shared in (sa, sb):
            shared.grad = torch.randn(shared.shape, generator=torch.Generator().manual_seed(step))
        for a, b in zip(alone[2:], together[2:]):
            for (p, _), (q, _) in zip(a.slices, b.slices):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad = p.grad.clone()
        norms = []
        for a in alone:
            a.bind()
            norms.append(a.local_sq_norm().sqrt())
            a.step(grad_norm=norms[-1], rebind=False)
        for b in together:
            b.bind()
        assert step_many(list(zip(together, norms))) == {}
        assert torch.equal(sa, sb)
        for a, b in zip(alone[2:], together[2:]):
            assert all(torch.equal(p, q) for (p, _), (q, _) in zip(a.slices, b.slices))


def test_the_fused_step_is_within_one_ulp_of_the_multi_tensor_step():
    """The fused kernel (the default for contiguous tensors) against the multi-tensor path it replaced:
    the same AdamW, apart from the last bit of the second moment."""
    from mlora_lab.optim import _foreach_adamw

    fused, plain = optimizers(SETTINGS), optimizers(SETTINGS)
    for step in range(20):
        for k, (a, b) in enumerate(zip(fused, plain)):
            g = torch.Generator().manual_seed(100 * step + k)
            for (p, _), (q, _) in zip(a.slices, b.slices):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad = p.grad.clone()
            a.bind()
        step_many([(a, 1.0) for a in fused])
        with torch.no_grad():
            for b in plain:
                group = b.optimizer.param_groups[0]
                parts = b.parts()
                states = [b._adamw_state(h) for h, _, _ in parts]
                k = float(states[0]["step"]) + 1
                scalars = [(group["lr"], group["weight_decay"], *group["betas"], group["eps"], k)] * len(
                    parts
                )
                if b.max_grad_norm is not None:
                    from mlora_lab.optim import clip_factor

                    torch._foreach_mul_([g for _, _, g in parts], clip_factor(b.max_grad_norm, 1.0))
                _foreach_adamw(
                    [w for _, w, _ in parts],
                    [g for _, _, g in parts],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                    scalars,
                )
                b.optimizer._opt_called = True
                b.scheduler.step()
    for a, b in zip(fused, plain):
        for (p, _), (q, _) in zip(a.slices, b.slices):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_tenant_tiling_one_buffer_steps_as_one_tensor_like_tensor_by_tensor():
    """The model makes a dense tenant's tensors views tiling one buffer; step_many then steps the tenant as
    one tensor (weights, gathered gradient, moments over the same layout, one step count): 20 steps with
    clipping, weight decay and schedules agree with stepping tensor by tensor to 1e-6 (the fused kernel's
    vectorised and scalar parts round the second moment differently in the last bit), and the state dict is
    per tensor as always, each entry a view of the flat moments."""
    flat, plain = flat_optimizers(SETTINGS), optimizers(SETTINGS)
    assert all(o._flat is not None for o in flat) and all(o._flat is None for o in plain)
    for step in range(20):
        give_grads(flat, step)
        give_grads(plain, step)
        step_all(flat)
        step_all(plain)
    for a, b in zip(flat, plain):
        assert a.lr == b.lr
        for (p, _), (q, _) in zip(a.slices, b.slices):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        assert sorted(sa) == sorted(sb)
        for i in sa:
            assert float(sa[i]["step"]) == float(sb[i]["step"]) == 20
            for key in ("exp_avg", "exp_avg_sq"):
                assert sa[i][key].shape == sb[i][key].shape
                torch.testing.assert_close(sa[i][key], sb[i][key], rtol=1e-4, atol=1e-8)
        moments = a._moments
        assert a.flat and moments is not None, "stepped as one tensor"
        for handle in a.params:
            state = a.optimizer.state[handle]
            assert state["step"] is moments.step
            assert (
                state["exp_avg"].untyped_storage().data_ptr() == moments.exp_avg.untyped_storage().data_ptr()
            )


def test_a_flat_tenants_state_round_trips_and_a_cleared_state_starts_again():
    """A state dict saved from a tenant stepped as one tensor and loaded into a fresh one (the loaded
    moments are copied into its own flat buffer at its next step) goes on bit for bit as the original; a
    cleared state (the Tinker driver's reset) starts at step 1 with zero moments."""
    import copy

    original, other = flat_optimizers(SETTINGS[:1]), flat_optimizers(SETTINGS[:1])
    for step in range(3):
        give_grads(original, step)
        step_all(original)
    with torch.no_grad():
        for (p, _), (q, _) in zip(original[0].slices, other[0].slices):
            q.copy_(p)
    other[0].load_state_dict(copy.deepcopy(original[0].state_dict()))
    for step in range(3, 6):
        give_grads(original, step)
        give_grads(other, step)
        step_all(original)
        step_all(other)
        assert all(torch.equal(p, q) for (p, _), (q, _) in zip(original[0].slices, other[0].slices))
    assert other[0].flat and other[0]._moments.step is not original[0]._moments.step
    original[0].optimizer.state.clear()
    give_grads(original, 6)
    step_all(original)
    assert {float(s["step"]) for s in original[0].optimizer.state.values()} == {1.0}


def test_a_tensor_without_gradient_is_left_alone_as_torch_adamw_leaves_it():
    """A tenant stepped as one tensor whose tensor gets no gradient in a step (an expert no token reached)
    is stepped tensor by tensor from then on: that tensor keeps its weights, moments and step count, as
    ``torch.optim.AdamW`` keeps them, and the adapters agree with torch's AdamW to 1e-6."""
    ours = flat_optimizers([dict(lr=1e-2, weight_decay=0.1)])
    theirs = [p.detach().clone().requires_grad_() for p, _ in ours[0].slices]
    torch_adamw = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(5):
        skip = (0, 1) if step == 2 else None
        give_grads(ours, step, skip)
        for t, (p, _) in zip(theirs, ours[0].slices):
            t.grad = None if p.grad is None else p.grad.clone()
        norms = sq_norms(ours).sqrt().tolist()
        assert step_many(list(zip(ours, norms))) == {}
        ours[0].zero_grad()
        torch_adamw.step()
        torch_adamw.zero_grad()
    for t, (p, _) in zip(theirs, ours[0].slices):
        torch.testing.assert_close(p, t, rtol=0, atol=1e-6)
    counts = [float(ours[0].optimizer.state[h]["step"]) for h in ours[0].params]
    assert counts == [float(torch_adamw.state[t]["step"]) for t in theirs] == [5.0, 4.0, 5.0]


def test_tiling_is_only_whole_contiguous_tensors_one_after_another():
    buffer = torch.zeros(20)
    a, b = buffer[:6].view(2, 3), buffer[6:14].view(4, 2)
    assert torch.equal(tiling([a, b]), buffer[:14]) and tiling([a, b]).data_ptr() == buffer.data_ptr()
    assert tiling([b, a]) is None, "out of order"
    assert tiling([a, buffer[7:9]]) is None, "a gap"
    assert tiling([buffer[:12].view(3, 4).T]) is None, "strided"
    assert tiling([torch.zeros(3), torch.zeros(3)]) is None, "two buffers"
    assert tiling([torch.zeros(3, device="meta")]) is None
