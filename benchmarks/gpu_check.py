"""Issue 35's GPU check: the CUDA equivalences and the figures G1-G4 (and issue 36's quantized base), in one run
that writes one JSON.

    bash scripts/gpu-check.sh            # on a GPU machine (≤ 8 min on one H200); what scripts/gpu-wheels.sh
                                         # gathered in .whl/ is installed first
    bash scripts/gpu-check.sh --dry      # here, on the CPU: every part on tiny sizes, to show it runs

Parts (each in its own time budget; one that fails is recorded with its error and the others go on):

- ``env``: the device, versions, the dtype ``dtype="auto"`` gives, the TF32 settings and the attention
  implementation transformers picks.
- ``a_equivalences``: the CUDA-sensitive tests, run by pytest on the GPU: grouped LoRA = the per-segment
  reference (every architecture, padded and exact buckets), mixed tenants = each alone and one tenant =
  PEFT (fp32, TF32 off: the job on the GPU against PEFT on the CPU), the bf16 base against PEFT's, the
  static sampler against PEFT ``generate``, the RL loss = TRL's, and a served job driven by the ``tinker``
  SDK whose state is saved, loaded and resumed.
- ``g1_training``: tokens/s of one training step (forward, backward, AdamW) with 1, 4 and 16 tenants
  (ranks 8/16/32 in turn, all linear layers) sharing 16 rows of 512 tokens on a ~0.5B Qwen2 config built
  here (random weights, bf16), against one PEFT adapter (rank 16) on the same 16 rows, and against 16 PEFT
  steps one after another (one row each: 16 tenants trained the PEFT way).
- ``g2_sampling``: tokens/s of 16 adapters × 8 samples × 256 new tokens in one ``sample()`` call (the static
  path, CUDA graphs), against the base alone in the same sampler, and against PEFT ``generate`` one adapter
  at a time (measured on ``peft_adapters`` of them, the rate extrapolated to 16).
- ``g3_grpo``: ``benchmarks/rl.py --part grpo``: a 4-tenant GRPO job against 4 TRL ``GRPOTrainer`` runs.
- ``g4_clients``: ``benchmarks/service.py --part clients``: 4 SDK clients through ``ml.serve`` against 1.
- ``g5_async`` (issue 52): ``benchmarks/rl.py --part async``: 4 GRPO tenants, synchronous on two GPUs against a
  trainer GPU and a rollout GPU (``rollout_ranks=1``, ``max_staleness`` 1 and 2); needs two GPUs.
- ``q_quantized`` (issue 36): the same base in bf16, nf4 and nf4 with ``quantize_embeddings``: its bytes, a
  4-tenant step's time and peak memory, against one PEFT adapter over the same base.

Every part records its peak GPU memory: this process's ``max_memory_allocated`` and the device's used
memory sampled every 0.2 s (which sees the jobs that parts (a), (d) and (e) start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

GOALS = {
    "g1_vs_one_peft_adapter": (">=", 0.95),
    "g1_vs_16_sequential_peft_steps": (">=", 3.0),
    "g2_vs_base_alone": (">=", 0.7),
    "g2_vs_peft_loop": (">=", 5.0),
    "g3_vs_four_trl_runs": ("<=", 0.5),
    "g4_four_clients_vs_one": (">=", 0.95),
    # issue 36's base memory (bytes, the same on any device; the part states the step times beside them)
    "q_nf4_base_bytes_vs_16bit": ("<=", 0.30),
    "q_nf4_embeddings_base_bytes_vs_16bit": ("<=", 0.30),
}
TESTS = [
    "tests/lora/test_grouped.py",
    "tests/lora/test_equivalence.py::test_isolation_mixed_equals_alone",
    "tests/lora/test_equivalence.py::test_peft_equivalence",
    "tests/lora/test_equivalence.py::test_bf16_base_fp32_adapters_equal_peft",
    "tests/test_static_decode.py",
    "tests/rl/test_rl_loss.py",
    "tests/service/test_service_sdk.py::test_save_state_load_it_and_a_client_from_it_continue_exactly",
    "tests/service/test_service_sdk.py::test_snapshots_and_sampling_sessions_from_before_a_resume_sample_as_before",
]
# (hidden, layers, heads, kv heads, intermediate, vocab): Qwen2-0.5B's shape, and a tiny one for --dry
QWEN_05B = (896, 24, 14, 2, 4864, 151936)
TINY = (64, 2, 4, 2, 128, 512)


class MemoryWatch:
    """The device's peak used memory (``mem_get_info``) sampled every 0.2 s on a thread, and this process's
    peak allocation, over a block."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.peak_used = 0
        self._stop = threading.Event()

    def __enter__(self) -> MemoryWatch:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak_used = max(self.peak_used, total - free)
            self._stop.wait(0.2)

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._stop.set()
            self._thread.join()

    def record(self) -> dict:
        if not self.cuda:
            return {"peak_gpu_bytes_allocated": None, "peak_gpu_bytes_used": None}
        return {
            "peak_gpu_bytes_allocated": torch.cuda.max_memory_allocated(),
            "peak_gpu_bytes_used": self.peak_used,
        }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


