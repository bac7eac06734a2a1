"""A served job launched like any other (``ml.serve``): the real Tinker SDK drives a tenant over HTTP,
keys are checked (a wrong one, one added and then revoked), and a stop ends the run and its service; a
served job on two processes (fsdp=2; tp=2; ep=2 of an MoE model; two nodes, each one process) equals PEFT +
AdamW on one."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import mlora_lab as ml

tinker = pytest.importorskip("tinker")
from conftest import stop_runs_under  # noqa: E402
from tinker import types  # noqa: E402

SLOTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # (no lm_head)


def served_spec(base: str, service: ml.Service, **kw) -> ml.JobSpec:
    """The served job these tests launch: no tenants of its own, 3 slots of rank up to 8 on the 7 projections,
    rows of up to 48 tokens (3 slots: a client's tenant, another's, and a twin made from a saved state)."""
    return ml.JobSpec(
        base_model=base, tenants=[], seq_len=48, max_tenants=3, max_rank=8, slot_modules=SLOTS, service=service,
        **kw,
    )  # fmt: skip


def refused(client: tinker.ServiceClient, base_model: str) -> bool:
    """Whether the service refuses the client's key: creating a training client fails with
    AuthenticationError."""
    try:
        client.create_lora_training_client(base_model=base_model, rank=4, train_unembed=False).result()
    except tinker.AuthenticationError:
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # (starts a job)
def test_served_job_trains_a_tinker_client_checks_keys_stops_and_resumes(llama_path, tmp_path):
    """Served, a client trains, keys are checked, the job stops; resumed on the same port, the very same SDK
    client goes on (its seq_ids continue) with its tenant's weights and AdamW state, and equals a client made
    from the state it saved before the stop; a named sampler snapshot from before samples as it did, and so do
    the sampling clients made before the stop (of that snapshot, and of an unnamed save)."""
    port = free_port()  # (for the resume to serve on the same one)
    # (3 slots: this client's tenant, the one a key made before it was revoked, and the resumed twin)
    spec = served_spec(llama_path, ml.Service(port=port, session_timeout=5))
    t0 = time.monotonic()
    svc = ml.serve(spec, workdir=tmp_path / "runs")
    try:
        assert isinstance(svc, ml.Run) and svc.spec.service == ml.Service(port=port, session_timeout=5)
        assert svc.base_url.startswith("http://127.0.0.1:") and svc.base_model == llama_path
        started = time.monotonic() - t0
        # one forward_backward of two datums, then optim_step, through the real SDK
        tc = svc.client().create_lora_training_client(base_model=svc.base_model, rank=4, train_unembed=False)
        tc = tc.result()  # (the SDK hands back a future of the client)
        tok = transformers.AutoTokenizer.from_pretrained(llama_path)
        data = []
        for text in ("the red cat sat on the road", "a blue bird and a green tree"):
            ids = tok(text).input_ids
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
                )
            )
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        loss = fb.result().metrics["loss:sum"]
        step.result()
        assert math.isfinite(loss) and loss > 0
        # a named sampler snapshot: after the resume below, read back from its PEFT folder
        snapshot = tc.save_weights_for_sampler("kept").result().path
        greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
        prompt = types.ModelInput.from_ints(tok("the red cat").input_ids)

        def draw(sampler) -> list[int]:
            return sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0].tokens

        def snapshot_tokens(client) -> list[int]:
            return draw(client.create_sampling_client(model_path=snapshot))

        before = snapshot_tokens(svc.client())
        # the same job through its OpenAI endpoint (a launched job: the service its rank 0 runs)
        oa = svc.openai_client(max_retries=0)
        assert svc.openai_base_url == f"{svc.base_url}/v1"
        assert {"base", svc.tenant_of(tc.model_id), snapshot} <= {m.id for m in oa.models.list()}
        got = oa.completions.create(
            model=snapshot, prompt=tok("the red cat").input_ids, max_tokens=4, temperature=0
        )
        assert got.usage.completion_tokens == len(before)
        assert got.choices[0].text == tok.decode(before, skip_special_tokens=True)
        # sampling clients made before the stop: of the named snapshot, and of an unnamed save (the checkpoint
        # keeps its snapshot and both sessions)
        samplers = [
            svc.client().create_sampling_client(model_path=snapshot),
            tc.save_weights_and_get_sampling_client().result(),
        ]
        assert [draw(s) for s in samplers] == [before, before]
        tenant = svc.tenant_of(tc.model_id)
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
        # resumed: the client's tenant is back (job.json records its Tinker model), served on the same port
        again = ml.resume(svc.path)
        assert type(again).__name__ == "ServedRun" and again.base_url == svc.base_url
        assert svc.status == "running"  # (the old handle follows the job that took its run over)
        assert snapshot_tokens(again.client()) == before
        assert [draw(s) for s in samplers] == [before, before]  # the very sampling clients from before
        twin = again.client().create_training_client_from_state_with_optimizer(saved).result()
        forwards = [c.forward(data, "cross_entropy") for c in (tc, twin)]  # tc: the client from before
        got, want = (f.result().metrics["loss:sum"] for f in forwards)
        assert got == pytest.approx(want, abs=1e-6) and got < loss  # the weights after its one step
        for c in (tc, twin):  # one more step each: its AdamW state came back too
            c.forward_backward(data, "cross_entropy").result()
            c.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        got, want = (c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (tc, twin))
        assert got == pytest.approx(want, abs=1e-6)
        # its client's session is heard again (the SDK heartbeats to the same session id): its tenant runs
        state = again.tenant_states()
        assert state[tenant] == "running", state
        assert again.stop() == "stopped", again.logs(0)
        print(f"service up {started:.1f} s after ml.serve; whole test {time.monotonic() - t0:.1f} s")
    finally:
        stop_runs_under(tmp_path)


def two_rounds(svc, base: str) -> tuple:
    """The SDK drives the served job ``svc``: a client (rank 4, seed 7, attention and MLP), its state saved
    as created, two rounds of forward_backward in chunks of 3 and 2 datums + optim_step, its state saved
    again, and an unnamed sampler snapshot. ``(datums, client, init folder, losses, logprobs, final folder,
    sampling client)``."""
    from test_service_sdk import TEXTS, datums, sdk_steps

    data = datums(
        transformers.AutoTokenizer.from_pretrained(base), [*TEXTS, "the green plane and the city road"]
    )
    tc = (
        svc.client()
        .create_lora_training_client(base_model=svc.base_model, rank=4, seed=7, train_unembed=False)
        .result()
    )
    init = svc.local_path(tc.save_state("init").result().path)
    losses, logprobs, _ = sdk_steps(tc, [data[:3], data[3:]], steps=2)
    final = svc.local_path(tc.save_state("final").result().path)
    return data, tc, init, losses, logprobs, final, tc.save_weights_and_get_sampling_client().result()


def assert_a_client_from_its_saved_state_steps_as_it_does(svc, tc, data: list) -> None:
    """A client made from the state ``tc`` saved as ``final`` (:func:`two_rounds`: its weights and AdamW
    state) takes the step ``tc`` takes next: the same loss, to 1e-6."""
    from test_service_sdk import sdk_steps

    other = svc.client().create_training_client_from_state_with_optimizer(
        f"tinker://{tc.model_id}/weights/final"
    )
    next_loss = sdk_steps(tc, [data[:3], data[3:]], steps=1)[0]
    assert sdk_steps(other.result(), [data[:3], data[3:]], steps=1)[0] == pytest.approx(next_loss, abs=1e-6)


@pytest.mark.slow  # (starts a job on two processes: ~37 s, ~25 s of it the start)
def test_a_served_job_on_two_processes_equals_peft_and_adamw(llama_path, tmp_path):
    """The SDK drives a served job on two processes under fsdp=2 (rank 0 serves, both run every step):
    forward_backward in chunks of 3 and 2 datums (each rank gets some of the step's datums, unevenly) +
    optim_step, a forward of one datum (rank 1 has no row at all), save_state, a sampler snapshot's greedy
    samples: the losses, logprobs, saved adapter and samples equal PEFT + AdamW on one process to 1e-5; a
    client made from the saved state (with its AdamW state) then steps as the first one does. Stopped and
    resumed on two processes, its sampler snapshots (unnamed, through the sampling client from before; named,
    read back from its folder by each process) sample as they did.
    (Measured: losses 2.4e-6, logprobs 4.8e-7, adapter 8.4e-7. tp=2, ep=2 and two nodes: the next test.)"""
    from test_service_sdk import assert_same, peft_greedy, peft_steps, to_sdk

    from mlora_lab.lora import read_adapter
    from mlora_lab.reference import peft_lora_tensors

    # (on a port of its own: the resume serves on the same one)
    spec = served_spec(llama_path, ml.Service(port=free_port()), parallel=ml.Parallel(nproc=2, fsdp=2))
    t0 = time.monotonic()
    svc = ml.serve(spec, workdir=tmp_path / "runs")
    try:
        data, tc, init, losses, logprobs, final, sampler = two_rounds(svc, llama_path)
        alone = tc.forward([to_sdk(data[4])], "cross_entropy").result()
        named = tc.save_weights_for_sampler("kept").result().path  # (the same weights)
        greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
        prompts = [d[0][:4] for d in data[:2]]
        samples = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=2, sampling_params=greedy)
            for p in prompts
        ]
        samples = [f.result() for f in samples]
        served_s = time.monotonic() - t0

        want_losses, want_logprobs, model = peft_steps(llama_path, init, data, steps=2)
        assert_same(
            (losses, logprobs), (want_losses, want_logprobs), read_adapter(final)[1], peft_lora_tensors(model)
        )
        model.eval()
        with torch.no_grad():
            x, y, _ = data[4]
            lp = model(input_ids=torch.tensor([x])).logits[0].float().log_softmax(-1)
            want = lp.gather(1, torch.tensor(y)[:, None])[:, 0]
        assert torch.allclose(alone.loss_fn_outputs[0]["logprobs"].to_torch(), want, atol=1e-5)
        for p, answer in zip(prompts, samples):
            tokens, lps = peft_greedy(model, p, 5)
            assert [s.tokens for s in answer.sequences] == [tokens, tokens]
            assert answer.sequences[0].logprobs == pytest.approx(lps, abs=1e-4)
        # a client from the saved state (read by rank 0, broadcast) takes the step the first one takes next
        assert_a_client_from_its_saved_state_steps_as_it_does(svc, tc, data)
        assert svc.stop() == "stopped", svc.logs(0)
        # resumed on two processes: the unnamed snapshot comes back from the checkpoint with its sampling
        # session, the named one is read back from its folder (rank 0 and rank 1 each read it): both sample
        # the greedy tokens of before, although the client stepped on since
        again = ml.resume(svc.path)
        sampled = [sampler.sample(types.ModelInput.from_ints(prompts[0]), 1, greedy).result()]
        kept = again.client().create_sampling_client(model_path=named)
        sampled.append(kept.sample(types.ModelInput.from_ints(prompts[0]), 1, greedy).result())
        for answer in sampled:
            assert answer.sequences[0].tokens == samples[0].sequences[0].tokens
            assert answer.sequences[0].logprobs == pytest.approx(samples[0].sequences[0].logprobs, abs=1e-5)
        assert again.stop() == "stopped", again.logs(0)
        print(f"served on two processes for {served_s:.1f} s; whole test {time.monotonic() - t0:.1f} s")
    finally:
        stop_runs_under(tmp_path)


@pytest.mark.slow  # (starts a job on two processes: ~30 s each)
@pytest.mark.parametrize(
    "arch, layout",
    [
        ("llama", ml.Parallel(nproc=2, fsdp=1, tp=2)),
        ("qwen3_moe", ml.Parallel(nproc=2, fsdp=1, ep=2)),
        ("llama", ml.Parallel(nproc=1, nnodes=2, fsdp=2)),
    ],
    ids=["tp=2", "ep=2 of an MoE model", "two nodes"],
)
def test_a_served_job_in_every_layout_equals_peft_and_adamw(arch, layout, tiny_models, tmp_path):
    """The SDK drives a served job under tensor parallelism (rank 0 serves; both processes hold every datum,
    each half of every projection), under expert parallelism of an MoE model (its experts split over the
    processes, tokens travelling between them; the client's MLP is the packed experts, PEFT's
    ``target_parameters``), and on two nodes (each a torchrun agent of one process, started by launchers/multinode.sh as
    on a cluster; rank 0's node serves): two rounds of forward_backward in chunks of 3 and 2 datums +
    optim_step, the saved state, and a sampler snapshot's greedy samples equal PEFT + AdamW on one process
    (losses, logprobs and adapters to 1e-5; sampled logprobs to 1e-4)."""
    from test_service_sdk import assert_same, peft_greedy, peft_steps

    from mlora_lab.lab.launch import prepare_run
    from mlora_lab.lora import read_adapter
    from mlora_lab.reference import peft_lora_tensors

    base = tiny_models(arch)
    moe = arch == "qwen3_moe"
    spec = ml.JobSpec(
        base_model=base,
        tenants=[],
        seq_len=48,
        max_tenants=2,
        max_rank=8,
        slot_modules=SLOTS[:4] if moe else SLOTS,  # (an MoE block's MLP: its packed experts, slotted)
        parallel=layout,
        # one node: any free port, bound by the job itself (a port picked here can be taken by another test's
        # process before the job binds it: EADDRINUSE, seen once in CI); two nodes: the port the script serves
        service=ml.Service(port=free_port() if layout.nnodes > 1 else 0),
    )
    agents = []
    if layout.nnodes == 1:
        svc = ml.serve(spec, workdir=tmp_path / "runs")
    else:  # (the local launcher is one node's: a cluster's nodes each start their share)
        run_dir = prepare_run(spec, workdir=tmp_path / "runs")
        env = {**os.environ, "PYTHON": sys.executable, "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
        multinode = Path(__file__).resolve().parents[2] / "launchers" / "multinode.sh"
        for _ in range(2):
            agents.append(
                subprocess.Popen(
                    ["bash", str(multinode), str(run_dir.root)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        svc = ml.attach(run_dir.root)
    try:
        data, _, init, losses, logprobs, final, sampler = two_rounds(svc, base)
        greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
        prompts = [d[0][:4] for d in data[:2]]
        samples = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=1, sampling_params=greedy).result()
            for p in prompts
        ]
        assert svc.stop() == "stopped", svc.logs(0)
        outputs = [a.communicate(timeout=120)[0] for a in agents]
        assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        stop_runs_under(tmp_path)
    config, adapter = read_adapter(final)
    assert config.target_parameters == (["gate_up_proj", "down_proj"] if moe else None)
    want_losses, want_logprobs, model = peft_steps(base, init, data, steps=2)
    assert_same((losses, logprobs), (want_losses, want_logprobs), adapter, peft_lora_tensors(model))
    model.eval()
    for p, answer in zip(prompts, samples):
        tokens, lps = peft_greedy(model, p, 5)
        assert answer.sequences[0].tokens == tokens
        assert answer.sequences[0].logprobs == pytest.approx(lps, abs=1e-4)


def readme_block(heading: str) -> str:
    """The first ```python block of the README after ``heading``."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    after = text[text.index(heading) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```", start)]


@pytest.mark.slow  # (starts a job)
def test_the_readmes_service_example_runs_as_written(llama_path, tmp_path, monkeypatch):
    """The README's example of a served job, verbatim, with the defaults: a spec with one file-driven tenant on
    q_proj/v_proj (what a new user has), then the SDK's default training client (attention, MLP and the
    output layer), which that job used to refuse ("no adapter slots on the MLP or output layer")."""
    monkeypatch.chdir(tmp_path)  # (ml.serve's runs land here)
    data = tmp_path / "alice.jsonl"
    data.write_text("".join(f'{{"text": "the red cat sat on the road {i}"}}\n' for i in range(8)))
    alice = ml.Tenant(name="alice", data=str(data), rank=8, target_modules=["q_proj", "v_proj"], max_steps=3)
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    ids = tok("the red cat sat on the road").input_ids
    datums = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
    ]
    spec = ml.JobSpec(base_model=llama_path, tenants=[alice], seq_len=48)
    namespace = {"ml": ml, "tinker": tinker, "spec": spec, "datums": datums}
    try:
        exec(readme_block("### Programs that drive their tenants (Tinker API)"), namespace)
    finally:
        left = stop_runs_under(tmp_path)
    svc, tc = namespace["svc"], namespace["tc"]
    assert not left and svc.status.value == "stopped", svc.logs(0)
    assert math.isfinite(namespace["fb"].result().metrics["loss:sum"])
    tenant = svc.tenant_of(tc.model_id)
    assert tenant == "owner-1" and tenant in set(svc.metrics()["tenant"])
    assert ml.JobSpec.load(svc.dir.job).slot_modules == ["all-linear", "lm_head", "q_proj", "v_proj"]
    usage = svc.usage().set_index(["key", "tenant"])  # (what the owner's key cost: one step of one datum)
    assert usage.loc[("owner", "owner-1"), ["tokens_trained", "requests"]].tolist() == [len(ids) - 1, 2]
    assert ml.runs(tmp_path / "runs").loc[0, "tokens_trained"] == len(ids) - 1


@pytest.mark.slow  # (starts a job, and resumes it)
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs the quant extra")
def test_a_served_job_over_an_nf4_base_equals_peft_and_survives_a_resume(llama_path, tmp_path):
    """``ml.serve`` of a job with ``quantize="nf4"`` (launched as users launch it): the SDK's two rounds of
    forward_backward + optim_step, the saved adapter and a sampler snapshot's greedy samples equal PEFT + AdamW
    over the same nf4 base; stopped and resumed, the base is quantized again as it loads, the snapshot samples
    as it did, and a client made from the saved state takes the step the first client takes. (Over the
    float32 base PEFT's losses differ by more than 1e-3, 100 times the tolerance: the nf4 base is what ran.)"""
    from test_service_sdk import assert_same, peft_greedy, peft_steps

    from mlora_lab.lora import read_adapter
    from mlora_lab.reference import peft_lora_tensors

    spec = served_spec(llama_path, ml.Service(port=free_port()), quantize="nf4")  # (resumed on the same port)
    svc = ml.serve(spec, workdir=tmp_path / "runs")
    try:
        assert svc.spec.quantize == "nf4"
        data, tc, init, losses, logprobs, final, sampler = two_rounds(svc, llama_path)
        greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
        prompt = data[0][0][:4]
        before = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]

        want_losses, want_logprobs, model = peft_steps(llama_path, init, data, steps=2, quantize="nf4")
        assert_same(
            (losses, logprobs), (want_losses, want_logprobs), read_adapter(final)[1], peft_lora_tensors(model)
        )
        unquantized = peft_steps(llama_path, init, data, steps=2)[0]  # (the same over the float32 base)
        assert max(abs(a - b) for a, b in zip(losses, unquantized)) > 1e-3, (losses, unquantized)
        model.eval()
        tokens, lps = peft_greedy(model, prompt, 5)
        assert before.tokens == tokens and before.logprobs == pytest.approx(lps, abs=1e-4)
        assert svc.stop() == "stopped", svc.logs(0)

        again = ml.resume(svc.path)
        after = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
        assert after.tokens == before.tokens and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
        assert_a_client_from_its_saved_state_steps_as_it_does(again, tc, data)
        assert again.stop() == "stopped", again.logs(0)
    finally:
        stop_runs_under(tmp_path)


