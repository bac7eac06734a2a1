"""The launcher seam: launchers by name, a third engine that is one module, status.json's launcher_job.

The proof that "a new engine is then one module": :class:`FakeEngine` below is an engine the package has
never heard of, written against the Launcher protocol only. It queues a job until the test releases it,
then runs the real job as a process of its own, and answers in its own words. Registered in the test, it
runs through ``ml.launch`` / ``run.wait`` / ``run.kill`` / ``mlora-lab status`` with no change elsewhere:
queued with its reason, finished, killed while queued, and failed with its words when it ends a job.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

import mlora_lab as ml
from mlora_lab.lab import cli
from mlora_lab.lab.launch import read_options
from mlora_lab.lab.launchers import registry
from mlora_lab.lab.launchers.base import EngineJob, Launcher, LauncherError
from mlora_lab.lab.launchers.local import (
    LocalLauncher,
    identity_id,
    identity_of,
    job_env,
    kill_job,
    torchrun_command,
)
from mlora_lab.lab.slurm.cluster import SlurmError, SlurmOptions
from mlora_lab.rundir import RunDir, read_status, update_status
from mlora_lab.rundir.status import JobRef, ProcessIdentity
from mlora_lab.search import LogUniform, Random

slow = pytest.mark.slow


# -- the registry -----------------------------------------------------------------------------------------


def test_the_registry_names_local_slurm_and_ray_and_refuses_others_naming_them():
    assert registry.names()[:3] == ("local", "slurm", "ray")
    assert registry.get("local").name == "local" and registry.get("slurm").name == "slurm"
    assert isinstance(registry.get("slurm"), Launcher)
    assert registry.get("slurm").options_type is SlurmOptions
    with pytest.raises(ml.SpecError, match=r"unknown launcher 'k8s'; known: local, slurm, ray"):
        registry.get("k8s")
    assert issubclass(SlurmError, LauncherError)


def test_a_launcher_whose_module_cannot_be_imported_says_which(monkeypatch):
    monkeypatch.setitem(registry.LAUNCHERS, "nowhere", "mlora_lab.lab.launchers.no_such_engine:Engine")
    with pytest.raises(LauncherError, match=r"the nowhere launcher cannot be loaded \(ModuleNotFoundError"):
        registry.get("nowhere")


def test_options_for_another_launcher_or_of_another_type_are_one_problem_each(llama_path, tmp_path):
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    with pytest.raises(
        ml.SpecError, match=r"Ray options were given, but the launcher is 'local'; use launcher='ray'"
    ):
        ml.launch(spec, ray=object())
    with pytest.raises(ml.SpecError, match=r"slurm= takes an ml.SlurmOptions, not dict"):
        ml.launch(spec, launcher="slurm", slurm={"time": "10"})
    with pytest.raises(TypeError, match=r"^launch\(\) got an unexpected keyword argument 'k8s'"):
        ml.launch(spec, k8s=1)
    with pytest.raises(ml.SpecError, match=r"unknown launcher 'k8s'; known: local, slurm, ray"):
        ml.launch(spec, launcher="k8s")
    assert not (tmp_path / "r").exists()


def test_a_misspelt_keyword_is_a_type_error_naming_the_launchers_that_take_options(llama_path, tmp_path):
    """``**options`` takes launchers' options only: any other keyword is Python's own TypeError, as before
    the seam, and the hint names only the launchers that take options (not ``local``)."""
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    hint = r" \(launchers take their options as slurm=\.\.\., ray=\.\.\.\)$"
    with pytest.raises(TypeError, match=r"^launch\(\) got an unexpected keyword argument 'wrkdir'" + hint):
        ml.launch(spec, wrkdir=str(tmp_path))
    with pytest.raises(TypeError, match=r"^resume\(\) got an unexpected keyword argument 'nprocs'" + hint):
        ml.resume(tmp_path / "r", nprocs=2)
    with pytest.raises(TypeError, match=r"^sweep\(\) got an unexpected keyword argument 'budjet'"):
        ml.sweep(spec, {"lr": LogUniform(1e-4, 1e-2)}, Random(2), budjet=3)
    assert not (tmp_path / "r").exists()
    assert registry.with_options()[:2] == ("slurm", "ray") and "local" not in registry.with_options()


def test_launcher_none_is_the_local_launcher(llama_path, tmp_path, monkeypatch):
    """``ml.launch(spec, launcher=None)`` is a local launch, as before the seam (its run says ``local``)."""
    submitted = []

    class NoStart(LocalLauncher):
        def submit(self, run_dir, spec, options=None, resume=False):
            submitted.append(run_dir.root)
            return JobRef("local", identity_id(ProcessIdentity(1, None, "elsewhere")))

    monkeypatch.setitem(registry.LAUNCHERS, "local", NoStart)
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    run = ml.launch(spec, launcher=None)
    assert submitted == [run.path] and read_status(run.path).launcher == "local"


def test_a_local_job_ref_holds_the_process_identity_and_is_killed_by_it_only():
    # a process that looks like a job (its command line names the job's module) and is not one of ours
    code = "import time; print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, "mlora_lab.job"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"  # (it runs: its command line is readable)
        me = ProcessIdentity.of(proc.pid)
        ref = JobRef("local", identity_id(me))
        assert identity_of(ref) == me
        assert LocalLauncher().status(ref) == EngineJob("RUNNING", f"the job's process (pid {proc.pid}) runs")
        stranger = dataclasses.replace(me, start_ticks=me.start_ticks + 1, start_time=me.start_time - 99)
        gone = LocalLauncher().status(JobRef("local", identity_id(stranger)))
        assert gone.final and not gone.clean  # the pid belongs to another process: never signalled
        LocalLauncher().kill(JobRef("local", identity_id(stranger)), timeout=5)
        assert proc.poll() is None
        ended = LocalLauncher().kill(ref, timeout=30)
        assert ended.final and me.alive() is False  # (reaped by the kill: psutil waited for it)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(LauncherError, match="not a local job's process identity"):
        identity_of(JobRef("local", "42"))


# -- an engine this Python does not know, and engines installed by other distributions --------------------


def test_a_run_of_an_engine_not_registered_here_believes_its_status_file(tmp_path, capsys):
    """status.json names a job of an engine registered in another process ('k8s'): reading the run (its
    status, repr, ``mlora-lab status``, ``ml.runs``) believes the file, with the reason the engine cannot
    be asked, as when Slurm does not answer; stopping or killing it says why it cannot."""
    run_dir = RunDir(tmp_path / "runs" / "r").create()
    ml.JobSpec(base_model="m", tenants=[], stay_up=True).to_json(run_dir.job)
    update_status(run_dir.root, state="running", launcher="k8s", launcher_job=JobRef("k8s", "job-7"))
    run = ml.attach(run_dir.root)
    assert run.status == "running" and "status='running'" in repr(run)
    assert run.reason.startswith("launcher 'k8s' is not registered in this Python (known: local, slurm, ray")
    assert "its job job-7 cannot be asked from here" in run.reason
    assert cli.main(["status", str(run.path)]) == 0
    assert "running: launcher 'k8s' is not registered in this Python" in capsys.readouterr().out
    assert len(ml.runs(tmp_path / "runs")) == 1
    with pytest.raises(LauncherError, match="launcher 'k8s' is not registered in this Python"):
        run.liveness.kill(timeout=1)
    with pytest.raises(LauncherError, match="launcher 'k8s' is not registered in this Python"):
        run.liveness.signal_stop()
    with pytest.raises(LauncherError, match="launcher 'k8s' is not registered"):
        run.engine_job  # noqa: B018
    update_status(run_dir.root, state="stopped")  # its end, unconfirmed: believed for the view
    assert run.status == "stopped" and not run.liveness.verdict().confirmed
    assert read_status(run.path).launcher_state is None, "nothing recorded: the engine is asked again"


@pytest.fixture
def installed_engine(tmp_path, monkeypatch):
    """A distribution installed on sys.path that declares the engine 'k9s' in the entry-point group
    ``mlora_lab.launchers`` (its module: FakeEngine under another name), read afresh by the registry."""
    site = tmp_path / "site"
    (site / "k9s_engine").mkdir(parents=True)
    (site / "k9s_engine" / "__init__.py").write_text(
        "from test_seam import FakeEngine\n\nclass K9sEngine(FakeEngine):\n    name = 'k9s'\n"
    )
    info = site / "k9s_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k9s-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[mlora_lab.launchers]\nk9s = k9s_engine:K9sEngine\nlocal = k9s_engine:K9sEngine\n"
    )
    monkeypatch.syspath_prepend(str(site))
    registry.installed.cache_clear()
    yield
    registry.installed.cache_clear()


def test_an_engine_installed_by_a_distribution_is_one_entry_point(installed_engine, llama_path, tmp_path):
    """A new engine is one module and one entry point: named by the registry (after the built-in ones,
    which an entry point cannot replace), loaded on first use, and checked by ``ml.launch``."""
    assert registry.names()[:3] == ("local", "slurm", "ray") and "k9s" in registry.names()
    assert registry.unknown("k9s") is None and registry.get("local").name == "local"
    engine = registry.get("k9s")
    assert engine.name == "k9s" and engine.options_type is FakeOptions
    assert isinstance(registry.for_job(JobRef("k9s", "1")), Launcher)
    spec = ml.JobSpec(
        base_model=llama_path,
        tenants=[],
        stay_up=True,
        output_dir=str(tmp_path / "r"),
        parallel=ml.Parallel(nproc=1, nnodes=3, fsdp=3),
    )
    with pytest.raises(ml.SpecError, match="the fake cluster has 2 nodes, not 3"):
        ml.launch(spec, launcher="k9s", k9s=FakeOptions())


def test_an_installed_engine_that_cannot_be_imported_says_which_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "broken-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mlora_lab.launchers]\nbroken = no_such_module:Engine\n")
    monkeypatch.syspath_prepend(str(site))
    registry.installed.cache_clear()
    try:
        with pytest.raises(
            LauncherError, match=r"the broken launcher \(no_such_module:Engine, declared by broken\)"
        ):
            registry.get("broken")
    finally:
        registry.installed.cache_clear()


# -- a local run is stopped and killed by the local launcher ------------------------------------------------


def test_a_local_run_is_stopped_and_killed_through_the_local_launcher(tmp_path, monkeypatch):
    """The liveness signals a local job only through ``registry.get("local")`` (one implementation of
    "never signal a stale pid"), with the process this Python started, whose exit code it keeps."""
    calls = []

    class Spy(LocalLauncher):
        def stop(self, ref):
            calls.append(("stop", ref))
            return super().stop(ref)

        def kill(self, ref, timeout=120):
            calls.append(("kill", ref))
            return super().kill(ref, timeout)

    monkeypatch.setitem(registry.LAUNCHERS, "local", Spy)
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); print('ready', flush=True); time.sleep(60)"
    run_dir = RunDir(tmp_path / "r").create()
    run_dir.job.write_text("{}")
    procs = []
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "mlora_lab.job"], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline() == "ready\n"
    try:
        from mlora_lab.lab.launchers.liveness import Liveness
        from mlora_lab.rundir.status import process_fields

        me = ProcessIdentity.of(procs[0].pid)
        update_status(run_dir.root, state="running", launcher="local", **process_fields(me))
        live = Liveness(run_dir.root, procs[0])
        live.signal_stop()
        assert procs[0].wait(30) == 3 and calls == [("stop", JobRef("local", identity_id(me)))]
        assert live.verdict().state == "failed" and "code 3" in live.verdict().error  # the exit code it saw
        other = ProcessIdentity.of(procs[1].pid)  # a job this Python did not start: by its record
        update_status(run_dir.root, state="running", **process_fields(other))
        calls.clear()
        Liveness(run_dir.root).kill(timeout=30)
        assert calls == [("kill", JobRef("local", identity_id(other)))] and procs[1].poll() is not None
        assert read_status(run_dir.root).state == "stopped" and read_status(run_dir.root).error == "killed"
        calls.clear()
        Liveness(run_dir.root).kill(timeout=30)  # nothing runs: nothing is signalled
        assert calls == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# -- status.json: launcher_job, and old runs' Slurm fields --------------------------------------------------


def test_old_slurm_fields_are_read_as_a_job_ref_and_written_beside_the_new_ones(tmp_path):
    """A status.json from before the seam (``slurm_job_id``, ``slurm_state`` only) reads as a JobRef; a Slurm
    run's status.json carries the old fields beside the new ones (scripts outside read them) until the
    removal date; another engine's carries none."""
    run = RunDir(tmp_path / "r").create()
    run.status.write_text(
        json.dumps({"state": "stopped", "launcher": "slurm", "slurm_job_id": 42, "slurm_state": "CANCELLED"})
    )
    status = read_status(run.root)
    assert status.launcher_job == JobRef("slurm", "42") and status.launcher_state == "CANCELLED"
    assert status.slurm_job_id == 42 and status.slurm_state == "CANCELLED"
    update_status(run.root, error="killed")
    written = json.loads(run.status.read_text())
    assert (
        written["launcher_job"] == {"kind": "slurm", "id": "42"} and written["launcher_state"] == "CANCELLED"
    )
    assert written["slurm_job_id"] == 42 and written["slurm_state"] == "CANCELLED"
    update_status(run.root, launcher_job=JobRef("slurm", "43"), launcher_state=None)
    written = json.loads(run.status.read_text())
    assert written["slurm_job_id"] == 43 and written["slurm_state"] is None
    assert read_status(run.root).slurm_job_id == 43, "the new fields win over the old ones they sit beside"
    update_status(run.root, launcher_job=JobRef("ray", "raysubmit_1"), launcher_state=None)
    status = read_status(run.root)
    assert status.launcher_job == JobRef("ray", "raysubmit_1") and status.slurm_job_id is None
    assert status.slurm_state is None and "slurm_job_id" not in json.loads(run.status.read_text())
    run.status.write_text(json.dumps({"state": "running", "slurm_job_id": "42"}))
    with pytest.raises(ml.rundir.RunDirError, match=r"slurm_job_id has the wrong type \(str\)"):
        read_status(run.root)
    run.status.write_text(json.dumps({"state": "running", "launcher_job": {"kind": "ray"}}))
    with pytest.raises(ml.rundir.RunDirError, match=r"launcher_job must be \{'kind': str, 'id': str\}"):
        read_status(run.root)
    # a later version's extra keys are ignored (forward compatible)
    run.status.write_text(
        json.dumps({"state": "running", "launcher_job": {"kind": "ray", "id": "r1", "n": 2}})
    )
    assert read_status(run.root).launcher_job == JobRef("ray", "r1")


