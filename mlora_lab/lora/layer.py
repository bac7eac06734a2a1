"""Multi-tenant LoRA on a frozen ``nn.Linear``: one base matmul per batch, one LoRA delta per row's tenant.

Maths. The base layer computes ``y = x W^T (+ b)`` with ``W`` of shape ``[out, in]``. A tenant ``t`` with
rank ``r_t``, scaling ``s_t`` (``alpha / r`` or ``alpha / sqrt(r)`` with rsLoRA) and dropout ``p_t`` owns
two tensors of its own rank, held by the layer under the tenant's slot number ``t``:

    A_t = lora_A[t] : [r_t, in]          B_t = lora_B[t] : [out, r_t]

They exist only while the tenant does (a free slot holds nothing), so memory grows with the tenants
and their ranks, never with ``max_tenants`` or ``max_rank``. A row ``b`` of tenant ``t`` gets

    y_b = x_b W^T (+ b) + s_t * dropout_{p_t}(x_b) A_t^T B_t^T                    x_b : [T, in]

exactly PEFT's ``lora_B(lora_A(dropout(x))) * scaling``. Rows of one tenant sit in contiguous runs
(segments) of the batch, so the delta is one pair of small matmuls per segment: no per-row gather.

Gradients (``g`` = dL/dy for the segment's rows, ``xa = x A_t^T`` saved from the forward):

    dL/dB_t = s_t g^T xa        [out, r_t]
    dL/dA_t = (s_t g B_t)^T x   [r_t, in]
    dL/dx  += (s_t g B_t) A_t

A tenant whose rows are absent from the batch is not part of the computation and gets no gradient
(``None``: no memory), and no tenant's loss can reach another tenant's tensors.

The layer knows nothing about tenants' names, optimisers or sharding: routing comes from a shared
:class:`LoRARouting` that the model wrapper fills before each forward; the tensors are made by the
wrapper's :class:`~mlora_lab.lora.model.TensorIO` following ``layouts`` (set by a parallel layout,
opaque here).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlora_lab.lora import grouped


@dataclass
class LoRARouting:
    """Which batch rows belong to which slot, shared by every multi-tenant layer of one model.

    ``segments`` holds ``(slot, start_row, end_row)`` runs covering the rows that get an adapter;
    rows outside every segment get the base output only. ``None`` means "no adapters" (plain base).

    ``row_slots`` (a device tensor [rows], ``max_tenants`` for a row without an adapter), when set, routes
    by row instead (:func:`~mlora_lab.lora.grouped.per_row`: a decode step captured as a CUDA graph, whose
    rows' tenants live in that tensor and may change between replays without a new capture); ``slots``
    then names the slots it may hold (fixed for the graph).
    """

    segments: list[tuple[int, int, int]] | None = None
    num_rows: int = 0
    row_slots: torch.Tensor | None = None
    slots: tuple[int, ...] = ()


_GROUPED = [True]


@contextlib.contextmanager
def per_segment() -> Iterator[None]:
    """Within the block, deltas are computed one plan entry at a time (two matmuls an entry forward, four
    backward), not grouped (:mod:`mlora_lab.lora.grouped`): the reference the grouped path is tested
    against."""
    _GROUPED.append(False)
    try:
        yield
    finally:
        _GROUPED.pop()


class _Leaves:
    """A layer's factors handed to :class:`_GroupedLeaves` as one opaque argument (autograd sees no
    tensor in it), and the layer's memo for this routing (:meth:`MultiLoRALinear._plan`), where the
    grouped forward and backward keep what they found for the same factors at the last step (stacks that are
    views of their rows, their gradient homes)."""

    __slots__ = ("factors", "memo")

    def __init__(self, factors: Sequence[torch.Tensor], memo: dict | None) -> None:
        self.factors, self.memo = factors, memo


_ANCHORS: dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """An empty leaf that requires grad: the one tensor input that puts :class:`_GroupedLeaves` in the
    graph (its gradient is never made)."""
    found = _ANCHORS.get(device)
    if found is None:
        with torch.inference_mode(False):
            found = _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return found


class _GroupedLeaves(torch.autograd.Function):
    """:class:`_SegmentedLoRA`, grouped, when every factor is a leaf that requires grad (the usual
    case: each tenant's own tensors): the factors travel out of band, in a :class:`_Leaves`, and the
    backward writes their gradients into their ``.grad`` (:func:`grouped.backward`). Autograd then has
    no per-factor work at all (with 64 tenants a layer has 128 factors: their input checks, saved
    tensors and ``AccumulateGrad`` nodes were ~10 ms of a step on the CPU, and grew with the tenants);
    the ``anchor`` (:func:`_anchor`) keeps the node in the graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: torch.Tensor | None, plan: tuple, held: _Leaves, anchor):
        if base is not None:
            ctx.mark_dirty(base)
        out, ctx.grouping, xas = grouped.forward(x, base, plan, held.factors, held.memo)
        ctx.factors, ctx.memo = held.factors, held.memo
        ctx.save_for_backward(x, *xas)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *xas = ctx.saved_tensors
        need_x, need_base = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        factors = ctx.factors
        grad_x, _ = grouped.backward(
            grad_out, x, factors, factors, ctx.grouping, xas, need_x, [True] * len(factors), ctx.memo
        )
        return grad_x, grad_out if need_base else None, None, None, None


