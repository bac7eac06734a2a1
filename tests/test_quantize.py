"""A quantized frozen base (``JobSpec.quantize``, bitsandbytes nf4 / int8, on the CPU here).

- a tenant over a quantized base trains as plain PEFT over the same quantized base (QLoRA), per step;
- its adapters, gradients and AdamW state stay float32; the saved adapter, loaded by PEFT over that
  base, gives the job's logits;
- resume, sampling and data-parallel ranks work over it; layouts that cannot are refused up front.
"""

from __future__ import annotations

import importlib.util

import peft
import pytest
import torch
import transformers

from mlora_lab import quant
from mlora_lab.data import load_examples
from mlora_lab.job.trainer import Trainer
from mlora_lab.reference import train_peft
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Parallel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import TYPICAL_TARGETS
from mlora_lab.validate import check, problems

pytestmark = [
    pytest.mark.skipif(not quant.available(), reason="needs the quant extra (bitsandbytes)"),
    # bitsandbytes' CPU int8 path says once per layer that it casts float32 inputs to float16
    pytest.mark.filterwarnings("ignore:MatMul8bitLt"),
]

TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(max((a[k][0] - b[k][0]).abs().max().item(), (a[k][1] - b[k][1]).abs().max().item()) for k in a)


def peft_adapter(base: str, path: str, targets: list[str]) -> str:
    """A rank-4 PEFT adapter with ``B != 0`` (so the first step already depends on the base's output)."""
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    # (without the output layer's own weight, which PEFT saves beside an lm_head LoRA by default and could not
    # load back into a quantized output layer)
    peft.get_peft_model(model, config).save_pretrained(path, save_embedding_layers=False)
    return path


def one_tenant(base: str, data: str, adapter: str, targets: list[str], **kw) -> Tenant:
    # eps 1e-6 as the equivalence suite (tests/lora/test_equivalence.py says why)
    kw = (
        dict(rank=4, alpha=8, lr=3e-3, batch_size=7, max_steps=4, shuffle=False, max_grad_norm=None, eps=1e-6)
        | kw
    )
    return Tenant(name="a", data=data, init_adapter=adapter, target_modules=targets, **kw)


