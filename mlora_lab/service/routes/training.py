"""Training clients: their models (the SDK's ``models.py``: ``create_model``, ``get_info``) and their steps
(``training.py``: ``forward_backward``, ``optim_step``).

A model is made by the job at a step boundary (its tenant in a free slot); a resend of ``create_model``
waits on the first one's future. ``forward_backward`` comes as protobuf (:mod:`mlora_lab.service.wire`,
its tensors checked against the job's vocabulary and context before anything is queued; never compressed),
``optim_step`` as JSON; both are ordered by the model's ``seq_id``, and one refused at the door spends it
(:func:`~mlora_lab.service.routes.base.ordered`).
"""

from __future__ import annotations

from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.service import wire
from mlora_lab.service.bodies import Fields, read_adam, read_create_model
from mlora_lab.service.routes.base import (
    Refused,
    new_work,
    ordered,
    own_model,
    own_session,
    queue,
    read_body,
    read_json,
    refusal_of,
    route,
    skip_refused,
)
from mlora_lab.service.state import ServiceState
from mlora_lab.service.work import Kind


def routes(state: ServiceState) -> list[Route]:
    """The model and training routes over ``state``."""
    return [
        route(state, "/create_model", create_model),
        route(state, "/get_info", get_info),
        route(state, "/forward_backward", forward_backward),
        route(state, "/optim_step", optim_step),
    ]


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
