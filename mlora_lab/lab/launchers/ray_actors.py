"""What the ``ray`` launcher runs inside the cluster: one :class:`Agent` actor per node, one :class:`Supervisor`.

:mod:`mlora_lab.lab.launchers.ray` creates them (see its docstring for the design); Ray pickles these
classes by reference, so the nodes import this module (and mlora_lab with it) in the actors' processes:

    Agent(plan, node_rank, group)     bundle ``node_rank`` of the group: starts torchrun at once, from a
                                      thread that lives as long as torchrun (``PR_SET_PDEATHSIG``: torchrun
                                      dies with the actor); ``wait()`` -> its exit code
    Supervisor(plan, group, agents)   no CPU, on the head node: waits on every agent, ends the job when one
                                      fails or dies, removes the group, keeps the job's final word

A ``plan`` is the job as plain values: ``name``, ``namespace``, ``run_dir``, ``resume``, ``nnodes``, ``nproc``, ``bundle``
(what each node's bundle reserves), ``cpus_per_node``, ``python``, ``rdzv_port``, ``env_vars`` (the
runtime environment's). Ray is imported inside the functions: this module loads without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mlora_lab.lab.launchers.local import kill_job, terminate_job
from mlora_lab.lab.launchers.threads import machine_load, threads_per_process
from mlora_lab.lab.records.logs import LAUNCHER_LOG
from mlora_lab.rundir import RunDir, guarded_open
from mlora_lab.rundir.status import JOB_MODULE, TORCHRUN_MODULE

__all__ = [
    "DEAD_WAIT_S",
    "FAIL_GRACE_S",
    "RECORD_TTL_S",
    "Agent",
    "Supervisor",
    "agent_name",
    "amount",
    "cluster_view",
    "dead",
    "lookup",
    "words",
]

FAIL_GRACE_S = 15.0
"""After one agent failed or died, how long the others get to end by themselves (a rank whose peer is
gone fails its collective and writes why) before their process trees are killed."""
RECORD_TTL_S = 3600.0
"""How long the supervisor keeps a finished job's record for a status() that has not read it."""
DEAD_WAIT_S = 60.0
"""How long the supervisor waits for Ray to say an agent is dead (a node's death takes Ray ~15-30 s)."""


def words(e: BaseException, limit: int = 1200) -> str:
    """An exception's text on one line (Ray's errors span several)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def amount(value: float) -> str:
    """A resource amount as Ray users write it (``2``, ``0.5``)."""
    return f"{value:g}"


def cluster_view() -> tuple[list[dict], dict[str, float], dict[str, float]]:
    """The alive nodes (``ray.nodes()``), the cluster's total and free resources."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return nodes, ray.cluster_resources(), ray.available_resources()


def agent_name(name: str, rank: int) -> str:
    """The Ray name of the agent of node rank ``rank`` of the job ``name``."""
    return f"{name}-node{rank}"


def lookup(name: str, namespace: str) -> Any:
    """The live named actor, or None when Ray does not know it: it never was, or it is dead (Ray forgets
    a dead actor's name once it has declared it dead)."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def dead(actor: Any, timeout: float = 5.0) -> str | None:
    """Ray's words if ``actor`` is dead (its ``RayActorError``), None while it answers or is only
    unavailable for a moment (a node being declared dead)."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    try:
        ray.get(actor.ping.remote(), timeout=timeout)
    except ActorUnavailableError:
        return None
    except RayActorError as e:
        return words(e)
    except GetTimeoutError:
        return None
    return None


