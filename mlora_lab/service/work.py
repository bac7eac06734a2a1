"""Where the HTTP thread and the training loop meet: requests in, results out, both thread-safe.

The server thread (:mod:`.app`) never computes: it checks a request, turns it into a :class:`Work` item,
puts it in the :class:`Inbox` and answers the client with a future id at once. The training loop (the
service driver, on rank 0) takes the waiting items at each step boundary, runs them in every model's
``seq_id`` order, and settles each item's future in :class:`Futures`; a client's ``retrieve_future``
long-polls there. Nothing here knows HTTP or torch.

Ordering. A training client numbers its ordered requests 1, 2, 3, ... (``seq_id``, per model); it may send
them concurrently (the chunks of one ``forward_backward`` arrive together, the first chunk last), so the
inbox hands out, per model, only the run of consecutive ``seq_id`` s that follows the last one handed out
(:meth:`Inbox.take`); a later one waits for the gap to fill. A request sent again with a ``seq_id`` already
received (the SDK resends after a timeout or a 5xx) is answered with the first one's future and never run
twice (:meth:`Inbox.put`).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """What a work item asks of the training loop."""

    CREATE_MODEL = "create_model"
    FORWARD_BACKWARD = "forward_backward"  # also ``forward`` (its ForwardBackward says forward_only)
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"  # save_state: adapter + optimiser, resumable
    SAVE_FOR_SAMPLER = "save_weights_for_sampler"  # a frozen snapshot to sample from
    LOAD_WEIGHTS = "load_weights"
    SAMPLE = "sample"


ORDERED = frozenset(
    {Kind.FORWARD_BACKWARD, Kind.OPTIM_STEP, Kind.SAVE_WEIGHTS, Kind.SAVE_FOR_SAMPLER, Kind.LOAD_WEIGHTS}
)
"""The kinds a training client numbers with ``seq_id`` (and that run in that order)."""


class ErrorCategory(StrEnum):
    """How the SDK files a failed future (its ``RequestErrorCategory`` values)."""

    USER = "user"
    SERVER = "server"
    UNKNOWN = "unknown"


@dataclass
class Work:
    """One request for the training loop."""

    kind: Kind
    request_id: str
    owner: str
    """The name of the API key that sent it (a key reaches only its own models and checkpoints)."""
    model_id: str | None = None
    seq_id: int | None = None
    body: Any = None
    """The checked request: a :class:`~.wire.ForwardBackward`, or the fields of the JSON body."""
    received: float = field(default_factory=time.time)


@dataclass
class Result:
    """A settled future: a JSON object, protobuf bytes (``content_type`` says which), or an error."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: ErrorCategory = ErrorCategory.USER

    @property
    def content_type(self) -> str:
        return "application/x-protobuf" if self.proto is not None else "application/json"


class InboxFull(Exception):
    """The inbox holds as many waiting items as it may: the client should retry later (HTTP 429)."""


class NeverFits(Exception):
    """One request of more items than its source may ever have waiting (``most``: its share, or the whole
    inbox): retrying cannot help (HTTP 413, naming ``most``)."""

    def __init__(self, items: int, most: int) -> None:
        super().__init__(f"{items} items, and at most {most} may wait at once")
        self.items, self.most = items, most


