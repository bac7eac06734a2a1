"""One targeting rule everywhere (``mlora_lab.lora.targets``), and it is PEFT's.

Over the tiny-architecture table plus models whose output layer is tied to the input embedding or is
not called ``lm_head`` (GPT-NeoX-Japanese: ``embed_out``; BioGPT: ``output_projection``): "all-linear"
is exactly what ``peft.get_peft_model(target_modules="all-linear")`` wraps, and the spec validator, the
model wrapper, the saved adapter and the tenant form all use that same set; suffix and regex matching
agree with PEFT's ``check_target_module_exists``; a tenant that names the output layer explicitly is
accepted, slotted, saved and offered consistently.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import peft
import pytest
import torch
import transformers
from conftest import task_rows, write_jsonl
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from mlora_lab.lab.forms.builders import TenantForm, linear_target_names
from mlora_lab.lora import MultiLoRAModel
from mlora_lab.lora.targets import (
    ALL_LINEAR,
    has_all_linear,
    is_all_linear,
    linear_module_names,
    match_targets,
    matches,
    output_layer_names,
    storable_targets,
    suffixes,
)
from mlora_lab.spec.job import JobSpec, effective_slot_modules
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import ARCHITECTURES, MOE_ARCHITECTURES, build_tokenizer, tiny_config
from mlora_lab.validate import all_linear_names, linear_target_options
from mlora_lab.validate import problems as spec_problems

# The repo's table, plus: a tied-embedding model, and output layers not called lm_head (with
# transformers v5, GPT-NeoX's own output layer is called lm_head; GPT-NeoX-Japanese keeps embed_out).
EXTRA = ["llama+tied", "gpt_neox_japanese", "biogpt"]
ARCHS = [*ARCHITECTURES, *EXTRA]
OUTPUT = {"gpt_neox_japanese": "embed_out", "biogpt": "output_projection"}


def _config(arch: str, vocab: int) -> transformers.PretrainedConfig:
    if arch in ARCHITECTURES:
        return tiny_config(arch, vocab)
    if arch == "llama+tied":
        config = tiny_config("llama", vocab)
        config.tie_word_embeddings = True
        return config
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gpt_neox_japanese":
        return transformers.GPTNeoXJapaneseConfig(
            vocab_size=vocab,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_multiple_size=2,
            max_position_embeddings=256,
            **ids,
        )
    if arch == "biogpt":
        return transformers.BioGptConfig(
            vocab_size=vocab,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=256,
            **ids,
        )
    raise ValueError(arch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(arch) -> path``: a model directory (weights + the tiny tokenizer), built once per arch."""
    root, cache = tmp_path_factory.mktemp("targets"), {}

    def get(arch: str) -> str:
        if arch not in cache:
            out = Path(root) / arch.replace("+", "_")
            tok = build_tokenizer(out)
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(_config(arch, len(tok))).save_pretrained(out)
            cache[arch] = str(out)
        return cache[arch]

    return get


def load(path: str) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path)


def peft_wrapped(model: nn.Module, targets) -> tuple[list[str], list[str]]:
    """Names of the ``nn.Linear`` layers PEFT puts LoRA on for ``targets``, and of its other LoRA wrappers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tied-embedding and MoE-conversion notices
        pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=targets))
    names = [
        (n.removeprefix("base_model.model."), m) for n, m in pm.named_modules() if isinstance(m, LoraLayer)
    ]
    linear = [n for n, m in names if isinstance(m, PeftLoraLinear)]
    return linear, [n for n, m in names if not isinstance(m, PeftLoraLinear)]


def peft_selects(targets, names: list[str]) -> list[str]:
    """The names PEFT's ``check_target_module_exists`` selects for ``targets`` (a list or a regex)."""
    config = peft.LoraConfig(r=2, target_modules=targets)
    return [n for n in names if check_target_module_exists(config, n)]


