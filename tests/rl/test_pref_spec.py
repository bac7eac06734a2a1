"""Preference tenants in the spec: ``ml.Preference`` in job.json (``"pref"``), and validation of its settings and
its pairs, every problem of every tenant reported at once before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlora_lab as ml
from mlora_lab.rl import preference
from mlora_lab.spec.fields import SpecError
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import F_DIVERGENCES, PREFERENCE_LOSS_TYPES, Preference
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems as spec_problems

PAIRS = [
    {"prompt": "Say hi.", "chosen": " Hi there!", "rejected": " No."},
    {"prompt": "Name a fruit.", "chosen": " An apple.", "rejected": " A chair."},
]


def pairs(tmp: Path, rows: list = PAIRS, name: str = "pairs.jsonl") -> str:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def texts(spec: JobSpec) -> list[str]:
    return [str(p) for p in spec_problems(spec)]


def test_the_spec_offers_the_engines_loss_types_and_divergences():
    assert PREFERENCE_LOSS_TYPES == preference.LOSS_TYPES
    assert F_DIVERGENCES == preference.F_DIVERGENCES


def test_preference_settings_round_trip_through_job_json(tmp_path):
    pref = Preference(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3], beta=0.05, ld_alpha=0.5)
    spec = JobSpec(base_model="m", tenants=[Tenant(name="a", data="p.jsonl", pref=pref)])
    path = tmp_path / "job.json"
    spec.to_json(path)
    saved = json.loads(path.read_text())["tenants"][0]["pref"]
    assert saved["loss_type"] == ["sigmoid", "sft"] and saved["beta"] == 0.05 and saved["reference"] is None
    assert Preference().loss_types == ["sigmoid"] and Preference(method="kto").loss_types == ["kto"]
    back = JobSpec.load(path).tenants[0].pref
    assert back == pref and back.loss_types == ["sigmoid", "sft"]
    with pytest.raises(
        SpecError, match=r"tenants\[0\] \('a'\)\.pref: unknown field 'bta' \(did you mean 'beta'\?\)"
    ):
        JobSpec.from_dict({"base_model": "m", "tenants": [{"name": "a", "data": "p", "pref": {"bta": 1}}]})


def test_the_default_reference_is_trls(tmp_path):
    assert Preference().reference_of(None) == "base"
    assert Preference().reference_of("init") == "init_adapter"  # TRL copies a pretrained adapter as "ref"
    assert Preference(reference="base").reference_of("init") == "base"


def test_every_problem_of_every_preference_tenant_at_once(llama_path, tmp_path):
    good = pairs(tmp_path)
    bad = pairs(
        tmp_path,
        [
            {"prompt": "a", "chosen": "x", "rejected": "x"},
            {"prompt": "a", "chosen": "x"},
            {"prompt": "a", "completion": "y", "label": True},
            {"prompt": "a", "chosen": "x", "rejected": "y", "score": 3},
        ],
        "bad.jsonl",
    )
    spec = JobSpec(
        base_model=llama_path,
        tenants=[
            Tenant(name="unknown", data=good, pref=Preference(loss_type=["sigmoid", "kto"])),
            Tenant(name="beta", data=good, pref=Preference(beta=0.0, label_smoothing=0.7)),
            Tenant(name="exo", data=good, pref=Preference(loss_type="exo_pair")),
            Tenant(
                name="fdiv",
                data=good,
                pref=Preference(loss_type="bco_pair", f_divergence_type="js_divergence"),
            ),
            Tenant(
                name="weights", data=good, pref=Preference(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
            ),
            Tenant(name="init", data=good, pref=Preference(reference="init_adapter")),
            Tenant(name="both", data=good, pref=Preference(), rl=ml.RL(reward="r.py:f")),
            Tenant(name="heldout", data=good, heldout_data=good, pref=Preference(method="kto")),
            Tenant(name="heldbad", data=good, heldout_data=bad, pref=Preference()),
            Tenant(name="rows", data=bad, pref=Preference()),
        ],
        max_tenants=16,
    )
    out = "\n".join(texts(spec))
    for needle in (
        "tenant 'unknown': pref.loss_type: unknown loss type(s) 'kto'; offered (TRL 1.16's DPOTrainer): sigmoid, hinge",
        "tenant 'beta': pref.beta must be in (0, 1000] (got 0.0)",
        "tenant 'beta': pref.label_smoothing must be in [0, 0.5) (got 0.7)",
        "tenant 'exo': pref: exo_pair needs 0 < label_smoothing < 1",
        "tenant 'fdiv': pref: f_divergence='js_divergence' applies only to sigmoid",
        "tenant 'weights': pref: 1 loss_weights for 2 loss_types",
        "tenant 'init': pref.reference = 'init_adapter' needs the tenant's init_adapter",
        "tenant 'both': a tenant learns from rewards (rl) or from preference pairs (pref), not both",
        "tenant 'heldout': a KTO tenant has no heldout_data yet",
        "tenant 'heldbad': heldout_data: ",
        "bad.jsonl line 1: 'chosen' and 'rejected' are the same",
        "bad.jsonl line 2: missing key 'rejected'",
        "bad.jsonl line 3: an unpaired (KTO) row; a preference tenant trains on pairs",
        "bad.jsonl line 4: unexpected key 'score'",
    ):
        assert needle in out, f"{needle!r} not in:\n{out}"
    assert out.count("tenant 'rows': data: ") == 4 and out.count("tenant 'heldbad': heldout_data: ") == 4
    spec.output_dir = str(tmp_path / "out")
    with pytest.raises(SpecError, match="tenant 'unknown'"):
        ml.launch(spec)  # refused before any process starts
    assert not (tmp_path / "out").exists()


def test_packing_and_unpaired_rows_are_refused(llama_path, tmp_path):
    unpaired = pairs(tmp_path, [{"prompt": "a", "completion": " b", "label": True}], "kto.jsonl")
    spec = JobSpec(
        base_model=llama_path,
        tenants=[Tenant(name="p", data=pairs(tmp_path), pref=Preference())],
        packing=True,
    )
    assert any("turn packing off in a job with preference tenants" in p for p in texts(spec))
    from mlora_lab.data import DataError
    from mlora_lab.rl.pairs import read_pairs

    with pytest.raises(DataError, match=r"line 1: an unpaired \(KTO\) row"):
        read_pairs(unpaired, None, 64)


def test_orpo_and_cpo_options_are_checked_for_their_method(llama_path, tmp_path):
    good = pairs(tmp_path)
    spec = JobSpec(
        base_model=llama_path,
        tenants=[
            Tenant(name="orpo", data=good, pref=Preference(method="orpo", loss_type="ipo", reference="base")),
            Tenant(name="cpo", data=good, pref=Preference(method="cpo", loss_type="kto")),
            Tenant(
                name="hinge", data=good, pref=Preference(method="cpo", loss_type="hinge", label_smoothing=0.1)
            ),
            Tenant(name="many", data=good, pref=Preference(method="cpo", loss_type=["sigmoid", "ipo"])),
            Tenant(name="kto", data=good, pref=Preference(method="simpo")),
            Tenant(name="fine", data=good, pref=Preference(method="cpo", loss_type="simpo", cpo_alpha=0.0)),
            Tenant(name="kto1", data=good, pref=Preference(method="kto"), batch_size=1),
            Tenant(
                name="ktow",
                data=good,
                pref=Preference(method="kto", desirable_weight=0, undesirable_weight=0),
            ),
            Tenant(name="ktofine", data=good, pref=Preference(method="kto", reference="base")),
            Tenant(
                name="ktols", data=good, pref=Preference(method="kto", label_smoothing=0.2, cpo_alpha=0.5)
            ),
            Tenant(name="dpocpo", data=good, pref=Preference(simpo_gamma=0.2)),
            Tenant(name="hostile", data=good, pref=Preference(method=["dpo"], loss_type="nope")),
            Tenant(name="drop", data=good, pref=Preference(), dropout=0.1),
        ],
        max_tenants=16,
    )
    out = "\n".join(texts(spec))
    for needle in (
        "tenant 'orpo': pref: orpo has one loss, its odds ratio: leave loss_type unset (got 'ipo')",
        "tenant 'orpo': pref: orpo does not read reference (reference is dpo and kto's): leave it unset",
        "tenant 'cpo': pref.loss_type: unknown loss type(s) 'kto'; offered (TRL 1.16's CPOTrainer): sigmoid, "
        "hinge, ipo, simpo",
        "tenant 'hinge': pref: hinge ignores label_smoothing",
        "tenant 'many': pref: cpo takes one loss_type",
        "tenant 'kto': pref.method must be one of",
        "tenant 'kto1': KTO's KL estimate pairs each row's prompt with another row's completion",
        "tenant 'ktow': pref: desirable_weight and undesirable_weight are both 0",
    ):
        assert needle in out, f"{needle!r} not in:\n{out}"
    for needle in (
        "tenant 'ktols': pref: kto does not read label_smoothing, cpo_alpha (label_smoothing is dpo and cpo's; "
        "cpo_alpha is cpo's): leave them unset",
        "tenant 'dpocpo': pref: dpo does not read simpo_gamma (simpo_gamma is cpo's): leave it unset",
        "tenant 'hostile': pref.method must be one of",
        "tenant 'hostile': pref.loss_type: unknown loss type(s) 'nope'",
        "tenant 'drop': dropout = 0.1 in a preference tenant: TRL's preference trainers turn dropout off",
    ):
        assert needle in out, f"{needle!r} not in:\n{out}"
    assert "internal error" not in out
    assert "tenant 'fine'" not in out and "tenant 'ktofine'" not in out
