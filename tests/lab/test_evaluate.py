"""``ml.evaluate``: every model's completions in one batch equal PEFT's own generation of each, the metrics
score them as the functions themselves do, and the tables (scores with bootstrap intervals, examples,
comparisons) and the saved evaluation hold what was measured."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import peft
import pytest
import torch
import transformers

import mlora_lab as ml
from mlora_lab.evals import metrics as M

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
    assert len(fig.axes[0].patches) == 3 * 3  # a bar per model and metric
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
