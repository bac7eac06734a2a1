"""``metrics.jsonl``: the typed rows the job appends, the writer, and the incremental reader.

One JSON object per line, with a ``kind``:

========  ====================================================================================
train     ``step, tenant, tenant_step, loss, tokens, lr, grad_norm, rows_seen, tokens_seen, time``
eval      ``step, tenant, loss, time``
system    ``step, rank, mem_bytes, peak_mem_bytes, step_time, tokens_per_s, cpu_percent, gpu_util,
          time``
tenant    ``step, tenant, state, adapter_bytes, optimizer_bytes, local_adapter_bytes,
          local_optimizer_bytes, reason, time`` (the tenant's state and memory: written when its
          state changes, and once more, still ``running``, when its optimiser state first exists)
event     ``step, event, message, time`` (resumed, a checkpoint that failed or was skipped, ...)
========  ====================================================================================

Fields added after the first release are optional (their default is ``None``), so files written
before them stay readable: a reader sees ``None`` for what an older job did not record.

Float fields may be ``null``: JSON has no NaN or infinity, and the writer puts ``null`` for them.
The writer appends each row with one ``write`` on an ``O_APPEND`` descriptor, so a reader sees whole
lines, or a last line without its newline (left for the next poll). Readers never break: a line that
is not JSON, or not one of these rows, is skipped with a warning naming the file and line; a file
that was rewritten (resume drops the rows after its checkpoint) or replaced is noticed and re-read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
import types
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import orjson

from mlora_lab.rundir.files import TextEnum, atomic_write_bytes, guarded_open


class RowKind(TextEnum):
    TRAIN = "train"
    EVAL = "eval"
    SYSTEM = "system"
    TENANT = "tenant"
    EVENT = "event"


class TenantState(TextEnum):
    """A tenant's life: ``pending`` (being added) → ``running`` ⇄ ``paused`` → ``finished``, or
    ``removed``; ``failed`` = quarantined (its step went NaN/inf or raised); ``refused`` = a request to
    add it was turned down (the reason says why)."""

    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    REMOVED = "removed"
    FAILED = "failed"
    REFUSED = "refused"


class EventKind(TextEnum):
    RESUMED = "resumed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # damaged: resume fell back to an older one
    SAVE_FAILED = "save_failed"  # a periodic checkpoint or adapter save failed (e.g. disk full)
    METRICS_RECREATED = "metrics_recreated"  # metrics.jsonl was deleted or replaced under the job
    SEARCH = "search"  # a decision of the job's hyperparameter search (mlora_lab.job.search)
    TRACKER_FAILED = "tracker_failed"  # a tracker of report_to failed and gets no more rows


@dataclass
class Row:
    """One line of metrics.jsonl. Readers get the typed row of its ``kind`` (:meth:`from_dict`) and
    key on its class and attributes; :meth:`to_dict` is the JSON object the line holds."""

    kind: ClassVar[RowKind]

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON object: ``kind`` first, then the fields in order, enums as their text."""
        d = {"kind": self.kind.value, **vars(self)}
        for name in ENUM_FIELDS[self.kind.value]:
            d[name] = d[name].value
        return d

    @staticmethod
    def from_dict(d: Any) -> Row:
        """The typed row of a parsed line (a :class:`TrainRow` for ``{"kind": "train", ...}``, ...);
        ``ValueError`` naming the problem when it is not a row (:func:`row_problem`). Fields a newer
        writer added are dropped; optional fields an older one did not write are ``None``."""
        return _row_of(d.copy() if type(d) is dict else d)


def _row_of(d: Any) -> Row:
    """:meth:`Row.from_dict` of a dict nobody else holds (a line just parsed): it becomes the row's
    attributes."""
    # A reader sees every row, and checking a row's fields one by one costs more than parsing its
    # line. A row with exactly this writer's keys, in order, whose value types were already found
    # good together (remembered per kind), needs only its enum values checked.
    kind = d.get("kind") if type(d) is dict else None
    good = _GOOD_TYPES.get(kind) if type(kind) is str else None
    if good is None or tuple(d) != _KEY_ORDER[kind] or tuple(map(type, d.values())) not in good:
        problem = row_problem(d)
        if problem is not None:
            raise ValueError(problem)
        if tuple(d) != _KEY_ORDER[kind]:  # an older or newer writer's row: the dataclass fills it in
            return ROW_TYPES[kind](**{name: d[name] for name in _FIELD_NAMES[kind] if name in d})
        if len(good) < 64:  # (each float field may be null: a few layouts per kind)
            good.add(tuple(map(type, d.values())))
    # Exactly the fields of this writer's rows, in order, of the right types: built without the
    # dataclass __init__ (which costs as much again).
    row = object.__new__(ROW_TYPES[kind])
    del d["kind"]
    row.__dict__ = d
    for name, enum in ENUM_FIELDS[kind].items():
        try:
            d[name] = enum(d[name])
        except ValueError:
            raise ValueError(f"{kind} row: {name!r} has the wrong type or value (str)") from None
    return row


