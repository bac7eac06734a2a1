"""The ``mlora-loopback`` rendezvous: a single-node torchrun job listens on loopback only.

Real torchrun, 2 processes, gloo. The worker lists every LISTEN socket of the whole torchrun process
tree (the agent and all its descendants) while every rank is alive. Measured with torch 2.13: with
``--standalone`` the agent (``pt_elastic``) listens on ``::`` twice -- the rendezvous store and the shared
agent store workers connect to -- and gloo binds whatever the hostname resolves to; with
``single_node_torchrun_args`` + ``loopback_env`` everything is on 127.0.0.1. The ``--standalone`` job
runs here as a negative control: it shows the listing does see wildcard sockets.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from mlora_lab.rendezvous import (
    BACKEND,
    LOOPBACK,
    loopback_env,
    loopback_interface,
    loopback_tcp_store,
    single_node_torchrun_args,
)

JOB_TIMEOUT = 120

WORKER = textwrap.dedent(
    """
    import json, os, sys

    import psutil
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    assert x.item() == world * (world + 1) / 2, x
    dist.barrier()  # every rank has its sockets open
    if rank == 0:
        agent = psutil.Process().parent()
        listen = []
        for p in [agent, *agent.children(recursive=True)]:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listen.append({"pid": p.pid, "name": p.name(), "agent": p.pid == agent.pid,
                                   "ip": c.laddr.ip, "port": c.laddr.port})
        env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
        with open(sys.argv[1], "w") as f:
            json.dump({"sum": x.item(), "world": world, "env": env, "listen": listen}, f)
    dist.barrier()  # nobody exits before rank 0 has looked
    dist.destroy_process_group()
    """
)


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%", 1)[0]).is_loopback


def _own_listeners() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


class Jobs:
    """Starts torchrun jobs and, at teardown, ends every process they started: the agent's tree, plus
    any worker left orphaned (torchrun puts workers in their own sessions), found by this test's own
    worker script path in its command line."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.script = root / "worker.py"
        self.script.write_text(WORKER)
        self.procs: list[subprocess.Popen] = []

    def start(
        self, name: str, torchrun_args: list[str], extra_env: dict[str, str]
    ) -> tuple[subprocess.Popen, Path]:
        env = {**os.environ, **extra_env}  # extra_env wins: the test checks exactly what it sets
        env.setdefault("OMP_NUM_THREADS", "1")
        out = self.root / f"{name}.json"
        with open(self.root / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(self.script), str(out)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc, out

    def result(self, name: str, proc: subprocess.Popen, out: Path) -> dict:
        try:
            rc = proc.wait(JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        log = (self.root / f"{name}.log").read_text(errors="replace")
        assert rc == 0, f"{name}: torchrun exit {rc}\n{log[-4000:]}"
        assert out.is_file(), f"{name}: worker wrote no listing\n{log[-4000:]}"
        return json.loads(out.read_text())

    def close(self) -> None:
        victims: dict[int, psutil.Process] = {}
        for proc in self.procs:
            try:
                agent = psutil.Process(proc.pid)
                for p in [agent, *agent.children(recursive=True)]:
                    victims[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter(["pid", "cmdline"]):
            if str(self.script) in (p.info["cmdline"] or []):
                victims[p.pid] = p
        for p in victims.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(list(victims.values()), timeout=10)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


# The tests of the three jobs below go to one xdist worker: a module fixture is made once per worker.
on_one_worker = pytest.mark.xdist_group("rendezvous_jobs")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    """Three jobs at once (saves wall time on a small machine): two on ``mlora-loopback`` and a
    ``--standalone`` negative control."""
    js = Jobs(tmp_path_factory.mktemp("rendezvous"))
    try:
        started = {
            "a": js.start("a", single_node_torchrun_args(2), loopback_env()),
            "b": js.start("b", single_node_torchrun_args(2), loopback_env()),
            "standalone": js.start(
                "standalone",
                ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0"],
                {},
            ),
        }
        results: dict[str, dict] = {}

        def result(name: str) -> dict:
            if name not in results:
                results[name] = js.result(name, *started[name])
            return results[name]

        yield result
    finally:
        js.close()


def assert_loopback_job(listing: dict) -> None:
    assert listing["sum"] == 3.0 and listing["world"] == 2
    assert listing["env"]["MASTER_ADDR"] == LOOPBACK
    listen = listing["listen"]
    agent = [s for s in listen if s["agent"]]
    # the rendezvous store and the shared agent store (the workers' MASTER_PORT)
    assert len(agent) >= 2, listen
    assert int(listing["env"]["MASTER_PORT"]) in {s["port"] for s in agent}, listen
    assert [s for s in listen if not _is_loopback(s["ip"])] == [], listen


@pytest.mark.slow
@on_one_worker
def test_single_node_job_listens_on_loopback_only(jobs):
    listing = jobs("a")
    assert_loopback_job(listing)
    assert {s["ip"] for s in listing["listen"]} == {LOOPBACK}


@pytest.mark.slow
@on_one_worker
def test_two_jobs_at_once_get_their_own_ports(jobs):
    a, b = jobs("a"), jobs("b")
    assert_loopback_job(b)
    ports_a = {s["port"] for s in a["listen"]}
    ports_b = {s["port"] for s in b["listen"]}
    assert ports_a and ports_b and not ports_a & ports_b


@pytest.mark.slow
@on_one_worker
def test_standalone_listens_on_all_interfaces(jobs):
    """Negative control: stock ``--standalone`` agent stores listen on the wildcard address (``::``), so
    the listing above would have seen them."""
    listen = jobs("standalone")["listen"]
    wildcard = [s for s in listen if s["agent"] and ipaddress.ip_address(s["ip"]).is_unspecified]
    assert len(wildcard) >= 2, listen


# -- fast, in-process --------------------------------------------------------------------------------


def test_torchrun_args_and_env():
    args = single_node_torchrun_args(3)
    opts = dict(zip(args[::2], args[1::2]))
    assert opts["--rdzv-backend"] == BACKEND and opts["--rdzv-endpoint"] == f"{LOOPBACK}:0"
    assert opts["--local-addr"] == LOOPBACK and opts["--nnodes"] == "1" and opts["--nproc-per-node"] == "3"
    assert "--standalone" not in args
    assert opts["--rdzv-id"] != dict(zip(*[iter(single_node_torchrun_args(3))] * 2))["--rdzv-id"]
    lo = loopback_interface()
    assert loopback_env() == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    assert any(a.address == LOOPBACK for a in psutil.net_if_addrs()[lo])


def test_loopback_tcp_store_listens_on_loopback():
    before = _own_listeners()
    store = loopback_tcp_store()
    try:
        assert (LOOPBACK, store.port) in _own_listeners() - before
        assert {ip for ip, _ in _own_listeners() - before} == {LOOPBACK}
        client = dist.TCPStore(LOOPBACK, store.port, is_master=False)
        client.set("k", "v")
        assert store.get("k") == b"v"
        del client
    finally:
        del store
    assert not any(port for _, port in _own_listeners() - before)


def test_handler_from_registry_rendezvous_on_loopback():
    """torchrun's registry (entry point ``torchrun.handlers``) builds the handler; one round of a
    one-node rendezvous puts both stores on 127.0.0.1 and tells workers ``MASTER_ADDR=127.0.0.1``."""
    before = _own_listeners()
    params = RendezvousParameters(
        backend=BACKEND, endpoint=f"{LOOPBACK}:0", run_id="t", min_nodes=1, max_nodes=1, local_addr=None
    )
    handler = rendezvous_handler_registry.create_handler(params)
    try:
        assert handler.get_backend() == BACKEND
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == LOOPBACK
        new = _own_listeners() - before
        assert len(new) >= 2 and {ip for ip, _ in new} == {LOOPBACK}, new
        assert (LOOPBACK, info.bootstrap_store_info.master_port) in new
    finally:
        handler.shutdown()


@pytest.mark.parametrize(
    "change",
    [{"max_nodes": 2}, {"endpoint": "0.0.0.0:0"}, {"endpoint": "node0:29500"}, {"local_addr": "10.0.0.1"}],
)
def test_handler_refuses_non_loopback(change):
    kw = {"backend": BACKEND, "endpoint": f"{LOOPBACK}:0", "run_id": "t", "min_nodes": 1, "max_nodes": 1}
    kw.update(change)
    with pytest.raises(ValueError, match=BACKEND):
        rendezvous_handler_registry.create_handler(RendezvousParameters(**kw))


def test_handler_refuses_unshared_store(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters(
        backend=BACKEND, endpoint=f"{LOOPBACK}:0", run_id="t", min_nodes=1, max_nodes=1
    )
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        rendezvous_handler_registry.create_handler(params)
