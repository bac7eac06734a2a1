"""``ml.Judge(mode="rank")``: a judge that scores a group's completions against each other (RULER's way) gives
each the score the judge said, whatever order the completions came in (permutation-invariant), shows them in an
order fixed by its seed, asks once per group (cached), and names what it cannot use."""

from __future__ import annotations

import re

import pytest
from judge_server import JudgeServer

import mlora_lab as ml
from mlora_lab.evals.metrics import rank_scores

SCORES = {"Paris.": 1.0, "Lyon.": 0.2, "It is Paris, the capital.": 0.9, "No idea.": 0.0}


def scripted(asked: str) -> str:
    """A judge with a fixed opinion of each answer, whatever number the answer was shown under."""
    shown = re.findall(r"Answer (\d+):\n(.*)", asked)
    return "\n".join(f"{k}: {SCORES[text]}" for k, text in shown)


@pytest.fixture
def server():
    s = JudgeServer()
    s.reply = scripted
    yield s
    s.close()


def judge(server: JudgeServer, **kw) -> ml.Judge:
    return ml.Judge(model="base", base_url=server.url, api_key="k", mode="rank", **kw)


def test_a_groups_rewards_are_the_judges_scores_in_any_order_and_asked_once(server):
    j = judge(server)
    answers = list(SCORES)
    prompts = ["Capital of France?"] * 4
    assert j(prompts, answers) == [SCORES[a] for a in answers]
    assert len(server.asked) == 1 and "Here are 4 answers" in server.asked[0]
    reordered = answers[::-1]
    assert j(prompts, reordered) == [SCORES[a] for a in reordered]
    assert len(server.asked) == 1  # (cached: the same group in another order is not asked again)
    fresh = judge(server)
    assert fresh(prompts, reordered) == [SCORES[a] for a in reordered]
    assert server.asked[1] == server.asked[0]  # (the same seed shows the answers in the same order)


def test_groups_are_told_apart_by_their_prompt_and_equal_answers_share_a_score(server):
    j = judge(server)
    prompts = ["A?", "B?", "A?", "B?", "A?"]
    completions = ["Paris.", "Lyon.", "No idea.", "Paris.", "Paris."]
    assert j(prompts, completions) == [1.0, 0.2, 0.0, 1.0, 1.0]
    assert len(server.asked) == 2 and all("Here are 2 answers" in a for a in server.asked)
    assert j(["C?"] * 3, ["Lyon."] * 3) == [0.5] * 3  # (nothing to tell apart: no request)
    assert len(server.asked) == 2


def test_the_seed_orders_what_the_judge_sees_not_the_rewards(server):
    orders = set()
    for seed in range(6):
        j = judge(server, seed=seed)
        assert j(["Capital of France?"] * 4, list(SCORES)) == list(SCORES.values())
        orders.add(tuple(re.findall(r"Answer \d+:\n(.*)", server.asked[-1])))
    assert len(orders) > 1


def test_answers_the_judge_gave_no_score_are_none(server):
    server.reply = lambda asked: "1: 0.7\nI cannot judge the others."
    assert sorted(judge(server)(["Q?"] * 3, ["Paris.", "Lyon.", "No idea."]), key=str) == [0.7, None, None]
    server.reply = lambda asked: "They are all fine."
    assert judge(server)(["Q?"] * 2, ["Paris.", "Lyon."]) == [None, None]


def test_rank_scores_reads_the_usual_shapes_and_clips():
    assert rank_scores("1: 0.5\n2 = 1.7\nAnswer 3) 0.25\n[4]. .5\n9: 1\n1: 0", 4) == {
        1: 0.5,
        2: 1.0,
        3: 0.25,
        4: 0.5,
    }
    assert rank_scores("", 3) == {}


def test_a_rank_rubric_names_only_its_fields():
    with pytest.raises(ValueError, match=r"\{completion\}"):
        ml.Judge(mode="rank", rubric="Rate {completion}")
    with pytest.raises(ValueError, match="mode must be one of score, rank"):
        ml.Judge(mode="pairwise")
    assert "mode='rank'" in repr(ml.Judge(mode="rank"))
    assert ml.Judge(mode="rank", rubric="Rank {answers} for {prompt} ({n}; {reference})").mode == "rank"


def test_as_a_reward_its_requests_and_verdicts_go_with_the_samples(server):
    """Used as an RL tenant's reward, the judge logs, per completion, what it asked and what it answered
    (``log_extra``, the column named after it): the recent samples view shows them beside each completion."""
    logged: dict[str, list[str]] = {}
    j = judge(server, name="ruler")
    answers = ["Paris.", "Paris.", "Paris.", "Lyon."]
    rewards = j(["Capital?"] * 2 + ["Other?"] * 2, answers, log_extra=logged.__setitem__)
    assert rewards == [0.5, 0.5, 1.0, 0.2]  # (the first group: two equal answers, no request)
    said = logged["ruler"]
    assert len(said) == 4 and said[0] == said[1] == "(one distinct answer: ½ each, no request)"
    assert said[2] == said[3] and said[2].startswith("asked: ") and "Answer 1:" in said[2]
    assert said[2].endswith("answered: " + scripted(server.asked[0]))
    scored = ml.Judge(model="base", base_url=server.url, api_key="k", name="scorer")
    server.reply = lambda asked: "8"
    assert scored(["Q?"], ["A."], log_extra=logged.__setitem__) == [0.8]
    assert logged["scorer"][0].endswith("answered: 8") and "A." in logged["scorer"][0]
