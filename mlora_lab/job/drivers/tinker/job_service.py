"""A served job's Tinker service on its process (``JobSpec.service``): keys, shared state, HTTP server.

Where the job is assembled (:mod:`mlora_lab.job.__main__`)::

    with JobService(spec, run) as service:           # keys.json made (one "owner" key) if it has none
        trainer = Trainer(spec, run.root, dist, drivers=service.drivers(DEFAULT_DRIVERS))  # ServiceDriver first
        service.start()                              # uvicorn on a thread; service/endpoint.json says where
        trainer.train()
    # the server has stopped and endpoint.json is gone

The HTTP thread only queues work and answers futures (:mod:`mlora_lab.service.app`); the training loop takes
the work at its step boundaries through :class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`, whose ``waiting()``
keeps the job up while it has no tenant. Under torchrun only rank 0 builds a ``JobService``; every other
process gets :func:`follower_drivers`, whose service driver runs what rank 0's broadcasts (keys, inbox and
futures exist on rank 0 alone)::

    drivers = service.drivers(DEFAULT_DRIVERS) if dist.is_main else follower_drivers(spec, run, DEFAULT_DRIVERS)

(``DEFAULT_DRIVERS``: :mod:`mlora_lab.job.drivers.default`; the job composes the drivers, none imports another.)
"""

from __future__ import annotations

import os

from mlora_lab import hub
from mlora_lab.bases import resolve_base
from mlora_lab.evals.metrics import ENDPOINT_ENV
from mlora_lab.job.drivers.base import DriverFactory, JobParts
from mlora_lab.job.drivers.tinker.driver import ServiceDriver
from mlora_lab.rundir import RunDir
from mlora_lab.rundir import service as files
from mlora_lab.service import wire
from mlora_lab.service.app import Server
from mlora_lab.service.keys import Keys
from mlora_lab.service.state import ServiceState
from mlora_lab.service.work import Futures, Inbox
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Service


class JobService:
    """The service of one served job (``spec.service`` set), on the process that serves it."""

    def __init__(self, spec: JobSpec, run: RunDir) -> None:
        assert isinstance(spec.service, Service), "a JobService needs a spec with a service"
        self.settings, self.run = spec.service, run
        keys = Keys(path=files.keys_path(run))
        if files.OWNER not in keys.names():
            keys.add(files.OWNER)
        # The name clients use for the base, and the tokenizer they are told to load: a Hub id where there is
        # one (the SDK and the cookbook load it by name, from the Hub cache), else the local directory.
        name = files.served_base_name(self.settings.model_name, spec.base_model)
        if spec.tokenizer:
            tokenizer = spec.tokenizer if hub.is_hub_id(spec.tokenizer) else str(hub.resolve(spec.tokenizer))
        elif hub.is_hub_id(spec.base_model):
            tokenizer = spec.base_model
        else:
            tokenizer = str(resolve_base(spec.base_model, revision=spec.revision))
        self.state = ServiceState(
            inbox=Inbox(capacity=self.settings.max_queue),
            futures=Futures(),
            keys=keys,
            base_model=name,
            limits=wire.Limits(vocab_size=1, max_tokens=1),  # (set from the engine with the driver)
            max_rank=spec.max_rank,
            tokenizer_id=tokenizer,
            checkpoints=run.service,
        )
        self.server: Server | None = None

    def driver(self, parts: JobParts) -> ServiceDriver:
        """The loop's service driver, the state's limits set from the job's model and ``seq_len`` (a datum
        is its input tokens and one more position: ``seq_len - 1`` input tokens at most)."""
        self.state.limits = wire.Limits(
            vocab_size=parts.engine.vocab_rows,
            max_tokens=parts.spec.seq_len - 1,
            max_tensor_bytes=self.state.max_body_bytes,
        )
        return ServiceDriver(
            parts,
            self.state,
            lora_alpha=self.settings.lora_alpha,
            checkpoints=self.run.service,
            session_timeout_s=self.settings.session_timeout,
            max_step_tokens=self.settings.max_step_tokens,
        )

    def drivers(self, others: tuple[DriverFactory, ...] = ()) -> tuple[DriverFactory, ...]:
        """The job's drivers: the service's first (a client's tenant is its own), then ``others`` (the job's
        default ones: the job composes them, a driver never imports another)."""
        return (self.driver, *others)

    def start(self) -> str:
        """Listen, and say where in ``service/endpoint.json``; the URL."""
        self.server = Server(self.state, self.settings.host, self.settings.port).start()
        files.write_endpoint(self.run, self.server.url, self.state.base_model)
        # (the processes the job starts, reward and metric workers, find its OpenAI endpoint: an ml.Judge there)
        os.environ[ENDPOINT_ENV[0]] = f"{self.server.url}/v1"
        os.environ[ENDPOINT_ENV[1]] = files.read_keys(files.keys_path(self.run)).get(files.OWNER, "")
        print(f"Tinker service at {self.server.url} (keys: {files.keys_path(self.run)})", flush=True)
        return self.server.url

    def stop(self) -> None:
        """Stop listening; endpoint.json is removed first, so nobody is sent to a closed port."""
        files.remove_endpoint(self.run)
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> JobService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def follower_drivers(
    spec: JobSpec, run: RunDir, others: tuple[DriverFactory, ...] = ()
) -> tuple[DriverFactory, ...]:
    """The drivers of a served job on a process other than rank 0: a service driver with no service state
    (it follows rank 0's orders, :mod:`mlora_lab.job.drivers.tinker.driver`), then ``others``."""
    assert isinstance(spec.service, Service), "a served job's drivers need a spec with a service"
    alpha = spec.service.lora_alpha

    def driver(parts: JobParts) -> ServiceDriver:
        return ServiceDriver(parts, None, lora_alpha=alpha, checkpoints=run.service)

    return (driver, *others)
