"""``ml.evaluate(..., env=...)``: agent environments as benchmarks (issue 51 §5).

The base and two tenants of a finished run each play a multi-turn env on every example, ``k = 2`` episodes each,
every model's waiting turns sampled together (fewer generations than models × turns); each row's ``env`` column
is what the env returned (its rubric's parts as ``env/<part>``), a metric scores the whole conversation, the base
samples with no adapter, greedy episodes are the same for both samples; ``tools=`` runs the built-in tool loop;
an env that fails names itself; every problem with the env's arguments is named before a model loads.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import task_rows, write_jsonl

import mlora_lab as ml
import mlora_lab.agents.rollouts as rollouts_module
from mlora_lab.agents.envs import STOPS

ROWS = [
    {"messages": [{"role": "user", "content": "guess a colour"}], "word": "red"},
    {"messages": [{"role": "user", "content": "guess an animal"}], "word": "cat"},
]
ROUNDS = 2


def guess(client, model, example, rounds=ROUNDS):
    """A guessing game: ``rounds`` model turns with feedback between them; a rubric of two parts."""
    messages = list(example["messages"])
    hit = length = 0.0
    for k in range(rounds):
        m = client.chat.completions.create(model=model, messages=messages).choices[0].message
        messages.append({"role": "assistant", "content": m.content})
        hit += float(example["word"] in (m.content or ""))
        length -= len(m.content or "") / 20
        if k + 1 < rounds:
            messages.append({"role": "user", "content": "no, try again"})
    return {
        "rewards": {"hit": hit, "length": {"score": length, "weight": 0.5}},
        "messages": messages,
    }


def boom(client, model, example):
    client.chat.completions.create(model=model, messages=example["messages"])
    raise RuntimeError("the env fell over")


def assistant_turns(prompts, completions, **kwargs):
    """A metric over whole conversations: the model's answers in each (None: it does not start with one)."""
    return [
        float(sum(m["role"] == "assistant" for m in c)) if c and c[0]["role"] == "assistant" else None
        for c in completions
    ]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def no_schema(x):
    return x


@pytest.fixture(scope="module")
def run_dir(llama_path, tmp_path_factory):
    """A finished run of two SFT tenants on the tiny llama (their adapters change its greedy text)."""
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.lab.launch import prepare_run

    tmp = tmp_path_factory.mktemp("env_eval")
    data = write_jsonl(tmp / "rev.jsonl", task_rows("reverse", 8))
    tenants = [
        ml.Tenant(name=name, data=data, rank=4, batch_size=2, max_steps=2, lr=lr, seed=seed,
                  target_modules=["q_proj", "v_proj"])
        for name, lr, seed in (("alpha", 5e-2, 1), ("beta", 1e-1, 2))
    ]  # fmt: skip
    spec = ml.JobSpec(base_model=llama_path, tenants=tenants, seq_len=64, max_rank=4,
                      output_dir=str(tmp / "run"))  # fmt: skip
    run = prepare_run(spec)
    trainer = Trainer(ml.JobSpec.load(run.job), run_dir=run.root)
    trainer.train()
    trainer.close()
    return run.root


@pytest.fixture
def generations(monkeypatch):
    """Every generation the agents' wave loop runs: the number of requests in each."""
    calls: list[int] = []
    real = rollouts_module.sample

    def counted(model, requests, **kwargs):
        calls.append(len(requests))
        return real(model, requests, **kwargs)

    monkeypatch.setattr(rollouts_module, "sample", counted)
    return calls


def test_a_multi_turn_env_on_the_base_and_two_tenants_is_scored_by_the_env_and_a_metric(
    run_dir, llama_path, generations
):
    ev = ml.evaluate(
        run_dir, ROWS, [assistant_turns], env=guess, env_args={"rounds": ROUNDS}, num_samples=2,
        temperature=0.0, max_new_tokens=6, name="guessing",
    )  # fmt: skip
    models = ["base", "alpha", "beta"]
    assert ev.models == models
    assert ev.metrics == ["env", "env/hit", "env/length", "assistant_turns"]
    table = ev.examples()
    assert len(table) == len(ROWS) * len(models) * 2
    assert sorted(zip(table["example"], table["model"], table["sample"])) == sorted(
        (e, m, j) for e in range(len(ROWS)) for m in models for j in range(2)
    )

    # the env's own reward, its parts, and the metric over the whole conversation
    for _, row in table.iterrows():
        episode = row["episode"]
        said = [m["content"] or "" for m in episode["messages"] if m["role"] == "assistant"]
        assert len(said) == ROUNDS == episode["turns"] and episode["stop"] == "returned"
        hit = sum(float(row["word"] in s) for s in said)
        length = -sum(len(s) for s in said) / 20
        assert row["env/hit"] == hit and row["env/length"] == pytest.approx(length)
        assert row["env"] == pytest.approx(hit + 0.5 * length)
        assert episode["parts"] == {"hit": [hit, 1.0], "length": [pytest.approx(length), 0.5]}
        assert row["assistant_turns"] == ROUNDS
        assert row["completion"].startswith("assistant: ") and "user: no, try again" in row["completion"]
        assert row["stop_reason"] == "returned" and row["tokens"] >= ROUNDS

    # greedy: both samples of an episode are the same; the models differ (each its own adapter)
    first = {}
    for (e, m), group in table.groupby(["example", "model"]):
        texts = list(group.sort_values("sample").completion)
        assert texts[0] == texts[1]
        first[(e, m)] = texts[0]
    assert len({first[(0, m)] for m in models}) > 1, first

    # every model's turns batched: 2 rounds of 12 episodes in far fewer generations than models × turns
    assert sum(generations) == len(ROWS) * len(models) * 2 * ROUNDS
    assert len(generations) < len(models) * ROUNDS, generations

    # the base's first answer is the base's own greedy continuation (no adapter: tenant=None)
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_path).eval()
    ids = tok.apply_chat_template(ROWS[0]["messages"], add_generation_prompt=True, return_dict=True)
    ids = torch.tensor([list(ids["input_ids"])])
    with torch.no_grad():
        out = base.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
        )
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    got = next(m for m in table[(table.model == "base") & (table.example == 0)].iloc[0]["episode"]["messages"]
               if m["role"] == "assistant")  # fmt: skip
    assert got["content"].strip() == want.strip()

    # the eval table shows an example's columns once per example: an episode is its row's, not among them
    frame = ev.table().frame()
    assert "episode" not in frame.columns and "word" in frame.columns
    assert "user: no, try again" in ev.table(models=["base", "beta"]).html()
    assert all("episode" not in r.columns for r in ev.rows) and len(ev.episodes) == len(ev.rows)

    # the scores table and the saved evaluation
    scores = ev.scores()
    assert list(scores.index) == models and {"env", "env/hit", "assistant_turns"} <= set(scores.columns)
    assert ev.folder is not None and (ev.folder / "env").is_dir()
    again = ml.load_evaluation(run_dir, "guessing")
    assert again.metrics == ev.metrics and again.examples()["episode"].iloc[0] == table["episode"].iloc[0]


