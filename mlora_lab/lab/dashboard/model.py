"""What a dashboard shows, without a widget: the runs it offers, their states, series and ETAs, and RL
tenants' recent samples (an agent tenant's as whole episodes: :class:`Episode`).

:class:`ViewModel` polls run directories only: each run's :class:`~mlora_lab.lab.launchers.liveness.Liveness`
(reconciled, so a job that died unseen is recorded as failed or lost), its metrics through a
:class:`~mlora_lab.lab.records.series.RunSeries`, and its labels. The widgets (:mod:`.board`) read it; it can
be driven and tested without ipywidgets.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd

from mlora_lab.lab.launchers.liveness import Liveness, Verdict
from mlora_lab.lab.plotting import cut_note, run_name, run_titles
from mlora_lab.lab.records.logs import read_log
from mlora_lab.lab.records.series import RunSeries, TenantSeries, rows_frame
from mlora_lab.rundir import (
    HeldoutRow,
    RunDirError,
    RunState,
    Status,
    TenantState,
    TrainRow,
    read_labels,
    read_status,
    shown_tenant_state,
)
from mlora_lab.rundir.files import TextEnum
from mlora_lab.text import shown_text

RESCAN_EVERY_S = 5.0
"""A workdir view looks for new runs (and re-reads tags) this often."""

Key = tuple[str, str]
"""A series of a view: (run name, tenant)."""


class Unreadable(TextEnum):
    """A run shown in a view whose status.json cannot be read: a state no run is ever in."""

    BROKEN = "broken"


Shown = RunState | Unreadable
"""The state a view shows a run in."""
TenantShown = TenantState | RunState
"""The state a view shows a tenant in: its own, or its run's once the run ended while it still went."""


def is_final(state: Shown | None) -> bool:
    return isinstance(state, RunState) and state.final


SAMPLES_SHOWN = 3
"""Sampled completions the samples view shows per RL tenant: its latest."""
PROMPT_CHARS, COMPLETION_CHARS = 300, 600
"""A sample's prompt and completion are shown up to about this many characters (cut in the middle: a
prompt rendered through a chat template starts with the same system text every time)."""


MESSAGE_CHARS, TOOL_CHARS = 600, 300
"""A message of an episode is shown up to about this many characters (cut in the middle, as a completion); a
tool's result (and a tool call's arguments) up to this many, then ``…``: a tool may return pages."""
MESSAGES_SHOWN = 40
"""The most messages shown of one episode (its first quarter and its last three quarters of them; a line says
how many were left out between)."""


@dataclass(frozen=True)
class Message:
    """One message of an episode as a view shows it: texts cut and hidden characters escaped, plain text still
    to be escaped for HTML."""

    role: str
    content: str
    calls: tuple[str, ...] = ()
    """An assistant's tool calls, each ``name(arguments)``."""
    name: str = ""
    """A tool message's tool."""


@dataclass(frozen=True)
class Episode:
    """An agent tenant's episode as a view shows it (its completion row's
    :class:`~mlora_lab.rundir.EpisodeRecord`)."""

    turns: int | None
    """The model's turns."""
    stop: str
    """Why it ended: ``answered``, ``max_turns``, ``context``, ``returned``."""
    parts: tuple[tuple[str, float | None, float | None], ...]
    """The env's rubric: ``(name, score, weight)`` each, its reward ``Σ score·weight``."""
    messages: tuple[Message, ...]
    left_out: int = 0
    """Messages not shown, between the first and the last ones (:data:`MESSAGES_SHOWN`)..."""
    left_at: int = 0
    """... before ``messages[left_at]``."""


def _text(content: Any) -> str:
    """A message's content as text: a string, OpenAI's content parts (their ``text``), else its JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return json.dumps(content, default=str)


def cut_end(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, then ``…`` (the start of a tool's output says what it is), hidden
    characters escaped."""
    return shown_text(text[:limit] + ("…" if len(text) > limit else ""), limit + 1)


