"""What a job is: ``Tenant``, ``Parallel`` and ``JobSpec``, their JSON form, and their validation.

These are plain dataclasses that store names and paths, never live objects, so a spec round-trips
through ``job.json`` unchanged::

    spec = JobSpec(base_model="models/tiny", tenants=[Tenant(name="alice", data="alice.jsonl")])
    spec.to_json("run/job.json")                # atomic write
    spec = JobSpec.load("run/job.json")         # relative paths resolved against run/
    spec.validate()                             # raises SpecError listing *every* problem at once

``JobSpec.problems()`` never raises and starts no process: it reads the model's config (and builds
the model on the ``meta`` device, which allocates nothing), the tokenizer, the tenants' data files
and any ``init_adapter`` directories, so bad input is reported before anything is launched.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate schedules a tenant may use; every one starts with ``warmup_steps`` of linear warmup."""

DTYPES = ("float32", "bfloat16", "float16")
"""Base-model dtypes a job may run in."""

ALL_LINEAR = "all-linear"
"""Special ``target_modules`` entry (PEFT's): every ``nn.Linear`` except the output layer ``lm_head``."""

MAX_NAME_LEN = 100
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")


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
    """Linear layers to adapt, matched as PEFT does (full name or ``.``-suffix), or ``["all-linear"]``."""
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
        """Build from a dict (e.g. one ``tenants`` entry of ``job.json``); unknown keys raise ``SpecError``."""
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
        """Build from a dict; unknown keys raise ``SpecError``."""
        kwargs, problems = _kwargs_for(cls, d, "parallel")
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Parallel) else cls(**kwargs)


@dataclass
class JobSpec:
    """A whole job: one frozen base model, its tenants, and the job-wide settings. ``= job.json``."""

    base_model: str
    """Local directory of a transformers causal LM (``save_pretrained`` layout); nothing is downloaded."""
    tenants: list[Tenant]
    """The tenants to train (may be empty with ``serve=True``)."""
    tokenizer: str | None = None
    """Tokenizer directory; ``None`` = ``base_model``."""
    seq_len: int = 512
    """Rows are truncated to this many tokens (with a warning) and right-padded."""
    max_tenants: int = 8
    """Adapter slots allocated up front: the most tenants the job can hold at once."""
    max_rank: int = 64
    """Rank of every slot: the largest rank a tenant (present or added later) may have."""
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
    slot_modules: list[str] | None = None
    """Linear layers that get adapter slots (same matching as ``target_modules``); ``None`` = the union
    of the tenants' ``target_modules``. Set it so that tenants added later may target modules no
    initial tenant uses (slots are allocated once, when the model is wrapped)."""

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

        Unknown or missing keys, at any level, raise one ``SpecError`` naming all of them.
        """
        kwargs, problems = _kwargs_for(cls, d, "job")
        tenants = kwargs.get("tenants")
        if "tenants" in kwargs and not isinstance(tenants, list):
            problems.append(f"tenants must be a list (got {type(tenants).__name__})")
        elif isinstance(tenants, list):
            built: list[Tenant] = []
            for i, t in enumerate(tenants):
                label = f"tenants[{i}]" + (f" ({t['name']!r})" if isinstance(t, dict) and "name" in t else "")
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
            _atomic_write_text(os.fspath(path), text + "\n")
        return text

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """Parse ``job.json`` text; bad JSON or bad keys raise ``SpecError``. Paths are kept as written."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"job spec is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | os.PathLike) -> JobSpec:
        """Read a ``job.json`` file; relative paths in it are relative to the file's directory."""
        path = os.fspath(path)
        with open(path, encoding="utf-8") as fh:
            spec = cls.from_json(fh.read())
        return spec.resolved(os.path.dirname(os.path.abspath(path)))

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

    def problems(self) -> list[str]:
        """Every problem with this spec, each naming its tenant and field. Never raises; starts no
        process. Checks that need the model are skipped when the model cannot be loaded."""
        try:
            return _Validator(self).run()
        except Exception as e:  # "never raises": a bug in a check is still reported, not thrown
            return [f"internal error while validating the spec ({type(e).__name__}: {_short(e)})"]

    def validate(self) -> JobSpec:
        """Return ``self`` if the spec has no problems, else raise ``SpecError`` listing all of them."""
        problems = self.problems()
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


