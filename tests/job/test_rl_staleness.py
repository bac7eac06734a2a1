"""RL tenants that sample ahead (``rl.max_staleness``): generations drawn with the adapter of their time, rewards
in flight while the job trains, and everything a job promises still true with them in flight.

- a stale tenant equals PEFT with a hand-written asynchronous GRPO loop (TRL AsyncGRPO's ratio against the
  sampler's log-probs), and each generation's sampler log-probs are PEFT's under the adapter version that the
  completion row names;
- stale and on-policy tenants beside an SFT tenant each equal themselves alone;
- a job stopped with generations in flight (sampled, rewards not read) resumes exactly;
- a reward that fails on a generation sampled ahead fails only its tenant, when that generation's window starts;
- validation refuses what staleness cannot do yet, naming each problem.
"""

from __future__ import annotations

from dataclasses import replace

import peft
import pytest
import torch
import transformers

from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.trainer import Trainer
from mlora_lab.reference import peft_lora_tensors
from mlora_lab.rundir import CompletionRow, RowKind, TenantState
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems
from tests.job.test_rl_driver import (
    TOL,
    Recording,
    completion_logps,
    job,
    max_diff,
    peft_adapter,
    prompt_file,
    reward_file,
    rl_tenant,
)

SLOW = """
import time

def slow_short(prompts, completions, **kwargs):
    time.sleep(0.2)
    return [-len(c if isinstance(c, str) else c[0]["content"]) / 10 for c in completions]

def sleepy(prompts, completions, **kwargs):           # a slow tool or judge: 2 s a call
    time.sleep(2.0)
    return [float(i % 2) for i in range(len(completions))]

def late_boom(prompts, completions, trainer_state, **kwargs):   # fails on what adapter version 1 sampled
    if trainer_state.global_step >= 1:
        raise RuntimeError("late boom")
    return [float(i % 2) for i in range(len(completions))]
"""


def slow_rewards(tmp_path) -> str:
    path = tmp_path / "slow.py"
    path.write_text(SLOW)
    return str(path)


def versions(trainer: Trainer, name: str) -> list[tuple[int, int]]:
    """``(tenant_step, adapter_version)`` of a tenant's completion rows."""
    rows = [CompletionRow.from_dict(r) for r in trainer.history if r["kind"] == RowKind.COMPLETION]
    return [(r.tenant_step, r.adapter_version) for r in rows if r.tenant == name]


