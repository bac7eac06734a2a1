"""The job's own OpenAI-compatible endpoint for agent tenants: what their episodes call, on loopback.

An RL job with agent tenants (``rl.env`` or ``rl.tools``) opens ``/v1/chat/completions`` and ``/v1/models`` on
127.0.0.1 (rank 0), whether it is served or not. Each agent tenant gets its own private key
(``secrets.token_urlsafe``), given only to its env worker: a key reaches only its own tenant, so one tenant's env
can neither sample nor write into another's trajectories. A request names its trajectory (``X-Trajectory-Id``;
verifiers' ``X-Session-ID``; or ``metadata.trajectory_id``), which the job registered before the episode
started.

A request becomes a :class:`Turn` in one queue. The RL driver takes every turn that waits at the same moment,
of every tenant, and samples them in **one batched generation** (each row with its tenant's adapter), then
answers each (:meth:`AgentEndpoint.take`, :meth:`Turn.settle`); the HTTP handler waits on its turn's future. So
while one tenant's episodes run their tools, the others' turns are sampled, and no tenant waits for another's
environment.

What a turn samples is the tenant's own: its ``rl.temperature`` (the trainer scores at it; a request's own
``temperature``, ``top_p`` are not taken), at most ``rl.max_new_tokens`` (or the request's ``max_tokens``,
whichever is smaller, and what room the model's context leaves), stopping at EOS, ``rl.stop`` and the request's
``stop``. An episode may grow past the job's ``seq_len`` (up to the model's context, ``context``): the job trains
its first ``seq_len`` tokens, with a warning row (:class:`~mlora_lab.agents.rollouts.Played`'s ``cut``).
Its seed is the trajectory's: turn ``u`` of member ``j`` of prompt ``b`` of generation ``g`` draws as completion
``j`` of that prompt does in a single-turn tenant (:data:`turn_seed`), so a one-turn env equals today's RL.

The answer is OpenAI's ``ChatCompletion`` (or its stream: one content chunk, a finish chunk, a usage chunk when
``stream_options.include_usage``, ``[DONE]``), with:

- ``tool_calls`` parsed from the sampled text (Hermes ``<tool_call>`` blocks, when the request gave ``tools``),
  ``finish_reason: "tool_calls"``;
- ``choices[0].token_ids`` and ``prompt_token_ids`` (vLLM's names) and, with ``logprobs: true``, one logprob per
  sampled token: the sampler's, what the trainer's importance ratio is taken against.

The capture of each trajectory's tokens is :mod:`mlora_lab.agents.ledger`'s. Errors have OpenAI's shape: 401 a
wrong key, 404 another tenant's model, 400 a bad body or a full context (the message says "context": an episode
ends there normally), 504 a turn the job did not answer in time.

**Harness mode** (``rl.harness``): no env worker; the job :meth:`~AgentEndpoint.publish`-es a generation's
episodes and an outside program plays them with the tenant's key::

    GET  /v1/episodes?limit=N&wait=S            claims up to N (default 1) of the tenant's unclaimed episodes,
                                                waiting up to S seconds (default 0) for one: {"data":
                                                [{"trajectory_id", "example"}]}
    POST /v1/trajectories/<id>/reward           the episode's reward, once: {"reward": x} or {"rewards": {...},
                                                "metrics": {...}} (an env rollout's return, checked as one:
                                                :func:`mlora_lab.agents.env_worker.rollout_result`) -> {"ok":
                                                true}; 400 naming every problem, 404 not an episode of the
                                                key's tenant, 409 a second reward

A rewarded episode is over: a turn of it is a 409.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlora_lab.agents import chat
from mlora_lab.agents.ledger import Capture, CaptureError, Ledger
from mlora_lab.sampling import Completion, SampleRequest

MAX_BODY_BYTES = 8 << 20
JUDGE = "(judge)"
"""The owner of the judges' key (no tenant may be named so: parentheses are not in a tenant's name)."""
BASE = "base"
JUDGE_MAX_TOKENS = 256
GREEDY_BELOW = 1e-5
"""A judge's temperature below this samples greedily (as the served job's OpenAI route does)."""
TRAJECTORY_HEADERS = ("x-trajectory-id", "x-session-id")
MAX_STOP = 4
MAX_CLAIM = 4096
"""The most episodes one ``GET /v1/episodes`` claims."""
MAX_POLL_S = 300.0
"""The longest ``GET /v1/episodes`` waits for an episode (its ``wait``)."""
POLL_S = 0.05


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` of a trajectory whose first turn draws with ``seed``: ``seed`` itself
    for turn 0 (a one-turn episode draws what the single-turn tenant draws), else 63 bits of a hash of both."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"mlora_lab.agents/{seed}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class TenantTurns:
    """How an agent tenant's turns are sampled (its ``rl`` settings)."""

    max_new_tokens: int
    temperature: float
    stop: tuple[str, ...] = ()
    harness: bool = False  # its episodes are published for an outside program (rl.harness)


