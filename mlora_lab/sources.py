"""Where a tenant's rows come from: files and in-memory sources, each read as rows of plain JSON values.

A tenant's ``data`` (and ``heldout_data``) is one of::

    "train.jsonl"           JSON Lines: one object per line
    "train.json"            a JSON array of objects (pandas ``df.to_json(path, orient="records")``), or JSON
                            Lines under a .json name (what ``datasets.Dataset.to_json`` writes by default)
    "train.parquet"         a parquet file, read with pyarrow
    "train.csv"             a CSV file whose first line names the columns; every cell is text
    df                      a pandas DataFrame, a column per key
    [{"text": ...}, ...]    a list of dicts
    ds                      a datasets.Dataset
    HubDataset("org/name")  a dataset on the Hub (config, split, revision), read with datasets.load_dataset

The file's suffix says how it is read (any case: ``.JSONL`` too). Values JSON cannot hold are converted
where that is unambiguous (numpy numbers to Python numbers, NaN and pandas' NA to null, numpy arrays to
lists) and otherwise refused with the row and the key named (a timestamp, bytes, inf, a set): a row must be
what a JSON Lines file could hold, since that is how the job reads an in-memory source. A table (CSV,
parquet, a DataFrame, a Dataset) holds every column in every row: a missing cell (NaN, None, an empty CSV
cell) is null, and :mod:`mlora_lab.data` takes a null key as a missing one, so one table can mix ``text``
rows and ``prompt``/``completion`` rows (and keeps every column in every row, as ``datasets`` does).

    for r in source_rows(source):    # SourceError if the whole source cannot be read
        r.label, r.row, r.problems   # "line 3" / "row 2"; the row as JSON values; why it is not one

Lines are numbered from 1, as editors do (JSON Lines, CSV); rows from 0, as Python indexes them (a JSON
array, parquet, ``df.iloc[2]``, ``rows[2]``, ``ds[2]``).

In-memory sources exist only in the notebook: job.json names files. A launch (and ``run.add_tenant``)
first takes a :func:`snapshot` of each one, in one pass over it, validates that and writes it into the run
directory as JSON Lines (:meth:`Snapshot.jsonl`), so the job and every resume read exactly the rows that
were validated, whatever becomes of the DataFrame afterwards.

This module imports no torch and no pandas (a DataFrame or a Dataset is recognised by its class, and
``datasets`` is never imported); pyarrow is imported only to read a parquet file.
"""

from __future__ import annotations

import collections
import csv
import json
import math
import os
import stat
import sys
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlora_lab import hub
from mlora_lab.hub import HUB_ID
from mlora_lab.hub import offline as hub_offline
from mlora_lab.text import brief, error_line, parse_json, path_problem, show_path

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
"""The data files a tenant can name, by suffix."""
MEMORY_KINDS = ("DataFrame", "list", "Dataset", "Hub dataset")
"""The in-memory sources, as messages name them: a pandas DataFrame, a list of dicts, a datasets.Dataset, and a
:class:`HubDataset` (read into memory by validation, then written into the run directory as the others)."""
ACCEPTED = (
    "a .jsonl, .json, .parquet or .csv file path, a pandas DataFrame, a list of dicts, a datasets.Dataset "
    "or an ml.HubDataset"
)
"""What a tenant's ``data`` may be, as messages say it."""
_CHUNK = 1024  # rows converted at a time from a DataFrame, a Dataset or a parquet file
_MAX_DEPTH = 64  # a cell nested deeper than this is refused (no RecursionError converting it)


