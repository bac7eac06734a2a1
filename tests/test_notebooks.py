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

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SHORTENED = {"01_quickstart", "03_distributed"}
"""Notebooks run here with a quarter of their training steps: the quickstart trains 300-400 steps so that a
reader sees what the tenants learn, which the test does not judge (the whole test took 98 s with them, 42 s
with a quarter); the distributed one's three 2-process jobs, 70 s -> 59 s. (The RL notebook's time is its
jobs' start: 39 s in full, 42 s with a quarter, on a quiet machine.)"""
NEEDS = {"06_service": "tinker"}
"""Notebooks that need an optional package (the ``serve`` extra's SDK, in the ``dev`` extra too)."""


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
