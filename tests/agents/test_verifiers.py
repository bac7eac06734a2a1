"""verifiers 0.4 environments as agent tenants (``rl.env = "verifiers:<taskset id>"``; mlora_lab.agents.vf_harness).

Against verifiers 0.4.0 itself (the ``agents`` extra), with tasksets written here as module files in the worker's
launch directory, on loopback only (the in-process harness: no uv, no MCP program, no container):

- the env worker runs each episode with ``Env.run_episode``: every request names the trajectory
  (``X-Trajectory-Id``, beside verifiers' own ``X-Session-ID``) with the tenant's key; the reward is
  ``trace.reward`` with its weighted parts and the task's metrics; a calculator toolset is served by verifiers
  as MCP and called; a guessing game answers each guess with feedback; a Taskset object pickled by value
  runs as its id does; a role pinning another harness and a tool server that never comes up are named;
- in a job (in-process Trainer, the tiny model), beside an SFT tenant: a single-turn taskset trains exactly as
  today's single-turn RL tenant on the same reward and seed; the calculator and the guessing game finish with
  their rewards' parts logged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "verifiers.v1", reason="verifiers is not installed (pip install 'mlora_lab[agents]': verifiers==0.4.0)"
)

from test_agent_tenants import TOL, WORDS, Recording, chat_file, code_file, job, max_diff, tenant
from test_envs import KEY, StubEndpoint, call, completion

from mlora_lab.agents.envs import EnvConfig, EnvError, EnvWorker, Episode
from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.trainer import Trainer
from mlora_lab.rundir import RowKind, TenantState
from mlora_lab.spec.parts import RL

# The single-turn taskset: its one reward is test_agent_tenants' ``short`` over the answer.
SHORT_TS = """
import verifiers.v1 as vf


class ShortTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def short(self, trace) -> float:
        return -len(trace.messages[-1].content or "") / 10


class ShortTaskset(vf.Taskset[ShortTask, vf.TasksetConfig]):
    def load(self):
        for p in ["say red and", "say green blue and"]:
            yield ShortTask(vf.TaskData(prompt=p), self.config.task)


__all__ = ["ShortTaskset"]
"""

# A calculator toolset: verifiers serves it as an MCP server, ``python -m calc_tools``.
CALC_TOOLS = '''
import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    CalcToolset.run()
'''

CALC_TS = """
import verifiers.v1 as vf
from calc_tools import CalcToolset


def answer(trace) -> str:
    return (trace.messages[-1].content or "") if trace.messages else ""


class CalcData(vf.TaskData):
    answer: int = 5


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def correct(self, task, trace) -> float:
        return float(str(task.answer) in answer(trace))

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return -len(answer(trace)) / 20

    @vf.metric
    async def tool_calls(self, trace) -> float:
        return float(sum(1 for m in trace.messages if m.role == "tool"))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.SharedToolsetConfig())]

    def load(self):
        yield CalcTask(CalcData(prompt="what is 2 + 3?", answer=5), self.config.task)


__all__ = ["CalcTaskset"]
"""

# A guessing game: the env plays the user, answering each guess with feedback (TextArena's shape).
GUESS_TS = """
import verifiers.v1 as vf


class GuessData(vf.TaskData):
    word: str = "cat"


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        hits, guesses = 0.0, 0
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                guesses += 1
                hits += float(task.data.word in segment.last_reply)
                if guesses == self.config.rounds:
                    break
                segment = await interaction.turn("higher" if guesses % 2 == 0 else "lower, try again")
        trace = interaction.trace
        trace.record_reward("hit", hits, 1.0)
        trace.record_reward("length", -sum(len(m.content or "") for m in trace.messages if m.role == "assistant") / 20, 0.5)
        trace.record_metric("guesses", float(guesses))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        yield GuessTask(GuessData(prompt="guess my word", word="cat"), self.config.task)


__all__ = ["GuessEnv", "GuessTaskset"]
"""

# A taskset whose env pins verifiers' uv-installed ``bash`` harness for its agent.
PINNED_TS = SHORT_TS.replace(
    '__all__ = ["ShortTaskset"]',
    """
class PinnedConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "bash"})


