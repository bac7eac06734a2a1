"""The env worker of agent tenants (:mod:`mlora_lab.agents.envs`): real worker processes against a stub
OpenAI endpoint on loopback that answers from a script and records every request's body and headers."""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from mlora_lab.agents.envs import GRACE_S, EnvConfig, EnvError, EnvWorker, Episode, checked_results

KEY = "job-private-key"

ENV_CODE = '''
import asyncio, math, os, subprocess, time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"boom at {x}")


def flood(n: int) -> str:
    """A huge output.

    Args:
        n: How many characters.
    """
    return "x" * n


def stuck(x: int) -> int:
    """Never answers.

    Args:
        x: Anything.
    """
    time.sleep(1e6)


async def slow_add(a: int, b: int) -> int:
    """Add, slowly.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.01)
    return a + b


def ask(client, model, example):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": example["prompt"]}])
    return 1.0 if reply.choices[0].message.content == "hello" else 0.0


async def ask_async(client, model, example):
    messages = [{"role": "user", "content": example["prompt"]}]
    reply = await client.chat.completions.create(model=model, messages=messages)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return {
        "rewards": {"exact": 1.0, "short": {"score": 0.5, "weight": 2}},
        "metrics": {"length": len(messages[-1]["content"])},
        "messages": messages,
    }


def with_args(client, model, example, scale, offset=0.0):
    return scale * len(example["prompt"]) + offset


def sleepy(client, model, example):
    time.sleep(0.5)
    return 0.25


def hostile(client, model, example):
    mode = example["mode"]
    if mode == "raise":
        raise KeyError("no such answer")
    if mode == "hang":
        time.sleep(1e6)
    if mode == "exit":
        os._exit(3)
    if mode == "detach":  # (a daemon of its own session, then a failure: it must not outlive the worker)
        proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        with open(example["pidfile"], "w") as f:
            f.write(str(proc.pid))
        raise RuntimeError("left a daemon behind")
    if mode == "string":
        return "1.0"
    if mode == "big":
        return {"reward": 1.0, "messages": [{"role": "assistant", "content": "x" * 5000}]}
    if mode == "nan":
        return math.nan
    if mode == "unknown_key":
        return {"reward": 1.0, "score": 2.0}
    if mode == "bad_part":
        return {"rewards": {"a": "high"}}
    return 0.5


async def blocking(client, model, example):
    if example["mode"] == "block":
        time.sleep(1e6)  # (sync code in an async def: the loop never runs again)
    return 0.5
'''


class StubEndpoint:
    """``POST /v1/chat/completions`` answered by ``script(body) -> (status, json)``; every request's body and
    headers are kept in ``requests``."""

    def __init__(self, script: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]) -> None:
        self.script = script
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with server.lock:
                    server.requests.append((body, {k.lower(): v for k, v in self.headers.items()}))
                status, answer = server.script(body) if self.path == "/v1/chat/completions" else (404, {})
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join()


def completion(
    content: str | None, tool_calls: list[dict[str, Any]] | None = None
) -> tuple[int, dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return 200, {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": 0,
        "model": "agent",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}
        ],
    }


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


@pytest.fixture(scope="module")
def env_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("envs") / "my_env.py"
    path.write_text(ENV_CODE)
    return str(path)


@pytest.fixture
def endpoint() -> Iterator[StubEndpoint]:
    stub = StubEndpoint(lambda body: completion("hello"))
    yield stub
    stub.close()


def config(
    endpoint: StubEndpoint, env_file: str, env: str | None = None, tools: tuple[str, ...] = (), **kw: Any
) -> EnvConfig:
    return EnvConfig(
        env=f"{env_file}:{env}" if env else None,
        tools=[f"{env_file}:{t}" for t in tools],
        env_args={},
        base_url=endpoint.url,
        api_key=KEY,
        model="agent",
        max_turns=kw.pop("max_turns", 4),
        turn_timeout_s=kw.pop("turn_timeout_s", 5.0),
        rollout_timeout_s=kw.pop("rollout_timeout_s", 10.0),
        **kw,
    )


@pytest.fixture
def workers() -> Iterator[list[EnvWorker]]:
    made: list[EnvWorker] = []
    yield made
    for w in made:
        w.close()


def worker(workers: list[EnvWorker], cfg: EnvConfig) -> EnvWorker:
    w = EnvWorker(cfg)
    workers.append(w)
    return w


def gone(pid: int | None) -> bool:
    """The process ended (and was reaped, or is a zombie about to be)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def calculator(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Turn 1: add(2, 3); after the tool's answer: the final answer."""
    last = body["messages"][-1]
    if last["role"] == "user":
        return completion(None, [call("call_" + last["content"], "add", {"a": 2, "b": 3})])
    return completion(f"the sum is {last['content']}")