class _SegmentedLoRA(torch.autograd.Function):
    """``y[s:e] = base[s:e] + scale * (x[s:e] A^T) B^T`` for each plan entry
    ``(ia, a_index, ib, b_index, s, e, scale)``, with ``A = factors[ia][a_index]`` ([r, in]) and
    ``B = factors[ib][b_index]`` ([out, r]); see the module docstring. Dense layers pass a tenant's own
    tensors (index ``()``); packed experts a tenant's per-expert tensors (index ``(expert,)``). ``x`` is
    ``[rows, ..., in]``; ``base`` ([rows, ..., out], the base layer's output, or ``None`` for the delta
    alone) is updated in place, so no ``[rows, out]`` delta is ever materialised; the gradient of a
    factor used by several entries is their sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: torch.Tensor | None, plan: tuple, *factors: torch.Tensor):
        if base is not None:
            ctx.mark_dirty(base)
        ctx.grouping = None
        if _GROUPED[-1]:
            out, ctx.grouping, xas = grouped.forward(x, base, plan, factors)
            # the leaves themselves: a saved tensor may come back as another object (a checkpointed
            # block's recomputation), and the grouped backward writes a leaf's gradient into its .grad
            ctx.leaves = [f if f.is_leaf and f.requires_grad else None for f in factors]
        else:
            out, xas = _add_deltas(x, base, plan, factors)
        ctx.plan, ctx.n_factors = plan, len(factors)
        ctx.save_for_backward(x, *factors, *xas)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *rest = ctx.saved_tensors
        factors, xas = rest[: ctx.n_factors], rest[ctx.n_factors :]
        need_x, need_base = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need = ctx.needs_input_grad[3:]
        if ctx.grouping is not None:  # (``xas``: each bucket's stacked factors and x A^T)
            grad_x, grads = grouped.backward(
                grad_out, x, factors, ctx.leaves, ctx.grouping, xas, need_x, need
            )
            return grad_x, grad_out if need_base else None, None, *grads
        in_features = x.shape[-1]
        grad_x = None
        if need_x:
            grad_x = torch.empty_like(x)
            _zero_gaps(grad_x, ctx.plan)
        grads: list[torch.Tensor | None] = [None] * len(factors)
        for (ia, a_index, ib, b_index, start, end, scale), xa in zip(ctx.plan, xas):
            A, B = factors[ia][a_index], factors[ib][b_index]
            # the order of autograd through ``(x A^T B^T) * s``: the same rounding as PEFT's layers
            g = grad_out[start:end].reshape(-1, B.shape[-2]) * scale  # [n, out]
            xa2 = xa.reshape(-1, xa.shape[-1])  # [n, r]
            g_xa = g @ B  # [n, r]
            if need[ib]:
                if grads[ib] is None:
                    grads[ib] = torch.zeros_like(factors[ib])
                grads[ib][b_index].addmm_(g.T, xa2)
            if need[ia]:
                if grads[ia] is None:
                    grads[ia] = torch.zeros_like(factors[ia])
                grads[ia][a_index].addmm_(g_xa.T, x[start:end].reshape(-1, in_features))
            if need_x:
                torch.mm(g_xa, A, out=grad_x[start:end].view(-1, in_features))
        return grad_x, grad_out if need_base else None, None, *grads


def _add_deltas(
    x: torch.Tensor, base: torch.Tensor | None, plan: tuple, factors: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The forward of :class:`_SegmentedLoRA`: ``base`` (or zeros) plus each plan entry's delta, in place,
    and each entry's ``x A^T`` [n, ..., r] (what the backward needs)."""
    _, _, ib, b_index, *_ = plan[0]
    out_features = factors[ib][b_index].shape[-2]
    if base is None:  # plan entries cover disjoint rows (most of them): zero only the gaps
        out = x.new_empty(*x.shape[:-1], out_features)
        _zero_gaps(out, plan)
    else:
        out = base
    xas = []
    for ia, a_index, ib, b_index, start, end, scale in plan:
        xa = F.linear(x[start:end], factors[ia][a_index])  # [n, ..., r]
        rows = out[start:end].view(-1, out_features)  # rows of a contiguous tensor: a view
        xa2 = xa.reshape(-1, xa.shape[-1])
        B = factors[ib][b_index]
        if base is None:
            torch.mm(xa2, B.T, out=rows).mul_(scale)
        else:
            rows.addmm_(xa2, B.T, alpha=scale)
        xas.append(xa)
    return out, xas


