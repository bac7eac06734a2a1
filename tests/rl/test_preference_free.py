"""mlora_lab.rl.preference_free equals TRL 1.16.0's ORPOTrainer, CPOTrainer (CPO, SimPO, AlphaPO) and
KTOTrainer: each trainer's own ``compute_loss`` on one batch of its own dataloader, and our loss fed with
log-probs of the same batch computed here from the PEFT model's plain forward (KTO's reference: the same forward
under ``disable_adapter()``), give the same loss, the same LoRA gradients and the same logged metrics."""

from __future__ import annotations

import inspect
import re
import sys
from unittest import mock

import pytest
import torch

from mlora_lab.rl.preference_free import (
    CPO_AVERAGED_LOSS_TYPES,
    CPO_LOSS_TYPES,
    CPO_METRICS,
    KTO_LOSS_TYPES,
    KTO_METRICS,
    ORPO_METRICS,
    check_cpo_options,
    check_kto_options,
    check_orpo_options,
    cpo_loss,
    kto_loss,
    masked_logps,
    orpo_loss,
    token_mean_nll,
)

# As in tests/rl/test_rl_loss.py: TRL would import trackio, which fixes its store folder on import.
_TRACKIO_BEFORE = "trackio" in sys.modules
with (
    mock.patch("transformers.integrations.is_trackio_available", return_value=False),
    mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
):
    trl = pytest.importorskip("trl")
    from trl import KTOConfig, KTOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

# ORPO and CPO compute their log-probs from the float64 model's logits, as we do here: the two differ by float64
# rounding (measured: 4e-15 on the loss, 3e-14 on the metrics, 5e-16 on CPO's gradients), except where ORPO casts
# the average log-probs (≈ -6) to float32 for its odds ratio (orpo:691). There an input one float64 rounding
# apart can round to the next float32 (5e-7 away), which moves the loss by up to β·5e-7; the float32 backward
# of that term leaves ~1e-9 on the gradients (measured 2e-9).
F64_TOL = 1e-10
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
METRIC_REL, METRIC_ABS = 1e-6, 1e-6
# KTO's own forward is TRL's fused LM head, float32 per-token log-probs whatever the model's dtype
# (trl/kernels/chunked_logprob.py). Fed those (``fused``), ours gives TRL's loss and gradients (measured:
# identical); its metrics TRL divides in Python floats, ours in float32 (5e-6 on ≈ -134: within 1e-6 relative).
# Fed float64 ones computed here, the sums (≈ -134) differ by float32 rounding, ~1e-7 of their size: measured
# 6e-7 on the loss, 3e-8 on the gradients, 5e-6 on the metrics.
KTO_OWN_ABS, KTO_OWN_GRAD_RTOL = 1e-5, 1e-4
BETA = 0.3  # large enough that every loss's rewards and gradients are far from 0

ROWS = [
    {
        "prompt": f"Question {i}: what do cats like?",
        "chosen": " They like warm places" + " and naps" * (i % 3),
        "rejected": " Nothing" + " at all" * (i % 4 + 1),
    }
    for i in range(4)
]
# KTO reads its rows in order (train_sampling_strategy="sequential"): the first batch of 4 is rows 0-3
UNPAIRED_MIXED = [
    {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
    for r, side in zip(ROWS * 2, ["chosen", "rejected", "chosen", "chosen"] * 2, strict=True)
]
UNPAIRED_DESIRABLE = [
    {**u, "completion": r["chosen"], "label": True} for u, r in zip(UNPAIRED_MIXED, ROWS * 2)
]


def test_importing_trl_here_left_trackio_unimported():
    assert _TRACKIO_BEFORE or "trackio" not in sys.modules


def test_the_matched_trl_version_is_installed():
    assert trl.__version__ == "1.16.0", "mlora_lab.rl.preference_free cites TRL 1.16.0's lines; re-check it"


def test_every_trl_loss_type_is_offered():
    """CPO: the list ``cpo_loss`` names when it refuses an unknown type; KTO: ``KTOConfig.loss_type``'s choices;
    the averaged types: those ``concatenated_forward`` asks average log-probs for."""
    source = inspect.getsource(CPOTrainer.cpo_loss)
    listed = source[source.index("Should be one of [") :]
    assert tuple(re.findall(r"'(\w+)'", listed[: listed.index("]")])) == CPO_LOSS_TYPES
    forward = inspect.getsource(CPOTrainer.concatenated_forward)
    averaged = re.search(r"average_log_prob=self.loss_type in \[(.*?)\]", forward).group(1)
    assert tuple(re.findall(r'"(\w+)"', averaged)) == CPO_AVERAGED_LOSS_TYPES
    field = KTOConfig.__dataclass_fields__["loss_type"]
    assert tuple(field.metadata["choices"]) == KTO_LOSS_TYPES


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()}


