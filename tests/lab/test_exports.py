"""Adapters out (mlora_lab.lab.exports): merged into the base, and as a GGUF LoRA adapter.

- merged: over the architecture table, the merged transformers model's logits equal the base with the PEFT
  adapter (fp32, 1e-5), and ``dtype`` chooses the merged weights' dtype;
- GGUF: read back with the ``gguf`` package, the file says what llama.cpp's loader reads (architecture,
  ``general.type = adapter``, ``adapter.type = lora``, its alpha, rsLoRA's alpha scaled to llama.cpp's
  ``alpha / r``), names each pair after the base's GGUF tensor, and holds PEFT's A and B, with B's rows in
  llama.cpp's per-head order for a Llama's query and key projections (llama.cpp's own ``permute``, copied here);
- a base the format's conversion rearranges is refused, naming the ones written;
- ``Run.merge`` and ``Run.export`` on a trained run, and the CLI;
- nothing a user has is lost: a merge never writes into a run directory (its own, another's, an adapter's
  folder) and never into a folder holding files unless asked (then it replaces only its own files, and one cut
  short never looks complete); a GGUF export never replaces a run's file or an existing file unasked; a bogus
  dtype, a folder or ``/proc`` is one message naming what the user gave; a merge draws no progress bar.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers

from mlora_lab.job.trainer import Trainer
from mlora_lab.lab.exports import ExportError, export_gguf, merge
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import RunDir, update_status
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant
from mlora_lab.tiny import TYPICAL_TARGETS

TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(base: str, path, targets, rank: int = 4, alpha: float = 8.0, rslora: bool = False) -> str:
    torch.manual_seed(rank)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora
    )
    peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gpt_neox"])
def test_merged_model_gives_the_base_with_adapter_logits(arch, tiny_models, tmp_path):
    base = tiny_models(arch)
    adapter = peft_adapter(base, tmp_path / "ad", TYPICAL_TARGETS[arch])
    out = merge(adapter, base, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), adapter
    )
    ids = torch.randint(3, 200, (2, 11))
    with torch.no_grad():
        ours, theirs = merged(input_ids=ids).logits, reference.eval()(input_ids=ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - plain).abs().max().item() > 1e-3, "the adapter is in the merged weights"
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert transformers.AutoTokenizer.from_pretrained(out)("hello").input_ids
    half = merge(adapter, base, tmp_path / "bf16", dtype="bfloat16")
    assert transformers.AutoModelForCausalLM.from_pretrained(half).dtype == torch.bfloat16


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``, as llama.cpp writes it."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("arch, rslora", [("llama", False), ("llama", True), ("qwen2", False)])
def test_gguf_adapter_reads_back_as_llama_cpp_expects(arch, rslora, tiny_models, tmp_path):
    import gguf
    from safetensors.torch import load_file

    base = tiny_models(arch)
    rank, alpha = 4, 8.0
    adapter = peft_adapter(base, tmp_path / "ad", TYPICAL_TARGETS[arch], rank, alpha, rslora)
    path = export_gguf(adapter, base, tmp_path / "out" / "a.gguf")
    reader = gguf.GGUFReader(path)
    fields = {name: field for name, field in reader.fields.items()}

    def value(key):
        f = fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tobytes().decode()

    assert value("general.architecture") == arch
    assert value("general.type") == "adapter" and value("adapter.type") == "lora"
    assert value("adapter.lora.alpha") == pytest.approx(alpha * math.sqrt(rank) if rslora else alpha)
    config = transformers.AutoConfig.from_pretrained(base)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    written = {t.name: t for t in reader.tensors}
    peft_tensors = load_file(f"{adapter}/adapter_model.safetensors")
    assert len(written) == len(peft_tensors) > 0
    for key, value_ in peft_tensors.items():
        module, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        which = part[0]
        gguf_name = names.get_name(module + ".weight", try_suffixes=(".weight",)) + f".lora_{which.lower()}"
        t = written[gguf_name]
        expected = value_.float().numpy()
        if which == "B" and arch == "llama" and module.endswith(("q_proj", "k_proj")):
            kv = config.num_key_value_heads if module.endswith("k_proj") else config.num_attention_heads
            expected = llama_cpp_permute(expected, config.num_attention_heads, kv)
        # GGUF lists dims fastest first: [in, r] for A ([r, in] in numpy), [r, out] for B
        assert list(t.shape) == list(reversed(expected.shape)), gguf_name
        assert np.array_equal(np.asarray(t.data).reshape(expected.shape), expected), gguf_name
    if arch == "llama":  # the permutation really moved rows: q's B differs from PEFT's as stored
        q = next(k for k in peft_tensors if "q_proj.lora_B" in k)
        name = (
            names.get_name(
                q.removeprefix("base_model.model.").rpartition(".lora_")[0] + ".weight",
                try_suffixes=(".weight",),
            )
            + ".lora_b"
        )
        assert not np.array_equal(np.asarray(written[name].data), peft_tensors[q].numpy())


def test_a_base_whose_conversion_rearranges_weights_is_refused(tiny_models, tmp_path):
    base = tiny_models("phi3")
    adapter = peft_adapter(base, tmp_path / "ad", TYPICAL_TARGETS["phi3"])
    with pytest.raises(ValueError, match=r"llama, mistral, qwen2, qwen3 bases; this base is 'phi3'"):
        export_gguf(adapter, base, tmp_path / "a.gguf")
    assert not (tmp_path / "a.gguf").exists()


def test_run_merge_and_export_of_a_trained_tenant_and_the_cli(tiny_models, make_data, tmp_path):
    base = tiny_models("llama")
    tenant = Tenant(name="a", data=make_data("reverse"), rank=4, alpha=8, target_modules=["q_proj", "v_proj"],
                    lr=5e-3, batch_size=2, max_steps=3)  # fmt: skip
    Trainer(JobSpec(base_model=base, tenants=[tenant], seq_len=32), run_dir=tmp_path / "run").train()
    run = Run(tmp_path / "run")
    merged = run.merge("a", tmp_path / "merged")
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    path = run.export("a")
    assert path == tmp_path / "run" / "exports" / "a.gguf" and path.stat().st_size > 0
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        run.export("a", "onnx")
    with pytest.raises(FileNotFoundError, match="no adapter saved yet for tenant 'b'"):
        run.merge("b", tmp_path / "nope")
    cli = [sys.executable, "-m", "mlora_lab.lab.cli"]
    done = subprocess.run([*cli, "export", str(tmp_path / "run"), "a", "--out", str(tmp_path / "cli.gguf")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cli.gguf").read_bytes() == path.read_bytes()
    done = subprocess.run([*cli, "merge", str(tmp_path / "run"), "a", str(tmp_path / "cli_merged")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cli_merged" / "model.safetensors").is_file()


def test_the_dashboards_export_tab_writes_a_shown_tenants_adapter(tiny_models, make_data, tmp_path):
    """The export tab offers the shown tenants that have a saved adapter; its button writes the GGUF
    adapter, or the merged model, into the export folder."""
    from mlora_lab.lab.dashboard import Dashboard

    base = tiny_models("qwen2")
    tenants = [
        Tenant(name=n, data=make_data("reverse"), rank=4, alpha=8, target_modules=["q_proj"], batch_size=2,
               max_steps=2, seed=i)
        for i, n in enumerate(("a", "b"))
    ]  # fmt: skip
    Trainer(JobSpec(base_model=base, tenants=tenants, seq_len=32), run_dir=tmp_path / "run").train()
    dash = Dashboard(Run(tmp_path / "run"), interactive=False, export_dir=tmp_path / "out")
    tab = dash.exporter
    assert [label for label, _ in tab.adapter.options] == ["a", "b"]
    tab.adapter.value = tab.adapter.options[1][1]
    tab.adapter_button.click()
    assert (tmp_path / "out" / "b.gguf").is_file(), tab.message.value
    tab.adapter_format.value = "merged"
    tab.adapter_button.click()
    assert (tmp_path / "out" / "b-merged" / "config.json").is_file(), tab.message.value
    assert "b-merged" in tab.message.value


def adapter_run(folder: Path, base: str, tenants: tuple[str, ...] = ("a", "b")) -> Run:
    """A run directory as a finished job leaves it, without the training: job.json, status.json, metrics, a
    checkpoint and a PEFT adapter per tenant (PEFT's own, with a random B)."""
    run = RunDir(folder).create()
    spec = JobSpec(base_model=base, seq_len=32, tenants=[
        Tenant(name=n, data=f"{n}.jsonl", rank=4, alpha=8, target_modules=["q_proj", "v_proj"]) for n in tenants])  # fmt: skip
    spec.to_json(run.job)
    update_status(run.root, state="finished", pid=1, started=time.time(), ended=time.time())
    run.metrics.write_text(json.dumps({"kind": "train", "step": 1, "tenant": tenants[0], "loss": 1.0}) + "\n")
    (run.checkpoints / "step_1").mkdir()
    (run.checkpoints / "step_1" / "state.pt").write_bytes(b"state")
    for i, name in enumerate(tenants):
        peft_adapter(base, run.adapter(name), ["q_proj", "v_proj"], rank=4 + i)
    return Run(run.root)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` and its bytes: what must come out of a refused merge unchanged."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_merge_into_a_folder_holding_a_users_file_keeps_it(tiny_models, tmp_path):
    """EX1: a merge into an existing folder holding a user's file swapped a fresh folder in, and the file was
    gone. Now refused, naming the folder; with ``overwrite=True`` the merge writes its files beside the
    user's, and a second merge replaces only its own files (an earlier merge's weights it does not write go)."""
    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ExportError, match=r"mine is not empty \(it holds notes.txt\).*overwrite=True"):
        run.merge("a", out)
    assert snapshot(out) == {"notes.txt": b"my notes"}
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an earlier merge's shard")
    merged = run.merge("a", out, overwrite=True)
    assert (out / "notes.txt").read_text() == "my notes"
    assert not (out / "model-00001-of-00002.safetensors").exists(), "the earlier merge's shard is gone"
    assert transformers.AutoModelForCausalLM.from_pretrained(merged) is not None
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temporary folder left"
    run.merge("b", out, overwrite=True)
    assert (out / "notes.txt").read_text() == "my notes" and (out / "config.json").is_file()


def test_a_merge_into_a_run_directory_is_refused_and_the_run_is_kept(tiny_models, tmp_path):
    """EX2 / EX3: a merge into ``run.path`` swapped the whole run away (job.json, metrics, checkpoints); one
    into another tenant's adapter folder replaced that adapter. Anything inside a run directory is refused,
    overwrite or not: this run's, its adapters', another run's (a folder holding a job.json or status.json).
    Its ``exports/`` folder is the exception: the run's outputs go there."""
    base = tiny_models("llama")
    run = adapter_run(tmp_path / "run", base)
    other = adapter_run(tmp_path / "other", base, tenants=("c",))
    before, before_other = snapshot(run.path), snapshot(other.path)
    (tmp_path / "link").symlink_to(run.path / "adapters")
    for asked in ({}, {"overwrite": True}):  # (a plain merge, then one asked to overwrite)
        with pytest.raises(
            ExportError, match=r"run is a run directory: a merged model is never written into a run"
        ):
            run.merge("a", run.path, **asked)
        with pytest.raises(ExportError, match=r"adapters/b is inside the run directory .*run"):
            run.merge("a", run.path / "adapters" / "b", **asked)
        with pytest.raises(ExportError, match=r"is inside the run directory .*other"):
            run.merge("a", other.path / "merged", **asked)
        with pytest.raises(ExportError, match=r"is inside the run directory"):  # (through a link to it)
            run.merge("a", tmp_path / "link" / "b", **asked)
        assert snapshot(run.path) == before and snapshot(other.path) == before_other
    assert snapshot(run.path) == before and snapshot(other.path) == before_other
    merged = run.merge("a", run.path / "exports" / "a-merged")
    assert (merged / "config.json").is_file() and snapshot(run.path).items() >= before.items()


def test_a_merge_to_the_current_folder_gets_a_true_message(tiny_models, tmp_path, monkeypatch):
    """EX4b: a merge to ``.`` said it "names the run directory itself", wherever ``.`` was. Now: in a folder
    that holds files, that it is not empty (naming the folder); in a run, that it is the run directory; in an
    empty folder, the merge is written there."""
    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "data.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ExportError) as refused:
        run.merge("a", ".")
    assert f". ({tmp_path / 'work'}) is not empty" in str(refused.value), refused.value
    assert "names the run directory" not in str(refused.value)
    monkeypatch.chdir(run.path)
    with pytest.raises(ExportError, match=r"is a run directory"):
        run.merge("a", ".")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    run.merge("a", ".")
    assert (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.parametrize("dtype", ["bogus", ["float16"], b"float16", "int8", torch.int8, "auto!"])
def test_a_bogus_dtype_is_one_message_before_anything_is_read(dtype, tiny_models, tmp_path):
    """EX5c: ``dtype=["float16"]`` (or bytes) gave transformers' ``IndexError``, a name torch lacks an
    ``AttributeError``: each is one message naming the dtype and the ones a merge takes, and nothing is made."""
    with pytest.raises(
        ExportError, match=r"dtype .* is not one a merged model is saved in: give one of float32"
    ):
        merge(tmp_path / "no-adapter", tiny_models("llama"), tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_a_gguf_export_never_replaces_a_runs_file_or_a_users_unasked(tiny_models, tmp_path):
    """EX6e / EX6d: ``run.export(..., path=<run>/job.json)`` overwrote the job file; an export to a folder or
    into ``/proc`` named temporary file names. A path in a run (but its exports/) is refused, an existing file
    is replaced only with ``overwrite=True`` (the run's own exports/ excepted), and every refusal or failure
    names the path the user gave."""
    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    job = run.dir.job.read_bytes()
    with pytest.raises(ExportError, match=r"job.json is inside the run directory"):
        run.export("a", "gguf", path=run.dir.job)
    with pytest.raises(ExportError, match=r"job.json is inside the run directory"):
        run.export("a", "gguf", path=run.dir.job, overwrite=True)
    assert run.dir.job.read_bytes() == job
    for folder in (tmp_path, Path("/proc")):
        with pytest.raises(ExportError) as refused:
            run.export("a", "gguf", path=folder)
        said = str(refused.value)
        assert said.startswith(f"{folder} is a folder: name the GGUF file") and ".tmp-" not in said, said
    with pytest.raises(ExportError) as refused:
        run.export("a", "gguf", path="/proc/a.gguf")
    said = str(refused.value)
    assert said.startswith("/proc/a.gguf: the GGUF adapter could not be written (") and "tmp" not in said, (
        said
    )
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"my own file")
    with pytest.raises(ExportError, match=r"mine.gguf exists: overwrite=True"):
        run.export("a", "gguf", path=mine)
    assert mine.read_bytes() == b"my own file"
    assert run.export("a", "gguf", path=mine, overwrite=True).read_bytes()[:4] == b"GGUF"
    first = run.export("a")  # (the run's exports/: a second export replaces the first)
    assert run.export("b") != first and run.export("a") == first and first.read_bytes()[:4] == b"GGUF"


def test_a_merge_cut_short_never_leaves_a_folder_that_looks_complete(tiny_models, tmp_path, monkeypatch):
    """A merge that fails while it writes (a full disk, say) leaves no ``config.json`` in a new folder, and an
    earlier merge's folder (``overwrite``) as it was; one cut short while its files move in leaves that folder
    without a ``config.json`` (it moves in last), never a mix that looks complete. The user's files stay, no
    temporary folder is left, and the failure names the folder as given, never a temporary name."""
    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    out = tmp_path / "out"
    run.merge("a", out)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device", "/some/.write.tmp-123/tokenizer.json")

    with monkeypatch.context() as m:
        m.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", full_disk)
        for folder, asked in ((tmp_path / "new", {}), (out, {"overwrite": True})):
            with pytest.raises(ExportError) as failed:
                run.merge("b", folder, **asked)
            assert (
                str(failed.value)
                == f"{folder}: the merged model could not be written (No space left on device)"
            )
            assert not [p for p in folder.iterdir() if p.name.startswith(".")], "no temporary folder left"
    assert not (tmp_path / "new" / "config.json").exists()
    assert snapshot(out) == before, "the earlier merge is untouched"
    replace, moves = os.replace, []

    def cut(src, dst, **kwargs):  # the third file that moves in fails
        moves.append(dst)
        if len(moves) == 3:
            raise OSError(5, "Input/output error", dst)
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(
        ExportError, match=r"out: the merged model could not be written \(Input/output error\)"
    ):
        run.merge("b", out, overwrite=True)
    monkeypatch.undo()
    assert not (out / "config.json").exists(), "half-moved, the folder does not look complete"
    assert (out / "notes.txt").read_text() == "mine"
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temporary folder left"


def test_a_merge_draws_no_progress_bar(tiny_models, tmp_path, capfd):
    """m6: ``merge`` drew transformers' ``Writing model shards`` (and ``Loading weights``) bars: a widget per
    call in a notebook."""
    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    capfd.readouterr()
    run.merge("a", tmp_path / "out")
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err, err


def test_the_cli_refuses_a_merge_into_a_run_in_one_line(tiny_models, tmp_path):
    """EX2 / EX4b from the shell: ``mlora-lab merge RUN a RUN`` exited 0 having replaced the run; ``. `` in a run
    said "names the run directory itself". Both exit 2 with one line; ``--overwrite`` writes beside a user's
    file; ``export --out`` onto the job file is refused likewise."""
    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    before = snapshot(run.path)
    command = [sys.executable, "-m", "mlora_lab.lab.cli"]

    def cli(*args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=300)

    for args, cwd in (
        (("merge", str(run.path), "a", str(run.path)), tmp_path),
        (("merge", str(run.path), "a", "."), run.path),
        (("merge", str(run.path), "a", "adapters/b", "--overwrite"), run.path),
        (("export", str(run.path), "a", "--out", str(run.dir.job), "--overwrite"), tmp_path),
    ):
        done = cli(*args, cwd=cwd)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"mlora-lab {args[0]}: ") and "run directory" in lines[0], lines
        assert "names the run directory itself" not in lines[0]
    assert snapshot(run.path) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    done = cli("merge", str(run.path), "a", "mine")
    assert done.returncode == 2 and "is not empty" in done.stderr and "--overwrite" in done.stderr, (
        done.stderr
    )
    done = cli("merge", str(run.path), "a", "mine", "--overwrite")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mine" / "config.json").is_file() and (
        tmp_path / "mine" / "notes.txt"
    ).read_text() == "mine"


def test_the_export_tab_refuses_what_a_merge_refuses_and_overwrites_when_asked(tiny_models, tmp_path):
    """EX1 / EX3 / EX6e from the dashboard: the export tab's adapter row goes through the same checks. A second
    export into its folder is refused (the message says so) until its overwrite box is ticked, which keeps a
    user's file beside a merged model; a folder inside the run is refused, its exports/ taken."""
    from mlora_lab.lab.dashboard.outputs import ExportTab

    run = adapter_run(tmp_path / "run", tiny_models("llama"))
    out = tmp_path / "out"
    tab = ExportTab(out, export=lambda **kw: [])
    tab.follow([run.path], [("a", (run.dir, "a"))])
    tab.adapter.value = (run.dir, "a")
    tab.adapter_button.click()
    assert (out / "a.gguf").is_file() and "wrote" in tab.message.value, tab.message.value
    tab.adapter_button.click()
    assert "export failed" in tab.message.value and "a.gguf exists" in tab.message.value, tab.message.value
    tab.adapter_overwrite.value = True
    tab.adapter_button.click()
    assert "wrote" in tab.message.value, tab.message.value
    tab.adapter_format.value, tab.adapter_overwrite.value = "merged", False
    (out / "a-merged").mkdir()
    (out / "a-merged" / "notes.txt").write_text("mine")
    tab.adapter_button.click()
    assert "export failed" in tab.message.value and "is not empty" in tab.message.value, tab.message.value
    tab.adapter_overwrite.value = True
    tab.adapter_button.click()
    assert (out / "a-merged" / "config.json").is_file() and (
        out / "a-merged" / "notes.txt"
    ).read_text() == "mine"
    before = snapshot(run.path)
    tab.folder.value = str(run.path / "adapters")
    tab.adapter_button.click()
    assert "inside the run directory" in tab.message.value and snapshot(run.path) == before, tab.message.value
    tab.folder.value = str(run.path / "exports")
    tab.adapter_button.click()
    assert (run.path / "exports" / "a-merged" / "config.json").is_file(), tab.message.value


def float32_gguf(src, dst) -> None:
    """A copy of the GGUF model ``src`` with every tensor dequantized to float32 (names, layout and metadata
    kept): llama.cpp then multiplies in float32, as PEFT does, instead of quantizing activations to 8 bits."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():  # (as gguf's own gguf_new_metadata script copies them)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = 0 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()  # (0: all float32)
        writer.add_key_value(
            field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        )
    for t in reader.tensors:
        writer.add_tensor(
            t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # (SmolLM2-135M through llama.cpp and through PEFT)
@pytest.mark.parametrize(
    "targets, rslora",
    [(["v_proj"], False), (["q_proj", "k_proj"], False), (TARGETS_ALL, False), (TARGETS_ALL, True)],
    ids=["v", "q and k (permuted)", "all linear", "all linear, rsLoRA"],
)
def test_llama_cpp_loads_the_gguf_adapter_and_gives_pefts_logits(targets, rslora, tmp_path):
    """llama.cpp itself (``llama-cpp-python``, built from source: ``scripts/check-llama-cpp.sh``; the test skips
    without it) loads the exported adapter over the real SmolLM2-135M GGUF, its weights dequantized to float32
    (the shipped Q4_1 file makes llama.cpp quantize activations to 8 bits: its logits then move ~5 % with any
    change, a tiny adapter's too), with a float32 KV cache. PEFT runs the same weights (the GGUF dequantized
    by transformers). The base's logits agree to 1e-5, the adapter's to 1e-5, and what the adapter adds to them
    to 1e-3 (a difference of two logits of ~1,500: measured 1.7e-6, 2.2e-6 and 2.2e-4): the q/k rows are
    in llama.cpp's order and the scale is PEFT's, rsLoRA's too."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from mlora_lab.bases import real_model_path, resolve_base

    base = str(resolve_base(real_model_path(), cache_dir=tmp_path / "gguf"))  # (dequantized to float32)
    gguf_base = tmp_path / "base-f32.gguf"
    float32_gguf(real_model_path(), gguf_base)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, use_rslora=rslora
    )
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), config)
    # B of a trained adapter's size: a visible change of the logits, not a swamping one
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.02)
    model.save_pretrained(tmp_path / "adapter")
    path = export_gguf(tmp_path / "adapter", base, tmp_path / "adapter.gguf")
    prompt = transformers.AutoTokenizer.from_pretrained(base)("The quick brown fox jumps over").input_ids

    with torch.no_grad():
        ids = torch.tensor([prompt])
        ours = model(input_ids=ids).logits[0].double()
        with model.disable_adapter():
            plain = model(input_ids=ids).logits[0].double()

    def llama_logits(**kw) -> torch.Tensor:
        f32 = 0  # (GGML_TYPE_F32: the KV cache in float32, not llama.cpp's default float16)
        llm = llama_cpp.Llama(
            model_path=str(gguf_base), n_ctx=64, logits_all=True, n_threads=1, verbose=False, type_k=f32,
            type_v=f32, **kw,
        )  # fmt: skip
        llm.eval(prompt)
        out = torch.tensor(np.asarray(llm.scores[: len(prompt)]), dtype=torch.float64)
        llm.close()
        return out

    theirs_plain, theirs = llama_logits(), llama_logits(lora_path=str(path))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    print(f"llama.cpp vs PEFT: base {rel(theirs_plain, plain):.2e}, adapter {rel(theirs, ours):.2e}, "
          f"its delta {rel(theirs - theirs_plain, ours - plain):.2e}")  # fmt: skip
    assert rel(ours, plain) > 5e-3, "the adapter moves the logits by far more than the agreement asked"
    assert rel(theirs_plain, plain) < 1e-5 and rel(theirs, ours) < 1e-5
    assert rel(theirs - theirs_plain, ours - plain) < 1e-3
