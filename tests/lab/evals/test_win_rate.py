"""``ml.WinRate``: a judge asked which of two answers is better, the evaluated model's or a baseline's (the
base model's completion, or a preference row's ``chosen``), once in each order; wins, ties and losses score
1, ½ and 0 per order, a comparison the mean of its two orders, the win rate the mean over examples with the
evaluation's bootstrap interval. The judge is a scripted server on loopback."""

from __future__ import annotations

import json
import re

import numpy as np
import peft
import pytest
import torch
import transformers
from judge_server import JudgeServer

import mlora_lab as ml
from mlora_lab.evals import metrics as M

PAIRS = [
    {
        "prompt": f"Question {i}: what do {'cats' if i % 2 else 'dogs'} like?",
        "chosen": " Warm" if i % 3 == 0 else " They like warm places" + " and naps" * (i % 3),
        "rejected": " Nothing" + " at all" * (i % 4 + 1),
    }
    for i in range(6)
]
ASKED = re.compile(r"\n\nQuestion: (?P<q>.*)\n\nAnswer A: (?P<a>.*)\n\nAnswer B: (?P<b>.*)\n\Z", re.DOTALL)


@pytest.fixture
def judge_server():
    server = JudgeServer()
    yield server
    server.close()


def answers(text: str) -> tuple[str, str]:
    found = ASKED.search(text)
    assert found is not None, text
    return found["a"], found["b"]


def prefers_good(text: str) -> str:
    """A judge without position bias: the answer saying "good" wins; both or neither: a tie."""
    a, b = ("good" in x for x in answers(text))
    return "tie" if a == b else ("A" if a else "B")


# -- the scoring, alone ----------------------------------------------------------------------------------


def test_each_comparison_is_asked_in_both_orders_and_scored_one_half_zero(judge_server):
    judge = ml.Judge(model="grader", base_url=judge_server.url, api_key="k")
    win = ml.WinRate(judge, against="chosen")
    assert win.__name__ == "win_rate_vs_chosen" and ml.WinRate(judge).__name__ == "win_rate_vs_base"
    judge_server.reply = prefers_good
    scores = win(
        ["q1", "q2", "q3"], ["a good one", "a bad one", "good too"], chosen=["meh", "good", "good as well"]
    )
    assert scores == [1.0, 0.0, 0.5]
    # every comparison twice, the completion first as A, then as B, with the row's prompt
    assert [answers(t) for t in judge_server.asked] == [
        ("a good one", "meh"), ("meh", "a good one"),
        ("a bad one", "good"), ("good", "a bad one"),
        ("good too", "good as well"), ("good as well", "good too"),
    ]  # fmt: skip
    assert [ASKED.search(t)["q"] for t in judge_server.asked] == ["q1", "q1", "q2", "q2", "q3", "q3"]


def test_a_judge_biased_to_one_position_scores_every_comparison_one_half(judge_server):
    win = ml.WinRate(ml.Judge(base_url=judge_server.url, api_key="k"), against="chosen")
    for always in ("A", "B", "[[A]]", "answer: b."):
        judge_server.reply = lambda text, said=always: said
        assert win(["q", "q"], ["x", "y"], chosen=["z", "w"]) == [0.5, 0.5], always
    # a win in one order and a tie in the other: ¾; a loss and a tie: ¼
    judge_server.reply = lambda text: "A" if "good" in answers(text)[0] else "tie"
    assert win(["q", "q"], ["good", "bad"], chosen=["bad", "good"]) == [0.75, 0.25]
    judge_server.reply = lambda text: "Tie"
    assert win(["q"], ["x"], chosen=["y"]) == [0.5]


def test_a_judge_that_answers_neither_leaves_the_comparison_unscored(judge_server):
    win = ml.WinRate(ml.Judge(base_url=judge_server.url, api_key="k"), against="chosen")
    judge_server.reply = lambda text: "I cannot tell"
    assert win(["q", "q"], ["x", "y"], chosen=["z", "w"]) == [None, None]
    # one order read, the other not: not scored either (one order alone keeps the judge's position bias)
    judge_server.reply = lambda text: "A" if answers(text)[0] == "x" else "A and B are both fine"
    assert win(["q"], ["x"], chosen=["z"]) == [None]
    for said, read in (("A", "A"), (" [[b]] ", "B"), ("Verdict: tie!", "tie"), ('"A"', "A")):
        assert M.verdict(said) == read, said
    for said in ("", "A and B", "C", "Answer A is better", "neither"):
        assert M.verdict(said) is None, said


