"""The served job against what a new user and an attacker tried (issue 33): every case named there gets a
clear 4xx to its sender alone, and the job and every other client go on untouched.

- checkpoint names that are paths (``.``, ``..``, separators, NUL, over-long) on every route that takes one;
- declared tensor shapes past what the job holds (a sparse ``[1, 2**31]`` in 100 bytes);
- ``weights_info`` of a bad path; symlinks planted in the run (``load_state``, ``local_path``, a named
  snapshot read back);
- a refused request sent again with its ``seq_id``; a quarantined model's later requests; sessions that end;
  degenerate sampling parameters; too many prompt chunks.
"""

from __future__ import annotations

import os
import resource
import shutil
import threading
import time

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from conftest import task_rows, write_jsonl  # noqa: E402
from served_job import Served  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from mlora_lab.rundir import LinkRefused, RunDir, TenantState  # noqa: E402
from mlora_lab.rundir.service import local_path, saved_folder  # noqa: E402
from mlora_lab.service import wire  # noqa: E402
from mlora_lab.service.state import MAX_SAMPLING_SESSIONS, SamplingSession, Session  # noqa: E402

BAD_NAMES = [".", "..", "a/b", "../x", "a\x00b", "x" * 129, ".hidden", "", "a b", "/etc"]
"""Checkpoint names that are not names: each is refused with a 400 naming its field."""


@pytest.fixture
def served(llama_path, tmp_path):
    s = Served(llama_path, max_tenants=4, checkpoints=tmp_path / "run" / "service")
    yield s
    s.close()


def api(served: Served, path: str, body: dict | None = None, key: str | None = None, **kw) -> httpx.Response:
    return httpx.post(
        f"{served.server.url}/api/v1/{path}",
        headers={"X-API-Key": key or served.key},
        json=body,
        timeout=30,
        **kw,
    )


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def train_step(tc, tokens=(5, 6, 7, 8, 9)) -> float:
    fb = tc.forward_backward([datum(list(tokens))], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return loss


def alive(served: Served) -> bool:
    return served.thread is not None and served.thread.is_alive()


def test_checkpoint_names_that_are_paths_are_refused_on_every_route_and_touch_nothing(served, tmp_path):
    """``save_state("..")`` used to be answered 200 and then end the job; ``save_state(".", overwrite=True)``
    deleted the model's other states. Now every route that takes a checkpoint name or path answers 400 naming
    the field, before the job sees the request: the job, the other checkpoints and the other client go on."""
    honest = served.client().create_lora_training_client(base_model=served.base, rank=4).result()
    train_step(honest)
    kept_state = honest.save_state("kept").result().path
    kept_snapshot = honest.save_weights_for_sampler("kept-snap").result().path
    mallory = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    mid = mallory.model_id
    session = mid.split(":train:")[0]
    seq = 0
    for name in BAD_NAMES:
        routes = []
        for route in ("save_weights", "save_weights_for_sampler"):
            seq += 1
            routes.append((route, {"model_id": mid, "seq_id": seq, "path": name, "overwrite": True}, "path"))
        weights = f"tinker://{mid}/weights/{name}"
        sampler = f"tinker://{mid}/sampler_weights/{name}"
        seq += 1
        routes += [
            ("load_weights", {"model_id": mid, "seq_id": seq, "path": weights, "optimizer": True}, "path"),
            ("load_weights", {"session_id": session, "model_seq_id": 99, "path": weights}, "path"),
            ("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 7,
                                         "model_path": sampler}, "model_path"),
            ("asample", {"model_path": sampler, "num_samples": 1,
                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}}, "model_path"),
            ("weights_info", {"tinker_path": weights}, "tinker_path"),
        ]  # fmt: skip
        for route, body, field in routes:
            r = api(served, route, body)
            assert r.status_code == 400, (name, route, r.status_code, r.text)
            assert field in str(r.json()["detail"]), (name, route, r.text)
    # the SDK's own calls get a BadRequestError at once (no retry, no hang)
    for call in (lambda: mallory.save_state(".."), lambda: mallory.save_weights_for_sampler(".")):
        with pytest.raises(tinker.BadRequestError, match="not a checkpoint name"):
            call().result()
    with pytest.raises(tinker.BadRequestError, match="not a checkpoint name"):
        served.client().create_training_client_from_state(f"tinker://{mid}/weights/..").result()
    # nothing was touched: the job runs, both checkpoints are there, and both clients train on
    assert alive(served)
    folder = saved_folder(served.state.checkpoints, kept_state)
    assert (folder / "adapter" / "adapter_config.json").is_file()
    assert (saved_folder(served.state.checkpoints, kept_snapshot) / "adapter_config.json").is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == ["kept"]
    # (mallory's SDK client numbers its requests from 1, which the raw requests above spent: a new client)
    again = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    assert np.isfinite(train_step(honest)) and np.isfinite(train_step(again))
    honest.load_state(kept_state).result()
    assert served.trainer.tenants[served.tenant(honest.model_id)].state is TenantState.RUNNING


