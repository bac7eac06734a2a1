"""Preference tenants (``Tenant.pref``) trained by the job equal TRL 1.16.0's ``DPOTrainer`` with PEFT LoRA: the same
rows in the same order, the same AdamW, N optimiser steps; then the per-step losses, TRL's logged metrics and the
LoRA weights agree. The reference is the base with the adapter off (TRL's ``disable_adapter()``), or the adapter
the tenant starts from (TRL's ``ref_adapter_name``). The same tenant beside SFT and RL tenants trains exactly as
alone; a stop and resume mid-run changes nothing; PEFT loading the saved adapter gives the job's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from mlora_lab.job.trainer import Trainer
from mlora_lab.reference import peft_lora_tensors
from mlora_lab.rundir import RowKind, TenantState
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Preference
from mlora_lab.spec.tenant import Tenant

with (
    mock.patch("transformers.integrations.is_trackio_available", return_value=False),
    mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
):
    trl = pytest.importorskip("trl")
    from trl import DPOConfig, DPOTrainer
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

TOL = 1e-5
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ROWS = [
    {
        "prompt": f"Question {i}: what do {'cats' if i % 2 else 'dogs'} like?",
        "chosen": " They like warm places" + " and naps" * (i % 3),
        "rejected": " Nothing" + " at all" * (i % 4 + 1),
    }
    for i in range(8)
]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def pair_file(folder: Path, rows: list[dict] = ROWS, name: str = "pairs.jsonl") -> str:
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def init_adapter(base: str, folder: Path, seed: int = 11, targets: list[str] = TARGETS) -> str:
    """A PEFT adapter with B ≠ 0, so the policy differs from the base at step 0 (the rewards are not all 0)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    path = folder / f"init_{seed}"
    peft.get_peft_model(model, config).save_pretrained(path)
    return str(path)


def pref_tenant(name: str, data: str, adapter: str | None, pref: Preference, **kw) -> Tenant:
    settings = dict(
        rank=4,
        alpha=8,
        target_modules=TARGETS,
        lr=5e-3,
        batch_size=2,
        grad_accum=1,
        max_steps=3,
        max_grad_norm=None,
        shuffle=False,
        seed=3,
        init_adapter=adapter,
    )
    return Tenant(name=name, data=data, pref=pref, **(settings | kw))


def job(base: str, tenants: list[Tenant], **kw) -> JobSpec:
    kw = {"seq_len": 64, "max_rank": 8, "max_tenants": 4, "dtype": "float32", **kw}
    return JobSpec(base_model=base, tenants=tenants, **kw)


def trl_settings(t: Tenant, out: Path) -> dict[str, Any]:
    """The settings every TRL trainer below shares with tenant ``t``: its rows in order (sequential), its batch,
    accumulation and steps, its AdamW (constant lr, no decay, no clipping), fp32 on the CPU, a log each step."""
    return dict(
        output_dir=str(out),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        max_steps=t.max_steps,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_epsilon=t.eps,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_length=64,
    )


def trl_inputs(base: str, data: str, adapter: str) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, rows)`` for a TRL trainer: the base in fp32 with the PEFT adapter the tenant starts
    from (trainable), and the tenant's data file as a ``datasets.Dataset``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(base)
    return model, tok, datasets.Dataset.from_list(rows)


def trained(trainer: Any, t: Tenant) -> tuple[Any, list[dict]]:
    """Train ``trainer`` against ``t``'s reference and return it with its per-step logs. TRL 1.16 copies a
    pretrained adapter as "ref", its reference; without it, the adapter disabled (the base)."""
    if "ref" in getattr(trainer.model, "peft_config", {}) and t.pref.reference_of(t.init_adapter) == "base":
        trainer.model.delete_adapter("ref")
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def trl_run(base: str, data: str, adapter: str, t: Tenant, out: Path) -> tuple[DPOTrainer, list[dict]]:
    """TRL's DPOTrainer on the same rows, order, AdamW and steps as tenant ``t``."""
    pref = t.pref
    args = DPOConfig(
        **trl_settings(t, out),
        loss_type=pref.loss_types,
        loss_weights=pref.loss_weights,
        beta=pref.beta,
        label_smoothing=pref.label_smoothing,
        f_divergence_type=pref.f_divergence_type,
        f_alpha_divergence_coef=pref.f_alpha_divergence_coef,
        ld_alpha=pref.ld_alpha,
        precompute_ref_log_probs=False,  # (the reference in each step: "ref" can be dropped after __init__)
    )
    model, tok, rows = trl_inputs(base, data, adapter)
    trainer = DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    assert "ref" in trainer.model.peft_config
    return trained(trainer, t)


def tied(metrics: dict) -> bool:
    """Whether a step's pairs are tied (margins 0 to the float32 rounding of ~100-nat sequence log-probs, as every
    pair's is at the first step against the init adapter): each is then "accurate" or not by the last bits of
    two forwards, TRL's as arbitrary as ours. Margins of a step that learned are 1e-2 and more."""
    return abs(metrics["rewards/margins"]) < 1e-4


