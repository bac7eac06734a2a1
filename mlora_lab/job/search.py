"""The search inside the job: reports trials to the engine (:mod:`mlora_lab.search`) at step boundaries
and applies its actions to tenant slots, on every rank at the same step.

At each step boundary every rank works out, from its own (identical) tenant counters, which trials
reached the step the engine asked them to report at, and evaluates them together (a collective). Rank 0
alone computes the objectives, asks the engine and broadcasts the actions with the engine's new state;
every rank then applies them in order, like a control message (everything that can fail is tried on
every rank first, and a failure anywhere is the trial's failure everywhere):

* ``start``: the trial's tenant takes a free slot (fresh: PEFT's init, its own seed and data order);
* ``pause`` (ASHA): the trial's full state is kept (and its adapter saved), its slot freed;
* ``restore``: a paused trial that was promoted takes a free slot again with exactly that state;
* ``continue``: a trial promoted as it reached its rung goes on in its slot;
* ``stop``: a trial that trained its budget gives its slot back (its adapter is saved);
* ``exploit`` (PBT): the trial takes the source's adapter, optimiser and schedule state and step (its
  data cursor stays its own), then the explored settings.

Kept states and the engine's state are part of every checkpoint, so a resumed job makes the same
decisions as one that ran through; ``search.json`` in the run directory holds the engine's state for readers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mlora_lab.job.agree import agree, describe
from mlora_lab.job.recorder import Recorder
from mlora_lab.job.tenants import FeedFor, TenantPool
from mlora_lab.parallel import Collectives
from mlora_lab.rundir import (
    EventKind,
    MetricsReader,
    Row,
    RowKind,
    RunDir,
    TenantRow,
    TenantState,
    atomic_write_json,
)
from mlora_lab.search import Action, ActionOp, Objective, Search, Sweep, TrialState, is_eval_score
from mlora_lab.spec.tenant import Tenant

OPTIMIZER_FIELDS = ("lr", "weight_decay", "max_grad_norm")

HeldoutLosses = Callable[[Sequence[str]], dict[str, float]]


def load_objective(metric: str) -> Callable[[list[dict]], float] | None:
    """The user's objective function for ``"module:function"`` (None for the built-in metrics);
    ``ValueError`` when it cannot be used (:meth:`~mlora_lab.search.Objective.function`)."""
    return Objective(metric).function()


class SearchController:
    """Runs :class:`~mlora_lab.search.Search` over the slots of a :class:`~.tenants.TenantPool`.

    Built with what it acts on: the pool (slots, tenant states), the feeds of new trials, the recorder
    (rows and events), the communicator, and ``heldout_losses(names)`` (held-out losses of trials, a
    collective).
    ``saved`` is its :meth:`state_dict` from a checkpoint, when the job resumes."""

    def __init__(
        self,
        sweep: Sweep,
        pool: TenantPool,
        feed_for: FeedFor,
        recorder: Recorder,
        comm: Collectives,
        heldout_losses: HeldoutLosses,
        run: RunDir | None,
        is_main: bool,
        saved: dict[str, Any] | None = None,
    ) -> None:
        self.sweep, self.pool, self.feed_for, self.recorder = sweep, pool, feed_for, recorder
        self.comm, self.heldout_losses, self.run, self.is_main = comm, heldout_losses, run, is_main
        self.engine = Search.from_dict(saved["engine"]) if saved else sweep.search()
        self.kept: dict[int, dict[str, Any]] = {int(k): v for k, v in (saved or {}).get("kept", {}).items()}
        self.objective_fn = load_objective(sweep.objective.metric) if is_main else None
        self._said_pruned = {t.id for t in self.engine.trials if t.state is TrialState.PRUNED}
        # rows written before a resume: a trial's train-loss objective looks back over them too
        self.past_rows: list[Row] = []
        if saved and is_main and run is not None:
            reader = MetricsReader(run.metrics)
            reader.poll()
            self.past_rows = list(reader.rows)

    # -- what the trainer asks ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: ``{"search": the engine's state and the kept states of paused trials}``."""
        return {
            "search": {"engine": self.engine.to_dict(), "kept": {str(k): v for k, v in self.kept.items()}}
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The search's state is read when it is built (``saved``): its trials decide which tenants start."""

    def not_in_slots(self) -> set[str]:
        """Trial tenants the job must not start by itself on resume: those not running (the search
        restores or starts them)."""
        return {
            self.name(t.id)
            for t in self.engine.trials
            if t.state is not TrialState.RUNNING or t.id in self.kept
        }

    @property
    def active(self) -> bool:
        """Trials still run, or can still start or be promoted."""
        return not self.engine.done

    def name(self, trial_id: int) -> str:
        return f"{self.sweep.prefix}{trial_id:03d}"

    # -- one step boundary -------------------------------------------------------------------------
    def poll(self) -> None:
        """Report, decide (rank 0) and apply, on every rank. A collective only when something is due."""
        running = [t for t in self.engine.trials if t.state is TrialState.RUNNING]
        due, failed = [], []
        for t in running:
            run = self.pool.tenants.get(self.name(t.id))
            if run is None or run.state is TenantState.FAILED:
                failed.append(t.id)
            elif not run.accumulating and run.step >= self.engine.next_report(t.id):
                due.append(t.id)
        free = self.pool.free_slots
        if not (due or failed or (free > 0 and self.engine.can_fill())):
            return
        heldout = self._heldout_losses(due)
        decided = None
        if self.is_main:
            decided = self._decide(due, failed, heldout, free)
        actions, state = self.comm.broadcast_object(decided)
        self.engine = Search.from_dict(state)
        for action in actions:
            self.apply(action)
        self._say_pruned()
        if self.is_main and self.run is not None:
            try:
                atomic_write_json(self.run.search, self.engine.to_dict())
            except OSError as e:  # a full disk: the checkpoint still holds it
                print(f"search.json not written: {e}", flush=True)

    def _heldout_losses(self, due: list[int]) -> dict[str, float]:
        """Held-out losses of the trials due now (those with held-out data), if the objective wants them."""
        if not due or self.sweep.objective.metric == "train_loss":
            return {}
        return self.heldout_losses([self.name(i) for i in due])

    def _decide(self, due: list[int], failed: list[int], heldout: dict[str, float], free: int) -> tuple:
        engine, step = self.engine, self.recorder.step
        actions: list[Action] = []
        for i in failed:
            run = self.pool.tenants.get(self.name(i))
            engine.fail(i, (run.reason if run else None) or "its tenant is gone", step)
            if run is not None:  # a quarantined trial gives its slot back (its tenant row says why)
                actions.append(Action(ActionOp.STOP, i, why="failed"))
        paused = []
        for i in sorted(due):
            run = self.pool[self.name(i)]
            value, why = self._value(i, heldout)
            actions += engine.report(i, run.step, value, step, why=why)
            if engine.trial(i).state is TrialState.PAUSED:
                paused.append(i)
        freed = sum(a.op is ActionOp.STOP for a in actions)
        actions += engine.fill(free + freed + len(paused), step, tuple(paused))
        return actions, engine.to_dict()

    def _value(self, trial_id: int, heldout: dict[str, float]) -> tuple[float, str]:
        """The objective of a trial now, and why it is NaN when it is: its held-out loss (``eval_loss``, when it
        has held-out data), else the mean of its last ``window`` train losses, or the user's function of its rows."""
        name, objective = self.name(trial_id), self.sweep.objective
        rows = [r for r in (*self.past_rows, *self.recorder.history) if r.get("tenant") == name]
        if self.objective_fn is not None:
            # The boundary of a call into the user's code: whatever it raises (SystemExit included) is this
            # trial's failure, not the job's end. (An interrupt of an in-process job still stops it.)
            try:
                return float(self.objective_fn(rows)), ""
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                why = f"{objective.metric} raised {describe(e)}"
                print(f"objective of {name}: {why}", flush=True)
                return math.nan, why
        if objective.metric == "eval_loss" and name in heldout:
            return heldout[name], ""
        if is_eval_score(objective.metric):  # its latest score in one of the job's evaluations
            scores = [
                r["value"]
                for r in (*self.past_rows, *self.recorder.history)
                if r["kind"] == RowKind.EVAL_METRIC
                and r["model"] == name
                and f"eval/{r['eval']}/{r['metric']}" == objective.metric
            ]
            if not scores or scores[-1] is None:
                return math.nan, f"no {objective.metric} score yet (the evaluation runs every `every` steps)"
            return float(scores[-1]), ""
        losses = [r["loss"] for r in rows if r["kind"] == RowKind.TRAIN and r["loss"] is not None]
        if not losses:
            return math.nan, "no train loss was logged (log_every is larger than its report step?)"
        return sum(losses[-objective.window :]) / len(losses[-objective.window :]), ""

    # -- applying an action (every rank) -----------------------------------------------------------
    def apply(self, a: Action) -> None:
        pool, name, step = self.pool, self.name(a.trial), self.recorder.step
        source = f" from {self.name(a.source)}" if a.source is not None else ""
        self.recorder.event(EventKind.SEARCH, f"{a.op} {name}{source}" + (f": {a.why}" if a.why else ""))
        if a.op is ActionOp.START:
            tenant = self.sweep.trial_tenant(a.trial, a.config)
            refusal = agree(self.comm, lambda: pool.prepare_add(tenant, self.feed_for))
            if refusal is not None:
                self.engine.fail(a.trial, f"could not start: {refusal.error}", step)
        elif a.op is ActionOp.PAUSE:
            pool.save_adapter(name)
            self.kept[a.trial] = pool.tenant_state(name)
            pool.release(name, TenantState.PAUSED, a.why or "waits for a promotion")
        elif a.op is ActionOp.RESTORE:
            saved = self.kept.pop(a.trial)
            tenant = Tenant.from_dict(saved["spec"])
            refusal = agree(self.comm, lambda: pool.prepare_add(tenant, self.feed_for, saved))
            if refusal is not None:
                self.engine.fail(a.trial, f"could not be restored: {refusal.error}", step)
        elif a.op is ActionOp.STOP:
            t = self.engine.trial(a.trial)
            if name in pool:
                failed = t.state is TrialState.FAILED and pool[name].state is not TenantState.FAILED
                # (a trial failed by its objective says so in a tenant row; a quarantined one said it)
                pool.release(name, *((TenantState.FAILED, t.reason) if failed else (None, None)))
        elif a.op is ActionOp.EXPLOIT:
            source_state = pool.tenant_state(self.name(a.source))
            pool.load_tenant_state(name, source_state, whole=False)
            settings = {k: v for k, v in a.config.items() if k in OPTIMIZER_FIELDS}
            pool.set_hyperparameters(pool[name], settings)
        # "continue": the trial goes on in its slot

    def _say_pruned(self) -> None:
        """A tenant row for each trial pruned now that nothing can promote it any more."""
        for t in self.engine.trials:
            if t.state is TrialState.PRUNED and t.id not in self._said_pruned:
                self._said_pruned.add(t.id)
                self.kept.pop(t.id, None)  # its state is not needed any more (its adapter is saved)
                row = TenantRow(
                    step=self.recorder.step,
                    tenant=self.name(t.id),
                    state=TenantState.REMOVED,
                    reason=f"pruned: {t.reason}",
                )
                self.recorder.log(row)


def read_sweep(run: RunDir) -> Sweep | None:
    """The run's ``sweep.json`` (None when the run is not a sweep)."""
    if not run.sweep.is_file():
        return None
    return Sweep.read(run.sweep)
