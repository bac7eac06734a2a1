"""The reward worker process (see :mod:`mlora_lab.rl.rewards`); never imported by the job itself.

    python -m mlora_lab.rl.reward_worker --inspect REF...   one JSON line: each function's signature
                                                          (or why it cannot be used), then exit
    python -m mlora_lab.rl.reward_worker --serve REF...     import the functions, say {"ok": true} (or
                                                          {"error": ...}), then answer one JSON line per
                                                          request line on stdin until stdin closes

Requests and answers are JSON lines on the process's original stdin/stdout. What the reward functions
print goes to stderr instead (stdout is the answer channel), and a watchdog thread ends the process
when its parent dies, even while a function hangs.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
import time
import types
from collections import defaultdict
from typing import Any

import orjson

from mlora_lab.rl.rewards import RewardRef, parse_reward
from mlora_lab.text import brief, error_line


def load(text: str) -> Any:
    """The function a reward names; ``LookupError`` with the reason when it cannot be had."""
    ref = parse_reward(text)
    if isinstance(ref, str):
        raise LookupError(ref)
    try:
        module = _module(ref)
    except LookupError:
        raise
    except BaseException as e:  # the user's module ran and raised (or called exit) while importing
        raise LookupError(
            f"reward {brief(text)}: importing {brief(ref.target)} raised {type(e).__name__}: {error_line(e)}"
        ) from None
    fn = getattr(module, ref.function, None)
    if fn is None:
        raise LookupError(f"reward {brief(text)}: {brief(ref.target)} has no {ref.function!r}")
    if not callable(fn):
        raise LookupError(f"reward {brief(text)}: {ref.function!r} is not a function ({type(fn).__name__})")
    return fn


def _module(ref: RewardRef) -> types.ModuleType:
    if not ref.is_file:
        if "" not in sys.path:
            sys.path.insert(0, "")  # a module in the launch directory, as the notebook would import it
        try:
            return importlib.import_module(ref.target)
        except ModuleNotFoundError as e:
            if e.name is not None and ref.target.startswith(e.name):
                raise LookupError(f"reward {brief(str(ref))}: no module named {brief(e.name)}") from None
            raise
    path = os.path.abspath(ref.target)
    if not os.path.isfile(path):
        raise LookupError(f"reward {brief(str(ref))}: no file {brief(path)}")
    name = f"mlora_lab_reward_{abs(hash(path)):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LookupError(f"reward {brief(str(ref))}: {brief(path)} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling in the user's file look themselves up here)
    sys.path.insert(0, os.path.dirname(path))  # its own imports of files beside it
    spec.loader.exec_module(module)
    return module


def signature(text: str, fn: Any) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: take it as accepting everything
        return {"ref": text, "accepts": [], "required": [], "var_keyword": True, "is_async": False}
    kinds = inspect.Parameter
    named = [p for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    return {
        "ref": text,
        "accepts": [p.name for p in named],
        "required": [p.name for p in named if p.default is kinds.empty],
        "var_keyword": any(p.kind is kinds.VAR_KEYWORD for p in params),
        "is_async": inspect.iscoroutinefunction(fn),
    }


def inspect_all(refs: list[str]) -> list[Any]:
    out: list[Any] = []
    for text in refs:
        try:
            out.append(signature(text, load(text)))
        except LookupError as e:
            out.append(str(e))
    return out


class Functions:
    """A tenant's reward functions, called as TRL calls them."""

    def __init__(self, refs: list[str]) -> None:
        self.refs = refs
        self.fns = [load(r) for r in refs]
        self.sigs = [signature(r, f) for r, f in zip(refs, self.fns, strict=True)]

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        n = len(request["completions"])
        metrics: dict[str, list[float]] = defaultdict(list)
        extra: dict[str, list[Any]] = defaultdict(list)
        state = types.SimpleNamespace(**request.get("state", {}))
        everything = {
            "prompts": request["prompts"],
            "completions": request["completions"],
            "completion_ids": request["completion_ids"],
            **request.get("columns", {}),
            "trainer_state": state,
            "log_metric": lambda name, value: metrics[str(name)].append(float(value)),
            "log_extra": lambda column, values: extra[str(column)].extend(values),
        }
        table = [[math.nan] * len(self.fns) for _ in range(n)]
        for f, (text, fn, sig) in enumerate(zip(self.refs, self.fns, self.sigs, strict=True)):
            kwargs = (
                everything
                if sig["var_keyword"]
                else {k: v for k, v in everything.items() if k in sig["accepts"]}
            )
            try:
                out = fn(**kwargs)
                if inspect.isawaitable(out):
                    out = asyncio.run(_awaited(out))
            except BaseException as e:  # SystemExit too: it is the function's failure, not the worker's
                raise RuntimeError(
                    f"reward {brief(text)} raised {type(e).__name__}: {error_line(e)}"
                ) from None
            values = _rewards(text, out, n)
            for i, v in enumerate(values):
                table[i][f] = v
        for f, text in enumerate(self.refs):
            if all(math.isnan(row[f]) for row in table):
                raise RuntimeError(
                    f"reward {brief(text)} gave no reward (None or NaN) for any of the {n} completions"
                )
        clean = [[None if math.isnan(v) else v for v in row] for row in table]
        return {
            "rewards": clean,
            "metrics": {k: sum(v) / len(v) for k, v in metrics.items() if v},
            "extra": extra,
        }


async def _awaited(out: Any) -> Any:
    return await out


def _rewards(text: str, out: Any, n: int) -> list[float]:
    """A function's answer as ``n`` floats (NaN for None), or ``RuntimeError`` saying what is wrong."""
    if hasattr(out, "tolist") and not isinstance(out, list | tuple):  # a numpy array or a tensor
        out = out.tolist()
    if not isinstance(out, list | tuple):
        raise RuntimeError(f"reward {brief(text)} returned {type(out).__name__}, not a list of numbers")
    if len(out) != n:
        raise RuntimeError(
            f"reward {brief(text)} returned {len(out)} rewards for {n} completions (one per completion)"
        )
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
        elif isinstance(v, numbers.Real):
            x = float(v)
            if math.isinf(x):
                raise RuntimeError(f"reward {brief(text)} returned {x} for completion {i}")
            values.append(x)
        else:
            raise RuntimeError(
                f"reward {brief(text)} returned {brief(v)} for completion {i}, not a number or None"
            )
    return values


def _watch_parent() -> None:
    """End this process when the job that started it is gone (even while a reward function hangs)."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def answer_channel() -> Any:
    """This process's stdout as the answer channel, and everything else printed (by the reward
    functions, or their modules when imported) sent to stderr."""
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(message: Any) -> None:
        answers.write(orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    return say


def serve(refs: list[str]) -> None:
    say = answer_channel()
    threading.Thread(target=_watch_parent, daemon=True).start()
    try:
        functions = Functions(refs)
    except LookupError as e:
        say({"error": str(e)})
        return
    say({"ok": True})
    for line in sys.stdin.buffer:
        try:
            say(functions(orjson.loads(line)))
        except Exception as e:
            say({"error": str(e)})


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "--inspect":
        answer_channel()(inspect_all(argv[1:]))
        return 0
    if len(argv) >= 1 and argv[0] == "--serve":
        serve(argv[1:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
