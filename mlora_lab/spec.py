"""What a job is: ``Tenant``, ``Parallel`` and ``JobSpec``, their JSON form, and their validation.

These are plain dataclasses that store names and paths, never live objects, so a spec round-trips
through ``job.json`` unchanged::

    spec = JobSpec(base_model="models/tiny", tenants=[Tenant(name="alice", data="alice.jsonl")])
    spec.to_json("run/job.json")                # atomic write
    spec = JobSpec.load("run/job.json")         # relative paths resolved against run/
    spec.validate()                             # raises SpecError listing *every* problem at once

``JobSpec.problems()`` never raises and starts no process: it reads the model's config (and builds
the model on the ``meta`` device, which allocates nothing), the tokenizer, the tenants' data files
(tokenized until one row keeps a target token at ``seq_len``) and the headers of any
``init_adapter`` weights, so bad input is reported before anything is launched.
``JobSpec.problems(files=False)`` checks only the fields, names, parallel layout and tenant set,
reading no file: cheap enough for the training process to re-check the ``job.json`` it starts from.

Everything here treats its input as hostile: any JSON (or Python values in the fields) gives
``SpecError`` or a list of problems, never another exception, and a message repeats at most ~80
characters of a bad value.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import reprlib
import stat
from dataclasses import dataclass, field
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

SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate schedules a tenant may use; every one starts with ``warmup_steps`` of linear warmup."""

DTYPES = ("float32", "bfloat16", "float16")
"""Base-model dtypes a job may run in."""

MAX_NAME_LEN = 100
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")

# Upper bounds of the integer fields: far above any real job, low enough that nothing downstream
# overflows (int64 tensors, float64 JSON readers, torch / random seeding).
MAX_SEED = 2**63 - 1
"""Seeds are in ``[0, 2**63)``: ``torch.manual_seed`` takes ``[-2**63, 2**64)``, ``random.Random`` any int."""
MAX_COUNT = 2**53 - 1
"""Steps and every-N fields: the largest integer a float64 (a JSON reader) holds exactly."""
MAX_ROWS = 2**20
"""Rows per optimizer step (``batch_size * grad_accum``): more is a typo, not a job."""
MAX_SEQ_LEN = 2**24
MAX_SLOTS = 2**16
"""``max_tenants`` and ``max_rank``."""
MAX_DEGREE = 2**20
"""Every ``parallel`` field."""
MAX_TARGETS = 10_000
"""Entries of ``target_modules`` / ``target_parameters`` / ``slot_modules`` (each at most 1000 characters)."""
MAX_PROBLEMS = 200
"""``problems()`` lists at most this many, then ``... and N more problem(s)``."""
_MAX_JSON_BYTES = 64 * 2**20  # job.json, adapter_config.json, *.index.json: a few KB in real life
_MAX_DEPTH = 16  # job.json nests 3 deep (tenants[i].betas); 16 leaves room and stops RecursionError


class SpecError(ValueError):
    """A job spec with problems; ``problems`` lists every one and ``str()`` shows them, one per line."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        n = len(self.problems)
        super().__init__(
            f"invalid job spec ({n} problem{'s' if n != 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in self.problems)
        )


# ---------------------------------------------------------------------------------------------
# The dataclasses
# ---------------------------------------------------------------------------------------------


def _path_str(value: Any) -> Any:
    """``os.PathLike`` -> ``str`` (so ``pathlib.Path`` arguments serialise); anything else unchanged."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@dataclass
class Tenant:
    """One LoRA adapter trained in the job: its data, its LoRA shape and its own optimizer settings."""

    name: str
    """Unique name; it becomes a directory name (``adapters/<name>/``), so only ``[A-Za-z0-9._-]``."""
    data: str
    """Training data: a JSONL file of ``text``, ``prompt``/``completion`` or ``messages`` rows."""
    eval_data: str | None = None
    """Optional held-out JSONL file (same format), evaluated every ``JobSpec.eval_every`` steps."""
    init_adapter: str | None = None
    """Optional PEFT LoRA adapter directory to start from; its r, alpha, rsLoRA and targets must match."""
    rank: int = 8
    """LoRA rank r (1 .. ``JobSpec.max_rank``)."""
    alpha: float = 16
    """LoRA alpha; the delta is scaled by :attr:`scaling`."""
    use_rslora: bool = False
    """rsLoRA: scale by ``alpha / sqrt(rank)`` instead of ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Linear layers to adapt, matched as PEFT does (full name or ``.``-suffix), or ``["all-linear"]`` (every
    ``nn.Linear`` but the output layer); the rules live in :mod:`mlora_lab.lora.targets`."""
    target_parameters: list[str] = field(default_factory=list)
    """3-D packed MoE expert parameters to adapt (e.g. ``mlp.experts.gate_up_proj``), PEFT-style."""
    lr: float = 2e-4
    """Peak learning rate of this tenant's AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (a JSON list in ``job.json``)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: str = "constant"
    """Learning-rate schedule after warmup: ``"constant"``, ``"linear"`` or ``"cosine"`` (decay to 0)."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to ``lr``."""
    max_grad_norm: float | None = 1.0
    """Clip this tenant's gradient norm to this value; ``None`` disables clipping."""
    batch_size: int = 4
    """Rows of this tenant in each micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    max_steps: int = 100
    """Optimizer steps after which this tenant is finished (its adapter is saved and its slot idles)."""
    shuffle: bool = True
    """Shuffle the rows every epoch (seeded by ``seed``)."""
    seed: int = 0
    """Seed of this tenant's LoRA init, dropout and data order."""

    def __post_init__(self) -> None:
        self.data = _path_str(self.data)
        self.eval_data = _path_str(self.eval_data)
        self.init_adapter = _path_str(self.init_adapter)
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA (as PEFT)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (``betas`` as a list)."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas) if isinstance(self.betas, tuple | list) else self.betas
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Tenant) -> Tenant:
        """Build from a dict (e.g. one ``tenants`` entry of ``job.json``); unknown keys raise ``SpecError``.

        Any input gives a ``Tenant`` or ``SpecError``, nothing else; field values are not checked here
        (``JobSpec.problems()`` does that) except for nesting too deep to copy."""
        kwargs, problems = _kwargs_for(cls, d, "tenant")
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Tenant) else cls(**kwargs)


