"""The env worker process (see :mod:`mlora_lab.agents.envs`); never imported by the job itself.

    python -m mlora_lab.agents.env_worker --key-fd=N

Its first stdin line is the tenant's :class:`~mlora_lab.agents.envs.EnvConfig` (JSON: the endpoint's private
key travels there, never on a command line). It imports the env function or the tools once, saying
``{"importing": ref}`` before each (so a hang or a crash while importing names it), then ``{"ok": true}`` or
``{"error": ...}``, then answers one request line ``{"episodes": [{"trajectory_id", "example"}, ...]}`` at a
time, until stdin closes, with ``{"results": [...]}`` (one per episode, in their order) or ``{"error": ...}``.
Every answer is a frame sealed with the parent's key, as the reward worker's
(:mod:`mlora_lab.rl.reward_worker`: the key is read off ``--key-fd`` and closed before any env code is imported;
what the env prints goes to stderr). It is a child subreaper, a watchdog thread ends it (and what the env
started) when its parent dies, and it kills its descendants when it ends.

A verifiers environment (``env`` is ``"verifiers:<taskset id>"``, or a pickled ``Taskset`` / ``Env``) is loaded
and served once, before ``{"ok": true}``, and each episode is its ``Env.run_episode`` with the in-process harness
(:mod:`mlora_lab.agents.vf_harness`).

The episodes of a request run concurrently in one asyncio loop, each under ``asyncio.wait_for(...,
rollout_timeout_s)``; a sync function runs in a thread of a pool the loop keeps for the worker's life (a hung
thread is never joined: the parent kills the worker after a failed batch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import math
import numbers
import os
import sys
import threading
import traceback
from typing import Any

import orjson

from mlora_lab.agents.envs import ANSWER_CAP, EnvConfig
from mlora_lab.rl.reward_worker import answer_channel, become_subreaper, leave, load, take_key, watch_parent
from mlora_lab.sources import PICKLED_REWARD, verifiers_object
from mlora_lab.text import brief, error_line

TRAJECTORY_HEADER = "X-Trajectory-Id"
ROLLOUT_KEYS = ("reward", "rewards", "metrics", "messages")


class EpisodeFailure(Exception):
    """An episode failed by the env's fault: the whole answer is an error with this message."""


def last_line(e: BaseException) -> str:
    """The last line of the exception's traceback: ``TypeError: what``, in at most 300 characters."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    line = text[-1] if text else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _number(v: Any) -> bool:
    """A real, finite number (a bool is not one)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(float(v))
    except (OverflowError, ValueError):
        return False


