"""mlora_lab: train and compare many LoRA adapters at once on one frozen base model, from a notebook."""

from mlora_lab.launch import Run, attach, launch, resume, runs
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.report import compare, compare_generations, summary
from mlora_lab.spec import JobSpec, Parallel, SpecError, Tenant
from mlora_lab.widgets import JobBuilder, TenantForm

__all__ = [
    "JobBuilder",
    "JobSpec",
    "MultiLoRAModel",
    "Parallel",
    "Run",
    "SpecError",
    "Tenant",
    "TenantForm",
    "attach",
    "compare",
    "compare_generations",
    "launch",
    "resume",
    "runs",
    "summary",
]
__version__ = "0.1.0"
