"""What a job is: ``Tenant``, ``Parallel``, ``Service`` and ``JobSpec``, their JSON form, and what each field means.

These are plain dataclasses that store names and paths, never live objects, so a spec round-trips
through ``job.json`` unchanged (the one exception lives only in the notebook: a tenant's rows held in memory,
a DataFrame say, which a launch writes into the run directory before it writes ``job.json``)::

    spec = JobSpec(base_model="models/tiny", tenants=[Tenant(name="alice", data="alice.jsonl")])
    spec.to_json("run/job.json")                # atomic write
    spec = JobSpec.load("run/job.json")         # relative paths resolved against run/

    from mlora_lab.validate import check
    check(spec)                                 # raises SpecError listing *every* problem at once

Each field carries a :class:`FieldInfo` (``field_info(Tenant, "lr")``): its label, help line, widget
kind, form section and bounds. The notebook forms (:mod:`mlora_lab.lab.forms`) build their inputs from it
and the validator (:mod:`mlora_lab.validate`) checks values against the same bounds, so a new
``Tenant`` field is one edit here.

Validation lives in :mod:`mlora_lab.validate` (``problems(spec)``, ``check(spec)``), which imports
this module and never the other way round; this module holds only the contract it reports in,
:class:`Problem` (a tenant, a field, a sentence) and :class:`SpecError`. It imports no torch,
transformers or model code: the notebook side and the training processes both read specs cheaply.

Everything here treats its input as hostile: any JSON (or Python values in the fields) gives
``SpecError``, never another exception, and a message repeats at most ~80 characters of a bad value
(:mod:`mlora_lab.text` shows and reads hostile values).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.lora.targets import ALL_LINEAR
from mlora_lab.sources import describe, memory_kind
from mlora_lab.text import brief, json_type, parse_json, read_json, show_path

SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate schedules a tenant may use; every one starts with ``warmup_steps`` of linear warmup."""

DTYPES = ("float32", "bfloat16", "float16")
"""Base-model dtypes a job may run in."""

TRACKERS = ("tensorboard", "trackio", "wandb")
"""Experiment trackers a job can mirror its metrics rows to (``JobSpec.report_to``), each an optional extra
of the package (``pip install 'mlora_lab[wandb]'``; ``mlora_lab[trackers]`` for all three). ``"all"`` and
``"none"`` are taken as transformers' ``TrainingArguments.report_to`` takes them."""
REPORT_GROUPS = ("tenant", "job")
"""``JobSpec.report_group``: one tracker run per tenant (grouped under the job), or one run for the job."""
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo")
"""``RL.loss_type``: how TRL 1.16's ``GRPOTrainer`` turns per-token terms into a loss (``dapo`` its default)."""
SCALE_REWARDS = ("group", "batch", "none")
"""``RL.scale_rewards``: divide advantages by the std of the prompt's group, of the batch, or not at all."""
MAX_REWARDS = 16
"""Most reward functions one tenant may combine."""
MAX_NEW_TOKENS = 2**16
MAX_GROUP = 2**12

MAX_NAME_LEN = 100
"""Longest tenant name (it names a directory)."""
MAX_RUN_NAME_LEN = 100
"""The longest ``JobSpec.name``."""
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")
"""What a tenant name is made of (it names a directory): ``SAFE_NAME.fullmatch(name)``."""

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
# The optimiser's scalars: AdamW moves every element of an adapter by about ``lr`` per step, whatever the
# gradient's scale, so past these nothing trains (the weights are rewritten at every step), and far past
# them (lr=1e38) the update does not even fit in float32. The job quarantines a tenant whose update
# overflows or whose weights diverge anyway (mlora_lab.optim); these bounds refuse the typo before launch.
MAX_LR = 10.0
"""Largest ``lr``: LoRA trains at 1e-5 .. 1e-2; 10 already rewrites every weight each step."""
MAX_WEIGHT_DECAY = 10.0
"""Largest ``weight_decay``: AdamW multiplies the weights by ``1 - lr·wd`` per step; at lr 0.1 this is 0."""
MAX_PORT = 65_535
MAX_QUEUE = 2**20
"""Most requests a served job's inbox holds (``Service.max_queue``)."""
MAX_SESSION_TIMEOUT = 7 * 24 * 3600.0
"""Longest ``Service.session_timeout``: a week."""
MAX_PROBLEMS = 200
""":func:`mlora_lab.validate.problems` lists at most this many, then ``... and N more problem(s)``."""
_MAX_DEPTH = 16  # job.json nests 3 deep (tenants[i].betas); 16 leaves room and stops RecursionError


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: which tenant, which field, and what, in one sentence.

    ``str(problem)`` is the sentence as the CLI and :class:`SpecError` print it: ``"tenant 'alice':
    rank must be >= 1 (got 0)"`` for a tenant's problem, the message alone for a job-wide one. Views
    sort, filter and place problems by ``tenant`` / ``field``, never by parsing the text.
    """

    tenant: str | None
    """Name of the tenant the problem is about; ``None`` for a job-wide problem (and for a tenant whose
    name is not a string at all: its ``message`` then names it as the spec holds it)."""
    field: str | None
    """The ``Tenant`` / ``JobSpec`` field to change (``"lr"``, ``"data"``, ``"parallel.fsdp"``,
    ``"target_modules"``, ``"tenants"``); ``None`` for a problem of the whole spec."""
    message: str
    """The sentence, without the ``"tenant 'alice': "`` prefix."""
    path: str | None = None
    """The file the problem is in, for a problem of one data file (``data`` / ``eval_data``): lets a
    view group the same problem across files."""

    def __str__(self) -> str:
        return self.message if self.tenant is None else f"{tenant_label(self.tenant)}: {self.message}"


class SpecError(ValueError):
    """A job spec with problems; ``problems`` lists every one (:class:`Problem`) and ``str()`` shows
    them, one per line. Plain strings are accepted and kept as job-wide problems."""

    def __init__(self, problems: Sequence[Problem | str] | Problem | str) -> None:
        items = [problems] if isinstance(problems, str | Problem) else list(problems)
        self.problems: list[Problem] = [
            p if isinstance(p, Problem) else Problem(None, None, str(p)) for p in items
        ]
        n = len(self.problems)
        super().__init__(
            f"invalid job spec ({n} problem{'s' if n != 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in self.problems)
        )


# ---------------------------------------------------------------------------------------------
# Field metadata
# ---------------------------------------------------------------------------------------------

FIELD_KINDS = (
    "name",
    "text",
    "path",
    "dir",
    "int",
    "float",
    "log-float",
    "bool",
    "choice",
    "targets",
    "pair",
    "tenants",
    "parallel",
    "trackers",
    "id",
    "rl",
    "rewards",
    "numbers",
    "texts",
    "service",
    "client",
)
"""Kinds of :attr:`FieldInfo.kind`. ``tenants``, ``parallel``, ``service``, ``rl`` and ``client`` are the spec's
nested parts, checked on their own; ``rewards`` (reward functions), ``numbers`` and ``texts`` (lists) are
RL's."""


