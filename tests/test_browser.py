"""In a real browser: Voila serves a notebook with a live dashboard of a running job; headless
Chromium (driven by Playwright) sees the tenants and the plot, sees them update, and stops the run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

import mlora_lab as ml
from mlora_lab.demo import task_rows, write_jsonl

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError("CI must install Debian's chromium (scripts/test.sh does)")
    pytest.skip(
        "chromium is not installed (scripts/test.sh installs it with apt-get)", allow_module_level=True
    )
playwright = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until something accepts connections on the port (not: until a request stops failing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "voila exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


def step_of(text: str) -> int:
    return int(text.split("· step ")[1].split()[0])


def test_live_dashboard_in_chromium(llama_path, tmp_path):
    tenants = [
        ml.Tenant(
            name=n, data=write_jsonl(tmp_path / f"{n}.jsonl", task_rows(n, 64, 0)), rank=4, max_steps=100_000
        )
        for n in ("reverse", "upper")
    ]
    run = ml.launch(
        ml.JobSpec(base_model=llama_path, tenants=tenants, seq_len=48, max_rank=8), workdir=tmp_path / "runs"
    )
    voila = log = None
    try:
        code = f"import mlora_lab as ml\nrun = ml.attach({str(run.path)!r})\ndash = run.dashboard(refresh_s=0.5)\ndash"
        nb = new_notebook(
            cells=[new_code_cell(code)],
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        )
        nbformat.write(nb, tmp_path / "dash.ipynb")
        port = free_port()
        log = (tmp_path / "voila.log").open("w")
        voila = subprocess.Popen(
            [sys.executable, "-m", "voila", str(tmp_path / "dash.ipynb"), "--no-browser", f"--port={port}",
             "--Voila.ip=127.0.0.1"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_listening(port, voila)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/", timeout=180_000)
            page.wait_for_selector("text=· running · loss", timeout=180_000)
            status = page.locator(".widget-html-content", has_text=f"{run.path.name} — ").first
            first_text, first_imgs = (
                status.inner_text(),
                page.eval_on_selector_all("img", "e => e.map(i => i.src)"),
            )
            body = page.inner_text("body")
            assert "reverse" in body and "upper" in body, body
            assert len(first_imgs) == 2, "loss plot and system plot"
            time.sleep(3)
            second_text, second_imgs = (
                status.inner_text(),
                page.eval_on_selector_all("img", "e => e.map(i => i.src)"),
            )
            assert step_of(second_text) > step_of(first_text), "the dashboard updates while the job runs"
            assert second_imgs != first_imgs, "the plots are redrawn"
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            page.get_by_role("button", name="Stop").click()
            assert run.wait(timeout=120) == "stopped"
            page.wait_for_selector("text=stopped", timeout=30_000)
            browser.close()
    finally:  # never leave a job, a server or a log handle behind
        if voila is not None:
            voila.terminate()
            voila.wait(timeout=30)
            log.close()
        if run.status not in ("finished", "failed", "stopped"):
            run.kill()
