"""How many torch (OpenMP) threads each process of a job gets.

The rule, from ``benchmarks/threads.py`` (2-core machine; see benchmarks/README.md, "Threads per process"):
OpenMP slows down by 5-50x as soon as a job's threads and anything else runnable (another process of
the job, a second job, the notebook that launched it, other people's work) want more cores than
there are, because a descheduled thread stalls every parallel region; a second thread per process
gained at most 1.45x, and only on an otherwise idle machine. So:

- an ``OMP_NUM_THREADS`` the user set is always kept;
- otherwise every process gets ``max(1, (cores - 1 - busy) // nproc)`` threads: the usable physical
  cores (:func:`usable_cores`), less one left for the notebook or shell that launched the job and the
  rest of the machine, less ``busy`` (threads of other jobs this process started and that still
  run), shared by the job's ``nproc`` processes; never fewer than one.

Standard library and psutil only: the training processes may import it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping

import psutil


def usable_cores() -> int:
    """Physical cores this process may use: the machine's physical cores, capped by the CPU affinity
    mask (``taskset``, container CPU sets) and a cgroup CPU quota (``docker --cpus``)."""
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    cores = psutil.cpu_count(logical=False) or logical
    # the allowed logical CPUs, as physical cores (two hyperthreads are one core); no affinity API on macOS
    with contextlib.suppress(AttributeError, OSError):
        cores = min(cores, max(1, len(os.sched_getaffinity(0)) * cores // logical))
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def _cgroup_cpu_quota() -> int | None:
    """Whole CPUs of the cgroup's quota, rounded up (v2 ``cpu.max``, v1 ``cfs_quota_us``); None if unlimited."""
    for path, parse in (
        ("/sys/fs/cgroup/cpu.max", lambda s: s.split()[:2]),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", None),
    ):
        try:
            with open(path) as f:
                text = f.read().strip()
            if parse is not None:
                quota, period = parse(text)
            else:
                with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                    quota, period = text, f.read().strip()
            if quota in ("max", "-1"):
                return None
            return max(1, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return None


def threads_per_process(nproc: int, busy: int = 0, cores: int | None = None) -> int:
    """Torch threads for each of a job's ``nproc`` processes on ``cores`` cores (default
    :func:`usable_cores`) of which other jobs already use ``busy``: ``max(1, (cores - 1 - busy) // nproc)``
    (all ``cores`` on a one-core machine)."""
    cores = usable_cores() if cores is None else cores
    spare = max(1, cores - 1)  # one core for the launching notebook / shell and the rest of the machine
    return max(1, (spare - busy) // max(1, nproc))


def thread_env(nproc: int, busy: int = 0, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": ...}`` for a job of ``nproc`` processes, or ``{}`` if ``environ`` (default
    ``os.environ``) already sets it (the user's choice wins). torch reads it when it starts, so the
    job's processes run with exactly that many intra-op threads (``torch.get_num_threads()``)."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(threads_per_process(nproc, busy))}


def omp_threads(value: str | None) -> int:
    """The thread count an ``OMP_NUM_THREADS`` value asks for at the outer level (``"4"``, ``"4,2"``); 1 if unreadable."""
    try:
        return max(1, int((value or "").split(",")[0]))
    except ValueError:
        return 1
