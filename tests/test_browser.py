"""In a real browser (headless Chromium driven by Playwright, never a downloaded browser):

- JupyterLab opens the quickstart notebook and runs it: the interactive (ipympl) figures, the progress
  bars and the runs table appear and keep updating while a later cell blocks in ``run.wait()``, and the
  dashboard's Stop button stops the job;
- Voila serves a notebook with a live PNG dashboard of a running job; it updates and Stop works.

Screenshots go to the test's temp dir."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import stop_runs_under
from nbformat.v4 import new_code_cell, new_notebook

import mlora_lab as ml
from mlora_lab.lab.demo import task_rows, write_jsonl

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

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
        code = f"import mlora_lab as ml\nrun = ml.attach({str(run.path)!r})\ndash = run.dashboard(refresh_s=0.5, interactive=False)\ndash"
        nb = new_notebook(
            cells=[new_code_cell(code)],
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        )
        nbformat.write(nb, tmp_path / "dash.ipynb")
        port = free_port()
        log = (tmp_path / "voila.log").open("w")
        voila = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "voila",
                str(tmp_path / "dash.ipynb"),
                "--no-browser",
                f"--port={port}",
                "--Voila.ip=127.0.0.1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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
            drawn = page.eval_on_selector_all("img", "e => e.filter(i => i.naturalWidth > 0).length")
            assert drawn >= 2, (
                "the loss plot and the system plot (the lr & grad norm tab is drawn when opened)"
            )
            # the next step may take a while on a busy machine: wait for it, then for its redraw
            deadline = time.monotonic() + 180
            while step_of(status.inner_text()) <= step_of(first_text) and time.monotonic() < deadline:
                time.sleep(1)
            time.sleep(2)
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


QUICKSTART = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"


def start_server(args: list[str], log_path: Path) -> tuple[subprocess.Popen, int, object]:
    """A Jupyter server on a free loopback port (no token: only this machine can reach it)."""
    port = free_port()
    log = log_path.open("w")
    proc = subprocess.Popen([*args, f"--port={port}"], stdout=log, stderr=subprocess.STDOUT)
    wait_listening(port, proc)
    return proc, port, log


def canvas_pixels(page) -> list[str]:
    """The pixels of every ipympl figure on the page (as data URLs): they change when a figure is redrawn."""
    return page.eval_on_selector_all(
        ".jupyter-matplotlib-figure canvas", "cs => cs.map(c => c.width > 50 ? c.toDataURL() : '')"
    )


def wait_for_run(runs: Path, timeout: float) -> Path:
    """The one run directory the notebook creates under ``runs``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(runs.glob("*/job.json"))
        if found:
            return found[0].parent
        time.sleep(0.5)
    raise TimeoutError(f"the notebook started no run under {runs}")


def test_quickstart_in_jupyterlab(tmp_path):
    """The quickstart as a user runs it in JupyterLab, up to the cell that waits for the job."""
    root = tmp_path / "lab"
    root.mkdir()
    nb = nbformat.read(QUICKSTART, as_version=4)
    for cell in nb.cells:  # long enough to watch it and stop it by hand (the notebook asks for 300-400)
        cell.source = re.sub(r"max_steps=\d+", "max_steps=100_000", cell.source)
    nbformat.write(nb, root / "quickstart.ipynb")
    wait_cell = next(i for i, c in enumerate(nb.cells) if "run.wait(" in c.source)
    lab = log = None
    try:
        lab, port, log = start_server(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--allow-root",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.root_dir={root}",
                "--IdentityProvider.token=",
                "--ServerApp.password=",
                "--LabApp.news_url=None",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            ],
            tmp_path / "jupyterlab.log",
        )
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            try:
                drive_quickstart(page, port, root, wait_cell, tmp_path)
            except Exception:
                page.screenshot(path=str(tmp_path / "jupyterlab-failed.png"), full_page=True)
                raise
            browser.close()
    finally:  # never leave a job, a server or a log handle behind
        stop_runs_under(root)
        if lab is not None:
            lab.terminate()
            lab.wait(timeout=30)
            log.close()