# -- rollout mode ---------------------------------------------------------------------------------
def rollout_result(tid: str, name: str, out: Any) -> dict[str, Any]:
    """A rollout function's return as a result (``reward``, ``parts``, ``metrics``, ``messages``, ``turns``,
    ``stop``), or :class:`EpisodeFailure` naming every way it is garbage."""
    where = f"episode {tid!r}: rollout {name!r} returned"
    if _number(out):
        return {
            "reward": float(out),
            "parts": {},
            "metrics": {},
            "messages": None,
            "turns": 0,
            "stop": "returned",
        }
    if not isinstance(out, dict):
        raise EpisodeFailure(
            f"{where} {type(out).__name__} {brief(out)}, not a number or a dict of {ROLLOUT_KEYS}"
        )
    problems = []
    unknown = [k for k in out if k not in ROLLOUT_KEYS]
    if unknown:
        problems.append(
            f"unknown keys {', '.join(map(brief, unknown))} (it may return {', '.join(ROLLOUT_KEYS)})"
        )
    parts: dict[str, tuple[float, float]] = {}
    rewards = out.get("rewards", {})
    if not isinstance(rewards, dict):
        problems.append(f"rewards {brief(rewards)}, not a dict name -> score or {{'score', 'weight'}}")
        rewards = {}
    for k, v in rewards.items():
        score, weight = (v.get("score"), v.get("weight", 1.0)) if isinstance(v, dict) else (v, 1.0)
        if not isinstance(k, str) or (isinstance(v, dict) and set(v) - {"score", "weight"}):
            problems.append(f"rewards[{brief(k)}] = {brief(v)}, not a named score or {{'score', 'weight'}}")
        elif not _number(score) or not _number(weight):
            problems.append(f"rewards[{brief(k)}] = {brief(v)}: its score and weight must be finite numbers")
        else:
            parts[k] = (float(score), float(weight))
    metrics = out.get("metrics", {})
    if not isinstance(metrics, dict):
        problems.append(f"metrics {brief(metrics)}, not a dict name -> number")
        metrics = {}
    bad = [k for k, v in metrics.items() if not isinstance(k, str) or not _number(v)]
    if bad:
        problems.append(
            f"metrics that are not finite numbers: {', '.join(brief(k) + '=' + brief(metrics[k]) for k in bad)}"
        )
    messages = out.get("messages")
    if messages is not None and not (
        isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
    ):
        problems.append(f"messages {brief(messages)}, not a list of message dicts")
    if "reward" in out:
        reward = out["reward"]
        if reward is not None and not _number(reward):
            problems.append(f"reward {type(reward).__name__} {brief(reward)}, not a finite number or None")
    elif "rewards" in out:
        reward = sum(s * w for s, w in parts.values())
    else:
        problems.append("no 'reward' and no 'rewards'")
        reward = None
    if problems:
        raise EpisodeFailure(f"{where} a dict with {'; '.join(problems)}")
    try:
        orjson.dumps(messages)
    except orjson.JSONEncodeError as e:
        raise EpisodeFailure(f"{where} messages that are not JSON: {error_line(e)}") from None
    turns = sum(1 for m in messages or () if m.get("role") == "assistant")
    return {
        "reward": None if reward is None else float(reward),
        "parts": parts,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "messages": messages,
        "turns": turns,
        "stop": "returned",
    }


async def run_rollout(config: EnvConfig, fn: Any, tid: str, example: dict[str, Any]) -> dict[str, Any]:
    """One episode of a rollout function: called with a client whose every request names the trajectory."""
    import openai

    name = getattr(fn, "__name__", type(fn).__name__)
    args = {
        "base_url": config.base_url,
        "api_key": config.api_key,
        "default_headers": {TRAJECTORY_HEADER: tid},
        "max_retries": 0,
        "timeout": config.turn_timeout_s,
    }
    try:
        if inspect.iscoroutinefunction(fn):
            async with openai.AsyncOpenAI(**args) as client:
                out = await fn(client, config.model, example, **config.env_args)
        else:
            with openai.OpenAI(**args) as client:
                out = await asyncio.to_thread(fn, client, config.model, example, **config.env_args)
                if inspect.isawaitable(out):
                    out = await out
    except (asyncio.CancelledError, EpisodeFailure):
        raise
    except BaseException as e:  # SystemExit too: the env's failure, not the worker's
        raise EpisodeFailure(f"episode {tid!r}: rollout {name!r} raised {last_line(e)}") from None
    return rollout_result(tid, name, out)


