"""TenantForm and JobBuilder, driven the way a notebook drives them: set widget values, click buttons."""

from __future__ import annotations

import html

import pytest

import mlora_lab.data
from mlora_lab.spec import JobSpec, Parallel, SpecError, Tenant
from mlora_lab.widgets import JobBuilder, TenantForm

LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shown(widget) -> str:
    """The text of an HTML widget as the user reads it."""
    return html.unescape(widget.value)


def filled_form(base: str, data: str, **kw) -> TenantForm:
    form = TenantForm(base_model=base, **kw)
    form.name.value = "alice"
    form.data.value = data
    return form


# -- TenantForm -----------------------------------------------------------------------------------


def test_targets_are_the_models_linear_layers(llama_path):
    form = TenantForm(base_model=llama_path)
    assert form.linear_names == LLAMA_LINEAR
    assert list(form.target_modules.options) == ["all-linear", *LLAMA_LINEAR]
    assert form.target_modules.value == ("q_proj", "v_proj")
    assert form.rank.value == 8 and form.lr.value == pytest.approx(2e-4)
    bundle = form._repr_mimebundle_()  # a bare `form` in a cell shows the widget
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == form.widget.model_id


def test_fused_architecture_offers_its_own_names(tiny_models):
    form = TenantForm(base_model=tiny_models("phi3"))
    names = form.linear_names
    assert {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"} == set(names)
    assert "lm_head" not in form.target_modules.options
    assert form.target_modules.value == tuple(names[:2])  # no q_proj/v_proj: the first two


def test_fields_make_the_matching_tenant(llama_path, make_data):
    train, evals = make_data("text"), make_data("reverse", name="held_out")
    form = filled_form(llama_path, train)
    form.eval_data.value = evals
    form.rank.value = 16
    form.alpha.value = 32
    form.use_rslora.value = True
    form.dropout.value = 0.1
    form.target_modules.value = ("k_proj", "down_proj")
    form.lr.value = 1e-3
    form.schedule.value = "cosine"
    form.warmup_steps.value = 5
    form.no_clipping.value = True
    form.max_steps.value = 20
    form.batch_size.value = 2
    form.grad_accum.value = 3
    form.seed.value = 7
    assert shown(form.problems_box).endswith("ok</span>")
    t = form.tenant()
    assert t == Tenant(
        name="alice", data=train, eval_data=evals, rank=16, alpha=32, use_rslora=True, dropout=0.1,
        target_modules=["k_proj", "down_proj"], lr=pytest.approx(1e-3), schedule="cosine", warmup_steps=5,
        max_grad_norm=None, max_steps=20, batch_size=2, grad_accum=3, seed=7,
    )  # fmt: skip
    assert form.max_grad_norm.disabled


def test_defaults_fill_the_form(llama_path, make_data):
    t = Tenant(name="bob", data=make_data("text"), rank=4, alpha=8, lr=3e-5, target_modules=["all-linear"])
    form = TenantForm(base_model=llama_path, defaults=t)
    assert form.tenant() == Tenant(**{**t.to_dict(), "lr": pytest.approx(3e-5)})


def test_data_dir_files_are_offered(llama_path, make_data, tmp_path):
    a, b = make_data("text", name="a"), make_data("chat", name="b")
    form = TenantForm(base_model=llama_path, data_dir=tmp_path)
    assert list(form.data.options) == [a, b] == list(form.eval_data.options)


def test_all_linear_excludes_the_other_targets(llama_path):
    form = TenantForm(base_model=llama_path)
    form.target_modules.value = ("all-linear", "q_proj", "v_proj")
    assert form.target_modules.value == ("all-linear",)
    form.target_modules.value = ("all-linear", "o_proj")
    assert form.target_modules.value == ("o_proj",)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("name", "a/b", "name is not a safe directory name"),
        ("data", "missing.jsonl", "missing.jsonl: file not found"),
        ("max_grad_norm", -1.0, "max_grad_norm must be > 0"),
        ("target_modules", (), "nothing to adapt"),
    ],
)
def test_invalid_field_is_shown_inline_and_raises(llama_path, make_data, field, value, problem):
    form = filled_form(llama_path, make_data("text"))
    getattr(form, field).value = value
    assert problem in shown(form.problems_box)
    with pytest.raises(SpecError) as err:
        form.tenant()
    assert any(problem in p for p in err.value.problems)


def test_rank_above_max_rank_is_kept_and_reported(llama_path, make_data):
    t = Tenant(name="big", data=make_data("text"), rank=100)
    form = TenantForm(base_model=llama_path, defaults=t, max_rank=64)
    assert form.rank.value == 100  # not clamped silently
    assert "rank must be <= max_rank=64 (got 100)" in shown(form.problems_box)
    with pytest.raises(SpecError, match="max_rank=64"):
        form.tenant()
    form.rank.value = 32
    assert form.rank.max == 64 and form.tenant().rank == 32


def test_data_file_is_scanned_only_when_it_changes(llama_path, make_data, monkeypatch):
    calls = []
    real = mlora_lab.data.scan_jsonl
    monkeypatch.setattr(mlora_lab.data, "scan_jsonl", lambda p: calls.append(p) or real(p))
    path = make_data("text")
    form = filled_form(llama_path, path)
    n = len(calls)
    assert n >= 1
    form.rank.value = 4
    form.name.value = "alicia"
    form.lr.value = 1e-3
    assert len(calls) == n  # other fields (even the name) re-validate from the cache
    with open(path, "a") as fh:
        fh.write("not json\n")
    form.rank.value = 5
    assert len(calls) == n + 1 and "not valid JSON" in shown(form.problems_box)


