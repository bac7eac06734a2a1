"""``MultiLoRAModel``: a transformers causal LM with multi-tenant LoRA slots on its linear layers.

The in-process API, for people who write their own loop::

    base = AutoModelForCausalLM.from_pretrained(path)
    mm = MultiLoRAModel(base, max_tenants=8, max_rank=64, slot_modules="all-linear")
    mm.add_tenant("alice", rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    mm.load_adapter("bob", "path/to/peft_adapter")
    out = mm(input_ids, attention_mask=mask, tenants=["alice", "alice", "bob"])   # one name per row
    mm.save_adapter("alice", "out/alice")            # a PEFT adapter directory

Layers are wrapped once, at wrap time, on every linear layer named by ``slot_modules``; a tenant's
tensors (its own rank, on the layers it targets) are made when it is added and released when it is
removed, so memory grows with the tenants, not with ``max_tenants`` or ``max_rank``, and adding or
removing one never re-wraps the model. The wrapper holds no distributed logic: how a tenant's tensors
are split over processes is :class:`TensorIO`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig
from torch import nn

from mlora_lab.lora import homes
from mlora_lab.lora.experts import MultiLoRAExperts, from_peft, packed_experts_problem, to_peft
from mlora_lab.lora.layer import LoRARouting, MultiLoRALinear
from mlora_lab.lora.peft_io import AdapterError, read_adapter, write_adapter
from mlora_lab.lora.targets import (  # the targeting rules; re-exported here for existing imports
    ALL_LINEAR,
    has_all_linear,
    linear_module_names,
    match_targets,
    matches,
    name_matches,
    storable_targets,
    suffixes,
)


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / (rank**0.5) if use_rslora else alpha / rank


class TensorIO:
    """How the wrapper makes, reads and writes tenants' tensors.

    This default keeps every tensor whole on this process. :mod:`mlora_lab.parallel` installs a
    subclass that splits them as a parallel layout says (the opaque ``layout`` a layer carries), so
    the LoRA code itself never needs to know how a tensor is laid out:

    - ``new(layout, full)``: a leaf tensor (``requires_grad``) holding this process's part of ``full``;
    - ``new_many(parts)``: ``new`` for each ``(layout, full)`` of one tenant; this default makes them tile
      one flat buffer, which the tenant's optimiser then steps as one tensor
      (:func:`mlora_lab.optim.step_many`): a row of the buffer of the tenants of the same layout
      (:class:`mlora_lab.lora.homes.Weights`), so a layer's tenants' factors are one view, not a stack;
    - ``local(t)``: the storage this process holds for ``t`` (optimisers update it in place);
    - ``gather(param, index, local_part)``: the full value of ``param[index]`` from this process's
      part of it (a collective when split: every process must call it, in the same order);
    - ``scatter(param, index, full)``: this process's part of a full value of ``param[index]``;
    - ``copies(param)``: how many processes hold the same part of ``param``;
    - ``reduce_grads(params)``: sum the gradients of ``params`` over the processes that hold the same
      parts and saw other rows (a collective), leaving every copy with the whole gradient;
    - ``grad_sum(param)``: a copy of that sum for ``param`` alone, without changing its gradient;
    - ``first_copy(param)``: whether this process is the first of those that hold the same part.
    """

    def new(self, layout: object, full: torch.Tensor) -> torch.Tensor:
        return full.detach().clone().requires_grad_(True)

    def new_many(self, parts: Sequence[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
        fulls = [full for _, full in parts]
        if not fulls or len({(f.dtype, f.device) for f in fulls}) != 1:
            return [self.new(layout, full) for layout, full in parts]
        if not fulls[0].is_floating_point():
            return [self.new(layout, full) for layout, full in parts]
        return homes.weights(fulls)  # (a row of the buffer of the tenants of this layout)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, param: torch.Tensor, index: tuple, local_part: torch.Tensor) -> torch.Tensor:
        return local_part.detach().clone()

    def scatter(self, param: torch.Tensor, index: tuple, full: torch.Tensor) -> torch.Tensor:
        return full

    def copies(self, param: torch.Tensor) -> int:
        """How many processes hold the same part of ``param`` (to count each part once in sums)."""
        return 1

    reduces = False
    """Whether :meth:`reduce_grads` has anything to do (gradients held by more than this process)."""

    def reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        return None

    def grad_sum(self, param: torch.Tensor) -> torch.Tensor:
        grad = param.grad
        return torch.zeros_like(param.detach()) if grad is None else grad.detach().clone()

    def first_copy(self, param: torch.Tensor) -> bool:
        return True


@dataclass
class TenantAdapter:
    """One tenant's LoRA: where it lives (``slot``) and the hyper-parameters that define its maths."""

    name: str
    slot: int
    rank: int
    alpha: float
    use_rslora: bool
    dropout: float
    target_modules: list[str] | str
    modules: list[str]  # full names of the wrapped linear layers this tenant adapts
    target_parameters: list[str] = field(default_factory=list)
    parameters: list[str] = field(
        default_factory=list
    )  # full names of the packed expert parameters it adapts

    @property
    def scaling(self) -> float:
        return lora_scaling(self.rank, self.alpha, self.use_rslora)


