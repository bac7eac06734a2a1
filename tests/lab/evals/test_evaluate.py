"""``ml.evaluate``: every model's completions in one batch equal PEFT's own generation of each, the metrics
score them as the functions themselves do, and the tables (scores with bootstrap intervals, examples,
comparisons) and the saved evaluation hold what was measured."""

from __future__ import annotations

import csv
import json
import math
import re
import socket

import numpy as np
import pandas as pd
import peft
import pytest
import torch
import transformers
from conftest import task_rows, write_jsonl
from judge_server import JudgeServer

import mlora_lab as ml
from mlora_lab.evals import metrics as M
from mlora_lab.lab.evals.evaluation import Evaluation
from mlora_lab.rundir.evals import EvalExample, EvalMeta

ROWS = [
    {"prompt": "reverse: red cat\n", "answer": "cat red"},
    {"prompt": "upper: sun\n", "answer": "SUN"},
    {"prompt": "count: a b c\n", "answer": "#### 3"},
    {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]},
]


def long_words(prompts, completions, **kwargs):
    """A notebook's own metric: the share of words longer than three letters (None for no words)."""
    out = []
    for c in completions:
        words = M.text_of(c).split()
        out.append(sum(len(w) > 3 for w in words) / len(words) if words else None)
    return out


# -- the built-in metrics, alone --------------------------------------------------------------------------


def test_builtin_metrics_score_as_documented():
    comps = ["  cat red ", "the answer is SUN.", "so 1,234 apples", "#### -2.50\nthen 7"]
    cols = {"answer": ["cat red", "SUN", "#### 1234", "-2.5"]}
    assert M.exact_match([], comps, **cols) == [1.0, 0.0, 0.0, 0.0]
    assert M.contains([], comps, **cols) == [1.0, 1.0, 0.0, 1.0]  # ("-2.5" is in "-2.50")
    assert M.numeric_match([], comps, **cols) == [
        None,
        None,
        1.0,
        1.0,
    ]  # after ####, else the last; no number: None
    assert M.numeric_match([], ["42"], reference=["no number"]) == [None]
    assert M.regex([], comps, pattern=[r"red$", r"SUN", r"\d{4}", r"^x"]) == [0.0, 1.0, 0.0, 0.0]
    assert M.Regex(r"\bred\b")([], comps) == [1.0, 0.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "cat red"}]]  # a chat prompt's completion, as TRL hands it
    assert M.exact_match([], chat, reference=["cat red"]) == [1.0]
    assert [M.final_number(t) for t in ("$5.", "no", "-.5", "1,000,000 and 2")] == [5.0, None, -0.5, 2.0]
    with pytest.raises(ValueError, match="'answer' or 'reference' or 'solution' or 'target' or 'completion'"):
        M.exact_match([], comps, other=[1, 2, 3, 4])


def test_rouge_is_rouge_score_rouge_l_or_says_what_to_install():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        with pytest.raises(ImportError, match="pip install rouge-score"):
            M.rouge([], ["a b"], reference=["a"])
        return
    got = M.rouge([], ["the cat sat", "dog"], reference=["the cat sat down", "cat"])
    want = [rouge_scorer.RougeScorer(["rougeL"]).score(r, c)["rougeL"].fmeasure for r, c in
            (("the cat sat down", "the cat sat"), ("cat", "dog"))]  # fmt: skip
    assert got == want and 0 < got[0] < 1 and got[1] == 0


# -- adapter folders: one batch equals PEFT, model by model --------------------------------------------------


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    """Two PEFT adapters of the tiny llama (random A and B: each changes the base's greedy text)."""
    out = tmp_path_factory.mktemp("adapters")
    paths = []
    for name, r, targets, seed in (
        ("alpha", 4, ["q_proj", "v_proj"], 1),
        ("beta", 8, ["o_proj", "up_proj"], 2),
    ):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(llama_path)
        config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
        peft.get_peft_model(model, config).save_pretrained(out / name)
        paths.append(str(out / name))
    return paths