@dataclass(frozen=True)
class HubDataset:
    """A split of a dataset on the Hub, as a tenant's ``data`` or ``heldout_data``:
    ``datasets.load_dataset(repo_id, config, split=split, revision=revision)``.

    It is read once, in the notebook's process, by validation (a download into ``datasets``' cache, with its
    progress bars; ``HF_TOKEN`` for a gated one, ``HF_ENDPOINT`` for another server, ``HF_HUB_OFFLINE`` to read
    only the cache), and a launch writes its rows into the run directory as JSON Lines, as it does a
    DataFrame's: every rank and every resume reads exactly the rows that were validated. A spec's job.json
    holds it as ``{"repo_id": ..., "config": ..., "split": ..., "revision": ...}`` until it is launched. A
    dataset that cannot be had is one of three answers naming it: not on the Hub (or private), gated (accept
    its terms, then log in or set ``HF_TOKEN``), or offline and not cached."""

    repo_id: str
    """``org/name``, as the Hub spells the dataset's repository."""
    config: str | None = None
    """The dataset's configuration (its subset), ``None`` for the default one."""
    split: str = "train"
    """The split whose rows are the tenant's (``"train"``, ``"test"``, ``"train[:100]"``, ...)."""
    revision: str | None = None
    """A branch, tag or commit; ``None``: ``main``."""

    def __str__(self) -> str:
        config = f", {self.config}" if self.config else ""
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{at} ({self.split}{config})"

    def load(self) -> Any:
        """The split as a ``datasets.Dataset`` (downloaded, or read from the cache); :class:`SourceError`
        saying which of the three it is when it cannot be had, or why it cannot be read."""
        return _load_hub_dataset(self)


class SourceError(ValueError):
    """A source that cannot be read at all (a missing file, an unknown suffix, a DataFrame whose column
    names are not strings); the message says why, without naming the source."""


@dataclass(frozen=True)
class SourceRow:
    """One row of a source: where it is, its value as plain JSON values, and why it is not usable."""

    label: str
    """Where the row is: ``"line 3"`` (JSON Lines, CSV: from 1) or ``"row 2"`` (from 0)."""
    row: Any
    """The row as plain JSON values (a dict, for a usable row); ``None`` when it could not be read."""
    problems: tuple[str, ...] = ()
    """Why the row could not be read or converted (its shape is :mod:`mlora_lab.data`'s to check)."""


# ---------------------------------------------------------------------------------------------
# What a source is
# ---------------------------------------------------------------------------------------------


def _class_is(value: Any, package: str, *names: str) -> bool:
    """Whether ``value``'s class (or a base class) is ``package``'s class called one of ``names``,
    without importing ``package``."""
    return any(c.__module__.split(".")[0] == package and c.__name__ in names for c in type(value).__mro__)


def memory_kind(value: Any) -> str | None:
    """``"DataFrame"``, ``"list"`` or ``"Dataset"`` for an in-memory source (a :class:`Snapshot` is
    one of the kind it was taken of), else ``None`` (a path, or something that is no source)."""
    if isinstance(value, Snapshot):
        return value.kind
    if isinstance(value, HubDataset):
        return "Hub dataset"
    if isinstance(value, list | tuple):
        return "list"
    if _class_is(value, "pandas", "DataFrame"):
        return "DataFrame"
    if _class_is(value, "datasets", "Dataset"):
        return "Dataset"
    return None


def source_type_problem(value: Any) -> str | None:
    """Why ``value`` is not a data source at all, as the rest of a sentence that starts with the
    field's name (``"is a pandas Series; ..."``, ``"must be a .jsonl, ... (got 3 of type int)"``);
    ``None`` for a string, a path object or an in-memory source (whether they can be read is
    :func:`source_rows`' to say). Only the type is looked at."""
    if isinstance(value, str | os.PathLike) or memory_kind(value) is not None:
        return None
    if _class_is(value, "datasets", "DatasetDict", "IterableDatasetDict"):
        try:
            keys = [k for k in value if isinstance(k, str)]
        except Exception:  # (a broken mapping is still named)
            keys = []
        split = brief(keys[0]) if keys else "'train'"
        return f"is a DatasetDict of the splits {_names(keys)}; give one split: dataset[{split}]"
    if _class_is(value, "datasets", "IterableDataset"):
        return "is an IterableDataset, which has no fixed rows; give a Dataset (Dataset.from_list(list(ds)))"
    if _class_is(value, "pandas", "Series"):
        return "is a pandas Series; give a DataFrame with named columns (series.to_frame('text'))"
    return f"must be {ACCEPTED} (got {brief(value)} of type {type(value).__name__})"


