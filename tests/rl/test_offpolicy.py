"""Off-policy correction (issue 52) equals TRL 1.16.0's: the sampling importance ratio in its four modes, its
clip bounds, the off-policy sequence mask, and where they enter the loss, compared on fixed tensors with TRL's
own code — ``_compute_loss``, ``get_off_policy_mask`` and ``get_gamma_weights`` called on a stand-in trainer,
and the ratio and its metrics run from the lines of ``_generate_and_score_completions`` that compute them
(that method needs a model and vLLM to run whole; its source is read, and those lines executed as they are)."""

from __future__ import annotations

import inspect
import itertools
import math
import textwrap
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_rl_loss import SAPO, VESPO, GRPOTrainer, StandIn, batch

from mlora_lab.rl.grpo import (
    CLIPPED,
    IS_MODES,
    LOSS_TYPES,
    MAX_METRICS,
    MIN_METRICS,
    combine_metrics,
    masked_means,
    off_policy_mask,
    policy_loss,
    sampling_is_ratio,
)

TOL = 1e-6
# (clip_min, clip_max): GRPOConfig's default, both bounds, a floor alone, none (the mask modes only)
CLIPS = [(None, 3.0), (0.5, 2.0), (0.8, None), (None, None)]


def _trl_lines(anchor: str, end: str) -> str:
    """The ``if self.use_vllm and self.vllm_importance_sampling_correction:`` block of
    ``_generate_and_score_completions`` that holds ``anchor``, up to the line holding ``end``, dedented."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    at = source.index(anchor)
    start = source.rindex("if self.use_vllm and self.vllm_importance_sampling_correction:", 0, at)
    start = source.rindex("\n", 0, start) + 1
    stop = source.rindex("\n", 0, source.index(end, at)) + 1
    return textwrap.dedent(source[start:stop])


RATIO_LINES = compile(
    _trl_lines(
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
        "# Compute the per-token log probabilities for the reference model",
    ),
    "trl:vllm_importance_sampling_ratio",
    "exec",
)
METRIC_LINES = compile(
    _trl_lines("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {"),
    "trl:importance_sampling_metrics",
    "exec",
)


def trl_ratio(old, sampler, mask, mode, clip_min, clip_max) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's ``vllm_importance_sampling_ratio`` and the metrics it logs of it, from its own lines."""
    from trl.trainer.utils import nanmax, nanmin

    trainer = SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
        accelerator=SimpleNamespace(gather=lambda x: x),  # one process
        _metrics={"train": defaultdict(list)},
    )
    scope = {
        "self": trainer,
        "torch": torch,
        "math": math,
        "nanmin": nanmin,
        "nanmax": nanmax,
        "completion_mask": mask,
        "tool_mask": None,
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampler,
        "mode": "train",
        "device": old.device,
    }
    exec(RATIO_LINES, scope)
    exec(METRIC_LINES, scope)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return scope["vllm_importance_sampling_ratio"], logged


def sampler_of(seed: int, old: torch.Tensor, scale: float = 0.4, nan: bool = True) -> torch.Tensor:
    """A sampler's log-probs near ``old`` (ratios on both sides of the clip bounds), NaN on two tokens (one of
    them masked) when ``nan``: tokens the sampler could not score."""
    g = torch.Generator().manual_seed(1000 + seed)
    sampler = old + scale * torch.randn(old.shape, generator=g, dtype=old.dtype)
    if nan:
        sampler[0, 0] = torch.nan
        sampler[2, -1] = torch.nan
    return sampler


