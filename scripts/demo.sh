#!/usr/bin/env bash
# Set everything up and run the demo: three LoRA tenants trained together under torchrun on a tiny
# model built locally. Extra arguments go to `mlora-lab demo` (e.g. --nproc 2, --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
exec .venv/bin/mlora-lab demo "$@"
