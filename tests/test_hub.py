"""Hub ids for base_model, tokenizer and init_adapter (mlora_lab.hub), against a loopback Hub (tests/hub_server.py).

``huggingface_hub`` talks to the loopback server through ``HF_ENDPOINT`` and writes its cache as it writes the
Hub's (``HF_HOME``): the download path and the cache layout are both the library's own.

- validation gives three distinct answers, each naming the id: not on the Hub, gated, offline and not cached
  (and a revision that does not exist); a gated model downloads with ``HF_TOKEN``;
- a local directory of the same name wins (relative to the job file, as the spec's paths are);
- validation downloads once: the job's processes read the cache (every file fetched once however many
  checks and trainers), the adapters record the id as their base, and ``init_adapter`` may be an id too;
- offline (``HF_HUB_OFFLINE``) a cached id still validates and trains;
- a launched job (torchrun) records the commit it read and trains with the Hub unreachable;
- a tenant's data may be a Hub dataset (``ml.HubDataset``, through ``datasets.load_dataset``): it trains as the
  same rows from a file, the three answers name it, job.json holds it until a launch writes its rows;
- a Hub that misbehaves is one problem naming the id and what was wrong, in bounded time: one that never answers
  (the timeout named), one that cannot be reached (the ways out named, no retries), a download cut short, file
  names that leave the repository (nothing written outside the cache), a revision that is no revision; a push
  that cannot reach the Hub is one line from the CLI.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from conftest import task_rows, write_jsonl
from hub_server import HubServer, Repo, SilentHub, closed_port, repo_from_folder

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems

TOKEN = "hf_loopback_token"


@pytest.fixture
def hub(tiny_models, tmp_path, monkeypatch):
    """A loopback Hub with ``org/tiny`` (a tiny llama), ``org/gated`` (the same, gated) and ``org/adapter``
    (a PEFT adapter of it), and an empty Hub cache in ``tmp_path/hf``."""
    import huggingface_hub.constants

    base = tiny_models("llama")
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(
        tmp_path / "adapter"
    )
    rows = parquet_splits(train=task_rows("reverse", 8), test=task_rows("reverse", 3))
    repos = {
        "org/tiny": repo_from_folder(base),
        "org/gated": repo_from_folder(base, gated=True),
        "org/adapter": repo_from_folder(tmp_path / "adapter"),
        "datasets/org/rows": Repo(rows),
        "datasets/org/gated-rows": Repo(rows, gated=True),
    }
    with HubServer(repos, token=TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        importlib.reload(huggingface_hub.constants)  # (it reads the variables at import)
        import huggingface_hub.hf_api

        # (and the module-level HfApi behind huggingface_hub.file_exists, which PEFT calls, is made at import)
        monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", server.url)
        import datasets.config  # (read at import too: its endpoint, cache and offline switch)

        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", server.url)
        monkeypatch.setattr(
            datasets.config, "HUB_DATASETS_URL", server.url + "/datasets/{repo_id}/resolve/{revision}/{path}"
        )
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        server.base = base
        try:
            yield server
        finally:
            monkeypatch.undo()
            importlib.reload(huggingface_hub.constants)


def parquet_splits(**splits: list[dict]) -> dict[str, bytes]:
    """A dataset repository's files as the Hub's parquet layout names them: ``data/<split>-00000-of-00001.parquet``."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    for split, rows in splits.items():
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        files[f"data/{split}-00000-of-00001.parquet"] = buffer.getvalue()
    return files


def tenant(make_data, **kw) -> Tenant:
    return Tenant(name="a", data=make_data("reverse"), rank=4, alpha=8, target_modules=["q_proj", "v_proj"],
                  lr=5e-3, batch_size=2, max_steps=2, **kw)  # fmt: skip


def messages(spec: JobSpec) -> list[str]:
    return [p.message for p in problems(spec)]