def ours(trainer: Trainer, name: str) -> list[dict]:
    return [r for r in trainer.history if r["kind"] == RowKind.TRAIN and r["tenant"] == name]


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(max((a[k][0] - b[k][0]).abs().max().item(), (a[k][1] - b[k][1]).abs().max().item()) for k in a)


@pytest.mark.parametrize(
    "pref",
    [
        Preference(beta=0.3, reference="base"),
        Preference(loss_type="ipo", beta=0.3, reference="base"),
        Preference(loss_type="hinge", beta=0.3, reference="base"),
        Preference(loss_type="robust", beta=0.3, label_smoothing=0.1, reference="base"),
        Preference(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], beta=0.3, reference="base"),  # RPO
        Preference(loss_type="sigmoid_norm", beta=0.3, ld_alpha=0.5, reference="base"),
        Preference(beta=0.3, f_divergence_type="js_divergence", reference="base"),
        Preference(loss_type="apo_zero", beta=0.3),  # a tenant with an init adapter: it is the reference
        *(
            Preference(loss_type=loss_type, beta=0.3, reference="base", **extra)
            for loss_type, extra in (
                ("exo_pair", {"label_smoothing": 1e-3}),
                ("nca_pair", {}),
                ("bco_pair", {}),
                ("sppo_hard", {}),
                ("aot", {"label_smoothing": 0.1}),
                ("aot_unpaired", {}),
                ("apo_down", {}),
                ("discopop", {}),
                ("sft", {}),
            )
        ),
        Preference(
            beta=0.3, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, reference="base"
        ),
    ],
    ids=[
        "sigmoid",
        "ipo",
        "hinge",
        "robust",
        "rpo",
        "sigmoid_norm-ld",
        "js",
        "apo_zero-init-ref",
        "exo_pair",
        "nca_pair",
        "bco_pair",
        "sppo_hard",
        "aot",
        "aot_unpaired",
        "apo_down",
        "discopop",
        "sft",
        "alpha_divergence",
    ],
)
def test_one_preference_tenant_equals_trls_dpo_trainer(pref, llama_path, tmp_path):
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    t = pref_tenant("p", data, adapter, pref, grad_accum=2, max_steps=3)
    trainer = Trainer(job(llama_path, [t]))
    trainer.train()
    assert trainer.tenants["p"].state is TenantState.FINISHED
    reference, logs = trl_run(llama_path, data, adapter, t, tmp_path / "trl")
    rows = ours(trainer, "p")
    assert [r["tenant_step"] for r in rows] == [1, 2, 3]
    # (relative too: sppo_hard's losses are ~2, where float32 sums of differently shaped batches differ by ~1e-5)
    assert [r["loss"] for r in rows] == pytest.approx([h["loss"] for h in logs], rel=TOL, abs=TOL)
    for m in METRICS:
        skip = [m == "rewards/accuracies" and tied(h) for h in logs]
        got = [r["extra"][m] for r, s in zip(rows, skip, strict=True) if not s]
        want = [h[m] for h, s in zip(logs, skip, strict=True) if not s]
        assert got == pytest.approx(want, rel=1e-5, abs=TOL), m
    assert rows[-1]["rows_seen"] == 12  # pairs: 3 steps of 2 micro-batches of 2
    diff = max_diff(trainer.model.tenant_tensors("p"), peft_lora_tensors(reference.model))
    assert diff <= TOL, f"adapters differ by {diff}"


def test_preference_sft_and_rl_tenants_together_each_equal_alone(llama_path, tmp_path, make_data):
    """Two preference tenants (the base and the init adapter as references, different β and loss), an SFT
    tenant and an RL tenant in one job, one base forward per step: each trains exactly as alone."""
    from test_rl_driver import prompt_file, reward_file, rl_tenant

    from mlora_lab.spec.parts import RL

    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    tenants = [
        pref_tenant("dpo", data, adapter, Preference(beta=0.2, reference="base"), grad_accum=2),
        pref_tenant("ipo", data, adapter, Preference(loss_type="ipo", beta=0.5), batch_size=3, max_steps=4),
        Tenant(
            name="sft", data=make_data("reverse"), rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=5, seed=1
        ),
        rl_tenant(
            "rl",
            prompt_file(tmp_path),
            RL(reward=f"{reward_file(tmp_path)}:short", group_size=2, max_new_tokens=4),
        ),
    ]
    slots = dict(slot_modules=TARGETS)
    together = Trainer(job(llama_path, tenants, **slots))
    together.train()
    for t in tenants:
        alone = Trainer(job(llama_path, [t], **slots))
        alone.train()
        assert together.tenants[t.name].state is alone.tenants[t.name].state is TenantState.FINISHED
        assert together.losses(t.name) == pytest.approx(alone.losses(t.name), abs=TOL), t.name
        diff = max_diff(together.model.tenant_tensors(t.name), alone.model.tenant_tensors(t.name))
        assert diff <= TOL, f"{t.name}: together vs alone adapters differ by {diff}"
    margins = [r["extra"]["rewards/margins"] for r in ours(together, "dpo")]
    assert margins[-1] > margins[0]  # it learns to prefer the chosen answers
    assert all(r["extra"] is None for r in ours(together, "sft"))