def _zero_gaps(t: torch.Tensor, plan: tuple) -> None:
    """Zero the rows of ``t`` outside every plan entry's ``[start, end)`` (entries are disjoint)."""
    row = 0
    for *_, start, end, _ in sorted(plan, key=lambda p: p[4]):
        if start > row:
            t[row:start].zero_()
        row = max(row, end)
    if row < t.shape[0]:
        t[row:].zero_()


def segmented_lora(
    x: torch.Tensor, y: torch.Tensor, plan: tuple, factors: list[torch.Tensor], memo: dict | None = None
) -> torch.Tensor:
    """``y`` plus the plan's deltas (:class:`_SegmentedLoRA`), in place when it can be: the same dtype
    and not a view (autograd cannot rebase a view). A low-precision base (bf16) with fp32 adapters
    adds in fp32 and rounds once, in PEFT's order. ``memo``: a dict kept by the caller for as long as these
    factors and this plan go together (:meth:`MultiLoRALinear._plan`), for the grouped backward."""
    x = x.to(factors[0].dtype)
    in_place = y.dtype == factors[0].dtype and not y._is_view()
    if not torch.is_grad_enabled():  # sampling, evaluation: the same arithmetic, without autograd's node
        add = grouped.forward if _GROUPED[-1] else _add_deltas
        if in_place:
            return add(x, y, plan, factors)[0]
        return (y + add(x, None, plan, factors)[0]).to(y.dtype)
    # (map over C getters: this runs for every layer and step, over 2 factors a tenant)
    if _GROUPED[-1] and all(map(_REQUIRES_GRAD, factors)) and all(map(_IS_LEAF, factors)):
        held, anchor = _Leaves(factors, memo), _anchor(x.device)
        if in_place:
            return _GroupedLeaves.apply(x, y, plan, held, anchor)
        return (y + _GroupedLeaves.apply(x, None, plan, held, anchor)).to(y.dtype)
    if in_place:
        return _SegmentedLoRA.apply(x, y, plan, *factors)
    return (y + _SegmentedLoRA.apply(x, None, plan, *factors)).to(y.dtype)


