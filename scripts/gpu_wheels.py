"""Gather, into ``.whl/``, the wheels a bare GPU machine of this workplace lacks to run scripts/gpu-check.sh.

    .venv/bin/python scripts/gpu_wheels.py        # here (where pip reaches a package registry)

The lent H200 (``nvidia-h200``) runs Python 3.12 on x86-64 with PyTorch, transformers, PEFT and many more
already installed (:data:`THERE`, its image's package list) and nothing to download from. What
``mlora_lab`` needs beyond that (its own dependencies but the notebook widgets, which a job never imports;
the ``serve`` extra: the ``tinker`` SDK, Starlette and
uvicorn; and TRL 1.16.0 with ``datasets``, which the equivalence tests compare against) is resolved here: each
requirement's wheel for that machine is downloaded without its dependencies, its own requirements are read
from its metadata (markers evaluated for Python 3.12 on Linux), and those the machine lacks are fetched in
turn. ``mlora_lab`` itself goes in as a wheel built from this checkout (torchrun finds its rendezvous handler
through the installed entry point). ``scripts/gpu-check.sh`` installs the folder there with
``pip install --no-index --no-deps --target``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".whl"
PLATFORM = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    *[f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                  "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")],
]  # fmt: skip
ROOTS = [
    "msgspec>=0.19", "orjson>=3.9", "gguf>=0.10",
    "tinker==0.38.0", "starlette>=0.40", "uvicorn>=0.30", "trl==1.16.0", "datasets>=3", "pytest-timeout",
    "bitsandbytes>=0.50",  # (issue 36's quantized base; ~40 MB, its CUDA kernels included)
]  # fmt: skip
THERE = set(
    canonicalize_name(n)
    for n in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
    equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
    grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
    interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
    lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()  # noqa: SIM905 (the list as KINDS.md prints it)
)
"""The packages of the lent H200's image (the device's KINDS.md, read 2026-11-17)."""
ENVIRONMENT = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
               "implementation_name": "cpython", "extra": ""}  # fmt: skip


def download(requirement: Requirement) -> Path:
    """The wheel of ``requirement`` for the machine, in :data:`OUT`."""
    before = set(OUT.glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            *PLATFORM,
            # (the versions the suite last passed with, where constraints.txt names the package)
            "-c",
            str(ROOT / "constraints.txt"),
            "-d",
            str(OUT),
            str(requirement),
        ],
        check=True,
    )
    new = set(OUT.glob("*.whl")) - before
    name = canonicalize_name(requirement.name)
    found = new or {w for w in OUT.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name}
    return sorted(found)[0]


def requirements(wheel: Path) -> list[Requirement]:
    """What the wheel's metadata requires on the machine (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(ENVIRONMENT):
                out.append(req)
    return out


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    seen: set[str] = set()
    queue = [Requirement(r) for r in ROOTS]
    while queue:
        req = queue.pop()
        name = canonicalize_name(req.name)
        if name in seen or name in THERE:
            continue
        seen.add(name)
        wheel = download(req)
        print(f"  {wheel.name}")
        queue.extend(requirements(wheel))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(OUT), str(ROOT)], check=True
    )
    size = sum(w.stat().st_size for w in OUT.glob("*.whl"))
    print(f"{len(list(OUT.glob('*.whl')))} wheels in {OUT.relative_to(ROOT)}/, {size / 2**20:.1f} MiB "
          "(carry it: run(carry=['.whl']))")  # fmt: skip
    # the device's working tree travels in 64 MiB: the repository's files and what is carried, with 2 MiB spare
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / f).stat().st_size for f in listed.decode().split("\0") if f and (ROOT / f).is_file())
    if size + tree > 62 * 2**20:
        sys.exit(f"{(size + tree) / 2**20:.1f} MiB with the repository's {tree / 2**20:.1f}: over the 62 MiB "
                 "that leave 2 of the 64 the device's working tree may take")  # fmt: skip


if __name__ == "__main__":
    main()
