"""Applying control messages inside the job: every rank, the same step, one request at a time, each
request isolated from the job.

At a step boundary rank 0 reads the queue (:func:`mlora_lab.rundir.control.incoming`), moves invalid
files to ``rejected/``, claims the valid ones (``applying/``) and broadcasts them. Each message is then
applied in two phases on every rank:

1. ``prepare(msg) -> Change`` does everything that can fail (validation, reading files, filling a
   slot, saving an adapter) and raises, having changed nothing, if it cannot. Whatever it raises is
   caught here — any exception type: the boundary of a request is where its failures stop;
2. the ranks agree (one all-gather of each rank's error, or None): if every rank prepared it,
   ``change.commit()`` makes it visible; if any rank failed, the ranks that succeeded call
   ``change.undo()``, and the request is refused with the first error.

Rank 0 writes the result (``results/<id>.json``), and ``on_refused`` records a refusal (a tenant
row in state ``refused``). The job goes on in every case.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlora_lab.parallel import Collectives
from mlora_lab.rundir import RunDir, RunDirError, control
from mlora_lab.rundir.control import ControlMessage, ControlResult


def _nothing() -> None:
    return None


@dataclass
class Change:
    """A prepared request: ``commit`` makes it take effect (it must not fail the request), ``undo``
    takes back what ``prepare`` did (another rank could not prepare it)."""

    commit: Callable[[], None] = field(default=_nothing)
    undo: Callable[[], None] = field(default=_nothing)


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


class ControlHandler:
    """Reads, applies and answers control messages for one job (see the module docstring)."""

    def __init__(
        self,
        run: RunDir | None,
        comm: Collectives,
        is_main: bool,
        prepare: Callable[[ControlMessage], Change],
        on_refused: Callable[[ControlMessage, str], None] = lambda msg, error: None,
    ) -> None:
        self.run, self.comm, self.is_main = run, comm, is_main
        self.prepare, self.on_refused = prepare, on_refused
        self._noted: set[str] = set()

    def _note(self, text: str) -> None:
        """Say what is wrong with the control folder once per distinct problem (it is polled every step)."""
        if text not in self._noted:
            self._noted.add(text)
            print(text, flush=True)

    def start(self, step: int) -> None:
        """At job start: answer messages a previous run of the job died while applying (not replayed)."""
        if self.run is None or not self.is_main:
            return
        try:
            for msg_id in control.interrupted(self.run.root, step):
                print(
                    f"control message {msg_id} was interrupted by the end of the previous run; not replayed"
                )
        except (OSError, RunDirError) as e:
            self._note(f"interrupted control messages not answered: {e}")

    def poll(self, step: int) -> list[ControlResult]:
        """Apply every queued message now; returns their results (on every rank). Trouble with the
        control folder itself (gone, replaced by a file or by a symlink leading elsewhere) is said
        once and otherwise ignored: it never ends the job."""
        if self.run is None:
            return []
        claimed: list[tuple[Path, ControlMessage]] = []
        if self.is_main:
            try:
                items = control.incoming(self.run.root)
            except (OSError, RunDirError) as e:
                self._note(f"control messages not read: {e}")
                items = []
            for item in items:
                try:
                    if item.message is None:
                        self._note(f"control file {item.path.name[:80]!r} rejected: {item.problem}")
                        control.reject(self.run.root, item, step)
                    else:
                        claimed.append((control.claim(self.run.root, item), item.message))
                except (OSError, RunDirError) as e:  # it vanished, or cannot be moved: leave it, say so
                    self._note(f"control file {item.path.name[:80]!r} skipped: {e}")
        messages: list[ControlMessage] = self.comm.broadcast_object([m for _, m in claimed])
        results = []
        for i, msg in enumerate(messages):
            result = self._apply(msg, step)
            results.append(result)
            if self.is_main:
                try:
                    control.finish(self.run.root, claimed[i][0], result)
                except (OSError, RunDirError) as e:
                    self._note(f"control message {msg.id}: cannot write its result ({e})")
        return results

    def _apply(self, msg: ControlMessage, step: int) -> ControlResult:
        change, error = None, None
        try:
            change = self.prepare(msg)
        except Exception as e:  # any type: one request's failure stays with that request
            error = describe(e)
            if not isinstance(e, ValueError | KeyError):  # an unexpected failure: keep its traceback
                traceback.print_exc()
        errors = self.comm.gather_objects(error)
        first = next((e for e in errors if e), None)
        if first is None:
            change.commit()
            # every rank says so in its own log: where a job spans nodes, the logs show that all
            # ranks applied it at the same step
            print(
                f"control message {msg.id} applied at step {step}: {msg.op.value} {msg.subject!r}", flush=True
            )
            return ControlResult(msg.id, True, None, step)
        if change is not None:
            try:
                change.undo()
            except Exception:
                traceback.print_exc()
        error = first if error is not None else f"refused on another process: {first}"
        message = f"{msg.op.value}: {error}"
        print(f"control message {msg.id} refused: {message[:500]}", flush=True)
        self.on_refused(msg, message)
        return ControlResult(msg.id, False, message, step)
