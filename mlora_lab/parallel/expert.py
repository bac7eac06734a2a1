"""Expert parallelism (EP) for packed MoE experts with multi-tenant LoRA slots.

With ``ep = k`` the ``E`` experts of every MoE layer are split into ``k`` contiguous groups of
``E/k``; process ``i`` of an EP group keeps experts ``[i E/k, (i+1) E/k)`` of the base weights and of
every tenant's LoRA. A tenant's expert tensors are DTensors on the EP mesh, split on their expert
dimension:

    A [E, r, in]   Shard(0)        B [E, out, r]   Shard(0)

so :class:`~mlora_lab.parallel.fsdp.ShardedTensorIO` reads full (all-expert) values for saving and
checkpoints and writes this process's experts of a full value, and per-tenant optimisers step the
local experts.

The forward of each experts module becomes dispatch → compute → combine. The members of an EP group
are data-parallel ranks: each routes its own tokens, sorts the (token, k) pairs by expert (hence by
the rank holding the expert), and one ``all_to_all_single`` with uneven splits sends each pair's hidden
state, with its local expert index and its tenant's slot, to that rank. Every rank then runs the
grouped expert MLP of :class:`~mlora_lab.lora.experts.MultiLoRAExperts` on what it received (possibly
nothing) and a second ``all_to_all_single`` sends the outputs back, where they are weighted by the
router and summed onto their tokens. Both exchanges are differentiable
(functional collectives, which carry autograd), so backward sends the gradients the other way.

Gradients of a rank's expert tensors thus already hold every EP-group member's tokens. When there are
several EP groups (``dp / ep > 1``: the ``ep_replicate`` dimension), each holds the same experts and
sees other rows: the gradients of the tenants that step are summed over it (the layout's
``reduce_group``), a SUM, because each process's loss is already its share of the tenant's global
token mean.

Attention and the dense parts stay with FSDP2 (:func:`~mlora_lab.parallel.fsdp.apply_fsdp`), which
must leave the expert parameters alone (``ignored_params``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from mlora_lab.lora.experts import PACKED, MultiLoRAExperts
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.parallel.fsdp import SlotLayout


class ExpertParallelLoRAExperts(MultiLoRAExperts):
    """A :class:`MultiLoRAExperts` that holds ``local_experts`` experts from ``first_expert`` on and
    exchanges tokens with the other ranks of its EP group (module docstring). Made by
    :func:`apply_expert_parallel`, which swaps the class of an existing module."""

    ep_group: dist.ProcessGroup
    ep_size: int
    first_expert: int
    local_experts: int

    def slot_tensors(self, name: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        A, B = super().slot_tensors(name, slot)
        # to_local() is differentiable: the local gradient lands in the DTensor's .grad
        return A.to_local(), B.to_local()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        token, expert, weight, slot = self.route(top_k_index, top_k_weights)
        order = torch.argsort(expert, stable=True)  # by expert, hence by destination rank
        token, expert, weight, slot = token[order], expert[order], weight[order], slot[order]
        dest = torch.div(expert, self.local_experts, rounding_mode="floor")
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        # (local expert index on the destination, slot): slots are numbered alike on every rank
        meta = torch.stack([expert - dest * self.local_experts, slot], dim=1)
        meta_in = meta.new_empty(sum(recv), 2)
        dist.all_to_all_single(meta_in, meta, recv, send, group=self.ep_group)
        x = hidden_states[token]
        x_in = all_to_all_single(x, recv, send, self.ep_group)
        y_in = self.compute(x_in, meta_in[:, 0], meta_in[:, 1])
        y = all_to_all_single(y_in, send, recv, self.ep_group)
        y = y * weight[:, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))

    def extra_repr(self) -> str:
        last = self.first_expert + self.local_experts - 1
        return f"experts {self.first_expert}..{last} of {self.num_experts}, ep={self.ep_size}"


def apply_expert_parallel(
    mm: MultiLoRAModel, ep_mesh: DeviceMesh, replicate_group: dist.ProcessGroup | None = None
) -> set[nn.Parameter]:
    """Split every experts module of ``mm`` over the 1-D ``ep_mesh`` in place (module docstring).

    ``replicate_group`` joins the ranks that hold the same experts (one per EP group), over which
    tenants' gradients are summed; ``None`` when there is a single EP group. Returns the base expert
    parameters, which FSDP must ignore. Call before any tenant is added.
    """
    if mm.tenants:
        raise RuntimeError("apply expert parallelism before adding tenants")
    if not mm.experts:
        raise ValueError("expert parallelism needs a model with packed experts wrapped (wrap_experts=True)")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    owned: set[nn.Parameter] = set()
    for name, module in mm.experts.items():
        if module.num_experts % ep:
            raise ValueError(f"{name}: {module.num_experts} experts do not split over ep={ep} ranks")
        n = module.num_experts // ep
        first = rank * n
        with torch.no_grad():
            for attr in PACKED:  # keep only this rank's experts of the frozen base
                full = getattr(module.base_layer, attr)
                local = nn.Parameter(full[first : first + n].clone(), requires_grad=False)
                setattr(module.base_layer, attr, local)
                owned.add(local)
        # tenants' A [E, r, in] and B [E, out, r]: this rank's experts; summed over the EP groups
        layout = SlotLayout(ep_mesh, [Shard(0)], reduce_group=replicate_group)
        module.layouts = {"A": layout, "B": layout}
        module.__class__ = ExpertParallelLoRAExperts
        module.ep_group, module.ep_size = ep_mesh.get_group(), ep
        module.first_expert, module.local_experts = first, n
    return owned
