"""The RL driver: tenants that learn from rewards by GRPO (TRL 1.16's ``GRPOTrainer``), in the same loop
and the same base forward as the SFT tenants.

An RL tenant's optimiser window is one **generation**: ``B·k`` prompts of its data (``B = batch_size``,
``k = grad_accum``), ``G = rl.group_size`` completions of each, ``N = B·k·G`` completions in all, trained on
for ``rl.num_iterations`` optimiser steps (TRL's μ) before the next generation. Each optimiser step is ``k``
micro-batches of ``B·G`` rows (micro-batch ``m``: the completions of prompts ``m·B … m·B + B − 1``), their
gradients summed: TRL's ``gradient_accumulation_steps = k`` with ``steps_per_generation = k`` (its
default), ``per_device_train_batch_size = B·G``::

    generate    at a window start: the B·k prompts of EVERY RL tenant starting a window, in ONE sample()
                call (each row with its own adapter; stop at EOS, at rl.stop strings, at max_new_tokens)
    reward      on rank 0: each tenant's reward worker (its own process, with a timeout) scores its N
                completions; every tenant's batch is submitted before any answer is read, so they
                compute at once; the answers (or each failure) are broadcast to every process
    advantage   R = combine_rewards(r [N, F], rl.reward_weights)   A = advantages(R, G, rl.scale_rewards)
    rows        prompt + completion, labels on the completion tokens only (EOS included when drawn;
                none at all on a completion cut at max_new_tokens with rl.mask_truncated_completions)
    loss        from the loop's per-token losses ℓ [n, T-1] of this process's rows: the completion's
                log-probs logps[i, k] = −ℓ[i, P_i − 1 + k] (P_i its prompt's tokens) [n, L], and
                policy_loss(logps, old, A, mask) with TRL's normalisers over the whole window:
                S = N completions, N_tok = its completion tokens, K = k·D micro-batches (D
                data-parallel processes; their gradients are summed, as for the SFT tenants)

**Why every process generates everything.** Under FSDP, TP and EP every forward is a collective, so all
processes must run the same forwards: they all call :func:`~mlora_lab.sampling.sample` with the same
requests and the same seeds (so they draw the same completions), and an ``any_running`` hook (an
all-reduce of "a row still runs here") keeps their decode steps in step. Splitting the prompts over the
data-parallel ranks, and gathering the completions, is a later optimisation. Each process then trains on
its own share of the rows (``engine.local_rows``).

**Ahead, and elsewhere** (:mod:`~mlora_lab.job.drivers.rl.drawing`, :mod:`mlora_lab.job.rollout`). With
``rl.max_staleness = s`` a tenant samples a generation up to ``s`` optimiser steps before it trains on it (with
the adapter of that time; its rewards compute meanwhile), and a tenant whose generation is not ready sits the
step out. With ``Parallel.rollout_ranks`` the sampling above runs on the rollout ranks instead: the same
requests, seeds and adapter versions, so the same tokens.

**Seeds.** Completion ``j`` of prompt ``b`` of generation ``g`` of a tenant with ``seed`` draws from
``row_seed(generation_seed(seed, g, b), j)``: nothing else. A resume regenerates nothing that was trained
on and needs no RNG state; the same tenant alone or beside others draws the same tokens (up to
floating-point differences of differently shaped batches, see :mod:`mlora_lab.sampling`).

**Logprobs.** The plan asks the loop to divide each RL tenant's logits by its ``rl.temperature``, so
``−ℓ`` is TRL's ``log_softmax(z / temperature)[y]`` (top-k / top-p do not enter it, as in TRL). With
``num_iterations = 1`` the old
log-probs are ``sg(logps)`` (ratio 1, TRL's own shortcut); with more, the first step's ``sg(logps)`` are
kept (each micro-batch's as it is computed, then gathered from every process at the window's end, so a
checkpoint holds them whatever the world size, mid-window too) and the later steps' ratios are taken
against them. A generation sampled ahead (or an agent's episodes) is taken against the sampler's own log-probs
from its first step; with ``rl.importance_sampling_correction`` the ratio's "old" is the trainer's at the
window's start and the sampler's enter through TRL's truncated importance weight (:mod:`mlora_lab.rl.grpo`).
With ``beta > 0`` the reference log-probs are those of the base
model alone: one no-grad forward of the generation's rows with no adapter (tenant ``None``) right after
the generation, once per generation, on the shared base (no second copy of the model).
"""

from mlora_lab.job.drivers.rl.driver import FLAT_GENERATIONS, RLDriver, converged, reward_metrics
from mlora_lab.job.drivers.rl.generation import (
    Generation,
    RLFeed,
    completion_index,
    generation_seed,
    prompts_digest,
    read_prompts,
    sampler_logps,
)

__all__ = [
    "FLAT_GENERATIONS",
    "Generation",
    "RLDriver",
    "RLFeed",
    "completion_index",
    "converged",
    "generation_seed",
    "prompts_digest",
    "read_prompts",
    "reward_metrics",
    "sampler_logps",
]
