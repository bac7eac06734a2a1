"""Run under torchrun (2 or 4 processes): expert parallelism against one unsplit model on every rank.

Every process builds the same tiny MoE model twice: a reference (all experts, the whole batch) and
one laid out with ``ep = 2`` (FSDP2 over the data-parallel ranks for the rest; with 4 processes two
EP groups hold the same experts). The same tenants (ranks 2, 8 and 5 in rank-8 slots, on attention
and the packed experts, with non-zero B) are added to both. Each process feeds its share of the
rows to the split model. Checked, for each case of routing:

- logits of this process's rows equal the reference's (≤ 1e-5);
- the gathered (all-expert) gradients of every tenant equal the reference's (≤ 1e-5), including
  when the router sends every token to the first rank's experts (the other rank receives nothing);
- slot reset and add under EP use local shapes: remove a tenant, load a PEFT adapter into the freed
  slot, and the gathered adapter equals the file's.

Exits non-zero on the first failed check; tests/parallel/test_distributed.py runs it.
"""

from __future__ import annotations

import copy
import sys

import torch
import transformers
from checks import assert_reload_into_freed_slot, assert_same_gradients

from mlora_lab.lora import MultiLoRAModel
from mlora_lab.parallel import exit_process, init_distributed, ParallelDims, parallelize, shutdown_distributed
from mlora_lab.parallel.expert import ExpertParallelLoRAExperts
from mlora_lab.tiny import EXPERT_TARGETS

TENANTS = [("a", 2, ["q_proj"], EXPERT_TARGETS), ("b", 8, ["v_proj"], EXPERT_TARGETS[:1]),
           ("c", 5, ["q_proj", "o_proj"], EXPERT_TARGETS[1:])]
ROWS = ["a", "a", "b", None, "c", "c", "c", "a"]  # mixed, one base-only row; 2 or 1 rows per process


def tiny_moe(arch: str) -> transformers.PreTrainedModel:
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=16)
    else:
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 16}, num_local_experts=4)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def wrap(base: torch.nn.Module) -> MultiLoRAModel:
    return MultiLoRAModel(base, max_tenants=4, max_rank=8, slot_modules=["q_proj", "v_proj", "o_proj"],
                          slot_parameters=EXPERT_TARGETS, wrap_experts=True)


def inits(mm: MultiLoRAModel) -> dict[str, dict]:
    """Non-zero A and B for every tenant, drawn on the reference and reused for the split model."""
    out = {}
    for name, rank, modules, params in TENANTS:
        mm.add_tenant(name, rank=rank, alpha=2 * rank, target_modules=modules, target_parameters=params, seed=rank)
        out[name] = {k: (A, torch.randn_like(B) * 0.1) for k, (A, B) in mm.tenant_tensors(name).items()}
        mm.set_tenant_tensors(name, out[name])
    return out


def only_first_experts(mm: MultiLoRAModel) -> None:
    """Route every token to experts 0 and 1 (the first EP rank's): the others receive nothing."""
    for module in mm.model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda m, args, out: (out[0], out[1], out[2] % 2))


def check(arch: str, skewed: bool, rank: int, world: int) -> None:
    ids = torch.randint(3, 120, (len(ROWS), 10), generator=torch.Generator().manual_seed(1))
    reference = wrap(tiny_moe(arch))
    split = wrap(tiny_moe(arch))
    dims = ParallelDims(world, fsdp=2, ep=2)
    parallelize(split, dims, dims.build_mesh("cpu"), "cpu")
    experts = next(iter(split.experts.values()))
    assert isinstance(experts, ExpertParallelLoRAExperts) and experts.local_experts == 2
    assert experts.base_layer.gate_up_proj.shape[0] == 2, "the base keeps only this rank's experts"
    if skewed:
        only_first_experts(reference)
        only_first_experts(split)
    for name, tensors in inits(reference).items():
        t = next(t for t in TENANTS if t[0] == name)
        split.add_tenant(name, rank=t[1], alpha=2 * t[1], target_modules=t[2], target_parameters=t[3], init=tensors)
    reference.train()
    split.train()
    full = reference(ids, tenants=ROWS).logits
    full.square().mean().backward()
    mine = list(range(rank, len(ROWS), world))
    local = split(ids[mine], tenants=[ROWS[i] for i in mine]).logits
    torch.testing.assert_close(local, full[mine], atol=1e-5, rtol=0)
    # this process's share of the same loss: the sum over processes is the reference loss
    (local.square().sum() / full.numel()).backward()
    assert_same_gradients(split, reference, [t[0] for t in TENANTS])
    # slot reset + add under EP: the freed slot takes a PEFT adapter with the experts' full layout
    assert_reload_into_freed_slot(split, reference, "b")
    print(f"rank {rank}: {arch} skewed={skewed} ok", flush=True)


def main() -> None:
    info = init_distributed()
    for arch in sys.argv[1:]:
        for skewed in (False, True):
            check(arch, skewed, info.rank, info.world_size)
    print("expert parallel ok", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)  # (see exit_process: a mesh's groups abort the interpreter's finalization)
