"""Notebook forms that build jobs: :class:`TenantForm` (tenants) and :class:`JobBuilder` (a whole job).

    form = ml.TenantForm(base_model="models/tiny", data_dir="data")
    form                  # shows the form; fill it in and press "Add tenant" once per tenant
    form.tenant()         # the Tenant of the current fields (SpecError listing every problem if bad)
    form.tenants          # the tenants added so far

    builder = ml.JobBuilder(base_model="models/tiny", form=form)
    builder               # job settings, live problems and job.json preview, a Launch button
    builder.spec()        # the JobSpec of the current fields
    builder.run           # the Run, once launched

Validation is the spec's own (:meth:`JobSpec.problems`), shown under the fields as they change. It is
cheap enough to run on every change: the model config and tokenizer are loaded once per path, and a
data file is scanned again only when its path, size or modification time changes.
"""

from __future__ import annotations

import copy
import html
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from mlora_lab.rundir import RunState
from mlora_lab.spec import (
    ALL_LINEAR,
    DTYPES,
    SCHEDULES,
    JobSpec,
    Parallel,
    SpecError,
    Tenant,
    _short,
    _Validator,
    linear_target_options,
)

if TYPE_CHECKING:  # launch imports pandas: only at launch time
    from mlora_lab.launch import Run

_LABEL = {"description_width": "130px"}


def _wide() -> W.Layout:
    return W.Layout(width="420px")


def _narrow() -> W.Layout:
    return W.Layout(width="250px")


_BIG = 10**9


# ---------------------------------------------------------------------------------------------
# Validation that is cheap to repeat
# ---------------------------------------------------------------------------------------------


class _Checker:
    """``JobSpec.problems()`` with caches, so the forms can re-validate on every field change.

    Caches the model/tokenizer load per (base_model, tokenizer) path (successes only, so a path that
    is fixed later is seen at once) and each data file's problems per (path, mtime, size).
    """

    def __init__(self) -> None:
        self.env: dict[Any, tuple[Any, Any, list[str]]] = {}
        self.data: dict[Any, list[tuple[bool, str]]] = {}

    def problems(self, spec: JobSpec) -> list[str]:
        """Every problem of ``spec``, as :meth:`JobSpec.problems` reports them; never raises."""
        try:
            return _CachedValidator(spec, self).run()
        except Exception as e:  # same promise as JobSpec.problems(): report, never raise
            return [f"internal error while validating the spec ({type(e).__name__}: {_short(e)})"]


def _file_key(path: Any) -> Any:
    """What identifies one version of a data file: its absolute path, mtime and size."""
    if not isinstance(path, str) or not path:
        return path
    try:
        st = os.stat(path)
    except OSError:
        return (os.path.abspath(path), None, None)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


class _CachedValidator(_Validator):
    """The spec's validator with two expensive steps served from a :class:`_Checker`'s caches."""

    def __init__(self, spec: JobSpec, cache: _Checker) -> None:
        super().__init__(spec)
        self.cache = cache

    def _load_model_and_tokenizer(self) -> None:
        s = self.spec
        paths = (s.base_model, s.tokenizer)
        key = tuple(os.path.abspath(p) if isinstance(p, str) and p else p for p in paths)
        hit = self.cache.env.get(key) if all(isinstance(p, str | None) for p in key) else None
        if hit is not None:
            self.model, self.tok, problems = hit
            self.out += problems
            return
        start = len(self.out)
        super()._load_model_and_tokenizer()
        if len(self.out) == start and all(isinstance(p, str | None) for p in key):
            self.cache.env[key] = (self.model, self.tok, [])

    def _check_data(self, t: Tenant) -> None:
        prefix = f"tenant {t.name!r}: "
        has_template = bool(getattr(self.tok, "chat_template", None))
        try:
            # seq_len and the tokenizer decide whether rows keep target tokens after truncation
            key = (_file_key(t.data), _file_key(t.eval_data), id(self.tok), has_template, self.spec.seq_len)
            hit = self.cache.data.get(key)
        except TypeError:  # unhashable field values: no caching, just check
            super()._check_data(t)
            return
        if hit is None:
            start = len(self.out)
            super()._check_data(t)
            # Stored without the tenant's name, so renaming a tenant does not rescan its data.
            hit = [(p.startswith(prefix), p.removeprefix(prefix)) for p in self.out[start:]]
            self.cache.data[key] = hit
            return
        self.out += [prefix + p if prefixed else p for prefixed, p in hit]


