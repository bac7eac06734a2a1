"""The HTTP side of the service driven by the real ``tinker`` SDK: requests are checked, queued and
answered through futures; a small executor thread here plays the training loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")

from mlora_lab.service import wire  # noqa: E402
from mlora_lab.service.app import Server  # noqa: E402
from mlora_lab.service.keys import Keys  # noqa: E402
from mlora_lab.service.state import ServiceState  # noqa: E402
from mlora_lab.service.work import ErrorCategory, Futures, Inbox, Kind, Result  # noqa: E402

BASE = "tiny-base"
BAD_LR = 0.5  # the executor fails an optim_step with this learning rate, as a user error


class Executor(threading.Thread):
    """Plays the training loop: takes work from the inbox and settles its futures at once."""

    def __init__(self, state: ServiceState) -> None:
        super().__init__(daemon=True)
        self.state = state
        self.seen: list[tuple[Kind, str | None, int | None]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            items = self.state.inbox.take()
            if not items:
                time.sleep(0.002)
            for w in items:
                self.seen.append((w.kind, w.model_id, w.seq_id))
                self.state.futures.settle(w.request_id, self.answer(w))

    def answer(self, w) -> Result:
        if w.kind == Kind.CREATE_MODEL:
            with self.state.lock:
                self.state.models[w.model_id] = w.body
            self.state.inbox.start_model(w.model_id)
            return Result(json={"model_id": w.model_id, "type": "create_model"})
        if w.kind == Kind.FORWARD_BACKWARD:
            logprobs = [-torch.arange(len(d.tokens), dtype=torch.float32) for d in w.body.data]
            return Result(proto=wire.forward_backward_output(logprobs, {"loss:sum": float(w.seq_id)}))
        if w.kind == Kind.OPTIM_STEP:
            if w.body.learning_rate == BAD_LR:
                return Result(error=f"learning rate {BAD_LR} refused", category=ErrorCategory.USER)
            return Result(json={"metrics": {}})
        if w.kind == Kind.SAMPLE:
            seqs = [wire.Sampled([5, 6 + i], [-0.5, -0.25], stopped=False) for i in range(w.body.num_samples)]
            return Result(proto=wire.sample_response(seqs))
        return Result(error=f"{w.kind} is not played by this executor", category=ErrorCategory.SERVER)


@pytest.fixture(scope="module")
def service():
    keys = Keys()
    alice, bob = keys.add("alice"), keys.add("bob")
    state = ServiceState(
        inbox=Inbox(capacity=64),
        futures=Futures(),
        keys=keys,
        base_model=BASE,
        limits=wire.Limits(vocab_size=100, max_tokens=32),
        max_rank=16,
    )
    state.client_config["fwdbwd_max_chunk_len"] = 2  # several chunks per forward_backward call
    executor = Executor(state)
    executor.start()
    server = Server(state).start()
    yield state, server, executor, {"alice": alice, "bob": bob}
    executor.done.set()
    server.stop()


def client(server: Server, key: str):
    return tinker.ServiceClient(base_url=server.url, api_key=key)


def post(server: Server, path: str, key: str | None, headers: dict | None = None, **kw) -> httpx.Response:
    headers = {**({} if key is None else {"X-API-Key": key}), **(headers or {})}
    return httpx.post(f"{server.url}/api/v1/{path}", headers=headers, timeout=10, **kw)


def datum(n: int):
    tokens = list(range(1, n + 1))
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": tokens, "weights": [1.0] * n},
    )


def test_training_requests_run_in_seq_order_and_results_come_back(service):
    state, server, executor, keys = service
    sc = client(server, keys["alice"])
    tc = sc.create_lora_training_client(BASE, rank=4, train_unembed=False).result()
    info = tc.get_info()
    assert (info.model_data.model_name, info.lora_rank) == (BASE, 4)
    model_id = tc.model_id
    assert state.models[model_id].owner == "alice" and not state.models[model_id].train_unembed

    lengths = [3, 5, 2, 4, 1]  # 3 chunks of at most 2 datums, sent together, the first one last
    fb = tc.forward_backward([datum(n) for n in lengths], "cross_entropy")
    opt = tc.optim_step(tinker.AdamParams(learning_rate=1e-3))
    out = fb.result()
    assert opt.result().metrics == {}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [
        [-float(i) for i in range(n)] for n in lengths
    ]
    assert out.metrics["loss:sum"] == 1 + 2 + 3  # summed over the chunks (seq ids 1, 2, 3)
    ordered = [(k, s) for k, m, s in executor.seen if m == model_id and s is not None]
    assert ordered == [
        (Kind.FORWARD_BACKWARD, 1),
        (Kind.FORWARD_BACKWARD, 2),
        (Kind.FORWARD_BACKWARD, 3),
        (Kind.OPTIM_STEP, 4),
    ]

    with pytest.raises(tinker.RequestFailedError) as failed:  # a failed future reaches the client...
        tc.optim_step(tinker.AdamParams(learning_rate=BAD_LR)).result()
    assert str(failed.value.category) == "user"
    assert "learning rate" in str(failed.value)
    assert tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result().metrics == {}  # ...which goes on


def test_sampling_returns_every_sample_with_its_sequence_id(service):
    _, server, _, keys = service
    sampler = client(server, keys["alice"]).create_sampling_client(base_model=BASE).result()
    params = tinker.SamplingParams(max_tokens=2, temperature=0.7, stop=["\n"])
    res = sampler.sample(
        tinker.ModelInput.from_ints([1, 2, 3]), num_samples=2, sampling_params=params
    ).result()
    assert [s.tokens for s in res.sequences] == [[5, 6], [5, 7]]
    ids = [s.sequence_id for s in res.sequences]
    assert len(set(ids)) == 2 and all(ids)


def test_a_wrong_or_missing_key_is_refused(service):
    state, server, _, _ = service
    before = len(state.sessions)
    with pytest.raises(tinker.AuthenticationError):
        client(server, "tml-not-a-key").create_lora_training_client(BASE, rank=4).result()
    assert len(state.sessions) == before  # nothing was created
    r = post(server, "create_session", None, json={})
    assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}  # the one open route


def test_a_key_reaches_only_its_own_models_and_futures(service):
    _, server, _, keys = service
    tc = client(server, keys["alice"]).create_lora_training_client(BASE, rank=2).result()
    r = post(server, "get_info", keys["bob"], json={"model_id": tc.model_id, "type": "get_info"})
    assert r.status_code == 404 and "no model" in r.json()["detail"]
    mine = post(server, "get_info", keys["alice"], json={"model_id": tc.model_id, "type": "get_info"})
    assert mine.status_code == 200 and mine.json()["model_id"] == tc.model_id
    fut = post(
        server,
        "optim_step",
        keys["alice"],
        json={"model_id": tc.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
    )
    request_id = fut.json()["request_id"]
    assert post(server, "retrieve_future", keys["bob"], json={"request_id": request_id}).status_code == 404
    assert post(server, "retrieve_future", keys["alice"], json={"request_id": request_id}).json() == {
        "metrics": {}
    }
    assert post(server, "retrieve_future", keys["alice"], json={"request_id": "nope"}).status_code == 404


def test_an_oversized_body_gets_413_whether_declared_or_not(service):
    state, server, _, keys = service
    limit = state.max_body_bytes
    state.max_body_bytes = 1000
    try:
        r = post(
            server,
            "forward_backward",
            keys["alice"],
            content=b"x" * 2000,
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 413 and "1000" in r.json()["detail"]
        chunked = post(
            server, "telemetry", keys["alice"], content=iter([b"{" + b" " * 600, b" " * 600 + b"}"])
        )
        assert "content-length" not in chunked.request.headers
        assert chunked.status_code == 413 and "detail" in chunked.json()
    finally:
        state.max_body_bytes = limit


def test_a_full_inbox_answers_429_never_402(service):
    state, server, _, keys = service
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 2},
        "base_model": BASE,
    }
    capacity = state.inbox.capacity
    state.inbox.capacity = 0
    try:
        r = post(server, "asample", keys["alice"], json=body)
    finally:
        state.inbox.capacity = capacity
    assert r.status_code == 429 and "busy" in r.json()["detail"]
    assert post(server, "asample", keys["alice"], json=body).status_code == 200


def test_a_hostile_body_gets_one_answer_naming_every_problem(service):
    _, server, _, keys = service
    hostile = {
        "session_id": 5,
        "model_seq_id": -1,
        "base_model": "other",
        "lora_config": {"rank": 10**9, "train_attn": "yes"},
        "optimizer_config": {"type": "sgd"},
    }
    r = post(server, "create_model", keys["alice"], json=hostile)
    assert r.status_code == 422
    problems = " | ".join(r.json()["detail"])
    for word in ("session_id", "model_seq_id", "'other'", "rank", "train_attn", "'sgd'"):
        assert word in problems, (word, problems)
    sample = {
        "prompt": {"chunks": [{"type": "image", "data": "x"}, {"tokens": [1, 10**6]}]},
        "num_samples": 10**6,
        "sampling_params": {"max_tokens": 10**9, "temperature": -1, "top_p": 0, "top_k": 0},
    }
    r = post(server, "asample", keys["alice"], json=sample)
    problems = " | ".join(r.json()["detail"])
    assert r.status_code == 422
    for word in ("image", "10000000", "num_samples", "max_tokens", "temperature", "top_p", "top_k"):
        assert word.replace("10000000", "1000000") in problems, (word, problems)
    garbage = post(server, "create_session", keys["alice"], content=b"{not json")
    assert garbage.status_code == 400 and "not JSON" in garbage.json()["detail"]
    proto = post(server, "forward_backward", keys["alice"], content=b"\xff\xff\xff")
    assert proto.status_code == 400 and proto.json()["detail"]


def test_heartbeats_move_the_session_and_a_finished_one_gets_410(service):
    state, server, _, keys = service
    sc = client(server, keys["alice"])
    sc.create_lora_training_client(BASE, rank=2).result()
    session_id = sc._get_session_holder().get_session_id()
    seen = state.sessions[session_id].last_seen
    time.sleep(0.01)
    beat = {"session_id": session_id, "type": "session_heartbeat"}  # what the SDK sends every 10 s
    assert post(server, "session_heartbeat", keys["alice"], json=beat).json() == {"type": "session_heartbeat"}
    assert state.sessions[session_id].last_seen > seen
    assert post(server, "session_heartbeat", keys["bob"], json=beat).status_code == 410  # not bob's
    sc.close("success").result()
    assert state.sessions[session_id].finished
    gone = post(server, "session_heartbeat", keys["alice"], json=beat)
    assert gone.status_code == 410 and "finished" in gone.json()["detail"]


def test_a_failing_handler_answers_500_and_the_server_goes_on(service):
    state, server, _, keys = service
    limits, state.limits = state.limits, None
    try:
        r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": keys["bob"]})
    finally:
        state.limits = limits
    assert r.status_code == 500 and r.json()["detail"]
    r = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": keys["bob"]})
    assert r.json()["supported_models"][0]["model_name"] == BASE
    assert httpx.get(f"{server.url}/api/v1/no_such_route").status_code == 404


def test_keys_file_is_owner_only_and_reloaded_when_rewritten(tmp_path):
    path = tmp_path / "keys.json"
    keys = Keys(path=path)
    k = keys.add("carol")
    assert k.startswith("tml-") and path.stat().st_mode & 0o777 == 0o600
    other = Keys.load(path)  # another process (a notebook) revokes carol and adds dave
    other.revoke("carol")
    dave = other.add("dave")
    assert keys.who(k) is None and keys.who(dave) == "dave" and keys.who("") is None


def test_connections_are_served_without_nagles_delay(service):
    """Every accepted connection has TCP_NODELAY: uvicorn writes a response's headers and body separately, and
    with Nagle's algorithm on, the body waited for the client's delayed ACK (40 ms a request, measured with
    the SDK's HTTP client on loopback before the fix; 0.85 ms after)."""
    import socket

    _, server, _, _ = service
    with httpx.Client() as http:
        assert http.get(f"{server.url}/api/v1/healthz").status_code == 200
        connections = list(server._server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_a_server_on_every_interface_is_reached_by_the_machines_name():
    """``Service(host="0.0.0.0")`` (a job on a Slurm node, reached from the login node): endpoint.json names the
    machine, not the wildcard address; loopback and IPv6 addresses are written as they are."""
    import socket

    from mlora_lab.service.app import reachable

    assert reachable("0.0.0.0") == reachable("::") == socket.gethostname()
    assert reachable("127.0.0.1") == "127.0.0.1" and reachable("::1") == "[::1]"


def test_a_long_wait_is_polled_quietly_by_the_sdk(caplog):
    """A result that takes longer than one long-poll is answered ``try_again`` as a 408 (what the hosted
    service does), which the SDK polls again without a warning; a 200 ``try_again`` printed "Retrying
    request ... because of try_again" on every poll, a dozen times an RL loop."""
    keys = Keys()
    key = keys.add("alice")
    state = ServiceState(
        inbox=Inbox(), futures=Futures(), keys=keys, base_model=BASE, limits=wire.Limits(100, 32), poll_s=0.2
    )
    with Server(state) as server:
        sampler = client(server, key).create_sampling_client(base_model=BASE).result()

        def settle_late() -> None:  # (plays a slow generation: 6 polls' worth)
            while not (items := state.inbox.take()):
                time.sleep(0.01)
            time.sleep(1.2)
            seqs = [wire.Sampled([5, 6], [-0.5, -0.25], stopped=False)]
            state.futures.settle(items[0].request_id, Result(proto=wire.sample_response(seqs)))

        threading.Thread(target=settle_late, daemon=True).start()
        with caplog.at_level("WARNING"):
            got = sampler.sample(tinker.ModelInput.from_ints([1, 2]), 1, tinker.SamplingParams(max_tokens=2))
            assert got.result(timeout=30).sequences[0].tokens == [5, 6]
    assert not [r for r in caplog.records if "try_again" in r.getMessage()], caplog.text
    assert state.poll_s < ServiceState.__dataclass_fields__["poll_s"].default < 45  # (the SDK reads for 45 s)
