"""The base model and what the tenants ask of it: its config and weights load, its tokenizer loads and
fits its embedding, every target names layers it has (linear layers, or packed expert parameters),
and the tenants' own tensors fit one device.

    load_model_and_tokenizer(ctx)   sets ctx.model (a meta-device structure) and ctx.tok, or says why not
    check_targets(ctx, t)           target_modules / target_parameters against the model
    check_slot_modules(ctx, ts)     slot_modules against the model, and every target inside them
    check_vocab(ctx)                the ids the job inserts (BOS, EOS, padding) are rows of the embedding
    check_memory(ctx, ts)           the tenants' adapters, gradients and AdamW state fit one device

Every check but the first is skipped when the model cannot be loaded (that problem is reported).
"""

from __future__ import annotations

import os

from mlora_lab.bases import (
    GGUFBaseError,
    gguf_file,
    gguf_problem,
    gguf_tensor_problem,
    gguf_tokenizer,
    is_gguf,
)
from mlora_lab.lora.targets import ALL_LINEAR, name_matches, suffixes
from mlora_lab.spec.fields import MAX_SLOTS, tenant_label
from mlora_lab.spec.job import valid_targets
from mlora_lab.spec.parts import RL, Parallel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import (
    MAX_JSON_BYTES,
    brief,
    brief_list,
    error_line,
    is_int,
    is_number,
    read_json,
    show_path,
)
from mlora_lab.validate.context import Context, usable_path
from mlora_lab.validate.introspect import device_memory, load_config, model_info
from mlora_lab.validate.weights import safetensors_shapes

# ---------------------------------------------------------------------------------------------
# Loading the model's structure and the tokenizer
# ---------------------------------------------------------------------------------------------


def load_model_and_tokenizer(ctx: Context) -> None:
    """``ctx.model`` and ``ctx.tok``, from the cache when both loaded before without a problem."""
    cache = ctx.cache
    key = ctx.env_key() if cache is not None else None
    if key is not None and key in cache.models:
        ctx.model, ctx.tok = cache.models[key]
        return
    start = len(ctx.out)
    _load_now(ctx)
    if key is not None and len(ctx.out) == start:  # only successes: a fixed path is seen at once
        cache.models[key] = (ctx.model, ctx.tok)


def _load_now(ctx: Context) -> None:
    s = ctx.spec
    base_ok = False
    if usable_path(s.base_model):
        if is_gguf(s.base_model):
            base_ok = _load_gguf(ctx, s.base_model)
        elif not os.path.isdir(s.base_model):
            ctx.say(
                None,
                "base_model",
                f"base_model {brief(s.base_model)} is not a local directory (give the directory of a "
                "model saved with save_pretrained, a .gguf file, or a Hub id: org/name)",
            )
        else:
            base_ok = _load_model(ctx, s.base_model)
    tok_path = s.tokenizer if s.tokenizer is not None else s.base_model
    label = "tokenizer" if s.tokenizer is not None else "tokenizer (base_model)"
    if not usable_path(tok_path) or (s.tokenizer is None and not base_ok):
        return  # already reported (bad type or path, or the base_model problem covers it)
    gguf_tok = is_gguf(tok_path)
    if not gguf_tok and not os.path.isdir(tok_path):
        ctx.say(None, "tokenizer", f"{label} {brief(tok_path)} is not a local directory")
        return
    try:
        from transformers import AutoTokenizer

        # a GGUF's tokenizer (chat template included) is read from its metadata
        ctx.tok = gguf_tokenizer(tok_path) if gguf_tok else AutoTokenizer.from_pretrained(tok_path)
    except Exception as e:
        ctx.say(
            None, "tokenizer", f"{label} {brief(tok_path)}: AutoTokenizer cannot load it ({error_line(e)})"
        )


def _load_gguf(ctx: Context, path: str) -> bool:
    """A GGUF base (``mlora_lab.bases``): one readable ``.gguf`` file whose metadata describes a
    causal LM transformers can load, and whose tensors make that model. Nothing is converted here;
    the launch converts it once, before it creates the run (``resolve_base``)."""
    where = f"base_model {brief(path)}"
    try:
        file = gguf_file(path)
    except GGUFBaseError as e:
        ctx.say(None, "base_model", f"{where}: {e.reason}")
        return False
    assert file is not None
    why = gguf_problem(file)
    if why:
        ctx.say(None, "base_model", f"{where}: {why}")
        return False
    try:
        load_config(path)
    except Exception as e:
        ctx.say(
            None,
            "base_model",
            f"{where}: transformers cannot read a model config from this GGUF ({error_line(e)})",
        )
        return False
    why = gguf_tensor_problem(file)
    if why:
        ctx.say(None, "base_model", f"{where}: {why}")
        return False
    return _read_model_info(ctx, path, where)


