"""mlora_lab: train and compare many LoRA adapters at once on one frozen base model, from a notebook.

Public names are resolved lazily (PEP 562): ``import mlora_lab`` imports nothing heavy, and the
training processes (:mod:`mlora_lab.job`) never load the notebook side (:mod:`mlora_lab.lab`: pandas,
matplotlib, ipywidgets). ``ml.launch`` imports the launcher on first use, ``ml.TenantForm`` the forms.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _no_kernel_offer(record: logging.LogRecord) -> bool:
    # bitsandbytes, imported by PEFT and transformers whenever it is installed (the quant extra), says on a CPU
    # with AVX512-BF16 that it could not download a faster nf4 inference kernel: one a job never uses (it holds
    # every layer to the training kernel, mlora_lab.quant.keep_one_kernel), so the line only alarms. Offline
    # (HF_HUB_OFFLINE=1) the kernels package says instead that it skips the kernel's publisher check.
    text = str(record.msg)
    return "gemm_4bit_forward from kernels-community" not in text and "quantization-bitsandbytes" not in text


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_kernel_offer)
logging.getLogger("kernels._internals.hf_hub").addFilter(_no_kernel_offer)

_EXPORTS = {  # public name -> the module that defines it
    "ASHA": "mlora_lab.search",
    "Dashboard": "mlora_lab.lab.dashboard",
    "Eval": "mlora_lab.spec.parts",
    "Evaluation": "mlora_lab.lab.evals.evaluation",
    "Grid": "mlora_lab.search",
    "HubDataset": "mlora_lab.sources",
    "JobBuilder": "mlora_lab.lab.forms.builders",
    "Judge": "mlora_lab.evals.metrics",
    "JobSpec": "mlora_lab.spec.job",
    "MultiLoRAModel": "mlora_lab.lora",
    "Objective": "mlora_lab.search",
    "PBT": "mlora_lab.search",
    "Parallel": "mlora_lab.spec.parts",
    "Preference": "mlora_lab.spec.parts",
    "RL": "mlora_lab.spec.parts",
    "Random": "mlora_lab.search",
    "RayOptions": "mlora_lab.lab.launchers.ray",
    "Request": "mlora_lab.lab.runs.run",
    "Run": "mlora_lab.lab.runs.run",
    "Service": "mlora_lab.spec.parts",
    "SlurmOptions": "mlora_lab.lab.slurm.cluster",
    "SpecError": "mlora_lab.spec.fields",
    "Sweep": "mlora_lab.search",
    "SweepRun": "mlora_lab.lab.runs.sweep",
    "Tenant": "mlora_lab.spec.tenant",
    "TenantForm": "mlora_lab.lab.forms.builders",
    "WinRate": "mlora_lab.evals.metrics",
    "attach": "mlora_lab.lab.runs.attach",
    "choice": "mlora_lab.search",
    "compare": "mlora_lab.lab.compare.results",
    "compare_generations": "mlora_lab.lab.compare.generations",
    "evaluate": "mlora_lab.lab.evals.evaluate",
    "evaluations": "mlora_lab.lab.evals.evaluation",
    "hparams": "mlora_lab.lab.compare.hparams",
    "launch": "mlora_lab.lab.launch",
    "load_evaluation": "mlora_lab.lab.evals.evaluation",
    "loguniform": "mlora_lab.search",
    "metrics": "mlora_lab.evals",
    "randint": "mlora_lab.search",
    "report": "mlora_lab.trackers",
    "resume": "mlora_lab.lab.launch",
    "runs": "mlora_lab.lab.compare.results",
    "serve": "mlora_lab.lab.launch",
    "summary": "mlora_lab.lab.compare.results",
    "sweep": "mlora_lab.lab.sweeps",
    "uniform": "mlora_lab.search",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from mlora_lab.evals import metrics  # noqa: F401
    from mlora_lab.evals.metrics import Judge, WinRate  # noqa: F401
    from mlora_lab.lab.compare.generations import compare_generations  # noqa: F401
    from mlora_lab.lab.compare.hparams import hparams  # noqa: F401
    from mlora_lab.lab.compare.results import compare, runs, summary  # noqa: F401
    from mlora_lab.lab.dashboard import Dashboard  # noqa: F401
    from mlora_lab.lab.evals.evaluate import evaluate  # noqa: F401
    from mlora_lab.lab.evals.evaluation import Evaluation, evaluations, load_evaluation  # noqa: F401
    from mlora_lab.lab.forms.builders import JobBuilder, TenantForm  # noqa: F401
    from mlora_lab.lab.launch import launch, resume, serve  # noqa: F401
    from mlora_lab.lab.launchers.ray import RayOptions  # noqa: F401
    from mlora_lab.lab.runs.attach import attach  # noqa: F401
    from mlora_lab.lab.runs.run import Request, Run  # noqa: F401
    from mlora_lab.lab.runs.sweep import SweepRun  # noqa: F401
    from mlora_lab.lab.slurm.cluster import SlurmOptions  # noqa: F401
    from mlora_lab.lab.sweeps import sweep  # noqa: F401
    from mlora_lab.lora import MultiLoRAModel  # noqa: F401
    from mlora_lab.search import (  # noqa: F401
        ASHA,
        PBT,
        Grid,
        Objective,
        Random,
        Sweep,
        choice,
        loguniform,
        randint,
        uniform,
    )
    from mlora_lab.spec.fields import SpecError  # noqa: F401
    from mlora_lab.spec.job import JobSpec  # noqa: F401
    from mlora_lab.spec.parts import RL, Eval, Parallel, Preference, Service  # noqa: F401
    from mlora_lab.spec.tenant import Tenant  # noqa: F401
    from mlora_lab.trackers import report  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlora_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