@dataclass(frozen=True)
class FieldInfo:
    """What the forms show for one field and which values the validator accepts: one source for both.

    Read it with :func:`field_info` / :func:`fields_info`. ``kind`` picks the input and the check:
    ``name`` (a tenant name), ``path`` (a data file: a box offering the ``.jsonl`` files it finds),
    ``dir`` (a directory), ``int``, ``float``, ``log-float`` (a float typed exactly, with a slider that
    snaps to 1, 2, 3, 5 x 10^k beside it), ``bool``, ``choice`` (one of ``choices``), ``targets`` (a
    list of module names), ``pair`` (two floats, not shown in forms), ``trackers`` (``report_to``: tracker
    names, ``"all"`` or ``"none"``), ``id`` (a short name of ``[A-Za-z0-9._-]``); the last two are not
    shown in forms.
    """

    label: str
    """Short label before the input; at most :data:`MAX_LABEL` characters, so it is never cut off."""
    help: str = ""
    """One line shown next to the input (and as its tooltip)."""
    kind: str = "int"
    """One of :data:`FIELD_KINDS`."""
    section: str = ""
    """Group of the form the input is in (Tenant: Data, LoRA, Optimizer, Advanced; JobSpec: Job, Logging,
    Advanced; Parallel: Parallel)."""
    min: float | None = None
    """Smallest valid value (numbers), excluded when ``min_open``."""
    max: float | None = None
    """Largest valid value (numbers), excluded when ``max_open``."""
    min_open: bool = False
    max_open: bool = False
    at_most: str = ""
    """A ``JobSpec`` field bounding this one from above: ``rank`` is at most ``max_rank``."""
    step: float | None = None
    """Step of the input's slider."""
    slider: bool = False
    """Show a slider (over ``typical``, or ``min`` .. ``at_most`` for an int) instead of a text box."""
    typical: tuple[float, float] | None = None
    """The range a slider spans; valid values outside it widen the slider rather than being clamped."""
    choices: tuple[str, ...] = ()
    """The valid values of a ``choice`` field."""
    optional: bool = False
    """``None`` (JSON ``null``) is valid: an optional path, or a number that may be switched off."""
    null_means: str = ""
    """For an optional number: what ``None`` means, as the label of the form's checkbox that sets it
    (the form's attribute is that label with ``_`` for spaces: ``"no clipping"`` -> ``form.no_clipping``)."""
    empty: str = ""
    """What a form says while this required field is empty ("choose a training data file")."""
    form: bool = True
    """Shown by the forms; a field that is not keeps the value the form was given."""
    bool_ok: bool = False
    """An ``int`` field that also takes ``true`` / ``false`` (``activation_checkpointing``)."""

    def rule(self) -> str:
        """The numeric bounds as messages say them: ``"> 0"``, ``">= 0"``, ``"in [0, 1)"``."""
        lo, hi = self.min, self.max
        if lo is not None and hi is not None:
            return f"in {'(' if self.min_open else '['}{lo:g}, {hi:g}{')' if self.max_open else ']'}"
        if lo is not None:
            return f"{'>' if self.min_open else '>='} {lo:g}"
        if hi is not None:
            return f"{'<' if self.max_open else '<='} {hi:g}"
        return "a number"

    def allows(self, value: float) -> bool:
        """Whether the finite number ``value`` is within the bounds (``at_most`` is the validator's)."""
        lo, hi = self.min, self.max
        if lo is not None and (value <= lo if self.min_open else value < lo):
            return False
        return not (hi is not None and (value >= hi if self.max_open else value > hi))


MAX_LABEL = 18
"""Longest :attr:`FieldInfo.label`: what the forms' label column shows whole."""
_INFO = "mlora_lab"  # the key of a field's metadata that holds its FieldInfo


def _meta(label: str, **info: Any) -> dict[str, FieldInfo]:
    """A field's ``metadata`` holding its :class:`FieldInfo` (``label`` first, then its other attributes):
    ``rank: int = field(default=8, metadata=_meta("rank", section="LoRA", min=1))``."""
    return {_INFO: FieldInfo(label, **info)}


def field_info(cls: type, name: str) -> FieldInfo:
    """The :class:`FieldInfo` of field ``name`` of ``Tenant``, ``JobSpec`` or ``Parallel``."""
    return cls.__dataclass_fields__[name].metadata[_INFO]


def fields_info(cls: type) -> Iterator[tuple[str, FieldInfo]]:
    """``(name, FieldInfo)`` of every field of ``cls`` in definition order (the order forms show them)."""
    for f in dataclasses.fields(cls):
        yield f.name, f.metadata[_INFO]


# ---------------------------------------------------------------------------------------------
# The dataclasses
# ---------------------------------------------------------------------------------------------