def _read_model_info(ctx: Context, path: str, where: str) -> bool:
    """``ctx.model`` from the config at ``path`` (a meta-device build), or a problem."""
    try:
        ctx.model = model_info(os.path.abspath(path))
    except Exception as e:
        ctx.say(None, "base_model", f"{where}: cannot build a causal LM from its config ({error_line(e)})")
        return False
    return True


def _load_model(ctx: Context, path: str) -> bool:
    where = f"base_model {brief(path)}"
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg) and os.path.getsize(cfg) > MAX_JSON_BYTES:
        ctx.say(None, "base_model", f"{where}: config.json is larger than 64 MiB; that is not a model config")
        return False
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path)
    except Exception as e:
        ctx.say(None, "base_model", f"{where} does not hold a loadable transformers config ({error_line(e)})")
        return False
    if not _read_model_info(ctx, path, where):
        return False
    _check_weights(ctx, path, where)
    return True


def _check_weights(ctx: Context, path: str, where: str) -> None:
    """``from_pretrained`` needs the weights next to the config: ``model.safetensors`` (a complete
    file), an index whose shards all exist, or ``pytorch_model.bin``. A config-only directory
    validates the layout but could never train."""
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        _, why = safetensors_shapes(single)
        if why:
            ctx.say(
                None, "base_model", f"{where}: model.safetensors is not usable ({why}); save the model again"
            )
        return
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = os.path.join(path, index)
        if not os.path.isfile(index_path):
            continue
        value, why = read_json(index_path, "an index file")
        weight_map = value.get("weight_map") if isinstance(value, dict) else None
        shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        plain = all(isinstance(f, str) and f and os.path.basename(f) == f and usable_path(f) for f in shards)
        if why or not shards or not plain:
            why = why or "has no weight_map of tensor name -> shard file name"
            ctx.say(None, "base_model", f"{where}: {index} {why}; save the model again")
            return
        missing = [f for f in shards if not os.path.isfile(os.path.join(path, f))]
        if missing:
            ctx.say(
                None,
                "base_model",
                f"{where}: no weights found: {index} lists shard files that are missing "
                f"({brief_list(missing, 5)}); copy every shard next to it",
            )
            return
        for shard in shards if index.startswith("model.safetensors") else []:
            _, why = safetensors_shapes(os.path.join(path, shard))
            if why:
                ctx.say(
                    None,
                    "base_model",
                    f"{where}: shard {show_path(shard)} is not usable ({why}); save the model again",
                )
                return
        return
    if not os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        ctx.say(
            None,
            "base_model",
            f"{where}: no weights found (it has a config but no model.safetensors, "
            "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json); "
            "save the model with save_pretrained",
        )


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def _resolve_modules(ctx: Context, owner: Tenant | None, field: str, targets: list[str]) -> set[str] | None:
    """Full names of the linear layers ``targets`` select; reports unknown / non-linear targets."""
    m = ctx.model
    assert m is not None
    chosen: set[str] = set()
    if ALL_LINEAR in targets:  # alone, or with other names in slot_modules (the union)
        chosen = set(ctx.linear_of([ALL_LINEAR]))
        if not chosen:
            ctx.say(owner, field, f"{field} '{ALL_LINEAR}' matches no linear layer in the model")
            return None
        targets = [t for t in targets if t != ALL_LINEAR]
    unknown: list[str] = []
    ok = True
    for target in targets:
        hits = ctx.modules_named(target)
        if not hits:
            unknown.append(target)
            continue
        not_linear = [(n, cls) for n, cls in hits if n not in m.linear]
        if not_linear:
            n, cls = not_linear[0]
            ctx.say(
                owner,
                field,
                f"{field} {brief(target)} matches modules that are not nn.Linear (e.g. {n}: {cls}); "
                "LoRA goes on linear layers only",
            )
            ok = False
        chosen |= {n for n, _ in hits if n in m.linear}
    if unknown:
        ctx.say(
            owner,
            field,
            f"{field} not found in the model: {brief_list(unknown)} (available: {suffixes(m.linear)})",
        )
        ok = False
    return chosen if ok else None


