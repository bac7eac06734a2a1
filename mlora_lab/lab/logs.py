"""A run's logs as the notebook side reads them: each rank's ``logs/rank<R>.log`` and the torchrun
agent's ``logs/launcher.log`` (a Slurm job's batch output goes there too)."""

from __future__ import annotations

import re
from pathlib import Path

from mlora_lab.rundir import RunDir

LAUNCHER_LOG = "launcher.log"
TAIL_BYTES = 64 << 10
"""A live view reads at most this much of a log's end (a long run's log grows without bound)."""


def log_path(run: RunDir, rank: int | None) -> Path:
    """Rank ``rank``'s log (``None``: the launcher's)."""
    return run.logs / LAUNCHER_LOG if rank is None else run.log(rank)


def read_log(run: RunDir, rank: int | None = 0, tail: int | None = 50) -> str:
    """The last ``tail`` lines (``None``: all) of rank ``rank``'s log (``None``: the launcher's); ``""``
    when it does not exist yet."""
    try:
        lines = log_path(run, rank).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-tail:] if tail else lines)


def tail_lines(path: Path, lines: int, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of a text file, reading at most its last ``max_bytes``."""
    try:
        with open(path, "rb") as f:
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