def source_name(value: Any) -> str:
    """How messages name a source: the path as :func:`~mlora_lab.text.show_path` shows it, or its
    in-memory kind (``"DataFrame"``)."""
    if isinstance(value, HubDataset):
        return f"Hub dataset {value}"
    kind = memory_kind(value)
    if kind is not None:
        return kind
    try:
        return show_path(os.fsdecode(os.fspath(value)))
    except TypeError:
        return brief(value)


def describe(value: Any) -> str:
    """A source in a few words: ``"a DataFrame of 120 rows"``, ``"a list of 3 rows"``, or the path."""
    kind = memory_kind(value)
    if kind is None or isinstance(value, HubDataset):
        return source_name(value)
    try:
        n = len(value)
    except Exception:  # (a Dataset whose length cannot be taken: it is still named)
        return f"a {kind}"
    return f"a {kind} of {n:,} row{'s' if n != 1 else ''}"


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def source_rows(value: Any) -> Iterator[SourceRow]:
    """Every row of ``value`` (see the module docstring), read one at a time where the format allows
    it. Raises :class:`SourceError` when the source cannot be read at all, or stops being readable
    half-way (the rows already given stay valid)."""
    if isinstance(value, Snapshot):
        yield from value.rows()
        return
    kind = memory_kind(value)
    if kind == "list":
        for i, item in enumerate(value):
            row, problems = _plain_row(item)
            yield SourceRow(f"row {i}", row, problems)
    elif kind == "DataFrame":
        yield from _frame_rows(value)
    elif kind == "Dataset":
        yield from _dataset_rows(value)
    elif kind == "Hub dataset":
        yield from _dataset_rows(value.load())
    else:
        why = source_type_problem(value)
        if why is not None:
            raise SourceError(f"not a data source: it {why}")
        yield from _file_rows(os.fsdecode(os.fspath(value)))


def file_problem(path: Any) -> str | None:
    """Why ``path`` cannot be read as a data file, or ``None``: not a usable path, missing, not a
    regular file, or a suffix that names no known format. Nothing is opened: a FIFO would block and
    /dev/zero never ends."""
    try:
        p = os.fsdecode(os.fspath(path))
    except TypeError:
        return f"not a file path ({type(path).__name__})"
    why = path_problem(p)
    if why:
        return f"the path {why}"
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        return "file not found"
    except OSError as e:  # e.g. a name too long, a permission denied on a parent
        return f"cannot read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    suffix = os.path.splitext(p)[1].lower()
    if suffix not in FILE_SUFFIXES:
        what = f"suffix {brief(suffix)}" if suffix else "no suffix"
        return f"unknown kind of data file ({what}); give a {', '.join(FILE_SUFFIXES[:-1])} or .csv file"
    return None


def _file_rows(path: str) -> Iterator[SourceRow]:
    why = file_problem(path)
    if why:
        raise SourceError(why)
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".jsonl":
            with open(path, "rb") as fh:
                yield from _json_lines(fh)
        elif suffix == ".json":
            yield from _json_file(path)
        elif suffix == ".csv":
            yield from _csv_rows(path)
        else:
            yield from _parquet_rows(path)
    except OSError as e:
        raise SourceError(f"cannot read ({e.strerror or e})") from None


