"""Batched multi-tenant sampling (mlora_lab.sampling) over a table of tiny architectures.

- greedy tokens and their logprobs equal PEFT's ``generate`` with each adapter alone (and the plain
  base for ``tenant=None``), from one mixed batch of prompts of different lengths; prompt logprobs
  equal PEFT's forward of the prompt alone;
- sampled tokens are reproducible from the seed and do not depend on the rest of the batch; their
  logprobs are a forward pass's over the same tokens; top-k / top-p draw only inside their set;
- stop token ids, stop strings and max_new_tokens stop rows independently;
- bad requests raise one ValueError naming every problem;
- the distributed hook: a process whose rows stopped keeps stepping while others run, unchanged.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import peft
import pytest
import torch
import transformers

from mlora_lab.lora import MultiLoRAModel
from mlora_lab.sampling import SampleRequest, row_seed, sample
from mlora_lab.tiny import EXPERT_TARGETS, MOE_ARCHITECTURES, TYPICAL_TARGETS

ARCHS = ["llama", "qwen2", "phi3", "gpt_neox", "qwen3_moe", "mixtral"]
TOL = 1e-5
TEXTS = ["red", "the model and the adapter", "one two three four five six seven", "hello world"]


def make_adapters(arch: str, base: str, root: Path) -> dict[str, str]:
    """Two PEFT adapter directories with B != 0 (``init_lora_weights=False``): ``a`` rank 4 on two
    projections, ``b`` rank 8 on every typical target and, on MoE models, the packed experts."""
    targets = TYPICAL_TARGETS[arch]
    experts = EXPERT_TARGETS if arch in MOE_ARCHITECTURES else None
    dirs = {}
    for name, rank, modules, params in (("a", 4, targets[:2], None), ("b", 8, targets, experts)):
        torch.manual_seed(rank)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=modules,
            target_parameters=params,
            init_lora_weights=False,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        peft.get_peft_model(model, config).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def build_setup(arch: str, tiny_models, tmp_path_factory) -> SimpleNamespace:
    """A MultiLoRAModel of ``arch`` with tenants ``a`` and ``b`` loaded from PEFT directories, its
    tokenizer and four prompts of different lengths."""
    base = tiny_models(arch)
    dirs = make_adapters(arch, base, tmp_path_factory.mktemp(f"adapters_{arch}"))
    mm = MultiLoRAModel(
        transformers.AutoModelForCausalLM.from_pretrained(base),
        max_tenants=3,
        max_rank=16,
        slot_modules=TYPICAL_TARGETS[arch],
        slot_parameters=EXPERT_TARGETS if arch in MOE_ARCHITECTURES else (),
    )
    for name, path in dirs.items():
        mm.load_adapter(name, path)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    prompts = [tok(t).input_ids for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts of different lengths"
    return SimpleNamespace(arch=arch, base=base, dirs=dirs, mm=mm, tok=tok, prompts=prompts)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tiny_models, tmp_path_factory) -> SimpleNamespace:
    return build_setup(request.param, tiny_models, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory) -> SimpleNamespace:
    """For checks of code that is the same for every architecture."""
    return build_setup("llama", tiny_models, tmp_path_factory)


def peft_model(base: str, adapter: str | None) -> torch.nn.Module:
    """The plain base, or PEFT's model of one adapter directory over it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return (model if adapter is None else peft.PeftModel.from_pretrained(model, adapter)).eval()


