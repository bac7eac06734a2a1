"""The eval table: an evaluation's examples with the chosen models' outputs side by side, their scores and
each one's change from a reference column, in a notebook (``ev.table()``, :class:`EvalTable`).

Per example (a row): the prompt, the example's reference columns (``answer``...), then per model shown its
first completion, its score for the chosen metric (the mean over its samples) and ``Δ``, that score minus
the reference model's (green above, red below). Above the rows, a leaderboard (each model's mean with its
bootstrap interval, :meth:`~mlora_lab.lab.evals.evaluation.Evaluation.plot`) and the controls:

- **filter**: ``all``; ``disagreements`` (the models shown do not all score the same); ``regressions`` (a model
  scores below the reference) and ``improvements`` (above);
- **search**: examples whose prompt, reference or a shown completion contains the text (case-insensitive);
- **sort**: by example, largest change first (``|Δ|``), or by the reference's score (worst or best first);
- **export**: the rows as filtered and sorted, to CSV (spreadsheet-safe: a text cell that would start a
  formula gets a leading ``'``) and to a standalone HTML page, written into the evaluation's folder in its
  run (else the working directory).

The rows are built by :meth:`EvalTable.frame` (a DataFrame, what the exports write), so all of it is also
usable without widgets.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

import ipywidgets as W
import numpy as np
import pandas as pd

from mlora_lab.lab.plotting import DISPLAY_DPI, figure_png
from mlora_lab.lab.tables import spreadsheet_csv
from mlora_lab.rundir.files import atomic_write_text

FILTERS = ("all", "disagreements", "regressions", "improvements")
SORTS = ("example", "largest change", "reference worst first", "reference best first")
PAGE = 50
"""Rows shown at first (``show more`` adds as many)."""


def _text(prompt: Any) -> str:
    """A prompt as one line of text: a chat's messages as ``role: content`` lines."""
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)
        )
    return str(prompt)