@dataclass
class Parallel:
    """How the job is laid out over processes: ``fsdp * tp`` must divide ``world_size``, and ``ep``
    the ``world_size / tp`` data-parallel ranks (expert parallelism borrows from them)."""

    nproc: int = 1
    """Processes (ranks) per node."""
    nnodes: int = 1
    """Nodes."""
    fsdp: int = 1
    """FSDP2 shard-group size (data parallel over the rest)."""
    tp: int = 1
    """Tensor-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE models): groups of ``ep`` data-parallel ranks split the experts."""

    @property
    def world_size(self) -> int:
        """Total number of ranks: ``nproc * nnodes``."""
        return self.nproc * self.nnodes

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Parallel) -> Parallel:
        """Build from a dict; unknown keys raise ``SpecError`` (and any input gives a ``Parallel`` or
        ``SpecError``)."""
        kwargs, problems = _kwargs_for(cls, d, "parallel")
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Parallel) else cls(**kwargs)


@dataclass
class JobSpec:
    """A whole job: one frozen base model, its tenants, and the job-wide settings. ``= job.json``."""

    base_model: str
    """Local directory of a transformers causal LM (``save_pretrained`` layout), or a ``.gguf`` file (or a
    directory holding one ``.gguf`` and no ``config.json``), converted once into a cache by
    ``mlora_lab.bases.resolve_base``; nothing is downloaded."""
    tenants: list[Tenant]
    """The tenants to train (may be empty with ``serve=True``)."""
    tokenizer: str | None = None
    """Tokenizer directory; ``None`` = ``base_model``."""
    seq_len: int = 512
    """Rows are truncated to this many tokens (with a warning) and right-padded."""
    max_tenants: int = 8
    """The most tenants the job can hold at once (a limit: a free slot allocates nothing)."""
    max_rank: int = 64
    """The largest rank a tenant (present or added later) may have (a limit: each tenant's tensors have
    its own rank)."""
    parallel: Parallel = field(default_factory=Parallel)
    """Process layout (ranks, FSDP / TP / EP degrees)."""
    dtype: str = "float32"
    """dtype of the frozen base: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    log_every: int = 1
    """Write train metrics every this many steps."""
    eval_every: int = 0
    """Evaluate tenants with ``eval_data`` every this many steps; 0 = never (only at the end)."""
    save_every: int = 0
    """Save adapters and a checkpoint every this many steps; 0 = only at the end."""
    serve: bool = False
    """Stay up after all tenants finish, waiting for tenants added from the notebook."""
    seed: int = 0
    """Job-wide seed (batch mixing order)."""
    output_dir: str | None = None
    """Run directory; ``None`` = a new directory under ``runs/`` chosen at launch."""
    activation_checkpointing: bool | int = 0
    """Recompute decoder blocks' activations in the backward instead of keeping them: 0 (or false) =
    off, 1 (or true) = every block, k = every k-th block (blocks 0, k, 2k, ...)."""
    packing: bool = False
    """Pack each tenant's rows into ``seq_len``-token sequences (documents kept whole and apart: position
    ids restart and no token attends across a document boundary) instead of one right-padded row each;
    ``batch_size`` then counts packed sequences."""
    slot_modules: list[str] | None = None
    """Linear layers that can take adapters (same matching as ``target_modules``, except that
    ``"all-linear"`` may come with other names: the union); ``None`` = the union of the tenants'
    ``target_modules``. Set it so that tenants added later may target modules no initial tenant uses
    (the layers are wrapped once, when the job starts; wrapping allocates nothing per tenant)."""

    def __post_init__(self) -> None:
        self.base_model = _path_str(self.base_model)
        self.tokenizer = _path_str(self.tokenizer)
        self.output_dir = _path_str(self.output_dir)

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, field order as in ``job.json``."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "tenants":
                value = [t.to_dict() if isinstance(t, Tenant) else copy.deepcopy(t) for t in value]
            elif f.name == "parallel":
                value = value.to_dict() if isinstance(value, Parallel) else copy.deepcopy(value)
            else:
                value = copy.deepcopy(value)
            d[f.name] = value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        """Build from a dict (``tenants`` as dicts or ``Tenant``, ``parallel`` as a dict or ``Parallel``).

        Unknown or missing keys, at any level, raise one ``SpecError`` naming all of them; any input
        gives a ``JobSpec`` or ``SpecError``, nothing else.
        """
        kwargs, problems = _kwargs_for(cls, d, "job")
        tenants = kwargs.get("tenants")
        if "tenants" in kwargs and not isinstance(tenants, list):
            problems.append(f"tenants must be a list (got {type(tenants).__name__})")
        elif isinstance(tenants, list):
            built: list[Tenant] = []
            for i, t in enumerate(tenants):
                label = f"tenants[{i}]" + (
                    f" ({_brief(t['name'])})" if isinstance(t, dict) and "name" in t else ""
                )
                t_kwargs, t_problems = _kwargs_for(Tenant, t, label)
                problems += t_problems
                if not t_problems:
                    built.append(t if isinstance(t, Tenant) else Tenant(**t_kwargs))
            kwargs["tenants"] = built
        if "parallel" in kwargs:
            p_kwargs, p_problems = _kwargs_for(Parallel, kwargs["parallel"], "parallel")
            problems += p_problems
            if not p_problems and not isinstance(kwargs["parallel"], Parallel):
                kwargs["parallel"] = Parallel(**p_kwargs)
        if problems:
            raise SpecError(problems)
        return cls(**kwargs)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The spec as JSON text (indent 2); with ``path``, also write it there atomically."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            from mlora_lab.rundir.files import atomic_write_text  # the one atomic write (rundir owns files)

            atomic_write_text(path, text + "\n")
        return text

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        """Parse ``job.json`` text; bad JSON or bad keys raise ``SpecError``. Paths are kept as written."""
        parsed = _json_problem(text)
        if isinstance(parsed, str):
            raise SpecError(f"job spec is not valid JSON: {parsed}")
        return cls.from_dict(parsed[0])

    @classmethod
    def load(cls, path: str | os.PathLike) -> JobSpec:
        """Read a ``job.json`` file; relative paths in it are relative to the file's directory.

        Every way the file can be wrong (missing, a directory or device, not UTF-8, not JSON, not a
        JSON object, bad keys) raises one ``SpecError`` that names the file.
        """
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            raise SpecError(f"job file must be a path (got {type(path).__name__})") from None
        name = _show_path(path)
        d, why = _read_json(path, "a job file")
        if why:
            raise SpecError(f"{name}: {why}")
        if not isinstance(d, dict):
            raise SpecError(
                f"{name}: the top level must be a JSON object with base_model and tenants (got {_json_type(d)})"
            )
        return cls.from_dict(d).resolved(os.path.dirname(os.path.abspath(path)))

    def resolved(self, base_dir: str | os.PathLike) -> JobSpec:
        """A copy whose relative paths (base_model, tokenizer, data, eval_data, init_adapter) are made
        absolute against ``base_dir``; absolute paths and ``None`` are kept."""
        base = os.path.abspath(os.fspath(base_dir))
        out = copy.deepcopy(self)
        out.base_model = _resolve(out.base_model, base)
        out.tokenizer = _resolve(out.tokenizer, base)
        for t in out.tenants:
            if isinstance(t, Tenant):
                t.data = _resolve(t.data, base)
                t.eval_data = _resolve(t.eval_data, base)
                t.init_adapter = _resolve(t.init_adapter, base)
        return out

    # -- lookup and validation -----------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name``; ``KeyError`` naming the known tenants otherwise."""
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(f"no tenant {name!r}; tenants: {[t.name for t in self.tenants]}")

    def problems(self, files: bool = True) -> list[str]:
        """Every problem with this spec, each naming its tenant and field. Never raises; starts no
        process. Checks that need the model are skipped when the model cannot be loaded.

        ``files=False`` runs only the checks of the fields, names, parallel layout and tenant set:
        no model, tokenizer, data or adapter file is read.
        """
        try:
            return _capped(_Validator(self).run(files=files))
        except Exception as e:  # "never raises": a bug in a check is still reported, not thrown
            return [f"internal error while validating the spec ({type(e).__name__}: {_short(e)})"]

    def validate(self, files: bool = True) -> JobSpec:
        """Return ``self`` if the spec has no problems, else raise ``SpecError`` listing all of them."""
        problems = self.problems(files=files)
        if problems:
            raise SpecError(problems)
        return self


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


