#!/usr/bin/env bash
# Write constraints.txt from an environment where the whole suite passed (default .venv; --from DIR for
# another, e.g. .venv-latest after scripts/test-latest.sh). torch and mlora_lab itself are left out: torch
# comes from TORCH_SPEC in scripts/setup.sh, so a GPU machine can take its own build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
[ "${1:-}" = "--from" ] && VENV="$2"
{
  sed -n '/^#/p' constraints.txt
  "$VENV/bin/python" -m pip freeze --exclude-editable 2>/dev/null | grep -viE '^(torch|mlora[-_]lab)=='
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pinned packages from $VENV"
