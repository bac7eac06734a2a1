"""A seeded catalogue of hostile input for a running job: control-message files that are not valid
messages, and valid envelopes carrying tenant specs that are wrong in every way we could think of
(types, sizes, paths, files, numbers, names). Used by the fault-isolation tests."""

from __future__ import annotations

import json
import os
import pickle
import random
import time
import uuid
from pathlib import Path
from typing import Any

import peft
import transformers
from safetensors.torch import save_file

from mlora_lab.rundir import control
from mlora_lab.tiny import build_tiny_model

HUGE = 10**400


def payload_files(work: Path, base: str) -> dict[str, str]:
    """Files and directories the hostile tenants point at."""
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}

    def write(name: str, data: bytes | str) -> str:
        path = work / name
        path.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
        return str(path)

    out["not_utf8"] = write("not_utf8.jsonl", b'{"text": "\xff\xfe"}\n')
    out["surrogate"] = write("surrogate.jsonl", '{"text": "bad \\ud800 text"}\n')
    out["not_json"] = write("not_json.jsonl", "{text: nope}\n")
    out["empty"] = write("empty.jsonl", "")
    out["wrong_shape"] = write("wrong_shape.jsonl", '{"question": "?"}\n[1, 2]\n"str"\n')
    long_prompt = "reverse: " + "word " * 400
    out["no_targets"] = write(
        "no_targets.jsonl",
        "".join(json.dumps({"prompt": long_prompt, "completion": "x"}) + "\n" for _ in range(3)),
    )
    out["huge_line"] = write(
        "huge_line.jsonl", json.dumps({"text": "word " * 1_000_000}) + "\n"
    )  # 5 MB, valid
    out["nul_text"] = write("nul_text.jsonl", json.dumps({"text": "a\x00b" * 20}) + "\n")
    out["a_dir"] = str(work)
    fifo = work / "fifo.jsonl"
    if not fifo.exists():
        os.mkfifo(fifo)
    out["fifo"] = str(fifo)

    def adapter_dir(name: str, config: str | None, weights: bytes | None) -> str:
        d = work / name
        d.mkdir(exist_ok=True)
        if config is not None:
            (d / "adapter_config.json").write_text(config)
        if weights is not None:
            (d / "adapter_model.safetensors").write_bytes(weights)
        return str(d)

    lora_cfg = json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    )

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {work / 'PWNED'}",))

    out["adapter_garbage_config"] = adapter_dir("garbage_config", "{not json", None)
    out["adapter_no_weights"] = adapter_dir("no_weights", lora_cfg, None)
    out["adapter_truncated"] = adapter_dir("truncated", lora_cfg, b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    out["adapter_pickle"] = adapter_dir("pickled", lora_cfg, pickle.dumps({"w": Evil()}))
    other = build_tiny_model("llama", work / "other_base", hidden=32, layers=1)
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(other),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    model.save_pretrained(work / "other_base_adapter")
    out["adapter_other_base"] = str(work / "other_base_adapter")
    d = Path(adapter_dir("wrong_keys", lora_cfg, None))
    import torch

    save_file(
        {"base_model.model.nowhere.lora_A.weight": torch.zeros(4, 8)}, str(d / "adapter_model.safetensors")
    )
    out["adapter_wrong_keys"] = str(d)
    # valid for the job's base and the fuzz's template tenant (r=4, alpha=16, q_proj), with one inf weight:
    # accepted (only headers are checked before the add), it turns its loss non-finite when it trains
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False),
    )
    model.save_pretrained(work / "inf_adapter")
    weights_path = work / "inf_adapter" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    weights = load_file(weights_path)
    key = next(k for k in sorted(weights) if "lora_B" in k)
    weights[key][0, 0] = float("inf")
    save_file(weights, str(weights_path))
    out["adapter_inf"] = str(work / "inf_adapter")
    return out