def drive_quickstart(page, port: int, root: Path, wait_cell: int, tmp_path: Path) -> None:
    """Run the quickstart up to its ``run.wait()`` cell, watch the dashboard update while the kernel is
    busy in it, interrupt the wait, press Stop."""
    page.goto(f"http://127.0.0.1:{port}/lab/tree/quickstart.ipynb", timeout=180_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=180_000)
    no_news = page.get_by_role("button", name="No", exact=True)
    if no_news.count():  # JupyterLab asks once whether to fetch news
        no_news.click()
    # Run every code cell up to the one that blocks in run.wait(), each in turn: select it, Shift+Enter,
    # and wait for its prompt to show an execution count (the last one: "[*]", busy). A press made
    # while the kernel connection is still settling can be lost, so a cell that shows no sign of
    # running after a few seconds is run again.
    cells = nbformat.read(root / "quickstart.ipynb", 4).cells
    for i, cell in enumerate(cells[: wait_cell + 1]):
        if cell.cell_type != "code":
            continue
        prompt = page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-InputPrompt")
        done = r"/\[\*\]/" if i == wait_cell else r"/\[\d+\]/"
        for attempt in range(3):
            prompt.click()
            page.keyboard.press("Shift+Enter")
            try:
                page.wait_for_function(
                    "e => /\\[(\\*|\\d+)\\]/.test(e.textContent)",
                    arg=prompt.element_handle(),
                    timeout=10_000,
                )
                break
            except playwright.TimeoutError:
                assert attempt < 2, f"cell {i} does not run"
        page.wait_for_function(
            f"e => {done}.test(e.textContent)", arg=prompt.element_handle(), timeout=300_000
        )
    run_dir = wait_for_run(root / "lab" / "runs", timeout=300)
    run = ml.attach(run_dir)
    # the job runs: the dashboard's header counts steps, its figures are ipympl canvases
    header = page.locator(".widget-html-content", has_text=f"{run_dir.name} — running · step").first
    header.wait_for(timeout=300_000)
    page.wait_for_selector(".jupyter-matplotlib-figure canvas", timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('· loss ')", timeout=120_000)
    body = page.inner_text("body")
    for tenant in ("spanish", "french", "count"):
        assert tenant in body, f"tenant {tenant} is not on the page"
    bars = page.locator(".widget-hprogress").count()
    assert bars >= 3, f"{bars} progress bars for 3 tenants"
    table = page.locator(".widget-html-content", has_text="best loss").first
    assert table.is_visible(), "the runs table"
    row = page.locator(".widget-html-content", has_text="3: spanish, french, count").first
    assert run_dir.name in row.inner_text(), "the run is a row of the runs table"
    first_step, first_pixels = step_of(header.inner_text()), canvas_pixels(page)
    first_bar = page.locator(".widget-hprogress .progress-bar").first.get_attribute("style")
    page.screenshot(path=str(tmp_path / "jupyterlab-1.png"), full_page=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # while the kernel is busy in run.wait()
        time.sleep(2)
        if step_of(header.inner_text()) > first_step + 2 and canvas_pixels(page) != first_pixels:
            break
    assert step_of(header.inner_text()) > first_step, "the header follows the job"
    assert canvas_pixels(page) != first_pixels, "the interactive figures are redrawn"
    assert page.locator(".widget-hprogress .progress-bar").first.get_attribute("style") != first_bar
    page.screenshot(path=str(tmp_path / "jupyterlab-2.png"), full_page=True)
    # A widget's button is handled by the kernel, which is busy in run.wait(): interrupt the wait
    # (the job goes on), then Stop works. The job checkpoints, saves its adapters and ends.
    page.locator("[data-command='notebook:interrupt-kernel']").first.click()
    page.wait_for_selector(".jp-OutputArea-output >> text=KeyboardInterrupt", timeout=60_000)
    assert run.status == "running", "interrupting the wait leaves the job alone"
    page.get_by_role("button", name="Stop").first.click()
    assert run.wait(timeout=120) == "stopped", run.logs(0)
    assert all(run.adapter_path(t).is_dir() for t in ("spanish", "french", "count"))
    page.wait_for_selector(f"text={run_dir.name} — stopped", timeout=30_000)
    assert "running" not in page.locator(".widget-hprogress").first.locator("xpath=..").inner_text()
    page.screenshot(path=str(tmp_path / "jupyterlab-3.png"), full_page=True)
