"""What a job is: :class:`JobSpec` (one frozen base, its tenants and the job-wide settings), its JSON form
``job.json``, and what each field means.

These are plain dataclasses that store names and paths, never live objects, so a spec round-trips
through ``job.json`` unchanged (the one exception lives only in the notebook: a tenant's rows held in memory,
a DataFrame say, which a launch writes into the run directory before it writes ``job.json``)::

    spec = JobSpec(base_model="models/tiny", tenants=[Tenant(name="alice", data="alice.jsonl")])
    spec.to_json("run/job.json")                # atomic write
    spec = JobSpec.load("run/job.json")         # relative paths resolved against run/

    from mlora_lab.validate import check
    check(spec)                                 # raises SpecError listing *every* problem at once

The contract is a package, and this is the module users write with :mod:`mlora_lab.spec.tenant` (``Tenant``):
the nested parts a spec holds (``Parallel``, ``Service``, ``Eval``, a tenant's ``RL`` and ``ClientModel``) are
in :mod:`mlora_lab.spec.parts`; where its paths point (resolved against ``job.json``'s directory, written back
relative to it) in :mod:`mlora_lab.spec.paths`; its renamed fields, still read under their old names with a
warning (``eval_every``, ``serve``), in :mod:`mlora_lab.spec.renames`; and what every spec dataclass is built
from in :mod:`mlora_lab.spec.fields`: each field's :class:`~mlora_lab.spec.fields.FieldInfo`
(``field_info(JobSpec, "seq_len")``: its label, help line, widget kind, form section and bounds), from which
the notebook forms (:mod:`mlora_lab.lab.forms.builders`) build their inputs and against which the validator
(:mod:`mlora_lab.validate`) checks values, so a new field is one edit here; every bound; and the reader of
hostile dicts.

Two things are measured while a job trains, and the code keeps their names apart: a tenant's *held-out
loss* (``Tenant.heldout_data`` every ``heldout_every`` steps) and the *evaluations* (``evals``: generations
scored by metrics). Only the run directory's held-out rows keep their old ``kind``, ``"eval"`` (a contract
that outside checks and old runs read).

Validation lives in :mod:`mlora_lab.validate` (``problems(spec)``, ``check(spec)``), which imports
this module and never the other way round; the spec holds only the contract it reports in,
:class:`~mlora_lab.spec.fields.Problem` (a tenant, a field, a sentence) and
:class:`~mlora_lab.spec.fields.SpecError`. It imports no torch, transformers or model code: the notebook side
and the training processes both read specs cheaply.

Everything here treats its input as hostile: any JSON (or Python values in the fields) gives
``SpecError``, never another exception, and a message repeats at most ~80 characters of a bad value
(:mod:`mlora_lab.text` shows and reads hostile values).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.lora.targets import ALL_LINEAR
from mlora_lab.sources import memory_kind, reward_in_memory
from mlora_lab.spec.fields import (
    MAX_COUNT,
    MAX_RUN_NAME_LEN,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_SLOTS,
    MAX_TARGETS,
    SpecError,
    kwargs_for,
    meta,
)
from mlora_lab.spec.parts import RL, ClientModel, Eval, Parallel, Preference, Service
from mlora_lab.spec.paths import (
    path_str,
    relative_tenant_paths,
    resolve_model_path,
    resolve_path,
    resolve_reward,
    resolve_tenant_paths,
)
from mlora_lab.spec.renames import RENAMED, add_old_names, renamed_keys, warn_old_keys
from mlora_lab.spec.tenant import Tenant, in_memory_problems, tenant_kwargs
from mlora_lab.text import brief, collection_paused, json_type, parse_json, read_json, show_path

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Base-model dtypes a job may run in."""

QUANTIZE = ("nf4", "int8")
"""How a job may quantize its frozen base (``JobSpec.quantize``): bitsandbytes' 4-bit NormalFloat (QLoRA's)
or LLM.int8."""

