"""Tinker's ``gspo`` loss (mlora_lab.service.losses) against the implementation Tinker's docs print for it
(GSPO-token: one geometric-mean ratio per datum over its ``sequence_ratio_mask``, carried by every token with
its own log-prob's gradient), against TRL's GSPO (``importance_sampling_level="sequence"``, which
tests/rl/test_rl_loss.py checks against TRL's own code) where the two define the same thing, and through the
official SDK's ``forward_backward(..., loss_fn="gspo")``."""

from __future__ import annotations

import math

import pytest
import torch

from mlora_lab.rl.grpo import policy_loss
from mlora_lab.service.losses import CONFIG, LossInputError, datum_loss, validate

LO, HI = 0.8, 1.2


def docs_gspo(target_logprobs, ref_logprobs, advantages, sequence_ratio_mask, lo=LO, hi=HI):
    """The docs' lines for one datum, as printed (https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo),
    the PPO objective's clip and sum after them."""
    in_ratio = sequence_ratio_mask != 0
    log_ratio = (target_logprobs.detach() - ref_logprobs)[in_ratio].mean()
    ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
    clipped_ratio = torch.clamp(ratio, lo, hi)
    return -torch.min(ratio * advantages, clipped_ratio * advantages).sum()


def sequence(seed: int, n: int, log_s: float, dtype=torch.float64):
    """A datum whose masked token log-ratios average ``log_s`` (so ``s = e^log_s``), spread around it; the
    prompt-like first positions unmasked with advantage 0, as the cookbook sends them."""
    g = torch.Generator().manual_seed(seed)
    q = -3 * torch.rand(n, generator=g, dtype=dtype)
    spread = torch.randn(n, generator=g, dtype=dtype)
    mask = torch.ones(n, dtype=dtype)
    mask[:2] = 0
    spread = (spread - spread[2:].mean()) * mask + (1 - mask) * 5.0  # (unmasked positions: far off, ignored)
    lp = (q + log_s + spread).requires_grad_(True)
    adv = torch.randn(n, generator=g, dtype=dtype) * mask
    return lp, {
        "target_tokens": torch.arange(n),
        "logprobs": q,
        "advantages": adv,
        "sequence_ratio_mask": mask,
    }


