"""The run directory's layout, the one atomic-write helper, and ownership of a run directory.

Every path the job writes is derived here from the run directory's root and a name that came from
somewhere else (a tenant name from job.json or a control message, a rank). :meth:`RunDir.inside`
resolves such a path and refuses it unless it stays inside the run directory, so neither a crafted
name (``../../x``) nor a stray symlink planted in the directory can make the job write elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
"""A tenant name: it becomes a directory name (``adapters/<name>/``), so only these characters."""


FILE_MODE = 0o644
DIR_MODE = 0o755
"""The run directory's one mode policy: every file is created ``0644`` and every directory ``0755``, less
what the process's umask takes away (the modes ``os.open(path, flags, 0o644)`` and ``mkdir(0o755)`` give).
With the usual umask 022 anyone on the machine may read a run; with 077 only its owner. Files first written
under a temporary name (``mkstemp`` and safetensors create ``0600``) are given the same mode."""


def run_mode(directory: bool = False) -> int:
    """The mode of a new file (``directory=False``) or directory of a run under this process's umask."""
    return (DIR_MODE if directory else FILE_MODE) & ~_umask()


def _umask() -> int:
    try:  # (Linux: read it without setting it, which would race with other threads' new files)
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class TextEnum(str, Enum):
    """The run directory's enums: members are their JSON strings (``RunState.RUNNING == "running"``),
    and ``str()`` / f-strings give the plain value."""

    def __str__(self) -> str:
        return self.value


class RunDirError(RuntimeError):
    """A run directory, or a file in it, that cannot be used as asked; the message says why."""


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a safe tenant (directory) name, or None if it is."""
    if not isinstance(name, str):
        return f"a name must be a string (got {type(name).__name__})"
    if name in (".", ".."):
        return f"{name!r} is not allowed"
    if not SAFE_NAME.fullmatch(name):
        if not name:
            return "it is empty"
        if len(name) > 100:
            return f"it is {len(name)} characters long (at most 100)"
        bad = "".join(sorted({c for c in name if not SAFE_NAME.fullmatch(c)}))
        return f"it contains {bad[:20]!r}"
    return None


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (see the package docstring for the layout)."""

    root: Path

    def __init__(self, root: str | os.PathLike) -> None:
        object.__setattr__(self, "root", Path(root))

    job = property(lambda self: self.root / "job.json")
    status = property(lambda self: self.root / "status.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    logs = property(lambda self: self.root / "logs")
    adapters = property(lambda self: self.root / "adapters")
    checkpoints = property(lambda self: self.root / "checkpoints")
    control = property(lambda self: self.root / "control")
    labels = property(lambda self: self.root / "labels.json")
    lock = property(lambda self: self.root / ".lock")
    slurm_options = property(lambda self: self.root / "slurm.json")
    slurm_script = property(lambda self: self.root / "slurm.sbatch")
    sweep = property(lambda self: self.root / "sweep.json")
    search = property(lambda self: self.root / "search.json")

    def inside(self, path: str | os.PathLike) -> Path:
        """``path`` resolved (symlinks followed), checked to stay inside the run directory."""
        root = self.root.resolve()
        resolved = Path(path).resolve()
        if resolved != root and root not in resolved.parents:
            raise RunDirError(f"{path} resolves to {resolved}, outside the run directory {root}")
        return resolved

    def log(self, rank: int) -> Path:
        """Rank ``rank``'s log file."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise RunDirError(f"rank must be a non-negative integer (got {rank!r})")
        return self.inside(self.logs / f"rank{rank}.log")

    def adapter(self, tenant: str) -> Path:
        """``adapters/<tenant>``: the tenant's latest PEFT adapter directory."""
        problem = name_problem(tenant)
        if problem:
            raise RunDirError(f"tenant name {str(tenant)[:80]!r} cannot name a directory: {problem}")
        return self.inside(self.adapters / tenant)

    def is_run(self) -> bool:
        """True when the directory holds a run (a job.json)."""
        return self.job.is_file()

    def create(self) -> RunDir:
        """Create the directory and its sub-directories (those that exist are kept)."""
        self.root.mkdir(DIR_MODE, parents=True, exist_ok=True)
        for d in (self.logs, self.adapters, self.checkpoints, self.control):
            d.mkdir(DIR_MODE, exist_ok=True)
            self.inside(d)  # a planted symlink (adapters -> /elsewhere) is refused here
        return self


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old content or the new, never a mix, and
    a crash (or a full disk) leaves the old file intact: a temporary file in the same directory,
    fsynced, then renamed over ``path`` (which replaces a symlink there, never its target). Its mode is
    :func:`run_mode` unless ``mode`` is given."""
    path = Path(path)
    path.parent.mkdir(DIR_MODE, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, run_mode() if mode is None else mode)  # (mkstemp creates 0600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 text (a lone surrogate, which hostile input can carry into
    a message, is written as its ``\\udXXX`` escape rather than failing the write)."""
    atomic_write_bytes(path, text.encode("utf-8", "backslashreplace"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it onto ``path`` when the block ends
    without an exception: readers see the old directory or the complete new one. On an exception
    (a full disk, a crash of the writer) the temporary directory is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(DIR_MODE, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(tmp, run_mode(directory=True))
        yield tmp
        for f in tmp.iterdir():
            if f.is_file() and not f.is_symlink():
                os.chmod(f, run_mode())  # one policy for what the block wrote (safetensors makes 0600)
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if path.is_symlink() or path.is_file():
            path.unlink()
        if path.exists():
            # Swap: the old directory moves aside first, so ``path`` is never missing for long.
            old = path.parent / f".{path.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class RunLock:
    """Exclusive ownership of a run directory: an ``flock`` on ``<run_dir>/.lock``.

    The launcher holds it while it checks that nobody else owns the directory, writes the run's
    files and starts the job; the job's rank 0 holds it for the life of the job. A second launch,
    resume or job on the same directory cannot take it and is refused. The kernel drops the lock when
    its holder exits however it exits (kill -9 included), so a dead job never keeps its directory.
    """

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self._fd: int | None = None

    def acquire(self, timeout: float = 0.0, poll: float = 0.1) -> None:
        """Take the lock, waiting up to ``timeout`` seconds; :class:`RunDirError` if another holds it."""
        self.run.root.mkdir(DIR_MODE, parents=True, exist_ok=True)
        fd = os.open(self.run.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunDirError(
                        f"{self.run.root} is in use by another launch or a running job (it holds "
                        f"{self.run.lock.name}); wait for it to end, or stop it first"
                    ) from None
                time.sleep(poll)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        if self._fd is None:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def is_held_elsewhere(self) -> bool:
        """True if some other process holds the lock now (a probe: takes and drops it at once)."""
        if self._fd is not None or not self.run.lock.exists():
            return False
        try:
            self.acquire()
        except RunDirError:
            return True
        except OSError:
            return False
        self.release()
        return False