TRACKERS = ("tensorboard", "trackio", "wandb")
"""Experiment trackers a job can mirror its metrics rows to (``JobSpec.report_to``), each an optional extra
of the package (``pip install 'mlora_lab[wandb]'``; ``mlora_lab[trackers]`` for all three). ``"all"`` and
``"none"`` are taken as transformers' ``TrainingArguments.report_to`` takes them."""
REPORT_GROUPS = ("tenant", "job")
"""``JobSpec.report_group``: one tracker run per tenant (grouped under the job), or one run for the job."""

# ---------------------------------------------------------------------------------------------
# The dataclasses
# ---------------------------------------------------------------------------------------------


@dataclass
class JobSpec:
    """A whole job: one frozen base model, its tenants, and the job-wide settings. ``= job.json``."""

    # fmt: off
    base_model: str = field(metadata=meta("base model", kind="dir", form=False))
    """A Hub id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``: downloaded once, by validation, into the Hub cache,
    see :mod:`mlora_lab.hub`; a local directory of the same name wins), a local directory of a transformers
    causal LM (``save_pretrained`` layout), or a ``.gguf`` file (or a directory holding one ``.gguf`` and no
    ``config.json``), converted once into a cache by ``mlora_lab.bases.resolve_base``."""
    tenants: list[Tenant] = field(metadata=meta("tenants", kind="tenants", form=False))
    """The tenants to train (may be empty with ``stay_up=True`` or a ``service``)."""
    name: str | None = field(default=None, metadata=meta(
        "run name", kind="text", section="Job", optional=True, max=MAX_RUN_NAME_LEN,
        help="shown in every label; empty: made from the tenants' names"))
    """The run's name, shown in every label (legends, progress rows, the runs table, the dashboard's
    header; ``run / tenant`` when runs are shown together) and the key of its tenants' colours, so that a
    notebook run again keeps its colours: at most ``MAX_RUN_NAME_LEN`` printable characters. ``None`` =
    made from the tenants' names when the spec is resolved (:func:`default_run_name`: ``"alice+bob"``),
    which a launch does before it writes ``job.json``. The run directory keeps its timestamped id."""
    tokenizer: str | None = field(default=None, metadata=meta(
        "tokenizer", kind="dir", optional=True, form=False))
    """Tokenizer directory or Hub id; ``None`` = ``base_model``."""
    revision: str | None = field(default=None, metadata=meta(
        "revision", kind="text", section="Job", optional=True, max=256, form=False, null_means="the main branch",
        help="Hub revision (branch, tag or commit) of a base_model / tokenizer given by its Hub id"))
    """The Hub revision of ``base_model`` and ``tokenizer`` when they are Hub ids (``None``: ``main``); a launch
    records the commit it downloaded, so every process of the run reads the same snapshot."""
    seq_len: int = field(default=512, metadata=meta(
        "seq len", section="Job", min=2, max=MAX_SEQ_LEN, help="tokens per row; longer rows are cut"))
    """Rows are truncated to this many tokens (with a warning) and right-padded."""
    max_tenants: int = field(default=8, metadata=meta(
        "max tenants", section="Job", min=1, max=MAX_SLOTS,
        help="most tenants at once; a free slot costs nothing"))
    """The most tenants the job can hold at once (a limit: a free slot allocates nothing)."""
    max_rank: int = field(default=64, metadata=meta(
        "max rank", section="Job", min=1, max=MAX_SLOTS, help="largest rank of a tenant, now or added later"))
    """The largest rank a tenant (present or added later) may have (a limit: each tenant's tensors have
    its own rank)."""
    parallel: Parallel = field(default_factory=Parallel, metadata=meta(
        "parallel", kind="parallel", form=False))
    """Process layout (ranks, FSDP / TP / EP degrees)."""
    dtype: str = field(default="auto", metadata=meta(
        "dtype", kind="choice", choices=DTYPES, section="Job",
        help="of the frozen base (adapters stay float32); auto: bfloat16 on a GPU that has it, else float32"))
    """dtype of the frozen base: ``"auto"`` (bfloat16 on a GPU that supports it, float32 on the CPU and
    on older GPUs), ``"float32"``, ``"bfloat16"`` or ``"float16"``. Adapters, their gradients and AdamW
    state are float32 whatever it is, as PEFT keeps them."""
    quantize: str | None = field(default=None, metadata=meta(
        "quantize", kind="choice", choices=QUANTIZE, section="Job", optional=True, form=False,
        help="the frozen base in 4-bit nf4 or int8 (bitsandbytes); adapters stay float32"))
    """Quantize the frozen base's linear layers as it loads (bitsandbytes through transformers'
    ``BitsAndBytesConfig``, :mod:`mlora_lab.quant`): ``"nf4"`` (QLoRA's 4-bit NormalFloat, blocks of 64
    with an absmax scale each, the scales quantized again) or ``"int8"`` (LLM.int8: row-wise absmax int8,
    outlier features above 6.0 in 16-bit). ``None``: the base in ``dtype``. The embeddings, the norms and
    the output layer stay in ``dtype``; every LoRA delta is added to the dequantized layer's output, and
    adapters, their gradients and AdamW state stay float32, as PEFT keeps them over a quantized base
    (QLoRA). Needs the ``quant`` extra; one process, or data parallel only (no FSDP, TP or EP)."""
    quantize_embeddings: bool = field(default=False, metadata=meta(
        "quantize embeddings", kind="bool", section="Job", form=False,
        help="with quantize='nf4': the embedding and output layers in nf4 too (QLoRA keeps them in dtype)"))
    """With ``quantize="nf4"``: the input embedding and the output layer in nf4 too (a tied pair stored
    once; :func:`mlora_lab.quant.quantize_embeddings`). QLoRA keeps them in ``dtype``; with a large vocabulary
    they are much of the base (13 % of Llama-3.1-8B), and this takes base memory from ~0.35 to ~0.26 of
    bf16's, at the cost of the output layer's precision (llama.cpp's 4-bit files quantize them too)."""
    log_every: int = field(default=1, metadata=meta(
        "log every", section="Logging", min=1, max=MAX_COUNT, help="write train metrics every N steps"))
    """Write train metrics every this many steps."""
    heldout_every: int = field(default=0, metadata=meta(
        "held-out every", section="Logging", min=0, max=MAX_COUNT,
        help="held-out loss every N steps; 0 = only at the end"))
    """Log the held-out loss of tenants with ``heldout_data`` every this many steps; 0 = only at the end. Called
    ``eval_every`` before (``JobSpec(eval_every=...)``, ``spec.eval_every`` and a job file's ``"eval_every"``
    still mean it, with a ``DeprecationWarning``, until :data:`~mlora_lab.spec.renames.REMOVAL`); the
    evaluations' own schedule is each :class:`~mlora_lab.spec.parts.Eval`'s ``every``."""
    save_every: int = field(default=0, metadata=meta(
        "save every", section="Logging", min=0, max=MAX_COUNT,
        help="save adapters and a checkpoint every N steps; 0 = only at the end"))
    """Save adapters and a checkpoint every this many steps; 0 = only at the end."""
    report_to: list[str] | str = field(default_factory=list, metadata=meta(
        "report to", kind="trackers", section="Logging", form=False,
        help="mirror metrics to tensorboard, trackio, wandb"))
    """Experiment trackers that rank 0 mirrors every metrics row to while the job runs: a list of
    ``"tensorboard"``, ``"trackio"``, ``"wandb"``, or ``"all"`` (those installed) / ``"none"``, as
    transformers' ``report_to``. Each is an optional extra; one that is not installed is a validation
    problem, one that fails while the job runs is said once in its events and never ends it
    (:mod:`mlora_lab.trackers`). W&B runs offline unless ``WANDB_MODE`` says otherwise."""
    report_group: str = field(default="tenant", metadata=meta(
        "report group", kind="choice", choices=REPORT_GROUPS, section="Logging", form=False,
        help="a tracker run per tenant, or one for the job"))
    """``"tenant"``: one tracker run per tenant, on its own tenant step, grouped under the job (W&B and
    trackio ``group=``), plus one run of the job's own rows (system, events); ``"job"``: one run for the
    whole job, on the global step, every tenant's metric under its name (``train/loss/alice``)."""
    logging_dir: str | None = field(default=None, metadata=meta(
        "logging dir", kind="dir", optional=True, form=False))
    """Where the trackers write (``tensorboard/``, ``wandb/``, ``trackio/`` in it); ``None`` = the run
    directory's ``trackers/``, unless ``WANDB_DIR`` / ``TRACKIO_DIR`` are set: nothing leaves the run
    directory unless asked."""
    project: str | None = field(default=None, metadata=meta(
        "project", kind="id", optional=True, form=False))
    """The W&B / trackio project the tracker runs go to; ``None`` = ``WANDB_PROJECT`` for W&B, else
    ``"mlora_lab"``."""
    stay_up: bool = field(default=False, metadata=meta(
        "stay up", kind="bool", section="Job", help="stay up for tenants added later"))
    """Stay up after all tenants finish, waiting for tenants added from the notebook. (Called ``serve``
    before: ``JobSpec(serve=True)``, ``spec.serve`` and a job file's ``"serve"`` still mean it, with a
    ``DeprecationWarning``, until :data:`~mlora_lab.spec.renames.REMOVAL`: mlora_lab 0.3, or 2027-06-01. The
    new name keeps it apart from ``service`` and ``ml.serve``, which serve the Tinker API.)"""
    seed: int = field(default=0, metadata=meta(
        "job seed", section="Advanced", min=0, max=MAX_SEED, help="order in which tenants' rows are mixed"))
    """Job-wide seed (batch mixing order)."""
    output_dir: str | None = field(default=None, metadata=meta(
        "output dir", kind="dir", optional=True, form=False))
    """Run directory; ``None`` = a new directory under ``runs/`` chosen at launch."""
    activation_checkpointing: bool | int = field(default=0, metadata=meta(
        "checkpointing", section="Advanced", min=0, max=MAX_SLOTS, bool_ok=True,
        help="recompute activations: 0 = off, k = every k-th block"))
    """Recompute decoder blocks' activations in the backward instead of keeping them: 0 (or false) =
    off, 1 (or true) = every block, k = every k-th block (blocks 0, k, 2k, ...)."""
    max_pass_tokens: int | None = field(default=None, metadata=meta(
        "max pass tokens", section="Advanced", min=1, max=MAX_COUNT, optional=True, null_means="one pass",
        help="padded tokens of one forward + backward; a larger step runs in several"))
    """At most this many tokens (rows × their padded length) in one forward + backward: a step whose
    tenants' rows hold more runs in several passes, each of whole tenants (at least one), their gradients
    summed before the optimiser steps: the same update, with the activations of one pass at a time instead
    of the whole step's. The tenants still share the step (one generation for the RL tenants; the requests
    of a service's clients that wait together). ``None``: every step in one pass, except in a job that serves
    on a CPU: 1,024 (a served step holds however many clients wait at once, and measured on a CPU its
    throughput was the same in passes). Passes trade time for memory elsewhere (measured on a CPU: a
    4-tenant step of 2,048 tokens ~7 % slower in two passes, its peak RSS 15 % lower); a GPU gains from big
    passes."""
    packing: bool = field(default=False, metadata=meta(
        "packing", kind="bool", section="Advanced", help="pack each tenant's rows into seq_len sequences"))
    """Pack each tenant's rows into ``seq_len``-token sequences (documents kept whole and apart: position
    ids restart and no token attends across a document boundary) instead of one right-padded row each;
    ``batch_size`` then counts packed sequences."""
    lockstep: bool = field(default=False, metadata=meta(
        "lockstep", kind="bool", section="Advanced",
        help="RL tenants wait for their generation: a run repeats bit for bit"))
    """RL tenants that sample ahead (``rl.max_staleness``) or on rollout ranks wait for a generation that is not
    ready instead of sitting the step out. Off (the default), the trainer stays busy, but which tenants share a
    step then depends on timing: each tenant's results are its own up to floating-point reassociation, so a
    sampled token may differ between two runs after some steps. On, a run repeats bit for bit (rewards and
    sampling still overlap training within ``max_staleness``)."""
    slot_modules: list[str] | None = field(default=None, metadata=meta(
        "slot modules", kind="targets", optional=True, form=False))
    """Linear layers that can take adapters (same matching as ``target_modules``, except that
    ``"all-linear"`` may come with other names: the union); ``None`` = the union of the tenants'
    ``target_modules``. Set it so that tenants added later may target modules no initial tenant uses
    (the layers are wrapped once, when the job starts; wrapping allocates nothing per tenant)."""
    service: Service | None = field(default=None, metadata=meta(
        "service", kind="service", optional=True, form=False, help="serve the Tinker API"))
    """``None``: no service. A :class:`Service`: the job also serves the Tinker API (``ml.serve(spec)``), on
    one process for now, and stays up until it is stopped."""
    evals: list[Eval] = field(default_factory=list, metadata=meta(
        "evals", kind="evals", section="Eval", form=False, help="evaluations while training"))
    """Evaluations run while the job trains (:class:`~mlora_lab.spec.parts.Eval`): generations of every
    tenant and the base, scored by metrics, logged as ``eval/<name>/<metric>`` rows."""
    # fmt: on

    def __post_init__(self) -> None:
        if isinstance(self.evals, list | tuple):
            self.evals = [Eval.from_dict(e) if isinstance(e, dict) else e for e in self.evals]
        if isinstance(self.service, dict):
            self.service = Service.from_dict(self.service)
        self.base_model = path_str(self.base_model)
        self.tokenizer = path_str(self.tokenizer)
        self.output_dir = path_str(self.output_dir)
        self.logging_dir = path_str(self.logging_dir)

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, field order as in ``job.json``. A tenant whose data is held in memory
        makes it :class:`SpecError` (naming every such tenant): job.json names files, so launch the spec
        (the launch writes the rows into the run directory) or write the data to a file."""
        tenants = self.tenants if isinstance(self.tenants, list | tuple) else []
        held = [p for t in tenants if isinstance(t, Tenant) for p in in_memory_problems(t)]
        evals = self.evals if isinstance(self.evals, list | tuple) else []
        held += [
            f"evaluation {e.name!r}: its {what} is held in memory; job.json names files (launch the spec, "
            "which writes it into the run directory)"
            for e in evals
            if isinstance(e, Eval)
            for what, held_ in (
                ("data", memory_kind(e.data) is not None),
                ("metric", any(reward_in_memory(m) for m in e.metrics)),
            )
            if held_
        ]
        if held:
            raise SpecError(held)
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "tenants":
                value = [t.to_dict() if isinstance(t, Tenant) else copy.deepcopy(t) for t in value]
            elif f.name in ("parallel", "service"):
                value = value.to_dict() if isinstance(value, Parallel | Service) else copy.deepcopy(value)
            elif f.name == "evals" and isinstance(value, list | tuple):
                value = [e.to_dict() if isinstance(e, Eval) else copy.deepcopy(e) for e in value]
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
        with collection_paused():  # (a million tenants' objects: the collector would scan them for nothing)
            return cls._from_dict(d)

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> JobSpec:
        old: list[str] = []  # the old field names the file holds (read as the new ones, warned once)
        problems: list[str] = []
        if isinstance(d, dict):
            d, old, problems = renamed_keys(d, RENAMED["JobSpec"], "job")
        kwargs, more = kwargs_for(cls, d, "job", nested=("tenants", "parallel", "service", "evals"))
        problems += more
        evals = kwargs.get("evals")
        if "evals" in kwargs and not isinstance(evals, list):
            problems.append(f"evals must be a list (got {type(evals).__name__})")
        elif isinstance(evals, list):
            built_evals = []
            for i, e in enumerate(evals):
                try:
                    built_evals.append(Eval.from_dict(e))
                except SpecError as err:
                    problems += [f"evals[{i}]: {p}" for p in err.problems]
            kwargs["evals"] = built_evals
        tenants = kwargs.get("tenants")
        if "tenants" in kwargs and not isinstance(tenants, list):
            problems.append(f"tenants must be a list (got {type(tenants).__name__})")
        elif isinstance(tenants, list):
            built: list[Tenant] = []
            for i, t in enumerate(tenants):
                label = f"tenants[{i}]" + (
                    f" ({brief(t['name'])})" if isinstance(t, dict) and "name" in t else ""
                )
                t_kwargs, t_problems, t_old = tenant_kwargs(t, label)
                old += t_old
                if isinstance(t_kwargs.get("rl"), dict):
                    t_problems += kwargs_for(RL, t_kwargs["rl"], f"{label}.rl")[1]
                if isinstance(t_kwargs.get("client"), dict):
                    t_problems += kwargs_for(ClientModel, t_kwargs["client"], f"{label}.client")[1]
                if isinstance(t_kwargs.get("pref"), dict):
                    t_problems += kwargs_for(Preference, t_kwargs["pref"], f"{label}.pref")[1]
                problems += t_problems
                if not t_problems:
                    built.append(t if isinstance(t, Tenant) else Tenant(**t_kwargs))
            kwargs["tenants"] = built
        if "parallel" in kwargs:
            p_kwargs, p_problems = kwargs_for(Parallel, kwargs["parallel"], "parallel")
            problems += p_problems
            if not p_problems and not isinstance(kwargs["parallel"], Parallel):
                kwargs["parallel"] = Parallel(**p_kwargs)
        if kwargs.get("service") is not None:
            s_kwargs, s_problems = kwargs_for(Service, kwargs["service"], "service")
            problems += s_problems
            if not s_problems and not isinstance(kwargs["service"], Service):
                kwargs["service"] = Service(**s_kwargs)
        warn_old_keys("job.json", old, RENAMED["JobSpec"] + RENAMED["Tenant"])
        if problems:
            raise SpecError(problems)
        return cls(**kwargs)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The spec as JSON text (indent 2); with ``path``, also write it there atomically. A tenant's
        ``data`` / ``heldout_data`` below the file's own directory is written relative to it (:meth:`load`
        resolves it there again): a run directory that is copied or moved reads its own copy of the rows
        a launch wrote into it (``data/<tenant>/train.jsonl``), not the original's."""
        d = self.to_dict()
        if path is not None:
            here = os.path.dirname(os.path.abspath(os.fspath(path)))
            for t in d["tenants"] if isinstance(d["tenants"], list) else []:
                relative_tenant_paths(t, here)
            for e in d["evals"] if isinstance(d["evals"], list) else []:
                relative_tenant_paths(e, here)  # (an evaluation's data, as a tenant's)
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
        # (a fresh spec: its paths are resolved in place, without resolved()'s deep copy, which
        # took 9 s of a 10-s load for 100k tenants)
        return cls.from_dict(d)._resolve_in_place(os.path.dirname(os.path.abspath(path)))

    def resolved(self, base_dir: str | os.PathLike) -> JobSpec:
        """A copy whose relative paths (base_model, tokenizer, logging_dir, data, heldout_data, init_adapter) are
        made absolute against ``base_dir`` (absolute paths and ``None`` are kept), and whose ``name``, if
        ``None``, is :func:`default_run_name`."""
        base = os.path.abspath(os.fspath(base_dir))
        # In-memory data (a DataFrame, ...) is shared with the copy, not copied: it is never changed here.
        tenants = self.tenants if isinstance(self.tenants, list | tuple) else []
        memo = {
            id(v): v
            for t in tenants
            if isinstance(t, Tenant)
            for v in (t.data, t.heldout_data)
            if memory_kind(v) is not None
        }
        return copy.deepcopy(self, memo)._resolve_in_place(base)

    def _resolve_in_place(self, base: str) -> JobSpec:
        """:meth:`resolved`'s changes, made to this spec itself; returns it."""
        out = self
        if out.name is None:
            out.name = default_run_name(out)
        out.base_model = resolve_model_path(out.base_model, base)
        out.tokenizer = resolve_model_path(out.tokenizer, base)
        out.logging_dir = resolve_path(out.logging_dir, base)
        for t in out.tenants:
            if isinstance(t, Tenant):
                resolve_tenant_paths(t, base)
        for e in out.evals if isinstance(out.evals, list) else []:
            if isinstance(e, Eval):
                e.data = resolve_path(path_str(e.data), base)
                if isinstance(e.metrics, list):
                    e.metrics = [resolve_reward(m, base) for m in e.metrics]
        return out

    # -- lookup --------------------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name``; ``KeyError`` naming the known tenants otherwise."""
        for t in self.tenants:
            if t.name == name:
                return t
        raise KeyError(f"no tenant {name!r}; tenants: {[t.name for t in self.tenants]}")


