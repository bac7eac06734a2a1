"""FSDP2 for the frozen base of a :class:`~mlora_lab.lora.model.MultiLoRAModel`, and how tenants'
tensors are laid out over processes (:class:`SlotLayout`, :class:`ShardedTensorIO`).

``apply_fsdp`` calls ``fully_shard`` on every decoder block, then on the root, sharding the frozen
base on dim 0 (FSDP2's default). Tenants' tensors are not FSDP's: they come and go while the job runs
(FSDP2 fixes its parameters when it wraps a module) and each exists at its tenant's own rank. They are
made per tenant, as its layer's :class:`SlotLayout` says:

- split over a tensor- or expert-parallel group where the layer is (a DTensor on that mesh:
  ``A`` replicated and ``B`` split by output rows in a colwise layer, and so on), whole otherwise;
- held alike by the data-parallel ranks, which see different rows: after the backward, the gradients
  of the tenants that step are summed over them (``reduce_group``), one flat bucket per group, as a
  SUM (each process's loss is already its share of the tenant's global token mean,
  ``sum(local token losses) / N_global``). Only tenants in the step take part: a tenant that is
  paused, finished or mid-window costs no communication.

:class:`ShardedTensorIO` makes tenants' tensors and reads and writes their full values: reads
all-gather over the split (so saved adapters are full tensors whatever the layout), writes keep this
rank's part of a full value (never re-splitting an already-local part).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from mlora_lab.lora.model import MultiLoRAModel, TensorIO
from mlora_lab.memory import decoder_blocks


@dataclass
class SlotLayout:
    """How one layer's tenant factor (``A`` or ``B``) is laid out: a DTensor on ``mesh`` with
    ``placements`` (whole on this process when ``mesh`` is None), and the group of processes that hold
    the same part and see other rows (gradients are summed over it; None: no such processes)."""

    mesh: DeviceMesh | None = None
    placements: Sequence[Placement] = field(default_factory=tuple)
    reduce_group: dist.ProcessGroup | None = None


def apply_fsdp(
    mm: MultiLoRAModel,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Shard the frozen base of ``mm`` in place with FSDP2 (per block, then the root).
    ``ignored_params`` (the experts under expert parallelism) are left as they are."""
    # Every parameter computes in its own dtype: the frozen base in the job's ``dtype`` (bf16 is the
    # recommendation on GPUs); tenants' tensors are not FSDP's and compute in fp32, as PEFT's adapters
    # do over a bf16 base. Should a base parameter ever carry a gradient, it is reduced in fp32.
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for block in decoder_blocks(mm.model):
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
            mp_policy=policy,
        )
    # The root (embeddings, final norm, output layer) stays unsharded from its forward to the end of
    # the backward: the chunked loss (mlora_lab.memory) calls the output layer after the forward and
    # again in the backward, and the backward would all-gather it again at once anyway.
    fully_shard(
        mm.model, mesh=mesh, reshard_after_forward=False, ignored_params=ignored_params, mp_policy=policy
    )
    for module in mm.model.modules():
        if isinstance(module, FSDPModule):
            # A plain SUM (gloo has no PREMUL_SUM): each process's loss is already its share.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


class ShardedTensorIO(TensorIO):
    """:class:`TensorIO` for tenants' tensors laid out by :class:`SlotLayout` (the layout is kept on
    each tensor it makes, as ``slot_layout``), over ``world`` training processes (a job's rollout ranks hold
    no shard: :func:`~mlora_lab.parallel.split_roles`)."""

    def __init__(self, world: int | None = None) -> None:
        self.world = world

    def new(self, layout: object, full: torch.Tensor) -> torch.Tensor:
        layout = layout if isinstance(layout, SlotLayout) else SlotLayout()
        if layout.mesh is None:
            t = full.detach().clone()
        else:  # every process holds the same full value (same seed): keep this rank's part of it
            t = distribute_tensor(full.detach(), layout.mesh, list(layout.placements), src_data_rank=None)
        t.requires_grad_(True)
        t.slot_layout = layout
        return t

    reduces = True

    def new_many(self, parts: Sequence[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
        return [self.new(layout, full) for layout, full in parts]  # (each its own layout)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """One flat all-reduce (SUM) per reduce group, over the local gradients of ``params`` (zeros
        where a process made none: its rows had no token of that tenant)."""
        by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
        for p in params:
            # A part that saw no token of its tenant here (an expert no token was routed to) has a
            # zero gradient, as it would in one process, where it is part of a tensor that has one.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            group = getattr(p, "slot_layout", SlotLayout()).reduce_group
            if group is not None:
                by_group.setdefault(group, []).append(self.local(p.grad))
        for group, grads in by_group.items():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def grad_sum(self, param: torch.Tensor) -> torch.Tensor:
        local = (
            self.local(param.grad) if param.grad is not None else torch.zeros_like(self.local(param.detach()))
        )
        out = local.detach().clone()
        group = getattr(param, "slot_layout", SlotLayout()).reduce_group
        if group is not None:
            dist.all_reduce(out, group=group)
        return out

    def first_copy(self, param: torch.Tensor) -> bool:
        group = getattr(param, "slot_layout", SlotLayout()).reduce_group
        return group is None or dist.get_rank(group) == 0

    @staticmethod
    def _view_layout(param: DTensor, index: tuple) -> tuple[list[Placement], torch.Size]:
        """Placements and global shape of ``param[index]``. The index may take whole slices of a
        split dim only, so the view's chunks are the chunks of ``param``."""
        placements: list[Placement] = []
        for p in param.placements:
            if not isinstance(p, Shard):
                placements.append(p)
                continue
            d = p.dim
            if d < len(index) and index[d] != slice(None):
                raise ValueError(f"cannot index split dim {d} of a tenant tensor with {index[d]!r}")
            placements.append(Shard(d - sum(isinstance(i, int) for i in index[:d])))
        return placements, torch.empty(param.shape, device="meta")[index].shape

    def gather(self, param: torch.Tensor, index: tuple, local_part: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return super().gather(param, index, local_part)
        placements, shape = self._view_layout(param, index)
        view = DTensor.from_local(
            local_part.detach().contiguous(),
            param.device_mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )
        return view.full_tensor().cpu()

    def copies(self, param: torch.Tensor) -> int:
        world = self.world if self.world is not None else dist.get_world_size()
        if not isinstance(param, DTensor):
            return world
        mesh = param.device_mesh
        shards = math.prod(mesh.size(d) for d, p in enumerate(param.placements) if isinstance(p, Shard))
        return world // shards

    def scatter(self, param: torch.Tensor, index: tuple, full: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return full
        placements, shape = self._view_layout(param, index)
        if tuple(full.shape) != tuple(shape):  # a local shard passed as if it were whole
            raise ValueError(f"expected the full value of shape {tuple(shape)}, got {tuple(full.shape)}")
        local = distribute_tensor(
            full.to(param.device_mesh.device_type), param.device_mesh, placements, src_data_rank=None
        )
        return local.to_local()
