"""Prepare on every rank, agree, then commit or undo: the one way the job changes its tenants.

Whatever changes which tenants hold slots — a control message, a search trial starting or coming back,
a job.json tenant starting — runs on every rank at the same step and must end the same way on all of
them: if one rank filled a slot that another did not, the next forward/backward differs between
ranks and the next collective hangs. So every such change goes through :func:`agree`:

1. ``prepare()`` does everything that can fail (validation, reading files, filling a slot, saving an
   adapter) and returns a :class:`Change`; it raises, having changed nothing, if it cannot. Whatever
   it raises is caught here, any exception type: the boundary of a request is where its failures stop;
2. the ranks agree, with one all-gather of each rank's error (or ``None``): if every rank prepared it,
   ``change.commit()`` makes it visible; if any rank failed, the ranks that succeeded call
   ``change.undo()`` and every rank returns the same :class:`Refusal`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


def _nothing() -> None:
    return None


@dataclass
class Change:
    """A prepared change: ``commit`` makes it take effect (it must not fail), ``undo`` takes back what
    ``prepare`` did (another rank could not prepare it)."""

    commit: Callable[[], None] = field(default=_nothing)
    undo: Callable[[], None] = field(default=_nothing)


@dataclass(frozen=True)
class Refusal:
    """Why a change was not made: the first failing rank's ``error`` (the same text on every rank), and
    whether this rank's own ``prepare`` failed (``here``)."""

    error: str
    here: bool

    def __str__(self) -> str:
        return self.error if self.here else f"refused on another process: {self.error}"


class ObjectGather(Protocol):
    def gather_objects(self, obj: object) -> list[object]: ...


def describe(exc: BaseException, limit: int = 2000) -> str:
    """One line for a result file or a tenant's reason, cut to ``limit`` characters. An expected
    refusal (a ``ValueError`` such as a bad spec, or a ``KeyError`` for an unknown tenant) is its
    message, every problem it lists joined by "; "; anything else keeps its exception type."""
    problems = getattr(exc, "problems", None)
    if isinstance(problems, list) and problems:
        text = "; ".join(str(p) for p in problems)
    elif isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    else:
        text = str(exc)
    text = " ".join(text.split()) or "(no message)"
    if not isinstance(exc, ValueError | KeyError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agree(comm: ObjectGather, prepare: Callable[[], Change]) -> Refusal | None:
    """Run ``prepare`` on this rank, agree with every other rank, and commit (returning ``None``) or
    undo (returning the :class:`Refusal`). A collective: every rank calls it for the same change."""
    change, error = None, None
    try:
        change = prepare()
    except Exception as e:  # any type: one request's failure stays with that request
        error = describe(e)
        if not isinstance(e, ValueError | KeyError):  # an unexpected failure: keep its traceback
            traceback.print_exc()
    first = next((e for e in comm.gather_objects(error) if e), None)
    if first is None:
        change.commit()
        return None
    if change is not None:
        try:
            change.undo()
        except Exception:
            traceback.print_exc()
    return Refusal(first, here=error is not None)
