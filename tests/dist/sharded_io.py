"""Run under torchrun (2 processes): checks of tenant-tensor I/O that need a real process group.

Exits non-zero on the first failed check; tests/parallel/test_distributed.py runs it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import transformers

from mlora_lab.lora import MultiLoRAModel
from mlora_lab.optim import TenantOptimizer
from mlora_lab.parallel import exit_process, init_distributed, ParallelDims, parallelize, shutdown_distributed


def main(model_dir: str) -> None:
    info = init_distributed()
    check(model_dir, info.rank, info.world_size)
    shutdown_distributed()


def check(model_dir: str, rank: int, world_size: int) -> None:
    """Every check above, in a process group that is already up (``world_size`` processes, FSDP2 over all)."""
    dims = ParallelDims(world_size, fsdp=world_size)
    mesh = dims.build_mesh("cpu")
    plain = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(model_dir), max_tenants=3, max_rank=8)
    split = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(model_dir), max_tenants=3, max_rank=8)
    parallelize(split, dims, mesh, "cpu")
    layer = next(iter(split.layers.values()))
    assert not layer.lora_A, "a free slot holds nothing"

    # the same seed gives the same logical adapter whatever the layout (rank-consistent init)
    for mm in (plain, split):
        mm.add_tenant("a", rank=4, target_modules=["q_proj", "down_proj"], seed=7)
        mm.add_tenant("b", rank=8, target_modules=["v_proj"], seed=8)
    for name in ("a", "b"):
        full_plain, full_split = plain.tenant_tensors(name), split.tenant_tensors(name)
        for m, (A, B) in full_plain.items():
            assert full_split[m][0].shape == A.shape, "read tensors are whole"
            torch.testing.assert_close(full_split[m][0], A, atol=0, rtol=0)
            torch.testing.assert_close(full_split[m][1], B, atol=0, rtol=0)
    assert tuple(layer.lora_A[split.tenants["a"].slot].shape) == (4, layer.in_features), "its own rank"

    # a value of the wrong shape is refused
    A = layer.lora_A[split.tenants["a"].slot]
    try:
        split.write(A, (), torch.zeros(3, layer.in_features))
    except ValueError:
        pass
    else:
        raise AssertionError("a value of the wrong shape was accepted")

    # gradients: each rank's own, summed by reduce_gradients (only the tenants named); grad_sum is
    # the same sum without touching the gradient; a rank that made none counts as zeros
    pairs = list(split.tenant_slices("a"))
    for k, (p, _) in enumerate(pairs):
        p.grad = None if (rank == 1 and k == 0) else torch.full_like(p, float(rank + 1))
    b_grad = torch.ones_like(split.layers[split.tenants["b"].modules[0]].lora_A[split.tenants["b"].slot])
    split.layers[split.tenants["b"].modules[0]].lora_A[split.tenants["b"].slot].grad = b_grad
    expected0 = torch.full_like(pairs[0][0], 1.0)  # rank 1 made no gradient for it
    torch.testing.assert_close(split.io.grad_sum(pairs[0][0]), expected0)
    split.reduce_gradients(["a"])
    torch.testing.assert_close(pairs[0][0].grad, expected0)
    for p, _ in pairs[1:]:
        torch.testing.assert_close(p.grad, torch.full_like(p, 3.0))
    assert b_grad.eq(1).all(), "a tenant not named is not reduced"
    assert split.io.first_copy(pairs[0][0]) == (dist.get_rank() == 0)

    # optimiser state round-trips through its full (gathered) form
    opt = TenantOptimizer(split.tenant_slices("a"), lr=0.1, local=split.io.local)
    opt.step()
    full = opt.state_dict(gather=split.io.gather)
    exp_avg = full["optimizer"]["state"][0]["exp_avg"]
    assert tuple(exp_avg.shape) == (4, layer.in_features), exp_avg.shape
    again = TenantOptimizer(split.tenant_slices("a"), lr=0.1, local=split.io.local)
    again.load_state_dict(full, scatter=split.io.scatter)
    for k in (0, 1):
        torch.testing.assert_close(
            again.optimizer.state[again.params[k]]["exp_avg"], opt.optimizer.state[opt.params[k]]["exp_avg"]
        )
    print(f"rank {rank}: sharded I/O ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # (see exit_process: a mesh's groups abort the interpreter's finalization)
