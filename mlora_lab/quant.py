"""A quantized frozen base (``JobSpec.quantize``): bitsandbytes through transformers' ``BitsAndBytesConfig``.

Only the base's ``nn.Linear`` layers are quantized (bitsandbytes replaces them with ``Linear4bit`` /
``Linear8bitLt``, still ``nn.Linear`` subclasses); the embeddings, the norms and the output layer stay in
the job's dtype. A LoRA layer wraps the quantized layer as it wraps a plain one, so for a row of tenant
``t``

    y = W̃ x + s_t · B_t (A_t x),      W̃ = dequant(Q(W))

where ``W̃ x`` is what the bitsandbytes layer computes:

- ``"nf4"`` (QLoRA): ``W`` in blocks of 64 values, each stored as 4-bit indices into the 16 NormalFloat
  levels times the block's absmax; the absmax values quantized again to 8 bits in blocks of 256 (double
  quantization). ``W̃ x`` runs in the compute dtype (the job's dtype): 0.5 byte a weight plus ~0.127
  bit of scales;
- ``"int8"`` (LLM.int8): ``W`` row-wise absmax int8, and the input's columns with an outlier above 6.0
  multiplied in 16-bit.

``A_t``, ``B_t``, their gradients and AdamW state are float32 whatever the base is, as PEFT keeps them over
a quantized base (``prepare_model_for_kbit_training`` is not needed: nothing of the base trains). Any
equivalence with PEFT is over the *same* quantized base (:func:`config` for both).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import transformers
from torch import nn

from mlora_lab.spec import QUANTIZE


def available() -> bool:
    """Whether bitsandbytes is installed (the ``quant`` extra)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def config(quantize: str, dtype: torch.dtype) -> transformers.BitsAndBytesConfig:
    """transformers' ``BitsAndBytesConfig`` for ``quantize`` (one of :data:`~mlora_lab.spec.QUANTIZE`),
    computing in ``dtype``: QLoRA's settings for ``"nf4"`` (NormalFloat 4-bit, double quantization)."""
    if quantize == "nf4":
        return transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    if quantize == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"quantize must be one of {QUANTIZE} or None (got {quantize!r})")


def load_kwargs(quantize: str | None, dtype: torch.dtype, device: torch.device) -> dict:
    """Extra ``from_pretrained`` arguments that load the base quantized on ``device`` (bitsandbytes
    quantizes as it places each weight, so the model is never whole in 16/32-bit); ``{}`` for ``None``."""
    if quantize is None:
        return {}
    return {"quantization_config": config(quantize, dtype), "device_map": {"": device}}


def keep_one_kernel(model: nn.Module) -> nn.Module:
    """``model`` with every 4-bit layer held to one kernel. On a CPU with AVX512-BF16, bitsandbytes repacks a
    ``Linear4bit``'s weight for a faster inference kernel the first time the layer runs in eval mode
    without gradients, and the layer rounds differently from then on: a job that samples or evaluates
    between steps would train over another base than one that does not (measured: losses 2e-5 apart after
    a resume, whose first forward is in eval mode). The switch is per layer; nothing else changes."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    # LLM.int8 multiplies in float16 and says so on every forward of a float32 base: once is enough
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _SayOnce) for f in logger.filters):
        logger.addFilter(_SayOnce())
    return model


class _SayOnce(logging.Filter):
    """Lets each distinct message template through once."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in self.said:
            return False
        self.said.add(str(record.msg))
        return True


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` holds bitsandbytes-quantized weights (a model, or one of its linear layers)."""
    return any(type(m).__module__.startswith("bitsandbytes") for m in module.modules())
