"""A request's JSON body, read the same way by both sides of the service (the Tinker routes,
:mod:`.app`, and the OpenAI ones, :mod:`.openai_api`): bounded as it arrives, and every way it can fail to
be a body is one :class:`Unreadable` naming the field at fault, never an exception of the parser.

    raw = await read_body(request, max_bytes)   # 413 past max_bytes, by Content-Length or as it is read
    body = parse_body(raw)                      # 400: not JSON, nested too deeply, a lone surrogate

What the parser alone would let through or raise:

* **depth** — Python's JSON parser recurses once per level and raises ``RecursionError`` near a thousand
  levels (``[[[[…]]]]`` 100,000 deep is 200 KB): the field holding the nesting is found by a scan of the
  text, on that failure only, and named with its depth.
* **lone surrogates** — ``"\\ud800"`` escaped in JSON decodes to a string that is no text (it cannot be
  encoded, tokenized or written back); a surrogate *pair* (an emoji) is text. Only a body whose bytes hold
  a surrogate escape is searched, so the common body costs one regular-expression scan of its bytes.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request

from mlora_lab.text import parse_json, surrogate_problem


class Unreadable(Exception):
    """A body that cannot be read: its HTTP ``status`` (400, 413), the ``message`` and the top-level
    ``field`` at fault (None: the body as a whole)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 past ``max_bytes`` by its Content-Length and as it is read (it is never
    held whole first)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise Unreadable(400, f"Content-Length {declared[:40]!r} is not a number")
        if int(declared) > max_bytes:
            raise Unreadable(413, f"the body has {declared} bytes; at most {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise Unreadable(413, f"the body has more than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes) -> Any:
    """The JSON value of ``raw`` (``None`` for an empty body), or :class:`Unreadable` (400) saying why it is
    not one and, where a field is at fault, naming it."""
    if not raw:
        return None
    value, why = parse_json(raw)
    if why == "nested too deeply":
        field, depth, cut = deepest(raw)
        where = f"field {field!r}" if field is not None else "the body"
        raise Unreadable(
            400,
            f"{where} is nested {'more than ' if cut else ''}{depth:,} levels deep (arrays and objects inside "
            "each other); a request needs a few levels, and JSON past about a thousand is refused",
            field,
        )
    if why is not None:
        raise Unreadable(400, f"the body is not JSON ({why})")
    if SURROGATE_ESCAPE.search(raw):
        found = lone_surrogate(value)
        if found is not None:
            where, text, field = found
            raise Unreadable(400, surrogate_problem(where, text)[0], field)
    return value


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A surrogate escape in a JSON text: half of a pair (an emoji) or a lone one."""

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[{]+|[\]}]+|:')
"""A JSON text's strings (whole: brackets inside them do not count), runs of opening and of closing brackets,
and colons: what :func:`deepest` follows."""


SCAN_TOKENS = 100_000
"""At most this many of :data:`_TOKENS` are followed (some 50 ms): a body nested past it is said to be nested
more than the depth reached by then (``[1,[1,[1,…`` over 8 MiB would take a second of the server's loop)."""


def deepest(raw: bytes) -> tuple[str | None, int, bool]:
    """``(the top-level key whose value nests deepest, or None when the body itself does; that depth; whether
    the scan stopped before the end)``, from the text alone (it did not parse). A run of brackets is one match:
    100,000 of them cost one step."""
    depth, best, key, best_key, last = 0, 0, None, None, b""
    for n, m in enumerate(_TOKENS.finditer(raw)):
        if n == SCAN_TOKENS:
            return (best_key, best - 1, True) if best_key is not None else (None, best, True)
        token = m.group()
        if token[0] in b"[{":
            if depth + len(token) > best:
                best, best_key = depth + len(token), key if depth >= 1 else None
            depth += len(token)
        elif token[0] in b"]}":
            depth -= len(token)
        elif token == b":" and depth == 1 and last.startswith(b'"'):
            name = parse_json(last)[0]
            key = name if isinstance(name, str) and not surrogate_problem("", name) else None
        last = token
    if best_key is not None:  # (the key's value: the levels below the body's own object)
        return best_key, best - 1, False
    return None, best, False


def lone_surrogate(value: Any) -> tuple[str, str, str | None] | None:
    """``(where, the string, the top-level field)`` of the first key or string of ``value`` holding a lone
    surrogate, ``where`` written as a client names it (``messages[0].content``); None when there is none.
    Walked without recursion (a parsed body may be hundreds of levels deep)."""
    stack: list[tuple[str, str | None, Any]] = [("", None, value)]
    while stack:
        where, field, v = stack.pop()
        if isinstance(v, str):
            if surrogate_problem("", v):
                return where or "the body", v, field
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                if surrogate_problem("", k):
                    return f"a key of {where or 'the body'}", k, field
                stack.append((f"{where}.{k}" if where else k, field or k, item))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", field, item) for i, item in reversed(list(enumerate(v))))
    return None
