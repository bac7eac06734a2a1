"""Preference tenants (issue 50): DPO steps in mlora_lab vs TRL's ``DPOTrainer`` with PEFT LoRA.

    .venv/bin/python benchmarks/preference.py           # full run (~3 min on a quiet 2-core machine)
    .venv/bin/python benchmarks/preference.py --quick   # smoke test (~40 s: 4 processes start; numbers mean nothing)

One preference tenant (``Tenant(pref=Preference(beta=β))``, loss ``sigmoid``: DPO) in an **in-process** mlora_lab
job (``Trainer(JobSpec(...), run_dir=None).train()``, the loop a launched job runs on each process, without
torchrun's start-up) against TRL 1.16's ``DPOTrainer`` on a ``PeftModel`` (the recipe of
``tests/job/test_preference_driver.py``'s ``trl_run``), with the same settings on the same rows: ``B`` pairs per
optimiser step (TRL: ``per_device_train_batch_size = B``, one accumulation step), every sequence cut to
``seq_len`` tokens keeping its start (TRL: ``max_length``), rank r / alpha 2r on all 7 projections, lr 1e-4
constant, AdamW (weight decay 0), clip 1.0, fp32, no gradient checkpointing (TRL's default is on, mlora_lab's
off: off on both), ``steps`` optimiser steps over ``B · steps`` pairs (one epoch). Every completion is longer
than ``seq_len``, so each of the ``2B`` sequences of a step has exactly ``seq_len`` tokens on both sides and the
batches have the same shape.

**The reference is computed the same way on both sides:** one no-grad forward of each pair (its two
sequences) through the base with the adapter off, for the whole run, its two log-probs kept. TRL:
``precompute_ref_log_probs=True``, every pair in ``DPOTrainer.__init__`` (batches of ``B`` pairs); mlora_lab
caches a pair's reference on first use, at the start of the step that first draws it (here every step draws
``B`` new pairs). Both are timed (a wrapper around TRL's ``_precompute_ref_logps`` and mlora_lab's
``PreferenceDriver._reference``), so that step times exclude the reference forward on both sides and job
times include it on both sides.

Each run is its own process (``--worker``): its peak memory is its own (``ru_maxrss`` of the process),
and imports are done before the clock starts.

- **step time**, 1 tenant: the time between the ends of consecutive optimiser steps, less the reference
  forward mlora_lab runs inside the step; the first step excluded (first-call costs). TRL's from a
  ``TrainerCallback`` (``on_step_end``). The 1-tenant job runs ``one_tenant_runs`` times, interleaved with the
  TRL runs (one per β), and each side's step is the median over all its runs' steps, by wall and CPU time.
  Goal: mlora / TRL <= 1.0.
- **peak memory**, 1 tenant: the median peak RSS of the 1-tenant runs / that of the TRL runs. Goal <= 1.0.
- **4 tenants** with β = 0.05, 0.1, 0.2, 0.5 in one job vs 4 TRL runs one after another (4 processes), each
  with its tenant's β, all on the same pairs (a β sweep, the case the issue names: in one job the tenants share
  one reference cache, so each pair's reference forward is made once for the four; each TRL run makes its
  own): job time = set-up (tokenizer, pairs, model load + wrap) + the reference of
  every pair + all steps, imports excluded. Goal: mlora / sum of the 4 TRL runs <= 0.6.

Every run reports the cores *other* processes kept busy while it trained (``/proc/stat`` less its own CPU
time): above ~1 they compete with the benchmark's one thread and wall times are noise (see README).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

STEP_GOAL = 1.0  # 1-tenant step time, mlora / TRL: at most
MEM_GOAL = 1.0  # 1-tenant peak RSS, mlora / TRL: at most
JOB_GOAL = 0.6  # 4 tenants in one job / 4 TRL runs in a row: at most
LR = 1e-4
BETAS = [0.05, 0.1, 0.2, 0.5]

FULL = dict(
    size=common.ModelSize(384, 6, 8, 4, 4096), rank=16, seq_len=128, pairs=4, steps=12, one_tenant_runs=3
)
QUICK = dict(
    size=common.ModelSize(128, 2, 4, 2, 1024), rank=8, seq_len=64, pairs=2, steps=3, one_tenant_runs=1
)


# -- data -------------------------------------------------------------------------------------------


def write_pairs(path: Path, n: int, seed: int) -> str:
    """``n`` pairs ``{"prompt", "chosen", "rejected"}`` of pseudo-words: a prompt of a few tokens, completions of
    200 words (longer than any ``seq_len`` used here, so every sequence is cut to exactly ``seq_len``)."""
    rng = random.Random(seed)
    vocab = " ".join(common.synthetic_corpus()[-200:]).split()

    def words(k: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(k))

    rows = [
        {"prompt": words(rng.randint(3, 6)), "chosen": " " + words(200), "rejected": " " + words(200)}
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# -- timing inside a worker ------------------------------------------------------------------------------


class Clock:
    """Wall and CPU seconds of this process, and the CPU seconds of every other process, since ``start()``."""

    def start(self) -> Clock:
        self.b0, self.c0, self.t0 = common.machine_busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def read(self) -> dict:
        wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
        others = max(common.machine_busy_seconds() - self.b0 - cpu, 0.0)
        return dict(wall=wall, cpu=cpu, others=others / wall if wall > 0 else 0.0)


class Spent:
    """Wall and CPU seconds spent inside the wrapped calls (the reference forwards), read per step."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - t0
                self.cpu += time.process_time() - c0

        return timed


