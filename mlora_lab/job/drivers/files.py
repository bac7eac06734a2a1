"""The file-data driver: supervised fine-tuning on each tenant's rows (``data`` in its spec).

Per step, every running tenant contributes its next ``batch_size`` rows. A tenant with ``grad_accum = k``
draws its whole window of ``k · batch_size`` rows when the window starts and counts its target tokens
``N_t`` there, so that k micro-batches give exactly the gradient of one big batch; with ``packing`` a row
is up to ``seq_len`` tokens of whole documents of the tenant (:func:`~mlora_lab.data.pack`). With ``D``
data-parallel processes, process ``d`` takes rows ``d, d + D, ...`` of each tenant's micro-batch.

Tenant ``t``'s loss on a process is ``Σ(token CE over its local rows) / N_t``: ``N_t`` counts the whole
window, on every process, so summing the gradients over the processes and the micro-batches gives
exactly the one-process, one-batch gradient of the mean target-token loss. A tenant steps when its
window is complete; its counters and data cursor move only then, and nothing moves for a tenant that did
not train.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example, TenantStream
from mlora_lab.job.agree import describe
from mlora_lab.job.drivers.base import Driver, Plan, StepResult
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rundir import HeldoutRow, TenantState
from mlora_lab.spec.tenant import Tenant


def rows_digest(examples: Sequence[Example]) -> str:
    """SHA-256 of a tenant's tokenized rows (ids, labels and positions of each, in order): what its data
    cursor indexes into. Equal digests mean the same rows, whatever file, tokenizer or ``seq_len`` made them."""
    h = hashlib.sha256()
    for ex in examples:
        for part in (ex.input_ids, ex.labels, ex.position_ids or ()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(array("q", part).tobytes())
    return h.hexdigest()


@dataclass
class FileFeed:
    """A file-data tenant's feed: its data order, held-out rows and the accumulation window."""

    stream: TenantStream
    heldout_examples: list[Example] = field(default_factory=list)
    micro: int = 0  # micro-batches done in the current accumulation window
    window: list[list[Example]] = field(default_factory=list)
    window_tokens: int = 0
    digest: str | None = field(default=None, repr=False)  # of the stream's rows, made when first needed

    def data_digest(self) -> str:
        """:func:`rows_digest` of the tenant's training rows (computed once: only checkpoints need it)."""
        if self.digest is None:
            self.digest = rows_digest(self.stream.examples)
        return self.digest

    def reset(self) -> None:
        self.micro = 0

    def rows_taken(self) -> int:
        """Rows (documents, when packed) of the tenant's data that went into its batches so far: every
        row the stream handed out, less those drawn for packing that still wait for a place in a row.
        Read from the stream's own position, so it survives a resume exactly."""
        waiting = len(self.stream.state_dict()["pending"])
        return self.stream.epoch * len(self.stream) + self.stream.cursor - waiting

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.state_dict(),
            "micro": self.micro,
            "window": [[[ex.input_ids, ex.labels, ex.position_ids] for ex in rows] for rows in self.window],
            "window_tokens": self.window_tokens,
            "data_digest": self.data_digest(),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        """Continue from a checkpoint's state; ``ValueError`` if the tenant's rows are not the rows that
        state counts through (its data changed since: the same number of rows with other content too).
        Checkpoints written before the digest existed have none, and are taken as they are."""
        saved = s.get("data_digest")
        if saved is not None and saved != self.data_digest():
            before = s["stream"].get("n_examples") if isinstance(s.get("stream"), dict) else None
            rows = f"{len(self.stream)} rows now" + (f", {before} then" if before is not None else "")
            raise ValueError(
                f"its training data changed since the checkpoint ({rows}; their content differs): put the "
                "data back as it was to resume it, or train on the new data as a new tenant that starts from "
                "its adapter (init_adapter: its directory in adapters/)"
            )
        self.stream.load_state_dict(s["stream"])
        self.micro = s["micro"]
        self.window = [[_example(row) for row in rows] for rows in s["window"]]
        self.window_tokens = s["window_tokens"]


def _example(saved: list) -> Example:
    """A window row as saved: ``[input_ids, labels, position_ids]`` (``None`` unless packed; checkpoints
    written before packing existed have no third entry)."""
    ids, labels, *rest = saved
    positions = rest[0] if rest else None
    return Example(list(ids), list(labels), None if positions is None else list(positions))


