"""The clients' models and their sessions: which tenant each model is, made, brought back by a resume,
paused when its client goes away and run again when it comes back.

Part of the service driver (:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`), which hands
:class:`Sessions` the ``create_model`` requests it takes (and the models a saved state makes, or a resumed job
brings back) and asks it at each step boundary which clients went away or came back.

    create_model      a tenant in a free slot: rank r, alpha ``lora_alpha`` (Tinker has none: a job setting),
                      LoRA on the attention (``train_attn``) and MLP (``train_mlp``) projections and on the
                      output layer (``train_unembed``) (:func:`tinker_targets`), PEFT's initialisation from
                      the client's seed, named for whom it is (:func:`client_tenant_name`); the creation is
                      agreed on every process (``agree``): one that cannot be made fails its request alone

A client shows life with every request naming its session or model, and with the SDK's heartbeat (every
10 s). One silent for ``session_timeout_s``, or whose session finished, has gone away: its tenants are saved
(``adapters/<tenant>``) and paused, never lost; a paused one whose client shows life again goes on where it
stopped. A session that made no model is forgotten then
(:meth:`~mlora_lab.service.state.ServiceState.expire_sessions`).

Rank 0 decides (it holds the sessions) and every process applies what it decided (a pause saves the
adapter: a collective). The watch looks once a second at a step boundary, and again, whatever the time,
just before a checkpoint is written (:meth:`SessionWatch.changes` with ``now``): a checkpoint must not keep
as live a client that had gone away by then, or a resumed job would give it a fresh timeout.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from mlora_lab.job.agree import agree
from mlora_lab.job.drivers.tinker.snapshots import Snapshots
from mlora_lab.job.engine import Engine
from mlora_lab.job.tenants import FeedFor, TenantPool, TenantRun
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.lora.targets import output_layer_names, storable_targets
from mlora_lab.rundir import TenantState
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.work import ErrorCategory, Kind, Result, Work
from mlora_lab.spec.fields import MAX_COUNT
from mlora_lab.spec.parts import ClientModel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.text import brief

GONE = "its client sent no heartbeat nor request"
"""The start of the reason a tenant of a client that went away is paused with."""

WATCH_EVERY_S = 1.0
"""How often, at most, the step boundaries look at the sessions."""

ATTENTION = (".self_attn.", ".attention.", ".attn.", ".self_attention.")
"""A module path holding one of these is an attention projection (``train_attn``); other linear layers of
the blocks are the MLP's (``train_mlp``, experts included)."""


