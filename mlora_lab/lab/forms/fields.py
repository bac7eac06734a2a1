"""Form inputs made from field metadata, and how forms show problems: the parts of the notebook
forms (:mod:`mlora_lab.lab.forms.builders`) that know no particular form.

Every ``Tenant`` (or ``JobSpec``) field shown in forms gets an input of its kind (:func:`make_input`
from its :class:`~mlora_lab.spec.fields.FieldInfo`), with its label and help line, in its section
(:func:`layout_inputs`), and is read back into the dataclass (:meth:`FieldInput.read`). Inputs never
clamp: a value out of range stays as typed and is reported (:func:`problems_html`).
"""

from __future__ import annotations

import contextlib
import html
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as W

from mlora_lab.lora.targets import ALL_LINEAR
from mlora_lab.rundir import atomic_write_bytes
from mlora_lab.sources import FILE_SUFFIXES
from mlora_lab.spec.fields import FieldInfo, Problem
from mlora_lab.text import show_path

LABEL_WIDTH = "150px"
"""Width of the forms' label column: room for ``MAX_LABEL`` characters, so no label is cut off."""
LABEL_STYLE = {"description_width": LABEL_WIDTH}


def wide_layout() -> W.Layout:
    return W.Layout(width="460px")


def narrow_layout() -> W.Layout:
    return W.Layout(width="290px")


# ---------------------------------------------------------------------------------------------
# Inputs made from field metadata
# ---------------------------------------------------------------------------------------------


def nice_values(lo: float, hi: float) -> list[tuple[str, float]]:
    """``(label, value)`` of 1, 2, 3 and 5 x 10^k between ``lo`` and ``hi``. Each value is parsed from
    its decimal text, so it is the float a user typing ``3e-4`` gets (``3 * 10**-4`` is not)."""
    out = []
    for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 3, 5):
            v = float(f"{m}e{k}")
            if lo <= v <= hi:
                out.append((f"{m}e{k}", v))
    return out


@dataclass
class FieldInput:
    """The input of one field: the widget whose ``value`` is the field's, its helpers, and its row."""

    name: str
    info: FieldInfo
    widget: W.ValueWidget
    """The form attribute named like the field (``form.lr``)."""
    default: Any
    """The dataclass default, shown in a number input switched off by ``null_means``."""
    extras: dict[str, W.Widget] = field(default_factory=dict)
    """Helper widgets, also form attributes: the ``null_means`` checkbox (``no_clipping``), a log-float's
    snapping slider (``lr_slider``), a targets list's note (``target_modules_note``)."""
    row: W.Widget | None = None
    """What the form lays out: the input, its helpers and its help line."""
    chooser: FileChooser | None = None
    """A path input's file chooser and upload."""

    @property
    def null_toggle(self) -> W.Checkbox | None:
        return self.extras.get(self.info.null_means.replace(" ", "_")) if self.info.null_means else None

    def show(self, value: Any) -> None:
        """Put ``value`` (from a dataclass) into the input; nothing is clamped (sliders widen instead)."""
        info, w = self.info, self.widget
        if info.kind in ("name", "text", "path", "dir"):
            w.value = "" if value is None else str(value)
        elif info.kind == "targets":
            targets = [str(x) for x in value] if isinstance(value, list | tuple) else []
            extra = [x for x in targets if x not in w.options]
            if extra:  # e.g. full module names: offer them so the selection can hold them
                w.options = [*w.options, *extra]
            w.value = targets
        elif info.kind == "choice":
            w.value = value if value in info.choices else info.choices[0]
        elif info.kind == "bool":
            w.value = bool(value)
        elif value is None and self.null_toggle is not None:
            self.null_toggle.value = True
            # (a field whose default is None shows its lowest value until switched on)
            w.value = self.default if self.default is not None else type(w.value)(info.min or 0)
        else:
            if self.null_toggle is not None:
                self.null_toggle.value = False
            number = int(value) if info.kind == "int" else float(value)
            if isinstance(w, W.IntSlider | W.FloatSlider):
                w.min, w.max = min(w.min, number), max(w.max, number)
            w.value = number
        if self.null_toggle is not None:
            w.disabled = self.null_toggle.value

    def read(self) -> Any:
        """The field's value as the dataclass takes it."""
        info, value = self.info, self.widget.value
        if info.kind in ("name", "text", "path", "dir"):
            text = value.strip()
            return None if info.optional and not text else text
        if info.kind == "targets":
            return list(value)
        if self.null_toggle is not None and self.null_toggle.value:
            return None
        return value

    def is_empty(self) -> bool:
        """A required text input left empty (the form then says ``info.empty``)."""
        return bool(self.info.empty) and isinstance(self.widget.value, str) and not self.widget.value.strip()


