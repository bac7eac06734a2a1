"""Hyperparameter search inside one job: the search space, the strategies and their decisions.

Tenants are the trials. A search decides, at step boundaries, which trial starts in a free tenant slot,
which one stops, which one continues, and (PBT) which one takes over another's weights. This module is
the decision engine only: pure Python, seeded, no torch, its whole state JSON; the job applies its
actions to tenant slots (:mod:`mlora_lab.search_job`) and the notebook reads its state.

Strategies (``budget`` = the most tenant steps any trial trains, ``R``):

* :class:`Grid` / :class:`Random` ``(n)``: every trial trains ``R`` steps; trials start as slots free up.
* :class:`ASHA` ``(n, min_steps=r, eta=η)``: asynchronous successive halving (Li et al., "A System for
  Massively Parallel Hyperparameter Tuning", MLSys 2020, Algorithm 2). Rungs at ``r, rη, rη², …`` tenant
  steps, capped by ``R`` (the top rung). A trial trains to its rung and reports the objective there.
  Whenever a slot is free, ``get_job`` looks from the highest rung down for a trial in the top
  ``⌊|rung k| / η⌋`` of rung ``k`` that was not promoted from it yet, and promotes the best such trial to
  rung ``k + 1`` (it continues from where it stopped, its state kept while it waited); if none, a new
  trial starts at rung 0. Nobody waits for a rung to fill. A trial that is never promoted is *pruned*.
* :class:`PBT` ``(population, interval)``: population-based training (Jaderberg et al. 2017) with
  truncation selection. Every ``interval`` tenant steps a member reports; if its latest objective is in
  the bottom ``quantile`` of the population's latest objectives, it *exploits* a member drawn from the
  top ``quantile`` (copies its adapter, optimiser state and step) and *explores* (each searched value
  multiplied by a factor drawn from ``perturb``, clipped to its range; a choice resampled with
  probability ``resample``). Only optimiser settings can be searched by PBT (weights are copied between
  members, so their shapes must agree).

The objective is ``eval_loss`` (a trial with eval data is evaluated when it reports), ``train_loss``
(the mean of its last ``window`` logged train losses) or ``"module:function"``, a function of the
trial's metrics rows the job imports; ``mode`` is ``min`` or ``max``.

Determinism: the configurations come from ``random.Random(seed)``, and every decision is a function of
the reports in the order they arrive (the job reports in trial order at each step boundary), so the
same seed and the same metrics give the same trials and the same decisions, also across a stop and
resume (the state, the generator's included, is in every checkpoint).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mlora_lab.rundir.files import TextEnum

__all__ = [
    "ASHA",
    "PBT",
    "SEARCHABLE",
    "Action",
    "ActionOp",
    "Choice",
    "Grid",
    "IntUniform",
    "LogUniform",
    "Objective",
    "Random",
    "Search",
    "Sweep",
    "Trial",
    "TrialState",
    "Uniform",
    "asha_rungs",
    "choice",
    "dist_from_dict",
    "loguniform",
    "randint",
    "search_problems",
    "space_from_dict",
    "space_to_dict",
    "strategy_from_dict",
    "uniform",
]

SEARCHABLE = (
    "lr",
    "rank",
    "alpha",
    "use_rslora",
    "dropout",
    "target_modules",
    "weight_decay",
    "schedule",
    "warmup_steps",
    "max_grad_norm",
    "batch_size",
    "grad_accum",
    "seed",
)
"""Tenant fields a search may vary."""

PBT_SEARCHABLE = ("lr", "weight_decay", "max_grad_norm")
"""What PBT may vary: settings of the optimiser, which can change while a member trains."""


# -- distributions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Range:
    """A continuous range ``[low, high]``; PBT's explore multiplies a value and clips it to the range."""

    low: float
    high: float

    def perturb(self, value: float, factor: float) -> float:
        return min(max(value * factor, self.low), self.high)


