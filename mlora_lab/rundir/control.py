"""Control messages between the notebook and a running job: ``<run_dir>/control/``.

::

    control/<time_ns>-<id>.json      a queued message (written atomically; lexical order = arrival order)
    control/applying/<file>          claimed by the job, being applied at a step boundary
    control/done/<file>              applied or refused; the outcome is results/<id>.json
    control/rejected/<file>          not a valid message (never applied); <file>.reason says why
    control/results/<id>.json        {"id", "ok", "error", "step"}
    control/stop                     a graceful stop request (a plain file)

A message is data, never a path: its ``id`` is 32 lowercase hex digits generated here (uuid4), and
the job accepts a file only if its name is ``<20 digits>-<id>.json`` with that same id inside, it is a
regular file (not a symlink) of at most 1 MiB, and its fields have the types below. Anything else
is moved to ``rejected/`` with the reason; a result file is written only for a well-formed id, and
never over an existing one (a replayed id is rejected). A claimed message that was still in
``applying/`` when the job died is answered "interrupted" at the next start and never replayed.

The notebook side reads this folder too: :func:`stage` says where a message is (queued, being
applied, answered), :func:`sent_tenants` the tenants sent by ``add`` (a refused tenant is in no
job.json; its configuration is here).

Messages (``op``): ``add`` with ``tenant`` (a Tenant as a JSON object, validated by the job like a
job.json tenant); ``remove`` / ``pause`` / ``resume`` with ``name`` (a tenant name).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from mlora_lab.rundir.files import (
    RunDir,
    RunDirError,
    TextEnum,
    atomic_write_json,
    atomic_write_text,
    move_into,
    name_problem,
)

MESSAGE_ID = re.compile(r"[0-9a-f]{32}")
MESSAGE_FILE = re.compile(r"([0-9]{20})-([0-9a-f]{32})\.json")
MAX_MESSAGE_BYTES = 1 << 20
MAX_DEPTH = 32
"""Deepest nesting of lists/objects a message may have: the job passes messages between its ranks
(pickled), and a message nested hundreds deep that JSON still parses would overflow the stack there."""


class Op(TextEnum):
    ADD = "add"
    REMOVE = "remove"
    PAUSE = "pause"
    RESUME = "resume"


class ControlError(RuntimeError):
    """A control message the job refused (its reason is the message), or no answer from the job."""


@dataclass(frozen=True)
class ControlMessage:
    """One request to the job."""

    id: str
    op: Op
    name: str | None = None
    tenant: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "op": self.op.value}
        if self.op is Op.ADD:
            d["tenant"] = self.tenant
        else:
            d["name"] = self.name
        return d

    @property
    def subject(self) -> str | None:
        """The tenant the message is about (its name), if that is a usable name."""
        name = self.tenant.get("name") if self.op is Op.ADD and self.tenant else self.name
        return name if name_problem(name) is None else None

    @classmethod
    def parse(cls, d: Any, file_id: str) -> ControlMessage:
        """Check a decoded message; ``ValueError`` with the reason if it is not a valid one."""
        if not isinstance(d, dict):
            raise ValueError(f"a message is a JSON object (got {type(d).__name__})")
        if _depth(d) > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        unknown = sorted(str(k)[:40] for k in d if k not in ("id", "op", "name", "tenant"))
        if unknown:
            raise ValueError(f"unknown fields {unknown[:5]}")
        if d.get("id") != file_id:
            raise ValueError("its id differs from the id in its file name")
        try:
            op = Op(d.get("op"))
        except (ValueError, TypeError):
            raise ValueError(f"'op' must be one of {', '.join(o.value for o in Op)}") from None
        if op is Op.ADD:
            if "name" in d:
                raise ValueError("an add message carries 'tenant', not 'name'")
            if not isinstance(d.get("tenant"), dict):
                raise ValueError("an add message needs 'tenant', a JSON object")
            return cls(file_id, op, tenant=d["tenant"])
        if "tenant" in d:
            raise ValueError(f"a {op.value} message carries 'name', not 'tenant'")
        problem = name_problem(d.get("name"))
        if problem:
            raise ValueError(f"'name' is not a tenant name ({problem})")
        return cls(file_id, op, name=d["name"])


@dataclass(frozen=True)
class ControlResult:
    """The job's answer to one message."""

    id: str
    ok: bool
    error: str | None
    step: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "ok": self.ok, "error": self.error, "step": self.step}


@dataclass
class Incoming:
    """A file found in the queue: a valid ``message``, or the ``problem`` that makes it invalid."""

    path: Path
    message: ControlMessage | None
    problem: str | None
    msg_id: str | None  # from a well-formed file name: a refusal can then be answered


