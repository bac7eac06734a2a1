"""mlora_lab.rl.preference_ref: a pair's reference log-probs from the shared base (the tenant's delta off) equal
TRL 1.16.0's ``DPOTrainer(precompute_ref_log_probs=True)`` columns on the same rows; each row is computed once,
the cache survives a state_dict round trip, and an init adapter as the reference equals PEFT with it loaded."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch

from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.rl.pairs import tokenize_pair
from mlora_lab.rl.preference_ref import ReferenceCache, reference_logps, token_logps

_TRACKIO_BEFORE = "trackio" in sys.modules
with (
    mock.patch("transformers.integrations.is_trackio_available", return_value=False),
    mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
):
    trl = pytest.importorskip("trl")
    from trl import DPOConfig, DPOTrainer
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

# TRL's fused LM head computes per-token log-probs in float32 whatever the model's dtype
# (trl/kernels/chunked_logprob.py): its sequence log-probs (sums of ~-80 here) carry float32 rounding of
# ~1e-7 relative, i.e. ~1e-5 absolute; ours come from the float64 logits. Hence atol 5e-5, rtol 1e-6.
TRL_RTOL, TRL_ATOL = 1e-6, 5e-5
TARGETS = ["q_proj", "v_proj", "down_proj"]
ROWS = [
    {
        "prompt": f"Question {i}: what do cats like?",
        "chosen": " They like warm places" + " and naps" * (i % 3),
        "rejected": " Nothing" + " at all" * (i % 4 + 1),
    }
    for i in range(5)
]


@pytest.fixture(scope="module")
def base(tiny_models):
    import transformers

    path = tiny_models("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, tok


def multi_lora(path: str) -> MultiLoRAModel:
    """A MultiLoRAModel of the float64 base with tenant "alice" registered, her delta set at random (so that
    it is far from the base: the reference must leave it off)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    mm = MultiLoRAModel(model, max_tenants=3, max_rank=8, adapter_dtype=torch.float64)
    mm.add_tenant("alice", rank=4, alpha=8, target_modules=TARGETS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor, index in mm.tenant_slices("alice"):
            tensor[index].copy_(torch.randn(tensor[index].shape, generator=g, dtype=torch.float64) * 0.3)
    return mm


def test_importing_trl_here_left_trackio_unimported():
    assert _TRACKIO_BEFORE or "trackio" not in sys.modules


def test_cache_equals_trls_precomputed_reference_and_computes_each_row_once(base, tmp_path):
    path, tok = base
    import transformers

    args = DPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        per_device_train_batch_size=2,
        dataloader_num_workers=0,
        disable_tqdm=True,
        precompute_ref_log_probs=True,
        bf16=False,  # TRL's default autocasts its forwards to bfloat16
    )
    trainer = DPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tok,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0),
    )
    trl_chosen = torch.tensor(trainer.train_dataset["ref_chosen_logps"], dtype=torch.float64)
    trl_rejected = torch.tensor(trainer.train_dataset["ref_rejected_logps"], dtype=torch.float64)
    assert trl_chosen.shape == (len(ROWS),) and (trl_chosen < -1).all()

    mm = multi_lora(path)
    calls = []
    mm.model.register_forward_hook(lambda module, args, out: calls.append(1))
    pairs = [tokenize_pair(row, tok) for row in ROWS]
    cache = ReferenceCache(
        mm,
        pad_token_id=tok.pad_token_id,
        max_length=args.max_length,
        truncation_mode=args.truncation_mode,
        batch_size=2,
    )
    ids = [f"row{i}" for i in range(len(ROWS))]
    assert cache.missing(ids[:3] + ids[:1]) == ids[:3]
    chosen, rejected = cache(ids[:3], pairs[:3], dtype=torch.float64)  # the first draw: 3 rows, 2 batches
    assert cache.forwards == len(calls) == 2 and len(cache) == 3
    chosen, rejected = cache(ids, pairs, dtype=torch.float64)  # rows 0-2 again: only rows 3-4 are new
    assert cache.forwards == len(calls) == 3 and cache.missing(ids) == []
    cache(ids[::-1], pairs[::-1])  # another epoch, another order: nothing computed
    assert cache.forwards == len(calls) == 3

    torch.testing.assert_close(chosen, trl_chosen, rtol=TRL_RTOL, atol=TRL_ATOL)
    torch.testing.assert_close(rejected, trl_rejected, rtol=TRL_RTOL, atol=TRL_ATOL)

    # the tenant's delta is real and left off: her own log-probs differ from the reference by far
    batch = {
        k: torch.tensor(v)
        for k, v in trainer.data_collator([trainer.train_dataset[i] for i in range(2)]).items()
    }
    with torch.no_grad():
        hers = token_logps(mm, batch["input_ids"], batch["attention_mask"], "alice")
        mask = batch["completion_mask"][:, 1:]
        assert ((hers * mask).sum(dim=1).chunk(2)[0] - chosen[:2]).abs().min() > 1e-2
    # the batch-level function on TRL's own collated batch gives the same values
    ref_chosen, ref_rejected = reference_logps(mm, batch)
    torch.testing.assert_close(ref_chosen, chosen[:2], rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(ref_rejected, rejected[:2], rtol=1e-12, atol=1e-9)

    # a checkpoint round trip: the values come back, nothing is recomputed
    state, made = cache.state_dict(), len(calls)
    torch.save(state, tmp_path / "ref.pt")
    restored = ReferenceCache(
        mm, pad_token_id=tok.pad_token_id, max_length=args.max_length, truncation_mode=args.truncation_mode
    )
    restored.load_state_dict(torch.load(tmp_path / "ref.pt"))
    again = restored(ids, pairs, dtype=torch.float64)
    assert restored.forwards == 0 and len(calls) == made
    assert torch.equal(again[0], chosen) and torch.equal(again[1], rejected)
    other = ReferenceCache(mm, pad_token_id=tok.pad_token_id, ld_alpha=0.5, tenant="alice")
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    assert "ld_alpha: None in the checkpoint, 0.5 here" in str(e.value)
    assert "reference: None in the checkpoint, 'alice' here" in str(e.value)


@pytest.mark.parametrize("ld_alpha", [None, 0.4], ids=["plain", "ld_alpha"])
def test_init_adapter_reference_equals_peft_with_it_loaded(base, tmp_path, ld_alpha):
    """The init adapter registered as a frozen tenant and routed to: PEFT's model with that adapter loaded gives
    the same sequence log-probs (both float64, from the logits: to 1e-9)."""
    import transformers

    from mlora_lab.rl.pairs import collate_pairs
    from mlora_lab.rl.preference import sequence_logps

    path, tok = base
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    init = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.1, init_lora_weights=False),
    )
    init.save_pretrained(tmp_path / "init")

    mm = multi_lora(path)
    mm.load_adapter("alice@ref", tmp_path / "init")
    mm.train()  # the reference runs in eval mode whatever the model's mode: the adapter's dropout stays off
    pairs = [tokenize_pair(row, tok) for row in ROWS]
    cache = ReferenceCache(
        mm, pad_token_id=tok.pad_token_id, tenant="alice@ref", ld_alpha=ld_alpha, batch_size=3
    )
    chosen, rejected = cache(list(range(len(ROWS))), pairs, dtype=torch.float64)
    assert mm.training

    batch = {k: torch.tensor(v) for k, v in collate_pairs(pairs, tok.pad_token_id).items()}
    init.eval()
    with torch.no_grad():
        logits = init(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["completion_mask"][:, 1:]
    expected = sequence_logps(
        *logps.chunk(2)[:1], mask.chunk(2)[0], logps.chunk(2)[1], mask.chunk(2)[1], ld_alpha=ld_alpha
    )
    torch.testing.assert_close(chosen, expected[0], rtol=0, atol=1e-9)
    torch.testing.assert_close(rejected, expected[1], rtol=0, atol=1e-9)
    with torch.no_grad(), init.disable_adapter():
        plain = init(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not torch.allclose(plain[:, :-1], logits, atol=1e-3)  # the init adapter changes the reference


def test_init_adapter_reference_equals_trls_ref_adapter(base, tmp_path):
    """TRL's ``"ref"`` adapter case: a PEFT model with a pretrained adapter, which TRL copies into a frozen "ref"
    adapter, with ``precompute_ref_log_probs``: TRL's columns (its forward under the "ref" adapter)
    equal the cache routed to the init adapter's frozen tenant, to TRL's float32 precision."""
    import transformers

    path, tok = base
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    init = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    )
    init.save_pretrained(tmp_path / "init")
    policy = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64),
        tmp_path / "init",
        is_trainable=True,
    )
    args = DPOConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=2,
        dataloader_num_workers=0,
        disable_tqdm=True,
        precompute_ref_log_probs=True,
        ld_alpha=0.4,
    )
    trainer = DPOTrainer(
        model=policy, args=args, train_dataset=datasets.Dataset.from_list(ROWS), processing_class=tok
    )
    trl_chosen = torch.tensor(trainer.train_dataset["ref_chosen_logps"], dtype=torch.float64)
    trl_rejected = torch.tensor(trainer.train_dataset["ref_rejected_logps"], dtype=torch.float64)

    mm = multi_lora(path)
    mm.load_adapter("alice@ref", tmp_path / "init")
    pairs = [tokenize_pair(row, tok) for row in ROWS]
    cache = ReferenceCache(mm, pad_token_id=tok.pad_token_id, tenant="alice@ref", ld_alpha=0.4)
    chosen, rejected = cache(list(range(len(ROWS))), pairs, dtype=torch.float64)
    torch.testing.assert_close(chosen, trl_chosen, rtol=TRL_RTOL, atol=TRL_ATOL)
    torch.testing.assert_close(rejected, trl_rejected, rtol=TRL_RTOL, atol=TRL_ATOL)
    base_only, _ = ReferenceCache(mm, pad_token_id=tok.pad_token_id, ld_alpha=0.4)(
        list(range(len(ROWS))), pairs, dtype=torch.float64
    )
    assert (base_only - chosen).abs().min() > 1e-3  # TRL did use the "ref" adapter, not the bare base
