"""FSDP2 for a :class:`~mlora_lab.lora.model.MultiLoRAModel`, and sharded slot access.

``apply_fsdp`` calls ``fully_shard`` on every decoder block, then on the root, sharding the frozen
base on dim 0 (FSDP2's default) and the LoRA slots on their *feature* dims:

    lora_A [S, R, in]   Shard(2)        lora_B [S, out, R]   Shard(1)

so every tenant (whatever its slot and rank) is split evenly over the ranks, and a tenant's matrices
``A_t = lora_A[slot, :r]`` / ``B_t = lora_B[slot, :, :r]`` are plain slices of the *local* shard with
the same index. Per-tenant optimisers therefore run on local shards unchanged; only the gradient
norm (for clipping) needs a sum over shards.

Gradients are reduced as a SUM over data-parallel ranks (divide factor 1): each process's loss is
already its share of the tenant's global token mean, ``sum(local token losses) / N_global``.

:class:`ShardedTensorIO` reads and writes full values of slot parts: reads all-gather (so saved
adapters are full tensors whatever the world size), writes keep this rank's chunk of a full value
(never re-sharding an already-local shard).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from mlora_lab.lora.model import MultiLoRAModel, TensorIO


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model (``_no_split_modules`` classes), in order."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def apply_fsdp(
    mm: MultiLoRAModel,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Shard ``mm`` in place with FSDP2 (per block, then the root) and switch it to sharded slot I/O.
    ``ignored_params`` (the experts under expert parallelism) are left as they are."""
    placements: dict[int, Shard] = {}
    for layer in mm.layers.values():
        placements[id(layer.lora_A)] = Shard(2)
        placements[id(layer.lora_B)] = Shard(1)
    for experts in mm.experts.values():  # A [S, E, R, in], B [S, E, out, R]: feature dims again
        for attr in experts.param_names:
            lora_A, lora_B = experts.lora(attr)
            placements[id(lora_A)] = Shard(3)
            placements[id(lora_B)] = Shard(2)

    def place(param: nn.Parameter) -> Shard:
        return placements.get(id(param), Shard(0))

    for block in decoder_blocks(mm.model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=place,
                    ignored_params=ignored_params)  # fmt: skip
    fully_shard(mm.model, mesh=mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=place,
                ignored_params=ignored_params)  # fmt: skip
    for module in mm.model.modules():
        if isinstance(module, FSDPModule):
            # A plain SUM (gloo has no PREMUL_SUM): each process's loss is already its share.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    mm.io = ShardedTensorIO()
    # Every process must produce the same set of gradients for the reduce-scatter, whichever
    # tenants its rows belong to.
    mm.routing.grad_every_slot = True


class ShardedTensorIO(TensorIO):
    """:class:`TensorIO` for DTensor slot tensors (plain tensors pass through)."""

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    @staticmethod
    def _view_layout(param: DTensor, index: tuple) -> tuple[list[Placement], torch.Size]:
        """Placements and global shape of ``param[index]``. The index may take whole slices of a
        sharded dim only, so the view's chunks are the chunks of ``param``."""
        placements: list[Placement] = []
        for p in param.placements:
            if not isinstance(p, Shard | _StridedShard):
                placements.append(p)
                continue
            d = p.dim
            if d < len(index) and index[d] != slice(None):
                raise ValueError(f"cannot index sharded dim {d} of a slot tensor with {index[d]!r}")
            d_view = d - sum(isinstance(i, int) for i in index[:d])
            # FSDP over a tensor-parallel shard of the same dim makes a strided shard
            strided = isinstance(p, _StridedShard)
            placements.append(
                _StridedShard(d_view, split_factor=p.split_factor) if strided else Shard(d_view)
            )
        return placements, torch.empty(param.shape, device="meta")[index].shape

    def gather(self, param: torch.Tensor, index: tuple, local_part: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return super().gather(param, index, local_part)
        placements, shape = self._view_layout(param, index)
        view = DTensor.from_local(
            local_part.detach().contiguous(), param.device_mesh, placements, run_check=False,
            shape=shape, stride=torch.empty(shape, device="meta").stride(),
        )  # fmt: skip
        return view.full_tensor().cpu()

    def copies(self, param: torch.Tensor) -> int:
        if not isinstance(param, DTensor):
            return dist.get_world_size()
        mesh = param.device_mesh
        shards = math.prod(
            mesh.size(d) for d, p in enumerate(param.placements) if isinstance(p, Shard | _StridedShard)
        )
        return dist.get_world_size() // shards

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
