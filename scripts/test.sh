#!/usr/bin/env bash
# Set everything up and run the checks: ruff (lint + format) and the test suite (notebooks and a
# headless-Chromium dashboard test included).
# Extra arguments go to pytest (e.g. -k peft, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The browser test drives Debian's Chromium (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null
fi
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
.venv/bin/ruff check mlora_lab tests benchmarks
.venv/bin/ruff format --check mlora_lab tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
