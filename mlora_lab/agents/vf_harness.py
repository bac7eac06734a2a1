"""verifiers 0.4 environments as agent tenants (issue 51): an in-process harness and the episode runner.

Imported only by the env worker of a tenant whose ``rl.env`` names a verifiers environment (it needs
``verifiers``, the ``agents`` extra); never by the job.

**The env.** ``rl.env = "verifiers:<taskset id>"`` is resolved as verifiers' own loader resolves ids:
``vf.resolve_env_config({"taskset": {"id": id, **env_args}, ...})`` then ``vf.load_environment(cfg)``
(``verifiers.v1.tasksets.<id>`` else the module ``<id>``, which exports exactly one ``Taskset``, and may export
an ``Env``). ``rl.env`` may also be a ``Taskset`` or ``Env`` object a notebook holds: pickled by value at
launch, rebuilt here from its class and config (:func:`load_vf_env`).

**The harness.** verifiers' built-in harnesses launch a program that ``uv`` installs from the package index,
which a loopback-only job cannot reach. :class:`InProcessHarness` (harness id :data:`HARNESS_ID`) runs the chat
and tool loop in the worker's own event loop instead (verifiers' ``Harness.launch`` contract allows it: every
model call still goes through the interception server, which commits each turn onto the trace). Every role of
the env plays with it, in the ``subprocess`` runtime (no container, no Prime sandbox); a role that pins another
harness or a remote runtime is refused, named. Tools are the taskset's MCP toolsets, which verifiers serves
from their module (``python -m <module>``), called with verifiers' own MCP client helpers.

**The trajectory id.** verifiers sends its trace id as ``X-Session-ID`` on every upstream request; the job's
endpoint needs the trajectory it registered. The harness puts ``X-Trajectory-Id: <trajectory id>`` (the
episode's, a :data:`TRAJECTORY` context variable the worker sets around ``run_episode``: asyncio tasks copy it)
on its own requests, and verifiers' eval client forwards a program's headers upstream (only localhost framing
and auth are dropped, ``clients/eval.py``); the endpoint reads ``X-Trajectory-Id`` before ``X-Session-ID``.
One shared client per endpoint config (verifiers keeps one per distinct config), no per-episode clients.

**The result.** ``reward = trace.reward = Σ score·weight`` over ``trace.rewards`` (the parts,
``name -> (score, weight)``), ``metrics = trace.metrics``, ``messages`` the trace's final branch.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import sys
import types
from contextlib import AsyncExitStack
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.configs.client import ClientTimeoutConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult, Runtime, SubprocessConfig

__all__ = ["InProcessHarness"]

HARNESS_ID = "mlora_lab_vf_harness"
"""The harness id verifiers' loader resolves to this module (an alias in ``sys.modules``: 0.4.0 looks a dotted
id up as ``verifiers.v1.harnesses.<id>`` first, whose missing parent package raises)."""
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
PREFIX = "verifiers:"
KEY_VAR = "MLORA_LAB_ENDPOINT_KEY"
"""The environment variable the worker puts the tenant's private key in (``EvalClientConfig.api_key_var``)."""
TRAJECTORY_HEADER = "X-Trajectory-Id"
TRAJECTORY: contextvars.ContextVar[str | None] = contextvars.ContextVar("mlora_trajectory", default=None)
"""The trajectory id of the episode the current asyncio task plays (``None`` outside an episode)."""
CONTEXT_STOP = "mlora_context"
"""``trace.info`` key the harness sets when the endpoint refused a turn because the context is full."""


