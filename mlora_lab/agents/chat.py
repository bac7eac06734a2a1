"""A conversation as tokens, turn by turn and append-only, as TRL's tool loop builds it.

Pure functions over a Hugging Face tokenizer and its chat template: no torch, no processes.

Let ``T(m, g)`` be the template's token ids of the messages ``m`` (``g``: with the generation
prompt). An agent's trajectory is one growing row of ids::

    row_0 = T(prompt, True)                                  # context (ENV)
    row_1 = row_0 + s_1                                      # s_1: ids the model sampled (MODEL)
    row_2 = row_1 + bridge(s_1, C) + suffix(new_1)           # tool results, next user turn (ENV)
    row_3 = row_2 + s_2 ...

where ``C = closing_ids`` are the tokens the template puts after an assistant message's content
(``</s> \\n`` for :data:`mlora_lab.tiny.CHAT_TEMPLATE`, ``<|im_end|> \\n`` for ChatML) and
``suffix(new) = T(d + new, True) - T(d, False)`` is TRL's dummy-diff (``_get_tool_suffix_ids``):
``d`` is a dummy user message and a dummy assistant message, and ``-`` removes a prefix. The model's
text is never re-tokenized: what it sampled stays in the row as sampled, which is what its logprobs
are of. For a prefix-preserving template (:func:`prefix_preserving`) and a model that wrote exactly
the template's text, ``row_k`` equals ``T(conversation so far, True)`` token for token.

The dummy-diff starts *after* the dummy assistant's closing, whereas a sampled turn may stop
before it (cut by length or a stop string) or inside it (the model's EOS, not the ``\\n`` after):
:func:`bridge` adds the missing closing tokens as ENV tokens. TRL instead trims ``T(d)`` to its
last EOS, so its suffix starts with the ``\\n``; both give the same row when the model ends on EOS.

Tool calls are Hermes/Qwen style, ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``:
:func:`parse_tool_calls` turns a completion's text into an OpenAI assistant message's
``content`` and ``tool_calls``; :func:`normalize_messages` turns OpenAI messages into what HF
templates read (arguments as dicts, TRL's convention).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role; HF templates know only "system".
ROLE_ALIASES = {"developer": "system"}

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MARKER = "qzxMarkerqzx"


def _template_name(tokenizer: Any) -> str:
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"


def _normalize_tool_calls(calls: Any, where: str, problems: list[str]) -> list[dict] | None:
    """OpenAI ``tool_calls`` with JSON-string arguments parsed to dicts (non-JSON strings kept)."""
    if not isinstance(calls, list):
        problems.append(f"{where}: tool_calls is a {type(calls).__name__}, not a list")
        return None
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            problems.append(f"{where}: tool_calls[{j}] has no function with a name")
            continue
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def _normalize_content(content: Any, where: str, problems: list[str]) -> str | None:
    """A string or None as is; a list of text parts joined with newlines (as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts, bad = [], []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                bad.append(f"part {j} ({kind!r})")
        if bad:
            problems.append(f"{where}: only text content parts are supported, not {', '.join(bad)}")
            return None
        return "\n".join(texts)
    problems.append(
        f"{where}: content is a {type(content).__name__}, not a string, a list of text parts or None"
    )
    return None


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """OpenAI chat messages -> what HF chat templates read, in new dicts (the input is not changed).

    - ``developer`` becomes ``system``;
    - ``tool_calls[i].function.arguments`` given as a JSON string of an object is parsed to a dict
      (TRL's convention; a string that is not such JSON stays as is), ``type`` defaults to
      ``"function"``;
    - a content list of ``{"type": "text", "text": ..}`` parts becomes one string (joined with
      ``"\\n"``), ``None`` stays ``None``;
    - other keys (``name``, ``tool_call_id``, ...) pass through.

    Raises ``ValueError`` naming every bad message (its index and what is wrong): not a dict, an
    unknown role, a system/user/tool message without content, an assistant message with neither
    content nor tool calls, tool calls on another role, malformed tool calls or content parts.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"chat messages must be a list of dicts, not a {type(messages).__name__}")
    problems: list[str] = []
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, Mapping):
            problems.append(f"{where}: not a dict but a {type(m).__name__}")
            continue
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            allowed = ", ".join((*ROLES, *ROLE_ALIASES))
            problems.append(f"{where}: role {m.get('role')!r} is not one of {allowed}")
            continue
        msg = dict(m)
        msg["role"] = role
        msg["content"] = _normalize_content(m.get("content"), where, problems)
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                problems.append(f"{where}: a {role} message cannot have tool_calls")
            else:
                msg["tool_calls"] = _normalize_tool_calls(calls, where, problems)
        if m.get("content") is None:
            if role in ("system", "user", "tool"):
                problems.append(f"{where}: a {role} message without content")
            elif not calls:
                problems.append(f"{where}: an assistant message with neither content nor tool_calls")
        out.append(msg)
    if problems:
        raise ValueError("bad chat messages:\n  " + "\n  ".join(problems))
    return out


def render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """``T(messages, add_generation_prompt)``: the template's token ids of the normalized messages.

    ``tools=`` reaches the template only when given. Accepts what transformers returns for one
    conversation (a list of ids, a nested list, or a BatchEncoding/dict with ``input_ids``).
    """
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools is not None else {}
    ids = tokenizer.apply_chat_template(
        normalize_messages(messages),
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"{_template_name(tokenizer)} rendered {len(ids)} rows for one conversation")
        ids = ids[0]
    return [int(t) for t in ids]


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_e5c1",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def supports_tools(tokenizer: Any) -> bool:
    """Whether the template reads ``tools`` and renders a whole tool-calling exchange.

    Two checks, both needed: rendering with a probe tool differs from rendering without it (the
    template lists tools), and in ``user -> assistant(tool_calls) -> tool`` the call's name, its
    argument key and value, and the tool result all appear (TRL's ``supports_tool_calling``; the basic
    Llama 3 template, say, drops ``tool_calls``). A template that raises on either is ``False``.
    """
    import jinja2

    if getattr(tokenizer, "chat_template", None) is None:
        return False
    name, key, value, result = "tool_name_a8f3", "arg_key_b9d4", "arg_val_d6e7", "tool_result_c4f9"
    exchange = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: value}}}],
        },
        {"role": "tool", "name": name, "content": result},
    ]
    plain = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(exchange, tokenize=False)
        with_tool = tokenizer.apply_chat_template(plain, tools=[_PROBE_TOOL], tokenize=False)
        without = tokenizer.apply_chat_template(plain, tokenize=False)
    except (jinja2.exceptions.TemplateError, TypeError):
        return False
    return with_tool != without and all(s in text for s in (name, key, value, result))


def _dummy(new_messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """TRL's dummy user + assistant turn; the assistant calls the tool that answers first, if any."""
    first = new_messages[0] if new_messages else {}
    if first.get("role") != "tool":
        return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
    # The real tool name (and call id): some templates derive the tool response's header from them.
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": first.get("name") or "dummy", "arguments": {}},
    }
    if first.get("tool_call_id"):
        call["id"] = first["tool_call_id"]
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


