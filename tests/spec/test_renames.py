"""Renamed spec fields (:mod:`mlora_lab.spec.renames`): ``eval_data`` -> ``heldout_data``, ``eval_every`` ->
``heldout_every``, ``serve`` -> ``stay_up``. Each old name is still read, as a job.json key, a constructor
keyword and an attribute, with one ``DeprecationWarning`` naming the new name and the removal date; files,
forms and validation problems speak the new names only."""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import json
import pickle
import warnings

import pytest

from mlora_lab.lab.forms.builders import JobBuilder, TenantForm
from mlora_lab.spec.fields import SpecError, fields_info
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import RL
from mlora_lab.spec.renames import REMOVAL
from mlora_lab.spec.tenant import Tenant
from mlora_lab.validate import problems

NEW = {
    "base_model": "base",
    "tenants": [
        {"name": "a", "data": "a.jsonl", "heldout_data": "a_heldout.jsonl"},
        {"name": "b", "data": "b.jsonl", "heldout_data": None},
        {"name": "c", "data": "c.jsonl", "heldout_data": "c_heldout.jsonl"},
    ],
    "heldout_every": 7,
    "stay_up": True,
}


def old_keys(d: dict) -> dict:
    """``d`` as an older version wrote it: every renamed key under its old name."""
    out = {
        ("eval_every" if k == "heldout_every" else "serve" if k == "stay_up" else k): v for k, v in d.items()
    }
    out["tenants"] = [
        {("eval_data" if k == "heldout_data" else k): v for k, v in t.items()} for t in d["tenants"]
    ]
    return out


