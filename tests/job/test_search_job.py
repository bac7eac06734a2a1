"""The search inside a job (mlora_lab.job.search), on the tiny model in this process: a refilled slot
starts clean, PBT's exploit copies adapter and optimiser state exactly, and a sweep stopped and resumed
makes the same decisions as one that ran through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import task_rows, write_jsonl

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.rundir import RunDir, atomic_write_json
from mlora_lab.search import ASHA, PBT, Action, Objective, Sweep, choice, loguniform


@pytest.fixture
def base_tenant(tmp_path) -> ml.Tenant:
    data = write_jsonl(tmp_path / "train.jsonl", task_rows("reverse", 24))
    evals = write_jsonl(tmp_path / "eval.jsonl", task_rows("reverse", 6))
    return ml.Tenant(name="base", data=data, heldout_data=evals, rank=4, batch_size=2, max_steps=8)


def sweep_trainer(llama_path: str, out: Path, sweep: Sweep, resume: bool = False, **job) -> Trainer:
    spec = ml.JobSpec(
        base_model=llama_path,
        tenants=[],
        seq_len=64,
        max_rank=16,
        output_dir=str(out),
        slot_modules=["q_proj", "v_proj"],
        **{"max_tenants": 3, **job},
    )
    if not resume:
        run = RunDir(out).create()
        spec.to_json(run.job)
        atomic_write_json(run.root / "sweep.json", sweep.to_dict())
    else:  # as the job does: job.json, which lists the trials the sweep started
        spec = ml.JobSpec.load(RunDir(out).job)
    return Trainer(spec, out, resume=resume)


def search_state(out: Path) -> dict:
    return json.loads((out / "search.json").read_text())


def asha_sweep(base: ml.Tenant) -> Sweep:
    space = {"lr": loguniform(1e-4, 3e-2), "rank": choice(4, 8)}
    return Sweep(base, space, ASHA(n=8, min_steps=2, eta=2), budget=8, seed=1)


def test_asha_in_a_job_prunes_and_refills_its_slots(llama_path, base_tenant, tmp_path):
    tr = sweep_trainer(llama_path, tmp_path / "run", asha_sweep(base_tenant))
    held = []
    step = tr.step

    def counting_step():
        held.append(len(tr.model.tenants))
        return step()

    tr.step = counting_step
    tr.train(idle_s=0.01)
    tr.close()
    state = search_state(tmp_path / "run")
    assert max(held) == 3, "never more trials at once than slots"
    trials = state["trials"]
    assert len(trials) == 8 and {t["state"] for t in trials} == {"finished", "pruned"}
    assert sum(t["state"] == "finished" for t in trials) >= 1
    actions = [d["action"] for d in state["decisions"]]
    assert actions.count("start") == 8 and "promote" in actions and "prune" in actions
    # every trial that reached a rung has its adapter at that rung, pruned ones included
    assert all(
        (tmp_path / "run" / "adapters" / f"trial-{t['id']:03d}" / "adapter_config.json").is_file()
        for t in trials
    )


def test_a_refilled_slot_starts_clean(llama_path, base_tenant, tmp_path):
    """A trial that takes a slot another trial left is the same as that trial alone in a fresh job."""
    sweep = asha_sweep(base_tenant)
    tr = sweep_trainer(llama_path, tmp_path / "sweep", sweep, max_tenants=2)
    tr.train(idle_s=0.01)
    tr.close()
    state = search_state(tmp_path / "sweep")
    # a trial that started in a slot an earlier trial left, and stopped at its first rung (2 steps)
    late = next(t for t in state["trials"] if t["id"] >= 2 and list(t["results"]) == ["2"])
    started = next(
        d["step"] for d in state["decisions"] if d["trial"] == late["id"] and d["action"] == "start"
    )
    assert started > 0
    name = f"trial-{late['id']:03d}"
    in_sweep = {r.tenant_step: r.loss for r in _train_rows(tr, name)}

    alone = sweep.trial_tenant(late["id"], late["config"])
    spec = ml.JobSpec(
        base_model=llama_path,
        tenants=[ml.Tenant(**{**alone.to_dict(), "max_steps": 2})],
        seq_len=64,
        max_rank=16,
        max_tenants=2,
        slot_modules=["q_proj", "v_proj"],
    )
    fresh = Trainer(spec)
    fresh.train(idle_s=0.01)
    for step, loss in enumerate(fresh.losses(name), start=1):
        assert abs(loss - in_sweep[step]) <= 1e-6, (step, loss, in_sweep[step])
    from mlora_lab.lora import read_adapter

    kept = read_adapter(tmp_path / "sweep" / "adapters" / name)[1]  # saved at its first rung (2 steps)
    mine = fresh.model.tenant_tensors(name)
    for module, (a, b) in kept.items():
        got = mine[module]
        assert torch.allclose(a, got[0], atol=1e-6) and torch.allclose(b, got[1], atol=1e-6), module


def _train_rows(tr: Trainer, name: str):
    from types import SimpleNamespace

    return [
        SimpleNamespace(**r.to_dict()) for r in tr.history if r["kind"] == "train" and r["tenant"] == name
    ]


def test_pbt_exploit_copies_adapter_and_optimiser_state_exactly(llama_path, base_tenant, tmp_path):
    """After the exploit, the copied trial's next step on the source's rows equals the source's step."""
    sweep = Sweep(
        base_tenant, {"lr": loguniform(1e-3, 1e-2)}, PBT(population=2, interval=100), budget=20, seed=4
    )
    tr = sweep_trainer(llama_path, tmp_path / "run", sweep)
    tr.search.poll()
    for _ in range(3):
        tr.step()
    ctl = tr.search
    src, dst = tr.tenants["trial-001"], tr.tenants["trial-000"]
    assert not torch.equal(
        *(
            tr.model.tenant_tensors(n)["model.layers.0.self_attn.q_proj"][0]
            for n in ("trial-000", "trial-001")
        )
    )
    ctl.apply(Action("exploit", 0, source=1, config={"lr": src.spec.lr}))
    assert dst.step == src.step and dst.optimizer.lr == src.optimizer.lr
    dst.feed.stream.load_state_dict(src.feed.stream.state_dict())  # the same rows next
    tr.step()
    got, want = tr.model.tenant_tensors("trial-000"), tr.model.tenant_tensors("trial-001")
    for module in want:
        for x, y in zip(got[module], want[module]):
            assert torch.equal(x, y), module
    a, b = dst.optimizer.state_dict()["optimizer"]["state"], src.optimizer.state_dict()["optimizer"]["state"]
    assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in b)
    # and explore: a new lr applies from the next step, at the schedule's position
    ctl.apply(Action("exploit", 0, source=1, config={"lr": 2 * src.spec.lr}))
    assert dst.optimizer.lr == pytest.approx(2 * src.optimizer.lr) and dst.spec.lr == 2 * src.spec.lr