def _depth(obj: Any) -> int:
    """Nesting depth of lists and dicts in ``obj`` (iterative: never recurses itself)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, level = stack.pop()
        if isinstance(x, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:  # no need to walk further than the limit
                stack.extend((v, level + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def new_message_id() -> str:
    return uuid.uuid4().hex


def _result_path(run: RunDir, msg_id: str) -> Path:
    if not isinstance(msg_id, str) or not MESSAGE_ID.fullmatch(msg_id):
        raise ValueError(f"{str(msg_id)[:80]!r} is not a control message id (32 hex digits)")
    return run.inside(run.control / "results" / f"{msg_id}.json")


def send(
    run_dir: str | os.PathLike, op: Op | str, *, name: str | None = None, tenant: dict | None = None
) -> str:
    """Queue a control message; returns its id."""
    op = Op(op)
    run = RunDir(run_dir)
    msg = ControlMessage(new_message_id(), op, name=name, tenant=tenant)
    atomic_write_json(run.control / f"{time.time_ns():020d}-{msg.id}.json", msg.to_dict(), root=run.root)
    return msg.id


def _read(path: Path, run: RunDir) -> tuple[ControlMessage | None, str | None, str | None]:
    m = MESSAGE_FILE.fullmatch(path.name)
    if not m:
        return (
            None,
            "its file name is not <20 digits>-<32 hex digits>.json (ids are made by the library)",
            None,
        )
    msg_id = m.group(2)
    if _result_path(run, msg_id).exists():
        return None, "duplicate message id: a message with this id was already answered", None
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file (a symlink, a directory or a device)", msg_id
    if st.st_size > MAX_MESSAGE_BYTES:
        return None, f"{st.st_size} bytes; a message is at most {MAX_MESSAGE_BYTES}", msg_id
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MESSAGE_BYTES + 1)
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start})", msg_id
    except ValueError as e:
        return None, f"not valid JSON ({str(e)[:120]})", msg_id
    except RecursionError:
        return None, "not valid JSON (nested too deeply)", msg_id
    try:
        return ControlMessage.parse(d, msg_id), None, msg_id
    except ValueError as e:
        return None, str(e), msg_id


def incoming(run_dir: str | os.PathLike) -> list[Incoming]:
    """Queued message files in arrival order, each parsed or with the reason it is invalid."""
    run = RunDir(run_dir)
    out = []
    try:
        folder = run.inside(run.control)  # a control/ replaced by a symlink elsewhere is not read
        paths = sorted(p for p in folder.iterdir() if p.name.endswith(".json") and not p.name.startswith("."))
    except FileNotFoundError:
        return []
    for path in paths:
        try:
            msg, problem, msg_id = _read(path, run)
        except OSError as e:
            msg, problem, msg_id = None, f"cannot be read ({e.strerror or e})", None
        out.append(Incoming(path, msg, problem, msg_id))
    return out


def _move(run: RunDir, path: Path, folder: str) -> Path:
    """Move a message file into ``control/<folder>/`` (never through a symlink planted there)."""
    return move_into(run.root, path, run.control / folder)


def reject(run_dir: str | os.PathLike, item: Incoming, step: int) -> None:
    """Move an invalid message to ``rejected/`` with its reason (and answer it, if its id allows)."""
    run = RunDir(run_dir)
    target = _move(run, item.path, "rejected")
    atomic_write_text(target.with_name(target.name + ".reason"), f"{item.problem}\n", root=run.root)
    if item.msg_id and not _result_path(run, item.msg_id).exists():
        write_result(run.root, ControlResult(item.msg_id, False, f"rejected: {item.problem}", step))


def claim(run_dir: str | os.PathLike, item: Incoming) -> Path:
    """Take a valid message out of the queue before applying it (so it is never applied twice)."""
    return _move(RunDir(run_dir), item.path, "applying")


def write_result(run_dir: str | os.PathLike, result: ControlResult) -> None:
    run = RunDir(run_dir)
    atomic_write_json(_result_path(run, result.id), result.to_dict(), root=run.root)


def finish(run_dir: str | os.PathLike, claimed: Path, result: ControlResult) -> None:
    """Record a claimed message's outcome and move it to ``done/``."""
    run = RunDir(run_dir)
    write_result(run.root, result)
    _move(run, claimed, "done")


