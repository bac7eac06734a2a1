"""Tinker's built-in losses (mlora_lab.service.losses) against the formulas of Tinker's docs, per token.

Each loss's value and its gradient with respect to the learner's log-probs are compared with the formula
written out here in Python floats, token by token; ``cross_entropy`` with ``weights = −∂L/∂lp`` must give
every loss's gradient (the SDK's custom-loss path relies on it); the checks must name every problem of a
request in one error. No model: the learner's log-probs are a leaf tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

from mlora_lab.service.losses import (
    CONFIG,
    LOSS_FNS,
    MAX_PROBLEMS,
    LossInputError,
    config_problems,
    datum_loss,
    validate,
)

# ratios r = exp(lp − q) on both sides of [0.8, 1.2] and inside it, advantages of both signs and zero
RATIOS = [0.5, 0.7, 0.79, 0.9, 1.0, 1.1, 1.21, 1.5, 2.0, 1.3, 0.6]
ADVANTAGES = [1.0, -0.5, 1.5, -1.0, 0.7, 1.2, -0.3, 0.4, -1.1, 0.0, 0.0]
SAMPLER = [-0.4, -1.3, -2.2, -0.05, -0.9, -1.7, -0.6, -2.5, -1.0, -0.8, -0.3]
WEIGHTS = [1.0, 0.0, 2.5, -1.5, 1.0, -0.25, 0.0, 3.0, 1.0, -2.0, 0.5]
IN_RATIO = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]  # gspo's sequence_ratio_mask
N = len(RATIOS)
SDK_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")  # lib/chunked_fwdbwd_helpers.py
CONFIGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.3},
}


def datum(dtype: torch.dtype, ratios=RATIOS, advantages=ADVANTAGES):
    q = torch.tensor(SAMPLER[: len(ratios)], dtype=dtype)
    lp = (q + torch.log(torch.tensor(ratios, dtype=dtype))).requires_grad_(True)
    inputs = {
        "target_tokens": torch.arange(len(ratios), dtype=torch.int64),
        "logprobs": q,
        "advantages": torch.tensor(advantages, dtype=dtype),
        "weights": torch.tensor(WEIGHTS[: len(ratios)], dtype=dtype),
        "sequence_ratio_mask": torch.tensor(IN_RATIO[: len(ratios)], dtype=dtype),
    }
    return lp, inputs


def for_loss(loss_fn: str, inputs: dict) -> dict:
    keep = (
        ("target_tokens", "weights")
        if loss_fn == "cross_entropy"
        else ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")
        if loss_fn == "gspo"
        else ("target_tokens", "logprobs", "advantages")
    )
    return {k: v for k, v in inputs.items() if k in keep}


def by_hand(loss_fn: str, lp, inputs, config) -> tuple[float, list[float]]:
    """``(L, [∂L/∂lp_t])`` from the docs' per-token formulas, in Python floats."""
    lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    loss, grads = 0.0, []
    marked = [t for t, m in enumerate(inputs["sequence_ratio_mask"].tolist()) if m != 0]
    logs = [lp.detach().tolist()[t] - float(inputs["logprobs"][t]) for t in marked]
    s = math.exp(sum(logs) / len(logs)) if logs else 1.0  # gspo's one ratio: the geometric mean over M
    for t, lp_t in enumerate(lp.detach().tolist()):
        w = float(inputs["weights"][t])
        q, a = float(inputs["logprobs"][t]), float(inputs["advantages"][t])
        r = math.exp(lp_t - q)
        c = None if lo is None else min(max(r, lo), hi)
        if loss_fn == "cross_entropy":
            term, grad = -lp_t * w, -w
        elif loss_fn == "importance_sampling":
            term, grad = -r * a, -r * a
        elif loss_fn == "ppo":
            term = -min(r * a, c * a)
            grad = -r * a if r * a <= c * a else 0.0  # the clipped term is the min: no gradient
        elif loss_fn == "cispo":
            term, grad = -c * lp_t * a, -c * a
        elif loss_fn == "gspo":
            cs = min(max(s, lo), hi)
            term = -min(s * a, cs * a)
            grad = -s * a if s * a <= cs * a else 0.0
        else:
            beta = config["beta"]
            term, grad = -(lp_t * a - 0.5 * beta * (lp_t - q) ** 2), -a + beta * (lp_t - q)
        loss += term
        grads.append(grad)
    return loss, grads