@dataclass
class TrainRow(Row):
    """One optimiser step of one tenant (every ``log_every``-th, and its last)."""

    kind: ClassVar[RowKind] = RowKind.TRAIN
    step: int
    tenant: str
    tenant_step: int
    loss: float
    tokens: int
    """Target tokens of this step (its whole accumulation window)."""
    lr: float
    grad_norm: float
    time: float = field(default_factory=time.time)
    rows_seen: int | None = None
    """Rows of the tenant's data trained on so far, this step included (with ``packing``: documents,
    not packed rows). Cumulative, so it stays exact when ``log_every > 1`` skips rows."""
    tokens_seen: int | None = None
    """Target tokens trained on so far, this step included (cumulative, as ``rows_seen``)."""


@dataclass
class EvalRow(Row):
    kind: ClassVar[RowKind] = RowKind.EVAL
    step: int
    tenant: str
    loss: float
    time: float = field(default_factory=time.time)


@dataclass
class SystemRow(Row):
    """One rank's resources at a logged step."""

    kind: ClassVar[RowKind] = RowKind.SYSTEM
    step: int
    rank: int
    mem_bytes: int
    """GPU: ``torch.cuda.memory_allocated``; CPU: the process's resident set."""
    peak_mem_bytes: int
    step_time: float
    tokens_per_s: float
    time: float = field(default_factory=time.time)
    cpu_percent: float | None = None
    """CPU used by the rank's process and its children since the rank's previous system row, in
    percent of one core (two busy cores = 200)."""
    gpu_util: float | None = None
    """GPU utilisation in percent (``torch.cuda.utilization``: the share of the last sample period in
    which a kernel ran); ``None`` on CPU, or when NVML (``pynvml``) is not available."""


@dataclass
class TenantRow(Row):
    """A tenant's state and memory. Written when its state changes, and once more (still ``running``)
    after its first optimiser step, when its AdamW state (two moments per trained value) exists: the
    memory a tenant costs is its latest row's ``adapter_bytes + optimizer_bytes``."""

    kind: ClassVar[RowKind] = RowKind.TENANT
    step: int
    tenant: str
    state: TenantState
    adapter_bytes: int = 0
    optimizer_bytes: int = 0
    local_adapter_bytes: int = 0
    local_optimizer_bytes: int = 0
    reason: str | None = None
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.state = TenantState(self.state)


@dataclass
class EventRow(Row):
    kind: ClassVar[RowKind] = RowKind.EVENT
    step: int
    event: EventKind
    message: str = ""
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.event = EventKind(self.event)


ROW_TYPES: dict[RowKind, type[Row]] = {t.kind: t for t in (TrainRow, EvalRow, SystemRow, TenantRow, EventRow)}


_MISSING = object()


def _field_rule(annotation: Any) -> tuple[frozenset[type], frozenset[str] | None]:
    """The exact JSON value types a field of this type accepts (orjson gives exact ``int``, ``float``,
    ``str``, ``bool``, ``None``, so ``type(v) in types`` also keeps bools out of numbers; an int is a
    float), and for an enum field the values it may take."""
    parts = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    accepted: set[type] = set()
    values: frozenset[str] | None = None
    for part in parts:
        if part is float:  # JSON has no NaN/inf: a writer puts null for a number that is not finite
            accepted |= {int, float, type(None)}
        elif isinstance(part, type) and issubclass(part, Enum):
            accepted.add(str)
            values = frozenset(m.value for m in part)
        else:
            accepted.add(part)
    return frozenset(accepted), values


def _schema(row_type: type[Row]) -> tuple[tuple[str, bool, frozenset[type], frozenset[str] | None], ...]:
    hints = typing.get_type_hints(row_type)
    return tuple(
        (
            f.name,
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            *_field_rule(hints[f.name]),
        )
        for f in dataclasses.fields(row_type)
    )


SCHEMAS = {kind.value: _schema(t) for kind, t in ROW_TYPES.items()}
_FIELD_NAMES = {kind: tuple(name for name, *_ in schema) for kind, schema in SCHEMAS.items()}
_KEY_ORDER = {kind: ("kind", *names) for kind, names in _FIELD_NAMES.items()}
ENUM_FIELDS: dict[str, dict[str, type[Enum]]] = {
    kind.value: {
        f.name: hint
        for f in dataclasses.fields(t)
        if isinstance(hint := typing.get_type_hints(t)[f.name], type) and issubclass(hint, Enum)
    }
    for kind, t in ROW_TYPES.items()
}
"""Per kind, the fields that hold an enum (a tenant row's ``state``, an event row's ``event``)."""
_GOOD_TYPES: dict[str, set[tuple[type, ...]]] = {kind: set() for kind in SCHEMAS}
"""Per kind, the value types (in field order) of rows that passed :func:`row_problem` (see ``_row_of``)."""


