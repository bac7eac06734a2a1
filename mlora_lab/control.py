"""Control messages between the notebook and a running job: ``<run_dir>/control/``.

The notebook writes one JSON file per command (atomically: a hidden temporary file renamed into
place), named so that lexical order is arrival order::

    control/<time_ns>-<id>.json     {"id", "op": "add" | "remove" | "pause" | "resume", "tenant" | "name"}

Rank 0 of the job reads pending messages at a step boundary, broadcasts them to every rank (so all
ranks apply them at the same step), moves each file to ``control/done/`` and writes its outcome to
``control/results/<id>.json`` ({"ok": bool, "error": str | None, "step": int}). ``control/stop``
(a plain file) asks for a graceful stop.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from mlora_lab.rundir import RunDir, atomic_write_json

OPS = ("add", "remove", "pause", "resume")


class ControlError(RuntimeError):
    """A control message the job rejected (its reason is the message)."""


def send(run_dir: str | Path, op: str, **payload: Any) -> str:
    """Queue a control message; returns its id."""
    if op not in OPS:
        raise ValueError(f"unknown control op {op!r}; known: {', '.join(OPS)}")
    control = RunDir(run_dir).control
    control.mkdir(parents=True, exist_ok=True)
    msg_id = uuid.uuid4().hex[:12]
    atomic_write_json(control / f"{time.time_ns():020d}-{msg_id}.json", {"id": msg_id, "op": op, **payload})
    return msg_id


def pending(run_dir: str | Path) -> list[tuple[Path, dict | str]]:
    """Queued messages in arrival order: ``(path, message)``, or ``(path, problem)`` for a file that
    is not a valid message (it is rejected, never half-applied)."""
    out: list[tuple[Path, dict | str]] = []
    for path in sorted(RunDir(run_dir).control.glob("[0-9]*.json")):
        try:
            msg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            out.append((path, f"{path.name}: not a valid JSON message ({e})"))
            continue
        if not isinstance(msg, dict) or msg.get("op") not in OPS:
            out.append((path, f"{path.name}: needs an 'op' in {', '.join(OPS)}"))
            continue
        out.append((path, msg))
    return out


def finish(
    run_dir: str | Path, path: Path, msg_id: str | None, ok: bool, error: str | None, step: int
) -> None:
    """Record a message's outcome and move it out of the queue."""
    run = RunDir(run_dir)
    msg_id = msg_id or path.stem.split("-", 1)[-1]
    atomic_write_json(run.control / "results" / f"{msg_id}.json", {"ok": ok, "error": error, "step": step})
    (run.control / "done").mkdir(exist_ok=True)
    os.replace(path, run.control / "done" / path.name)


def wait_result(run_dir: str | Path, msg_id: str, timeout: float = 120, is_alive=lambda: True) -> dict:
    """Wait for the job to apply message ``msg_id``; raise :class:`ControlError` if it was rejected."""
    path = RunDir(run_dir).control / "results" / f"{msg_id}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job did not answer control message {msg_id} within {timeout} s")
        if not is_alive():
            raise ControlError(f"the job ended before applying control message {msg_id}")
        time.sleep(0.1)
    result = json.loads(path.read_text())
    if not result["ok"]:
        raise ControlError(result["error"])
    return result
