"""Tensor parallelism: base memory per rank and step time of the same job with tp = 1, 2 (and fsdp).

    .venv/bin/python benchmarks/tp.py            # ~20M-parameter Llama-style model, ~3 min
    .venv/bin/python benchmarks/tp.py --quick    # tiny model, smoke test

Each layout runs the same 4-tenant job under real torchrun (gloo on CPU, nccl on GPU). Per rank it
reports the bytes of the frozen base parameters the rank holds (its TP slice of every projection, of
the vocabulary-split embedding and of ``lm_head``, further split by FSDP where fsdp > 1: exact
``to_local()`` bytes, not an RSS estimate), of its adapter slots, its peak RSS and its median step time.
Goal: base bytes per rank with tp=2 ÷ tp=1 ≤ 0.55. Step times are as measured: on a 2-core CPU the
processes share the same two cores, and TP adds two all-reduces per block over gloo.
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

GOAL = 0.55
LAYOUTS = [dict(nproc=1), dict(nproc=2, fsdp=1, tp=2), dict(nproc=2, fsdp=2), dict(nproc=4, fsdp=2, tp=2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    common.add_worker_args(parser)
    args = parser.parse_args()
    if args.worker:
        common.layout_worker(args.worker, args.out, args.steps)
        return

    common.setup()
    work = Path(tempfile.mkdtemp(prefix="mlora_tp_bench_"))
    spec_path, n_params, size = common.llama_layout_job(work, args.quick)
    steps = 5 if args.quick else args.steps
    results = [(layout, common.run_layout(__file__, spec_path, layout, steps, work)) for layout in LAYOUTS]

    print(common.machine_line())
    print(
        f"model: Llama-style {n_params / 1e6:.1f}M params {size}; 4 tenants (ranks 8-64) on all seven "
        "projections, batch 4 each, seq <= 64"
    )
    table = []
    for layout, rows in results:
        for r in rows:
            table.append(
                [
                    layout["nproc"],
                    layout.get("fsdp", 1),
                    layout.get("tp", 1),
                    r["rank"],
                    common.mib(r["base_bytes"]),
                    common.mib(r["slot_bytes"]),
                    common.mib(r["peak_rss"]),
                    f"{r['step_time']:.3f}",
                ]
            )
    common.print_table(
        ["world", "fsdp", "tp", "rank", "base / rank", "slots / rank", "peak RSS", "step s"], table
    )

    def worst(i: int, key: str) -> float:
        return max(r[key] for r in results[i][1])

    ratio = worst(1, "base_bytes") / worst(0, "base_bytes")
    print(f"\nRATIO base parameter bytes per rank, tp=2 / tp=1: {common.verdict(ratio, GOAL)}")
    print(
        f"      adapter slot bytes per rank, tp=2 / tp=1: {worst(1, 'slot_bytes') / worst(0, 'slot_bytes'):.3f}"
    )
    print(
        f"      base bytes per rank, fsdp=2 x tp=2 (4 processes) / one process: "
        f"{worst(3, 'base_bytes') / worst(0, 'base_bytes'):.3f}"
    )
    print(
        f"      step time tp=2 / one process: {worst(1, 'step_time') / worst(0, 'step_time'):.2f}; "
        f"fsdp=2 / one process: {worst(2, 'step_time') / worst(0, 'step_time'):.2f} "
        f"(same {os.cpu_count()} cores, torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
