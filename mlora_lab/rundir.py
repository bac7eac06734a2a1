"""The run directory: layout, atomic writes, status, and the metrics log (writer and incremental reader).

```
<run_dir>/job.json            the spec as launched
<run_dir>/status.json         {"state", "pid", "started", "ended", "error"} — written atomically
<run_dir>/metrics.jsonl       one JSON object per line, appended by rank 0
<run_dir>/logs/rank<R>.log    each rank's stdout+stderr
<run_dir>/adapters/<tenant>/  latest PEFT adapter dir of that tenant
<run_dir>/checkpoints/        resumable state (written to a temp name, then renamed)
<run_dir>/control/            commands from the notebook
```

Both the trainer and the notebook side use this module; it imports nothing from the training code.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

STATES = ("starting", "running", "finished", "failed", "stopped")
FINAL_STATES = ("finished", "failed", "stopped")


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    job = property(lambda self: self.root / "job.json")
    status = property(lambda self: self.root / "status.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    logs = property(lambda self: self.root / "logs")
    adapters = property(lambda self: self.root / "adapters")
    checkpoints = property(lambda self: self.root / "checkpoints")
    control = property(lambda self: self.root / "control")

    def log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def adapter(self, tenant: str) -> Path:
        return self.adapters / tenant

    def create(self) -> RunDir:
        for d in (self.root, self.logs, self.adapters, self.checkpoints, self.control):
            d.mkdir(parents=True, exist_ok=True)
        return self


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """status.json as a dict (``{}`` when it does not exist yet)."""
    try:
        return json.loads(RunDir(run_dir).status.read_text())
    except FileNotFoundError:
        return {}


def update_status(run_dir: str | Path, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into status.json (atomically) and return the new status."""
    status = {"state": None, "pid": None, "started": None, "ended": None, "error": None}
    status.update(read_status(run_dir))
    status.update(fields)
    atomic_write_json(RunDir(run_dir).status, status)
    return status


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl; each row is written with a single
    ``write`` + flush, so a reader sees whole lines, or a last line without its newline (which
    :class:`MetricsReader` leaves for later)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open for the run

    def write(self, kind: str, **row: Any) -> None:
        row = {"kind": kind, **row}
        row.setdefault("time", time.time())
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MetricsReader:
    """Reads metrics.jsonl incrementally: remembers its byte offset and never parses a partial line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.rows: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """Rows appended since the last call (also kept in ``self.rows``)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        new = [orjson.loads(line) for line in chunk[: end + 1].splitlines() if line.strip()]
        self.offset += end + 1
        self.rows.extend(new)
        return new
