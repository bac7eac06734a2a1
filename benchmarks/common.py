"""Helpers shared by the benchmark scripts (plain scripts: each does ``sys.path.insert(0, <this dir>)``).

Everything is local: models and tokenizers are built with :func:`mlora_lab.tiny.build_tiny_model` from a
synthetic corpus (so the BPE vocabulary really reaches ``vocab_size``), data is synthetic text, and
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Quiet, offline, deterministic; set before transformers is imported (children inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import psutil
import torch
import transformers

THREADS = 1
"""Intra-op threads for every benchmark process (``--threads`` changes it).

One, not the machine's 2 cores: the lab machine is shared, and OpenMP with 2 threads on 2 cores slows
down 5-20x whenever any other process is runnable (a descheduled thread stalls every parallel region),
which made 2-thread timings irreproducible. With one thread the CPU time of a call is also a faithful
measure of its work, so every table reports CPU seconds beside wall seconds."""

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RESULT_MARK = "@@RESULT@@ "


def setup(threads: int = THREADS) -> None:
    """Same threading and logging in every benchmark process (parent and children)."""
    torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*truncated to seq_len.*")


@dataclass(frozen=True)
class ModelSize:
    """A llama-shaped tiny model (see :func:`mlora_lab.tiny.build_tiny_model`)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab_size: int

    def describe(self, n_params: int) -> str:
        return (
            f"llama hidden={self.hidden} layers={self.layers} heads={self.heads}/{self.kv_heads}kv "
            f"intermediate={2 * self.hidden} vocab={self.vocab_size}: {n_params / 1e6:.1f}M parameters"
        )


def synthetic_corpus(n_words: int = 20000, seed: int = 0) -> list[str]:
    """Pseudo-words built from syllables: enough distinct strings for a BPE vocabulary of 8k."""
    from mlora_lab.tiny import default_corpus

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n_words)]
    return default_corpus() + [" ".join(words[i : i + 16]) for i in range(0, n_words, 16)]


def build_model(out_dir: str | Path, size: ModelSize) -> str:
    """Build and save the model + tokenizer; returns the directory."""
    from mlora_lab.tiny import build_tiny_model

    return build_tiny_model(
        "llama",
        out_dir,
        hidden=size.hidden,
        layers=size.layers,
        heads=size.heads,
        kv_heads=size.kv_heads,
        vocab_size=size.vocab_size,
        corpus=synthetic_corpus(),
    )


def n_params(model_dir: str) -> int:
    """Parameters of the saved model (built on the meta device: allocates nothing)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def write_text_rows(path: str | Path, n_rows: int, seed: int, words_per_row: int = 200) -> str:
    """A tenant JSONL file of ``{"text": ...}`` rows long enough to be truncated to any ``seq_len``
    used here, so every row has exactly ``seq_len`` tokens and every batch has the same shape."""
    rng = random.Random(seed)
    vocab = " ".join(synthetic_corpus()[-200:]).split()
    with open(path, "w") as f:
        for _ in range(n_rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words_per_row))}) + "\n")
    return str(path)


# -- timing ------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One timed call: wall-clock seconds, CPU seconds of this process (all its threads), and the
    CPU seconds every *other* process on the machine used meanwhile (``others / wall`` = how many
    cores they kept busy: with 1 benchmark thread on 2 cores, above ~1 they compete with us)."""

    wall: float
    cpu: float
    others: float

    @property
    def contention(self) -> float:
        return self.others / self.wall if self.wall > 0 else 0.0


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds() -> float:
    """CPU seconds all processes have used since boot (``/proc/stat``: user, nice, system, irq,
    softirq, steal); 0 where there is no ``/proc``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields)) / _CLK_TCK


def time_once(fn: Callable[[], object]) -> Timing:
    b0, c0, t0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Timing(wall, cpu, max(machine_busy_seconds() - b0 - cpu, 0.0))


def others_load(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over the next ``seconds``."""
    return time_once(lambda: time.sleep(seconds)).contention


