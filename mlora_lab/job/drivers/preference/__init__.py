"""The preference driver: tenants that learn from preference pairs (DPO and its family, ``Tenant.pref``), in
the same loop and the same base forward as the SFT and RL tenants, as TRL 1.16's ``DPOTrainer`` trains them.

A tenant's data is ``M`` pairs ``(x, y_w, y_l)`` tokenized as TRL does (:func:`~mlora_lab.rl.pairs.read_pairs`).
Its optimiser window is ``B·k`` pairs (``B = batch_size``, ``k = grad_accum``), drawn when the window starts
(the tenant's seeded order, as an SFT tenant's rows), trained in ``k`` micro-batches of ``B`` pairs: TRL's
``per_device_train_batch_size = B``, ``gradient_accumulation_steps = k``. With ``D`` data-parallel processes,
process ``d`` takes pairs ``d, d + D, ...`` of each micro-batch, and both sequences of a pair stay together::

    reference   at a window start, for the window's pairs not yet cached: one no-grad forward (eval mode) of
                their 2 sequences routed to no adapter (reference "base": the base alone) or to the tenant
                (reference "init_adapter", the default of a tenant with one, as TRL's: done for EVERY pair
                before the tenant's first step, while its slot still holds the init adapter); each process its share, the values summed over the processes,
                kept by pair id (:class:`~mlora_lab.rl.preference_ref.ReferenceCache`) and checkpointed
    rows        per local pair: prompt + chosen, prompt + rejected (labels on the completion tokens only),
                the chosen half then the rejected half
    loss        from the loop's per-token losses ℓ [2P, T-1] of this process's P pairs: token log-probs −ℓ,
                sequence log-probs over the completion tokens (LD-DPO's ld_alpha), the reference's from the
                cache, and preference_loss(...) = TRL's batch loss L_b (a mean over the P pairs), scaled to
                L_b · P / (B·k): summed over the processes and micro-batches, the window's gradient is the
                mean over micro-batches of each micro-batch's mean over its pairs, as TRL's
    metrics     TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
                logps/rejected: sums over every pair of the window (all processes), logged as their means in
                the train row's ``extra``

**Why the reference is cached, not computed in the step.** The reference is fixed for the run, so a pair's
``ℓ^ref`` depends on its tokens alone: one forward per pair for the whole run (TRL's
``precompute_ref_log_probs``), against a second forward of every pair at every step of every epoch in the
same-step approach. Its memory is two floats per pair on the host (about 100 bytes a pair with Python's
dict; 1M pairs ≈ 100 MB) and nothing on the accelerator; a checkpoint holds it as an ``[M, 2]`` float64
tensor. The reference forward is small (the window's new pairs, no gradient) and leaves the step's batch
to the policy's rows.

**Under D > 1.** The losses that are a mean of per-pair terms (all but ``aot``, ``aot_unpaired`` and
``sft``) give exactly the one-process gradient. ``aot`` and ``aot_unpaired`` sort the pairs of a batch and
``sft`` averages over a batch's tokens: each process computes them over its own share of the micro-batch,
as TRL does on each of its devices under data parallelism.

The package: :mod:`.feeds` (a tenant's rows, windows, reference caches and metric sums, and what a checkpoint
keeps of them), :mod:`.kto` (KTO's unpaired rows and KL estimate), :mod:`.driver` (the driver itself).
"""

from mlora_lab.job.drivers.preference.driver import PreferenceDriver
from mlora_lab.job.drivers.preference.feeds import (
    METHOD_METRICS,
    PrefFeed,
    completion_masks,
    pair_examples,
    pairs_digest,
    unpaired_digest,
)

__all__ = [
    "METHOD_METRICS",
    "PrefFeed",
    "PreferenceDriver",
    "completion_masks",
    "pair_examples",
    "pairs_digest",
    "unpaired_digest",
]
