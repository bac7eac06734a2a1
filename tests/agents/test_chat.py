"""mlora_lab.agents.chat: conversations as append-only token rows, over the tiny template and a
Qwen2.5-style ChatML tool template; the tiny template's tool rendering; tool-call parsing."""

from __future__ import annotations

import copy
import json

import pytest

from mlora_lab.agents import chat
from mlora_lab.tiny import build_tokenizer

# The tiny template as it was before it learnt tools: what old conversations must still render as.
OLD_TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Short Hermes-style ChatML template, shaped like Qwen2.5-Instruct's: tools in the system prompt, an
# assistant's calls as "\n<tool_call>\n{json}\n</tool_call>" after its content, consecutive tool
# results in one user turn of <tool_response> blocks.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are helpful.{% endif %}"
    "{{ '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{%- endfor %}"
    '{{ \'\\n</tools>\\n\\nReturn <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call>\' }}'
    "<|im_end|>{{ '\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system{{ '\\n' }}{{ messages[0]['content'] }}<|im_end|>{{ '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant{%- if message.content %}{{ '\\n' }}{{ message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' }}{{ f.name }}{{ \'", "arguments": \' }}'
    "{%- if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}{%- endfor %}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message.content }}{{ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tiny():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chatml(tiny):
    tok = copy.deepcopy(tiny)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.eos_token = "<|im_end|>"  # as Qwen2.5-Instruct: the end of a turn is the EOS
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok


@pytest.fixture(params=["tiny", "chatml"])
def tok(request, tiny, chatml):
    return {"tiny": tiny, "chatml": chatml}[request.param]


def text_of(tok, messages, **kw):
    return tok.apply_chat_template(chat.normalize_messages(messages), tokenize=False, **kw)


OLD_CONVERSATIONS = [
    [{"role": "user", "content": "count red"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nworld"}],
    [
        {"role": "user", "content": "what is one and two"},
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": "and  four ?"},
        {"role": "assistant", "content": ""},
    ],
    [{"role": "assistant", "content": '{"name": 1} <tool_call> </s>'}],
]


@pytest.mark.parametrize("conversation", OLD_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_tiny_template_renders_old_conversations_byte_for_byte_as_before(
    tiny, conversation, add_generation_prompt
):
    kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
    new = tiny.apply_chat_template(conversation, **kw)
    old = tiny.apply_chat_template(conversation, chat_template=OLD_TINY_TEMPLATE, **kw)
    assert new == old


def test_tiny_template_renders_tools_tool_calls_and_results(tiny):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 3,"b":4}'}},
                {"type": "function", "function": {"name": "noop"}},
            ],
        },
        {"role": "tool", "content": "3"},
    ]
    text = tiny.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|system|>\nbe brief\n\nYou can call these tools:\n<tools>\n"
        + json.dumps(TOOLS[0])
        + "\n</tools>\n"
        + 'To call one, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n'
        + "<|user|>\nadd\n<|assistant|>\n"
        + '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        + '<tool_call>{"name": "add", "arguments": {"a": 3,"b":4}}</tool_call>'  # a string goes in as is
        + '<tool_call>{"name": "noop", "arguments": {}}</tool_call></s>\n'
        + "<|tool|>\n3\n<|assistant|>\n"
    )
    # Without a system message the tools get a system block of their own.
    text = tiny.apply_chat_template(messages[1:2], tools=TOOLS, tokenize=False)
    assert text.startswith("<s><|system|>\nYou can call these tools:\n<tools>\n{")
    assert text.endswith("</tool_call>\n<|user|>\nadd\n")


def test_render_tokenizes_as_apply_chat_template_and_passes_tools_only_when_given(tok):
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    hf = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.render(tok, msgs) == tok.encode(
        text_of(tok, hf, add_generation_prompt=True), add_special_tokens=False
    )
    with_tools = chat.render(tok, msgs, tools=TOOLS, add_generation_prompt=False)
    assert with_tools != chat.render(tok, msgs, add_generation_prompt=False)
    assert "<tools>" in tok.decode(with_tools)


def test_supports_tools_and_prefix_preserving(tok, tiny):
    assert chat.supports_tools(tok)
    assert chat.prefix_preserving(tok)
    assert chat.prefix_preserving(tok, tools=TOOLS)
    old = copy.deepcopy(tiny)
    old.chat_template = OLD_TINY_TEMPLATE
    assert not chat.supports_tools(old)  # it reads neither tools nor tool_calls
    # A template that drops earlier answers once a new user turn comes (as Qwen3 drops reasoning).
    old.chat_template = OLD_TINY_TEMPLATE.replace(
        "{{ m['content'] }}", "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
    )
    assert not chat.prefix_preserving(old)
    with pytest.raises(ValueError, match="not prefix-preserving"):
        chat.suffix_ids(old, [{"role": "user", "content": "next"}])


