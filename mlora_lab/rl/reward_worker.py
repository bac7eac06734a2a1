"""The reward worker process (see :mod:`mlora_lab.rl.rewards`); never imported by the job itself.

    python -m mlora_lab.rl.reward_worker --key-fd=N --inspect REF...   one answer: each function's signature
                                                                     (or why it cannot be used), then exit
    python -m mlora_lab.rl.reward_worker --key-fd=N --inspect --probe REF...   the same, then each function
                                                                     called once on the requests stdin holds
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
import functools
import importlib
import importlib.util
import inspect
import itertools
import math
import numbers
import os
import signal
import sys
import threading
import time
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import orjson
import psutil

from mlora_lab.rl.rewards import ENDPOINT_ENV, KEY_FD, RewardRef, kill_tree, parse_reward, seal, shown_reward
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


def inspect_all(refs: list[str], say: Any = lambda message: None) -> tuple[list[Any], list[Any]]:
    """Each reference's signature (or why it cannot be used), and its function (None when it cannot)."""
    found: list[Any] = []
    fns: list[Any] = []
    for text in refs:
        say({"importing": text})
        try:
            fn = load(text)
            found.append(signature(text, fn))
        except LookupError as e:
            fn = None
            found.append(str(e))
        fns.append(fn)
    return found, fns


def run_inspect(refs: list[str], say: Any, probe: dict[str, Any] | None) -> None:
    """``--inspect``: say the signatures; then, with ``probe`` (``{"requests": [[request, what], ...],
    "timeout_s": t}``), call each function once on each request (:meth:`Functions.probe`) and say
    ``{"probed": [[index, problem]]}`` for each that fails."""
    found, fns = inspect_all(refs, say)
    say(found)
    if probe is None:
        return
    usable = [i for i, fn in enumerate(fns) if fn is not None]
    functions = Functions([refs[i] for i in usable], say, [fns[i] for i in usable])
    for request, what in probe["requests"]:
        for j, why in functions.probe(request, str(what), float(probe["timeout_s"])):
            say({"probed": [[usable[j], why]]})


JSON_SCALARS = (str, int, float, bool, type(None))


class Functions:
    """A tenant's reward functions, called as TRL calls them. ``say`` tells the parent which one is about to
    be imported or called; ``fns``: the functions, already imported (else they are imported here)."""

    def __init__(
        self, refs: list[str], say: Any = lambda message: None, fns: list[Any] | None = None
    ) -> None:
        self.refs, self.say = refs, say
        if fns is None:
            fns = []
            for r in refs:
                say({"importing": r})
                fns.append(load(r))
        self.fns = fns
        self.sigs = [signature(r, f) for r, f in zip(refs, self.fns, strict=True)]

    def arguments(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list], dict[str, list]]:
        """Every argument a call of ``request`` may pass (TRL's), and the metrics and extra columns that its
        ``log_metric`` and ``log_extra`` fill."""
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
        return everything, metrics, extra

    def call(self, f: int, everything: dict[str, Any]) -> Any:
        """What function ``f`` returns, given the arguments it takes of ``everything`` (all of them with
        ``**kwargs``); it raises what the function raises."""
        text, fn, sig = self.refs[f], self.fns[f], self.sigs[f]
        kwargs = (
            everything if sig["var_keyword"] else {k: v for k, v in everything.items() if k in sig["accepts"]}
        )
        self.say({"calling": text})
        out = fn(**kwargs)
        return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        n = len(request["completions"])
        everything, metrics, extra = self.arguments(request)
        table = [[math.nan] * len(self.fns) for _ in range(n)]
        for f, text in enumerate(self.refs):
            try:
                out = self.call(f, everything)
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

    def probe(self, request: dict[str, Any], what: str, timeout_s: float) -> Iterator[tuple[int, str]]:
        """Each function called once on ``request`` (a row of the data with a sample completion, ``what``
        says which), one after the other: ``(its index, why its type does not fit the data's)`` for one that
        raised ``TypeError`` or ``AttributeError``, or returned no list of one number or None per completion
        (yielded at once: a later function may end the worker). A function the request cannot be
        given (it needs a column the row lacks: its signature says so), a callable object (an ``ml.Judge``
        asks a model), what it raises otherwise (the sample's text may be what it refuses) and a call past
        ``timeout_s`` are not judged."""
        n = len(request["completions"])
        everything, _, _ = self.arguments(request)
        for f, (text, fn, sig) in enumerate(zip(self.refs, self.fns, self.sigs, strict=True)):
            needs = {"prompts", "completions"} - (
                {*sig["accepts"]} if not sig["var_keyword"] else set(everything)
            )
            if needs or set(sig["required"]) - set(everything) or not _plain(fn):
                continue
            called = f"reward {shown_reward(text)}, called once on {what} with a sample completion,"
            try:
                with _time_limit(timeout_s):
                    got = self.call(f, everything)
            except (TypeError, AttributeError) as e:
                yield f, f"{called} raised {type(e).__name__}: {error_line(e)}{SHAPES}"
                continue
            except BaseException:  # (its own refusal of the sample's text, or the time limit)
                continue
            try:
                _rewards(text, got, n)
            except RuntimeError as e:  # ("reward 'fn' (file) returned ...": said once)
                yield f, f"{called} {error_line(e).removeprefix(f'reward {shown_reward(text)} ')}"


SHAPES = (
    " (a text prompt's completion is a text; a chat prompt's is a list of one message, "
    "[{'role': 'assistant', 'content': ...}], as TRL passes them)"
)
"""What a type mismatch found by :meth:`Functions.probe` is told about the completions' shapes."""


class _TimedOut(BaseException):
    """A probe call ran past its time (a ``BaseException``: a function's ``except Exception`` keeps it)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Any:
    """Raise :class:`_TimedOut` in this (the main) thread after ``seconds`` (a signal: it interrupts Python
    code and sleeps; the parent's clock is the last bound)."""

    def ring(signum: int, frame: Any) -> None:
        raise _TimedOut

    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _plain(fn: Any) -> bool:
    """A function (a ``def``, a lambda, a method, a builtin, a ``functools.partial`` of one), not a callable
    object such as ``ml.Judge``, whose call may ask a model that is not up before launch."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn)


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


def watch_parent() -> None:
    """End this process, and everything its functions started, when the job that started it is gone (even
    while a reward function hangs)."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            leave(1)


def leave(code: int) -> None:
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
    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        functions = Functions(refs, say)
    except LookupError as e:
        say({"error": str(e)})
        return
    # (a judge that asks the job it runs in: the job then answers its requests while it waits for the rewards)
    say({"ok": True, "asks_the_job": any(getattr(f, "asks_the_job", False) is True for f in functions.fns)})
    for line in sys.stdin.buffer:
        try:
            request = orjson.loads(line)
            endpoint = request.pop("endpoint", None) if isinstance(request, dict) else None
            if isinstance(endpoint, list) and len(endpoint) == 2:  # (the job's own, for its judges)
                os.environ[ENDPOINT_ENV[0]], os.environ[ENDPOINT_ENV[1]] = map(str, endpoint)
            answer = functions(request)
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
        probing = len(argv) >= 2 and argv[1] == "--probe"
        # (read before any reward is imported: a module that reads stdin cannot take it)
        probe = orjson.loads(sys.stdin.buffer.read()) if probing else None
        run_inspect(argv[2:] if probing else argv[1:], answer_channel(key), probe)
        return 0
    if len(argv) >= 1 and argv[0] == "--serve":
        serve(argv[1:], key)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    leave(code)  # (what the functions started does not outlive them)
