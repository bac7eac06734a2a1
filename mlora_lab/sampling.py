"""One batched generation for many tenants: every request's samples, each row with its own adapter.

    >>> out = sample(mm, [SampleRequest(prompt=ids_a, tenant="alice", num_samples=8, max_new_tokens=64, seed=1),
    ...                   SampleRequest(prompt=ids_b, tenant=None, temperature=0.0)], tokenizer=tok)
    >>> out[0].tokens, out[0].logprobs, out[0].stop_reason     # request 0, sample 0

The RL driver (each RL tenant's prompts x ``group_size``) and the service's sampler call it; it knows
nothing about jobs, rewards or processes.

**The decode loop.** Requests are put in tenant order (the rows of one tenant contiguous, so each
LoRA layer does one pair of small matmuls per tenant), and ``R`` requests with ``S = Σ num_samples``
samples run as one batch through :meth:`MultiLoRAModel.forward` (``tenants`` routes each row to its
adapter, ``None`` to the plain base) with a transformers ``DynamicCache``:

    prefill   input_ids, attention_mask, position_ids [R, T]  (left-padded to the longest prompt T)
              → logits of the last position [R, V] (of every position [R, T, V] when a request asks
              for its prompt's logprobs); the cache [R, heads, T, d] is then repeated to
              the samples' rows [S, heads, T, d] (each prompt is computed once, whatever num_samples)
    step k    every row draws its token from its logits [B, V]; rows that stopped leave the batch
              (the cache, mask and routing are cut to the rows still running: B shrinks)
              → input_ids [B, 1], position_ids [B, 1], attention_mask [B, T + k + 1] → logits [B, V]

Position ids count real tokens only (``cumsum(mask) - 1``), so a left-padded row computes what it
would alone: padding is masked out of attention and shifts no position.

**Choosing a token.** With ``z`` the model's logits at that step (float32): ``temperature == 0`` takes
``argmax z`` (greedy); otherwise the token is drawn from ``softmax(z / temperature)`` restricted to
the ``top_k`` most likely tokens, then to the smallest set of them whose probability reaches
``top_p`` (HF's order: temperature, top-k, top-p), renormalised. Each sample row draws from its own
``torch.Generator`` seeded from ``(request seed, sample index)`` (:func:`row_seed`), so a completion
is the same whatever else is in the batch and wherever its row sits (up to floating-point
differences in the logits of differently shaped batches, ~1e-7, which could flip a draw that falls
within that distance of a boundary). Draws are reproducible on one device type (CPU and CUDA
generators differ).

**Logprobs.** Each sampled token gets two numbers:

- ``logprobs``: ``log_softmax(z)[token]``, the raw logits at temperature 1 with no top-k/top-p: the
  model's own log-probability of the token, what a forward pass over the same tokens gives (vLLM's
  ``raw_logprobs``; what a Tinker-style loss compares a training forward with). Temperature, top-k
  and top-p do not change it.
- ``sampling_logprobs``: the log-probability under the distribution the token was actually drawn
  from, ``log_softmax(filter(z / temperature))[token]`` (vLLM's ``processed_logprobs``, which TRL
  1.16 asks vLLM for; TRL scores its own policy with ``log_softmax(z / temperature)``, equal to this
  when top-k and top-p are off). ``0.0`` for greedy rows.

**Stopping.** A row stops at the first of: a token in ``stop_token_ids`` (reason ``"eos"``; the token
is kept, with its logprob), a stop string (``"stop"``), or ``max_new_tokens`` tokens (``"length"``).
Stop strings are looked for in ``tokenizer.decode(completion, skip_special_tokens=True)`` after
each token (the completion's text only, not the prompt's; only its last characters, where a new one can
end: :func:`_has_stop_string`); the completion ends with the token that
completes the first stop string, so the stop string is **kept** (as in HF ``generate``; that token
may carry a few characters after it).

**Distributed** (FSDP2, TP, EP): every forward has collectives, so every process must run the same
number of forwards. All processes call :func:`sample` together, each with its own requests (under
TP the processes of one TP group pass the same requests, with seeds: their logits are the same, so
their draws are too), and pass ``any_running``: a function that takes whether this process still has
a running row and returns whether any process has (an all-reduce of a flag). It is called once after
every forward, on every process; all stop together when it returns ``False``. A process with nothing
left to run (or no requests at all) keeps feeding one idle row, whose output is thrown away, until
then. Without ``any_running`` a process stops when its own rows have.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from mlora_lab.batching import cache_keyword, left_pad
from mlora_lab.lora.model import MultiLoRAModel

StopReason = Literal["eos", "stop", "length"]
MAX_TOP_LOGPROBS = 20
"""The most likely tokens a request may ask for at each step (OpenAI's bound for ``top_logprobs``)."""


@dataclass(frozen=True)
class SampleRequest:
    """``num_samples`` completions of one prompt by one tenant (``None``: the plain base model)."""

    prompt: Sequence[int]
    """Prompt token ids (``tokenizer(text).input_ids`` or a rendered chat), at least one."""
    tenant: str | None = None
    num_samples: int = 1
    max_new_tokens: int = 16
    """At most this many tokens per completion (``len(prompt) + max_new_tokens`` must fit the model)."""
    temperature: float = 1.0
    """``0``: greedy (argmax of the logits); otherwise the logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches ``top_p``."""
    top_k: int | None = None
    """Only the ``top_k`` most likely tokens may be drawn (``None``: all)."""
    stop_token_ids: Sequence[int] | None = None
    """Stop after any of these tokens (kept in the completion); ``None``: the model's EOS ids."""
    stop_strings: Sequence[str] = ()
    """Stop once the completion's text contains any of these (needs ``tokenizer``; the string is kept)."""
    seed: int | None = None
    """Seeds sample ``i``'s generator with :func:`row_seed` ``(seed, i)``; ``None``: a seed drawn from
    torch's global generator (reproducible under ``torch.manual_seed``)."""
    prompt_logprobs: bool = False
    """Also give the prompt's own logprobs (then the prefill keeps every position's logits, [R, T, V])."""
    top_logprobs: int = 0
    """Also give, at every completion token, the ``top_logprobs`` most likely tokens and their raw logprobs
    (what OpenAI's ``top_logprobs`` asks; 0: none)."""
    first_sample: int = 0
    """Sample ``i`` draws as sample ``first_sample + i`` of the same request would (``row_seed(seed,
    first_sample + i)``): one sample of a group asked on its own (an agent's turn) draws what the group's
    member draws."""


@dataclass
class Completion:
    """Sample ``index`` of request ``request``: its new tokens and why it stopped."""

    request: int
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """``log_softmax(z)[token]`` per token: the model's own log-probability (see the module doc)."""
    sampling_logprobs: list[float] = field(default_factory=list)
    """Log-probability under the distribution the token was drawn from (``0.0`` when greedy)."""
    stop_reason: StopReason = "length"
    prompt_logprobs: list[float | None] | None = None
    """When asked: ``[None, log p(prompt[1] | prompt[:1]), ..., log p(prompt[n-1] | prompt[:n-1])]``
    (raw logits, like ``logprobs``; the first token has no logprob)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """When asked (``SampleRequest.top_logprobs``): per completion token, ``(token, raw logprob)`` of the most
    likely tokens there, most likely first."""
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    """When both the prompt's logprobs and ``top_logprobs`` are asked: the most likely tokens at each prompt
    position but the first (``[]`` there), as ``top_logprobs``: whether the prompt is the greedy text."""


def row_seed(seed: int, index: int) -> int:
    """The generator seed of sample ``index`` of a request with ``seed``: 63 bits of a hash of both
    (not ``seed + index``, which would give request seed 1's sample 0 the draws of seed 0's sample 1)."""
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def default_stop_ids(model: MultiLoRAModel, tokenizer: Any = None) -> list[int]:
    """The ids ``stop_token_ids=None`` means: the generation config's EOS (as HF ``generate`` uses),
    else the model config's, else the tokenizer's; none at all is an empty list."""
    eos = getattr(getattr(model.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def request_problems(
    model: MultiLoRAModel, requests: Sequence[SampleRequest], tokenizer: Any = None
) -> list[str]:
    """Every problem of ``requests`` for ``model``, one line each (empty: all can run)."""
    config = model.model.config
    vocab = getattr(config, "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None)
    problems = []
    for i, r in enumerate(requests):
        where = f"request {i}"
        if not isinstance(r, SampleRequest):
            problems.append(f"{where}: a {type(r).__name__}, not a SampleRequest")
            continue
        if len(r.prompt) == 0:
            problems.append(f"{where}: the prompt is empty (give at least one token, e.g. BOS)")
        bad_ids = [t for t in r.prompt if not _is_token(t, vocab)]
        if bad_ids:
            problems.append(f"{where}: prompt token ids that are not integers in [0, {vocab}): {bad_ids[:5]}")
        if r.tenant is not None and r.tenant not in model.tenants:
            problems.append(f"{where}: unknown tenant {r.tenant!r}; tenants: {sorted(model.tenants)}")
        if not _is_int(r.num_samples) or r.num_samples < 1:
            problems.append(f"{where}: num_samples must be an integer >= 1, got {r.num_samples!r}")
        if not _is_int(r.max_new_tokens) or r.max_new_tokens < 1:
            problems.append(f"{where}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
        elif positions is not None and len(r.prompt) + r.max_new_tokens > positions:
            problems.append(
                f"{where}: prompt ({len(r.prompt)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds "
                f"the model's {positions} positions"
            )
        if not _is_real(r.temperature) or not math.isfinite(r.temperature) or r.temperature < 0:
            problems.append(f"{where}: temperature must be a finite number >= 0, got {r.temperature!r}")
        if not _is_real(r.top_p) or not 0 < r.top_p <= 1:
            problems.append(f"{where}: top_p must be in (0, 1], got {r.top_p!r}")
        if r.top_k is not None and (not _is_int(r.top_k) or r.top_k < 1):
            problems.append(f"{where}: top_k must be None or an integer >= 1, got {r.top_k!r}")
        if r.stop_token_ids is not None:
            bad_stops = [t for t in r.stop_token_ids if not _is_token(t, vocab)]
            if bad_stops:
                problems.append(
                    f"{where}: stop token ids that are not integers in [0, {vocab}): {bad_stops[:5]}"
                )
        if isinstance(r.stop_strings, str):
            problems.append(
                f"{where}: stop_strings must be a list of strings, got the string {r.stop_strings!r}"
            )
        elif r.stop_strings:
            if any(not isinstance(s, str) or not s for s in r.stop_strings):
                problems.append(
                    f"{where}: stop strings must be non-empty strings, got {list(r.stop_strings)!r}"
                )
            if tokenizer is None:
                problems.append(f"{where}: stop strings need a tokenizer (pass tokenizer=...)")
        if r.seed is not None and not _is_int(r.seed):
            problems.append(f"{where}: seed must be an integer or None, got {r.seed!r}")
        if not _is_int(r.top_logprobs) or not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            problems.append(
                f"{where}: top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {r.top_logprobs!r}"
            )
    return problems


@dataclass
class _Row:
    """One sample row's settings and what it has produced so far."""

    out: Completion
    tenant: str | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    stops: frozenset[int]
    stop_strings: tuple[str, ...]
    generator: torch.Generator | None
    seed: int = 0  # :func:`row_seed` of the request's seed and the sample's index (the static path's draws)
    top: int = 0  # the most likely tokens recorded at each step (SampleRequest.top_logprobs)
    done: bool = False


@torch.no_grad()
def sample(
    model: MultiLoRAModel,
    requests: Sequence[SampleRequest],
    *,
    tokenizer: Any = None,
    any_running: Callable[[bool], bool] | None = None,
    static: bool | None = None,
) -> list[Completion]:
    """Sample every request's completions in one batch (see the module docstring for the loop, the
    logprobs, the stop rules and the distributed contract).

    ``static``: decode over a static KV cache with each step one CUDA graph
    (:mod:`mlora_lab.static_decode`); ``None`` (the default) does so on a single CUDA process (no
    ``any_running``) for a dense model when no request asks for its prompt's logprobs, and keeps the
    dynamic loop everywhere else (the CPU among them).

    Returns one :class:`Completion` per sample, request by request (``request`` 0's samples
    ``0 .. num_samples - 1`` first). Bad requests raise one ``ValueError`` naming every problem, before
    any forward. The model runs in eval mode (no dropout) and is put back in its mode afterwards.
    """
    requests = list(requests)
    problems = request_problems(model, requests, tokenizer)
    if problems:
        raise ValueError("bad sampling requests:\n  - " + "\n  - ".join(problems))
    if not requests and any_running is None:
        return []
    device = model.model.get_input_embeddings().weight.device
    pad = getattr(model.model.config, "pad_token_id", None) or 0
    eos = frozenset(default_stop_ids(model, tokenizer))

    # Tenant order: each tenant's rows contiguous, in order of first appearance.
    first: dict[str | None, int] = {}
    for r in requests:
        first.setdefault(r.tenant, len(first))
    order = sorted(range(len(requests)), key=lambda i: first[requests[i].tenant])
    rows: list[_Row] = []
    expand: list[int] = []  # prefill row of each sample row
    for p, i in enumerate(order):
        r = requests[i]
        seed = r.seed
        if seed is None and r.temperature > 0:
            seed = int(torch.randint(0, 2**63 - 1, ()))
        for k in range(r.num_samples):
            generator = None
            if r.temperature > 0:
                generator = torch.Generator(device=device).manual_seed(row_seed(seed, r.first_sample + k))
            stops = eos if r.stop_token_ids is None else frozenset(int(t) for t in r.stop_token_ids)
            settings = (r.max_new_tokens, float(r.temperature), float(r.top_p), r.top_k, stops)
            row_s = row_seed(seed, r.first_sample + k) if r.temperature > 0 else 0
            row = _Row(Completion(i, k), r.tenant, *settings, tuple(r.stop_strings), generator, row_s)
            if r.top_logprobs:
                row.top, row.out.top_logprobs = r.top_logprobs, []
            rows.append(row)
            expand.append(p)

    if static is None:
        static = (
            device.type == "cuda"
            and any_running is None
            and not _has_experts(model)  # (an MoE router's token groups have data-dependent shapes)
            and not any(r.prompt_logprobs or r.top_logprobs for r in requests)
        )
    if static and rows:
        from mlora_lab import static_decode

        if any_running is not None or any(r.prompt_logprobs for r in requests):
            raise ValueError("static decoding runs on a single process without prompt logprobs")
        saved_routing = model.routing.segments, model.routing.num_rows
        was_training = model.training
        model.eval()
        try:
            prompts = [list(requests[i].prompt) for i in order]
            static_decode.run(model, rows, [prompts[p] for p in expand], pad, tokenizer, _recorder(tokenizer))
        finally:
            model.train(was_training)
            model.routing.segments, model.routing.num_rows = saved_routing
        return sorted((row.out for row in rows), key=lambda c: (c.request, c.index))

    prompts = [list(requests[i].prompt) for i in order] or [[pad]]  # no requests: one idle row
    tenants = [requests[i].tenant for i in order] or [None]
    input_ids, mask, positions = left_pad(prompts, pad, device)
    next_position = [len(p) for p in prompts]  # [R]: where each row's next token sits

    cache = DynamicCache(config=model.model.config)
    saved_routing = model.routing.segments, model.routing.num_rows
    was_training = model.training
    model.eval()
    try:
        want = [j for j, i in enumerate(order) if requests[i].prompt_logprobs]
        logits = _forward(model, input_ids, tenants, mask, positions, cache, every_position=bool(want))
        prompt_lps = {j: _prompt_logprobs(logits[j], input_ids[j], len(prompts[j])) for j in want}
        tops = {j: _prompt_top(logits[j], len(prompts[j]), requests[order[j]].top_logprobs)
                for j in want if requests[order[j]].top_logprobs}  # fmt: skip
        for row, p in zip(rows, expand):
            if p in prompt_lps:
                row.out.prompt_logprobs = list(prompt_lps[p])
            if p in tops:
                row.out.prompt_top_logprobs = [list(step) for step in tops[p]]
        logits = logits[:, -1].float()  # [R, V]
        batch: list[_Row | None] = list(rows) or [None]  # the rows in the batch; None: the idle row
        if rows:
            index = torch.tensor(expand, device=device)
            cache.batch_select_indices(index)
            mask, logits = mask[index], logits[index]
            next_position = [next_position[p] for p in expand]
        while True:
            _choose(logits, batch, tokenizer)
            running = any(row is not None and not row.done for row in batch)
            if not (any_running(running) if any_running is not None else running):
                break
            keep = [j for j, row in enumerate(batch) if row is not None and not row.done] or [0]
            if len(keep) < len(batch):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask = mask[index]
                # nothing running here: a stopped row stays as the idle row, its output thrown away
                batch = [None if batch[j] is None or batch[j].done else batch[j] for j in keep]
                next_position = [next_position[j] for j in keep]
            last = [[pad if row is None else row.out.tokens[-1]] for row in batch]
            step_ids = torch.tensor(last, dtype=torch.long).to(device)  # [B, 1]
            step_positions = torch.tensor([[p] for p in next_position], dtype=torch.long).to(device)
            mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)  # [B, T + k + 1]
            step_tenants = [None if row is None else row.tenant for row in batch]
            logits = _forward(model, step_ids, step_tenants, mask, step_positions, cache)[:, -1].float()
            # an idle row stays at its position: its output is thrown away, and it must not walk past
            # the model's positions while other processes finish long completions
            next_position = [p if row is None else p + 1 for p, row in zip(next_position, batch)]
    finally:
        model.train(was_training)
        model.routing.segments, model.routing.num_rows = saved_routing
    return sorted((row.out for row in rows), key=lambda c: (c.request, c.index))


