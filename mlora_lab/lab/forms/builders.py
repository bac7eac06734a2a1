"""Notebook forms that build jobs: :class:`TenantForm` (tenants) and :class:`JobBuilder` (a whole job).

    form = ml.TenantForm(base_model="models/tiny", data_dir="data")
    form                  # shows the form; fill it in and press "Add tenant" once per tenant
    form.tenant()         # the Tenant of the current fields (SpecError listing every problem if bad)
    form.tenants          # the tenants added so far

    builder = ml.JobBuilder(base_model="models/tiny", form=form)
    builder               # job settings, live problems and job.json preview, a Launch button
    builder.spec()        # the JobSpec of the current fields
    builder.run           # the Run, once launched; the status line follows it by itself

Both forms are generated from the fields' :class:`~mlora_lab.spec.fields.FieldInfo`: every ``Tenant`` (or
``JobSpec``) field shown in forms gets an input of its kind, with its label and help line, in its
section, and is read back into the dataclass; a new field needs no change here. Inputs never clamp:
a value out of range stays as typed and is reported.

Validation is the spec's own (:class:`~mlora_lab.validate.Validator`), shown under the fields as they
change. It is cheap enough to run on every change: a :class:`~mlora_lab.validate.ValidationCache`
loads the model config and tokenizer once per path and scans a data file again only when its path,
size or modification time changes.
"""

from __future__ import annotations

import copy
import dataclasses
import html
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from mlora_lab import hub
from mlora_lab.lab.forms.fields import (
    LABEL_STYLE,
    FieldInput,
    layout_inputs,
    make_input,
    message_html,
    problem_lines,
    problems_html,
    wide_layout,
)
from mlora_lab.lora.targets import ALL_LINEAR
from mlora_lab.rundir import RunState
from mlora_lab.sources import describe
from mlora_lab.spec.fields import FieldInfo, Problem, SpecError, field_info, fields_info
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Parallel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import error_line
from mlora_lab.validate import ValidationCache, Validator, linear_target_options

if TYPE_CHECKING:  # the launcher imports pandas: only at launch time
    from mlora_lab.lab.runs.run import Run


# ---------------------------------------------------------------------------------------------
# TenantForm
# ---------------------------------------------------------------------------------------------


def linear_target_names(base_model: str | os.PathLike, revision: str | None = None) -> list[str]:
    """The target names the form offers besides ``all-linear``: the layers ``all-linear`` selects, as
    short PEFT names in model order (``q_proj, k_proj, ...``; never the output layer, whatever it is
    called). The model is built on the meta device (cached). A Hub id is downloaded first, once, at
    ``revision`` (:func:`mlora_lab.hub.fetch`; what validation reads afterwards). See
    :func:`mlora_lab.validate.linear_target_options`."""
    if hub.is_hub_id(base_model):
        path, why = hub.fetch(str(base_model), revision)
        if path is None:
            raise ValueError(why)
        return linear_target_options(str(path))
    return linear_target_options(os.fspath(base_model))


def _data_files(data_dir: str | None) -> list[str]:
    """``*.jsonl`` files under ``data_dir`` (recursively), as paths that start with ``data_dir``.

    Run directories are not training data: a directory holding ``job.json`` or ``status.json`` (a run,
    with its ``metrics.jsonl`` and control files) is skipped whole, and so are hidden directories
    (``.ipynb_checkpoints``, ``.git``)."""
    if not data_dir or not os.path.isdir(data_dir):
        return []
    found = []
    for root, dirs, files in os.walk(data_dir):
        if "job.json" in files or "status.json" in files:
            dirs.clear()
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in files if f.endswith(".jsonl") and not f.startswith(".")]
    return sorted(found)


def _next_name(name: str, taken: set[str]) -> str:
    """``alice`` -> ``alice-2``, ``alice-2`` -> ``alice-3``, skipping names in ``taken``."""
    stem, _, num = name.rpartition("-")
    stem, n = (stem, int(num)) if stem and num.isdigit() else (name, 1)
    while True:
        n += 1
        candidate = f"{stem}-{n}"
        if candidate not in taken:
            return candidate


