"""Notebook-side performance: metrics latency, incremental reading, dashboard refresh.

    python benchmarks/lab.py            # full
    python benchmarks/lab.py --quick    # smaller, for a smoke test

1. Latency: a real job (torchrun, tiny model) writes metrics rows; the notebook side polls
   ``run.metrics()`` every 100 ms; for every row, (time it first appears in the DataFrame) - (the
   trainer's timestamp in the row). Goal: p95 <= 1 s.
2. Reading 100k rows incrementally: a metrics.jsonl grows by 1,000 rows at a time; the run's reader
   polls after each chunk (``run.rows()``), then ``run.metrics()`` builds the DataFrame. Goal: <= 0.5 s
   in all (median of 3 repeats). Also
   reported: ``run.metrics()`` after every chunk (the DataFrame grows incrementally too), and one cold
   read of all 100k rows.
3. Dashboard refresh with 10 tenants x 10k points: time of one ``Dashboard.refresh()`` that brings
   in one new row per tenant and redraws, median of 10. Goal: <= 150 ms. With PNG figures
   (``interactive=False``) the refresh renders the loss figure at 2x (the system tab at most every 2 s);
   with ipympl figures the refresh renders the loss figure and pushes the frame to the browser itself
   (so the figure keeps updating while a cell blocks); a render the browser asks for on its own (a
   resize, a zoom: ``canvas.draw()``) is reported separately.
4. The same for a view over 5 runs x 10 tenants x 10k points (every refresh brings a row per tenant in
   every run). Goal: <= 300 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def latency(quick: bool) -> None:
    import mlora_lab as ml
    from mlora_lab.lab.demo import task_rows, write_jsonl
    from mlora_lab.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="mlora_lat_"))
    base = build_tiny_model("llama", work / "model")
    tenants = [
        ml.Tenant(name=f"t{i}", data=write_jsonl(work / f"{i}.jsonl", task_rows("upper", 32, i)), rank=4,
                  max_steps=40 if quick else 150)
        for i in range(3)
    ]  # fmt: skip
    run = ml.launch(
        ml.JobSpec(base_model=base, tenants=tenants, seq_len=48, max_rank=8), workdir=work / "runs"
    )
    seen, delays = 0, []
    while True:
        done = run.status in ("finished", "failed", "stopped")
        m = run.metrics()
        now = time.time()
        if len(m) > seen:
            new = m.iloc[seen:]
            delays += list(now - new["time"].astype("int64").to_numpy() / 1e9)
            seen = len(m)
        if done:
            break
        time.sleep(0.1)
    d = np.array(delays)
    print(
        f"1. row -> run.metrics() latency over {len(d)} rows (poll every 100 ms): "
        f"median {np.median(d) * 1e3:.0f} ms, p95 {np.percentile(d, 95) * 1e3:.0f} ms, "
        f"max {d.max() * 1e3:.0f} ms   (goal p95 <= 1000 ms)"
    )


def fake_rows(n: int, tenants: int, t0: float = 1.8e9) -> list[str]:
    """Train rows as the job writes them (every field of this release's ``TrainRow``, in its order)."""
    from mlora_lab.rundir import TrainRow

    rows = []
    for i in range(n):
        tenant = i % tenants
        step = i // tenants + 1
        row = TrainRow(
            step=step,
            tenant=f"tenant{tenant}",
            tenant_step=step,
            loss=5.0 / (1 + 0.001 * step) + 0.1 * float(np.sin(step)),
            tokens=512,
            lr=1e-4,
            grad_norm=1.0,
            time=t0 + step * 0.1,
            rows_seen=4 * step,
            tokens_seen=512 * step,
        )
        rows.append(json.dumps(row.to_dict()))
    return rows


def make_run_dir(root: Path, tenants: int, state: str = "finished") -> Path:
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.tenant import Tenant

    root.mkdir(parents=True)
    (root / "logs").mkdir()
    data = root / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    spec = JobSpec(
        base_model=str(root),
        tenants=[Tenant(name=f"tenant{i}", data=str(data), max_steps=10_000) for i in range(tenants)],
        max_tenants=tenants,
    )
    spec.to_json(root / "job.json")
    (root / "status.json").write_text(json.dumps({"state": state}))  # no pid: taken as written
    return root


def incremental_read(quick: bool, repeats: int = 3) -> None:
    from mlora_lab.lab.runs.run import Run

    n, chunk = (20_000 if quick else 100_000), 1_000
    rows = fake_rows(n, 10)
    results: dict[str, list[float]] = {"poll": [], "frame": [], "cold": []}
    for _ in range(repeats):  # interleaved, medians reported (see "Machine and method")
        for mode in ("poll", "frame"):
            root = make_run_dir(Path(tempfile.mkdtemp()) / "run", 10)
            run = Run(root)
            total = 0.0
            with open(root / "metrics.jsonl", "a") as f:
                for i in range(0, n, chunk):
                    f.write("\n".join(rows[i : i + chunk]) + "\n")
                    f.flush()
                    t0 = time.perf_counter()
                    run.rows() if mode == "poll" else run.metrics()
                    total += time.perf_counter() - t0
            t0 = time.perf_counter()
            df = run.metrics()
            results[mode].append(total + (time.perf_counter() - t0))
            assert len(df) == n
        t0 = time.perf_counter()
        cold = Run(root).metrics()
        results["cold"].append(time.perf_counter() - t0)
        assert len(cold) == n
    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"2. reading {n:,} rows that arrive {chunk:,} at a time: incremental reader (a poll per chunk) + the "
        f"final run.metrics() DataFrame {med['poll']:.3f} s (median of {repeats}; max {max(results['poll']):.3f})"
        f"   (goal <= 0.5 s)\n"
        f"   run.metrics() after every chunk: {med['frame']:.3f} s in all; one cold read of all rows "
        f"{med['cold']:.3f} s"
    )