def sparse_request(model_id: str, seq_id: int, shape: list[int], n: int = 4) -> bytes:
    """A forward_backward whose ``target_tokens`` is a sparse_csr tensor of ``shape``: about 100 bytes."""
    rows = shape[0]
    crow = np.zeros(rows + 1, dtype="<i8") if rows < 2**20 else None
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape)
    if crow is None:  # (too many rows to list: the shape is refused before the indices are looked at)
        tensor.sparse_csr.crow_indices = np.zeros(2, dtype="<i8").tobytes()
    else:
        tensor.sparse_csr.crow_indices = crow.tobytes()
    tensor.sparse_csr.values = b""
    tensor.sparse_csr.col_indices = b""
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = np.arange(5, 5 + n, dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(tensor)
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    msg.data.append(d)
    return msg.SerializeToString()


def test_declared_tensor_shapes_are_bounded_before_anything_is_allocated(served):
    """A sparse ``[1, 2**31]`` in 100 bytes grew the job to 18 GB (the OOM killer ended it); ``[1, 2**40]``
    was a 500. Every shape is now checked against the job (positions, vocabulary, a byte budget) first: 400
    or 413, the job's memory does not move, and the model's next requests run."""
    tc = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    vocab = served.trainer.engine.vocab_rows
    rows = served.state.limits.max_tokens
    served.state.limits = wire.Limits(vocab, rows, max_tensor_bytes=1 << 16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cases = {
        (1, 2**31): 400,
        (1, 2**40): 400,
        (2**40, 1): 400,
        (rows, vocab): 413,  # (each dimension within bounds, all of it past the byte budget)
    }
    for seq, (shape, status) in enumerate(cases.items(), start=1):
        r = httpx.post(
            f"{served.server.url}/api/v1/forward_backward",
            headers={"X-API-Key": served.key, "content-type": "application/x-protobuf"},
            content=sparse_request(tc.model_id, seq, list(shape)),
            timeout=30,
        )
        assert r.status_code == status, (shape, r.status_code, r.text)
        assert "target_tokens" in str(r.json()["detail"]) or r.status_code == 413, r.text
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # (kB)
    assert grown < 200_000, f"the job grew by {grown} kB answering them"
    assert alive(served)
    # the refused seq_ids were stepped over: the SDK client (which numbers on from where it is) still trains
    other = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    assert np.isfinite(train_step(other))


def test_a_refused_request_sent_again_gets_the_same_refusal_and_the_next_one_runs(served):
    """The resend of a refused request (same ``seq_id``, now well-formed) used to get ``request_id: ""``:
    it gets the first answer again, and the model's next request runs."""
    tc = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    body = {"model_id": tc.model_id, "seq_id": 1, "path": "..", "type": "save_weights"}
    first = api(served, "save_weights", body)
    assert first.status_code == 400
    pending = len(served.state.futures._pending)
    again = api(served, "save_weights", {**body, "path": "fine"})
    assert (again.status_code, again.json()) == (first.status_code, first.json())
    assert len(served.state.futures._pending) == pending  # (the refused resend left no future behind)
    ok = api(served, "save_weights", {**body, "seq_id": 2, "path": "fine"})
    assert ok.status_code == 200 and ok.json()["request_id"]
    got = api(served, "retrieve_future", {"request_id": ok.json()["request_id"]}).json()
    assert got == {"path": f"tinker://{tc.model_id}/weights/fine", "type": "save_weights"}


def test_weights_info_of_a_bad_path_is_a_4xx(served):
    tc = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    for path, status in (
        ("tinker://x/weights/..", 400),
        ("tinker://../weights/a", 400),
        (f"tinker://{tc.model_id}/weights/../../keys.json", 400),
        ("not a path", 400),
        (f"tinker://{tc.model_id}/weights/never-saved", 404),
        ("tinker://ffff:train:0/weights/a", 404),
    ):
        r = api(served, "weights_info", {"tinker_path": path})
        assert r.status_code == status, (path, r.status_code, r.text)
    assert alive(served)


def test_a_symlink_planted_in_the_run_is_never_followed(served, tmp_path):
    """``load_state``, ``local_path`` and a named snapshot read back after it was dropped refuse a link
    planted where a checkpoint was, whether at its folder or at a file in it."""
    tc = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    train_step(tc)
    state = tc.save_state("s").result().path
    snap = tc.save_weights_for_sampler("snap").result().path
    run = RunDir(tmp_path / "run")
    folder = saved_folder(run.service, state)
    outside = tmp_path / "outside"
    shutil.copytree(folder, outside)
    # a file of the state made a link (to a copy outside with the same bytes: only the link is wrong)
    (folder / "tensors.safetensors").unlink()
    os.symlink(outside / "tensors.safetensors", folder / "tensors.safetensors")
    with pytest.raises(tinker.RequestFailedError, match="symbolic link"):
        tc.load_state(state).result()
    # the whole folder made a link
    shutil.rmtree(folder)
    os.symlink(outside, folder)
    with pytest.raises(tinker.RequestFailedError, match=r"symbolic link|no saved state"):
        tc.load_state(state).result()
    with pytest.raises(LinkRefused):
        local_path(run, state)
    # the snapshot's folder made a link; the job's copy in memory dropped, so that it is read back
    snap_folder = saved_folder(run.service, snap)
    shutil.copytree(snap_folder, tmp_path / "outside-snap")
    shutil.rmtree(snap_folder)
    os.symlink(tmp_path / "outside-snap", snap_folder)
    with pytest.raises(LinkRefused):
        local_path(run, snap)
    driver = served.trainer.drivers.all[0]
    driver.snapshots.by_key.pop(snap, None)
    sampler = served.client().create_sampling_client(model_path=snap).result()
    with pytest.raises(tinker.RequestFailedError, match="no sampler snapshot"):
        sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
    assert alive(served) and np.isfinite(train_step(tc))


def test_a_quarantined_model_answers_its_later_requests_with_why(served):
    """A forward_backward whose loss overflows quarantines the client's tenant; its later requests are
    answered with the reason instead of waiting forever, and another client trains on."""
    tc = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    other = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
    huge = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [3e38] * 4},
    )
    tc.forward_backward([huge], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="failed"):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tenant = served.trainer.tenants[served.tenant(tc.model_id)]
    assert tenant.state is TenantState.FAILED
    for later in (
        lambda: tc.forward_backward([datum([5, 6, 7])], "cross_entropy"),
        lambda: tc.optim_step(types.AdamParams(learning_rate=1e-2)),
        lambda: tc.save_state("after"),
    ):
        with pytest.raises(tinker.RequestFailedError, match="quarantined"):
            later().result(timeout=60)
    assert np.isfinite(train_step(other))


