"""The series the lab draws, read from a run directory: one module for the dashboard, ``ml.compare``
and the reports.

:class:`RunSeries` reads one run directory's ``metrics.jsonl`` incrementally (the typed
:class:`~mlora_lab.rundir.MetricsReader`) into numpy columns per tenant (train and eval rows), per
rank (system rows) and the run's resume times; :meth:`RunSeries.xy` gives one tenant's metric against
one of the :data:`X_AXES`. It needs nothing but the run directory: the run's handle, a dashboard and a
comparison each keep their own. :func:`rows_frame` turns typed rows into the DataFrames the lab
returns (one column per field, ``time`` as datetimes).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import types
import typing
import zlib
from collections import deque
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from mlora_lab.lab.plotting import MAX_DRAWN, SMOOTHING, series_colour
from mlora_lab.rundir import (
    CompletionRow,
    EvalMetricRow,
    EventKind,
    EventRow,
    HeldoutRow,
    MetricsReader,
    Row,
    RunDir,
    SystemRow,
    TenantRow,
    TenantState,
    TrainRow,
    UsageRow,
)
from mlora_lab.rundir.rows import FIELD_NAMES, ROW_TYPES
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.outline import Outline
from mlora_lab.text import collection_paused

X_AXES = ("tenant step", "global step", "tokens", "wall time", "relative time")
"""What a metric can be drawn against: the tenant's own step, the job's global step, the tenant's
target tokens seen so far, the wall clock, or seconds since the run's first row."""
TIME_AXES = ("wall time", "relative time")
RL_METRICS = ("reward", "reward_std", "completion_len", "kl", "clip_ratio")
"""What an RL tenant's train rows add (:class:`~mlora_lab.rundir.TrainRow`); an SFT tenant has none."""
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference tenant's train rows carry in their ``extra`` (``Tenant.pref``; named as TRL's DPOTrainer
logs them): with ``r_c = beta (log pi(y_c|x) - log pi_ref(y_c|x))`` and ``r_r`` the same of the rejected
answer, the means over the window's pairs of ``r_c``, ``r_r``, ``[r_c > r_r]``, ``r_c - r_r``, and of the
policy's ``log pi(y_c|x)``, ``log pi(y_r|x)``. Other tenants have none."""
PREFERENCE_MARK = "rewards/margins"
"""The key of a train row's ``extra`` that makes it a preference tenant's row (every such row has it)."""
METRICS = {
    "loss": "train",
    "eval_loss": "heldout",  # (the held-out loss, of the run directory's ``eval`` rows)
    "lr": "train",
    "grad_norm": "train",
    "tokens": "train",
    **dict.fromkeys(RL_METRICS, "rl"),
    **dict.fromkeys(PREFERENCE_METRICS, "named"),
}
"""Metrics a tenant has, and the rows they come from (``heldout``: the held-out loss rows; ``rl``: the train
rows of an RL tenant; ``named``: a train row's ``extra``, here a preference tenant's)."""
RECENT_SAMPLES = 16
"""Completion rows kept per tenant (the latest ones): the dashboard shows a few of them."""

GAP_FACTOR, GAP_MIN_S = 5.0, 5.0
"""Two consecutive rows further apart in time than ``max(GAP_FACTOR x the median interval, GAP_MIN_S)``
are not joined by a line (the job was stopped and resumed, or stalled)."""


def rows_frame(rows: Sequence[Row]) -> pd.DataFrame:
    """Typed rows as a DataFrame: a column per field (``kind`` first, then each kind's fields in order,
    kinds in the order they first appear, as in metrics.jsonl; enums as their text), one row per
    row in their order, and ``time`` as datetimes. A field a kind lacks is NaN in that kind's rows.

    Built a column at a time from the rows' value tuples, each with the dtype its field's type gives
    (:data:`_COLUMN_TYPES`), not by letting pandas infer one per row or per column: a notebook reads
    frames of 100k rows."""
    with collection_paused():
        return _rows_frame(rows)


_TEXT = pd.StringDtype("python", na_value=np.nan)
"""Text columns: pandas' ``str`` dtype kept in Python strings. The Arrow-backed default (with pyarrow
installed) converts every string when a frame is built, for columns that are only compared and grouped
by (tenant names, states). The 100k train rows of ``benchmarks/lab.py`` item 2 (15 fields) take 0.32 s
through ``DataFrame.from_records`` (inferred dtypes, Arrow strings) and 0.26-0.29 s this way."""


