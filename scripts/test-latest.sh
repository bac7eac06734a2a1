#!/usr/bin/env bash
# Run the test suite against the newest releases of everything pyproject.toml allows (transformers, peft,
# ...), in a separate environment (.venv-latest), so that the next upstream break is seen on purpose, not
# on a user's fresh install. When it passes, scripts/lock.sh --from .venv-latest moves constraints.txt
# (what scripts/setup.sh and CI install) to these versions. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-latest CONSTRAINTS="" bash scripts/setup.sh
# (on a re-run: everything to its newest release, but torch, which stays the build set up first)
torch_pin="torch==$(.venv-latest/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')"
.venv-latest/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -c <(echo "$torch_pin") -e ".[dev]"
.venv-latest/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^(transformers|peft|tokenizers|accelerate|safetensors|pandas|matplotlib)=='
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
exec .venv-latest/bin/python -m pytest -q "$@"
