"""The HTTP side of the service: Starlette routes that check a request, queue it and answer futures.

Nothing here computes. Each route checks its request (the caller's API key, the body's size and fields,
that the session, model, sampling session or checkpoint is the caller's), turns it into a
:class:`~.work.Work` item in the :class:`~.work.Inbox` and answers ``{"request_id"}`` at once; the training
loop settles the future in :class:`~.work.Futures` and the client long-polls ``retrieve_future`` for it.
The routes and their bodies are those of the ``tinker`` SDK 0.38.0: the paths its
``tinker/resources/`` modules call (``service.py``, ``training.py``, ``sampling.py``, ``weights.py``,
``futures.py``, ``models.py``) and the request and response types of ``tinker/types/``, one module of
:mod:`.routes` per resource (:mod:`~.routes.sessions`, :mod:`~.routes.training`, :mod:`~.routes.weights`,
:mod:`~.routes.sampling`, :mod:`~.routes.rest`; what they share at the door, :mod:`~.routes.base`), and
beside them the OpenAI-compatible routes (:mod:`.openai_api`).

Errors always carry a JSON body (the SDK retries a bare 400 as a connection error):
401 no or a wrong ``X-API-Key``; 404 an id that is unknown *or another key's* (so ids do not leak);
400 unreadable JSON or protobuf (JSON nested too deeply or holding a lone surrogate: naming the field,
:mod:`.reading`), a checkpoint name that is not a name (``.``, ``..``, a separator: never a path) or a path
that is not a checkpoint's, a tensor shape past what the job holds; 422 fields that are wrong
(``{"detail": ...}`` names every problem); 410 a finished session; 413 a body over ``max_body_bytes``, or
tensors that would decode past it; 429 the inbox is full (never 402: the SDK pauses for an hour on it);
500 a bug in a handler (the server goes on). An ordered request refused at the door spends its ``seq_id``
(the model's next requests do not wait for it), and sent again it gets the same answer.
``retrieve_future`` holds a request up to ``poll_s`` (40 s) and then answers ``try_again`` as a 408, which
the SDK polls again without a word.

:class:`Server` runs the app under uvicorn on a daemon thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from mlora_lab.service.openai_api import openai_routes
from mlora_lab.service.routes import rest, sampling, sessions, training, weights
from mlora_lab.service.routes.base import http_error
from mlora_lab.service.state import ServiceState

log = logging.getLogger(__name__)

RESOURCES = (sessions, training, weights, sampling, rest)
"""The Tinker routes' modules, one per resource of the SDK, each with its ``routes(state)``."""


def create_app(state: ServiceState) -> Starlette:
    """The Starlette app serving ``state``: the Tinker routes of every resource, then the OpenAI-compatible
    ones (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``); JSON for every error."""
    routes = [r for resource in RESOURCES for r in resource.routes(state)] + openai_routes(state)
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: http_error})


# ---------------------------------------------------------------------------------------------- server


def reachable(host: str) -> str:
    """The address clients reach a server listening on ``host`` at: this machine's name for a wildcard
    (``0.0.0.0``, ``::``: every interface; a job on a Slurm node is reached from the login node by name),
    an IPv6 address in brackets."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


class Server:
    """uvicorn serving ``state`` (or another ``app``) on a daemon thread with its own event loop (``futures``
    bound to it).

    ``Server(state).start()`` returns once it accepts connections; ``.url`` is then its base URL."""

    def __init__(
        self, state: ServiceState | None, host: str = "127.0.0.1", port: int = 0, app: Starlette | None = None
    ) -> None:
        self.state, self.app = state, app  # (``app``: another app than the service's, with no state)
        self.host = host
        self.port = port
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def start(self, timeout: float = 30.0) -> Server:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on a socket that says it is TCP. Without it
        # uvicorn's response (headers, then body: two writes) waited for the client's delayed ACK, 40 ms a
        # request; the flag is also set here, inherited by every accepted connection
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.state) if self.app is None else self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=75,
        )
        self._server = uvicorn.Server(config)

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            if self.state is not None:
                self.state.futures.bind(loop)
            try:
                loop.run_until_complete(self._server.serve(sockets=[sock]))  # type: ignore[union-attr]
            except BaseException as e:  # reported by start() when it happens before startup
                self._failed = e
                log.exception("the service's HTTP server stopped")
            finally:
                sock.close()
                loop.close()

        self._thread = threading.Thread(target=run, name="mlora-service-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._failed is not None or not self._thread.is_alive():
                raise RuntimeError(f"the service's HTTP server did not start: {self._failed}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service's HTTP server did not start in {timeout} s")
            time.sleep(0.01)
        self.url = f"http://{reachable(self.host)}:{self.port}"
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