@functools.lru_cache(maxsize=32)
def _model_info(path: str) -> _ModelInfo:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    # On the meta device nothing is allocated or initialised: cheap even for a large model.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    modules = tuple((n, type(m).__name__) for n, m in model.named_modules() if n)
    linear = frozenset(n for n, m in model.named_modules() if n and isinstance(m, torch.nn.Linear))
    experts = tuple(n for n, p in model.named_parameters() if p.ndim == 3)
    from mlora_lab.lora.experts import packed_experts_problem

    holders = sorted({n.rpartition(".")[0] for n in experts})
    expert_modules = tuple(
        (n, model.get_submodule(n).gate_up_proj.shape[0] if not problem else 0, problem)
        for n in holders
        for problem in [packed_experts_problem(model.get_submodule(n))]
    )
    return _ModelInfo(modules, linear, experts, expert_modules)


@functools.lru_cache(maxsize=32)
def _tp_problems(path: str, tp: int) -> list[str]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlora_lab.parallel.tensor import tp_problems

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return tp_problems(model, tp)


def effective_slot_modules(job: JobSpec) -> list[str]:
    """The linear-layer names that get adapter slots: ``slot_modules``, else the union of the
    tenants' targets (``["all-linear"]`` if any tenant asks for it)."""
    names = job.slot_modules or sorted({m for t in job.tenants for m in t.target_modules})
    return [ALL_LINEAR] if ALL_LINEAR in names else list(names)


def tenant_problems(job: JobSpec, tenant: Tenant) -> list[str]:
    """Problems of adding ``tenant`` to the job ``job`` while it runs: the tenant's own fields and files,
    checked against the job's model, tokenizer, ``max_rank`` and adapter slots."""
    probe = dataclasses.replace(
        job, tenants=[tenant], slot_modules=effective_slot_modules(job), serve=False, parallel=Parallel(),
        output_dir=None,
    )  # fmt: skip
    mine = f"tenant {tenant.name!r}"
    return [p for p in probe.problems() if mine in p or "slot_modules" in p or "base_model" in p]


def model_target_names(base_model: str) -> tuple[list[str], list[str]]:
    """Full names of the model's ``nn.Linear`` modules, and of its 3-D parameters (packed MoE experts).

    The model is built from its config on the ``meta`` device (no weights are read); results are
    cached per path. Raises whatever transformers raises if the config cannot be loaded.
    """
    info = _model_info(os.path.abspath(os.fspath(base_model)))
    linear_in_order = [n for n, _ in info.modules if n in info.linear]
    return linear_in_order, list(info.experts)


def _matches(name: str, target: str) -> bool:
    """PEFT's rule: a target names a module by its full name or by a ``.``-separated suffix of it."""
    return name == target or name.endswith("." + target)


def _valid_targets(v: Any) -> bool:
    """A list of non-empty names, with ``"all-linear"`` only on its own."""
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x for x in v):
        return False
    return ALL_LINEAR not in v or len(v) == 1


def _select_linear(info: _ModelInfo, targets: list[str] | tuple[str, ...]) -> set[str]:
    """Full names of the linear layers that ``targets`` (valid per :func:`_valid_targets`) select."""
    if list(targets) == [ALL_LINEAR]:
        return {n for n in info.linear if not _matches(n, "lm_head")}
    return {n for n in info.linear if any(_matches(n, t) for t in targets)}


def _suffixes(names: Any) -> str:
    return ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names}))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _got(v: Any) -> str:
    return f"got {v!r} of type {type(v).__name__}"


