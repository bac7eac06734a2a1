""":class:`Mirror`: rows in, tracker runs out, and one tracker's failure (or hang) kept from the others;
:class:`Background`: the same off the job's training loop.

The job's rank 0 makes one (:func:`mlora_lab.trackers.open_sink`) and hands it each row the recorder
writes; :func:`mlora_lab.trackers.mirror_run` makes one and hands it every row of a finished run. Either
way the rows go through the same :class:`~mlora_lab.trackers.points.RowMapper`, tracker runs are opened
when their first row comes (with their hyperparameters, read from the run's job.json, which lists every
tenant the run has had), and any exception a tracker raises, at any point, takes that tracker out: it
is said once through ``say`` and the other trackers, and the job, go on.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from mlora_lab.rundir import Row, RunDir, name_problem
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, error_line
from mlora_lab.trackers.backends import BACKENDS, Backend, Where
from mlora_lab.trackers.points import (
    JOB,
    Log,
    Note,
    RowMapper,
    TrackerRun,
    job_config,
    job_title,
    tenant_config,
    tenant_run_config,
    tenants_entries,
)

CALL_TIMEOUT_S = 120.0
"""How long one call into a tracker (open a run, log a row, close) may take before the tracker is taken
out as hung (W&B's first contact with its server is the slowest)."""
MAX_QUEUED = 100_000
"""The most rows :class:`Background` holds for trackers that fall behind."""


class TenantSpecs:
    """Each tenant's spec, from the run's job.json (read again when a tenant it does not list appears:
    the job adds a tenant there before its first row)."""

    def __init__(self, run: RunDir, spec: JobSpec) -> None:
        self.run = run
        self.known: dict[str, Tenant] = {t.name: t for t in spec.tenants if isinstance(t, Tenant)}

    def config(self, name: str) -> dict[str, Any]:
        if name not in self.known:
            try:
                spec = JobSpec.load(self.run.job)
            except SpecError:
                spec = None
            if spec is not None:
                self.known.update((t.name, t) for t in spec.tenants if t.name not in self.known)
        return tenant_config(self.known.get(name), name)


class Mirror:
    """Mirrors rows to ``trackers`` for the job of ``spec`` in ``run``; ``say(sentence)`` hears of a
    tracker that failed (once each). Nothing here raises past :meth:`write` and :meth:`close`."""

    def __init__(
        self, run: RunDir, spec: JobSpec, trackers: Iterable[str], say: Callable[[str], None]
    ) -> None:
        self.say = say
        self.group = spec.report_group
        self.title = job_title(spec, run.root)
        self.mapper = RowMapper(self.group)
        self.tenants = TenantSpecs(run, spec)
        self.job = job_config(spec)
        self.runs: dict[str | None, TrackerRun] = {}
        self.described: set[str] = set()  # tenants whose config the job's run has (report_group="job")
        self.failed: dict[str, str] = {}
        self.skipped: set[str] = set()  # tenant names of rows left out
        self._workers: dict[str, _Worker] = {}  # each tracker's own thread
        self._lock = threading.RLock()  # say() may log an event row, which comes back here
        where = Where(run, spec.logging_dir, spec.project)
        self.backends: dict[str, Backend] = {}
        for name in trackers:
            self._call(name, lambda name=name: self.backends.__setitem__(name, BACKENDS[name](where)))

    def destinations(self) -> dict[str, str]:
        """Where each tracker still mirroring writes."""
        return {name: b.destination() for name, b in self.backends.items()}

    def seed(self, rows: Iterable[Row]) -> None:
        """Rows already written before this mirror (a resumed job's): learnt from, not sent."""
        for row in rows:
            self.mapper.seed(row)

    def write(self, row: Row) -> None:
        """Send ``row`` to every tracker still mirroring."""
        with self._lock:
            if not self.backends:
                return
            tenant = getattr(row, "tenant", None)
            if tenant is not None and (why := name_problem(tenant)) is not None:
                # a hand-written metrics.jsonl: a tenant name that cannot name a folder (TensorBoard's
                # run) never comes from a job; its rows are left out, said once
                if tenant not in self.skipped:
                    self.skipped.add(tenant)
                    self.say(f"rows of tenant {brief(tenant)} are not mirrored: not a tenant name ({why})")
                return
            try:
                items = [
                    (item, self._new_run(item.key), self._described_now(row))
                    for item in self.mapper.items(row)
                ]
            except Exception as e:  # a row this mirror cannot map: no tracker can have it, or the next ones
                for name in list(self.backends):
                    self._drop(name, e)
                return
            self._send_all(items)

    def _send_all(self, items: list[tuple[Log | Note, TrackerRun | None, dict[str, Any]]]) -> None:
        for item, run, more in items:
            for name in list(self.backends):
                self._call(
                    name,
                    lambda name=name, item=item, run=run, more=more: self._send(name, run, more, item),
                )

    def close(self) -> None:
        """Finish every tracker run (idempotent: the job's exit calls it again)."""
        with self._lock:
            with contextlib.suppress(Exception):  # (the last step's completions, waiting for a next row)
                self._send_all([(item, self._new_run(item.key), {}) for item in self.mapper.flush()])
            for name in list(self.backends):
                self._call(name, self.backends[name].close)
            self.backends = {}
            for worker in self._workers.values():
                worker.stop()
            self._workers = {}

    # -- inside ----------------------------------------------------------------------------------------
    def _new_run(self, key: str | None) -> TrackerRun | None:
        """The tracker run of ``key`` if it is not open yet (it is then recorded as open)."""
        if key in self.runs:
            return None
        if key is not JOB:
            config = tenant_run_config(self.job, self.tenants.config(key))
            run = TrackerRun(key, f"{self.title}/{key}", self.title, "tenant", f"tenants/{key}", config)
        elif self.group == "tenant":
            run = TrackerRun(JOB, self.title, self.title, "job", "job", dict(self.job))
        else:  # the one run of the job: with every tenant job.json lists so far
            config = dict(self.job)
            for name in self.tenants.known:
                config.update(self._undescribed(name))
            run = TrackerRun(JOB, self.title, None, "job", "job", config)
        run.since = self.mapper.since(key)
        self.runs[key] = run
        return run

    def _described_now(self, row: Row) -> dict[str, Any]:
        """``report_group="job"``: the config of the row's tenant, the first time the job's run hears of it."""
        tenant = getattr(row, "tenant", None)
        return self._undescribed(tenant) if self.group == "job" and isinstance(tenant, str) else {}

    def _undescribed(self, tenant: str) -> dict[str, Any]:
        """``report_group="job"``: the config entries of ``tenant`` if the job's run has not had them."""
        if tenant in self.described:
            return {}
        self.described.add(tenant)
        return tenants_entries(tenant, self.tenants.config(tenant))

    def _send(self, name: str, run: TrackerRun | None, more: dict[str, Any], item: Log | Note) -> None:
        backend = self.backends[name]
        if run is not None:
            backend.start(run)
        if more:
            backend.add_config(JOB, item.step, more)
        if isinstance(item, Log):
            backend.log(item.key, item.step, item.values)
        else:
            backend.note(item.key, item.step, item.tag, item.text)

    def _call(self, name: str, fn: Callable[[], Any]) -> None:
        """``fn()`` on ``name``'s own thread (every call of one tracker on the same thread: W&B's client keeps
        per-thread state), waited for at most :data:`CALL_TIMEOUT_S`; if it raises, or hangs past that,
        ``name`` gets no more rows, and ``say`` hears it once (a hung thread is left to itself: a daemon,
        which ends with the process)."""
        if name in self.failed:
            return
        worker = self._workers.get(name)
        if worker is None:
            worker = self._workers[name] = _Worker(f"tracker-{name}")
        finished, raised = worker.call(fn, CALL_TIMEOUT_S)
        if not finished:
            self._drop(name, TimeoutError(f"no answer in {CALL_TIMEOUT_S:g} s"), hung=True)
        elif raised is not None:
            self._drop(name, raised)

    def _drop(self, name: str, e: Exception, hung: bool = False) -> None:
        """``name`` raised ``e`` (or hung): it gets no more rows, and ``say`` hears it (once)."""
        backend = self.backends.pop(name, None)
        worker = self._workers.pop(name, None)
        self.failed[name] = why = f"{type(e).__name__}: {error_line(e)}"
        if backend is not None and worker is not None and not hung:  # (a hung one would hang its close too)
            worker.call(backend.close, CALL_TIMEOUT_S)  # (it failed already: what it raises adds nothing)
        if worker is not None:
            worker.stop()
        self.say(f"{name} failed ({why}); no more rows go to it, and training goes on")


class _Worker:
    """A daemon thread that runs the calls it is given, one at a time, in order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event, list] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def call(self, fn: Callable[[], Any], timeout: float) -> tuple[bool, Exception | None]:
        """Run ``fn`` there; ``(whether it finished within timeout seconds, what it raised)``."""
        done, raised = threading.Event(), []
        self._calls.put((fn, done, raised))
        if not done.wait(timeout):
            return False, None
        return True, raised[0] if raised else None

    def stop(self) -> None:
        self._calls.put(None)  # (a thread hung in a call never reads it: it stays hung, a daemon)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, done, raised = item
            try:
                fn()
            except Exception as e:
                raised.append(e)
            finally:
                done.set()


class Background:
    """The job's mirror, off its training loop: :meth:`write` queues the row and returns; a thread hands the
    rows to the :class:`Mirror`, in order. What the mirror says of a failed tracker is said on the loop's
    thread, at its next :meth:`write` (or at :meth:`close`): ``say`` writes an event row, which the loop's
    thread alone writes. At most :data:`MAX_QUEUED` rows wait; past that, rows are left out (said once)."""

    def __init__(self, make: Callable[[Callable[[str], None]], Mirror], say: Callable[[str], None]) -> None:
        self.say = say
        self._said: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.mirror = make(self._said.put)
        self._rows: queue.Queue[Row | None] = queue.Queue(maxsize=MAX_QUEUED)
        self._full = False
        self._closed = self._draining = False
        self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self._thread.start()

    def seed(self, rows: Iterable[Row]) -> None:
        self.mirror.seed(rows)

    def destinations(self) -> dict[str, str]:
        return self.mirror.destinations()

    def write(self, row: Row) -> None:
        """Queue ``row`` for the trackers (never blocks, never raises)."""
        self._say_what_was_said()
        if self._closed:
            return
        if self._draining:  # (close: the thread is done; the last events go straight to the trackers)
            self.mirror.write(row)
            return
        try:
            self._rows.put_nowait(row)
        except queue.Full:
            if not self._full:
                self._full = True
                self.say(
                    f"the trackers fall behind ({MAX_QUEUED:,} rows wait): rows are left out until they catch up"
                )

    def close(self) -> None:
        """Send what is queued (every tracker call bounded by :data:`CALL_TIMEOUT_S`), then finish the
        tracker runs. Idempotent."""
        if not self._closed:
            self._rows.put(None)
            self._thread.join()
            self._draining = True
            self._say_what_was_said()  # (what failed in the last rows, said and mirrored to the others)
            self._closed = True
            self.mirror.close()
        self._say_what_was_said()

    def _work(self) -> None:
        while (row := self._rows.get()) is not None:
            self.mirror.write(row)

    def _say_what_was_said(self) -> None:
        while True:
            try:
                sentence = self._said.get_nowait()
            except queue.Empty:
                return
            self.say(sentence)
