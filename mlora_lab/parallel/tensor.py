"""Tensor parallelism (TP) for a :class:`~mlora_lab.lora.model.MultiLoRAModel`, following the model's
transformers TP plan (``model._tp_plan``: ``base_model_tp_plan`` with the causal LM's own entries).

The ``tp`` ranks of a group see the same rows. A projection ``y = x W^T (+ b)``, ``W`` [out, in], with
tenant deltas ``s_t (x A_t^T) B_t^T`` is split over them as in Megatron-LM:

- **colwise** (q/k/v, gate/up): rank ``i`` holds rows ``W_i`` (and ``b_i``) of the output features and
  computes ``y_i = x W_i^T + b_i + s_t (x A_t^T) B_{t,i}^T``: the base **and** ``B`` are split by output
  rows, ``A`` is replicated. No collective in the forward; in the backward the gradient of the
  (replicated) input is the sum of every rank's partial ``g_i W_i + s_t (g_i B_{t,i}) A_t``: base and
  LoRA parts are added locally, then **one** all-reduce.
- **rowwise** (o_proj, down_proj): rank ``i`` holds the input columns ``W_{:,i}`` and gets the matching
  slice ``x_i`` of the input features; ``A`` is split by input columns, ``B`` is replicated, and
  ``y = Σ_i [x_i W_{:,i}^T + s_t (x_i A_{t,:,i}^T) B_t^T] + b``: both partial products are added locally
  and **one** all-reduce makes ``y`` (the bias is added once, after it). The LoRA inner product
  ``x A^T`` is itself a sum over ranks, which is why it must not be reduced apart from the base:
  reducing base and LoRA separately changes the order of the sums, and the losses of different
  TP/DP layouts drift apart.
- ``colwise_gather_output`` / ``rowwise_split_input`` (fused ``qkv_proj``/``gate_up_proj`` that the model
  slices by absolute offsets): colwise and then an all-gather of the output features; the input slice
  of this rank and then rowwise.
- ``embedding_rowwise``: the vocabulary rows are split; each rank embeds the ids it holds (zeros for the
  others) and one all-reduce adds them. ``lm_head`` is ``colwise_gather_output`` (logits gathered).

The gradient of a *replicated* LoRA factor (``A`` in colwise, ``B`` in rowwise) is also a sum of every
rank's partial one: the factor passes through an identity whose backward all-reduces (the same
operator as for the colwise input), so every rank holds the whole gradient, as for the base input.

A tenant's tensors are DTensors on the TP mesh (``Shard`` where split, ``Replicate`` where not), made
when the tenant is added (:class:`~mlora_lab.parallel.fsdp.SlotLayout`), so
:class:`~mlora_lab.parallel.fsdp.ShardedTensorIO` reads and writes their full (logical) values: saved
adapters, checkpoints and every tenant's init are the same whatever ``tp``, and a tenant's init, drawn
whole from its seed on every rank, is sliced the same way as the base (rank-consistent by
construction). The frozen base weights are plain tensors holding this rank's slice. Packed MoE experts
stay replicated over TP ranks (split them with ``ep``).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from mlora_lab.lora.layer import MultiLoRALinear
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.parallel.fsdp import SlotLayout

LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
EMBEDDING_STYLES = ("embedding_rowwise",)
COLWISE = ("colwise", "colwise_gather_output")


# -- the four Megatron-LM region operators ------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over the TP group in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _CopyManyToTP(torch.autograd.Function):
    """:class:`_CopyToTP` for several tensors: one all-reduce of all their gradients (flattened)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        grads = tuple(
            g if g is not None else torch.zeros(s, dtype=d, device=v)
            for g, (s, d, v) in zip(grads, ctx.shapes)
        )
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        out, offset = [], 0
        for g in grads:
            out.append(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return None, *out


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) over the TP group forward; identity gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _all_gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _my_slice(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = x.shape[-1] // dist.get_world_size(group)
    rank = dist.get_rank(group)
    return x[..., rank * size : (rank + 1) * size].contiguous()


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _my_slice(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """This rank's slice of the last dim forward; all-gather of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _my_slice(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_last(grad, ctx.group), None


# -- layers ------------------------------------------------------------------------------------------


def _tp_linear(module: nn.Module, x: torch.Tensor, with_delta) -> torch.Tensor:
    """The TP forward of a linear layer (module docstring); ``with_delta(x, y)`` adds the tenant deltas."""
    group, style = module.tp_group, module.tp_style
    if style == "rowwise_split_input":
        x = _ScatterToTP.apply(x, group)
    if style in COLWISE:
        x = _CopyToTP.apply(x, group)
    base = module.base_layer if isinstance(module, MultiLoRALinear) else module
    y = F.linear(x, base.weight, base.bias if style in COLWISE else None)
    y = with_delta(x, y)  # base + LoRA partials, added before the one collective below
    if style in COLWISE:
        return _GatherFromTP.apply(y, group) if style == "colwise_gather_output" else y
    y = _ReduceFromTP.apply(y, group)
    return y if base.bias is None else y + base.bias


class TPMultiLoRALinear(MultiLoRALinear):
    """A :class:`MultiLoRALinear` split over the TP group (``tp_style``); made by
    :func:`apply_tensor_parallel`, which swaps the class of an existing layer."""

    tp_group: dist.ProcessGroup
    tp_style: str

    def factors(self, slots: list[int]) -> list[torch.Tensor]:
        """This rank's parts of the tenants' ``A``, ``B``; the replicated factor (``A`` in colwise,
        ``B`` in rowwise) of all of them passes one identity whose backward all-reduces their
        gradients together: one collective per layer, whatever the number of tenants."""
        local = [
            t.to_local() if isinstance(t, DTensor) else t
            for slot in slots
            for t in (self.lora_A[slot], self.lora_B[slot])
        ]
        first = 0 if self.tp_style in COLWISE else 1
        local[first::2] = _CopyManyToTP.apply(self.tp_group, *local[first::2])
        return local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tp_linear(self, x, self.with_delta)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tp={self.tp_style}"


class TPLinear(nn.Linear):
    """A plain (slot-less) ``nn.Linear`` split over the TP group."""

    tp_group: dist.ProcessGroup
    tp_style: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tp_linear(self, x, lambda _, y: y)


class TPEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose vocabulary rows ``[first, first + rows)`` live on this rank."""

    tp_group: dist.ProcessGroup
    first: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        return _ReduceFromTP.apply(out, self.tp_group)


# -- the plan ----------------------------------------------------------------------------------------


def tp_plan(model: nn.Module) -> dict[str, str]:
    """``{module name: style}`` of the modules of ``model`` (a transformers causal LM, possibly
    wrapped in slots) that the model's TP plan splits; entries for packed experts, norms and other
    non-linear modules are left out (those stay replicated)."""
    plan = getattr(model, "_tp_plan", None) or {}
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in plan.items()]
    out = {}
    for name, module in model.named_modules():
        style = next((v for rx, v in patterns if rx.match(name)), None)
        linear = isinstance(module, nn.Linear | MultiLoRALinear)
        if (style in LINEAR_STYLES and linear) or (
            style in EMBEDDING_STYLES and isinstance(module, nn.Embedding)
        ):
            out[name] = style
    return out


def tp_problems(model: nn.Module, tp: int) -> list[str]:
    """Why ``model`` (e.g. built on the meta device) cannot be split over ``tp`` ranks, if it cannot."""
    plan = tp_plan(model)
    if not plan:
        return [
            f"parallel.tp = {tp}: the model has no tensor-parallel plan (transformers' base_model_tp_plan)"
        ]
    out = []
    cfg = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n % tp:
            out.append(f"parallel.tp = {tp} does not divide {key} = {n}")
    for name, style in plan.items():
        module = model.get_submodule(name)
        weight = module.weight if not isinstance(module, MultiLoRALinear) else module.base_layer.weight
        dim = 1 if style in ("rowwise", "rowwise_split_input") else 0
        if weight.shape[dim] % tp:
            what = (
                "input features"
                if dim
                else ("vocabulary rows" if style in EMBEDDING_STYLES else "output features")
            )
            out.append(
                f"parallel.tp = {tp} does not divide the {weight.shape[dim]} {what} of {name} ({style})"
            )
    return out


def apply_tensor_parallel(mm: MultiLoRAModel, tp_mesh: DeviceMesh) -> None:
    """Split ``mm`` over the 1-D ``tp_mesh`` in place, following :func:`tp_plan` (module docstring).
    Call before FSDP and before any tenant is added."""
    if mm.tenants:
        raise RuntimeError("apply tensor parallelism before adding tenants")
    tp = tp_mesh.size()
    problems = tp_problems(mm.model, tp)
    if problems:
        raise ValueError("; ".join(problems))
    rank, group = tp_mesh.get_local_rank(), tp_mesh.get_group()
    shared: dict[tuple[int, int], nn.Parameter] = {}  # tied embedding / lm_head weights stay one tensor

    def local(param: torch.Tensor, dim: int) -> nn.Parameter:
        key = (id(param), dim)
        if key not in shared:
            n = param.shape[dim] // tp
            shared[key] = nn.Parameter(param.detach().narrow(dim, rank * n, n).clone(), requires_grad=False)
        return shared[key]

    for name, style in tp_plan(mm.model).items():
        module = mm.model.get_submodule(name)
        if style in EMBEDDING_STYLES:
            module.first = rank * (module.weight.shape[0] // tp)
            module.weight = local(module.weight, 0)
            module.__class__ = TPEmbedding
        else:
            base = module.base_layer if isinstance(module, MultiLoRALinear) else module
            colwise = style in COLWISE
            if base.bias is not None and colwise:
                base.bias = local(base.bias, 0)
            base.weight = local(base.weight, 0 if colwise else 1)
            if isinstance(module, MultiLoRALinear):  # tenants' A [r, in], B [out, r]
                module.layouts = {
                    "A": SlotLayout(tp_mesh, [Replicate() if colwise else Shard(1)]),
                    "B": SlotLayout(tp_mesh, [Shard(0) if colwise else Replicate()]),
                }
                module.__class__ = TPMultiLoRALinear
            else:
                module.__class__ = TPLinear
        module.tp_group, module.tp_style = group, style
