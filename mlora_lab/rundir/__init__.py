"""The run directory: the one typed protocol between a job and everything that watches or steers it.

```
<run_dir>/job.json            the spec as launched (JobSpec as JSON)
<run_dir>/status.json         {"state", "pid", "pid_start_time", "pid_start_ticks", "pid_boot_id", "host",
                               "started", "ended", "error", "launcher", "launcher_job", "launcher_state"}
                              (launcher_job: {"kind", "id"} of the engine's job; a Slurm run's also
                              slurm_job_id / slurm_state, written until mlora_lab 0.3 and read from an
                              older file as launcher_job / launcher_state: legacy.py)
<run_dir>/metrics.jsonl       typed rows (train / eval / system / tenant / event / completion), appended by rank 0
<run_dir>/logs/rank<R>.log    each rank's stdout+stderr (logs/launcher.log: the torchrun agent's)
<run_dir>/adapters/<tenant>/  latest PEFT adapter directory of that tenant
<run_dir>/data/<tenant>/      train.jsonl / eval.jsonl: rows the tenant was given in memory (a DataFrame,
                              ...), written at launch or add_tenant; job.json names them
<run_dir>/checkpoints/        step_<N>/ = state.json + tensors.safetensors + meta.json (checksums)
<run_dir>/control/            control messages, their results, and the stop request
<run_dir>/labels.json         tags and a note, set by people (the job never reads it)
<run_dir>/slurm.json          the SlurmOptions of a Slurm job (mlora_lab.lab.slurm.cluster), reused by a resume
<run_dir>/<L>_options.json    another launcher L's options (ray_options.json: RayOptions), reused likewise
<run_dir>/slurm.sbatch        its batch script as last submitted (logs/launcher.log: its output)
<run_dir>/sweep.json          a search inside the job (mlora_lab.search.Sweep), if it runs one
<run_dir>/search.json         that search's state: trials, rungs, decisions and why (written by rank 0)
<run_dir>/service/            a served job's endpoint.json (its URL) and keys.json (API keys, 0600)
<run_dir>/agents.json         harness tenants' agents endpoint and keys (0600; :mod:`.agents`)
<run_dir>/.lock               held (flock) by whoever owns the directory: a launch, then the job
<run_dir>/.spare              space the job keeps allocated, freed to write status.json on a full disk
```

No file of a run is written through a symlink planted in it (:mod:`.files`: the one guard every writer
goes through).

One module per format: :mod:`.files` (layout, names → paths, atomic writes, the lock),
:mod:`.status` (run states, process identity), :mod:`.rows` (metrics rows, writer, reader),
:mod:`.control` (messages, results, stop), :mod:`.checkpoint` (checkpoint layout and format),
:mod:`.labels` (tags and note) and :mod:`.service` (a served job's endpoint and keys).
The job, the launcher, the dashboard, the reports and the CLI all go through them; nothing here
imports the training code or the notebook side.

Importing this package loads no torch: the checkpoint codec (:mod:`.checkpoint`, safetensors and
torch) is imported on first use of ``rundir.checkpoint`` or ``rundir.CheckpointError``, so the notebook
side reads a run (status, metrics, logs) without it.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from mlora_lab.rundir import control, labels, rows
from mlora_lab.rundir.control import ControlError, ControlMessage, ControlResult, Op
from mlora_lab.rundir.files import (
    LinkRefused,
    RunDir,
    RunDirError,
    RunLock,
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    guarded_open,
    name_problem,
)
from mlora_lab.rundir.labels import RunLabels, read_labels, update_labels
from mlora_lab.rundir.rows import (
    HELDOUT_KIND,
    CompletionRow,
    EpisodeRecord,
    EvalMetricRow,
    EventKind,
    EventRow,
    HeldoutRow,
    MetricsReader,
    MetricsWriter,
    Row,
    RowKind,
    SystemRow,
    TenantRow,
    TenantState,
    TrainRow,
    UsageRow,
)
from mlora_lab.rundir.status import (
    FINAL_STATES,
    ProcessIdentity,
    RunState,
    Status,
    read_status,
    record_problem,
    shown_tenant_state,
    update_status,
)

__all__ = [
    "FINAL_STATES",
    "HELDOUT_KIND",
    "CheckpointError",
    "CompletionRow",
    "ControlError",
    "ControlMessage",
    "ControlResult",
    "EpisodeRecord",
    "EvalMetricRow",
    "EventKind",
    "EventRow",
    "HeldoutRow",
    "LinkRefused",
    "MetricsReader",
    "MetricsWriter",
    "Op",
    "ProcessIdentity",
    "Row",
    "RowKind",
    "RunDir",
    "RunDirError",
    "RunLabels",
    "RunLock",
    "RunState",
    "Status",
    "SystemRow",
    "TenantRow",
    "TenantState",
    "TrainRow",
    "UsageRow",
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "checkpoint",
    "control",
    "guarded_open",
    "labels",
    "name_problem",
    "read_labels",
    "read_status",
    "record_problem",
    "shown_tenant_state",
    "update_labels",
    "update_status",
]


if TYPE_CHECKING:  # the same names, imported eagerly, for type checkers
    from mlora_lab.rundir import checkpoint
    from mlora_lab.rundir.checkpoint import CheckpointError


def __getattr__(name: str) -> Any:
    """The checkpoint codec, imported when it is first asked for (it loads torch); an old name of
    :data:`~mlora_lab.rundir.rows.OLD_NAMES` (``EvalRow``), with its ``DeprecationWarning``."""
    if name in ("checkpoint", "CheckpointError"):
        codec = importlib.import_module("mlora_lab.rundir.checkpoint")
        return codec if name == "checkpoint" else codec.CheckpointError
    if name in rows.OLD_NAMES:
        if sys._getframe(1).f_globals.get("__name__", "").startswith("importlib"):
            # ``from mlora_lab.rundir import EvalRow`` asks hasattr() first, from the import machinery, then
            # getattr() from the importing line: the warning is said once, there
            return getattr(rows, rows.OLD_NAMES[name])
        return getattr(rows, name)
    raise AttributeError(f"module 'mlora_lab.rundir' has no attribute {name!r}")