# -- env ---------------------------------------------------------------------------------------------------


def part_env(cfg: dict, work: Path) -> dict:
    import peft
    import transformers

    from mlora_lab.job.engine import base_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "dtype_auto": str(base_dtype("auto", device)).removeprefix("torch."),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
    }


# -- (a) --------------------------------------------------------------------------------------------------------


def part_equivalences(cfg: dict, work: Path) -> dict:
    tests = cfg["tests"]
    log = cfg["logs"] / "a_equivalences.log"
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(cfg["test_workers"]),
        "--basetemp", tempfile.mkdtemp(prefix="gc_"), "-o", "addopts=", *tests,
    ]  # fmt: skip
    t0 = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=cfg["tests_timeout"]
        )
    text = log.read_text()
    summary = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error)", line)]
    return {
        "command": " ".join(command[1:]),
        "returncode": done.returncode,
        "summary": summary[-1] if summary else None,
        "failed": [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))][:40],
        "seconds": round(time.perf_counter() - t0, 1),
    }


# -- the model for G1 and G2 -----------------------------------------------------------------------------------


def build_base(cfg: dict, work: Path) -> str:
    """A Qwen2 of ``cfg["shape"]`` with random weights and a small local tokenizer, saved at ``work/base``."""
    import transformers

    from mlora_lab.tiny import build_tokenizer

    out = work / "base"
    if (out / "config.json").exists():
        return str(out)
    hidden, layers, heads, kv, inter, vocab = cfg["shape"]
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=cfg["dtype"])
    model.save_pretrained(out)
    build_tokenizer(out)
    return str(out)


def text_rows(path: Path, n: int, words: int) -> str:
    import random

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(400)]
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")
    return str(path)


# -- (b) G1 ------------------------------------------------------------------------------------------------------


