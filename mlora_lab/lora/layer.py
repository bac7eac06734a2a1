"""Multi-tenant LoRA on a frozen ``nn.Linear``: one base matmul per batch, one LoRA delta per row's tenant.

Maths. The base layer computes ``y = x W^T (+ b)`` with ``W`` of shape ``[out, in]``. A tenant ``t`` with
rank ``r_t``, scaling ``s_t`` (``alpha / r`` or ``alpha / sqrt(r)`` with rsLoRA) and dropout ``p_t`` owns
slot ``t`` of two pre-allocated tensors

    lora_A : [S, R, in]      S = max_tenants, R = max_rank
    lora_B : [S, out, R]

of which only the leading ``A_t = lora_A[t, :r_t]`` ([r_t, in]) and ``B_t = lora_B[t, :, :r_t]`` ([out, r_t])
are used. A row ``b`` of tenant ``t`` gets

    y_b = x_b W^T (+ b) + s_t * dropout_{p_t}(x_b) A_t^T B_t^T                    x_b : [T, in]

exactly PEFT's ``lora_B(lora_A(dropout(x))) * scaling``: a rank-4 tenant in a rank-64 slot *is* a
rank-4 LoRA, because the delta is computed on the ``[:r_t]`` views, never on the zero padding. Rows of
one tenant sit in contiguous runs (segments) of the batch, so the delta is one pair of small matmuls
per segment on views of the slot tensors: no per-row gather, no copy of ``A`` or ``B``.

Gradients (``g`` = dL/dy for the segment's rows, ``xa = x A_t^T`` saved from the forward):

    dL/dB_t = s_t g^T xa        [out, r_t]
    dL/dA_t = (s_t g B_t)^T x   [r_t, in]
    dL/dx  += (s_t g B_t) A_t

They are written into one zero-initialised gradient per slot tensor, so a tenant whose rows are absent
gets an exact zero gradient and no tenant's loss can reach another tenant's slot.

The layer knows nothing about tenants' names, optimisers or sharding: routing comes from a shared
:class:`LoRARouting` that the model wrapper fills before each forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LoRARouting:
    """Which batch rows belong to which slot, shared by every multi-tenant layer of one model.

    ``segments`` holds ``(slot, start_row, end_row)`` runs covering the rows that get an adapter;
    rows outside every segment get the base output only. ``None`` means "no adapters" (plain base).
    """

    segments: list[tuple[int, int, int]] | None = None
    num_rows: int = 0
    # When True, every layer runs its LoRA function even with no segment of its own, so every slot
    # tensor gets a (possibly zero) gradient on every process: data-parallel gradient reduction
    # needs the same set of gradients everywhere, whichever tenants a process's rows belong to.
    grad_every_slot: bool = False


class _SegmentedLoRA(torch.autograd.Function):
    """``y[s:e] = base[s:e] + scale * (x[s:e] A^T) B^T`` for each plan entry ``(A_index, B_index, s, e,
    scale)``, with ``A = lora_A[A_index]`` ([r, in]) and ``B = lora_B[B_index]`` ([out, r]); see the
    module docstring. Dense layers index a slot (``(slot, :r)``); packed experts index a slot and an
    expert (``(slot, expert, :r)``). ``x`` is ``[rows, ..., in]``; ``base`` ([rows, ..., out], the base
    layer's output, or ``None`` for the delta alone) is updated in place, so no ``[rows, out]`` delta is
    ever materialised; gradients of all entries land in one zero-initialised tensor per slot tensor."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        lora_A: torch.Tensor,
        lora_B: torch.Tensor,
        plan: tuple,
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out_features = lora_B.shape[-2]
        if base is None:  # plan entries cover disjoint rows (most of them): zero only the gaps
            out = x.new_empty(*x.shape[:-1], out_features)
            _zero_gaps(out, plan)
        else:
            out = base
            ctx.mark_dirty(base)
        xas = []
        for a_index, b_index, start, end, scale in plan:
            xa = F.linear(x[start:end], lora_A[a_index])  # [n, ..., r]
            rows = out[start:end].view(-1, out_features)  # rows of a contiguous tensor: a view
            xa2 = xa.reshape(-1, xa.shape[-1])
            if base is None:
                torch.mm(xa2, lora_B[b_index].T, out=rows).mul_(scale)
            else:
                rows.addmm_(xa2, lora_B[b_index].T, alpha=scale)
            xas.append(xa)
        ctx.plan = plan
        ctx.save_for_backward(x, lora_A, lora_B, *xas)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, lora_A, lora_B, *xas = ctx.saved_tensors
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        in_features, out_features = x.shape[-1], lora_B.shape[-2]
        grad_x = None
        if need_x:
            grad_x = torch.empty_like(x)
            _zero_gaps(grad_x, ctx.plan)
        grad_A = torch.zeros_like(lora_A) if need_A else None
        grad_B = torch.zeros_like(lora_B) if need_B else None
        for (a_index, b_index, start, end, scale), xa in zip(ctx.plan, xas):
            # the order of autograd through ``(x A^T B^T) * s``: the same rounding as PEFT's layers
            g = grad_out[start:end].reshape(-1, out_features) * scale  # [n, out]
            xa2 = xa.reshape(-1, xa.shape[-1])  # [n, r]
            g_xa = g @ lora_B[b_index]  # [n, r]
            if need_B:  # one slot (and expert) may own several entries: accumulate
                grad_B[b_index].addmm_(g.T, xa2)
            if need_A:
                grad_A[a_index].addmm_(g_xa.T, x[start:end].reshape(-1, in_features))
            if need_x:
                torch.mm(g_xa, lora_A[a_index], out=grad_x[start:end].view(-1, in_features))
        if len(ctx.needs_input_grad) == 4:  # called without ``base``
            return grad_x, grad_A, grad_B, None
        return grad_x, grad_A, grad_B, None, grad_out if ctx.needs_input_grad[4] else None


def _zero_gaps(t: torch.Tensor, plan: tuple) -> None:
    """Zero the rows of ``t`` outside every plan entry's ``[start, end)`` (entries are disjoint)."""
    row = 0
    for _, _, start, end, _ in sorted(plan, key=lambda p: p[2]):
        if start > row:
            t[row:start].zero_()
        row = max(row, end)
    if row < t.shape[0]:
        t[row:].zero_()


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus ``max_tenants`` LoRA slots of up to ``max_rank`` (see module docstring).

    Per-slot settings live in plain Python lists (``ranks``, ``scalings``, ``dropouts``) so the forward
    never reads a device tensor to decide what to compute: no hidden device syncs in the hot loop.
    ``ranks[t] == 0`` means slot ``t`` does not target this layer.
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
        self.max_tenants, self.max_rank = max_tenants, max_rank
        device = base_layer.weight.device
        self.lora_A = nn.Parameter(
            torch.zeros(max_tenants, max_rank, self.in_features, dtype=dtype, device=device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(max_tenants, self.out_features, max_rank, dtype=dtype, device=device)
        )
        self.ranks = [0] * max_tenants
        self.scalings = [0.0] * max_tenants
        self.dropouts = [0.0] * max_tenants
        # A plain attribute, not a submodule: the routing is shared by every layer of the model.
        object.__setattr__(self, "routing", routing)

    # -- slot settings (the slot tensors themselves are written by the model wrapper) ----------
    def configure_slot(self, slot: int, rank: int, scaling: float, dropout: float) -> None:
        """Slot ``slot`` now holds a rank-``rank`` LoRA with this scaling and dropout."""
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..max_rank={self.max_rank}")
        self.ranks[slot], self.scalings[slot], self.dropouts[slot] = rank, float(scaling), float(dropout)

    def clear_slot(self, slot: int) -> None:
        """Slot ``slot`` no longer targets this layer."""
        self.ranks[slot], self.scalings[slot], self.dropouts[slot] = 0, 0.0, 0.0

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_delta(x, self.base_layer(x))

    def slot_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors the delta multiplies by: ``(lora_A, lora_B)`` (a sharded layout may give the
        part this process holds)."""
        return self.lora_A, self.lora_B

    def with_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output for ``x``, [rows, ..., out]) plus every row's tenant delta
        ``s_t · dropout(x) A_t^T B_t^T`` (nothing for rows without a tenant); ``y`` itself when no row
        has one and no gradient is needed. ``y`` may be updated in place."""
        segments = self.routing.segments or []
        always = self.routing.grad_every_slot and self.training and torch.is_grad_enabled()
        if not segments and not always:
            return y
        if x.shape[0] != self.routing.num_rows:
            raise RuntimeError(
                f"multi-tenant LoRA expects inputs of shape [rows, ..., in] with rows={self.routing.num_rows}, "
                f"got {tuple(x.shape)}; was the routing set for this batch?"
            )
        plan = tuple(
            ((slot, slice(0, r)), (slot, slice(None), slice(0, r)), start, end, self.scalings[slot])
            for slot, start, end in segments
            if (r := self.ranks[slot]) > 0
        )
        if not plan and not always:
            return y
        A, B = self.slot_tensors()
        x_lora = x.to(A.dtype)
        if self.training and any(self.dropouts[p[0][0]] > 0 for p in plan):
            x_lora = self._dropout(x_lora, plan)
        if y.dtype == A.dtype and not y._is_view():  # in place (autograd cannot rebase a view)
            return _SegmentedLoRA.apply(x_lora, A, B, plan, y)
        return y + _SegmentedLoRA.apply(x_lora, A, B, plan).to(y.dtype)

    def _dropout(self, x: torch.Tensor, plan: tuple) -> torch.Tensor:
        """Each segment's rows get their own tenant's dropout; rows outside segments pass through."""
        pieces, row = [], 0
        for (slot, _), _, start, end, _ in plan:
            if start > row:
                pieces.append(x[row:start])
            pieces.append(F.dropout(x[start:end], self.dropouts[slot], training=True))
            row = end
        if row < x.shape[0]:
            pieces.append(x[row:])
        return torch.cat(pieces, dim=0)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={self.max_tenants}, max_rank={self.max_rank}"
