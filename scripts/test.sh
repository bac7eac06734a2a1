#!/usr/bin/env bash
# Set everything up and run the checks: ruff (lint + format) and the test suite.
# Extra arguments go to pytest (e.g. -k peft, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
.venv/bin/ruff check mlora_lab tests benchmarks
.venv/bin/ruff format --check mlora_lab tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