def test_three_distinct_answers_each_naming_the_id(hub, make_data, monkeypatch):
    t = tenant(make_data)
    (missing,) = messages(JobSpec(base_model="org/missing", tenants=[t]))
    assert "base_model org/missing is not on the Hub" in missing and "HF_TOKEN" in missing
    (gated,) = messages(JobSpec(base_model="org/gated", tenants=[t]))
    assert "base_model org/gated is a gated model on the Hub" in gated and "HF_TOKEN" in gated
    (revision,) = messages(JobSpec(base_model="org/tiny", revision="v9", tenants=[t]))
    assert "org/tiny has no revision 'v9'" in revision
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (offline,) = messages(JobSpec(base_model="org/tiny", tenants=[t]))
    assert "base_model org/tiny is not in the Hub cache" in offline and "HF_HUB_OFFLINE is set" in offline
    assert hub.requests == {}, "nothing was downloaded"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert messages(JobSpec(base_model="org/gated", tenants=[t])) == []  # (with a token: downloaded)


def test_a_local_directory_of_the_same_name_wins(hub, make_data, tmp_path):
    local = tmp_path / "job" / "org" / "tiny"
    local.mkdir(parents=True)
    spec = JobSpec(base_model="org/tiny", tenants=[tenant(make_data)]).resolved(tmp_path / "job")
    assert spec.base_model == str(local)
    elsewhere = JobSpec(base_model="org/tiny", tenants=[tenant(make_data)]).resolved(tmp_path)
    assert elsewhere.base_model == "org/tiny"  # (no such directory there: the Hub id)


