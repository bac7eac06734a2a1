"""What a tenant reads: its data (every problem of every row, of a file or of rows held in memory, and a
row that keeps a target token at ``seq_len``) and its ``init_adapter`` (a PEFT LoRA adapter whose config
matches the tenant and whose tensor shapes fit the base model, read from the weights' header alone).

    check_data(ctx, t)           data and heldout_data (a file scanned once per version with a cache)
    check_init_adapter(ctx, t)   adapter_config.json against the tenant, weight shapes against the model
"""

from __future__ import annotations

import json
import os
from typing import Any

from mlora_lab.lora.targets import name_matches
from mlora_lab.rl.prompts import RL_ROWS
from mlora_lab.sources import Snapshot, memory_kind, source_name
from mlora_lab.spec.fields import field_info
from mlora_lab.spec.job import JobSpec, valid_targets
from mlora_lab.spec.parts import RL
from mlora_lab.spec.paths import TENANT_FILES
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, brief_list, is_int, json_type, read_json, show_path
from mlora_lab.validate.context import Context, got, more, usable_path
from mlora_lab.validate.introspect import select_linear
from mlora_lab.validate.pref import check_pairs
from mlora_lab.validate.rl import check_rewards
from mlora_lab.validate.weights import safetensors_shapes

# ---------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------


def check_data(ctx: Context, t: Tenant) -> None:
    """Every problem of the tenant's ``data`` and ``heldout_data`` sources (a file's problems keep its path
    in ``Problem.path``, so a view can group one file's problems across tenants). An RL tenant's rows
    are prompts, and its reward functions are checked against their columns (:mod:`.rl`)."""
    if t.client is not None:  # a Tinker client's tenant: its client sends the rows
        return
    if t.pref is not None:  # its rows are preference pairs (its heldout_data is refused with its fields)
        check_pairs(ctx, t)
        return
    if isinstance(t.rl, RL):
        columns, samples = None, {}
        if memory_kind(t.data) is not None or usable_path(t.data):
            report = _scan_prompts(ctx, t.data)
            path = t.data if isinstance(t.data, str) else None
            for problem in report.problems:
                ctx.say(t, "data", f"data: {problem}", path=path)
            columns, samples = (None, {}) if report.problems else (report.columns, report.samples)
        check_rewards(ctx, t, columns, [samples[k] for k in ("prompt", "messages") if k in samples])
        return
    for name in TENANT_FILES:
        source = getattr(t, name)
        if memory_kind(source) is not None:
            for tail in _data_problems(ctx, source):
                ctx.say(t, name, name + tail)
        elif usable_path(source):  # (else a type or path problem, reported with the fields)
            for tail in _data_problems(ctx, source):
                ctx.say(t, name, name + tail, path=source)


def _scan_prompts(ctx: Context, source: Any) -> Any:
    """An RL tenant's prompt rows: their problems, and the columns they hold."""
    from mlora_lab.data import scan_source  # the data module imports torch

    report = scan_source(source, prompts=RL_ROWS)
    if "messages" in report.kinds and ctx.tok is not None and not getattr(ctx.tok, "chat_template", None):
        report.problems.append(
            f"{source_name(source)} has chat ('messages') rows but the tokenizer has no chat_template"
        )
    return report