@pytest.mark.slow  # (starts a job on two processes)
def test_a_served_job_with_a_rollout_rank_samples_there_as_peft_does(llama_path, tmp_path):
    """``Parallel(nproc=2, rollout_ranks=1)``: one process trains the clients' steps, the other samples every
    sampling request. A client's two rounds, then its sampler snapshot's greedy samples: PEFT's tokens and
    logprobs (the snapshot's adapter reached the rollout rank in memory, known by its digest), and the rollout
    rank was the one busy sampling."""
    from test_service_sdk import peft_greedy, peft_steps

    spec = served_spec(llama_path, ml.Service(), parallel=ml.Parallel(nproc=2, rollout_ranks=1))
    svc = ml.serve(spec, workdir=tmp_path / "runs")
    try:
        data, _, init, _, _, _, sampler = two_rounds(svc, llama_path)
        greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
        prompts = [d[0][:4] for d in data[:2]]
        samples = [sampler.sample(types.ModelInput.from_ints(p), 2, greedy).result() for p in prompts]
        _, _, model = peft_steps(llama_path, init, data, steps=2)
        model.eval()
        for p, answer in zip(prompts, samples):
            tokens, lps = peft_greedy(model, p, 5)
            assert [s.tokens for s in answer.sequences] == [tokens, tokens]
            assert answer.sequences[0].logprobs == pytest.approx(lps, abs=1e-4)
        assert svc.stop() == "stopped", svc.logs(0)
        said = re.search(r"rollout rank 0: done after sampling (\d+) batches", svc.logs(1))
        assert said and int(said.group(1)) >= 2, svc.logs(1)  # (the two sampling requests, at least)
    finally:
        stop_runs_under(tmp_path)