def effective_slot_modules(job: JobSpec) -> list[str]:
    """The linear-layer names that get adapter slots: ``slot_modules``, else the union of the
    tenants' targets (``"all-linear"`` first if any tenant asks for it, then the names other tenants
    give: one may name a layer all-linear leaves out, the output layer). Targets that are not valid
    lists of names (a spec that does not validate) are left out rather than raised on."""
    slots = job.slot_modules
    if slots and isinstance(slots, list | tuple):
        names = [m for m in slots if isinstance(m, str)]
    else:
        tenants = job.tenants if isinstance(job.tenants, list | tuple) else []
        targets = [t.target_modules for t in tenants if isinstance(t, Tenant)]
        names = sorted({m for ts in targets if _valid_targets(ts) for m in ts})
    if ALL_LINEAR not in names:
        return list(names)
    return [ALL_LINEAR, *(n for n in names if n != ALL_LINEAR)]


def tenant_problems(job: JobSpec, tenant: Tenant) -> list[str]:
    """Problems of adding ``tenant`` to the job ``job`` while it runs: the tenant's own fields and files,
    checked against the job's model, tokenizer, ``max_rank``, adapter slots and tenant names. Never raises."""
    if not isinstance(tenant, Tenant):
        return [f"tenant must be a Tenant (got {type(tenant).__name__})"]
    try:
        probe = dataclasses.replace(
            job, tenants=[tenant], slot_modules=effective_slot_modules(job), serve=False,
            parallel=Parallel(), output_dir=None,
        )  # fmt: skip
        # The probe holds only this tenant and the job's settings (valid: the job runs with them), so
        # every problem it finds is one of adding this tenant.
        out = probe.problems()
        # Names are never reused (job.json lists every tenant the run has had, removed ones included),
        # and a name equal up to case collides with that tenant's adapter directory.
        if isinstance(tenant.name, str) and isinstance(job.tenants, list):
            for other in job.tenants:
                name = other.name if isinstance(other, Tenant) else None
                if name == tenant.name:
                    out.append(
                        f"{_who(tenant.name)}: a tenant of that name already exists in this run (names are never reused)"
                    )
                elif isinstance(name, str) and name.lower() == tenant.name.lower():
                    out.append(_case_problem(tenant.name, name, existing=True))
        return out
    except Exception as e:  # same promise as JobSpec.problems()
        return [f"internal error while validating the tenant ({type(e).__name__}: {_short(e)})"]


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


def _valid_targets(v: Any, union: bool = False) -> bool:
    """A list of at most ``MAX_TARGETS`` non-empty names (each at most 1000 characters), with
    ``"all-linear"`` only on its own, as PEFT takes it; with ``union`` (``slot_modules``, which PEFT
    never sees) ``"all-linear"`` may come with other names and the list selects the union."""
    if not isinstance(v, list | tuple) or len(v) > MAX_TARGETS:
        return False
    if not all(isinstance(x, str) and 0 < len(x) <= 1000 for x in v):
        return False
    return union or ALL_LINEAR not in v or len(v) == 1


def _select_linear(info: _ModelInfo, targets: list[str] | tuple[str, ...]) -> set[str]:
    """Full names of the linear layers that ``targets`` (valid per :func:`_valid_targets`) select."""
    return set(match_targets(sorted(info.linear), list(targets), info.all_linear))


# ---------------------------------------------------------------------------------------------
# Showing hostile values, reading hostile files
# ---------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """A real number that is neither inf nor nan; an int too large for a float (10**400) is not."""
    if not _is_num(v):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 40, 40, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def _brief(v: Any, limit: int = 80) -> str:
    """``repr(v)`` in at most about ``limit`` characters: a message never repeats a hostile value
    whole (a 10-MB name, a 10**400 seed), and never fails on one."""
    try:
        if isinstance(v, str):
            r = repr(v[: limit + 1])  # slice first: a 10-MB string is never copied into a repr
            if len(v) <= limit and len(r) <= limit + 2:
                return r
            return r[: limit - 3] + "..." + (f" ({len(v):,} characters)" if len(v) > limit else "")
        if _is_int(v) and v.bit_length() > 200:
            return f"{'-' if v < 0 else ''}a {int(v.bit_length() * math.log10(2)) + 1}-digit integer"
        r = _REPR.repr(v)
        return r if len(r) <= limit else r[: limit - 3] + "..."
    except Exception:  # a value whose repr fails or is refused (an int past Python's digit limit)
        return f"<{type(v).__name__}>"


def _got(v: Any) -> str:
    return f"got {_brief(v)} of type {type(v).__name__}"


