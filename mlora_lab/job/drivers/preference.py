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
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, DataError, Example, TenantStream, check_vocab
from mlora_lab.job.agree import describe
from mlora_lab.job.drivers.base import Driver, Plan, StepResult
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.pairs import (
    PairIds,
    UnpairedIds,
    kl_completion_ids,
    pair_sequences,
    read_pairs,
    read_unpaired,
    sequence,
)
from mlora_lab.rl.preference import METRICS, preference_loss, sequence_logps
from mlora_lab.rl.preference_free import (
    CPO_AVERAGED_LOSS_TYPES,
    CPO_METRICS,
    KTO_METRICS,
    ORPO_METRICS,
    cpo_loss,
    kto_loss,
    masked_logps,
    orpo_loss,
    token_mean_nll,
)
from mlora_lab.rl.preference_ref import ReferenceCache
from mlora_lab.rundir import HeldoutRow, TenantState
from mlora_lab.spec.parts import Preference
from mlora_lab.spec.tenant import Tenant

SORTING_OR_BATCH = ("aot", "aot_unpaired", "sft")
"""Loss types that are not a mean of per-pair terms (see the module docstring, "Under D > 1")."""
METHOD_METRICS = {"dpo": METRICS, "orpo": ORPO_METRICS, "cpo": CPO_METRICS, "kto": KTO_METRICS}
"""What each method logs (TRL's names): DPO's six, ORPO's and CPO's with their NLL and odds terms."""


def pairs_digest(pairs: Sequence[PairIds]) -> str:
    """SHA-256 of a tenant's tokenized pairs, in order: what its data cursor and reference cache index into."""
    h = hashlib.sha256()
    for p in pairs:
        for part in (p.prompt_ids, p.chosen_ids, p.rejected_ids):
            h.update(len(part).to_bytes(8, "little"))
            h.update(array("q", part).tobytes())
    return h.hexdigest()


def unpaired_digest(rows: Sequence[UnpairedIds], kl_ids: Sequence[list[int]]) -> str:
    """SHA-256 of a KTO tenant's tokenized rows, their labels and their KL completions, in order."""
    h = hashlib.sha256()
    for r, kl in zip(rows, kl_ids, strict=True):
        for part in (r.prompt_ids, r.completion_ids, [int(r.label)], kl):
            h.update(len(part).to_bytes(8, "little"))
            h.update(array("q", part).tobytes())
    return h.hexdigest()


def _example(input_ids: Sequence[int], mask: Sequence[int]) -> Example:
    return Example(
        list(input_ids), [tok if m else IGNORE_INDEX for tok, m in zip(input_ids, mask, strict=True)]
    )


def pair_examples(pair: PairIds, seq_len: int, whole_chosen: bool = False) -> tuple[Example, Example]:
    """The chosen and the rejected sequence of a pair as loop rows: prompt + completion cut to ``seq_len``
    (its start kept, as TRL's ``keep_start``), labels the tokens themselves on the completion, ignored on the
    prompt (the loop's loss at position ``p`` predicts token ``p + 1``, TRL's ``completion_mask[:, 1:]``).
    ``whole_chosen`` (ORPO, whose NLL covers the chosen prompt too): every token of the chosen row is a label."""
    out = []
    for k, s in enumerate(pair_sequences(pair, seq_len, "keep_start")):
        whole = whole_chosen and k == 0
        labels = [
            tok if m or whole else IGNORE_INDEX for tok, m in zip(s.input_ids, s.completion_mask, strict=True)
        ]
        out.append(Example(list(s.input_ids), labels))
    return out[0], out[1]


def completion_masks(pair: PairIds, seq_len: int) -> tuple[list[int], list[int]]:
    """The chosen and the rejected sequence's completion masks (1 on a completion token), as cut to ``seq_len``."""
    chosen, rejected = pair_sequences(pair, seq_len, "keep_start")
    return chosen.completion_mask, rejected.completion_mask


