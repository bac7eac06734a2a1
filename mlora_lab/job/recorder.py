"""What the job writes about itself: metrics rows, events and each rank's system meters.

Rank 0 appends every row to ``metrics.jsonl`` (:class:`~mlora_lab.rundir.MetricsWriter`); every rank
also keeps the rows in memory (:attr:`Recorder.history`), which the in-job search reads and in-process
tests inspect. A row that cannot be written (a full disk) is kept in memory and said once per kind of
error: training goes on. Rank 0 also mirrors every row to the trackers job.json's ``report_to`` names
(:func:`mlora_lab.trackers.open_sink`, which imports them only then).
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import torch

from mlora_lab.parallel import Collectives
from mlora_lab.rundir import (
    EventKind,
    EventRow,
    MetricsWriter,
    Row,
    RowKind,
    RunDir,
    SystemRow,
    record_problem,
)
from mlora_lab.trackers import open_sink

if TYPE_CHECKING:
    from mlora_lab.trackers.mirror import Background


class Recorder:
    """Rows of one job. ``step`` is the global step the rows are stamped with; the trainer moves it."""

    def __init__(self, run: RunDir | None, comm: Collectives, is_main: bool, log_every: int = 1) -> None:
        self.run, self.comm, self.is_main, self.log_every = run, comm, is_main, log_every
        self.step = 0
        self.history: list[Row] = []  # every row (typed), also kept in memory
        self.metrics: MetricsWriter | None = None
        self.sink: Background | None = None  # the trackers of report_to (rank 0), off the loop
        self._write_errors: set[str] = set()
        self._cpu: CpuMeter | None = None
        self._gpu: GpuMeter | None = None

    def open(self) -> None:
        """Start appending to metrics.jsonl (rank 0; after a resume has cut the rows past its checkpoint)."""
        if self.run is not None and self.is_main:
            self.metrics = MetricsWriter(self.run.metrics)
            self.sink = open_sink(self.run, lambda why: self.event(EventKind.TRACKER_FAILED, why))

    def start_meters(self) -> None:
        """CPU and GPU use are measured from here (set-up excluded) to each system row."""
        self._cpu, self._gpu = CpuMeter(), GpuMeter(self.comm.device)

    def log(self, row: Row) -> None:
        self.history.append(row)
        if self.metrics is None:
            return
        try:
            self.metrics.write(row)
        except OSError as e:  # e.g. a full disk: training goes on; say so once per kind of error
            if str(e) not in self._write_errors:
                self._write_errors.add(str(e))
                print(f"metrics.jsonl: cannot write ({e}); rows are kept in memory", flush=True)
        if self.sink is not None:  # never raises: a tracker that fails is said once and dropped
            self.sink.write(row)

    def event(self, event: EventKind, message: str) -> None:
        print(f"[{event.value}] {message}", flush=True)
        self.log(EventRow(step=self.step, event=event, message=message))
        if event is EventKind.SAVE_FAILED:  # the run goes on, but status.json says it cannot save
            self.save_problem(f"saving failed at step {self.step}: {message} (training goes on)")

    def save_problem(self, problem: str | None) -> None:
        """Say in status.json (rank 0) that saving fails while the run goes on, or, with ``None``, that
        it works again (:func:`~mlora_lab.rundir.record_problem`)."""
        if self.run is not None and self.is_main:
            record_problem(self.run.root, problem)

    def system(
        self,
        step_time: float,
        tokens: int,
        tenants: int | None = None,
        shares: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """One ``system`` row per rank (gathered to rank 0): memory, step time, throughput, CPU/GPU use,
        and how many tenants had rows in the step; ``shares()``: rank 0's row's ``rollout_busy`` and
        ``trainer_idle`` (asked only when rows are written). A collective every ``log_every`` steps."""
        if self.step % self.log_every:
            return
        said = shares() if shares is not None else {}
        mem, peak = memory_bytes(self.comm.device)
        cpu = self._cpu.percent() if self._cpu else None
        gpu = self._gpu.utilization() if self._gpu else None
        per_rank = self.comm.gather_objects((mem, peak, step_time, tokens, cpu, gpu, tenants))
        total_tokens = sum(r[3] for r in per_rank)
        for rank, (mem, peak, step_time, _, cpu, gpu, tenants) in enumerate(per_rank):
            self.log(
                SystemRow(
                    step=self.step,
                    rank=rank,
                    mem_bytes=mem,
                    peak_mem_bytes=peak,
                    step_time=step_time,
                    tokens_per_s=total_tokens / step_time if step_time > 0 else 0.0,
                    cpu_percent=cpu,
                    gpu_util=gpu,
                    tenants=tenants,
                    **(said if rank == 0 else {}),
                )
            )

    def losses(self, tenant: str) -> list[float]:
        """Per-step training losses of ``tenant`` (from the in-memory rows)."""
        return [r["loss"] for r in self.history if r["kind"] == RowKind.TRAIN and r["tenant"] == tenant]

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        if self.metrics is not None:
            self.metrics.close()


class CpuMeter:
    """CPU used by this process and its live children between two calls of :meth:`percent`."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._times = self._tree_times()
        self._at = time.monotonic()

    def _tree_times(self) -> dict[int, float]:
        """CPU seconds (user + system) of this process and each live descendant, by pid. This process's own by
        ``time.process_time`` (nanoseconds): ``/proc``'s clock ticks are 10 ms, and two steps of a small model
        can use less, which read as 0 % CPU."""
        times = {self._me.pid: time.process_time()}
        with contextlib.suppress(psutil.Error):
            for p in self._me.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # a child may exit while we look
                    t = p.cpu_times()
                    times[p.pid] = t.user + t.system
        return times

    def percent(self) -> float | None:
        """Percent of one core used since the previous call (or since this meter was made)."""
        times, now = self._tree_times(), time.monotonic()
        # a child born since the previous call used all of its time inside the interval
        used = sum(max(t - self._times.get(pid, 0.0), 0.0) for pid, t in times.items())
        elapsed, self._times, self._at = now - self._at, times, now
        return 100.0 * used / elapsed if elapsed > 0 else None


class GpuMeter:
    """GPU utilisation of this process's device (``torch.cuda.utilization``, through NVML); ``None``
    on CPU, and from the first failure on (no ``pynvml``, no NVML driver) without trying again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._available = device.type == "cuda"

    def utilization(self) -> float | None:
        if not self._available:
            return None
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:  # pynvml missing, or NVML not usable here: the field stays empty
            self._available = False
            return None


def memory_bytes(device: torch.device) -> tuple[int, int]:
    """(current, peak) memory of this process: torch.cuda figures on GPU, RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss, max(peak, rss)
