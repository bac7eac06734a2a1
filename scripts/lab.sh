#!/usr/bin/env bash
# Set everything up and open the notebooks in JupyterLab. They open as copies in workspace/ (ignored by
# git): running them, and JupyterLab's autosave, never touch the tracked notebooks/. A copy that exists
# is kept (your edits stay); delete it, or the whole workspace/, to get the original back.
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8899).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p workspace
for nb in notebooks/*.ipynb; do
  [ -e "workspace/$(basename "$nb")" ] || cp "$nb" workspace/
done
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
exec .venv/bin/jupyter lab --notebook-dir=workspace "$@"
