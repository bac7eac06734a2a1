"""Grouped LoRA: every tenant's delta of one layer in a fixed number of batched matmuls.

A layer's plan (see :mod:`mlora_lab.lora.layer`) lists entries ``e = (A_e, B_e, rows_e, s_e)``: rows
``rows_e`` of the batch get ``s_e (x A_e^T) B_e^T`` with ``A_e`` [r_e, in] and ``B_e`` [out, r_e]. Done
one entry at a time that is two matmuls an entry forward and four backward, so a step's kernel count
grows with the tenants. Here the entries of a rank bucket (rank ``R``) are computed by batched matmuls
(``bmm``) over the bucket's ``G`` entries at once:

    X  = rows of the entries, padded to L tokens      [G, L, in]
    Â  = A_e zero-padded to rank R, stacked           [G, R, in]
    B̂  = B_e zero-padded to rank R, stacked           [G, out, R]
    XA = X Â^T                                        [G, L, R]
    Y  = s · XA B̂^T                                   [G, L, out]   (s: [G, 1, 1])

and backward, with ``Ĝ = s · dL/dY`` (zero on padded tokens):

    dB̂ = Ĝ^T XA     [G, out, R]      dÂ = (Ĝ B̂)^T X     [G, R, in]      dX = (Ĝ B̂) Â     [G, L, in]

Padding is exact in real arithmetic: a padded rank ``j >= r_e`` has ``Â[e, j] = 0`` and ``B̂[e, :, j] = 0``,
so it adds zeros to ``Y`` and ``dX``, and its gradients ``dÂ[e, j] = (Ĝ B̂[e, :, j])^T X = 0`` and
``dB̂[e, :, j] = Ĝ^T XA[:, j] = 0`` are dropped. A padded token has ``Ĝ = 0`` and its ``Y`` is never
written back.

Buckets (:func:`rank_padding`). On a GPU, ranks up to :data:`PAD_UP_TO` share one bucket at the largest of
them, and larger ranks get a bucket per power of two: with the usual ranks a layer launches the same
kernels for 1 tenant as for 64. Padding a rank-4 adapter to 32 costs arithmetic that the memory traffic
hides (these products read ``in`` numbers a token to compute ``R`` of them). On the CPU, which is bound by
arithmetic rather than launches, a bucket is one exact rank: there padding would only add work, and it
would make a tenant's rounding depend on the batch. The longer sums round differently, and a tenant's
adapter after 20 AdamW steps mixed with others then differs from the same tenant trained alone by 2.7e-5,
where exact buckets keep it within 1e-5 (the llama case of ``tests/lora/test_equivalence.py``).

Factors. A layer's tenants' factors are stacked once a step; the tenants' tensors are rows of one buffer
(:class:`mlora_lab.lora.homes.Weights`), so for tenants in consecutive rows, the usual batch, the stack is a
strided view of it and nothing is copied.

Rows. Entries of equal length at evenly spaced rows (the usual batch: every tenant's rows together, as
many per tenant, whatever the bucket) are a strided view of the input: nothing is copied. Otherwise (MoE
runs, uneven batch sizes) one ``index_select`` gathers them and one ``index_add_`` scatters the result
back. A plan's index tensors are made once and cached: every layer of a step, and every step with the
same batch layout, reuses them.

Per row (:func:`per_row`). A decode step replayed as a CUDA graph cannot change its plan between replays,
so there each row picks its adapter from a device tensor of slots: all the layer's adapters padded to one
rank and stacked, ``Â[slot(b)]`` gathered per row, then the same two batched matmuls with ``G`` = rows
(vLLM's and Punica's BGMV layout). It is for sampling only (no backward).

Gradients. A factor that is a leaf tensor (a tenant's own ``A`` or ``B``) gets its gradient written into
``.grad`` here, as Megatron-LM's fused weight-gradient accumulation does, instead of through autograd's
per-tensor ``AccumulateGrad`` node: each tenant's gradient is a view of the bucket's one result, so the
backward does no per-tenant work at all. Hooks on such a leaf's gradient are therefore not called; the
LoRA code registers none. A factor that is not a leaf (a tensor-parallel identity, a DTensor's local part)
gets its gradient through autograd as usual. When the bucket's leaves have gradient homes in consecutive rows
of one arena (:mod:`mlora_lab.lora.homes`: the rows the optimiser steps each tenant's flat gradient from),
the bucket's result goes there by one strided copy instead, and each ``.grad`` is its home. A layer keeps the
homes its buckets found, and its factor stacks that are views of their rows, in its memo
(:meth:`~mlora_lab.lora.layer.MultiLoRALinear._plan`), and uses them at the next step without a look at each
factor, until any rows change (:func:`homes.epoch`).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mlora_lab.lora import homes

PAD_UP_TO = 64
"""With rank padding on, ranks up to this share one bucket, padded to the largest among them."""

_PADDING: list[bool | None] = [None]  # None: on for every device but the CPU
_CACHE: OrderedDict[tuple, Grouping] = OrderedDict()
_SHAPE = operator.attrgetter("shape")
_CACHE_SIZE = 256


@contextlib.contextmanager
def rank_padding(on: bool | None) -> Iterator[None]:
    """Within the block, pad ranks into shared buckets (``True``), keep exact-rank buckets (``False``), or
    follow the device (``None``, the default: padding everywhere but on the CPU). See the module
    docstring."""
    _PADDING.append(on)
    try:
        yield
    finally:
        _PADDING.pop()


def pads(device: torch.device) -> bool:
    """Whether ranks are padded into shared buckets on ``device`` now (:func:`rank_padding`)."""
    on = _PADDING[-1]
    return device.type != "cpu" if on is None else on


@dataclass
class Bucket:
    """One rank bucket of a plan: ``G`` entries computed together at rank ``rank``."""

    entries: tuple[int, ...]  # plan positions, in the order of the batched dimension
    rank: int  # R
    a_ids: tuple[int, ...]  # distinct factor positions of the entries' A, stacked in this order
    b_ids: tuple[int, ...]
    a_pick: torch.Tensor | None  # [G] row of the stacked (and flattened over experts) A of each entry
    b_pick: torch.Tensor | None  # (None: entry g uses row g, and every row is used)
    a_keep: torch.Tensor | None  # rank positions of the stacked A (f * R + j, j < r_f) that are real
    b_keep: torch.Tensor | None  # (None: no factor is padded)
    start: int | None  # evenly spaced entries: the first token, and ``stride`` tokens from one to the next
    stride: int
    length: int  # L, tokens per entry (padded)
    index: torch.Tensor | None  # [G * L] token of each (entry, position) (gathered layout; pads: 0)
    keep: torch.Tensor | None  # [n] positions in [G * L] that are real tokens (None: all are)
    dest: torch.Tensor | None  # [n] their tokens
    scale: torch.Tensor  # [G, 1, 1], or [G, L, 1] with zeros on padded tokens
    uniform: float | None  # the entries' one scale, when they share it (the usual case: one alpha/r)


@dataclass
class Grouping:
    """How a plan's entries map to batched matmuls (see :func:`grouping`)."""

    buckets: list[Bucket]
    ranks: tuple[int, ...]  # per factor: its rank (A: dim -2, B: dim -1)