def _who(name: Any) -> str:
    """How messages name a tenant: ``tenant 'alice'`` (a valid name is never shortened)."""
    return f"tenant {_brief(name, MAX_NAME_LEN + 2)}"


def _names(items: list[Any], n: int = 10) -> str:
    """``a, b, c and 7 more``: a list in a message, at most ``n`` entries, each shortened."""
    shown = [x if isinstance(x, str) and len(x) <= 120 and x.isprintable() else _brief(x) for x in items[:n]]
    return ", ".join(shown) + (f" and {len(items) - n} more" if len(items) > n else "")


def _more(items: list[str]) -> str:
    """`` (and N more)`` after the first of ``items`` is shown."""
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _short(e: BaseException, limit: int = 300) -> str:
    try:
        text = str(e).strip()
    except Exception:
        text = ""
    text = text.splitlines()[0] if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _capped(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    return [*problems[:MAX_PROBLEMS], f"... and {len(problems) - MAX_PROBLEMS} more problem(s)"]


def _path_problem(path: str) -> str | None:
    """Why the string ``path`` cannot name a file at all, or ``None``: a NUL byte (the OS would cut
    the name there), more than 4096 characters (PATH_MAX), or a lone surrogate (``"\ud800"`` from
    JSON: it has no bytes, so no file is called that)."""
    if "\0" in path:
        return "contains a NUL byte, which no file name can hold"
    if len(path) > 4096:
        return f"is {len(path):,} characters long (at most 4096)"
    try:
        os.fsencode(path)
    except UnicodeEncodeError as e:
        return f"contains a lone surrogate (\\u{ord(path[e.start]):04x}), which is not valid text"
    return None


def _usable_path(v: Any) -> bool:
    """A non-empty string that can name a file (type and path problems are reported elsewhere)."""
    return isinstance(v, str) and bool(v) and _path_problem(v) is None


def _show_path(path: Any) -> str:
    """A file name as messages show it: as is when it is short, printable text, else a shortened repr."""
    text = path if isinstance(path, str) else str(path)
    if len(text) <= 240 and text.isprintable() and _path_problem(text) is None:
        return text
    return _brief(text)


def _json_type(v: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "true/false", type(None): "null"}
    return names.get(type(v), "a number" if _is_num(v) else type(v).__name__)


def _json_problem(text: Any) -> tuple[Any] | str:
    """``(value,)`` of JSON ``text``, or why it is not JSON (with the line and column)."""
    try:
        return (json.loads(text),)
    except json.JSONDecodeError as e:
        return f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        return "nested too deeply"
    except (ValueError, TypeError) as e:
        if "integer string conversion" in str(e):  # Python refuses ints of more than 4300 digits
            return "a number has more than 4300 digits"
        return _short(e)


def _read_json(path: str, what: str) -> tuple[Any, str | None]:
    """``(value, None)`` from the JSON file ``path``, or ``(None, why)``: missing, not a regular file
    (a directory, a device such as /dev/zero, a FIFO that would block), too large, not UTF-8, not JSON."""
    why = _path_problem(path)
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
    if st.st_size > _MAX_JSON_BYTES:
        return None, f"is {st.st_size / 2**20:.0f} MiB, too large for {what} (at most 64 MiB)"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_JSON_BYTES + 1)
    except OSError as e:
        return None, f"cannot read it ({e.strerror or e})"
    if len(raw) > _MAX_JSON_BYTES:
        return None, f"is too large for {what} (at most 64 MiB)"
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at position {e.start})"
    parsed = _json_problem(text)
    if isinstance(parsed, str):
        return None, f"not valid JSON ({parsed})"
    return parsed[0], None


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


