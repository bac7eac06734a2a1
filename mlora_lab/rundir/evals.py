"""Saved evaluations: ``<run>/evals/<name>/``, the format :func:`mlora_lab.evaluate` writes and the lab reads.

An evaluation is two files, each written atomically (a reader sees the old evaluation or the new one):

- ``meta.json``, an :class:`EvalMeta`: what was asked (models, metrics, sampling) and when;
- ``examples.jsonl``, one :class:`EvalExample` per (example, model, sample): the prompt, the completion,
  every metric's score (``None``: not scored), and the example's reference columns.

Written last, ``meta.json`` is the evaluation's commit mark: a folder without it is an evaluation being
written (or one whose writer died), which readers do not list.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import msgspec

from mlora_lab.rundir.files import atomic_write_bytes

EVALS_DIR = "evals"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""An evaluation's name: it names a folder (letters, digits, ``. _ -``, at most 100, not starting with
``.``)."""


class EvalMeta(msgspec.Struct, kw_only=True):
    """What an evaluation asked for."""

    name: str
    models: list[str]
    """The columns of its tables: ``base``, tenants' names, adapter folders' names."""
    metrics: list[str]
    """The metrics' names, in the order given (the score columns)."""
    data: str
    """Where its examples came from (a file's path, ``DataFrame``, a Hub dataset's id...)."""
    examples: int
    num_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    step: int | None = None
    """The job's global step it was taken at, for an evaluation during training (None: after)."""
    time: float = msgspec.field(default_factory=time.time)
    seconds: float | None = None
    """How long it took (generation and metrics)."""
    left_out: dict[str, str] = msgspec.field(default_factory=dict)
    """Tenants of the run not evaluated by default, and why: those that failed (their reason)."""


class EvalExample(msgspec.Struct, kw_only=True):
    """One completion of one example by one model, and its scores."""

    example: int
    model: str
    sample: int
    prompt: Any
    """The example's prompt as given: a text, or a chat (a list of ``{"role", "content"}``)."""
    completion: str
    scores: dict[str, float | None]
    columns: dict[str, Any] = msgspec.field(default_factory=dict)
    """The example's other columns (its reference answer, ...), as the metrics got them."""
    tokens: int = 0
    """The completion's length in tokens."""
    stop_reason: str = "length"


def eval_dir(root: str | os.PathLike, name: str) -> Path:
    """The folder of evaluation ``name`` of run ``root``; ``ValueError`` for a name that cannot be one."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"an evaluation's name names a folder: letters, digits, '.', '_', '-' (at most 100); got {name!r}"
        )
    return Path(root) / EVALS_DIR / name


def write_eval(root: str | os.PathLike, meta: EvalMeta, examples: list[EvalExample]) -> Path:
    """Save an evaluation into run ``root`` (replacing one of the same name): the examples first, then
    its meta (the commit mark). Returns its folder."""
    folder = eval_dir(root, meta.name)
    encoder = msgspec.json.Encoder()
    lines = b"".join(encoder.encode(e) + b"\n" for e in examples)
    atomic_write_bytes(folder / "examples.jsonl", lines, root=root)
    atomic_write_bytes(folder / "meta.json", encoder.encode(meta) + b"\n", root=root)
    return folder


def read_eval(root: str | os.PathLike, name: str) -> tuple[EvalMeta, list[EvalExample]]:
    """A saved evaluation of run ``root``: ``FileNotFoundError`` naming the ones there are when it has
    none of that name; ``ValueError`` naming the file and line of a damaged one."""
    folder = eval_dir(root, name)
    if not (folder / "meta.json").is_file():
        there = list_evals(root)
        raise FileNotFoundError(
            f"run {Path(root).name} has no evaluation {name!r}"
            + (f" (it has {', '.join(map(repr, there))})" if there else " (it has none)")
        )
    try:
        meta = msgspec.json.decode((folder / "meta.json").read_bytes(), type=EvalMeta)
    except msgspec.DecodeError as e:
        raise ValueError(f"{folder / 'meta.json'}: {e}") from None
    decoder = msgspec.json.Decoder(EvalExample)
    examples = []
    with open(folder / "examples.jsonl", "rb") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    examples.append(decoder.decode(line))
                except msgspec.DecodeError as e:
                    raise ValueError(f"{folder / 'examples.jsonl'} line {n}: {e}") from None
    return meta, examples


def list_evals(root: str | os.PathLike) -> list[str]:
    """The names of run ``root``'s saved evaluations, oldest first."""
    base = Path(root) / EVALS_DIR
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if NAME.fullmatch(p.name) and (p / "meta.json").is_file()]
    return [p.name for p in sorted(found, key=lambda p: (p / "meta.json").stat().st_mtime_ns)]
