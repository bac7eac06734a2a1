"""The dashboard's logs tab (a live tail of each rank's log, errors in red) and its export (the
figures as PNG and SVG, the shown tenants' metrics as CSV, each file written atomically)."""

from __future__ import annotations

import html
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import ipywidgets as W
import pandas as pd
from matplotlib.figure import Figure

from mlora_lab.lab.dashboard.figures import RED
from mlora_lab.lab.plotting import figure_png, figure_svg, fit_layout
from mlora_lab.lab.records.logs import log_files, tail_lines
from mlora_lab.lab.tables import spreadsheet_csv
from mlora_lab.rundir import RunDir, atomic_write_bytes

ERROR_LINE = re.compile(r"Traceback|Error|error:|Exception|\bFAILED\b|Killed")
LOG_LINES = 40


class LogTab:
    """A dropdown of the chosen runs' logs (``source``: each rank's, then the launcher's) and the
    last :data:`LOG_LINES` lines of the one picked (``view``), redrawn only when the file changed."""

    def __init__(self, quieted: Callable[[], object]) -> None:
        self.source = W.Dropdown(options=[], description="log")
        self.view = W.HTML()
        self.box = W.VBox([self.source, self.view])
        self._quieted = quieted  # a context manager: the dashboard itself changes the dropdown
        self._shown: tuple | None = None

    def update(self, runs: Sequence[tuple[str, RunDir]], force: bool = False) -> None:
        """Offer the logs of ``runs`` ((name, run directory) of the runs shown) and show the picked one."""
        options = []
        for name, run in runs:
            for path in log_files(run):
                what = "launcher" if path.stem == "launcher" else f"rank {path.stem[4:]}"
                options.append((f"{name} / {what}" if len(runs) > 1 else what, str(path)))
        if list(self.source.options) != options:
            current = self.source.value
            with self._quieted():
                self.source.options = options
                paths = dict(options).values()
                self.source.value = current if current in paths else (options[0][1] if options else None)
        path = self.source.value
        if path is None:
            self.view.value = "<i>no logs yet</i>"
            return
        try:
            stat = Path(path).stat()
            mark = (path, stat.st_size, stat.st_mtime_ns)
        except OSError:
            mark = (path, None, None)
        if mark == self._shown and not force:
            return
        self._shown = mark
        lines = []
        for line in tail_lines(Path(path), LOG_LINES).splitlines():
            text = html.escape(line)
            if ERROR_LINE.search(line):  # errors stand out in a long tail
                text = f"<span style='color:{RED};font-weight:bold'>{text}</span>"
            lines.append(text)
        self.view.value = (
            "<pre style='max-height:420px;overflow:auto;font-size:12px;line-height:1.3;margin:0;"
            f"white-space:pre-wrap'>{chr(10).join(lines) or '<i>empty</i>'}</pre>"
        )


def default_export_dir(paths: Sequence[Path]) -> Path | None:
    """A single run's ``exports/``, or ``exports/`` next to several runs (runs of one workdir:
    ``<workdir>/exports``); None when no run is shown."""
    if not paths:
        return None
    if len(paths) == 1:
        return paths[0] / "exports"
    return Path(os.path.commonpath(paths)) / "exports"


def export_files(
    folder: Path, figures: Sequence[tuple[str, Figure]], metrics: pd.DataFrame | None
) -> list[Path]:
    """Write each named figure (PNG at twice the display resolution, and SVG) and the metrics (CSV)
    into ``folder``, each file atomically (the CSV safe to open in a spreadsheet: :func:`spreadsheet_csv`); names start with the time, so exports never overwrite each
    other. Returns the files written."""
    # an exports/ folder (a run's, or next to the runs: the default) is a folder of the runs: never
    # written through a link planted in its place; a folder named otherwise is taken as given
    root = folder.parent if folder.name == "exports" else folder
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if folder.is_dir() and any(folder.glob(f"{stamp}-*")):  # a second export within the second
        stamp += f"-{time.monotonic_ns() % 10**6:06d}"
    written = []
    for name, fig in figures:
        fit_layout(fig)
        for suffix, data in (("png", figure_png(fig)), ("svg", figure_svg(fig))):
            path = folder / f"{stamp}-{name}.{suffix}"
            atomic_write_bytes(path, data, root=root)
            written.append(path)
    if metrics is not None:
        path = folder / f"{stamp}-metrics.csv"
        atomic_write_bytes(path, spreadsheet_csv(metrics).encode(), root=root)
        written.append(path)
    return written


ADAPTER_FORMATS = [("GGUF adapter (llama.cpp, Ollama)", "gguf"), ("merged model (transformers)", "merged")]