def test_trls_lines_were_found_and_compute_what_they_should():
    """The source slices are the ratio and its metrics (a TRL that moved them fails here, not silently)."""
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in _trl_lines(
        "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
        "# Compute the per-token",
    )
    _, old, _, mask, _ = batch(0)
    ratio, logged = trl_ratio(old, sampler_of(0, old), mask, "token_truncate", None, 3.0)
    assert ratio.shape == old.shape and set(logged) == {
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
    }


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max"),
    # (GRPOConfig refuses a truncation with no bound, and so does ours: see the validation tests)
    [(m, lo, hi) for m in IS_MODES for lo, hi in CLIPS if m.endswith("_mask") or (lo, hi) != (None, None)],
)
def test_the_sampling_ratio_and_its_metrics_equal_trls(mode, clip_min, clip_max):
    moved = bounded = False
    bounds = [b for b in (clip_min, clip_max) if b is not None]
    for seed in range(4):
        _, old, _, mask, _ = batch(seed)
        sampler = sampler_of(seed, old, scale=0.5)
        theirs, logged = trl_ratio(old, sampler, mask, mode, clip_min, clip_max)
        ours = sampling_is_ratio(old, sampler, mask, mode, clip_min, clip_max)
        assert ours.shape == ((6, 1) if mode.startswith("sequence") else (6, 7))
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
        _, metrics = policy_loss(
            old.clone().requires_grad_(),
            old,
            torch.randn(6, dtype=old.dtype),
            mask,
            sampler_logps=sampler,
            importance_sampling_correction=True,
            importance_sampling_mode=mode,
            importance_sampling_clip_min=clip_min,
            importance_sampling_clip_max=clip_max,
        )
        values = {k: float(v) for k, v in masked_means(metrics).items() if k.startswith("sampling/")}
        assert set(values) == set(logged)
        for name, value in logged.items():
            assert abs(values[name] - value) <= TOL, (name, values[name], value)
        kept = ours[mask.bool()] if ours.shape[1] > 1 else ours
        moved |= bool(((kept != 1) & (kept != 0)).any())
        bounded |= any(bool((kept == b).any()) for b in [0.0, *bounds])
    assert moved, "the batches never moved the ratio off 1"
    assert bounded or not bounds, "the batches never reached a bound"


class VLLMStandIn(StandIn):
    """A ``GRPOTrainer`` with ``use_vllm=True``: its sampling correction and off-policy mask as configured."""

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)  # TRL's own OPSM

    def __init__(self, logps, *, correction, threshold, **settings):
        super().__init__(logps, **settings)
        self.use_vllm = True
        self.vllm_importance_sampling_correction = correction
        self.off_policy_mask_threshold = threshold


def compare(
    seed,
    *,
    loss_type,
    level,
    mode,
    clip_min=None,
    clip_max=3.0,
    correction=True,
    threshold=None,
    with_old=True,
    beta=0.04,
):
    """TRL's ``_compute_loss`` (one process, one accumulation step) and ours on the same tensors: the loss, its
    gradient and every metric TRL logs for it (the ratio's from its generation lines)."""
    logps, old, ref, mask, adv = batch(seed)
    sampler = sampler_of(seed, old if with_old else logps, scale=0.3 if mode.startswith("sequence") else 0.5)
    trl_old = old if with_old else logps.clone()  # (TRL with vLLM always computes ℓ_old: the same values)
    n, T = logps.shape
    num_items = int(mask.sum()) + 5
    L = T + 3
    leaf = logps.clone().requires_grad_()
    trainer = VLLMStandIn(
        leaf,
        correction=correction,
        threshold=threshold,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=beta,
        level=level,
        delta=None,
        bias_kl=True,
        ga=1,
        P=1,
        spg=1,
        L=L,
    )
    inputs = {
        "prompt_ids": torch.zeros(n, 3, dtype=torch.long),
        "prompt_mask": torch.ones(n, 3, dtype=torch.long),
        "completion_ids": torch.zeros(n, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "num_items_in_batch": torch.tensor(num_items),
        "old_per_token_logps": trl_old,
        "sampling_per_token_logps": sampler,
        "ref_per_token_logps": ref,
    }
    generation_logged = {}
    if correction:
        inputs["importance_sampling_ratio"], generation_logged = trl_ratio(
            trl_old, sampler, mask, mode, clip_min, clip_max
        )
    theirs = GRPOTrainer._compute_loss(trainer, None, inputs)
    theirs.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()} | generation_logged

    mine = logps.clone().requires_grad_()
    ours, totals = policy_loss(
        mine,
        old if with_old else None,
        adv,
        mask,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        beta=beta,
        ref_logps=ref,
        importance_sampling_level=level,
        max_completion_length=L,
        num_tokens=num_items,
        sampler_logps=sampler,
        importance_sampling_correction=correction,
        importance_sampling_mode=mode,
        importance_sampling_clip_min=clip_min,
        importance_sampling_clip_max=clip_max,
        off_policy_mask_threshold=threshold,
        **SAPO,
        **VESPO,
    )
    ours.backward()
    assert torch.isfinite(theirs)
    ours, theirs = ours.detach(), theirs.detach()
    assert abs(float(ours) - float(theirs)) <= TOL, (float(ours), float(theirs))
    assert leaf.grad.abs().sum() > 0, "a batch that moves nothing compares nothing"
    torch.testing.assert_close(mine.grad, leaf.grad, atol=TOL, rtol=0)
    metrics = {k: float(v) for k, v in masked_means(totals).items()}
    compared = {
        k: v for k, v in logged.items() if k not in ("entropy", "clip_ratio/low_min", "clip_ratio/high_max")
    }
    assert set(metrics) == set(compared)
    for name, value in compared.items():
        assert abs(metrics[name] - value) <= TOL, (name, metrics[name], value)
    return metrics, leaf.grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_corrected_loss_gradient_and_metrics_equal_trls(loss_type):
    """Every loss type × every mode (vespo: the token modes, as TRL requires) × both importance-sampling
    levels × OPSM on and off, with ℓ_old given (a later update) or not (the first), clip bounds varied."""
    modes = [m for m in IS_MODES if loss_type != "vespo" or m.startswith("token_")]
    cases = itertools.product(modes, ("token", "sequence"), (None, 0.05), (True, False))
    for seed, (mode, level, threshold, with_old) in enumerate(cases):
        clip_min, clip_max = CLIPS[seed % 3]
        compare(
            seed,
            loss_type=loss_type,
            level=level,
            mode=mode,
            clip_min=clip_min,
            clip_max=clip_max,
            threshold=threshold,
            with_old=with_old,
        )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
