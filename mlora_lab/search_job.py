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

import dataclasses
import importlib
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlora_lab.control_handler import describe
from mlora_lab.rundir import (
    EventKind,
    MetricsReader,
    RowKind,
    RunDir,
    TenantRow,
    TenantState,
    atomic_write_json,
)
from mlora_lab.search import Action, Search, Sweep
from mlora_lab.spec import Tenant

if TYPE_CHECKING:
    from mlora_lab.train import Trainer

OPTIMIZER_FIELDS = ("lr", "weight_decay", "max_grad_norm")


def load_objective(metric: str) -> Callable[[list[dict]], float] | None:
    """The user's objective function for ``"module:function"`` (None for the built-in metrics)."""
    if ":" not in metric:
        return None
    module, _, name = metric.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"objective {metric!r} is not a function")
    return obj


class SearchController:
    """Runs :class:`~mlora_lab.search.Search` for one :class:`~mlora_lab.train.Trainer`."""

    def __init__(self, trainer: Trainer, sweep: Sweep, saved: dict[str, Any] | None = None) -> None:
        self.tr, self.sweep = trainer, sweep
        self.engine = Search.from_dict(saved["engine"]) if saved else sweep.search()
        self.kept: dict[int, dict[str, Any]] = {int(k): v for k, v in (saved or {}).get("kept", {}).items()}
        self.objective_fn = load_objective(sweep.objective.metric) if trainer.dist.is_main else None
        self._said_pruned = {t.id for t in self.engine.trials if t.state == "pruned"}
        # rows written before a resume: a trial's train-loss objective looks back over them too
        self.past_rows: list[dict] = []
        if saved and trainer.dist.is_main and trainer.run is not None:
            reader = MetricsReader(trainer.run.metrics)
            reader.poll()
            self.past_rows = [r.to_dict() for r in reader.rows]  # (the reader's rows are typed)

    # -- what the trainer asks ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """For checkpoints: the engine's state and the kept states of paused trials."""
        return {"engine": self.engine.to_dict(), "kept": {str(k): v for k, v in self.kept.items()}}

    def not_in_slots(self) -> set[str]:
        """Trial tenants the job must not start by itself on resume: those not running (the search
        restores or starts them)."""
        return {self.name(t.id) for t in self.engine.trials if t.state != "running" or t.id in self.kept}

    @property
    def active(self) -> bool:
        """Trials still run, or can still start or be promoted."""
        return not self.engine.done

    def name(self, trial_id: int) -> str:
        return f"{self.sweep.prefix}{trial_id:03d}"

    # -- one step boundary -------------------------------------------------------------------------
    def poll(self) -> None:
        """Report, decide (rank 0) and apply, on every rank. A collective only when something is due."""
        tr = self.tr
        running = [t for t in self.engine.trials if t.state == "running"]
        due, failed = [], []
        for t in running:
            run = tr.tenants.get(self.name(t.id))
            if run is None or run.state is TenantState.FAILED:
                failed.append(t.id)
            elif run.micro == 0 and run.step >= self.engine.next_report(t.id):
                due.append(t.id)
        free = tr.spec.max_tenants - len(tr.model.tenants)
        if not (due or failed or (free > 0 and self.engine.can_fill())):
            return
        evals = self._evaluate(due)
        decided = None
        if tr.dist.is_main:
            decided = self._decide(due, failed, evals, free)
        actions, state = tr.comm.broadcast_object(decided)
        self.engine = Search.from_dict(state)
        for action in actions:
            self._apply(action)
        self._say_pruned()
        if tr.dist.is_main and tr.run is not None:
            try:
                atomic_write_json(tr.run.search, self.engine.to_dict())
            except OSError as e:  # a full disk: the checkpoint still holds it
                print(f"search.json not written: {e}", flush=True)

    def _evaluate(self, due: list[int]) -> dict[str, float]:
        names = [self.name(i) for i in due if self.tr.tenants[self.name(i)].eval_examples]
        wants_eval = self.sweep.objective.metric != "train_loss"
        return self.tr.evaluate(names) if names and wants_eval else {}

    def _decide(self, due: list[int], failed: list[int], evals: dict[str, float], free: int) -> tuple:
        tr, engine, step = self.tr, self.engine, self.tr.global_step
        actions: list[Action] = []
        for i in failed:
            run = tr.tenants.get(self.name(i))
            engine.fail(i, (run.reason if run else None) or "its tenant is gone", step)
        paused = []
        for i in sorted(due):
            run = tr.tenants[self.name(i)]
            actions += engine.report(i, run.step, self._value(i, evals), step)
            if engine.trial(i).state == "paused":
                paused.append(i)
        freed = sum(a.op == "stop" for a in actions)
        actions += engine.fill(free + freed + len(paused), step, tuple(paused))
        return actions, engine.to_dict()

    def _value(self, trial_id: int, evals: dict[str, float]) -> float:
        """The objective of a trial now: its eval loss (when it has eval data), else the mean of its
        last ``window`` train losses, or the user's function of its rows."""
        name, objective = self.name(trial_id), self.sweep.objective
        rows = [r for r in (*self.past_rows, *self.tr.history) if r.get("tenant") == name]
        if self.objective_fn is not None:
            try:
                return float(self.objective_fn(rows))
            except Exception as e:  # one trial's bad objective is that trial's NaN, not the job's end
                print(f"objective of {name}: {describe(e)}", flush=True)
                return math.nan
        if objective.metric == "eval_loss" and name in evals:
            return evals[name]
        losses = [r["loss"] for r in rows if r["kind"] == RowKind.TRAIN and r["loss"] is not None]
        return sum(losses[-objective.window :]) / len(losses[-objective.window :]) if losses else math.nan

    # -- applying an action (every rank) -----------------------------------------------------------
    def _apply(self, a: Action) -> None:
        tr, name = self.tr, self.name(a.trial)
        tr._event(EventKind.SEARCH, f"{a.op} {name}" + (f" from {self.name(a.source)}" if a.source is not None else "")
                  + (f": {a.why}" if a.why else ""))  # fmt: skip
        if a.op == "start":
            error = self._agreed(lambda: tr.start_trial(self.sweep.trial_tenant(a.trial, a.config)))
            if error is not None:
                self.engine.fail(a.trial, f"could not start: {error}", tr.global_step)
        elif a.op == "pause":
            tr.save_adapter(name)
            self.kept[a.trial] = tr.checkpointer.tenant_state(name)
            tr.release_slot(name, TenantState.PAUSED, a.why or "waits for a promotion")
        elif a.op == "restore":
            saved = self.kept.pop(a.trial)
            error = self._agreed(lambda: tr.start_trial(Tenant.from_dict(saved["spec"]), saved))
            if error is not None:
                self.engine.fail(a.trial, f"could not be restored: {error}", tr.global_step)
        elif a.op == "stop":
            if name in tr.tenants:
                tr.release_slot(name, None, None)
        elif a.op == "exploit":
            source = tr.checkpointer.tenant_state(self.name(a.source))
            tr.checkpointer.restore_tenant(name, source, whole=False)
            run = tr.tenants[name]
            settings = {k: v for k, v in a.config.items() if k in OPTIMIZER_FIELDS}
            run.optimizer.set_hyperparameters(**settings)
            run.spec = dataclasses.replace(run.spec, **settings)
        # "continue": the trial goes on in its slot

    def _say_pruned(self) -> None:
        """A tenant row for each trial pruned now that nothing can promote it any more."""
        for t in self.engine.trials:
            if t.state == "pruned" and t.id not in self._said_pruned:
                self._said_pruned.add(t.id)
                self.kept.pop(t.id, None)  # its state is not needed any more (its adapter is saved)
                self.tr._log(TenantRow(step=self.tr.global_step, tenant=self.name(t.id), state=TenantState.REMOVED,
                                       reason=f"pruned: {t.reason}"))  # fmt: skip

    def _agreed(self, prepare: Callable[[], Any]) -> str | None:
        """Run ``prepare`` (returns a Change) on every rank; commit if it worked everywhere, else undo
        and return the first error (the same on every rank)."""
        change, error = None, None
        try:
            change = prepare()
        except Exception as e:
            error = describe(e)
        first = next((e for e in self.tr.comm.gather_objects(error) if e), None)
        if first is None:
            change.commit()
            return None
        if change is not None:
            change.undo()
        return first


def read_sweep(run_root: Any) -> Sweep | None:
    """The run's ``sweep.json`` (None when the run is not a sweep)."""
    path = RunDir(run_root).sweep
    if not path.is_file():
        return None
    return Sweep.from_dict(json.loads(path.read_text(encoding="utf-8")))