def test_a_launchers_options_file_is_named_by_the_one_legacy_table(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.launcher_options("slurm") == run.slurm_options == run.root / "slurm.json"
    assert run.launcher_options("ray") == run.root / "ray_options.json"


# -- a third engine, one module: through ml.launch, wait, kill and the CLI -------------------------------


@dataclasses.dataclass
class FakeOptions:
    hold: bool = True
    """Queue the job until :meth:`FakeEngine.release` (else start it at once)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> FakeOptions:
        return cls(**d)


class FakeEngine:
    """An engine that queues jobs and runs each as a local process: the Launcher protocol, nothing else."""

    name: ClassVar[str] = "fake"
    options_type: ClassVar[type | None] = FakeOptions
    queues: ClassVar[bool] = True
    jobs: ClassVar[dict[str, dict]] = {}
    """job id -> {"run": RunDir, "spec", "resume", "proc": Popen | None, "ended": engine state | None}"""

    def check(self, spec, options, run_dir, resume=False):
        return (
            [] if spec.parallel.nnodes <= 2 else [f"the fake cluster has 2 nodes, not {spec.parallel.nnodes}"]
        )

    def submit(self, run_dir, spec, options, resume=False):
        job_id = str(len(self.jobs) + 1)
        self.jobs[job_id] = {"run": run_dir, "spec": spec, "resume": resume, "proc": None, "ended": None}
        if not (options or FakeOptions()).hold:
            self.release(job_id)
        return JobRef(self.name, job_id)

    @classmethod
    def release(cls, job_id: str) -> None:
        job = cls.jobs[job_id]
        log = open(job["run"].logs / "launcher.log", "ab")  # noqa: SIM115 (the job's output, for as long as it runs)
        job["proc"] = subprocess.Popen(
            torchrun_command(job["spec"], job["run"].root, job["resume"]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=job_env(1),
        )

    def status(self, ref):
        job = self.jobs.get(ref.id)
        if job is None:
            return None
        if job["ended"] is not None:
            return EngineJob(job["ended"], f"Fake job {ref.id} was {job['ended'].lower()}", final=True)
        if job["proc"] is None:
            return EngineJob("HELD", f"Fake job {ref.id} waits for a slot (held)", pending=True)
        code = job["proc"].poll()
        if code is None:
            return EngineJob("BUSY", f"Fake job {ref.id} runs")
        state = "DONE" if code == 0 else "CRASHED"
        return EngineJob(
            state, f"Fake job {ref.id} ended ({state}, code {code})", final=True, clean=code == 0
        )

    def stop(self, ref):
        raise LauncherError("the fake engine stops nothing gracefully")

    def kill(self, ref, timeout=120):
        job = self.jobs[ref.id]
        if job["proc"] is not None:
            kill_job(job["proc"].pid)
            job["proc"].wait(timeout)
        job["ended"] = "CANCELLED"
        return self.status(ref)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(registry.LAUNCHERS, "fake", FakeEngine)
    monkeypatch.setattr(FakeEngine, "jobs", {})
    return FakeEngine


def tiny_job(llama_path: str, make_data, out: Path, **kw) -> ml.JobSpec:
    tenant = ml.Tenant(name="a", data=make_data("upper", 16), rank=4, lr=5e-3, max_steps=3)
    return ml.JobSpec(
        base_model=llama_path, tenants=[tenant], seq_len=32, max_rank=8, output_dir=str(out), **kw
    )


def test_a_third_engine_is_checked_by_its_own_check(fake, llama_path, make_data, tmp_path):
    spec = tiny_job(llama_path, make_data, tmp_path / "r", parallel=ml.Parallel(nproc=1, nnodes=3, fsdp=3))
    with pytest.raises(ml.SpecError, match="the fake cluster has 2 nodes, not 3"):
        ml.launch(spec, launcher="fake")
    with pytest.raises(ml.SpecError, match=r"fake= takes an ml.FakeOptions, not SlurmOptions"):
        ml.launch(spec, launcher="fake", fake=SlurmOptions())
    assert not (tmp_path / "r").exists()


@slow
def test_a_third_engine_runs_through_launch_wait_and_the_cli(fake, llama_path, make_data, tmp_path, capsys):
    run = ml.launch(
        tiny_job(llama_path, make_data, tmp_path / "r"), launcher="fake", fake=FakeOptions(hold=True)
    )
    status = read_status(run.path)
    assert (
        status.launcher == "fake" and status.launcher_job == JobRef("fake", "1") and status.state == "queued"
    )
    assert run.status == "queued" and run.reason == "Fake job 1 waits for a slot (held)"
    assert run.engine_job.pending and run.process is None
    assert read_options(RunDir(run.path), "fake") == FakeOptions(hold=True)  # (fake_options.json)
    assert cli.main(["status", str(run.path)]) == 0
    assert "queued: Fake job 1 waits for a slot (held)" in capsys.readouterr().out
    fake.release("1")
    assert run.wait(300) == "finished", run.logs(None)
    status = read_status(run.path)
    assert status.launcher_state == "DONE" and run.engine_job.state == "DONE"
    assert run.metrics()["tenant_step"].max() == 3


def test_a_third_engine_kills_a_queued_job_and_ends_one_with_its_words(fake, llama_path, make_data, tmp_path):
    run = ml.launch(tiny_job(llama_path, make_data, tmp_path / "r"), launcher="fake")
    assert run.status == "queued"
    run.kill()
    status = read_status(run.path)
    assert status.state == "stopped" and status.error == "cancelled while queued (Fake job 1)"
    assert status.launcher_state == "CANCELLED"
    # a job the engine ended, though the run directory says it runs: failed with the engine's words
    other = ml.launch(tiny_job(llama_path, make_data, tmp_path / "o"), launcher="fake")
    update_status(other.path, state="running")
    fake.jobs["2"]["ended"] = "PREEMPTED"
    assert other.status == "failed"
    assert other.error == "Fake job 2 was preempted; resume it from its last checkpoint"
    assert other.reconcile() == "failed" and read_status(other.path).launcher_state == "PREEMPTED"
    fake.jobs.clear()  # the engine forgets: its verdict is recorded, it is asked no more
    assert ml.attach(other.path).status == "failed"


def test_a_failure_the_dying_job_writes_during_a_kill_is_recorded_as_the_kill(
    fake, llama_path, make_data, tmp_path, monkeypatch
):
    """SIGKILL reaches the nodes one by one: rank 0 sees a peer vanish and writes ``failed`` just before
    its own SIGKILL. That is the kill's echo: the run is ``stopped`` (killed). A run that had already
    ended before the kill keeps its own end."""
    real = FakeEngine.kill

    def echo(self, ref, timeout=120):
        if self.jobs[ref.id]["proc"] is not None:
            update_status(self.jobs[ref.id]["run"].root, state="failed", error="a peer's socket closed")
        return real(self, ref, timeout)

    monkeypatch.setattr(FakeEngine, "kill", echo)
    run = ml.launch(tiny_job(llama_path, make_data, tmp_path / "r"), launcher="fake")
    fake.jobs["1"]["proc"] = subprocess.Popen(["sleep", "600"], start_new_session=True)  # (it runs)
    update_status(run.path, state="running")
    run.kill()
    status = read_status(run.path)
    assert (status.state, status.error, status.launcher_state) == (
        "stopped",
        "killed (Fake job 1)",
        "CANCELLED",
    )
    assert run.status == "stopped"

    ended = ml.launch(tiny_job(llama_path, make_data, tmp_path / "e"), launcher="fake")
    update_status(ended.path, state="failed", error="out of memory")  # its own end, before the kill
    ended.kill()
    status = read_status(ended.path)
    assert (status.state, status.error) == ("failed", "out of memory")


def test_a_job_whose_launcher_job_cannot_be_recorded_is_killed(
    fake, llama_path, make_data, tmp_path, monkeypatch
):
    """The engine took the job, then status.json could not record it (a full disk): nothing could follow
    the job, so it is killed (as a local process whose pid cannot be recorded), and the error raised."""
    from mlora_lab.lab import launch as launch_module

    real = launch_module.update_status

    def full(root, **fields):
        if fields.get("launcher_job") is not None:
            raise OSError(28, "No space left on device")
        return real(root, **fields)

    monkeypatch.setattr(launch_module, "update_status", full)
    with pytest.raises(OSError, match="No space left on device"):
        ml.launch(tiny_job(llama_path, make_data, tmp_path / "r"), launcher="fake")
    assert fake.jobs["1"]["ended"] == "CANCELLED"
    status = read_status(tmp_path / "r")
    assert status.state == "failed" and "No space left on device" in status.error


def test_a_third_engine_that_cannot_be_asked_leaves_an_end_unconfirmed(
    fake, llama_path, make_data, tmp_path, monkeypatch
):
    run = ml.launch(tiny_job(llama_path, make_data, tmp_path / "r"), launcher="fake")
    update_status(run.path, state="stopped")

    def down(self, ref):
        raise LauncherError("the fake head does not answer")

    monkeypatch.setattr(FakeEngine, "status", down)
    assert run.status == "stopped"  # believed, for the view
    with pytest.raises(
        LauncherError, match=r"says the run is stopped, but Fake cannot say whether its job has"
    ):
        run.wait(timeout=0.3, poll=0.1)
    assert read_status(run.path).launcher_state is None


# -- the CLI ------------------------------------------------------------------------------------------------


def test_the_cli_takes_every_registered_launcher_and_its_options(tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["run", "job.json", "--launcher", "ray", "--ray-address", "ray://head:10001"])
    assert args.launcher == "ray" and args.ray_address == "ray://head:10001"
    args = parser.parse_args(["resume", "runs/x", "--launcher", "ray", "--nnodes", "1"])
    assert args.launcher == "ray" and args.nnodes == 1
    (tmp_path / "slurm.json").write_text(json.dumps({"partition": "gpu", "time": "10", "setup": ["echo hi"]}))
    args = parser.parse_args(
        [
            "run",
            "job.json",
            "--launcher",
            "slurm",
            "--launcher-options",
            str(tmp_path / "slurm.json"),
            "--time",
            "20",
        ]
    )
    assert cli.launcher_options(args, "slurm") == {
        "slurm": SlurmOptions(partition="gpu", time="20", setup=["echo hi"])
    }  # (the flags override the file's fields)
    (tmp_path / "bad.json").write_text(json.dumps({"nodes": 2}))
    args = parser.parse_args(
        ["run", "job.json", "--launcher", "slurm", "--launcher-options", str(tmp_path / "bad.json")]
    )
    with pytest.raises(ml.SpecError, match="slurm options: unknown Slurm options: nodes"):
        cli.launcher_options(args, "slurm")
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "job.json", "--launcher", "k8s"])


def test_the_cli_refuses_options_for_another_launcher_before_loading_any(tmp_path, monkeypatch, capsys):
    """``--ray-address`` with ``--launcher slurm`` (or local) is that one problem, found before any launcher
    is loaded: the Ray launcher here cannot even be imported, and is never tried."""
    monkeypatch.setitem(registry.LAUNCHERS, "ray", "mlora_lab.lab.launchers.no_such_engine:Engine")
    parser = cli.build_parser()
    args = parser.parse_args(["run", "job.json", "--launcher", "slurm", "--ray-address", "ray://head:10001"])
    with pytest.raises(ml.SpecError) as err:
        cli.launcher_options(args, "slurm")
    assert [str(p) for p in err.value.problems] == [
        "Ray options were given, but the launcher is 'slurm'; use --launcher ray"
    ]
    args = parser.parse_args(["run", "job.json", "--ray-address", "x", "--partition", "gpu"])
    with pytest.raises(ml.SpecError) as err:
        cli.launcher_options(args, "local")
    assert [str(p) for p in err.value.problems] == [
        "Slurm options were given, but the launcher is 'local'; use --launcher slurm",
        "Ray options were given, but the launcher is 'local'; use --launcher ray",
    ]
    assert cli.main(["run", str(tmp_path / "job.json"), "--ray-address", "x"]) == 2
    assert "Ray options were given, but the launcher is 'local'" in capsys.readouterr().err
    args = parser.parse_args(["run", "job.json", "--launcher", "ray", "--ray-address", "x"])
    with pytest.raises(ml.SpecError, match=r"the ray launcher cannot be loaded \(ModuleNotFoundError"):
        cli.launcher_options(args, "ray")


def test_a_resume_whose_launcher_cannot_be_loaded_lists_that_problem(
    llama_path, tmp_path, monkeypatch, capsys
):
    from mlora_lab.lab import launch as launch_module
    from mlora_lab.lab.launch import prepare_run

    monkeypatch.setitem(registry.LAUNCHERS, "nowhere", "mlora_lab.lab.launchers.no_such_engine:Engine")
    run = prepare_run(
        ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    )
    ended = {"state": "stopped", "launcher_job": JobRef("nowhere", "1"), "launcher_state": "DONE"}
    update_status(run.root, launcher="nowhere", **ended)
    run.launcher_options("nowhere").write_text("{}")
    # (a run with a checkpoint to resume from: what the resume checks before the launcher)
    monkeypatch.setattr(
        launch_module, "_resumable", lambda r: (ml.JobSpec.load(r.job), [], read_status(r.root))
    )
    with pytest.raises(ml.SpecError) as err:
        ml.resume(run.root)
    (problem,) = err.value.problems
    assert str(problem).startswith("the nowhere launcher cannot be loaded (ModuleNotFoundError")
    assert cli.main(["resume", str(run.root), "--no-follow"]) == 2
    assert "the nowhere launcher cannot be loaded" in capsys.readouterr().err
    assert read_status(run.root).state == "stopped", "nothing changed"


def test_the_cli_runs_a_registered_engine_by_name(fake, llama_path, make_data, tmp_path, capsys):
    tiny_job(llama_path, make_data, tmp_path / "r").to_json(tmp_path / "job.json")
    (tmp_path / "fake.json").write_text(json.dumps({"hold": True}))
    argv = ["run", str(tmp_path / "job.json"), "--launcher", "fake", "--no-follow"]
    assert cli.main([*argv, "--launcher-options", str(tmp_path / "fake.json")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r")
    assert ml.attach(tmp_path / "r").status == "queued"
    ml.attach(tmp_path / "r").kill()  # (returns once the engine says the job ended)
    assert ml.attach(tmp_path / "r").status == "stopped"
