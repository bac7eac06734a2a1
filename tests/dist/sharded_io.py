"""Run under torchrun (2 processes): checks of sharded slot I/O that need a real process group.

Exits non-zero on the first failed check; tests/test_distributed.py runs it.
"""

from __future__ import annotations

import sys

import torch
import transformers
from torch.distributed.tensor import DTensor

from mlora_lab.lora import MultiLoRAModel
from mlora_lab.optim import TenantOptimizer
from mlora_lab.parallel import ParallelDims, init_distributed, shutdown_distributed
from mlora_lab.parallel.fsdp import apply_fsdp


def main(model_dir: str) -> None:
    info = init_distributed()
    mesh = ParallelDims(info.world_size, fsdp=info.world_size).build_mesh("cpu")
    plain = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(model_dir), max_tenants=3, max_rank=8)
    sharded = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(model_dir), max_tenants=3, max_rank=8)
    apply_fsdp(sharded, mesh["dp_shard"])
    layer = next(iter(sharded.layers.values()))
    assert isinstance(layer.lora_A, DTensor), "slots are sharded"
    assert layer.lora_A.to_local().shape[2] == layer.in_features // info.world_size, "A is split on its input dim"

    # the same seed gives the same logical adapter whatever the sharding (rank-consistent init)
    for mm in (plain, sharded):
        mm.add_tenant("a", rank=4, target_modules=["q_proj", "down_proj"], seed=7)
        mm.add_tenant("b", rank=8, target_modules=["v_proj"], seed=8)
    for name in ("a", "b"):
        full_plain, full_sharded = plain.tenant_tensors(name), sharded.tenant_tensors(name)
        for m, (A, B) in full_plain.items():
            assert full_sharded[m][0].shape == A.shape, "gathered tensors are whole, not local shards"
            torch.testing.assert_close(full_sharded[m][0], A, atol=0, rtol=0)
            torch.testing.assert_close(full_sharded[m][1], B, atol=0, rtol=0)

    # writing a local shard as if it were the whole value is refused (no double sharding)
    A_local = sharded.io.local(layer.lora_A.data)[0, :4]
    try:
        sharded.write(layer.lora_A, (0, slice(0, 4)), A_local.clone())
    except ValueError:
        pass
    else:
        raise AssertionError("a local shard was accepted as a full value")

    # a write of a full value lands as this rank's chunk and reads back whole
    value = torch.arange(4 * layer.in_features, dtype=torch.float32).reshape(4, layer.in_features)
    sharded.write(layer.lora_A, (1, slice(0, 4)), value)
    torch.testing.assert_close(sharded.read(layer.lora_A, (1, slice(0, 4))), value, atol=0, rtol=0)

    # optimiser state round-trips through its full (gathered) form
    opt = TenantOptimizer(sharded.tenant_slices("a"), lr=0.1, local=sharded.io.local)
    for p, i in opt.slices:
        p.grad = torch.zeros_like(p)
        sharded.io.local(p.grad)[i].normal_(generator=torch.Generator().manual_seed(info.rank))
    opt.step()
    full = opt.state_dict(gather=sharded.io.gather)
    exp_avg = full["optimizer"]["state"][0]["exp_avg"]
    assert tuple(exp_avg.shape) == (4, layer.in_features), exp_avg.shape
    again = TenantOptimizer(sharded.tenant_slices("a"), lr=0.1, local=sharded.io.local)
    again.load_state_dict(full, scatter=sharded.io.scatter)
    for k in (0, 1):
        torch.testing.assert_close(
            again.optimizer.state[again.params[k]]["exp_avg"], opt.optimizer.state[opt.params[k]]["exp_avg"]
        )
    print(f"rank {info.rank}: sharded I/O ok", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
