"""tinker-cookbook's own minimal loops (0.6.1, which scripts/setup.sh installs), unchanged, train through a job's
service on loopback.

``recipes/sl_loop.py`` (supervised, ``cross_entropy``) and ``recipes/rl_loop.py`` (GRPO-style groups,
``loss_fn="importance_sampling"``) run their real ``main(Config(...))`` against a :class:`Served` job, with
``base_url`` its server and ``model_name`` its served name (the tiny model's local directory). Only what must
be local is patched: ``datasets.load_dataset`` (a few rows built here), the recommended renderer of a model
the cookbook does not know (``role_colon``, the cookbook's plain ``User: … / Assistant: …`` format; the
cookbook loads the tokenizer of a local directory itself) and, for RL, the reward (a toy task the tiny
model learns in a few steps, in place of grading GSM8K); and, as this is a test process, the loops' set-up
of the logging module is skipped. The SDK takes the key from ``TINKER_API_KEY``.

And ``sl_loop`` once more, from the command line with nothing patched, against a job launched with ``ml.serve``
under a name the cookbook knows (``Service.model_name``), its tokenizer and data set from a loopback Hub.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import datasets
import pytest

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")
from served_job import Served

# The cookbook's logging module imports wandb and trackio when they are installed, and trackio fixes its store
# folder when it is imported: a trackio mirror later in this pytest worker (tests/trackers/test_trackers.py) is then
# refused, and test_rl_loss checks that nothing imported it. The loops log to no tracker here, so the cookbook
# is imported with those two taken as absent (only for its import: None in sys.modules makes `import` fail).
_ABSENT = [m for m in ("trackio", "wandb") if m not in sys.modules]
sys.modules.update(dict.fromkeys(_ABSENT))
try:
    from tinker_cookbook import model_info
    from tinker_cookbook.recipes import rl_loop, sl_loop
    from tinker_cookbook.utils import ml_log
finally:
    for _m in _ABSENT:
        del sys.modules[_m]

from mlora_lab.rundir.service import saved_folder  # noqa: E402

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road", "car", "plane"]


@pytest.fixture
def cookbook(llama_path, tmp_path, monkeypatch, one_thread):
    """A served job of the tiny llama (checkpoints in ``tmp_path/service``; 256 positions: rl_loop's prompt
    holds a worked example), whose name the cookbook's loops can use."""
    served = Served(llama_path, checkpoints=tmp_path / "service", seq_len=256)
    monkeypatch.setenv("TINKER_API_KEY", served.key)
    # (the loops set up the logging module as a program's main would: every root handler, pytest's capture
    # among them, replaced by a console and a file handler, for the rest of the session)
    monkeypatch.setattr(
        ml_log, "configure_logging_module", lambda path, level=logging.INFO: logging.getLogger()
    )
    recommended = model_info.get_recommended_renderer_name
    monkeypatch.setattr(
        model_info,
        "get_recommended_renderer_name",
        lambda name: "role_colon" if name == served.base else recommended(name),
    )
    yield served
    served.close()


def local_dataset(monkeypatch, rows: list[dict]) -> None:
    """``datasets.load_dataset`` (of any name) answers a split ``train`` of ``rows``."""
    dataset = datasets.DatasetDict(train=datasets.Dataset.from_list(rows))
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kw: dataset)


def logged(log_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (log_path / name).read_text().splitlines()]


def test_sl_loop_trains_and_saves_its_final_checkpoint_as_a_peft_adapter(cookbook, tmp_path, monkeypatch):
    """The train NLL the loop logs falls over its steps; its final checkpoint (``kind="both"``) is a saved
    state whose ``adapter/`` is a PEFT adapter directory, and a sampler snapshot that is one too."""
    local_dataset(
        monkeypatch,
        [
            {
                "messages": [
                    {"role": "user", "content": f"name a {w}"},
                    {"role": "assistant", "content": "blue bird"},
                ]
            }
            for w in WORDS * 2
        ],
    )
    log_path = tmp_path / "sl"
    sl_loop.main(
        sl_loop.Config(
            base_url=cookbook.server.url,
            log_path=str(log_path),
            model_name=cookbook.base,
            batch_size=4,
            learning_rate=1e-2,
            max_length=40,
            lora_rank=4,
            save_every=0,
            max_steps=6,
        )
    )

    nll = [row["train_mean_nll"] for row in logged(log_path, "metrics.jsonl")]
    assert len(nll) == 6 and nll[-1] < 0.5 * nll[0], f"the train NLL did not fall: {nll}"
    final = logged(log_path, "checkpoints.jsonl")[-1]
    assert final["name"] == "final"
    for folder in (
        saved_folder(tmp_path / "service", final["state_path"]) / "adapter",
        saved_folder(tmp_path / "service", final["sampler_path"]),
    ):
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
        assert (folder / "adapter_model.safetensors").is_file()


