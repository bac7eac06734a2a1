"""The OpenAI-compatible endpoint of a served job, driven by the official ``openai`` client: its models are the
base, the tenants and the named snapshots; its completions equal PEFT's own generation of the same adapter;
sampling is seeded, logprobs are the model's, streaming gives the same text, and errors have OpenAI's shapes."""

from __future__ import annotations

import json
import threading
import time

import httpx
import peft
import pytest
import torch
import transformers
from conftest import task_rows, write_jsonl
from served_job import Served
from test_service_sdk import peft_greedy

import mlora_lab as ml
from mlora_lab.rundir import TenantState

openai = pytest.importorskip("openai")

PROMPT = "reverse: red cat\n"


@pytest.fixture(scope="module")
def served(llama_path, tmp_path_factory):
    """A served job with one file-data tenant that trains 3 steps and then keeps its adapter in its slot."""
    tmp = tmp_path_factory.mktemp("openai")
    alice = ml.Tenant(name="alice", data=write_jsonl(tmp / "a.jsonl", task_rows("reverse", 12)), rank=4, lr=5e-2,
                      max_steps=3, batch_size=2, target_modules=["q_proj", "v_proj"], max_grad_norm=None)  # fmt: skip
    job = Served(llama_path, tenants=[alice], slot_modules=["q_proj", "v_proj"], idle_s=0.05, max_tenants=4,
                 checkpoints=tmp / "service")  # fmt: skip
    deadline = time.monotonic() + 120
    while job.trainer.pool.states().get("alice") is not TenantState.FINISHED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.trainer.pool.states()["alice"] is TenantState.FINISHED
    adapter = job.trainer.model.save_adapter("alice", tmp / "alice", base_model_name_or_path=llama_path)
    yield job, adapter
    job.close()