def test_sessions_that_made_no_model_expire_and_leave_the_checkpoints(llama_path, tmp_path):
    """A sampling-only client that goes away is forgotten after ``session_timeout`` (its sampling sessions
    with it, and out of the registry a checkpoint keeps); a session with models stays while they do."""
    served = Served(llama_path, session_timeout_s=1.0)
    try:
        sampler = served.client().create_sampling_client(base_model=served.base).result()
        sid = sampler._sampling_session_id
        session = sid.split(":sample:")[0]
        trainer = served.client().create_lora_training_client(base_model=served.base, rank=2).result()
        assert session in served.state.sessions
        served.state.sessions[session].last_seen = 0.0  # (as if silent since long ago: the SDK heartbeats)
        deadline = time.monotonic() + 30
        while session in served.state.sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session not in served.state.sessions and sid not in served.state.sampling_sessions
        assert sid not in served.state.registry(set())["sampling_sessions"]
        assert trainer.model_id.split(":train:")[0] in served.state.sessions  # (it made a model)
    finally:
        served.close()


def test_sv22_clients_gone_away_at_checkpoint_time_are_not_kept_as_live(llama_path, tmp_path):
    """SV22: a client silent for longer than ``session_timeout`` when a checkpoint is written has its tenant
    saved and paused first, and a session of it that made no model is forgotten, so the checkpoint (what a
    resumed job restores) holds neither as live, even when the loop had not looked at the sessions yet."""
    served = Served(llama_path, background=False, session_timeout_s=30.0, run_dir=tmp_path / "run")
    try:
        sampling = served.client()
        sid = sampling.create_sampling_client(base_model=served.base).result()._sampling_session_id
        program, made = served.client(), []

        def create() -> None:
            made.append(program.create_lora_training_client(base_model=served.base, rank=2).result())

        threading.Thread(target=create, daemon=True).start()
        served.step_while(lambda: not made, timeout=60)
        name, model_session = served.tenant(made[0].model_id), made[0].model_id.split(":train:")[0]
        for client in (sampling, program):  # (no heartbeat from here on: they went away)
            client._get_session_holder().close()
        with served.state.lock:
            for session in served.state.sessions.values():
                session.last_seen -= 31.0
        served.trainer.save_checkpoint()
        state = served.trainer.checkpointer.latest()[1]
        kept = state["tenants"][name]
        assert kept["state"] == TenantState.PAUSED.value, kept["state"]
        assert kept["reason"].startswith("its client sent no heartbeat nor request"), kept["reason"]
        assert (served.trainer.run.adapters / name / "adapter_model.safetensors").is_file()
        sessions = state["service"]["sessions"]
        assert model_session in sessions and sid.split(":sample:")[0] not in sessions, sorted(sessions)
        assert sid not in state["service"]["sampling_sessions"]
    finally:
        served.close()