def _parse(text: str | bytes) -> tuple[Any, str | None]:
    """A JSON value, or why it is not one (as a row problem says it)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, "not valid JSON (nested too deeply)"
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        return None, f"not valid JSON ({error_line(e)})"


def _json_lines(lines: Iterable[bytes]) -> Iterator[SourceRow]:
    """Every non-blank line as a JSON value, one line at a time."""
    for lineno, bline in enumerate(lines, start=1):
        label = f"line {lineno}"
        try:
            line = bline.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield SourceRow(label, None, (f"not valid UTF-8 ({e.reason} at byte {e.start})",))
            continue
        if not line.strip():
            continue
        row, why = _parse(line)
        yield SourceRow(label, row, (why,) if why else ())


def _json_file(path: str) -> Iterator[SourceRow]:
    """A ``.json`` file: a JSON array of rows, or JSON Lines (``datasets``' default ``to_json``). A single
    object of objects is pandas' default ``to_json`` orient, whose rows cannot be told from its columns."""
    with open(path, "rb") as fh:
        raw = fh.read()
    head = raw.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if head == b"[":
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise SourceError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
        value, why = parse_json(text)
        if why is not None:
            raise SourceError(f"not valid JSON ({why})")
        for i, item in enumerate(value):
            yield SourceRow(f"row {i}", item)
        return
    if head == b"{":
        value, why = _parse(raw.decode("utf-8-sig", "replace"))
        if (
            why is None
            and isinstance(value, dict)
            and value
            and all(isinstance(v, dict) for v in value.values())
        ):
            raise SourceError(
                "one JSON object of objects (pandas' default to_json orient, whose rows cannot be told from "
                "its columns); write it with df.to_json(path, orient='records') or with lines=True"
            )
    if not head:
        return
    yield from _json_lines(raw.splitlines(keepends=True))


def _csv_rows(path: str) -> Iterator[SourceRow]:
    """A CSV file with a header line: every cell is a string, an empty cell a missing one (null)."""
    # A cell may be a whole document: the csv module's 128 KiB default is raised (a process-wide
    # setting, never lowered again: nothing here wants a cap).
    csv.field_size_limit(max(csv.field_size_limit(), min(sys.maxsize, 2**31 - 1)))
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader, None)
            if header is None:
                return
            names = [h.strip() for h in header]
            counts = collections.Counter(names)
            dup = sorted(n for n, c in counts.items() if c > 1 and n)
            if dup:
                raise SourceError(f"the header line names column(s) {_names(dup)} more than once")
            end = reader.line_num
            for cells in reader:
                label, end = f"line {end + 1}", reader.line_num
                if not any(c.strip() for c in cells):
                    continue  # a blank line
                problems: tuple[str, ...] = ()
                if len(cells) > len(names):
                    problems = (f"{len(cells)} cells, but the header line names {len(names)} columns",)
                # every column in every row, as in any table: a short line's last cells are missing
                row = {n: (cells[i] or None) if i < len(cells) else None for i, n in enumerate(names)}
                yield SourceRow(label, None if problems else row, problems)
        except csv.Error as e:
            raise SourceError(f"not valid CSV at line {reader.line_num} ({error_line(e)})") from None
        except UnicodeDecodeError as e:
            # (the decoder reads ahead by chunks: the line the reader is at says nothing; find the line)
            raise SourceError(f"not valid UTF-8 ({e.reason} at line {_bad_utf8_line(path)})") from None


def _bad_utf8_line(path: str) -> int | str:
    """The number (from 1) of the first line of ``path`` that is not valid UTF-8, as an editor counts."""
    with open(path, "rb") as fh:
        for i, line in enumerate(fh, 1):
            try:
                line.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError:
                return i
    return "?"


def _names(names: list[Any]) -> str:
    """Names in a message: ``'a', 'b'`` (at most five, then how many more)."""
    shown = ", ".join(brief(n, 40) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _parquet_rows(path: str) -> Iterator[SourceRow]:
    try:
        import pyarrow.parquet as pq  # (only a job or a check that reads a parquet file pays for it)
    except ImportError:
        raise SourceError("reading a .parquet file needs pyarrow (pip install pyarrow)") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_CHUNK)
        i = 0
        for batch in batches:
            for item in batch.to_pylist():
                row, problems = _plain_row(item)
                yield SourceRow(f"row {i}", row, problems)
                i += 1
    except (
        OSError,
        ValueError,
        TypeError,
        NotImplementedError,
    ) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise SourceError(f"not a readable parquet file ({type(e).__name__}: {error_line(e)})") from None


