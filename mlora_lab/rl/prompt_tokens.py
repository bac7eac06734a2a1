"""An RL tenant's prompts as token ids: read and checked as data rows are (:mod:`mlora_lab.data`), each
cut to its last ``seq_len - max_new_tokens`` tokens (the room a completion leaves; the end of a prompt is
where it asks) before it is tokenized whole, as SFT rows are cut before they are, with one warning in their
words::

    load_prompts(source, tokenizer, max_tokens) -> list[PromptRow]   (the RL driver's feed)
    encode_prompt_cut(row, tokenizer, max_tokens) -> (prompt, text, ids, cut)

The ids are exactly the end of the prompt's whole tokenization (:func:`_encode_tail`), so a resumed tenant's
prompts keep their digest.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from mlora_lab import data
from mlora_lab.rl.prompts import RL_ROWS
from mlora_lab.sources import source_name


@dataclass(frozen=True)
class PromptRow:
    """One prompt of an RL tenant, as the model and the reward functions see it."""

    ids: list[int]
    """Token ids to complete (its last ``max_tokens``, :func:`tokenize_prompts`)."""
    prompt: Any
    """As the reward functions get it: the row's ``prompt`` text, or its ``messages`` list."""
    text: str
    """The text the ids encode (a chat rendered with the generation prompt): what the samples show."""
    columns: dict[str, Any]
    """Every other field of the row, for the reward functions' keyword arguments."""

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def tokenize_prompts(rows: list[dict], tokenizer: Any, max_tokens: int, source: str = "") -> list[PromptRow]:
    """An RL tenant's prompt rows tokenized (:func:`encode_prompt_cut`): a prompt longer than ``max_tokens``
    (``seq_len - max_new_tokens``: the room a completion leaves) keeps its last ones, cut before it is
    tokenized whole, as :func:`~mlora_lab.data.tokenize_rows` cuts a row. Warns once (``UserWarning``) with the number cut."""
    out, cut = [], 0
    for row in rows:
        prompt, text, ids, was_cut = encode_prompt_cut(row, tokenizer, max_tokens)
        cut += was_cut
        columns = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        out.append(PromptRow(ids, prompt, text, columns))
    if cut:
        warnings.warn(
            f"{source or '<rows>'}: {cut} of {len(rows)} prompt(s) truncated to their last {max_tokens} tokens "
            "(seq_len - max_new_tokens)",
            UserWarning,
            stacklevel=2,
        )
    return out


def load_prompts(source: Any, tokenizer: Any, max_tokens: int) -> list[PromptRow]:
    """:func:`~mlora_lab.data.read_rows` of prompt rows + :func:`tokenize_prompts`: an RL tenant's prompts as token ids."""
    return tokenize_prompts(
        data.read_rows(source, prompts=RL_ROWS), tokenizer, max_tokens, source=source_name(source)
    )


def encode_prompt_cut(row: dict, tokenizer: Any, max_tokens: int) -> tuple[Any, str, list[int], bool]:
    """:func:`~mlora_lab.data.encode_prompt` keeping the prompt's last ``max_tokens`` tokens (the end of a prompt is where
    it asks): ``(prompt as given, text fed, ids, cut)``. The ids are exactly the end of the whole
    tokenization, but a long prompt is never tokenized whole (:func:`_encode_tail`)."""
    prompt, text, special = data.prompt_text(row, tokenizer)
    ids = _encode_tail(tokenizer, text, special, max_tokens)
    return prompt, text, ids[-max_tokens:], len(ids) > max_tokens


def _encode_tail(tokenizer: Any, text: str, add_special_tokens: bool, n: int) -> list[int]:
    """The last tokens of ``tokenizer(text)`` without tokenizing all of a huge ``text``,
    :func:`mlora_lab.data._encode_head` from the other end: all its tokens when ``text`` is short enough to
    be tokenized entirely, else the last ``n + 1`` tokens of the whole text (so it has more than ``n``). Suffixes of ``text`` (as many
    characters as :func:`mlora_lab.data._encode_head`'s prefixes, then doubling) are tokenized without special tokens
    until two successive ones agree on their last ``n + 1`` ids (a suffix only tokenizes differently near
    its cut); the special tokens the tokenizer puts after a text (an EOS, for some) then end them.
    """
    need = n + 1
    length = max(data._HEAD_CHARS_PER_TOKEN * need, data._HEAD_MIN_CHARS, 1)
    prev: list[int] | None = None
    while length < len(text):
        piece = text[len(text) - length :]
        ids = data.encode(tokenizer, piece, add_special_tokens=False)
        if len(ids) >= need:
            if prev == ids[-need:]:
                after = _specials_after(tokenizer, piece, ids) if add_special_tokens else []
                return (ids + after)[-need:]
            prev = ids[-need:]
        length *= 2
    return data.encode(tokenizer, text, add_special_tokens)


def _specials_after(tokenizer: Any, text: str, plain: list[int]) -> list[int]:
    """The special tokens ``tokenizer`` puts after ``text``'s own (``plain``: without special tokens)."""
    full = data.encode(tokenizer, text, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[start + len(plain) :]
    return []
