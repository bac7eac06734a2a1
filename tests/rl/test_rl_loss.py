"""mlora_lab.rl.grpo equals TRL 1.16.0's GRPO: the policy loss, its gradient and logged metrics are compared
with TRL's own ``GRPOTrainer._compute_loss`` (called on a stand-in trainer), the advantages with TRL's lines
replicated verbatim (``_generate_and_score_completions`` needs a model and a generator to run)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys
from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from mlora_lab.rl.grpo import LOSS_TYPES, advantages, combine_rewards, masked_means, nanstd, policy_loss

# TRL imports trackio when it is installed, and trackio fixes its store folder when it is imported: an
# in-process trackio mirror later in this worker (tests/trackers/test_trackers.py) is then, rightly, refused. TRL's
# loss code needs no tracker, so TRL is imported with trackio taken as absent.
_TRACKIO_BEFORE = "trackio" in sys.modules
with (
    mock.patch("transformers.integrations.is_trackio_available", return_value=False),
    mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
):
    trl = pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import nanstd as trl_nanstd

SAPO = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)  # GRPOConfig's defaults
VESPO = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)
TOL = 1e-6


def test_importing_trl_here_left_trackio_unimported():
    assert _TRACKIO_BEFORE or "trackio" not in sys.modules


def test_the_matched_trl_version_is_installed():
    assert trl.__version__ == "1.16.0", (
        "mlora_lab.rl.grpo cites TRL 1.16.0's lines; re-check it against the new one"
    )


class Accelerator:
    """One process of ``num_processes``: gather and reduce see only this process's values (identity)."""

    def __init__(self, num_processes: int) -> None:
        self.num_processes = num_processes

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


class StandIn:
    """The attributes of a ``GRPOTrainer`` that ``_compute_loss`` reads, with the policy's per-token log-probs
    handed out as a leaf tensor instead of a model forward."""

    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)  # TRL's own VESPO weights

    def __init__(
        self, logps, *, loss_type, epsilon_low, epsilon_high, beta, level, delta, bias_kl, ga, P, spg, L
    ):
        self.logps = logps
        self.entropies = torch.rand(
            logps.shape, dtype=logps.dtype, generator=torch.Generator().manual_seed(7)
        )
        self.loss_type, self.beta, self.importance_sampling_level = loss_type, beta, level
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.use_vllm = False
        self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = False
        self.args = SimpleNamespace(
            delta=delta, use_bias_correction_kl=bias_kl, steps_per_generation=spg, **SAPO, **VESPO
        )
        self.model = SimpleNamespace(training=True)
        self.current_gradient_accumulation_steps = ga
        self.accelerator = Accelerator(P)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.max_completion_length = L

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == self.logps.shape[1]
        return self.logps, self.entropies, None


def batch(seed: int, n: int = 6, T: int = 7, dtype=torch.float64):
    """Random log-probs whose ratios fall on both sides of both clip bounds, right-padded masks of uneven
    lengths (one completion fully masked, as ``mask_truncated_completions`` leaves it), advantages of both
    signs and some zeros."""
    g = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(n, T, generator=g, dtype=dtype)
    old = logps + 0.3 * torch.randn(n, T, generator=g, dtype=dtype)
    ref = logps + 0.5 * torch.randn(n, T, generator=g, dtype=dtype)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    lengths[-1] = 0
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = torch.randn(n, generator=g, dtype=dtype)
    adv[1] = 0.0
    return logps, old, ref, mask, adv


def trl_loss(logps, old, ref, mask, adv, *, num_items, **settings):
    """TRL's ``_compute_loss`` on these tensors: (loss, d loss / d logps, the metrics it logged)."""
    leaf = logps.clone().requires_grad_()
    trainer = StandIn(leaf, **settings)
    n, T = logps.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 3, dtype=torch.long),
        "prompt_mask": torch.ones(n, 3, dtype=torch.long),
        "completion_ids": torch.zeros(n, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "num_items_in_batch": torch.tensor(num_items),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if settings["beta"] != 0.0:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), leaf.grad, logged


