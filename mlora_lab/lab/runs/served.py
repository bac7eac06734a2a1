"""The handle of a run whose job serves the Tinker API: :class:`ServedRun` (``ml.serve`` returns one, and
``ml.attach`` does for a run directory whose job.json has a ``service``).

    svc = ml.serve(spec)                      # a Run: dashboard, metrics, stop, ... as any other
    tc = svc.client().create_lora_training_client(base_model=svc.base_model, rank=8)
    svc.new_key("bob"); svc.revoke_key("bob")

This side never talks to the job's process: it reads ``service/endpoint.json`` (where the server listens)
and reads and rewrites ``service/keys.json`` (which the server re-reads), both through
:mod:`mlora_lab.rundir.service`. The ``tinker`` SDK (the ``serve`` extra) is imported only by :meth:`client`.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pandas as pd

from mlora_lab.lab.records.usage import latest_usage, usage_table
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import RunState
from mlora_lab.rundir import service as files
from mlora_lab.rundir.files import name_problem

ENDPOINT_TIMEOUT_S = 300.0
"""How long :attr:`ServedRun.base_url` waits for the job to load its model and listen."""


class ServiceNotUp(RuntimeError):
    """The run's service is not listening: the run ended (or failed) before, or it did not start in time."""


class ServedRun(Run):
    """A :class:`~mlora_lab.lab.runs.run.Run` whose job also serves the Tinker API (``JobSpec.service``)."""

    def endpoint(self, timeout: float = ENDPOINT_TIMEOUT_S, poll: float = 0.2) -> files.Endpoint:
        """Where the service listens, once it does: waits up to ``timeout`` seconds while the job starts
        (it loads the model first). :class:`ServiceNotUp` when the run ends first (with the job's error) or
        the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.status  # first: an endpoint removed at the end is then seen as the end
            found = files.read_endpoint(self.dir)
            if state.final:
                why = f": {self.error}" if self.error else ""
                raise ServiceNotUp(
                    f"the run is {state.value}{why}; its Tinker service is not up ({self.path})"
                )
            if found is not None and state is RunState.RUNNING:
                return found
            if time.monotonic() >= deadline:
                raise ServiceNotUp(
                    f"the Tinker service of {self.path} did not start within {timeout:g} s (run {state.value}); "
                    f"see run.logs(0)"
                )
            time.sleep(poll)

    @property
    def base_url(self) -> str:
        """The service's URL (``http://127.0.0.1:PORT``), once it listens (:meth:`endpoint`)."""
        return self.endpoint().url

    @property
    def base_model(self) -> str:
        """The model name clients pass (``create_lora_training_client(base_model=...)``): the job's base, as
        ``Service.model_name`` names it (default: ``base_model``)."""
        service = self.spec.service
        return (service.model_name if service is not None else None) or self.spec.base_model

    @property
    def keys_path(self) -> Path:
        """``service/keys.json``: the API keys, by name, owner-only."""
        return files.keys_path(self.dir)

    @property
    def api_key(self) -> str:
        """The key the job made for its owner (``"owner"`` in the keys file), once the service is up."""
        return self.key(files.OWNER)

    def key(self, name: str) -> str:
        """The API key called ``name``; ``KeyError`` naming the keys there are."""
        self.endpoint()  # (the job makes the keys file before it listens)
        keys = files.read_keys(self.keys_path)
        if name not in keys:
            raise KeyError(f"no API key named {name!r} in {self.keys_path}; keys: {sorted(keys)}")
        return keys[name]

    def new_key(self, name: str) -> str:
        """A new API key for ``name`` (replacing its old one), accepted by the running service at once (it
        re-reads the keys file). Models a key creates are its own."""
        problem = name_problem(name)
        if problem:
            raise ValueError(f"a key's name is 1-100 characters from A-Z a-z 0-9 . _ - ({problem})")
        self.endpoint()  # the job writes the keys file before it listens; after that, only we do
        keys = files.read_keys(self.keys_path)
        keys[name] = files.new_key()
        files.write_keys(self.keys_path, keys, root=self.path)
        return keys[name]

    def revoke_key(self, name: str) -> None:
        """Forget ``name``'s key: the service refuses it from its next request on."""
        self.endpoint()
        keys = files.read_keys(self.keys_path)
        if name not in keys:
            raise KeyError(f"no API key named {name!r} in {self.keys_path}; keys: {sorted(keys)}")
        del keys[name]
        files.write_keys(self.keys_path, keys, root=self.path)

    def client(self, api_key: str | None = None, **kwargs: Any) -> Any:
        """A ``tinker.ServiceClient`` bound to the service (with the owner's key unless ``api_key`` is
        given) that sends the job no telemetry (:func:`service_client`); ``kwargs`` go to it. Needs the
        ``tinker`` SDK: ``pip install 'mlora_lab[serve]'``."""
        return service_client(self.base_url, api_key or self.api_key, **kwargs)

    @property
    def openai_base_url(self) -> str:
        """The OpenAI-compatible API of the job (``<base_url>/v1``): models ``base``, each tenant by its name
        and the named sampler snapshots (:mod:`mlora_lab.service.openai_api`), with the same API keys."""
        return f"{self.base_url}/v1"

    def openai_client(self, api_key: str | None = None, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client of :attr:`openai_base_url` (with the owner's key unless ``api_key`` is
        given); ``kwargs`` go to it. Needs the ``openai`` package: ``pip install 'mlora_lab[openai]'``."""
        try:
            import openai
        except ImportError as e:
            raise ImportError("svc.openai_client() needs the openai package: pip install openai") from e
        return openai.OpenAI(base_url=self.openai_base_url, api_key=api_key or self.api_key, **kwargs)

    def usage(self, by: str = "tenant") -> pd.DataFrame:
        """What the clients' requests have cost the job so far: per API key and tenant (``by="tenant"``;
        tenant ``None``: samples of the base model) or per key (``by="key"``): ``tokens_trained``,
        ``tokens_forward``, ``tokens_sampled``, ``busy_s`` (the job's seconds, each step's shared out over
        its tenants by their tokens) and ``requests``, most busy first (:mod:`mlora_lab.lab.records.usage`)."""
        return usage_table(latest_usage(self.typed_rows()), by=by)

    def tenant_of(self, model_id: str) -> str:
        """The name of the tenant a client's model is in the job (``job.json`` records each client's model
        with its tenant): its ``user_metadata["name"]``, or its key's name and a count (``owner-1``).
        ``KeyError`` for a model the job has not made (yet)."""
        for t in self.spec.tenants:
            if t.client is not None and t.client.model_id == model_id:
                return t.name
        raise KeyError(f"no tenant of model {model_id!r} in {self.path}")

    def local_path(self, tinker_path: str) -> Path:
        """The PEFT adapter directory of a checkpoint a client saved: ``tinker://…/weights/<name>``
        (``save_state``) or ``tinker://…/sampler_weights/<name>`` (a named ``save_weights_for_sampler``);
        ``FileNotFoundError`` when the run has none of that name."""
        return files.local_path(self.dir, tinker_path)


def service_client(base_url: str, api_key: str, **kwargs: Any) -> Any:
    """A ``tinker.ServiceClient`` of a served job (``kwargs`` go to it) that sends no telemetry.

    The SDK reports its own usage and errors to whatever server it talks to, in batches every 10 s and when it
    closes (``TINKER_TELEMETRY``, on by default). A served job collects none: it takes the batches and drops
    them, and once it has stopped, a client still alive in a notebook failed to send one and printed a 75-line
    traceback into whatever cell ran then. Telemetry is turned off for this client alone, as each of its
    sessions starts; the environment, and every other client of the process, are left as they are."""
    return _client_class()(base_url=base_url, api_key=api_key, **kwargs)


@functools.cache
def _client_class() -> type:
    try:
        import tinker
    except ImportError as e:
        raise ImportError(
            "svc.client() needs the tinker SDK: pip install 'mlora_lab[serve]' (or tinker==0.38.0)"
        ) from e

    class ServedJobClient(tinker.ServiceClient):
        """A ``tinker.ServiceClient`` whose holders (its session's, its REST reads') send no telemetry."""

        def _get_session_holder(self) -> Any:
            return _without_telemetry(super()._get_session_holder())

        def _get_rest_holder(self) -> Any:
            return _without_telemetry(super()._get_rest_holder())

    return ServedJobClient


def _without_telemetry(holder: Any) -> Any:
    """``holder`` (the SDK 0.38 ``InternalClientHolder``) with its telemetry stopped and dropped: what it
    queued is never sent, and it queues nothing more (the SDK logs only ``if holder.get_telemetry()``)."""
    telemetry = getattr(holder, "_telemetry", None)
    if telemetry is not None:
        holder._telemetry = None
        telemetry.stop()
    return holder