def test_a_session_keeps_its_most_recently_used_sampling_sessions():
    from mlora_lab.service.keys import Keys
    from mlora_lab.service.state import ServiceState
    from mlora_lab.service.work import Futures, Inbox

    state = ServiceState(Inbox(), Futures(), Keys(), "base", wire.Limits(10, 10))
    state.sessions["s"] = Session("alice")
    for i in range(MAX_SAMPLING_SESSIONS + 10):
        state.add_sampling_session(f"s:sample:{i}", SamplingSession("alice", "base"))
        if i == 20:
            state.used_sampling_session("s:sample:0")  # (used again: kept)
    assert len(state.sampling_sessions) == MAX_SAMPLING_SESSIONS
    assert "s:sample:0" in state.sampling_sessions and "s:sample:1" not in state.sampling_sessions
    assert state.expire_sessions(now=1e12, timeout_s=60) == ["s"] and not state.sampling_sessions


def test_degenerate_sampling_parameters_are_clamped_and_too_many_chunks_refused(served):
    """temperature 1e-320 (logits / it overflow to inf) samples greedily, as 0 does; top_p 1e-300 (0 in
    float32) keeps the most likely token; more prompt chunks than the server takes are refused, not dropped."""
    sampler = served.client().create_sampling_client(base_model=served.base).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])

    def tokens(**params) -> list[int]:
        got = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=3, **params)).result()
        return got.sequences[0].tokens

    greedy = tokens(temperature=0.0)
    assert tokens(temperature=1e-320) == greedy
    assert tokens(temperature=1.0, top_p=1e-300) == greedy
    body = {
        "sampling_session_id": sampler._sampling_session_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}] * 1025},
        "sampling_params": {"max_tokens": 2},
    }
    r = api(served, "asample", body)
    assert r.status_code == 422 and "1025 chunks" in str(r.json()["detail"])