def _column_type(hint: Any) -> str:
    """How a field's values become a column: ``int`` (int64), ``int?`` (int64, or float64 with NaN
    where a value is None), ``float`` (float64, None as NaN), ``text`` (:data:`_TEXT`), ``enum`` (the
    members' text, as ``text``) or ``object``."""
    args = (
        set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    )
    optional, args = type(None) in args, args - {type(None)}
    if len(args) != 1:
        return "object"
    (t,) = args
    if isinstance(t, type) and issubclass(t, Enum):
        return "enum"
    if t is str:
        return "text"
    if t is int:
        return "int?" if optional else "int"
    return "float" if t is float else "object"


_COLUMN_TYPES: dict[str, tuple[str, ...]] = {
    kind.value: tuple(_column_type(typing.get_type_hints(t)[name]) for name in t.__struct_fields__)
    for kind, t in ROW_TYPES.items()
}
"""Per row kind, the column type (:func:`_column_type`) of each of its fields, in ``FIELD_NAMES`` order."""


def _column(values: np.ndarray, how: str) -> Any:
    """One field's values (an object array, one per row) as a column of the type ``how`` names."""
    if how == "float":
        return values.astype(np.float64)  # (None -> NaN)
    if how == "int" or (how == "int?" and not np.equal(values, None).any()):
        return values.astype(np.int64)
    if how == "int?":
        return values.astype(np.float64)
    if how == "text":
        return pd.array(values, dtype=_TEXT)
    if how == "enum":
        return pd.array([v.value for v in values], dtype=_TEXT)
    return values


def _extra_columns(values: np.ndarray) -> dict[str, Any]:
    """The ``extra`` dicts of a kind's rows (None where a row has none) as a column per key, in the order
    the keys first appear: float64 where every value is a number (or missing: NaN), else objects."""
    keys = dict.fromkeys(k for d in values if d for k in d)
    out = {}
    for key in keys:
        column = np.array([d.get(key) if d else None for d in values], dtype=object)
        numeric = all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in column)
        out[key] = _column(column, "float" if numeric else "object")
    return out


def _rows_frame(rows: Sequence[Row]) -> pd.DataFrame:
    row_types = set(map(type, rows))
    parts = []
    for row_type in sorted(row_types, key=[type(r) for r in rows].index) if len(row_types) > 1 else row_types:
        at = [i for i, r in enumerate(rows) if type(r) is row_type] if len(row_types) > 1 else None
        mine = rows if at is None else [rows[i] for i in at]
        kind = row_type.kind.value
        names = FIELD_NAMES[kind]
        # [rows, fields] of objects from one flat iterator in C (every field holds a scalar, so the
        # shape is exact): assigning the list of tuples instead makes numpy discover a nested
        # sequence, 4x slower for 100k rows
        values = itertools.chain.from_iterable(map(msgspec.structs.astuple, mine))
        table = np.fromiter(values, dtype=object, count=len(mine) * len(names)).reshape(len(mine), len(names))
        data = {"kind": pd.array([kind] * len(mine), dtype=_TEXT)}
        for j, (name, how) in enumerate(zip(names, _COLUMN_TYPES[kind], strict=True)):
            if name == "extra":  # (named metrics or columns: a column each, none when no row has any)
                data |= _extra_columns(table[:, j])
            else:
                data[name] = _column(table[:, j], how)
        parts.append(pd.DataFrame(data, index=at))
    if not parts:
        return pd.DataFrame()
    df = parts[0] if len(parts) == 1 else pd.concat(parts).sort_index(kind="stable").reset_index(drop=True)
    if "time" in df:
        df["time"] = to_datetimes(df["time"])
    return df


def to_datetimes(seconds: Any) -> Any:
    """Seconds since 1970 (a Series, or one number or None) as pandas datetimes. A time no clock gives
    (before 1970 or after :data:`MAX_TIME_S`, e.g. a hand-written ``time: 1e12``) is ``NaT``: pandas
    cannot hold most of them at its resolution, and one would fail the whole table
    (``OutOfBoundsDatetime``)."""
    if isinstance(seconds, pd.Series):
        t = pd.to_numeric(seconds, errors="coerce").astype(float)
        return pd.to_datetime(t.where((t >= 0) & (t <= MAX_TIME_S)), unit="s", errors="coerce")
    if seconds is None or not (isinstance(seconds, int | float) and 0 <= seconds <= MAX_TIME_S):
        return pd.NaT
    return pd.to_datetime(seconds, unit="s")


