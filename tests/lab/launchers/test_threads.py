"""Torch threads per job process (``mlora_lab.lab.launchers.threads``, measured in ``benchmarks/threads.py``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from mlora_lab.lab.launchers import local as launcher
from mlora_lab.lab.launchers import threads
from mlora_lab.lab.launchers.threads import omp_threads, thread_env, threads_per_process, usable_cores


def test_a_busy_machine_keeps_a_core_and_is_never_oversubscribed():
    """Load not measured, or measured busy: one core left for the rest, other jobs' threads counted."""
    for load in (None, 0.3, 1.0):
        assert [threads_per_process(n, cores=2, load=load) for n in (1, 2, 3)] == [1, 1, 1]
    assert threads_per_process(1, cores=1) == 1 and threads_per_process(1, cores=1, load=0.9) == 1
    assert [threads_per_process(n, cores=16) for n in (1, 2, 4, 8, 16, 32)] == [15, 7, 3, 1, 1, 1]
    assert threads_per_process(1, busy=7, cores=16) == 8 and threads_per_process(2, busy=20, cores=16) == 1
    assert threads_per_process(1, cores=16, load=3.0) == 13  # the measured load, when more than one core
    assert threads_per_process(1, busy=2, cores=16, load=0.0) == 13  # our own running jobs are never idle
    for cores in range(2, 33):
        for nproc in range(1, cores):
            for load in (None, 0.5, 2.0):
                assert nproc * threads_per_process(nproc, cores=cores, load=load) <= cores - 1
    assert usable_cores() >= 1


def test_an_idle_machine_is_used_whole():
    """Nothing else runs (less than a quarter of a core busy): every core goes to the job."""
    assert [threads_per_process(n, cores=2, load=0.05) for n in (1, 2, 3)] == [2, 1, 1]
    assert [threads_per_process(n, cores=16, load=0.2) for n in (1, 2, 4, 8, 16, 32)] == [16, 8, 4, 2, 1, 1]


def test_the_machine_load_is_measured_without_this_process():
    """A spinning child counts (about one core); this process spinning meanwhile does not."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"]
    )
    try:
        time.sleep(0.5)
        assert threads.machine_load(0.5) >= 0.5
    finally:
        child.kill()
        child.wait()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        while_spinning = threads.machine_load(0.5)
    finally:
        stop.set()
        spinner.join()
    # this process's own spinning thread (a whole core) is not the machine's load
    assert while_spinning < threads.machine_load(0.5) + 0.5


def test_thread_env_measures_the_machine_when_it_decides(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "machine_load", lambda interval=0.25: 0.02)
    assert thread_env(1, environ={}) == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setattr(threads, "machine_load", lambda interval=0.25: 1.1)
    assert thread_env(1, environ={}) == {"OMP_NUM_THREADS": "1"}


def test_a_users_omp_num_threads_is_kept():
    assert thread_env(1, environ={"OMP_NUM_THREADS": "3"}) == {}
    assert thread_env(2, environ={"OMP_NUM_THREADS": ""}, load=1.0) == {
        "OMP_NUM_THREADS": str(threads_per_process(2))
    }
    assert (
        omp_threads("4") == 4 and omp_threads("4,2") == 4 and omp_threads("x") == 1 and omp_threads(None) == 1
    )


class _Alive:
    def poll(self):
        return None


class _Done:
    def poll(self):
        return 0


def test_jobs_started_here_count_as_busy(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.setattr(threads, "machine_load", lambda interval=0.25: 1.0)  # someone else's work
    monkeypatch.setattr(launcher, "_started", [])
    assert launcher.job_env(2)["OMP_NUM_THREADS"] == "7"
    launcher._started.extend([(_Alive(), 8), (_Done(), 6)])
    assert launcher.job_env(1)["OMP_NUM_THREADS"] == "7"  # 15 spare - 8 busy; the finished job is forgotten
    assert len(launcher._started) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert launcher.job_env(1)["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize("omp", ["1", "2"])
def test_the_job_process_runs_with_that_many_torch_threads(omp, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    env = launcher.job_env(1)
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == omp
