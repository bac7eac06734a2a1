"""``metrics.jsonl``: the typed rows the job appends, the writer, and the incremental reader.

One JSON object per line, with a ``kind``:

========  ====================================================================================
train     ``step, tenant, tenant_step, loss, tokens, lr, grad_norm, rows_seen, tokens_seen, time``;
          an RL tenant's rows add ``reward, reward_std, completion_len, kl, clip_ratio`` (``None``
          for an SFT tenant)
completion ``step, tenant, tenant_step, prompt, completion, reward, time``: a few sampled
          completions of an RL tenant per logged step (``rl.log_completions``), with their reward
eval      ``step, tenant, loss, time``: a tenant's held-out loss (:data:`HELDOUT_KIND`, :class:`HeldoutRow`)
system    ``step, rank, mem_bytes, peak_mem_bytes, step_time, tokens_per_s, cpu_percent, gpu_util,
          time``
tenant    ``step, tenant, state, adapter_bytes, optimizer_bytes, local_adapter_bytes,
          local_optimizer_bytes, reason, time`` (the tenant's state and memory: written when its
          state changes, and once more, still ``running``, when its optimiser state first exists)
event     ``step, event, message, time`` (resumed, a checkpoint that failed or was skipped, ...)
========  ====================================================================================

Fields added after the first release are optional (their default is ``None``), so files written
before them stay readable: a reader sees ``None`` for what an older job did not record.

Float fields may be ``null``: JSON has no NaN or infinity, and the writer puts ``null`` for them.
A tenant's name in a row (``tenant``; an eval_metric row's ``model``) is a safe name (:data:`TenantName`):
readers make adapter paths of it, so a row naming ``../x`` is not a row. The writer appends each row with one ``write`` on an ``O_APPEND`` descriptor, so a reader sees whole
lines, or a last line without its newline (left for the next poll). Readers never break: a line that
is not JSON, or not one of these rows, is skipped with a warning naming the file and line; a file
that was rewritten (resume drops the rows after its checkpoint) or replaced is noticed and re-read.
"""

from __future__ import annotations

import os
import time
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
import orjson

from mlora_lab.rundir.files import SAFE_NAME, TextEnum, atomic_write_bytes, guarded_open
from mlora_lab.text import error_line

HELDOUT_KIND = "eval"
"""The ``kind`` of a held-out loss row (:class:`HeldoutRow`: the mean loss of a tenant's ``heldout_data``).
It keeps the name it had before the spec called that loss "held-out" (``eval_data`` then): the value is a
contract of the run directory, which outside checks and older runs' files hold. Elsewhere "eval" means the
generation evaluations, whose rows are ``eval_metric`` (:class:`EvalMetricRow`)."""


class RowKind(TextEnum):
    TRAIN = "train"
    HELDOUT = HELDOUT_KIND
    EVAL = HELDOUT_KIND
    """The old name of :attr:`HELDOUT` (the same member: an enum alias), kept for code that names it."""
    SYSTEM = "system"
    TENANT = "tenant"
    EVENT = "event"
    COMPLETION = "completion"
    USAGE = "usage"
    EVAL_METRIC = "eval_metric"


class TenantState(TextEnum):
    """A tenant's life: ``pending`` (being added) → ``running`` ⇄ ``paused`` → ``finished``, or
    ``removed``; ``failed`` = quarantined (its step went NaN/inf or raised); ``refused`` = a request to
    add it was turned down (the reason says why)."""

    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    REMOVED = "removed"
    FAILED = "failed"
    REFUSED = "refused"


