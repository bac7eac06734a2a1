"""Tenant data: rows → token rows with label masks → mixed-tenant batches.

A tenant's rows come from a file (JSON Lines, JSON, parquet, CSV) or, in the notebook, from a pandas
DataFrame, a list of dicts or a datasets.Dataset (:mod:`mlora_lab.sources` reads them all as plain
JSON rows). Each row has one of three shapes (rows of different shapes may be mixed in one source)::

    {"text": "..."}                                      loss on every token
    {"prompt": "...", "completion": "..."}               loss on the completion only
    {"messages": [{"role": ..., "content": ...}, ...]}   chat template; loss on assistant turns only

The flow is one way::

    scan_source(source) -> SourceReport     every problem of a source, never raises (spec validation)
    load_examples(source, tok, seq_len)     -> list[Example]  (input_ids + labels, -100 = no loss)
    TenantStream(examples, seed).take(n)    -> the tenant's next n examples, seeded shuffle per epoch
    collate([(tenant, examples), ...], pad) -> Batch  [B, T], rows of each tenant contiguous

Labels are *unshifted*: ``labels[i]`` is the target for position ``i`` and the model shifts
internally (as HF causal LMs do), so ``labels[0]`` never contributes to the loss.

Files are hostile input: they are read a row at a time (a FIFO or /dev/zero is refused, never read),
and a row is cut to ``seq_len`` tokens *before* it is tokenized whole (:func:`tokenize_example`), so
one 50-MB line costs a few kB of tokenizing. Rows that keep no target token are dropped.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlora_lab.rl.prompts import PromptRows, chat_prompt, prompt_row_problems
from mlora_lab.sources import SourceError, memory_kind, source_name, source_rows
from mlora_lab.text import error_line, surrogate_problem

IGNORE_INDEX = -100
ROW_KINDS = ("text", "prompt", "messages")  # "prompt" = a prompt/completion row
MAX_PROBLEMS_PER_FILE = 20
# A row is of a kind when it has any of that kind's keys (so a lone "completion" is a prompt row missing its prompt).
_KIND_KEYS = {"text": ("text",), "prompt": ("prompt", "completion"), "messages": ("messages",)}


class DataError(ValueError):
    """Bad tenant data. ``problems`` lists every problem found, each naming its file and line."""

    def __init__(self, problems: Sequence[str], header: str = "bad tenant data") -> None:
        self.problems = list(problems)
        super().__init__(
            f"{header} ({len(self.problems)} problem(s)):\n" + "\n".join(f"  - {p}" for p in self.problems)
        )


# ---------------------------------------------------------------------------------------------
# JSONL scanning / reading
# ---------------------------------------------------------------------------------------------


@dataclass
class SourceReport:
    """What :func:`scan_source` found in one source."""

    n_rows: int
    """Rows (non-blank lines of a JSON Lines or CSV file), valid or not."""
    kinds: set[str] = field(default_factory=set)
    """Row kinds seen: a subset of ``{"text", "prompt", "messages"}``."""
    problems: list[str] = field(default_factory=list)
    """Every problem (capped at ~20 per source plus an "... and N more" line); empty = usable."""
    columns: set[str] = field(default_factory=set)
    """Every key with a value in a valid row (an RL tenant's reward functions take them as arguments)."""
    samples: dict[str, dict] = field(default_factory=dict)
    """Prompt rows (``prompts``): the first valid row of each shape, ``"prompt"`` and ``"messages"``, which
    validation calls the reward functions on once."""


# In a Python str from JSON every surrogate code point is a lone one ("\ud800"): a valid pair
# ("\ud83d\ude00") is decoded to one character. It has no UTF-8 form, so tokenizers raise on it.
def _row_kind_and_problems(row: Any, prompts: PromptRows | None = None) -> tuple[str | None, list[str]]:
    """Classify one parsed row; problems are phrased without the file/line prefix. A key whose value is
    null counts as missing: a table (a DataFrame, a parquet file) holds every column in every row, so
    its ``text`` rows have a null ``prompt`` and ``completion``. With ``prompts`` the row is a prompt to
    complete (:func:`~mlora_lab.rl.prompts.prompt_row_problems`; a text: what the rows are called)."""
    if not isinstance(row, dict):
        return None, [f"expected a JSON object, got {type(row).__name__}"]
    if prompts is not None:
        return prompt_row_problems(row, prompts)
    present = [kind for kind, keys in _KIND_KEYS.items() if any(row.get(key) is not None for key in keys)]
    if not present:
        return None, ["row has none of 'text', 'prompt'+'completion', 'messages'"]
    if len(present) > 1:
        names = ", ".join("'prompt'+'completion'" if k == "prompt" else f"'{k}'" for k in present)
        return None, [f"row mixes {names}; use exactly one"]
    kind = present[0]
    problems: list[str] = []
    if kind == "text":
        if not isinstance(row["text"], str):
            problems.append("'text' must be a string")
        elif not row["text"]:
            problems.append("'text' is empty (nothing to learn)")
        else:
            problems += surrogate_problem("'text'", row["text"])
    elif kind == "prompt":
        for key in ("prompt", "completion"):
            if row.get(key) is None:
                other = "completion" if key == "prompt" else "prompt"
                problems.append(f"'{other}' without '{key}'")
            elif not isinstance(row[key], str):
                problems.append(f"'{key}' must be a string")
            else:
                problems += surrogate_problem(f"'{key}'", row[key])
        if isinstance(row.get("completion"), str) and not row["completion"]:
            problems.append("'completion' is empty (nothing to learn)")
    else:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            problems.append("'messages' must be a non-empty list of {'role', 'content'} objects")
        else:
            for i, m in enumerate(msgs):
                if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
                    problems.append(f"messages[{i}] needs 'role' and 'content' strings")
                    continue
                for key in ("role", "content"):
                    problems += surrogate_problem(f"'messages[{i}].{key}'", m[key])
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs):
                problems.append("messages has no assistant turn (nothing to learn)")
    return kind, problems


