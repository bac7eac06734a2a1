"""Reading and writing standard PEFT LoRA adapter directories.

A PEFT LoRA adapter directory holds ``adapter_config.json`` (a ``peft.LoraConfig``) and
``adapter_model.safetensors`` with, for every adapted module ``M`` (its name inside the base model),

    base_model.model.<M>.lora_A.weight : [r, in]
    base_model.model.<M>.lora_B.weight : [out, r]

This module converts between that layout and ``{module_name: (A, B)}``; it knows nothing about slots.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from mlora_lab.rundir.files import atomic_directory

PREFIX = "base_model.model."
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"

# LoraConfig features a plain slot cannot represent; loading an adapter that uses them is an error,
# never a silent partial load.
_UNSUPPORTED = {
    "rank_pattern": lambda v: bool(v),
    "alpha_pattern": lambda v: bool(v),
    "use_dora": lambda v: bool(v),
    "modules_to_save": lambda v: bool(v),
    "layers_to_transform": lambda v: v is not None,
    "bias": lambda v: v not in (None, "none"),
}


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded as asked; the message says why."""


def read_adapter(path: str | Path) -> tuple[LoraConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Read a PEFT LoRA adapter directory into its config and ``{module_name: (A [r, in], B [out, r])}``.

    PEFT saves an adapted output layer's or embedding's own weights beside its LoRA
    (``save_embedding_layers="auto"``, for a vocabulary that may have been resized): the base's weights, which a
    tenant of a shared frozen base cannot change, so they are not read."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise AdapterError(f"{path}: not a PEFT adapter directory (no {CONFIG_NAME})")
    try:
        config = LoraConfig.from_pretrained(str(path))
    except Exception as e:  # bad JSON, wrong types, unknown fields: say which file, not a traceback
        raise AdapterError(
            f"{path}: {CONFIG_NAME} is not a valid LoRA config ({type(e).__name__}: {e})"
        ) from None
    problems = [
        f"{key}={getattr(config, key)!r}"
        for key, bad in _UNSUPPORTED.items()
        if bad(getattr(config, key, None))
    ]
    if problems:
        raise AdapterError(
            f"{path}: adapter uses LoRA features mlora_lab does not support: {', '.join(problems)}"
        )
    try:
        if (path / WEIGHTS_NAME).is_file():
            state = load_file(str(path / WEIGHTS_NAME))
        elif (path / "adapter_model.bin").is_file():
            # weights_only: torch's restricted unpickler loads tensors and containers, never code
            state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
        else:
            raise AdapterError(f"{path}: no {WEIGHTS_NAME} (or adapter_model.bin)")
    except AdapterError:
        raise
    except Exception as e:  # truncated, not safetensors (a pickle renamed), unreadable
        raise AdapterError(f"{path}: the adapter weights cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise AdapterError(f"{path}: the adapter weights are not a dict of tensors")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unexpected = []
    for key, tensor in state.items():
        name = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        if name.endswith((".base_layer.weight", ".base_layer.bias")):  # (the base's own: see above)
            continue
        for part in ("lora_A", "lora_B"):
            # Saved adapters drop the adapter name; raw state dicts keep it (".lora_A.default.weight").
            marker = f".{part}."
            if marker in name and name.endswith(".weight"):
                module = name[: name.index(marker)]
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            unexpected.append(key)
    if unexpected:
        raise AdapterError(
            f"{path}: unexpected tensors in adapter: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    out = {}
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(
                f"{path}: module {module} has {sorted(parts)} but needs both lora_A and lora_B"
            )
        A, B = parts["lora_A"], parts["lora_B"]
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
            raise AdapterError(
                f"{path}: module {module} has inconsistent shapes A{tuple(A.shape)} B{tuple(B.shape)}"
            )
        out[module] = (A, B)
    if not out:
        raise AdapterError(f"{path}: adapter holds no LoRA tensors")
    return config, out


def write_adapter(
    path: str | Path,
    config: LoraConfig,
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    root: str | Path | None = None,
) -> Path:
    """Write a PEFT adapter directory atomically: build it under a temporary name, then rename.

    A reader never sees a half-written directory: either the old adapter or the new one. The folders on
    the way from ``root`` (default: the directory's parent) are walked without following a link.
    """
    path = Path(path)
    state = {}
    for module, (A, B) in tensors.items():
        state[f"{PREFIX}{module}.lora_A.weight"] = A.detach().to("cpu").contiguous()
        state[f"{PREFIX}{module}.lora_B.weight"] = B.detach().to("cpu").contiguous()
    with atomic_directory(path, root=root) as tmp:
        config.save_pretrained(str(tmp))
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return path


def adapter_config_dict(path: str | Path) -> dict:
    """The raw ``adapter_config.json`` of an adapter directory."""
    return json.loads((Path(path) / CONFIG_NAME).read_text())