MAX_TIME_S = 2**33
"""Rows stamped after this (the year 2242) are not placed on a wall-clock axis: matplotlib's dates end
at the year 9999, and one hand-written ``time: 1e12`` would fail the whole figure."""


def date_numbers(seconds: np.ndarray) -> np.ndarray:
    """Seconds since 1970 as matplotlib's date numbers (days since 1970-01-01, UTC); a time no clock
    gives (negative, or past :data:`MAX_TIME_S`) is NaN: not drawn."""
    t = np.asarray(seconds, dtype=float)
    return np.where((t >= 0) & (t <= MAX_TIME_S), t, np.nan) / 86400.0


def gap_breaks(t: np.ndarray, resumes: Sequence[float] = ()) -> np.ndarray:
    """``b[i]`` is True when point ``i`` must not be joined to point ``i - 1``: the rows are further apart
    in time than the logging rhythm explains (see :data:`GAP_FACTOR`), or the run was resumed between
    them (a ``resumed`` event)."""
    t = np.asarray(t, dtype=float)
    breaks = np.zeros(len(t), dtype=bool)
    if len(t) < 2:
        return breaks
    dt = np.diff(t)
    limit = max(GAP_FACTOR * float(np.median(dt)), GAP_MIN_S)
    breaks[1:] = dt > limit
    for when in resumes:
        i = int(np.searchsorted(t, when, side="left"))
        if 0 < i < len(t):
            breaks[i] = True
    return breaks


