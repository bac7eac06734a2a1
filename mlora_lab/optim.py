"""Per-tenant optimisation: ``torch.optim.AdamW``, a warmup schedule and clipping by the tenant's own norm.

Each tenant's matrices are views into shared slot tensors (``lora_A[slot, :r]``, ...), which are not
leaf tensors an optimiser could own. A :class:`TenantOptimizer` therefore keeps one stand-in
``nn.Parameter`` per matrix and, right before each step, points its ``.data`` and ``.grad`` at the
current views. ``torch.optim.AdamW`` then updates the slots in place with its exact semantics, and its
state (``exp_avg``, ``exp_avg_sq``, ``step``) has the tenant's own shapes, so ``state_dict()`` is the
same whatever ``max_rank`` or sharding the job uses. Rebinding every step (rather than once) keeps
it valid when a wrapper such as FSDP replaces the slot storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import transformers
from torch import nn

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}

Gather = Callable[[torch.Tensor, tuple, torch.Tensor], torch.Tensor]
Scatter = Callable[[torch.Tensor, tuple, torch.Tensor], torch.Tensor]


def _per_element(v: object) -> bool:
    return torch.is_tensor(v) and v.ndim > 0


def _local(param: torch.Tensor) -> torch.Tensor:
    return param


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
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=False
        )
        self.scheduler = transformers.get_scheduler(
            SCHEDULES[schedule], self.optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps
        )
        self.max_grad_norm = max_grad_norm

    def _view(self, param: torch.Tensor, index: tuple) -> torch.Tensor:
        return self.local(param.data)[index]

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def bind(self) -> None:
        """Point the stand-in parameters and their gradients at the current slot storage."""
        for handle, (param, index) in zip(self.params, self.slices):
            handle.data = self._view(param, index)
            handle.grad = None if param.grad is None else self.local(param.grad)[index]

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

    def zero_grad(self) -> None:
        """Zero this tenant's part of the shared slot gradients (other tenants may be mid-window)."""
        for param, index in self.slices:
            if param.grad is not None:
                self.local(param.grad)[index].zero_()
        for handle in self.params:
            handle.grad = None

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

    def state_bytes(self) -> int:
        """Bytes of the optimiser state (AdamW's two moments) held for this tenant."""
        return sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.ndim > 0
        )


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
