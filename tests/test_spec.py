"""JobSpec / Tenant / Parallel: JSON round trip, path resolution, and validation that reports every problem."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from mlora_lab.spec import JobSpec, Parallel, SpecError, Tenant, model_target_names
from mlora_lab.tiny import build_tokenizer

LLAMA_LINEAR = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def good_spec(model: str, tmp: Path, **job: Any) -> JobSpec:
    """A spec that validates: one llama tenant with a two-row data file."""
    data = write(tmp / "a.jsonl", '{"text": "hello world"}\n{"prompt": "1 2", "completion": " 3"}\n')
    return JobSpec(base_model=model, tenants=[Tenant(name="a", data=data)], **job)


def problems_text(spec: JobSpec) -> str:
    return "\n".join(spec.problems())


# ---------------------------------------------------------------------------------------------
# Dataclasses and JSON
# ---------------------------------------------------------------------------------------------


def test_json_round_trip_keeps_types():
    spec = JobSpec(
        base_model="/m",
        tenants=[
            Tenant(name="a", data="a.jsonl", betas=(0.8, 0.95), max_grad_norm=None, target_parameters=["x"]),
            Tenant(name="b", data="b.jsonl", eval_data="b_eval.jsonl", use_rslora=True, schedule="cosine"),
        ],
        parallel=Parallel(nproc=2),
        slot_modules=["q_proj", "k_proj", "v_proj"],
        serve=True,
    )
    text = spec.to_json()
    back = JobSpec.from_json(text)
    assert back == spec
    assert back.tenants[0].betas == (0.8, 0.95) and isinstance(back.tenants[0].betas, tuple)
    assert back.tenants[0].max_grad_norm is None
    assert json.loads(text)["tenants"][0]["betas"] == [0.8, 0.95]
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert Tenant.from_dict(spec.tenants[1].to_dict()) == spec.tenants[1]
    assert Parallel.from_dict({"nproc": 2}) == Parallel(nproc=2)


def test_job_json_of_the_product_brief_parses():
    d = {
        "base_model": "m",
        "tenants": [{"name": "alice", "data": "alice.jsonl", "betas": [0.9, 0.999], "max_grad_norm": None}],
        "parallel": {"nproc": 1, "nnodes": 1, "fsdp": 1, "tp": 1, "ep": 1},
    }
    spec = JobSpec.from_dict(d)
    assert spec.tenants[0] == Tenant(name="alice", data="alice.jsonl", max_grad_norm=None)
    assert spec.parallel == Parallel()


def test_pathlike_arguments_are_stored_as_strings(tmp_path):
    t = Tenant(name="a", data=tmp_path / "a.jsonl", betas=[0.9, 0.99])
    spec = JobSpec(base_model=tmp_path, tenants=[t], output_dir=tmp_path / "out")
    assert isinstance(t.data, str) and isinstance(spec.base_model, str) and isinstance(spec.output_dir, str)
    assert t.betas == (0.9, 0.99)
    json.loads(spec.to_json())


def test_to_json_writes_atomically_and_load_resolves_relative_paths(tmp_path):
    spec = JobSpec(
        base_model="models/tiny",
        tokenizer="/abs/tok",
        tenants=[Tenant(name="a", data="data/a.jsonl", eval_data="../e.jsonl", init_adapter="~/ad")],
    )
    job = tmp_path / "run" / "job.json"
    job.parent.mkdir()
    text = spec.to_json(job)
    assert job.read_text().strip() == text
    assert os.listdir(job.parent) == ["job.json"]  # no temp file left behind

    loaded = JobSpec.load(job)
    run = str(tmp_path / "run")
    assert loaded.base_model == os.path.join(run, "models", "tiny")
    assert loaded.tokenizer == "/abs/tok"
    t = loaded.tenants[0]
    assert t.data == os.path.join(run, "data", "a.jsonl")
    assert t.eval_data == str(tmp_path / "e.jsonl")
    assert t.init_adapter == os.path.expanduser("~/ad")
    assert spec.tenants[0].data == "data/a.jsonl"  # resolved() returns a copy
    assert loaded.resolved(tmp_path) == loaded  # absolute paths are kept


def test_load_then_validate(tmp_path, llama_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "job.json").write_text(
        json.dumps({"base_model": llama_path, "tenants": [{"name": "a", "data": "a.jsonl"}]})
    )
    spec = JobSpec.load(tmp_path / "job.json").validate()
    assert spec.tenants[0].data == str(tmp_path / "a.jsonl")


def test_from_dict_reports_every_unknown_and_missing_key():
    d = {
        "base_model": "m",
        "tenants": [{"name": "a", "data": "a.jsonl", "lrr": 1e-3, "rnak": 4}, {"name": "b"}],
        "parallel": {"nprocs": 2},
        "epochs": 3,
    }
    with pytest.raises(SpecError) as err:
        JobSpec.from_dict(d)
    msg = str(err.value)
    for needle in (
        "'epochs'",
        "'lrr' (did you mean 'lr'?)",
        "'rnak'",
        "'nprocs'",
        "missing required field data",
    ):
        assert needle in msg
    assert len(err.value.problems) == 4
    with pytest.raises(SpecError, match="'bogus'"):
        Tenant.from_dict({"name": "a", "data": "d", "bogus": 1})
    with pytest.raises(SpecError, match="missing required field"):
        JobSpec.from_dict({"tenants": []})
    with pytest.raises(SpecError, match="not valid JSON"):
        JobSpec.from_json("{not json")


def test_spec_error_lists_problems_one_per_line():
    err = SpecError(["first", "second"])
    assert err.problems == ["first", "second"]
    assert isinstance(err, ValueError)
    assert str(err).splitlines()[1:] == ["  - first", "  - second"]


def test_scaling_tenant_lookup_and_world_size():
    assert Tenant(name="a", data="d", rank=4, alpha=16).scaling == 4.0
    assert Tenant(name="a", data="d", rank=4, alpha=16, use_rslora=True).scaling == 8.0
    assert math.isclose(
        Tenant(name="a", data="d", rank=8, alpha=8, use_rslora=True).scaling, 8 / math.sqrt(8)
    )
    spec = JobSpec(base_model="m", tenants=[Tenant(name="a", data="d")], parallel=Parallel(nproc=4, nnodes=2))
    assert spec.tenant("a") is spec.tenants[0]
    with pytest.raises(KeyError, match="no tenant 'zz'"):
        spec.tenant("zz")
    assert spec.parallel.world_size == 8


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def test_valid_spec_validates_and_starts_no_process(tmp_path, llama_path):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    spec = good_spec(llama_path, tmp_path)
    assert spec.validate() is spec
    assert spec.problems() == []
    assert {p.pid for p in me.children(recursive=True)} == before


def test_model_target_names(llama_path):
    linear, experts = model_target_names(llama_path)
    assert "model.layers.0.self_attn.q_proj" in linear and "lm_head" in linear
    assert experts == []


def at(path: str, value: Any) -> Callable[[JobSpec, Path], None]:
    """A mutation setting a dotted attribute path (``tenants.0.rank``); ``value`` may be ``fn(tmp)``."""

    def apply(spec: JobSpec, tmp: Path) -> None:
        *parts, last = path.split(".")
        obj: Any = spec
        for p in parts:
            obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
        setattr(obj, last, value(tmp) if callable(value) else value)

    return apply


def two_tenants(spec: JobSpec, tmp: Path) -> None:
    spec.tenants.append(Tenant(name="a", data=spec.tenants[0].data))


def mkdir(name: str) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        (tmp / name).mkdir()
        return str(tmp / name)

    return make


BAD_CASES: list[tuple[str, Callable[[JobSpec, Path], None], str]] = [
    # tenant fields
    ("rank0", at("tenants.0.rank", 0), "tenant 'a': rank must be >= 1 (got 0)"),
    ("rank_over_max", at("tenants.0.rank", 65), "tenant 'a': rank must be <= max_rank=64 (got 65)"),
    ("rank_str", at("tenants.0.rank", "8"), "tenant 'a': rank must be an integer (got '8' of type str)"),
    ("rank_float", at("tenants.0.rank", 8.5), "tenant 'a': rank must be an integer (got 8.5"),
    ("rank_bool", at("tenants.0.rank", True), "tenant 'a': rank must be an integer"),
    ("alpha0", at("tenants.0.alpha", 0), "tenant 'a': alpha must be > 0"),
    ("alpha_str", at("tenants.0.alpha", "16"), "tenant 'a': alpha must be a finite number"),
    ("rslora_str", at("tenants.0.use_rslora", "yes"), "tenant 'a': use_rslora must be true or false"),
    ("dropout1", at("tenants.0.dropout", 1.0), "tenant 'a': dropout must be in [0, 1)"),
    ("dropout_neg", at("tenants.0.dropout", -0.1), "tenant 'a': dropout must be in [0, 1)"),
    ("lr0", at("tenants.0.lr", 0.0), "tenant 'a': lr must be > 0"),
    ("lr_nan", at("tenants.0.lr", float("nan")), "tenant 'a': lr must be a finite number"),
    ("wd_neg", at("tenants.0.weight_decay", -0.01), "tenant 'a': weight_decay must be >= 0"),
    ("beta_one", at("tenants.0.betas", (0.9, 1.0)), "tenant 'a': betas[1] must be in [0, 1)"),
    ("betas_len", at("tenants.0.betas", (0.9,)), "tenant 'a': betas must be a pair"),
    ("eps0", at("tenants.0.eps", 0), "tenant 'a': eps must be > 0"),
    (
        "schedule",
        at("tenants.0.schedule", "step"),
        "tenant 'a': schedule must be one of constant, linear, cosine",
    ),
    ("warmup_neg", at("tenants.0.warmup_steps", -1), "tenant 'a': warmup_steps must be >= 0"),
    ("clip0", at("tenants.0.max_grad_norm", 0.0), "tenant 'a': max_grad_norm must be > 0"),
    ("batch0", at("tenants.0.batch_size", 0), "tenant 'a': batch_size must be >= 1"),
    ("accum0", at("tenants.0.grad_accum", 0), "tenant 'a': grad_accum must be >= 1"),
    ("steps0", at("tenants.0.max_steps", 0), "tenant 'a': max_steps must be >= 1"),
    ("shuffle_int", at("tenants.0.shuffle", 1), "tenant 'a': shuffle must be true or false"),
    ("seed_float", at("tenants.0.seed", 1.5), "tenant 'a': seed must be an integer"),
    ("targets_str", at("tenants.0.target_modules", "q_proj"), "tenant 'a': target_modules must be a list"),
    (
        "no_targets",
        at("tenants.0.target_modules", []),
        "tenant 'a': target_modules and target_parameters are both empty",
    ),
    (
        "unknown_module",
        at("tenants.0.target_modules", ["q_proj", "qkv_proj"]),
        f"tenant 'a': target_modules not found in the model: qkv_proj (available: {LLAMA_LINEAR})",
    ),
    (
        "not_linear",
        at("tenants.0.target_modules", ["mlp"]),
        "tenant 'a': target_modules 'mlp' matches modules that are not nn.Linear",
    ),
    (
        "all_linear_mixed",
        at("tenants.0.target_modules", ["all-linear", "q_proj"]),
        "'all-linear' must be the only entry",
    ),
    (
        "no_experts",
        at("tenants.0.target_parameters", ["mlp.experts.gate_up_proj"]),
        "tenant 'a': target_parameters not found in the model: mlp.experts.gate_up_proj (the model has no 3-D",
    ),
    # tenant names
    ("name_empty", at("tenants.0.name", ""), "tenant '': name is not a safe directory name (it is empty)"),
    ("name_dot", at("tenants.0.name", "."), "tenant '.': name is not a safe directory name"),
    ("name_dotdot", at("tenants.0.name", ".."), "tenant '..': name is not a safe directory name"),
    ("name_slash", at("tenants.0.name", "a/b"), "name is not a safe directory name (it contains '/')"),
    (
        "name_backslash",
        at("tenants.0.name", "a\\b"),
        "name is not a safe directory name (it contains '\\\\')",
    ),
    ("name_nul", at("tenants.0.name", "a\0b"), "name is not a safe directory name (it contains '\\x00')"),
    ("name_space", at("tenants.0.name", "a b"), "name is not a safe directory name (it contains ' ')"),
    ("name_long", at("tenants.0.name", "x" * 101), "it is 101 characters long (at most 100)"),
    ("name_type", at("tenants.0.name", 3), "tenant name must be a string"),
    ("duplicate", two_tenants, "tenant name 'a' is used 2 times"),
    # data
    ("data_missing", at("tenants.0.data", lambda tmp: str(tmp / "nope.jsonl")), "tenant 'a': data: "),
    (
        "data_missing_msg",
        at("tenants.0.data", lambda tmp: str(tmp / "nope.jsonl")),
        "nope.jsonl: file not found",
    ),
    ("data_empty", at("tenants.0.data", lambda tmp: write(tmp / "e.jsonl", "")), "tenant 'a': data: "),
    ("data_empty_msg", at("tenants.0.data", lambda tmp: write(tmp / "e.jsonl", "")), "e.jsonl: empty file"),
    (
        "data_bad_line",
        at("tenants.0.data", lambda tmp: write(tmp / "b.jsonl", '{"text": "ok"}\n{oops\n')),
        "b.jsonl line 2: not valid JSON",
    ),
    ("data_type", at("tenants.0.data", None), "tenant 'a': data must be a non-empty string"),
    ("eval_missing", at("tenants.0.eval_data", lambda tmp: str(tmp / "ev.jsonl")), "tenant 'a': eval_data: "),
    (
        "init_not_dir",
        at("tenants.0.init_adapter", lambda tmp: str(tmp / "nope")),
        "is not a PEFT adapter directory",
    ),
    (
        "init_no_config",
        at("tenants.0.init_adapter", mkdir("ad")),
        "is not a PEFT adapter directory (no adapter_config.json)",
    ),
    # job fields
    (
        "base_missing",
        at("base_model", lambda tmp: str(tmp / "no_model")),
        "no_model' is not a local directory",
    ),
    (
        "base_no_config",
        at("base_model", mkdir("empty")),
        "empty' does not hold a loadable transformers config",
    ),
    ("tokenizer_missing", at("tokenizer", lambda tmp: str(tmp / "tok")), "tokenizer '"),
    ("tokenizer_empty_dir", at("tokenizer", mkdir("tok")), "AutoTokenizer cannot load it"),
    ("seq_len", at("seq_len", 1), "seq_len must be >= 2"),
    ("max_tenants0", at("max_tenants", 0), "max_tenants must be >= 1"),
    ("max_rank0", at("max_rank", 0), "max_rank must be >= 1"),
    ("log_every0", at("log_every", 0), "log_every must be >= 1"),
    ("eval_every_neg", at("eval_every", -1), "eval_every must be >= 0"),
    ("save_every_neg", at("save_every", -1), "save_every must be >= 0"),
    ("dtype", at("dtype", "float64"), "dtype must be one of float32, bfloat16, float16 (got 'float64')"),
    ("serve_str", at("serve", "no"), "serve must be true or false"),
    ("no_tenants", at("tenants", []), "no tenants"),
    ("too_many", at("max_tenants", 1), "2 tenants but max_tenants=1"),  # with two_tenants below
    ("output_file", at("output_dir", lambda tmp: write(tmp / "out", "x")), "output_dir '"),
    # parallel
    ("nproc0", at("parallel.nproc", 0), "parallel.nproc must be >= 1"),
    ("tp_str", at("parallel.tp", "2"), "parallel.tp must be an integer"),
    ("fsdp", at("parallel", Parallel(nproc=2, fsdp=4)), "must divide nproc*nnodes"),
    (
        "tp_heads",
        at("parallel", Parallel(nproc=8, tp=8)),
        "parallel.tp = 8 does not divide num_key_value_heads = 2",
    ),
    ("ep_dense", at("parallel", Parallel(nproc=2, ep=2)), "parallel.ep = 2, but the model has no packed"),
    ("ep_divide", at("parallel", Parallel(nproc=2, ep=4)), "ep = 4 must divide the data-parallel ranks"),
    (
        "divide",
        at("parallel", Parallel(nproc=2, fsdp=3)),
        "fsdp*tp = 3*1 = 3 must divide nproc*nnodes = 2*1 = 2",
    ),
    ("parallel_type", at("parallel", {"nproc": 1}), "parallel must be a Parallel"),
    # slot_modules
    (
        "slots_unknown",
        at("slot_modules", ["q_proj", "v_proj", "wq"]),
        f"slot_modules not found in the model: wq (available: {LLAMA_LINEAR})",
    ),
    (
        "slots_cover",
        at("slot_modules", ["q_proj", "k_proj"]),
        "tenant 'a': target_modules v_proj not covered by slot_modules",
    ),
    ("slots_type", at("slot_modules", "q_proj"), "slot_modules must be a list"),
]


@pytest.mark.parametrize("mutate, expected", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_each_bad_input_is_reported(tmp_path, llama_path, mutate, expected):
    spec = good_spec(llama_path, tmp_path)
    if expected.startswith("2 tenants"):
        spec.tenants.append(Tenant(name="b", data=spec.tenants[0].data))
    mutate(spec, tmp_path)
    problems = spec.problems()
    assert any(expected in p for p in problems), problems
    with pytest.raises(SpecError) as err:
        spec.validate()
    assert expected in str(err.value)


def test_many_problems_are_reported_at_once(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path, dtype="fp8", seq_len=0, parallel=Parallel(nproc=2, fsdp=3))
    spec.tenants[0].rank = 0
    spec.tenants[0].lr = -1.0
    spec.tenants[0].schedule = "bogus"
    spec.tenants[0].target_modules = ["q_proj", "nope"]
    spec.tenants.append(Tenant(name="b/c", data=str(tmp_path / "missing.jsonl"), batch_size=0))
    with pytest.raises(SpecError) as err:
        spec.validate()
    msg = str(err.value)
    for needle in (
        "dtype must be one of",
        "seq_len must be >= 2",
        "must divide nproc*nnodes",
        "tenant 'a': rank must be >= 1",
        "tenant 'a': lr must be > 0",
        "tenant 'a': schedule must be one of",
        "tenant 'a': target_modules not found in the model: nope",
        "tenant 'b/c': name is not a safe directory name",
        "tenant 'b/c': batch_size must be >= 1",
        "tenant 'b/c': data: ",
    ):
        assert needle in msg, msg
    assert len(err.value.problems) >= 10


def test_unloadable_model_skips_model_checks_but_reports_the_rest(tmp_path):
    spec = good_spec(str(tmp_path / "nowhere"), tmp_path)
    spec.tenants[0].target_modules = ["whatever"]
    spec.tenants[0].rank = -1
    problems = spec.problems()
    assert len(problems) == 2, problems
    assert "is not a local directory" in problems[1] or "is not a local directory" in problems[0]


def test_serve_mode_allows_no_tenants(tmp_path, llama_path):
    spec = JobSpec(base_model=llama_path, tenants=[], serve=True)
    assert spec.problems() == []


def test_phi3_fused_projections(tmp_path, tiny_models):
    phi3 = tiny_models("phi3")
    spec = good_spec(phi3, tmp_path)
    spec.tenants[0].target_modules = ["qkv_proj", "gate_up_proj"]
    assert spec.problems() == []
    spec.tenants[0].target_modules = ["q_proj"]
    (problem,) = spec.problems()
    assert "target_modules not found in the model: q_proj" in problem
    assert "available: down_proj, gate_up_proj, lm_head, o_proj, qkv_proj" in problem


def test_all_linear_and_full_names(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    spec.tenants[0].target_modules = ["all-linear"]
    assert spec.problems() == []
    spec.tenants[0].target_modules = ["model.layers.0.self_attn.q_proj", "self_attn.v_proj"]
    assert spec.problems() == []
    spec.slot_modules = ["all-linear"]
    spec.tenants.append(Tenant(name="b", data=spec.tenants[0].data, target_modules=["all-linear"]))
    assert spec.problems() == []


def test_slot_modules_cover_tenants(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path, slot_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert spec.problems() == []
    spec.tenants[0].target_modules = ["all-linear"]
    (problem,) = spec.problems()
    assert "target_modules all-linear not covered by slot_modules" in problem


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, llama_path) -> str:
    """A tiny Qwen3-MoE config (no weights: validation builds the model on the meta device)."""
    from transformers import Qwen3MoeConfig

    out = tmp_path_factory.mktemp("moe")
    Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    ).save_pretrained(out)
    return str(out)


def test_target_parameters_are_checked(tmp_path, moe_path, llama_path):
    _, experts = model_target_names(moe_path)
    assert experts == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    spec = good_spec(moe_path, tmp_path, tokenizer=llama_path)
    spec.tenants[0].target_parameters = ["mlp.experts.up_proj"]
    (problem,) = spec.problems()
    assert (
        "target_parameters not found in the model: mlp.experts.up_proj (available: down_proj, gate_up_proj)"
        in problem
    )
    spec.tenants[0].target_parameters = ["mlp.experts.gate_up_proj", "down_proj"]
    assert spec.problems() == []
    spec.tenants[0].dropout = 0.1
    assert spec.problems() == [
        "tenant 'a': dropout must be 0 with target_parameters (PEFT has no dropout on expert weights)"
    ]
    spec.tenants[0].dropout = 0.0
    spec.tenants[0].target_modules = ["gate"]  # the router is not an nn.Linear in transformers 5
    assert any("'gate' matches modules that are not nn.Linear" in p for p in spec.problems())


def test_expert_parallel_is_checked_against_the_experts(tmp_path, moe_path, llama_path):
    spec = good_spec(moe_path, tmp_path, tokenizer=llama_path)
    spec.parallel = Parallel(nproc=4, fsdp=2, ep=2)  # ep borrows from all 4 data-parallel ranks
    assert spec.problems() == []
    spec.parallel = Parallel(nproc=8, ep=8)
    assert spec.problems() == ["parallel.ep = 8 does not divide the 4 experts of each MoE layer"]
    spec.parallel = Parallel(nproc=3, ep=3)
    assert spec.problems() == ["parallel.ep = 3 does not divide the 4 experts of each MoE layer"]


def test_chat_rows_need_a_chat_template(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    chat = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    spec.tenants[0].eval_data = write(tmp_path / "chat.jsonl", chat)
    assert spec.problems() == []  # the tiny tokenizer has a chat template
    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain_tok")
    spec.tokenizer = str(tmp_path / "plain_tok")
    (problem,) = spec.problems()
    assert (
        "tenant 'a': eval_data has chat ('messages') rows but the tokenizer has no chat_template" in problem
    )


# ---------------------------------------------------------------------------------------------
# init_adapter
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, llama_path) -> str:
    """A real PEFT LoRA adapter of the tiny llama: r=16, alpha=32, q_proj + v_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama_path)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return str(out)


