"""Memory of the training forward: the loss without the full logits, and activation checkpointing.

**The loss without the logits.** A causal LM's next-token loss is, for a row ``b`` and position ``p``
whose next token ``y = labels[b, p + 1]`` is a target,

    ℓ[b, p] = logsumexp(z) - z[y],        z = h[b, p] W_out^T      (W_out: [V, H], h: [B, T, H])

Computed the usual way, ``z`` exists for every position at once: ``[B, T, V]`` values, in fp32 for the
loss, plus the softmax and its gradient in the backward. On a 49k vocabulary at 12 rows x 512 tokens
that is 1.2 GB per copy; at 128k x 2k tokens it is the largest tensor of the whole step.
:func:`token_loss` instead takes the final hidden states (the model runs with its output layer as the
identity: :func:`hidden_states`), keeps only the positions that have a target (prompt and padding
positions never need a logit), and evaluates ``ℓ`` over chunks of at most ``chunk_tokens`` of them.
When the step's targets need more than one chunk, each chunk runs under
:func:`torch.utils.checkpoint.checkpoint`: the forward keeps only the chunk's ``h`` ([n, H]); the backward
recomputes its ``z`` ([n, V]) and frees it before the next chunk. When they all fit in one chunk, their
logits take at most ``chunk_tokens × V × 4`` bytes, which one chunk would hold anyway, so they are kept
for the backward and nothing is recomputed: the recomputation costs one more ``[n, H] × [H, V]`` matmul
per step (+9% CPU per step on the 11M-parameter model of ``benchmarks/concurrency.py``, whose 16 × 128
targets fit in one chunk), and buys memory only beyond one chunk. The numbers are those of the full
computation either way: each position's ``z`` and ``ℓ`` are computed by the same operations on the same
values, only fewer rows at a time.

The output layer is called as a module, so whatever a parallel layout put there keeps working: a
tensor-parallel ``lm_head`` gathers its vocabulary shards per chunk, an FSDP2 root keeps its (possibly
tied) weight unsharded from the forward to the end of the backward, and a LoRA slot on the output
layer gets each chunk's rows routed to their tenant (LoRA dropout on such a slot draws its mask chunk by
chunk: the same distribution as one draw over all rows, other numbers).

**Activation checkpointing.** :func:`checkpoint_blocks` wraps the forward of every ``k``-th decoder
block in a (non-reentrant) checkpoint: the block keeps only its input in the forward and recomputes
its activations in the backward, with the same dropout masks (the RNG state is replayed) and the same
tenant routing (set once per batch, restored after the loss chunks). Wrapping the block's ``forward``,
not its ``__call__``, leaves module hooks outside the checkpoint, as FSDP2 wants them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache

IGNORE_INDEX = -100

LOSS_CHUNK_BYTES = 64 << 20
"""Size of one chunk's fp32 logits ([chunk_tokens, vocab] x 4 bytes): large enough for full-speed
matmuls, small next to a decoder block's activations."""

# Config attributes of models whose forward post-processes the logits (soft-capping, scaling): the
# output layer cannot be made the identity for them, so they keep the full-logits loss.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def causal_lm_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross entropy ``[B, T-1]`` (fp32) from full logits ``[B, T, V]``, 0 where
    ``labels[:, 1:]`` is ignored: the reference that :func:`token_loss` equals."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return loss.view(shift_labels.shape)


def output_layer(model: nn.Module) -> nn.Module | None:
    """The module that turns hidden states into logits, when the loss may be computed in chunks
    from its input; ``None`` when it may not (no output embedding, or post-processed logits)."""
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _LOGIT_POSTPROCESSING):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if isinstance(head, nn.Module) else None