def test_defaults_are_the_configs():
    common = {"output_dir": "unused", "report_to": "none", "use_cpu": True, "bf16": False}
    orpo, cpo, kto = ORPOConfig(**common), CPOConfig(**common), KTOConfig(**common)
    assert _defaults(orpo_loss)["beta"] == orpo.beta
    d = _defaults(cpo_loss)
    assert (d["loss_type"], d["beta"], d["label_smoothing"]) == (cpo.loss_type, cpo.beta, cpo.label_smoothing)
    assert (d["cpo_alpha"], d["simpo_gamma"], d["alpha"]) == (cpo.cpo_alpha, cpo.simpo_gamma, cpo.alpha)
    d = _defaults(kto_loss)
    assert (d["loss_type"], d["beta"]) == (kto.loss_type, kto.beta)
    assert (d["desirable_weight"], d["undesirable_weight"]) == (kto.desirable_weight, kto.undesirable_weight)


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    import transformers

    path = tiny_models("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, tok, tmp_path_factory.mktemp("preference_free")


def trainer_for(setup, trainer_cls, config_cls, rows, **config):
    """TRL's trainer on a fresh float64 tiny llama with a fresh LoRA, its LoRA weights then set at random (seeded)
    so that the policy differs from the base (KTO's reference)."""
    import transformers

    path, tok, out = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0
    )
    args = config_cls(
        output_dir=str(out),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # these configs default to bf16
        per_device_train_batch_size=4,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **config,
    )
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    trainer.model.train()
    return trainer