def _path_str(value: Any) -> Any:
    """``os.PathLike`` -> ``str`` (so ``pathlib.Path`` arguments serialise); anything else unchanged."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@dataclass
class Tenant:
    """One LoRA adapter trained in the job: its data, its LoRA shape and its own optimizer settings."""

    # fmt: off
    name: str = field(metadata=_meta(
        "name", kind="name", section="Data", help="letters, digits, . _ - (it names a directory)",
        empty="enter a name for this tenant"))
    """Unique name; it becomes a directory name (``adapters/<name>/``), so only ``[A-Za-z0-9._-]``."""
    data: str | Any = field(metadata=_meta(
        "data", kind="path", section="Data", help=".jsonl/.json/.parquet/.csv rows: text, prompt/completion or messages",
        empty="choose a training data file"))
    """Training data: rows of ``text``, ``prompt``/``completion`` or ``messages``, from a ``.jsonl``,
    ``.json``, ``.parquet`` or ``.csv`` file, or (in the notebook) a pandas DataFrame, a list of dicts or
    a ``datasets.Dataset`` (:mod:`mlora_lab.sources`). job.json holds only paths: a launch (and
    ``run.add_tenant``) writes an in-memory source into the run directory and names that file there."""
    eval_data: str | Any | None = field(default=None, metadata=_meta(
        "eval data", kind="path", section="Data", optional=True, help="optional held-out rows, same format"))
    """Optional held-out rows (any source ``data`` takes), evaluated every ``JobSpec.eval_every`` steps."""
    init_adapter: str | None = field(default=None, metadata=_meta(
        "init adapter", kind="dir", section="Advanced", optional=True,
        help="optional PEFT adapter directory to start from"))
    """Optional PEFT LoRA adapter directory to start from; its r, alpha, rsLoRA and targets must match."""
    rank: int = field(default=8, metadata=_meta(
        "rank", section="LoRA", min=1, max=MAX_SLOTS, at_most="max_rank", slider=True,
        help="LoRA rank r, at most the job's max_rank"))
    """LoRA rank r (1 .. ``JobSpec.max_rank``)."""
    alpha: float = field(default=16, metadata=_meta(
        "alpha", kind="float", section="LoRA", min=0, min_open=True,
        help="the delta is scaled by alpha / rank"))
    """LoRA alpha; the delta is scaled by :attr:`scaling`."""
    use_rslora: bool = field(default=False, metadata=_meta(
        "rsLoRA", kind="bool", section="LoRA", help="scale by alpha / sqrt(rank) instead"))
    """rsLoRA: scale by ``alpha / sqrt(rank)`` instead of ``alpha / rank``."""
    dropout: float = field(default=0.0, metadata=_meta(
        "dropout", kind="float", section="LoRA", min=0, max=1, max_open=True, slider=True, typical=(0.0, 0.5),
        step=0.01, help="dropout on the LoRA input"))
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"], metadata=_meta(
        "target modules", kind="targets", section="LoRA",
        help="all-linear: every linear layer but the output"))
    """Linear layers to adapt, matched as PEFT does (full name or ``.``-suffix), or ``["all-linear"]`` (every
    ``nn.Linear`` but the output layer); the rules live in :mod:`mlora_lab.lora.targets`."""
    target_parameters: list[str] = field(default_factory=list, metadata=_meta(
        "target parameters", kind="targets", form=False, help="packed MoE expert weights to adapt"))
    """3-D packed MoE expert parameters to adapt (e.g. ``mlp.experts.gate_up_proj``), PEFT-style."""
    lr: float = field(default=2e-4, metadata=_meta(
        "lr", kind="log-float", section="Optimizer", min=0, min_open=True, max=MAX_LR, typical=(1e-6, 1e-1),
        help="peak learning rate, used exactly as typed"))
    """Peak learning rate of this tenant's AdamW (at most :data:`MAX_LR`)."""
    weight_decay: float = field(default=0.0, metadata=_meta(
        "weight decay", kind="float", section="Advanced", min=0, max=MAX_WEIGHT_DECAY, help="AdamW weight decay"))
    """AdamW weight decay (at most :data:`MAX_WEIGHT_DECAY`)."""
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=_meta(
        "betas", kind="pair", min=0, max=1, max_open=True, form=False))
    """AdamW betas (a JSON list in ``job.json``)."""
    eps: float = field(default=1e-8, metadata=_meta(
        "eps", kind="float", min=0, min_open=True, max=1, form=False))
    """AdamW epsilon, in (0, 1]."""
    schedule: str = field(default="constant", metadata=_meta(
        "schedule", kind="choice", choices=SCHEDULES, section="Optimizer",
        help="after warmup: constant or decay to 0"))
    """Learning-rate schedule after warmup: ``"constant"``, ``"linear"`` or ``"cosine"`` (decay to 0)."""
    warmup_steps: int = field(default=0, metadata=_meta(
        "warmup steps", section="Optimizer", min=0, max=MAX_COUNT, help="linear warmup from 0 to lr"))
    """Steps of linear warmup from 0 to ``lr``."""
    max_grad_norm: float | None = field(default=1.0, metadata=_meta(
        "max grad norm", kind="float", section="Optimizer", min=0, min_open=True, optional=True,
        null_means="no clipping", help="clip the gradient norm to this"))
    """Clip this tenant's gradient norm to this value; ``None`` disables clipping."""
    batch_size: int = field(default=4, metadata=_meta(
        "batch size", section="Optimizer", min=1, max=MAX_ROWS, help="rows of this tenant per micro-batch"))
    """Rows of this tenant in each micro-batch."""
    grad_accum: int = field(default=1, metadata=_meta(
        "grad accum", section="Optimizer", min=1, max=MAX_ROWS, help="micro-batches per optimizer step"))
    """Micro-batches per optimizer step."""
    max_steps: int = field(default=100, metadata=_meta(
        "max steps", section="Optimizer", min=1, max=MAX_COUNT,
        help="optimizer steps; then the adapter is saved"))
    """Optimizer steps after which this tenant is finished (its adapter is saved and its slot idles)."""
    shuffle: bool = field(default=True, metadata=_meta(
        "shuffle", kind="bool", section="Advanced", help="shuffle the rows every epoch"))
    """Shuffle the rows every epoch (seeded by ``seed``)."""
    seed: int = field(default=0, metadata=_meta(
        "seed", section="Optimizer", min=0, max=MAX_SEED, help="LoRA init, dropout and data order"))
    """Seed of this tenant's LoRA init, dropout and data order."""
    rl: RL | None = field(default=None, metadata=_meta(
        "rl", kind="rl", section="RL", optional=True, form=False, help="learn from rewards (GRPO)"))
    """``None``: supervised rows. An :class:`RL`: the rows are prompts, and the tenant learns from rewards."""
    client: ClientModel | None = field(default=None, metadata=_meta(
        "client", kind="client", section="Service", optional=True, form=False,
        help="the Tinker training client that drives it"))
    """``None``: the job feeds it (``data``). A :class:`ClientModel`: a served job's tenant that a Tinker training
    client drives request by request (it has no ``data``); the job records it so a resume brings it back."""
    # fmt: on

    def __post_init__(self) -> None:
        if isinstance(self.rl, dict):
            self.rl = RL.from_dict(self.rl)
        if isinstance(self.client, dict):
            self.client = ClientModel.from_dict(self.client)
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
        """Plain JSON-ready dict (``betas`` as a list). A tenant whose data is held in memory (a DataFrame,
        ...) has none: :class:`SpecError` says to launch it or to write the data to a file."""
        held = in_memory_problems(self)
        if held:
            raise SpecError(held)
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas) if isinstance(self.betas, tuple | list) else self.betas
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Tenant) -> Tenant:
        """Build from a dict (e.g. one ``tenants`` entry of ``job.json``); unknown keys raise ``SpecError``.

        Any input gives a ``Tenant`` or ``SpecError``, nothing else; field values are not checked here
        (:func:`mlora_lab.validate.problems` does that) except for nesting too deep to copy."""
        kwargs, problems = _kwargs_for(cls, d, "tenant")
        if isinstance(kwargs.get("rl"), dict):
            problems += _kwargs_for(RL, kwargs["rl"], "tenant.rl")[1]
        if isinstance(kwargs.get("client"), dict):
            problems += _kwargs_for(ClientModel, kwargs["client"], "tenant.client")[1]
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Tenant) else cls(**kwargs)


