"""The notebooks run top to bottom with a real Jupyter kernel (nbclient)."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow
NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.monotonic()
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
    print(f"{path.name}: {time.monotonic() - t0:.0f} s")
    # the dashboard and the comparison plots really rendered
    mimes = {
        k for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) for k in o.get("data", {})
    }
    assert "application/vnd.jupyter.widget-view+json" in mimes
    assert "image/png" in mimes or path.stem == "03_distributed"
