"""A judge inside the job: an RL tenant's reward that asks the job it runs in (``ml.Judge`` with no ``base_url``)
is answered by the job itself, through the agents' endpoint, in batched waves every process serves, with the base
or any running tenant as the judge; its requests and verdicts go with the sampled completions."""

from __future__ import annotations

import json
from pathlib import Path

from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.drivers.rl import RLDriver
from mlora_lab.job.trainer import Trainer
from mlora_lab.rundir import RowKind, TenantState
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.tenant import Tenant

CODE = '''
import json, os, urllib.request

import mlora_lab as ml

RUBRIC = "Rate 0-10: {completion}"
base_judge = ml.Judge(model="base", rubric=RUBRIC, name="by_base", max_tokens=6)
tenant_judge = ml.Judge(model="writer", rubric=RUBRIC, name="by_writer", max_tokens=6)
ghost_judge = ml.Judge(model="nobody", name="ghost")


def _text(c):
    return c if isinstance(c, str) else c[0]["content"]


def judged(prompts, completions, log_extra, **kwargs):
    """Asks two judges (the base, and the SFT tenant 'writer'): their verdicts are logged; the reward is the
    length, so that the tenant trains whatever a tiny model's verdicts say."""
    base_judge(prompts, completions, log_extra=log_extra)
    tenant_judge(prompts, completions, log_extra=log_extra)
    return [len(_text(c)) / 10 for c in completions]

judged.asks_the_job = True


class Raw:
    """A reward asking the job's endpoint itself, as any judge program would."""

    asks_the_job = True

    def __call__(self, prompts, completions, **kwargs):
        url, key = os.environ["MLORA_OPENAI_BASE_URL"], os.environ["MLORA_OPENAI_API_KEY"]
        out = []
        for c in completions:
            body = {"model": "base", "messages": [{"role": "user", "content": _text(c)}], "temperature": 0,
                    "max_tokens": 3}
            request = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Authorization": f"Bearer {key}",
                                                      "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                said = json.loads(answer.read())
            out.append(float(len(said["choices"][0]["token_ids"])))
        return out

raw = Raw()


def ghost(prompts, completions, **kwargs):
    return ghost_judge(prompts, completions)

ghost.asks_the_job = True
'''


def rows(tmp: Path) -> str:
    path = tmp / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"say {w} and"}) + "\n" for w in ["red", "cat", "tree", "sun"])
    )
    return str(path)


def texts(tmp: Path) -> str:
    path = tmp / "texts.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"the {w} is red and blue"}) + "\n" for w in ["cat", "dog", "sun"])
    )
    return str(path)


def job(base: str, tenants: list[Tenant]) -> JobSpec:
    return JobSpec(base_model=base, tenants=tenants, seq_len=64, max_rank=8, max_tenants=4)


def tenant(name: str, data: str, **kw) -> Tenant:
    return Tenant(
        **(dict(name=name, data=data, rank=4, alpha=8, lr=1e-2, batch_size=2, max_steps=2, seed=5) | kw)
    )


def test_a_judge_asking_the_job_is_answered_by_the_job_with_the_base_or_a_tenant(llama_path, tmp_path):
    code = tmp_path / "judges.py"
    code.write_text(CODE)
    data = rows(tmp_path)
    tenants = [
        tenant(
            "judged", data, rl=RL(reward=f"{code}:judged", group_size=2, max_new_tokens=5, log_completions=4)
        ),
        tenant("raw", data, rl=RL(reward=f"{code}:raw", group_size=2, max_new_tokens=5)),
        tenant("writer", texts(tmp_path), max_steps=3),  # an SFT tenant: the second judge
    ]
    trainer = Trainer(job(llama_path, tenants), drivers=(RLDriver, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    for name in ("judged", "raw", "writer"):
        assert trainer.tenants[name].state is TenantState.FINISHED, (name, trainer.tenants[name].reason)
    sampled = [r for r in trainer.history if r["kind"] == RowKind.COMPLETION and r["tenant"] == "judged"]
    assert sampled
    for row in sampled:
        for judge in ("by_base", "by_writer"):
            said = row["extra"][judge]
            assert said.startswith("asked: ") and "\nanswered: " in said, said
            assert row["completion"] in said  # (the rubric shows the judge the completion)
    # the raw reward: the number of tokens the base answered with (greedy, at most 3)
    train = [r for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == "raw"]
    assert train and all(1 <= r["reward"] <= 3 for r in train)


def test_a_judge_asking_a_model_the_job_does_not_have_quarantines_only_its_tenant(llama_path, tmp_path):
    code = tmp_path / "judges.py"
    code.write_text(CODE)
    data = rows(tmp_path)
    tenants = [
        tenant("ghostly", data, rl=RL(reward=f"{code}:ghost", group_size=2, max_new_tokens=4)),
        tenant("fine", texts(tmp_path), max_steps=2),
    ]
    trainer = Trainer(job(llama_path, tenants), drivers=(RLDriver, FileData))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.tenants["fine"].state is TenantState.FINISHED
    assert trainer.tenants["ghostly"].state is TenantState.FAILED
    reason = trainer.tenants["ghostly"].reason
    assert "HTTP 404" in reason and "'nobody' is neither 'base' nor a running tenant" in reason, reason