def test_a_served_job_without_slot_modules_serves_the_sdks_default_client(llama_path, tmp_path):
    """No ``slot_modules``: a served job slots every linear layer and the output layer, so the SDK's default
    ``create_lora_training_client`` (attention, MLP and the output layer) is a tenant; a narrower job refuses
    it naming the flags to turn off."""
    served = Served(llama_path)
    try:
        assert served.trainer.spec.slot_modules == ["all-linear", "lm_head"]
        tc = served.client().create_lora_training_client(base_model=served.base, rank=4).result()
        adapter = served.trainer.model.tenants[served.tenant(tc.model_id)]
        assert "lm_head" in adapter.modules and any("mlp" in m for m in adapter.modules)
        assert np.isfinite(train_step(tc))
    finally:
        served.close()
    narrow = Served(llama_path, slot_modules=["q_proj", "v_proj"])
    try:
        with pytest.raises(tinker.RequestFailedError) as e:
            narrow.client().create_lora_training_client(base_model=narrow.base, rank=4).result()
        assert "train_mlp=False and train_unembed=False" in str(e.value)
        tc = (
            narrow.client()
            .create_lora_training_client(base_model=narrow.base, rank=4, train_mlp=False, train_unembed=False)
            .result()
        )
        assert np.isfinite(train_step(tc))
    finally:
        narrow.close()
    linear = Served(
        llama_path, slot_modules=["all-linear"]
    )  # (PEFT's all-linear leaves the output layer out)
    try:
        with pytest.raises(tinker.RequestFailedError, match=r"output layer .* train_unembed=False,"):
            linear.client().create_lora_training_client(base_model=linear.base, rank=4).result()
    finally:
        linear.close()


def test_slots_that_would_be_empty_fail_validation_and_host_empty_is_named(llama_path):
    import mlora_lab as ml
    from mlora_lab.spec.job import effective_slot_modules
    from mlora_lab.validate import problems

    said = [
        str(p) for p in problems(ml.JobSpec(base_model=llama_path, tenants=[], slot_modules=[], stay_up=True))
    ]
    assert any("slot_modules is empty" in p for p in said), said
    waiting = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True)
    assert problems(waiting) == []
    assert effective_slot_modules(waiting) == ["all-linear"]
    said = [
        str(p) for p in problems(ml.JobSpec(base_model=llama_path, tenants=[], service=ml.Service(host="")))
    ]
    assert len(said) == 1 and "service.host is empty" in said[0] and "0.0.0.0" in said[0], said


def test_sh1d_no_tenant_of_a_served_job_takes_a_name_of_the_base(llama_path, tmp_path):
    """SH1d: a served job's tenant named ``base`` (or as clients name the base, ``Service.model_name``) would be
    listed twice by the OpenAI endpoint and never reached: validation names it; unserved, the name is free."""
    import mlora_lab as ml
    from mlora_lab.validate import problems

    data = write_jsonl(tmp_path / "d.jsonl", task_rows("reverse", 4))
    for name, service in (("base", ml.Service()), ("my-base", ml.Service(model_name="my-base"))):
        spec = ml.JobSpec(base_model=llama_path, tenants=[ml.Tenant(name=name, data=data)], service=service)
        said = [str(p) for p in problems(spec)]
        assert len(said) == 1 and f"'{name}' is what the job's OpenAI endpoint calls" in said[0], said
    assert problems(ml.JobSpec(base_model=llama_path, tenants=[ml.Tenant(name="base", data=data)])) == []


