"""The ``ray`` launcher: a Ray cluster (KubeRay included) as the engine of multi-node jobs.

One mlora_lab job is one Ray placement group of ``parallel.nnodes`` bundles, ``STRICT_SPREAD`` (each
bundle on its own node), with one detached *agent* actor in each bundle and one detached *supervisor*
actor (no CPU, on the head node) that watches them::

    ml.launch(spec, launcher="ray", ray=ml.RayOptions(address="ray://head:10001"))
      └─ placement group mlora-<run>-<id>: nnodes × {CPU: c, GPU: g}, STRICT_SPREAD, detached
           ├─ agent actor, bundle 0 ──► torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
           │                              --rdzv-endpoint <bundle 0's node>:<port> ──► P × python -m mlora_lab.job RUN_DIR
           ├─ agent actor, bundle 1 ──► torchrun ... (the same rendezvous) ──► P × python -m mlora_lab.job RUN_DIR
           └─ supervisor actor (0 CPUs, head node): each agent's exit or death, the job's record

**c10d, not Ray's own torch process group.** Ray Train's ``TorchTrainer`` would make every rank a Ray
actor and set up the process group itself; the job would then be a different program on Ray than
everywhere else. Here the ranks stay torchrun's workers, as under the local and the Slurm launchers:
the same ``python -m mlora_lab.job RUN_DIR``, the same environment (``RANK``, ``LOCAL_RANK``,
``TORCHELASTIC_RUN_ID``), the same per-rank logs, the same exit when the agent is gone, the same
graceful stop on SIGTERM and the same exact resume on any layout. Ray only places the agents and says
what only it knows: that the group waits for resources, or that a node died. The agents meet in
torchrun's c10d rendezvous hosted by bundle 0's agent (``is_host`` set explicitly, so that two agents
on one machine never both host it), at its node's Ray address (``--local-addr`` too: on KubeRay a
pod's hostname does not resolve in the other pods, its IP does). A one-node job uses the loopback
rendezvous of the local launcher (:mod:`mlora_lab.rendezvous`): nothing listens beyond 127.0.0.1.

**The job's record.** The supervisor waits on every agent's torchrun. When all have exited, or one
has failed or died and the others had :data:`~mlora_lab.lab.launchers.ray_actors.FAIL_GRACE_S` to end by themselves (then their process
trees are killed, as ``srun --kill-on-bad-exit`` does), it removes the placement group (Ray kills the
agents and frees their resources), waits until Ray says the agents are dead and the group removed,
and only then holds the job's final word: ``SUCCEEDED`` (every agent exited 0: the only clean end),
``FAILED`` (with Ray's own words, the ``RayActorError`` text, for an agent Ray killed or whose node
died) or ``STOPPED`` (killed from the lab). :meth:`RayLauncher.status` reads that word and then ends
the supervisor; one nobody asks ends itself after :data:`~mlora_lab.lab.launchers.ray_actors.RECORD_TTL_S`, after which Ray no longer knows
the job (``status`` is None, as Slurm forgets a job after ``MinJobAge``).

**No orphans.** An agent starts torchrun from a thread that lives as long as torchrun does, with
``PR_SET_PDEATHSIG`` = SIGKILL: if the agent dies (its node killed, Ray killing the actor, the group
removed), the kernel kills torchrun, whose workers exit when their agent is gone
(:func:`mlora_lab.job.__main__.exit_with_agent`). :meth:`RayLauncher.kill` SIGKILLs every process tree
first and returns only when Ray says the agents are dead and the group is removed.

**The run directory on shared storage.** Everything the nodes share goes through the run directory
(``job.json``, checkpoints, adapters, metrics, control messages, every rank's log and
``logs/launcher.log``, which each agent appends to), so it must be on storage every node mounts at the
same path, and so must the notebook: it reads runs from there (``ml.runs``, ``ml.attach``, the
dashboard, control messages, exports work unchanged). On KubeRay that is a ReadWriteMany volume (NFS,
GKE Filestore, EFS, Azure Files, CephFS) mounted at the same ``mountPath`` in the head's and every
worker group's pod template, and in the notebook's pod. The nodes' Python (default: the agent actor's
own interpreter, so a ``runtime_env`` with ``pip`` or ``conda`` applies) must have mlora_lab and torch.

**Connecting.** The lab talks to Ray in its own process: ``ray.init(address)`` once (a GCS address
``host:6379`` on a machine that is a node of the cluster, ``auto``, or a Ray Client address
``ray://head:10001`` from anywhere else), reused for every run on that cluster. An address that
cannot be reached is found out by a bounded probe (:data:`PROBE_TIMEOUT_S`) before ``ray.init``, which
would otherwise retry for ever; ``ray.init`` itself gets :data:`CONNECT_TIMEOUT_S`. A
:class:`~mlora_lab.rundir.status.JobRef` of this launcher holds ``namespace/name@address``, so any
process can follow a job another one submitted.

Ray is imported only when the launcher talks to a cluster: ``ml.RayOptions`` needs no Ray installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from mlora_lab.lab.launchers.base import EngineJob, LauncherError
from mlora_lab.lab.launchers.ray_actors import (
    Agent,
    Supervisor,
    agent_name,
    amount,
    cluster_view,
    lookup,
    words,
)
from mlora_lab.rundir import RunDir
from mlora_lab.rundir.status import JobRef
from mlora_lab.spec.job import JobSpec
from mlora_lab.text import brief

__all__ = [
    "CONNECT_TIMEOUT_S",
    "PROBE_TIMEOUT_S",
    "RayLauncher",
    "RayOptions",
    "connect",
    "job_of",
]

NAMESPACE = "mlora_lab"
PROBE_TIMEOUT_S = 5.0
"""How long the address's host may take to resolve and its port to accept a connection."""
CONNECT_TIMEOUT_S = 30.0
"""How long ``ray.init`` may take once the port accepts (a port that is not Ray's would hang it)."""
ASK_TIMEOUT_S = 20.0
"""How long one question to the cluster (a status, a stop) may take."""
START_TIMEOUT_S = 120.0
"""How long the supervisor may take to start (a worker process; a ``runtime_env`` set up first)."""

_ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class RayOptions:
    """Where and how a job runs on a Ray cluster (its nodes: ``parallel.nnodes``, one agent each).

    ``address``: the cluster, as ``ray.init`` takes it: a Ray Client address ``"ray://head:10001"``
    (from a machine outside the cluster: a laptop, a notebook pod), a GCS address ``"head:6379"`` or
    ``"auto"`` (on a node of the cluster); None: ``RAY_ADDRESS``, else ``"auto"``. ``namespace``: the
    Ray namespace of the job's named actors. ``cpus_per_node`` / ``gpus_per_node``: what each node's
    bundle reserves (default: one CPU per process, no GPU; with GPUs set ``parallel.nproc`` to the same
    number, one rank per GPU); ``OMP_NUM_THREADS`` is ``cpus_per_node / nproc`` when given, else computed
    on the node from its cores (:mod:`mlora_lab.lab.launchers.threads`). ``resources``: custom Ray
    resources each bundle also asks (``{"a100": 1}``: a node type of your cluster). ``runtime_env``: Ray's
    runtime environment of the agents (``env_vars``, ``pip``, ``conda``, ``container``, ...), which the
    job's processes inherit; an ``OMP_NUM_THREADS`` in its ``env_vars`` wins. ``python``: the interpreter
    that runs torchrun on the nodes (default: the agent actor's own). ``rdzv_port``: the rendezvous port
    on the first node (default: 20000 + a hash of the job's name mod 20000)."""

    address: str | None = None
    namespace: str = NAMESPACE
    cpus_per_node: int | None = None
    gpus_per_node: int = 0
    resources: dict[str, float] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    python: str | None = None
    rdzv_port: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> RayOptions:
        """Build from a dict (unknown keys raise ``ValueError``)."""
        if isinstance(d, RayOptions):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"Ray options must be a JSON object, not {type(d).__name__}")
        unknown = sorted(map(str, set(d) - {f.name for f in dataclasses.fields(cls)}))
        if unknown:
            raise ValueError(f"unknown Ray options: {', '.join(unknown)[:200]}")
        return cls(**d)

    def target(self) -> str:
        """The address to connect to: ``address``, else ``RAY_ADDRESS``, else ``"auto"``."""
        return self.address or os.environ.get("RAY_ADDRESS") or "auto"

    def bundle(self, nproc: int) -> dict[str, float]:
        """What each node's bundle (and its agent actor) reserves."""
        out: dict[str, float] = {"CPU": float(self.cpus_per_node or max(1, nproc))}
        if self.gpus_per_node:
            out["GPU"] = float(self.gpus_per_node)
        return out | {k: float(v) for k, v in self.resources.items()}

    def problems(self, nnodes: int, nproc: int) -> list[str]:
        """Every problem of these options for a job of ``nnodes`` × ``nproc`` ranks (empty: none)."""
        out: list[str] = []
        address = self.address
        if address is not None and not (
            isinstance(address, str) and (address == "auto" or _ADDRESS.fullmatch(address))
        ):
            out.append(
                "ray.address must be a Ray Client address 'ray://host:10001', a GCS address 'host:6379' "
                f"or 'auto', got {brief(address)}"
            )
        if not (isinstance(self.namespace, str) and _NAME.fullmatch(self.namespace)):
            out.append(f"ray.namespace must be a name (letters, digits, _ . -), got {brief(self.namespace)}")
        if self.cpus_per_node is not None and (
            not _is_int(self.cpus_per_node) or not 1 <= self.cpus_per_node <= 4096
        ):
            out.append(
                f"ray.cpus_per_node must be a whole number from 1 to 4096, got {brief(self.cpus_per_node)}"
            )
        if not _is_int(self.gpus_per_node) or not 0 <= self.gpus_per_node <= 64:
            out.append(
                f"ray.gpus_per_node must be a whole number from 0 to 64, got {brief(self.gpus_per_node)}"
            )
        elif self.gpus_per_node and _is_int(nproc) and nproc > self.gpus_per_node:
            out.append(
                f"parallel.nproc = {nproc} processes per node but ray.gpus_per_node = {self.gpus_per_node}: "
                "run one process per GPU (nproc <= gpus_per_node)"
            )
        out += self._resource_problems()
        out += self._runtime_env_problems()
        if self.python is not None and not (
            isinstance(self.python, str) and self.python and not _CONTROL.search(self.python)
        ):
            out.append(f"ray.python must be the path of a Python interpreter, got {brief(self.python)}")
        if self.rdzv_port is not None and (
            not _is_int(self.rdzv_port) or not 1024 <= self.rdzv_port <= 65535
        ):
            out.append(f"ray.rdzv_port must be a port from 1024 to 65535, got {brief(self.rdzv_port)}")
        return out

    def _resource_problems(self) -> list[str]:
        if not isinstance(self.resources, dict):
            return [f"ray.resources must be a dict of resource name to amount, got {brief(self.resources)}"]
        out = []
        for name, value in self.resources.items():
            if name in _OWN_RESOURCES:
                field_name = {"CPU": "cpus_per_node", "GPU": "gpus_per_node"}.get(name)
                use = f"use ray.{field_name}" if field_name else "the job does not reserve it"
                out.append(f"ray.resources gives {name!r}: {use}")
            elif not (isinstance(name, str) and name and not _CONTROL.search(name)):
                out.append(f"ray.resources has a key that is not a resource name: {brief(name)}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
                out.append(f"ray.resources[{name!r}] must be a positive number, got {brief(value)}")
        return out

    def _runtime_env_problems(self) -> list[str]:
        env = self.runtime_env
        if env is None:
            return []
        if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
            return [f"ray.runtime_env must be a dict (Ray's runtime environment), got {brief(env)}"]
        variables = env.get("env_vars", {})
        if not isinstance(variables, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in variables.items()
        ):
            return [f"ray.runtime_env['env_vars'] must map names to strings, got {brief(variables)}"]
        return []


# -- the connection -----------------------------------------------------------------------------------

_connection: dict[str, Any] = {}
"""The Ray connection this module made: ``address``; ``stuck``: an address whose ``ray.init`` did not return."""


def _probe(address: str) -> None:
    """:class:`LauncherError` if ``address``'s host does not resolve or its port does not accept a TCP
    connection within :data:`PROBE_TIMEOUT_S` (``ray.init`` would retry for ever)."""
    match = _ADDRESS.fullmatch(address)
    if match is None:  # ("auto": ray.init looks for this machine's cluster and says at once if there is none)
        return
    host, port = match.group(2).strip("[]"), int(match.group(3))
    found: dict[str, Any] = {}

    def resolve() -> None:
        try:
            found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            found["error"] = e

    resolving = threading.Thread(target=resolve, daemon=True)
    resolving.start()
    resolving.join(PROBE_TIMEOUT_S)
    if "error" in found or resolving.is_alive():
        why = found["error"].strerror if "error" in found else f"no answer within {PROBE_TIMEOUT_S:.0f} s"
        raise LauncherError(f"the Ray address {address!r} names an unknown host {host!r} ({why})")
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise LauncherError(
            f"nothing answers at the Ray address {address!r} ({why}): is the cluster up, and is this its "
            "GCS port (host:6379) or its Ray Client port (ray://host:10001)?"
        ) from None


def _same_cluster(address: str) -> bool:
    """Whether this process's Ray connection (its own or one the user made) is to ``address``."""
    import ray

    if address in ("auto", _connection.get("address")):
        return True
    client = address.startswith("ray://")
    if client != ray.util.client.ray.is_connected():
        return False
    if client:  # a Ray Client connection made by the user: the address cannot be read back; taken as meant
        return "address" not in _connection
    try:
        here = ray.get_runtime_context().gcs_address
    except Exception:  # (a connection in an odd state: not the one meant)
        return False
    return _endpoint(here) == _endpoint(address)


def _endpoint(address: str) -> tuple[str, int] | None:
    match = _ADDRESS.fullmatch(address)
    if match is None:
        return None
    host = match.group(2).strip("[]")
    with contextlib.suppress(OSError):
        host = socket.gethostbyname(host)
    return host, int(match.group(3))


def _current_address() -> str:
    """Where this process's Ray connection goes, as far as it can be told."""
    import ray

    if "address" in _connection:
        return _connection["address"]
    with contextlib.suppress(Exception):
        return ray.get_runtime_context().gcs_address
    return "another cluster (ray.init)"


def connect(address: str, namespace: str = NAMESPACE) -> None:
    """Connect this process to the Ray cluster at ``address`` (``ray.init``), or reuse the connection
    it has to that cluster. :class:`LauncherError` when the address cannot be reached (a bounded probe
    first), ``ray.init`` fails or does not return within :data:`CONNECT_TIMEOUT_S`, or this process is
    connected to another cluster (one Ray connection per process)."""
    import ray

    if ray.is_initialized() and _same_cluster(address):
        return
    _probe(address)  # (first: an address that cannot be reached is said as such, connected or not)
    if ray.is_initialized():
        raise LauncherError(
            f"this Python is connected to Ray at {_current_address()}, not {address!r} (one Ray connection "
            "per process): call ray.shutdown() first, or restart the kernel"
        )
    stuck = _connection.get("stuck")
    if stuck is not None and stuck[1].is_alive():
        raise LauncherError(
            f"ray.init({stuck[0]!r}) has not returned yet; restart the kernel to connect again"
        )
    outcome: dict[str, BaseException] = {}

    def init() -> None:
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=init, name="mlora-ray-init", daemon=True)
    thread.start()
    thread.join(CONNECT_TIMEOUT_S)
    if thread.is_alive():
        _connection["stuck"] = (address, thread)
        raise LauncherError(
            f"{address!r} accepts connections but did not answer as a Ray cluster within "
            f"{CONNECT_TIMEOUT_S:.0f} s (a GCS port, host:6379, or a Ray Client port, ray://host:10001?)"
        )
    if "error" in outcome:
        e = outcome["error"]
        raise LauncherError(f"cannot connect to Ray at {address!r}: {type(e).__name__}: {words(e)}")
    _connection["address"] = address


