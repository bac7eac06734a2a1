"""Grouped LoRA (mlora_lab.lora.grouped) equals the per-segment reference, layer by layer and step by step.

The grouped path computes a layer's tenant deltas with batched matmuls over rank buckets; the reference
(``per_segment``) with two matmuls per segment forward and four backward, as before. Both are run over a
table of plans (uneven rows, several segments of one tenant, gaps, packed experts, 3-D inputs), with exact
buckets (the CPU's default) and padded ones (the GPU's), then over the architecture table: one whole
training step of three tenants (ranks 4, 8 and 16) gives the same adapters either way.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from test_equivalence import ARCHS, max_diff, three_tenants

from mlora_lab import optim
from mlora_lab.job.trainer import Trainer
from mlora_lab.lora import grouped
from mlora_lab.lora.grouped import rank_padding
from mlora_lab.lora.layer import per_segment, segmented_lora
from mlora_lab.spec.job import JobSpec

IN, OUT, E = 12, 10, 4
TOL = 1e-6  # (relative to the largest value compared, when above 1)


def dense_factors(ranks: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in ranks:
        out += [torch.randn(r, IN, generator=g) * 0.3, torch.randn(OUT, r, generator=g) * 0.3]
    return out


def expert_factors(ranks: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in ranks:
        out += [torch.randn(E, r, IN, generator=g) * 0.3, torch.randn(E, OUT, r, generator=g) * 0.3]
    return out


def dense(slot_rows: list[tuple[int, int, int]], scales: dict[int, float]) -> tuple:
    """A dense layer's plan: ``(slot, start, end)`` segments, slot ``k``'s factors at 2k, 2k + 1."""
    return tuple((2 * k, (), 2 * k + 1, (), s, e, scales[k]) for k, s, e in slot_rows)


PLANS = {
    # every tenant's rows together, as many per tenant: an evenly spaced view in every bucket
    "even": (
        dense([(k, 2 * k, 2 * k + 2) for k in range(5)], {k: 0.5 + k for k in range(5)}),
        [4, 8, 16, 4, 8],
        10,
    ),
    # uneven rows, a tenant twice, rows without a tenant (gaps), first row not at 0
    "uneven": (
        dense([(0, 1, 2), (1, 2, 5), (0, 6, 7), (4, 7, 9)], {0: 1.0, 1: 2.0, 4: 0.3}),
        [4, 16, 8, 8, 32],
        10,
    ),
    "one tenant": (dense([(0, 0, 6)], {0: 2.0}), [8], 6),
}


def expert_plan() -> tuple:
    """(slot, expert) runs over sorted pairs, two tenants of ranks 4 and 8, an expert with no pair."""
    runs = [(0, 0, 0, 3), (1, 0, 3, 4), (0, 2, 4, 8), (1, 3, 9, 10), (0, 3, 10, 12)]
    return tuple((2 * k, (ex,), 2 * k + 1, (ex,), s, e, [1.5, 0.5][k]) for k, ex, s, e in runs)


def run(plan: tuple, factors: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor | None, mode: str):
    """Output and gradients (x, base, factors) of the plan in ``mode``: "reference", "exact" or "padded"."""
    fs = [f.clone().requires_grad_() for f in factors]
    xx = x.clone().requires_grad_()
    yy = None if y is None else y.clone().requires_grad_()
    context = {"reference": per_segment(), "exact": rank_padding(False), "padded": rank_padding(True)}[mode]
    with context:
        out = segmented_lora(xx, torch.zeros(*x.shape[:-1], OUT) if yy is None else yy * 1.0, plan, fs)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out * weights).sum().backward()
        with torch.no_grad():  # sampling's path: the same arithmetic without autograd
            no_grad = segmented_lora(
                x, torch.zeros(*x.shape[:-1], OUT) if y is None else y.clone(), plan, factors
            )
    return [out.detach(), no_grad, xx.grad, None if yy is None else yy.grad, *[f.grad for f in fs]]


def assert_same(a: list, b: list) -> None:
    for i, (p, q) in enumerate(zip(a, b)):
        assert (p is None) == (q is None), i
        if p is not None:
            scale = max(q.abs().max().item(), 1.0)
            assert (p - q).abs().max().item() <= TOL * scale, (i, (p - q).abs().max().item(), scale)


CASES = [(name, tokens) for name in PLANS for tokens in (1, 3)] + [("experts", 1)]  # (experts: [pairs, in])


@pytest.mark.parametrize("mode", ["exact", "padded"])
@pytest.mark.parametrize("name, tokens", CASES)
def test_grouped_equals_the_per_segment_reference(name, tokens, mode):
    """Outputs, the no-grad path, and the gradients of x, the base output and every factor (1e-6)."""
    if name == "experts":
        plan, factors, rows = expert_plan(), expert_factors([4, 8]), 12
    else:
        plan, ranks, rows = PLANS[name]
        factors = dense_factors(ranks)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, *([tokens] if tokens > 1 else []), IN, generator=g)
    y = torch.randn(*x.shape[:-1], OUT, generator=g)
    assert_same(run(plan, factors, x, y, mode), run(plan, factors, x, y, "reference"))


def test_a_tenant_absent_from_a_bucket_gets_no_gradient_and_others_exactly_theirs():
    """Factors no entry uses get ``None``; a tenant whose rows are in the batch but not in the loss gets
    exactly zero (autograd's rule, kept by the grouped path)."""
    factors = [f.requires_grad_() for f in dense_factors([4, 8, 4])]
    plan = dense([(0, 0, 2), (2, 2, 4)], {0: 1.0, 2: 1.0})
    with rank_padding(True):
        out = segmented_lora(torch.randn(4, IN), torch.zeros(4, OUT), plan, factors)
    out[:2].sum().backward()  # tenant 0's rows only
    assert factors[2].grad is None and factors[3].grad is None
    assert factors[4].grad.abs().max() == 0 and factors[5].grad.abs().max() == 0
    assert factors[0].grad.abs().max() > 0 and factors[1].grad.abs().max() > 0


def test_padding_is_exact_padded_ranks_get_zero_gradient():
    """Zero-padded ranks add nothing and get zero gradients: the padded stack's gradient is zero there."""
    ranks, R = [4, 8, 2], 8
    factors = dense_factors(ranks)
    keep = torch.tensor([k * R + j for k, r in enumerate(ranks) for j in range(r)])
    A = grouped._stack(factors[0::2], keep, R, -2)  # [3, 8, in]
    B = grouped._stack(factors[1::2], keep, R, -1)  # [3, out, 8]
    for k, r in enumerate(ranks):
        assert torch.equal(A[k, :r], factors[2 * k]) and not A[k, r:].any()
        assert torch.equal(B[k, :, :r], factors[2 * k + 1]) and not B[k, :, r:].any()
    x, g = torch.randn(3, 5, IN), torch.randn(3, 5, OUT)
    xa = torch.bmm(x, A.transpose(1, 2))
    dB, dA = torch.bmm(g.transpose(1, 2), xa), torch.bmm(torch.bmm(g, B).transpose(1, 2), x)
    for k, r in enumerate(ranks):
        assert not dA[k, r:].any() and not dB[k, :, r:].any()
    back = grouped._unstack(A.reshape(-1, R, IN), factors[0::2], keep, R, -2)
    assert all(torch.equal(a, f) for a, f in zip(back, factors[0::2]))


def test_a_bucket_runs_the_same_kernels_for_any_number_of_tenants():
    """Padded buckets: the ops of a layer's forward and backward do not grow with the tenants (the same
    count for 2 tenants and 16, ranks 4 to 32 mixed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for tenants in (2, 16):
        ranks = [(4, 8, 16, 32)[k % 4] for k in range(tenants)]
        factors = [f.requires_grad_() for f in dense_factors(ranks)]
        plan = dense([(k, 2 * k, 2 * k + 2) for k in range(tenants)], dict.fromkeys(range(tenants), 1.0))
        x = torch.randn(2 * tenants, 3, IN, requires_grad=True)
        with rank_padding(True):
            segmented_lora(
                x, torch.zeros(2 * tenants, 3, OUT), plan, factors
            ).sum().backward()  # (warm cache)
            Count.n = 0
            with Count():
                segmented_lora(x, torch.zeros(2 * tenants, 3, OUT), plan, factors).sum().backward()
        counts.append(Count.n)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("arch", ARCHS)
def test_training_steps_equal_the_per_segment_steps(arch, tiny_models, make_data, monkeypatch):
    """Three tenants (ranks 4, 16, 8; uneven batch sizes; clipping, schedules, weight decay) over every
    architecture, grouped (exact and padded buckets, and the device's default) and per segment: every
    step's gradients agree to 1e-6 (the largest is 0.4), and the adapters after 6 AdamW steps to
    1e-5, the tolerance of ``test_equivalence`` (AdamW divides by the gradient's size: an element whose
    gradient is near zero moves by about ``lr`` whatever its last digits)."""
    tenants = [dataclasses.replace(t, max_steps=6, grad_accum=1) for t in three_tenants(arch, make_data)]
    slots = sorted({m for t in tenants for m in t.target_modules})
    spec = JobSpec(base_model=tiny_models(arch), tenants=tenants, seq_len=64, max_rank=32, slot_modules=slots)
    step_many = optim.step_many
    grads: list[list[torch.Tensor]] = []

    def recording(steps):
        grads.append([g.clone() for opt, _ in steps for _, _, g in opt.parts()])
        return step_many(steps)

    monkeypatch.setattr(optim, "step_many", recording)
    results = {}
    for mode, context in [
        ("reference", per_segment()),
        ("exact", rank_padding(False)),
        ("padded", rank_padding(True)),
        ("device default", contextlib.nullcontext()),
    ]:
        grads.clear()
        with context:
            trainer = Trainer(spec)
            trainer.train()
        assert all(trainer.tenants[t.name].step == 6 for t in tenants)
        results[mode] = ({t.name: trainer.model.tenant_tensors(t.name) for t in tenants}, list(grads))
    adapters, reference_grads = results["reference"]
    for mode in ("exact", "padded", "device default"):
        for step, (ours, theirs) in enumerate(zip(results[mode][1], reference_grads)):
            assert len(ours) == len(theirs)
            diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
            assert diff <= TOL, f"{arch} ({mode}) step {step}: gradients differ by {diff}"
        for t in tenants:
            diff = max_diff(results[mode][0][t.name], adapters[t.name])
            assert diff <= 1e-5, f"{arch}/{t.name} ({mode}): adapters differ by {diff}"
