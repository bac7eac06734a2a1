"""The env worker of an agent tenant: its episodes run in a process of their own, isolated as rewards are.

An env tenant is an RL tenant with ``env=`` (a rollout function) or ``tools=[fn, ...]`` (the built-in tool
loop). All its episodes run in **one worker process per tenant** (``python -m mlora_lab.agents.env_worker``),
inside one asyncio loop, so the ``n`` episodes of a batch wait on the model and on their tools at the same
time. The model is the job's OpenAI-compatible endpoint on loopback (``base_url`` ending in ``/v1``, a private
``api_key``), called with ``model=<tenant>`` and the header ``X-Trajectory-Id: <trajectory id>`` on every
request of an episode: the endpoint records each trajectory's tokens from it; the worker never sees tokens.

A function is named as a reward function is (:mod:`mlora_lab.rl.rewards`): ``"module:function"``,
``"path/to/file.py:function"``, or a pickled ``"<...>.pkl:name"``.

**Rollout mode** (``env``): ``rollout(client, model, example)``, a ``def`` (called in a thread with an
``openai.OpenAI`` client) or an ``async def`` (awaited with an ``openai.AsyncOpenAI``), returns the reward
(a number), or ``{"reward": r | None, "rewards": {name: score | {"score": s, "weight": w}}, "metrics":
{name: x}, "messages": [...]}`` (every key but ``reward`` optional; with ``rewards`` and no ``reward``,
``r = Σ score·weight``, weight 1 by default).

**Tools mode** (``tools``): TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop``) over HTTP: up to
``max_turns`` model turns, each tool call run and its result appended as a ``tool`` message; a mistake of the
model (an unknown tool, arguments that do not bind, a tool that raises) is fed back as ``{"error": ...}``;
the reward is ``None`` (the tenant's reward functions score the messages).

**Isolation** (the reward worker's: :class:`~mlora_lab.rl.rewards.RewardWorker`): frames sealed with a key only
the worker holds, a child subreaper, a watchdog on its parent, a group kill. The parent keeps each batch's
deadline (``rollout_timeout_s`` + :data:`GRACE_S`) on its own clock, whatever the env does to the worker; the
worker keeps ``rollout_timeout_s`` per episode itself (``asyncio.wait_for``), so an env that yields is named
with its trajectory, and the parent's clock is the backstop for sync code that never does. Any failure, a
raise, a hang, garbage, a crash, a flood, is an :class:`EnvError` for that tenant only; the worker and
everything it started are then killed, and the next :meth:`EnvWorker.submit` starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from mlora_lab.rl.rewards import EXIT_GRACE_S, START_TIMEOUT_S, Frames, kill_tree, spawn
from mlora_lab.text import brief, is_finite

WORKER_MODULE = "mlora_lab.agents.env_worker"
GRACE_S = 2.0
"""What the parent's clock allows past ``rollout_timeout_s`` (the worker's own limit answers first)."""
ANSWER_CAP = 64 << 20
"""The most bytes one answer of a worker may take (a flood past it is the tenant's fault)."""
STOPS = ("answered", "max_turns", "context", "returned")
"""Why an episode ended: the model answered without a tool call; ``max_turns`` turns without a final answer;
the endpoint refused a turn because the context is full (HTTP 400, a normal end); a rollout function
returned."""


class EnvError(RuntimeError):
    """Why a tenant's env failed: the job quarantines that tenant with this message; others go on."""


@dataclass
class Episode:
    """One episode to run: its trajectory id (the ``X-Trajectory-Id`` of its requests) and the tenant's data
    row, ``{"prompt": str}`` or ``{"messages": [...]}`` plus any other columns."""

    trajectory_id: str
    example: dict[str, Any]


@dataclass
class EpisodeResult:
    """What an episode gave. ``reward``: the env's (``None``: the tenant's reward functions score
    ``messages``); ``parts``: ``name -> (score, weight)``, with ``reward = Σ score·weight`` when the env gave
    no reward of its own; ``turns``: the model turns; ``stop``: why it ended (:data:`STOPS`)."""

    trajectory_id: str
    reward: float | None
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    turns: int = 0
    stop: str = "returned"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EnvConfig:
    """A tenant's env: ``env`` (a rollout function's reference, called as ``rollout(client, model, example,
    **env_args)``) or ``tools`` (tool functions' references: the tool loop), its endpoint and limits. With
    ``env``, the rollout function runs its own tools: ``tools`` are not the worker's then. ``turn_timeout_s`` bounds one model request and one tool call;
    ``rollout_timeout_s`` one episode (and, with :data:`GRACE_S`, a batch by the parent's clock)."""

    env: str | None
    tools: list[str]
    env_args: dict[str, Any]
    base_url: str
    api_key: str
    model: str
    max_turns: int
    turn_timeout_s: float
    rollout_timeout_s: float
    max_tool_output_chars: int = 16_384

    def problems(self) -> list[str]:
        """Everything wrong with this config (empty: none)."""
        out = []
        if self.env is None and not self.tools:
            out.append("an env tenant needs env= (a rollout function) or tools=[...]")
        if self.env is None and self.env_args:
            out.append("env_args are the keyword arguments of env=, and there is no env")
        if self.env is not None and not isinstance(self.env, str):
            out.append(f"env must be a reference 'module:function' or 'file.py:function' ({brief(self.env)})")
        if not isinstance(self.tools, list) or not all(isinstance(t, str) for t in self.tools):
            out.append(f"tools must be a list of references 'module:function' ({brief(self.tools)})")
        if not isinstance(self.env_args, dict):
            out.append(f"env_args must be a dict ({brief(self.env_args)})")
        if not isinstance(self.max_turns, int) or isinstance(self.max_turns, bool) or self.max_turns < 1:
            out.append(f"max_turns must be a positive integer ({brief(self.max_turns)})")
        for name in ("turn_timeout_s", "rollout_timeout_s"):
            v = getattr(self, name)
            if not is_finite(v) or isinstance(v, bool) or v <= 0:
                out.append(f"{name} must be a positive number of seconds ({brief(v)})")
        m = self.max_tool_output_chars
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            out.append(f"max_tool_output_chars must be a positive integer ({brief(m)})")
        return out


def spawn_worker(cwd: str | os.PathLike | None) -> tuple[subprocess.Popen, Frames]:
    """Start an env worker as :func:`mlora_lab.rl.rewards.spawn` starts a reward worker: its own session (a kill
    takes what the env started too), its frames' key on a pipe it inherits."""
    return spawn([], cwd, module=WORKER_MODULE, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def checked_results(answer: Any, episodes: list[Episode]) -> list[EpisodeResult]:
    """A worker's ``{"results": [...]}`` for ``episodes``, each field checked, in the episodes' order;
    ``ValueError`` naming every problem. The worker makes answers of this shape: one that is not was forged
    (by the env, which runs in the worker's interpreter) or is a bug, and fails only its tenant."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise ValueError(f"its results are not a list ({brief(results)})")
    if len(results) != len(episodes):
        raise ValueError(f"it answered {len(results)} results for {len(episodes)} episodes")
    out, problems = [], []
    for i, (r, ep) in enumerate(zip(results, episodes, strict=True)):
        where = f"result {i} ({brief(ep.trajectory_id)})"
        if not isinstance(r, dict):
            problems.append(f"{where} is not an object ({brief(r)})")
            continue
        bad = []
        if r.get("trajectory_id") != ep.trajectory_id:
            bad.append(f"its trajectory_id is {brief(r.get('trajectory_id'))}")
        reward = r.get("reward")
        if reward is not None and (not is_finite(reward) or isinstance(reward, bool)):
            bad.append(f"its reward is {brief(reward)}")
        parts = r.get("parts")
        ok_parts = isinstance(parts, dict) and all(
            isinstance(v, list) and len(v) == 2 and all(is_finite(x) and not isinstance(x, bool) for x in v)
            for v in parts.values()
        )
        if not ok_parts:
            bad.append(f"its parts are not name -> [score, weight] ({brief(parts)})")
        metrics = r.get("metrics")
        if not isinstance(metrics, dict) or not all(
            is_finite(v) and not isinstance(v, bool) for v in metrics.values()
        ):
            bad.append(f"its metrics are not name -> number ({brief(metrics)})")
        messages = r.get("messages")
        if messages is not None and not (
            isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
        ):
            bad.append(f"its messages are not a list of objects ({brief(messages)})")
        turns = r.get("turns")
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 0:
            bad.append(f"its turns are {brief(turns)}")
        if r.get("stop") not in STOPS:
            bad.append(f"its stop is {brief(r.get('stop'))}")
        extra = set(r) - {"trajectory_id", "reward", "parts", "metrics", "messages", "turns", "stop"}
        if extra:
            bad.append(f"it has unknown fields {sorted(map(brief, extra))}")
        if bad:
            problems.append(f"{where}: {'; '.join(bad)}")
            continue
        out.append(
            EpisodeResult(
                trajectory_id=ep.trajectory_id,
                reward=None if reward is None else float(reward),
                parts={str(k): (float(v[0]), float(v[1])) for k, v in parts.items()},
                metrics={str(k): float(v) for k, v in metrics.items()},
                messages=messages,
                turns=turns,
                stop=r["stop"],
            )
        )
    if problems:
        raise ValueError("; ".join(problems))
    return out


class EnvWorker:
    """The worker process of one tenant's env (see the module docstring), driven without blocking.

    :meth:`submit` sends a batch of episodes and returns at once (starting a worker if none runs);
    :meth:`poll` never blocks: ``None`` while the answer is not complete, then the results in the episodes'
    order, or :class:`EnvError` (the worker is then killed). So the job steps the workers of all its env
    tenants from one loop. The batch's deadline is ``rollout_timeout_s`` + :data:`GRACE_S` from the submit,
    by this process's clock (for a new worker, from its ``ok``: importing the env has
    :data:`~mlora_lab.rl.rewards.START_TIMEOUT_S` of its own).
    """

    def __init__(self, config: EnvConfig, cwd: str | os.PathLike | None = None) -> None:
        problems = config.problems()
        if problems:
            raise EnvError("; ".join(problems))
        self.config = config
        self.cwd = cwd
        self._proc: subprocess.Popen | None = None
        self._frames = Frames(b"")
        self._buffer = b""
        self._pending = b""  # request bytes not yet written (the worker reads them when it is ready)
        self._ready = False  # it said {"ok": true}
        self._eof_at: float | None = None
        self._episodes: list[Episode] | None = None
        self._deadline = 0.0
        self._doing = ""
        self._current: str | None = None  # the function it last said it imports
        self.ended: list[str] = []  # episodes the worker said ended, not yet taken (:meth:`take_ended`)

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` while none runs)."""
        return self._proc.pid if self._proc is not None else None

    # -- the process ---------------------------------------------------------------------------
    def _start(self) -> None:
        proc, frames = spawn_worker(self.cwd)
        os.set_blocking(proc.stdin.fileno(), False)  # type: ignore[union-attr]
        os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self._proc, self._frames, self._buffer, self._ready = proc, frames, b"", False
        self._eof_at, self._current = None, None
        self._pending = (
            orjson.dumps(asdict(self.config)) + b"\n"
        )  # (its first line: the config, key included)

    def close(self) -> None:
        """Kill the worker and everything it started (its process group, and any descendant that left it)."""
        proc, self._proc, self._episodes = self._proc, None, None
        self._pending, self._buffer = b"", b""
        if proc is None:
            return
        kill_tree(proc.pid, include_root=False)  # (first, while it lives: detached ones are its descendants)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        proc.wait()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _fail(self, why: str) -> EnvError:
        """The worker is stopped; the error to raise."""
        current = self._current if not self._ready else None
        self.close()
        return EnvError(why + (f" (importing {brief(current)})" if current else ""))

    # -- calls ---------------------------------------------------------------------------------
    def submit(self, episodes: list[Episode]) -> None:
        """Send ``episodes`` to the worker (starting one if none runs) and return at once; :meth:`poll`
        reads the answer."""
        if self._episodes is not None:
            raise RuntimeError("submit() twice before the answer was read")
        problems = [
            f"episode {i} is {brief(ep)}, not an Episode with a str trajectory_id and a dict example"
            for i, ep in enumerate(episodes)
            if not (
                isinstance(ep, Episode) and isinstance(ep.trajectory_id, str) and isinstance(ep.example, dict)
            )
        ]
        ids = [ep.trajectory_id for ep in episodes if isinstance(ep, Episode)]
        if len(set(ids)) != len(ids):
            problems.append("two episodes share a trajectory id")
        if problems:
            raise EnvError("; ".join(problems))
        try:
            line = orjson.dumps(
                {"episodes": [asdict(ep) for ep in episodes]}, option=orjson.OPT_SERIALIZE_NUMPY
            )
        except orjson.JSONEncodeError as e:
            raise EnvError(f"the episodes cannot be sent to the env worker: {e}") from None
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        now = time.monotonic()
        if self._ready:
            self._deadline, self._doing = (
                now + self.config.rollout_timeout_s + GRACE_S,
                "running the episodes",
            )
        else:
            self._deadline, self._doing = now + START_TIMEOUT_S, "starting the env worker"
        self._pending += line + b"\n"
        self._episodes = list(episodes)
        self._flush()

    def _flush(self) -> None:
        """Write what the pipe takes now of the pending request bytes (never blocks)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        while self._pending:
            try:
                n = os.write(proc.stdin.fileno(), self._pending)
            except BlockingIOError:
                return
            except OSError:  # it died or closed its input: the read says how
                self._pending = b""
                return
            self._pending = self._pending[n:]

    def _fill(self) -> bool:
        """Read what the worker sent so far into the buffer (never blocks); ``True`` at end of file."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        while True:
            try:
                chunk = os.read(proc.stdout.fileno(), 1 << 20)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            self._buffer += chunk
            if len(self._buffer) - (self._buffer.rfind(b"\n") + 1) > ANSWER_CAP:  # (an unfinished line)
                raise self._too_big()

    def _too_big(self) -> EnvError:
        return self._fail(
            f"the env worker's answer is over {_size(ANSWER_CAP)} (ANSWER_CAP) while {self._doing}: stopped"
        )

    def take_ended(self) -> list[str]:
        """The episodes the worker said ended since the last call (read by :meth:`poll`)."""
        out, self.ended = self.ended, []
        return out

    def poll(self) -> list[EpisodeResult] | None:
        """The answer to the last :meth:`submit` if it is complete (the results in the episodes' order),
        else ``None``; never blocks. :class:`EnvError` when the env failed, the worker crashed or exited,
        sent a malformed or oversized answer, or the batch ran past its deadline: the worker and everything
        it started are then killed."""
        if self._episodes is None:
            raise RuntimeError("poll() without submit()")
        self._flush()
        eof = self._fill()
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            if len(line) > ANSWER_CAP:
                raise self._too_big()
            try:
                message = self._frames.open(line)
                if not isinstance(message, dict):
                    raise ValueError("not an object")
            except ValueError:
                raise self._fail(
                    f"the env worker sent a malformed answer while {self._doing} (the env writing to its "
                    f"answer channel?): {brief(line.decode('utf-8', 'replace'))}"
                ) from None
            if "importing" in message:
                self._current = str(message["importing"])
                continue
            if "ended" in message and len(message) == 1:  # (an episode ended: progress, not the answer)
                self.ended.append(str(message["ended"]))
                continue
            if not self._ready:
                if "error" in message:
                    raise self._fail(f"the env could not be loaded: {message['error']}")
                if message.get("ok") is not True:
                    raise self._fail(f"the env worker's first answer is malformed: {brief(message)}")
                self._ready, self._current = True, None
                self._deadline = time.monotonic() + self.config.rollout_timeout_s + GRACE_S
                self._doing = "running the episodes"
                continue
            episodes, self._episodes = self._episodes, None
            if "error" in message:
                self.close()  # (an env that failed may have left threads or processes behind)
                raise EnvError(str(message["error"]))
            try:
                return checked_results(message, episodes)
            except ValueError as e:
                raise self._fail(f"the env worker's answer is malformed: {e}") from None
        proc = self._proc
        assert proc is not None
        if eof:
            code = proc.poll()
            if code is None:
                self._eof_at = self._eof_at or time.monotonic()
                if time.monotonic() - self._eof_at < EXIT_GRACE_S:
                    return None
                raise self._fail(
                    f"the env worker closed its answer channel and did not exit while {self._doing}"
                )
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise self._fail(f"the env worker {how} while {self._doing}")
        if time.monotonic() > self._deadline:
            limit = (
                f"{self.config.rollout_timeout_s:g} s (rollout_timeout_s) + {GRACE_S:g} s"
                if self._ready
                else f"{START_TIMEOUT_S:g} s"
            )
            raise self._fail(f"{self._doing} took more than {limit}, by the job's clock: stopped")
        return None

    def wait(self, timeout: float) -> list[EpisodeResult] | None:
        """:meth:`poll` until an answer or an error, for at most ``timeout`` seconds (``None`` then)."""
        end = time.monotonic() + timeout
        while True:
            got = self.poll()
            if got is not None:
                return got
            left = end - time.monotonic()
            if left <= 0:
                return None
            proc = self._proc
            assert proc is not None and proc.stdout is not None
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
                sel.select(min(left, 0.05 if self._pending or self._eof_at else 0.25))

    def run(self, episodes: list[Episode], timeout: float | None = None) -> list[EpisodeResult]:
        """Submit ``episodes`` and wait for their results: at most ``timeout`` seconds (by default, long
        enough for a start and the batch's own deadline, which raises first)."""
        self.submit(episodes)
        got = self.wait(
            timeout if timeout is not None else START_TIMEOUT_S + self.config.rollout_timeout_s + 2 * GRACE_S
        )
        if got is None:
            raise self._fail(f"{self._doing} gave no answer in time")
        return got


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"
