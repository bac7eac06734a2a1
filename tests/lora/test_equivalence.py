"""Numerical fidelity over a table of tiny architectures.

- isolation: tenants trained together end exactly as when each is trained alone;
- PEFT equivalence: a tenant started from a PEFT adapter trains exactly like plain PEFT;
- round trip: the saved adapter, loaded by PEFT, gives the tenant's logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import peft
import pytest
import torch
import transformers

from mlora_lab.data import load_examples
from mlora_lab.job.trainer import Trainer
from mlora_lab.lora import read_adapter
from mlora_lab.reference import train_peft
from mlora_lab.spec.fields import MAX_COUNT
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import TYPICAL_TARGETS

ARCHS = ["llama", "qwen2", "phi3", "gpt_neox"]
TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(max((a[k][0] - b[k][0]).abs().max().item(), (a[k][1] - b[k][1]).abs().max().item()) for k in a)


def three_tenants(arch: str, make_data) -> list[Tenant]:
    targets = TYPICAL_TARGETS[arch]
    return [
        Tenant(
            name="A",
            data=make_data("reverse"),
            rank=4,
            alpha=8,
            target_modules=targets[:2],
            lr=5e-3,
            batch_size=2,
            max_steps=20,
            seed=1,
        ),
        Tenant(
            name="B",
            data=make_data("upper"),
            rank=16,
            alpha=16,
            use_rslora=True,
            target_modules=targets,
            lr=1e-3,
            batch_size=3,
            max_steps=20,
            schedule="cosine",
            warmup_steps=3,
            seed=2,
            weight_decay=0.01,
        ),
        Tenant(
            name="C",
            data=make_data("text"),
            rank=8,
            alpha=32,
            target_modules=targets[-2:],
            lr=2e-3,
            batch_size=1,
            grad_accum=2,
            max_steps=20,
            schedule="linear",
            max_grad_norm=0.05,
            seed=3,
        ),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_isolation_mixed_equals_alone(arch, tiny_models, make_data):
    base = tiny_models(arch)
    tenants = three_tenants(arch, make_data)
    slots = sorted({m for t in tenants for m in t.target_modules})
    spec = dict(base_model=base, seq_len=64, max_rank=32, max_tenants=4, slot_modules=slots)
    together = Trainer(JobSpec(tenants=tenants, **spec))
    together.train()
    for t in tenants:
        alone = Trainer(JobSpec(tenants=[t], **spec))
        alone.train()
        assert together.tenants[t.name].step == alone.tenants[t.name].step == 20
        diff = max_diff(together.model.tenant_tensors(t.name), alone.model.tenant_tensors(t.name))
        assert diff <= TOL, f"{arch}/{t.name}: mixed vs alone adapters differ by {diff}"
        losses_mixed, losses_alone = together.losses(t.name), alone.losses(t.name)
        assert losses_mixed == pytest.approx(losses_alone, abs=TOL)
        # the adapter really moved: the comparison is not between two untouched inits
        start = Trainer(JobSpec(tenants=[t], **spec)).model.tenant_tensors(t.name)
        assert max_diff(start, alone.model.tenant_tensors(t.name)) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_in_passes_equals_one_pass(arch, tiny_models, make_data):
    """``max_pass_tokens`` runs a step as several forward + backward passes of whole tenants (1: one pass
    per tenant; 100: one or two tenants a pass, as their rows' lengths fall: on llama, of the 12 steps 1 ran
    in 3 passes, 5 in 2 and 6 in one): the same losses and adapters as the one-pass step, tenant by tenant."""
    base = tiny_models(arch)
    tenants = [dataclasses.replace(t, max_steps=6) for t in three_tenants(arch, make_data)]
    slots = sorted({m for t in tenants for m in t.target_modules})
    spec = dict(base_model=base, tenants=tenants, seq_len=64, max_rank=32, max_tenants=4, slot_modules=slots)
    one = Trainer(JobSpec(max_pass_tokens=MAX_COUNT, **spec))  # every step in one pass
    one.train()
    for max_pass_tokens in (1, 100):
        passes = Trainer(JobSpec(max_pass_tokens=max_pass_tokens, **spec))
        passes.train()
        assert passes.global_step == one.global_step
        for t in tenants:
            assert passes.losses(t.name) == pytest.approx(one.losses(t.name), abs=TOL)
            diff = max_diff(passes.model.tenant_tensors(t.name), one.model.tenant_tensors(t.name))
            assert diff <= TOL, f"{arch}/{t.name}, max_pass_tokens={max_pass_tokens}: {diff}"


def make_peft_adapter(base: str, path: str, rank: int, targets: list[str], alpha: float, seed: int) -> str:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_peft_equivalence(arch, tiny_models, make_data, tmp_path):
    """Ranks 4 and 16 in one job with max_rank 32, started from PEFT adapters with B != 0, trained k
    full-batch AdamW steps without clipping: per-step losses and final adapters equal plain PEFT.

    AdamW's ε is 1e-6 on both sides, not the default 1e-8. Adam's first step moves an entry by
    ``lr · g / (|g| + ε)``; entries whose true gradient is zero (shifting every key of a query by the
    same vector leaves its softmax unchanged, so parts of a LoRA on k_proj get no gradient) come out as
    float noise of ~1e-9 on either side, and with ε = 1e-8 Adam turns that noise into steps of a good
    fraction of ``lr``. Measured on qwen2 (transformers 5.24, rank 16, k_proj of layer 1): after 5
    steps the adapters differ by 2.0e-5 with ε = 1e-8, 8.9e-6 with 1e-7, 1.1e-6 with 1e-6, while the
    losses agree to 1.4e-6 in every case: a comparison of noise, not of the implementations."""
    base = tiny_models(arch)
    targets = TYPICAL_TARGETS[arch]
    k, eps = 5, 1e-6
    setups = [
        ("r4", 4, targets[:2], 8.0, make_data("reverse", 7), 3e-3),
        ("r16", 16, targets, 24.0, make_data("chat", 5), 1e-3),
    ]
    tenants = []
    for name, rank, tmods, alpha, data, lr in setups:
        adapter = make_peft_adapter(base, str(tmp_path / f"init_{name}"), rank, tmods, alpha, seed=rank)
        n_rows = len(Path(data).read_text().splitlines())
        tenants.append(
            Tenant(
                name=name,
                data=data,
                init_adapter=adapter,
                rank=rank,
                alpha=alpha,
                target_modules=tmods,
                lr=lr,
                batch_size=n_rows,
                max_steps=k,
                shuffle=False,
                max_grad_norm=None,
                weight_decay=0.01,
                eps=eps,
            )
        )
    spec = JobSpec(base_model=base, tenants=tenants, seq_len=64, max_rank=32, max_tenants=4)
    trainer = Trainer(spec)
    trainer.train()

    tok = transformers.AutoTokenizer.from_pretrained(base)
    for t in tenants:
        examples = load_examples(t.data, tok, spec.seq_len)
        assert len({len(e.input_ids) for e in examples}) > 1, "rows of different lengths"
        ref = train_peft(
            base,
            [examples] * k,
            adapter_dir=t.init_adapter,
            lr=t.lr,
            eps=eps,
            weight_decay=0.01,
            pad_id=tok.pad_token_id,
        )
        assert trainer.losses(t.name) == pytest.approx(ref.losses, abs=TOL), arch
        diff = max_diff(trainer.model.tenant_tensors(t.name), ref.tensors)
        assert diff <= TOL, f"{arch}/{t.name}: adapter differs from plain PEFT by {diff}"
        assert trainer.tenants[t.name].optimizer.flat, "a dense tenant steps as one flat tensor"
        assert max_diff(read_adapter(t.init_adapter)[1], ref.tensors) > 1e-3, "training moved the adapter"


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_adapter_round_trip(arch, tiny_models, make_data, tmp_path):
    base = tiny_models(arch)
    targets = TYPICAL_TARGETS[arch]
    tenants = [
        Tenant(
            name="x",
            data=make_data("reverse"),
            rank=4,
            alpha=8,
            target_modules=targets[:2],
            lr=1e-2,
            max_steps=3,
            use_rslora=True,
        ),
        Tenant(
            name="y",
            data=make_data("upper"),
            rank=16,
            alpha=16,
            target_modules=["all-linear"],
            lr=1e-2,
            max_steps=3,
        ),
    ]
    spec = JobSpec(base_model=base, tenants=tenants, seq_len=64, max_rank=32, slot_modules=["all-linear"])
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    ids = torch.randint(3, 200, (2, 9))
    trainer.model.eval()
    for t in tenants:
        with torch.no_grad():
            ours = trainer.model(ids, tenants=[t.name, t.name]).logits
            plain = trainer.model(ids, tenants=[None, None]).logits
        loaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base),
            str(tmp_path / "run" / "adapters" / t.name),
        )
        loaded.eval()
        with torch.no_grad():
            theirs = loaded(input_ids=ids).logits
        assert (ours - theirs).abs().max().item() <= TOL
        assert (ours - plain).abs().max().item() > 1e-4, "the adapter must change the logits"


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_base_fp32_adapters_equal_peft(arch, tiny_models, make_data, tmp_path):
    """dtype=bfloat16: the base computes in bf16, the adapter (fp32, as PEFT keeps it over a bf16
    base) trains exactly as plain PEFT on the same bf16 base; the saved adapter gives PEFT's logits."""
    base = tiny_models(arch)
    targets = TYPICAL_TARGETS[arch]
    data = make_data("reverse", 7)
    adapter = make_peft_adapter(base, str(tmp_path / "init"), 4, targets, 8.0, seed=4)
    tenant = Tenant(
        name="a",
        data=data,
        init_adapter=adapter,
        rank=4,
        alpha=8,
        target_modules=targets,
        lr=3e-3,
        batch_size=7,
        max_steps=4,
        shuffle=False,
        max_grad_norm=None,
    )
    spec = JobSpec(base_model=base, tenants=[tenant], seq_len=64, max_rank=8, max_tenants=2, dtype="bfloat16")
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.model.parameters() if not p.requires_grad)
    assert all(p.dtype == torch.float32 for p, _ in trainer.model.tenant_slices("a"))
    state = trainer.tenants["a"].optimizer.optimizer.state.values()  # AdamW's moments: fp32 too
    assert state and all(s[k].dtype == torch.float32 for s in state for k in ("exp_avg", "exp_avg_sq"))
    tok = transformers.AutoTokenizer.from_pretrained(base)
    examples = load_examples(data, tok, spec.seq_len)
    ref = train_peft(
        base, [examples] * 4, adapter_dir=adapter, lr=3e-3, pad_id=tok.pad_token_id, dtype=torch.bfloat16
    )
    assert trainer.losses("a") == pytest.approx(ref.losses, abs=TOL)
    assert max_diff(trainer.model.tenant_tensors("a"), ref.tensors) <= TOL
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
        str(tmp_path / "run" / "adapters" / "a"),
    ).eval()
    ids = torch.randint(3, 200, (2, 9))
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(ids, tenants=["a", "a"]).logits
        theirs = loaded(input_ids=ids).logits
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert (ours.float() - theirs.float()).abs().max().item() == 0.0


def test_dtype_auto_is_bfloat16_on_a_gpu_that_has_it_and_float32_elsewhere(monkeypatch):
    """``JobSpec.dtype`` defaults to "auto": the base in bf16 where a GPU supports it, fp32 on the CPU
    and on GPUs without bf16; the named dtypes are taken as they are."""
    from mlora_lab.job.engine import base_dtype

    assert JobSpec(base_model="m", tenants=[]).dtype == "auto"
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert base_dtype("auto", cpu) == torch.float32
    assert base_dtype("bfloat16", cpu) == torch.bfloat16 and base_dtype("float16", gpu) == torch.float16
    for supported, expected in [(True, torch.bfloat16), (False, torch.float32)]:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, s=supported: s)
        assert base_dtype("auto", gpu) == expected
        assert base_dtype("float32", gpu) == torch.float32
