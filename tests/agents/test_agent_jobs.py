"""Agent tenants in real jobs (issue 51): beside SFT tenants, on two ranks, with tools the model really calls.

- two ranks equal one: an env tenant (a multi-turn rollout given by value) and a tools tenant (``tools=[add]``,
  its reward by value) beside an SFT tenant, launched under torchrun with ``fsdp=2``, end as on one process:
  the same rewards and losses, the same adapters (1e-5);
- a tool-using tenant calls its tools: from an adapter SFT-trained to write ``<tool_call>`` for ``add``, its
  episodes are MODEL · ENV · MODEL, the ENV segment the template's ``<|tool|>`` turn holding the tool's result,
  and the reward functions get the whole conversation, the tool's message included;
- rewards rise for a multi-turn env and a tools tenant in one job with an SFT tenant (3 seeds);
- a conversation that grows past ``seq_len`` is cut to it (a warning row, ``agent/cut``) and the job finishes;
- a tool-loop turn that leaves no room in the model's context ends its episode normally, stop ``"context"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from mlora_lab.job.drivers.base import JobParts, Plan
from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.drivers.rl import Generation, RLDriver
from mlora_lab.job.trainer import Trainer
from mlora_lab.rl.trajectory import ENV, MODEL
from mlora_lab.rundir import RowKind, TenantState
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant

TOL = 1e-5
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road"]
CALLER_TARGETS = [
    "q_proj",
    "v_proj",
    "lm_head",
]  # (a random base's output layer needs adapting to learn a call)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


# -- what the tenants run (given by value: the launch pickles them) ---------------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def guess(client, model, example, rounds=2):
    """A multi-turn game: ``rounds`` answers, "shorter, with <word>" between them; its reward is hits and
    brevity."""
    messages = list(example["messages"])
    hit = brevity = 0.0
    for k in range(rounds):
        m = client.chat.completions.create(model=model, messages=messages).choices[0].message
        messages.append({"role": "assistant", "content": m.content})
        hit += float(example["word"] in m.content)
        brevity -= len(m.content) / 20
        if k + 1 < rounds:
            messages.append({"role": "user", "content": f"shorter, with {example['word']}"})
    return {"rewards": {"hit": hit, "brevity": {"score": brevity, "weight": 0.5}}, "messages": messages}


def tool_reward(prompts, completions, **kwargs):
    """Tool messages count, long answers cost (``completions``: the conversation from the first answer on)."""
    out = []
    for conversation in completions:
        tools = sum(m["role"] == "tool" for m in conversation)
        text = sum(len(m.get("content") or "") for m in conversation if m["role"] == "assistant")
        out.append(tools - text / 40)
    return out


# -- the same, as a file (the in-process jobs) ------------------------------------------------------------------
CODE = '''
import openai

def _said(conversation):
    return "".join(m.get("content") or "" for m in conversation if m["role"] == "assistant")

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b

def short(prompts, completions, **kwargs):
    return [-len(_said(c)) / 10 for c in completions]

def tools_seen(prompts, completions, **kwargs):
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]

def brief(client, model, example, rounds=2):
    messages = list(example["messages"])
    score = 0.0
    for k in range(rounds):
        m = client.chat.completions.create(model=model, messages=messages).choices[0].message
        messages.append({"role": "assistant", "content": m.content})
        score -= len(m.content) / 10
        if k + 1 < rounds:
            messages.append({"role": "user", "content": "shorter"})
    return {"reward": score, "messages": messages}

def grow(client, model, example):
    messages, refused = list(example["messages"]), 0.0
    for k in range(8):
        try:
            m = client.chat.completions.create(model=model, messages=messages).choices[0].message
        except openai.BadRequestError as e:
            assert "context" in str(e), str(e)
            refused = 1.0
            break
        messages += [{"role": "assistant", "content": m.content},
                     {"role": "user", "content": "go on " + "and " * 8}]
    return {"reward": -len(messages) / 10, "metrics": {"refused": refused}, "messages": messages}
'''


def code_file(tmp: Path) -> str:
    path = tmp / "agents_code.py"
    path.write_text(CODE)
    return str(path)


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_rows(n: int = 4) -> list[dict]:
    return [
        {
            "messages": [{"role": "user", "content": f"say {' '.join(WORDS[i : i + 1 + i % 3])} and"}],
            "word": WORDS[(i + 3) % len(WORDS)],
        }
        for i in range(n)
    ]


def question_rows(n: int = 2) -> list[dict]:
    return [{"messages": [{"role": "user", "content": "what is 2 + 3?"}]} for _ in range(n)]


def sft_rows(n: int = 4) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"tell me of the {w}"},
                {"role": "assistant", "content": f"the {w} is {WORDS[(i + 2) % len(WORDS)]}"},
            ]
        }
        for i, w in enumerate(WORDS[:n])
    ]


def tenant(name: str, data: str, rl: RL | None = None, **kw) -> Tenant:
    settings = dict(
        rank=8,
        alpha=16,
        target_modules=TARGETS,
        lr=2e-2,
        batch_size=2,
        max_steps=2,
        max_grad_norm=None,
        eps=1e-4,
        seed=3,
    )
    return Tenant(name=name, data=data, rl=rl, **(settings | kw))


def job(base: str, tenants: list[Tenant], seq_len: int, **kw) -> JobSpec:
    return JobSpec(base_model=base, tenants=tenants, seq_len=seq_len, max_rank=8, max_tenants=8, **kw)


class Recording(RLDriver):
    """The RL driver, keeping every generation its tenants train on."""

    def __init__(self, parts: JobParts) -> None:
        super().__init__(parts)
        self.generations: dict[str, list[Generation]] = {}

    def plan(self) -> Plan | None:
        plan = super().plan()
        for t in plan.tenants if plan is not None else []:
            g = t.feed.current
            if g is not None and g.iteration == 0 and t.name not in plan.failed:
                self.generations.setdefault(t.name, []).append(g)
        return plan


def train(spec: JobSpec, run_dir: Path | None = None) -> tuple[Trainer, Recording]:
    trainer = Trainer(spec, run_dir=run_dir, drivers=(Recording, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    for name, t in trainer.tenants.items():
        assert t.state is TenantState.FINISHED, (name, t.reason)
    (driver, _) = trainer.drivers
    return trainer, driver


def rows_of(trainer: Trainer, name: str) -> list[dict]:
    return [r for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == name]


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(max((a[k][0] - b[k][0]).abs().max().item(), (a[k][1] - b[k][1]).abs().max().item()) for k in a)


# -- an adapter that calls add ----------------------------------------------------------------------------------
def tools_system(tok) -> str:
    """The system block the template writes for ``tools=[add]``, as a system message's content: an SFT row with it
    renders the RL prompt character for character."""
    rendered = chat_render(tok, question_rows(1)[0]["messages"], tools=True)
    head = f"{tok.bos_token}<|system|>\n"
    assert rendered.startswith(head)
    return rendered[len(head) : rendered.index("\n<|user|>")]


def chat_render(tok, messages: list[dict], tools: bool = False, generation: bool = True) -> str:
    from transformers.utils import get_json_schema

    return tok.apply_chat_template(
        messages,
        tools=[get_json_schema(add)] if tools else None,
        tokenize=False,
        add_generation_prompt=generation,
    )


@pytest.fixture(scope="module")
def caller(llama_path, tmp_path_factory) -> str:
    """An adapter SFT-trained (in-process, 60 steps: the loss falls from 6.3 to 0.006) to answer "what is 2 + 3?" with a tool call to ``add``, then,
    after the tool's ``5``, with ``5``: rows whose system message is the tools block, so they render the RL
    tenant's prompt exactly."""
    folder = tmp_path_factory.mktemp("caller")
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    system = {"role": "system", "content": tools_system(tok)}
    question = question_rows(1)[0]["messages"]
    conversation = [
        system,
        *question,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    # the SFT row's prompt is the RL tenant's, token for token
    assert chat_render(tok, [system, *question]) == chat_render(tok, question, tools=True)
    data = write_rows(folder / "calls.jsonl", [{"messages": conversation}] * 4)
    t = tenant("caller", data, target_modules=CALLER_TARGETS, lr=5e-2, max_steps=60, seed=5)
    train(job(llama_path, [t], seq_len=512), run_dir=folder / "run")
    return str(folder / "run" / "adapters" / "caller")


def test_a_tool_using_tenant_calls_its_tools_and_its_rewards_see_the_tool_turns(caller, llama_path, tmp_path):
    code = code_file(tmp_path)
    data = write_rows(tmp_path / "questions.jsonl", question_rows(2))
    rl = RL(
        tools=[f"{code}:add"],
        reward=[f"{code}:tools_seen", f"{code}:short"],
        reward_weights=[1.0, 0.01],
        group_size=2,
        max_new_tokens=64,
        temperature=0.3,
        max_turns=2,
    )
    t = tenant("user", data, rl, init_adapter=caller, target_modules=CALLER_TARGETS, lr=1e-3, max_steps=2)
    trainer, driver = train(job(llama_path, [t], seq_len=512))
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    called = 0
    for g in driver.generations["user"]:
        seen = g.per_function[:, 0].tolist()  # tools_seen: the tool messages its conversation held
        for i, tr in enumerate(g.trajectories):
            messages = g.episodes[i]["messages"]
            tools = [m for m in messages if m["role"] == "tool"]
            assert seen[i] == len(tools), (seen[i], messages)  # the reward got the whole conversation
            sources = [s.source for s in tr.segments]
            if sources[:4] != [ENV, MODEL, ENV, MODEL]:
                continue
            called += 1
            between = tok.decode(list(tr.segments[2].tokens))
            assert "<|tool|>\n5\n" in between and between.endswith("<|assistant|>\n"), between
            assert tok.decode(list(tr.segments[1].tokens), skip_special_tokens=True) == CALL
            asked = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
            assert asked and asked[0]["tool_calls"][0]["function"]["name"] == "add", messages
            arguments = asked[0]["tool_calls"][0]["function"]["arguments"]  # (normalized: a dict)
            assert (json.loads(arguments) if isinstance(arguments, str) else arguments) == {"a": 2, "b": 3}
            assert tools and tools[0]["content"] == "5", messages
            assert g.episodes[i]["turns"] == 2
    assert called >= 1, [g.episodes for g in driver.generations["user"]]
    rows = rows_of(trainer, "user")
    assert max(r["extra"]["rewards/tools_seen/mean"] for r in rows) > 0


def test_a_tool_loop_turn_that_leaves_no_room_ends_its_episode_with_stop_context(
    caller, llama_path, tmp_path
):
    """The model's context (``max_position_embeddings``, a copy of the base with it lowered; ``seq_len`` the same)
    holds the prompt and the tool call (and its EOS) but not the tool's turn after it: the loop's second request
    is refused as a full context (a 400 saying "context"), and the episode ends there normally, stop
    ``"context"``, one turn; the tenant trains and finishes."""
    import shutil

    code = code_file(tmp_path)
    data = write_rows(tmp_path / "questions.jsonl", question_rows(2))
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    question = question_rows(1)[0]["messages"]
    prompt = tok(chat_render(tok, question, tools=True), add_special_tokens=False)["input_ids"]
    answer = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq_len = len(prompt) + len(answer) + 1  # (the tool's turn takes more than one token)
    base = tmp_path / "short"
    shutil.copytree(llama_path, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"max_position_embeddings": seq_len}))
    rl = RL(
        tools=[f"{code}:add"],
        reward=f"{code}:short",
        group_size=2,
        max_new_tokens=64,
        temperature=0.3,
        max_turns=3,
    )
    t = tenant("user", data, rl, init_adapter=caller, target_modules=CALLER_TARGETS, lr=1e-3, max_steps=2)
    _, driver = train(job(str(base), [t], seq_len=seq_len))
    stopped = 0
    for g in driver.generations["user"]:
        for i, tr in enumerate(g.trajectories):
            assert len(tr.tokens) <= seq_len
            said = tok.decode(list(tr.segments[1].tokens), skip_special_tokens=True)
            if said != CALL:  # (an answer without a call ends the loop by itself)
                assert g.episodes[i]["stop"] == "answered", (said, g.episodes[i]["stop"])
                continue
            stopped += 1
            assert g.episodes[i]["stop"] == "context" and g.episodes[i]["turns"] == 1, g.episodes[i]
            assert [s.source for s in tr.segments] == [ENV, MODEL]
    assert stopped >= 1