def greedy_generate(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF ``generate``'s greedy tokens for one unpadded prompt, and the log-softmax of its raw logits
    at each chosen token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [step.float().log_softmax(-1)[0, t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def forward_logits(
    mm: MultiLoRAModel, tenant: str | None, prompt: list[int], tokens: list[int]
) -> torch.Tensor:
    """The model's raw logits [len(tokens), V] at each completion token's position (teacher-forced)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = mm(ids, tenants=[tenant]).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def check_logprobs(mm: MultiLoRAModel, tenant: str | None, prompt: list[int], c, temperature: float) -> float:
    """Completion ``c``'s logprobs are a forward pass's over its tokens (raw logits) and its sampling
    logprobs those of ``z / temperature`` (to TOL); returns how far the two kinds lie apart."""
    logits = forward_logits(mm, tenant, prompt, c.tokens)
    steps = torch.arange(len(c.tokens))
    raw = logits.log_softmax(-1)[steps, c.tokens]
    scaled = (logits / temperature).log_softmax(-1)[steps, c.tokens]
    assert (raw - torch.tensor(c.logprobs)).abs().max().item() <= TOL
    assert (scaled - torch.tensor(c.sampling_logprobs)).abs().max().item() <= TOL
    return (raw - scaled).abs().max().item()


def test_greedy_equals_peft_generate_with_each_adapter_alone(setup):
    n = 10
    tenants = ["a", None, "b", "a"]  # interleaved: the sampler groups them; the output keeps this order
    requests = [
        SampleRequest(p, t, max_new_tokens=n, temperature=0.0, prompt_logprobs=True)
        for p, t in zip(setup.prompts, tenants)
    ]
    requests.append(SampleRequest(setup.prompts[2], "b", num_samples=2, max_new_tokens=n, temperature=0.0))
    out = sample(setup.mm, requests)
    assert [(c.request, c.index) for c in out] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1)]
    references = {t: peft_model(setup.base, setup.dirs.get(t)) for t in ("a", "b", None)}
    worst = 0.0
    for c in out:
        r = requests[c.request]
        tokens, logprobs = greedy_generate(references[r.tenant], list(r.prompt), n)
        assert c.tokens == tokens, f"{setup.arch} request {c.request}"
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, logprobs)))
        if r.prompt_logprobs:  # a plain forward of the prompt alone: padding changed nothing
            with torch.no_grad():
                z = references[r.tenant](input_ids=torch.tensor([list(r.prompt)])).logits[0, :-1]
            expected = z.float().log_softmax(-1).gather(1, torch.tensor(r.prompt[1:])[:, None])[:, 0]
            assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(r.prompt)
            worst = max(worst, (torch.tensor(c.prompt_logprobs[1:]) - expected).abs().max().item())
        else:
            assert c.prompt_logprobs is None
        assert c.sampling_logprobs == [0.0] * len(tokens)
        eos = setup.mm.model.generation_config.eos_token_id
        assert c.stop_reason == ("eos" if tokens[-1] == eos else "length") and len(tokens) <= n
    assert worst <= TOL, f"{setup.arch}: logprobs differ from PEFT's by {worst}"
    # the adapters matter: the same prompt gives other tokens or logprobs through each of them
    alone = {
        t: sample(setup.mm, [SampleRequest(setup.prompts[0], t, max_new_tokens=n, temperature=0.0)])[0]
        for t in ("a", "b", None)
    }
    for t in ("a", "b"):
        gap = max(abs(x - y) for x, y in zip(alone[t].logprobs, alone[None].logprobs))
        assert alone[t].tokens != alone[None].tokens or gap > 1e-3, (
            f"{setup.arch}: adapter {t} changes nothing"
        )


def test_samples_are_reproducible_and_independent_of_the_batch(setup):
    mm, p = setup.mm, setup.prompts
    target = SampleRequest(p[1], "b", num_samples=3, max_new_tokens=12, temperature=0.8, seed=7)
    alone = sample(mm, [target])
    others = [
        SampleRequest(p[2], "a", num_samples=2, max_new_tokens=5, temperature=1.0, seed=1),
        SampleRequest(p[0], None, max_new_tokens=20, temperature=0.0),
        SampleRequest(p[3], "b", max_new_tokens=3, temperature=1.2, top_k=5, seed=3),
    ]
    mixed = [c for c in sample(mm, [others[0], target, *others[1:]]) if c.request == 1]
    again = sample(mm, [target])
    for a, m, g in zip(alone, mixed, again):
        assert a.tokens == m.tokens == g.tokens and a.index == m.index
        assert max(abs(x - y) for x, y in zip(a.logprobs, m.logprobs)) <= TOL
        assert a.logprobs == g.logprobs
    assert len({tuple(c.tokens) for c in alone}) == 3, "each sample index draws its own tokens"
    other_seed = sample(
        mm, [SampleRequest(p[1], "b", num_samples=3, max_new_tokens=12, temperature=0.8, seed=8)]
    )
    assert [c.tokens for c in other_seed] != [c.tokens for c in alone]
    assert row_seed(1, 0) != row_seed(0, 1)
    unseeded = SampleRequest(p[1], "b", num_samples=2, max_new_tokens=6)  # a seed from torch's generator
    torch.manual_seed(5)
    first = sample(mm, [unseeded])
    torch.manual_seed(5)
    assert [c.tokens for c in sample(mm, [unseeded])] == [c.tokens for c in first]
    # logprobs: the model's own (a forward over the same tokens); sampling logprobs: of z / temperature
    for c in alone:
        assert check_logprobs(mm, "b", list(p[1]), c, 0.8) > 1e-3


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (None, 0.3), (4, 0.5)])
def test_top_k_and_top_p_draw_only_inside_their_set(llama, top_k, top_p):
    """Every drawn token is among the ``top_k`` most likely, and within the smallest set reaching
    ``top_p`` after top-k; its sampling logprob is that of the renormalised set."""
    mm, prompt = llama.mm, list(llama.prompts[1])
    request = SampleRequest(
        prompt,
        "a",
        num_samples=6,
        max_new_tokens=8,
        temperature=1.5,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=(),
        seed=11,
    )
    for c in sample(mm, [request]):
        z = forward_logits(mm, "a", prompt, c.tokens) / 1.5
        for step, token in enumerate(c.tokens):
            probs, order = z[step].softmax(-1).sort(descending=True)
            k = top_k or len(probs)
            probs = probs[:k] / probs[:k].sum()
            before = probs.cumsum(0) - probs
            allowed = order[:k][before < top_p]
            assert token in allowed.tolist()
            p = probs[: len(allowed)] / probs[: len(allowed)].sum()
            expected = p[allowed.tolist().index(token)].log().item()
            assert abs(c.sampling_logprobs[step] - expected) <= TOL


def test_stop_ids_stop_strings_and_lengths_stop_rows_independently(setup):
    mm, tok, prompt = setup.mm, setup.tok, list(setup.prompts[2])
    n = 14
    free = SampleRequest(prompt, "a", max_new_tokens=n, temperature=0.0, stop_token_ids=())
    greedy = sample(mm, [free])[0].tokens
    assert len(greedy) == n
    i = 4  # stop at the first occurrence of the 5th token
    i = greedy.index(greedy[i])
    text = tok.decode(greedy, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    j = next(j for j in range(n) if stop in tok.decode(greedy[: j + 1], skip_special_tokens=True))
    requests = [
        free,
        SampleRequest(prompt, "a", max_new_tokens=n, temperature=0.0, stop_token_ids=[greedy[i]]),
        SampleRequest(prompt, "a", max_new_tokens=n, temperature=0.0, stop_token_ids=(), stop_strings=[stop]),
        SampleRequest(prompt, "a", max_new_tokens=3, temperature=0.0, stop_token_ids=()),
    ]
    out = sample(mm, requests, tokenizer=tok)
    assert out[0].tokens == greedy and out[0].stop_reason == "length"
    assert out[1].tokens == greedy[: i + 1] and out[1].stop_reason == "eos"
    assert out[2].tokens == greedy[: j + 1] and out[2].stop_reason == "stop"
    assert stop in tok.decode(out[2].tokens, skip_special_tokens=True), "the stop string is kept"
    assert out[3].tokens == greedy[:3] and out[3].stop_reason == "length"
    for c in out:
        assert c.logprobs == pytest.approx(out[0].logprobs[: len(c.tokens)], abs=TOL)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_stop_string_is_found_on_the_completions_tail_where_the_whole_text_has_it(arch, tiny_models):
    """The stop check decodes only the completion's last tokens (decoding all of it after every token made a
    long sample quadratic): on random completions (special tokens and word pieces included), it fires at the
    very token where the decoded whole first holds a stop string, for stop strings of 1 to 30 characters."""
    from mlora_lab.sampling import _has_stop_string

    tok = transformers.AutoTokenizer.from_pretrained(tiny_models(arch))
    g = torch.Generator().manual_seed(0)

    def whole(t: list[int], stops: tuple[str, ...]) -> bool:
        return any(s in tok.decode(t, skip_special_tokens=True) for s in stops)

    def tail(t: list[int], stops: tuple[str, ...]) -> bool:
        return _has_stop_string(tok, t, stops)

    def first(found, tokens: list[int], stops: tuple[str, ...]) -> int | None:
        """The length of the shortest prefix of ``tokens`` that ``found`` says holds a stop string."""
        return next((i for i in range(1, len(tokens) + 1) if found(tokens[:i], stops)), None)

    fired = 0
    for _ in range(30):
        tokens = torch.randint(0, len(tok), (50,), generator=g).tolist()
        text = tok.decode(tokens, skip_special_tokens=True)
        for length in (1, 3, 8, 30):
            start = int(torch.randint(0, max(1, len(text) - length), (1,), generator=g))
            stops = (text[start : start + length], "a stop string that is never there")
            want = first(whole, tokens, stops)
            assert first(tail, tokens, stops) == want and first(tail, tokens, stops[:1]) == want
            fired += want is not None
    assert fired >= 100


def test_bad_requests_get_one_error_naming_every_problem(setup):
    mm, p = setup.mm, setup.prompts[0]
    positions = mm.model.config.max_position_embeddings
    bad = [
        SampleRequest(p, "nobody"),
        SampleRequest(p, "a", max_new_tokens=0),
        SampleRequest(p, "a", top_p=0.0),
        SampleRequest(p, "b", top_p=1.5),
        SampleRequest(p, None, temperature=-0.5),
        SampleRequest([], "a"),
        SampleRequest(p, "a", max_new_tokens=positions),
        SampleRequest(p, "a", stop_strings=["\n"]),
        SampleRequest([5, 10**6], "a", top_k=0),
    ]
    with pytest.raises(ValueError) as info:
        sample(mm, [SampleRequest(p, "a"), *bad])
    message = str(info.value)
    expected = [
        "request 1: unknown tenant 'nobody'",
        "request 2: max_new_tokens must be an integer >= 1, got 0",
        "request 3: top_p must be in (0, 1], got 0.0",
        "request 4: top_p must be in (0, 1], got 1.5",
        "request 5: temperature must be a finite number >= 0, got -0.5",
        "request 6: the prompt is empty",
        f"request 7: prompt ({len(p)} tokens) + max_new_tokens ({positions}) exceeds the model's {positions}",
        "request 8: stop strings need a tokenizer",
        "request 9: prompt token ids that are not integers in [0, ",
        "request 9: top_k must be None or an integer >= 1, got 0",
    ]
    for line in expected:
        assert line in message, (line, message)
    assert "request 0" not in message
    assert message.count("\n  - ") == len(expected)


def test_a_process_whose_rows_stopped_keeps_stepping_with_the_others(setup):
    """``any_running`` as an all-reduce would give it: another process runs 20 steps longer. The local
    results are unchanged, every call after the local rows stopped says so, and a process with no
    requests at all steps along too."""
    mm, p = setup.mm, setup.prompts
    requests = [
        SampleRequest(p[0], "a", max_new_tokens=4, temperature=0.0),
        SampleRequest(p[1], "b", max_new_tokens=6, temperature=1.0, seed=2, stop_token_ids=()),
    ]
    plain = sample(mm, requests)
    for reqs in (requests, []):
        flags: list[bool] = []

        def any_running(running: bool, flags=flags) -> bool:
            flags.append(running)
            return len(flags) < 26

        out = sample(mm, reqs, any_running=any_running)
        assert len(flags) == 26, "one call per forward, until no process runs"
        assert flags == ([True] * 5 if reqs else []) + [False] * (26 - (5 if reqs else 0))
        assert [(c.tokens, c.logprobs) for c in out] == [(c.tokens, c.logprobs) for c in plain[: len(out)]]
        assert len(out) == len(reqs)


@pytest.mark.slow
def test_split_models_sample_like_one_process_under_torchrun():
    """tests/dist/sampling.py on 2 processes: fsdp=2 and tp=2 (llama), fsdp=2 with ep=2 (qwen3_moe)
    give the reference's tokens and logprobs, every process running the same number of forwards."""
    script = Path(__file__).parent / "dist" / "sampling.py"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            "fsdp:llama",
            "tp:llama",
            "ep:qwen3_moe",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("sampling ok") == 2