class Columns:
    """Append-only numeric columns that hand out numpy arrays without re-converting old values
    (``None`` becomes NaN)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self._new: list[tuple] = []
        self._arrays: dict[str, np.ndarray] | None = None  # (made when first asked: a million tenants)
        self._n = 0

    def append(self, *values: Any) -> None:
        self._new.append(values)
        self._n += 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays()[name]

    def last(self, name: str) -> float | None:
        """The latest value of a column (None when empty)."""
        if self._new:
            return self._new[-1][self.names.index(name)]
        a = self.arrays()[name]
        return float(a[-1]) if len(a) else None

    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {n: np.empty(0) for n in self.names}
        if self._new:  # fold the new rows into the arrays once
            block = np.array(self._new, dtype=float).reshape(len(self._new), len(self.names))
            self._arrays = {
                n: np.concatenate([self._arrays[n], block[:, i]]) for i, n in enumerate(self.names)
            }
            self._new = []
        return self._arrays


def _drawable(value: float | None) -> float:
    """:func:`~mlora_lab.lab.plotting.drawable` of one number (NaN for None), without numpy: it runs
    for every train row."""
    if value is None or not math.isfinite(value):
        return math.nan
    return min(max(float(value), -MAX_DRAWN), MAX_DRAWN)


def _ema_step(state: tuple[float, float], value: float | None) -> tuple[tuple[float, float], float | None]:
    """One row of the EMA of :func:`~mlora_lab.lab.plotting.best_smoothed` over what is drawn (clipped; NaN
    only decays the weights), kept as its numerator and denominator: the new state, and the smoothed value
    at this row (None when the row has no value)."""
    w, (num, den) = SMOOTHING, state
    v = _drawable(value)
    if v != v:
        return (w * num, w * den), None
    num, den = w * num + v, w * den + 1.0
    return (num, den), num / den


class TenantSeries:
    """One tenant of one run: its train and held-out loss rows as columns, its latest state and memory."""

    TRAIN = ("step", "tenant_step", "tokens", "time", "loss", "lr", "grad_norm")
    HELDOUT = ("step", "tenant_step", "tokens", "time", "loss")
    RL = ("step", "tenant_step", "tokens", "time", *RL_METRICS)

    def __init__(self, name: str, max_steps: int | None) -> None:
        self.name = name
        self.max_steps = max_steps
        self.train = Columns(*self.TRAIN)
        self.heldout = Columns(*self.HELDOUT)
        self.state: TenantState | None = None  # as its latest tenant row says (None: no row yet)
        self.reason: str | None = None
        self.adapter_bytes = 0
        self.optimizer_bytes = 0
        self.step = 0
        self.tokens = 0
        self.last_loss: float | None = None
        self.loss_reduction: str | None = None
        """How its latest loss is taken over tokens (``TrainRow.loss_reduction``): None for their mean,
        ``"sum"`` for a Tinker client's ``loss:sum``, with :attr:`last_loss_per_token` beside it."""
        self.last_loss_per_token: float | None = None
        self.best_loss: float | None = None
        """The lowest point of its smoothed train loss (:func:`~mlora_lab.lab.plotting.best_smoothed`,
        kept up row by row: the EMA's numerator and denominator are two numbers)."""
        self._ema = (0.0, 0.0)
        self.rl: Columns | None = None
        """An RL tenant's :data:`RL` columns, from its first train row that carries one of
        :data:`RL_METRICS` on (None for an SFT tenant: it costs such a tenant nothing)."""
        self.last_reward: float | None = None
        self.best_reward: float | None = None
        """An RL tenant's highest smoothed mean reward (kept up row by row, as :attr:`best_loss` is)."""
        self._reward_ema = (0.0, 0.0)
        self.samples: deque[CompletionRow] | None = None
        """Its latest :data:`RECENT_SAMPLES` completion rows, oldest first (None: it has none)."""
        self.named: dict[str, Columns] = {}
        """Its train rows' named metrics (``TrainRow.extra``: ``rewards/<fn>/mean``, ``log_metric``'s, a
        preference tenant's :data:`PREFERENCE_METRICS`), each as columns ``step, tenant_step, tokens, time,
        value`` from the first row that has it on."""
        self.warning: str | None = None
        """Its latest ``warning`` (it trains on nothing: flat rewards, every completion masked)."""

    def add_train(self, r: TrainRow) -> None:
        # tokens_seen is cumulative and exact; older jobs only log each step's tokens, so their sum
        # misses the steps that log_every skipped
        self.tokens = r.tokens_seen if r.tokens_seen is not None else self.tokens + (r.tokens or 0)
        self.step = r.tenant_step
        loss = r.loss
        self.train.append(r.step, self.step, self.tokens, r.time, loss, r.lr, r.grad_norm)
        if loss is not None:
            self.last_loss = loss
            self.loss_reduction, self.last_loss_per_token = r.loss_reduction, r.loss_per_token
        self._ema, smoothed = _ema_step(self._ema, loss)
        if smoothed is not None:
            self.best_loss = smoothed if self.best_loss is None else min(self.best_loss, smoothed)
        # (an SFT row: five checks, and nothing more is kept or computed for it)
        if r.extra:
            for name, value in r.extra.items():
                cols = self.named.get(name)
                if cols is None:
                    cols = self.named[name] = Columns("step", "tenant_step", "tokens", "time", "value")
                cols.append(r.step, self.step, self.tokens, r.time, value)
        if self.rl is not None or not (
            r.reward is None
            and r.completion_len is None
            and r.reward_std is None
            and r.kl is None
            and r.clip_ratio is None
        ):
            self.add_rl(r)

    def add_rl(self, r: TrainRow) -> None:
        """An RL tenant's train row: every one from its first on goes into :attr:`rl` (a value it lacks is
        NaN), so its lines break where a generation had no reward rather than join across it."""
        if self.rl is None:
            self.rl = Columns(*self.RL)
        self.rl.append(
            r.step,
            r.tenant_step,
            self.tokens,
            r.time,
            r.reward,
            r.reward_std,
            r.completion_len,
            r.kl,
            r.clip_ratio,
        )
        if r.reward is not None:
            self.last_reward = r.reward
        self._reward_ema, smoothed = _ema_step(self._reward_ema, r.reward)
        if smoothed is not None:
            self.best_reward = smoothed if self.best_reward is None else max(self.best_reward, smoothed)

    @property
    def preference(self) -> bool:
        """Whether it learns from preference pairs (its train rows carry :data:`PREFERENCE_METRICS`)."""
        return PREFERENCE_MARK in self.named

    def add_completion(self, r: CompletionRow) -> None:
        if self.samples is None:
            self.samples = deque(maxlen=RECENT_SAMPLES)
        self.samples.append(r)

    def add_heldout(self, r: HeldoutRow) -> None:
        # held-out rows carry the global step; they are placed at the tenant's step and tokens at that step
        # (its latest train row at or before it: normally the row just logged)
        tenant_step, tokens = self.step, self.tokens
        if len(self.train) and r.step < self.train.last("step"):
            a = self.train.arrays()
            i = int(np.searchsorted(a["step"], r.step, side="right")) - 1
            tenant_step, tokens = (a["tenant_step"][i], a["tokens"][i]) if i >= 0 else (0, 0)
        self.heldout.append(r.step, tenant_step, tokens, r.time, r.loss)

    def add_state(self, r: TenantRow) -> None:
        self.state = r.state
        self.reason = r.reason
        # the latest row's numbers: a tenant row is written when the state changes and again once its
        # optimiser state exists, so the latest is the tenant's current memory
        self.adapter_bytes = r.adapter_bytes or 0
        self.optimizer_bytes = r.optimizer_bytes or 0

    def loss_shown(self) -> str:
        """Its latest loss as a view says it: ``loss 0.5321`` (a mean per token), or ``loss:sum 281.2 (0.5274 a
        token)`` for a Tinker client's: unnamed, a sum that grows with the client's batch reads as divergence."""
        if self.loss_reduction != "sum":
            return f"loss {self.last_loss:.4f}"
        mean = "" if self.last_loss_per_token is None else f" ({self.last_loss_per_token:.4f} a token)"
        return f"loss:sum {self.last_loss:.5g}{mean}"

    def timing(self, resumes: Sequence[float] = (), window: int = 20) -> tuple[float, float | None]:
        """``(elapsed, eta)`` in seconds: the time it has trained (gaps such as a stop before a resume
        left out) and, from its step rate over its last ``window`` logged steps, the time it still
        needs to reach ``max_steps`` (None when unknown)."""
        a = self.train.arrays()
        t, steps = a["time"], a["tenant_step"]
        if len(t) < 2:
            return 0.0, None
        breaks = gap_breaks(t, resumes)
        dt = np.diff(t)
        elapsed = float(dt[~breaks[1:]].sum())
        last_break = int(np.flatnonzero(breaks)[-1]) if breaks.any() else 0
        k = max(last_break, len(t) - 1 - window)  # the rate since the last gap only
        span = t[-1] - t[k]
        if self.max_steps is None or span <= 0 or steps[-1] <= steps[k]:
            return elapsed, None
        rate = (steps[-1] - steps[k]) / span
        return elapsed, max(0.0, (self.max_steps - steps[-1]) / rate)