def test_a_conversation_that_grows_past_seq_len_is_cut_with_a_warning_and_the_job_finishes(
    llama_path, tmp_path
):
    """An env that answers each of 8 answers with a long "go on ...", beside an SFT tenant, at ``seq_len=96``:
    the endpoint lets the episode grow past ``seq_len`` (up to the model's context), the job trains each
    trajectory's first ``seq_len`` tokens (cut, ``truncated``), says so in a warning row, logs ``agent/cut``, and
    finishes."""
    code = code_file(tmp_path)
    data = write_rows(tmp_path / "chat.jsonl", chat_rows(2))
    rl = RL(env=f"{code}:grow", group_size=2, max_new_tokens=6, temperature=0.9)
    sft = tenant("sft", write_rows(tmp_path / "sft.jsonl", sft_rows()))
    seq_len = 96
    trainer, driver = train(job(llama_path, [tenant("grower", data, rl), sft], seq_len=seq_len))
    for g in driver.generations["grower"]:
        for i, tr in enumerate(g.trajectories):
            assert len(tr.tokens) == seq_len and tr.truncated
            assert g.episodes[i]["stop"] == "returned" and g.episodes[i]["turns"] == 8, g.episodes[i]
            messages = g.episodes[i]["messages"]
            assert sum(m["role"] == "assistant" for m in messages) == 8
    rows = rows_of(trainer, "grower")
    assert len(rows) == 2 and len(rows_of(trainer, "sft")) == 2
    assert all(r["extra"]["agent/cut"] == 1.0 for r in rows), [r["extra"] for r in rows]
    warnings = [r for r in trainer.history if r["kind"] == RowKind.EVENT and r.get("event") == "warning"]
    assert any("longer than seq_len" in r["message"] for r in warnings), warnings


