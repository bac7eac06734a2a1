"""Each tracker written with its own API: TensorBoard event files (``tensorboard``'s writer, no
TensorFlow or torch), W&B runs (``wandb.init``, offline unless ``WANDB_MODE`` says otherwise) and trackio
runs (``trackio.init``, its local SQLite store). A backend holds any number of tracker runs at once,
one per key (:class:`~mlora_lab.trackers.points.TrackerRun`); its tracker is imported when it is made.

Where they write (:class:`Where`): ``<logging_dir>/<tracker>``, where ``logging_dir`` is the job's (or
the caller's), else what the user set for the tracker itself (``TENSORBOARD_LOGGING_DIR``, ``WANDB_DIR``,
``TRACKIO_DIR``), else the run directory's ``trackers/``: nothing leaves the run directory unless asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mlora_lab.rundir import RunDir
from mlora_lab.rundir.files import LinkRefused, open_folder, relative_parts
from mlora_lab.trackers.points import TrackerRun

DEFAULT_PROJECT = "mlora_lab"
"""The W&B / trackio project when neither ``JobSpec.project`` nor ``WANDB_PROJECT`` names one."""
ENV_DIRS = {"tensorboard": "TENSORBOARD_LOGGING_DIR", "wandb": "WANDB_DIR", "trackio": "TRACKIO_DIR"}
"""The variable each tracker (or transformers, for TensorBoard) reads its folder from."""


@dataclass(frozen=True)
class Where:
    """Where a mirror writes: the run directory, an explicit ``logging_dir`` (``None``: each tracker's
    own variable, else ``<run_dir>/trackers``) and the project."""

    run: RunDir
    logging_dir: str | None
    project: str | None

    def folder(self, tracker: str) -> Path:
        """The folder ``tracker`` writes in. The default one, inside the run directory, is checked to
        stay there (a planted ``trackers`` symlink is refused)."""
        if self.logging_dir is not None:
            return Path(self.logging_dir) / tracker
        own = os.environ.get(ENV_DIRS[tracker])
        if own:
            return Path(os.path.expanduser(own))
        return self.run.inside(self.run.root / "trackers" / tracker)

    def make(self, folder: Path) -> None:
        """Create ``folder``: below the run directory through its guard (no link followed on the way), a
        folder the user named (``logging_dir``, the tracker's own variable) as it is."""
        try:
            parts = relative_parts(self.run.root, folder)
        except LinkRefused:  # (not below the run directory)
            folder.mkdir(parents=True, exist_ok=True)
        else:
            os.close(open_folder(self.run.root, parts, create=True))

    def project_for(self, tracker: str) -> str:
        if self.project:
            return self.project
        if tracker == "wandb" and os.environ.get("WANDB_PROJECT"):
            return os.environ["WANDB_PROJECT"]
        return DEFAULT_PROJECT

    def run_id(self, run: TrackerRun) -> str:
        """A W&B run id that is the same for the same run directory and key, so a resumed job (and a
        later mirror of the same run) continues its tracker run instead of starting another."""
        digest = hashlib.sha256(f"{self.run.root.resolve()}\0{run.key or ''}".encode()).hexdigest()
        return f"mlora-{digest[:20]}"


class Backend(Protocol):
    """What a mirror asks of a tracker; every method may raise (the mirror then drops the tracker)."""

    name: str

    def destination(self) -> str: ...
    def start(self, run: TrackerRun) -> None: ...
    def log(self, key: str | None, step: int, values: dict[str, float]) -> None: ...
    def note(self, key: str | None, step: int, tag: str, text: str) -> None: ...
    def add_config(self, key: str | None, step: int, config: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def scalar(value: Any) -> bool | int | float | str:
    """A config value as TensorBoard's hyperparameters take it: a bool, number or string (lists and
    ``None`` as their JSON text)."""
    if isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, default=str)


def _file_second(name: str) -> int:
    """The second an event file was started in, from its name (``events.out.tfevents.<second>...``)."""
    parts = name.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else -1


class TensorBoard:
    """TensorBoard event files: one folder per tracker run under ``<logging_dir>/tensorboard``
    (``tenants/<name>``, ``job``), scalars as scalar summaries, the config as hyperparameters (the
    HParams tab) and as JSON text, notes as text. Written with tensorboard's own event writer, flushed
    after every row, so a running ``tensorboard --logdir`` follows the job."""

    name = "tensorboard"

    def __init__(self, where: Where) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.hparams import summary_v2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = (event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2)
        self._hparams, self._text_metadata, self._writer_class = summary_v2, text_metadata, EventFileWriter
        self.root = where.folder(self.name)
        self.writers: dict[str | None, Any] = {}

    def destination(self) -> str:
        return str(self.root)

    def _event(self, key: str | None, step: int, summary: Any) -> None:
        event_pb2 = self._pb[0]
        self.writers[key].add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _text(self, key: str | None, step: int, tag: str, text: str) -> None:
        _, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2 = self._pb
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode("utf-8", "backslashreplace")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]
            ),
        )
        metadata = self._text_metadata.create_summary_metadata(display_name=None, description=None)
        value = summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)
        self._event(key, step, summary_pb2.Summary(value=[value]))

    def start(self, run: TrackerRun) -> None:
        event_pb2 = self._pb[0]
        folder = self.root / run.folder
        # Readers take a folder's event files in the order of their names, ``events.out.tfevents.<second>.
        # <host>.<pid>.<n><suffix>``: within one second (a resume, a mirror again) the counter ``n`` decides,
        # and 10 sorts before 9, so the restart marker below was read before the events it drops (seen in a
        # test). A new file starts in a later second than the folder's last one.
        newest = max((_file_second(p.name) for p in folder.glob("events.out.tfevents.*")), default=-1)
        while int(time.time()) <= newest:
            time.sleep(0.05)
        self.writers[run.key] = self._writer_class(str(folder))
        # TensorBoard's restart marker: what the folder holds from this step on (an earlier mirror of
        # the run, or the rows a resumed job logs again) is dropped by every reader
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self.writers[run.key].add_event(
            event_pb2.Event(wall_time=time.time(), step=run.since, session_log=start)
        )
        hparams = {k: scalar(v) for k, v in run.config.items()}
        self._event(run.key, run.since, self._hparams.hparams_pb(hparams, trial_id=run.title))
        self._text(run.key, run.since, "config", json.dumps(run.config, indent=1, default=str))
        self.writers[run.key].flush()

    def log(self, key: str | None, step: int, values: dict[str, float]) -> None:
        summary_pb2 = self._pb[1]
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self._event(key, step, summary)
        self.writers[key].flush()

    def note(self, key: str | None, step: int, tag: str, text: str) -> None:
        self._text(key, step, tag, text)
        self.writers[key].flush()

    def add_config(self, key: str | None, step: int, config: dict[str, Any]) -> None:
        self._text(key, step, "config", json.dumps(config, indent=1, default=str))
        self.writers[key].flush()

    def close(self) -> None:
        writers, self.writers = self.writers, {}
        for w in writers.values():
            w.close()