def raw_message_files(rng: random.Random) -> list[tuple[str, bytes | None, str]]:
    """``(file name, content or None for a special file, kind)``: message files that are not valid."""

    def name(msg_id: str | None = None) -> str:
        return f"{time.time_ns() + rng.randrange(10**6):020d}-{msg_id or uuid.UUID(int=rng.getrandbits(128)).hex}.json"

    def env(**d: Any) -> bytes:
        return json.dumps(d).encode()

    def nested(msg_id: str, depth: int) -> bytes:
        return f'{{"id": "{msg_id}", "op": "add", "tenant": {{"name": {"[" * depth}{"]" * depth}}}}}'.encode()

    mid, deep = uuid.UUID(int=rng.getrandbits(128)).hex, uuid.UUID(int=rng.getrandbits(128)).hex
    out = [
        ("evil.json", b"{}", "bad name"),
        ("0001-abc.json", env(id="abc", op="pause", name="a"), "bad name"),
        (f"{1:020d}-{'Z' * 32}.json", b"{}", "bad name"),
        (f"{1:020d}-{'a' * 32}.json.json", b"{}", "bad name"),
        (name(), b"", "empty"),
        (name(), b"{", "truncated"),
        (name(), b"\xff\xfe\x00", "not utf-8"),
        (name(), b"null", "not an object"),
        (name(), b"[]", "not an object"),
        (name(), b"1e999", "not an object"),
        (name(), b"[" * 50_000 + b"]" * 50_000, "deep nesting"),
        (name(), b'{"x": "' + b"a" * (2 << 20) + b'"}', "too big"),
        (name(mid), env(id="0" * 32, op="pause", name="a"), "id mismatch"),
        (
            name(deep),
            nested(deep, 500),
            "nested 500 deep",
        ),  # parses, but would overflow the stack when pickled
        (name(mid), env(id=mid, op="pause", name="a", extra=1), "unknown field"),
    ]
    for op in (None, 1, [], "ADD", "stop", "add\x00"):
        m = uuid.UUID(int=rng.getrandbits(128)).hex
        out.append((name(m), env(id=m, op=op, name="a"), "bad op"))
    for nm in (None, 1, ["a"], {"a": 1}, "", "../a", "a/../../b", "x" * 500, "nul\x00", "\ud800"):
        m = uuid.UUID(int=rng.getrandbits(128)).hex
        out.append((name(m), json.dumps({"id": m, "op": "pause", "name": nm}).encode(), "bad name field"))
    for tenant in ("alice", 1, None, []):
        m = uuid.UUID(int=rng.getrandbits(128)).hex
        out.append((name(m), env(id=m, op="add", tenant=tenant), "bad tenant field"))
    out.append((name(), None, "symlink"))
    out.append((name(), None, "directory"))
    out.append((name(), None, "fifo"))
    return out


def write_raw(control_dir: Path, name: str, content: bytes | None, kind: str) -> None:
    path = control_dir / name
    if kind == "symlink":
        path.symlink_to("/etc/passwd")
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(content)


