"""TenantForm and JobBuilder, driven the way a notebook drives them: set widget values, click buttons."""

from __future__ import annotations

import datetime
import html
import importlib
import os
import time
from pathlib import Path

import ipywidgets as W
import pytest

import mlora_lab.data
from mlora_lab.lab.forms.builders import JobBuilder, TenantForm
from mlora_lab.lab.forms.fields import LABEL_WIDTH
from mlora_lab.rundir import RunState
from mlora_lab.spec.fields import MAX_LABEL, SpecError, field_info, fields_info
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Parallel
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems as spec_problems

LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shown(widget) -> str:
    """The text of an HTML widget as the user reads it."""
    return html.unescape(widget.value)


def texts(widget: W.Widget) -> list[str]:
    """Every HTML text under ``widget``, as the user reads it."""
    out = [html.unescape(widget.value)] if isinstance(widget, W.HTML) else []
    for child in getattr(widget, "children", ()):
        out += texts(child)
    return out


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
    form.heldout_data.value = evals
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
        name="alice",
        data=train,
        heldout_data=evals,
        rank=16,
        alpha=32,
        use_rslora=True,
        dropout=0.1,
        target_modules=["k_proj", "down_proj"],
        lr=pytest.approx(1e-3),
        schedule="cosine",
        warmup_steps=5,
        max_grad_norm=None,
        max_steps=20,
        batch_size=2,
        grad_accum=3,
        seed=7,
    )
    assert form.max_grad_norm.disabled


def test_defaults_fill_the_form(llama_path, make_data):
    t = Tenant(name="bob", data=make_data("text"), rank=4, alpha=8, lr=3e-5, target_modules=["all-linear"])
    form = TenantForm(base_model=llama_path, defaults=t)
    assert form.tenant() == Tenant(**{**t.to_dict(), "lr": pytest.approx(3e-5)})


def test_data_dir_files_are_offered(llama_path, make_data, tmp_path):
    a, b = make_data("text", name="a"), make_data("chat", name="b")
    form = TenantForm(base_model=llama_path, data_dir=tmp_path)
    assert list(form.data.options) == [a, b] == list(form.heldout_data.options)


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
    assert any(problem in str(p) for p in err.value.problems)


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
    real = mlora_lab.data.scan_source
    monkeypatch.setattr(mlora_lab.data, "scan_source", lambda p: calls.append(p) or real(p))
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
    assert "already added; pick another name" in shown(form.problems_box)
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


def test_inputs_are_made_from_the_field_metadata(llama_path):
    form = TenantForm(base_model=llama_path)
    shown_fields = [name for name, info in fields_info(Tenant) if info.form]
    assert [f for f in form.fields if f != "no_clipping"] == shown_fields
    for name in shown_fields:
        info = field_info(Tenant, name)
        assert form.fields[name].description == info.label and len(info.label) <= MAX_LABEL
        assert any(info.help in t for t in texts(form.widget))  # its help line is shown
    assert isinstance(form.batch_size, W.IntText)  # unbounded: nothing is clamped silently
    form.batch_size.value = 0
    assert form.batch_size.value == 0 and "batch_size must be >= 1 (got 0)" in shown(form.problems_box)


def test_lr_is_exactly_what_is_typed(llama_path, make_data):
    form = filled_form(llama_path, make_data("text"))
    assert form.tenant().lr == 2e-4  # the default, exactly
    form.lr.value = 3e-4
    assert form.tenant().lr == 3e-4 and form.lr_slider.value == 3e-4
    form.lr_slider.value = 5e-5  # the helper snaps to 1, 2, 3, 5 x 10^k and types that value
    assert form.lr.value == 5e-5 and form.tenant().lr == 5e-5
    form.lr.value = 2.5e-4  # between two steps: kept as typed, the slider only moves near it
    assert form.tenant().lr == 2.5e-4 and form.lr_slider.value in (2e-4, 3e-4)
    assert "3e-4" in [label for label, _ in form.lr_slider.options]


def test_empty_required_fields_are_asked_for_in_plain_words(llama_path, make_data):
    form = TenantForm(base_model=llama_path)  # data not chosen yet
    text = shown(form.problems_box)
    assert "choose a training data file" in text
    assert "non-empty string" not in text and "of type" not in text
    form.name.value = ""
    assert "enter a name for this tenant" in shown(form.problems_box)
    with pytest.raises(SpecError, match="choose a training data file"):
        form.tenant()
    form.name.value = "alice"
    form.data.value = make_data("text")
    assert shown(form.problems_box).endswith("ok</span>")