def _short(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Validator:
    """Collects every problem of one ``JobSpec``; each ``_check_*`` appends to ``self.out``."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.out: list[str] = []
        self.model: _ModelInfo | None = None
        self.tok: Any = None

    def run(self) -> list[str]:
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
        self._load_model_and_tokenizer()
        for t in good:
            self._check_targets(t)
            self._check_data(t)
            self._check_init_adapter(t)
        self._check_slot_modules(good)
        self._check_expert_parallel()
        self._check_tensor_parallel()
        return self.out

    # -- generic field checks ------------------------------------------------------------------

    def _int(
        self, where: str, name: str, v: Any, lo: int | None = None, hi: int | None = None, hi_name: str = ""
    ) -> None:
        if not _is_int(v):
            self.out.append(f"{where}{name} must be an integer ({_got(v)})")
        elif lo is not None and v < lo:
            self.out.append(f"{where}{name} must be >= {lo} (got {v})")
        elif hi is not None and v > hi:
            self.out.append(f"{where}{name} must be <= {hi_name or hi} (got {v})")

    def _num(self, where: str, name: str, v: Any, rule: str, ok: Any) -> None:
        """A finite real number for which ``ok(v)`` holds; ``rule`` says what that means."""
        if not _is_num(v) or not math.isfinite(v):
            self.out.append(f"{where}{name} must be a finite number ({_got(v)})")
        elif not ok(v):
            self.out.append(f"{where}{name} must be {rule} (got {v})")

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

    def _str_list(self, where: str, name: str, v: Any) -> bool:
        if _valid_targets(v):
            return True
        if isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v):
            self.out.append(f"{where}{name}: '{ALL_LINEAR}' must be the only entry (got {list(v)})")
        else:
            self.out.append(f"{where}{name} must be a list of non-empty strings ({_got(v)})")
        return False

    # -- job-level -----------------------------------------------------------------------------

    def _check_job_fields(self) -> None:
        s = self.spec
        self._str("", "base_model", s.base_model)
        self._str("", "tokenizer", s.tokenizer, optional=True)
        self._int("", "seq_len", s.seq_len, lo=2)
        self._int("", "max_tenants", s.max_tenants, lo=1)
        self._int("", "max_rank", s.max_rank, lo=1)
        if s.dtype not in DTYPES:
            self.out.append(f"dtype must be one of {', '.join(DTYPES)} (got {s.dtype!r})")
        self._int("", "log_every", s.log_every, lo=1)
        self._int("", "eval_every", s.eval_every, lo=0)
        self._int("", "save_every", s.save_every, lo=0)
        self._bool("", "serve", s.serve)
        self._int("", "seed", s.seed)
        out_ok = self._str("", "output_dir", s.output_dir, optional=True) and s.output_dir is not None
        if out_ok and os.path.exists(s.output_dir) and not os.path.isdir(s.output_dir):
            self.out.append(f"output_dir {s.output_dir!r} exists and is not a directory")
        if s.slot_modules is not None:
            self._str_list("", "slot_modules", s.slot_modules)

    def _check_parallel(self) -> None:
        p = self.spec.parallel
        if not isinstance(p, Parallel):
            self.out.append(f"parallel must be a Parallel (got {type(p).__name__})")
            return
        names = ("nproc", "nnodes", "fsdp", "tp", "ep")
        for name in names:
            self._int("", f"parallel.{name}", getattr(p, name), lo=1)
        if not all(_is_int(getattr(p, n)) and getattr(p, n) >= 1 for n in names):
            return
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
        if self.model is None or not isinstance(p, Parallel) or not _is_int(p.tp) or p.tp <= 1:
            return
        self.out.extend(_tp_problems(os.path.abspath(self.spec.base_model), p.tp))

    def _check_expert_parallel(self) -> None:
        """``ep > 1`` needs packed experts that split evenly over ``ep`` ranks."""
        p = self.spec.parallel
        if self.model is None or not isinstance(p, Parallel) or not _is_int(p.ep) or p.ep <= 1:
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
            self.out.append(f"{len(tenants)} tenants but max_tenants={s.max_tenants}; raise max_tenants")
        names = [t.name for t in tenants if isinstance(t, Tenant) and isinstance(t.name, str)]
        for dup in sorted({n for n in names if names.count(n) > 1}):
            self.out.append(f"tenant name {dup!r} is used {names.count(dup)} times; names must be unique")

    # -- tenant fields -------------------------------------------------------------------------

    def _check_tenant_fields(self, t: Tenant) -> None:
        w = f"tenant {t.name!r}: "
        self._check_name(t.name)
        self._str(w, "data", t.data)
        self._str(w, "eval_data", t.eval_data, optional=True)
        self._str(w, "init_adapter", t.init_adapter, optional=True)
        max_rank = self.spec.max_rank if _is_int(self.spec.max_rank) else None
        self._int(w, "rank", t.rank, lo=1, hi=max_rank, hi_name=f"max_rank={max_rank}")
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
        if t.schedule not in SCHEDULES:
            self.out.append(f"{w}schedule must be one of {', '.join(SCHEDULES)} (got {t.schedule!r})")
        self._int(w, "warmup_steps", t.warmup_steps, lo=0)
        if t.max_grad_norm is not None:
            self._num(
                w, "max_grad_norm", t.max_grad_norm, "> 0 (or null to disable clipping)", lambda v: v > 0
            )
        self._int(w, "batch_size", t.batch_size, lo=1)
        self._int(w, "grad_accum", t.grad_accum, lo=1)
        self._int(w, "max_steps", t.max_steps, lo=1)
        self._bool(w, "shuffle", t.shuffle)
        self._int(w, "seed", t.seed)

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
            why = f"it is {len(name)} characters long (at most {MAX_NAME_LEN})"
        elif not _SAFE_NAME.fullmatch(name):
            bad = "".join(sorted({c for c in name if not _SAFE_NAME.fullmatch(c)}))
            why = f"it contains {bad!r}"
        if why:
            self.out.append(
                f"tenant {name!r}: name is not a safe directory name ({why}); "
                f"use 1-{MAX_NAME_LEN} characters from A-Z a-z 0-9 . _ -"
            )

    # -- model and tokenizer -------------------------------------------------------------------

    def _load_model_and_tokenizer(self) -> None:
        s = self.spec
        base_ok = False
        if isinstance(s.base_model, str) and s.base_model:
            if not os.path.isdir(s.base_model):
                self.out.append(
                    f"base_model {s.base_model!r} is not a local directory (give the directory of a model "
                    "saved with save_pretrained; nothing is downloaded)"
                )
            else:
                base_ok = self._load_model(s.base_model)
        tok_path = s.tokenizer if s.tokenizer is not None else s.base_model
        field_name = "tokenizer" if s.tokenizer is not None else "tokenizer (base_model)"
        if not isinstance(tok_path, str) or not tok_path or (s.tokenizer is None and not base_ok):
            return  # already reported (bad type, or the base_model problem covers it)
        if not os.path.isdir(tok_path):
            self.out.append(f"{field_name} {tok_path!r} is not a local directory")
            return
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(tok_path)
        except Exception as e:
            self.out.append(f"{field_name} {tok_path!r}: AutoTokenizer cannot load it ({_short(e)})")

    def _load_model(self, path: str) -> bool:
        try:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(path)
        except Exception as e:
            self.out.append(f"base_model {path!r} does not hold a loadable transformers config ({_short(e)})")
            return False
        try:
            self.model = _model_info(os.path.abspath(path))
        except Exception as e:
            self.out.append(f"base_model {path!r}: cannot build a causal LM from its config ({_short(e)})")
            return False
        return True

    # -- targets -------------------------------------------------------------------------------

    def _resolve_modules(self, where: str, targets: list[str]) -> set[str] | None:
        """Full names of the linear layers ``targets`` select; reports unknown / non-linear targets."""
        m = self.model
        assert m is not None
        if list(targets) == [ALL_LINEAR]:
            chosen = _select_linear(m, targets)
            if not chosen:
                self.out.append(f"{where}'{ALL_LINEAR}' matches no linear layer in the model")
                return None
            return chosen
        chosen: set[str] = set()
        unknown: list[str] = []
        ok = True
        for target in targets:
            hits = [(n, cls) for n, cls in m.modules if _matches(n, target)]
            if not hits:
                unknown.append(target)
                continue
            not_linear = [(n, cls) for n, cls in hits if n not in m.linear]
            if not_linear:
                n, cls = not_linear[0]
                self.out.append(
                    f"{where}{target!r} matches modules that are not nn.Linear (e.g. {n}: {cls}); "
                    "LoRA goes on linear layers only"
                )
                ok = False
            chosen |= {n for n, _ in hits if n in m.linear}
        if unknown:
            self.out.append(
                f"{where}not found in the model: {', '.join(unknown)} (available: {_suffixes(m.linear)})"
            )
            ok = False
        return chosen if ok else None

    def _check_targets(self, t: Tenant) -> None:
        if self.model is None:
            return
        w = f"tenant {t.name!r}: "
        mods = t.target_modules
        if _valid_targets(mods) and mods:
            self._resolve_modules(f"{w}target_modules ", mods)
        params = t.target_parameters
        if not (_valid_targets(params) and params):
            return
        unknown = [p for p in params if not any(_matches(n, p) for n in self.model.experts)]
        if unknown:
            avail = (
                f"available: {_suffixes(self.model.experts)}"
                if self.model.experts
                else "the model has no 3-D expert parameters"
            )
            self.out.append(f"{w}target_parameters not found in the model: {', '.join(unknown)} ({avail})")
        elif t.dropout:
            self.out.append(
                f"{w}dropout must be 0 with target_parameters (PEFT has no dropout on expert weights)"
            )

    def _check_slot_modules(self, tenants: list[Tenant]) -> None:
        slots = self.spec.slot_modules
        if self.model is None or slots is None or not _valid_targets(slots):
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
                    f"tenant {t.name!r}: target_modules {', '.join(outside)} not covered by slot_modules "
                    f"{list(slots)}; add them to slot_modules"
                )

    # -- data ----------------------------------------------------------------------------------

    def _check_data(self, t: Tenant) -> None:
        from mlora_lab.data import scan_jsonl

        w = f"tenant {t.name!r}: "
        for name in ("data", "eval_data"):
            path = getattr(t, name)
            if not isinstance(path, str) or not path:
                continue
            report = scan_jsonl(path)
            self.out += [f"{w}{name}: {p}" for p in report.problems]
            if not report.problems and report.n_rows == 0:
                self.out.append(f"{w}{name}: {path}: no rows")
            if (
                "messages" in report.kinds
                and self.tok is not None
                and not getattr(self.tok, "chat_template", None)
            ):
                self.out.append(
                    f"{w}{name} has chat ('messages') rows but the tokenizer has no chat_template"
                )

    # -- init_adapter --------------------------------------------------------------------------

    def _check_init_adapter(self, t: Tenant) -> None:
        path = t.init_adapter
        if not isinstance(path, str) or not path:
            return
        w = f"tenant {t.name!r}: "
        cfg_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_file):
            self.out.append(
                f"{w}init_adapter {path!r} is not a PEFT adapter directory (no adapter_config.json)"
            )
            return
        try:
            with open(cfg_file, encoding="utf-8") as fh:
                cfg = json.load(fh)
            if not isinstance(cfg, dict):
                raise ValueError("not a JSON object")
        except Exception as e:
            self.out.append(f"{w}init_adapter {cfg_file!r} cannot be read ({_short(e)})")
            return
        if cfg.get("peft_type", "LORA") != "LORA":
            self.out.append(f"{w}init_adapter is a {cfg.get('peft_type')} adapter; only LORA is supported")
            return
        if not any(
            os.path.isfile(os.path.join(path, f)) for f in ("adapter_model.safetensors", "adapter_model.bin")
        ):
            self.out.append(f"{w}init_adapter {path!r} has no adapter_model.safetensors")
        r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        rslora = bool(cfg.get("use_rslora", False))
        if _is_int(self.spec.max_rank) and _is_int(r) and r > self.spec.max_rank:
            self.out.append(f"{w}init_adapter has r={r} > max_rank={self.spec.max_rank}; raise max_rank")
        if r != t.rank:
            self.out.append(f"{w}rank {t.rank!r} differs from init_adapter r={r}; set rank={r}")
        if alpha != t.alpha:
            self.out.append(
                f"{w}alpha {t.alpha!r} differs from init_adapter lora_alpha={alpha}; set alpha={alpha}"
            )
        if rslora != t.use_rslora:
            self.out.append(
                f"{w}use_rslora {t.use_rslora!r} differs from init_adapter use_rslora={rslora}; "
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
                self.out.append(f"{w}init_adapter uses {key}={cfg.get(key)!r}, which is not supported")

    def _compare_targets(self, w: str, key: str, theirs: Any, ours: Any) -> None:
        theirs_list = [theirs] if isinstance(theirs, str) else list(theirs or [])
        if not _valid_targets(ours) or set(theirs_list) == set(ours):
            return
        # Different spellings may select the same layers (PEFT saves "all-linear" expanded).
        m = self.model
        if m is not None and key == "target_modules" and _valid_targets(theirs_list):
            selected = _select_linear(m, theirs_list)
            if selected and selected == _select_linear(m, ours):
                return
        self.out.append(
            f"{w}{key} {sorted(ours)} differs from init_adapter {key}={sorted(theirs_list)}; "
            f"set {key}={json.dumps(sorted(theirs_list))}"
        )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _kwargs_for(cls: type, d: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    """Split ``d`` into constructor kwargs for dataclass ``cls``; problems for unknown/missing keys."""
    if isinstance(d, cls):
        return {f.name: getattr(d, f.name) for f in dataclasses.fields(cls)}, []
    if not isinstance(d, dict):
        return {}, [f"{where} must be an object/dict (got {type(d).__name__})"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems = []
    unknown = [k for k in d if k not in fields]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        problems.append(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    missing = [
        name
        for name, f in fields.items()
        if name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        problems.append(
            f"{where}: missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        )
    return {k: v for k, v in d.items() if k in fields}, problems


def _resolve(path: Any, base: str) -> Any:
    if not isinstance(path, str) or not path:
        return path
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base, expanded))


def _atomic_write_text(path: str, text: str) -> None:
    """Write to a temporary file in the same directory, fsync, then ``os.replace`` onto ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; job.json is meant to be read by others
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