def our_loss(logps, old, ref, mask, adv, **kwargs):
    leaf = logps.clone().requires_grad_()
    loss, totals = policy_loss(leaf, old, adv, mask, ref_logps=ref, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad, {k: float(v) for k, v in masked_means(totals).items()}


def compare(
    seed,
    *,
    loss_type,
    beta,
    with_old,
    level,
    delta=None,
    epsilon_low=0.2,
    epsilon_high=None,
    bias_kl=True,
    ga=1,
    P=1,
    spg=None,
    dtype=torch.float64,
):
    """TRL's loss on one of ``P`` processes, ``ga`` accumulation steps, is ``P`` times ours with the global
    counts of the module docstring (its DDP averages gradients over processes, ours are summed)."""
    spg = ga if spg is None else spg
    logps, old, ref, mask, adv = batch(seed, dtype=dtype)
    old = old if with_old else None
    L = logps.shape[1] + 3
    num_items = int(mask.sum()) * P * spg + 5  # the generation batch's completion tokens, all processes
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    theirs, their_grad, logged = trl_loss(
        logps,
        old,
        ref,
        mask,
        adv,
        num_items=num_items,
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=eps_high,
        beta=beta,
        level=level,
        delta=delta,
        bias_kl=bias_kl,
        ga=ga,
        P=P,
        spg=spg,
        L=L,
    )
    ours, our_grad, metrics = our_loss(
        logps,
        old,
        ref,
        mask,
        adv,
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=beta,
        delta=delta,
        importance_sampling_level=level,
        use_bias_correction_kl=bias_kl,
        max_completion_length=L,
        num_micro_batches=P * ga,
        num_tokens=num_items * ga / spg,
        **SAPO,
        **VESPO,
    )
    assert torch.isfinite(theirs)
    assert abs(float(P * ours) - float(theirs)) <= TOL, (float(P * ours), float(theirs))
    assert their_grad.abs().sum() > 0, "a batch that moves nothing compares nothing"
    torch.testing.assert_close(P * our_grad, their_grad, atol=TOL, rtol=0)
    compared = {
        k: logged[k] for k in logged if k not in ("entropy", "clip_ratio/low_min", "clip_ratio/high_max")
    }
    assert set(metrics) == set(compared)
    for name, value in compared.items():
        assert abs(metrics[name] - value) <= TOL, (name, metrics[name], value)
    return metrics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_gradient_and_metrics_equal_trls_compute_loss(loss_type):
    """Every loss type, with and without the KL term, with old log-probs given (several updates per
    generation) or not (ratio 1), at token and sequence importance-sampling level."""
    seen_clipping = set()
    for seed, (beta, with_old, level) in enumerate(
        itertools.product((0.0, 0.04), (True, False), ("token", "sequence"))
    ):
        metrics = compare(seed, loss_type=loss_type, beta=beta, with_old=with_old, level=level)
        seen_clipping |= {k for k, v in metrics.items() if v > 0}
        assert ("kl" in metrics) == (beta != 0)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert {"clip_ratio/low_mean", "clip_ratio/high_mean"} <= seen_clipping, "the batches never clip"


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize(("ga", "P", "spg"), [(3, 1, 3), (2, 2, 2), (2, 3, 4)])
def test_the_normalisers_over_accumulation_and_processes_equal_trls(loss_type, ga, P, spg):
    compare(11, loss_type=loss_type, beta=0.04, with_old=True, level="token", ga=ga, P=P, spg=spg)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo", "luspo"])
def test_asymmetric_epsilon_delta_and_plain_kl_equal_trls(loss_type):
    compare(21, loss_type=loss_type, beta=0.1, with_old=True, level="token", epsilon_high=0.28, delta=1.1)
    compare(22, loss_type=loss_type, beta=0.1, with_old=True, level="sequence", delta=1.05, bias_kl=False)


def test_cispo_clips_at_epsilon_high_as_trl():
    metrics = compare(31, loss_type="cispo", beta=0.0, with_old=True, level="token", epsilon_high=1.1)
    assert metrics["cispo_clip_ratio"] > 0
    compare(32, loss_type="cispo", beta=0.04, with_old=True, level="token", epsilon_high=5.0, bias_kl=False)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo"])
def test_float32_equals_trl(loss_type):
    compare(41, loss_type=loss_type, beta=0.04, with_old=True, level="token", dtype=torch.float32)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"])
def test_micro_batches_of_uneven_size_sum_to_the_whole_batch(loss_type):
    """With the global counts, the losses (and so the gradients) of a batch cut into uneven pieces — a
    tenant's rows over processes and accumulation steps — add up to the loss of the whole batch."""
    logps, old, ref, mask, adv = batch(51, n=8)
    kw = dict(loss_type=loss_type, beta=0.04, ref_logps=ref, max_completion_length=9)
    whole = policy_loss(logps, old, adv, mask, **kw)[0]
    pieces = [slice(0, 5), slice(5, 6), slice(6, 8)]
    counts = dict(num_sequences=8, num_tokens=int(mask.sum()), num_micro_batches=len(pieces))
    parts = [
        policy_loss(logps[s], old[s], adv[s], mask[s], **{**kw, "ref_logps": ref[s]}, **counts)
        for s in pieces
    ]
    assert abs(float(sum(p[0] for p in parts)) - float(whole)) <= 1e-12
    summed = {k: sum(p[1][k] for p in parts) for k in parts[0][1]}
    whole_means = masked_means(policy_loss(logps, old, adv, mask, **kw)[1])
    for name, mean in masked_means(summed).items():
        assert abs(float(mean) - float(whole_means[name])) <= 1e-12, name


def trl_advantages(rewards_per_func, reward_weights, num_generations, scale_rewards):
    """TRL 1.16.0 ``GRPOTrainer._generate_and_score_completions``, trl/trainer/grpo_trainer.py lines 2759-2810
    and 2826-2830 (``multi_objective_aggregation="sum_then_normalize"``, one process), verbatim but for
    ``self.`` and the device."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = trl_nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        if rewards.numel() > 1:
            std_rewards = trl_nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    stats = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": trl_nanstd(rewards).item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
    }
    return advantages, stats


def reward_table(seed: int, G: int = 4, B: int = 5) -> torch.Tensor:
    """Two reward functions over ``B`` groups of ``G``: NaN where a function returned None; group 1 scores every
    completion the same, group 2 has one scorable completion, group 3 none."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B * G, 2, generator=g)
    r[torch.rand(B * G, 2, generator=g) < 0.2] = torch.nan
    r[G : 2 * G] = torch.tensor([1.0, 0.5])
    r[2 * G : 3 * G] = torch.nan
    r[2 * G, 1] = 0.7
    r[3 * G : 4 * G] = torch.nan
    return r


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("weights", [[1.0, 1.0], [0.3, -2.0]])
def test_advantages_equal_trls_lines(scale_rewards, weights):
    for seed in range(3):
        per_function = reward_table(seed)
        expected, expected_stats = trl_advantages(per_function, torch.tensor(weights), 4, scale_rewards)
        adv, stats = advantages(combine_rewards(per_function, weights), 4, scale_rewards)
        torch.testing.assert_close(adv, expected, atol=TOL, rtol=0)
        for name, value in expected_stats.items():
            assert abs(float(getattr(stats, name)) - value) <= TOL, name
        assert torch.all(adv[2 * 4 : 4 * 4] == 0), (
            "groups with fewer than two scorable completions learn nothing"
        )
        if scale_rewards != "batch":  # group 1 scored every completion the same
            assert stats.frac_reward_zero_std > 0


def test_nanstd_equals_trls():
    x = torch.randn(6, 5)
    x[x > 1.0] = torch.nan
    x[0, :4] = torch.nan  # one value: NaN
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1), equal_nan=True)
    torch.testing.assert_close(nanstd(x), trl_nanstd(x), equal_nan=True)


