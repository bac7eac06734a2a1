"""The HTTP side of the service: Starlette routes that check a request, queue it and answer futures.

Nothing here computes. Each route checks its request (the caller's API key, the body's size and fields,
that the session, model, sampling session or checkpoint is the caller's), turns it into a
:class:`~.work.Work` item in the :class:`~.work.Inbox` and answers ``{"request_id"}`` at once; the training
loop settles the future in :class:`~.work.Futures` and the client long-polls ``retrieve_future`` for it.
The routes and their bodies are those of the ``tinker`` SDK 0.38.0: the paths its
``tinker/resources/`` modules call (``service.py``, ``training.py``, ``sampling.py``, ``weights.py``,
``futures.py``, ``models.py``) and the request and response types of ``tinker/types/``.

Errors always carry a JSON body (the SDK retries a bare 400 as a connection error):
401 no or a wrong ``X-API-Key``; 404 an id that is unknown *or another key's* (so ids do not leak);
400 unreadable JSON or protobuf (JSON nested too deeply or holding a lone surrogate: naming the field,
:mod:`.reading`), a checkpoint name that is not a name (``.``, ``..``, a separator: never a path) or a path
that is not a checkpoint's, a tensor shape past what the job holds; 422 fields that are wrong
(``{"detail": ...}`` names every problem); 410 a finished session; 413 a body over ``max_body_bytes``, or
tensors that would decode past it; 429 the inbox is full (never 402: the SDK pauses for an hour on it);
500 a bug in a handler (the server goes on). An ordered request refused at the door spends its ``seq_id``
(the model's next requests do not wait for it), and sent again it gets the same answer.
``retrieve_future`` holds a request up to ``poll_s`` (40 s) and then answers ``try_again`` as a 408, which
the SDK polls again without a word.

:class:`Server` runs the app under uvicorn on a daemon thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.rundir import service as files
from mlora_lab.service import reading, wire
from mlora_lab.service.bodies import (
    BodyError,
    CheckpointPath,
    Fields,
    Load,
    ModelInfo,
    parse_checkpoint_path,
    read_adam,
    read_create_model,
    read_sample,
    read_save,
    read_user_metadata,
)
from mlora_lab.service.openai_api import openai_routes
from mlora_lab.service.state import MAX_SAMPLING_SESSIONS, SamplingSession, ServiceState, Session
from mlora_lab.service.work import InboxFull, Kind, Refusal, SeqIdPassed, Work

log = logging.getLogger(__name__)

PREFIX = "/api/v1"


class Refused(Exception):
    """An answer other than success: ``status`` and a JSON ``detail``."""

    def __init__(self, status: int, detail: str | list[str]) -> None:
        self.status = status
        self.detail = detail
        super().__init__(detail)


def error(status: int, detail: Any) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


Handler = Callable[[Request, ServiceState, str], Awaitable[Response]]


def create_app(state: ServiceState) -> Starlette:
    """The Starlette app serving ``state``."""

    def route(path: str, handler: Handler, methods: tuple[str, ...] = ("POST",), auth: bool = True) -> Route:
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
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error in the service"
        return error(status, detail)

    routes = [
        route("/healthz", healthz, ("GET",), auth=False),
        route("/client/config", client_config),
        route("/client/dynamic_config", dynamic_config),
        route("/create_session", create_session),
        route("/session_heartbeat", session_heartbeat),
        route("/sessions/{session_id}/finish", finish_session),
        route("/telemetry", telemetry),
        route("/get_server_capabilities", capabilities, ("GET",)),
        route("/create_model", create_model),
        route("/get_info", get_info),
        route("/forward_backward", forward_backward),
        route("/optim_step", optim_step),
        route("/save_weights", save_weights),
        route("/save_weights_for_sampler", save_weights_for_sampler),
        route("/load_weights", load_weights),
        route("/create_sampling_session", create_sampling_session),
        route("/samplers/{sampler_id}", get_sampler, ("GET",)),
        route("/training_runs", list_training_runs, ("GET",)),
        route("/training_runs/{run_id}", get_training_run, ("GET",)),
        route("/training_runs/{run_id}/checkpoints", list_checkpoints, ("GET",)),
        route("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", delete_checkpoint, ("DELETE",)),
        route("/checkpoints", list_user_checkpoints, ("GET",)),
        route("/weights_info", weights_info),
        route("/asample", asample),
        route("/retrieve_future", retrieve_future),
        *openai_routes(
            state
        ),  # (the OpenAI-compatible side: /v1/models, /v1/completions, /v1/chat/completions)
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: http_error})


# ---------------------------------------------------------------------------------------------- reading


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


# ---------------------------------------------------------------------------------------------- routes


async def healthz(request: Request, state: ServiceState, owner: str) -> Response:
    return JSONResponse({"status": "ok"})


async def client_config(request: Request, state: ServiceState, owner: str) -> Response:
    await read_body(request, state)
    return JSONResponse(state.client_config)


async def dynamic_config(request: Request, state: ServiceState, owner: str) -> Response:
    await read_body(request, state)
    return JSONResponse({})


async def telemetry(request: Request, state: ServiceState, owner: str) -> Response:
    await read_body(request, state)
    return JSONResponse({"status": "accepted"})


async def capabilities(request: Request, state: ServiceState, owner: str) -> Response:
    model = {
        "model_name": state.base_model,
        "max_context_length": state.limits.max_tokens,
        "trainable": True,
        "sampleable": True,
    }
    return JSONResponse({"supported_models": [model]})


async def create_session(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    tags = f.body.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        f.problems.append("tags must be a list of strings")
    meta = read_user_metadata(f)
    f.raise_if_any()
    session_id = secrets.token_hex(8)
    with state.lock:
        state.sessions[session_id] = Session(owner, user_metadata=meta)
    return JSONResponse({"session_id": session_id})


async def session_heartbeat(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    session_id = f.str("session_id")
    f.raise_if_any()
    with state.lock:
        session = state.sessions.get(session_id)  # type: ignore[arg-type]
        if session is None or session.owner != owner or session.finished:
            raise Refused(410, f"session {session_id!r} is unknown or finished")
        session.last_seen = time.time()
    return JSONResponse({"type": "session_heartbeat"})


async def finish_session(request: Request, state: ServiceState, owner: str) -> Response:
    await read_body(request, state)
    session = own_session(state, owner, request.path_params["session_id"])
    with state.lock:
        session.finished = True
    return Response(status_code=204)


async def create_model(request: Request, state: ServiceState, owner: str) -> Response:
    body = await read_json(request, state)
    session_id, _, info = read_create_model(
        body, owner=owner, base_model=state.base_model, max_rank=state.max_rank
    )
    session = own_session(state, owner, session_id)
    if info.name is None and session.user_metadata.get("name"):  # (the session's name, else the model's)
        info = replace(info, name=session.user_metadata["name"])
    with state.lock:
        if info.model_id in state.creating:
            return JSONResponse({"request_id": state.creating[info.model_id], "model_id": info.model_id})
        work = new_work(state, Kind.CREATE_MODEL, owner, model_id=info.model_id, body=info)
        request_id = queue(state, work)
        state.creating[info.model_id] = request_id
        session.model_ids.append(info.model_id)
    return JSONResponse({"request_id": request_id, "model_id": info.model_id})


async def get_info(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    model_id = f.str("model_id")
    f.raise_if_any()
    model = own_model(state, owner, model_id)
    data = {
        "arch": "lora",
        "model_name": model.base_model,
        "tokenizer_id": state.tokenizer_id or model.base_model,
    }
    return JSONResponse(
        {
            "type": "get_info",
            "model_data": data,
            "model_id": model.model_id,
            "optimizer_config": {"type": "adamw"},
            "is_lora": True,
            "lora_rank": model.rank,
            "model_name": model.base_model,
        }
    )


async def forward_backward(request: Request, state: ServiceState, owner: str) -> Response:
    if "zstd" in request.headers.get("content-encoding", ""):
        raise Refused(
            400, "compressed forward_backward bodies are not accepted (proto_compress_fwdbwd is off)"
        )
    try:
        fb = wire.read_forward_backward(await read_body(request, state), state.limits)
    except wire.WireError as e:
        skip_refused(state, owner, e.model_id, e.seq_id, refusal_of(e))
        raise
    with ordered(state, owner, fb.model_id, fb.seq_id):
        own_model(state, owner, fb.model_id)
    work = new_work(state, Kind.FORWARD_BACKWARD, owner, model_id=fb.model_id, seq_id=fb.seq_id, body=fb)
    return JSONResponse({"request_id": queue(state, work), "model_id": fb.model_id})


async def optim_step(request: Request, state: ServiceState, owner: str) -> Response:
    body = await read_json(request, state)
    with ordered(state, owner, body.get("model_id"), body.get("seq_id")):
        model_id, seq_id, step = read_adam(body)
        own_model(state, owner, model_id)
    work = new_work(state, Kind.OPTIM_STEP, owner, model_id=model_id, seq_id=seq_id, body=step)
    return JSONResponse({"request_id": queue(state, work), "model_id": model_id})


async def save_weights(request: Request, state: ServiceState, owner: str) -> Response:
    body = await read_json(request, state)
    with ordered(state, owner, body.get("model_id"), body.get("seq_id")):
        model_id, seq_id, save, _ = read_save(body, "state")
        own_model(state, owner, model_id)
    work = new_work(state, Kind.SAVE_WEIGHTS, owner, model_id=model_id, seq_id=seq_id, body=save)
    return JSONResponse({"request_id": queue(state, work), "model_id": model_id})


async def save_weights_for_sampler(request: Request, state: ServiceState, owner: str) -> Response:
    body = await read_json(request, state)
    with ordered(state, owner, body.get("model_id"), body.get("seq_id")):
        model_id, seq_id, save, sampling_seq = read_save(body, "sampler")
        model = own_model(state, owner, model_id)
        if sampling_seq is not None:
            sampling_id = f"{model_id.split(':train:')[0]}:sample:{sampling_seq}"
            save = replace(save, name=None, sampling_session_id=sampling_id)
            with state.lock:
                known = state.sampling_sessions.get(sampling_id)
                if known is not None and known.model_id != model_id:
                    raise Refused(422, [f"sampling_session_seq_id {sampling_seq} is taken in this session"])
                state.add_sampling_session(
                    sampling_id, SamplingSession(owner, model.base_model, model_id=model_id)
                )
    work = new_work(state, Kind.SAVE_FOR_SAMPLER, owner, model_id=model_id, seq_id=seq_id, body=save)
    return JSONResponse({"request_id": queue(state, work), "model_id": model_id})


async def load_weights(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    path = parse_checkpoint_path(f.body.get("path"), "path", f)
    if path is not None and path.kind != "weights":
        f.problems.append(f"path {str(path)!r} is a sampler snapshot; load a state (tinker://…/weights/…)")
    optimizer = f.bool("optimizer", False)
    if "model_id" in f.body:  # load_state into an existing model, in its seq_id order
        with ordered(state, owner, f.body.get("model_id"), f.body.get("seq_id")):
            model_id, seq_id = f.str("model_id"), f.int("seq_id", 1, 2**31 - 1)
            f.raise_if_any()
            own_model(state, owner, model_id)
            own_checkpoint(state, owner, path)
        load = Load(str(path), bool(optimizer), create=False, owner=owner)
        work = new_work(state, Kind.LOAD_WEIGHTS, owner, model_id=model_id, seq_id=seq_id, body=load)
        return JSONResponse({"request_id": queue(state, work), "model_id": model_id})
    # create_training_client_from_state: a new model whose first request (seq_id 0) is this load
    session_id, model_seq_id = f.str("session_id"), f.int("model_seq_id", 0, 2**31 - 1)
    asked = f.body.get("base_model")
    if asked is not None and asked != state.base_model:
        f.problems.append(
            f"base_model {asked!r} is not served here; this service trains {state.base_model!r}"
        )
    meta = read_user_metadata(f)
    f.raise_if_any()
    session = own_session(state, owner, session_id)
    own_checkpoint(state, owner, path)
    name = meta.get("name") or session.user_metadata.get("name")
    model_id = f"{session_id}:train:{model_seq_id}"
    with state.lock:
        if model_id in state.creating:  # a resend: the same future
            return JSONResponse({"request_id": state.creating[model_id], "model_id": model_id})
        if model_id in state.models:
            raise Refused(422, [f"model {model_id!r} exists already (model_seq_id {model_seq_id} is taken)"])
        state.inbox.start_model(model_id, 0)
        work = new_work(
            state,
            Kind.LOAD_WEIGHTS,
            owner,
            model_id=model_id,
            seq_id=0,
            body=Load(str(path), bool(optimizer), create=True, owner=owner, name=name),
        )
        request_id = queue(state, work)
        state.creating[model_id] = request_id
        session.model_ids.append(model_id)
    return JSONResponse({"request_id": request_id, "model_id": model_id})


async def create_sampling_session(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    session_id = f.str("session_id")
    seq = f.int("sampling_session_seq_id", 0, 2**31 - 1)
    model_path = None
    if f.body.get("model_path") is not None:
        model_path = parse_checkpoint_path(f.body["model_path"], "model_path", f)
    asked = f.body.get("base_model")
    if asked is not None and asked != state.base_model:
        f.problems.append(
            f"base_model {asked!r} is not served here; this service samples {state.base_model!r}"
        )
    f.raise_if_any()
    own_session(state, owner, session_id)
    if model_path is not None:
        own_checkpoint(state, owner, model_path)
    sampling_id = f"{session_id}:sample:{seq}"
    with state.lock:
        known = state.sampling_sessions.get(sampling_id)
        path = str(model_path) if model_path else None
        if known is not None and known.model_path != path:
            raise Refused(422, [f"sampling_session_seq_id {seq} is taken in this session"])
        state.add_sampling_session(sampling_id, SamplingSession(owner, state.base_model, model_path=path))
    return JSONResponse({"sampling_session_id": sampling_id})


async def get_sampler(request: Request, state: ServiceState, owner: str) -> Response:
    sampler_id = request.path_params["sampler_id"]
    with state.lock:
        s = state.sampling_sessions.get(sampler_id)
        if s is None or s.owner != owner:
            raise Refused(404, f"no sampler {sampler_id!r}")
        answer = {"sampler_id": sampler_id, "base_model": s.base_model}
        if s.model_path:
            answer["model_path"] = s.model_path
    return JSONResponse(answer)


# -- REST reads: training runs (the models) and their checkpoints, from the service folder --------------


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _checkpoint(c: files.Saved) -> dict[str, Any]:
    """A saved checkpoint as the SDK's ``Checkpoint``."""
    kind = "training" if c.kind == "weights" else "sampler"
    return {
        "checkpoint_id": f"{c.kind}/{c.name}",
        "checkpoint_type": kind,
        "time": _when(c.time),
        "tinker_path": c.tinker_path,
        "size_bytes": c.size_bytes,
        "public": False,
    }


