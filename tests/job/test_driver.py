"""The driver seam (mlora_lab.job.drivers.base): a toy driver feeds the training loop a fixed batch and a loss,
and the loop needs nothing else: no data file (the tenant's ``data`` does not exist), no knowledge of
windows or rows. It trains exactly like the file-data driver on the same rows, and it optimises, logs and
clips whatever loss the driver makes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mlora_lab.data import Example, tokenize_rows
from mlora_lab.job.drivers.base import Driver, JobParts, Plan, StepResult
from mlora_lab.job.tenants import TenantRun
from mlora_lab.job.trainer import Trainer
from mlora_lab.rundir import TenantState
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant

ROWS = [
    {"text": "the quick brown fox"},
    {"text": "jumps over the lazy dog and away"},
    {"text": "hello world"},
]


class NoFeed:
    """The toy's per-tenant state: nothing (it is saved and restored as nothing)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def reset(self) -> None:
        pass


class FixedBatch(Driver):
    """Every running tenant trains on the same rows every step, with ``scale`` × their mean token loss."""

    scale = 1.0

    def __init__(self, parts: JobParts) -> None:
        self.pool, self.engine = parts.pool, parts.engine
        self.rows: list[Example] = tokenize_rows(ROWS, self.engine.tokenizer, parts.spec.seq_len)
        self.results: list[tuple[str, int, StepResult]] = []

    def accepts(self, tenant: Tenant) -> bool:
        return True

    def feed(self, tenant: Tenant) -> NoFeed:
        return NoFeed()

    def plan(self) -> Plan | None:
        running = self.pool.running()
        if not running:
            return None
        rows = {t.name: self.engine.local_rows(self.rows) for t in running}
        return Plan(tenants=running, rows=rows, complete=[t.name for t in running])

    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n_targets = sum(ex.n_target for ex in self.rows)
        return self.scale * token_loss.sum() / n_targets

    def stepped(self, t: TenantRun, result: StepResult) -> None:
        self.results.append((t.name, t.step, result))
        if t.step >= t.spec.max_steps:
            self.pool.finish(t)


class Doubled(FixedBatch):
    scale = 2.0


class FailsForB(FixedBatch):
    """Its loss raises for tenant b (a driver's bug, or what one tenant's request made of it)."""

    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if t.name == "b":
            raise RuntimeError("Expected all tensors to be on the same device")
        return super().loss(t, token_loss, labels)


def tenant(data: str) -> Tenant:
    return Tenant(
        name="a",
        data=data,
        rank=4,
        alpha=8,
        target_modules=["q_proj", "v_proj"],
        lr=1e-2,
        batch_size=len(ROWS),
        max_steps=3,
        shuffle=False,
        max_grad_norm=None,
    )


def test_a_toy_driver_trains_like_the_file_driver_on_the_same_rows(llama_path, tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    from_file = Trainer(JobSpec(base_model=llama_path, tenants=[tenant(str(data))], seq_len=32))
    from_file.train()

    missing = tmp_path / "never-read.jsonl"
    toy = Trainer(
        JobSpec(base_model=llama_path, tenants=[tenant(str(missing))], seq_len=32), drivers=(FixedBatch,)
    )
    toy.train()
    assert not missing.exists()
    assert toy.tenants["a"].state is TenantState.FINISHED and toy.tenants["a"].step == 3
    (driver,) = toy.drivers
    assert [(n, s) for n, s, _ in driver.results] == [("a", 1), ("a", 2), ("a", 3)]
    assert [r.loss for *_, r in driver.results] == pytest.approx(from_file.losses("a"), abs=1e-6)
    got, want = toy.model.tenant_tensors("a"), from_file.model.tenant_tensors("a")
    for module in want:
        for x, y in zip(got[module], want[module]):
            assert (x - y).abs().max() <= 1e-6, module


def test_the_loop_optimises_logs_and_clips_the_loss_the_driver_makes(llama_path, tmp_path):
    spec = JobSpec(base_model=llama_path, tenants=[tenant(str(tmp_path / "none.jsonl"))], seq_len=32)
    once, twice = Trainer(spec, drivers=(FixedBatch,)), Trainer(spec, drivers=(Doubled,))
    assert once.step() and twice.step()
    (r1,), (r2,) = [[r for *_, r in next(iter(t.drivers)).results] for t in (once, twice)]
    assert r2.loss == pytest.approx(2 * r1.loss, rel=1e-6)
    assert r2.grad_norm == pytest.approx(2 * r1.grad_norm, rel=1e-5)


def test_a_loss_that_raises_quarantines_its_tenant_and_the_others_train_as_alone(llama_path, tmp_path):
    """The job goes on: the tenant whose loss raised is quarantined with the error, and the other one's
    losses and adapter are those of a job without it."""
    none = str(tmp_path / "none.jsonl")
    alone = Trainer(JobSpec(base_model=llama_path, tenants=[tenant(none)], seq_len=32), drivers=(FixedBatch,))
    alone.train()
    b = dataclasses.replace(tenant(none), name="b", seed=1)
    both = Trainer(
        JobSpec(base_model=llama_path, tenants=[tenant(none), b], seq_len=32), drivers=(FailsForB,)
    )
    both.train()
    assert both.tenants["b"].state is TenantState.FAILED
    assert "in its loss: RuntimeError: Expected all tensors" in both.tenants["b"].reason
    assert both.tenants["a"].state is TenantState.FINISHED
    assert both.losses("a") == pytest.approx(alone.losses("a"), abs=1e-6)
    got, want = both.model.tenant_tensors("a"), alone.model.tenant_tensors("a")
    assert all(torch.allclose(got[m][i], want[m][i], atol=1e-6) for m in want for i in (0, 1))