def deprecations(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_an_old_job_json_loads_with_one_warning_and_equals_the_new_one(tmp_path):
    """Three tenants' ``eval_data`` and the job's ``eval_every`` and ``serve``: one warning for the file
    (naming every old key, its new name and the removal date), a spec equal to the new file's, and the file
    written back with the new names only."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps(old_keys(NEW)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = JobSpec.load(path)
    (w,) = deprecations(caught)
    text = str(w.message)
    for name in (
        "'eval_every'",
        "'serve'",
        "'eval_data'",
        "heldout_every",
        "stay_up",
        "heldout_data",
        REMOVAL,
    ):
        assert name in text, text
    assert w.filename == __file__, "attributed to the caller outside mlora_lab"
    path.write_text(json.dumps(NEW))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new file: no warning at all
        new = JobSpec.load(path)
    assert old == new
    assert old.heldout_every == 7 and old.stay_up is True
    assert [t.heldout_data for t in old.tenants] == [
        str(tmp_path / "a_heldout.jsonl"),
        None,
        str(tmp_path / "c_heldout.jsonl"),
    ]
    written = json.loads(old.to_json())
    assert "heldout_every" in written and "stay_up" in written
    assert not {"eval_every", "serve"} & set(written)
    assert all("heldout_data" in t and "eval_data" not in t for t in written["tenants"])


def test_a_tenant_dict_with_eval_data_warns_once(tmp_path):
    """A control message or a checkpoint's tenant written by an older version (``Tenant.from_dict``)."""
    with pytest.warns(DeprecationWarning, match=r"'eval_data'.*use heldout_data") as caught:
        t = Tenant.from_dict({"name": "a", "data": "a.jsonl", "eval_data": "e.jsonl"})
    assert len(deprecations(caught.list)) == 1
    assert t == Tenant(name="a", data="a.jsonl", heldout_data="e.jsonl")


def test_old_keyword_arguments_and_attributes_still_work_with_a_warning():
    with pytest.warns(
        DeprecationWarning, match=r"Tenant\(eval_data=\.\.\.\): deprecated, use heldout_data"
    ) as w:
        t = Tenant(name="a", data="a.jsonl", eval_data="e.jsonl")
    assert t.heldout_data == "e.jsonl" and w.list[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"Tenant\.eval_data: deprecated, use heldout_data"):
        assert t.eval_data == "e.jsonl"
    with pytest.warns(DeprecationWarning, match=r"Tenant\.eval_data: deprecated"):
        t.eval_data = "f.jsonl"
    assert t.heldout_data == "f.jsonl"
    with pytest.warns(
        DeprecationWarning, match=r"JobSpec\(eval_every=\.\.\.\): deprecated, use heldout_every"
    ):
        spec = JobSpec(base_model="m", tenants=[t], eval_every=3)
    assert spec.heldout_every == 3
    with pytest.warns(DeprecationWarning, match=r"JobSpec\.eval_every: deprecated"):
        assert spec.eval_every == 3
    with pytest.warns(DeprecationWarning, match=r"JobSpec\.eval_every: deprecated"):
        spec.eval_every = 5
    assert spec.heldout_every == 5
    # the old names are no dataclass fields: fields(), asdict() and replace() see the new names only
    assert "eval_data" not in {f.name for f in dataclasses.fields(Tenant)}
    assert "eval_every" not in dataclasses.asdict(spec) and "serve" not in dataclasses.asdict(spec)
    # replace() with an old name: the change wins over the value replace copies under the new name
    with pytest.warns(DeprecationWarning, match=r"Tenant\(eval_data=\.\.\.\)") as w:
        assert dataclasses.replace(t, eval_data=None).heldout_data is None
    assert w.list[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"JobSpec\(serve=\.\.\.\)"):
        assert (
            dataclasses.replace(JobSpec(base_model="m", tenants=[], stay_up=True), serve=False).stay_up
            is False
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(t, heldout_data=None).heldout_data is None
        assert dataclasses.replace(spec, heldout_every=0).heldout_every == 0


def test_an_old_name_beside_its_new_one_must_agree():
    """Given both, they are one setting when they agree and refused when they do not, in the constructor
    (keyword or positional) as in JSON: neither silently wins."""
    with pytest.warns(DeprecationWarning):
        assert Tenant(name="a", data="d", heldout_data="e", eval_data="e").heldout_data == "e"
        with pytest.raises(
            SpecError, match=r"eval_data \(the old name of heldout_data\) and heldout_data disagree"
        ):
            Tenant(name="a", data="d", heldout_data="e", eval_data="f")
        with pytest.raises(
            SpecError, match=r"eval_data \(the old name of heldout_data\) and heldout_data disagree"
        ):
            Tenant("a", "d", "e", eval_data="f")
        with pytest.raises(
            SpecError, match=r"eval_every \(the old name of heldout_every\) and heldout_every disagree"
        ):
            JobSpec(base_model="m", tenants=[], heldout_every=2, eval_every=3)
        with pytest.raises(SpecError) as err:
            JobSpec.from_dict(
                {
                    "base_model": "m",
                    "tenants": [{"name": "a", "data": "d", "heldout_data": "e", "eval_data": "f"}],
                    "heldout_every": 1,
                    "eval_every": 2,
                }
            )
    assert [str(p) for p in err.value.problems] == [
        "job: eval_every (the old name of heldout_every) and heldout_every disagree: give heldout_every only",
        "tenants[0] ('a'): eval_data (the old name of heldout_data) and heldout_data disagree: give heldout_data only",
    ]


def test_the_serve_alias_names_its_removal_date():
    """``serve`` (stay_up's old name) warns, in every form, that it goes in mlora_lab 0.3 or on 2027-06-01."""
    assert "mlora_lab 0.3" in REMOVAL and "2027-06-01" in REMOVAL
    with pytest.warns(DeprecationWarning, match=r"JobSpec\(serve=\.\.\.\): deprecated, use stay_up") as w:
        spec = JobSpec(base_model="m", tenants=[], serve=True)
    assert REMOVAL in str(w.list[0].message) and spec.stay_up is True
    with pytest.warns(DeprecationWarning, match=r"JobSpec\.serve: deprecated, use stay_up") as w:
        assert spec.serve is True
    assert REMOVAL in str(w.list[0].message)
    with pytest.warns(DeprecationWarning, match=r"job\.json's 'serve': deprecated, use stay_up") as w:
        JobSpec.from_dict({"base_model": "m", "tenants": [], "serve": True})
    assert REMOVAL in str(w.list[0].message)
    assert "2027-06-01" in JobSpec.serve.__doc__ and "mlora_lab 0.3" in JobSpec.serve.__doc__


class OldPickle:
    """Pickles as an object of ``cls`` whose state (its ``__dict__``) is ``state``: what an older version's
    ``pickle.dumps(obj)`` wrote when the field still had its old name."""

    def __init__(self, cls: type, state: dict) -> None:
        self.cls, self.state = cls, state

    def __reduce__(self):
        return copyreg._reconstructor, (self.cls, object, None), self.state


def tenant_state(**changes) -> dict:
    return {**vars(Tenant(name="a", data="a.jsonl")), **changes}


def test_an_old_pickle_reads_its_old_keys_as_the_new_names_with_the_warning():
    """A Tenant pickled with ``eval_data`` and a JobSpec with ``eval_every`` and ``serve`` in their state:
    unpickled, the values are under the new names (not lost behind the old names' properties), with one
    DeprecationWarning per object naming the new names and the removal date, attributed to the caller."""
    state = tenant_state(eval_data="e.jsonl")
    del state["heldout_data"]
    with pytest.warns(
        DeprecationWarning, match=r"a pickled Tenant's 'eval_data': deprecated, use heldout_data"
    ) as w:
        t = pickle.loads(pickle.dumps(OldPickle(Tenant, state)))
    assert len(deprecations(w.list)) == 1 and REMOVAL in str(w.list[0].message)
    assert w.list[0].filename == __file__
    assert t == Tenant(name="a", data="a.jsonl", heldout_data="e.jsonl") and "eval_data" not in vars(t)

    spec = vars(JobSpec(base_model="m", tenants=[]))
    spec = {
        ("eval_every" if k == "heldout_every" else "serve" if k == "stay_up" else k): v
        for k, v in spec.items()
    }
    spec |= {"eval_every": 7, "serve": True, "tenants": [OldPickle(Tenant, state)]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = pickle.loads(pickle.dumps(OldPickle(JobSpec, spec)))
    texts = sorted(str(w.message) for w in deprecations(caught))
    assert len(texts) == 2 and "'eval_every' and 'serve'" in texts[0] and "'eval_data'" in texts[1], texts
    assert job.heldout_every == 7 and job.stay_up is True and job.tenants[0].heldout_data == "e.jsonl"


def test_a_new_pickle_or_copy_warns_nothing_and_an_old_key_that_disagrees_is_refused():
    t = Tenant(name="a", data="a.jsonl", heldout_data="e.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pickle.loads(pickle.dumps(t)) == t and copy.deepcopy(t) == t
    with pytest.raises(SpecError, match=r"a pickled Tenant: eval_data \(the old name of heldout_data\) and"):
        pickle.loads(pickle.dumps(OldPickle(Tenant, tenant_state(heldout_data="e", eval_data="f"))))


def test_validation_forms_and_field_metadata_use_the_new_names(tmp_path):
    """A problem of the held-out rows names ``heldout_data`` / ``heldout_every`` (also when the spec was given
    the old names), and the forms and the field metadata know only the new names."""
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "p"}\n')
    with pytest.warns(DeprecationWarning):
        rl = Tenant(name="a", data=str(rows), eval_data=str(rows), rl=RL(reward="x.py:f"))
        spec = JobSpec(base_model=str(tmp_path), tenants=[rl], eval_every=-1)
    found = problems(spec, files=False)
    assert any(p.field == "heldout_every" and "heldout_every must be >= 0" in p.message for p in found), found
    held = [p for p in found if p.field == "heldout_data"]
    assert held and "an RL tenant has no heldout_data" in held[0].message
    assert not any("eval_data" in str(p) or "eval_every" in str(p) for p in found), found
    assert "heldout_data" in dict(fields_info(Tenant)) and "eval_data" not in dict(fields_info(Tenant))
    assert "heldout_every" in dict(fields_info(JobSpec)) and "eval_every" not in dict(fields_info(JobSpec))
    assert dict(fields_info(Tenant))["heldout_data"].label == "held-out data"
    form = TenantForm(base_model=str(tmp_path))
    assert hasattr(form, "heldout_data") and not hasattr(form, "eval_data")
    assert hasattr(JobBuilder(base_model=str(tmp_path)), "heldout_every")