def tied(base: str, out) -> str:
    """A copy of the model at ``base`` whose output layer is tied to its input embedding."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def quantized_base(base: str, mode: str) -> transformers.PreTrainedModel:
    """The base as a job with ``quantize=mode`` (``"nf4+embeddings"``: and ``quantize_embeddings``) loads it."""
    kind = mode.removesuffix("+embeddings")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, **quant.load_kwargs(kind, torch.float32, torch.device("cpu"))
    )
    return quant.prepare(model, kind, torch.float32, embeddings=mode.endswith("+embeddings"))


@pytest.mark.parametrize(
    ("arch", "mode"),
    [
        ("llama", "nf4"),
        ("qwen2", "nf4"),
        ("llama", "int8"),
        ("llama", "nf4+embeddings"),
        ("llama, tied", "nf4+embeddings"),
    ],
)
def test_a_quantized_base_trains_as_peft_over_the_same_quantized_base(
    arch, mode, tiny_models, make_data, tmp_path
):
    """Per step and at the end, as PEFT over the same quantized base; ``quantize_embeddings`` (the output
    layer then also carries the tenant's LoRA, over its 4-bit weight) over an untied and a tied base."""
    base = tiny_models(arch.removesuffix(", tied"))
    targets = TYPICAL_TARGETS[arch.removesuffix(", tied")]
    embeddings = mode.endswith("+embeddings")
    if arch.endswith("tied"):
        base = tied(base, tmp_path / "tied")
    if embeddings:
        targets = [*targets, "lm_head"]
    data = make_data("reverse", 7)
    adapter = peft_adapter(base, str(tmp_path / "init"), targets)
    spec = JobSpec(
        base_model=base,
        tenants=[one_tenant(base, data, adapter, targets)],
        seq_len=64,
        max_rank=8,
        max_tenants=2,
        quantize=mode.removesuffix("+embeddings"),
        quantize_embeddings=embeddings,
    )
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    layer = trainer.model.layers[next(iter(trainer.model.layers))].base_layer
    kind = mode.removesuffix("+embeddings")
    assert type(layer).__name__ == {"nf4": "Linear4bit", "int8": "Linear8bitLt"}[kind]
    assert layer.weight.dtype == {"nf4": torch.uint8, "int8": torch.int8}[kind]
    if embeddings:
        import bitsandbytes as bnb

        model = trainer.model.model
        embedding, output = model.get_input_embeddings(), trainer.model.layers["lm_head"].base_layer
        assert isinstance(embedding, bnb.nn.Embedding4bit) and isinstance(output, bnb.nn.Linear4bit)
        assert embedding.weight.dtype == output.weight.dtype == torch.uint8
        assert (output.weight is embedding.weight) == arch.endswith("tied")
        assert trainer.engine.vocab_rows == model.config.vocab_size  # (not the packed weight's rows)
        plain = quantized_base(base, kind)
        assert model.get_memory_footprint() < plain.get_memory_footprint()
    assert all(p.dtype == torch.float32 for p, _ in trainer.model.tenant_slices("a"))
    state = trainer.tenants["a"].optimizer.optimizer.state.values()
    assert state and all(s[k].dtype == torch.float32 for s in state for k in ("exp_avg", "exp_avg_sq"))

    tok = transformers.AutoTokenizer.from_pretrained(base)
    examples = load_examples(data, tok, spec.seq_len)
    ref = train_peft(
        base, [examples] * 4, adapter_dir=adapter, lr=3e-3, eps=1e-6, pad_id=tok.pad_token_id, quantize=kind,
        quantize_embeddings=embeddings,
    )  # fmt: skip
    assert trainer.losses("a") == pytest.approx(ref.losses, abs=TOL)
    assert max_diff(trainer.model.tenant_tensors("a"), ref.tensors) <= TOL

    # the saved adapter, loaded by PEFT over the same quantized base, gives the job's logits
    loaded = peft.PeftModel.from_pretrained(
        quantized_base(base, mode), str(tmp_path / "run" / "adapters" / "a")
    ).eval()
    ids = torch.randint(3, 200, (2, 9))
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(ids, tenants=["a", "a"]).logits
        theirs = loaded(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= TOL


def test_two_tenants_over_a_quantized_base_equal_each_alone(tiny_models, make_data):
    """Isolation holds over a quantized base: the base's quantized output is the same for every row."""
    base = tiny_models("llama")
    targets = TYPICAL_TARGETS["llama"]
    tenants = [
        Tenant(name="a", data=make_data("reverse"), rank=4, target_modules=targets[:2], lr=5e-3, batch_size=2,
               max_steps=5, seed=1, eps=1e-6),
        Tenant(name="b", data=make_data("upper"), rank=8, target_modules=targets, lr=1e-3, batch_size=3,
               max_steps=5, seed=2, eps=1e-6, max_grad_norm=0.05),
    ]  # fmt: skip

    def run(ts):
        trainer = Trainer(
            JobSpec(base_model=base, tenants=ts, seq_len=48, max_rank=8, max_tenants=2, quantize="nf4")
        )
        trainer.train()
        return trainer

    together = run(tenants)
    for t in tenants:
        alone = run([t])
        assert together.losses(t.name) == pytest.approx(alone.losses(t.name), abs=TOL)
        assert max_diff(together.model.tenant_tensors(t.name), alone.model.tenant_tensors(t.name)) <= TOL


@pytest.mark.parametrize("embeddings", [False, True], ids=["nf4", "nf4 with its embeddings"])
def test_resume_over_a_quantized_base_equals_an_uninterrupted_run(
    embeddings, tiny_models, make_data, tmp_path
):
    """The base is quantized again as the resumed job loads it, to the same weights (with quantized
    embeddings too): the run goes on as if never cut."""
    base = tiny_models("llama")
    targets = ["q_proj", "v_proj", *(["lm_head"] if embeddings else [])]
    tenant = Tenant(
        name="a", data=make_data("reverse"), rank=4, target_modules=targets, lr=5e-3, batch_size=2,
        max_steps=6, seed=1, eps=1e-6,
    )  # fmt: skip
    spec = JobSpec(
        base_model=base, tenants=[tenant], seq_len=48, max_rank=8, max_tenants=2, quantize="nf4",
        quantize_embeddings=embeddings,
    )  # fmt: skip
    straight = Trainer(spec)
    straight.train()
    first = Trainer(spec, run_dir=tmp_path / "cut")
    for _ in range(3):
        first.step()
    first.save_checkpoint()
    first.close()
    again = Trainer(spec, run_dir=tmp_path / "cut", resume=True)
    assert again.global_step == 3
    again.train()
    assert again.losses("a")[-1] == straight.losses("a")[-1]
    assert max_diff(again.model.tenant_tensors("a"), straight.model.tenant_tensors("a")) <= 1e-6


def cut_nf4_run(base: str, data: str, run_dir, steps: int = 3) -> JobSpec:
    """An nf4 run of one tenant (6 steps) cut after ``steps`` with a checkpoint; its spec."""
    tenant = Tenant(
        name="a", data=data, rank=4, target_modules=["q_proj", "v_proj"], lr=5e-3, batch_size=2, max_steps=6,
        seed=1, eps=1e-6,
    )  # fmt: skip
    spec = JobSpec(base_model=base, tenants=[tenant], seq_len=48, max_rank=8, max_tenants=2, quantize="nf4")
    first = Trainer(spec, run_dir=run_dir)
    for _ in range(steps):
        first.step()
    first.save_checkpoint()
    first.close()
    return spec


@pytest.mark.parametrize(
    "edit", [{"quantize": None}, {"quantize": "int8"}, {"quantize_embeddings": True}], ids=str
)
def test_Q6_a_changed_quantize_is_held_back_when_an_nf4_run_resumes(edit, tiny_models, make_data, tmp_path):
    """Q6: resuming an nf4 run after job.json's ``quantize`` (or ``quantize_embeddings``) changed said
    nothing, and the adapters went on over another base. The change is held back, as a changed rank is: the
    resume keeps the checkpoint's base (nf4), says which setting it held back and why (a ``warning`` event,
    and the log), puts job.json back, and goes on exactly as a run never cut."""
    import json

    base = tiny_models("llama")
    spec = cut_nf4_run(base, make_data("reverse"), tmp_path / "cut")
    straight = Trainer(spec)
    straight.train()
    job = tmp_path / "cut" / "job.json"
    job.write_text(json.dumps(json.loads(job.read_text()) | edit))
    again = Trainer(JobSpec.load(job), run_dir=tmp_path / "cut", resume=True)
    (field,) = edit
    assert (again.spec.quantize, again.spec.quantize_embeddings) == ("nf4", False)
    saved = json.loads(job.read_text())
    assert (saved["quantize"], saved["quantize_embeddings"]) == ("nf4", False), "job.json is put back"
    (warning,) = [r for r in again.history if r["kind"] == "event" and r["event"] == "warning"]
    assert f"job.json's {field}={edit[field]!r} is held back" in warning["message"], warning["message"]
    again.train()
    assert again.global_step == 6 and again.losses("a")[-1] == straight.losses("a")[-1]
    assert max_diff(again.model.tenant_tensors("a"), straight.model.tenant_tensors("a")) <= 1e-6


@pytest.mark.slow
def test_Q6_ml_resume_says_what_it_held_back(tiny_models, make_data, tmp_path):
    """Q6: ``ml.resume`` (and ``mlora-lab resume``) warns the caller, naming the setting it holds back,
    before the job starts; the resumed job runs over the nf4 base it was trained on."""
    import json

    import mlora_lab as ml
    from mlora_lab.rundir import update_status

    run_dir = tmp_path / "cut"
    cut_nf4_run(tiny_models("llama"), make_data("reverse"), run_dir)
    update_status(run_dir, state="stopped")
    job = run_dir / "job.json"
    job.write_text(json.dumps(json.loads(job.read_text()) | {"quantize": None}))
    with pytest.warns(UserWarning, match=r"job.json's quantize=None is held back.*quantize='nf4'"):
        run = ml.resume(run_dir)
    assert json.loads(job.read_text())["quantize"] == "nf4"
    assert run.wait(timeout=300) == "finished", run.logs(0)
    assert run.metrics().query("kind == 'train'")["tenant_step"].max() == 6


@pytest.mark.parametrize("mode", ["nf4", "nf4+embeddings"])
def test_greedy_sampling_over_a_quantized_base_equals_peft_generate(mode, tiny_models, tmp_path):
    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.sampling import SampleRequest, sample

    base = tiny_models("llama")
    targets = ["q_proj", "v_proj", *(["lm_head"] if mode.endswith("embeddings") else [])]
    adapter = peft_adapter(base, str(tmp_path / "init"), targets)

    def quantized():
        return quantized_base(base, mode)

    mm = MultiLoRAModel(quantized(), max_tenants=2, max_rank=8, slot_modules=targets)
    mm.load_adapter("a", adapter)
    prompt = [5, 17, 33, 9, 41]
    ours = sample(mm, [SampleRequest(prompt, "a", max_new_tokens=8, temperature=0.0, stop_token_ids=[])])
    peft_model = peft.PeftModel.from_pretrained(quantized(), adapter).eval()
    with torch.no_grad():
        theirs = peft_model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    assert ours[0].tokens == theirs[0, len(prompt) :].tolist()


def test_layouts_that_cannot_hold_a_quantized_base_are_refused_at_once(tiny_models, make_data, monkeypatch):
    base = tiny_models("llama")
    tenant = Tenant(name="a", data=make_data("reverse"), target_modules=["q_proj"])
    bad = JobSpec(base_model=base, tenants=[tenant], quantize="fp8")
    assert any("quantize" in p.field and "nf4" in p.message for p in problems(bad))
    sharded = JobSpec(
        base_model=base, tenants=[tenant], quantize="nf4", parallel=Parallel(nproc=2, fsdp=2, tp=1)
    )
    split = JobSpec(base_model=base, tenants=[tenant], quantize="int8", parallel=Parallel(nproc=2, tp=2))
    said = {p.field: p.message for p in problems(sharded)} | {p.field: p.message for p in problems(split)}
    assert "FSDP2" in said["parallel.fsdp"] and "quantize='nf4'" in said["parallel.fsdp"]
    assert "tensor parallel" in said["parallel.tp"]
    replicated = JobSpec(base_model=base, tenants=[tenant], quantize="nf4", parallel=Parallel(nproc=2))
    assert not problems(replicated), "data parallel holds the whole quantized base on every process"
    for q in (None, "int8"):  # the embeddings in nf4 go with the linear layers in nf4
        said = {p.field: p.message for p in problems(JobSpec(base_model=base, tenants=[tenant], quantize=q,
                                                            quantize_embeddings=True))}  # fmt: skip
        assert f"quantize is {q!r}" in said["quantize_embeddings"], said
    assert not problems(JobSpec(base_model=base, tenants=[tenant], quantize="nf4", quantize_embeddings=True))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    with pytest.raises(SpecError, match=r"mlora_lab\[quant\]"):
        check(JobSpec(base_model=base, tenants=[tenant], quantize="nf4"))


@pytest.mark.slow
def test_two_data_parallel_ranks_over_a_quantized_base_equal_one(tiny_models, make_data, tmp_path):
    """Under torchrun, 2 processes each hold the whole nf4 base (no FSDP) and sum the tenants' gradients:
    the adapters equal a 1-process job's."""
    import dataclasses

    import mlora_lab as ml
    from mlora_lab.lora import read_adapter

    base = tiny_models("llama")
    tenant = Tenant(
        name="a", data=make_data("reverse"), rank=4, target_modules=["q_proj", "v_proj"], lr=5e-3, batch_size=4,
        max_steps=4, seed=1, eps=1e-6,
    )  # fmt: skip
    spec = JobSpec(
        base_model=base, tenants=[tenant], seq_len=48, max_rank=8, max_tenants=2, quantize="nf4",
        parallel=Parallel(nproc=2), output_dir=str(tmp_path / "dp"),
    )  # fmt: skip
    run = ml.launch(spec)
    assert run.wait(timeout=300) == "finished", run.logs(0)
    one = Trainer(dataclasses.replace(spec, parallel=Parallel(), output_dir=None))
    one.train()
    assert max_diff(read_adapter(run.adapter_path("a"))[1], one.model.tenant_tensors("a")) <= TOL


def test_an_rl_tenant_over_a_quantized_base_trains_and_resumes_exactly(tiny_models, tmp_path):
    """GRPO over an nf4 base: generation, the reference log-probs and the policy step all run over the
    quantized layers, and a stop mid-window then resume equals a run straight through."""
    import json

    from mlora_lab.spec.parts import RL

    base = tiny_models("llama")
    (tmp_path / "rewards.py").write_text(
        "def short(prompts, completions, **kw):\n    return [-len(c) / 10 for c in completions]\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"say {w} and"}) + "\n" for w in ("red", "green", "blue", "one"))
    )
    rl = RL(
        reward=f"{tmp_path / 'rewards.py'}:short", group_size=3, max_new_tokens=6, beta=0.1, num_iterations=2
    )
    tenant = Tenant(
        name="a", data=str(prompts), rl=rl, rank=4, alpha=8, target_modules=["q_proj", "v_proj"], lr=2e-2,
        batch_size=2, max_steps=4, max_grad_norm=None, eps=1e-6, seed=3,
    )  # fmt: skip
    spec = JobSpec(base_model=base, tenants=[tenant], seq_len=48, max_rank=8, max_tenants=2, quantize="nf4")
    straight = Trainer(spec)
    straight.train()
    assert straight.tenants["a"].step == 4
    first = Trainer(spec, run_dir=tmp_path / "run")
    for _ in range(3):
        assert first.step()
    first.save_checkpoint()
    first.close()
    again = Trainer(spec, run_dir=tmp_path / "run", resume=True)
    again.train()
    assert again.losses("a")[-1:] == pytest.approx(straight.losses("a")[-1:], abs=1e-6)
    assert max_diff(again.model.tenant_tensors("a"), straight.model.tenant_tensors("a")) <= 1e-6


def test_quantized_embeddings_are_refused_for_an_embedding_that_computes_more_than_a_lookup(
    tiny_models, tmp_path
):
    """Gemma's input embedding scales its rows by sqrt(hidden): replacing it by bitsandbytes' plain nf4
    embedding would drop the scale, so validation refuses ``quantize_embeddings`` there, naming the class."""
    config = transformers.AutoConfig.for_model(
        "gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma")
    transformers.AutoTokenizer.from_pretrained(tiny_models("llama")).save_pretrained(tmp_path / "gemma")
    tenant = Tenant(name="a", data=[{"text": "a b c"}] * 4, target_modules=["q_proj"])
    spec = JobSpec(
        base_model=str(tmp_path / "gemma"), tenants=[tenant], quantize="nf4", quantize_embeddings=True
    )
    said = {p.field: p.message for p in problems(spec)}
    assert "Gemma3TextScaledWordEmbedding" in said["quantize_embeddings"], said
    assert not problems(JobSpec(base_model=str(tmp_path / "gemma"), tenants=[tenant], quantize="nf4"))
