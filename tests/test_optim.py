"""Every tenant's AdamW step at once (mlora_lab.optim.step_many) equals each tenant's own step."""

from __future__ import annotations

import torch

from mlora_lab.optim import TenantOptimizer, step_many


def tenant_tensors(seed: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def optimizers(settings) -> list[TenantOptimizer]:
    out = []
    for i, kw in enumerate(settings):
        tensors = tenant_tensors(i, [(3, 5), (7, 3)] if i % 2 else [(2, 4), (4, 2), (6, 2)])
        out.append(TenantOptimizer([(t, ()) for t in tensors], **kw))
    return out


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