@dataclass
class PrefFeed:
    """A preference tenant's feed: its pairs, their order, the window being trained, the reference cache and
    the window's metric sums."""

    pairs: list[PairIds]
    examples: list[tuple[Example, Example]]
    masks: list[tuple[list[int], list[int]]]  # each sequence's completion mask (1 on a completion token)
    stream: TenantStream  # over pair indices
    reference: ReferenceCache | None  # (None: ORPO and CPO have no reference)
    digest: str
    metrics: tuple[str, ...] = METRICS
    micro: int = 0  # micro-batches done in the current window
    window: list[list[int]] = field(default_factory=list)  # [k][B] pair indices
    window_tokens: int = 0  # completion tokens (chosen and rejected) of the window's pairs
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    """This process's ``Σ`` of each of ``metrics`` over its pairs of the window, then its pair count (KTO:
    ``[k, 6]``, per micro-batch ``n_D, Σβu_D, Σℓ_D, n_U, Σβu_U, Σℓ_U``)."""
    labels: list[bool] | None = None  # KTO: each row's label (desirable); its examples are (row, KL row)
    kls: list[float] = field(default_factory=list)  # KTO: each micro-batch's KL estimate z₀, so far
    heldout: PrefFeed | None = None  # the held-out pairs (their examples, masks and reference; no order)

    def __post_init__(self) -> None:
        if self.labels is None and self.sums.numel() != len(self.metrics) + 1:
            self.sums = torch.zeros(len(self.metrics) + 1, dtype=torch.float64)

    def zero_sums(self, k: int) -> None:
        """Forget the window's metric sums (``k`` micro-batches)."""
        self.sums = torch.zeros(k, 6, dtype=torch.float64) if self.labels is not None else self.sums.zero_()
        self.kls = []

    def reset(self) -> None:
        self.micro = 0
        self.sums.zero_()
        self.kls = []

    def pairs_taken(self) -> int:
        return self.stream.epoch * len(self.stream) + self.stream.cursor

    def state_dict(self) -> dict[str, Any]:
        # (keys apart from the pool's: mlora_lab.job.tenants.POOL_KEYS)
        return {
            "pref_stream": self.stream.state_dict(),
            "pref_micro": self.micro,
            "pref_window": self.window,
            "pref_window_tokens": self.window_tokens,
            "pref_sums": self.sums.clone(),
            "pref_kls": list(self.kls),
            "pref_reference": None if self.reference is None else self.reference.state_dict(),
            "pref_heldout_reference": (
                None
                if self.heldout is None or self.heldout.reference is None
                else self.heldout.reference.state_dict()
            ),
            "pref_digest": self.digest,
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        """Continue from a checkpoint; ``ValueError`` if the pairs changed since, or the reference was computed
        under other options."""
        if s["pref_digest"] != self.digest:
            raise ValueError(
                f"its preference pairs changed since the checkpoint ({len(self.pairs)} pairs now; their tokens "
                "differ): put the data back as it was to resume it, or train on the new pairs as a new tenant "
                "that starts from its adapter (init_adapter)"
            )
        self.stream.load_state_dict(s["pref_stream"])
        self.micro = int(s["pref_micro"])
        self.window = [[int(i) for i in micro] for micro in s["pref_window"]]
        self.window_tokens = int(s["pref_window_tokens"])
        self.sums = s["pref_sums"].to(torch.float64).clone()
        self.kls = [float(x) for x in s.get("pref_kls", [])]
        for cache, saved in (
            (self.reference, s["pref_reference"]),
            (None if self.heldout is None else self.heldout.reference, s.get("pref_heldout_reference")),
        ):
            if (
                cache is not None and saved is not None
            ):  # (merged: a cache shared with tenants restored before)
                before = dict(cache.values)
                cache.load_state_dict(saved)
                cache.values = {**before, **cache.values}


def _shifted(masks: Sequence[Sequence[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[n, width − 1]`` bool: ``out[r, p] = masks[r][p + 1]`` (the loop's ``ℓ[:, p]`` is of token ``p + 1``),
    False past a row's end."""
    out = torch.zeros(len(masks), width - 1, dtype=torch.bool)
    for r, m in enumerate(masks):
        out[r, : len(m) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    return out.to(device)


def _kto_metrics(sums: torch.Tensor, kls: list[float]) -> dict[str, float | None]:
    """TRL's KTO metrics of a window from its per-micro-batch sums ``[k, 6]`` (``n_D, Σβu_D, Σℓ_D, n_U, Σβu_U,
    Σℓ_U`` over every process) and KL estimates: each micro-batch's side means where it has that side (margins
    where it has both), averaged over the micro-batches (kto:1524-1546, TRL's log of a step); ``None`` for a
    side no micro-batch had."""
    per: dict[str, list[float]] = {m: [] for m in KTO_METRICS}
    per["kl"] = list(kls)
    for n_d, r_d, l_d, n_u, r_u, l_u in sums.tolist():
        if n_d:
            per["rewards/chosen"].append(r_d / n_d)
            per["logps/chosen"].append(l_d / n_d)
        if n_u:
            per["rewards/rejected"].append(r_u / n_u)
            per["logps/rejected"].append(l_u / n_u)
        if n_d and n_u:
            per["rewards/margins"].append(r_d / n_d - r_u / n_u)
    return {m: (sum(v) / len(v) if v else None) for m, v in per.items()}


class PreferenceDriver(Driver):
    """Preference tenants: pairs, a cached reference, TRL's DPO-family losses (see the module docstring)."""

    def __init__(self, parts: Any) -> None:
        super().__init__(parts)
        self.comm = parts.engine.comm
        # reference caches of the base reference by (rows' digest, ld_alpha): tenants on the same rows (a β
        # sweep, DPO beside IPO) share one, so each row's reference forward is made once for all of them
        self.shared: dict[tuple[str, float | None], ReferenceCache] = {}

    def _base_reference(self, digest: str, ld_alpha: float | None) -> ReferenceCache:
        """The cache of the base reference of rows with this ``digest`` (made on first use, then shared)."""
        key = (digest, ld_alpha)
        if key not in self.shared:
            e = self.engine
            self.shared[key] = ReferenceCache(
                e.model, pad_token_id=e.pad_id, ld_alpha=ld_alpha, max_length=self.spec.seq_len
            )
        return self.shared[key]

    def accepts(self, tenant: Tenant) -> bool:
        return tenant.pref is not None and tenant.client is None and tenant.rl is None

    def feed(self, tenant: Tenant) -> PrefFeed:
        if tenant.pref.method == "kto":
            return self._kto_feed(tenant)
        f = self._pair_feed(tenant, tenant.data)
        if tenant.heldout_data is not None:
            f.heldout = self._pair_feed(tenant, tenant.heldout_data)
        return f

    def _pair_feed(self, tenant: Tenant, source: Any) -> PrefFeed:
        """The pairs of ``source`` (the tenant's data or held-out data) as a feed, with their reference cache."""
        e, pref, L = self.engine, tenant.pref, self.spec.seq_len
        pairs = read_pairs(source, e.tokenizer, L)
        examples = [pair_examples(p, L, whole_chosen=pref.method == "orpo") for p in pairs]
        check_vocab([ex for both in examples for ex in both], e.vocab_rows, str(source))
        reference = None
        if pref.method == "dpo":
            on_init = pref.reference_of(tenant.init_adapter) == "init_adapter"
            if on_init and tenant.init_adapter is None:
                raise DataError(
                    ["pref.reference = 'init_adapter' needs an init_adapter"], header="cannot train"
                )
            reference = (
                ReferenceCache(
                    e.model, pad_token_id=e.pad_id, tenant=tenant.name, ld_alpha=pref.ld_alpha, max_length=L
                )
                if on_init
                else self._base_reference(pairs_digest(pairs), pref.ld_alpha)
            )
        # (the stream's "examples" are the pairs' indices: it only counts and orders them)
        stream = TenantStream(list(range(len(pairs))), seed=tenant.seed, shuffle=tenant.shuffle)
        masks = [completion_masks(p, L) for p in pairs]
        return PrefFeed(
            pairs,
            examples,
            masks,
            stream,
            reference,
            pairs_digest(pairs),
            metrics=METHOD_METRICS[pref.method],
        )

    def _kto_feed(self, tenant: Tenant) -> PrefFeed:
        """A KTO tenant's rows (TRL's ``KTOTrainer``): each row's KL completion is the one before it within its
        block of ``batch_size`` rows in data order (:func:`~mlora_lab.rl.pairs.kl_completion_ids`), fixed for the
        run as TRL fixes it when it prepares the data set; each row's reference values are those of its row and
        of its KL row."""
        e, pref, L = self.engine, tenant.pref, self.spec.seq_len
        rows = read_unpaired(tenant.data, e.tokenizer, L)
        kl_ids = kl_completion_ids([r.completion_ids for r in rows], tenant.batch_size)
        seqs = [
            (sequence(r.prompt_ids, r.completion_ids, L), sequence(r.prompt_ids, kl, L))
            for r, kl in zip(rows, kl_ids, strict=True)
        ]
        examples = [tuple(_example(s.input_ids, s.completion_mask) for s in both) for both in seqs]
        check_vocab([ex for both in examples for ex in both], e.vocab_rows, str(tenant.data))
        on_init = pref.reference_of(tenant.init_adapter) == "init_adapter"
        if on_init and tenant.init_adapter is None:
            raise DataError(["pref.reference = 'init_adapter' needs an init_adapter"], header="cannot train")
        digest = unpaired_digest(rows, kl_ids)
        reference = (
            ReferenceCache(e.model, pad_token_id=e.pad_id, tenant=tenant.name, max_length=L)
            if on_init
            else self._base_reference(digest, None)
        )
        stream = TenantStream(list(range(len(rows))), seed=tenant.seed, shuffle=tenant.shuffle)
        masks = [(a.completion_mask, b.completion_mask) for a, b in seqs]
        return PrefFeed(
            rows,
            examples,
            masks,
            stream,
            reference,
            digest,
            metrics=KTO_METRICS,
            labels=[r.label for r in rows],
            sums=torch.zeros(tenant.grad_accum, 6, dtype=torch.float64),
        )

    def _mine(self, tenants: Sequence[TenantRun]) -> list[TenantRun]:
        return [t for t in tenants if isinstance(t.feed, PrefFeed)]

    def _local(self, pair_ids: Sequence[int]) -> list[int]:
        return list(pair_ids[self.comm.dp_rank :: self.comm.dp_size])

    # -- a step's plan ---------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        active = self._mine(self.pool.running())
        if not active:
            return None
        failed: dict[str, str] = {}
        for t in active:
            f: PrefFeed = t.feed
            if f.micro == 0:
                try:
                    B, k = t.spec.batch_size, t.spec.grad_accum
                    drawn = f.stream.take(B * k)
                    f.window = [drawn[i * B : (i + 1) * B] for i in range(k)]
                    if f.labels is None:  # (its completions')
                        f.window_tokens = sum(sum(m[1:]) for i in drawn for m in f.masks[i])
                    else:  # (KTO: its rows', not their KL rows')
                        f.window_tokens = sum(sum(f.masks[i][0][1:]) for i in drawn)
                    f.zero_sums(k)
                except Exception as e:  # (the same on every process: the same stream)
                    failed[t.name] = describe(e)
        self._reference([t for t in active if t.feed.micro == 0 and t.name not in failed])
        self._kl_estimates([t for t in active if t.spec.pref.loss_types == ["kto"] and t.name not in failed])
        rows: dict[str, list[Example]] = {}
        for t in active:
            f = t.feed
            if t.name not in failed:
                mine = self._local(f.window[f.micro])
                if f.labels is not None:  # KTO: its rows alone (their KL rows were scored without gradient)
                    rows[t.name] = [f.examples[i][0] for i in mine]
                else:
                    rows[t.name] = [f.examples[i][0] for i in mine] + [f.examples[i][1] for i in mine]
            f.micro += 1  # (the micro-batch the loss below is of: micro - 1)
        complete = [t.name for t in active if t.feed.micro == t.spec.grad_accum]  # the same on every process
        return Plan(tenants=active, rows=rows, complete=complete, failed=failed)

    @torch.no_grad()
    def _reference(self, starting: list[TenantRun]) -> None:
        """The reference log-probs of the starting windows' pairs not yet cached (a tenant whose reference is its
        init adapter: of all its pairs, before its first step), one forward per tenant whose reference is its
        init adapter and one for all the others (routed to no adapter). A collective: every process has the same
        caches, so the same pairs are missing everywhere; each computes its share and the sums are shared.
        Tenants that share a cache (the same rows, the base as reference) have their missing rows computed once."""
        wanted: list[tuple[PrefFeed, Sequence[int], int]] = []  # (feed, its rows wanted, rows per forward)
        for t in starting:
            f: PrefFeed = t.feed
            if f.reference is None:
                continue
            chunk = t.spec.batch_size * t.spec.grad_accum
            on_init = (
                f.reference.tenant is not None
            )  # (every row now: the slot holds the init adapter until step 1)
            wanted.append((f, range(len(f.pairs)) if on_init else [i for m in f.window for i in m], chunk))
            if on_init and f.heldout is not None:
                wanted.append((f.heldout, range(len(f.heldout.pairs)), chunk))
        self._fill(wanted)

    def _fill(self, wanted: list[tuple[PrefFeed, Sequence[int], int]]) -> None:
        """Compute the missing reference values of each feed's wanted rows, a cache shared by several feeds
        once, in forwards of at most the largest ``rows per forward`` of each reference (a collective)."""
        by_cache: dict[int, tuple[PrefFeed, list[int], int]] = {}
        for f, rows, chunk in wanted:
            first, before, most = by_cache.get(id(f.reference), (f, [], 0))
            by_cache[id(f.reference)] = (first, before + list(rows), max(most, chunk))
        todo: dict[str | None, list[tuple[PrefFeed, list[int], int]]] = {}
        for f, rows, chunk in by_cache.values():
            missing = [int(i) for i in f.reference.missing(rows)]
            if missing:
                todo.setdefault(f.reference.tenant, []).append((f, missing, chunk))
        if not todo:
            return
        model = self.engine.model
        was_training = model.training
        model.eval()  # (a fixed reference: no dropout of an init adapter)
        try:
            for key, jobs in todo.items():
                chunk = max(c for _, _, c in jobs)
                for start in range(0, max(len(m) for _, m, _ in jobs), chunk):
                    self._reference_pass(key, [(f, m[start : start + chunk]) for f, m, _ in jobs])
        finally:
            model.train(was_training)

    @torch.no_grad()
    def _kl_estimates(self, tenants: list[TenantRun]) -> None:
        """KTO's KL estimate of each tenant's micro-batch about to train, ``z₀ = max(0, mean_B(ℓ' − ℓ'^ref))`` over
        its ``B`` KL rows (each row's prompt with another row's completion) under the tenant's adapter as it is
        now, without gradient (TRL's ``_compute_kl_logps``): one forward of every such tenant's KL rows (each
        process its share; the sums shared, so every process holds the whole micro-batch's z₀). A collective."""
        if not tenants:
            return
        model = self.engine.model
        was_training = model.training
        model.eval()  # (TRL disables dropout: disable_dropout=True)
        try:
            local = [self._local(t.feed.window[t.feed.micro]) for t in tenants]
            groups = [
                (t.name, [t.feed.examples[i][1] for i in mine])
                for t, mine in zip(tenants, local, strict=True)
            ]
            batch, token_loss = self.engine.forward(groups)
        finally:
            model.train(was_training)
        sums = torch.zeros(len(tenants), 2, dtype=torch.float64)
        start = 0
        for j, (t, mine) in enumerate(zip(tenants, local, strict=True)):
            if mine:
                f: PrefFeed = t.feed
                mask = _shifted([f.masks[i][1] for i in mine], batch.labels.shape[1], token_loss.device)
                kl_logps = masked_logps(-token_loss[start : start + len(mine)], mask).double().cpu()
                ref = torch.tensor([f.reference.values[i][1] for i in mine], dtype=torch.float64)
                sums[j] = torch.tensor([float((kl_logps - ref).sum()), len(mine)], dtype=torch.float64)
            start += len(mine)
        sums = self.comm.sum_over_dp(sums)
        for j, t in enumerate(tenants):
            t.feed.kls.append(max(0.0, float(sums[j, 0] / sums[j, 1])))

    def _reference_pass(self, key: str | None, jobs: list[tuple[PrefFeed, list[int]]]) -> None:
        groups, local = [], []
        for f, missing in jobs:
            mine = self._local(missing)
            local.append(mine)
            ex = f.examples
            groups.append((key, [ex[i][0] for i in mine] + [ex[i][1] for i in mine]))
        batch, token_loss = self.engine.forward(groups)
        start = 0
        for (f, missing), mine in zip(jobs, local, strict=True):
            values = torch.zeros(len(missing), 2, dtype=torch.float64)
            if mine:
                n = len(mine)
                logps = -token_loss[start : start + 2 * n].double()
                mask = batch.labels[start : start + 2 * n, 1:] != IGNORE_INDEX
                chosen, rejected = sequence_logps(
                    logps[:n], mask[:n], logps[n:], mask[n:], ld_alpha=f.reference.options["ld_alpha"]
                )
                at = torch.tensor([missing.index(i) for i in mine])
                values[at, 0], values[at, 1] = chosen.cpu(), rejected.cpu()
            start += 2 * len(mine)
            values = self.comm.sum_over_dp(values)
            for i, (c, r) in zip(missing, values.tolist(), strict=True):
                f.reference.values[i] = (c, r)

    # -- the loss --------------------------------------------------------------------------------
    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The tenant's preference loss of this process's pairs of the micro-batch (see the module docstring)."""
        f: PrefFeed = t.feed
        pref: Preference = t.spec.pref
        mine = self._local(f.window[f.micro - 1])
        n = len(mine)
        logps = -token_loss  # [2n, T-1] (KTO: [n, T-1])
        if f.labels is not None:
            return self._kto(t, f, pref, mine, logps, labels.shape[1])
        loss, metrics = self._pairs_loss(pref, f, mine, logps, labels)
        f.sums += torch.tensor([float(metrics[m]) * n for m in f.metrics] + [n], dtype=torch.float64)
        return loss * (n / (t.spec.batch_size * t.spec.grad_accum))

    def _pairs_loss(
        self, pref: Preference, f: PrefFeed, mine: list[int], logps: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics of pairs ``mine`` of ``f`` (its masks and reference) from their rows' token
        log-probs ``[2n, T-1]`` and labels ``[2n, T]`` (the chosen rows, then the rejected ones)."""
        n = len(mine)
        masks = [f.masks[i][0] for i in mine] + [f.masks[i][1] for i in mine]
        mask = _shifted(masks, labels.shape[1], logps.device)  # [2n, T-1]: ℓ[:, p] is of token p + 1
        if pref.method == "dpo":
            loss, metrics = self._dpo(f, pref, mine, logps, mask)
        elif pref.method == "orpo":
            whole = (
                labels[:n, 1:] != IGNORE_INDEX
            )  # the chosen rows' prompt and completion (attention_mask[:, 1:])
            average = masked_logps(logps, mask, average=True)
            loss, metrics = orpo_loss(
                average[:n], average[n:], token_mean_nll(logps[:n], whole), beta=pref.beta
            )
        else:
            (loss_type,) = pref.loss_types
            seq = masked_logps(logps, mask, average=loss_type in CPO_AVERAGED_LOSS_TYPES)
            nll = token_mean_nll(logps[:n], mask[:n]) if pref.cpo_alpha != 0 else None
            loss, metrics = cpo_loss(
                seq[:n],
                seq[n:],
                nll,
                loss_type=loss_type,
                beta=pref.beta,
                label_smoothing=pref.label_smoothing,
                cpo_alpha=pref.cpo_alpha,
                simpo_gamma=pref.simpo_gamma,
            )
        return loss, metrics

    def _kto(
        self, t: TenantRun, f: PrefFeed, pref: Preference, mine: list[int], logps: torch.Tensor, width: int
    ) -> torch.Tensor:
        """KTO's loss of this process's rows (the micro-batch's KL estimate computed by :meth:`_kl_estimates`), its
        metric sums kept per micro-batch (TRL logs the mean of each micro-batch's side means)."""
        n = len(mine)
        mask = _shifted([f.masks[i][0] for i in mine], width, logps.device)
        seq = masked_logps(logps, mask)
        ref = torch.tensor([f.reference.values[i][0] for i in mine], dtype=seq.dtype, device=seq.device)
        desirable = torch.tensor([f.labels[i] for i in mine], dtype=torch.bool, device=seq.device)
        (loss_type,) = pref.loss_types
        kl = torch.tensor(f.kls[f.micro - 1], dtype=seq.dtype) if loss_type == "kto" else None
        loss, _ = kto_loss(
            seq,
            ref,
            desirable,
            loss_type=loss_type,
            beta=pref.beta,
            desirable_weight=pref.desirable_weight,
            undesirable_weight=pref.undesirable_weight,
            kl=kl,
        )
        rewards, kept = pref.beta * (seq.detach() - ref), seq.detach()
        d, u = desirable, ~desirable
        sides = [(int(s.sum()), float(rewards[s].sum()), float(kept[s].sum())) for s in (d, u)]
        f.sums[f.micro - 1] += torch.tensor([*sides[0], *sides[1]], dtype=torch.float64)
        return loss * (n / (t.spec.batch_size * t.spec.grad_accum))

    def _dpo(
        self, f: PrefFeed, pref: Preference, mine: list[int], logps: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n = len(mine)
        chosen, rejected = sequence_logps(logps[:n], mask[:n], logps[n:], mask[n:], ld_alpha=pref.ld_alpha)
        ref = torch.tensor([f.reference.values[i] for i in mine], dtype=logps.dtype, device=logps.device)
        # TRL's unshifted completion_mask counts (a completion token at position 0 counts there, not in ℓ)
        counts = torch.tensor([sum(m) for m in [f.masks[i][0] for i in mine] + [f.masks[i][1] for i in mine]])
        return preference_loss(
            chosen,
            rejected,
            ref[:, 0],
            ref[:, 1],
            loss_types=pref.loss_types,
            loss_weights=pref.loss_weights,
            beta=pref.beta,
            label_smoothing=pref.label_smoothing,
            f_divergence=pref.f_divergence_type,
            f_alpha=pref.f_alpha_divergence_coef,
            discopop_tau=pref.discopop_tau,
            chosen_tokens=counts[:n].to(logps.device),
            rejected_tokens=counts[n:].to(logps.device),
            chosen_token_logps=logps[:n],
            chosen_mask=mask[:n],
        )

    def stepped(self, t: TenantRun, result: StepResult) -> None:
        f: PrefFeed = t.feed
        sums = self.comm.sum_over_dp(f.sums.clone())  # (every process steps the same tenants, in order)
        if f.labels is not None:
            extra = _kto_metrics(sums, f.kls or [0.0] * t.spec.grad_accum)
        else:
            count = float(sums[-1])
            extra = {m: (float(sums[i]) / count if count else None) for i, m in enumerate(f.metrics)}
        f.kls = []
        f.micro = 0
        f.sums.zero_()
        t.tokens_seen += f.window_tokens
        self.log_train(
            t, result, f.window_tokens, rows_seen=f.pairs_taken(), tokens_seen=t.tokens_seen, extra=extra
        )
        if t.step >= t.spec.max_steps:
            self.pool.finish(t)

    # -- held-out pairs ------------------------------------------------------------------------
    @torch.no_grad()
    def heldout_losses(self, only: Sequence[str] | None = None) -> dict[str, float]:
        """Each pair tenant's preference loss over its held-out pairs (or of the tenants ``only``), the mean over
        the pairs (TRL's ``eval_loss`` with batches of ``batch_size`` pairs), with TRL's metrics, logged as a
        :class:`~mlora_lab.rundir.HeldoutRow` (metrics in ``extra``). Their base references are computed (and
        kept) first; an init adapter's were computed before the first step. A collective."""
        tenants = [
            t
            for t in self._mine(list(self.pool))
            if t.feed.heldout is not None
            and t.state is not TenantState.FAILED
            and (only is None or t.name in only)
        ]
        if not tenants:  # (the same on every process)
            return {}
        self._fill([(t.feed.heldout, range(len(t.feed.heldout.pairs)), t.spec.batch_size) for t in tenants])
        width = max(len(t.feed.metrics) for t in tenants) + 2
        sums = torch.zeros(
            len(tenants), width, dtype=torch.float64
        )  # (Σ n·loss, Σ n·metric..., n) per tenant
        model = self.engine.model
        was_training = model.training
        model.eval()
        try:
            cursors = [0] * len(
                tenants
            )  # (each tenant in batches of its batch_size; the same on every process)
            while any(c < len(t.feed.heldout.pairs) for c, t in zip(cursors, tenants, strict=True)):
                local = [
                    self._local(range(c, min(c + t.spec.batch_size, len(t.feed.heldout.pairs))))
                    for c, t in zip(cursors, tenants, strict=True)
                ]
                cursors = [c + t.spec.batch_size for c, t in zip(cursors, tenants, strict=True)]
                groups = []
                for t, mine in zip(tenants, local, strict=True):
                    ex = t.feed.heldout.examples
                    groups.append((t.name, [ex[i][0] for i in mine] + [ex[i][1] for i in mine]))
                batch, token_loss = self.engine.forward(groups)
                start = 0
                for j, (t, mine) in enumerate(zip(tenants, local, strict=True)):
                    if mine:
                        rows = slice(start, start + 2 * len(mine))
                        h = t.feed.heldout
                        loss, metrics = self._pairs_loss(
                            t.spec.pref, h, mine, -token_loss[rows], batch.labels[rows]
                        )
                        n = len(mine)
                        values = [float(loss) * n, *(float(metrics[m]) * n for m in h.metrics)]
                        sums[j, : len(values)] += torch.tensor(values, dtype=torch.float64)
                        sums[j, -1] += n
                    start += 2 * len(mine)
        finally:
            model.train(was_training)
        sums = self.comm.sum_over_dp(sums)
        out = {}
        for j, t in enumerate(tenants):
            n = float(sums[j, -1])
            out[t.name] = float(sums[j, 0]) / n
            extra = {m: float(sums[j, 1 + i]) / n for i, m in enumerate(t.feed.heldout.metrics)}
            self.recorder.log(
                HeldoutRow(step=self.recorder.step, tenant=t.name, loss=out[t.name], extra=extra)
            )
        return out
