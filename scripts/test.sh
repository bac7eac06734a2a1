#!/usr/bin/env bash
# Set everything up and run the checks: ruff (lint + format) and the test suite (notebooks and a
# headless-Chromium dashboard test included).
# Extra arguments go to pytest (e.g. -k peft, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts hundreds of Python processes: each module's bytecode is written at its first import and
# reused by every later process (with PYTHONDONTWRITEBYTECODE set, setup.sh would compile all 18,000 files).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
# The browser test drives Debian's Chromium (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null
fi
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
.venv/bin/ruff check mlora_lab tests benchmarks
.venv/bin/ruff format --check mlora_lab tests benchmarks
# Two workers (the suite's jobs take one thread a process); the Slurm cluster and the browser tests each keep
# to one worker (--dist loadgroup). A short base folder: messages that show a path cut it at 80 characters.
basetemp="$(mktemp -d "${TMPDIR:-/tmp}/mlt.XXXXXX")"
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations 25 --basetemp "$basetemp" "$@"
