"""Tables that show themselves fitted: ``ml.runs()`` and ``ml.summary()`` are DataFrames whose data is every
column, unchanged, and whose display (a notebook's HTML, a terminal's text) is made to be read at a glance.

A plain DataFrame shows a wide table badly: pandas wraps a terminal's text into blocks of columns (each row
on two or more lines), a notebook wraps long cells (a run's path, a date and its time) so every row takes two
lines, one tiny value (−1.5e-08) turns a whole column into scientific notation, and a count with one missing
value becomes a float (``1234.0``). A :class:`FittedFrame` shows a *view* of itself instead:

- the columns of its :attr:`~FittedFrame.VIEW`, in that order, under short headers, each value formatted by
  its column (losses with 4 decimals, never in scientific notation unless huge; a learning rate as ``2e-05``;
  a count as a whole number; a time to the minute); a column marked ``optional`` only when some row has a
  value; columns the view does not name after them, as pandas shows them;
- in a notebook, every cell on one line (a table wider than the output scrolls sideways);
- in a terminal, as many columns as fit its width, the least needed dropped first, and a line naming them.

Everything else (indexing, filtering, ``.to_csv()``, the dtypes) is the DataFrame's own: a filtered or
re-indexed table is a table of the same kind, and shows itself the same way.
"""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from mlora_lab.text import spreadsheet_safe

MISSING = "–"
"""What a cell without a value shows."""
_ids = itertools.count()


def missing(v: Any) -> bool:
    """Whether a cell holds no value: None, ``pd.NA``, ``pd.NaT`` or a float NaN."""
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    return isinstance(v, float | np.floating) and math.isnan(v)


def decimals(places: int = 4) -> Callable[[Any], str]:
    """A number with ``places`` decimals, never in scientific notation below 1e9 (a loss of −1.5e-08 is
    ``0.0000``, not a reason to write its whole column as ``-1.500000e-08``); beyond, 4 significant digits."""

    def fmt(v: Any) -> str:
        if missing(v):
            return MISSING
        if isinstance(v, bool | str):
            return str(v)
        v = float(v)
        if not math.isfinite(v) or abs(v) >= 1e9:
            return f"{v:.4g}"
        text = f"{v:.{places}f}"
        return text.lstrip("-") if float(text) == 0 else text

    return fmt


def general(v: Any) -> str:
    """A setting as people write it: ``2e-05``, ``0.1``, ``3``."""
    if missing(v):
        return MISSING
    return f"{v:g}" if isinstance(v, float | np.floating) else str(v)


def whole(v: Any) -> str:
    """A count: a whole number (``1,234``), whatever the column's dtype (a float column where a value was
    missing)."""
    if missing(v):
        return MISSING
    if isinstance(v, bool | str):
        return str(v)
    f = float(v)
    return f"{int(f):,}" if f.is_integer() else f"{f:,.1f}"


def minute(v: Any) -> str:
    """A time to the minute (``2026-11-29 00:32``)."""
    if missing(v):
        return MISSING
    try:
        return pd.Timestamp(v).strftime("%Y-%m-%d %H:%M")
    except (ValueError, TypeError):
        return str(v)


def cut(limit: int) -> Callable[[Any], str]:
    """Text cut to ``limit`` characters (``…`` in place of the rest)."""

    def fmt(v: Any) -> str:
        if missing(v) or v == "":
            return "" if v == "" else MISSING
        text = " ".join(str(v).split())  # (a note's line breaks would break the row)
        return text if len(text) <= limit else text[: limit - 1] + "…"

    return fmt


@dataclass(frozen=True)
class Shown:
    """A column as a :class:`FittedFrame` shows it."""

    column: str
    header: str
    fmt: Callable[[Any], str] = general
    keep: int = 0
    """How much it is needed: a terminal too narrow for every column drops the lowest first."""
    optional: bool = False
    """Shown only when some row has a value (a served run's usage, a problem, tags)."""