def test_rewards_rise_for_a_multi_turn_env_and_a_tools_tenant_beside_an_sft_tenant(llama_path, tmp_path):
    """Three seeds of each, in one job (``lm_head`` adapted: a random base's output layer must move): the mean
    reward of the last 3 generations is above the first 3's for every tenant. Both rewards ask for short answers
    (the env over its two answers, the tool tenant's function over its conversation)."""
    code = code_file(tmp_path)
    chats = write_rows(tmp_path / "chat.jsonl", chat_rows(4))
    questions = write_rows(tmp_path / "questions.jsonl", question_rows(2))
    settings = dict(target_modules=CALLER_TARGETS, lr=5e-2, max_steps=10)
    tenants = [tenant("sft", write_rows(tmp_path / "sft.jsonl", sft_rows()), max_steps=10)]
    for seed in (1, 2, 3):
        brief = RL(env=f"{code}:brief", group_size=4, max_new_tokens=8, temperature=1.0)
        tools = RL(tools=[f"{code}:add"], reward=f"{code}:short", group_size=4, max_new_tokens=8)
        tenants += [
            tenant(f"env{seed}", chats, brief, seed=seed, **settings),
            tenant(f"tools{seed}", questions, tools, seed=seed, batch_size=1, **settings),
        ]
    trainer, _ = train(job(llama_path, tenants, seq_len=448))
    rose = {}
    for t in tenants[1:]:
        rewards = [r["reward"] for r in rows_of(trainer, t.name)]
        assert len(rewards) == 10
        rose[t.name] = (sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3)
    assert all(last > first for first, last in rose.values()), rose