def test_stopped_mid_window_and_resumed_equals_straight_through(llama_path, tmp_path):
    """A checkpoint inside a window (one of 3 micro-batches done, the metric sums and the reference cache of
    both references kept) and a resume give the same losses, metrics and adapters as one straight run."""
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    tenants = [
        pref_tenant("a", data, adapter, Preference(beta=0.2, reference="base"), grad_accum=3, max_steps=3),
        pref_tenant(
            "b", data, adapter, Preference(loss_type="robust", label_smoothing=0.2), shuffle=True, max_steps=6
        ),
    ]
    straight = Trainer(job(llama_path, tenants))
    straight.train()
    first = Trainer(job(llama_path, tenants), run_dir=tmp_path / "run")
    for _ in range(4):
        assert first.step()
    fa = first.tenants["a"].feed
    assert fa.micro == 1 and fa.sums[-1] == 2 and len(fa.reference) == 8  # 2 windows: 12 pairs of 8
    assert len(first.tenants["b"].feed.reference) == len(ROWS)  # the init adapter's: every pair at once
    first.save_checkpoint()
    first.close()
    again = Trainer(job(llama_path, tenants), run_dir=tmp_path / "run", resume=True)
    ra = again.tenants["a"].feed
    assert ra.micro == 1 and torch.equal(ra.sums, fa.sums) and ra.reference.values == fa.reference.values
    again.train()
    for name, steps in (("a", 3), ("b", 6)):
        assert again.tenants[name].step == steps
        assert again.losses(name)[-2:] == pytest.approx(straight.losses(name)[-2:], abs=1e-6), name
        assert [r["extra"] for r in ours(again, name)][-1] == pytest.approx(
            [r["extra"] for r in ours(straight, name)][-1], abs=1e-6
        )
        diff = max_diff(again.model.tenant_tensors(name), straight.model.tenant_tensors(name))
        assert diff <= 1e-6, name


def test_a_resume_refuses_changed_pairs_and_a_reference_of_other_options(llama_path, tmp_path):
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    t = pref_tenant("a", data, adapter, Preference(beta=0.2, reference="base"))
    first = Trainer(job(llama_path, [t]), run_dir=tmp_path / "run")
    assert first.step()
    state = first.tenants["a"].feed.state_dict()
    first.close()
    from mlora_lab.job.drivers.preference import PrefFeed

    other = pair_file(tmp_path, ROWS[::-1], "reversed.jsonl")
    feed: PrefFeed = first.drivers.of(t).feed(Tenant(**{**t.__dict__, "data": other}))
    with pytest.raises(ValueError, match="its preference pairs changed since the checkpoint"):
        feed.load_state_dict(state)
    ld = Tenant(**{**t.__dict__, "pref": Preference(beta=0.2, reference="base", ld_alpha=0.5)})
    with pytest.raises(ValueError, match=r"reference log-probs computed under other options: ld_alpha"):
        first.drivers.of(ld).feed(ld).load_state_dict(state)


def test_peft_loads_the_saved_adapter_and_gives_the_jobs_logits(llama_path, tmp_path):
    import transformers

    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    t = pref_tenant("p", data, adapter, Preference(beta=0.3, reference="base"), max_steps=2)
    trainer = Trainer(job(llama_path, [t]), run_dir=tmp_path / "run")
    trainer.train()
    trainer.close()
    saved = tmp_path / "run" / "adapters" / "p"
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama_path), saved
    )
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        want = model(ids).logits
        got = trainer.model(ids, tenants=["p"]).logits
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("source", ["dataframe", "dataset", "chat"])
def test_pairs_from_every_source_train_as_from_a_file(source, llama_path, tmp_path):
    """A DataFrame, a ``datasets.Dataset`` (a Hub dataset is read as one) and conversational pairs are read as
    TRL reads them: the DataFrame and Dataset give the very rows of the JSONL file; chat pairs train."""
    import pandas as pd

    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    pref = Preference(beta=0.3, reference="base")
    if source == "chat":
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in ROWS
        ]
        t = pref_tenant("p", datasets.Dataset.from_list(rows), adapter, pref, max_steps=2)
        trainer = Trainer(job(llama_path, [t]))
        trainer.train()
        assert trainer.tenants["p"].state is TenantState.FINISHED
        return
    given = pd.DataFrame(ROWS) if source == "dataframe" else datasets.Dataset.from_list(ROWS)
    a = Trainer(job(llama_path, [pref_tenant("p", given, adapter, pref, max_steps=2)]))
    a.train()
    b = Trainer(job(llama_path, [pref_tenant("p", data, adapter, pref, max_steps=2)]))
    b.train()
    assert a.losses("p") == b.losses("p")


@pytest.fixture(scope="module")
def pref_one_process(llama_path, tmp_path_factory) -> tuple[list[Tenant], Trainer]:
    """Two preference tenants trained on one process, here (the reference of the torchrun tests): 3 pairs per
    micro-batch (2 and 1 on two ranks), 2 micro-batches per step, the base and the init adapter as references."""
    folder = tmp_path_factory.mktemp("pref_one")
    data, adapter = pair_file(folder), init_adapter(llama_path, folder)
    tenants = [
        pref_tenant("a", data, adapter, Preference(beta=0.2, reference="base"), batch_size=3, grad_accum=2),
        pref_tenant("b", data, adapter, Preference(loss_type="ipo", beta=0.4), batch_size=2, shuffle=True),
    ]
    trainer = Trainer(job(llama_path, tenants))
    trainer.train()
    trainer.close()
    return tenants, trainer


