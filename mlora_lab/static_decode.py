"""The GPU sampler: a static KV cache, and each decode step replayed as one CUDA graph, with per-row adapters.

:func:`mlora_lab.sampling.sample`'s decode loop is launch-bound on a GPU: every step of a small batch is a
few hundred small kernels, each launched from Python, and the batch shrinks as rows stop (new shapes each
time). Here (``sample(..., static=True)``; the default on a single CUDA process) the shapes never change:

- the batch is ``B`` rows, the sample rows padded up to a power of two (a bucket; rows that stop keep
  computing and their tokens are dropped), over a transformers ``StaticCache`` of ``L`` positions (the
  longest prompt plus the most new tokens, rounded up to :data:`LENGTH_STEP`);
- every input of a step lives in a fixed buffer: the tokens [B, 1], their positions [B, 1], the
  attention mask [B, 1, 1, L] (one more position opened per step, by the step itself), and the rows'
  adapter slots [B] (:attr:`~mlora_lab.lora.layer.LoRARouting.row_slots`: each LoRA layer gathers its row's
  adapter from a stack of all of them, :func:`mlora_lab.lora.grouped.per_row`), so that on CUDA the
  forward is captured once per (bucket, length, tenants) as a ``torch.cuda.CUDAGraph`` and replayed;
- the next token is chosen on the device (greedy rows: ``argmax``; the others: a uniform from a counter
  hash of the row's seed and the step, :func:`uniforms`, through the inverse CDF as in ``sampling``), and
  goes into the token buffer without a trip to the host;
- the host reads a step's tokens (one copy a step, into pinned memory) while the device runs the next
  step, and checks stop tokens and stop strings there: off the critical path. A row's stop is seen one step
  late, and that step's token dropped.

The prefill runs the prompts eagerly (each sample row its own copy of its prompt: the static cache is laid
out per row) with the usual grouped LoRA. On the CPU the same code runs without capture (tests); the CPU
keeps ``sample``'s dynamic path by default.

Greedy output equals the dynamic path's (and PEFT ``generate``'s, to the rounding that can flip a near
tie); sampled output is reproducible from the requests' seeds, and is not the dynamic path's (another
random stream: one counter hash on the device instead of a ``torch.Generator`` per row).
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StaticCache

from mlora_lab.batching import cache_keyword, left_pad
from mlora_lab.lora import grouped
from mlora_lab.lora.model import MultiLoRAModel

LENGTH_STEP = 64
"""The cache length is rounded up to a multiple of this: calls of similar lengths share a graph."""

KEEP_DECODERS = 4
"""Decoders (a static cache and its graph each) kept on a model for later calls, the least recently used
dropped first."""

_MASK64 = (1 << 64) - 1


def bucket(rows: int) -> int:
    """The batch size ``rows`` sample rows run at: the next power of two."""
    return 1 << max(0, math.ceil(math.log2(max(rows, 1))))


def uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """``U[0, 1)`` float32 per row from its 63-bit ``seeds`` [n] (int64) and the step: splitmix64 of
    ``seed + step · φ``, its top 24 bits. Done on the device in one batch; a row's draws depend on its seed
    alone, wherever it sits."""
    x = seeds + _signed((step + 1) * 0x9E3779B97F4A7C15)  # (int64 sums and products wrap, as uint64's do)
    x = _mix(x, 30, _signed(0xBF58476D1CE4E5B9))
    x = _mix(x, 27, _signed(0x94D049BB133111EB))
    x = x ^ _shr(x, 31)
    return _shr(x, 40).to(torch.float32) * (1.0 / (1 << 24))


def _signed(v: int) -> int:
    """``v`` mod 2^64 as a signed int64 (the same bits)."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor, k: int, m: int) -> torch.Tensor:
    return (x ^ _shr(x, k)) * m


@dataclass
class RowSettings:
    """The sampling settings of a batch's rows, as device tensors [B] (padding rows: greedy)."""

    temperature: torch.Tensor  # float32; 0: greedy
    top_k: torch.Tensor  # long; V: off
    top_p: torch.Tensor  # float32; inf: off
    seeds: torch.Tensor  # int64
    greedy: bool  # every row is greedy
    filtered: bool  # some row uses top-k or top-p


