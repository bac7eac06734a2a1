"""Per-tenant optimisation: ``torch.optim.AdamW``, a warmup schedule and clipping by the tenant's own norm.

Each tenant's matrices are views into shared slot tensors (``lora_A[slot, :r]``, ...), which are not
leaf tensors an optimiser could own. A :class:`TenantOptimizer` therefore keeps one stand-in
``nn.Parameter`` per matrix and, right before each step, points its ``.data`` and ``.grad`` at the
current views. ``torch.optim.AdamW`` then updates the slots in place with its exact semantics, and its
state (``exp_avg``, ``exp_avg_sq``, ``step``) has the tenant's own shapes, so ``state_dict()`` is the
same whatever ``max_rank`` or sharding the job uses. Rebinding every step (rather than once) keeps
it valid when a wrapper such as FSDP replaces the slot storage.

The trainer steps every tenant at once (:func:`step_many`). A tenant whose tensors tile one buffer (a dense
tenant's, as the model makes them) is one tensor there: its flat weights, its gradient gathered into one
buffer, AdamW's moments over the same layout (each tensor's state entry views its part) and one step count,
so the multi-tensor calls of a step run over as many tensors as there are tenants. That gradient buffer is the
tenant's row of an arena shared by the tenants of its layout (:mod:`mlora_lab.lora.homes`), which the grouped
backward writes a layer's tenants' gradients into by one copy.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from torch import nn

from mlora_lab.lora import homes

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}

Gather = Callable[[torch.Tensor, tuple, torch.Tensor], torch.Tensor]
Scatter = Callable[[torch.Tensor, tuple, torch.Tensor], torch.Tensor]


def _per_element(v: object) -> bool:
    return torch.is_tensor(v) and v.ndim > 0


def _local(param: torch.Tensor) -> torch.Tensor:
    return param


@dataclass
class _FlatMoments:
    """AdamW's state of a tenant stepped as one flat tensor: its moments over the tenant's flat buffer
    and one step count. Every tensor's own state entry views them (its ``exp_avg`` a slice of
    ``exp_avg``, its ``step`` this ``step``), so ``state_dict()`` is per tensor as always."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor


def tiling(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view ``[n]`` of ``tensors`` when they tile one buffer: contiguous, of one floating dtype
    and device, each starting where the one before it ends; ``None`` otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    try:
        storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
        for t in tensors:
            if (
                t.dtype != first.dtype
                or t.device != first.device
                or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage
                or t.storage_offset() != offset
            ):
                return None
            offset += t.numel()
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: meta, a DTensor, a fake)
        return None
    if not first.is_floating_point() or storage == 0:
        return None
    return first.detach().as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def _views(state: dict | None, moments: _FlatMoments) -> bool:
    """Whether a tensor's AdamW ``state`` is its part of ``moments``."""
    if not state or state.get("step") is not moments.step:
        return False
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    return (
        m is not None
        and v is not None
        and m.untyped_storage().data_ptr() == moments.exp_avg.untyped_storage().data_ptr()
        and v.untyped_storage().data_ptr() == moments.exp_avg_sq.untyped_storage().data_ptr()
    )