class FittedFrame(pd.DataFrame):
    """A DataFrame that shows its :attr:`VIEW` (see the module's docstring)."""

    VIEW: ClassVar[tuple[Shown, ...]] = ()
    HIDDEN: ClassVar[frozenset[str]] = frozenset()
    """Columns the display leaves out (they are in the frame: a run's ``path``, which its ``run`` names)."""
    _metadata: ClassVar[list[str]] = []

    @property
    def _constructor(self) -> type[FittedFrame]:
        return type(self)

    def view(self) -> list[Shown]:
        """The columns shown, in order: the view's that this frame has (an ``optional`` one only with a
        value), then the frame's other columns, as they are."""
        named = {s.column for s in self.VIEW}
        shown = [
            s
            for s in self.VIEW
            if s.column in self.columns
            and not (s.optional and not self[s.column].map(lambda v: not missing(v) and v != "").any())
        ]
        for c in self.columns:
            if c not in named and c not in self.HIDDEN:
                fmt = decimals() if pd.api.types.is_float_dtype(self[c].dtype) else general
                shown.append(Shown(str(c), str(c), fmt))
        return shown

    def shown(self, view: list[Shown] | None = None) -> pd.DataFrame:
        """The view as a plain frame of text: what the table shows."""
        view = self.view() if view is None else view
        return pd.DataFrame(
            {s.header: [s.fmt(v) for v in self[s.column].tolist()] for s in view}, index=self.index
        )

    def __repr__(self) -> str:
        if self.columns.has_duplicates:  # (a view names its columns one by one)
            return repr(pd.DataFrame(self))
        return self.to_text()

    def to_text(self, width: int | None = None, index: bool = True) -> str:
        """The table as a terminal shows it: as many of the view's columns as fit ``width`` (the
        terminal's; pandas' ``display.width`` when output is not a terminal), the least needed dropped
        first and named below; ``index``: with the frame's index (a command's report leaves it out)."""
        width = width or _terminal_width()
        full = self.view()
        view = list(full)
        while True:
            text = self.shown(view).to_string(max_rows=pd.get_option("display.max_rows"), index=index)
            if len(view) <= 1 or max(map(len, text.splitlines()), default=0) <= width:
                break
            view.pop(min(range(len(view)), key=lambda i: (view[i].keep, -i)))  # (the rightmost of the least)
        dropped = [s.column for s in full if s not in view]
        if dropped:
            text += "\n(not shown, to fit: " + ", ".join(dropped) + ")"
        return text

    def _repr_html_(self) -> str | None:
        """The view as an HTML table whose every cell stays on one line (a wide table scrolls)."""
        if self.columns.has_duplicates:
            return pd.DataFrame(self)._repr_html_()
        table = f"mlora-table-{next(_ids)}"
        body = self.shown().to_html(
            table_id=table,
            max_rows=pd.get_option("display.max_rows"),
            max_cols=pd.get_option("display.max_columns"),
            notebook=True,
            border=0,
        )
        style = f"<style>#{table} th, #{table} td {{white-space: nowrap}}</style>"
        return f"<div style='overflow-x:auto'>{style}{body}</div>"


def _terminal_width() -> int:
    """Columns of the terminal the output goes to (pandas' ``display.width`` otherwise: 80)."""
    fallback = int(pd.get_option("display.width") or 80)
    return shutil.get_terminal_size((fallback, 24)).columns


def spreadsheet_csv(frame: pd.DataFrame) -> str:
    """``frame`` as CSV that is safe to open in a spreadsheet: a text cell or header that would start a formula
    (a completion ``=HYPERLINK(...)``, a quarantine reason) gets a leading ``'``
    (:func:`~mlora_lab.text.spreadsheet_safe`); number columns stay numbers. Rows end with CRLF, as RFC 4180
    has it: the csv writer then quotes a cell holding a lone ``\\r`` too, which a reader would otherwise take
    for the end of a row."""
    frame = frame.rename(columns=spreadsheet_safe)
    for column in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[column]):  # (a number column holds no text to run)
            frame[column] = frame[column].map(spreadsheet_safe)
    return frame.to_csv(index=False, lineterminator="\r\n")
