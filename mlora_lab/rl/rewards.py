"""Reward functions of RL tenants: TRL's signature, run in a worker process with a timeout.

A reward function is written as for TRL's ``GRPOTrainer`` (matched: TRL 1.16.0,
``GRPOTrainer._calculate_rewards``), so one written for TRL works here unchanged::

    def short_answer(prompts, completions, completion_ids, **kwargs) -> list[float | None]:
        return [-len(c) / 100 for c in completions]

It is named ``"module:function"`` (an importable module, e.g. ``"trl.rewards:think_format_reward"``) or
``"path/to/file.py:function"`` (a file; a relative path is taken from where the job is launched and
made absolute in the spec), or given as the function itself (a notebook's ``def``, a lambda, a closure),
which a launch pickles by value into the run (:class:`~mlora_lab.sources.RewardSnapshot`) and names
``"<run>/rewards/<tenant>/<i>-<name>.pkl:<name>"``. It is called, as TRL calls it, with keyword arguments
only:

=================  ===============================================================================
``prompts``        one per completion (a prompt repeated ``group_size`` times): the row's ``prompt``
                   text, or its ``messages`` (a list of ``{"role", "content"}``) for a chat row
``completions``    the generated text; for a chat row ``[{"role": "assistant", "content": text}]``
``completion_ids`` the generated token ids (lists of ints)
every other column of the tenant's data rows, one value per completion (``answer=[...]``)
``trainer_state``  an object with ``global_step`` (the tenant's step) and ``max_steps``
``log_metric``     ``log_metric(name, value)``: a number logged with the tenant's row
``log_extra``      ``log_extra(column, values)``: a column shown with the tenant's sampled completions
=================  ===============================================================================

A function without ``**kwargs`` gets only the arguments it names (TRL would pass them all and fail);
one that names an argument no row has is refused before launch. It returns one number per completion;
``None`` (or NaN) means "no reward for this one" (several functions are then summed over the others,
as TRL's ``nansum``). An ``async def`` function is awaited.

**Isolation.** The functions of a tenant run in their own worker process
(``python -m mlora_lab.rl.reward_worker``), which imports them once and then answers one request per
step. So a reward that raises, hangs (past ``timeout_s`` the worker and everything it started are killed,
and a new one is started for the next call), crashes the interpreter, prints to stdout, writes into the
answer channel, closes its descriptors, detaches processes (``setsid()``), or returns the wrong count, a
non-number or no reward at all, fails **only that tenant's call**, with the reason and the function's name
and file (:class:`RewardError`); the job goes on. The parent keeps ``timeout_s`` by its own clock, whatever
the worker does to its pipes. An answer is a frame sealed with a key only the worker holds (:func:`seal`: an
HMAC of a counter and the answer): the key comes on a pipe the worker inherits, reads and closes before it
imports a function, so it is in no environment (``/proc/self/environ`` keeps the one a process started with),
command line or descriptor a reward can read, and a frame read off the channel (``/proc/self/fd``) gives
nothing to forge another with. Anything else on the channel is a malformed answer, a fault of that tenant.
A reward runs in the worker's interpreter, so one that digs the key out of its memory can still seal an
answer: every answer's shape is checked (:func:`checked_answer`), and what it forges fails or misleads only
its own tenant. The worker ends, and kills what its functions started, when its pipe closes or its parent
dies.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import psutil

from mlora_lab.text import brief, error_line, is_finite

STANDARD_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
"""What every call may pass besides the data's columns (TRL 1.16 passes all of these)."""
REQUIRED_ARGS = ("prompts", "completions")
"""What a reward function must accept (by name, or through ``**kwargs``)."""
ENDPOINT_ENV = ("MLORA_OPENAI_BASE_URL", "MLORA_OPENAI_API_KEY")
"""Where a reward worker's judges find the job's own OpenAI endpoint and a key: a served job sets them in its
environment for the processes it starts, and an RL job sends its agents' endpoint with each request of a worker
whose functions ask the job (``RewardBatch.endpoint``)."""
WORKER_MODULE = "mlora_lab.rl.reward_worker"
START_TIMEOUT_S = 60.0
"""How long importing a tenant's reward functions in a new worker may take."""
KEY_FD = "--key-fd"
"""The worker's first argument, ``--key-fd=N``: the descriptor it reads its frames' key from (then closes)."""
PROBE_TIMEOUT_S = 10.0
"""How long one call of a reward function on a sample row may take at validation (a slower one is not
judged: :func:`inspect_rewards`)."""
EXIT_GRACE_S = 2.0
"""How long a worker that closed its answer channel may take to exit before it is killed."""


