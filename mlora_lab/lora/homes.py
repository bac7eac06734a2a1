"""Rows: the tenants of one layout in rows of one buffer, their weights (no stacking) and their gradients
(gradient homes: a layer's tenants' gradients written by one copy).

Weights. :class:`Weights` keeps the flat weights of tenants whose tensors have the same shapes in the same
order as rows of one buffer ``W`` [capacity, n], tensor ``j`` of row ``k`` at ``W[k, o_j : o_j + n_j]``. The
grouped forward stacks a layer's tenants' ``A`` (and ``B``) into [G, r, in] for its batched products; for
tenants in consecutive rows that stack *is* a strided view of ``W`` (``G`` rows ``n`` elements apart), so
nothing is copied (:func:`stacked`; ``bmm`` runs as fast on it). A row is free again once every tensor of its
tenant is gone. A full buffer grows by a quarter (:func:`grown`): its rows are copied and every tenant's tensors
are pointed at the new one (``set_``: the same tensor objects, so optimisers, slots and
references stay valid; a captured CUDA graph keys on the addresses and is captured again).

Gradients. A dense tenant's tensors tile one flat buffer (its row), and the
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
arena that is full grows by a quarter, copying its rows and re-pointing its homes (and any ``.grad`` that was
one).
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def grown(capacity: int) -> int:
    """The rows a full buffer of ``capacity`` rows grows to: a quarter more (at least one). Free rows hold
    memory (on a GPU, real memory) for tenants that may never come: a quarter bounds that waste, where
    doubling could nearly double the adapters' memory; the copies of all the growths stay within about five
    times the rows."""
    return capacity + max(1, capacity // 4)


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


class Rows:
    """Rows of one buffer [capacity, n] for the tenants of one layout (``shapes``, ``dtype``, ``device``):
    tensor ``j`` of row ``k`` at ``buffer[k, offsets[j] : offsets[j] + sizes[j]]``, shaped ``shapes[j]``;
    ``rows[k]`` says who holds row ``k`` (``None``: free)."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, device: torch.device):
        self.shapes = shapes
        self.sizes = [math.prod(s) for s in shapes]
        self.offsets = [sum(self.sizes[:j]) for j in range(len(shapes))]
        self.numel = sum(self.sizes)
        self.strides = [tuple(math.prod(s[i + 1 :]) for i in range(len(s))) for s in shapes]  # (contiguous)
        self.buffer = torch.empty(0, self.numel, dtype=dtype, device=device)
        self.rows: list = []

    @classmethod
    def of(cls, registry: dict, tensors: Sequence[torch.Tensor]):
        """The rows of ``tensors``' layout in ``registry`` (made at the first use)."""
        first = tensors[0]
        key = (tuple(tuple(t.shape) for t in tensors), first.dtype, first.device)
        found = registry.get(key)
        if found is None:
            found = registry[key] = cls(key[0], first.dtype, first.device)
        return found

    def _free_row(self) -> int:
        """A free row (the first), the buffer grown by a quarter (:func:`grown`) when there is none: its rows
        copied, then :meth:`_moved` re-points what views them."""
        row = next((k for k, r in enumerate(self.rows) if r is None), len(self.rows))
        if row == len(self.rows):
            self.rows.append(None)
        if row >= self.buffer.shape[0]:
            old = self.buffer
            self.buffer = old.new_empty(grown(old.shape[0]), self.numel)
            with torch.no_grad():
                self.buffer[: old.shape[0]].copy_(old)
            _EPOCH[0] += 1  # (views of the old buffer kept anywhere are stale: see epoch())
            self._moved()
        return row

    def _release(self, row: int) -> None:
        self.rows[row] = None
        if all(r is None for r in self.rows):  # (no tenant left: nothing kept)
            self.rows = []
            self.buffer = self.buffer.new_empty(0, self.numel)

    def _moved(self) -> None:
        """The buffer was replaced by a larger one: point whatever viewed the old one at the new one."""

    def _view(self, row: int, j: int) -> torch.Tensor:
        o = self.offsets[j]
        return self.buffer[row, o : o + self.sizes[j]].view(self.shapes[j])


