#!/usr/bin/env bash
# Start this node's share of a multi-node job: run the same command on every node.
#
#   mlora-lab prepare job.json                      # once: validate, create RUN_DIR (on a shared filesystem)
#   RDZV_ENDPOINT=node0:29500 launchers/multinode.sh RUN_DIR [--resume]    # on every node
#
# torchrun's c10d rendezvous meets at RDZV_ENDPOINT (host:port of any one node; the agent on that
# host serves it). NNODES and NPROC_PER_NODE default to parallel.nnodes / parallel.nproc in job.json;
# RDZV_ID (default: the run directory's name) keeps concurrent jobs apart.
#
# Network exposure: the rendezvous store listens on RDZV_ENDPOINT's port on ALL interfaces of the node
# that hosts it (that is how the other nodes reach it); so does the agent store that workers connect to
# (MASTER_PORT, a free port picked at start), and every rank's gloo/NCCL sockets listen on the node's
# network address. None of these is authenticated: whoever can reach them can join or disturb the job.
# Run multi-node jobs only on a trusted network, or firewall these ports to the job's nodes.
# (Single-node jobs need none of this: launchers/local.sh listens on 127.0.0.1 only.)
set -euo pipefail
RUN_DIR="${1:?usage: RDZV_ENDPOINT=host:port launchers/multinode.sh RUN_DIR [--resume]}"
shift
PY="${PYTHON:-python}"
ENDPOINT="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous}"
read -r JOB_NNODES JOB_NPROC JOB_MODULE < <("$PY" -c 'import sys; from mlora_lab.spec.job import JobSpec
from mlora_lab.rundir.status import JOB_MODULE
p = JobSpec.load(sys.argv[1] + "/job.json").parallel; print(p.nnodes, p.nproc, JOB_MODULE)' "$RUN_DIR")
exec "$PY" -m torch.distributed.run \
  --nnodes "${NNODES:-$JOB_NNODES}" --nproc-per-node "${NPROC_PER_NODE:-$JOB_NPROC}" \
  --rdzv-backend c10d --rdzv-endpoint "$ENDPOINT" --rdzv-id "${RDZV_ID:-$(basename "$RUN_DIR")}" \
  --max-restarts 0 \
  -m "$JOB_MODULE" "$RUN_DIR" "$@"