def test_trl_defaults_are_ours():
    """Our defaults are GRPOConfig's (dapo, ε 0.2, ε_high = ε, β 0, group scaling, token level, …), and the
    SAPO/VESPO settings the comparisons pass are its defaults too."""
    config = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    ours = {p.name: p.default for p in inspect.signature(policy_loss).parameters.values()}
    same_name = ["loss_type", "beta", "delta", "importance_sampling_level", "use_bias_correction_kl"]
    same_name += [*SAPO, *VESPO]
    assert {k: ours[k] for k in same_name} == {k: config[k] for k in same_name}
    assert (ours["epsilon_low"], ours["epsilon_high"]) == (config["epsilon"], config["epsilon_high"])
    assert (config["loss_type"], config["epsilon"], config["epsilon_high"]) == ("dapo", 0.2, None)
    assert {k: config[k] for k in [*SAPO, *VESPO]} == {**SAPO, **VESPO}
    assert inspect.signature(advantages).parameters["scale_rewards"].default == config["scale_rewards"]
    logps, old, _, mask, adv = batch(61)
    default = policy_loss(logps, old, adv, mask)[0]
    explicit = policy_loss(logps, old, adv, mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2)[0]
    assert float(default) == float(explicit), "epsilon_high=None is epsilon_low"


def test_bad_policy_loss_arguments_get_one_error_naming_each():
    logps, old, _, mask, adv = batch(71)
    with pytest.raises(ValueError) as e:
        policy_loss(
            logps, old[:, :3], adv[:4], mask, loss_type="ppo", importance_sampling_level="word", beta=0.1
        )
    text = str(e.value)
    for part in (
        "unknown loss_type 'ppo'",
        "importance_sampling_level 'word'",
        "old_logps has shape (6, 3)",
        "advantages has shape (4,)",
        "needs ref_logps",
    ):
        assert part in text, (part, text)
    with pytest.raises(ValueError) as e:
        policy_loss(
            logps, old, adv, mask, loss_type="dr_grpo", num_micro_batches=0, delta=0.0, epsilon_low=-1
        )
    text = str(e.value)
    for part in ("max_completion_length", "num_micro_batches", "delta must be > 0", "epsilon_low"):
        assert part in text, (part, text)
    with pytest.raises(ValueError, match="pass num_tokens"):
        policy_loss(logps, old, adv, mask, loss_type="dapo", num_micro_batches=2)
    with pytest.raises(ValueError, match="delta caps the ratio"):
        policy_loss(logps, old, adv, mask, loss_type="cispo", delta=2.0)


def test_bad_advantage_arguments_get_one_error_naming_each():
    with pytest.raises(ValueError) as e:
        advantages(torch.randn(7), 1, "tenant")
    text = str(e.value)
    assert "group_size must be at least 2" in text and "unknown scale_rewards 'tenant'" in text, text
    with pytest.raises(ValueError, match="7 rewards do not split into groups of 2"):
        advantages(torch.randn(7), 2)
    with pytest.raises(ValueError) as e:
        advantages(torch.randn(2, 4), 4.0)
    assert "group_size must be an integer" in str(e.value) and "must be 1-D" in str(e.value)
    with pytest.raises(ValueError, match="3 weights for 2 reward functions"):
        combine_rewards(torch.randn(4, 2), [1.0, 1.0, 1.0])
