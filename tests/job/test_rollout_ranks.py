"""Rollout ranks (``Parallel.rollout_ranks``): processes that hold the base and every RL tenant's adapter and
sample while the others train, the adapters reaching them in memory after each step.

- one trainer and one rollout rank equal the same job on one process, stale and on-policy RL tenants beside an
  SFT tenant: the same completions (each sampled with the adapter version its row names), losses, adapters;
- two FSDP trainers and a rollout rank equal it too;
- a job stopped with generations in flight on the rollout rank resumes exactly;
- validation names a layout whose rollout ranks leave no trainer, or that the trainers cannot split.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pandas as pd
import pytest

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.lora import read_adapter
from mlora_lab.rundir import RowKind, TenantState
from mlora_lab.rundir.checkpoint import read_checkpoint
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems
from tests.job.test_rl_driver import TOL, job, max_diff, prompt_file, reward_file, rl_tenant
from tests.job.test_rl_staleness import slow_rewards


def evals(folder: Path) -> list[ml.Eval]:
    """An evaluation every 2 steps of the base and every tenant (with rollout ranks: sampled there)."""
    from conftest import write_jsonl

    rows = [
        {"prompt": "reverse: red cat\n", "answer": "tac der"},
        {"prompt": "upper: sun\n", "answer": "SUN"},
    ]
    return [
        ml.Eval(name="quick", data=write_jsonl(folder / "eval.jsonl", rows), metrics=["contains"], every=2)
    ]


def tenants(folder: Path, make_data) -> list[Tenant]:
    """A stale RL tenant (slow rewards, two steps ahead), an on-policy one with two updates per generation and
    two micro-batches, and an SFT tenant."""
    rewards, slow = reward_file(folder), slow_rewards(folder)
    return [
        rl_tenant("ahead", prompt_file(folder), RL(reward=f"{slow}:slow_short", group_size=3, max_new_tokens=6,
                                                   temperature=0.9, max_staleness=2), batch_size=3, max_steps=4),
        rl_tenant("now", prompt_file(folder, chat=True), RL(reward=f"{rewards}:has_word", group_size=2,
                                                            max_new_tokens=5, beta=0.1, num_iterations=2),
                  batch_size=1, grad_accum=2, max_steps=3, seed=7),
        Tenant(name="s", data=make_data("reverse"), rank=4, alpha=8, target_modules=["q_proj", "v_proj"], lr=5e-3,
               batch_size=2, max_steps=4, seed=1),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def here(llama_path, tmp_path_factory):
    """The job on one process, here (the reference)."""
    from conftest import task_rows, write_jsonl

    folder = tmp_path_factory.mktemp("rollout_here")

    def make_data(kind: str, n: int = 12) -> str:
        return write_jsonl(folder / f"{kind}.jsonl", task_rows(kind, n))

    ts = tenants(folder, make_data)
    trainer = Trainer(job(llama_path, ts, evals=evals(folder), lockstep=True), run_dir=folder / "run")
    trainer.train()
    trainer.close()
    return ts, trainer, folder / "run"


def completions(rows) -> list[tuple[str, int, int, str]]:
    return sorted(
        (r["tenant"], r["tenant_step"], r["adapter_version"], r["completion"])
        for r in rows
        if r["kind"] == RowKind.COMPLETION
    )


def same_as_here(run: ml.Run, here, tol: float) -> None:
    ts, trainer, reference = here
    m = run.metrics()
    train = m[m["kind"] == "train"]
    want = {(r["tenant"], r["tenant_step"]): r for r in trainer.history if r["kind"] == RowKind.TRAIN}
    got = train.set_index(["tenant", "tenant_step"]).sort_index()
    assert set(got.index) == set(want)
    assert list(got["loss"]) == pytest.approx([want[k]["loss"] for k in got.index], abs=tol)
    for name in ("ahead", "now"):
        rewards = [want[k]["reward"] for k in got.index if k[0] == name]
        assert list(got.loc[name]["reward"]) == pytest.approx(rewards, abs=1e-6), name
    for t in ts:
        x, y = read_adapter(run.adapter_path(t.name))[1], read_adapter(reference / "adapters" / t.name)[1]
        assert max_diff(x, y) <= tol, t.name
    assert completions(run.completions().assign(kind=RowKind.COMPLETION).to_dict("records")) == completions(
        trainer.history
    )

    # the evaluations, sampled on the rollout rank: a step's held tenants make more global steps (evaluated every
    # 2), so the base's scores (the same model, the step's seeds) are compared where both evaluated
    def base_scores(rows) -> dict[int, float]:
        return {r["step"]: r["value"] for r in rows if r["kind"] == "eval_metric" and r["model"] == "base"}

    got_base = base_scores(run.eval_metrics().assign(kind="eval_metric").to_dict("records"))
    want_base = base_scores(trainer.history)
    common = sorted(set(got_base) & set(want_base))
    assert common and [got_base[k] for k in common] == pytest.approx([want_base[k] for k in common], abs=1e-6)
    assert set(run.eval_metrics()["model"]) == {"base", *(t.name for t in ts)}


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_here")
@pytest.mark.parametrize(("nproc", "layout"), [(2, {}), (3, {"fsdp": 2})], ids=["1+1", "fsdp2+1"])
def test_rollout_ranks_equal_one_process(nproc, layout, here, llama_path, tmp_path):
    ts, _, _ = here
    spec = job(
        llama_path, ts, evals=evals(tmp_path), parallel=ml.Parallel(nproc=nproc, rollout_ranks=1, **layout)
    )
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    state = run.wait(600)
    logs = "\n".join(run.logs(r) for r in range(nproc))
    assert state == "finished", f"{state}: {run.error}\n{logs}"
    assert f"[rank {nproc - 1}] rollout rank 0: done" in run.logs(nproc - 1)
    # the rollout rank samples the batches the trainer would have sampled (the same tokens); a tenant whose
    # generation is not ready sits a step out, so a step's batch depends on timing: float reassociation, TOL
    same_as_here(run, here, TOL)
    system = pd.DataFrame([r.to_dict() for r in run.rows() if r["kind"] == "system"])
    assert set(system["rank"]) == set(range(nproc - 1))  # (the trainers' rows; the rollout rank's shares)
    zero = system[system["rank"] == 0]
    assert zero["rollout_busy"].between(0, 1).all() and zero["rollout_busy"].sum() > 0
    assert zero["trainer_idle"].between(0, 1).all()
    assert system[system["rank"] > 0]["rollout_busy"].isna().all()


@pytest.mark.slow
def test_stopped_with_generations_in_flight_on_the_rollout_rank_and_resumed_equals_straight_through(
    llama_path, tmp_path, make_data
):
    """A graceful stop lands while the rollout rank holds generations sampled ahead (their rewards in flight,
    or still being sampled): the checkpoint waits for them and keeps them whole, and the resumed job (with its
    rollout rank) ends as the same job straight through on one process."""
    ts = [dataclasses.replace(t, max_steps=3 * t.max_steps) for t in tenants(tmp_path, make_data)]
    straight = Trainer(job(llama_path, ts, lockstep=True))
    straight.train()
    spec = job(llama_path, ts, lockstep=True, parallel=ml.Parallel(nproc=2, rollout_ranks=1))
    spec.output_dir = str(tmp_path / "out")
    stopped = ml.launch(spec)
    while not any(r["kind"] == "train" and r["tenant"] == "ahead" for r in stopped.rows()):
        assert stopped.status in ("starting", "running"), stopped.logs(0)
        time.sleep(0.05)
    (stopped.path / "control" / "stop").write_text("now")
    assert stopped.wait(300) == "stopped", stopped.logs(0) + stopped.logs(1)
    (ckpt,) = sorted((stopped.path / "checkpoints").glob("step_*"))
    assert int(ckpt.name.split("_")[1]) < 12, ckpt
    state = read_checkpoint(ckpt)
    kept = state["tenants"]["ahead"]["rl_ahead"]  # (sampled two steps ahead: whole, tokens and all)
    assert kept and all(len(a["tokens"]) == len(a["prompts"]) * 3 for a in kept), kept
    resumed = ml.resume(stopped.path)
    assert resumed.wait(300) == "finished", resumed.logs(0) + resumed.logs(1)
    m = ml.attach(stopped.path).metrics()
    m = m[m["kind"] == "train"]
    for t in ts:
        got = m[m["tenant"] == t.name].sort_values("tenant_step")
        assert list(got["tenant_step"]) == list(range(1, t.max_steps + 1)), t.name
        assert list(got["loss"]) == pytest.approx(straight.losses(t.name), abs=TOL), t.name
        x = read_adapter(ml.attach(stopped.path).adapter_path(t.name))[1]
        assert max_diff(x, straight.model.tenant_tensors(t.name)) <= TOL, t.name


def test_a_layout_whose_rollout_ranks_leave_no_trainer_or_an_uneven_split_is_named(llama_path, tmp_path):
    ts = [
        rl_tenant("a", prompt_file(tmp_path), RL(reward=f"{reward_file(tmp_path)}:short", max_new_tokens=8))
    ]
    none_left = [
        str(p) for p in problems(job(llama_path, ts, parallel=ml.Parallel(nproc=2, rollout_ranks=2)))
    ]
    assert any("rollout_ranks = 2 leaves no process to train" in p for p in none_left), none_left
    uneven = [
        str(p) for p in problems(job(llama_path, ts, parallel=ml.Parallel(nproc=3, fsdp=2, rollout_ranks=2)))
    ]
    assert any(
        "must divide the training ranks, nproc*nnodes - rollout_ranks = 3 - 2 = 1" in p for p in uneven
    )


# -- in this process: rank 0's side against a rollout server of its own -----------------------------------------
class LoopbackLink:
    """A :class:`~mlora_lab.job.rollout.RolloutLink` whose one rollout rank is a
    :class:`~mlora_lab.job.rollout.RolloutServer` in this process (its own model), answering at once;
    ``tamper(message)`` may change a message on its way (a corrupt transfer, a failed sampling)."""

    def __init__(self, spec, tamper=None) -> None:
        from mlora_lab.job.rollout import RolloutServer
        from mlora_lab.parallel import DistInfo, Roles

        self.server = RolloutServer(spec, DistInfo(), Roles(1, 1, None, 0))
        self.tamper = tamper or (lambda m: m)
        self.inbox: list = []
        self.busy_s, self.failed, self.k = [0.0], None, 1

    def send(self, j: int, message) -> None:
        from mlora_lab.job.rollout import AdapterRefused, AdapterUpdate, DropAdapter, SampleWork

        message = self.tamper(message)
        if isinstance(message, AdapterUpdate):
            why = self.server.update(message)
            if why is not None:
                self.inbox.append((0, AdapterRefused(message.tenant, message.version, why)))
        elif isinstance(message, DropAdapter) and message.tenant in self.server.versions:
            self.server.engine.model.remove_tenant(message.tenant)
            del self.server.versions[message.tenant]
        elif isinstance(message, SampleWork):
            self.inbox.append((0, self.server.work(message)))

    def send_all(self, message) -> None:
        self.send(0, message)

    def replies(self, timeout=0.0):
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        pass


def loopback_job(spec, tamper=None) -> Trainer:
    """``spec`` trained in this process, its RL tenants sampled by a loopback rollout server."""
    from mlora_lab.job.drivers.default import DEFAULT_DRIVERS
    from mlora_lab.job.drivers.rl import RLDriver
    from mlora_lab.parallel import Roles

    class Remote(RLDriver):
        def make_link(self, roles):
            return LoopbackLink(spec, tamper)

    drivers = [Remote if d is RLDriver else d for d in DEFAULT_DRIVERS]
    return Trainer(spec, drivers=drivers, roles=Roles(1, 1, None, None))


def test_a_corrupt_adapter_transfer_quarantines_only_its_tenant_and_the_rollout_rank_keeps_the_old(
    llama_path, tmp_path, make_data
):
    from mlora_lab.job.rollout import AdapterUpdate

    ts = tenants(tmp_path, make_data)
    spec = job(llama_path, ts, lockstep=True)
    here = Trainer(spec)
    here.train()
    loop = loopback_job(spec)
    loop.train()  # (the loopback is the same job: what the torchrun test shows across processes)
    for t in ts:
        assert loop.losses(t.name) == pytest.approx(here.losses(t.name), abs=TOL), t.name
    held = {}

    def corrupt(m):  # version 1 of "ahead" arrives with one value changed (its digest is of the original)
        if isinstance(m, AdapterUpdate) and m.tenant == "ahead" and m.version == 1:
            held["before"] = {k: (a.clone(), b.clone()) for k, (a, b) in link.server.engine.model.tenant_tensors("ahead").items()}  # fmt: skip
            name = sorted(m.tensors)[0]
            a, b = m.tensors[name]
            a = a.clone()
            a.view(-1)[0] += 1.0
            m.tensors[name] = (a, b)
        return m

    bad = loopback_job(spec, corrupt)
    (driver, *_) = bad.drivers
    link = driver.link
    bad.train()
    ahead, now, sft = (bad.tenants[n] for n in ("ahead", "now", "s"))
    assert ahead.state is TenantState.FAILED and "corrupted (digest mismatch)" in ahead.reason, ahead.reason
    # (its generation 3 was due at step 1, two steps ahead: its adapter refused, it fails at the next plan, and
    # nothing sampled by the adapter the rollout rank kept instead trains)
    assert ahead.step == 1
    kept = link.server.engine.model.tenant_tensors("ahead") if "ahead" in link.server.versions else None
    assert kept is None or all(
        (kept[k][0] == held["before"][k][0]).all() and (kept[k][1] == held["before"][k][1]).all()
        for k in kept
    )
    for t in (now, sft):
        assert t.state is TenantState.FINISHED
        assert bad.losses(t.name) == pytest.approx(here.losses(t.name), abs=TOL), t.name


def test_a_sampling_that_fails_on_the_rollout_rank_fails_the_tenants_it_sampled_for(
    llama_path, tmp_path, make_data
):
    from mlora_lab.job.rollout import SampleWork

    ts = tenants(tmp_path, make_data)

    def broken(m):  # the third work asks for a tenant the rollout rank has no adapter of
        if isinstance(m, SampleWork) and m.ticket == 2:
            m.requests = [dataclasses.replace(r, tenant="nobody") for r in m.requests]
        return m

    trainer = loopback_job(job(llama_path, ts, lockstep=True), broken)
    trainer.train()
    states = {n: (t.state, t.reason or "") for n, t in trainer.tenants.items()}
    failed = {n for n, (s, _) in states.items() if s is TenantState.FAILED}
    assert failed and failed <= {"ahead", "now"}, states
    for n in failed:
        assert "failed on a rollout rank: rollout rank 0 holds no adapter of nobody" in states[n][1]
    assert states["s"][0] is TenantState.FINISHED


@pytest.mark.parametrize("remote", [False, True], ids=["colocated", "loopback"])
def test_pause_resume_and_remove_with_generations_in_flight(remote, llama_path, tmp_path, make_data):
    """Pausing a tenant that holds generations sampled ahead (rewards in flight; on a rollout rank, its adapter
    freed there) and resuming it later trains what an uninterrupted job trains; removing one mid-run leaves the
    others as they were."""
    ts = tenants(tmp_path, make_data)
    straight = Trainer(job(llama_path, ts, lockstep=True))
    straight.train()
    spec = job(llama_path, ts, lockstep=True)
    trainer = loopback_job(spec) if remote else Trainer(spec)
    for _ in range(2):
        assert trainer.step()
    assert trainer.tenants["ahead"].feed.ahead  # (two generations sampled ahead)
    trainer.apply_control({"op": "pause", "name": "ahead"})
    trainer.apply_control({"op": "remove", "name": "now"})
    for _ in range(2):
        assert trainer.step()
    if remote:
        (driver, *_) = trainer.drivers
        assert "ahead" not in driver.link.server.versions  # (its slot on the rollout rank freed)
    trainer.apply_control({"op": "resume", "name": "ahead"})
    trainer.train()
    for name in ("ahead", "s"):
        assert trainer.losses(name) == pytest.approx(straight.losses(name), abs=TOL), name
        assert max_diff(trainer.model.tenant_tensors(name), straight.model.tenant_tensors(name)) <= TOL
    assert "now" not in trainer.tenants or trainer.tenants["now"].state.value == "removed"
