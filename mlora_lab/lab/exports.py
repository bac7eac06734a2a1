"""Adapters out: a tenant's adapter merged into its base model, or written as a GGUF LoRA adapter for llama.cpp.

**Merged.** ``W' = W + s · B A`` for every adapted weight (PEFT's ``merge_and_unload``: ``s = alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA), saved as a plain transformers model with its tokenizer. Its logits are the
base-with-adapter's, up to the rounding of adding ``s·BA`` to ``W`` once instead of ``s·(xA^T)B^T`` to every
output.

**GGUF.** What llama.cpp's ``convert_lora_to_gguf.py`` writes and ``llama-cli --lora`` loads: one file with the
base's architecture, ``general.type = "adapter"``, ``adapter.type = "lora"`` and ``adapter.lora.alpha``, and per
adapted weight ``<gguf name>.lora_a`` (PEFT's ``A`` [r, in], GGUF dims [in, r]) and ``<gguf name>.lora_b``
(``B`` [out, r]), named after the base's GGUF tensors (``blk.0.attn_q.weight``). llama.cpp scales a LoRA by
``alpha / r``, so an rsLoRA adapter is written with ``alpha · sqrt(r)``. Llama-family models store the query and
key projections with their rotary halves interleaved per head (``convert_hf_to_gguf.py``'s ``permute``), so the
same row permutation is applied to those projections' ``B``. Architectures whose conversion rearranges other
weights are refused, naming those that are written. Checked against llama.cpp itself (``llama-cpp-python``
0.3.36, ``scripts/check-llama-cpp.sh``): over SmolLM2-135M in float32 its logits with the adapter are PEFT's to
3e-6 (relative), what the adapter adds to them to 3e-4.

**Where they are written.** A merge or an export never removes or replaces what it did not write. Anything
inside a run directory (the run's own, or any other: :func:`~mlora_lab.rundir.files.is_run_folder`) is refused,
but for the run's ``exports/`` folder: a run's files are its job's (a merge into a run once lost it). A
merged model goes into a new or empty folder (:func:`check_merge_target`); with ``overwrite=True`` into one
that holds files too, where only the files a merge writes are replaced (config, weights and their index,
generation config, tokenizer files) and the others are kept (:func:`~mlora_lab.rundir.files.files_into`: built
in a temporary folder, ``config.json`` moved in last, so a merge cut short never leaves a folder that looks
complete). A GGUF file replaces an existing file only with ``overwrite=True``, or in a run's ``exports/``
(where the run's earlier exports are). Refusals and failures are :class:`ExportError`, naming the path as the
user gave it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from mlora_lab.rundir.files import run_holding
from mlora_lab.text import brief, brief_list, error_line, show_path

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""transformers ``model_type`` -> llama.cpp architecture, for the bases whose adapters :func:`export_gguf`
writes (their conversion renames weights without rearranging them, but for the Llama q/k permutation)."""
PERMUTED = {"llama"}  # llama.cpp architectures whose q_proj / k_proj rows are permuted per head
MERGED_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes a merged model's weights may be saved in (``None``, or ``"auto"``: the base's own)."""
WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The weights a merge writes (one file, or shards and their index): with ``overwrite=True`` an earlier
merge's that this one does not write go, so the folder holds one model (transformers reads
``model.safetensors`` before an index: an old one left beside new shards would be loaded instead)."""


class ExportError(ValueError):
    """A merge, an export or a push refused or failed: one sentence naming the path (or the repository) the user
    gave and why. (A ``ValueError``: ``mlora-lab`` prints it as one line, the dashboard's export tab shows it.)"""


def shown(path: str | os.PathLike) -> str:
    """A path as the user gave it, with its absolute form when that says more (``.``: the current folder's)."""
    given = os.fspath(path)
    full = os.path.abspath(given)
    return show_path(given) if given == full else f"{show_path(given)} ({show_path(full)})"


def merged_dtype(dtype: Any) -> Any:
    """The torch dtype a merge saves its weights in: ``None`` (the base's own) for ``None`` or ``"auto"``; one
    of :data:`MERGED_DTYPES` given by name or as a torch dtype. :class:`ExportError` for anything else, before
    anything is read or written."""
    import torch

    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str) and dtype in MERGED_DTYPES:
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and str(dtype).removeprefix("torch.") in MERGED_DTYPES:
        return dtype
    raise ExportError(
        f"dtype {brief(dtype)} is not one a merged model is saved in: give one of {', '.join(MERGED_DTYPES)} "
        "(or None: the base's own)"
    )


