"""A served job launched like any other (``ml.serve``): the real Tinker SDK drives a tenant over HTTP,
keys are checked (a wrong one, one added and then revoked), and a stop ends the run and its service."""

from __future__ import annotations

import math
import stat
import time

import pytest
import transformers

import mlora_lab as ml

tinker = pytest.importorskip("tinker")
from conftest import stop_runs_under  # noqa: E402
from tinker import types  # noqa: E402

SLOTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # (no lm_head)


def refused(client: tinker.ServiceClient, base_model: str) -> bool:
    """Whether the service refuses the client's key: creating a training client fails with
    AuthenticationError."""
    try:
        client.create_lora_training_client(base_model=base_model, rank=4, train_unembed=False).result()
    except tinker.AuthenticationError:
        return True
    return False


@pytest.mark.slow  # (starts a job)
def test_served_job_trains_a_tinker_client_checks_keys_and_stops(llama_path, tmp_path):
    spec = ml.JobSpec(base_model=llama_path, tenants=[], seq_len=48, max_tenants=2, max_rank=8,
                      slot_modules=SLOTS)  # fmt: skip
    t0 = time.monotonic()
    svc = ml.serve(spec, workdir=tmp_path / "runs")
    try:
        assert isinstance(svc, ml.Run) and svc.spec.service == ml.Service()
        assert svc.base_url.startswith("http://127.0.0.1:") and svc.base_model == llama_path
        started = time.monotonic() - t0
        # one forward_backward of two datums, then optim_step, through the real SDK
        tc = svc.client().create_lora_training_client(base_model=svc.base_model, rank=4, train_unembed=False)
        tc = tc.result()  # (the SDK hands back a future of the client)
        tok = transformers.AutoTokenizer.from_pretrained(llama_path)
        data = []
        for text in ("the red cat sat on the road", "a blue bird and a green tree"):
            ids = tok(text).input_ids
            data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))  # fmt: skip
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        loss = fb.result().metrics["loss:sum"]
        step.result()
        assert math.isfinite(loss) and loss > 0
        tenant = tc.model_id.replace(":", "-")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and tenant not in set(svc.metrics().get("tenant", [])):
            time.sleep(0.2)
        train = svc.metrics()
        assert list(train[train["tenant"] == tenant]["loss"]) == pytest.approx([loss], rel=1e-4)
        # a saved state is also a PEFT adapter directory in the run, found from its tinker:// path
        saved = tc.save_state("after-one-step").result().path
        assert (svc.local_path(saved) / "adapter_config.json").is_file()
        with pytest.raises(FileNotFoundError):
            svc.local_path(f"tinker://{tc.model_id}/weights/never-saved")
        # keys: a wrong one is refused; one added works at once, and is refused once revoked
        base = svc.base_model
        assert refused(tinker.ServiceClient(base_url=svc.base_url, api_key="tml-wrong"), base)
        bob = svc.new_key("bob")
        assert not refused(svc.client(api_key=bob), base)
        svc.revoke_key("bob")
        assert refused(svc.client(api_key=bob), base)
        assert stat.S_IMODE(svc.keys_path.stat().st_mode) == 0o600
        assert svc.api_key.startswith("tml-") and "bob" not in svc.keys_path.read_text()
        # a stop ends the run and its service
        assert svc.stop() == "stopped", svc.logs(0)
        assert not (svc.path / "service" / "endpoint.json").exists()
        assert (svc.adapter_path(tenant) / "adapter_config.json").is_file()  # saved at the stop, as PEFT
        assert type(ml.attach(svc.path)).__name__ == "ServedRun"
        with pytest.raises(RuntimeError, match="stopped"):
            svc.base_url  # noqa: B018
        print(f"service up {started:.1f} s after ml.serve; whole test {time.monotonic() - t0:.1f} s")
    finally:
        stop_runs_under(tmp_path)