class TenantForm:
    """An ipywidgets form that produces :class:`~mlora_lab.spec.tenant.Tenant` objects.

    Each input is an attribute named like the Tenant field it sets (``form.rank``, ``form.lr``,
    ``form.target_modules``, ...; ``form.no_clipping`` turns ``max_grad_norm`` into ``None``), made
    from the field's :class:`~mlora_lab.spec.fields.FieldInfo`. The tenant's problems are shown under the form
    as fields change, and "Add tenant" is enabled only while there are none; it appends the tenant to
    :attr:`tenants` and moves the name on (``alice`` -> ``alice-2``). Pressing it again before any field
    changes adds nothing. Display ``form`` (or ``form.widget``) in a cell.
    """

    def __init__(
        self,
        base_model: str | os.PathLike,
        data_dir: str | os.PathLike | None = None,
        defaults: Tenant | None = None,
        max_rank: int = 64,
        revision: str | None = None,
    ) -> None:
        self.base_model = os.fspath(base_model)
        self.revision = revision
        """The Hub revision of a ``base_model`` given by its Hub id (``JobSpec.revision``)."""
        self.data_dir = os.fspath(data_dir) if data_dir is not None else None
        self.tenants: list[Tenant] = []
        """Tenants added with "Add tenant" (or :meth:`add`), in order."""
        self._max_rank = max_rank
        self._validator = Validator(ValidationCache())
        self._listeners: list[Callable[[], None]] = []
        self._hold = 0  # > 0 while fields are set in bulk: validate once at the end
        self._added: tuple[Tenant, str] | None = None  # (the fields right after an add, that tenant's name)
        try:
            self.linear_names = linear_target_names(self.base_model, revision)
            """The model's linear-layer names offered as targets (those ``all-linear`` selects; a tenant
            that names the output layer shows it as an extra option)."""
            self._model_error = None
        except Exception as e:
            self.linear_names = []
            self._model_error = Problem(
                None, "base_model", f"cannot list the model's linear layers ({error_line(e)})"
            )
        default_targets = (
            ["q_proj", "v_proj"] if {"q_proj", "v_proj"} <= set(self.linear_names) else self.linear_names[:2]
        )
        if defaults is not None:
            base = copy.deepcopy(defaults)
        else:
            base = Tenant(name="tenant-1", data="", target_modules=default_targets)
        self._base = base  # supplies the Tenant fields the form does not show (betas, eps, ...)

        files = _data_files(self.data_dir)
        self._inputs: dict[str, FieldInput] = {}
        for name, info in fields_info(Tenant):
            if info.form:
                default = Tenant.__dataclass_fields__[name].default
                self._inputs[name] = inp = make_input(
                    name, info, default, files, self.linear_names, folder=self.data_dir
                )
                setattr(self, name, inp.widget)
                for attr, w in inp.extras.items():
                    setattr(self, attr, w)
        self.fields: dict[str, W.Widget] = {}
        """Every input widget by the name of the Tenant field it sets, and each checkbox that sets a
        field to ``None`` (``no_clipping``) by its own name."""
        for name, inp in self._inputs.items():
            self.fields[name] = inp.widget
            if inp.null_toggle is not None:
                self.fields[inp.info.null_means.replace(" ", "_")] = inp.null_toggle

        self.problems_box = W.HTML()
        self.add_button = W.Button(description="Add tenant", button_style="primary", icon="plus")
        self.message = W.HTML()
        self.table = W.HTML()
        self.selected = W.Dropdown(options=[], description="tenant", style={"description_width": "60px"})
        self.remove_button = W.Button(description="Remove", icon="trash")
        self.load_button = W.Button(description="Load into form", icon="pencil")

        self.load(base)
        for inp in self._inputs.values():
            inp.widget.observe(self._on_field, names="value")
            if inp.null_toggle is not None:
                inp.null_toggle.observe(self._on_null_toggle(inp), names="value")
        self.add_button.on_click(lambda _: self._on_add())
        self.remove_button.on_click(lambda _: self._on_remove())
        self.load_button.on_click(lambda _: self._on_load())

        self.widget = W.VBox(
            [
                W.HTML("<h4 style='margin:4px 0'>Tenant</h4>"),
                *layout_inputs(list(self._inputs.values())),
                self.problems_box,
                W.HBox([self.add_button, self.message]),
                self.table,
                W.HBox([self.selected, self.remove_button, self.load_button]),
            ],
            layout=W.Layout(border="1px solid #ddd", padding="6px"),
        )
        """The whole form as one ipywidgets VBox."""
        self._refresh()
        self._update_table()

    # -- display ---------------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # -- public API ------------------------------------------------------------------------------

    @property
    def max_rank(self) -> int:
        """The job's ``max_rank``: the rank slider's upper end and the bound the rank is checked against."""
        return self._max_rank

    @max_rank.setter
    def max_rank(self, value: int) -> None:
        self._max_rank = value
        self._sync_bounds()
        self._refresh()

    def tenant(self) -> Tenant:
        """The Tenant of the current fields; raises :class:`SpecError` listing its problems."""
        t = self._read()
        problems = self._tenant_problems(t)
        if problems:
            raise SpecError(problems)
        return t

    def problems(self) -> list[Problem]:
        """The current fields' problems (as shown under the form), including a name already added."""
        t = self._read()
        problems = self._tenant_problems(t)
        if t.name in {x.name for x in self.tenants}:
            problems.append(self._duplicate(t.name))
        return problems

    def add(self) -> Tenant:
        """Append the current tenant to :attr:`tenants` and return it; raises :class:`SpecError` if it
        has problems, its name is taken, or no field changed since the last add (that would be a clone
        of the tenant just added). The name field then moves on (``alice`` -> ``alice-2``)."""
        repeat = self._repeat()
        if repeat is not None:
            raise SpecError(repeat)
        t = self.tenant()
        taken = {x.name for x in self.tenants}
        if t.name in taken:
            raise SpecError(self._duplicate(t.name))
        self.tenants.append(t)
        self._hold += 1
        try:
            self.name.value = _next_name(t.name, taken | {t.name})
        finally:
            self._hold -= 1
        self._added = (self._read(), t.name)
        self._update_table()
        self._refresh()
        self.message.value = message_html(
            f"added {t.name!r} ({len(self.tenants)} tenant{'s' if len(self.tenants) != 1 else ''})", True
        )
        return t

    def remove(self, name: str) -> Tenant:
        """Remove the tenant called ``name`` from :attr:`tenants` and return it (``KeyError`` if absent)."""
        for i, t in enumerate(self.tenants):
            if t.name == name:
                del self.tenants[i]
                if self._added is not None and self._added[1] == name:
                    self._added = None  # its settings may be added again
                self._update_table()
                self._refresh()
                return t
        raise KeyError(f"no tenant {name!r}; tenants: {[t.name for t in self.tenants]}")

    def load(self, tenant: Tenant) -> None:
        """Set every field from ``tenant`` (fields the form does not show are kept from it as well)."""
        t = copy.deepcopy(tenant)
        self._base = t
        self._added = None
        self._hold += 1
        try:
            for name, inp in self._inputs.items():
                inp.show(getattr(t, name))
            self._sync_bounds()
            for inp in self._inputs.values():
                for key, w in inp.extras.items():
                    if key.endswith("_note"):
                        w.value = ""
        finally:
            self._hold -= 1
        self._refresh()

    def on_tenants_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever :attr:`tenants` changes through the form."""
        self._listeners.append(callback)

    # -- internals -------------------------------------------------------------------------------

    def _read(self) -> Tenant:
        d = self._base.to_dict()
        d.update({name: inp.read() for name, inp in self._inputs.items()})
        return Tenant.from_dict(d)

    def _tenant_problems(self, t: Tenant) -> list[Problem]:
        spec = JobSpec(
            base_model=self.base_model, tenants=[t], max_rank=self._max_rank, revision=self.revision
        )
        # The probe job has this one tenant and default settings, so its job-wide problems are the
        # model's, the tokenizer's, or this tenant's (its size): none is about fields the form lacks.
        problems = [
            p
            for p in self._validator.problems(spec)
            if p.tenant is not None or p.field in (None, "base_model", "tokenizer")
        ]
        # A required field left empty gets the form's words ("choose a training data file"), not the
        # validator's (which are about job.json values).
        empty = {name: inp.info.empty for name, inp in self._inputs.items() if inp.is_empty()}
        owner = t.name if isinstance(t.name, str) and t.name else None
        shown, said = [], set()
        for p in problems:
            if p.field in empty:
                if p.field not in said:
                    said.add(p.field)
                    shown.append(Problem(owner, p.field, empty[p.field]))
            else:
                shown.append(p)
        if self._model_error is not None and not shown:
            shown.append(self._model_error)
        return shown

    @staticmethod
    def _duplicate(name: str) -> Problem:
        return Problem(name, "name", "already added; pick another name (or remove that one first)")

    def _repeat(self) -> Problem | None:
        """Why adding now would add a clone: no field changed since the last add."""
        if self._added is None or self._read() != self._added[0]:
            return None
        return Problem(
            None,
            None,
            f"{self._added[1]!r} is already added with these settings; change a field to add another tenant",
        )

    def _sync_bounds(self) -> None:
        # A slider bounded by a job field (rank by max_rank) ends there, but never below the current
        # value: a rank above max_rank stays visible (and is reported) instead of being clamped.
        for inp in self._inputs.values():
            if inp.info.at_most == "max_rank" and isinstance(inp.widget, W.IntSlider):
                inp.widget.max = max(self._max_rank, inp.widget.value)

    def _refresh(self) -> None:
        if self._hold:
            return
        t = self._read()
        problems = self.problems()
        self.problems_box.value = problems_html(problems, ok="ok", own=t.name)
        repeat = self._repeat()
        self.add_button.disabled = bool(problems) or repeat is not None
        if problems:
            lines = problem_lines(problems, own=t.name)
            more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
            self.add_button.tooltip = f"fix first: {lines[0]}{more}"
        elif repeat is not None:
            self.add_button.tooltip = repeat.message
        else:
            self.add_button.tooltip = f"add {t.name!r} to the tenants"

    def _on_field(self, change: dict) -> None:
        owner = change["owner"]
        if owner is getattr(self, "target_modules", None):
            new, old = tuple(change["new"]), tuple(change["old"])
            note = self.target_modules_note
            if ALL_LINEAR in new and len(new) > 1 and not self._hold:
                # PEFT takes "all-linear" only on its own (in a list it is a name matching nothing), so
                # picking it clears the others and picking another name clears it; the note says so.
                # (A loaded tenant that mixes them is shown as it is, with the validator's problem.)
                picked_all = ALL_LINEAR not in old
                self.target_modules.value = (
                    (ALL_LINEAR,) if picked_all else tuple(x for x in new if x != ALL_LINEAR)
                )
                note.value = (
                    f"<i>{ALL_LINEAR} covers every linear layer but the output layer, so the other names were "
                    "cleared</i>"
                    if picked_all
                    else f"<i>{ALL_LINEAR} was cleared: it cannot be combined with named layers</i>"
                )
                return  # the nested change re-validated
            note.value = ""
        if self._hold:
            return
        if owner is getattr(self, "rank", None):
            self._sync_bounds()
        self.message.value = ""  # it was about the last press; the problems box says what is wrong now
        self._refresh()

    def _on_null_toggle(self, inp: FieldInput) -> Callable[[dict], None]:
        def toggled(change: dict) -> None:
            inp.widget.disabled = bool(change["new"])
            self._on_field(change)

        return toggled

    def _on_add(self) -> None:
        try:
            self.add()
        except SpecError as e:
            own = self.name.value.strip()
            self.message.value = message_html(
                "not added: " + "; ".join(problem_lines(e.problems, own)), False
            )

    def _on_remove(self) -> None:
        if self.selected.value:
            name = self.selected.value
            self.remove(name)
            self.message.value = message_html(f"removed {name!r}", True)

    def _on_load(self) -> None:
        for t in self.tenants:
            if self.selected.value and t.name == self.selected.value:
                self.load(t)
                self.message.value = message_html(f"loaded {t.name!r} into the form", True)

    def _update_table(self) -> None:
        if not self.tenants:
            self.table.value = "<i>no tenants added yet</i>"
        else:
            head = ["name", "data", "rank", "alpha", "targets", "lr", "schedule", "steps", "batch"]
            rows = [
                [
                    t.name,
                    describe(t.data),  # (a path, or "a DataFrame of 120 rows": never the frame's repr)
                    t.rank,
                    f"{t.alpha:g}" + (" (rs)" if t.use_rslora else ""),
                    ", ".join(t.target_modules),
                    f"{t.lr:g}",
                    t.schedule,
                    t.max_steps,
                    f"{t.batch_size}x{t.grad_accum}" if t.grad_accum != 1 else t.batch_size,
                ]
                for t in self.tenants
            ]
            cell = "padding:1px 8px;border-bottom:1px solid #eee;text-align:left"
            th = "".join(f"<th style='{cell}'>{h}</th>" for h in head)
            body = "".join(
                "<tr>" + "".join(f"<td style='{cell}'>{html.escape(str(v))}</td>" for v in r) + "</tr>"
                for r in rows
            )
            self.table.value = f"<table style='border-collapse:collapse'><tr>{th}</tr>{body}</table>"
        names = [t.name for t in self.tenants]
        self.selected.options = names
        for w in (self.selected, self.remove_button, self.load_button):
            w.disabled = not names
        for callback in list(self._listeners):
            callback()


# ---------------------------------------------------------------------------------------------
# JobBuilder
# ---------------------------------------------------------------------------------------------


def _divisor_choice(name: str, n: int, value: int) -> W.Dropdown:
    """A dropdown of the divisors of ``n``, at ``value`` if it is one (else 1), labelled from ``Parallel.<name>``."""
    info = field_info(Parallel, name)
    options = _divisors(n)
    return W.Dropdown(
        options=options,
        value=value if value in options else 1,
        description=info.label,
        style=LABEL_STYLE,
        tooltip=info.help,
        layout=W.Layout(width="220px"),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _default_max_nproc() -> int:
    """GPUs on this machine if any, else CPU cores."""
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        gpus = 0
    return gpus or os.cpu_count() or 1


def _help_row(widget: W.Widget, info: FieldInfo) -> W.HBox:
    note = W.HTML(f"<span style='color:#57606a;font-size:90%'>{html.escape(info.help)}</span>")
    return W.HBox([widget, note], layout=W.Layout(align_items="center"))


class JobBuilder:
    """An ipywidgets panel that builds a :class:`~mlora_lab.spec.job.JobSpec` and launches it.

    It embeds a :class:`TenantForm` (``builder.form``) for the tenants and adds the job settings
    (``builder.seq_len``, ``builder.nproc``, ``builder.fsdp``, ...; made from the ``JobSpec`` and
    ``Parallel`` fields' :class:`~mlora_lab.spec.fields.FieldInfo`), the whole spec's problems and a live
    ``job.json`` preview. "Launch" is enabled only while the spec has no problems; it calls
    :func:`mlora_lab.lab.launch.launch` and keeps the :class:`~mlora_lab.lab.runs.run.Run` in :attr:`run`, whose
    state the status line then follows by itself (a background thread, polling every
    :attr:`refresh_s` seconds until the run ends or :meth:`stop_watching`). ``defaults`` pre-fills the
    job settings and adds its tenants to the form.
    """

    def __init__(
        self,
        base_model: str | os.PathLike,
        form: TenantForm | None = None,
        workdir: str | os.PathLike = "runs",
        defaults: JobSpec | None = None,
        max_nproc: int | None = None,
        revision: str | None = None,
    ) -> None:
        self.base_model = os.fspath(base_model)
        d = (
            copy.deepcopy(defaults)
            if defaults is not None
            else JobSpec(base_model=self.base_model, tenants=[], revision=revision)
        )
        if revision is not None:
            d.revision = revision
        if form is None:
            form = TenantForm(self.base_model, max_rank=d.max_rank, revision=d.revision)
        elif os.path.abspath(form.base_model) != os.path.abspath(self.base_model):
            raise ValueError(f"form is for base_model {form.base_model!r}, not {self.base_model!r}")
        self.form = form
        """The embedded tenant form; its :attr:`TenantForm.tenants` are the job's tenants."""
        self.run: Run | None = None
        """The :class:`~mlora_lab.lab.runs.run.Run` of the last launch (``None`` before)."""
        self.refresh_s = 1.0
        """Seconds between two looks at :attr:`run`'s state by the status line's thread."""
        self._base = d  # keeps fields the builder does not show (tokenizer, slot_modules)
        self._hold = 0
        self._problems: list[Problem] = []
        self._watcher: threading.Thread | None = None
        self._stop_watch = threading.Event()
        max_nproc = max(1, max_nproc or _default_max_nproc(), d.parallel.nproc)

        self._inputs: dict[str, FieldInput] = {}
        for name, info in fields_info(JobSpec):
            if info.form:
                default = JobSpec.__dataclass_fields__[name].default
                self._inputs[name] = inp = make_input(name, info, default, [], [])
                inp.show(getattr(d, name))
                setattr(self, name, inp.widget)
        nproc_info = field_info(Parallel, "nproc")
        self.nproc = W.IntSlider(
            value=d.parallel.nproc,
            min=1,
            max=max_nproc,
            description=nproc_info.label,
            style=LABEL_STYLE,
            tooltip=nproc_info.help,
            layout=wide_layout(),
        )
        self.tp = _divisor_choice("tp", d.parallel.nproc, d.parallel.tp)
        dp = d.parallel.nproc // self.tp.value  # the data-parallel ranks
        self.fsdp = _divisor_choice("fsdp", dp, d.parallel.fsdp)
        self.ep = _divisor_choice("ep", dp, d.parallel.ep)
        self.workdir = W.Text(
            value=os.fspath(workdir), description="workdir", style=LABEL_STYLE, layout=wide_layout()
        )
        self.fields: dict[str, W.Widget] = {name: inp.widget for name, inp in self._inputs.items()}
        """Every job-setting widget by name (``nproc``/``tp``/``fsdp``/``ep`` set ``parallel``)."""
        self.fields.update(nproc=self.nproc, tp=self.tp, fsdp=self.fsdp, ep=self.ep)

        self.problems_box = W.HTML()
        self.launch_button = W.Button(description="Launch", button_style="success", icon="rocket")
        self.status = W.HTML()
        self.refresh_button = W.Button(description="status", icon="refresh", layout=W.Layout(width="90px"))
        self.preview = W.HTML()

        for name, w in self.fields.items():
            if name not in ("nproc", "tp"):
                w.observe(lambda _: self._refresh(), names="value")
        self.nproc.observe(self._on_layout, names="value")
        self.tp.observe(self._on_layout, names="value")
        self.max_rank.observe(self._on_max_rank, names="value")
        self.launch_button.on_click(lambda _: self._on_launch())
        self.refresh_button.on_click(lambda _: self._refresh())
        if defaults is not None:
            known = {t.name for t in form.tenants}
            form.tenants.extend(copy.deepcopy(t) for t in d.tenants if t.name not in known)
        form.on_tenants_change(self._refresh)
        if form.max_rank != d.max_rank:
            form.max_rank = d.max_rank
        form._update_table()  # shows tenants that came with ``defaults``; notifies -> _refresh()

        parallel = [
            W.HTML("<b>Parallel</b>"),
            _help_row(self.nproc, nproc_info),
            *(_help_row(getattr(self, n), field_info(Parallel, n)) for n in ("tp", "fsdp", "ep")),
        ]
        job = W.VBox(
            [
                W.HTML("<h4 style='margin:4px 0'>Job</h4>"),
                *layout_inputs(list(self._inputs.values())),
                *parallel,
                self.workdir,
                self.problems_box,
                W.HBox([self.launch_button, self.refresh_button]),
                self.status,
                W.Accordion([self.preview], titles=("job.json",), selected_index=0),
            ],
            layout=W.Layout(border="1px solid #ddd", padding="6px"),
        )
        self.widget = W.VBox([form.widget, job])
        """The whole panel (tenant form, then job settings) as one ipywidgets VBox."""
        self._refresh()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # -- public API ------------------------------------------------------------------------------

    def spec(self) -> JobSpec:
        """The JobSpec of the current fields and ``form.tenants`` (not validated: see :meth:`problems`)."""
        return dataclasses.replace(
            copy.deepcopy(self._base),
            base_model=self.base_model,
            tenants=copy.deepcopy(self.form.tenants),
            parallel=Parallel(
                nproc=self.nproc.value, nnodes=1, fsdp=self.fsdp.value, tp=self.tp.value, ep=self.ep.value
            ),
            output_dir=None,  # every launch gets a new directory under workdir
            **{name: inp.read() for name, inp in self._inputs.items()},
        )

    def problems(self) -> list[Problem]:
        """Every problem of :meth:`spec` (as :func:`mlora_lab.validate.problems` reports them)."""
        return self.form._validator.problems(self.spec())

    def launch(self) -> Run:
        """Launch :meth:`spec` under torchrun in the background (``launch(spec, workdir)``); returns the
        Run, keeps it in :attr:`run` and starts following its state in the status line. Raises
        :class:`SpecError` if the spec has problems."""
        from mlora_lab.lab.launch import launch

        self.run = launch(self.spec(), self.workdir.value)
        self._refresh()
        self._watch()
        return self.run

    @property
    def watching(self) -> bool:
        """Whether the status line's thread is following :attr:`run`."""
        return self._watcher is not None and self._watcher.is_alive()

    def stop_watching(self, timeout: float = 5.0) -> None:
        """Stop the status line's thread (the run itself is not touched); the status button still works."""
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(timeout)

    # -- internals -------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Follow :attr:`run` in a background thread (one at a time: a new launch replaces the old)."""
        self.stop_watching()
        self._stop_watch = stop = threading.Event()
        run = self.run
        self._watcher = threading.Thread(
            target=self._watch_loop, args=(run, stop), name="mlora-jobbuilder-status", daemon=True
        )
        self._watcher.start()

    def _watch_loop(self, run: Run, stop: threading.Event) -> None:
        # Only the status line and the Launch button change here: validation (and its cache) stays on
        # the notebook's thread.
        while not stop.wait(self.refresh_s):
            try:
                state = run.status
            except Exception:  # a run directory that became unreadable: keep the last state shown
                continue
            self._show_state(state)
            if state.final:
                return

    def _refresh(self) -> None:
        if self._hold:
            return
        spec = self.spec()
        self._problems = self.problems()
        shown = list(self._problems)
        if not spec.tenants and not spec.stay_up and spec.service is None:
            shown.append(Problem(None, "tenants", 'fill in the tenant form above and press "Add tenant"'))
        self.problems_box.value = problems_html(shown, ok="ready to launch")
        self.preview.value = (
            "<pre style='max-height:320px;overflow:auto;margin:0'>" + html.escape(spec.to_json()) + "</pre>"
        )
        self._show_state(self.run.status if self.run is not None else None)

    def _show_state(self, state: RunState | None) -> None:
        self.launch_button.disabled = bool(self._problems) or (state is not None and not state.final)
        self.status.value = self._status_html(state)

    def _status_html(self, state: RunState | None) -> str:
        if self.run is None:
            return ""
        color = {
            RunState.FINISHED: "#1a7f37",
            RunState.FAILED: "#b42318",
            RunState.LOST: "#b42318",
            RunState.STOPPED: "#9a6700",
        }.get(state, "#0550ae")
        text = f"run <code>{html.escape(str(self.run.path))}</code>: <b style='color:{color}'>{state}</b>"
        error = self.run.error if state in (RunState.FAILED, RunState.LOST) else None
        if error:
            text += f"<br><span style='color:#b42318'>{html.escape(error)}</span>"
        return text + "<br><i>builder.run.dashboard() follows it live</i>"

    def _on_layout(self, change: dict) -> None:
        """nproc or tp changed: tp divides nproc, fsdp and ep divide the data-parallel ranks."""
        self._hold += 1
        try:
            for w, n in ((self.tp, self.nproc.value), (self.fsdp, None), (self.ep, None)):
                options = _divisors(n if n is not None else self.nproc.value // self.tp.value)
                old = w.value
                w.options = options  # resets the value to the first option
                w.value = old if old in options else 1
        finally:
            self._hold -= 1
        self._refresh()

    def _on_max_rank(self, change: dict) -> None:
        value = change["new"]
        if (
            isinstance(value, int) and value >= 1
        ):  # a bad max_rank is reported; the form keeps the last good one
            self.form.max_rank = value

    def _on_launch(self) -> None:
        try:
            self.launch()
        except Exception as e:  # shown in the panel: a button callback has nowhere else to report
            problems = (
                e.problems
                if isinstance(e, SpecError)
                else [Problem(None, None, f"launch failed: {type(e).__name__}: {e}")]
            )
            self.status.value = problems_html(problems)
