"""The search engine (mlora_lab.search) on scripted metric streams: what the spaces sample, ASHA's
decisions against an independent implementation of the published rule, PBT's exploit/explore, and
the same decisions after the state went through JSON (a stop and resume)."""

from __future__ import annotations

import json
import math
import random

import pytest

from mlora_lab.search import (
    ASHA,
    PBT,
    Grid,
    Objective,
    Random,
    Search,
    asha_rungs,
    choice,
    loguniform,
    randint,
    search_problems,
    uniform,
)

SPACE = {
    "lr": loguniform(1e-5, 1e-2),
    "rank": choice(4, 8, 16),
    "target_modules": choice(["q_proj"], ["q_proj", "v_proj"]),
}


def test_grid_is_every_combination_in_order():
    search = Search({"rank": choice(4, 8), "alpha": choice(8, 16, 32)}, Grid(), budget=10)
    assert [t.config for t in search.trials] == [{"rank": r, "alpha": a} for r in (4, 8) for a in (8, 16, 32)]


def test_random_samples_what_it_says_and_the_seed_fixes_it():
    a = Search(SPACE, Random(200), budget=10, seed=7)
    again, other = (
        Search(SPACE, Random(200), budget=10, seed=7),
        Search(SPACE, Random(200), budget=10, seed=8),
    )
    assert [t.config for t in a.trials] == [t.config for t in again.trials]
    assert [t.config for t in a.trials] != [t.config for t in other.trials]
    lrs = [t.config["lr"] for t in a.trials]
    assert all(1e-5 <= x <= 1e-2 for x in lrs)
    # log-uniform: half the draws below the geometric mean of the range (binomial sd ~ 0.035)
    below = sum(x < math.sqrt(1e-5 * 1e-2) for x in lrs) / len(lrs)
    assert abs(below - 0.5) < 0.12
    assert {t.config["rank"] for t in a.trials} == {4, 8, 16}
    assert {tuple(t.config["target_modules"]) for t in a.trials} == {("q_proj",), ("q_proj", "v_proj")}
    ints = Search({"warmup_steps": randint(0, 3), "dropout": uniform(0.0, 0.2)}, Random(100), budget=5)
    assert {t.config["warmup_steps"] for t in ints.trials} == {0, 1, 2, 3}
    assert all(0.0 <= t.config["dropout"] <= 0.2 for t in ints.trials)


@pytest.mark.parametrize(
    ("space", "strategy", "expected"),
    [
        ({"rank": choice(4, 64)}, Random(3), "above the job's max_rank = 16"),
        ({"nonsense": choice(1)}, Random(3), "cannot be searched"),
        ({"lr": loguniform(1e-3, 1e-4)}, Random(3), "loguniform needs 0 < low <= high"),
        ({"lr": loguniform(1e-5, 1e-3)}, Grid(), "a grid needs a choice of values"),
        ({"lr": loguniform(1e-5, 1e-3)}, ASHA(8, min_steps=20), "must be below the budget"),
        ({"lr": loguniform(1e-5, 1e-3)}, ASHA(8, min_steps=2, eta=1), "eta must be a whole number >= 2"),
        ({"rank": choice(4, 8)}, PBT(4, interval=2), "pbt copies weights between members"),
        ({"lr": loguniform(1e-5, 1e-3)}, PBT(8, interval=2), "needs as many free tenant slots"),
        ({"lr": loguniform(1e-5, 1e-3)}, PBT(4, interval=2, quantile=0.9), "quantile must be in (0, 0.5]"),
    ],
)
def test_bad_searches_are_named(space, strategy, expected):
    problems = search_problems(space, strategy, 20, Objective(), slots=4, max_rank=16)
    assert any(expected in p for p in problems), problems


def test_objective_problems():
    assert Objective("mypkg.metrics:score", "max").problems() == []
    assert "objective metric" in Objective("os.system('x')").problems()[0]
    assert "mode" in Objective(mode="up").problems()[0]


# -- ASHA against the published rule -----------------------------------------------------------------