def seal(key: bytes, counter: int, body: bytes) -> bytes:
    """One answer frame of a worker: ``<counter> <HMAC-SHA256(key, counter, body) in hex> <body>\\n``. The
    counter grows with every frame, so a frame copied off the channel cannot be sent again either."""
    mac = hmac.new(key, counter.to_bytes(8, "little") + body, hashlib.sha256).hexdigest()
    return b"%d %s %s\n" % (counter, mac.encode(), body)


class Frames:
    """The parent's side of a worker's frames (:func:`seal`): :meth:`open` gives a line's message, or
    ``ValueError`` when the line is not a frame of this worker (another key, a counter not past the last
    one's, not JSON)."""

    def __init__(self, key: bytes) -> None:
        self._key, self._last = key, 0

    def open(self, line: bytes) -> Any:
        head, _, rest = line.partition(b" ")
        mac, _, body = rest.partition(b" ")
        if not head.isdigit() or len(head) > 19:
            raise ValueError("no frame")
        counter = int(head)
        want = hmac.new(self._key, counter.to_bytes(8, "little") + body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, want.encode()):
            raise ValueError("not sealed with this worker's key")
        if counter <= self._last:
            raise ValueError("a frame sent again")
        self._last = counter
        return orjson.loads(body)  # (a JSONDecodeError is a ValueError)


def spawn(
    args: list[str], cwd: str | os.PathLike | None, module: str = "", **popen: Any
) -> tuple[subprocess.Popen, Frames]:
    """Start a worker (``python -m mlora_lab.rl.reward_worker ARGS``, or another ``module``: an agent's env
    worker) in its own session, its frames' key on a pipe it inherits (``--key-fd``): the key is never in its
    environment nor on its command line."""
    key = secrets.token_hex(32).encode()
    r, w = os.pipe()
    try:
        os.write(w, key)  # (64 bytes: a pipe holds them; the worker reads to the end, this side closed)
    finally:
        os.close(w)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module or WORKER_MODULE, f"{KEY_FD}={r}", *args],
            cwd=cwd,
            pass_fds=(r,),
            start_new_session=True,  # its own process group: a timeout kills what the function started too
            **popen,
        )
    finally:
        os.close(r)
    return proc, Frames(key)


def checked_answer(
    answer: dict[str, Any], n: int, f: int
) -> tuple[list[list[float]], dict[str, float], dict[str, list[Any]]]:
    """A worker's answer to ``n`` completions scored by ``f`` functions, as ``(rewards [n][f] (NaN: none),
    metrics, extra columns)``, every part's shape checked: ``ValueError`` saying what is wrong. The worker
    makes answers of this shape; one that is not is forged (or a bug), and must fail its own tenant's call,
    never reach the job as a ragged table."""
    rewards = answer.get("rewards")
    if not isinstance(rewards, list):
        raise ValueError(f"its rewards are not a list ({brief(rewards)})")
    if len(rewards) != n:
        raise ValueError(f"it answered {len(rewards)} rows of rewards for {n} completions")
    table = []
    for i, row in enumerate(rewards):
        if not isinstance(row, list):
            raise ValueError(f"row {i} is not a list ({brief(row)})")
        if len(row) != f:
            raise ValueError(f"row {i} has {len(row)} rewards for {f} reward function(s)")
        bad = next((v for v in row if v is not None and not is_finite(v)), None)
        if bad is not None:
            raise ValueError(f"row {i} holds {brief(bad)}, not a number or null")
        table.append([math.nan if v is None else float(v) for v in row])
    metrics, extra = answer.get("metrics", {}), answer.get("extra", {})
    if not isinstance(metrics, dict) or not isinstance(extra, dict):
        raise ValueError("its metrics or extra columns are not objects")
    for k, v in metrics.items():
        if not is_finite(v):
            raise ValueError(f"metric {brief(k)} is {brief(v)}, not a finite number")
    for k, v in extra.items():
        scalars = isinstance(v, list) and all(isinstance(x, str | int | float | type(None)) for x in v)
        if not scalars or len(v) != n:
            raise ValueError(f"extra column {brief(k)} is not {n} texts or numbers ({brief(v)})")
    return table, {str(k): float(v) for k, v in metrics.items()}, {str(k): list(v) for k, v in extra.items()}