@pytest.mark.slow
@pytest.mark.xdist_group("pref_one_process")  # (a module fixture is made once per xdist worker)
@pytest.mark.parametrize("layout", [{"fsdp": 2}, {"fsdp": 1, "tp": 2}], ids=["fsdp2", "tp2"])
def test_two_ranks_equal_one(layout, pref_one_process, llama_path, tmp_path):
    """Under torchrun with fsdp=2 each rank trains its share of each micro-batch's pairs (both sequences of a
    pair together) and computes the reference of its share, the values shared; with tp=2 every forward is
    split. The losses, TRL's metrics and the adapters are those of one process."""
    import mlora_lab as ml
    from mlora_lab.lora import read_adapter

    tenants, trainer = pref_one_process
    spec = job(llama_path, tenants, parallel=ml.Parallel(nproc=2, **layout))
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    state = run.wait(600)
    assert state == "finished", f"{state}: {run.error}\n{run.logs(0)}\n{run.logs(1)}"
    m = run.metrics()
    m = m[m["kind"] == "train"].set_index(["tenant", "tenant_step"]).sort_index()
    want = {(r["tenant"], r["tenant_step"]): r for r in trainer.history if r["kind"] == RowKind.TRAIN}
    assert set(m.index) == set(want)
    assert list(m["loss"]) == pytest.approx([want[k]["loss"] for k in m.index], abs=TOL)
    for metric in METRICS:
        # (a train row's extra: a column per key; tied margins make arbitrary accuracies, as in the TRL test)
        keys = [k for k in m.index if metric != "rewards/accuracies" or not tied(want[k]["extra"])]
        got = list(m.loc[keys, metric])
        assert got == pytest.approx([want[k]["extra"][metric] for k in keys], abs=TOL), metric
    for name in ("a", "b"):
        tensors = read_adapter(run.adapter_path(name))[1]
        assert max_diff(tensors, trainer.model.tenant_tensors(name)) <= TOL, name


def test_an_in_job_search_sweeps_beta_of_dpo_tenants(llama_path, tmp_path):
    """``pref.beta`` in a sweep's space: each trial is the base preference tenant with its own β, the trials
    train side by side on one base, and each equals that tenant trained alone."""
    from test_search_job import search_state

    import mlora_lab as ml
    from mlora_lab.rundir import RunDir, atomic_write_json
    from mlora_lab.search import Objective, Sweep, choice

    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    base = pref_tenant("base", data, adapter, Preference(reference="base"))
    sweep = Sweep(
        base, {"pref.beta": choice(0.05, 0.5)}, ml.Grid(), budget=3, objective=Objective("train_loss")
    )
    spec = job(llama_path, [], slot_modules=TARGETS, output_dir=str(tmp_path / "run"))
    run = RunDir(tmp_path / "run").create()
    spec.to_json(run.job)
    atomic_write_json(run.root / "sweep.json", sweep.to_dict())
    tr = Trainer(spec, tmp_path / "run")
    tr.train(idle_s=0.01)
    tr.close()
    trials = {t["id"]: t for t in search_state(tmp_path / "run")["trials"]}
    assert [trials[i]["state"] for i in (0, 1)] == ["finished", "finished"]
    for i, beta in enumerate((0.05, 0.5)):
        alone = Trainer(job(llama_path, [sweep.trial_tenant(i, {"pref.beta": beta})], slot_modules=TARGETS))
        alone.train()
        assert alone.tenants[f"trial-00{i}"].spec.pref.beta == beta
        assert tr.losses(f"trial-00{i}") == pytest.approx(alone.losses(f"trial-00{i}"), abs=TOL)
    from mlora_lab.validate import sweep_problems

    sft = Sweep(ml.Tenant(name="s", data=data), {"pref.beta": choice(0.1, 1.0)}, ml.Grid(), budget=2)
    problems = [str(p) for p in sweep_problems(job(llama_path, []), sft)]
    assert any("search space pref.beta: the base tenant 's' has no pref" in p for p in problems), problems