def _saved(state: ServiceState, model_id: str) -> list[files.Saved]:
    return [] if state.checkpoints is None else files.saved_of(state.checkpoints, model_id)


def _training_run(state: ServiceState, model: ModelInfo) -> dict[str, Any]:
    """A model as the SDK's ``TrainingRun`` (its last request: its session's last sign of life)."""
    saved = _saved(state, model.model_id)
    with state.lock:
        session = state.sessions.get(model.model_id.split(":train:")[0])
        seen = session.last_seen if session is not None and session.last_seen else time.time()
    last = {kind: next((c for c in reversed(saved) if c.kind == kind), None) for kind in files.SAVED_KINDS}
    return {
        "training_run_id": model.model_id,
        "base_model": model.base_model,
        "model_owner": model.owner,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": model.rank,
        "last_request_time": _when(seen),
        "last_checkpoint": _checkpoint(last["weights"]) if last["weights"] else None,
        "last_sampler_checkpoint": _checkpoint(last["sampler_weights"]) if last["sampler_weights"] else None,
    }


def _page(request: Request) -> tuple[int, int]:
    """``limit`` (1 to 1,000; default 20) and ``offset`` (default 0) of a listing's query string."""
    problems, out = [], []
    for key, lo, hi, default in (("limit", 1, 1000, 20), ("offset", 0, 2**31 - 1, 0)):
        text = request.query_params.get(key)
        value = (
            int(text) if text is not None and text.isascii() and text.isdigit() and len(text) < 12 else None
        )
        if text is not None and (value is None or not lo <= value <= hi):
            problems.append(f"{key} must be an integer in [{lo}, {hi}]")
        out.append(default if value is None or problems else value)
    if problems:
        raise Refused(422, problems)
    return out[0], out[1]


