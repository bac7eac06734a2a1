"""How many torch (OpenMP) threads each process of a job gets.

The rule, from ``benchmarks/threads.py`` (2-core machine; see benchmarks/README.md, "Threads per process"):
OpenMP slows down by 5-50x as soon as a job's threads and anything else runnable (another process of
the job, a second job, the notebook that launched it, other people's work) want more cores than
there are, because a descheduled thread stalls every parallel region; on an idle machine, though, a
second thread per process is a real gain (1.45x for one process). So the launcher looks at the machine
as it starts a job:

- an ``OMP_NUM_THREADS`` the user set is always kept;
- on an **idle** machine (other processes keep less than :data:`IDLE_LOAD` of a core busy over a short
  sample: :func:`machine_load`, and no job this process started still runs) every process gets
  ``max(1, cores // nproc)`` threads: nothing else wants the cores, so none is left idle;
- on a **busy** machine, the protective rule: ``max(1, (cores - others) // nproc)``, where ``others`` is
  one core (for the notebook or shell that launched the job and the rest of the machine) plus ``busy``,
  the threads of other jobs this process started that still run, or the cores the sample found busy
  (rounded up past :data:`IDLE_LOAD`) if that is more; never fewer than one thread.

``cores`` are the usable physical cores (:func:`usable_cores`). A job started on an idle machine keeps its
threads when something else starts later; jobs meant to share a machine should be given
``OMP_NUM_THREADS`` (the tests do: they start jobs side by side).

Standard library and psutil only.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping

import psutil

IDLE_LOAD = 0.25
"""Cores other processes may keep busy while the machine still counts as idle (a shell, a notebook
waiting for its kernel, background daemons)."""


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


def machine_load(interval: float = 0.25) -> float:
    """How many cores the machine's other processes kept busy over the next ``interval`` seconds (this
    process excluded): the machine's busy CPU time (user, nice, system, interrupts; not idle, I/O wait or
    a hypervisor's steal) less this process's, per second."""
    me = psutil.Process()

    def busy() -> tuple[float, float]:
        t, own = psutil.cpu_times(), me.cpu_times()
        machine = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return machine, own.user + own.system

    (m0, o0), t0 = busy(), time.monotonic()
    time.sleep(interval)
    (m1, o1), t1 = busy(), time.monotonic()
    return max((m1 - m0) - (o1 - o0), 0.0) / max(t1 - t0, 1e-6)


def threads_per_process(
    nproc: int, busy: int = 0, cores: int | None = None, load: float | None = None
) -> int:
    """Torch threads for each of a job's ``nproc`` processes on ``cores`` cores (default
    :func:`usable_cores`), when other jobs started from here use ``busy`` threads and the machine's other
    processes keep ``load`` cores busy (``None``: not measured, taken as busy). Idle (``load`` below
    :data:`IDLE_LOAD`, ``busy`` 0): ``max(1, cores // nproc)``; else ``max(1, (cores - others) // nproc)``
    with ``others = max(1 + busy, ⌈load - IDLE_LOAD⌉)`` (all ``cores`` on a one-core machine)."""
    cores = usable_cores() if cores is None else cores
    nproc = max(1, nproc)
    if load is not None and load < IDLE_LOAD and busy == 0:
        return max(1, cores // nproc)
    measured = math.ceil(load - IDLE_LOAD) if load is not None else 0
    others = max(1 + busy, measured) if cores > 1 else 0
    return max(1, (cores - others) // nproc)


def thread_env(
    nproc: int, busy: int = 0, environ: Mapping[str, str] | None = None, load: float | None = None
) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": ...}`` for a job of ``nproc`` processes, or ``{}`` if ``environ`` (default
    ``os.environ``) already sets it (the user's choice wins). ``load``: the machine's other load
    (:func:`machine_load`), measured here when not given. torch reads the variable when it starts, so
    the job's processes run with exactly that many intra-op threads (``torch.get_num_threads()``)."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return {}
    if load is None and busy == 0:
        load = machine_load()
    return {"OMP_NUM_THREADS": str(threads_per_process(nproc, busy, load=load))}


def omp_threads(value: str | None) -> int:
    """The thread count an ``OMP_NUM_THREADS`` value asks for at the outer level (``"4"``, ``"4,2"``); 1 if unreadable."""
    try:
        return max(1, int((value or "").split(",")[0]))
    except ValueError:
        return 1
