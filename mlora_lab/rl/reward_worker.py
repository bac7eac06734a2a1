"""The reward worker process (see :mod:`mlora_lab.rl.rewards`); never imported by the job itself.

    python -m mlora_lab.rl.reward_worker --key-fd=N --inspect REF...   one answer: each function's signature
                                                                     (or why it cannot be used), then exit
    python -m mlora_lab.rl.reward_worker --key-fd=N --serve REF...     import the functions, say {"ok": true}
                                                                     (or {"error": ...}), then answer one
                                                                     request line on stdin at a time until
                                                                     stdin closes

Requests are JSON lines on stdin. Answers are frames on the process's original stdout, each line sealed with
the parent's key (:func:`~mlora_lab.rl.rewards.seal`): the key comes on the descriptor ``--key-fd=N`` names,
read to its end and closed before any reward is imported, so no line a reward function writes there (by
accident, or copied off the channel) is taken for an answer. What the functions print goes to stderr
(stdout itself is redirected there). Before it imports or calls a
function the worker says which (``{"importing": ref}``, ``{"calling": ref}``), so whatever happens next (a
hang, a crash, ``os._exit``) is reported with the function's name and file.

The worker is a child subreaper (Linux): what a function starts, even a process that detaches with
``setsid()`` and double-forks, stays its descendant, and is killed with it: when it ends, and by the parent
(:meth:`~mlora_lab.rl.rewards.RewardWorker.close`). A watchdog thread ends it (and them) when its parent
dies, even while a function hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import importlib.util
import inspect
import itertools
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
import psutil

from mlora_lab.rl.rewards import KEY_FD, RewardRef, kill_tree, parse_reward, seal, shown_reward
from mlora_lab.sources import PICKLED_REWARD
from mlora_lab.text import brief, error_line


def load(text: str) -> Any:
    """The function a reward names (a pickled one, ``"file.pkl:name"``, unpickled); ``LookupError`` with the
    reason when it cannot be had."""
    ref = parse_reward(text)
    if isinstance(ref, str):
        raise LookupError(ref)
    if ref.target.endswith(PICKLED_REWARD):  # a notebook's function, pickled by value at launch
        try:
            import cloudpickle

            with open(ref.target, "rb") as f:
                fn = cloudpickle.load(f)
        except BaseException as e:  # (a function that needs a module the job's Python lacks, say)
            raise LookupError(
                f"reward {shown_reward(text)}: unpickling it raised {type(e).__name__}: {error_line(e)}"
            ) from None
        if not callable(fn):
            raise LookupError(f"reward {shown_reward(text)}: it is not a function ({type(fn).__name__})")
        return fn
    try:
        module = _module(ref)
    except LookupError:
        raise
    except BaseException as e:  # the user's module ran and raised (or called exit) while importing
        raise LookupError(
            f"reward {shown_reward(text)}: importing {brief(ref.target)} raised {type(e).__name__}: {error_line(e)}"
        ) from None
    fn = getattr(module, ref.function, None)
    if fn is None:
        raise LookupError(f"reward {shown_reward(text)}: {brief(ref.target)} has no {ref.function!r}")
    if not callable(fn):
        raise LookupError(
            f"reward {shown_reward(text)}: {ref.function!r} is not a function ({type(fn).__name__})"
        )
    return fn


def _module(ref: RewardRef) -> types.ModuleType:
    if not ref.is_file:
        if "" not in sys.path:
            sys.path.insert(0, "")  # a module in the launch directory, as the notebook would import it
        try:
            return importlib.import_module(ref.target)
        except ModuleNotFoundError as e:
            if e.name is not None and ref.target.startswith(e.name):
                raise LookupError(
                    f"reward {shown_reward(str(ref))}: no module named {brief(e.name)}"
                ) from None
            raise
    path = os.path.abspath(ref.target)
    if not os.path.isfile(path):
        raise LookupError(f"reward {shown_reward(str(ref))}: no file {brief(path)}")
    name = f"mlora_lab_reward_{abs(hash(path)):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LookupError(
            f"reward {shown_reward(str(ref))}: {brief(path)} cannot be imported as a Python file"
        )
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


def inspect_all(refs: list[str], say: Any = lambda message: None) -> list[Any]:
    out: list[Any] = []
    for text in refs:
        say({"importing": text})
        try:
            out.append(signature(text, load(text)))
        except LookupError as e:
            out.append(str(e))
    return out


JSON_SCALARS = (str, int, float, bool, type(None))


class Functions:
    """A tenant's reward functions, called as TRL calls them. ``say`` tells the parent which one is about to
    be imported or called."""

    def __init__(self, refs: list[str], say: Any = lambda message: None) -> None:
        self.refs, self.say = refs, say
        self.fns = []
        for r in refs:
            say({"importing": r})
            self.fns.append(load(r))
        self.sigs = [signature(r, f) for r, f in zip(refs, self.fns, strict=True)]

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        n = len(request["completions"])
        metrics: dict[str, list[float]] = defaultdict(list)
        extra: dict[str, list[Any]] = defaultdict(list)
        state = types.SimpleNamespace(**request.get("state", {}))

        def log_metric(name: Any, value: Any) -> None:
            """A number logged with the tenant's row (the mean over the functions' calls of a step)."""
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"log_metric({brief(name)}, ...) takes a finite number, got {brief(value)}")
            metrics[str(name)].append(float(value))

        def log_extra(column: Any, values: Any) -> None:
            """A column shown beside the tenant's sampled completions: one text or number per completion."""
            if not isinstance(values, list | tuple) or not all(isinstance(v, JSON_SCALARS) for v in values):
                raise TypeError(
                    f"log_extra({brief(column)}, ...) takes a list of texts or numbers (one per completion), "
                    f"got {brief(values)}"
                )
            if len(values) != n:
                raise TypeError(
                    f"log_extra({brief(column)}, ...) takes one value per completion ({n}), got {len(values)}"
                )
            extra[str(column)].extend(
                v if not isinstance(v, float) or math.isfinite(v) else None for v in values
            )

        everything = {
            "prompts": request["prompts"],
            "completions": request["completions"],
            "completion_ids": request["completion_ids"],
            **request.get("columns", {}),
            "trainer_state": state,
            "log_metric": log_metric,
            "log_extra": log_extra,
        }
        table = [[math.nan] * len(self.fns) for _ in range(n)]
        for f, (text, fn, sig) in enumerate(zip(self.refs, self.fns, self.sigs, strict=True)):
            kwargs = (
                everything
                if sig["var_keyword"]
                else {k: v for k, v in everything.items() if k in sig["accepts"]}
            )
            self.say({"calling": text})
            try:
                out = fn(**kwargs)
                if inspect.isawaitable(out):
                    out = asyncio.run(_awaited(out))
            except BaseException as e:  # SystemExit too: it is the function's failure, not the worker's
                raise RuntimeError(
                    f"reward {shown_reward(text)} raised {type(e).__name__}: {error_line(e)}"
                ) from None
            values = _rewards(text, out, n)
            for i, v in enumerate(values):
                table[i][f] = v
        for f, text in enumerate(self.refs):
            # (a reward that scores nothing would train on nothing in silence; an evaluation's metric may, its
            # scores then read as missing)
            if not request.get("scores_may_be_missing") and all(math.isnan(row[f]) for row in table):
                raise RuntimeError(
                    f"reward {shown_reward(text)} gave no reward (None or NaN) for any of the {n} completions"
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
        raise RuntimeError(
            f"reward {shown_reward(text)} returned {type(out).__name__}, not a list of numbers"
        )
    if len(out) != n:
        raise RuntimeError(
            f"reward {shown_reward(text)} returned {len(out)} rewards for {n} completions (one per completion)"
        )
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            try:
                x = float(v)
            except (OverflowError, ValueError):  # 10**400: no float holds it
                raise RuntimeError(
                    f"reward {shown_reward(text)} returned {brief(v)} for completion {i}, past what a float holds"
                ) from None
            if math.isinf(x):
                raise RuntimeError(f"reward {shown_reward(text)} returned {x} for completion {i}")
            values.append(x)
        else:
            raise RuntimeError(
                f"reward {shown_reward(text)} returned {brief(v)} for completion {i}, not a number or None"
            )
    return values


def _watch_parent() -> None:
    """End this process, and everything its functions started, when the job that started it is gone (even
    while a reward function hangs)."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            _leave(1)


def _leave(code: int) -> None:
    """Kill this process's descendants, then end it."""
    with contextlib.suppress(psutil.Error):
        kill_tree(os.getpid(), include_root=False)
    os._exit(code)


def become_subreaper() -> None:
    """Linux: descendants orphaned below this process (a ``setsid()`` daemon's double fork) become its
    children rather than init's, so :func:`~mlora_lab.rl.rewards.kill_tree` finds them."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def take_key(argv: list[str]) -> tuple[bytes, list[str]]:
    """The frames' key from the descriptor ``argv[0]`` names (``--key-fd=N``), read to its end and closed, and
    the other arguments. Called first: no reward is imported yet, and afterwards no descriptor holds the key."""
    if not argv or not argv[0].startswith(KEY_FD + "="):
        return b"", argv
    fd = int(argv[0].partition("=")[2])
    key = b""
    try:
        while chunk := os.read(fd, 4096):
            key += chunk
    finally:
        os.close(fd)
    return key, argv[1:]


def answer_channel(key: bytes) -> Any:
    """This process's stdout as the answer channel (frames sealed with ``key``, see the module docstring),
    and everything else printed (by the reward functions, or their modules when imported) sent to stderr."""
    answers = os.dup(1)  # (not inheritable: a process a function starts does not get it)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    counter = itertools.count(1)

    def say(message: Any) -> None:
        data = seal(key, next(counter), orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY))
        while data:
            data = data[os.write(answers, data) :]

    return say


def serve(refs: list[str], key: bytes) -> None:
    say = answer_channel(key)
    threading.Thread(target=_watch_parent, daemon=True).start()
    try:
        functions = Functions(refs, say)
    except LookupError as e:
        say({"error": str(e)})
        return
    say({"ok": True})
    for line in sys.stdin.buffer:
        try:
            answer = functions(orjson.loads(line))
        except Exception as e:
            say({"error": str(e)})
            continue
        try:
            say(answer)
        except (TypeError, ValueError) as e:  # (checked above: a bug if it happens)
            say({"error": f"the rewards' answer cannot be sent: {error_line(e)}"})


def main(argv: list[str]) -> int:
    key, argv = take_key(argv)
    become_subreaper()
    if len(argv) >= 1 and argv[0] == "--inspect":
        say = answer_channel(key)
        say(inspect_all(argv[1:], say))
        return 0
    if len(argv) >= 1 and argv[0] == "--serve":
        serve(argv[1:], key)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    _leave(code)  # (what the functions started does not outlive them)
