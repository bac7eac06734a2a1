"""Sampling: the routes of the SDK's sampling clients (``create_sampling_session``, ``samplers/{id}`` and
``asample``).

A sampling session samples the base or a sampler snapshot (a ``tinker://`` path of the caller's); a
session keeps its :data:`~mlora_lab.service.state.MAX_SAMPLING_SESSIONS` most recently used. ``asample``
names a sampling session, a ``model_path`` or the base; the job takes every waiting sample at a step
boundary into one batched generation (:mod:`mlora_lab.job.drivers.tinker.snapshots`).
"""

from __future__ import annotations

import time
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.service.bodies import Fields, parse_checkpoint_path, read_sample
from mlora_lab.service.routes.base import (
    Refused,
    new_work,
    own_checkpoint,
    own_session,
    queue,
    read_json,
    route,
)
from mlora_lab.service.state import MAX_SAMPLING_SESSIONS, SamplingSession, ServiceState
from mlora_lab.service.work import Kind


def routes(state: ServiceState) -> list[Route]:
    """The sampling routes over ``state``."""
    return [
        route(state, "/create_sampling_session", create_sampling_session),
        route(state, "/samplers/{sampler_id}", get_sampler, ("GET",)),
        route(state, "/asample", asample),
    ]


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