@dataclass(frozen=True)
class LogUniform(_Range):
    """``exp(U(log low, log high))``: learning rates, weight decay."""

    kind: ClassVar[str] = "loguniform"

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))

    def problems(self, name: str) -> list[str]:
        if not (_num(self.low) and _num(self.high) and 0 < self.low <= self.high):
            return [
                f"search space {name}: loguniform needs 0 < low <= high (got {self.low!r}, {self.high!r})"
            ]
        return []


@dataclass(frozen=True)
class Uniform(_Range):
    """``U(low, high)``."""

    kind: ClassVar[str] = "uniform"

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def problems(self, name: str) -> list[str]:
        if not (_num(self.low) and _num(self.high) and self.low <= self.high):
            return [f"search space {name}: uniform needs low <= high (got {self.low!r}, {self.high!r})"]
        return []


@dataclass(frozen=True)
class IntUniform:
    """A whole number from ``low`` to ``high``, both included."""

    low: int
    high: int
    kind: ClassVar[str] = "randint"

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def perturb(self, value: int, factor: float) -> int:
        return int(min(max(round(value * factor), self.low), self.high))

    def problems(self, name: str) -> list[str]:
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high))
        if not (ok and self.low <= self.high):
            return [
                f"search space {name}: randint needs whole numbers low <= high (got {self.low!r}, {self.high!r})"
            ]
        return []


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (numbers, strings, booleans, or lists such as target module names)."""

    values: tuple
    kind: ClassVar[str] = "choice"

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(_frozen(v) for v in self.values))

    def sample(self, rng: random.Random) -> Any:
        return _thawed(self.values[rng.randrange(len(self.values))])

    def perturb(self, value: Any, factor: float) -> Any:
        return value

    def problems(self, name: str) -> list[str]:
        if not self.values:
            return [f"search space {name}: choice needs at least one value"]
        if len(set(self.values)) != len(self.values):
            return [f"search space {name}: choice has a value twice"]
        return []


Distribution = LogUniform | Uniform | IntUniform | Choice
_KINDS = {cls.kind: cls for cls in (LogUniform, Uniform, IntUniform, Choice)}


def loguniform(low: float, high: float) -> LogUniform:
    return LogUniform(low, high)


def uniform(low: float, high: float) -> Uniform:
    return Uniform(low, high)


def randint(low: int, high: int) -> IntUniform:
    return IntUniform(low, high)


def choice(*values: Any) -> Choice:
    """``choice(4, 8, 16)`` or ``choice([4, 8, 16])``."""
    if len(values) == 1 and isinstance(values[0], list | tuple):
        values = tuple(values[0])
    return Choice(tuple(values))


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _thawed(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def dist_to_dict(d: Distribution) -> dict[str, Any]:
    if isinstance(d, Choice):
        return {"kind": d.kind, "values": [_thawed(v) for v in d.values]}
    return {"kind": d.kind, "low": d.low, "high": d.high}


def dist_from_dict(d: Any) -> Distribution:
    """A distribution from its JSON form (``ValueError`` naming the problem otherwise)."""
    if isinstance(d, LogUniform | Uniform | IntUniform | Choice):
        return d
    if isinstance(d, list):  # a bare list is a choice
        return Choice(tuple(d))
    if not isinstance(d, dict) or d.get("kind") not in _KINDS:
        raise ValueError(
            f"not a distribution: {str(d)[:80]!r} (kinds: {', '.join(_KINDS)}, or a list of values)"
        )
    cls = _KINDS[d["kind"]]
    keys = {"kind", "values"} if cls is Choice else {"kind", "low", "high"}
    if set(d) != keys:
        raise ValueError(f"a {d['kind']} has the keys {sorted(keys)}, got {sorted(map(str, d))}")
    return Choice(tuple(d["values"])) if cls is Choice else cls(d["low"], d["high"])


def space_to_dict(space: dict[str, Distribution]) -> dict[str, Any]:
    return {name: dist_to_dict(d) for name, d in space.items()}


def space_from_dict(d: Any) -> dict[str, Distribution]:
    if not isinstance(d, dict):
        raise ValueError(f"a search space is an object of field -> distribution, not {type(d).__name__}")
    return {str(k): dist_from_dict(v) for k, v in d.items()}


# -- strategies and the objective --------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """Every combination of the space's choices (each field must be a :class:`Choice`)."""

    kind: ClassVar[str] = "grid"