# ---------------------------------------------------------------------------------------------
# all-linear: one set, PEFT's
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_all_linear_is_what_peft_wraps(arch, saved):
    model = load(saved(arch))
    ours = linear_module_names(model)
    output = OUTPUT.get(arch, "lm_head")
    assert output_layer_names(model) == [output]
    assert output not in ours and len(ours) == sum(isinstance(m, nn.Linear) for m in model.modules()) - 1
    linear, other = peft_wrapped(model, "all-linear")
    assert linear == ours
    # With transformers v5, PEFT's "all-linear" on a MoE model also puts LoRA on the packed experts and
    # the router (they were nn.Linear in v4); here experts are targeted with target_parameters.
    assert not other or arch in MOE_ARCHITECTURES
    assert all(re.search(r"\.mlp\.(experts(\.base_layer)?|gate)$", n) for n in other), other
    # On the meta device (how the spec and the forms look at a model) the answer is the same.
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(model.config)
    assert output_layer_names(meta) == [output] and linear_module_names(meta) == ours


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_wrapper_adapter_and_form_agree(arch, saved, tmp_path):
    path = saved(arch)
    model = load(path)
    ours = linear_module_names(model)
    every = [n for n, _ in model.named_modules()]
    # the spec validator
    assert all_linear_names(path) == ours
    # the form: short names, in model order, selecting exactly all-linear (never the output layer)
    options = linear_target_options(path)
    assert linear_target_names(path) == options
    assert peft_selects(options, every) == ours
    form = TenantForm(base_model=path)
    assert form.linear_names == options and list(form.target_modules.options) == [ALL_LINEAR, *options]
    # the model wrapper: slots, a tenant's layers, and the adapter it saves
    mm = MultiLoRAModel(model, max_tenants=2, max_rank=4, slot_modules="all-linear")
    assert list(mm.layers) == ours
    assert mm.add_tenant("all", rank=2, target_modules=["all-linear"]).modules == ours
    assert mm.add_tenant("short", rank=2, target_modules=options).modules == ours
    config = mm.peft_config("all")
    assert isinstance(config.target_modules, set | list) and set(config.target_modules) == set(options)
    assert peft_selects(sorted(config.target_modules), every) == ours
    mm.save_adapter("all", tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(load(path), tmp_path / "adapter")
    assert [
        n.removeprefix("base_model.model.") for n, m in loaded.named_modules() if isinstance(m, LoraLayer)
    ] == ours


@pytest.mark.parametrize("arch", ARCHS)
def test_suffix_and_regex_matching_agree_with_peft(arch, saved):
    config = transformers.AutoConfig.from_pretrained(saved(arch))  # (built outside: it saves real weights)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_modules() if n]
    parts = {n.rsplit(".", 1)[-1] for n in names}
    twos = {".".join(n.split(".")[-2:]) for n in names if "." in n}
    targets = [*sorted(parts | twos), "proj", "layers.0", names[-1], names[len(names) // 2], "nope", ""]
    for t in targets:
        assert [n for n in names if matches(n, [t])] == peft_selects([t], names), t
    several = [*sorted(parts)[:3], "layers.1.mlp"]
    assert [n for n in names if matches(n, several)] == peft_selects(several, names)
    for regex in (r".*\.(q_proj|v_proj|dense)", r".*layers\.0\..*", output_layer_names(model)[0], "layers"):
        assert [n for n in names if matches(n, regex)] == peft_selects(regex, names), regex


# ---------------------------------------------------------------------------------------------
# The output layer, named explicitly
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt_neox_japanese", "llama+tied", "llama"])
def test_naming_the_output_layer_is_consistent(arch, saved, tmp_path):
    path = saved(arch)
    model = load(path)
    out = OUTPUT.get(arch, "lm_head")
    ours = linear_module_names(model)
    # PEFT puts LoRA on it when named
    assert peft_wrapped(model, [out])[0] == [out]
    # the wrapper: not slotted by all-linear; slotted when slot_modules name it (alone or with all-linear)
    mm = MultiLoRAModel(copy.deepcopy(model), max_tenants=2, max_rank=4, slot_modules="all-linear")
    with pytest.raises(ValueError, match=f"target modules \\['{out}'\\] have no adapter slots"):
        mm.add_tenant("head", rank=2, target_modules=[out])
    mm = MultiLoRAModel(copy.deepcopy(model), max_tenants=2, max_rank=4, slot_modules=["all-linear", out])
    assert set(mm.layers) == {*ours, out}
    assert (
        mm.add_tenant("all", rank=2, target_modules=["all-linear"]).modules == ours
    )  # never the output layer
    assert mm.add_tenant("head", rank=2, target_modules=[out]).modules == [out]
    assert list(mm.peft_config("head").target_modules) == [out]
    mm.save_adapter("head", tmp_path / "head")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(load(path), tmp_path / "head")
    assert [
        n.removeprefix("base_model.model.") for n, m in loaded.named_modules() if isinstance(m, LoraLayer)
    ] == [out]
    # the spec: accepted; the effective slots cover it next to an all-linear tenant
    data = write_jsonl(tmp_path / "d.jsonl", task_rows("reverse", 4))
    spec = JobSpec(
        base_model=path,
        seq_len=64,
        max_rank=8,
        tenants=[
            Tenant(name="a", data=data, rank=4, target_modules=["all-linear"]),
            Tenant(name="h", data=data, rank=4, target_modules=[out]),
        ],
    )
    assert spec_problems(spec) == []
    assert effective_slot_modules(spec) == ["all-linear", out]
    spec.slot_modules = ["all-linear"]
    (problem,) = map(str, spec_problems(spec))
    assert f"tenant 'h': target_modules {out} not covered by slot_modules" in problem
    spec.slot_modules = ["all-linear", out]
    assert spec_problems(spec) == []
    spec.tenants[1].target_modules = ["all-linear", out]  # a tenant's list is PEFT's: all-linear alone
    assert "'all-linear' must be the only entry" in "\n".join(map(str, spec_problems(spec)))
    # the form: not offered among the all-linear names, but a tenant that names it loads and validates
    form = TenantForm(base_model=path)
    assert out not in form.target_modules.options
    form.load(Tenant(name="h", data=data, rank=4, target_modules=[out]))
    assert form.target_modules.value == (out,)
    assert form.tenant().target_modules == [out]


# ---------------------------------------------------------------------------------------------
# The rules on their own
# ---------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.key, self.output, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


class _Plain(nn.Module):
    """No ``get_output_embeddings``: an inner layer is called ``output`` and another ``head``."""

    def __init__(self, top: str = "lm_head") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        setattr(self, top, nn.Linear(4, 8))


def test_output_layer_without_get_output_embeddings_follows_transformers_conventions():
    plain = _Plain()
    assert output_layer_names(plain) == ["lm_head"]
    assert "blocks.0.output" in linear_module_names(plain) and "lm_head" not in linear_module_names(plain)

    class Broken(_Plain):  # a method that raises, and transformers' tied-weights mapping
        _tied_weights_keys = {"head.weight": "embed.weight"}  # noqa: RUF012

        def get_output_embeddings(self):
            raise NotImplementedError

    assert output_layer_names(Broken("head")) == ["head"]
    assert output_layer_names(_Plain("proj")) == []  # nothing to go by: every linear is all-linear
    with torch.device("meta"):
        rwkv = transformers.AutoModelForCausalLM.from_config(
            transformers.RwkvConfig(
                vocab_size=64,
                hidden_size=16,
                num_hidden_layers=1,
                attention_hidden_size=16,
                intermediate_size=32,
                context_length=16,
            )
        )
    assert output_layer_names(rwkv) == ["head"]  # by identity, though inner layers are called "output"
    assert "rwkv.blocks.0.attention.output" in linear_module_names(rwkv)


def test_storable_targets_never_select_the_output_layer():
    model = _Plain("head")  # the output layer shares its last name with inner layers
    every = [n for n, _ in model.named_modules()]
    selected = [n for n in linear_module_names(model) if n != "head"]
    assert linear_module_names(model) == [*selected, "head"]  # no convention names "head": not excluded
    short = storable_targets(selected, every)
    assert short == ["key", "output", "0.head", "1.head"]
    assert peft_selects(short, every) == selected
    with pytest.raises(ValueError, match="cannot be targeted by name"):
        storable_targets(["head"], every)  # "head" also names blocks.*.head


def test_all_linear_spellings_and_union():
    assert is_all_linear("all-linear") and is_all_linear("ALL-LINEAR") and is_all_linear(["all-linear"])
    assert (
        not is_all_linear(["all-linear", "q_proj"]) and not is_all_linear("q_proj") and not is_all_linear([])
    )
    assert has_all_linear(["q_proj", "all-linear"]) and not has_all_linear(["q_proj"])
    names = ["a.q_proj", "a.v_proj", "lm_head"]
    assert match_targets(names, ["all-linear"], names[:2]) == names[:2]
    assert match_targets(names, "ALL-LINEAR", names[:2]) == names[:2]
    assert match_targets(names, ["lm_head", "all-linear"], names[:2]) == names
    assert match_targets(names, r"a\..*", []) == names[:2]
    assert match_targets(names, ["q_proj", "proj"], []) == ["a.q_proj"]
    assert suffixes(names) == "lm_head, q_proj, v_proj"
    assert re.fullmatch(r"[a-z_, ]+", suffixes(names))
