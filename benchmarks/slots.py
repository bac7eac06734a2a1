"""Free adapter slots cost nothing (issue 33): a served job slots every linear layer and the output layer.

    .venv/bin/python benchmarks/slots.py            # full run (~2 min on a quiet 2-core machine)
    .venv/bin/python benchmarks/slots.py --quick    # smoke test (<30 s; numbers mean nothing)

A served job without ``slot_modules`` gives adapter slots to what the Tinker SDK's default client trains:
``["all-linear", <the output layer>]`` (``lm_head`` here). Its clients may train less: this measures what
the slots nobody uses cost a tenant that adapts ``q_proj`` and ``v_proj`` only, against a job whose slots are
exactly those two (the baseline). Both are one :class:`~mlora_lab.job.trainer.Trainer` in this process with
the same tenant (rank 16, its rows, AdamW), stepped in turn (1 warm-up round, median of the repeats; one
step = forward, backward and the optimiser step, as the job runs it). Also shown: the bytes of every LoRA
tensor the model holds (a free slot holds none) and the wrapped layers.

Goal: step time with every layer slotted / with q_proj and v_proj slotted <= 1.02.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer

GOAL = 1.02
FULL = dict(size=common.ModelSize(512, 8, 8, 4, 8192), rows=8, seq=128, warmup=1, repeats=10)
QUICK = dict(size=common.ModelSize(128, 2, 4, 2, 1024), rows=4, seq=32, warmup=1, repeats=3)


def lora_bytes(trainer: Trainer) -> int:
    """Bytes of every LoRA tensor the job's wrapped layers hold (each tenant's, in the layers it targets: a
    free slot, or a layer no tenant targets, holds none)."""
    return sum(
        t.numel() * t.element_size()
        for layer in trainer.engine.model.layers.values()
        for tensors in (layer.lora_A, layer.lora_B)
        for t in tensors.values()
    )


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, few repeats (smoke test)")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    common.setup(args.threads)
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        model_dir = common.build_model(Path(tmp) / "model", cfg["size"])
        n_params = common.n_params(model_dir)
        data = common.write_text_rows(Path(tmp) / "rows.jsonl", 256, seed=0)
        tenant = ml.Tenant(
            name="qv",
            data=data,
            rank=16,
            alpha=32,
            target_modules=["q_proj", "v_proj"],
            batch_size=cfg["rows"],
            max_steps=10**6,
        )
        # (the served default resolves to exactly these on this model: tests/service/test_service_hardening.py)
        jobs = {
            "slots on q_proj, v_proj (baseline)": ["q_proj", "v_proj"],
            "slots on all-linear + lm_head (served default)": ["all-linear", "lm_head"],
        }
        trainers = {
            label: Trainer(
                ml.JobSpec(
                    base_model=model_dir,
                    tenants=[tenant],
                    seq_len=cfg["seq"],
                    max_tenants=8,
                    max_rank=64,
                    slot_modules=slots,
                )
            )
            for label, slots in jobs.items()
        }
        times = common.time_interleaved(
            {k: t.step for k, t in trainers.items()}, warmup=cfg["warmup"], repeats=cfg["repeats"]
        )
        wrapped = {k: len(t.engine.model.layers) for k, t in trainers.items()}
        held = {k: lora_bytes(t) for k, t in trainers.items()}
        adapter = {k: t.engine.model.adapter_bytes("qv") for k, t in trainers.items()}
    load_after = common.others_load()
    base_key, served_key = list(jobs)
    med = {k: common.median([t.wall for t in v]) for k, v in times.items()}
    ratio = med[served_key] / med[base_key]
    print("\n# slots: what free adapter slots cost a tenant that adapts q_proj and v_proj\n")
    print(common.machine_line())
    print(
        f"model: {cfg['size'].describe(n_params)}; {cfg['rows']} rows x {cfg['seq']} tokens a step; torch {torch.__version__}"
    )
    print(f"others' load: {load_before:.2f} cores before, {load_after:.2f} after\n")
    common.print_table(
        [
            "job",
            "wrapped layers",
            "LoRA bytes held",
            "tenant's adapter bytes",
            "step s (median)",
            "spread",
            "cpu s",
        ],
        [
            [
                k,
                wrapped[k],
                f"{held[k]:,}",
                f"{adapter[k]:,}",
                f"{med[k]:.4f}",
                common.spread([t.wall for t in times[k]]),
                f"{common.median([t.cpu for t in times[k]]):.4f}",
            ]
            for k in jobs
        ],
    )
    print(f"\nserved default / baseline = {ratio:.3f} (goal <= {GOAL}): {common.verdict(ratio, GOAL)}")


if __name__ == "__main__":
    main()