class Agent:
    """One node's torchrun agent, as a detached Ray actor in bundle ``node_rank`` of the job's group.

    It starts torchrun at once (from a thread that lives as long as torchrun, so ``PR_SET_PDEATHSIG``
    ties torchrun to this actor's life) and answers :meth:`wait` with torchrun's exit code."""

    def __init__(self, plan: dict[str, Any], node_rank: int, group: Any) -> None:
        self.plan, self.node_rank, self.group = plan, node_rank, group
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self.error: str | None = None
        self.killed = False
        self.lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._run, name="mlora-torchrun", daemon=True).start()

    def ping(self) -> dict[str, Any]:
        return {"pid": self.proc.pid if self.proc else None, "code": self.code, "error": self.error}

    def wait(self) -> int:
        """torchrun's exit code once it has exited (RuntimeError if it could not be started)."""
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(self.error)
        return int(self.code if self.code is not None else -1)

    def terminate(self) -> None:
        """SIGTERM the ranks (a graceful stop: they save and exit); torchrun itself if it has none yet."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            terminate_job(proc.pid)

    def kill_tree(self) -> None:
        """SIGKILL torchrun and every process below it, and wait for them."""
        with self.lock:
            self.killed = True
            proc = self.proc
        if proc is not None and proc.poll() is None:
            kill_job(proc.pid)
        self.done.wait(30)

    def _run(self) -> None:
        try:
            command, env, header = self._command()
            run = RunDir(Path(self.plan["run_dir"]))
            log = guarded_open(run.root, run.logs / LAUNCHER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                os.write(log, header.encode())
                with self.lock:
                    if self.killed:
                        return
                    self.proc = subprocess.Popen(
                        command,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=str(run.root),
                        env=env,
                        start_new_session=True,  # only this agent's own signals reach it
                        preexec_fn=_die_with(os.getpid()),
                    )
            finally:
                os.close(log)
            self.code = self.proc.wait()
        except BaseException as e:
            self.error = f"node rank {self.node_rank}: torchrun could not be started: {type(e).__name__}: {e}"
        finally:
            self.done.set()

    def _command(self) -> tuple[list[str], dict[str, str], str]:
        """torchrun's command line, its environment, and the line it starts the log with."""
        import ray

        plan, rank = self.plan, self.node_rank
        nnodes, nproc = plan["nnodes"], plan["nproc"]
        here = ray.util.get_node_ip_address()
        env = dict(os.environ)
        if not (plan.get("env_vars") or {}).get("OMP_NUM_THREADS"):
            cpus = plan.get("cpus_per_node")
            threads = max(1, cpus // nproc) if cpus else threads_per_process(nproc, load=machine_load())
            env["OMP_NUM_THREADS"] = str(threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["MLORA_RAY_JOB"] = plan["name"]
        if nnodes == 1:
            from mlora_lab.rendezvous import loopback_env, single_node_torchrun_args  # (torch: here only)

            args = single_node_torchrun_args(nproc)
            for key, value in loopback_env().items():
                env.setdefault(key, value)
            where = "loopback rendezvous"
        else:
            host = _bundle_node_address(self.group, 0)
            endpoint = f"[{host}]:{plan['rdzv_port']}" if ":" in host else f"{host}:{plan['rdzv_port']}"
            args = [
                "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", plan["name"],
                "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}",
                "--local-addr", here, "--max-restarts", "0",
            ]  # fmt: skip
            where = f"rendezvous at {endpoint}"
        python = plan.get("python") or sys.executable
        command = [python, "-m", TORCHRUN_MODULE, *args, "-m", JOB_MODULE, plan["run_dir"]]
        command += ["--resume"] if plan.get("resume") else []
        header = (
            f"ray job {plan['name']}: node rank {rank} of {nnodes} on {here} (Ray node "
            f"{ray.get_runtime_context().get_node_id()[:12]}, agent pid {os.getpid()}, "
            f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}): {where}\n"
        )
        return command, env, header


def _bundle_node_address(group: Any, bundle: int, timeout: float = 60.0) -> str:
    """The Ray address (IP) of the node that holds ``bundle`` of ``group``."""
    import ray
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout
    while True:
        node_id = placement_group_table(group)["bundles_to_node_id"].get(bundle)
        for node in ray.nodes():
            if node_id and node["NodeID"] == node_id:
                return node["NodeManagerAddress"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"bundle {bundle} of the job's placement group is on no alive node")
        time.sleep(0.5)


