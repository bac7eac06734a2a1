"""Multi-tenant LoRA: slot layers, the model wrapper, and PEFT adapter import/export."""

from mlora_lab.lora.layer import LoRARouting, MultiLoRALinear
from mlora_lab.lora.model import (
    MultiLoRAModel,
    TenantAdapter,
    linear_module_names,
    lora_scaling,
    match_targets,
)
from mlora_lab.lora.peft_io import AdapterError, read_adapter, write_adapter

__all__ = [
    "AdapterError",
    "LoRARouting",
    "MultiLoRALinear",
    "MultiLoRAModel",
    "TenantAdapter",
    "linear_module_names",
    "lora_scaling",
    "match_targets",
    "read_adapter",
    "write_adapter",
]