class Arena(Rows):
    """The flat gradients of tenants with one layout, as rows: see the module docstring. ``rows[k]``: the
    homes of its tenant's tensors."""

    def join(self, leaves: Sequence[torch.Tensor]) -> list[Home]:
        """A row for the tenant whose tensors are ``leaves`` (in the layout's order): their homes, which
        each leaf now carries (``leaf._grad_home``)."""
        row = self._free_row()
        _EPOCH[0] += 1
        homes = [Home(self, row, j, self._view(row, j), weakref.ref(leaf)) for j, leaf in enumerate(leaves)]
        self.rows[row] = homes
        for leaf, home in zip(leaves, homes):
            leaf._grad_home = home
        return homes

    def leave(self, homes: list[Home]) -> None:
        """The tenant of ``homes`` gives its row back (it stopped training, or its optimiser is gone)."""
        if not homes or homes[0].row >= len(self.rows) or self.rows[homes[0].row] is not homes:
            return
        _EPOCH[0] += 1
        for home in homes:
            leaf = home.leaf()
            if leaf is not None and getattr(leaf, "_grad_home", None) is home:
                del leaf._grad_home
        self._release(homes[0].row)

    def row(self, k: int) -> torch.Tensor:
        """Row ``k``: the flat gradient of its tenant [n]."""
        return self.buffer[k]

    def homes_of(self, j: int, first: int, count: int) -> torch.Tensor:
        """The homes of tensor ``j`` of rows ``first .. first + count - 1`` as one view [count, *shape]."""
        offset = self.buffer.storage_offset() + first * self.numel + self.offsets[j]
        return self.buffer.as_strided((count, *self.shapes[j]), (self.numel, *self.strides[j]), offset)

    def _moved(self) -> None:
        for homes in self.rows:
            for home in homes or ():
                before, home.view = home.view, self._view(home.row, home.j)
                leaf = home.leaf()
                if leaf is not None and leaf.grad is before:  # (a gradient being accumulated: moved)
                    leaf.grad = home.view


_ARENAS: dict[tuple, Arena] = {}


def join(leaves: Sequence[torch.Tensor]) -> list[Home]:
    """Homes in the arena of ``leaves``' layout for a tenant whose tensors are ``leaves``."""
    return Arena.of(_ARENAS, leaves).join(leaves)


_EPOCH = [0]


def epoch() -> int:
    """A number that changes whenever rows do anything that a kept view of them would miss: a tenant joins
    or leaves a gradient arena, or any buffer (gradients or weights) grows and its rows move. Homes found
    (:func:`spot`) and factors stacked as views (:func:`stacked`) at the same epoch are still right."""
    return _EPOCH[0]


def spot(leaves: Sequence[torch.Tensor | None]) -> list[Home] | None:
    """The homes of ``leaves`` (a bucket's factors, in its order) when its gradient can go there by one
    copy (:func:`put`): every leaf has a home and no gradient yet, and the homes are tensor ``j`` of
    consecutive rows of one arena; ``None`` otherwise."""
    first = getattr(leaves[0], "_grad_home", None)
    if first is None:  # (no home, or a copy of a leaf: see Home.__reduce__)
        return None
    arena, j, row = first.arena, first.j, first.row
    found = []
    for k, leaf in enumerate(leaves):  # (one pass: this runs for every layer, bucket and tenant of a step)
        home = getattr(leaf, "_grad_home", None)
        if (
            home is None
            or home.arena is not arena
            or home.j != j
            or home.row != row + k
            or leaf.grad is not None
        ):
            return None
        found.append(home)
    return found


GRAD = operator.attrgetter("grad")
"""``GRAD(t)`` is ``t.grad``: a C getter to map over many tensors (here and in :mod:`mlora_lab.optim`)."""