def test_add_pause_resume_remove_and_quarantine_a_preference_tenant(llama_path, make_data, tmp_path):
    """A preference tenant added at step 3 of a running job, paused mid-window and resumed, trains exactly as
    alone; one whose adapter blows up is quarantined alone (the others exactly as without it); a removed one's
    adapter is saved."""
    from test_lifecycle import corrupted_adapter

    from mlora_lab.lora import read_adapter
    from mlora_lab.rundir import control

    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    sft = Tenant(name="s", data=make_data("reverse"), rank=4, lr=5e-3, batch_size=2, max_steps=14, seed=1)
    p = pref_tenant("p", data, adapter, Preference(beta=0.2, reference="base"), grad_accum=2, max_steps=4)
    trainer = Trainer(job(llama_path, [sft], slot_modules=TARGETS), run_dir=tmp_path / "run")
    for _ in range(3):
        trainer.step()
    msg = control.send(trainer.run.root, "add", tenant=p.to_dict())  # (as the lab sends it)
    trainer.poll()
    assert control.wait_result(trainer.run.root, msg, timeout=5).step == 3
    trainer.step()  # p: micro-batch 1 of 2 done
    assert trainer.tenants["p"].feed.micro == 1
    trainer.apply_control({"op": "pause", "name": "p"})
    for _ in range(2):
        trainer.step()
    assert trainer.tenants["p"].feed.micro == 1 and trainer.tenants["p"].step == 0
    trainer.apply_control({"op": "resume", "name": "p"})
    for _ in range(3):
        trainer.step()
    trainer.apply_control({"op": "remove", "name": "s"})
    assert read_adapter(tmp_path / "run" / "adapters" / "s")[1]
    trainer.train()
    alone = Trainer(job(llama_path, [p], slot_modules=TARGETS))
    alone.train()
    assert trainer.tenants["p"].state is TenantState.FINISHED
    assert trainer.losses("p") == pytest.approx(alone.losses("p"), abs=TOL)
    assert max_diff(trainer.model.tenant_tensors("p"), alone.model.tenant_tensors("p")) <= TOL

    bad_init = corrupted_adapter(llama_path, tmp_path / "corrupt", TARGETS)
    bad = pref_tenant("bad", data, bad_init, Preference(reference="base"), max_steps=4)
    good = pref_tenant("good", data, adapter, Preference(beta=0.3, reference="base"), max_steps=4)
    with_bad = Trainer(job(llama_path, [good, bad], slot_modules=TARGETS))
    with_bad.train()
    without = Trainer(job(llama_path, [good], slot_modules=TARGETS))
    without.train()
    assert (
        with_bad.tenants["bad"].state is TenantState.FAILED and "non-finite" in with_bad.tenants["bad"].reason
    )
    assert with_bad.losses("good") == pytest.approx(without.losses("good"), abs=1e-6)
    assert max_diff(with_bad.model.tenant_tensors("good"), without.model.tenant_tensors("good")) <= 1e-6


def free_trl_run(base: str, data: str, adapter: str, t: Tenant, out: Path) -> tuple[Any, list[dict]]:
    """TRL's ORPOTrainer or CPOTrainer (``trl.experimental``) on the same rows, order, AdamW and steps as ``t``."""
    with (
        mock.patch("transformers.integrations.is_trackio_available", return_value=False),
        mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
    ):
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    pref = t.pref
    if pref.method == "orpo":
        config, trainer_class = ORPOConfig(**trl_settings(t, out), beta=pref.beta), ORPOTrainer
    else:
        config = CPOConfig(
            **trl_settings(t, out),
            beta=pref.beta,
            loss_type=pref.loss_types[0],
            label_smoothing=pref.label_smoothing,
            cpo_alpha=pref.cpo_alpha,
            simpo_gamma=pref.simpo_gamma,
        )
        trainer_class = CPOTrainer
    model, tok, rows = trl_inputs(base, data, adapter)
    return trained(trainer_class(model=model, args=config, train_dataset=rows, processing_class=tok), t)


@pytest.mark.parametrize(
    "pref",
    [
        Preference(method="orpo", beta=0.3),
        Preference(method="cpo", beta=0.3),
        Preference(method="cpo", loss_type="simpo", beta=2.0, cpo_alpha=0.0, simpo_gamma=0.4),
        Preference(method="cpo", loss_type="ipo", beta=0.3, cpo_alpha=0.5),
    ],
    ids=["orpo", "cpo", "simpo", "cpo-ipo"],
)
def test_orpo_and_cpo_tenants_equal_trls_trainers(pref, llama_path, tmp_path):
    """Without a reference: ORPO (its odds ratio and the chosen NLL over prompt and completion) and CPO/SimPO
    equal TRL's ORPOTrainer and CPOTrainer over 3 steps of 2 micro-batches: losses, TRL's metrics, adapters."""
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    t = pref_tenant("p", data, adapter, pref, grad_accum=2, max_steps=3)
    trainer = Trainer(job(llama_path, [t]))
    trainer.train()
    assert trainer.tenants["p"].state is TenantState.FINISHED
    reference, logs = free_trl_run(llama_path, data, adapter, t, tmp_path / "trl")
    rows = ours(trainer, "p")
    assert [r["loss"] for r in rows] == pytest.approx([h["loss"] for h in logs], abs=TOL)
    names = [m for m in rows[0]["extra"] if m in logs[0]]
    assert {"rewards/margins", "rewards/accuracies", "nll_loss"} <= set(names)
    for m in names:
        assert [r["extra"][m] for r in rows] == pytest.approx([h[m] for h in logs], rel=1e-5, abs=TOL), m
    diff = max_diff(trainer.model.tenant_tensors("p"), peft_lora_tensors(reference.model))
    assert diff <= TOL, f"adapters differ by {diff}"


KTO_ROWS = [
    {
        "prompt": f"Question {i}: what do {'cats' if i % 2 else 'dogs'} like?",
        "completion": (" They like warm places" + " and naps" * (i % 3))
        if i % 3
        else " Nothing" + " at all" * i,
        "label": bool(i % 3),
    }
    for i in range(12)
]


