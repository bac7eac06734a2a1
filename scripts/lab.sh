#!/usr/bin/env bash
# Set everything up and open the notebooks in JupyterLab. They open as copies in workspace/ (ignored by
# git; WORKSPACE picks another folder): running them, and JupyterLab's autosave, never touch the tracked
# notebooks/. A copy that exists is kept (your edits stay); delete it, or the whole workspace/, to get the
# original back.
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8899).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || bash scripts/setup.sh  # (SKIP_SETUP=1: the .venv is ready)
WORKSPACE="${WORKSPACE:-workspace}"
mkdir -p "$WORKSPACE"
for nb in notebooks/*.ipynb; do
  [ -e "$WORKSPACE/$(basename "$nb")" ] || cp "$nb" "$WORKSPACE/"
done
# (the Hub is not switched off: notebook 01 trains on SmolLM2 by its Hub id when the Hub answers, else on a GGUF)
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
root=()
[ "$(id -u)" = 0 ] && root=(--allow-root) # JupyterLab refuses root without it (containers run as root)
# notebook_shim 0.2.4 reads every trait of the server while it links (inspect.getmembers), which makes
# jupyter_server 2.21 warn "ServerApp.token config is deprecated" though nothing sets it; it shows because
# voila's import turns traitlets' DeprecationWarnings on for everyone. After that import they are off again,
# Python's default (a user can do nothing about them). Everything else is `jupyter lab` as it is.
exec .venv/bin/python -c '
import sys, warnings
import voila  # noqa: F401  (its filter first: ours, added later, is checked before it)
warnings.filterwarnings("ignore", category=DeprecationWarning, module="traitlets")
from jupyterlab.labapp import main
sys.argv[0] = "jupyter-lab"
sys.exit(main())
' --notebook-dir="$WORKSPACE" "${root[@]}" "$@"
