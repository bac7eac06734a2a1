"""The service driver: training clients of the Tinker API drive their tenants request by request.

Third driver of the training loop (after file data and RL, :mod:`mlora_lab.job.driver`). The HTTP thread
(:mod:`mlora_lab.service.app`) only queues :class:`~mlora_lab.service.work.Work`; at each step boundary this
driver takes what may run (:meth:`~mlora_lab.service.work.Inbox.take`: every model's requests in ``seq_id``
order) and turns it into one mixed-tenant step, so the requests of every client that wait at the same moment
share one forward and one backward of the base:

    create_model      a tenant in a free slot: rank r, alpha ``lora_alpha`` (Tinker has none: a job setting),
                      LoRA on the attention (``train_attn``) and MLP (``train_mlp``) projections and on the
                      output layer (``train_unembed``), PEFT's initialisation from the client's seed
    forward_backward  its datums are rows of the step: input ``x [N]`` + one more position, labels
                      ``[-, y_0 … y_{N-1}]`` (``y = target_tokens``), so the loop's per-token loss ``ℓ [N]``
                      gives ``lp_t = −ℓ_t = log p(y_t | x_{≤t})``, the logprobs the client gets back; the
                      request's loss is Tinker's sum over its datums (:mod:`mlora_lab.service.losses`);
                      ``forward`` (forward-only) rows take part in the forward and add nothing to the backward
    optim_step        the tenant's AdamW step after the backward, with the request's ``AdamParams``
                      (torch AdamW: lr, betas, eps, decoupled weight decay; clipping when ``grad_clip_norm``
                      > 0, by torch's rule): gradients of every ``forward_backward`` since the last
                      optim_step are summed, as in Tinker

A model's requests run in ``seq_id`` order: in one step a model takes its waiting forward/backward requests
up to and including its first optim_step; what follows waits for the next step (it must see the new
weights). Results are settled as soon as they are known: a forward/backward's after the forward, an
optim_step's after the optimiser step (or its failure: a quarantined tenant fails its waiting requests).
With ``max_step_tokens``, a step takes forward/backward requests until their datums hold that many input
tokens (at least one request); the rest wait for the next steps, and the models take turns to go first.

    save_weights_for_sampler   a **snapshot**: the tenant's adapter as it is now, copied into a slot of its
                      own (no optimiser; later steps of the tenant do not change it), at its place in
                      the model's ``seq_id`` order; named (``tinker://<model>/sampler_weights/<name>``) or
                      not (a sampling session of the SDK's ``save_weights_and_get_sampling_client``)
    asample           the samples of every client waiting at a step boundary, in ONE batched generation
                      (:func:`mlora_lab.sampling.sample`: each row with its snapshot's adapter, or the
                      base alone; a KV cache; seeds; stop strings and token ids; per-token logprobs always,
                      the prompt's when asked)

    save_weights      ``save_state``: ``<checkpoints>/weights/<model>/<name>/`` in the checkpoint format (JSON
                      + safetensors, never a pickle; complete or absent), holding the adapter, the AdamW
                      state and the client's LoRA settings, and ``adapter/`` beside them, a PEFT adapter
                      directory; answered ``tinker://<model>/weights/<name>``
    load_weights      into the model (``load_state``: the weights, a fresh AdamW; ``..._with_optimizer``:
                      its state too), or a new model from it (``create_training_client_from_state``:
                      the load is that model's first request)

A client that goes away (its session finished, or no heartbeat nor request for ``session_timeout_s``; the
SDK heartbeats every 10 s) has its tenants saved (``adapters/<tenant>``) and paused, not lost; a paused
tenant whose session shows life again (a request naming its model) goes on where it stopped.

It runs on one process for now (``parallel.nproc = 1``). A snapshot holds a slot while the job runs
(snapshots and training clients share ``max_tenants``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlora_lab.data import IGNORE_INDEX, Example
from mlora_lab.job.agree import agree
from mlora_lab.job.driver import Driver, JobParts, Plan, StepResult
from mlora_lab.job.tenants import TenantRun
from mlora_lab.lora.model import MultiLoRAModel
from mlora_lab.lora.targets import output_layer_names
from mlora_lab.rundir import TenantState, TrainRow, checkpoint
from mlora_lab.rundir.checkpoint import CheckpointError, read_checkpoint, write_state_dir
from mlora_lab.rundir.service import saved_folder
from mlora_lab.sampling import SampleRequest, default_stop_ids, sample
from mlora_lab.service import losses, wire
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.work import ErrorCategory, Kind, Result, Work
from mlora_lab.spec import MAX_COUNT, Tenant

GONE = "its client sent no heartbeat nor request"
"""The start of the reason a tenant of a client that went away is paused with."""

STATE_FORMAT = "mlora_lab.service.state/1"
"""What a saved Tinker state says it is (a checkpoint-format directory of another kind is refused)."""

ATTENTION = (".self_attn.", ".attention.", ".attn.", ".self_attention.")
"""A module path holding one of these is an attention projection (``train_attn``); other linear layers of
the blocks are the MLP's (``train_mlp``, experts included)."""


