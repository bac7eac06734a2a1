"""Everything that knows about processes, devices, meshes and sharding lives here.

The rest of mlora_lab is plain PyTorch: the LoRA layers and the model wrapper see ordinary modules,
and reach sharded slot tensors only through :class:`~mlora_lab.lora.model.TensorIO`, which this
package implements for DTensors (:mod:`mlora_lab.parallel.fsdp`).

``init_distributed()`` reads the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
and picks cuda + nccl when a GPU is present, cpu + gloo otherwise. Without torchrun it describes a
single process and initialises nothing, so the same training code runs in-process (tests, notebooks).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mlora_lab.quant import is_quantized


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank and its device. In a job with rollout
    ranks (:func:`split_roles`) a trainer's ``world_size`` counts the trainers only and ``group`` is theirs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: dist.ProcessGroup | None = field(default=None, compare=False)
    """The training processes' group (``None``: every process of the job)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 does all run-directory I/O."""
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def pick_device(local_rank: int = 0) -> torch.device:
    """``cuda:<local_rank>`` when a GPU is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600) -> DistInfo:
    """Join the process group torchrun set up (if any) and return this process's :class:`DistInfo`."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=pick_device())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    info = DistInfo(rank, world, local_rank, pick_device(local_rank))
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if not dist.is_initialized():
        dist.init_process_group(backend=info.backend, timeout=timedelta(seconds=timeout_s))
    return info


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` without the interpreter's finalization, once its work is done and its
    process group destroyed: the ``atexit`` handlers run (trackers close their runs), the standard streams are
    flushed, then ``os._exit``. Why: a ``DeviceMesh`` keeps its sub-groups' ProcessGroup objects alive until
    finalization, and gloo's threads destroyed there abort the process ("terminate called without an active
    exception", SIGABRT) after everything went well: 4 of 12 two-process runs of a mesh, all-reduces and
    ``destroy_process_group`` on torch 2.13 (CPU); 0 of 12 without the mesh, 0 of 12 ending this way. A job
    whose rank aborted so read as failed, and a test that ran it failed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def leave_together() -> None:
    """Wait until every process of the job is here (a barrier; nothing when there is one process). Called
    once a job's work is done, before its processes tear their connections down: a process that left right
    after its side of the last collective could close its sockets while another still read that
    collective's last message, and the other then failed ("Connection closed by peer", seen under load)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@dataclass(frozen=True)
class Roles:
    """What each process of a job with ``k`` rollout ranks does: the first ``T = world − k`` train (their own
    group, :attr:`DistInfo.group`; every collective of the training loop stays within it), the last ``k`` hold
    the frozen base and every RL tenant's adapter and sample (:mod:`mlora_lab.job.rollout`). Rank 0 talks to
    rollout rank ``j`` over two groups of the two of them, one per direction (``down[j]``: orders and adapters;
    ``up[j]``: completions), so a send never waits behind a receive."""

    trainers: int
    rollout_ranks: int
    trainer: DistInfo | None  # this process as a trainer (None on a rollout rank)
    rollout_index: int | None  # this rollout rank's index, 0..k-1 (None on a trainer)
    down: list[dist.ProcessGroup | None] = field(default_factory=list, compare=False)
    up: list[dist.ProcessGroup | None] = field(default_factory=list, compare=False)

    def rollout_rank(self, j: int) -> int:
        """The global rank of rollout rank ``j``."""
        return self.trainers + j


def split_roles(info: DistInfo, rollout_ranks: int) -> Roles:
    """Split the job's processes into trainers and ``rollout_ranks`` rollout ranks (see :class:`Roles`). Every
    process calls it, in the same order as everything else that makes groups (``new_group`` is collective)."""
    trainers = info.world_size - rollout_ranks
    if rollout_ranks == 0:
        return Roles(trainers, 0, info, None)
    if trainers < 1:
        raise ValueError(f"{rollout_ranks} rollout ranks leave no trainer among {info.world_size} processes")
    group = dist.new_group(list(range(trainers)))
    down, up = [], []
    for j in range(rollout_ranks):
        down.append(dist.new_group([0, trainers + j]))
        up.append(dist.new_group([0, trainers + j]))
    if info.rank < trainers:
        trainer = dataclasses.replace(info, world_size=trainers, group=group)
        return Roles(trainers, rollout_ranks, trainer, None, down, up)
    return Roles(trainers, rollout_ranks, None, info.rank - trainers, down, up)


@dataclass(frozen=True)
class ParallelDims:
    """How the world is split: ``dp_replicate × fsdp × tp`` processes, and EP groups among them.

    - ``fsdp`` ranks shard the base and the adapter slots (FSDP2) and see different rows;
    - ``dp_replicate`` groups of them hold full replicas (HSDP when ``fsdp > 1``) and see different rows;
    - ``tp`` (tensor parallel) ranks see the same rows and split every projection
      (:mod:`mlora_lab.parallel.tensor`); they are the innermost (fastest-varying) dimension;
    - ``ep`` (expert parallel) borrows from the data-parallel ranks: each run of ``ep`` consecutive
      data-parallel ranks splits the experts among itself (``dp / ep`` such groups hold the same
      experts: the ``ep_replicate`` dimension).
    """

    world_size: int = 1
    fsdp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.world_size % (self.fsdp * self.tp):
            raise ValueError(f"fsdp*tp = {self.fsdp * self.tp} does not divide world size {self.world_size}")
        if self.dp % self.ep:
            raise ValueError(f"ep = {self.ep} does not divide the {self.dp} data-parallel ranks")

    @property
    def dp_replicate(self) -> int:
        return self.world_size // (self.fsdp * self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways each tenant's rows are split."""
        return self.dp_replicate * self.fsdp

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ``("dp_replicate", "dp_shard", "tp")`` mesh over global ranks ``0 … world_size − 1`` (None for a
        single process; a job's rollout ranks, after them, are in none of its groups)."""
        if self.world_size == 1:
            return None
        if self.world_size == dist.get_world_size():
            return init_device_mesh(
                device_type,
                (self.dp_replicate, self.fsdp, self.tp),
                mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
            )
        return DeviceMesh(
            device_type,
            torch.arange(self.world_size).reshape(self.dp_replicate, self.fsdp, self.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )

    def build_ep_mesh(self, device_type: str) -> DeviceMesh | None:
        """The ``("ep_tp", "ep_replicate", "ep")`` mesh over the same ranks (None without EP).

        Global rank ``g = d * tp + t`` is data-parallel rank ``d`` at tensor-parallel index ``t``;
        data-parallel ranks ``d = i * ep + j`` form EP group ``i``, in which ``g`` is member ``j``.
        """
        if self.ep == 1:
            return None
        ranks = torch.arange(self.world_size).reshape(self.dp, self.tp).T
        return DeviceMesh(
            device_type,
            ranks.reshape(self.tp, self.dp // self.ep, self.ep),
            mesh_dim_names=("ep_tp", "ep_replicate", "ep"),
        )


def parallelize(
    mm,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device_type: str,
    dp_group: dist.ProcessGroup | None = None,
) -> None:
    """Lay ``mm`` (a :class:`~mlora_lab.lora.model.MultiLoRAModel`, before any tenant is added) out
    over the processes: projections over TP groups, experts over EP groups, the frozen base with FSDP2
    (2-D with TP: FSDP shards each rank's TP slice over the data-parallel ranks), and the layout of the
    tenants' tensors each layer will make (:class:`~mlora_lab.parallel.fsdp.SlotLayout`): split like
    the layer over TP / EP, held alike by the data-parallel ranks, gradients summed over them."""
    if mesh is None:
        return
    from mlora_lab.parallel.expert import apply_expert_parallel
    from mlora_lab.parallel.fsdp import ShardedTensorIO, SlotLayout, apply_fsdp
    from mlora_lab.parallel.tensor import apply_tensor_parallel

    if dims.tp > 1:
        apply_tensor_parallel(mm, mesh["tp"])

    ignored = set()
    ep_mesh = dims.build_ep_mesh(device_type)
    if ep_mesh is not None:
        replicate = ep_mesh["ep_replicate"].get_group() if dims.dp > dims.ep else None
        ignored = apply_expert_parallel(mm, ep_mesh["ep"], replicate)
    fsdp_mesh = mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    if not is_quantized(mm.model):
        apply_fsdp(mm, fsdp_mesh, ignored_params=ignored)
    # (else data parallel only, which validation allows for a quantized base: every process holds the
    # whole quantized base, as DDP over a QLoRA base does, and FSDP2 has nothing to shard; the tenants'
    # gradients are summed over the data-parallel ranks by their layouts below)

    if dims.dp == 1:
        dp_group = None
    elif dp_group is None:  # the data-parallel ranks (Collectives flattens the same dims)
        dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    for layer in mm.layers.values():  # split by TP or whole; held alike by the data-parallel ranks
        for kind in ("A", "B"):
            layout = layer.layouts[kind] or SlotLayout()
            layer.layouts[kind] = dataclasses.replace(layout, reduce_group=dp_group)
    for experts in mm.experts.values():  # EP set its own group (the ranks holding the same experts)
        for kind in ("A", "B"):
            if experts.layouts[kind] is None:
                experts.layouts[kind] = SlotLayout(reduce_group=dp_group)
    mm.io = ShardedTensorIO(dims.world_size)
    # Every process runs the backward through every block, whichever tenants its rows belong to (or
    # none): FSDP2 all-gathers each block again in the backward and expert parallelism exchanges
    # tokens, collectives that every process must join. The embeddings' output asks for a gradient,
    # so the graph below the first adapted layer is the same everywhere (its cost: the input
    # gradients of the blocks below it).
    mm.model.get_input_embeddings().register_forward_hook(_require_grad)


def _require_grad(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and module.training and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


class Collectives:
    """The few collectives the training loop needs, as no-ops in a single process.

    ``dp_rank``/``dp_size`` say which share of each tenant's rows this process takes;
    ``sum_over_dp`` adds per-process partial sums (losses, token counts); ``sum_over_world`` adds
    partial sums of squares of sharded gradients, each already divided by how many processes hold
    the same shard (:meth:`~mlora_lab.lora.model.TensorIO.copies`), whatever the tensor's mesh.
    """

    def __init__(
        self,
        dims: ParallelDims,
        mesh: DeviceMesh | None,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.dims, self.mesh, self.device = dims, mesh, device
        self.group = group  # "the world": every training process (None: every process of the job)
        if mesh is None:
            self.dp_rank, self.dp_size = 0, 1
            self.dp_group = None
        else:
            dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
            self.dp_rank, self.dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
            self.dp_group = dp_mesh.get_group()

    def sum_over_dp(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over the data-parallel ranks (a float64 copy)."""
        out = values.detach().to(self.device, torch.float64).clone()
        if self.dp_group is not None:
            dist.all_reduce(out, group=self.dp_group)
        return out.cpu()

    def sum_over_world(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over every process (a float64 copy)."""
        out = values.detach().to(self.device, torch.float64).clone()
        if self.mesh is not None:
            dist.all_reduce(out, group=self.group)
        return out.cpu()

    def max_over_world(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``values`` over every process (a float64 copy)."""
        out = values.detach().to(self.device, torch.float64).clone()
        if self.mesh is not None:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out.cpu()

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank."""
        if self.mesh is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_objects(self, obj: object) -> list[object]:
        """``obj`` from every rank (in rank order)."""
        if self.mesh is None:
            return [obj]
        out: list[object] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier(group=self.group)
