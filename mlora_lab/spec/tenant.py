"""What a tenant is: one LoRA adapter of a job (:class:`Tenant`), its JSON form, and what each field means.

    t = Tenant(name="alice", data="alice.jsonl", heldout_data="alice_heldout.jsonl", rank=8, lr=2e-4)
    Tenant.from_dict(d)        # one ``tenants`` entry of job.json (or a control message): SpecError or a Tenant
    t.to_dict()                # JSON-ready; rows held in memory are refused (job.json names files)

A tenant trains on ``data`` and, given ``heldout_data``, is measured on it: the mean loss of those rows every
``JobSpec.heldout_every`` steps, logged as the run directory's ``eval`` rows (their ``kind`` keeps that name,
:data:`mlora_lab.rundir.HELDOUT_KIND`). "Eval" in code means the generation evaluations of
:class:`~mlora_lab.spec.parts.Eval`. The job holding its tenants is :mod:`mlora_lab.spec.job`; the field
machinery both are built with is :mod:`mlora_lab.spec.fields`; where a tenant's paths point,
:mod:`mlora_lab.spec.paths`; its old field names (``eval_data``), :mod:`mlora_lab.spec.renames`.

Light contract (no torch), and every input is hostile: any dict gives a ``Tenant`` or ``SpecError``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.sources import HubDataset, describe, memory_kind, reward_in_memory
from mlora_lab.spec.fields import (
    MAX_COUNT,
    MAX_LR,
    MAX_ROWS,
    MAX_SEED,
    MAX_SLOTS,
    MAX_WEIGHT_DECAY,
    Problem,
    SpecError,
    kwargs_for,
    meta,
)
from mlora_lab.spec.parts import RL, ClientModel, Preference
from mlora_lab.spec.paths import TENANT_FILES, path_str
from mlora_lab.spec.renames import RENAMED, add_old_names, renamed_keys, warn_old_keys
from mlora_lab.text import json_type

SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate schedules a tenant may use; every one starts with ``warmup_steps`` of linear warmup."""