def _case_problem(name: str, other: str, existing: bool = False) -> str:
    return (
        f"{_who(name)}: name differs from {'existing tenant ' if existing else ''}{_brief(other)} only in "
        "case; their adapters/<name> directories collide on case-insensitive filesystems (macOS, "
        "Windows): rename one"
    )


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class _Validator:
    """Collects every problem of one ``JobSpec``; each ``_check_*`` appends to ``self.out``."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.out: list[str] = []
        self.model: _ModelInfo | None = None
        self.tok: Any = None
        self.layout_ok = False
        """``parallel`` is a valid layout (the TP / EP checks against the model need one)."""

    def run(self, files: bool = True) -> list[str]:
        s = self.spec
        self._check_job_fields()
        self._check_parallel()
        tenants = s.tenants if isinstance(s.tenants, list) else []
        if not isinstance(s.tenants, list):
            self.out.append(f"tenants must be a list of Tenant (got {type(s.tenants).__name__})")
        good = []
        for i, t in enumerate(tenants):
            if isinstance(t, Tenant):
                good.append(t)
            else:
                self.out.append(f"tenants[{i}] must be a Tenant (got {type(t).__name__})")
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

    # -- generic field checks ------------------------------------------------------------------

    def _int(
        self, where: str, name: str, v: Any, lo: int | None = None, hi: int | None = None, hi_name: str = ""
    ) -> bool:
        if not _is_int(v):
            self.out.append(f"{where}{name} must be an integer ({_got(v)})")
        elif lo is not None and v < lo:
            self.out.append(f"{where}{name} must be >= {lo} (got {_brief(v)})")
        elif hi is not None and v > hi:
            self.out.append(f"{where}{name} must be <= {hi_name or hi} (got {_brief(v)})")
        else:
            return True
        return False

    def _num(self, where: str, name: str, v: Any, rule: str, ok: Any) -> None:
        """A finite real number for which ``ok(v)`` holds; ``rule`` says what that means."""
        if not _is_finite(v):
            self.out.append(f"{where}{name} must be a finite number ({_got(v)})")
        elif not ok(v):
            self.out.append(f"{where}{name} must be {rule} (got {_brief(v)})")

    def _bool(self, where: str, name: str, v: Any) -> None:
        if not isinstance(v, bool):
            self.out.append(f"{where}{name} must be true or false ({_got(v)})")

    def _str(self, where: str, name: str, v: Any, optional: bool = False) -> bool:
        if v is None and optional:
            return True
        if not isinstance(v, str) or not v:
            kind = "a non-empty string or null" if optional else "a non-empty string"
            self.out.append(f"{where}{name} must be {kind} ({_got(v)})")
            return False
        return True

    def _path(self, where: str, name: str, v: Any, optional: bool = False) -> bool:
        """A string that can name a file (``None`` allowed when ``optional``)."""
        if not self._str(where, name, v, optional):
            return False
        why = _path_problem(v) if isinstance(v, str) else None
        if why:
            self.out.append(f"{where}{name} path {why}")
            return False
        return True

    def _one_of(self, where: str, name: str, v: Any, choices: tuple[str, ...]) -> None:
        if not (isinstance(v, str) and v in choices):
            self.out.append(f"{where}{name} must be one of {', '.join(choices)} (got {_brief(v)})")

    def _str_list(self, where: str, name: str, v: Any, union: bool = False) -> bool:
        if _valid_targets(v, union):
            return True
        strings = isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v)
        if isinstance(v, list | tuple) and len(v) > MAX_TARGETS:
            self.out.append(f"{where}{name} has {len(v):,} entries (at most {MAX_TARGETS:,})")
        elif strings and any(len(x) > 1000 for x in v):
            self.out.append(f"{where}{name}: every entry must be at most 1000 characters (a module name)")
        elif strings:
            self.out.append(f"{where}{name}: '{ALL_LINEAR}' must be the only entry (got {_brief(list(v))})")
        else:
            self.out.append(f"{where}{name} must be a list of non-empty strings ({_got(v)})")
        return False

    # -- job-level -----------------------------------------------------------------------------

    def _check_job_fields(self) -> None:
        s = self.spec
        self._path("", "base_model", s.base_model)
        self._path("", "tokenizer", s.tokenizer, optional=True)
        self._int("", "seq_len", s.seq_len, lo=2, hi=MAX_SEQ_LEN, hi_name="2**24")
        self._int("", "max_tenants", s.max_tenants, lo=1, hi=MAX_SLOTS, hi_name="2**16")
        self._int("", "max_rank", s.max_rank, lo=1, hi=MAX_SLOTS, hi_name="2**16")
        self._one_of("", "dtype", s.dtype, DTYPES)
        self._int("", "log_every", s.log_every, lo=1, hi=MAX_COUNT, hi_name="2**53 - 1")
        self._int("", "eval_every", s.eval_every, lo=0, hi=MAX_COUNT, hi_name="2**53 - 1")
        self._int("", "save_every", s.save_every, lo=0, hi=MAX_COUNT, hi_name="2**53 - 1")
        self._bool("", "serve", s.serve)
        self._bool("", "packing", s.packing)
        if not isinstance(s.activation_checkpointing, bool):
            self._int("", "activation_checkpointing", s.activation_checkpointing, lo=0, hi=MAX_SLOTS,
                      hi_name="2**16")  # fmt: skip
        self._int("", "seed", s.seed, lo=0, hi=MAX_SEED, hi_name="2**63 - 1")
        out_ok = self._path("", "output_dir", s.output_dir, optional=True) and s.output_dir is not None
        if out_ok and os.path.exists(s.output_dir) and not os.path.isdir(s.output_dir):
            self.out.append(f"output_dir {_brief(s.output_dir)} exists and is not a directory")
        if s.slot_modules is not None:
            self._str_list("", "slot_modules", s.slot_modules, union=True)

    def _check_parallel(self) -> None:
        p = self.spec.parallel
        if not isinstance(p, Parallel):
            self.out.append(f"parallel must be a Parallel (got {type(p).__name__})")
            return
        names = ("nproc", "nnodes", "fsdp", "tp", "ep")
        ok = [
            self._int("", f"parallel.{n}", getattr(p, n), lo=1, hi=MAX_DEGREE, hi_name="2**20") for n in names
        ]
        if not all(ok):
            return
        self.layout_ok = True
        group = p.fsdp * p.tp
        if p.world_size % group:
            self.out.append(
                f"parallel: fsdp*tp = {p.fsdp}*{p.tp} = {group} must divide "
                f"nproc*nnodes = {p.nproc}*{p.nnodes} = {p.world_size}"
            )
        elif (p.world_size // p.tp) % p.ep:
            self.out.append(
                f"parallel: ep = {p.ep} must divide the data-parallel ranks (nproc*nnodes/tp = "
                f"{p.world_size // p.tp}); expert parallelism splits the experts over groups of them"
            )

    def _check_tensor_parallel(self) -> None:
        """``tp > 1`` needs the model's TP plan and dimensions that split evenly over ``tp`` ranks."""
        p = self.spec.parallel
        if self.model is None or not self.layout_ok or p.tp <= 1:
            return
        self.out.extend(_tp_problems(os.path.abspath(self.spec.base_model), p.tp))

    def _check_expert_parallel(self) -> None:
        """``ep > 1`` needs packed experts that split evenly over ``ep`` ranks."""
        p = self.spec.parallel
        if self.model is None or not self.layout_ok or p.ep <= 1:
            return
        if not self.model.expert_modules:
            self.out.append(f"parallel.ep = {p.ep}, but the model has no packed (3-D) expert parameters")
            return
        name, n, problem = self.model.expert_modules[0]
        if problem:
            self.out.append(f"parallel.ep = {p.ep}: experts module {name} {problem}")
        elif n % p.ep:
            self.out.append(f"parallel.ep = {p.ep} does not divide the {n} experts of each MoE layer")

    def _check_tenant_set(self, tenants: list[Any]) -> None:
        s = self.spec
        if not tenants and s.serve is not True:
            self.out.append("no tenants: add at least one, or set serve=true to wait for tenants")
        if _is_int(s.max_tenants) and len(tenants) > s.max_tenants:
            self.out.append(
                f"{len(tenants)} tenants but max_tenants={_brief(s.max_tenants)}; raise max_tenants"
            )
        names = [t.name for t in tenants if isinstance(t, Tenant) and isinstance(t.name, str)]
        counts = collections.Counter(names)  # not names.count(): quadratic in a hostile tenant list
        for dup in sorted(n for n, c in counts.items() if c > 1):
            self.out.append(f"tenant name {_brief(dup)} is used {counts[dup]} times; names must be unique")
        # Equal up to case: two directories on a case-sensitive filesystem, one on macOS / Windows.
        first: dict[str, str] = {}
        for name in counts:
            other = first.setdefault(name.lower(), name)
            if other != name:
                self.out.append(_case_problem(name, other))

    # -- tenant fields -------------------------------------------------------------------------

    def _check_tenant_fields(self, t: Tenant) -> None:
        w = f"{_who(t.name)}: "
        self._check_name(t.name)
        self._path(w, "data", t.data)
        self._path(w, "eval_data", t.eval_data, optional=True)
        self._path(w, "init_adapter", t.init_adapter, optional=True)
        max_rank = self.spec.max_rank
        if _is_int(max_rank) and 1 <= max_rank <= MAX_SLOTS:
            self._int(w, "rank", t.rank, lo=1, hi=max_rank, hi_name=f"max_rank={max_rank}")
        else:  # max_rank itself is reported
            self._int(w, "rank", t.rank, lo=1, hi=MAX_SLOTS, hi_name="2**16")
        self._num(w, "alpha", t.alpha, "> 0", lambda v: v > 0)
        self._bool(w, "use_rslora", t.use_rslora)
        self._num(w, "dropout", t.dropout, "in [0, 1)", lambda v: 0 <= v < 1)
        ok_modules = self._str_list(w, "target_modules", t.target_modules)
        ok_params = self._str_list(w, "target_parameters", t.target_parameters)
        if ok_modules and ok_params and not t.target_modules and not t.target_parameters:
            self.out.append(f"{w}target_modules and target_parameters are both empty; nothing to adapt")
        self._num(w, "lr", t.lr, "> 0", lambda v: v > 0)
        self._num(w, "weight_decay", t.weight_decay, ">= 0", lambda v: v >= 0)
        if not (isinstance(t.betas, tuple | list) and len(t.betas) == 2):
            self.out.append(f"{w}betas must be a pair of numbers in [0, 1) ({_got(t.betas)})")
        else:
            for i, b in enumerate(t.betas):
                self._num(w, f"betas[{i}]", b, "in [0, 1)", lambda v: 0 <= v < 1)
        self._num(w, "eps", t.eps, "> 0", lambda v: v > 0)
        self._one_of(w, "schedule", t.schedule, SCHEDULES)
        self._int(w, "warmup_steps", t.warmup_steps, lo=0, hi=MAX_COUNT, hi_name="2**53 - 1")
        if t.max_grad_norm is not None:
            self._num(
                w, "max_grad_norm", t.max_grad_norm, "> 0 (or null to disable clipping)", lambda v: v > 0
            )
        bs_ok = self._int(w, "batch_size", t.batch_size, lo=1, hi=MAX_ROWS, hi_name="2**20")
        ga_ok = self._int(w, "grad_accum", t.grad_accum, lo=1, hi=MAX_ROWS, hi_name="2**20")
        if bs_ok and ga_ok and t.batch_size * t.grad_accum > MAX_ROWS:
            self.out.append(
                f"{w}batch_size*grad_accum = {t.batch_size}*{t.grad_accum} = {t.batch_size * t.grad_accum:,} "
                f"rows per optimizer step is more than {MAX_ROWS:,} (2**20); lower batch_size or grad_accum"
            )
        self._int(w, "max_steps", t.max_steps, lo=1, hi=MAX_COUNT, hi_name="2**53 - 1")
        self._bool(w, "shuffle", t.shuffle)
        self._int(w, "seed", t.seed, lo=0, hi=MAX_SEED, hi_name="2**63 - 1")

    def _check_name(self, name: Any) -> None:
        if not isinstance(name, str):
            self.out.append(f"tenant name must be a string ({_got(name)})")
            return
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
                f"{_who(name)}: name is not a safe directory name ({why}); "
                f"use 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ -"
            )

    # -- model and tokenizer -------------------------------------------------------------------

    def _load_model_and_tokenizer(self) -> None:
        s = self.spec
        base_ok = False
        if _usable_path(s.base_model):
            if is_gguf(s.base_model):
                base_ok = self._load_gguf(s.base_model)
            elif not os.path.isdir(s.base_model):
                self.out.append(
                    f"base_model {_brief(s.base_model)} is not a local directory (give the directory of a "
                    "model saved with save_pretrained, or a .gguf file; nothing is downloaded)"
                )
            else:
                base_ok = self._load_model(s.base_model)
        tok_path = s.tokenizer if s.tokenizer is not None else s.base_model
        field_name = "tokenizer" if s.tokenizer is not None else "tokenizer (base_model)"
        if not _usable_path(tok_path) or (s.tokenizer is None and not base_ok):
            return  # already reported (bad type or path, or the base_model problem covers it)
        gguf_tok = is_gguf(tok_path)
        if not gguf_tok and not os.path.isdir(tok_path):
            self.out.append(f"{field_name} {_brief(tok_path)} is not a local directory")
            return
        try:
            from transformers import AutoTokenizer

            # a GGUF's tokenizer (chat template included) is read from its metadata
            self.tok = gguf_tokenizer(tok_path) if gguf_tok else AutoTokenizer.from_pretrained(tok_path)
        except Exception as e:
            self.out.append(f"{field_name} {_brief(tok_path)}: AutoTokenizer cannot load it ({_short(e)})")

    def _load_gguf(self, path: str) -> bool:
        """A GGUF base (``mlora_lab.bases``): one readable ``.gguf`` file whose metadata describes a
        causal LM transformers can load. Nothing is converted here; the job converts it once, when it
        loads the base (``resolve_base``)."""
        where = f"base_model {_brief(path)}"
        try:
            file = gguf_file(path)
        except GGUFBaseError as e:
            self.out.append(f"{where}: {e.reason}")
            return False
        assert file is not None
        why = gguf_problem(file)
        if why:
            self.out.append(f"{where}: {why}")
            return False
        try:
            _load_config(path)
        except Exception as e:
            self.out.append(f"{where}: transformers cannot read a model config from this GGUF ({_short(e)})")
            return False
        return self._read_model_info(path, where)

    def _read_model_info(self, path: str, where: str) -> bool:
        """``self.model`` from the config at ``path`` (a meta-device build), or a problem."""
        try:
            self.model = _model_info(os.path.abspath(path))
        except Exception as e:
            self.out.append(f"{where}: cannot build a causal LM from its config ({_short(e)})")
            return False
        return True

    def _load_model(self, path: str) -> bool:
        where = f"base_model {_brief(path)}"
        cfg = os.path.join(path, "config.json")
        if os.path.isfile(cfg) and os.path.getsize(cfg) > _MAX_JSON_BYTES:
            self.out.append(f"{where}: config.json is larger than 64 MiB; that is not a model config")
            return False
        try:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(path)
        except Exception as e:
            self.out.append(f"{where} does not hold a loadable transformers config ({_short(e)})")
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
                self.out.append(f"{where}: model.safetensors is not usable ({why}); save the model again")
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
                self.out.append(f"{where}: {index} {why}; save the model again")
                return
            missing = [f for f in shards if not os.path.isfile(os.path.join(path, f))]
            if missing:
                self.out.append(
                    f"{where}: no weights found: {index} lists shard files that are missing "
                    f"({_names(missing, 5)}); copy every shard next to it"
                )
                return
            for shard in shards if index.startswith("model.safetensors") else []:
                _, why = _safetensors_shapes(os.path.join(path, shard))
                if why:
                    self.out.append(
                        f"{where}: shard {_show_path(shard)} is not usable ({why}); save the model again"
                    )
                    return
            return
        if not os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            self.out.append(
                f"{where}: no weights found (it has a config but no model.safetensors, "
                "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json); "
                "save the model with save_pretrained"
            )

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
            field_name = "tokenizer" if self.spec.tokenizer is not None else "tokenizer (base_model)"
            ids = ", ".join(f"{name} id {i}" for name, i in past.items())
            self.out.append(
                f"{field_name}: {ids} past the model's input embedding ({m.vocab:,} rows, vocab_size); "
                "use the model's own tokenizer"
            )

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
            self.out.append(
                f"the tenants' adapters need about {need / gib:,.1f} GiB per device with their gradients and "
                f"AdamW state (rank x in+out features x 16 bytes, summed over tenants; the largest is "
                f"{_who(name)}: rank {rank} x {feats:,} features) but {device} has {total / gib:,.1f} GiB; "
                "lower ranks, target fewer layers, or start fewer tenants at once"
            )

    # -- targets -------------------------------------------------------------------------------

    def _resolve_modules(self, where: str, targets: list[str]) -> set[str] | None:
        """Full names of the linear layers ``targets`` select; reports unknown / non-linear targets."""
        m = self.model
        assert m is not None
        chosen: set[str] = set()
        if ALL_LINEAR in targets:  # alone, or with other names in slot_modules (the union)
            chosen = _select_linear(m, [ALL_LINEAR])
            if not chosen:
                self.out.append(f"{where}'{ALL_LINEAR}' matches no linear layer in the model")
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
                self.out.append(
                    f"{where}{_brief(target)} matches modules that are not nn.Linear (e.g. {n}: {cls}); "
                    "LoRA goes on linear layers only"
                )
                ok = False
            chosen |= {n for n, _ in hits if n in m.linear}
        if unknown:
            self.out.append(
                f"{where}not found in the model: {_names(unknown)} (available: {suffixes(m.linear)})"
            )
            ok = False
        return chosen if ok else None

    def _check_targets(self, t: Tenant) -> None:
        if self.model is None:
            return
        w = f"{_who(t.name)}: "
        mods = t.target_modules
        if _valid_targets(mods) and mods:
            self._resolve_modules(f"{w}target_modules ", mods)
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
            self.out.append(f"{w}target_parameters not found in the model: {_names(unknown)} ({avail})")
        elif _is_num(t.dropout) and t.dropout:
            self.out.append(
                f"{w}dropout must be 0 with target_parameters (PEFT has no dropout on expert weights)"
            )

    def _check_slot_modules(self, tenants: list[Tenant]) -> None:
        slots = self.spec.slot_modules
        if self.model is None or slots is None or not _valid_targets(slots, union=True):
            return  # no model, no slot_modules, or a type problem already reported
        covered = self._resolve_modules("slot_modules ", slots) if slots else set()
        if covered is None:
            return
        for t in tenants:
            if not _valid_targets(t.target_modules):
                continue
            outside = [x for x in t.target_modules if _select_linear(self.model, [x]) - covered]
            if outside:
                self.out.append(
                    f"{_who(t.name)}: target_modules {_names(outside)} not covered by slot_modules "
                    f"{_brief(list(slots))}; add them to slot_modules"
                )

    # -- data ----------------------------------------------------------------------------------

    def _check_data(self, t: Tenant) -> None:
        from mlora_lab.data import scan_jsonl, target_problem

        w = f"{_who(t.name)}: "
        seq_len = self.spec.seq_len
        for name in ("data", "eval_data"):
            path = getattr(t, name)
            if not _usable_path(path):
                continue  # a type or path problem, reported with the fields
            report = scan_jsonl(path)
            self.out += [f"{w}{name}: {p}" for p in report.problems]
            if not report.problems and report.n_rows == 0:
                self.out.append(f"{w}{name}: {_show_path(path)}: no rows")
            no_template = (
                "messages" in report.kinds
                and self.tok is not None
                and not getattr(self.tok, "chat_template", None)
            )
            if no_template:
                self.out.append(
                    f"{w}{name} has chat ('messages') rows but the tokenizer has no chat_template"
                )
            if report.problems or not report.n_rows or no_template or self.tok is None:
                continue
            if _is_int(seq_len) and 2 <= seq_len <= MAX_SEQ_LEN:
                # Tokenizes rows (each cut at seq_len) only until one keeps a target token: one row for
                # a usable file, every row only for a file the job would refuse anyway.
                why = target_problem(path, self.tok, seq_len)
                if why:
                    self.out.append(f"{w}{name}: {why}")

    # -- init_adapter --------------------------------------------------------------------------

    def _check_init_adapter(self, t: Tenant) -> None:
        path = t.init_adapter
        if not _usable_path(path):
            return
        w = f"{_who(t.name)}: "
        cfg_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_file):
            self.out.append(
                f"{w}init_adapter {_brief(path)} is not a PEFT adapter directory (no adapter_config.json)"
            )
            return
        cfg, why = _read_json(cfg_file, "an adapter config")
        if why or not isinstance(cfg, dict):
            why = why or f"the top level is {_json_type(cfg)}, not a JSON object"
            self.out.append(f"{w}init_adapter {_show_path(cfg_file)}: {why}")
            return
        if cfg.get("peft_type", "LORA") != "LORA":
            self.out.append(
                f"{w}init_adapter is a {_brief(cfg.get('peft_type'))} adapter; only LORA is supported"
            )
            return
        weights = os.path.join(path, "adapter_model.safetensors")
        if not any(os.path.isfile(f) for f in (weights, os.path.join(path, "adapter_model.bin"))):
            self.out.append(f"{w}init_adapter {_brief(path)} has no adapter_model.safetensors")
        r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        rslora = bool(cfg.get("use_rslora", False))
        if not (_is_int(r) and r >= 1):
            self.out.append(
                f"{w}init_adapter has r={_brief(r)}, not a positive integer; save the adapter again"
            )
            r = None
        elif _is_int(self.spec.max_rank) and r > self.spec.max_rank:
            self.out.append(f"{w}init_adapter has r={r} > max_rank={self.spec.max_rank}; raise max_rank")
        if r is not None and r != t.rank:
            self.out.append(f"{w}rank {_brief(t.rank)} differs from init_adapter r={r}; set rank={r}")
        if alpha != t.alpha:
            self.out.append(
                f"{w}alpha {_brief(t.alpha)} differs from init_adapter lora_alpha={_brief(alpha)}; "
                f"set alpha={_brief(alpha)}"
            )
        if rslora != t.use_rslora:
            self.out.append(
                f"{w}use_rslora {_brief(t.use_rslora)} differs from init_adapter use_rslora={rslora}; "
                f"set use_rslora={json.dumps(rslora)}"
            )
        self._compare_targets(w, "target_modules", cfg.get("target_modules"), t.target_modules)
        self._compare_targets(w, "target_parameters", cfg.get("target_parameters"), t.target_parameters)
        for key in ("rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                self.out.append(
                    f"{w}init_adapter has a non-empty {key}; per-layer ranks/alphas are not supported"
                )
        unsupported = {
            "use_dora": cfg.get("use_dora"),
            "bias": cfg.get("bias", "none") not in (None, "none"),
            "modules_to_save": cfg.get("modules_to_save"),
            "layers_to_transform": cfg.get("layers_to_transform") is not None,
        }
        for key, present in unsupported.items():
            if present:
                self.out.append(f"{w}init_adapter uses {key}={_brief(cfg.get(key))}, which is not supported")
        if os.path.isfile(weights):
            self._check_adapter_weights(w, weights, cfg, r)

    def _check_adapter_weights(self, w: str, path: str, cfg: dict, r: int | None) -> None:
        """Compare the adapter's tensor shapes (from the safetensors header) with the base model:

            linear layer W [out, in]:           lora_A [r, in],   lora_B [out, r]
            packed experts W [E, out, in]:      lora_A [E*r, in], lora_B [out, E*r]  (PEFT's flattening)

        An adapter trained on another base (other widths, more layers) fails here, not in the job.
        """
        shapes, why = _safetensors_shapes(path)
        if why:
            self.out.append(
                f"{w}init_adapter weights {_show_path(path)} are not readable: {why}; save the adapter again"
            )
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
            self.out.append(
                f"{w}init_adapter holds tensors that are not LoRA A/B weights: {_names(not_lora, 5)}"
            )
        elif not pairs:
            self.out.append(f"{w}init_adapter {_show_path(path)} holds no LoRA tensors")
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
            self.out.append(
                f"{w}init_adapter was made for another base model: it has weights for modules this base "
                f"model does not have: {_names(unknown, 5)}"
            )
        if wrong:
            self.out.append(f"{w}init_adapter was made for another base model: {wrong[0]}{_more(wrong)}")
        if r is not None and ranks - {r}:
            broken.append(f"its weights have rank {_names(sorted(ranks))} but adapter_config.json says r={r}")
        if broken:
            self.out.append(
                f"{w}init_adapter {_show_path(path)} is inconsistent: {broken[0]}{_more(broken)}; save it again"
            )

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

    def _compare_targets(self, w: str, key: str, theirs: Any, ours: Any) -> None:
        if theirs is None:
            theirs_list: list[str] = []
        elif isinstance(theirs, str):
            theirs_list = [theirs]
        elif isinstance(theirs, list | tuple) and all(isinstance(x, str) for x in theirs):
            theirs_list = list(theirs)
        else:
            self.out.append(f"{w}init_adapter {key} must be a list of names ({_got(theirs)})")
            return
        if not _valid_targets(ours) or set(theirs_list) == set(ours):
            return
        # Different spellings may select the same layers (PEFT saves "all-linear" expanded).
        m = self.model
        if m is not None and key == "target_modules" and _valid_targets(theirs_list):
            selected = _select_linear(m, theirs_list)
            if selected and selected == _select_linear(m, ours):
                return
        self.out.append(
            f"{w}{key} {_brief(sorted(ours))} differs from init_adapter {key}={_brief(sorted(theirs_list), 200)}; "
            f"set {key}={_brief(json.dumps(sorted(theirs_list)), 200)}"
        )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _too_deep(value: Any, limit: int = _MAX_DEPTH) -> bool:
    """Whether containers nest more than ``limit`` levels (iteratively: no RecursionError here, and
    none later in ``copy.deepcopy`` or ``repr``). A container met twice is walked once."""
    stack, seen = [(value, 1)], set()
    while stack:
        x, depth = stack.pop()
        if not isinstance(x, dict | list | tuple) or id(x) in seen:
            continue
        if depth > limit:
            return True
        seen.add(id(x))
        stack.extend((c, depth + 1) for c in (x.values() if isinstance(x, dict) else x))
    return False


