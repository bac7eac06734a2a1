"""Agent tenants in the training loop (``rl.env``, ``rl.tools``; mlora_lab.agents, the RL driver's agent part).

- a one-turn env trains exactly as today's single-turn RL tenant on the same reward and seed, in one job;
- a multi-turn env (a guessing game with feedback) trains token-exactly: the trajectory's rows are the sampled
  ids and the template's own tokens for the feedback, the loss covers the model's tokens alone (the
  environment's get no gradient), the ratio is against the sampler's log-probs: the adapter equals PEFT with
  GRPO written by hand over the recorded trajectories;
- an env that raises, returns garbage or never calls the model quarantines only its tenant, with the reason.
"""

from __future__ import annotations

import json
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
from mlora_lab.rl.trajectory import ENV, MODEL
from mlora_lab.rundir import CompletionRow, EpisodeRecord, MetricsReader, RowKind, TenantState
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant

TOL = 1e-5

CODE = """
def _text(c):
    return c if isinstance(c, str) else c[0]["content"]

def short(prompts, completions, **kwargs):
    return [-len(_text(c)) / 10 for c in completions]

def one_turn(client, model, example):
    answer = client.chat.completions.create(model=model, messages=example["messages"])
    return -len(answer.choices[0].message.content) / 10

def guess(client, model, example, rounds=3):
    messages = list(example["messages"])
    parts = {"hit": 0.0, "length": 0.0}
    for k in range(rounds):
        m = client.chat.completions.create(model=model, messages=messages).choices[0].message
        messages.append({"role": "assistant", "content": m.content})
        parts["hit"] += float(example["word"] in m.content)
        parts["length"] -= len(m.content) / 20
        if k + 1 < rounds:
            messages.append({"role": "user", "content": "higher" if k % 2 else "lower, try again"})
    return {"rewards": {"hit": parts["hit"], "length": {"score": parts["length"], "weight": 0.5}},
            "metrics": {"rounds": rounds}, "messages": messages}

async def async_guess(client, model, example):
    m = (await client.chat.completions.create(model=model, messages=example["messages"])).choices[0].message
    return len(m.content) / 10

def boom(client, model, example):
    client.chat.completions.create(model=model, messages=example["messages"])
    raise RuntimeError("the env fell over")

def garbage(client, model, example):
    client.chat.completions.create(model=model, messages=example["messages"])
    return "a string is no reward"

def silent(client, model, example):
    return 1.0

def add(a: int, b: int) -> int:
    '''Add two numbers.

    Args:
        a: the first
        b: the second
    '''
    return a + b

def rewriter(client, model, example):
    # sends its first answer back changed (a program that edits its history): the second turn cannot extend
    # the first, and starts a branch of its own
    messages = list(example["messages"])
    first = client.chat.completions.create(model=model, messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": "(edited) " + first}, {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model=model, messages=messages).choices[0].message.content
    return len(first + second) / 10
"""

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road"]


def code_file(tmp: Path) -> str:
    path = tmp / "agents_env.py"
    path.write_text(CODE)
    return str(path)


def chat_file(tmp: Path, n: int = 4) -> str:
    rows = []
    for i in range(n):
        text = f"say {' '.join(WORDS[i : i + 1 + i % 3])} and"
        rows.append({"messages": [{"role": "user", "content": text}], "word": WORDS[(i + 3) % len(WORDS)]})
    path = tmp / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tenant(name: str, data: str, rl: RL, **kw) -> Tenant:
    settings = dict(
        rank=4,
        alpha=8,
        target_modules=["q_proj", "v_proj"],
        lr=2e-2,
        batch_size=2,
        max_steps=3,
        max_grad_norm=None,
        eps=1e-4,
        seed=3,
    )
    return Tenant(name=name, data=data, rl=rl, **(settings | kw))


def job(base: str, tenants: list[Tenant], seq_len: int = 64) -> JobSpec:
    return JobSpec(base_model=base, tenants=tenants, seq_len=seq_len, max_rank=8, max_tenants=4)


class Recording(RLDriver):
    """The RL driver, keeping every generation its tenants train on."""

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