def test_clients_tenants_are_named_after_their_metadata_or_their_key(llama_path):
    """A tenant takes its name from the SDK's ``user_metadata`` (the session's, or the model's own), made
    safe and unique; without one, from its key's name and a count, never an opaque id alone."""
    served = Served(llama_path, max_tenants=5, background=True)
    bob = served.keys.add("bob")
    names = []
    for kwargs, model_meta in (
        ({"user_metadata": {"name": "alice-rl"}}, None),
        ({"user_metadata": {"name": "alice-rl"}}, None),
        ({}, {"name": "my run/../x"}),
        ({}, None),
        ({"api_key": bob}, None),
    ):
        key = kwargs.pop("api_key", None)
        sc = served.client(key, **kwargs)
        tc = sc.create_lora_training_client(base_model=served.base, rank=2, user_metadata=model_meta).result()
        names.append(served.tenant(tc.model_id))
    served.close()
    assert names == ["alice-rl", "alice-rl-2", "my-run-..-x", "owner-1", "bob-1"]


def test_each_keys_tokens_and_busy_seconds_are_metered_per_tenant(llama_path):
    """Usage rows count, per API key and tenant, the tokens trained (forward_backward), the tokens scored
    (forward), the tokens sampled and the requests, and share each step's and generation's time out over
    them; the totals go into the job's checkpoints and come back."""
    from mlora_lab.job.metering import Meter
    from mlora_lab.lab.records.usage import latest_usage, usage_cell, usage_table
    from mlora_lab.rundir import Row

    served = Served(llama_path, max_tenants=3)
    try:
        bob_key = served.keys.add("bob")
        alice = served.client(user_metadata={"name": "alice-sft"})
        tc = alice.create_lora_training_client(base_model=served.base, rank=2).result()
        t0 = time.monotonic()
        for _ in range(2):
            train_step(tc, (5, 6, 7, 8, 9))  # 4 input tokens a step
        tc.forward([datum([5, 6, 7])], "cross_entropy").result()  # 2 tokens scored
        bob = served.client(bob_key).create_lora_training_client(base_model=served.base, rank=2).result()
        train_step(bob, (5, 6, 7))
        base = served.client(bob_key).create_sampling_client(base_model=served.base).result()
        got = base.sample(
            types.ModelInput.from_ints([5, 6]), 3, types.SamplingParams(max_tokens=4, temperature=1.0)
        )
        sampled = sum(len(s.tokens) for s in got.result().sequences)
        wall = time.monotonic() - t0
        driver = served.trainer.drivers.all[0]
        deadline = time.monotonic() + 30
        rows: list = []
        while time.monotonic() < deadline:  # (written when the job goes idle)
            rows = [Row.from_dict(r) for r in served.trainer.recorder.history if r["kind"] == "usage"]
            latest = latest_usage(rows)
            if ("bob", None) in latest and latest[("bob", "bob-1")].requests == 2:
                break
            time.sleep(0.05)
        latest = latest_usage(rows)
        a, b, s = latest[("owner", "alice-sft")], latest[("bob", "bob-1")], latest[("bob", None)]
        assert (a.tokens_trained, a.tokens_forward, a.tokens_sampled, a.requests) == (8, 2, 0, 5)
        assert (b.tokens_trained, b.tokens_forward, b.requests) == (2, 0, 2)
        assert (s.tokens_sampled, s.requests, s.tokens_trained) == (sampled, 1, 0)
        assert all(u.busy_s > 0 for u in (a, b, s)) and a.busy_s + b.busy_s + s.busy_s < wall
        per_key = usage_table(latest, by="key").set_index("key")
        assert per_key.loc["bob", "tokens_sampled"] == sampled and per_key.loc["owner", "requests"] == 5
        text, title = usage_cell(latest)
        assert text == f"10 trained · {sampled} sampled" and "bob:" in title and "owner:" in title
        again = Meter()
        assert again.load_state_dict(driver.state_dict()["service"]) == 0
        assert again.usage[("bob", None)].tokens_sampled == sampled
        assert again.load_state_dict({"usage": [["k", 5, {}], "junk", ["k", None, {"requests": True}]]}) == 3
    finally:
        served.close()
