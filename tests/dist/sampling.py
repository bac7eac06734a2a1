"""Run under torchrun (2 processes): batched multi-tenant sampling on a split model against one process.

``python -m torch.distributed.run --nproc-per-node 2 sampling.py LAYOUT:ARCH...`` with ``LAYOUT`` one of
``fsdp`` (fsdp=2), ``tp`` (tp=2) or ``ep`` (fsdp=2, ep=2, a MoE arch). Every process builds the same
tiny model twice, a reference and one laid out as asked, with the same tenants (non-zero B; on a MoE
model one of them also adapts the packed experts). Then, per case:

- the reference samples every request in this one process (greedy and seeded, tenants mixed with the
  base, different lengths and ``max_new_tokens``, ``num_samples`` 1 and 2);
- the split model samples this process's share (data-parallel ranks split the requests; TP ranks pass
  the same ones), with ``any_running`` an all-reduce of "a row of mine still runs"; in a second round
  one process has no requests at all.

Checked: the same tokens as the reference and logprobs within 1e-5, and every process called
``any_running`` (ran a forward) the same number of times. A process that stopped alone would hang
the others' collectives, so a mismatch in the loop shows as a timeout.

Exits non-zero on the first failed check; tests/test_sampling.py runs it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import transformers

from mlora_lab.lora import MultiLoRAModel
from mlora_lab.parallel import exit_process, init_distributed, ParallelDims, parallelize, shutdown_distributed
from mlora_lab.sampling import SampleRequest, sample
from mlora_lab.tiny import EXPERT_TARGETS, MOE_ARCHITECTURES, TYPICAL_TARGETS, tiny_config

LAYOUTS = {"fsdp": dict(fsdp=2), "tp": dict(tp=2), "ep": dict(fsdp=2, ep=2)}


def build(arch: str, ep: bool) -> MultiLoRAModel:
    config = tiny_config(arch, 128, hidden=32, layers=2, heads=4, kv_heads=2)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # no exact zeros or ones (biases, norms): every parameter matters
        for p in base.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    moe = arch in MOE_ARCHITECTURES
    return MultiLoRAModel(base, max_tenants=3, max_rank=8, slot_modules="all-linear",
                          slot_parameters=EXPERT_TARGETS if moe else (), wrap_experts=ep)


def add_tenants(mm: MultiLoRAModel, arch: str) -> None:
    targets = TYPICAL_TARGETS[arch]
    experts = EXPERT_TARGETS if arch in MOE_ARCHITECTURES else ()
    mm.add_tenant("a", rank=2, alpha=4, target_modules=targets, seed=2)
    mm.add_tenant("b", rank=8, alpha=16, target_modules=targets[:2], target_parameters=experts, seed=8)
    for name in ("a", "b"):  # B != 0, the same values on every process and layout
        g = torch.Generator().manual_seed(len(name) + 10)
        mm.set_tenant_tensors(name, {k: (A, torch.randn(B.shape, generator=g) * 0.3)
                                     for k, (A, B) in mm.tenant_tensors(name).items()})


def requests() -> list[SampleRequest]:
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(3, 120, (n,), generator=g).tolist()  # noqa: E731
    return [
        SampleRequest(prompt(5), "a", max_new_tokens=9, temperature=0.0),
        SampleRequest(prompt(11), "b", num_samples=2, max_new_tokens=4, temperature=1.0, seed=1),
        SampleRequest(prompt(3), None, max_new_tokens=12, temperature=0.0, stop_token_ids=()),
        SampleRequest(prompt(8), "b", max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=20, seed=2),
        SampleRequest(prompt(6), "a", num_samples=2, max_new_tokens=2, temperature=1.3, seed=3),
    ]


def any_running(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check(layout: str, arch: str, rank: int, world: int) -> None:
    dims = ParallelDims(world, **LAYOUTS[layout])
    reference, split = build(arch, ep=False), build(arch, ep=dims.ep > 1)
    parallelize(split, dims, dims.build_mesh("cpu"), "cpu")
    add_tenants(reference, arch)
    add_tenants(split, arch)
    everything = requests()
    expected = sample(reference, everything)
    dp_rank = rank // dims.tp
    for case in ("shared", "one process has none"):
        if case == "shared":
            mine = list(range(dp_rank, len(everything), dims.dp))
        else:
            mine = list(range(len(everything))) if dp_rank == 0 else []
        calls = []

        def hook(flag: bool, calls=calls) -> bool:
            calls.append(flag)
            return any_running(flag)

        got = sample(split, [everything[i] for i in mine], any_running=hook)
        want = [c for c in expected if c.request in mine]
        assert len(got) == len(want), (layout, arch, case)
        worst = 0.0
        for c, w in zip(got, want):
            assert mine[c.request] == w.request and c.index == w.index
            assert c.tokens == w.tokens, (layout, arch, case, w.request, c.tokens, w.tokens)
            assert c.stop_reason == w.stop_reason
            gap = max(abs(a - b) for a, b in zip(c.logprobs, w.logprobs))
            assert gap <= 1e-5, (layout, arch, case, w.request, gap)
            worst = max(worst, gap)
        counts = [None] * world
        dist.all_gather_object(counts, len(calls))
        assert len(set(counts)) == 1, f"forwards per process differ: {counts}"
        # one forward per token of the longest completion anywhere (the prefill gives the first token)
        assert counts[0] == max(len(c.tokens) for c in expected), (counts, case)
        print(f"rank {rank}: {layout} {arch} {case}: {len(got)} completions, {counts[0]} forwards, "
              f"logprobs within {worst:.1e}", flush=True)
    print(f"rank {rank}: {layout} {arch} ok", flush=True)


def main() -> None:
    info = init_distributed()
    for item in sys.argv[1:]:
        layout, _, arch = item.partition(":")
        check(layout, arch, info.rank, info.world_size)
    print("sampling ok", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)  # (see exit_process: a mesh's groups abort the interpreter's finalization)