def test_the_same_text_ties_unasked_and_a_model_is_not_compared_with_itself(judge_server):
    win = ml.WinRate(ml.Judge(base_url=judge_server.url, api_key="k"))  # against "base"
    judge_server.reply = prefers_good
    peers = [{"base": " same "}, {"base": "bad"}, {"base": "good"}, {}]
    got = win(
        ["q"] * 4,
        ["same", "good", "good", "anything"],
        eval_model=["dpo", "dpo", "base", "dpo"],
        eval_completions=peers,
    )
    assert got == [0.5, 1.0, None, None]
    assert len(judge_server.asked) == 2  # (only the second was a comparison to ask)
    with pytest.raises(ValueError, match=r"win_rate_vs_base compares each completion with 'base'"):
        win(["q"], ["x"], answer=["y"])


def test_a_rubric_may_name_only_the_pairwise_fields_and_the_judge_is_a_judge():
    judge = ml.Judge(model="grader")
    with pytest.raises(ValueError) as e:
        ml.WinRate(judge, rubric="{prompt} {completion} {answer_a}", name="pairwise")
    text = str(e.value)
    assert "win rate 'pairwise'" in text and "model 'grader'" in text and "{completion}" in text, text
    assert "{prompt}, {answer_a}, {answer_b} and {reference}" in text, text
    with pytest.raises(TypeError, match="asks through a Judge"):
        ml.WinRate("grader")
    assert ml.WinRate(judge, rubric="{reference}|{answer_b}|{answer_a}|{prompt}").rubric


def test_conversational_preference_rows_are_asked_as_chats_with_chosen_as_reference(llama_path, judge_server):
    from mlora_lab.evals.generate import read_examples

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi?"}]
    row = {"prompt": chat, "chosen": [{"role": "assistant", "content": "hello"}],
           "rejected": [{"role": "assistant", "content": "go away"}]}  # fmt: skip
    (ex,) = read_examples([row], transformers.AutoTokenizer.from_pretrained(llama_path))
    assert ex.prompt == chat and ex.columns == {
        "chosen": row["chosen"],
        "rejected": row["rejected"],
        "reference": "hello",
    }
    judge_server.reply = prefers_good
    win = ml.WinRate(ml.Judge(base_url=judge_server.url, api_key="k"), against="chosen")
    assert win([chat], [[{"role": "assistant", "content": "good day"}]], chosen=[row["chosen"]]) == [1.0]
    assert answers(judge_server.asked[0]) == ("good day", "hello")
    assert ASKED.search(judge_server.asked[0])["q"] == "system: Be brief.\n\nuser: hi?"


# -- ml.evaluate of a trained preference tenant ----------------------------------------------------------


def longer_wins_else_a(text: str) -> str:
    """The longer answer wins; answers of one length: "A", a judge biased to the first position."""
    a, b = (len(x.strip()) for x in answers(text))
    return "A" if a >= b else "B"


def expected(mine: str, baseline: str) -> float:
    mine, baseline = mine.strip(), baseline.strip()
    return 0.5 if len(mine) == len(baseline) else float(len(mine) > len(baseline))


def paired_bootstrap(values: np.ndarray, resamples: int = 1000, confidence: float = 0.95, seed: int = 0):
    """The percentile bootstrap over examples, written out: the same draws for every model."""
    draws = np.random.default_rng(seed).integers(0, values.shape[1], size=(resamples, values.shape[1]))
    means = values[:, draws].mean(axis=2)
    tail = (1 - confidence) / 2 * 100
    return np.percentile(means, tail, axis=1), np.percentile(means, 100 - tail, axis=1)


