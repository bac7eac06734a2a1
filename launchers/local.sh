#!/usr/bin/env bash
# Run a job on this machine with torchrun in the foreground (`mlora-lab run` does the same in the
# background and follows it).
#   launchers/local.sh job.json
# Validates job.json (one error listing every problem, nothing started), creates the run directory,
# then starts parallel.nproc processes on this node.
#
# Nothing listens beyond this machine: torchrun uses the mlora-loopback rendezvous (mlora_lab/rendezvous.py)
# instead of --standalone, whose two agent stores listen on all interfaces. Both stores listen on
# 127.0.0.1 (free ports, so several jobs can run at once), workers get MASTER_ADDR=127.0.0.1, and
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME default to the loopback interface (your own settings win).
set -euo pipefail
JOB="${1:?usage: launchers/local.sh job.json}"
PY="${PYTHON:-python}"
NPROC="$("$PY" -c 'import sys; from mlora_lab.spec.job import JobSpec; print(JobSpec.load(sys.argv[1]).parallel.nproc)' "$JOB")"
RUN_DIR="$("$PY" -m mlora_lab.lab.cli prepare "$JOB")"
echo "run directory: $RUN_DIR"
# Line 1: the job's module (mlora_lab.rundir.status.JOB_MODULE); line 2: the torchrun arguments; then
# NAME=value lines of the loopback environment and of the torch threads per process (OMP_NUM_THREADS, as
# ml.launch sets it: mlora_lab/lab/launchers/threads.py).
RDZV="$("$PY" -c 'import sys; from mlora_lab.rendezvous import loopback_env, single_node_torchrun_args
from mlora_lab.lab.launchers.threads import thread_env
from mlora_lab.rundir.status import JOB_MODULE
print(JOB_MODULE)
print(*single_node_torchrun_args(int(sys.argv[1])))
for k, v in {**loopback_env(), **thread_env(int(sys.argv[1]))}.items(): print(f"{k}={v}")' "$NPROC")"
{
  read -r JOB_MODULE
  read -r -a TORCHRUN_ARGS
  while IFS='=' read -r key value; do export "$key=${!key:-$value}"; done
} <<<"$RDZV"
exec "$PY" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" -m "$JOB_MODULE" "$RUN_DIR"
