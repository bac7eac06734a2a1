"""Saved weights: the routes of the SDK's ``weights.py`` (``save_weights``, ``save_weights_for_sampler``,
``load_weights``).

Each is run by the job at its place in the model's ``seq_id`` order
(:mod:`mlora_lab.job.drivers.tinker.saved_states`, :mod:`mlora_lab.job.drivers.tinker.snapshots`). A
checkpoint name that is not a name (``.``, ``..``, a separator: never a path) or a path that is not a
checkpoint's is refused here, and a path must be one of the caller's runs'. ``save_weights_for_sampler``
with a ``sampling_session_seq_id`` opens that sampling session on the snapshot;
``load_weights`` without a ``model_id`` is ``create_training_client_from_state``: a new model whose first
request (``seq_id`` 0) is the load.
"""

from __future__ import annotations

from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.service.bodies import Fields, Load, parse_checkpoint_path, read_save, read_user_metadata
from mlora_lab.service.routes.base import (
    Refused,
    new_work,
    ordered,
    own_checkpoint,
    own_model,
    own_session,
    queue,
    read_json,
    route,
)
from mlora_lab.service.state import SamplingSession, ServiceState
from mlora_lab.service.work import Kind


def routes(state: ServiceState) -> list[Route]:
    """The save and load routes over ``state``."""
    return [
        route(state, "/save_weights", save_weights),
        route(state, "/save_weights_for_sampler", save_weights_for_sampler),
        route(state, "/load_weights", load_weights),
    ]


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
