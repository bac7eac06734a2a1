"""Showing hostile values in messages, and reading hostile paths and JSON: one set of helpers for the
spec, the validator, the data reader and the notebook forms.

A job spec, a data file or an adapter config comes from a user, a notebook or a control message, and
may hold anything: a 10-MB name, a 10**400 seed, a NUL byte or a lone surrogate in a path, JSON nested
a million levels deep, ``/dev/zero`` where a file should be. Every message about such a value is
short and every reader here answers rather than raises::

    brief("x" * 10**7)                 # "'xxxx...xxx'... (10,000,000 characters)"  (about 80 characters)
    brief(10**400)                     # "a 401-digit integer"
    shown_text(completion, 400)        # multi-line text kept readable, cut, control characters escaped
    show_path("/data/alice.jsonl")     # the path as it is; a hostile one as a shortened repr
    path_problem("a\\0b")               # "contains a NUL byte, which no file name can hold"
    value, why = parse_json(text)      # why: "Expecting value at line 1 column 1", "nested too deeply"
    value, why = read_json(path, "a job file")   # why: "not found", "is a directory, not a job file"
    spreadsheet_safe("=HYPERLINK(...)")  # "'=HYPERLINK(...)": a CSV cell no spreadsheet runs

This module imports nothing of mlora_lab and no third-party package: the notebook side, the validator
and the training processes all use it cheaply.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Iterator
from typing import Any

MAX_JSON_BYTES = 64 * 2**20
"""Largest JSON file :func:`read_json` reads: job.json, adapter_config.json and weight indexes are a
few KB in real life; 64 MiB is far above any of them and still cheap to parse."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


# ---------------------------------------------------------------------------------------------
# What a value is
# ---------------------------------------------------------------------------------------------


