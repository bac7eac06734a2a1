"""A run's logs as the notebook side reads them: each rank's ``logs/rank<R>.log`` and the torchrun
agent's ``logs/launcher.log`` (a Slurm job's batch output goes there too)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from mlora_lab.rundir import RunDir, RunDirError, guarded_open

LAUNCHER_LOG = "launcher.log"
TAIL_BYTES = 64 << 10
"""A live view reads at most this much of a log's end (a long run's log grows without bound)."""


def log_path(run: RunDir, rank: int | None) -> Path:
    """Rank ``rank``'s log (``None``: the launcher's)."""
    return run.logs / LAUNCHER_LOG if rank is None else run.log(rank)


def read_log(run: RunDir, rank: int | None = 0, tail: int | None = 50) -> str:
    """The last ``tail`` lines (``None``: all) of rank ``rank``'s log (``None``: the launcher's); ``""``
    when it does not exist yet; why not, in parentheses, when it is a symlink (or a FIFO) planted there
    (never read through)."""
    try:
        path = log_path(run, rank)
        with open(guarded_open(run.root, path, os.O_RDONLY, create=False), "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return ""
    except RunDirError as e:
        return f"({e})"
    return "\n".join(lines[-tail:] if tail else lines)


def tail_lines(path: Path, lines: int, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of a text file, reading at most its last ``max_bytes``."""
    try:
        with open(
            guarded_open(path.parent, path, os.O_RDONLY, create=False), "rb"
        ) as f:  # (no link, no FIFO)
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def log_files(run: RunDir) -> list[Path]:
    """Every log of the run: the ranks' in rank order, then the launcher's."""
    paths = sorted(run.logs.glob("rank*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if (run.logs / LAUNCHER_LOG).exists():
        paths.append(run.logs / LAUNCHER_LOG)
    return paths
