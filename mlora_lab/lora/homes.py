"""Gradient homes: a layer's tenants' gradients written into rows of one buffer by one copy.

A dense tenant's tensors tile one flat buffer (:meth:`~mlora_lab.lora.model.TensorIO.new_many`), and the
optimiser steps it as one tensor of ``n`` elements with its gradient flat too
(:meth:`~mlora_lab.optim.TenantOptimizer.flat_grad`). The grouped backward (:mod:`mlora_lab.lora.grouped`)
makes a layer's gradients as one tensor per rank bucket, ``dÂ`` [G, r, in] for the bucket's ``G`` tenants;
gathering each tenant's part of every bucket into its flat buffer is one copy per tensor: 5,376 a step for
64 tenants of 84 matrices, ~12 ms on a CPU of per-copy work alone, growing with the tenants.

Here the flat gradients of tenants with one layout (the same shapes in the same order) are the rows of one
arena ``H`` [capacity, n]. Tensor ``j`` (``n_j`` elements at offset ``o_j`` of the layout) of the tenant in
row ``k`` has its gradient's *home* at ``H[k, o_j : o_j + n_j]``. When a bucket's factors are tensor ``j`` of
the tenants in rows ``k0, k0 + 1, ..., k0 + G - 1`` (the usual batch: tenants in the order they started),
their homes are one strided view of ``H`` (``G`` rows ``n`` elements apart), and the bucket's gradient goes
there by **one** copy; each factor's ``.grad`` is then its home, and the tenant's flat gradient is its row,
with nothing to gather. Any other case (gradient accumulation into an existing ``.grad``, tenants out of
row order, padded ranks) falls back to per-tensor gradients, which the optimiser gathers into the row.

Rows are scratch for one optimiser window: the optimiser reads them and releases the ``.grad``\\ s. An
arena that is full doubles, copying its rows and re-pointing its homes (and any ``.grad`` that was one).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Home:
    """Where the gradient of one tensor (``leaf``) of a tenant goes: ``arena``'s row ``row``, the
    layout's tensor ``j``; ``view`` is that part of the row, shaped as the tensor."""

    arena: Arena
    row: int
    j: int
    view: torch.Tensor
    leaf: weakref.ref

    def __reduce__(self) -> tuple:
        # a home belongs to this process's live arena: a copy or a pickle of its leaf carries none
        return (_no_home, ())


def _no_home() -> None:
    return None


class Arena:
    """The rows of tenants with one layout (``shapes``, ``dtype``, ``device``): see the module
    docstring."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, device: torch.device):
        self.shapes = shapes
        self.sizes = [math.prod(s) for s in shapes]
        self.offsets = [sum(self.sizes[:j]) for j in range(len(shapes))]
        self.numel = sum(self.sizes)
        self.strides = [tuple(math.prod(s[i + 1 :]) for i in range(len(s))) for s in shapes]  # (contiguous)
        self.buffer = torch.empty(0, self.numel, dtype=dtype, device=device)
        self.rows: list[list[Home] | None] = []  # per row: its tenant's homes (None: free)

    def join(self, leaves: Sequence[torch.Tensor]) -> list[Home]:
        """A row for the tenant whose tensors are ``leaves`` (in the layout's order): their homes, which
        each leaf now carries (``leaf._grad_home``)."""
        row = next((k for k, r in enumerate(self.rows) if r is None), len(self.rows))
        if row == len(self.rows):
            self.rows.append(None)
        if row >= self.buffer.shape[0]:
            self._grow(max(1, 2 * self.buffer.shape[0]))
        homes = [Home(self, row, j, self._view(row, j), weakref.ref(leaf)) for j, leaf in enumerate(leaves)]
        self.rows[row] = homes
        for leaf, home in zip(leaves, homes):
            leaf._grad_home = home
        return homes

    def leave(self, homes: list[Home]) -> None:
        """The tenant of ``homes`` gives its row back (it stopped training, or its optimiser is gone)."""
        if not homes or homes[0].row >= len(self.rows) or self.rows[homes[0].row] is not homes:
            return
        for home in homes:
            leaf = home.leaf()
            if leaf is not None and getattr(leaf, "_grad_home", None) is home:
                del leaf._grad_home
        self.rows[homes[0].row] = None
        if all(r is None for r in self.rows):  # (no tenant left: nothing kept)
            self.rows = []
            self.buffer = self.buffer.new_empty(0, self.numel)

    def row(self, k: int) -> torch.Tensor:
        """Row ``k``: the flat gradient of its tenant [n]."""
        return self.buffer[k]

    def homes_of(self, j: int, first: int, count: int) -> torch.Tensor:
        """The homes of tensor ``j`` of rows ``first .. first + count - 1`` as one view [count, *shape]."""
        offset = self.buffer.storage_offset() + first * self.numel + self.offsets[j]
        return self.buffer.as_strided((count, *self.shapes[j]), (self.numel, *self.strides[j]), offset)

    def _view(self, row: int, j: int) -> torch.Tensor:
        o = self.offsets[j]
        return self.buffer[row, o : o + self.sizes[j]].view(self.shapes[j])

    def _grow(self, capacity: int) -> None:
        old = self.buffer
        self.buffer = old.new_empty(capacity, self.numel)
        self.buffer[: old.shape[0]].copy_(old)
        for homes in self.rows:
            for home in homes or ():
                before, home.view = home.view, self._view(home.row, home.j)
                leaf = home.leaf()
                if leaf is not None and leaf.grad is before:  # (a gradient being accumulated: moved)
                    leaf.grad = home.view


_ARENAS: dict[tuple, Arena] = {}


def join(leaves: Sequence[torch.Tensor]) -> list[Home]:
    """Homes in the arena of ``leaves``' layout for a tenant whose tensors are ``leaves``."""
    first = leaves[0]
    key = (tuple(tuple(t.shape) for t in leaves), first.dtype, first.device)
    arena = _ARENAS.get(key)
    if arena is None:
        arena = _ARENAS[key] = Arena(key[0], first.dtype, first.device)
    return arena.join(leaves)


def take(d: torch.Tensor, leaves: Sequence[torch.Tensor | None]) -> bool:
    """Write ``d`` [G, *shape] (entry ``g``'s gradient of ``leaves[g]``) into the leaves' homes by one
    copy, and make each leaf's ``.grad`` its home; ``False`` (nothing done) unless every leaf has a home,
    no gradient yet, and the homes are one tensor of consecutive rows of one arena."""
    try:
        found = [leaf._grad_home for leaf in leaves]
    except AttributeError:  # (a leaf without a home, or None)
        return False
    if any(h is None for h in found):  # (a copy of a leaf: see Home.__reduce__)
        return False
    arena, j, row = found[0].arena, found[0].j, found[0].row
    if [(h.arena, h.j, h.row) for h in found] != [(arena, j, row + k) for k in range(len(found))]:
        return False
    if any(leaf.grad is not None for leaf in leaves):
        return False
    arena.homes_of(j, row, len(found)).copy_(d.view(len(found), *arena.shapes[j]))
    for leaf, home in zip(leaves, found):
        leaf.grad = home.view
    return True