def is_int(v: Any) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` to Python, never to a spec)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """An ``int`` or ``float`` that is not a bool (it may be inf or nan: see :func:`is_finite`)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_finite(v: Any) -> bool:
    """A real number that is neither inf nor nan; an int too large for a float (10**400) is not."""
    if not is_number(v):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def json_type(v: Any) -> str:
    """What a parsed JSON value is, as messages say it: ``"an object"``, ``"an array"``, ``"a string"``,
    ``"true/false"``, ``"null"``, ``"a number"`` (else the Python type's name)."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(v), "a number" if is_number(v) else type(v).__name__)


# ---------------------------------------------------------------------------------------------
# Showing values
# ---------------------------------------------------------------------------------------------


def brief(v: Any, limit: int = 80) -> str:
    """``repr(v)`` in at most about ``limit`` characters: a message never repeats a hostile value
    whole (a 10-MB name, a 10**400 seed), and never fails on one.

    A long string is cut and says its length; an integer of more than 200 bits is named by its number
    of digits (``repr`` of it would take quadratic time, or be refused past 4300 digits); containers
    show a few items two levels deep; a value whose ``repr`` raises is shown as ``<type name>``.
    """
    try:
        if isinstance(v, str):
            r = repr(v[: limit + 1])  # slice first: a 10-MB string is never copied into a repr
            if len(v) <= limit and len(r) <= limit + 2:
                return r
            return r[: limit - 3] + "..." + (f" ({len(v):,} characters)" if len(v) > limit else "")
        if is_int(v) and v.bit_length() > 200:
            return f"{'-' if v < 0 else ''}a {int(v.bit_length() * math.log10(2)) + 1}-digit integer"
        r = _REPR.repr(v)
        return r if len(r) <= limit else r[: limit - 3] + "..."
    except Exception:  # a value whose repr fails or is refused (an int past Python's digit limit)
        return f"<{type(v).__name__}>"


HIDDEN = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]"
)
"""Characters that would make shown text lie about itself or break its transport: C0/C1 controls but
newline and tab (a terminal escape, a carriage return that overwrites), zero-width and bidirectional
marks and overrides (text that reads differently than it is), and lone surrogates (not valid text: the
frontend's JSON would refuse the message)."""


def shown_text(text: str, limit: int) -> str:
    """Model-written or user text (a prompt, a completion) as a view shows it: lines kept, cut in the
    middle to about ``limit`` characters, saying how long it was (``"start … [12,345 characters] … end"``;
    the start is what came first, the end where a prompt asks and a completion concludes), and every
    hidden character (:data:`HIDDEN`) shown as its escape (``\\x1b``, ``\\u202e``). Plain text:
    a view still escapes it for HTML."""
    if len(text) > limit:
        head = max(1, limit * 2 // 3)
        tail = max(0, limit - head)
        text = f"{text[:head]} … [{len(text):,} characters] … {text[len(text) - tail :] if tail else ''}"
    return HIDDEN.sub(lambda m: ascii(m.group())[1:-1], text)


def brief_list(items: list[Any], n: int = 10) -> str:
    """``a, b, c and 7 more``: a list in a message, at most ``n`` entries, each shortened (a short,
    printable string as it is, anything else as :func:`brief` shows it)."""
    shown = [x if isinstance(x, str) and len(x) <= 120 and x.isprintable() else brief(x) for x in items[:n]]
    return ", ".join(shown) + (f" and {len(items) - n} more" if len(items) > n else "")


def error_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, at most ``limit`` characters (its type's name when
    the message is empty or ``str(e)`` itself raises): what a message shows of an error it caught."""
    try:
        text = str(e).strip()
    except Exception:
        text = ""
    text = text.splitlines()[0] if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def path_problem(path: str) -> str | None:
    """Why the string ``path`` cannot name a file at all, or ``None``: a NUL byte (the OS would cut
    the name there), more than 4096 characters (PATH_MAX), or a lone surrogate (``"\\ud800"`` from
    JSON: it has no bytes, so no file is called that). The sentence follows "the path ..."."""
    if "\0" in path:
        return "contains a NUL byte, which no file name can hold"
    if len(path) > 4096:
        return f"is {len(path):,} characters long (at most 4096)"
    try:
        os.fsencode(path)
    except UnicodeEncodeError as e:
        return f"contains a lone surrogate (\\u{ord(path[e.start]):04x}), which is not valid text"
    return None


def show_path(path: Any) -> str:
    """A file name as messages show it: as is when it is short, printable text that can name a file,
    else a shortened repr (so a newline or a terminal escape in a name cannot forge a message line)."""
    text = path if isinstance(path, str) else str(path)
    if len(text) <= 240 and text.isprintable() and path_problem(text) is None:
        return text
    return brief(text)


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def parse_json(text: str | bytes) -> tuple[Any, str | None]:
    """``(value, None)`` from JSON ``text``, or ``(None, why)`` saying why it is not JSON (with the line
    and column), never an exception: not JSON, nested too deeply for Python's recursion, a number of
    more than 4300 digits, bytes that are not text."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        return None, "nested too deeply"
    except (ValueError, TypeError) as e:
        if "integer string conversion" in str(e):  # Python refuses ints of more than 4300 digits
            return None, "a number has more than 4300 digits"
        return None, error_line(e)


def read_json(path: str, what: str) -> tuple[Any, str | None]:
    """``(value, None)`` from the JSON file ``path``, or ``(None, why)``: missing, not a regular file
    (a directory, a device such as /dev/zero, a FIFO that would block), larger than
    :data:`MAX_JSON_BYTES`, not UTF-8, not JSON. ``what`` names what the file should be in the
    sentence (``"a job file"``: "is a directory, not a job file"). Nothing but a regular file is opened."""
    why = path_problem(path)
    if why:
        return None, f"the path {why}"
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None, "not found"
    except OSError as e:
        return None, f"cannot read it ({e.strerror or e})"
    if stat.S_ISDIR(st.st_mode):
        return None, f"is a directory, not {what}"
    if not stat.S_ISREG(st.st_mode):
        return None, f"is not a regular file (a device, pipe or socket), not {what}"
    if st.st_size > MAX_JSON_BYTES:
        return None, f"is {st.st_size / 2**20:.0f} MiB, too large for {what} (at most 64 MiB)"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        return None, f"cannot read it ({e.strerror or e})"
    if len(raw) > MAX_JSON_BYTES:
        return None, f"is too large for {what} (at most 64 MiB)"
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at position {e.start})"
    value, why = parse_json(text)
    if why is not None:
        return None, f"not valid JSON ({why})"
    return value, None


SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_problem(label: str, text: str) -> list[str]:
    """``["'text' contains a lone surrogate (\\ud800), which is not valid text"]`` or ``[]``."""
    if text.isascii():  # O(1) in CPython: the common case costs nothing, even for a 50-MB row
        return []
    found = SURROGATE.search(text)
    if found is None:
        return []
    return [f"{label} contains a lone surrogate (\\u{ord(found.group()):04x}), which is not valid text"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection while many small objects are made in bulk (rows into tables, a job file of
    a million tenants into a spec). Turning 100k rows into a DataFrame (or
    into dicts) makes a tuple or dict per row, which the cyclic collector tracks: it would run dozens
    of times over the whole heap (a notebook's heap holds torch and pandas), and none of them can find
    garbage, since rows hold no cycles. It runs again as usual afterwards (if it was on: a caller's
    own setting is kept)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Spreadsheets
# ---------------------------------------------------------------------------------------------

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet may read as the start of a formula in a CSV cell (OWASP's CSV-injection list)."""

_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)


def spreadsheet_safe(value: Any) -> Any:
    """A CSV cell as a spreadsheet should get it: a text that begins with one of :data:`FORMULA_STARTS`
    (``=HYPERLINK(...)``, ``-2+3``, ``@SUM(...)``: a completion or a data column a spreadsheet would run)
    with a leading ``'``, as OWASP's CSV-injection advice has it, so it is shown as the text it is. A text
    that is a plain number (``-2.5``: the spreadsheet reads that number, nothing runs) and anything not a
    string (a number stays a number) are kept."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value
