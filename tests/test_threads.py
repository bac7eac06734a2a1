"""Torch threads per job process (``mlora_lab.lab.threads``, measured in ``benchmarks/threads.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlora_lab.lab import launcher, threads
from mlora_lab.lab.threads import omp_threads, thread_env, threads_per_process, usable_cores


def test_rule_leaves_a_core_and_never_oversubscribes():
    assert [threads_per_process(n, cores=2) for n in (1, 2, 3)] == [1, 1, 1]
    assert threads_per_process(1, cores=1) == 1
    assert [threads_per_process(n, cores=16) for n in (1, 2, 4, 8, 16, 32)] == [15, 7, 3, 1, 1, 1]
    assert threads_per_process(1, busy=7, cores=16) == 8 and threads_per_process(2, busy=20, cores=16) == 1
    for cores in range(2, 33):
        for nproc in range(1, cores):
            assert nproc * threads_per_process(nproc, cores=cores) <= cores - 1
    assert usable_cores() >= 1


def test_a_users_omp_num_threads_is_kept():
    assert thread_env(1, environ={"OMP_NUM_THREADS": "3"}) == {}
    assert thread_env(2, environ={"OMP_NUM_THREADS": ""}) == {"OMP_NUM_THREADS": str(threads_per_process(2))}
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
