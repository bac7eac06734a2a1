"""Multi-tenant LoRA on packed MoE experts (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).

A packed expert parameter ``W`` [E, out, in] is used per expert as ``F.linear(x, W[e])``. A tenant ``t``
targeting it owns, per expert ``e``, a rank-``r_t`` LoRA in slot ``t`` of

    lora_A : [S, E, R, in]      A_{t,e} = lora_A[t, e, :r_t]     ([r_t, in])
    lora_B : [S, E, out, R]     B_{t,e} = lora_B[t, e, :, :r_t]  ([out, r_t])

and a token of tenant ``t`` routed to expert ``e`` gets ``x W_e^T + s_t (x A_{t,e}^T) B_{t,e}^T``: PEFT's
``target_parameters`` maths (PEFT adds ``s_t B_{t,e} A_{t,e}`` to ``W_e``; same function, other rounding).

The forward is the transformers experts loop in grouped form: the (token, k) pairs are sorted by expert
and then by token, so within each expert's block the tokens of one tenant are contiguous (a tenant's
rows are contiguous in the batch) and the LoRA deltas are one pair of small matmuls per (expert,
tenant) run, via the same segmented function as the dense layers.

PEFT's saved layout per parameter: ``lora_A`` [E*r, in] (expert-major) and ``lora_B`` [out, E*r] read as
``(out, r, E)`` (rank-major); :func:`to_peft` / :func:`from_peft` convert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlora_lab.lora.layer import LoRARouting, _SegmentedLoRA


def to_peft(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` [E, r, in], ``B`` [E, out, r] → PEFT's ``lora_A`` [E*r, in], ``lora_B`` [out, E*r]."""
    E, r, _ = A.shape
    return A.reshape(E * r, -1), B.permute(1, 2, 0).reshape(B.shape[1], r * E)


def from_peft(A: torch.Tensor, B: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_peft`."""
    r = A.shape[0] // num_experts
    return A.reshape(num_experts, r, -1), B.reshape(B.shape[0], r, num_experts).permute(2, 0, 1)


class MultiLoRAExperts(nn.Module):
    """A packed-experts module (``forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``)
    with LoRA slots on some of its 3-D parameters. Per-slot settings are per parameter name."""

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
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        # definition order (PEFT nests its wrappers in this order, which fixes the saved key names)
        self.param_names = [
            n for n, p in base_layer.named_parameters(recurse=False) if n in param_names and p.ndim == 3
        ]
        self.max_tenants, self.max_rank = max_tenants, max_rank
        self.shapes: dict[str, tuple[int, int, int]] = {}
        for name in self.param_names:
            E, out, inn = getattr(base_layer, name).shape
            self.shapes[name] = (E, out, inn)
            device = getattr(base_layer, name).device
            self.register_parameter(
                f"lora_A_{name}",
                nn.Parameter(torch.zeros(max_tenants, E, max_rank, inn, dtype=dtype, device=device)),
            )
            self.register_parameter(
                f"lora_B_{name}",
                nn.Parameter(torch.zeros(max_tenants, E, out, max_rank, dtype=dtype, device=device)),
            )
        self.ranks = {n: [0] * max_tenants for n in self.param_names}
        self.scalings = {n: [0.0] * max_tenants for n in self.param_names}
        self.num_experts = next(iter(self.shapes.values()))[0]
        self.act_fn = base_layer.act_fn
        object.__setattr__(self, "routing", routing)

    def lora(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        return getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")

    def configure_slot(self, slot: int, name: str, rank: int, scaling: float) -> None:
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"rank {rank} is outside 1..max_rank={self.max_rank}")
        self.ranks[name][slot], self.scalings[name][slot] = rank, float(scaling)

    def clear_slot(self, slot: int) -> None:
        for name in self.param_names:
            self.ranks[name][slot], self.scalings[name][slot] = 0, 0.0

    def _linear(
        self, name: str, x: torch.Tensor, blocks: list[tuple[int, int, int]], runs: list
    ) -> torch.Tensor:
        """``x`` [M, in] sorted by expert: the base projection per expert block plus each (expert,
        tenant) run's LoRA delta."""
        weight = getattr(self.base_layer, name)
        out = (
            torch.cat([F.linear(x[s:e], weight[ex]) for ex, s, e in blocks])
            if blocks
            else x.new_zeros(0, weight.shape[1])
        )
        if name not in self.param_names:
            return out
        plan = tuple(
            ((slot, ex, slice(0, r)), (slot, ex, slice(None), slice(0, r)), s, e, self.scalings[name][slot])
            for slot, ex, s, e in runs
            if (r := self.ranks[name][slot]) > 0
        )
        always = self.routing.grad_every_slot and self.training and torch.is_grad_enabled()
        if plan or always:
            A, B = self.lora(name)
            out = out + _SegmentedLoRA.apply(x.to(A.dtype), A, B, plan).to(out.dtype)
        return out

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        N, k = top_k_index.shape
        E = self.num_experts
        expert = top_k_index.reshape(-1)
        token = torch.arange(N, device=hidden_states.device).repeat_interleave(k)
        weight = top_k_weights.reshape(-1)
        keep = expert < E  # some routers mark dropped slots with expert == E
        expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.argsort(expert * N + token)
        expert, token, weight = expert[order], token[order], weight[order]
        counts = torch.bincount(expert, minlength=E).tolist()
        blocks, start = [], 0
        for ex, c in enumerate(counts):
            if c:
                blocks.append((ex, start, start + c))
            start += c
        runs = self._runs(token, blocks, N)
        x = hidden_states[token]  # [M, H]
        gate, up = self._linear("gate_up_proj", x, blocks, runs).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        y = self._linear("down_proj", h, blocks, runs) * weight[:, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))

    def _runs(
        self, token: torch.Tensor, blocks: list[tuple[int, int, int]], N: int
    ) -> list[tuple[int, int, int, int]]:
        """(slot, expert, start, end) runs of tokens of one tenant inside each expert block."""
        segments = self.routing.segments or []
        if not segments:
            return []
        rows = self.routing.num_rows
        if N % rows:
            raise RuntimeError(f"{N} tokens do not split into {rows} rows")
        row_slot = torch.full((rows,), -1, dtype=torch.long)
        for slot, s, e in segments:
            row_slot[s:e] = slot
        slots = row_slot[(token // (N // rows)).cpu()].tolist()
        runs = []
        for ex, s, e in blocks:
            i = s
            while i < e:
                j = i
                while j < e and slots[j] == slots[i]:
                    j += 1
                if slots[i] >= 0:
                    runs.append((slots[i], ex, i, j))
                i = j
        return runs