def choose(
    logits: torch.Tensor, rows: RowSettings, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next token of every row from ``logits`` [B, V] (float32), with ``sampling``'s rules (temperature,
    then top-k, then top-p; greedy at temperature 0): ``(tokens, raw logprobs, sampling logprobs)``, each
    [B], computed on the device without reading anything back."""
    raw = logits.log_softmax(-1)
    greedy = logits.argmax(-1)
    if rows.greedy:
        return greedy, raw.gather(1, greedy[:, None])[:, 0], torch.zeros_like(raw[:, 0])
    V = logits.shape[-1]
    drawn = rows.temperature > 0
    z = logits / torch.where(drawn, rows.temperature, 1.0)[:, None]
    if rows.filtered:
        ranked, order = z.sort(dim=-1, descending=True)
        remove = torch.arange(V, device=z.device)[None] >= rows.top_k[:, None]
        probs = ranked.masked_fill(remove, -math.inf).softmax(-1)
        remove |= probs.cumsum(-1) - probs >= rows.top_p[:, None]
        z = z.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), -math.inf)
    logp = z.log_softmax(-1)
    cdf = logp.exp().cumsum(-1)
    u = uniforms(rows.seeds, step)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
    last = torch.where(torch.isfinite(logp), torch.arange(V, device=z.device), -1).amax(-1)
    tokens = torch.where(torch.isinf(logp.gather(1, tokens[:, None])[:, 0]), last, tokens)
    tokens = torch.where(drawn, tokens, greedy)
    sampling = torch.where(drawn, logp.gather(1, tokens[:, None])[:, 0], 0.0)
    return tokens, raw.gather(1, tokens[:, None])[:, 0], sampling


class Decoder:
    """A static cache of ``rows`` × ``length`` and the buffers of a decode step over it, captured as a CUDA
    graph on CUDA (see the module docstring). Made by :func:`decoder`, kept on the model for later calls
    of the same shape and tenants."""

    def __init__(self, model: MultiLoRAModel, rows: int, length: int, slots: tuple[int, ...]) -> None:
        self.model, self.rows, self.length, self.slots = model, rows, length, slots
        device = model.model.get_input_embeddings().weight.device
        self.device = device
        self.cache = StaticCache(config=model.model.config, max_cache_len=length)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)  # the cache position the step writes
        self.row_slots = torch.full((rows,), model.max_tenants, dtype=torch.long, device=device)
        self.eager_mask = model.model.config._attn_implementation != "sdpa"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.pinned: list[Any] = []  # what a captured graph reads: kept alive with it
        self.pinned_host: list[torch.Tensor] = []  # where a step's tokens and logprobs are copied to

    def step(self) -> torch.Tensor:
        """One decode step over the buffers: open position ``at`` in the mask, run the model on ``tokens`` at
        ``positions``, advance ``at`` and ``positions``; the last logits [B, V] (float32)."""
        self.mask.index_fill_(-1, self.at, True)
        mask = self.mask
        if self.eager_mask:  # (eager attention adds a float mask)
            mask = torch.where(mask, 0.0, torch.finfo(self.model.model.dtype).min).to(self.model.model.dtype)
        routing = self.model.routing
        saved = routing.segments, routing.num_rows, routing.row_slots, routing.slots
        routing.segments, routing.num_rows = None, self.rows
        routing.row_slots, routing.slots = self.row_slots, self.slots
        try:
            out = self.model.model(
                input_ids=self.tokens,
                position_ids=self.positions,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{_cache_keyword(self.model): self.cache},
            )
        finally:
            routing.segments, routing.num_rows, routing.row_slots, routing.slots = saved
        self.at += 1
        self.positions += 1
        return out.logits[:, -1].float()

    def capture(self) -> None:
        """Capture :meth:`step` as a CUDA graph (after warm-up steps on a side stream, as CUDA graphs need),
        then reset the cache and buffers it advanced."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.step()
        self.graph = graph
        self.pinned = [*grouped._CACHE.values(), *grouped._LOOKUP.values()]
        self.reset()

    def run(self) -> torch.Tensor:
        """One decode step: the graph's replay where there is one, else :meth:`step`."""
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.logits

    def reset(self) -> None:
        self.cache.reset()
        self.mask.zero_()
        self.at.zero_()


def _cache_keyword(model: MultiLoRAModel) -> str:
    return cache_keyword(type(model.model))


def tenants_key(model: MultiLoRAModel) -> tuple:
    """What a captured graph depends on besides shapes: each tenant's slot and the addresses of its
    tensors (a graph reads them where they were at capture)."""
    return tuple(
        (t.slot, *(p.data_ptr() for p, _ in model.tenant_slices(name)))
        for name, t in sorted(model.tenants.items())
    )


def decoder(model: MultiLoRAModel, rows: int, length: int) -> Decoder:
    """A :class:`Decoder` for ``rows`` × ``length`` over the model's current tenants: a kept one when the
    shape and the tenants match (its cache reset), else a new one (captured on CUDA)."""
    key = (rows, length, tenants_key(model))
    kept: OrderedDict = model.__dict__.setdefault("_decoders", OrderedDict())
    found = kept.get(key)
    if found is not None:
        kept.move_to_end(key)
        found.reset()
        return found
    for old in [k for k in kept if k[2] != key[2]]:  # other tenants: those graphs read freed tensors
        del kept[old]
    while len(kept) >= KEEP_DECODERS:  # (each holds a KV cache of its rows × length)
        kept.popitem(last=False)
    made = Decoder(model, rows, length, tuple(sorted(t.slot for t in model.tenants.values())))
    if made.device.type == "cuda":
        try:
            made.capture()
        except Exception as e:  # (the eager static step still runs: slower, the same tokens)
            warnings.warn(
                f"the decode step could not be captured as a CUDA graph ({type(e).__name__}: {e}); "
                "it runs eagerly",
                stacklevel=2,
            )
            made.graph = None
            made.reset()
    kept[key] = made
    return made


