"""MoE tenants: a mixed-tenant step on packed experts vs one PEFT adapter, and expert memory under EP.

    .venv/bin/python benchmarks/moe.py            # full run (~5 min on 2 cores)
    .venv/bin/python benchmarks/moe.py --quick    # smoke test (~1 min)
    .venv/bin/python benchmarks/moe.py --part served   # what a served job's expert slots cost (~1 min)

**Step.** Forward+backward of one batch through a Qwen3-MoE model (8 experts, top-2), LoRA r=16 on
the attention projections and on both packed expert parameters (``target_parameters``):
``MultiLoRAModel`` with 4 tenants, rows split evenly (each routed token gets its own tenant's expert
delta), vs ``peft.get_peft_model(LoraConfig(r, target_modules, target_parameters))`` with one adapter
for every row. Same rows, same loss code, gradients reset as each side's loop does (see
``overhead.py``), timed interleaved in one process. Goal: ``time(mlora, 4 tenants) / time(PEFT) <= 1.15``.

**Memory.** The same multi-tenant job under real torchrun on 2 processes (gloo on CPU, nccl on GPU),
with and without expert parallelism. Per rank it reports the bytes of the expert parameters this rank
holds (the frozen packed base experts and the tenants' expert LoRA slots, local part: exact, not an
RSS estimate), the bytes of everything else, and the median step time. Goal: expert bytes per rank
with ep=2 ÷ ep=1 (same world, same fsdp) <= 0.55.

**Served.** A served job slots every packed expert parameter, so that a Tinker client's ``train_mlp`` adapts
them; clients that adapt attention only then pay for the experts' LoRA wrapper. The step above, with 4
tenants on attention alone, the experts not slotted vs slotted and unused (PEFT on attention as the baseline).
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
from mlora_lab.tiny import EXPERT_TARGETS, build_tiny_model

STEP_GOAL, MEMORY_GOAL = 1.15, 0.55
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FULL = dict(
    size=dict(hidden=256, layers=4, heads=8, kv_heads=4, vocab_size=4096, experts=8),
    rows=16,
    seq=128,
    warmup=1,
    repeats=8,
    steps=8,
)
QUICK = dict(
    size=dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=512, experts=8),
    rows=8,
    seq=32,
    warmup=1,
    repeats=3,
    steps=4,
)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2)]  # (world, fsdp, ep)


# -- memory: one torchrun job per layout -------------------------------------------------------------


def memory(model_dir: str, cfg: dict, work: Path) -> float:
    from mlora_lab.lab.demo import task_rows, write_jsonl
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    tenants = [
        Tenant(name=f"t{i}", data=write_jsonl(work / f"t{i}.jsonl", task_rows(task, 64, seed=i)), rank=r,
               target_modules=ATTENTION, target_parameters=EXPERT_TARGETS, batch_size=4, max_steps=1000)
        for i, (task, r) in enumerate([("reverse", 8), ("upper", 16), ("count", 16), ("reverse", 32)])
    ]  # fmt: skip
    spec = JobSpec(base_model=model_dir, tenants=tenants, seq_len=64, max_tenants=4, max_rank=32)
    spec_path = work / "job.json"
    spec.to_json(spec_path)
    results = {
        (w, f, e): common.run_layout(
            __file__, spec_path, {"nproc": w, "fsdp": f, "ep": e}, cfg["steps"], work
        )
        for w, f, e in LAYOUTS
    }
    print("\n# expert memory per rank: the same 4-tenant job (ranks 8-32, attention + experts) per layout\n")
    table = []
    for (world, fsdp, ep), rows in results.items():
        for r in rows:
            other = r["base_bytes"] + r["slot_bytes"]
            table.append(
                [
                    world,
                    fsdp,
                    ep,
                    r["rank"],
                    common.mib(r["expert_bytes"]),
                    common.mib(other),
                    f"{r['step_time']:.3f}",
                ]
            )
    common.print_table(["world", "fsdp", "ep", "rank", "expert params", "other params", "step s"], table)

    def worst(layout, key="expert_bytes") -> float:
        return max(r[key] for r in results[layout])

    ratio = worst((2, 1, 2)) / worst((2, 1, 1))
    print(
        f"\nRATIO expert bytes per rank, ep=2 / ep=1 (world 2, fsdp 1): {common.verdict(ratio, MEMORY_GOAL)}"
    )
    print(
        f"      ep=2 / one process: {worst((2, 1, 2)) / worst((1, 1, 1)):.3f}; "
        f"fsdp=2 x ep=2 / fsdp=2: {worst((2, 2, 2)) / worst((2, 2, 1)):.3f}"
    )
    step = {k: worst(k, "step_time") for k in results}
    print(
        f"      step time ep=2 / ep=1 (world 2, fsdp 1, same 2 cores): {step[(2, 1, 2)] / step[(2, 1, 1)]:.2f}"
    )
    return ratio


# -- step: in one process ---------------------------------------------------------------------------


def step_time(model_dir: str, cfg: dict, r: int, repeats: int) -> float:
    def load() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    rows, seq = cfg["rows"], cfg["seq"]
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    input_ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    n_tokens = rows * (seq - 1)

    def step(model: torch.nn.Module, segments: list[tuple[str, int, int]]) -> None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        token_loss = causal_lm_token_loss(logits, input_ids)
        total = sum(token_loss[s:e].sum() / n_tokens for _, s, e in segments)
        total.backward()

    reference = peft.get_peft_model(
        load(),
        peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=ATTENTION, target_parameters=EXPERT_TARGETS),
    )
    reference.train()
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    ours = MultiLoRAModel(
        load(), max_tenants=4, max_rank=r, slot_modules=ATTENTION, slot_parameters=EXPERT_TARGETS
    )
    for i in range(4):
        ours.add_tenant(
            f"t{i}", rank=r, alpha=2 * r, target_modules=ATTENTION, target_parameters=EXPERT_TARGETS, seed=i
        )
    ours.train()
    slots = [p for p in ours.parameters() if p.requires_grad]
    per = rows // 4
    four = [(f"t{i}", i * per, (i + 1) * per) for i in range(4)]
    one = [("t0", 0, rows)]

    def prepare_ref() -> None:
        for p in ref_params:
            p.grad = None

    def prepare(segments):
        def fn() -> None:
            for p in slots:
                if p.grad is not None:
                    p.grad.zero_()
            ours.set_segments(segments, rows)

        return fn

    cases = {
        f"PEFT, 1 adapter r={r}": (prepare_ref, lambda: step(reference, [("all", 0, rows)])),
        f"mlora, 4 tenants r={r}": (prepare(four), lambda: step(ours.model, four)),
        f"mlora, 1 tenant r={r} holds all rows": (prepare(one), lambda: step(ours.model, one)),
    }
    times = common.time_interleaved(
        {k: fn for k, (_, fn) in cases.items()},
        warmup=cfg["warmup"],
        repeats=repeats,
        prepare={k: prep for k, (prep, _) in cases.items()},
    )
    wall = {k: common.median([t.wall for t in v]) for k, v in times.items()}
    cpu = {k: common.median([t.cpu for t in v]) for k, v in times.items()}
    base = f"PEFT, 1 adapter r={r}"
    print(
        f"\n# step: forward+backward, {rows} rows x {seq} tokens, LoRA r={r} on {', '.join(ATTENTION)} + experts\n"
    )
    common.print_table(
        [
            "case",
            "wall s (median)",
            "wall min–max",
            "CPU s (median)",
            "others' cores",
            "wall ÷ PEFT",
            "CPU ÷ PEFT",
        ],
        [
            [
                k,
                f"{wall[k]:.3f}",
                common.spread([t.wall for t in times[k]]),
                f"{cpu[k]:.3f}",
                f"{common.median([t.contention for t in times[k]]):.2f}",
                f"{wall[k] / wall[base]:.3f}",
                f"{cpu[k] / cpu[base]:.3f}",
            ]
            for k in cases
        ],
    )
    ratio = wall[f"mlora, 4 tenants r={r}"] / wall[base]
    print(f"\nRATIO 4 tenants / PEFT target_parameters (wall): {common.verdict(ratio, STEP_GOAL)}")
    return ratio


def served_step(model_dir: str, cfg: dict, r: int, repeats: int) -> float:
    """A served job slots every packed expert parameter (a Tinker client's ``train_mlp``): what that costs the
    clients that adapt attention only. 4 tenants on attention, the experts not slotted (as a file-driven job
    whose tenants do not target them) vs slotted and unused (the experts' forward goes through the LoRA
    wrapper's grouped path with no tenant on it), with PEFT on attention as the baseline."""
    rows, seq = cfg["rows"], cfg["seq"]
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    input_ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    per = rows // 4
    four = [(f"t{i}", i * per, (i + 1) * per) for i in range(4)]

    def load() -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def step(model: torch.nn.Module, segments: list[tuple[str, int, int]]) -> None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        token_loss = causal_lm_token_loss(logits, input_ids)
        sum(token_loss[s:e].sum() / token_loss.numel() for _, s, e in segments).backward()

    reference = peft.get_peft_model(load(), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=ATTENTION))
    reference.train()
    models = {}
    for slotted in (False, True):
        model = MultiLoRAModel(
            load(),
            max_tenants=4,
            max_rank=r,
            slot_modules=ATTENTION,
            slot_parameters=EXPERT_TARGETS if slotted else (),
        )
        for i in range(4):
            model.add_tenant(f"t{i}", rank=r, alpha=2 * r, target_modules=ATTENTION, seed=i)
        model.train()
        models[slotted] = model

    def prepare(params: list[torch.Tensor], model: MultiLoRAModel | None):
        def fn() -> None:
            for p in params:
                p.grad = None
            if model is not None:
                model.set_segments(four, rows)

        return fn

    names = {
        "PEFT, attention": (reference, None),
        "mlora, 4 tenants, experts not slotted": (models[False].model, models[False]),
        "mlora, 4 tenants, experts slotted, unused": (models[True].model, models[True]),
    }
    times = common.time_interleaved(
        {
            k: (lambda m=m, seg=(four if w else [("all", 0, rows)]): step(m, seg))
            for k, (m, w) in names.items()
        },
        warmup=cfg["warmup"],
        repeats=repeats,
        prepare={
            k: prepare([p for p in m.parameters() if p.requires_grad], w) for k, (m, w) in names.items()
        },
    )
    wall = {k: common.median([t.wall for t in v]) for k, v in times.items()}
    cpu = {k: common.median([t.cpu for t in v]) for k, v in times.items()}
    print(f"\n# served: experts slotted for train_mlp, used by no tenant ({rows} rows x {seq}, r={r})\n")
    common.print_table(
        ["case", "wall s (median)", "CPU s (median)", "others' cores", "wall ÷ PEFT", "CPU ÷ PEFT"],
        [
            [
                k,
                f"{wall[k]:.3f}",
                f"{cpu[k]:.3f}",
                f"{common.median([t.contention for t in times[k]]):.2f}",
                f"{wall[k] / wall['PEFT, attention']:.3f}",
                f"{cpu[k] / cpu['PEFT, attention']:.3f}",
            ]
            for k in names
        ],
    )
    slotted, plain = "mlora, 4 tenants, experts slotted, unused", "mlora, 4 tenants, experts not slotted"
    ratio = cpu[slotted] / cpu[plain]
    print(
        f"\nRATIO experts slotted and unused / not slotted (CPU): {ratio:.3f} (wall {wall[slotted] / wall[plain]:.3f})"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few repeats (smoke test)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=common.THREADS)
    parser.add_argument("--max-wait", type=float, default=120, help="s to wait for a quiet machine")
    parser.add_argument("--part", choices=["all", "step", "memory", "served"], default="all")
    common.add_worker_args(parser)
    args = parser.parse_args()
    if args.worker:
        common.layout_worker(args.worker, args.out, args.steps)
        return
    cfg = QUICK if args.quick else FULL
    common.setup(args.threads)
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    with tempfile.TemporaryDirectory(prefix="mlora_moe_bench_") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model("qwen3_moe", work / "model", **cfg["size"])
        n_params = transformers.AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()
        print(common.machine_line())
        print(
            f"model: Qwen3-MoE {n_params / 1e6:.1f}M params {cfg['size']}, top-2 routing; other processes "
            f"kept {load_before:.2f} cores busy before the run"
        )
        if args.part in ("all", "step"):
            step_time(model_dir, cfg, args.rank, args.repeats or cfg["repeats"])
        if args.part in ("all", "served"):
            served_step(model_dir, cfg, args.rank, args.repeats or cfg["repeats"])
        if args.part in ("all", "memory"):
            memory(model_dir, cfg, work)


if __name__ == "__main__":
    main()