@pytest.mark.slow  # (starts a job under torchrun)
@pytest.mark.parametrize("layout", [{"fsdp": 2}, {"rollout_ranks": 1}], ids=["fsdp2", "rollout-rank"])
def test_two_ranks_equal_one_with_an_env_and_a_tools_tenant_beside_sft(layout, llama_path, tmp_path):
    """Under torchrun with ``fsdp=2``: an env tenant (:func:`guess`, given by value: the launch pickles it), a
    tools tenant (``tools=[add]``, :func:`tool_reward` by value) and an SFT tenant end as the same job on one
    process (the same pickles, read from a run folder as the launch writes them): rank 0 plays the episodes and
    broadcasts them, each rank trains its share of the rows, and the rewards, the losses (1e-5) and the
    adapters (1e-5) agree. With a rollout rank instead (one trainer), every wave of turns is sampled there, with
    the tenants' adapters as of the step: the same run again."""
    import mlora_lab as ml
    from mlora_lab.lab.runs.tenant_data import freeze, write_data
    from mlora_lab.lora import read_adapter
    from mlora_lab.rundir import RunDir

    chats = write_rows(tmp_path / "chat.jsonl", chat_rows(4))
    questions = write_rows(tmp_path / "questions.jsonl", question_rows(2))
    tenants = [
        tenant(
            "env",
            chats,
            RL(env=guess, env_args={"rounds": 2}, group_size=2, max_new_tokens=6, temperature=0.9),
        ),
        tenant(
            "tools",
            questions,
            RL(tools=[add], reward=tool_reward, group_size=3, max_new_tokens=6, max_turns=2),
            batch_size=1,
            seed=7,
        ),
        tenant("sft", write_rows(tmp_path / "sft.jsonl", sft_rows())),
    ]
    here = RunDir(tmp_path / "here").create()
    trainer = Trainer(
        job(llama_path, [write_data(here, freeze(t)) for t in tenants], seq_len=448), run_dir=here.root
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    for name, t in trainer.tenants.items():
        assert t.state is TenantState.FINISHED, (name, t.reason)

    spec = job(llama_path, tenants, seq_len=448, parallel=ml.Parallel(nproc=2, **layout))
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    state = run.wait(300)
    assert state == "finished", f"{state}: {run.error}\n{run.logs(0)}\n{run.logs(1)}"
    m = run.metrics()
    m = m[m["kind"] == "train"]
    assert set(m["tenant"]) == {"env", "tools", "sft"}
    want = {(r["tenant"], r["tenant_step"]): r for r in trainer.history if r["kind"] == RowKind.TRAIN}
    got = m.set_index(["tenant", "tenant_step"]).sort_index()
    assert set(got.index) == set(want)
    rl_keys = [k for k in got.index if k[0] != "sft"]
    assert [got.loc[k, "reward"] for k in rl_keys] == pytest.approx(
        [want[k]["reward"] for k in rl_keys], abs=TOL
    )
    assert list(got["loss"]) == pytest.approx([want[k]["loss"] for k in got.index], abs=TOL)
    for name in ("env", "tools", "sft"):
        x, y = read_adapter(run.adapter_path(name))[1], read_adapter(here.root / "adapters" / name)[1]
        assert max_diff(x, y) <= TOL, name
    if layout.get(
        "rollout_ranks"
    ):  # (the trainer sampled nothing: the rollout rank was busy, and said goodbye)
        busy = [r["rollout_busy"] for r in run.rows() if r["kind"] == "system" and r["rank"] == 0]
        assert sum(b or 0 for b in busy) > 0 and "rollout rank 0: done" in run.logs(1)
