"""Applying control messages inside the job: every rank, the same step, one request at a time, each
request isolated from the job.

At a step boundary rank 0 reads the queue (:func:`mlora_lab.rundir.control.incoming`), moves invalid
files to ``rejected/``, claims the valid ones (``applying/``) and broadcasts them. Each message is then
prepared on every rank and agreed (:func:`~mlora_lab.job.agree.agree`): everything that can fail
(validation, reading files, filling a slot, saving an adapter) happens in the prepare phase, and a
message that any rank could not prepare is refused with the first error on all of them. Rank 0 writes
the result (``results/<id>.json``); a refused ``add`` gets a tenant row in state ``refused``. The job
goes on in every case.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlora_lab.job.agree import Change, agree
from mlora_lab.job.tenants import FeedFor, TenantPool
from mlora_lab.parallel import Collectives
from mlora_lab.rundir import RunDir, RunDirError, TenantRow, TenantState, control
from mlora_lab.rundir.control import ControlMessage, ControlResult, Op
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import tenant_problems


class Controls:
    """What each control message does to the job's tenants, in two phases (:meth:`prepare`)."""

    def __init__(self, pool: TenantPool, feed_for: FeedFor, run: RunDir | None) -> None:
        self.pool, self.feed_for, self.run = pool, feed_for, run

    def prepare(self, msg: ControlMessage) -> Change:
        """First phase of ``msg``: check and do everything that can fail; raise, changing nothing, if it
        cannot be done."""
        if msg.op is Op.ADD:
            return self._prepare_add(msg.tenant)
        if msg.op is Op.REMOVE:
            return self.pool.prepare_remove(msg.name)
        return self.pool.prepare_pause(msg.name, pause=msg.op is Op.PAUSE)

    def _prepare_add(self, d: dict) -> Change:
        """Validate and add a tenant sent by ``add``. Relative paths in it are relative to the run
        directory, as in job.json (the Run API sends absolute paths), so they resolve the same way on
        resume."""
        spec = self.pool.spec
        tenant = Tenant.from_dict(d)
        if self.run is not None:
            tenant = dataclasses.replace(spec, tenants=[tenant]).resolved(self.run.root).tenants[0]
        problems = tenant_problems(spec, tenant)  # names too: job.json lists every tenant the run had
        if problems:
            raise SpecError(problems)
        self.pool.check_free_slot()
        self.pool.recorder.log(
            TenantRow(step=self.pool.recorder.step, tenant=tenant.name, state=TenantState.PENDING)
        )
        return self.pool.prepare_add(tenant, self.feed_for)

    def refused(self, msg: ControlMessage, error: str) -> None:
        """A refused ``add`` gets a tenant row in state ``refused`` (never left at ``pending``), unless its
        name belongs to a tenant of this run (whose state must not change)."""
        name = msg.subject
        if msg.op is Op.ADD and name is not None and not self.pool.name_taken(name):
            step = self.pool.recorder.step
            self.pool.recorder.log(TenantRow(step=step, tenant=name, state=TenantState.REFUSED, reason=error))


class ControlHandler:
    """Reads, applies and answers the control messages of one job (see the module docstring)."""

    def __init__(self, run: RunDir | None, comm: Collectives, is_main: bool, controls: Controls) -> None:
        self.run, self.comm, self.is_main, self.controls = run, comm, is_main, controls
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
            result = self.apply(msg, step)
            results.append(result)
            if self.is_main:
                try:
                    control.finish(self.run.root, claimed[i][0], result)
                except (OSError, RunDirError) as e:
                    self._note(f"control message {msg.id}: cannot write its result ({e})")
        return results

    def apply(self, msg: ControlMessage, step: int) -> ControlResult:
        """Prepare ``msg`` on every rank, agree, commit or undo; the result (the same on every rank)."""
        refusal = agree(self.comm, lambda: self.controls.prepare(msg))
        if refusal is None:
            # every rank says so in its own log: where a job spans nodes, the logs show that all
            # ranks applied it at the same step
            print(
                f"control message {msg.id} applied at step {step}: {msg.op.value} {msg.subject!r}", flush=True
            )
            return ControlResult(msg.id, True, None, step)
        message = f"{msg.op.value}: {refusal}"
        print(f"control message {msg.id} refused: {message[:500]}", flush=True)
        self.controls.refused(msg, message)
        return ControlResult(msg.id, False, message, step)