Item = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""What :func:`step_many` updates: ``(weight, gradient, exp_avg, exp_avg_sq, step)``."""


class TenantOptimizer:
    """AdamW + schedule + clipping for one tenant; ``step()`` applies one optimiser step."""

    def __init__(
        self,
        slices: Iterable[tuple[nn.Parameter, tuple]],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        schedule: str = "constant",
        warmup_steps: int = 0,
        max_steps: int = 1,
        max_grad_norm: float | None = None,
        local: Callable[[torch.Tensor], torch.Tensor] = _local,
        copies: Callable[[torch.Tensor], int] = lambda param: 1,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; known: {sorted(SCHEDULES)}")
        self.slices = list(slices)
        self.local, self.copies = local, copies
        self.params = [nn.Parameter(self._view(p, idx)) for p, idx in self.slices]
        # fused=True: one pass per tensor, the optimiser transformers' Trainer uses by default
        # ("adamw_torch_fused"), and what step_many runs (bit for bit) for every contiguous tensor.
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            foreach=False,
            fused=all(fusable(p) for p in self.params) or None,
        )
        self.scheduler = transformers.get_scheduler(
            SCHEDULES[schedule], self.optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps
        )
        self.max_grad_norm = max_grad_norm
        # A tenant whose tensors tile one buffer (the model makes them so: TensorIO.new_many) is stepped as
        # one tensor: see step_many. ``_flat`` is that buffer, ``_moments`` AdamW's state over it (made at
        # its first such step), ``_grad`` its gradient gathered for this step (sq_norms, then step_many).
        self._whole = all(index == () for _, index in self.slices)
        self._bound = False  # (whether bind() gave the stand-ins gradients)
        self._flat = self._tiling()
        self._moments: _FlatMoments | None = None
        self._grad: torch.Tensor | None = None
        self._homes: list[homes.Home] | None = None  # (its gradient's row: flat_grad)
        self._home_views: tuple[int, list[torch.Tensor]] = (-1, [])  # (homes.epoch(), each home's view)
        self._tensors = [p for p, _ in self.slices]

    def _tiling(self) -> torch.Tensor | None:
        """One flat view of the tenant's weights when they tile one buffer, in order, whole, each held by
        this process alone; ``None`` otherwise (a parallel layout, packed experts, strided views)."""
        if not self.slices or any(index != () or self.copies(p) != 1 for p, index in self.slices):
            return None
        return tiling([self.local(p.data) for p, _ in self.slices])

    def _view(self, param: torch.Tensor, index: tuple) -> torch.Tensor:
        return self.local(param.data)[index]

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def set_hyperparameters(
        self, lr: float | None = None, weight_decay: float | None = None, max_grad_norm: float | None = None
    ) -> None:
        """Change settings while training (PBT's explore): a new base ``lr`` keeps the schedule's
        position (the next step uses ``lr × schedule(step)``); ``weight_decay`` and ``max_grad_norm``
        apply from the next step."""
        group = self.optimizer.param_groups[0]
        if lr is not None:
            self.scheduler.base_lrs = [lr]
            group["initial_lr"] = lr
            group["lr"] = lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
        if max_grad_norm is not None:
            self.max_grad_norm = max_grad_norm

    def parts(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
        """``(stand-in, weight, gradient)`` of each tensor with a gradient, this process's part of the
        current slot storage, without rebinding the stand-ins (which only key AdamW's state here). A
        whole tensor (the usual case) is used as it is: no per-tensor op, which is what lets
        :func:`step_many` and :func:`sq_norms` run a fixed number of ops for any number of tenants."""
        out = []
        with torch.no_grad():
            for handle, (param, index) in zip(self.params, self.slices):
                if param.grad is None:
                    continue
                weight, grad = self.local(param), self.local(param.grad)
                if index != ():
                    weight, grad = weight[index], grad[index]
                out.append((handle, weight, grad))
        return out

    def bind(self) -> None:
        """Point the stand-in parameters and their gradients at the current slot storage."""
        for handle, (param, index) in zip(self.params, self.slices):
            handle.data = self._view(param, index)
            handle.grad = None if param.grad is None else self.local(param.grad)[index]
        self._bound = True

    @property
    def flat(self) -> bool:
        """Whether the tenant's last step took it as one tensor (see :func:`step_many`)."""
        return self._moments is not None

    def flat_grad(self) -> torch.Tensor | None:
        """The tenant's gradient as one flat tensor laid out as its flat weights (:func:`sq_norms` reads it,
        :func:`step_many` steps with it): its row of the gradient arena of its layout
        (:mod:`mlora_lab.lora.homes`), where the grouped backward has usually written it already, else
        gathered there by one multi-tensor copy; ``None`` unless its weights tile one buffer and every one
        of its tensors has a gradient. The row is taken at the first call and given back by
        :meth:`release` (or when the optimiser is gone)."""
        if self._flat is None:
            return None
        if self._flat.data_ptr() != self.slices[0][0].data_ptr():
            self._follow()
        if self._grad is None:
            found = self._homes
            if found is not None and self._home_views[0] != homes.epoch():  # (the homes moved)
                self._home_views = (homes.epoch(), [h.view for h in found])
            # (the usual case, checked first: the backward wrote every gradient into its home)
            if found is None or not all(
                map(operator.is_, map(homes.GRAD, self._tensors), self._home_views[1])
            ):
                grads = [p.grad for p in self._tensors]
                if any(g is None for g in grads):
                    return None
                if found is None:  # its row of the arena of its layout (mlora_lab.lora.homes)
                    found = self._homes = homes.join([p for p, _ in self.slices])
                    weakref.finalize(self, found[0].arena.leave, found)
                with torch.no_grad():  # one multi-tensor copy, whatever the tensors' count
                    torch._foreach_copy_([h.view for h in found], grads)
            self._grad = found[0].arena.row(found[0].row)
        return self._grad

    def _follow(self) -> None:
        """View the tenant's weights where they are now: they moved, the same tensors in a new buffer
        (their arena grew: :class:`mlora_lab.lora.homes.Weights`). The stand-ins follow too, so that
        nothing keeps the old buffer."""
        self._flat = self._tiling()
        for handle, (param, index) in zip(self.params, self.slices):
            handle.data = self._view(param, index)

    def _flat_moments(self) -> _FlatMoments | None:
        """AdamW's state over the flat buffer: made at the first step, or remade from the per-tensor state
        (after a load, or a step taken tensor by tensor) when that state no longer views it. ``None`` when
        the tensors' step counts differ (a tensor that once had no gradient: they step one by one)."""
        state, moments = self.optimizer.state, self._moments
        first, last = state.get(self.params[0]), state.get(self.params[-1])
        if moments is not None and _views(first, moments) and _views(last, moments):
            return moments
        flat = self._flat
        states = [state.get(h) for h in self.params]
        with torch.no_grad():
            if not any(states):
                m, v = torch.zeros_like(flat), torch.zeros_like(flat)
                step = torch.tensor(0.0, dtype=torch.float32, device=flat.device)
            elif all(states):
                counts = torch.stack([s["step"].detach().float().cpu() for s in states])
                if not bool((counts == counts[0]).all()):
                    return None
                m = torch.cat([s["exp_avg"].reshape(-1) for s in states]).to(flat)
                v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]).to(flat)
                step = counts[0].clone().to(flat.device)
            else:
                return None
        offset = 0
        for handle in self.params:
            n = handle.numel()
            state[handle] = {
                "step": step,
                "exp_avg": m[offset : offset + n].view(handle.shape),
                "exp_avg_sq": v[offset : offset + n].view(handle.shape),
            }
            offset += n
        self._moments = _FlatMoments(m, v, step)
        return self._moments

    def _unflatten(self) -> None:
        """Give every tensor its own step count again (a step taken tensor by tensor advances each
        tensor's own); the moments stay where they are."""
        if self._moments is None:
            return
        step = self._moments.step
        for handle in self.params:
            state = self.optimizer.state.get(handle)
            if state and state.get("step") is step:
                state["step"] = step.clone()
        self._moments = None

    def _items(self) -> list[Item]:
        """What :func:`step_many` updates for this tenant: its flat buffer as one tensor when it can
        (:meth:`flat_grad`, :meth:`_flat_moments`), else each of its tensors with a gradient."""
        grad = self.flat_grad()
        if grad is not None:
            moments = self._flat_moments()
            if moments is not None:
                return [(self._flat, grad, moments.exp_avg, moments.exp_avg_sq, moments.step)]
        self._unflatten()
        out = []
        for handle, weight, grad in self.parts():
            state = self._adamw_state(handle)
            if state["step"].device != weight.device and fusable(weight):  # (a state saved by a CPU step)
                state["step"] = state["step"].to(weight.device)
            out.append((weight, grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
        return out

    def local_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this process's part of the tenant's gradient, each part divided by how
        many processes hold it (call after ``bind``). The clipping norm is ``sqrt`` of its sum over
        all processes."""
        parts = [
            h.grad.double().square().sum() / self.copies(param)
            for h, (param, _) in zip(self.params, self.slices)
            if h.grad is not None
        ]
        return sum(parts).cpu() if parts else torch.zeros((), dtype=torch.float64)

    def step(self, grad_norm: torch.Tensor | float | None = None, rebind: bool = True) -> torch.Tensor:
        """Clip by the tenant's own norm (if enabled), step AdamW and the schedule; return the norm.

        ``grad_norm`` is the norm of the tenant's whole gradient; when omitted it is computed from
        this process's gradients (right for unsharded slots). ``rebind=False`` when the caller has
        just called :meth:`bind` (to compute the norm) and nothing changed the storage since.
        """
        self._unflatten()  # (torch's AdamW steps each tensor's own count)
        self._grad = None
        if rebind:
            self.bind()
        norm = torch.as_tensor(grad_norm if grad_norm is not None else self.local_sq_norm().sqrt()).float()
        if self.max_grad_norm is not None:
            # Same rule as torch.nn.utils.clip_grad_norm_: scale by min(1, max / (norm + 1e-6)).
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.device))
        self.optimizer.step()
        self.scheduler.step()
        return norm

    def _adamw_state(self, handle: torch.Tensor) -> dict:
        """``torch.optim.AdamW``'s state for ``handle``, created as its first step creates it."""
        state = self.optimizer.state[handle]
        if not state:  # (the fused kernel reads its step count where the tensor is, as torch keeps it)
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=handle.device)
            state["exp_avg"] = torch.zeros_like(handle, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(handle, memory_format=torch.preserve_format)
        return state

    def zero_grad(self) -> None:
        """Release this tenant's gradients (its tensors are its own: nothing else is touched)."""
        if self._whole:  # (the usual case, and a loop over every tensor of every tenant each step)
            for param in self._tensors:
                param.grad = None
        else:
            for param, index in self.slices:
                if param.grad is None:
                    continue
                if index == ():
                    param.grad = None
                else:  # a view into a tensor shared with others: zero just this part
                    self.local(param.grad)[index].zero_()
        if self._bound:  # (only bind() gives the stand-ins gradients)
            for handle in self.params:
                handle.grad = None
            self._bound = False
        self._grad = None

    def release(self) -> None:
        """:meth:`zero_grad`, and the buffer its flat gradient is gathered in: the tenant stops training
        (finished, failed, removed)."""
        self.zero_grad()
        if self._homes is not None:
            self._homes[0].arena.leave(self._homes)
            self._homes = None

    def state_dict(self, gather: Gather | None = None) -> dict:
        """Optimiser and schedule state. With ``gather(param, index, local_part) -> full`` every
        per-element state tensor is stored full (the same whatever the sharding)."""
        state = self.optimizer.state_dict()
        if gather is not None:
            state["state"] = {
                i: {k: gather(*self.slices[i], v) if _per_element(v) else v for k, v in s.items()}
                for i, s in state["state"].items()
            }
        return {"optimizer": state, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict, scatter: Scatter | None = None) -> None:
        """Inverse of :meth:`state_dict`; ``scatter(param, index, full) -> local_part``."""
        self.bind()
        opt = dict(state["optimizer"])
        if scatter is not None:
            opt["state"] = {
                int(i): {k: scatter(*self.slices[int(i)], v) if _per_element(v) else v for k, v in s.items()}
                for i, s in opt["state"].items()
            }
        self.optimizer.load_state_dict(opt)
        self.scheduler.load_state_dict(state["scheduler"])
        self._moments = None  # (the next step copies the loaded moments into a flat buffer again)

    def state_bytes(self) -> int:
        """Bytes of the optimiser state (AdamW's two moments) held for this tenant."""
        return sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.ndim > 0
        )


MAX_WEIGHT = 1e4
"""An adapter whose weights reach this size (in absolute value) has diverged. PEFT initialises ``A`` within
``±1/sqrt(in_features)`` and ``B`` at 0, and AdamW moves an element by about ``lr`` per step, so at any lr
the validator accepts (at most 10) a weight of 1e4 means a thousand steps and more in one direction: the
tenant's delta ``s·B·A`` is then far beyond anything its base layer computes, and in a bf16/fp16 base it
overflows (fp16 ends at 65504)."""


def sq_norms(optimizers: Sequence[TenantOptimizer]) -> torch.Tensor:
    """Each optimiser's :meth:`TenantOptimizer.local_sq_norm` (float64 [n], on the CPU), for all of them
    in one multi-tensor norm and one segment sum: ``Σ_i ||g_i||² / copies_i`` over the tenant's tensors.
    A tenant whose tensors tile one buffer counts as one tensor, its :meth:`~TenantOptimizer.flat_grad`
    (the same sum, rounded once over the whole gradient rather than tensor by tensor)."""
    grads: list[torch.Tensor] = []
    owner: list[int] = []
    weight: list[float] = []
    for k, opt in enumerate(optimizers):
        flat = opt.flat_grad()
        if flat is not None:
            grads.append(flat)
            owner.append(k)
            weight.append(1.0)
            continue
        for param, index in opt.slices:
            if param.grad is None:
                continue
            grad = opt.local(param.grad)
            grads.append(grad if index == () else grad[index])
            owner.append(k)
            weight.append(1.0 / opt.copies(param))
    out = torch.zeros(len(optimizers), dtype=torch.float64)
    if not grads:
        return out
    device = grads[0].device
    # (each tensor's norm in its own dtype, as clip_grad_norm_ takes them; their squares summed in float64)
    norms = torch.stack(torch._foreach_norm(grads, 2)).double()
    parts = norms.square_().mul_(torch.tensor(weight, dtype=torch.float64).to(device))
    return out.to(device).index_add_(0, torch.tensor(owner).to(device), parts).cpu()


def step_many(steps: Sequence[tuple[TenantOptimizer, float]]) -> dict[int, str]:
    """One optimiser step for several tenants at once: ``steps[i] = (optimizer, grad_norm)``, with the
    norm of the tenant's whole gradient.

    The same per-element maths as calling each :meth:`TenantOptimizer.step` (clipping, then
    ``torch.optim.AdamW``'s update, then the schedule) — each tenant keeps its own lr, betas, eps,
    weight decay and step count — but done by a few calls over every tenant instead of a loop per
    tenant and tensor:

    - a tenant whose tensors tile one buffer (the model makes every dense tenant's so) is **one** tensor
      here: its weights' flat view, its gradient gathered into one (:meth:`~TenantOptimizer.flat_grad`),
      AdamW's moments over the same layout and one step count (which every tensor's own state entry
      views, so state dicts and checkpoints are per tensor as always). 64 tenants of 84 matrices are 64
      tensors, not 5,376: on a CPU every multi-tensor call is a loop over its tensors. The update is
      element for element the one below; the fused kernel's vectorised and scalar parts round the second
      moment differently in the last bit, so against stepping the same tensors one by one it agrees to
      about 1e-7 relative, not bit for bit;
    - other contiguous tensors go through ``torch._fused_adamw_`` tensor by tensor, one call per
      distinct ``(lr, wd, β1, β2, eps)``, one pass over each tensor: bit for bit
      ``torch.optim.AdamW(fused=True)``, which transformers' Trainer uses by default
      (``adamw_torch_fused``);
    - strided views go through multi-tensor (``foreach``) calls with per-tensor scalars, bit for bit
      the single-tensor AdamW.

    The step counts are read in one op and the divergence check is one host read.

        p  ← p (1 - lr wd);  m ← lerp(m, g, 1 - β1);  v ← β2 v + (1 - β2) g²;  k ← k + 1
        p  ← p - lr / (1 - β1^k) · m / (sqrt(v) / sqrt(1 - β2^k) + eps)

    Returns ``{i: why}`` for the tenants that must be quarantined, ``why`` completing "its optimiser step
    ...". A step that cannot be set up, or whose scalars (``1 - lr·wd``, the step size ``lr / (1 - β1^k)``,
    ``eps``, ...) do not fit the weights' dtype (``lr=1e38`` overflows float32: one such scalar in the
    multi-tensor calls would raise for every tenant), is not taken: nothing of that tenant changes, and
    the others step. A step after which the tenant's weights are not finite or larger than
    :data:`MAX_WEIGHT` (this process's part of them: with sharded slots the caller agrees over the
    processes) was taken, and is reported as diverged.
    """
    errors: dict[int, str] = {}
    prepared = []  # (i, opt, items, lr, wd, β1, β2, eps, clipping factor or None)
    try:
        for i, (opt, grad_norm) in enumerate(steps):
            try:
                group = opt.optimizer.param_groups[0]
                lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
                beta1, beta2 = (float(b) for b in group["betas"])
                items = opt._items()
                coef = None
                if opt.max_grad_norm is not None and items:
                    coef = clip_factor(opt.max_grad_norm, float(grad_norm))
            except Exception as e:
                errors[i] = f"raised {type(e).__name__}: {e}"
                continue
            prepared.append((i, opt, items, lr, wd, beta1, beta2, eps, coef))
        _step_prepared(prepared, errors)
    finally:
        for opt, _ in steps:
            opt._grad = None  # (this step's gathered gradient)
    return errors


def _step_prepared(prepared: list, errors: dict[int, str]) -> None:
    """The updates of :func:`step_many` for its prepared tenants (refused ones go into ``errors``)."""
    before = _read_counts([item[4] for p in prepared for item in p[2]])
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    stepped: list[torch.Tensor] = []
    owners: list[int] = []  # per tensor: its tenant's index in ``steps``
    scalars: list[tuple[float, float, float, float, float, float]] = []  # per tensor: lr, wd, β1, β2, eps, k
    clip_grads: list[torch.Tensor] = []
    clip_coefs: list[float] = []
    fused: dict[tuple, list[int]] = {}  # (device, dtype, lr, wd, β1, β2, eps) -> indices of fusable tensors
    rest: list[int] = []  # indices of the others (strided views)
    done = []
    n = 0
    for i, opt, items, lr, wd, beta1, beta2, eps, coef in prepared:
        ks = [k + 1 for k in before[n : n + len(items)]]  # the step each update counts as
        n += len(items)
        why = _overflow([w for w, *_ in items], ks, lr, wd, eps, beta1, beta2, 1.0 if coef is None else coef)
        if why is not None:
            errors[i] = why
            continue
        for (weight, grad, m, v, count), k in zip(items, ks):
            # (inline rather than fusable(): this loop runs for every tensor of a tenant stepped tensor by tensor)
            if (
                weight.device.type in _FUSED_DEVICES
                and weight.dtype.is_floating_point
                and weight.is_contiguous()
                and grad.is_contiguous()
                and m.is_contiguous()
                and v.is_contiguous()
                and count.device == weight.device
            ):
                fused.setdefault((weight.device, weight.dtype, lr, wd, beta1, beta2, eps), []).append(
                    len(params)
                )
            else:
                rest.append(len(params))
            params.append(weight)
            grads.append(grad)
            exp_avgs.append(m)
            exp_avg_sqs.append(v)
            stepped.append(count)
            owners.append(i)
            scalars.append((lr, wd, beta1, beta2, eps, k))
            if coef is not None and coef != 1.0:  # (a factor of exactly 1 changes nothing: skipped)
                clip_grads.append(grad)
                clip_coefs.append(coef)
        done.append(opt)
    with torch.no_grad():
        if clip_grads:
            torch._foreach_mul_(clip_grads, clip_coefs)
        if params:
            for (_, _, lr, wd, beta1, beta2, eps), js in fused.items():
                # torch.optim.AdamW(fused=True)'s own two calls, bit for bit
                steps_ = [stepped[j] for j in js]
                torch._foreach_add_(steps_, 1)
                torch._fused_adamw_(
                    *([t[j] for j in js] for t in (params, grads, exp_avgs, exp_avg_sqs)),
                    [],
                    steps_,
                    amsgrad=False,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=wd,
                    eps=eps,
                    maximize=False,
                )
            if rest:
                _foreach_adamw(
                    *([t[j] for j in rest] for t in (params, grads, exp_avgs, exp_avg_sqs, stepped)),
                    [scalars[j] for j in rest],
                )
            for i, values in _diverged(params, owners).items():
                finite = all(math.isfinite(v) for v in values)
                what = f"a weight of {max(values):.3g}" if finite else "non-finite weights"
                errors[i] = f"diverged: its adapter reached {what} (above {MAX_WEIGHT:g} it has diverged)"
    for opt in done:
        # the scheduler checks that its optimiser stepped (torch's wrapper would set this flag)
        opt.optimizer._opt_called = True
        opt.scheduler.step()


_FUSED_DEVICES = ("cpu", "cuda")


def fusable(t: torch.Tensor) -> bool:
    """Whether ``torch._fused_adamw_`` updates ``t`` correctly: a contiguous floating-point tensor on a
    device with the fused kernel (on the CPU it mis-updates strided views, measured)."""
    return t.is_contiguous() and t.is_floating_point() and t.device.type in _FUSED_DEVICES


def _read_counts(counts: list[torch.Tensor]) -> list[float]:
    """The values of AdamW's step counters in one host read per device (they live on the CPU, or on the
    weights' device for the fused kernel)."""
    by_device: dict[torch.device, list[int]] = {}
    for j, c in enumerate(counts):
        by_device.setdefault(c.device, []).append(j)
    out = [0.0] * len(counts)
    for js in by_device.values():
        for j, v in zip(js, torch.stack([counts[j] for j in js]).tolist()):
            out[j] = v
    return out


def _foreach_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    stepped: list[torch.Tensor],
    scalars: list[tuple[float, float, float, float, float, float]],
) -> None:
    """``torch.optim.AdamW``'s single-tensor update over tensors the fused kernel cannot take (strided
    views of shared slots), in multi-tensor calls with per-tensor scalars ``(lr, wd, β1, β2, eps, k)``."""
    torch._foreach_add_(stepped, 1)
    decayed = [(p, 1 - lr * wd) for p, (lr, wd, *_) in zip(params, scalars) if 1 - lr * wd != 1.0]
    if decayed:  # (no weight decay, the default: nothing to multiply)
        torch._foreach_mul_([p for p, _ in decayed], [f for _, f in decayed])
    torch._foreach_lerp_(exp_avgs, grads, [1 - b1 for _, _, b1, *_ in scalars])
    torch._foreach_mul_(exp_avg_sqs, [b2 for _, _, _, b2, _, _ in scalars])
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, [1 - b2 for _, _, _, b2, _, _ in scalars])
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - b2**k) ** 0.5 for _, _, _, b2, _, k in scalars])
    torch._foreach_add_(denom, [eps for *_, eps, _ in scalars])
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-(lr / (1 - b1**k)) for lr, _, b1, *_, k in scalars])