class Refusal(Exception):
    """A numbered request sent again after it was refused at the door: the first answer, again (``status``
    and ``detail``), since its ``seq_id`` was stepped over and can never run."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail
        super().__init__(str(detail))


class SeqIdPassed(Exception):
    """A numbered request whose ``seq_id`` was handed out long ago and is no longer remembered (HTTP 422):
    not a resend the inbox can answer, and it could never run."""


class Inbox:
    """Waiting work, at most ``capacity`` items (see the module docstring for the ordering).

    Fair shares: one **source** (a model's numbered requests, or one key's unnumbered ones such as samples)
    holds at most ``share`` of the waiting items (a quarter of ``capacity`` by default), so a client that
    floods the service, or sends ``seq_id`` s far ahead that never become runnable, is answered 429 alone
    while everyone else's requests still find room. A resend is recognised by its ``(model_id, seq_id)``
    for the last ``remember`` ``seq_id`` s of each model handed out (the SDK resends within seconds)."""

    def __init__(self, capacity: int = 4096, share: int | None = None, remember: int = 4096) -> None:
        self.capacity = capacity
        self.share = share
        self.remember = remember
        self._lock = threading.Lock()
        self._unordered: list[Work] = []
        # model -> seq_id -> waiting item (None: a seq_id refused at the door, to step over)
        self._ordered: dict[str, dict[int, Work | None]] = defaultdict(dict)
        self._next: dict[str, int] = {}  # model -> the seq_id to hand out next
        self._seen: dict[str, dict[int, str]] = defaultdict(dict)  # model -> seq_id -> its request id
        # model -> seq_id -> (status, detail) of a seq_id refused at the door ("" in _seen), for its resends
        self._refused: dict[str, dict[int, tuple[int, Any]]] = defaultdict(dict)
        self._held: dict[str, int] = defaultdict(int)  # source -> its waiting items
        self._waiting = 0
        self.arrived: threading.Event | None = None
        """Set whenever work is put or a gap stepped over (the training loop idles on it)."""
        self._first: float | None = None  # when the first item since the last take came (monotonic)
        self._last = 0.0  # when the latest came

    def __len__(self) -> int:
        with self._lock:
            return self._waiting

    @property
    def per_source(self) -> int:
        """Most waiting items one source may hold."""
        return self.share if self.share is not None else max(1, self.capacity // 4)

    @staticmethod
    def source(work: Work) -> str:
        """Whose share ``work`` counts against: its model's (numbered requests), else its key's."""
        return f"model {work.model_id}" if work.kind in ORDERED else f"key {work.owner}"

    def start_model(self, model_id: str, next_seq_id: int = 1) -> None:
        """A model exists from now on; its ordered requests count from ``next_seq_id``."""
        with self._lock:
            self._next.setdefault(model_id, next_seq_id)

    def next_seq_id(self, model_id: str) -> int | None:
        """The ``seq_id`` of ``model_id`` handed out next (None: the model was never started)."""
        with self._lock:
            return self._next.get(model_id)

    def put(self, work: Work) -> str:
        """Queue ``work``; returns the request id the client waits on: ``work``'s own, or that of the
        request already received with the same ``(model_id, seq_id)``. :class:`InboxFull` when the inbox,
        or the share of ``work``'s source, is full."""
        with self._lock:
            if work.kind in ORDERED:
                seen = self._seen[work.model_id].get(work.seq_id)
                if seen == "":  # refused at the door: a resend gets the same answer
                    status, detail = self._refused[work.model_id].get(work.seq_id, (422, "refused"))
                    raise Refusal(status, detail)
                if seen is not None:
                    return seen
                if work.seq_id < self._next.get(work.model_id, 0):
                    raise SeqIdPassed(f"seq_id {work.seq_id} of model {work.model_id!r} ran long ago")
            self._room_for(self.source(work), 1)
            if work.kind in ORDERED:
                self._seen[work.model_id][work.seq_id] = work.request_id
                self._ordered[work.model_id][work.seq_id] = work
            else:
                self._unordered.append(work)
            self._held_one(work)
        self._arrived()
        return work.request_id

    def put_all(self, works: Sequence[Work]) -> None:
        """Queue the unordered ``works`` of one request (an OpenAI request's prompts, one key's) whole or not
        at all: :class:`NeverFits` when they are more than one source may ever have waiting, so that the
        request is refused for good rather than told to retry; :class:`InboxFull` when they do not fit now."""
        assert not any(w.kind in ORDERED for w in works), "numbered requests come one at a time"
        with self._lock:
            counts: dict[str, int] = defaultdict(int)
            for work in works:
                counts[self.source(work)] += 1
            most = min(self.per_source, self.capacity)
            for n in counts.values():
                if n > most:
                    raise NeverFits(n, most)
            for source, n in counts.items():
                self._room_for(source, n)
            if self._waiting + len(works) > self.capacity:  # (several sources' items together)
                raise InboxFull(f"{self._waiting} requests are waiting, of at most {self.capacity}")
            for work in works:
                self._unordered.append(work)
                self._held_one(work)
        self._arrived()

    def _room_for(self, source: str, n: int) -> None:
        """:class:`InboxFull` unless ``n`` more items of ``source`` fit now (the lock is held)."""
        if self._waiting + n > self.capacity:
            raise InboxFull(f"{self._waiting} requests are waiting, of at most {self.capacity}")
        if self._held.get(source, 0) + n > self.per_source:
            raise InboxFull(f"{self._held[source]} requests of {source} are waiting, its most at once")

    def _held_one(self, work: Work) -> None:
        """``work`` waits from now on (the lock is held)."""
        self._held[self.source(work)] += 1
        self._waiting += 1
        self._last = time.monotonic()
        self._first = self._first or self._last

    def take(self) -> list[Work]:
        """Every item that may run now: unordered ones in arrival order, then per model the consecutive
        run of ``seq_id`` s from the next one expected (a model not started yet hands out nothing)."""
        with self._lock:
            self._first = None
            out, self._unordered = self._unordered, []
            for model, waiting in self._ordered.items():
                if model not in self._next:
                    continue
                seq = self._next[model]
                while seq in waiting:
                    work = waiting.pop(seq)
                    if work is not None:
                        out.append(work)
                    seq += 1
                self._next[model] = seq
                seen = self._seen[model]
                if len(seen) > 2 * self.remember:  # forget resends of seq_ids long handed out
                    for old in [s for s in seen if s < seq - self.remember]:
                        del seen[old]
                        self._refused[model].pop(old, None)
            for work in out:
                self._release(work)
            return out

    def gather_wait(self, quiet_s: float, most_s: float) -> float:
        """How much longer to wait for what was sent together with the items that came since the last
        :meth:`take` (0: take them now): until none has come for ``quiet_s`` seconds, or the first of them
        has waited ``most_s``."""
        with self._lock:
            if self._first is None:
                return 0.0
            return max(0.0, min(self._last + quiet_s, self._first + most_s) - time.monotonic())

    def _release(self, work: Work) -> None:
        source = self.source(work)
        self._held[source] -= 1
        if not self._held[source]:
            del self._held[source]
        self._waiting -= 1

    def skip(self, model_id: str, seq_id: int, refusal: tuple[int, Any] = (422, "refused")) -> None:
        """``seq_id`` of ``model_id`` was refused before it was queued (a 4xx answer, ``refusal``: its status
        and detail): the client counted it anyway, so the model's later requests must not wait for it, and
        a resend of it gets the same answer (:class:`Refusal`). Only a ``seq_id`` the model may still run is
        recorded (from its next one, within ``remember`` of it): one far ahead, or long handed out, would
        never be taken, and a flood of them would grow without bound."""
        with self._lock:
            nxt = self._next.get(model_id)
            ahead = nxt is not None and nxt <= seq_id < nxt + self.remember
            if ahead and seq_id not in self._seen[model_id]:
                self._seen[model_id][seq_id] = ""
                self._refused[model_id][seq_id] = refusal
                self._ordered[model_id][seq_id] = None
        self._arrived()

    def _arrived(self) -> None:
        if self.arrived is not None:
            self.arrived.set()

    def forget_model(self, model_id: str) -> list[Work]:
        """Drop a model's waiting items (it is gone); returns them, so their futures can be failed."""
        with self._lock:
            self._next.pop(model_id, None)
            self._seen.pop(model_id, None)
            self._refused.pop(model_id, None)
            dropped = [w for w in self._ordered.pop(model_id, {}).values() if w is not None]
            for work in dropped:
                self._release(work)
            return dropped


