"""RL (issues 23 and 52): batched multi-tenant rollouts vs PEFT ``generate``, GRPO steps vs TRL's
``GRPOTrainer``, and sampling on a rollout rank ahead of training (``--part async``) vs the synchronous job.

    .venv/bin/python benchmarks/rl.py              # parts 1 and 2 (~9 min on 2 cores; --part rollouts|grpo: one)
    .venv/bin/python benchmarks/rl.py --part async # part 3 alone (~10 min; not in ``all``, which stays parts 1-2)
    .venv/bin/python benchmarks/rl.py --quick      # smoke test (~1 min: 4 processes start; numbers mean nothing)
    .venv/bin/python benchmarks/rl.py --quick --part async   # part 3's smoke test (~2 min)

**1. Rollouts** (in this process, the two sides interleaved, 1 warm-up round, median of the repeats):
``tenants`` PEFT adapters of rank r on all 7 projections (B drawn at random, so every adapter gives other
tokens), one prompt each, ``samples`` completions of ``new_tokens`` tokens per tenant, temperature 1, no
top-k / top-p, KV cache on both sides:

- mlora: ONE :func:`mlora_lab.sampling.sample` call over a ``MultiLoRAModel`` holding the 4 adapters (each
  row routed to its own adapter), ``stop_token_ids=()`` so that no row stops before ``new_tokens``;
- PEFT: the 4 ``PeftModel`` s one after another, each ``generate(do_sample=True, temperature=1, top_k=0,
  top_p=1, num_return_sequences=samples, max_new_tokens=min_new_tokens=new_tokens)``;
- also shown: mlora with one ``sample()`` call per tenant, one after another (the batching alone).

Every completion is checked to have exactly ``new_tokens`` tokens on both sides. Goal: tokens/s ratio >= 1.5.

**2. GRPO steps.** One RL tenant in an in-process mlora_lab job (``Trainer(JobSpec(...), run_dir=None)
.train()``, what a launched job runs on each process, without torchrun's start-up) vs TRL 1.16's
``GRPOTrainer`` with ``peft_config=LoraConfig(...)`` on the same model with the same settings: ``prompts``
prompts x ``group`` completions per optimiser step (TRL: ``per_device_train_batch_size = prompts x group``,
``num_generations = group``, one gradient-accumulation step), ``max_new_tokens`` (TRL:
``max_completion_length``), temperature 1, loss ``dapo``, beta 0, one iteration, epsilon 0.2, group
scaling, lr 1e-4 constant, AdamW (weight decay 0), clip 1.0, rank r / alpha 2r on all 7 projections, fp32,
no gradient checkpointing (TRL's default is on, mlora_lab's off: off on both), the same prompts and the same
reward function from one file, written with TRL's calling convention (a length reward: long completions
win, so few stop at EOS; each side's mean completion length is printed). Each run is its own process
(``--worker``), so its peak memory is its own: the peak RSS of the process *and its children* (mlora_lab's
reward workers are child processes), sampled with psutil every 20 ms, a child from 0.2 s after it starts (before
its exec it shows its parent's pages); imports are done before the clock starts.

- step time: the median time between the ends of consecutive optimiser steps, the first step excluded
  (it pays the reward worker's start and first-call costs); TRL's from a ``TrainerCallback`` (``on_step_end``;
  generation, rewards, forward, backward, optimiser step and logging all fall between two of them).
  The 1-tenant job runs ``one_tenant_runs`` times (3), interleaved with the TRL runs (one per tenant), and
  each side's step is the median over all its runs' steps: one run's steps vary by ~±20 %.
  Goal: mlora / TRL <= 1.0.
- 4 tenants: one mlora job with 4 RL tenants (all 4 generate in one ``sample()`` call and train in one
  forward + backward per step) vs 4 TRL runs one after another (4 processes). Time = set-up (tokenizer,
  model load + wrap, prompts) + all steps, imports excluded. Goal: mlora / sum of the 4 TRL runs <= 0.7.
- memory: peak RSS of the 4-tenant job vs one TRL run (the largest of the 4). Goal <= 1.3. Also the same job
  with ``grad_accum = prompts`` (``batch_size`` 1: each step's generation trained in one micro-batch per
  prompt, the same update), and the same job with ``max_pass_tokens = 1024`` (each step's forward + backward
  in passes of whole tenants, one tenant's 16 rows a pass here: the same update, the generation still one
  ``sample()`` call for all four): the knobs a user turns for memory, and their step times.

**3. Async RL** (``--part async``, issue 52; not in ``all``: its jobs run under torchrun, ~6-10 min more). Four
RL tenants (each its own prompts and seed; ``prompts`` prompts x ``group`` completions x <= ``new_tokens``
tokens per step, temperature 1, loss dapo, beta 0, one iteration, rank r on all 7 projections) in ONE job of
2 processes, started with ``ml.launch`` (torchrun, as a user starts it) and ``run.wait()``, one job at a time:

- sync: ``ml.Parallel(nproc=2)`` (``--sync-fsdp 1``, the default: the base replicated, the tenants' rows split
  over the 2 ranks), ``max_staleness=0``: today's job; every rank samples every generation (the same tokens,
  the same seeds), then each trains its half. The other layout, ``fsdp=2`` (the base sharded, so every decode
  step all-gathers it), is run once beside it ("sync_other"): it was the slower baseline (~2x), so the ratios
  are taken against ``fsdp=1``, the stricter one;
- async: ``ml.Parallel(nproc=2, rollout_ranks=1)``, ``max_staleness=1``: rank 1 samples every tenant's step
  ``k + 1`` (with the adapter of step ``k``) while rank 0 trains step ``k``.

Each pair runs with a cheap reward (the share of a's among a completion's letters) and with the same reward
sleeping ``sleep`` s per call (a slow judge or tool); the slow reward also runs with ``max_staleness=2``
("async_s2": with 1, a generation sampled on the rollout rank has its rewards submitted only at the plan that
trains it, so the sleep is not hidden; its ratio is printed beside the goal's). RL steps per minute, from the run's train rows (one per tenant per optimiser step): the rows
after the first row's ``time`` over the seconds from it to the last row's, x 60 (start-up, imports, model load
and the first generation excluded). Each seed's sync and async jobs run back to back, and a ratio is the median
over seeds (``seeds`` for the cheap reward, ``slow_seeds`` for the slow one) of each pair's async / sync: goal
>= 1.4 (cheap reward), >= 2 (slow reward). Before each job, the cores other processes keep busy (1 s of
``/proc/stat``) are printed: a 2-rank sync job waits at every collective for its slower rank, so it suffers
from a busy machine more than the async one does.

Learning: each tenant's mean reward over its last ``last`` of ``steps`` steps with the cheap reward, the sync
job over ``seeds`` seeds (seed s: tenant i has seed ``100 s + i`` and prompts drawn with it) against the async
job on the same seeds: each async value should fall within the sync range [min, max] (where async changes
nothing, a value falls within the range of k sync runs with probability (k − 1)/(k + 1), which is printed too,
with the mean first-step and last-steps rewards: whether the tenants learned at all in ``steps`` steps). The
rollout rank's busy share and the trainer's idle share come from rank 0's system rows. ``--out FILE`` writes
the results as JSON.

Threads: ``--threads`` (default 1, as every benchmark here: see README) in every process
(``torch.set_num_threads`` and ``OMP_NUM_THREADS``, which the reward worker inherits).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import psutil
import torch

ROLLOUT_GOAL = 1.5  # tokens/s, mlora / PEFT: at least
STEP_GOAL = 1.0  # GRPO step time, mlora / TRL: at most
JOB_GOAL = 0.7  # 4 tenants in one job / 4 TRL runs in a row: at most
MEM_GOAL = 1.3  # peak RSS, 4-tenant job / one TRL run: at most
LR = 1e-4

FULL = dict(
    size=common.ModelSize(384, 6, 8, 4, 4096),
    rank=16,
    rollout=dict(tenants=4, samples=8, new_tokens=64, repeats=3),
    grpo=dict(tenants=4, prompts=2, group=8, new_tokens=32, steps=10, one_tenant_runs=3),
)
QUICK = dict(
    size=common.ModelSize(128, 2, 4, 2, 1024),
    rank=8,
    rollout=dict(tenants=4, samples=8, new_tokens=16, repeats=1),
    grpo=dict(tenants=2, prompts=2, group=4, new_tokens=8, steps=3, one_tenant_runs=1),
)
ASYNC_FULL = dict(
    size=common.ModelSize(256, 4, 4, 2, 2048),  # 3.4M parameters (agents.py's): a step is mostly sampling
    rank=8,
    tenants=4,
    prompts=2,
    group=4,
    new_tokens=24,
    steps=16,
    last=4,
    seeds=3,
    slow_seeds=3,
    sleep=0.3,
    lr=3e-2,
)
ASYNC_QUICK = dict(
    size=common.ModelSize(128, 2, 4, 2, 1024),
    rank=4,
    tenants=4,
    prompts=1,
    group=4,
    new_tokens=8,
    steps=4,
    last=2,
    seeds=1,
    slow_seeds=1,
    sleep=0.3,
    lr=3e-2,
)
ASYNC_GOAL = 1.4  # RL steps per minute, async / sync, cheap reward: at least
ASYNC_SLOW_GOAL = 2.0  # the same with a reward that sleeps 0.3 s per call: at least
PROMPT_ROOM = 32  # tokens a prompt may have (seq_len = this + max_new_tokens)
PASS_TOKENS = 1024  # max_pass_tokens of the 4-tenant job's variant in passes

REWARDS = '''
def length_reward(prompts, completions, **kwargs):
    """TRL's calling convention: one number per completion (long completions win)."""
    return [len(c) / 100.0 for c in completions]