# JobSpec(eval_every=..., serve=...), spec.eval_every and spec.serve: read, with a warning
add_old_names(JobSpec, RENAMED["JobSpec"])


def default_run_name(job: JobSpec) -> str:
    """A readable name for a run that was given none: its tenants' names joined by ``+`` (at most three,
    then how many more: ``"a+b+c+4 more"``), cut to 60 characters; ``"serve"`` for a serving job (or one
    with a ``service``) without tenants, ``"run"`` for none at all."""
    tenants = job.tenants if isinstance(job.tenants, list | tuple) else []
    names = [t.name for t in tenants if isinstance(t, Tenant) and isinstance(t.name, str)]
    return default_name(names, job.stay_up is True or job.service is not None)


def default_name(names: list[str], serving: bool) -> str:
    """:func:`default_run_name` of a job whose tenants have ``names`` (``serving``: one that stays up or
    serves the Tinker API)."""
    names = [n for n in names if n]
    if not names:
        return "serve" if serving else "run"
    text = "+".join(names[:3]) + (f"+{len(names) - 3} more" if len(names) > 3 else "")
    return text if len(text) <= 60 else text[:59] + "…"


def effective_slot_modules(job: JobSpec, output_layer: Sequence[str] = ()) -> list[str]:
    """The linear-layer names that get adapter slots: ``slot_modules``, else the union of the
    tenants' targets (``"all-linear"`` first if any tenant asks for it, then the names other tenants
    give: one may name a layer all-linear leaves out, the output layer). A served job (``service``)
    without ``slot_modules`` slots what a Tinker client's default ``LoraConfig`` trains: ``"all-linear"``
    and ``output_layer`` (the model's output layer, by its full name: the caller that has the model says
    which, :func:`~mlora_lab.lora.targets.output_layer_names`), besides its tenants' targets; a job with no
    tenant to go by (``stay_up``: waiting for them) slots ``"all-linear"``. A free slot holds no tensor, and a
    layer no tenant of a batch targets computes nothing more than the base.
    Targets that are not valid lists of names (a spec that does not validate) are left out rather than
    raised on."""
    slots = job.slot_modules
    if slots and isinstance(slots, list | tuple):
        names = [m for m in slots if isinstance(m, str)]
    else:
        tenants = job.tenants if isinstance(job.tenants, list | tuple) else []
        targets = [t.target_modules for t in tenants if isinstance(t, Tenant)]
        names = sorted({m for ts in targets if valid_targets(ts) for m in ts})
        if job.service is not None:
            names = [ALL_LINEAR, *(n for n in output_layer if n not in names), *names]
        elif not names:  # (a job that waits for tenants: they may target any linear layer)
            names = [ALL_LINEAR]
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