def kto_trl_run(base: str, data: str, adapter: str, t: Tenant, out: Path) -> tuple[Any, list[dict]]:
    """TRL's KTOTrainer on the same rows (unpaired, or pairs it unpairs), order, AdamW and steps as ``t``."""
    from trl import KTOConfig, KTOTrainer

    pref = t.pref
    config = KTOConfig(
        **trl_settings(t, out),
        beta=pref.beta,
        loss_type=pref.loss_types[0],
        desirable_weight=pref.desirable_weight,
        undesirable_weight=pref.undesirable_weight,
        precompute_ref_log_probs=False,
    )
    model, tok, rows = trl_inputs(base, data, adapter)
    return trained(KTOTrainer(model=model, args=config, train_dataset=rows, processing_class=tok), t)


@pytest.mark.parametrize(
    ("pref", "paired"),
    [
        (Preference(method="kto", beta=0.3, reference="base"), False),
        (Preference(method="kto", beta=0.3, desirable_weight=1.3, undesirable_weight=0.7), False),
        (Preference(method="kto", loss_type="apo_zero_unpaired", beta=0.3, reference="base"), False),
        (Preference(method="kto", beta=0.3, reference="base"), True),
    ],
    ids=["kto", "kto-weighted-init-ref", "apo_zero_unpaired", "kto-unpaired-pairs"],
)
def test_kto_tenants_equal_trls_kto_trainer(pref, paired, llama_path, tmp_path):
    """KTO on unpaired rows (and on pairs, unpaired as TRL unpairs them): the KL estimate from each row's prompt
    with the previous row's completion, the reference the base or the init adapter; losses, TRL's metrics and
    the adapters equal KTOTrainer's over 3 steps of 2 micro-batches."""
    data = pair_file(tmp_path) if paired else pair_file(tmp_path, KTO_ROWS, "kto.jsonl")
    adapter = init_adapter(llama_path, tmp_path)
    # (steps that never straddle an epoch: HF's Trainer ends an epoch with a short accumulation, we do not)
    t = pref_tenant("k", data, adapter, pref, batch_size=4 if paired else 3, grad_accum=2, max_steps=3)
    trainer = Trainer(job(llama_path, [t]))
    trainer.train()
    assert trainer.tenants["k"].state is TenantState.FINISHED
    reference, logs = kto_trl_run(llama_path, data, adapter, t, tmp_path / "trl")
    rows = ours(trainer, "k")
    assert [r["loss"] for r in rows] == pytest.approx([h["loss"] for h in logs], abs=TOL)
    for m in (
        "kl",
        "rewards/chosen",
        "logps/chosen",
        "rewards/rejected",
        "logps/rejected",
        "rewards/margins",
    ):
        assert [r["extra"][m] for r in rows] == pytest.approx([h.get(m) for h in logs], rel=1e-5, abs=TOL), m
    diff = max_diff(trainer.model.tenant_tensors("k"), peft_lora_tensors(reference.model))
    assert diff <= TOL, f"adapters differ by {diff}"


@pytest.mark.slow  # (starts a served job)
def test_a_served_jobs_file_tenants_include_preference_tenants(llama_path, tmp_path):
    """A served job (the Tinker service on) feeds its file tenants through the same drivers: a DPO tenant in it
    trains to its steps, equal to the tenant trained alone, while the service waits for clients."""
    import time

    import mlora_lab as ml
    from mlora_lab.lora import read_adapter

    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    p = pref_tenant("p", data, adapter, Preference(beta=0.2, reference="base"), max_steps=3)
    svc = ml.serve(job(llama_path, [p], output_dir=str(tmp_path / "served")))
    try:
        deadline = time.monotonic() + 240
        while svc.tenant_state("p") != "finished":
            assert time.monotonic() < deadline and svc.status in ("starting", "running"), svc.logs(0)
            time.sleep(0.5)
        rows = svc.metrics()
        rows = rows[(rows["kind"] == "train") & (rows["tenant"] == "p")]
        margins = list(rows["rewards/margins"])
    finally:
        assert svc.stop() == "stopped", svc.logs(0)
    alone = Trainer(job(llama_path, [p]))
    alone.train()
    assert list(rows["loss"]) == pytest.approx(alone.losses("p"), abs=TOL)
    assert margins == pytest.approx([r["extra"]["rewards/margins"] for r in ours(alone, "p")], abs=TOL)
    assert max_diff(read_adapter(svc.adapter_path("p"))[1], alone.model.tenant_tensors("p")) <= TOL