'''

ASYNC_REWARDS = """
import time

SLEEP_S = {sleep}


def a_share(prompts, completions, **kwargs):
    \"\"\"The share of a's among a completion's letters (cheap; TRL's calling convention): the pseudo-words'
    syllables are consonant + vowel, so the share of all vowels hardly varies (~0.48), that of one does.\"\"\"
    out = []
    for c in completions:
        letters = [ch for ch in c.lower() if ch.isalpha()]
        out.append(letters.count("a") / len(letters) if letters else 0.0)
    return out


def slow_a_share(prompts, completions, **kwargs):
    \"\"\"``a_share`` after SLEEP_S seconds per call (a slow judge or tool).\"\"\"
    time.sleep(SLEEP_S)
    return a_share(prompts, completions)
"""


# -- data -------------------------------------------------------------------------------------------


def prompt_texts(n: int, seed: int) -> list[str]:
    """``n`` short prompts of pseudo-words (a few tokens each, well under ``PROMPT_ROOM``)."""
    rng = random.Random(seed)
    vocab = " ".join(common.synthetic_corpus()[-200:]).split()
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 6))) for _ in range(n)]


def write_prompts(path: Path, n: int, seed: int) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompt_texts(n, seed)))
    return str(path)


# -- peak memory of a process and its children -------------------------------------------------------


class PeakRSS:
    """Samples the RSS of this process plus all its children (psutil) every ``interval`` s in a thread
    (children from 0.2 s after they start)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._me = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        total = self._me.memory_info().rss
        now = time.time()
        for child in self._me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                # a child younger than 0.2 s is not counted: between its fork and its exec it reports its
                # parent's pages as its own (one 2-tenant run read 776 MiB, the main process 396 MiB, where
                # the reward workers, once started, hold ~25 MiB each)
                if now - child.create_time() >= 0.2:
                    total += child.memory_info().rss
        self.peak = max(self.peak, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakRSS:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def step_times(start: float, stamps: list[float]) -> list[float]:
    """Durations between consecutive time stamps (the first from ``start``)."""
    edges = [start, *stamps]
    return [b - a for a, b in itertools.pairwise(edges)]


# -- 2. GRPO workers (each in its own process) ----------------------------------------------------------


def worker_mlora(p: dict) -> dict:
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.rundir import RowKind
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.parts import RL
    from mlora_lab.spec.tenant import Tenant

    rss_imported = common.rss_bytes()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        rl = RL(
            reward=f"{p['reward']}:length_reward",
            group_size=p["group"],
            max_new_tokens=p["new_tokens"],
            temperature=1.0,
            loss_type="dapo",
            beta=0.0,
            num_iterations=1,
            epsilon=0.2,
            scale_rewards="group",
        )
        tenants = [
            Tenant(
                name=f"t{i}",
                data=path,
                rl=rl,
                rank=p["rank"],
                alpha=2 * p["rank"],
                target_modules=common.LLAMA_TARGETS,
                lr=LR,
                weight_decay=0.0,
                max_grad_norm=1.0,
                batch_size=p["prompts"] // p.get("grad_accum", 1),
                grad_accum=p.get("grad_accum", 1),
                max_steps=p["steps"],
                seed=i,
            )
            for i, path in enumerate(p["data"])
        ]
        spec = JobSpec(
            base_model=p["model"],
            tenants=tenants,
            seq_len=PROMPT_ROOM + p["new_tokens"],
            max_tenants=len(tenants),
            max_rank=p["rank"],
            max_pass_tokens=p.get("max_pass_tokens"),
        )
        trainer = Trainer(spec, run_dir=None)
        t_loaded, c_loaded = time.perf_counter(), time.process_time()
        stamps: list[float] = []
        cpu_stamps: list[float] = []
        step = trainer.step

        def timed_step() -> bool:
            before = sum(t.step for t in trainer.tenants.values())
            stepped = step()
            # an optimiser step (with grad_accum, most loop steps are micro-batches)
            if sum(t.step for t in trainer.tenants.values()) > before:
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())
            return stepped

        trainer.step = timed_step  # (train() calls self.step())
        trainer.train()
        t1 = time.perf_counter()
        trainer.close()
    assert all(t.step == p["steps"] for t in trainer.tenants.values()), {
        n: (t.step, t.state, t.reason) for n, t in trainer.tenants.items()
    }
    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN]
    return dict(
        job_s=t1 - t0,
        setup_s=t_loaded - t0,
        train_s=t1 - t_loaded,
        steps=step_times(t_loaded, stamps),
        cpu_steps=step_times(c_loaded, cpu_stamps),
        completion_len=statistics.mean(r["completion_len"] for r in rows),
        rss_imported=rss_imported,
        peak_tree=mem.peak,
        peak_self=common.peak_rss_bytes(),
    )


def import_trl():
    """TRL, imported with trackio taken as absent (as tests/rl/test_rl_loss.py does): trackio would fix its
    store folder on import; nothing here reports to it (``report_to="none"``)."""
    from unittest import mock

    with (
        mock.patch("transformers.integrations.is_trackio_available", return_value=False),
        mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
    ):
        import trl
        from trl import GRPOConfig, GRPOTrainer
    return trl, GRPOConfig, GRPOTrainer


def worker_trl(p: dict) -> dict:
    import importlib.util

    import datasets
    import peft
    import transformers

    _, GRPOConfig, GRPOTrainer = import_trl()
    spec = importlib.util.spec_from_file_location("bench_rewards", p["reward"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    datasets.disable_progress_bars()

    class Stamps(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu_stamps: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())

    rss_imported = common.rss_bytes()
    stamps = Stamps()
    with PeakRSS() as mem, tempfile.TemporaryDirectory(prefix="mlora_bench_trl_") as out:
        t0 = time.perf_counter()
        tok = transformers.AutoTokenizer.from_pretrained(p["model"])
        model = transformers.AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.float32)
        rows = [json.loads(line) for line in Path(p["data"]).read_text().splitlines()]
        dataset = datasets.Dataset.from_list(rows)
        config = GRPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            dataloader_pin_memory=False,
            per_device_train_batch_size=p["prompts"] * p["group"],
            gradient_accumulation_steps=1,
            num_generations=p["group"],
            max_completion_length=p["new_tokens"],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            loss_type="dapo",
            beta=0.0,
            num_iterations=1,
            epsilon=0.2,
            scale_rewards="group",
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch",
            max_steps=p["steps"],
            seed=p["seed"],
            log_completions=False,
        )
        lora = peft.LoraConfig(
            r=p["rank"], lora_alpha=2 * p["rank"], target_modules=common.LLAMA_TARGETS, lora_dropout=0.0
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=module.length_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            peft_config=lora,
            callbacks=[stamps],
        )
        t_loaded, c_loaded = time.perf_counter(), time.process_time()
        trainer.train()
        t1 = time.perf_counter()
    assert trainer.state.global_step == p["steps"] == len(stamps.stamps)
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return dict(
        job_s=t1 - t0,
        setup_s=t_loaded - t0,
        train_s=t1 - t_loaded,
        steps=step_times(t_loaded, stamps.stamps),
        cpu_steps=step_times(c_loaded, stamps.cpu_stamps),
        completion_len=statistics.mean(lengths),
        rss_imported=rss_imported,
        peak_tree=mem.peak,
        peak_self=common.peak_rss_bytes(),
    )


def worker(payload: str) -> None:
    p = json.loads(payload)
    common.setup(p["threads"])
    if p["kind"] == "trl":
        import_trl()  # (imports before the clock, as mlora_lab's below)
    else:
        import mlora_lab.job.trainer  # noqa: F401
    common.report_to_parent(worker_mlora(p) if p["kind"] == "mlora" else worker_trl(p))


# -- 1. rollouts (in this process) -------------------------------------------------------------------------


def make_adapters(model_dir: str, root: Path, n: int, rank: int) -> list[str]:
    """``n`` PEFT adapter directories, rank ``rank`` on all 7 projections, B ~ N(0, 0.02²) (non-zero: each
    adapter changes the model's tokens)."""
    import peft
    import transformers

    dirs = []
    for i in range(n):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=common.LLAMA_TARGETS, lora_dropout=0.0
        )
        model = peft.get_peft_model(base, config)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.02)
        model.save_pretrained(root / f"t{i}")
        dirs.append(str(root / f"t{i}"))
    return dirs


def rollouts(model_dir: str, tmp: Path, cfg: dict, rank: int, repeats: int, with_sequential: bool) -> dict:
    import peft
    import transformers

    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.sampling import SampleRequest, sample

    n, S, L = cfg["tenants"], cfg["samples"], cfg["new_tokens"]
    dirs = make_adapters(model_dir, tmp / "adapters", n, rank)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t).input_ids for t in prompt_texts(n, seed=7)]

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    mm = MultiLoRAModel(load(), max_tenants=n, max_rank=rank, slot_modules=common.LLAMA_TARGETS)
    for i, d in enumerate(dirs):
        mm.load_adapter(f"t{i}", d)
    mm.eval()
    requests = [
        SampleRequest(
            prompts[i], f"t{i}", num_samples=S, max_new_tokens=L, temperature=1.0, stop_token_ids=(), seed=i
        )
        for i in range(n)
    ]
    peft_models = [peft.PeftModel.from_pretrained(load(), d).eval() for d in dirs]

    def run_mlora() -> None:
        out = sample(mm, requests)
        assert len(out) == n * S and all(len(c.tokens) == L for c in out)

    def run_mlora_sequential() -> None:
        for r in requests:
            out = sample(mm, [r])
            assert all(len(c.tokens) == L for c in out)

    def run_peft() -> None:
        for model, prompt in zip(peft_models, prompts):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=L,
                    min_new_tokens=L,
                    num_return_sequences=S,
                    pad_token_id=tok.pad_token_id,
                )
            assert out.shape == (S, len(prompt) + L), out.shape

    fns = {"mlora": run_mlora, "peft": run_peft}
    if with_sequential:
        fns["mlora_seq"] = run_mlora_sequential
    times = common.time_interleaved(fns, warmup=1, repeats=repeats)
    # the adapters differ: the same prompt through each gives other logits
    with torch.no_grad():
        ids = torch.tensor([prompts[0]] * n)
        logits = mm(ids, tenants=[f"t{i}" for i in range(n)]).logits[:, -1]
    gap = min((logits[i] - logits[j]).abs().max().item() for i in range(n) for j in range(i))
    return dict(times=times, tokens=n * S * L, prompt_lens=[len(p) for p in prompts], gap=gap)


# -- 3. async RL: rollout ranks and sampling ahead vs the synchronous job (launched jobs) ----------------------


def async_layout(mode: str, sync_fsdp: int) -> tuple[dict, int]:
    """``mode``'s ``Parallel`` arguments and ``max_staleness``: "sync" (2 training ranks, ``fsdp=sync_fsdp``,
    every rank sampling between steps), "sync_other" (the same with the other fsdp: 1 = replicated, 2 = sharded),
    "async" (1 trainer + 1 rollout rank, staleness 1), "async_s2" (the same, staleness 2)."""
    return {
        "sync": (dict(nproc=2, fsdp=sync_fsdp), 0),
        "sync_other": (dict(nproc=2, fsdp=3 - sync_fsdp), 0),
        "async": (dict(nproc=2, rollout_ranks=1), 1),
        "async_s2": (dict(nproc=2, rollout_ranks=1), 2),
    }[mode]


def async_job(
    model_dir: str, tmp: Path, cfg: dict, mode: str, reward: str, seed: int, sync_fsdp: int
) -> dict:
    """One job of ``cfg['tenants']`` RL tenants on 2 processes, laid out as :func:`async_layout` says, launched
    with ``ml.launch`` and waited for; ``reward`` a function of the rewards file. Returns its steps per minute
    (train rows after the first row's time / seconds to the last row), each tenant's rewards by step, the
    staleness seen and rank 0's rollout-busy / trainer-idle shares. RuntimeError with ``run.error`` and every
    rank's log if the job did not finish."""
    import mlora_lab as ml

    c = cfg
    layout, staleness = async_layout(mode, sync_fsdp)
    parallel = ml.Parallel(**layout)
    rl = ml.RL(
        reward=f"{tmp / 'async_rewards.py'}:{reward}",
        group_size=c["group"],
        max_new_tokens=c["new_tokens"],
        temperature=1.0,
        loss_type="dapo",
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        scale_rewards="group",
        max_staleness=staleness,
    )
    tenants = [
        ml.Tenant(
            name=f"t{i}",
            data=write_prompts(
                tmp / f"async_s{seed}_t{i}.jsonl", c["prompts"] * c["steps"], seed=100 * seed + i
            ),
            rl=rl,
            rank=c["rank"],
            alpha=2 * c["rank"],
            target_modules=common.LLAMA_TARGETS,
            lr=c["lr"],
            weight_decay=0.0,
            max_grad_norm=1.0,
            batch_size=c["prompts"],
            max_steps=c["steps"],
            seed=100 * seed + i,
        )
        for i in range(c["tenants"])
    ]
    spec = ml.JobSpec(
        base_model=model_dir,
        tenants=tenants,
        seq_len=PROMPT_ROOM + c["new_tokens"],
        max_tenants=c["tenants"],
        max_rank=c["rank"],
        parallel=parallel,
    )
    b0, t0 = common.machine_busy_seconds(), time.perf_counter()
    run = ml.launch(spec, workdir=tmp / "runs")
    state = run.wait(timeout=900)
    wall = time.perf_counter() - t0
    busy = (common.machine_busy_seconds() - b0) / wall
    if state != "finished":
        logs = "\n".join(f"--- rank {r} ---\n{run.logs(r, tail=80)}" for r in range(parallel.world_size))
        raise RuntimeError(f"{mode} job ({reward}, seed {seed}) ended {state}: {run.error}\n{logs}")
    rows = [r.to_dict() for r in run.rows()]
    train = sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["time"])
    first, last = train[0]["time"], train[-1]["time"]
    after = sum(r["time"] > first for r in train)
    rewards: dict[str, list[float]] = {}
    for r in sorted(train, key=lambda r: (r["tenant"], r["tenant_step"])):
        rewards.setdefault(r["tenant"], []).append(r["reward"])
    stale = [r.get("staleness", (r.get("extra") or {}).get("staleness")) for r in train]
    system = [r for r in rows if r["kind"] == "system" and r.get("rank") == 0]
    shares = {
        k: statistics.mean(v) if (v := [r[k] for r in system if r.get(k) is not None]) else None
        for k in ("rollout_busy", "trainer_idle")
    }
    return dict(
        mode=mode,
        reward=reward,
        seed=seed,
        steps_per_min=60 * after / (last - first),
        train_rows=len(train),
        span_s=last - first,
        job_wall_s=wall,
        busy=busy,
        rewards=rewards,
        staleness=sorted({x for x in stale if x is not None}),
        **shares,
    )


def async_rl(args, cfg: dict, tmp: Path, model_dir: str) -> dict:
    """Part 3 (the module docstring): the jobs one after another, the table, the ratios; returns the results."""
    c = cfg["async_"]
    (tmp / "async_rewards.py").write_text(ASYNC_REWARDS.format(sleep=c["sleep"]))
    n, last = c["tenants"], c["last"]
    print(
        f"## 3. async RL: {n} RL tenants, {c['prompts']} prompts x {c['group']} completions x <= {c['new_tokens']} "
        f"new tokens per step, {c['steps']} steps each; lr {c['lr']}; ml.launch, one job at a time; the ratios are "
        f"async / sync\n",
        flush=True,
    )
    # pairs back to back (sync, then async, on the same seed), so the machine's drift hits both alike; the slow
    # reward also with staleness 2 (with 1, a generation sampled on the rollout rank has its rewards submitted only
    # at the plan that trains it); once, the other sync layout (which 2-rank sync is the faster baseline)
    order = []
    for seed in range(c["seeds"]):
        order += [("sync", "a_share", seed), ("async", "a_share", seed)]
        if seed < c["slow_seeds"]:
            order += [
                ("sync", "slow_a_share", seed),
                ("async", "slow_a_share", seed),
                ("async_s2", "slow_a_share", seed),
            ]
        if seed == 0:
            order += [("sync_other", "a_share", 0)]
    jobs: dict[tuple[str, str, int], dict] = {}
    for mode, reward, seed in order:
        print(f"  {mode} {reward} seed {seed} ...", end=" ", flush=True)
        others = common.others_load(1.0)  # (no job of ours runs now: all of it is other people's)
        res = jobs[(mode, reward, seed)] = async_job(model_dir, tmp, c, mode, reward, seed, args.sync_fsdp)
        res["others_before"] = others
        print(
            f"{res['steps_per_min']:.1f} steps/min ({res['job_wall_s']:.0f} s in all; others' cores before "
            f"{others:.2f}, all cores busy during {res['busy']:.2f})",
            flush=True,
        )

    def fmt(x: float | None, spec: str = ".2f") -> str:
        return "" if x is None else format(x, spec)

    rows = []
    for (mode, reward, seed), r in jobs.items():
        layout, staleness = async_layout(mode, args.sync_fsdp)
        rows.append(
            [
                f"{mode}: {', '.join(f'{k}={v}' for k, v in layout.items())}, max_staleness={staleness}",
                reward,
                seed,
                f"{r['steps_per_min']:.1f}",
                f"{r['train_rows']} / {r['span_s']:.1f}",
                f"{r['job_wall_s']:.1f}",
                " ".join(str(int(x)) for x in r["staleness"]),
                fmt(r["rollout_busy"]),
                fmt(r["trainer_idle"]),
                f"{r['others_before']:.2f}",
                f"{r['busy']:.2f}",
            ]
        )
    print()
    common.print_table(
        [
            "job",
            "reward",
            "seed",
            "RL steps/min",
            "train rows / span s",
            "job wall s",
            "staleness",
            "rollout busy",
            "trainer idle",
            "others' cores before",
            "all cores busy",
        ],
        rows,
    )

    def ratios(reward: str, seeds: int, mode: str = "async") -> list[float]:
        """``mode`` / sync steps per minute, each seed's pair (run back to back)."""
        return [
            jobs[(mode, reward, s)]["steps_per_min"] / jobs[("sync", reward, s)]["steps_per_min"]
            for s in range(seeds)
        ]

    fast_each, slow_each = ratios("a_share", c["seeds"]), ratios("slow_a_share", c["slow_seeds"])
    s2_each = ratios("slow_a_share", c["slow_seeds"], "async_s2")
    fast, slow, slow_s2 = common.median(fast_each), common.median(slow_each), common.median(s2_each)

    def tail_mean(r: dict, tenant: str) -> float:
        return statistics.mean(r["rewards"][tenant][-last:])

    print(
        f"\nlearning: each tenant's mean reward over its last {last} of {c['steps']} steps (cheap reward)\n"
    )
    learn, within = [], {}
    syncs = [jobs[("sync", "a_share", s)] for s in range(c["seeds"])]
    asyncs = [jobs[("async", "a_share", s)] for s in range(c["seeds"])]
    tenants = sorted(syncs[0]["rewards"])
    for t in tenants:
        lo, hi = min(tail_mean(r, t) for r in syncs), max(tail_mean(r, t) for r in syncs)
        firsts = statistics.mean(r["rewards"][t][0] for r in syncs)
        values = [tail_mean(r, t) for r in asyncs]
        within[t] = [lo <= v <= hi for v in values]
        learn.append(
            [
                t,
                f"{firsts:.3f}",
                f"[{lo:.3f}, {hi:.3f}]",
                " ".join(f"{v:.3f}" for v in values),
                f"{sum(within[t])} of {len(values)}",
            ]
        )
    common.print_table(
        [
            "tenant",
            "sync first-step reward (mean over seeds)",
            f"sync range over {len(syncs)} seed(s)",
            f"async, seed{'s' if len(asyncs) > 1 else ''} 0-{len(asyncs) - 1}",
            "async within",
        ],
        learn,
    )
    first = statistics.mean(r["rewards"][t][0] for r in syncs for t in tenants)
    end = {
        k: statistics.mean(tail_mean(r, t) for r in rs for t in tenants)
        for k, rs in (("sync", syncs), ("async", asyncs))
    }
    hits, tries = sum(sum(v) for v in within.values()), sum(len(v) for v in within.values())
    # (k runs of one distribution: a further one falls within their [min, max] with probability (k-1)/(k+1))
    chance = (len(syncs) - 1) / (len(syncs) + 1)
    print(
        f"\n(mean over tenants and seeds: first-step reward {first:.3f}; last {last} steps sync {end['sync']:.3f}, "
        f"async {end['async']:.3f}. A value from the sync runs' own distribution falls within the range of "
        f"{len(syncs)} of them with probability {chance:.2f})"
    )
    print(
        f"\nRATIO RL steps/min async / sync, cheap reward (median over {len(fast_each)} seed pair(s)): "
        f"{at_least(fast, ASYNC_GOAL)}  [each pair: {' '.join(f'{x:.2f}' for x in fast_each)}]"
    )
    print(
        f"RATIO RL steps/min async / sync, reward sleeping {c['sleep']} s per call (median over {len(slow_each)} "
        f"pair(s)): {at_least(slow, ASYNC_SLOW_GOAL)}  [each pair: {' '.join(f'{x:.2f}' for x in slow_each)}]"
    )
    print(
        f"RATIO RL steps/min async with max_staleness=2 / sync, the same slow reward (median over {len(s2_each)} "
        f"pair(s)): {at_least(slow_s2, ASYNC_SLOW_GOAL)}  [each pair: {' '.join(f'{x:.2f}' for x in s2_each)}]"
    )
    print(
        f"LEARNING async within the sync range over {len(syncs)} seed(s): {hits} of {tries} (tenant, seed) values "
        f"(chance alone: {chance:.2f} of them)\n",
        flush=True,
    )
    return dict(
        config={k: v for k, v in c.items() if k != "size"},
        size=common.as_dict(c["size"]),
        sync_fsdp=args.sync_fsdp,
        ratio_cheap=fast,
        ratio_cheap_each=fast_each,
        ratio_slow=slow,
        ratio_slow_each=slow_each,
        ratio_slow_s2=slow_s2,
        ratio_slow_s2_each=s2_each,
        within=within,
        reward_first=first,
        reward_last=end,
        jobs=[dict(r) for r in jobs.values()],
    )


# -- the benchmark ------------------------------------------------------------------------------------------


def at_least(value: float, goal: float) -> str:
    return f"{value:.3f} (goal >= {goal:.2f}: {'MET' if value >= goal else 'MISSED'})"


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, few tokens and steps (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="rollout repeats")
    parser.add_argument(
        "--part", choices=["all", "rollouts", "grpo", "async"], default="all", help="all: rollouts and grpo"
    )
    parser.add_argument(
        "--sync-fsdp",
        type=int,
        choices=[1, 2],
        default=1,
        help="async part: the sync job's fsdp (1: replicated)",
    )
    parser.add_argument("--out", help="async part: write its results here (JSON)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    cfg = dict(QUICK if args.quick else FULL, async_=ASYNC_QUICK if args.quick else ASYNC_FULL)
    common.setup(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # children (and their reward workers) inherit it
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    med = common.median

    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp_name:
        tmp = Path(tmp_name)
        if args.part == "async":
            size, rank = cfg["async_"]["size"], cfg["async_"]["rank"]
            print("\n# rl: async RL (issue 52), rollout ranks and sampling ahead vs the synchronous job\n")
        else:
            size, rank = cfg["size"], cfg["rank"]
            print(f"\n# rl: GRPO tenants (issue 23) vs PEFT generate and TRL {trl_version()} GRPOTrainer\n")
        model_dir = common.build_model(tmp / "model", size)
        print(common.machine_line())
        print(
            f"threads: torch.set_num_threads({args.threads}) and OMP_NUM_THREADS={args.threads} in every process"
        )
        print(
            f"model: {size.describe(common.n_params(model_dir))}; LoRA rank {rank}, alpha "
            f"{2 * rank}, all 7 projections; fp32"
        )
        print(f"other processes kept {load_before:.2f} cores busy before the run\n")

        if args.part == "async":
            result = async_rl(args, cfg, tmp, model_dir)
            result.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_before=load_before)
            result["machine"] = common.machine_line()
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
                print(f"results: {args.out}")
            return

        if args.part in ("all", "rollouts"):
            r = cfg["rollout"]
            repeats = args.repeats or r["repeats"]
            print(
                f"## 1. rollouts: {r['tenants']} tenants x {r['samples']} completions x {r['new_tokens']} "
                f"new tokens, temperature 1, KV cache; median of {repeats} interleaved repeat(s)\n",
                flush=True,
            )
            res = rollouts(model_dir, tmp, r, cfg["rank"], repeats, with_sequential=not args.quick)
            t = res["times"]
            rows = []
            labels = {
                "peft": f"PEFT: {r['tenants']} models, generate() one after another",
                "mlora": f"mlora: one sample() call, {r['tenants'] * r['samples']} rows",
                "mlora_seq": "mlora: one sample() call per tenant, in a row",
            }
            peft_tps = res["tokens"] / med([x.wall for x in t["peft"]])
            for name in ("peft", "mlora", "mlora_seq"):
                if name not in t:
                    continue
                wall, cpu = med([x.wall for x in t[name]]), med([x.cpu for x in t[name]])
                tps = res["tokens"] / wall
                others = med([x.contention for x in t[name]])
                rows.append(
                    [
                        labels[name],
                        f"{wall:.3f}",
                        common.spread([x.wall for x in t[name]]),
                        f"{cpu:.3f}",
                        f"{tps:.0f}",
                        f"{others:.2f}",
                        f"{tps / peft_tps:.3f}",
                    ]
                )
            common.print_table(
                ["", "wall s", "wall min–max", "CPU s", "tokens/s", "others' cores", "tokens/s ÷ PEFT"], rows
            )
            ratio = res["tokens"] / med([x.wall for x in t["mlora"]]) / peft_tps
            cpu_ratio = med([x.cpu for x in t["peft"]]) / med([x.cpu for x in t["mlora"]])
            print(
                f"(prompt lengths {res['prompt_lens']} tokens; every completion {r['new_tokens']} tokens on both "
                f"sides; the adapters' last-position logits on one prompt differ pairwise by >= {res['gap']:.3f})"
            )
            print(
                f"\nRATIO rollout tokens/s mlora / PEFT: {at_least(ratio, ROLLOUT_GOAL)}  "
                f"[mlora {res['tokens'] / med([x.wall for x in t['mlora']]):.0f} vs PEFT {peft_tps:.0f} tokens/s; "
                f"by CPU time {cpu_ratio:.3f}]\n",
                flush=True,
            )

        if args.part in ("all", "grpo"):
            grpo(args, cfg, tmp, model_dir)


def trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def grpo(args, cfg: dict, tmp: Path, model_dir: str) -> None:
    g = cfg["grpo"]
    n = g["tenants"]
    reward = tmp / "rewards.py"
    reward.write_text(REWARDS)
    data = [write_prompts(tmp / f"prompts{i}.jsonl", g["prompts"] * g["steps"], seed=i) for i in range(n)]
    shared = dict(
        model=model_dir,
        reward=str(reward),
        rank=cfg["rank"],
        threads=args.threads,
        **{k: g[k] for k in ("prompts", "group", "new_tokens", "steps")},
    )
    print(
        f"## 2. GRPO: {g['prompts']} prompts x {g['group']} completions x <= {g['new_tokens']} new tokens per "
        f"optimiser step, {g['steps']} steps; loss dapo, beta 0, 1 iteration; one process per run\n",
        flush=True,
    )
    runs: dict[str, common.ChildResult] = {}
    # interleaved, so drift of the machine hits both sides alike: the 1-tenant job runs several times (on
    # the prompts of TRL runs 0, 1, ...), as TRL does once per tenant, and each side's step is the median over
    # all its runs' steps (one run's median moved by +-0.2 of the ratio)
    ones = [f"mlora1_{i}" for i in range(g["one_tenant_runs"])]
    order = [(ones[0], dict(kind="mlora", data=data[:1])), ("trl0", dict(kind="trl", data=data[0], seed=0))]
    order += [(f"mlora{n}", dict(kind="mlora", data=data))]
    for i in range(1, n):
        if i < len(ones):
            order += [(ones[i], dict(kind="mlora", data=data[i : i + 1]))]
        order += [(f"trl{i}", dict(kind="trl", data=data[i], seed=i))]
    # the same job in micro-batches (the same prompts, completions and update; less memory)
    order += [(f"mlora{n}acc", dict(kind="mlora", data=data, grad_accum=g["prompts"]))]
    # the same job with each step's forward + backward in passes of at most PASS_TOKENS padded tokens (one
    # tenant's 16 rows a pass): the same update, one tenant's activations at a time
    order += [(f"mlora{n}pass", dict(kind="mlora", data=data, max_pass_tokens=PASS_TOKENS))]
    for name, extra in order:
        print(f"  {name} ...", flush=True)
        b0, t0 = common.machine_busy_seconds(), time.perf_counter()
        runs[name] = common.run_child(__file__, dict(shared, **extra))
        # cores kept busy by every process, this run's included (its CPU is not known out here)
        runs[name].result["busy"] = (common.machine_busy_seconds() - b0) / (time.perf_counter() - t0)
    med = common.median
    trls = [runs[f"trl{i}"].result for i in range(n)]
    m1s = [runs[k].result for k in ones]
    m1, mn, macc = m1s[0], runs[f"mlora{n}"].result, runs[f"mlora{n}acc"].result
    mpass = runs[f"mlora{n}pass"].result

    def steady(res: dict) -> float:
        return med(res["steps"][1:])

    trl_step = med([s for r in trls for s in r["steps"][1:]])
    trl_cpu_step = med([s for r in trls for s in r["cpu_steps"][1:]])

    def cpu_steady(res: dict) -> float:  # (the main process's CPU: mlora_lab's reward worker not counted)
        return med(res["cpu_steps"][1:])

    one_step = med([s for r in m1s for s in r["steps"][1:]])
    one_cpu_step = med([s for r in m1s for s in r["cpu_steps"][1:]])
    step_ratio = one_step / trl_step
    trl_job = sum(r["job_s"] for r in trls)
    trl_train = sum(r["train_s"] for r in trls)
    trl_setup = sum(r["setup_s"] for r in trls)
    trl_wall = sum(runs[f"trl{i}"].process_wall_s for i in range(n))
    trl_peak = max(r["peak_tree"] for r in trls)
    trl_len = statistics.mean(r["completion_len"] for r in trls)
    trl_imported = med([r["rss_imported"] for r in trls])
    mib = common.mib

    def fmt_steps(res: dict) -> str:
        return " ".join(f"{s:.2f}" for s in res["steps"])

    common.print_table(
        ["", "mlora", "TRL", "ratio"],
        [
            [
                f"1 tenant: step s (median, first excluded; {len(m1s)} / {n} runs)",
                f"{one_step:.3f}",
                f"{trl_step:.3f}",
                f"{step_ratio:.3f}",
            ],
            ["  steps s (mlora 1-tenant run 0; TRL run 0)", fmt_steps(m1), fmt_steps(trls[0]), ""],
            [
                "  each run's median step s",
                " ".join(f"{steady(r):.2f}" for r in m1s),
                " ".join(f"{steady(r):.2f}" for r in trls),
                "",
            ],
            [
                "  step CPU s (median, first excluded)",
                f"{one_cpu_step:.3f}",
                f"{trl_cpu_step:.3f}",
                f"{one_cpu_step / trl_cpu_step:.3f}",
            ],
            ["  mean completion length (tokens)", f"{m1['completion_len']:.1f}", f"{trl_len:.1f}", ""],
            [
                f"{n} tenants: 1 job vs {n} runs in a row, job s",
                f"{mn['job_s']:.2f}",
                f"{trl_job:.2f}",
                f"{mn['job_s'] / trl_job:.3f}",
            ],
            [
                "  set-up s (tokenizer, model, wrap, prompts)",
                f"{mn['setup_s']:.2f}",
                f"{trl_setup:.2f}",
                f"{mn['setup_s'] / trl_setup:.3f}",
            ],
            [
                "  training s (all steps)",
                f"{mn['train_s']:.2f}",
                f"{trl_train:.2f}",
                f"{mn['train_s'] / trl_train:.3f}",
            ],
            [
                f"  step s ({n}-tenant job; TRL: {n} x one run's)",
                f"{steady(mn):.3f}",
                f"{n * trl_step:.3f}",
                f"{steady(mn) / (n * trl_step):.3f}",
            ],
            [
                f"  step CPU s ({n}-tenant job; TRL: {n} x one run's)",
                f"{cpu_steady(mn):.3f}",
                f"{n * trl_cpu_step:.3f}",
                f"{cpu_steady(mn) / (n * trl_cpu_step):.3f}",
            ],
            [f"  steps s ({n}-tenant job)", fmt_steps(mn), "", ""],
            ["  mean completion length (tokens)", f"{mn['completion_len']:.1f}", f"{trl_len:.1f}", ""],
            [
                "  process wall s (incl. start-up, imports)",
                f"{runs[f'mlora{n}'].process_wall_s:.2f}",
                f"{trl_wall:.2f}",
                f"{runs[f'mlora{n}'].process_wall_s / trl_wall:.3f}",
            ],
            [
                f"peak RSS, process + children ({n}-tenant job; TRL: one run)",
                mib(mn["peak_tree"]),
                mib(trl_peak),
                f"{mn['peak_tree'] / trl_peak:.3f}",
            ],
            [
                f"  peak RSS, {n}-tenant job in {g['prompts']} micro-batches (grad_accum={g['prompts']})",
                mib(macc["peak_tree"]),
                mib(trl_peak),
                f"{macc['peak_tree'] / trl_peak:.3f}",
            ],
            [
                f"    its step s ({n}-tenant job; TRL: {n} x one run's)",
                f"{steady(macc):.3f}",
                f"{n * trl_step:.3f}",
                f"{steady(macc) / (n * trl_step):.3f}",
            ],
            [
                f"  peak RSS, {n}-tenant job in passes of <= {PASS_TOKENS} tokens (max_pass_tokens)",
                mib(mpass["peak_tree"]),
                mib(trl_peak),
                f"{mpass['peak_tree'] / trl_peak:.3f}",
            ],
            [
                f"    its step s ({n}-tenant job; TRL: {n} x one run's)",
                f"{steady(mpass):.3f}",
                f"{n * trl_step:.3f}",
                f"{steady(mpass) / (n * trl_step):.3f}",
            ],
            [
                "  peak RSS, 1-tenant job / one TRL run",
                mib(m1["peak_tree"]),
                mib(trl_peak),
                f"{m1['peak_tree'] / trl_peak:.3f}",
            ],
            ["  RSS after imports (main process)", mib(mn["rss_imported"]), mib(trl_imported), ""],
            [
                "  peak RSS above imports",
                mib(mn["peak_tree"] - mn["rss_imported"]),
                mib(trl_peak - trl_imported),
                f"{(mn['peak_tree'] - mn['rss_imported']) / (trl_peak - trl_imported):.3f}",
            ],
            [
                "  peak RSS of the main process only (ru_maxrss)",
                mib(mn["peak_self"]),
                mib(max(r["peak_self"] for r in trls)),
                f"{mn['peak_self'] / max(r['peak_self'] for r in trls):.3f}",
            ],
        ],
    )
    busy = {k: f"{v.result['busy']:.2f}" for k, v in runs.items()}
    print(f"\nall cores busy during each run (ours included; 1 = only the run itself on 1 thread): {busy}")
    print(
        f"\nRATIO GRPO step time, 1 tenant, mlora / TRL: {common.verdict(step_ratio, STEP_GOAL)}  "
        f"[mlora {one_step:.3f} s vs TRL {trl_step:.3f} s]"
    )
    print(
        f"RATIO {n} tenants in one job / {n} TRL runs in a row (set-up + steps): "
        f"{common.verdict(mn['job_s'] / trl_job, JOB_GOAL)}  [mlora {mn['job_s']:.2f} s vs TRL {trl_job:.2f} s; "
        f"training only {mn['train_s'] / trl_train:.3f}]"
    )
    print(
        f"RATIO peak RSS {n}-tenant job / one TRL run: {common.verdict(mn['peak_tree'] / trl_peak, MEM_GOAL)}  "
        f"[mlora {mib(mn['peak_tree'])} vs TRL {mib(trl_peak)}]"
    )
    print(
        f"RATIO peak RSS {n}-tenant job in {g['prompts']} micro-batches / one TRL run: "
        f"{common.verdict(macc['peak_tree'] / trl_peak, MEM_GOAL)}  [mlora {mib(macc['peak_tree'])}; its step "
        f"{steady(macc) / (n * trl_step):.3f} of {n} TRL runs' (one batch: {steady(mn) / (n * trl_step):.3f})]"
    )
    print(
        f"RATIO peak RSS {n}-tenant job in passes of <= {PASS_TOKENS} tokens / one TRL run: "
        f"{common.verdict(mpass['peak_tree'] / trl_peak, MEM_GOAL)}  [mlora {mib(mpass['peak_tree'])}; its step "
        f"{steady(mpass) / (n * trl_step):.3f} of {n} TRL runs']"
    )


if __name__ == "__main__":
    main()