def test_init_adapter_matching_tenant_validates(tmp_path, llama_path, adapter_dir):
    spec = good_spec(llama_path, tmp_path)
    t = spec.tenants[0]
    t.init_adapter, t.rank, t.alpha, t.target_modules = adapter_dir, 16, 32, ["v_proj", "q_proj"]
    assert spec.problems() == []


def test_init_adapter_mismatches_say_what_to_set(tmp_path, llama_path, adapter_dir):
    spec = good_spec(llama_path, tmp_path, max_rank=8)
    t = spec.tenants[0]
    t.init_adapter, t.use_rslora, t.target_modules = adapter_dir, True, ["q_proj"]
    text = problems_text(spec)
    for needle in (
        "tenant 'a': init_adapter has r=16 > max_rank=8",
        "tenant 'a': rank 8 differs from init_adapter r=16; set rank=16",
        "tenant 'a': alpha 16 differs from init_adapter lora_alpha=32; set alpha=32",
        "tenant 'a': use_rslora True differs from init_adapter use_rslora=False; set use_rslora=false",
        "tenant 'a': target_modules ['q_proj'] differs from init_adapter target_modules=['q_proj', 'v_proj']",
    ):
        assert needle in text, text


def test_init_adapter_patterns_are_not_supported(tmp_path, llama_path, adapter_dir):
    ad = tmp_path / "ad"
    ad.mkdir()
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    cfg.update(rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 8})
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    spec = good_spec(llama_path, tmp_path)
    t = spec.tenants[0]
    t.init_adapter, t.rank, t.alpha = str(ad), 16, 32
    text = problems_text(spec)
    assert "init_adapter has a non-empty rank_pattern" in text
    assert "init_adapter has a non-empty alpha_pattern" in text
    assert "has no adapter_model.safetensors" in text


def test_init_adapter_all_linear_saved_expanded_matches(tmp_path, llama_path, adapter_dir):
    # PEFT saves "all-linear" as the expanded list of full module names.
    ad = tmp_path / "ad"
    ad.mkdir()
    linear, _ = model_target_names(llama_path)
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    cfg["target_modules"] = [n for n in linear if n != "lm_head"]
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    (ad / "adapter_model.safetensors").write_bytes(b"")
    spec = good_spec(llama_path, tmp_path)
    t = spec.tenants[0]
    t.init_adapter, t.rank, t.alpha, t.target_modules = str(ad), 16, 32, ["all-linear"]
    assert spec.problems() == []