def test_add_is_disabled_while_the_fields_have_problems(llama_path, make_data):
    form = TenantForm(base_model=llama_path)
    assert form.add_button.disabled
    assert form.add_button.tooltip == "fix first: choose a training data file"
    form.data.value = make_data("text")
    assert not form.add_button.disabled
    form.batch_size.value = 0
    form.max_steps.value = 0
    assert form.add_button.disabled
    assert form.add_button.tooltip.startswith("fix first: batch_size must be >= 1") and "(and 1 more)" in (
        form.add_button.tooltip
    )


def test_a_stale_message_goes_when_the_fields_change(llama_path, make_data):
    form = filled_form(llama_path, make_data("text"))
    form.name.value = "a/b"
    form.add_button.click()  # a click that reaches the handler although the button is disabled
    assert "not added" in shown(form.message)
    form.name.value = "bob"
    assert shown(form.message) == ""
    form.add_button.click()
    assert "added 'bob'" in shown(form.message)
    form.rank.value = 4
    assert shown(form.message) == ""


def test_pressing_add_twice_adds_no_clone(llama_path, make_data):
    form = filled_form(llama_path, make_data("text"))
    form.add_button.click()
    assert form.name.value == "alice-2" and form.add_button.disabled
    assert "'alice' is already added with these settings" in form.add_button.tooltip
    form.add_button.click()
    assert [t.name for t in form.tenants] == ["alice"]
    assert "'alice' is already added with these settings; change a field" in shown(form.message)
    with pytest.raises(SpecError, match="already added with these settings"):
        form.add()
    form.rank.value = 16  # a changed configuration gets the new name
    assert not form.add_button.disabled
    form.add_button.click()
    assert [t.name for t in form.tenants] == ["alice", "alice-2"] and form.tenants[1].rank == 16
    form.remove("alice-2")  # its settings may be added again once it is gone
    assert not form.add_button.disabled


def test_all_linear_with_named_modules_says_what_it_cleared(llama_path, make_data):
    form = filled_form(llama_path, make_data("text"))
    form.target_modules.value = ("all-linear", "q_proj", "v_proj")
    assert form.target_modules.value == ("all-linear",)
    assert "other names were cleared" in shown(form.target_modules_note)
    form.target_modules.value = ("all-linear", "o_proj")
    assert form.target_modules.value == ("o_proj",)
    assert "all-linear was cleared" in shown(form.target_modules_note)
    form.target_modules.value = ("o_proj", "k_proj")
    assert shown(form.target_modules_note) == ""
    # A tenant from job.json that mixes them is shown as it is, with the validator's problem.
    form.load(Tenant(name="mixed", data=form.data.value, target_modules=["all-linear", "q_proj"]))
    assert form.target_modules.value == ("all-linear", "q_proj")
    assert "'all-linear' must be the only entry" in shown(form.problems_box)


def test_data_files_of_runs_are_not_offered(llama_path, tmp_path):
    (tmp_path / "sub").mkdir()
    good = [str(tmp_path / "a.jsonl"), str(tmp_path / "sub" / "b.jsonl")]
    run = tmp_path / "runs" / "20250101-000000-abcd"
    (run / "control").mkdir(parents=True)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    bad = [
        run / "metrics.jsonl",
        run / "control" / "results.jsonl",
        tmp_path / ".ipynb_checkpoints" / "a-checkpoint.jsonl",
    ]
    for path in [*map(Path, good), *bad]:
        path.write_text('{"text": "x"}\n')
    (run / "job.json").write_text("{}")
    form = TenantForm(base_model=llama_path, data_dir=tmp_path)
    assert list(form.data.options) == good


def test_the_same_problem_of_several_data_files_is_one_line(llama_path, tmp_path):
    for name in ("e1", "e2"):
        (tmp_path / f"{name}.jsonl").write_text("")
    form = filled_form(llama_path, str(tmp_path / "e1.jsonl"))
    form.heldout_data.value = str(tmp_path / "e2.jsonl")
    assert len(form.problems()) == 2
    text = shown(form.problems_box)
    assert "1 problem" in text
    assert (
        f"{tmp_path / 'e1.jsonl'} (data), {tmp_path / 'e2.jsonl'} (heldout_data): empty file (no rows)"
        in text
    )


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
    builder.heldout_every.value = 5
    builder.save_every.value = 10
    builder.nproc.value = 2
    builder.fsdp.value = 2
    spec = builder.spec()
    assert spec.tenants == builder.form.tenants and spec.tenants[0].name == "alice"
    assert (spec.seq_len, spec.max_tenants, spec.max_rank, spec.dtype) == (32, 3, 16, "bfloat16")
    assert (spec.heldout_every, spec.save_every) == (5, 10)
    assert spec.parallel == Parallel(nproc=2, fsdp=2)
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec_problems(spec) == [] and builder.problems() == []
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
    assert "parallel.ep = 2, but the model has no packed" in " ".join(
        map(str, builder.problems())
    )  # llama: dense
    builder.tp.value = 2  # fsdp and ep now divide the 2 data-parallel ranks
    assert list(builder.fsdp.options) == [1, 2] and list(builder.ep.options) == [1, 2]
    assert builder.spec().parallel == Parallel(nproc=4, fsdp=1, tp=2, ep=2)
    builder.ep.value = 1
    # llama has a TP plan and 2 kv heads
    assert not [p for p in builder.problems() if (p.field or "").startswith("parallel")]


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