def tinker_targets(
    model: MultiLoRAModel, train_attn: bool, train_mlp: bool, train_unembed: bool
) -> list[str]:
    """The full names of the slotted layers of ``model`` a Tinker ``LoraConfig`` selects; ``ValueError``
    when it asks for a part that has no adapter slot in this job (the job's ``slot_modules``)."""
    heads = set(output_layer_names(model.model))
    chosen, missing = [], []
    for part, wanted in (("attention", train_attn), ("MLP", train_mlp), ("output layer", train_unembed)):
        names = [n for n in model.layers if _part(n, heads) == part]
        if wanted and not names:
            missing.append(part)
        chosen += names if wanted else []
    if missing:
        raise ValueError(
            f"this job has no adapter slots on the {' or '.join(missing)} (its slot_modules); "
            f"create the client with train_{'unembed' if missing == ['output layer'] else 'attn/mlp'}=False, "
            "or serve a job whose slot_modules cover it"
        )
    return chosen


def _part(name: str, heads: set[str]) -> str:
    if name in heads:
        return "output layer"
    return "attention" if any(a in f".{name}." for a in ATTENTION) else "MLP"


@dataclass
class ServiceFeed:
    """A service tenant's per-tenant state: its model id and the current window's counters."""

    model_id: str
    window_tokens: int = 0
    window_requests: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"service_model_id": self.model_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model_id = state["service_model_id"]

    def reset(self) -> None:
        self.window_tokens = self.window_requests = 0


@dataclass
class _Pending:
    """What a tenant runs in this step: its forward/backward requests (with their datums' lengths) and the
    optim_step that ends it, if any."""

    forwards: list[tuple[Work, list[int]]] = field(default_factory=list)
    optim: Work | None = None