def test_win_rate_of_a_trained_preference_tenant_against_the_base_and_chosen(
    llama_path, tmp_path, judge_server
):
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.lab.launch import prepare_run

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    torch.manual_seed(5)  # (an adapter with B ≠ 0: the tenant's greedy text differs from the base's)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), config
    ).save_pretrained(tmp_path / "init")
    tenant = ml.Tenant(name="dpo", data=str(data), pref=ml.Preference(beta=0.1), rank=4, alpha=16, batch_size=2,
                       max_steps=2, target_modules=["q_proj", "v_proj"], init_adapter=str(tmp_path / "init"))  # fmt: skip
    spec = ml.JobSpec(base_model=llama_path, tenants=[tenant], seq_len=64, max_rank=4,
                      output_dir=str(tmp_path / "run"))  # fmt: skip
    run = prepare_run(spec)
    trainer = Trainer(ml.JobSpec.load(run.job), run_dir=run.root)
    trainer.train()
    trainer.close()

    judge_server.reply = longer_wins_else_a
    judge = ml.Judge(model="grader", base_url=judge_server.url, api_key="k")
    metrics = [ml.WinRate(judge, against="base"), ml.WinRate(judge, against="chosen")]
    ev = ml.evaluate(run.root, PAIRS, metrics, max_new_tokens=8, name="wins")
    assert ev.models == ["base", "dpo"] and ev.metrics == ["win_rate_vs_base", "win_rate_vs_chosen"]
    table = ev.examples()
    # preference rows: the prompt is asked, chosen is the reference, chosen and rejected stay columns
    assert table["prompt"].tolist() == [r["prompt"] for r in PAIRS] * 2
    assert table["reference"].tolist() == table["chosen"].tolist() == [r["chosen"] for r in PAIRS] * 2
    base = table[table.model == "base"].set_index("example").completion
    dpo = table[table.model == "dpo"].set_index("example").completion
    assert (base != dpo).any(), "the tenant should answer differently from the base somewhere"
    want_base = [expected(dpo[e], base[e]) for e in range(len(PAIRS))]
    want_chosen = {
        m: [expected(c[e], PAIRS[e]["chosen"]) for e in range(len(PAIRS))]
        for m, c in (("base", base), ("dpo", dpo))
    }
    got = table.set_index(["model", "example"])
    assert got.loc["dpo", "win_rate_vs_base"].tolist() == want_base
    assert got.loc["base", "win_rate_vs_base"].isna().all()  # (the base is not compared with itself)
    for m in ("base", "dpo"):
        assert got.loc[m, "win_rate_vs_chosen"].tolist() == want_chosen[m]
    # the judge saw each differing pair twice, the tenant's answer first as A then as B
    differ = sum(dpo[e].strip() != base[e].strip() for e in range(len(PAIRS)))
    differ += sum(c[e].strip() != PAIRS[e]["chosen"].strip() for c in (base, dpo) for e in range(len(PAIRS)))
    assert len(judge_server.asked) == 2 * differ

    scores = ev.scores()
    values = np.array([want_base, want_chosen["base"], want_chosen["dpo"]])
    low, high = paired_bootstrap(values)
    for row, (model, metric) in enumerate(
        (("dpo", "win_rate_vs_base"), ("base", "win_rate_vs_chosen"), ("dpo", "win_rate_vs_chosen"))
    ):
        assert scores.loc[model, metric] == pytest.approx(values[row].mean(), abs=1e-12)
        assert scores.loc[model, f"{metric}_low"] == pytest.approx(low[row], abs=1e-12)
        assert scores.loc[model, f"{metric}_high"] == pytest.approx(high[row], abs=1e-12)
        assert low[row] <= values[row].mean() <= high[row]
    assert np.isnan(scores.loc["base", "win_rate_vs_base"])
    back = ml.load_evaluation(run.root, "wins")  # (saved with the run, scores and all)
    assert back.scores().equals(scores)

    with pytest.raises(ValueError, match=r"win_rate_vs_base compares every model with 'base', which is not "
                       r"evaluated: add 'base' to models"):  # fmt: skip
        ml.evaluate(run.root, PAIRS, [ml.WinRate(judge)], models=["dpo"])
    with pytest.raises(ValueError, match=r"win_rate_vs_nobody compares every model with 'nobody', which is neither "
                       r"a model of this evaluation \(base, dpo\) nor a column of its rows \(chosen, reference, rejected\)"):  # fmt: skip
        ml.evaluate(run.root, PAIRS, [ml.WinRate(judge, against="nobody")])
    with pytest.raises(ValueError, match=r"column 'eval_model' has a name the evaluation itself passes"):
        ml.evaluate(run.root, [PAIRS[0] | {"eval_model": "x"}], [ml.WinRate(judge)])