class PinnedEnv(vf.Env[PinnedConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["PinnedEnv", "ShortTaskset"]
""",
)

MODULES = {
    "short_ts.py": SHORT_TS,
    "calc_tools.py": CALC_TOOLS,
    "calc_ts.py": CALC_TS,
    "guess_ts.py": GUESS_TS,
}


@pytest.fixture
def launch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tasksets' modules in the launch directory, the env workers' working directory."""
    folder = tmp_path / "launch"
    folder.mkdir()
    for name, text in MODULES.items():
        (folder / name).write_text(text)
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def workers() -> Any:
    made: list[EnvWorker] = []
    yield made
    for w in made:
        w.close()


def worker(workers: list[EnvWorker], endpoint: StubEndpoint, env: str, **kw: Any) -> EnvWorker:
    cfg = EnvConfig(
        env=env,
        tools=[],
        env_args=kw.pop("env_args", {}),
        base_url=endpoint.url,
        api_key=KEY,
        model="agent",
        max_turns=kw.pop("max_turns", 4),
        turn_timeout_s=5.0,
        rollout_timeout_s=kw.pop("rollout_timeout_s", 30.0),
    )
    w = EnvWorker(cfg)
    workers.append(w)
    return w


@pytest.fixture
def endpoint() -> Any:
    stub = StubEndpoint(lambda body: completion("a cat"))
    yield stub
    stub.close()


# -- the env worker against a stub endpoint ------------------------------------------------------------
def test_a_single_turn_taskset_scores_with_its_reward_and_names_the_trajectory(launch_dir, endpoint, workers):
    w = worker(workers, endpoint, "verifiers:short_ts")
    rows = [{"prompt": "say red and"}, {"messages": [{"role": "user", "content": "say green and"}]}]
    results = w.run([Episode(f"traj-{i}", row) for i, row in enumerate(rows)])
    for i, r in enumerate(results):
        assert r.trajectory_id == f"traj-{i}"
        assert r.reward == pytest.approx(-len("a cat") / 10)
        assert r.parts == {"short": pytest.approx((-0.5, 1.0))}
        assert r.turns == 1 and r.stop == "answered"
        assert r.messages[-1] == {"role": "assistant", "content": "a cat"}
    assert results[1].messages[0] == {"role": "user", "content": "say green and"}
    for body, headers in endpoint.requests:
        assert headers["authorization"] == f"Bearer {KEY}"
        assert headers["x-trajectory-id"] in {"traj-0", "traj-1"}
        assert headers["x-session-id"] and headers["x-session-id"] != headers["x-trajectory-id"]
        assert body["model"] == "agent" and body["logprobs"] is True and "tools" not in body
    assert sorted(h["x-trajectory-id"] for _, h in endpoint.requests) == ["traj-0", "traj-1"]


def test_a_calculator_toolset_is_served_and_called_and_its_weighted_parts_sum(launch_dir, endpoint, workers):
    def script(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        last = body["messages"][-1]
        if last["role"] == "user":
            return completion(None, [call("c1", "calc_toolset_add", {"a": 2, "b": 3})])
        return completion(f"it is {last['content']}")

    endpoint.script = script
    w = worker(workers, endpoint, "verifiers:calc_ts")
    (r,) = w.run([Episode("calc-0", {"prompt": "what is 2 + 3?", "answer": 5})])
    tool = [m for m in r.messages if m["role"] == "tool"]
    assert tool and tool[0]["content"] == "5" and tool[0]["tool_call_id"] == "c1", r.messages
    assert r.messages[-1]["content"] == "it is 5" and r.turns == 2 and r.stop == "answered"
    assert r.parts == {"correct": (1.0, 2.0), "brief": pytest.approx((-7 / 20, 0.5))}
    assert r.reward == pytest.approx(2.0 - 0.5 * 7 / 20)
    assert r.metrics["tool_calls"] == 1.0
    first = endpoint.requests[0][0]
    assert [t["function"]["name"] for t in first["tools"]] == ["calc_toolset_add"]
    assert {h["x-trajectory-id"] for _, h in endpoint.requests} == {"calc-0"}


def test_a_guessing_game_answers_each_guess_with_feedback(launch_dir, endpoint, workers):
    w = worker(workers, endpoint, "verifiers:guess_ts")
    (r,) = w.run([Episode("g-0", {"prompt": "guess my word", "word": "cat"})])
    roles = [m["role"] for m in r.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"], r.messages
    assert [m["content"] for m in r.messages if m["role"] == "user"][1:] == ["lower, try again", "higher"]
    assert r.turns == 3 and r.metrics["guesses"] == 3.0
    assert r.parts == {"hit": (3.0, 1.0), "length": pytest.approx((-15 / 20, 0.5))}
    last = endpoint.requests[-1][0]["messages"]  # the whole conversation on the last turn
    assert [m["role"] for m in last] == roles[:-1]


def test_max_turns_ends_the_game_as_a_limit(launch_dir, endpoint, workers):
    w = worker(workers, endpoint, "verifiers:guess_ts", max_turns=2)
    (r,) = w.run([Episode("g-1", {"prompt": "guess my word", "word": "dog"})])
    assert r.turns == 2 and r.stop == "max_turns", r
    assert r.parts["hit"] == (0.0, 1.0)


def test_a_taskset_object_pickled_by_value_runs_as_its_id_does(launch_dir, endpoint, workers, tmp_path):
    import cloudpickle

    taskset = notebook_taskset()
    path = tmp_path / "env-0-ShortTaskset.pkl"
    path.write_bytes(cloudpickle.dumps(taskset))
    w = worker(workers, endpoint, f"{path}:ShortTaskset")
    (r,) = w.run([Episode("obj-0", {"prompt": "say red and"})])
    assert r.parts == {"short": pytest.approx((-0.5, 1.0))} and r.stop == "answered"


LOADER = """
import verifiers.v1 as vf

import short_ts


def load_environment(level: int = 0):
    assert level == 2, level  # (env_args reach the loader)
    return short_ts.ShortTaskset(vf.TasksetConfig())


def not_an_env(level: int = 0):
    return {"level": level}
"""


def test_an_environment_module_s_loader_is_called_with_env_args_as_verifiers_convention_has_it(
    launch_dir, endpoint, workers
):
    """``env="my_env:load_environment"`` with ``env_args``: a function that is not ``rollout(client, model,
    example)`` but takes the env_args is a loader, called once with them; what it returns runs as a verifiers env.
    A loader of something else is named."""
    (launch_dir / "my_env.py").write_text(LOADER)
    w = worker(workers, endpoint, "my_env:load_environment", env_args={"level": 2})
    (r,) = w.run([Episode("l-0", {"prompt": "say red and"})])
    assert r.parts == {"short": pytest.approx((-0.5, 1.0))} and r.stop == "answered"
    with pytest.raises(EnvError, match=r"returned .*level.*, not a verifiers Env or Taskset"):
        worker(workers, endpoint, "my_env:not_an_env", env_args={"level": 2}).run(
            [Episode("l-1", {"prompt": "x"})]
        )


def test_an_env_pinning_another_harness_or_an_unknown_taskset_is_named(launch_dir, endpoint, workers):
    (launch_dir / "pinned_ts.py").write_text(PINNED_TS)
    with pytest.raises(EnvError, match="role 'agent' pins harness 'bash'"):
        worker(workers, endpoint, "verifiers:pinned_ts").run([Episode("p-0", {"prompt": "x"})])
    with pytest.raises(EnvError, match="no_such_ts"):
        worker(workers, endpoint, "verifiers:no_such_ts").run([Episode("n-0", {"prompt": "x"})])


def test_a_tool_server_that_never_comes_up_is_stopped_by_the_start_limit(
    launch_dir, endpoint, workers, monkeypatch
):
    """verifiers waits for a tool server's port forever when its process died (here: a toolset without its
    config type); the worker brings the env up before it says it is ready, so the job's start limit names it."""
    (launch_dir / "broken_tools.py").write_text(
        CALC_TOOLS.replace("vf.Toolset[vf.SharedToolsetConfig]", "vf.Toolset")
    )
    (launch_dir / "broken_ts.py").write_text(CALC_TS.replace("from calc_tools", "from broken_tools"))
    monkeypatch.setattr("mlora_lab.agents.envs.START_TIMEOUT_S", 20.0)
    with pytest.raises(
        EnvError, match=r"starting the env worker took more than 20 s.*importing 'verifiers:broken_ts'"
    ):
        worker(workers, endpoint, "verifiers:broken_ts").run([Episode("b-0", {"prompt": "x"})], timeout=40)


# -- in a job, beside an SFT tenant ------------------------------------------------------------------------
def sft_file(tmp: Path) -> str:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"tell me of the {w}"},
                {"role": "assistant", "content": f"the {w}"},
            ]
        }
        for w in WORDS[:4]
    ]
    path = tmp / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_file(tmp: Path, name: str, rows: list[dict]) -> str:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def train(spec: Any) -> tuple[Trainer, Recording]:
    trainer = Trainer(spec, drivers=(Recording, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    for name, t in trainer.tenants.items():
        assert t.state is TenantState.FINISHED, (name, t.reason)
    (driver, _) = trainer.drivers
    return trainer, driver


def test_a_single_turn_taskset_trains_as_the_single_turn_tenant_beside_an_sft_tenant(
    launch_dir, llama_path, tmp_path
):
    code, data = code_file(tmp_path), chat_file(tmp_path)
    settings = dict(group_size=4, max_new_tokens=8, temperature=0.9)
    plain = tenant("plain", data, RL(reward=f"{code}:short", **settings))
    agent = tenant("agent", data, RL(env="verifiers:short_ts", **settings))
    sft = tenant("sft", sft_file(tmp_path), None)
    trainer, driver = train(job(llama_path, [plain, agent, sft]))
    for (gp, _), (ga, _) in zip(driver.generations["plain"], driver.generations["agent"], strict=True):
        assert gp.tokens == ga.tokens  # the same draws
        assert torch.allclose(gp.rewards, ga.rewards, atol=1e-6)
        assert [r.input_ids for r in gp.rows] == [r.input_ids for r in ga.rows]
        assert [r.labels for r in gp.rows] == [r.labels for r in ga.rows]
        parts = [e["parts"] for e in ga.episodes]
        assert parts == [{"short": [pytest.approx(r), 1.0]} for r in ga.rewards.tolist()]
    assert trainer.losses("agent") == pytest.approx(trainer.losses("plain"), abs=TOL)
    diff = max_diff(trainer.model.tenant_tensors("agent"), trainer.model.tenant_tensors("plain"))
    assert diff <= TOL, f"the verifiers taskset's adapter differs from the single-turn tenant's by {diff}"


def test_the_calculator_and_the_guessing_game_finish_in_a_job_with_their_parts_logged(
    launch_dir, llama_path, tmp_path
):
    calc = rows_file(tmp_path, "calc.jsonl", [{"prompt": "what is 2 + 3?", "answer": 5}] * 2)
    guess = rows_file(
        tmp_path,
        "guess.jsonl",
        [{"prompt": f"guess my word, it starts with {w[0]}", "word": w} for w in WORDS[:2]],
    )
    rl = dict(group_size=2, max_new_tokens=6, temperature=1.0, max_turns=3)
    tenants = [
        tenant("calc", calc, RL(env="verifiers:calc_ts", **rl)),
        tenant("guess", guess, RL(env="verifiers:guess_ts", **rl)),
        tenant("sft", sft_file(tmp_path), None),
    ]
    trainer, driver = train(job(llama_path, tenants, seq_len=512))
    for g, _ in driver.generations["guess"]:
        for i, episode in enumerate(g.episodes):
            messages, turns, parts = episode["messages"], episode["turns"], episode["parts"]
            assert [m["role"] for m in messages[: 2 * turns]] == ["user", "assistant"] * turns
            assert set(parts) == {"hit", "length"} and turns >= 1
            total = parts["hit"][0] * parts["hit"][1] + parts["length"][0] * parts["length"][1]
            assert g.rewards[i].item() == pytest.approx(total, abs=1e-6)
    for g, _ in driver.generations["calc"]:
        for parts in (e["parts"] for e in g.episodes):
            assert set(parts) == {"correct", "brief"} and parts["correct"][1] == 2.0
    logged: dict[str, set[str]] = {}
    for row in trainer.history:
        if row["kind"] == RowKind.TRAIN:
            logged.setdefault(row["tenant"], set()).update(
                k for k in row.get("extra") or {} if k.startswith("rewards/")
            )
    assert {"rewards/hit/mean", "rewards/length/mean"} <= logged["guess"], logged
    assert {"rewards/correct/mean", "rewards/brief/mean"} <= logged["calc"], logged


def test_rewards_rise_for_the_guessing_game_and_the_calculator_beside_an_sft_tenant(
    launch_dir, llama_path, tmp_path
):
    """Three seeds of each verifiers env in one job with an SFT tenant (``lm_head`` adapted: a random base's output
    layer must move): the mean reward of the last 3 generations is above the first 3's for every tenant. Both
    rubrics reward brevity (``length``, ``brief``: weight 0.5), which a tiny model can learn in a few steps."""
    from test_agent_jobs import CALLER_TARGETS

    calc = rows_file(tmp_path, "calc.jsonl", [{"prompt": "what is 2 + 3?", "answer": 5}] * 2)
    guess = rows_file(
        tmp_path,
        "guess.jsonl",
        [{"prompt": f"guess my word, it starts with {w[0]}", "word": w} for w in WORDS[:4]],
    )
    settings = dict(target_modules=CALLER_TARGETS, lr=5e-2, max_steps=10)
    tenants = [tenant("sft", sft_file(tmp_path), None, max_steps=10)]
    for seed in (1, 2, 3):
        rl = dict(group_size=4, max_new_tokens=8, temperature=1.0, max_turns=2)
        tenants += [
            tenant(f"guess{seed}", guess, RL(env="verifiers:guess_ts", **rl), seed=seed, **settings),
            tenant(
                f"calc{seed}", calc, RL(env="verifiers:calc_ts", **rl), seed=seed, batch_size=1, **settings
            ),
        ]
    spec = job(llama_path, tenants, seq_len=512)
    spec.max_tenants = len(tenants)
    trainer, _ = train(spec)
    rose = {}
    for t in tenants[1:]:
        rewards = [
            r["reward"] for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == t.name
        ]
        assert len(rewards) == 10
        rose[t.name] = (sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3)
    assert all(last > first for first, last in rose.values()), rose


def notebook_taskset() -> Any:
    """The single-turn taskset as a notebook holds it: its classes defined in ``__main__``."""
    import verifiers.v1 as vf

    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(SHORT_TS, namespace)
    return namespace["ShortTaskset"](vf.TasksetConfig())


def test_a_taskset_object_trains_in_a_job_pickled_by_value_at_launch(launch_dir, llama_path, tmp_path):
    data = chat_file(tmp_path)
    from mlora_lab.lab.runs.tenant_data import freeze_all, write_all
    from mlora_lab.rundir import RunDir

    t = tenant("agent", data, RL(env=notebook_taskset(), group_size=2, max_new_tokens=6), max_steps=1)
    launched = write_all(
        RunDir(tmp_path / "launched").create(), freeze_all(job(llama_path, [t]))
    )  # (as ml.launch)
    env = launched.tenants[0].rl.env
    assert isinstance(env, str) and env.endswith(".pkl:reward"), env
    _, driver = train(launched)
    episodes = [e for g, _ in driver.generations["agent"] for e in g.episodes]
    assert episodes and all(set(e["parts"]) == {"short"} for e in episodes)


def test_verifiers_envs_are_validated_with_every_problem_at_once(launch_dir, llama_path, tmp_path):
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.validate import problems

    data = chat_file(tmp_path)
    good = [
        tenant("by_id", data, RL(env="verifiers:short_ts")),
        tenant("by_value", data, RL(env=notebook_taskset(), env_args={"system_prompt": None})),
    ]
    assert [str(p) for p in problems(JobSpec(base_model=llama_path, seq_len=128, tenants=good))] == []
    code = code_file(tmp_path)
    bad = [
        tenant("empty", data, RL(env="verifiers:")),
        tenant("tools", data, RL(env="verifiers:short_ts", tools=[f"{code}:short"])),
    ]
    found = "\n".join(str(p) for p in problems(JobSpec(base_model=llama_path, seq_len=128, tenants=bad)))
    for expected in [
        "rl.env 'verifiers:' names no taskset: write 'verifiers:<taskset id>'",
        "rl.tools are not used by a verifiers environment (rl.env): its tools are its taskset's toolsets",
    ]:
        assert expected in found, f"{expected!r} not in:\n{found}"