def test_validation_downloads_once_and_the_job_reads_the_cache(hub, make_data, tmp_path, monkeypatch):
    spec = JobSpec(
        base_model="org/tiny",
        tenants=[tenant(make_data, init_adapter="org/adapter")],
        seq_len=32,
    )
    assert messages(spec) == [] and messages(spec) == []
    downloaded = dict(hub.requests)
    assert downloaded[("org/tiny", "model.safetensors")] == 1
    assert downloaded[("org/adapter", "adapter_model.safetensors")] == 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the job never asks the Hub
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    start = trainer.model.tenant_tensors("a")
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hub.base), str(tmp_path / "adapter")
    )
    q = dict(reference.named_parameters())[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    ]
    assert torch.equal(start["model.layers.0.self_attn.q_proj"][0], q.detach()), "init_adapter from the Hub"
    trainer.train()
    assert hub.requests == downloaded
    saved = json.loads((tmp_path / "run" / "adapters" / "a" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "org/tiny"
    assert messages(spec) == [], "offline, the cached id validates"


def test_a_launched_job_records_the_commit_and_trains_from_the_cache(hub, make_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = JobSpec(base_model="org/tiny", tenants=[tenant(make_data)], seq_len=32)
    run = ml.launch(spec, workdir=tmp_path / "runs")
    try:
        assert run.wait(timeout=300).value == "finished", run.logs()
    finally:
        run.stop()
    recorded = json.loads(Path(run.path, "job.json").read_text())
    assert recorded["base_model"] == "org/tiny" and recorded["revision"] == hub.repos["org/tiny"].sha
    assert hub.requests[("org/tiny", "model.safetensors")] == 1
    assert (
        json.loads((run.adapter_path("a") / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "org/tiny"
    )


def test_push_to_hub_uploads_an_adapter_peft_loads_by_name(hub, make_data, tmp_path, monkeypatch):
    """``run.push_to_hub`` makes a private repository and commits the adapter; PEFT loads it from the Hub by
    its id and gives the saved weights; the CLI's ``push --public`` makes a public one; without a token
    the Hub refuses (and nothing is made)."""
    import subprocess
    import sys

    from mlora_lab.lab.runs.run import Run

    Trainer(
        JobSpec(base_model=hub.base, tenants=[tenant(make_data)], seq_len=32), run_dir=tmp_path / "run"
    ).train()
    run = Run(tmp_path / "run")
    with pytest.raises(Exception, match=r"401|credentials|token"):
        run.push_to_hub("a", "me/adapter-a")
    assert "me/adapter-a" not in hub.repos
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    url = run.push_to_hub("a", "me/adapter-a")
    assert "me/adapter-a" in url and hub.private["me/adapter-a"] is True
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(hub.repos["me/adapter-a"].files)
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hub.base), "me/adapter-a"
    )
    ours = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hub.base), str(run.adapter_path("a"))
    )
    theirs = dict(loaded.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters() if "lora_" in n)
    done = subprocess.run(
        [sys.executable, "-m", "mlora_lab.lab.cli", "push", str(tmp_path / "run"), "a", "me/public-a", "--public"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert hub.private["me/public-a"] is False and "me/public-a" in done.stdout


def test_a_served_job_answers_to_the_hub_id_or_the_name_the_spec_gives(hub, make_data, tmp_path):
    """Its base goes by ``Service.model_name`` when given, else by the base's Hub id (not a local path), and
    the tokenizer clients are told to load is the Hub id, which the SDK and the cookbook load by name."""
    from mlora_lab.job.drivers.tinker.job_service import JobService
    from mlora_lab.lab.runs.served import ServedRun
    from mlora_lab.rundir import RunDir
    from mlora_lab.spec.parts import Service

    def served(spec: JobSpec, name: str) -> JobService:
        run = RunDir(tmp_path / name)
        run.create()
        spec.to_json(run.job)
        return JobService(spec, run), ServedRun(run.root)

    by_id = JobSpec(base_model="org/tiny", tenants=[], service=Service())
    assert messages(by_id) == []  # (downloads it)
    job, handle = served(by_id, "by_id")
    assert (job.state.base_model, job.state.tokenizer_id, handle.base_model) == ("org/tiny",) * 3
    named = JobSpec(base_model="org/tiny", tenants=[], service=Service(model_name="acme/base-v1"))
    job, handle = served(named, "named")
    assert (job.state.base_model, job.state.tokenizer_id, handle.base_model) == (
        "acme/base-v1",
        "org/tiny",
        "acme/base-v1",
    )
    local = JobSpec(base_model=hub.base, tenants=[], service=Service(model_name="tiny"))
    job, handle = served(local, "local")
    assert (job.state.base_model, job.state.tokenizer_id) == ("tiny", hub.base)
    assert transformers.AutoTokenizer.from_pretrained("org/tiny")(
        "hello"
    ).input_ids  # (by name, from the cache)


def test_a_forms_validation_cache_asks_the_hub_once_per_id(hub, make_data):
    from mlora_lab.validate import ValidationCache, Validator

    validator = Validator(ValidationCache())
    spec = JobSpec(base_model="org/tiny", tenants=[tenant(make_data)], seq_len=32)
    assert validator.problems(spec) == []
    calls = hub.calls
    for seq_len in (16, 24, 40):  # (a form re-checks on every change)
        assert (
            validator.problems(JobSpec(base_model="org/tiny", tenants=[tenant(make_data)], seq_len=seq_len))
            == []
        )
    assert hub.calls == calls, "the Hub was asked again"


def test_a_hub_dataset_trains_as_the_same_rows_from_a_file(hub, tmp_path):
    """``ml.HubDataset`` through ``datasets.load_dataset`` from the loopback Hub: the same losses and adapters
    as the same rows in a JSONL file, and its test split as held-out data."""
    data = ml.HubDataset("org/rows")
    assert str(data) == "org/rows (train)"
    same = write_jsonl(tmp_path / "rows.jsonl", task_rows("reverse", 8))
    settings = dict(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], lr=5e-3, batch_size=2, max_steps=3)

    def trained(train, heldout_data):
        spec = JobSpec(
            base_model=hub.base,
            seq_len=32,
            tenants=[Tenant(name="a", data=train, heldout_data=heldout_data, **settings)],
        )
        assert messages(spec) == []
        trainer = Trainer(spec)
        trainer.train()
        return trainer

    ours = trained(data, ml.HubDataset("org/rows", split="test"))
    theirs = trained(same, write_jsonl(tmp_path / "test.jsonl", task_rows("reverse", 3)))
    assert ours.losses("a") == theirs.losses("a")
    for m, (A, B) in theirs.model.tenant_tensors("a").items():
        assert torch.equal(ours.model.tenant_tensors("a")[m][0], A) and torch.equal(
            ours.model.tenant_tensors("a")[m][1], B
        )
    assert hub.requests[("datasets/org/rows", "data/train-00000-of-00001.parquet")] == 1, "downloaded once"


def test_a_hub_dataset_that_cannot_be_had_is_one_answer_naming_it(hub, monkeypatch):
    def said(data) -> str:
        spec = JobSpec(base_model=hub.base, tenants=[Tenant(name="a", data=data, target_modules=["q_proj"])])
        (message,) = messages(spec)
        return message

    missing = said(ml.HubDataset("org/nothing"))
    assert "org/nothing is not a dataset on the Hub" in missing and "HF_TOKEN" in missing
    gated = said(ml.HubDataset("org/gated-rows"))
    assert "org/gated-rows is a gated dataset on the Hub" in gated and "HF_TOKEN" in gated
    assert "no revision 'v9'" in said(ml.HubDataset("org/rows", revision="v9"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert messages(JobSpec(base_model=hub.base, tenants=[
        Tenant(name="a", data=ml.HubDataset("org/gated-rows"), target_modules=["q_proj"])])) == [], "with the token"  # fmt: skip
    monkeypatch.delenv("HF_TOKEN")
    import datasets.config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    offline = said(ml.HubDataset("org/rows", split="test"))
    assert "org/rows is not in the cache and HF_HUB_OFFLINE is set" in offline


def test_job_json_holds_a_hub_dataset_until_a_launch_writes_its_rows(hub, tmp_path):
    from mlora_lab.lab.runs import tenant_data
    from mlora_lab.rundir import RunDir

    t = Tenant(name="a", data=ml.HubDataset("org/rows", revision="main"), target_modules=["q_proj"])
    d = JobSpec(base_model=hub.base, tenants=[t]).to_dict()
    assert d["tenants"][0]["data"] == {
        "repo_id": "org/rows",
        "config": None,
        "split": "train",
        "revision": "main",
    }
    again = JobSpec.from_dict(json.loads(json.dumps(d)))
    assert again.tenants[0].data == t.data
    with pytest.raises(ml.SpecError, match=r"data \(a Hub dataset\): unknown field 'splt'"):
        JobSpec.from_dict(
            {**d, "tenants": [{**d["tenants"][0], "data": {"repo_id": "org/rows", "splt": "x"}}]}
        )
    run = RunDir(tmp_path / "run")
    written = tenant_data.write_data(run, tenant_data.freeze(t))
    rows = [json.loads(line) for line in Path(written.data).read_text().splitlines()]
    assert rows == task_rows("reverse", 8)


def test_the_demos_real_model_is_the_hub_id_when_the_hub_answers_else_the_gguf(hub, monkeypatch):
    from mlora_lab.bases import real_model_path
    from mlora_lab.lab.demo import REAL_MODEL_ID, real_base_model

    hub.repos[REAL_MODEL_ID] = repo_from_folder(hub.base)  # (the tiny llama, under the real model's id)
    base, which = real_base_model()
    assert base == REAL_MODEL_ID and "by its Hub id" in which
    assert hub.requests[(REAL_MODEL_ID, "model.safetensors")] == 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base, which = real_base_model()
    assert base == str(real_model_path()) and "HF_HUB_OFFLINE is set" in which
    monkeypatch.delenv("HF_HUB_OFFLINE")
    del hub.repos[REAL_MODEL_ID]
    base, which = real_base_model()
    assert base == str(real_model_path()) and "the Hub did not give it (RepositoryNotFoundError)" in which


def test_forms_take_a_hub_id_and_a_revision(hub, make_data):
    """A TenantForm over ``org/tiny`` lists its linear layers (downloaded once, at the revision), and the
    JobBuilder's spec carries the revision; a revision the Hub does not have is the form's model problem."""
    commit = hub.repos["org/tiny"].sha
    form = ml.TenantForm("org/tiny", revision=commit)
    assert {"q_proj", "v_proj", "down_proj"} <= set(form.linear_names)
    builder = ml.JobBuilder("org/tiny", form=form, revision=commit)
    assert builder.spec().revision == commit and builder.form.revision == commit
    bad = ml.TenantForm("org/tiny", revision="v9")
    assert bad.linear_names == [] and "has no revision 'v9'" in bad._model_error.message


def point_at(monkeypatch, url: str) -> None:
    """``huggingface_hub`` (and the module-level API object PEFT uses) pointed at ``url`` for the rest of the test."""
    import huggingface_hub.constants
    import huggingface_hub.hf_api

    monkeypatch.setenv("HF_ENDPOINT", url)
    importlib.reload(huggingface_hub.constants)
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", url)


def test_a_hub_that_never_answers_is_one_problem_naming_the_id_and_the_timeout(hub, make_data, monkeypatch):
    """HB4: a Hub that accepts connections and never answers held validation for 400 s (huggingface_hub's
    defaults: a 10 s HEAD, then six 60 s ones with back-off). Each request now waits ``hub.TIMEOUT_S`` at most,
    and the id is one problem naming the timeout; a Hub dataset likewise."""
    import time

    from mlora_lab import hub as hub_module

    monkeypatch.setattr(hub_module, "TIMEOUT_S", 1.0)
    with SilentHub() as silent:
        point_at(monkeypatch, silent.url)
        started = time.monotonic()
        (said,) = messages(JobSpec(base_model="org/tiny", tenants=[tenant(make_data)]))
        spent = time.monotonic() - started
        assert silent.connections >= 1, "the Hub was asked"
        assert "base_model org/tiny" in said and "did not answer within 1 s" in said, said
        assert spent < 30, f"validation waited {spent:.0f} s"  # (a sanity bound: one 1 s wait is the design)
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", silent.url)
        spec = JobSpec(base_model=hub.base, tenants=[Tenant(name="a", data=ml.HubDataset("org/rows"),
                                                            target_modules=["q_proj"])])  # fmt: skip
        (said,) = messages(spec)
        assert "org/rows" in said and "did not answer within 1 s" in said, said


def test_a_download_cut_short_is_one_problem_naming_the_id(hub, make_data):
    """HB5: the connection closes half-way through the weights: one problem naming the id and the cut, not
    "internal error while validating the spec"; nothing half-written is left as the snapshot's file."""
    hub.repos["org/cut"] = Repo(dict(hub.repos["org/tiny"].files), cut=frozenset({"model.safetensors"}))
    (said,) = messages(JobSpec(base_model="org/cut", tenants=[tenant(make_data)]))
    assert "internal error" not in said, said
    assert "base_model org/cut" in said and "cut short" in said, said
    from mlora_lab import hub as hub_module

    with pytest.raises(FileNotFoundError):
        hub_module.local("org/cut")


def test_hub_file_names_leaving_the_repository_are_refused_and_nothing_escapes(hub, make_data, tmp_path):
    """HB7: a Hub that lists ``../`` file names (and serves them): one problem naming the id and the name, and
    no file written outside the Hub cache."""
    files = dict(hub.repos["org/tiny"].files)
    files["../escape.json"] = b'{"escaped": true}'
    files["../../../../../escape.json"] = b'{"escaped": true}'
    hub.repos["org/evil"] = Repo(files)
    spec = JobSpec(base_model="org/evil", tenants=[tenant(make_data)])
    before = {p for p in tmp_path.rglob("*") if "hf" not in p.relative_to(tmp_path).parts[:1]}
    (said,) = messages(spec)
    assert "internal error" not in said, said
    assert "base_model org/evil" in said and "../escape.json" in said, said
    after = {p for p in tmp_path.rglob("*") if "hf" not in p.relative_to(tmp_path).parts[:1]}
    assert after == before and not list(tmp_path.parent.glob("escape.json")), "a file escaped the cache"
    assert not any(p.name == "escape.json" for p in (tmp_path / "hf").rglob("*")), "nothing of it is kept"


@pytest.mark.parametrize(
    "revision",
    ["main\nforged: line", "", " ", "v1\x00", "a b"],
    ids=["newline", "empty", "blank", "nul", "space"],
)
def test_a_revision_that_is_no_revision_is_one_problem_naming_it(hub, make_data, revision):
    """HB8b / HB8c: a revision holding a newline (or a NUL) was an internal error (or a second problem from
    the Hub); an empty one got a message about "the tenants". Each is one problem, the revision field's, and
    the Hub is not asked; :func:`mlora_lab.hub.fetch` (which the forms call) names the id and the revision."""
    from mlora_lab import hub as hub_module

    calls = hub.calls
    found = problems(JobSpec(base_model="org/tiny", revision=revision, tenants=[tenant(make_data)]))
    assert [p.field for p in found] == ["revision"], [p.message for p in found]
    said = found[0].message
    assert "internal error" not in said and "tenants" not in said and "\n" not in said, said
    assert said.startswith("revision ") and ("empty" in said) == (not revision.strip()), said
    assert said.endswith("(the Hub revision of base_model org/tiny: not asked for)"), said
    path, why = hub_module.fetch("org/tiny", revision)
    assert path is None and why.startswith("org/tiny: revision ") and "\n" not in why, why
    assert hub.calls == calls, "the Hub was asked"


def test_an_unreachable_hub_fails_at_once_and_names_the_ways_out(hub, make_data, monkeypatch, caplog, capfd):
    """m3: with HF_HUB_OFFLINE unset and the Hub unreachable, huggingface_hub retried for 24 s with a warning
    each time, then said nothing of what to do. One request, no retry, and the message names the ways out:
    HF_HUB_OFFLINE=1 with a filled HF_HOME, or the SmolLM2 that ships with the package. A cached id still
    validates from the cache."""
    import logging
    import time

    assert messages(JobSpec(base_model="org/tiny", tenants=[tenant(make_data)])) == []  # (now cached)
    point_at(monkeypatch, closed_port())
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    (said,) = messages(JobSpec(base_model="org/other", tenants=[tenant(make_data)]))
    spent = time.monotonic() - started
    assert "base_model org/other is not in the Hub cache" in said and "the Hub cannot be reached" in said
    assert "HF_HUB_OFFLINE=1" in said and "HF_HOME" in said and "real_base_model()" in said, said
    noise = caplog.text + "".join(capfd.readouterr())
    assert "Retrying" not in noise and "Retry" not in noise, noise
    assert spent < 10, f"{spent:.0f} s"  # (a sanity bound: no back-off; one refused connection is instant)
    assert messages(JobSpec(base_model="org/tiny", tenants=[tenant(make_data)])) == [], "the cache still does"


def test_a_push_that_cannot_reach_the_hub_is_one_line_from_the_cli(hub, make_data, tmp_path, monkeypatch):
    """m4: ``mlora-lab push`` with the Hub unreachable printed a 75-line traceback. One line naming the
    repository and the cause, exit code 2, as the rest of the CLI; ``run.push_to_hub`` raises the same."""
    import subprocess
    import sys

    from mlora_lab.lab.exports import ExportError
    from mlora_lab.lab.runs.run import Run

    Trainer(
        JobSpec(base_model=hub.base, tenants=[tenant(make_data)], seq_len=32), run_dir=tmp_path / "run"
    ).train()
    url = closed_port()
    point_at(monkeypatch, url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(ExportError, match=r"me/adapter-a.*cannot be reached"):
        Run(tmp_path / "run").push_to_hub("a", "me/adapter-a")
    done = subprocess.run(
        [sys.executable, "-m", "mlora_lab.lab.cli", "push", str(tmp_path / "run"), "a", "me/adapter-a"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "me/adapter-a" in lines[0] and "cannot be reached" in lines[0], done.stderr
