"""The service's shared state: its clients' sessions, sampling sessions and models, and the inbox and
futures between the HTTP thread (:mod:`mlora_lab.service.app`, whose routes read and write it) and the
training loop (:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`, which takes the work and settles the futures).
Both take :attr:`ServiceState.lock` to touch it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlora_lab.service import wire
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.keys import Keys
from mlora_lab.service.work import Futures, Inbox

MAX_SAMPLING_SESSIONS = 1024
"""Sampling sessions one session keeps: past it, the least recently used one is forgotten (sampling from it
then fails saying so). An RL loop that names a snapshot a step and samples it through a new sampling client
makes one a step; it only ever uses the latest few."""


@dataclass
class Session:
    """A client's session: it owns the models and sampling sessions it creates."""

    owner: str
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    """When the session last showed life (a heartbeat or any request naming it)."""
    model_ids: list[str] = field(default_factory=list)
    finished: bool = False
    user_metadata: dict[str, str] = field(default_factory=dict)
    """What the client said of itself (the SDK's ``ServiceClient(user_metadata=...)``): ``name`` names its
    models' tenants."""
    sampling_ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Its sampling sessions, least recently used first (at most :data:`MAX_SAMPLING_SESSIONS`)."""


@dataclass
class SamplingSession:
    """What a sampling session samples from: ``model_path`` (a sampler snapshot) or the base model."""

    owner: str
    base_model: str
    model_path: str | None = None
    model_id: str | None = None
    """The training model it was saved from (``save_weights_and_get_sampling_client``), if any."""
    created: float = field(default_factory=time.time)


@dataclass
class ServiceState:
    """Everything the routes read and write; shared with the training loop (take :attr:`lock`)."""

    inbox: Inbox
    futures: Futures
    keys: Keys
    base_model: str
    """The model name clients pass (``create_lora_training_client(base_model)``)."""
    limits: wire.Limits
    max_rank: int = 64
    tokenizer_id: str | None = None
    """What ``get_info`` names as the tokenizer (a local directory works); defaults to ``base_model``."""
    models: dict[str, ModelInfo] = field(default_factory=dict)
    """Filled by the training loop once a model exists."""
    sessions: dict[str, Session] = field(default_factory=dict)
    sampling_sessions: dict[str, SamplingSession] = field(default_factory=dict)
    max_body_bytes: int = 8 << 20
    poll_s: float = 40.0
    """How long ``retrieve_future`` holds a request before answering ``try_again`` (the SDK's read timeout is
    45 s): a long step or generation is one quiet poll, not a dozen. ``try_again`` comes as a 408 with the
    body the SDK reads (its "try_again pretending to be an HTTP error", as the hosted service answers),
    which the SDK retries without printing "Retrying request ... because of try_again"."""
    client_config: dict[str, Any] = field(default_factory=lambda: {"use_pyqwest_transport": False})
    """The answer to ``client/config`` (e.g. ``fwdbwd_max_chunk_len``, the datums per request)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    creating: dict[str, str] = field(default_factory=dict)
    """model_id -> the request id of its create (a resent create_model gets the same future)."""
    checkpoints: Path | None = None
    tokenizer: Any = None
    """The job's tokenizer (the OpenAI endpoint encodes prompts and decodes completions with it)."""
    tenant_names: list[str] = field(default_factory=list)
    """The tenants holding a slot (the OpenAI endpoint's models), as the training loop last saw them."""
    snapshot_paths: list[str] = field(default_factory=list)
    """The named sampler snapshots (``tinker://…``) the loop holds: models the OpenAI endpoint lists."""
    """The service folder its saved checkpoints live in (``<run_dir>/service``; None: it saves none)."""
    future_owners: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)
    """request_id -> (the key name that asked, when), oldest first: only its owner may retrieve a future."""

    def restore_model(self, info: ModelInfo, next_seq_id: int, alive: bool) -> None:
        """A model a resumed job brought back: registered under its id and owner, its requests taken from
        ``next_seq_id`` on, its session watched again (``alive``: as if it had just been heard from, so its
        client has the session timeout to come back; else as long silent)."""
        session_id = info.model_id.split(":train:")[0]
        with self.lock:
            self.models[info.model_id] = info
            session = self.sessions.setdefault(session_id, Session(owner=info.owner, last_seen=0.0))
            if info.model_id not in session.model_ids:
                session.model_ids.append(info.model_id)
            if alive:
                session.last_seen = time.time()
        self.inbox.start_model(info.model_id, next_seq_id)

    def registry(self, snapshots: Collection[str]) -> dict[str, Any]:
        """The clients' sessions and sampling sessions, for the job's checkpoints (with the snapshots, see
        :mod:`mlora_lab.job.drivers.tinker.snapshots`): ``sessions`` (id -> owner, model ids, finished) and
        ``sampling_sessions`` (id -> owner, and the snapshot path or training model it samples). A sampling
        session of an unnamed save is kept only while its snapshot is (its id in ``snapshots``): a model
        keeps the few most recent, and an RL loop makes one a step."""
        with self.lock:
            sessions = {
                sid: {
                    "owner": s.owner,
                    "model_ids": list(s.model_ids),
                    "finished": s.finished,
                    "user_metadata": dict(s.user_metadata),
                }
                for sid, s in self.sessions.items()
            }
            sampling = {
                sid: {"owner": s.owner, "model_path": s.model_path, "model_id": s.model_id}
                for sid, s in self.sampling_sessions.items()
                if s.model_id is None or sid in snapshots
            }
        return {"sessions": sessions, "sampling_sessions": sampling}

    def restore_registry(self, saved: Mapping[str, Any]) -> int:
        """Take back what :meth:`registry` kept (a resumed job: its clients' sessions and sampling sessions go
        on). A session with models counts as long silent until :meth:`restore_model` says otherwise; one
        with none as just heard from. An entry of the wrong shape is left out; how many were."""
        left_out = 0
        now = time.time()
        with self.lock:
            for sid, s in _entries(saved, "sessions"):
                try:
                    models = [str(m) for m in s["model_ids"]]
                    session = Session(str(s["owner"]), last_seen=0.0 if models else now, model_ids=models)
                    session.finished = bool(s["finished"])
                    meta = s.get("user_metadata") or {}
                    session.user_metadata = {str(k): str(v) for k, v in meta.items()}
                except (KeyError, TypeError):
                    left_out += 1
                    continue
                self.sessions.setdefault(str(sid), session)
            for sid, s in _entries(saved, "sampling_sessions"):
                try:
                    path, model = s["model_path"], s["model_id"]
                    entry = SamplingSession(
                        str(s["owner"]),
                        self.base_model,
                        model_path=None if path is None else str(path),
                        model_id=None if model is None else str(model),
                    )
                except (KeyError, TypeError):
                    left_out += 1
                    continue
                if str(sid) not in self.sampling_sessions:
                    self.add_sampling_session(str(sid), entry)
        return left_out

    def add_sampling_session(self, sampling_id: str, entry: SamplingSession) -> None:
        """Register (or renew) ``sampling_id`` (``<session>:sample:<n>``) as its session's most recent;
        past :data:`MAX_SAMPLING_SESSIONS` the session's least recently used one is forgotten."""
        session_id = sampling_id.split(":sample:")[0]
        with self.lock:
            session = self.sessions.get(session_id)
            if session is None:  # (a model's session that had expired: it shows life again)
                session = self.sessions[session_id] = Session(entry.owner)
            self.sampling_sessions[sampling_id] = entry
            session.sampling_ids[sampling_id] = None
            session.sampling_ids.move_to_end(sampling_id)
            while len(session.sampling_ids) > MAX_SAMPLING_SESSIONS:
                old, _ = session.sampling_ids.popitem(last=False)
                self.sampling_sessions.pop(old, None)

    def used_sampling_session(self, sampling_id: str) -> None:
        """``sampling_id`` was sampled from: the most recently used of its session."""
        with self.lock:
            session = self.sessions.get(sampling_id.split(":sample:")[0])
            if session is not None and sampling_id in session.sampling_ids:
                session.sampling_ids.move_to_end(sampling_id)

    def expire_sessions(self, now: float, timeout_s: float) -> list[str]:
        """Forget the sessions that made no model and are over: finished, or silent for ``timeout_s``
        (their sampling sessions go with them, and so they leave the job's checkpoints). A session that
        made models stays while they do (its models' tenants are the job's: paused when it goes silent,
        running again when it shows life, and a finished one answers 410). The ids forgotten."""
        with self.lock:
            gone = [
                sid
                for sid, s in self.sessions.items()
                if not s.model_ids and (s.finished or now - s.last_seen > timeout_s)
            ]
            for sid in gone:
                session = self.sessions.pop(sid)
                for sampling_id in session.sampling_ids:
                    self.sampling_sessions.pop(sampling_id, None)
        return gone

    def owns_run(self, owner: str, run_id: str) -> bool:
        """Whether ``run_id`` (a model id, the first part of a ``tinker://`` path) is ``owner``'s."""
        with self.lock:
            model = self.models.get(run_id)
            if model is not None:
                return model.owner == owner
            session = self.sessions.get(run_id.split(":train:")[0])
            return session is not None and session.owner == owner and run_id in session.model_ids


def _entries(saved: Mapping[str, Any], key: str) -> list[tuple[Any, Any]]:
    """The (id, entry) pairs of ``saved[key]`` (none when it is not an object)."""
    value = saved.get(key)
    return list(value.items()) if isinstance(value, dict) else []
