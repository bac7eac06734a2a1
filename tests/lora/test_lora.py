"""The multi-tenant LoRA layer and model wrapper: maths, isolation, slots, PEFT import/export errors."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers

from mlora_lab.lora import AdapterError, MultiLoRAModel, read_adapter
from mlora_lab.lora.layer import LoRARouting, MultiLoRALinear


@pytest.fixture(scope="module")
def base(llama_path):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_path)


def randomise(mm: MultiLoRAModel, name: str, seed: int = 0) -> None:
    """Give a tenant non-zero A and B so every path of its delta (and gradient) is exercised."""
    g = torch.Generator().manual_seed(seed)
    t = mm.tenants[name]
    with torch.no_grad():
        for m in t.modules:
            layer = mm.layers[m]
            layer.lora_A[t.slot].copy_(torch.randn(t.rank, layer.in_features, generator=g) * 0.1)
            layer.lora_B[t.slot].copy_(torch.randn(layer.out_features, t.rank, generator=g) * 0.1)


def set_slot(layer: MultiLoRALinear, slot: int, A: torch.Tensor, B: torch.Tensor, scaling: float) -> None:
    layer.set_slot(slot, A.clone().requires_grad_(), B.clone().requires_grad_(), A.shape[0], scaling, 0.0)


def test_layer_maths_rank_in_larger_slot():
    """A rank-3 tenant under max_rank 16 computes exactly base + s * x A^T B^T on its rows only, and
    holds tensors of its own rank, nothing for the free slots."""
    torch.manual_seed(0)
    routing = LoRARouting()
    layer = MultiLoRALinear(torch.nn.Linear(6, 5), routing, max_tenants=3, max_rank=16)
    A, B = torch.randn(3, 6), torch.randn(5, 3)
    set_slot(layer, 1, A, B, scaling=0.7)
    x = torch.randn(4, 2, 6)
    routing.segments, routing.num_rows = [(1, 1, 3)], 4
    y = layer(x)
    ref = layer.base_layer(x)
    ref[1:3] += 0.7 * (x[1:3] @ A.T) @ B.T
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)
    assert layer.lora_A[1].shape == (3, 6) and layer.lora_B[1].shape == (5, 3)
    assert set(layer.lora_A) == {1}


def test_layer_gradients_match_autograd():
    """The hand-written backward equals autograd through the plain formula, with interleaved segments."""
    torch.manual_seed(0)
    routing = LoRARouting()
    layer = MultiLoRALinear(torch.nn.Linear(6, 5), routing, max_tenants=3, max_rank=4)
    set_slot(layer, 0, torch.randn(2, 6), torch.randn(5, 2), scaling=0.5)
    set_slot(layer, 2, torch.randn(4, 6), torch.randn(5, 4), scaling=2.0)
    x = torch.randn(5, 3, 6, requires_grad=True)
    routing.segments, routing.num_rows = [(0, 0, 1), (2, 1, 3), (0, 3, 4)], 5  # row 4: base only
    w = torch.randn(5, 3, 5)
    (layer(x) * w).sum().backward()

    A = {t: layer.lora_A[t].detach().clone().requires_grad_() for t in (0, 2)}
    B = {t: layer.lora_B[t].detach().clone().requires_grad_() for t in (0, 2)}
    x2 = x.detach().clone().requires_grad_()
    out = layer.base_layer(x2)
    rows = [(0, 0.5), (2, 2.0), (2, 2.0), (0, 0.5), None]
    deltas = [
        torch.zeros(3, 5) if r is None else r[1] * (x2[i] @ A[r[0]].T) @ B[r[0]].T for i, r in enumerate(rows)
    ]
    ((out + torch.stack(deltas)) * w).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for t in (0, 2):
        torch.testing.assert_close(layer.lora_A[t].grad, A[t].grad)
        torch.testing.assert_close(layer.lora_B[t].grad, B[t].grad)


def test_other_tenants_loss_gives_exactly_zero_gradient(base):
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=3, max_rank=8)
    for i, name in enumerate("ABC"):
        mm.add_tenant(name, rank=2 + 2 * i, target_modules=["q_proj", "v_proj", "down_proj"])
        randomise(mm, name, seed=i)
    ids = torch.randint(3, 300, (6, 7))
    logits = mm(ids, tenants=["A", "A", "B", "B", "C", "C"]).logits
    logits[2:4].square().sum().backward()  # B's loss only
    for name in ("A", "C"):  # in the batch, not in the loss: exactly zero
        assert all(p.grad is not None and p.grad.abs().max() == 0 for p, _ in mm.tenant_slices(name))
    slot_b = mm.tenants["B"].slot
    assert all(mm.layers[m].lora_B[slot_b].grad.abs().max() > 0 for m in mm.tenants["B"].modules)


def test_rows_match_single_tenant_forward(base):
    """A mixed batch equals each row computed alone with its own tenant (or the plain base)."""
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=8)
    mm.add_tenant("a", rank=4, target_modules=["q_proj", "k_proj"])
    mm.add_tenant("b", rank=8, target_modules=["up_proj"])
    randomise(mm, "a", 1)
    randomise(mm, "b", 2)
    ids = torch.randint(3, 300, (4, 6))
    names = ["b", None, "a", "b"]
    with torch.no_grad():
        mixed = mm(ids, tenants=names).logits
        for i, n in enumerate(names):
            alone = mm(ids[i : i + 1], tenants=[n]).logits
            torch.testing.assert_close(mixed[i : i + 1], alone, atol=1e-5, rtol=0)
        plain = base(input_ids=ids[1:2]).logits
    torch.testing.assert_close(mixed[1:2], plain, atol=1e-5, rtol=0)


def test_dropout_matches_peft_exactly(base, tmp_path):
    """Same RNG seed, training mode: a tenant with dropout 0.3 gives PEFT's lora_dropout=0.3 logits."""
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    pm = peft.get_peft_model(copy.deepcopy(base), config)
    pm.save_pretrained(tmp_path / "ad")
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=8)
    mm.load_adapter("d", tmp_path / "ad")
    assert mm.tenants["d"].dropout == 0.3
    pm.train()
    mm.train()
    ids = torch.randint(3, 300, (3, 8))
    torch.manual_seed(123)
    ours = mm(ids, tenants=["d"] * 3).logits
    torch.manual_seed(123)
    theirs = pm(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    torch.manual_seed(124)
    assert (mm(ids, tenants=["d"] * 3).logits - ours).abs().max() > 1e-4, "dropout is active in training"
    mm.eval()
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, tenants=["d"] * 3).logits, mm(ids, tenants=["d"] * 3).logits)


