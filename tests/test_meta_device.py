"""CPU operands never reach device code: the training forward, every loss and the grouped LoRA on ``meta``.

CI has no GPU, and a CPU-only run cannot tell a tensor left on the CPU from one on the job's device: the
two are the same there. A tensor on the ``meta`` device has a shape and a dtype and no data, and an op
mixing it with a CPU tensor raises ("Expected all tensors to be on the same device"), as it would with a
CUDA tensor. So these run the device-side code with the model and its inputs on ``meta``: a CPU tensor
that the code makes and forgets to move (an index, a scale, a loss input) fails here as it would on a GPU.
What reads values on the host (``.tolist()``, the optimiser's divergence check) or sizes a tensor by its
values (the chunked loss's mask, an MoE router's token groups) cannot run on ``meta`` and is left out: the
packed experts' LoRA is covered here through its grouped plans.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mlora_lab.data import Example
from mlora_lab.job.engine import Engine
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.lora.grouped import rank_padding
from mlora_lab.lora.layer import segmented_lora
from mlora_lab.memory import causal_lm_token_loss
from mlora_lab.rl.grpo import policy_loss
from mlora_lab.service import losses
from mlora_lab.tiny import TYPICAL_TARGETS, tiny_config

META = torch.device("meta")


@pytest.mark.parametrize("padded", [False, True])
def test_grouped_lora_on_meta(padded):
    """Uneven rows (a gathered bucket), mixed ranks (padded stacks), packed experts: forward and backward."""
    dense = [torch.empty(r, 12, device=META) for r in (4, 8)] + [
        torch.empty(10, r, device=META) for r in (4, 8)
    ]
    factors = [t.requires_grad_() for t in (dense[0], dense[2], dense[1], dense[3])]
    plans = [
        ((0, (), 1, (), 0, 2, 1.0), (2, (), 3, (), 2, 5, 0.5)),
        ((0, (), 1, (), 0, 2, 1.0), (2, (), 3, (), 2, 4, 0.5)),  # evenly spaced: a view
    ]
    with rank_padding(padded):
        for plan in plans:
            x = torch.empty(6, 3, 12, device=META, requires_grad=True)
            out = segmented_lora(x, torch.empty(6, 3, 10, device=META), plan, factors)
            out.sum().backward()
            assert out.device == META and x.grad.device == META
        experts = [torch.empty(4, 4, 12, device=META), torch.empty(4, 10, 4, device=META)]
        experts = [t.requires_grad_() for t in experts]
        plan = ((0, (0,), 1, (0,), 0, 3, 1.0), (0, (2,), 1, (2,), 3, 7, 1.0))
        x = torch.empty(8, 12, device=META, requires_grad=True)
        segmented_lora(x, torch.empty(8, 10, device=META), plan, experts).sum().backward()
        assert experts[0].grad.device == META


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt_neox"])
def test_training_forward_losses_and_backward_on_meta(arch, padded):
    """A mixed batch of three tenants through the model (the output layer slotted for one of them, its
    logits at a temperature), then the SFT, GRPO and Tinker losses on their slices, then the backward.
    The chunked loss (``mlora_lab.memory.token_loss``) sizes its chunks from the mask on the host, so the
    full-logits loss stands in for it here."""
    torch.manual_seed(0)
    config = tiny_config(arch, 97, hidden=32, layers=2)
    # (eager attention: the SDPA mask reads on the host whether the padding mask is all ones)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    targets = TYPICAL_TARGETS[arch]
    mm = MultiLoRAModel(base, max_tenants=3, max_rank=16, slot_modules=[*targets, "lm_head"])
    mm.to(META)  # (before the tenants: their tensors are made on the layers' device)
    mm.add_tenant("a", rank=4, target_modules=targets)
    mm.add_tenant("b", rank=16, target_modules=targets[:1])
    mm.add_tenant("c", rank=8, target_modules=[*targets, "lm_head"])
    assert all(p.device == META for n in "abc" for p, _ in mm.tenant_slices(n))
    engine = Engine(mm, _Tokenizer(), _Comm(), "base", 16, 97, None, [*targets, "lm_head"])
    engine.head = None  # the full-logits loss: the chunked one picks tokens by a mask, on the host

    rows = {n: [Example(list(range(3, 3 + k)), list(range(3, 3 + k))) for k in (5, 7)] for n in "abc"}
    with rank_padding(padded):
        batch, token_loss = engine.forward(list(rows.items()), {"c": 0.7})
        assert token_loss.device == META
        _, s, e = batch.segments[0]
        sft = token_loss[s:e].sum() / (batch.labels[s:e, 1:] != -100).sum()
        _, s, e = batch.segments[1]
        logps = -token_loss[s:e]
        mask = batch.labels[s:e, 1:] != -100
        grpo, _ = policy_loss(
            logps, logps.detach(), torch.zeros(e - s, device=META), mask, beta=0.04, ref_logps=logps.detach()
        )
        _, s, e = batch.segments[2]
        lp = -token_loss[s, :4]
        inputs = {"logprobs": torch.zeros(4), "advantages": torch.ones(4)}  # as a request's: on the CPU
        tinker, _ = losses.datum_loss("ppo", lp, inputs, {})
        (sft + grpo + tinker).backward()
    grads = [p.grad for n in "abc" for p, _ in mm.tenant_slices(n)]
    assert grads and all(g is not None and g.device == META for g in grads)


def test_token_loss_on_meta():
    """The full-logits loss (models whose forward post-processes the logits) keeps to the device too."""
    logits = torch.empty(2, 5, 11, device=META, requires_grad=True)
    labels = torch.zeros(2, 5, dtype=torch.long, device=META)
    loss = causal_lm_token_loss(logits, labels)
    loss.sum().backward()
    assert loss.device == META


class _Tokenizer:
    pad_token_id = 0


class _Comm:
    device = META
    dp_size = 1

    def max_over_world(self, values):
        return values