def prefill_mask(prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, T, L] bool: query ``q`` sees the prompt's real tokens up to itself; a padding position sees
    itself alone (so no row of the softmax is empty); no position past the prompt."""
    B, T = prompt_mask.shape
    q = torch.arange(T, device=prompt_mask.device)
    sees = (q[None, :] <= q[:, None])[None] & prompt_mask[:, None, :].bool()  # [B, T, T]
    sees |= torch.eye(T, dtype=torch.bool, device=prompt_mask.device)[None]
    out = torch.zeros(B, 1, T, length, dtype=torch.bool, device=prompt_mask.device)
    out[:, 0, :, :T] = sees
    return out


def row_settings(rows: Sequence[Any], B: int, vocab: int, device: torch.device) -> RowSettings:
    """:class:`RowSettings` of ``rows`` (``sampling._Row``, with ``seed``) padded to ``B`` greedy rows."""
    pad = B - len(rows)
    temperature = [r.temperature for r in rows] + [0.0] * pad
    top_k = [min(r.top_k or vocab, vocab) for r in rows] + [vocab] * pad
    top_p = [r.top_p if r.top_p < 1 else math.inf for r in rows] + [math.inf] * pad
    seeds = [r.seed for r in rows] + [0] * pad
    return RowSettings(
        torch.tensor(temperature, dtype=torch.float32).to(device),
        torch.tensor(top_k, dtype=torch.long).to(device),
        torch.tensor(top_p, dtype=torch.float32).to(device),
        torch.tensor(seeds, dtype=torch.long).to(device),
        greedy=all(t == 0 for t in temperature),
        filtered=any(r.top_k is not None or r.top_p < 1 for r in rows),
    )


def run(
    model: MultiLoRAModel,
    rows: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    pad: int,
    tokenizer: Any,
    record: Any,
) -> None:
    """Generate every row of ``rows`` (``sampling._Row``, each with its prompt ``prompts[i]``) to its end:
    prefill, then decode steps over a :class:`Decoder`, ``record(row, token, raw, sampling)`` called on the
    host for each new token of a running row (it sets ``row.done``)."""
    device = model.model.get_input_embeddings().weight.device
    S = len(rows)
    B = bucket(S)
    padded = [list(p) for p in prompts] + [[pad]] * (B - S)
    T = max(len(p) for p in padded)
    new = max(r.max_new_tokens for r in rows)
    length = LENGTH_STEP * math.ceil((T + new) / LENGTH_STEP)
    d = decoder(model, B, length)
    input_ids, prompt_mask, positions = left_pad(padded, pad, device)
    mask = prefill_mask(prompt_mask, length)
    if d.eager_mask:
        mask = torch.where(mask, 0.0, torch.finfo(model.model.dtype).min).to(model.model.dtype)
    model.set_routing([r.tenant for r in rows] + [None] * (B - S), B)
    logits = (
        model.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{_cache_keyword(model): d.cache},
        )
        .logits[:, -1]
        .float()
    )
    d.mask[:, 0, 0, :T] = prompt_mask.bool()
    d.at.fill_(T)
    d.positions.copy_(positions[:, -1:] + 1)
    slots = [model.max_tenants if r.tenant is None else model.tenants[r.tenant].slot for r in rows]
    d.row_slots.copy_(torch.tensor(slots + [model.max_tenants] * (B - S)))
    settings = row_settings(rows, B, logits.shape[-1], device)
    step = 0
    chosen = choose(logits, settings, step)
    fetch = _to_host(chosen, d)
    while True:
        d.tokens.copy_(chosen[0][:, None])
        more = step + 1 < new  # (a row may still want a token after this one)
        if more:
            logits = d.run()  # queued on the device while the host reads the last step's tokens
        tokens, raw, sampling = fetch()
        for j, row in enumerate(rows):
            if not row.done:
                record(row, tokens[j], raw[j], sampling[j])
        if not more or all(row.done for row in rows):
            break
        step += 1
        chosen = choose(logits, settings, step)
        fetch = _to_host(chosen, d)


def _to_host(tensors: Sequence[torch.Tensor], d: Decoder):
    """Start copying ``tensors`` ([B] each) to the host; the returned function waits for them and gives
    them as lists. On CUDA the copy goes into pinned memory and does not wait for the device."""
    if d.device.type != "cuda":
        values = [t.tolist() for t in tensors]
        return lambda: values
    if not d.pinned_host:
        d.pinned_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for buffer, t in zip(d.pinned_host, tensors):
        buffer.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def wait() -> list[list]:
        done.synchronize()
        return [buffer.tolist() for buffer in d.pinned_host]

    return wait
