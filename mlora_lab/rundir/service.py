"""A served job's files (``JobSpec.service``): where its Tinker service listens, and the keys it accepts.

```
<run_dir>/service/endpoint.json   {"url": "http://127.0.0.1:PORT", "base_model": "..."}: written by the job's
                                  rank 0 once its server listens, removed when the server stops
<run_dir>/service/keys.json       {"keys": {name: "tml-..."}}: the API keys, owner-only (0600); the job
                                  creates it with one key named "owner" when it has none, and re-reads it
                                  whenever it is rewritten (a notebook's new_key / revoke_key)
<run_dir>/service/weights/<model>/<name>/          a client's save_state (tinker://<model_id>/weights/<name>):
                                  the checkpoint format (:mod:`.checkpoint`) with the adapter, its AdamW state
                                  and the client's LoRA settings, and adapter/, a PEFT adapter directory
<run_dir>/service/sampler_weights/<model>/<name>/  a named sampler snapshot (save_weights_for_sampler):
                                  a PEFT adapter directory
```

``<model>`` is the model id with ``:`` written ``-`` (:func:`saved_folder`, :func:`local_path`).

Both are written whole, atomically, through the run directory's guard (:mod:`.files`). The job side
(:mod:`mlora_lab.service.keys`) and the notebook side (:class:`mlora_lab.lab.runs.served.ServedRun`) read and
write them only through this module. A key is ``"tml-"`` and 32 random bytes, URL-safe (the SDK refuses
keys without the ``tml-`` prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlora_lab.rundir.files import (
    RunDir,
    RunDirError,
    atomic_write_bytes,
    atomic_write_json,
    check_no_links,
    read_guarded,
)
from mlora_lab.text import read_json

KEY_PREFIX = "tml-"
OWNER = "owner"
"""The name of the key the job creates: the one ``svc.api_key`` is."""
KEYS_MODE = 0o600
BASE_MODEL_NAME = "base"
"""What the OpenAI endpoint of a served job calls its base model, beside the name clients give it."""


def served_base_name(model_name: Any, base_model: Any) -> Any:
    """The name a served job's clients give its base: ``Service.model_name`` where it is set, else
    ``base_model`` (a Hub id, or the local directory) as the spec holds it (unchecked: validation's)."""
    return model_name if isinstance(model_name, str) and model_name else base_model


def reserved_model_names(base_model: str) -> frozenset[str]:
    """The model names a served job's endpoint gives meaning to (``"base"`` and ``base_model``, the name its
    clients give the base): no tenant of the job may take one, or it would be listed twice and never be
    reached (a ``tinker://`` path is never a tenant's name)."""
    return frozenset({BASE_MODEL_NAME, base_model})


def keys_path(run: RunDir) -> Path:
    return run.service / "keys.json"


def endpoint_path(run: RunDir) -> Path:
    return run.service / "endpoint.json"


TINKER = "tinker://"
SAVED_KINDS = ("weights", "sampler_weights")
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
"""A checkpoint's name (``save_state(name)``, ``save_weights_for_sampler(name)``: the last part of its
``tinker://`` path, and a folder's name): 1 to 128 of ``A-Z a-z 0-9 . _ -``, not starting with a dot.
A name is never a path: no separator, and neither ``.`` nor ``..`` (the folders themselves) nor a
dot-first name (how a folder being written is named, :func:`~mlora_lab.rundir.files.atomic_directory`)."""
MODEL_ID = re.compile(r"[A-Za-z0-9_-]{1,64}:train:[0-9]{1,10}")
"""A training client's model id (``<session>:train:<n>``), the first part of its checkpoints' paths."""


def checkpoint_name_problem(name: object) -> str | None:
    """Why ``name`` is not a checkpoint name (:data:`CHECKPOINT_NAME`), or None if it is."""
    if not isinstance(name, str):
        return f"a checkpoint name is a string, got {type(name).__name__}"
    if CHECKPOINT_NAME.fullmatch(name):
        return None
    if not name:
        return "it is empty"
    if len(name) > 128:
        return f"it is {len(name)} characters long (at most 128)"
    if name.startswith("."):
        return f"{name[:20]!r} starts with a dot (a name is never a path: not '.', '..' nor a hidden folder)"
    bad = "".join(sorted({c for c in name if not re.fullmatch(r"[A-Za-z0-9._-]", c)}))
    return f"it holds {bad[:20]!r} (a name is 1-128 of A-Z a-z 0-9 . _ -, never a path)"


def split_tinker_path(tinker_path: object) -> tuple[str, str, str]:
    """``(model id, kind, name)`` of ``tinker://<model_id>/<weights|sampler_weights>/<name>``;
    ``ValueError`` saying what is wrong for anything else (a name that is a path above all)."""
    text = tinker_path if isinstance(tinker_path, str) else ""
    parts = text.removeprefix(TINKER).split("/") if text.startswith(TINKER) else []
    if len(parts) != 3 or parts[1] not in SAVED_KINDS:
        shown = repr(tinker_path)[:80]
        raise ValueError(f"{shown} is not tinker://<model>/weights|sampler_weights/<name>")
    run_id, kind, name = parts
    if not MODEL_ID.fullmatch(run_id):
        raise ValueError(f"{text[:80]!r}: {run_id[:40]!r} is not a model id (<session>:train:<n>)")
    if (why := checkpoint_name_problem(name)) is not None:
        raise ValueError(f"{text[:80]!r}: its name is not a checkpoint name: {why}")
    return run_id, kind, name


def saved_folder(service: str | os.PathLike, tinker_path: str) -> Path:
    """Where the ``tinker://<model_id>/<weights|sampler_weights>/<name>`` a service saved lives, under its
    folder ``service`` (``<run_dir>/service``); ``ValueError`` for a path of another form
    (:func:`split_tinker_path`: the folder is always ``service/<kind>/<model>/<name>``, never above)."""
    run_id, kind, name = split_tinker_path(tinker_path)
    return Path(service) / kind / run_id.replace(":", "-") / name


def local_path(run: RunDir, tinker_path: str) -> Path:
    """The PEFT adapter directory of a checkpoint the run's service saved (``FileNotFoundError`` when there
    is none; ``ValueError`` for a path of another form). No link is followed: a symlink anywhere on the way
    from the run directory, or inside the adapter folder, is refused (:class:`LinkRefused`), since the
    caller hands the folder to a reader (PEFT) that would follow it out of the run."""
    folder = saved_folder(run.service, tinker_path)
    adapter = folder / "adapter" if split_tinker_path(tinker_path)[1] == "weights" else folder
    try:
        check_no_links(run.root, adapter)
    except FileNotFoundError:
        raise FileNotFoundError(f"{tinker_path}: no saved adapter at {adapter}") from None
    if not (adapter / "adapter_config.json").is_file():  # (no link in it: is_file follows none)
        raise FileNotFoundError(f"{tinker_path}: no saved adapter at {adapter}")
    return adapter


@dataclass(frozen=True)
class Saved:
    """One checkpoint a service saved: its ``tinker://`` path, its kind (``weights``: a state;
    ``sampler_weights``: a snapshot), when it was written (its folder's mtime) and its size in bytes."""

    tinker_path: str
    kind: str
    name: str
    time: float
    size_bytes: int


def saved_of(service: str | os.PathLike, model_id: str) -> list[Saved]:
    """The checkpoints saved for ``model_id`` under the service folder ``service``, oldest first (folders
    being written, whose names start with a dot, are not listed; nor is anything reached through a link)."""
    out = []
    for kind in SAVED_KINDS:
        folder = Path(service) / kind / model_id.replace(":", "-")
        with contextlib.suppress(OSError):
            check_no_links(service, folder.parent)  # (the kind's folder: not a link)
            if os.path.islink(folder):
                continue
            for d in folder.iterdir():
                if d.name.startswith(".") or d.is_symlink() or not d.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
                    out.append(
                        Saved(f"{TINKER}{model_id}/{kind}/{d.name}", kind, d.name, d.stat().st_mtime, size)
                    )
    return sorted(out, key=lambda c: (c.time, c.tinker_path))


def saved_lora(service: str | os.PathLike, tinker_path: str) -> dict[str, object] | None:
    """The LoRA settings a saved checkpoint was made with (``rank``, ``train_attn``, ``train_mlp``,
    ``train_unembed`` for a state; ``rank`` for a snapshot, from its PEFT config), read from its JSON without
    loading a tensor, through no link; None when there is no such checkpoint, it cannot be read, or the path
    is not one of a checkpoint (:func:`split_tinker_path`)."""
    try:
        folder = saved_folder(service, tinker_path)
        state = split_tinker_path(tinker_path)[1] == "weights"
        d = json.loads(read_guarded(service, folder / ("state.json" if state else "adapter_config.json")))
    except (OSError, ValueError):
        return None
    if state:
        lora = d.get("lora") if isinstance(d, dict) else None
        return lora if isinstance(lora, dict) else None
    return {"rank": d.get("r")} if isinstance(d, dict) else None


def is_served(run: RunDir) -> bool:
    """Whether the run's job.json asks for a service (read as plain JSON: no spec is built)."""
    d, why = read_json(str(run.job), "a job file")
    return why is None and isinstance(d, dict) and isinstance(d.get("service"), dict)


# -- keys ----------------------------------------------------------------------------------------


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def read_keys(path: str | os.PathLike) -> dict[str, str]:
    """The keys file at ``path`` (``{}`` when there is none); ``ValueError`` when it is not a keys file
    (only a regular file is read)."""
    value, why = read_json(os.fspath(path), "a keys file")
    if why == "not found":
        return {}
    keys = value.get("keys") if isinstance(value, dict) else None
    if why is not None or not isinstance(keys, dict):
        raise ValueError(f"{path}: expected {{'keys': {{name: key}}}} ({why or 'another shape'})")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ValueError(f"{path}: every key's name and value must be strings")
    return dict(keys)


def write_keys(path: str | os.PathLike, keys: dict[str, str], root: str | os.PathLike | None = None) -> None:
    """Write ``{"keys": keys}`` to ``path`` atomically, owner-only, through no link (below ``root``)."""
    body = json.dumps({"keys": keys}, indent=1, sort_keys=True).encode()
    atomic_write_bytes(path, body, mode=KEYS_MODE, root=root)


# -- endpoint ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where a served job listens and the model name its clients pass."""

    url: str
    base_model: str


def write_endpoint(run: RunDir, url: str, base_model: str) -> None:
    atomic_write_json(endpoint_path(run), {"url": url, "base_model": base_model}, root=run.root)


def read_endpoint(run: RunDir) -> Endpoint | None:
    """The endpoint the job wrote, or None while there is none (not up yet, or stopped)."""
    path = endpoint_path(run)
    if not path.exists():
        return None
    d, why = read_json(str(path), "an endpoint file")
    if why == "not found":  # (removed while we looked)
        return None
    if why is not None or not isinstance(d, dict):
        raise RunDirError(f"{path}: not an endpoint file ({why or 'not a JSON object'})")
    url, base = d.get("url"), d.get("base_model")
    if not (isinstance(url, str) and isinstance(base, str)):
        raise RunDirError(f"{path}: expected {{'url': str, 'base_model': str}}")
    return Endpoint(url, base)


def remove_endpoint(run: RunDir) -> None:
    """Say the server no longer listens (nothing happens when the file is already gone)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(run.inside(endpoint_path(run)))