def test_the_off_policy_mask_alone_equals_trls(loss_type):
    """OPSM without the sampling correction: against the sampler's log-probs (TRL's, with vLLM), and it drops
    something here (negative advantages, drifted sequences)."""
    dropped = 0
    for seed in range(6):
        compare(seed, loss_type=loss_type, level="token", mode="token_mask", correction=False, threshold=0.01)
        logps, old, _, mask, adv = batch(seed)
        sampler = sampler_of(seed, old, scale=0.5)
        ours = off_policy_mask(adv, logps, sampler, mask, 0.01)
        theirs = GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), logps, sampler, mask, 0.01)
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
        dropped += int((ours == 0).sum())
    assert dropped > 0


def test_vespos_gamma_weights_take_the_ratio_as_trls():
    from mlora_lab.rl.grpo import gamma_weights

    for mode in ("token_truncate", "token_mask", "sequence_mask"):
        logps, old, _, mask, adv = batch(5)
        ratio = sampling_is_ratio(old, sampler_of(5, old), mask, mode, 0.5, 2.0)
        theirs = GRPOTrainer.get_gamma_weights(adv.unsqueeze(1), logps - old, mask, ratio, **_vespo_args())
        ours = gamma_weights(adv.unsqueeze(1), logps - old, mask, *_vespo_args().values(), ratio)
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def _vespo_args() -> dict[str, float]:
    return {"k_pos": VESPO["vespo_k_pos"], "lambda_pos": VESPO["vespo_lambda_pos"],
            "k_neg": VESPO["vespo_k_neg"], "lambda_neg": VESPO["vespo_lambda_neg"]}  # fmt: skip


def test_micro_batches_combine_to_the_whole_generations_metrics():
    """The five sampling metrics of two micro-batches, combined (sums added, extremes min/max'd), equal the
    whole batch's: how the driver gathers a window's rows over micro-batches and processes."""
    logps, old, _, mask, adv = batch(9)
    sampler = sampler_of(9, old)
    mask[1] = 0  # a micro-batch with a fully masked row, and the other with one sequence only
    settings = dict(
        sampler_logps=None, importance_sampling_correction=True, importance_sampling_mode="token_mask"
    )
    for mode in ("token_mask", "sequence_truncate"):
        settings["importance_sampling_mode"] = mode
        whole = policy_loss(logps, old, adv, mask, **(settings | {"sampler_logps": sampler}))[1]
        parts = [
            policy_loss(
                logps[rows], old[rows], adv[rows], mask[rows], **(settings | {"sampler_logps": sampler[rows]})
            )[1]
            for rows in (slice(0, 5), slice(5, 6))
        ]
        combined = combine_metrics(*parts)
        for name in whole:
            torch.testing.assert_close(combined[name], whole[name], atol=1e-12, rtol=0)
        assert set(MIN_METRICS) | set(MAX_METRICS) <= set(combined)


