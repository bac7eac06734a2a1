#!/usr/bin/env bash
# llama.cpp itself loads what `run.export(tenant, "gguf")` writes: builds llama-cpp-python from source (no
# wheel of it is published for this platform; ~10 min on 2 cores the first time, then pip's cache), installs
# it into .venv, and runs the test that loads an exported adapter over the real SmolLM2-135M GGUF and compares
# llama.cpp's logits with PEFT's. Not part of scripts/test.sh (CI would build it every run): there the test skips.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36  # (the version tested: 2026-11-29)
bash scripts/setup.sh
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  # portable build (no -march=native), without llama.cpp's own tests and examples
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/pip install "llama-cpp-python==$VERSION" --no-deps
  .venv/bin/pip install diskcache jinja2  # (its other dependencies; numpy and typing-extensions are there)
fi
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/lab/test_exports.py -k llama_cpp "$@"