class Wandb:
    """W&B runs, any number at once (``reinit="create_new"``): ``mode="offline"`` unless ``WANDB_MODE``
    is set, under ``<logging_dir>/wandb`` (W&B adds its own ``wandb/`` inside: ``offline-run-*``), named
    ``<job>/<tenant>`` with ``group=<job>``, ``job_type`` tenant or job, the config as the run's config,
    notes in its summary. The run id is stable per run directory and key (``resume="allow"``): once
    synced, a resumed job (or a later mirror of the run) continues the same W&B runs."""

    name = "wandb"

    def __init__(self, where: Where) -> None:
        import wandb

        self.wandb = wandb
        self.where = where
        self.dir = where.folder(self.name)
        self.runs: dict[str | None, Any] = {}

    def destination(self) -> str:
        return str(self.dir)

    def start(self, run: TrackerRun) -> None:
        self.where.make(self.dir)
        wandb = self.wandb
        self.runs[run.key] = wandb.init(
            project=self.where.project_for(self.name),
            name=run.title,
            group=run.group,
            job_type=run.kind,
            config=run.config,
            id=self.where.run_id(run),
            resume="allow",
            dir=str(self.dir),
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            reinit="create_new",
            # the job's rank 0 already logs its own output and system meters; no code is saved
            settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False, silent=True),
        )

    def log(self, key: str | None, step: int, values: dict[str, float]) -> None:
        self.runs[key].log(values, step=step)

    def note(self, key: str | None, step: int, tag: str, text: str) -> None:
        self.runs[key].summary[tag] = text

    def add_config(self, key: str | None, step: int, config: dict[str, Any]) -> None:
        self.runs[key].config.update(config, allow_val_change=True)

    def close(self) -> None:
        runs, self.runs = self.runs, {}
        for r in runs.values():
            r.finish()
        if runs and self.wandb.run is None:  # no run of anyone else's: W&B's service process ends too
            self.wandb.teardown()