@pytest.mark.slow
def test_expert_parallel_two_ranks_equal_one(tiny_models, tmp_path):
    """A DPO and a KTO tenant on a mixture of experts (mixtral) under ep=2: the experts split, tokens travel
    between the ranks, each rank trains its share of the pairs (rows); the run equals one process."""
    import mlora_lab as ml
    from mlora_lab.lora import read_adapter

    base, targets = tiny_models("mixtral"), ["q_proj", "v_proj"]
    adapter = init_adapter(base, tmp_path, targets=targets)
    data, kto = pair_file(tmp_path), pair_file(tmp_path, KTO_ROWS, "kto.jsonl")
    tenants = [
        pref_tenant(
            "a", data, adapter, Preference(beta=0.2, reference="base"), target_modules=targets, batch_size=3
        ),
        pref_tenant(
            "k", kto, adapter, Preference(method="kto", beta=0.3), target_modules=targets, batch_size=3
        ),
    ]
    one = Trainer(job(base, tenants, slot_modules=targets))
    one.train()
    spec = job(base, tenants, slot_modules=targets, parallel=ml.Parallel(nproc=2, fsdp=1, ep=2))
    spec.output_dir = str(tmp_path / "out")
    run = ml.launch(spec)
    state = run.wait(600)
    assert state == "finished", f"{state}: {run.error}\n{run.logs(0)}\n{run.logs(1)}"
    m = run.metrics()
    m = m[m["kind"] == "train"].set_index(["tenant", "tenant_step"]).sort_index()
    want = {(r["tenant"], r["tenant_step"]): r for r in one.history if r["kind"] == RowKind.TRAIN}
    assert set(m.index) == set(want)
    assert list(m["loss"]) == pytest.approx([want[k]["loss"] for k in m.index], abs=TOL)
    assert list(m["rewards/chosen"]) == pytest.approx(
        [want[k]["extra"]["rewards/chosen"] for k in m.index], abs=TOL
    )
    for name in ("a", "k"):
        assert max_diff(read_adapter(run.adapter_path(name))[1], one.model.tenant_tensors(name)) <= TOL, name


def test_tenants_on_the_same_pairs_share_one_base_reference(llama_path, tmp_path):
    """A β sweep (and IPO beside DPO) on the same pairs: one reference cache, each pair's reference forward made
    once for all of them; each tenant still trains as alone. A tenant whose reference is its init adapter, or
    on other pairs, has its own."""
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    other = pair_file(tmp_path, ROWS[:6], "other.jsonl")
    tenants = [
        pref_tenant("b1", data, adapter, Preference(beta=0.1, reference="base")),
        pref_tenant("b5", data, adapter, Preference(beta=0.5, reference="base"), shuffle=True),
        pref_tenant("ipo", data, adapter, Preference(loss_type="ipo", reference="base")),
        pref_tenant("init", data, adapter, Preference(beta=0.1)),
        pref_tenant("other", other, adapter, Preference(beta=0.1, reference="base")),
    ]
    together = Trainer(job(llama_path, tenants, max_tenants=5))
    passes = []
    driver = together.drivers.of(tenants[0])
    real = driver._reference_pass
    driver._reference_pass = lambda key, jobs: passes.append(sum(len(m) for _, m in jobs)) or real(key, jobs)
    together.train()
    feeds = {t.name: together.tenants[t.name].feed for t in tenants}
    assert feeds["b1"].reference is feeds["b5"].reference is feeds["ipo"].reference
    assert feeds["init"].reference is not feeds["b1"].reference is not feeds["other"].reference
    assert (
        sum(passes) == len(ROWS) + len(ROWS) + 6
    )  # the shared cache's 8 pairs once, the init's, the other's
    for t in tenants[:3]:
        alone = Trainer(job(llama_path, [t]))
        alone.train()
        assert together.losses(t.name) == pytest.approx(alone.losses(t.name), abs=TOL), t.name
        assert max_diff(together.model.tenant_tensors(t.name), alone.model.tenant_tensors(t.name)) <= TOL


def test_held_out_pairs_give_trls_eval_loss_and_metrics(llama_path, tmp_path):
    """``heldout_data`` of pairs: every ``heldout_every`` steps and at the end, the mean preference loss over the
    held-out pairs and TRL's metrics (a held-out row), equal to TRL's ``evaluate()`` (``eval_loss``,
    ``eval_rewards/...``) on the same pairs after the same steps; the base reference of the held-out pairs is
    shared with a tenant training on them, the init adapter's computed before the first step."""
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    heldout = pair_file(tmp_path, ROWS[:4], "heldout.jsonl")
    t = pref_tenant("p", data, adapter, Preference(beta=0.3), heldout_data=heldout, grad_accum=2, max_steps=2)
    trainer = Trainer(job(llama_path, [t], heldout_every=1))
    trainer.train()
    rows = [r for r in trainer.history if r["kind"] == RowKind.HELDOUT and r["tenant"] == "p"]
    reference, _ = trl_run(llama_path, data, adapter, t, tmp_path / "trl")
    eval_rows = [json.loads(line) for line in Path(heldout).read_text().splitlines()]
    reference.args.per_device_eval_batch_size = t.batch_size
    got = reference.evaluate(datasets.Dataset.from_list(eval_rows))
    assert rows[-1]["loss"] == pytest.approx(got["eval_loss"], abs=TOL)
    for m in METRICS:
        assert rows[-1]["extra"][m] == pytest.approx(got[f"eval_{m}"], rel=1e-5, abs=TOL), m
    assert len(rows) >= 2 and rows[0]["step"] < rows[-1]["step"]
    assert trainer.heldout_losses(["p"])["p"] == pytest.approx(rows[-1]["loss"], abs=1e-6)