class ServiceDriver(Driver):
    """Tenants of Tinker training clients (see the module docstring). ``state`` is the service's shared
    state (:class:`~mlora_lab.service.app.ServiceState`): its inbox, futures and model registry."""

    def __init__(
        self,
        parts: JobParts,
        state: Any,
        lora_alpha: float = 32.0,
        checkpoints: str | Path | None = None,
        session_timeout_s: float = 60.0,
        max_step_tokens: int | None = None,
    ) -> None:
        super().__init__(parts)
        self.max_step_tokens = max_step_tokens
        self._first = 0  # which model goes first in the next step (they take turns)
        self.session_timeout_s = float(session_timeout_s)
        self._watched = 0.0
        self.state, self.lora_alpha = state, float(lora_alpha)
        state.inbox.wake_with(parts.wake)  # a request ends the loop's idle wait at once
        self.checkpoints = None if checkpoints is None else Path(checkpoints)
        self.comm = parts.engine.comm
        self.names: dict[str, str] = {}  # model id -> tenant name
        self.queues: dict[str, deque[Work]] = {}  # model id -> its requests taken, not run yet
        self.step_work: dict[str, _Pending] = {}  # tenant -> what it runs in the current step
        self.waiting_optim: dict[str, Work] = {}  # tenant -> its optim_step, until the step settles it
        self.snapshots: dict[str, str] = {}  # tinker:// path or sampling session id -> its slot's name
        self._snapshot_ids = itertools.count()
        if self.comm.dims.world_size > 1:
            raise NotImplementedError("the Tinker service runs on one process for now (parallel.nproc=1)")

    def accepts(self, tenant: Tenant) -> bool:
        return tenant.name in self.names.values()

    def feed(self, tenant: Tenant) -> ServiceFeed:
        model_id = next(m for m, n in self.names.items() if n == tenant.name)
        return ServiceFeed(model_id)

    def waiting(self) -> bool:
        return True  # clients may send requests at any time

    # -- a step's plan ---------------------------------------------------------------------------
    def plan(self) -> Plan | None:
        self._settle_failed()
        self._watch_sessions()
        samples: list[Work] = []
        for work in self.state.inbox.take():
            if work.kind is Kind.CREATE_MODEL:
                self._create(work)
            elif work.kind is Kind.SAMPLE:
                samples.append(work)
            elif work.kind is Kind.LOAD_WEIGHTS and work.body.create:
                self._create_from_state(work)
            elif work.model_id in self.queues:
                self.queues[work.model_id].append(work)
            else:
                self._fail(work, f"no model {work.model_id!r} on this server")
        self.step_work = {}
        models = list(self.queues)
        if self.max_step_tokens is not None and models:  # the models take turns to go first
            self._first = (self._first + 1) % len(models)
            models = models[self._first :] + models[: self._first]
        tokens = 0  # input tokens of the step's datums so far
        for model_id in models:
            queue = self.queues[model_id]
            name = self.names[model_id]
            t = self.pool.tenants.get(name)
            if t is None or t.state is not TenantState.RUNNING:
                continue
            pending = _Pending()
            while queue:
                work = queue[0]
                if work.kind is Kind.FORWARD_BACKWARD:
                    fb: wire.ForwardBackward = work.body
                    lengths = [len(d.tokens) for d in fb.data]
                    if self._full(tokens, sum(lengths)):  # it and the model's later requests: next step
                        break
                    queue.popleft()
                    try:  # (a request that cannot be computed fails alone, before the step)
                        losses.validate(fb.loss_fn, fb.config, [d.inputs for d in fb.data], lengths,
                                        vocab_size=self.engine.vocab_rows)  # fmt: skip
                    except losses.LossInputError as e:
                        self._fail(work, str(e))
                        continue
                    pending.forwards.append((work, lengths))
                    tokens += sum(lengths)
                elif work.kind in (Kind.SAVE_FOR_SAMPLER, Kind.SAVE_WEIGHTS, Kind.LOAD_WEIGHTS):
                    if pending.forwards:  # it must come after them (and their step): next step
                        break
                    {Kind.SAVE_FOR_SAMPLER: self._snapshot, Kind.SAVE_WEIGHTS: self._save_state,
                     Kind.LOAD_WEIGHTS: self._load_state}[work.kind](queue.popleft(), t)  # fmt: skip
                else:  # an optim_step (the only other kind queued): it ends the tenant's part of this step
                    pending.optim = queue.popleft()
                    break
            if pending.forwards or pending.optim is not None:
                self.step_work[name] = pending
        if samples:
            self._sample(samples)
        if not self.step_work:
            return None
        tenants = [self.pool[n] for n in self.step_work]
        rows: dict[str, list[Example]] = {}
        complete = []
        for t in tenants:
            pending = self.step_work[t.name]
            rows[t.name] = [_row(d) for work, _ in pending.forwards for d in work.body.data]
            if pending.optim is not None:
                self._set_adam(t, pending.optim.body)
                self.waiting_optim[t.name] = pending.optim
                complete.append(t.name)
        return Plan(tenants=tenants, rows=rows, complete=complete)

    def _full(self, tokens: int, more: int) -> bool:
        """Whether a step holding ``tokens`` input tokens has no room for ``more`` (``max_step_tokens``; a
        step always takes its first request)."""
        return self.max_step_tokens is not None and tokens > 0 and tokens + more > self.max_step_tokens

    def _create(self, work: Work, info: Any = None) -> TenantRun | None:
        """A tenant for the model ``info`` describes (``work.body`` by default); None (the request failed,
        saying why) if it cannot be made."""
        info = info or work.body
        model_id = info.model_id
        if model_id in self.names:
            self._fail(work, f"model {model_id!r} exists already")
            return None
        name = model_id.replace(":", "-")
        try:
            targets = tinker_targets(self.engine.model, info.train_attn, info.train_mlp, info.train_unembed)
        except ValueError as e:
            self._fail(work, str(e))
            return None
        tenant = Tenant(name=name, data="", rank=info.rank, alpha=self.lora_alpha, target_modules=targets,
                        lr=1e-4, weight_decay=0.0, max_grad_norm=None, batch_size=1, max_steps=MAX_COUNT,
                        seed=0 if info.seed is None else int(info.seed), dropout=0.0)  # fmt: skip
        self.names[model_id] = name
        refusal = agree(self.comm, lambda: self.pool.prepare_add(tenant, self.feed))
        if refusal is not None:
            del self.names[model_id]
            self._fail(work, f"cannot create the model: {refusal.error}")
            return None
        self.queues[model_id] = deque()
        with self.state.lock:  # (the HTTP thread reads the registry under it)
            self.state.models[model_id] = info
        self.state.inbox.start_model(model_id)
        if work.kind is Kind.CREATE_MODEL:
            answer = {"model_id": model_id, "type": "create_model"}
            self.state.futures.settle(work.request_id, Result(json=answer))
        return self.pool[name]

    def _watch_sessions(self) -> None:
        """Pause (after saving) the tenants of clients that went away; resume those whose client is back.
        Looked at once a second."""
        now = time.time()
        if now - self._watched < 1.0:
            return
        self._watched = now
        with self.state.lock:
            sessions = [(s.finished, s.last_seen, list(s.model_ids)) for s in self.state.sessions.values()]
        for finished, seen, models in sessions:
            gone = finished or now - seen > self.session_timeout_s
            for model_id in models:
                t = self.pool.tenants.get(self.names.get(model_id, ""))
                if t is None:
                    continue
                if gone and t.state is TenantState.RUNNING:
                    self.pool.save_adapter_logged(t.name)
                    why = "its client finished its session" if finished else GONE
                    self.pool.set_state(t, TenantState.PAUSED, f"{why} (adapter saved)")
                elif not gone and t.state is TenantState.PAUSED and (t.reason or "").startswith(GONE):
                    self.pool.set_state(t, TenantState.RUNNING)

    # -- training state ----------------------------------------------------------------------------
    def _folder(self, path: str) -> Path | None:
        """Where the checkpoint ``path`` (``tinker://…``) lives (None: this server saves nothing)."""
        return None if self.checkpoints is None else saved_folder(self.checkpoints, path)

    def _save_state(self, work: Work, t: TenantRun) -> None:
        save = work.body
        path = f"tinker://{work.model_id}/weights/{save.name}"
        folder = self._folder(path)
        if folder is None:
            self._fail(work, "this server keeps no saved states (it runs without a run directory)")
            return
        if folder.exists() and not save.overwrite:
            self._fail(work, f"{path} exists already (save with overwrite=True to replace it)")
            return
        info = self.state.models[work.model_id]
        lora = {k: getattr(info, k) for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed")}
        tree = {
            "format": STATE_FORMAT,
            "model_id": work.model_id,
            "lora": {**lora, "alpha": self.lora_alpha},
            "adapter": self.engine.model.tenant_tensors(t.name),
            "optimizer": t.optimizer.state_dict(gather=self.engine.model.io.gather),
            "step": t.step,
        }

        def peft_folder(tmp: Path) -> None:
            self.engine.save_adapter(t.name, tmp / "adapter")

        try:
            write_state_dir(folder, t.step, tree, beside=peft_folder)
        except checkpoint.WRITE_ERRORS as e:
            self._fail(work, f"could not save {path}: {e}", ErrorCategory.SERVER)
            return
        self.state.futures.settle(work.request_id, Result(json={"path": path, "type": "save_weights"}))

    def _read_state(self, work: Work) -> dict[str, Any] | None:
        folder = self._folder(work.body.path)
        try:
            if folder is None or not folder.exists():
                raise CheckpointError(f"no saved state {work.body.path} on this server")
            state = read_checkpoint(folder)
            if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
                raise CheckpointError(f"{work.body.path} is not a saved state of this service")
        except CheckpointError as e:
            self._fail(work, str(e))
            return None
        return state

    def _load_state(self, work: Work, t: TenantRun) -> None:
        """``load_state``: the saved weights (and, asked, the AdamW state; else a fresh one) into ``t``."""
        state = self._read_state(work)
        if state is None:
            return
        mine = self.engine.model.tenant_tensors(t.name)
        theirs = state["adapter"]
        if set(mine) != set(theirs) or any(mine[k][0].shape != theirs[k][0].shape for k in mine):
            self._fail(work, f"{work.body.path} has another LoRA shape (rank or layers) than this model")
            return
        self._restore(t, state, work.body.optimizer)
        answer = {"path": work.body.path, "type": "load_weights"}
        self.state.futures.settle(work.request_id, Result(json=answer))

    def _create_from_state(self, work: Work) -> None:
        """``create_training_client_from_state``: a new model with the saved LoRA settings, then the load."""
        state = self._read_state(work)
        if state is None:
            return
        lora = state["lora"]
        info = ModelInfo(work.model_id, work.body.owner, self.state.base_model, int(lora["rank"]), lora["seed"],
                         bool(lora["train_attn"]), bool(lora["train_mlp"]), bool(lora["train_unembed"]))  # fmt: skip
        t = self._create(work, info)
        if t is None:
            return
        self._restore(t, state, work.body.optimizer)
        answer = {"path": work.body.path, "type": "load_weights", "model_id": work.model_id}
        self.state.futures.settle(work.request_id, Result(json=answer))

    def _restore(self, t: TenantRun, state: dict[str, Any], optimizer: bool) -> None:
        self.engine.model.set_tenant_tensors(t.name, state["adapter"])
        t.optimizer.zero_grad()
        if optimizer:
            t.optimizer.load_state_dict(state["optimizer"], scatter=self.engine.model.io.scatter)
        else:
            t.optimizer.optimizer.state.clear()  # AdamW starts again: no moments, step 0

    # -- sampling ----------------------------------------------------------------------------------
    def _snapshot(self, work: Work, t: TenantRun) -> None:
        """Copy ``t``'s adapter, as it is now, into a slot of its own, named by the request."""
        save = work.body
        key = save.sampling_session_id or f"tinker://{work.model_id}/sampler_weights/{save.name}"
        if key in self.snapshots and not save.overwrite:
            self._fail(work, f"{key} exists already (save with overwrite=True to replace it)")
            return
        model = self.engine.model
        adapter = model.tenants[t.name]
        snap = f"{t.name}.s{next(self._snapshot_ids)}"
        try:
            if len(model.tenants) >= self.spec.max_tenants:
                raise ValueError(f"no free slot for a sampler snapshot: all max_tenants={self.spec.max_tenants} "
                                 "slots hold training clients or snapshots")  # fmt: skip
            model.add_tenant(snap, rank=adapter.rank, alpha=adapter.alpha, target_modules=adapter.modules,
                             use_rslora=adapter.use_rslora, init=model.tenant_tensors(t.name))  # fmt: skip
        except ValueError as e:
            self._fail(work, str(e))
            return
        if key in self.snapshots:  # overwritten: the old copy's slot is freed
            model.remove_tenant(self.snapshots[key])
        self.snapshots[key] = snap
        folder = self._folder(key) if save.name else None
        if folder is not None:  # a named snapshot is also a PEFT adapter directory (svc.local_path)
            try:
                self.engine.save_adapter(snap, folder)
            except checkpoint.WRITE_ERRORS as e:
                self._fail(work, f"could not save {key}: {e}", ErrorCategory.SERVER)
                return
        if save.sampling_session_id:
            answer = {"sampling_session_id": save.sampling_session_id, "type": "save_weights_for_sampler"}
        else:
            answer = {"path": key, "type": "save_weights_for_sampler"}
        self.state.futures.settle(work.request_id, Result(json=answer))

    def _sample(self, works: list[Work]) -> None:
        """Every waiting sample request in one batched generation; each future gets its sequences."""
        requests, taken = [], []
        eos = default_stop_ids(self.engine.model, self.engine.tokenizer)
        for work in works:
            s = work.body
            source = s.sampling_session_id if s.sampling_session_id in self.snapshots else s.model_path
            if source is not None and source not in self.snapshots:
                self._fail(work, f"no sampler snapshot {source!r} on this server")
                continue
            ids = list(s.stop_token_ids)
            # ``stop`` absent: the model's end-of-sequence; ``stop: []``: nothing stops a sample but its
            # length; stop strings or ids: those and the end-of-sequence
            stops = ids + eos if (s.stop_at_eos or s.stop_strings or ids) else []
            requests.append(
                SampleRequest(
                    prompt=s.prompt,
                    tenant=None if source is None else self.snapshots[source],
                    num_samples=s.num_samples,
                    max_new_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=None if s.top_k < 1 else s.top_k,
                    stop_token_ids=tuple(dict.fromkeys(stops)),
                    stop_strings=tuple(s.stop_strings),
                    seed=s.seed,
                    prompt_logprobs=s.prompt_logprobs,
                )
            )
            taken.append(work)
        if not requests:
            return
        try:
            done = sample(self.engine.model, requests, tokenizer=self.engine.tokenizer)
        except ValueError as e:  # (checked by the HTTP side already; a request it let through fails alone)
            for work in taken:
                self._fail(work, f"sampling failed: {e}")
            return
        for i, work in enumerate(taken):
            mine = [c for c in done if c.request == i]
            sequences = [wire.Sampled(c.tokens, c.logprobs, stopped=c.stop_reason != "length") for c in mine]
            prompt = mine[0].prompt_logprobs if requests[i].prompt_logprobs else None
            self.state.futures.settle(work.request_id, Result(proto=wire.sample_response(sequences, prompt)))

    def _set_adam(self, t: TenantRun, params: Any) -> None:
        """The request's AdamParams on the tenant's AdamW for the coming step (the schedule is constant)."""
        p = _params(params)
        opt = t.optimizer
        opt.set_hyperparameters(lr=p["learning_rate"], weight_decay=p["weight_decay"])
        group = opt.optimizer.param_groups[0]
        group["betas"], group["eps"] = (p["beta1"], p["beta2"]), p["eps"]
        opt.max_grad_norm = p["grad_clip_norm"] if p["grad_clip_norm"] > 0 else None

    # -- the loss ----------------------------------------------------------------------------------
    def loss(self, t: TenantRun, token_loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each forward/backward request's Tinker loss from its rows (settling the request's future with
        its loss and per-datum logprobs); the tenant's loss is the sum of those that are not forward-only."""
        pending = self.step_work[t.name]
        total = token_loss.sum() * 0.0
        start = 0
        for work, lengths in pending.forwards:
            fb: wire.ForwardBackward = work.body
            rows, start = range(start, start + len(lengths)), start + len(lengths)
            per_datum, loss_sum, metrics = [], token_loss.new_zeros(()), {}
            for i, d, n in zip(rows, fb.data, lengths):
                lp = -token_loss[i, :n]
                value, m = losses.datum_loss(fb.loss_fn, lp, d.inputs, fb.config)
                loss_sum = loss_sum + value
                per_datum.append(lp.detach().float().cpu())
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
            metrics["loss:sum"] = float(loss_sum.detach())
            self.state.futures.settle(
                work.request_id, Result(proto=wire.forward_backward_output(per_datum, metrics))
            )
            if not fb.forward_only:
                total = total + loss_sum
                t.feed.window_tokens += sum(lengths)
                t.feed.window_requests += 1
        return total

    # -- after its optimiser step --------------------------------------------------------------------
    def stepped(self, t: TenantRun, result: StepResult) -> None:
        work = self.waiting_optim.pop(t.name, None)
        if work is not None:
            metrics = {"grad_norm:max": result.grad_norm, "learning_rate:max": result.lr}
            self.state.futures.settle(work.request_id, Result(json={"metrics": metrics}))
        f: ServiceFeed = t.feed
        self.recorder.log(TrainRow(step=self.recorder.step, tenant=t.name, tenant_step=t.step, loss=result.loss,
                                   tokens=f.window_tokens, lr=result.lr, grad_norm=result.grad_norm))  # fmt: skip
        f.reset()

    def _settle_failed(self) -> None:
        """Requests of tenants the last step quarantined fail with the tenant's reason."""
        for name, work in list(self.waiting_optim.items()):
            t = self.pool.tenants.get(name)
            if t is None or t.state is TenantState.FAILED:
                del self.waiting_optim[name]
                why = t.reason if t is not None else "it is gone"
                self._fail(work, f"the model's step failed: {why}", ErrorCategory.USER)

    def _fail(self, work: Work, why: str, category: ErrorCategory = ErrorCategory.USER) -> None:
        self.state.futures.settle(work.request_id, Result(error=why, category=category))


def _row(d: wire.Datum) -> Example:
    """A datum as a row of the step: ``x`` and one more position, labels ``[-, y_0, …, y_{N-1}]`` (the
    extra input token is never predicted from; its logits are not used)."""
    targets = d.inputs["target_tokens"].reshape(-1).tolist()
    return Example([*d.tokens, targets[-1]], [IGNORE_INDEX, *targets])


def _params(params: Any) -> Mapping[str, float]:
    keys = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    if isinstance(params, Mapping):
        return {k: float(params[k]) for k in keys}
    return {k: float(getattr(params, k)) for k in keys}