class InProcessHarnessConfig(vf.HarnessConfig):
    """:class:`InProcessHarness`'s config (its id is :data:`HARNESS_ID`)."""

    id: str = HARNESS_ID


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    """The chat and tool loop of verifiers' ``null`` harness program, run in the worker's event loop.

    Turn ``u``: ``POST {endpoint}/chat/completions`` with the conversation and the MCP tools' schemas; the answer
    is appended; with no tool call the segment ends, else each call is run (an unknown tool, arguments that are
    not a JSON object: an ``error: ...`` tool message for the model to read, as the ``null`` program does) and
    the loop goes on. A refused turn ends the segment normally when verifiers' own limits refused it
    (``trace.stop_condition``: ``max_turns``, a ``@stop``) or the job's endpoint found the context full (HTTP 400
    naming the context); any other failure is a non-zero exit, which verifiers records as the trace's error."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to install: the loop is this module."""

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        import openai
        from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        tid = TRAJECTORY.get()
        async with (
            AsyncExitStack() as stack,
            openai.AsyncOpenAI(
                base_url=endpoint,
                api_key=secret,
                default_headers={TRAJECTORY_HEADER: tid} if tid else None,
                max_retries=0,
                timeout=None,  # (verifiers' client holds the read limit: turn_timeout_s)
            ) as client,
        ):
            servers = {
                "mcpServers": {
                    name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
                }
            }
            tools, dispatch, live = await connect_mcp(servers, stack) if mcp_urls else ([], {}, {})
            while True:
                try:
                    reply = await client.chat.completions.create(
                        model=ctx.model, messages=messages, **({"tools": tools} if tools else {})
                    )
                except openai.APIStatusError as e:
                    if trace.stop_condition is not None:
                        break  # (verifiers refused the turn: a limit or a @stop, the trace says which)
                    if e.status_code == 400 and "context" in str(e).lower():
                        trace.info[CONTEXT_STOP] = True
                        break
                    turn = 1 + sum(m.get("role") == "assistant" for m in messages)
                    return ProgramResult(1, "", f"turn {turn}: {type(e).__name__}: {e}")
                except openai.OpenAIError as e:
                    return ProgramResult(1, "", f"the model call failed: {type(e).__name__}: {e}")
                if not reply.choices:
                    return ProgramResult(1, "", "the endpoint answered with no choice")
                message = reply.choices[0].message
                said: dict[str, Any] = {"role": "assistant", "content": message.content}
                if message.tool_calls:  # (only what a chat message holds: no provider extras sent back)
                    said["tool_calls"] = [
                        c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls
                    ]
                messages.append(said)
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    name = call.function.name
                    try:
                        args = json.loads(call.function.arguments or "{}")
                    except json.JSONDecodeError as e:
                        content: Any = (
                            f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
                        )
                    else:
                        if not isinstance(args, dict):
                            content = (
                                f"error: tool arguments must be a JSON object, got {type(args).__name__}"
                            )
                        elif name in dispatch:
                            content = await call_mcp(live, dispatch, name, args)
                        else:
                            content = f"error: unknown tool {name!r}"
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "name": name, "content": content}
                    )
        return ProgramResult(0, "", "")


# -- the env ----------------------------------------------------------------------------------------
def _object_module(cls: type, base: type) -> str:
    """A module id verifiers' loader resolves to ``cls`` (a subclass of ``base``): ``cls``'s own module when it
    exports ``cls`` alone among ``base``'s subclasses, else a module made for it in ``sys.modules``."""
    module = sys.modules.get(cls.__module__)
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", ())] if module else []
    if (
        module is not None
        and "." not in module.__name__  # (see HARNESS_ID)
        and module.__name__ != "__main__"
        and [o for o in exported if isinstance(o, type) and issubclass(o, base) and o is not base] == [cls]
    ):
        return module.__name__
    name = f"mlora_lab_vf_{base.__name__.lower()}_{cls.__name__.lower()}_{id(cls):x}"
    made = types.ModuleType(name)
    made.__all__ = [cls.__name__]  # type: ignore[attr-defined]
    setattr(made, cls.__name__, cls)
    sys.modules[name] = made
    return name


