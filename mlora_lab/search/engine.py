"""Trials, actions and the search engine: :class:`Search` decides, from the objectives reported at step
boundaries, which trial starts, pauses, is promoted, stops or (PBT) exploits another; pure Python, seeded,
its whole state JSON (see :mod:`mlora_lab.search`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.rundir.files import TextEnum
from mlora_lab.search.space import (
    ASHA,
    PBT,
    Choice,
    Distribution,
    Grid,
    Objective,
    Strategy,
    asha_rungs,
    grid_problem,
    space_from_dict,
    space_to_dict,
    strategy_from_dict,
    strategy_to_dict,
    thawed,
)

# -- trials, actions and the search --------------------------------------------------------------------


class TrialState(TextEnum):
    """A trial's life: ``waiting`` (not started) → ``running`` → ``finished``; ASHA: ``running`` →
    ``paused`` (reached its rung, kept for a possible promotion, holds no slot) → ``running`` again
    (promoted) or ``pruned``; ``failed`` when its tenant failed or could not start."""

    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    PRUNED = "pruned"
    FINISHED = "finished"
    FAILED = "failed"


class ActionOp(TextEnum):
    """What the job does to a trial's tenant slot (see :class:`Action`)."""

    START = "start"
    CONTINUE = "continue"
    RESTORE = "restore"
    PAUSE = "pause"
    STOP = "stop"
    EXPLOIT = "exploit"