def diffs(start: float, stamps: list[float]) -> list[float]:
    """Durations between consecutive time stamps (the first from ``start``)."""
    edges = [start, *stamps]
    return [b - a for a, b in itertools.pairwise(edges)]


# -- workers (each in its own process) ---------------------------------------------------------------------


def worker_mlora(p: dict) -> dict:
    from mlora_lab.job.drivers.preference import PreferenceDriver
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.parts import Preference
    from mlora_lab.spec.tenant import Tenant

    ref = Spent()
    PreferenceDriver._reference = ref.wrap(PreferenceDriver._reference)
    rss_imported = common.rss_bytes()
    clock = Clock().start()
    tenants = [
        Tenant(
            name=f"t{i}",
            data=path,
            pref=Preference(beta=beta),
            rank=p["rank"],
            alpha=2 * p["rank"],
            target_modules=common.LLAMA_TARGETS,
            lr=LR,
            weight_decay=0.0,
            max_grad_norm=1.0,
            batch_size=p["pairs"],
            grad_accum=1,
            max_steps=p["steps"],
            seed=i,
        )
        for i, (path, beta) in enumerate(zip(p["data"], p["betas"], strict=True))
    ]
    spec = JobSpec(
        base_model=p["model"],
        tenants=tenants,
        seq_len=p["seq_len"],
        max_tenants=len(tenants),
        max_rank=p["rank"],
        dtype="float32",
    )
    trainer = Trainer(spec, run_dir=None)
    setup_s = time.perf_counter() - clock.t0
    t_loaded, c_loaded = time.perf_counter(), time.process_time()
    stamps, cpu_stamps, ref_walls, ref_cpus = [], [], [], []
    step = trainer.step

    def timed_step() -> bool:
        before = sum(t.step for t in trainer.tenants.values())
        stepped = step()
        if sum(t.step for t in trainer.tenants.values()) > before:  # an optimiser step ended
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())
            ref_walls.append(ref.wall)
            ref_cpus.append(ref.cpu)
        return stepped

    trainer.step = timed_step  # (train() calls self.step())
    trainer.train()
    job = clock.read()
    trainer.close()
    assert all(t.step == p["steps"] for t in trainer.tenants.values()), {
        n: (t.step, t.state, t.reason) for n, t in trainer.tenants.items()
    }
    # each step less the reference forward it ran (the reference's seconds are cumulative)
    walls, cpus = diffs(t_loaded, stamps), diffs(c_loaded, cpu_stamps)
    ref_w, ref_c = diffs(0.0, ref_walls), diffs(0.0, ref_cpus)
    return dict(
        job=job,
        setup_s=setup_s,
        ref_s=ref.wall,
        ref_cpu_s=ref.cpu,
        train_s=job["wall"] - setup_s - ref.wall,
        steps=[w - r for w, r in zip(walls, ref_w, strict=True)],
        cpu_steps=[c - r for c, r in zip(cpus, ref_c, strict=True)],
        steps_with_ref=walls,
        rss_imported=rss_imported,
        peak=common.peak_rss_bytes(),
    )


