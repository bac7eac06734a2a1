"""Multi-turn trajectories (mlora_lab.rl.trajectory): on a fixed trajectory, the model mask, the positions of the
model's tokens in the loop's per-token losses, the importance ratio against the sampler's log-probs and GRPO's
loss equal a hand computation; the environment's tokens get exactly zero gradient; a cut keeps masks and
log-probs aligned and says so."""

from __future__ import annotations

import math

import pytest
import torch

from mlora_lab.data import IGNORE_INDEX
from mlora_lab.rl.grpo import policy_loss
from mlora_lab.rl.trajectory import ENV, MODEL, Segment, Trajectory, example_of, gather, model_positions

# prompt (env) | the model's first turn | a tool result (env) | the model's second turn
FIXED = Trajectory(
    [
        Segment(ENV, (5, 6, 7)),
        Segment(MODEL, (8, 9), (-0.5, -1.0)),
        Segment(ENV, (10, 11)),
        Segment(MODEL, (12,), (-0.25,)),
    ],
    reward=1.0,
    example=0,
)


def test_the_masks_and_positions_of_a_fixed_trajectory():
    assert FIXED.tokens == [5, 6, 7, 8, 9, 10, 11, 12]
    assert FIXED.model_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert FIXED.old_logps == [-0.5, -1.0, -0.25]
    assert model_positions(FIXED) == [2, 3, 6]  # ℓ[:, q - 1] is the log-prob of token q
    ex = example_of(FIXED)
    assert ex.labels == [IGNORE_INDEX] * 3 + [8, 9] + [IGNORE_INDEX] * 2 + [12]


def test_the_ratio_and_the_loss_against_a_hand_computation():
    """ℓ at the model's positions, the ratio r = exp(logp − λ) against the sampler's λ, and dapo's loss
    −Σ min(r·A, clip(r, 1 ± ε)·A) / N_tok with one trajectory of advantage A."""
    token_loss = torch.tensor([[0.1, 0.2, 0.4, 0.9, 3.0, 4.0, 0.2]])  # (−log-probs of tokens 1..7)
    logps, old, mask = gather(token_loss, [FIXED])
    assert logps[0].tolist() == pytest.approx([-0.4, -0.9, -0.2])
    assert old[0].tolist() == [-0.5, -1.0, -0.25] and mask.tolist() == [[True, True, True]]
    ratio = [math.exp(a - b) for a, b in zip([-0.4, -0.9, -0.2], [-0.5, -1.0, -0.25], strict=True)]
    A, eps = 0.5, 0.05
    want = -sum(min(r * A, min(max(r, 1 - eps), 1 + eps) * A) for r in ratio) / 3
    loss, _ = policy_loss(logps, old, torch.tensor([A]), mask, loss_type="dapo", epsilon_low=eps)
    assert float(loss) == pytest.approx(want, rel=1e-6)


def test_the_environments_tokens_get_zero_gradient():
    """Through a real forward: the gradient of GRPO's loss reaches the logits that predict the model's tokens
    and no other (not those of the prompt, nor of the tool result)."""
    torch.manual_seed(0)
    x = torch.tensor([FIXED.tokens])
    logits = torch.randn(1, len(FIXED.tokens), 16, requires_grad=True)
    token_loss = -torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    logps, old, mask = gather(token_loss, [FIXED])
    loss, _ = policy_loss(logps, old, torch.tensor([1.0]), mask, loss_type="grpo")
    loss.backward()
    per_position = logits.grad.abs().sum(-1)[0]
    trained = set(model_positions(FIXED))
    for p in range(len(FIXED.tokens)):
        assert (per_position[p] > 0) == (p in trained), p


def test_a_cut_keeps_masks_and_logprobs_aligned_and_says_so():
    cut = FIXED.cut(5)
    assert cut.truncated and cut.tokens == [5, 6, 7, 8, 9] and cut.old_logps == [-0.5, -1.0]
    assert model_positions(cut) == [2, 3] and FIXED.cut(8) is FIXED
    mid = FIXED.cut(4)
    assert mid.tokens == [5, 6, 7, 8] and mid.old_logps == [-0.5] and mid.reward == 1.0


def test_a_model_token_with_no_context_is_not_scored_and_its_logprob_dropped():
    t = Trajectory([Segment(MODEL, (3, 4), (-0.7, -0.1)), Segment(ENV, (5,))])
    assert model_positions(t) == [0]
    logps, old, mask = gather(torch.tensor([[0.3, 0.6]]), [t])
    assert logps[0].tolist() == pytest.approx([-0.3]) and old[0].tolist() == pytest.approx([-0.1])
    assert mask.tolist() == [[True]]


def test_trajectories_of_different_lengths_are_padded_and_masked():
    short = Trajectory([Segment(ENV, (1,)), Segment(MODEL, (2,), (-0.1,))])
    token_loss = torch.zeros(2, 7)
    logps, old, mask = gather(token_loss, [FIXED, short])
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    assert logps.abs().sum() == 0 and logps.shape == (2, 3)  # (zero losses: log-probs 0; padding masked to 0)
    assert old.flatten().tolist() == pytest.approx([-0.5, -1.0, -0.25, -0.1, 0.0, 0.0])


def test_a_bad_segment_is_refused_naming_why():
    with pytest.raises(ValueError, match="needs as many sampler log-probs, got 1"):
        Segment(MODEL, (1, 2), (-0.1,))
    with pytest.raises(ValueError, match="an environment segment has no log-probs"):
        Segment(ENV, (1,), (-0.1,))
    with pytest.raises(ValueError, match="'model' or 'env', not 'tool'"):
        Segment("tool", (1,))