def test_a_resume_with_other_held_out_pairs_recomputes_their_base_reference(llama_path, tmp_path):
    """Review finding: the held-out cache's values were restored by row index onto other held-out pairs, and
    through the shared cache reached a tenant training on those pairs. Now the held-out pairs' digest is kept:
    other pairs' base references are dropped and computed again; an init adapter's cannot be, so it is refused."""
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    first, second = pair_file(tmp_path, ROWS[:4], "a.jsonl"), pair_file(tmp_path, ROWS[4:], "b.jsonl")
    y = pref_tenant("y", data, adapter, Preference(reference="base"), heldout_data=first, max_steps=3)
    trainer = Trainer(job(llama_path, [y]), run_dir=tmp_path / "run")
    trainer.step()
    trainer.save_checkpoint()
    trainer.close()
    moved = Tenant(**{**y.__dict__, "heldout_data": second})
    x = pref_tenant("x", second, adapter, Preference(reference="base"), max_steps=3)
    again = Trainer(job(llama_path, [moved, x]), run_dir=tmp_path / "run", resume=True)
    again.train()
    fresh = Trainer(job(llama_path, [x]))
    fresh.train()
    assert again.losses("x") == pytest.approx(fresh.losses("x"), abs=TOL)
    assert again.heldout_losses(["y"])["y"] < 5  # (the first pairs' values gave 6.9 here)
    init_ref = pref_tenant("i", data, adapter, Preference(), heldout_data=first, max_steps=3)
    saved = Trainer(job(llama_path, [init_ref]), run_dir=tmp_path / "run2")
    saved.step()
    state = saved.tenants["i"].feed.state_dict()
    saved.close()
    other = saved.drivers.of(init_ref).feed(Tenant(**{**init_ref.__dict__, "heldout_data": second}))
    with pytest.raises(
        ValueError, match="its held-out pairs changed since the checkpoint, and their reference"
    ):
        other.load_state_dict(state)


def test_a_windows_metric_sums_are_saved_over_every_process_and_restored_on_rank_0():
    """Review finding: a mid-window checkpoint held rank 0's own metric sums only. They are saved summed over
    the data-parallel processes (as the window's loss) and restored on rank 0, zeros elsewhere."""
    from mlora_lab.data import TenantStream
    from mlora_lab.job.drivers.preference import PrefFeed

    class Comm:
        def __init__(self, rank: int) -> None:
            self.dp_rank = rank

        def sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2  # (two processes holding the same partial sums)

    def feed(rank: int) -> PrefFeed:
        return PrefFeed([], [], [], TenantStream([0, 1], seed=0), None, "d", comm=Comm(rank))

    saving = feed(0)
    saving.sums += torch.tensor([1.0, 2, 3, 4, 5, 6, 2])
    state = saving.state_dict()
    assert state["pref_sums"].tolist() == [2.0, 4, 6, 8, 10, 12, 4]
    for rank, want in ((0, [2.0, 4, 6, 8, 10, 12, 4]), (1, [0.0] * 7)):
        f = feed(rank)
        f.load_state_dict(state)
        assert f.sums.tolist() == want


def test_a_resume_with_another_grad_accum_mid_window_fails_only_that_tenant(llama_path, make_data, tmp_path):
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    p = pref_tenant("p", data, adapter, Preference(reference="base"), grad_accum=4, max_steps=2)
    s = Tenant(name="s", data=make_data("reverse"), rank=4, batch_size=2, max_steps=3)
    first = Trainer(job(llama_path, [p, s]), run_dir=tmp_path / "run")
    first.step()
    first.save_checkpoint()
    first.close()
    again = Trainer(
        job(llama_path, [Tenant(**{**p.__dict__, "grad_accum": 2}), s]), run_dir=tmp_path / "run", resume=True
    )
    again.train()
    assert again.tenants["p"].state is TenantState.FAILED
    assert "grad_accum is 2 now: resume it with the grad_accum it was saved with" in again.tenants["p"].reason
    assert again.tenants["s"].state is TenantState.FINISHED


def test_reference_forwards_keep_to_a_micro_batch_and_max_pass_tokens(llama_path, tmp_path):
    """Review finding: a reference forward held a whole window (B·k pairs) of every tenant at once. It holds at
    most a micro-batch (B pairs) of each, and with ``max_pass_tokens`` the tenants' groups go in passes."""
    data, adapter = pair_file(tmp_path), init_adapter(llama_path, tmp_path)
    other = pair_file(tmp_path, ROWS[::-1], "other.jsonl")
    tenants = [
        pref_tenant("a", data, adapter, Preference(reference="base"), grad_accum=4, max_steps=1),
        pref_tenant("b", other, adapter, Preference(reference="base"), grad_accum=4, max_steps=1),
    ]
    trainer = Trainer(job(llama_path, tenants, max_pass_tokens=64))
    sizes = []
    real = trainer.engine.forward

    def counted(groups, temperatures=None):
        sizes.append(sum(len(rows) for _, rows in groups))
        return real(groups, temperatures)

    trainer.engine.forward = counted
    trainer.train()
    assert max(sizes) <= 4, sizes  # one tenant's micro-batch: 2 pairs, 4 sequences