def test_rl_loop_importance_sampling_raises_the_reward_of_a_toy_task(cookbook, tmp_path, monkeypatch):
    """Reward: a completion's lowercase ASCII letters, 32 of them or more scoring 1 (about 1/3 for the tiny
    random model's near-uniform 8 tokens, byte tokens among them: it learns to say longer lowercase words).
    Over 10 steps of 4 questions x 8 samples the mean reward of the last 3 steps is well above that of the
    first 3 (seen over 21 runs with other sampling seeds: 0.30-0.37 before, 0.74-1.0 after; a reward that
    saturates sooner, the share of lowercase letters, rose less surely, as Adam's steps on the few groups
    left unsaturated sometimes knocked it back). Every step's new sampler snapshot is loaded into the slot
    of the one before (max_tenants=2). The job trained the client's tenant one optimiser step per step the
    loop trained."""
    monkeypatch.setattr(rl_loop, "get_reward", lowercase_letters)
    local_dataset(monkeypatch, [{"question": f"say a word after {w}", "answer": "#### 0"} for w in WORDS * 4])
    log_path = tmp_path / "rl"
    rl_loop.main(
        rl_loop.Config(
            base_url=cookbook.server.url,
            log_path=str(log_path),
            model_name=cookbook.base,
            batch_size=4,
            group_size=8,
            learning_rate=5e-2,
            lora_rank=4,
            save_every=0,
            max_tokens=8,
            loss_fn="importance_sampling",
            max_steps=10,
        )
    )

    metrics = logged(log_path, "metrics.jsonl")
    rewards = [row["reward/total"] for row in metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert len(rewards) == 10 and last > first + 0.3, f"the reward did not rise: {rewards}"
    trained = sum("grad_norm:max" in row for row in metrics)  # (a step whose groups all tie trains nothing)
    rows = [r for r in cookbook.trainer.history if r["kind"] == "train"]
    assert trained >= 3 and [r["tenant_step"] for r in rows] == list(range(1, trained + 1))


def lowercase_letters(response: str, answer: str) -> float:
    return min(1.0, sum("a" <= c <= "z" for c in response) / 32)


@pytest.mark.slow
def test_sl_loop_runs_unchanged_from_the_command_line_against_a_job_served_by_the_models_name(
    llama_path, tmp_path
):
    """``python -m tinker_cookbook.recipes.sl_loop base_url=… model_name=…``, nothing patched, against a job
    launched with ``ml.serve`` that serves the tiny llama as ``Service(model_name="meta-llama/Llama-3.2-1B")``.
    The recipe finds everything by that name, as it would on the real Hub, here a loopback one (``HF_ENDPOINT``):
    its renderer (``role_colon``, the cookbook's choice for that model), its tokenizer (the cookbook loads
    Llama 3's from ``thinkingmachineslabinc/meta-llama-3-instruct-tokenizer``, here the tiny llama's) and its
    data set (``HuggingFaceH4/no_robots``, here a few chats). The train NLL it logs falls, and its final
    checkpoint is a PEFT adapter."""
    import io
    import os
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import stop_runs_under
    from hub_server import HubServer, Repo, repo_from_folder

    import mlora_lab as ml

    def parquet(rows: list[dict]) -> bytes:
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buffer)
        return buffer.getvalue()

    chats = [
        {
            "messages": [
                {"role": "user", "content": f"name a {w}"},
                {"role": "assistant", "content": "blue bird"},
            ]
        }
        for w in WORDS * 2
    ]
    repos = {
        "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer": repo_from_folder(llama_path),
        "datasets/HuggingFaceH4/no_robots": Repo(
            {
                "data/train-00000-of-00001.parquet": parquet(chats),
                "data/test-00000-of-00001.parquet": parquet(chats[:4]),
            }
        ),
    }
    spec = ml.JobSpec(
        base_model=llama_path,
        tenants=[],
        seq_len=64,
        max_tenants=2,
        max_rank=8,
        service=ml.Service(model_name="meta-llama/Llama-3.2-1B"),
    )
    with HubServer(repos) as hub:
        svc = ml.serve(spec, workdir=tmp_path / "runs")
        try:
            assert svc.base_model == "meta-llama/Llama-3.2-1B"
            env = {
                **os.environ,
                "HF_ENDPOINT": hub.url,
                "HF_HOME": str(tmp_path / "hf"),
                "TINKER_API_KEY": svc.api_key,
                "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            }
            for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE"):
                env.pop(name, None)
            log_path = tmp_path / "sl"
            args = dict(base_url=svc.base_url, model_name="meta-llama/Llama-3.2-1B", log_path=log_path, batch_size=4,
                        learning_rate=1e-2, max_length=40, lora_rank=4, save_every=0, max_steps=6)  # fmt: skip
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tinker_cookbook.recipes.sl_loop",
                    *(f"{k}={v}" for k, v in args.items()),
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                cwd=tmp_path,
            )
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            nll = [row["train_mean_nll"] for row in logged(log_path, "metrics.jsonl")]
            assert len(nll) == 6 and nll[-1] < 0.5 * nll[0], f"the train NLL did not fall: {nll}"
            final = logged(log_path, "checkpoints.jsonl")[-1]
            adapter = saved_folder(svc.path / "service", final["sampler_path"])
            assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
            asked = set(hub.paths)
            assert any("no_robots" in p for p in asked) and any(
                "meta-llama-3-instruct-tokenizer" in p for p in asked
            )
            assert svc.stop() == "stopped", svc.logs(0)
        finally:
            stop_runs_under(tmp_path)


def test_m3_the_cookbook_does_not_know_smollm2_and_notebook_06_says_so():
    """M3: the only real model shipped here, SmolLM2-135M-Instruct, is a name tinker-cookbook 0.6.1 does not know
    (its recipes pick their renderer by it, and stop), and notebook 06, which serves it, says so plainly instead
    of implying that the cookbook's recipes run on it."""
    import nbformat

    from mlora_lab.lab.demo import REAL_MODEL_ID

    with pytest.raises(Exception, match="Unknown model"):
        model_info.get_recommended_renderer_name(REAL_MODEL_ID)
    notebook = Path(__file__).resolve().parents[2] / "notebooks" / "06_service.ipynb"
    text = " ".join(c.source for c in nbformat.read(notebook, 4).cells if c.cell_type == "markdown")
    said = " ".join(text.split())
    assert "tinker-cookbook's recipes cannot run on this model" in said, said
    assert f"does not know SmolLM2's: it stops with `Unknown model: {REAL_MODEL_ID}`" in said, said
