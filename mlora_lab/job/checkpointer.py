"""Checkpointing a job: its resumable state is the state of its parts, saved together.

A checkpoint holds everything needed to continue exactly, in full (gathered) form, so it can be
resumed on any number of processes. The checkpointer knows no part's insides: it is handed the job's
``Stateful`` parts (``state_dict()`` / ``load_state_dict()``, as in ``torch.distributed.checkpoint``)
and saves the union of their state dicts, each part owning its own top-level keys:

* the job (:class:`~mlora_lab.job.trainer.Trainer`): ``global_step``, ``world_size``, ``rng``;
* the tenants (:class:`~mlora_lab.job.tenants.TenantPool`): ``removed``, ``tenants`` (per tenant: spec,
  adapter, optimiser and schedule, counters, the gradient accumulated so far, and its feed's state —
  data cursor, accumulation window and a digest of its rows for a file-data tenant; a tenant a resume
  held back keeps its saved state here) and ``unrecorded`` (tenants job.json could not be updated with);
  the digest and ``unrecorded`` are optional: checkpoints written before them resume as they did;
* a search (:class:`~mlora_lab.job.search.SearchController`), if the job runs one: ``search``.
* the drivers (:class:`~mlora_lab.job.drivers.base.Driver`), for what they keep beyond their tenants' feeds: a
  served job's ``service`` (its sessions, sampling sessions and unnamed sampler snapshots); none for the
  others.

The files and their format (JSON + safetensors, checksums, atomic commit) are
:mod:`mlora_lab.rundir.checkpoint`'s. Rank 0 writes; rank 0 also picks the checkpoint to resume from (the
newest intact one, skipping damaged ones, with the reasons) and every rank reads that one; a state that
fails :func:`~mlora_lab.rundir.checkpoint.check_job_state` (a tenant named ``../..``) is skipped too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from mlora_lab.parallel import Collectives
from mlora_lab.rundir import RunDir, checkpoint

CHECKPOINTS_KEPT = 2


class Stateful(Protocol):
    """A part of the job with a resumable state (the protocol of ``torch.distributed.checkpoint``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Saves the parts of one job under ``checkpoints/`` and finds the one to resume from."""

    def __init__(
        self, run: RunDir | None, comm: Collectives, is_main: bool, keep: int = CHECKPOINTS_KEPT
    ) -> None:
        self.run, self.comm, self.is_main, self.keep = run, comm, is_main, keep

    @staticmethod
    def state(parts: Mapping[str, Stateful]) -> dict[str, Any]:
        """The union of the parts' state dicts (a collective: parts gather their tensors in full)."""
        state: dict[str, Any] = {}
        for name, part in parts.items():
            own = part.state_dict()
            clash = set(own) & set(state)
            if clash:
                raise ValueError(f"checkpoint part {name!r} reuses the keys {sorted(clash)}")
            state.update(own)
        return state

    def save(self, step: int, parts: Mapping[str, Stateful]) -> Path | None:
        """Write ``checkpoints/step_<step>`` (rank 0) and drop all but the newest ``keep``. A collective.
        A failed write (a full disk) raises on rank 0 and leaves every earlier checkpoint intact."""
        state = self.state(parts)
        if self.run is None or not self.is_main:
            return None
        folder = self.run.inside(self.run.checkpoints)  # never through a symlink planted in its place
        path = checkpoint.write_checkpoint(folder, step, state)
        checkpoint.prune(folder, self.keep)
        return path

    def choose(self) -> tuple[Path | None, list[tuple[str, str]]]:
        """The checkpoint to resume from, as rank 0 found it: the newest intact one, and the newer
        damaged ones skipped, ``(name, why)``. A collective."""
        found: tuple[str | None, list[tuple[str, str]]] = (None, [])
        if self.run is not None and self.is_main:
            path, skipped = checkpoint.latest_intact(self.run.checkpoints)
            found = (path.name if path else None, [(p.name, why) for p, why in skipped])
        name, skipped = self.comm.broadcast_object(found)
        return (self.run.checkpoints / name if name and self.run else None), skipped

    def read(self, path: Path) -> dict[str, Any]:
        """The state of checkpoint ``path``, checked (:func:`~mlora_lab.rundir.checkpoint.check_job_state`)."""
        state = checkpoint.read_checkpoint(path)
        checkpoint.check_job_state(state, path.name)
        return state

    def latest(self) -> tuple[Path | None, dict[str, Any] | None, list[tuple[str, str]]]:
        """The checkpoint to resume from and its state: the newest one that is intact and whose state
        passes its checks, and the newer ones skipped, ``(name, why)``. A collective (rank 0 picks the
        newest intact one); every process then reads, and skips, the same files of the shared run directory."""
        path, skipped = self.choose()
        while path is not None:
            try:
                return path, self.read(path), skipped
            except checkpoint.CheckpointError as e:
                skipped.append((path.name, str(e)))
            older = [
                p
                for p in checkpoint.checkpoint_dirs(path.parent)
                if checkpoint.step_of(p) < checkpoint.step_of(path)
            ]
            path = next((p for p in reversed(older) if self._intact(p, skipped)), None)
        return None, None, skipped

    @staticmethod
    def _intact(path: Path, skipped: list[tuple[str, str]]) -> bool:
        try:
            checkpoint.verify(path)
            return True
        except checkpoint.CheckpointError as e:
            skipped.append((path.name, str(e)))
            return False

    @staticmethod
    def load(state: dict[str, Any], parts: Mapping[str, Stateful]) -> None:
        """Give every part the checkpoint's state (each takes its own keys)."""
        for part in parts.values():
            part.load_state_dict(state)