@dataclass
class Tenant:
    """One LoRA adapter trained in the job: its data, its LoRA shape and its own optimizer settings."""

    # fmt: off
    name: str = field(metadata=meta(
        "name", kind="name", section="Data", help="letters, digits, . _ - (it names a directory)",
        empty="enter a name for this tenant"))
    """Unique name; it becomes a directory name (``adapters/<name>/``), so only ``[A-Za-z0-9._-]``."""
    data: str | Any = field(metadata=meta(
        "data", kind="path", section="Data", help=".jsonl/.json/.parquet/.csv rows: text, prompt/completion or messages",
        empty="choose a training data file"))
    """Training data: rows of ``text``, ``prompt``/``completion`` or ``messages``, from a ``.jsonl``,
    ``.json``, ``.parquet`` or ``.csv`` file, or (in the notebook) a pandas DataFrame, a list of dicts or
    a ``datasets.Dataset`` (:mod:`mlora_lab.sources`). job.json holds only paths: a launch (and
    ``run.add_tenant``) writes an in-memory source into the run directory and names that file there."""
    heldout_data: str | Any | None = field(default=None, metadata=meta(
        "held-out data", kind="path", section="Data", optional=True, help="optional held-out rows, same format"))
    """Optional held-out rows (any source ``data`` takes), never trained on: their mean loss is logged every
    ``JobSpec.heldout_every`` steps and at the end (the run directory's ``eval`` rows). Called ``eval_data``
    before (``Tenant(eval_data=...)``, ``t.eval_data`` and a job file's ``"eval_data"`` still mean it, with a
    ``DeprecationWarning``, until :data:`~mlora_lab.spec.renames.REMOVAL`): "eval" means the generation
    evaluations (``JobSpec.evals``)."""
    init_adapter: str | None = field(default=None, metadata=meta(
        "init adapter", kind="dir", section="Advanced", optional=True,
        help="optional PEFT adapter directory to start from"))
    """Optional PEFT LoRA adapter directory to start from; its r, alpha, rsLoRA and targets must match."""
    rank: int = field(default=8, metadata=meta(
        "rank", section="LoRA", min=1, max=MAX_SLOTS, at_most="max_rank", slider=True,
        help="LoRA rank r, at most the job's max_rank"))
    """LoRA rank r (1 .. ``JobSpec.max_rank``)."""
    alpha: float = field(default=16, metadata=meta(
        "alpha", kind="float", section="LoRA", min=0, min_open=True,
        help="the delta is scaled by alpha / rank"))
    """LoRA alpha; the delta is scaled by :attr:`scaling`."""
    use_rslora: bool = field(default=False, metadata=meta(
        "rsLoRA", kind="bool", section="LoRA", help="scale by alpha / sqrt(rank) instead"))
    """rsLoRA: scale by ``alpha / sqrt(rank)`` instead of ``alpha / rank``."""
    dropout: float = field(default=0.0, metadata=meta(
        "dropout", kind="float", section="LoRA", min=0, max=1, max_open=True, slider=True, typical=(0.0, 0.5),
        step=0.01, help="dropout on the LoRA input"))
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"], metadata=meta(
        "target modules", kind="targets", section="LoRA",
        help="all-linear: every linear layer but the output"))
    """Linear layers to adapt, matched as PEFT does (full name or ``.``-suffix), or ``["all-linear"]`` (every
    ``nn.Linear`` but the output layer); the rules live in :mod:`mlora_lab.lora.targets`."""
    target_parameters: list[str] = field(default_factory=list, metadata=meta(
        "target parameters", kind="targets", form=False, help="packed MoE expert weights to adapt"))
    """3-D packed MoE expert parameters to adapt (e.g. ``mlp.experts.gate_up_proj``), PEFT-style."""
    lr: float = field(default=2e-4, metadata=meta(
        "lr", kind="log-float", section="Optimizer", min=0, min_open=True, max=MAX_LR, typical=(1e-6, 1e-1),
        help="peak learning rate, used exactly as typed"))
    """Peak learning rate of this tenant's AdamW (at most :data:`MAX_LR`)."""
    weight_decay: float = field(default=0.0, metadata=meta(
        "weight decay", kind="float", section="Advanced", min=0, max=MAX_WEIGHT_DECAY, help="AdamW weight decay"))
    """AdamW weight decay (at most :data:`MAX_WEIGHT_DECAY`)."""
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=meta(
        "betas", kind="pair", min=0, max=1, max_open=True, form=False))
    """AdamW betas (a JSON list in ``job.json``)."""
    eps: float = field(default=1e-8, metadata=meta(
        "eps", kind="float", min=0, min_open=True, max=1, form=False))
    """AdamW epsilon, in (0, 1]."""
    schedule: str = field(default="constant", metadata=meta(
        "schedule", kind="choice", choices=SCHEDULES, section="Optimizer",
        help="after warmup: constant or decay to 0"))
    """Learning-rate schedule after warmup: ``"constant"``, ``"linear"`` or ``"cosine"`` (decay to 0)."""
    warmup_steps: int = field(default=0, metadata=meta(
        "warmup steps", section="Optimizer", min=0, max=MAX_COUNT, help="linear warmup from 0 to lr"))
    """Steps of linear warmup from 0 to ``lr``."""
    max_grad_norm: float | None = field(default=1.0, metadata=meta(
        "max grad norm", kind="float", section="Optimizer", min=0, min_open=True, optional=True,
        null_means="no clipping", help="clip the gradient norm to this"))
    """Clip this tenant's gradient norm to this value; ``None`` disables clipping."""
    batch_size: int = field(default=4, metadata=meta(
        "batch size", section="Optimizer", min=1, max=MAX_ROWS, help="rows of this tenant per micro-batch"))
    """Rows of this tenant in each micro-batch."""
    grad_accum: int = field(default=1, metadata=meta(
        "grad accum", section="Optimizer", min=1, max=MAX_ROWS, help="micro-batches per optimizer step"))
    """Micro-batches per optimizer step."""
    max_steps: int = field(default=100, metadata=meta(
        "max steps", section="Optimizer", min=1, max=MAX_COUNT,
        help="optimizer steps; then the adapter is saved"))
    """Optimizer steps after which this tenant is finished (its adapter is saved and its slot idles)."""
    shuffle: bool = field(default=True, metadata=meta(
        "shuffle", kind="bool", section="Advanced", help="shuffle the rows every epoch"))
    """Shuffle the rows every epoch (seeded by ``seed``)."""
    seed: int = field(default=0, metadata=meta(
        "seed", section="Optimizer", min=0, max=MAX_SEED, help="LoRA init, dropout and data order"))
    """Seed of this tenant's LoRA init, dropout and data order."""
    rl: RL | None = field(default=None, metadata=meta(
        "rl", kind="rl", section="RL", optional=True, form=False, help="learn from rewards (GRPO)"))
    """``None``: supervised rows. An :class:`RL`: the rows are prompts, and the tenant learns from rewards."""
    pref: Preference | None = field(default=None, metadata=meta(
        "pref", kind="pref", section="Preference", optional=True, form=False,
        help="learn from preference pairs (DPO and its family)"))
    """``None``: supervised rows. A :class:`Preference`: the rows are preference pairs (``prompt``, ``chosen``,
    ``rejected``), and the tenant learns to prefer the chosen completion (DPO, IPO, ... as TRL computes them)."""
    client: ClientModel | None = field(default=None, metadata=meta(
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
        if isinstance(self.pref, dict):
            self.pref = Preference.from_dict(self.pref)
        self.data = path_str(self.data)
        self.heldout_data = path_str(self.heldout_data)
        self.init_adapter = path_str(self.init_adapter)
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
        kwargs, problems, old = tenant_kwargs(d, "tenant")
        warn_old_keys("the tenant", old, RENAMED["Tenant"])
        if isinstance(kwargs.get("rl"), dict):
            problems += kwargs_for(RL, kwargs["rl"], "tenant.rl")[1]
        if isinstance(kwargs.get("client"), dict):
            problems += kwargs_for(ClientModel, kwargs["client"], "tenant.client")[1]
        if isinstance(kwargs.get("pref"), dict):
            problems += kwargs_for(Preference, kwargs["pref"], "tenant.pref")[1]
        if problems:
            raise SpecError(problems)
        return d if isinstance(d, Tenant) else cls(**kwargs)


# Tenant(eval_data=...) and t.eval_data: read, with a warning
add_old_names(Tenant, RENAMED["Tenant"])


def step_goal(t: Tenant) -> int | None:
    """The steps a tenant trains to (its ``max_steps``), or None when it has no goal: a Tinker client's
    tenant (its client steps it for as long as it likes; its ``max_steps`` is the largest count) or any
    tenant whose ``max_steps`` is that count. Views show such a tenant's steps done, never ``52/2**53-1``
    nor an ETA."""
    goal = t.max_steps
    if t.client is not None or not isinstance(goal, int) or goal >= MAX_COUNT:
        return None
    return goal


def in_memory_problems(t: Tenant) -> list[Problem]:
    """One problem per field of ``t`` (``data``, ``heldout_data``) that holds rows in memory rather than a
    path: what :meth:`Tenant.to_dict` and :meth:`JobSpec.to_dict` refuse, since job.json names files."""
    out = []
    for name in TENANT_FILES:
        value = getattr(t, name)
        if memory_kind(value) is None or isinstance(value, HubDataset):  # (a Hub dataset is its name)
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
    if isinstance(t.rl, RL) and any(reward_in_memory(v) for _, _, v in _functions(t.rl)):
        out.append(
            Problem(
                t.name if isinstance(t.name, str) else None,
                "rl",
                "rl.reward, rl.env or rl.tools holds a function in memory, which job.json cannot hold: launch "
                "the spec (ml.launch "
                "pickles it into the run directory and names that file) or give 'file.py:function'",
            )
        )
    return out


def tenant_kwargs(d: Any, where: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """:func:`~mlora_lab.spec.fields.kwargs_for` a ``Tenant``, with its old field names read as the new ones:
    ``(kwargs, problems, the old names found)``, the caller warning once per file
    (:func:`~mlora_lab.spec.renames.warn_old_keys`). A problem for each of ``data`` / ``heldout_data`` given
    as rows; an object there is a Hub dataset, as :meth:`Tenant.to_dict` writes one."""
    old: list[str] = []
    problems: list[str] = []
    if isinstance(d, dict):
        d, old, problems = renamed_keys(d, RENAMED["Tenant"], where)
    kwargs, more = kwargs_for(Tenant, d, where)
    problems += more
    if isinstance(d, dict):  # a dict is JSON (job.json, a control message): it names files, never holds rows
        problems += [
            f"{where}: {k} must be a file path (got {json_type(d[k])}); rows held in memory are for the "
            "notebook's Tenant, which a launch writes to a file"
            for k in TENANT_FILES
            if isinstance(d.get(k), list)
        ]
        for k in TENANT_FILES:
            if isinstance(d.get(k), dict):
                hub_kwargs, hub_problems = kwargs_for(HubDataset, d[k], f"{where}.{k} (a Hub dataset)")
                problems += hub_problems
                if not hub_problems:
                    kwargs[k] = HubDataset(**hub_kwargs)
    return kwargs, problems, old


def _functions(rl: RL) -> list[tuple[str, int, Any]]:
    """``rl.functions``, or the rewards alone when the agent fields are not well-formed (validation names them)."""
    try:
        return rl.functions
    except TypeError:
        return [("", i, r) for i, r in enumerate(rl.rewards)]