# -- tools mode -----------------------------------------------------------------------------------
class Tools:
    """A tenant's tools: each function by its name, and its JSON schema (``transformers``'
    ``get_json_schema``, as TRL builds ``tools=``)."""

    def __init__(self, refs: list[str], say: Any) -> None:
        from transformers.utils import get_json_schema

        self.fns: dict[str, Any] = {}
        self.schemas: list[dict[str, Any]] = []
        problems = []
        for ref in refs:
            say({"importing": ref})
            try:
                fn = load(ref)
            except LookupError as e:
                problems.append(f"tool {ref!r}: {str(e).removeprefix('reward ')}")
                continue
            try:
                schema = get_json_schema(fn)
            except Exception as e:
                problems.append(
                    f"tool {ref!r} has no JSON schema (a Google docstring with Args: for each argument): {error_line(e)}"
                )
                continue
            name = schema["function"]["name"]
            if name in self.fns:
                problems.append(f"two tools are named {name!r}")
                continue
            self.fns[name] = fn
            self.schemas.append(schema)
        if problems:
            raise LookupError("; ".join(problems))

    async def call(self, config: EnvConfig, tid: str, call: dict[str, Any]) -> str:
        """A tool call's result as the tool message's content. The model's mistakes (an unknown tool,
        arguments that are not a JSON object or do not bind, a tool that raises) are ``{"error": ...}``
        for it to read; a tool that hangs past ``turn_timeout_s`` or floods is :class:`EpisodeFailure`."""
        name = call["function"]["name"]
        fn = self.fns.get(name)
        if fn is None:
            return json.dumps({"error": f"Tool {name} not found."})
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except (TypeError, ValueError) as e:
            return json.dumps({"error": f"the arguments of {name} are not JSON: {error_line(e)}"})
        if not isinstance(args, dict):
            return json.dumps({"error": f"the arguments of {name} are not a JSON object: {brief(args)}"})
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            return json.dumps({"error": f"{name}: {error_line(e)}"})
        except ValueError:  # (no signature: the call says)
            pass
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(**args), config.turn_timeout_s)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(fn, **args), config.turn_timeout_s)
                if inspect.isawaitable(result):
                    result = await asyncio.wait_for(result, config.turn_timeout_s)
        except TimeoutError:
            raise EpisodeFailure(
                f"episode {tid!r}: tool {name!r} took more than {config.turn_timeout_s:g} s (turn_timeout_s)"
            ) from None
        except Exception as e:  # (the model's arguments made it fail: fed back, as TRL does)
            return json.dumps({"error": error_line(e)})
        except BaseException as e:  # (SystemExit, KeyboardInterrupt: not the model's doing)
            raise EpisodeFailure(f"episode {tid!r}: tool {name!r} raised {last_line(e)}") from None
        content = result if isinstance(result, str) else json.dumps(result, default=str)
        if len(content) > config.max_tool_output_chars:
            raise EpisodeFailure(
                f"episode {tid!r}: tool {name!r} returned {len(content):,} characters, over "
                f"max_tool_output_chars ({config.max_tool_output_chars:,})"
            )
        return content


def first_messages(tid: str, example: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation an episode starts from: the row's ``messages``, or its ``prompt`` as a user turn."""
    if isinstance(example.get("messages"), list):
        return [dict(m) for m in example["messages"]]
    if isinstance(example.get("prompt"), str):
        return [{"role": "user", "content": example["prompt"]}]
    raise EpisodeFailure(
        f"episode {tid!r}: its example has no 'prompt' text and no 'messages' list "
        f"(its columns: {', '.join(map(brief, example)) or 'none'})"
    )


async def run_tools(config: EnvConfig, tools: Tools, tid: str, example: dict[str, Any]) -> dict[str, Any]:
    """One episode of the tool loop (TRL 1.16's ``_tool_call_loop`` over HTTP, see the module docstring)."""
    import openai

    messages = first_messages(tid, example)
    calls = failures = turns = 0
    stop = "max_turns"
    async with openai.AsyncOpenAI(
        base_url=config.base_url,
        api_key=config.api_key,
        default_headers={TRAJECTORY_HEADER: tid},
        max_retries=0,
        timeout=config.turn_timeout_s,
    ) as client:
        while turns < config.max_turns:
            try:
                reply = await client.chat.completions.create(
                    model=config.model, messages=messages, tools=tools.schemas
                )
            except openai.BadRequestError as e:
                if "context" in str(e).lower():
                    stop = "context"
                    break
                raise EpisodeFailure(
                    f"episode {tid!r}: the endpoint refused turn {turns + 1}: {error_line(e)}"
                ) from None
            except openai.OpenAIError as e:
                raise EpisodeFailure(
                    f"episode {tid!r}: the endpoint failed turn {turns + 1}: {type(e).__name__}: {error_line(e)}"
                ) from None
            turns += 1
            if not reply.choices:
                raise EpisodeFailure(f"episode {tid!r}: the endpoint answered turn {turns} with no choice")
            message = reply.choices[0].message
            assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
            tool_calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in message.tool_calls or ()
                if getattr(c, "function", None) is not None
            ]
            if tool_calls:
                assistant["tool_calls"] = tool_calls
            messages.append(assistant)
            if not tool_calls:
                stop = "answered"
                break
            for call in tool_calls:
                calls += 1
                content = await tools.call(config, tid, call)
                failures += content.startswith('{"error": ')
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": call["function"]["name"],
                        "content": content,
                    }
                )
    return {
        "reward": None,
        "parts": {},
        "metrics": {"tool_calls": float(calls), "tool_failures": float(failures)},
        "messages": messages,
        "turns": turns,
        "stop": stop,
    }