def grad(loss, lp):
    return torch.autograd.grad(loss, lp)[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("log_s", [-0.6, -0.1, 0.0, 0.1, 0.5])  # s below lo, inside, at 1, inside, above hi
def test_gspo_equals_the_docs_implementation(log_s, dtype):
    for seed in range(3):
        lp, inputs = sequence(seed, 9, log_s, dtype)
        ours, metrics = datum_loss("gspo", lp, inputs, {"clip_low_threshold": LO, "clip_high_threshold": HI})
        theirs = docs_gspo(lp, inputs["logprobs"], inputs["advantages"], inputs["sequence_ratio_mask"])
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
        torch.testing.assert_close(grad(ours, lp), grad(theirs, lp), rtol=1e-6, atol=1e-6)
        s = math.exp(log_s)
        counted = int((inputs["advantages"] != 0).sum())
        assert metrics["tokens:sum"].item() == counted
        assert metrics["clipped:sum"].item() == (counted if not LO <= s <= HI else 0)


def test_a_sequence_past_a_bound_in_its_advantages_direction_stops_as_a_whole():
    """``s > hi`` with ``A > 0`` (or ``s < lo`` with ``A < 0``): the clipped term is the min, constant — no
    token of the datum moves; the other way round every token keeps ``−s·A_t``."""
    for log_s, sign, frozen in [(0.5, 1, True), (0.5, -1, False), (-0.6, -1, True), (-0.6, 1, False)]:
        lp, inputs = sequence(7, 8, log_s)
        inputs["advantages"] = sign * inputs["advantages"].abs()
        loss, _ = datum_loss("gspo", lp, inputs, {})
        g = grad(loss, lp)
        if frozen:
            assert not g.any()
        else:
            torch.testing.assert_close(g, -math.exp(log_s) * inputs["advantages"])


def test_gspo_is_ppo_when_every_token_has_the_sequences_ratio():
    lp, inputs = sequence(3, 7, 0.0)
    q = lp.detach() - torch.tensor([0.3] * 7, dtype=torch.float64)  # every token ratio e^0.3 (above hi)
    inputs = {**inputs, "logprobs": q, "sequence_ratio_mask": torch.ones(7, dtype=torch.float64)}
    ppo_inputs = {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}
    for adv in (inputs["advantages"], -inputs["advantages"]):
        gspo, _ = datum_loss("gspo", lp, {**inputs, "advantages": adv}, {})
        ppo, _ = datum_loss("ppo", lp, {**ppo_inputs, "advantages": adv}, {})
        assert gspo.item() == pytest.approx(ppo.item(), rel=1e-12)
        torch.testing.assert_close(grad(gspo, lp), grad(ppo, lp))


@pytest.mark.parametrize("log_s", [-0.5, 0.05, 0.4])
def test_with_one_advantage_per_sequence_it_is_trls_gspo(log_s):
    """With ``A_t = A`` on the masked tokens (0 elsewhere) and the ratio against the sampler, Tinker's GSPO-token
    is TRL's GSPO (``importance_sampling_level="sequence"``, luspo's per-sequence sum) on one sequence: equal
    loss and gradient (the token form's ``∂s_t/∂lp_t = s`` sums, over the sequence, to the mean's)."""
    lp, inputs = sequence(11, 10, log_s)
    mask = inputs["sequence_ratio_mask"]
    for A in (1.3, -0.7):
        adv = A * mask
        tinker_loss, _ = datum_loss("gspo", lp, {**inputs, "advantages": adv}, {})
        trl_loss, _ = policy_loss(
            lp.unsqueeze(0),
            inputs["logprobs"].unsqueeze(0),
            torch.tensor([A], dtype=torch.float64),
            mask.unsqueeze(0),
            loss_type="luspo",
            importance_sampling_level="sequence",
            epsilon_low=1 - LO,
            epsilon_high=HI - 1,
        )
        assert tinker_loss.item() == pytest.approx(trl_loss.item(), rel=1e-12, abs=1e-12)
        torch.testing.assert_close(grad(tinker_loss, lp), grad(trl_loss, lp), rtol=1e-12, atol=1e-12)


def test_gspo_needs_its_mask_and_takes_ppos_thresholds():
    lp, inputs = sequence(1, 6, 0.1)
    without = {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"}
    with pytest.raises(LossInputError) as caught:
        validate("gspo", {"clip_low_threshold": 1.3, "beta": 0.1}, [without, inputs], [6, 5])
    message = str(caught.value)
    for fragment in (
        "datum 0: missing sequence_ratio_mask (gspo needs target_tokens, logprobs, advantages, sequence_ratio_mask)",
        "clip_low_threshold 1.3 is above clip_high_threshold 1.2",
        "loss_fn_config keys 'beta' are unknown to gspo",
        "datum 1: sequence_ratio_mask has shape [6], expected [5]",
    ):
        assert fragment in message, (fragment, message)
    assert CONFIG["gspo"] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert validate("gspo", {}, [inputs], [6]) == CONFIG["gspo"]
    empty = {**inputs, "sequence_ratio_mask": torch.zeros(6, dtype=torch.float64)}
    loss, _ = datum_loss("gspo", lp, empty, {})  # no marked token: s = 1, the loss is −Σ A_t
    assert loss.item() == pytest.approx(-float(inputs["advantages"].sum()))


@pytest.fixture
def served(llama_path, tmp_path):
    """A job served on this process (tests/served_job.py), as tests/service/test_service_sdk.py serves one."""
    pytest.importorskip("tinker")
    from served_job import Served

    s = Served(llama_path, max_tenants=3, checkpoints=tmp_path / "service")
    yield s
    s.close()


def test_the_sdks_forward_backward_with_gspo_is_the_formula_over_the_returned_logprobs(served, llama_path):
    """Through the official SDK: ``forward_backward(data, "gspo", config)`` answers ``loss:sum`` equal to the docs'
    lines over the logprobs it returns, and its clip counts."""
    import transformers
    from test_service_sdk import TEXTS, datums, training_client
    from tinker import types

    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    xs = [x for x, _, _ in datums(tok, TEXTS[:2])]
    ys = [y for _, y, _ in datums(tok, TEXTS[:2])]
    gen = torch.Generator().manual_seed(0)
    qs = [-torch.rand(len(x), generator=gen) * 6 for x in xs]
    advs = [torch.randn(len(x), generator=gen) for x in xs]
    masks = [(torch.arange(len(x)) >= 2).float() for x in xs]
    client, _ = training_client(served, seed=3)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(x),
            loss_fn_inputs={"target_tokens": y, "logprobs": q, "advantages": a, "sequence_ratio_mask": m},
        )
        for x, y, q, a, m in zip(xs, ys, qs, advs, masks)
    ]
    out = client.forward_backward(data, "gspo", config).result()
    lps = [o["logprobs"].to_torch() for o in out.loss_fn_outputs]
    want = sum(float(docs_gspo(lp, q, a, m, 0.9, 1.1)) for lp, q, a, m in zip(lps, qs, advs, masks))
    assert out.metrics["loss:sum"] == pytest.approx(want, abs=1e-5)
    assert out.metrics["tokens:sum"] == sum(int((a != 0).sum()) for a in advs)
