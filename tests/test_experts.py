"""Packed-expert LoRA layer (groundwork for MoE tenants): PEFT target_parameters maths and layout."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from mlora_lab.lora.experts import MultiLoRAExperts, from_peft, to_peft
from mlora_lab.lora.layer import LoRARouting

E = 4


def tiny_moe(arch: str):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0)  # fmt: skip
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
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
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
            lora_A, lora_B = layer.lora(name)
            with torch.no_grad():
                lora_A[1, :, :4], lora_B[1, :, :, :4] = A, B
            layer.configure_slot(1, name, 4, 8 / 4)
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
            for p in block.experts.lora(name):
                assert p.grad is None or p.grad.abs().max() == 0
