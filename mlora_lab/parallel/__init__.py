"""Everything that knows about processes and devices lives here (the rest of mlora_lab is plain PyTorch).

``init_distributed()`` reads the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
and picks cuda + nccl when a GPU is present, cpu + gloo otherwise. Without torchrun it describes a
single process and initialises nothing, so the same training code runs in-process (tests, notebooks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

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
