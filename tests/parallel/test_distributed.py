"""Real torchrun, 2 processes on gloo: N ranks equal 1 rank, resume, two nodes on loopback (the demo on two
processes: tests/lab/test_cli.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import peft
import pytest
import torch
import transformers
from conftest import task_rows, write_jsonl

import mlora_lab as ml
from mlora_lab.job.trainer import Trainer
from mlora_lab.lab.launch import prepare_run
from mlora_lab.lora import read_adapter
from mlora_lab.rundir import read_status
from mlora_lab.tiny import EXPERT_TARGETS, TYPICAL_TARGETS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def tenants_for(arch: str, make_data) -> list[ml.Tenant]:
    """Heterogeneous ranks and targets, rows of unequal length, odd batch sizes (ranks get unequal
    rows; with batch_size 1 one rank gets none), accumulation and clipping."""
    targets = TYPICAL_TARGETS[arch]
    experts = EXPERT_TARGETS if arch in ("qwen3_moe", "mixtral") else []  # MoE: also the packed experts
    return [
        ml.Tenant(name="a", data=make_data("reverse"), rank=4, alpha=8, target_modules=targets[:2], lr=5e-3,
                  batch_size=3, max_steps=5, seed=1, target_parameters=experts),
        ml.Tenant(name="b", data=make_data("chat"), rank=16, alpha=16, use_rslora=True, target_modules=targets,
                  lr=2e-3, batch_size=1, grad_accum=2, max_steps=4, schedule="cosine", warmup_steps=1, seed=2,
                  max_grad_norm=0.1, target_parameters=experts[:1]),
        ml.Tenant(name="c", data=make_data("text"), rank=8, target_modules=targets[-1:], lr=1e-3,
                  batch_size=4, max_steps=6, weight_decay=0.1, seed=3),
    ]  # fmt: skip


def job(base: str, tenants: list[ml.Tenant], out: Path, nproc: int = 1, **kw) -> ml.JobSpec:
    return ml.JobSpec(
        base_model=base,
        tenants=tenants,
        seq_len=64,
        max_rank=16,
        max_tenants=4,
        parallel=ml.Parallel(nproc=nproc, fsdp=nproc),
        output_dir=str(out),
        **kw,
    )


def finished(run: ml.Run, timeout: float = 300) -> ml.Run:
    state = run.wait(timeout)
    assert state == "finished", f"{state}: {run.error}\n{run.logs(0)}\n{run.logs(1)}"
    return run


@dataclasses.dataclass
class Reference:
    """A job trained in this test process, on one rank, with no launch: what a launched job on N ranks is
    compared with (a launched one-process job is the same code, after ~10 s of imports in two new
    processes; that it equals this one is the lifecycle tests' business, not this module's)."""

    trainer: Trainer
    path: Path  # its run directory: adapters/<tenant> as a launched run writes them

    def adapter_path(self, tenant: str) -> Path:
        return self.path / "adapters" / tenant


def train_here(spec: ml.JobSpec, run_dir: Path) -> Reference:
    """Train ``spec`` (one process) to the end in this process, its adapters saved in ``run_dir``."""
    assert spec.parallel.nproc == 1
    trainer = Trainer(spec, run_dir=run_dir)
    try:
        trainer.train()
    finally:
        trainer.close()
    return Reference(trainer, run_dir)


def losses(run: ml.Run | Reference) -> dict[tuple[str, int], float]:
    """``(tenant, tenant step) -> loss`` of every train row."""
    if isinstance(run, Reference):
        return {(t, i + 1): v for t in run.trainer.tenants for i, v in enumerate(run.trainer.losses(t))}
    m = run.metrics()
    m = m[m["kind"] == "train"]
    return {(r.tenant, r.tenant_step): r.loss for r in m.itertuples()}


def adapters(run: ml.Run | Reference, names) -> dict[str, dict]:
    return {n: read_adapter(run.adapter_path(n))[1] for n in names}


def assert_same_adapters(x: dict, y: dict, tol: float) -> None:
    for name in x:
        assert set(x[name]) == set(y[name])
        for m, (A, B) in x[name].items():
            assert A.shape == y[name][m][0].shape and B.shape == y[name][m][1].shape
            diff = max((A - y[name][m][0]).abs().max().item(), (B - y[name][m][1]).abs().max().item())
            assert diff <= tol, f"{name}/{m}: {diff}"


@pytest.fixture(scope="module")
def one_process(tiny_models, tmp_path_factory):
    """``one_process(arch) -> (tenants, reference)``: the :func:`tenants_for` job of ``arch`` on one
    process, trained in this process once per module (the reference every layout below is compared with)."""
    done: dict[str, tuple[list[ml.Tenant], Reference]] = {}

    def get(arch: str) -> tuple[list[ml.Tenant], Reference]:
        if arch not in done:
            out = tmp_path_factory.mktemp(f"one_{arch}")
            tenants = tenants_for(
                arch, lambda kind, n=12: write_jsonl(out / f"{kind}.jsonl", task_rows(kind, n))
            )
            done[arch] = tenants, train_here(job(tiny_models(arch), tenants, out / "run"), out / "run")
        return done[arch]

    return get


def same_as_one_process(
    one_process, arch: str, base: str, out: Path, parallel: ml.Parallel, **spec_fields
) -> tuple[Reference, ml.Run]:
    """Run the job of ``arch`` with ``parallel`` (and ``spec_fields``, e.g. activation checkpointing,
    which the one-process reference runs without): per-step losses and saved adapters agree with the
    one-process run to TOL, and every rank reports its memory. Returns both runs."""
    tenants, one = one_process(arch)
    spec = job(base, tenants, out / "many", nproc=parallel.nproc, **spec_fields)
    spec.parallel = parallel
    many = finished(ml.launch(spec))
    l1, l2 = losses(one), losses(many)
    assert set(l1) == set(l2) and len(l1) == 5 + 4 + 6
    assert max(abs(l1[k] - l2[k]) for k in l1) <= TOL
    names = [t.name for t in tenants]
    assert_same_adapters(adapters(one, names), adapters(many, names), TOL)
    assert set(many.system_metrics()["rank"]) == set(range(parallel.nproc))
    return one, many


def assert_same_peft_logits(base: str, runs: list[ml.Run | Reference], tenant: str) -> None:
    """The runs' saved adapters of ``tenant``, loaded by PEFT, give the same logits."""
    ids = torch.randint(3, 300, (2, 9))
    logits = []
    for run in runs:
        model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base), str(run.adapter_path(tenant))
        )
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("arch, checkpointing", [("phi3", 1), ("qwen3_moe", 1)])
def test_fsdp2_two_ranks_equal_one(arch, checkpointing, tiny_models, one_process, tmp_path):
    """fsdp=2 with activation checkpointing of every block equals one process without it (fsdp=2 of
    llama without checkpointing: :func:`test_resume_after_stop_with_two_ranks`)."""
    _, two = same_as_one_process(
        one_process,
        arch,
        tiny_models(arch),
        tmp_path,
        ml.Parallel(2, fsdp=2),
        activation_checkpointing=checkpointing,
    )
    # FSDP2 shards the frozen base; a tenant's tensors are its own, whole on each data-parallel rank
    # (they come and go with the tenant, at its rank), their gradients summed when it steps
    events = two.tenant_events().dropna(subset=["adapter_bytes"])
    assert (events["local_adapter_bytes"] == events["adapter_bytes"]).all()