def _forward(
    model: MultiLoRAModel,
    input_ids: torch.Tensor,
    tenants: list[str | None],
    mask: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    every_position: bool = False,
) -> torch.Tensor:
    """One forward of ``input_ids`` [B, t] (rows routed to ``tenants``) over ``cache`` (extended in
    place; ``mask`` is [B, cached + t]): the logits of the last position [B, 1, V], or of every
    position [B, t, V] with ``every_position``."""
    out = model(
        input_ids,
        tenants=tenants,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=0 if every_position else 1,  # 1: the output layer runs on the last position only
        **{cache_keyword(type(model.model)): cache},
    )
    return out.logits


def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, n: int) -> list[float | None]:
    """``[None, log_softmax(z_0)[p_1], ...]`` for the last ``n`` positions of one left-padded row
    (``logits`` [T, V], ``ids`` [T]): each prompt token's logprob given the tokens before it."""
    T = ids.shape[0]
    logp = logits[T - n : T - 1].float().log_softmax(-1)  # [n - 1, V]
    return [None, *logp.gather(1, ids[T - n + 1 :, None])[:, 0].tolist()]


def _prompt_top(logits: torch.Tensor, n: int, k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely tokens (and their raw logprobs) at each of the last ``n`` positions of one
    left-padded row but the first (``logits`` [T, V]): what each prompt token could have been."""
    T = logits.shape[0]
    values, ids = logits[T - n : T - 1].float().log_softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
    return [[], *(list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))]


def _choose(logits: torch.Tensor, batch: list[_Row | None], tokenizer: Any) -> None:
    """Draw the next token of every running row of ``batch`` from its logits ([B, V], float32) and
    record it (token, both logprobs, whether the row stops); idle and stopped rows draw nothing."""
    live = [j for j, row in enumerate(batch) if row is not None and not row.done]
    if not live:
        return
    tokens = logits.argmax(-1)  # greedy rows keep these
    sampling_lp = torch.zeros(len(batch), device=logits.device)
    drawn = [j for j in live if batch[j].temperature > 0]
    if drawn:
        picked, lp = _draw(logits[drawn], [batch[j] for j in drawn])
        index = torch.tensor(drawn, device=logits.device)
        tokens[index], sampling_lp[index] = picked, lp
    logp = logits.log_softmax(-1)
    raw_lp = logp.gather(1, tokens[:, None])[:, 0]
    # one device sync per step: the stop rules need the tokens on the host
    tokens_h, raw_h, sampling_h = tokens.tolist(), raw_lp.tolist(), sampling_lp.tolist()
    k = max((batch[j].top for j in live), default=0)
    if k:  # (only when a row asks: one topk over the batch)
        top_v, top_i = (t.tolist() for t in logp.topk(min(k, logp.shape[-1]), dim=-1))
    record = _recorder(tokenizer)
    for j in live:
        row = batch[j]
        if row.top and row.out.top_logprobs is not None:
            row.out.top_logprobs.append(list(zip(top_i[j][: row.top], top_v[j][: row.top])))
        record(row, tokens_h[j], raw_h[j], sampling_h[j])


def _has_experts(model: MultiLoRAModel) -> bool:
    config = model.model.config
    return any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def _recorder(tokenizer: Any) -> Callable[[_Row, int, float, float], None]:
    """``record(row, token, raw logprob, sampling logprob)``: append a row's new token and decide whether
    the row stops there (the stop rules of the module docstring)."""

    def record(row: _Row, token: int, raw: float, sampling: float) -> None:
        row.out.tokens.append(token)
        row.out.logprobs.append(raw)
        row.out.sampling_logprobs.append(sampling)
        if token in row.stops:
            row.done, row.out.stop_reason = True, "eos"
        elif row.stop_strings and _has_stop_string(tokenizer, row.out.tokens, row.stop_strings):
            row.done, row.out.stop_reason = True, "stop"
        elif len(row.out.tokens) >= row.max_new_tokens:
            row.done, row.out.stop_reason = True, "length"

    return record


def _draw(logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` [n, V] with each row's temperature, top-k, top-p and
    generator: ``(tokens [n], log-probabilities of them under the filtered distribution [n])``.

    A row's draw depends on its own logits and generator only: top-k / top-p remove tokens in the
    vocabulary's order, so a row draws from the same list whether or not another row filters."""
    V = logits.shape[-1]
    device = logits.device
    z = logits / torch.tensor([r.temperature for r in rows], device=device)[:, None]
    if any(r.top_k is not None or r.top_p < 1 for r in rows):
        ranked, order = z.sort(dim=-1, descending=True)  # [n, V], most likely first
        top_k = torch.tensor([min(r.top_k or V, V) for r in rows], device=device)
        remove = torch.arange(V, device=device)[None] >= top_k[:, None]
        probs = ranked.masked_fill(remove, -math.inf).softmax(-1)
        # keep a token while the mass before it is below top_p: the first token is always kept;
        # rows with top_p = 1 keep all (a float cumsum can pass 1.0 and would cut a tail)
        top_p = torch.tensor([r.top_p if r.top_p < 1 else math.inf for r in rows], device=device)
        remove |= probs.cumsum(-1) - probs >= top_p[:, None]
        z = z.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), -math.inf)
    logp = z.log_softmax(-1)
    # Inverse-CDF draws: one uniform u ~ U[0, 1) from each row's own generator, then the first token whose
    # cumulative probability exceeds u · total (right=True: a token of probability 0 adds no step to the
    # CDF, so it is never drawn). One batched search instead of one multinomial call per row.
    u = torch.cat([torch.rand(1, generator=r.generator, device=device) for r in rows])  # [n]
    cdf = logp.exp().cumsum(-1)  # [n, V]
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
    # (rounding can leave the top of a row's CDF on a run of zero-probability tokens: step back to the
    # last token that has probability)
    tokens = torch.where(torch.isinf(logp.gather(1, tokens[:, None])[:, 0]), _last_possible(logp), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _last_possible(logp: torch.Tensor) -> torch.Tensor:
    """The highest token id of each row of ``logp`` [n, V] with a finite log-probability, [n]."""
    V = logp.shape[-1]
    ids = torch.arange(V, device=logp.device).expand_as(logp)
    return torch.where(torch.isfinite(logp), ids, -1).amax(-1)


STOP_MARGIN = 8
"""Characters of text decoded before the window a stop string can end in (see :func:`_has_stop_string`)."""


def _has_stop_string(tokenizer: Any, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    """Whether the completion ``tokens`` holds a stop string now that its last token came, checked on the
    text of its last tokens only: called after every token, a stop string not there before must end in the
    new token's characters, so only the last ``longest`` characters and the new ones can hold it. Decoding the
    whole completion each time cost O(n²) over an n-token sample. The tail's first characters may decode
    differently from the same place in the whole text (a multi-byte character or a word-start marker cut in
    two), so ``STOP_MARGIN`` more characters are decoded before it; the tail grows (doubling its tokens)
    until it holds that many characters or the whole completion."""
    want = max(len(s) for s in stop_strings) + STOP_MARGIN
    n = min(len(tokens), want)  # (a token decodes to one character or more, except special ones)
    while True:
        text = tokenizer.decode(tokens[-n:], skip_special_tokens=True)
        if len(text) >= want or n == len(tokens):
            return any(s in text for s in stop_strings)
        n = min(len(tokens), 2 * n)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_token(t: object, vocab: int | None) -> bool:
    return _is_int(t) and t >= 0 and (vocab is None or t < vocab)
