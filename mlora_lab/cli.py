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

from mlora_lab.launch import DEFAULT_WORKDIR, LAUNCHERS, Run, attach, launch, prepare_run, resume
from mlora_lab.rundir import CheckpointError, ControlError, RowKind, RunDirError, RunState
from mlora_lab.spec import JobSpec, SpecError

# What a user can get wrong (a bad job.json, a directory that is not a run, a run that cannot be
# resumed): one clear message and exit code 2, never a traceback.
USER_ERRORS = (SpecError, RunDirError, CheckpointError, ControlError, FileNotFoundError, RuntimeError)


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def follow(run: Run, every: float = 2.0, out=sys.stdout) -> str:
    """Print per-tenant progress while ``run`` goes; return its final state."""
    print(f"run directory: {run.path}", file=out, flush=True)
    last: dict[str, dict] = {}
    printed = 0.0
    cursor = (0, 0)
    while True:
        state = run.status
        new, cursor = run.rows_since(cursor)
        for row in new:
            if row["kind"] == RowKind.TRAIN:
                last[row["tenant"]] = row
        if last and (time.monotonic() - printed >= every or state.final):
            # a loss that is not a finite number is null in metrics.jsonl
            parts = [f"{n} {r['tenant_step']} loss {_nan(r['loss']):.3f}" for n, r in sorted(last.items())]
            print(f"[{state}] " + " | ".join(parts), file=out, flush=True)
            printed = time.monotonic()
        if state.final:
            return run.wait()
        time.sleep(0.5)


def print_outcome(run: Run, state: str, out=sys.stdout) -> None:
    from mlora_lab.report import summary

    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.precision", 4):
        print("\n" + summary(run).to_string(index=False), file=out)
    if state != RunState.FINISHED:
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
    return 0 if state == RunState.FINISHED else 1


def cmd_run(args: argparse.Namespace) -> int:
    run = launch(JobSpec.load(args.job), workdir=args.workdir, launcher=args.launcher)
    return follow_to_exit(run, args.no_follow)


def cmd_prepare(args: argparse.Namespace) -> int:
    # launchers/ start the processes themselves, on one node or many
    run = prepare_run(JobSpec.load(args.job), workdir=args.workdir, launcher=None)
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
    run = resume(args.run_dir, nproc=args.nproc, fsdp=args.fsdp, ep=args.ep, tp=args.tp)
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
    p.add_argument("--launcher", default="local", choices=LAUNCHERS, help="where the job runs")
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
    try:
        return args.func(args)
    except USER_ERRORS as e:
        text = str(e).strip() or type(e).__name__
        if isinstance(e, SpecError):
            print(text, file=sys.stderr)  # already one line per problem
        else:
            print(f"mlora-lab {args.command}: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted (the job, if one was started, keeps running; `mlora-lab stop RUN_DIR` ends it)",
              file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main())