def make_input(
    name: str,
    info: FieldInfo,
    default: Any,
    paths: list[str],
    targets: list[str],
    folder: str | os.PathLike | None = None,
) -> FieldInput:
    """The input for field ``name`` from its :class:`FieldInfo`: ``paths`` are offered by ``path``
    inputs, ``targets`` by ``targets`` inputs. Number inputs are unbounded (a bounded one would clamp
    silently); sliders span ``typical`` (or ``min`` .. the ``at_most`` bound, set by the form). A path
    input has a file chooser (``<name>_browse``, starting in ``folder``) and, for a file, an upload
    button (``<name>_upload``: the file is saved into ``folder``)."""
    common: dict[str, Any] = {"description": info.label, "style": LABEL_STYLE, "tooltip": info.help or None}
    kind, extras = info.kind, {}
    chooser = None
    if kind == "name":
        widget = W.Text(layout=narrow_layout(), **common)
    elif kind == "text":
        widget = W.Text(placeholder="optional" if info.optional else "", layout=wide_layout(), **common)
    elif kind in ("path", "dir"):
        hint = "path/to/train.jsonl" if kind == "path" else "directory"
        # continuous_update=False: a path is checked when typed out, not on every keystroke.
        cls = W.Combobox if kind == "path" else W.Text
        extra = {"options": paths, "ensure_option": False} if kind == "path" else {}
        widget = cls(
            placeholder=f"optional: {hint}" if info.optional else hint,
            continuous_update=False,
            layout=wide_layout(),
            **extra,
            **common,
        )
        chooser = FileChooser(widget, folder, want_dir=kind == "dir")
        extras[f"{name}_browse"] = chooser.toggle
        if chooser.upload is not None:
            extras[f"{name}_upload"] = chooser.upload
    elif kind == "int" and info.slider:
        lo = int(info.min if info.min is not None else 0)
        widget = W.IntSlider(min=lo, max=max(lo, 1), layout=wide_layout(), **common)
    elif kind == "int":
        widget = W.IntText(layout=narrow_layout(), **common)
    elif kind == "float" and info.slider:
        lo, hi = info.typical or (info.min or 0.0, info.max or 1.0)
        widget = W.FloatSlider(min=lo, max=hi, step=info.step or 0.01, layout=wide_layout(), **common)
    elif kind in ("float", "log-float"):
        # An exact input: what is typed is what the Tenant gets (a log slider can only land near 3e-4).
        widget = W.FloatText(layout=narrow_layout(), **common)
        if kind == "log-float" and info.typical:
            extras[f"{name}_slider"] = snapping_slider(widget, info.typical)
    elif kind == "bool":
        widget = W.Checkbox(indent=True, layout=narrow_layout(), **common)
    elif kind == "choice":
        widget = W.Dropdown(options=list(info.choices), layout=narrow_layout(), **common)
    elif kind == "targets":
        widget = W.SelectMultiple(
            options=[ALL_LINEAR, *targets], rows=min(len(targets) + 1, 9), layout=wide_layout(), **common
        )
        extras[f"{name}_note"] = W.HTML()
    else:
        raise ValueError(f"field {name!r}: a form has no input for kind {kind!r}")
    if info.null_means:
        extras[info.null_means.replace(" ", "_")] = W.Checkbox(
            description=info.null_means, indent=False, layout=W.Layout(width="130px")
        )
    inp = FieldInput(name, info, widget, default, extras)
    help_line = W.HTML(f"<span style='color:#57606a;font-size:90%'>{html.escape(info.help)}</span>")
    parts = [widget, *(w for k, w in extras.items() if not k.endswith("_note")), help_line]
    row = W.HBox(parts, layout=W.Layout(align_items="center"))
    below = [w for w in (extras.get(f"{name}_note"), chooser.box if chooser else None) if w is not None]
    inp.row = W.VBox([row, *below]) if below else row
    inp.chooser = chooser
    return inp


DATA_SUFFIXES = FILE_SUFFIXES
"""Files a data input's chooser lists and its upload accepts (what ``Tenant.data`` reads)."""
CHOOSER_ENTRIES = 500
"""A chooser lists at most this many entries of a folder."""