def import_trl():
    """TRL, imported with trackio taken as absent (as the tests do): trackio would fix its store folder on
    import; nothing here reports to it (``report_to="none"``)."""
    from unittest import mock

    with (
        mock.patch("transformers.integrations.is_trackio_available", return_value=False),
        mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
    ):
        import trl
        from trl import DPOConfig, DPOTrainer
    return trl, DPOConfig, DPOTrainer


def worker_trl(p: dict) -> dict:
    import datasets
    import peft
    import torch
    import transformers

    _, DPOConfig, DPOTrainer = import_trl()
    datasets.disable_progress_bars()
    ref = Spent()
    DPOTrainer._precompute_ref_logps = ref.wrap(DPOTrainer._precompute_ref_logps)

    class Stamps(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu_stamps: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())

    rss_imported = common.rss_bytes()
    stamps = Stamps()
    with tempfile.TemporaryDirectory(prefix="mlora_bench_trl_") as out:
        clock = Clock().start()
        tok = transformers.AutoTokenizer.from_pretrained(p["model"])
        model = transformers.AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.float32)
        lora = peft.LoraConfig(
            r=p["rank"], lora_alpha=2 * p["rank"], target_modules=common.LLAMA_TARGETS, lora_dropout=0.0
        )
        model = peft.get_peft_model(model, lora)
        rows = [json.loads(line) for line in Path(p["data"]).read_text().splitlines()]
        config = DPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            dataloader_pin_memory=False,
            dataloader_num_workers=0,
            disable_tqdm=True,
            logging_steps=1,
            per_device_train_batch_size=p["pairs"],
            gradient_accumulation_steps=1,
            max_steps=p["steps"],
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch",
            max_length=p["seq_len"],
            loss_type=["sigmoid"],
            beta=p["beta"],
            precompute_ref_log_probs=True,
            seed=p["seed"],
        )
        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[stamps],
        )
        assert ref.wall > 0, "TRL computed no reference (a cached one from another run?)"
        t_loaded, c_loaded = time.perf_counter(), time.process_time()
        setup_s = t_loaded - clock.t0 - ref.wall
        trainer.train()
        job = clock.read()
    assert trainer.state.global_step == p["steps"] == len(stamps.stamps)
    return dict(
        job=job,
        setup_s=setup_s,
        ref_s=ref.wall,
        ref_cpu_s=ref.cpu,
        train_s=job["wall"] - setup_s - ref.wall,
        steps=diffs(t_loaded, stamps.stamps),
        cpu_steps=diffs(c_loaded, stamps.cpu_stamps),
        rss_imported=rss_imported,
        peak=common.peak_rss_bytes(),
    )


def worker(payload: str) -> None:
    p = json.loads(payload)
    common.setup(p["threads"])
    if p["kind"] == "trl":
        import_trl()  # (imports before the clock, as mlora_lab's below)
        import datasets  # noqa: F401
        import peft  # noqa: F401
    else:
        import mlora_lab.job.trainer  # noqa: F401
    common.report_to_parent(worker_mlora(p) if p["kind"] == "mlora" else worker_trl(p))


# -- the benchmark ------------------------------------------------------------------------------------------


def trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, few pairs and steps (smoke test)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    cfg = QUICK if args.quick else FULL
    n = 2 if args.quick else len(BETAS)
    betas = BETAS[:n]
    common.setup(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children inherit it
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    med, mib = common.median, common.mib

    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = common.build_model(tmp / "model", cfg["size"])
        # a β sweep: every tenant (and TRL run) on the same pairs; in one job they share one base reference
        data = [write_pairs(tmp / "pairs.jsonl", cfg["pairs"] * cfg["steps"], seed=0)] * n
        print(f"\n# preference: DPO tenants (issue 50) vs TRL {trl_version()} DPOTrainer + PEFT LoRA\n")
        print(common.machine_line())
        print(
            f"threads: torch.set_num_threads({args.threads}) and OMP_NUM_THREADS={args.threads} in every process"
        )
        print(
            f"model: {cfg['size'].describe(common.n_params(model_dir))}; LoRA rank {cfg['rank']}, alpha "
            f"{2 * cfg['rank']}, all 7 projections; fp32"
        )
        print(
            f"DPO (sigmoid): {cfg['pairs']} pairs ({2 * cfg['pairs']} sequences of {cfg['seq_len']} tokens) per "
            f"step, {cfg['steps']} steps, {cfg['pairs'] * cfg['steps']} pairs per tenant; reference: the base, "
            "computed once per pair on both sides"
        )
        print(f"other processes kept {load_before:.2f} cores busy before the run\n", flush=True)

        shared = dict(
            model=model_dir,
            threads=args.threads,
            **{k: cfg[k] for k in ("rank", "seq_len", "pairs", "steps")},
        )
        # interleaved, so drift of the machine hits both sides alike: the 1-tenant job runs several times (on
        # the pairs and β of TRL runs 0, 1, ...), as TRL runs once per tenant
        ones = [f"mlora1_{i}" for i in range(cfg["one_tenant_runs"])]

        def one(i: int) -> dict:
            return dict(kind="mlora", data=data[i : i + 1], betas=betas[i : i + 1])

        def trl(i: int) -> dict:
            return dict(kind="trl", data=data[i], beta=betas[i], seed=i)

        order = [
            (ones[0], one(0)),
            ("trl0", trl(0)),
            (f"mlora{n}", dict(kind="mlora", data=data, betas=betas)),
        ]
        for i in range(1, n):
            if i < len(ones):
                order.append((ones[i], one(i)))
            order.append((f"trl{i}", trl(i)))
        runs: dict[str, dict] = {}
        walls: dict[str, float] = {}
        for name, extra in order:
            print(f"  {name} ...", flush=True)
            child = common.run_child(__file__, dict(shared, **extra))
            runs[name], walls[name] = child.result, child.process_wall_s

    trls = [runs[f"trl{i}"] for i in range(n)]
    m1s = [runs[k] for k in ones]
    mn = runs[f"mlora{n}"]

    def step(rs: list[dict], key: str = "steps") -> float:
        return med([s for r in rs for s in r[key][1:]])

    def others(rs: list[dict]) -> str:
        return f"{max(r['job']['others'] for r in rs):.2f}"

    one_step, trl_step = step(m1s), step(trls)
    one_cpu, trl_cpu = step(m1s, "cpu_steps"), step(trls, "cpu_steps")
    one_peak, trl_peak = med([r["peak"] for r in m1s]), med([r["peak"] for r in trls])
    trl_job = sum(r["job"]["wall"] for r in trls)
    trl_job_cpu = sum(r["job"]["cpu"] for r in trls)

    def total(key: str) -> float:
        return sum(r[key] for r in trls)

    print("\n## time (wall and CPU s; others' cores: the most any run of the row saw)\n")
    common.print_table(
        [
            "",
            "mlora wall s",
            "mlora CPU s",
            "TRL wall s",
            "TRL CPU s",
            "wall ratio",
            "CPU ratio",
            "others' cores",
        ],
        [
            [
                f"**1 tenant: step** (median, first excluded; {len(m1s)} / {n} runs)",
                f"{one_step:.3f}",
                f"{one_cpu:.3f}",
                f"{trl_step:.3f}",
                f"{trl_cpu:.3f}",
                f"**{one_step / trl_step:.3f}**",
                f"{one_cpu / trl_cpu:.3f}",
                f"{others(m1s)} / {others(trls)}",
            ],
            [
                "  each run's median step",
                " ".join(f"{med(r['steps'][1:]):.3f}" for r in m1s),
                "",
                " ".join(f"{med(r['steps'][1:]):.3f}" for r in trls),
                "",
                "",
                "",
                "",
            ],
            [
                "  mlora step with its reference forward",
                f"{step(m1s, 'steps_with_ref'):.3f}",
                "",
                "",
                "",
                f"{step(m1s, 'steps_with_ref') / trl_step:.3f}",
                "",
                "",
            ],
            [
                "  reference, all pairs (1 tenant; TRL run 0)",
                f"{m1s[0]['ref_s']:.3f}",
                f"{m1s[0]['ref_cpu_s']:.3f}",
                f"{trls[0]['ref_s']:.3f}",
                f"{trls[0]['ref_cpu_s']:.3f}",
                f"{m1s[0]['ref_s'] / trls[0]['ref_s']:.3f}",
                f"{m1s[0]['ref_cpu_s'] / trls[0]['ref_cpu_s']:.3f}",
                "",
            ],
            [
                f"**{n} tenants: 1 job vs {n} runs in a row, job**",
                f"{mn['job']['wall']:.2f}",
                f"{mn['job']['cpu']:.2f}",
                f"{trl_job:.2f}",
                f"{trl_job_cpu:.2f}",
                f"**{mn['job']['wall'] / trl_job:.3f}**",
                f"{mn['job']['cpu'] / trl_job_cpu:.3f}",
                f"{others([mn])} / {others(trls)}",
            ],
            [
                "  set-up (tokenizer, pairs, model load + wrap)",
                f"{mn['setup_s']:.2f}",
                "",
                f"{total('setup_s'):.2f}",
                "",
                f"{mn['setup_s'] / total('setup_s'):.3f}",
                "",
                "",
            ],
            [
                "  reference, all pairs",
                f"{mn['ref_s']:.2f}",
                f"{mn['ref_cpu_s']:.2f}",
                f"{total('ref_s'):.2f}",
                f"{total('ref_cpu_s'):.2f}",
                f"{mn['ref_s'] / total('ref_s'):.3f}",
                f"{mn['ref_cpu_s'] / total('ref_cpu_s'):.3f}",
                "",
            ],
            [
                "  training (all steps, reference excluded)",
                f"{mn['train_s']:.2f}",
                "",
                f"{total('train_s'):.2f}",
                "",
                f"{mn['train_s'] / total('train_s'):.3f}",
                "",
                "",
            ],
            [
                f"  step ({n}-tenant job; TRL: {n} × one run's)",
                f"{step([mn]):.3f}",
                f"{step([mn], 'cpu_steps'):.3f}",
                f"{n * trl_step:.3f}",
                f"{n * trl_cpu:.3f}",
                f"{step([mn]) / (n * trl_step):.3f}",
                f"{step([mn], 'cpu_steps') / (n * trl_cpu):.3f}",
                "",
            ],
            [
                "  process wall (start-up and imports included)",
                f"{walls[f'mlora{n}']:.2f}",
                "",
                f"{sum(walls[f'trl{i}'] for i in range(n)):.2f}",
                "",
                f"{walls[f'mlora{n}'] / sum(walls[f'trl{i}'] for i in range(n)):.3f}",
                "",
                "",
            ],
        ],
    )
    trl_imported = med([r["rss_imported"] for r in trls])
    one_imported = med([r["rss_imported"] for r in m1s])
    print("\n## peak memory (ru_maxrss of each run's process; medians over the runs)\n")
    common.print_table(
        ["", "mlora", "TRL", "ratio"],
        [
            ["**1 tenant: peak RSS**", mib(one_peak), mib(trl_peak), f"**{one_peak / trl_peak:.3f}**"],
            [
                "  each run's",
                " ".join(mib(r["peak"]) for r in m1s),
                " ".join(mib(r["peak"]) for r in trls),
                "",
            ],
            ["  RSS after imports", mib(one_imported), mib(trl_imported), ""],
            [
                "  peak RSS above imports",
                mib(one_peak - one_imported),
                mib(trl_peak - trl_imported),
                f"{(one_peak - one_imported) / (trl_peak - trl_imported):.3f}",
            ],
            [
                f"{n}-tenant job vs one TRL run",
                mib(mn["peak"]),
                mib(trl_peak),
                f"{mn['peak'] / trl_peak:.3f}",
            ],
        ],
    )
    busiest = max(r["job"]["others"] for r in runs.values())
    if busiest > 1.0:
        print(
            f"\nwarning: other processes kept up to {busiest:.2f} cores busy during a run: trust the CPU ratios"
        )
    print(
        f"\nRATIO DPO step time, 1 tenant, mlora / TRL: {common.verdict(one_step / trl_step, STEP_GOAL)}  "
        f"[mlora {one_step:.3f} s vs TRL {trl_step:.3f} s; by CPU time {one_cpu / trl_cpu:.3f}]"
    )
    print(
        f"RATIO peak RSS, 1 tenant, mlora / TRL: {common.verdict(one_peak / trl_peak, MEM_GOAL)}  "
        f"[mlora {mib(one_peak)} vs TRL {mib(trl_peak)}]"
    )
    print(
        f"RATIO {n} tenants in one job / {n} TRL runs in a row (set-up + reference + steps): "
        f"{common.verdict(mn['job']['wall'] / trl_job, JOB_GOAL)}  [mlora {mn['job']['wall']:.2f} s vs TRL "
        f"{trl_job:.2f} s; by CPU time {mn['job']['cpu'] / trl_job_cpu:.3f}]"
    )


if __name__ == "__main__":
    main()