def test_add_remove_and_duplicate_names(llama_path, make_data):
    form = filled_form(llama_path, make_data("text"))
    form.add_button.click()
    assert [t.name for t in form.tenants] == ["alice"]
    assert form.name.value == "alice-2"  # moved on, ready for the next tenant
    assert "alice" in shown(form.table) and "added 'alice'" in shown(form.message)

    form.name.value = "alice"
    assert "'alice' is already added" in shown(form.problems_box)
    form.add_button.click()
    assert len(form.tenants) == 1 and "not added" in shown(form.message)
    with pytest.raises(SpecError, match="already added"):
        form.add()

    form.name.value = "a/b"
    form.add_button.click()
    assert len(form.tenants) == 1 and "safe directory name" in shown(form.message)

    form.name.value = "carol"
    form.rank.value = 4
    form.add_button.click()
    assert [t.name for t in form.tenants] == ["alice", "carol"]
    form.selected.value = "alice"
    form.remove_button.click()
    assert [t.name for t in form.tenants] == ["carol"] and "alice" not in shown(form.table)
    form.selected.value = "carol"
    form.load_button.click()
    assert form.name.value == "carol" and form.rank.value == 4


# -- JobBuilder -----------------------------------------------------------------------------------


def builder_with_tenant(llama_path: str, data: str, **kw) -> JobBuilder:
    form = filled_form(llama_path, data)
    form.max_steps.value = 2
    form.batch_size.value = 2
    form.add()
    builder = JobBuilder(base_model=llama_path, form=form, **kw)
    builder.seq_len.value = 32
    return builder


def test_job_builder_spec_round_trips(llama_path, make_data, tmp_path):
    builder = builder_with_tenant(llama_path, make_data("text"), workdir=tmp_path / "runs", max_nproc=4)
    builder.max_tenants.value = 3
    builder.max_rank.value = 16
    builder.dtype.value = "bfloat16"
    builder.eval_every.value = 5
    builder.save_every.value = 10
    builder.nproc.value = 2
    builder.fsdp.value = 2
    spec = builder.spec()
    assert spec.tenants == builder.form.tenants and spec.tenants[0].name == "alice"
    assert (spec.seq_len, spec.max_tenants, spec.max_rank, spec.dtype) == (32, 3, 16, "bfloat16")
    assert (spec.eval_every, spec.save_every) == (5, 10)
    assert spec.parallel == Parallel(nproc=2, fsdp=2)
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec.problems() == [] and builder.problems() == []
    assert '"max_rank": 16' in shown(builder.preview)

    again = JobBuilder(base_model=llama_path, defaults=spec, max_nproc=4)
    assert again.spec() == spec


def test_fsdp_options_follow_nproc(llama_path):
    builder = JobBuilder(base_model=llama_path, max_nproc=8)
    assert list(builder.fsdp.options) == [1]
    builder.nproc.value = 6
    assert list(builder.fsdp.options) == [1, 2, 3, 6]
    builder.fsdp.value = 3
    builder.nproc.value = 3
    assert list(builder.fsdp.options) == [1, 3] and builder.fsdp.value == 3  # kept: still a divisor
    builder.ep.value = 3
    builder.nproc.value = 4
    assert builder.fsdp.value == 1 and builder.ep.value == 1
    builder.ep.value = 2
    assert builder.spec().parallel == Parallel(nproc=4, fsdp=1, ep=2)
    assert "parallel.ep = 2, but the model has no packed" in " ".join(builder.problems())  # llama: dense
    builder.tp.value = 2  # fsdp and ep now divide the 2 data-parallel ranks
    assert list(builder.fsdp.options) == [1, 2] and list(builder.ep.options) == [1, 2]
    assert builder.spec().parallel == Parallel(nproc=4, fsdp=1, tp=2, ep=2)
    builder.ep.value = 1
    assert not [p for p in builder.problems() if "parallel" in p]  # llama has a TP plan and 2 kv heads


def test_launch_is_disabled_while_the_spec_has_problems(llama_path, make_data):
    builder = JobBuilder(base_model=llama_path)
    assert builder.launch_button.disabled  # no tenants yet
    assert "Add tenant" in shown(builder.problems_box)

    form = builder.form
    form.name.value = "alice"
    form.data.value = make_data("text")
    form.rank.value = 16
    form.add_button.click()
    assert not builder.launch_button.disabled and "ready to launch" in shown(builder.problems_box)

    builder.max_rank.value = 8  # reaches the form too
    assert form.max_rank == 8
    assert builder.launch_button.disabled
    assert "tenant 'alice': rank must be <= max_rank=8 (got 16)" in shown(builder.problems_box)
    builder.max_rank.value = 16
    assert not builder.launch_button.disabled

    builder.max_tenants.value = 1
    form.name.value = "bob"
    form.add_button.click()
    assert builder.launch_button.disabled and "max_tenants=1" in shown(builder.problems_box)
    form.remove("bob")
    assert not builder.launch_button.disabled


def test_form_for_another_model_is_refused(llama_path, tiny_models):
    with pytest.raises(ValueError, match="base_model"):
        JobBuilder(base_model=tiny_models("phi3"), form=TenantForm(base_model=llama_path))


@pytest.mark.slow
def test_launch_button_runs_a_tiny_job(llama_path, make_data, tmp_path):
    builder = builder_with_tenant(llama_path, make_data("text"), workdir=tmp_path / "runs")
    builder.launch_button.click()
    run = builder.run
    assert run is not None and run.path.parent == (tmp_path / "runs").absolute()
    assert builder.launch_button.disabled or run.status not in ("starting", "running")
    assert run.wait(timeout=240) == "finished", run.logs(rank=None) + run.logs(0)
    builder.refresh_button.click()
    assert "finished" in shown(builder.status) and not builder.launch_button.disabled
    assert run.adapter_path("alice").is_dir()