def _call(call: Any) -> str:
    """A tool call as ``name(arguments)`` (OpenAI's ``{function: {name, arguments}}`` or a bare
    ``{name, arguments}``)."""
    f = call.get("function", call) if isinstance(call, Mapping) else {}
    f = f if isinstance(f, Mapping) else {}
    args = f.get("arguments", "")
    args = args if isinstance(args, str) else json.dumps(args, default=str)
    return f"{shown_text(str(f.get('name', '?')), 80)}({cut_end(args, TOOL_CHARS)})"


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _parts(value: Any) -> tuple[tuple[str, float | None, float | None], ...]:
    """The rubric ``{name: [score, weight]}`` (a bare number: a score of weight 1)."""
    if not isinstance(value, Mapping):
        return ()
    out = []
    for name, v in value.items():
        if isinstance(v, list | tuple) and len(v) == 2:
            out.append((shown_text(str(name), 80), _number(v[0]), _number(v[1])))
        else:
            out.append((shown_text(str(name), 80), _number(v), 1.0))
    return tuple(out)


def episode_of(extra: Mapping[str, Any] | None) -> Episode | None:
    """The episode a completion row's ``episode`` record holds, as plain data (None: no ``messages`` list).
    Whatever the run directory holds is shown, never trusted: a message that is not a mapping shows as its
    text, a role or a tool call of the wrong type as ``?``."""
    messages = (extra or {}).get("messages")
    if not isinstance(messages, list):
        return None
    shown = []
    cut = max(0, len(messages) - MESSAGES_SHOWN)
    head = MESSAGES_SHOWN // 4
    for m in messages[:head] + messages[head + cut :] if cut else messages:
        if not isinstance(m, Mapping):
            shown.append(Message("?", shown_text(_text(m), MESSAGE_CHARS)))
            continue
        role = m.get("role") if isinstance(m.get("role"), str) else "?"
        text = _text(m.get("content"))
        calls = m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else []
        shown.append(
            Message(
                shown_text(role, 40),
                cut_end(text, TOOL_CHARS) if role == "tool" else shown_text(text, MESSAGE_CHARS),
                tuple(_call(c) for c in calls),
                shown_text(str(m.get("name") or ""), 80),
            )
        )
    turns = extra.get("turns")
    stop = extra.get("stop")
    return Episode(
        turns=int(turns) if _number(turns) is not None else None,
        stop=shown_text(stop, 40) if isinstance(stop, str) else "",
        parts=_parts(extra.get("parts")),
        messages=tuple(shown),
        left_out=cut,
        left_at=head if cut else 0,
    )


@dataclass(frozen=True)
class Sample:
    """One sampled completion (a :class:`~mlora_lab.rundir.CompletionRow`) as a view shows it: its texts
    cut and their hidden characters escaped (:func:`~mlora_lab.text.shown_text`), plain text still to be
    escaped for HTML."""

    step: int
    tenant_step: int
    reward: float | None
    prompt: str
    completion: str
    extra: str = ""
    """What the reward functions logged for it with ``log_extra``: ``column: value`` lines."""
    episode: Episode | None = None
    """An agent tenant's: the whole episode (its ``completion`` is then every turn's text, one string)."""
    version: int | None = None
    """The adapter version that sampled it (``CompletionRow.adapter_version``; ``None`` in older runs)."""

    @property
    def lag(self) -> int:
        """How many optimiser steps older than the adapter its step trained the sampling adapter was (0: on
        policy; ``rl.max_staleness`` bounds it at the window's first step)."""
        return 0 if self.version is None else max(self.tenant_step - 1 - self.version, 0)