def env_config_data(target: Any, env_args: dict[str, Any]) -> dict[str, Any]:
    """The verifiers env config (a dict ``resolve_env_config`` takes) of ``target``: a taskset id (a str), a
    ``Taskset`` or an ``Env`` object; ``env_args`` are the taskset config's fields. ``ValueError`` naming what
    is wrong."""
    if isinstance(target, str):
        if not target:
            raise ValueError(f"rl.env {PREFIX!r} names no taskset: write '{PREFIX}<taskset id>'")
        return {"taskset": {"id": target, **env_args}}
    if isinstance(target, vf.Taskset):
        data = target.config.model_dump()
        data.update(env_args, id=_object_module(type(target), vf.Taskset))
        return {"taskset": data}
    if isinstance(target, vf.Env):
        data = target.config.model_dump()
        taskset = dict(data["taskset"], **env_args)
        taskset["id"] = _object_module(type(target.taskset), vf.Taskset)
        data["taskset"] = taskset
        data["id"] = _object_module(type(target), vf.Env)
        return data
    raise ValueError(f"rl.env is a {type(target).__name__}, not a verifiers Taskset or Env")


def load_vf_env(
    target: Any, env_args: dict[str, Any], max_turns: int, turn_timeout_s: float, rollout_timeout_s: float
) -> vf.Env:
    """The env to run the tenant's episodes: ``target`` (see :func:`env_config_data`) with every role played by
    :class:`InProcessHarness` in the subprocess runtime (a tool call bounded by ``turn_timeout_s``), at most
    ``max_turns`` model turns per role, and the episode limit ``timeout.episode = rollout_timeout_s`` (verifiers
    leaves it unset). ``ValueError`` naming every role
    that pins another harness or a remote runtime."""
    data = env_config_data(target, env_args)
    cfg = vf.resolve_env_config(data)
    problems, updates = [], {}
    for role, spec in agent_config_fields(cfg).items():
        pinned = spec.harness.id if spec.harness is not None else None
        if pinned not in (None, HARNESS_ID):
            problems.append(
                f"role {role!r} pins harness {pinned!r}: a job runs verifiers envs with its in-process harness "
                f"({HARNESS_ID}) only"
            )
        explicit = "runtime" in spec.model_fields_set
        if explicit and not isinstance(spec.runtime, SubprocessConfig):
            problems.append(
                f"role {role!r} pins runtime {spec.runtime.type!r}: a job runs verifiers envs in the subprocess "
                "runtime only"
            )
        updates[role] = spec.model_copy(
            update={
                "harness": InProcessHarnessConfig(tool_timeout=float(turn_timeout_s)),
                "runtime": SubprocessConfig(),
                "max_turns": max_turns if spec.max_turns is None else min(spec.max_turns, max_turns),
            }
        )
    if problems:
        raise ValueError("; ".join(problems))
    timeout = cfg.timeout.model_copy(update={"episode": float(rollout_timeout_s)})
    cfg = cfg.model_copy(update={**updates, "timeout": timeout})
    return vf.load_environment(cfg)


