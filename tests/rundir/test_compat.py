"""Run directories written by earlier versions keep working.

``tests/data/run_v1`` was written by the job code as it stood before the package was re-housed
(``mlora_lab.train``, before ``mlora_lab.job``): a tiny Llama base, two tenants (one mid-way through a
gradient-accumulation window at the checkpoint), a checkpoint at step 3 of 5, and what that code's
uninterrupted run ended with (``expected.json``: every logged loss; ``expected.safetensors``: the final
adapters). Resuming it with today's code must end exactly there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mlora_lab.job.trainer import Trainer
from mlora_lab.spec.job import JobSpec

V1 = Path(__file__).parents[1] / "data" / "run_v1"


def test_a_checkpoint_of_the_previous_layout_resumes_exactly(tmp_path):
    root = tmp_path / "v1"
    shutil.copytree(V1, root)
    run = root / "run"
    resumed = Trainer(JobSpec.load(run / "job.json"), run_dir=run, resume=True)
    assert resumed.global_step == 3 and resumed.tenants["b"].feed.micro == 1, "restored mid-window"
    resumed.train()
    expected = json.loads((root / "expected.json").read_text())["losses"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for name, losses in expected.items():
        got = [r["loss"] for r in rows if r["kind"] == "train" and r["tenant"] == name]
        assert got == pytest.approx(losses, abs=1e-6), name  # rows before the checkpoint kept, the rest new
    want = load_file(root / "expected.safetensors")
    for name in expected:
        for module, (A, B) in resumed.model.tenant_tensors(name).items():
            assert (A - want[f"{name}/{module}/A"]).abs().max() <= 1e-6, (name, module)
            assert (B - want[f"{name}/{module}/B"]).abs().max() <= 1e-6, (name, module)
