"""Checkpoints: ``checkpoints/step_<N>/``, in a format that never unpickles and is never read half-written.

::

    checkpoints/step_00000012/
        state.json             the state tree as JSON; each tensor replaced by {"@tensor": "<key>"}
        tensors.safetensors    the tensors, by key
        meta.json              {"format": 1, "step": 12, "files": {name: {"bytes", "sha256"}}} — written last

Loading a checkpoint reads JSON and safetensors only, so a crafted checkpoint cannot run code (a
pickle, as ``torch.save`` writes, can). A directory is built under a temporary name and renamed into
place (:func:`~mlora_lab.rundir.files.atomic_directory`), so ``step_*`` is complete when it exists; and
since disks and people damage files later, reading checks every file's size and SHA-256 against
``meta.json`` first. :func:`latest_intact` walks back from the newest checkpoint to the first intact
one and reports the damaged ones it skipped, with why.

The state tree holds dicts, lists, strings, numbers, booleans, None and tensors. Dict keys are strings
(or ints, stored as ``{"@items": [[key, value], ...]}``); tuples come back as lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save_file

from mlora_lab.rundir.files import (
    RunDirError,
    atomic_directory,
    atomic_write_json,
    name_problem,
    read_guarded,
)

FORMAT = 1
MAX_STEP = 2**53 - 1
"""The largest step a checkpoint may hold (``spec.MAX_COUNT``: what a float64 JSON reader holds exactly)."""
WRITE_ERRORS = (OSError, SafetensorError, RunDirError)
"""What a failed write raises: a full disk (safetensors reports ENOSPC as a SafetensorError), or a
folder of the run replaced by a symlink that leads outside it."""
STATE, TENSORS, META = "state.json", "tensors.safetensors", "meta.json"
STEP_DIR = re.compile(r"step_([0-9]{8,})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (damaged, incomplete, or in a format that is not loaded)."""


