"""Multi-turn trajectories trained token-exactly: an agent's turns as the tokens the sampler drew and the tokens its
environment added, and what GRPO trains on them.

A trajectory is a sequence of **segments**, each the model's or the environment's::

    x = [p_1 … p_a] [m_1 … m_b] [e_1 … e_c] [m_{b+1} … m_d] …        (tokens, in order)
         env         model        env          model
    μ = [0 … 0]     [1 … 1]      [0 … 0]      [1 … 1]    …           (model mask)
    ℓ^old = [· · ·]  [λ_1 … λ_b] [· · ·]      [λ_{b+1} … λ_d]        (the sampler's log-probs, model tokens)

- The model's tokens are **the sampler's token ids**, never a re-tokenization of its text: a turn's text may
  tokenize differently (merges across the turn's edge, a chat template's normalisation), and the ratio
  ``π/π_old`` is only meaningful for the exact tokens drawn. The environment's tokens (the prompt, tool
  results, a user's next turn) are what the chat template renders for its messages (how a turn's end joins
  the next message's rendering is the environment runner's to settle, issue 51; not here).
- The loss covers the model's tokens only: the loop's per-token losses ``ℓ[:, q − 1]`` (the log-prob of token
  ``q``) are gathered at the model's positions (:func:`model_positions`), so an environment token neither
  enters the loss nor gets a gradient; and the importance ratio is taken against the sampler's log-probs
  ``λ`` (:attr:`Trajectory.old_logps`), as TRL's ``rollout_func`` trajectories carry theirs.
- With ``L`` the most model tokens of a batch's trajectories, the gathered log-probs ``[n, L]``, the sampler's
  ``[n, L]`` and the mask ``[n, L]`` are exactly what :func:`mlora_lab.rl.grpo.policy_loss` takes for
  single-turn completions: a multi-turn trajectory trains with every ``loss_type``, the KL to the base and
  the group advantages of today's RL tenants.
- A trajectory longer than ``seq_len`` is cut (:meth:`Trajectory.cut`), keeping its start, its masks and
  log-probs with it; the caller is told (``truncated``), never silently.

Engine room: plain Python and torch, no processes, no tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example

MODEL, ENV = "model", "env"
"""Whose a segment's tokens are: the model's (sampled: trained, with the sampler's log-probs) or the
environment's (rendered: the prompt, tool results, other turns; never trained)."""


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of one source: the model's (``logprobs`` the sampler's, one per token) or the
    environment's (``logprobs`` None)."""

    source: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.source not in (MODEL, ENV):
            problems.append(f"a segment is {MODEL!r} or {ENV!r}, not {self.source!r}")
        if self.source == MODEL and (self.logprobs is None or len(self.logprobs) != len(self.tokens)):
            got = "none" if self.logprobs is None else len(self.logprobs)
            problems.append(
                f"a model segment of {len(self.tokens)} tokens needs as many sampler log-probs, got {got}"
            )
        if self.source == ENV and self.logprobs is not None:
            problems.append("an environment segment has no log-probs (it was not sampled)")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Trajectory:
    """One episode: its segments in order, its reward (``None`` until scored), the example it answers (a group
    is the trajectories of one example) and whether it was cut to fit."""

    segments: list[Segment]
    reward: float | None = None
    example: Any = None
    truncated: bool = False
    turns: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """The messages, as the environment saw them (for the recent samples view): not trained on."""

    @property
    def tokens(self) -> list[int]:
        """``x``: every token, in order."""
        return [t for s in self.segments for t in s.tokens]

    @property
    def model_mask(self) -> list[int]:
        """``μ``: 1 on the model's tokens, 0 on the environment's."""
        return [int(s.source == MODEL) for s in self.segments for _ in s.tokens]

    @property
    def old_logps(self) -> list[float]:
        """The sampler's log-probs of the model's tokens, in order (``Σ μ`` of them)."""
        return [lp for s in self.segments if s.source == MODEL for lp in s.logprobs]

    def cut(self, seq_len: int) -> Trajectory:
        """The trajectory cut to its first ``seq_len`` tokens (segments, masks and log-probs cut with them),
        ``truncated`` when anything was cut; itself when it fits."""
        if len(self.tokens) <= seq_len:
            return self
        kept, room = [], seq_len
        for s in self.segments:
            if room <= 0:
                break
            n = min(room, len(s.tokens))
            lps = None if s.logprobs is None else s.logprobs[:n]
            kept.append(Segment(s.source, s.tokens[:n], lps))
            room -= n
        return Trajectory(kept, self.reward, self.example, True, self.turns)


def model_positions(trajectory: Trajectory) -> list[int]:
    """Where the model's tokens sit in the loop's per-token losses ``ℓ [n, T − 1]`` (``ℓ[:, p]`` is of token
    ``p + 1``): ``q − 1`` for each model token at position ``q ≥ 1``. A model token at position 0 (no context
    before it) cannot be scored and is left out, as a causal LM never predicts its first token."""
    return [q - 1 for q, m in enumerate(trajectory.model_mask) if m and q > 0]


def example_of(trajectory: Trajectory) -> Example:
    """The trajectory as a loop row: its tokens, labels the model's tokens (the environment's ignored)."""
    tokens, mask = trajectory.tokens, trajectory.model_mask
    return Example(tokens, [t if m else IGNORE_INDEX for t, m in zip(tokens, mask, strict=True)])


def gather(
    token_loss: torch.Tensor, trajectories: Sequence[Trajectory]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logps [n, L], old_logps [n, L], mask [n, L])`` of ``n`` trajectories from the loop's per-token losses
    ``ℓ [n, T − 1]`` of their rows (:func:`example_of`, in order): the log-probs of each one's model tokens
    (``−ℓ`` at :func:`model_positions`, with gradient), the sampler's, and the mask of those that exist, ``L``
    the most model tokens of them; what :func:`mlora_lab.rl.grpo.policy_loss` takes."""
    positions = [model_positions(t) for t in trajectories]
    olds = [t.old_logps[len(t.old_logps) - len(p) :] for t, p in zip(trajectories, positions, strict=True)]
    L = max((len(p) for p in positions), default=0)
    index = torch.zeros(len(trajectories), L, dtype=torch.long)
    mask = torch.zeros(len(trajectories), L, dtype=torch.bool)
    old = torch.zeros(len(trajectories), L, dtype=token_loss.dtype)
    for i, (p, o) in enumerate(zip(positions, olds, strict=True)):
        index[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, : len(p)] = True
        old[i, : len(o)] = torch.tensor(o, dtype=token_loss.dtype)
    index, mask, old = index.to(token_loss.device), mask.to(token_loss.device), old.to(token_loss.device)
    logps = -token_loss.gather(1, index) * mask
    return logps, old, mask
