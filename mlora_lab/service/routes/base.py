"""What every Tinker route does at the door, before anything is queued: nothing here computes.

A route (:func:`route`) checks the caller's ``X-API-Key`` and turns every refusal into a JSON answer (the SDK
retries a bare 400 as a connection error): :class:`Refused` and the body errors with their status, a full
inbox a 429 with ``retry-after``, a bug in a handler a 500 (logged; the server goes on). A handler reads its
body (:func:`read_body`, :func:`read_json`: past ``max_body_bytes`` a 413, unreadable a 400 naming the
field), checks that the session, model or checkpoint it names is the caller's (:func:`own_session`,
:func:`own_model`, :func:`own_checkpoint`: another key's is unknown, a 404, so ids do not leak), and
queues its :class:`~mlora_lab.service.work.Work` (:func:`queue`). An ordered request refused at the door
still spends its ``seq_id`` (:func:`ordered`): the model's next requests do not wait for it, and sent again
it gets the same answer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.service import reading, wire
from mlora_lab.service.bodies import BodyError, CheckpointPath, ModelInfo
from mlora_lab.service.state import ServiceState, Session
from mlora_lab.service.work import InboxFull, Kind, Refusal, SeqIdPassed, Work

log = logging.getLogger(__name__)

PREFIX = "/api/v1"

Handler = Callable[[Request, ServiceState, str], Awaitable[Response]]
"""A route's handler: ``(request, the service's state, the caller's key name)`` -> its answer."""


class Refused(Exception):
    """An answer other than success: ``status`` and a JSON ``detail``."""

    def __init__(self, status: int, detail: str | list[str]) -> None:
        self.status = status
        self.detail = detail
        super().__init__(detail)


def error(status: int, detail: Any) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def route(
    state: ServiceState, path: str, handler: Handler, methods: tuple[str, ...] = ("POST",), auth: bool = True
) -> Route:
    """``handler`` served at ``PREFIX + path`` over ``state``: the caller's key checked (``auth``), every
    refusal a JSON answer with its status."""

    async def endpoint(request: Request) -> Response:
        try:
            owner = ""
            if auth:
                owner = state.keys.who(request.headers.get("x-api-key")) or ""
                if not owner:
                    return error(401, "a valid X-API-Key header is needed")
            return await handler(request, state, owner)
        except Refused as e:
            return error(e.status, e.detail)
        except BodyError as e:
            return error(e.status, e.problems)
        except wire.WireError as e:
            return error(e.status, e.problems)
        except SeqIdPassed as e:
            return error(422, str(e))
        except Refusal as e:  # (an ordered request refused before, sent again)
            return error(e.status, e.detail)
        except InboxFull as e:
            return JSONResponse(
                {"detail": f"the service is busy ({e}); retry later"},
                status_code=429,
                headers={"retry-after": "1"},
            )
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return error(500, "internal error in the service")

    return Route(PREFIX + path, endpoint, methods=list(methods))


async def http_error(request: Request, exc: Exception) -> Response:
    """What Starlette itself refuses (an unknown path, a wrong method) or a bug past a route: JSON too."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error in the service"
    return error(status, detail)


async def read_body(request: Request, state: ServiceState) -> bytes:
    """The body, refused with 413 past ``max_body_bytes`` (by its Content-Length, and as it is read)."""
    try:
        return await reading.read_body(request, state.max_body_bytes)
    except reading.Unreadable as e:
        raise Refused(e.status, e.message) from None


async def read_json(request: Request, state: ServiceState) -> dict[str, Any]:
    """The JSON object of the body (``{}`` for none): a 400 naming the field when it is not JSON, nested too
    deeply or holds a lone surrogate (:mod:`.reading`, as the OpenAI routes read theirs)."""
    try:
        body = reading.parse_body(await read_body(request, state))
    except reading.Unreadable as e:
        raise Refused(e.status, e.message) from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise Refused(422, ["the body must be a JSON object"])
    return body


def own_session(state: ServiceState, owner: str, session_id: Any) -> Session:
    """The caller's live session ``session_id`` (404 when unknown or another key's, 410 when finished)."""
    with state.lock:
        session = state.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.owner != owner:
            raise Refused(404, f"no session {session_id!r}")
        if session.finished:
            raise Refused(410, f"session {session_id!r} has finished")
        session.last_seen = time.time()
        return session


def own_model(state: ServiceState, owner: str, model_id: Any) -> ModelInfo:
    with state.lock:
        model = state.models.get(model_id) if isinstance(model_id, str) else None
        if model is None or model.owner != owner:
            raise Refused(404, f"no model {model_id!r}")
        session = state.sessions.get(model_id.split(":train:")[0])
        if session is not None:
            if session.finished:
                raise Refused(410, f"the session of model {model_id!r} has finished")
            session.last_seen = time.time()
        return model


def own_checkpoint(state: ServiceState, owner: str, path: CheckpointPath | None) -> CheckpointPath:
    if path is None or not state.owns_run(owner, path.run_id):
        raise Refused(404, f"no checkpoint {str(path) if path else path!r}")
    return path


def refusal_of(e: Exception) -> tuple[int, Any]:
    """The HTTP status and detail a request refused with ``e`` is answered."""
    if isinstance(e, BodyError | wire.WireError):
        return e.status, e.problems
    assert isinstance(e, Refused | Refusal)
    return e.status, e.detail


def skip_refused(
    state: ServiceState, owner: str, model_id: Any, seq_id: Any, refusal: tuple[int, Any]
) -> None:
    """An ordered request of one of ``owner``'s models refused at the door (``refusal``: its answer) still
    spent its ``seq_id`` on the client: the model's next requests must not wait for it, and the request
    sent again gets the same answer."""
    if isinstance(model_id, str) and type(seq_id) is int and seq_id >= 1:
        with state.lock:
            model = state.models.get(model_id)
        if model is not None and model.owner == owner:
            state.inbox.skip(model_id, seq_id, refusal)


@contextlib.contextmanager
def ordered(state: ServiceState, owner: str, model_id: Any, seq_id: Any) -> Iterator[None]:
    """Around everything an ordered request goes through before it is queued: a refusal steps its
    ``seq_id`` over (:func:`skip_refused`)."""
    try:
        yield
    except (BodyError, Refused, wire.WireError) as e:
        skip_refused(state, owner, model_id, seq_id, refusal_of(e))
        raise


def queue(state: ServiceState, work: Work) -> str:
    """Put ``work`` in the inbox; the request id the client waits on (the first one's for a resend). A
    request the inbox refuses (full, a seq_id long passed or refused before) leaves no pending future."""
    try:
        request_id = state.inbox.put(work)
    except BaseException:
        state.futures.forget(work.request_id)
        raise
    if request_id != work.request_id:  # a resend: the client waits on the first one's future
        state.futures.forget(work.request_id)
    with state.lock:
        now = time.time()
        state.future_owners.setdefault(request_id, (work.owner, now))
        while state.future_owners:  # forget, oldest first, the futures the Futures forgot
            rid, (_, t) = next(iter(state.future_owners.items()))
            if now - t <= state.futures.keep_s or state.futures.known(rid):
                break
            del state.future_owners[rid]
    return request_id


def new_work(state: ServiceState, kind: Kind, owner: str, **kw: Any) -> Work:
    return Work(kind, state.futures.new(), owner, **kw)