class EvalTable:
    """The eval table of ``evaluation`` (see the module docstring). ``models``: the columns shown (default
    every model); ``reference``: the column the others' ``Δ`` is taken from (default ``base`` when there
    is one, else the first); ``metric``: the score shown (default the first)."""

    def __init__(
        self,
        evaluation: Any,  # (an Evaluation: it makes its own table, so this module does not import it)
        models: list[str] | None = None,
        reference: str | None = None,
        metric: str | None = None,
        export_dir: str | os.PathLike | None = None,
    ) -> None:
        self.ev = evaluation
        names = evaluation.models
        reference = reference or ("base" if "base" in names else names[0])
        for m in [*(models or []), reference]:
            if m not in names:
                raise KeyError(f"no model {m!r} in evaluation {evaluation.name!r}; models: {names}")
        if metric is not None and metric not in evaluation.metrics:
            raise KeyError(
                f"no metric {metric!r} in evaluation {evaluation.name!r}; metrics: {evaluation.metrics}"
            )
        self.export_dir = Path(export_dir) if export_dir else (evaluation.folder or Path.cwd())
        self.models = W.SelectMultiple(
            options=names, value=tuple(models or names), description="models", rows=min(6, len(names))
        )
        self.reference = W.Dropdown(options=names, value=reference, description="reference")
        self.metric = W.Dropdown(
            options=evaluation.metrics, value=metric or evaluation.metrics[0], description="metric"
        )
        self.filter = W.ToggleButtons(options=FILTERS, value="all")
        self.search = W.Text(
            placeholder="search prompts, references and completions", continuous_update=False
        )
        self.sort = W.Dropdown(options=SORTS, value="example", description="sort")
        self.more = W.Button(description="show more")
        self.csv = W.Button(description="export CSV")
        self.page = W.Button(description="export HTML")
        self.saved = W.HTML()
        self.count = W.HTML()
        self.leaderboard = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.rows = W.HTML()
        self.shown = PAGE
        for w in (self.models, self.reference, self.metric, self.filter, self.search, self.sort):
            w.observe(lambda _: self.update(reset=True), names="value")
        self.metric.observe(lambda _: self.draw_leaderboard(), names="value")
        self.more.on_click(lambda _: self.show_more())
        self.csv.on_click(lambda _: self._say(self.to_csv()))
        self.page.on_click(lambda _: self._say(self.to_html()))
        controls = W.VBox([
            W.HBox([self.models, W.VBox([self.reference, self.metric, self.sort])]),
            W.HBox([self.filter, self.search]),
            W.HBox([self.count, self.more, self.csv, self.page, self.saved]),
        ])  # fmt: skip
        self.widget = W.VBox([self.leaderboard, controls, self.rows])
        self.draw_leaderboard()
        self.update(reset=True)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # -- the rows --------------------------------------------------------------------------------
    def frame(self) -> pd.DataFrame:
        """The rows as the controls filter and sort them: ``example, prompt``, the reference columns, then
        per shown model ``<model>`` (its first completion), ``<model> <metric>`` and ``<model> Δ``."""
        ev, metric, ref = self.ev, self.metric.value, self.reference.value
        shown = list(self.models.value) or [ref]
        scores = ev.per_example()[metric]  # [models, examples]
        first = {(r.model, r.example): r for r in ev.rows if r.sample == 0}
        columns = list(dict.fromkeys(k for r in ev.rows for k in r.columns))
        n = ev.meta.examples
        table: dict[str, Any] = {"example": np.arange(n)}
        table["prompt"] = [
            _text(first[(ev.models[0], e)].prompt) if (ev.models[0], e) in first else "" for e in range(n)
        ]
        any_row = {r.example: r for r in ev.rows}
        for c in columns:
            table[c] = [any_row[e].columns.get(c) if e in any_row else None for e in range(n)]
        ref_scores = scores[ev.models.index(ref)]
        for m in shown:
            i = ev.models.index(m)
            table[m] = [getattr(first.get((m, e)), "completion", "") for e in range(n)]
            table[f"{m} {metric}"] = scores[i]
            table[f"{m} Δ"] = scores[i] - ref_scores
        frame = pd.DataFrame(table)
        view = np.vstack([scores[ev.models.index(m)] for m in shown])
        others = np.vstack(
            [scores[ev.models.index(m)] - ref_scores for m in shown if m != ref] or [np.zeros(n)]
        )
        with np.errstate(invalid="ignore"):
            keep = {
                "all": np.ones(n, dtype=bool),
                "disagreements": np.nanmax(view, axis=0) != np.nanmin(view, axis=0) if len(shown) > 1 else np.zeros(n, bool),
                "regressions": (others < 0).any(axis=0),
                "improvements": (others > 0).any(axis=0),
            }[self.filter.value]  # fmt: skip
        text = self.search.value.strip().lower()
        if text:
            fields = ["prompt", *columns, *shown]
            hay = [
                "\n".join(_text(v) for v in row if v is not None).lower()
                for row in frame[fields].itertuples(index=False)
            ]
            keep = keep & np.array([text in h for h in hay], dtype=bool)
        frame = frame[keep]
        if self.sort.value == "largest change":
            change = np.nanmax(np.abs(others[:, keep]), axis=0) if keep.any() else np.zeros(0)
            frame = frame.iloc[np.argsort(-np.nan_to_num(change, nan=-1.0), kind="stable")]
        elif self.sort.value.startswith("reference"):
            ascending = self.sort.value.endswith("worst first")
            frame = frame.sort_values(f"{ref} {metric}" if ref in shown else "example", ascending=ascending,
                                      kind="stable", na_position="last")  # fmt: skip
        return frame.reset_index(drop=True)

    def html(self, limit: int | None = None) -> str:
        """The rows (at most ``limit``) as an HTML table: completions side by side, each with its score
        and its Δ (green above the reference, red below), the reference column shaded."""
        frame = self.frame()
        metric, ref = self.metric.value, self.reference.value
        shown = list(self.models.value) or [ref]
        columns = [c for c in frame.columns if c not in ("example", "prompt") and not any(
            c == m or c.startswith(f"{m} ") for m in shown)]  # fmt: skip
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ["#", "prompt", *columns])
        head += "".join(
            f"<th style='background:{'#eef3f8' if m == ref else 'none'}'>{html.escape(m)}"
            f"{' (reference)' if m == ref else ''}</th>"
            for m in shown
        )
        body = []
        for _, row in frame.head(limit).iterrows() if limit is not None else frame.iterrows():
            cells = [f"<td>{int(row['example'])}</td>", f"<td>{_cell(row['prompt'])}</td>"]
            cells += [f"<td>{_cell(row[c])}</td>" for c in columns]
            for m in shown:
                score, delta = row[f"{m} {metric}"], row[f"{m} Δ"]
                mark = "" if m == ref or not np.isfinite(delta) or delta == 0 else (
                    f" <b style='color:{'#1e8449' if delta > 0 else '#c0392b'}'>Δ {delta:+.3g}</b>")  # fmt: skip
                shade = "background:#eef3f8;" if m == ref else ""
                cells.append(
                    f"<td style='{shade}'>{_cell(row[m])}<div style='color:#555;font-size:11px'>"
                    f"{html.escape(metric)} {_num(score)}{mark}</div></td>"
                )
            body.append(f"<tr>{''.join(cells)}</tr>")
        style = (
            "<style>.mlora-eval td,.mlora-eval th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;"
            "text-align:left;font-size:12px;max-width:420px}.mlora-eval{border-collapse:collapse}"
            ".mlora-eval pre{white-space:pre-wrap;margin:0;font-family:inherit}</style>"
        )
        return f"{style}<table class='mlora-eval'><tr>{head}</tr>{''.join(body)}</table>"

    def update(self, reset: bool = False) -> None:
        """Rebuild the rows for the controls (``reset``: back to the first page)."""
        if reset:
            self.shown = PAGE
        total = len(self.frame())
        self.rows.value = self.html(limit=self.shown)
        self.count.value = f"{min(self.shown, total)} of {total} examples ({self.ev.meta.examples} in all)"
        self.more.layout.display = "" if total > self.shown else "none"

    def show_more(self) -> None:
        self.shown += PAGE
        self.update()

    def draw_leaderboard(self) -> None:
        """The leaderboard of the chosen metric, shown at its display size (rendered at twice it)."""
        fig = self.ev.plot(self.metric.value)
        self.leaderboard.value = figure_png(fig)
        self.leaderboard.width = str(int(fig.get_figwidth() * DISPLAY_DPI))

    # -- exports ---------------------------------------------------------------------------------
    def to_csv(self, path: str | os.PathLike | None = None) -> Path:
        """The rows as filtered and sorted, as CSV (default ``<evaluation>-<metric>.csv`` in the export folder).
        Safe to open in a spreadsheet: a text cell or header that would start a formula (a completion
        ``=HYPERLINK(...)``) gets a leading ``'`` (:func:`~mlora_lab.text.spreadsheet_safe`); numbers stay
        numbers. Rows end with CRLF, and a cell holding a line break is quoted."""
        out = Path(path) if path else self.export_dir / f"{self.ev.name}-{self.metric.value}.csv"
        atomic_write_text(out, spreadsheet_csv(self.frame()))
        return out

    def to_html(self, path: str | os.PathLike | None = None) -> Path:
        """The rows as filtered and sorted, with the leaderboard's numbers, as one standalone HTML page."""
        out = Path(path) if path else self.export_dir / f"{self.ev.name}-{self.metric.value}.html"
        scores = self.ev.scores()
        metric = self.metric.value
        failed = scores.get(f"{metric}_failed")
        board = "".join(
            f"<li>{html.escape(m)}: failed ({html.escape(failed[m])})</li>"
            if failed is not None and isinstance(failed[m], str)
            else f"<li>{html.escape(m)}: {_num(scores.loc[m, metric])} "
            f"[{_num(scores.loc[m, f'{metric}_low'])}, {_num(scores.loc[m, f'{metric}_high'])}]</li>"
            for m in self.ev.models
        )
        title = html.escape(f"evaluation {self.ev.name}: {metric}")
        page = (
            f"<!doctype html><meta charset='utf-8'><title>{title}</title><h2>{title}</h2>"
            f"<ul>{board}</ul><p>{html.escape(self.count.value)}; filter {html.escape(self.filter.value)}"
            f"{'; search ' + html.escape(repr(self.search.value)) if self.search.value else ''}</p>{self.html()}"
        )
        atomic_write_text(out, page)
        return out

    def _say(self, path: Path) -> None:
        self.saved.value = f"<span style='font-size:12px'>saved {html.escape(str(path))}</span>"


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ""
    return f"<pre>{html.escape(_text(value))}</pre>"


def _num(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float | np.floating) and np.isfinite(value) else "–"