def sample_of(row: Any) -> Sample:
    """A :class:`~mlora_lab.rundir.CompletionRow` as a view shows it: an agent tenant's with its
    :class:`Episode` (from the row's :class:`~mlora_lab.rundir.EpisodeRecord`)."""
    record = getattr(row, "episode", None)
    episode = episode_of(msgspec.to_builtins(record)) if record is not None else None
    extra = row.extra or {}
    return Sample(
        row.step,
        row.tenant_step,
        row.reward,
        shown_text(row.prompt, PROMPT_CHARS),
        shown_text(row.completion, COMPLETION_CHARS),
        shown_text("\n".join(f"{k}: {v}" for k, v in extra.items()), PROMPT_CHARS),
        episode,
        getattr(row, "adapter_version", None),
    )


@dataclass
class RunView:
    """One run of a view: its directory, liveness, series and what was last read of it."""

    name: str
    liveness: Liveness
    series: RunSeries
    state: Shown | None = None
    """``None`` before the first poll."""
    verdict: Verdict | None = None
    status: Status | None = None
    labels: tuple[str, str] = ("", "")
    """Its tags (comma-joined) and note (:func:`~mlora_lab.lab.plotting.cut_note`)."""
    title: str = ""
    """What labels call it: the job's name, told apart from other runs of the view with the same name
    (:func:`~mlora_lab.lab.plotting.run_titles`)."""
    _labels_seen: tuple | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.series.path

    @property
    def final(self) -> bool:
        return is_final(self.state)

    def poll_state(self) -> bool:
        """Reconcile the run's state (recording an end found: :meth:`Liveness.reconcile
        <mlora_lab.lab.launchers.liveness.Liveness.reconcile>`); True if it changed."""
        try:
            self.verdict = self.liveness.reconcile()
            state: Shown = self.verdict.state
            self.status = read_status(self.path)
        except (RunDirError, OSError):
            state = Unreadable.BROKEN
        changed = state != self.state
        self.state = state
        return changed

    def tenant_state(self, tenant: str) -> TenantShown | None:
        """The state a tenant is shown in: its own (from its latest tenant row), or its run's once the
        run ended while it was still going (:func:`~mlora_lab.rundir.shown_tenant_state`); None when
        nothing is known of it yet in a run whose state cannot be read."""
        s = self.series.tenants[tenant]
        # a tenant with steps but no tenant row yet (an older job logs none at the start) is running
        own = s.state or (TenantState.RUNNING if len(s.train) else None)
        if isinstance(self.state, Unreadable):
            return own
        shown = shown_tenant_state(own, self.state or RunState.RUNNING)
        try:
            return TenantState(shown)
        except ValueError:  # the run's state: it ended while the tenant still went
            return RunState(shown)

    def failed_tenants(self) -> list[str]:
        """Tenants quarantined or refused."""
        bad = (TenantState.FAILED, TenantState.REFUSED)
        return [t for t, s in self.series.tenants.items() if s.state in bad]

    def elapsed(self) -> float | None:
        """Seconds from the run's start to its end (or to now, while it goes)."""
        if self.status is None or not self.status.started:
            return None
        end = self.status.ended if self.final and self.status.ended else time.time()
        return end - self.status.started

    def eta(self) -> float | None:
        """Seconds until the slowest running tenant reaches its ``max_steps`` (None: unknown, or the
        run has ended)."""
        if self.final:
            return None
        resumes = self.series.resumes
        etas = [
            s.timing(resumes)[1]
            for t, s in self.series.tenants.items()
            if self.tenant_state(t) is TenantState.RUNNING
        ]
        etas = [e for e in etas if e is not None]
        return max(etas) if etas else None  # the run ends with its slowest running tenant

    @property
    def waiting(self) -> str | None:
        """Why a queued run waits (Slurm's words)."""
        return self.verdict.waiting if self.verdict is not None else None

    @property
    def error(self) -> str | None:
        return self.verdict.error if self.verdict is not None else None

    def failure_log(self, lines: int = 6) -> str:
        """The log tail of the rank its error names (``rank 1: ...``), else rank 0's."""
        error = self.error or ""
        rank = error.split(":")[0].replace("rank", "").strip() if error.startswith("rank") else "0"
        return read_log(self.liveness.dir, int(rank) if rank.isdigit() else 0, tail=lines)

    def read_labels(self) -> tuple[str, str]:
        """Its tags and note, read again only when labels.json changed; a note longer than
        :data:`~mlora_lab.lab.plotting.NOTE_CHARS` (a hand-written file may hold megabytes) is cut."""
        try:
            st = self.path.joinpath("labels.json").stat()
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            seen = None
        if seen is not None and seen == self._labels_seen:
            return self.labels
        self._labels_seen = seen
        try:
            labels = read_labels(self.path)
        except (RunDirError, OSError):
            return "", ""
        return ", ".join(labels.tags), cut_note(labels.note)


