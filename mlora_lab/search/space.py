"""Search spaces, strategies and the objective: what a search may vary and how, as plain data with
JSON forms, and :func:`search_problems`, every problem of a search definition that needs no model."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

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
    "pref.beta",
    "pref.label_smoothing",
)
"""Tenant fields a search may vary; ``pref.<field>`` is a field of a preference tenant's
:class:`~mlora_lab.spec.parts.Preference` (a β sweep: ten DPO variants on one base)."""

PBT_SEARCHABLE = ("lr", "weight_decay", "max_grad_norm")
"""What PBT may vary: settings of the optimiser, which can change while a member trains."""

MAX_TRIALS = 10_000
"""The most trials a search may hold (``n`` of random and ASHA, the points of a grid): every trial is a
row of its state, its decisions and its table."""


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
        return thawed(self.values[rng.randrange(len(self.values))])

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


def thawed(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def dist_to_dict(d: Distribution) -> dict[str, Any]:
    if isinstance(d, Choice):
        return {"kind": d.kind, "values": [thawed(v) for v in d.values]}
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
    """What a trial is judged by: ``eval_loss`` (the held-out loss of its ``heldout_data``), ``train_loss`` (mean of the last ``window`` logged
    train losses), an evaluation's score ``eval/<name>/<metric>`` (its latest, ``JobSpec.evals``) or
    ``"module:function"`` (``function(rows) -> float`` of the trial's metrics rows); ``mode`` ``min`` or
    ``max``."""

    metric: str = "eval_loss"
    mode: str = "min"
    window: int = 5

    def better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def key(self, value: float) -> float:
        """Sort key: ascending = best first (NaN and ±inf last: no objective, not the best one)."""
        if value is None or not math.isfinite(value):
            return math.inf
        return value if self.mode == "min" else -value

    def function(self) -> Callable[[list[dict]], float] | None:
        """The user's function for a ``"module:function"`` metric (None for ``eval_loss`` / ``train_loss``),
        imported; ``ValueError`` saying why it cannot be used: the module does not import, has no such
        name, or the name is not a Python function (``sys:exit``, a class or a builtin would be called with
        the trial's rows)."""
        if self.metric in ("eval_loss", "train_loss") or is_eval_score(self.metric):
            return None
        if not isinstance(self.metric, str) or not _is_reference(self.metric):
            raise ValueError(f"objective {str(self.metric)[:80]!r} is not 'module:function'")
        module, _, name = self.metric.partition(":")
        try:
            found: Any = importlib.import_module(module)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # (a module that calls sys.exit() on import, too)
            raise ValueError(
                f"objective {self.metric!r}: module {module!r} cannot be imported ({type(e).__name__}: {e})"
            ) from None
        for part in name.split("."):
            found = getattr(found, part, _MISSING)
            if found is _MISSING:
                raise ValueError(f"objective {self.metric!r}: module {module!r} has no {name!r}")
        if not inspect.isfunction(found):
            raise ValueError(
                f"objective {self.metric!r} is {_what(found)}, not a Python function of a trial's rows "
                "(def objective(rows): return ...)"
            )
        return found

    def problems(self) -> list[str]:
        out = []
        if self.mode not in ("min", "max"):
            out.append(f"objective mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.metric, str) or not (
            self.metric in ("eval_loss", "train_loss")
            or _is_reference(self.metric)
            or is_eval_score(self.metric)
        ):
            out.append(
                "objective metric must be 'eval_loss', 'train_loss', an evaluation's 'eval/<name>/<metric>' or "
                f"'module:function', got {str(self.metric)[:80]!r}"
            )
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            out.append(f"objective window must be a whole number >= 1, got {self.window!r}")
        return out


_MISSING = object()


def _what(obj: Any) -> str:
    kind = "a class" if inspect.isclass(obj) else f"a {type(obj).__name__}"
    return kind + (" (a builtin)" if inspect.isbuiltin(obj) else "")


def is_eval_score(text: Any) -> bool:
    """Whether ``text`` names an evaluation's score, ``eval/<name>/<metric>`` (``JobSpec.evals``): a trial's
    latest score is its objective (give ``mode="max"`` for a score where more is better)."""
    return isinstance(text, str) and re.fullmatch(r"eval/[^/]+/[^/]+", text) is not None


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


def asha_reach(n: int, eta: int, rungs: int) -> tuple[list[int], list[int]]:
    """How many of ``n`` trials reach each of ``rungs`` rungs: ``(at least, at most)``.

    Of the ``m`` trials that reach rung ``k``, the top ``⌊m/η⌋`` are promoted by the end of the search
    (so at least ``⌊…⌊n/η⌋…/η⌋``); a trial is promoted only while it is in the top ``⌊s/η⌋`` of the ``s``
    there at the time, which the ``η - 1`` worst of them never are (so at most ``m - η + 1``)."""
    least, most = [n], [n]
    for _ in range(rungs - 1):
        least.append(least[-1] // eta)
        most.append(max(most[-1] - eta + 1, 0))
    return least, most


def asha_warning(strategy: Any, budget: int) -> str | None:
    """What to tell the user before an ASHA search starts whose trials may never train to the budget
    (``n=6, eta=3`` over rungs at 5, 15, 45, 60 steps: at most 4, 2, then 0 trials reach each rung), or
    None. The search then trains its best trial of the highest rung reached on to the budget
    (:class:`~mlora_lab.search.engine.Search`), so it still ends with one trained as asked."""
    s = strategy
    counts = (s.n, s.eta, s.min_steps, budget) if isinstance(s, ASHA) else ()
    if not counts or not all(isinstance(v, int) and not isinstance(v, bool) for v in counts):
        return None
    if not (s.n >= 1 and s.eta >= 2 and 1 <= s.min_steps < budget):  # (refused by the checks anyway)
        return None
    rungs = asha_rungs(strategy.min_steps, strategy.eta, budget)
    least, most = asha_reach(strategy.n, strategy.eta, len(rungs))
    if least[-1] > 0:
        return None
    head = f"ASHA(n={s.n}, eta={s.eta}) with rungs at {', '.join(map(str, rungs))} steps: "
    if most[-1] == 0:
        reach = (
            f"no trial can be promoted to the budget of {budget} steps (at most {', '.join(map(str, most))} "
            "reach each rung), so the search will train its best trial of the highest rung reached on to the "
            "budget at the end"
        )
    else:
        reach = (
            f"a trial is promoted to the budget of {budget} steps only if later trials keep beating earlier "
            f"ones (at least {', '.join(map(str, least))} reach each rung); if none is, the search trains its "
            "best trial of the highest rung reached on to the budget at the end"
        )
    return (
        f"{head}{reach}. n >= {s.eta ** (len(rungs) - 1)} (or fewer rungs: a larger min_steps) promotes one."
    )


def grid_size(space: dict[str, Any]) -> int:
    """The number of points of a grid over ``space`` (the product of its choices' sizes), counted without
    enumerating them."""
    return math.prod(len(d.values) for d in space.values() if isinstance(d, Choice))


def grid_problem(space: dict[str, Any]) -> str | None:
    """Why a grid over ``space`` is too large to run (None when it is not)."""
    size = grid_size(space)
    if size <= MAX_TRIALS:
        return None
    sizes = " x ".join(f"{len(d.values)} {name}" for name, d in space.items() if isinstance(d, Choice))
    return (
        f"a grid of {size:,} points ({sizes}) is more than {MAX_TRIALS:,} trials; "
        "search fewer values, or draw n of them with random or asha"
    )


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
        elif (too_big := grid_problem(space)) is not None:
            out.append(too_big)
    elif isinstance(s, Random | ASHA):
        if not isinstance(s.n, int) or isinstance(s.n, bool) or not 1 <= s.n <= MAX_TRIALS:
            out.append(f"{s.kind}: n (trials) must be a whole number from 1 to {MAX_TRIALS}, got {s.n!r}")
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
