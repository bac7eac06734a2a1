"""A loopback OpenAI-compatible chat endpoint for the judge tests (:class:`mlora_lab.evals.metrics.Judge`,
:class:`~mlora_lab.evals.metrics.WinRate`): it answers every request with ``status`` and ``body`` (set by the
test, as a misbehaving judge server would), or, given ``reply``, with a chat completion whose content is
``reply(the request's user message)`` (a scripted judge). It keeps every message it was asked."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable


class JudgeServer:
    def __init__(self) -> None:
        self.status, self.body = 200, b""
        self.reply: Callable[[str], str] | None = None
        self.asked: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = server.body
                if server.reply is not None:
                    text = json.loads(raw)["messages"][-1]["content"]
                    server.asked.append(text)
                    body = json.dumps({"choices": [{"message": {"content": server.reply(text)}}]}).encode()
                self.send_response(server.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join()
