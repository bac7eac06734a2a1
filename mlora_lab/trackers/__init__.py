"""Mirroring a run's metrics rows to the experiment trackers people keep their runs in: TensorBoard,
trackio and W&B (``JobSpec.report_to``, transformers' ``report_to`` convention).

Both sides use it, so it lives in neither ``job/`` nor ``lab/``:

* the job's rank 0 (:class:`~mlora_lab.job.recorder.Recorder`) opens a sink with :func:`open_sink` and
  hands it every row as it is written; a tracker that fails is said once in the run's events
  (``tracker_failed``) and gets no more rows, and the job goes on;
* after the fact, :func:`report` (``ml.report(run, to=["tensorboard"])``) and ``mlora-lab report RUN_DIR
  --to tensorboard`` (:func:`mirror_run`) send an existing run directory's rows through the same mapping.

What goes where is :mod:`mlora_lab.trackers.points` (rows → metric names and steps, tenants'
hyperparameters → config), shared by both; :mod:`.backends` writes them with each tracker's own API;
:mod:`.mirror` routes them and keeps one tracker's failure from the others and from the job.

None of the trackers is a dependency: each is an extra (``pip install 'mlora_lab[tensorboard]'``,
``[trackio]``, ``[wandb]``, or ``[trackers]`` for the three), imported only when a run asks for it.
This module itself imports none of them, nor torch.
"""

from __future__ import annotations

import atexit
import difflib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlora_lab.rundir import MetricsReader, RunDir
from mlora_lab.spec.fields import MAX_NAME_LEN, SAFE_NAME, SpecError
from mlora_lab.spec.job import REPORT_GROUPS, TRACKERS, JobSpec
from mlora_lab.text import brief, error_line

if TYPE_CHECKING:
    from mlora_lab.trackers.mirror import Background

EXTRAS = {name: name for name in TRACKERS}
"""The pip extra of mlora_lab that installs each tracker (``pip install 'mlora_lab[wandb]'``)."""
ALL_EXTRA = "trackers"
"""The extra that installs all three."""
ANSWER = "mlora_lab.trackers answer: "
"""How the child process of :func:`report` marks its answer line (JSON) on its standard output."""
MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}
"""The module each tracker is imported as."""


