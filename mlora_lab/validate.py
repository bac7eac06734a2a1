"""Validation of a :class:`~mlora_lab.spec.JobSpec`: every problem at once, before anything starts.

    from mlora_lab.validate import Validator, ValidationCache
    problems = Validator().problems(spec)          # = spec.problems(); list[Problem], never raises
    for p in problems:
        print(p.tenant, p.field, p.message)         # str(p): "tenant 'alice': rank must be >= 1 (got 0)"

    form_validator = Validator(ValidationCache())  # what the notebook forms use: repeated checks of
    form_validator.problems(spec)                  # similar specs load the model once and scan a data
                                                   # file again only when it changes

A check never raises and starts no process: it reads the model's config (and builds the model on the
``meta`` device, which allocates nothing), the tokenizer, the tenants' data files (tokenized until one
row keeps a target token at ``seq_len``) and the headers of any ``init_adapter`` weights, so bad input
is reported before anything is launched. ``problems(spec, files=False)`` checks only the fields,
names, parallel layout and tenant set, reading no file: cheap enough for the training process to
re-check the ``job.json`` it starts from.

Field values are checked against each field's :class:`~mlora_lab.spec.FieldInfo` (kind, bounds,
choices), the same metadata the forms build their inputs from. Each :class:`~mlora_lab.spec.Problem`
names its tenant and field, so views place problems without parsing their text. Everything here
treats its input as hostile: a message repeats at most ~80 characters of a bad value.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from mlora_lab.bases import GGUFBaseError, gguf_config, gguf_file, gguf_problem, gguf_tokenizer, is_gguf
from mlora_lab.lora.targets import (
    ALL_LINEAR,
    match_targets,
    name_matches,
    output_layer_names,
    storable_targets,
    suffixes,
)
from mlora_lab.spec import (
    _MAX_JSON_BYTES,
    _SAFE_NAME,
    MAX_NAME_LEN,
    MAX_PROBLEMS,
    MAX_ROWS,
    MAX_SLOTS,
    MAX_TARGETS,
    FieldInfo,
    JobSpec,
    Parallel,
    Problem,
    Tenant,
    _brief,
    _is_int,
    _is_num,
    _json_problem,
    _json_type,
    _path_problem,
    _read_json,
    _short,
    _show_path,
    _valid_targets,
    _who,
    effective_slot_modules,
    field_info,
    fields_info,
)

__all__ = [
    "Problem",
    "ValidationCache",
    "Validator",
    "all_linear_names",
    "linear_target_options",
    "model_target_names",
    "sweep_problems",
    "sweep_slot_modules",
    "tenant_problems",
]


# ---------------------------------------------------------------------------------------------
# The public entry points
# ---------------------------------------------------------------------------------------------


class ValidationCache:
    """What a :class:`Validator` may remember between specs, so a form can re-validate on every change.

    - the base model's structure and its tokenizer, per ``(base_model, tokenizer)`` path, kept only
      when both loaded without a problem (a path that is fixed later is seen at once);
    - each data file's problems, per file version (absolute path, mtime, size) and what the check
      depends on (the tokenizer's paths, ``seq_len``): a file is read again only when it changes,
      and renaming its tenant does not re-read it.

    Not thread-safe: one cache per form, used from the notebook's thread.
    """

    def __init__(self) -> None:
        self._env: dict[tuple[Any, ...], tuple[_ModelInfo | None, Any]] = {}
        self._data: dict[tuple[Any, ...], list[str]] = {}

    def clear(self) -> None:
        """Forget everything (e.g. after a model directory was rewritten in place)."""
        self._env.clear()
        self._data.clear()


class Validator:
    """Checks specs and reports every problem at once, as :class:`~mlora_lab.spec.Problem` objects.

    ``JobSpec.problems()`` is ``Validator().problems(spec)``. With a :class:`ValidationCache`, repeated
    checks skip the slow steps (loading the model config and tokenizer, scanning unchanged data files).
    """

    def __init__(self, cache: ValidationCache | None = None) -> None:
        self.cache = cache
        """The cache consulted and filled by every check (``None``: nothing is remembered)."""

    def problems(self, spec: JobSpec, files: bool = True) -> list[Problem]:
        """Every problem of ``spec``, at most ``MAX_PROBLEMS`` of them; never raises, starts no process.

        ``files=False`` reads no file: only the fields, names, parallel layout and tenant set."""
        try:
            return _capped(_Check(spec, self.cache).run(files=files))
        except Exception as e:  # "never raises": a bug in a check is still reported, not thrown
            return [
                Problem(
                    None, None, f"internal error while validating the spec ({type(e).__name__}: {_short(e)})"
                )
            ]

    def tenant_problems(self, job: JobSpec, tenant: Tenant) -> list[Problem]:
        """Problems of adding ``tenant`` to the job ``job`` while it runs: the tenant's own fields and
        files, checked against the job's model, tokenizer, ``max_rank``, adapter slots and tenant names.
        Never raises."""
        if not isinstance(tenant, Tenant):
            return [Problem(None, None, f"tenant must be a Tenant (got {type(tenant).__name__})")]
        try:
            probe = dataclasses.replace(
                job, tenants=[tenant], slot_modules=effective_slot_modules(job), serve=False,
                parallel=Parallel(), output_dir=None,
            )  # fmt: skip
            # The probe holds only this tenant and the job's settings (valid: the job runs with them), so
            # every problem it finds is one of adding this tenant.
            out = self.problems(probe)
            # Names are never reused (job.json lists every tenant the run has had, removed ones included),
            # and a name equal up to case collides with that tenant's adapter directory.
            if isinstance(tenant.name, str) and isinstance(job.tenants, list):
                for other in job.tenants:
                    name = other.name if isinstance(other, Tenant) else None
                    if name == tenant.name:
                        out.append(
                            Problem(tenant.name, "name", "a tenant of that name already exists in this run "
                                    "(names are never reused)")
                        )  # fmt: skip
                    elif isinstance(name, str) and name.lower() == tenant.name.lower():
                        out.append(_case_problem(tenant.name, name, existing=True))
            return out
        except Exception as e:  # same promise as problems()
            return [
                Problem(
                    None,
                    None,
                    f"internal error while validating the tenant ({type(e).__name__}: {_short(e)})",
                )
            ]


def tenant_problems(job: JobSpec, tenant: Tenant) -> list[Problem]:
    """:meth:`Validator.tenant_problems` without a cache (what ``Run.add_tenant`` and the job use)."""
    return Validator().tenant_problems(job, tenant)


def model_target_names(base_model: str) -> tuple[list[str], list[str]]:
    """Full names of the model's ``nn.Linear`` modules, and of its 3-D parameters (packed MoE experts).

    The model is built from its config on the ``meta`` device (no weights are read); results are
    cached per path. Raises whatever transformers raises if the config cannot be loaded.
    """
    info = _model_info(os.path.abspath(os.fspath(base_model)))
    linear_in_order = [n for n, _ in info.modules if n in info.linear]
    return linear_in_order, list(info.experts)


def all_linear_names(base_model: str) -> list[str]:
    """Full names of the layers ``["all-linear"]`` selects in the model, in model order: every
    ``nn.Linear`` except the output layer (found as :mod:`mlora_lab.lora.targets` says, the way PEFT
    finds it). Built on the ``meta`` device and cached, like :func:`model_target_names`."""
    return _model_info(os.path.abspath(os.fspath(base_model))).all_linear


def linear_target_options(base_model: str) -> list[str]:
    """``target_modules`` entries that name the model's all-linear layers, in model order: the shortest
    ``.``-suffixes (``q_proj``, ``k_proj``, ...) that select only such layers (never the output layer),
    as the forms offer them (:func:`mlora_lab.lora.targets.storable_targets`)."""
    info = _model_info(os.path.abspath(os.fspath(base_model)))
    return storable_targets(info.all_linear, [n for n, _ in info.modules])


# ---------------------------------------------------------------------------------------------
# Model introspection
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelInfo:
    modules: tuple[tuple[str, str], ...]
    """(full name, class name) of every submodule."""
    linear: frozenset[str]
    """Full names of the ``nn.Linear`` submodules."""
    experts: tuple[str, ...]
    """Full names of the 3-D parameters (packed MoE experts)."""
    expert_modules: tuple[tuple[str, int, str | None], ...] = ()
    """(full name, number of experts, why it cannot be split or None) of each module holding 3-D parameters."""
    linear_shapes: tuple[tuple[str, int, int], ...] = ()
    """(full name, in_features, out_features) of every ``nn.Linear``: ``W`` is ``[out, in]``."""
    expert_shapes: tuple[tuple[str, int, int, int], ...] = ()
    """(full name, E, out, in) of every 3-D parameter: expert ``e`` computes ``x W[e]^T``, ``W`` ``[E, out, in]``."""
    vocab: int | None = None
    """Rows of the input embedding: token ids must be below it."""
    logits: int | None = None
    """Columns of the logits (the output layer's outputs)."""
    output: frozenset[str] = frozenset()
    """Full names of the output layer (:func:`mlora_lab.lora.targets.output_layer_names`)."""

    @property
    def all_linear(self) -> list[str]:
        """What ``"all-linear"`` selects: every ``nn.Linear`` but the output layer, in model order."""
        return [n for n, _ in self.modules if n in self.linear and n not in self.output]


# A config this large is not a model but a typo or an attack: building even its meta skeleton
# (one Python object per module) would take minutes and gigabytes.
_CONFIG_LIMITS = {"num_hidden_layers": 4096, "n_layer": 4096, "num_layers": 4096, "num_experts": 2**16,
                  "num_local_experts": 2**16, "n_routed_experts": 2**16}  # fmt: skip


def _load_config(path: str) -> Any:
    """The transformers config of a base model: its directory's ``config.json``, or for a GGUF base
    (``mlora_lab.bases``) the config its metadata describes, read without converting it."""
    if is_gguf(path):
        return gguf_config(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@functools.lru_cache(maxsize=32)
def _model_info(path: str) -> _ModelInfo:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _load_config(path)
    for key, limit in _CONFIG_LIMITS.items():
        v = getattr(cfg, key, None)
        if _is_int(v) and v > limit:
            raise ValueError(f"config.json has {key}={_brief(v)} (at most {limit}); that is not a real model")
    # On the meta device nothing is allocated or initialised: cheap even for a large model.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    named = [(n, m) for n, m in model.named_modules() if n]
    modules = tuple((n, type(m).__name__) for n, m in named)
    linear_mods = [(n, m) for n, m in named if isinstance(m, torch.nn.Linear)]
    linear = frozenset(n for n, _ in linear_mods)
    linear_shapes = tuple((n, m.in_features, m.out_features) for n, m in linear_mods)
    params3 = [(n, p) for n, p in model.named_parameters() if p.ndim == 3]
    experts = tuple(n for n, _ in params3)
    expert_shapes = tuple((n, *(int(d) for d in p.shape)) for n, p in params3)
    from mlora_lab.lora.experts import packed_experts_problem

    holders = sorted({n.rpartition(".")[0] for n in experts})
    expert_modules = tuple(
        (n, model.get_submodule(n).gate_up_proj.shape[0] if not problem else 0, problem)
        for n in holders
        for problem in [packed_experts_problem(model.get_submodule(n))]
    )
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = getattr(emb, "num_embeddings", None) if emb is not None else None
    logits = getattr(head, "out_features", None) if head is not None else None
    vocab = vocab if _is_int(vocab) else getattr(cfg, "vocab_size", None)
    logits = logits if _is_int(logits) else vocab
    output = frozenset(output_layer_names(model))
    return _ModelInfo(
        modules, linear, experts, expert_modules, linear_shapes, expert_shapes, vocab, logits, output
    )


@functools.lru_cache(maxsize=32)
def _tp_problems(path: str, tp: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from mlora_lab.parallel.tensor import tp_problems

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_load_config(path))
    return tp_problems(model, tp)


def _select_linear(info: _ModelInfo, targets: list[str] | tuple[str, ...]) -> set[str]:
    """Full names of the linear layers that ``targets`` (valid per ``_valid_targets``) select."""
    return set(match_targets(sorted(info.linear), list(targets), info.all_linear))


@functools.cache
def _device_memory() -> tuple[int, str] | None:
    """Bytes of memory of one device the job may run on, and what it is: GPU 0 if CUDA is available,
    else the host's RAM (a CPU job). ``None`` if neither can be read."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory), "GPU 0"
    except Exception:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total), "RAM"
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------


def _of(name: Any, field: str | None, message: str, path: str | None = None) -> Problem:
    """A problem of the tenant called ``name``. A name that is not a string cannot key anything: the
    problem is then job-wide (``tenant=None``) and its message names the tenant as the spec holds it."""
    if isinstance(name, str):
        return Problem(name, field, message, path)
    return Problem(None, field, f"{_who(name)}: {message}", path)


def _is_finite(v: Any) -> bool:
    """A real number that is neither inf nor nan; an int too large for a float (10**400) is not."""
    if not _is_num(v):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _got(v: Any) -> str:
    return f"got {_brief(v)} of type {type(v).__name__}"


def _names(items: list[Any], n: int = 10) -> str:
    """``a, b, c and 7 more``: a list in a message, at most ``n`` entries, each shortened."""
    shown = [x if isinstance(x, str) and len(x) <= 120 and x.isprintable() else _brief(x) for x in items[:n]]
    return ", ".join(shown) + (f" and {len(items) - n} more" if len(items) > n else "")


def _more(items: list[str]) -> str:
    """`` (and N more)`` after the first of ``items`` is shown."""
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _bound(n: float) -> str:
    """An integer bound as messages write it: ``2**24``, ``2**53 - 1`` for the huge ones, else the number."""
    if _is_int(n) and n >= 2**10:
        k = n.bit_length()
        if n == 2 ** (k - 1):
            return f"2**{k - 1}"
        if n == 2**k - 1:
            return f"2**{k} - 1"
    return f"{n:g}" if isinstance(n, float) else str(n)


def _capped(problems: list[Problem]) -> list[Problem]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    return [
        *problems[:MAX_PROBLEMS],
        Problem(None, None, f"... and {len(problems) - MAX_PROBLEMS} more problem(s)"),
    ]


def _usable_path(v: Any) -> bool:
    """A non-empty string that can name a file (type and path problems are reported elsewhere)."""
    return isinstance(v, str) and bool(v) and _path_problem(v) is None


def _case_problem(name: str, other: str, existing: bool = False) -> Problem:
    return Problem(
        name,
        "name",
        f"name differs from {'existing tenant ' if existing else ''}{_brief(other)} only in case; their "
        "adapters/<name> directories collide on case-insensitive filesystems (macOS, Windows): rename one",
    )


def _file_key(path: str) -> tuple[str, int | None, int | None]:
    """What identifies one version of a file: its absolute path, mtime and size (``None`` if missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return (os.path.abspath(path), None, None)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


# Bytes per element of the safetensors dtypes (sub-byte and unknown ones are not size-checked).
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}  # fmt: skip


def _safetensors_shapes(path: str) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """The tensor shapes a safetensors file declares, from its header only (no tensor is read), or
    ``({}, why)`` when it is not a complete safetensors file.

    Layout: ``N`` (8 bytes, little-endian), ``N`` bytes of JSON ``{name: {dtype, shape, data_offsets:
    [begin, end]}, "__metadata__": {...}}``, then the data, ``end`` bytes at most. A pickle renamed to
    ``.safetensors`` gives an absurd ``N``; a truncated download, a tensor that ends past the file.
    """
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            head = fh.read(9)
            if size == 0:
                return {}, "it is empty"
            if len(head) < 8:
                return {}, f"it is truncated ({size} bytes)"
            n = int.from_bytes(head[:8], "little")
            # safetensors' own limit on the header; and the header is a JSON object
            if n > 100 * 2**20 or head[8:9] not in (b"{", b""):
                return {}, "it is not a safetensors file (no valid header)"
            if 8 + n > size:
                return {}, f"it is truncated (its header needs {8 + n} bytes, the file has {size})"
            raw = head[8:] + fh.read(n - 1) if n else b""
    except OSError as e:
        return {}, f"it cannot be read ({e.strerror or e})"
    parsed = _json_problem(raw) if raw[:1] == b"{" else "no JSON object"
    header = parsed[0] if isinstance(parsed, tuple) else None
    if not isinstance(header, dict):
        return {}, "it is not a safetensors file (its header is not a JSON object)"
    data = size - 8 - n
    shapes: dict[str, tuple[int, ...]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (
            isinstance(shape, list)
            and all(_is_int(d) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            return {}, f"it is not a safetensors file (bad header entry {_brief(key)})"
        if offsets[1] > data:
            return {}, f"it is truncated (tensor {_brief(key)} ends at byte {offsets[1]} of {data})"
        width = _ST_BYTES.get(info.get("dtype"))
        if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
            return {}, f"it is not a safetensors file (tensor {_brief(key)} has the wrong byte count)"
        shapes[key] = tuple(shape)
    return shapes, None


# ---------------------------------------------------------------------------------------------
# One check of one spec
# ---------------------------------------------------------------------------------------------


class _Check:
    """Collects every problem of one ``JobSpec``; each ``_check_*`` appends to ``self.out``.

    The field checks take an ``owner``: the ``Tenant`` whose field it is, or ``None`` for a job field."""

    def __init__(self, spec: JobSpec, cache: ValidationCache | None = None) -> None:
        self.spec = spec
        self.cache = cache
        self.out: list[Problem] = []
        self.model: _ModelInfo | None = None
        self.tok: Any = None
        self.layout_ok = False
        """``parallel`` is a valid layout (the TP / EP checks against the model need one)."""

    def run(self, files: bool = True) -> list[Problem]:
        s = self.spec
        self._check_job_fields()
        self._check_parallel()
        tenants = s.tenants if isinstance(s.tenants, list) else []
        if not isinstance(s.tenants, list):
            self._say(None, "tenants", f"tenants must be a list of Tenant (got {type(s.tenants).__name__})")
        good = []
        for i, t in enumerate(tenants):
            if isinstance(t, Tenant):
                good.append(t)
            else:
                self._say(None, "tenants", f"tenants[{i}] must be a Tenant (got {type(t).__name__})")
        self._check_tenant_set(tenants)
        for t in good:
            self._check_tenant_fields(t)
        # Past the tenant cap the job is refused anyway; reading every tenant's files would only cost time.
        if not files or len(tenants) > MAX_SLOTS:
            return self.out
        self._load_model_and_tokenizer()
        for t in good:
            self._check_targets(t)
            self._check_data(t)
            self._check_init_adapter(t)
        self._check_slot_modules(good)
        self._check_expert_parallel()
        self._check_tensor_parallel()
        self._check_vocab()
        self._check_memory(good)
        return self.out

    def _say(self, owner: Tenant | None, field: str | None, message: str, path: str | None = None) -> None:
        self.out.append(
            Problem(None, field, message, path) if owner is None else _of(owner.name, field, message, path)
        )

    # -- generic field checks (from each field's FieldInfo) ------------------------------------

    def _check_field(
        self, owner: Tenant | None, field: str, value: Any, info: FieldInfo, label: str = ""
    ) -> bool:
        """``value`` of ``field`` checked against its :class:`FieldInfo`; whether it passed. ``label``
        is how messages name the field (``parallel.nproc``), ``field`` by default."""
        label = label or field
        if value is None and info.optional:
            return True
        kind = info.kind
        if kind == "int":
            if info.bool_ok and isinstance(value, bool):
                return True
            hi, hi_name = info.max, ""
            bound = getattr(self.spec, info.at_most, None) if info.at_most else None
            # a bad bound (max_rank=0) is reported on its own field; this one keeps its own bounds
            if _is_int(bound) and field_info(JobSpec, info.at_most).allows(bound):
                hi, hi_name = bound, f"{info.at_most}={bound}"
            return self._int(owner, field, value, info.min, hi, hi_name, label)
        if kind in ("float", "log-float"):
            return self._num(owner, field, value, info, label)
        if kind == "bool":
            return self._bool(owner, field, value, label)
        if kind == "choice":
            return self._one_of(owner, field, value, info.choices, label)
        if kind in ("path", "dir"):
            return self._path(owner, field, value, info, label)
        if kind == "targets":
            return self._str_list(owner, field, value, union=field == "slot_modules", label=label)
        if kind == "pair":
            if not (isinstance(value, tuple | list) and len(value) == 2):
                self._say(owner, field, f"{label} must be a pair of numbers {info.rule()} ({_got(value)})")
                return False
            return all([self._num(owner, field, v, info, f"{label}[{i}]") for i, v in enumerate(value)])
        if kind == "name":
            return self._check_name(value)
        raise ValueError(f"field {field!r} has kind {kind!r}, which has no check")

    def _int(
        self, owner: Tenant | None, field: str, v: Any, lo: float | None, hi: float | None, hi_name: str = "",
        label: str = "",
    ) -> bool:  # fmt: skip
        label = label or field
        if not _is_int(v):
            self._say(owner, field, f"{label} must be an integer ({_got(v)})")
        elif lo is not None and v < lo:
            self._say(owner, field, f"{label} must be >= {_bound(lo)} (got {_brief(v)})")
        elif hi is not None and v > hi:
            self._say(owner, field, f"{label} must be <= {hi_name or _bound(hi)} (got {_brief(v)})")
        else:
            return True
        return False

    def _num(self, owner: Tenant | None, field: str, v: Any, info: FieldInfo, label: str = "") -> bool:
        """A finite real number within ``info``'s bounds."""
        label = label or field
        if not _is_finite(v):
            self._say(owner, field, f"{label} must be a finite number ({_got(v)})")
        elif not info.allows(v):
            rule = info.rule() + (f" (or null for {info.null_means})" if info.null_means else "")
            self._say(owner, field, f"{label} must be {rule} (got {_brief(v)})")
        else:
            return True
        return False

    def _bool(self, owner: Tenant | None, field: str, v: Any, label: str = "") -> bool:
        if isinstance(v, bool):
            return True
        self._say(owner, field, f"{label or field} must be true or false ({_got(v)})")
        return False

    def _path(self, owner: Tenant | None, field: str, v: Any, info: FieldInfo, label: str = "") -> bool:
        """A string that can name a file or directory (``None`` allowed when ``info.optional``)."""
        label = label or field
        what = "a directory" if info.kind == "dir" else "a file"
        if v == "":
            self._say(owner, field, f"{label} is empty; give the path of {what}")
            return False
        if not isinstance(v, str):
            kind = "a non-empty string or null" if info.optional else "a non-empty string"
            self._say(owner, field, f"{label} must be {kind} ({_got(v)})")
            return False
        why = _path_problem(v)
        if why:
            self._say(owner, field, f"{label} path {why}")
            return False
        return True

    def _one_of(
        self, owner: Tenant | None, field: str, v: Any, choices: tuple[str, ...], label: str = ""
    ) -> bool:
        if isinstance(v, str) and v in choices:
            return True
        self._say(owner, field, f"{label or field} must be one of {', '.join(choices)} (got {_brief(v)})")
        return False

    def _str_list(
        self, owner: Tenant | None, field: str, v: Any, union: bool = False, label: str = ""
    ) -> bool:
        label = label or field
        if _valid_targets(v, union):
            return True
        strings = isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v)
        if isinstance(v, list | tuple) and len(v) > MAX_TARGETS:
            self._say(owner, field, f"{label} has {len(v):,} entries (at most {MAX_TARGETS:,})")
        elif strings and any(len(x) > 1000 for x in v):
            self._say(owner, field, f"{label}: every entry must be at most 1000 characters (a module name)")
        elif strings:
            # PEFT reads "all-linear" only as the whole value; in a list it is one more module name, which
            # matches nothing, so ["all-linear", "q_proj"] would silently adapt q_proj alone.
            self._say(
                owner, field,
                f"{label}: '{ALL_LINEAR}' must be the only entry (got {_brief(list(v))}); with other names "
                "PEFT would read it as a module name that matches nothing",
            )  # fmt: skip
        else:
            self._say(owner, field, f"{label} must be a list of non-empty strings ({_got(v)})")
        return False

    # -- job-level -----------------------------------------------------------------------------

    def _check_job_fields(self) -> None:
        s = self.spec
        for name, info in fields_info(JobSpec):
            if info.kind not in ("tenants", "parallel"):  # checked part by part, below
                self._check_field(None, name, getattr(s, name), info)
        out = s.output_dir
        if _usable_path(out) and os.path.exists(out) and not os.path.isdir(out):
            self._say(None, "output_dir", f"output_dir {_brief(out)} exists and is not a directory")

    def _check_parallel(self) -> None:
        p = self.spec.parallel
        if not isinstance(p, Parallel):
            self._say(None, "parallel", f"parallel must be a Parallel (got {type(p).__name__})")
            return
        ok = [
            self._check_field(None, f"parallel.{n}", getattr(p, n), info) for n, info in fields_info(Parallel)
        ]
        if not all(ok):
            return
        self.layout_ok = True
        group = p.fsdp * p.tp
        if p.world_size % group:
            self._say(
                None, "parallel.fsdp",
                f"parallel: fsdp*tp = {p.fsdp}*{p.tp} = {group} must divide "
                f"nproc*nnodes = {p.nproc}*{p.nnodes} = {p.world_size}",
            )  # fmt: skip
        elif (p.world_size // p.tp) % p.ep:
            self._say(
                None, "parallel.ep",
                f"parallel: ep = {p.ep} must divide the data-parallel ranks (nproc*nnodes/tp = "
                f"{p.world_size // p.tp}); expert parallelism splits the experts over groups of them",
            )  # fmt: skip

    def _check_tensor_parallel(self) -> None:
        """``tp > 1`` needs the model's TP plan and dimensions that split evenly over ``tp`` ranks."""
        p = self.spec.parallel
        if self.model is None or not self.layout_ok or p.tp <= 1:
            return
        for problem in _tp_problems(os.path.abspath(self.spec.base_model), p.tp):
            self._say(None, "parallel.tp", problem)

    def _check_expert_parallel(self) -> None:
        """``ep > 1`` needs packed experts that split evenly over ``ep`` ranks."""
        p = self.spec.parallel
        if self.model is None or not self.layout_ok or p.ep <= 1:
            return
        if not self.model.expert_modules:
            self._say(
                None,
                "parallel.ep",
                f"parallel.ep = {p.ep}, but the model has no packed (3-D) expert parameters",
            )
            return
        name, n, problem = self.model.expert_modules[0]
        if problem:
            self._say(None, "parallel.ep", f"parallel.ep = {p.ep}: experts module {name} {problem}")
        elif n % p.ep:
            self._say(
                None, "parallel.ep", f"parallel.ep = {p.ep} does not divide the {n} experts of each MoE layer"
            )

    def _check_tenant_set(self, tenants: list[Any]) -> None:
        s = self.spec
        if not tenants and s.serve is not True:
            self._say(None, "tenants", "no tenants: add at least one, or set serve=true to wait for tenants")
        if _is_int(s.max_tenants) and len(tenants) > s.max_tenants:
            self._say(
                None,
                "max_tenants",
                f"{len(tenants)} tenants but max_tenants={_brief(s.max_tenants)}; raise max_tenants",
            )
        names = [t.name for t in tenants if isinstance(t, Tenant) and isinstance(t.name, str)]
        counts = collections.Counter(names)  # not names.count(): quadratic in a hostile tenant list
        for dup in sorted(n for n, c in counts.items() if c > 1):
            self._say(
                None,
                "tenants",
                f"tenant name {_brief(dup)} is used {counts[dup]} times; names must be unique",
            )
        # Equal up to case: two directories on a case-sensitive filesystem, one on macOS / Windows.
        first: dict[str, str] = {}
        for name in counts:
            other = first.setdefault(name.lower(), name)
            if other != name:
                self.out.append(_case_problem(name, other))

    # -- tenant fields -------------------------------------------------------------------------

    def _check_tenant_fields(self, t: Tenant) -> None:
        ok = {name: self._check_field(t, name, getattr(t, name), info) for name, info in fields_info(Tenant)}
        if (
            ok["target_modules"]
            and ok["target_parameters"]
            and not t.target_modules
            and not t.target_parameters
        ):
            self._say(
                t, "target_modules", "target_modules and target_parameters are both empty; nothing to adapt"
            )
        if ok["batch_size"] and ok["grad_accum"] and t.batch_size * t.grad_accum > MAX_ROWS:
            self._say(
                t, "batch_size",
                f"batch_size*grad_accum = {t.batch_size}*{t.grad_accum} = {t.batch_size * t.grad_accum:,} "
                f"rows per optimizer step is more than {MAX_ROWS:,} (2**20); lower batch_size or grad_accum",
            )  # fmt: skip

    def _check_name(self, name: Any) -> bool:
        if not isinstance(name, str):
            self._say(None, "name", f"tenant name must be a string ({_got(name)})")
            return False
        why = ""
        if not name:
            why = "it is empty"
        elif name in (".", ".."):
            why = f"{name!r} is not allowed"
        elif len(name) > MAX_NAME_LEN:
            why = f"it is {len(name):,} characters long (at most {MAX_NAME_LEN})"
        elif not _SAFE_NAME.fullmatch(name):
            bad = "".join(sorted({c for c in name if not _SAFE_NAME.fullmatch(c)}))
            why = f"it contains {_brief(bad)}"
        if why:
            self.out.append(
                _of(name, "name", f"name is not a safe directory name ({why}); "
                    f"use 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ -")
            )  # fmt: skip
        return not why

    # -- model and tokenizer -------------------------------------------------------------------

    def _env_key(self) -> tuple[Any, ...] | None:
        """The cache key of the model and tokenizer: their absolute paths (``None`` if not both usable)."""
        paths = (self.spec.base_model, self.spec.tokenizer)
        if not all(p is None or _usable_path(p) for p in paths):
            return None
        return tuple(os.path.abspath(p) if p is not None else None for p in paths)

    def _load_model_and_tokenizer(self) -> None:
        key = self._env_key() if self.cache is not None else None
        if key is not None and key in self.cache._env:
            self.model, self.tok = self.cache._env[key]
            return
        start = len(self.out)
        self._load_model_and_tokenizer_now()
        if key is not None and len(self.out) == start:  # only successes: a fixed path is seen at once
            self.cache._env[key] = (self.model, self.tok)

    def _load_model_and_tokenizer_now(self) -> None:
        s = self.spec
        base_ok = False
        if _usable_path(s.base_model):
            if is_gguf(s.base_model):
                base_ok = self._load_gguf(s.base_model)
            elif not os.path.isdir(s.base_model):
                self._say(
                    None, "base_model",
                    f"base_model {_brief(s.base_model)} is not a local directory (give the directory of a "
                    "model saved with save_pretrained, or a .gguf file; nothing is downloaded)",
                )  # fmt: skip
            else:
                base_ok = self._load_model(s.base_model)
        tok_path = s.tokenizer if s.tokenizer is not None else s.base_model
        label = "tokenizer" if s.tokenizer is not None else "tokenizer (base_model)"
        if not _usable_path(tok_path) or (s.tokenizer is None and not base_ok):
            return  # already reported (bad type or path, or the base_model problem covers it)
        gguf_tok = is_gguf(tok_path)
        if not gguf_tok and not os.path.isdir(tok_path):
            self._say(None, "tokenizer", f"{label} {_brief(tok_path)} is not a local directory")
            return
        try:
            from transformers import AutoTokenizer

            # a GGUF's tokenizer (chat template included) is read from its metadata
            self.tok = gguf_tokenizer(tok_path) if gguf_tok else AutoTokenizer.from_pretrained(tok_path)
        except Exception as e:
            self._say(
                None, "tokenizer", f"{label} {_brief(tok_path)}: AutoTokenizer cannot load it ({_short(e)})"
            )

    def _load_gguf(self, path: str) -> bool:
        """A GGUF base (``mlora_lab.bases``): one readable ``.gguf`` file whose metadata describes a
        causal LM transformers can load. Nothing is converted here; the job converts it once, when it
        loads the base (``resolve_base``)."""
        where = f"base_model {_brief(path)}"
        try:
            file = gguf_file(path)
        except GGUFBaseError as e:
            self._say(None, "base_model", f"{where}: {e.reason}")
            return False
        assert file is not None
        why = gguf_problem(file)
        if why:
            self._say(None, "base_model", f"{where}: {why}")
            return False
        try:
            _load_config(path)
        except Exception as e:
            self._say(
                None,
                "base_model",
                f"{where}: transformers cannot read a model config from this GGUF ({_short(e)})",
            )
            return False
        return self._read_model_info(path, where)

    def _read_model_info(self, path: str, where: str) -> bool:
        """``self.model`` from the config at ``path`` (a meta-device build), or a problem."""
        try:
            self.model = _model_info(os.path.abspath(path))
        except Exception as e:
            self._say(None, "base_model", f"{where}: cannot build a causal LM from its config ({_short(e)})")
            return False
        return True

    def _load_model(self, path: str) -> bool:
        where = f"base_model {_brief(path)}"
        cfg = os.path.join(path, "config.json")
        if os.path.isfile(cfg) and os.path.getsize(cfg) > _MAX_JSON_BYTES:
            self._say(
                None, "base_model", f"{where}: config.json is larger than 64 MiB; that is not a model config"
            )
            return False
        try:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(path)
        except Exception as e:
            self._say(
                None, "base_model", f"{where} does not hold a loadable transformers config ({_short(e)})"
            )
            return False
        if not self._read_model_info(path, where):
            return False
        self._check_weights(path, where)
        return True

    def _check_weights(self, path: str, where: str) -> None:
        """``from_pretrained`` needs the weights next to the config: ``model.safetensors`` (a complete
        file), an index whose shards all exist, or ``pytorch_model.bin``. A config-only directory
        validates the layout but could never train."""
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(single):
            _, why = _safetensors_shapes(single)
            if why:
                self._say(
                    None,
                    "base_model",
                    f"{where}: model.safetensors is not usable ({why}); save the model again",
                )
            return
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index_path = os.path.join(path, index)
            if not os.path.isfile(index_path):
                continue
            value, why = _read_json(index_path, "an index file")
            weight_map = value.get("weight_map") if isinstance(value, dict) else None
            shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
            plain = all(
                isinstance(f, str) and f and os.path.basename(f) == f and _usable_path(f) for f in shards
            )
            if why or not shards or not plain:
                why = why or "has no weight_map of tensor name -> shard file name"
                self._say(None, "base_model", f"{where}: {index} {why}; save the model again")
                return
            missing = [f for f in shards if not os.path.isfile(os.path.join(path, f))]
            if missing:
                self._say(
                    None, "base_model",
                    f"{where}: no weights found: {index} lists shard files that are missing "
                    f"({_names(missing, 5)}); copy every shard next to it",
                )  # fmt: skip
                return
            for shard in shards if index.startswith("model.safetensors") else []:
                _, why = _safetensors_shapes(os.path.join(path, shard))
                if why:
                    self._say(
                        None, "base_model",
                        f"{where}: shard {_show_path(shard)} is not usable ({why}); save the model again",
                    )  # fmt: skip
                    return
            return
        if not os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            self._say(
                None, "base_model",
                f"{where}: no weights found (it has a config but no model.safetensors, "
                "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json); "
                "save the model with save_pretrained",
            )  # fmt: skip

    def _check_vocab(self) -> None:
        """Token ids index the input embedding. The ids the job itself inserts (BOS, EOS, padding)
        must be rows of it; a tokenizer may have more tokens than rows (some tokenizer classes add
        special tokens a model never saw), and a tenant whose rows contain such ids is refused alone
        when it is loaded, before any of its rows reach the shared forward."""
        m, tok = self.model, self.tok
        if m is None or tok is None or not _is_int(m.vocab):
            return
        used = {name: getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos", "pad")}
        past = {name: i for name, i in used.items() if _is_int(i) and not 0 <= i < m.vocab}
        if past:
            label = "tokenizer" if self.spec.tokenizer is not None else "tokenizer (base_model)"
            ids = ", ".join(f"{name} id {i}" for name, i in past.items())
            self._say(
                None, "tokenizer",
                f"{label}: {ids} past the model's input embedding ({m.vocab:,} rows, vocab_size); "
                "use the model's own tokenizer",
            )  # fmt: skip

    def _check_memory(self, tenants: list[Tenant]) -> None:
        """Sizes that cannot fit one device: the tenants' own tensors. Each tenant's exist only for it,
        at its rank (nothing is allocated for free slots or for ``max_rank``), and are held whole on
        every data-parallel rank. An estimate, made to catch the absurd:

            need = sum over tenants of rank_t * F_t * 4 bytes * 4 (value, gradient, two AdamW moments)
                   F_t = sum over its linear layers of (in + out) + over its expert parameters E*(in + out)

        (The logits are not estimated: the loss is computed in chunks and never holds them whole.)
        """
        m = self.model
        mem = _device_memory() if m is not None else None
        if m is None or mem is None:
            return
        total, device = mem
        sizes = []  # (bytes, tenant, rank, features)
        for t in tenants:
            if not (_is_int(t.rank) and 1 <= t.rank <= MAX_SLOTS):
                continue
            chosen = _select_linear(m, t.target_modules) if _valid_targets(t.target_modules) else set()
            feats = sum(inn + out for n, inn, out in m.linear_shapes if n in chosen)
            params = t.target_parameters if _valid_targets(t.target_parameters) else []
            feats += sum(
                E * (inn + out)
                for n, E, out, inn in m.expert_shapes
                if any(name_matches(n, p) for p in params)
            )
            sizes.append((t.rank * feats * 16, t.name, t.rank, feats))
        need = sum(size for size, *_ in sizes)
        if need > total:
            gib = 2**30
            _, name, rank, feats = max(sizes)
            self._say(
                None, None,
                f"the tenants' adapters need about {need / gib:,.1f} GiB per device with their gradients and "
                f"AdamW state (rank x in+out features x 16 bytes, summed over tenants; the largest is "
                f"{_who(name)}: rank {rank} x {feats:,} features) but {device} has {total / gib:,.1f} GiB; "
                "lower ranks, target fewer layers, or start fewer tenants at once",
            )  # fmt: skip

    # -- targets -------------------------------------------------------------------------------

    def _resolve_modules(self, owner: Tenant | None, field: str, targets: list[str]) -> set[str] | None:
        """Full names of the linear layers ``targets`` select; reports unknown / non-linear targets."""
        m = self.model
        assert m is not None
        chosen: set[str] = set()
        if ALL_LINEAR in targets:  # alone, or with other names in slot_modules (the union)
            chosen = _select_linear(m, [ALL_LINEAR])
            if not chosen:
                self._say(owner, field, f"{field} '{ALL_LINEAR}' matches no linear layer in the model")
                return None
            targets = [t for t in targets if t != ALL_LINEAR]
        unknown: list[str] = []
        ok = True
        for target in targets:
            hits = [(n, cls) for n, cls in m.modules if name_matches(n, target)]
            if not hits:
                unknown.append(target)
                continue
            not_linear = [(n, cls) for n, cls in hits if n not in m.linear]
            if not_linear:
                n, cls = not_linear[0]
                self._say(
                    owner, field,
                    f"{field} {_brief(target)} matches modules that are not nn.Linear (e.g. {n}: {cls}); "
                    "LoRA goes on linear layers only",
                )  # fmt: skip
                ok = False
            chosen |= {n for n, _ in hits if n in m.linear}
        if unknown:
            self._say(
                owner,
                field,
                f"{field} not found in the model: {_names(unknown)} (available: {suffixes(m.linear)})",
            )
            ok = False
        return chosen if ok else None

    def _check_targets(self, t: Tenant) -> None:
        if self.model is None:
            return
        mods = t.target_modules
        if _valid_targets(mods) and mods:
            self._resolve_modules(t, "target_modules", mods)
        params = t.target_parameters
        if not (_valid_targets(params) and params):
            return
        unknown = [p for p in params if not any(name_matches(n, p) for n in self.model.experts)]
        if unknown:
            avail = (
                f"available: {suffixes(self.model.experts)}"
                if self.model.experts
                else "the model has no 3-D expert parameters"
            )
            self._say(
                t,
                "target_parameters",
                f"target_parameters not found in the model: {_names(unknown)} ({avail})",
            )
        elif _is_num(t.dropout) and t.dropout:
            self._say(
                t,
                "dropout",
                "dropout must be 0 with target_parameters (PEFT has no dropout on expert weights)",
            )

    def _check_slot_modules(self, tenants: list[Tenant]) -> None:
        slots = self.spec.slot_modules
        if self.model is None or slots is None or not _valid_targets(slots, union=True):
            return  # no model, no slot_modules, or a type problem already reported
        covered = self._resolve_modules(None, "slot_modules", slots) if slots else set()
        if covered is None:
            return
        for t in tenants:
            if not _valid_targets(t.target_modules):
                continue
            outside = [x for x in t.target_modules if _select_linear(self.model, [x]) - covered]
            if outside:
                self._say(
                    t, "target_modules",
                    f"target_modules {_names(outside)} not covered by slot_modules {_brief(list(slots))}; "
                    "add them to slot_modules",
                )  # fmt: skip

    # -- data ----------------------------------------------------------------------------------

    def _check_data(self, t: Tenant) -> None:
        for name in ("data", "eval_data"):
            path = getattr(t, name)
            if not _usable_path(path):
                continue  # a type or path problem, reported with the fields
            for tail in self._data_file_problems(path):
                self._say(t, name, name + tail, path=path)

    def _data_file_problems(self, path: str) -> list[str]:
        """The problems of one data file, each as the rest of a sentence that starts with the field's
        name (``": a.jsonl line 3: not valid JSON"``); served from the cache while the file, the
        tokenizer and ``seq_len`` stay the same."""
        seq_len = self.spec.seq_len
        if self.cache is None or not _is_int(seq_len):
            return self._scan_data_file(path)
        key = (_file_key(path), self._env_key(), self.tok is not None, seq_len)
        hit = self.cache._data.get(key)
        if hit is None:
            hit = self.cache._data[key] = self._scan_data_file(path)
        return hit

    def _scan_data_file(self, path: str) -> list[str]:
        from mlora_lab.data import scan_jsonl, target_problem

        seq_len = self.spec.seq_len
        report = scan_jsonl(path)
        tails = [f": {p}" for p in report.problems]
        if not report.problems and report.n_rows == 0:
            tails.append(f": {_show_path(path)}: no rows")
        no_template = (
            "messages" in report.kinds
            and self.tok is not None
            and not getattr(self.tok, "chat_template", None)
        )
        if no_template:
            tails.append(" has chat ('messages') rows but the tokenizer has no chat_template")
        if report.problems or not report.n_rows or no_template or self.tok is None:
            return tails
        if _is_int(seq_len) and field_info(JobSpec, "seq_len").allows(seq_len):
            # Tokenizes rows (each cut at seq_len) only until one keeps a target token: one row for
            # a usable file, every row only for a file the job would refuse anyway.
            why = target_problem(path, self.tok, seq_len)
            if why:
                tails.append(f": {why}")
        return tails

    # -- init_adapter --------------------------------------------------------------------------

    def _check_init_adapter(self, t: Tenant) -> None:
        path = t.init_adapter
        if not _usable_path(path):
            return
        cfg_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_file):
            self._say(
                t,
                "init_adapter",
                f"init_adapter {_brief(path)} is not a PEFT adapter directory (no adapter_config.json)",
            )
            return
        cfg, why = _read_json(cfg_file, "an adapter config")
        if why or not isinstance(cfg, dict):
            why = why or f"the top level is {_json_type(cfg)}, not a JSON object"
            self._say(t, "init_adapter", f"init_adapter {_show_path(cfg_file)}: {why}")
            return
        if cfg.get("peft_type", "LORA") != "LORA":
            self._say(
                t,
                "init_adapter",
                f"init_adapter is a {_brief(cfg.get('peft_type'))} adapter; only LORA is supported",
            )
            return
        weights = os.path.join(path, "adapter_model.safetensors")
        if not any(os.path.isfile(f) for f in (weights, os.path.join(path, "adapter_model.bin"))):
            self._say(t, "init_adapter", f"init_adapter {_brief(path)} has no adapter_model.safetensors")
        r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        rslora = bool(cfg.get("use_rslora", False))
        if not (_is_int(r) and r >= 1):
            self._say(
                t,
                "init_adapter",
                f"init_adapter has r={_brief(r)}, not a positive integer; save the adapter again",
            )
            r = None
        elif _is_int(self.spec.max_rank) and r > self.spec.max_rank:
            self._say(
                t, "max_rank", f"init_adapter has r={r} > max_rank={self.spec.max_rank}; raise max_rank"
            )
        if r is not None and r != t.rank:
            self._say(t, "rank", f"rank {_brief(t.rank)} differs from init_adapter r={r}; set rank={r}")
        if alpha != t.alpha:
            self._say(
                t, "alpha",
                f"alpha {_brief(t.alpha)} differs from init_adapter lora_alpha={_brief(alpha)}; "
                f"set alpha={_brief(alpha)}",
            )  # fmt: skip
        if rslora != t.use_rslora:
            self._say(
                t, "use_rslora",
                f"use_rslora {_brief(t.use_rslora)} differs from init_adapter use_rslora={rslora}; "
                f"set use_rslora={json.dumps(rslora)}",
            )  # fmt: skip
        self._compare_targets(t, "target_modules", cfg.get("target_modules"), t.target_modules)
        self._compare_targets(t, "target_parameters", cfg.get("target_parameters"), t.target_parameters)
        for key in ("rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                self._say(
                    t,
                    "init_adapter",
                    f"init_adapter has a non-empty {key}; per-layer ranks/alphas are not supported",
                )
        unsupported = {
            "use_dora": cfg.get("use_dora"),
            "bias": cfg.get("bias", "none") not in (None, "none"),
            "modules_to_save": cfg.get("modules_to_save"),
            "layers_to_transform": cfg.get("layers_to_transform") is not None,
        }
        for key, present in unsupported.items():
            if present:
                self._say(
                    t,
                    "init_adapter",
                    f"init_adapter uses {key}={_brief(cfg.get(key))}, which is not supported",
                )
        if os.path.isfile(weights):
            self._check_adapter_weights(t, weights, cfg, r)

    def _check_adapter_weights(self, t: Tenant, path: str, cfg: dict, r: int | None) -> None:
        """Compare the adapter's tensor shapes (from the safetensors header) with the base model:

            linear layer W [out, in]:           lora_A [r, in],   lora_B [out, r]
            packed experts W [E, out, in]:      lora_A [E*r, in], lora_B [out, E*r]  (PEFT's flattening)

        An adapter trained on another base (other widths, more layers) fails here, not in the job.
        """
        shapes, why = _safetensors_shapes(path)
        if why:
            self._say(
                t, "init_adapter",
                f"init_adapter weights {_show_path(path)} are not readable: {why}; save the adapter again",
            )  # fmt: skip
            return
        m = self.model
        if m is None:
            return
        linear = {n: (inn, out) for n, inn, out in m.linear_shapes}
        experts = {n: (E, out, inn) for n, E, out, inn in m.expert_shapes}
        targets = cfg.get("target_parameters")
        targets = [x for x in targets if isinstance(x, str)] if isinstance(targets, list) else []
        pairs: dict[str, dict[str, tuple[int, ...]]] = {}
        not_lora: list[str] = []
        for key, shape in shapes.items():
            name = key.removeprefix("base_model.model.")
            for part in ("lora_A", "lora_B"):
                # Saved adapters drop the adapter name; raw state dicts keep it (".lora_A.default.weight").
                if f".{part}." in name and name.endswith(".weight"):
                    pairs.setdefault(name[: name.index(f".{part}.")], {})[part] = shape
                    break
            else:
                not_lora.append(key)
        if not_lora:
            self._say(
                t,
                "init_adapter",
                f"init_adapter holds tensors that are not LoRA A/B weights: {_names(not_lora, 5)}",
            )
        elif not pairs:
            self._say(t, "init_adapter", f"init_adapter {_show_path(path)} holds no LoRA tensors")
        unknown: list[str] = []  # modules the base does not have
        wrong: list[str] = []  # shapes that do not fit the base
        broken: list[str] = []  # shapes that fit no base: a damaged adapter
        ranks: set[int] = set()
        for module in sorted(pairs):
            parts = pairs[module]
            if set(parts) != {"lora_A", "lora_B"}:
                broken.append(f"{module} has {'lora_A' if 'lora_A' in parts else 'lora_B'} without its pair")
                continue
            A, B = parts["lora_A"], parts["lora_B"]
            if len(A) != 2 or len(B) != 2:
                broken.append(f"{module}.lora_A is {list(A)} and lora_B is {list(B)}, not 2-D")
                continue
            if module in linear:
                inn, out, experts_n, label = *linear[module], 1, module.rsplit(".", 1)[-1]
            else:
                param = self._expert_param(module, targets)
                if param is None:
                    unknown.append(module)
                    continue
                experts_n, out, inn = experts[param]
                label = ".".join(param.split(".")[-2:])
            if A[1] != inn:
                wrong.append(f"{module}.lora_A is {list(A)} but {label} takes {inn} inputs")
            if B[0] != out:
                wrong.append(f"{module}.lora_B is {list(B)} but {label} gives {out} outputs")
            if A[0] != B[1]:
                broken.append(f"{module}.lora_A is {list(A)} but lora_B is {list(B)}: their ranks differ")
            elif experts_n > 1 and (A[0] % experts_n or (r is not None and A[0] != experts_n * r)):
                rank = f"{experts_n}*{r} = {experts_n * r}" if r is not None else f"{experts_n}*r"
                wrong.append(
                    f"{module}.lora_A is {list(A)} but {label} has {experts_n} experts (lora_A [{rank}, {inn}])"
                )
            elif experts_n == 1:
                ranks.add(A[0])
        if unknown:
            self._say(
                t, "init_adapter",
                f"init_adapter was made for another base model: it has weights for modules this base "
                f"model does not have: {_names(unknown, 5)}",
            )  # fmt: skip
        if wrong:
            self._say(
                t, "init_adapter", f"init_adapter was made for another base model: {wrong[0]}{_more(wrong)}"
            )
        if r is not None and ranks - {r}:
            broken.append(f"its weights have rank {_names(sorted(ranks))} but adapter_config.json says r={r}")
        if broken:
            self._say(
                t, "init_adapter",
                f"init_adapter {_show_path(path)} is inconsistent: {broken[0]}{_more(broken)}; save it again",
            )  # fmt: skip

    def _expert_param(self, module: str, targets: list[str]) -> str | None:
        """The 3-D parameter an expert LoRA key belongs to. PEFT nests one wrapper per targeted
        parameter of a module, the first-defined innermost: ``<module>(.base_layer)*d`` holds the
        parameter ``n - 1 - d`` of the ``n`` it targets there."""
        assert self.model is not None
        depth = 0
        while module.endswith(".base_layer"):
            module, depth = module[: -len(".base_layer")], depth + 1
        params = [n for n in self.model.experts if n.rpartition(".")[0] == module]
        targeted = [n for n in params if any(name_matches(n, t) for t in targets)]
        return targeted[len(targeted) - 1 - depth] if depth < len(targeted) else None

    def _compare_targets(self, t: Tenant, key: str, theirs: Any, ours: Any) -> None:
        if theirs is None:
            theirs_list: list[str] = []
        elif isinstance(theirs, str):
            theirs_list = [theirs]
        elif isinstance(theirs, list | tuple) and all(isinstance(x, str) for x in theirs):
            theirs_list = list(theirs)
        else:
            self._say(t, key, f"init_adapter {key} must be a list of names ({_got(theirs)})")
            return
        if not _valid_targets(ours) or set(theirs_list) == set(ours):
            return
        # Different spellings may select the same layers (PEFT saves "all-linear" expanded).
        m = self.model
        if m is not None and key == "target_modules" and _valid_targets(theirs_list):
            selected = _select_linear(m, theirs_list)
            if selected and selected == _select_linear(m, ours):
                return
        self._say(
            t, key,
            f"{key} {_brief(sorted(ours))} differs from init_adapter "
            f"{key}={_brief(sorted(theirs_list), 200)}; "
            f"set {key}={_brief(json.dumps(sorted(theirs_list)), 200)}",
        )  # fmt: skip


def _representative_configs(space: dict[str, Any]) -> list[dict[str, Any]]:
    """Configurations that between them take every choice and both ends of every range, each field
    varied from the first configuration (for checking every value a search can give a tenant)."""
    from mlora_lab.search import Choice

    def values(d: Any) -> list[Any]:
        if isinstance(d, Choice):
            return [list(v) if isinstance(v, tuple) else v for v in d.values]
        return [d.low, d.high]

    first = {name: values(d)[0] for name, d in space.items()}
    configs = [first]
    for name, d in space.items():
        for v in values(d)[1:]:
            configs.append({**first, name: v})
    return configs[:64]


def sweep_slot_modules(spec: JobSpec, sweep: Any) -> list[str]:
    """The slot modules a sweep's job needs: the union of the job's tenants', the base tenant's and
    every ``target_modules`` choice of the space (unless the job names its own)."""
    if spec.slot_modules is not None:
        return list(spec.slot_modules)
    names: list[str] = []
    targets = [t.target_modules for t in spec.tenants] + [sweep.base.target_modules]
    space_targets = sweep.space.get("target_modules")
    if space_targets is not None and hasattr(space_targets, "values"):
        targets += [list(v) for v in space_targets.values]
    for group in targets:
        for name in group if isinstance(group, list | tuple) else [group]:
            if name not in names:
                names.append(name)
    return names


def sweep_problems(spec: JobSpec, sweep: Any, cache: ValidationCache | None = None) -> list[Problem]:
    """Every problem of running ``sweep`` (a :class:`~mlora_lab.search.Sweep`) in the job ``spec``, at
    once: the search itself (:func:`~mlora_lab.search.search_problems`), the job with the base tenant as
    a trial, and the tenant every choice and both ends of every range would give (a rank above
    ``max_rank``, target modules the model lacks, a data file that cannot be read, ...)."""
    from mlora_lab.search import search_problems

    slots = (spec.max_tenants if _is_int(spec.max_tenants) else 0) - (
        len(spec.tenants) if isinstance(spec.tenants, list) else 0
    )
    max_rank = spec.max_rank if _is_int(spec.max_rank) else 0
    out = [Problem(None, "search", p) for p in search_problems(
        sweep.space, sweep.strategy, sweep.budget, sweep.objective, slots, max_rank)]  # fmt: skip
    if out:
        return out
    validator = Validator(cache or ValidationCache())
    configs = _representative_configs(sweep.space)
    job = dataclasses.replace(spec, slot_modules=sweep_slot_modules(spec, sweep))
    first = sweep.trial_tenant(0, configs[0])
    out += validator.problems(dataclasses.replace(job, tenants=[*spec.tenants, first]))
    seen = {str(p) for p in out}
    for i, config in enumerate(configs[1:], start=1):
        for p in validator.tenant_problems(job, sweep.trial_tenant(i, config)):
            text = str(p).replace(f"trial {sweep.prefix}{i:03d}", "a trial")
            if text not in seen:  # the same problem from several values is said once
                seen.add(text)
                out.append(p)
    return _capped(out)
