"""API keys of the service: name -> key, checked in constant time, kept owner-only on disk.

A key is ``"tml-" + secrets.token_urlsafe(32)`` (the SDK refuses keys without the ``tml-`` prefix). The
file is JSON ``{"keys": {name: key}}``, written atomically (a temporary file in the same folder, 0600, then
renamed over the old one): its format lives in :mod:`mlora_lab.rundir.service`. :meth:`Keys.who` re-reads the file when it changed on disk, so a notebook adds
or revokes a key by rewriting it (or with :meth:`Keys.add` / :meth:`Keys.revoke` in any process).
"""

from __future__ import annotations

import contextlib
import hmac
import threading
from pathlib import Path

from mlora_lab.rundir.service import KEY_PREFIX as PREFIX
from mlora_lab.rundir.service import new_key, read_keys, write_keys

__all__ = ["PREFIX", "Keys", "new_key"]


class Keys:
    """The keys one service accepts, by name (a name owns what its key creates)."""

    def __init__(self, keys: dict[str, str] | None = None, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._keys: dict[str, str] = dict(keys or {})
        self._stamp: tuple[int, int] | None = None
        if self.path is not None and self.path.exists():
            self._load()

    @classmethod
    def load(cls, path: str | Path) -> Keys:
        return cls(path=path)

    def names(self) -> list[str]:
        self._reload_if_changed()
        with self._lock:
            return sorted(self._keys)

    def key(self, name: str) -> str:
        self._reload_if_changed()
        with self._lock:
            return self._keys[name]

    def add(self, name: str, key: str | None = None) -> str:
        """A new key for ``name`` (replacing its old one); saved at once when the keys have a file."""
        if not name or not isinstance(name, str):
            raise ValueError("a key's name is a non-empty string")
        key = key or new_key()
        if not key.startswith(PREFIX):
            raise ValueError(f"a key starts with {PREFIX!r} (the SDK refuses others)")
        self._reload_if_changed()
        with self._lock:
            self._keys[name] = key
            self._save_locked()
        return key

    def revoke(self, name: str) -> bool:
        """Forget ``name``'s key; False when it had none."""
        self._reload_if_changed()
        with self._lock:
            found = self._keys.pop(name, None) is not None
            if found:
                self._save_locked()
        return found

    def who(self, key: str | None) -> str | None:
        """The name whose key ``key`` is, or None. Every stored key is compared, each in constant time."""
        if not key:
            return None
        self._reload_if_changed()
        given = key.encode()
        found = None
        with self._lock:
            for name, known in self._keys.items():
                if hmac.compare_digest(given, known.encode()):
                    found = name
        return found

    def save(self, path: str | Path | None = None) -> None:
        if path is not None:
            self.path = Path(path)
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        if self.path is None:
            return
        # owner-only, written atomically through the run directory's guarded writer (no link is followed)
        write_keys(self.path, self._keys)
        self._stamp = _stamp(self.path)

    def _load(self) -> None:
        assert self.path is not None
        stamp = _stamp(self.path)
        self._keys = read_keys(self.path)
        self._stamp = stamp

    def _reload_if_changed(self) -> None:
        if self.path is None:
            return
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp is None:  # the file is gone: no key is valid any more
                self._keys, self._stamp = {}, None
                return
            with contextlib.suppress(OSError, ValueError):  # half-written by hand: keep the last good keys
                self._load()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    # (an atomic rewrite is a new inode: seen even within the filesystem's mtime granularity at equal size)
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
