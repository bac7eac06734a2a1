"""Harness mode (issue 51 §3, ``RL(harness=True)``): any agent program trains a tenant.

- a scripted agent program through ``openai.OpenAI`` (two turns with a feedback message between) claims the
  published episodes, plays them and posts their rewards; the job trains two steps on them: each captured
  trajectory is exactly the tokens the program was answered with (``prompt_token_ids`` of its first turn, then
  ``choices[0].token_ids`` of each turn), the rewards are the ones posted, groups are per example;
- a shell-ish program (``curl`` through subprocess) plays one turn and posts the reward;
- bad reward bodies get 400/404/409 naming the problem, another tenant's key 401/404; a program that never
  rewards fails its tenant after ``rollout_timeout_s`` with the reason, and an SFT tenant beside it goes on;
- a launched run: the test drives its harness tenant through ``run.agent_endpoint`` / ``agent_client`` /
  ``episodes`` / ``reward``; it finishes, its ``agents.json`` is owner-only;
- validation: a harness with an env or tools is named; a harness needs no reward function.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

import mlora_lab as ml
from mlora_lab.job.drivers.base import JobParts, Plan
from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.drivers.rl import Generation, RLDriver
from mlora_lab.job.trainer import Trainer
from mlora_lab.rl.trajectory import ENV, MODEL
from mlora_lab.rundir import TenantState
from mlora_lab.rundir.agents import agents_path
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road"]


def chat_file(tmp: Path, n: int = 4) -> str:
    rows = [
        {
            "messages": [{"role": "user", "content": f"say {WORDS[i]} and"}],
            "word": WORDS[(i + 3) % len(WORDS)],
        }
        for i in range(n)
    ]
    path = tmp / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_file(tmp: Path, n: int = 4) -> str:
    rows = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in WORDS[:n]
    ]
    path = tmp / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tenant(name: str, data: str, rl: RL | None = None, **kw: Any) -> Tenant:
    settings = dict(
        rank=4,
        alpha=8,
        target_modules=["q_proj", "v_proj"],
        lr=2e-2,
        batch_size=2,
        max_steps=2,
        max_grad_norm=None,
        seed=3,
    )
    return Tenant(name=name, data=data, rl=rl, **(settings | kw))


def job(base: str, tenants: list[Tenant], seq_len: int = 128) -> JobSpec:
    return JobSpec(base_model=base, tenants=tenants, seq_len=seq_len, max_rank=8, max_tenants=4)


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


def rl_driver(trainer: Trainer) -> Any:
    return next(d for d in trainer.drivers if isinstance(d, RLDriver))


class Running:
    """An in-process Trainer on a thread; its agents' endpoint once it opens."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.error = trainer, None
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as e:  # (said by the test's thread)
            self.error = e

    def endpoint(self, timeout: float = 120.0) -> tuple[str, dict[str, str]]:
        """The endpoint's base URL and the harness tenants' keys, once the first generation is published."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rollouts = rl_driver(self.trainer).rollouts
            if rollouts is not None and rollouts.endpoint is not None and rollouts.endpoint.keys():
                return rollouts.endpoint.url, rollouts.endpoint.keys()
            assert self.thread.is_alive(), f"the job ended before publishing: {self.error!r}"
            time.sleep(0.05)
        raise AssertionError("no agents' endpoint in time")

    def done(self, timeout: float = 300.0) -> Trainer:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the job did not end in time"
        self.trainer.close()
        assert self.error is None, repr(self.error)
        return self.trainer


def http(method: str, url: str, key: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def claim(base: str, key: str, limit: int = 16, wait: float = 0.5) -> list[dict[str, Any]]:
    status, got = http("GET", f"{base}/episodes?limit={limit}&wait={wait}", key)
    assert status == 200, got
    return got["data"]


def test_a_scripted_agent_trains_a_harness_tenant_and_its_captured_trace_equals_the_sampled_tokens(
    llama_path, tmp_path
):
    data = chat_file(tmp_path)
    rl = RL(harness=True, group_size=2, max_new_tokens=6, temperature=1.0)
    running = Running(Trainer(job(llama_path, [tenant("agent", data, rl)]), drivers=(Recording, FileData)))
    base, keys = running.endpoint()
    answered: dict[str, dict[str, Any]] = {}  # trajectory -> what the program was told, and what it posted
    while running.thread.is_alive():
        for e in claim(base, keys["agent"]):
            tid, example = e["trajectory_id"], e["example"]
            client = openai.OpenAI(
                base_url=base, api_key=keys["agent"], default_headers={"X-Trajectory-Id": tid}, max_retries=0
            )
            messages = list(example["messages"])
            turns = []
            for k in range(2):
                a = client.chat.completions.create(model="agent", messages=messages).model_dump()
                turns.append(a)
                messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
                if k == 0:
                    messages.append({"role": "user", "content": f"not quite: say {example['word']}"})
            text = " ".join(t["choices"][0]["message"]["content"] for t in turns)
            hit = float(example["word"] in text)
            rewards = {"length": {"score": len(text) / 10, "weight": 0.5}, "hit": hit}
            status, got = http(
                "POST",
                f"{base}/trajectories/{tid}/reward",
                keys["agent"],
                {"rewards": rewards, "metrics": {"k": 2}},
            )
            assert (status, got) == (200, {"ok": True})
            answered[tid] = {"turns": turns, "reward": len(text) / 20 + hit, "example": example}
    trainer = running.done()
    assert trainer.tenants["agent"].state is TenantState.FINISHED, trainer.tenants["agent"].reason
    generations = rl_driver(trainer).generations["agent"]
    assert len(generations) == 2 and len(answered) == 2 * 2 * 2  # 2 steps · B=2 · G=2
    for g in generations:
        assert g.trajectories is not None and len(g.trajectories) == 4
        ids = [f"agent/{g.index}/{b}/{j}" for b in range(2) for j in range(2)]
        for i, (tid, tr) in enumerate(zip(ids, g.trajectories, strict=True)):
            told = answered[tid]["turns"]
            sampled = [t["choices"][0]["token_ids"] for t in told]
            assert [list(s.tokens) for s in tr.segments if s.source == MODEL] == sampled
            assert tr.segments[0].source == ENV and list(tr.segments[0].tokens) == told[0]["prompt_token_ids"]
            # the second turn's prompt is the first one's ids, the answer, and the feedback, appended
            assert [t for s in tr.segments[:3] for t in s.tokens] == told[1]["prompt_token_ids"]
            assert [t for s in tr.segments for t in s.tokens] == told[1]["prompt_token_ids"] + sampled[1]
            assert g.per_function[i, 0].item() == pytest.approx(answered[tid]["reward"], abs=1e-6)
            assert g.rewards[i].item() == pytest.approx(answered[tid]["reward"], abs=1e-5)
        for b in range(2):  # a group: the G episodes of one example, drawn from the tenant's data
            group = [answered[f"agent/{g.index}/{b}/{j}"]["example"] for j in range(2)]
            assert group[0] == group[1]
            row = trainer.tenants["agent"].feed.prompts[g.prompts[b]]
            assert group[0]["messages"] == row.prompt


def curl_or_urllib(method: str, url: str, key: str, headers: dict[str, str], body: Any = None) -> dict:
    """What a shell script does: curl (urllib where there is no curl)."""
    if shutil.which("curl") is None:
        request = urllib.request.Request(
            url,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())
    args = ["curl", "-sS", "--fail-with-body", "-X", method, url, "-H", f"Authorization: Bearer {key}"]
    args += ["-H", "Content-Type: application/json"]
    for k, v in headers.items():
        args += ["-H", f"{k}: {v}"]
    if body is not None:
        args += ["-d", json.dumps(body)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_shell_program_with_curl_plays_one_turn_and_posts_the_reward(llama_path, tmp_path):
    data = chat_file(tmp_path)
    rl = RL(harness=True, group_size=2, max_new_tokens=4)
    spec = job(llama_path, [tenant("sh", data, rl, batch_size=1, max_steps=1)])
    running = Running(Trainer(spec, drivers=(Recording, FileData)))
    base, keys = running.endpoint()
    key, posted = keys["sh"], {}
    while running.thread.is_alive():
        for e in curl_or_urllib("GET", f"{base}/episodes?limit=4&wait=0.5", key, {})["data"]:
            tid = e["trajectory_id"]
            body = {"model": "sh", "messages": e["example"]["messages"]}
            a = curl_or_urllib("POST", f"{base}/chat/completions", key, {"X-Trajectory-Id": tid}, body)
            posted[tid] = (a["choices"][0]["token_ids"], len(a["choices"][0]["message"]["content"]) / 4)
            got = curl_or_urllib(
                "POST", f"{base}/trajectories/{tid}/reward", key, {}, {"reward": posted[tid][1]}
            )
            assert got == {"ok": True}
    trainer = running.done()
    assert trainer.tenants["sh"].state is TenantState.FINISHED, trainer.tenants["sh"].reason
    (g,) = rl_driver(trainer).generations["sh"]
    assert [list(t.segments[1].tokens) for t in g.trajectories] == [
        posted[f"sh/0/0/{j}"][0] for j in range(2)
    ]
    assert g.rewards.tolist() == pytest.approx([posted[f"sh/0/0/{j}"][1] for j in range(2)], abs=1e-6)


def test_bad_rewards_are_refused_naming_the_problem_and_a_silent_program_fails_only_its_tenant(
    llama_path, tmp_path
):
    data = chat_file(tmp_path)
    quiet = RL(harness=True, group_size=2, max_new_tokens=4, rollout_timeout_s=6.0)
    other = RL(harness=True, group_size=2, max_new_tokens=4, rollout_timeout_s=6.0)
    spec = job(
        llama_path,
        [
            tenant("sft", sft_file(tmp_path), max_steps=3),
            tenant("quiet", data, quiet, batch_size=1, max_steps=1),
            tenant("other", data, other, batch_size=1, max_steps=1),
        ],
    )
    running = Running(Trainer(spec, drivers=(RLDriver, FileData)))
    base, keys = running.endpoint()
    key = keys["quiet"]
    (first, second) = claim(base, key, limit=2)
    tid = first["trajectory_id"]
    url = f"{base}/trajectories/{tid}/reward"
    status, got = http("POST", url, key, {"reward": 1.0})
    assert status == 400 and "no answered turn yet" in got["error"]["message"]
    client = openai.OpenAI(
        base_url=base, api_key=key, default_headers={"X-Trajectory-Id": tid}, max_retries=0
    )
    client.chat.completions.create(model="quiet", messages=first["example"]["messages"])
    for body, said in [
        (b"{not json", "not JSON"),
        ([1, 2], "must be a JSON object"),
        ({"reward": "high"}, "reward str 'high', not a finite number"),
        ({"reward": float("nan")}, "reward float nan, not a finite number"),  # (Python's JSON reads NaN)
        ({"score": 1}, "unknown keys 'score'"),
        ({"rewards": {"a": {"score": "x"}}, "metrics": {"m": "y"}}, "rewards['a']"),
        ({"metrics": {"m": 1}}, "no 'reward' and no 'rewards'"),
    ]:
        status, got = http("POST", url, key, body)
        assert status == 400, (body, got)
        assert said in got["error"]["message"], (body, got)
    status, got = http("POST", url, key, {"rewards": {"a": {"score": "x"}}, "metrics": {"m": "y"}})
    assert "metrics that are not finite numbers" in got["error"]["message"]  # (every problem at once)
    status, got = http("POST", url, keys["other"], {"reward": 1.0})
    assert status == 404 and "not one of tenant 'other'" in got["error"]["message"], got
    status, got = http("POST", url, "wrong-key", {"reward": 1.0})
    assert status == 401, got
    status, got = http("POST", f"{base}/trajectories/quiet/9/9/9/reward", key, {"reward": 1.0})
    assert status == 404, got
    with pytest.raises(openai.NotFoundError):  # another tenant's model with this key
        client.chat.completions.create(model="other", messages=first["example"]["messages"])
    assert http("POST", url, key, {"reward": 0.5}) == (200, {"ok": True})
    status, got = http("POST", url, key, {"reward": 0.5})
    assert status == 409 and "has its reward already" in got["error"]["message"], got
    with pytest.raises(openai.ConflictError, match="its episode is over"):
        client.chat.completions.create(model="quiet", messages=first["example"]["messages"])
    status, got = http("GET", f"{base}/episodes?limit=0&wait=-1", key)
    assert (
        status == 400
        and "limit must be" in got["error"]["message"]
        and "wait must be" in got["error"]["message"]
    )
    assert second["trajectory_id"] != tid  # ... which the program never plays, nor "other"'s episodes
    trainer = running.done()
    assert trainer.tenants["sft"].state is TenantState.FINISHED, trainer.tenants["sft"].reason
    for name in ("quiet", "other"):
        assert trainer.tenants[name].state is TenantState.FAILED
    assert "1 of 2 episodes got no reward in 6 s" in trainer.tenants["quiet"].reason
    assert "2 of 2 episodes got no reward in 6 s" in trainer.tenants["other"].reason
    assert "is its harness program running?" in trainer.tenants["other"].reason


def test_a_launched_run_is_driven_from_the_notebook_through_run_agent_endpoint(llama_path, tmp_path):
    data = chat_file(tmp_path)
    rl = RL(harness=True, group_size=2, max_new_tokens=4)
    spec = job(llama_path, [tenant("nb", data, rl, batch_size=1, max_steps=2)])
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    try:
        endpoint = run.agent_endpoint("nb", timeout=240)
        assert endpoint["base_url"].startswith("http://127.0.0.1:") and endpoint["base_url"].endswith("/v1")
        mode = stat.S_IMODE(os.stat(agents_path(run.dir)).st_mode)
        assert mode == 0o600, oct(mode)
        client = run.agent_client("nb", max_retries=0)
        with pytest.raises(ValueError, match="needs a value or rewards"):
            run.reward("nb/0/0/0")
        played = 0
        deadline = time.monotonic() + 240
        while played < 4 and time.monotonic() < deadline:
            for e in run.episodes("nb", limit=4, wait=1.0):
                a = client.chat.completions.create(
                    model="nb",
                    messages=e["example"]["messages"],
                    extra_headers={"X-Trajectory-Id": e["trajectory_id"]},
                )
                run.reward(e["trajectory_id"], len(a.choices[0].message.content) / 8, metrics={"chars": 1.0})
                played += 1
        assert run.wait(240) == "finished", f"{run.error}\n{run.logs(0)}"
    finally:
        if not run.status.final:
            run.kill()
    assert played == 4
    assert not agents_path(run.dir).exists()  # (the endpoint stopped: its keys are gone)
    m = run.metrics()
    assert list(m[m["kind"] == "train"]["tenant_step"]) == [1, 2]


def test_a_harness_with_an_env_or_tools_is_named_and_needs_no_reward_function(llama_path, tmp_path):
    data = chat_file(tmp_path)
    env = tmp_path / "env.py"
    env.write_text("def rollout(client, model, example):\n    return 1.0\n")
    spec = job(
        llama_path,
        [
            tenant("ok", data, RL(harness=True)),
            tenant("both", data, RL(harness=True, env=f"{env}:rollout", tools=[f"{env}:rollout"])),
            tenant("yes", data, RL(harness="yes")),
        ],
    )
    said = "\n".join(str(p) for p in problems(spec))
    assert "rl.harness is on and rl.env and rl.tools given" in said, said
    assert "yes" in said and "rl.harness" in said
    assert "tenant 'ok'" not in said and "'ok'" not in said, said
    assert RL(harness=True).agent and RL(harness=True).own_reward and not RL(reward="a:b").agent