def token_logps(model, input_ids, attention_mask) -> torch.Tensor:
    """Per-token log-probs of each row's next tokens ``[n, T-1]`` from the plain float64 logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def pair_stats(model, batch, average: bool):
    """``(ℓ_w [B], ℓ_l [B], chosen per-token log-probs, chosen completion mask)`` of an ORPO/CPO batch: each
    side's own padded rows (right padding leaves the real positions' logits as TRL's concatenated batch has
    them); the completion is where TRL's labels are not -100."""
    out = []
    for side in ("chosen", "rejected"):
        tl = token_logps(model, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"])
        mask = batch[f"{side}_labels"][:, 1:] != -100
        out.append((masked_logps(tl, mask, average=average), tl, mask))
    (chosen, chosen_tl, chosen_mask), (rejected, _, _) = out
    return chosen, rejected, chosen_tl, chosen_mask


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def trl_then_ours(trainer, batch, ours_fn, metric_store):
    """TRL's loss, gradients and last logged metrics, then ours (``ours_fn(model) -> (loss, metrics)``)."""
    model = trainer.model
    model.zero_grad()
    trl_loss = trainer.compute_loss(model, batch)
    trl_loss.backward()
    trl_grads = lora_grads(model)
    trl_metrics = {name: values[-1] for name, values in metric_store(trainer).items()}
    model.zero_grad()
    loss, metrics = ours_fn(model)
    loss.backward()
    return (trl_loss, trl_grads, trl_metrics), (loss, lora_grads(model), metrics)


def assert_equal(
    theirs,
    ours,
    metric_names,
    *,
    loss_tol,
    grad_tol=GRAD_TOL,
    grad_rtol=0.0,
    metric_rel=METRIC_REL,
    metric_abs=METRIC_ABS,
):
    (trl_loss, trl_grads, trl_metrics), (loss, grads, metrics) = theirs, ours
    assert abs(loss.item() - trl_loss.item()) <= loss_tol, (loss.item(), trl_loss.item())
    assert grads.keys() == trl_grads.keys() and len(grads) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    for name, grad in grads.items():
        assert torch.allclose(grad, trl_grads[name], atol=grad_tol, rtol=grad_rtol), name
    assert any(g.abs().max() > 1e-3 for g in grads.values())  # the comparison is not between zeros
    assert set(metric_names) <= trl_metrics.keys()
    for name in metric_names:
        expected = pytest.approx(trl_metrics[name], rel=metric_rel, abs=metric_abs)
        assert metrics[name].item() == expected, name


def _stored(trainer):
    return trainer._stored_metrics["train"]


@pytest.mark.parametrize("beta", [0.1, BETA])
def test_orpo_equals_trl(setup, beta):
    trainer = trainer_for(setup, ORPOTrainer, ORPOConfig, ROWS, beta=beta)
    batch = next(iter(trainer.get_train_dataloader()))

    def ours(model):
        chosen, rejected, _, _ = pair_stats(model, batch, average=True)
        # ORPO's NLL covers the chosen rows' prompt and completion: every attended token after the first
        chosen_tl = token_logps(model, batch["chosen_input_ids"], batch["chosen_attention_mask"])
        nll = token_mean_nll(chosen_tl, batch["chosen_attention_mask"][:, 1:])
        return orpo_loss(chosen, rejected, nll, beta=beta)

    theirs, mine = trl_then_ours(trainer, batch, ours, _stored)
    assert_equal(theirs, mine, ORPO_METRICS, loss_tol=LOSS_TOL)
    metrics = mine[2]
    assert metrics["log_odds_chosen"].abs() > 1e-3  # the odds-ratio term is not at its zero
    assert metrics["rewards/margins"].abs() > 1e-3  # the policy tells the two apart


CPO_CASES = [pytest.param({"loss_type": t}, id=t) for t in CPO_LOSS_TYPES] + [
    pytest.param({"loss_type": "sigmoid", "label_smoothing": 0.2, "cpo_alpha": 0.5}, id="sigmoid-smoothed"),
    pytest.param({"loss_type": "simpo", "simpo_gamma": 1.3, "label_smoothing": 0.1}, id="simpo-gamma"),
    pytest.param({"loss_type": "simpo", "cpo_alpha": 0.0, "alpha": 0.4}, id="alphapo"),
    pytest.param({"loss_type": "sigmoid", "alpha": -0.01}, id="sigmoid-alpha"),
]


@pytest.mark.parametrize("options", CPO_CASES)
def test_cpo_equals_trl(setup, options):
    trainer = trainer_for(setup, CPOTrainer, CPOConfig, ROWS, beta=BETA, **options)
    batch = next(iter(trainer.get_train_dataloader()))

    def ours(model):
        average = options["loss_type"] in CPO_AVERAGED_LOSS_TYPES
        chosen, rejected, chosen_tl, chosen_mask = pair_stats(model, batch, average=average)
        return cpo_loss(chosen, rejected, token_mean_nll(chosen_tl, chosen_mask), beta=BETA, **options)

    theirs, mine = trl_then_ours(trainer, batch, ours, _stored)
    assert_equal(
        theirs, mine, CPO_METRICS, loss_tol=F64_TOL, grad_tol=F64_TOL, metric_rel=F64_TOL, metric_abs=F64_TOL
    )
    assert mine[2]["rewards/margins"].abs() > 1e-3  # the policy tells the two apart
    assert (mine[2]["nll_loss"] == 0) == (options.get("cpo_alpha", 1.0) == 0)


def test_config_alphapo_is_simpo_without_nll():
    config = CPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False, loss_type="alphapo")
    assert (config.loss_type, config.cpo_alpha) == ("simpo", 0.0)


def kto_stats(model, batch, prefix: str, fused: bool) -> torch.Tensor:
    """A KTO batch's completion log-prob sums ``[n]`` (``prefix`` "KL_": its mismatched rows'). ``fused``: from
    the forward TRL makes (its fused LM head, float32), so that the loss maths alone is compared."""
    input_ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}completion_mask"]
    attention = batch[f"{prefix}attention_mask"]
    if fused:
        labels = input_ids.masked_fill(mask == 0, -100)
        out = model(
            input_ids=input_ids, attention_mask=attention, labels=labels, fused_lm_head=True, use_cache=False
        )
        return out.log_probs.sum(-1)  # zero where the labels are ignored
    return masked_logps(token_logps(model, input_ids, attention), mask[:, 1:])