# -- the job's plan and reference ---------------------------------------------------------------------


def job_name(run_dir: Path) -> str:
    """A new Ray name for a job of ``run_dir``: ``mlora-<run name>-<6 hex>`` (each submission its own)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(run_dir).name)[:40]
    return f"mlora-{stem}-{uuid.uuid4().hex[:6]}"


def ref_id(address: str, namespace: str, name: str) -> str:
    """A JobRef id: ``namespace/name@address``."""
    return f"{namespace}/{name}@{address}"


def job_of(ref: JobRef) -> tuple[str, str, str]:
    """``(address, namespace, name)`` of a ``ray`` JobRef; :class:`LauncherError` if it holds none."""
    head, _, address = ref.id.partition("@")
    namespace, _, name = head.partition("/")
    if ref.kind != RayLauncher.name or not (address and _NAME.fullmatch(namespace) and _NAME.fullmatch(name)):
        raise LauncherError(f"{ref.kind} job {ref.id!r} is not a Ray job (namespace/name@address)")
    return address, namespace, name


# -- the launcher -------------------------------------------------------------------------------------


class RayLauncher:
    """A Ray cluster as the engine: :class:`~mlora_lab.lab.launchers.base.Launcher` ``ray``."""

    name: ClassVar[str] = "ray"
    options_type: ClassVar[type | None] = RayOptions
    queues: ClassVar[bool] = True

    def check(self, spec: JobSpec, options: Any, run_dir: Path, resume: bool = False) -> list[str]:
        """The options' problems for this layout; if none, the cluster is asked (connecting, bounded):
        an address that cannot be reached, too few alive nodes, and nodes without the CPUs, GPUs or
        custom resources a bundle asks, one problem each. Nothing is created."""
        options = options if options is not None else RayOptions()
        p = spec.parallel
        problems = options.problems(p.nnodes, p.nproc)
        if problems:
            return problems
        try:
            import ray  # noqa: F401
        except ImportError as e:
            return [f"the ray launcher needs Ray on this machine ({e}): pip install 'mlora_lab[ray]'"]
        address = options.target()
        try:
            connect(address, options.namespace)
            nodes, _, _ = cluster_view()
        except LauncherError as e:
            return [str(e)]
        return _capacity_problems(options, nodes, p.nnodes, p.nproc, address)

    def submit(self, run_dir: RunDir, spec: JobSpec, options: Any = None, resume: bool = False) -> JobRef:
        """Create the job's detached placement group, its agents and its supervisor, and return at once
        (the group may wait for resources: the run reads ``queued``). :class:`LauncherError` with Ray's
        words if Ray refuses; whatever was created is removed again then."""
        import ray
        from ray.util import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        options = options if options is not None else RayOptions()
        p = spec.parallel
        address = options.target()
        connect(address, options.namespace)
        if address == "auto" and not ray.util.client.ray.is_connected():
            address = ray.get_runtime_context().gcs_address  # (where another process finds the job)
        name, bundle = job_name(run_dir.root), options.bundle(p.nproc)
        plan = {
            "name": name,
            "run_dir": str(run_dir.root),
            "resume": resume,
            "nnodes": p.nnodes,
            "nproc": p.nproc,
            "bundle": bundle,
            "cpus_per_node": options.cpus_per_node,
            "python": options.python,
            "rdzv_port": options.rdzv_port or 20000 + zlib.crc32(name.encode()) % 20000,
            "env_vars": (options.runtime_env or {}).get("env_vars", {}),
            "namespace": options.namespace,
        }
        common: dict[str, Any] = {"namespace": options.namespace, "lifetime": "detached", "max_restarts": 0}
        if options.runtime_env is not None:
            common["runtime_env"] = options.runtime_env
        group, made = None, []
        try:
            group = placement_group(
                [bundle] * p.nnodes, strategy="STRICT_SPREAD", name=name, lifetime="detached"
            )
            own = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            for i in range(p.nnodes):
                made.append(
                    ray.remote(Agent)
                    .options(
                        name=agent_name(name, i),
                        num_cpus=bundle["CPU"],
                        num_gpus=bundle.get("GPU", 0),
                        resources=own,
                        max_concurrency=4,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, i),
                        **common,
                    )
                    .remote(plan, i, group)
                )
            head = next(
                (n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]), None
            )
            # (hard: on the head it lives as long as the cluster; a soft affinity may spill it to a worker node)
            place = NodeAffinitySchedulingStrategy(head, soft=False) if head else "DEFAULT"
            supervisor = (
                ray.remote(Supervisor)
                .options(name=name, num_cpus=0, max_concurrency=8, scheduling_strategy=place, **common)
                .remote(plan, group, made)
            )
            made.append(supervisor)
            ray.get(supervisor.ping.remote(), timeout=START_TIMEOUT_S)  # (it runs: the job is followed)
        except Exception as e:
            for actor in made:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if group is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(group)
            raise LauncherError(f"Ray refused the job: {type(e).__name__}: {words(e)}") from None
        return JobRef(self.name, ref_id(address, options.namespace, name))

    def status(self, ref: JobRef) -> EngineJob | None:
        """The supervisor's word on the job (None: Ray no longer knows it: no such actor, or it is dead).
        A final word is read once: the supervisor is ended then (the lab records the word in
        status.json). :class:`LauncherError` when Ray cannot be asked, or the supervisor cannot answer
        for a moment (``ActorUnavailableError``: the lab asks again)."""
        import ray
        from ray.exceptions import ActorDiedError, RayError

        supervisor = self._supervisor(ref)
        if supervisor is None:
            return None
        try:
            record = ray.get(supervisor.report.remote(), timeout=ASK_TIMEOUT_S)
        except ActorDiedError:
            return None
        except RayError as e:  # (GetTimeoutError, ActorUnavailableError, an error of the report itself)
            raise LauncherError(
                f"Ray cannot say what became of job {ref.id}: {type(e).__name__}: {words(e)}"
            ) from None
        job = EngineJob(**record)
        if job.final:
            with contextlib.suppress(Exception):
                ray.kill(supervisor)
        return job

    def stop(self, ref: JobRef) -> None:
        """SIGTERM every rank of the job on every node, through its supervisor; returns at once."""
        supervisor = self._supervisor(ref)
        if supervisor is not None:
            supervisor.stop.remote()

    def kill(self, ref: JobRef, timeout: float = 120) -> EngineJob | None:
        """SIGKILL every process tree of the job, kill its agents, remove its group; return when Ray says
        the agents are dead and the group removed (:class:`LauncherError` if not by ``timeout``)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        _, namespace, name = job_of(ref)
        supervisor = self._supervisor(ref)
        record: dict[str, Any] | None = None
        if supervisor is not None:
            with contextlib.suppress(RayActorError):
                try:
                    record = ray.get(supervisor.kill.remote(), timeout=timeout)
                except GetTimeoutError:
                    raise LauncherError(
                        f"Ray job {ref.id} was not over {timeout:.0f} s after its kill"
                    ) from None
        left = _leftovers(name, namespace)  # (a supervisor gone early: the agents and group by name)
        if left:
            _remove_leftovers(name, namespace, timeout)
        if supervisor is not None:
            with contextlib.suppress(Exception):
                ray.kill(supervisor)
        if left and record is None:
            record = {"state": "STOPPED", "words": f"Ray job {name} was killed", "final": True}
        return EngineJob(**record) if record else None

    def _supervisor(self, ref: JobRef) -> Any:
        address, namespace, name = job_of(ref)
        connect(address, namespace)
        return lookup(name, namespace)


