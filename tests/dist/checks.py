"""Checks shared by the torchrun scripts in this folder: a split model against an unsplit reference.

(Each script runs as ``python tests/dist/<script>.py``, so this folder is on ``sys.path``.)
"""

from __future__ import annotations

import tempfile

import torch

from mlora_lab.lora import MultiLoRAModel


def assert_same_gradients(split: MultiLoRAModel, reference: MultiLoRAModel, names, atol: float = 1e-5) -> None:
    """The gathered (full) gradient of every tenant's tensors, summed over the data-parallel ranks as
    the trainer does before an optimiser step, equals the reference's."""
    io = split.io
    split.reduce_gradients(list(names))
    for name in names:
        for (p, i), (q, j) in zip(split.tenant_slices(name), reference.tenant_slices(name)):
            g = io.gather(p, i, io.local(p.grad)[i])
            assert g.shape == q.grad[j].shape, "gathered gradients are whole"
            torch.testing.assert_close(g, q.grad[j], atol=atol, rtol=0)


def assert_reload_into_freed_slot(split: MultiLoRAModel, reference: MultiLoRAModel, name: str) -> None:
    """Slot reset + add on the split model: ``name`` is removed and the reference's saved PEFT adapter
    is loaded into the freed slot (full tensors written into local shapes); it reads back exactly."""
    with tempfile.TemporaryDirectory() as tmp:
        reference.save_adapter(name, tmp)
        split.remove_tenant(name)
        split.load_adapter(name + "2", tmp)
        for k, (A, B) in reference.tenant_tensors(name).items():
            A2, B2 = split.tenant_tensors(name + "2")[k]
            assert torch.equal(A2, A) and torch.equal(B2, B), k
