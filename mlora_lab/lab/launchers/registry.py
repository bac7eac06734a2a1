"""Launchers by name: ``local``, ``slurm``, ``ray``, and any an extension registers.

Each name maps to ``"module:Class"``, imported on first use: the Ray launcher imports ``ray`` (an
optional extra) and the Slurm one Slurm's script machinery, and neither is loaded by a run that uses
the other. The lab asks for a launcher by the name a run records (``status.json``'s ``launcher``, a
``launcher_job``'s ``kind``) and never branches on it::

    launcher = registry.get("slurm")      # -> a Launcher (mlora_lab.lab.launchers.base)
    registry.names()                      # ('local', 'slurm', 'ray'): ml.launch's and --launcher's choices

A new engine is one module with one class, and one line here (or :func:`register` at run time).
"""

from __future__ import annotations

import importlib

from mlora_lab.lab.launchers.base import Launcher, LauncherError
from mlora_lab.spec.fields import SpecError

LAUNCHERS: dict[str, str | type] = {
    "local": "mlora_lab.lab.launchers.local:LocalLauncher",
    "slurm": "mlora_lab.lab.launchers.slurm:SlurmLauncher",
    "ray": "mlora_lab.lab.launchers.ray:RayLauncher",
}
"""name -> ``"module:Class"`` (imported on first use) or the class itself."""


def names() -> tuple[str, ...]:
    """The known launchers' names, in the order they were registered."""
    return tuple(LAUNCHERS)


def unknown(name: object) -> str | None:
    """The problem of ``name`` as a launcher's name (None: it is one), naming the known ones."""
    if isinstance(name, str) and name in LAUNCHERS:
        return None
    return f"unknown launcher {name!r}; known: {', '.join(LAUNCHERS)}"


def register(name: str, target: str | type) -> None:
    """Make ``target`` (a Launcher class, or ``"module:Class"``) the launcher called ``name``."""
    LAUNCHERS[name] = target


def get(name: str) -> Launcher:
    """The launcher called ``name``. :class:`~mlora_lab.spec.fields.SpecError` naming the known ones
    for an unknown name; :class:`~mlora_lab.lab.launchers.base.LauncherError` when its module cannot
    be imported (an optional extra not installed: the error says which module is missing)."""
    if (problem := unknown(name)) is not None:
        raise SpecError([problem])
    target = LAUNCHERS[name]
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), cls)
        except ImportError as e:
            raise LauncherError(
                f"the {name} launcher cannot be loaded ({type(e).__name__}: {e}); install its extra "
                f"(pip install 'mlora_lab[{name}]')"
            ) from None
    return target()