# -- tools mode ------------------------------------------------------------------------------------
def test_tool_loop_calls_the_calculator_and_names_the_trajectory_on_every_request(
    env_file, endpoint, workers
):
    endpoint.script = calculator
    w = worker(workers, config(endpoint, env_file, tools=("add",)))
    results = w.run(
        [
            Episode("t-1", {"prompt": "one"}),
            Episode("t-2", {"messages": [{"role": "user", "content": "two"}]}),
        ]
    )
    assert [r.trajectory_id for r in results] == ["t-1", "t-2"]
    for r, prompt in zip(results, ["one", "two"], strict=True):
        assert (r.reward, r.parts, r.turns, r.stop) == (None, {}, 2, "answered")
        assert r.metrics == {"tool_calls": 1.0, "tool_failures": 0.0}
        assert r.messages == [
            {"role": "user", "content": prompt},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("call_" + prompt, "add", {"a": 2, "b": 3})],
            },
            {"role": "tool", "tool_call_id": "call_" + prompt, "name": "add", "content": "5"},
            {"role": "assistant", "content": "the sum is 5"},
        ]
    assert len(endpoint.requests) == 4
    by_trajectory: dict[str, list[dict[str, Any]]] = {}
    for body, headers in endpoint.requests:
        assert headers["authorization"] == f"Bearer {KEY}"
        assert body["model"] == "agent"
        assert [t["function"]["name"] for t in body["tools"]] == ["add"]
        assert body["tools"][0]["function"]["parameters"]["properties"] == {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {"type": "integer", "description": "The second integer."},
        }
        by_trajectory.setdefault(headers["x-trajectory-id"], []).append(body)
    assert sorted(by_trajectory) == ["t-1", "t-2"]
    for tid, prompt in (("t-1", "one"), ("t-2", "two")):
        first, second = by_trajectory[tid]
        assert first["messages"] == [{"role": "user", "content": prompt}]
        assert second["messages"][-1] == {
            "role": "tool",
            "tool_call_id": "call_" + prompt,
            "name": "add",
            "content": "5",
        }
        assert second["messages"][1]["tool_calls"][0]["id"] == "call_" + prompt


