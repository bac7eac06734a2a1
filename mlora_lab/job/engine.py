"""The engine: the shared frozen base with every tenant's LoRA slot, and the one forward all drivers share.

:meth:`Engine.forward` takes the rows of a step, grouped by tenant, and returns the per-token loss of
every row under its own tenant's adapter:

1. the groups are collated into one right-padded batch ``[B, T]``, tenant by tenant (packed rows carry
   restarting ``position_ids`` instead of a 2-D mask), and the model learns each row's slot
   (:meth:`~mlora_lab.lora.MultiLoRAModel.set_segments`);
2. the base runs once for the whole batch (with activation checkpointing, every k-th decoder block
   recomputes its activations in the backward: :mod:`mlora_lab.memory`);
3. the loss ``ℓ[b, p] = logsumexp(z) − z[y]`` of each target position is computed in chunks from the final
   hidden states, never holding the full ``[B, T, V]`` logits (:func:`~mlora_lab.memory.token_loss`);
   a group given a temperature ``τ`` has its logits divided by it first (an RL tenant's completions are
   scored at the temperature they were sampled at).

Drivers turn these per-token values into each tenant's loss; the engine knows nothing of windows,
rewards or requests. Built once per process by :meth:`Engine.build`, which is where the parallel layout
is applied (:func:`~mlora_lab.parallel.parallelize`): the model code itself stays plain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from mlora_lab import hub, quant
from mlora_lab.bases import resolve_base
from mlora_lab.data import IGNORE_INDEX, Batch, Example, check_vocab, collate, load_examples
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.lora.experts import packed_expert_parameters
from mlora_lab.lora.targets import output_layer_names
from mlora_lab.memory import (
    causal_lm_token_loss,
    checkpoint_blocks,
    chunk_tokens_for,
    hidden_states,
    output_layer,
    token_loss,
)
from mlora_lab.parallel import Collectives, ParallelDims, parallelize
from mlora_lab.sources import source_name
from mlora_lab.spec.job import JobSpec, effective_slot_modules

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_dtype(name: str, device: torch.device) -> torch.dtype:
    """The frozen base's dtype for ``JobSpec.dtype`` on ``device``: ``"auto"`` is bfloat16 on a GPU that
    supports it (Ampere and later) and float32 elsewhere (the CPU, whose bfloat16 matmuls are slower
    than its float32 ones on most machines, and older GPUs, where float16 training would need loss
    scaling). Adapters stay float32 in every case."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float32


SERVED_CPU_PASS_TOKENS = 1024
"""``max_pass_tokens`` of a job that serves (``JobSpec.service``) on a CPU when the spec leaves it ``None``.
A served step holds the requests of however many clients wait at once, so in one pass its memory grows with
them; a file-driven job's step is what its spec says (its tenants' batch sizes), so it keeps one pass.
Measured on an 11M llama, one thread (benchmarks/service.py, 4 clients' steps of 8 × 128 tokens): the job's
peak RSS 0.30-0.31 of four one-client jobs in passes of 1,024 tokens, against 0.46 in one pass, at the same
throughput within the runs' noise (4 clients ÷ 1: 1.02-1.17 in passes, 1.12 in one pass). For a file-driven
job passes trade time for memory (the 4-tenant SFT step of benchmarks/concurrency.py, 2,048 tokens:
training 1.04× four PEFT runs in two passes against 0.97× in one, peak RSS 880 against 1,033 MiB), so
there it is the user's choice."""


