"""The README's scripts as a user runs them: ``scripts/setup.sh`` run again installs nothing and prints one
line; ``scripts/lab.sh`` starts JupyterLab (as root too, where a container runs it) on copies of the
notebooks.

Both run the real ``setup.sh`` of this checkout on the suite's own ``.venv``; they run where that ``.venv``
was installed by this checkout's ``setup.sh`` (CI, a fresh clone, a developer's own checkout), and are skipped
in another checkout that borrows the environment (a re-install there would point it elsewhere)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
STAMP = VENV / ".mlora_lab-setup"


def installed_here() -> bool:
    """Whether ``.venv`` holds the install ``setup.sh`` made from this checkout's files (its stamp)."""
    if not STAMP.is_file():
        return False
    made_from = b"".join(
        (ROOT / f).read_bytes() for f in ("pyproject.toml", "scripts/setup.sh", "constraints.txt")
    )
    want = f"{hashlib.sha256(made_from).hexdigest()} {os.environ.get('TORCH_SPEC', 'torch==2.13.0')}"
    editable = subprocess.run(
        [VENV / "bin/python", "-c", "import mlora_lab; print(mlora_lab.__file__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return STAMP.read_text().strip() == want and Path(editable).is_relative_to(ROOT)


needs_own_setup = pytest.mark.skipif(
    not installed_here(), reason=".venv was not installed by this checkout's scripts/setup.sh"
)


@needs_own_setup
def test_setup_run_again_installs_nothing_and_says_one_line():
    out = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlora_lab "), out.stdout
    assert "pip" not in out.stderr and "!!" not in out.stderr, out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_own_setup
def test_lab_sh_starts_jupyterlab_on_copies_of_the_notebooks(tmp_path):
    workspace, port = tmp_path / "workspace", free_port()
    log = (tmp_path / "lab.log").open("w")
    lab = subprocess.Popen(
        [
            "bash",
            "scripts/lab.sh",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--port={port}",
            "--IdentityProvider.token=",
        ],
        cwd=ROOT,
        env={**os.environ, "WORKSPACE": str(workspace)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and lab.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        text = (tmp_path / "lab.log").read_text()
        assert lab.poll() is None, f"lab.sh ended ({'as root' if os.getuid() == 0 else 'as a user'}):\n{text}"
        assert "--allow-root" not in text and "Running as root is not recommended" not in text
        assert "Warning" not in text, text  # (notebook_shim made jupyter_server warn of ServerApp.token)
        shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
        assert sorted(p.name for p in workspace.glob("*.ipynb")) == shipped
    finally:
        os.killpg(lab.pid, 15)
        lab.wait(timeout=30)
        log.close()
