"""``labels.json``: a run's tags and note, set by people (``run.tag("baseline")``, ``run.note("...")``)
and shown by ``ml.runs()``.

::

    {"tags": ["baseline", "rslora"], "note": "first try with rsLoRA on q/v"}

Only the notebook side writes it; the job never reads it, so labels can be changed while a run goes,
after it ended, or on a run another machine trained. A missing file means no labels. A change is a
read-modify-write under an ``flock`` on ``.labels.lock`` (two notebooks tagging the same run at once
both keep their tags), and the file is replaced atomically: a reader sees the old labels or the new.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlora_lab.rundir.files import LinkRefused, RunDir, RunDirError, atomic_write_json, guarded_open

TAG = re.compile(r"[^\s,]{1,40}")
"""A tag: 1 to 40 characters, no whitespace and no comma (``ml.runs()`` shows tags comma-joined)."""
MAX_TAGS = 32
MAX_NOTE_CHARS = 4000


def tag_problem(tag: Any) -> str | None:
    """Why ``tag`` cannot be a tag (None if it can)."""
    if not isinstance(tag, str):
        return f"a tag is a string (got {type(tag).__name__})"
    if not TAG.fullmatch(tag) or not tag.isprintable():
        if not tag:
            return "a tag cannot be empty"
        if len(tag) > 40:
            return f"tag {tag[:40]!r}... is {len(tag)} characters long (at most 40)"
        return f"tag {tag[:40]!r} contains whitespace, a comma or an unprintable character"
    return None


@dataclass(frozen=True)
class RunLabels:
    """A run's tags (in the order they were added, no duplicates) and its free-text note."""

    tags: tuple[str, ...] = ()
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"tags": list(self.tags), "note": self.note}

    @classmethod
    def from_dict(cls, d: Any, where: str = "labels.json") -> RunLabels:
        """Parse ``labels.json``'s object; :class:`RunDirError` naming the problem otherwise."""
        if not isinstance(d, dict):
            raise RunDirError(f"{where}: not a JSON object")
        tags, note = d.get("tags", []), d.get("note", "")
        if not isinstance(tags, list):
            raise RunDirError(f"{where}: 'tags' is not a list")
        problems = [p for p in map(tag_problem, tags) if p]
        if problems:
            raise RunDirError(f"{where}: {problems[0]}")
        if not isinstance(note, str):
            raise RunDirError(f"{where}: 'note' is not a string")
        return cls(tuple(dict.fromkeys(tags)), note)


def read_labels(run_dir: str | os.PathLike) -> RunLabels:
    """The run's labels (empty when it has none); :class:`RunDirError` if the file is corrupt."""
    path = RunDir(run_dir).labels
    try:
        with os.fdopen(guarded_open(path.parent, path, os.O_RDONLY, create=False), "rb") as f:
            text = f.read()  # (never through a link planted in its place)
    except FileNotFoundError:
        return RunLabels()
    except LinkRefused:
        raise
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        d = json.loads(text)
    except ValueError as e:
        raise RunDirError(f"{path}: corrupt ({e}); delete it to start the labels afresh") from None
    return RunLabels.from_dict(d, str(path))


def update_labels(
    run_dir: str | os.PathLike,
    add: Iterable[str] = (),
    remove: Iterable[str] = (),
    note: str | None = None,
) -> RunLabels:
    """Add tags ``add``, take away ``remove`` (absent ones are ignored) and, unless ``note`` is None,
    replace the note; returns the labels now stored. Bad tags or a note that is too long raise
    ``ValueError`` listing every problem, and nothing is written."""
    add, remove = list(add), list(remove)
    problems = [p for p in map(tag_problem, add) if p]
    if note is not None and not isinstance(note, str):
        problems.append(f"a note is a string (got {type(note).__name__})")
    elif note is not None and len(note) > MAX_NOTE_CHARS:
        problems.append(f"the note is {len(note)} characters long (at most {MAX_NOTE_CHARS})")
    if problems:
        raise ValueError("; ".join(problems))
    run = RunDir(run_dir)
    if not run.is_run():
        raise RunDirError(f"{run.root}: not a run directory (no job.json)")
    with _locked(run.root / ".labels.lock"):
        current = read_labels(run.root)
        gone = set(remove)
        tags = tuple(dict.fromkeys(t for t in (*current.tags, *add) if t not in gone))
        if len(tags) > MAX_TAGS:
            raise ValueError(f"a run has at most {MAX_TAGS} tags ({len(tags)} asked for)")
        labels = RunLabels(tags, current.note if note is None else note)
        if labels != current:
            atomic_write_json(run.labels, labels.to_dict(), root=run.root)
    return labels


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block."""
    fd = guarded_open(path.parent, path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock
