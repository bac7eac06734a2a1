"""The REST client's reads: training runs (the caller's models) and their checkpoints, from the service
folder (``<run_dir>/service/``, :mod:`mlora_lab.rundir.service`), and a checkpoint's LoRA settings
(``weights_info``).

Listings page by ``limit`` (1 to 1,000; default 20) and ``offset``; only the caller's models and
checkpoints are listed. Checkpoints are folders of the run directory, removed with the run: this server
deletes none (a 422 that says so).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlora_lab.rundir import service as files
from mlora_lab.service.bodies import Fields, ModelInfo, parse_checkpoint_path
from mlora_lab.service.routes.base import Refused, own_checkpoint, own_model, read_json, route
from mlora_lab.service.state import ServiceState


def routes(state: ServiceState) -> list[Route]:
    """The REST routes over ``state``."""
    return [
        route(state, "/training_runs", list_training_runs, ("GET",)),
        route(state, "/training_runs/{run_id}", get_training_run, ("GET",)),
        route(state, "/training_runs/{run_id}/checkpoints", list_checkpoints, ("GET",)),
        route(
            state, "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", delete_checkpoint, ("DELETE",)
        ),
        route(state, "/checkpoints", list_user_checkpoints, ("GET",)),
        route(state, "/weights_info", weights_info),
    ]


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