def _built(cls: type, d: Any, where: str) -> Any:
    """``d`` if it is a ``cls`` already, else ``cls`` built from the dict ``d``; unknown or missing keys raise
    :class:`SpecError` (the nested parts' ``from_dict``)."""
    kwargs, problems = _kwargs_for(cls, d, where)
    if problems:
        raise SpecError(problems)
    return d if isinstance(d, cls) else cls(**kwargs)


@dataclass
class RL:
    """A tenant that learns from rewards instead of fixed rows: GRPO, as TRL 1.16's ``GRPOTrainer``.

    Each optimizer step the job samples ``group_size`` completions of each of the tenant's
    ``batch_size × grad_accum`` prompts (all RL tenants in one batched generation, each row with its own
    adapter; the step then trains in ``grad_accum`` micro-batches of ``batch_size`` prompts), scores them with
    the reward functions (a weighted sum; ``None`` from a function is skipped, as TRL's ``nansum``), turns
    the rewards into advantages within each prompt's group, ``A = (r - mean) / (std + 1e-4)`` (std over the
    group with n-1, or the batch, or 1: ``scale_rewards``), and minimises the clipped importance-ratio
    loss over the completion tokens (``loss_type``), plus ``beta`` times the KL to the base model (the
    shared base with the adapter switched off). The tenant's data rows are prompts: ``{"prompt": ...}`` or
    ``{"messages": [...]}`` (the chat template with the generation prompt), and any other fields, which
    reach the reward functions as keyword arguments. See :mod:`mlora_lab.rl.rewards` for how reward
    functions are called."""

    # fmt: off
    reward: str | list[str] = field(metadata=_meta(
        "reward", kind="rewards", section="RL", max=MAX_REWARDS, help="module:function or file.py:function"))
    """The reward function, ``"module:function"`` or ``"path/to/file.py:function"`` (a relative file is
    taken from where the job is launched), or a list of them whose rewards are summed (``reward_weights``)."""
    reward_weights: list[float] | None = field(default=None, metadata=_meta(
        "reward weights", kind="numbers", section="RL", optional=True, help="one per reward function"))
    """A weight per reward function (default 1 each); the tenant's reward is their weighted sum."""
    group_size: int = field(default=8, metadata=_meta(
        "group size", section="RL", min=2, max=MAX_GROUP, help="completions sampled per prompt"))
    """Completions per prompt (TRL's ``num_generations``): advantages compare completions of one prompt."""
    max_new_tokens: int = field(default=64, metadata=_meta(
        "max new tokens", section="RL", min=1, max=MAX_NEW_TOKENS, help="longest completion"))
    """Longest completion (TRL's ``max_completion_length``); prompt and completion fit ``seq_len``."""
    temperature: float = field(default=1.0, metadata=_meta(
        "temperature", kind="float", section="RL", min=0, min_open=True, max=100, help="sampling temperature"))
    """Sampling temperature (> 0: a group of greedy completions would all be the same); the training
    forward scores completions at it too (``log_softmax(logits / temperature)``, as TRL)."""
    top_p: float = field(default=1.0, metadata=_meta(
        "top p", kind="float", section="RL", min=0, min_open=True, max=1, help="nucleus sampling"))
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = field(default=0, metadata=_meta(
        "top k", section="RL", min=0, max=2**31 - 1, help="0: all tokens"))
    """Sample from the ``top_k`` most likely tokens only (0: no limit)."""
    stop: list[str] = field(default_factory=list, metadata=_meta(
        "stop", kind="texts", section="RL", max=64, help="strings that end a completion"))
    """Strings that end a completion (besides EOS and ``max_new_tokens``); the stop string is kept."""
    loss_type: str = field(default="dapo", metadata=_meta(
        "loss type", kind="choice", choices=LOSS_TYPES, section="RL", help="TRL's loss_type"))
    """How per-token terms make the loss, as TRL's ``loss_type`` (:data:`LOSS_TYPES`; ``dapo``: summed over
    every completion token of the step and divided by their number)."""
    epsilon: float = field(default=0.2, metadata=_meta(
        "epsilon", kind="float", section="RL", min=0, min_open=True, max=10, help="clip the ratio to 1 ± epsilon"))
    """The importance ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``."""
    epsilon_high: float | None = field(default=None, metadata=_meta(
        "epsilon high", kind="float", section="RL", min=0, min_open=True, max=100, optional=True,
        null_means="same as epsilon", help="upper clip (DAPO); null: epsilon"))
    """Upper clip of the ratio (DAPO's clip-higher); ``None``: ``epsilon``. For ``cispo`` the cap of the ratio."""
    beta: float = field(default=0.0, metadata=_meta(
        "beta", kind="float", section="RL", min=0, max=100, help="KL weight to the base model"))
    """Weight of the KL to the reference, the base model without the adapter (0: no reference pass)."""
    num_iterations: int = field(default=1, metadata=_meta(
        "iterations", section="RL", min=1, max=64, help="updates per generation"))
    """Optimizer steps on each generation's completions (TRL's ``num_iterations``, μ)."""
    scale_rewards: str = field(default="group", metadata=_meta(
        "scale rewards", kind="choice", choices=SCALE_REWARDS, section="RL", help="advantage std: group/batch/none"))
    """Divide advantages by the reward std of the prompt's group, of the whole batch, or not at all."""
    mask_truncated_completions: bool = field(default=False, metadata=_meta(
        "mask truncated", kind="bool", section="RL", help="no loss on completions cut at max_new_tokens"))
    """Leave completions that hit ``max_new_tokens`` without EOS or a stop string out of the loss (as TRL)."""
    reward_timeout_s: float = field(default=60.0, metadata=_meta(
        "reward timeout", kind="float", section="RL", min=0, min_open=True, max=86_400,
        help="seconds a reward call may take"))
    """Seconds one call of the tenant's reward functions may take; past it the tenant is quarantined."""
    log_completions: int = field(default=2, metadata=_meta(
        "log completions", section="RL", min=0, max=64, help="samples kept per logged step"))
    """Sampled completions (with their rewards) kept per logged step, shown by the dashboard."""
    # fmt: on

    @property
    def rewards(self) -> list[str]:
        """``reward`` as a list."""
        return [self.reward] if isinstance(self.reward, str) else list(self.reward)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | RL) -> RL:
        """Build from a dict (``rl`` of a tenant in ``job.json``); unknown or missing keys raise
        ``SpecError``."""
        return _built(cls, d, "rl")


