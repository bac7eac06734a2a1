"""The RL driver (mlora_lab.job.drivers.rl): GRPO tenants in the training loop, beside SFT tenants.

- one RL tenant trains exactly as plain PEFT with a hand-written GRPO loop (TRL's dapo loss, KL to the
  base with the adapter off, two updates per generation) replaying the completions the job sampled;
- RL and SFT tenants in one job each end as in a job of their own;
- a reward function that raises or hangs quarantines only its tenant, with the reason;
- a job stopped mid-generation and resumed ends as the uninterrupted one.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import peft
import pytest
import torch
import transformers

from mlora_lab.job.drivers.base import JobParts, Plan
from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.drivers.rl import Generation, RLDriver, RLFeed
from mlora_lab.job.trainer import Trainer
from mlora_lab.reference import peft_lora_tensors
from mlora_lab.rundir import CompletionRow, RowKind, TenantState
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import TYPICAL_TARGETS

TOL = 1e-5

REWARDS = """
def _text(c):
    return c if isinstance(c, str) else c[0]["content"]

def short(prompts, completions, **kwargs):
    return [-len(_text(c)) / 10 for c in completions]

def vowels(prompts, completions, completion_ids, **kwargs):
    assert len(completion_ids) == len(completions)
    return [sum(_text(c).count(v) for v in "aeiou") / 4 for c in completions]

def has_word(prompts, completions, word, trainer_state, **kwargs):
    assert trainer_state.max_steps > trainer_state.global_step >= 0
    return [float(w in _text(c)) + 0.1 * len(_text(c).split()) for c, w in zip(completions, word)]

def boom(prompts, completions, **kwargs):
    raise RuntimeError("boom goes the reward")

def hang(prompts, completions, **kwargs):
    import time
    time.sleep(600)

def huge(prompts, completions, **kwargs):          # R9: 1e308 is inf in float32
    return [1e308 * (i % 2) for i in range(len(completions))]

def big(prompts, completions, **kwargs):           # R10: their squares overflow the group's std
    return [1e200 * (i % 2) for i in range(len(completions))]

def unit(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]

def const(prompts, completions, **kwargs):         # every completion alike: nothing to learn
    return [1.0] * len(completions)

def logs(prompts, completions, log_metric, log_extra, **kwargs):
    log_metric("length", sum(len(_text(c)) for c in completions) / len(completions))
    log_extra("first", [_text(c)[:1] for c in completions])
    return [len(_text(c)) / 10 for c in completions]

def plateau(prompts, completions, trainer_state, **kwargs):   # m8: it learns, then every completion scores 0.92
    if trainer_state.global_step >= 2:
        return [0.92] * len(completions)
    return [float(i % 2) for i in range(len(completions))]

def forge(prompts, completions, **kwargs):         # RN12: its worker's say(), found in memory: a ragged frame
    import sys
    f = sys._getframe(1)
    while not hasattr(f.f_locals.get("self"), "say"):
        f = f.f_back
    f.f_locals["self"].say({"rewards": [[1.0]] + [[1.0, 2.0]] * (len(completions) - 1)})
    return [1.0] * len(completions)
