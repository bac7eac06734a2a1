"""Search: a 16-trial ASHA search in one mlora_lab job vs the same trials as PEFT processes, back to back.

    .venv/bin/python benchmarks/search.py            # full run (~5 min on 2 cores)
    .venv/bin/python benchmarks/search.py --quick    # smoke test (~1 min)

- mlora: ``ml.sweep(spec, space, ml.ASHA(n=16, min_steps, eta), budget)`` launched as a user launches it
  (validation, torchrun, imports, model load: all paid once) with 4 tenant slots; timed from the call to
  the end of the job, in this process.
- PEFT: the same 16 configurations (lr, rank, target modules) with the *same pruning decisions*: each
  trial is one process (``get_peft_model`` + ``torch.optim.AdamW`` + clipping, the loop of
  ``mlora_lab.reference.train_peft``) that trains exactly the steps the ASHA job gave that trial (its
  last rung), on the same rows in the same order, and saves its adapter; the processes run one after
  another and their wall times (interpreter start-up included) are summed. This favours PEFT: a real
  ASHA over processes pays one more process start and checkpoint load per promotion.

Both sides train on the train loss (no eval set), fp32, one thread per process. Trials per hour = 16 /
wall time; the goal is ``mlora trials/hour ÷ PEFT trials/hour >= 1.5``. Between two trials the job's
device is never idle by construction: a pruned trial's slot is refilled at the same step boundary, in
the same process, with the model already loaded (PEFT: a process start, imports and a model load).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GOAL = 1.5
FULL = dict(
    size=common.ModelSize(256, 4, 4, 2, 2048), seq=64, batch_size=4, n=16, min_steps=10, eta=3, budget=90
)
QUICK = dict(
    size=common.ModelSize(128, 2, 4, 2, 1024), seq=32, batch_size=2, n=16, min_steps=2, eta=3, budget=18
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def space():
    import mlora_lab as ml

    return {
        "lr": ml.loguniform(1e-4, 1e-2),
        "rank": ml.choice(4, 8, 16),
        "target_modules": ml.choice(["q_proj", "v_proj"], ATTENTION, common.LLAMA_TARGETS),
    }


def worker_peft(p: dict) -> dict:
    """One trial as its own PEFT training: ``steps`` steps of the trial's configuration."""
    import peft
    import torch
    import transformers

    from mlora_lab.data import TenantStream, collate, load_examples

    t0 = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(p["model"])
    stream = TenantStream(load_examples(p["data"], tok, p["seq"]), seed=p["seed"], shuffle=True)
    torch.manual_seed(p["seed"])
    base = transformers.AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.float32)
    c = p["config"]
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=c["rank"], lora_alpha=2 * c["rank"], target_modules=c["target_modules"], lora_dropout=0.0
        ),
    )
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=c["lr"], foreach=False)
    t_loaded = time.perf_counter()
    for _ in range(p["steps"]):
        batch = collate([("t", stream.take(p["batch_size"]))], tok.pad_token_id)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    model.save_pretrained(p["out"])
    return dict(job_s=time.perf_counter() - t0, setup_s=t_loaded - t0)


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, short rungs (smoke test)")
    args = parser.parse_args()
    if args.worker:
        p = json.loads(args.worker)
        common.setup(p["threads"])
        common.report_to_parent(worker_peft(p))
        return
    cfg = QUICK if args.quick else FULL
    common.setup(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the job's processes: one thread, as PEFT's
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    import mlora_lab as ml

    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        model_dir = common.build_model(Path(tmp) / "model", cfg["size"])
        data = common.write_text_rows(Path(tmp) / "train.jsonl", 256, seed=0)
        tenant = ml.Tenant(
            name="base",
            data=data,
            rank=8,
            target_modules=ATTENTION,
            batch_size=cfg["batch_size"],
            max_steps=cfg["budget"],
            seed=0,
        )
        spec = ml.JobSpec(
            base_model=model_dir,
            tenants=[tenant],
            seq_len=cfg["seq"],
            max_tenants=4,
            max_rank=16,
            log_every=1,
        )
        strategy = ml.ASHA(n=cfg["n"], min_steps=cfg["min_steps"], eta=cfg["eta"])
        t0 = time.perf_counter()
        run = ml.sweep(
            spec,
            space(),
            strategy,
            budget=cfg["budget"],
            objective="train_loss",
            seed=0,
            workdir=Path(tmp) / "runs",
        )
        state = run.wait(3600)
        mlora_s = time.perf_counter() - t0
        if state != "finished":
            raise SystemExit(f"the sweep ended {state}: {run.error}\n{run.logs(0)}")
        trials = run.search.trials
        steps = {t.id: max(t.results) for t in trials}
        peft_runs = [
            common.run_child(__file__, dict(
                model=model_dir, data=data, seq=cfg["seq"], batch_size=cfg["batch_size"], steps=steps[t.id],
                seed=t.id, config=t.config, out=str(Path(tmp) / "peft" / f"trial-{t.id:03d}"), threads=args.threads,
            ), timeout=3600)
            for t in trials
        ]  # fmt: skip
        peft_s = sum(r.process_wall_s for r in peft_runs)
        peft_setup = sum(r.result["setup_s"] for r in peft_runs) + sum(
            r.process_wall_s - r.result["job_s"] for r in peft_runs
        )
        n_params = common.n_params(model_dir)
        rungs = run.search.rungs

    print(common.machine_line())
    print(
        f"model: {cfg['size'].describe(n_params)}; seq {cfg['seq']}, batch {cfg['batch_size']} rows per trial step"
    )
    print(
        f"ASHA: {cfg['n']} trials, rungs {rungs} steps (eta {cfg['eta']}), 4 slots; machine load before: {load_before:.2f}"
    )
    trained = sum(steps.values())
    print(
        f"trial steps trained (both sides): {trained}; trials reaching each rung: "
        f"{[sum(1 for s in steps.values() if s >= r) for r in rungs]}"
    )
    common.print_table(
        ["", "mlora (one job)", "PEFT (16 processes)"],
        [
            ["wall time", f"{mlora_s:.1f} s", f"{peft_s:.1f} s"],
            ["trials per hour", f"{cfg['n'] * 3600 / mlora_s:.0f}", f"{cfg['n'] * 3600 / peft_s:.0f}"],
            ["process starts + imports + model loads", "1", f"{len(peft_runs)} ({peft_setup:.1f} s in all)"],
            [
                "device idle between trials",
                "0 s (a slot is refilled at the same step boundary)",
                f"{peft_setup:.1f} s",
            ],
        ],
    )
    ratio = peft_s / mlora_s
    print(
        f"\ntrials/hour ratio (mlora / PEFT): {ratio:.2f} (goal >= {GOAL}: {'MET' if ratio >= GOAL else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