@dataclass
class ClientModel:
    """The Tinker model (a training client's LoRA) behind a served job's tenant: its id, the API key that made
    it, and its ``LoraConfig``. The job writes it into ``job.json`` when the client creates the model; a resume
    registers the model again under its id and owner (its saved states stay reachable), and its client has
    ``Service.session_timeout`` to come back before the tenant is saved and paused."""

    # fmt: off
    model_id: str = field(metadata=_meta("model id", kind="text", section="Service", max=255,
                                         help="the Tinker model id"))
    owner: str = field(metadata=_meta("owner", kind="text", section="Service", max=255,
                                      help="the name of the API key that made it"))
    seed: int | None = field(default=None, metadata=_meta(
        "seed", section="Service", min=0, max=MAX_SEED, optional=True, help="its LoRA init seed"))
    train_attn: bool = field(default=True, metadata=_meta("train attn", kind="bool", section="Service"))
    train_mlp: bool = field(default=True, metadata=_meta("train mlp", kind="bool", section="Service"))
    train_unembed: bool = field(default=True, metadata=_meta("train unembed", kind="bool", section="Service"))
    # fmt: on

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | ClientModel) -> ClientModel:
        """Build from a dict (``client`` of a tenant in ``job.json``); unknown or missing keys raise
        ``SpecError``."""
        return _built(cls, d, "client")


@dataclass
class Parallel:
    """How the job is laid out over processes: ``fsdp * tp`` must divide ``world_size``, and ``ep``
    the ``world_size / tp`` data-parallel ranks (expert parallelism borrows from them)."""

    # fmt: off
    nproc: int = field(default=1, metadata=_meta(
        "nproc", section="Parallel", min=1, max=MAX_DEGREE, slider=True,
        help="processes (ranks) on this machine"))
    """Processes (ranks) per node."""
    nnodes: int = field(default=1, metadata=_meta(
        "nnodes", section="Parallel", min=1, max=MAX_DEGREE, form=False))
    """Nodes."""
    fsdp: int = field(default=1, metadata=_meta(
        "fsdp", section="Parallel", min=1, max=MAX_DEGREE, help="shard group size: a divisor of nproc / tp"))
    """FSDP2 shard-group size (data parallel over the rest)."""
    tp: int = field(default=1, metadata=_meta(
        "tp", section="Parallel", min=1, max=MAX_DEGREE,
        help="tensor parallel: ranks that split every projection"))
    """Tensor-parallel degree."""
    ep: int = field(default=1, metadata=_meta(
        "ep", section="Parallel", min=1, max=MAX_DEGREE,
        help="expert parallel (MoE): a divisor of nproc / tp and of the experts"))
    """Expert-parallel degree (MoE models): groups of ``ep`` data-parallel ranks split the experts."""
    # fmt: on

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
class Service:
    """The job also serves the Tinker API (:mod:`mlora_lab.service`): programs drive their own tenants with
    the official ``tinker`` SDK, request by request, and the requests of every client that wait at the same
    moment share one mixed-tenant step. Rank 0 serves HTTP on a thread; every request needs an API key
    (``<run_dir>/service/keys.json``, owner-only). The job stays up until it is stopped (as ``serve``)."""

    # fmt: off
    host: str = field(default="127.0.0.1", metadata=_meta(
        "host", kind="text", section="Service", max=255, help="address to listen on (loopback by default)"))
    """The address the server listens on: loopback unless told otherwise (``"0.0.0.0"``: every interface)."""
    port: int = field(default=0, metadata=_meta(
        "port", section="Service", min=0, max=MAX_PORT, help="0: any free port"))
    """The TCP port; 0 = a free one, chosen when the server starts (``service/endpoint.json`` says which)."""
    lora_alpha: float = field(default=32.0, metadata=_meta(
        "lora alpha", kind="float", section="Service", min=0, min_open=True,
        help="alpha of the clients' adapters (Tinker has none)"))
    """LoRA alpha of every client's adapter: Tinker's ``LoraConfig`` has a rank and no alpha."""
    max_queue: int = field(default=4096, metadata=_meta(
        "max queue", section="Service", min=1, max=MAX_QUEUE, help="waiting requests; more are answered 429"))
    """Requests that may wait at once; past it a request is answered 429 (the SDK retries it). One source (a
    model's numbered requests, or one key's samples) holds at most a quarter of them."""
    session_timeout: float = field(default=60.0, metadata=_meta(
        "session timeout", kind="float", section="Service", min=1, max=MAX_SESSION_TIMEOUT,
        help="seconds without heartbeat before a client's tenants are saved and paused"))
    """Seconds a client may be silent (no heartbeat nor request; the SDK heartbeats every 10 s) before its
    tenants are saved and paused; a request of its brings them back."""
    max_step_tokens: int | None = field(default=None, metadata=_meta(
        "max step tokens", section="Service", min=1, max=MAX_COUNT, optional=True, null_means="no limit",
        help="datum tokens one step takes at most; more wait for the next"))
    """The input tokens of the clients' datums one step of the loop takes at most: the forward/backward
    requests waiting beyond it run in the next steps (each model's in order, the models taking turns to go
    first; one request larger than it runs alone). A step's activation memory grows with its tokens, so this
    bounds it however many clients send at once; on a CPU a smaller step also costs less per token (its
    working set stays in cache), while a GPU gains from big steps. ``None``: every waiting request."""
    # fmt: on

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Service) -> Service:
        """Build from a dict (``service`` of ``job.json``); unknown keys raise ``SpecError``."""
        kwargs, problems = _kwargs_for(cls, d, "service")
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Service) else cls(**kwargs)