def _cap(problems: list[str], where: str, total: int | None = None) -> list[str]:
    """At most ``MAX_PROBLEMS_PER_FILE`` of ``problems``, then how many more of ``total`` (default: all
    of ``problems``) there are."""
    total = len(problems) if total is None else total
    if total <= MAX_PROBLEMS_PER_FILE:
        return problems
    extra = total - MAX_PROBLEMS_PER_FILE
    return [*problems[:MAX_PROBLEMS_PER_FILE], f"{where}: ... and {extra} more problem(s)"]


def _checked_rows(
    source: Any, prompts: PromptRows | None = None
) -> Iterator[tuple[str, str | None, Any, list[str]]]:
    """``(label, kind, row, problems)`` of every row of ``source`` (:func:`~mlora_lab.sources.source_rows`),
    its shape checked. Raises :class:`~mlora_lab.sources.SourceError`."""
    for r in source_rows(source):
        if r.problems:
            yield r.label, None, None, list(r.problems)
            continue
        kind, problems = _row_kind_and_problems(r.row, prompts)
        yield r.label, kind, r.row, problems


def _scan(
    source: Any, keep_rows: bool = True, prompts: PromptRows | None = None
) -> tuple[SourceReport, list[dict]]:
    """Read and check every row of ``source`` (``prompts``: prompt rows, :func:`scan_source`); returns the
    report and (with ``keep_rows``) the rows that are valid."""
    where = source_name(source)
    problems: list[str] = []
    n_problems = 0  # all of them; only the first few are kept as text
    kinds: set[str] = set()
    columns: set[str] = set()
    samples: dict[str, dict] = {}
    rows: list[dict] = []
    n_rows = 0
    try:
        for label, kind, row, row_problems in _checked_rows(source, prompts):
            n_rows += 1
            n_problems += len(row_problems)
            if len(problems) <= MAX_PROBLEMS_PER_FILE:
                problems += [f"{where} {label}: {msg}" for msg in row_problems]
            if kind is not None:
                kinds.add(kind)
            if kind is not None and not row_problems:
                columns.update(k for k, v in row.items() if isinstance(k, str) and v is not None)
                if prompts is not None:
                    samples.setdefault(kind, row)
                if keep_rows:
                    rows.append(row)
    except SourceError as e:
        n_problems += 1
        problems.append(f"{where}: {e}")
    if n_rows == 0 and not n_problems:
        n_problems += 1
        problems.append(f"{where}: {'empty file' if memory_kind(source) is None else 'empty'} (no rows)")
    return SourceReport(n_rows, kinds, _cap(problems, where, n_problems), columns, samples), rows


