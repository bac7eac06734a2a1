"""JobSpec / Tenant / Parallel: JSON round trip, path resolution, and validation that reports every problem."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

import mlora_lab.text
import mlora_lab.validate
import mlora_lab.validate.model
from mlora_lab.spec.fields import Problem, SpecError, fields_info
from mlora_lab.spec.job import MAX_COUNT, JobSpec, default_run_name
from mlora_lab.spec.outline import Outline
from mlora_lab.spec.parts import Parallel, Service
from mlora_lab.spec.tenant import Tenant, step_goal
from mlora_lab.tiny import build_tokenizer
from mlora_lab.validate import check, model_target_names, tenant_problems
from mlora_lab.validate import problems as spec_problems

LLAMA_LINEAR = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def good_spec(model: str, tmp: Path, **job: Any) -> JobSpec:
    """A spec that validates: one llama tenant with a two-row data file."""
    data = write(tmp / "a.jsonl", '{"text": "hello world"}\n{"prompt": "1 2", "completion": " 3"}\n')
    return JobSpec(base_model=model, tenants=[Tenant(name="a", data=data)], **job)


def texts(spec: JobSpec, files: bool = True) -> list[str]:
    """The spec's problems as the sentences the CLI prints."""
    return [str(p) for p in spec_problems(spec, files=files)]


def problems_text(spec: JobSpec) -> str:
    return "\n".join(texts(spec))


# ---------------------------------------------------------------------------------------------
# Dataclasses and JSON
# ---------------------------------------------------------------------------------------------