def grouping(
    plan: tuple, factors: Sequence[torch.Tensor], tokens_per_row: int, device: torch.device
) -> Grouping:
    """The (cached) :class:`Grouping` of ``plan`` (entries ``(ia, a_index, ib, b_index, start, end,
    scale)`` over rows of ``tokens_per_row`` tokens) for ``factors``' shapes, its index tensors on
    ``device``."""
    shapes = tuple(map(_SHAPE, factors))  # (torch.Size: a tuple already)
    padded = pads(device)
    key = (plan, shapes, tokens_per_row, str(device), padded)
    found = _CACHE.get(key)
    if found is not None:
        _CACHE.move_to_end(key)
        return found
    with torch.inference_mode(False), torch.no_grad():  # usable by autograd later, whoever made it
        made = _make_grouping(plan, shapes, tokens_per_row, device, padded)
    _CACHE[key] = made
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return made


def _make_grouping(
    plan: tuple, shapes: tuple[tuple[int, ...], ...], tpr: int, device: torch.device, padded: bool
) -> Grouping:
    # a factor's rank: A [*lead, r, in] is named by an entry's ``ia``, B [*lead, out, r] by its ``ib``
    ranks = [0] * len(shapes)
    for ia, _, ib, *_ in plan:
        ranks[ia], ranks[ib] = shapes[ia][-2], shapes[ib][-1]
    small = max((ranks[ia] for ia, *_ in plan if ranks[ia] <= PAD_UP_TO), default=0)

    def bucket_rank(r: int) -> int:
        if not padded:
            return r
        return small if r <= PAD_UP_TO else 1 << math.ceil(math.log2(r))

    leads = tuple(math.prod(s[:-2]) for s in shapes)
    by_rank: dict[int, list[int]] = {}
    for i, (ia, *_rest) in enumerate(plan):
        by_rank.setdefault(bucket_rank(ranks[ia]), []).append(i)
    buckets = []
    for rank, entries in sorted(by_rank.items()):
        entries.sort(key=lambda i: plan[i][4])  # by first row: evenly spaced layouts become views
        buckets.append(_make_bucket(plan, entries, rank, ranks, leads, tpr, device))
    return Grouping(buckets, tuple(ranks))


