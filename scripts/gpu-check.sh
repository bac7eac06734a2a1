#!/usr/bin/env bash
# Issue 35's GPU check (benchmarks/gpu_check.py): the CUDA equivalences and G1-G4, one JSON.
#
#   on a GPU machine:  bash scripts/gpu-check.sh          (≤ 8 minutes on one H200)
#   here, on the CPU:  bash scripts/gpu-check.sh --dry    (tiny sizes: shows that every part runs)
#
# On the workplace's lent H200, first gather what it lacks, here: `.venv/bin/python scripts/gpu_wheels.py`
# (wheels in .whl/, ignored by git), then run this with .whl carried: run(command="bash scripts/gpu-check.sh",
# carry=[".whl"], timeout_s=540). The JSON, its log and the parts' own logs (pytest, the GRPO and service
# benchmarks) go to $OUT (or ./gpu-check-out): six files.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
if [ "${1:-}" = "--dry" ] && [ -x .venv/bin/python ]; then
    python=.venv/bin/python
elif compgen -G ".whl/*.whl" >/dev/null; then
    # (no index there: the wheels gathered here, without their dependencies, into a folder of their own)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="/tmp/site/bin:$PATH"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true; } | tee "$out/nvidia-smi.txt"
# (each part has its own budget inside; this bounds the whole, leaving the JSON written so far)
timeout 480 "$python" benchmarks/gpu_check.py --out "$out/gpu-check.json" "$@" 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