# -- an episode ---------------------------------------------------------------------------------------
def task_of(env: vf.Env, example: dict[str, Any], tasks: list[vf.Task] | None) -> vf.Task:
    """The verifiers task an example (a row of the tenant's data) plays. A row ``{"task": i}`` (an ``int``: the
    taskset's ``i``-th task; a ``str``: the task of that ``id`` or ``name``) picks one of the taskset's own
    tasks; any other row *is* the task's data: its columns that are fields of the taskset's ``TaskData`` type
    (``prompt``, or ``messages`` as the prompt, ``answer``...), under the taskset's task config."""
    if "task" in example and set(example) <= {"task", "prompt", "messages"}:
        if tasks is None:
            raise ValueError("the taskset is unbounded: rows cannot pick its tasks by 'task'")
        key = example["task"]
        for t in tasks:
            if (isinstance(key, int) and t.data.idx == key) or (
                isinstance(key, str) and key in (t.data.id, t.data.name)
            ):
                return t
        raise ValueError(f"the taskset has no task {key!r} (it has {len(tasks)})")
    task_cls = env._task_cls
    data_cls = task_cls.data_type()
    row = dict(example)
    if "prompt" not in row and isinstance(row.get("messages"), list):
        row["prompt"] = row.pop("messages")
    fields = {k: v for k, v in row.items() if k in data_cls.model_fields}
    return task_cls(data_cls.model_validate(fields), env.taskset.config.task)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def episode_result(tid: str, episode: vf.Episode, rollout_timeout_s: float) -> dict[str, Any]:
    """An episode as a worker result (``reward``, ``parts``, ``metrics``, ``messages``, ``turns``, ``stop``), or
    ``RuntimeError`` naming why the episode failed (its errors, a timeout, more than one trace)."""
    if episode.is_timeout or any(t.is_timeout for t in episode.traces):
        raise RuntimeError(f"episode {tid!r} took more than {rollout_timeout_s:g} s (rollout_timeout_s)")
    errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
    if errors or not episode.ok:
        whys = [f"{e.type}: {e.message[:300]}" for e in errors] or ["not ok"]
        raise RuntimeError(f"episode {tid!r} failed in verifiers: {'; '.join(whys)}")
    if len(episode.traces) != 1:
        raise RuntimeError(
            f"episode {tid!r} has {len(episode.traces)} traces: a job trains one agent per episode"
        )
    trace = episode.traces[0]
    parts = {name: (float(r.score), float(r.weight)) for name, r in trace.rewards.items() if r is not None}
    bad = [n for n, (s, w) in parts.items() if not (_number(s) and _number(w))]
    bad += [n for n, v in trace.metrics.items() if v is not None and not _number(v)]
    if bad:
        raise RuntimeError(
            f"episode {tid!r}: rewards or metrics that are not finite numbers: {', '.join(bad)}"
        )
    metrics = {str(k): float(v) for k, v in trace.metrics.items() if v is not None}
    if trace.stop_condition == "max_turns":
        stop = "max_turns"
    elif trace.info.get(CONTEXT_STOP):
        stop = "context"
    elif trace.stop_condition in (None, "agent_completed"):
        stop = "answered"
    else:
        stop = "returned"  # (a @stop, a token cap, an env's own end: verifiers' name for it is a metric's)
        metrics[f"stop/{trace.stop_condition}"] = 1.0
    return {
        "reward": float(sum(s * w for s, w in parts.values())),
        "parts": parts,
        "metrics": metrics,
        "messages": [message_to_wire(m) for m in trace.messages],
        "turns": trace.num_turns,
        "stop": stop,
    }


class VerifiersEnv:
    """A tenant's verifiers env in the worker: loaded once, served (``env.serving()``: shared tool servers, the
    interception server) for the worker's life, and each episode run with ``Env.run_episode`` under a
    ``ModelContext`` of the job's endpoint (the tenant as the model, the private key through
    :data:`KEY_VAR`, ``turn_timeout_s`` as the HTTP read limit, log-probs asked for)."""

    def __init__(
        self,
        target: Any,
        env_args: dict[str, Any],
        base_url: str,
        api_key: str,
        model: str,
        max_turns: int,
        turn_timeout_s: float,
        rollout_timeout_s: float,
    ) -> None:
        self.env = load_vf_env(target, env_args, max_turns, turn_timeout_s, rollout_timeout_s)
        self.rollout_timeout_s = rollout_timeout_s
        os.environ[KEY_VAR] = api_key
        timeout = ClientTimeoutConfig(read=float(turn_timeout_s))
        self.ctx = vf.ModelContext(
            model=model,
            client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR, timeout=timeout),
            sampling=vf.SamplingConfig(logprobs=True),
        )
        self.tasks = list(self.env.taskset) if self.env.taskset.bounded else None
        self._serving: contextlib.AbstractAsyncContextManager | None = None

    async def start(self) -> None:
        """Enter ``env.serving()`` (once, in the worker's loop)."""
        if self._serving is None:
            self._serving = self.env.serving()
            await self._serving.__aenter__()

    async def run(self, tid: str, example: dict[str, Any]) -> dict[str, Any]:
        """One episode of trajectory ``tid`` (see :func:`task_of`, :func:`episode_result`)."""
        await self.start()
        task = task_of(self.env, example, self.tasks)
        token = TRAJECTORY.set(tid)
        try:
            episode = await self.env.run_episode(task, self.ctx)
        finally:
            TRAJECTORY.reset(token)
        return episode_result(tid, episode, self.rollout_timeout_s)
