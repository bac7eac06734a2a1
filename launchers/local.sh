#!/usr/bin/env bash
# Run a job on this machine with torchrun in the foreground (`mlora-lab run` does the same in the
# background and follows it).
#   launchers/local.sh job.json
# Validates job.json (one error listing every problem, nothing started), creates the run directory,
# then starts parallel.nproc processes on this node.
set -euo pipefail
JOB="${1:?usage: launchers/local.sh job.json}"
PY="${PYTHON:-python}"
NPROC="$("$PY" -c 'import sys; from mlora_lab.spec import JobSpec; print(JobSpec.load(sys.argv[1]).parallel.nproc)' "$JOB")"
RUN_DIR="$("$PY" -m mlora_lab.cli prepare "$JOB")"
echo "run directory: $RUN_DIR"
exec "$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC" \
  -m mlora_lab.train "$RUN_DIR"