def installed(tracker: str) -> bool:
    """Whether ``tracker``'s package can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(MODULES[tracker]) is not None
    except (ImportError, ValueError):  # a broken install, or a module without a spec
        return False


def install_hint(trackers: Sequence[str]) -> str:
    """``pip install 'mlora_lab[wandb]'``: what installs ``trackers``."""
    extras = ",".join(EXTRAS[t] for t in trackers)
    return f"pip install 'mlora_lab[{extras}]'"


def report_to_problems(value: Any) -> list[str]:
    """Every problem of a ``report_to`` value (empty when it is good), each a sentence naming what to
    change: its type, an unknown tracker (with the closest name), a tracker whose package is not
    installed (with the pip extra that installs it), ``"all"`` with none installed."""
    value = list(value) if isinstance(value, tuple) else value
    if value is None or value == "none" or value == ["none"]:
        return []
    if value == "all" or value == ["all"]:
        if any(installed(t) for t in TRACKERS):
            return []
        return [
            f"report_to='all' but none of {', '.join(TRACKERS)} is installed; "
            f"pip install 'mlora_lab[{ALL_EXTRA}]'"
        ]
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        return [
            "report_to must be a tracker name, a list of them, 'all' or 'none' "
            f"(got {brief(value)} of type {type(value).__name__})"
        ]
    if len(names) > len(TRACKERS) * 4:
        return [f"report_to lists {len(names):,} trackers; there are {len(TRACKERS)}: {', '.join(TRACKERS)}"]
    problems = []
    for n in dict.fromkeys(names):
        if n in ("all", "none"):
            problems.append(f"report_to: {n!r} stands alone, not in a list with other trackers")
        elif n not in TRACKERS:
            close = difflib.get_close_matches(n, TRACKERS, n=1) if len(n) <= 100 else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(
                f"report_to: unknown tracker {brief(n)}{hint}; known: {', '.join(TRACKERS)}, 'all' or 'none'"
            )
    missing = [n for n in dict.fromkeys(names) if n in TRACKERS and not installed(n)]
    problems += [
        f"report_to: {n} is not installed here; {install_hint([n])} "
        f"(or 'mlora_lab[{ALL_EXTRA}]' for {', '.join(TRACKERS)})"
        for n in missing
    ]
    return problems


def requested(value: Any) -> list[str]:
    """The trackers ``report_to`` asks for, in its order, once each: ``"all"`` is those installed,
    ``"none"`` / ``None`` / ``[]`` none. ``ValueError`` with every problem when it is not valid here."""
    problems = report_to_problems(value)
    if problems:
        raise ValueError("; ".join(problems))
    value = list(value) if isinstance(value, tuple) else value
    if value is None or value == "none" or value == ["none"]:
        return []
    if value == "all" or value == ["all"]:
        return [t for t in TRACKERS if installed(t)]
    return list(dict.fromkeys([value] if isinstance(value, str) else value))


def open_sink(run: RunDir, say: Callable[[str], None]) -> Background | None:
    """The job's mirror (rank 0), or ``None`` when its job.json asks for no tracker.

    Reads ``report_to`` and the rest from ``run``'s job.json, and the rows already in metrics.jsonl (a
    resumed job: each tenant's step so far). ``say(sentence)`` is how a tracker's failure reaches the
    run's events; nothing here raises. The trackers are imported only now, and only those asked for.
    """
    try:
        spec = JobSpec.load(run.job)
    except SpecError as e:  # the job wrote it just before; it knows its spec, this only cannot tell
        print(f"trackers: job.json not readable ({error_line(e)}); no rows are mirrored", flush=True)
        return None
    try:
        trackers = requested(spec.report_to)
    except ValueError as e:  # e.g. a tracker installed where the job was checked, not where it runs
        say(f"{error_line(e)}; no rows are mirrored (training goes on)")
        return None
    if not trackers:
        return None
    from mlora_lab.trackers.mirror import Background, Mirror

    # off the training loop: a tracker that is slow, or hangs, never holds a step up
    mirror = Background(lambda tell: Mirror(run, spec, trackers, tell), say)
    mirror.seed(MetricsReader(run.metrics).poll())
    atexit.register(mirror.close)  # a job that fails still finishes its tracker runs
    return mirror


def mirror_run(
    run: Any,
    to: Sequence[str] | str | None = None,
    *,
    group: str | None = None,
    logging_dir: str | os.PathLike | None = None,
    project: str | None = None,
) -> dict[str, str]:
    """Mirror every row of an existing run directory to the trackers ``to``, in this process; returns
    where each wrote (``{"tensorboard": "<dir>", ...}``).

    ``run`` is a run directory (or anything with a ``path``, such as a ``Run``). ``to``, ``group``,
    ``logging_dir`` and ``project`` default to the run's own ``report_to``, ``report_group``,
    ``logging_dir`` and ``project``. Sent again to the same place, TensorBoard and trackio still hold
    each step once (TensorBoard's restart marker replaces what its folder held, trackio skips the steps
    its run holds); W&B's runs keep their id, so a sync continues them. :class:`~mlora_lab.spec.fields.SpecError` for bad arguments (every problem at
    once); ``RuntimeError`` naming each tracker that failed, after the others are done.
    """
    from mlora_lab.trackers.mirror import Mirror

    rundir = RunDir(Path(os.fspath(getattr(run, "path", run))))
    if not rundir.is_run():
        raise FileNotFoundError(f"{rundir.root} is not a run directory (no job.json)")
    spec = JobSpec.load(rundir.job)
    wanted = spec.report_to if to is None else to
    problems = report_to_problems(wanted)
    if not problems and not requested(wanted):
        problems.append(f"say which trackers to mirror to: to=[{', '.join(repr(t) for t in TRACKERS)}]")
    if group is not None and group not in REPORT_GROUPS:
        problems.append(f"group must be one of {', '.join(REPORT_GROUPS)} (got {brief(group)})")
    if project is not None and not (
        isinstance(project, str) and len(project) <= MAX_NAME_LEN and SAFE_NAME.fullmatch(project)
    ):
        problems.append(
            f"project must be 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ - (got {brief(project)})"
        )
    if problems:
        raise SpecError(problems)
    trackers = requested(wanted)
    spec.report_group = spec.report_group if group is None else group
    spec.project = spec.project if project is None else project
    if logging_dir is not None:
        spec.logging_dir = os.path.abspath(os.fspath(logging_dir))
    failures: list[str] = []
    mirror = Mirror(rundir, spec, trackers, failures.append)
    for row in MetricsReader(rundir.metrics).poll():
        mirror.write(row)
    where = mirror.destinations()
    mirror.close()
    if failures:
        raise RuntimeError("; ".join(failures))
    return where


def report(
    run: Any,
    to: Sequence[str] | str | None = None,
    *,
    group: str | None = None,
    logging_dir: str | os.PathLike | None = None,
    project: str | None = None,
    timeout: float | None = 600,
) -> dict[str, str]:
    """``ml.report(run, to=["tensorboard"])``: :func:`mirror_run` in a child process, so the notebook's
    kernel never imports a tracker (W&B's and trackio's process-wide state, their output) and trackio
    writes where it is told (it reads its folder once, at import). Same arguments and result."""
    rundir = Path(os.fspath(getattr(run, "path", run))).absolute()
    args = {
        "run": str(rundir),
        "to": to,
        "group": group,
        "logging_dir": None if logging_dir is None else os.path.abspath(os.fspath(logging_dir)),
        "project": project,
    }
    done = subprocess.run(
        [sys.executable, "-m", "mlora_lab.trackers", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    # the trackers (and W&B's service process) print too: the answer is the last line with the marker
    answers = [line[len(ANSWER) :] for line in done.stdout.splitlines() if line.startswith(ANSWER)]
    answer = json.loads(answers[-1]) if answers else {}
    if "where" in answer:
        return answer["where"]
    error = answer.get("error") or (done.stderr.strip().splitlines() or ["no output"])[-1]
    kinds = {"ValueError": ValueError, "SpecError": ValueError, "FileNotFoundError": FileNotFoundError}
    kind = kinds.get(answer.get("type"))
    raise (kind or RuntimeError)(error)