def _file_key(path: str) -> tuple[str, int | None, int | None]:
    """What identifies one version of a file: its absolute path, mtime and size (``None`` if missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return (os.path.abspath(path), None, None)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


def _source_key(source: Any) -> tuple[Any, ...] | None:
    """What identifies one version of a source: a file's version, a snapshot's own key (it never
    changes); ``None`` for rows held in memory that may still change (a DataFrame: read every time)."""
    if isinstance(source, Snapshot):
        return ("snapshot", source.key)
    if isinstance(source, str):
        return _file_key(source)
    return None


def _data_problems(ctx: Context, source: Any) -> list[str]:
    """The problems of one data source, each as the rest of a sentence that starts with the field's
    name (``": a.jsonl line 3: not valid JSON"``); served from the cache while the source, the
    tokenizer and ``seq_len`` stay the same."""
    seq_len = ctx.spec.seq_len
    key = _source_key(source)
    if ctx.cache is None or key is None or not is_int(seq_len):
        return _scan_data(ctx, source)
    key = (key, ctx.env_key(), ctx.tok is not None, seq_len)
    hit = ctx.cache.data_files.get(key)
    if hit is None:
        hit = ctx.cache.data_files[key] = _scan_data(ctx, source)
    return hit


def _scan_data(ctx: Context, source: Any) -> list[str]:
    from mlora_lab.data import scan_source, target_problem  # the data module imports torch

    seq_len = ctx.spec.seq_len
    report = scan_source(source)
    tails = [f": {p}" for p in report.problems]
    if not report.problems and report.n_rows == 0:
        tails.append(f": {source_name(source)}: no rows")
    no_template = (
        "messages" in report.kinds and ctx.tok is not None and not getattr(ctx.tok, "chat_template", None)
    )
    if no_template:
        tails.append(" has chat ('messages') rows but the tokenizer has no chat_template")
    if report.problems or not report.n_rows or no_template or ctx.tok is None:
        return tails
    if is_int(seq_len) and field_info(JobSpec, "seq_len").allows(seq_len):
        # Tokenizes rows (each cut at seq_len) only until one keeps a target token: one row for
        # a usable source, every row only for a source the job would refuse anyway.
        why = target_problem(source, ctx.tok, seq_len)
        if why:
            tails.append(f": {why}")
    return tails


# ---------------------------------------------------------------------------------------------
# init_adapter
# ---------------------------------------------------------------------------------------------


def check_init_adapter(ctx: Context, t: Tenant) -> None:
    """The tenant's ``init_adapter``: a PEFT LORA adapter directory whose r, alpha, rsLoRA and targets
    are the tenant's, with no feature mlora_lab does not train (DoRA, per-layer ranks, biases, ...),
    and weights that fit the base model."""
    path = t.init_adapter
    if not usable_path(path):
        return
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter {brief(path)} is not a PEFT adapter directory (no adapter_config.json)",
        )
        return
    cfg, why = read_json(cfg_file, "an adapter config")
    if why or not isinstance(cfg, dict):
        why = why or f"the top level is {json_type(cfg)}, not a JSON object"
        ctx.say(t, "init_adapter", f"init_adapter {show_path(cfg_file)}: {why}")
        return
    if cfg.get("peft_type", "LORA") != "LORA":
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter is a {brief(cfg.get('peft_type'))} adapter; only LORA is supported",
        )
        return
    weights = os.path.join(path, "adapter_model.safetensors")
    if not any(os.path.isfile(f) for f in (weights, os.path.join(path, "adapter_model.bin"))):
        ctx.say(t, "init_adapter", f"init_adapter {brief(path)} has no adapter_model.safetensors")
    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rslora = bool(cfg.get("use_rslora", False))
    if not (is_int(r) and r >= 1):
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter has r={brief(r)}, not a positive integer; save the adapter again",
        )
        r = None
    elif is_int(ctx.spec.max_rank) and r > ctx.spec.max_rank:
        ctx.say(t, "max_rank", f"init_adapter has r={r} > max_rank={ctx.spec.max_rank}; raise max_rank")
    if r is not None and r != t.rank:
        ctx.say(t, "rank", f"rank {brief(t.rank)} differs from init_adapter r={r}; set rank={r}")
    if alpha != t.alpha:
        ctx.say(
            t,
            "alpha",
            f"alpha {brief(t.alpha)} differs from init_adapter lora_alpha={brief(alpha)}; set alpha={brief(alpha)}",
        )
    if rslora != t.use_rslora:
        ctx.say(
            t,
            "use_rslora",
            f"use_rslora {brief(t.use_rslora)} differs from init_adapter use_rslora={rslora}; "
            f"set use_rslora={json.dumps(rslora)}",
        )
    _compare_targets(ctx, t, "target_modules", cfg.get("target_modules"), t.target_modules)
    _compare_targets(ctx, t, "target_parameters", cfg.get("target_parameters"), t.target_parameters)
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            ctx.say(
                t,
                "init_adapter",
                f"init_adapter has a non-empty {key}; per-layer ranks/alphas are not supported",
            )
    unsupported = {
        "use_dora": cfg.get("use_dora"),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": cfg.get("modules_to_save"),
        "layers_to_transform": cfg.get("layers_to_transform") is not None,
    }
    for key, present in unsupported.items():
        if present:
            ctx.say(
                t, "init_adapter", f"init_adapter uses {key}={brief(cfg.get(key))}, which is not supported"
            )
    if os.path.isfile(weights):
        _check_adapter_weights(ctx, t, weights, cfg, r)


def _check_adapter_weights(ctx: Context, t: Tenant, path: str, cfg: dict, r: int | None) -> None:
    """Compare the adapter's tensor shapes (from the safetensors header) with the base model:

        linear layer W [out, in]:           lora_A [r, in],   lora_B [out, r]
        packed experts W [E, out, in]:      lora_A [E*r, in], lora_B [out, E*r]  (PEFT's flattening)

    An adapter trained on another base (other widths, more layers) fails here, not in the job.
    """
    shapes, why = safetensors_shapes(path)
    if why:
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter weights {show_path(path)} are not readable: {why}; save the adapter again",
        )
        return
    m = ctx.model
    if m is None:
        return
    linear = {n: (inn, out) for n, inn, out in m.linear_shapes}
    experts = {n: (E, out, inn) for n, E, out, inn in m.expert_shapes}
    targets = cfg.get("target_parameters")
    targets = [x for x in targets if isinstance(x, str)] if isinstance(targets, list) else []
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    not_lora: list[str] = []
    for key, shape in shapes.items():
        name = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            # Saved adapters drop the adapter name; raw state dicts keep it (".lora_A.default.weight").
            if f".{part}." in name and name.endswith(".weight"):
                pairs.setdefault(name[: name.index(f".{part}.")], {})[part] = shape
                break
        else:
            not_lora.append(key)
    if not_lora:
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter holds tensors that are not LoRA A/B weights: {brief_list(not_lora, 5)}",
        )
    elif not pairs:
        ctx.say(t, "init_adapter", f"init_adapter {show_path(path)} holds no LoRA tensors")
    unknown: list[str] = []  # modules the base does not have
    wrong: list[str] = []  # shapes that do not fit the base
    broken: list[str] = []  # shapes that fit no base: a damaged adapter
    ranks: set[int] = set()
    for module in sorted(pairs):
        parts = pairs[module]
        if set(parts) != {"lora_A", "lora_B"}:
            broken.append(f"{module} has {'lora_A' if 'lora_A' in parts else 'lora_B'} without its pair")
            continue
        A, B = parts["lora_A"], parts["lora_B"]
        if len(A) != 2 or len(B) != 2:
            broken.append(f"{module}.lora_A is {list(A)} and lora_B is {list(B)}, not 2-D")
            continue
        if module in linear:
            inn, out, experts_n, label = *linear[module], 1, module.rsplit(".", 1)[-1]
        else:
            param = _expert_param(ctx, module, targets)
            if param is None:
                unknown.append(module)
                continue
            experts_n, out, inn = experts[param]
            label = ".".join(param.split(".")[-2:])
        if A[1] != inn:
            wrong.append(f"{module}.lora_A is {list(A)} but {label} takes {inn} inputs")
        if B[0] != out:
            wrong.append(f"{module}.lora_B is {list(B)} but {label} gives {out} outputs")
        if A[0] != B[1]:
            broken.append(f"{module}.lora_A is {list(A)} but lora_B is {list(B)}: their ranks differ")
        elif experts_n > 1 and (A[0] % experts_n or (r is not None and A[0] != experts_n * r)):
            rank = f"{experts_n}*{r} = {experts_n * r}" if r is not None else f"{experts_n}*r"
            wrong.append(
                f"{module}.lora_A is {list(A)} but {label} has {experts_n} experts (lora_A [{rank}, {inn}])"
            )
        elif experts_n == 1:
            ranks.add(A[0])
    if unknown:
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter was made for another base model: it has weights for modules this base "
            f"model does not have: {brief_list(unknown, 5)}",
        )
    if wrong:
        ctx.say(t, "init_adapter", f"init_adapter was made for another base model: {wrong[0]}{more(wrong)}")
    if r is not None and ranks - {r}:
        broken.append(f"its weights have rank {brief_list(sorted(ranks))} but adapter_config.json says r={r}")
    if broken:
        ctx.say(
            t,
            "init_adapter",
            f"init_adapter {show_path(path)} is inconsistent: {broken[0]}{more(broken)}; save it again",
        )


def _expert_param(ctx: Context, module: str, targets: list[str]) -> str | None:
    """The 3-D parameter an expert LoRA key belongs to. PEFT nests one wrapper per targeted
    parameter of a module, the first-defined innermost: ``<module>(.base_layer)*d`` holds the
    parameter ``n - 1 - d`` of the ``n`` it targets there."""
    assert ctx.model is not None
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module[: -len(".base_layer")], depth + 1
    params = [n for n in ctx.model.experts if n.rpartition(".")[0] == module]
    targeted = [n for n in params if any(name_matches(n, t) for t in targets)]
    return targeted[len(targeted) - 1 - depth] if depth < len(targeted) else None


def _compare_targets(ctx: Context, t: Tenant, key: str, theirs: Any, ours: Any) -> None:
    """The adapter's ``key`` (``target_modules`` / ``target_parameters``) selects what the tenant's does
    (two spellings may select the same layers: PEFT saves ``"all-linear"`` expanded)."""
    if theirs is None:
        theirs_list: list[str] = []
    elif isinstance(theirs, str):
        theirs_list = [theirs]
    elif isinstance(theirs, list | tuple) and all(isinstance(x, str) for x in theirs):
        theirs_list = list(theirs)
    else:
        ctx.say(t, key, f"init_adapter {key} must be a list of names ({got(theirs)})")
        return
    if not valid_targets(ours) or set(theirs_list) == set(ours):
        return
    m = ctx.model
    if m is not None and key == "target_modules" and valid_targets(theirs_list):
        selected = select_linear(m, theirs_list)
        if selected and selected == select_linear(m, ours):
            return
    ctx.say(
        t,
        key,
        f"{key} {brief(sorted(ours))} differs from init_adapter "
        f"{key}={brief(sorted(theirs_list), 200)}; "
        f"set {key}={brief(json.dumps(sorted(theirs_list)), 200)}",
    )