def row_problem(row: Any) -> str | None:
    """Why a parsed line is not a metrics row (None if it is one). Extra keys are allowed (a newer
    writer may add fields); a missing required field or a value of the wrong type is not. Called on
    every row a reader sees, so it is a few dict lookups per field."""
    if type(row) is not dict:
        return f"not a JSON object ({type(row).__name__})"
    kind = row.get("kind")
    schema = SCHEMAS.get(kind) if type(kind) is str else None
    if schema is None:
        return f"unknown kind {str(kind)[:40]!r}"
    for name, required, accepted, values in schema:
        v = row.get(name, _MISSING)
        if v is _MISSING:
            if required:
                return f"{kind} row without {name!r}"
        elif type(v) not in accepted or (values is not None and v not in values):
            return f"{kind} row: {name!r} has the wrong type or value ({type(v).__name__})"
    return None


def _default(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    raise TypeError(f"cannot write {type(obj).__name__} to metrics.jsonl")


def _line(row: Row) -> bytes:
    """One row as a JSON line. Text that is not valid UTF-8 (a lone surrogate quoted from hostile
    input into a reason) is written as its escape, so no message can make a row unwritable."""
    d = row.to_dict()
    try:
        return orjson.dumps(d, default=_default) + b"\n"
    except orjson.JSONEncodeError:
        clean = {
            k: v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v
            for k, v in d.items()
        }
        return orjson.dumps(clean, default=_default) + b"\n"


class MetricsWriter:
    """Appends rows to metrics.jsonl (rank 0 only). If the file is deleted or replaced under the
    job, the next write notices (one ``stat`` per row) and starts a new file, saying so in it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = -1
        self._open()

    def _open(self) -> None:
        # never through a link: a symlink planted at metrics.jsonl must not make the job append elsewhere
        self._fd = guarded_open(self.path.parent, self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._ino = os.fstat(self._fd).st_ino

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino != self._ino
        except FileNotFoundError:
            return True

    def write(self, row: Row) -> None:
        if self._replaced():
            os.close(self._fd)
            self._open()
            note = EventRow(
                step=getattr(row, "step", 0),
                event=EventKind.METRICS_RECREATED,
                message=f"{self.path.name} was deleted or replaced while the job ran; rows before this one are not in it",
            )
            os.write(self._fd, _line(note))
        os.write(self._fd, _line(row))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection while rows are read in bulk. Every typed row is an object the cyclic
    collector tracks (a parsed line's dict of numbers and text is not), so reading 100k rows would
    run it hundreds of times over a growing heap; none of them can find garbage (rows hold no
    cycles). It runs again as usual afterwards (if it was on: a caller's own setting is kept)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class MetricsReader:
    """The one reader of metrics.jsonl: typed rows (:class:`TrainRow`, :class:`EvalRow`, ...), read
    incrementally. It remembers its byte offset and line number, never parses a partial line, skips
    bad lines (one warning each, naming file and line), and starts over when the file was rewritten or
    replaced (``generation`` then increases: callers that keep derived state, like a dashboard,
    rebuild it from ``rows``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.offset = 0
        self.line = 0
        self.generation = 0
        self.rows: list[Row] = []
        self.skipped = 0
        self._ino: int | None = None

    def _reset(self) -> None:
        self.offset = self.line = self.skipped = 0
        self.rows = []
        self.generation += 1

    def poll(self) -> list[Row]:
        """Rows appended since the last call (also kept in ``self.rows``). After a rewrite, every row
        of the new file (and ``generation`` has moved on)."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._ino is not None and (st.st_ino != self._ino or st.st_size < self.offset):
                    self._reset()
                self._ino = st.st_ino
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        except OSError as e:
            warnings.warn(f"{self.path}: cannot be read ({e.strerror or e})", RuntimeWarning, stacklevel=2)
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        new = []
        with collection_paused():
            for raw in chunk[: end + 1].split(b"\n")[:-1]:
                self.line += 1
                if not raw.strip():
                    continue
                try:
                    new.append(_row_of(orjson.loads(raw)))
                except orjson.JSONDecodeError as e:
                    self._skip(f"not valid JSON ({str(e).split(':')[0]})")
                except ValueError as e:
                    self._skip(str(e))
        self.offset += end + 1
        self.rows.extend(new)
        return new

    def _skip(self, problem: str) -> None:
        self.skipped += 1
        warnings.warn(f"{self.path} line {self.line}: skipped ({problem})", RuntimeWarning, stacklevel=3)


def truncate_after(path: str | os.PathLike, step: int) -> None:
    """Keep only the rows logged at or before global ``step`` (resume logs the later ones again),
    and drop lines that are not rows. Rewritten atomically: readers see a new file and re-read it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    keep = []
    for raw in data.split(b"\n"):
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue  # a row cut off by a crash, or not ours
        if row_problem(row) is None and row["step"] <= step:
            keep.append(raw + b"\n")
    atomic_write_bytes(path, b"".join(keep))