def _die_with(parent: int) -> Any:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that started it ends (Linux
    ``PR_SET_PDEATHSIG``); a parent gone before that took effect ends the child at once. (Elsewhere:
    nothing; the workers still end with their agent.)"""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # (looked up before the fork)
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class Supervisor:
    """The job's supervisor, a detached actor without CPUs: it watches every agent's torchrun, ends the
    job when one fails or dies, removes the placement group at the end and keeps the job's final
    word (see the module's docstring) until :meth:`RayLauncher.status` has read it."""

    def __init__(self, plan: dict[str, Any], group: Any, agents: list[Any]) -> None:
        self.plan, self.group, self.agents = plan, group, agents
        self.ends: dict[int, str] = {}
        self.failed: list[str] = []
        self.started = False
        self.killing = False
        self.record: dict[str, Any] | None = None
        self.lock = threading.Lock()
        self.over = threading.Event()
        threading.Thread(target=self._watch, name="mlora-supervise", daemon=True).start()

    def ping(self) -> str:
        """The Ray node this supervisor runs on (the head node, where it can be)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def report(self) -> dict[str, Any]:
        """The job's state as :class:`EngineJob` fields."""
        name = self.plan["name"]
        if self.record is not None:
            return self.record
        if not self._group_placed():
            return {"state": "PENDING", "words": self._pending_words(), "pending": True}
        if self.failed or self.killing:
            why = self.failed[0] if self.failed else "it is being killed"
            return {"state": "RUNNING", "words": f"Ray job {name} is ending ({why})"}
        nodes = sorted({n for n in self.plan.get("nodes", [])})
        on = f" on {', '.join(nodes)}" if nodes else ""
        return {"state": "RUNNING", "words": f"Ray job {name} runs{on}"}

    def stop(self) -> None:
        """SIGTERM every node's ranks (they finish the step, save and exit 0)."""
        for agent in self.agents:
            agent.terminate.remote()

    def kill(self) -> dict[str, Any]:
        """SIGKILL every agent's process tree, remove the group, and return the final record once Ray
        says the agents are dead and the group removed."""
        import ray

        with self.lock:
            self.killing = True
        if self._group_placed():  # (an agent on a dead node never answers: at most 30 s for them all)
            refs = [agent.kill_tree.remote() for agent in self.agents]
            ray.wait(refs, num_returns=len(refs), timeout=30)
        self._end()
        return self.record or {}

    # -- watching ------------------------------------------------------------------------------------
    def _group_placed(self) -> bool:
        from ray.util import placement_group_table

        if not self.started:
            table = placement_group_table(self.group)
            if table.get("state") == "CREATED":
                self.started = True
                self.plan["nodes"] = self._node_addresses(table)
        return self.started

    def _node_addresses(self, table: dict) -> list[str]:
        import ray

        where = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [where.get(node, "?") for node in table.get("bundles_to_node_id", {}).values()]

    def _pending_words(self) -> str:
        """Ray's reason the group waits: what it asks, against what the cluster has."""
        from ray.util import placement_group_table

        table = placement_group_table(self.group)
        stats = table.get("stats") or {}
        reason = stats.get("scheduling_state") or table.get("state", "PENDING")
        nodes, total, free = cluster_view()
        bundle = self.plan["bundle"]
        asks = ", ".join(f"{k}: {amount(v)}" for k, v in bundle.items())
        has = "; ".join(
            f"{key} {amount(free.get(key, 0.0))} free of {amount(total.get(key, 0.0))}" for key in bundle
        )
        return (
            f"Ray placement group {self.plan['name']} is waiting for resources ({reason}): it asks "
            f"{self.plan['nnodes']} bundles of {{{asks}}}, each on its own node (STRICT_SPREAD); the "
            f"cluster has {len(nodes)} alive node{'s' if len(nodes) != 1 else ''}, {has}"
        )

    def _watch(self) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        waiting = {agent.wait.remote(): i for i, agent in enumerate(self.agents)}
        first_bad: float | None = None
        while waiting and not self.killing:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=1.0)
            for ref in ready:
                i = waiting.pop(ref)
                try:
                    code = ray.get(ref)
                except ActorUnavailableError:  # its process is gone or cut off: wait for Ray's verdict
                    said = dead(self.agents[i])
                    if said is None:
                        time.sleep(0.5)
                        waiting[self.agents[i].wait.remote()] = i
                        continue
                    self._ended(i, None, f"the agent of node rank {i} died: {said}")
                except RayActorError as e:
                    self._ended(i, None, f"the agent of node rank {i} died: {words(e)}")
                except RayTaskError as e:
                    self._ended(i, None, words(e.cause if e.cause is not None else e))
                else:
                    self._ended(i, code, None)
            if self.failed and first_bad is None:
                first_bad = time.monotonic()
            if first_bad is not None and waiting and time.monotonic() - first_bad > FAIL_GRACE_S:
                for i in waiting.values():
                    self.agents[i].kill_tree.remote()
                first_bad = float("inf")  # (once)
        if not self.killing:
            self._end()

    def _ended(self, rank: int, code: int | None, died: str | None) -> None:
        self.ends[rank] = f"exited with code {code}" if died is None else "died"
        if died is not None:
            self.failed.insert(0, died)  # a death is the cause; the others' exits follow from it
        elif code != 0:
            self.failed.append(f"the agent of node rank {rank} exited with code {code}")

    def _end(self) -> None:
        """Remove the group, wait until Ray says every agent is dead and the group removed, keep the record."""
        import ray
        from ray.util import placement_group_table, remove_placement_group

        with self.lock:
            ending = self.over.is_set()
            self.over.set()
        if ending:  # (the watcher and a kill may both get here: the first ends the job, the other waits)
            deadline = time.monotonic() + DEAD_WAIT_S + 30
            while self.record is None and time.monotonic() < deadline:
                time.sleep(0.2)
            return
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)
        for agent in self.agents:  # (Ray kills a group's actors with it; one never placed waits until killed)
            with contextlib.suppress(Exception):
                ray.kill(agent, no_restart=True)
        deadline = time.monotonic() + DEAD_WAIT_S
        unconfirmed = list(range(len(self.agents)))
        while unconfirmed and time.monotonic() < deadline:
            name, namespace = self.plan["name"], self.plan["namespace"]
            unconfirmed = [i for i in unconfirmed if lookup(agent_name(name, i), namespace) is not None]
            if unconfirmed:
                time.sleep(0.2)
        removed = placement_group_table(self.group).get("state") == "REMOVED"
        name, ends = self.plan["name"], "; ".join(f"node rank {i} {e}" for i, e in sorted(self.ends.items()))
        if self.killing:
            state, clean = "STOPPED", False
            said = f"Ray job {name} was killed (its processes SIGKILLed, its placement group removed)"
        elif self.failed:
            state, clean = "FAILED", False
            said = f"Ray job {name} failed: {'; '.join(self.failed)}"
        else:
            state, clean = "SUCCEEDED", True
            said = f"Ray job {name} ended: {ends}"
        if unconfirmed or not removed:
            left = (
                f"agents of node ranks {unconfirmed} still alive" if unconfirmed else "its group not removed"
            )
            said += f" (Ray did not confirm its end within {DEAD_WAIT_S:.0f} s: {left})"
        self.record = {"state": state, "words": said, "final": True, "clean": clean}
        threading.Timer(RECORD_TTL_S, _exit_actor).start()


def _exit_actor() -> None:
    """End the actor this runs in (its record kept long enough)."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(ray.get_runtime_context().current_actor)