@dataclass
class ViewModel:
    """The runs a view offers (and, for a workdir, the directory it watches for new ones)."""

    workdir: Path | None = None
    runs: dict[str, RunView] = field(default_factory=dict)
    _paths: dict[str, Path] = field(default_factory=dict)  # run name -> its directory
    _labels_read: float = 0.0
    _rescanned: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, runs: Any) -> ViewModel:
        """A view of ``runs``: a run (a ``Run`` or a run directory), a list of them, or a workdir (every
        run under it, and the ones launched there later)."""
        if isinstance(runs, str | os.PathLike) and not (Path(os.fspath(runs)) / "job.json").is_file():
            path = Path(os.fspath(runs))
            if not path.is_dir():
                raise RunDirError(f"{path}: neither a run directory nor a workdir of runs")
            model = cls(workdir=path)
            model.rescan()
            return model
        model = cls()
        for run in [runs] if isinstance(runs, str | os.PathLike) else runs:
            model.add(run)
        return model

    def add(self, run: Any) -> None:
        """Offer a run: a run directory, or anything ``os.fspath`` takes that may carry its liveness
        (a ``Run`` does: :meth:`~mlora_lab.lab.launchers.liveness.Liveness.of`)."""
        liveness = Liveness.of(run)
        if not liveness.dir.is_run():
            raise RunDirError(f"{liveness.dir.root}: not a run directory (no job.json)")
        name = run_name(
            liveness.dir.root, self._paths
        )  # two runs/ folders may each hold a run of the same name
        if name not in self.runs:
            self.runs[name] = RunView(name, liveness, RunSeries(liveness.dir, name))

    def rescan(self) -> None:
        """A workdir view: offer runs that appeared since the last look."""
        self._rescanned = time.monotonic()
        known = {view.path for view in self.runs.values()}
        for job in sorted(self.workdir.glob("*/job.json")):
            if job.parent.absolute() not in known:
                with contextlib.suppress(RunDirError, OSError):
                    self.add(job.parent)

    def due_rescan(self) -> bool:
        return self.workdir is not None and time.monotonic() - self._rescanned > RESCAN_EVERY_S

    def poll(self, guard: AbstractContextManager[Any] | None = None) -> bool:
        """Read the states and new rows of every offered run (and, every :data:`RESCAN_EVERY_S`,
        their labels); True if anything changed. The rows are taken in under ``guard`` (a lock that
        drawing holds), the states outside it (asking Slurm may take a while)."""
        changed = False
        for view in self.runs.values():
            changed |= view.poll_state()
            with guard or contextlib.nullcontext():
                changed |= bool(view.series.poll())
        if time.monotonic() - self._labels_read > RESCAN_EVERY_S:
            self._labels_read = time.monotonic()
            for view in self.runs.values():
                labels = view.read_labels()
                changed |= view.labels != labels
                view.labels = labels
        return changed

    @property
    def going(self) -> bool:
        """True while a run may still change (one has not ended)."""
        return any(not view.final for view in self.runs.values())

    def live(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` whose run has not ended (and was read)."""
        return [n for n in names if self.runs[n].state is not None and not self.runs[n].final]

    def keys(self, names: Sequence[str], limit: int | None = None) -> list[Key]:
        """The (run, tenant) pairs of these runs, in order (runs as given, each run's tenants as listed):
        all of them, or the first ``limit``."""
        out: list[Key] = []
        for n in names:
            tenants = self.runs[n].series.tenants
            room = len(tenants) if limit is None else limit - len(out)
            out += [(n, t) for t in itertools.islice(tenants, max(0, room))]
        return out

    def count(self, names: Sequence[str]) -> int:
        """How many (run, tenant) pairs these runs have."""
        return sum(len(self.runs[n].series.tenants) for n in names)

    def retitle(self, names: Sequence[str]) -> None:
        """Give the runs their titles for a view showing ``names`` together (the others their own name)."""
        titles = run_titles([(self.runs[n].series.title, n) for n in names])
        for n, title in zip(names, titles):
            self.runs[n].title = title
        for n, view in self.runs.items():
            if n not in names:
                view.title = view.series.title

    def tenant(self, key: Key) -> TenantSeries:
        return self.runs[key[0]].series.tenants[key[1]]

    def colour(self, key: Key) -> str:
        """A series' colour (:func:`~mlora_lab.lab.plotting.series_colour`: its run's name and its place
        in the run)."""
        return self.runs[key[0]].series.colour(key[1])

    # -- RL tenants: whether to show their views, and what ------------------------------------------
    def rewarded(self, names: Sequence[str]) -> bool:
        """True when some tenant of these runs has a reward value (the reward panel is shown)."""
        return any(self.runs[n].series.rewarded for n in names)

    def sampled(self, names: Sequence[str]) -> bool:
        """True when some tenant of these runs has sampled completions (the samples view is shown)."""
        return any(self.runs[n].series.sampled for n in names)

    def rl_versions(self, names: Sequence[str]) -> tuple[tuple[int, int], ...]:
        """What the RL views of these runs were drawn from: each run's restarts and RL rows taken in
        (they are stale when it differs; an SFT row never changes it)."""
        return tuple((self.runs[n].series.epoch, self.runs[n].series.rl_version) for n in names)

    def samples(self, picked: Sequence[Key], n: int = SAMPLES_SHOWN) -> list[tuple[Key, list[Sample]]]:
        """Per picked tenant that has sampled completions, in ``picked``'s order: its latest ``n``, newest
        first (the last rows of metrics.jsonl first; texts as :class:`Sample` shows them)."""
        out = []
        for key in picked:
            rows = self.tenant(key).samples
            if not rows:
                continue
            latest = [rows[-1 - i] for i in range(min(n, len(rows)))]
            out.append((key, [sample_of(r) for r in latest]))
        return out

    def logged(self, key: Key) -> dict[str, float | None]:
        """What a tenant's reward functions logged with ``log_metric``, at its latest logged step (its named
        metrics but the per-function rewards, which the reward panel draws)."""
        named = self.tenant(key).named
        return {
            name: cols.last("value")
            for name, cols in named.items()
            if not name.startswith("rewards/") and len(cols)
        }

    def metrics(self, picked: Sequence[Key]) -> pd.DataFrame:
        """The train and eval rows of the ``picked`` tenants, with a ``run`` column first."""
        tenants: dict[str, set[str]] = {}
        for run, tenant in picked:
            tenants.setdefault(run, set()).add(tenant)
        frames = []
        for run, names in tenants.items():
            rows = [
                r
                for r in self.runs[run].series.rows
                if isinstance(r, TrainRow | HeldoutRow) and r.tenant in names
            ]
            if rows:
                df = rows_frame(rows)
                df.insert(0, "run", run)
                frames.append(df)
        if not frames:
            return pd.DataFrame(columns=["run", "kind", "tenant"])
        return pd.concat(frames, ignore_index=True)