def test_a_sweep_stopped_and_resumed_decides_the_same(llama_path, base_tenant, tmp_path):
    sweep = asha_sweep(base_tenant)
    straight = sweep_trainer(llama_path, tmp_path / "straight", sweep, save_every=2)
    straight.train(idle_s=0.01)
    straight.close()

    first = sweep_trainer(llama_path, tmp_path / "stopped", sweep, save_every=2)
    step = first.step

    def stop_at_7():
        done = step()
        first.stop_requested |= first.global_step == 7
        return done

    first.step = stop_at_7
    first.train(idle_s=0.01)
    first.close()
    assert search_state(tmp_path / "stopped")["decisions"] != search_state(tmp_path / "straight")["decisions"]
    resumed = sweep_trainer(llama_path, tmp_path / "stopped", sweep, resume=True, save_every=2)
    resumed.train(idle_s=0.01)
    resumed.close()
    want, got = search_state(tmp_path / "straight"), search_state(tmp_path / "stopped")
    assert [(d["step"], d["trial"], d["action"]) for d in got["decisions"]] == [
        (d["step"], d["trial"], d["action"]) for d in want["decisions"]
    ]
    for a, b in zip(got["trials"], want["trials"]):
        assert a["state"] == b["state"] and a["results"].keys() == b["results"].keys()
        assert all(abs(a["results"][k] - b["results"][k]) <= 1e-6 for k in a["results"])


