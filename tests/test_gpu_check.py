"""``scripts/gpu-check.sh --dry``: the GPU check runs its parts on the CPU, on tiny sizes, and writes its JSON.

CI has no GPU; this keeps the script that a GPU session runs in one call from breaking unseen between such
sessions. The dry run's figures mean nothing (tiny models on the CPU): its goals are recorded unjudged.
The parts that start other programs (pytest, the GRPO and service benchmarks) are left to a full dry run
(``bash scripts/gpu-check.sh --dry``, ~1.5 min here)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_dry_on_the_cpu_and_writes_its_json(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--dry", "--parts", "env,g1_training,g2_sampling,q_quantized"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry"] is True and set(report["parts"]) == {
        "env",
        "g1_training",
        "g2_sampling",
        "q_quantized",
    }
    for name, part in report["parts"].items():
        assert part["ok"], (name, part.get("error"), part.get("traceback"))
    assert report["parts"]["env"]["dtype_auto"] == "float32"  # (the CPU)
    g1 = report["parts"]["g1_training"]
    assert set(g1["tenants"]) == {"1", "4", "16"} and all(
        t["tokens_per_s"] > 0 for t in g1["tenants"].values()
    )
    assert report["parts"]["g2_sampling"]["static_equals_dynamic_greedy"] is True
    bases = report["parts"]["q_quantized"][
        "bases"
    ]  # (issue 36: the base in 16 bits, nf4, nf4 with embeddings)
    assert bases["base"]["base_bytes"] > bases["nf4"]["base_bytes"] > bases["nf4+embeddings"]["base_bytes"]
    goals = report["goals"]
    assert set(goals) == {
        "g1_vs_one_peft_adapter", "g1_vs_16_sequential_peft_steps", "g2_vs_base_alone", "g2_vs_peft_loop",
        "q_nf4_base_bytes_vs_16bit", "q_nf4_embeddings_base_bytes_vs_16bit",
    }  # fmt: skip
    assert all(g["value"] > 0 and g["met"] is None for g in goals.values())
    assert (tmp_path / "gpu-check.log").is_file()
