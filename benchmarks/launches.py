"""Kernels a training step launches: aten ops per step with 1, 4 and 16 tenants (issue 35's launch count).

    .venv/bin/python benchmarks/launches.py            # full run (~1 min)
    .venv/bin/python benchmarks/launches.py --quick    # smoke test (fewer tenant counts)

On a GPU every aten op of a step is (at least) one kernel launch, so a step of many small tenants is bound
by launches when their count grows with the tenants. This counts them on the CPU, where the count is the
same: every aten op one ``Trainer.step()`` dispatches (forward, backward, clipping, AdamW, schedule),
through a ``TorchDispatchMode`` (below autograd: what the device runs), after one warm-up step. The job is
what issue 35 measured from outside: a tiny Qwen2 (every linear layer adapted), 16 rows of 32 tokens a step
shared by the tenants, ranks 4, 8, 16, 32 in turn. Also shown: the matrix products among them (``mm``,
``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``) and the step's wall time on this machine (which the CPU
does not make launch-bound: read the counts).

Goal (issue 35): aten ops per step, 16 tenants ÷ 1 tenant ≤ 1.5.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from torch.utils._python_dispatch import TorchDispatchMode

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.tiny import build_tiny_model

GOAL = 1.5
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear")
TOTAL_ROWS, SEQ = 16, 32
RANKS = (4, 8, 16, 32)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, by name (``aten.mm.default`` -> ``mm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def job(model_dir: str, data: str, tenants: int) -> Trainer:
    """``tenants`` tenants sharing :data:`TOTAL_ROWS` rows a step, every linear layer, mixed ranks."""
    rows = TOTAL_ROWS // tenants
    spec = ml.JobSpec(
        base_model=model_dir,
        tenants=[
            ml.Tenant(
                name=f"t{i}",
                data=data,
                rank=RANKS[i % len(RANKS)],
                alpha=16,
                target_modules=["all-linear"],
                batch_size=rows,
                max_steps=10**6,
                seed=i,
            )
            for i in range(tenants)
        ],
        seq_len=SEQ,
        max_tenants=16,
        max_rank=max(RANKS),
    )
    return Trainer(spec)


def main() -> None:
    parser = common.bench_parser(__doc__, "1 and 4 tenants only (smoke test)")
    args = parser.parse_args()
    common.setup(args.threads)
    counts = (1, 4) if args.quick else (1, 4, 16)
    results = {}
    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        model_dir = build_tiny_model("qwen2", Path(tmp) / "model")
        data = common.write_text_rows(Path(tmp) / "rows.jsonl", 64, seed=0)
        for k in counts:
            trainer = job(model_dir, data, k)
            trainer.step()  # (warm-up: lazily made state, the first optimiser step)
            counter = OpCounter()
            t0 = time.perf_counter()
            with counter:
                trainer.step()
            wall = time.perf_counter() - t0
            ops = counter.ops
            results[k] = (sum(ops.values()), sum(ops[m] for m in MATMULS), wall, ops.most_common(6))
    base_ops, base_mm = results[1][0], results[1][1]
    print("\n# launches: aten ops of one training step (forward, backward, optimiser)\n")
    print(common.machine_line())
    print(f"tiny qwen2, every linear layer, {TOTAL_ROWS} rows x {SEQ} tokens a step, ranks {RANKS} in turn\n")
    common.print_table(
        ["tenants", "aten ops", "÷ 1 tenant", "matmuls", "÷ 1 tenant", "step s (CPU)", "most frequent"],
        [
            [
                k,
                f"{n:,}",
                f"{n / base_ops:.2f}",
                f"{mm:,}",
                f"{mm / base_mm:.2f}",
                f"{wall:.3f}",
                ", ".join(f"{name} {c}" for name, c in top),
            ]
            for k, (n, mm, wall, top) in results.items()
        ],
    )
    last = max(results)
    ratio = results[last][0] / base_ops
    print(f"\naten ops, {last} tenants / 1 = {ratio:.2f} (goal <= {GOAL}): {common.verdict(ratio, GOAL)}")


if __name__ == "__main__":
    main()