def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a state tree into a JSON-able tree and its tensors (``{"@tensor": key}`` in their place).
    Anything that is not JSON or a tensor raises ``TypeError``: nothing is ever pickled."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"t{len(tensors)}"
            # A separate contiguous CPU copy: safetensors refuses views and shared storage.
            tensors[key] = x.detach().to("cpu").contiguous().clone()
            return {"@tensor": key}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                reserved = [k for k in x if k.startswith("@")]
                if reserved:
                    raise TypeError(f"state keys may not start with '@' ({reserved[0]!r})")
                return {k: enc(v) for k, v in x.items()}
            if all(isinstance(k, int | str) and not isinstance(k, bool) for k in x):
                return {"@items": [[k, enc(v)] for k, v in x.items()]}
            raise TypeError(
                f"state dict keys must be str or int (got {sorted({type(k).__name__ for k in x})})"
            )
        if isinstance(x, list | tuple):
            return [enc(v) for v in x]
        if x is None or isinstance(x, str | bool | int | float):
            return x
        raise TypeError(f"cannot store {type(x).__name__} in a checkpoint (only JSON values and tensors)")

    return enc(tree), tensors


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(obj, dict):
        if set(obj) == {"@tensor"}:
            try:
                return tensors[obj["@tensor"]]
            except (KeyError, TypeError):
                raise CheckpointError(
                    f"state refers to a tensor {str(obj['@tensor'])[:40]!r} that is not stored"
                ) from None
        if set(obj) == {"@items"}:
            return {k: decode(v, tensors) for k, v in obj["@items"]}
        return {k: decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    return obj


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def step_of(path: Path) -> int:
    m = STEP_DIR.fullmatch(path.name)
    if not m:
        raise CheckpointError(f"{path.name}: not a checkpoint directory name (step_<N>)")
    return int(m.group(1))


def write_checkpoint(checkpoints: str | os.PathLike, step: int, tree: Any) -> Path:
    """Write ``tree`` as ``checkpoints/step_<step>`` (complete, or not at all)."""
    return write_state_dir(Path(checkpoints) / f"step_{step:08d}", step, tree)


def write_state_dir(
    final: str | os.PathLike,
    step: int,
    tree: Any,
    beside: Callable[[Path], None] | None = None,
    root: str | os.PathLike | None = None,
) -> Path:
    """Write ``tree`` in the checkpoint format at ``final`` (complete, or not at all; an old directory
    there is replaced). ``beside(tmp)`` may add more to the directory before it is complete (a PEFT
    adapter folder, say): it is checked by nobody but its own reader. The folders from ``root`` (default:
    ``final``'s parent) on are walked without following a link."""
    obj, tensors = encode(tree)
    final = Path(final)
    with atomic_directory(final, root=root) as tmp:
        if beside is not None:
            beside(tmp)
        (tmp / STATE).write_text(json.dumps(obj), encoding="utf-8")
        save_file(tensors, str(tmp / TENSORS), metadata={"format": "pt"})
        files = {
            name: {"bytes": (tmp / name).stat().st_size, "sha256": _digest(tmp / name)}
            for name in (STATE, TENSORS)
        }
        atomic_write_json(tmp / META, {"format": FORMAT, "step": step, "files": files})
    return final


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.json`` of an intact checkpoint; :class:`CheckpointError` saying what is wrong otherwise."""
    path = Path(path)
    if (path / "state.pt").exists() and not (path / STATE).exists():
        raise CheckpointError(
            f"{path.name} is in the old pickle format (state.pt), which is not loaded: unpickling a file "
            "can run code. Continue from an adapter instead (init_adapter), or resume with the mlora_lab "
            "version that wrote it"
        )
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        files = meta["files"]
        if meta.get("format") != FORMAT or set(files) != {STATE, TENSORS}:
            raise ValueError(f"unknown format {meta.get('format')!r}")
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: incomplete (no {META})") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path.name}: {META} is unreadable ({e})") from None
    for name, info in files.items():
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: {name} is missing") from None
        if size != info.get("bytes"):
            raise CheckpointError(
                f"{path.name}: {name} has {size} bytes, {info.get('bytes')} were written (truncated?)"
            )
        if _digest(f) != info.get("sha256"):
            raise CheckpointError(f"{path.name}: {name} does not match its checksum (damaged)")
    return meta


def read_checkpoint(path: str | os.PathLike, root: str | os.PathLike | None = None) -> Any:
    """The state tree of an intact checkpoint (verified first); :class:`CheckpointError` otherwise.

    With ``root`` (a folder above ``path``: the run's, say), every file is read through no link below it
    (:func:`~mlora_lab.rundir.files.read_guarded`, the writers' rule), once: the bytes checked against
    ``meta.json`` are the bytes decoded. A checkpoint that a request names is read so."""
    path = Path(path)
    if root is not None:
        return _read_guarded(path, Path(root))
    verify(path)
    try:
        tensors = load_file(str(path / TENSORS))
        obj = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"{path.name}: cannot be decoded ({e})") from None
    return decode(obj, tensors)


def _read_guarded(path: Path, root: Path) -> Any:
    """:func:`read_checkpoint` through no link below ``root``."""

    def read(name: str) -> bytes:
        try:
            return read_guarded(root, path / name)
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: incomplete (no {name})") from None
        except OSError as e:  # (a link in the way: LinkRefused says where)
            raise CheckpointError(f"{path.name}: {name} cannot be read ({e})") from None

    try:
        meta = json.loads(read(META))
        files = meta["files"]
        if meta.get("format") != FORMAT or set(files) != {STATE, TENSORS}:
            raise ValueError(f"unknown format {meta.get('format')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path.name}: {META} is unreadable ({e})") from None
    data = {}
    for name, info in files.items():
        data[name] = read(name)
        if not isinstance(info, dict) or len(data[name]) != info.get("bytes"):
            raise CheckpointError(f"{path.name}: {name} has {len(data[name])} bytes, not what was written")
        if hashlib.sha256(data[name]).hexdigest() != info.get("sha256"):
            raise CheckpointError(f"{path.name}: {name} does not match its checksum (damaged)")
    try:
        return decode(json.loads(data[STATE].decode("utf-8")), load(data[TENSORS]))
    except (ValueError, SafetensorError) as e:
        raise CheckpointError(f"{path.name}: cannot be decoded ({e})") from None


def check_job_state(state: Any, name: str = "checkpoint") -> None:
    """The parts of a job's checkpoint state that name files or count steps, checked before anything uses
    them: the checksums show a checkpoint is the one written, not that what wrote it was honest (a tenant
    named ``../..`` would be trained until its adapter is saved; a step of 1e30 is not a step).
    :class:`CheckpointError` saying what is wrong, ``name`` (the directory's) first."""

    def fail(why: str) -> None:
        raise CheckpointError(f"{name}: {why}")

    def count(value: Any, what: str, low: int = 0) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_STEP):
            fail(f"{what} must be a whole number from {low} to 2**53-1 (got {str(value)[:40]})")

    if not isinstance(state, dict):
        fail("its state is not an object")
    count(state.get("global_step"), "global_step")
    if "world_size" in state:
        count(state["world_size"], "world_size", low=1)
    tenants, removed = state.get("tenants"), state.get("removed", [])
    if not isinstance(tenants, dict) or not isinstance(removed, list):
        fail("its tenants must be an object and removed a list")
    for tenant in [*tenants, *removed]:
        if (why := name_problem(tenant)) is not None:
            fail(f"tenant name {str(tenant)[:80]!r} is not a safe name ({why})")
    for tenant, saved in tenants.items():
        spec = saved.get("spec") if isinstance(saved, dict) else None
        if not isinstance(spec, dict) or spec.get("name") != tenant:
            fail(f"the state of tenant {tenant!r} does not hold its own spec")
        count(saved.get("step"), f"tenant {tenant!r}: step")


BASE_SETTINGS = ("quantize", "quantize_embeddings", "dtype")
"""The base model's settings (``JobSpec`` fields) a job's checkpoint records, as its state's ``base``: the
adapters it holds were trained over that base (an nf4 one, a bfloat16 one), and a resume continues exactly,
so a resume keeps them (:func:`hold_back_base`), as it keeps a tenant's rank."""


def base_settings(spec: Any) -> dict[str, Any]:
    """``spec``'s :data:`BASE_SETTINGS`, as a checkpoint records them."""
    return {f: getattr(spec, f) for f in BASE_SETTINGS}


def read_base(path: str | os.PathLike) -> dict[str, Any] | None:
    """The base settings an intact checkpoint records (its ``state.json`` alone is read: no tensor);
    ``None`` for one written before they were kept, or one that cannot be read."""
    try:
        state = json.loads((Path(path) / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    base = state.get("base") if isinstance(state, dict) else None
    return base if isinstance(base, dict) else None


def hold_back_base(spec: Any, saved: Any) -> list[str]:
    """Put ``spec``'s base settings that differ from a checkpoint's (``saved``, its ``base``) back to the
    checkpoint's, and say so: one sentence per setting held back, naming both values. Nothing for a
    checkpoint that records none (written before they were kept), nor for a recorded value that no spec
    could hold (a crafted checkpoint)."""
    from mlora_lab.spec.job import DTYPES, QUANTIZE  # (the spec's choices; rundir otherwise knows no spec)

    if not isinstance(saved, dict):
        return []
    allowed = {
        "quantize": lambda v: v is None or (isinstance(v, str) and v in QUANTIZE),
        "quantize_embeddings": lambda v: isinstance(v, bool),
        "dtype": lambda v: isinstance(v, str) and v in DTYPES,
    }
    said = []
    for f in BASE_SETTINGS:
        then, now = saved.get(f), getattr(spec, f)
        if f not in saved or not allowed[f](then) or (type(now) is type(then) and now == then):
            continue
        setattr(spec, f, then)
        said.append(
            f"job.json's {f}={now!r} is held back: this run's adapters were trained over the base its checkpoint "
            f"records ({f}={then!r}), and the resume goes on over it (job.json says so again). To train over "
            "another base, launch a new run whose tenants start from these adapters (init_adapter)"
        )
    return said


def checkpoint_dirs(checkpoints: str | os.PathLike) -> list[Path]:
    """``step_*`` directories (not symlinks), oldest first."""
    root = Path(checkpoints)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=step_of)


def latest_intact(checkpoints: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint (None if there is none) and the newer ones skipped, with why."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(checkpoint_dirs(checkpoints)):
        try:
            verify(path)
            return path, skipped
        except CheckpointError as e:
            skipped.append((path, str(e)))
    return None, skipped


def prune(checkpoints: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for old in checkpoint_dirs(checkpoints)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