def _frame_rows(df: Any) -> Iterator[SourceRow]:
    columns = list(df.columns)
    bad = [c for c in columns if not isinstance(c, str)]
    if bad:
        raise SourceError(f"column names must be strings (got {_names(bad)}); name the columns")
    dup = sorted(c for c, n in collections.Counter(columns).items() if n > 1)
    if dup:
        raise SourceError(f"column(s) {_names(dup)} appear more than once")
    for start in range(0, len(df), _CHUNK):
        for i, item in enumerate(df.iloc[start : start + _CHUNK].to_dict(orient="records"), start=start):
            row, problems = _plain_row(item)
            yield SourceRow(f"row {i}", row, problems)


def _load_hub_dataset(source: HubDataset) -> Any:
    """:meth:`HubDataset.load`. ``huggingface_hub`` asks first (what it raises tells the three cases apart, as
    :func:`mlora_lab.hub.fetch` does for models), then ``datasets`` loads the split at the commit that answered,
    so that a branch moving in between cannot mix two versions."""
    if not isinstance(source.repo_id, str) or HUB_ID.fullmatch(source.repo_id) is None:
        raise SourceError(f"a Hub dataset is named org/name (got {brief(source.repo_id)})")
    try:
        import datasets
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as e:
        raise SourceError(
            f"a Hub dataset is read with the datasets package, which is not installed ({e})"
        ) from None

    where = f"{source.repo_id}" + (f" (revision {brief(source.revision)})" if source.revision else "")
    if (why := hub.revision_problem(source.revision)) is not None:
        raise SourceError(f"the Hub dataset {source.repo_id}: revision {brief(source.revision)} {why}")
    revision = source.revision
    with hub.bounded_waits():  # (every request answers within hub.TIMEOUT_S, or fails at once: no retries)
        if not hub_offline():
            try:
                api = HfApi()
                info = api.dataset_info(source.repo_id, revision=source.revision, timeout=hub.TIMEOUT_S)
                revision = info.sha or revision
                api.auth_check(source.repo_id, repo_type="dataset")
            except GatedRepoError:
                raise SourceError(
                    f"{where} is a gated dataset on the Hub: accept its terms on its page, then log in "
                    "(`hf auth login`) or set HF_TOKEN"
                ) from None
            except RevisionNotFoundError:
                raise SourceError(
                    f"the Hub dataset {source.repo_id} has no revision {brief(source.revision)}"
                ) from None
            except RepositoryNotFoundError:
                raise SourceError(
                    f"{where} is not a dataset on the Hub (if it is private: log in with `hf auth login` or "
                    "set HF_TOKEN)"
                ) from None
            except Exception as e:  # (the Hub cannot be reached: what the cache holds may still do)
                if hub.timed_out(e):
                    raise SourceError(
                        f"the Hub dataset {where}: {hub.silence(e)} (with HF_HUB_OFFLINE=1 a copy in the cache is "
                        "read without asking it)"
                    ) from None
                if not hub.unanswered(e):
                    raise SourceError(f"the Hub dataset {where} could not be read: {error_line(e)}") from None
        try:
            return datasets.load_dataset(source.repo_id, source.config, split=source.split, revision=revision)
        except Exception as e:
            if hub_offline() or hub.unanswered(e):
                reason = "HF_HUB_OFFLINE is set" if hub_offline() else hub.silence(e)
                raise SourceError(
                    f"the Hub dataset {where} is not in the cache and {reason}: nothing can be downloaded; "
                    f"{hub.ways_out(model=False)}"
                ) from None
            raise SourceError(f"the Hub dataset {where} could not be loaded: {error_line(e)}") from None


