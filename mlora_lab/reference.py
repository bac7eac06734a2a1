"""Plain PEFT training of one adapter: the baseline the equivalence tests and benchmarks measure against.

Deliberately the textbook loop (``PeftModel`` + ``torch.optim.AdamW`` + the model's own loss), with no
mlora_lab machinery beyond tokenisation and collation, so agreement with it means something.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import peft
import torch
import transformers

from mlora_lab import quant
from mlora_lab.bases import resolve_base
from mlora_lab.data import Example, collate


@dataclass
class ReferenceResult:
    losses: list[float]
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # {module: (A [r, in], B [out, r])}


def peft_lora_tensors(
    model: peft.PeftModel, adapter: str = "default"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module_name: (A, B)}`` of a PEFT model's LoRA layers, module names as in the base model."""
    out = {}
    prefix = "base_model.model."
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and adapter in module.lora_A:
            key = name[len(prefix) :] if name.startswith(prefix) else name
            out[key] = (
                module.lora_A[adapter].weight.detach().clone(),
                module.lora_B[adapter].weight.detach().clone(),
            )
    return out


def train_peft(
    base_model: str,
    batches: Sequence[Sequence[Example]],
    *,
    adapter_dir: str | None = None,
    lora_config: peft.LoraConfig | None = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = None,
    pad_id: int = 0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    quantize: str | None = None,
    quantize_embeddings: bool = False,
) -> ReferenceResult:
    """Train one PEFT LoRA adapter on ``batches`` (one optimiser step per batch) and return the
    per-step losses and the final adapter tensors. ``dtype`` is the base's (PEFT keeps the adapter in
    fp32 over a bf16/fp16 base: ``autocast_adapter_dtype``); ``quantize`` loads it quantized as a job
    does (:mod:`mlora_lab.quant`: QLoRA's ``BitsAndBytesConfig``; with ``quantize_embeddings``, the embedding
    and output layers too), on the CPU."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_base(base_model), dtype=dtype, **quant.load_kwargs(quantize, dtype, torch.device("cpu"))
    )
    quant.prepare(base, quantize, dtype, quantize_embeddings)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    else:
        model = peft.get_peft_model(base, lora_config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: transformers' Trainer's default optimiser ("adamw_torch_fused"), and the one mlora_lab uses
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    losses = []
    for rows in batches:
        batch = collate([("t", rows)], pad_id)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        out.loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return ReferenceResult(losses, peft_lora_tensors(model))