@dataclass
class JobSpec:
    """A whole job: one frozen base model, its tenants, and the job-wide settings. ``= job.json``."""

    # fmt: off
    base_model: str = field(metadata=_meta("base model", kind="dir", form=False))
    """Local directory of a transformers causal LM (``save_pretrained`` layout), or a ``.gguf`` file (or a
    directory holding one ``.gguf`` and no ``config.json``), converted once into a cache by
    ``mlora_lab.bases.resolve_base``; nothing is downloaded."""
    tenants: list[Tenant] = field(metadata=_meta("tenants", kind="tenants", form=False))
    """The tenants to train (may be empty with ``serve=True`` or a ``service``)."""
    name: str | None = field(default=None, metadata=_meta(
        "run name", kind="text", section="Job", optional=True, max=MAX_RUN_NAME_LEN,
        help="shown in every label; empty: made from the tenants' names"))
    """The run's name, shown in every label (legends, progress rows, the runs table, the dashboard's
    header; ``run / tenant`` when runs are shown together) and the key of its tenants' colours, so that a
    notebook run again keeps its colours: at most ``MAX_RUN_NAME_LEN`` printable characters. ``None`` =
    made from the tenants' names when the spec is resolved (:func:`default_run_name`: ``"alice+bob"``),
    which a launch does before it writes ``job.json``. The run directory keeps its timestamped id."""
    tokenizer: str | None = field(default=None, metadata=_meta(
        "tokenizer", kind="dir", optional=True, form=False))
    """Tokenizer directory; ``None`` = ``base_model``."""
    seq_len: int = field(default=512, metadata=_meta(
        "seq len", section="Job", min=2, max=MAX_SEQ_LEN, help="tokens per row; longer rows are cut"))
    """Rows are truncated to this many tokens (with a warning) and right-padded."""
    max_tenants: int = field(default=8, metadata=_meta(
        "max tenants", section="Job", min=1, max=MAX_SLOTS,
        help="most tenants at once; a free slot costs nothing"))
    """The most tenants the job can hold at once (a limit: a free slot allocates nothing)."""
    max_rank: int = field(default=64, metadata=_meta(
        "max rank", section="Job", min=1, max=MAX_SLOTS, help="largest rank of a tenant, now or added later"))
    """The largest rank a tenant (present or added later) may have (a limit: each tenant's tensors have
    its own rank)."""
    parallel: Parallel = field(default_factory=Parallel, metadata=_meta(
        "parallel", kind="parallel", form=False))
    """Process layout (ranks, FSDP / TP / EP degrees)."""
    dtype: str = field(default="float32", metadata=_meta(
        "dtype", kind="choice", choices=DTYPES, section="Job",
        help="of the frozen base (adapters stay float32)"))
    """dtype of the frozen base: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    log_every: int = field(default=1, metadata=_meta(
        "log every", section="Logging", min=1, max=MAX_COUNT, help="write train metrics every N steps"))
    """Write train metrics every this many steps."""
    eval_every: int = field(default=0, metadata=_meta(
        "eval every", section="Logging", min=0, max=MAX_COUNT,
        help="evaluate every N steps; 0 = only at the end"))
    """Evaluate tenants with ``eval_data`` every this many steps; 0 = never (only at the end)."""
    save_every: int = field(default=0, metadata=_meta(
        "save every", section="Logging", min=0, max=MAX_COUNT,
        help="save adapters and a checkpoint every N steps; 0 = only at the end"))
    """Save adapters and a checkpoint every this many steps; 0 = only at the end."""
    report_to: list[str] | str = field(default_factory=list, metadata=_meta(
        "report to", kind="trackers", section="Logging", form=False,
        help="mirror metrics to tensorboard, trackio, wandb"))
    """Experiment trackers that rank 0 mirrors every metrics row to while the job runs: a list of
    ``"tensorboard"``, ``"trackio"``, ``"wandb"``, or ``"all"`` (those installed) / ``"none"``, as
    transformers' ``report_to``. Each is an optional extra; one that is not installed is a validation
    problem, one that fails while the job runs is said once in its events and never ends it
    (:mod:`mlora_lab.trackers`). W&B runs offline unless ``WANDB_MODE`` says otherwise."""
    report_group: str = field(default="tenant", metadata=_meta(
        "report group", kind="choice", choices=REPORT_GROUPS, section="Logging", form=False,
        help="a tracker run per tenant, or one for the job"))
    """``"tenant"``: one tracker run per tenant, on its own tenant step, grouped under the job (W&B and
    trackio ``group=``), plus one run of the job's own rows (system, events); ``"job"``: one run for the
    whole job, on the global step, every tenant's metric under its name (``train/loss/alice``)."""
    logging_dir: str | None = field(default=None, metadata=_meta(
        "logging dir", kind="dir", optional=True, form=False))
    """Where the trackers write (``tensorboard/``, ``wandb/``, ``trackio/`` in it); ``None`` = the run
    directory's ``trackers/``, unless ``WANDB_DIR`` / ``TRACKIO_DIR`` are set: nothing leaves the run
    directory unless asked."""
    project: str | None = field(default=None, metadata=_meta(
        "project", kind="id", optional=True, form=False))
    """The W&B / trackio project the tracker runs go to; ``None`` = ``WANDB_PROJECT`` for W&B, else
    ``"mlora_lab"``."""
    serve: bool = field(default=False, metadata=_meta(
        "serve", kind="bool", section="Job", help="stay up for tenants added later"))
    """Stay up after all tenants finish, waiting for tenants added from the notebook."""
    seed: int = field(default=0, metadata=_meta(
        "job seed", section="Advanced", min=0, max=MAX_SEED, help="order in which tenants' rows are mixed"))
    """Job-wide seed (batch mixing order)."""
    output_dir: str | None = field(default=None, metadata=_meta(
        "output dir", kind="dir", optional=True, form=False))
    """Run directory; ``None`` = a new directory under ``runs/`` chosen at launch."""
    activation_checkpointing: bool | int = field(default=0, metadata=_meta(
        "checkpointing", section="Advanced", min=0, max=MAX_SLOTS, bool_ok=True,
        help="recompute activations: 0 = off, k = every k-th block"))
    """Recompute decoder blocks' activations in the backward instead of keeping them: 0 (or false) =
    off, 1 (or true) = every block, k = every k-th block (blocks 0, k, 2k, ...)."""
    packing: bool = field(default=False, metadata=_meta(
        "packing", kind="bool", section="Advanced", help="pack each tenant's rows into seq_len sequences"))
    """Pack each tenant's rows into ``seq_len``-token sequences (documents kept whole and apart: position
    ids restart and no token attends across a document boundary) instead of one right-padded row each;
    ``batch_size`` then counts packed sequences."""
    slot_modules: list[str] | None = field(default=None, metadata=_meta(
        "slot modules", kind="targets", optional=True, form=False))
    """Linear layers that can take adapters (same matching as ``target_modules``, except that
    ``"all-linear"`` may come with other names: the union); ``None`` = the union of the tenants'
    ``target_modules``. Set it so that tenants added later may target modules no initial tenant uses
    (the layers are wrapped once, when the job starts; wrapping allocates nothing per tenant)."""
    service: Service | None = field(default=None, metadata=_meta(
        "service", kind="service", optional=True, form=False, help="serve the Tinker API"))
    """``None``: no service. A :class:`Service`: the job also serves the Tinker API (``ml.serve(spec)``), on
    one process for now, and stays up until it is stopped."""
    # fmt: on

    def __post_init__(self) -> None:
        if isinstance(self.service, dict):
            self.service = Service.from_dict(self.service)
        self.base_model = _path_str(self.base_model)
        self.tokenizer = _path_str(self.tokenizer)
        self.output_dir = _path_str(self.output_dir)
        self.logging_dir = _path_str(self.logging_dir)

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, field order as in ``job.json``. A tenant whose data is held in memory
        makes it :class:`SpecError` (naming every such tenant): job.json names files, so launch the spec
        (the launch writes the rows into the run directory) or write the data to a file."""
        tenants = self.tenants if isinstance(self.tenants, list | tuple) else []
        held = [p for t in tenants if isinstance(t, Tenant) for p in in_memory_problems(t)]
        if held:
            raise SpecError(held)
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "tenants":
                value = [t.to_dict() if isinstance(t, Tenant) else copy.deepcopy(t) for t in value]
            elif f.name in ("parallel", "service"):
                value = value.to_dict() if isinstance(value, Parallel | Service) else copy.deepcopy(value)
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
                    f" ({brief(t['name'])})" if isinstance(t, dict) and "name" in t else ""
                )
                t_kwargs, t_problems = _kwargs_for(Tenant, t, label)
                if isinstance(t_kwargs.get("rl"), dict):
                    t_problems += _kwargs_for(RL, t_kwargs["rl"], f"{label}.rl")[1]
                if isinstance(t_kwargs.get("client"), dict):
                    t_problems += _kwargs_for(ClientModel, t_kwargs["client"], f"{label}.client")[1]
                problems += t_problems
                if not t_problems:
                    built.append(t if isinstance(t, Tenant) else Tenant(**t_kwargs))
            kwargs["tenants"] = built
        if "parallel" in kwargs:
            p_kwargs, p_problems = _kwargs_for(Parallel, kwargs["parallel"], "parallel")
            problems += p_problems
            if not p_problems and not isinstance(kwargs["parallel"], Parallel):
                kwargs["parallel"] = Parallel(**p_kwargs)
        if kwargs.get("service") is not None:
            s_kwargs, s_problems = _kwargs_for(Service, kwargs["service"], "service")
            problems += s_problems
            if not s_problems and not isinstance(kwargs["service"], Service):
                kwargs["service"] = Service(**s_kwargs)
        if problems:
            raise SpecError(problems)
        return cls(**kwargs)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The spec as JSON text (indent 2); with ``path``, also write it there atomically. A tenant's
        ``data`` / ``eval_data`` below the file's own directory is written relative to it (:meth:`load`
        resolves it there again): a run directory that is copied or moved reads its own copy of the rows
        a launch wrote into it (``data/<tenant>/train.jsonl``), not the original's."""
        d = self.to_dict()
        if path is not None:
            here = os.path.dirname(os.path.abspath(os.fspath(path)))
            for t in d["tenants"] if isinstance(d["tenants"], list) else []:
                for key in ("data", "eval_data"):
                    if isinstance(t, dict) and isinstance(t.get(key), str):
                        t[key] = _relative_below(t[key], here)
        text = json.dumps(d, indent=2)
        if path is not None:
            from mlora_lab.rundir.files import atomic_write_text  # the one atomic write (rundir owns files)

            atomic_write_text(path, text + "\n")
        return text

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        """Parse ``job.json`` text; bad JSON or bad keys raise ``SpecError``. Paths are kept as written."""
        value, why = parse_json(text)
        if why is not None:
            raise SpecError(f"job spec is not valid JSON: {why}")
        return cls.from_dict(value)

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
        name = show_path(path)
        d, why = read_json(path, "a job file")
        if why:
            raise SpecError(f"{name}: {why}")
        if not isinstance(d, dict):
            raise SpecError(
                f"{name}: the top level must be a JSON object with base_model and tenants (got {json_type(d)})"
            )
        return cls.from_dict(d).resolved(os.path.dirname(os.path.abspath(path)))

    def resolved(self, base_dir: str | os.PathLike) -> JobSpec:
        """A copy whose relative paths (base_model, tokenizer, logging_dir, data, eval_data, init_adapter) are
        made absolute against ``base_dir`` (absolute paths and ``None`` are kept), and whose ``name``, if
        ``None``, is :func:`default_run_name`."""
        base = os.path.abspath(os.fspath(base_dir))
        # In-memory data (a DataFrame, ...) is shared with the copy, not copied: it is never changed here.
        tenants = self.tenants if isinstance(self.tenants, list | tuple) else []
        memo = {
            id(v): v
            for t in tenants
            if isinstance(t, Tenant)
            for v in (t.data, t.eval_data)
            if memory_kind(v) is not None
        }
        out = copy.deepcopy(self, memo)
        if out.name is None:
            out.name = default_run_name(out)
        out.base_model = _resolve(out.base_model, base)
        out.tokenizer = _resolve(out.tokenizer, base)
        out.logging_dir = _resolve(out.logging_dir, base)
        for t in out.tenants:
            if isinstance(t, Tenant):
                t.data = _resolve(t.data, base)
                t.eval_data = _resolve(t.eval_data, base)
                t.init_adapter = _resolve(t.init_adapter, base)
                if isinstance(t.rl, RL):
                    t.rl.reward = (
                        resolve_reward(t.rl.reward, base)
                        if isinstance(t.rl.reward, str)
                        else [resolve_reward(r, base) for r in t.rl.reward]
                        if isinstance(t.rl.reward, list)
                        else t.rl.reward
                    )
        return out

    # -- lookup --------------------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name``; ``KeyError`` naming the known tenants otherwise."""
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(f"no tenant {name!r}; tenants: {[t.name for t in self.tenants]}")


