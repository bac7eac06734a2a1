"""Multi-tenant LoRA on packed MoE experts (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).

A packed expert parameter ``W`` [E, out, in] is used per expert as ``F.linear(x, W[e])``. A tenant ``t``
targeting it owns, per expert ``e``, a rank-``r_t`` LoRA, held under its slot number ``t``:

    lora_A[name][t] : [E, r_t, in]      A_{t,e} = lora_A[name][t][e]     ([r_t, in])
    lora_B[name][t] : [E, out, r_t]     B_{t,e} = lora_B[name][t][e]     ([out, r_t])

and a token of tenant ``t`` routed to expert ``e`` gets ``x W_e^T + s_t (x A_{t,e}^T) B_{t,e}^T``: PEFT's
``target_parameters`` maths (PEFT adds ``s_t B_{t,e} A_{t,e}`` to ``W_e``; same function, other rounding).

The forward is the transformers experts loop in grouped form, in three steps that expert parallelism
(:mod:`mlora_lab.parallel.expert`) can pull apart to move tokens between processes:

1. :meth:`~MultiLoRAExperts.route`: the kept (token, k) pairs ``[M]`` with their expert, router weight
   and the slot of the token's row (``-1``: no adapter);
2. :meth:`~MultiLoRAExperts.compute`: the expert MLP of ``x`` [M, H] (each pair's hidden state): pairs
   are sorted by (expert, slot), so each expert is one block and each (expert, tenant) one run, and the
   LoRA deltas are one pair of small matmuls per run, via the same segmented function as dense layers;
3. the router-weighted outputs are summed back onto their tokens.

PEFT's saved layout per parameter: ``lora_A`` [E*r, in] (expert-major) and ``lora_B`` [out, E*r] read as
``(out, r, E)`` (rank-major); :func:`to_peft` / :func:`from_peft` convert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlora_lab.lora.layer import LoRARouting, segmented_lora

PACKED = ("gate_up_proj", "down_proj")


def to_peft(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` [E, r, in], ``B`` [E, out, r] → PEFT's ``lora_A`` [E*r, in], ``lora_B`` [out, E*r]."""
    E, r, _ = A.shape
    return A.reshape(E * r, -1), B.permute(1, 2, 0).reshape(B.shape[1], r * E)