def wait_for_quiet(max_wait: float, threshold: float = 0.5) -> float:
    """Wait (at most ``max_wait`` s) until other processes keep fewer than ``threshold`` cores busy;
    returns the last reading. Timings taken while others compute for the same cores are noise."""
    deadline = time.monotonic() + max_wait
    load = others_load()
    while load >= threshold and time.monotonic() < deadline:
        load = others_load(2.0)
    if load >= threshold:
        print(f"warning: other processes keep {load:.1f} cores busy; timings will be noisy", flush=True)
    return load


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    repeats: int,
    prepare: dict[str, Callable[[], object]] | None = None,
) -> dict[str, list[Timing]]:
    """Run each function ``warmup`` times untimed, then ``repeats`` rounds of one timed call each,
    in turn (A, B, C, A, B, C, ...), so that drift of the machine hits every contender alike.
    ``prepare[name]`` (untimed) runs before every call of ``fns[name]``."""
    prepare = prepare or {}

    def call(name: str) -> Timing:
        if name in prepare:
            prepare[name]()
        return time_once(fns[name])

    for _ in range(warmup):
        for name in fns:
            call(name)
    times: dict[str, list[Timing]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name in fns:
            times[name].append(call(name))
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """``min–max`` of a sample, for the tables."""
    return f"{min(xs):.3f}–{max(xs):.3f}"


# -- memory --------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory() -> None:
    """Hand glibc's free heap pages back to the OS (``malloc_trim``), so RSS tracks live memory."""
    with contextlib.suppress(OSError):  # not glibc: RSS then also counts the allocator's free lists
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- child processes ----------------------------------------------------------------------------------


@dataclass
class ChildResult:
    result: dict
    process_wall_s: float  # interpreter start to exit, as seen by the parent


def run_child(script: str, payload: dict, timeout: float = 600) -> ChildResult:
    """Run ``python script --worker JSON`` and return the JSON object it prints after ``RESULT_MARK``.

    Each child is its own process, so its ``ru_maxrss`` is its own peak memory."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, script, "--worker", json.dumps(payload)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"worker {payload} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return ChildResult(json.loads(line[len(RESULT_MARK) :]), wall)
    raise RuntimeError(f"worker {payload} printed no result:\n{proc.stdout}\n{proc.stderr}")


def report_to_parent(result: dict) -> None:
    print(RESULT_MARK + json.dumps(result), flush=True)


# -- output ---------------------------------------------------------------------------------------------


def machine_line() -> str:
    return (
        f"machine: {platform.machine()} {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, torch threads {torch.get_num_threads()}, "
        f"python {platform.python_version()}"
    )


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain-text table (also valid Markdown), columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print(line(r))


def verdict(value: float, goal: float) -> str:
    return f"{value:.3f} (goal <= {goal:.2f}: {'MET' if value <= goal else 'MISSED'})"


def as_dict(obj) -> dict:
    return asdict(obj)


# -- one job per parallel layout, under torchrun ---------------------------------------------------------


def layout_worker(spec_path: str, out: str, steps: int) -> None:
    """Run under torchrun by :func:`run_layout`: build the job's :class:`~mlora_lab.job.trainer.Trainer`, run
    ``steps`` global steps, and write (rank 0) one row per rank of the bytes of the parameters this
    rank holds (``to_local()``: exact, not an RSS estimate), by kind, its peak RSS and its median step
    time (the first two steps excluded)."""
    from mlora_lab.job.recorder import memory_bytes
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.parallel import init_distributed, shutdown_distributed
    from mlora_lab.spec.job import JobSpec

    setup()
    dist = init_distributed()
    trainer = Trainer(JobSpec.load(spec_path), run_dir=None, dist=dist)
    model, io = trainer.model, trainer.model.io
    experts = {id(p) for m in model.experts.values() for p in m.parameters()}

    def local_bytes(select) -> int:
        return sum(io.local(p.data).nbytes for p in model.parameters() if select(id(p)))

    sizes = {
        "base_bytes": local_bytes(lambda i: i not in experts),
        "expert_bytes": local_bytes(lambda i: i in experts),
        # tenants' own tensors (not module parameters): this rank's parts
        "slot_bytes": sum(io.local(p.data).nbytes for _, p in model.named_tenant_tensors()),
    }
    model.train()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        trainer.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    _, peak = memory_bytes(trainer.engine.device)
    rows = trainer.comm.gather_objects(
        {"rank": dist.rank, **sizes, "peak_rss": peak, "step_time": statistics.median(times)}
    )
    if dist.is_main:
        Path(out).write_text(json.dumps(rows))
    shutdown_distributed()


def run_layout(script: str, spec_path: Path, parallel: dict, steps: int, workdir: Path) -> list[dict]:
    """Run the job ``spec_path`` with ``parallel`` (``nproc``, ``fsdp``, ``tp``, ``ep``) under torchrun:
    ``script --worker JOB --out OUT --steps N`` must call :func:`layout_worker`. Returns its rows."""
    spec = json.loads(spec_path.read_text())
    spec["parallel"] = parallel
    tag = "_".join(f"{k}{v}" for k, v in sorted(parallel.items()))
    path, out = workdir / f"job_{tag}.json", workdir / f"result_{tag}.json"
    path.write_text(json.dumps(spec))
    nproc = parallel["nproc"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        script,
        "--worker",
        str(path),
        "--out",
        str(out),
        "--steps",
        str(steps),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"layout {parallel} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def bench_parser(doc: str, quick_help: str, max_wait: float = 120) -> argparse.ArgumentParser:
    """The options every single-process benchmark script takes: ``--quick``, ``--threads``,
    ``--max-wait`` and the hidden ``--worker PAYLOAD`` its own child processes are started with."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--max-wait", type=float, default=max_wait, help="s to wait for a quiet machine")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def add_worker_args(parser) -> None:
    """``--worker JOB --out OUT --steps N``: how :func:`run_layout` calls a script back under torchrun."""
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help="global steps per layout (2 of them warm-up)")


def llama_layout_job(work: Path, quick: bool) -> tuple[Path, int, dict]:
    """The 4-tenant job ``fsdp.py`` and ``tp.py`` run per layout: a Llama-style model (20.3M
    parameters, or a tiny one with ``quick``), tenants of ranks 8-64 on all seven projections, batch 4
    each, seq <= 64. Returns the job.json path, the parameter count and the model size."""
    from mlora_lab.lab.demo import task_rows, write_jsonl
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant
    from mlora_lab.tiny import build_tiny_model

    size = (
        dict(hidden=64, layers=2, heads=4, kv_heads=2, vocab_size=512)
        if quick
        else dict(hidden=512, layers=8, heads=8, kv_heads=4, vocab_size=4096)
    )
    base = build_tiny_model("llama", work / "model", **size)
    tenants = [
        Tenant(name=f"t{i}", data=write_jsonl(work / f"t{i}.jsonl", task_rows(task, 64, seed=i)), rank=r,
               target_modules=LLAMA_TARGETS, batch_size=4, max_steps=1000)
        for i, (task, r) in enumerate([("reverse", 8), ("upper", 16), ("count", 32), ("reverse", 64)])
    ]  # fmt: skip
    spec_path = work / "job.json"
    JobSpec(base_model=base, tenants=tenants, seq_len=64, max_tenants=4, max_rank=64).to_json(spec_path)
    return spec_path, n_params(base), size
