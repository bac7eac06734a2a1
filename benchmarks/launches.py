"""Kernels a training step launches: aten ops per step with 1, 4 and 16 tenants (issue 35's launch count).

    .venv/bin/python benchmarks/launches.py            # full run (~1 min)
    .venv/bin/python benchmarks/launches.py --quick    # smoke test (fewer tenant counts)

On a GPU every aten op of a step that computes is a kernel launch, so a step of many small tenants is
bound by launches when their count grows with the tenants. This counts them on the CPU, where the count is
the same: every aten op one ``Trainer.step()`` dispatches (forward, backward, clipping, AdamW, schedule),
through a ``TorchDispatchMode`` (below autograd: what the device runs), after one warm-up step. The job is
what issue 35 measured from outside: a tiny Qwen2 (every linear layer adapted), 16 rows of 32 tokens a step
shared by the tenants, ranks 4, 8, 16, 32 in turn.

Three ways of computing the LoRA deltas (``mlora_lab.lora.grouped``), each in the same run:

- grouped, padded buckets: what a GPU runs (ranks up to 64 share one bucket per layer);
- grouped, exact-rank buckets: what the CPU runs (one bucket per distinct rank: here 4);
- per segment: the previous path (two matmuls per tenant and layer forward, four backward), the baseline.

Columns: every aten op; those among them that launch a kernel (views, ``detach``, ``alias`` and the like
only make new tensor metadata); the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
``_grouped_mm``); host reads of a tensor's value (``_local_scalar_dense``: a device sync on a GPU); and the
step's wall time on this machine (which the CPU does not make launch-bound: read the counts).

Goal (issue 35): aten ops per step, 16 tenants ÷ 1 tenant ≤ 1.5 (grouped, padded buckets).
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
from mlora_lab.lora.grouped import rank_padding
from mlora_lab.lora.layer import per_segment
from mlora_lab.tiny import build_tiny_model

GOAL = 1.5
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear")
TOTAL_ROWS, SEQ = 16, 32
RANKS = (4, 8, 16, 32)


METADATA = {"detach", "alias", "lift_fresh", "_local_scalar_dense"}  # (no kernel: metadata or a host read)
PATHS = {
    "grouped, padded": lambda: rank_padding(True),
    "grouped, exact ranks": lambda: rank_padding(False),
    "per segment (before)": per_segment,
}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active, by name (``aten.mm.default`` -> ``mm``), and
    those that launch a kernel (not a view, not in :data:`METADATA`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.ops[name] += 1
        self.kernels += not (func.is_view or name in METADATA)
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


def count(model_dir: str, data: str, tenants: int) -> dict:
    """One measured ``Trainer.step()`` of a job of ``tenants`` tenants (after a warm-up step)."""
    trainer = job(model_dir, data, tenants)
    trainer.step()  # (warm-up: lazily made state, the first optimiser step, the grouping's index cache)
    counter = OpCounter()
    t0 = time.perf_counter()
    with counter:
        trainer.step()
    wall = time.perf_counter() - t0
    ops = counter.ops
    return dict(
        ops=sum(ops.values()),
        kernels=counter.kernels,
        matmuls=sum(ops[m] for m in MATMULS),
        syncs=ops["_local_scalar_dense"],
        wall=wall,
        top=ops.most_common(5),
    )


def main() -> None:
    parser = common.bench_parser(__doc__, "1 and 4 tenants only (smoke test)")
    args = parser.parse_args()
    common.setup(args.threads)
    counts = (1, 4) if args.quick else (1, 4, 16)
    results: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        model_dir = build_tiny_model("qwen2", Path(tmp) / "model")
        data = common.write_text_rows(Path(tmp) / "rows.jsonl", 64, seed=0)
        for path, context in PATHS.items():
            with context():
                results[path] = {k: count(model_dir, data, k) for k in counts}
    print("\n# launches: aten ops of one training step (forward, backward, optimiser)\n")
    print(common.machine_line())
    print(f"tiny qwen2, every linear layer, {TOTAL_ROWS} rows x {SEQ} tokens a step, ranks {RANKS} in turn\n")
    rows = []
    for path, by_k in results.items():
        one = by_k[1]
        for k, r in by_k.items():
            rows.append(
                [
                    path,
                    k,
                    f"{r['ops']:,}",
                    f"{r['ops'] / one['ops']:.2f}",
                    f"{r['kernels']:,}",
                    f"{r['kernels'] / one['kernels']:.2f}",
                    f"{r['matmuls']:,}",
                    r["syncs"],
                    f"{r['wall']:.3f}",
                    ", ".join(f"{name} {c}" for name, c in r["top"]),
                ]
            )
    common.print_table(
        ["LoRA path", "tenants", "aten ops", "÷ 1 tenant", "kernels", "÷ 1 tenant", "matmuls", "host reads",
         "step s (CPU)", "most frequent"],
        rows,
    )  # fmt: skip
    last = max(counts)
    padded, before = results["grouped, padded"], results["per segment (before)"]
    ratio = padded[last]["ops"] / padded[1]["ops"]
    print(f"\nbefore: aten ops, {last} tenants / 1 = {before[last]['ops'] / before[1]['ops']:.2f}")
    print(
        f"aten ops, {last} tenants / 1 (grouped, padded) = {ratio:.2f} (goal <= {GOAL}): {common.verdict(ratio, GOAL)}"
    )


if __name__ == "__main__":
    main()