def _trial_rows(tr: Trainer, name: str, kind: str) -> list[dict]:
    return [r for r in tr.history if r["kind"] == kind and r["tenant"] == name]


def test_a_diverging_trial_fails_alone_frees_its_slot_and_is_never_the_best(
    llama_path, base_tenant, tmp_path
):
    """A sweep whose range reaches lr=1e38 (a job.json written by hand: ml.sweep refuses the range) ended
    the job for every trial. Now each such trial is quarantined with why, gives its slot back to the next
    trial, and is never the best; the others train to the budget."""
    space = {"lr": choice(1e38, 1e-3), "seed": choice(0, 1)}
    sweep = Sweep(base_tenant, space, ml.Grid(), budget=3, objective=Objective("train_loss"))
    tr = sweep_trainer(llama_path, tmp_path / "run", sweep, max_tenants=2)
    tr.train(idle_s=0.01)
    tr.close()
    trials = {t["id"]: t for t in search_state(tmp_path / "run")["trials"]}
    assert [trials[i]["state"] for i in range(4)] == ["failed", "failed", "finished", "finished"]
    assert "non-finite update" in trials[0]["reason"] and "lr=1e+38" in trials[0]["reason"]
    rows = _trial_rows(tr, "trial-000", "tenant")
    assert rows[-1]["state"] == "failed" and "non-finite update" in rows[-1]["reason"]
    from mlora_lab.lab.records import trials as lab_trials

    table, best = lab_trials.results(RunDir(tmp_path / "run")), lab_trials.best(RunDir(tmp_path / "run"))
    assert best["trial"] in (2, 3) and table.iloc[0].trial == best["trial"]
    assert list(table.state[-2:]) == ["failed", "failed"], "failed trials last, however far they got"


def test_results_of_a_grid_too_large_say_so(base_tenant, tmp_path):
    """results() of a run whose sweep.json holds a 4.2e10-point grid (written by hand) died with a bare
    MemoryError; it says what is wrong with the file."""
    from mlora_lab.lab.records import trials as lab_trials
    from mlora_lab.rundir import RunDirError

    space = {f: choice(*range(1, 1001)) for f in ("seed", "warmup_steps", "batch_size")}
    space["grad_accum"] = choice(*range(1, 43))
    run = RunDir(tmp_path / "run").create()
    atomic_write_json(run.sweep, Sweep(base_tenant, space, ml.Grid(), budget=3).to_dict())
    with pytest.raises(RunDirError, match=r"sweep.json: a grid of 42,000,000,000 points"):
        lab_trials.results(run)


def test_asha_with_too_few_trials_trains_its_best_to_the_budget_in_a_job(llama_path, base_tenant, tmp_path):
    """ASHA(n=6, eta=3) over rungs at 1, 3, 9, 27 steps can promote nobody to the budget: the job ended
    with every trial pruned. Its best trial of the highest rung reached is restored and trains on to the
    budget, and is the search's best."""
    sweep = Sweep(
        base_tenant,
        {"lr": loguniform(1e-4, 3e-2)},
        ASHA(n=6, min_steps=1, eta=3),
        budget=27,
        seed=2,
        objective=Objective("train_loss", window=1),
    )
    tr = sweep_trainer(llama_path, tmp_path / "run", sweep)
    tr.train(idle_s=0.01)
    tr.close()
    state = search_state(tmp_path / "run")
    (finished,) = [t for t in state["trials"] if t["state"] == "finished"]
    assert max(int(k) for k in finished["results"]) == 27
    assert {t["state"] for t in state["trials"] if t is not finished} == {"pruned"}
    assert any(
        d["trial"] == finished["id"] and "no trial trained to the budget" in d["why"]
        for d in state["decisions"]
    )
    steps = [r["tenant_step"] for r in _trial_rows(tr, f"trial-{finished['id']:03d}", "train")]
    assert steps == list(range(1, 28)), "trained on from where it stopped, to the budget"


