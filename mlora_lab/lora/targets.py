"""Which layers a ``target_modules`` (or ``slot_modules``) value selects: the one home of these rules.

The rules are PEFT's, so that a tenant's targets mean the same here, in the saved adapter and in
``peft.PeftModel.from_pretrained``:

- ``"all-linear"`` (:data:`ALL_LINEAR`; as a string, any case, or as the list ``["all-linear"]``):
  every ``nn.Linear`` of the model except its **output layer** (:func:`output_layer_names`), as
  ``peft.tuners.tuners_utils._maybe_include_all_linear_layers`` does;
- a list of names: module ``n`` is selected by an entry ``t`` when ``n == t`` or ``n`` ends with
  ``"." + t`` (``check_target_module_exists``);
- any other string: a regular expression that must match the whole module name (``re.fullmatch``).

The output layer is found by identity with ``model.get_output_embeddings()`` (what PEFT does), so it
is excluded whatever it is called (``lm_head``, ``embed_out`` in GPT-NeoX-Japanese,
``output_projection`` in BioGPT, ``head`` in RWKV); only a model without that method (or one whose
method fails or returns ``None``) falls back to transformers' conventions (:func:`output_layer_names`).
Everything here works on models built on the ``meta`` device, and importing this module imports no
torch (:mod:`mlora_lab.spec.job` and :mod:`mlora_lab.validate` use it before any model exists).

Differences from PEFT, on purpose: LoRA goes on ``nn.Linear`` only (PEFT also takes GPT-2's
``Conv1D``), and with transformers v5 PEFT turns ``"all-linear"`` on a MoE model whose experts were
``nn.Linear`` in v4 (Mixtral, Qwen-MoE) into ``target_parameters`` on the packed experts and the
router as well; here packed experts are targeted only by ``target_parameters`` and a saved
``"all-linear"`` adapter is written with its layers spelled out (:func:`storable_targets`), so PEFT
loads exactly the layers it was trained on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

ALL_LINEAR = "all-linear"
"""The special ``target_modules`` entry (PEFT's): every ``nn.Linear`` except the output layer."""

OUTPUT_LAYER_NAMES = ("lm_head", "embed_out", "output_projection")
"""Top-level names transformers gives a causal LM's output layer; used only when the model cannot
say which module it is (no working ``get_output_embeddings``)."""


def is_all_linear(targets: object) -> bool:
    """Whether ``targets`` means "all-linear": the string (any case, as PEFT) or the list ``["all-linear"]``."""
    if isinstance(targets, str):
        return targets.lower() == ALL_LINEAR
    return isinstance(targets, list | tuple) and len(targets) == 1 and targets[0] == ALL_LINEAR


def name_matches(name: str, target: str) -> bool:
    """PEFT's rule for one list entry: ``target`` names module (or parameter) ``name`` by its full
    name or by a ``.``-separated suffix of it."""
    return name == target or name.endswith("." + target)


def matches(name: str, targets: str | Iterable[str]) -> bool:
    """Whether ``targets`` (a regex string, full match, or a list of names / suffixes) selects ``name``.
    ``"all-linear"`` is not resolved here (it needs the model): see :func:`match_targets`."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name_matches(name, t) for t in targets)


def has_all_linear(targets: object) -> bool:
    """Whether ``targets`` is, or (as a list) holds, ``"all-linear"``."""
    if isinstance(targets, str):
        return is_all_linear(targets)
    return isinstance(targets, list | tuple) and ALL_LINEAR in targets


def match_targets(names: Sequence[str], targets: str | Sequence[str], all_linear: Sequence[str]) -> list[str]:
    """The names among ``names`` that ``targets`` selects; ``"all-linear"`` selects ``all_linear`` (the
    model's :func:`linear_module_names`, a subset of ``names``), in its order.

    A list that holds ``"all-linear"`` besides other names selects the union, in ``names`` order: only
    ``JobSpec.slot_modules`` may be such a list (a tenant's ``target_modules`` holds ``"all-linear"``
    alone, as PEFT requires), e.g. slots for all-linear plus the output layer one tenant names.
    """
    if is_all_linear(targets):
        return list(all_linear)
    if has_all_linear(targets):
        chosen = set(all_linear) | {n for n in names if matches(n, [t for t in targets if t != ALL_LINEAR])}
        return [n for n in names if n in chosen]
    return [n for n in names if matches(n, targets)]


def output_layer_names(model: nn.Module) -> list[str]:
    """Full names of the model's output layer (more than one only if it is reachable by several paths).

    By identity with ``model.get_output_embeddings()``, as PEFT does. A model without that method, or
    one whose method raises or returns ``None``, falls back to transformers' conventions: the modules
    whose weight ``_tied_weights_keys`` ties to the input embedding, else a top-level ``nn.Linear``
    named in :data:`OUTPUT_LAYER_NAMES`.
    """
    from torch import nn

    named = list(model.named_modules(remove_duplicate=False))
    get = getattr(model, "get_output_embeddings", None)
    output = None
    if callable(get):
        try:
            output = get()
        except Exception:  # some backbones raise NotImplementedError: fall back to conventions
            output = None
    if isinstance(output, nn.Module):
        found = [n for n, m in named if m is output]
        if found:
            return found
    modules = dict(named)
    tied = getattr(model, "_tied_weights_keys", None)  # v5: {"lm_head.weight": "model.embed_tokens.weight"}
    keys = tied if isinstance(tied, dict | list | tuple | set) else ()
    found = [k.removesuffix(".weight") for k in keys if isinstance(k, str) and k.endswith(".weight")]
    found = [n for n in found if isinstance(modules.get(n), nn.Linear)]
    if found:
        return found
    return [n for n in OUTPUT_LAYER_NAMES if isinstance(modules.get(n), nn.Linear)]


def linear_module_names(model: nn.Module) -> list[str]:
    """What ``"all-linear"`` selects: names of every ``nn.Linear`` in ``model`` (in model order)
    except its output layer (:func:`output_layer_names`)."""
    from torch import nn

    output = set(output_layer_names(model))
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in output]


def storable_targets(selected: Sequence[str], module_names: Iterable[str]) -> list[str]:
    """The shortest ``.``-suffixes that select exactly ``selected`` among ``module_names`` (every module
    of the model) under PEFT's list rule, in order of first use: ``q_proj, k_proj, ...`` for a typical
    ``"all-linear"``, longer suffixes (up to the full name) where a short one would also select a module
    outside ``selected`` (say, an output layer that shares its last name with an inner layer).

    This is how an ``"all-linear"`` tenant is written to ``adapter_config.json`` and how the forms list
    the model's layers. Raises ``ValueError`` if a module of ``selected`` cannot be named without also
    naming another module (its full name is a suffix of another module's name).
    """
    chosen = set(selected)
    names = list(module_names)
    by_last: dict[str, list[str]] = {}
    for n in names:
        by_last.setdefault(n.rsplit(".", 1)[-1], []).append(n)
    safe: dict[str, bool] = {}

    def only_selected(suffix: str) -> bool:
        if suffix not in safe:
            pool = by_last.get(suffix.rsplit(".", 1)[-1], [])
            safe[suffix] = all(n in chosen for n in pool if name_matches(n, suffix))
        return safe[suffix]

    out: dict[str, None] = {}
    for name in selected:
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            suffix = ".".join(parts[i:])
            if only_selected(suffix):
                out.setdefault(suffix, None)
                break
        else:
            raise ValueError(
                f"module {name!r} cannot be targeted by name without also targeting another module"
            )
    return list(out)


def suffixes(names: Iterable[str]) -> str:
    """``"down_proj, k_proj, ..."``: the sorted distinct last name parts of ``names``, for messages."""
    return ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names}))