@dataclass
class Trial:
    """One configuration being tried: its :class:`TrialState`, rung and last reported step, and
    ``results``, the objective at each tenant step it reported at."""

    id: int
    config: dict[str, Any]
    state: TrialState = TrialState.WAITING
    rung: int = 0
    step: int = 0
    results: dict[int, float] = field(default_factory=dict)
    parent: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        d["results"] = {str(k): v for k, v in self.results.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trial:
        d = dict(d)
        d["state"] = TrialState(d.get("state", TrialState.WAITING))
        d["results"] = {int(k): v for k, v in d.get("results", {}).items()}
        return cls(**d)


@dataclass(frozen=True)
class Action:
    """What the job must do at this step boundary, in order.

    ``start``: add the trial (base tenant + config) to a free slot. ``continue``: a trial that reached its
    rung and was promoted at once goes on in its slot. ``restore``: a paused trial was promoted: put it
    back in a free slot with the state it had. ``pause``: keep the trial's state, free its slot.
    ``stop``: the trial is done (finished or pruned): free its slot. ``exploit``: copy ``source``'s
    adapter, optimiser state and step into the trial, then apply ``config`` (PBT)."""

    op: ActionOp
    trial: int
    source: int | None = None
    config: dict[str, Any] | None = None
    why: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", ActionOp(self.op))


class Search:
    """The state and the decisions of one search. The job calls :meth:`report` when a trial reaches
    the step :meth:`next_report` names, then :meth:`fill` with the number of free slots, and applies
    the returned actions in order. Everything is in :meth:`to_dict`."""

    def __init__(
        self,
        space: dict[str, Distribution],
        strategy: Strategy,
        budget: int,
        seed: int = 0,
        objective: Objective | None = None,
    ) -> None:
        self.space, self.strategy, self.budget = space, strategy, budget
        self.objective = objective or Objective()
        self.rng = random.Random(seed)
        self.seed = seed
        self.trials: list[Trial] = [Trial(i, c) for i, c in enumerate(self._configs())]
        self.decisions: list[dict[str, Any]] = []
        self.rungs = (
            asha_rungs(strategy.min_steps, strategy.eta, budget) if isinstance(strategy, ASHA) else []
        )
        self.rung_results: list[dict[int, float]] = [{} for _ in self.rungs]
        self.promoted: list[list[int]] = [[] for _ in self.rungs]
        self.latest: dict[int, float] = {}  # PBT: every member's latest objective

    # -- the configurations --------------------------------------------------------------------
    def _configs(self) -> list[dict[str, Any]]:
        s = self.strategy
        if isinstance(s, Grid):
            # (counted before it is enumerated: a grid of 4.2e10 points is refused, not a MemoryError)
            too_big = grid_problem(self.space)
            if too_big is not None:
                raise ValueError(too_big)
            names = list(self.space)
            values = [[thawed(v) for v in self.space[n].values] for n in names]
            return [dict(zip(names, combo)) for combo in itertools.product(*values)]
        n = s.population if isinstance(s, PBT) else s.n
        return [{name: d.sample(self.rng) for name, d in self.space.items()} for _ in range(n)]

    # -- what the job asks -------------------------------------------------------------------
    def trial(self, trial_id: int) -> Trial:
        return self.trials[trial_id]

    def next_report(self, trial_id: int) -> int:
        """The tenant step at which the job reports this running trial's objective next."""
        t, s = self.trials[trial_id], self.strategy
        if isinstance(s, ASHA):
            return self.rungs[t.rung]
        if isinstance(s, PBT):
            return min((t.step // s.interval + 1) * s.interval, self.budget)
        return self.budget

    @property
    def done(self) -> bool:
        """No trial runs and none can start or be promoted."""
        return (
            all(t.state not in (TrialState.WAITING, TrialState.RUNNING) for t in self.trials)
            and not self.can_fill()
        )

    def can_fill(self) -> bool:
        """A free slot would be used now: a trial waits to start, or one can be promoted (or, ASHA with
        none trained to the budget, finish the search)."""
        return (
            any(t.state is TrialState.WAITING for t in self.trials)
            or self._promotable() is not None
            or self._finisher() is not None
        )

    def report(
        self, trial_id: int, step: int, value: float, global_step: int = 0, why: str = ""
    ) -> list[Action]:
        """The trial reached ``step`` (= :meth:`next_report`) with objective ``value``. A value that is not
        a finite number (NaN, ±inf: its objective raised, ``why``, or its training diverged) is no result:
        the trial fails, and is never promoted, exploited or the best."""
        t = self.trials[trial_id]
        value = float(value)
        if not math.isfinite(value):
            t.step = step
            self.fail(
                trial_id,
                f"its objective at step {step} is {value}" + (f" ({why})" if why else ""),
                global_step,
            )
            return [Action(ActionOp.STOP, t.id, why="failed")]
        t.step, t.results[step] = step, value
        s = self.strategy
        if step >= self.budget:
            t.state = TrialState.FINISHED
            self._say(global_step, t, "finish", f"trained its budget of {self.budget} steps")
            self.latest.pop(t.id, None)
            if isinstance(s, ASHA):
                self.rung_results[t.rung][t.id] = float(value)
            return [Action(ActionOp.STOP, t.id, why="finished")]
        if isinstance(s, ASHA):
            self.rung_results[t.rung][t.id] = float(value)
            t.state = TrialState.PAUSED  # until fill() promotes it (maybe right away) or it stays behind
            return []
        if isinstance(s, PBT):
            self.latest[t.id] = float(value)
            return self._pbt_step(t, global_step)
        return []

    def fail(self, trial_id: int, why: str, global_step: int = 0) -> None:
        """The trial's tenant failed (quarantined, or could not start): it takes no further part."""
        t = self.trials[trial_id]
        t.state, t.reason = TrialState.FAILED, why
        self.latest.pop(t.id, None)
        self._say(global_step, t, "fail", why)

    def fill(self, free: int, global_step: int = 0, paused_in_slot: tuple[int, ...] = ()) -> list[Action]:
        """Use ``free`` slots (those of trials that paused at this boundary count as free). Returns
        pauses first (slots handed back), then continues, restores and starts."""
        actions: list[Action] = []
        for _ in range(max(free, 0)):
            job = self._get_job(global_step, paused_in_slot)
            if job is None:
                break
            actions.append(job)
        promoted_now = {a.trial for a in actions if a.op is ActionOp.CONTINUE}
        pauses = [
            Action(ActionOp.PAUSE, i, why=self.trials[i].reason or "")
            for i in paused_in_slot
            if self.trials[i].state is TrialState.PAUSED and i not in promoted_now
        ]
        if isinstance(self.strategy, ASHA) and self.done:
            for t in self.trials:
                if t.state is TrialState.PAUSED:  # where it stands in its rung now that the rung is complete
                    rank, k = self._ranked(t.rung).index(t.id) + 1, t.rung
                    t.state = TrialState.PRUNED
                    t.reason = (
                        f"rank {rank} of {len(self.rung_results[k])} at rung {k} ({self.rungs[k]} steps): "
                        f"not in the top 1/{self.strategy.eta}"
                    )
                    self._say(global_step, t, "prune", t.reason)
        return pauses + actions

    # -- strategies --------------------------------------------------------------------------
    def _get_job(self, global_step: int, paused_in_slot: tuple[int, ...]) -> Action | None:
        if isinstance(self.strategy, ASHA):
            found = self._promotable()
            if found is not None:
                t, k = found
                self.promoted[k].append(t.id)
                t.rung, t.state, t.reason = k + 1, TrialState.RUNNING, None
                rank = self._ranked(k).index(t.id) + 1
                self._say(
                    global_step,
                    t,
                    "promote",
                    f"rank {rank} of {len(self.rung_results[k])} at rung {k} ({self.rungs[k]} steps): "
                    f"in the top 1/{self.strategy.eta}; trains to {self.rungs[k + 1]} steps",
                )
                return Action(
                    ActionOp.CONTINUE if t.id in paused_in_slot else ActionOp.RESTORE, t.id, why="promoted"
                )
            for t in self.trials:  # a paused trial that was not promoted: why it waits
                if t.state is TrialState.PAUSED and t.reason is None:
                    rank = self._ranked(t.rung).index(t.id) + 1
                    t.reason = (
                        f"rank {rank} of {len(self.rung_results[t.rung])} at rung {t.rung}: "
                        f"not in the top 1/{self.strategy.eta}"
                    )
        waiting = next((t for t in self.trials if t.state is TrialState.WAITING), None)
        if waiting is None:
            return self._finish_best(global_step, paused_in_slot)
        waiting.state = TrialState.RUNNING
        self._say(global_step, waiting, "start", _brief_config(waiting.config))
        return Action(ActionOp.START, waiting.id, config=dict(waiting.config), why="a free slot")

    def _ranked(self, k: int) -> list[int]:
        """Trial ids of rung ``k``, best first (ties: the earlier trial first)."""
        results = self.rung_results[k]
        return sorted(results, key=lambda i: (self.objective.key(results[i]), i))

    def _promotable(self) -> tuple[Trial, int] | None:
        """ASHA's get_job: from the highest rung below the top down, the best trial of the top
        ``⌊|rung k| / η⌋`` not yet promoted from rung ``k``."""
        if not isinstance(self.strategy, ASHA):
            return None
        for k in reversed(range(len(self.rungs) - 1)):
            top = self._ranked(k)[: len(self.rung_results[k]) // self.strategy.eta]
            for i in top:
                if i not in self.promoted[k] and self.trials[i].state is TrialState.PAUSED:
                    return self.trials[i], k
        return None

    def _finisher(self) -> tuple[Trial, int] | None:
        """ASHA out of work with no trial trained to the budget (too few trials for its rungs: ``n=6,
        eta=3`` and rungs at 5, 15, 45, 60 steps promote at most 4, 2, 0): the best trial of the highest
        rung reached, and that rung. None while anything else can still happen."""
        if not isinstance(self.strategy, ASHA) or self._promotable() is not None:
            return None
        busy = (TrialState.WAITING, TrialState.RUNNING, TrialState.FINISHED)
        if any(t.state in busy for t in self.trials):
            return None
        for k in reversed(range(len(self.rungs) - 1)):
            for i in self._ranked(k):
                t = self.trials[i]
                if t.state is TrialState.PAUSED and t.rung == k:
                    return t, k
        return None

    def _finish_best(self, global_step: int, paused_in_slot: tuple[int, ...]) -> Action | None:
        """Promote :meth:`_finisher`'s trial straight to the budget, so the search ends with a trial
        trained as asked (its decision says why)."""
        found = self._finisher()
        if found is None:
            return None
        t, k = found
        top = len(self.rungs) - 1
        self.promoted[k].append(t.id)
        t.rung, t.state, t.reason = top, TrialState.RUNNING, None
        self._say(
            global_step,
            t,
            "promote",
            f"no trial trained to the budget (n={self.strategy.n} trials are too few for eta="
            f"{self.strategy.eta} over {len(self.rungs)} rungs): the best of rung {k} ({self.rungs[k]} steps) "
            f"trains on to the budget ({self.budget} steps)",
        )
        op = ActionOp.CONTINUE if t.id in paused_in_slot else ActionOp.RESTORE
        return Action(op, t.id, why="the best trial finishes the search")

    def _pbt_step(self, t: Trial, global_step: int) -> list[Action]:
        s = self.strategy
        members = sorted(self.latest, key=lambda i: (self.objective.key(self.latest[i]), i))
        cut = max(1, int(len(members) * s.quantile))
        if len(members) < 2 or t.id not in members[-cut:] or t.id in members[:cut]:
            return []
        source = self.trials[members[:cut][self.rng.randrange(cut)]]
        config = dict(source.config)
        for name, d in self.space.items():
            if isinstance(d, Choice):
                if self.rng.random() < s.resample:
                    config[name] = d.sample(self.rng)
            else:
                config[name] = d.perturb(config[name], s.perturb[self.rng.randrange(len(s.perturb))])
        why = (
            f"objective {self.latest[t.id]:.4g} in the bottom {s.quantile:.0%}: copies trial {source.id} "
            f"({self.latest[source.id]:.4g}) and explores {_brief_config(config)}"
        )
        # (members step together: the source is at this same tenant step, so the copy keeps t.step)
        t.config, t.parent = config, source.id
        self.latest[t.id] = self.latest[source.id]
        self._say(global_step, t, "exploit", why)
        return [Action(ActionOp.EXPLOIT, t.id, source=source.id, config=dict(config), why=why)]

    def _say(self, global_step: int, t: Trial, action: str, why: str) -> None:
        self.decisions.append({"step": global_step, "trial": t.id, "action": action, "why": why})

    # -- results -----------------------------------------------------------------------------
    def best_value(self, trial: Trial) -> float | None:
        """The trial's best reported objective (None before its first report)."""
        values = [v for v in trial.results.values() if math.isfinite(v)]
        if not values:
            return None
        return min(values) if self.objective.mode == "min" else max(values)

    def final_value(self, trial: Trial) -> float | None:
        """The objective at the furthest step the trial reported."""
        return trial.results[max(trial.results)] if trial.results else None

    def best_trial(self) -> Trial | None:
        """The trial whose objective at its furthest step is best, preferring trials that went
        further (an ASHA trial pruned early is not compared with one trained to the top). A trial that
        failed (its tenant diverged or raised, its objective was not a number) is never the best."""
        done = [
            t
            for t in self.trials
            if t.results and t.state is not TrialState.FAILED and math.isfinite(self.final_value(t))
        ]
        if not done:
            return None
        return min(done, key=lambda t: (-max(t.results), self.objective.key(self.final_value(t)), t.id))

    # -- state -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "space": space_to_dict(self.space),
            "strategy": strategy_to_dict(self.strategy),
            "budget": self.budget,
            "seed": self.seed,
            "objective": dataclasses.asdict(self.objective),
            "rng": [version, list(internal), gauss],
            "trials": [t.to_dict() for t in self.trials],
            "decisions": list(self.decisions),
            "rungs": list(self.rungs),
            "rung_results": [{str(i): v for i, v in r.items()} for r in self.rung_results],
            "promoted": [list(p) for p in self.promoted],
            "latest": {str(i): v for i, v in self.latest.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Search:
        search = cls.__new__(cls)
        search.space = space_from_dict(d["space"])
        search.strategy = strategy_from_dict(d["strategy"])
        search.budget, search.seed = d["budget"], d["seed"]
        search.objective = Objective(**d["objective"])
        search.rng = random.Random()
        version, internal, gauss = d["rng"]
        search.rng.setstate((version, tuple(internal), gauss))
        search.trials = [Trial.from_dict(t) for t in d["trials"]]
        search.decisions = list(d["decisions"])
        search.rungs = list(d["rungs"])
        search.rung_results = [{int(i): v for i, v in r.items()} for r in d["rung_results"]]
        search.promoted = [list(p) for p in d["promoted"]]
        search.latest = {int(i): v for i, v in d["latest"].items()}
        return search


def _brief_config(config: dict[str, Any]) -> str:
    parts = []
    for k, v in config.items():
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    return ", ".join(parts)