@dataclass(frozen=True)
class Random:
    """``n`` configurations drawn from the space."""

    n: int
    kind: ClassVar[str] = "random"


@dataclass(frozen=True)
class ASHA:
    """Asynchronous successive halving over ``n`` drawn configurations: rungs at ``min_steps · eta^k``
    tenant steps (and the budget as the top rung), the top ``1/eta`` of a rung promoted."""

    n: int
    min_steps: int
    eta: int = 3
    kind: ClassVar[str] = "asha"


@dataclass(frozen=True)
class PBT:
    """Population-based training of ``population`` members, a decision every ``interval`` steps."""

    population: int
    interval: int
    quantile: float = 0.25
    perturb: tuple[float, float] = (0.8, 1.25)
    resample: float = 0.25
    kind: ClassVar[str] = "pbt"


Strategy = Grid | Random | ASHA | PBT
_STRATEGIES = {cls.kind: cls for cls in (Grid, Random, ASHA, PBT)}


def strategy_to_dict(s: Strategy) -> dict[str, Any]:
    return {
        "kind": s.kind,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(s).items()},
    }


def strategy_from_dict(d: Any) -> Strategy:
    if isinstance(d, Grid | Random | ASHA | PBT):
        return d
    if not isinstance(d, dict) or d.get("kind") not in _STRATEGIES:
        raise ValueError(f"not a strategy: {str(d)[:80]!r} (kinds: {', '.join(_STRATEGIES)})")
    cls = _STRATEGIES[d["kind"]]
    args = {k: v for k, v in d.items() if k != "kind"}
    names = {f.name for f in dataclasses.fields(cls)}
    if set(args) - names:
        raise ValueError(f"{d['kind']} has no {', '.join(sorted(set(args) - names))}")
    if "perturb" in args:
        args["perturb"] = tuple(args["perturb"])
    return cls(**args)


@dataclass(frozen=True)
class Objective:
    """What a trial is judged by: ``eval_loss``, ``train_loss`` (mean of the last ``window`` logged
    train losses) or ``"module:function"`` (``function(rows) -> float`` of the trial's metrics rows);
    ``mode`` ``min`` or ``max``."""

    metric: str = "eval_loss"
    mode: str = "min"
    window: int = 5

    def better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def key(self, value: float) -> float:
        """Sort key: ascending = best first (NaN last)."""
        if value is None or math.isnan(value):
            return math.inf
        return value if self.mode == "min" else -value

    def problems(self) -> list[str]:
        out = []
        if self.mode not in ("min", "max"):
            out.append(f"objective mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.metric, str) or not (
            self.metric in ("eval_loss", "train_loss") or _is_reference(self.metric)
        ):
            out.append(
                f"objective metric must be 'eval_loss', 'train_loss' or 'module:function', got {str(self.metric)[:80]!r}"
            )
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            out.append(f"objective window must be a whole number >= 1, got {self.window!r}")
        return out


def _is_reference(text: str) -> bool:
    module, _, name = text.partition(":")
    return bool(module and name) and all(p.isidentifier() for p in (*module.split("."), *name.split(".")))


def asha_rungs(min_steps: int, eta: int, budget: int) -> list[int]:
    """Tenant steps of the rungs: ``min_steps · eta^k`` below ``budget``, then ``budget``."""
    rungs, r = [], min_steps
    while r < budget:
        rungs.append(r)
        r *= eta
    return [*rungs, budget]