def _live_runs(n_runs: int, tenants: int, points: int, held_back: int) -> tuple[list[Path], list[str]]:
    """``n_runs`` running run directories with ``points`` logged steps: per step a train row per tenant
    and a system row (memory, throughput, CPU). The last ``held_back`` steps are returned, not written:
    the benchmark appends them one refresh at a time."""
    rows = fake_rows(tenants * points, tenants)
    steps = [
        "\n".join([*rows[k * tenants : (k + 1) * tenants], json.dumps({
            "kind": "system", "step": k + 1, "rank": 0, "mem_bytes": 2_000_000_000 + (k % 7) * 1_000_000,
            "peak_mem_bytes": 2_100_000_000, "step_time": 0.1, "tokens_per_s": 5000.0 + k % 13,
            "cpu_percent": 95.0, "time": 1.8e9 + (k + 1) * 0.1})])
        for k in range(points)
    ]  # fmt: skip
    roots = []
    for i in range(n_runs):
        root = make_run_dir(Path(tempfile.mkdtemp()) / f"run{i}", tenants, state="running")
        (root / "metrics.jsonl").write_text("\n".join(steps[:-held_back]) + "\n")
        roots.append(root)
    return roots, steps[-held_back:]


def _refresh_times(roots: list[Path], steps: list[str], interactive: bool):
    """Refresh times (and, interactive, the canvas render times), one refresh after each of ``steps``
    was appended to every run, as a live run does; then the system tab's render time."""
    from mlora_lab.lab.dashboard import Dashboard
    from mlora_lab.lab.runs.run import Run

    dash = Dashboard([Run(r) for r in roots], interactive=interactive)
    dash.refresh()  # the first load of every row
    refresh, render = [], []
    for step in steps:
        for root in roots:
            with open(root / "metrics.jsonl", "a") as f:
                f.write(step + "\n")
        t0 = time.perf_counter()
        dash.refresh()
        refresh.append(time.perf_counter() - t0)
        if interactive:  # what a render on the browser's request (resize, zoom) costs the kernel
            t0 = time.perf_counter()
            dash.loss_plot.draw()
            render.append(time.perf_counter() - t0)
    system = []
    for _ in range(3):  # the system tab, re-rendered at most every 2 s on top of a refresh
        t0 = time.perf_counter()
        dash.redraw(["system"])
        system.append(time.perf_counter() - t0)
    dash.stop()
    return refresh, render, system


def _ms(times: list[float]) -> str:
    return f"median {statistics.median(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms"


def dashboard_refresh(quick: bool) -> None:
    tenants, points = 10, (2_000 if quick else 10_000)
    for n_runs, goal, label in ((1, 150, "3."), (5, 300, "4.")):
        what = f"{n_runs} run{'s' if n_runs > 1 else ''} x {tenants} tenants x {points:,} points"
        roots, rows = _live_runs(n_runs, tenants, points, held_back=10)
        png, _, system = _refresh_times(roots, rows, interactive=False)
        print(
            f"{label} dashboard refresh, {what}, PNG figures: {_ms(png)}   (goal <= {goal} ms); "
            f"the system tab, redrawn at most every 2 s: {_ms(system)} more"
        )
        roots, rows = _live_runs(n_runs, tenants, points, held_back=10)
        live, render, _ = _refresh_times(roots, rows, interactive=True)
        print(
            f"   ipympl figures: refresh (renders and pushes the frame) {_ms(live)}; a render on the browser's request {_ms(render)}"
        )


def many_tenants(quick: bool) -> None:
    """A finished run of 10**6 tenants (one train row each): the dashboard's first load and a refresh."""
    import resource

    from mlora_lab.lab.dashboard import Dashboard
    from mlora_lab.lab.runs.run import Run

    n = 100_000 if quick else 1_000_000
    root = Path(tempfile.mkdtemp()) / "run"
    root.mkdir(parents=True)
    (root / "logs").mkdir()
    (root / "d.jsonl").write_text('{"text": "x"}\n')
    tenants = [{"name": f"t{i}", "data": "d.jsonl", "max_steps": 10} for i in range(n)]
    (root / "job.json").write_text(
        json.dumps({"base_model": str(root), "tenants": tenants, "max_tenants": n})
    )
    (root / "status.json").write_text(json.dumps({"state": "finished"}))
    with open(root / "metrics.jsonl", "w") as f:
        for i in range(n):
            row = {
                "kind": "train",
                "step": 1,
                "tenant": f"t{i}",
                "tenant_step": 1,
                "loss": 1.0 + i * 1e-6,
                "tokens": 10,
                "lr": 1e-4,
                "grad_norm": 1.0,
                "time": 1.8e9,
                "rows_seen": 1,
                "tokens_seen": 10,
            }
            f.write(json.dumps(row) + "\n")  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    dash = Dashboard([Run(root)], interactive=False)
    dash.refresh()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    dash.refresh()
    again = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dash.stop()
    print(
        f"5. a dashboard over {n:,} tenants (one train row each): built and first refresh {first:.1f} s, "
        f"next refresh {again * 1e3:.0f} ms; peak RSS {peak / 2**20:.2f} GiB ({(peak - before) / 2**20:.2f} GiB more)"
        f"   (goal: seconds; 106 s and 4.3 GB on fe8cc2b)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}; CPU; {'quick' if args.quick else 'full'} run")
    latency(args.quick)
    incremental_read(args.quick)
    dashboard_refresh(args.quick)
    many_tenants(args.quick)


if __name__ == "__main__":
    main()