def _owned_models(state: ServiceState, owner: str) -> list[ModelInfo]:
    with state.lock:
        return sorted((m for m in state.models.values() if m.owner == owner), key=lambda m: m.model_id)


async def list_training_runs(request: Request, state: ServiceState, owner: str) -> Response:
    limit, offset = _page(request)
    models = _owned_models(state, owner)
    runs = [_training_run(state, m) for m in models[offset : offset + limit]]
    return JSONResponse(
        {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}
    )


async def get_training_run(request: Request, state: ServiceState, owner: str) -> Response:
    return JSONResponse(_training_run(state, own_model(state, owner, request.path_params["run_id"])))


async def list_checkpoints(request: Request, state: ServiceState, owner: str) -> Response:
    model = own_model(state, owner, request.path_params["run_id"])
    return JSONResponse({"checkpoints": [_checkpoint(c) for c in _saved(state, model.model_id)]})


async def list_user_checkpoints(request: Request, state: ServiceState, owner: str) -> Response:
    limit, offset = _page(request)
    saved = sorted(
        (c for m in _owned_models(state, owner) for c in _saved(state, m.model_id)), key=lambda c: -c.time
    )
    return JSONResponse(
        {
            "checkpoints": [_checkpoint(c) for c in saved[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(saved)},
        }
    )


async def delete_checkpoint(request: Request, state: ServiceState, owner: str) -> Response:
    own_model(state, owner, request.path_params["run_id"])
    raise Refused(
        422,
        "this server does not delete checkpoints; they are folders of the run directory "
        "(<run_dir>/service/), removed with the run",
    )


async def weights_info(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    path = parse_checkpoint_path(f.body.get("tinker_path"), "tinker_path", f)
    f.raise_if_any()
    own_checkpoint(state, owner, path)
    lora = None if state.checkpoints is None else files.saved_lora(state.checkpoints, str(path))
    if lora is None:
        raise Refused(404, f"no checkpoint {str(path)!r} on this server")
    answer = {"base_model": state.base_model, "is_lora": True, "lora_rank": lora.get("rank")}
    for k in ("train_attn", "train_mlp", "train_unembed"):
        if k in lora:
            answer[k] = lora[k]
    return JSONResponse(answer)


async def asample(request: Request, state: ServiceState, owner: str) -> Response:
    f, sample = read_sample(
        await read_json(request, state),
        vocab_size=state.limits.vocab_size,
        max_context=state.limits.max_tokens,
    )
    sampling_id = f.body.get("sampling_session_id")
    model_path = f.body.get("model_path")
    if sampling_id is not None:
        with state.lock:
            s = state.sampling_sessions.get(sampling_id) if isinstance(sampling_id, str) else None
            if s is None or s.owner != owner:
                raise Refused(
                    404,
                    f"no sampling session {sampling_id!r} (a session keeps its {MAX_SAMPLING_SESSIONS} most "
                    "recently used; one that made no model is forgotten once it has ended or timed out)",
                )
            model_path = s.model_path
            sampling_model = s.model_id
        state.used_sampling_session(sampling_id)
        session = state.sessions.get(sampling_id.split(":sample:")[0])
        if session is not None:
            session.last_seen = time.time()
    else:
        sampling_model = None
        if model_path is not None:
            path = parse_checkpoint_path(model_path, "model_path", f)
            f.raise_if_any()
            own_checkpoint(state, owner, path)
        elif f.body.get("base_model") != state.base_model:
            raise Refused(422, [f"name sampling_session_id, model_path or base_model {state.base_model!r}"])
    work = new_work(state, Kind.SAMPLE, owner, model_id=sampling_model)
    ids = [f"{work.request_id}:{i}" for i in range(sample.num_samples)]
    work.body = replace(sample, sampling_session_id=sampling_id, model_path=model_path, sequence_ids=ids)
    return JSONResponse({"request_id": queue(state, work), "sample_sequence_ids": ids})


async def retrieve_future(request: Request, state: ServiceState, owner: str) -> Response:
    f = Fields(await read_json(request, state))
    request_id = f.str("request_id")
    f.raise_if_any()
    with state.lock:
        known = state.future_owners.get(request_id)  # type: ignore[arg-type]
    if known is None or known[0] != owner or not state.futures.known(request_id):  # type: ignore[arg-type]
        raise Refused(404, f"no future {request_id!r}")
    result = await state.futures.wait(request_id, state.poll_s)  # type: ignore[arg-type]
    if result is None:  # (408: the SDK polls again quietly; a 200 "try_again" prints a warning each time)
        return JSONResponse(
            {"type": "try_again", "request_id": request_id, "queue_state": "active"}, status_code=408
        )
    if result.error is not None:
        return JSONResponse({"error": result.error, "category": str(result.category)})
    if result.proto is not None:
        return Response(result.proto, media_type="application/x-protobuf")
    return JSONResponse(result.json or {})


# ---------------------------------------------------------------------------------------------- server


def reachable(host: str) -> str:
    """The address clients reach a server listening on ``host`` at: this machine's name for a wildcard
    (``0.0.0.0``, ``::``: every interface; a job on a Slurm node is reached from the login node by name),
    an IPv6 address in brackets."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


class Server:
    """uvicorn serving ``state`` on a daemon thread with its own event loop (``futures`` bound to it).

    ``Server(state).start()`` returns once it accepts connections; ``.url`` is then its base URL."""

    def __init__(self, state: ServiceState, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.host = host
        self.port = port
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def start(self, timeout: float = 30.0) -> Server:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on a socket that says it is TCP. Without it
        # uvicorn's response (headers, then body: two writes) waited for the client's delayed ACK, 40 ms a
        # request; the flag is also set here, inherited by every accepted connection
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.state),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=75,
        )
        self._server = uvicorn.Server(config)

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.state.futures.bind(loop)
            try:
                loop.run_until_complete(self._server.serve(sockets=[sock]))  # type: ignore[union-attr]
            except BaseException as e:  # reported by start() when it happens before startup
                self._failed = e
                log.exception("the service's HTTP server stopped")
            finally:
                sock.close()
                loop.close()

        self._thread = threading.Thread(target=run, name="mlora-service-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._failed is not None or not self._thread.is_alive():
                raise RuntimeError(f"the service's HTTP server did not start: {self._failed}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service's HTTP server did not start in {timeout} s")
            time.sleep(0.01)
        self.url = f"http://{reachable(self.host)}:{self.port}"
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
