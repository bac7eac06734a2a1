"""Batches for a causal LM's forward: left-padded prompts, and the name its forward gives the KV cache."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch


def left_pad(
    prompts: Sequence[Sequence[int]], pad: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompts`` as one left-padded batch: ``input_ids``, ``attention_mask`` (1 on tokens) and
    ``position_ids`` (``cumsum(mask) - 1``: a row's first token is at 0 however much padding precedes
    it), each [R, T] with T the longest prompt."""
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for j, p in enumerate(prompts):
        input_ids[j, T - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[j, T - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    return input_ids.to(device), mask.to(device), positions.to(device)


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The forward's name for the KV cache: ``cache`` since transformers 5.x deprecated
    ``past_key_values`` (still the name in the 4.x releases the project supports)."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
