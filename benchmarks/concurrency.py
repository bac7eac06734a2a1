"""Concurrency: one mlora_lab job training 4 tenants vs the same 4 trainings run one after another with PEFT.

    .venv/bin/python benchmarks/concurrency.py            # full run (~4 min on 2 cores)
    .venv/bin/python benchmarks/concurrency.py --quick    # smoke test (<30 s)

Each training is its own process (``python benchmarks/concurrency.py --worker ...``), so that its peak
memory (``ru_maxrss``) is its own:

- mlora: one in-process job, ``Trainer(JobSpec(4 tenants), run_dir=None).train()``: tokenizer and data
  loading, model load + wrap, ``steps`` global steps in which every tenant trains ``batch_size`` rows;
- PEFT: 4 processes one after another, each the loop of ``mlora_lab.reference.train_peft`` (the
  textbook ``get_peft_model`` + ``torch.optim.AdamW`` + clipping loop, inlined to time its parts):
  tokenizer and data loading, model load, ``steps`` steps of ``batch_size`` rows.

Both sides see the same rows in the same order (the PEFT side draws them from the same seeded
``TenantStream``; the step-1 losses, taken while B = 0, are compared as a check), the same rank, alpha,
targets, lr, clipping (1.0) and fp32. The job time of a process is measured inside it, from before the
tokenizer is loaded to the end of training (interpreter start-up and ``import torch`` excluded, which
is conservative: every extra PEFT process pays them too); the process wall time, start-up included,
is reported beside it.

Goals: ``time(mlora job) / sum(time(4 PEFT jobs)) <= 0.9`` and
``peak RSS(mlora job) / peak RSS(one PEFT job) <= 1.25`` (4 PEFT processes side by side need ~4x).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TIME_GOAL = 0.9
MEM_GOAL = 1.25
FULL = dict(
    size=common.ModelSize(384, 6, 8, 4, 4096), tenants=4, batch_size=4, seq=128, steps=8, rank=16, repeats=3
)
# --quick trains 2 tenants (3 processes instead of 5) to stay a smoke test
QUICK = dict(
    size=common.ModelSize(128, 2, 4, 2, 1024), tenants=2, batch_size=2, seq=32, steps=3, rank=8, repeats=1
)
LR = 1e-4


# -- workers (run in their own process) ------------------------------------------------------------


def worker_mlora(p: dict) -> dict:
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    rss_imported = common.rss_bytes()
    b0, c0, t0 = common.machine_busy_seconds(), time.process_time(), time.perf_counter()
    tenants = [
        Tenant(
            name=f"t{i}",
            data=path,
            rank=p["rank"],
            alpha=2 * p["rank"],
            target_modules=common.LLAMA_TARGETS,
            lr=LR,
            max_grad_norm=1.0,
            batch_size=p["batch_size"],
            max_steps=p["steps"],
            seed=i,
        )
        for i, path in enumerate(p["data"])
    ]
    spec = JobSpec(
        base_model=p["model"],
        tenants=tenants,
        seq_len=p["seq"],
        max_tenants=len(tenants),
        max_rank=p["rank"],
        **({} if p.get("max_pass_tokens") is None else {"max_pass_tokens": p["max_pass_tokens"]}),
    )
    trainer = Trainer(spec, run_dir=None)
    t_loaded = time.perf_counter()
    rss_loaded = common.rss_bytes()
    trainer.train()
    t1 = time.perf_counter()
    others = common.machine_busy_seconds() - b0 - (time.process_time() - c0)
    assert all(t.step == p["steps"] for t in trainer.tenants.values())
    return dict(
        job_s=t1 - t0,
        contention=max(others, 0.0) / (t1 - t0),
        setup_s=t_loaded - t0,
        train_s=t1 - t_loaded,
        rss_imported=rss_imported,
        rss_loaded=rss_loaded,
        peak=common.peak_rss_bytes(),
        first_losses=[trainer.losses(f"t{i}")[0] for i in range(len(tenants))],
    )


def worker_peft(p: dict) -> dict:
    """One plain PEFT training: the loop of ``mlora_lab.reference.train_peft``, inlined only to time its
    set-up (tokenizer, data, model load + ``get_peft_model``) apart from its training steps."""
    import peft
    import torch
    import transformers

    from mlora_lab.data import TenantStream, collate, load_examples

    rss_imported = common.rss_bytes()
    b0, c0, t0 = common.machine_busy_seconds(), time.process_time(), time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(p["model"])
    examples = load_examples(p["data"], tok, p["seq"])
    stream = TenantStream(examples, seed=p["seed"], shuffle=True)  # the Trainer's row order
    batches = [stream.take(p["batch_size"]) for _ in range(p["steps"])]
    torch.manual_seed(p["seed"])
    base = transformers.AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.float32)
    config = peft.LoraConfig(
        r=p["rank"], lora_alpha=2 * p["rank"], target_modules=common.LLAMA_TARGETS, lora_dropout=0.0
    )
    model = peft.get_peft_model(base, config)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    t_loaded = time.perf_counter()
    losses = []
    for rows in batches:
        batch = collate([("t", rows)], tok.pad_token_id)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    t1 = time.perf_counter()
    others = common.machine_busy_seconds() - b0 - (time.process_time() - c0)
    return dict(
        job_s=t1 - t0,
        contention=max(others, 0.0) / (t1 - t0),
        setup_s=t_loaded - t0,
        train_s=t1 - t_loaded,
        rss_imported=rss_imported,
        peak=common.peak_rss_bytes(),
        first_loss=losses[0],
    )


def worker(payload: str) -> None:
    p = json.loads(payload)
    common.setup(p["threads"])
    common.report_to_parent(worker_mlora(p) if p["kind"] == "mlora" else worker_peft(p))


# -- the benchmark ------------------------------------------------------------------------------------


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, few steps (smoke test)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--max-pass-tokens",
        type=int,
        default=None,
        help="the mlora job's JobSpec.max_pass_tokens (default: one pass)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    cfg = QUICK if args.quick else FULL
    repeats = args.repeats or cfg["repeats"]
    common.setup(args.threads)
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)

    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        model_dir = common.build_model(Path(tmp) / "model", cfg["size"])
        n_params = common.n_params(model_dir)
        n_rows = cfg["batch_size"] * cfg["steps"]  # one epoch
        data = [
            common.write_text_rows(Path(tmp) / f"t{i}.jsonl", n_rows, seed=i) for i in range(cfg["tenants"])
        ]
        shared = dict(
            model=model_dir,
            seq=cfg["seq"],
            batch_size=cfg["batch_size"],
            steps=cfg["steps"],
            rank=cfg["rank"],
            threads=args.threads,
            max_pass_tokens=args.max_pass_tokens,
        )
        mlora_runs, peft_runs = [], []  # per repeat: ChildResult / one ChildResult per tenant
        for rep in range(repeats):
            print(f"repeat {rep + 1}/{repeats}: mlora job ...", flush=True)
            mlora_runs.append(common.run_child(__file__, dict(shared, kind="mlora", data=data)))
            print(f"repeat {rep + 1}/{repeats}: {cfg['tenants']} PEFT jobs ...", flush=True)
            peft_runs.append(
                [
                    common.run_child(__file__, dict(shared, kind="peft", data=data[i], seed=i))
                    for i in range(cfg["tenants"])
                ]
            )
        # Memory only: the same tenants with batch_size / n rows each, so the mlora batch has as many
        # rows as one PEFT job's batch; shows what the peak memory scales with.
        n = cfg["tenants"]
        print(
            f"extra: mlora job, {n} tenants x {cfg['batch_size'] // n} row(s) (same total rows as one PEFT job) ..."
        )
        same_rows = common.run_child(
            __file__, dict(shared, kind="mlora", data=data, batch_size=max(cfg["batch_size"] // n, 1))
        ).result

    med = common.median

    def mlora(key: str) -> list[float]:
        return [r.result[key] for r in mlora_runs]

    def peft_sum(key: str) -> list[float]:  # a repeat's PEFT jobs, one after another
        return [sum(r.result[key] for r in rs) for rs in peft_runs]

    m_wall = [r.process_wall_s for r in mlora_runs]
    p_wall = [sum(r.process_wall_s for r in rs) for rs in peft_runs]
    m_peak = med(mlora("peak"))
    p_peak = med([max(r.result["peak"] for r in rs) for rs in peft_runs])
    m_base = med(mlora("rss_imported"))
    p_base = med([r.result["rss_imported"] for rs in peft_runs for r in rs])
    loss_diff = max(
        abs(m.result["first_losses"][i] - rs[i].result["first_loss"])
        for m, rs in zip(mlora_runs, peft_runs)
        for i in range(cfg["tenants"])
    )

    time_ratio = med(mlora("job_s")) / med(peft_sum("job_s"))
    mem_ratio = m_peak / p_peak
    print(f"\n# concurrency: one {n}-tenant mlora job vs {n} PEFT jobs one after another\n")
    print(common.machine_line())
    print(f"model: {cfg['size'].describe(n_params)}")
    print(
        f"each tenant: rank {cfg['rank']}, alpha {2 * cfg['rank']}, all 7 projections, lr {LR}, clip 1.0, "
        f"{cfg['steps']} steps x {cfg['batch_size']} rows x {cfg['seq']} tokens; mlora batch = "
        f"{cfg['tenants'] * cfg['batch_size']} rows; median of {repeats} repeat(s)"
    )
    print(f"same rows check: |step-1 loss mlora - PEFT| max = {loss_diff:.2e}")
    print(
        f"other processes kept {load_before:.2f} cores busy before the run, and during the jobs (median): "
        f"mlora {med(mlora('contention')):.2f}, PEFT {med([r.result['contention'] for rs in peft_runs for r in rs]):.2f} "
        "(above ~1 they compete with this 1-thread benchmark)\n"
    )

    def row(label: str, key: str) -> list[str]:
        m, q = med(mlora(key)), med(peft_sum(key))
        return [label, f"{m:.2f}", f"{q:.2f}", f"{m / q:.3f}"]

    common.print_table(
        ["", f"mlora: 1 job, {n} tenants", f"PEFT: {n} jobs in a row", "ratio"],
        [
            row("job time s (tokenize + load + train)", "job_s"),
            [
                "  per repeat",
                " ".join(f"{x:.2f}" for x in mlora("job_s")),
                " ".join(f"{x:.2f}" for x in peft_sum("job_s")),
                "",
            ],
            row("  set-up s (tokenize + load model + wrap)", "setup_s"),
            row("  training s (all steps)", "train_s"),
            [
                "process wall s (incl. start-up, imports)",
                f"{med(m_wall):.2f}",
                f"{med(p_wall):.2f}",
                f"{med(m_wall) / med(p_wall):.3f}",
            ],
            ["peak RSS (PEFT: one job)", common.mib(m_peak), common.mib(p_peak), f"{mem_ratio:.3f}"],
            ["RSS after imports", common.mib(m_base), common.mib(p_base), ""],
            [
                "peak RSS above imports",
                common.mib(m_peak - m_base),
                common.mib(p_peak - p_base),
                f"{(m_peak - m_base) / (p_peak - p_base):.3f}",
            ],
        ],
    )
    print(f"\nRATIO time mlora / sequential PEFT: {common.verdict(time_ratio, TIME_GOAL)}")
    print(
        f"      training steps only (what long jobs converge to): "
        f"{med(mlora('train_s')) / med(peft_sum('train_s')):.3f}"
    )
    print(f"RATIO peak RSS mlora / one PEFT job: {common.verdict(mem_ratio, MEM_GOAL)}")
    print(
        f"      with the same total rows per step ({n} tenants x {max(cfg['batch_size'] // n, 1)} row(s) vs PEFT "
        f"{cfg['batch_size']} rows): mlora peak {common.mib(same_rows['peak'])}, ratio "
        f"{same_rows['peak'] / p_peak:.3f}"
    )
    print(
        f"({n} PEFT jobs side by side: ~{n * p_peak / 2**20:.0f} MiB, i.e. {n * p_peak / m_peak:.2f}x the mlora job)"
    )


if __name__ == "__main__":
    main()
