"""Clients that go away and come back: the service driver's watch over its clients' sessions.

A client shows life with every request naming its session or model, and with the SDK's heartbeat (every
10 s). One silent for ``session_timeout_s``, or whose session finished, has gone away: its tenants are saved
(``adapters/<tenant>``) and paused, never lost; a paused one whose client shows life again goes on where it
stopped. A session that made no model is forgotten then
(:meth:`~mlora_lab.service.state.ServiceState.expire_sessions`).

Rank 0 decides (it holds the sessions) and every process applies what it decided (a pause saves the
adapter: a collective). The watch looks once a second at a step boundary, and again, whatever the time,
just before a checkpoint is written (:meth:`SessionWatch.changes` with ``now``): a checkpoint must not keep
as live a client that had gone away by then, or a resumed job would give it a fresh timeout.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from mlora_lab.job.tenants import TenantPool
from mlora_lab.rundir import TenantState

GONE = "its client sent no heartbeat nor request"
"""The start of the reason a tenant of a client that went away is paused with."""

WATCH_EVERY_S = 1.0
"""How often, at most, the step boundaries look at the sessions."""


class SessionWatch:
    """Rank 0's view of which clients went away or came back (``timeout_s``: ``Service.session_timeout``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._watched = 0.0

    def changes(
        self, state: Any, pool: TenantPool, names: Mapping[str, str], now: bool = False
    ) -> tuple[dict[str, str], list[str]]:
        """The tenants of clients that went away (to pause, with why) and those whose client is back (to
        resume), from the service's ``state`` (``names``: model id -> tenant). Looked at once a second, or
        ``now``; sessions that made no model and are over are forgotten then."""
        at = time.time()
        pauses: dict[str, str] = {}
        resumes: list[str] = []
        if not now and at - self._watched < WATCH_EVERY_S:
            return pauses, resumes
        self._watched = at
        state.expire_sessions(at, self.timeout_s)
        with state.lock:
            sessions = [(s.finished, s.last_seen, list(s.model_ids)) for s in state.sessions.values()]
        for finished, seen, models in sessions:
            gone = finished or at - seen > self.timeout_s
            for model_id in models:
                t = pool.tenants.get(names.get(model_id, ""))
                if t is None:
                    continue
                if gone and t.state is TenantState.RUNNING:
                    pauses[t.name] = "its client finished its session" if finished else GONE
                elif not gone and t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE):
                    resumes.append(t.name)
        return pauses, resumes


def apply_changes(pool: TenantPool, pauses: Mapping[str, str], resumes: list[str]) -> None:
    """On every process: pause (after saving the adapter: a collective) the tenants of clients that went
    away, and run again those whose client is back."""
    for name, why in pauses.items():
        pool.save_adapter_logged(name)
        pool.set_state(pool[name], TenantState.PAUSED, f"{why} (adapter saved)")
    for name in resumes:
        pool.set_state(pool[name], TenantState.RUNNING)
