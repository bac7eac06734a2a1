"""Reference log-probs of preference pairs: from the shared base, computed once per row and cached.

A preference tenant's loss (:mod:`mlora_lab.rl.preference`) needs each pair's reference sequence log-probs
``ℓ^ref_w``, ``ℓ^ref_l``. The reference of a LoRA tenant is the frozen base with the tenant's delta off,
``π_ref(y|x) = π_W(y|x)`` (TRL's PEFT case, ``disable_adapter()``), or the base with the tenant's
``init_adapter`` on, ``π_ref = π_{W + s·B_0 A_0}`` (TRL's ``"ref"`` adapter case), registered as a frozen
tenant of its own. No copy of the base is made: the reference forward is the same
:class:`~mlora_lab.lora.MultiLoRAModel`, its rows routed to no slot (``tenants=None``: every row's delta is
off) or to the init adapter's slot.

Both references are fixed for the whole run, so ``ℓ^ref`` is a function of the pair's tokens alone. We
therefore compute it ONCE per row, the first time the row is drawn, by a no-grad forward of ``2B`` sequences
(the chosen half then the rejected half, as :func:`mlora_lab.rl.pairs.collate_pairs` lays them out), and keep
it (TRL's ``precompute_ref_log_probs``, done lazily rather than over the whole dataset before step 1):

- memory: 2 floats per pair, 8 bytes in float32 (TRL's two columns): 1M pairs are 8 MB. Kept here as
  Python floats (float64, so a float64 model's values are not rounded) in a dict by row id, a few hundred
  bytes per row with the dict's overhead (1M rows: a few hundred MB of host memory), nothing on the
  accelerator; the checkpoint's :meth:`ReferenceCache.state_dict` is an ``[N, 2]`` float64 tensor, 16 MB;
- compute: one forward (no backward, no activations kept) per row for the whole run, versus a second
  forward of every pair at every step and every epoch in the same-step approach: E epochs save ``E − 1``
  reference forwards per row and keep the step's batch free of the reference rows.

The price: a row's reference is computed in its own small batch (its own padding), not beside the policy's
rows; its value is the same up to rounding (right padding under a causal mask: each row's log-probs see only
its own tokens). The cache remembers the options its values depend on (reference, ``ld_alpha``, ``max_length``,
truncation); a checkpoint's cache is refused under other options, since its numbers would be wrong.

Per-token log-probs: ``ℓ_t = z_t[y_{t+1}] − logsumexp(z_t)`` from the logits ``z`` ``[2B, W, V]`` in the
model's dtype (at least float32); the sequence log-probs are :func:`~mlora_lab.rl.preference.sequence_logps`
over the completion mask shifted by one (``completion_mask[:, 1:]``), with LD-DPO's ``ld_alpha``.
Engine room: plain torch, no run directory, no validation beyond the shapes it is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mlora_lab.rl.pairs import PairIds, collate_pairs
from mlora_lab.rl.preference import sequence_logps


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` within the block (a fixed reference: no dropout of an init adapter), mode restored."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def token_logps(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, tenant: str | None = None
) -> torch.Tensor:
    """``ℓ_t`` ``[N, W−1]``: the log-prob of each next token ``input_ids[:, 1:]`` under ``model`` (a
    :class:`~mlora_lab.lora.MultiLoRAModel`) with every row routed to ``tenant`` (``None``: the base alone).
    Computed in the logits' dtype, at least float32."""
    tenants = None if tenant is None else [tenant] * input_ids.shape[0]
    logits = model(input_ids, tenants=tenants, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def reference_logps(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    tenant: str | None = None,
    ld_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ref_chosen [B], ref_rejected [B])`` of a collated pair batch (``input_ids``, ``attention_mask``,
    ``completion_mask``, each ``[2B, W]``: chosen rows then rejected rows), by one no-grad forward of the
    base with no delta (``tenant=None``) or with the frozen init adapter registered as ``tenant``, in eval
    mode. ``ld_alpha`` as :func:`~mlora_lab.rl.preference.sequence_logps` takes it."""
    input_ids = batch["input_ids"]
    if input_ids.ndim != 2 or input_ids.shape[0] % 2:
        raise ValueError(f"a pair batch has 2B rows, got input_ids of shape {tuple(input_ids.shape)}")
    with _evaluating(model):
        logps = token_logps(model, input_ids, batch["attention_mask"], tenant)
    mask = batch["completion_mask"][:, 1:]
    chosen, rejected = logps.chunk(2)
    chosen_mask, rejected_mask = mask.chunk(2)
    return sequence_logps(chosen, chosen_mask, rejected, rejected_mask, ld_alpha=ld_alpha)


class ReferenceCache:
    """Reference sequence log-probs by row id: ``{id: (ℓ^ref_w, ℓ^ref_l)}``, each row computed once.

    ``cache(ids, pairs)`` returns ``(ref_chosen [B], ref_rejected [B])`` for the rows ``ids`` (``pairs``
    their token ids, :class:`~mlora_lab.rl.pairs.PairIds`), first computing the rows it lacks
    (:meth:`missing`) in batches of ``batch_size`` pairs. ``forwards`` counts the reference forwards made.
    :meth:`state_dict` / :meth:`load_state_dict` carry the values through a checkpoint.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int,
        tenant: str | None = None,
        ld_alpha: float | None = None,
        max_length: int | None = None,
        truncation_mode: str = "keep_start",
        batch_size: int = 8,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.pad_token_id, self.batch_size = model, pad_token_id, batch_size
        self.tenant = tenant
        # what the values depend on besides the rows' tokens (the model's weights are fixed for the run)
        self.options: dict[str, Any] = {
            "reference": tenant,
            "ld_alpha": ld_alpha,
            "max_length": max_length,
            "truncation_mode": truncation_mode,
        }
        self.values: dict[Hashable, tuple[float, float]] = {}
        self.forwards = 0

    def __len__(self) -> int:
        return len(self.values)

    def missing(self, ids: Sequence[Hashable]) -> list[Hashable]:
        """The ids among ``ids`` without a cached value, in order, each once."""
        return [i for i in dict.fromkeys(ids) if i not in self.values]

    def fill(self, pairs: Mapping[Hashable, PairIds]) -> int:
        """Compute and keep the rows of ``pairs`` not yet cached; returns how many were computed."""
        todo = self.missing(list(pairs))
        device = next(self.model.parameters()).device
        for start in range(0, len(todo), self.batch_size):
            ids = todo[start : start + self.batch_size]
            lists = collate_pairs(
                [pairs[i] for i in ids],
                self.pad_token_id,
                self.options["max_length"],
                self.options["truncation_mode"],
            )
            batch = {k: torch.tensor(v, device=device) for k, v in lists.items()}
            chosen, rejected = reference_logps(
                self.model, batch, tenant=self.tenant, ld_alpha=self.options["ld_alpha"]
            )
            self.forwards += 1
            for i, c, r in zip(ids, chosen.tolist(), rejected.tolist(), strict=True):
                self.values[i] = (c, r)
        return len(todo)

    def __call__(
        self, ids: Sequence[Hashable], pairs: Sequence[PairIds], dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ref_chosen [B], ref_rejected [B])`` of rows ``ids`` (token ids ``pairs``, in the same order),
        on the model's device, computing the rows not yet cached."""
        if len(ids) != len(pairs):
            raise ValueError(f"{len(ids)} row ids for {len(pairs)} pairs")
        self.fill(dict(zip(ids, pairs, strict=True)))
        values = torch.tensor([self.values[i] for i in ids], dtype=dtype).reshape(len(ids), 2)
        values = values.to(next(self.model.parameters()).device)
        return values[:, 0], values[:, 1]

    def state_dict(self) -> dict[str, Any]:
        """``{"options", "ids", "logps" [N, 2] float64}``: what a checkpoint keeps (``torch.save``-able)."""
        ids = list(self.values)
        logps = torch.tensor([self.values[i] for i in ids], dtype=torch.float64).reshape(len(ids), 2)
        return {"options": dict(self.options), "ids": ids, "logps": logps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the values of :meth:`state_dict`; refused (``ValueError``, every difference named) if they
        were computed under other options."""
        differ = [
            f"{k}: {state['options'].get(k)!r} in the checkpoint, {v!r} here"
            for k, v in self.options.items()
            if state["options"].get(k) != v
        ]
        if differ:
            raise ValueError("reference log-probs computed under other options: " + "; ".join(differ))
        logps = state["logps"].tolist()
        self.values = {i: (c, r) for i, (c, r) in zip(state["ids"], logps, strict=True)}