# -- verifiers mode ---------------------------------------------------------------------------------
VERIFIERS_PREFIX = "verifiers:"


def verifiers_target(env: str) -> Any:
    """What ``env`` names if it is a verifiers environment: the taskset id of ``"verifiers:<id>"``, or the
    ``Taskset`` / ``Env`` object a pickled ``"<...>.pkl:name"`` holds; ``None`` for a rollout function."""
    if env.startswith(VERIFIERS_PREFIX):
        return env.removeprefix(VERIFIERS_PREFIX)
    target, _, _ = env.rpartition(":")
    if not target.endswith(PICKLED_REWARD):
        return None
    try:
        import cloudpickle

        with open(target, "rb") as f:
            obj = cloudpickle.load(f)
    except BaseException:  # (``load`` unpickles it again and names the failure)
        return None
    return obj if verifiers_object(obj) else None


def load_verifiers(config: EnvConfig, target: Any, loop: asyncio.AbstractEventLoop) -> Any:
    """The episode runner of a verifiers env (:mod:`mlora_lab.agents.vf_harness`), loaded and serving (its
    shared tool servers and interception server up, in ``loop``) before the worker says it is ready, so the
    parent's start limit bounds a tool server that never comes up. ``LookupError`` naming what failed."""
    try:
        from mlora_lab.agents.vf_harness import VerifiersEnv
    except ImportError as e:
        raise LookupError(
            f"env {config.env!r} is a verifiers environment and verifiers cannot be imported "
            f"({error_line(e)}): pip install 'mlora_lab[agents]'"
        ) from None
    # (verifiers starts a taskset's tool servers as `python -m <module>`: the launch directory's modules
    # import there as they do here)
    paths = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        env = VerifiersEnv(
            target,
            config.env_args,
            base_url=config.base_url,
            api_key=config.api_key,
            model=config.model,
            max_turns=config.max_turns,
            turn_timeout_s=config.turn_timeout_s,
            rollout_timeout_s=config.rollout_timeout_s,
        )
        loop.run_until_complete(env.start())
    except Exception as e:
        raise LookupError(f"env {config.env!r}: loading it in verifiers raised {last_line(e)}") from None

    async def run(tid: str, example: dict[str, Any]) -> dict[str, Any]:
        try:
            return await env.run(tid, example)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise EpisodeFailure(
                str(e) if isinstance(e, RuntimeError) else f"episode {tid!r}: {last_line(e)}"
            ) from None

    return run


def loaded_environment(config: EnvConfig, fn: Any) -> Any:
    """``None`` when ``fn`` is a rollout function (``rollout(client, model, example, **env_args)``); the verifiers
    environment when it is a loader, as verifiers' environment modules export one (``load_environment(**env_args)
    -> Env``: called here, once); ``LookupError`` naming the env when it is neither."""
    try:
        signature = inspect.signature(fn)
    except ValueError:  # (no signature to check: called as a rollout, which says)
        return None
    try:
        signature.bind(None, None, None, **config.env_args)
        return None
    except TypeError as e:
        rollout_error = error_line(e)
    try:
        signature.bind(**config.env_args)
    except TypeError:
        raise LookupError(
            f"env {config.env!r} cannot be called as rollout(client, model, example"
            f"{''.join(', ' + k + '=...' for k in config.env_args)}): {rollout_error}"
        ) from None
    made = fn(**config.env_args)
    if not verifiers_object(made):
        raise LookupError(
            f"env {config.env!r} is neither rollout(client, model, example, ...) nor a loader of a verifiers "
            f"environment: called with env_args it returned {brief(made)}, not a verifiers Env or Taskset"
        )
    return made