class Futures:
    """Results by request id, and waiting for them from the server's event loop (long-polls).

    :meth:`settle` may be called from any thread; :meth:`wait` runs on the loop given to :meth:`bind`."""

    def __init__(self, keep_s: float = 600.0) -> None:
        self.keep_s = keep_s
        self._lock = threading.Lock()
        self._results: OrderedDict[str, tuple[float, Result]] = OrderedDict()  # oldest settled first
        self._pending: set[str] = set()
        self._waiters: dict[str, list[asyncio.Future]] = defaultdict(list)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def new(self) -> str:
        """A fresh request id, pending until settled."""
        request_id = f"{next(self._ids)}-{secrets.token_hex(8)}"
        with self._lock:
            self._pending.add(request_id)
        return request_id

    def forget(self, request_id: str) -> None:
        """Drop a request id that will never be settled (a resend answered with the first one's)."""
        with self._lock:
            self._pending.discard(request_id)
            self._results.pop(request_id, None)

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending or request_id in self._results

    def settle(self, request_id: str, result: Result) -> None:
        """Record the result and wake whoever waits for it."""
        now = time.time()
        with self._lock:
            self._pending.discard(request_id)
            self._results.pop(request_id, None)
            self._results[request_id] = (now, result)
            while self._results:  # (in settling order: the expired ones are at the front)
                rid, (t, _) = next(iter(self._results.items()))
                if now - t <= self.keep_s:
                    break
                del self._results[rid]
            waiters = self._waiters.pop(request_id, [])
        if waiters and self._loop is not None:
            self._loop.call_soon_threadsafe(_wake, waiters, result)

    def get(self, request_id: str) -> Result | None:
        with self._lock:
            found = self._results.get(request_id)
        return None if found is None else found[1]

    async def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, as soon as it is settled, or ``None`` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        with self._lock:
            found = self._results.get(request_id)
            if found is not None:
                return found[1]
            waiter = loop.create_future()
            self._waiters[request_id].append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            with self._lock:
                if waiter in self._waiters.get(request_id, []):
                    self._waiters[request_id].remove(waiter)
            return self.get(request_id)


def _wake(waiters: Sequence[asyncio.Future], result: Result) -> None:
    for w in waiters:
        if not w.done():
            w.set_result(result)
