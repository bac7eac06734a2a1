"""Sampler snapshots, the slots they share with training clients, and the batched sampling from them.

Part of the service driver (:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`), which hands this module the
``save_weights_for_sampler`` and ``asample`` requests it takes and settles the answers it gets back:

    save_weights_for_sampler   a **snapshot**: the tenant's adapter as it is now, copied into a slot of its
                      own (no optimiser; later steps of the tenant do not change it), at its place in
                      the model's ``seq_id`` order; named (``tinker://<model>/sampler_weights/<name>``) or
                      not (a sampling session of the SDK's ``save_weights_and_get_sampling_client``)
    asample           the samples of every client waiting at a step boundary, in ONE batched generation
                      (:func:`mlora_lab.sampling.sample`: each row with its snapshot's adapter, or the
                      base alone; a KV cache; seeds; stop strings and token ids; per-token logprobs always,
                      the prompt's when asked)

Snapshots and slots. A sampler snapshot keeps the adapter's tensors (in memory, on every process; a named
one is also a PEFT folder) and is loaded into a free slot when it is sampled from. Snapshots and training
clients share ``max_tenants``: a training client being created, or a batch sampling from snapshots that are
not loaded, unloads the snapshots sampled least recently. A model keeps its :data:`SESSION_SNAPSHOTS` most
recent unnamed snapshots (``save_weights_and_get_sampling_client``, once per step of an RL loop); its
``kind="inflight"`` saves share one target, which each such save moves on for every inflight session.

A named snapshot outlives the process: after a resume (or once the job has dropped it) the first request
that samples from its path reads it back from its PEFT folder, a snapshot as before. Unnamed ones (and the
inflight targets) go into the job's checkpoints (:meth:`Snapshots.state_dict`: each snapshot's tensors once,
with every key it is kept under, in the order they were saved), so a resumed job samples a sampling session
from before the stop as it did; the sessions themselves are the service state's
(:meth:`~mlora_lab.service.state.ServiceState.registry`). A checkpoint so holds at most
:data:`SESSION_SNAPSHOTS` + 1 adapters' tensors per model.

On several processes every process keeps every snapshot (their tensors gathered everywhere) and runs every
sample request (same seeds: the same tokens), its decode steps kept in step with the others
(``any_running``), as the RL driver generates; a named snapshot's PEFT folder is written by rank 0 alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlora_lab.job.engine import Engine
from mlora_lab.lora import AdapterError
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.rundir import checkpoint
from mlora_lab.rundir.files import check_no_links
from mlora_lab.rundir.service import TINKER, saved_folder
from mlora_lab.sampling import SampleRequest, default_stop_ids, sample
from mlora_lab.service import wire
from mlora_lab.service.work import ErrorCategory, Result, Work

SESSION_SNAPSHOTS = 8
"""Unnamed sampler snapshots kept per model (the most recent saves; named ones are all kept)."""


@dataclass(eq=False)
class Snapshot:
    """A sampler snapshot: the adapter's full tensors when it was saved (on every process) and its LoRA
    shape (``modules``: the linear layers; ``parameters``: PEFT ``target_parameters`` of packed experts), and
    the slot it is loaded in now (None: unloaded to make room; loaded again when sampled)."""

    model_id: str
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    alpha: float
    modules: tuple[str, ...]
    use_rslora: bool
    named: bool
    slot: str | None = None
    used: int = 0
    parameters: tuple[str, ...] = ()


def json_sequence(c: Any) -> dict[str, Any]:
    """One completion as the OpenAI endpoint reads it: tokens, their raw logprobs, the most likely tokens at
    each step (when asked) and why it stopped (``eos``, ``stop``, ``length``)."""
    return {"tokens": list(c.tokens), "logprobs": list(c.logprobs), "top_logprobs": c.top_logprobs,
            "prompt_logprobs": c.prompt_logprobs, "prompt_top_logprobs": c.prompt_top_logprobs,
            "stop_reason": c.stop_reason}  # fmt: skip


class Snapshots:
    """The job's sampler snapshots, the slots of ``engine``'s model they are loaded in (of ``max_tenants``,
    shared with the training clients), and sampling from them. ``checkpoints``: the service folder named
    snapshots are written in (None: none is written); ``main``: whether this is rank 0, which writes them.

    Requests are answered with a :class:`~mlora_lab.service.work.Result` for the caller to settle (rank 0
    holds the futures)."""

    def __init__(self, engine: Engine, max_tenants: int, checkpoints: Path | None, main: bool) -> None:
        self.engine, self.max_tenants = engine, max_tenants
        self.checkpoints, self.main = checkpoints, main
        # tinker:// path or sampling session id -> its snapshot (a model's inflight sessions share one)
        self.by_key: dict[str, Snapshot] = {}
        # when a snapshot was last sampled from: the least recent leaves first
        self._uses = itertools.count()
        self._ids = itertools.count()
        self.sampler: Callable[..., list[Any]] | None = None  # (a job with rollout ranks samples there)

    def save(self, work: Work, tenant: str) -> Result:
        """Keep ``tenant``'s adapter, as it is now, under the request's name: a frozen snapshot (named, or
        the sampling session of ``save_weights_and_get_sampling_client``), or the model's inflight target,
        which this save updates for every inflight session of the model."""
        save = work.body
        key = save.sampling_session_id or f"tinker://{work.model_id}/sampler_weights/{save.name}"
        if key in self.by_key and not save.overwrite:
            return Result(error=f"{key} exists already (save with overwrite=True to replace it)")
        model = self.engine.model
        adapter = model.tenants[tenant]
        tensors = model.tenant_tensors(tenant)  # (full tensors, on every process)
        target = self.by_key.get(f"inflight {work.model_id}") if save.inflight else self.by_key.get(key)
        if target is not None:  # overwritten, or the inflight target moves on: in place, in its slot too
            target.tensors = tensors
            if target.slot is not None:
                model.set_tenant_tensors(target.slot, tensors)
        else:
            target = Snapshot(
                work.model_id,
                tensors,
                adapter.rank,
                adapter.alpha,
                tuple(adapter.modules),
                adapter.use_rslora,
                named=save.name is not None,
                parameters=tuple(adapter.target_parameters),
            )
        if save.inflight:
            self.by_key[f"inflight {work.model_id}"] = target
        self.by_key[key] = target
        self.forget_old_sessions(work.model_id)
        folder = None if self.checkpoints is None or not save.name else saved_folder(self.checkpoints, key)
        if folder is not None:  # a named snapshot is also a PEFT adapter directory (svc.local_path)
            try:  # (the tenant's adapter, which the snapshot is a copy of now: gathered, written by rank 0)
                root = self.checkpoints.parent  # (the run: no link planted in it is followed)
                self.engine.save_adapter(tenant, folder if self.main else None, root=root)
            except checkpoint.WRITE_ERRORS as e:
                return Result(error=f"could not save {key}: {e}", category=ErrorCategory.SERVER)
        if save.sampling_session_id:
            answer = {"sampling_session_id": save.sampling_session_id, "type": "save_weights_for_sampler"}
        else:
            answer = {"path": key, "type": "save_weights_for_sampler"}
        return Result(json=answer)

    def forget_old_sessions(self, model_id: str) -> None:
        """A model keeps the snapshots of its :data:`SESSION_SNAPSHOTS` most recent unnamed sampler saves (an
        RL loop saves one per step): older ones are dropped, and sampling from them fails saying so."""
        keys = [
            k
            for k, snap in self.by_key.items()
            if snap.model_id == model_id and not snap.named and not k.startswith("inflight ")
        ]
        for k in keys[:-SESSION_SNAPSHOTS]:
            snap = self.by_key.pop(k)
            if snap.slot is not None and all(other is not snap for other in self.by_key.values()):
                self.engine.model.remove_tenant(snap.slot)
                snap.slot = None

    def free_slots(self, wanted: int, keep: set[int] = frozenset()) -> int:
        """Unload least recently sampled snapshots (not those in ``keep``, by id) until ``wanted`` slots are
        free or none is left to unload; the free slots."""
        model = self.engine.model
        loaded = sorted(
            {id(s): s for s in self.by_key.values() if s.slot is not None and id(s) not in keep}.values(),
            key=lambda s: s.used,
        )
        while self.max_tenants - len(model.tenants) < wanted and loaded:
            snap = loaded.pop(0)
            model.remove_tenant(snap.slot)
            snap.slot = None
        return self.max_tenants - len(model.tenants)

    def load(self, snaps: list[Snapshot]) -> set[int]:
        """Put ``snaps`` in slots (evicting others, least recently sampled first); the ids of those that
        could not get one (every slot holds a training client or a snapshot this batch samples)."""
        need = {id(s): s for s in snaps}
        missing = [s for s in need.values() if s.slot is None]
        free = self.free_slots(len(missing), keep=set(need))
        unloaded = set()
        for snap in missing:
            if free <= 0:
                unloaded.add(id(snap))
                continue
            snap.slot = f"snapshot.{next(self._ids)}"
            self.engine.model.add_tenant(
                snap.slot,
                rank=snap.rank,
                alpha=snap.alpha,
                target_modules=list(snap.modules),
                use_rslora=snap.use_rslora,
                init=snap.tensors,
                target_parameters=list(snap.parameters),
            )
            free -= 1
        for snap in need.values():
            snap.used = next(self._uses)
        return unloaded

    def sample(self, works: list[Work], settle: Callable[[Work, Result], None]) -> list[tuple[Work, int]]:
        """Every waiting sample request in one batched generation (on every process: its forwards are
        collectives); ``settle`` gets each request's answer, its sequences or why it failed (at once, for a
        request that cannot run). The snapshots sampled from are loaded into free slots first (a snapshot
        not sampled from lately may have been unloaded to make room). Returns the requests that ran, each
        with the tokens generated for it (all its samples')."""
        requests, taken = [], []
        eos = default_stop_ids(self.engine.model, self.engine.tokenizer)
        sources: list[Snapshot | None] = []
        for work in works:
            s = work.body
            # a snapshot's sampling session (its work names the model), a saved snapshot, or the base model
            source = s.sampling_session_id if work.model_id is not None else s.model_path
            if s.tenant is not None:  # (a tenant's current adapter: the OpenAI endpoint's model)
                if s.tenant not in self.engine.model.tenants:
                    settle(work, Result(error=f"no tenant {s.tenant!r} holds a slot now"))
                    continue
                sources.append(None)
                taken.append(work)
                continue
            if source is not None and source not in self.by_key and work.model_id is None:
                self.restore(source)
            if source is not None and source not in self.by_key:
                why = (
                    f"no sampler snapshot {source!r} on this server (an unnamed one is kept for "
                    f"the {SESSION_SNAPSHOTS} most recent saves of its model)"
                )
                settle(work, Result(error=why))
                continue
            sources.append(None if source is None else self.by_key[source])
            taken.append(work)
        unloaded = self.load([s for s in sources if s is not None])
        kept = []
        for work, snap in zip(taken, sources):
            if snap is not None and id(snap) in unloaded:
                why = (
                    f"no free slot to sample from its snapshot: the job's max_tenants="
                    f"{self.max_tenants} slots hold training clients and the snapshots sampled "
                    "with it; try again, or serve with a larger max_tenants"
                )
                settle(work, Result(error=why))
                continue
            s = work.body
            slot = s.tenant if s.tenant is not None else None if snap is None else snap.slot
            requests.append(sample_request(s, slot, eos))
            kept.append(work)
        taken = kept
        if not requests:
            return []
        any_running = self._any_running if self.engine.comm.mesh is not None else None
        try:
            done = (self.sampler or sample)(
                self.engine.model, requests, tokenizer=self.engine.tokenizer, any_running=any_running
            )
        except ValueError as e:  # (checked by the HTTP side already; a request it let through fails alone)
            for work in taken:
                settle(work, Result(error=f"sampling failed: {e}"))
            return []
        ran = []
        for i, work in enumerate(taken):
            mine = [c for c in done if c.request == i]
            if work.body.json_reply:  # (the OpenAI endpoint: it decodes and shapes the answer itself)
                settle(work, Result(json={"sequences": [json_sequence(c) for c in mine]}))
                ran.append((work, sum(len(c.tokens) for c in mine)))
                continue
            sequences = [wire.Sampled(c.tokens, c.logprobs, stopped=c.stop_reason != "length") for c in mine]
            prompt = mine[0].prompt_logprobs if requests[i].prompt_logprobs else None
            settle(work, Result(proto=wire.sample_response(sequences, prompt)))
            ran.append((work, sum(len(c.tokens) for c in mine)))
        return ran

    def restore(self, path: str) -> None:
        """Read the named snapshot ``path`` (``tinker://<model>/sampler_weights/<name>``) back from its PEFT
        folder into :attr:`by_key`, unloaded, if it is there and every process could read it (one all-reduce:
        the processes take part in every sample together, so they must agree on which can run)."""
        snap = None if self.checkpoints is None else read_snapshot(self.engine.model, self.checkpoints, path)
        unreadable = torch.tensor([float(snap is None)])
        if self.engine.comm.mesh is not None:
            unreadable = self.engine.comm.sum_over_world(unreadable)
        if float(unreadable[0]) == 0:
            self.by_key[path] = snap

    # -- in the job's checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The unnamed snapshots, for a checkpoint: ``snapshots`` (each once: its model, LoRA shape and
        tensors ``{layer: [A, B]}``) and ``keys`` (``[key, index into snapshots]`` in :attr:`by_key`'s order,
        which :meth:`forget_old_sessions` goes by). Named ones are PEFT folders already."""
        snapshots: list[dict[str, Any]] = []
        index: dict[int, int] = {}
        keys = []
        for key, snap in self.by_key.items():
            if snap.named:
                continue
            if id(snap) not in index:
                index[id(snap)] = len(snapshots)
                snapshots.append(
                    {
                        "model_id": snap.model_id,
                        "rank": snap.rank,
                        "alpha": snap.alpha,
                        "modules": list(snap.modules),
                        "parameters": list(snap.parameters),
                        "use_rslora": snap.use_rslora,
                        "tensors": {layer: list(ab) for layer, ab in snap.tensors.items()},
                    }
                )
            keys.append([key, index[id(snap)]])
        return {"snapshots": snapshots, "keys": keys}

    def load_state_dict(self, saved: dict[str, Any]) -> list[str]:
        """Take back the unnamed snapshots of a checkpoint (:meth:`state_dict`), unloaded; one that does not
        fit this job's model (a layer it has no slot on) is left out. The reasons of those left out."""
        snaps: list[Snapshot | None] = []
        dropped = []
        layers = set(self.engine.model.layers) | set(self.engine.model.expert_parameters)
        entries, keys = (
            saved.get(k) if isinstance(saved.get(k), list) else [] for k in ("snapshots", "keys")
        )
        for i, entry in enumerate(entries):
            try:
                tensors = {str(k): (a, b) for k, (a, b) in entry["tensors"].items()}
                if not set(tensors) <= layers or not all(
                    isinstance(t, torch.Tensor) for ab in tensors.values() for t in ab
                ):
                    raise ValueError("it has tensors of layers this job has no slot on")
                snaps.append(
                    Snapshot(
                        str(entry["model_id"]),
                        tensors,
                        int(entry["rank"]),
                        float(entry["alpha"]),
                        tuple(str(m) for m in entry["modules"]),
                        bool(entry["use_rslora"]),
                        named=False,
                        parameters=tuple(str(p) for p in entry.get("parameters", [])),
                    )
                )
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                snaps.append(None)
                dropped.append(f"sampler snapshot {i} of the checkpoint is left out: {e}")
        for pair in keys:
            key, i = pair if isinstance(pair, list | tuple) and len(pair) == 2 else (None, None)
            if isinstance(key, str) and isinstance(i, int) and 0 <= i < len(snaps) and snaps[i] is not None:
                self.by_key[key] = snaps[i]
            else:
                dropped.append(f"sampler snapshot key {str(pair)[:80]} of the checkpoint is left out")
        return dropped

    def _any_running(self, running: bool) -> bool:
        """Whether a sampling row still runs on any process (an all-reduce after every decode step)."""
        return bool(self.engine.comm.sum_over_world(torch.tensor([float(running)]))[0] > 0)


