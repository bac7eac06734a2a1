"""The one object every check shares: the spec being checked, what a form may remember between
checks, what has been loaded so far (the model's structure, the tokenizer) and the problems found.

Each phase of :mod:`mlora_lab.validate` is a set of functions ``check_*(ctx, ...)`` that read
``ctx.spec`` and add problems with :meth:`Context.say`; the phases run in the order of
:func:`mlora_lab.validate.validator.run_checks`, and a later phase reads what an earlier one
left (``ctx.model``, ``ctx.tok``, ``ctx.layout_ok``). Also here: how messages phrase what they show.
"""

from __future__ import annotations

import os
from typing import Any

from mlora_lab.lora.targets import name_matches
from mlora_lab.spec.fields import MAX_PROBLEMS, Problem, tenant_label
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief, is_int, path_problem
from mlora_lab.validate.introspect import ModelInfo, select_linear


class ValidationCache:
    """What a :class:`~mlora_lab.validate.Validator` may remember between specs, so a form can
    re-validate on every change.

    - the base model's structure and its tokenizer, per ``(base_model, tokenizer)`` path, kept only
      when both loaded without a problem (a path that is fixed later is seen at once);
    - each data file's problems, per file version (absolute path, mtime, size) and what the check
      depends on (the tokenizer's paths, ``seq_len``): a file is read again only when it changes,
      and renaming its tenant does not re-read it (a launch's snapshot of rows held in memory is kept
      the same way; a DataFrame itself, which may change in place, is read at every check).

    Not thread-safe: one cache per form, used from the notebook's thread.
    """

    def __init__(self) -> None:
        self.models: dict[tuple[Any, ...], tuple[ModelInfo | None, Any]] = {}
        """``(base_model, tokenizer)`` absolute paths -> (the model's structure, the tokenizer)."""
        self.data_files: dict[tuple[Any, ...], list[str]] = {}
        """(file version or snapshot key, model key, tokenizer loaded, ``seq_len``) -> its problems, each the
        rest of a sentence that starts with the field's name."""
        self.hub: dict[tuple[str, str | None, bool], str] = {}
        """``(Hub id, revision, adapter)`` -> its snapshot directory, once downloaded: a form checking on every
        change asks the Hub once per id."""

    def clear(self) -> None:
        """Forget everything (e.g. after a model directory was rewritten in place)."""
        self.models.clear()
        self.data_files.clear()
        self.hub.clear()


class Context:
    """One check of one ``JobSpec``: the spec, the cache, what the phases loaded, the problems found.

    A check's ``owner`` is the ``Tenant`` whose field it is, or ``None`` for a job field."""

    def __init__(self, spec: JobSpec, cache: ValidationCache | None = None) -> None:
        self.spec = spec
        self.cache = cache
        self.out: list[Problem] = []
        """Every problem found so far, in the order found."""
        self.model: ModelInfo | None = None
        """The base model's structure (built on the meta device); ``None`` until loaded, or if it cannot be."""
        self.tok: Any = None
        """The tokenizer; ``None`` until loaded, or if it cannot be."""
        self.layout_ok = False
        """``parallel`` is a valid layout (the TP / EP checks against the model need one)."""
        # What a target list selects in the model, per distinct list: resolving one walks every module of
        # the model, and 10,000 tenants of a 30-layer model (who share a few lists) took half a minute.
        self._linear: dict[tuple[str, ...], frozenset[str]] = {}
        self._hits: dict[str, tuple[tuple[str, str], ...]] = {}

    def say(self, owner: Tenant | None, field: str | None, message: str, path: str | None = None) -> None:
        """Add a problem of ``owner``'s ``field`` (a job-wide one when ``owner`` is ``None``)."""
        self.out.append(
            Problem(None, field, message, path)
            if owner is None
            else tenant_problem(owner.name, field, message, path)
        )

    def add(self, problem: Problem) -> None:
        """Add a problem made elsewhere (:func:`tenant_problem`, :func:`case_problem`)."""
        self.out.append(problem)

    def linear_of(self, targets: list[str] | tuple[str, ...]) -> frozenset[str]:
        """:func:`~mlora_lab.validate.introspect.select_linear` of the loaded model for ``targets`` (a
        valid target list), worked out once per distinct list during this check."""
        assert self.model is not None
        key = tuple(targets)
        hit = self._linear.get(key)
        if hit is None:
            hit = self._linear[key] = frozenset(select_linear(self.model, key))
        return hit

    def modules_named(self, target: str) -> tuple[tuple[str, str], ...]:
        """(full name, class name) of every module of the loaded model that ``target`` names (its full
        name or a ``.``-suffix of it, PEFT's rule), found once per distinct target during this check."""
        assert self.model is not None
        hit = self._hits.get(target)
        if hit is None:
            hit = self._hits[target] = tuple((n, c) for n, c in self.model.modules if name_matches(n, target))
        return hit

    def env_key(self) -> tuple[Any, ...] | None:
        """The cache key of the model and tokenizer: their absolute paths (``None`` if not both usable)."""
        paths = (self.spec.base_model, self.spec.tokenizer)
        if not all(p is None or usable_path(p) for p in paths):
            return None
        return tuple(os.path.abspath(p) if p is not None else None for p in paths)


# ---------------------------------------------------------------------------------------------
# Problems and how their messages phrase things
# ---------------------------------------------------------------------------------------------


def tenant_problem(name: Any, field: str | None, message: str, path: str | None = None) -> Problem:
    """A problem of the tenant called ``name``. A name that is not a string cannot key anything: the
    problem is then job-wide (``tenant=None``) and its message names the tenant as the spec holds it."""
    if isinstance(name, str):
        return Problem(name, field, message, path)
    return Problem(None, field, f"{tenant_label(name)}: {message}", path)


def case_problem(name: str, other: str, existing: bool = False) -> Problem:
    """Tenant ``name`` differs from ``other`` (an existing tenant of the run, with ``existing``) only
    in case: their adapter directories would be one directory on macOS and Windows."""
    return Problem(
        name,
        "name",
        f"name differs from {'existing tenant ' if existing else ''}{brief(other)} only in case; their "
        "adapters/<name> directories collide on case-insensitive filesystems (macOS, Windows): rename one",
    )


def capped(problems: list[Problem]) -> list[Problem]:
    """At most ``MAX_PROBLEMS`` problems, then one saying how many more there are."""
    if len(problems) <= MAX_PROBLEMS:
        return problems
    return [
        *problems[:MAX_PROBLEMS],
        Problem(None, None, f"... and {len(problems) - MAX_PROBLEMS} more problem(s)"),
    ]


def got(v: Any) -> str:
    """``got 'x' of type str``: what a message says it was given."""
    return f"got {brief(v)} of type {type(v).__name__}"


def more(items: list[str]) -> str:
    """`` (and N more)`` after the first of ``items`` is shown."""
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def bound(n: float) -> str:
    """An integer bound as messages write it: ``2**24``, ``2**53 - 1`` for the huge ones, else the number."""
    if is_int(n) and n >= 2**10:
        k = n.bit_length()
        if n == 2 ** (k - 1):
            return f"2**{k - 1}"
        if n == 2**k - 1:
            return f"2**{k} - 1"
    return f"{n:g}" if isinstance(n, float) else str(n)


def usable_path(v: Any) -> bool:
    """A non-empty string that can name a file (type and path problems are reported elsewhere)."""
    return isinstance(v, str) and bool(v) and path_problem(v) is None