def test_empty_extremes_read_as_trls_zero():
    """A micro-batch with no masked token counts nothing: its extremes are ±inf, read as 0 (TRL's value)."""
    logps, old, _, mask, adv = batch(3)
    mask = torch.zeros_like(mask)
    _, totals = policy_loss(
        logps, old, adv, mask, sampler_logps=old - 0.1, importance_sampling_correction=True,
        importance_sampling_mode="token_truncate",
    )  # fmt: skip
    assert math.isinf(float(totals["sampling/importance_sampling_ratio/min"][0]))
    values = masked_means(totals)
    assert {k: float(v) for k, v in values.items() if k.startswith("sampling/")} == dict.fromkeys(
        [k for k in values if k.startswith("sampling/")], 0.0
    )


def test_bad_correction_settings_get_one_error_naming_each():
    logps, old, _, mask, adv = batch(1)
    with pytest.raises(ValueError) as caught:
        policy_loss(
            logps,
            old,
            adv,
            mask,
            loss_type="vespo",
            importance_sampling_correction=True,
            importance_sampling_mode="sequence_mask",
            importance_sampling_clip_min=2.0,
            importance_sampling_clip_max=1.0,
            off_policy_mask_threshold=math.nan,
        )
    message = str(caught.value)
    for part in (
        "importance_sampling_correction needs sampler_logps",
        "importance_sampling_clip_min (2.0) must be below importance_sampling_clip_max (1.0)",
        "vespo takes the sampling ratio per token",
        "off_policy_mask_threshold must be a finite number",
    ):
        assert part in message, (part, message)
    with pytest.raises(ValueError, match="truncates the ratio: give a clip_min or a clip_max"):
        sampling_is_ratio(old, old, mask, "token_truncate", None, None)
    with pytest.raises(ValueError, match="unknown importance_sampling_mode 'tis'"):
        sampling_is_ratio(old, old, mask, "tis", None, 3.0)


def test_a_correction_that_changes_nothing_is_todays_loss():
    """Sampler = trainer (this project's default sampler, no top-k): every ratio is 1, the loss is today's."""
    for loss_type in sorted(set(CLIPPED) | {"cispo", "sapo"}):
        logps, old, _, mask, adv = batch(4)
        plain = policy_loss(logps, old, adv, mask, loss_type=loss_type, max_completion_length=10)[0]
        corrected = policy_loss(
            logps,
            old,
            adv,
            mask,
            loss_type=loss_type,
            max_completion_length=10,
            sampler_logps=old,
            importance_sampling_correction=True,
        )[0]
        assert float(plain) == float(corrected)