def test_json_round_trip_keeps_types():
    spec = JobSpec(
        base_model="/m",
        tenants=[
            Tenant(name="a", data="a.jsonl", betas=(0.8, 0.95), max_grad_norm=None, target_parameters=["x"]),
            Tenant(name="b", data="b.jsonl", heldout_data="b_eval.jsonl", use_rslora=True, schedule="cosine"),
        ],
        parallel=Parallel(nproc=2),
        slot_modules=["q_proj", "k_proj", "v_proj"],
        stay_up=True,
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
        base_model="./models/tiny",  # (./: a local path; "models/tiny" that does not exist reads as a Hub id)
        tokenizer="/abs/tok",
        tenants=[Tenant(name="a", data="data/a.jsonl", heldout_data="../e.jsonl", init_adapter="~/ad")],
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
    assert t.heldout_data == str(tmp_path / "e.jsonl")
    assert t.init_adapter == os.path.expanduser("~/ad")
    assert spec.tenants[0].data == "data/a.jsonl"  # resolved() returns a copy
    assert loaded.resolved(tmp_path) == loaded  # absolute paths are kept
    hub_id = JobSpec(base_model="models/tiny", tenants=[]).resolved(tmp_path / "run")
    assert hub_id.base_model == "models/tiny"  # org/name with no such directory there: a Hub id
    (tmp_path / "run" / "models" / "tiny").mkdir(parents=True)
    local = JobSpec(base_model="models/tiny", tenants=[]).resolved(tmp_path / "run")
    assert local.base_model == os.path.join(run, "models", "tiny")  # a local directory of that name wins


def test_load_then_validate(tmp_path, llama_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "job.json").write_text(
        json.dumps({"base_model": llama_path, "tenants": [{"name": "a", "data": "a.jsonl"}]})
    )
    spec = check(JobSpec.load(tmp_path / "job.json"))
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
    assert err.problems == [Problem(None, None, "first"), Problem(None, None, "second")]
    assert [str(p) for p in err.problems] == ["first", "second"]
    assert isinstance(err, ValueError)
    assert str(err).splitlines()[1:] == ["  - first", "  - second"]


def test_spec_error_keeps_structured_problems():
    rank = Problem("alice", "rank", "rank must be >= 1 (got 0)")
    err = SpecError([rank, "a plain sentence"])
    assert err.problems == [rank, Problem(None, None, "a plain sentence")]
    assert str(err).splitlines()[1:] == [
        "  - tenant 'alice': rank must be >= 1 (got 0)",
        "  - a plain sentence",
    ]
    assert SpecError(rank).problems == [rank] and SpecError("x").problems == [Problem(None, None, "x")]


def test_spec_module_imports_no_validator_and_no_model_code():
    code = (
        "import sys, mlora_lab.spec.job as s\n"
        "assert 'torch' not in sys.modules and 'mlora_lab.validate' not in sys.modules\n"
        "assert not hasattr(s, 'tenant_problems') and not hasattr(s.JobSpec, 'problems')\n"  # no shim
        "import mlora_lab.validate as v\n"
        "assert callable(v.problems) and callable(v.check) and callable(v.tenant_problems)\n"
        "assert 'torch' not in sys.modules\n"  # the validator builds the model only when a check needs it
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


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
    assert check(spec) is spec
    assert spec_problems(spec) == []
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
    ("lr0", at("tenants.0.lr", 0.0), "tenant 'a': lr must be in (0, 10] (got 0.0)"),
    ("lr_nan", at("tenants.0.lr", float("nan")), "tenant 'a': lr must be a finite number"),
    ("lr_huge", at("tenants.0.lr", 1e38), "tenant 'a': lr must be in (0, 10] (got 1e+38)"),
    (
        "wd_huge",
        at("tenants.0.weight_decay", 1e34),
        "tenant 'a': weight_decay must be in [0, 10] (got 1e+34)",
    ),
    ("eps_huge", at("tenants.0.eps", 1e300), "tenant 'a': eps must be in (0, 1] (got 1e+300)"),
    ("wd_neg", at("tenants.0.weight_decay", -0.01), "tenant 'a': weight_decay must be in [0, 10]"),
    ("beta_one", at("tenants.0.betas", (0.9, 1.0)), "tenant 'a': betas[1] must be in [0, 1)"),
    ("betas_len", at("tenants.0.betas", (0.9,)), "tenant 'a': betas must be a pair"),
    ("eps0", at("tenants.0.eps", 0), "tenant 'a': eps must be in (0, 1]"),
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
    (
        "eval_missing",
        at("tenants.0.heldout_data", lambda tmp: str(tmp / "ev.jsonl")),
        "tenant 'a': heldout_data: ",
    ),
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
    ("eval_every_neg", at("heldout_every", -1), "heldout_every must be >= 0"),
    ("save_every_neg", at("save_every", -1), "save_every must be >= 0"),
    (
        "dtype",
        at("dtype", "float64"),
        "dtype must be one of auto, float32, bfloat16, float16 (got 'float64')",
    ),
    ("stay_up_str", at("stay_up", "no"), "stay_up must be true or false"),
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
    problems = texts(spec)
    assert any(expected in p for p in problems), problems
    with pytest.raises(SpecError) as err:
        check(spec)
    assert expected in str(err.value)


def test_many_problems_are_reported_at_once(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path, dtype="fp8", seq_len=0, parallel=Parallel(nproc=2, fsdp=3))
    spec.tenants[0].rank = 0
    spec.tenants[0].lr = -1.0
    spec.tenants[0].schedule = "bogus"
    spec.tenants[0].target_modules = ["q_proj", "nope"]
    spec.tenants.append(Tenant(name="b/c", data=str(tmp_path / "missing.jsonl"), batch_size=0))
    with pytest.raises(SpecError) as err:
        check(spec)
    msg = str(err.value)
    for needle in (
        "dtype must be one of",
        "seq_len must be >= 2",
        "must divide nproc*nnodes",
        "tenant 'a': rank must be >= 1",
        "tenant 'a': lr must be in (0, 10]",
        "tenant 'a': schedule must be one of",
        "tenant 'a': target_modules not found in the model: nope",
        "tenant 'b/c': name is not a safe directory name",
        "tenant 'b/c': batch_size must be >= 1",
        "tenant 'b/c': data: ",
    ):
        assert needle in msg, msg
    assert len(err.value.problems) >= 10


def test_problems_name_their_tenant_and_field(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path, seq_len=1, parallel=Parallel(nproc=2, fsdp=3))
    spec.tenants[0].rank = 0
    spec.tenants[0].betas = (0.9, 1.0)
    spec.tenants.append(Tenant(name="b", data=str(tmp_path / "missing.jsonl")))
    spec.tenants.append(Tenant(name=7, data=spec.tenants[0].data))  # type: ignore[arg-type]
    by_key = {(p.tenant, p.field): p for p in spec_problems(spec)}
    assert by_key[("a", "rank")] == Problem("a", "rank", "rank must be >= 1 (got 0)")
    assert str(by_key[("a", "betas")]) == "tenant 'a': betas[1] must be in [0, 1) (got 1.0)"
    assert by_key[(None, "seq_len")].message == "seq_len must be >= 2 (got 1)"
    assert "must divide nproc*nnodes" in by_key[(None, "parallel.fsdp")].message
    missing = by_key[("b", "data")]
    assert missing.path == str(tmp_path / "missing.jsonl")
    assert missing.message == f"data: {tmp_path / 'missing.jsonl'}: file not found"
    # a name that is not a string keys nothing: job-wide, its message names the tenant as given
    assert by_key[(None, "name")].message == "tenant name must be a string (got 7 of type int)"


def test_empty_paths_are_named_readably(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    spec.tenants[0].data = ""
    spec.tokenizer = ""
    text = problems_text(spec)
    assert "tenant 'a': data is empty; give the path of a file" in text
    assert "tokenizer is empty; give the path of a directory" in text
    assert "of type str" not in text


def test_all_linear_with_other_names_says_what_peft_would_do(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    spec.tenants[0].target_modules = ["all-linear", "q_proj"]
    (problem,) = spec_problems(spec)
    assert (problem.tenant, problem.field) == ("a", "target_modules")
    assert problem.message == (
        "target_modules: 'all-linear' must be the only entry (got ['all-linear', 'q_proj']); with other names "
        "PEFT would read it as a module name that matches nothing"
    )
    spec.slot_modules = ["all-linear", "lm_head"]  # slot_modules never reach PEFT: the union is fine there
    spec.tenants[0].target_modules = ["all-linear"]
    assert spec_problems(spec) == []


INT_FIELDS = [
    (cls, name, info)
    for cls in (Tenant, JobSpec, Parallel)
    for name, info in fields_info(cls)
    if info.kind == "int" and info.min is not None
]


@pytest.mark.parametrize(
    ("cls", "name", "info"), INT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in INT_FIELDS]
)
def test_integer_bounds_are_the_field_metadata(tmp_path, llama_path, cls, name, info):
    """The validator checks each integer field against its FieldInfo bounds (the ones the forms show):
    the bound itself is valid, one past it is reported on that field."""
    spec = good_spec(llama_path, tmp_path)
    owner = {Tenant: spec.tenants[0], JobSpec: spec, Parallel: spec.parallel}[cls]
    label = f"parallel.{name}" if cls is Parallel else name
    hi = getattr(spec, info.at_most) if info.at_most else int(info.max)  # rank: at most max_rank

    def bound_problems(value: int) -> list[str]:
        setattr(owner, name, value)
        return [
            p.message
            for p in spec_problems(spec, files=False)
            if p.field == label and p.message.startswith(label)
        ]

    assert bound_problems(int(info.min)) == [] and bound_problems(hi) == []
    assert bound_problems(int(info.min) - 1) == [
        f"{label} must be >= {int(info.min)} (got {int(info.min) - 1})"
    ]
    (too_big,) = bound_problems(hi + 1)
    assert too_big.startswith(f"{label} must be <= ") and too_big.endswith(f" (got {hi + 1})")


def test_a_validation_cache_loads_the_tokenizer_once(tmp_path, llama_path, monkeypatch):
    import transformers

    loads = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: loads.append(a) or real(*a, **k)
    )
    spec = good_spec(llama_path, tmp_path)
    cached = mlora_lab.validate.Validator(mlora_lab.validate.ValidationCache())
    assert cached.problems(spec) == [] and cached.problems(spec) == []
    assert len(loads) == 1
    assert spec_problems(spec) == [] and len(loads) == 2  # problems() without a cache remembers nothing
    spec.tokenizer = str(tmp_path / "no_tok")  # a failure is not remembered: fixed, it is seen at once
    assert cached.problems(spec) and cached.problems(spec)
    shutil.copytree(llama_path, tmp_path / "no_tok")
    assert cached.problems(spec) == []


def test_unloadable_model_skips_model_checks_but_reports_the_rest(tmp_path):
    spec = good_spec(str(tmp_path / "nowhere"), tmp_path)
    spec.tenants[0].target_modules = ["whatever"]
    spec.tenants[0].rank = -1
    problems = texts(spec)
    assert len(problems) == 2, problems
    assert "is not a local directory" in problems[1] or "is not a local directory" in problems[0]


def test_serve_mode_allows_no_tenants(tmp_path, llama_path):
    spec = JobSpec(base_model=llama_path, tenants=[], stay_up=True)
    assert spec_problems(spec) == []


def test_a_service_round_trips_and_needs_no_tenants(tmp_path, llama_path):
    spec = JobSpec(
        base_model=llama_path, tenants=[], service=Service(host="0.0.0.0", port=8123, lora_alpha=16.0)
    )
    assert json.loads(spec.to_json())["service"] == {
        "host": "0.0.0.0",
        "port": 8123,
        "lora_alpha": 16.0,
        "max_queue": 4096,
        "session_timeout": 60.0,
        "max_step_tokens": None,
        "model_name": None,
    }
    assert (
        JobSpec.from_json(spec.to_json()) == spec
        and JobSpec.from_json(JobSpec(base_model="m", tenants=[]).to_json()).service is None
    )
    assert JobSpec(base_model="m", tenants=[], service={"port": 1}).service == Service(port=1)
    assert spec_problems(spec) == [] and default_run_name(spec) == "serve"
    with pytest.raises(SpecError, match=r"service: unknown field 'prot' \(did you mean 'port'\?\)"):
        JobSpec.from_dict({"base_model": "m", "tenants": [], "service": {"prot": 1}})


def test_every_service_problem_is_named_at_once(tmp_path, llama_path):
    bad = Service(host=3, port=70_000, lora_alpha=0.0, max_queue=0, session_timeout=0.5, max_step_tokens=0)
    spec = good_spec(llama_path, tmp_path, service=bad, parallel=Parallel(nproc=2))
    by_field = {p.field: str(p) for p in spec_problems(spec, files=False)}
    assert by_field == {
        "service.host": "service.host must be a string (got 3 of type int)",
        "service.port": "service.port must be <= 2**16 - 1 (got 70000)",
        "service.lora_alpha": "service.lora_alpha must be > 0 (got 0.0)",
        "service.max_queue": "service.max_queue must be >= 1 (got 0)",
        "service.session_timeout": "service.session_timeout must be in [1, 604800] (got 0.5)",
        "service.max_step_tokens": "service.max_step_tokens must be >= 1 (got 0)",
    }  # (nproc=2: a service runs on several processes too)
    spec.service = "yes"
    assert texts(spec, files=False) == [
        "service must be Service settings (an object) or null (got 'yes' of type str)"
    ]
    spec.service, spec.parallel = Service(port=65_535), Parallel()
    assert texts(spec) == []


def test_phi3_fused_projections(tmp_path, tiny_models):
    phi3 = tiny_models("phi3")
    spec = good_spec(phi3, tmp_path)
    spec.tenants[0].target_modules = ["qkv_proj", "gate_up_proj"]
    assert spec_problems(spec) == []
    spec.tenants[0].target_modules = ["q_proj"]
    (problem,) = texts(spec)
    assert "target_modules not found in the model: q_proj" in problem
    assert "available: down_proj, gate_up_proj, lm_head, o_proj, qkv_proj" in problem


def test_all_linear_and_full_names(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    spec.tenants[0].target_modules = ["all-linear"]
    assert spec_problems(spec) == []
    spec.tenants[0].target_modules = ["model.layers.0.self_attn.q_proj", "self_attn.v_proj"]
    assert spec_problems(spec) == []
    spec.slot_modules = ["all-linear"]
    spec.tenants.append(Tenant(name="b", data=spec.tenants[0].data, target_modules=["all-linear"]))
    assert spec_problems(spec) == []


def test_slot_modules_cover_tenants(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path, slot_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert spec_problems(spec) == []
    spec.tenants[0].target_modules = ["all-linear"]
    (problem,) = texts(spec)
    assert "target_modules all-linear not covered by slot_modules" in problem


def tiny_moe_config(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen3MoeConfig(**{**kw, **overrides})


def save_model(config: Any, out: Path) -> str:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, llama_path) -> str:
    """A tiny Qwen3-MoE model, weights included (a config-only directory is a problem)."""
    return save_model(tiny_moe_config(), tmp_path_factory.mktemp("moe"))


def test_target_parameters_are_checked(tmp_path, moe_path, llama_path):
    _, experts = model_target_names(moe_path)
    assert experts == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    spec = good_spec(moe_path, tmp_path, tokenizer=llama_path)
    spec.tenants[0].target_parameters = ["mlp.experts.up_proj"]
    (problem,) = texts(spec)
    assert (
        "target_parameters not found in the model: mlp.experts.up_proj (available: down_proj, gate_up_proj)"
        in problem
    )
    spec.tenants[0].target_parameters = ["mlp.experts.gate_up_proj", "down_proj"]
    assert spec_problems(spec) == []
    spec.tenants[0].dropout = 0.1
    assert texts(spec) == [
        "tenant 'a': dropout must be 0 with target_parameters (PEFT has no dropout on expert weights)"
    ]
    spec.tenants[0].dropout = 0.0
    spec.tenants[0].target_modules = ["gate"]  # the router is not an nn.Linear in transformers 5
    assert any("'gate' matches modules that are not nn.Linear" in p for p in texts(spec))


def test_expert_parallel_is_checked_against_the_experts(tmp_path, moe_path, llama_path):
    spec = good_spec(moe_path, tmp_path, tokenizer=llama_path)
    spec.parallel = Parallel(nproc=4, fsdp=2, ep=2)  # ep borrows from all 4 data-parallel ranks
    assert spec_problems(spec) == []
    spec.parallel = Parallel(nproc=8, ep=8)
    assert texts(spec) == ["parallel.ep = 8 does not divide the 4 experts of each MoE layer"]
    spec.parallel = Parallel(nproc=3, ep=3)
    assert texts(spec) == ["parallel.ep = 3 does not divide the 4 experts of each MoE layer"]


def test_chat_rows_need_a_chat_template(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    chat = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    spec.tenants[0].heldout_data = write(tmp_path / "chat.jsonl", chat)
    assert spec_problems(spec) == []  # the tiny tokenizer has a chat template
    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain_tok")
    spec.tokenizer = str(tmp_path / "plain_tok")
    (problem,) = texts(spec)
    assert (
        "tenant 'a': heldout_data has chat ('messages') rows but the tokenizer has no chat_template"
        in problem
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
    assert spec_problems(spec) == []


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
    shutil.copy(Path(adapter_dir) / "adapter_model.safetensors", ad)  # an empty file is now a problem
    spec = good_spec(llama_path, tmp_path)
    t = spec.tenants[0]
    t.init_adapter, t.rank, t.alpha, t.target_modules = str(ad), 16, 32, ["all-linear"]
    assert spec_problems(spec) == []


# ---------------------------------------------------------------------------------------------
# Hostile input: job files, field values, files the spec points at
# ---------------------------------------------------------------------------------------------


def job_file(content: str | bytes | None) -> Callable[[Path], str]:
    """A ``job.json`` under ``tmp`` holding ``content`` (``None``: no file at all)."""

    def make(tmp: Path) -> str:
        path = tmp / "job.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        return str(path)

    return make


def fifo(tmp: Path) -> str:
    os.mkfifo(tmp / "job.json")  # opening it would block until a writer comes: it must not be opened
    return str(tmp / "job.json")


LOAD_CASES: list[tuple[str, Callable[[Path], str], str]] = [
    ("missing", job_file(None), "job.json: not found"),
    ("directory", mkdir("job.json"), "job.json: is a directory, not a job file"),
    ("not_utf8", job_file(b'{"base_model": "\xff"}'), "job.json: not UTF-8 text (byte 0xff at position 16)"),
    (
        "bad_json",
        job_file('{"base_model": "m",\n "tenants": [}'),
        "job.json: not valid JSON (Expecting value at line 2 column 14)",
    ),
    (
        "top_level_list",
        job_file("[1, 2]"),
        "job.json: the top level must be a JSON object with base_model and tenants (got an array)",
    ),
    ("deep", job_file("[" * 100_000 + "]" * 100_000), "job.json: not valid JSON (nested too deeply)"),
    (
        "huge_int",
        job_file('{"seed": ' + "1" * 5000 + "}"),
        "job.json: not valid JSON (a number has more than 4300 digits)",
    ),
    ("fifo", fifo, "job.json: is not a regular file (a device, pipe or socket), not a job file"),
    ("dev_zero", lambda tmp: "/dev/zero", "/dev/zero: is not a regular file"),
    ("nul", lambda tmp: str(tmp / "job\0.json"), "the path contains a NUL byte"),
    ("surrogate", lambda tmp: str(tmp / "job\ud800.json"), "the path contains a lone surrogate (\\ud800)"),
]


@pytest.mark.parametrize("make, expected", [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_load_raises_one_spec_error_naming_the_file(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(SpecError) as err:
        JobSpec.load(path)
    (problem,) = map(str, err.value.problems)
    assert expected in problem
    assert problem.startswith(path) or problem.startswith(repr(path)), problem  # names the file


def test_load_accepts_a_byte_order_mark(tmp_path):
    (tmp_path / "job.json").write_bytes(
        b"\xef\xbb\xbf" + json.dumps({"base_model": "m", "tenants": []}).encode()
    )
    assert JobSpec.load(tmp_path / "job.json").tenants == []


DEEP: Any = 1
for _ in range(40):
    DEEP = [DEEP]
# Values no field should hold. Each is a way a job.json (or Python code) has broken validators.
GARBAGE_CASES: list[tuple[str, Any]] = [
    ("None", None),
    ("[]", []),
    ("{}", {}),
    ("10MB", "x" * 10_000_000),
    ("1e400", 10**400),
    ("1e5000", 10**5000),
    ("inf", float("inf")),
    ("nan", float("nan")),
    ("-1", -1),
    ("True", True),
    ("surrogate", "\ud800"),
    ("nul", "a\0b"),
    ("deep", DEEP),
    ("deep_dict", {"k": DEEP}),
    ("mixed_list", ["x", 1]),
    ("list_of_dict", [{"name": 1}]),
    ("2**63", 2**63),
]
GARBAGE = [value for _, value in GARBAGE_CASES]
GARBAGE_IDS = [name for name, _ in GARBAGE_CASES]
TENANT_FIELDS = [f for f in Tenant.__dataclass_fields__ if f != "name"]
# (field, value) pairs of GARBAGE that are valid (a list: [] is unhashable)
VALID = [
    ("heldout_data", None),
    ("init_adapter", None),
    ("rl", None),
    ("pref", None),
    ("client", None),
    ("max_grad_norm", None),
    ("target_parameters", []),
    ("use_rslora", True),
    ("shuffle", True),
    *((f, 2**63) for f in ("alpha", "max_grad_norm")),
]


def test_from_dict_raises_only_spec_error_for_any_input():
    jobs, tenants, parallels = [], [], []
    for value in GARBAGE:
        tenants += [value, {"name": value, "data": "d"}]
        tenants += [{"name": "a", "data": "d", f: value} for f in TENANT_FIELDS]
        parallels += [value] + [{f: value} for f in Parallel.__dataclass_fields__]
        jobs += [value, {"base_model": "m", "tenants": value}, {"base_model": "m", "tenants": [value]}]
        jobs += [
            {"base_model": "m", "tenants": [], f: value}
            for f in JobSpec.__dataclass_fields__
            if f != "tenants"
        ]
        jobs += [
            {"base_model": "m", "tenants": [], "parallel": {"nproc": value}},
            {value if isinstance(value, str) else "k": 1},
        ]
    for build, inputs in (
        (Tenant.from_dict, tenants),
        (Parallel.from_dict, parallels),
        (JobSpec.from_dict, jobs),
    ):
        for d in inputs:
            try:
                out = build(d)
            except SpecError as e:
                assert e.problems and all(len(str(p)) < 500 for p in e.problems), e.problems
            else:
                assert isinstance(out.to_dict(), dict)
    with pytest.raises(SpecError, match="nested more than 16 levels deep"):
        JobSpec.from_dict({"base_model": "m", "tenants": [], "seed": DEEP})
    with pytest.raises(SpecError, match=r"unknown field 'xxxxx.*\(10,000,000 characters\)"):
        Tenant.from_dict({"name": "a", "data": "d", "x" * 10_000_000: 1})
    with pytest.raises(SpecError, match="job spec is not valid JSON"):
        JobSpec.from_json(b"\xff")


@pytest.mark.parametrize("value", GARBAGE, ids=GARBAGE_IDS)
def test_problems_never_raise_and_name_the_tenant(tmp_path, llama_path, value):
    """One tenant per field, holding ``value``: every invalid one is reported with its tenant named,
    in a short message, by problems() (both modes) and tenant_problems(); nothing raises."""
    data = good_spec(llama_path, tmp_path).tenants[0].data
    tenants = []
    for i, f in enumerate(TENANT_FIELDS):
        t = Tenant(name=f"t{i}", data=data)
        setattr(t, f, value)
        tenants.append(t)
    spec = JobSpec(base_model=llama_path, tenants=[*tenants, Tenant(name=value, data=data)], max_tenants=64)
    for files in (False, True):
        problems = texts(spec, files=files)
        assert problems and not any("internal error" in p for p in problems), problems
        assert all(len(p) < 600 for p in problems), max(problems, key=len)
        for i, f in enumerate(TENANT_FIELDS):
            named = any(f"tenant 't{i}': " in p for p in problems)
            # a list is a tenant's rows held in memory: like a file's, its rows are read with the files
            rows = f in ("data", "heldout_data") and isinstance(value, list)
            assert named == ((f, value) not in VALID and (files or not rows)), (f, problems)
        if not (isinstance(value, str) and value.isalnum()):
            assert any("tenant name must be a string" in p or "name is not a safe" in p for p in problems)
    for i, t in enumerate(spec.tenants):
        own = [str(p) for p in tenant_problems(spec, t)]
        assert not any("internal error" in p for p in own), own
        if i < len(TENANT_FIELDS) and (TENANT_FIELDS[i], value) not in VALID:
            assert own and all(f"tenant 't{i}'" in p for p in own), own


def test_tenant_problems_never_raise(tmp_path, llama_path):
    bad_job = JobSpec(base_model=None, tenants="x", slot_modules=5, max_rank=[1])  # type: ignore[arg-type]
    assert tenant_problems(bad_job, Tenant(name=[1], data=3))  # type: ignore[arg-type]
    (problem,) = tenant_problems(bad_job, {"name": "a"})  # type: ignore[arg-type]
    assert str(problem) == "tenant must be a Tenant (got dict)"
    job = JobSpec(base_model=llama_path, tenants=[Tenant(name="a", data="d", target_modules=[["q_proj"]])])
    assert not any("internal error" in str(p) for p in tenant_problems(job, Tenant(name="b", data="d")))


def test_problems_without_files_reads_no_file(tmp_path, llama_path, monkeypatch):
    import mlora_lab.data

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("problems(files=False) read a file")

    # every reader, in every module of the validator that holds one (and in the data module)
    readers = ("model_info", "read_json", "safetensors_shapes", "scan_source", "target_problem")
    modules = [m for name, m in sys.modules.items() if name.startswith("mlora_lab.validate.")]
    patched = 0
    for module in [*modules, mlora_lab.data, mlora_lab.text]:
        for name in readers:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, boom)
                patched += 1
    assert patched >= 8
    spec = JobSpec(
        base_model=llama_path,
        tenants=[Tenant(name="a", data=str(tmp_path / "nope.jsonl"), init_adapter=str(tmp_path / "ad"))],
    )
    assert spec_problems(spec, files=False) == []
    assert check(spec, files=False) is spec
    spec.tenants[0].rank = 0
    spec.tenants.append(Tenant(name="A", data="x"))
    spec.parallel = Parallel(nproc=2, fsdp=3)
    problems = texts(spec, files=False)
    assert any("tenant 'a': rank must be >= 1" in p for p in problems)
    assert any("tenant 'A': name differs from 'a' only in case" in p for p in problems)
    assert any("must divide nproc*nnodes" in p for p in problems)
    with pytest.raises(SpecError):
        check(spec, files=False)
    monkeypatch.undo()
    assert any("nope.jsonl: file not found" in p for p in texts(spec))  # files=True does read


def test_names_equal_up_to_case_collide(tmp_path, llama_path):
    spec = good_spec(llama_path, tmp_path)
    data = spec.tenants[0].data
    spec.tenants = [
        Tenant(name="alice", data=data),
        Tenant(name="Alice", data=data),
        Tenant(name="bob", data=data),
    ]
    assert texts(spec) == [
        "tenant 'Alice': name differs from 'alice' only in case; their adapters/<name> directories collide on "
        "case-insensitive filesystems (macOS, Windows): rename one"
    ]
    spec.tenants.pop(1)
    assert spec_problems(spec) == []
    (problem,) = map(str, tenant_problems(spec, Tenant(name="BOB", data=data)))
    assert problem.startswith("tenant 'BOB': name differs from existing tenant 'bob' only in case")
    assert tenant_problems(spec, Tenant(name="carol", data=data)) == []


def test_memory_estimates_catch_absurd_sizes(tmp_path, llama_path, monkeypatch):
    memory, device = mlora_lab.validate.model.device_memory()
    assert memory > 0 and device in ("GPU 0", "RAM")
    monkeypatch.setattr(mlora_lab.validate.model, "device_memory", lambda: (2**30, "GPU 0"))
    spec = good_spec(llama_path, tmp_path)
    assert spec_problems(spec) == []
    # nothing is allocated for free slots or max_rank: only the tenants' own tensors count
    spec.max_tenants, spec.max_rank = 1024, 2**16
    assert spec_problems(spec) == []
    # all-linear on 2 layers: 2,048 in+out features; rank 2**16 x 2,048 x 16 bytes = 2 GiB
    spec.slot_modules = ["all-linear"]
    spec.tenants[0].target_modules, spec.tenants[0].rank = ["all-linear"], 2**16
    (problem,) = texts(spec)
    assert problem == (
        "the tenants' adapters need about 2.0 GiB per device with their gradients and AdamW state (rank x "
        "in+out features x 16 bytes, summed over tenants; the largest is tenant 'a': rank 65536 x 2,048 "
        "features) but GPU 0 has 1.0 GiB; lower ranks, target fewer layers, or start fewer tenants at once"
    )
    # the loss never holds the full logits (mlora_lab.memory): a batch whose [rows, seq, vocab] fp32
    # logits alone would take 3 GiB is no problem any more
    spec = good_spec(llama_path, tmp_path, seq_len=8192)
    spec.tenants[0].batch_size = 64
    assert spec_problems(spec) == []


def test_seed_rule_is_what_torch_and_random_accept():
    import random

    import torch

    from mlora_lab.spec.fields import MAX_SEED

    for seed in (0, MAX_SEED):
        torch.manual_seed(seed)
        torch.Generator().manual_seed(seed)
        random.Random(seed)
    with pytest.raises((RuntimeError, ValueError)):
        torch.manual_seed(2**64)


def rows_per_step(spec: JobSpec, tmp: Path) -> None:
    spec.tenants[0].batch_size, spec.tenants[0].grad_accum = 2**10, 2**11


def config_only(tmp: Path) -> str:
    from transformers import AutoConfig

    AutoConfig.from_pretrained(tmp / ".." / "llama_link").save_pretrained(tmp / "cfg_only")
    return str(tmp / "cfg_only")


def with_weights(change: Callable[[Path], None]) -> Callable[[Path], str]:
    """A copy of the tiny llama directory (linked as ``tmp/../llama_link``), then ``change(copy)``."""

    def make(tmp: Path) -> str:
        out = tmp / "model_copy"
        shutil.copytree(tmp / ".." / "llama_link", out)
        change(out)
        return str(out)

    return make


def truncate_weights(d: Path) -> None:
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])


def missing_shard(d: Path) -> None:
    os.remove(d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
    )


def bigger_tokenizer(tmp: Path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp / ".." / "llama_link")
    tok.add_tokens([f"<extra_{i}>" for i in range(8)])
    tok.add_special_tokens({"pad_token": "<extra_7>"})  # an id the job inserts, past the embedding
    tok.save_pretrained(tmp / "big_tok")
    return str(tmp / "big_tok")


def data_fifo(tmp: Path) -> str:
    os.mkfifo(tmp / "fifo.jsonl")
    return str(tmp / "fifo.jsonl")


HARDENING_CASES: list[tuple[str, Callable[[JobSpec, Path], None], str]] = [
    # integer bounds
    ("seed_negative", at("tenants.0.seed", -1), "tenant 'a': seed must be >= 0 (got -1)"),
    (
        "seed_2_63",
        at("tenants.0.seed", 2**63),
        "tenant 'a': seed must be <= 2**63 - 1 (got 9223372036854775808)",
    ),
    ("job_seed_huge", at("seed", 10**400), "seed must be <= 2**63 - 1 (got a 401-digit integer)"),
    ("max_steps_2_53", at("tenants.0.max_steps", 2**53), "tenant 'a': max_steps must be <= 2**53 - 1"),
    ("warmup_2_53", at("tenants.0.warmup_steps", 2**53), "tenant 'a': warmup_steps must be <= 2**53 - 1"),
    ("save_every_2_53", at("save_every", 2**53), "save_every must be <= 2**53 - 1"),
    ("batch_2_21", at("tenants.0.batch_size", 2**21), "tenant 'a': batch_size must be <= 2**20"),
    (
        "rows_per_step",
        rows_per_step,
        "tenant 'a': batch_size*grad_accum = 1024*2048 = 2,097,152 rows per optimizer step is more than 1,048,576",
    ),
    ("seq_len_2_25", at("seq_len", 2**25), "seq_len must be <= 2**24 (got 33554432)"),
    ("max_tenants_2_17", at("max_tenants", 2**17), "max_tenants must be <= 2**16"),
    ("nproc_2_21", at("parallel.nproc", 2**21), "parallel.nproc must be <= 2**20"),
    (
        "alpha_1e400",
        at("tenants.0.alpha", 10**400),
        "tenant 'a': alpha must be a finite number (got a 401-digit integer",
    ),
    ("lr_inf", at("tenants.0.lr", float("inf")), "tenant 'a': lr must be a finite number (got inf"),
    # paths that cannot name a file, files that are not regular files
    ("data_nul", at("tenants.0.data", "a\0b.jsonl"), "tenant 'a': data path contains a NUL byte"),
    (
        "data_surrogate",
        at("tenants.0.data", "a\ud800.jsonl"),
        "tenant 'a': data path contains a lone surrogate (\\ud800), which is not valid text",
    ),
    (
        "eval_nul",
        at("tenants.0.heldout_data", "e\0.jsonl"),
        "tenant 'a': heldout_data path contains a NUL byte",
    ),
    (
        "init_surrogate",
        at("tenants.0.init_adapter", "\udfff"),
        "tenant 'a': init_adapter path contains a lone",
    ),
    ("base_nul", at("base_model", "m\0"), "base_model path contains a NUL byte"),
    ("tokenizer_surrogate", at("tokenizer", "t\ud800"), "tokenizer path contains a lone surrogate"),
    ("output_nul", at("output_dir", "o\0"), "output_dir path contains a NUL byte"),
    ("data_dir", at("tenants.0.data", mkdir("d.jsonl")), "d.jsonl: not a regular file"),
    ("data_dev_zero", at("tenants.0.data", "/dev/zero"), "tenant 'a': data: /dev/zero: not a regular file"),
    ("data_fifo", at("tenants.0.data", data_fifo), "fifo.jsonl: not a regular file"),
    ("data_long_path", at("tenants.0.data", "x" * 10_000), "tenant 'a': data path is 10,000 characters long"),
    ("data_long_name", at("tenants.0.data", "x" * 300), "(300 characters): cannot read (File name too long)"),
    ("eval_dir", at("tenants.0.heldout_data", mkdir("e.jsonl")), "tenant 'a': heldout_data: "),
    # the base model and its tokenizer
    (
        "config_only",
        at("base_model", config_only),
        "cfg_only': no weights found (it has a config but no model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json); save the model with save_pretrained",
    ),
    (
        "truncated_weights",
        at("base_model", with_weights(truncate_weights)),
        "model.safetensors is not usable (it is truncated",
    ),
    (
        "missing_shard",
        at("base_model", with_weights(missing_shard)),
        "no weights found: model.safetensors.index.json lists shard files that are missing "
        "(model-00001-of-00002.safetensors, model-00002-of-00002.safetensors); copy every shard next to it",
    ),
    (
        "tokenizer_too_big",
        at("tokenizer", bigger_tokenizer),
        "tokenizer: pad id 519 past the model's input embedding (512 rows, vocab_size); use the model's own "
        "tokenizer",
    ),
]


@pytest.mark.parametrize(
    "mutate, expected", [c[1:] for c in HARDENING_CASES], ids=[c[0] for c in HARDENING_CASES]
)
def test_each_hostile_input_is_reported(tmp_path, llama_path, mutate, expected):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "llama_link").symlink_to(llama_path)
    spec = good_spec(llama_path, work)
    mutate(spec, work)
    problems = texts(spec)
    assert any(expected in p for p in problems), problems
    assert not any("internal error" in p or "cannot scan" in p for p in problems), problems
    with pytest.raises(SpecError) as err:
        check(spec)
    assert expected in str(err.value)


# ---------------------------------------------------------------------------------------------
# init_adapter weights against the base model
# ---------------------------------------------------------------------------------------------


def adapter_with(
    tmp: Path, adapter_dir: str, tensors: dict[str, Any] | None = None, raw: bytes | None = None
) -> str:
    """A copy of ``adapter_dir``'s config with the given tensors (or raw bytes) as its weights."""
    from safetensors.torch import save_file

    out = tmp / "ad"
    out.mkdir(exist_ok=True)
    shutil.copy(Path(adapter_dir) / "adapter_config.json", out)
    if raw is not None:
        (out / "adapter_model.safetensors").write_bytes(raw)
    else:
        save_file(tensors or {}, str(out / "adapter_model.safetensors"))
    return str(out)


def init_spec(llama_path: str, tmp: Path, init: str, **tenant: Any) -> JobSpec:
    spec = good_spec(llama_path, tmp)
    t = spec.tenants[0]
    t.init_adapter, t.rank, t.alpha, t.target_modules = init, 16, 32, ["q_proj", "v_proj"]
    for k, v in tenant.items():
        setattr(t, k, v)
    return spec


def test_init_adapter_made_on_another_base_is_reported(tmp_path, llama_path):
    """A real PEFT adapter trained on a narrower llama (hidden 32): every shape tells."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mlora_lab.tiny import build_tiny_model

    small = build_tiny_model("llama", tmp_path / "small", hidden=32)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(small),
        LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    )
    peft_model.save_pretrained(tmp_path / "small_adapter")
    assert (
        spec_problems(init_spec(small, tmp_path, str(tmp_path / "small_adapter"))) == []
    )  # on its own base: fine
    (problem,) = texts(init_spec(llama_path, tmp_path, str(tmp_path / "small_adapter")))
    assert problem == (
        "tenant 'a': init_adapter was made for another base model: model.layers.0.self_attn.q_proj.lora_A is "
        "[16, 32] but q_proj takes 64 inputs (and 7 more)"
    )


def test_init_adapter_shapes_from_the_header(tmp_path, llama_path, adapter_dir):
    import torch

    prefix = "base_model.model.model.layers.0.self_attn."
    good = {
        f"{prefix}q_proj.lora_A.weight": torch.zeros(16, 64),
        f"{prefix}q_proj.lora_B.weight": torch.zeros(64, 16),
        f"{prefix}v_proj.lora_A.weight": torch.zeros(16, 64),
        f"{prefix}v_proj.lora_B.weight": torch.zeros(32, 16),
    }
    assert spec_problems(init_spec(llama_path, tmp_path, adapter_with(tmp_path, adapter_dir, good))) == []
    wide_b = {**good, f"{prefix}v_proj.lora_B.weight": torch.zeros(128, 16)}
    (problem,) = texts(init_spec(llama_path, tmp_path, adapter_with(tmp_path, adapter_dir, wide_b)))
    assert problem.endswith(
        "init_adapter was made for another base model: model.layers.0.self_attn.v_proj.lora_B is [128, 16] but "
        "v_proj gives 32 outputs"
    )
    deeper = {
        **good,
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(16, 64),
        "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 16),
    }
    (problem,) = texts(init_spec(llama_path, tmp_path, adapter_with(tmp_path, adapter_dir, deeper)))
    assert problem == (
        "tenant 'a': init_adapter was made for another base model: it has weights for modules this base model "
        "does not have: model.layers.7.self_attn.q_proj"
    )
    rank8 = {k: (v[:8] if "lora_A" in k else v[:, :8]).contiguous() for k, v in good.items()}
    (problem,) = texts(init_spec(llama_path, tmp_path, adapter_with(tmp_path, adapter_dir, rank8)))
    assert (
        "is inconsistent: its weights have rank 8 but adapter_config.json says r=16; save it again" in problem
    )
    extra = {**good, "base_model.model.lm_head.weight": torch.zeros(2, 2)}
    (problem,) = texts(init_spec(llama_path, tmp_path, adapter_with(tmp_path, adapter_dir, extra)))
    assert (
        problem
        == "tenant 'a': init_adapter holds tensors that are not LoRA A/B weights: base_model.model.lm_head.weight"
    )


def unreadable(adapter_dir: str) -> list[tuple[str, bytes, str]]:
    import pickle

    real = (Path(adapter_dir) / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(real[:8], "little")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"  # the last one stored

    def n8(size: int) -> bytes:  # a safetensors file starts with its header's length, 8 bytes little-endian
        return size.to_bytes(8, "little")

    return [
        ("empty", b"", "it is empty"),
        ("seven_bytes", real[:7], "it is truncated (7 bytes)"),
        (
            "truncated_header",
            real[:100],
            f"it is truncated (its header needs {8 + n} bytes, the file has 100)",
        ),
        (
            "truncated_data",
            real[:-500],
            f"it is truncated (tensor '{key}' ends at byte {len(real) - 8 - n} of {len(real) - 508 - n})",
        ),
        ("pickle", pickle.dumps({"lora_A": [1.0] * 100}), "it is not a safetensors file (no valid header)"),
        ("zip", b"PK\x03\x04" + bytes(200), "it is not a safetensors file (no valid header)"),
        ("not_an_object", n8(4) + b"[1]", "it is not a safetensors file (no valid header)"),
        ("bad_json", n8(20) + b"{" * 20, "it is not a safetensors file (its header is not a JSON object)"),
        ("bad_entry", n8(19) + b'{"a": {"shape": 1}}', "it is not a safetensors file (bad header entry 'a')"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_unreadable_adapter_weights_are_a_problem_naming_the_file(tmp_path, llama_path, adapter_dir, case):
    """A truncated download, an empty file, a pickle or zip renamed to .safetensors: one problem
    naming the file, read from the header only."""
    _, raw, why = unreadable(adapter_dir)[case]
    ad = adapter_with(tmp_path, adapter_dir, raw=raw)
    weights = os.path.join(ad, "adapter_model.safetensors")
    assert texts(init_spec(llama_path, tmp_path, ad)) == [
        f"tenant 'a': init_adapter weights {weights} are not readable: {why}; save the adapter again"
    ]


def test_init_adapter_on_packed_experts(tmp_path, moe_path, llama_path):
    """PEFT's flattened expert layout (lora_A [E*r, in], lora_B [out, E*r], nested .base_layer keys)
    fits its own base and is refused on a base with narrower or more experts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mlora_lab.tiny import EXPERT_TARGETS

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_TARGETS)
    get_peft_model(AutoModelForCausalLM.from_pretrained(moe_path), config).save_pretrained(tmp_path / "ad")
    spec = good_spec(moe_path, tmp_path, tokenizer=llama_path)
    t = spec.tenants[0]
    t.init_adapter, t.rank, t.alpha = str(tmp_path / "ad"), 4, 8
    t.target_modules, t.target_parameters = ["q_proj"], list(EXPERT_TARGETS)
    assert spec_problems(spec) == []
    spec.base_model = save_model(tiny_moe_config(moe_intermediate_size=8), tmp_path / "narrow")
    (problem,) = texts(spec)
    assert problem == (
        "tenant 'a': init_adapter was made for another base model: model.layers.0.mlp.experts.lora_A is [16, 16] "
        "but experts.down_proj takes 8 inputs (and 1 more)"
    )
    spec.base_model = save_model(tiny_moe_config(num_experts=8), tmp_path / "more_experts")
    (problem,) = texts(spec)
    assert problem == (
        "tenant 'a': init_adapter was made for another base model: model.layers.0.mlp.experts.lora_A is [16, 16] "
        "but experts.down_proj has 8 experts (lora_A [8*4 = 32, 16]) (and 1 more)"
    )


# ---------------------------------------------------------------------------------------------
# Data checked with the job's tokenizer and seq_len
# ---------------------------------------------------------------------------------------------


LONG_PROMPT = "one two three four five six seven eight nine ten"


def test_data_whose_rows_all_lose_their_targets(tmp_path, llama_path):
    rows = "".join(json.dumps({"prompt": LONG_PROMPT, "completion": " yes"}) + "\n" for _ in range(3))
    path = write(tmp_path / "p.jsonl", rows)
    spec = good_spec(llama_path, tmp_path, seq_len=8)
    spec.tenants[0].data = spec.tenants[0].heldout_data = path
    assert texts(spec) == [
        f"tenant 'a': {field}: {path}: all 3 row(s) lose their target tokens when truncated to seq_len=8; "
        "raise seq_len or shorten the prompts"
        for field in ("data", "heldout_data")
    ]
    spec.seq_len = 64
    assert spec_problems(spec) == []


def test_data_check_tokenizes_only_until_a_row_keeps_a_target(tmp_path, llama_path, monkeypatch):
    import mlora_lab.data

    calls = []
    real = mlora_lab.data.tokenize_example
    monkeypatch.setattr(mlora_lab.data, "tokenize_example", lambda *a: calls.append(a) or real(*a))
    spec = good_spec(llama_path, tmp_path)
    spec.tenants[0].data = write(tmp_path / "many.jsonl", '{"text": "hello world"}\n' * 2000)
    assert spec_problems(spec) == []
    assert len(calls) == 1  # one row shows the file is usable


def test_data_that_cannot_be_tokenized_is_reported(tmp_path, llama_path):
    tok = build_tokenizer()
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "unstable_tok")
    chat = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    spec = good_spec(llama_path, tmp_path, tokenizer=str(tmp_path / "unstable_tok"))
    spec.tenants[0].data = path = write(tmp_path / "chat.jsonl", chat)
    (problem,) = texts(spec)
    assert problem.startswith(f"tenant 'a': data: {path} line 1: the chat template is not prefix-stable")


def test_outline_reads_names_and_goals_as_the_spec_does(tmp_path):
    """Views read a job file's outline (names, step goals, the run's name) without building its tenants;
    it agrees with the spec's own step_goal and default name, and it is read again once the file changes."""
    tenants = [
        {"name": "a", "data": "d.jsonl"},  # max_steps left out: Tenant's default
        {"name": "b", "data": "d.jsonl", "max_steps": 7},
        {"name": "c", "data": "d.jsonl", "max_steps": MAX_COUNT},  # the largest count: no goal
        {"name": "d", "data": None, "client": {"model_id": "m", "owner": "k"}},  # a Tinker client's: no goal
    ]
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"base_model": str(tmp_path), "tenants": tenants}))
    outline = Outline.read(path)
    spec = JobSpec.from_dict(json.loads(path.read_text()))
    assert (
        outline.goals
        == {t.name: step_goal(t) for t in spec.tenants}
        == {"a": 100, "b": 7, "c": None, "d": None}
    )
    assert outline.name == default_run_name(spec) == "a+b+c+1 more"
    assert Outline.read(path) is outline  # unchanged: remembered

    broken = [{"name": "x", "max_steps": 3}, "not a tenant", {"max_steps": 5}, {"name": 4}]
    path.write_text(json.dumps({"base_model": ".", "tenants": broken, "name": "mine", "more": 1}))
    assert Outline.read(path) == Outline("mine", {"x": 3})  # what can be read of a broken file
    path.write_text(json.dumps({"base_model": ".", "tenants": [], "serve": True}))
    assert Outline.read(path).name == "serve"
    path.write_text("[1, 2]")
    with pytest.raises(SpecError, match="top level must be a JSON object"):
        Outline.read(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (the warning: tests/spec/test_renames.py)
def test_stay_up_is_still_read_under_its_old_name_serve(tmp_path):
    """``serve`` was renamed ``stay_up`` (it competed with ``service`` and ``ml.serve``): the constructor's
    ``serve=``, the attribute and a job file's ``"serve"`` still mean it; files are written with the new name."""
    spec = JobSpec(base_model=str(tmp_path), tenants=[], serve=True)
    assert spec.stay_up is True and spec.serve is True
    spec.serve = False
    assert spec.stay_up is False
    assert "serve" not in spec.to_dict() and spec.to_dict()["stay_up"] is False
    old = {"base_model": str(tmp_path), "tenants": [], "serve": True}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(old))
    loaded = JobSpec.load(path)
    assert loaded.stay_up is True and json.loads(loaded.to_json())["stay_up"] is True
    assert not any("no tenants" in str(p) for p in spec_problems(loaded))  # no tenants: it stays up for them
    with pytest.raises(SpecError, match=r"serve .the old name of stay_up. and stay_up disagree"):
        JobSpec.from_dict({**old, "stay_up": False})
    assert JobSpec.from_dict({**old, "stay_up": True}).stay_up is True


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (the warning: tests/spec/test_renames.py)
def test_JJ1e_the_constructor_refuses_serve_and_stay_up_that_disagree(tmp_path):
    """JJ1e: ``JobSpec(serve=False, stay_up=True)`` is refused as job.json refuses the same disagreement
    (a ``stay_up`` left at its default takes ``serve``'s value; both given alike are one setting)."""
    with pytest.raises(SpecError, match=r"serve .the old name of stay_up. and stay_up disagree"):
        JobSpec(base_model=str(tmp_path), tenants=[], serve=False, stay_up=True)
    with pytest.raises(SpecError, match=r"serve .the old name of stay_up. and stay_up disagree"):
        JobSpec.from_dict({"base_model": str(tmp_path), "tenants": [], "serve": False, "stay_up": True})
    assert JobSpec(base_model=str(tmp_path), tenants=[], serve=True, stay_up=True).stay_up is True
    assert JobSpec(base_model=str(tmp_path), tenants=[], serve=False).stay_up is False
    assert JobSpec(base_model=str(tmp_path), tenants=[], serve=True).stay_up is True