class RunSeries:
    """Everything the lab draws of one run, read incrementally from its ``metrics.jsonl``.

    ``run_dir``: the run directory (a path, a :class:`~mlora_lab.rundir.RunDir`, or anything
    ``os.fspath`` takes, such as a ``Run``). ``poll()`` takes in the rows that arrived since the last
    call (a rewritten file, after a resume, starts it over). Only reads the run directory."""

    SYSTEM = ("time", "step", "mem", "peak", "tokens_per_s", "cpu_percent", "gpu_util")

    def __init__(self, run_dir: RunDir | str | os.PathLike, name: str | None = None) -> None:
        self.dir = run_dir if isinstance(run_dir, RunDir) else RunDir(os.path.abspath(os.fspath(run_dir)))
        self.name = name or self.dir.root.name
        self.title = self.dir.root.name
        """The job's name (``JobSpec.name``; the directory's name when job.json cannot be read)."""
        self._reader = MetricsReader(self.dir.metrics)  # its own offset: it needs every row
        self._max_steps: dict[str, int | None] = {}  # (None: no goal, step_goal)
        self._index: dict[str, int] = {}  # each tenant's place in the run, kept across a restart
        self._spec_fresh = False
        self._best: tuple[tuple[int, int] | None, tuple[float | None, float | None]] = (None, (None, None))
        self._read_spec()
        self._reset()

    @property
    def path(self) -> Path:
        return self.dir.root

    def _read_spec(self) -> None:
        with contextlib.suppress(SpecError, OSError, ValueError):  # a broken job.json: keep what we knew
            outline = Outline.read(self.dir.job)  # (names and goals: a million tenants in a second)
            self._max_steps = dict(outline.goals)
            self.title = outline.name or self.title

    def best(self) -> tuple[float | None, float | None]:
        """``(the lowest smoothed train loss of its tenants that learn from data, the highest smoothed mean
        reward of those that learn from rewards)`` (:attr:`TenantSeries.best_loss`, ``best_reward``; None:
        none has one), worked out again only after new rows."""
        if self._best[0] != (self.epoch, self.version):
            tenants = self.tenants.values()
            losses = [s.best_loss for s in tenants if s.rl is None and s.best_loss is not None]
            rewards = [s.best_reward for s in tenants if s.best_reward is not None]
            self._best = ((self.epoch, self.version), (min(losses, default=None), max(rewards, default=None)))
        return self._best[1]

    def colour(self, tenant: str) -> str:
        """The tenant's colour in every figure (:func:`~mlora_lab.lab.plotting.series_colour`: the job's
        name and the tenant's place in this run: job.json's order, then as tenants first appear)."""
        index = self._index.get(tenant)
        if index is None:  # (not a tenant of this run: a colour of its own name)
            index = zlib.crc32(tenant.encode("utf-8", "surrogatepass")) % 20
        return series_colour(self.title, index)

    def _reset(self) -> None:
        self.epoch = getattr(self, "epoch", -1) + 1  # counts restarts (a rewritten metrics.jsonl)
        self.tenants: dict[str, TenantSeries] = {}
        with collection_paused():  # (a series per tenant of job.json, a million of them maybe)
            for n in self._max_steps:
                self.tenant(n)
        self.system: dict[int, Columns] = {}
        self.resumes: list[float] = []
        self.t0: float | None = None
        self.global_step = 0
        self.tokens_per_s: float | None = None
        self.version = 0  # counts rows taken in: a drawing is stale when it differs
        self.rl_version = 0  # counts RL train rows and completion rows (the reward panel, the samples)
        self.preference_version = 0  # counts preference tenants' train rows (the preference panel)
        self.rewarded = False  # some tenant has a reward value (the dashboard then shows its panel)
        self.sampled = False  # some tenant has completion rows
        self.usage: dict[
            tuple[str, str | None], UsageRow
        ] = {}  # a served job's: the latest per (key, tenant)
        self.base_evals: dict[str, Columns] = {}  # the base model's eval/<name>/<metric> (JobSpec.evals)
        self.eval_version = 0  # counts evaluation rows (the dashboard's evaluation figure redraws on it)

    def tenant(self, name: str) -> TenantSeries:
        s = self.tenants.get(name)
        if s is None:  # a tenant added while the job runs: the job records it in job.json
            if name not in self._max_steps and not self._spec_fresh:
                self._read_spec()  # (once per batch of rows: a file naming 10**6 tenants reads it once)
                self._spec_fresh = True
            s = self.tenants[name] = TenantSeries(name, self._max_steps.get(name))
            self._index.setdefault(name, len(self._index))
        return s

    def poll(self) -> int:
        """Take in new rows; returns how many arrived."""
        generation = self._reader.generation
        new = self._reader.poll()
        if self._reader.generation != generation:  # metrics.jsonl was rewritten (a resume): start over
            self._reset()
            new = list(self._reader.rows)
        self.add(new)
        return len(new)

    @property
    def rows(self) -> list[Row]:
        """Every row read so far."""
        return self._reader.rows

    def add(self, rows: Sequence[Row]) -> None:
        with collection_paused():  # (a series per new tenant: none of them is garbage)
            self._add(rows)

    def _add(self, rows: Sequence[Row]) -> None:
        self._spec_fresh = False
        for r in rows:
            if self.t0 is None:
                self.t0 = r.time
            self.global_step = max(self.global_step, r.step)
            if isinstance(r, TrainRow):
                s = self.tenant(r.tenant)
                s.add_train(r)
                if s.rl is not None:
                    self.rl_version += 1
                    self.rewarded = self.rewarded or r.reward is not None
                elif r.extra and PREFERENCE_MARK in r.extra:  # (an SFT row: one check)
                    self.preference_version += 1
            elif isinstance(r, HeldoutRow):
                self.tenant(r.tenant).add_heldout(r)
            elif isinstance(r, SystemRow):
                cols = self.system.get(r.rank)
                if cols is None:
                    cols = self.system[r.rank] = Columns(*self.SYSTEM)
                cols.append(
                    r.time, r.step, r.mem_bytes, r.peak_mem_bytes, r.tokens_per_s, r.cpu_percent, r.gpu_util
                )
                if r.rank == 0:
                    self.tokens_per_s = r.tokens_per_s
            elif isinstance(r, TenantRow):
                self.tenant(r.tenant).add_state(r)
            elif isinstance(r, EventRow) and r.event is EventKind.RESUMED:
                self.resumes.append(r.time)
            elif isinstance(r, EventRow) and r.event is EventKind.WARNING and r.tenant is not None:
                self.tenant(r.tenant).warning = r.message
            elif isinstance(r, UsageRow):
                self.usage[(r.key, r.tenant)] = r
            elif isinstance(r, EvalMetricRow):  # (an evaluation's score: a named series of its model)
                base = r.model == "base" and "base" not in self.tenants
                named = self.base_evals if base else self.tenant(r.model).named
                cols = named.get(r.series)
                if cols is None:
                    cols = named[r.series] = Columns("step", "tenant_step", "tokens", "time", "value")
                s = None if base else self.tenants[r.model]
                cols.append(
                    r.step, r.step if s is None else s.step, 0 if s is None else s.tokens, r.time, r.value
                )
                self.eval_version += 1
            elif isinstance(r, CompletionRow):
                self.tenant(r.tenant).add_completion(r)
                self.rl_version += 1
                self.sampled = True
        self.version += len(rows)

    def x_values(self, cols: dict[str, np.ndarray], x: str) -> np.ndarray:
        """The x coordinates of a tenant's rows (``cols``: its train, eval or RL columns) for axis ``x``."""
        if x == "tenant step":
            return cols["tenant_step"]
        if x == "global step":
            return cols["step"]
        if x == "tokens":
            return cols["tokens"]
        if x == "wall time":
            return date_numbers(cols["time"])
        if x == "relative time":
            return cols["time"] - (self.t0 or 0.0)
        raise ValueError(f"unknown x axis {x!r}; choose from {', '.join(X_AXES)}")

    def xy(
        self, tenant: str, metric: str, x: str = "tenant step"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(x, y, breaks)`` of one tenant's ``metric`` (see :data:`METRICS`); ``breaks`` marks the points
        not to join to the previous one (on time axes only; None otherwise)."""
        s = self.tenants.get(tenant)
        source = METRICS.get(metric, "named")  # (else a train row's named metric: rewards/<fn>/mean, ...)
        if s is None and tenant == "base" and metric in self.base_evals:  # (the base's evaluation scores)
            cols = self.base_evals[metric].arrays()
            breaks = gap_breaks(cols["time"], self.resumes) if x in TIME_AXES else None
            return self.x_values(cols, x), cols["value"], breaks
        columns = (
            None
            if s is None
            else s.heldout
            if source == "heldout"
            else s.rl
            if source == "rl"
            else s.named.get(metric)
            if source == "named"
            else s.train
        )
        if columns is None:  # (not a tenant of the run, or an SFT tenant asked for an RL metric)
            return np.empty(0), np.empty(0), None
        cols = columns.arrays()
        y = cols["value" if source == "named" else "loss" if metric == "eval_loss" else metric]
        xs = self.x_values(cols, x)
        breaks = gap_breaks(cols["time"], self.resumes) if x in TIME_AXES else None
        return xs, y, breaks

    def has(self, metric: str) -> bool:
        """True when some tenant of the run has a finite value of ``metric``."""
        return any(np.isfinite(self.xy(name, metric)[1]).any() for name in self.tenants)

    def metric_names(self) -> list[str]:
        """The :data:`METRICS` the run :meth:`has`, in their order (what a message offers when a metric
        asked for has no value)."""
        return [metric for metric in METRICS if self.has(metric)]

    def system_x(self, cols: dict[str, np.ndarray], x: str) -> np.ndarray:
        """x of system rows: the wall clock when that is the x axis, else seconds since the run started
        (a rank has no tenant step or tokens)."""
        if x == "wall time":
            return date_numbers(cols["time"])
        if x == "global step":
            return cols["step"]
        return cols["time"] - (self.t0 or 0.0)