def _dataset_rows(ds: Any) -> Iterator[SourceRow]:
    columns = list(ds.column_names)
    for start in range(0, len(ds), _CHUNK):
        batch = ds[start : start + _CHUNK]  # {column: [values]}: one conversion from Arrow per chunk
        n = len(batch[columns[0]]) if columns else 0
        for k in range(n):
            row, problems = _plain_row({c: batch[c][k] for c in columns})
            yield SourceRow(f"row {start + k}", row, problems)


# ---------------------------------------------------------------------------------------------
# Values JSON can hold
# ---------------------------------------------------------------------------------------------


class _Refused(Exception):
    """A value that JSON cannot hold unambiguously; ``args[0]`` says what it is."""


def _plain(v: Any, depth: int = 0) -> Any:
    """``v`` as plain JSON values (see the module docstring); :class:`_Refused` for one that has none."""
    if depth > _MAX_DEPTH:
        raise _Refused(f"a value nested more than {_MAX_DEPTH} levels deep")
    if v is None or type(v) in (str, bool, int):
        return v
    if isinstance(v, float):  # (numpy's float64 is a float)
        if math.isnan(v):
            return None
        if math.isinf(v):
            raise _Refused(f"{v}, which JSON cannot hold")
        return float(v)
    if isinstance(v, str):  # numpy's str_, and other str subclasses
        return str(v)
    if isinstance(v, bool | int):
        return int(v) if not isinstance(v, bool) else bool(v)
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Refused(f"a mapping with the key {brief(k)}, not a string")
            out[str(k)] = _plain(x, depth + 1)
        return out
    if isinstance(v, list | tuple):
        return [_plain(x, depth + 1) for x in v]
    name = type(v).__name__
    if name in ("NAType", "NaTType") and _class_is(v, "pandas", name):
        return None  # pandas' missing value
    if type(v).__module__.split(".")[0] == "numpy":
        kind = getattr(getattr(v, "dtype", None), "kind", "")
        if name == "ndarray" and kind in "biufUO":
            return _plain(v.tolist(), depth)
        if name != "ndarray" and kind in "biufU":  # a numpy scalar: bool, int, float or str
            return _plain(v.item(), depth)
        raise _Refused(f"a numpy {name} of dtype {v.dtype}, which JSON cannot hold")
    raise _Refused(f"a {name} value, which JSON cannot hold")


def _plain_row(item: Any) -> tuple[Any, tuple[str, ...]]:
    """``(row, problems)``: a row as plain JSON values, a key at a time so every refused value is named."""
    if not isinstance(item, dict):
        try:
            return _plain(item), ()
        except _Refused as e:
            return None, (f"the row is {e.args[0]}",)
    row, problems = {}, []
    for key, value in item.items():
        if not isinstance(key, str):
            problems.append(f"the key {brief(key)} is not a string")
            continue
        try:
            row[str(key)] = _plain(value, 1)
        except _Refused as e:
            problems.append(f"{brief(key, 40)} holds {e.args[0]}; convert it (to a string, say) or drop it")
    return (None if problems else row), tuple(problems)