def check_targets(ctx: Context, t: Tenant) -> None:
    """``target_modules`` name linear layers of the model; ``target_parameters`` name its packed expert
    parameters (and then ``dropout`` is 0: PEFT has none on expert weights)."""
    if ctx.model is None:
        return
    mods = t.target_modules
    if valid_targets(mods) and mods:
        _resolve_modules(ctx, t, "target_modules", mods)
    params = t.target_parameters
    if not (valid_targets(params) and params):
        return
    unknown = [p for p in params if not any(name_matches(n, p) for n in ctx.model.experts)]
    if unknown:
        avail = (
            f"available: {suffixes(ctx.model.experts)}"
            if ctx.model.experts
            else "the model has no 3-D expert parameters"
        )
        ctx.say(
            t,
            "target_parameters",
            f"target_parameters not found in the model: {brief_list(unknown)} ({avail})",
        )
    elif is_number(t.dropout) and t.dropout:
        ctx.say(
            t, "dropout", "dropout must be 0 with target_parameters (PEFT has no dropout on expert weights)"
        )


def check_slot_modules(ctx: Context, tenants: list[Tenant]) -> None:
    """``slot_modules`` name linear layers of the model, and cover every layer a tenant targets."""
    slots = ctx.spec.slot_modules
    if ctx.model is None or slots is None or not valid_targets(slots, union=True):
        return  # no model, no slot_modules, or a type problem already reported
    covered = _resolve_modules(ctx, None, "slot_modules", slots) if slots else set()
    if covered is None:
        return
    for t in tenants:
        if not valid_targets(t.target_modules):
            continue
        outside = [x for x in t.target_modules if ctx.linear_of([x]) - covered]
        if outside:
            ctx.say(
                t,
                "target_modules",
                f"target_modules {brief_list(outside)} not covered by slot_modules {brief(list(slots))}; "
                "add them to slot_modules",
            )


# ---------------------------------------------------------------------------------------------
# Vocabulary and memory
# ---------------------------------------------------------------------------------------------