def scan_source(source: Any, prompts: PromptRows | None = None) -> SourceReport:
    """Check a tenant's data source (a file of any kind :mod:`mlora_lab.sources` reads, or an in-memory
    source) and report every problem; never raises. ``prompts``: rows to complete, and what for
    (:data:`~mlora_lab.rl.prompts.RL_ROWS`, :data:`~mlora_lab.rl.prompts.EVAL_ROWS`).

    Problems name the source and the row, e.g. ``"data.jsonl line 3: not valid JSON (...)"``,
    ``"DataFrame row 2: 'text' must be a string"``. Blank lines are skipped. The list is capped at ~20
    problems plus ``"... and N more"``. Files are read one row at a time and no row is kept.
    """
    try:
        return _scan(source, keep_rows=False, prompts=prompts)[0]
    except Exception as e:  # "never raises": an unforeseen failure is still a reported problem
        return SourceReport(
            0, set(), [f"{source_name(source)}: cannot scan ({type(e).__name__}: {error_line(e)})"]
        )


def read_rows(source: Any, prompts: PromptRows | None = None) -> list[dict]:
    """All rows of a tenant's data source, in order (``prompts``: prompt rows, :func:`scan_source`). Raises
    :class:`DataError` listing every problem."""
    report, rows = _scan(source, prompts=prompts)
    if report.problems:
        raise DataError(report.problems, header=f"bad tenant data {source_name(source)}")
    return rows


# ---------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------


@dataclass
class Example:
    """One tokenized row. ``labels[i]`` is the target at position ``i`` (unshifted), -100 = no loss."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    """Set on packed rows (:func:`pack`): positions restart at 0 at every document."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"input_ids ({len(self.input_ids)}) and labels ({len(self.labels)}) differ in length"
            )

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_target(self) -> int:
        """Tokens that carry loss. Position 0 is excluded: a causal LM never predicts its first token."""
        return sum(1 for t in self.labels[1:] if t != IGNORE_INDEX)


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer(text)``'s input ids as a list: how every row is tokenized (and prompts are, to
    compare generations as the tenants were trained)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_prompt(row: dict, tokenizer: Any) -> tuple[Any, str, list[int]]:
    """A prompt row (an RL tenant's, an evaluation's) as ``(prompt as given, text fed, token ids)``:
    ``prompt`` text with the tokenizer's special tokens, a chat (``messages``, or TRL's conversational
    ``prompt``) through the chat template with the generation prompt (its special tokens are the
    template's)."""
    prompt, text, special = prompt_text(row, tokenizer)
    return prompt, text, encode(tokenizer, text, add_special_tokens=special)


def prompt_text(row: dict, tokenizer: Any) -> tuple[Any, str, bool]:
    """``(prompt as given, text fed, whether the tokenizer adds its special tokens)`` of a prompt row."""
    chat = chat_prompt(row)
    if chat is not None:
        return chat, render_chat(tokenizer, chat, add_generation_prompt=True), False
    return row["prompt"], row["prompt"], True


# The first prefix _encode_head tokenizes: this many characters per token needed, and at least this many.
_HEAD_CHARS_PER_TOKEN = 8
_HEAD_MIN_CHARS = 1024