def default_run_name(job: JobSpec) -> str:
    """A readable name for a run that was given none: its tenants' names joined by ``+`` (at most three,
    then how many more: ``"a+b+c+4 more"``), cut to 60 characters; ``"serve"`` for a serving job (or one
    with a ``service``) without tenants, ``"run"`` for none at all."""
    tenants = job.tenants if isinstance(job.tenants, list | tuple) else []
    names = [t.name for t in tenants if isinstance(t, Tenant) and isinstance(t.name, str) and t.name]
    if not names:
        return "serve" if job.serve is True or job.service is not None else "run"
    text = "+".join(names[:3]) + (f"+{len(names) - 3} more" if len(names) > 3 else "")
    return text if len(text) <= 60 else text[:59] + "…"


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
        names = sorted({m for ts in targets if valid_targets(ts) for m in ts})
    if ALL_LINEAR not in names:
        return list(names)
    return [ALL_LINEAR, *(n for n in names if n != ALL_LINEAR)]


def valid_targets(v: Any, union: bool = False) -> bool:
    """A list of at most ``MAX_TARGETS`` non-empty names (each at most 1000 characters), with
    ``"all-linear"`` only on its own, as PEFT takes it (in a list with other names PEFT reads it as
    one more plain name, which matches no layer); with ``union`` (``slot_modules``, which PEFT never
    sees) ``"all-linear"`` may come with other names and the list selects the union."""
    if not isinstance(v, list | tuple) or len(v) > MAX_TARGETS:
        return False
    if not all(isinstance(x, str) and 0 < len(x) <= 1000 for x in v):
        return False
    return union or ALL_LINEAR not in v or len(v) == 1