def _expert_param_for_key(key: str, experts: dict, target_parameters: Sequence[str]) -> str | None:
    """The packed expert parameter (``<module>.<attr>``, a key of ``experts``' modules) that the PEFT
    adapter key ``key`` holds, or ``None``. PEFT nests one wrapper per targeted parameter of a module, the
    first-defined innermost: ``<module>(.base_layer)*d`` holds the parameter ``n - 1 - d`` of the ``n`` it
    targets there."""
    depth = 0
    while key.endswith(".base_layer"):
        key, depth = key[: -len(".base_layer")], depth + 1
    module = experts.get(key)
    if module is None:
        return None
    targeted = [a for a in module.param_names if matches(f"{key}.{a}", list(target_parameters))]
    if depth >= len(targeted):
        return None
    return f"{key}.{targeted[len(targeted) - 1 - depth]}"


class MultiLoRAModel(nn.Module):
    """Wrap a causal LM; ``forward`` takes ``tenants`` (one tenant name, or ``None``, per batch row)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_tenants: int = 8,
        max_rank: int = 64,
        slot_modules: str | Sequence[str] = ALL_LINEAR,
        slot_parameters: Sequence[str] = (),
        adapter_dtype: torch.dtype = torch.float32,
        wrap_experts: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.max_tenants, self.max_rank, self.adapter_dtype = max_tenants, max_rank, adapter_dtype
        self.routing = LoRARouting()
        all_linear = linear_module_names(model)
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        wrapped = match_targets(linear, slot_modules, all_linear)
        if not wrapped:
            raise ValueError(
                f"slot_modules={slot_modules!r} matches no linear layer; available: {suffixes(all_linear)}"
            )
        self.layers: dict[str, MultiLoRALinear] = {}
        for name in wrapped:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = MultiLoRALinear(
                getattr(parent, child), self.routing, max_tenants, max_rank, adapter_dtype
            )
            setattr(parent, child, layer)
            self.layers[name] = layer
        self._all_linear = [n for n in all_linear if n in self.layers]
        # Packed MoE expert parameters ([E, out, in]) get per-expert slots through their module;
        # with ``wrap_experts`` every packed-experts module is wrapped, slotted or not (expert
        # parallelism moves tokens inside the wrapper's grouped forward).
        self.experts: dict[str, MultiLoRAExperts] = {}
        self._expert_params: dict[str, tuple[str, str]] = {}  # full parameter name -> (module, attribute)
        by_module: dict[str, list[str]] = {}
        for pname, p in model.named_parameters():
            if p.ndim == 3 and matches(pname, list(slot_parameters)):
                module, _, attr = pname.rpartition(".")
                by_module.setdefault(module, []).append(attr)
        if slot_parameters and not by_module:
            raise ValueError(
                f"slot_parameters={list(slot_parameters)} match no 3-D (packed expert) parameter"
            )
        if wrap_experts:
            for module_name, module in model.named_modules():
                if packed_experts_problem(module) is None:
                    by_module.setdefault(module_name, [])
        for module, attrs in by_module.items():
            parent_name, _, child = module.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            try:
                wrapped = MultiLoRAExperts(
                    getattr(parent, child), self.routing, attrs, max_tenants, max_rank, adapter_dtype
                )
            except ValueError as e:
                raise ValueError(f"{module}: {e}") from None
            setattr(parent, child, wrapped)
            self.experts[module] = wrapped
            for attr in wrapped.param_names:
                self._expert_params[f"{module}.{attr}"] = (module, attr)
        self.expert_parameters = list(self._expert_params)  # full names of the slotted expert parameters
        self.tenants: dict[str, TenantAdapter] = {}
        self.io = TensorIO()

    # -- slot storage --------------------------------------------------------------------------
    def read(self, param: torch.Tensor, index: tuple) -> torch.Tensor:
        """Full value of ``param[index]`` (gathered if the slot tensors are sharded)."""
        return self.io.gather(param, index, self.io.local(param.detach())[index])

    @torch.no_grad()
    def write(self, param: torch.Tensor, index: tuple, full: torch.Tensor) -> None:
        """Set ``param[index]`` to the full value ``full`` (each process writes its own part)."""
        expected = torch.empty(param.shape, device="meta")[index].shape
        if tuple(full.shape) != tuple(expected):
            raise ValueError(f"value of shape {tuple(full.shape)} for a slot part of shape {tuple(expected)}")
        local = self.io.local(param.data)
        local[index].copy_(self.io.scatter(param, index, full.to(local.dtype)))

    def _make(self, layer: nn.Module, kind: str, full: torch.Tensor) -> torch.Tensor:
        """A new tenant tensor for ``layer`` (``kind`` "A" or "B"): this process's part of ``full``."""
        return self.io.new(layer.layouts[kind], self._full(layer, full))

    def _full(self, layer: nn.Module, full: torch.Tensor) -> torch.Tensor:
        """``full`` on ``layer``'s device in the adapters' dtype."""
        return full.to(device=layer.device, dtype=self.adapter_dtype)

    # -- tenants -------------------------------------------------------------------------------
    def resolve_parameters(self, target_parameters: Sequence[str]) -> list[str]:
        """Full names of the slotted expert parameters ``target_parameters`` selects (PEFT's rule)."""
        names = self.expert_parameters
        missing = [t for t in target_parameters if not any(name_matches(n, t) for n in names)]
        if missing:
            raise ValueError(
                f"target parameters {missing} have no adapter slots; slotted expert parameters: "
                f"{sorted({n.split('.', 3)[-1] for n in names}) or 'none'}"
            )
        return [n for n in names if matches(n, list(target_parameters))]

    def resolve_targets(self, target_modules: str | Sequence[str]) -> list[str]:
        """Full names of the wrapped layers ``target_modules`` selects; an error if it names others."""
        if not isinstance(target_modules, str) and not list(target_modules):
            return []
        names = list(self.layers)
        matched = match_targets(names, target_modules, self._all_linear)
        if isinstance(target_modules, str):
            missing = [] if matched else [target_modules]
        else:
            missing = [t for t in target_modules if t != ALL_LINEAR and not match_targets(names, [t], [])]
        if missing or not matched:
            raise ValueError(
                f"target modules {missing or list(target_modules)} have no adapter slots; slotted layers: "
                f"{suffixes(names)} (wrap with slot_modules covering every module a tenant may target)"
            )
        return matched

    def add_tenant(
        self,
        name: str,
        *,
        rank: int = 8,
        alpha: float = 16,
        target_modules: str | Sequence[str] = ("q_proj", "v_proj"),
        use_rslora: bool = False,
        dropout: float = 0.0,
        seed: int = 0,
        init: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        target_parameters: Sequence[str] = (),
    ) -> TenantAdapter:
        """Give a free slot to a new tenant.

        Without ``init`` the adapter starts as PEFT's default (A kaiming-uniform from a generator
        seeded with ``seed``, B = 0, so the tenant starts exactly at the base model); with
        ``init = {module_name: (A [rank, in], B [out, rank])}`` it starts from those tensors, which must
        cover exactly the targeted modules.
        """
        if name in self.tenants:
            raise ValueError(f"tenant {name!r} already exists")
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"tenant {name!r}: rank {rank} is outside 1..max_rank={self.max_rank}")
        modules = self.resolve_targets(target_modules)
        params = self.resolve_parameters(target_parameters)
        if not modules and not params:
            raise ValueError(f"tenant {name!r} targets nothing: give target_modules and/or target_parameters")
        targets = set(modules) | set(params)
        if init is not None and set(init) != targets:
            raise AdapterError(
                f"tenant {name!r}: adapter modules differ from its targets; only in adapter: "
                f"{sorted(set(init) - targets)[:5]}, only in targets: {sorted(targets - set(init))[:5]}"
            )
        slot = self._free_slot(name)
        tenant = TenantAdapter(
            name,
            slot,
            rank,
            alpha,
            use_rslora,
            dropout,
            _as_list(target_modules),
            modules,
            list(target_parameters),
            params,
        )
        # Every process draws the same full init from the same seed and keeps its own part of it,
        # so the logical adapter does not depend on how the slots are sharded.
        generator = torch.Generator().manual_seed(seed)
        try:
            dense = _dense_init(name, [(m, self.layers[m]) for m in modules], rank, init, generator)
            # the dense layers' tensors together (one buffer per tenant by default: TensorIO.new_many)
            made = self.io.new_many(
                [
                    (self.layers[module].layouts[kind], self._full(self.layers[module], t))
                    for module, A, B in dense
                    for kind, t in (("A", A), ("B", B))
                ]
            )
            for k, (module, _, _) in enumerate(dense):
                layer = self.layers[module]
                layer.set_slot(slot, made[2 * k], made[2 * k + 1], rank, tenant.scaling, dropout)
            for param in params:  # packed experts: per-expert A [E, r, in], B [E, out, r]
                module, attr = self._expert_params[param]
                experts = self.experts[module]
                E, out, inn = experts.shapes[attr]
                if init is not None:
                    A, B = init[param]
                    if tuple(A.shape) != (E, rank, inn) or tuple(B.shape) != (E, out, rank):
                        raise AdapterError(
                            f"tenant {name!r}: {param} needs A [{E}, {rank}, {inn}] and B [{E}, {out}, {rank}]"
                        )
                else:  # PEFT's ParamWrapper init: kaiming-uniform on lora_A [E*r, in], B = 0
                    A = torch.empty(E * rank, inn)
                    nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
                    A, B = A.reshape(E, rank, inn), torch.zeros(E, out, rank)
                experts.set_slot(
                    slot, attr, self._make(experts, "A", A), self._make(experts, "B", B), rank, tenant.scaling
                )
        except Exception:
            self._clear(slot)
            raise
        self.tenants[name] = tenant
        return tenant

    def _clear(self, slot: int) -> None:
        """Release every tensor of ``slot``."""
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for experts in self.experts.values():
            experts.clear_slot(slot)

    def load_adapter(self, name: str, path: str | Path, *, dropout: float | None = None) -> TenantAdapter:
        """Add tenant ``name`` from a PEFT LoRA adapter directory (rank, alpha, targets from its config)."""
        config, init = self.read_peft_adapter(path)
        ranks = {A.shape[-2] if k in self._expert_params else A.shape[0] for k, (A, _) in init.items()}
        if len(ranks) != 1:
            raise AdapterError(f"{path}: modules have different ranks {sorted(ranks)}")
        rank = ranks.pop()
        if rank > self.max_rank:
            raise AdapterError(f"{path}: adapter rank {rank} exceeds max_rank={self.max_rank}")
        targets = config.target_modules or []
        targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
        return self.add_tenant(
            name,
            rank=rank,
            alpha=config.lora_alpha,
            target_modules=targets,
            use_rslora=config.use_rslora,
            dropout=config.lora_dropout if dropout is None else dropout,
            init=init,
            target_parameters=sorted(config.target_parameters or []),
        )

    def read_peft_adapter(
        self, path: str | Path
    ) -> tuple[LoraConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """A PEFT adapter directory as ``(config, init)`` for :meth:`add_tenant`: linear modules as
        ``(A [r, in], B [out, r])``, packed expert parameters as ``(A [E, r, in], B [E, out, r])``."""
        config, tensors = read_adapter(path)
        target_parameters = sorted(config.target_parameters or [])
        init, unknown = {}, []
        for key, (A, B) in tensors.items():
            if key in self.layers:
                init[key] = (A, B)
                continue
            full = _expert_param_for_key(key, self.experts, target_parameters)
            if full is None:
                unknown.append(key)
            else:
                init[full] = from_peft(A, B, self.experts[self._expert_params[full][0]].num_experts)
        if unknown:
            raise AdapterError(f"{path}: adapter targets layers without slots: {sorted(unknown)[:5]}")
        return config, init

    def _peft_tensors(self, t: TenantAdapter, tensors: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Our layout → PEFT's keys and shapes (expert parameters nested as PEFT does)."""
        out = {m: tensors[m] for m in t.modules}
        for param in t.parameters:
            module, attr = self._expert_params[param]
            targeted = [a for a in self.experts[module].param_names if f"{module}.{a}" in t.parameters]
            depth = len(targeted) - 1 - targeted.index(attr)
            out[module + ".base_layer" * depth] = to_peft(*tensors[param])
        return out

    def remove_tenant(self, name: str) -> None:
        """Free the tenant's slot (zeroed, so it contributes nothing)."""
        self._clear(self._tenant(name).slot)
        del self.tenants[name]

    def tenant_slices(self, name: str) -> Iterator[tuple[torch.Tensor, tuple]]:
        """``(tensor, index)`` pairs such that ``tensor[index]`` is one of the tenant's LoRA matrices
        (``A_t`` [r, in] or ``B_t`` [out, r]; per expert [E, r, in] / [E, out, r]), in a fixed order: its
        optimiser's parameters. The tensors are the tenant's own (index ``()``)."""
        t = self._tenant(name)
        for module in t.modules:
            layer = self.layers[module]
            yield layer.lora_A[t.slot], ()
            yield layer.lora_B[t.slot], ()
        for param in t.parameters:
            module, attr = self._expert_params[param]
            experts = self.experts[module]
            yield experts.lora_A[attr][t.slot], ()
            yield experts.lora_B[attr][t.slot], ()

    def named_tenant_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``("<tenant>:<module>.lora_A", tensor)`` (and ``lora_B``) for every tensor of every tenant:
        this process's parts."""
        for name, t in self.tenants.items():
            keys = [f"{name}:{k}.lora_{ab}" for k in (*t.modules, *t.parameters) for ab in "AB"]
            for key, (p, _) in zip(keys, self.tenant_slices(name)):
                yield key, p

    def reduce_gradients(self, names: Sequence[str]) -> None:
        """Sum the tenants' fresh gradients over the processes that hold the same parts (a collective:
        every process calls it with the same names, in the same order)."""
        if self.io.reduces:  # (listing every tensor of every tenant costs ~2 ms a step at 64 tenants)
            self.io.reduce_grads([p for n in names for p, _ in self.tenant_slices(n)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, tenants' tensors included (they are not module parameters)."""
        super().zero_grad(set_to_none)
        for _, p in self.named_tenant_tensors():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def release_gradients(self, name: str) -> None:
        """Free the tenant's gradients (it has stepped, or stopped training)."""
        for p, _ in self.tenant_slices(name):
            p.grad = None

    def tenant_tensors(self, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{module_name: (A [r, in], B [out, r])}``: detached copies of the tenant's adapter."""
        t = self._tenant(name)
        pairs = list(self.tenant_slices(name))
        keys = t.modules + t.parameters
        return {k: (self.read(*pairs[2 * i]), self.read(*pairs[2 * i + 1])) for i, k in enumerate(keys)}

    def set_tenant_tensors(self, name: str, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Overwrite the tenant's adapter with full tensors in :meth:`tenant_tensors`' layout."""
        t = self._tenant(name)
        keys = t.modules + t.parameters
        if set(tensors) != set(keys):
            raise AdapterError(
                f"tenant {name!r}: tensors for {sorted(tensors)[:5]}, expected {sorted(keys)[:5]}"
            )
        pairs = list(self.tenant_slices(name))
        for i, k in enumerate(keys):
            self.write(*pairs[2 * i], tensors[k][0])
            self.write(*pairs[2 * i + 1], tensors[k][1])

    def peft_config(self, name: str, base_model_name_or_path: str | None = None) -> LoraConfig:
        """The ``peft.LoraConfig`` that describes tenant ``name`` exactly."""
        t = self._tenant(name)
        targets = t.target_modules
        if has_all_linear(targets):  # written out, as PEFT saves it: exactly the layers it was trained on
            targets = sorted(storable_targets(t.modules, (n for n, _ in self.model.named_modules())))
        return LoraConfig(
            target_parameters=list(t.target_parameters) or None,
            r=t.rank,
            lora_alpha=t.alpha,
            lora_dropout=t.dropout,
            use_rslora=t.use_rslora,
            target_modules=targets or [],
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_name_or_path,
        )

    def save_adapter(
        self,
        name: str,
        path: str | Path,
        base_model_name_or_path: str | None = None,
        tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        root: str | Path | None = None,
    ) -> Path:
        """Write tenant ``name`` as a PEFT adapter directory (atomically). ``tensors`` overrides the
        slot contents (the distributed job passes gathered full tensors); ``root``: see
        :func:`~mlora_lab.lora.peft_io.write_adapter`."""
        base = base_model_name_or_path or getattr(getattr(self.model, "config", None), "_name_or_path", None)
        config = self.peft_config(name, base)
        tensors = tensors if tensors is not None else self.tenant_tensors(name)
        return write_adapter(path, config, self._peft_tensors(self._tenant(name), tensors), root=root)

    def adapter_bytes(self, name: str) -> int:
        """Bytes of the tenant's own adapter tensors (its rank, not the slot's max_rank)."""
        t = self._tenant(name)
        size = torch.empty((), dtype=self.adapter_dtype).element_size()
        total = sum(t.rank * (self.layers[m].in_features + self.layers[m].out_features) for m in t.modules)
        for param in t.parameters:
            module, attr = self._expert_params[param]
            E, out, inn = self.experts[module].shapes[attr]
            total += E * t.rank * (inn + out)
        return total * size

    # -- forward -------------------------------------------------------------------------------
    def set_routing(self, tenants: Sequence[str | None] | None, num_rows: int) -> None:
        """Route batch rows to slots: ``tenants[i]`` is row i's tenant (``None``: base only)."""
        if tenants is None:
            self.routing.segments, self.routing.num_rows = None, num_rows
            return
        if len(tenants) != num_rows:
            raise ValueError(f"got {len(tenants)} tenant names for {num_rows} rows")
        segments: list[tuple[int, int, int]] = []
        for row, name in enumerate(tenants):
            if name is None:
                continue
            slot = self._tenant(name).slot
            if segments and segments[-1][0] == slot and segments[-1][2] == row:
                segments[-1] = (slot, segments[-1][1], row + 1)
            else:
                segments.append((slot, row, row + 1))
        self.routing.segments, self.routing.num_rows = segments, num_rows

    @contextlib.contextmanager
    def routed(self, segments: Sequence[tuple[int, int, int]], num_rows: int) -> Iterator[None]:
        """Within the block, the layers see ``num_rows`` rows routed by ``(slot, start, end)``
        ``segments``; the batch's routing is restored on exit (a loss chunk projects a few rows of one
        tenant while a checkpointed block may still recompute with the batch's routing)."""
        saved = self.routing.segments, self.routing.num_rows
        self.routing.segments, self.routing.num_rows = list(segments), num_rows
        try:
            yield
        finally:
            self.routing.segments, self.routing.num_rows = saved

    def set_segments(self, segments: Sequence[tuple[str, int, int]], num_rows: int) -> None:
        """Route contiguous runs ``(tenant, start_row, end_row)`` (what ``data.collate`` produces)."""
        self.routing.segments = [
            (self._tenant(n).slot, s, e) for n, s, e in segments if n is not None and e > s
        ]
        self.routing.num_rows = num_rows

    def forward(
        self, input_ids: torch.Tensor, tenants: Sequence[str | None] | None = None, **kwargs
    ) -> object:
        """The wrapped model's forward, with row ``i`` adapted by tenant ``tenants[i]``."""
        self.set_routing(tenants, input_ids.shape[0])
        return self.model(input_ids=input_ids, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, tenants: Sequence[str | None] | None = None, **kwargs):
        """``model.generate`` with per-row tenants (rows keep their order; no beam search)."""
        self.set_routing(tenants, input_ids.shape[0])
        return self.model.generate(input_ids=input_ids, **kwargs)

    # -- helpers -------------------------------------------------------------------------------
    def _tenant(self, name: str) -> TenantAdapter:
        try:
            return self.tenants[name]
        except KeyError:
            raise KeyError(f"unknown tenant {name!r}; tenants: {sorted(self.tenants)}") from None

    def _free_slot(self, name: str) -> int:
        used = {t.slot for t in self.tenants.values()}
        for slot in range(self.max_tenants):
            if slot not in used:
                return slot
        raise RuntimeError(
            f"no free slot for tenant {name!r}: all max_tenants={self.max_tenants} slots are taken by "
            f"{sorted(self.tenants)}"
        )


def _dense_init(
    name: str,
    layers: Sequence[tuple[str, MultiLoRALinear]],
    rank: int,
    init: dict[str, tuple[torch.Tensor, torch.Tensor]] | None,
    generator: torch.Generator,
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(module, A [rank, in], B [out, rank])`` of a new tenant for each of ``layers`` in their order
    (deterministic, so a seed gives one adapter): from ``init``, or PEFT's default, A kaiming-uniform
    (a=sqrt(5), fan_in = in) drawn from ``generator`` and B = 0."""
    out = []
    for module, layer in layers:
        if init is not None:
            A, B = init[module]
            if tuple(A.shape) != (rank, layer.in_features) or tuple(B.shape) != (layer.out_features, rank):
                raise AdapterError(
                    f"tenant {name!r}: {module} needs A [{rank}, {layer.in_features}] and "
                    f"B [{layer.out_features}, {rank}], got A{tuple(A.shape)} B{tuple(B.shape)}"
                )
        else:
            A = torch.empty(rank, layer.in_features)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
            B = torch.zeros(layer.out_features, rank)
        out.append((module, A, B))
    return out


def _as_list(targets: str | Sequence[str]) -> list[str] | str:
    return targets if isinstance(targets, str) else list(targets)