def _capacity_problems(
    options: RayOptions, nodes: list[dict], nnodes: int, nproc: int, address: str
) -> list[str]:
    """Too few alive nodes; too few with the CPUs, GPUs, each custom resource a bundle asks (one
    problem each, counted against the nodes there are, so that too few nodes is said once)."""
    where = f"the Ray cluster at {address}"
    problems = []
    if len(nodes) < nnodes:
        problems.append(
            f"parallel.nnodes = {nnodes}, but {where} has {len(nodes)} alive node{'s' * (len(nodes) != 1)}: "
            "the job places one torchrun agent on each of that many different nodes (STRICT_SPREAD)"
        )
    wanted = min(nnodes, len(nodes))
    asked = {"CPU": "ray.cpus_per_node", "GPU": "ray.gpus_per_node"}
    for key, need in options.bundle(nproc).items():
        fit = [n for n in nodes if n.get("Resources", {}).get(key, 0.0) >= need]
        if len(fit) < wanted:
            has = ", ".join(amount(n.get("Resources", {}).get(key, 0.0)) for n in nodes)
            what = asked.get(key, f"ray.resources[{key!r}]")
            default = (
                " (one per process by default)" if key == "CPU" and options.cpus_per_node is None else ""
            )
            problems.append(
                f"{what} = {amount(need)}{default} {key} on each of {nnodes} nodes, but only {len(fit)} of "
                f"the alive nodes of {where} have that many (their {key}: {has or 'none'})"
            )
    return problems