def sample_request(s: Any, slot: str | None, eos: list[int]) -> SampleRequest:
    """A sample request's body ``s`` as a row group of the batched generation, sampled with the adapter in
    ``slot`` (None: the base alone); ``eos``: the model's end-of-sequence ids."""
    ids = list(s.stop_token_ids)
    # ``stop`` absent: the model's end-of-sequence; ``stop: []``: nothing stops a sample but its
    # length; stop strings or ids: those and the end-of-sequence
    stops = ids + eos if (s.stop_at_eos or s.stop_strings or ids) else []
    return SampleRequest(
        prompt=s.prompt,
        tenant=slot,
        num_samples=s.num_samples,
        max_new_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=None if s.top_k < 1 else s.top_k,
        stop_token_ids=tuple(dict.fromkeys(stops)),
        stop_strings=tuple(s.stop_strings),
        seed=s.seed,
        prompt_logprobs=s.prompt_logprobs,
        top_logprobs=s.top_logprobs,
    )


def read_snapshot(model: MultiLoRAModel, checkpoints: Path, path: str) -> Snapshot | None:
    """The named snapshot ``path`` (``tinker://<model>/sampler_weights/<name>``) read back from its PEFT
    folder in the service folder ``checkpoints``, unloaded; None when it is not one or cannot be read."""
    parts = path.removeprefix(TINKER).split("/")
    if not path.startswith(TINKER) or len(parts) != 3 or parts[1] != "sampler_weights":
        return None
    try:
        folder = saved_folder(checkpoints, path)
        check_no_links(checkpoints.parent, folder)  # (no link planted in the run is followed)
        # (linear layers as they are; packed experts' PEFT tensors in the slots' layout)
        config, tensors = model.read_peft_adapter(folder)
    except (OSError, ValueError, AdapterError):
        return None
    return Snapshot(
        parts[0],
        tensors,
        int(config.r),
        float(config.lora_alpha),
        tuple(k for k in tensors if k in model.layers),
        bool(config.use_rslora),
        named=True,
        parameters=tuple(sorted(config.target_parameters or [])),
    )
