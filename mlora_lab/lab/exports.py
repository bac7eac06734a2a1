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
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""transformers ``model_type`` -> llama.cpp architecture, for the bases whose adapters :func:`export_gguf`
writes (their conversion renames weights without rearranging them, but for the Llama q/k permutation)."""
PERMUTED = {"llama"}  # llama.cpp architectures whose q_proj / k_proj rows are permuted per head


def merge(
    adapter_dir: str | os.PathLike,
    base_model: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: Any = None,
    revision: str | None = None,
) -> Path:
    """Write ``base_model`` with the PEFT adapter at ``adapter_dir`` merged into it, and the tokenizer, as a
    transformers model directory ``out_dir`` (atomically). ``dtype``: of the merged weights (a torch dtype or
    its name; default: the base's own, as stored)."""
    import peft
    import torch
    import transformers

    from mlora_lab.bases import quiet_loads, resolve_base
    from mlora_lab.rundir.files import atomic_directory

    base = resolve_base(base_model, revision=revision)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with quiet_loads():  # (in the notebook's kernel: a bar widget and PEFT's FutureWarning per merge)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype if dtype is not None else "auto"
        )
        merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    tok = transformers.AutoTokenizer.from_pretrained(resolve_base(tokenizer) if tokenizer else base)
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        merged.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def export_gguf(
    adapter_dir: str | os.PathLike,
    base_model: str | os.PathLike,
    out_path: str | os.PathLike,
    revision: str | None = None,
) -> Path:
    """Write the PEFT adapter at ``adapter_dir`` (trained on ``base_model``) as a GGUF LoRA adapter file
    ``out_path`` (atomically): see the module docstring. Raises ``ValueError`` for a base or an adapter the
    format cannot hold."""
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
    it by name: ``PeftModel.from_pretrained(base, repo_id)``."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(
        folder_path=str(adapter_dir),
        repo_id=repo_id,
        commit_message=commit_message or f"Upload the adapter {Path(adapter_dir).name} (mlora_lab)",
    )
    return str(getattr(info, "commit_url", info))