def test_slots_are_reused_and_errors_are_clear(base, tmp_path):
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=8, slot_modules=["q_proj", "v_proj"])
    mm.add_tenant("a", rank=4)
    mm.add_tenant("b", rank=8)
    with pytest.raises(RuntimeError, match="no free slot"):
        mm.add_tenant("c")
    with pytest.raises(ValueError, match="already exists"):
        mm.add_tenant("a")
    slot = mm.tenants["a"].slot
    randomise(mm, "a")
    mm.remove_tenant("a")
    assert all(slot not in layer.lora_A and layer.ranks[slot] == 0 for layer in mm.layers.values())
    with pytest.raises(ValueError, match=r"outside 1\.\.max_rank"):
        mm.add_tenant("big", rank=9)
    with pytest.raises(ValueError, match=r"no adapter slots.*q_proj, v_proj"):
        mm.add_tenant("mlp", rank=4, target_modules=["down_proj"])
    assert "big" not in mm.tenants and "mlp" not in mm.tenants
    c = mm.add_tenant("c", rank=2)
    assert c.slot == slot
    with pytest.raises(KeyError, match="unknown tenant 'zz'"):
        mm(torch.zeros(1, 3, dtype=torch.long), tenants=["zz"])


def test_loading_adapter_for_missing_slots_is_an_error_not_an_empty_load(base, tmp_path):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"], init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path / "mlp")
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=8, slot_modules=["q_proj"])
    with pytest.raises(AdapterError, match="without slots"):
        mm.load_adapter("m", tmp_path / "mlp")
    assert not mm.tenants
    small = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=2, slot_modules=["down_proj"])
    with pytest.raises(AdapterError, match="exceeds max_rank"):
        small.load_adapter("m", tmp_path / "mlp")
    with pytest.raises(AdapterError, match="not a PEFT adapter"):
        read_adapter(tmp_path)


def test_saved_adapter_holds_every_module_under_the_tenant_name(base, tmp_path):
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=3, max_rank=8)
    mm.add_tenant("one", rank=2, target_modules=["k_proj"])
    mm.add_tenant("two", rank=4, target_modules=["q_proj", "o_proj"])
    randomise(mm, "two")
    mm.save_adapter("two", tmp_path / "two")
    config, tensors = read_adapter(tmp_path / "two")
    assert config.r == 4 and sorted(config.target_modules) == ["o_proj", "q_proj"]
    assert set(tensors) == set(mm.tenants["two"].modules) and len(tensors) == 4
    for name, (A, B) in mm.tenant_tensors("two").items():
        torch.testing.assert_close(tensors[name][0], A)
        torch.testing.assert_close(tensors[name][1], B)
        assert A.abs().sum() > 0
    # re-saving replaces the directory atomically and leaves no temporary siblings
    mm.save_adapter("two", tmp_path / "two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two"]


def test_adapter_bytes_counts_the_tenants_own_rank(base):
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=64, slot_modules=["q_proj"])
    t = mm.add_tenant("a", rank=4, target_modules=["q_proj"])
    layer = mm.layers[t.modules[0]]
    assert mm.adapter_bytes("a") == len(t.modules) * 4 * (layer.in_features + layer.out_features) * 4


def test_a_peft_adapter_of_the_output_layer_saved_with_its_base_weight_loads(base, tmp_path):
    """PEFT saves an adapted ``lm_head``'s own weight beside its LoRA (``save_embedding_layers="auto"``,
    its default when the output layer is a target): the base's weight, not read; the adapter's own LoRA is,
    and the tenant's logits are PEFT's."""
    torch.manual_seed(0)
    targets = ["q_proj", "lm_head"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    model.save_pretrained(tmp_path / "a")
    from safetensors.torch import load_file

    assert any(
        k.endswith("lm_head.base_layer.weight")
        for k in load_file(tmp_path / "a" / "adapter_model.safetensors")
    )
    _, tensors = read_adapter(tmp_path / "a")
    assert {m.rsplit(".", 1)[-1] for m in tensors} == {"q_proj", "lm_head"}
    mm = MultiLoRAModel(copy.deepcopy(base), max_tenants=2, max_rank=8, slot_modules=targets)
    mm.load_adapter("a", tmp_path / "a")
    ids = torch.randint(3, 200, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(
            mm(ids, tenants=["a", "a"]).logits, model.eval()(input_ids=ids).logits, atol=1e-5, rtol=0
        )