def tenant_label(name: Any) -> str:
    """How messages name a tenant: ``tenant 'alice'`` (a valid name is never shortened)."""
    return f"tenant {brief(name, MAX_NAME_LEN + 2)}"


def in_memory_problems(t: Tenant) -> list[Problem]:
    """One problem per field of ``t`` (``data``, ``eval_data``) that holds rows in memory rather than a
    path: what :meth:`Tenant.to_dict` and :meth:`JobSpec.to_dict` refuse, since job.json names files."""
    out = []
    for name in ("data", "eval_data"):
        value = getattr(t, name)
        if memory_kind(value) is None:
            continue
        label = t.name if isinstance(t.name, str) else None
        out.append(
            Problem(
                label,
                name,
                f"{name} is {describe(value)} held in memory, which job.json cannot hold: launch the spec "
                "(ml.launch writes the rows into the run directory and names that file) or write the rows "
                "to a file and give its path (df.to_json('rows.jsonl', orient='records', lines=True))",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Building the dataclasses from hostile dicts
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
            hints.append(brief(k) + (f" (did you mean {close[0]!r}?)" if close else ""))
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
    deep = [
        k
        for k, v in d.items()
        if k in fields and k not in ("tenants", "parallel", "service") and _too_deep(v)
    ]
    problems += [f"{where}: {k} is nested more than {_MAX_DEPTH} levels deep" for k in deep]
    if cls is Tenant:  # a dict is JSON (job.json, a control message): it names files, never holds rows
        problems += [
            f"{where}: {k} must be a file path (got {json_type(d[k])}); rows held in memory are for the "
            "notebook's Tenant, which a launch writes to a file"
            for k in ("data", "eval_data")
            if isinstance(d.get(k), list | dict)
        ]
    return {k: v for k, v in d.items() if k in fields and k not in deep}, problems


def resolve_reward(ref: Any, base: str) -> Any:
    """A reward ``"path/to/file.py:function"`` with a relative file made absolute against ``base``; a
    ``"module:function"`` (no ``/`` and no ``.py``) and anything else are kept."""
    if not isinstance(ref, str):
        return ref
    target, sep, function = ref.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if not sep or not target or not is_file:
        return ref
    return f"{_resolve(target, base)}:{function}"


def _relative_below(path: str, base: str) -> str:
    """``path`` relative to ``base`` when it is an absolute path below ``base`` (lexically), else as it is."""
    if not os.path.isabs(path):
        return path
    try:
        if os.path.commonpath([os.path.normpath(path), base]) != base:
            return path
    except ValueError:  # (different drives)
        return path
    return os.path.relpath(os.path.normpath(path), base)


def _resolve(path: Any, base: str) -> Any:
    if not isinstance(path, str) or not path:
        return path
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base, expanded))