@pytest.mark.parametrize("arch, fsdp", [("mixtral", 1)])
def test_expert_parallel_two_ranks_equal_one(arch, fsdp, tiny_models, one_process, tmp_path):
    """ep=2 with attention replicated (fsdp=1) equals one process: the experts and their slots are
    split, tokens travel between the ranks (one rank has no rows of tenant b), and the saved adapters
    are gathered whole (ep=2 x fsdp=2 of qwen3_moe: :func:`test_resume_after_stop_with_two_ranks`)."""
    base = tiny_models(arch)
    one, two = same_as_one_process(
        one_process, arch, base, tmp_path, ml.Parallel(2, fsdp=fsdp, ep=2), activation_checkpointing=fsdp
    )  # checkpointed under fsdp=2 x ep=2
    a = two.tenant_events().query("tenant == 'a'").iloc[0]
    assert a.local_adapter_bytes < a.adapter_bytes  # its experts' share
    # the gathered adapter is PEFT's: loaded by PEFT, it gives the logits of the one-process adapter
    assert_same_peft_logits(base, [one, two], "a")


@pytest.mark.parametrize(
    "arch, nproc, fsdp, ep, checkpointing",
    [("gpt_neox", 2, 1, 1, 1), ("qwen2", 4, 2, 1, 2), ("qwen3_moe", 4, 1, 2, 1)],
)
def test_tensor_parallel_equals_one_process(
    arch, nproc, fsdp, ep, checkpointing, tiny_models, one_process, tmp_path
):
    """tp=2 (and fsdp=2 x tp=2, and tp=2 x ep=2 with LoRA on the experts, on 4 processes; with
    activation checkpointing of every block or every second one) equals one process without it:
    per-step losses and the saved adapters; a TP-trained adapter loaded by PEFT gives the logits of
    the one-process adapter (tp=2 of llama without checkpointing: :func:`test_resume_after_stop_with_two_ranks`)."""
    base = tiny_models(arch)
    layout = ml.Parallel(nproc, fsdp=fsdp, tp=2, ep=ep)
    one, many = same_as_one_process(
        one_process, arch, base, tmp_path, layout, activation_checkpointing=checkpointing
    )
    assert_same_peft_logits(base, [one, many], "b")


