"""The GPU sampler's path (mlora_lab.static_decode), run on the CPU without graph capture.

The static cache, the per-row adapters (each LoRA layer gathers its row's adapter from a device tensor of
slots), the in-place mask and positions, the device-side choice of tokens and the one-step-late stop checks
are the same code a CUDA graph captures; here they run eagerly, over the dense architectures (an MoE
router's token groups have data-dependent shapes: MoE models keep the dynamic loop).

- greedy tokens equal PEFT ``generate`` with each adapter alone (and the base), logprobs to 1e-5, from one
  mixed batch with several samples and different lengths;
- the static path's greedy completions equal the dynamic path's, stop strings and stop ids included;
- seeded sampling is reproducible and does not depend on the rest of the batch; its logprobs are a
  forward pass's, its sampling logprobs those of ``z / temperature``; top-k / top-p draw inside their set;
- the device's uniforms are uniform and depend on the seed and the step alone;
- a decoder is kept for the next call of the same shape and tenants, and dropped when the tenants change.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import TOL, build_setup, check_logprobs, forward_logits, greedy_generate, peft_model

from mlora_lab import static_decode
from mlora_lab.sampling import SampleRequest, sample

DENSE = ["llama", "qwen2", "phi3", "gpt_neox"]


@pytest.fixture(scope="module", params=DENSE)
def setup(request, tiny_models, tmp_path_factory):
    return build_setup(request.param, tiny_models, tmp_path_factory)


def test_static_greedy_equals_peft_generate_with_each_adapter_alone(setup):
    n = 10
    tenants = ["a", None, "b", "a"]
    requests = [
        SampleRequest(p, t, max_new_tokens=n, temperature=0.0) for p, t in zip(setup.prompts, tenants)
    ]
    requests.append(SampleRequest(setup.prompts[2], "b", num_samples=2, max_new_tokens=n, temperature=0.0))
    requests.append(SampleRequest(setup.prompts[1], None, max_new_tokens=3, temperature=0.0))
    out = sample(setup.mm, requests, static=True)
    assert [(c.request, c.index) for c in out] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0)]
    references = {t: peft_model(setup.base, setup.dirs.get(t)) for t in ("a", "b", None)}
    worst = 0.0
    for c in out:
        r = requests[c.request]
        tokens, logprobs = greedy_generate(references[r.tenant], list(r.prompt), r.max_new_tokens)
        assert c.tokens == tokens, f"{setup.arch} request {c.request}"
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, logprobs)))
        assert c.sampling_logprobs == [0.0] * len(tokens)
    assert worst <= TOL, f"{setup.arch}: logprobs differ from PEFT's by {worst}"


def test_static_greedy_equals_the_dynamic_path_with_stop_strings_and_ids(setup):
    p = setup.prompts
    first = sample(setup.mm, [SampleRequest(p[0], "a", max_new_tokens=12, temperature=0.0)])[0]
    stop_id = first.tokens[3]  # a token the greedy completion reaches: its row stops there
    text = setup.tok.decode(first.tokens[:5], skip_special_tokens=True)
    requests = [
        SampleRequest(p[0], "a", max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_id]),
        SampleRequest(p[0], "a", max_new_tokens=12, temperature=0.0, stop_strings=[text[-2:] or "x"]),
        SampleRequest(p[2], "b", max_new_tokens=7, temperature=0.0),
        SampleRequest(p[3], None, max_new_tokens=12, temperature=0.0),
    ]
    dynamic = sample(setup.mm, requests, tokenizer=setup.tok, static=False)
    static = sample(setup.mm, requests, tokenizer=setup.tok, static=True)
    for d, s in zip(dynamic, static):
        assert (d.tokens, d.stop_reason) == (s.tokens, s.stop_reason)
        assert max(abs(a - b) for a, b in zip(d.logprobs, s.logprobs)) <= TOL
    assert static[0].stop_reason == "eos" and static[0].tokens[-1] == stop_id


def test_static_samples_are_reproducible_independent_of_the_batch_and_scored(setup):
    mm, p = setup.mm, setup.prompts
    target = SampleRequest(p[1], "b", num_samples=3, max_new_tokens=12, temperature=0.8, seed=7)
    alone = sample(mm, [target], static=True)
    others = [
        SampleRequest(p[2], "a", num_samples=2, max_new_tokens=5, temperature=1.0, seed=1),
        SampleRequest(p[0], None, max_new_tokens=20, temperature=0.0),
        SampleRequest(p[3], "b", max_new_tokens=3, temperature=1.2, top_k=5, seed=3),
    ]
    mixed = [c for c in sample(mm, [others[0], target, *others[1:]], static=True) if c.request == 1]
    again = sample(mm, [target], static=True)
    for a, m, g in zip(alone, mixed, again):
        assert a.tokens == m.tokens == g.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, m.logprobs)) <= TOL
    assert len({tuple(c.tokens) for c in alone}) == 3, "each sample index draws its own tokens"
    for c in alone:
        check_logprobs(mm, "b", list(p[1]), c, 0.8)


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (None, 0.3)])
def test_static_top_k_and_top_p_draw_only_inside_their_set(tiny_models, tmp_path_factory, top_k, top_p):
    s = build_setup("llama", tiny_models, tmp_path_factory)
    request = SampleRequest(s.prompts[1], "a", num_samples=16, max_new_tokens=4, temperature=1.0, top_k=top_k,
                            top_p=top_p, seed=11, stop_token_ids=())  # fmt: skip
    for c in sample(s.mm, [request], static=True):
        logits = forward_logits(s.mm, "a", list(s.prompts[1]), c.tokens)
        for step, token in enumerate(c.tokens):
            probs = logits[step].softmax(-1)
            ranked = probs.argsort(descending=True).tolist()
            keep = ranked[: top_k or len(ranked)]
            if top_p < 1:
                mass, kept = 0.0, []
                for t in ranked:
                    if mass >= top_p:
                        break
                    kept.append(t)
                    mass += probs[t].item()
                keep = kept
            assert token in keep


def test_uniforms_are_uniform_and_depend_on_seed_and_step_alone():
    seeds = torch.arange(20000, dtype=torch.long) * 7919 + 3
    u = static_decode.uniforms(seeds, 0)
    assert u.dtype == torch.float32 and u.min().item() >= 0 and u.max().item() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    assert torch.equal(static_decode.uniforms(seeds[5:9], 0), u[5:9])  # a row's draw: its seed alone
    assert not torch.equal(static_decode.uniforms(seeds, 1), u)
    assert (static_decode.uniforms(seeds, 1) - u).abs().mean().item() > 0.2  # steps are not correlated


def test_a_decoder_is_kept_for_the_same_shape_and_dropped_when_tenants_change(tiny_models, tmp_path_factory):
    s = build_setup("llama", tiny_models, tmp_path_factory)
    request = SampleRequest(s.prompts[0], "a", num_samples=3, max_new_tokens=5, temperature=0.0)
    first = sample(s.mm, [request], static=True)
    kept = dict(s.mm._decoders)
    assert len(kept) == 1 and next(iter(kept))[:2] == (4, 64)  # 3 rows in a bucket of 4, 64 positions
    assert [c.tokens for c in sample(s.mm, [request], static=True)] == [c.tokens for c in first]
    assert s.mm._decoders == kept
    s.mm.add_tenant("c", rank=2, target_modules=["q_proj"])
    sample(s.mm, [request], static=True)
    assert len(s.mm._decoders) == 1 and s.mm._decoders.keys() != kept.keys()
