"""The runs table of a view over several runs (or a workdir): sortable, filterable, a checkbox per run
to plot it."""

from __future__ import annotations

import html
import itertools
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from mlora_lab.lab.dashboard.model import RunView
from mlora_lab.lab.dashboard.progress import run_state_html
from mlora_lab.lab.plotting import shorten
from mlora_lab.lab.records.series import RunSeries
from mlora_lab.lab.records.usage import usage_cell

SORT_KEYS = ("started", "run", "state", "global step", "best loss (smoothed)", "tenants")
STATE_CHOICES = ["any state", "running", "finished", "failed", "stopped", "lost", "starting"]
COLUMNS = (
    ("run", 140),
    ("id", 175),
    ("state", 120),
    ("tenants", 130),
    ("step", 60),
    ("best loss", 100),
    ("started", 90),
    ("tags", 110),
    ("usage", 140),
)
"""The table's columns and their widths in pixels (each includes :data:`GAP`), short enough that a row fits a
laptop's notebook (955 px with the checkbox; 1,460 px wrapped every row onto two lines), each header whole.
``id`` fits a run directory's whole name (``20261129-003243-2679c1``, in a monospace font): it used to share
the run's cell and be cut to ``2026…`` behind a long name. ``usage`` is shown only when a run served clients."""
GAP = 10
"""Pixels between two cells: a cell's text is cut before it, never run into the next one's."""
MAX_NAMES = 50
"""A run's tenants are listed up to this many (a metrics file may name a million)."""


def columns(usage: bool) -> tuple[tuple[str, int], ...]:
    """The columns shown: all of :data:`COLUMNS`, ``usage`` only when some run has usage."""
    return tuple(c for c in COLUMNS if usage or c[0] != "usage")


class RunRow:
    """One row of the runs table: a checkbox and the run's cells."""

    def __init__(self, name: str, on_tick: Callable[[dict], None]) -> None:
        self.check = W.Checkbox(value=False, indent=False, layout=W.Layout(width="28px"))
        self.check.observe(on_tick, names="value")
        self.cells = W.HTML()
        self.box = W.HBox(
            [self.check, self.cells], layout=W.Layout(align_items="center", flex="0 0 auto")
        )  # (never shrunk in the scrolling list: see TenantProgress)
        self.name = name


def row_html(values: dict[str, Any] | None, shown: tuple[tuple[str, int], ...] = COLUMNS) -> str:
    """A row's cells (``None``: the header) of the ``shown`` columns, of fixed widths, each cut to one line
    with its whole text in the tooltip, and held on one line (a narrower output scrolls: a row that wrapped
    put half its cells under the others)."""
    cells = []
    for col, width in shown:
        if values is None:
            text, title = f"<b>{col}</b>", col
        else:
            text, title = values[col], values.get(f"{col}_title", "")
        cells.append(
            f"<span title='{html.escape(str(title), quote=True)}' style='display:inline-block;width:{width}px;"
            f"padding-right:{GAP}px;box-sizing:border-box;white-space:nowrap;overflow:hidden;"
            f"text-overflow:ellipsis;vertical-align:middle'>{text}</span>"
        )
    pad = "" if values is not None else "<span style='display:inline-block;width:30px'></span>"
    return f"<div style='white-space:nowrap'>{pad}{''.join(cells)}</div>"


def best_cell(feed: RunSeries) -> tuple[str, float | None, str]:
    """The best-loss cell of a run: its text, its sort key and its tooltip. The lowest smoothed train loss
    of its tenants that learn from data; for a run whose tenants all learn from rewards (a GRPO loss says
    nothing of how well they do), its highest smoothed mean reward instead."""
    loss, reward = feed.best()
    if loss is not None or reward is None:
        why = "the lowest smoothed train loss of any tenant (EMA 0.6, as the figure draws it)"
        return (f"{loss:.4f}" if loss is not None else "–"), loss, why
    why = "its tenants learn from rewards: the highest smoothed mean reward of any (EMA 0.6), not a loss"
    return f"reward {reward:.3f}", None, why