def _identity(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return x


@contextlib.contextmanager
def hidden_states(head: nn.Module) -> Iterator[None]:
    """Within the block, ``head`` (the output layer) returns its input: the model's ``.logits`` are
    its final hidden states ``[B, T, H]``. An instance attribute shadows the class's ``forward`` (so
    classes swapped in by a parallel layout are covered too); it is removed on exit."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def chunk_tokens_for(vocab: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Target positions per chunk so that one chunk's fp32 logits take about ``chunk_bytes``."""
    return max(16, chunk_bytes // (4 * max(vocab, 1)))


def token_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    project: Callable[[object, torch.Tensor], torch.Tensor],
    groups: Sequence[tuple[object, int, int]],
    chunk_tokens: int,
) -> torch.Tensor:
    """Per-token next-token cross entropy ``[B, T-1]`` (fp32, 0 where ``labels[:, 1:]`` is ignored),
    equal to :func:`causal_lm_token_loss` of the full logits, without ever holding them.

    ``hidden`` is ``[B, T, H]`` (the output layer's input); ``project(key, h)`` maps ``h`` [n, H] of rows
    that belong to ``key`` to their logits [n, V]; ``groups`` are ``(key, start_row, end_row)`` runs
    (a tenant's rows); rows outside every group are projected with key ``None``. Chunks never mix
    groups, so each chunk has one key. Every call projects at least once (an empty chunk when there is
    no target at all), so every process takes part in the output layer's backward.
    """
    B = hidden.shape[0]
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX  # [B, T-1]
    h_all, y_all = hidden[:, :-1], shift_labels
    runs: list[tuple[object, int, int]] = []
    row = 0
    for key, start, end in sorted(groups, key=lambda g: g[1]):
        if start > row:
            runs.append((None, row, start))
        runs.append((key, start, end))
        row = end
    if row < B:
        runs.append((None, row, B))
    pieces: list[torch.Tensor] = []
    recompute = int(mask.sum()) > chunk_tokens  # more than one chunk of logits: free each after its use
    for key, start, end in runs:
        m = mask[start:end]
        h, y = h_all[start:end][m], y_all[start:end][m]  # [n, H], [n]: row-major, as mask order
        for a in range(0, h.shape[0], chunk_tokens):
            piece = (h[a : a + chunk_tokens], y[a : a + chunk_tokens])
            pieces.append(_chunk_loss(project, key, *piece, recompute=recompute))
    if not pieces:  # nothing to predict here: one empty chunk keeps the graph whole
        pieces.append(_chunk_loss(project, None, h_all[:0, 0], y_all[:0, 0], recompute=False))
    out = torch.zeros(B, shift_labels.shape[1], dtype=torch.float32, device=hidden.device)
    return out.masked_scatter(mask, torch.cat(pieces)) if mask.any() else out + pieces[0].sum()


def _ce(project: Callable, key: object, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(project(key, h).float(), y, reduction="none")


def _chunk_loss(
    project: Callable, key: object, h: torch.Tensor, y: torch.Tensor, recompute: bool
) -> torch.Tensor:
    if recompute and torch.is_grad_enabled():
        return checkpoint(_ce, project, key, h, y, use_reentrant=False)
    return _ce(project, key, h, y)


# -- activation checkpointing ---------------------------------------------------------------------


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model (``_no_split_modules`` classes), in order."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def checkpoint_blocks(model: nn.Module, every: int) -> list[int]:
    """Checkpoint decoder blocks ``0, every, 2*every, ...`` (none when ``every`` is 0); returns their
    indices. Only training forwards with gradients are checkpointed (evaluation and generation run
    as before)."""
    if every <= 0:
        return []
    chosen = []
    for i, block in enumerate(decoder_blocks(model)):
        if i % every == 0:
            block.forward = functools.partial(_checkpointed, block, block.forward)
            chosen.append(i)
    return chosen


# Names under which transformers has passed a decoder block its KV cache: ``cache`` since 5.x (which
# deprecates ``past_key_values``), ``past_key_value`` and ``layer_past`` in older and GPT-style blocks.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(name: str, value: object) -> bool:
    """Whether the block argument ``name=value`` is a KV cache: by type (a transformers ``Cache``,
    whatever the argument is called in this version) or, for legacy tuples, by name."""
    return value is not None and (isinstance(value, Cache) or name in _CACHE_KWARGS)


def _checkpointed(block: nn.Module, forward: Callable, *args, **kwargs):
    if block.training and torch.is_grad_enabled():
        # A KV cache would be appended to twice (forward and recomputation), and the recomputed
        # attention would then see every key twice ([.., T, 2T] scores): training needs none.
        kwargs = {k: None if _is_cache(k, v) else v for k, v in kwargs.items()}
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)