def _kwargs_for(cls: type, d: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    """Split ``d`` into constructor kwargs for dataclass ``cls``; problems for unknown/missing keys
    and for values nested too deeply to be copied."""
    if isinstance(d, cls):
        return {f.name: getattr(d, f.name) for f in dataclasses.fields(cls)}, []
    if not isinstance(d, dict):
        return {}, [f"{where} must be an object/dict (got {type(d).__name__})"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = []
    unknown = [k for k in d if k not in fields]
    if unknown:
        hints = []
        for k in unknown[:10]:
            # difflib on a 10-MB key would take seconds: only names of a sane length get a hint
            close = (
                difflib.get_close_matches(k, list(fields), n=1)
                if isinstance(k, str) and len(k) <= 100
                else []
            )
            hints.append(_brief(k) + (f" (did you mean {close[0]!r}?)" if close else ""))
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        problems.append(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(hints)}{more}")
    missing = [
        name
        for name, f in fields.items()
        if name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        problems.append(
            f"{where}: missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        )
    # tenants[i] and parallel are checked level by level by the caller; every other value is a leaf
    deep = [k for k, v in d.items() if k in fields and k not in ("tenants", "parallel") and _too_deep(v)]
    problems += [f"{where}: {k} is nested more than {_MAX_DEPTH} levels deep" for k in deep]
    return {k: v for k, v in d.items() if k in fields and k not in deep}, problems


def _resolve(path: Any, base: str) -> Any:
    if not isinstance(path, str) or not path:
        return path
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base, expanded))
