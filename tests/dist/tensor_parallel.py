"""Run under torchrun (2 or 4 processes): tensor parallelism against one unsplit model on every rank.

``python -m torch.distributed.run --nproc-per-node N tensor_parallel.py FSDP ARCH...``: every process
builds the same tiny model twice, a reference and one laid out with ``tp = N / FSDP`` (FSDP2 over the
other dimension, 2-D). Per architecture, checked:

- rank-consistent init: tenants added from seeds (PEFT's default init) and one reset slot re-added
  give the same full adapter as on the reference, and so does a PEFT adapter loaded into a freed slot;
- logits of this process's rows equal the reference's (≤ 1e-5) for mixed-tenant rows with ranks 2, 8
  and 5 (B != 0), and the gathered gradients of every tenant equal the reference's (≤ 1e-5);
- one collective per split layer: a forward issues exactly one all-reduce per rowwise layer and per
  split embedding, one all-gather per gathered output, and nothing for colwise layers; the backward
  adds at most one all-reduce per colwise input (base and LoRA together) and one per replicated LoRA
  factor.

Exits non-zero on the first failed check; tests/parallel/test_distributed.py runs it.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.distributed as dist
import transformers
from checks import assert_reload_into_freed_slot, assert_same_gradients

import mlora_lab.parallel.tensor as tensor_parallel
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.parallel import exit_process, init_distributed, ParallelDims, parallelize, shutdown_distributed
from mlora_lab.tiny import TYPICAL_TARGETS, tiny_config

ROWS = ["a", "a", "b", None, "c", "c", "c", "a"]


def build(arch: str) -> MultiLoRAModel:
    """``arch`` from :data:`~mlora_lab.tiny.ARCHITECTURES`; ``+tied`` ties lm_head to the embedding."""
    arch, _, tied = arch.partition("+")
    config = tiny_config(arch, 128, hidden=32, layers=2, heads=4, kv_heads=2)
    config.tie_word_embeddings = bool(tied)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    assert (base.lm_head.weight is base.get_input_embeddings().weight) == bool(tied)
    with torch.no_grad():  # no exact zeros or ones (biases, norms): every parameter matters
        for p in base.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    return MultiLoRAModel(base, max_tenants=4, max_rank=8, slot_modules="all-linear")


def add_tenants(mm: MultiLoRAModel, targets: list[str]) -> None:
    for name, rank, mods in (("a", 2, targets), ("b", 8, targets[:2]), ("c", 5, targets[-2:])):
        mm.add_tenant(name, rank=rank, alpha=2 * rank, target_modules=mods, seed=rank)
    mm.remove_tenant("b")  # reset a slot, then fill it again
    mm.add_tenant("b", rank=8, alpha=16, target_modules=targets[:2], seed=8)
    for name in ("a", "b", "c"):  # B != 0, the same values on every rank and layout
        g = torch.Generator().manual_seed(len(name))
        mm.set_tenant_tensors(name, {k: (A, torch.randn(B.shape, generator=g) * 0.1)
                                     for k, (A, B) in mm.tenant_tensors(name).items()})


def count_collectives(fn) -> Counter:
    counts: Counter = Counter()
    originals = {n: getattr(tensor_parallel.dist, n) for n in ("all_reduce", "all_gather")}

    def wrap(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for n in originals:
        setattr(tensor_parallel.dist, n, wrap(n))
    try:
        fn()
    finally:
        for n, f in originals.items():
            setattr(tensor_parallel.dist, n, f)
    return counts


def check(arch: str, fsdp: int, rank: int, world: int) -> None:
    tp = world // fsdp
    targets = TYPICAL_TARGETS[arch.partition("+")[0]]
    ids = torch.randint(3, 120, (len(ROWS), 10), generator=torch.Generator().manual_seed(1))
    reference, split = build(arch), build(arch)
    dims = ParallelDims(world, fsdp=fsdp, tp=tp)
    mesh = dims.build_mesh("cpu")
    parallelize(split, dims, mesh, "cpu")
    add_tenants(reference, targets)
    add_tenants(split, targets)
    for name in ("a", "b", "c"):  # rank-consistent init: the logical adapters are the reference's
        for k, (A, B) in reference.tenant_tensors(name).items():
            A2, B2 = split.tenant_tensors(name)[k]
            assert A2.shape == A.shape and torch.equal(A2, A) and torch.equal(B2, B), f"{name}/{k}"
    reference.train()
    split.train()
    full = reference(ids, tenants=ROWS).logits
    full.square().mean().backward()
    dp_rank, dp = rank // tp, world // tp  # TP ranks share rows
    mine = list(range(dp_rank, len(ROWS), dp))
    out = {}
    forward = count_collectives(lambda: out.update(logits=split(ids[mine], tenants=[ROWS[i] for i in mine]).logits))
    local = out["logits"]
    torch.testing.assert_close(local, full[mine], atol=1e-5, rtol=0)
    plan = tensor_parallel.tp_plan(split.model)
    styles = Counter(plan.values())
    expected = styles["rowwise"] + styles["rowwise_split_input"] + styles["embedding_rowwise"]
    assert forward["all_reduce"] == expected, (forward, styles)
    assert forward["all_gather"] == styles["colwise_gather_output"], (forward, styles)
    backward = count_collectives(lambda: (local.square().sum() / full.numel()).backward())
    colwise = styles["colwise"] + styles["colwise_gather_output"]
    slotted = sum(1 for n in plan if n in split.layers)  # one replicated LoRA factor each
    # (a colwise layer whose input needs no gradient, e.g. the first block's q/k/v, reduces none)
    assert 0 < backward["all_reduce"] <= colwise + slotted, (backward, styles, slotted)
    assert_same_gradients(split, reference, ("a", "b", "c"))
    assert_reload_into_freed_slot(split, reference, "b")
    print(f"rank {rank}: {arch} tp={tp} fsdp={fsdp} ok", flush=True)


def main() -> None:
    info = init_distributed()
    fsdp = int(sys.argv[1])
    for arch in sys.argv[2:]:
        check(arch, fsdp, info.rank, info.world_size)
    print("tensor parallel ok", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)  # (see exit_process: a mesh's groups abort the interpreter's finalization)