def reference_asha(values, n, slots, min_steps, eta, budget):
    """Algorithm 2 of Li et al. (MLSys 2020), written independently of mlora_lab.search, on a pool of
    ``slots`` workers that each advance one step per tick. ``values[trial][rung]``: the scripted
    objective (lower is better). Returns the jobs as ``(tick, trial, rung)`` in the order handed out."""
    rungs = [min_steps * eta**k for k in range(64) if min_steps * eta**k < budget] + [budget]
    top = len(rungs) - 1
    seen = [dict() for _ in rungs]  # rung -> {trial: loss}
    promoted = [set() for _ in rungs]
    started, jobs, workers, tick = 0, [], [None] * slots, 0  # worker: [trial, rung, step]

    def get_job():
        nonlocal started
        for k in range(top - 1, -1, -1):
            ranked = sorted(seen[k], key=lambda c: (seen[k][c], c))[: len(seen[k]) // eta]
            candidates = [c for c in ranked if c not in promoted[k]]
            if candidates:
                promoted[k].add(candidates[0])
                return candidates[0], k + 1
        if started < n:
            started += 1
            return started - 1, 0
        return None

    step_of = {}
    while True:
        for w in range(slots):  # free workers take jobs, in worker order
            if workers[w] is None and (job := get_job()) is not None:
                trial, k = job
                jobs.append((tick, trial, k))
                workers[w] = [trial, k]
        if all(w is None for w in workers):
            return jobs, seen
        tick += 1
        done = []
        for w, job in enumerate(workers):
            if job is None:
                continue
            trial, k = job
            step_of[trial] = step_of.get(trial, 0) + 1
            if step_of[trial] == rungs[k]:
                done.append((trial, w, k))
        for trial, w, k in sorted(done):
            seen[k][trial] = values[trial][k]
            workers[w] = None


def drive(search: Search, slots: int, values, stop_at: int | None = None, running=None, tick: int = 0):
    """Run ``search`` the way the job does: every running trial advances one step per global step;
    at a boundary the trials that reached their report step report (in trial order), then the free
    slots are filled and the actions applied. Returns the jobs ``(tick, trial, rung)``, the running
    trials and the tick (``running``/``tick`` given: go on from a stop at ``tick``)."""
    jobs = []
    if running is None:  # the start: fill every slot
        running = {}
        for a in search.fill(slots, 0):
            running[a.trial] = 0
            jobs.append((0, a.trial, search.trial(a.trial).rung))
    while running or not search.done:
        if stop_at is not None and tick == stop_at:
            return jobs, running, tick
        tick += 1
        for t in running:
            running[t] += 1
        paused = []
        for t in sorted(running):
            if running[t] == search.next_report(t):
                rung = search.trial(t).rung
                for a in search.report(t, running[t], values[t][rung], tick):
                    assert a.op == "stop"
                    del running[t]
                if search.trial(t).state == "paused":
                    paused.append(t)
        free = slots - sum(1 for t in running if search.trial(t).state == "running")
        kept = {}
        for a in search.fill(free, tick, tuple(paused)):
            if a.op == "pause":
                del running[a.trial]
            elif a.op in ("start", "restore", "continue"):
                kept[a.trial] = running.pop(a.trial, search.trial(a.trial).step)
                jobs.append((tick, a.trial, search.trial(a.trial).rung))
        running.update(kept)
        assert len(running) <= slots
    return jobs, running, tick


@pytest.mark.parametrize(
    ("seed", "n", "slots", "min_steps", "eta", "budget"),
    [
        (0, 16, 4, 1, 3, 27),
        (1, 16, 4, 2, 2, 16),
        (2, 30, 3, 1, 3, 9),
        (3, 9, 9, 1, 3, 9),
        (4, 40, 5, 3, 2, 48),
    ],
)
def test_asha_decisions_equal_the_published_rule(seed, n, slots, min_steps, eta, budget):
    rng = random.Random(seed)
    rungs = asha_rungs(min_steps, eta, budget)
    values = [[rng.random() for _ in rungs] for _ in range(n)]
    want, seen = reference_asha(values, n, slots, min_steps, eta, budget)
    search = Search({"lr": loguniform(1e-5, 1e-2)}, ASHA(n, min_steps, eta), budget, seed=seed)
    got, _, _ = drive(search, slots, values)
    assert got == want
    assert [dict(r) for r in search.rung_results] == seen
    assert search.done
    assert {t.state for t in search.trials} <= {"finished", "pruned"}
    finished = [t.id for t in search.trials if t.state == "finished"]
    assert finished and all(t in seen[-1] for t in finished)
    assert all(d["why"] for d in search.decisions)


def test_asha_state_survives_json_and_decides_the_same():
    rng = random.Random(5)
    values = [[rng.random() for _ in asha_rungs(1, 3, 27)] for _ in range(16)]
    straight = Search(SPACE, ASHA(16, 1, 3), 27, seed=5)
    want, _, _ = drive(straight, 4, values)
    first = Search(SPACE, ASHA(16, 1, 3), 27, seed=5)
    jobs, running, tick = drive(first, 4, values, stop_at=11)
    resumed = Search.from_dict(json.loads(json.dumps(first.to_dict())))
    rest, _, _ = drive(resumed, 4, values, running=running, tick=tick)
    assert jobs + rest == want
    assert resumed.to_dict()["decisions"] == straight.to_dict()["decisions"]


# -- PBT ------------------------------------------------------------------------------------------------


def pbt_run(search: Search, losses, steps: int, stop_at: int | None = None, start: int = 0):
    """Members step together; at each interval they report ``losses(trial, step, config)``."""
    actions = []
    if start == 0:
        actions += search.fill(search.strategy.population, 0)
    for step in range(start + 1, steps + 1):
        if stop_at is not None and step > stop_at:
            break
        for t in range(search.strategy.population):
            if step == search.next_report(t) and search.trial(t).state == "running":
                actions += search.report(t, step, losses(t, step, search.trial(t).config), step)
    return actions


def test_pbt_exploits_the_top_and_explores_within_the_range():
    space = {"lr": loguniform(1e-4, 1e-2), "weight_decay": choice(0.0, 0.01, 0.1)}
    search = Search(
        space, PBT(population=8, interval=5, quantile=0.25, perturb=(0.8, 1.25), resample=0.5), 40, seed=3
    )

    def losses(trial, step, config):  # lower lr is better here, deterministically
        return config["lr"] * 100 + step * 0.001

    before = {t.id: dict(t.config) for t in search.trials}
    actions = pbt_run(search, losses, 40)
    exploits = [a for a in actions if a.op == "exploit"]
    assert exploits, "the bottom quarter exploits"
    for a in exploits:
        assert a.source != a.trial and a.config["lr"] > 0
        assert 1e-4 <= a.config["lr"] <= 1e-2 and a.config["weight_decay"] in (0.0, 0.01, 0.1)
    first = exploits[0]  # at the first interval: the source's lr times 0.8 or 1.25 (clipped)
    src_lr = before[first.source]["lr"]
    assert any(math.isclose(first.config["lr"], min(max(src_lr * f, 1e-4), 1e-2)) for f in (0.8, 1.25))
    worst_first = sorted(before, key=lambda i: before[i]["lr"])
    assert first.source in worst_first[:2] and first.trial in worst_first[-2:]
    assert sum(a.op == "stop" for a in actions) == 8
    assert all(t.state == "finished" for t in search.trials)


def test_pbt_is_seeded_and_resumes_to_the_same_decisions():
    space = {"lr": loguniform(1e-4, 1e-2)}

    def losses(trial, step, config):
        return abs(math.log(config["lr"]) - math.log(1e-3)) + 0.01 * ((trial * 7 + step) % 5)

    def fresh():
        return Search(space, PBT(population=6, interval=3), 30, seed=11)

    straight = pbt_run(fresh(), losses, 30)
    assert straight == pbt_run(fresh(), losses, 30)
    first = fresh()
    part = pbt_run(first, losses, 30, stop_at=14)
    resumed = Search.from_dict(json.loads(json.dumps(first.to_dict())))
    rest = pbt_run(resumed, losses, 30, start=14)
    assert part + rest == straight


# -- what a search must never do -------------------------------------------------------------------------


def test_asha_with_too_few_trials_for_its_rungs_finishes_its_best_and_says_so_before():
    """n=6, eta=3 over rungs at 5, 15, 45, 60 steps: at most 4, then 2, then 0 trials reach each rung, so
    the search ended with every trial pruned and nothing trained to the budget, silently. A warning says
    so before the search starts, and the search trains its best trial of the highest rung reached on to
    the budget, so it ends with one trained as asked."""
    from mlora_lab.search import asha_warning

    strategy, budget = ASHA(6, min_steps=5, eta=3), 60
    note = asha_warning(strategy, budget)
    assert note is not None and "no trial can be promoted to the budget of 60 steps" in note
    assert "n >= 27" in note and asha_warning(ASHA(27, min_steps=5, eta=3), budget) is None
    rng = random.Random(3)
    rungs = asha_rungs(5, 3, budget)
    values = [[rng.random() for _ in rungs] for _ in range(6)]
    search = Search({"lr": loguniform(1e-5, 1e-2)}, strategy, budget, seed=3)
    drive(search, 2, values)
    assert search.done
    (finished,) = [t for t in search.trials if t.state == "finished"]
    assert max(finished.results) == budget and search.best_trial() is finished
    reached = max(k for k, r in enumerate(search.rung_results[:-1]) if r)  # the highest rung reached
    best_there = min(search.rung_results[reached], key=search.rung_results[reached].get)
    assert finished.id == best_there
    assert {t.state for t in search.trials if t is not finished} == {"pruned"}
    said = [d for d in search.decisions if d["trial"] == finished.id and d["action"] == "promote"]
    assert "no trial trained to the budget" in said[-1]["why"]


def test_asha_that_reaches_its_budget_is_unchanged_by_the_finish():
    """The finish only acts when nothing else can: a search whose trials reach the budget decides as the
    published rule (the parametrised test above) and promotes nobody extra."""
    rng = random.Random(0)
    values = [[rng.random() for _ in asha_rungs(1, 3, 9)] for _ in range(9)]
    search = Search({"lr": loguniform(1e-5, 1e-2)}, ASHA(9, 1, 3), 9, seed=0)
    drive(search, 9, values)
    assert not any("no trial trained" in d["why"] for d in search.decisions)


@pytest.mark.parametrize("bad", [math.nan, -math.inf, math.inf])
def test_a_non_finite_objective_fails_its_trial_and_is_never_the_best(bad):
    """NaN, -inf (for min) and +inf were ranked as numbers: -inf was the best trial. A value that is not
    a finite number is no result: the trial fails (with why), frees its slot and is never promoted, the
    best or compared."""
    for mode in ("min", "max"):
        search = Search({"lr": loguniform(1e-5, 1e-2)}, ASHA(4, 1, 2), 4, objective=Objective(mode=mode))
        search.fill(4)
        assert search.report(0, 1, bad, 1, why="its objective raised SystemExit") == [_stop(0)]
        assert search.trial(0).state == "failed" and "SystemExit" in search.trial(0).reason
        assert not search.trial(0).results and search.best_value(search.trial(0)) is None
        for i, v in ((1, 0.5), (2, 0.25), (3, 0.75)):
            search.report(i, 1, v, 1)
        assert 0 not in search.rung_results[0] and search.best_trial().id in (1, 2, 3)
        promoted = [a.trial for a in search.fill(4, 1) if a.op in ("continue", "restore")]
        assert 0 not in promoted


def _stop(trial: int):
    from mlora_lab.search import Action

    return Action("stop", trial, why="failed")


def test_a_grid_too_large_is_refused_before_it_is_enumerated():
    """A 4.2e10-point grid was accepted and died with a bare MemoryError (in the job and in results()).
    It is counted, not enumerated, and refused with a clear message."""
    space = {
        "rank": choice(*range(1, 65)),
        "seed": choice(*range(1000)),
        "warmup_steps": choice(*range(1000)),
        "lr": choice(*(1e-5 * (i + 1) for i in range(656))),
    }
    problems = search_problems(space, Grid(), 10, Objective(), slots=4, max_rank=64)
    assert any("a grid of 41,984,000,000 points" in p and "more than 10,000 trials" in p for p in problems)
    with pytest.raises(ValueError, match="a grid of 41,984,000,000 points"):
        Search(space, Grid(), budget=10)


@pytest.mark.parametrize(
    ("metric", "why"),
    [
        ("sys:exit", "not a Python function"),
        ("json:JSONDecoder", "is a class"),
        ("no_such_module_here:f", "cannot be imported"),
        ("math:no_such_name", "has no 'no_such_name'"),
    ],
)
def test_an_objective_must_be_a_python_function(metric, why):
    with pytest.raises(ValueError, match=why):
        Objective(metric).function()
    assert Objective("test_search:_stop").function() is _stop
    assert Objective("eval_loss").function() is None