class SessionWatch:
    """Rank 0's view of which clients went away or came back (``timeout_s``: ``Service.session_timeout``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._watched = 0.0

    def changes(
        self, state: Any, pool: TenantPool, names: Mapping[str, str], now: bool = False
    ) -> tuple[dict[str, str], list[str]]:
        """The tenants of clients that went away (to pause, with why) and those whose client is back (to
        resume), from the service's ``state`` (``names``: model id -> tenant). Looked at once a second, or
        ``now``; sessions that made no model and are over are forgotten then."""
        at = time.time()
        pauses: dict[str, str] = {}
        resumes: list[str] = []
        if not now and at - self._watched < WATCH_EVERY_S:
            return pauses, resumes
        self._watched = at
        state.expire_sessions(at, self.timeout_s)
        with state.lock:
            sessions = [(s.finished, s.last_seen, list(s.model_ids)) for s in state.sessions.values()]
        for finished, seen, models in sessions:
            gone = finished or at - seen > self.timeout_s
            for model_id in models:
                t = pool.tenants.get(names.get(model_id, ""))
                if t is None:
                    continue
                if gone and t.state is TenantState.RUNNING:
                    pauses[t.name] = "its client finished its session" if finished else GONE
                elif not gone and t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE):
                    resumes.append(t.name)
        return pauses, resumes


def apply_changes(pool: TenantPool, pauses: Mapping[str, str], resumes: list[str]) -> None:
    """On every process: pause (after saving the adapter: a collective) the tenants of clients that went
    away, and run again those whose client is back."""
    for name, why in pauses.items():
        pool.save_adapter_logged(name)
        pool.set_state(pool[name], TenantState.PAUSED, f"{why} (adapter saved)")
    for name in resumes:
        pool.set_state(pool[name], TenantState.RUNNING)


class Sessions:
    """The clients' models on this job (``names``: model id -> tenant) and the watch over their sessions.

    ``engine`` and ``pool``: the job's; ``state``: the service's shared state on rank 0 (its registry of
    models and sessions, the inbox each model's requests come through), None on every other process (it
    follows rank 0's orders); ``snapshots``: the sampler snapshots a new model may take a slot from;
    ``settle``: answers a request (a no-op but on rank 0); ``lora_alpha``: every client's alpha;
    ``timeout_s``: how long a silent client is waited for; ``reserved``: names no tenant of a client takes
    (those the OpenAI endpoint gives the base)."""

    def __init__(
        self,
        engine: Engine,
        pool: TenantPool,
        state: Any,
        snapshots: Snapshots,
        settle: Callable[[Work, Result], None],
        lora_alpha: float,
        timeout_s: float,
        reserved: Collection[str] = (),
    ) -> None:
        self.engine, self.comm, self.pool, self.state = engine, engine.comm, pool, state
        self.snapshots, self.settle = snapshots, settle
        self.lora_alpha, self.reserved = float(lora_alpha), reserved
        self.main = state is not None
        self.watch = SessionWatch(timeout_s)  # (rank 0's: clients gone away, or back)
        self.names: dict[str, str] = {}  # model id -> tenant name
        self.restored: list[str] = []  # clients' tenants a resume brought back, to register on rank 0

    def model_of(self, tenant: Tenant) -> tuple[str, bool]:
        """The model id of a tenant :meth:`create` is making, or of a client's tenant a resumed job brings
        back from ``job.json`` (registered again under its model id: then True, and :meth:`restore_models`
        registers it on rank 0 once the checkpoint said where its client's requests go on)."""
        if tenant.name not in self.names.values():
            assert tenant.client is not None
            self.names[tenant.client.model_id] = tenant.name
            self.restored.append(tenant.name)
            return tenant.client.model_id, True
        return next(m for m, n in self.names.items() if n == tenant.name), False

    def restore_models(self) -> None:
        """Rank 0, the first step of a resumed job: the clients' models its checkpoint brought back are
        registered again (their ids and owners: the keys that made them reach them and their saved states),
        their inboxes open at the seq_id their clients go on from, and each client's session is watched
        again: a client that does not come back within the session timeout has its tenant saved and paused
        (one paused already waits for a request of its client)."""
        restored, self.restored = self.restored, []
        if not self.main:
            return
        for name in restored:
            t = self.pool.tenants.get(name)
            if t is None or t.spec.client is None:
                continue
            c = t.spec.client
            info = ModelInfo(
                c.model_id,
                c.owner,
                self.state.base_model,
                t.spec.rank,
                c.seed,
                c.train_attn,
                c.train_mlp,
                c.train_unembed,
            )
            waiting = t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE)
            self.state.restore_model(info, t.feed.restored_seq_id or 1, alive=not waiting)

    def create(self, work: Work, feed: FeedFor, info: ModelInfo | None = None) -> TenantRun | None:
        """A tenant for the model ``info`` describes (``work.body`` by default), its feed made by ``feed``,
        and ``create_model`` answered; None (the request failed, saying why) if it cannot be made. On every
        process (the slot is agreed: a collective)."""
        info = info or work.body
        model_id = info.model_id
        if model_id in self.names:
            self._fail(work, f"model {model_id!r} exists already")
            return None
        model, reserved = self.engine.model, self.reserved
        name = client_tenant_name(
            info, lambda n: not self.pool.name_taken(n) and n not in model.tenants and n not in reserved
        )
        try:
            targets, experts = tinker_targets(
                model, info.train_attn, info.train_mlp, info.train_unembed, self.engine.slot_modules
            )
        except ValueError as e:
            self._fail(work, str(e))
            return None
        client = ClientModel(
            model_id, info.owner, info.seed, info.train_attn, info.train_mlp, info.train_unembed
        )
        tenant = Tenant(
            name=name,
            data="",
            rank=info.rank,
            alpha=self.lora_alpha,
            target_modules=targets,
            target_parameters=experts,
            lr=1e-4,
            weight_decay=0.0,
            max_grad_norm=None,
            batch_size=1,
            max_steps=MAX_COUNT,
            seed=0 if info.seed is None else int(info.seed),
            dropout=0.0,
            client=client,
        )
        self.names[model_id] = name
        # (a loaded snapshot gives its slot to a training client; it loads again when sampled)
        self.snapshots.free_slots(1)
        refusal = agree(self.comm, lambda: self.pool.prepare_add(tenant, feed))
        if refusal is not None:
            del self.names[model_id]
            self._fail(work, f"cannot create the model: {refusal.error}")
            return None
        if self.main:
            with self.state.lock:  # (the HTTP thread reads the registry under it)
                self.state.models[model_id] = info
            self.state.inbox.start_model(model_id)
        if work.kind is Kind.CREATE_MODEL:
            self.settle(work, Result(json={"model_id": model_id, "type": "create_model"}))
        return self.pool[name]

    def changes(self, now: bool = False) -> tuple[dict[str, str], list[str]]:
        """Rank 0: the tenants of clients that went away (to pause, with why) and those whose client is back
        (:meth:`SessionWatch.changes`)."""
        return self.watch.changes(self.state, self.pool, self.names, now=now)

    def before_checkpoint(self) -> None:
        """The clients that had gone away by now are paused before the checkpoint keeps their tenants (their
        sessions that made no model forgotten): a resumed job must not take them for live ones. On every
        process (rank 0 decides; pausing saves: a collective)."""
        changes = self.changes(now=True) if self.main else None
        pauses, resumes = self.comm.broadcast_object(changes)
        apply_changes(self.pool, pauses, resumes)

    def publish(self) -> None:
        """Rank 0: tell the HTTP side what the OpenAI endpoint lists and samples: the tenants holding a slot,
        and the named sampler snapshots (before a snapshot's save is answered: its client may list it next)."""
        if not self.main:
            return
        tenants = [n for n in self.pool.tenants if n in self.engine.model.tenants]
        snaps = [k for k, v in self.snapshots.by_key.items() if k.startswith("tinker://") and v is not None]
        with self.state.lock:
            self.state.tenant_names, self.state.snapshot_paths = tenants, snaps

    def _fail(self, work: Work, why: str) -> None:
        self.settle(work, Result(error=why, category=ErrorCategory.USER))


def tinker_targets(
    model: MultiLoRAModel,
    train_attn: bool,
    train_mlp: bool,
    train_unembed: bool,
    slot_modules: list[str] | None = None,
) -> tuple[list[str], list[str]]:
    """What a Tinker ``LoraConfig`` selects in ``model``: the full names of the slotted linear layers, and
    the packed expert parameters (an MoE block's MLP, with ``train_mlp``) as PEFT ``target_parameters``
    suffixes; ``ValueError`` when it asks for a part that has no adapter slot in this job (its
    ``slot_modules``)."""
    heads = set(output_layer_names(model.model))
    chosen, missing = [], []
    slotted = model.expert_parameters
    experts = slotted if train_mlp else []
    parts = (("attention", "train_attn", train_attn), ("MLP", "train_mlp", train_mlp))
    for part, flag, wanted in (*parts, ("output layer", "train_unembed", train_unembed)):
        names = [n for n in model.layers if _part(n, heads) == part]
        if wanted and not names and not (part == "MLP" and experts):
            missing.append((part, flag))
        chosen += names if wanted else []
    if missing:
        flags = " and ".join(f"{flag}=False" for _, flag in missing)
        raise ValueError(
            f"this job has no adapter slots on the {' or '.join(p for p, _ in missing)} (its slot_modules "
            f"{brief(slot_modules)}); create the client with {flags}, or serve a job whose "
            "slot_modules cover them (leave slot_modules unset: a served job then slots every linear "
            "layer and the output layer)"
        )
    # (the shortest suffixes that name them all: what the tenant's adapter_config.json says, as PEFT writes)
    return chosen, storable_targets(experts, slotted) if experts else []


def client_tenant_name(info: ModelInfo, free: Callable[[str], bool]) -> str:
    """The name of the tenant a client's model becomes, the first ``free`` one (the same on every process: it
    depends on ``info`` and the names taken alone): its ``user_metadata["name"]`` made safe (each run of
    other characters becomes ``-``; at most 64 characters), then ``-2``, ``-3``...; without one, its key's
    name and the first count free (``alice-1``, ``alice-2``...): a dashboard says whose it is, never an
    opaque id alone. (A name the OpenAI endpoint gives the base, ``base``, is never free: ``base-2``.)"""
    wanted = re.sub(r"[^A-Za-z0-9._-]+", "-", info.name or "").strip(".-")[:64]
    if wanted:
        if free(wanted):
            return wanted
        return next(f"{wanted}-{k}" for k in itertools.count(2) if free(f"{wanted}-{k}"))
    owner = re.sub(r"[^A-Za-z0-9._-]+", "-", info.owner).strip(".-")[:80] or "client"
    return next(f"{owner}-{k}" for k in itertools.count(1) if free(f"{owner}-{k}"))


def _part(name: str, heads: set[str]) -> str:
    if name in heads:
        return "output layer"
    return "attention" if any(a in f".{name}." for a in ATTENTION) else "MLP"