def _encode_head(
    tokenizer: Any, text: str, add_special_tokens: bool, n: int, offsets: bool = False
) -> tuple[list[int], list[tuple[int, int]] | None, bool]:
    """The first tokens of ``tokenizer(text)`` without tokenizing all of a huge ``text``:
    ``(ids, offset_mapping or None, whole)``.

    ``whole``: ``text`` was tokenized entirely and ``ids`` are all its tokens. Otherwise ``ids`` are
    the first ``n + 1`` tokens of the whole text (so it has more than ``n``). Prefixes of ``text``
    (``max(8 (n + 1), 1024)`` characters, then doubling) are tokenized until two successive ones
    agree on their first ``n + 1`` ids: a prefix only tokenizes differently near its cut (a word or
    a whitespace run split in two), so a 50-MB row costs a few kB of tokenizing instead of GBs.
    """
    need = n + 1
    length = max(_HEAD_CHARS_PER_TOKEN * need, _HEAD_MIN_CHARS, 1)
    prev: list[int] | None = None
    while True:
        whole = length >= len(text)
        piece = text if whole else text[:length]
        if offsets:
            enc = tokenizer(piece, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        else:  # called exactly as encode calls it, so a whole short row is tokenized as before
            enc = tokenizer(piece, add_special_tokens=add_special_tokens)
        ids = list(enc["input_ids"])
        offs = [tuple(o) for o in enc["offset_mapping"]] if offsets else None
        if whole:
            return ids, offs, True
        if len(ids) >= need:
            if prev == ids[:need]:
                return ids[:need], offs[:need] if offs is not None else None, False
            prev = ids[:need]
        length *= 2


def _with_eos(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is not None and (not ids or ids[-1] != eos_id):
        return [*ids, eos_id]
    return ids


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The text of a conversation through the tokenizer's chat template (``tokenize=False``); a template
    that fails or gives no string raises :class:`DataError` saying so."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:
        raise DataError([f"the chat template failed on this conversation ({type(e).__name__}: {e})"]) from e
    if not isinstance(text, str):
        raise DataError([f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str"])
    return text


def _chat_example(
    messages: list[dict], tokenizer: Any, seq_len: int | None = None
) -> tuple[list[int], list[int]]:
    """Render a chat and mark the characters of each assistant turn, then the tokens inside them.

    Assistant turn ``i`` spans ``len(render(messages[:i], add_generation_prompt=True))`` to
    ``len(render(messages[:i+1]))`` in the full rendering: its content plus whatever the template
    closes the turn with (e.g. EOS). Trailing whitespace the template puts after that (a newline
    between turns) is left out, so the model learns to stop at EOS rather than at "EOS\\n".

    With ``seq_len``, only a prefix of the rendering is tokenized (:func:`_encode_head`): at least
    its first ``seq_len`` tokens, exactly as the whole rendering gives them. The spans are
    character spans of the whole rendering, so they mark the prefix's tokens unchanged, and turns
    that start past the last kept character are not rendered at all: a row of 100k turns costs a
    few renders, not 100k renders of a growing conversation.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(["'messages' rows need a tokenizer with a chat_template; this tokenizer has none"])
    full = render_chat(tokenizer, messages)
    try:
        if seq_len is None:
            enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        else:
            ids, offsets, _ = _encode_head(tokenizer, full, False, seq_len, offsets=True)
            offsets = offsets or []
    except NotImplementedError as e:
        raise DataError(["'messages' rows need a fast tokenizer (one that returns offset mappings)"]) from e
    covered = max((e for _, e in offsets), default=0)  # characters of `full` the kept tokens reach
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        _check_prefix(full, before, f"messages[:{i}] + generation prompt")
        if len(before) >= covered:
            break  # this turn and every later one start past the kept tokens: no label to mark
        upto = render_chat(tokenizer, messages[: i + 1])
        _check_prefix(full, upto, f"messages[:{i + 1}]")
        start, end = len(before), len(upto)
        while end > start and full[end - 1].isspace():
            end -= 1
        spans.append((start, end))
    labels = [IGNORE_INDEX] * len(ids)
    for k, (s, e) in enumerate(offsets):
        if e > s and any(a <= s and e <= b for a, b in spans):
            labels[k] = ids[k]
    return ids, labels


def _check_prefix(full: str, prefix: str, what: str) -> None:
    if not full.startswith(prefix):
        raise DataError(
            [
                f"the chat template is not prefix-stable: the rendering of {what} is not a prefix of "
                "the whole conversation, so assistant turns cannot be located for the loss mask "
                "(use prompt/completion rows, or a template that renders earlier turns unchanged)"
            ]
        )


def tokenize_example(row: dict, tokenizer: Any, seq_len: int) -> tuple[Example, bool]:
    """Tokenize one row; returns ``(example, was_truncated)``.

    - ``text``: ``tok(text, add_special_tokens=True)`` + EOS, loss on every token.
    - ``prompt``/``completion``: ``tok(prompt, add_special_tokens=True)`` then
      ``tok(completion, add_special_tokens=False)`` + EOS; loss on the completion part.
    - ``messages``: the tokenizer's chat template, loss on assistant turns; no EOS appended.

    EOS is appended only when the tokenizer has one and did not already put it last. Rows longer
    than ``seq_len`` keep their first ``seq_len`` tokens. Raises :class:`DataError` for a bad row.

    The result is the whole row's tokenization cut to ``seq_len``, but a long string is never
    tokenized whole (:func:`_encode_head`): the text, the prompt, then only as much of the
    completion as the prompt leaves room for, or a prefix of the rendered chat.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    kind, problems = _row_kind_and_problems(row)
    if problems or kind is None:
        raise DataError(problems)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if kind == "text":
        ids, _, whole = _encode_head(tokenizer, row["text"], True, seq_len)
        ids = _with_eos(ids, eos_id) if whole else ids  # EOS only on a row that is not cut
        labels = list(ids)
    elif kind == "prompt":
        p_ids, _, p_whole = _encode_head(tokenizer, row["prompt"], True, seq_len)
        c_ids: list[int] = []
        if p_whole:  # else the prompt alone overflows the row: no completion token survives the cut
            c_ids, _, c_whole = _encode_head(
                tokenizer, row["completion"], False, max(seq_len - len(p_ids), 0)
            )
            c_ids = _with_eos(c_ids, eos_id) if c_whole else c_ids
        ids = p_ids + c_ids
        labels = [IGNORE_INDEX] * len(p_ids) + c_ids
    else:
        ids, labels = _chat_example(row["messages"], tokenizer, seq_len)
    truncated = len(ids) > seq_len
    return Example(ids[:seq_len], labels[:seq_len]), truncated


def _no_target_problem(where: str, n_rows: int, n_cut: int, seq_len: int) -> str:
    """What to say when none of ``n_rows`` rows keeps a target token (``n_cut`` of them lost theirs
    to truncation)."""
    if n_cut == n_rows:
        return (
            f"{where}: all {n_rows} row(s) lose their target tokens when truncated to seq_len={seq_len}; "
            "raise seq_len or shorten the prompts"
        )
    return (
        f"{where}: none of the {n_rows} row(s) has a target token at seq_len={seq_len} ({n_cut} lose "
        "theirs when truncated); every row needs text, a completion or an assistant turn that carries loss"
    )


def tokenize_rows(rows: list[dict], tokenizer: Any, seq_len: int, source: str = "") -> list[Example]:
    """Tokenize every row (order kept), dropping the rows left with no target token: they would add
    no loss, only compute.

    Warns once (``UserWarning``) with the number of truncated rows and of dropped rows. Raises one
    :class:`DataError` listing every bad row, as ``"<source> row N: ..."``, or saying that no row
    keeps a target token (a tenant that would "train" at loss 0).
    """
    where = source or "<rows>"
    examples: list[Example] = []
    problems: list[str] = []
    n_truncated = n_no_target = n_cut = 0
    for i, row in enumerate(rows, start=1):
        try:
            ex, truncated = tokenize_example(row, tokenizer, seq_len)
        except DataError as e:
            problems += [f"{where} row {i}: {p}" for p in e.problems]
            continue
        n_truncated += truncated
        if ex.n_target == 0:
            n_no_target += 1
            n_cut += truncated
            continue
        examples.append(ex)
    if problems:
        raise DataError(_cap(problems, where), header=f"cannot tokenize {where}")
    if rows and not examples:
        raise DataError([_no_target_problem(where, len(rows), n_cut, seq_len)], header=f"cannot use {where}")
    if n_truncated or n_no_target:
        parts = (
            [f"{n_truncated} of {len(rows)} row(s) truncated to seq_len={seq_len} tokens"]
            if n_truncated
            else []
        )
        if n_no_target:
            parts.append(
                f"{n_no_target} row(s) have no target token left and are dropped (they would add no loss)"
            )
        warnings.warn(f"{where}: " + "; ".join(parts), UserWarning, stacklevel=2)
    return examples


def load_examples(source: Any, tokenizer: Any, seq_len: int) -> list[Example]:
    """:func:`read_rows` + :func:`tokenize_rows`: a tenant's data source as token rows (rows with no
    target token left dropped; :class:`DataError` if no row keeps one)."""
    return tokenize_rows(read_rows(source), tokenizer, seq_len, source=source_name(source))


def check_vocab(examples: list[Example], vocab: int, source: str = "") -> None:
    """Raise :class:`DataError` if any row holds a token id the model cannot embed (``>= vocab``):
    such a row would index past the input embedding of the shared forward. A tokenizer can have
    more tokens than the model has rows (special tokens a tokenizer class adds)."""
    bad = [
        (i, max(ex.input_ids))
        for i, ex in enumerate(examples, start=1)
        if ex.input_ids and max(ex.input_ids) >= vocab
    ]
    if bad:
        where = source or "<rows>"
        first, top = bad[0][0], max(b[1] for b in bad)
        message = (
            f"{where}: {len(bad)} row(s) (the first is row {first}) hold token ids up to {top}, past the "
            f"model's {vocab} embedding rows; the tokenizer has tokens the model cannot embed"
        )
        raise DataError([message], header=f"cannot use {where}")


def target_problem(source: Any, tokenizer: Any, seq_len: int) -> str | None:
    """Why :func:`load_examples` would refuse ``source`` at ``seq_len`` although every row is valid,
    or ``None``: the first row that fails to tokenize (e.g. a chat template that is not prefix-stable),
    or no row keeping a target token. Cheap for a usable source: rows are read and tokenized (each cut
    at ``seq_len``, :func:`tokenize_example`) only until one keeps a target. Rows
    :func:`scan_source` reports are skipped; never raises.
    """
    where = source_name(source)
    n_rows = n_cut = 0
    try:
        for label, kind, row, problems in _checked_rows(source):
            if kind is None or problems:
                continue
            try:
                ex, truncated = tokenize_example(row, tokenizer, seq_len)
            except DataError as e:
                return f"{where} {label}: {e.problems[0] if e.problems else e}"
            if ex.n_target:
                return None
            n_rows, n_cut = n_rows + 1, n_cut + truncated
    except SourceError as e:
        return f"{where}: {e}"
    except Exception as e:  # a tokenizer that raises on a row: reported, not thrown
        return f"{where}: cannot tokenize ({type(e).__name__}: {error_line(e)})"
    return _no_target_problem(where, n_rows, n_cut, seq_len) if n_rows else None


# ---------------------------------------------------------------------------------------------
# Per-tenant data order
# ---------------------------------------------------------------------------------------------


class TenantStream:
    """A tenant's data order: seeded shuffle per epoch, a cursor that moves only when rows are taken.

    Epoch ``e`` visits the examples in a permutation drawn from ``random.Random`` seeded with
    ``(seed, e)`` (a string seed, hashed with SHA-512 by Python: the same in every process and on
    every platform), or in file order when ``shuffle=False``. ``epoch`` counts completed passes
    and ``cursor`` is the position inside the current pass; both are the whole resumable state.
    """

    def __init__(self, examples: list[Example], seed: int, shuffle: bool = True) -> None:
        self.examples = examples
        self.seed = int(seed)
        self.shuffle = shuffle
        self._epoch = 0
        self._cursor = 0
        self._order_epoch = -1
        self._order: list[int] = []
        self._pending: list[tuple[int, int]] = []  # packing: (example index, calls waited), oldest first

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def epoch(self) -> int:
        """Completed passes over the data."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Rows already taken from the current pass."""
        return self._cursor

    def order(self, epoch: int) -> list[int]:
        """The example indices of pass ``epoch``, in visiting order."""
        n = len(self.examples)
        idx = list(range(n))
        if self.shuffle:
            random.Random(f"mlora_lab.TenantStream/{self.seed}/{epoch}").shuffle(idx)
        return idx

    def _current_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            self._order, self._order_epoch = self.order(self._epoch), self._epoch
        return self._order

    def take(self, n: int) -> list[Example]:
        """The next ``n`` examples, crossing into the next (reshuffled) pass as needed."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        if n and not self.examples:
            raise ValueError("cannot take rows from a tenant with no examples")
        return [self.examples[i] for i in self._take_indices(n)]

    def _take_indices(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            order = self._current_order()
            k = min(n - len(out), len(order) - self._cursor)
            out += order[self._cursor : self._cursor + k]
            self._cursor += k
            if self._cursor == len(order):
                self._epoch, self._cursor = self._epoch + 1, 0
        return out

    def take_packed(self, rows: int, seq_len: int) -> list[Example]:
        """Up to ``rows`` packed rows (:func:`pack`) of at most ``seq_len`` tokens, filled with whole
        examples (:func:`pack_rows`) from those waiting since earlier calls and new ones from the
        stream, drawn until twice the rows' tokens are on offer (so short examples fill the gaps long
        ones leave). Examples that did not fit wait for the next call (in the resumable state)."""
        if rows < 1:
            raise ValueError(f"take_packed needs rows >= 1, got {rows}")
        if not self.examples:
            raise ValueError("cannot take rows from a tenant with no examples")
        lengths = [len(ex) for ex in self.examples]
        if max(lengths) > seq_len:
            raise ValueError(f"an example of {max(lengths)} tokens does not fit seq_len={seq_len}")
        offered = sum(lengths[i] for i, _ in self._pending)
        while offered < 2 * rows * seq_len and len(self._pending) < 64 * rows:
            (i,) = self._take_indices(1)
            self._pending.append((i, 0))
            offered += lengths[i]
        placed, self._pending = pack_rows(self._pending, lengths, rows, seq_len)
        return [pack([self.examples[i] for i in row]) for row in placed]

    def state_dict(self) -> dict:
        """Plain ints/bools (JSON-serialisable): enough to continue the exact same sequence."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "n_examples": len(self.examples),
            "pending": [list(p) for p in self._pending],
        }

    def load_state_dict(self, d: dict) -> None:
        """Continue from :meth:`state_dict`. Refuses a state taken over different data or settings."""
        mismatched = [
            f"{k}: saved {d[k]!r}, now {v!r}"
            for k, v in (("seed", self.seed), ("shuffle", self.shuffle), ("n_examples", len(self.examples)))
            if k in d and d[k] != v
        ]
        if mismatched:
            raise ValueError("TenantStream state does not match this stream (" + "; ".join(mismatched) + ")")
        epoch, cursor = int(d["epoch"]), int(d["cursor"])
        if epoch < 0 or not 0 <= cursor <= max(len(self.examples) - 1, 0):
            raise ValueError(f"TenantStream state out of range: epoch={epoch}, cursor={cursor}")
        pending = [(int(i), int(w)) for i, w in d.get("pending", [])]
        if any(not 0 <= i < len(self.examples) or w < 0 for i, w in pending):
            raise ValueError("TenantStream state out of range: pending example index")
        self._epoch, self._cursor, self._pending = epoch, cursor, pending


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def pack(docs: Sequence[Example]) -> Example:
    """One row holding ``docs`` back to back, each computed as if it were alone in its row.

    Positions restart at 0 at every document, which is what transformers' attention reads as packed
    sequences (``masking_utils.find_packed_sequence_indices``: with ``position_ids`` and no 2-D
    attention mask, a token attends only to earlier tokens of its own document). Each document's
    first label is dropped: unpacked, a row's first token is never predicted, and packed it must not
    be predicted from the previous document's last token. Its loss and gradients are then those of
    the documents in rows of their own.
    """
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for doc in docs:
        ids += doc.input_ids
        labels += [IGNORE_INDEX, *doc.labels[1:]] if doc.labels else []
        positions += range(len(doc))
    return Example(ids, labels, positions)


PACK_PATIENCE = 8
"""Calls a document may wait before it is placed ahead of every newer one (see :func:`pack_rows`)."""


def pack_rows(
    pending: Sequence[tuple[int, int]], lengths: Sequence[int], rows: int, seq_len: int
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Place documents into ``rows`` rows of ``seq_len`` tokens: best fit decreasing, with patience.

    ``pending`` holds ``(index, calls waited)`` (``lengths[index]`` ≤ ``seq_len``). Documents that have
    waited :data:`PACK_PATIENCE` calls go first, then the rest, longest first; each goes to the row it
    fills best (the least room that still fits it). Longest-first is what leaves little padding (a few
    percent on lengths spread over 4-100 % of ``seq_len``, with twice the rows' tokens on offer);
    patience bounds how long a document can be passed over: once it is at the front, the rows are
    empty enough for it. Returns ``(rows' document indices, documents left with one more call
    waited)``, both in a deterministic order.
    """
    # by position in ``pending``: an example drawn again in a later pass may wait twice
    order = sorted(
        range(len(pending)), key=lambda j: (pending[j][1] < PACK_PATIENCE, -lengths[pending[j][0]], j)
    )
    bins: list[list[int]] = [[] for _ in range(rows)]
    room = [seq_len] * rows
    placed: set[int] = set()
    for j in order:
        i = pending[j][0]
        fits = [r for r in range(rows) if room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: room[r])
            bins[r].append(i)
            room[r] -= lengths[i]
            placed.add(j)
    left = [(i, w + 1) for j, (i, w) in enumerate(pending) if j not in placed]
    return [b for b in bins if b], left


def padding_waste(rows: Sequence[Example]) -> float:
    """Share of a right-padded batch of ``rows`` that is padding: ``1 - tokens / (rows * longest)``."""
    if not rows:
        return 0.0
    longest = max(len(r) for r in rows)
    return 1.0 - sum(len(r) for r in rows) / (len(rows) * longest) if longest else 0.0


# ---------------------------------------------------------------------------------------------
# Mixed-tenant batches
# ---------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Rows of several tenants in one right-padded batch.

    ``segments`` holds ``(key, start_row, end_row)``: rows ``start_row:end_row`` belong to ``key``
    (a tenant name or slot); segments are contiguous, non-empty and in the order given to :func:`collate`.
    """

    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long, 1 on tokens, 0 on padding
    labels: torch.Tensor  # [B, T] long, -100 on padding and non-target tokens (unshifted)
    segments: list[tuple[Any, int, int]]
    position_ids: torch.Tensor | None = None  # [B, T] long, when some row is packed (see pack())

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.labels.to(device),
            list(self.segments),
            None if self.position_ids is None else self.position_ids.to(device),
        )


def collate(
    groups: Sequence[tuple[Any, Sequence[Example]]], pad_id: int, pad_to_multiple_of: int | None = None
) -> Batch:
    """Stack groups of examples into one :class:`Batch` of shape ``[B, T]``.

    ``B`` is the total number of rows; ``T`` the longest row, rounded up to ``pad_to_multiple_of``
    when given. Groups keep their order and their rows stay contiguous; a group with zero rows
    adds no rows and no segment. No rows at all gives a ``[0, 0]`` batch.
    """
    rows: list[Example] = []
    segments: list[tuple[Any, int, int]] = []
    for key, examples in groups:
        if len(examples):
            segments.append((key, len(rows), len(rows) + len(examples)))
            rows.extend(examples)
    T = max((len(ex) for ex in rows), default=0)
    if pad_to_multiple_of and T % pad_to_multiple_of:
        T += pad_to_multiple_of - T % pad_to_multiple_of
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), T), dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
    packed = any(ex.position_ids is not None for ex in rows)
    # Packed rows: positions say where documents start; the padding after a row's last document
    # is one more "document" (its positions restart too), which no real token can see (causal).
    position_ids = torch.arange(T).repeat(len(rows), 1) if packed else None
    for r, ex in enumerate(rows):
        n = len(ex)
        input_ids[r, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        attention_mask[r, :n] = 1
        labels[r, :n] = torch.tensor(ex.labels, dtype=torch.long)
        if position_ids is not None:
            if ex.position_ids is not None:
                position_ids[r, :n] = torch.tensor(ex.position_ids, dtype=torch.long)
            position_ids[r, n:] = torch.arange(T - n)
    return Batch(input_ids, attention_mask, labels, segments, position_ids)