class FileData(Driver):
    """SFT tenants fed from their data files (see the module docstring)."""

    def accepts(self, tenant: Tenant) -> bool:
        # an RL tenant's rows are prompts: the RL driver's (mlora_lab.job.drivers.rl); a preference tenant's are
        # pairs (mlora_lab.job.drivers.preference); a Tinker client's tenant is the service driver's
        # (mlora_lab.job.drivers.tinker.driver)
        return tenant.rl is None and tenant.client is None and tenant.pref is None

    def feed(self, tenant: Tenant) -> FileFeed:
        examples = self.engine.examples(tenant.data)
        heldout = self.engine.examples(tenant.heldout_data) if tenant.heldout_data is not None else []
        return FileFeed(TenantStream(examples, seed=tenant.seed, shuffle=tenant.shuffle), heldout)

    def _mine(self, tenants: Sequence[TenantRun]) -> list[TenantRun]:
        return [t for t in tenants if isinstance(t.feed, FileFeed)]

    def plan(self) -> Plan | None:
        active = self._mine(self.pool.running())
        if not active:
            return None
        rows, failed = {}, {}
        for t in active:
            f: FileFeed = t.feed
            try:
                if f.micro == 0:
                    bs, k = t.spec.batch_size, t.spec.grad_accum
                    if self.spec.packing:  # bs rows of seq_len tokens, each full of whole documents
                        f.window = [f.stream.take_packed(bs, self.spec.seq_len) for _ in range(k)]
                    else:
                        drawn = f.stream.take(bs * k)
                        f.window = [drawn[i * bs : (i + 1) * bs] for i in range(k)]
                    f.window_tokens = sum(ex.n_target for micro in f.window for ex in micro)
                rows[t.name] = self.engine.local_rows(f.window[f.micro])
            except Exception as e:
                failed[t.name] = describe(e)
            f.micro += 1
        complete = [t.name for t in active if t.feed.micro == t.spec.grad_accum]  # the same on every process
        return Plan(tenants=active, rows=rows, complete=complete, failed=failed)

    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss.sum() / max(t.feed.window_tokens, 1)

    def stepped(self, t: TenantRun, result: StepResult) -> None:
        f: FileFeed = t.feed
        f.micro = 0
        t.tokens_seen += f.window_tokens
        self.log_train(t, result, f.window_tokens, rows_seen=f.rows_taken(), tokens_seen=t.tokens_seen)
        if t.step >= t.spec.max_steps:
            self.pool.finish(t)

    @torch.no_grad()
    def heldout_losses(self, only: Sequence[str] | None = None) -> dict[str, float]:
        """Mean target-token loss of each tenant's held-out rows (or of the tenants ``only``), computed in
        mixed-tenant batches, logged as :class:`~mlora_lab.rundir.HeldoutRow` rows. A collective: every
        process calls it with the same tenants."""
        # a quarantined tenant's loss is NaN by definition: it is not measured
        tenants = [
            t
            for t in self._mine(list(self.pool))
            if t.feed.heldout_examples
            and t.state is not TenantState.FAILED
            and (only is None or t.name in only)
        ]
        if not tenants:  # (the same on every process)
            return {}
        model = self.engine.model
        was_training = model.training
        model.eval()
        names = [t.name for t in tenants]
        sums = torch.zeros(len(names), 2, dtype=torch.float64)  # (loss sum, target tokens) per tenant
        cursors = dict.fromkeys(names, 0)
        while any(cursors[t.name] < len(t.feed.heldout_examples) for t in tenants):
            groups = []
            for t in tenants:
                c = cursors[t.name]
                groups.append(
                    (t.name, self.engine.local_rows(t.feed.heldout_examples[c : c + t.spec.batch_size]))
                )
                cursors[t.name] = c + t.spec.batch_size
            batch, token_loss = self.engine.forward(groups)
            n_tokens = (batch.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
            for n, start, end in batch.segments:
                if n is not None:
                    i = names.index(n)
                    sums[i, 0] += float(token_loss[start:end].sum())
                    sums[i, 1] += int(n_tokens[start:end].sum())
        sums = self.engine.comm.sum_over_dp(sums)
        model.train(was_training)
        losses = {n: float(sums[i, 0] / max(sums[i, 1], 1)) for i, n in enumerate(names)}
        for n, loss in losses.items():
            self.recorder.log(HeldoutRow(step=self.recorder.step, tenant=n, loss=loss))
        return losses