class FileChooser:
    """A file (or folder) chooser made of widgets, for a path input (``target``).

    ``toggle`` ("browse…") shows ``box``: the folder it is in and a list of its sub-folders and data
    files (:data:`DATA_SUFFIXES`); picking a folder opens it (``..`` goes up), picking a file puts its
    path into the input (relative to the working directory when it is under it) and closes the
    chooser; for a folder input, "use this folder" puts the folder's. ``upload`` (file inputs only) takes
    a file from the browser's machine and saves it into ``folder`` (``uploads/`` by default) under its
    own name made safe, never over another file, then puts its path into the input."""

    def __init__(self, target: W.ValueWidget, folder: str | os.PathLike | None, want_dir: bool) -> None:
        self.target = target
        self.want_dir = want_dir
        self.home = Path(folder) if folder is not None else None
        self.folder = Path(folder or ".").absolute()
        self.toggle = W.ToggleButton(
            description="browse…",
            icon="folder-open",
            tooltip="pick from this machine's files",
            layout=W.Layout(width="100px"),
        )
        self.upload: W.FileUpload | None = None
        if not want_dir:
            self.upload = W.FileUpload(
                accept=",".join(DATA_SUFFIXES),
                multiple=False,
                description="upload",
                tooltip="send a file from your computer (saved next to the data)",
                layout=W.Layout(width="100px"),
            )
            self.upload.observe(self._on_upload, names="value")
        self.where = W.HTML()
        self.entries = W.Select(options=[], rows=8, layout=wide_layout())
        self.use = W.Button(
            description="use this folder",
            icon="check",
            layout=W.Layout(width="160px", display="" if want_dir else "none"),
        )
        self.message = W.HTML()
        self.box = W.VBox(
            [self.where, self.entries, W.HBox([self.use, self.message])],
            layout=W.Layout(display="none", margin="0 0 0 150px"),
        )
        self.toggle.observe(lambda change: self.show(change["new"]), names="value")
        self.entries.observe(self._on_pick, names="value")
        self.use.on_click(lambda _: self.choose(self.folder))

    def show(self, on: bool) -> None:
        if on:
            self.open(self.folder)
        self.box.layout.display = "" if on else "none"
        if self.toggle.value != on:
            self.toggle.value = on

    def open(self, folder: Path) -> None:
        """List ``folder`` (sub-folders, then the files a data input takes; hidden ones left out)."""
        try:
            names = sorted(os.listdir(folder))
        except OSError as e:
            self.message.value = message_html(f"cannot list {folder}: {e.strerror or e}", good=False)
            return
        self.folder = folder
        dirs = [n for n in names if not n.startswith(".") and (folder / n).is_dir()]
        files = (
            []
            if self.want_dir
            else [
                n
                for n in names
                if not n.startswith(".") and n.endswith(DATA_SUFFIXES) and (folder / n).is_file()
            ]
        )
        options = [("📁 ..", str(folder.parent))] if folder.parent != folder else []
        options += [(f"📁 {n}", str(folder / n)) for n in dirs] + [
            (f"📄 {n}", str(folder / n)) for n in files
        ]
        more = len(options) - CHOOSER_ENTRIES
        self.entries.unobserve(self._on_pick, names="value")
        self.entries.options = options[:CHOOSER_ENTRIES]
        self.entries.value = None
        self.entries.observe(self._on_pick, names="value")
        shown = html.escape(show_path(str(folder)))
        self.where.value = f"<code>{shown}</code>" + (
            f" <i>(the first {CHOOSER_ENTRIES} of {len(options):,})</i>" if more > 0 else ""
        )
        self.message.value = ""

    def _on_pick(self, change: dict) -> None:
        path = change["new"]
        if path is None:
            return
        path = Path(path)
        if path.is_dir():
            self.open(path)
        else:
            self.choose(path)

    def choose(self, path: Path) -> None:
        """Put ``path`` into the input (relative to the working directory when under it) and close."""
        self.target.value = shown_path(path)
        self.show(False)

    def _on_upload(self, change: dict) -> None:
        for item in change["new"] or ():
            try:
                saved = save_upload(self.home or Path("uploads"), item["name"], bytes(item["content"]))
            except (OSError, ValueError) as e:
                self.message.value = message_html(f"upload failed: {e}", good=False)
                self.box.layout.display = ""
                continue
            self.target.value = shown_path(saved)
        with contextlib.suppress(Exception):  # ready for the next file (the value is the browser's)
            self.upload.value = ()


SAFE_FILE = re.compile(r"[^A-Za-z0-9._-]+")