def test_JJ4_ten_thousand_tenants_are_checked_without_redoing_shared_work(llama_path, tmp_path, monkeypatch):
    """JJ4: validating 10,000 tenants took a minute: each tenant's data file was scanned, and the model's
    modules walked for its target list, once per tenant. Tenants share a few files and target lists, and
    each is now worked out once per check: the work does not grow with the tenants that share it (counted
    here, not timed), and every problem is still reported, by tenant."""
    import mlora_lab.lora.targets
    import mlora_lab.validate.files

    counts = {"scans": 0, "matches": 0}
    scan = mlora_lab.validate.files._scan_data
    match = mlora_lab.lora.targets.name_matches

    def counted_scan(*a, **kw):
        counts["scans"] += 1
        return scan(*a, **kw)

    def counted_match(*a, **kw):
        counts["matches"] += 1
        return match(*a, **kw)

    monkeypatch.setattr(mlora_lab.validate.files, "_scan_data", counted_scan)
    for module in ("mlora_lab.lora.targets", "mlora_lab.validate.model", "mlora_lab.validate.context"):
        monkeypatch.setattr(f"{module}.name_matches", counted_match, raising=False)
    data = write(tmp_path / "a.jsonl", '{"text": "hello world"}\n' * 20)

    def check_tenants(n: int) -> tuple[list[str], dict[str, int]]:
        tenants = [
            Tenant(name=f"t{i}", data=data, target_modules=["q_proj", "v_proj"] if i % 2 else ["all-linear"])
            for i in range(n)
        ]
        tenants[n // 2].rank = 0
        tenants[-1].target_modules = ["nope_proj"]
        counts.update(scans=0, matches=0)
        found = texts(JobSpec(base_model=llama_path, tenants=tenants, max_tenants=8))
        return found, dict(counts)

    few, few_counts = check_tenants(10)
    many, many_counts = check_tenants(10_000)
    assert many[0] == "10000 tenants but max_tenants=8; raise max_tenants"
    assert "tenant 't5000': rank must be >= 1 (got 0)" in many
    assert any(p.startswith("tenant 't9999': target_modules not found in the model: nope_proj") for p in many)
    assert len(many) == 3, many
    assert len(few) == 3 and "tenant 't5': rank must be >= 1 (got 0)" in few
    assert many_counts == few_counts, "the shared file and target lists are worked out once per check"
    assert few_counts["scans"] == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (the warning: tests/spec/test_renames.py)
def test_JJ1e_replace_sets_stay_up_either_way(tmp_path):
    """JJ1e: ``dataclasses.replace(spec, stay_up=...)`` (how a sweep's job is made) sets ``stay_up`` either way:
    ``serve`` is the constructor's old name for it, not a field that ``replace`` passes again with the old value
    (which disagreed with the new one, and refused every sweep; before the refusal, it overrode a new False)."""
    import dataclasses

    spec = JobSpec(base_model=str(tmp_path), tenants=[])
    assert dataclasses.replace(spec, stay_up=True).stay_up is True
    assert (
        dataclasses.replace(JobSpec(base_model=str(tmp_path), tenants=[], serve=True), stay_up=False).stay_up
        is False
    )
    with pytest.raises(SpecError, match=r"serve .the old name of stay_up. and stay_up disagree"):
        JobSpec(base_model=str(tmp_path), tenants=[], serve=True, stay_up=False)
    assert spec.serve is False and JobSpec(base_model=str(tmp_path), tenants=[], serve=True).serve is True