def _diverged(params: list[torch.Tensor], owners: list[int]) -> dict[int, list[float]]:
    """``{owner: largest |weight| of each tensor}`` for the owners with a tensor that is not finite or
    above :data:`MAX_WEIGHT`. ``max|w| <= ||w||_2``, so one multi-tensor L2 norm (2.6x faster than the
    max-norm on the CPU) clears every tensor at or below the bound (NaN and inf carry through it); only
    the rest get the exact max-norm."""
    l2 = torch.stack(torch._foreach_norm(params, 2)).tolist()
    suspects = [j for j, v in enumerate(l2) if not v <= MAX_WEIGHT * (1 - 1e-6)]  # (a margin for rounding)
    out: dict[int, list[float]] = {}
    if suspects:
        largest = torch.stack(torch._foreach_norm([params[j] for j in suspects], float("inf"))).tolist()
        for j, v in zip(suspects, largest):
            if not v <= MAX_WEIGHT:  # (NaN too)
                out.setdefault(owners[j], []).append(v)
    return out


def clip_factor(max_grad_norm: float, grad_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor ``min(1, max / (norm + 1e-6))``, in its float32
    arithmetic: the norm rounded to float32, as that function's total norm is, and ``max / t`` computed
    as torch computes a number divided by a tensor, ``t.reciprocal() * max``."""
    inverse = np.float32(1.0) / (np.float32(grad_norm) + np.float32(1e-6))
    return float(min(np.float32(1.0), inverse * np.float32(max_grad_norm)))


def _overflow(
    weights: list[torch.Tensor],
    ks: list[float],
    lr: float,
    wd: float,
    eps: float,
    beta1: float,
    beta2: float,
    coef: float,
) -> str | None:
    """Why this tenant's update would not be finite in its weights' dtype (None when it is): every
    scalar :func:`step_many` hands the multi-tensor calls must be a finite value of that dtype."""
    if not weights:
        return None
    top = min(torch.finfo(w.dtype).max for w in weights)
    dtype = str(weights[0].dtype).removeprefix("torch.")
    k = min(ks)  # the step this update counts as (the largest factors)
    bias1 = 1 - beta1**k
    bias2 = (1 - beta2**k) ** 0.5
    named = {
        "lr": lr,
        "1 - lr·weight_decay": 1 - lr * wd,
        "eps": eps,
        "the clipping factor": coef,
        "the step size lr/(1-β1^k)": lr / bias1 if bias1 else math.inf,
        "1/sqrt(1-β2^k)": 1 / bias2 if bias2 else math.inf,
    }
    for name, value in named.items():
        if not (math.isfinite(value) and abs(value) <= top):
            return (
                f"has a non-finite update: {name} = {value:.3g} at lr={lr:g}, weight_decay={wd:g} "
                f"(beyond {dtype}'s largest value {top:.3g})"
            )
    return None


def build_optimizer(slices: Iterable[tuple[nn.Parameter, tuple]], tenant, **kw) -> TenantOptimizer:
    """A :class:`TenantOptimizer` from a ``Tenant`` spec's fields."""
    return TenantOptimizer(
        slices,
        lr=tenant.lr,
        weight_decay=tenant.weight_decay,
        betas=tuple(tenant.betas),
        eps=tenant.eps,
        schedule=tenant.schedule,
        warmup_steps=tenant.warmup_steps,
        max_steps=tenant.max_steps,
        max_grad_norm=tenant.max_grad_norm,
        **kw,
    )
