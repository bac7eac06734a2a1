"""A loopback server answering the Hub's file and model endpoints, for tests that cannot reach the Hub.

``huggingface_hub`` (``HF_ENDPOINT`` pointed here) downloads from it exactly as from the Hub: model info
(``/api/models/<id>[/revision/<rev>]``), the file tree (``/api/models/<id>/tree/<rev>``) and files
(``HEAD`` / ``GET /<id>/resolve/<rev>/<path>``, with the commit and ETag headers its cache is keyed by), and
its errors as the Hub sends them (``X-Error-Code``: ``RepoNotFound``, ``GatedRepo``, ``RevisionNotFound``,
``EntryNotFound``). A repository is a folder of files; a gated one answers files only to a request that
carries the token ``HF_TOKEN`` holds. A dataset's repository is keyed ``"datasets/<org>/<name>"`` and answers
the same endpoints under ``/api/datasets/`` and ``/datasets/<id>/resolve/``, with the folder listing and
``paths-info`` that ``datasets.load_dataset`` asks for. Writes (``create_repo``, then ``upload_folder``'s pre-upload and commit,
every file a "regular" upload, its bytes in the commit) need that token too.

Hostile Hubs: a repository's ``cut`` files are sent half and the connection closed (a download cut short), and
its ``files`` may hold names no Hub gives (``../escape.json``), listed and served as they are. :class:`SilentHub`
accepts connections and never answers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    sha: str = field(default="")
    cut: frozenset[str] = frozenset()  # files whose download stops half-way (the connection closed)

    def __post_init__(self) -> None:
        if not self.sha:
            digest = hashlib.sha1(b"".join(k.encode() + v for k, v in sorted(self.files.items())))
            self.sha = digest.hexdigest()


def repo_from_folder(folder: str | Path, gated: bool = False) -> Repo:
    root = Path(folder)
    return Repo(
        {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}, gated
    )


class HubServer:
    """``with HubServer({"org/name": Repo(...)}, token="...") as hub:`` ... ``hub.url`` is the endpoint;
    ``hub.requests`` counts the file downloads (``GET`` of a file) per ``(repo, path)``."""

    def __init__(self, repos: dict[str, Repo], token: str = "hf_test_token") -> None:
        self.repos, self.token = repos, token
        self.requests: dict[tuple[str, str], int] = {}
        self.private: dict[str, bool] = {}  # repositories created here, and whether private
        self.commits: list[str] = []  # the repository of each commit
        self.calls = 0  # every request answered
        self.paths: list[str] = []  # every request's path, in order (what a client asked for)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # (quiet)
                pass

            def do_HEAD(self) -> None:
                server.answer(self, body=False)

            def do_GET(self) -> None:
                server.answer(self, body=True)

            def do_POST(self) -> None:
                server.write(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- writes: a repository created, a commit of small files ("regular" uploads, base64 in the commit) ------

    def write(self, h: BaseHTTPRequestHandler) -> None:
        parts = [unquote(p) for p in urlparse(h.path).path.strip("/").split("/")]
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        self.paths.append("POST " + "/".join(parts))
        if (
            parts[:2] in (["api", "models"], ["api", "datasets"])
            and len(parts) >= 6
            and parts[4] == "paths-info"
        ):
            repo_id = ("datasets/" if parts[1] == "datasets" else "") + "/".join(parts[2:4])
            repo = self._repo(h, repo_id, files=False)
            if repo is not None and self._revision(h, repo, parts[5]):
                self.paths_info(h, repo, body)
            return
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 401, "", "Invalid credentials in Authorization header")
            return
        if parts == ["api", "repos", "create"]:
            ask = json.loads(body)
            repo_id = f"{ask['organization']}/{ask['name']}" if ask.get("organization") else ask["name"]
            if repo_id in self.repos:
                self._error(h, 409, "", "You already created this model repo")
                return
            self.repos[repo_id] = Repo({}, sha=hashlib.sha1(repo_id.encode()).hexdigest())
            # (huggingface_hub 2.x sends "visibility"; 1.x sent "private")
            self.private[repo_id] = ask.get("visibility") == "private" or bool(ask.get("private"))
            self._json(h, {"url": f"{self.url}/{repo_id}", "name": repo_id}, True)
            return
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("preupload", "commit"):
            repo = self.repos.get("/".join(parts[2:4]))
            if repo is None:
                self._error(h, 404, "RepoNotFound", "Repository not found")
                return
            if parts[4] == "preupload":
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                self._json(h, {"files": modes}, True)
                return
            for line in body.decode().splitlines():
                entry = json.loads(line)
                if entry["key"] == "file":
                    repo.files[entry["value"]["path"]] = base64.b64decode(entry["value"]["content"])
                elif entry["key"] == "deletedFile":
                    repo.files.pop(entry["value"]["path"], None)
            repo.sha = hashlib.sha1(
                b"".join(k.encode() + v for k, v in sorted(repo.files.items()))
            ).hexdigest()
            self.commits.append("/".join(parts[2:4]))
            self._json(
                h,
                {"commitUrl": f"{self.url}/{parts[2]}/{parts[3]}/commit/{repo.sha}", "commitOid": repo.sha},
                True,
            )
            return
        self._error(h, 404, "", "not found")

    # -- answers ------------------------------------------------------------------------------------------

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        self.calls += 1
        parts = [unquote(p) for p in urlparse(h.path).path.strip("/").split("/")]
        self.paths.append("/".join(parts))
        prefix = ""  # a dataset's repository is keyed "datasets/<id>" in ``repos``
        if parts[:1] == ["datasets"] or parts[:2] == ["api", "datasets"]:
            prefix = "datasets/"
            parts = parts[1:] if parts[0] == "datasets" else ["api", "models", *parts[2:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = prefix + "/".join(parts[2:4]), parts[4:]
            repo = self._repo(h, repo_id, files=False)
            if repo is None:
                return
            if rest[:1] == ["auth-check"]:
                if self._repo(h, repo_id, files=True) is not None:
                    self._json(h, {}, body)
                return
            if rest[:1] == ["tree"]:
                if self._revision(h, repo, rest[1] if len(rest) > 1 else "main"):
                    under = "/".join(rest[2:])
                    self._json(h, self._tree(repo, under), body)
                return
            revision = rest[1] if rest[:1] == ["revision"] and len(rest) > 1 else "main"
            if self._revision(h, repo, revision):
                info = {
                    "id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                    "gated": "manual" if repo.gated else False,
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                }  # fmt: skip
                self._json(h, info, body)
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, path = prefix + "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self._repo(h, repo_id, files=True)
            if repo is None or not self._revision(h, repo, revision):
                return
            if path not in repo.files:
                self._error(h, 404, "EntryNotFound", f"{path} does not exist")
                return
            data = repo.files[path]
            h.send_response(200)
            h.send_header("X-Repo-Commit", repo.sha)
            h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            h.send_header("Content-Length", str(len(data)))
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            if body:
                self.requests[(repo_id, path)] = self.requests.get((repo_id, path), 0) + 1
                if path in repo.cut:  # half of it, then the connection ends
                    h.wfile.write(data[: len(data) // 2])
                    h.wfile.flush()
                    h.close_connection = True
                    return
                h.wfile.write(data)
            return
        self._error(h, 404, "", "not found")

    @staticmethod
    def _tree(repo: Repo, under: str) -> list[dict]:
        """The files and folders at ``under`` and below it (as the Hub lists a tree ``recursive=True``)."""
        out, folders = [], set()
        for path, data in sorted(repo.files.items()):
            if under and not path.startswith(under + "/"):
                continue
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            while parent and parent != under and parent not in folders:
                folders.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
            out.append(
                {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}
            )
        out += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                for d in sorted(folders)]  # fmt: skip
        return out

    def paths_info(self, h: BaseHTTPRequestHandler, repo: Repo, body: bytes) -> None:
        """``POST /api/<kind>/<id>/paths-info/<rev>``: each asked path, a file or a folder."""
        from urllib.parse import parse_qs

        asked = parse_qs(body.decode()).get("paths", []) if body else []
        if body.startswith(b"{"):
            asked = json.loads(body).get("paths", [])
        out = []
        for p in asked:
            if p in repo.files:
                data = repo.files[p]
                out.append(
                    {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": p}
                )
            elif any(f.startswith(p.rstrip("/") + "/") for f in repo.files) or p in ("", "."):
                out.append(
                    {"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0, "path": p}
                )
        self._json(h, out, True)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, files: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", "Repository not found")
            return None
        if files and repo.gated and h.headers.get("Authorization") != f"Bearer {self.token}":
            self._error(h, 403, "GatedRepo", "Access to model is restricted")
            return None
        return repo

    def _revision(self, h: BaseHTTPRequestHandler, repo: Repo, revision: str) -> bool:
        if revision in ("main", repo.sha):
            return True
        self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return False

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj: object, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


class SilentHub:
    """``with SilentHub() as hub:`` ... ``hub.url``: a server that accepts every connection and never answers
    (a Hub behind a stalled proxy); ``hub.connections`` counts those accepted."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []

    @property
    def connections(self) -> int:
        return len(self.held)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # (closed: the block ended)
                return
            self.held.append(conn)

    def __enter__(self) -> SilentHub:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def closed_port() -> str:
    """The URL of a loopback port nothing listens on (a Hub that cannot be reached: connections refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