def check_vocab(ctx: Context) -> None:
    """Token ids index the input embedding. The ids the job itself inserts (BOS, EOS, padding)
    must be rows of it; a tokenizer may have more tokens than rows (some tokenizer classes add
    special tokens a model never saw), and a tenant whose rows contain such ids is refused alone
    when it is loaded, before any of its rows reach the shared forward."""
    m, tok = ctx.model, ctx.tok
    if m is None or tok is None or not is_int(m.vocab):
        return
    used = {name: getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos", "pad")}
    past = {name: i for name, i in used.items() if is_int(i) and not 0 <= i < m.vocab}
    if past:
        label = "tokenizer" if ctx.spec.tokenizer is not None else "tokenizer (base_model)"
        ids = ", ".join(f"{name} id {i}" for name, i in past.items())
        ctx.say(
            None,
            "tokenizer",
            f"{label}: {ids} past the model's input embedding ({m.vocab:,} rows, vocab_size); "
            "use the model's own tokenizer",
        )


def check_quantized_embeddings(ctx: Context) -> None:
    """``quantize_embeddings`` replaces the input embedding by an nf4 ``Embedding4bit`` and the output layer by
    a ``Linear4bit`` (:func:`mlora_lab.quant.quantize_embeddings`): only a plain ``nn.Embedding`` and
    ``nn.Linear`` compute just what those do (a subclass may scale its output, as Gemma's embedding does)."""
    m = ctx.model
    if m is None or ctx.spec.quantize_embeddings is not True:
        return
    embedding, output = m.embeddings
    odd = [
        f"its {what} is a {kind}"
        for what, kind, plain in (
            ("input embedding", embedding, "Embedding"),
            ("output layer", output, "Linear"),
        )
        if kind not in (plain, "")
    ]
    if odd:
        ctx.say(
            None,
            "quantize_embeddings",
            f"quantize_embeddings=True replaces a plain nn.Embedding and nn.Linear by their nf4 versions, but "
            f"{' and '.join(odd)}, which may compute more than its weight does; use quantize_embeddings=False",
        )


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_generation_memory(ctx: Context, tenants: list[Tenant]) -> None:
    """RL tenants generate all their completions at once, every RL tenant's in one batch: a generation
    that cannot fit is refused now rather than killed by the kernel (or CUDA) mid-run. An estimate:

        rows   = Σ over RL tenants of batch_size × grad_accum × group_size × (1 + max_staleness // num_iterations)
        need   = rows × seq_len × kv_per_token × bytes(dtype)        the KV cache (prompt + completion)
               + rows × logits × 4 bytes × 3                          a decode step's logits, probabilities, CDF
               + base parameters × bytes(dtype)                       with rollout ranks: each holds the whole base

    (a tenant that samples ahead draws its first ``1 + max_staleness // num_iterations`` generations in one
    batch) against the device's memory (the training ranks' base, sharded, and the adapters come on top: a
    generation that needs more than all of it cannot run)."""
    m = ctx.model
    mem = device_memory() if m is not None else None
    rl = [t for t in tenants if isinstance(t.rl, RL)]  # (a hostile value is another check's to report)
    if m is None or mem is None or not rl:
        return
    total, device = mem
    dtype = ctx.spec.dtype
    if dtype == "auto":  # (bfloat16 on a GPU: the engine's rule, mlora_lab.job.engine.base_dtype)
        dtype = "bfloat16" if device.startswith("GPU") else "float32"
    per_token = (m.kv_per_token or 0) * (DTYPE_BYTES.get(dtype, 4) if isinstance(dtype, str) else 4)
    sizes = []
    for t in rl:
        counts = (t.batch_size, t.grad_accum, t.rl.group_size)
        if not all(is_int(c) and c > 0 for c in counts) or not is_int(ctx.spec.seq_len):
            continue
        ahead = 1
        if is_int(t.rl.max_staleness) and is_int(t.rl.num_iterations) and t.rl.num_iterations > 0:
            ahead += max(t.rl.max_staleness, 0) // t.rl.num_iterations
        rows = counts[0] * counts[1] * counts[2] * ahead
        sizes.append((rows * (ctx.spec.seq_len * per_token + (m.logits or 0) * 12), t.name, rows))
    need = sum(size for size, *_ in sizes)
    p = ctx.spec.parallel
    base = 0  # (a rollout rank holds the whole base, never sharded)
    if isinstance(p, Parallel) and is_int(p.rollout_ranks) and p.rollout_ranks > 0:
        hidden = max((i for n, i, _ in m.linear_shapes if n in m.output), default=0)
        params = sum(i * o for _, i, o in m.linear_shapes) + sum(e * o * i for _, e, o, i in m.expert_shapes)
        base = (params + (m.vocab or 0) * hidden) * (
            DTYPE_BYTES.get(dtype, 4) if isinstance(dtype, str) else 4
        )
    if sizes and need + base > total:
        gib = 2**30
        _, name, rows = max(sizes)
        where = f", on a rollout rank beside the whole base (~{base / gib:,.1f} GiB)" if base else ""
        ctx.say(
            None,
            None,
            f"the RL tenants' generation needs about {(need + base) / gib:,.1f} GiB{where} (every completion "
            f"of a step at once: {sum(r for *_, r in sizes):,} sequences of up to seq_len={ctx.spec.seq_len} "
            f"tokens, their KV cache and logits; the largest is {tenant_label(name)}: batch_size × grad_accum × "
            f"group_size (× the generations it samples at once, 1 + max_staleness // num_iterations) = {rows:,}) "
            f"but {device} has {total / gib:,.1f} GiB; lower group_size, batch_size, seq_len or max_staleness",
        )


def check_memory(ctx: Context, tenants: list[Tenant]) -> None:
    """Sizes that cannot fit one device: the tenants' own tensors. Each tenant's exist only for it,
    at its rank (nothing is allocated for free slots or for ``max_rank``), and are held whole on
    every data-parallel rank. An estimate, made to catch the absurd:

        need = sum over tenants of rank_t * F_t * 4 bytes * 4 (value, gradient, two AdamW moments)
               F_t = sum over its linear layers of (in + out) + over its expert parameters E*(in + out)

    (The logits are not estimated: the loss is computed in chunks and never holds them whole.)
    """
    m = ctx.model
    mem = device_memory() if m is not None else None
    if m is None or mem is None:
        return
    total, device = mem
    sizes = []  # (bytes, tenant, rank, features)
    features: dict[tuple[tuple[str, ...], tuple[str, ...]], int] = {}  # (many tenants share a few targets)
    for t in tenants:
        if not (is_int(t.rank) and 1 <= t.rank <= MAX_SLOTS):
            continue
        mods = tuple(t.target_modules) if valid_targets(t.target_modules) else ()
        params = tuple(t.target_parameters) if valid_targets(t.target_parameters) else ()
        feats = features.get((mods, params))
        if feats is None:
            chosen = ctx.linear_of(mods) if mods else frozenset()
            feats = sum(inn + out for n, inn, out in m.linear_shapes if n in chosen)
            feats += sum(
                E * (inn + out)
                for n, E, out, inn in m.expert_shapes
                if any(name_matches(n, p) for p in params)
            )
            features[(mods, params)] = feats
        sizes.append((t.rank * feats * 16, t.name, t.rank, feats))
    need = sum(size for size, *_ in sizes)
    if need > total:
        gib = 2**30
        _, name, rank, feats = max(sizes)
        ctx.say(
            None,
            None,
            f"the tenants' adapters need about {need / gib:,.1f} GiB per device with their gradients and "
            f"AdamW state (rank x in+out features x 16 bytes, summed over tenants; the largest is "
            f"{tenant_label(name)}: rank {rank} x {feats:,} features) but {device} has {total / gib:,.1f} GiB; "
            "lower ranks, target fewer layers, or start fewer tenants at once",
        )