@pytest.mark.parametrize(
    "nproc, checks",
    [
        (2, ["tp:1:llama,llama+tied,gpt_neox,phi3,qwen3_moe", "ep:qwen3_moe,mixtral", "io:{llama}"]),
        (4, ["tp:2:llama,phi3", "ep:qwen3_moe"]),
    ],
)
def test_split_models_match_the_unsplit_model_under_torchrun(nproc, checks, llama_path):
    """``tests/dist/all_checks.py`` under torchrun: tensor parallelism (tp = nproc / fsdp) and expert
    parallelism against one unsplit model on every rank, and tenant-tensor I/O under FSDP2 (see the
    scripts it runs); one torchrun for all, so each process imports torch and transformers once."""
    checks = [c.format(llama=llama_path) for c in checks]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(ROOT / "tests" / "dist" / "all_checks.py"),
            *checks,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    oks = {"tp": "tensor parallel ok", "ep": "expert parallel ok", "io": "sharded I/O ok"}
    for check in checks:
        assert proc.stdout.count(oks[check[:2]]) == nproc, (check, proc.stdout[-4000:])


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_resume_in_process_equals_uninterrupted(arch, tiny_models, make_data, tmp_path):
    """Stopped after 3 global steps (mid accumulation window for tenant b), then resumed."""
    base = tiny_models(arch)  # with qwen3_moe, tenants a and b also adapt the packed experts
    tenants = tenants_for(arch, make_data)
    straight = Trainer(job(base, tenants, tmp_path / "straight"))
    straight.train()
    first = Trainer(job(base, tenants, tmp_path / "cut"), run_dir=tmp_path / "cut")
    for _ in range(3):
        first.step()
    assert first.tenants["b"].feed.micro == 1
    first.save_checkpoint()
    first.close()
    # a checkpoint cut off mid-write is never used: neither a temporary dir nor one without meta.json
    (tmp_path / "cut" / "checkpoints" / ".tmp-step_00000009").mkdir()
    (tmp_path / "cut" / "checkpoints" / "step_00000008").mkdir()
    (tmp_path / "cut" / "checkpoints" / "step_00000008" / "state.pt").write_bytes(b"partial")
    again = Trainer(job(base, tenants, tmp_path / "cut"), run_dir=tmp_path / "cut", resume=True)
    assert again.global_step == 3 and again.tenants["b"].feed.micro == 1
    again.train()
    for t in tenants:
        assert again.losses(t.name)[-1] == straight.losses(t.name)[-1]
        for m, (A, B) in straight.model.tenant_tensors(t.name).items():
            A2, B2 = again.model.tenant_tensors(t.name)[m]
            assert max((A - A2).abs().max().item(), (B - B2).abs().max().item()) <= 1e-6