def gradient(loss: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, lp)[0]


DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_loss_and_its_gradient_equal_the_per_token_formula(loss_fn, dtype):
    lp, inputs = datum(dtype)
    loss, metrics = datum_loss(loss_fn, lp, for_loss(loss_fn, inputs), CONFIGS[loss_fn])
    want_loss, want_grads = by_hand(loss_fn, lp, inputs, CONFIGS[loss_fn])
    assert loss.dtype == dtype and loss.ndim == 0
    assert loss.item() == pytest.approx(want_loss, rel=1e-6, abs=1e-6)
    torch.testing.assert_close(
        gradient(loss, lp), torch.tensor(want_grads, dtype=dtype), rtol=1e-6, atol=1e-6
    )
    assert metrics["loss:sum"].item() == loss.item() and not metrics["loss:sum"].requires_grad
    for key in metrics:  # the SDK splits on the one colon and drops unknown reductions
        name, reduction = key.split(":")
        assert name and reduction in SDK_REDUCTIONS


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_the_loss_is_computed_on_the_device_of_the_logprobs(loss_fn):
    """The request's inputs arrive as CPU tensors; the learner's logprobs are on the job's device (a GPU). A
    ``meta`` device stands in for it here: like CUDA, it refuses arithmetic with CPU tensors. (The first run
    of a served job on a GPU failed every forward_backward this way.)"""
    lp, inputs = datum(torch.float32)
    lp = lp.detach().to("meta").requires_grad_()
    mask = torch.ones(lp.shape, dtype=torch.bool)
    loss, metrics = datum_loss(loss_fn, lp, for_loss(loss_fn, inputs), CONFIGS[loss_fn], mask=mask)
    assert loss.device.type == "meta" and all(m.device.type == "meta" for m in metrics.values())
    assert gradient(loss, lp).shape == lp.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_cross_entropy_weighted_by_minus_the_gradient_has_the_same_gradient(loss_fn, dtype):
    lp, inputs = datum(dtype)
    loss, _ = datum_loss(loss_fn, lp, for_loss(loss_fn, inputs), CONFIGS[loss_fn])
    grad = gradient(loss, lp)
    surrogate_inputs = {"target_tokens": inputs["target_tokens"], "weights": -grad}
    surrogate, metrics = datum_loss("cross_entropy", lp, surrogate_inputs, {})
    torch.testing.assert_close(gradient(surrogate, lp), grad, rtol=1e-6, atol=1e-6)
    assert metrics["loss:sum"].item() == pytest.approx(float((lp.detach() * grad).sum()), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("lo, hi", [(0.8, 1.2), (0.5, 1.6)])
def test_ppo_and_cispo_clip_on_both_sides_for_both_signs_of_the_advantage(lo, hi):
    ratios = [3.0, 3.0, 0.25, 0.25, 1.0, 3.0]
    advantages = [1.0, -1.0, 1.0, -1.0, 2.0, 0.0]
    lp, inputs = datum(torch.float64, ratios, advantages)
    config = {"clip_low_threshold": lo, "clip_high_threshold": hi}
    ppo, ppo_metrics = datum_loss("ppo", lp, for_loss("ppo", inputs), config)
    cispo, cispo_metrics = datum_loss("cispo", lp, for_loss("cispo", inputs), config)
    # ppo: above hi with A > 0 and below lo with A < 0 take the clipped (constant) term; the rest −r·A
    want_ppo = [0.0, 3.0, -0.25, 0.0, -2.0, 0.0]
    # cispo: every token keeps its policy gradient, weighted by the clipped ratio
    want_cispo = [-hi, hi, -lo, lo, -2.0, 0.0]
    torch.testing.assert_close(gradient(ppo, lp), torch.tensor(want_ppo, dtype=torch.float64))
    torch.testing.assert_close(gradient(cispo, lp), torch.tensor(want_cispo, dtype=torch.float64))
    want_ppo_loss = -(hi * 1 + 3.0 * -1 + 0.25 * 1 + lo * -1 + 1.0 * 2)
    assert ppo.item() == pytest.approx(want_ppo_loss)
    for metrics in (ppo_metrics, cispo_metrics):  # the last token is outside but has A = 0: not counted
        assert metrics["clipped:sum"].item() == 4 and metrics["tokens:sum"].item() == 5


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo"])
def test_clip_thresholds_default_to_0_8_and_1_2(loss_fn):
    lp, inputs = datum(torch.float64)
    default, _ = datum_loss(loss_fn, lp, for_loss(loss_fn, inputs), {})
    explicit, _ = datum_loss(loss_fn, lp, for_loss(loss_fn, inputs), CONFIGS[loss_fn])
    other, _ = datum_loss(loss_fn, lp, for_loss(loss_fn, inputs), {"clip_low_threshold": 0.9})
    assert default.item() == explicit.item() != other.item()
    assert CONFIG[loss_fn] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert validate(loss_fn, {}, [for_loss(loss_fn, inputs)], [N]) == CONFIGS[loss_fn]


def test_cross_entropy_without_weights_weighs_every_position_one_and_takes_negative_weights():
    lp, inputs = datum(torch.float32)
    unweighted, _ = datum_loss("cross_entropy", lp, {"target_tokens": inputs["target_tokens"]}, {})
    ones, _ = datum_loss(
        "cross_entropy", lp, {**for_loss("cross_entropy", inputs), "weights": torch.ones(N)}, {}
    )
    assert unweighted.item() == ones.item() == pytest.approx(-float(lp.detach().sum()))
    negative = {"target_tokens": inputs["target_tokens"], "weights": -torch.ones(N)}
    flipped, _ = datum_loss("cross_entropy", lp, negative, {})
    assert flipped.item() == pytest.approx(-unweighted.item())
    torch.testing.assert_close(gradient(flipped, lp), torch.ones(N))
    assert validate("cross_entropy", {}, [negative, {"target_tokens": inputs["target_tokens"]}], [N, N]) == {}


def test_dro_refuses_a_missing_beta_and_says_there_is_no_default():
    lp, inputs = datum(torch.float64)
    with pytest.raises(LossInputError, match="needs loss_fn_config 'beta': Tinker documents no default"):
        datum_loss("dro", lp, for_loss("dro", inputs), {})
    zero, _ = datum_loss("dro", lp, for_loss("dro", inputs), {"beta": 0})
    assert zero.item() == pytest.approx(-float((lp.detach() * inputs["advantages"]).sum()))


@pytest.mark.parametrize("loss_fn", LOSS_FNS)
def test_a_padded_batch_with_a_mask_sums_its_datums(loss_fn):
    lengths = [N, 4, 7]
    lp = torch.zeros(3, N, dtype=torch.float64)
    padded = {
        k: torch.zeros(3, N, dtype=v.dtype) for k, v in for_loss(loss_fn, datum(torch.float64)[1]).items()
    }
    mask = torch.zeros(3, N, dtype=torch.bool)
    want = 0.0
    for b, n in enumerate(lengths):
        lp_b, inputs_b = datum(torch.float64, RATIOS[:n], ADVANTAGES[::-1][:n] if b else ADVANTAGES[:n])
        loss_b, _ = datum_loss(loss_fn, lp_b, for_loss(loss_fn, inputs_b), CONFIGS[loss_fn])
        want += loss_b.item()
        lp[b, :n] = lp_b.detach()
        for k in padded:
            padded[k][b, :n] = inputs_b[k]
        mask[b, :n] = True
    lp.requires_grad_(True)
    loss, _ = datum_loss(loss_fn, lp, padded, CONFIGS[loss_fn], mask=mask)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert not gradient(loss, lp)[~mask].any()


def test_every_problem_of_a_request_is_named_in_one_error():
    good = for_loss("ppo", datum(torch.float32)[1])
    bad_shapes = {**good, "advantages": torch.zeros(N + 1), "logprobs": torch.zeros(2, N)}
    bad_values = {
        **good,
        "target_tokens": torch.tensor([0, 1, -1] + [N] * (N - 3)),
        "advantages": torch.tensor([math.nan, math.inf] + [0.0] * (N - 2)),
        "logprobs": torch.zeros(N, dtype=torch.int32),
    }
    bad_keys = {
        "target_tokens": good["target_tokens"].float(),
        "advantages": good["advantages"],
        "weights": torch.ones(N),
        "clip_low_threshold": torch.ones(N),
    }
    config = {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2, "beta": 0.1}
    with pytest.raises(LossInputError) as caught:
        validate("ppo", config, [good, bad_shapes, bad_values, bad_keys], [N, N, N, N], vocab_size=N)
    message = str(caught.value)
    for fragment in [
        "loss_fn_config keys 'beta' are unknown to ppo (takes clip_low_threshold, clip_high_threshold)",
        "clip_low_threshold 1.5 is above clip_high_threshold 1.2",
        f"datum 1: advantages has shape [{N + 1}], expected [{N}]",
        f"datum 1: logprobs has shape [2, {N}], expected [{N}]",
        f"datum 2: target_tokens must be token ids in [0, {N}), got values from -1 to {N}",
        "datum 2: advantages has 2 non-finite values",
        "datum 2: logprobs must be torch.float32 or torch.float64, got torch.int32",
        "datum 3: missing logprobs (ppo needs target_tokens, logprobs, advantages)",
        "datum 3: unknown inputs clip_low_threshold, weights (ppo takes target_tokens, logprobs, advantages; "
        "clip thresholds go in loss_fn_config)",
        "datum 3: target_tokens must be torch.int64, got torch.float32",
    ]:
        assert fragment in message
    assert "datum 0" not in message


def test_config_values_that_make_no_sense_are_all_named():
    problems, _ = config_problems("ppo", {"clip_low_threshold": -0.1, "clip_high_threshold": math.nan})
    assert problems == [
        "loss_fn_config 'clip_high_threshold' must be a finite number, got nan",
        "clip_low_threshold must be ≥ 0 (a ratio bound, e.g. 0.8), got -0.1",
    ]
    problems, _ = config_problems("dro", {"beta": -1.0})
    assert problems == ["beta must be ≥ 0, got -1.0"]
    problems, _ = config_problems("cispo", {"clip_high_threshold": "1.2", "clip_low_threshold": True})
    assert len(problems) == 2 and all("must be a finite number" in p for p in problems)
    problems, _ = config_problems("cross_entropy", {"beta": 0.1})
    assert problems == ["loss_fn_config keys 'beta' are unknown to cross_entropy (takes none)"]


@pytest.mark.parametrize("name", ["stable_reinforce", "custom"])
def test_the_sdks_other_losses_are_refused_as_a_user_error(name):
    supported = "supported: cross_entropy, importance_sampling, ppo, cispo, gspo, dro"
    with pytest.raises(ValueError, match=f"'{name}' is not supported by this server; {supported}"):
        validate(name, {}, [{"target_tokens": torch.zeros(3, dtype=torch.int64)}], [3])
    with pytest.raises(LossInputError, match="is not supported by this server"):
        datum_loss(name, torch.zeros(3), {}, {})


def test_an_unknown_loss_is_refused_and_its_inputs_still_checked():
    with pytest.raises(LossInputError) as caught:
        validate("mse", {"x": 1.0}, [{"advantages": torch.zeros(2)}], [3])
    message = str(caught.value)
    assert "unknown loss_fn 'mse'; supported: cross_entropy" in message
    assert "datum 0: advantages has shape [2], expected [3]" in message


def test_a_flood_of_bad_datums_gives_a_message_of_bounded_length():
    data = [{"target_tokens": torch.zeros(2, dtype=torch.int64)}] * 1000
    with pytest.raises(LossInputError) as caught:
        validate("importance_sampling", {}, data, [3] * 1000)
    message = str(caught.value)
    assert message.endswith(f"and {2 * 1000 - MAX_PROBLEMS} more") and len(message) < 4000
