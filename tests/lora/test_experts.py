"""Packed-expert LoRA layer (groundwork for MoE tenants): PEFT target_parameters maths and layout."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from mlora_lab.lora.experts import MultiLoRAExperts, from_peft, to_peft
from mlora_lab.lora.layer import LoRARouting

E = 4


def tiny_moe(arch: str):
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=E, moe_intermediate_size=32, decoder_sparse_step=1
        )
    else:
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=E)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_lora_equals_peft_target_parameters(arch, tmp_path):
    base = tiny_moe(arch)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[],
        init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    reference = peft.get_peft_model(copy.deepcopy(base), config)
    reference.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    ours, routing = copy.deepcopy(base), LoRARouting()
    blocks = [layer.mlp for layer in ours.model.layers]
    for i, block in enumerate(blocks):
        block.experts = layer = MultiLoRAExperts(block.experts, routing, ["gate_up_proj", "down_proj"], 2, 8)
        prefix = f"base_model.model.model.layers.{i}.mlp.experts."
        # PEFT nests one wrapper per targeted parameter, the first-defined innermost
        for name, key in (("gate_up_proj", prefix + "base_layer."), ("down_proj", prefix)):
            A, B = from_peft(saved[key + "lora_A.weight"], saved[key + "lora_B.weight"], E)
            assert A.shape == (E, 4, layer.shapes[name][2]) and B.shape == (E, layer.shapes[name][1], 4)
            back = to_peft(A, B)
            assert torch.equal(back[0], saved[key + "lora_A.weight"]) and torch.equal(
                back[1], saved[key + "lora_B.weight"]
            )
            layer.set_slot(1, name, A.clone().requires_grad_(), B.clone().requires_grad_(), 4, 8 / 4)
    ids = torch.randint(3, 500, (3, 7))
    routing.segments, routing.num_rows = [(1, 0, 2)], 3  # rows 0-1: the tenant, row 2: base only
    with torch.no_grad():
        mixed = ours(input_ids=ids).logits
        torch.testing.assert_close(mixed[:2], reference(input_ids=ids[:2]).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(mixed[2:], base(input_ids=ids[2:]).logits, atol=1e-5, rtol=0)
    # the base row's loss gives the tenant's expert slots exactly zero gradient
    ours(input_ids=ids).logits[2:].square().sum().backward()
    for block in blocks:
        for name in ("gate_up_proj", "down_proj"):
            for p in block.experts.slot_tensors(name, 1):
                assert p.grad is None or p.grad.abs().max() == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_tenants_train_like_peft_and_round_trip(arch, tiny_models, make_data, tmp_path):
    """Two tenants on attention + packed experts (ranks 4 and 8 in rank-16 slots), started from PEFT
    adapters with B != 0, trained 4 full-batch steps: losses and adapters equal plain PEFT
    target_parameters training; the saved adapters load in PEFT and give the same logits.

    Adam's eps is 1e-6 on both sides, not the default 1e-8: an entry whose gradient is near eps gets the
    update ``lr · g / (|g| + eps)``, whose slope there is ``lr / (4 eps)`` (7.5e4 at lr 3e-3, eps 1e-8), so
    float32's rounding of a sum that cancels to ~1e-8 moves the adapter by more than the tolerance. Seen on
    qwen3_moe: one expert B entry of 2,048 had step-1 gradient -1.67e-8 and ended 1.7e-5 from PEFT's, the
    next-worst 2.2e-7; which entry lands there depends on the CPU's kernels. eps 1e-6 bounds the slope at
    750 and tests the same arithmetic."""
    from mlora_lab.data import load_examples
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.lora import read_adapter
    from mlora_lab.reference import train_peft
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant
    from mlora_lab.tiny import EXPERT_TARGETS
    from mlora_lab.validate import problems as spec_problems

    base = tiny_models(arch)
    tenants = []
    for name, rank, data in (("r4", 4, make_data("reverse", 6)), ("r8", 8, make_data("upper", 5))):
        torch.manual_seed(rank)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "v_proj"],
            target_parameters=EXPERT_TARGETS,
            init_lora_weights=False,
        )
        peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(
            tmp_path / name
        )
        n_rows = len(Path(data).read_text().splitlines())
        tenants.append(
            Tenant(
                name=name,
                data=data,
                init_adapter=str(tmp_path / name),
                rank=rank,
                alpha=2 * rank,
                target_modules=["q_proj", "v_proj"],
                target_parameters=EXPERT_TARGETS,
                lr=3e-3,
                batch_size=n_rows,
                max_steps=4,
                shuffle=False,
                max_grad_norm=None,
                eps=1e-6,
            )
        )
    spec = JobSpec(base_model=base, tenants=tenants, seq_len=48, max_rank=16, max_tenants=2)
    assert spec_problems(spec) == []
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    tok = transformers.AutoTokenizer.from_pretrained(base)
    ids = torch.randint(3, 300, (2, 7))
    trainer.model.eval()
    for t in tenants:
        examples = load_examples(t.data, tok, spec.seq_len)
        ref = train_peft(
            base, [examples] * 4, adapter_dir=t.init_adapter, lr=t.lr, eps=t.eps, pad_id=tok.pad_token_id
        )
        assert trainer.losses(t.name) == pytest.approx(ref.losses, abs=1e-5)
        config, saved = read_adapter(tmp_path / "run" / "adapters" / t.name)
        assert sorted(config.target_parameters) == sorted(EXPERT_TARGETS)
        assert set(saved) == set(ref.tensors) and any("base_layer" in k for k in saved)
        for key, (A, B) in saved.items():
            torch.testing.assert_close(A, ref.tensors[key][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(B, ref.tensors[key][1], atol=1e-5, rtol=0)
        loaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base),
            str(tmp_path / "run" / "adapters" / t.name),
        )
        with torch.no_grad():
            ours = trainer.model(ids, tenants=[t.name, t.name]).logits
            torch.testing.assert_close(ours, loaded(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_only_packed_experts_of_the_known_layout_are_wrapped():
    """A module with 2-D, transposed or biased "experts" is refused with the reason, never wrapped
    with maths it does not have."""
    from torch import nn

    from mlora_lab.lora.experts import packed_experts_problem

    class Experts(nn.Module):
        def __init__(self, gate_up, down, **flags):
            super().__init__()
            self.gate_up_proj, self.down_proj = (
                nn.Parameter(torch.zeros(gate_up)),
                nn.Parameter(torch.zeros(down)),
            )
            self.act_fn = nn.SiLU()
            self.__dict__.update(flags)

    assert packed_experts_problem(Experts((4, 32, 16), (4, 16, 16))) is None
    assert "not 3-D" in packed_experts_problem(Experts((32, 16), (16, 16)))
    assert "are not [E, 2I, H], [E, H, I]" in packed_experts_problem(Experts((4, 16, 32), (4, 16, 16)))
    assert "is_transposed=True" in packed_experts_problem(
        Experts((4, 32, 16), (4, 16, 16), is_transposed=True)
    )
    assert "has_bias=True" in packed_experts_problem(Experts((4, 32, 16), (4, 16, 16), has_bias=True))
    with pytest.raises(ValueError, match="is_transposed=True"):
        MultiLoRAExperts(
            Experts((4, 32, 16), (4, 16, 16), is_transposed=True), LoRARouting(), ["down_proj"], 2, 4
        )


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_batch_with_no_tenant_on_the_experts_takes_the_models_own_experts_forward(arch, monkeypatch):
    """Experts slotted for some tenants (a served job slots them all): a batch none of whose rows has a tenant
    on them runs the model's own experts forward, not the grouped LoRA path computing the base alone, and
    gives what that path gives the same rows beside a tenant that does adapt the experts."""
    from mlora_lab.lora import MultiLoRAModel

    model = MultiLoRAModel(
        tiny_moe(arch),
        max_tenants=2,
        max_rank=8,
        slot_modules=["q_proj", "v_proj"],
        slot_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model.add_tenant("attention", rank=4, target_modules=["q_proj", "v_proj"], seed=1)
    model.add_tenant("experts", rank=4, target_modules=["q_proj"], target_parameters=["gate_up_proj"], seed=2)
    tensors = model.tenant_tensors("experts")
    model.set_tenant_tensors("experts", {k: (A, torch.randn_like(B) * 0.1) for k, (A, B) in tensors.items()})
    grouped = []
    mlp = MultiLoRAExperts._mlp
    monkeypatch.setattr(MultiLoRAExperts, "_mlp", lambda self, *a: grouped.append(1) or mlp(self, *a))
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone = model(ids, tenants=["attention", "attention"]).logits
        assert not grouped
        mixed = model(ids, tenants=["attention", "experts"]).logits
        assert grouped
    torch.testing.assert_close(alone[0], mixed[0], atol=1e-5, rtol=0)
    assert (alone[1] - mixed[1]).abs().max() > 1e-3  # (the other row's experts are adapted)