def empty(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether none of ``leaves`` has a gradient (map over a C getter: a bucket's worth of tenants each
    layer)."""
    return all(map(operator.is_, map(GRAD, leaves), itertools.repeat(None)))


def put(d: torch.Tensor, leaves: Sequence[torch.Tensor], found: list[Home]) -> None:
    """Write ``d`` [G, *shape] (entry ``g``'s gradient of ``leaves[g]``) into their homes ``found``
    (:func:`spot`) by one copy, and make each leaf's ``.grad`` its home."""
    first = found[0]
    arena = first.arena
    arena.homes_of(first.j, first.row, len(found)).copy_(d.view(len(found), *arena.shapes[first.j]))
    for leaf, home in zip(leaves, found):
        leaf.grad = home.view


# -- weights ------------------------------------------------------------------------------------------------


class Weights(Rows):
    """The flat weights of tenants with one layout as rows: see the module docstring. ``rows[k]``: weak
    references to its tenant's tensors; a row is given back when they are all gone."""

    def join(self, fulls: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Leaf tensors (``requires_grad``) holding ``fulls``' values in a free row."""
        row = self._free_row()
        with torch.no_grad():
            self.buffer[row].copy_(torch.cat([f.detach().reshape(-1).to(self.buffer) for f in fulls]))
        leaves = [self._point(torch.empty(0, dtype=self.buffer.dtype, device=self.buffer.device), row, j)
                  for j in range(len(self.shapes))]  # fmt: skip
        for leaf in leaves:
            leaf.requires_grad_(True)
        refs = [weakref.ref(leaf) for leaf in leaves]
        self.rows[row] = refs
        alive = [len(leaves)]  # (the row is free once every one of them is gone)
        for leaf in leaves:
            weakref.finalize(leaf, self._gone, row, refs, alive)
        return leaves

    def _point(self, t: torch.Tensor, row: int, j: int) -> torch.Tensor:
        offset = self.buffer.storage_offset() + row * self.numel + self.offsets[j]
        with torch.no_grad():
            return t.set_(self.buffer.untyped_storage(), offset, self.shapes[j], self.strides[j])

    def _gone(self, row: int, refs: list[weakref.ref], alive: list[int]) -> None:
        alive[0] -= 1
        if alive[0] == 0 and row < len(self.rows) and self.rows[row] is refs:
            self._release(row)

    def _moved(self) -> None:
        for row, refs in enumerate(self.rows):
            for j, ref in enumerate(refs or ()):
                leaf = ref()
                if leaf is not None:
                    self._point(leaf, row, j)


_WEIGHTS: dict[tuple, Weights] = {}


def weights(fulls: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors with ``fulls``' values (one floating dtype and device), a row of the :class:`Weights`
    of their layout."""
    return Weights.of(_WEIGHTS, fulls).join(fulls)


def stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(tensors)`` as a view, without copying, when the tensors (of one shape, contiguous)
    lie at equal distances in one storage, in order (rows of one :class:`Weights`); ``None`` otherwise.
    The view is detached: for the grouped forward, which gives the factors their gradients itself."""
    first = tensors[0]
    if len(tensors) < 2 or not first.is_contiguous():
        return None
    try:
        start, size, shape = first.data_ptr(), first.element_size(), first.shape
        step = tensors[1].data_ptr() - start
        if start == 0 or step <= 0 or step % size or step // size < first.numel():
            return None
        for k, t in enumerate(tensors):
            if t.data_ptr() != start + k * step or t.shape != shape or not t.is_contiguous():
                return None
        # the same addresses as the tensors', inside the first one's storage (as_strided checks the bounds)
        return first.detach().as_strided((len(tensors), *shape), (step // size, *first.stride()))
    except (RuntimeError, NotImplementedError):  # (no storage: meta, a DTensor, a fake; out of bounds)
        return None