def peft_stepper(model, tok, device) -> Callable[[list], None]:
    """One rank-16 PEFT adapter on every linear layer of ``model``, and its training step on a list of rows:
    forward with the model's own loss, backward, AdamW (what G1 and the quantized part compare with)."""
    import peft

    from mlora_lab.data import collate

    pm = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)

    def step(rows: list) -> None:
        batch = collate([("t", rows)], tok.pad_token_id or 0).to(device)
        out = pm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def part_g1(cfg: dict, work: Path) -> dict:
    import transformers

    from mlora_lab.data import load_examples
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    base = build_base(cfg, work)
    rows, seq = cfg["rows"], cfg["seq"]
    data = text_rows(work / "g1.jsonl", 4 * rows, words=2 * seq)
    ranks = (8, 16, 32)
    result: dict = {"rows": rows, "seq": seq, "tenants": {}}
    for k in cfg["tenant_counts"]:
        spec = JobSpec(
            base_model=base,
            tenants=[
                Tenant(name=f"t{i}", data=data, rank=ranks[i % 3], alpha=2 * ranks[i % 3],
                       target_modules=["all-linear"], batch_size=rows // k, max_steps=10**6, lr=1e-4, seed=i)
                for i in range(k)
            ],
            seq_len=seq, max_tenants=max(k, 1), max_rank=32, dtype=cfg["dtype_name"],
        )  # fmt: skip
        trainer = Trainer(spec)
        trainer.model.train()
        times = timed(trainer.step, cfg["steps"], warmup=2)
        tokens = rows * seq
        result["tenants"][k] = {
            "step_s": statistics.median(times),
            "tokens_per_s": tokens / statistics.median(times),
        }
        _free()
    tok = transformers.AutoTokenizer.from_pretrained(base)
    examples = load_examples(data, tok, seq)[:rows]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=cfg["dtype"]).to(device)
    peft_step = peft_stepper(model, tok, device)

    one = statistics.median(timed(lambda: peft_step(examples), cfg["steps"], warmup=2))
    sequential = statistics.median(
        timed(
            lambda: [peft_step(examples[i : i + 1]) for i in range(rows)], max(1, cfg["steps"] // 2), warmup=1
        )
    )
    tokens = rows * seq
    result["peft_one_adapter"] = {"step_s": one, "tokens_per_s": tokens / one}
    result["peft_16_sequential"] = {"step_s": sequential, "tokens_per_s": tokens / sequential}
    top = result["tenants"][max(cfg["tenant_counts"])]["tokens_per_s"]
    result["ratios"] = {
        "g1_vs_one_peft_adapter": top / result["peft_one_adapter"]["tokens_per_s"],
        "g1_vs_16_sequential_peft_steps": top / result["peft_16_sequential"]["tokens_per_s"],
    }
    _free()
    return result


# -- (c) G2 ------------------------------------------------------------------------------------------------------


def part_g2(cfg: dict, work: Path) -> dict:
    import peft
    import transformers

    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.sampling import SampleRequest, sample

    base = build_base(cfg, work)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, S, L = cfg["adapters"], cfg["samples"], cfg["new_tokens"]
    tok = transformers.AutoTokenizer.from_pretrained(base)
    prompts = [tok(f"prompt {i}: w1 w2 w3 w{i} w5 w6 w7 w8").input_ids for i in range(n)]

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=cfg["dtype"]).to(device)

    dirs = []
    for i in range(n):  # adapters whose B is not zero: each gives other tokens
        pm = peft.get_peft_model(load(), peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                         init_lora_weights=False))  # fmt: skip
        pm.save_pretrained(work / f"adapter{i}")
        dirs.append(str(work / f"adapter{i}"))
        del pm
    mm = MultiLoRAModel(load(), max_tenants=n, max_rank=16, slot_modules=["all-linear"])
    for i, d in enumerate(dirs):
        mm.load_adapter(f"t{i}", d)
    mm.eval()

    def requests(tenant):
        return [
            SampleRequest(prompts[i], tenant(i), num_samples=S, max_new_tokens=L, temperature=1.0,
                          stop_token_ids=(), seed=i)
            for i in range(n)
        ]  # fmt: skip

    tokens = n * S * L
    mixed = statistics.median(timed(lambda: sample(mm, requests(lambda i: f"t{i}")), cfg["repeats"]))
    alone = statistics.median(timed(lambda: sample(mm, requests(lambda i: None)), cfg["repeats"]))
    k = min(n, cfg["peft_adapters"])
    peft_models = [peft.PeftModel.from_pretrained(load(), d).eval() for d in dirs[:k]]

    def peft_loop() -> None:
        for model, prompt in zip(peft_models, prompts):
            ids = torch.tensor([prompt], device=device)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                               max_new_tokens=L, min_new_tokens=L, num_return_sequences=S,
                               pad_token_id=tok.pad_token_id)  # fmt: skip

    loop = statistics.median(timed(peft_loop, 1, warmup=1)) * n / k  # (the rate of k adapters, for n)
    result = {
        "adapters": n, "samples": S, "new_tokens": L, "peft_adapters_measured": k,
        "static_path": device == "cuda",
        "captured": any(d.graph is not None for d in getattr(mm, "_decoders", {}).values()),
        "mixed_tokens_per_s": tokens / mixed, "base_alone_tokens_per_s": tokens / alone,
        "peft_loop_tokens_per_s": tokens / loop,
    }  # fmt: skip
    result["ratios"] = {"g2_vs_base_alone": alone / mixed, "g2_vs_peft_loop": loop / mixed}
    # greedy, static (graphs on CUDA) against the dynamic loop: the same tokens
    greedy = [
        SampleRequest(prompts[i], f"t{i}", max_new_tokens=32, temperature=0.0) for i in range(min(n, 4))
    ]
    static = sample(mm, greedy, static=True)
    dynamic = sample(mm, greedy, static=False)
    result["static_equals_dynamic_greedy"] = [c.tokens for c in static] == [c.tokens for c in dynamic]
    _free()
    return result


# -- (d), (e): the existing benchmarks -------------------------------------------------------------------------


