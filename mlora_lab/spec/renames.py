"""The spec's renamed fields: each old name, what it is called now and why, in one table, and the one
warning every way of giving an old name says, until :data:`REMOVAL`.

    Tenant.eval_data   -> heldout_data    "eval" means the generation evaluations (JobSpec.evals, ml.Eval)
    JobSpec.eval_every -> heldout_every   (the same)
    JobSpec.serve      -> stay_up         kept apart from JobSpec.service and ml.serve (the Tinker API)

An old name is read three ways, each with a ``DeprecationWarning`` naming the new one:

* a constructor keyword (``Tenant(eval_data=...)``) and an attribute (``t.eval_data``, read or set), which
  :func:`add_old_names` gives a dataclass. Neither is a dataclass field (an ``InitVar`` would be one), so
  ``dataclasses.fields``, ``asdict`` and ``replace`` see the new names only: ``replace(spec, stay_up=...)``
  passes ``stay_up`` alone, never the old value again under the old name;
* a key of a dict read from JSON (``job.json``, ``sweep.json``, a checkpoint's tenants, a control message),
  which :func:`renamed_keys` maps and whose reader warns once per file with :func:`warn_old_keys`; and a
  key of a pickled object's state (a ``Tenant`` or ``JobSpec`` pickled by an older version), mapped the
  same way by the ``__setstate__`` :func:`add_old_names` gives the class.
  Files are always written with the new names, so a run directory written by an older version loads, runs
  and resumes, and its next ``job.json`` is new.

An old name given beside its new one with another value is refused (:func:`disagree`), in the constructor
as in JSON: neither can silently win. (Except in ``dataclasses.replace(t, eval_data=...)``, which passes every
field as it is beside the change: there the change wins, as ``replace`` means.) The warning is attributed to the first caller outside mlora_lab (the
notebook cell or script that used the old name), where Python's default filters show it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from mlora_lab.spec.fields import SpecError

REMOVAL = "mlora_lab 0.3 (or 2027-06-01, whichever comes first)"
"""When the old names stop being read: after it, an old name is an unknown field (a ``SpecError``)."""


@dataclass(frozen=True)
class Renamed:
    """One renamed field: ``old`` is read as ``new`` until :data:`REMOVAL`; ``why`` says why in one clause."""

    old: str
    new: str
    why: str


_EVAL = '"eval" now means the generation evaluations: JobSpec.evals, ml.Eval'
RENAMED: dict[str, tuple[Renamed, ...]] = {
    "Tenant": (Renamed("eval_data", "heldout_data", _EVAL),),
    "JobSpec": (
        Renamed("eval_every", "heldout_every", _EVAL),
        Renamed("serve", "stay_up", "kept apart from service and ml.serve, which serve the Tinker API"),
    ),
}
"""Every rename, by the name of the dataclass whose field it is."""


def disagree(r: Renamed) -> str:
    """The refusal of ``r.old`` and ``r.new`` given together with different values."""
    return f"{r.old} (the old name of {r.new}) and {r.new} disagree: give {r.new} only"


def deprecation(what: str, renamed: Sequence[Renamed]) -> str:
    """The warning's sentence: ``what`` (``"Tenant(eval_data=...)"``, ``"job.json's 'eval_every'"``) is
    deprecated, its new name(s), why, and until when the old ones are read:
    ``"Tenant.eval_data: deprecated, use heldout_data (...). The old name is read until mlora_lab 0.3 ..."``."""
    news = _listed([r.new for r in renamed])
    whys = "; ".join(dict.fromkeys(r.why for r in renamed))
    return (
        f"{what}: deprecated, use {news} ({whys}). The old name{'s are' if len(renamed) > 1 else ' is'} "
        f"read until {REMOVAL}, then refused"
    )


def warn_old(message: str) -> None:
    """A ``DeprecationWarning`` of ``message``, attributed to the first caller outside mlora_lab (a notebook
    cell, a script; ``dataclasses.replace`` and ``copy`` are looked through too), so that Python's default
    filters show it where the old name was written rather than hide it inside the package."""
    frame, level = sys._getframe(1), 2  # level 2: the function that called warn_old
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _OURS:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


_OURS = ("mlora_lab", "dataclasses", "copy", "functools")


def renamed_keys(
    d: dict[str, Any], renamed: Iterable[Renamed], where: str
) -> tuple[dict[str, Any], list[str], list[str]]:
    """``(d with each old key read as its new name, the old names found, problems)``: a problem (starting with
    ``where``) for an old key beside its new one with another value. ``d`` itself is returned when it holds
    no old key (a million tenants' dicts are not copied), else a copy: the caller's dict is never changed."""
    found = [r for r in renamed if r.old in d]
    if not found:
        return d, [], []
    out, problems = dict(d), []
    for r in found:
        value = out.pop(r.old)
        if r.new in out and not _same(out[r.new], value):
            problems.append(f"{where}: {disagree(r)}")
        out[r.new] = value
    return out, [r.old for r in found], problems


def warn_old_keys(what: str, old: Iterable[str], renamed: Iterable[Renamed]) -> None:
    """One warning for every old key a file held (``old``: their names, repeats allowed): ``what`` names the
    file (``"job.json"``), so a job of 100 tenants that each give ``eval_data`` warns once, not 100 times."""
    names = set(old)
    found = [r for r in renamed if r.old in names]
    if found:
        keys = _listed([repr(r.old) for r in found])
        warn_old(
            deprecation(f"{what}'s {keys}", found)
            + " (read as the new names now; files are written with them)"
        )


def add_old_names(cls: type, renamed: Sequence[Renamed]) -> None:
    """Give dataclass ``cls`` its old field names: a property each (reading and setting the new field, with
    the warning) and a keyword each of its ``__init__``, which must then agree with the new field when both
    are given (:func:`disagree`, a :class:`SpecError`)."""
    for r in renamed:
        setattr(cls, r.old, _alias(cls.__name__, r))
    order = [f.name for f in fields(cls) if f.init]
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        used = [r for r in renamed if r.old in kwargs]
        if used:
            problems = []
            # dataclasses.replace(obj, old=...) passes every field as it is, the new name's too: the change wins
            replacing = _called_by_replace(sys._getframe(1))
            for r in used:
                value = kwargs.pop(r.old)
                position = order.index(r.new)
                given = (
                    kwargs[r.new] if r.new in kwargs else args[position] if position < len(args) else _UNSET
                )
                if given is not _UNSET and not replacing and not _same(given, value):
                    problems.append(disagree(r))
                elif given is _UNSET or replacing:
                    kwargs[r.new] = value
            warn_old(deprecation(f"{cls.__name__}({', '.join(f'{r.old}=...' for r in used)})", used))
            if problems:
                raise SpecError(problems)
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    if "__setstate__" not in vars(cls):
        cls.__setstate__ = _setstate(cls.__name__, renamed)


def _setstate(owner: str, renamed: Sequence[Renamed]) -> Any:
    """``__setstate__`` for a pickle (or ``copy``) of ``owner`` made before the rename: its state (the
    instance's ``__dict__``) holds an old key, which would sit unseen under the old name's property while
    the new field read its default. The old keys are read as the new names with one warning per object
    (:func:`warn_old_keys`); an old key beside its new one with another value is a :class:`SpecError`."""

    def __setstate__(self: Any, state: Any) -> None:
        if isinstance(state, tuple):  # (dict state, slots state): what pickle gives a class with both
            state, slots = state
            for name, value in (slots or {}).items():
                object.__setattr__(self, name, value)
        state, old, problems = renamed_keys(state or {}, renamed, f"a pickled {owner}")
        if problems:
            raise SpecError(problems)
        warn_old_keys(f"a pickled {owner}", old, renamed)
        self.__dict__.update(state)

    return __setstate__


def _called_by_replace(frame: Any) -> bool:
    """Whether ``frame`` is ``dataclasses.replace`` (or the helper it calls, in Python 3.13+)."""
    code = frame.f_code
    return code.co_filename == dataclasses.__file__ and code.co_name in ("replace", "_replace")


def _alias(owner: str, r: Renamed) -> property:
    def get(self: Any) -> Any:
        warn_old(deprecation(f"{owner}.{r.old}", [r]))
        return getattr(self, r.new)

    def set_(self: Any, value: Any) -> None:
        warn_old(deprecation(f"{owner}.{r.old}", [r]))
        setattr(self, r.new, value)

    return property(
        get, set_, doc=f"The old name of :attr:`{owner}.{r.new}` (deprecated: read until {REMOVAL})."
    )


_UNSET: Any = object()


def _listed(names: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _same(a: Any, b: Any) -> bool:
    """Whether two values given for one field are the same setting (rows held in memory: the same object;
    a DataFrame's ``==`` is a frame, not a bool)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # (an ambiguous truth value, a hostile __eq__)
        return False
