"""Run under torchrun (2 or 4 processes): the checks of ``tensor_parallel.py``, ``expert_parallel.py`` and
``sharded_io.py`` in one process group, so that each process imports torch and transformers once.

``python -m torch.distributed.run --nproc-per-node N all_checks.py CHECK...``, each ``CHECK`` one of::

    tp:FSDP:ARCH[,ARCH...]    tensor parallelism, tp = N / FSDP, against one unsplit model
    ep:ARCH[,ARCH...]         expert parallelism (even and skewed routing) against one unsplit model
    io:MODEL_DIR              tenant-tensor I/O under FSDP2 over every process

Each check prints its own line ("tensor parallel ok", "expert parallel ok", "sharded I/O ok") on every
process; the first failed check exits non-zero. tests/parallel/test_distributed.py runs it.
"""

from __future__ import annotations

import sys

import expert_parallel
import sharded_io
import tensor_parallel

from mlora_lab.parallel import exit_process, init_distributed, shutdown_distributed


def main(checks: list[str]) -> None:
    info = init_distributed()
    for check in checks:
        what, _, rest = check.partition(":")
        if what == "tp":
            fsdp, _, archs = rest.partition(":")
            for arch in archs.split(","):
                tensor_parallel.check(arch, int(fsdp), info.rank, info.world_size)
            print("tensor parallel ok", flush=True)
        elif what == "ep":
            for arch in rest.split(","):
                for skewed in (False, True):
                    expert_parallel.check(arch, skewed, info.rank, info.world_size)
            print("expert parallel ok", flush=True)
        elif what == "io":
            sharded_io.check(rest, info.rank, info.world_size)
        else:
            raise SystemExit(f"unknown check {check!r}")
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_process(0)  # (see exit_process: a mesh's groups abort the interpreter's finalization)
