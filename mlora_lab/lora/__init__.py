"""Multi-tenant LoRA: slot layers, the model wrapper, PEFT adapter import/export, and the targeting rules.

Names are resolved lazily (PEP 562), so ``mlora_lab.lora.targets`` (the targeting rules, which the spec
validator uses) can be imported without importing torch or peft.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {  # public name -> the module that defines it
    "ALL_LINEAR": "mlora_lab.lora.targets",
    "AdapterError": "mlora_lab.lora.peft_io",
    "LoRARouting": "mlora_lab.lora.layer",
    "MultiLoRALinear": "mlora_lab.lora.layer",
    "MultiLoRAModel": "mlora_lab.lora.model",
    "TenantAdapter": "mlora_lab.lora.model",
    "linear_module_names": "mlora_lab.lora.targets",
    "lora_scaling": "mlora_lab.lora.model",
    "match_targets": "mlora_lab.lora.targets",
    "output_layer_names": "mlora_lab.lora.targets",
    "read_adapter": "mlora_lab.lora.peft_io",
    "write_adapter": "mlora_lab.lora.peft_io",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from mlora_lab.lora.layer import LoRARouting, MultiLoRALinear  # noqa: F401
    from mlora_lab.lora.model import MultiLoRAModel, TenantAdapter, lora_scaling  # noqa: F401
    from mlora_lab.lora.peft_io import AdapterError, read_adapter, write_adapter  # noqa: F401
    from mlora_lab.lora.targets import (  # noqa: F401
        ALL_LINEAR,
        linear_module_names,
        match_targets,
        output_layer_names,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlora_lab.lora' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