@pytest.mark.parametrize(("arch", "staleness"), [("llama", 1), ("qwen2", 2)])
def test_a_stale_tenant_equals_peft_with_a_hand_written_async_grpo_loop(
    arch, staleness, tiny_models, tmp_path
):
    base_path = tiny_models(arch)
    rewards = reward_file(tmp_path)
    rl = RL(
        reward=[f"{rewards}:short", f"{rewards}:vowels"],
        reward_weights=[1.0, 0.5],
        group_size=4,
        max_new_tokens=8,
        temperature=0.9,
        epsilon=0.2,
        max_staleness=staleness,
    )
    t = rl_tenant("a", prompt_file(tmp_path), rl, max_steps=4, eps=1e-4)
    t = replace(t, init_adapter=peft_adapter(base_path, tmp_path / "init", t))
    trainer = Trainer(job(base_path, [t]), drivers=(Recording, FileData))
    trainer.train()
    assert trainer.tenants["a"].state is TenantState.FINISHED and trainer.tenants["a"].step == 4
    (driver, _) = trainer.drivers
    generations = [g for g, _ in driver.generations["a"]]
    feed = driver.generations["a"][0][1]
    # generation k starts at step k and was sampled with the adapter of step max(0, k - s)
    assert [g.version for g in generations] == [max(0, k - staleness) for k in range(4)]
    assert versions(trainer, "a") == [
        (k + 1, max(0, k - staleness)) for k in range(4) for _ in range(rl.log_completions)
    ]

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    model = peft.PeftModel.from_pretrained(base, t.init_adapter, is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=0.0, foreach=False)
    snapshots = {0: [p.detach().clone() for p in params]}  # adapter version → its parameters
    losses = []
    for k, g in enumerate(generations):
        rows = [(feed.prompts[g.prompts[i // rl.group_size]].ids, g.tokens[i]) for i in range(len(g))]
        mask = torch.zeros(len(rows), max(len(c) for _, c in rows))
        for i, (_, c) in enumerate(rows):
            mask[i, : len(c)] = 1
        sampler = torch.zeros_like(mask)
        for i, lps in enumerate(g.sampled_logps):
            sampler[i, : len(lps)] = torch.tensor(lps)
        # the sampler's log-probs are PEFT's under the adapter of the version the rows name
        now = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, snapshots[g.version]):
                p.copy_(v)
            then = completion_logps(model, rows, rl.temperature)
            for p, v in zip(params, now):
                p.copy_(v)
        assert ((then - sampler) * mask).abs().max() <= 1e-4, (
            f"generation {k} was not sampled at v{g.version}"
        )
        A = g.advantages
        logps = completion_logps(model, rows, rl.temperature)
        ratio = torch.exp(logps - sampler)  # AsyncGRPO: π_θ / π_sampler
        per_token = -torch.min(ratio * A[:, None], ratio.clamp(1 - rl.epsilon, 1 + rl.epsilon) * A[:, None])
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        snapshots[k + 1] = [p.detach().clone() for p in params]

    assert trainer.losses("a") == pytest.approx(losses, abs=TOL)
    diff = max_diff(trainer.model.tenant_tensors("a"), peft_lora_tensors(model))
    assert diff <= TOL, f"adapter differs from PEFT + hand-written async GRPO by {diff}"
    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == "a"]
    assert [r["extra"]["staleness"] for r in rows] == [k - max(0, k - staleness) for k in range(4)]


def test_stale_and_on_policy_tenants_beside_sft_each_equal_alone(llama_path, tmp_path, make_data):
    rewards = reward_file(tmp_path)
    slow = slow_rewards(tmp_path)
    ahead = rl_tenant(
        "ahead",
        prompt_file(tmp_path),
        RL(reward=f"{slow}:slow_short", group_size=3, max_new_tokens=6, beta=0.05, max_staleness=2),
        max_steps=4,
    )
    mu = rl_tenant(
        "mu",
        prompt_file(tmp_path, chat=True),
        RL(reward=f"{rewards}:has_word", group_size=4, max_new_tokens=5, num_iterations=2, max_staleness=1),
        batch_size=1,
        grad_accum=2,
        max_steps=5,
        seed=5,
    )
    now = rl_tenant(
        "now", prompt_file(tmp_path), RL(reward=f"{rewards}:vowels", group_size=3, max_new_tokens=5)
    )
    sft = Tenant(
        name="s",
        data=make_data("reverse"),
        rank=4,
        alpha=8,
        target_modules=["q_proj", "v_proj"],
        lr=5e-3,
        batch_size=2,
        max_steps=5,
        seed=1,
    )
    together = Trainer(job(llama_path, [ahead, mu, now, sft], lockstep=True))
    together.train()
    for t in (ahead, mu, now, sft):
        alone = Trainer(job(llama_path, [t], lockstep=True))
        alone.train()
        assert together.tenants[t.name].state is alone.tenants[t.name].state is TenantState.FINISHED
        assert together.losses(t.name) == pytest.approx(alone.losses(t.name), abs=TOL), t.name
        diff = max_diff(together.model.tenant_tensors(t.name), alone.model.tenant_tensors(t.name))
        assert diff <= TOL, f"{t.name}: together vs alone adapters differ by {diff}"
        if t.rl is not None:
            assert versions(together, t.name) == versions(alone, t.name)
    # μ = 2 with s = 1: generation k starts at step 2k, sampled one step before (at step 2k - 1) from k = 1 on
    assert sorted({v for _, v in versions(together, "mu")}) == [0, 1, 3]
    assert all(v == s - 1 for s, v in versions(together, "now"))  # (s = 0: the adapter that trains on it)


def test_stopped_with_generations_in_flight_and_resumed_equals_straight_through(llama_path, tmp_path):
    slow = slow_rewards(tmp_path)
    rl = RL(reward=f"{slow}:slow_short", group_size=3, max_new_tokens=6, max_staleness=2)
    tenants = [rl_tenant("a", prompt_file(tmp_path), rl, max_steps=5)]
    straight = Trainer(job(llama_path, tenants, lockstep=True))
    straight.train()
    first = Trainer(job(llama_path, tenants, lockstep=True), run_dir=tmp_path / "run")
    for _ in range(2):
        assert first.step()
    ahead = first.tenants["a"].feed.ahead
    assert [s.version for s in ahead] == [0, 1]  # generations 2 and 3: sampled, their rewards in flight
    first.save_checkpoint()
    first.close()
    again = Trainer(job(llama_path, tenants, lockstep=True), run_dir=tmp_path / "run", resume=True)
    restored = again.tenants["a"].feed.ahead
    assert [(s.index, s.version, s.tokens) for s in restored] == [
        (s.index, s.version, s.tokens) for s in ahead
    ]
    again.train()
    assert again.tenants["a"].step == 5
    assert again.losses("a")[-3:] == pytest.approx(straight.losses("a")[-3:], abs=TOL)
    assert max_diff(again.model.tenant_tensors("a"), straight.model.tenant_tensors("a")) <= TOL
    assert versions(again, "a") == [x for x in versions(straight, "a") if x[0] > 2]


def test_a_reward_failing_on_a_generation_sampled_ahead_fails_only_its_tenant(llama_path, tmp_path):
    slow = slow_rewards(tmp_path)
    rewards = reward_file(tmp_path)
    data = prompt_file(tmp_path)
    bad = rl_tenant(
        "bad", data, RL(reward=f"{slow}:late_boom", group_size=3, max_new_tokens=6, max_staleness=1)
    )
    good = rl_tenant("good", data, RL(reward=f"{rewards}:short", group_size=3, max_new_tokens=6), seed=4)
    trainer = Trainer(job(llama_path, [bad, good]))
    trainer.train()
    b, g = trainer.tenants["bad"], trainer.tenants["good"]
    # generations 0 and 1 were sampled by version 0 and train; generation 2 (version 1) fails when it would start
    assert b.state is TenantState.FAILED and b.step == 2 and "late boom" in b.reason, b.reason
    assert g.state is TenantState.FINISHED and g.step == 4


def test_staleness_is_refused_where_it_cannot_hold_naming_each_problem(llama_path, tmp_path):
    rewards = reward_file(tmp_path)
    data = prompt_file(tmp_path)
    agent = rl_tenant("agent", data, RL(env=f"{rewards}:short", max_new_tokens=8, max_staleness=1))
    filtered = rl_tenant(
        "filtered", data, RL(reward=f"{rewards}:short", max_new_tokens=8, top_k=5, max_staleness=2), seed=4
    )
    negative = rl_tenant(
        "negative", data, RL(reward=f"{rewards}:short", max_new_tokens=8, max_staleness=-1), seed=5
    )
    text = "\n".join(str(p) for p in problems(job(llama_path, [agent, filtered, negative])))
    assert "agent" in text and "sampling them ahead is not offered yet" in text
    assert "filtered" in text and "top_k=5" in text
    assert "negative" in text and "max_staleness" in text


def test_a_tenant_waiting_on_its_rewards_sits_steps_out_and_does_not_hold_the_others_back(
    llama_path, tmp_path
):
    """A tenant sampling ahead whose rewards are still being computed sits the step out (its generation starts
    when they are in) while the others train: their steps are not held back, and every tenant ends as alone."""
    slow, rewards = slow_rewards(tmp_path), reward_file(tmp_path)
    data = prompt_file(tmp_path)
    sleepy = rl_tenant(
        "sleepy",
        data,
        RL(reward=f"{slow}:sleepy", group_size=2, max_new_tokens=4, max_staleness=1),
        max_steps=3,
    )
    quick = rl_tenant(
        "quick",
        data,
        RL(reward=f"{rewards}:short", group_size=2, max_new_tokens=4, max_staleness=1),
        seed=4,
        max_steps=8,
    )
    trainer = Trainer(job(llama_path, [sleepy, quick]))
    trainer.train()
    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN]
    steps = {
        n: [(r["step"], r["tenant_step"]) for r in rows if r["tenant"] == n] for n in ("sleepy", "quick")
    }
    # while sleepy waits ~2 s for its second generation's rewards, quick goes on training (however loaded the
    # machine, a step of it takes far less than 2 s / 6)
    second = steps["sleepy"][1][0]
    assert sum(1 for s, _ in steps["quick"] if s < second) >= 6, steps
    for t in (sleepy, quick):
        alone = Trainer(job(llama_path, [t]))
        alone.train()
        assert trainer.losses(t.name) == pytest.approx(alone.losses(t.name), abs=TOL), t.name
