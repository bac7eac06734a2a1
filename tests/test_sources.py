"""mlora_lab.sources: a tenant's rows from a JSONL, JSON, parquet or CSV file, a pandas DataFrame, a list of
dicts or a datasets.Dataset: the same rows, the same tokens and the same adapter as the JSONL file; bad
sources refused with one clear message each; in-memory rows written into the run directory at launch and
``run.add_tenant``, and read from there by the job and by a resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
from conftest import not_ours

import mlora_lab as ml
from mlora_lab.data import load_examples, read_rows, scan_source
from mlora_lab.job.trainer import Trainer
from mlora_lab.lab.launch import prepare_run
from mlora_lab.lora import read_adapter
from mlora_lab.rundir import control, update_status
from mlora_lab.sources import Snapshot, SourceError, describe, snapshot, source_rows
from mlora_lab.tiny import build_tokenizer
from mlora_lab.validate import problems

ROOT = Path(__file__).resolve().parents[1]

PLAIN = [  # rows a CSV file can hold too: text and prompt/completion, mixed
    {"text": "the quick brown fox"},
    {"prompt": "reverse: red cat\n", "completion": "tac der"},
    {"text": "hello wörld ✓"},
    {"prompt": "upper: blue\n", "completion": "BLUE"},
]
CHAT = [
    {"messages": [{"role": "user", "content": "count red"}, {"role": "assistant", "content": "3"}]},
    {"text": "plain text between chats"},
]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def given(rows: list[dict]) -> list[dict]:
    """The rows without their null keys (a table's missing cells): what a row says."""
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


def dataset(rows: list[dict]) -> datasets.Dataset:
    """``rows`` as a Dataset with every key of every row (``Dataset.from_list`` takes the first row's)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return datasets.Dataset.from_dict({k: [r.get(k) for r in rows] for k in keys})


def sources_of(rows: list[dict], tmp: Path, with_chat: bool) -> dict[str, object]:
    """The same rows as every kind of source (CSV only without chat rows: a CSV cell is text)."""
    df = pd.DataFrame(rows)  # (rows of other shapes have NaN in these columns: missing cells)
    ds = dataset(rows)  # (and None here)
    df.to_json(tmp / "records.json", orient="records", force_ascii=False)
    ds.to_json(tmp / "datasets.json")  # datasets' default: JSON Lines under a .json name
    df.to_parquet(tmp / "pandas.parquet")
    ds.to_parquet(tmp / "datasets.parquet")
    out: dict[str, object] = {
        "json": str(tmp / "records.json"),
        "json lines": str(tmp / "datasets.json"),
        "parquet (pandas)": str(tmp / "pandas.parquet"),
        "parquet (datasets)": str(tmp / "datasets.parquet"),
        "DataFrame": df,
        "list": [dict(r) for r in rows],
        "Dataset": ds,
    }
    if not with_chat:
        df.to_csv(tmp / "pandas.csv", index=False)
        out["csv"] = str(tmp / "pandas.csv")
    return out


@pytest.mark.parametrize("rows", [PLAIN, CHAT], ids=["plain", "chat"])
def test_every_source_gives_the_rows_and_tokens_of_the_jsonl_file(rows, tmp_path):
    tok = build_tokenizer()
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    want = load_examples(jsonl, tok, seq_len=32)
    assert read_rows(jsonl) == rows
    for kind, source in sources_of(rows, tmp_path, with_chat=rows is CHAT).items():
        assert scan_source(source).problems == [], kind
        assert given(read_rows(source)) == rows, kind  # a table's missing cells are null
        assert load_examples(source, tok, seq_len=32) == want, kind
        if not isinstance(source, str):  # what a launch writes reads back as the same rows
            (tmp_path / "copy.jsonl").write_bytes(snapshot(source).jsonl())
            assert read_rows(tmp_path / "copy.jsonl") == read_rows(source), kind


def test_values_json_cannot_hold_are_converted_or_refused_by_row_and_key():
    df = pd.DataFrame(
        {
            "text": ["a", "b", "c"],
            "n": np.array([1, 2, 3], dtype=np.int32),
            "x": [np.float32(0.5), np.nan, 2.0],
            "ok": np.array([True, False, True]),
            "ids": [np.array([1, 2]), [3], None],
        }
    )
    assert read_rows(df) == [
        {"text": "a", "n": 1, "x": 0.5, "ok": True, "ids": [1, 2]},
        {"text": "b", "n": 2, "x": None, "ok": False, "ids": [3]},  # NaN is null
        {"text": "c", "n": 3, "x": 2.0, "ok": True, "ids": None},
    ]
    assert read_rows([{"text": "a", "score": np.nan, "prompt": None}]) == [
        {"text": "a", "score": None, "prompt": None}
    ]
    df["when"] = pd.Timestamp("2026-01-01")
    df["blob"] = pd.Series([None, b"raw", None], dtype=object)
    report = scan_source(df)
    refused = "value, which JSON cannot hold; convert it (to a string, say) or drop it"
    assert report.problems == [
        f"DataFrame row 0: 'when' holds a Timestamp {refused}",
        f"DataFrame row 1: 'when' holds a Timestamp {refused}",
        f"DataFrame row 1: 'blob' holds a bytes {refused}",
        f"DataFrame row 2: 'when' holds a Timestamp {refused}",
    ]
    (problem,) = scan_source([{"text": "a"}, {"text": "b", "w": float("inf")}, {1: "x"}]).problems[:1]
    assert (
        problem
        == "list row 1: 'w' holds inf, which JSON cannot hold; convert it (to a string, say) or drop it"
    )
    assert scan_source([{"text": "a"}, {1: "x"}]).problems == ["list row 1: the key 1 is not a string"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing.jsonl", "missing.jsonl: file not found"),
        (lambda tmp: touch(tmp / "rows.txt", '{"text": "a"}\n'), "unknown kind of data file (suffix '.txt')"),
        (lambda tmp: touch(tmp / "rows", '{"text": "a"}\n'), "unknown kind of data file (no suffix)"),
        (lambda tmp: touch(tmp / "e.csv", ""), "e.csv: empty file (no rows)"),
        (lambda tmp: touch(tmp / "e.json", "[]"), "e.json: empty file (no rows)"),
        (lambda tmp: [], "list: empty (no rows)"),
        (lambda tmp: pd.DataFrame({"text": []}), "DataFrame: empty (no rows)"),
        (lambda tmp: datasets.Dataset.from_dict({"text": []}), "Dataset: empty (no rows)"),
        (lambda tmp: [{"text": "a"}, "b"], "list row 1: expected a JSON object, got str"),
        (
            lambda tmp: pd.DataFrame({"text": ["a", None], "other": [None, "x"]}),
            "DataFrame row 1: row has none of 'text', 'prompt'+'completion', 'messages'",
        ),
        (lambda tmp: pd.DataFrame({"text": [1, "b"]}), "DataFrame row 0: 'text' must be a string"),
        (
            lambda tmp: datasets.Dataset.from_dict({"prompt": ["p"]}),
            "Dataset row 0: 'prompt' without 'completion'",
        ),
        (lambda tmp: pd.DataFrame([["a", "b"]]), "DataFrame: column names must be strings (got 0, 1)"),
        (
            lambda tmp: pd.DataFrame([["a", "b"]], columns=["text", "text"]),
            "DataFrame: column(s) 'text' appear more than once",
        ),
        (
            lambda tmp: touch(tmp / "c.csv", "text,prompt\nhello\na,b,c\n"),
            "c.csv line 3: 3 cells, but the header line names 2 columns",
        ),
        (
            lambda tmp: touch(tmp / "c.csv", 'text,messages\n,"[{""role"": ""user""}]"\n'),
            "c.csv line 2: 'messages' must be a non-empty list",  # a CSV cell is text
        ),
        (
            lambda tmp: pd.DataFrame({"text": ["a", "b"]}).to_json(tmp / "d.json") or tmp / "d.json",
            "one JSON object of objects (pandas' default to_json orient",
        ),
        (
            # (the decoder reads ahead by 8 KiB: the bad byte on line 3 of a longer file is still line 3)
            lambda tmp: touch_bytes(tmp / "u.csv", b"text\nfine\nab\xff cd\n" + b"more\n" * 3000),
            "u.csv: not valid UTF-8 (invalid start byte at line 3)",
        ),
        (lambda tmp: touch(tmp / "a.json", '[{"text": "a"},'), "a.json: not valid JSON ("),
        (lambda tmp: touch(tmp / "b.parquet", "not parquet"), "b.parquet: not a readable parquet file"),
    ],
)
def test_a_bad_source_gets_one_clear_message(make, message, tmp_path):
    source = make(tmp_path)
    report = scan_source(str(source) if isinstance(source, Path) else source)
    assert len(report.problems) == 1, report.problems
    assert message in report.problems[0]


def touch(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def touch_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_what_is_no_source_is_named_by_the_field_check(llama_path, tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(PLAIN)})
    it = datasets.Dataset.from_list(PLAIN).to_iterable_dataset()
    cases = {
        "dd": (dd, "data is a DatasetDict of the splits 'train'; give one split: dataset['train']"),
        "it": (it, "data is an IterableDataset, which has no fixed rows"),
        "series": (pd.Series(["a"]), "data is a pandas Series; give a DataFrame with named columns"),
        "three": (3, "data must be a .jsonl, .json, .parquet or .csv file path, a pandas DataFrame, a list"),
    }
    spec = ml.JobSpec(
        base_model=llama_path, tenants=[ml.Tenant(name=n, data=v) for n, (v, _) in cases.items()]
    )
    found = {p.tenant: str(p) for p in problems(spec)}
    for name, (_, message) in cases.items():
        assert message in found[name], found[name]
    assert not any("internal error" in text for text in found.values())


def test_validation_reports_every_problem_of_every_in_memory_source_at_once(llama_path):
    good = pd.DataFrame(PLAIN)
    bad = pd.DataFrame({"text": ["ok", 3, None]})
    spec = ml.JobSpec(
        base_model=llama_path,
        tenants=[
            ml.Tenant(name="good", data=good, heldout_data=list(PLAIN)),
            ml.Tenant(name="bad", data=bad, heldout_data=[{"prompt": "p"}]),
        ],
    )
    found = [str(p) for p in problems(spec)]
    assert found == [
        "tenant 'bad': data: DataFrame row 1: 'text' must be a string",
        "tenant 'bad': data: DataFrame row 2: row has none of 'text', 'prompt'+'completion', 'messages'",
        "tenant 'bad': heldout_data: list row 0: 'prompt' without 'completion'",
    ]


def test_job_json_holds_no_rows_in_memory_and_resolving_shares_them(tmp_path):
    df = pd.DataFrame(PLAIN)
    spec = ml.JobSpec(
        base_model="m", tenants=[ml.Tenant(name="bob", data=df), ml.Tenant(name="al", data="a.jsonl")]
    )
    with pytest.raises(ml.SpecError) as err:
        spec.to_json(tmp_path / "job.json")
    assert "tenant 'bob': data is a DataFrame of 4 rows held in memory, which job.json cannot hold" in str(
        err.value
    )
    assert "launch the spec" in str(err.value) and not (tmp_path / "job.json").exists()
    with pytest.raises(ml.SpecError, match="held in memory"):
        spec.tenants[0].to_dict()
    assert spec.resolved(tmp_path).tenants[0].data is df  # shared, never deep-copied
    inline = {"base_model": "m", "tenants": [{"name": "x", "data": PLAIN}]}  # job.json names files
    with pytest.raises(
        ml.SpecError, match=r"tenants\[0\] \('x'\): data must be a file path \(got an array\)"
    ):
        ml.JobSpec.from_json(json.dumps(inline))
    assert describe(df) == "a DataFrame of 4 rows" and describe([{}]) == "a list of 1 row"


def test_a_snapshot_keeps_the_rows_it_read():
    df = pd.DataFrame({"text": ["one", "two"], "note": ["x", "y"]})
    frozen = snapshot(df)
    assert isinstance(frozen, Snapshot) and snapshot(frozen) is frozen and len(frozen) == 2
    df.loc[0, "text"] = "changed"
    assert [r.row["text"] for r in source_rows(frozen)] == ["one", "two"]
    # a lone surrogate (a str can hold one; a JSON escape can too) is written as its escape: read back as itself
    rows = [{"text": "a\ud800b", "note": "ö"}]
    assert [json.loads(line) for line in snapshot(rows).jsonl().splitlines()] == rows
    broken = snapshot(pd.DataFrame([[1]]))
    with pytest.raises(SourceError, match="column names must be strings"):
        list(source_rows(broken))


def test_reading_rows_loads_neither_pandas_nor_datasets():
    code = (
        "import json, sys, mlora_lab.data as d, mlora_lab.validate, mlora_lab.job.trainer; "
        "d.read_rows([{'text': 'a'}]); "
        "print(json.dumps(sorted(m for m in ('pandas', 'datasets') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not_ours(json.loads(out.stdout.strip())) == []


# --------------------------------------------------------------------------- in a job


def spec_for(base: str, data, **kw) -> ml.JobSpec:
    tenant = ml.Tenant(name="bob", data=data, rank=4, lr=5e-3, batch_size=2, max_steps=kw.pop("max_steps", 6))
    return ml.JobSpec(base_model=base, tenants=[tenant], seq_len=32, max_rank=8, **kw)


def max_diff(x: dict, y: dict) -> float:
    assert set(x) == set(y)
    return max(max((x[m][0] - y[m][0]).abs().max().item(), (x[m][1] - y[m][1]).abs().max().item()) for m in x)


def trained(spec: ml.JobSpec) -> dict:
    trainer = Trainer(spec)
    trainer.train()
    return trainer.model.tenant_tensors("bob")


def test_an_in_process_job_on_a_dataframe_equals_the_jsonl_file(llama_path, tmp_path):
    rows = PLAIN * 3
    from_file = trained(spec_for(llama_path, write_jsonl(tmp_path / "rows.jsonl", rows)))
    from_frame = trained(spec_for(llama_path, pd.DataFrame(rows)))
    assert max_diff(from_file, from_frame) == 0


def test_a_launch_writes_the_rows_into_the_run_and_add_tenant_does_too(llama_path, tmp_path):
    """prepare_run is what ml.launch does before it starts torchrun; the job runs here, in this process."""
    df = pd.DataFrame(PLAIN * 3)
    spec = spec_for(llama_path, df, max_steps=20, output_dir=str(tmp_path / "run"))
    spec.tenants[0].heldout_data = dataset(PLAIN)
    run = ml.attach(prepare_run(spec).root)
    job = ml.JobSpec.load(run.dir.job)
    bob = job.tenant("bob")
    assert (bob.data, bob.heldout_data) == (
        str(run.dir.tenant_data("bob", "train")),
        str(run.dir.tenant_data("bob", "eval")),
    )
    assert given(read_rows(bob.data)) == PLAIN * 3 and given(read_rows(bob.heldout_data)) == PLAIN
    raw = json.loads(run.dir.job.read_text())["tenants"][0]  # relative: a copied run reads its own copy
    assert (raw["data"], raw["heldout_data"]) == ("data/bob/train.jsonl", "data/bob/eval.jsonl")
    update_status(run.path, state="running")
    trainer = Trainer(job, run_dir=run.path)
    trainer.step()
    carol = pd.DataFrame(PLAIN[::-1])
    request = run.add_tenant(ml.Tenant(name="carol", data=carol, rank=4, max_steps=2), wait=False)
    carol["text"] = carol["text"].astype(object)
    carol.loc[1, "text"] = 5  # too late: the rows were read and written when the tenant was added
    trainer.poll()
    assert request.status == "applied", request.result
    assert ml.JobSpec.load(run.dir.job).tenant("carol").data == str(run.dir.tenant_data("carol", "train"))
    assert given(read_rows(run.dir.tenant_data("carol", "train"))) == PLAIN[::-1]
    with pytest.raises(ml.SpecError, match=r"tenant 'dave': data: DataFrame row 1: 'text' must be a string"):
        run.add_tenant(ml.Tenant(name="dave", data=carol), wait=False)
    assert not run.dir.data.joinpath("dave").exists() and not control.incoming(run.path)


def test_a_sweeps_base_tenant_on_a_dataframe_is_written_into_the_run(llama_path, tmp_path):
    from mlora_lab.search import Objective, Sweep, choice

    base = ml.Tenant(name="base", data=pd.DataFrame(PLAIN * 3), rank=4, batch_size=2, max_steps=4)
    sweep = Sweep(base, {"lr": choice(1e-3, 1e-2)}, ml.Grid(), budget=2, objective=Objective("train_loss"))
    spec = ml.JobSpec(
        base_model=llama_path, tenants=[], seq_len=32, max_rank=8, output_dir=str(tmp_path / "r")
    )
    run = prepare_run(spec, sweep=sweep)
    saved = Sweep.read(run.sweep)
    assert saved.base.data == str(run.tenant_data("base", "train"))
    assert given(read_rows(saved.base.data)) == PLAIN * 3
    # named relative to the run, as job.json names its tenants' rows: a copied run reads its own copy
    assert json.loads(run.sweep.read_text())["base"]["data"] == "data/base/train.jsonl"
    copy = Path(shutil.copytree(run.root, tmp_path / "copy"))
    assert Sweep.read(copy / "sweep.json").base.data == str(copy / "data" / "base" / "train.jsonl")


@pytest.mark.slow
def test_a_dataframe_tenant_launched_trains_and_resumes_from_the_runs_copy(llama_path, tmp_path):
    rows = PLAIN * 4
    df = pd.DataFrame(rows)
    straight = trained(spec_for(llama_path, write_jsonl(tmp_path / "rows.jsonl", rows), max_steps=300))
    run = ml.launch(spec_for(llama_path, df, max_steps=300, output_dir=str(tmp_path / "run")))
    deadline = time.monotonic() + 180
    while not any(r["kind"] == "train" for r in run.rows()):
        assert run.status in ("starting", "running") and time.monotonic() < deadline, run.logs(0)
        time.sleep(0.05)
    (run.path / "control" / "stop").write_text("now")
    assert run.wait(120) == "stopped", run.logs(0)
    step = int(sorted((run.path / "checkpoints").glob("step_*"))[-1].name.split("_")[1])
    assert 1 <= step < 300, "stopped mid-run"
    df["text"] = "changed"  # the notebook changes its DataFrame: the run has its own rows
    df.loc[df.index[:5], "completion"] = None
    resumed = ml.resume(run.path)
    assert resumed.wait(300) == "finished", resumed.logs(0)
    assert max_diff(read_adapter(resumed.adapter_path("bob"))[1], straight) <= 1e-6
