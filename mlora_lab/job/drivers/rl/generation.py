"""An RL tenant's generations and feed: what a window trains on, its seeds, its prompts, and where the trained
tokens sit in the loop's per-token losses (see :mod:`mlora_lab.job.drivers.rl` for the maths)."""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, DataError, Example, TenantStream
from mlora_lab.rl.prompt_tokens import PromptRow, load_prompts
from mlora_lab.rl.trajectory import Segment, Trajectory, example_of, model_positions
from mlora_lab.sources import source_name
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant


def generation_seed(seed: int, generation: int, position: int) -> int:
    """The sampling seed of the prompt at ``position`` of a tenant's ``generation``: 63 bits of a hash of
    the three (each completion's own generator is then seeded with ``row_seed(this, j)``)."""
    digest = hashlib.blake2b(f"mlora_lab.rl/{seed}/{generation}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Generation:
    """One generation of a tenant: its completions and everything its window's steps train on.

    Completion ``i = b·G + j`` is completion ``j`` of prompt ``prompts[b]`` (TRL's order). ``old_logps`` and
    ``ref_logps`` are ``[N, L]`` (``L`` the longest completion; 0 past a completion's end), for every
    completion, on every process."""

    index: int  # the tenant's generation counter when it was drawn
    prompts: list[int]  # [B] indices into the feed's prompts
    group_size: int
    tokens: list[list[int]]  # [N] completion tokens
    truncated: list[bool]  # [N] stopped by max_new_tokens (no EOS, no stop string)
    rewards: torch.Tensor  # [N] combined reward, NaN where none was given
    advantages: torch.Tensor  # [N]
    iteration: int = 0  # optimiser steps taken on it so far
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    # within a window: this process's sg(logps) of the micro-batches done (first window, μ > 1), [N, L]
    old_local: torch.Tensor | None = None
    # within a window: this process's (kl sum, kl count, clipped sum, clipped count) of the micro-batches done
    stats: torch.Tensor = field(default_factory=lambda: torch.zeros(4, dtype=torch.float64))
    rows: list[Example] = field(default_factory=list, repr=False)
    n_tokens: int = 0  # completion tokens that carry loss, over all N
    per_function: torch.Tensor | None = None  # [N, F] each reward function's reward (float64, NaN: none)
    logged: dict[str, float] = field(default_factory=dict)  # what the functions logged with log_metric
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra columns, one value per completion
    # an agent tenant's episodes (rl.env / rl.tools): [N] trajectories (segments: tokens, masks, the sampler's
    # log-probs, cut to seq_len), trained in place of prompt + completion; tokens[i] is then episode i's model tokens
    trajectories: list[Trajectory] | None = field(default=None, repr=False)
    # and each episode as its completion row shows it (rundir.EpisodeRecord's fields: messages, turns, stop, parts,
    # forks)
    episodes: list[dict[str, Any]] | None = field(default=None, repr=False)
    # [N] each sampled completion's log-probs under the distribution it was drawn from (the sampler's
    # ``sampling_logprobs``: log_softmax(filter(z / T))[token]); an agent's episodes carry theirs in ``trajectories``
    sampled_logps: list[list[float]] | None = field(default=None, repr=False)
    # the tenant's adapter version (its optimiser steps taken) that sampled it, and the tenant's step when it was
    # drawn: their difference at a training step is its staleness
    version: int = 0
    # the ratio's "old" log-probs are the sampler's (``old_logps = sampler_logps(self)``): an agent's episodes, and
    # a generation of a tenant with ``max_staleness > 0`` (TRL's AsyncGRPO: π_θ / π_sampler from its first step)
    off_policy: bool = False

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_len(self) -> int:
        if self.trajectories is not None:
            return max((len(model_positions(t)) for t in self.trajectories), default=0)
        return max(len(c) for c in self.tokens)

    def positions(self, i: int) -> list[int]:
        """Where completion ``i``'s trained tokens sit in the loop's per-token losses ``ℓ [n, T-1]``: ``P_i − 1 + k``
        for the ``k``-th completion token, or an episode's model tokens (:func:`~mlora_lab.rl.trajectory.model_positions`)."""
        if self.trajectories is not None:
            return model_positions(self.trajectories[i])
        start = self.prompt_len(i) - 1
        return list(range(start, start + len(self.tokens[i])))

    def build(self, prompts: Sequence[PromptRow], mask_truncated: bool) -> None:
        """The training rows: prompt + completion, labels on the completion's tokens (none on a truncated
        completion when ``mask_truncated``), and the count of tokens that carry loss. An agent's episode: its
        tokens, labels on the model's own (:func:`~mlora_lab.rl.trajectory.example_of`)."""
        self.rows, self.n_tokens = [], 0
        if self.trajectories is not None:
            for i, t in enumerate(self.trajectories):
                row = example_of(t)
                if mask_truncated and self.truncated[i]:
                    row = Example(row.input_ids, [IGNORE_INDEX] * len(row.input_ids))
                self.rows.append(row)
                self.n_tokens += 0 if mask_truncated and self.truncated[i] else len(model_positions(t))
            return
        for i, tokens in enumerate(self.tokens):
            ids = prompts[self.prompts[i // self.group_size]].ids
            masked = mask_truncated and self.truncated[i]
            labels = (
                [IGNORE_INDEX] * (len(ids) + len(tokens)) if masked else [IGNORE_INDEX] * len(ids) + tokens
            )
            self.rows.append(Example([*ids, *tokens], labels))
            self.n_tokens += 0 if masked else len(tokens)

    def completion_text(self, i: int, tokenizer: Any) -> str:
        """What completion ``i`` says, as the samples show it: its text, or an episode's every turn after its
        prompt (the model's answers and what its environment added between them, tool results included)."""
        if self.trajectories is None:
            return tokenizer.decode(self.tokens[i], skip_special_tokens=True)
        segments = self.trajectories[i].segments
        after = (
            [t for s in segments[1:] for t in s.tokens] if segments and segments[0].source != "model" else []
        )
        return tokenizer.decode(after, skip_special_tokens=True)

    def prompt_len(self, i: int) -> int:
        return len(self.rows[i]) - len(self.tokens[i])

    def micro(self, m: int, k: int) -> range:
        """The completions of micro-batch ``m`` of ``k``: those of its ``B`` prompts, ``B·G`` in all."""
        n = len(self.tokens) // k
        return range(m * n, (m + 1) * n)

    def state_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompts": self.prompts,
            "group_size": self.group_size,
            "tokens": self.tokens,
            "truncated": self.truncated,
            "rewards": self.rewards,
            "advantages": self.advantages,
            "iteration": self.iteration,
            "old_logps": self.old_logps,
            "ref_logps": self.ref_logps,
            "old_local": self.old_local,
            "stats": self.stats,
            "per_function": self.per_function,
            "logged": self.logged,
            "extra": self.extra,
            "episodes": self.episodes,
            "sampled_logps": self.sampled_logps,
            "version": self.version,
            "off_policy": self.off_policy,
            "trajectories": None
            if self.trajectories is None
            else [
                {
                    "segments": [
                        (x.source, list(x.tokens), x.logprobs and list(x.logprobs)) for x in t.segments
                    ],
                    "reward": t.reward,
                    "truncated": t.truncated,
                }
                for t in self.trajectories
            ],
        }

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> Generation:
        return cls(
            index=int(s["index"]),
            prompts=[int(p) for p in s["prompts"]],
            group_size=int(s["group_size"]),
            tokens=[list(map(int, c)) for c in s["tokens"]],
            truncated=[bool(x) for x in s["truncated"]],
            rewards=s["rewards"].float(),
            advantages=s["advantages"].float(),
            iteration=int(s["iteration"]),
            old_logps=None if s["old_logps"] is None else s["old_logps"].float(),
            ref_logps=None if s["ref_logps"] is None else s["ref_logps"].float(),
            old_local=None if s.get("old_local") is None else s["old_local"].float(),
            stats=s["stats"].double() if "stats" in s else torch.zeros(4, dtype=torch.float64),
            per_function=None if s.get("per_function") is None else s["per_function"].double(),
            logged={str(k): float(v) for k, v in (s.get("logged") or {}).items()},
            extra={str(k): list(v) for k, v in (s.get("extra") or {}).items()},
            episodes=s.get("episodes"),
            sampled_logps=None
            if s.get("sampled_logps") is None
            else [list(map(float, c)) for c in s["sampled_logps"]],
            version=int(s.get("version", 0)),
            off_policy=bool(s.get("off_policy", s.get("trajectories") is not None)),
            trajectories=None
            if s.get("trajectories") is None
            else [
                Trajectory(
                    [
                        Segment(src, tuple(tok), None if lps is None else tuple(lps))
                        for src, tok, lps in t["segments"]
                    ],
                    t["reward"],
                    truncated=bool(t["truncated"]),
                )
                for t in s["trajectories"]
            ],
        )


@dataclass
class Sampled:
    """A generation sampled ahead of its window (``rl.max_staleness > 0``, or just now): its draws, waiting for
    their rewards. Kept in checkpoints, so a resume scores it again (reward functions see the same inputs and
    ``global_step``) and never redraws what was sampled with an older adapter."""

    index: int  # the tenant's generation counter when it was drawn (its seeds derive from it)
    version: int  # the adapter version (tenant steps) that sampled it
    prompts: list[int]  # [B·k] indices into the feed's prompts
    tokens: list[list[int]]  # [N] completion tokens, N = B·k·G
    logps: list[list[float]]  # [N] the sampler's log-probs of them
    truncated: list[bool]  # [N] cut at max_new_tokens
    # sent to a rollout rank and not answered yet (tokens, logps and truncated still empty): the work's ticket
    ticket: int | None = None
    # (rank 0) set once it is answered (its rewards may start: they wait for it on their tenant's thread), and
    # why its sampling failed, if it did
    arrived: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    error: str | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.ticket is not None:  # (a checkpoint waits for every answer first: Drawing.before_checkpoint)
            raise ValueError(f"generation {self.index} is still being sampled")
        return {k: getattr(self, k) for k in ("index", "version", "prompts", "tokens", "logps", "truncated")}

    def fill(
        self,
        tokens: list[list[int]],
        logps: list[list[float]],
        truncated: list[bool],
        error: str | None = None,
    ) -> None:
        """A rollout rank's answer: the generation is sampled (or failed, ``error``). May run on the link's
        receiving thread: ``ticket`` is cleared last, so one who sees it cleared sees the tokens."""
        self.tokens, self.logps, self.truncated, self.error = tokens, logps, truncated, error
        self.ticket = None
        self.arrived.set()

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> Sampled:
        return cls(
            index=int(s["index"]),
            version=int(s["version"]),
            prompts=[int(p) for p in s["prompts"]],
            tokens=[list(map(int, c)) for c in s["tokens"]],
            logps=[list(map(float, c)) for c in s["logps"]],
            truncated=[bool(x) for x in s["truncated"]],
        )


def prompts_digest(prompts: Sequence[PromptRow]) -> str:
    """SHA-256 of a tenant's prompt token ids, in order: what its prompt cursor indexes into."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(len(p.ids).to_bytes(8, "little"))
        h.update(array("q", p.ids).tobytes())
    return h.hexdigest()


@dataclass
class RLFeed:
    """An RL tenant's feed: its prompts, their order, its generation counter and the generation its
    window trains on (``None`` between windows)."""

    prompts: list[PromptRow]
    stream: TenantStream  # over prompt indices: take(n) gives the next n indices
    mask_truncated: bool = False  # the tenant's rl.mask_truncated_completions (rows of a restored generation)
    generations: int = 0  # generations drawn so far (the seeds derive from it)
    current: Generation | None = None
    digest: str = ""
    micro: int = 0  # micro-batches done in the current optimiser window (of grad_accum)
    flat: int = 0  # generations in a row whose every group had one reward for all its completions
    masked: int = 0  # generations in a row whose every completion was masked (cut, mask_truncated)
    reward_range: tuple[float, float] | None = None  # the lowest and highest mean reward of its generations
    # generations sampled and not yet trained on, oldest first (rl.max_staleness > 0: up to the bound ahead)
    ahead: list[Sampled] = field(default_factory=list)

    def reset(self) -> None:
        """A quarantine drops the generation in progress and those sampled ahead."""
        self.current = None
        self.micro = 0
        self.ahead = []

    def prompts_taken(self) -> int:
        """Prompts trained on or in training (not those of generations sampled ahead)."""
        drawn = self.stream.epoch * len(self.stream) + self.stream.cursor
        return drawn - sum(len(s.prompts) for s in self.ahead)

    def state_dict(self) -> dict[str, Any]:
        # (keys apart from the pool's: mlora_lab.job.tenants.POOL_KEYS)
        return {
            "rl_stream": self.stream.state_dict(),
            "rl_generations": self.generations,
            "rl_current": None if self.current is None else self.current.state_dict(),
            "rl_prompts_digest": self.digest,
            "rl_micro": self.micro,
            "rl_reward_range": self.reward_range,
            "rl_ahead": [s.state_dict() for s in self.ahead],
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        """Continue from a checkpoint; ``ValueError`` if the tenant's prompts changed since."""
        if s["rl_prompts_digest"] != self.digest:
            raise ValueError(
                f"its prompts changed since the checkpoint ({len(self.prompts)} prompts now; their tokens "
                "differ): put the data back as it was to resume it, or train on the new prompts as a new "
                "tenant that starts from its adapter (init_adapter)"
            )
        self.stream.load_state_dict(s["rl_stream"])
        self.generations = int(s["rl_generations"])
        self.current = None if s["rl_current"] is None else Generation.from_state(s["rl_current"])
        self.micro = int(s.get("rl_micro", 0))
        low_high = s.get("rl_reward_range")  # (none in a checkpoint written before it was kept)
        self.reward_range = None if low_high is None else (float(low_high[0]), float(low_high[1]))
        self.ahead = [Sampled.from_state(a) for a in s.get("rl_ahead") or []]
        if self.current is not None:
            self.current.build(self.prompts, self.mask_truncated)


def read_prompts(tenant: Tenant, tokenizer: Any, seq_len: int, vocab: int) -> list[PromptRow]:
    """An RL tenant's prompt rows, tokenized (:func:`~mlora_lab.rl.prompt_tokens.load_prompts`: ``prompt``
    text with the tokenizer's special tokens, ``messages`` through the chat template with the generation
    prompt). A prompt longer than ``seq_len − max_new_tokens`` keeps its last tokens (one warning, as SFT rows
    cut get); every kept token must be one the model embeds."""
    rl: RL = tenant.rl
    where = source_name(tenant.data)
    prompts = load_prompts(tenant.data, tokenizer, seq_len - rl.max_new_tokens)
    problems = []
    for n, p in enumerate(prompts, start=1):
        if not p.ids:
            problems.append(f"{where} row {n}: the prompt encodes to no token")
        elif max(p.ids) >= vocab:
            problems.append(
                f"{where} row {n}: token id {max(p.ids)} is outside the model's {vocab} embeddings"
            )
    if problems:
        raise DataError(problems, header=f"cannot use {where}")
    return prompts


def completion_index(
    g: Generation, local: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the completion tokens of rows ``local`` of ``g`` sit in the loop's per-token losses
    ``ℓ [n, T-1]`` (``ℓ[:, p]`` predicts token ``p + 1``): ``(index [n, L], valid [n, L])`` with
    ``index[r, k] = P_r − 1 + k`` for the ``k``-th completion token (0 past the completion's end, where
    ``valid`` is False), ``L`` the longest of these completions."""
    if g.trajectories is not None:  # (an agent's episodes: the model's tokens, wherever they sit)
        positions = [g.positions(i) for i in local]
        L = max((len(p) for p in positions), default=0)
        index = torch.zeros(len(local), L, dtype=torch.long)
        valid = torch.zeros(len(local), L, dtype=torch.bool)
        for r, p in enumerate(positions):
            index[r, : len(p)] = torch.tensor(p, dtype=torch.long)
            valid[r, : len(p)] = True
        return index.to(device), valid.to(device)
    starts = torch.tensor([g.prompt_len(i) - 1 for i in local], dtype=torch.long)
    lengths = torch.tensor([len(g.tokens[i]) for i in local], dtype=torch.long)
    k = torch.arange(int(lengths.max()) if len(local) else 0)
    valid = k[None] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + k[None], 0)
    return index.to(device), valid.to(device)


def sampler_logps(g: Generation) -> torch.Tensor:
    """``[N, L]``: each completion's sampler log-probs (an episode's: of its trained model tokens), laid out as
    :func:`completion_index` lays out the trainer's (0 past the end). ``ValueError`` for a generation sampled
    before they were kept."""
    out = torch.zeros(len(g), g.max_len, dtype=torch.float32)
    if g.trajectories is None:
        if g.sampled_logps is None:
            raise ValueError(f"generation {g.index} keeps no sampler log-probs")
        for i, lps in enumerate(g.sampled_logps):
            if lps:
                out[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return out
    for i, t in enumerate(g.trajectories):
        n = len(g.positions(i))
        old = t.old_logps
        if n:
            out[i, :n] = torch.tensor(old[len(old) - n :], dtype=torch.float32)
    return out