def interrupted(run_dir: str | os.PathLike, step: int) -> list[str]:
    """Answer every message left in ``applying/`` by a job that died while applying it: it is not
    replayed (whatever it did is not in the checkpoint being resumed). Returns their ids."""
    run = RunDir(run_dir)
    ids = []
    for path in sorted((run.control / "applying").glob("*.json")):
        m = MESSAGE_FILE.fullmatch(path.name)
        if m and not _result_path(run, m.group(2)).exists():
            error = (
                "interrupted: the job ended while applying this message; it is not replayed (send it again)"
            )
            write_result(run.root, ControlResult(m.group(2), False, error, step))
            ids.append(m.group(2))
        _move(run, path, "done")
    return ids


def read_result(run_dir: str | os.PathLike, msg_id: str) -> ControlResult | None:
    """The job's answer to ``msg_id`` (None if there is none yet)."""
    path = _result_path(RunDir(run_dir), msg_id)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return ControlResult(d["id"], bool(d["ok"]), d.get("error"), int(d.get("step", 0)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return ControlResult(msg_id, False, f"unreadable result file ({e})", 0)


def wait_result(
    run_dir: str | os.PathLike,
    msg_id: str,
    timeout: float = 120,
    is_alive: Callable[[], bool] = lambda: True,
    on_wait: Callable[[float], None] | None = None,
) -> ControlResult:
    """Wait for the job to answer ``msg_id``; :class:`ControlError` if it refused the message.
    ``on_wait(seconds_waited)`` is called about every second while waiting (progress reporting)."""
    start = time.monotonic()
    next_note = start + 1.0
    while (result := read_result(run_dir, msg_id)) is None:
        now = time.monotonic()
        if now - start > timeout:
            raise TimeoutError(f"the job did not answer control message {msg_id} within {timeout} s")
        if not is_alive():
            if (result := read_result(run_dir, msg_id)) is not None:
                break
            raise ControlError(f"the job ended before applying control message {msg_id}")
        if on_wait is not None and now >= next_note:
            on_wait(now - start)
            next_note = now + 1.0
        time.sleep(0.1)
    if not result.ok:
        raise ControlError(result.error)
    return result


def stage(run_dir: str | os.PathLike, msg_id: str) -> str:
    """Where message ``msg_id`` is: ``answered`` (its result exists), ``applying`` (claimed by the
    job), ``queued`` (waiting for the job's next step boundary; a job that is still loading its model
    has not looked yet) or ``unknown`` (no such message)."""
    run = RunDir(run_dir)
    result = _result_path(run, msg_id)  # checks that msg_id is an id: the globs below are safe
    # Looked up in the order a message moves (queue -> applying/ -> result), so a message that moves
    # while we look is still found.
    if any(run.control.glob(f"*-{msg_id}.json")):
        return "queued"
    if any((run.control / "applying").glob(f"*-{msg_id}.json")):
        return "applying"
    return "answered" if result.exists() else "unknown"


class SentTenant(NamedTuple):
    """A tenant sent by an ``add`` message, and whether the job has answered that message."""

    tenant: dict[str, Any]
    answered: bool


def sent_tenants(run_dir: str | os.PathLike) -> dict[str, SentTenant]:
    """The tenants sent by ``add`` messages, by name, in arrival order (a later message for the same
    name wins): answered (applied or refused, ``done/``), being applied, or still queued. This is
    where the configuration of a tenant that is in no job.json (a refused one, one still being added)
    is found. Files that are not well-formed messages are left out."""
    run = RunDir(run_dir)
    found: list[tuple[str, ControlMessage, bool]] = []
    for folder, answered in (
        (run.control / "done", True),
        (run.control / "applying", False),
        (run.control, False),
    ):
        try:
            paths = list(run.inside(folder).iterdir())
        except (FileNotFoundError, NotADirectoryError, RunDirError):
            continue
        for path in paths:
            m = MESSAGE_FILE.fullmatch(path.name)
            if not m:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        continue
                    raw = f.read(MAX_MESSAGE_BYTES + 1)
                msg = ControlMessage.parse(json.loads(raw.decode("utf-8")), m.group(2))
            except (OSError, ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
                continue
            if msg.op is Op.ADD and msg.subject is not None:
                found.append((m.group(1), msg, answered))
    found.sort(key=lambda item: item[0])  # the file name starts with the time it was sent
    return {msg.subject: SentTenant(msg.tenant, answered) for _, msg, answered in found}


def request_stop(run_dir: str | os.PathLike) -> None:
    """Ask the job to stop gracefully (finish the step, checkpoint, save adapters, exit)."""
    run = RunDir(run_dir)
    atomic_write_text(run.control / "stop", f"{time.time()}\n", root=run.root)


def stop_requested(run_dir: str | os.PathLike) -> bool:
    return (RunDir(run_dir).control / "stop").exists()


def clear_stop(run_dir: str | os.PathLike) -> None:
    (RunDir(run_dir).control / "stop").unlink(missing_ok=True)
