"""The ``mlora-lab`` command line.

mlora-lab run job.json        validate, launch under torchrun, follow until it ends
mlora-lab demo                build a tiny model + 3 tenants, train them together, summarise
mlora-lab status RUN_DIR      state and per-tenant summary of a run
mlora-lab stop RUN_DIR        graceful stop (checkpoint, save adapters, exit)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from mlora_lab.launch import DEFAULT_WORKDIR, Run, attach, launch, prepare_run, resume
from mlora_lab.rundir import FINAL_STATES
from mlora_lab.spec import JobSpec, SpecError


def follow(run: Run, every: float = 2.0, out=sys.stdout) -> str:
    """Print per-tenant progress while ``run`` goes; return its final state."""
    print(f"run directory: {run.path}", file=out, flush=True)
    last: dict[str, dict] = {}
    printed = 0.0
    while True:
        state = run.status
        for row in run.rows():
            if row["kind"] == "train":
                last[row["tenant"]] = row
        if last and (time.monotonic() - printed >= every or state in FINAL_STATES):
            parts = [f"{n} {r['tenant_step']} loss {r['loss']:.3f}" for n, r in sorted(last.items())]
            print(f"[{state}] " + " | ".join(parts), file=out, flush=True)
            printed = time.monotonic()
        if state in FINAL_STATES:
            return run.wait()
        time.sleep(0.5)


def print_outcome(run: Run, state: str, out=sys.stdout) -> None:
    from mlora_lab.report import summary

    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.precision", 4):
        print("\n" + summary(run).to_string(index=False), file=out)
    if state != "finished":
        print(f"\nrun {state}: {run.error or ''}\n--- rank 0 log tail ---\n{run.logs(0, 30)}", file=out)
    else:
        print(f"\nadapters (PEFT format): {run.path / 'adapters'}", file=out)


def follow_to_exit(run: Run, no_follow: bool = False) -> int:
    """Follow ``run`` to its end and summarise it (or just print its directory); the exit code."""
    if no_follow:
        print(run.path)
        return 0
    state = follow(run)
    print_outcome(run, state)
    return 0 if state == "finished" else 1


def cmd_run(args: argparse.Namespace) -> int:
    try:
        spec = JobSpec.load(args.job)
        run = launch(spec, workdir=args.workdir)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 2
    return follow_to_exit(run, args.no_follow)


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        run = prepare_run(JobSpec.load(args.job), workdir=args.workdir)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 2
    print(run.root)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mlora_lab.demo import build_demo
    from mlora_lab.report import plot_losses

    work = Path(args.workdir)
    kind = "Qwen3-MoE" if args.moe else "Llama-style"
    print(f"building a tiny {kind} model, a local tokenizer and 3 tenants' data in {work}/ ...", flush=True)
    spec = build_demo(work, steps=args.steps, nproc=args.nproc, moe=args.moe)
    run = launch(spec, workdir=work / "runs")
    code = follow_to_exit(run)
    png = work / "loss_curves.png"
    plot_losses(run, png)
    print(f"loss curves: {png}")
    return code


def cmd_resume(args: argparse.Namespace) -> int:
    try:
        run = resume(args.run_dir, nproc=args.nproc, fsdp=args.fsdp, ep=args.ep, tp=args.tp)
    except (SpecError, FileNotFoundError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 2
    return follow_to_exit(run, args.no_follow)


def cmd_status(args: argparse.Namespace) -> int:
    run = attach(args.run_dir)
    print(f"{run.path}: {run.status} (step {run.global_step})")
    if run.error:
        print(f"error: {run.error}")
    from mlora_lab.report import summary

    print(summary(run).to_string(index=False))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run = attach(args.run_dir)
    state = run.stop(timeout=args.timeout)
    print(f"{run.path}: {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlora-lab", description="Multi-tenant LoRA lab")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="launch a job.json under torchrun and follow it")
    p.add_argument("job", type=Path)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where run directories go (unless output_dir)")
    p.add_argument("--no-follow", action="store_true", help="print the run directory and return at once")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("prepare", help="validate a job.json and create its run directory (for launchers/)")
    p.add_argument("job", type=Path)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR)
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("demo", help="train three tenants on a tiny model built locally")
    p.add_argument("--workdir", default="mlora_demo")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument(
        "--moe", action="store_true", help="a small Qwen3-MoE model, LoRA on its packed experts too"
    )
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("resume", help="continue a run from its latest checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--nproc", type=int, default=None, help="change the number of processes")
    p.add_argument("--fsdp", type=int, default=None, help="change the FSDP degree (default: nproc / tp)")
    p.add_argument("--tp", type=int, default=None, help="change the tensor-parallel degree")
    p.add_argument("--ep", type=int, default=None, help="change the expert-parallel degree (MoE)")
    p.add_argument("--no-follow", action="store_true")
    p.set_defaults(func=cmd_resume)
    p = sub.add_parser("status", help="show a run's state and per-tenant summary")
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("stop", help="stop a run gracefully")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--timeout", type=float, default=60)
    p.set_defaults(func=cmd_stop)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
