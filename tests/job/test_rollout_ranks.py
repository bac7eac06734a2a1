"""Rollout ranks (``Parallel.rollout_ranks``): processes that hold the base and every RL tenant's adapter and
sample while the others train, the adapters reaching them in memory after each step.

- one trainer and one rollout rank equal the same job on one process, stale and on-policy RL tenants beside an
  SFT tenant: the same completions (each sampled with the adapter version its row names), losses, adapters;
- two FSDP trainers and a rollout rank equal it too;
- a job stopped with generations in flight on the rollout rank resumes exactly;
- validation names a layout whose rollout ranks leave no trainer, or that the trainers cannot split.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.lora import read_adapter
from mlora_lab.rundir import RowKind
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems
from tests.job.test_rl_driver import TOL, job, max_diff, prompt_file, reward_file, rl_tenant
from tests.job.test_rl_staleness import slow_rewards


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
    trainer = Trainer(job(llama_path, ts), run_dir=folder / "run")
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


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_here")
@pytest.mark.parametrize(("nproc", "layout"), [(2, {}), (3, {"fsdp": 2})], ids=["1+1", "fsdp2+1"])
def test_rollout_ranks_equal_one_process(nproc, layout, here, llama_path, tmp_path):
    ts, _, _ = here
    spec = job(llama_path, ts, parallel=ml.Parallel(nproc=nproc, rollout_ranks=1, **layout))
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    state = run.wait(600)
    logs = "\n".join(run.logs(r) for r in range(nproc))
    assert state == "finished", f"{state}: {run.error}\n{logs}"
    assert f"[rank {nproc - 1}] rollout rank 0: done" in run.logs(nproc - 1)
    # one trainer samples nothing itself: the rollout rank's batches are the ones it would have sampled
    same_as_here(run, here, 1e-6 if nproc == 2 else TOL)
    system = pd.DataFrame([r.to_dict() for r in run.rows() if r["kind"] == "system"])
    assert set(system["rank"]) == set(range(nproc - 1))  # (the trainers' rows; the rollout rank's shares)
    zero = system[system["rank"] == 0]
    assert zero["rollout_busy"].between(0, 1).all() and zero["rollout_busy"].sum() > 0
    assert zero["trainer_idle"].between(0, 1).all()
    assert system[system["rank"] > 0]["rollout_busy"].isna().all()


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