def exiting_objective(rows: list[dict]) -> float:
    """An objective that ends the process for trial-001 and is NaN for trial-002 (for the test below)."""
    name = rows[-1]["tenant"]
    if name == "trial-001":
        raise SystemExit(3)
    if name == "trial-002":
        return float("nan")
    return sum(r["loss"] for r in rows if r["kind"] == "train")


def test_an_objective_that_exits_fails_only_its_trial(llama_path, base_tenant, tmp_path):
    """An objective raising SystemExit ended the whole sweep and left every trial "running". It is the
    failure of the trial it was called for (so is a NaN), with why; the sweep goes on to its end."""
    sweep = Sweep(
        base_tenant,
        {"seed": choice(0, 1, 2, 3)},
        ml.Grid(),
        budget=2,
        objective=Objective("test_search_job:exiting_objective"),
    )
    tr = sweep_trainer(llama_path, tmp_path / "run", sweep)
    tr.train(idle_s=0.01)
    tr.close()
    trials = {t["id"]: t for t in search_state(tmp_path / "run")["trials"]}
    assert [trials[i]["state"] for i in range(4)] == ["finished", "failed", "failed", "finished"]
    assert "raised SystemExit: 3" in trials[1]["reason"] and "is nan" in trials[2]["reason"]
    assert _trial_rows(tr, "trial-001", "tenant")[-1]["state"] == "failed"
    assert not tr.model.tenants, "every slot was given back"


# -- ml.sweep: launched jobs -----------------------------------------------------------------------------


def sweep_job(llama_path: str, base: ml.Tenant, out: Path, nproc: int = 1) -> ml.JobSpec:
    return ml.JobSpec(
        base_model=llama_path,
        tenants=[base],
        seq_len=64,
        max_rank=16,
        max_tenants=3,
        parallel=ml.Parallel(nproc=nproc, fsdp=nproc),
        output_dir=str(out),
    )


SPACE = {
    "lr": ml.loguniform(1e-4, 3e-2),
    "rank": ml.choice(4, 8),
    "target_modules": ml.choice(["q_proj", "v_proj"], ["q_proj", "v_proj", "o_proj"]),
}