def test_closing_ids_of_both_templates(tiny, chatml):
    assert chat.closing_ids(tiny) == [tiny.eos_token_id, *tiny.encode("\n", add_special_tokens=False)]
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert chat.closing_ids(chatml) == [im_end, *chatml.encode("\n", add_special_tokens=False)]
    assert chat.closing_ids(chatml, tools=TOOLS) == chat.closing_ids(chatml)


def test_bridge_adds_what_the_sampled_turn_lacks_of_the_closing():
    closing = [2, 10]
    assert chat.bridge([5, 6, 2, 10], closing) == []
    assert chat.bridge([5, 6, 2], closing) == [10]
    assert chat.bridge([5, 6], closing) == [2, 10]
    assert chat.bridge([], closing) == [2, 10]
    assert chat.bridge([5, 10], closing) == [2, 10]  # ends with the closing's tail, not a prefix of it
    assert chat.bridge([5], []) == []


def assistant_text(tok, prompt, assistant, tools):
    """The text the template renders for ``assistant`` between the generation prompt and its closing:
    what a model that writes exactly the template's text samples."""
    before = text_of(tok, prompt, tools=tools, add_generation_prompt=True)
    after = text_of(tok, [*prompt, assistant], tools=tools, add_generation_prompt=False)
    assert after.startswith(before)
    closing = tok.decode(chat.closing_ids(tok, tools=tools))
    assert after.endswith(closing)
    return after[len(before) : len(after) - len(closing)]


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
@pytest.mark.parametrize("ends", ["eos", "closing", "cut"])
def test_turn_by_turn_rows_equal_the_full_rendering(tok, tools, ends):
    """render(prompt) + sampled + bridge + suffix(tool results) == render(conversation, gen prompt),
    over two model turns, the second answering a tool result and a user's next turn."""
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add one and two"}]
    turn1 = {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
    }
    results = [{"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "3"}]
    turn2 = {"role": "assistant", "content": "three"}
    follow = [{"role": "user", "content": "thanks"}]
    eos = [tok.eos_token_id]
    closing = chat.closing_ids(tok, tools=tools)

    row = chat.render(tok, prompt, tools=tools)
    history = list(prompt)
    for answer, new in ((turn1, results), (turn2, follow)):
        text = assistant_text(tok, history, answer, tools)
        sampled = (
            tok.encode(text, add_special_tokens=False) + {"eos": eos, "closing": closing, "cut": []}[ends]
        )
        # The model's text parses back into the message it stands for.
        content, calls = chat.parse_tool_calls(text)
        assert (content or "").strip() == answer["content"]
        assert [c["function"]["name"] for c in calls] == [
            c["function"]["name"] for c in answer.get("tool_calls", [])
        ]
        row += sampled + chat.bridge(sampled, closing) + chat.suffix_ids(tok, new, tools=tools)
        history += [answer, *new]
        assert row == chat.render(tok, history, tools=tools, add_generation_prompt=True)


def test_suffix_ids_of_a_tool_result_follow_the_template(tiny, chatml):
    results = [
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "tool", "name": "add", "content": "7"},
    ]
    assert tiny.decode(chat.suffix_ids(tiny, results)) == "<|tool|>\n3\n<|tool|>\n7\n<|assistant|>\n"
    assert chatml.decode(chat.suffix_ids(chatml, results)) == (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="at least one"):
        chat.suffix_ids(tiny, [])


def test_parse_tool_calls_good_bad_nameless_multiple_and_mixed():
    assert chat.parse_tool_calls("just text") == ("just text", [])
    assert chat.parse_tool_calls("  \n") == (None, [])

    content, calls = chat.parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    assert content is None
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert calls[0]["id"].startswith("call_0_") and len(calls[0]["id"]) == len("call_0_") + 8
    int(calls[0]["id"][-8:], 16)
    assert chat.parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == (
        content,
        calls,
    )  # deterministic ids

    bad_json = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    assert chat.parse_tool_calls(bad_json) == (bad_json, [])
    nameless = (
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call><tool_call>[1]</tool_call>'
    )
    assert chat.parse_tool_calls(nameless) == (nameless, [])

    mixed = (
        'First <tool_call>{"name": "a"}</tool_call>, then\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
        "<tool_call>oops</tool_call> done"
    )
    content, calls = chat.parse_tool_calls(mixed)
    assert content == "First , then\n<tool_call>oops</tool_call> done"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("a", "{}"),
        ("b", '{"x": 1}'),
    ]
    assert [c["id"][:7] for c in calls] == ["call_0_", "call_1_"]
    assert calls[0]["id"][7:] != calls[1]["id"][7:]