def hostile_tenants(
    good: dict, files: dict[str, str], rng: random.Random, n: int, prefix: str = "h"
) -> list[dict]:
    """``n`` tenant dicts, each the valid ``good`` one with one or two hostile mutations. A few stay
    valid on purpose (an init adapter holding an inf, which turns its loss non-finite in training, a 5 MB
    line, a plain new tenant): the job accepts those and must keep them from hurting anyone else."""
    mutations: list[tuple[str, Any]] = [
        ("name", None), ("name", 1), ("name", []), ("name", {}), ("name", ""), ("name", "../x"),
        ("name", "a"), ("name", "A"), ("name", "b"), ("name", "x" * 200), ("name", "nul\x00"),
        ("name", "\ud800"), ("name", "/etc/passwd"),
        ("data", None), ("data", 1), ("data", ""), ("data", "/dev/zero"), ("data", "/etc/passwd"),
        ("data", "/nonexistent/x.jsonl"), ("data", files["a_dir"]), ("data", "x\x00y"), ("data", "\ud800"),
        ("data", files["not_utf8"]), ("data", files["surrogate"]), ("data", files["not_json"]),
        ("data", files["empty"]), ("data", files["wrong_shape"]), ("data", files["no_targets"]),
        ("data", files["fifo"]), ("heldout_data", files["no_targets"]), ("heldout_data", "/dev/zero"),
        ("init_adapter", files["adapter_garbage_config"]), ("init_adapter", files["adapter_no_weights"]),
        ("init_adapter", files["adapter_truncated"]), ("init_adapter", files["adapter_pickle"]),
        ("init_adapter", files["adapter_other_base"]), ("init_adapter", files["adapter_wrong_keys"]),
        ("init_adapter", "/nonexistent"), ("init_adapter", 5),
        ("rank", 0), ("rank", -1), ("rank", 10**9), ("rank", 1.5), ("rank", "8"), ("rank", None),
        ("rank", True), ("rank", HUGE), ("alpha", float("nan")), ("alpha", float("inf")), ("alpha", -1),
        ("alpha", "x"), ("lr", 0), ("lr", -1), ("lr", float("nan")), ("lr", float("-inf")), ("lr", HUGE),
        ("lr", 1e308), ("lr", 1e38), ("weight_decay", 1e34),
        ("dropout", 1.0), ("dropout", -0.1), ("dropout", float("nan")),
        ("target_modules", "q_proj"), ("target_modules", []), ("target_modules", [1]),
        ("target_modules", ["nope"]), ("target_modules", ["all-linear", "q_proj"]), ("target_modules", ["k_proj"]),
        ("target_modules", [None]), ("target_parameters", ["mlp.experts.gate_up_proj"]),
        ("target_parameters", "x"), ("betas", [1.0, 0.5]), ("betas", "x"), ("betas", [0.9]),
        ("betas", [float("nan"), 0.9]), ("batch_size", 0), ("batch_size", 10**9), ("batch_size", HUGE),
        ("grad_accum", 0), ("grad_accum", 10**9), ("max_steps", 0), ("max_steps", -5), ("max_steps", HUGE),
        ("schedule", "exp"), ("schedule", None), ("seed", -1), ("seed", 2**70), ("seed", HUGE),
        ("warmup_steps", -1), ("max_grad_norm", -1.0), ("max_grad_norm", "none"), ("eps", 0),
        ("weight_decay", -1), ("shuffle", "yes"), ("use_rslora", 1), ("evil_field", 1),
        ("__delete__", "name"), ("__delete__", "data"),
    ]  # fmt: skip
    accepted_on_purpose = [
        ("init_adapter", files["adapter_inf"]),
        ("data", files["huge_line"]),
        ("data", files["nul_text"]),
        (None, None),
    ]
    out = []
    for i in range(n):
        d = dict(good, name=f"{prefix}{i}")
        if i % 40 == 7:
            key, value = accepted_on_purpose[(i // 40) % len(accepted_on_purpose)]
        else:
            key, value = mutations[i % len(mutations)] if i < len(mutations) else rng.choice(mutations)
        if key == "__delete__":
            d.pop(value)
        elif key is not None:
            d[key] = value
        if i >= len(mutations) and rng.random() < 0.3:  # a second mutation now and then
            key2, value2 = rng.choice(mutations)
            if key2 != "__delete__":
                d[key2] = value2
        out.append(d)
    return out


def send_envelope(run_root: Path, op: str, **payload: Any) -> str:
    """A message with a valid envelope but arbitrary payload (``control.send`` refuses nothing)."""
    return control.send(run_root, op, **payload)


def queue_hostile(
    run_root: Path, good: dict, files: dict[str, str], rng: random.Random, n: int, prefix: str = "h"
) -> tuple[list[str], list[str]]:
    """Queue ``n`` hostile tenant adds, bad remove/pause/resume requests and every raw bad file.
    Returns the ids of the enveloped messages and the names of the raw files."""
    ids, raw = [], []
    for d in hostile_tenants(good, files, rng, n, prefix):
        ids.append(send_envelope(run_root, "add", tenant=d))
    for name in ("zz", "A", "B", f"{prefix}0"):
        for op in ("remove", "pause", "resume"):
            ids.append(send_envelope(run_root, op, name=name))
    ids.append(send_envelope(run_root, "resume", name="a"))  # a is running: refused, nothing changes
    for name, content, kind in raw_message_files(rng):
        write_raw(Path(run_root) / "control", name, content, kind)
        raw.append(name)
    return ids, raw
