"""The run directory's layout, the guard every writer goes through, and ownership of a run directory.

Every path the job writes is derived here from the run directory's root and a name that came from
somewhere else (a tenant name from job.json or a control message, a rank). Whoever can write into a
run directory (a shared filesystem, a second user) can also plant a symlink there, so no file of a run
is ever opened, created or replaced through one. One guard does it, for every writer of the package:

    run.inside(path)                          # path, lexically inside the run, no link below its root
    fd = guarded_open(root, path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)   # a log, metrics.jsonl, a lock
    atomic_write_bytes(path, data, root=root) # a whole file (status.json, a control message, an export)
    with atomic_directory(path, root=root) as tmp: ...     # a whole directory (an adapter, a checkpoint)

A folder the user names (a merged model's) is written differently, since it may hold the user's own files:
``with files_into(path) as tmp:`` adds files, never removes or replaces one it did not write, and
:func:`run_holding` tells whether a path is inside a run directory (which no export writes into).

Each walks from ``root`` (trusted as given: it may itself be a link, say to a bigger disk) one folder at
a time with ``O_NOFOLLOW``, holding each folder open, and opens or renames the last name relative to
its folder, so a link planted anywhere below ``root`` (a folder or the file itself) is refused with
:class:`LinkRefused`, which names it, even one planted while the writer walks. An atomic write onto a
link replaces the link, never the file it leads to. Without ``root``, the file's own folder is the root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from mlora_lab.rundir.legacy import options_file
from mlora_lab.text import show_path

T = TypeVar("T")

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


class LinkRefused(RunDirError, OSError):
    """A file of a run directory that would be written (or read) through a symlink, or a path that
    leads outside the directory. Also an ``OSError``: a write that was refused is a write that failed,
    for every ``except OSError`` that handles one (a failed save, a metrics row kept in memory)."""


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
        # Absolute: the guarded writers and readers take a path below the root as relative to the root, so
        # a relative root ("lab/runs/x") would put its files at lab/runs/x/lab/runs/x/... (ml.runs("lab/runs")
        # lost every tag and note so).
        object.__setattr__(self, "root", Path(os.path.abspath(root)))

    job = property(lambda self: self.root / "job.json")
    status = property(lambda self: self.root / "status.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    logs = property(lambda self: self.root / "logs")
    adapters = property(lambda self: self.root / "adapters")
    data = property(lambda self: self.root / "data")
    checkpoints = property(lambda self: self.root / "checkpoints")
    control = property(lambda self: self.root / "control")
    labels = property(lambda self: self.root / "labels.json")
    lock = property(lambda self: self.root / ".lock")
    slurm_options = property(lambda self: self.launcher_options("slurm"))
    slurm_script = property(lambda self: self.root / "slurm.sbatch")
    sweep = property(lambda self: self.root / "sweep.json")
    search = property(lambda self: self.root / "search.json")
    service = property(lambda self: self.root / "service")

    def launcher_options(self, launcher: str) -> Path:
        """Where a launch records the options of ``launcher`` (its ``options_type`` as JSON), which a
        resume reads again: ``<launcher>_options.json``, or the name it had before the seam
        (:data:`~mlora_lab.rundir.legacy.LEGACY`: Slurm's ``slurm.json``)."""
        return self.root / options_file(launcher)

    def inside(self, path: str | os.PathLike) -> Path:
        """``path`` checked: lexically inside the run directory, and no part of it below the root (the
        folders on the way, the file itself) is a symlink. Returns it under the resolved root.
        :class:`LinkRefused` naming the link (or the way out) otherwise. Parts that do not exist yet
        are fine: the writers create them (never through a link either, see :func:`guarded_open`)."""
        root = self.root.resolve()
        parts = relative_parts(self.root, path)
        here = root
        for part in parts:
            here = here / part
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                break
            except OSError as e:
                raise LinkRefused(f"{show_path(here)}: cannot be checked ({e.strerror or e})") from None
            if stat.S_ISLNK(st.st_mode):
                raise LinkRefused(link_message(here, root))
        return root.joinpath(*parts)

    def links(self) -> list[Path]:
        """The symlinks planted where the job or a launch writes: its folders (``logs/``, ``control/``
        and the folders in it, ``adapters/``, ``checkpoints/``) and the files it appends to (each log,
        metrics.jsonl, the lock). Each would be refused by the writer (:func:`guarded_open`): a resume
        names them all before it starts anything. (A link at a file that is written whole, status.json
        say, is replaced, not refused.)"""
        control = [self.control / name for name in ("applying", "done", "rejected", "results")]
        paths = [self.logs, self.control, *control, self.adapters, self.checkpoints, self.metrics, self.lock]
        with contextlib.suppress(OSError):
            if not self.logs.is_symlink():
                paths += sorted(self.logs.iterdir())
        return [p for p in paths if p.is_symlink()]

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

    def tenant_data(self, tenant: str, split: str) -> Path:
        """``data/<tenant>/<split>.jsonl`` (``split``: ``"train"`` or ``"eval"``): the rows a tenant was
        given in memory (a DataFrame, ...), written by the launch or ``run.add_tenant``; job.json names it."""
        problem = name_problem(tenant)
        if problem:
            raise RunDirError(f"tenant name {str(tenant)[:80]!r} cannot name a directory: {problem}")
        if split not in ("train", "eval"):
            raise RunDirError(f"a tenant's data split is 'train' or 'eval' (got {str(split)[:80]!r})")
        return self.inside(self.data / tenant / f"{split}.jsonl")

    def reward(self, tenant: str, index: int, name: str, role: str = "") -> Path:
        """``rewards/<tenant>/<role><index>-<name>.pkl``: a reward function the tenant was given as a callable
        (``role`` ``""``; an agent's env ``"env"``, its tools ``"tool"``), pickled by value at launch or
        ``run.add_tenant`` (job.json names it ``"<that path>:<name>"``)."""
        problem = name_problem(tenant) or (None if name.isidentifier() else f"{name[:40]!r} is no identifier")
        problem = problem or (None if role in ("", "env", "tool") else f"{role[:40]!r} is no function role")
        if problem:
            raise RunDirError(f"a reward file of tenant {str(tenant)[:80]!r} cannot be named: {problem}")
        return self.inside(self.root / "rewards" / tenant / f"{role}{int(index)}-{name}.pkl")

    def is_run(self) -> bool:
        """True when the directory holds a run (a job.json)."""
        return self.job.is_file()

    def create(self) -> RunDir:
        """Create the directory and its sub-directories (those that exist are kept; a symlink planted
        in place of one, ``adapters -> /elsewhere``, is refused)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for d in (self.logs, self.adapters, self.checkpoints, self.control):
            os.close(open_folder(self.root, relative_parts(self.root, d), create=True))
        return self


def is_run_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a run directory: it holds a status.json (a launch writes one), or a job.json beside
    the folders :meth:`RunDir.create` makes (``control/``, ``checkpoints/``). A project folder that keeps its own
    job.json (``mlora-lab run job.json``) is no run."""
    here = Path(folder)
    if os.path.lexists(here / "status.json"):
        return True
    return os.path.lexists(here / "job.json") and any(
        os.path.isdir(here / d) for d in ("control", "checkpoints")
    )


def run_holding(path: str | os.PathLike) -> Path | None:
    """The run directory ``path`` is in, or is: the nearest folder at or above it that is one
    (:func:`is_run_folder`), found both by the path's names and through the links on the way
    (``out -> runs/x/adapters``). None when no run holds it. What writers of a user's paths (merges, exports)
    check: a run's files are the job's, and replacing one (job.json, a checkpoint, another tenant's adapter)
    loses the run."""
    given = Path(os.path.abspath(path))
    for chain in (given, Path(os.path.realpath(given))):
        for folder in (chain, *chain.parents):
            if is_run_folder(folder):
                return folder
    return None


# ---------------------------------------------------------------------------------------------
# The guard: paths below a root, walked without following a link
# ---------------------------------------------------------------------------------------------


def relative_parts(root: str | os.PathLike, path: str | os.PathLike) -> tuple[str, ...]:
    """The names that lead from ``root`` to ``path`` (absolute, or relative to ``root``), found
    lexically (``a/../b`` is ``b``: the writers open what the names say, never following a link, so
    this is where they write); :class:`LinkRefused` if ``path`` is not below ``root``."""
    base = Path(os.path.abspath(root))
    p = Path(path)
    p = Path(os.path.abspath(p if p.is_absolute() else base / p))
    for candidate in (base, Path(os.path.realpath(base))):
        with contextlib.suppress(ValueError):
            return p.relative_to(candidate).parts
    raise LinkRefused(f"{show_path(p)} is outside the run directory {show_path(base)}")


def link_message(path: Path, root: Path) -> str:
    """Why a symlink at ``path`` is refused (its target shown, never a newline of it as a line)."""
    try:
        target = show_path(os.readlink(path))
    except OSError:
        target = "?"
    return (
        f"{show_path(path)} is a symbolic link (to {target}); files of the run directory "
        f"{show_path(root)} are never written or read through a link, which can lead outside it: "
        "remove the link"
    )


def _refusal(e: OSError, folder_fd: int, name: str, where: Path, root: Path) -> OSError:
    """The error for ``e``, raised opening ``name`` in ``folder_fd``: :class:`LinkRefused` when a link
    is in the way (or something that is not a folder, or not a regular file, where one goes), else
    ``e`` itself."""
    try:
        kind = stat.S_IFMT(os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode)
    except OSError:
        return e
    if kind == stat.S_IFLNK:
        return LinkRefused(link_message(where, root))
    if e.errno == errno.ENOTDIR:
        return LinkRefused(f"{show_path(where)} is not a folder")
    if e.errno == errno.ENXIO or kind not in (stat.S_IFREG, stat.S_IFDIR):
        return LinkRefused(f"{show_path(where)} is not a regular file (a FIFO, a socket or a device)")
    return e


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_folder(root: str | os.PathLike, parts: Sequence[str], create: bool = False) -> int:
    """A descriptor of the folder ``root/parts...``, opened one name at a time without following a
    link (``root`` itself is trusted as given); missing folders are created (0755) when ``create``.
    The caller closes it."""
    root = Path(root)
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = root
    try:
        for part in parts:
            here = here / part
            try:
                sub = os.open(part, _FOLDER, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, DIR_MODE, dir_fd=fd)
                try:
                    sub = os.open(part, _FOLDER, dir_fd=fd)
                except OSError as e:
                    raise _refusal(e, fd, part, here, root) from None
            except OSError as e:
                raise _refusal(e, fd, part, here, root) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _split(path: str | os.PathLike, root: str | os.PathLike | None) -> tuple[Path, tuple[str, ...], str]:
    """(root, folders from the root to the file, the file's name) for a write of ``path``."""
    path = Path(path)
    base = Path(root) if root is not None else path.parent
    parts = relative_parts(base, path)
    if not parts:
        raise LinkRefused(f"{show_path(path)} names the run directory itself, not a file in it")
    return base, parts[:-1], parts[-1]


def guarded_open(
    root: str | os.PathLike, path: str | os.PathLike, flags: int, mode: int = FILE_MODE, create: bool = True
) -> int:
    """``os.open(path, flags | O_NOFOLLOW)`` for a file below ``root``, through no link (see the module
    docstring), its folders created when ``create``. Only a regular file is opened: a FIFO or a device
    planted in its place is refused without blocking. The caller closes the descriptor."""
    base, folders, name = _split(path, root)
    folder = open_folder(base, folders, create=create)
    where = base.joinpath(*folders, name)
    try:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=folder)
        except OSError as e:
            raise _refusal(e, folder, name, where, base) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LinkRefused(f"{show_path(where)} is not a regular file (a FIFO, a device or a folder)")
        os.set_blocking(fd, True)
        return fd
    finally:
        os.close(folder)