KTO_CASES = [
    pytest.param(UNPAIRED_MIXED, {}, id="kto"),
    pytest.param(UNPAIRED_MIXED, {"desirable_weight": 0.8, "undesirable_weight": 2.5}, id="kto-weighted"),
    pytest.param(UNPAIRED_MIXED, {"loss_type": "apo_zero_unpaired"}, id="apo_zero_unpaired"),
    pytest.param(UNPAIRED_DESIRABLE, {"undesirable_weight": 3.0}, id="kto-all-desirable"),
]


@pytest.mark.parametrize("fused", [True, False], ids=["trl-logps", "own-logps"])
@pytest.mark.parametrize(("rows", "options"), KTO_CASES)
def test_kto_equals_trl(setup, rows, options, fused):
    """With TRL's float32 log-probs (``fused``), loss to 1e-6, gradients to 1e-5, metrics to 1e-6 relative; with
    float64 ones computed here, the loss and metrics to 1e-5 absolute, the gradients to 1e-5 + 1e-4 relative."""
    trainer = trainer_for(setup, KTOTrainer, KTOConfig, rows, beta=BETA, **options)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["label"].tolist() == [r["label"] for r in rows[:4]]  # read in order, as the KL rows assume
    calculate_kl = options.get("loss_type", "kto") == "kto"

    def ours(model):
        logps = kto_stats(model, batch, "", fused)
        kl_logps = kto_stats(model, batch, "KL_", fused) if calculate_kl else None
        with torch.no_grad(), model.disable_adapter():
            ref_logps = kto_stats(model, batch, "", fused)
            ref_kl_logps = kto_stats(model, batch, "KL_", fused) if calculate_kl else None
        return kto_loss(logps, ref_logps, batch["label"], kl_logps, ref_kl_logps, beta=BETA, **options)

    theirs, mine = trl_then_ours(trainer, batch, ours, lambda t: t._metrics["train"])
    metrics = mine[2]
    names = [n for n in KTO_METRICS if n in metrics]
    assert set(names) == set(KTO_METRICS) & theirs[2].keys()  # an absent side is logged by neither
    assert_equal(
        theirs,
        mine,
        names,
        loss_tol=LOSS_TOL if fused else KTO_OWN_ABS,
        grad_rtol=0.0 if fused else KTO_OWN_GRAD_RTOL,
        metric_abs=METRIC_ABS if fused else KTO_OWN_ABS,
    )
    assert (metrics["kl"] > 1e-3) == calculate_kl  # the KL term is exercised, not clamped to 0
    assert metrics["rewards/chosen"].abs() > 1e-3


def test_masked_logps_and_token_mean_nll():
    tl = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    assert masked_logps(tl, mask).tolist() == [-5.0, -4.0]
    assert masked_logps(tl, mask, average=True).tolist() == [-2.5, -4.0]
    assert token_mean_nll(tl, mask).item() == pytest.approx(3.0)  # pooled: (2 + 3 + 4) / 3, not a row mean
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    labels = torch.tensor([[2, -100, 5], [-100, -100, 1]])
    tl = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 7), labels.view(-1))
    assert torch.allclose(token_mean_nll(tl, labels != -100), expected)


def test_orpo_problems_are_reported_together():
    assert check_orpo_options(beta=0.0) == []
    assert "beta must be ≥ 0" in check_orpo_options(beta=-0.1)[0]
    with pytest.raises(ValueError) as e:
        orpo_loss(-torch.ones(2), -torch.ones(3), torch.ones(2), beta=-1.0)
    text = str(e.value)
    for part in ("beta must be ≥ 0", "rejected_logps_mean has shape (3,)", "chosen_nll must be 0-d"):
        assert part in text, part


def test_cpo_problems_are_reported_together():
    assert check_cpo_options("simpo", beta=2.0, label_smoothing=0.1, cpo_alpha=0.0) == []
    assert check_cpo_options("ipo", beta=0.1, label_smoothing=0.0, cpo_alpha=1.0) == []
    problems = check_cpo_options("hinge", beta=0.0, label_smoothing=0.1, cpo_alpha=-1.0)
    assert len(problems) == 3 and "hinge ignores label_smoothing" in problems[1]
    assert (
        "alphapo is loss_type='simpo'"
        in check_cpo_options("alphapo", beta=0.1, label_smoothing=0.0, cpo_alpha=0.0)[0]
    )
    with pytest.raises(ValueError) as e:
        cpo_loss(torch.zeros(2), torch.zeros(2, 1), loss_type="dpo", label_smoothing=0.5)
    text = str(e.value)
    for part in (
        "unknown loss type 'dpo'; offered: " + ", ".join(CPO_LOSS_TYPES),
        "label_smoothing must lie in [0, 0.5), got 0.5",
        "rejected_logps has shape (2, 1)",
        "cpo_alpha ≠ 0 needs chosen_nll",
    ):
        assert part in text, part