def run_benchmark(script: str, args: list[str], cfg: dict, work: Path, name: str) -> dict:
    log = cfg["logs"] / f"{name}.log"
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args, *(["--quick"] if cfg["dry"] else [])]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=cfg["bench_timeout"]
        )
    text = log.read_text()
    return {
        "command": " ".join(command[1:]),
        "returncode": done.returncode,
        "goal_lines": [line.strip() for line in text.splitlines() if "goal" in line.lower()][-12:],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def part_g3(cfg: dict, work: Path) -> dict:
    result = run_benchmark("rl.py", ["--part", "grpo", "--max-wait", "0"], cfg, work, "g3_grpo")
    ratio = _ratio(result["goal_lines"], "tenants in one job")
    result["ratios"] = {"g3_vs_four_trl_runs": ratio}
    return result


def part_g4(cfg: dict, work: Path) -> dict:
    result = run_benchmark("service.py", ["--part", "clients", "--max-wait", "0"], cfg, work, "g4_clients")
    result["ratios"] = {"g4_four_clients_vs_one": _ratio(result["goal_lines"], "clients / 1")}
    return result


def part_g5_async(cfg: dict, work: Path) -> dict:
    """Issue 52: ``benchmarks/rl.py --part async`` on the device: 4 GRPO tenants, the synchronous job on two
    ranks against one trainer GPU and one rollout GPU (``rollout_ranks=1``) at ``max_staleness`` 1 and 2. Needs
    two GPUs (NCCL does not put two ranks on one device; sampling on a second CUDA stream of one GPU is not
    built): on one it is recorded as not run, with why."""
    if not cfg["dry"] and torch.cuda.device_count() < 2:
        return {
            "skipped": f"needs 2 GPUs (a trainer and a rollout rank); this device has {torch.cuda.device_count()}"
        }
    result = run_benchmark("rl.py", ["--part", "async", "--max-wait", "0"], cfg, work, "g5_async")
    result["ratios"] = {
        "g5_async_vs_sync_cheap_reward": _ratio(result["goal_lines"], "cheap reward"),
        "g5_async_vs_sync_sleeping_reward": _ratio(result["goal_lines"], "sleeping"),
        "g5_staleness2_vs_sync_sleeping_reward": _ratio(result["goal_lines"], "max_staleness=2"),
    }
    return result


# -- issue 36: a quantized base -----------------------------------------------------------------------------------


def part_quantized(cfg: dict, work: Path) -> dict:
    """Issue 36 on the device: the base in bf16 (the CPU's dry run: float32), nf4 (QLoRA: the decoder's linear
    layers) and nf4 with ``quantize_embeddings``: its bytes (with bitsandbytes' scales), the peak memory of
    a step, and the step time of 4 tenants (ranks 8/16/32/8, all linear layers) sharing the G1 rows, against
    one PEFT adapter (rank 16) on the same rows over the same base."""
    import transformers
    from quantize import base_bytes

    from mlora_lab import quant
    from mlora_lab.data import load_examples
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    if not quant.available():
        raise RuntimeError("bitsandbytes is not installed (scripts/gpu_wheels.py gathers it)")
    base = build_base(cfg, work)
    rows, seq = cfg["rows"], cfg["seq"]
    data = text_rows(work / "q.jsonl", 4 * rows, words=2 * seq)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg["dtype"]
    tok = transformers.AutoTokenizer.from_pretrained(base)
    examples = load_examples(data, tok, seq)[:rows]
    result: dict = {"rows": rows, "seq": seq, "bases": {}}
    for name, mode in (("base", None), ("nf4", "nf4"), ("nf4+embeddings", "nf4")):
        embeddings = name.endswith("embeddings")
        spec = JobSpec(
            base_model=base,
            tenants=[
                Tenant(name=f"t{i}", data=data, rank=(8, 16, 32, 8)[i], alpha=16, target_modules=["all-linear"],
                       batch_size=rows // 4, max_steps=10**6, lr=1e-4, seed=i)
                for i in range(4)
            ],
            seq_len=seq, max_tenants=4, max_rank=32, dtype=str(dtype).removeprefix("torch."), quantize=mode,
            quantize_embeddings=embeddings,
        )  # fmt: skip
        _free()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(spec)
        trainer.model.train()
        ours = statistics.median(timed(trainer.step, cfg["steps"], warmup=2))
        entry = {
            "base_bytes": base_bytes(trainer.model.model),
            "step_s": ours,
            "tokens_per_s": rows * seq / ours,
        }
        if torch.cuda.is_available():
            entry["peak_gpu_bytes_allocated"] = torch.cuda.max_memory_allocated()
        del trainer
        _free()
        kw = quant.load_kwargs(mode, dtype, device)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype, **kw)
        if mode is None:
            model.to(device)
        peft_step = peft_stepper(quant.prepare(model, mode, dtype, embeddings), tok, device)
        times = timed(lambda step=peft_step: step(examples), cfg["steps"], warmup=2)
        entry["peft_step_s"] = statistics.median(times)
        entry["vs_peft"] = entry["peft_step_s"] / ours  # (tokens/s ÷ PEFT's)
        result["bases"][name] = entry
        del peft_step, model
        _free()
    bases = result["bases"]
    result["ratios"] = {
        "q_nf4_base_bytes_vs_16bit": bases["nf4"]["base_bytes"] / bases["base"]["base_bytes"],
        "q_nf4_embeddings_base_bytes_vs_16bit": bases["nf4+embeddings"]["base_bytes"]
        / bases["base"]["base_bytes"],
    }
    result["step_vs_16bit"] = {k: v["step_s"] / bases["base"]["step_s"] for k, v in bases.items()}
    return result


def _ratio(lines: list[str], near: str) -> float | None:
    """The first number after ``=`` or ``:`` on the goal line that mentions ``near``."""
    for line in lines:
        if near in line:
            found = re.search(r"[=:]\s*([0-9]+\.[0-9]+)", line)
            if found:
                return float(found.group(1))
    return None


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- main ----------------------------------------------------------------------------------------------------------

PARTS = {
    "env": part_env,
    "a_equivalences": part_equivalences,
    "g1_training": part_g1,
    "g2_sampling": part_g2,
    "g3_grpo": part_g3,
    "g4_clients": part_g4,
    "g5_async": part_g5_async,
    "q_quantized": part_quantized,
}


def config(dry: bool) -> dict:
    if dry:
        return dict(
            dry=True, shape=TINY, dtype=torch.float32, dtype_name="float32", rows=16, seq=64, steps=2,
            tenant_counts=(1, 4, 16), adapters=4, samples=2, new_tokens=8, repeats=1, peft_adapters=2,
            tests=["tests/lora/test_grouped.py::test_grouped_equals_the_per_segment_reference",
                   "tests/test_static_decode.py::test_uniforms_are_uniform_and_depend_on_seed_and_step_alone"],
            test_workers=1, tests_timeout=300, bench_timeout=300,
        )  # fmt: skip
    return dict(
        dry=False, shape=QWEN_05B, dtype=torch.bfloat16, dtype_name="auto", rows=16, seq=512, steps=5,
        tenant_counts=(1, 4, 16), adapters=16, samples=8, new_tokens=256, repeats=2, peft_adapters=2,
        tests=TESTS, test_workers=4, tests_timeout=150, bench_timeout=100,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry", action="store_true", help="tiny sizes on whatever device (the CPU here)")
    parser.add_argument("--out", default="gpu-check.json", help="where the JSON goes")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    args = parser.parse_args()
    if not args.dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry to check the script on the CPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the stated policy: fp32 matmuls are fp32 (see README)
    torch.backends.cudnn.allow_tf32 = False
    cfg = config(args.dry)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg["logs"] = out.parent  # (the pytest and benchmark logs, beside the JSON)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry": args.dry, "parts": {}, "goals": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        for name in args.parts.split(","):
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            with MemoryWatch() as memory:
                try:
                    entry = {"ok": True, **PARTS[name](cfg, work)}
                except Exception as e:
                    entry = {
                        "ok": False,
                        "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-4000:],
                    }
            entry.update(memory.record(), seconds_total=round(time.perf_counter() - t0, 1))
            report["parts"][name] = entry
            for key, value in entry.get("ratios", {}).items():
                sense, goal = GOALS[key]
                # (a dry run's figures come from tiny models on the CPU: they show the part runs, nothing more)
                met = (
                    None if value is None or args.dry else (value >= goal if sense == ">=" else value <= goal)
                )
                report["goals"][key] = {"value": value, "goal": f"{sense} {goal}", "met": met}
            print(
                json.dumps({name: {k: v for k, v in entry.items() if k != "traceback"}}, default=str)[:2000],
                flush=True,
            )
            _write(out, report)
    print(f"wrote {out}")


def _write(path: Path, report: dict) -> None:
    """The report so far (a part that hangs past the script's limit leaves the earlier ones written)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
