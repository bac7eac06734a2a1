"""FSDP2 memory and step time: the same multi-tenant job on 1 process and on 2 processes (fsdp=2).

    python benchmarks/fsdp.py            # ~20M-parameter Llama-style model, 4 tenants
    python benchmarks/fsdp.py --quick    # tiny model, smoke test

Each world size runs under real torchrun (gloo on CPU, nccl on GPU). Per rank it reports the bytes
of the frozen base parameters this rank holds (``to_local()`` of every FSDP-sharded base parameter:
exact, not an RSS estimate), the bytes of its adapter slots, its peak RSS, and the median step time.
Goal: base bytes per rank with fsdp=2 ÷ fsdp=1 ≤ 0.55. Step time is reported as measured: on a
2-core CPU two processes share the same two cores, so no speed-up is expected there.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    common.add_worker_args(parser)
    args = parser.parse_args()
    if args.worker:
        common.layout_worker(args.worker, args.out, args.steps)
        return

    work = Path(tempfile.mkdtemp(prefix="mlora_fsdp_bench_"))
    spec_path, n_params, size = common.llama_layout_job(work, args.quick)
    steps = 5 if args.quick else args.steps
    results = {
        n: common.run_layout(__file__, spec_path, {"nproc": n, "fsdp": n}, steps, work) for n in (1, 2)
    }

    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, Llama-style {n_params / 1e6:.1f}M params {size}, "
        "4 tenants (ranks 8-64) x batch 4, seq <= 64"
    )
    print(
        f"{'world':>5} {'rank':>4} {'base MiB/rank':>14} {'slots MiB/rank':>15} {'peak RSS MiB':>13} {'step s':>8}"
    )
    for n, rows in results.items():
        for r in rows:
            print(
                f"{n:>5} {r['rank']:>4} {r['base_bytes'] / 2**20:>14.2f} {r['slot_bytes'] / 2**20:>15.2f} "
                f"{r['peak_rss'] / 2**20:>13.1f} {r['step_time']:>8.3f}"
            )
    base_ratio = max(r["base_bytes"] for r in results[2]) / results[1][0]["base_bytes"]
    slot_ratio = max(r["slot_bytes"] for r in results[2]) / results[1][0]["slot_bytes"]
    time_ratio = max(r["step_time"] for r in results[2]) / results[1][0]["step_time"]
    print(f"base parameter bytes per rank, fsdp=2 / fsdp=1: {base_ratio:.3f} (goal <= 0.55)")
    print(f"adapter slot bytes per rank,   fsdp=2 / fsdp=1: {slot_ratio:.3f}")
    print(f"step time, world 2 / world 1 (same 2 cores):    {time_ratio:.2f}")


if __name__ == "__main__":
    main()
