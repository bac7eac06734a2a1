"""mlora_lab.rl.preference equals TRL 1.16.0's DPOTrainer: for every loss type (and LD-DPO, the
f-divergences, several weighted loss types, label smoothing, WPO), TRL's own ``DPOTrainer.compute_loss`` on one
batch of its own dataloader, and ``preference_loss`` fed with log-probs of the same batch computed here from
the PEFT model's plain forward (the reference: the same forward under ``disable_adapter()``), give the same
loss, the same LoRA gradients and the same logged metrics."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch

from mlora_lab.rl.preference import (
    F_DIVERGENCE_LOSS_TYPES,
    LOSS_TYPES,
    METRICS,
    check_options,
    preference_loss,
    sequence_logps,
    wpo_weights,
)

# As in tests/rl/test_rl_loss.py: TRL would import trackio, which fixes its store folder on import.
_TRACKIO_BEFORE = "trackio" in sys.modules
with (
    mock.patch("transformers.integrations.is_trackio_available", return_value=False),
    mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
):
    trl = pytest.importorskip("trl")
    from trl import DPOConfig, DPOTrainer
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

LOSS_TOL = 1e-6
GRAD_TOL = 1e-5
# TRL's fused LM head computes per-token log-probs in float32 whatever the model's dtype
# (trl/kernels/chunked_logprob.py), so its sequence log-probs (≈ -80 here) carry float32 rounding, ~1e-7 of
# their size; computed here from the float64 model's logits, ours do not.
METRIC_REL, METRIC_ABS, OWN_LOSS_TOL = 1e-6, 1e-5, 1e-5
# sppo_hard's gradient is 2(u − 1/2β)·∇u: the float32 error of TRL's u scales its LoRA gradients relatively
OWN_GRAD_RTOL = 1e-4
BETA = 0.3  # large enough that every loss type's rewards and gradients are far from 0

ROWS = [
    {
        "prompt": f"Question {i}: what do cats like?",
        "chosen": " They like warm places" + " and naps" * (i % 3),
        "rejected": " Nothing" + " at all" * (i % 4 + 1),
    }
    for i in range(4)
]


def test_importing_trl_here_left_trackio_unimported():
    assert _TRACKIO_BEFORE or "trackio" not in sys.modules


def test_the_matched_trl_version_is_installed():
    assert trl.__version__ == "1.16.0", "mlora_lab.rl.preference cites TRL 1.16.0's lines; re-check it"


def test_every_trl_loss_type_is_offered():
    """The list TRL's ``_compute_loss`` names when it refuses an unknown loss type is LOSS_TYPES."""
    import inspect
    import re

    from trl.trainer import dpo_trainer

    source = inspect.getsource(dpo_trainer.DPOTrainer._compute_loss)
    listed = source[
        source.index("Should be one of [") : source.index("]", source.index("Should be one of ["))
    ]
    assert tuple(re.findall(r"'(\w+)'", listed)) == LOSS_TYPES


def test_defaults_are_dpo_configs():
    import inspect

    config = DPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False)
    defaults = {k: p.default for k, p in inspect.signature(preference_loss).parameters.items()}
    assert list(defaults["loss_types"]) == config.loss_type
    assert defaults["loss_weights"] == config.loss_weights
    assert defaults["beta"] == config.beta
    assert defaults["label_smoothing"] == config.label_smoothing
    assert defaults["f_divergence"] == config.f_divergence_type
    assert defaults["f_alpha"] == config.f_alpha_divergence_coef
    assert defaults["discopop_tau"] == config.discopop_tau


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    import transformers

    path = tiny_models("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, tok, datasets.Dataset.from_list(ROWS), tmp_path_factory.mktemp("dpo")


def trainer_for(setup, **config) -> DPOTrainer:
    """TRL's trainer on a fresh tiny llama with a fresh LoRA (``peft_config``: the reference is the base with the
    adapter off), its LoRA weights then set at random (seeded) so that the policy differs from the reference."""
    import transformers

    path, tok, dataset, out = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    args = DPOConfig(
        output_dir=str(out),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        per_device_train_batch_size=len(ROWS),
        dataloader_num_workers=0,
        disable_tqdm=True,
        beta=BETA,
        **config,
    )
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tok, peft_config=lora
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    trainer.model.train()
    return trainer


def token_stats(model, batch, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of each row's next tokens ``[2B, T-1]`` and ``log Σ_v p_v²`` (WPO's, or None).

    ``fused``: from the forward TRL makes (its fused LM head, float32 softmax statistics whatever the model's
    dtype), so that the loss maths alone is compared, to TRL's precision. Otherwise from the plain float64
    logits: log-probs computed independently of TRL's kernel."""
    if fused:
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=labels,
            fused_lm_head=True,
            use_cache=False,
        )
        return out.log_probs, out.log_sum_sq_probs
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    token_logps = logprobs.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return token_logps, torch.logsumexp(2 * logprobs.detach(), dim=-1)


