"""KTO's part of the preference driver (TRL 1.16's ``KTOTrainer``): a tenant's unpaired rows with their KL
rows, the KL estimate of each micro-batch, and its loss and metric sums. A mixin of
:class:`~mlora_lab.job.drivers.preference.driver.PreferenceDriver`, which holds the engine, the collectives and
the shared reference caches it uses."""

from __future__ import annotations

from typing import Any

import torch

from mlora_lab.data import DataError, TenantStream, check_vocab
from mlora_lab.job.drivers.preference.feeds import PrefFeed, masked_example, shifted, unpaired_digest
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rl.pairs import kl_completion_ids, read_unpaired, sequence
from mlora_lab.rl.preference_free import KTO_METRICS, kto_loss, masked_logps
from mlora_lab.rl.preference_ref import ReferenceCache
from mlora_lab.spec.parts import Preference
from mlora_lab.spec.tenant import Tenant


class KTOParts:
    """KTO tenants' feed, KL estimates and loss (see the module docstring)."""

    engine: Any
    comm: Any
    spec: Any

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
        examples = [tuple(masked_example(s.input_ids, s.completion_mask) for s in both) for both in seqs]
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
            comm=self.comm,
            labels=[r.label for r in rows],
            sums=torch.zeros(tenant.grad_accum, 6, dtype=torch.float64),
        )

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
            outputs = self._forward(groups)
        finally:
            model.train(was_training)
        sums = torch.zeros(len(tenants), 2, dtype=torch.float64)
        for j, (t, mine, (token_loss, labels)) in enumerate(zip(tenants, local, outputs, strict=True)):
            if mine:
                f: PrefFeed = t.feed
                mask = shifted([f.masks[i][1] for i in mine], labels.shape[1], token_loss.device)
                kl_logps = masked_logps(-token_loss, mask).double().cpu()
                ref = torch.tensor([f.reference.values[i][1] for i in mine], dtype=torch.float64)
                sums[j] = torch.tensor([float((kl_logps - ref).sum()), len(mine)], dtype=torch.float64)
        sums = self.comm.sum_over_dp(sums)
        for j, t in enumerate(tenants):
            t.feed.kls.append(max(0.0, float(sums[j, 0] / sums[j, 1])))

    def _kto(
        self, t: TenantRun, f: PrefFeed, pref: Preference, mine: list[int], logps: torch.Tensor, width: int
    ) -> torch.Tensor:
        """KTO's loss of this process's rows (the micro-batch's KL estimate computed by :meth:`_kl_estimates`), its
        metric sums kept per micro-batch (TRL logs the mean of each micro-batch's side means)."""
        n = len(mine)
        mask = shifted([f.masks[i][0] for i in mine], width, logps.device)
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