def test_a_bad_sweep_is_refused_naming_every_problem_before_anything_starts(
    llama_path, base_tenant, tmp_path
):
    space = {
        "rank": ml.choice(4, 32),
        "target_modules": ml.choice(["q_proj"], ["no_such_proj"]),
        "bogus": ml.choice(1),
    }
    with pytest.raises(ml.SpecError) as err:
        ml.sweep(sweep_job(llama_path, base_tenant, tmp_path / "r"), space, ml.ASHA(8, 2, 2))
    text = str(err.value)
    assert "rank: [32] above the job's max_rank = 16" in text and "'bogus' cannot be searched" in text
    assert not (tmp_path / "r").exists()
    space = {"target_modules": ml.choice(["q_proj"], ["no_such_proj"])}
    with pytest.raises(ml.SpecError, match="no_such_proj"):
        ml.sweep(sweep_job(llama_path, base_tenant, tmp_path / "r"), space, ml.Grid())
    with pytest.raises(ml.SpecError) as err:  # what the job would call, or run, and could not
        ml.sweep(
            sweep_job(llama_path, base_tenant, tmp_path / "r"),
            {"lr": ml.loguniform(1e-4, 1e38), "seed": ml.choice(*range(1000))},
            ml.Random(2),
            objective="sys:exit",
        )
    text = str(err.value)
    assert "objective 'sys:exit' is a builtin_function_or_method (a builtin), not a Python function" in text
    assert "lr must be in (0, 10] (got 1e+38)" in text
    many = {name: ml.choice(*range(1, 1001)) for name in ("seed", "warmup_steps", "batch_size", "grad_accum")}
    with pytest.raises(ml.SpecError, match=r"a grid of 1,000,000,000,000 points .* is more than 10,000"):
        ml.sweep(sweep_job(llama_path, base_tenant, tmp_path / "r"), many, ml.Grid())
    # (warned before the launch checks anything: here it then refuses the rank)
    with (
        pytest.warns(UserWarning, match="no trial can be promoted to the budget of 60 steps"),
        pytest.raises(ml.SpecError),
    ):
        ml.sweep(
            sweep_job(llama_path, base_tenant, tmp_path / "r"),
            {"rank": ml.choice(4, 99)},
            ml.ASHA(6, min_steps=5, eta=3),
            budget=60,
        )
    with pytest.raises(ml.SpecError, match="defined in the notebook"):
        ml.sweep(
            sweep_job(llama_path, base_tenant, tmp_path / "r"),
            SPACE,
            ml.Random(2),
            objective=lambda rows: 0.0,
        )
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_sweep_on_two_ranks_decides_as_on_one(llama_path, base_tenant, tmp_path):
    """Decisions are taken on rank 0 and applied by every rank at the same step: an ASHA sweep with
    FSDP over two processes makes the decisions one process makes, with the same objectives."""
    runs = [
        ml.sweep(
            sweep_job(llama_path, base_tenant, tmp_path / f"n{n}", nproc=n), SPACE, ml.ASHA(8, 2, 2), seed=1
        )
        for n in (1, 2)
    ]
    for run in runs:
        assert run.wait(300) == "finished", run.logs(0)
    one, two = (run.search for run in runs)
    assert [(d["step"], d["trial"], d["action"]) for d in one.decisions] == [
        (d["step"], d["trial"], d["action"]) for d in two.decisions
    ]
    for a, b in zip(one.trials, two.trials):
        assert a.results.keys() == b.results.keys()
        assert all(abs(a.results[k] - b.results[k]) <= 1e-5 for k in a.results)
    table = runs[1].results()
    assert len(table) == 8 and set(table.state) == {"finished", "pruned"}
    assert table.iloc[0].state == "finished" and table.adapter.notna().all()
    best = runs[1].best()
    assert best["tenant"] == table.iloc[0].tenant and (best["adapter"] / "adapter_config.json").is_file()
    attached = ml.attach(runs[1].path)
    assert isinstance(attached, ml.SweepRun) and attached.best()["config"] == best["config"]
    assert set(attached.decisions().action) >= {"start", "promote", "prune", "finish"}


@pytest.mark.slow
def test_the_command_line_runs_a_sweep(llama_path, base_tenant, tmp_path, capsys):
    from mlora_lab.lab import cli

    job = sweep_job(llama_path, base_tenant, tmp_path / "run")
    (tmp_path / "sweep.json").write_text(
        json.dumps(
            {
                "job": job.to_dict(),
                "space": {"lr": {"kind": "loguniform", "low": 1e-4, "high": 3e-2}, "rank": [4, 8]},
                "strategy": {"kind": "random", "n": 4},
                "budget": 3,
                "seed": 2,
                "objective": "train_loss",
            }
        )
    )
    assert cli.main(["sweep", str(tmp_path / "sweep.json")]) == 0
    out = capsys.readouterr().out
    assert "trials, best first:" in out and "best: trial-" in out
    run = ml.attach(tmp_path / "run")
    assert {t.state for t in run.search.trials} == {"finished"} and len(run.search.trials) == 4


