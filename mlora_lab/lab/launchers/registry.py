"""Launchers by name: ``local``, ``slurm``, ``ray``, any an installed distribution declares, and any registered.

Each name maps to ``"module:Class"``, imported on first use: the Ray launcher imports ``ray`` (an
optional extra) and the Slurm one Slurm's script machinery, and neither is loaded by a run that uses
the other. The lab asks for a launcher by the name a run records (``status.json``'s ``launcher``, a
``launcher_job``'s ``kind``) and never branches on it::

    launcher = registry.get("slurm")      # -> a Launcher (mlora_lab.lab.launchers.base)
    registry.names()                      # ('local', 'slurm', 'ray', ...): ml.launch's and --launcher's choices
    registry.for_job(ref)                 # the launcher of an engine's job; LauncherError if not known here

A new engine is one module with one class and one entry point in its distribution's metadata, in the group
:data:`ENTRY_POINTS` (``[project.entry-points."mlora_lab.launchers"] k8s = "my_pkg.k8s:K8sLauncher"``), or
:func:`register` at run time. A name given here (the built-in ones, or registered) wins over an entry
point of the same name.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata

from mlora_lab.lab.launchers.base import Launcher, LauncherError
from mlora_lab.rundir.status import JobRef
from mlora_lab.spec.fields import SpecError

ENTRY_POINTS = "mlora_lab.launchers"
"""The entry-point group third-party engines declare themselves in: name -> ``"module:Class"``."""

LAUNCHERS: dict[str, str | type] = {
    "local": "mlora_lab.lab.launchers.local:LocalLauncher",
    "slurm": "mlora_lab.lab.launchers.slurm:SlurmLauncher",
    "ray": "mlora_lab.lab.launchers.ray:RayLauncher",
}
"""name -> ``"module:Class"`` (imported on first use) or the class itself."""


@functools.cache
def installed() -> dict[str, importlib.metadata.EntryPoint]:
    """The engines installed distributions declare (:data:`ENTRY_POINTS`), by name; read once per process
    (``installed.cache_clear()`` reads them again)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def _known() -> dict[str, str | type | importlib.metadata.EntryPoint]:
    """Every launcher: :data:`LAUNCHERS` first, then the installed ones it does not name."""
    return {**LAUNCHERS, **{n: ep for n, ep in installed().items() if n not in LAUNCHERS}}


def names() -> tuple[str, ...]:
    """The known launchers' names: the built-in and registered ones in order, then the installed ones."""
    return tuple(_known())


def unknown(name: object) -> str | None:
    """The problem of ``name`` as a launcher's name (None: it is one), naming the known ones."""
    if isinstance(name, str) and name in _known():
        return None
    return f"unknown launcher {name!r}; known: {', '.join(_known())}"


def with_options() -> tuple[str, ...]:
    """The names of the launchers that take options (an ``options_type``): what ``ml.launch``'s keywords
    may be. A launcher that cannot be loaded here is named too (it may take some)."""
    takes = []
    for name in _known():
        try:
            if get(name).options_type is None:
                continue
        except (LauncherError, SpecError):
            pass
        takes.append(name)
    return tuple(takes)


def register(name: str, target: str | type) -> None:
    """Make ``target`` (a Launcher class, or ``"module:Class"``) the launcher called ``name``."""
    LAUNCHERS[name] = target


def get(name: str) -> Launcher:
    """The launcher called ``name``. :class:`~mlora_lab.spec.fields.SpecError` naming the known ones
    for an unknown name; :class:`~mlora_lab.lab.launchers.base.LauncherError` when its module cannot
    be imported (an optional extra not installed: the error says which module is missing)."""
    if (problem := unknown(name)) is not None:
        raise SpecError([problem])
    target = _known()[name]
    if isinstance(target, importlib.metadata.EntryPoint):
        dist = getattr(target.dist, "name", None) or "its distribution"
        try:
            target = target.load()
        except Exception as e:  # (a third party's module: whatever its import raises)
            raise LauncherError(
                f"the {name} launcher ({target.value}, declared by {dist}) cannot be loaded "
                f"({type(e).__name__}: {e})"
            ) from None
    elif isinstance(target, str):
        module, _, cls = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), cls)
        except ImportError as e:
            raise LauncherError(
                f"the {name} launcher cannot be loaded ({type(e).__name__}: {e}); install its extra "
                f"(pip install 'mlora_lab[{name}]')"
            ) from None
    return target()


def for_job(ref: JobRef) -> Launcher:
    """The launcher of an engine's job ``ref`` (status.json's ``launcher_job``), to ask, stop or kill it.
    :class:`~mlora_lab.lab.launchers.base.LauncherError` when this Python cannot ask the engine: its
    launcher is not registered here (registered in another process, or its distribution not installed),
    or cannot be loaded. The caller then believes the run directory, as when the engine does not answer."""
    if unknown(ref.kind) is not None:
        raise LauncherError(
            f"launcher {ref.kind!r} is not registered in this Python (known: {', '.join(_known())}), so "
            f"its job {ref.id} cannot be asked from here; install or register it (mlora_lab.lab."
            f"launchers.registry.register, or the {ENTRY_POINTS!r} entry point of its distribution)"
        )
    return get(ref.kind)
