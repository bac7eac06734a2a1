"""The handle of a served run, on the notebook side: the SDK clients it makes (``svc.client()``)."""

from __future__ import annotations

import os
import threading
import time

import pytest

tinker = pytest.importorskip("tinker")

from mlora_lab.lab.runs.served import service_client  # noqa: E402
from mlora_lab.service import wire  # noqa: E402
from mlora_lab.service.app import Server  # noqa: E402
from mlora_lab.service.keys import Keys  # noqa: E402
from mlora_lab.service.routes import sessions  # noqa: E402
from mlora_lab.service.state import ServiceState  # noqa: E402
from mlora_lab.service.work import Futures, Inbox, Kind, Result  # noqa: E402

BASE = "tiny-base"


@pytest.fixture
def job(monkeypatch):
    """A service on loopback whose loop only creates models (a thread plays it), counting the telemetry
    batches it is sent."""
    sent: list[bytes] = []
    route = sessions.telemetry

    async def telemetry(request, state, owner):
        sent.append(await request.body())
        return await route(request, state, owner)

    # (before the app is made: its route takes this one)
    monkeypatch.setattr(sessions, "telemetry", telemetry)
    keys = Keys()
    key = keys.add("owner")
    state = ServiceState(Inbox(), Futures(), keys, BASE, wire.Limits(vocab_size=100, max_tokens=32))
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            for w in state.inbox.take():
                assert w.kind is Kind.CREATE_MODEL
                with state.lock:
                    state.models[w.model_id] = w.body
                state.inbox.start_model(w.model_id)
                state.futures.settle(
                    w.request_id, Result(json={"model_id": w.model_id, "type": "create_model"})
                )
            time.sleep(0.002)

    threading.Thread(target=loop, daemon=True).start()
    server = Server(state).start()
    yield server.url, key, sent
    done.set()
    server.stop()


def test_m2_clients_of_svc_client_send_the_job_no_telemetry(job, monkeypatch):
    """M2: with the SDK's telemetry on (as in a notebook kernel: tests turn it off), a plain
    ``tinker.ServiceClient`` sends the job its batches (at the latest when it closes), and a client of
    ``svc.client()`` sends none, so none can fail to reach a job that has stopped. It is a ServiceClient all
    the same, and the environment is left as it was."""
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    url, key, sent = job
    plain = tinker.ServiceClient(base_url=url, api_key=key)
    plain.create_lora_training_client(BASE, rank=2).result()
    plain.close("success").result()  # (drains what its telemetry holds, to the job: still up)
    assert sent, "a plain client sends telemetry: the check below can see it"
    before = len(sent)
    ours = service_client(url, key, user_metadata={"name": "a"})
    assert isinstance(ours, tinker.ServiceClient)
    ours.create_lora_training_client(BASE, rank=2).result()
    with pytest.warns(FutureWarning):  # (deprecated by the SDK, still what older programs call)
        rest = ours.create_rest_client()
    assert rest.list_training_runs().result().training_runs
    ours.close("success").result()
    assert len(sent) == before, "svc.client() sent the job telemetry"
    assert ours.get_telemetry() is None and rest.get_telemetry() is None
    assert os.environ["TINKER_TELEMETRY"] == "1"
    again = tinker.ServiceClient(base_url=url, api_key=key)  # (other clients of the process keep theirs)
    again.create_lora_training_client(BASE, rank=2).result()
    assert again.get_telemetry() is not None
