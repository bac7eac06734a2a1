"""A preference tenant's feed: its rows (pairs, or KTO's unpaired rows) as loop rows, their order, the window
being trained, the reference cache and the window's metric sums, and what a checkpoint keeps of them.

See :mod:`mlora_lab.job.drivers.preference` for the maths and why the reference is cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example, TenantStream
from mlora_lab.rl.pairs import PairIds, UnpairedIds, pair_sequences
from mlora_lab.rl.preference import METRICS
from mlora_lab.rl.preference_free import CPO_METRICS, KTO_METRICS, ORPO_METRICS
from mlora_lab.rl.preference_ref import ReferenceCache

SORTING_OR_BATCH = ("aot", "aot_unpaired", "sft")
"""Loss types that are not a mean of per-pair terms (see the module docstring, "Under D > 1")."""
METHOD_METRICS = {"dpo": METRICS, "orpo": ORPO_METRICS, "cpo": CPO_METRICS, "kto": KTO_METRICS}
"""What each method logs (TRL's names): DPO's six, ORPO's and CPO's with their NLL and odds terms."""


def pairs_digest(pairs: Sequence[PairIds]) -> str:
    """SHA-256 of a tenant's tokenized pairs, in order: what its data cursor and reference cache index into."""
    h = hashlib.sha256()
    for p in pairs:
        for part in (p.prompt_ids, p.chosen_ids, p.rejected_ids):
            h.update(len(part).to_bytes(8, "little"))
            h.update(array("q", part).tobytes())
    return h.hexdigest()


def unpaired_digest(rows: Sequence[UnpairedIds], kl_ids: Sequence[list[int]]) -> str:
    """SHA-256 of a KTO tenant's tokenized rows, their labels and their KL completions, in order."""
    h = hashlib.sha256()
    for r, kl in zip(rows, kl_ids, strict=True):
        for part in (r.prompt_ids, r.completion_ids, [int(r.label)], kl):
            h.update(len(part).to_bytes(8, "little"))
            h.update(array("q", part).tobytes())
    return h.hexdigest()


def masked_example(input_ids: Sequence[int], mask: Sequence[int]) -> Example:
    """A loop row whose labels are its tokens where ``mask`` is 1 (a completion), ignored elsewhere."""
    return Example(
        list(input_ids), [tok if m else IGNORE_INDEX for tok, m in zip(input_ids, mask, strict=True)]
    )


def pair_examples(pair: PairIds, seq_len: int, whole_chosen: bool = False) -> tuple[Example, Example]:
    """The chosen and the rejected sequence of a pair as loop rows: prompt + completion cut to ``seq_len``
    (its start kept, as TRL's ``keep_start``), labels the tokens themselves on the completion, ignored on the
    prompt (the loop's loss at position ``p`` predicts token ``p + 1``, TRL's ``completion_mask[:, 1:]``).
    ``whole_chosen`` (ORPO, whose NLL covers the chosen prompt too): every token of the chosen row is a label."""
    out = []
    for k, s in enumerate(pair_sequences(pair, seq_len, "keep_start")):
        whole = whole_chosen and k == 0
        labels = [
            tok if m or whole else IGNORE_INDEX for tok, m in zip(s.input_ids, s.completion_mask, strict=True)
        ]
        out.append(Example(list(s.input_ids), labels))
    return out[0], out[1]


def completion_masks(pair: PairIds, seq_len: int) -> tuple[list[int], list[int]]:
    """The chosen and the rejected sequence's completion masks (1 on a completion token), as cut to ``seq_len``."""
    chosen, rejected = pair_sequences(pair, seq_len, "keep_start")
    return chosen.completion_mask, rejected.completion_mask


@dataclass
class PrefFeed:
    """A preference tenant's feed: its pairs, their order, the window being trained, the reference cache and
    the window's metric sums."""

    pairs: list[PairIds]
    examples: list[tuple[Example, Example]]
    masks: list[tuple[list[int], list[int]]]  # each sequence's completion mask (1 on a completion token)
    stream: TenantStream  # over pair indices
    reference: ReferenceCache | None  # (None: ORPO and CPO have no reference)
    digest: str
    metrics: tuple[str, ...] = METRICS
    micro: int = 0  # micro-batches done in the current window
    window: list[list[int]] = field(default_factory=list)  # [k][B] pair indices
    window_tokens: int = 0  # completion tokens (chosen and rejected) of the window's pairs
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    """This process's ``Σ`` of each of ``metrics`` over its pairs of the window, then its pair count (KTO:
    ``[k, 6]``, per micro-batch ``n_D, Σβu_D, Σℓ_D, n_U, Σβu_U, Σℓ_U``)."""
    labels: list[bool] | None = None  # KTO: each row's label (desirable); its examples are (row, KL row)
    kls: list[float] = field(default_factory=list)  # KTO: each micro-batch's KL estimate z₀, so far
    heldout: PrefFeed | None = None  # the held-out pairs (their examples, masks and reference; no order)
    comm: Any = field(default=None, repr=False)  # the job's collectives (the metric sums of a checkpoint)

    def __post_init__(self) -> None:
        if self.labels is None and self.sums.numel() != len(self.metrics) + 1:
            self.sums = torch.zeros(len(self.metrics) + 1, dtype=torch.float64)

    def zero_sums(self, k: int) -> None:
        """Forget the window's metric sums (``k`` micro-batches)."""
        self.sums = torch.zeros(k, 6, dtype=torch.float64) if self.labels is not None else self.sums.zero_()
        self.kls = []

    def reset(self) -> None:
        self.micro = 0
        self.sums.zero_()
        self.kls = []

    def pairs_taken(self) -> int:
        return self.stream.epoch * len(self.stream) + self.stream.cursor

    def state_dict(self) -> dict[str, Any]:
        # (keys apart from the pool's: mlora_lab.job.tenants.POOL_KEYS)
        return {
            "pref_stream": self.stream.state_dict(),
            "pref_micro": self.micro,
            "pref_window": self.window,
            "pref_window_tokens": self.window_tokens,
            # (the window's metric sums over every process: rank 0 takes them back on a resume, as window_loss)
            "pref_sums": self.sums.clone() if self.comm is None else self.comm.sum_over_dp(self.sums.clone()),
            "pref_kls": list(self.kls),
            "pref_reference": None if self.reference is None else self.reference.state_dict(),
            "pref_heldout_reference": (
                None
                if self.heldout is None or self.heldout.reference is None
                else self.heldout.reference.state_dict()
            ),
            "pref_digest": self.digest,
            "pref_heldout_digest": None if self.heldout is None else self.heldout.digest,
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        """Continue from a checkpoint; ``ValueError`` if the pairs changed since, or the reference was computed
        under other options."""
        if s["pref_digest"] != self.digest:
            raise ValueError(
                f"its preference pairs changed since the checkpoint ({len(self.pairs)} pairs now; their tokens "
                "differ): put the data back as it was to resume it, or train on the new pairs as a new tenant "
                "that starts from its adapter (init_adapter)"
            )
        self.stream.load_state_dict(s["pref_stream"])
        self.micro = int(s["pref_micro"])
        self.window = [[int(i) for i in micro] for micro in s["pref_window"]]
        self.window_tokens = int(s["pref_window_tokens"])
        self.sums = s["pref_sums"].to(torch.float64).clone()
        if self.comm is not None and self.comm.dp_rank != 0:
            self.sums.zero_()  # (the saved sums are every process's: rank 0 carries them)
        self.kls = [float(x) for x in s.get("pref_kls", [])]
        merge_reference(self.reference, s["pref_reference"])
        held = None if self.heldout is None else self.heldout.reference
        if held is not None and s.get("pref_heldout_reference") is not None:
            if s.get("pref_heldout_digest") == self.heldout.digest:
                merge_reference(held, s["pref_heldout_reference"])
            elif held.tenant is not None:
                raise ValueError(
                    "its held-out pairs changed since the checkpoint, and their reference was its init adapter "
                    "as it was before the first step, which cannot be computed again: put the held-out data back "
                    "as it was, or resume without heldout_data"
                )
            # (else the base's values of other pairs: dropped, the new pairs' computed when first needed)


def merge_reference(cache: ReferenceCache | None, saved: dict[str, Any] | None) -> None:
    """A checkpoint's reference values into ``cache``, merged: a cache shared with tenants restored before
    this one keeps theirs (the same rows, the same values). ``ValueError`` if computed under other options."""
    if cache is None or saved is None:
        return
    before = dict(cache.values)
    cache.load_state_dict(saved)
    cache.values = {**before, **cache.values}


def shifted(masks: Sequence[Sequence[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[n, width − 1]`` bool: ``out[r, p] = masks[r][p + 1]`` (the loop's ``ℓ[:, p]`` is of token ``p + 1``),
    False past a row's end."""
    out = torch.zeros(len(masks), width - 1, dtype=torch.bool)
    for r, m in enumerate(masks):
        out[r, : len(m) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    return out.to(device)


def kto_metrics(sums: torch.Tensor, kls: list[float]) -> dict[str, float | None]:
    """TRL's KTO metrics of a window from its per-micro-batch sums ``[k, 6]`` (``n_D, Σβu_D, Σℓ_D, n_U, Σβu_U,
    Σℓ_U`` over every process) and KL estimates: each micro-batch's side means where it has that side (margins
    where it has both), averaged over the micro-batches (kto:1524-1546, TRL's log of a step); ``None`` for a
    side no micro-batch had."""
    per: dict[str, list[float]] = {m: [] for m in KTO_METRICS}
    per["kl"] = list(kls)
    for n_d, r_d, l_d, n_u, r_u, l_u in sums.tolist():
        if n_d:
            per["rewards/chosen"].append(r_d / n_d)
            per["logps/chosen"].append(l_d / n_d)
        if n_u:
            per["rewards/rejected"].append(r_u / n_u)
            per["logps/rejected"].append(l_u / n_u)
        if n_d and n_u:
            per["rewards/margins"].append(r_d / n_d - r_u / n_u)
    return {m: (sum(v) / len(v) if v else None) for m, v in per.items()}