@pytest.mark.slow
def test_a_pbt_sweep_stops_resumes_and_shows_its_trials(llama_path, base_tenant, tmp_path):
    import time

    spec = sweep_job(llama_path, base_tenant, tmp_path / "run")
    spec.save_every = 4
    run = ml.sweep(
        spec, {"lr": ml.loguniform(1e-4, 3e-2)}, ml.PBT(population=3, interval=4), budget=40, seed=3
    )
    deadline = time.monotonic() + 120
    while run.global_step < 10:
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.1)
    assert run.stop(timeout=120) == "stopped"
    resumed = ml.resume(run.path)
    assert isinstance(resumed, ml.SweepRun)
    assert resumed.wait(300) == "finished", resumed.logs(0)
    search = resumed.search
    assert {t.state for t in search.trials} == {"finished"}
    assert "exploit" in set(resumed.decisions().action)
    exploited = [t for t in search.trials if t.parent is not None]
    assert exploited and all(1e-4 <= t.config["lr"] <= 3e-2 for t in exploited)
    board = resumed.dashboard(interactive=False)
    board.refresh()
    assert "trial-000" in board.trials.value and bytes(board.scatter.value[:4]) == b"\x89PNG"
    board.stop()


@pytest.mark.slow
def test_a_stopped_asha_sweep_with_more_trials_than_slots_resumes(llama_path, base_tenant, tmp_path):
    """Every trial the job starts is listed in job.json (the views read its settings there), and the job
    checked job.json again when it resumed: an ASHA search of 6 trials on 3 slots, once stopped, could never
    be resumed ("4 tenants but max_tenants=3"). Trials are checked with the sweep, so it resumes and ends."""
    import time

    spec = sweep_job(llama_path, base_tenant, tmp_path / "run")
    spec.save_every = 2
    space = {"lr": ml.loguniform(1e-4, 3e-2)}
    run = ml.sweep(spec, space, ml.ASHA(6, min_steps=2, eta=2), budget=8, seed=1, objective="train_loss")
    deadline = time.monotonic() + 300
    while len(ml.JobSpec.load(run.path / "job.json").tenants) <= spec.max_tenants:
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.1)
    assert run.stop(timeout=120) == "stopped"
    resumed = ml.resume(run.path, nproc=1)  # (a layout given: the launcher checks job.json again too)
    assert resumed.wait(300) == "finished", (resumed.status, resumed.logs(0))
    states = {t.state for t in resumed.search.trials}
    assert states <= {"finished", "pruned"} and "finished" in states, states


def test_an_evaluation_score_is_a_sweeps_objective(llama_path, base_tenant, tmp_path):
    """objective="eval/<name>/<metric>": each trial is judged by its latest score in that evaluation (here
    a longest-completion metric, mode max), and a sweep naming an evaluation the job lacks is refused."""
    from mlora_lab.rundir import EvalMetricRow
    from mlora_lab.validate.sweep import sweep_problems

    metric = tmp_path / "metric.py"
    metric.write_text(
        "def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"
    )
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": "reverse: red cat\n"}, {"prompt": "upper: a\n"}]
    )
    quick = ml.Eval(name="quick", data=prompts, metrics=[f"{metric}:length"], every=1, max_new_tokens=6,
                    models=["base"] + [f"trial-{i:03d}" for i in range(4)])  # fmt: skip
    sweep = Sweep(base_tenant, {"lr": choice(1e-3, 3e-2)}, ml.Grid(), budget=2,
                  objective=Objective("eval/quick/length", mode="max"))  # fmt: skip
    tr = sweep_trainer(llama_path, tmp_path / "run", sweep, evals=[quick], stay_up=False)
    tr.train(idle_s=0.01)
    tr.close()
    trials = search_state(tmp_path / "run")["trials"]
    assert [t["state"] for t in trials] == ["finished", "finished"]
    for t in trials:
        name = f"trial-{t['id']:03d}"
        scores = [r for r in tr.history if isinstance(r, EvalMetricRow) and r.model == name]
        assert scores and t["results"]["2"] == pytest.approx(scores[-1].value)  # (reported at its step 2)

    spec = ml.JobSpec(base_model=llama_path, tenants=[], max_tenants=3, seq_len=64, max_rank=16)
    found = [str(p) for p in sweep_problems(spec, sweep)]
    assert any("the job has no evaluation 'quick'" in p for p in found), found
