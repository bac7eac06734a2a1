#!/usr/bin/env bash
# Set everything up and open the notebooks in JupyterLab. They open as copies in workspace/ (ignored by
# git; WORKSPACE picks another folder): running them, and JupyterLab's autosave, never touch the tracked
# notebooks/. A copy that exists is kept (your edits stay); delete it, or the whole workspace/, to get the
# original back.
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8899).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
WORKSPACE="${WORKSPACE:-workspace}"
mkdir -p "$WORKSPACE"
for nb in notebooks/*.ipynb; do
  [ -e "$WORKSPACE/$(basename "$nb")" ] || cp "$nb" "$WORKSPACE/"
done
# (the Hub is not switched off: notebook 01 trains on SmolLM2 by its Hub id when the Hub answers, else on a GGUF)
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
root=()
[ "$(id -u)" = 0 ] && root=(--allow-root) # JupyterLab refuses root without it (containers run as root)
exec .venv/bin/jupyter lab --notebook-dir="$WORKSPACE" "${root[@]}" "$@"
