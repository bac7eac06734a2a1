"""A client's session and its futures: the routes of the SDK's ``service.py``, ``telemetry.py`` and
``futures.py``.

``healthz`` needs no key. ``create_session`` opens a session (its ``user_metadata`` names the models made in
it), the SDK's heartbeat (every 10 s) and every request naming it keep it alive, ``finish`` ends it (a
finished session's models are paused by the job, :mod:`mlora_lab.job.drivers.tinker.sessions`).
``retrieve_future`` holds a request up to ``poll_s`` (40 s) and then answers ``try_again`` as a 408, which
the SDK polls again without a word; a future is the key's that queued it (another key's is unknown).
"""

from __future__ import annotations

import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.service.bodies import Fields, read_user_metadata
from mlora_lab.service.routes.base import Refused, own_session, read_body, read_json, route
from mlora_lab.service.state import ServiceState, Session


def routes(state: ServiceState) -> list[Route]:
    """The session and future routes over ``state``."""
    return [
        route(state, "/healthz", healthz, ("GET",), auth=False),
        route(state, "/client/config", client_config),
        route(state, "/client/dynamic_config", dynamic_config),
        route(state, "/create_session", create_session),
        route(state, "/session_heartbeat", session_heartbeat),
        route(state, "/sessions/{session_id}/finish", finish_session),
        route(state, "/telemetry", telemetry),
        route(state, "/get_server_capabilities", capabilities, ("GET",)),
        route(state, "/retrieve_future", retrieve_future),
    ]


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
