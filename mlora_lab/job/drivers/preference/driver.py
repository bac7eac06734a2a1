"""The preference driver (see :mod:`mlora_lab.job.drivers.preference`): pairs into the mixed step, the
reference cached (and shared by tenants on the same rows), TRL's DPO, ORPO and CPO losses, KTO's through its
mixin (:mod:`.kto`), held-out pairs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, DataError, Example, TenantStream, check_vocab
from mlora_lab.job.agree import describe
from mlora_lab.job.drivers.base import Driver, Plan, StepResult
from mlora_lab.job.drivers.preference.feeds import (
    METHOD_METRICS,
    PrefFeed,
    completion_masks,
    kto_metrics,
    pair_examples,
    pairs_digest,
    shifted,
)
from mlora_lab.job.drivers.preference.kto import KTOParts
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.pairs import read_pairs
from mlora_lab.rl.preference import preference_loss, sequence_logps
from mlora_lab.rl.preference_free import (
    CPO_AVERAGED_LOSS_TYPES,
    cpo_loss,
    masked_logps,
    orpo_loss,
    token_mean_nll,
)
from mlora_lab.rl.preference_ref import ReferenceCache
from mlora_lab.rundir import HeldoutRow, TenantState
from mlora_lab.spec.parts import Preference
from mlora_lab.spec.tenant import Tenant


class PreferenceDriver(KTOParts, Driver):
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
            comm=self.comm,
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
            if (
                t.name not in failed and len(f.window) != t.spec.grad_accum
            ):  # (a resume with another grad_accum)
                failed[t.name] = (
                    f"its checkpoint holds a window of {len(f.window)} micro-batches, {f.micro} done, but grad_accum "
                    f"is {t.spec.grad_accum} now: resume it with the grad_accum it was saved with"
                )
        self._reference([t for t in active if t.feed.micro == 0 and t.name not in failed])
        self._kl_estimates(
            [
                t
                for t in active
                if t.spec.pref.loss_types == ["kto"] and t.name not in failed and t.feed.labels
            ]
        )
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
            chunk = t.spec.batch_size  # (pairs per forward: a micro-batch's, as the step's own forward)
            if f.reference.tenant is None:
                wanted.append((f, [i for m in f.window for i in m], chunk))
            elif len(f.reference) < len(
                f.pairs
            ):  # every row now: the slot holds the init adapter until step 1
                wanted.append((f, range(len(f.pairs)), chunk))
                if f.heldout is not None:
                    wanted.append((f.heldout, range(len(f.heldout.pairs)), chunk))
        self._fill(wanted)

    def _fill(self, wanted: list[tuple[PrefFeed, Sequence[int], int]]) -> None:
        """Compute the missing reference values of each feed's wanted rows, a cache shared by several feeds
        once, each cache at most its ``rows per forward`` pairs a forward, the caches of one reference side by
        side in passes of at most ``max_pass_tokens`` (a collective)."""
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

    def _forward(
        self, groups: list[tuple[str | None, list[Example]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each group's token losses ``[n, T−1]`` and labels ``[n, T]``, the groups run side by side in passes of
        at most ``max_pass_tokens`` padded tokens (:meth:`~mlora_lab.job.engine.Engine.passes`: the same passes on
        every process, so a collective)."""
        out = []
        for part in self.engine.passes(groups):
            batch, token_loss = self.engine.forward(part)
            start = 0
            for _, rows in part:
                out.append((token_loss[start : start + len(rows)], batch.labels[start : start + len(rows)]))
                start += len(rows)
        return out

    def _reference_pass(self, key: str | None, jobs: list[tuple[PrefFeed, list[int]]]) -> None:
        groups, local = [], []
        for f, missing in jobs:
            mine = self._local(missing)
            local.append(mine)
            ex = f.examples
            groups.append((key, [ex[i][0] for i in mine] + [ex[i][1] for i in mine]))
        outputs = self._forward(groups)
        for (f, missing), mine, (token_loss, labels) in zip(jobs, local, outputs, strict=True):
            values = torch.zeros(len(missing), 2, dtype=torch.float64)
            if mine:
                n = len(mine)
                logps = -token_loss.double()
                mask = labels[:, 1:] != IGNORE_INDEX
                chosen, rejected = sequence_logps(
                    logps[:n], mask[:n], logps[n:], mask[n:], ld_alpha=f.reference.options["ld_alpha"]
                )
                at = torch.tensor([missing.index(i) for i in mine])
                values[at, 0], values[at, 1] = chosen.cpu(), rejected.cpu()
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
        mask = shifted(masks, labels.shape[1], logps.device)  # [2n, T-1]: ℓ[:, p] is of token p + 1
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
            extra = kto_metrics(sums, f.kls or [0.0] * t.spec.grad_accum)
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
                outputs = self._forward(groups)
                for j, (t, mine, (token_loss, labels)) in enumerate(
                    zip(tenants, local, outputs, strict=True)
                ):
                    if mine:
                        h = t.feed.heldout
                        loss, metrics = self._pairs_loss(t.spec.pref, h, mine, -token_loss, labels)
                        n = len(mine)
                        values = [float(loss) * n, *(float(metrics[m]) * n for m in h.metrics)]
                        sums[j, : len(values)] += torch.tensor(values, dtype=torch.float64)
                        sums[j, -1] += n
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
