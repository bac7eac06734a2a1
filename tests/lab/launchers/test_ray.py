"""The Ray launcher: its options and job references (fast), then real jobs on a real two-node Ray cluster on
this machine (:mod:`ray_cluster`: a head and a worker raylet, as Ray's own tests start them).

On the cluster: the cluster is asked before anything is created (one problem each); a job waits ``queued``
with Ray's reason while the cluster is full, then runs on both nodes (the dashboard's rows, a live tenant
reaching both nodes' ranks at the same step) and stops gracefully; a job whose worker node is killed is
``failed`` with Ray's words, and a resume on the one node left continues it exactly (its adapters equal
one uninterrupted local process's to 1e-6). Whenever a call says a job ended (``wait()``, ``stop()``,
``kill()``), Ray says its agents are dead and its placement group removed, and no process of it is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import pytest
import ray_cluster
from conftest import task_files, two_tenants
from test_distributed import assert_same_adapters

import mlora_lab as ml
from mlora_lab.lab import cli
from mlora_lab.lab.dashboard.model import ViewModel
from mlora_lab.lab.launch import read_options
from mlora_lab.lab.launchers import ray as ray_launcher
from mlora_lab.lab.launchers.base import LauncherError
from mlora_lab.lab.launchers.ray import RayLauncher, RayOptions, job_of
from mlora_lab.lora import read_adapter
from mlora_lab.rundir import RunDir, checkpoint, read_status
from mlora_lab.rundir.status import JOB_MODULE, JobRef

# every test here shares one local Ray cluster: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("ray")

# -- options and references (no cluster) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (RayOptions(address="head"), "ray.address must be a Ray Client address"),
        (RayOptions(address="http://head:8265"), "ray.address must be a Ray Client address"),
        (RayOptions(address="ray://head:10001\nx"), "ray.address must be a Ray Client address"),
        (RayOptions(namespace="a/b"), "ray.namespace must be a name"),
        (RayOptions(cpus_per_node=0), "ray.cpus_per_node must be a whole number"),
        (RayOptions(cpus_per_node=1.5), "ray.cpus_per_node must be a whole number"),
        (RayOptions(gpus_per_node=True), "ray.gpus_per_node must be a whole number"),
        (RayOptions(gpus_per_node=2), "parallel.nproc = 4 processes per node but ray.gpus_per_node = 2"),
        (RayOptions(resources={"CPU": 4}), "ray.resources gives 'CPU': use ray.cpus_per_node"),
        (RayOptions(resources={"a100": -1}), "ray.resources['a100'] must be a positive number"),
        (RayOptions(resources=["a100"]), "ray.resources must be a dict"),
        (RayOptions(runtime_env="env"), "ray.runtime_env must be a dict"),
        (RayOptions(runtime_env={"env_vars": {"A": 1}}), "runtime_env['env_vars'] must map names to strings"),
        (RayOptions(python="py\nthon"), "ray.python must be the path of a Python interpreter"),
        (RayOptions(rdzv_port=80), "ray.rdzv_port must be a port"),
    ],
)
def test_bad_ray_options_are_named(options, expected):
    problems = options.problems(nnodes=2, nproc=4)
    assert len(problems) == 1 and expected in problems[0], problems


def test_every_problem_of_the_options_is_named_at_once():
    problems = RayOptions(address="x", namespace="", gpus_per_node=-1, rdzv_port=1).problems(2, 1)
    assert [p.split(" ")[0] for p in problems] == [
        "ray.address",
        "ray.namespace",
        "ray.gpus_per_node",
        "ray.rdzv_port",
    ]


def test_good_ray_options_have_no_problem_and_round_trip():
    options = RayOptions(
        address="ray://raycluster-head-svc:10001",
        namespace="team-a",
        cpus_per_node=16,
        gpus_per_node=8,
        resources={"a100": 1},
        runtime_env={"env_vars": {"NCCL_DEBUG": "INFO"}, "pip": ["mlora_lab"]},
        python="/opt/venv/bin/python",
        rdzv_port=29400,
    )
    assert options.problems(nnodes=4, nproc=8) == []
    for address in ("auto", "10.0.0.7:6379", "[fd00::7]:6379", "ray://head:10001", None):
        assert RayOptions(address=address).problems(1, 1) == [], address
    assert RayOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    assert options.bundle(8) == {"CPU": 16.0, "GPU": 8.0, "a100": 1.0}
    assert RayOptions().bundle(3) == {"CPU": 3.0}  # one CPU per process by default
    with pytest.raises(ValueError, match="unknown Ray options: nodes"):
        RayOptions.from_dict({"nodes": 2})


def test_the_address_defaults_to_ray_address_then_auto(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RayOptions().target() == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert RayOptions().target() == "ray://head:10001"
    assert RayOptions(address="10.0.0.7:6379").target() == "10.0.0.7:6379"


def test_a_ray_job_reference_holds_its_namespace_name_and_address():
    ref = JobRef("ray", ray_launcher.ref_id("ray://head:10001", "team-a", "mlora-r1-abc123"))
    assert ref.id == "team-a/mlora-r1-abc123@ray://head:10001"
    assert job_of(ref) == ("ray://head:10001", "team-a", "mlora-r1-abc123")
    for bad in (JobRef("slurm", ref.id), JobRef("ray", "mlora-r1"), JobRef("ray", "a b/c@x:1")):
        with pytest.raises(LauncherError, match="is not a Ray job"):
            job_of(bad)
    name = ray_launcher.job_name(Path("runs") / "20260101-000000 my run")
    assert re.fullmatch(r"mlora-20260101-000000_my_run-[0-9a-f]{6}", name), name


# -- a real two-node cluster ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_leftover_jobs():
    """conftest's, narrowed to the jobs: every process of the module's Ray cluster descends from this one
    (its raylets start and end workers as they please, between tests too), so only the job processes a
    test left behind (torchrun agents, ranks) are killed, never Ray's own."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.pid not in before and JOB_MODULE in " ".join(p.cmdline()):
                leftovers.append(p)
                p.kill()
    psutil.wait_procs(leftovers, timeout=10)


