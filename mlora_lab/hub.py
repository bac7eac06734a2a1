"""Hub ids: a base model, tokenizer or init adapter named ``org/name``, read through ``huggingface_hub``'s cache.

A value is a Hub id when it has that shape and no local path of that name exists (a local directory of the
same name wins, as in transformers). Where it is used:

- **validation** (the notebook's process, before anything starts) downloads it (:func:`fetch`): a first request
  (the repo's information, at most :data:`TIMEOUT_S` seconds) tells the cases apart, each with its own answer
  naming the id: not on the Hub (or private), gated (accept its terms, then log in or set ``HF_TOKEN``), a
  revision it does not have, a file name that would leave the repository, or the Hub unreachable (or silent)
  and the id not in the cache, with the ways out. Then the whole snapshot is downloaded, once, with
  ``huggingface_hub``'s progress bars, into its cache (``HF_HOME`` / ``HF_HUB_CACHE``; ``HF_TOKEN`` or a login
  for gated models; ``HF_ENDPOINT`` for another server). Every request waits at most :data:`TIMEOUT_S` seconds
  for an answer and none is retried once unanswered (:func:`bounded_waits`): huggingface_hub's own defaults
  held validation for 400 s on a Hub that never answered, and for 24 s of retry warnings on one that could not
  be reached. A download cut short is one answer naming the id too;
- **the job** (every rank and node) reads that snapshot with :func:`local`, never the network: the commit
  the notebook downloaded is what the run records (``JobSpec.revision``), so every process reads the same.

Adapters record the id as their ``base_model_name_or_path``, so PEFT and vLLM load them by name.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlora_lab.text import brief, error_line

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
"""``org/name`` as the Hub spells repository ids."""
COMMIT = re.compile(r"[0-9a-f]{40}")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]
"""What a model's snapshot needs (config, weights, tokenizer): not the duplicate formats (``*.bin``, ONNX,
GGUF, Flax) a repository may also hold."""
ADAPTER_FILES = ["*.json", "*.safetensors"]  # (within MODEL_FILES: :func:`local` reads either with those)
TIMEOUT_S = 10.0
"""How long a request to the Hub waits for an answer (to connect, and for each next piece of it: a download of any
size goes on while bytes flow) before the Hub counts as silent (:func:`bounded_waits`)."""
REAL_MODEL_HINT = (
    "or train on the SmolLM2-135M-Instruct this package ships, which needs no Hub "
    "(`from mlora_lab.lab.demo import real_base_model`; `base_model, _ = real_base_model()`)"
)


def is_hub_id(value: object) -> bool:
    """Whether ``value`` names a Hub repository: ``org/name``, and no local path of that name."""
    return (
        isinstance(value, str) and HUB_ID.fullmatch(value) is not None and ".." not in value
        and not os.path.exists(value)
    )  # fmt: skip


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


class HubUnanswered(Exception):
    """A request to the Hub sent again after it went unanswered: refused inside :func:`bounded_waits` rather
    than retried with back-off. ``silent``: the first try waited its whole timeout (else it was refused)."""

    def __init__(self, what: str, silent: bool) -> None:
        super().__init__(f"{what}: {'no answer' if silent else 'refused'}")
        self.silent = silent


@contextlib.contextmanager
def bounded_waits(seconds: float | None = None) -> Iterator[None]:
    """Inside the block, every request ``huggingface_hub`` makes (and ``datasets`` through it) waits at most
    ``seconds`` (default :data:`TIMEOUT_S`) for the Hub, to connect and for each next piece of the answer, and a
    request that went unanswered is not sent again: its second try raises :class:`HubUnanswered` at once.

    Why: huggingface_hub's API calls wait forever by default, and a file whose first request went unanswered is
    asked again with a 60 s timeout and five back-off retries (a Hub that never answered held a launch for
    400 s; one that could not be reached printed 24 s of retry warnings). A download cut short, whose answer
    began, may still resume. The clamp goes on every client huggingface_hub makes while the block runs (one
    that fails to connect is closed and made again), through its client factory; the factory in force before
    (the user's own, say with a proxy) makes them, and is put back afterwards."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    limit = TIMEOUT_S if seconds is None else seconds
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    lock = threading.Lock()
    waiting: dict[tuple[str, str], float] = {}  # (method, url) of requests sent, not answered -> when sent

    def clamp(request: Any) -> None:
        key = (request.method, str(request.url))
        with lock:
            if key in waiting:
                silent = time.monotonic() - waiting[key] >= 0.9 * limit
                raise HubUnanswered(f"{request.method} {request.url}", silent)
            waiting[key] = time.monotonic()
        given = request.extensions.get("timeout") or {}
        timeouts = {k: limit if given.get(k) is None else min(given[k], limit) for k in
                    ("connect", "read", "write", "pool")}  # fmt: skip
        request.extensions = {**request.extensions, "timeout": timeouts}

    def answered(response: Any) -> None:
        with lock:
            waiting.pop((response.request.method, str(response.request.url)), None)

    def factory() -> Any:
        client = previous()
        client.event_hooks = {
            "request": [*client.event_hooks["request"], clamp],
            "response": [*client.event_hooks["response"], answered],
        }
        return client

    set_client_factory(factory)
    try:
        yield
    finally:
        set_client_factory(previous)


def revision_problem(revision: object) -> str | None:
    """Why ``revision`` cannot name a branch, tag or commit (None when it can, or is None: ``main``)."""
    if revision is None:
        return None
    if not isinstance(revision, str):
        return f"must be a string (got {type(revision).__name__})"
    if not revision.strip():
        return "is empty (null means the main branch)"
    if (
        len(revision) > 256
        or not revision.isprintable()
        or any(c.isspace() or c in "\\^~:?*[" for c in revision)
    ):
        return "is no branch, tag or commit name (it holds a space, a line break or another character Git refuses)"
    if ".." in revision or revision.startswith("/") or revision.endswith(("/", ".")):
        return "is no branch, tag or commit name"
    return None


def unsafe_file_name(name: str) -> bool:
    """Whether a file name a Hub lists would lead out of the snapshot folder (``../x``, ``/etc/x``, a
    backslash, an empty or NUL part): no Hub gives such a name, and none is downloaded."""
    parts = name.split("/")
    return (
        not name or "\\" in name or "\0" in name or name.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
    )  # fmt: skip


def endpoint() -> str:
    """The Hub server asked (``HF_ENDPOINT``, as huggingface_hub reads it)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def ways_out(model: bool = True) -> str:
    """What to do when the Hub cannot give an id and the cache does not hold it (``model``: a base model, which
    the SmolLM2 this package ships can stand in for)."""
    offline_way = (
        "download it once where the Hub answers (HF_HUB_OFFLINE unset), then set HF_HUB_OFFLINE=1 with HF_HOME "
        "at that cache"
    )
    return f"{offline_way}, {REAL_MODEL_HINT}" if model else offline_way


def fetch(repo_id: str, revision: str | None = None, adapter: bool = False) -> tuple[Path | None, str | None]:
    """Download ``repo_id`` at ``revision`` into the Hub cache (nothing when it is there already, or
    offline): ``(snapshot directory, None)``, or ``(None, why not)`` naming the id (see the module
    docstring). ``adapter``: a PEFT adapter repository rather than a model. Never raises for what the Hub
    (or the network) does: every request is bounded (:func:`bounded_waits`)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" (revision {brief(revision)})" if revision else "")
    if (why := revision_problem(revision)) is not None:
        return None, f"{repo_id}: revision {brief(revision)} {why}"
    first = "adapter_config.json" if adapter else "config.json"
    patterns = ADAPTER_FILES if adapter else MODEL_FILES
    if offline():
        if (cached := _cached(repo_id, revision, first, patterns)) is not None:
            return cached, None
        return None, (
            f"{where} is not in the Hub cache ({cache_dir()}) and HF_HUB_OFFLINE is set: nothing can be "
            f"downloaded; {ways_out(model=not adapter)}"
        )
    try:
        with bounded_waits():
            try:  # one request first: what it raises tells the cases apart, in TIMEOUT_S at most
                info = HfApi().model_info(repo_id, revision=revision, timeout=TIMEOUT_S)
            except Exception as e:
                if not unanswered(e):
                    raise
                # what huggingface_hub would fall back to, without its retries
                if (cached := _cached(repo_id, revision, first, patterns)) is not None:
                    return cached, None
                why = f"{where} is not in the Hub cache ({cache_dir()}) and {silence(e)}"
                return None, f"{why}; {ways_out(model=not adapter)}"
            bad = [s.rfilename for s in info.siblings or () if unsafe_file_name(s.rfilename)]
            if bad:
                return None, (
                    f"{where}: the Hub lists file names that lead out of the repository "
                    f"({', '.join(brief(n, 60) for n in bad[:3])}); nothing was downloaded"
                )
            hf_hub_download(repo_id, first, revision=revision, etag_timeout=TIMEOUT_S)
            path = snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, etag_timeout=TIMEOUT_S
            )
    except GatedRepoError:
        return None, (
            f"{where} is a gated model on the Hub: accept its terms on its page, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        )
    except RevisionNotFoundError:
        return None, f"{repo_id} has no revision {brief(revision)} on the Hub"
    except RepositoryNotFoundError:
        return None, (
            f"{where} is not on the Hub (if it is private: log in with `hf auth login` or set HF_TOKEN); "
            "no local directory of that name either"
        )
    except LocalEntryNotFoundError as e:  # (an EntryNotFoundError too: first) the Hub stopped answering
        return None, f"{where} could not be downloaded: {silence(e)}"
    except EntryNotFoundError:
        return None, f"{where} has no {first}: not a {'PEFT adapter' if adapter else 'transformers model'}"
    except HfHubHTTPError as e:
        return None, f"{where} could not be downloaded: the Hub answered {error_line(e, 200)}"
    except Exception as e:
        if unanswered(e):
            return None, f"{where} could not be downloaded: {silence(e)}"
        if _cut_short(e):
            return None, (
                f"{where} could not be downloaded: the download was cut short ({error_line(e, 200)}); "
                "nothing of it is used (try again)"
            )
        return None, f"{where} could not be downloaded ({type(e).__name__}: {error_line(e, 200)})"
    return Path(path), None


def _cached(repo_id: str, revision: str | None, first: str, patterns: list[str]) -> Path | None:
    """The snapshot the cache holds of ``repo_id`` at ``revision`` (with its ``first`` file), asking no one."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        hf_hub_download(repo_id, first, revision=revision, local_files_only=True)
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True)
        )
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _kinds(e: BaseException) -> set[str]:
    """The names of ``e``'s classes: huggingface_hub raises its HTTP library's errors (httpx's, or httpx2's
    from huggingface_hub 2), which are told apart by name rather than imported."""
    return {c.__name__ for c in type(e).__mro__}


UNANSWERED = {"ConnectError", "TimeoutException", "ConnectionError", "Timeout", "OfflineModeIsEnabled",
              "LocalEntryNotFoundError"}  # fmt: skip
"""The classes (by name) of what huggingface_hub, its HTTP library and ``datasets`` raise when the Hub did not
answer: httpx's and httpx2's errors, and what ``datasets`` raises in their stead or when nothing is cached."""


def unanswered(e: BaseException) -> bool:
    """Whether ``e`` (raised by huggingface_hub or ``datasets`` inside :func:`bounded_waits`) says the Hub did
    not answer (refused, unreachable, silent), rather than what it answered."""
    return isinstance(e, HubUnanswered) or bool(_kinds(e) & UNANSWERED)


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` (:func:`unanswered`) is a Hub that stayed silent for the whole timeout (not one refused)."""
    return "TimeoutException" in _kinds(e) or (isinstance(e, HubUnanswered) and e.silent)


def silence(e: BaseException) -> str:
    """``e`` (:func:`unanswered`) in words: "the Hub (its URL) did not answer within 10 s", or "the Hub cannot be
    reached (...)"."""
    if timed_out(e):
        return f"the Hub ({endpoint()}) did not answer within {TIMEOUT_S:g} s"
    return f"the Hub cannot be reached ({endpoint()}: {error_line(e, 120)})"


def _cut_short(e: BaseException) -> bool:
    """Whether ``e`` says a download ended before its end (the connection closed, a size that disagrees)."""
    # (huggingface_hub resumes a cut download a few times, then raises the transport's error; a file that ends
    # at another size than announced is its "Consistency check failed")
    return bool(_kinds(e) & {"RemoteProtocolError", "ReadError"}) or (
        isinstance(e, OSError) and "Consistency check failed" in str(e)
    )


def local(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of ``repo_id`` at ``revision`` (a commit, branch or tag), with no network: what the
    job's processes read. ``FileNotFoundError`` naming the id when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        # (the patterns fetch() downloaded: a repository's other files, a README, are not in the cache)
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES, local_files_only=True)
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{repo_id}" + (f" (revision {revision})" if revision else "") + f" is not in the Hub cache "
            f"({cache_dir()}): validation downloads it before a job starts (ml.launch, mlora-lab run)"
        ) from None


def resolve(value: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory for ``value``: itself, or the cached snapshot of a Hub id (:func:`local`)."""
    if is_hub_id(value):
        return local(str(value), revision)
    return Path(os.fspath(value))


def commit_of(snapshot: Path) -> str | None:
    """The commit a snapshot directory of the cache holds (its name), if it is one."""
    return snapshot.name if COMMIT.fullmatch(snapshot.name) else None
