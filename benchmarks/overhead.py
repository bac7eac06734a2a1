"""Mixed-tenant overhead: forward+backward of one batch that mixes 4 tenants vs one plain PEFT adapter.

    .venv/bin/python benchmarks/overhead.py            # full run (~4 min on 2 cores)
    .venv/bin/python benchmarks/overhead.py --quick    # smoke test (<30 s)

Both sides see the same rows (same ``input_ids``, ``attention_mask``, shapes) and compute the same
loss code (``causal_lm_token_loss`` summed per tenant segment, divided by its token count; PEFT has one
segment). The only difference is the LoRA layers: ``MultiLoRAModel`` with 4 tenants of rank r in
``max_tenants=4`` slots (rows split evenly, each row gets its own tenant's delta) vs
``peft.get_peft_model(LoraConfig(r, target_modules))`` (one adapter for every row). Each side's
gradients are reset the way its real training loop does it (PEFT: ``zero_grad(set_to_none=True)``;
mlora_lab: the slot gradients stay allocated and are zeroed in place, as ``TenantOptimizer.zero_grad``
does), outside the timed region.

Goal: ``time(mlora, 4 tenants) / time(PEFT, 1 adapter) <= 1.10``.

Also measured (labelled as such):
- 1 tenant holding every row (the multi-LoRA layer with no segmentation) vs PEFT;
- heterogeneous ranks 4, 8, 16, 32 in ``max_rank=32`` slots vs PEFT rank 16 (about the same LoRA
  FLOPs: mean rank 15) and vs PEFT rank 32 (every row at the largest rank).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import peft
import torch
import transformers

from mlora_lab.lora import MultiLoRAModel
from mlora_lab.memory import causal_lm_token_loss

GOAL = 1.10
FULL = dict(size=common.ModelSize(512, 8, 8, 4, 8192), rows=16, seq=128, warmup=1, repeats=8)
QUICK = dict(size=common.ModelSize(128, 2, 4, 2, 1024), rows=8, seq=32, warmup=1, repeats=3)


def load(model_dir: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def peft_model(model_dir: str, rank: int) -> peft.PeftModel:
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=common.LLAMA_TARGETS, lora_dropout=0.0
    )
    model = peft.get_peft_model(load(model_dir), config)
    model.train()
    return model


def mlora_model(model_dir: str, ranks: list[int], max_rank: int) -> MultiLoRAModel:
    model = MultiLoRAModel(
        load(model_dir), max_tenants=len(ranks), max_rank=max_rank, slot_modules=common.LLAMA_TARGETS
    )
    for i, r in enumerate(ranks):
        model.add_tenant(f"t{i}", rank=r, alpha=2 * r, target_modules=common.LLAMA_TARGETS, seed=i)
    model.train()
    return model


def even_segments(n_tenants: int, rows: int) -> list[tuple[str, int, int]]:
    per = rows // n_tenants
    return [(f"t{i}", i * per, (i + 1) * per if i < n_tenants - 1 else rows) for i in range(n_tenants)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few repeats (smoke test)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=common.THREADS)
    parser.add_argument("--max-wait", type=float, default=120, help="s to wait for a quiet machine")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    repeats = args.repeats or cfg["repeats"]
    common.setup(args.threads)
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    r, rows, seq = args.rank, cfg["rows"], cfg["seq"]

    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        model_dir = common.build_model(Path(tmp) / "model", cfg["size"])
        n_params = common.n_params(model_dir)
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(3, vocab, (rows, seq), generator=g)
        attention_mask = torch.ones_like(input_ids)
        labels = input_ids.clone()
        n_tokens = int((labels[:, 1:] != -100).sum())

        def step(model: torch.nn.Module, segments: list[tuple[str, int, int]]) -> None:
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            token_loss = causal_lm_token_loss(logits, labels)
            total = logits.new_zeros((), dtype=torch.float32)
            for _, start, end in segments:
                total = total + token_loss[start:end].sum() / n_tokens
            total.backward()

        def peft_case(model: peft.PeftModel):
            params = [p for p in model.parameters() if p.requires_grad]

            def prepare() -> None:
                for p in params:
                    p.grad = None

            return prepare, lambda: step(model, [("all", 0, rows)])

        def mlora_case(model: MultiLoRAModel, segments: list[tuple[str, int, int]]):
            slots = [p for p in model.parameters() if p.requires_grad]

            def prepare() -> None:
                for p in slots:
                    if p.grad is not None:
                        p.grad.zero_()
                model.set_segments(segments, rows)

            return prepare, lambda: step(model.model, segments)

        p_r = peft_model(model_dir, r)
        p_max = peft_model(model_dir, 32)
        m_same = mlora_model(model_dir, [r] * 4, max_rank=r)
        m_het = mlora_model(model_dir, [4, 8, 16, 32], max_rank=32)
        cases = {
            f"PEFT, 1 adapter r={r}": peft_case(p_r),
            f"mlora, 4 tenants r={r} (max_rank {r})": mlora_case(m_same, even_segments(4, rows)),
            f"mlora, 1 tenant r={r} holds all rows": mlora_case(m_same, even_segments(1, rows)),
            "mlora, 4 tenants r=4/8/16/32 (max_rank 32)": mlora_case(m_het, even_segments(4, rows)),
            "PEFT, 1 adapter r=32": peft_case(p_max),
        }
        times = common.time_interleaved(
            {k: fn for k, (_, fn) in cases.items()},
            warmup=cfg["warmup"],
            repeats=repeats,
            prepare={k: prep for k, (prep, _) in cases.items()},
        )

    wall = {k: [t.wall for t in v] for k, v in times.items()}
    cpu = {k: [t.cpu for t in v] for k, v in times.items()}
    med_w = {k: common.median(v) for k, v in wall.items()}
    med_c = {k: common.median(v) for k, v in cpu.items()}
    base_key, base32_key = f"PEFT, 1 adapter r={r}", "PEFT, 1 adapter r=32"
    same_key, het_key = f"mlora, 4 tenants r={r} (max_rank {r})", "mlora, 4 tenants r=4/8/16/32 (max_rank 32)"
    print("\n# overhead: forward+backward of one mixed-tenant batch vs one PEFT adapter\n")
    print(common.machine_line())
    print(f"model: {cfg['size'].describe(n_params)}")
    print(
        f"batch: {rows} rows x {seq} tokens (no padding), LoRA on {', '.join(common.LLAMA_TARGETS)}, "
        f"alpha = 2r, fp32; {cfg['warmup']} warm-up rounds, median of {repeats} interleaved repeats"
    )
    print(
        f"other processes kept {load_before:.2f} cores busy before the run (median during each case: column "
        "'others' cores'; above ~1 they compete with this 1-thread benchmark and wall times are noise)\n"
    )
    mins = {k: min(v) for k, v in wall.items()}
    table = []
    for k in times:
        table.append(
            [
                k,
                f"{med_w[k]:.3f}",
                common.spread(wall[k]),
                f"{med_c[k]:.3f}",
                f"{common.median([t.contention for t in times[k]]):.2f}",
                f"{med_w[k] / med_w[base_key]:.3f}",
                f"{mins[k] / mins[base_key]:.3f}",
                f"{med_c[k] / med_c[base_key]:.3f}",
                f"{med_w[k] / med_w[base32_key]:.3f}",
            ]
        )
    common.print_table(
        [
            "case",
            "wall s (median)",
            "wall min–max",
            "CPU s (median)",
            "others' cores",
            f"wall ÷ PEFT r={r}",
            f"min wall ÷ PEFT r={r}",
            f"CPU ÷ PEFT r={r}",
            "wall ÷ PEFT r=32",
        ],
        table,
    )
    ratio = med_w[same_key] / med_w[base_key]
    print(f"\nRATIO 4 tenants r={r} / PEFT r={r} (wall): {common.verdict(ratio, GOAL)}")
    print(
        f"      same ratio on CPU time: {med_c[same_key] / med_c[base_key]:.3f}, "
        f"on the fastest repeat: {mins[same_key] / mins[base_key]:.3f}"
    )
    print(
        f"ratio heterogeneous r=4/8/16/32 / PEFT r={r} (same mean rank): {med_w[het_key] / med_w[base_key]:.3f}"
    )
    print(
        f"ratio heterogeneous r=4/8/16/32 / PEFT r=32 (largest rank):  {med_w[het_key] / med_w[base32_key]:.3f}"
    )


if __name__ == "__main__":
    main()
