"""Agent tenants in the spec: ``ml.RL(env=..., env_args=..., tools=[...], max_turns=...)`` in job.json, their
validation (every problem at once, before anything starts), and functions given by value pickled at launch."""

from __future__ import annotations

import json
from pathlib import Path

from mlora_lab.lab.runs.tenant_data import freeze, write_data
from mlora_lab.rundir import RunDir
from mlora_lab.sources import RewardSnapshot
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems as spec_problems

ENV = """
def rollout(client, model, example, rounds=2):
    return 1.0

def add(a: int, b: int) -> int:
    '''Add two numbers.

    Args:
        a: the first
        b: the second
    '''
    return a + b

def score(completions, **kwargs):
    return [0.0 for _ in completions]
"""


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def chats(tmp: Path) -> str:
    rows = [{"messages": [{"role": "user", "content": "2 + 2?"}], "answer": "4"}]
    return write(tmp / "chat.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def texts(spec: JobSpec) -> list[str]:
    return [str(p) for p in spec_problems(spec)]


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first
        b: the second
    """
    return a * b


def no_docstring(a: int) -> int:
    return a


def test_agent_settings_round_trip_through_job_json_and_their_files_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rl = RL(
        env="env.py:rollout",
        env_args={"rounds": 3, "level": "hard"},
        tools=["env.py:add", "operator:mul"],
        reward="env.py:score",
        max_turns=5,
        turn_timeout_s=7.5,
        rollout_timeout_s=90,
    )
    spec = JobSpec(base_model="m", tenants=[Tenant(name="a", data="p.jsonl", rl=rl)])
    spec.to_json(tmp_path / "job.json")
    back = JobSpec.load(tmp_path / "job.json").resolved(str(tmp_path)).tenants[0].rl
    assert back.env == f"{tmp_path / 'env.py'}:rollout"
    assert back.tools == [f"{tmp_path / 'env.py'}:add", "operator:mul"]
    assert back.env_args == {"rounds": 3, "level": "hard"}
    assert (back.max_turns, back.turn_timeout_s, back.rollout_timeout_s) == (5, 7.5, 90)
    assert back.agent and not RL(reward="m:f").agent


def test_a_good_agent_tenant_validates_and_its_env_may_stand_for_the_reward(tmp_path, llama_path):
    env = write(tmp_path / "env.py", ENV)
    spec = JobSpec(
        base_model=llama_path,
        seq_len=128,
        tenants=[
            Tenant(name="env", data=chats(tmp_path), rl=RL(env=f"{env}:rollout", env_args={"rounds": 3})),
            Tenant(
                name="tools",
                data=chats(tmp_path),
                rl=RL(tools=[f"{env}:add", multiply], reward=f"{env}:score"),
            ),
        ],
    )
    assert texts(spec) == []


def test_bad_agent_settings_are_all_reported_at_once(tmp_path, llama_path):
    data = chats(tmp_path)
    bad = [
        Tenant(name="a", data=data, rl=RL(env=42, env_args={"x": {1, 2}}, top_p=0.9, max_turns=0)),
        Tenant(name="b", data=data, rl=RL(tools="add", turn_timeout_s=0, rollout_timeout_s=-1)),
        Tenant(name="c", data=data, rl=RL(tools=[multiply, no_docstring, multiply, "no module"])),
        Tenant(name="d", data=data, rl=RL(reward=None, env_args={"rounds": 2})),
    ]
    found = "\n".join(texts(JobSpec(base_model=llama_path, seq_len=128, tenants=bad)))
    for expected in [
        "rl.env must be 'module:function', 'file.py:function' or a function (got 42 of type int)",
        "rl.env_args must hold JSON values only",
        "an agent tenant samples with every token allowed (top_p=1, top_k=0; got top_p=0.9",
        "rl.max_turns must be >= 1 (got 0)",
        "rl.tools must be a list of functions",
        "rl.turn_timeout_s must be in (0, 86400] (got 0)",
        "rl.rollout_timeout_s must be in (0, 86400] (got -1)",
        "rl.tools[1] 'no_docstring' has no tool schema",
        "rl.tools has two tools named 'multiply'",
        "rl.tools[3]: reward 'no module' is not 'module:function'",
        "rl.reward is required (the functions that score completions), unless rl.env gives each episode's reward",
        "rl.env_args are the keyword arguments of rl.env, and there is no rl.env",
    ]:
        assert expected in found, f"{expected!r} not in:\n{found}"


def test_an_env_and_tools_given_by_value_are_pickled_at_launch_and_named_in_job_json(tmp_path):
    def rollout(client, model, example):
        return float(multiply(2, 3))

    t = Tenant(
        name="a", data="p.jsonl", rl=RL(env=rollout, tools=[multiply], reward=lambda completions, **kw: [0.0])
    )
    frozen = freeze(t)
    assert isinstance(frozen.rl.env, RewardSnapshot) and frozen.rl.env.name == "rollout"
    assert all(isinstance(f, RewardSnapshot) for f in frozen.rl.tools)
    assert frozen.rl.reward_names == ["<lambda #1>"]
    run = RunDir(tmp_path / "run").create()
    written = write_data(run, frozen)
    env_path, env_name = written.rl.env.rsplit(":", 1)
    assert env_name == "rollout" and Path(env_path).name == "env0-rollout.pkl" and Path(env_path).is_file()
    assert [Path(f.rsplit(":", 1)[0]).name for f in written.rl.tools] == ["tool0-multiply.pkl"]
    assert Path(written.rl.reward.rsplit(":", 1)[0]).name == "0-reward.pkl"
    import cloudpickle

    assert cloudpickle.loads(Path(env_path).read_bytes())(None, "a", {}) == 6.0