def test_kto_problems_are_reported_together():
    assert (
        check_kto_options("apo_zero_unpaired", beta=0.1, desirable_weight=0.0, undesirable_weight=1.0) == []
    )
    problems = check_kto_options("bco", beta=-1.0, desirable_weight=-1.0, undesirable_weight=0.0)
    assert len(problems) == 3 and "offered: " + ", ".join(KTO_LOSS_TYPES) in problems[0]
    assert "both 0" in check_kto_options("kto", beta=0.1, desirable_weight=0.0, undesirable_weight=0.0)[0]
    with pytest.raises(ValueError) as e:
        kto_loss(torch.zeros(1), torch.zeros(2), torch.ones(1))
    text = str(e.value)
    for part in (
        "ref_logps has shape (2,)",
        "labels must be bool",
        "kto needs kl_logps and ref_kl_logps",
        "kto needs more than one row",
    ):
        assert part in text, part
    # apo_zero_unpaired estimates no KL: one row and no KL rows are fine, and its logged kl is 0
    loss, metrics = kto_loss(
        torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([False]), loss_type="apo_zero_unpaired"
    )
    assert metrics["kl"].item() == 0 and "rewards/chosen" not in metrics
    assert loss.item() == pytest.approx(torch.sigmoid(torch.tensor(0.1)).item())


def test_orpo_log_odds_are_the_odds_ratio_of_the_average_probabilities():
    """``log_odds = log(odds(p_w)/odds(p_l))`` with ``odds(p) = p/(1−p)``, ``p = e^ā`` (the ORPO paper's Eq. 4),
    on both sides of ``log1mexp``'s branch at ``−log 2``."""
    chosen, rejected = torch.tensor([-0.1, -2.0], dtype=torch.float64), torch.tensor([-3.0, -0.5])
    loss, metrics = orpo_loss(chosen, rejected.double(), torch.tensor(1.5, dtype=torch.float64), beta=0.2)
    p_w, p_l = chosen.exp(), rejected.double().exp()
    log_odds = torch.log(p_w / (1 - p_w)) - torch.log(p_l / (1 - p_l))
    assert metrics["log_odds_chosen"].item() == pytest.approx(log_odds.mean().item(), rel=1e-6)
    expected = 1.5 - 0.2 * torch.nn.functional.logsigmoid(log_odds).mean().item()
    assert loss.item() == pytest.approx(expected, rel=1e-6)  # the odds ratio is float32, as TRL's


def test_kto_kl_estimate_is_clamped_at_zero():
    """A policy that gives the mismatched completions less mass than the reference does has a negative KL
    estimate; KTO clamps it to 0 (and then equals apo_zero_unpaired's desirable half)."""
    logps, ref_logps = torch.tensor([-5.0, -7.0]), torch.tensor([-6.0, -6.5])
    labels = torch.tensor([True, False])
    kl_logps, ref_kl_logps = torch.tensor([-9.0, -9.0]), torch.tensor([-8.0, -8.5])
    loss, metrics = kto_loss(logps, ref_logps, labels, kl_logps, ref_kl_logps, beta=0.5)
    assert metrics["kl"].item() == 0.0
    u = logps - ref_logps
    expected = ((1 - torch.sigmoid(0.5 * u[0])) + (1 - torch.sigmoid(-0.5 * u[1]))) / 2
    assert loss.item() == pytest.approx(expected.item())
    _, positive = kto_loss(logps, ref_logps, labels, ref_kl_logps, kl_logps, beta=0.5)
    assert positive["kl"].item() == pytest.approx(0.75)  # mean(1, 0.5)
    assert positive["rewards/margins"].item() == pytest.approx(0.5 * (1.0 - -0.5))