def _picks(
    plan: tuple, entries: list[int], which: int, leads: tuple[int, ...]
) -> tuple[tuple[int, ...], list[int] | None]:
    """The distinct factor positions (``which`` = 0 for A, 2 for B) of ``entries`` in first-use order,
    and each entry's row in their stack flattened over the leading (expert) index; ``None`` when entry
    ``g`` uses row ``g`` and every row is used (no ``index_select`` needed)."""
    ids: dict[int, int] = {}
    for i in entries:
        ids.setdefault(plan[i][which], len(ids))
    rows = [
        ids[plan[i][which]] * leads[plan[i][which]] + (plan[i][which + 1][0] if plan[i][which + 1] else 0)
        for i in entries
    ]
    used = sum(leads[f] for f in ids)
    return tuple(ids), None if rows == list(range(used)) else rows


def _make_bucket(
    plan: tuple,
    entries: list[int],
    R: int,
    ranks: list[int],
    leads: tuple[int, ...],
    tpr: int,
    device: torch.device,
) -> Bucket:
    G = len(entries)
    spans = [(plan[i][4] * tpr, plan[i][5] * tpr) for i in entries]
    L = max(e - s for s, e in spans)
    a_ids, a_rows = _picks(plan, entries, 0, leads)
    b_ids, b_rows = _picks(plan, entries, 2, leads)

    def on_device(values: list[int] | None) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=torch.long).to(device)

    def real_ranks(ids: tuple[int, ...]) -> list[int] | None:
        if all(ranks[f] == R for f in ids):
            return None
        return [k * R + j for k, f in enumerate(ids) for j in range(ranks[f])]

    common = dict(
        entries=tuple(entries), rank=R, a_ids=a_ids, b_ids=b_ids,
        a_pick=on_device(a_rows), b_pick=on_device(b_rows),
        a_keep=on_device(real_ranks(a_ids)), b_keep=on_device(real_ranks(b_ids)),
    )  # fmt: skip
    scales = [float(plan[i][6]) for i in entries]
    scale = torch.tensor(scales, dtype=torch.float32).view(G, 1, 1)
    common["uniform"] = scales[0] if len(set(scales)) == 1 else None
    stride = spans[1][0] - spans[0][0] if G > 1 else L
    if (
        all(e - s == L for s, e in spans)
        and stride >= L
        and all(spans[g][0] == spans[0][0] + g * stride for g in range(G))
    ):
        return Bucket(
            **common, start=spans[0][0], stride=stride, length=L, index=None, keep=None, dest=None,
            scale=scale.to(device),
        )  # fmt: skip
    starts = torch.tensor([s for s, _ in spans], dtype=torch.long)
    lengths = torch.tensor([e - s for s, e in spans], dtype=torch.long)
    pos = torch.arange(L, dtype=torch.long)
    real = pos[None, :] < lengths[:, None]  # [G, L]
    index = torch.where(real, starts[:, None] + pos[None, :], 0).reshape(-1)
    keep = real.reshape(-1).nonzero().squeeze(1)
    return Bucket(
        **common, start=None, stride=0, length=L, index=index.to(device),
        keep=None if len(keep) == G * L else keep.to(device), dest=index[keep].to(device),
        scale=(scale * real[:, :, None]).to(device),
    )  # fmt: skip


