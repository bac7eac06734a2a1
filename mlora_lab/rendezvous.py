"""A loopback-only torchrun rendezvous for single-node jobs: nothing a job starts listens beyond 127.0.0.1.

What listens where. A torchrun job on one node opens these listening TCP sockets:

=====================  ====================================  ===========================  ==================
socket                 process                               ``--standalone`` / c10d      ``mlora-loopback``
=====================  ====================================  ===========================  ==================
rendezvous TCPStore    the agent (``pt_elastic``)            ``::`` (all interfaces)      ``127.0.0.1``
shared agent store     the agent; workers connect to it at   ``::`` (all interfaces)      ``127.0.0.1``
                       ``MASTER_ADDR:MASTER_PORT``
gloo / NCCL sockets    every worker                          the hostname's address       ``lo`` (loopback)
=====================  ====================================  ===========================  ==================

Why the stock path is open: ``torch.distributed.TCPStore(host, port, is_master=True)`` uses ``host`` only to
*connect*; its server always binds the wildcard address, so both agent stores accept connections from any
host that can reach the machine -- and a TCPStore has no authentication: whoever connects can read and
write the keys the job coordinates through. Collectives bind the address the hostname resolves to (a LAN
address on most machines) unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface.

How this backend closes it. ``TCPStore`` does honour an already-bound listening socket passed as
``master_listen_fd``; so every store here is created from a socket bound to ``127.0.0.1`` port 0 (the
kernel picks a free port, so many jobs can run at once on one machine without clashing or racing for a
port). The backend is torchrun's own c10d dynamic rendezvous with two changes: (1) the rendezvous store
is such a loopback store, always hosted by this (the only) agent; (2) the handler's shared agent store --
the one whose port becomes the workers' ``MASTER_PORT`` -- is one too, and the node address is forced to
``127.0.0.1`` so ``MASTER_ADDR`` is ``127.0.0.1``. :func:`loopback_env` points gloo and NCCL at the loopback
interface for the collectives' own sockets.

Use it (torchrun finds the backend through the ``torchrun.handlers`` entry point in ``pyproject.toml``)::

    python -m torch.distributed.run $(single_node_torchrun_args(N)) train.py ...   # env: loopback_env()

Single node only: a multi-node rendezvous must listen where the other nodes can reach it, so it cannot be
loopback (``launchers/multinode.sh`` uses the stock c10d backend on a trusted network). This module imports
only torch, psutil and the standard library: torchrun loads it in every agent process.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import psutil
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters

# torch.distributed.elastic.rendezvous is imported only inside the functions below, never at import time:
# importing that package loads every ``torchrun.handlers`` entry point, this module included, so a
# top-level import would make ``import mlora_lab.rendezvous`` load itself half-initialised.

__all__ = [
    "BACKEND",
    "LOOPBACK",
    "create_handler",
    "loopback_env",
    "loopback_interface",
    "loopback_tcp_store",
    "single_node_torchrun_args",
    "torchrun_handler",
]

BACKEND = "mlora-loopback"
LOOPBACK = "127.0.0.1"
_LOOPBACK_NAMES = ("127.0.0.1", "localhost")


def single_node_torchrun_args(nproc: int) -> list[str]:
    """torchrun arguments (everything before the script) for an ``nproc``-process job on this node, on
    the ``mlora-loopback`` rendezvous.

    ``--rdzv-endpoint 127.0.0.1:0``: the rendezvous store listens on loopback, on a free port the kernel
    picks (so concurrent jobs never clash); ``--rdzv-id``: a fresh id per job; ``--local-addr 127.0.0.1``:
    the address the workers get as ``MASTER_ADDR`` (the backend forces it anyway); ``--max-restarts 0``:
    a failed worker fails the job. ``--standalone`` must not be added: it replaces the backend with c10d.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [
        "--rdzv-backend", BACKEND,
        "--rdzv-endpoint", f"{LOOPBACK}:0",
        "--rdzv-id", uuid.uuid4().hex,
        "--local-addr", LOOPBACK,
        "--nnodes", "1",
        "--nproc-per-node", str(nproc),
        "--max-restarts", "0",
    ]  # fmt: skip


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS).

    Falls back to any interface with a loopback address (``127.0.0.0/8`` or ``::1``); raises
    :class:`RuntimeError` if there is none, since then the collectives cannot be kept on loopback.
    """
    interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    for name, addrs in interfaces.items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and _is_loopback(a.address):
                return name
    raise RuntimeError(f"no loopback network interface on this machine (interfaces: {sorted(interfaces)})")


def loopback_env() -> dict[str, str]:
    """Environment for a single-node job so the collectives' own sockets listen on loopback too.

    gloo binds its pair sockets to the address of ``GLOO_SOCKET_IFNAME`` (default: whatever the hostname
    resolves to, usually a LAN address) and NCCL its bootstrap/socket transport to ``NCCL_SOCKET_IFNAME``;
    both are set to the loopback interface's name. Apply with ``setdefault`` so a user's own setting wins.
    """
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def loopback_tcp_store(port: int = 0, timeout: timedelta = timedelta(seconds=60)) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``127.0.0.1:port`` only (``port=0``: a free port; read ``.port``).

    ``TCPStore(host, ...)`` binds the wildcard address whatever ``host`` says, so the socket is bound and
    put into listening state here and handed over as ``master_listen_fd``. The store takes ownership of
    that file descriptor (it closes it when the store is destroyed), hence ``detach()``: the Python socket
    object must neither close it nor hand it to a second store.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if port and os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port may be in TIME_WAIT
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
        store = dist.TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=sock.fileno(), timeout=timeout)
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


@functools.cache
def _classes() -> tuple[type, type]:
    """The backend and handler classes (built on first use, see the note on imports above)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class LoopbackC10dBackend(C10dRendezvousBackend):
        """torchrun's c10d rendezvous state machine (compare-and-set on one store key), under this
        backend's name: torchrun checks that the handler's backend name equals ``--rdzv-backend``."""

        @property
        def name(self) -> str:
            return BACKEND

    class LoopbackRendezvousHandler(DynamicRendezvousHandler):
        """torchrun's dynamic rendezvous handler whose shared agent store listens on 127.0.0.1 only.

        After the rendezvous, the agent of rank 0 creates the store that workers use for their process
        group (``MASTER_ADDR:MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``); the stock handler
        makes it with ``TCPStore(addr, 0, is_master=True)``, which listens on all interfaces. This
        override makes a :func:`loopback_tcp_store` instead. (It overrides a private torch method: if
        torch renames it, the store silently reverts to the wildcard address, which
        ``tests/test_rendezvous.py`` catches.)
        """

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
            if master_addr not in _LOOPBACK_NAMES:
                raise RuntimeError(f"{BACKEND}: the agent store must be on {LOOPBACK}, not {master_addr!r}")
            return loopback_tcp_store(master_port)

    return LoopbackC10dBackend, LoopbackRendezvousHandler


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _parse_endpoint(endpoint: str | None) -> tuple[str, int]:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default_port=0)


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    seconds = params.get_as_int(f"{key}_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``mlora-loopback`` handler from torchrun's rendezvous parameters.

    Accepts the c10d options that make sense on one node (``--rdzv-conf`` ``join_timeout``,
    ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``, ``read_timeout``); refuses anything that would need a non-loopback socket:
    more than one node, a non-loopback endpoint or ``--local-addr``, or
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (then worker rank 0 would host its own store on all interfaces).
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    if params.max_nodes != 1:
        raise ValueError(f"{BACKEND} is for single-node jobs (--nnodes 1), got max_nodes={params.max_nodes}")
    host, port = _parse_endpoint(params.endpoint)
    if host not in _LOOPBACK_NAMES:
        raise ValueError(
            f"{BACKEND}: the rendezvous endpoint must be {LOOPBACK}[:port], got {params.endpoint!r}"
        )
    if params.local_addr and params.local_addr not in _LOOPBACK_NAMES:
        raise ValueError(f"{BACKEND}: --local-addr must be {LOOPBACK}, got {params.local_addr!r}")
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
        raise ValueError(
            f"{BACKEND} needs the shared agent store: with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 worker rank 0 "
            "would host the process-group store on all interfaces; unset it"
        )
    if params.get("store_type", "tcp").strip().lower() != "tcp":
        raise ValueError(f"{BACKEND} supports only store_type=tcp")
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")

    backend_cls, handler_cls = _classes()
    store = loopback_tcp_store(port, timeout=timedelta(seconds=read_timeout))
    backend = backend_cls(store, params.run_id)
    timeout = RendezvousTimeout(
        _timeout(params, "join"),
        _timeout(params, "last_call"),
        _timeout(params, "close"),
        _timeout(params, "heartbeat"),
    )
    return handler_cls.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        LOOPBACK,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torchrun calls it with no arguments and registers the
    returned creator under the entry point's name, ``mlora-loopback``."""
    return create_handler
