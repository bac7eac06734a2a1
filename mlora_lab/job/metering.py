"""Metering a served job: what each API key's requests cost, per tenant (``UsageRow``s in metrics.jsonl).

The service driver (:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`) counts as its requests run: the input
tokens of each ``forward_backward`` (and forward-only) datum, the tokens each sample generates, the requests,
and the job's busy seconds, shared out as one bills a batch that many clients share:

    a step of wall time T whose tenants' datums hold n_1 ... n_k input tokens:  tenant i is busy T · n_i / Σ n
    (all of them equally when no datum ran: the step was optimiser steps alone)
    a generation of wall time T whose requests generate m_1 ... m_j tokens:    request i is busy T · m_i / Σ m

so that the busy seconds of every key add up to the time the job spent on its clients. Totals run from the
job's start; a resume takes them back from its checkpoint. Only rank 0 meters (it holds the requests'
owners and writes the rows).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from mlora_lab.rundir import UsageRow

WRITE_EVERY_S = 5.0
"""Usage rows are written at most this often while requests keep coming (and at once when the job goes
idle), so a busy job adds a row per (key, tenant) every few seconds, not one per request."""


@dataclass
class Usage:
    """One (key, tenant)'s totals (see :class:`~mlora_lab.rundir.UsageRow`)."""

    tokens_trained: int = 0
    tokens_forward: int = 0
    tokens_sampled: int = 0
    busy_s: float = 0.0
    requests: int = 0


Key = tuple[str, str | None]
"""(API key's name, tenant; None: the base model)."""


class Meter:
    """Usage per (key, tenant), and the rows saying it when it changed."""

    def __init__(self, every_s: float = WRITE_EVERY_S) -> None:
        self.every_s = every_s
        self.usage: dict[Key, Usage] = {}
        self._changed: set[Key] = set()
        self._written = 0.0
        self._began: float | None = None  # when the step or generation being metered began

    def add(
        self,
        key: str,
        tenant: str | None,
        *,
        trained: int = 0,
        forward: int = 0,
        sampled: int = 0,
        busy_s: float = 0.0,
        requests: int = 0,
    ) -> None:
        u = self.usage.setdefault((key, tenant), Usage())
        u.tokens_trained += trained
        u.tokens_forward += forward
        u.tokens_sampled += sampled
        u.busy_s += busy_s
        u.requests += requests
        self._changed.add((key, tenant))

    def began(self) -> None:
        """A step (or a generation) begins: :meth:`ended` shares out its time."""
        self._began = time.perf_counter()

    def ended(self, weights: Mapping[Key, int]) -> None:
        """The step :meth:`began` is over: its time shared out over ``weights`` (:meth:`share`)."""
        began, self._began = self._began, None
        if began is not None and weights:
            self.share(time.perf_counter() - began, weights)

    def share(self, seconds: float, weights: Mapping[Key, int]) -> None:
        """``seconds`` of the job's time, shared out over ``weights``' keys by their weights (tokens); equally
        when they are all 0."""
        total = sum(weights.values())
        for k, w in weights.items():
            self.add(*k, busy_s=seconds * (w / total if total else 1 / len(weights)))

    def rows(self, step: int, idle: bool = False, now: float | None = None) -> list[UsageRow]:
        """The rows of the (key, tenant)s that changed since the last rows, when it is time (``every_s``
        since then, or the job is ``idle``); none otherwise."""
        now = time.monotonic() if now is None else now
        if not self._changed or (not idle and now - self._written < self.every_s):
            return []
        self._written = now
        changed, self._changed = sorted(self._changed, key=lambda k: (k[0], k[1] or "")), set()
        return [UsageRow(step=step, key=k, tenant=t, **asdict(self.usage[(k, t)])) for k, t in changed]

    def state_dict(self) -> dict[str, Any]:
        """The totals, for the job's checkpoints: ``[[key, tenant, {counts}], ...]``."""
        return {"usage": [[k, t, asdict(u)] for (k, t), u in self.usage.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Take back :meth:`state_dict`'s totals; entries of the wrong shape are left out (how many)."""
        left_out = 0
        names = {f.name for f in fields(Usage)}
        entries = state.get("usage")
        for entry in entries if isinstance(entries, list) else []:
            try:
                key, tenant, counts = entry
                if not isinstance(key, str) or not (tenant is None or isinstance(tenant, str)):
                    raise TypeError("key and tenant are text")
                if set(counts) != names or any(isinstance(v, bool) for v in counts.values()):
                    raise TypeError("its counts are not a usage's")
                self.usage[(key, tenant)] = Usage(**{n: type(getattr(Usage(), n))(counts[n]) for n in names})
            except (TypeError, ValueError):
                left_out += 1
        return left_out
