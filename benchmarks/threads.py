"""Torch threads per process: step time of one job with 1 or 2 threads per process, on 1 or 2 processes.

    .venv/bin/python benchmarks/threads.py            # ~4 min on 2 cores
    .venv/bin/python benchmarks/threads.py --quick    # smoke test (~1 min; its numbers mean nothing)

``mlora_lab.lab.launch`` sets ``OMP_NUM_THREADS`` for the job's processes; this measures which value to set.
Every case is the same small job (a Llama-style model, 2 tenants, the same global batch per step)
started the way ``ml.launch`` starts it: ``torchrun`` on the loopback rendezvous, ``OMP_NUM_THREADS`` in
the environment and nothing else (the worker does not call ``torch.set_num_threads``; it reports the
``torch.get_num_threads()`` it got). Cases:

- ``1 proc``: one process (``nproc=1``);
- ``2 procs``: one job of two processes (``nproc=2, fsdp=2``: each rank computes half the rows);
- ``2 jobs``: two one-process jobs at once (two ``ml.launch`` calls, as in ``tests/lab/test_lab.py``): each
  computes its whole batch, both on the same cores;

each with 1 and with 2 threads per process. Reported per case: the median step time (rank 0; for
``2 jobs`` the mean of the two jobs' medians; the first 2 steps are warm-up) and how many cores other
processes kept busy meanwhile. Cases are interleaved over ``--rounds`` rounds (A, B, C, ..., A, B, ...),
so drift of a shared machine hits them alike, and the table shows the median over rounds. The ratio
that decides the rule: step time with 2 threads ÷ with 1 thread, per case.

Then **what the launcher picks** (``mlora_lab.lab.launchers.threads``): the one-process job on the machine as it is
(idle, after waiting for quiet) and with one core kept busy by a spinning process this benchmark starts:
in each condition the load the launcher measures (``machine_load``), the threads it gives
(``threads_per_process``), and the step time with 1 and with 2 threads, so the table shows whether the
rule picked the faster one on both an idle and a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

FULL = dict(size=dict(hidden=256, layers=4, heads=8, kv_heads=4, vocab_size=2048), rows=8, steps=12, rounds=3)
QUICK = dict(size=dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=512), rows=4, steps=4, rounds=1)
WARMUP_STEPS = 2
# name -> (processes per job, jobs at once)
CASES = {"1 proc": (1, 1), "2 procs": (2, 1), "2 jobs": (1, 2)}


def worker(job: str, out: str, steps: int, budget: float) -> None:
    """Under torchrun: build the job's Trainer and time ``steps`` steps (fewer if they take more than
    ``budget`` seconds, but at least 3 after the warm-up); rank 0 writes every rank's row."""
    import torch
    import transformers

    from mlora_lab.job.trainer import Trainer
    from mlora_lab.parallel import init_distributed, shutdown_distributed
    from mlora_lab.spec.job import JobSpec

    transformers.utils.logging.set_verbosity_error()
    dist = init_distributed()
    trainer = Trainer(JobSpec.load(job), run_dir=None, dist=dist)
    trainer.model.train()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps:
        t0 = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - t0)
        over = torch.tensor([float(time.perf_counter() - start > budget and len(times) >= WARMUP_STEPS + 3)])
        if dist.world_size > 1:  # every rank stops at the same step
            torch.distributed.all_reduce(over, op=torch.distributed.ReduceOp.MAX)
        if over.item():
            break
    row = {
        "rank": dist.rank,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "step_time": statistics.median(times[WARMUP_STEPS:]),
        "steps": len(times),
    }
    rows = trainer.comm.gather_objects(row)
    if dist.is_main:
        Path(out).write_text(json.dumps(rows))
    shutdown_distributed()


def build_job(work: Path, quick: bool) -> Path:
    from mlora_lab.lab.demo import task_rows, write_jsonl
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant
    from mlora_lab.tiny import build_tiny_model

    cfg = QUICK if quick else FULL
    base = build_tiny_model("llama", work / "model", **cfg["size"])
    tenants = [
        Tenant(name=f"t{i}", data=write_jsonl(work / f"t{i}.jsonl", task_rows(task, 64, seed=i)), rank=16,
               target_modules=common.LLAMA_TARGETS, batch_size=cfg["rows"], max_steps=10_000)
        for i, task in enumerate(["reverse", "upper"])
    ]  # fmt: skip
    path = work / "job.json"
    JobSpec(base_model=base, tenants=tenants, seq_len=64, max_tenants=2, max_rank=16).to_json(path)
    return path


