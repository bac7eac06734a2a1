"""A real two-node Slurm cluster on this one machine, for the Slurm launcher's tests.

Debian's ``slurm-wlm`` runs several ``slurmd`` on one host: ``node1`` and ``node2`` both have the
address 127.0.0.1, each ``slurmd -N nodeK`` listens on its own port. ``munged`` (authentication),
``slurmctld`` and the two ``slurmd`` are started here with every file (key, sockets, state, spool,
logs, pid files) under one temporary folder, in the foreground as children of this process, and
stopped by the pids recorded at start, never by name: a Slurm or munge running on the machine for
someone else is left alone. Clients find the cluster through ``SLURM_CONF``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")


def missing() -> list[str]:
    return [c for c in (*DAEMONS, *COMMANDS) if _which(c) is None]


def _which(command: str) -> str | None:
    return shutil.which(command) or shutil.which(command, path="/usr/sbin:/sbin:/usr/bin")


def install() -> str | None:
    """Install Debian's slurm-wlm (and munge) if a command is missing; None if done, else why not.
    Only as root (CI runs as root); a package index that is too old is refreshed once."""
    if not missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing())} missing) and this is not root with apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=900)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or missing():
        return f"apt-get install slurm-wlm failed: {(proc.stderr or proc.stdout)[-1500:]}"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurm:
    """``node[1-2]`` on 127.0.0.1, one partition ``debug``; whole nodes per job (``select/linear``)."""

    nodes = ("node1", "node2")

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        r = self.root
        for d in ("state", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "munge").chmod(0o700)
        ctld, d1, d2 = _free_ports(3)
        host = socket.gethostname()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=mloratest",
                    "SlurmctldHost=localhost(127.0.0.1)",
                    f"SlurmctldPort={ctld}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r}/munge/munge.sock",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool/%n",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd-%n.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd-%n.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "MpiDefault=none",
                    "SelectType=select/linear",
                    "SchedulerType=sched/backfill",
                    "ReturnToService=2",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MinJobAge=3600",
                    "KillWait=15",
                    "InactiveLimit=0",
                    "SlurmctldTimeout=30",
                    "SlurmdTimeout=30",
                    f"NodeName=node1 NodeHostname={host} NodeAddr=127.0.0.1 Port={d1} CPUs=2 State=UNKNOWN",
                    f"NodeName=node2 NodeHostname={host} NodeAddr=127.0.0.1 Port={d2} CPUs=2 State=UNKNOWN",
                    "PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (kept open by the child)
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
        )

    def start(self, timeout: float = 60) -> None:
        self.write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={m}/munge.sock",
                f"--key-file={m}/munge.key",
                f"--log-file={m}/munged.log",
                f"--pid-file={m}/munged.pid",
                f"--seed-file={m}/munged.seed",
            ],
        )
        self._wait(lambda: (m / "munge.sock").exists(), timeout, "munged")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        self._wait(lambda: self.run("sinfo", "-h").returncode == 0, timeout, "slurmctld")
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait(lambda: self.idle_nodes() == len(self.nodes), timeout, "both slurmd to register")

    def idle_nodes(self) -> int:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        return sum(1 for line in out if line.strip().endswith("idle"))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"local Slurm: no {what} ({'exited: ' + ', '.join(dead) if dead else 'timeout'})\n"
                    + self.log_tail()
                )
            time.sleep(0.3)

    def log_tail(self, n: int = 20) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_which(args[0]), *args[1:]], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still has queued or running."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def cancel_all(self, timeout: float = 60) -> None:
        """End every job of this cluster (SIGKILL to each step, then cancel) and wait until the queue
        is empty. (``scancel --signal=KILL JOB`` would only SIGTERM the steps until ``KillWait``.)"""
        for job in self.jobs():
            for step in self.run("squeue", "-h", "--steps", "-j", job, "-o", "%i").stdout.split():
                if step.split(".", 1)[1].isdigit():
                    self.run("scancel", "--signal=KILL", step)
            self.run("scancel", job)
        deadline = time.monotonic() + timeout
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop exactly the daemons started here (by pid): slurmd first, munged last."""
        with contextlib.suppress(Exception):
            self.cancel_all()
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