def search_problems(
    space: Any, strategy: Any, budget: Any, objective: Objective, slots: int, max_rank: int
) -> list[str]:
    """Every problem of a search definition that needs no model or data (those are checked with the
    job's tenants, :mod:`mlora_lab.validate`): unknown or unsearchable fields, bad distributions, a
    grid over a continuous range, rank values above ``max_rank``, strategy settings out of range, a
    PBT population that does not fit the free slots."""
    out: list[str] = []
    if not isinstance(space, dict) or not space:
        return ["the search space must be a non-empty object of tenant field -> distribution"]
    for name, d in space.items():
        if name not in SEARCHABLE:
            out.append(
                f"search space: {str(name)[:40]!r} cannot be searched; searchable: {', '.join(SEARCHABLE)}"
            )
            continue
        if not isinstance(d, LogUniform | Uniform | IntUniform | Choice):
            out.append(f"search space {name}: not a distribution ({type(d).__name__})")
            continue
        out += d.problems(name)
        if name == "rank":
            values = d.values if isinstance(d, Choice) else (d.low, d.high)
            too_big = [v for v in values if isinstance(v, int) and v > max_rank]
            if too_big:
                out.append(f"search space rank: {too_big} above the job's max_rank = {max_rank}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        out.append(f"the budget (steps per trial) must be a whole number >= 1, got {budget!r}")
        budget = None
    s = strategy
    if isinstance(s, Grid):
        ranges = [n for n, d in space.items() if not isinstance(d, Choice)]
        if ranges:
            out.append(
                f"a grid needs a choice of values for every field; {', '.join(ranges)} are ranges (use random or asha)"
            )
    elif isinstance(s, Random | ASHA):
        if not isinstance(s.n, int) or isinstance(s.n, bool) or not 1 <= s.n <= 10_000:
            out.append(f"{s.kind}: n (trials) must be a whole number from 1 to 10000, got {s.n!r}")
        if isinstance(s, ASHA):
            if not isinstance(s.eta, int) or isinstance(s.eta, bool) or s.eta < 2:
                out.append(f"asha: eta must be a whole number >= 2, got {s.eta!r}")
            if not isinstance(s.min_steps, int) or isinstance(s.min_steps, bool) or s.min_steps < 1:
                out.append(f"asha: min_steps must be a whole number >= 1, got {s.min_steps!r}")
            elif budget is not None and s.min_steps >= budget:
                out.append(
                    f"asha: min_steps ({s.min_steps}) must be below the budget ({budget} steps): no rung to prune at"
                )
    elif isinstance(s, PBT):
        fixed = [n for n in space if n not in PBT_SEARCHABLE]
        if fixed:
            out.append(
                f"pbt copies weights between members, so it can only vary {', '.join(PBT_SEARCHABLE)}; "
                f"not {', '.join(fixed)}"
            )
        if not isinstance(s.population, int) or isinstance(s.population, bool) or s.population < 2:
            out.append(f"pbt: population must be a whole number >= 2, got {s.population!r}")
        elif s.population > slots:
            out.append(
                f"pbt: a population of {s.population} needs as many free tenant slots; the job has {slots}"
            )
        if not isinstance(s.interval, int) or isinstance(s.interval, bool) or s.interval < 1:
            out.append(f"pbt: interval must be a whole number >= 1, got {s.interval!r}")
        if not (_num(s.quantile) and 0 < s.quantile <= 0.5):
            out.append(f"pbt: quantile must be in (0, 0.5], got {s.quantile!r}")
        if not (isinstance(s.perturb, tuple) and s.perturb and all(_num(f) and f > 0 for f in s.perturb)):
            out.append(f"pbt: perturb must be positive factors, got {s.perturb!r}")
        if not (_num(s.resample) and 0 <= s.resample <= 1):
            out.append(f"pbt: resample must be a probability, got {s.resample!r}")
    else:
        out.append(f"unknown strategy {type(s).__name__}; use Grid, Random, ASHA or PBT")
    if slots < 1:
        out.append("the job has no free tenant slot for trials (raise max_tenants)")
    return out + objective.problems()


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
            names = list(self.space)
            values = [[_thawed(v) for v in self.space[n].values] for n in names]
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
        """A free slot would be used now: a trial waits to start, or one can be promoted."""
        return any(t.state is TrialState.WAITING for t in self.trials) or self._promotable() is not None

    def report(self, trial_id: int, step: int, value: float, global_step: int = 0) -> list[Action]:
        """The trial reached ``step`` (= :meth:`next_report`) with objective ``value``."""
        t = self.trials[trial_id]
        t.step, t.results[step] = step, float(value)
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
            return None
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
        values = [v for v in trial.results.values() if not math.isnan(v)]
        if not values:
            return None
        return min(values) if self.objective.mode == "min" else max(values)

    def final_value(self, trial: Trial) -> float | None:
        """The objective at the furthest step the trial reported."""
        return trial.results[max(trial.results)] if trial.results else None

    def best_trial(self) -> Trial | None:
        """The trial whose objective at its furthest step is best, preferring trials that went
        further (an ASHA trial pruned early is not compared with one trained to the top)."""
        done = [t for t in self.trials if t.results and t.state is not TrialState.FAILED]
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


# -- the sweep: what a job searches ---------------------------------------------------------------------


@dataclass
class Sweep:
    """A search over tenant settings inside one job (``<run_dir>/sweep.json``): trial ``i`` is the
    tenant ``base`` with ``name = f"{prefix}{i:03d}"``, the trial's configuration applied and
    ``max_steps = budget``."""

    base: Any  # mlora_lab.spec.Tenant
    space: dict[str, Distribution]
    strategy: Strategy
    budget: int
    seed: int = 0
    objective: Objective = field(default_factory=Objective)
    prefix: str = "trial-"

    def trial_tenant(self, trial_id: int, config: dict[str, Any]) -> Any:
        """The tenant of trial ``trial_id`` with ``config``."""
        return dataclasses.replace(
            self.base, name=f"{self.prefix}{trial_id:03d}", max_steps=self.budget, **_tenant_values(config)
        )

    def trial_id(self, name: str) -> int | None:
        """The trial a tenant name belongs to (None: not a trial of this sweep)."""
        rest = name[len(self.prefix) :] if name.startswith(self.prefix) else ""
        return int(rest) if rest.isdigit() and len(rest) >= 3 else None

    def search(self) -> Search:
        """A fresh :class:`Search` for this sweep."""
        return Search(self.space, self.strategy, self.budget, self.seed, self.objective)

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base.to_dict(),
            "space": space_to_dict(self.space),
            "strategy": strategy_to_dict(self.strategy),
            "budget": self.budget,
            "seed": self.seed,
            "objective": dataclasses.asdict(self.objective),
            "prefix": self.prefix,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Sweep:
        """From ``sweep.json``'s object; ``ValueError`` naming the problem otherwise."""
        from mlora_lab.spec import SpecError, Tenant

        if not isinstance(d, dict):
            raise ValueError("sweep.json must hold a JSON object")
        unknown = set(d) - {"base", "space", "strategy", "budget", "seed", "objective", "prefix"}
        if unknown:
            raise ValueError(f"sweep.json: unknown keys {sorted(map(str, unknown))}")
        try:
            base = Tenant.from_dict(d["base"])
        except (KeyError, SpecError) as e:
            raise ValueError(f"sweep.json: base tenant: {e}") from None
        objective = d.get("objective", {})
        return cls(
            base=base,
            space=space_from_dict(d.get("space")),
            strategy=strategy_from_dict(d.get("strategy")),
            budget=d.get("budget"),
            seed=d.get("seed", 0),
            objective=Objective(**objective) if isinstance(objective, dict) else Objective(str(objective)),
            prefix=d.get("prefix", "trial-"),
        )


def _tenant_values(config: dict[str, Any]) -> dict[str, Any]:
    """A configuration as tenant field values (choices of lists come back as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