# -- a request --------------------------------------------------------------------------------------
async def run_batch(
    config: EnvConfig, run: Any, episodes: list[dict[str, Any]], ended: Any = lambda tid: None
) -> dict[str, Any]:
    """Every episode at once, each within ``rollout_timeout_s``: ``{"results": [...]}``, or ``{"error": ...}``
    naming every episode that failed (the others are cancelled at the first failure). ``ended(tid)`` as each
    episode ends (the parent's endpoint then waits for its turns no more)."""
    limit = config.rollout_timeout_s

    async def one(ep: dict[str, Any]) -> dict[str, Any]:
        tid = ep["trajectory_id"]
        try:
            out = await asyncio.wait_for(run(tid, ep["example"]), limit)
        except TimeoutError:
            raise EpisodeFailure(f"episode {tid!r} took more than {limit:g} s (rollout_timeout_s)") from None
        finally:
            ended(tid)
        return {"trajectory_id": tid, **out}

    tasks = [asyncio.ensure_future(one(ep)) for ep in episodes]
    if not tasks:
        return {"results": []}
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    failed = [t.exception() for t in tasks if t in done and t.exception() is not None]
    if failed:
        whys = [
            str(e) if isinstance(e, EpisodeFailure) else f"the env worker failed: {last_line(e)}"
            for e in failed
        ]
        return {"error": "; ".join(whys)}
    return {"results": [t.result() for t in tasks]}


def serve(key: bytes) -> None:
    say = answer_channel(key)
    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        config = EnvConfig(**orjson.loads(sys.stdin.buffer.readline()))
    except (TypeError, ValueError) as e:
        say({"error": f"the env worker's config is malformed: {error_line(e)}"})
        return
    problems = config.problems()
    if problems:
        say({"error": "; ".join(problems)})
        return
    try:
        import openai  # noqa: F401  (once, before the first episode's clock runs)
    except ImportError:
        say(
            {
                "error": "an env worker calls the job through the openai client: pip install 'mlora_lab[openai]'"
            }
        )
        return
    loop = asyncio.new_event_loop()
    try:
        vf_target = verifiers_target(config.env) if config.env is not None else None
        if vf_target is not None:
            say({"importing": config.env})
            run = load_verifiers(config, vf_target, loop)
        elif config.env is not None:
            say({"importing": config.env})
            fn = load(config.env)
            if not callable(fn):
                raise LookupError(f"env {config.env!r} is not a function")
            loaded = loaded_environment(config, fn)
            if loaded is not None:  # (verifiers' convention: load_environment(**env_args) -> an Env)
                run = load_verifiers(dataclasses.replace(config, env_args={}), loaded, loop)
            else:

                def run(tid: str, example: dict[str, Any]) -> Any:
                    return run_rollout(config, fn, tid, example)

        else:
            tools = Tools(config.tools, say)

            def run(tid: str, example: dict[str, Any]) -> Any:
                return run_tools(config, tools, tid, example)

    except LookupError as e:
        say({"error": str(e).removeprefix("reward ")})
        return
    except BaseException as e:  # (an import that raised something else, or called exit)
        say({"error": f"loading the env raised {last_line(e)}"})
        return
    say({"ok": True})
    # (many episodes in sync code at once; threads of a hung one are never joined: the parent kills us)
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=256))
    for line in sys.stdin.buffer:
        try:
            request = orjson.loads(line)
            answer = loop.run_until_complete(
                run_batch(config, run, request["episodes"], lambda tid: say({"ended": tid}))
            )
        except Exception as e:
            answer = {"error": f"the env worker failed: {last_line(e)}"}
        try:
            body = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
        except (TypeError, orjson.JSONEncodeError) as e:
            answer = {"error": f"the episodes' results cannot be sent: {error_line(e)}"}
        else:
            if len(body) > ANSWER_CAP - 200:
                answer = {
                    "error": f"the episodes' results take {len(body):,} bytes, over the {ANSWER_CAP >> 20} MiB cap"
                }
        say(answer)


def main(argv: list[str]) -> int:
    key, argv = take_key(argv)
    become_subreaper()
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    serve(key)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    leave(code)