def test_job_settings_are_made_from_the_field_metadata(llama_path):
    builder = JobBuilder(base_model=llama_path)
    for name, info in fields_info(JobSpec):
        if info.form:
            widget = builder.fields[name]
            assert widget.description == info.label and len(info.label) <= MAX_LABEL
            assert widget.style.description_width == LABEL_WIDTH
    assert builder.save_every.description == "save every"  # it was "save_every (0=end)", cut off
    assert any("0 = only at the end" in t for t in texts(builder.widget))
    assert builder.nproc.description == field_info(Parallel, "nproc").label


def test_out_of_range_job_settings_are_kept_and_reported(llama_path, make_data):
    builder = builder_with_tenant(llama_path, make_data("text"))
    assert not builder.launch_button.disabled
    builder.seq_len.value = 1
    assert builder.seq_len.value == 1 and builder.spec().seq_len == 1  # as typed, not clamped to 2
    assert "seq_len must be >= 2 (got 1)" in shown(builder.problems_box)
    assert builder.launch_button.disabled
    builder.max_rank.value = 0
    assert "max_rank must be >= 1 (got 0)" in shown(builder.problems_box)
    assert builder.form.max_rank == 64  # the form keeps the last usable bound


def test_one_line_names_every_tenant_with_the_same_data_problem(llama_path, make_data, tmp_path):
    a, b = make_data("text", name="a"), make_data("text", name="b")
    spec = JobSpec(base_model=llama_path, tenants=[Tenant(name="alice", data=a), Tenant(name="bob", data=b)])
    builder = JobBuilder(base_model=llama_path, defaults=spec)
    os.remove(a)
    os.remove(b)
    builder.refresh_button.click()
    text = shown(builder.problems_box)
    assert "1 problem" in text
    assert f"{a} (tenant 'alice' data), {b} (tenant 'bob' data): file not found" in text


class FakeRun:
    """What JobBuilder reads of a Run: its path, state and error."""

    def __init__(self, path: Path) -> None:
        self.path, self.state, self.error = path, RunState.STARTING, None

    @property
    def status(self) -> RunState:
        return self.state


def test_status_follows_the_run_without_a_click(llama_path, make_data, tmp_path, monkeypatch):
    run = FakeRun(tmp_path / "runs" / "r1")
    launched = []
    monkeypatch.setattr(
        importlib.import_module("mlora_lab.lab.launch"),
        "launch",
        lambda spec, workdir: launched.append(spec) or run,
    )
    builder = builder_with_tenant(llama_path, make_data("text"))
    builder.refresh_s = 0.02
    try:
        builder.launch_button.click()
        assert builder.run is run and launched and builder.watching
        assert "starting" in shown(builder.status) and builder.launch_button.disabled

        def wait_for(text: str) -> None:
            deadline = time.monotonic() + 10
            while text not in shown(builder.status) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert text in shown(builder.status)

        run.state = RunState.RUNNING
        wait_for("running")
        run.state = RunState.FINISHED
        wait_for("finished")
        builder._watcher.join(5)
        assert not builder.watching  # a final state ends the thread
        assert not builder.launch_button.disabled
    finally:
        builder.stop_watching()
    assert not builder.watching


def test_stop_watching_ends_the_status_thread(llama_path, make_data, tmp_path, monkeypatch):
    run = FakeRun(tmp_path / "runs" / "r1")
    monkeypatch.setattr(importlib.import_module("mlora_lab.lab.launch"), "launch", lambda spec, workdir: run)
    builder = builder_with_tenant(llama_path, make_data("text"))
    builder.refresh_s = 0.02
    builder.launch()
    assert builder.watching
    builder.stop_watching()
    assert not builder.watching
    run.state = RunState.RUNNING
    time.sleep(0.1)
    assert "starting" in shown(builder.status)  # no longer followed...
    builder.refresh_button.click()
    assert "running" in shown(builder.status)  # ...but the button still reads it


