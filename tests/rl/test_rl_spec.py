"""RL tenants in the spec: ``ml.RL`` in job.json, and validation of its settings, its prompt rows and its
reward functions, every problem reported at once before anything starts."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import mlora_lab as ml
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems as spec_problems

REWARDS = """
def short(completions, **kwargs):
    return [-len(c) for c in completions]

def with_answer(prompts, completions, answer, **kwargs):
    return [float(a in c) for a, c in zip(answer, completions)]

def wrong(text):
    return [0.0]
"""


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def prompts(tmp: Path, name: str = "prompts.jsonl") -> str:
    rows = [
        {"prompt": "2 + 2 =", "answer": "4"},
        {"messages": [{"role": "user", "content": "3 + 1?"}], "answer": "4"},
    ]
    return write(tmp / name, "".join(json.dumps(r) + "\n" for r in rows))


def texts(spec: JobSpec) -> list[str]:
    return [str(p) for p in spec_problems(spec)]


def test_rl_settings_round_trip_through_job_json_and_file_rewards_become_absolute(tmp_path):
    rl = RL(
        reward=["rewards.py:short", "trl.rewards:think_format_reward"],
        reward_weights=[1.0, 0.5],
        group_size=4,
        max_new_tokens=16,
        stop=["\n\n"],
        loss_type="grpo",
        beta=0.04,
    )
    spec = JobSpec(
        base_model="m", tenants=[Tenant(name="a", data="p.jsonl", rl=rl), Tenant(name="b", data="s.jsonl")]
    )
    d = json.loads(spec.to_json())
    assert d["tenants"][0]["rl"]["reward"] == ["rewards.py:short", "trl.rewards:think_format_reward"]
    assert d["tenants"][1]["rl"] is None
    again = JobSpec.from_dict(d)
    assert again == spec and isinstance(again.tenants[0].rl, RL)
    spec.to_json(tmp_path / "job.json")
    loaded = JobSpec.load(tmp_path / "job.json")
    assert loaded.tenants[0].rl.reward == [
        f"{tmp_path / 'rewards.py'}:short",
        "trl.rewards:think_format_reward",
    ]
    assert Tenant(name="c", data="x", rl={"reward": "m:f", "group_size": 2}).rl == RL(
        reward="m:f", group_size=2
    )
    assert ml.RL is RL


def test_unknown_rl_keys_are_named_with_every_other_problem():
    d = {
        "base_model": "m",
        "tenants": [{"name": "a", "data": "p", "rl": {"rewards": "m:f", "group": 2}, "lrr": 1}],
    }
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(d)
    message = str(e.value)
    assert "tenants[0] ('a'): unknown field 'lrr' (did you mean 'lr'?)" in message
    assert "tenants[0] ('a').rl: unknown fields 'rewards' (did you mean 'reward'?), 'group'" in message
    assert "missing required field reward" not in message  # (rl.reward may be left out: an agent's env
    # gives rewards; validation says when it is needed)


def test_a_good_rl_tenant_validates_beside_an_sft_tenant(tmp_path, llama_path, make_data):
    rewards = write(tmp_path / "rewards.py", REWARDS)
    spec = JobSpec(
        base_model=llama_path,
        seq_len=64,
        tenants=[
            Tenant(
                name="rl",
                data=prompts(tmp_path),
                rl=RL(reward=[f"{rewards}:short", f"{rewards}:with_answer"], group_size=4, max_new_tokens=16),
            ),
            Tenant(name="sft", data=make_data("text")),
        ],
    )
    assert texts(spec) == []


def test_bad_rl_settings_are_all_reported_at_once(tmp_path, llama_path):
    rewards = write(tmp_path / "rewards.py", REWARDS)
    data = prompts(tmp_path)
    bad = RL(
        reward=[f"{rewards}:short", "no module"],
        reward_weights=[1.0],
        group_size=1,
        max_new_tokens=0,
        temperature=0.0,
        top_p=1.5,
        top_k=-1,
        stop=[""],
        loss_type="ppo",
        epsilon=0.0,
        beta=-1.0,
        num_iterations=0,
        scale_rewards="std",
        reward_timeout_s=0,
    )
    spec = JobSpec(base_model=llama_path, seq_len=64, tenants=[Tenant(name="a", data=data, rl=bad)])
    found = "\n".join(texts(spec))
    for expected in [
        "rl.group_size must be >= 2 (got 1)",
        "rl.max_new_tokens must be >= 1 (got 0)",
        "rl.temperature must be in (0, 100] (got 0.0)",
        "rl.top_p must be in (0, 1] (got 1.5)",
        "rl.top_k must be >= 0 (got -1)",
        "rl.stop must be a list of non-empty strings",
        "rl.loss_type must be one of dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo (got 'ppo')",
        "rl.epsilon must be in (0, 10] (got 0.0)",
        "rl.beta must be in [0, 100] (got -1.0)",
        "rl.num_iterations must be >= 1",
        "rl.scale_rewards must be one of group, batch, none (got 'std')",
        "rl.reward_timeout_s must be in (0, 86400] (got 0)",
        "reward 'no module' is not 'module:function'",
    ]:
        assert expected in found, expected
    long = RL(reward=f"{rewards}:short", max_new_tokens=64, reward_weights=[1.0, 2.0])
    spec = JobSpec(
        base_model=llama_path, seq_len=64, tenants=[Tenant(name="a", data=data, heldout_data=data, rl=long)]
    )
    found = "\n".join(texts(spec))
    assert "rl.max_new_tokens=64 leaves no room for a prompt in seq_len=64" in found
    assert "rl.reward_weights has 2 weights for 1 reward functions" in found
    assert "an RL tenant has no heldout_data" in found


def test_reward_functions_are_checked_against_the_rows_before_launch(tmp_path, llama_path):
    rewards = write(tmp_path / "rewards.py", REWARDS)
    write(tmp_path / "hangs_on_import.py", "import time\ntime.sleep(0)\nraise RuntimeError('bad config')\n")
    no_answer = write(tmp_path / "plain.jsonl", '{"prompt": "hi"}\n')
    refs = [
        f"{rewards}:with_answer",
        f"{rewards}:wrong",
        f"{rewards}:nope",
        f"{tmp_path / 'none.py'}:f",
        f"{tmp_path / 'hangs_on_import.py'}:f",
    ]
    spec = JobSpec(
        base_model=llama_path, seq_len=128, tenants=[Tenant(name="a", data=no_answer, rl=RL(reward=refs))]
    )
    found = texts(spec)
    assert len(found) == 6, found
    joined = "\n".join(found)
    assert (
        "'with_answer' (" in joined
        and "needs 'answer', which no data row has (the rows' columns: prompt)" in joined
    )
    assert "reward 'wrong' (" in joined and "does not take prompts or completions" in joined
    assert "needs 'text'" in joined
    assert "has no 'nope'" in joined
    assert "no file" in joined
    assert "raised RuntimeError: bad config" in joined


def test_rl_rows_are_prompts(tmp_path, llama_path):
    rewards = write(tmp_path / "rewards.py", REWARDS)
    rows = [
        '{"prompt": "ok"}',
        '{"text": "not a prompt"}',
        '{"prompt": "a", "messages": []}',
        '{"prompt": ""}',
        '{"messages": [{"role": "user"}]}',
        '{"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}',  # TRL's conversational rows
        '{"prompt": [{"role": "user"}]}',
        '{"prompt": "x", "completions": "mine", "trainer_state": 1}',  # names the job gives the rewards
    ]
    data = write(tmp_path / "rows.jsonl", "\n".join(rows) + "\n")
    spec = JobSpec(
        base_model=llama_path,
        seq_len=64,
        tenants=[Tenant(name="a", data=data, rl=RL(reward=f"{rewards}:short"))],
    )
    joined = "\n".join(texts(spec))
    needs = "an RL row needs 'prompt' (a text, or a chat as a list of messages) or 'messages' to complete"
    assert f"line 2: {needs}; this one has neither" in joined
    assert f"line 3: {needs}; this one has both" in joined
    assert "line 4: 'prompt' must be a non-empty string" in joined
    assert "line 5: messages[0] needs 'role' and 'content' strings" in joined
    assert "line 6" not in joined, joined  # (a conversational prompt is a prompt)
    assert "line 7: prompt[0] needs 'role' and 'content' strings" in joined
    for column in ("completions", "trainer_state"):
        assert f"line 8: column {column!r} has a name the job itself passes every reward function" in joined
    # the same rows are not SFT rows: a prompt without completion is refused there
    sft = JobSpec(
        base_model=llama_path,
        seq_len=64,
        tenants=[Tenant(name="a", data=write(tmp_path / "p.jsonl", '{"prompt": "x"}\n'))],
    )
    assert "'prompt' without 'completion'" in "\n".join(texts(sft))


def test_a_tenant_with_rl_added_to_a_running_job_is_checked_the_same(tmp_path, llama_path):
    from mlora_lab.validate import tenant_problems

    job = JobSpec(
        base_model=llama_path,
        seq_len=64,
        tenants=[Tenant(name="a", data=prompts(tmp_path), rl=RL(reward="m:f"))],
    )
    write(tmp_path / "r.py", textwrap.dedent(REWARDS))
    found = [
        str(p)
        for p in tenant_problems(
            job,
            Tenant(name="b", data=prompts(tmp_path, "b.jsonl"), rl=RL(reward=f"{tmp_path / 'r.py'}:wrong")),
        )
    ]
    assert any("does not take prompts or completions" in f for f in found), found


def test_rl_tenants_accumulate_and_sample_at_any_temperature(tmp_path, llama_path):
    """Gradient accumulation (each step's generation trained in micro-batches) and a sampling temperature
    other than 1 (the loss scores at it) validate like any other setting."""
    rewards = write(tmp_path / "rewards.py", REWARDS)
    rl = RL(reward=f"{rewards}:short", temperature=0.7, group_size=2, max_new_tokens=8)
    tenant = Tenant(name="a", data=prompts(tmp_path), rl=rl, grad_accum=2)
    assert texts(JobSpec(base_model=llama_path, seq_len=64, tenants=[tenant])) == []


def test_a_generation_that_cannot_fit_the_machine_is_refused_before_launch(tmp_path, llama_path):
    """group_size=4096 × batch_size=64 passed validation and then could not be generated: every completion of
    a step is generated at once, so the KV cache and logits of them all are estimated against the machine."""
    from mlora_lab.validate.introspect import device_memory, model_info

    rewards = write(tmp_path / "rewards.py", REWARDS)
    data = write(tmp_path / "rows.jsonl", '{"prompt": "ok"}\n')
    huge = Tenant(name="a", data=data, batch_size=64, rl=RL(reward=f"{rewards}:short", group_size=4096))
    said = texts(JobSpec(base_model=llama_path, seq_len=2048, tenants=[huge]))
    total, device = device_memory()
    info = model_info(str(llama_path))
    need = 64 * 4096 * (2048 * info.kv_per_token * 4 + info.logits * 12)
    assert need > total  # (the estimate this machine is checked against)
    assert len(said) == 1 and "the RL tenants' generation needs about" in said[0], said
    assert "262,144 sequences" in said[0] and f"but {device} has" in said[0]
    small = Tenant(name="a", data=data, batch_size=2, rl=RL(reward=f"{rewards}:short", group_size=4))
    assert texts(JobSpec(base_model=llama_path, seq_len=128, tenants=[small])) == []


def _letters(completions, **kwargs):
    return [c.count("e") / 4 for c in completions]


def test_m9_reward_names_are_validated_filled_for_functions_given_by_value_and_kept_in_job_json(
    tmp_path, llama_path
):
    """m9: ``reward_names`` names each reward function's columns (``rewards/<name>/mean``): one per function,
    distinct, no '/' (the columns' separator); functions given by value get theirs when frozen at launch
    (a lambda ``<lambda #k>``, the k-th of the tenant's lambdas), and job.json keeps them."""
    from mlora_lab.lab.runs.tenant_data import freeze

    rewards = write(tmp_path / "rewards.py", REWARDS)
    data = prompts(tmp_path)
    two = [f"{rewards}:short", f"{rewards}:with_answer"]
    for names, expected in [
        (["one"], "rl.reward_names has 1 names for 2 reward functions; give one name per function"),
        (["same", "same"], "rl.reward_names names two functions 'same'"),
        (["a/b", "c"], "rl.reward_names: 'a/b' holds a '/' (the columns are rewards/<name>/mean)"),
        ([" ", "c"], "rl.reward_names: ' ' is blank"),
        ("short", "rl.reward_names must be a list of non-empty strings"),
    ]:
        spec = JobSpec(
            base_model=llama_path,
            seq_len=64,
            tenants=[Tenant(name="a", data=data, rl=RL(reward=two, reward_names=names))],
        )
        assert any(expected in t for t in texts(spec)), (names, texts(spec))
    named = RL(reward=two, reward_names=["brevity", "right"])
    spec = JobSpec(base_model=llama_path, seq_len=128, tenants=[Tenant(name="a", data=data, rl=named)])
    assert texts(spec) == []
    spec.to_json(tmp_path / "job.json")
    assert JobSpec.load(tmp_path / "job.json").tenants[0].rl.reward_names == ["brevity", "right"]

    def frozen(*fns, **kw):
        return freeze(Tenant(name="a", data=data, rl=RL(reward=list(fns), **kw))).rl.reward_names

    assert frozen(lambda completions, **kw: [0.0], lambda completions, **kw: [1.0]) == [
        "<lambda #1>",
        "<lambda #2>",
    ]
    assert frozen(_letters, lambda completions, **kw: [0.0], f"{rewards}:short") == [
        "_letters",
        "<lambda #1>",
        "short",
    ]
    assert frozen(lambda completions, **kw: [0.0], reward_names=["mine"]) == ["mine"]
    assert frozen(f"{rewards}:short") is None  # (no function held in memory: nothing to fill)


SHAPES = """
def text_only(completions, **kwargs):      # a text reward: a chat's completion has no .split
    return [len(c.split()) / 10 for c in completions]

def picky(completions, **kwargs):          # raises on a completion it cannot parse: its own choice
    return [float(c) for c in completions]

def slow(completions, **kwargs):           # one row within the probe's time, it is called once
    return [1.0 for c in completions]

class Scorer:                               # a callable object (as ml.Judge is): not called before launch
    def __call__(self, completions, **kwargs):
        raise TypeError("called")

scorer = Scorer()
"""


def test_m7_each_reward_is_called_once_on_a_row_of_the_data_before_launch(tmp_path, llama_path):
    """m7: TRL's ``think_format_reward`` (it reads ``completion[0]["content"]``) on text prompts, and a text
    reward on chat prompts, are refused before launch: each reward function is called once in the worker, on
    the first row of each prompt shape in the data with a sample completion of that shape (a text; a list of
    one assistant message), and a TypeError or AttributeError there (a type mismatch) is one problem naming
    the tenant, the reward and the error. What raises on the sample's text (``float("...")``), and a callable
    object (a judge asks a model), are not judged there."""
    pytest.importorskip("trl")
    shapes = write(tmp_path / "shapes.py", SHAPES)
    text = write(tmp_path / "text.jsonl", '{"prompt": "2 + 2 ="}\n')
    chat = write(tmp_path / "chat.jsonl", '{"prompt": [{"role": "user", "content": "2 + 2?"}]}\n')

    def said(data, *refs):
        tenant = Tenant(name="t", data=data, rl=RL(reward=list(refs), max_new_tokens=8))
        return texts(JobSpec(base_model=llama_path, seq_len=64, tenants=[tenant]))

    got = said(text, "trl.rewards:think_format_reward", f"{shapes}:text_only", f"{shapes}:picky")
    assert len(got) == 1, got
    assert got[0].startswith("tenant 't': reward 'think_format_reward' (trl.rewards), called once on a text ")
    assert "raised TypeError: string indices must be integers" in got[0]
    assert "a text prompt's completion is a text" in got[0]
    got = said(chat, "trl.rewards:think_format_reward", f"{shapes}:text_only", f"{shapes}:scorer")
    assert len(got) == 1 and "reward 'text_only' (" in got[0], got
    assert "raised AttributeError: 'list' object has no attribute 'split'" in got[0]
    mixed = write(
        tmp_path / "mixed.jsonl", '{"prompt": "2 + 2 ="}\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    got = said(mixed, f"{shapes}:text_only")
    assert len(got) == 1 and "called once on a chat prompt of the data" in got[0], got
    assert said(text, f"{shapes}:text_only", f"{shapes}:slow") == []


def test_a_generation_sampled_ahead_or_beside_a_whole_base_on_a_rollout_rank_is_estimated(
    tmp_path, llama_path
):
    """``max_staleness`` draws its first ``1 + s // num_iterations`` generations in one batch, and a rollout
    rank holds the whole base beside them: a job that fits without them but not with them is refused."""
    from mlora_lab.spec.parts import Parallel
    from mlora_lab.validate.introspect import device_memory, model_info

    rewards = write(tmp_path / "rewards.py", REWARDS)
    data = write(tmp_path / "rows.jsonl", '{"prompt": "ok"}\n')
    total, _ = device_memory()
    info = model_info(str(llama_path))
    per_row = 1024 * info.kv_per_token * 4 + info.logits * 12
    group = 1024
    batch = int(0.4 * total / (per_row * group)) + 1  # (one generation: ~40 % of the machine)
    assert batch * group * per_row < total < 4 * batch * group * per_row

    def said(**rl) -> list[str]:
        t = Tenant(
            name="a", data=data, batch_size=batch, rl=RL(reward=f"{rewards}:short", group_size=group, **rl)
        )
        return [
            s for s in texts(JobSpec(base_model=llama_path, seq_len=1024, tenants=[t])) if "needs about" in s
        ]

    assert said() == [] and said(max_staleness=3, num_iterations=2) == []  # (two generations at once: 80 %)
    (ahead,) = said(max_staleness=3)  # four at once
    assert f"{4 * batch * group:,} sequences" in ahead and "max_staleness" in ahead
    t = Tenant(name="a", data=data, batch_size=batch, rl=RL(reward=f"{rewards}:short", group_size=group))
    spec = JobSpec(
        base_model=llama_path, seq_len=1024, tenants=[t], parallel=Parallel(nproc=2, rollout_ranks=1)
    )
    assert not [s for s in texts(spec) if "needs about" in s]  # (a tiny base adds next to nothing)
    spec.tenants[0].rl.max_staleness = 3
    (there,) = [s for s in texts(spec) if "needs about" in s]
    assert "on a rollout rank beside the whole base (~0.0 GiB)" in there
