"""Hub ids: a base model, tokenizer or init adapter named ``org/name``, read through ``huggingface_hub``'s cache.

A value is a Hub id when it has that shape and no local path of that name exists (a local directory of the
same name wins, as in transformers). Where it is used:

- **validation** (the notebook's process, before anything starts) downloads it (:func:`fetch`): a first request
  (the repo's ``config.json``, or ``adapter_config.json``) tells the three cases apart, each with its own
  answer naming the id: not on the Hub (or private), gated (accept its terms, then log in or set
  ``HF_TOKEN``), or offline (``HF_HUB_OFFLINE``, or the Hub unreachable) and not in the cache. Then the
  whole snapshot is downloaded, once, with ``huggingface_hub``'s progress bars, into its cache
  (``HF_HOME`` / ``HF_HUB_CACHE``; ``HF_TOKEN`` or a login for gated models; ``HF_ENDPOINT`` for another
  server);
- **the job** (every rank and node) reads that snapshot with :func:`local`, never the network: the commit
  the notebook downloaded is what the run records (``JobSpec.revision``), so every process reads the same.

Adapters record the id as their ``base_model_name_or_path``, so PEFT and vLLM load them by name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
"""``org/name`` as the Hub spells repository ids."""
COMMIT = re.compile(r"[0-9a-f]{40}")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]
"""What a model's snapshot needs (config, weights, tokenizer): not the duplicate formats (``*.bin``, ONNX,
GGUF, Flax) a repository may also hold."""
ADAPTER_FILES = ["*.json", "*.safetensors"]  # (within MODEL_FILES: :func:`local` reads either with those)


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


def fetch(repo_id: str, revision: str | None = None, adapter: bool = False) -> tuple[Path | None, str | None]:
    """Download ``repo_id`` at ``revision`` into the Hub cache (nothing when it is there already, or
    offline): ``(snapshot directory, None)``, or ``(None, why not)`` naming the id (see the module
    docstring). ``adapter``: a PEFT adapter repository rather than a model."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    first = "adapter_config.json" if adapter else "config.json"
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        hf_hub_download(repo_id, first, revision=revision, local_files_only=offline())
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ADAPTER_FILES if adapter else MODEL_FILES,
            local_files_only=offline(),
        )
    except GatedRepoError:
        return None, (
            f"{where} is a gated model on the Hub: accept its terms on its page, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        )
    except RevisionNotFoundError:
        return None, f"{repo_id} has no revision {revision!r} on the Hub"
    except RepositoryNotFoundError:
        return None, (
            f"{where} is not on the Hub (if it is private: log in with `hf auth login` or set HF_TOKEN); "
            "no local directory of that name either"
        )
    except LocalEntryNotFoundError:  # (an EntryNotFoundError too: first)
        reason = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
        return (
            None,
            f"{where} is not in the Hub cache ({cache_dir()}) and {reason}: nothing can be downloaded",
        )
    except EntryNotFoundError:
        return None, f"{where} has no {first}: not a {'PEFT adapter' if adapter else 'transformers model'}"
    return Path(path), None


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
