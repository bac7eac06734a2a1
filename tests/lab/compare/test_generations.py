"""``ml.compare_generations``: a view over ``ml.evaluate``'s sampler that renders each prompt the way each
tenant was trained.

- every column's greedy completions equal PEFT's ``generate`` with that adapter alone (the plain base for the
  base columns), prompt by prompt, unpadded, over a table of tiny architectures, with chat and plain prompts
  of different lengths in one batch and an EOS that stops some rows early: the outputs the older path (its
  own left padding and HF ``generate``) gave, which matched this reference on the same table;
- the columns, the rendering of chat and plain prompts per column, and the tokens fed to the sampler;
- a tokenizer without a chat template is said to be the problem when one is needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import peft
import pytest
import torch
import transformers

import mlora_lab as ml
from mlora_lab.lab.demo import task_rows, write_jsonl
from mlora_lab.lab.launch import prepare_run
from mlora_lab.tiny import TYPICAL_TARGETS

ARCHS = ["llama", "qwen2", "phi3", "gpt_neox", "qwen3_moe", "mixtral"]
NEW_TOKENS = 10
PROMPTS = [
    "red",
    "upper: the model and the adapter one two three\n",
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how many words: red cat dog"}],
]


def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """HF ``generate``'s greedy new tokens for one unpadded prompt (stopping at the generation config's EOS)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def stop_early(base: str, out: Path) -> tuple[str, int]:
    """A copy of ``base`` whose generation config also stops at a token the base's greedy completion of
    ``PROMPTS[0]`` reaches after a few others (a plain token, so its text stays in the decoded completion):
    some rows then end on EOS, others run to ``NEW_TOKENS``. Returns the copy and that token."""
    shutil.copytree(base, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tokens = greedy(
        transformers.AutoModelForCausalLM.from_pretrained(out).eval(), tok(PROMPTS[0]).input_ids, 8
    )
    fresh = [
        t for k, t in enumerate(tokens) if k >= 2 and t not in tokens[:k] and t not in tok.all_special_ids
    ]
    assert fresh, f"the base's greedy completion repeats itself: {tokens}"
    config = transformers.GenerationConfig.from_pretrained(out)
    config.eos_token_id = [tok.eos_token_id, fresh[0]]
    config.save_pretrained(out)
    return str(out), fresh[0]


@pytest.fixture(scope="module", params=ARCHS)
def random_adapters_run(request, tiny_models, tmp_path_factory):
    """``(run directory, base, EOS token added)``: a chat tenant (``messages`` rows, two targets, rank 4)
    and a prompt/completion tenant (every typical target, rank 8) of ``arch``, their PEFT adapters random
    (``init_lora_weights=False``: B != 0, so each changes the base's greedy text)."""
    arch = request.param
    work = tmp_path_factory.mktemp(f"gens_{arch}")
    base, eos = stop_early(tiny_models(arch), work / "base")
    targets = TYPICAL_TARGETS[arch]
    spec = ml.JobSpec(
        base_model=base,
        seq_len=64,
        max_rank=8,
        output_dir=str(work / "run"),
        tenants=[
            ml.Tenant(
                name="chatty",
                data=write_jsonl(work / "count.jsonl", task_rows("count", 8, 0)),
                rank=4,
                target_modules=targets[:2],
            ),
            ml.Tenant(
                name="plain",
                data=write_jsonl(work / "up.jsonl", task_rows("upper", 8, 0)),
                rank=8,
                target_modules=targets,
            ),
        ],
    )
    run = prepare_run(spec)
    for t in spec.tenants:
        torch.manual_seed(t.rank)
        config = peft.LoraConfig(
            r=t.rank, lora_alpha=2 * t.rank, target_modules=t.target_modules, init_lora_weights=False
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        peft.get_peft_model(model, config).save_pretrained(run.adapter(t.name))
    return run.root, base, eos


def test_greedy_generations_equal_peft_generate_with_each_adapter_alone(random_adapters_run):
    run_dir, base, eos = random_adapters_run
    gens = ml.compare_generations(run_dir, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert list(gens.columns) == ["prompt", "base", "base (chat)", "chatty", "plain"]
    assert gens.index.tolist() == [0, 1, 2] and gens["prompt"].tolist() == PROMPTS

    tok = transformers.AutoTokenizer.from_pretrained(base)
    lengths, stopped = set(), []
    for column in gens.columns[1:]:
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        if not column.startswith("base"):
            model = peft.PeftModel.from_pretrained(model, ml.attach(run_dir).adapter_path(column))
        model.eval()
        want = []
        for prompt, text in zip(PROMPTS, gens.attrs["inputs"][column]):
            # a chat's rendering brings its own BOS; a plain prompt gets the tokenizer's
            chat = gens.attrs["chat"][column] or not isinstance(prompt, str)
            ids = tok(text, add_special_tokens=not chat).input_ids
            tokens = greedy(model, ids, NEW_TOKENS)
            lengths.add(len(ids))
            stopped.append(tokens[-1] == eos and len(tokens) < NEW_TOKENS)
            want.append(tok.decode(tokens, skip_special_tokens=True))
        assert gens[column].tolist() == want, column
    assert (
        gens["chatty"].tolist() != gens["base (chat)"].tolist()
        and gens["plain"].tolist() != gens["base"].tolist()
    )
    assert len(lengths) >= 4, "prompts of different lengths: the batch pads them"
    assert any(stopped) and not all(stopped), "some rows stop at EOS, others run to max_new_tokens"


# -- generations: each tenant is fed prompts the way it was trained -----------------------------------


@pytest.fixture
def chat_and_plain_run(tiny_models, tmp_path):
    """A run directory (no job launched) with a chat tenant and a prompt/completion tenant, their
    adapters saved at PEFT's initialisation."""
    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.spec.job import effective_slot_modules

    base = tiny_models("llama")
    spec = ml.JobSpec(
        base_model=base,
        seq_len=64,
        max_rank=8,
        output_dir=str(tmp_path / "run"),
        tenants=[
            ml.Tenant(
                name="chatty", data=write_jsonl(tmp_path / "count.jsonl", task_rows("count", 8, 0)), rank=4
            ),
            ml.Tenant(
                name="plain",
                data=write_jsonl(tmp_path / "up.jsonl", task_rows("upper", 8, 0)),
                rank=4,
                target_modules=["q_proj"],
            ),
        ],
    )
    run = prepare_run(spec)
    mm = MultiLoRAModel(
        transformers.AutoModelForCausalLM.from_pretrained(base),
        max_tenants=2,
        max_rank=8,
        slot_modules=effective_slot_modules(spec),
    )
    for t in spec.tenants:
        mm.add_tenant(t.name, rank=t.rank, target_modules=t.target_modules)
        mm.save_adapter(t.name, run.adapter(t.name))
    return run.root


def test_generations_render_prompts_as_each_tenant_was_trained(chat_and_plain_run, monkeypatch):
    from mlora_lab import sampling

    fed = []
    sample = sampling.sample

    def spy(model, requests, **kw):
        fed.append(list(requests))
        return sample(model, requests, **kw)

    monkeypatch.setattr(sampling, "sample", spy)
    chat_text = (
        "<s><|user|>\ncount red\n<|assistant|>\n"  # mlora_lab.tiny.CHAT_TEMPLATE, generation prompt on
    )
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count blue dog"}]
    messages_text = "<s><|system|>\nbe brief\n<|user|>\ncount blue dog\n<|assistant|>\n"
    gens = ml.compare_generations(chat_and_plain_run, ["count red", messages], max_new_tokens=3)
    # the chat tenant trained on messages rows only: plain strings get the chat template; the
    # prompt/completion tenant gets them as they are; the base is shown both ways
    assert list(gens.columns) == ["prompt", "base", "base (chat)", "chatty", "plain"] and len(gens) == 2
    assert gens.attrs["chat"] == {"base": False, "base (chat)": True, "chatty": True, "plain": False}
    inputs = gens.attrs["inputs"]
    assert inputs["chatty"] == inputs["base (chat)"] == [chat_text, messages_text]
    assert (
        inputs["plain"] == inputs["base"] == ["count red", messages_text]
    )  # a message list is always a chat
    assert gens["prompt"].tolist() == ["count red", messages]
    # ... and exactly those tokens are what the model is fed: the rendering tokenized as training does
    (requests,), tok = fed, _tokenizer(chat_and_plain_run)
    assert [r.tenant for r in requests] == [None, None, None, None, "chatty", "chatty", "plain", "plain"]
    # one greedy batch of ml.evaluate's sampler, which pads the rows itself
    assert all(r.temperature == 0 and r.max_new_tokens == 3 and r.num_samples == 1 for r in requests)
    rows = [list(r.prompt) for r in requests]
    assert [tok.decode(r) for r in rows[4:6]] == [chat_text, messages_text]
    assert rows[4] == tok(chat_text, add_special_tokens=False)["input_ids"]  # the template brings its BOS
    assert rows[6] == tok("count red")["input_ids"] and tok.decode(rows[6]) == "<s>count red"
    assert rows[7] == rows[5]

    fed.clear()
    gens = ml.compare_generations(chat_and_plain_run, ["count red"], chat=False, include_base=False)
    assert list(gens.columns) == ["prompt", "chatty", "plain"]
    assert gens.attrs["inputs"] == {"chatty": ["count red"], "plain": ["count red"]}
    gens = ml.compare_generations(chat_and_plain_run, ["count red"], chat=True, tenants=["plain"])
    assert gens.attrs["inputs"] == {"base": [chat_text], "plain": [chat_text]}
    with pytest.raises(ValueError, match="a prompt is a string or a non-empty list"):
        ml.compare_generations(chat_and_plain_run, [[{"role": "user"}]])


def test_generations_say_when_the_tokenizer_has_no_chat_template(chat_and_plain_run, monkeypatch):
    import transformers

    load = transformers.AutoTokenizer.from_pretrained

    def no_template(*args, **kw):
        tok = load(*args, **kw)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_template)
    with pytest.raises(
        ValueError, match=r"tenant\(s\) 'chatty' were trained on 'messages' rows.* has no chat"
    ):
        ml.compare_generations(chat_and_plain_run, ["count red"])
    with pytest.raises(
        ValueError, match="prompts given as messages are rendered with the chat template, but"
    ):
        ml.compare_generations(chat_and_plain_run, [[{"role": "user", "content": "hi"}]], chat=False)
    with pytest.raises(ValueError, match="chat=True renders every prompt"):
        ml.compare_generations(chat_and_plain_run, ["count red"], chat=True, tenants=["plain"])
    gens = ml.compare_generations(chat_and_plain_run, ["count red"], chat=False, max_new_tokens=2)
    assert gens.attrs["inputs"]["chatty"] == ["count red"]


def _tokenizer(run_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(ml.attach(run_dir).spec.base_model)