@dataclass(frozen=True)
class Expected:
    """A trajectory the job registered: whose, and its first turn's seed and member index (its draws)."""

    tenant: str
    seed: int
    member: int


@dataclass
class Turn:
    """One request waiting for its generation: what to sample, and the future its handler waits on."""

    trajectory: str | None  # (None: a judge's request, not an episode's turn)
    request: SampleRequest
    arrived: float = field(default_factory=time.monotonic)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, repr=False)

    def settle(self, completion: Completion | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(completion, BaseException):
            self.future.set_exception(completion)
        else:
            self.future.set_result(completion)


class EndpointError(Exception):
    """An OpenAI-shaped refusal."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 504: "timeout"}.get(self.status, "invalid_request_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}
        return JSONResponse(body, status_code=self.status)


def _number(text: str, kind: type, low: float, high: float) -> Any:
    """``text`` as a ``kind`` in ``[low, high]``, or ``None``."""
    try:
        x = kind(text)
    except ValueError:
        return None
    return x if low <= x <= high else None


class AgentEndpoint:
    """The endpoint's state (keys, tenants, expected trajectories, the capture, the turn queue) and its app.

    ``seq_len``: the longest trajectory the endpoint holds, prompt and answers (the model's context: past it a
    turn is refused, "the context is full"); ``wait_s``: the longest a turn waits for the job before a 504."""

    def __init__(self, tokenizer: Any, seq_len: int, wait_s: float = 600.0) -> None:
        self.tokenizer, self.seq_len, self.wait_s = tokenizer, int(seq_len), float(wait_s)
        self.capture = Capture(tokenizer, seq_len)
        self._keys: dict[str, str] = {}  # key -> tenant
        self._tenants: dict[str, TenantTurns] = {}
        self._expected: dict[str, Expected] = {}
        self._turns: list[Turn] = []
        self._published: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # tenant -> unclaimed episodes
        self._rewards: dict[str, dict[str, Any] | None] = {}  # a published episode -> its reward, once posted
        self._lock = threading.Condition()
        self._active: set[str] = set()  # env workers' episodes not ended (a wave waits for their turns)
        self._judged: Callable[[], Collection[str]] | None = None  # (what a judge may ask besides the base)
        self._server: Any = None
        self.url: str | None = None

    # -- the job's side --------------------------------------------------------------------------
    def start(self) -> str:
        """Serve on 127.0.0.1 (any free port); the base URL, ending in ``/v1``."""
        if self._server is None:
            from mlora_lab.service.app import Server

            self._server = Server(None, "127.0.0.1", 0, app=self.app()).start()
            self.url = f"{self._server.url}/v1"
        return self.url  # type: ignore[return-value]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        with self._lock:
            for turn in self._turns:
                turn.settle(RuntimeError("the job is over"))
            self._turns = []

    def tenant(self, name: str, turns: TenantTurns) -> str:
        """Register (or update) agent tenant ``name``; its private key (the same one for as long as the job runs)."""
        with self._lock:
            self._tenants[name] = turns
            for key, owner in self._keys.items():
                if owner == name:
                    return key
            key = secrets.token_urlsafe(24)
            self._keys[key] = name
            return key

    def expect(self, trajectory: str, expected: Expected) -> None:
        """Trajectory ``trajectory`` may now call the endpoint (its tenant's key only). An env worker's episode
        counts as active (the next wave waits for its turn, :meth:`take`) until :meth:`ended`; a harness
        program's does not (its program may play its episodes one after another)."""
        with self._lock:
            self._expected[trajectory] = expected
            turns = self._tenants.get(expected.tenant)
            if turns is not None and not turns.harness:
                self._active.add(trajectory)

    def ended(self, trajectory: str) -> None:
        """Trajectory ``trajectory``'s episode has ended (its env worker said so): no wave waits for it."""
        with self._lock:
            self._active.discard(trajectory)
            self._lock.notify_all()

    def finish(self, trajectory: str) -> Ledger | None:
        """The trajectory's episode is over: its ledger (``None`` if it never called), and no more turns (nor a
        claim or a reward, were it published)."""
        with self._lock:
            self._expected.pop(trajectory, None)
            self._active.discard(trajectory)
            if self._rewards.pop(trajectory, False) is not False:
                for tenant, queue in self._published.items():
                    self._published[tenant] = [e for e in queue if e[0] != trajectory]
            return self.capture.take(trajectory)

    def judge_key(self, models: Callable[[], Collection[str]]) -> str:
        """The key of the job's judges (:data:`JUDGE`): they may ask ``base`` or any of ``models()`` (the job's
        running tenants), plain requests that are not an episode's turns (nothing is captured); the same key for
        as long as the job runs."""
        with self._lock:
            self._judged = models
            for key, owner in self._keys.items():
                if owner == JUDGE:
                    return key
            key = secrets.token_urlsafe(24)
            self._keys[key] = JUDGE
            return key

    def keys(self, harness: bool = True) -> dict[str, str]:
        """``tenant -> key`` of the registered tenants (only harness tenants', by default)."""
        with self._lock:
            return {
                t: k
                for k, t in self._keys.items()
                if t != JUDGE and (not harness or self._tenants[t].harness)
            }

    def publish(self, tenant: str, episodes: list[tuple[str, dict[str, Any]]]) -> None:
        """Harness tenant ``tenant``'s episodes ``(trajectory id, example)``, each :meth:`expect`-ed already, may
        now be claimed (``GET /v1/episodes``) and rewarded."""
        with self._lock:
            self._published.setdefault(tenant, []).extend(episodes)
            for tid, _ in episodes:
                self._rewards[tid] = None

    def rewards(self, trajectories: list[str]) -> dict[str, dict[str, Any]]:
        """The rewards posted so far for published ``trajectories`` (each a checked rollout result:
        ``reward``, ``parts``, ``metrics``, ``messages``, ``turns``, ``stop``)."""
        with self._lock:
            return {t: r for t in trajectories if (r := self._rewards.get(t)) is not None}

    def take(
        self, quiet_s: float = 0.01, most_s: float = 0.05, idle_s: float = 0.05, gather_s: float = 0.25
    ) -> list[Turn]:
        """The turns waiting now, so that turns that come together share one generation: waits up to ``idle_s``
        for a first one; then, while some active episode (an env worker's, not ended) has no turn waiting (its
        env is between turns: a tool runs), up to ``gather_s`` for them all; else while more arrive, at most
        ``quiet_s`` apart and ``most_s`` in all (a harness program's, a judge's)."""
        with self._lock:
            if not self._turns:
                self._lock.wait(idle_s)
            if self._turns:
                start = time.monotonic()
                if self._active:
                    while time.monotonic() - start < gather_s and not self._active <= self._waiting():
                        self._lock.wait(max(0.0, min(quiet_s, gather_s - (time.monotonic() - start))))
                else:
                    while time.monotonic() - start < most_s:
                        n = len(self._turns)
                        self._lock.wait(quiet_s)
                        if len(self._turns) == n:
                            break
            out, self._turns = self._turns, []
            return out

    def _waiting(self) -> set[str]:
        return {t.trajectory for t in self._turns if t.trajectory is not None}

    # -- HTTP ------------------------------------------------------------------------------------
    def app(self) -> Starlette:
        def route(path: str, handler: Any, methods: list[str]) -> Route:
            async def endpoint(request: Request) -> Response:
                try:
                    return await handler(request)
                except EndpointError as e:
                    return e.response()

            return Route(path, endpoint, methods=methods)

        return Starlette(
            routes=[
                route("/v1/models", self._models, ["GET"]),
                route("/v1/chat/completions", self._chat, ["POST"]),
                route("/v1/episodes", self._episodes, ["GET"]),
                route("/v1/trajectories/{trajectory:path}/reward", self._reward, ["POST"]),
            ]
        )

    def _owner(self, request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        owner = self._keys.get(key) if key else None
        if owner is None:
            raise EndpointError(401, "a missing or wrong key (Authorization: Bearer <the tenant's key>)")
        return owner

    async def _models(self, request: Request) -> Response:
        owner = self._owner(request)
        names = [BASE, *sorted(self._judged())] if owner == JUDGE and self._judged is not None else [owner]
        data = [
            {"id": n, "object": "model", "created": 0, "owned_by": "mlora_lab", "max_model_len": self.seq_len}
            for n in names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _episodes(self, request: Request) -> Response:
        owner = self._owner(request)
        if owner == JUDGE or not self._tenants[owner].harness:
            raise EndpointError(404, f"{owner!r} is not a harness tenant: it has no episodes to claim")
        problems = []
        given = request.query_params.get("limit", "1"), request.query_params.get("wait", "0")
        limit, wait = _number(given[0], int, 1, MAX_CLAIM), _number(given[1], float, 0.0, MAX_POLL_S)
        if limit is None:
            problems.append(f"limit must be an integer in [1, {MAX_CLAIM}] (got {given[0][:40]!r})")
        if wait is None:
            problems.append(f"wait must be seconds in [0, {MAX_POLL_S:g}] (got {given[1][:40]!r})")
        if problems:
            raise EndpointError(400, "; ".join(problems))
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                queue = self._published.get(owner, [])
                claimed, self._published[owner] = queue[:limit], queue[limit:]
            if claimed or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
        data = [{"trajectory_id": tid, "example": example} for tid, example in claimed]
        return JSONResponse({"object": "list", "data": data})

    async def _reward(self, request: Request) -> Response:
        from mlora_lab.agents.env_worker import EpisodeFailure, rollout_result

        owner = self._owner(request)
        tid = request.path_params["trajectory"]
        with self._lock:
            known = tid in self._rewards and (e := self._expected.get(tid)) is not None and e.tenant == owner
            given = self._rewards.get(tid) is not None
            led = self.capture.ledgers.get(tid)
            answered = led is not None and led.turns > 0
        if not known:
            raise EndpointError(404, f"trajectory {tid[:80]!r} is not one of tenant {owner!r}'s episodes now")
        if given:
            raise EndpointError(
                409, f"trajectory {tid!r} has its reward already: an episode is rewarded once"
            )
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise EndpointError(413, f"the body is {len(raw)} bytes, more than {MAX_BODY_BYTES}")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise EndpointError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise EndpointError(400, 'the body must be a JSON object: {"reward": x} or {"rewards": {...}}')
        try:
            result = rollout_result(tid, "harness", body)
        except EpisodeFailure as e:
            message = str(e).replace("rollout 'harness' returned", "the reward is", 1)
            raise EndpointError(400, message) from None
        if not answered:
            raise EndpointError(
                400,
                f"trajectory {tid!r} has no answered turn yet: call /v1/chat/completions with it (X-Trajectory-Id) "
                "first; an episode trains the model's tokens",
            )
        with self._lock:
            if self._rewards.get(tid, False) is not None:  # (rewarded meanwhile, or over)
                raise EndpointError(409, f"trajectory {tid!r} has its reward already, or its episode is over")
            self._rewards[tid] = result
        return JSONResponse({"ok": True})

    async def _chat(self, request: Request) -> Response:
        owner = self._owner(request)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise EndpointError(413, f"the body is {len(raw)} bytes, more than {MAX_BODY_BYTES}")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise EndpointError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise EndpointError(400, "the body must be a JSON object")
        turn, ids = self._judge_turn(body) if owner == JUDGE else self._turn(owner, request, body)
        loop = asyncio.get_running_loop()
        try:
            completion = await asyncio.wait_for(asyncio.wrap_future(turn.future, loop=loop), self.wait_s)
        except TimeoutError:
            raise EndpointError(504, f"the job did not answer this turn in {self.wait_s:g} s") from None
        except RuntimeError as e:
            raise EndpointError(503, str(e)) from None
        return self._answer(body, turn, ids, completion)

    def _turn(self, owner: str, request: Request, body: dict[str, Any]) -> tuple[Turn, list[int]]:
        problems = []
        if body.get("model") != owner:
            raise EndpointError(
                404, f"model {str(body.get('model'))[:80]!r} is not this key's tenant {owner!r}", "model"
            )
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        tid = next((request.headers[h] for h in TRAJECTORY_HEADERS if h in request.headers), None)
        tid = tid or meta.get("trajectory_id")
        with self._lock:
            expected = self._expected.get(tid) if isinstance(tid, str) else None
            over = isinstance(tid, str) and self._rewards.get(tid) is not None
        if over:
            raise EndpointError(409, f"trajectory {tid[:80]!r} has its reward: its episode is over")
        if expected is None or expected.tenant != owner:
            raise EndpointError(
                400,
                f"trajectory {str(tid)[:80]!r} is not one of tenant {owner!r}'s episodes now (send the "
                "X-Trajectory-Id its episode was given)",
            )
        n = body.get("n", 1)
        if n not in (1, None):
            problems.append("n must be 1: an episode's turn is one answer (a group is several episodes)")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            problems.append("messages must be a non-empty list")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(x, dict) for x in tools)):
            problems.append("tools must be a list of tool schemas")
        tools = tools or None
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)
        ):
            problems.append(f"stop must be a string or up to {MAX_STOP} non-empty strings")
            stops = []
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            problems.append("max_tokens must be a positive integer")
            asked = None
        if problems:
            raise EndpointError(400, "; ".join(problems))
        settings = self._tenants[owner]
        with self._lock:
            try:
                ids = self.capture.prompt(tid, messages, tools)
            except CaptureError as e:
                raise EndpointError(400, str(e), "messages") from None
            u = self.capture.ledgers[tid].turns
        room = self.seq_len - len(ids)
        if room < 1:
            raise EndpointError(
                400, f"the context is full: the prompt is {len(ids)} tokens of the model's {self.seq_len}"
            )
        request_ = SampleRequest(
            prompt=ids,
            tenant=None if owner == BASE else owner,  # (an evaluation's base: no tenant is named so)
            num_samples=1,
            max_new_tokens=min(settings.max_new_tokens, asked or settings.max_new_tokens, room),
            temperature=settings.temperature,
            stop_strings=(*settings.stop, *stops),
            seed=turn_seed(expected.seed, u),
            first_sample=expected.member,
        )
        turn = Turn(tid, request_)
        with self._lock:
            self._turns.append(turn)
            self._lock.notify_all()
        return turn, ids

    def _judge_turn(self, body: dict[str, Any]) -> tuple[Turn, list[int]]:
        """A judge's request: ``model`` ``base`` or a running tenant, its messages rendered whole (nothing is
        captured), its own ``temperature`` (below 1e-5: greedy), ``max_tokens`` (default 256, what room
        ``seq_len`` leaves), ``stop`` and ``seed`` (default 0)."""
        model = body.get("model")
        names = set(self._judged()) if self._judged is not None else set()
        if model != BASE and model not in names:
            known = ", ".join(sorted(names)[:20]) or "none running"
            raise EndpointError(
                404, f"model {str(model)[:80]!r} is neither {BASE!r} nor a running tenant ({known})"
            )
        problems = []
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            problems.append("messages must be a non-empty list")
        if body.get("n", 1) not in (1, None):
            problems.append("n must be 1")
        temperature = body.get("temperature", 1.0)
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, int | float)
            or not 0 <= temperature <= 100
        ):
            problems.append("temperature must be a number in [0, 100]")
            temperature = 0.0
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            problems.append("max_tokens must be a positive integer")
        seed = body.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            problems.append("seed must be an integer")
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP
            or not all(isinstance(x, str) and x for x in stops)
        ):
            problems.append(f"stop must be a string or up to {MAX_STOP} non-empty strings")
        if problems:
            raise EndpointError(400, "; ".join(problems))
        try:
            ids = chat.render(self.tokenizer, messages, tools=body.get("tools") or None)
        except Exception as e:  # (a message the template cannot take: named)
            raise EndpointError(
                400, f"the chat template cannot render these messages: {e}", "messages"
            ) from None
        room = self.seq_len - len(ids)
        if room < 1:
            raise EndpointError(
                400, f"the context is full: the prompt is {len(ids)} tokens of the model's {self.seq_len}"
            )
        turn = Turn(
            None,
            SampleRequest(
                prompt=ids,
                tenant=None if model == BASE else model,
                num_samples=1,
                max_new_tokens=min(asked or JUDGE_MAX_TOKENS, room),
                temperature=0.0 if temperature < GREEDY_BELOW else float(temperature),
                stop_strings=tuple(stops),
                seed=seed,
            ),
        )
        with self._lock:
            self._turns.append(turn)
            self._lock.notify_all()
        return turn, ids

    def _answer(self, body: dict[str, Any], turn: Turn, ids: list[int], c: Completion) -> Response:
        tok = self.tokenizer
        text = tok.decode(c.tokens, skip_special_tokens=True)
        tools = body.get("tools") or None
        content, calls = chat.parse_tool_calls(text) if tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        cut = c.stop_reason == "length"
        finish = "tool_calls" if calls else ("length" if cut else "stop")
        with self._lock:
            if turn.trajectory in self.capture.ledgers:
                self.capture.answer(turn.trajectory, list(c.tokens), list(c.sampling_logprobs), message, cut)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            pieces = [tok.decode([t]) for t in c.tokens]
            choice["logprobs"] = {
                "content": [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, c.sampling_logprobs, strict=True)
                ]
            }
        choice["token_ids"] = list(c.tokens)
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(c.tokens),
            "total_tokens": len(ids) + len(c.tokens),
        }
        answer = {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
            "prompt_token_ids": ids,
        }
        return JSONResponse(answer) if not body.get("stream") else streamed(body, answer)


def streamed(body: dict[str, Any], answer: dict[str, Any]) -> StreamingResponse:
    """A chat completion as server-sent events: one chunk with the whole message (its tool calls indexed), a
    finish chunk, the usage chunk when ``stream_options.include_usage`` asks for it, then ``[DONE]``."""
    choice = answer["choices"][0]
    message = choice["message"]
    base = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    chunks = [
        {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}],
        },
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
    ]
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        chunks.append({**base, "choices": [], "usage": answer["usage"]})

    def events() -> Any:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