def export_adapter(
    run: RunDir, tenant: str, fmt: str, folder: str | os.PathLike, overwrite: bool = False
) -> Path:
    """``tenant``'s latest adapter in ``run`` as ``fmt`` (:data:`ADAPTER_FORMATS`) in ``folder``:
    ``<tenant>.gguf``, or a ``<tenant>-merged`` model directory (what ``Run.export`` and ``Run.merge`` write,
    refusing what they refuse: a folder in a run but its ``exports/``, an earlier export without
    ``overwrite``; :class:`~mlora_lab.lab.exports.ExportError`)."""
    from mlora_lab.lab.exports import export_gguf, merge
    from mlora_lab.spec.job import JobSpec

    adapter = run.adapter(tenant)
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no adapter saved yet for tenant {tenant!r} in {run.root}")
    spec = JobSpec.load(run.job)
    if fmt == "gguf":
        return export_gguf(
            adapter,
            spec.base_model,
            Path(folder) / f"{tenant}.gguf",
            revision=spec.revision,
            overwrite=overwrite,
        )
    out = Path(folder) / f"{tenant}-merged"
    return merge(
        adapter, spec.base_model, out, tokenizer=spec.tokenizer, revision=spec.revision, overwrite=overwrite
    )


class ExportTab:
    """The export tab: the folder (default: see :func:`default_export_dir`), a button for the figures
    and one for the metrics, a tenant's adapter as GGUF or merged into its base (:func:`export_adapter`),
    and what was written (or why not)."""

    def __init__(self, export_dir: str | os.PathLike | None, export: Callable[..., list[Path]]) -> None:
        self.folder = W.Text(
            value=str(export_dir) if export_dir else "", description="folder", layout=W.Layout(width="640px")
        )
        self.given = export_dir is not None
        self.figures_button = W.Button(
            description="Save figures (PNG + SVG)", icon="image", layout=W.Layout(width="220px")
        )
        self.csv_button = W.Button(
            description="Save metrics (CSV)", icon="table", layout=W.Layout(width="180px")
        )
        self.figures_button.on_click(lambda _: self._clicked(figures=True))
        self.csv_button.on_click(lambda _: self._clicked(figures=False))
        # (value: (RunDir, tenant) of a tenant shown with a saved adapter)
        self.adapter = W.Dropdown(options=[], description="adapter", layout=W.Layout(width="320px"))
        self.adapter_format = W.Dropdown(
            options=ADAPTER_FORMATS, description="as", layout=W.Layout(width="320px")
        )
        self.adapter_button = W.Button(
            description="Export adapter", icon="download", layout=W.Layout(width="160px")
        )
        self.adapter_overwrite = W.Checkbox(
            value=False, description="overwrite", indent=False, layout=W.Layout(width="100px"),
            tooltip="replace an earlier export of this adapter in the folder (a merge: only its own files)",
        )  # fmt: skip
        self.adapter_button.on_click(lambda _: self._adapter_clicked())
        self.message = W.HTML()
        self._export = export
        intro = W.HTML(
            "Writes the three figures (PNG at 2x and SVG) or the shown tenants' train and eval rows (CSV, a "
            "<code>run</code> column first) into the folder, atomically; the default folder is the run's "
            "<code>exports/</code>, or <code>exports/</code> next to the runs when several are shown."
        )
        self.box = W.VBox(
            [
                intro,
                self.folder,
                W.HBox([self.figures_button, self.csv_button]),
                W.HBox([self.adapter, self.adapter_format, self.adapter_overwrite, self.adapter_button]),
                self.message,
            ]
        )

    def follow(self, paths: Sequence[Path], adapters: Sequence[tuple[str, tuple[RunDir, str]]] = ()) -> None:
        """The default folder for the runs shown (unless a folder was given), and the adapters offered:
        ``(label, (run directory, tenant))`` of the shown tenants that have one saved."""
        if not self.given:
            default = default_export_dir(paths)
            self.folder.value = str(default) if default else ""
        options = list(adapters)
        if options != list(self.adapter.options):
            keep = self.adapter.value
            self.adapter.options = options
            if keep in [v for _, v in options]:
                self.adapter.value = keep
        self.adapter_button.disabled = not options

    def _adapter_clicked(self) -> None:
        if self.adapter.value is None or not self.folder.value:
            self.message.value = f"<span style='color:{RED}'>choose an adapter and a folder first</span>"
            return
        run_dir, tenant = self.adapter.value
        self.message.value = f"exporting {html.escape(tenant)}'s adapter ..."
        try:
            path = export_adapter(
                run_dir, tenant, self.adapter_format.value, self.folder.value, self.adapter_overwrite.value
            )
        except (OSError, ValueError) as e:
            self.message.value = f"<span style='color:{RED}'>export failed: {html.escape(str(e))}</span>"
            return
        self.message.value = f"wrote <code>{html.escape(str(path))}</code>"

    def _clicked(self, figures: bool) -> None:
        try:
            written = self._export(figures=figures, metrics=not figures)
        except (OSError, ValueError) as e:
            self.message.value = f"<span style='color:{RED}'>export failed: {html.escape(str(e))}</span>"
            return
        names = "".join(f"<li><code>{html.escape(str(p))}</code></li>" for p in written)
        self.message.value = f"wrote {len(written)} file{'s' if len(written) > 1 else ''}:<ul>{names}</ul>"