def test_a_job_trains_gspo_and_corrected_tenants_and_logs_trls_sampling_metrics(llama_path, tmp_path):
    """One job: a GSPO tenant (sequence-level ratio, μ = 2) with the correction at TRL's default mode, a tenant
    whose sampler cuts its distribution (``top_k``: the sampler's probabilities are renormalised over 3
    tokens, the trainer's are not) with the token-level truncated correction and the off-policy mask, and one
    whose sampler is the trainer (every ratio 1 but for numerics). Each trains, and its train rows carry TRL's
    five sampling metrics, finite; the ``top_k`` tenant's differ from 1, the plain one's do not."""
    from test_rl_driver import job, prompt_file, reward_file, rl_tenant

    from mlora_lab.job.trainer import Trainer
    from mlora_lab.rundir import Row
    from mlora_lab.spec.parts import RL

    rewards, data = reward_file(tmp_path), prompt_file(tmp_path)
    common = dict(
        reward=f"{rewards}:short", group_size=2, max_new_tokens=4, importance_sampling_correction=True
    )
    tenants = [
        rl_tenant(
            "gspo",
            data,
            RL(**common, loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),
        ),
        rl_tenant(
            "topk",
            data,
            RL(**common, top_k=3, importance_sampling_mode="token_truncate", off_policy_mask_threshold=0.5),
        ),
        rl_tenant("plain", data, RL(**common, importance_sampling_mode="token_mask")),
    ]
    tenants = [replace(t, max_steps=2) for t in tenants]
    trainer = Trainer(job(llama_path, tenants))
    trainer.train()
    rows = [Row.from_dict(r) for r in trainer.recorder.history]
    names = [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
    names += [f"sampling/sampling_logp_difference/{s}" for s in ("mean", "max")]
    seen = {}
    for t in tenants:
        train = [r for r in rows if r.kind == "train" and r.tenant == t.name]
        assert len(train) == 2 and all(math.isfinite(r.loss) for r in train), t.name
        for r in train:
            assert set(names) <= set(r.extra), (t.name, r.extra)
            assert all(math.isfinite(r.extra[k]) for k in names), (t.name, r.extra)
        seen[t.name] = train[0].extra
    top = seen["topk"]
    # (top-k renormalises: the sampler's log-probs are above the trainer's, every ratio below 1)
    assert top["sampling/sampling_logp_difference/mean"] > 1e-2
    assert (
        top["sampling/importance_sampling_ratio/min"] < 0.99
        and top["sampling/importance_sampling_ratio/max"] <= 1
    )
    plain = seen["plain"]
    assert plain["sampling/sampling_logp_difference/max"] < 1e-3
    assert abs(plain["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
    assert math.isfinite(seen["gspo"]["sampling/importance_sampling_ratio/mean"])


def test_validation_names_every_bad_importance_sampling_setting(tmp_path, llama_path):
    from test_rl_driver import prompt_file, reward_file

    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.parts import RL
    from mlora_lab.spec.tenant import Tenant
    from mlora_lab.validate import problems

    rewards, data = reward_file(tmp_path), prompt_file(tmp_path)
    bad = {
        "luspo": RL(reward=f"{rewards}:short", max_new_tokens=8, loss_type="luspo"),  # at token level
        "dapo": RL(
            reward=f"{rewards}:short", max_new_tokens=8, importance_sampling_level="sequence"
        ),  # (dapo: the default)
        "bounds": RL(
            reward=f"{rewards}:short",
            max_new_tokens=8,
            importance_sampling_correction=True,
            importance_sampling_clip_min=2.0,
            importance_sampling_clip_max=1.5,
        ),
        "unbounded": RL(
            reward=f"{rewards}:short",
            max_new_tokens=8,
            importance_sampling_correction=True,
            importance_sampling_mode="sequence_truncate",
            importance_sampling_clip_max=None,
        ),
        "fields": RL(
            reward=f"{rewards}:short",
            max_new_tokens=8,
            importance_sampling_level="tokens",
            importance_sampling_mode="tis",
            off_policy_mask_threshold=0.0,
            importance_sampling_clip_max=-1.0,
        ),
    }
    tenants = [Tenant(name=n, data=data, rl=rl) for n, rl in bad.items()]
    tenants.append(Tenant(name="good", data=data, rl=RL(reward=f"{rewards}:short", max_new_tokens=8, loss_type="grpo",
                                                         importance_sampling_level="sequence",
                                                         importance_sampling_correction=True)))  # fmt: skip
    found = [str(p) for p in problems(JobSpec(base_model=llama_path, seq_len=64, tenants=tenants))]
    text = "\n".join(found)
    for tenant, expected in [
        ("luspo", "set rl.importance_sampling_level='sequence'"),
        ("dapo", "rl.loss_type='dapo' sums per-token terms"),
        ("bounds", "rl.importance_sampling_clip_min=2.0 must be below rl.importance_sampling_clip_max=1.5"),
        ("unbounded", "rl.importance_sampling_mode='sequence_truncate' clips the sampling ratio"),
        ("fields", "rl.importance_sampling_level must be one of token, sequence (got 'tokens')"),
        ("fields", "rl.importance_sampling_mode must be one of"),
        ("fields", "rl.off_policy_mask_threshold must be in (0, 1000] (or null for no off-policy mask)"),
        ("fields", "rl.importance_sampling_clip_max must be in (0, 1000] (or null for no upper bound)"),
    ]:
        assert any(tenant in p and expected in p for p in found), (tenant, expected, found)
    assert not [p for p in found if "good" in p], text