def peft_greedy(base: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = (model if adapter is None else peft.PeftModel.from_pretrained(model, adapter)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_adapter_folders_complete_as_peft_does_and_are_scored_by_their_metrics(llama_path, adapters):
    ev = ml.evaluate(
        adapters, ROWS, ["exact_match", "contains", long_words], max_new_tokens=6, name="folders"
    )
    assert ev.folder is None, "adapter folders have no run to keep it in"
    assert ev.models == ["base", "alpha", "beta"] and ev.metrics == ["exact_match", "contains", "long_words"]
    table = ev.examples()
    assert len(table) == len(ROWS) * 3 and list(table.columns[:5]) == [
        "example",
        "model",
        "sample",
        "prompt",
        "completion",
    ]
    # the supervised chat row is asked its first turn; its answer became the reference
    assert (
        table.loc[3, "prompt"] == [{"role": "user", "content": "say hi"}]
        and table.loc[3, "reference"] == "hi"
    )

    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    texts = {}
    for model, adapter in zip(ev.models, [None, *adapters]):
        for e, row in enumerate(ROWS[:3]):
            ids = tok(row["prompt"])["input_ids"]
            want = tok.decode(peft_greedy(llama_path, adapter, ids, 6), skip_special_tokens=True)
            got = table[(table.model == model) & (table.example == e)].completion.item()
            assert got == want, (model, e)
            texts[model, e] = got
    assert len({texts[m, 0] for m in ev.models}) == 3, "each adapter changes the base's text"

    for metric, fn in (("exact_match", M.exact_match), ("contains", M.contains), ("long_words", long_words)):
        refs = [r.get("answer", r.get("reference", "hi")) for r in ROWS]
        for model in ev.models:
            rows = table[table.model == model].sort_values("example")
            want = fn([], rows.completion.tolist(), answer=refs)
            got = rows[metric].tolist()
            assert all((w is None and math.isnan(g)) or g == w for g, w in zip(got, want)), (metric, model)

    scores = ev.scores(resamples=200)
    assert list(scores.index) == ev.models and (scores["n"] == len(ROWS)).all()
    for m in ev.metrics:
        mean = table.groupby("model")[m].mean().reindex(ev.models)
        assert np.allclose(scores[m], mean, equal_nan=True)
        finite = scores[m].notna()
        assert (scores.loc[finite, f"{m}_low"] <= scores.loc[finite, m] + 1e-12).all()
        assert (scores.loc[finite, m] <= scores.loc[finite, f"{m}_high"] + 1e-12).all()

    diff = ev.compare("base", "alpha", metric="long_words")
    deltas = diff["long_words_delta"].abs().fillna(-1).tolist()
    assert deltas == sorted(deltas, reverse=True), "disagreements first"
    assert list(diff.columns[:4]) == ["example", "prompt", "base", "alpha"]
    assert diff.set_index("example").loc[0, "alpha"] == texts["alpha", 0]
    fig = ev.plot()
    assert [len(ax.patches) for ax in fig.axes] == [3, 3, 3]  # an axes per metric, a bar per model
    with pytest.raises(KeyError, match="no model 'gamma'"):
        ev.compare("base", "gamma")


def test_models_may_name_more_adapter_folders(adapters):
    """A model given as a folder (a snapshot's) joins the source's, under its folder's name."""
    ev = ml.evaluate(adapters[:1], ROWS[:2], ["contains"], models=["alpha", adapters[1]], max_new_tokens=3)
    assert ev.models == ["alpha", "beta"]
    both = ml.evaluate(adapters, ROWS[:2], ["contains"], models=["alpha", "beta"], max_new_tokens=3)
    assert ev.examples().completion.tolist() == both.examples().completion.tolist()


def test_sampling_is_reproducible_and_gives_pass_at_k(adapters):
    kw = dict(num_samples=3, temperature=1.5, max_new_tokens=4, seed=7, models=["base", "beta"])
    a = ml.evaluate(adapters, ROWS[:3], [M.Regex(r"[a-z]", name="lower")], **kw)
    b = ml.evaluate(adapters, ROWS[:3], [M.Regex(r"[a-z]", name="lower")], **kw)
    assert a.examples().completion.tolist() == b.examples().completion.tolist()
    assert len(set(a.examples().completion)) > 2, "samples differ at temperature 1.5"
    scores = a.scores()
    assert "lower_pass@3" in scores.columns
    table = a.examples()
    for model in ("base", "beta"):
        any_pass = table[table.model == model].groupby("example")["lower"].max().mean()
        assert scores.loc[model, "lower_pass@3"] == pytest.approx(any_pass)  # k = n: any sample passed


def test_every_problem_is_named_before_a_model_loads(adapters, monkeypatch):
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded")
    )
    with pytest.raises(ValueError) as e:
        ml.evaluate(adapters, ROWS, ["exact_match", 3], models=["base", "gamma"], num_samples=0, name="a/b")
    text = str(e.value)
    for part in ("num_samples = 0", "metric 1 must be", "unknown model(s) 'gamma'", "name 'a/b'"):
        assert part in text, text
    with pytest.raises(ValueError, match="needs 'pattern', which no data row has"):
        ml.evaluate(adapters, ROWS, ["regex"])


# -- the eval table --------------------------------------------------------------------------------------


def test_eval_table_filters_sorts_searches_and_exports(adapters, tmp_path):
    ev = ml.evaluate(adapters, ROWS, ["contains", long_words], max_new_tokens=6)
    table = ev.table(metric="long_words", export_dir=tmp_path)
    assert table.reference.value == "base" and table.models.value == ("base", "alpha", "beta")
    full = table.frame()
    scores = ev.per_example()["long_words"]
    assert list(full.columns[:4]) == ["example", "prompt", "answer", "reference"]
    assert np.allclose(full["alpha Δ"], scores[1] - scores[0], equal_nan=True)
    assert full.loc[3, "prompt"] == "user: say hi" and full.loc[3, "reference"] == "hi"

    # every filter keeps exactly the examples its rule says
    delta = np.vstack([scores[1] - scores[0], scores[2] - scores[0]])
    for name, want in (
        ("disagreements", np.nanmax(scores, axis=0) != np.nanmin(scores, axis=0)),
        ("regressions", (delta < 0).any(axis=0)),
        ("improvements", (delta > 0).any(axis=0)),
    ):
        table.filter.value = name
        assert table.frame()["example"].tolist() == np.flatnonzero(want).tolist(), name
    table.filter.value = "all"
    table.sort.value = "largest change"
    change = np.nanmax(np.abs(delta), axis=0)
    got = table.frame()["example"].tolist()
    assert [np.nan_to_num(change[e], nan=-1) for e in got] == sorted(
        np.nan_to_num(change, nan=-1), reverse=True
    )

    table.search.value = "UPPER"  # (case-insensitive, in prompts, references and completions)
    assert table.frame()["example"].tolist() == [1]
    assert "1 of 1 examples (4 in all)" in table.count.value and "upper: sun" in table.rows.value
    table.models.value = ("alpha",)  # a model shown alone: its Δ still taken from the reference
    assert "alpha Δ" in table.frame().columns and "base" not in table.frame().columns

    csv, page = table.to_csv(), table.to_html()
    assert csv == tmp_path / f"{ev.name}-long_words.csv"
    assert pd.read_csv(csv)["example"].tolist() == [1]
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "upper: sun" in text and "alpha:" in text
    table.csv.click()
    assert str(csv) in table.saved.value
    assert table.leaderboard.value[:4] == b"\x89PNG"
    with pytest.raises(KeyError, match="no metric 'bleu'"):
        ev.table(metric="bleu")


def test_eval_table_pages_long_evaluations(adapters):
    rows = [{"prompt": f"reverse: {w}\n", "answer": w[::-1]} for w in ("a", "bb", "ccc") * 40]
    table = ml.evaluate(adapters[:1], rows, ["contains"], max_new_tokens=2).table()
    assert table.rows.value.count("<tr>") == 1 + 50 and table.more.layout.display == ""
    table.more.click()
    assert table.rows.value.count("<tr>") == 1 + 100
    table.more.click()
    assert table.rows.value.count("<tr>") == 1 + 120 and table.more.layout.display == "none"


# -- hardening round three (issue 48) ---------------------------------------------------------------------


def made(models: list[str], scores: dict[str, list[list[float | None]]], **columns: list) -> Evaluation:
    """An evaluation of ``models`` (no model loaded): ``scores[metric][model][example]``, one sample each; the
    completions ``columns["completion"][model][example]`` (default ``"c"``), other columns per example."""
    metrics = list(scores)
    n = len(next(iter(scores.values()))[0]) if scores else len(columns["completion"][0])
    completions = columns.pop("completion", [["c"] * n for _ in models])
    rows = [
        EvalExample(example=e, model=m, sample=0, prompt=f"prompt {e}", completion=completions[i][e],
                    scores={k: scores[k][i][e] for k in metrics}, columns={c: v[e] for c, v in columns.items()})
        for i, m in enumerate(models)
        for e in range(n)
    ]  # fmt: skip
    return Evaluation(EvalMeta(name="made", models=models, metrics=metrics, data="rows", examples=n), rows)


def huge(prompts, completions, **kwargs):
    """A metric near float64's largest number (1.8e308): any two of its scores sum past it."""
    return [1.7e308 if "reverse" in str(p) else 1e308 for p in prompts]


def test_ev4c_scores_near_the_largest_float_have_a_finite_mean_and_interval(adapters):
    """EV4c: a metric of 1e308 gave a mean of inf and a NaN interval (a naive sum overflows); the mean is now
    taken scaled, so it and its interval are the finite numbers they are."""
    ev = ml.evaluate(adapters[:1], ROWS, [huge, "contains"], max_new_tokens=2)
    scores = ev.scores(resamples=200)
    want = (1.7 + 3 * 1.0) / 4 * 1e308  # (one "reverse" prompt of four)
    for model in ev.models:
        mean, low, high = (scores.loc[model, f"huge{s}"] for s in ("", "_low", "_high"))
        assert mean == pytest.approx(want, rel=1e-12)
        assert 1e308 <= low <= mean <= high <= 1.7e308
    assert not [c for c in scores.columns if c.endswith("_failed")]
    per = ev.per_example()["huge"]
    assert np.isfinite(per).all() and per.max() == 1.7e308


def test_ev4c_a_mean_that_is_not_finite_is_a_named_failure_of_its_metric(tmp_path):
    """EV4c: a model whose mean or interval is not a finite number (an infinite score, which the metrics'
    worker refuses, held by an evaluation made in memory) is a named failure of that metric, in the scores
    table, the leaderboard and the exported page: never a silent NaN."""
    inf = float("inf")
    ev = made(["base", "a"], {"big": [[1.0, 2.0, 3.0], [1.0, inf, 3.0]], "fine": [[0.5] * 3, [1.0] * 3]})
    scores = ev.scores(resamples=50)
    assert scores.loc["base", "big"] == 2.0 and pd.isna(scores.loc["base", "big_failed"])
    why = scores.loc["a", "big_failed"]
    assert "'big'" in why and "'a'" in why and "not a finite number" in why, why
    assert math.isnan(scores.loc["a", "big"]) and math.isnan(scores.loc["a", "big_low"])
    assert "fine_failed" not in scores.columns and scores.loc["a", "fine"] == 1.0
    fig = ev.plot("big")
    assert any("failed" in t.get_text() for t in fig.axes[0].texts)
    page = ev.table(metric="big", export_dir=tmp_path).to_html().read_text()
    assert "a: failed" in page and "not a finite number" in page


def test_ev12c_the_csv_export_neutralises_formulas_and_keeps_numbers(tmp_path):
    """EV12c: a text cell of the eval table's CSV that begins with ``=``, ``+``, ``-``, ``@``, a tab or a
    carriage return is written with a leading ``'`` (OWASP's CSV-injection advice: a spreadsheet then shows
    it as text, never runs it), headers too; numbers stay numbers (a negative Δ, a text that is a plain
    number)."""
    hostile = ['=HYPERLINK("http://evil","x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\t=1", "\r=1"]
    plain = ["-0.5", "+3", "1e5", "a = b", "plain"]
    completions = hostile + plain
    n = len(completions)
    ev = made(
        ["base", "a"],
        {"score": [[1.0] * n, [0.5] * n]},
        completion=[["ok"] * n, completions],
        answer=["=1+1"] + ["-2.5"] * (n - 1),
        **{"=cmd|' /C calc'!A0": ["x"] * n},
    )
    out = ev.table(export_dir=tmp_path).to_csv()
    with open(out, newline="", encoding="utf-8") as f:
        header, *rows = list(csv.reader(f))
    assert "'=cmd|' /C calc'!A0" in header
    a, delta, answer = header.index("a"), header.index("a Δ"), header.index("answer")
    assert {r[delta] for r in rows} == {"-0.5"}  # (a number: no quote)
    assert [r[a] for r in rows] == ["'" + t for t in hostile] + plain
    assert [r[answer] for r in rows] == ["'=1+1"] + ["-2.5"] * (n - 1)
    for cell in [c for r in rows for c in r] + header:
        assert not cell or cell[0] not in "=+-@\t\r" or float(cell) == float(cell), repr(cell)
    back = pd.read_csv(out)
    assert back["a Δ"].dtype == float and (back["a Δ"] == -0.5).all()
    assert back["example"].tolist() == list(range(n))


@pytest.fixture
def judge_server():
    server = JudgeServer()
    yield server
    server.close()


def test_ev13b_a_judge_that_answers_garbage_is_one_message_naming_it_and_what_it_answered(judge_server):
    """EV13b: a judge server's answer that is not UTF-8 reported ``UnicodeDecodeError``, one without choices
    ``IndexError``; now every answer of the wrong shape is one ``JudgeError`` naming the judge, its model and
    what it answered."""
    judge = ml.Judge(model="grader", base_url=judge_server.url, api_key="k", name="strict")
    for body, shown in (
        (b"\xff\xfe\x00garbage", "garbage"),
        (b'{"choices": []}', '{"choices": []}'),
        (b"<html>upstream down</html>", "<html>upstream down</html>"),
        (b"[1, 2]", "[1, 2]"),
        (b'{"choices": [{"message": {"content": 7}}]}', '"content": 7'),
        (b'{"choices": [{"text": "7"}]}', '"text": "7"'),
        (b"", "nothing"),
    ):
        judge_server.body = body
        with pytest.raises(M.JudgeError) as e:
            judge(["question"], ["answer"])
        text = str(e.value)
        assert "judge 'strict'" in text and "model 'grader'" in text and shown in text, text
        assert "\n" not in text and len(text) < 700, text
    judge_server.body = b"x" * 100_000  # (what it answered is cut, never repeated whole)
    with pytest.raises(M.JudgeError, match=r"100,000"):
        judge(["question"], ["answer"])
    judge_server.body = json.dumps({"choices": [{"message": {"content": "I rate it 7"}}]}).encode()
    assert judge(["question"], ["answer"]) == [0.7]


def test_oa19_a_judge_servers_refusal_keeps_its_reason(judge_server):
    """OA19: a judge server's 400 lost its reason (``HTTP Error 400: Bad Request``); the message now names the
    judge, its model, the status and the reason the server gave (OpenAI's ``{"error": {"message"}}``, else
    its text); a server that cannot be reached is named with why."""
    judge = ml.Judge(model="grader", base_url=judge_server.url, api_key="k")
    judge_server.status = 400
    judge_server.body = json.dumps(
        {"error": {"message": "max_tokens = 8 is out of range", "type": "x"}}
    ).encode()
    with pytest.raises(M.JudgeError) as e:
        judge(["question"], ["answer"])
    text = str(e.value)
    assert "judge 'judge'" in text and "model 'grader'" in text and "HTTP 400" in text, text
    assert "max_tokens = 8 is out of range" in text, text
    judge_server.status, judge_server.body = 502, b"bad gateway\x1b[2J"
    with pytest.raises(M.JudgeError, match=r"HTTP 502.*bad gateway\\x1b\[2J"):
        judge(["question"], ["answer"])
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    gone = ml.Judge(model="grader", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", timeout_s=5)
    with pytest.raises(M.JudgeError, match=rf"cannot reach http://127.0.0.1:{port}/v1"):
        gone(["question"], ["answer"])


def test_ev13b_a_failing_judge_fails_an_evaluation_with_its_message(adapters, judge_server):
    """EV13b: the judge's message is what ``ml.evaluate`` says when the judge (in the metrics' worker) fails."""
    judge_server.body = b'{"choices": []}'
    judge = ml.Judge(model="grader", base_url=judge_server.url, api_key="k", name="strict")
    with pytest.raises(Exception, match=r"judge 'strict' \(model 'grader'.*\{\"choices\": \[\]\}"):
        ml.evaluate(adapters[:1], ROWS[:1], [judge], max_new_tokens=2)


def test_ev13e_a_rubric_naming_an_unknown_field_is_one_message():
    """EV13e: a rubric naming a field other than {prompt}, {completion} and {reference} gave a bare
    ``KeyError``; every such mistake is now one ``ValueError`` naming the judge, its model and the field."""
    with pytest.raises(ValueError) as e:
        ml.Judge(
            model="grader", rubric="Is {answer} right for {prompt}? {0} {completion.upper}", name="strict"
        )
    text = str(e.value)
    assert "judge 'strict'" in text and "model 'grader'" in text, text
    for part in ("{answer}", "{0}", "{completion.upper}", "{prompt}, {completion} and {reference}"):
        assert part in text, text
    for rubric, why in (("rate {prompt", "'{'"), ("rate {prompt:d}", "{prompt:d}"), ("}", "'}'")):
        with pytest.raises(ValueError, match=re.escape(why)):
            ml.Judge(rubric=rubric)
    assert ml.Judge(rubric="{prompt!r} {{literal}} {completion:>5} {reference}").rubric


def test_ev6_rows_without_a_prompt_are_refused_as_evaluation_rows(adapters, monkeypatch):
    """EV6: evaluation data without a prompt was refused as "an RL row needs 'prompt'" under "bad tenant
    data"; the one ``evaluate`` error now says they are evaluation rows, with every other bad row, before
    any model loads."""
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded")
    )
    rows = [{"text": "no prompt"}, {"prompt": "upper: sun\n", "completions": "SUN"}, *ROWS[:1]]
    with pytest.raises(ValueError) as e:
        ml.evaluate(adapters, rows, ["contains"], name="ev6")
    text = str(e.value)
    assert text.startswith("evaluate:") and "row 0: an evaluation row needs 'prompt'" in text, text
    assert "row 1: column 'completions'" in text, text
    assert "RL" not in text and "tenant" not in text, text


# -- plots and failed tenants (m11) ----------------------------------------------------------------------


def test_m11_the_leaderboard_of_many_models_and_metrics_is_a_grid():
    """m11: 6 models × 3 metrics drew one 1728×256 strip of 18 bars; each metric now has its own axes (a bar
    per model), laid out in a grid whose size grows with the models and the metrics."""
    models = ["base", *(f"tenant-{i}" for i in range(5))]
    ev = made(models, {m: [[0.1 * i] * 4 for i in range(6)] for m in ("exact", "contains", "rouge")})
    fig = ev.plot()
    assert len(fig.axes) == 3 and fig.axes[0].get_subplotspec().get_geometry()[:2] == (1, 3)
    assert [ax.get_title() for ax in fig.axes] == ["exact", "contains", "rouge"]
    assert all(len(ax.patches) == 6 for ax in fig.axes)
    width, height = fig.get_size_inches()
    assert 9 <= width <= 14 and 2.5 <= height <= 4.5, (width, height)

    seven = made(models[:4], {f"m{k}": [[0.5] * 2] * 4 for k in range(7)})
    fig = seven.plot()
    assert len(fig.axes) == 7 and fig.axes[0].get_subplotspec().get_geometry()[:2] == (3, 3)
    w7, h7 = fig.get_size_inches()
    assert w7 <= 14 and h7 >= 2.5 * height, (w7, h7)
    many = made([f"t{i}" for i in range(30)], {"a": [[0.5]] * 30, "b": [[0.5]] * 30})
    fig = many.plot()
    assert fig.axes[0].get_subplotspec().get_geometry()[:2] == (2, 1)  # (30 bars fill an axes' width)
    assert fig.get_size_inches()[0] <= 14
    one = ev.plot("rouge")
    assert len(one.axes) == 1 and len(one.axes[0].patches) == 6


def test_m11_a_tenant_that_failed_is_left_out_of_a_runs_evaluation_and_said(llama_path, tmp_path):
    """m11: ``ml.evaluate(run)`` evaluated a tenant that failed at step 1 as if it had trained. By default
    such a tenant is left out, a warning says which and why, and the evaluation records it; named in
    ``models`` it is evaluated (the caller asked)."""
    from safetensors.torch import load_file, save_file

    from mlora_lab.job.trainer import Trainer
    from mlora_lab.lab.launch import prepare_run
    from mlora_lab.rundir import TenantState

    data = write_jsonl(tmp_path / "rev.jsonl", task_rows("reverse", 8))
    bad_init = tmp_path / "corrupt"  # (an adapter with an infinite weight: its loss is not finite at step 1)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), config
    ).save_pretrained(bad_init)
    weights = load_file(bad_init / "adapter_model.safetensors")
    weights[next(k for k in sorted(weights) if "lora_B" in k)][0, 0] = float("inf")
    save_file(weights, bad_init / "adapter_model.safetensors")
    tenants = [
        ml.Tenant(name="good", data=data, rank=4, batch_size=2, max_steps=2, target_modules=["q_proj", "v_proj"]),
        ml.Tenant(name="bad", data=data, rank=4, alpha=16, batch_size=2, max_steps=2, init_adapter=str(bad_init),
                  target_modules=["q_proj", "v_proj"]),
    ]  # fmt: skip
    spec = ml.JobSpec(base_model=llama_path, tenants=tenants, seq_len=32, max_rank=4,
                      output_dir=str(tmp_path / "run"))  # fmt: skip
    run = prepare_run(spec)
    trainer = Trainer(ml.JobSpec.load(run.job), run_dir=run.root)
    trainer.train()
    trainer.close()
    handle = ml.attach(run.root)
    assert handle.tenant_states()["bad"] is TenantState.FAILED
    assert (handle.adapter_path("bad") / "adapter_config.json").is_file()  # (what was evaluated before)

    with pytest.warns(UserWarning, match=r"left out tenant 'bad', which failed \(.*non-finite"):
        ev = ml.evaluate(run.root, ROWS[:2], ["contains"], max_new_tokens=2, save=False)
    assert ev.models == ["base", "good"] and list(ev.meta.left_out) == ["bad"]
    assert "non-finite" in ev.meta.left_out["bad"] and "left out: bad (failed)" in repr(ev)
    asked = ml.evaluate(
        run.root, ROWS[:2], ["contains"], models=["base", "bad"], max_new_tokens=2, save=False
    )
    assert asked.models == ["base", "bad"] and asked.meta.left_out == {}