def read_guarded(root: str | os.PathLike, path: str | os.PathLike) -> bytes:
    """The bytes of the regular file ``path`` below ``root``, opened as the writers open theirs (each folder
    on the way and the file itself without following a link, :func:`guarded_open`): what a reader of files
    that requests name uses, so that a link planted in the run never leads it outside."""
    fd = guarded_open(root, path, os.O_RDONLY, create=False)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def check_no_links(root: str | os.PathLike, path: str | os.PathLike) -> Path:
    """``path`` (below ``root``) checked for a reader that goes by names (PEFT loading a folder, say): no
    part of it below ``root`` is a link, and when it is a folder, nothing in it is a link or anything but
    folders and regular files (a FIFO would block its reader). :class:`LinkRefused` naming the first one
    found; ``FileNotFoundError`` when ``path`` is not there. Returns ``path`` under ``root``.

    (A check, then the caller's read: the files a run's own writers put there, not the links someone may
    plant between the two; where this process reads the files itself it uses :func:`read_guarded`.)"""
    base = Path(root)
    parts = relative_parts(base, path)
    here = base
    for part in parts:
        here = here / part
        st = os.lstat(here)  # (FileNotFoundError: not there)
        if stat.S_ISLNK(st.st_mode):
            raise LinkRefused(link_message(here, base))
    if stat.S_ISDIR(os.lstat(here).st_mode):
        for folder, dirs, names in os.walk(here, followlinks=False):
            for name in [*dirs, *names]:
                entry = Path(folder) / name
                kind = stat.S_IFMT(os.lstat(entry).st_mode)
                if kind == stat.S_IFLNK:
                    raise LinkRefused(link_message(entry, base))
                if kind not in (stat.S_IFREG, stat.S_IFDIR):
                    raise LinkRefused(
                        f"{show_path(entry)} is not a regular file (a FIFO, a socket or a device)"
                    )
    return here