@pytest.mark.slow
def test_launch_button_runs_a_tiny_job(llama_path, make_data, tmp_path):
    builder = builder_with_tenant(llama_path, make_data("text"), workdir=tmp_path / "runs")
    builder.launch_button.click()
    run = builder.run
    assert run is not None and run.path.parent == (tmp_path / "runs").absolute()
    assert builder.launch_button.disabled or run.status not in ("starting", "running")
    assert run.wait(timeout=240) == "finished", run.logs(rank=None) + run.logs(0)
    deadline = time.monotonic() + 10  # the status line follows the run by itself
    while "finished" not in shown(builder.status) and time.monotonic() < deadline:
        time.sleep(0.1)
    builder.stop_watching()
    assert "finished" in shown(builder.status) and not builder.launch_button.disabled
    assert run.adapter_path("alice").is_dir()


# -- file chooser and upload ------------------------------------------------------------------------


def test_the_file_chooser_browses_folders_and_fills_the_input(llama_path, make_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_data("text", name="a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.parquet").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / ".hidden.jsonl").write_text("")
    form = TenantForm(base_model=llama_path, data_dir=tmp_path)
    chooser = form._inputs["data"].chooser
    assert chooser.box.layout.display == "none"
    form.data_browse.value = True
    assert chooser.box.layout.display == ""
    labels = [label for label, _ in chooser.entries.options]
    assert labels == ["📁 ..", "📁 sub", "📄 a.jsonl"]  # folders, then data files; no text or hidden file
    chooser.entries.value = str(tmp_path / "sub")  # a folder opens
    assert chooser.folder == tmp_path / "sub" and "📄 b.parquet" in [lb for lb, _ in chooser.entries.options]
    chooser.entries.value = str(tmp_path)  # ".." goes up
    chooser.entries.value = str(
        tmp_path / "a.jsonl"
    )  # a file fills the input (relative to the cwd) and closes
    assert form.data.value == "a.jsonl" and form.tenant().data == "a.jsonl"
    assert chooser.box.layout.display == "none" and not form.data_browse.value


def test_a_folder_chooser_uses_the_folder_it_shows(tmp_path, monkeypatch):
    from mlora_lab.lab.forms.fields import FileChooser

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    target = W.Text()
    chooser = FileChooser(target, tmp_path, want_dir=True)
    assert chooser.upload is None  # a folder is not uploaded
    chooser.show(True)
    chooser.entries.value = str(tmp_path / "models")
    chooser.entries.value = str(tmp_path / "models" / "tiny")
    chooser.use.click()
    assert target.value == os.path.join("models", "tiny")


def upload(widget: W.FileUpload, name: str, content: bytes) -> None:
    """What the browser sends when a file is picked in the upload button."""
    widget.value = (
        {
            "name": name,
            "type": "",
            "size": len(content),
            "content": memoryview(content),
            "last_modified": datetime.datetime.now(datetime.timezone.utc),
        },
    )


def test_upload_saves_into_the_data_folder_never_over_another_file(llama_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    form = TenantForm(base_model=llama_path, data_dir=tmp_path / "data")
    rows = b'{"text": "hello"}\n'
    upload(form.data_upload, "../my data (1).jsonl", rows)  # a path and odd characters: only a safe name
    saved = tmp_path / "data" / "my_data_1_.jsonl"
    assert saved.read_bytes() == rows and form.data.value == os.path.join("data", "my_data_1_.jsonl")
    assert form.data_upload.value == ()  # ready for the next file
    upload(form.data_upload, "my data (1).jsonl", rows)  # the same file again: the same path
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["my_data_1_.jsonl"]
    upload(form.data_upload, "my data (1).jsonl", b'{"text": "other"}\n')  # other content: never over it
    assert (
        saved.read_bytes() == rows
        and (tmp_path / "data" / "my_data_1_-2.jsonl").read_bytes() == b'{"text": "other"}\n'
    )
    assert form.data.value == os.path.join("data", "my_data_1_-2.jsonl")
    upload(form.data_upload, "run.sh", b"rm -rf /")  # not a data file: said, nothing written
    chooser = form._inputs["data"].chooser
    assert "not a data file" in shown(chooser.message) and not (tmp_path / "data" / "run.sh").exists()
    assert form.data.value == os.path.join("data", "my_data_1_-2.jsonl")
