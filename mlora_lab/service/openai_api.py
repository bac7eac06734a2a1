"""The OpenAI-compatible side of a served job: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``, so every evaluation harness and agent framework that talks to models through the
OpenAI API (the ``openai`` client, lm-eval's ``local-completions``, inspect-ai, verifiers) reaches the base,
every tenant and every named sampler snapshot of a running job.

Models: ``base`` (also the name the service gives the base, ``Service.model_name``; no tenant may take either
name: :func:`~mlora_lab.rundir.service.reserved_model_names`), each tenant holding a
slot by its name (sampled with its *current* adapter, while it trains), and the named sampler snapshots
(``tinker://<run>/sampler_weights/<name>``, those the caller's key saved). A request becomes the same
:class:`~.work.Work` a Tinker ``asample`` does: the training loop takes every waiting sample at once, so
requests from many callers share one batched generation with the job's own sampling, each row with its own
adapter. The answer waits for it (no polling): an OpenAI client simply waits on its HTTP request.

The request and response bodies are OpenAI's (``openai`` 3.x's ``Completion`` and ``ChatCompletion``): ``n``,
``temperature`` (below 1e-5 greedy, as the Tinker route samples), ``top_p``, ``max_tokens``
(``max_completion_tokens``), ``stop`` (up to 4 strings, cut from the text as OpenAI does), ``seed``,
``logprobs`` / ``top_logprobs`` (and ``echo`` with the prompt's logprobs for completions, what lm-eval's
log-likelihood requests use; ``echo`` with ``max_tokens: 0`` scores the prompt alone), and ``stream``
(server-sent events; the completion is generated in one batch, so its text comes as one chunk per choice, then
``[DONE]``). Bodies are read as the Tinker routes read theirs (:mod:`.reading`). Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: 401 a missing or wrong key (``Authorization: Bearer`` or
``X-API-Key``), 404 an unknown model (named), 400 a bad field (named: JSON nested too deeply and a lone
surrogate too), 413 a body over ``max_body_bytes`` or more prompts than a key may have waiting at once (its
share of the queue, named), 429 a full queue.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlora_lab.rundir.service import BASE_MODEL_NAME, reserved_model_names
from mlora_lab.service import reading
from mlora_lab.service.bodies import (
    Fields,
    Sample,
    floored_temperature,
    parse_checkpoint_path,
    prompt_room_problem,
)
from mlora_lab.service.state import ServiceState
from mlora_lab.service.work import InboxFull, Kind, NeverFits, Result, Work

OPENAI_PREFIX = "/v1"
MAX_N = 128
"""Completions one request may ask for (its prompts times ``n``)."""
MAX_PROMPTS = 64
"""Prompts one ``/v1/completions`` request may hold (each is one request of the job's queue)."""
MAX_STOP = 4
WAIT_S = 3600.0
"""The longest a request waits for its generation (a job busy with long steps answers later, not never)."""


class OpenAIError(Exception):
    """An OpenAI-shaped refusal."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def openai_routes(state: ServiceState) -> list[Route]:
    """The OpenAI-compatible routes over ``state``."""

    def route(path: str, handler: Any, methods: tuple[str, ...]) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                owner = state.keys.who(_key(request))
                if not owner:
                    raise OpenAIError(
                        401, "a valid API key is needed (Authorization: Bearer <key>)", code="invalid_api_key"
                    )
                return await handler(request, state, owner)
            except OpenAIError as e:
                return e.response()
            except InboxFull as e:
                return OpenAIError(
                    429, f"the service is busy ({e}); retry later", code="rate_limit_exceeded"
                ).response()

        return Route(OPENAI_PREFIX + path, endpoint, methods=list(methods))

    return [
        route("/models", list_models, ("GET",)),
        route("/completions", completions, ("POST",)),
        route("/chat/completions", chat_completions, ("POST",)),
    ]


def _key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def model_ids(state: ServiceState, owner: str) -> list[str]:
    """The models ``owner``'s key may sample: the base, the tenants (a Tinker client's only for its own key),
    and the named sampler snapshots its key saved."""
    reserved = reserved_model_names(state.base_model)  # (no tenant takes one: never listed as a tenant)
    with state.lock:
        others = {info.name for info in state.models.values() if info.owner != owner and info.name}
        tenants = [n for n in state.tenant_names if n not in others and n not in reserved]
        snaps = list(state.snapshot_paths)
    owned = []
    for path in snaps:
        parsed = parse_checkpoint_path(path, "model", Fields({}))
        if parsed is not None and state.owns_run(owner, parsed.run_id):
            owned.append(path)
    return [BASE_MODEL_NAME, *tenants, *owned]


async def list_models(request: Request, state: ServiceState, owner: str) -> Response:
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "mlora_lab"}
        for m in model_ids(state, owner)
    ]
    return JSONResponse({"object": "list", "data": data})


# -- reading a request -------------------------------------------------------------------------------------


async def _body(request: Request, state: ServiceState) -> dict[str, Any]:
    """The JSON body, read as the Tinker routes read theirs (:mod:`.reading`: refused past ``max_body_bytes``
    as it is read; JSON nested too deeply, or with a lone surrogate, is a 400 naming the field)."""
    try:
        body = reading.parse_body(await reading.read_body(request, state.max_body_bytes))
    except reading.Unreadable as e:
        raise OpenAIError(e.status, e.message, e.field) from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    return body


def _number(body: dict, name: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise OpenAIError(
            400, f"{name} must be {kind} in [{lo:g}, {hi:g}], got {json.dumps(value)[:60]}", name
        )
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP
    ):
        raise OpenAIError(
            400, f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", "stop"
        )
    return stops


def _unsupported(body: dict) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise OpenAIError(400, f"{name} is not supported by this server (leave it 0)", name)
    if body.get("logit_bias"):
        raise OpenAIError(400, "logit_bias is not supported by this server", "logit_bias")


def _target(state: ServiceState, owner: str, model: Any) -> dict[str, Any]:
    """The :class:`Sample` fields that aim a request at ``model`` (404 naming it when it is none of them)."""
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required: 'base', a tenant's name or a sampler snapshot", "model")
    if model in reserved_model_names(state.base_model):
        return {}
    known = model_ids(state, owner)
    if model not in known:
        raise OpenAIError(
            404, f"The model {model!r} does not exist on this server (models: {', '.join(known)})", "model",
            "model_not_found",
        )  # fmt: skip
    if model.startswith("tinker://"):
        return {"model_path": model}
    return {"tenant": model}


def _encode(state: ServiceState, prompt: Any, param: str) -> list[int]:
    tok = state.tokenizer
    if isinstance(prompt, str):
        return list(tok(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        vocab = state.limits.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"{param}: token id {bad[0]} is outside the vocabulary of {vocab}", param)
        return list(prompt)
    raise OpenAIError(400, f"{param} must be a string, a list of strings, or token ids", param)


def _scores_only(body: dict) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt scored (its logprobs), nothing sampled (what a harness sends
    to score a text, and OpenAI's completions accept)."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    return "prompt" in body and type(asked) is int and asked == 0 and body.get("echo") is True


def _sample(state: ServiceState, body: dict, prompt: list[int], target: dict, **kw: Any) -> Sample:
    """The :class:`Sample` a request's ``prompt`` asks for. Only scored (:func:`_scores_only`), it samples one
    greedy token, which the answer leaves out, with the prompt's logprobs."""
    scores_only = _scores_only(body)
    no_room = prompt_room_problem(len(prompt), state.limits.max_tokens, sampled=not scores_only)
    if no_room is not None:
        raise OpenAIError(400, no_room, "messages" if "messages" in body else "prompt")
    room = state.limits.max_tokens - len(prompt)
    default = kw.pop("default_max", min(room, 16))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(name) == 0 and not scores_only and "prompt" in body:
        raise OpenAIError(400, f"{name} 0 samples nothing: it needs echo: true (the prompt's logprobs)", name)
    max_tokens = 1 if scores_only else _number(body, name, default, 1, room, integer=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError(400, "seed must be an integer", "seed")
    temperature = floored_temperature(float(_number(body, "temperature", 1.0, 0.0, 2.0)))
    return Sample(
        prompt=prompt,
        num_samples=_number(body, "n", 1, 1, MAX_N, integer=True),
        max_tokens=max_tokens,
        temperature=0.0 if scores_only else temperature,
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        seed=seed,
        stop_strings=_stops(body),
        json_reply=True,
        **target,
        **kw,
    )


async def _run(state: ServiceState, owner: str, samples: list[Sample]) -> list[dict[str, Any]]:
    """Queue every sample (one per prompt, all or none) and wait for their generations; their JSON results.
    More prompts than a key may have waiting at once can never run: a 413 naming that share."""
    works = [Work(Kind.SAMPLE, state.futures.new(), owner, body=s) for s in samples]
    try:
        state.inbox.put_all(works)
    except (NeverFits, InboxFull) as e:
        for w in works:
            state.futures.forget(w.request_id)
        if isinstance(e, NeverFits):
            raise OpenAIError(
                413,
                f"the request has {e.items} prompts, and at most {e.most} of one key may wait in the job's "
                f"queue at once (its share): send at most {e.most} prompts a request",
                "prompt",
            ) from None
        raise
    out = []
    for w in works:
        deadline = time.monotonic() + WAIT_S
        result: Result | None = None
        while result is None and time.monotonic() < deadline:
            result = await state.futures.wait(w.request_id, 30.0)
        if result is None:
            raise OpenAIError(504, "the generation did not finish in time")
        if result.error is not None:
            raise OpenAIError(
                400 if "no tenant" in result.error or "no sampler" in result.error else 500, result.error
            )
        out.append(result.json or {})
    return out


def _text(state: ServiceState, tokens: list[int], stops: list[str]) -> tuple[str, bool]:
    """A completion's text (special tokens left out) cut at its first stop string, as OpenAI does; whether
    a stop string ended it."""
    text = state.tokenizer.decode(tokens, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _finish(seq: dict, stopped: bool) -> str:
    return "stop" if stopped or seq["stop_reason"] != "length" else "length"


def _piece(state: ServiceState, token: int) -> str:
    return state.tokenizer.decode([token])


# -- completions -------------------------------------------------------------------------------------------


async def completions(request: Request, state: ServiceState, owner: str) -> Response:
    body = await _body(request, state)
    _unsupported(body)
    target = _target(state, owner, body.get("model"))
    prompts = body.get("prompt")
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(type(t) is int for t in prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise OpenAIError(
            400, "prompt must be a string, a list of strings, token ids or lists of them", "prompt"
        )
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    if len(prompts) > MAX_PROMPTS or len(prompts) * n > MAX_N:
        raise OpenAIError(
            400, f"{len(prompts)} prompts x n={n}: at most {MAX_PROMPTS} prompts and {MAX_N} completions a request",
            "prompt",
        )  # fmt: skip
    logprobs = _number(body, "logprobs", None, 0, 5, integer=True)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise OpenAIError(400, "echo must be true or false", "echo")
    encoded = [_encode(state, p, "prompt") for p in prompts]
    stops = _stops(body)
    samples = [
        _sample(
            state,
            body,
            ids,
            target,
            prompt_logprobs=echo and logprobs is not None,
            top_logprobs=logprobs or 0,
        )
        for ids in encoded
    ]
    results = await _run(state, owner, samples)
    choices, completion_tokens = [], 0
    scores_only = _scores_only(body)
    for p, (ids, res) in enumerate(zip(encoded, results)):
        for j, seq in enumerate(res["sequences"]):
            if scores_only:  # (the one token sampled to score the prompt is not part of the answer)
                seq = {**seq, "tokens": [], "logprobs": [], "top_logprobs": [], "stop_reason": "length"}
            text, stopped = _text(state, seq["tokens"], stops)
            completion_tokens += len(seq["tokens"])
            shown = (state.tokenizer.decode(ids, skip_special_tokens=True) if echo else "") + text
            lp = None
            if logprobs is not None:
                lp = _completion_logprobs(state, seq, ids if echo else [])
            choices.append({"index": p * samples[p].num_samples + j, "text": shown, "logprobs": lp,
                            "finish_reason": _finish(seq, stopped)})  # fmt: skip
    answer = {
        "id": f"cmpl-{samples and id(samples[0]):x}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": choices,
        "usage": _usage(sum(len(i) * s.num_samples for i, s in zip(encoded, samples)), completion_tokens),
    }
    if body.get("stream"):
        return _stream([{**answer, "choices": [c]} for c in choices])
    return JSONResponse(answer)


def _completion_logprobs(state: ServiceState, seq: dict, prompt: list[int]) -> dict:
    """The legacy completions ``logprobs`` object: tokens, their logprobs, the most likely tokens at each
    step and the text offsets (``prompt`` given, with ``echo``: its tokens first, the first one without a
    logprob)."""
    tokens = [*prompt, *seq["tokens"]]
    echoed = (seq.get("prompt_logprobs") or [None] * len(prompt)) if prompt else []
    values = [*echoed, *seq["logprobs"]]
    asked = seq.get("prompt_top_logprobs") if prompt else None
    prompt_tops = [None, *(_by_text(state, step) for step in asked[1:])] if asked else [None] * len(prompt)
    tops = prompt_tops + [
        _by_text(state, step) for step in (seq.get("top_logprobs") or [[]] * len(seq["tokens"]))
    ]
    pieces = [_piece(state, t) for t in tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


# -- chat completions --------------------------------------------------------------------------------------


async def chat_completions(request: Request, state: ServiceState, owner: str) -> Response:
    body = await _body(request, state)
    _unsupported(body)
    target = _target(state, owner, body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):  # fmt: skip
        raise OpenAIError(
            400, "messages must be a non-empty list of {role, content} with text content", "messages"
        )
    if not getattr(state.tokenizer, "chat_template", None):
        raise OpenAIError(400, "the model's tokenizer has no chat template: use /v1/completions", "messages")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise OpenAIError(400, "logprobs must be true or false", "logprobs")
    top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
    if top and not logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    try:
        text = state.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as e:  # (a template that rejects these roles, say)
        raise OpenAIError(400, f"the chat template cannot render these messages ({e})", "messages") from None
    ids = list(state.tokenizer(text, add_special_tokens=False)["input_ids"])
    stops = _stops(body)
    sample = _sample(
        state, body, ids, target, top_logprobs=top, default_max=state.limits.max_tokens - len(ids)
    )
    (res,) = await _run(state, owner, [sample])
    choices, completion_tokens = [], 0
    for j, seq in enumerate(res["sequences"]):
        content, stopped = _text(state, seq["tokens"], stops)
        completion_tokens += len(seq["tokens"])
        lp = None
        if logprobs:
            tops = seq.get("top_logprobs") or [[]] * len(seq["tokens"])
            lp = {"content": [
                {"token": _piece(state, t), "logprob": v, "bytes": list(_piece(state, t).encode()),
                 "top_logprobs": [{"token": _piece(state, a), "logprob": b, "bytes": list(_piece(state, a).encode())}
                                  for a, b in step]}
                for t, v, step in zip(seq["tokens"], seq["logprobs"], tops)
            ]}  # fmt: skip
        choices.append({"index": j, "message": {"role": "assistant", "content": content}, "logprobs": lp,
                        "finish_reason": _finish(seq, stopped)})  # fmt: skip
    answer = {
        "id": f"chatcmpl-{id(sample):x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": choices,
        "usage": _usage(len(ids) * sample.num_samples, completion_tokens),
    }
    if body.get("stream"):
        chunks = []
        for c in choices:
            base = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
            delta = {"role": "assistant", "content": c["message"]["content"]}
            chunks.append({**base, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None}]})
            chunks.append(
                {**base, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]}
            )
        return _stream(chunks)
    return JSONResponse(answer)


def _by_text(state: ServiceState, step: list) -> dict[str, float]:
    """One step's most likely tokens keyed by their text, as the legacy format has them; two tokens of the same
    text (byte tokens that each print as "\ufffd") keep the likelier's logprob."""
    out: dict[str, float] = {}
    for token, value in step:  # (most likely first)
        out.setdefault(_piece(state, token), value)
    return out


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _stream(chunks: list[dict]) -> StreamingResponse:
    """Server-sent events: each chunk as a ``data:`` line, then ``data: [DONE]``."""

    def events() -> Iterator[bytes]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
