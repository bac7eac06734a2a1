"""The process layout: ``parallel``'s fields and how they divide each other (no file read), then, once
the model is loaded, whether the model splits over ``tp`` and ``ep`` ranks.

    world_size = nproc * nnodes;  trainers = world_size - rollout_ranks (≥ 1)
    fsdp * tp divides trainers;  ep divides trainers / tp
"""

from __future__ import annotations

import importlib.util
import os

from mlora_lab.spec.fields import fields_info
from mlora_lab.spec.job import QUANTIZE
from mlora_lab.spec.parts import Parallel
from mlora_lab.validate.context import Context
from mlora_lab.validate.fields import check_field
from mlora_lab.validate.introspect import tp_problems


def check_parallel(ctx: Context) -> None:
    """``parallel``'s fields, then the layout they make; sets ``ctx.layout_ok`` when the fields are valid
    (the TP / EP checks against the model need them)."""
    p = ctx.spec.parallel
    if not isinstance(p, Parallel):
        ctx.say(None, "parallel", f"parallel must be a Parallel (got {type(p).__name__})")
        return
    ok = [check_field(ctx, None, f"parallel.{n}", getattr(p, n), info) for n, info in fields_info(Parallel)]
    if not all(ok):
        return
    if p.rollout_ranks >= p.world_size:
        ctx.say(
            None,
            "parallel.rollout_ranks",
            f"parallel: rollout_ranks = {p.rollout_ranks} leaves no process to train among nproc*nnodes = "
            f"{p.nproc}*{p.nnodes} = {p.world_size}",
        )
        return
    ctx.layout_ok = True
    group = p.fsdp * p.tp
    # (the ranks that train: every rank, or those the rollout ranks leave)
    world = f"nproc*nnodes = {p.nproc}*{p.nnodes} = {p.world_size}"
    if p.rollout_ranks:
        world = f"the training ranks, nproc*nnodes - rollout_ranks = {p.world_size} - {p.rollout_ranks} = {p.trainers}"
    if p.trainers % group:
        ctx.say(None, "parallel.fsdp", f"parallel: fsdp*tp = {p.fsdp}*{p.tp} = {group} must divide {world}")
    elif (p.trainers // p.tp) % p.ep:
        over = "nproc*nnodes" + (" - rollout_ranks" if p.rollout_ranks else "")
        ctx.say(
            None,
            "parallel.ep",
            f"parallel: ep = {p.ep} must divide the data-parallel ranks ({over}/tp = "
            f"{p.trainers // p.tp}); expert parallelism splits the experts over groups of them",
        )


def check_tensor_parallel(ctx: Context) -> None:
    """``tp > 1`` needs the model's TP plan and dimensions that split evenly over ``tp`` ranks."""
    p = ctx.spec.parallel
    if ctx.model is None or not ctx.layout_ok or p.tp <= 1:
        return
    for problem in tp_problems(os.path.abspath(ctx.spec.base_model), p.tp):
        ctx.say(None, "parallel.tp", problem)


def check_expert_parallel(ctx: Context) -> None:
    """``ep > 1`` needs packed experts that split evenly over ``ep`` ranks."""
    p = ctx.spec.parallel
    if ctx.model is None or not ctx.layout_ok or p.ep <= 1:
        return
    if not ctx.model.expert_modules:
        ctx.say(
            None, "parallel.ep", f"parallel.ep = {p.ep}, but the model has no packed (3-D) expert parameters"
        )
        return
    name, n, problem = ctx.model.expert_modules[0]
    if problem:
        ctx.say(None, "parallel.ep", f"parallel.ep = {p.ep}: experts module {name} {problem}")
    elif n % p.ep:
        ctx.say(
            None, "parallel.ep", f"parallel.ep = {p.ep} does not divide the {n} experts of each MoE layer"
        )


def check_quantize(ctx: Context) -> None:
    """``quantize`` needs bitsandbytes, and a layout that keeps the whole quantized base on each process:
    one process or data parallel. FSDP2 shards parameters as DTensors, which bitsandbytes' packed 4-bit
    and int8 weights (and their quantization state beside them) are not; tensor and expert parallel
    split the base's weights, which would have to be quantized per slice."""
    q = ctx.spec.quantize
    if ctx.spec.quantize_embeddings is True and q != "nf4":
        ctx.say(
            None,
            "quantize_embeddings",
            f"quantize_embeddings=True quantizes the embedding and output layers to nf4, with quantize='nf4' "
            f"(the linear layers' nf4); quantize is {q!r}",
        )
    if q is None or q not in QUANTIZE:  # (a bad value is check_field's to report)
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        ctx.say(
            None,
            "quantize",
            f"quantize={q!r} needs bitsandbytes: pip install 'mlora_lab[quant]' (or bitsandbytes itself)",
        )
    p = ctx.spec.parallel
    if not isinstance(p, Parallel) or not ctx.layout_ok:
        return
    why = {
        "fsdp": "FSDP2 shards parameters as DTensors, which bitsandbytes' quantized weights cannot be",
        "tp": "tensor parallel splits the base's weights, which bitsandbytes quantizes whole",
        "ep": "expert parallel splits the experts, which a quantized base does not support here",
    }
    for name, reason in why.items():
        if getattr(p, name) > 1:
            ctx.say(
                None,
                f"parallel.{name}",
                f"quantize={q!r} with parallel.{name} = {getattr(p, name)}: {reason}; use fsdp=tp=ep=1 "
                "(data parallel: every process holds the whole quantized base) or quantize=None",
            )