# -- stacking the factors ----------------------------------------------------------------------------


def _stack(tensors: list[torch.Tensor], keep: torch.Tensor | None, R: int, dim: int) -> torch.Tensor:
    """``tensors`` (A [*lead, r, in] with ``dim=-2``, B [*lead, out, r] with ``dim=-1``) zero-padded to
    rank ``R`` and stacked, flattened over the leading (expert) index: [F * prod(lead), R, in] or
    [F * prod(lead), out, R]. Padding is one ``cat`` and one ``index_copy_`` for all of them; without
    padding, factors in consecutive rows of one weights arena are a view of it (:func:`homes.stacked`)."""
    if keep is None:
        # rows of one arena (mlora_lab.lora.homes.Weights, the usual batch) are a view of it: no copy
        stacked = homes.stacked(tensors) if len(tensors) > 1 else tensors[0].unsqueeze(0)
        if stacked is None:
            stacked = torch.stack(tensors)
        return stacked.reshape(-1, *stacked.shape[-2:])
    F = len(tensors)
    cat = torch.cat(tensors, dim=dim)  # [*lead, sum r, in] or [*lead, out, sum r]
    shape = list(cat.shape)
    shape[dim] = F * R
    wide = cat.new_zeros(shape).index_copy_(dim, keep, cat)  # [*lead, F*R, in] or [*lead, out, F*R]
    if dim == -2:  # -> [F, *lead, R, in]
        split = wide.unflatten(-2, (F, R)).movedim(-3, 0)
    else:  # -> [F, *lead, out, R]
        split = wide.unflatten(-1, (F, R)).movedim(-2, 0)
    return split.reshape(-1, *split.shape[-2:])


def _unstack(
    d: torch.Tensor, like: list[torch.Tensor], keep: torch.Tensor | None, R: int, dim: int
) -> Sequence[torch.Tensor]:
    """Inverse of :func:`_stack` for gradients: each factor's part ([*lead, r_f, in] or [*lead, out,
    r_f]), its padding dropped; views of one tensor."""
    F, lead = len(like), like[0].shape[:-2]
    if keep is None:
        return d.view(F, *like[0].shape).unbind(0) if F > 1 else (d.view(like[0].shape),)
    d = d.view(F, *lead, *d.shape[-2:])
    wide = d.movedim(0, -3).flatten(-3, -2) if dim == -2 else d.movedim(0, -2).flatten(-2, -1)
    real = wide.index_select(dim, keep)  # [*lead, sum r, in] or [*lead, out, sum r]
    return real.split([t.shape[dim] for t in like], dim=dim)