@pytest.mark.parametrize(
    "arch, layout, resume_nprocs",
    [("llama", {}, (2, 1)), ("qwen3_moe", {"ep": 2}, (2,)), ("llama", {"tp": 2, "fsdp": 1}, (2,))],
    ids=["fsdp2-fsdp2-and-one", "ep2-ep2", "tp2-tp2"],
)
def test_resume_after_stop_with_two_ranks(arch, layout, resume_nprocs, tiny_models, make_data, tmp_path):
    """A 2-process run (fsdp=2; ep=2 x fsdp=2; tp=2) stopped early (graceful stop: checkpoint at the step
    it stopped), resumed on 2 (and, from a copy of the stopped run directory, on 1) processes, ends like
    the same job on one process straight through: per-step losses and adapters, and a PEFT-loaded
    adapter's logits. With ep=2 (tp=2) the checkpoint gathers the split experts' (projections')
    adapters, optimiser states and partial gradients, and resuming splits them again."""
    base = tiny_models(arch)
    # long enough that the stop lands mid-run, whatever the machine's speed
    tenants = [dataclasses.replace(t, max_steps=4 * t.max_steps) for t in tenants_for(arch, make_data)]
    straight = train_here(job(base, tenants, tmp_path / "straight"), tmp_path / "straight")
    spec = job(base, tenants, tmp_path / "cut", nproc=2)
    spec.parallel = dataclasses.replace(spec.parallel, **layout)
    stopped = ml.launch(spec)
    while not any(r["kind"] == "train" for r in stopped.rows()):
        assert stopped.status in ("starting", "running"), stopped.logs(0)
        time.sleep(0.05)
    (stopped.path / "control" / "stop").write_text("now")
    assert stopped.wait(300) == "stopped", stopped.logs(0)
    ckpts = sorted((stopped.path / "checkpoints").glob("step_*"))
    # stopped before the end: the last global step is 32 (tenant b: 16 steps of 2 micro-batches)
    assert len(ckpts) == 1 and 1 <= int(ckpts[0].name.split("_")[1]) < 32, ckpts
    copies = [stopped.path]
    for n in resume_nprocs[1:]:  # the same stopped run, resumed on another layout from its own copy
        copies.append(tmp_path / f"copy-{n}" / stopped.path.name)
        shutil.copytree(stopped.path, copies[-1], symlinks=True)
    names = [t.name for t in tenants]
    for root, nproc in zip(copies, resume_nprocs, strict=True):
        resumed = finished(ml.resume(root, nproc=nproc))
        assert read_status(root).state == "finished"
        # N ranks add a window's gradients in another order than one (and stopped mid-window, the partial
        # gradient is saved as the sum over the ranks): float reassociation, not a different computation
        assert_same_adapters(adapters(straight, names), adapters(resumed, names), TOL)
        l1, l2 = losses(straight), losses(resumed)
        assert set(l1) == set(l2), "metrics hold each tenant step once"
        assert max(abs(l1[k] - l2[k]) for k in l1) <= TOL, nproc
    # every rank of the 2-process run reported its memory
    assert set(ml.attach(stopped.path).system_metrics()["rank"]) >= {0, 1}
    events = ml.attach(stopped.path).tenant_events().dropna(subset=["adapter_bytes"])
    if layout.get("ep"):  # each rank holds its experts' share of a tenant of the experts
        a = events.query("tenant == 'a'").iloc[0]
        assert a.local_adapter_bytes < a.adapter_bytes
    elif not layout.get("tp"):  # FSDP2 shards the frozen base; a tenant's tensors are whole on each rank
        assert (events["local_adapter_bytes"] == events["adapter_bytes"]).all()
    # the adapter saved by the split run (gathered whole) is PEFT's: PEFT gives the reference's logits
    assert_same_peft_logits(base, [straight, ml.attach(stopped.path)], "a" if layout.get("ep") else "b")


@pytest.mark.parametrize(
    "layout, fields, tol",
    [
        (ml.Parallel(2, fsdp=2), {"packing": True, "activation_checkpointing": 1}, TOL),
        (ml.Parallel(2, tp=2), {"packing": True}, TOL),
        # bf16: ranks see other row shapes, so the bf16 roundings differ: a bf16-sized tolerance
        (ml.Parallel(2, fsdp=2), {"dtype": "bfloat16"}, 5e-3),
    ],
    ids=["fsdp2-packed-checkpointed", "tp2-packed", "fsdp2-bf16"],
)
def test_packing_and_bf16_two_ranks_equal_one(layout, fields, tol, llama_path, make_data, tmp_path):
    """A packed (and checkpointed) job, and a bf16-base job (FSDP2's mixed-precision policy: base in
    bf16, adapters and their gradient reduction in fp32), on two ranks equal the same job on one."""
    tenants = tenants_for("llama", make_data)
    spec = job(llama_path, tenants, tmp_path / "run2", nproc=2, **fields)
    spec.parallel = layout
    runs = [
        train_here(job(llama_path, tenants, tmp_path / "run1", **fields), tmp_path / "run1"),
        finished(ml.launch(spec)),
    ]
    l1, l2 = losses(runs[0]), losses(runs[1])
    assert set(l1) == set(l2) and len(l1) == 5 + 4 + 6
    assert max(abs(l1[k] - l2[k]) for k in l1) <= tol
    names = [t.name for t in tenants]
    assert_same_adapters(adapters(runs[0], names), adapters(runs[1], names), tol)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_equal_one_node(llama_path, make_data, tmp_path):
    tenants = tenants_for("llama", make_data)
    one_node = finished(ml.launch(job(llama_path, tenants, tmp_path / "one", nproc=2)))
    spec = job(llama_path, tenants, tmp_path / "two", nproc=1)
    spec.parallel = ml.Parallel(nproc=1, nnodes=2, fsdp=2)
    run_dir = prepare_run(spec)
    env = {**os.environ, "PYTHON": sys.executable, "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    agents = [
        subprocess.Popen(["bash", str(ROOT / "launchers" / "multinode.sh"), str(run_dir.root)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]  # fmt: skip
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    two_nodes = ml.attach(run_dir.root)
    assert two_nodes.status == "finished"
    names = [t.name for t in tenants]
    assert_same_adapters(adapters(one_node, names), adapters(two_nodes, names), 1e-6)