def test_the_tool_loop_is_evaluated_by_its_metrics(run_dir):
    rows = [{"prompt": "what is 2 + 3? use the add tool"}]
    ev = ml.evaluate(
        run_dir, rows, [assistant_turns], models=["base", "alpha"], tools=[add], max_turns=2,
        max_new_tokens=8, save=False,
    )  # fmt: skip
    assert ev.metrics == ["assistant_turns"], "the tool loop has no reward of its own: no env column"
    table = ev.examples()
    assert len(table) == 2 and list(table.model) == ["base", "alpha"]
    for _, row in table.iterrows():
        episode = row["episode"]
        assert episode["stop"] in STOPS and 1 <= episode["turns"] <= 2
        assert row["assistant_turns"] == sum(m["role"] == "assistant" for m in episode["messages"])


def test_a_failing_env_names_itself_and_the_model(run_dir):
    with pytest.raises(
        RuntimeError, match=r"evaluate: env boom failed for model 'base': .*the env fell over"
    ):
        ml.evaluate(run_dir, ROWS[:1], env=boom, models=["base"], max_new_tokens=2, save=False)


def test_every_problem_with_the_env_is_named_before_a_model_loads(run_dir, monkeypatch):
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded")
    )
    with pytest.raises(ValueError) as e:
        ml.evaluate(run_dir, ROWS, [], env=42, env_args={"x": object()}, max_turns=0, top_p=0.5)
    text = str(e.value)
    for part in ("env must be 'module:function'", "env_args must hold JSON values", "max_turns = 0",
                 "top_p = 0.5"):  # fmt: skip
        assert part in text, text
    with pytest.raises(ValueError) as e:
        ml.evaluate(run_dir, ROWS, [], tools=[add, no_schema], env_args={"rounds": 2}, turn_timeout_s=0)
    text = str(e.value)
    for part in ("metrics must be a non-empty list", "tools[1] 'no_schema' has no tool schema",
                 "env_args are the keyword arguments of env", "turn_timeout_s = 0"):  # fmt: skip
        assert part in text, text
    with pytest.raises(ValueError, match="column 'episode'"):
        ml.evaluate(run_dir, [dict(ROWS[0], episode=1)], env=guess)


SHORT_TS = """
import verifiers.v1 as vf


class ShortTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def short(self, trace) -> float:
        return -len(trace.messages[-1].content or "") / 10


class ShortTaskset(vf.Taskset[ShortTask, vf.TasksetConfig]):
    def load(self):
        yield ShortTask(vf.TaskData(prompt="say red and"), self.config.task)


__all__ = ["ShortTaskset"]
"""


def test_a_verifiers_taskset_comes_through_the_same_env(run_dir, tmp_path, monkeypatch):
    pytest.importorskip("verifiers.v1", reason="verifiers is not installed (pip install 'mlora_lab[agents]')")
    (tmp_path / "short_ts.py").write_text(SHORT_TS)
    monkeypatch.chdir(tmp_path)  # (the env workers import the taskset from the working directory)
    rows = [{"prompt": "say red and"}, {"messages": [{"role": "user", "content": "say green and"}]}]
    ev = ml.evaluate(
        run_dir, rows, env="verifiers:short_ts", models=["base", "beta"], max_new_tokens=6, save=False
    )
    assert ev.metrics == ["env", "env/short"]
    table = ev.examples()
    assert len(table) == 4
    for _, row in table.iterrows():
        answer = row["episode"]["messages"][-1]
        assert answer["role"] == "assistant" and row["episode"]["stop"] == "answered"
        assert row["env"] == pytest.approx(-len(answer["content"] or "") / 10) == row["env/short"]