def factor_stacks(g: Grouping, bucket: Bucket, factors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The bucket's entries' ``Â`` [G, R, in] and ``B̂`` [G, out, R]."""
    A = _stack([factors[i] for i in bucket.a_ids], bucket.a_keep, bucket.rank, -2)
    B = _stack([factors[i] for i in bucket.b_ids], bucket.b_keep, bucket.rank, -1)
    if bucket.a_pick is not None:
        A = A.index_select(0, bucket.a_pick)
    if bucket.b_pick is not None:
        B = B.index_select(0, bucket.b_pick)
    return A, B


def _kept_stacks(
    g: Grouping, bucket: Bucket, factors: Sequence[torch.Tensor], memo: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`factor_stacks`, kept in ``memo`` when both are views of the factors' own storage (rows of one
    weights buffer: :func:`homes.stacked`), which see every in-place update of the factors, until any
    buffer's rows move (:func:`homes.epoch`). A stack that is a copy (padded ranks, picked rows, tenants out
    of row order) is made again at each call."""
    key = ("stacks", bucket.a_ids, bucket.b_ids)
    kept = memo.get(key)
    if kept is not None and kept[0] == homes.epoch():
        return kept[1], kept[2]
    A, B = factor_stacks(g, bucket, factors)
    try:
        views = all(
            s.untyped_storage().data_ptr() == factors[ids[0]].untyped_storage().data_ptr()
            for s, ids in ((A, bucket.a_ids), (B, bucket.b_ids))
        )
    except (RuntimeError, NotImplementedError):  # (no storage: a DTensor, a fake)
        views = False
    if views:
        memo[key] = (homes.epoch(), A, B)
    return A, B


def _rows(t: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The bucket's tokens of ``t`` ([tokens, d], contiguous) as [G, L, d] (a view when evenly spaced)."""
    G, L, d = len(bucket.entries), bucket.length, t.shape[-1]
    if bucket.index is None:
        return t.as_strided((G, L, d), (bucket.stride * d, d, 1), t.storage_offset() + bucket.start * d)
    return t.index_select(0, bucket.index).view(G, L, d)


def _write(out: torch.Tensor, bucket: Bucket, values: torch.Tensor, alpha: float = 1.0) -> None:
    """``out`` ([tokens, d], contiguous) at the bucket's real tokens += ``alpha · values`` [G, L, d]."""
    if bucket.index is None:
        _rows(out, bucket).add_(values, alpha=alpha)
        return
    flat = values.reshape(-1, out.shape[-1])
    if bucket.keep is not None:
        flat = flat.index_select(0, bucket.keep)
    out.index_add_(0, bucket.dest, flat, alpha=alpha)


def _whole(bucket: Bucket, tokens: int) -> bool:
    """Whether the bucket's rows are all ``tokens`` rows, in order (a plain reshape of them)."""
    G, L = len(bucket.entries), bucket.length
    return bucket.index is None and bucket.start == 0 and bucket.stride == L and tokens == G * L


# -- forward and backward ------------------------------------------------------------------------------


def forward(
    x: torch.Tensor,
    base: torch.Tensor | None,
    plan: tuple,
    factors: Sequence[torch.Tensor],
    memo: dict | None = None,
) -> tuple[torch.Tensor, Grouping, list[torch.Tensor]]:
    """``base`` (or zeros) plus every entry's delta, in place; the grouping, and each bucket's ``Â``,
    ``B̂`` and ``XA`` [G, L, R] in turn (what the backward needs). ``x``: [rows, ..., in]. ``memo``: a dict
    the caller keeps for these factors and this plan, where stacks that are views of the factors' rows are
    kept for the next step (:func:`_kept_stacks`)."""
    in_features = x.shape[-1]
    tpr = x[0].numel() // in_features if x.shape[0] else 1
    g = grouping(plan, factors, tpr, x.device)
    out_features = factors[plan[0][2]].shape[-2]
    out = base if base is not None else x.new_zeros(*x.shape[:-1], out_features)
    x2, out2 = x.reshape(-1, in_features).contiguous(), out.view(-1, out_features)
    saved = []
    for bucket in g.buckets:
        A, B = factor_stacks(g, bucket, factors) if memo is None else _kept_stacks(g, bucket, factors, memo)
        xa = torch.bmm(_rows(x2, bucket), A.transpose(1, 2))  # [G, L, R]
        if bucket.index is None:  # accumulated into the output by the product itself: out += s · XA B̂^T
            rows = _rows(out2, bucket)
            if (
                bucket.uniform is not None
            ):  # (the scale inside the product, as addmm's alpha: PEFT's rounding)
                rows.baddbmm_(xa, B.transpose(1, 2), alpha=bucket.uniform)
            else:
                rows.baddbmm_(xa * bucket.scale, B.transpose(1, 2))
        elif bucket.uniform is not None:
            _write(out2, bucket, torch.bmm(xa, B.transpose(1, 2)), alpha=bucket.uniform)
        else:
            _write(out2, bucket, torch.bmm(xa, B.transpose(1, 2)).mul_(bucket.scale))
        saved += [A, B, xa]
    return out, g, saved


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    factors: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor | None],
    g: Grouping,
    saved: Sequence[torch.Tensor],
    need_x: bool,
    need: Sequence[bool],
    memo: dict | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The gradients of :func:`forward` (module docstring): ``dL/dx`` (when ``need_x``), and each
    factor's (when ``need[i]``) either returned or, for a leaf (``leaves[i]``: the tensor itself, not
    ``None``), accumulated into its ``.grad`` (``None`` returned). ``memo``: a dict the caller keeps for
    these factors and this plan, where the gradient homes found for a bucket are kept for the next step
    (:func:`_give`)."""
    in_features, out_features = x.shape[-1], grad_out.shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()
    g2 = grad_out.reshape(-1, out_features).contiguous()
    # one bucket over every row in order (the usual batch): its dX is dL/dx as it is, nothing to zero or copy
    direct = need_x and len(g.buckets) == 1 and _whole(g.buckets[0], x2.shape[0])
    grad_x = torch.zeros_like(x2) if need_x and not direct else None
    grads: list[torch.Tensor | None] = [None] * len(factors)
    for k, bucket in enumerate(g.buckets):
        A, B, xa = saved[3 * k : 3 * k + 3]
        # [G, L, out]; zero on padded tokens (a gathered bucket's scale tensor has zeros there)
        plain = bucket.index is None and bucket.uniform is not None
        gs = _rows(g2, bucket) * (bucket.uniform if plain else bucket.scale)
        g_xa = torch.bmm(gs, B)  # [G, L, R]
        if any(need[i] for i in bucket.b_ids):
            dB = torch.bmm(gs.transpose(1, 2), xa)  # [G, out, R]
            _give(
                grads, factors, leaves, bucket.b_ids, bucket.b_pick, bucket.b_keep, bucket.rank, dB, -1, need,
                memo, ("B", bucket.b_ids),
            )  # fmt: skip
        if any(need[i] for i in bucket.a_ids):
            dA = torch.bmm(g_xa.transpose(1, 2), _rows(x2, bucket))  # [G, R, in]
            _give(
                grads, factors, leaves, bucket.a_ids, bucket.a_pick, bucket.a_keep, bucket.rank, dA, -2, need,
                memo, ("A", bucket.a_ids),
            )  # fmt: skip
        if direct:
            grad_x = torch.bmm(g_xa, A)
        elif need_x:
            _write(grad_x, bucket, torch.bmm(g_xa, A))
    return None if grad_x is None else grad_x.view(x.shape), grads


def _give(
    grads: list,
    factors: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor | None],
    ids: tuple[int, ...],
    pick: torch.Tensor | None,
    keep: torch.Tensor | None,
    R: int,
    d: torch.Tensor,
    dim: int,
    need: Sequence[bool],
    memo: dict | None = None,
    key: tuple = (),
) -> None:
    """Per-entry gradients ``d`` [G, ...] summed into the distinct factors ``ids`` (rows ``pick``), without
    their padding: a leaf's into its ``.grad``, any other's into ``grads``. When every entry's factor is a
    leaf with a gradient home (:mod:`mlora_lab.lora.homes`), ``d`` goes there by one copy instead; the homes
    found are kept in ``memo[key]`` until the arenas change (:func:`mlora_lab.lora.homes.epoch`), so that a
    step with the same factors finds them without a look at each."""
    if pick is None and keep is None:
        kept = memo.get(key) if memo is not None else None
        if kept is not None and kept[0] == homes.epoch():
            _, bucket_leaves, found = kept
            if homes.empty(bucket_leaves):  # (else: accumulation, below)
                homes.put(d, bucket_leaves, found)
                return
        elif all(need[i] for i in ids):
            bucket_leaves = [leaves[i] for i in ids]
            found = homes.spot(bucket_leaves)
            if found is not None:  # (one copy into the tenants' rows of their gradient arena)
                if memo is not None:
                    memo[key] = (homes.epoch(), bucket_leaves, found)
                homes.put(d, bucket_leaves, found)
                return
    like = [factors[i] for i in ids]
    if pick is not None:
        d = d.new_zeros(len(ids) * math.prod(like[0].shape[:-2]), *d.shape[1:]).index_add_(0, pick, d)
    held, more = [], []  # leaves that have a gradient already (accumulation), and what to add to them
    for i, part in zip(ids, _unstack(d, like, keep, R, dim)):
        f = leaves[i]
        if not need[i]:
            continue
        if f is None:
            grads[i] = part
        elif f.grad is None:
            f.grad = part
        else:
            held.append(f.grad)
            more.append(part)
    if held:
        torch._foreach_add_(held, more)


# -- per row (decode steps) ---------------------------------------------------------------------------------

_LOOKUP: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def per_row(
    x: torch.Tensor,
    y: torch.Tensor,
    row_slots: torch.Tensor,
    slots: Sequence[int],
    factors: Sequence[torch.Tensor],
    scales: Sequence[float],
    max_tenants: int,
) -> torch.Tensor:
    """``y`` [B, ..., out] plus row ``b``'s delta ``s (x_b Â^T) B̂^T`` with the adapter of slot
    ``row_slots[b]`` (a device tensor; ``max_tenants``: none), for slots among ``slots`` (whose A, B are
    ``factors[2k]``, ``factors[2k + 1]``): every op's shape is fixed by ``slots`` and ``y``, so a CUDA graph
    of it holds for any ``row_slots``. No autograd (sampling)."""
    if torch.is_grad_enabled() and (x.requires_grad or any(f.requires_grad for f in factors)):
        raise RuntimeError("per-row LoRA routing is for sampling: run it under torch.no_grad()")
    A_list, B_list = list(factors[0::2]), list(factors[1::2])
    ranks = [a.shape[-2] for a in A_list]
    R = max(ranks)
    keep = _lookup(("keep", tuple(ranks), str(x.device)), lambda: _real_ranks(ranks, R), x.device)
    keep = None if all(r == R for r in ranks) else keep
    zero_A = A_list[0].new_zeros(1, R, A_list[0].shape[-1])
    zero_B = B_list[0].new_zeros(1, B_list[0].shape[-2], R)
    A = torch.cat([_stack(A_list, keep, R, -2), zero_A])  # [F + 1, R, in]: the last, for rows without one
    B = torch.cat([_stack(B_list, keep, R, -1), zero_B])  # [F + 1, out, R]
    index = _lookup(
        ("slots", tuple(slots), max_tenants, str(x.device)), lambda: _slot_index(slots, max_tenants), x.device
    )
    scale = _lookup(("scales", tuple(scales), str(x.device)), lambda: torch.tensor([*scales, 0.0]), x.device)
    which = index[row_slots]  # [B]: each row's position in the stacks
    rows = x.to(A.dtype).reshape(x.shape[0], -1, x.shape[-1])  # [B, T, in]
    xa = torch.bmm(rows, A[which].transpose(1, 2))  # [B, T, R]
    delta = torch.bmm(xa, B[which].transpose(1, 2)).mul_(scale[which].view(-1, 1, 1))  # [B, T, out]
    if y.dtype == delta.dtype:
        return y.add_(delta.view(y.shape))
    return (y + delta.view(y.shape)).to(y.dtype)


def _real_ranks(ranks: list[int], R: int) -> torch.Tensor:
    return torch.tensor([k * R + j for k, r in enumerate(ranks) for j in range(r)], dtype=torch.long)


def _slot_index(slots: Sequence[int], max_tenants: int) -> torch.Tensor:
    """``[max_tenants + 1]``: slot -> its position among ``slots``, ``len(slots)`` (the zero adapter) else."""
    index = torch.full((max_tenants + 1,), len(slots), dtype=torch.long)
    index[list(slots)] = torch.arange(len(slots))
    return index


def _lookup(key: tuple, make, device: torch.device) -> torch.Tensor:
    """A small constant tensor on ``device``, made once (a graph's replays read the same one)."""
    found = _LOOKUP.get(key)
    if found is None:
        with torch.inference_mode(False), torch.no_grad():
            found = make().to(device)
        _LOOKUP[key] = found
        if len(_LOOKUP) > _CACHE_SIZE:
            _LOOKUP.popitem(last=False)
    return found