class EventKind(TextEnum):
    RESUMED = "resumed"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # damaged: resume fell back to an older one
    SAVE_FAILED = "save_failed"  # a periodic checkpoint or adapter save failed (e.g. disk full)
    METRICS_RECREATED = "metrics_recreated"  # metrics.jsonl was deleted or replaced under the job
    SEARCH = "search"  # a decision of the job's hyperparameter search (mlora_lab.job.search)
    EVAL_FAILED = "eval_failed"  # one of the job's evaluations (JobSpec.evals) failed: training goes on
    TRACKER_FAILED = "tracker_failed"  # a tracker of report_to failed and gets no more rows
    WARNING = (
        "warning"  # a tenant trains, but on nothing (an RL tenant's flat rewards, all completions masked)
    )


TENANT_NAME_PATTERN = rf"^(?!\.\.?$){SAFE_NAME.pattern}$"
TenantName = Annotated[str, msgspec.Meta(pattern=TENANT_NAME_PATTERN)]
"""A tenant's name as rows carry it: what :func:`~mlora_lab.rundir.files.name_problem` accepts (it names
a directory, ``adapters/<name>/``). Checked as a line is decoded, so a row written by hand with another
name is skipped and reported like any malformed row, and no reader meets it."""


class Row(msgspec.Struct, tag_field="kind", gc=False):
    """One line of metrics.jsonl. Readers get the typed row of its ``kind`` (:class:`MetricsReader`,
    :func:`decode_row`, :meth:`from_dict`) and key on its class and attributes; :meth:`to_dict` is the
    JSON object the line holds.

    Rows are ``msgspec`` structs: a line is decoded straight into its row and checked against the
    row's types in one pass of compiled code (``kind`` picks the type; a bool is not a number, an int
    is a float; a field a newer writer added is dropped, an optional one an older writer lacked is
    ``None``). That is what lets a notebook read 100k rows in a fraction of a second. Rows refer to no
    other objects, so the garbage collector does not track them (``gc=False``)."""

    kind: ClassVar[RowKind]

    # Mapping-style reads, so that code written when rows were dicts reads typed rows alike
    # (``row["loss"]``, ``row.get("tenant")``, ``"reward" in row``): the fields, and ``kind``.
    def __getitem__(self, key: str) -> Any:
        if key == "kind":
            return self.kind
        if key in self.__struct_fields__:
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        """``row[key]``, or ``default`` for a field this kind of row does not have."""
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key == "kind" or key in self.__struct_fields__

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON object: ``kind`` first, then the fields in order, enums as their text."""
        return msgspec.to_builtins(self)

    @staticmethod
    def from_dict(d: Any) -> Row:
        """The typed row of a parsed line (a :class:`TrainRow` for ``{"kind": "train", ...}``, ...);
        ``ValueError`` naming the problem when it is not a row (:func:`row_problem`)."""
        try:
            return msgspec.convert(d, AnyRow)
        except msgspec.ValidationError as e:
            raise ValueError(_problem(e)) from None


class TrainRow(Row, tag="train"):
    """One optimiser step of one tenant (every ``log_every``-th, and its last). A float is ``None``
    when it was not finite (JSON has no NaN or infinity: the writer puts null)."""

    kind: ClassVar[RowKind] = RowKind.TRAIN
    step: int
    tenant: TenantName
    tenant_step: int
    loss: float | None
    tokens: int
    """Target tokens of this step (its whole accumulation window)."""
    lr: float | None
    grad_norm: float | None
    time: float = msgspec.field(default_factory=time.time)
    rows_seen: int | None = None
    """Rows of the tenant's data trained on so far, this step included (with ``packing``: documents,
    not packed rows). Cumulative, so it stays exact when ``log_every > 1`` skips rows."""
    tokens_seen: int | None = None
    """Target tokens trained on so far, this step included (cumulative, as ``rows_seen``)."""
    reward: float | None = None
    """RL tenants: the mean reward of the generation this step trained on (completions no reward function
    scored left out; TRL's ``reward``)."""
    reward_std: float | None = None
    """RL tenants: the standard deviation (n − 1) of those rewards (TRL's ``reward_std``)."""
    completion_len: float | None = None
    """RL tenants: the mean number of tokens of the generation's completions."""
    kl: float | None = None
    """RL tenants with ``beta > 0``: the mean per-token KL estimate to the base model (TRL's ``kl``)."""
    clip_ratio: float | None = None
    """RL tenants: the share of completion tokens whose importance ratio was clipped (TRL's
    ``clip_ratio/region_mean``; ``cispo_clip_ratio`` for cispo; ``None`` for the losses without a clip)."""
    extra: dict[str, float | None] | None = None
    """Named metrics of the step: an RL tenant's ``rewards/<fn>/mean`` and ``rewards/<fn>/std`` of each reward
    function (as TRL logs them, ``fn`` the function's name) and what its functions logged with
    ``log_metric(name, value)`` (their mean over the step's calls)."""
    loss_reduction: str | None = None
    """How ``loss`` is taken over the step's tokens when it is not their mean (``None``): ``"sum"`` for a
    Tinker client's tenant (its requests' ``loss:sum``, Tinker's sum over tokens and datums, which grows with
    the batch: 281.2 may be 0.53 a token)."""
    loss_per_token: float | None = None
    """Beside a summed ``loss``: the mean per token, ``loss`` over the step's summed token weights (a Tinker
    client's ``cross_entropy``: ``Σ w·(−log p) / Σ w``, the mean over the trained tokens for 0/1 weights);
    ``None`` where it has no such mean (other losses, negative weights)."""


class HeldoutRow(Row, tag=HELDOUT_KIND):
    """A tenant's held-out loss at a step: the mean target-token loss of its ``heldout_data`` (a preference tenant:
    its preference loss, the mean over its held-out pairs, with TRL's metrics in ``extra``)."""

    kind: ClassVar[RowKind] = RowKind.HELDOUT
    step: int
    tenant: TenantName
    loss: float | None
    time: float = msgspec.field(default_factory=time.time)
    extra: dict[str, float | None] | None = None
    """Named metrics of the held-out rows: a preference tenant's TRL metrics over its held-out pairs
    (``rewards/accuracies``, ``rewards/margins``, ...; TRL logs them as ``eval_rewards/...``)."""


class SystemRow(Row, tag="system"):
    """One rank's resources at a logged step."""

    kind: ClassVar[RowKind] = RowKind.SYSTEM
    step: int
    rank: int
    mem_bytes: int
    """GPU: ``torch.cuda.memory_allocated``; CPU: the process's resident set."""
    peak_mem_bytes: int
    step_time: float | None
    tokens_per_s: float | None
    time: float = msgspec.field(default_factory=time.time)
    cpu_percent: float | None = None
    """CPU used by the rank's process and its children since the rank's previous system row, in
    percent of one core (two busy cores = 200)."""
    gpu_util: float | None = None
    """GPU utilisation in percent (``torch.cuda.utilization``: the share of the last sample period in
    which a kernel ran); ``None`` on CPU, or when NVML (``pynvml``) is not available."""
    tenants: int | None = None
    """Tenants whose rows shared the step's forward (on rank 0's rows: every tenant of the step there);
    ``None`` in rows of older jobs. A served job's steps batch the requests of every waiting client."""
    rollout_busy: float | None = None
    """A job with rollout ranks (``Parallel.rollout_ranks``), on rank 0's row: the share of the time since the
    previous system row that the rollout ranks spent sampling (their mean; 1: never idle)."""
    trainer_idle: float | None = None
    """And the share of that time the trainers waited for generations still being sampled (0: never)."""


class TenantRow(Row, tag="tenant"):
    """A tenant's state and memory. Written when its state changes, and once more (still ``running``)
    after its first optimiser step, when its AdamW state (two moments per trained value) exists: the
    memory a tenant costs is its latest row's ``adapter_bytes + optimizer_bytes``."""

    kind: ClassVar[RowKind] = RowKind.TENANT
    step: int
    tenant: TenantName
    state: TenantState
    adapter_bytes: int = 0
    optimizer_bytes: int = 0
    local_adapter_bytes: int = 0
    local_optimizer_bytes: int = 0
    reason: str | None = None
    time: float = msgspec.field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.state = TenantState(self.state)


class EventRow(Row, tag="event"):
    kind: ClassVar[RowKind] = RowKind.EVENT
    step: int
    event: EventKind
    message: str = ""
    time: float = msgspec.field(default_factory=time.time)
    tenant: TenantName | None = None
    """The tenant it is about (a ``warning``), if any."""

    def __post_init__(self) -> None:
        self.event = EventKind(self.event)


class EpisodeRecord(msgspec.Struct, frozen=True, gc=False):
    """An agent tenant's episode (``rl.env``, ``rl.tools``, harness mode), as its completion row holds it: what
    the recent samples view folds into turns."""

    messages: list[dict[str, Any]]
    """The conversation as OpenAI messages (``system``/``user``, ``assistant`` with ``content`` and ``tool_calls``,
    ``tool`` with ``tool_call_id``, ``name`` and ``content``): what the environment sent, and the answers."""
    turns: int
    """The model's turns."""
    stop: str
    """Why it ended: ``answered``, ``max_turns``, ``context``, ``returned`` (a rollout function returned), ``""``."""
    parts: dict[str, tuple[float, float]] = msgspec.field(default_factory=dict)
    """The env's rubric: ``name -> (score, weight)``; the episode's own reward is ``Σ score·weight``."""
    forks: int = 0
    """Times its program sent a history that did not extend the one it was answered in."""


class CompletionRow(Row, tag="completion"):
    """A completion an RL tenant sampled, with its prompt and reward (``rl.log_completions`` of them per
    logged step): what the dashboard shows as the tenant's recent samples."""

    kind: ClassVar[RowKind] = RowKind.COMPLETION
    step: int
    tenant: TenantName
    tenant_step: int
    prompt: str
    """The prompt as the model saw it (a chat rendered through the template)."""
    completion: str
    """The completion's text (special tokens left out, as the reward functions get it)."""
    reward: float | None
    """Its reward (the weighted sum of the reward functions); ``None`` when none scored it."""
    time: float = msgspec.field(default_factory=time.time)
    extra: dict[str, str | float | int | bool | None] | None = None
    """What the reward functions logged for it with ``log_extra(column, values)`` (one value per
    completion), by column."""
    episode: EpisodeRecord | None = None
    """An agent tenant's: the whole episode (``completion`` is then every turn's text after the prompt)."""
    adapter_version: int | None = None
    """The tenant's adapter version that sampled it (its optimiser steps then); ``tenant_step − 1 −
    adapter_version`` is how many steps stale it was when trained (``rl.max_staleness``)."""


class EvalMetricRow(Row, tag="eval_metric"):
    """One model's score for one metric of one of the job's evaluations (``JobSpec.evals``) at a step: the
    mean over the examples of each example's mean over its samples, with the 95 % percentile-bootstrap
    interval over examples (:func:`mlora_lab.evals.scores.bootstrap`). Read as the series
    ``eval/<eval>/<metric>`` of tenant ``model`` (``base`` for the base model)."""

    kind: ClassVar[RowKind] = RowKind.EVAL_METRIC
    step: int
    model: TenantName
    """A tenant's name, or ``base``."""
    eval: str
    metric: str
    value: float | None
    """``None`` when no example got a score (or it was not finite)."""
    low: float | None = None
    high: float | None = None
    n: int = 0
    """The examples scored."""
    time: float = msgspec.field(default_factory=time.time)

    @property
    def series(self) -> str:
        """Its name as a metric: ``eval/<eval>/<metric>``."""
        return f"eval/{self.eval}/{self.metric}"


class UsageRow(Row, tag="usage"):
    """What one API key's requests to a served job have cost so far, for one tenant (``None``: sampling the
    base model): the metering a hosted service bills by. Counts are totals since the job began (a resume
    goes on from its checkpoint's), so the latest row of a ``(key, tenant)`` is its usage; the job writes
    one when they changed, at most every few seconds and whenever it goes idle."""

    kind: ClassVar[RowKind] = RowKind.USAGE
    step: int
    key: str
    """The name of the API key (``service/keys.json``) whose requests these are."""
    tenant: TenantName | None
    tokens_trained: int
    """Input tokens of its ``forward_backward`` datums."""
    tokens_forward: int
    """Input tokens of its forward-only datums (``forward``, ``compute_logprobs`` of a training client)."""
    tokens_sampled: int
    """Tokens generated for its samples (every sample of ``num_samples``)."""
    busy_s: float
    """Seconds of the job's time its requests took: each step's (forward, backward and optimiser) shared
    out over the step's tenants by their tokens, each generation's over its requests by their tokens."""
    requests: int
    """Requests that ran (forward/backward, optimiser steps, samples)."""
    time: float = msgspec.field(default_factory=time.time)


ROW_TYPES: dict[RowKind, type[Row]] = {
    t.kind: t
    for t in (TrainRow, HeldoutRow, SystemRow, TenantRow, EventRow, CompletionRow, UsageRow, EvalMetricRow)
}
AnyRow = TrainRow | HeldoutRow | SystemRow | TenantRow | EventRow | CompletionRow | UsageRow | EvalMetricRow
"""Any metrics row: the type a line is decoded into (its ``kind`` picks which)."""
FIELD_NAMES: dict[str, tuple[str, ...]] = {kind.value: t.__struct_fields__ for kind, t in ROW_TYPES.items()}
"""Per kind, its fields in order (the keys of its line after ``kind``)."""

_DECODER = msgspec.json.Decoder(AnyRow)


def _problem(e: msgspec.ValidationError) -> str:
    """A validation error as one short line (a hostile value is quoted in it only cut short)."""
    text = str(e)
    if "matching regex" in text and (at := text.rpartition(" - at `$.")[2].rstrip("`")) in (
        "tenant",
        "model",
    ):
        return (
            f"not a metrics row: its {at} is not a safe name (1 to 100 letters, digits, '.', '_' or '-'; "
            "not '.' or '..')"
        )
    return f"not a metrics row: {error_line(e, 160)}"


def row_problem(row: Any) -> str | None:
    """Why a parsed line is not a metrics row (None if it is one). Extra keys are allowed (a newer
    writer may add fields); a missing required field, an unknown ``kind`` or a value of the wrong type
    is not."""
    try:
        msgspec.convert(row, AnyRow)
    except msgspec.ValidationError as e:
        return _problem(e)
    return None


def decode_row(line: bytes) -> Row:
    """The typed row of one line of metrics.jsonl; ``ValueError`` saying why when it is not one (not
    JSON, or not a row)."""
    try:
        return _DECODER.decode(line)
    except msgspec.ValidationError as e:
        raise ValueError(_problem(e)) from None
    except msgspec.DecodeError as e:
        raise ValueError(f"not valid JSON ({error_line(e, 80)})") from None


def _default(obj: Any) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    raise TypeError(f"cannot write {type(obj).__name__} to metrics.jsonl")


def _line(row: Row) -> bytes:
    """One row as a JSON line. Text that is not valid UTF-8 (a lone surrogate quoted from hostile
    input into a reason) is written as its escape, so no message can make a row unwritable."""
    d = row.to_dict()
    try:
        return orjson.dumps(d, default=_default) + b"\n"
    except orjson.JSONEncodeError:
        clean = {
            k: v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v
            for k, v in d.items()
        }
        return orjson.dumps(clean, default=_default) + b"\n"


class MetricsWriter:
    """Appends rows to metrics.jsonl (rank 0 only). If the file is deleted or replaced under the
    job, the next write notices (one ``stat`` per row) and starts a new file, saying so in it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = -1
        self._open()

    def _open(self) -> None:
        # never through a link: a symlink planted at metrics.jsonl must not make the job append elsewhere
        self._fd = guarded_open(self.path.parent, self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._ino = os.fstat(self._fd).st_ino

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino != self._ino
        except FileNotFoundError:
            return True

    def write(self, row: Row) -> None:
        if self._replaced():
            os.close(self._fd)
            self._open()
            note = EventRow(
                step=getattr(row, "step", 0),
                event=EventKind.METRICS_RECREATED,
                message=f"{self.path.name} was deleted or replaced while the job ran; rows before this one are not in it",
            )
            os.write(self._fd, _line(note))
        os.write(self._fd, _line(row))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MetricsReader:
    """The one reader of metrics.jsonl: typed rows (:class:`TrainRow`, :class:`HeldoutRow`, ...), read
    incrementally. It remembers its byte offset and line number, never parses a partial line, skips
    bad lines (one warning each, naming file and line), and starts over when the file was rewritten or
    replaced (``generation`` then increases: callers that keep derived state, like a dashboard,
    rebuild it from ``rows``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.offset = 0
        self.line = 0
        self.generation = 0
        self.rows: list[Row] = []
        self.skipped = 0
        self._ino: int | None = None

    def _reset(self) -> None:
        self.offset = self.line = self.skipped = 0
        self.rows = []
        self.generation += 1

    def poll(self) -> list[Row]:
        """Rows appended since the last call (also kept in ``self.rows``). After a rewrite, every row
        of the new file (and ``generation`` has moved on)."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._ino is not None and (st.st_ino != self._ino or st.st_size < self.offset):
                    self._reset()
                self._ino = st.st_ino
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        except OSError as e:
            warnings.warn(f"{self.path}: cannot be read ({e.strerror or e})", RuntimeWarning, stacklevel=2)
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        complete = chunk[: end + 1]
        try:  # nearly always: every line a row, decoded and checked in one call
            new = _DECODER.decode_lines(complete)
            self.line += complete.count(b"\n")
        except msgspec.DecodeError:  # a line at fault: find it (and any others) line by line
            new = []
            for raw in complete.split(b"\n")[:-1]:
                self.line += 1
                if raw.strip():
                    try:
                        new.append(decode_row(raw))
                    except ValueError as e:
                        self._skip(str(e))
        self.offset += end + 1
        self.rows.extend(new)
        return new

    def _skip(self, problem: str) -> None:
        self.skipped += 1
        warnings.warn(f"{self.path} line {self.line}: skipped ({problem})", RuntimeWarning, stacklevel=3)


def truncate_after(path: str | os.PathLike, step: int) -> None:
    """Keep only the rows logged at or before global ``step`` (resume logs the later ones again),
    and drop lines that are not rows. Rewritten atomically: readers see a new file and re-read it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    keep = []
    for raw in data.split(b"\n"):
        try:
            row = _DECODER.decode(raw)
        except msgspec.DecodeError:
            continue  # a row cut off by a crash, or not ours
        if row.step <= step:
            keep.append(raw + b"\n")
    atomic_write_bytes(path, b"".join(keep))


OLD_NAMES = {"EvalRow": "HeldoutRow"}
"""Names this module had before the held-out loss was called so: each is still given, with a
``DeprecationWarning``, until :data:`~mlora_lab.spec.renames.REMOVAL`."""


def __getattr__(name: str) -> Any:
    """An old name of :data:`OLD_NAMES` (``EvalRow``): its new one, with the deprecation."""
    if name in OLD_NAMES:
        from mlora_lab.spec.renames import REMOVAL, warn_old  # (the one wording of a deprecation)

        new = OLD_NAMES[name]
        warn_old(
            f'mlora_lab.rundir.{name}: deprecated, use {new} (the held-out loss\'s row; "eval" now means the '
            f"generation evaluations, whose rows are EvalMetricRow). The old name is read until {REMOVAL}"
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
