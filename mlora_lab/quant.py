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

With ``JobSpec.quantize_embeddings`` (nf4 only, :func:`quantize_embeddings`) the input embedding and the output
layer are quantized too, to nf4 in blocks of 64 (absmax scales not quantized again, so that an embedding row
is dequantized alone): a tied pair shares one quantized weight. QLoRA keeps them in 16 bits; llama.cpp's 4-bit
files quantize them too. They are a large share of a model with a big vocabulary (13 % of Llama-3.1-8B, 21 %
of SmolLM2-135M), so only with them does base memory fall to about a quarter of bf16's on such models.

``A_t``, ``B_t``, their gradients and AdamW state are float32 whatever the base is, as PEFT keeps them over
a quantized base (``prepare_model_for_kbit_training`` is not needed: nothing of the base trains). Any
equivalence with PEFT is over the *same* quantized base (:func:`config` for both).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import transformers
from torch import nn

from mlora_lab.spec.job import QUANTIZE


def available() -> bool:
    """Whether bitsandbytes is installed (the ``quant`` extra)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def config(quantize: str, dtype: torch.dtype) -> transformers.BitsAndBytesConfig:
    """transformers' ``BitsAndBytesConfig`` for ``quantize`` (one of :data:`~mlora_lab.spec.job.QUANTIZE`),
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


def prepare(
    model: nn.Module, quantize: str | None, dtype: torch.dtype, embeddings: bool = False
) -> nn.Module:
    """``model``, loaded with :func:`load_kwargs`'s ``quantize``, made what a job trains over: its embedding and
    output layers quantized too with ``embeddings`` (:func:`quantize_embeddings`), every 4-bit layer held to one
    kernel (:func:`keep_one_kernel`); unchanged for ``quantize=None``. The job, the PEFT reference and the
    benchmarks all call it, so they run over the same base."""
    if quantize is None:
        return model
    if embeddings:
        return quantize_embeddings(model, dtype)
    return keep_one_kernel(model)


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


def quantize_embeddings(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` (loaded with :func:`load_kwargs`'s ``"nf4"``) with its input embedding replaced by
    bitsandbytes' ``Embedding4bit`` and its output layer by a ``Linear4bit``, both nf4 in blocks of 64 and
    computing in ``dtype``; a tied output layer shares the embedding's quantized weight, so the pair is
    stored once. ``W̃ = dequant(Q(W))``: a token's embedding is its row of ``W̃`` (only the looked-up rows
    are dequantized) and the logits are ``h W̃^T``. The scales are not quantized again (bitsandbytes'
    embedding gathers them row by row). Deterministic: a resumed job quantizes the same weights again."""
    import bitsandbytes as bnb

    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not nn.Embedding or (output is not None and type(output) is not nn.Linear):
        # (validation refuses these first: a subclass may compute more than its weight, as Gemma's scales)
        raise ValueError(
            f"quantize_embeddings replaces a plain nn.Embedding and nn.Linear; this model's are "
            f"{type(embedding).__name__} and {type(output).__name__}"
        )
    tied = output is not None and output.weight is embedding.weight

    def quantized(weight: torch.Tensor, nested: bool) -> nn.Parameter:
        data = weight.detach().to(dtype).contiguous()
        packed = bnb.nn.Params4bit(data, requires_grad=False, compress_statistics=nested, quant_type="nf4")
        return packed.to(weight.device)  # (placing it on its device is what quantizes it)

    new_embedding = _embedding_class()(
        embedding.num_embeddings, embedding.embedding_dim, dtype=dtype, quant_type="nf4", device="meta"
    )
    new_embedding.weight = quantized(embedding.weight, nested=False)
    new_embedding.padding_idx = embedding.padding_idx
    model.set_input_embeddings(new_embedding)
    if output is not None:
        new_output = bnb.nn.Linear4bit(
            output.in_features, output.out_features, bias=output.bias is not None, compute_dtype=dtype,
            quant_type="nf4", device="meta",
        )  # fmt: skip
        new_output.weight = new_embedding.weight if tied else quantized(output.weight, nested=True)
        if output.bias is not None:
            new_output.bias = nn.Parameter(output.bias.detach(), requires_grad=False)
        model.set_output_embeddings(new_output)
    return keep_one_kernel(model)


@functools.cache
def _embedding_class() -> type:
    """bitsandbytes' ``Embedding4bit`` whose state dict holds its packed weight as it is (bitsandbytes' raises
    ``NotImplementedError``): PEFT reads every module's state dict when it loads an adapter."""
    import bitsandbytes as bnb

    class QuantizedEmbedding(bnb.nn.Embedding4bit):
        def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
            nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)

    return QuantizedEmbedding


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
