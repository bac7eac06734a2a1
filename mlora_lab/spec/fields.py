"""What a spec is built from: the problems it reports in, the metadata each field carries, every bound,
and the reader that turns a hostile dict into a dataclass's keyword arguments.

Nothing here names a particular dataclass: :mod:`mlora_lab.spec.job` (``Tenant``, ``JobSpec``) and
:mod:`mlora_lab.spec.parts` (their nested parts) declare their fields with :func:`meta` and read dicts
with :func:`kwargs_for`, and import this module, never the other way round. It sits below them so that
one vocabulary serves everyone who talks about specs: each field's :class:`FieldInfo`
(``field_info(Tenant, "lr")``: its label, help line, widget kind, form section and bounds), from which the
notebook forms (:mod:`mlora_lab.lab.forms.builders`) build their inputs and against which the validator
(:mod:`mlora_lab.validate`) checks values, so a new field is one edit where its dataclass is; and
:class:`Problem` (a tenant, a field, a sentence) and :class:`SpecError`, in which the validator, the
dataclasses' ``from_dict`` and the job's control messages all report.

Every bound of every field is here, in one table rather than beside its dataclass: limits are read best
side by side (most share one rationale: far above any real job, low enough that nothing downstream
overflows), and the validator, the forms and the job import them from one place. The choices of a
``choice`` field stay beside their dataclass (``SCHEDULES`` in :mod:`mlora_lab.spec.job`, ``LOSS_TYPES`` in
:mod:`mlora_lab.spec.parts`): they say what the field means, not how far it may go.

Like the spec, this is the light contract: no torch, transformers or model code (only
:mod:`mlora_lab.text`, which shows and reads hostile values); the notebook side and the training processes
both read it cheaply. Everything here treats its input as hostile: any JSON gives ``SpecError``, never
another exception.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mlora_lab.text import brief

# ---------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------

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
MAX_NEW_TOKENS = 2**16
"""``RL.max_new_tokens``."""
MAX_GROUP = 2**12
"""``RL.group_size``."""
MAX_REWARDS = 16
"""Most reward functions one tenant may combine."""
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
    """The file the problem is in, for a problem of one data file (``data`` / ``heldout_data``): lets a
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


def tenant_label(name: Any) -> str:
    """How messages name a tenant: ``tenant 'alice'`` (a valid name is never shortened)."""
    return f"tenant {brief(name, MAX_NAME_LEN + 2)}"


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
    "pref",
    "rewards",
    "numbers",
    "texts",
    "function",
    "functions",
    "mapping",
    "service",
    "client",
)
"""Kinds of :attr:`FieldInfo.kind`. ``tenants``, ``parallel``, ``service``, ``rl`` and ``client`` are the spec's
nested parts, checked on their own; ``rewards`` (reward functions), ``numbers`` and ``texts`` (lists),
``function`` (one optional function: an agent's env), ``functions`` (a list of them, maybe empty: its tools) and
``mapping`` (a JSON object: keyword arguments) are RL's."""


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
    (the form's attribute is that label with ``_`` for spaces: ``"no clipping"`` -> ``form.no_clipping``).
    For an optional text no form shows: what ``None`` means, in the message about an empty one."""
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


def meta(label: str, **info: Any) -> dict[str, FieldInfo]:
    """A field's ``metadata`` holding its :class:`FieldInfo` (``label`` first, then its other attributes):
    ``rank: int = field(default=8, metadata=meta("rank", section="LoRA", min=1))``."""
    return {_INFO: FieldInfo(label, **info)}


def field_info(cls: type, name: str) -> FieldInfo:
    """The :class:`FieldInfo` of field ``name`` of a spec's dataclass (``Tenant``, ``JobSpec``, ``Parallel``, ...)."""
    return cls.__dataclass_fields__[name].metadata[_INFO]


def fields_info(cls: type) -> Iterator[tuple[str, FieldInfo]]:
    """``(name, FieldInfo)`` of every field of ``cls`` in definition order (the order forms show them)."""
    for f in dataclasses.fields(cls):
        yield f.name, f.metadata[_INFO]


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


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, dataclasses.Field], tuple[str, ...]]:
    """``cls``'s fields by name, and the names of those without a default (asked per tenant: cached)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = tuple(
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return fields, required


def kwargs_for(
    cls: type, d: Any, where: str, nested: tuple[str, ...] = ()
) -> tuple[dict[str, Any], list[str]]:
    """Split ``d`` into constructor kwargs for dataclass ``cls``; problems (sentences starting with ``where``)
    for unknown/missing keys and for values nested too deeply to be copied. The fields named in ``nested``
    are the caller's to check level by level (``JobSpec``'s tenants, parallel, service); every other value
    is a leaf. A ``cls`` already is returned as its fields' values, without problems; a non-dict gives one
    problem and no kwargs."""
    if isinstance(d, cls):
        return {f.name: getattr(d, f.name) for f in dataclasses.fields(cls)}, []
    if not isinstance(d, dict):
        return {}, [f"{where} must be an object/dict (got {type(d).__name__})"]
    fields, required = _fields_of(cls)
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
    missing = [name for name in required if name not in d]
    if missing:
        problems.append(
            f"{where}: missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        )
    deep = [
        k
        for k, v in d.items()
        if isinstance(v, dict | list | tuple) and k in fields and k not in nested and _too_deep(v)
    ]
    problems += [f"{where}: {k} is nested more than {_MAX_DEPTH} levels deep" for k in deep]
    return {k: v for k, v in d.items() if k in fields and k not in deep}, problems