def fsync_dir(path: str | os.PathLike | int) -> None:
    """Make a rename or a new entry in directory ``path`` (or an open descriptor of it) durable."""
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        if isinstance(path, int):
            os.fsync(path)
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temporary_name(name: str, kind: str) -> str:
    return f".{name}.{kind}-{secrets.token_hex(6)}"


def atomic_write_bytes(
    path: str | os.PathLike, data: bytes, mode: int | None = None, *, root: str | os.PathLike | None = None
) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old content or the new, never a mix, and
    a crash (or a full disk) leaves the old file intact: a temporary file in the same folder, fsynced,
    then renamed over ``path`` (which replaces a symlink there, never its target). The folders from
    ``root`` (default: the file's own folder) are walked and created without following a link."""
    base, folders, name = _split(path, root)
    folder = open_folder(base, folders, create=True)
    try:
        tmp = _temporary_name(name, "tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder
        )
        try:
            os.fchmod(fd, run_mode() if mode is None else mode)  # (created 0600 while it is written)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
        fsync_dir(folder)
    finally:
        os.close(folder)


def atomic_write_text(path: str | os.PathLike, text: str, *, root: str | os.PathLike | None = None) -> None:
    """:func:`atomic_write_bytes` of UTF-8 text (a lone surrogate, which hostile input can carry into
    a message, is written as its ``\\udXXX`` escape rather than failing the write)."""
    atomic_write_bytes(path, text.encode("utf-8", "backslashreplace"), root=root)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, root: str | os.PathLike | None = None) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n", root=root)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it onto ``path`` when the block ends
    without an exception: readers see the old directory or the complete new one. On an exception
    (a full disk, a crash of the writer) the temporary directory is removed and ``path`` is untouched.

    The folders from ``root`` (default: the directory's own parent) are walked and created without
    following a link, and held open: the swap happens in the folder that was checked. The temporary
    directory is private (0700) until it is complete, so nobody plants anything in it while the
    block writes there; a link found at ``path`` itself is replaced, never followed."""
    base, folders, name = _split(path, root)
    folder = open_folder(base, folders, create=True)
    tmp = _temporary_name(name, "tmp")
    try:
        os.mkdir(tmp, 0o700, dir_fd=folder)
        yield base.joinpath(*folders, tmp)
        inner = os.open(tmp, _FOLDER, dir_fd=folder)
        try:
            for entry in os.listdir(inner):
                if stat.S_ISREG(os.stat(entry, dir_fd=inner, follow_symlinks=False).st_mode):
                    fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=inner)
                    try:
                        os.fchmod(fd, run_mode())  # one policy for what the block wrote (safetensors: 0600)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            fsync_dir(inner)
        finally:
            os.close(inner)
        os.chmod(tmp, run_mode(directory=True), dir_fd=folder)
        try:
            old = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            old = None
        if old is not None and not stat.S_ISDIR(old.st_mode):
            os.unlink(name, dir_fd=folder)  # a file or a link in its place: replaced, never followed
            old = None
        if old is not None:
            # Swap: the old directory moves aside first, so ``path`` is never missing for long.
            aside = _temporary_name(name, f"old-{os.getpid()}")
            os.replace(name, aside, src_dir_fd=folder, dst_dir_fd=folder)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            shutil.rmtree(aside, dir_fd=folder, ignore_errors=True)
        else:
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, dir_fd=folder, ignore_errors=True)
        os.close(folder)


@contextlib.contextmanager
def files_into(
    path: str | os.PathLike,
    *,
    replace: bool = False,
    stale: Callable[[str], bool] | None = None,
    last: str | None = None,
) -> Iterator[Path]:
    """Write files into the folder ``path`` (made, with its parents, if missing), which may hold files of its
    own that are never removed: the block writes into a private temporary folder inside ``path``, and when it
    ends without an exception its files move in.

    - a name ``path`` already holds is replaced only with ``replace`` (and only by a file: a folder of that
      name is never touched); without it the move is refused (``FileExistsError``, before anything moves), and
      a name that appears meanwhile is never overwritten either (each file is linked in, which fails on an
      existing name, then its temporary name removed);
    - ``stale(name)``: files of an earlier write of the same kind that this one does not write (a model saved
      in 3 shards before, in 1 now), removed with ``replace`` so the folder holds one write, not a mix;
    - ``last``: the file whose presence says the folder is complete (a model's ``config.json``): an old one
      is removed first and the new one moved in last, so a crash half-way never leaves a folder that looks
      complete.

    On an exception the temporary folder is removed and ``path`` keeps what it held. The block's files get the
    run's file mode (:func:`run_mode`; safetensors creates ``0600``) and are fsynced. Only files: a folder the
    block writes is refused. The user's path is trusted as given (links in it are followed, as any program
    writing there would); the files moved in replace links of their name rather than write through them."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    tmp = _temporary_name("write", "tmp")
    try:
        os.mkdir(tmp, 0o700, dir_fd=fd)
        yield folder / tmp
        inner = os.open(tmp, _FOLDER, dir_fd=fd)
        try:
            names = sorted(os.listdir(inner))
            for name in names:
                if not stat.S_ISREG(os.stat(name, dir_fd=inner, follow_symlinks=False).st_mode):
                    raise IsADirectoryError(
                        errno.EISDIR, f"only files are written into {show_path(folder)}", name
                    )
                file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=inner)
                try:
                    os.fchmod(file, run_mode())
                    os.fsync(file)
                finally:
                    os.close(file)

            def kind(name: str) -> int | None:
                try:
                    return stat.S_IFMT(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
                except FileNotFoundError:
                    return None

            held = [n for n in names if kind(n) is not None]
            if held and not replace:
                raise FileExistsError(
                    errno.EEXIST, f"{show_path(folder)} already holds {', '.join(held[:5])}"
                )
            for name in held:
                if kind(name) == stat.S_IFDIR:
                    raise IsADirectoryError(
                        errno.EISDIR, f"{show_path(folder / name)} is a folder, not a file"
                    )
            order = [n for n in names if n != last] + [n for n in names if n == last]
            if replace:
                if last in names and kind(last) is not None:
                    os.unlink(last, dir_fd=fd)  # first: from here on the folder does not look complete
                for name in os.listdir(fd):
                    if stale is not None and name not in names and stale(name) and kind(name) != stat.S_IFDIR:
                        os.unlink(name, dir_fd=fd)
            moved: list[str] = []
            try:
                for name in order:
                    if replace:
                        os.replace(name, name, src_dir_fd=inner, dst_dir_fd=fd)
                    else:
                        _link_new(name, inner, fd, folder)
                    moved.append(name)
            except BaseException:
                if not replace:  # (what this call added goes again: the folder is as it was)
                    for name in moved:
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=fd)
                raise
            fsync_dir(fd)
        finally:
            os.close(inner)
    finally:
        shutil.rmtree(tmp, dir_fd=fd, ignore_errors=True)
        os.close(fd)


