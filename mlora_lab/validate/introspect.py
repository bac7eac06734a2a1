"""What the checks know of a base model without loading it: its structure, built from its config on
the ``meta`` device (no weight is read, nothing is allocated), cached per path.

    model_target_names(path)    -> (every nn.Linear's full name, every 3-D expert parameter's)
    all_linear_names(path)      -> what ["all-linear"] selects, in model order
    linear_target_options(path) -> the target_modules entries the forms offer (q_proj, k_proj, ...)

torch and transformers are imported only inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from mlora_lab.bases import gguf_config, is_gguf
from mlora_lab.lora.targets import match_targets, output_layer_names, storable_targets
from mlora_lab.text import brief, is_int


@dataclass(frozen=True)
class ModelInfo:
    """The structure of a base model, as the checks need it (names and shapes, never tensors)."""

    modules: tuple[tuple[str, str], ...]
    """(full name, class name) of every submodule."""
    linear: frozenset[str]
    """Full names of the ``nn.Linear`` submodules."""
    experts: tuple[str, ...]
    """Full names of the 3-D parameters (packed MoE experts)."""
    expert_modules: tuple[tuple[str, int, str | None], ...] = ()
    """(full name, number of experts, why it cannot be split or None) of each module holding 3-D parameters."""
    linear_shapes: tuple[tuple[str, int, int], ...] = ()
    """(full name, in_features, out_features) of every ``nn.Linear``: ``W`` is ``[out, in]``."""
    expert_shapes: tuple[tuple[str, int, int, int], ...] = ()
    """(full name, E, out, in) of every 3-D parameter: expert ``e`` computes ``x W[e]^T``, ``W`` ``[E, out, in]``."""
    vocab: int | None = None
    """Rows of the input embedding: token ids must be below it."""
    logits: int | None = None
    """Columns of the logits (the output layer's outputs)."""
    output: frozenset[str] = frozenset()
    """Full names of the output layer (:func:`mlora_lab.lora.targets.output_layer_names`)."""
    kv_per_token: int | None = None
    """Elements of the KV cache one token of one sequence takes (``2 × layers × kv heads × head dim``; None
    when the config does not say): what a generation holds per token."""
    embeddings: tuple[str, str] = ("Embedding", "Linear")
    """Class names of the input embedding and the output layer (``""`` without one): what
    ``JobSpec.quantize_embeddings`` would replace."""

    @property
    def all_linear(self) -> list[str]:
        """What ``"all-linear"`` selects: every ``nn.Linear`` but the output layer, in model order."""
        return [n for n, _ in self.modules if n in self.linear and n not in self.output]


# A config this large is not a model but a typo or an attack: building even its meta skeleton
# (one Python object per module) would take minutes and gigabytes.
CONFIG_LIMITS = {
    "num_hidden_layers": 4096,
    "n_layer": 4096,
    "num_layers": 4096,
    "num_experts": 2**16,
    "num_local_experts": 2**16,
    "n_routed_experts": 2**16,
}
"""Largest value of each config entry that sizes the model; past it the config is refused unbuilt."""


def load_config(path: str) -> Any:
    """The transformers config of a base model: its directory's ``config.json``, or for a GGUF base
    (``mlora_lab.bases``) the config its metadata describes, read without converting it."""
    if is_gguf(path):
        return gguf_config(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


@functools.lru_cache(maxsize=32)
def model_info(path: str) -> ModelInfo:
    """The structure of the base model at the absolute ``path``, built on the ``meta`` device; raises
    whatever transformers raises, or ``ValueError`` for a config past :data:`CONFIG_LIMITS`."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_config(path)
    for key, limit in CONFIG_LIMITS.items():
        v = getattr(cfg, key, None)
        if is_int(v) and v > limit:
            raise ValueError(f"config.json has {key}={brief(v)} (at most {limit}); that is not a real model")
    # On the meta device nothing is allocated or initialised: cheap even for a large model.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    named = [(n, m) for n, m in model.named_modules() if n]
    modules = tuple((n, type(m).__name__) for n, m in named)
    linear_mods = [(n, m) for n, m in named if isinstance(m, torch.nn.Linear)]
    linear = frozenset(n for n, _ in linear_mods)
    linear_shapes = tuple((n, m.in_features, m.out_features) for n, m in linear_mods)
    params3 = [(n, p) for n, p in model.named_parameters() if p.ndim == 3]
    experts = tuple(n for n, _ in params3)
    expert_shapes = tuple((n, *(int(d) for d in p.shape)) for n, p in params3)
    from mlora_lab.lora.experts import packed_experts_problem

    holders = sorted({n.rpartition(".")[0] for n in experts})
    expert_modules = tuple(
        (n, model.get_submodule(n).gate_up_proj.shape[0] if not problem else 0, problem)
        for n in holders
        for problem in [packed_experts_problem(model.get_submodule(n))]
    )
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = getattr(emb, "num_embeddings", None) if emb is not None else None
    logits = getattr(head, "out_features", None) if head is not None else None
    vocab = vocab if is_int(vocab) else getattr(cfg, "vocab_size", None)
    logits = logits if is_int(logits) else vocab
    output = frozenset(output_layer_names(model))
    embeddings = tuple(type(m).__name__ if m is not None else "" for m in (emb, head))
    return ModelInfo(
        modules,
        linear,
        experts,
        expert_modules,
        linear_shapes,
        expert_shapes,
        vocab,
        logits,
        output,
        kv_size(cfg),
        embeddings,  # type: ignore[arg-type]
    )


def kv_size(cfg: Any) -> int | None:
    """``2 × layers × kv heads × head dim`` of a transformers config (a text config inside a multimodal
    one), or None when it lacks one of them."""
    cfg = getattr(cfg, "text_config", None) or cfg
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or (
        cfg.hidden_size // heads
        if is_int(getattr(cfg, "hidden_size", None)) and is_int(heads) and heads
        else None
    )
    if not all(is_int(v) and v > 0 for v in (layers, kv, dim)):
        return None
    return 2 * layers * kv * dim


@functools.lru_cache(maxsize=32)
def tp_problems(path: str, tp: int) -> list[str]:
    """Why the base model at ``path`` cannot be split over ``tp`` tensor-parallel ranks
    (:func:`mlora_lab.parallel.tensor.tp_problems`, on a meta-device build)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mlora_lab.parallel.tensor import tp_problems as model_tp_problems

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(path))
    return model_tp_problems(model, tp)


def select_linear(info: ModelInfo, targets: list[str] | tuple[str, ...]) -> set[str]:
    """Full names of the linear layers that ``targets`` (valid per ``spec.valid_targets``) select."""
    return set(match_targets(sorted(info.linear), list(targets), info.all_linear))


@functools.cache
def device_memory() -> tuple[int, str] | None:
    """Bytes of memory of one device the job may run on, and what it is: GPU 0 if CUDA is available,
    else the host's RAM (a CPU job). ``None`` if neither can be read."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory), "GPU 0"
    except Exception:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total), "RAM"
    except Exception:
        return None


def model_target_names(base_model: str) -> tuple[list[str], list[str]]:
    """Full names of the model's ``nn.Linear`` modules, and of its 3-D parameters (packed MoE experts).

    The model is built from its config on the ``meta`` device (no weights are read); results are
    cached per path. Raises whatever transformers raises if the config cannot be loaded.
    """
    info = model_info(os.path.abspath(os.fspath(base_model)))
    linear_in_order = [n for n, _ in info.modules if n in info.linear]
    return linear_in_order, list(info.experts)


def all_linear_names(base_model: str) -> list[str]:
    """Full names of the layers ``["all-linear"]`` selects in the model, in model order: every
    ``nn.Linear`` except the output layer (found as :mod:`mlora_lab.lora.targets` says, the way PEFT
    finds it). Built on the ``meta`` device and cached, like :func:`model_target_names`."""
    return model_info(os.path.abspath(os.fspath(base_model))).all_linear


def linear_target_options(base_model: str) -> list[str]:
    """``target_modules`` entries that name the model's all-linear layers, in model order: the shortest
    ``.``-suffixes (``q_proj``, ``k_proj``, ...) that select only such layers (never the output layer),
    as the forms offer them (:func:`mlora_lab.lora.targets.storable_targets`)."""
    info = model_info(os.path.abspath(os.fspath(base_model)))
    return storable_targets(info.all_linear, [n for n, _ in info.modules])