class Engine:
    """The model with its slots, its tokenizer, and the forward of one mixed-tenant batch."""

    def __init__(
        self,
        model: MultiLoRAModel,
        tokenizer,
        comm: Collectives,
        base_path: str,
        seq_len: int,
        vocab_rows: int,
        max_pass_tokens: int | None = None,
        slot_modules: Sequence[str] = (),
    ) -> None:
        self.model, self.tokenizer, self.comm = model, tokenizer, comm
        self.slot_modules = list(slot_modules)
        """What the model's slots were given on (``JobSpec.slot_modules`` as the job recorded it)."""
        self.device = comm.device
        self.base_path, self.seq_len = base_path, seq_len
        self.base_name = base_path
        """What saved adapters record as their ``base_model_name_or_path``: the base's Hub id, or its path."""
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id: int = pad
        self.vocab_rows = vocab_rows  # of the unsharded embedding
        # The loss is computed from the output layer's input in chunks (mlora_lab.memory); models
        # whose forward post-processes the logits keep the full-logits loss.
        self.head = output_layer(model.model)
        self.chunk_tokens = chunk_tokens_for(self.vocab_rows)
        # padded tokens of one forward + backward (None: one pass): the spec's, else chosen for the device
        self.max_pass_tokens = max_pass_tokens

    @classmethod
    def build(cls, spec: JobSpec, dims: ParallelDims, mesh, comm: Collectives) -> Engine:
        """Load the base (a GGUF base from its converted cache), give it ``spec.max_tenants`` slots on
        ``spec.slot_modules`` (and the tenants' target parameters; in a served job, every packed expert
        parameter), checkpoint its blocks if asked, and apply the parallel layout. Slots are fixed for the
        life of the job."""
        base_path = str(resolve_base(spec.base_model, revision=spec.revision))
        same = spec.tokenizer == spec.base_model  # (the revision is the base's)
        tokenizer_dir = (
            hub.resolve(spec.tokenizer, spec.revision if same else None) if spec.tokenizer else base_path
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        dtype = base_dtype(spec.dtype, comm.device)
        # (a quantized base is quantized as each weight is placed on the device: mlora_lab.quant)
        base = transformers.AutoModelForCausalLM.from_pretrained(
            base_path, dtype=dtype, **quant.load_kwargs(spec.quantize, dtype, comm.device)
        )
        if spec.quantize is None:
            base.to(comm.device)
        quant.prepare(base, spec.quantize, dtype, spec.quantize_embeddings)
        # before any sharding, and not the weight's shape: a quantized embedding's weight is packed
        embedding = base.get_input_embeddings()
        vocab_rows = getattr(embedding, "num_embeddings", None) or embedding.weight.shape[0]
        # (a served job's default slots include the output layer: named here, where the model is)
        slot_modules = effective_slot_modules(spec, output_layer_names(base))
        slot_parameters = {p for t in spec.tenants for p in t.target_parameters}
        if spec.service is not None:  # (a Tinker client's train_mlp adapts an MoE block's packed experts)
            slot_parameters |= set(packed_expert_parameters(base))
        model = MultiLoRAModel(
            base,
            max_tenants=spec.max_tenants,
            max_rank=spec.max_rank,
            slot_modules=slot_modules,
            slot_parameters=sorted(slot_parameters),
            wrap_experts=dims.ep > 1,
        )
        # Checkpoint blocks before FSDP wraps them: its hooks stay outside the recomputed region.
        checkpoint_blocks(model.model, int(spec.activation_checkpointing))
        parallelize(model, dims, mesh, comm.device.type, comm.dp_group)
        max_pass_tokens = spec.max_pass_tokens
        if max_pass_tokens is None and spec.service is not None and comm.device.type == "cpu":
            max_pass_tokens = SERVED_CPU_PASS_TOKENS
        engine = cls(
            model, tokenizer, comm, base_path, spec.seq_len, vocab_rows, max_pass_tokens, slot_modules
        )
        if hub.is_hub_id(
            spec.base_model
        ):  # adapters name their base by its id: PEFT and vLLM load it by name
            engine.base_name = spec.base_model
        return engine

    # -- data ------------------------------------------------------------------------------------
    def examples(self, source: Any) -> list[Example]:
        """A tenant's data source (a file; in an in-process job, an in-memory source too) tokenized for
        this base, every token inside its embedding."""
        examples = load_examples(source, self.tokenizer, self.seq_len)
        # no row of it may index past the embedding
        check_vocab(examples, self.vocab_rows, source_name(source))
        return examples

    def local_rows(self, rows: Sequence[Example]) -> list[Example]:
        """This data-parallel process's share of a tenant's rows: ``d, d + D, ...``."""
        return list(rows[self.comm.dp_rank :: self.comm.dp_size])

    # -- the forward -----------------------------------------------------------------------------
    def passes(
        self, groups: Sequence[tuple[str | None, list[Example]]]
    ) -> list[list[tuple[str | None, list[Example]]]]:
        """``groups`` cut into consecutive passes of whole groups, each of at most ``max_pass_tokens`` padded
        tokens (rows × the longest row) unless a group alone holds more (it is then a pass of its own);
        ``None``: one pass. Every process runs the same passes, so the sizes are agreed first (each group's
        rows and longest row, the largest over the processes: one small all-reduce)."""
        max_tokens = self.max_pass_tokens
        if max_tokens is None or len(groups) < 2:
            return [list(groups)]
        local = torch.tensor([[len(rows), max((len(ex) for ex in rows), default=0)] for _, rows in groups])
        sizes = [(int(n), int(t)) for n, t in self.comm.max_over_world(local).tolist()]
        return [[groups[i] for i in part] for part in pass_plan(sizes, max_tokens)]

    # -- the forward -----------------------------------------------------------------------------
    def forward(
        self,
        groups: Sequence[tuple[str | None, list[Example]]],
        temperatures: Mapping[str | None, float] | None = None,
    ) -> tuple[Batch, torch.Tensor]:
        """Collate ``groups`` into one batch, run the base with every row's LoRA, and return the batch
        and the per-token loss ``[B, T-1]`` (fp32, 0 on ignored tokens). A process with no rows still
        runs one padding row, so that it takes part in every collective of the forward/backward.

        ``temperatures[key]`` (``None``: the rows without an adapter) divides the logits of that group's
        rows before the loss: ``ℓ = logsumexp(z/τ) − z[y]/τ``, so ``−ℓ`` is ``log_softmax(z/τ)[y]``, how
        TRL scores a completion sampled at temperature ``τ``. Groups not named keep ``τ = 1``."""
        temps = {k: float(v) for k, v in (temperatures or {}).items() if v != 1.0}
        if not any(rows for _, rows in groups):
            groups = [(None, [Example([self.pad_id, self.pad_id], [IGNORE_INDEX, IGNORE_INDEX])])]
        batch = collate(groups, self.pad_id).to(self.device)
        self.model.set_segments(batch.segments, batch.num_rows)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
        if batch.position_ids is not None:  # packed rows: documents are told apart by their positions
            inputs["position_ids"] = batch.position_ids
            del inputs["attention_mask"]  # (transformers reads packing only without a 2-D mask)
        if self.head is None:
            logits = self.model.model(**inputs).logits
            if temps:  # [B, 1, 1]: each row's group's temperature
                scale = torch.ones(batch.num_rows, 1, 1, device=logits.device, dtype=logits.dtype)
                for key, start, end in batch.segments:
                    scale[start:end] = temps.get(key, 1.0)
                logits = logits / scale
            return batch, causal_lm_token_loss(logits, batch.labels)
        with hidden_states(self.head):
            hidden = self.model.model(**inputs).logits  # [B, T, H]: the output layer's input
        # Chunks follow tenants only where the output layer has their LoRA or their logits are scaled;
        # else any rows share one (rows outside these runs are projected with key None)
        slotted = [
            g for g in batch.segments if g[0] is not None and (self._head_slotted(g[0]) or g[0] in temps)
        ]

        def project(key: str | None, h: torch.Tensor) -> torch.Tensor:
            return self._project(key, h, temps.get(key, 1.0))

        return batch, token_loss(hidden, batch.labels, project, slotted, self.chunk_tokens)

    def _head_slotted(self, tenant: str) -> bool:
        """Whether the output layer carries ``tenant``'s LoRA."""
        ranks = getattr(self.head, "ranks", None)
        return ranks is not None and ranks[self.model.tenants[tenant].slot] > 0

    def _project(self, tenant: str | None, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Logits ``[n, V]`` of ``h`` [n, H], rows of ``tenant`` (its slot, if the output layer has
        one), divided by ``temperature``, for the chunked loss."""
        slots = [] if tenant is None else [(self.model.tenants[tenant].slot, 0, h.shape[0])]
        with self.model.routed(slots, h.shape[0]):
            logits = self.head(h)
        return logits if temperature == 1.0 else logits / temperature

    # -- adapters --------------------------------------------------------------------------------
    def save_adapter(self, name: str, path: Path | None, root: Path | None = None) -> Path | None:
        """Write tenant ``name``'s adapter as a PEFT directory at ``path``: full tensors gathered on every
        process (a collective), written by the caller that passes a ``path`` (rank 0), atomically (through
        no link below ``root``, when given)."""
        tensors = self.model.tenant_tensors(name)
        if path is None:
            return None
        return self.model.save_adapter(name, path, self.base_name, tensors=tensors, root=root)


def pass_plan(sizes: Sequence[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """Greedy cut of groups of ``(rows, longest row)`` into consecutive passes whose padded tokens
    ``Σ rows × max longest`` stay within ``max_tokens``: the indices of each pass's groups. A group too big
    for any pass is a pass of its own; groups without rows ride in the pass at hand."""
    passes: list[list[int]] = [[]]
    rows = longest = 0
    for i, (n, t) in enumerate(sizes):
        if n and rows and (rows + n) * max(longest, t) > max_tokens:
            passes.append([])
            rows = longest = 0
        passes[-1].append(i)
        rows, longest = rows + n, max(longest, t) if n else longest
    return passes