def client(job: Served, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{job.server.url}/v1", api_key=key or job.key, max_retries=0)


def test_models_are_the_base_and_the_tenants(served):
    job, _ = served
    assert [m.id for m in client(job).models.list()] == ["base", "alice"]


def test_greedy_completions_equal_peft_generate(served, llama_path):
    job, adapter = served
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    ids = tok(PROMPT)["input_ids"]
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    tuned = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), str(adapter)
    ).eval()
    for model, reference in (("base", base), ("alice", tuned)):
        want, want_lps = peft_greedy(reference, ids, 8)
        got = client(job).completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
        )
        choice = got.choices[0]
        assert choice.text == tok.decode(want, skip_special_tokens=True), model
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)
        assert choice.logprobs.token_logprobs == pytest.approx(want_lps, abs=1e-4)
        # the chosen token is the most likely one (greedy), and two are listed at each step (keyed by their
        # text, as OpenAI's legacy format has it: two byte tokens that both print as "\ufffd" share a key)
        assert all(1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)
                   for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))  # fmt: skip
    texts = {m: client(job).completions.create(model=m, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
             for m in ("base", "alice")}  # fmt: skip
    assert texts["base"] != texts["alice"], "the tenant's adapter changes the base's text"


def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks_them(served, llama_path):
    """lm-eval's log-likelihood requests: echo=True, logprobs=1, max_tokens=1: the prompt's tokens with the
    model's logprob of each given those before it (the first has none)."""
    job, _ = served
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    ids = tok(PROMPT)["input_ids"]
    got = client(job).completions.create(model="base", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                         echo=True).choices[0]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = [None, *(logp[i - 1, ids[i]].item() for i in range(1, len(ids)))]
    assert got.text.startswith(tok.decode(ids, skip_special_tokens=True))
    assert got.logprobs.token_logprobs[0] is None
    assert got.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(want[1:], abs=1e-4)
    assert len(got.logprobs.tokens) == len(ids) + 1


def test_seeded_sampling_n_stop_and_chat(served):
    job, _ = served
    c = client(job)
    kw = dict(model="alice", prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=11)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices] and len(a.choices) == 3
    assert len({x.text for x in a.choices}) > 1, "three samples differ"
    full = a.choices[0].text
    cut = c.completions.create(**kw, stop=[full[2:4]]).choices[0]
    assert cut.text == full[: full.index(full[2:4])] and cut.finish_reason == "stop"
    chat = c.chat.completions.create(model="base", messages=[{"role": "user", "content": "count red"}],
                                     max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    msg = chat.choices[0]
    assert msg.message.role == "assistant" and isinstance(msg.message.content, str)
    assert len(msg.logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in msg.logprobs.content)


def test_streaming_gives_the_same_text(served):
    job, _ = served
    c = client(job)
    plain = c.completions.create(model="alice", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    streamed = "".join(e.choices[0].text for e in c.completions.create(
        model="alice", prompt=PROMPT, max_tokens=6, temperature=0, stream=True))  # fmt: skip
    assert streamed == plain
    chat = c.chat.completions.create(model="alice", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, stream=True)  # fmt: skip
    parts = [e.choices[0].delta.content or "" for e in chat]
    again = c.chat.completions.create(model="alice", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0)  # fmt: skip
    assert "".join(parts) == again.choices[0].message.content


def test_errors_have_openais_shapes(served):
    job, _ = served
    with pytest.raises(openai.NotFoundError, match="'nobody' does not exist"):
        client(job).completions.create(model="nobody", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(job, key="wrong").models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client(job).completions.create(model="base", prompt=PROMPT, max_tokens=2, temperature=5)
    assert e.value.body["param"] == "temperature" and "temperature must be" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens must be"):
        client(job).completions.create(model="base", prompt=PROMPT, max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="at most 64 prompts and 128 completions"):
        client(job).completions.create(model="base", prompt=["a"] * 65, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 64 prompts and 128 completions"):
        client(job).completions.create(model="base", prompt=["a"] * 2, n=100, max_tokens=2)
    with pytest.raises(openai.APIStatusError) as big:  # (refused as it is read: never held whole)
        client(job).completions.create(
            model="base", prompt="a" * (job.state.max_body_bytes + 10), max_tokens=2
        )
    assert big.value.status_code == 413
    other = job.keys.add("mallory")  # another key sees the base and the job's own tenants
    assert [m.id for m in client(job, key=other).models.list()] == ["base", "alice"]


# -- lm-eval-harness: local-completions and local-chat-completions on a small local task ---------------------


def _lm_eval_tasks(folder, rows: list[dict]) -> str:
    """Two local tasks over the same rows: ``mlora_gen`` (generate_until, exact_match) and ``mlora_choice``
    (multiple_choice, acc: the log-likelihood of each choice, lm-eval's echo requests)."""
    data = write_jsonl(folder / "rows.jsonl", rows)
    (folder / "mlora_gen.yaml").write_text(
        f"task: mlora_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    (folder / "mlora_choice.yaml").write_text(
        f"task: mlora_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{prompt}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"
    )
    return str(folder)


def test_lm_eval_harness_runs_against_the_endpoint(served, llama_path, tmp_path, monkeypatch):
    """lm-eval's own API models evaluate a tenant through the endpoint; its multiple-choice accuracy equals the
    one computed here from PEFT's log-likelihoods of each choice, and its generations are the endpoint's."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    job, adapter = served
    monkeypatch.setenv("OPENAI_API_KEY", job.key)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [
        {"prompt": f"reverse: {p}\n", "answer": " ".join(reversed(p.split())), "choices": [a, b], "label": 0}
        for p, a, b in (("red cat", " cat red", " red cat"), ("dog sun", " sun dog", " dog dog"),
                        ("tree", " tree", " star"), ("blue bird red", " red bird blue", " blue"))
    ]  # fmt: skip
    manager = TaskManager(include_path=_lm_eval_tasks(tmp_path, rows))
    # (add_bos_token: the prompts as the tenant was trained on them, with the tokenizer's BOS)
    common = {"model": "alice", "tokenizer_backend": "huggingface", "tokenizer": llama_path, "max_length": 40,
              "add_bos_token": True}  # fmt: skip
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={**common, "base_url": f"{job.server.url}/v1/completions", "num_concurrent": 2},
        tasks=["mlora_gen", "mlora_choice"],
        task_manager=manager,
        log_samples=True,
    )
    acc = out["results"]["mlora_choice"]["acc,none"]
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), str(adapter)
    )
    picks = []
    for r in rows:
        ctx = tok(r["prompt"])["input_ids"]
        scores = []
        for choice in r["choices"]:
            whole = tok(r["prompt"] + choice)["input_ids"]
            with torch.no_grad():
                logp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            scores.append(sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))))
        picks.append(int(max(range(2), key=lambda i: scores[i]) == r["label"]))
    assert acc == pytest.approx(sum(picks) / len(picks))
    generated = [s["filtered_resps"][0] for s in out["samples"]["mlora_gen"]]
    c = client(job)
    for r, text in zip(rows, generated):
        again = c.completions.create(
            model="alice", prompt=r["prompt"], max_tokens=6, temperature=0, stop=["\n"]
        )
        assert text == again.choices[0].text

    chat = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={**common, "base_url": f"{job.server.url}/v1/chat/completions"},
        tasks=["mlora_gen"],
        task_manager=manager,
        apply_chat_template=True,
    )
    assert 0.0 <= chat["results"]["mlora_gen"]["exact_match,none"] <= 1.0


def test_an_llm_judge_metric_asks_a_model_through_the_endpoint(served, tmp_path, monkeypatch):
    """ml.Judge: a metric that asks a model of the served job (here its tenant) to rate each completion; its
    scores are the numbers that model answers (its replies, asked here directly, give the same), also from
    ml.evaluate's isolated metrics worker."""
    job, adapter = served
    judge = ml.Judge(model="alice", rubric="rate {completion} for {prompt}: ", base_url=f"{job.server.url}/v1",
                     api_key=job.key)  # fmt: skip
    for name in ml.metrics.ENDPOINT_ENV:  # (a served job in this process would have set them)
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="Judge needs an OpenAI-compatible endpoint"):
        ml.Judge(model="base")([""], ["x"])  # (outside a served job, and none given)
    rows = [
        {"prompt": "reverse: red cat\n", "answer": "cat red"},
        {"prompt": "upper: sun\n", "answer": "SUN"},
    ]
    completions = ["cat red", "SUN 3"]
    scores = judge([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])
    c = client(job)
    for r, comp, score in zip(rows, completions, scores):
        reply = c.chat.completions.create(model="alice", temperature=0, max_tokens=8, messages=[
            {"role": "user", "content": f"rate {comp} for {r['prompt']}: "}]).choices[0].message.content  # fmt: skip
        number = ml.metrics.final_number(reply)
        assert score == (None if number is None else min(max(number, 0), 10) / 10)
    ev = ml.evaluate(
        [str(adapter)], rows, [judge, "contains"], max_new_tokens=4
    )  # (the judge, pickled, in the worker)
    direct = judge([r["prompt"] for r in rows for _ in (0,)] * 2, ev.examples().completion.tolist(),
                   answer=[r["answer"] for r in rows] * 2)  # fmt: skip
    got = ev.examples()["judge"].tolist()
    assert all((a is None and b != b) or a == b for a, b in zip(direct, got))


def test_oa19_a_judge_keeps_the_endpoints_reason_for_refusing_it(served):
    """OA19: the endpoint's 400 reached a judge as "HTTP Error 400: Bad Request", its reason lost; the judge's
    error now names the judge, its model, the status and the endpoint's own reason."""
    job, _ = served
    judge = ml.Judge(model="alice", rubric="rate {completion}:", base_url=f"{job.server.url}/v1", api_key=job.key,
                     max_tokens=10**9, name="strict")  # fmt: skip
    with pytest.raises(Exception) as e:  # (before: urllib's HTTPError, "Bad Request")
        judge(["reverse: red cat\n"], ["cat red"])
    text = str(e.value)
    assert "judge 'strict' (model 'alice')" in text and "HTTP 400" in text and "max_tokens" in text, text
    assert isinstance(e.value, ml.metrics.JudgeError), repr(e.value)


def test_a_named_sampler_snapshot_is_a_model_of_its_key(served):
    """A Tinker client's named sampler snapshot is a model of the endpoint (its ``tinker://`` path), for its own
    key only, and samples as the SDK's sampling client of the same path does."""
    from tinker import types

    job, _ = served
    tc = job.client().create_lora_training_client(
        base_model=job.base, rank=4, train_mlp=False, train_unembed=False
    )
    tc = tc.result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 9, 13]),
        loss_fn_inputs={"target_tokens": [5, 9, 13, 17], "weights": [1.0, 1.0, 1.0, 1.0]},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("kept").result().path
    mine = [m.id for m in client(job).models.list()]
    assert path in mine and job.tenant(tc.model_id) in mine
    other = job.keys.add("eve")
    assert path not in [m.id for m in client(job, key=other).models.list()]
    with pytest.raises(openai.NotFoundError):
        client(job, key=other).completions.create(model=path, prompt=[1, 5, 9], max_tokens=3)
    got = client(job).completions.create(
        model=path, prompt=[1, 5, 9], max_tokens=5, temperature=0, logprobs=1
    )
    sampler = job.client().create_sampling_client(model_path=path)
    seq = sampler.sample(types.ModelInput.from_ints([1, 5, 9]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]  # fmt: skip
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(seq.logprobs, abs=1e-6)
    assert got.usage.completion_tokens == len(seq.tokens)


def test_many_callers_share_one_generation_and_a_full_queue_answers_429(llama_path):
    """Requests of several callers (three API keys) that wait together run in one batched generation of the
    job; past a caller's share of the queue (a quarter of it) a request is answered 429, openai's
    RateLimitError."""
    job = Served(llama_path, background=False, max_queue=4)
    driver = job.trainer.drivers.all[0]
    sizes, real = [], driver.snapshots.sample
    driver.snapshots.sample = lambda works, settle: sizes.append(len(works)) or real(works, settle)
    keys = [job.key, job.keys.add("bob"), job.keys.add("carol")]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        got = client(job, key=keys[i]).completions.create(
            model="base", prompt=f"say {i}", max_tokens=3, temperature=0
        )
        answers[i] = got.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(job.state.inbox) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError, match="busy"):
            client(job).completions.create(model="base", prompt="one more", max_tokens=3)
        job.trainer.step()
        for t in threads:
            t.join(60)
        assert sizes == [3] and sorted(answers) == [0, 1, 2]
    finally:
        job.close()


# -- the hardening the Tinker route has (issue 48, section 2) ------------------------------------------------


def post(job: Served, path: str, body: bytes | dict) -> httpx.Response:
    """A raw POST to the OpenAI side (a body no ``openai`` client would send)."""
    headers = {"Authorization": f"Bearer {job.key}", "Content-Type": "application/json"}
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{job.server.url}/v1/{path}", headers=headers, timeout=60, **kw)


def test_oa16b_a_temperature_below_the_floor_samples_greedily(served):
    """OA16b: temperature 1e-46 (logits / it overflow) samples greedily, as 0 does and as the Tinker route
    does below 1e-5; 2e-5 is a temperature like any other."""
    job, _ = served
    kw = dict(model="alice", prompt=PROMPT, max_tokens=8, logprobs=1, seed=3)
    greedy = client(job).completions.create(temperature=0, **kw).choices[0]
    for tiny in (1e-46, 1e-300, 9e-6):
        got = client(job).completions.create(temperature=tiny, **kw).choices[0]
        assert got.text == greedy.text, tiny
        assert got.logprobs.token_logprobs == pytest.approx(greedy.logprobs.token_logprobs, abs=1e-6), tiny


def test_oa12b_a_body_nested_too_deeply_is_a_400_naming_the_field(served):
    """OA12b: a JSON body 100,000 levels deep is a 400 naming the field that holds the nesting (it was a 500,
    "internal error"); the Tinker route answers the same, and both go on serving."""
    job, _ = served
    deep = b'{"model": "base", "max_tokens": 2, "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("completions", "chat/completions"):
        r = post(job, path, deep)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == "prompt" and "nested" in error["message"], error
        assert "100,000" in error["message"], error
    whole = post(job, "completions", b"[" * 100_000 + b"]" * 100_000)
    assert whole.status_code == 400 and "the body" in whole.json()["error"]["message"]
    tinker = httpx.post(f"{job.server.url}/api/v1/create_session", headers={"X-API-Key": job.key}, timeout=60,
                        content=b'{"tags": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")  # fmt: skip
    assert tinker.status_code == 400 and "tags" in str(tinker.json()["detail"]), tinker.text[:300]
    assert client(job).completions.create(model="base", prompt=PROMPT, max_tokens=2).choices


def test_oa12c_a_lone_surrogate_is_a_400_naming_the_field(served):
    """OA12c: a lone surrogate (``\\ud800``: no text) in a prompt, a message or a stop string is a 400 that
    names the field (it was a 500); a surrogate pair (an emoji) is text and is served."""
    job, _ = served
    cases = [
        ("completions", {"model": "base", "prompt": "red \\ud800 cat", "max_tokens": 2}, "prompt"),
        ("completions", {"model": "base", "prompt": ["ok", "red \\udc00"], "max_tokens": 2}, "prompt[1]"),
        ("completions", {"model": "base", "prompt": "red", "stop": ["\\ud800"], "max_tokens": 2}, "stop[0]"),
        ("chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi \\udbff"}]},
         "messages[0].content"),
    ]  # fmt: skip
    for path, body, field in cases:
        raw = json.dumps(body).replace("\\\\u", "\\u").encode()  # (the escape itself, as a client sends it)
        r = post(job, path, raw)
        assert r.status_code == 400, (field, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == field.split("[")[0].split(".")[0], error
        assert field in error["message"] and "lone surrogate" in error["message"], error
    emoji = post(job, "completions", {"model": "base", "prompt": "red \U0001f431", "max_tokens": 2})
    assert emoji.status_code == 200, emoji.text[:300]


def test_oa9_a_prompt_that_fills_the_context_is_told_the_limit(served):
    """OA9: a prompt with no room left to sample is told how long a prompt may be (it was told "the prompt has
    47 tokens; the job's context holds 47"), as the Tinker route says it."""
    job, _ = served
    limit = job.state.limits.max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client(job).completions.create(model="base", prompt=[5] * limit, max_tokens=1)
    message = e.value.body["message"]
    assert f"has {limit} tokens" in message and f"at most {limit - 1}" in message, message
    assert e.value.body["param"] == "prompt"
    fits = client(job).completions.create(model="base", prompt=[5] * (limit - 1), max_tokens=1, temperature=0)
    assert fits.usage.completion_tokens == 1


def test_oa4b_a_request_larger_than_the_keys_share_is_a_413_naming_it(served):
    """OA4b: a request of more prompts than its key may have waiting at once can never run: 413 naming the share
    (it was 429 "retry later"), and none of its prompts is queued; one within the share runs."""
    job, _ = served
    inbox = job.state.inbox
    share, inbox.share = inbox.share, 2
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(job).completions.create(model="base", prompt=["a", "b", "c"], max_tokens=1)
        assert e.value.status_code == 413
        assert "3 prompts" in e.value.message and "at most 2" in e.value.message, e.value.message
        assert len(inbox) == 0, "nothing of the refused request waits"
        assert len(client(job).completions.create(model="base", prompt=["a", "b"], max_tokens=1).choices) == 2
    finally:
        inbox.share = share


def test_m1_echo_with_max_tokens_0_scores_the_prompt_only(served):
    """m1: ``echo=True, max_tokens=0`` (what a harness sends to score a prompt) answers the prompt with its
    logprobs and no completion, as OpenAI's completions do; the logprobs are those of ``max_tokens=1``'s echo."""
    job, _ = served
    c = client(job)
    scored = c.completions.create(model="alice", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    one = c.completions.create(
        model="alice", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    n = len(one.choices[0].logprobs.tokens) - 1  # the prompt's tokens
    choice = scored.choices[0]
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:n]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        one.choices[0].logprobs.token_logprobs[1:n], abs=1e-5
    )
    assert choice.text == one.choices[0].text[: len(choice.text)] and choice.finish_reason == "length"
    limit = job.state.limits.max_tokens  # (a prompt that fills the context is scored too: nothing is sampled)
    full = c.completions.create(model="base", prompt=[5] * limit, max_tokens=0, echo=True, logprobs=0)
    assert len(full.choices[0].logprobs.token_logprobs) == limit
    with pytest.raises(openai.BadRequestError, match=r"max_tokens 0 .* echo"):
        c.completions.create(model="base", prompt=PROMPT, max_tokens=0)


def test_sh1d_a_client_cannot_take_the_name_base(served):
    """SH1d: a Tinker client that names its tenant ``base`` gets another name (``base-2``): ``/v1/models`` lists
    ``base`` once, and the client's tenant is reached by its name (its sampling differs from the base's)."""
    from tinker import types

    job, _ = served
    tc = (
        job.client(user_metadata={"name": "base"})
        .create_lora_training_client(base_model=job.base, rank=4, train_mlp=False, train_unembed=False)
        .result()
    )
    name = job.tenant(tc.model_id)
    assert name == "base-2"
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 5, 9, 13]),
                        loss_fn_inputs={"target_tokens": [5, 9, 13, 17], "weights": [1.0] * 4})  # fmt: skip
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    models = [m.id for m in client(job).models.list()]
    assert models.count("base") == 1 and name in models, models
    kw = dict(prompt=[1, 5, 9], max_tokens=4, temperature=0, logprobs=1)
    base = client(job).completions.create(model="base", **kw).choices[0].logprobs.token_logprobs
    tenant = client(job).completions.create(model=name, **kw).choices[0].logprobs.token_logprobs
    assert base != pytest.approx(tenant, abs=1e-4)