def test_normalize_messages_parses_arguments_joins_parts_and_keeps_the_input():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
                {"id": "c2", "function": {"name": "f", "arguments": "not json"}},
                {"id": "c3", "type": "function", "function": {"name": "g", "arguments": {"k": "v"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": ""},
    ]
    before = copy.deepcopy(messages)
    out = chat.normalize_messages(messages)
    assert messages == before
    assert out[0] == {"role": "system", "content": "be\nbrief"}
    assert out[2]["content"] is None
    assert [c["function"]["arguments"] for c in out[2]["tool_calls"]] == [{"a": 1}, "not json", {"k": "v"}]
    assert out[2]["tool_calls"][1]["type"] == "function"
    assert out[3] == {"role": "tool", "tool_call_id": "c1", "content": ""}
    assert chat.normalize_messages(out) == out  # idempotent


def test_normalize_messages_names_every_bad_message():
    messages = [
        "hi",
        {"role": "robot", "content": "x"},
        {"role": "tool"},
        {"role": "user", "content": None},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "x", "tool_calls": []},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "user", "content": 7},
        {"role": "user", "content": "fine"},
    ]
    with pytest.raises(ValueError) as e:
        chat.normalize_messages(messages)
    msg = str(e.value)
    for i, what in [
        (0, "not a dict"),
        (1, "'robot'"),
        (2, "tool message without content"),
        (3, "user message without content"),
        (4, "neither content nor tool_calls"),
        (5, "cannot have tool_calls"),
        (6, "tool_calls[0] has no function with a name"),
        (7, "'image_url'"),
        (8, "content is a int"),
    ]:
        assert f"message {i}: " in msg and what in msg, (i, what, msg)
    assert "message 9" not in msg
    assert msg.count("message 8") == 1  # a bad content is one problem, not also a missing one
    with pytest.raises(ValueError, match="list of dicts"):
        chat.normalize_messages("hello")


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def no_doc(a: int) -> int:
    return a


def untyped(a):
    """Return a.

    Args:
        a: Anything.
    """
    return a


def test_tool_schemas_of_a_typed_documented_function_and_of_bad_ones(tiny):
    [schema] = chat.tool_schemas([add])
    assert schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first integer."},
                    "b": {"type": "integer", "description": "The second integer."},
                },
                "required": ["a"],
            },
            "return": {
                "type": "integer"
            },  # transformers' schema, as apply_chat_template(tools=[add]) makes it
        },
    }
    assert "You can call these tools" in tiny.decode(
        chat.render(tiny, [{"role": "user", "content": "x"}], [schema])
    )
    with pytest.raises(ValueError) as e:
        chat.tool_schemas([add, no_doc, untyped, 3])
    msg = str(e.value)
    assert "tools[1] no_doc" in msg and "docstring" in msg
    assert "tools[2] untyped" in msg and "type hint" in msg
    assert "tools[3] 3: not callable" in msg
    assert "tools[0]" not in msg


class ShapedTokenizer:
    """Stands in for a tokenizer or processor whose apply_chat_template returns ``shape(ids)``."""

    def __init__(self, tok, shape):
        self.tok, self.shape, self.name_or_path = tok, shape, "shaped"

    def apply_chat_template(self, messages, **kw):
        return self.shape(self.tok.apply_chat_template(messages, **kw))


@pytest.mark.parametrize(
    "shape",
    [lambda ids: {"input_ids": ids}, lambda ids: [ids], lambda ids: tuple(ids)],
    ids=["dict", "batched", "tuple"],
)
def test_render_accepts_every_return_shape_of_one_conversation(tiny, shape):
    msgs = [{"role": "user", "content": "hi"}]
    assert chat.render(ShapedTokenizer(tiny, shape), msgs) == chat.render(tiny, msgs)
    with pytest.raises(ValueError, match="2 rows"):
        chat.render(ShapedTokenizer(tiny, lambda ids: [ids, ids]), msgs)