@pytest.fixture(scope="module")
def cluster():
    """A running local two-node Ray cluster, this process connected to its head; stopped at the end
    with nothing of it left."""
    why = ray_cluster.missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    local = ray_cluster.LocalRay().start()
    try:
        yield local
    finally:
        left = local.stop()
        assert not left, f"processes outlived the Ray cluster's shutdown: {left}"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return task_files(tmp_path_factory.mktemp("ray_data"))


def tenants(data: dict[str, str]) -> list[ml.Tenant]:
    return two_tenants(data, steps=(48, 36))


def job(base: str, ts: list[ml.Tenant], out: Path, nodes: int = 2) -> ml.JobSpec:
    parallel = ml.Parallel(nproc=1, nnodes=2, fsdp=2) if nodes == 2 else ml.Parallel(nproc=1)
    return ml.JobSpec(
        base_model=base,
        tenants=ts,
        seq_len=64,
        max_rank=8,
        max_tenants=3,
        save_every=4,
        parallel=parallel,
        output_dir=str(out),
    )


def options(cluster, **kw) -> RayOptions:
    return RayOptions(address=cluster.address, cpus_per_node=1, **kw)


def wait_for(what, predicate, run: ml.Run | None, timeout: float = 180, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            where = f"{run.status}: {run.reason}\n{run.logs(None)}" if run is not None else ""
            raise AssertionError(f"timed out waiting for {what}. {where}")
        time.sleep(poll)
    return value


def processes_of(run: ml.Run) -> list[str]:
    """Every process on this machine (both nodes are on it) whose command line names the run directory:
    the torchrun agents and the workers."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if str(run.path) in line:
            found.append(f"{p.info['pid']}: {line[:160]}")
    return found


def assert_ray_says_it_ended(run: ml.Run) -> None:
    """Ray knows no live actor of the run's job and its placement group is removed, and no process of the
    job is left: at once, when the call that said the job ended has returned."""
    import ray
    from ray.util import placement_group_table

    _, namespace, name = job_of(read_status(run.path).launcher_job)
    actors = [n for n in (name, f"{name}-node0", f"{name}-node1") if _named(ray, n, namespace)]
    groups = [t["state"] for t in placement_group_table().values() if t["name"] == name]
    assert not actors and groups in ([], ["REMOVED"]), (actors, groups)
    assert not processes_of(run), processes_of(run)


def _named(ray, name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


@pytest.mark.slow  # (the cluster's start)
def test_the_cluster_is_asked_first_one_problem_each(cluster, llama_path, data, tmp_path, capsys):
    spec = job(llama_path, tenants(data), tmp_path / "run")
    ray = RayLauncher()
    free_port = __import__("socket").socket()
    free_port.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{free_port.getsockname()[1]}"
    free_port.close()
    started = time.monotonic()
    (problem,) = ray.check(spec, RayOptions(address=dead), tmp_path / "run")
    assert f"nothing answers at the Ray address '{dead}'" in problem and time.monotonic() - started < 10
    (problem,) = ray.check(spec, RayOptions(address="no-such-head.invalid:6379"), tmp_path / "run")
    assert "names an unknown host 'no-such-head.invalid'" in problem

    assert ray.check(spec, options(cluster), tmp_path / "run") == []
    three = job(llama_path, tenants(data), tmp_path / "run")
    three.parallel = ml.Parallel(nproc=1, nnodes=3, fsdp=3)
    (problem,) = ray.check(three, options(cluster), tmp_path / "run")
    assert f"parallel.nnodes = 3, but the Ray cluster at {cluster.address} has 2 alive nodes" in problem
    (problem,) = ray.check(spec, options(cluster, gpus_per_node=1), tmp_path / "run")
    assert "ray.gpus_per_node = 1 GPU on each of 2 nodes, but only 0 of the alive nodes" in problem
    with pytest.raises(ml.SpecError) as raised:  # through ml.launch: every problem at once, nothing created
        ml.launch(
            spec,
            launcher="ray",
            ray=RayOptions(address=cluster.address, cpus_per_node=3, resources={"a100": 1}),
        )
    problems = [str(p) for p in raised.value.problems]
    assert len(problems) == 2, problems
    assert (
        "ray.cpus_per_node = 3 CPU on each of 2 nodes, but only 0" in problems[0]
        and "(their CPU: 2, 2)" in problems[0]
    )
    assert "ray.resources['a100'] = 1 a100 on each of 2 nodes" in problems[1]
    assert not (tmp_path / "run").exists()

    spec.to_json(tmp_path / "job.json")  # the command line: --ray-address, the other fields from a JSON file
    (tmp_path / "ray.json").write_text(json.dumps({"cpus_per_node": 3, "namespace": "cli"}))
    argv = ["run", str(tmp_path / "job.json"), "--launcher", "ray", "--ray-address", cluster.address]
    assert cli.main([*argv, "--launcher-options", str(tmp_path / "ray.json"), "--no-follow"]) == 2
    assert "ray.cpus_per_node = 3 CPU on each of 2 nodes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_queued_while_the_cluster_is_full_then_rows_a_live_tenant_and_a_graceful_stop(
    cluster, llama_path, data, tmp_path
):
    import ray
    from ray.util import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD", name="blocker")
    ray.get(blocker.ready(), timeout=60)
    long = [
        ml.Tenant(name="a", data=data["reverse"], rank=4, lr=1e-3, batch_size=2, max_steps=100_000, seed=1)
    ]
    run = ml.launch(job(llama_path, long, tmp_path / "run"), launcher="ray", ray=options(cluster))
    doomed = ml.launch(job(llama_path, long, tmp_path / "doomed"), launcher="ray", ray=options(cluster))
    try:
        assert doomed.status == "queued"
        doomed.kill()  # while queued: its group removed, its agents (never started) dead, and Ray says so
        assert_ray_says_it_ended(doomed)
        assert doomed.status == "stopped" and re.fullmatch(
            r"cancelled while queued \(Ray job mlora_lab/mlora-doomed-\w+@[\d.:]+\)", doomed.error
        ), doomed.error
        assert read_status(doomed.path).launcher_state == "STOPPED"
        assert run.status == "queued"
        waiting = wait_for("Ray's reason", lambda: "NO_RESOURCES" in (run.reason or "") and run.reason, run)
        assert re.fullmatch(
            r"Ray placement group mlora-run-[0-9a-f]{6} is waiting for resources \(NO_RESOURCES\): it asks 2 "
            r"bundles of \{CPU: 1\}, each on its own node \(STRICT_SPREAD\); the cluster has 2 alive nodes, "
            r"CPU 0 free of 4",
            waiting,
        ), waiting
        dash = ml.Dashboard([run], interactive=False)
        dash.refresh()
        assert "queued" in dash.status.value and "waiting for resources" in dash.status.value
        assert read_options(RunDir(run.path), "ray") == options(cluster)

        remove_placement_group(blocker)
        wait_for("the first steps", lambda: run.global_step >= 3, run)
        assert run.status == "running"
        view = ViewModel.of([run])
        view.poll()
        (key,) = view.keys(list(view.runs))
        assert key[1] == "a" and view.tenant(key).step >= 3 and view.tenant(key).last_loss is not None
        request = run.add_tenant(
            ml.Tenant(name="c", data=data["upper"], rank=8, lr=1e-3, max_steps=4), timeout=120
        )
        step = request.result.step
        for rank in (0, 1):  # both nodes' ranks applied it at the same step
            log = run.logs(rank, tail=None)
            assert f"control message {request.id} applied at step {step}: add 'c'" in log, log[-2000:]
        agents = re.findall(
            r"ray job (mlora-run-\w+): node rank (\d) of 2 on \S+ \(Ray node (\w+)", run.logs(None)
        )
        assert {rank for _, rank, _ in agents} == {"0", "1"} and len({node for *_, node in agents}) == 2
        wait_for("tenant c to finish", lambda: run.tenant_state("c") == "finished", run)

        assert run.stop(timeout=120) == "stopped", run.error
        assert_ray_says_it_ended(run)
        status = read_status(run.path)
        assert status.state == "stopped" and status.error is None and status.launcher_state == "SUCCEEDED"
        latest, _ = checkpoint.latest_intact(run.path / "checkpoints")
        assert (
            checkpoint.read_checkpoint(latest)["tenants"]["a"]["step"] > 0 and run.adapter_path("c").is_dir()
        )
    finally:
        for each in (run, doomed):
            if not each.reconcile().final:
                each.kill()


@pytest.mark.slow
def test_a_kill_ends_every_process_on_both_nodes_without_a_save(cluster, llama_path, data, tmp_path):
    long = [ml.Tenant(name="a", data=data["reverse"], rank=4, batch_size=2, max_steps=100_000, seed=1)]
    run = ml.launch(job(llama_path, long, tmp_path / "run"), launcher="ray", ray=options(cluster))
    wait_for("the first steps", lambda: run.global_step >= 2, run)
    assert len(processes_of(run)) == 4  # two torchrun agents, two workers
    run.kill()
    assert_ray_says_it_ended(run)
    assert run.status == "stopped" and re.fullmatch(
        r"killed \(Ray job mlora_lab/mlora-run-\w+@[\d.:]+\)", run.error
    )
    status = read_status(run.path)
    assert status.launcher_state == "STOPPED" and status.error == run.error
    assert "done after" not in run.logs(0, tail=None)  # SIGKILL: no final save


@pytest.fixture(scope="module")
def local_reference(llama_path, data, tmp_path_factory) -> ml.Run:
    """The job on one local process, run through."""
    run = ml.launch(job(llama_path, tenants(data), tmp_path_factory.mktemp("local") / "run", nodes=1))
    assert run.wait(300) == "finished", run.logs(0)
    return run


def adapters(run: ml.Run) -> dict[str, dict]:
    return {n: read_adapter(run.adapter_path(n))[1] for n in ("a", "b")}


@pytest.mark.slow
def test_a_killed_node_fails_the_run_with_rays_words_and_a_resume_on_one_node_continues_exactly(
    cluster, llama_path, data, local_reference, tmp_path
):
    run = ml.launch(job(llama_path, tenants(data), tmp_path / "run"), launcher="ray", ray=options(cluster))
    wait_for("the first checkpoint", lambda: any((run.path / "checkpoints").glob("step_*/meta.json")), run)
    cluster.kill_worker()
    assert run.wait(180) == "failed", f"{run.status}: {run.error}"
    assert_ray_says_it_ended(run)
    assert run.global_step < 48, "interrupted mid-run"
    assert re.search(
        r"Ray job mlora-run-\w+ failed: the agent of node rank \d died: .*The actor died because its node has died",
        run.error,
    ), run.error
    assert "resume it from its last checkpoint" in run.error
    assert read_status(run.path).launcher_state == "FAILED"

    resumed = ml.resume(run.path, launcher="ray", nnodes=1, nproc=1)  # (the run's Ray options, recorded)
    assert resumed.wait(300) == "finished", f"{resumed.error}\n{resumed.logs(None)}\n{resumed.logs(0)}"
    assert_ray_says_it_ended(resumed)
    assert read_status(run.path).launcher_state == "SUCCEEDED"
    assert "loopback rendezvous" in resumed.logs(None)
    assert_same_adapters(adapters(resumed), adapters(local_reference), 1e-6)