# ---------------------------------------------------------------------------------------------
# Snapshots of in-memory sources
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Snapshot:
    """An in-memory source as it was when :func:`snapshot` read it: its rows as plain JSON values (or
    why the source could not be read). What a launch validates and then writes into the run directory;
    changing the DataFrame afterwards changes nothing here."""

    kind: str
    """The kind of the source it was taken of (``"DataFrame"``): how messages name it."""
    items: tuple[SourceRow, ...] = ()
    error: str | None = None
    """Why the source could not be read (:class:`SourceError`), else ``None``."""
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names this snapshot in a validation cache (it never changes)."""

    def __len__(self) -> int:
        return len(self.items)

    def rows(self) -> Iterator[SourceRow]:
        """Its rows, as :func:`source_rows` gave them; :class:`SourceError` if it could not be read."""
        if self.error is not None:
            raise SourceError(self.error)
        yield from self.items

    def jsonl(self) -> bytes:
        """The rows as JSON Lines, UTF-8: what the job reads back as the same rows. Only a snapshot
        whose rows all read (validation checks that first) can be written."""
        bad = [r.label for r in self.items if r.problems]
        if self.error is not None or bad:
            raise SourceError(self.error or f"{len(bad)} row(s) could not be read (the first: {bad[0]})")
        text = "".join(json.dumps(r.row, ensure_ascii=False) + "\n" for r in self.items)
        # A lone surrogate (only a string can hold one) is written as its \\udXXX escape, which JSON
        # reads back as the same character: the row round-trips exactly.
        return text.encode("utf-8", "backslashreplace")


def snapshot(value: Any) -> Any:
    """An in-memory source read once into a :class:`Snapshot`; anything else (a path, a snapshot, a
    value that is no source) is returned as it is."""
    kind = memory_kind(value)
    if kind is None or isinstance(value, Snapshot):
        return value
    if isinstance(value, HubDataset):  # (messages about its rows name the dataset)
        kind = source_name(value)
    try:
        return Snapshot(kind, tuple(source_rows(value)))
    except SourceError as e:
        return Snapshot(kind, error=str(e))


PICKLED_REWARD = ".pkl"
"""The suffix of a reward function pickled by value into a run directory: ``"<run>/rewards/<tenant>/<i>-fn.pkl:fn"``
is the reference job.json holds for it (:class:`RewardSnapshot`)."""


@dataclass(frozen=True, eq=False)
class RewardSnapshot:
    """A reward function given as a callable (a notebook's ``def``, a lambda, a closure, as ``reward_funcs=[fn]``
    takes them in TRL), pickled by value with ``cloudpickle`` once, when the spec is launched: the function the
    job's reward worker calls is the one validated, whatever the notebook does with it afterwards. Written into
    the run directory and named there (:func:`mlora_lab.lab.runs.tenant_data.write_data`); the worker unpickles it
    (a run's own file: as trusted as a ``file.py:function`` in it)."""

    name: str
    """An identifier for messages and the reference (the function's ``__name__``; ``reward`` for a lambda)."""
    data: bytes

    @classmethod
    def of(cls, fn: Any) -> RewardSnapshot:
        """``fn`` pickled; ``TypeError`` (or cloudpickle's error) when it cannot be. A function of the user's
        own module (not an installed package's) goes by value with that module's globals it uses, as a
        notebook's does: the job's worker need not be able to import the module."""
        import cloudpickle

        name = getattr(fn, "__name__", "")
        name = name if isinstance(name, str) and name.isidentifier() else "reward"
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        own = module is not None and module.__name__ != "__main__" and _user_module(module)
        if own:
            cloudpickle.register_pickle_by_value(module)
        try:
            return cls(name, cloudpickle.dumps(fn))
        finally:
            if own:
                cloudpickle.unregister_pickle_by_value(module)


def _user_module(module: Any) -> bool:
    """Whether ``module`` is the user's code (a file outside the interpreter's and its packages' folders)."""
    import sysconfig

    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    real = os.path.realpath(path)
    return not any(real.startswith(os.path.realpath(p) + os.sep) for p in installed)


def reward_in_memory(value: Any) -> bool:
    """Whether a reward is a function held in memory (a callable, or its :class:`RewardSnapshot`), not a
    ``"module:function"`` / ``"file.py:function"`` reference. A verifiers ``Taskset`` or ``Env`` (an agent's
    ``rl.env``) travels as one: pickled by value at launch."""
    return (
        isinstance(value, RewardSnapshot)
        or (callable(value) and not isinstance(value, str | type))
        or verifiers_object(value)
    )


def verifiers_object(value: Any) -> bool:
    """Whether ``value`` is a verifiers ``Taskset`` or ``Env`` (told by its classes' names: verifiers is not
    imported)."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(value).__mro__}
    return bool(names & {"verifiers.v1.taskset.Taskset", "verifiers.v1.env.Env"})