"""

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road"]


def reward_file(tmp: Path) -> str:
    path = tmp / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


def prompt_file(tmp: Path, chat: bool = False, n: int = 6) -> str:
    rows = []
    for i in range(n):
        text = f"say {' '.join(WORDS[i : i + 1 + i % 3])} and"
        row = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        rows.append({**row, "word": WORDS[(i + 3) % len(WORDS)]})
    path = tmp / ("chat.jsonl" if chat else "prompts.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rl_tenant(name: str, data: str, rl: RL, **kw) -> Tenant:
    settings = dict(
        rank=4,
        alpha=8,
        target_modules=["q_proj", "v_proj"],
        lr=2e-2,
        batch_size=2,
        max_steps=4,
        max_grad_norm=None,
        eps=1e-6,
        seed=3,
    )
    return Tenant(name=name, data=data, rl=rl, **(settings | kw))


def job(base: str, tenants: list[Tenant], **kw) -> JobSpec:
    return JobSpec(base_model=base, tenants=tenants, seq_len=48, max_rank=8, max_tenants=4, **kw)


class Recording(RLDriver):
    """The RL driver, keeping every generation its tenants train on (for the replays below)."""

    def __init__(self, parts: JobParts) -> None:
        super().__init__(parts)
        self.generations: dict[str, list[tuple[Generation, RLFeed]]] = {}

    def plan(self) -> Plan | None:
        plan = super().plan()
        for t in plan.tenants if plan is not None else []:
            g = t.feed.current
            if g is not None and g.iteration == 0 and t.name not in plan.failed:
                self.generations.setdefault(t.name, []).append((g, t.feed))
        return plan


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(max((a[k][0] - b[k][0]).abs().max().item(), (a[k][1] - b[k][1]).abs().max().item()) for k in a)


def peft_adapter(base: str, path: Path, t: Tenant) -> str:
    """A PEFT adapter with B ≠ 0 (so the first step already has a gradient through A and B)."""
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(
        r=t.rank, lora_alpha=t.alpha, target_modules=t.target_modules, init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(path)
    return str(path)


def completion_logps(model, rows: list[tuple[list[int], list[int]]], temperature: float) -> torch.Tensor:
    """``log p(completion token k | prompt, earlier tokens)`` of each (prompt, completion), ``[N, L]``
    (0 past a completion's end): one padded forward, TRL's ``log_softmax(logits / temperature)``."""
    T = max(len(p) + len(c) for p, c in rows)
    L = max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logp = logits[:, :-1].log_softmax(-1)
    logp = logp.gather(2, ids[:, 1:, None])[..., 0]  # [N, T-1]: of token p + 1
    out = torch.zeros(len(rows), L)
    for i, (p, c) in enumerate(rows):
        out[i, : len(c)] = logp[i, len(p) - 1 : len(p) - 1 + len(c)]
    return out


ARCHS = [("llama", 1.0), ("qwen2", 0.7), ("phi3", 1.0), ("gpt_neox", 0.7)]
"""Tiny architectures (fused projections in phi3 and gpt_neox), each with one sampling temperature: the
loss scores at it."""


@pytest.mark.parametrize(("arch", "temperature"), ARCHS, ids=[a for a, _ in ARCHS])
def test_one_rl_tenant_equals_peft_with_a_hand_written_grpo_loop(arch, temperature, tiny_models, tmp_path):
    base_path = tiny_models(arch)
    rewards = reward_file(tmp_path)
    rl = RL(
        reward=[f"{rewards}:short", f"{rewards}:vowels"],
        reward_weights=[1.0, 0.5],
        group_size=4,
        max_new_tokens=8,
        beta=0.04,
        num_iterations=2,
        epsilon=0.2,
        temperature=temperature,
    )
    t = rl_tenant("a", prompt_file(tmp_path), rl, target_modules=TYPICAL_TARGETS[arch][::2], eps=1e-4)
    # (Adam's eps 1e-4, not 1e-6: advantages sum to zero in each group, so some gradient entries cancel
    # to rounding noise, ~1e-9, which Adam divides by eps; at 1e-6 and lr 2e-2 that noise alone moved
    # qwen2's and phi3's adapters by 2e-5 between two exact computations)
    t = replace(t, init_adapter=peft_adapter(base_path, tmp_path / "init", t))
    trainer = Trainer(job(base_path, [t]), drivers=(Recording, FileData))
    trainer.train()
    assert trainer.tenants["a"].state is TenantState.FINISHED and trainer.tenants["a"].step == 4
    (driver, _) = trainer.drivers
    generations = driver.generations["a"]
    assert len(generations) == 2  # 4 steps, 2 per generation

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    model = peft.PeftModel.from_pretrained(base, t.init_adapter, is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=0.0, foreach=False)
    tok = transformers.AutoTokenizer.from_pretrained(base_path)
    losses = []
    for g, feed in generations:
        G = rl.group_size
        rows = [(feed.prompts[g.prompts[i // G]].ids, g.tokens[i]) for i in range(len(g))]
        texts = [tok.decode(c, skip_special_tokens=True) for _, c in rows]
        # the rewards, by hand: TRL's weighted sum, then (r − mean) / (std + 1e-4) per prompt's group
        R = torch.tensor([-len(x) / 10 + 0.5 * sum(x.count(v) for v in "aeiou") / 4 for x in texts])
        assert torch.allclose(R, g.rewards, atol=1e-6)
        groups = R.view(-1, G)
        A = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        mask = torch.zeros(len(rows), max(len(c) for _, c in rows))
        for i, (_, c) in enumerate(rows):
            mask[i, : len(c)] = 1
        with torch.no_grad(), model.disable_adapter():
            ref = completion_logps(model, rows, rl.temperature)
        old = None
        for _ in range(rl.num_iterations):
            logps = completion_logps(model, rows, rl.temperature)
            old = logps.detach() if old is None else old
            ratio = torch.exp(logps - old)
            clipped = ratio.clamp(1 - rl.epsilon, 1 + rl.epsilon)
            per_token = -torch.min(ratio * A[:, None], clipped * A[:, None])
            kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
            loss = ((per_token + rl.beta * kl) * mask).sum() / mask.sum()  # dapo: over every completion token
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))

    assert trainer.losses("a") == pytest.approx(losses, abs=TOL)
    diff = max_diff(trainer.model.tenant_tensors("a"), peft_lora_tensors(model))
    assert diff <= TOL, f"adapter differs from PEFT + hand-written GRPO by {diff}"
    start = peft_lora_tensors(
        peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base_path), t.init_adapter
        )
    )
    assert max_diff(start, peft_lora_tensors(model)) > 1e-3, "training moved the adapter"

    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN]
    per_step = [g for g, _ in generations for _ in range(rl.num_iterations)]
    assert [r["reward"] for r in rows] == pytest.approx([float(g.rewards.mean()) for g in per_step])
    assert [r["completion_len"] for r in rows] == pytest.approx(
        [sum(map(len, g.tokens)) / len(g) for g in per_step]
    )
    assert all(r["kl"] > 0 and 0 <= r["clip_ratio"] <= 1 for r in rows)  # (the init adapter is not the base)
    samples = [CompletionRow.from_dict(r) for r in trainer.history if r["kind"] == RowKind.COMPLETION]
    assert len(samples) == 4 * rl.log_completions and all(s.tenant == "a" for s in samples)


def test_rl_and_sft_tenants_together_each_equal_alone(llama_path, tmp_path, make_data):
    rewards = reward_file(tmp_path)
    a = rl_tenant(
        "a",
        prompt_file(tmp_path),
        RL(reward=f"{rewards}:short", group_size=3, max_new_tokens=6, temperature=0.8, beta=0.05),
    )
    b = rl_tenant(
        "b",
        prompt_file(tmp_path, chat=True),
        RL(
            reward=f"{rewards}:has_word",
            group_size=4,
            max_new_tokens=5,
            loss_type="grpo",
            scale_rewards="batch",
            mask_truncated_completions=True,
            top_k=20,
            stop=["e"],
        ),
        rank=8,
        alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lr=1e-2,
        batch_size=3,
        max_steps=3,
        seed=5,
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
    slots = dict(slot_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    together = Trainer(job(llama_path, [a, b, sft], **slots))
    together.train()
    # the same job with one forward + backward per tenant in each step: the same run
    passes = Trainer(job(llama_path, [a, b, sft], max_pass_tokens=1, **slots))
    passes.train()
    assert passes.global_step == together.global_step
    for t in (a, b, sft):
        assert passes.losses(t.name) == pytest.approx(together.losses(t.name), abs=TOL), t.name
        assert max_diff(passes.model.tenant_tensors(t.name), together.model.tenant_tensors(t.name)) <= TOL
    for t in (a, b, sft):
        alone = Trainer(job(llama_path, [t], **slots))
        alone.train()
        assert together.tenants[t.name].state is alone.tenants[t.name].state is TenantState.FINISHED
        assert together.losses(t.name) == pytest.approx(alone.losses(t.name), abs=TOL), t.name
        diff = max_diff(together.model.tenant_tensors(t.name), alone.model.tenant_tensors(t.name))
        assert diff <= TOL, f"{t.name}: together vs alone adapters differ by {diff}"
        if t.rl is not None:

            def rewards(trainer, name=t.name):
                return [
                    r["reward"] for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == name
                ]

            assert rewards(together) == pytest.approx(rewards(alone), abs=1e-6)
    sft_rows = [r for r in together.history if r["kind"] == RowKind.TRAIN and r["tenant"] == "s"]
    assert all(r["reward"] is None and r["kl"] is None for r in sft_rows)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulating_micro_batches_equals_one_batch(loss_type, llama_path, tmp_path):
    """``batch_size=1, grad_accum=3`` draws the same 3 prompts and completions as ``batch_size=3`` (the same
    seeds) and trains them in three micro-batches: the same losses, rewards, KL and adapters, with TRL's
    normalisers over the whole generation (two updates per generation: the kept old log-probs too)."""
    rewards = reward_file(tmp_path)
    rl = RL(
        reward=f"{rewards}:vowels",
        group_size=2,
        max_new_tokens=6,
        loss_type=loss_type,
        beta=0.05,
        num_iterations=2,
    )
    data = prompt_file(tmp_path)
    one = Trainer(job(llama_path, [rl_tenant("a", data, rl, batch_size=3)]))
    one.train()
    acc = Trainer(job(llama_path, [rl_tenant("a", data, rl, batch_size=1, grad_accum=3)]))
    acc.train()
    assert acc.tenants["a"].step == 4
    assert acc.losses("a") == pytest.approx(one.losses("a"), abs=TOL)
    diff = max_diff(acc.model.tenant_tensors("a"), one.model.tenant_tensors("a"))
    assert diff <= TOL, f"accumulated vs one batch: adapters differ by {diff}"

    def rows(trainer):
        return [r for r in trainer.history if r["kind"] == RowKind.TRAIN]

    for key in ("reward", "completion_len", "kl", "clip_ratio", "tokens", "rows_seen"):
        assert [r[key] for r in rows(acc)] == pytest.approx([r[key] for r in rows(one)], abs=1e-6), key


def test_a_reward_that_raises_or_hangs_quarantines_only_its_tenant(llama_path, tmp_path, make_data):
    rewards = reward_file(tmp_path)
    data = prompt_file(tmp_path)
    good = rl_tenant("good", data, RL(reward=f"{rewards}:short", group_size=3, max_new_tokens=6), max_steps=3)
    boom = rl_tenant("boom", data, RL(reward=f"{rewards}:boom", group_size=3, max_new_tokens=6), seed=4)
    hang = rl_tenant(
        "hang",
        data,
        RL(reward=f"{rewards}:hang", group_size=3, max_new_tokens=6, reward_timeout_s=2.0),
        seed=5,
    )
    sft = Tenant(
        name="s",
        data=make_data("text"),
        rank=4,
        alpha=8,
        target_modules=["q_proj"],
        lr=5e-3,
        batch_size=2,
        max_steps=3,
    )
    trainer = Trainer(job(llama_path, [good, boom, hang, sft]))
    trainer.train()
    states = {n: (t.state, t.reason or "") for n, t in trainer.tenants.items()}
    assert states["good"][0] is TenantState.FINISHED and states["s"][0] is TenantState.FINISHED
    assert states["boom"][0] is TenantState.FAILED and "boom goes the reward" in states["boom"][1]
    assert states["hang"][0] is TenantState.FAILED and "took more than 2 s" in states["hang"][1]
    assert trainer.tenants["boom"].step == trainer.tenants["hang"].step == 0
    alone = Trainer(job(llama_path, [good]))
    alone.train()
    assert trainer.losses("good") == pytest.approx(alone.losses("good"), abs=TOL)
    assert max_diff(trainer.model.tenant_tensors("good"), alone.model.tenant_tensors("good")) <= TOL


def test_rn12_a_forged_ragged_answer_fails_only_its_tenant(llama_path, tmp_path):
    """RN12: a reward that sends its worker a real frame of ragged rows (it found the worker's say() in
    memory) quarantines its own tenant, naming the function; the job and the other RL tenant go on."""
    rewards, data = reward_file(tmp_path), prompt_file(tmp_path)
    fine = rl_tenant("fine", data, RL(reward=f"{rewards}:short", group_size=2, max_new_tokens=4), max_steps=2)
    forger = rl_tenant("forger", data, RL(reward=f"{rewards}:forge", group_size=2, max_new_tokens=4), seed=4)
    trainer = Trainer(job(llama_path, [fine, forger]))
    trainer.train()
    bad, good = trainer.tenants["forger"], trainer.tenants["fine"]
    assert bad.state is TenantState.FAILED and bad.step == 0, bad.reason
    assert "answer is malformed: row 1 has 2 rewards for 1 reward function(s)" in bad.reason
    assert "'forge' (" in bad.reason
    assert good.state is TenantState.FINISHED and good.step == 2


def test_stopped_mid_generation_and_resumed_equals_straight_through(llama_path, tmp_path):
    rewards = reward_file(tmp_path)
    rl = RL(reward=f"{rewards}:short", group_size=3, max_new_tokens=6, beta=0.1, num_iterations=2)
    # "b" accumulates 4 micro-batches: after 3 loop steps it is inside its first window, with the old
    # log-probs and KL sums of 3 micro-batches kept
    tenants = [
        rl_tenant("a", prompt_file(tmp_path), rl, max_steps=5),
        rl_tenant("b", prompt_file(tmp_path), rl, max_steps=2, batch_size=1, grad_accum=4, seed=8),
    ]
    straight = Trainer(job(llama_path, tenants))
    straight.train()
    first = Trainer(job(llama_path, tenants), run_dir=tmp_path / "run")
    for _ in range(3):
        assert first.step()
    g = first.tenants["a"].feed.current
    assert g is not None and g.iteration == 1 and g.old_logps is not None and g.ref_logps is not None
    gb = first.tenants["b"].feed.current
    assert first.tenants["b"].feed.micro == 3 and gb.iteration == 0 and first.tenants["b"].step == 0
    assert gb.old_local is not None and gb.stats[1] > 0
    first.save_checkpoint()
    first.close()
    again = Trainer(job(llama_path, tenants), run_dir=tmp_path / "run", resume=True)
    restored = again.tenants["a"].feed.current
    assert restored.tokens == g.tokens and torch.equal(restored.old_logps, g.old_logps)
    rb = again.tenants["b"].feed.current
    assert again.tenants["b"].feed.micro == 3 and torch.equal(rb.stats, gb.stats)
    assert torch.equal(rb.old_local, gb.old_local)
    again.train()
    assert again.tenants["a"].step == 5 and again.tenants["b"].step == 2
    for name, after in (("a", 2), ("b", 2)):
        assert again.losses(name)[-after:] == pytest.approx(straight.losses(name)[-after:], abs=1e-6), name
        for m, (A, B) in straight.model.tenant_tensors(name).items():
            A2, B2 = again.model.tenant_tensors(name)[m]
            assert max((A - A2).abs().max().item(), (B - B2).abs().max().item()) <= 1e-6, name

    def kl(trainer):
        return [r["kl"] for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == "b"]

    assert kl(again) == pytest.approx(kl(straight), abs=1e-6)  # (its window's sums were saved)


def test_rewards_reach_the_functions_as_trl_gives_them(llama_path, tmp_path):
    """Chat prompts reach the reward function as their messages and completions as one assistant
    message; the data's other columns, one value per completion."""
    seen = tmp_path / "seen.jsonl"
    path = tmp_path / "spy.py"
    path.write_text(
        "import json\n"
        "def spy(prompts, completions, completion_ids, word, trainer_state, **kwargs):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps([prompts, completions, completion_ids, word, trainer_state.global_step]) + '\\n')\n"
        "    return [float(len(c)) for c in completion_ids]\n"
    )
    rl = RL(reward=f"{path}:spy", group_size=2, max_new_tokens=4)
    t = rl_tenant("c", prompt_file(tmp_path, chat=True), rl, batch_size=2, max_steps=2, shuffle=False)
    trainer = Trainer(job(llama_path, [t]))
    trainer.train()
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [c[4] for c in calls] == [0, 1]
    prompts, completions, ids, words, _ = calls[0]
    assert prompts[0] == prompts[1] == [{"role": "user", "content": "say red and"}]
    assert words == ["cat", "cat", "dog", "dog"]
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    assert all(1 <= len(x) <= 4 for x in ids)
    rewards = [r["reward"] for r in trainer.history if r["kind"] == RowKind.TRAIN]
    assert rewards == pytest.approx([sum(map(len, ids)) / len(ids), sum(map(len, calls[1][2])) / len(ids)])


def two_rl_tenants(folder: Path) -> list[Tenant]:
    """Two RL tenants for the torchrun tests: one at temperature 0.9 with 3 prompts x 3 completions (9
    rows: 5 and 4 on two ranks), one with a KL term (beta 0.1), two updates per generation and two
    micro-batches per update (1 prompt x 2 completions each: one row per rank)."""
    rewards, data = reward_file(folder), prompt_file(folder)
    return [
        rl_tenant("a", data, RL(reward=f"{rewards}:short", group_size=3, max_new_tokens=6, temperature=0.9),
                  batch_size=3, max_steps=3),
        rl_tenant("b", data, RL(reward=f"{rewards}:has_word", group_size=2, max_new_tokens=5, beta=0.1,
                                num_iterations=2), batch_size=1, grad_accum=2, max_steps=3, seed=7),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(llama_path, tmp_path_factory) -> tuple[list[Tenant], Trainer, Path]:
    """:func:`two_rl_tenants` trained on one process, here (the reference of the torchrun tests)."""
    folder = tmp_path_factory.mktemp("rl_one")
    tenants = two_rl_tenants(folder)
    trainer = Trainer(job(llama_path, tenants), run_dir=folder / "run")
    trainer.train()
    trainer.close()
    return tenants, trainer, folder / "run"


@pytest.mark.slow
@pytest.mark.xdist_group("rl_one_process")  # (a module fixture is made once per xdist worker)
@pytest.mark.parametrize(
    ("layout", "passes"),
    [({"fsdp": 2}, None), ({"fsdp": 1, "tp": 2}, None), ({"fsdp": 2}, 1)],
    ids=["fsdp2", "tp2", "fsdp2-a-pass-per-tenant"],
)
def test_two_ranks_equal_one(layout, passes, one_process, llama_path, tmp_path):
    """Under torchrun with fsdp=2 (tp=2) both ranks sample the same completions (same requests, same
    seeds, the decode steps kept in step by ``any_running``; under tp=2 every forward is split), rank 0's
    rewards reach both, each trains its share of the rows (fsdp=2: 9 completions, 5 and 4; tp=2: all of
    them, its half of each projection), and the run ends as on one process. With ``max_pass_tokens=1``
    each step runs one forward + backward per tenant, the ranks agreeing on the passes although their rows
    differ: the same run again."""
    import mlora_lab as ml
    from mlora_lab.lora import read_adapter

    tenants, trainer, reference = one_process
    spec = job(llama_path, tenants, parallel=ml.Parallel(nproc=2, **layout), max_pass_tokens=passes)
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    state = run.wait(600)
    assert state == "finished", f"{state}: {run.error}\n{run.logs(0)}\n{run.logs(1)}"
    m = run.metrics()
    m = m[m["kind"] == "train"]
    assert set(m["tenant"]) == {"a", "b"}
    want = {(r["tenant"], r["tenant_step"]): r for r in trainer.history if r["kind"] == RowKind.TRAIN}
    got = m.set_index(["tenant", "tenant_step"]).sort_index()
    assert set(got.index) == set(want)
    assert list(got["reward"]) == pytest.approx([want[k]["reward"] for k in got.index], abs=1e-6)
    assert list(got["loss"]) == pytest.approx([want[k]["loss"] for k in got.index], abs=TOL)
    for name in ("a", "b"):
        x, y = read_adapter(run.adapter_path(name))[1], read_adapter(reference / "adapters" / name)[1]
        assert max_diff(x, y) <= TOL


def test_a_conversational_prompt_is_a_chat_to_complete_as_trl_takes_it(tmp_path, llama_path):
    """``{"prompt": [{"role": "user", ...}]}`` (TRL's conversational rows) is completed as the assistant's next
    turn, exactly as the same chat given as ``messages``: the same token ids, and the reward functions get
    the messages as the prompt and a chat completion."""
    from mlora_lab.job.drivers.rl import read_prompts

    chat = [{"role": "user", "content": "what is 2 + 2?"}]
    rows = {
        "prompt": tmp_path / "prompt.jsonl",
        "messages": tmp_path / "messages.jsonl",
    }
    for key, path in rows.items():
        path.write_text(json.dumps({key: chat, "answer": "4"}) + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    got = {
        key: read_prompts(
            Tenant(name="a", data=str(path), rl=RL(reward="x.py:f", max_new_tokens=8)),
            tok,
            64,
            tok.vocab_size,
        )[0]
        for key, path in rows.items()
    }
    assert got["prompt"].ids == got["messages"].ids and got["prompt"].prompt == chat and got["prompt"].chat
    assert got["prompt"].columns == {"answer": "4"} == got["messages"].columns


@pytest.mark.parametrize(
    ("name", "reward", "weights", "message"),
    [
        ("huge", "huge", [2.0], r"the weighted reward of completion 1 is inf: reward 'huge' \(.*rewards.py\) gave 1e\+308"),
        ("big", "big", None, r"standard deviation of the rewards of prompt 0's group overflows .*'big' \(.*rewards.py\)"),
        ("weighted", "unit", [1e300], r"standard deviation .* overflows"),
    ],
)  # fmt: skip
def test_rewards_that_overflow_are_a_named_fault_never_zero_advantages(
    llama_path, tmp_path, name, reward, weights, message
):
    """R9 (a reward of 1e308: inf in float32, every advantage 0), R10 (rewards near 1e200, or a huge weight:
    the group's std overflows): the tenant is quarantined with the reward named, never trained on nothing in
    silence; the rewards are combined in float64, so 1e20 rewards weighted by 1e20 still train."""
    rewards = reward_file(tmp_path)
    data = prompt_file(tmp_path)
    rl = RL(reward=f"{rewards}:{reward}", reward_weights=weights, group_size=2, max_new_tokens=4)
    fine = RL(reward=f"{rewards}:unit", reward_weights=[1e20], group_size=2, max_new_tokens=4)
    trainer = Trainer(
        job(llama_path, [rl_tenant(name, data, rl, max_steps=2), rl_tenant("fine", data, fine, max_steps=2)])
    )
    trainer.train()
    bad, good = trainer.tenants[name], trainer.tenants["fine"]
    assert bad.state is TenantState.FAILED and bad.step == 0
    assert re.search(message, bad.reason), bad.reason
    assert good.state is TenantState.FINISHED and all(
        r["grad_norm"] > 0 for r in trainer.recorder.history if r["kind"] == "train" and r["tenant"] == "fine"
    )


def test_a_tenant_that_trains_on_nothing_is_warned_and_what_its_rewards_logged_is_kept(llama_path, tmp_path):
    """Flat rewards for 5 generations in a row, or every completion masked: a ``warning`` row names the
    tenant (once a streak), never silence. Each reward function's mean and std (TRL's ``rewards/<fn>/mean``),
    what the functions logged with ``log_metric`` and ``log_extra`` are in the rows (R19)."""
    from mlora_lab.job.drivers.rl import FLAT_GENERATIONS
    from mlora_lab.lab.records.series import rows_frame
    from mlora_lab.rundir import Row

    rewards = reward_file(tmp_path)
    data = prompt_file(tmp_path)
    flat = rl_tenant("flat", data, RL(reward=f"{rewards}:const", group_size=2, max_new_tokens=3), max_steps=6)
    cut = RL(
        reward=f"{rewards}:unit", group_size=2, max_new_tokens=1, mask_truncated_completions=True, stop=[]
    )
    masked = rl_tenant("masked", data, cut, max_steps=2)
    both = RL(
        reward=[f"{rewards}:unit", f"{rewards}:logs"], group_size=2, max_new_tokens=3, log_completions=2
    )
    logged = rl_tenant("logged", data, both, max_steps=2)
    trainer = Trainer(job(llama_path, [flat, masked, logged]))
    trainer.train()
    rows = [Row.from_dict(r) for r in trainer.recorder.history]
    warnings = [(r.tenant, r.message) for r in rows if r.kind == "event" and r.event == "warning"]
    assert [t for t, _ in warnings].count("flat") == 1 and [t for t, _ in warnings].count("masked") == 1, (
        warnings
    )
    said = dict(warnings)
    assert f"last {FLAT_GENERATIONS} generations scored one reward" in said["flat"]
    assert "max_new_tokens=1 and mask_truncated_completions masks them all" in said["masked"]
    train = [r for r in rows if r.kind == "train" and r.tenant == "logged"]
    extra = train[-1].extra
    assert set(extra) == {
        "rewards/unit/mean",
        "rewards/unit/std",
        "rewards/logs/mean",
        "rewards/logs/std",
        "length",
    }
    assert extra["rewards/unit/mean"] == pytest.approx(0.5)  # (unit: 0, 1, 0, 1, ...)
    frame = rows_frame(train)
    assert frame["rewards/logs/mean"].notna().all() and frame["length"].dtype == "float64"
    samples = [r for r in rows if r.kind == "completion" and r.tenant == "logged"]
    assert samples and all(set(r.extra) == {"first"} and len(r.extra["first"]) <= 1 for r in samples)


def test_rn8_an_rl_tenants_far_longer_prompts_are_cut_before_they_are_tokenized_and_warned(
    llama_path, tmp_path
):
    """RN8: the RL driver reads a tenant's prompts as SFT rows are read: a 2-MB prompt is cut to its end
    before it is tokenized (never tokenized whole), and one warning in the SFT rows' words counts the cut."""
    import warnings

    from test_data import Spy

    from mlora_lab.job.drivers.rl import read_prompts

    data = tmp_path / "far.jsonl"
    data.write_text(
        json.dumps({"prompt": "word " * 400_000 + "say yes"}) + "\n" + json.dumps({"prompt": "hi"}) + "\n"
    )
    tok = Spy(transformers.AutoTokenizer.from_pretrained(llama_path))
    t = rl_tenant("a", str(data), RL(reward="m:f", max_new_tokens=8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prompts = read_prompts(t, tok, seq_len=48, vocab=10**6)
    assert tok.longest < 50_000, tok.longest
    assert [str(w.message) for w in caught] == [
        f"{data}: 1 of 2 prompt(s) truncated to their last 40 tokens (seq_len - max_new_tokens)"
    ]
    assert [len(p.ids) for p in prompts] == [40, len(tok.tok("hi")["input_ids"])]
    assert prompts[0].ids == tok.tok("word " * 20 + "say yes")["input_ids"][-40:]


def test_m8_flat_rewards_say_converged_at_the_best_reward_seen_and_finish_their_sentence(
    llama_path, tmp_path
):
    """m8: flat rewards for 5 generations in a row that are the best the tenant has had (0.92, after 0.5) say
    it converged; flat rewards from the start say it learns nothing and what would help, in whole sentences."""
    from mlora_lab.job.drivers.rl import FLAT_GENERATIONS
    from mlora_lab.rundir import Row

    rewards, data = reward_file(tmp_path), prompt_file(tmp_path)
    steps = 2 + FLAT_GENERATIONS
    tenants = [
        rl_tenant(
            "flat", data, RL(reward=f"{rewards}:const", group_size=2, max_new_tokens=2), max_steps=steps
        ),
        rl_tenant(
            "done", data, RL(reward=f"{rewards}:plateau", group_size=2, max_new_tokens=2), max_steps=steps
        ),
    ]
    trainer = Trainer(job(llama_path, tenants))
    trainer.train()
    rows = [Row.from_dict(r) for r in trainer.recorder.history]
    said = {r.tenant: r.message for r in rows if r.kind == "event" and r.event == "warning"}
    assert set(said) == {"flat", "done"}, said
    assert said["done"] == (
        f"every group of its last {FLAT_GENERATIONS} generations scored one reward for all its 2 completions "
        "(mean 0.92, the best it has had): it has converged, and with advantages of 0 it learns nothing more; "
        "stop it, or give it harder prompts or a reward that tells its completions apart."
    )
    assert said["flat"] == (
        f"every group of its last {FLAT_GENERATIONS} generations scored one reward for all its 2 completions "
        "(mean 1): its advantages are 0 and it learns nothing; a reward that tells its completions apart (or a "
        "higher temperature) would give it something to learn from."
    )


def test_m9_each_reward_functions_columns_are_named_by_reward_names_or_lambda_k(llama_path, tmp_path):
    """m9: two lambdas given by value, pickled into the run as a launch does (both ``…-reward.pkl:reward``),
    log ``rewards/<lambda #1>/mean`` and ``rewards/<lambda #2>/mean``, not ``rewards/reward/mean`` twice;
    ``reward_names`` names the columns of functions named by reference."""
    from mlora_lab.lab.runs.tenant_data import freeze, write_data
    from mlora_lab.rundir import RunDir

    rewards, data = reward_file(tmp_path), prompt_file(tmp_path)
    lambdas = RL(
        reward=[lambda completions, **kw: [len(str(c)) / 9 for c in completions], lambda completions, **kw: [
            float(i % 2) for i in range(len(completions))]],
        group_size=2,
        max_new_tokens=3,
    )  # fmt: skip
    given = write_data(RunDir(tmp_path / "run"), freeze(rl_tenant("l", data, lambdas, max_steps=1)))
    assert [r.rpartition(":")[2] for r in given.rl.reward] == ["reward", "reward"]
    named = RL(
        reward=[f"{rewards}:short", f"{rewards}:short"],
        reward_names=["brevity", "again"],
        group_size=2,
        max_new_tokens=3,
    )
    trainer = Trainer(job(llama_path, [given, rl_tenant("n", data, named, max_steps=1)]))
    trainer.train()
    extra = {r["tenant"]: r["extra"] for r in trainer.history if r["kind"] == RowKind.TRAIN}
    assert set(extra["l"]) == {f"rewards/<lambda #{k}>/{s}" for k in (1, 2) for s in ("mean", "std")}
    assert extra["l"]["rewards/<lambda #2>/mean"] == pytest.approx(0.5)
    assert set(extra["n"]) == {
        f"rewards/{name}/{s}" for name in ("brevity", "again") for s in ("mean", "std")
    }


@pytest.mark.slow  # (starts a job)
def test_reward_functions_from_a_notebook_a_lambda_and_a_closure_train_as_their_file_would(
    llama_path, tmp_path
):
    """``RL(reward=[fn, lambda ..., closure])`` as TRL's ``reward_funcs=[fn]``: validated (a function that
    cannot travel to the worker is named), pickled by value into the run at launch, and called by the job's
    reward worker; job.json names the pickles. The tenant trains exactly as with the same functions in a file."""
    import mlora_lab as ml
    from mlora_lab.validate import problems

    data = prompt_file(tmp_path)
    target = "e"

    def letters(prompts, completions, **kwargs):  # (a closure: `target` comes by value)
        return [_count(c, target) for c in completions]

    callables = [letters, lambda completions, **kw: [len(str(c)) / 20 for c in completions]]
    rl = RL(reward=callables, group_size=2, max_new_tokens=4)
    spec = job(llama_path, [rl_tenant("nb", data, rl, max_steps=2)])
    spec.output_dir = str(tmp_path / "runs")
    assert problems(spec) == []
    import threading

    lock = threading.Lock()  # (no pickle holds a lock)
    bad = RL(
        reward=lambda completions, **kw: [lock is None] * len(completions), group_size=2, max_new_tokens=4
    )
    said = [str(p) for p in problems(job(llama_path, [rl_tenant("bad", data, bad)]))]
    assert len(said) == 1 and "cannot be pickled for the reward worker" in said[0], said
    run = ml.launch(spec)
    assert run.wait(300) == "finished", run.logs(0)
    refs = ml.JobSpec.load(run.dir.job).tenants[0].rl.reward
    assert [Path(r.rpartition(":")[0]).name for r in refs] == ["0-letters.pkl", "1-reward.pkl"]
    rewards = [r for r in run.metrics()["reward"].dropna()]
    file = tmp_path / "same.py"
    file.write_text(
        "def _count(c, t):\n    return (c if isinstance(c, str) else c[0]['content']).count(t) / 4\n"
        "def letters(prompts, completions, **kwargs):\n    return [_count(c, 'e') for c in completions]\n"
        "def length(completions, **kw):\n    return [len(str(c)) / 20 for c in completions]\n"
    )
    same = RL(reward=[f"{file}:letters", f"{file}:length"], group_size=2, max_new_tokens=4)
    alone = Trainer(job(llama_path, [rl_tenant("nb", data, same, max_steps=2)]))
    alone.train()
    assert rewards == pytest.approx([r["reward"] for r in alone.recorder.history if r["kind"] == "train"])


def _count(c, t):
    return (c if isinstance(c, str) else c[0]["content"]).count(t) / 4


def test_log_every_logs_an_rl_tenants_rows_and_completions_on_the_same_steps(llama_path, tmp_path):
    """``log_every=2`` over 3 steps: train rows (with the reward) at tenant steps 2 and 3 (the last), and the
    sampled completions of those steps only."""
    rl = RL(reward=f"{reward_file(tmp_path)}:short", group_size=3, max_new_tokens=4, log_completions=2)
    trainer = Trainer(job(llama_path, [rl_tenant("a", prompt_file(tmp_path), rl, max_steps=3)], log_every=2))
    trainer.train()
    train = [r for r in trainer.history if r["kind"] == RowKind.TRAIN]
    assert [r["tenant_step"] for r in train] == [2, 3] and all(r["reward"] is not None for r in train)
    done = [r["tenant_step"] for r in trainer.history if r["kind"] == RowKind.COMPLETION]
    assert done == [2, 2, 3, 3]
