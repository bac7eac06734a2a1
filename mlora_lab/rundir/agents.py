"""Where a job's harness tenants (``rl.harness``) are played from: ``<run_dir>/agents.json``.

```
<run_dir>/agents.json    {tenant: {"base_url": "http://127.0.0.1:PORT/v1", "api_key": "..."}}: the job's own
                         agents' endpoint and each harness tenant's private key, owner-only (0600); written by
                         rank 0 whole, atomically, when a harness tenant is first registered at the endpoint
                         (its first generation), rewritten with each new one, removed when the endpoint
                         stops
```

The job side (the RL driver) writes it through :func:`write_agents`; the notebook side
(:mod:`mlora_lab.lab.runs.agents`) reads it through :func:`read_agents`. Only harness tenants' keys are in it:
an env tenant's key is given to its env worker alone.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from mlora_lab.rundir.files import RunDir, RunDirError, atomic_write_bytes
from mlora_lab.text import read_json

AGENTS_MODE = 0o600


@dataclass(frozen=True)
class HarnessEndpoint:
    """A harness tenant's endpoint: the OpenAI base URL (ending in ``/v1``) and its key."""

    base_url: str
    api_key: str


def agents_path(run: RunDir) -> Path:
    return run.root / "agents.json"


def write_agents(run: RunDir, base_url: str, keys: dict[str, str]) -> None:
    """``{tenant: {"base_url", "api_key"}}`` for ``keys`` (tenant -> key), atomically, owner-only."""
    body = {name: {"base_url": base_url, "api_key": key} for name, key in sorted(keys.items())}
    atomic_write_bytes(agents_path(run), json.dumps(body, indent=1).encode(), mode=AGENTS_MODE, root=run.root)


def remove_agents(run: RunDir) -> None:
    """The endpoint stopped: no file (nothing happens when there is none)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(run.inside(agents_path(run)))


def read_agents(run: RunDir) -> dict[str, HarnessEndpoint] | None:
    """The harness tenants' endpoints the job wrote, or ``None`` while there is no file;
    :class:`~mlora_lab.rundir.files.RunDirError` when it is not an agents file."""
    path = agents_path(run)
    value, why = read_json(str(path), "an agents file")
    if why == "not found":
        return None
    entries = value if isinstance(value, dict) else None
    if why is None and entries is not None:
        out = {}
        for name, e in entries.items():
            url, key = (e.get("base_url"), e.get("api_key")) if isinstance(e, dict) else (None, None)
            if not (isinstance(url, str) and isinstance(key, str)):
                break
            out[name] = HarnessEndpoint(url, key)
        else:
            return out
    raise RunDirError(f"{path}: not an agents file ({why or 'expected {tenant: {base_url, api_key}}'})")
