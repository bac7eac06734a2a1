"""Shared fixtures: tiny models built locally (never downloaded), once per test session."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mlora_lab.tiny import build_tiny_model

# The tests mirror the package (tests/job/, tests/lab/, ...). Some share helpers across folders
# (tests/lab/slurm/test_slurm compares adapters as tests/dist/test_distributed does): every folder's modules stay importable by
# their name, as pytest's "prepend" import mode makes them within a folder (names are unique).
sys.path[1:1] = sorted(
    {str(p.parent) for p in Path(__file__).parent.rglob("test_*.py") if p.parent != Path(__file__).parent}
)

# Determinism and a quiet, offline environment for every test (torchrun children inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TINKER_TELEMETRY", "0")  # the Tinker SDK sends nothing anywhere from a test
# Jobs the tests start run side by side with each other, with notebook kernels and with this process: one
# torch thread per job process, as the launcher picks on a busy machine (mlora_lab.lab.launchers.threads), whatever
# the machine looks like at the moment a job starts. (This process keeps the threads torch took at import.)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    """GGUF bases converted by the tests and their jobs go to one folder of this session, shared by the
    xdist workers (they inherit this process's environment), never to the user's ``~/.cache``. A run whose
    xdist groups would be split stops here (see :func:`pytest_collection_modifyitems`)."""
    if config.getoption("dist", None) == "loadgroup":
        from importlib.metadata import version

        from packaging.version import Version

        xdist = version("pytest-xdist")
        if Version(pytest.__version__) >= Version("9.2") and Version(xdist) <= Version("3.8"):
            raise pytest.UsageError(
                f"pytest {pytest.__version__} with pytest-xdist {xdist} splits every xdist_group over the "
                "workers under --dist loadgroup; install the pytest of constraints.txt"
            )
    if not hasattr(config, "workerinput") and "MLORA_LAB_CACHE" not in os.environ:
        config.stash[_OWN_CACHE] = os.environ["MLORA_LAB_CACHE"] = tempfile.mkdtemp(
            prefix="mlora-test-cache-"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    if own := config.stash.get(_OWN_CACHE, None):
        shutil.rmtree(own, ignore_errors=True)


_OWN_CACHE = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` each ``xdist_group`` must run on one worker: the Slurm tests share one local
    cluster per worker (two clusters at once number their jobs alike, and a job's rendezvous port comes from its
    id: one job's agents joined the other's store), the browser tests one display, and module fixtures that
    launch jobs run once. pytest-xdist groups by a suffix it adds to each test's id; pytest 9.2 ignores it, and
    the groups were silently split. A worker whose grouped tests lack the suffix stops the run, saying so."""
    if not getattr(config.option, "loadgroup", False):  # (set in xdist workers under --dist loadgroup)
        return
    lost = [i for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        why = (
            f"--dist loadgroup cannot keep xdist groups together here (pytest {pytest.__version__}: "
            f"{len(lost)} grouped tests without the group in their id, e.g. {lost[0].nodeid}); install the "
            "pytest of constraints.txt"
        )
        # Each such test fails with why, unrun: raised here, in a worker, the error reached the terminal as
        # an xdist INTERNALERROR traceback that hid it.
        for item in lost:
            item.runtest = functools.partial(pytest.fail, why, pytrace=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_models(arch) -> path``: a saved tiny model + tokenizer directory, built once per arch."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, Path(root) / arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def llama_path(tiny_models) -> str:
    return tiny_models("llama")


@pytest.fixture
def one_thread():
    """Torch on one thread in this process for the test, as in the job processes the tests start (pytest
    imports torch before conftest sets OMP_NUM_THREADS=1): beside the other xdist worker on 2 cores, two
    threads make small steps several times slower (measured: the real-model RL test took 74 s with two
    threads, 44 s with one; the cookbook's RL loop on a job in this process 54 s against 8 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _loaded_by_the_model_libraries() -> frozenset[str]:
    import subprocess

    code = (
        "import json, sys, torch, transformers; from transformers import AutoModelForCausalLM, PreTrainedModel; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return frozenset(json.loads(out.stdout.strip().splitlines()[-1]))


def not_ours(loaded: list[str] | set[str]) -> list[str]:
    """Of the modules ``loaded`` in a process of ours, those that torch and transformers' model classes do
    not load on their own here: what our code brought in. (transformers 5.17, the lent GPU machine's, with
    scikit-learn installed imports ``sklearn.metrics`` and with it pandas from generation/candidate_generator.py
    at import; 5.24 does not. A test that a job loads no pandas holds our code to it, not transformers.)"""
    return sorted(set(loaded) - _loaded_by_the_model_libraries())


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def task_rows(kind: str, n: int = 12) -> list[dict]:
    """Rows of small, clearly different tasks, with varied lengths."""
    words = ["red", "green", "blue", "cat", "dog", "bird", "tree", "river", "city", "road", "car", "plane"]
    rows = []
    for i in range(n):
        w = " ".join(words[j % len(words)] for j in range(i, i + 1 + i % 4))
        if kind == "reverse":
            rows.append({"prompt": f"reverse: {w}\n", "completion": w[::-1]})
        elif kind == "upper":
            rows.append({"prompt": f"upper: {w}\n", "completion": w.upper()})
        elif kind == "text":
            rows.append({"text": f"{i} {w} and {w} again {i + 1}"})
        elif kind == "chat":
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"count {w}"},
                        {"role": "assistant", "content": str(len(w))},
                    ]
                }
            )
        else:
            raise ValueError(kind)
    return rows


@pytest.fixture
def make_data(tmp_path: Path):
    """``make_data(kind, n=12, name=None) -> path`` of a JSONL file of ``task_rows(kind, n)``."""

    def make(kind: str, n: int = 12, name: str | None = None) -> str:
        return write_jsonl(tmp_path / f"{name or kind}.jsonl", task_rows(kind, n))

    return make


@pytest.fixture(autouse=True)
def sdk_clients_closed():
    """Every ``tinker.ServiceClient`` a test made is closed when it ends (after its server is gone): an open
    one heartbeats its session every 10 s and, with no server to answer, warns every 10 s from 2 minutes on,
    in whatever test runs then. Nothing happens in a process that has not imported the SDK."""
    import sys

    tinker = sys.modules.get("tinker")
    if tinker is None:
        yield
        return
    made: list = []
    init = tinker.ServiceClient.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    tinker.ServiceClient.__init__ = recording
    try:
        yield
    finally:
        tinker.ServiceClient.__init__ = init
        for client in made:
            # The public close() sends the session's finish request first, with the SDK's retries, and stops the
            # heartbeat only after them: with the server gone, minutes. Its holders' close() stops it at once.
            for name in ("_session_holder", "_rest_holder"):
                holder = getattr(client, name, None)
                if holder is not None:
                    with contextlib.suppress(Exception):
                        holder.close()


@pytest.fixture(autouse=True)
def no_leftover_jobs():
    """A test that fails half-way must not leave a training job running (it would slow every later
    test and benchmark): kill whatever processes it started and left behind."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(leftovers, timeout=10)


def stop_runs_under(folder: Path) -> list[str]:
    """Kill the job of every run directory under ``folder`` that is not final; the runs it stopped.

    For jobs started by a notebook kernel: their processes outlive the kernel, so they are found
    through the run directories, not among this process's children."""
    import mlora_lab as ml

    stopped = []
    for job in folder.rglob("job.json"):
        run = ml.attach(job.parent)
        if not run.status.final:
            run.kill()
            stopped.append(run.path.name)
    return stopped


def task_files(folder: Path) -> dict[str, str]:
    """The ``reverse``, ``chat`` and ``upper`` tasks' rows as JSONL files in ``folder``: kind -> path."""
    return {
        kind: write_jsonl(folder / f"{kind}.jsonl", task_rows(kind)) for kind in ("reverse", "chat", "upper")
    }


def two_tenants(data: dict[str, str], steps: tuple[int, int]) -> list:
    """The two tenants the multi-node engine tests (Slurm, Ray) train: different tasks, ranks, learning rates,
    batch sizes, accumulation, schedules and target modules; ``steps``: each one's ``max_steps``."""
    import mlora_lab as ml

    return [
        ml.Tenant(
            name="a", data=data["reverse"], rank=4, alpha=8, lr=1e-3, batch_size=3, max_steps=steps[0], seed=1
        ),
        ml.Tenant(
            name="b",
            data=data["chat"],
            rank=8,
            lr=2e-3,
            batch_size=2,
            grad_accum=2,
            max_steps=steps[1],
            schedule="cosine",
            warmup_steps=2,
            seed=2,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
    ]