def test_the_models_tool_mistakes_are_fed_back_and_the_episode_goes_on(env_file, endpoint, workers):
    def script(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body["messages"][-1]["role"] == "user":
            return completion(
                "trying",
                [
                    call("c1", "boom", {"x": 7}),
                    call("c2", "nosuch", {}),
                    call("c3", "add", {"a": 1}),
                    call("c4", "add", "{not json"),
                    call("c5", "slow_add", {"a": 1, "b": 1}),
                ],
            )
        return completion("done")

    endpoint.script = script
    w = worker(workers, config(endpoint, env_file, tools=("add", "boom", "slow_add")))
    (r,) = w.run([Episode("t", {"prompt": "go"})])
    assert (r.stop, r.turns) == ("answered", 2)
    tool_messages = [m for m in r.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["c1", "c2", "c3", "c4", "c5"]
    errors = [json.loads(m["content"]) for m in tool_messages[:4]]
    assert errors[0] == {"error": "boom at 7"}
    assert errors[1] == {"error": "Tool nosuch not found."}
    assert "missing a required argument: 'b'" in errors[2]["error"]
    assert "not JSON" in errors[3]["error"]
    assert tool_messages[4]["content"] == "2"
    assert r.metrics == {"tool_calls": 5.0, "tool_failures": 4.0}
    assert r.messages[-1] == {"role": "assistant", "content": "done"}


def test_max_turns_and_a_full_context_end_an_episode_normally(env_file, endpoint, workers):
    endpoint.script = lambda body: completion(
        None, [call(f"c{len(body['messages'])}", "add", {"a": 1, "b": 1})]
    )
    w = worker(workers, config(endpoint, env_file, tools=("add",), max_turns=3))
    (r,) = w.run([Episode("t", {"prompt": "loop"})])
    assert (r.stop, r.turns, len(r.messages)) == ("max_turns", 3, 1 + 3 * 2)

    def context_full(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if len(body["messages"]) > 1:
            return 400, {
                "error": {
                    "message": "the prompt leaves no room in the context (seq_len 64)",
                    "type": "invalid_request_error",
                }
            }
        return completion(None, [call("c", "add", {"a": 1, "b": 1})])

    endpoint.script = context_full
    (r,) = w.run([Episode("t2", {"prompt": "long"})])
    assert (r.stop, r.turns, [m["role"] for m in r.messages]) == ("context", 1, ["user", "assistant", "tool"])

    endpoint.script = lambda body: (500, {"error": {"message": "the job is stopping"}})
    with pytest.raises(EnvError, match=r"episode 't3': the endpoint failed turn 1: InternalServerError"):
        w.run([Episode("t3", {"prompt": "x"})])


def test_a_tool_output_flood_fails_the_tenant_naming_the_tool_and_its_size(env_file, endpoint, workers):
    endpoint.script = lambda body: completion(None, [call("c", "flood", {"n": 100_000})])
    w = worker(workers, config(endpoint, env_file, tools=("flood", "add")))
    with pytest.raises(
        EnvError,
        match=r"episode 'f': tool 'flood' returned 100,000 characters, over max_tool_output_chars \(16,384\)",
    ):
        w.run([Episode("f", {"prompt": "flood"})])
    assert w.pid is None
    endpoint.script = calculator
    (r,) = w.run([Episode("ok", {"prompt": "again"})])
    assert r.stop == "answered"


def test_a_tool_that_hangs_past_the_turn_limit_fails_the_tenant(env_file, endpoint, workers):
    endpoint.script = lambda body: completion(None, [call("c", "stuck", {"x": 1})])
    w = worker(workers, config(endpoint, env_file, tools=("stuck",), turn_timeout_s=0.5))
    start = time.monotonic()
    with pytest.raises(EnvError, match=r"episode 's': tool 'stuck' took more than 0.5 s \(turn_timeout_s\)"):
        w.run([Episode("s", {"prompt": "wait"})])
    assert time.monotonic() - start < 10.0 and w.pid is None


# -- rollout mode ----------------------------------------------------------------------------------
def test_rollouts_sync_and_async_return_a_number_or_a_dict_with_weighted_parts(env_file, endpoint, workers):
    w = worker(workers, config(endpoint, env_file, env="ask"))
    results = w.run([Episode("s-1", {"prompt": "hi", "answer": "x"}), Episode("s-2", {"prompt": "hey"})])
    assert [(r.trajectory_id, r.reward, r.parts, r.stop, r.messages) for r in results] == [
        ("s-1", 1.0, {}, "returned", None),
        ("s-2", 1.0, {}, "returned", None),
    ]
    assert sorted(h["x-trajectory-id"] for _, h in endpoint.requests) == ["s-1", "s-2"]

    w2 = worker(workers, config(endpoint, env_file, env="ask_async"))
    (r,) = w2.run([Episode("a-1", {"prompt": "hi"})])
    assert r.reward == pytest.approx(1.0 * 1 + 0.5 * 2)
    assert r.parts == {"exact": (1.0, 1.0), "short": (0.5, 2.0)}
    assert r.metrics == {"length": 5.0}
    assert r.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert (r.turns, r.stop) == (1, "returned")
    assert endpoint.requests[-1][1]["x-trajectory-id"] == "a-1"


def test_env_args_are_the_rollouts_keyword_arguments(env_file, endpoint, workers):
    cfg = config(endpoint, env_file, env="with_args")
    cfg.env_args = {"scale": 2.0, "offset": 0.5}
    (r,) = worker(workers, cfg).run([Episode("e", {"prompt": "abc"})])
    assert r.reward == 6.5
    cfg = config(endpoint, env_file, env="with_args")
    cfg.env_args = {"scael": 2.0}
    with pytest.raises(EnvError, match=r"cannot be called as rollout\(client, model, example, scael=...\)"):
        worker(workers, cfg).run([Episode("e", {"prompt": "abc"})])


def test_episodes_run_concurrently(env_file, endpoint, workers):
    w = worker(workers, config(endpoint, env_file, env="sleepy"))
    w.run([Episode("warm", {"prompt": "x"})])  # (the worker's start is not what is measured)
    start = time.monotonic()
    results = w.run([Episode(f"c-{i}", {"prompt": "x"}) for i in range(4)])
    took = time.monotonic() - start
    assert [r.reward for r in results] == [0.25] * 4
    assert took < 1.8, f"4 episodes of 0.5 s took {took:.2f} s: not concurrent"


# -- hostile envs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("raise", r"episode 'h': rollout 'hostile' raised KeyError: 'no such answer'"),
        ("string", r"episode 'h': rollout 'hostile' returned str '1.0', not a number or a dict"),
        ("nan", r"episode 'h': rollout 'hostile' returned float nan, not a number"),
        ("unknown_key", r"returned a dict with unknown keys 'score'"),
        ("bad_part", r"rewards\['a'\] = 'high': its score and weight must be finite numbers"),
        ("exit", r"the env worker exited with code 3 while running the episodes"),
    ],
)
def test_a_hostile_rollout_fails_its_tenant_and_the_next_submit_starts_a_new_worker(
    env_file, endpoint, workers, mode, match
):
    w = worker(workers, config(endpoint, env_file, env="hostile"))
    (r,) = w.run([Episode("first", {"mode": "ok"})])
    first = w.pid
    assert r.reward == 0.5
    with pytest.raises(EnvError, match=match):
        w.run([Episode("ok", {"mode": "ok"}), Episode("h", {"mode": mode})])
    assert w.pid is None and gone(first)
    (r,) = w.run([Episode("after", {"mode": "ok"})])
    assert r.reward == 0.5 and w.pid != first


def test_what_a_failed_env_started_is_killed_with_its_worker(env_file, endpoint, workers, tmp_path):
    w = worker(workers, config(endpoint, env_file, env="hostile"))
    pidfile = tmp_path / "daemon.pid"
    with pytest.raises(EnvError, match="raised RuntimeError: left a daemon behind"):
        w.run([Episode("d", {"mode": "detach", "pidfile": str(pidfile)})])
    daemon = int(pidfile.read_text())
    deadline = time.monotonic() + 5.0
    while not gone(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(daemon)


def test_an_answer_over_the_cap_fails_the_tenant(env_file, endpoint, workers, monkeypatch):
    import mlora_lab.agents.envs as envs

    w = worker(workers, config(endpoint, env_file, env="hostile"))
    assert w.run([Episode("small", {"mode": "ok"})])[0].reward == 0.5
    monkeypatch.setattr(envs, "ANSWER_CAP", 4096)  # (the job's side only: the worker keeps 64 MiB)
    with pytest.raises(
        EnvError, match=r"answer is over 4,096 bytes \(ANSWER_CAP\) while running the episodes"
    ):
        w.run([Episode("big", {"mode": "big"})])
    assert w.pid is None


def test_a_hanging_rollout_is_stopped_by_the_workers_limit_then_by_the_jobs_clock(
    env_file, endpoint, workers
):
    w = worker(workers, config(endpoint, env_file, env="hostile", rollout_timeout_s=1.0))
    w.run([Episode("warm", {"mode": "ok"})])
    start = time.monotonic()
    with pytest.raises(EnvError, match=r"episode 'h' took more than 1 s \(rollout_timeout_s\)"):
        w.run([Episode("h", {"mode": "hang"}), Episode("ok", {"mode": "ok"})])
    assert time.monotonic() - start < 1.0 + GRACE_S + 2.0
    assert w.run([Episode("after", {"mode": "ok"})])[0].reward == 0.5

    # (sync code inside an async def blocks the worker's loop: only the job's clock ends it)
    w2 = worker(workers, config(endpoint, env_file, env="blocking", rollout_timeout_s=1.0))
    w2.run([Episode("warm", {"mode": "ok"})])
    pid = w2.pid
    start = time.monotonic()
    w2.submit([Episode("b", {"mode": "block"})])
    assert w2.poll() is None  # (never blocks)
    with pytest.raises(
        EnvError,
        match=r"running the episodes took more than 1 s \(rollout_timeout_s\) \+ 2 s, by the job's clock",
    ):
        w2.wait(30.0)
    took = time.monotonic() - start
    assert 1.0 <= took < 1.0 + GRACE_S + 2.0
    assert gone(pid)
    assert w2.run([Episode("after", {"mode": "ok"})])[0].reward == 0.5


def test_an_env_that_cannot_be_loaded_is_named(env_file, endpoint, workers):
    w = worker(workers, config(endpoint, env_file, env="nothing_here"))
    with pytest.raises(EnvError, match=r"the env could not be loaded: .*has no 'nothing_here'"):
        w.run([Episode("t", {"prompt": "x"})])
    w = worker(workers, config(endpoint, env_file, tools=("add", "missing")))
    with pytest.raises(EnvError, match=r"tool '.*my_env.py:missing'"):
        w.run([Episode("t", {"prompt": "x"})])
    with pytest.raises(EnvError, match=r"env= .*or tools=") as e:
        EnvWorker(EnvConfig(None, [], {}, endpoint.url, KEY, "agent", 0, 1.0, -1.0))
    assert "max_turns" in str(e.value) and "rollout_timeout_s" in str(e.value)


def test_a_forged_answer_is_refused_with_every_problem_named():
    episodes = [Episode("a", {}), Episode("b", {})]
    good = {
        "trajectory_id": "a",
        "reward": 1.0,
        "parts": {},
        "metrics": {},
        "messages": None,
        "turns": 0,
        "stop": "returned",
    }
    assert (
        checked_results({"results": [good, good | {"trajectory_id": "b"}]}, episodes)[1].trajectory_id == "b"
    )
    with pytest.raises(ValueError, match="2 episodes"):
        checked_results({"results": [good]}, episodes)
    bad = good | {"trajectory_id": "b", "reward": "1", "parts": {"p": [1.0]}, "stop": "whatever", "x": 1}
    with pytest.raises(ValueError) as e:
        checked_results({"results": [good, bad]}, episodes)
    for what in ("its reward is '1'", "its parts", "its stop is 'whatever'", "unknown fields"):
        assert what in str(e.value)
