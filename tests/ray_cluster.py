"""A real two-node Ray cluster on this one machine, for the Ray launcher's tests.

As Ray's own tests start one (:class:`ray.cluster_utils.Cluster`): a head node (GCS, raylet) and one worker
node (a second raylet), each with :data:`CPUS` logical CPUs and a small object store, no dashboard and no
usage statistics. This process connects to the head node as a driver *before* the worker node is added,
so the worker node can be killed (:meth:`LocalRay.kill_worker`: its raylet and workers SIGKILLed, as a
machine that is lost) without taking the driver with it. Every process of the cluster is a descendant of
this process; :meth:`LocalRay.stop` ends them and says which ones, if any, outlived the shutdown.
"""

from __future__ import annotations

import os
import time

import psutil

CPUS = 2
OBJECT_STORE = 80 << 20
NAMESPACE = "mlora_tests"
QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


def missing() -> str | None:
    """Why Ray cannot run here (None: it can)."""
    try:
        import ray  # noqa: F401
        from ray.cluster_utils import Cluster  # noqa: F401
    except ImportError as e:
        return f"Ray is not installed ({e}): pip install -e '.[test]' installs ray==2.60.0"
    return None


class LocalRay:
    """A head node and one worker node on this machine, and this process connected to the head."""

    def __init__(self) -> None:
        self.cluster = None
        self.worker = None
        self.pids: set[int] = set()
        self.environ: dict[str, str | None] = {}

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self) -> LocalRay:
        import ray
        from ray.cluster_utils import Cluster

        self.environ = {k: os.environ.get(k) for k in QUIET}
        os.environ.update(QUIET)  # (the nodes' processes inherit this process's environment)
        node = {"num_cpus": CPUS, "object_store_memory": OBJECT_STORE}
        self.cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        ray.init(
            address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING"
        )
        self.worker = self.cluster.add_node(**node)
        self.cluster.wait_for_nodes()
        self.pids = self.descendants()
        return self

    def descendants(self) -> set[int]:
        """The pids of every process below this one (the cluster's, the jobs' on it)."""
        return {p.pid for p in psutil.Process().children(recursive=True)}

    def kill_worker(self) -> None:
        """The worker node lost: its raylet SIGKILLed (its worker processes follow it)."""
        self.cluster.remove_node(self.worker, allow_graceful=False)
        self.worker = None

    def stop(self) -> list[str]:
        """Disconnect and shut every node down; the processes that outlived it by 30 s, as text."""
        import ray

        before = self.descendants() | self.pids
        ray.shutdown()
        self.cluster.shutdown()
        for key, value in self.environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        deadline = time.monotonic() + 30
        while (left := [p for p in before if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [_describe(p) for p in left]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> str:
    try:
        return f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:160]}"
    except psutil.Error:
        return f"{pid}: (gone)"