def _problems_html(problems: list[str], ok: str = "ok") -> str:
    if not problems:
        return f'<span style="color:#1a7f37">&#10004; {html.escape(ok)}</span>'
    n = len(problems)
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    return (
        f'<div style="color:#b42318"><b>{n} problem{"s" if n != 1 else ""}</b>'
        f'<ul style="margin:2px 0 2px 0">{items}</ul></div>'
    )


def _message_html(text: str, good: bool) -> str:
    color = "#1a7f37" if good else "#b42318"
    return f'<span style="color:{color}">{html.escape(text)}</span>'


# ---------------------------------------------------------------------------------------------
# TenantForm
# ---------------------------------------------------------------------------------------------


def linear_target_names(base_model: str | os.PathLike) -> list[str]:
    """The target names the form offers besides ``all-linear``: the layers ``all-linear`` selects, as
    short PEFT names in model order (``q_proj, k_proj, ...``; never the output layer, whatever it is
    called). The model is built on the meta device (cached). See :func:`mlora_lab.spec.linear_target_options`."""
    return linear_target_options(os.fspath(base_model))


def _data_files(data_dir: str | None) -> list[str]:
    """``*.jsonl`` files under ``data_dir`` (recursively), as paths that start with ``data_dir``."""
    if not data_dir or not os.path.isdir(data_dir):
        return []
    root = Path(data_dir)
    return sorted(os.path.join(data_dir, str(p.relative_to(root))) for p in root.rglob("*.jsonl"))


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
    """An ipywidgets form that produces :class:`~mlora_lab.spec.Tenant` objects.

    Each field is an attribute named like the Tenant field it sets (``form.rank``, ``form.lr``,
    ``form.target_modules``, ...; ``form.no_clipping`` turns ``max_grad_norm`` into ``None``).
    The tenant's problems are shown under the form as fields change; "Add tenant" appends a valid
    tenant with a new name to :attr:`tenants`. Display ``form`` (or ``form.widget``) in a cell.
    """

    def __init__(
        self,
        base_model: str | os.PathLike,
        data_dir: str | os.PathLike | None = None,
        defaults: Tenant | None = None,
        max_rank: int = 64,
    ) -> None:
        self.base_model = os.fspath(base_model)
        self.data_dir = os.fspath(data_dir) if data_dir is not None else None
        self.tenants: list[Tenant] = []
        """Tenants added with "Add tenant" (or :meth:`add`), in order."""
        self._max_rank = max_rank
        self._checker = _Checker()
        self._listeners: list[Callable[[], None]] = []
        self._hold = 0  # > 0 while fields are set in bulk: validate once at the end
        try:
            self.linear_names = linear_target_names(self.base_model)
            """The model's linear-layer names offered as targets (those ``all-linear`` selects; a tenant
            that names the output layer shows it as an extra option)."""
            model_error = None
        except Exception as e:
            self.linear_names, model_error = [], f"cannot list the model's linear layers ({_short(e)})"
        files = _data_files(self.data_dir)
        default_targets = (
            ["q_proj", "v_proj"] if {"q_proj", "v_proj"} <= set(self.linear_names) else self.linear_names[:2]
        )
        if defaults is not None:
            base = copy.deepcopy(defaults)
        else:
            base = Tenant(name="tenant-1", data="", target_modules=default_targets)
        self._base = base  # supplies the Tenant fields the form does not show (betas, eps, ...)

        def path_box(desc: str, placeholder: str) -> W.Combobox:
            # continuous_update=False: a path is checked when typed out, not on every keystroke.
            return W.Combobox(
                options=files, ensure_option=False, placeholder=placeholder, description=desc,
                continuous_update=False, style=_LABEL, layout=_wide(),
            )  # fmt: skip

        self.name = W.Text(description="name", style=_LABEL, layout=_narrow())
        self.data = path_box("data (.jsonl)", "path/to/train.jsonl")
        self.eval_data = path_box("eval data", "optional: path/to/eval.jsonl")
        self.init_adapter = W.Text(
            description="init adapter", placeholder="optional: PEFT adapter directory",
            continuous_update=False, style=_LABEL, layout=_wide(),
        )  # fmt: skip
        self.rank = W.IntSlider(min=1, max=max_rank, description="rank", style=_LABEL, layout=_wide())
        self.alpha = W.FloatText(description="alpha", style=_LABEL, layout=_narrow())
        self.use_rslora = W.Checkbox(description="rsLoRA (alpha/sqrt(r))", indent=False)
        self.dropout = W.FloatSlider(
            min=0.0, max=0.5, step=0.01, description="dropout", style=_LABEL, layout=_wide()
        )
        self.target_modules = W.SelectMultiple(
            options=[ALL_LINEAR, *self.linear_names],
            rows=min(len(self.linear_names) + 1, 9),
            description="target modules",
            style=_LABEL,
            layout=_wide(),
        )
        self.lr = W.FloatLogSlider(
            value=2e-4, base=10, min=-6, max=-1, step=0.05, readout_format=".1e",
            description="lr", style=_LABEL, layout=_wide(),
        )  # fmt: skip
        self.schedule = W.Dropdown(
            options=list(SCHEDULES), description="schedule", style=_LABEL, layout=_narrow()
        )
        self.warmup_steps = W.BoundedIntText(
            min=0, max=_BIG, description="warmup steps", style=_LABEL, layout=_narrow()
        )
        self.max_grad_norm = W.FloatText(description="max grad norm", style=_LABEL, layout=_narrow())
        self.no_clipping = W.Checkbox(description="no clipping", indent=False)
        self.weight_decay = W.FloatText(description="weight decay", style=_LABEL, layout=_narrow())
        self.max_steps = W.BoundedIntText(
            min=1, max=_BIG, description="max steps", style=_LABEL, layout=_narrow()
        )
        self.batch_size = W.BoundedIntText(
            min=1, max=_BIG, description="batch size", style=_LABEL, layout=_narrow()
        )
        self.grad_accum = W.BoundedIntText(
            min=1, max=_BIG, description="grad accum", style=_LABEL, layout=_narrow()
        )
        self.shuffle = W.Checkbox(description="shuffle each epoch", indent=False)
        self.seed = W.IntText(description="seed", style=_LABEL, layout=_narrow())
        self.fields: dict[str, W.Widget] = {
            k: getattr(self, k)
            for k in (
                "name", "data", "eval_data", "init_adapter", "rank", "alpha", "use_rslora", "dropout",
                "target_modules", "lr", "schedule", "warmup_steps", "max_grad_norm", "no_clipping",
                "weight_decay", "max_steps", "batch_size", "grad_accum", "shuffle", "seed",
            )
        }  # fmt: skip
        """Every input widget, by the name of the Tenant field it sets."""

        self.problems_box = W.HTML()
        self.add_button = W.Button(description="Add tenant", button_style="primary", icon="plus")
        self.message = W.HTML()
        self.table = W.HTML()
        self.selected = W.Dropdown(options=[], description="tenant", style={"description_width": "60px"})
        self.remove_button = W.Button(description="Remove", icon="trash")
        self.load_button = W.Button(description="Load into form", icon="pencil")
        self._model_error = model_error

        self.load(base)
        for w in self.fields.values():
            w.observe(self._on_field, names="value")
        self.no_clipping.observe(self._on_no_clipping, names="value")
        self.add_button.on_click(lambda _: self._on_add())
        self.remove_button.on_click(lambda _: self._on_remove())
        self.load_button.on_click(lambda _: self._on_load())

        def row(*ws: W.Widget) -> W.HBox:
            return W.HBox(list(ws))

        def section(title: str) -> W.HTML:
            return W.HTML(f"<b>{html.escape(title)}</b>")

        self.widget = W.VBox(
            [
                W.HTML("<h4 style='margin:4px 0'>Tenant</h4>"),
                section("Data"),
                self.name,
                self.data,
                self.eval_data,
                section("LoRA"),
                self.rank,
                row(self.alpha, self.use_rslora),
                self.dropout,
                self.target_modules,
                section("Optimizer"),
                self.lr,
                row(self.schedule, self.warmup_steps),
                row(self.max_grad_norm, self.no_clipping),
                row(self.max_steps, self.batch_size),
                row(self.grad_accum, self.seed),
                W.Accordion(
                    [W.VBox([self.init_adapter, self.weight_decay, self.shuffle])],
                    titles=("Advanced",),
                    selected_index=None,
                ),
                self.problems_box,
                row(self.add_button, self.message),
                self.table,
                row(self.selected, self.remove_button, self.load_button),
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
        self._sync_rank_bounds()
        self._refresh()

    def tenant(self) -> Tenant:
        """The Tenant of the current fields; raises :class:`SpecError` listing its problems."""
        t = self._read()
        problems = self._tenant_problems(t)
        if problems:
            raise SpecError(problems)
        return t

    def problems(self) -> list[str]:
        """The current fields' problems (as shown under the form), including a name already added."""
        t = self._read()
        problems = self._tenant_problems(t)
        if t.name in {x.name for x in self.tenants}:
            problems.append(self._duplicate(t.name))
        return problems

    def add(self) -> Tenant:
        """Append the current tenant to :attr:`tenants` and return it; raises :class:`SpecError` if it
        has problems or its name is already taken. The name field then moves on (``alice`` -> ``alice-2``)."""
        t = self.tenant()
        taken = {x.name for x in self.tenants}
        if t.name in taken:
            raise SpecError(self._duplicate(t.name))
        self.tenants.append(t)
        self.name.value = _next_name(t.name, taken | {t.name})  # observer re-validates
        self._update_table()
        self.message.value = _message_html(
            f"added {t.name!r} ({len(self.tenants)} tenant{'s' if len(self.tenants) != 1 else ''})", True
        )
        return t

    def remove(self, name: str) -> Tenant:
        """Remove the tenant called ``name`` from :attr:`tenants` and return it (``KeyError`` if absent)."""
        for i, t in enumerate(self.tenants):
            if t.name == name:
                del self.tenants[i]
                self._update_table()
                self._refresh()
                return t
        raise KeyError(f"no tenant {name!r}; tenants: {[t.name for t in self.tenants]}")

    def load(self, tenant: Tenant) -> None:
        """Set every field from ``tenant`` (fields the form does not show are kept from it as well)."""
        t = copy.deepcopy(tenant)
        self._base = t
        self._hold += 1
        try:
            self.name.value = str(t.name)
            self.data.value = str(t.data or "")
            self.eval_data.value = str(t.eval_data or "")
            self.init_adapter.value = str(t.init_adapter or "")
            self.rank.max = max(self._max_rank, int(t.rank))
            self.rank.value = int(t.rank)
            self.alpha.value = float(t.alpha)
            self.use_rslora.value = bool(t.use_rslora)
            self.dropout.max = max(0.5, float(t.dropout))
            self.dropout.value = float(t.dropout)
            targets = [str(x) for x in t.target_modules]
            extra = [x for x in targets if x not in self.target_modules.options]
            if extra:  # e.g. full module names: offer them so the selection can hold them
                self.target_modules.options = [*self.target_modules.options, *extra]
            self.target_modules.value = targets
            if t.lr > 0:  # widen the log slider rather than clamp an lr outside 1e-6..1e-1
                exp = math.log10(t.lr)
                self.lr.min, self.lr.max = min(self.lr.min, math.floor(exp)), max(self.lr.max, math.ceil(exp))
            self.lr.value = float(t.lr)
            self.schedule.value = t.schedule if t.schedule in SCHEDULES else SCHEDULES[0]
            self.warmup_steps.value = int(t.warmup_steps)
            self.no_clipping.value = t.max_grad_norm is None
            self.max_grad_norm.value = 1.0 if t.max_grad_norm is None else float(t.max_grad_norm)
            self.max_grad_norm.disabled = t.max_grad_norm is None
            self.weight_decay.value = float(t.weight_decay)
            self.max_steps.value = int(t.max_steps)
            self.batch_size.value = int(t.batch_size)
            self.grad_accum.value = int(t.grad_accum)
            self.shuffle.value = bool(t.shuffle)
            self.seed.value = int(t.seed)
        finally:
            self._hold -= 1
        self._refresh()

    def on_tenants_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever :attr:`tenants` changes through the form."""
        self._listeners.append(callback)

    # -- internals -------------------------------------------------------------------------------

    def _read(self) -> Tenant:
        d = self._base.to_dict()
        d.update(
            name=self.name.value.strip(),
            data=self.data.value.strip(),
            eval_data=self.eval_data.value.strip() or None,
            init_adapter=self.init_adapter.value.strip() or None,
            rank=self.rank.value,
            alpha=self.alpha.value,
            use_rslora=self.use_rslora.value,
            dropout=self.dropout.value,
            target_modules=list(self.target_modules.value),
            lr=self.lr.value,
            schedule=self.schedule.value,
            warmup_steps=self.warmup_steps.value,
            max_grad_norm=None if self.no_clipping.value else self.max_grad_norm.value,
            weight_decay=self.weight_decay.value,
            max_steps=self.max_steps.value,
            batch_size=self.batch_size.value,
            grad_accum=self.grad_accum.value,
            shuffle=self.shuffle.value,
            seed=self.seed.value,
        )
        return Tenant.from_dict(d)

    def _tenant_problems(self, t: Tenant) -> list[str]:
        spec = JobSpec(base_model=self.base_model, tenants=[t], max_rank=self._max_rank)
        problems = [
            p
            for p in self._checker.problems(spec)
            if p.startswith(("tenant ", "base_model", "tokenizer", "internal error"))
        ]
        if self._model_error and not problems:
            problems.append(self._model_error)
        return problems

    @staticmethod
    def _duplicate(name: str) -> str:
        return f"tenant {name!r} is already added; pick another name (or remove that one first)"

    def _sync_rank_bounds(self) -> None:
        # The slider ends at max_rank, but never below the current rank: a rank above max_rank stays
        # visible (and is reported) instead of being clamped silently.
        self.rank.max = max(self._max_rank, self.rank.value)

    def _refresh(self) -> None:
        if self._hold:
            return
        self.problems_box.value = _problems_html(self.problems(), ok="ok")

    def _on_field(self, change: dict) -> None:
        if change["owner"] is self.target_modules:
            new, old = tuple(change["new"]), tuple(change["old"])
            if ALL_LINEAR in new and len(new) > 1:
                # "all-linear" excludes the others: picking it clears them, picking another clears it.
                keep_all = ALL_LINEAR not in old
                self.target_modules.value = (
                    (ALL_LINEAR,) if keep_all else tuple(x for x in new if x != ALL_LINEAR)
                )
                return  # the nested change re-validates
        if change["owner"] is self.rank and not self._hold:
            self._sync_rank_bounds()
        self._refresh()

    def _on_no_clipping(self, change: dict) -> None:
        self.max_grad_norm.disabled = bool(change["new"])

    def _on_add(self) -> None:
        try:
            self.add()
        except SpecError as e:
            self.message.value = _message_html("not added: " + "; ".join(e.problems), False)

    def _on_remove(self) -> None:
        if self.selected.value:
            name = self.selected.value
            self.remove(name)
            self.message.value = _message_html(f"removed {name!r}", True)

    def _on_load(self) -> None:
        if self.selected.value:
            for t in self.tenants:
                if t.name == self.selected.value:
                    self.load(t)

    def _update_table(self) -> None:
        if not self.tenants:
            self.table.value = "<i>no tenants added yet</i>"
        else:
            head = ["name", "data", "rank", "alpha", "targets", "lr", "schedule", "steps", "batch"]
            rows = [
                [
                    t.name,
                    t.data,
                    t.rank,
                    f"{t.alpha:g}" + (" (rs)" if t.use_rslora else ""),
                    ", ".join(t.target_modules),
                    f"{t.lr:.1e}",
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


def _divisor_choice(description: str, n: int, value: int) -> W.Dropdown:
    """A dropdown of the divisors of ``n``, at ``value`` if it is one (else 1)."""
    options = _divisors(n)
    return W.Dropdown(
        options=options, value=value if value in options else 1, description=description, style=_LABEL,
        layout=_narrow(),
    )  # fmt: skip


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


class JobBuilder:
    """An ipywidgets panel that builds a :class:`~mlora_lab.spec.JobSpec` and launches it.

    It embeds a :class:`TenantForm` (``builder.form``) for the tenants and adds the job settings
    (``builder.seq_len``, ``builder.nproc``, ``builder.fsdp``, ...), the whole spec's problems and a
    live ``job.json`` preview. "Launch" is enabled only while the spec has no problems; it calls
    :func:`mlora_lab.launch.launch` and keeps the :class:`~mlora_lab.launch.Run` in :attr:`run`.
    ``defaults`` pre-fills the job settings and adds its tenants to the form.
    """

    def __init__(
        self,
        base_model: str | os.PathLike,
        form: TenantForm | None = None,
        workdir: str | os.PathLike = "runs",
        defaults: JobSpec | None = None,
        max_nproc: int | None = None,
    ) -> None:
        self.base_model = os.fspath(base_model)
        d = (
            copy.deepcopy(defaults)
            if defaults is not None
            else JobSpec(base_model=self.base_model, tenants=[])
        )
        if form is None:
            form = TenantForm(self.base_model, max_rank=d.max_rank)
        elif os.path.abspath(form.base_model) != os.path.abspath(self.base_model):
            raise ValueError(f"form is for base_model {form.base_model!r}, not {self.base_model!r}")
        self.form = form
        """The embedded tenant form; its :attr:`TenantForm.tenants` are the job's tenants."""
        self.run: Run | None = None
        """The :class:`~mlora_lab.launch.Run` of the last launch (``None`` before)."""
        self._base = d  # keeps fields the builder does not show (tokenizer, slot_modules)
        self._hold = 0
        self._problems: list[str] = []
        max_nproc = max(1, max_nproc or _default_max_nproc(), d.parallel.nproc)

        def num(desc: str, value: int, lo: int) -> W.BoundedIntText:
            return W.BoundedIntText(
                value=value, min=lo, max=_BIG, description=desc, style=_LABEL, layout=_narrow()
            )

        self.seq_len = num("seq_len", d.seq_len, 2)
        self.max_tenants = num("max_tenants", d.max_tenants, 1)
        self.max_rank = num("max_rank", d.max_rank, 1)
        self.dtype = W.Dropdown(
            options=list(DTYPES), value=d.dtype, description="dtype", style=_LABEL, layout=_narrow()
        )
        self.log_every = num("log_every", d.log_every, 1)
        self.eval_every = num("eval_every (0=end)", d.eval_every, 0)
        self.save_every = num("save_every (0=end)", d.save_every, 0)
        self.seed = W.IntText(value=d.seed, description="job seed", style=_LABEL, layout=_narrow())
        self.serve = W.Checkbox(value=d.serve, description="serve (stay up for new tenants)", indent=False)
        self.nproc = W.IntSlider(
            value=d.parallel.nproc, min=1, max=max_nproc, description="nproc", style=_LABEL, layout=_wide()
        )
        self.tp = _divisor_choice("tp", d.parallel.nproc, d.parallel.tp)
        dp = d.parallel.nproc // self.tp.value  # the data-parallel ranks
        self.fsdp = _divisor_choice("fsdp", dp, d.parallel.fsdp)
        self.ep = _divisor_choice("ep", dp, d.parallel.ep)
        self.workdir = W.Text(value=os.fspath(workdir), description="workdir", style=_LABEL, layout=_wide())
        self.fields: dict[str, W.Widget] = {
            k: getattr(self, k)
            for k in (
                "seq_len", "max_tenants", "max_rank", "dtype", "log_every", "eval_every", "save_every",
                "seed", "serve", "nproc", "tp", "fsdp", "ep",
            )
        }  # fmt: skip
        """Every job-setting widget by name (``nproc``/``tp``/``fsdp``/``ep`` set ``parallel``)."""

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

        def row(*ws: W.Widget) -> W.HBox:
            return W.HBox(list(ws))

        job = W.VBox(
            [
                W.HTML("<h4 style='margin:4px 0'>Job</h4>"),
                row(self.seq_len, self.dtype),
                row(self.max_tenants, self.max_rank),
                row(self.log_every, self.eval_every),
                row(self.save_every, self.seed),
                self.serve,
                W.HTML("<b>Parallel</b>"),
                self.nproc,
                row(self.tp, W.HTML("<i>tensor parallel: ranks that split every projection</i>")),
                row(self.fsdp, W.HTML("<i>shard group size: a divisor of nproc / tp</i>")),
                row(
                    self.ep,
                    W.HTML("<i>expert parallel (MoE): a divisor of nproc / tp and of the experts</i>"),
                ),
                self.workdir,
                self.problems_box,
                row(self.launch_button, self.refresh_button),
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
        d = self._base
        return JobSpec(
            base_model=self.base_model,
            tenants=copy.deepcopy(self.form.tenants),
            tokenizer=d.tokenizer,
            seq_len=self.seq_len.value,
            max_tenants=self.max_tenants.value,
            max_rank=self.max_rank.value,
            parallel=Parallel(
                nproc=self.nproc.value, nnodes=1, fsdp=self.fsdp.value, tp=self.tp.value, ep=self.ep.value
            ),
            dtype=self.dtype.value,
            log_every=self.log_every.value,
            eval_every=self.eval_every.value,
            save_every=self.save_every.value,
            serve=self.serve.value,
            seed=self.seed.value,
            output_dir=None,  # every launch gets a new directory under workdir
            slot_modules=copy.deepcopy(d.slot_modules),
        )

    def problems(self) -> list[str]:
        """Every problem of :meth:`spec` (as :meth:`JobSpec.problems` reports them)."""
        return self.form._checker.problems(self.spec())

    def launch(self) -> Run:
        """Launch :meth:`spec` under torchrun in the background (``launch(spec, workdir)``); returns the
        Run and keeps it in :attr:`run`. Raises :class:`SpecError` if the spec has problems."""
        from mlora_lab.launch import launch

        self.run = launch(self.spec(), self.workdir.value)
        self._refresh()
        return self.run

    # -- internals -------------------------------------------------------------------------------

    def _refresh(self) -> None:
        if self._hold:
            return
        spec = self.spec()
        self._problems = self.problems()
        shown = list(self._problems)
        if not spec.tenants and not spec.serve:
            shown.append('fill in the tenant form above and press "Add tenant"')
        self.problems_box.value = _problems_html(shown, ok="ready to launch")
        self.preview.value = (
            "<pre style='max-height:320px;overflow:auto;margin:0'>" + html.escape(spec.to_json()) + "</pre>"
        )
        state = self.run.status if self.run is not None else None
        self.launch_button.disabled = bool(self._problems) or (state is not None and not state.final)
        self.status.value = self._status_html(state)

    def _status_html(self, state: str | None) -> str:
        if self.run is None:
            return ""
        color = {RunState.FINISHED: "#1a7f37", RunState.FAILED: "#b42318", RunState.LOST: "#b42318",
                 RunState.STOPPED: "#9a6700"}.get(state, "#0550ae")  # fmt: skip
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
        self.form.max_rank = int(change["new"])

    def _on_launch(self) -> None:
        try:
            self.launch()
        except Exception as e:  # shown in the panel: a button callback has nowhere else to report
            problems = e.problems if isinstance(e, SpecError) else [f"launch failed: {type(e).__name__}: {e}"]
            self.status.value = _problems_html(problems)