def run_case(
    work: Path, job: Path, nproc: int, jobs: int, threads: int, steps: int, budget: float, tag: str
) -> dict:
    """Start ``jobs`` torchrun jobs of ``nproc`` processes at once with ``OMP_NUM_THREADS=threads``."""
    from mlora_lab.rendezvous import loopback_env, single_node_torchrun_args

    spec = json.loads(job.read_text())
    spec["parallel"] = {"nproc": nproc, "fsdp": nproc}
    path = work / f"job_{tag}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, **loopback_env(), "OMP_NUM_THREADS": str(threads)}
    outs = [work / f"out_{tag}_{j}.json" for j in range(jobs)]
    busy0, kids0, t0 = common.machine_busy_seconds(), _children_cpu(), time.perf_counter()
    commands = [
        [sys.executable, "-m", "torch.distributed.run", *single_node_torchrun_args(nproc), __file__,
         "--worker", str(path), "--out", str(out), "--steps", str(steps), "--budget", str(budget)]
        for out in outs
    ]  # fmt: skip
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in commands
    ]
    logs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    others = max(common.machine_busy_seconds() - busy0 - (_children_cpu() - kids0), 0.0) / wall
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise RuntimeError(f"{tag} failed (exit {p.returncode}):\n{log[-3000:]}")
    rows = [json.loads(out.read_text()) for out in outs]
    return {
        "step_time": statistics.mean(r[0]["step_time"] for r in rows),  # rank 0 of each job
        "threads": sorted({row["threads"] for r in rows for row in r}),
        "steps": min(r[0]["steps"] for r in rows),
        "others": others,
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument("--max-wait", type=float, default=120, help="seconds to wait for a quiet machine")
    parser.add_argument("--budget", type=float, default=45, help="seconds of steps per run (>= 5 steps)")
    common.add_worker_args(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.steps, args.budget)
        return
    cfg = QUICK if args.quick else FULL
    rounds = args.rounds or cfg["rounds"]
    work = Path(tempfile.mkdtemp(prefix="mlora_threads_bench_"))
    job = build_job(work, args.quick)
    print(common.machine_line().replace(f"torch threads {common.torch.get_num_threads()}, ", ""))
    print(
        f"job: llama {cfg['size']}, 2 tenants x {cfg['rows']} rows x seq <= 64, rank 16 on all 7 projections; "
        f"{cfg['steps']} steps per run ({WARMUP_STEPS} warm-up; fewer past {args.budget:.0f} s), {rounds} interleaved round(s)"
    )
    common.wait_for_quiet(args.max_wait)
    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(rounds):
        for case, (nproc, jobs) in CASES.items():
            for threads in (1, 2):
                tag = f"{case.replace(' ', '')}_{threads}t_r{r}"
                res = run_case(work, job, nproc, jobs, threads, cfg["steps"], args.budget, tag)
                results.setdefault((case, threads), []).append(res)
                print(
                    f"  round {r + 1}: {case}, {threads} thread(s): step {res['step_time']:.3f} s "
                    f"({res['steps']} steps), torch threads {res['threads']}, others' cores {res['others']:.2f}",
                    flush=True,
                )
    rows = []
    for case, (nproc, jobs) in CASES.items():
        t1 = statistics.median(x["step_time"] for x in results[(case, 1)])
        for threads in (1, 2):
            xs = results[(case, threads)]
            t = statistics.median(x["step_time"] for x in xs)
            rows.append(
                [
                    case,
                    threads,
                    nproc * jobs * threads,
                    f"{t:.3f}",
                    common.spread([x["step_time"] for x in xs]),
                    f"{statistics.median(x['others'] for x in xs):.2f}",
                    f"{t / t1:.2f}",
                ]
            )
    print()
    common.print_table(
        [
            "case",
            "threads/process",
            "threads in all",
            "step s (median)",
            "range",
            "others' cores",
            "÷ 1 thread",
        ],
        rows,
    )
    print("\nwhat the launcher picks (one process):")
    common.print_table(
        [
            "machine",
            "load measured",
            "threads picked",
            "step s, 1 thread",
            "step s, 2 threads",
            "faster",
            "picked the faster",
        ],
        rule_rows(work, job, cfg["steps"], args.budget, rounds),
    )


def rule_rows(work: Path, job: Path, steps: int, budget: float, rounds: int) -> list[list]:
    """For an idle machine and one with a core kept busy: the load the launcher measures, the threads it
    picks for a one-process job, and that job's step time with 1 and with 2 threads (median of rounds)."""
    from mlora_lab.lab.launchers.threads import machine_load, threads_per_process

    out = []
    for condition in ("idle", "one core busy"):
        loads, picks, times = [], [], {1: [], 2: []}
        for r in range(rounds):
            spinner = None
            if condition != "idle":
                spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                time.sleep(1.0)
            try:
                loads.append(machine_load(1.0))
                picks.append(threads_per_process(1, load=loads[-1]))
                for threads in (1, 2):
                    tag = f"rule_{condition.replace(' ', '')}_{threads}t_r{r}"
                    times[threads].append(run_case(work, job, 1, 1, threads, steps, budget, tag)["step_time"])
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            print(
                f"  {condition}, round {r + 1}: load {loads[-1]:.2f}, picks {picks[-1]}, step 1t "
                f"{times[1][-1]:.3f} s, 2t {times[2][-1]:.3f} s",
                flush=True,
            )
        t1, t2 = statistics.median(times[1]), statistics.median(times[2])
        faster = 1 if t1 <= t2 else 2
        picked = statistics.median_low(picks)
        out.append(
            [
                condition,
                f"{statistics.median(loads):.2f}",
                picked,
                f"{t1:.3f}",
                f"{t2:.3f}",
                faster,
                "yes" if picked == faster else "no",
            ]
        )
    return out


if __name__ == "__main__":
    main()