class Trackio:
    """trackio runs in its local store (``<logging_dir>/trackio``, one SQLite file per project), named
    and grouped as W&B's, the config as the run's config (trackio keeps the config a run starts with),
    notes as text values. trackio reads its folder once, when it is imported: a process that imported it
    with another folder cannot mirror here (``ml.report`` runs in a child process for this). A run that
    exists already is continued, and rows at steps it holds are skipped (a resumed job re-logs the rows
    after its checkpoint; a run mirrored again adds nothing)."""

    name = "trackio"

    def __init__(self, where: Where) -> None:
        self.where = where
        self.dir = where.folder(self.name)
        if "trackio.utils" not in sys.modules:  # it reads TRACKIO_DIR once, at import
            before = os.environ.get("TRACKIO_DIR")
            os.environ["TRACKIO_DIR"] = str(self.dir)
            try:
                import trackio.utils
            finally:  # this process's children keep the variable they would have had
                if before is None:
                    del os.environ["TRACKIO_DIR"]
                else:
                    os.environ["TRACKIO_DIR"] = before
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        if Path(trackio.utils.TRACKIO_DIR).absolute() != self.dir.absolute():
            raise RuntimeError(
                f"trackio was imported in this process with its store at {trackio.utils.TRACKIO_DIR}, "
                f"not {self.dir}; mirror from another process (ml.report, mlora-lab report)"
            )
        self.trackio, self.storage = trackio, SQLiteStorage
        self.runs: dict[str | None, Any] = {}
        self.done_to: dict[str | None, int] = {}

    def destination(self) -> str:
        return str(self.dir)

    def start(self, run: TrackerRun) -> None:
        project = self.where.project_for(self.name)
        self.runs[run.key] = self.trackio.init(
            project=project,
            name=run.title,
            group=run.group,
            config=run.config,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )
        # trackio.init finishes the run it made before: each run stays open by leaving none current
        self.trackio.context_vars.current_run.set(None)
        last = self.storage.get_max_step_for_run(project, run.title)
        self.done_to[run.key] = -1 if last is None else int(last)

    def log(self, key: str | None, step: int, values: dict[str, float]) -> None:
        if step > self.done_to[key]:
            self.runs[key].log(values, step=step)

    def note(self, key: str | None, step: int, tag: str, text: str) -> None:
        if step > self.done_to[key]:
            self.runs[key].log({tag: text}, step=step)

    def add_config(self, key: str | None, step: int, config: dict[str, Any]) -> None:
        self.runs[key].config.update(config)

    def close(self) -> None:
        runs, self.runs = self.runs, {}
        for r in runs.values():
            r.finish()


BACKENDS: dict[str, type] = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": Wandb}
"""The backend class of each tracker."""