def save_upload(folder: Path, name: str, content: bytes) -> Path:
    """Save an uploaded file into ``folder`` (created if need be), atomically, under its name made safe
    (``my data (1).jsonl`` -> ``my_data_1_.jsonl``; never a path, never hidden), and never over another
    file: an existing file of other content gives ``name-2.jsonl``. Returns where it is."""
    base = SAFE_FILE.sub("_", Path(str(name)).name).lstrip(".") or "upload"
    if not base.endswith(DATA_SUFFIXES):
        raise ValueError(f"{show_path(name)}: not a data file ({', '.join(DATA_SUFFIXES)})")
    stem, suffix = base[: -len(Path(base).suffix)], Path(base).suffix
    path, k = folder / base, 1
    while path.exists():
        if path.is_file() and path.read_bytes() == content:
            return path
        k += 1
        path = folder / f"{stem}-{k}{suffix}"
    atomic_write_bytes(path, content)
    return path


def shown_path(path: Path) -> str:
    """``path`` as a form shows it: relative to the working directory when it is under it."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def snapping_slider(target: W.FloatText, span: tuple[float, float]) -> W.SelectionSlider:
    """A slider of 1, 2, 3, 5 x 10^k beside an exact number input: moving it types that value into
    ``target``; typing a value moves it to the nearest step (without changing what was typed)."""
    values = nice_values(*span)
    slider = W.SelectionSlider(
        options=values, description="", continuous_update=False, layout=W.Layout(width="220px")
    )
    syncing = [False]

    def from_slider(change: dict) -> None:
        if not syncing[0]:
            target.value = change["new"]

    def from_text(change: dict) -> None:
        v = change["new"]
        if not (isinstance(v, float | int) and v > 0):
            return
        nearest = min((val for _, val in values), key=lambda val: abs(math.log10(val) - math.log10(v)))
        syncing[0] = True
        try:
            slider.value = nearest
        finally:
            syncing[0] = False

    slider.observe(from_slider, names="value")
    target.observe(from_text, names="value")
    return slider


def layout_inputs(inputs: list[FieldInput], advanced: str = "Advanced") -> list[W.Widget]:
    """The inputs' rows under their section titles, in field order; the ``advanced`` section folded."""
    sections: dict[str, list[W.Widget]] = {}
    for inp in inputs:
        sections.setdefault(inp.info.section, []).append(inp.row)
    out: list[W.Widget] = []
    for title, rows in sections.items():
        if title == advanced:
            continue
        out += [W.HTML(f"<b>{html.escape(title)}</b>"), *rows]
    if advanced in sections:
        out.append(W.Accordion([W.VBox(sections[advanced])], titles=(advanced,), selected_index=None))
    return out


# ---------------------------------------------------------------------------------------------
# Showing problems
# ---------------------------------------------------------------------------------------------


def problem_lines(problems: list[Problem], own: str | None = None) -> list[str]:
    """One line per problem, as a form shows it. Problems of the form's own tenant (``own``) drop the
    ``tenant 'x':`` prefix. The same problem of several data files (``path`` set, same text after the
    file's name) becomes one line naming every file: ``a.jsonl (data), b.jsonl (heldout_data): empty file``."""
    groups: dict[str, list[Problem]] = {}
    rests: dict[int, str] = {}
    for i, p in enumerate(problems):
        head = f"{p.field}: {show_path(p.path)}" if p.path is not None else None
        if head is not None and p.tenant is not None and p.message.startswith(head):
            rests[i] = p.message[len(head) :]
            groups.setdefault(rests[i], []).append(p)
    lines, done = [], set()
    for i, p in enumerate(problems):
        rest = rests.get(i)
        if rest is not None and len(groups[rest]) > 1:
            if rest in done:
                continue
            done.add(rest)
            users: dict[str, list[str]] = {}
            for q in groups[rest]:
                who = q.field if q.tenant == own else f"tenant {q.tenant!r} {q.field}"
                users.setdefault(show_path(q.path), []).append(who)
            lines.append(", ".join(f"{path} ({', '.join(whos)})" for path, whos in users.items()) + rest)
        else:
            lines.append(p.message if own is not None and p.tenant == own else str(p))
    return lines


def problems_html(problems: list[Problem], ok: str = "ok", own: str | None = None) -> str:
    lines = problem_lines(problems, own)
    if not lines:
        return f'<span style="color:#1a7f37">&#10004; {html.escape(ok)}</span>'
    n = len(lines)
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return (
        f'<div style="color:#b42318"><b>{n} problem{"s" if n != 1 else ""}</b>'
        f'<ul style="margin:2px 0 2px 0">{items}</ul></div>'
    )


def message_html(text: str, good: bool) -> str:
    color = "#1a7f37" if good else "#b42318"
    return f'<span style="color:{color}">{html.escape(text)}</span>'