_REQUIRES_GRAD, _IS_LEAF = operator.attrgetter("requires_grad"), operator.attrgetter("is_leaf")


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus up to ``max_tenants`` tenants' LoRA of rank up to ``max_rank`` (see
    module docstring).

    Per-slot settings live in plain Python lists (``ranks``, ``scalings``, ``dropouts``) so the forward
    never reads a device tensor to decide what to compute: no hidden device syncs in the hot loop.
    ``ranks[t] == 0`` means slot ``t`` does not target this layer (and holds no tensors here).
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        routing: LoRARouting,
        max_tenants: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.max_tenants, self.max_rank, self.dtype = max_tenants, max_rank, dtype
        # slot -> this process's part of the tenant's A [r, in] / B [out, r] (leaf tensors)
        self.lora_A: dict[int, torch.Tensor] = {}
        self.lora_B: dict[int, torch.Tensor] = {}
        # how a parallel layout splits A and B over processes (None: whole, on this process)
        self.layouts: dict[str, object] = {"A": None, "B": None}
        self.ranks = [0] * max_tenants
        self.scalings = [0.0] * max_tenants
        self.dropouts = [0.0] * max_tenants
        # routing segments -> (segments with a tenant here, their slots, plan, memo): see _plan
        self._plans: dict[tuple, tuple[list, list[int], tuple, dict]] = {}
        # A plain attribute, not a submodule: the routing is shared by every layer of the model.
        object.__setattr__(self, "routing", routing)

    @property
    def device(self) -> torch.device:
        return self.base_layer.weight.device

    # -- slots (their tensors are made by the model wrapper) -----------------------------------
    def set_slot(
        self, slot: int, A: torch.Tensor, B: torch.Tensor, rank: int, scaling: float, dropout: float
    ) -> None:
        """Slot ``slot`` now holds a rank-``rank`` LoRA (``A``, ``B``: this process's parts)."""
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..max_rank={self.max_rank}")
        self.lora_A[slot], self.lora_B[slot] = A, B
        self.ranks[slot], self.scalings[slot], self.dropouts[slot] = rank, float(scaling), float(dropout)
        self._plans.clear()

    def clear_slot(self, slot: int) -> None:
        """Slot ``slot`` no longer targets this layer; its tensors are released."""
        self.lora_A.pop(slot, None)
        self.lora_B.pop(slot, None)
        self.ranks[slot], self.scalings[slot], self.dropouts[slot] = 0, 0.0, 0.0
        self._plans.clear()

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_delta(x, self.base_layer(x))

    def slot_tensors(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors the delta of ``slot`` multiplies by: ``(A, B)`` (a parallel layout may give
        the part this process holds)."""
        return self.lora_A[slot], self.lora_B[slot]

    def factors(self, slots: list[int]) -> list[torch.Tensor]:
        """``[A, B]`` of each of ``slots`` in turn, as :meth:`slot_tensors` gives them (a parallel
        layout may treat them together, e.g. one collective for all of a layer's tenants)."""
        return [t for slot in slots for t in self.slot_tensors(slot)]

    def with_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output for ``x``, [rows, ..., out]) plus every row's tenant delta
        ``s_t · dropout(x) A_t^T B_t^T`` (nothing for rows without a tenant); ``y`` itself when no row
        has one. ``y`` may be updated in place."""
        if self.routing.row_slots is not None:
            slots = [slot for slot in self.routing.slots if self.ranks[slot] > 0]
            if not slots:
                return y
            scales = [self.scalings[slot] for slot in slots]
            return grouped.per_row(
                x, y, self.routing.row_slots, slots, self.factors(slots), scales, self.max_tenants
            )
        segments, slots, plan, memo = self._plan(self.routing.segments)
        if not segments:
            return y
        if x.shape[0] != self.routing.num_rows:
            raise RuntimeError(
                f"multi-tenant LoRA expects inputs of shape [rows, ..., in] with rows={self.routing.num_rows}, "
                f"got {tuple(x.shape)}; was the routing set for this batch?"
            )
        factors = memo.get("factors")
        if factors is None:
            factors = self.factors(slots)  # A, B of slots[k] at 2k, 2k + 1
            if type(self).factors is _FACTORS and type(self).slot_tensors is _SLOT_TENSORS:
                # the slots' own tensors, the same objects until a slot changes (which clears the plans); a
                # parallel layout's factors() may make new ones each call (its collectives): not kept
                memo["factors"] = factors
        if memo["dropout"] and self.training:
            x = self._dropout(x.to(factors[0].dtype), segments)
        return segmented_lora(x, y, plan, factors, memo)

    def _plan(self, routed: list[tuple[int, int, int]] | None) -> tuple[list, list[int], tuple, dict]:
        """The segments of ``routed`` with a tenant here, their distinct slots, the plan over
        :meth:`factors` of those slots, and a memo for them (whether any of them has dropout; their
        factors; what the grouped backward found for them). Cached per routing: every layer of a step,
        and every step with the same batch layout, would otherwise redo it, a loop over the tenants (a
        slot's change clears the cache)."""
        key = tuple(routed or ())
        found = self._plans.get(key)
        if found is not None:
            return found
        segments = [(t, s, e) for t, s, e in key if self.ranks[t] > 0]
        slots = list(dict.fromkeys(slot for slot, _, _ in segments))
        where = {slot: 2 * k for k, slot in enumerate(slots)}
        plan = tuple(
            (where[slot], (), where[slot] + 1, (), start, end, self.scalings[slot])
            for slot, start, end in segments
        )
        if len(self._plans) >= 16:  # (a few layouts alternate: a step's batch, its loss chunks, evaluation)
            self._plans.clear()
        memo = {"dropout": any(self.dropouts[slot] > 0 for slot in slots)}
        found = self._plans[key] = (segments, slots, plan, memo)
        return found

    def _dropout(self, x: torch.Tensor, segments: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each segment's rows get their own tenant's dropout; rows outside segments pass through."""
        pieces, row = [], 0
        for slot, start, end in segments:
            if start > row:
                pieces.append(x[row:start])
            pieces.append(F.dropout(x[start:end], self.dropouts[slot], training=True))
            row = end
        if row < x.shape[0]:
            pieces.append(x[row:])
        return torch.cat(pieces, dim=0)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, slots={self.max_tenants}, "
            f"max_rank={self.max_rank}, tenants={len(self.lora_A)}"
        )


_FACTORS, _SLOT_TENSORS = MultiLoRALinear.factors, MultiLoRALinear.slot_tensors