def row_values(view: RunView) -> dict[str, Any]:
    """A run's cells (HTML), their tooltips, its sort keys (``_sort``) and the text a filter matches
    (``_text``: run name, tenants, tags and note)."""
    feed, status = view.series, view.status
    tags, note = view.labels
    names = list(itertools.islice(feed.tenants, MAX_NAMES))
    more = len(feed.tenants) - len(names)
    listed = ", ".join(names) + (f", … ({more:,} more)" if more else "")
    best, best_key, best_title = best_cell(feed)
    used, used_title = usage_cell(feed.usage)
    started = status.started if status is not None and status.started else None
    state = str(view.state) if view.state is not None else "?"
    title = feed.title
    return {
        "run": f"<b>{html.escape(shorten(title, 40))}</b>",
        "run_title": f"{title}\n{view.name}\n{note[:500]}".strip(),
        "id": f"<span style='color:#666;font-family:monospace'>{html.escape(view.name)}</span>",
        "id_title": f"the run directory: {view.name}",
        "state": run_state_html(view),
        "state_title": state,
        "tenants": html.escape(f"{len(feed.tenants):,}: {listed}"),
        "tenants_title": listed,
        "step": str(feed.global_step),
        "step_title": "the job's global step (one per batch, whichever tenants took part)",
        "best loss": best,
        "best loss_title": best_title,
        "usage": html.escape(used),
        "_usage": bool(feed.usage),
        "usage_title": used_title or "a served job's clients' tokens (none here)",
        "started": time.strftime("%m-%d %H:%M", time.localtime(started)) if started else "–",
        "tags": html.escape(tags),
        "tags_title": f"{tags}\n{note[:500]}".strip(),
        "_sort": {
            "run": title,
            "state": state if view.state is not None else "",
            "global step": feed.global_step,
            "best loss (smoothed)": best_key if best_key is not None else float("inf"),
            "started": started or 0.0,
            "tenants": len(feed.tenants),
        },
        "_text": " ".join([title, view.name, *names, tags, note]).lower(),
    }


class RunsTable:
    """The table's widgets (:attr:`box`): a text filter (run, tenant or tag), a state filter, the sort
    key and direction, the header, and a :class:`RunRow` per run (:attr:`rows`) in :attr:`body`."""

    def __init__(self, on_tick: Callable[[str], None]) -> None:
        self.filter = W.Text(placeholder="filter: run, tenant or tag", layout=W.Layout(width="240px"))
        self.state_filter = W.Dropdown(options=STATE_CHOICES, layout=W.Layout(width="130px"))
        self.sort_by = W.Dropdown(
            options=list(SORT_KEYS), value="started", description="sort by", layout=W.Layout(width="210px")
        )
        self.sort_desc = W.ToggleButton(
            value=True, description="descending", icon="sort-amount-desc", layout=W.Layout(width="130px")
        )
        self.shown = columns(usage=False)
        self.header = W.HTML(row_html(None, self.shown))
        self.body = W.VBox(layout=W.Layout(max_height="240px", overflow="auto"))
        self.rows: dict[str, RunRow] = {}
        self._on_tick = on_tick
        self._views: dict[str, RunView] = {}
        for w in (self.filter, self.state_filter, self.sort_by, self.sort_desc):
            w.observe(lambda _: self.render(), names="value")
        self.sort_desc.observe(self._on_sort_direction, names="value")
        controls = W.HBox([self.filter, self.state_filter, self.sort_by, self.sort_desc])
        self.box = W.VBox(
            [controls, self.header, self.body],
            layout=W.Layout(display="none", border="1px solid #ddd", padding="4px", margin="4px 0"),
        )

    def add(self, view: RunView) -> None:
        if view.name not in self.rows:
            self._views[view.name] = view
            self.rows[view.name] = RunRow(view.name, lambda _change, n=view.name: self._on_tick(n))

    @property
    def chosen(self) -> list[str]:
        """The runs ticked, in the order they were offered."""
        return [n for n, row in self.rows.items() if row.check.value]

    def render(self) -> None:
        """Refresh every row's cells, then show the rows that pass the filters, sorted."""
        rows = []
        text = self.filter.value.strip().lower()
        state = self.state_filter.value
        every = {name: row_values(self._views[name]) for name in self.rows}
        self.shown = columns(usage=any(values["_usage"] for values in every.values()))
        header = row_html(None, self.shown)
        if self.header.value != header:
            self.header.value = header
        for name, row in self.rows.items():
            view = self._views[name]
            values = every[name]
            cells = row_html(values, self.shown)
            if row.cells.value != cells:
                row.cells.value = cells
            if text and text not in values["_text"]:
                continue
            if state != "any state" and view.state != state:
                continue
            rows.append((values["_sort"][self.sort_by.value], name))
        rows.sort(reverse=self.sort_desc.value)
        children = tuple(self.rows[n].box for _, n in rows)
        if self.body.children != children:
            self.body.children = children

    def _on_sort_direction(self, change: dict) -> None:
        self.sort_desc.description = "descending" if change["new"] else "ascending"
        self.sort_desc.icon = "sort-amount-desc" if change["new"] else "sort-amount-asc"