def kill_tree(pid: int, include_root: bool = True) -> None:
    """SIGKILL every descendant of ``pid`` (and ``pid`` itself with ``include_root``): listed again until none
    is left, so that one forking meanwhile is caught too (a reward worker is a child subreaper: a detached
    grandchild stays its descendant while it lives)."""
    for _ in range(20):
        try:
            found = [p for p in psutil.Process(pid).children(recursive=True) if _alive(p)]
        except psutil.Error:
            found = []
        if not found:
            break
        for p in found:
            with contextlib.suppress(psutil.Error):
                p.kill()
        time.sleep(0.02)  # (a killed one is a zombie until its parent reaps it: not alive, not listed again)
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class RewardError(RuntimeError):
    """A reward call failed: the tenant it serves is quarantined with this message; others go on."""


@dataclass(frozen=True)
class RewardRef:
    """``"module:function"`` or ``"path/to/file.py:function"``, split."""

    target: str
    function: str

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py") or "/" in self.target or os.sep in self.target

    def __str__(self) -> str:
        return f"{self.target}:{self.function}"


def parse_reward(text: Any) -> RewardRef | str:
    """The :class:`RewardRef` of ``text``, or why it is not one."""
    if not isinstance(text, str):
        return f"a reward must be a string 'module:function' or 'file.py:function' ({brief(text)})"
    target, sep, function = text.rpartition(":")
    if not sep or not target or not function:
        return f"reward {brief(text)} is not 'module:function' or 'path/to/file.py:function'"
    if not function.isidentifier():
        return f"reward {brief(text)}: {brief(function)} is not a function name"
    ref = RewardRef(target, function)
    if not ref.is_file and not all(part.isidentifier() for part in target.split(".")):
        return f"reward {brief(text)}: {brief(target)} is neither a module name nor a .py file"
    return ref


def reward_names(rewards: Sequence[Any], given: Sequence[str] | None = None) -> list[str]:
    """The name each reward function's columns carry (``rewards/<name>/mean``): ``given`` (``RL.reward_names``)
    when there are names, else each function's name (a reference's, or a function's ``__name__``), ``name#2``
    for a second of one name, and ``<lambda #k>`` for the k-th lambda (every lambda is ``<lambda>``)."""
    if given is not None:
        return list(given)
    out: list[str] = []
    seen: dict[str, int] = {}
    lambdas = 0
    for r in rewards:
        name = r.rpartition(":")[2] if isinstance(r, str) else getattr(r, "__name__", None)
        if not isinstance(name, str) or not name:
            name = type(r).__name__
        if name == "<lambda>":
            lambdas += 1
            out.append(f"<lambda #{lambdas}>")
            continue
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def shown_reward(text: Any) -> str:
    """A reward as messages name it: its function, then its module or file (a long path's end, so the file's
    name always shows): ``'short' (…/tasks/rewards.py)``."""
    ref = parse_reward(text)
    if isinstance(ref, str):
        return brief(text)
    target = ref.target if len(ref.target) <= 60 else "…" + ref.target[-59:]
    return f"{ref.function!r} ({target})"


@dataclass(frozen=True)
class RewardSignature:
    """What the worker found when it imported a reward function: the names it accepts, the names it
    requires (no default), and whether it takes ``**kwargs``."""

    ref: str
    accepts: tuple[str, ...]
    required: tuple[str, ...]
    var_keyword: bool
    is_async: bool
    probe: str | None = None
    """Why its call on a sample row of the data failed as a type mismatch would (:func:`inspect_rewards`)."""

    def problems(self, columns: set[str] | None) -> list[str]:
        """Why it cannot be called with TRL's arguments and these data ``columns`` (None: not known), or
        its call on a sample row failed."""
        out = [self.probe] if self.probe else []
        missing = [a for a in REQUIRED_ARGS if a not in self.accepts and not self.var_keyword]
        if missing:
            out.append(
                f"reward {shown_reward(self.ref)} does not take {' or '.join(missing)} (a reward function is called "
                f"as fn(prompts=..., completions=..., completion_ids=..., **columns); add **kwargs)"
            )
        if columns is not None:
            unknown = [a for a in self.required if a not in STANDARD_ARGS and a not in columns]
            if unknown:
                out.append(
                    f"reward {shown_reward(self.ref)} needs {', '.join(map(repr, unknown))}, which no data row has "
                    f"(the rows' columns: {', '.join(sorted(columns)) or 'none'})"
                )
        return out