def _leftovers(name: str, namespace: str) -> bool:
    """Whether Ray still knows a live agent or an unremoved group of the job ``name``."""
    from ray.util import placement_group_table

    if any(lookup(agent_name(name, i), namespace) is not None for i in range(_most_nodes(name))):
        return True
    return any(
        t.get("name") == name and t.get("state") != "REMOVED" for t in placement_group_table().values()
    )


def _most_nodes(name: str) -> int:
    """How many bundles the job's group has (0 when Ray does not know it)."""
    from ray.util import placement_group_table

    return max(
        (len(t.get("bundles", {})) for t in placement_group_table().values() if t.get("name") == name),
        default=0,
    )


def _remove_leftovers(name: str, namespace: str, timeout: float) -> None:
    """Kill the job's agents and remove its group by name; wait until Ray says they are gone."""
    import ray
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    for i in range(_most_nodes(name)):
        if (agent := lookup(agent_name(name, i), namespace)) is not None:
            ray.wait([agent.kill_tree.remote()], timeout=10)  # (one never placed does not answer)
            ray.kill(agent, no_restart=True)
    for group_id, table in placement_group_table().items():
        if table.get("name") == name and table.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
    deadline = time.monotonic() + timeout
    while _leftovers(name, namespace):
        if time.monotonic() > deadline:
            raise LauncherError(
                f"Ray job {name}: its agents or group are still there {timeout:.0f} s after the kill"
            )
        time.sleep(0.5)