def from_peft(A: torch.Tensor, B: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_peft`."""
    r = A.shape[0] // num_experts
    return A.reshape(num_experts, r, -1), B.reshape(B.shape[0], r, num_experts).permute(2, 0, 1)


def packed_expert_parameters(model: nn.Module) -> list[str]:
    """Full names of the packed expert parameters (``<block>.gate_up_proj``, ``<block>.down_proj``) of every
    packed-experts block of ``model`` that :class:`MultiLoRAExperts` can adapt (:func:`packed_experts_problem`)."""
    return [
        f"{name}.{attr}" if name else attr
        for name, module in model.named_modules()
        if packed_experts_problem(module) is None
        for attr in PACKED
    ]


def packed_experts_problem(module: nn.Module) -> str | None:
    """Why ``module`` is not a packed-experts block whose maths :class:`MultiLoRAExperts` reproduces
    (``act_fn(x G_e^T) * (x U_e^T)`` then ``· D_e^T`` with ``gate_up_proj = [G; U]`` [E, 2I, H] and
    ``down_proj`` [E, H, I], no biases), or ``None`` if it is one."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return "has no 3-D gate_up_proj and down_proj parameters"
    if gate_up.ndim != 3 or down.ndim != 3:
        return f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not 3-D"
    E, two_i, H = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (E, H, two_i // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H], [E, H, I]"
    flags = {
        "is_transposed": False,
        "has_bias": False,
        "has_gate": True,
        "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    odd = [f"{k}={getattr(module, k)}" for k, v in flags.items() if getattr(module, k, v) != v]
    if odd:
        return f"uses a layout or gating this LoRA does not reproduce ({', '.join(odd)})"
    if not callable(getattr(module, "act_fn", None)):
        return "has no act_fn"
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in PACKED]
    if extra:
        return f"has parameters besides gate_up_proj and down_proj: {extra}"
    return None


class MultiLoRAExperts(nn.Module):
    """A packed-experts module (``forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``)
    with LoRA slots on some of its 3-D parameters (``param_names``; may be empty). Per-slot settings
    are per parameter name. ``shapes`` and ``num_experts`` are the model's, whatever part of the
    experts this process holds."""

    def __init__(
        self,
        base_layer: nn.Module,
        routing: LoRARouting,
        param_names: list[str],
        max_tenants: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        problem = packed_experts_problem(base_layer)
        if problem:
            raise ValueError(f"{type(base_layer).__name__} {problem}")
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        # definition order (PEFT nests its wrappers in this order, which fixes the saved key names)
        self.param_names = [n for n, _ in base_layer.named_parameters(recurse=False) if n in param_names]
        self.max_tenants, self.max_rank = max_tenants, max_rank
        self.shapes: dict[str, tuple[int, int, int]] = {
            n: tuple(getattr(base_layer, n).shape) for n in PACKED
        }
        # name -> slot -> this process's part of A [E, r, in] / B [E, out, r] (leaf tensors)
        self.lora_A: dict[str, dict[int, torch.Tensor]] = {n: {} for n in self.param_names}
        self.lora_B: dict[str, dict[int, torch.Tensor]] = {n: {} for n in self.param_names}
        self.layouts: dict[str, object] = {"A": None, "B": None}  # set by a parallel layout
        self.dtype = dtype
        self.ranks = {n: [0] * max_tenants for n in self.param_names}
        self.scalings = {n: [0.0] * max_tenants for n in self.param_names}
        self.num_experts = self.shapes["gate_up_proj"][0]
        self.act_fn = base_layer.act_fn
        object.__setattr__(self, "routing", routing)

    @property
    def device(self) -> torch.device:
        return self.base_layer.gate_up_proj.device

    def slot_tensors(self, name: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [E, r, in], B [E, out, r])`` of ``slot`` on parameter ``name``, for the experts this
        module computes (all of them here)."""
        return self.lora_A[name][slot], self.lora_B[name][slot]

    def set_slot(
        self, slot: int, name: str, A: torch.Tensor, B: torch.Tensor, rank: int, scaling: float
    ) -> None:
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..max_rank={self.max_rank}")
        self.lora_A[name][slot], self.lora_B[name][slot] = A, B
        self.ranks[name][slot], self.scalings[name][slot] = rank, float(scaling)

    def clear_slot(self, slot: int) -> None:
        for name in self.param_names:
            self.lora_A[name].pop(slot, None)
            self.lora_B[name].pop(slot, None)
            self.ranks[name][slot], self.scalings[name][slot] = 0, 0.0

    # -- forward -------------------------------------------------------------------------------
    def adapted(self) -> bool:
        """Whether a row of the current batch has a tenant with an adapter on these experts (else the
        grouped path would compute the base alone, slower than the model's own forward: a served job slots
        every expert for the clients that train the MLP, and the others' batches skip it)."""
        segments = self.routing.segments or []
        return any(self.ranks[n][slot] for slot, s, e in segments if e > s for n in self.param_names)

    def route(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept (token, k) pairs: ``token``, ``expert``, router ``weight`` and ``slot`` ([M] each)."""
        N, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        token = torch.arange(N, device=top_k_index.device).repeat_interleave(k)
        weight = top_k_weights.reshape(-1)
        keep = expert < self.num_experts  # some routers mark dropped pairs with expert == E
        token, expert, weight = token[keep], expert[keep], weight[keep]
        return token, expert, weight, self._slots(token, N)

    def _slots(self, token: torch.Tensor, N: int) -> torch.Tensor:
        """The slot of each token's row (``-1``: no adapter)."""
        segments, rows = self.routing.segments or [], self.routing.num_rows
        if not segments:
            return torch.full_like(token, -1)
        if N % rows:
            raise RuntimeError(f"{N} tokens do not split into {rows} rows")
        row_slot = torch.full((rows,), -1, dtype=torch.long)
        for slot, s, e in segments:
            row_slot[s:e] = slot
        return row_slot.to(token.device)[token // (N // rows)]

    def compute(self, x: torch.Tensor, expert: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The expert MLP (with each pair's tenant delta) of ``x`` [M, H]; ``expert`` [M] indexes the
        experts of :meth:`weights`, ``slot`` [M] is ``-1`` for base-only pairs. Returns [M, H], in
        the order of ``x``."""
        order, blocks, runs = self._group(expert, slot)
        ys = self._mlp(x[order], blocks, runs)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        return ys[inverse]

    def _group(self, expert: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, list, list]:
        """The permutation sorting pairs by (expert, slot), stable, with base-only pairs last in each
        expert; the ``(expert, start, end)`` blocks and ``(slot, expert, start, end)`` runs it makes."""
        S = self.max_tenants
        key = expert * (S + 1) + torch.where(slot < 0, S, slot)
        order = torch.argsort(key, stable=True)
        keys, counts = torch.unique_consecutive(key[order], return_counts=True)
        blocks, runs, start = [], [], 0
        for kv, c in zip(keys.tolist(), counts.tolist()):
            ex, s = divmod(kv, S + 1)
            if blocks and blocks[-1][0] == ex:
                blocks[-1] = (ex, blocks[-1][1], start + c)
            else:
                blocks.append((ex, start, start + c))
            if s < S:
                runs.append((s, ex, start, start + c))
            start += c
        return order, blocks, runs

    def _mlp(self, xs: torch.Tensor, blocks: list, runs: list) -> torch.Tensor:
        """``act(xs G_e^T) * (xs U_e^T) D_e^T`` (+ LoRA deltas) of pairs grouped by :meth:`_group`."""
        gate, up = self._linear("gate_up_proj", xs, blocks, runs).chunk(2, dim=-1)
        return self._linear("down_proj", self.act_fn(gate) * up, blocks, runs)

    def _linear(self, name: str, x: torch.Tensor, blocks: list, runs: list) -> torch.Tensor:
        """``x`` [M, in] sorted by expert: the base projection per expert block plus each (expert,
        tenant) run's LoRA delta."""
        weight = getattr(self.base_layer, name)
        # no pair here (expert parallelism: none was sent to this rank): an empty product, which keeps
        # the output in ``x``'s graph, so that the backward's token exchange runs here too
        out = (
            torch.cat([F.linear(x[s:e], weight[ex]) for ex, s, e in blocks])
            if blocks
            else F.linear(x, weight[0])
        )
        if name not in self.param_names:
            return out
        factors: list[torch.Tensor] = []
        where: dict[int, int] = {}
        plan = []
        for slot, ex, s, e in runs:
            if self.ranks[name][slot] == 0:
                continue
            if slot not in where:
                where[slot] = len(factors)
                factors.extend(self.slot_tensors(name, slot))
            i = where[slot]
            plan.append((i, (ex,), i + 1, (ex,), s, e, self.scalings[name][slot]))
        if not plan:
            return out
        return segmented_lora(x, out, tuple(plan), factors)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.adapted():  # no row of the batch has a tenant here: the model's own experts forward
            return self.base_layer(hidden_states, top_k_index, top_k_weights)
        token, expert, weight, slot = self.route(top_k_index, top_k_weights)
        order, blocks, runs = self._group(expert, slot)
        token, weight = token[order], weight[order]  # work in grouped order: no un-permuting
        y = self._mlp(hidden_states[token], blocks, runs) * weight[:, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))