def inspect_rewards(
    rewards: Sequence[str],
    cwd: str | os.PathLike | None = None,
    timeout_s: float = START_TIMEOUT_S,
    probes: Sequence[tuple[RewardBatch, str]] = (),
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> list[RewardSignature | str]:
    """Import each reward function in a fresh worker process (the notebook's own ``sys.modules`` keeps
    an old copy of an edited file; an import that hangs cannot hang the caller) and return its
    signature, or why it cannot be used: not found, not importable, not callable.

    ``probes``: ``(batch, what it is)`` pairs, sample rows of the data with a sample completion each; every
    function is then called once on each, in the same worker (at most ``probe_timeout_s`` a call), and a
    call that fails as a type mismatch would (a ``TypeError`` or ``AttributeError``, or an answer that is no
    list of numbers) is its signature's :attr:`~RewardSignature.probe` (what TRL's
    ``think_format_reward`` on text prompts does at the first step, said before launch)."""
    problems: list[RewardSignature | str | None] = [None] * len(rewards)
    refs = []
    for i, text in enumerate(rewards):
        ref = parse_reward(text)
        if isinstance(ref, str):
            problems[i] = ref
        else:
            refs.append((i, str(ref)))
    if not refs:
        return problems  # type: ignore[return-value]
    ask = None
    if probes:
        requests = [[_request(batch), what] for batch, what in probes]
        try:
            ask = orjson.dumps(
                {"requests": requests, "timeout_s": probe_timeout_s}, option=orjson.OPT_SERIALIZE_NUMPY
            )
        except orjson.JSONEncodeError:  # (a column no JSON holds: the job could not send it either)
            probes = ()
    args = ["--inspect", *(["--probe"] if probes else []), *(r for _, r in refs)]
    # (the parent's bound: imports, then every probe call at its time limit, which the worker keeps itself)
    bound = timeout_s + len(probes) * len(refs) * (probe_timeout_s + 1)
    try:
        answers, current, failure = _run_worker(args, cwd, bound, ask)
        if not isinstance(answers[0], list) or len(answers[0]) != len(refs):
            raise RewardError(f"the reward worker's answer is malformed: {brief(answers[0])}")
    except RewardError as e:
        answers, current, failure = [[str(e)] * len(refs)], None, None
    probed: dict[int, str] = {}
    for answer in answers[1:]:
        for j, why in answer.get("probed", []) if isinstance(answer, dict) else []:
            probed.setdefault(int(j), str(why))
    if failure and current is not None:  # a probe call that ended (or hung) its worker: that function's
        j = next((j for j, (_, r) in enumerate(refs) if r == current), None)
        if j is not None:
            probed.setdefault(
                j, f"reward {shown_reward(current)}, called once on a sample row of the data, {failure}"
            )
    for j, ((i, _), got) in enumerate(zip(refs, answers[0], strict=True)):
        if isinstance(got, dict):
            got |= {
                "accepts": tuple(got["accepts"]),
                "required": tuple(got["required"]),
                "probe": probed.get(j),
            }
        problems[i] = RewardSignature(**got) if isinstance(got, dict) else str(got)
    return problems  # type: ignore[return-value]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _run_worker(
    args: list[str], cwd: str | os.PathLike | None, timeout_s: float, stdin: bytes | None = None
) -> tuple[list[Any], str | None, str | None]:
    """Run a worker once (``--inspect``): ``(its answers, the function a progress frame last named, how it
    failed after its first answer, or None)``. A failure before it (no answer) is a :class:`RewardError`
    naming the function it was importing."""
    proc, frames = spawn(
        args,
        cwd,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
        failure = None
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        failure = f"took more than {timeout_s:g} s"
    answers, current = _frames(out, frames)
    if not answers and failure:
        raise RewardError(f"importing the reward functions {failure}{_doing(current)}")
    if proc.returncode != 0 and not failure:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        failure = f"ended its worker: {error_line(RuntimeError(tail[0]))}"
        if not answers:
            raise RewardError(
                f"the reward worker failed{_doing(current)}: {error_line(RuntimeError(tail[0]))}"
            )
    if not answers:  # (it exited 0 without an answer: an import that called os._exit(0), say)
        raise RewardError(f"the reward worker ended without an answer{_doing(current)}")
    return answers, current, failure


def _request(batch: RewardBatch) -> dict[str, Any]:
    """What a worker is sent of ``batch`` (a request line)."""
    return {
        "prompts": batch.prompts,
        "completions": batch.completions,
        "completion_ids": batch.completion_ids,
        "columns": batch.columns,
        "state": batch.state,
        "scores_may_be_missing": batch.scores_may_be_missing,
    } | ({"endpoint": list(batch.endpoint)} if batch.endpoint is not None else {})


def _frames(data: bytes, frames: Frames) -> tuple[list[Any], str | None]:
    """The answers among ``data``'s frames, and the last function a progress frame named."""
    answers, current = [], None
    for line in data.splitlines():
        try:
            message = frames.open(line)
        except ValueError:
            continue
        if isinstance(message, dict) and ("importing" in message or "calling" in message):
            current = str(message.get("importing") or message.get("calling"))
        else:
            answers.append(message)
    return answers, current


def _doing(current: str | None) -> str:
    return f" (in reward {shown_reward(current)})" if current else ""


@dataclass
class RewardBatch:
    """One call's inputs: ``n`` completions (a tenant's prompts, each ``group_size`` times)."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    """Every other data column, one value per completion."""
    state: dict[str, Any] = field(default_factory=dict)
    """``trainer_state``'s attributes (``global_step``, ``max_steps``)."""
    scores_may_be_missing: bool = False
    """An evaluation's metrics: a function that scores no completion at all is not a failure (a reward that
    does is: its tenant would train on nothing)."""
    endpoint: tuple[str, str] | None = None
    """The job's own OpenAI endpoint and a key, for functions that ask the job (:data:`ENDPOINT_ENV`)."""

    def __len__(self) -> int:
        return len(self.completions)


@dataclass
class RewardResult:
    """What a call gave: ``rewards[i][f]`` = function ``f``'s reward of completion ``i`` (NaN: none),
    the metrics the functions logged (means) and the extra columns they asked to show."""

    rewards: list[list[float]]
    metrics: dict[str, float]
    extra: dict[str, list[Any]]
    seconds: float


class RewardWorker:
    """The worker process of one tenant's reward functions (see the module docstring).

    :meth:`submit` sends a batch and returns at once; :meth:`result` waits for its answer (at most
    ``timeout_s`` from the submit, by this process's clock), so the workers of several tenants compute at the
    same time. A failed call raises :class:`RewardError` naming the function; the next submit starts a new
    worker if this one was lost.
    """

    def __init__(self, rewards: Sequence[str], timeout_s: float = 60.0, cwd: str | os.PathLike | None = None):
        self.rewards = list(rewards)
        self.timeout_s = timeout_s
        self.cwd = cwd
        self._proc: subprocess.Popen | None = None
        self._frames = Frames(b"")
        self._buffer = b""
        self._sent_at: float | None = None
        self._sent_n = 0
        self._current: str | None = None  # the function the worker said it is importing or calling
        self.asks_the_job = False  # (its hello says: a judge among its functions asks the job it runs in)

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` while none runs)."""
        return self._proc.pid if self._proc is not None else None

    # -- the process ---------------------------------------------------------------------------
    def _start(self) -> subprocess.Popen:
        proc, frames = spawn(
            ["--serve", *self.rewards], self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        os.set_blocking(proc.stdin.fileno(), False)  # type: ignore[union-attr]  (writes keep the deadline)
        self._proc, self._frames, self._buffer, self._current = proc, frames, b"", None
        hello = self._read(time.monotonic() + START_TIMEOUT_S, "importing the reward functions")
        self.asks_the_job = hello.get("asks_the_job") is True
        if "error" in hello:
            self.close()
            raise RewardError(str(hello["error"]))
        return proc

    def close(self) -> None:
        """Kill the worker and everything it started (its process group, and any descendant that left it)."""
        proc, self._proc, self._sent_at = self._proc, None, None
        if proc is None:
            return
        kill_tree(proc.pid, include_root=False)  # (first, while it lives: detached ones are its descendants)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # (already gone)
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        proc.wait()

    def __del__(self) -> None:
        self.close()

    def _fail(self, why: str) -> RewardError:
        """The worker is stopped; the error to raise, naming the function it was in."""
        current = self._current
        self.close()
        return RewardError(why + _doing(current))

    def _read(self, deadline: float, doing: str) -> dict[str, Any]:
        """The worker's next answer, read without blocking past ``deadline`` (progress frames say which
        function it is in; anything that is not a frame of this worker is a malformed answer)."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buffer:
                    line, _, self._buffer = self._buffer.partition(b"\n")
                    try:
                        message = self._frames.open(line)
                        if not isinstance(message, dict):
                            raise ValueError("not an object")
                    except ValueError:  # (orjson's JSONDecodeError is one)
                        raise self._fail(
                            f"the reward worker sent a malformed answer while {doing} (a reward function "
                            f"writing to its answer channel?): {brief(line.decode('utf-8', 'replace'))}"
                        ) from None
                    if "importing" in message or "calling" in message:
                        self._current = str(message.get("importing") or message.get("calling"))
                        continue
                    return message
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise self._fail(f"{doing} took more than {self.timeout_s:g} s (timeout_s): stopped")
                chunk = os.read(fd, 1 << 20)
                if not chunk:  # its answer channel closed: it exits, or it is stopped (it may hang on)
                    try:
                        code = proc.wait(min(EXIT_GRACE_S, max(deadline - time.monotonic(), 0.1)))
                        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    except subprocess.TimeoutExpired:
                        how = "closed its answer channel and did not exit"
                    raise self._fail(f"the reward worker {how} while {doing}")
                self._buffer += chunk

    def _write(self, data: bytes, deadline: float) -> None:
        """Send ``data`` to the worker without blocking past ``deadline`` (a worker that stops reading its
        requests cannot hold the job)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        fd = proc.stdin.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while data:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise self._fail(
                        f"sending the rewards' inputs took more than {self.timeout_s:g} s: stopped"
                    )
                try:
                    data = data[os.write(fd, data) :]
                except BlockingIOError:
                    continue
                except OSError:  # it died or closed its input: the read says how
                    return

    # -- calls ---------------------------------------------------------------------------------
    def ensure(self) -> None:
        """Start the worker if none runs (its hello says whether a function asks the job: :attr:`asks_the_job`);
        :class:`RewardError` when its functions cannot be imported."""
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()

    def submit(self, batch: RewardBatch) -> None:
        """Send ``batch`` to the worker (starting one if needed); the answer is read by :meth:`result`."""
        if self._sent_at is not None:
            raise RuntimeError("submit() twice without result()")
        self.ensure()
        try:
            data = orjson.dumps(_request(batch), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        except orjson.JSONEncodeError as e:
            raise RewardError(f"the reward inputs cannot be sent to the worker: {error_line(e)}") from None
        self._sent_at, self._sent_n, self._current = time.monotonic(), len(batch), None
        self._write(data, self._sent_at + self.timeout_s)

    def result(self) -> RewardResult:
        """The answer to the last :meth:`submit`: :class:`RewardResult`, or :class:`RewardError`."""
        if self._sent_at is None:
            raise RuntimeError("result() without submit()")
        started, n = self._sent_at, self._sent_n
        answer = self._read(started + self.timeout_s, "computing the rewards")
        self._sent_at = None
        if "error" in answer:
            raise RewardError(str(answer["error"]))
        try:
            rewards, metrics, extra = checked_answer(answer, n, len(self.rewards))
        except ValueError as e:  # (a worker answers in this shape: the answer was forged, by a reward)
            raise self._fail(f"the reward worker's answer is malformed: {e}") from None
        return RewardResult(rewards, metrics, extra, time.monotonic() - started)

    def __call__(self, batch: RewardBatch) -> RewardResult:
        self.submit(batch)
        return self.result()