def _run_exports(path: Path, given: str, what: str) -> bool:
    """Whether ``path`` is in a run's ``exports/`` folder; :class:`ExportError` when it is elsewhere in a run
    directory (:func:`~mlora_lab.rundir.files.run_holding`), which no export writes into."""
    run = run_holding(path)
    if run is None:
        return False
    for root, inside in ((run, path), (Path(os.path.realpath(run)), Path(os.path.realpath(path)))):
        try:
            parts = inside.relative_to(root).parts
        except ValueError:
            continue
        if parts[:1] == ("exports",):
            return True
    where = "is a run directory" if path in (run, Path(os.path.realpath(run))) else (
        f"is inside the run directory {show_path(run)}"
    )  # fmt: skip
    raise ExportError(
        f"{shown(given)} {where}: {what} is never written into a run (its job.json, checkpoints and adapters "
        f"would be replaced); choose a folder outside it, or the run's exports/ folder ({show_path(run / 'exports')})"
    )


def check_merge_target(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """``out_dir`` (absolute) if a merged model may be written there: outside every run directory (but for a
    run's ``exports/``), and a new or empty folder, or with ``overwrite`` a folder holding files too (a merge
    replaces only its own files there). :class:`ExportError` naming ``out_dir`` as given otherwise."""
    given = os.fspath(out_dir)
    path = Path(os.path.abspath(given))
    _run_exports(path, given, "a merged model")
    if os.path.lexists(path):
        if not path.is_dir():
            raise ExportError(f"{shown(given)} is a file, not a folder: a merged model is a folder of files")
        try:
            entries = sorted(os.listdir(path))
        except OSError as e:
            raise ExportError(f"{shown(given)} cannot be read ({e.strerror or error_line(e)})") from None
        if entries and not overwrite:
            raise ExportError(
                f"{shown(given)} is not empty (it holds {brief_list(entries, 3)}): a merge writes into a new or "
                "empty folder; overwrite=True (mlora-lab merge --overwrite) replaces the files a merge writes "
                "there and keeps the others"
            )
    return path


def check_gguf_target(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """``path`` (absolute) if a GGUF adapter file may be written there: outside every run directory (but for a
    run's ``exports/``), not a folder, and a new file, or with ``overwrite`` (or in a run's ``exports/``) an
    existing regular file. :class:`ExportError` naming ``path`` as given otherwise."""
    given = os.fspath(path)
    out = Path(os.path.abspath(given))
    in_exports = _run_exports(out, given, "a GGUF adapter")
    if out.is_dir():
        raise ExportError(
            f"{shown(given)} is a folder: name the GGUF file to write (e.g. {show_path(out / 'adapter.gguf')})"
        )
    if os.path.lexists(out):
        if not stat.S_ISREG(os.lstat(out).st_mode):
            raise ExportError(
                f"{shown(given)} exists and is not a regular file: a GGUF adapter is never written there"
            )
        if not (overwrite or in_exports):
            raise ExportError(
                f"{shown(given)} exists: overwrite=True (mlora-lab export --overwrite) replaces it"
            )
    return out


def merge(
    adapter_dir: str | os.PathLike,
    base_model: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: Any = None,
    revision: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``base_model`` with the PEFT adapter at ``adapter_dir`` merged into it, and the tokenizer, as a
    transformers model directory ``out_dir``: a new or empty folder, or with ``overwrite`` one whose other files
    are kept (see the module docstring; :class:`ExportError` otherwise, and for a folder in a run). ``dtype``:
    of the merged weights (:data:`MERGED_DTYPES`, by name or as a torch dtype; default: the base's own, as
    stored). transformers' progress bars stay off (a widget per call in a notebook)."""
    dtype = merged_dtype(dtype)  # (both checks before the model is read)
    out = check_merge_target(out_dir, overwrite)
    import peft
    import transformers

    from mlora_lab.bases import quiet_loads, resolve_base
    from mlora_lab.rundir.files import files_into

    base = resolve_base(base_model, revision=revision)
    with quiet_loads():  # (no progress widget, nor PEFT's is_gradient_checkpointing FutureWarning: m6)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype if dtype is not None else "auto"
        )
        merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
        tok = transformers.AutoTokenizer.from_pretrained(resolve_base(tokenizer) if tokenizer else base)
        try:
            with files_into(out, replace=overwrite, stale=WEIGHT_FILES.fullmatch, last="config.json") as tmp:
                merged.save_pretrained(tmp)
                tok.save_pretrained(tmp)
        except OSError as e:  # (its message, never the temporary names it was written under)
            raise ExportError(
                f"{shown(out_dir)}: the merged model could not be written ({e.strerror or type(e).__name__})"
            ) from None
    return Path(out_dir)


def export_gguf(
    adapter_dir: str | os.PathLike,
    base_model: str | os.PathLike,
    out_path: str | os.PathLike,
    revision: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the PEFT adapter at ``adapter_dir`` (trained on ``base_model``) as a GGUF LoRA adapter file
    ``out_path`` (atomically; an existing file only with ``overwrite``, or in a run's ``exports/``; never in a
    run directory elsewhere: :func:`check_gguf_target`): see the module docstring. Raises ``ValueError`` for a
    base or an adapter the format cannot hold, :class:`ExportError` (one too) for a path refused or unwritable."""
    check_gguf_target(out_path, overwrite)
    import gguf
    import numpy as np
    import transformers
    from safetensors.torch import load_file

    from mlora_lab.bases import resolve_base
    from mlora_lab.rundir.files import atomic_write_bytes

    config = transformers.AutoConfig.from_pretrained(resolve_base(base_model, revision=revision))
    arch = GGUF_ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(
            f"a GGUF adapter is written for {', '.join(sorted(GGUF_ARCHITECTURES))} bases; this base is "
            f"{config.model_type!r} (llama.cpp's conversion rearranges its weights in ways not reproduced here)"
        )
    adapter = Path(adapter_dir)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    problems = []
    if settings.get("target_parameters"):
        problems.append("it adapts packed MoE experts (target_parameters), which llama.cpp's LoRA does not")
    rank, alpha = int(settings["r"]), float(settings["lora_alpha"])
    if settings.get("rank_pattern") or settings.get("alpha_pattern"):
        problems.append("it has per-module ranks or alphas (one alpha for all of them in GGUF)")
    if problems:
        raise ValueError(f"the adapter at {adapter} cannot be written as GGUF: " + "; ".join(problems))
    if settings.get("use_rslora"):
        alpha *= math.sqrt(rank)  # llama.cpp scales by alpha / r; rsLoRA's scale is alpha / sqrt(r)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    out: dict[str, np.ndarray] = {}
    for key, value in sorted(tensors.items()):
        module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        which = part.split(".")[0]  # "A" or "B"
        if which not in ("A", "B"):
            raise ValueError(f"{key}: not a LoRA A or B matrix (GGUF adapters hold linear layers' LoRA only)")
        target = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if target is None:
            raise ValueError(f"{module}: no GGUF tensor of the {arch} architecture corresponds to it")
        data = value.float()
        if which == "B" and arch in PERMUTED and module.endswith(("q_proj", "k_proj")):
            n = heads if module.endswith("q_proj") or not kv_heads else kv_heads
            data = (
                data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:])
                .swapaxes(1, 2)
                .reshape(data.shape)
            )
        out[f"{target}.lora_{which.lower()}"] = data.numpy()
    tmp = Path(
        tempfile.mkdtemp(prefix="mlora_gguf_")
    )  # (the writer wants a path; the result moves atomically)
    try:
        writer = gguf.GGUFWriter(str(tmp / "adapter.gguf"), arch)
        writer.add_string(gguf.Keys.General.TYPE, "adapter")
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for name, array in out.items():
            writer.add_tensor(name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        path = Path(out_path)
        atomic_write_bytes(path, (tmp / "adapter.gguf").read_bytes())
        return path
    except OSError as e:  # (its message, never the temporary names it was written under)
        raise ExportError(
            f"{shown(out_path)}: the GGUF adapter could not be written ({e.strerror or error_line(e)})"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def push_to_hub(
    adapter_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = True,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload the PEFT adapter at ``adapter_dir`` to the Hub repository ``repo_id`` (made, private unless
    ``private=False``, if it does not exist) through ``huggingface_hub`` (its token: ``token``, else
    ``HF_TOKEN`` or a login; ``HF_ENDPOINT`` for another server). Returns the commit's URL. PEFT then loads
    it by name: ``PeftModel.from_pretrained(base, repo_id)``. :class:`ExportError` naming the repository when
    the Hub cannot be reached or refuses (no credentials, say), or HF_HUB_OFFLINE is set."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from mlora_lab import hub

    where = brief(repo_id)
    if hub.offline():
        raise ExportError(f"{where}: nothing is pushed while HF_HUB_OFFLINE is set (unset it to push)")
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(adapter_dir),
            repo_id=repo_id,
            commit_message=commit_message or f"Upload the adapter {Path(adapter_dir).name} (mlora_lab)",
        )
    except HfHubHTTPError as e:
        raise ExportError(f"the Hub refused the push to {where}: {error_line(e, 200)}") from None
    except Exception as e:  # (the boundary of a call to the Hub: one sentence, never a traceback)
        why = hub.silence(e) if hub.unanswered(e) else f"{type(e).__name__}: {error_line(e, 200)}"
        raise ExportError(f"{where} could not be pushed: {why}") from None
    return str(getattr(info, "commit_url", info))