def peft_adapter(base: str, path: Path, t: Tenant) -> str:
    """A PEFT adapter with B ≠ 0 (so the first step already has a gradient through A and B)."""
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(
        r=t.rank, lora_alpha=t.alpha, target_modules=t.target_modules, init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(path)
    return str(path)


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(max((a[k][0] - b[k][0]).abs().max().item(), (a[k][1] - b[k][1]).abs().max().item()) for k in a)


SETTINGS = [
    dict(loss_type="dapo"),
    dict(loss_type="grpo", beta=0.05, num_iterations=2),  # the KL to the base, two updates per generation
    dict(loss_type="dr_grpo", mask_truncated_completions=True),
]


@pytest.mark.parametrize("more", SETTINGS, ids=[s["loss_type"] for s in SETTINGS])
def test_a_one_turn_env_trains_as_the_single_turn_tenant_on_the_same_reward_and_seed(
    more, llama_path, tmp_path
):
    """Whatever ``loss_type``, KL term and number of updates: with ``num_iterations = 2`` the single-turn tenant's
    second ratio is against its trainer's first log-probs, the agent's against the sampler's, which equal them
    up to batch-shape rounding (~1e-7)."""
    code, data = code_file(tmp_path), chat_file(tmp_path)
    settings = dict(group_size=4, max_new_tokens=8, temperature=0.9, **more)
    plain = tenant("plain", data, RL(reward=f"{code}:short", **settings))
    agent = tenant("agent", data, RL(env=f"{code}:one_turn", **settings))
    trainer = Trainer(job(llama_path, [plain, agent]), drivers=(Recording, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    for name in ("plain", "agent"):
        assert trainer.tenants[name].state is TenantState.FINISHED, trainer.tenants[name].reason
    (driver, _) = trainer.drivers
    for (gp, _), (ga, _) in zip(driver.generations["plain"], driver.generations["agent"], strict=True):
        assert gp.tokens == ga.tokens  # the same draws: turn 0 of member j draws as completion j
        assert torch.allclose(gp.rewards, ga.rewards, atol=1e-6)
        assert [r.input_ids for r in gp.rows] == [r.input_ids for r in ga.rows]
        assert [r.labels for r in gp.rows] == [r.labels for r in ga.rows]
        assert ga.trajectories is not None and all(len(t.segments) == 2 for t in ga.trajectories)
    assert trainer.losses("agent") == pytest.approx(trainer.losses("plain"), abs=TOL)
    diff = max_diff(trainer.model.tenant_tensors("agent"), trainer.model.tenant_tensors("plain"))
    assert diff <= TOL, f"the one-turn env's adapter differs from the single-turn tenant's by {diff}"


def trajectory_logps(model, trajectories, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each trajectory's model tokens' ``log_softmax(z / T)`` by a plain padded forward ``[N, L]``, and the mask."""
    T = max(len(t.tokens) for t in trajectories)
    ids = torch.zeros(len(trajectories), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, t in enumerate(trajectories):
        ids[i, : len(t.tokens)] = torch.tensor(t.tokens)
        attn[i, : len(t.tokens)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logp = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
    positions = [[q - 1 for q, m in enumerate(t.model_mask) if m and q > 0] for t in trajectories]
    L = max(len(p) for p in positions)
    out, mask = torch.zeros(len(trajectories), L), torch.zeros(len(trajectories), L)
    for i, p in enumerate(positions):
        out[i, : len(p)] = logp[i, p]
        mask[i, : len(p)] = 1
    return out, mask


def test_a_multi_turn_env_trains_its_trajectories_token_exactly_as_peft_by_hand(llama_path, tmp_path):
    code, data = code_file(tmp_path), chat_file(tmp_path)
    rl = RL(env=f"{code}:guess", group_size=3, max_new_tokens=6, temperature=1.0, epsilon=0.2)
    t = tenant("guesser", data, rl, max_steps=2)
    t = replace(t, init_adapter=peft_adapter(llama_path, tmp_path / "init", t))
    trainer = Trainer(job(llama_path, [t], seq_len=96), drivers=(Recording, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.tenants["guesser"].state is TenantState.FINISHED, trainer.tenants["guesser"].reason
    (driver, _) = trainer.drivers
    generations = driver.generations["guesser"]
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)

    for g, feed in generations:
        for i, tr in enumerate(g.trajectories):
            sources = [s.source for s in tr.segments]
            assert sources[0] == ENV and sources.count(MODEL) == 3, sources  # three answers, feedback between
            prompt = feed.prompts[g.prompts[i // g.group_size]]
            assert list(tr.segments[0].tokens) == prompt.ids  # the first turn: the template's rendering
            # the feedback between answers is the template's own rendering of the user's message
            between = tok.decode(list(tr.segments[2].tokens))
            assert "lower, try again" in between and "<|user|>" in between
            messages = g.episodes[i]["messages"]
            answers = [m["content"] for m in messages if m["role"] == "assistant"]
            model_texts = [
                tok.decode(list(s.tokens), skip_special_tokens=True) for s in tr.segments if s.source == MODEL
            ]
            assert answers == model_texts
        # the env's reward: hit + 0.5 · length, with its parts logged
        assert torch.isfinite(g.rewards).all()
        assert "rewards/hit/mean" in g.logged and "rewards/length/mean" in g.logged

    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), t.init_adapter, is_trainable=True
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=0.0, foreach=False)
    losses = []
    for g, _ in generations:
        G = rl.group_size
        R = g.rewards.view(-1, G)
        A = ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-4)).view(-1)
        logps, mask = trajectory_logps(model, g.trajectories, rl.temperature)
        old = torch.zeros_like(logps)  # the sampler's log-probs of the model's tokens
        for i, tr in enumerate(g.trajectories):
            n = int(mask[i].sum())
            old[i, :n] = torch.tensor(tr.old_logps[len(tr.old_logps) - n :])
        assert ((logps - old).abs() * mask).max() < 1e-4  # the sampler scored what the trainer scores
        ratio = torch.exp(logps - old)
        clipped = ratio.clamp(1 - rl.epsilon, 1 + rl.epsilon)
        per_token = -torch.min(ratio * A[:, None], clipped * A[:, None])
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert trainer.losses("guesser") == pytest.approx(losses, abs=TOL)
    diff = max_diff(trainer.model.tenant_tensors("guesser"), peft_lora_tensors(model))
    assert diff <= TOL, (
        f"the agent's adapter differs from PEFT + GRPO by hand over its trajectories by {diff}"
    )
    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == "guesser"]
    assert [r["extra"]["agent/turns"] for r in rows] == [3.0, 3.0]


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ("boom", "the env fell over"),
        ("garbage", "str"),
        ("silent", "never had an answer from the model"),
    ],
)
def test_a_failing_env_quarantines_only_its_tenant_with_the_reason(env, said, llama_path, tmp_path):
    code, data = code_file(tmp_path), chat_file(tmp_path)
    settings = dict(group_size=2, max_new_tokens=4)
    good = tenant("good", data, RL(env=f"{code}:async_guess", **settings), max_steps=2)
    bad = tenant("bad", data, RL(env=f"{code}:{env}", **settings), max_steps=2)
    trainer = Trainer(job(llama_path, [good, bad]), drivers=(RLDriver, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.tenants["good"].state is TenantState.FINISHED, trainer.tenants["good"].reason
    assert trainer.tenants["bad"].state is TenantState.FAILED
    assert said in trainer.tenants["bad"].reason, trainer.tenants["bad"].reason


def test_stopped_mid_generation_and_resumed_equals_straight_through(llama_path, tmp_path):
    """A checkpoint inside an agent tenant's window keeps its episodes (segments, the sampler's log-probs, the
    conversations); the resumed job draws the next generation's episodes with the same seeds and ends as the
    uninterrupted one."""
    code, data = code_file(tmp_path), chat_file(tmp_path)
    rl = RL(env=f"{code}:guess", group_size=2, max_new_tokens=5, beta=0.1, num_iterations=2)
    tenants = [tenant("a", data, rl, max_steps=4)]
    straight = Trainer(job(llama_path, tenants, seq_len=96))
    try:
        straight.train()
    finally:
        straight.close()
    first = Trainer(job(llama_path, tenants, seq_len=96), run_dir=tmp_path / "run")
    assert first.step()
    g = first.tenants["a"].feed.current
    assert g is not None and g.iteration == 1 and g.trajectories is not None
    first.save_checkpoint()
    first.close()
    again = Trainer(job(llama_path, tenants, seq_len=96), run_dir=tmp_path / "run", resume=True)
    try:
        restored = again.tenants["a"].feed.current
        assert [t.segments for t in restored.trajectories] == [t.segments for t in g.trajectories]
        assert torch.equal(restored.old_logps, g.old_logps) and torch.equal(restored.ref_logps, g.ref_logps)
        assert [r.labels for r in restored.rows] == [r.labels for r in g.rows]
        again.train()
    finally:
        again.close()
    assert again.tenants["a"].step == 4
    assert again.losses("a")[-3:] == pytest.approx(straight.losses("a")[-3:], abs=1e-6)
    assert max_diff(again.model.tenant_tensors("a"), straight.model.tenant_tensors("a")) <= 1e-6


def test_a_program_that_rewrites_its_history_forks_and_is_warned_never_silently(llama_path, tmp_path):
    """The second turn's messages do not extend the first (the answer came back edited): its prompt is rendered
    whole and starts a new branch; the trajectory trains on that last branch (the first answer's tokens are then
    context: never a re-tokenization passed off as sampled ids), ``agent/forks`` counts it, a warning row says it."""
    code, data = code_file(tmp_path), chat_file(tmp_path)
    t = tenant("editor", data, RL(env=f"{code}:rewriter", group_size=2, max_new_tokens=5), max_steps=1)
    trainer = Trainer(
        job(llama_path, [t], seq_len=96), drivers=(Recording, FileData), run_dir=tmp_path / "run"
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.tenants["editor"].state is TenantState.FINISHED, trainer.tenants["editor"].reason
    (driver, _) = trainer.drivers
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    for g, _ in driver.generations["editor"]:
        for tr, messages in zip(g.trajectories, [e["messages"] for e in g.episodes], strict=True):
            assert [s.source for s in tr.segments] == [
                ENV,
                MODEL,
            ]  # (the last branch: one rendering, one answer)
            assert "(edited) " in tok.decode(list(tr.segments[0].tokens))
            assert messages[-1]["role"] == "assistant" and messages[-1]["content"] == tok.decode(
                list(tr.segments[1].tokens), skip_special_tokens=True
            )
    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN]
    assert rows[0]["extra"]["agent/forks"] == 1.0
    warnings = [r for r in trainer.history if r["kind"] == RowKind.EVENT and r.get("tenant") == "editor"]
    assert any("does not extend the one they were answered in" in r["message"] for r in warnings), warnings
    # the completion rows hold each episode whole (a typed record), and read back from metrics.jsonl
    reader = MetricsReader(tmp_path / "run" / "metrics.jsonl")
    sampled = [r for r in reader.poll() if isinstance(r, CompletionRow)]
    assert sampled and reader.skipped == 0
    for row in sampled:
        assert isinstance(row.episode, EpisodeRecord) and row.episode.turns == 2 and row.episode.forks == 1
        assert row.episode.stop == "returned" and [m["role"] for m in row.episode.messages] == [
            "user",
            "assistant",
            "user",
            "assistant",
        ]


DROPPING = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A template that drops earlier answers from the history (as templates that drop earlier reasoning do): not
append-only, and without tools."""


def test_a_template_that_is_not_append_only_or_ignores_tools_is_warned_before_the_first_episodes(
    llama_path, tmp_path
):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(llama_path, base)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    tok.chat_template = DROPPING
    tok.save_pretrained(base)
    code, data = code_file(tmp_path), chat_file(tmp_path)
    env = tenant("env", data, RL(env=f"{code}:one_turn", group_size=2, max_new_tokens=4), max_steps=1)
    tools = tenant(
        "tools",
        data,
        RL(tools=[f"{code}:add"], reward=f"{code}:short", group_size=2, max_new_tokens=4),
        max_steps=1,
    )
    trainer = Trainer(job(str(base), [env, tools]), drivers=(RLDriver, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    said = [(r["tenant"], r["message"]) for r in trainer.history if r["kind"] == RowKind.EVENT]
    for name in ("env", "tools"):
        assert trainer.tenants[name].state is TenantState.FINISHED, trainer.tenants[name].reason
        assert sum(n == name and "is not append-only" in m for n, m in said) == 1, said
    assert [n for n, m in said if "does not render tools=" in m] == ["tools"]