def _link_new(name: str, src: int, dst: int, folder: Path) -> None:
    """Move the file ``name`` from the folder ``src`` into ``dst`` only if ``dst`` has no such name: a hard link
    (which fails on a name that exists, even one made a moment ago); where the filesystem has no hard links, a
    rename after a look (the moment between is the only window)."""
    try:
        os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
        return
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{show_path(folder)} already holds {name}") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    if os.path.lexists(folder / name):
        raise FileExistsError(errno.EEXIST, f"{show_path(folder)} already holds {name}")
    os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)


def move_into(root: str | os.PathLike, path: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Move the file ``path`` into ``folder`` (both below ``root``), keeping its name: the rename
    happens between folders opened without following a link, and a link at ``path`` is moved as
    the link it is (never followed). Returns the new path."""
    base, src_folders, name = _split(path, root)
    dst_parts = relative_parts(base, folder)
    src = open_folder(base, src_folders)
    try:
        dst = open_folder(base, dst_parts, create=True)
        try:
            os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return Path(base).joinpath(*dst_parts, name)


# ---------------------------------------------------------------------------------------------
# Room for the last words on a full disk
# ---------------------------------------------------------------------------------------------

SPARE = ".spare"
SPARE_BYTES = 256 << 10
"""What the job keeps allocated in ``<run_dir>/.spare``: on a full disk, freeing part of it makes room
for status.json to say so (a few KB each time; the rest is allocated again right after)."""
SPARE_PIECE = 32 << 10
"""What :func:`with_spare` frees at a time: room for a status.json many times over, and a small part of
the spare, so that room taken by another writer of the same disk before ours (a race no lock covers:
the disk is shared) costs one piece, not the whole reserve."""
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def reserve_spare(root: str | os.PathLike, size: int = SPARE_BYTES) -> int:
    """Allocate (up to) ``size`` bytes in ``root/.spare``: as much of it as the disk has room for, in
    ever smaller pieces (so a full disk stays full: the spare never leaves room that another write
    then takes); returns the bytes it holds. Never raises."""
    try:
        fd = guarded_open(root, Path(root) / SPARE, os.O_WRONLY | os.O_CREAT, 0o600, create=False)
    except OSError:
        return 0
    try:
        held = os.fstat(fd).st_size
        piece = size - held
        while held < size and piece >= 4096:
            piece = min(piece, size - held)
            try:
                os.posix_fallocate(fd, held, piece)
                held += piece
            except OSError:
                piece //= 2
        return held
    finally:
        os.close(fd)


def _shrink_spare(root: str | os.PathLike, piece: int = SPARE_PIECE) -> bool:
    """Free the last ``piece`` bytes of ``root/.spare`` (a truncation: the disk gets them back at once);
    False when there is no spare left to free."""
    try:
        fd = guarded_open(root, Path(root) / SPARE, os.O_WRONLY, create=False)
    except OSError:
        return False
    try:
        held = os.fstat(fd).st_size
        if held == 0:
            return False
        os.ftruncate(fd, max(0, held - piece))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def with_spare(root: str | os.PathLike, write: Callable[[], T]) -> T:
    """``write()``; while the disk is full and ``root`` holds a spare allocation (:func:`reserve_spare`),
    free a piece of it (:data:`SPARE_PIECE`) and ``write()`` again; then allocate what is free again.

    Freeing the spare piece by piece, not at once: a job's last status was lost when a concurrent
    writer filled the room the whole spare had made before the spare was taken back (the next full-disk
    write then found an empty spare). Now such a thief takes one piece and the next is still there."""
    shrunk = False
    try:
        while True:
            try:
                return write()
            except OSError as e:
                if e.errno not in NO_SPACE or not _shrink_spare(root):
                    raise
                shrunk = True
    finally:
        if shrunk:
            reserve_spare(root)


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
        fd = guarded_open(self.run.root, self.run.lock, os.O_RDWR | os.O_CREAT)
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