def suffix_ids(
    tokenizer: Any,
    new_messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """``T(d + new, True) - T(d, False)``: the ids the template adds for ``new_messages`` after an
    assistant turn's closing, generation prompt included (TRL's dummy-diff, ``d`` as in
    :func:`_dummy`). ``ValueError`` if ``T(d)`` is not a prefix of ``T(d + new)`` (the template is
    not prefix-preserving, so no suffix exists).
    """
    if not new_messages:
        raise ValueError("suffix_ids needs at least one new message")
    new = normalize_messages(new_messages)
    dummy = _dummy(new)
    prefix = render(tokenizer, dummy, tools=tools, add_generation_prompt=False)
    full = render(tokenizer, dummy + new, tools=tools, add_generation_prompt=True)
    if full[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise ValueError(
            f"{_template_name(tokenizer)} is not prefix-preserving: rendering a dummy user + assistant "
            f"turn ({len(prefix)} ids) and then the same with {len(new)} new message(s) "
            f"({len(full)} ids) differ from token {at} on"
        )
    return full[len(prefix) :]


def closing_ids(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The ids the template puts after an assistant message's content (its end of turn).

    Renders ``user, assistant(<marker>)`` without the generation prompt and takes what follows the
    marker's ids, up to the end. ``ValueError`` if the marker's ids do not appear as such (the
    template merged it with its neighbours or dropped it).
    """
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}]
    ids = render(tokenizer, msgs, tools=tools, add_generation_prompt=False)
    marker = tokenizer.encode(_MARKER, add_special_tokens=False)
    for start in range(len(ids) - len(marker), -1, -1):
        if ids[start : start + len(marker)] == marker:
            return ids[start + len(marker) :]
    raise ValueError(
        f"{_template_name(tokenizer)}: an assistant message's content does not come out as its own "
        "tokens, so the closing ids after it cannot be found"
    )


def bridge(sampled: Sequence[int], closing: Sequence[int]) -> list[int]:
    """The ENV ids that must follow a model turn's ``sampled`` ids before the next :func:`suffix_ids`.

    The dummy-diff starts after the dummy assistant's whole closing ``C``, so the row must hold
    ``C`` after the sampled turn for the next suffix to join it as the template would:

    - ``sampled`` ends with all of ``C`` (the model wrote its end of turn): ``[]``;
    - it ends with a proper prefix of ``C`` (the EOS but not the ``\\n`` after it): the rest of ``C``;
    - otherwise (cut by ``max_tokens`` or a stop string): all of ``C``.
    """
    sampled, closing = list(sampled), list(closing)
    for k in range(len(closing), 0, -1):
        if len(sampled) >= k and sampled[len(sampled) - k :] == closing[:k]:
            return closing[k:]
    return closing


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Hermes ``<tool_call>{json}</tool_call>`` blocks of a completion's text -> (content, tool_calls).

    ``text`` is what the model wrote, EOS text already stripped by the caller. A block is a call when
    its inside is a JSON object with a string ``name``; its ``arguments`` (an object, or a JSON
    string as OpenAI sends them; missing -> ``"{}"``) come back as a JSON string, OpenAI-shaped:
    ``{"id": "call_<k>_<8 hex>", "type": "function", "function": {"name", "arguments"}}`` with ``k``
    the call's index and the hex a hash of its block, so ids are deterministic. Any other block stays
    in the content as written: an agent that writes garbage is told so by its env, not by a crash.
    ``content`` is the text outside the calls, ``None`` when only whitespace is left.
    """
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            continue
        args = obj.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        digest = hashlib.sha256(match.group(0).encode("utf-8")).hexdigest()[:8]
        calls.append(
            {
                "id": f"call_{len(calls)}_{digest}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args},
            }
        )
        kept.append(text[pos : match.start()])
        pos = match.end()
    kept.append(text[pos:])
    content = "".join(kept)
    return (content if content.strip() else None), calls


def tool_schemas(functions: Sequence[Callable[..., Any]]) -> list[dict]:
    """OpenAI tool schemas (``{"type": "function", "function": {name, description, parameters}}``)
    of Python callables, via ``transformers.utils.get_json_schema``: each needs type hints on every
    argument and a Google-style docstring with an ``Args:`` line per argument.

    Raises ``ValueError`` naming every function that has no usable schema and why.
    """
    from transformers.utils import get_json_schema

    schemas, problems = [], []
    for i, fn in enumerate(functions):
        name = getattr(fn, "__name__", None) or repr(fn)
        if not callable(fn):
            problems.append(f"tools[{i}] {name}: not callable")
            continue
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # transformers raises its own parsing exceptions, and TypeError/ValueError
            problems.append(f"tools[{i}] {name}: {type(e).__name__}: {e}")
    if problems:
        raise ValueError("functions without a usable tool schema:\n  " + "\n  ".join(problems))
    return schemas


def prefix_preserving(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> bool:
    """Whether ``T(m2, False)`` is a prefix of ``T(m2 + [next], True)`` for 2-turn conversations
    ``m2`` (TRL's ``is_chat_template_prefix_preserving``): the property :func:`suffix_ids` needs.

    Checked for a user turn after a plain answer and, when the template supports tools
    (:func:`supports_tools`), for a tool result after a tool call. ``False`` when the template
    raises on either.
    """
    import jinja2

    call = {"type": "function", "function": {"name": "dummy", "arguments": {}}}
    cases = [
        (
            [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}],
            {"role": "user", "content": "dummy"},
        )
    ]
    if supports_tools(tokenizer):
        cases.append(
            (
                [
                    {"role": "user", "content": "dummy"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                ],
                {"role": "tool", "name": "dummy", "content": "dummy"},
            )
        )
    try:
        for two, nxt in cases:
            short = render(tokenizer, two, tools=tools, add_generation_prompt=False)
            longer = render(tokenizer, [*two, nxt], tools=tools, add_generation_prompt=True)
            if longer[: len(short)] != short:
                return False
    except (jinja2.exceptions.TemplateError, TypeError):
        return False
    return True