def ours(trainer: DPOTrainer, batch, fused: bool, *, ld_alpha=None, **options):
    """``preference_loss`` on log-probs computed here from the batch TRL's dataloader gave."""
    model = trainer.model
    token_logps, log_sum_sq = token_stats(model, batch, fused)
    mask = batch["completion_mask"][:, 1:].to(token_logps.dtype)
    with torch.no_grad(), model.disable_adapter():
        ref_token_logps, _ = token_stats(model, batch, fused)
    chosen_mask, rejected_mask = mask.chunk(2)
    chosen_tl, rejected_tl = token_logps.chunk(2)  # TRL's batch is [chosen rows; rejected rows]
    ref_chosen_tl, ref_rejected_tl = ref_token_logps.chunk(2)
    chosen, rejected = sequence_logps(chosen_tl, chosen_mask, rejected_tl, rejected_mask, ld_alpha=ld_alpha)
    ref_chosen, ref_rejected = sequence_logps(
        ref_chosen_tl, chosen_mask, ref_rejected_tl, rejected_mask, ld_alpha=ld_alpha
    )
    counts = batch["completion_mask"].sum(dim=1)
    pair_weights = None
    if options.pop("use_weighting", False):
        w = wpo_weights(token_logps, log_sum_sq, mask)
        pair_weights = w.chunk(2)[0] * w.chunk(2)[1]
    return preference_loss(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta=BETA,
        chosen_tokens=counts.chunk(2)[0],
        rejected_tokens=counts.chunk(2)[1],
        chosen_token_logps=chosen_tl,
        chosen_mask=chosen_mask,
        pair_weights=pair_weights,
        **options,
    )


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


CASES = [
    pytest.param({"loss_type": [t]}, {"loss_types": [t]}, id=t) for t in LOSS_TYPES if t != "exo_pair"
] + [
    pytest.param(
        {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
        {"loss_types": ["exo_pair"], "label_smoothing": 1e-3},
        id="exo_pair-smoothed",
    ),
    pytest.param(
        {"loss_type": ["robust"], "label_smoothing": 0.2},
        {"loss_types": ["robust"], "label_smoothing": 0.2},
        id="robust-smoothed",
    ),
    pytest.param(
        {"loss_type": ["aot"], "label_smoothing": 0.1},
        {"loss_types": ["aot"], "label_smoothing": 0.1},
        id="aot-smoothed",
    ),
    pytest.param(
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [0.8, 0.2]},
        {"loss_types": ["sigmoid", "sft"], "loss_weights": [0.8, 0.2]},
        id="sigmoid+sft-weighted",
    ),
    pytest.param(
        {"loss_type": ["ipo", "bco_pair", "hinge"], "loss_weights": [1.0, 0.5, 2.0]},
        {"loss_types": ["ipo", "bco_pair", "hinge"], "loss_weights": [1.0, 0.5, 2.0]},
        id="ipo+bco_pair+hinge-weighted",
    ),
    pytest.param(
        {"loss_type": ["sigmoid"], "ld_alpha": 0.4},
        {"loss_types": ["sigmoid"], "ld_alpha": 0.4},
        id="ld_alpha",
    ),
    pytest.param(
        {"loss_type": ["ipo"], "ld_alpha": 0.7, "f_divergence_type": "js_divergence"},
        {"loss_types": ["ipo"], "ld_alpha": 0.7, "f_divergence": "js_divergence"},
        id="ld_alpha-ipo-js",
    ),
    pytest.param(
        {"loss_type": ["sigmoid"], "f_divergence_type": "forward_kl"},
        {"loss_types": ["sigmoid"], "f_divergence": "forward_kl"},
        id="forward_kl",
    ),
    pytest.param(
        {
            "loss_type": ["sigmoid_norm"],
            "f_divergence_type": "alpha_divergence",
            "f_alpha_divergence_coef": 0.5,
        },
        {"loss_types": ["sigmoid_norm"], "f_divergence": "alpha_divergence", "f_alpha": 0.5},
        id="alpha_divergence",
    ),
    pytest.param(
        {"loss_type": ["discopop"], "discopop_tau": 0.2},
        {"loss_types": ["discopop"], "discopop_tau": 0.2},
        id="discopop-tau",
    ),
    pytest.param(
        {"loss_type": ["sigmoid", "apo_zero"], "use_weighting": True},
        {"loss_types": ["sigmoid", "apo_zero"], "use_weighting": True},
        id="wpo",
    ),
]


