"""mlora_lab: train and compare many LoRA adapters at once on one frozen base model, from a notebook.

Public names are resolved lazily (PEP 562): ``import mlora_lab`` imports nothing heavy, and the
training processes, which import ``mlora_lab.train``, never load the notebook side (pandas,
matplotlib, ipywidgets). ``ml.launch`` imports the launcher on first use, ``ml.TenantForm`` the widgets.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {  # public name -> the module that defines it
    "Dashboard": "mlora_lab.dashboard",
    "JobBuilder": "mlora_lab.widgets",
    "JobSpec": "mlora_lab.spec",
    "MultiLoRAModel": "mlora_lab.lora",
    "Parallel": "mlora_lab.spec",
    "Request": "mlora_lab.launch",
    "Run": "mlora_lab.launch",
    "SlurmOptions": "mlora_lab.slurm",
    "SpecError": "mlora_lab.spec",
    "Sweep": "mlora_lab.search",
    "SweepRun": "mlora_lab.sweeps",
    "ASHA": "mlora_lab.search",
    "Grid": "mlora_lab.search",
    "Objective": "mlora_lab.search",
    "PBT": "mlora_lab.search",
    "Random": "mlora_lab.search",
    "choice": "mlora_lab.search",
    "loguniform": "mlora_lab.search",
    "randint": "mlora_lab.search",
    "sweep": "mlora_lab.sweeps",
    "uniform": "mlora_lab.search",
    "Tenant": "mlora_lab.spec",
    "TenantForm": "mlora_lab.widgets",
    "attach": "mlora_lab.launch",
    "compare": "mlora_lab.report",
    "compare_generations": "mlora_lab.report",
    "hparams": "mlora_lab.report",
    "resume": "mlora_lab.launch",
    "runs": "mlora_lab.launch",
    "summary": "mlora_lab.report",
}
__all__ = sorted([*_EXPORTS, "launch"])

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from mlora_lab.dashboard import Dashboard  # noqa: F401
    from mlora_lab.launch import Request, Run, attach, launch, resume, runs  # noqa: F401
    from mlora_lab.lora import MultiLoRAModel  # noqa: F401
    from mlora_lab.report import compare, compare_generations, hparams, summary  # noqa: F401
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
    from mlora_lab.slurm import SlurmOptions  # noqa: F401
    from mlora_lab.spec import JobSpec, Parallel, SpecError, Tenant  # noqa: F401
    from mlora_lab.sweeps import SweepRun, sweep  # noqa: F401
    from mlora_lab.widgets import JobBuilder, TenantForm  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlora_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


class _Package(types.ModuleType):
    """``mlora_lab.launch`` names both the public function and the module that defines it. When the
    module is first imported, Python records it as an attribute of this package, which would hide
    the function; this property keeps ``ml.launch`` the function (as an eager import used to)."""

    @property
    def launch(self) -> Any:
        from mlora_lab.launch import launch

        return launch

    @launch.setter
    def launch(self, value: Any) -> None:
        pass  # the import system recording the submodule: nothing to keep


sys.modules[__name__].__class__ = _Package