@pytest.mark.parametrize("fused", [True, False], ids=["trl-logps", "own-logps"])
@pytest.mark.parametrize(("trl_config", "options"), CASES)
def test_loss_gradients_and_metrics_equal_trl(setup, trl_config, options, fused):
    """With TRL's per-token log-probs (``fused``), loss to 1e-6, LoRA gradients to 1e-5, metrics to 1e-6
    relative. With log-probs computed here in float64, TRL's float32 ones differ by ~1e-7 of each sequence's
    log-prob (≈ -80, so ~1e-5): the loss is then compared to 1e-5, the gradients to 1e-5 + 1e-4 relative
    and the metrics to 1e-6 relative."""
    trainer = trainer_for(setup, **trl_config)
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model

    model.zero_grad()
    trl_loss = trainer.compute_loss(model, batch)
    trl_loss.backward()
    trl_grads = lora_grads(model)
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    model.zero_grad()
    loss, metrics = ours(trainer, batch, fused, **options)
    loss.backward()
    grads = lora_grads(model)

    assert abs(loss.item() - trl_loss.item()) <= (LOSS_TOL if fused else OWN_LOSS_TOL), (
        loss.item(),
        trl_loss.item(),
    )
    assert grads.keys() == trl_grads.keys() and len(grads) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    for name, grad in grads.items():
        assert torch.allclose(grad, trl_grads[name], atol=GRAD_TOL, rtol=0 if fused else OWN_GRAD_RTOL), name
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # the comparison is not between zeros
    assert set(METRICS) <= trl_metrics.keys()
    for name in METRICS:
        expected = pytest.approx(trl_metrics[name], rel=METRIC_REL, abs=LOSS_TOL if fused else METRIC_ABS)
        assert metrics[name].item() == expected, name
    assert metrics["rewards/margins"].abs() > 1e-3  # the policy differs from the reference


def test_sequence_logps_ld_alpha_weighs_the_longer_tail():
    chosen = torch.tensor([[0.0, -1.0, -2.0, -3.0, 0.0]])
    rejected = torch.tensor([[-5.0, -7.0, -9.0]])
    chosen_mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    rejected_mask = torch.tensor([[0.0, 1.0, 1.0]])
    won, lost = sequence_logps(chosen, chosen_mask, rejected, rejected_mask, ld_alpha=0.5)
    assert won.item() == -1.0 - 2.0 + 0.5 * -3.0 and lost.item() == -16.0  # shared length 2
    won, lost = sequence_logps(chosen, chosen_mask, rejected, rejected_mask)
    assert won.item() == -6.0 and lost.item() == -16.0  # masked positions never count


def test_problems_are_reported_together_naming_the_offered_types():
    with pytest.raises(ValueError) as e:
        preference_loss(
            torch.zeros(2),
            torch.zeros(3),
            torch.zeros(2),
            torch.zeros(2),
            loss_types=["dpo", "exo_pair", "nca_pair", "ipo"],
            loss_weights=[1.0],
            f_divergence="forward_kl",
        )
    text = str(e.value)
    for part in (
        "'dpo'",
        ", ".join(LOSS_TYPES),
        "1 loss_weights for 4",
        "not dpo, nca_pair",
        "exo_pair needs 0 < label_smoothing",
        "ipo need chosen_tokens",
        "rejected_logps has shape (3,)",
    ):
        assert part in text, part
    assert set(F_DIVERGENCE_LOSS_TYPES) < set(LOSS_TYPES)
    assert check_options(
        ["aot"], None, beta=0.1, label_smoothing=0.0, f_divergence="reverse_kl", weighted=True
    )
    assert not check_options(
        LOSS_TYPES[:1], None, beta=0.1, label_smoothing=0.0, f_divergence="js_divergence"
    )
