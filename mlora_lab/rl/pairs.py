"""Preference rows read and tokenized exactly as TRL 1.16.0's ``DPOTrainer`` and ``KTOTrainer`` do, so that a
preference tenant's sequences are token for token the ones TRL trains on (trl/trainer/dpo_trainer.py
``_prepare_dataset`` and ``DataCollatorForPreference``; trl/trainer/kto_trainer.py ``_prepare_dataset`` and
``DataCollatorForUnpairedPreference``; trl/data_utils.py ``extract_prompt``, ``common_prefix_length``)::

    row_format(row) -> (format | None, problems)       one row: which of FORMATS, and everything wrong
    check_rows(rows, where) -> format                  all rows at once: one DataError naming every problem
    tokenize_pair(row, tok) -> PairIds                 prompt_ids p, chosen_ids c, rejected_ids r
    pair_sequences(pair, L, mode) -> (chosen, rejected) Sequence(input_ids, completion_mask), cut to L
    collate_pairs(pairs, pad_id, L, mode) -> dict       TRL's batch: 2B rows, chosen half then rejected half
    tokenize_unpaired / unpair_rows / kl_completion_ids / collate_unpaired: KTO's unpaired rows

The formats (TRL's names for them in its "dataset formats" page):

- ``paired`` / ``paired_chat``: ``{"prompt", "chosen", "rejected"}``, all texts or all conversations;
- ``implicit`` / ``implicit_chat``: ``{"chosen", "rejected"}`` only; the prompt is their longest common
  prefix (characters, or whole messages), as ``extract_prompt`` finds it;
- ``unpaired`` / ``unpaired_chat``: KTO's ``{"prompt", "completion", "label"}``, ``label`` a bool.

Every row may also carry ``tools`` (a list, or its JSON text) and ``chat_template_kwargs`` (a dict), which
TRL passes to the chat template.

Token ids of one paired row, with ``T(x)`` the tokenizer (``tok(text=x)`` for texts, so with its special
tokens; ``apply_chat_template`` for conversations, the prompt with the generation prompt)::

    p0 = T(prompt), pc = T(prompt + chosen [+ EOS for texts]), pr = T(prompt + rejected [+ EOS])
    k  = min(common_prefix(p0, pc), common_prefix(p0, pr))    # where the completions start
    prompt_ids = p0[:k], chosen_ids = pc[k:], rejected_ids = pr[k:]

and the two training sequences, each of length ``n = len(p) + len(c)`` (resp. ``r``), cut to ``L`` =
``max_length`` by keeping its start (``keep_start``, TRL's default) or its end (``keep_end``)::

    input_ids = (p + c)[cut],  completion_mask = ([0] * len(p) + [1] * len(c))[cut]

A row whose prompt alone has ``>= L`` tokens is dropped under ``keep_start`` (its completion would be cut
away whole); :func:`keeps_pair` says which. The completion mask marks the tokens whose log-probabilities
enter the loss.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from mlora_lab.data import DataError
from mlora_lab.text import surrogate_problem

FORMATS = ("paired", "paired_chat", "implicit", "implicit_chat", "unpaired", "unpaired_chat")
TRUNCATION_MODES = ("keep_start", "keep_end")
PAIRED_KEYS = ("prompt", "chosen", "rejected")
UNPAIRED_KEYS = ("prompt", "completion", "label")
OPTIONAL_KEYS = ("tools", "chat_template_kwargs")
"""Keys TRL reads beside the format's own: passed to the chat template."""


@dataclass(frozen=True)
class PairIds:
    """One paired row's token ids, as TRL's ``_prepare_dataset`` stores them."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass(frozen=True)
class UnpairedIds:
    """One KTO row's token ids, as TRL's ``KTOTrainer._prepare_dataset`` stores them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool


@dataclass(frozen=True)
class Sequence:
    """One training sequence: ``input_ids`` and, at the same positions, 1 where a completion token is."""

    input_ids: list[int]
    completion_mask: list[int]


# ---------------------------------------------------------------------------------------------
# Recognising a row
# ---------------------------------------------------------------------------------------------


def _is_chat(value: Any) -> bool:
    """A list whose first item is a message (TRL's ``is_conversational`` test on one field)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _field_problems(key: str, value: Any) -> list[str]:
    """What is wrong with one text-or-conversation field: its type, emptiness, each message's shape."""
    if isinstance(value, str):
        if not value:
            return [f"'{key}' is empty"]
        return surrogate_problem(f"'{key}'", value)
    if not isinstance(value, list):
        return [
            f"'{key}' must be a text or a list of {{'role', 'content'}} messages, not {type(value).__name__}"
        ]
    if not value:
        return [f"'{key}' is empty"]
    problems = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
            problems.append(f"'{key}'[{i}] needs 'role' and 'content' strings")
            continue
        for part in ("role", "content"):
            problems += surrogate_problem(f"'{key}[{i}].{part}'", m[part])
    return problems


def _optional_problems(row: dict) -> list[str]:
    problems = []
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        if not isinstance(tools, str):
            problems.append(f"'tools' must be a list or its JSON text, not {type(tools).__name__}")
        else:
            try:
                if not isinstance(json.loads(tools), list):
                    problems.append("'tools' JSON text must hold a list")
            except json.JSONDecodeError as e:
                problems.append(f"'tools' is not valid JSON ({e.msg})")
    kwargs = row.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        problems.append(f"'chat_template_kwargs' must be an object, not {type(kwargs).__name__}")
    return problems


def row_format(row: Any) -> tuple[str | None, list[str]]:
    """``(format, problems)`` of one preference row: its format (one of :data:`FORMATS`, ``None`` when it
    cannot be told) and every problem with it (``[]`` = usable): a missing or unexpected key, a field that is
    neither a text nor a list of messages, an empty ``chosen``/``rejected``/``completion``, texts mixed with
    conversations (TRL would concatenate a ``str`` with a ``list``), a ``label`` that is not a bool,
    ``chosen == rejected`` (a pair that teaches nothing), an implicit pair with no common prompt."""
    if not isinstance(row, dict):
        return None, [f"a preference row must be an object, not {type(row).__name__}"]
    paired = "chosen" in row or "rejected" in row
    unpaired = "completion" in row or "label" in row
    if paired and unpaired:
        return None, ["mixes paired ('chosen', 'rejected') and unpaired ('completion', 'label') keys"]
    if not (paired or unpaired):
        return None, [
            "needs 'chosen' and 'rejected' (a preference pair, 'prompt' optional) or 'prompt', 'completion' "
            f"and 'label' (an unpaired row); it has {sorted(map(str, row))}"
        ]
    own = PAIRED_KEYS if paired else UNPAIRED_KEYS
    required = [k for k in own if k != "prompt"] if paired else list(own)
    problems = [f"missing key '{k}'" for k in required if k not in row]
    problems += [
        f"unexpected key {k!r} (a row has {', '.join(own + OPTIONAL_KEYS)})"
        for k in row
        if k not in own and k not in OPTIONAL_KEYS
    ]
    texts = [k for k in own if k != "label" and k in row]
    for k in texts:
        problems += _field_problems(k, row[k])
    if "label" in row and not isinstance(row["label"], bool):
        problems.append(f"'label' must be true or false, not {row['label']!r}")
    problems += _optional_problems(row)
    chats = {k: _is_chat(row[k]) for k in texts if (isinstance(row[k], str) and row[k]) or _is_chat(row[k])}
    chat = any(chats.values())
    if chat and not all(chats.values()):
        kinds = ", ".join(f"'{k}' is {'a conversation' if c else 'a text'}" for k, c in chats.items())
        problems.append(f"texts mixed with conversations ({kinds}): a row's fields are all one or the other")
    if paired and not problems and row["chosen"] == row["rejected"]:
        problems.append("'chosen' and 'rejected' are the same: the pair teaches nothing")
    if paired and not problems and "prompt" not in row and not extract_prompt(row)["prompt"]:
        problems.append("'chosen' and 'rejected' share no leading prompt: give the row a 'prompt'")
    kind = ("paired" if "prompt" in row else "implicit") if paired else "unpaired"
    return (f"{kind}_chat" if chat else kind), problems


def check_rows(rows: Seq[Any], where: str = "rows") -> str:
    """The one format of ``rows`` (:func:`row_format`), or :class:`~mlora_lab.data.DataError` naming every
    problem of every row (``"<where> row i: ..."``) at once. All rows must share one format: TRL decides from
    the first row whether to extract prompts and append EOS, then applies that to every row."""
    problems, first = [], None
    for i, row in enumerate(rows):
        fmt, row_problems = row_format(row)
        problems += [f"{where} row {i}: {p}" for p in row_problems]
        if fmt is not None and first is None:
            first = (i, fmt)
        elif fmt is not None and fmt != first[1]:
            problems.append(
                f"{where} row {i}: is {fmt} but row {first[0]} is {first[1]}: one format per tenant"
            )
    if not rows:
        problems.append(f"{where}: no rows")
    if problems:
        raise DataError(problems, header="bad preference data")
    return first[1]


# ---------------------------------------------------------------------------------------------
# Token ids
# ---------------------------------------------------------------------------------------------


def extract_prompt(row: dict) -> dict:
    """TRL's ``extract_prompt``: the prompt is ``chosen[:i]`` for the first ``i`` where chosen and rejected
    differ (characters of texts, messages of conversations), stepping back one when ``chosen[i-1]`` is a space
    so that the completions keep their leading space. When one is a prefix of the other, ``i`` stays at the
    last index compared (``min(len) - 1``), as TRL's loop leaves it."""
    chosen, rejected = row["chosen"], row["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _template_kwargs(row: dict) -> dict:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    return {"tools": tools, **(row.get("chat_template_kwargs") or {})}


def _ids(tokenizer: Any, value: str | list, **template_kwargs: Any) -> list[int]:
    """TRL's ``_tokenize`` for a tokenizer: a conversation through its chat template (no special tokens
    added beyond the template's), a text through ``tokenizer(text=...)`` (with them)."""
    if isinstance(value, list):
        out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **template_kwargs)
    else:
        out = tokenizer(text=value)
    return list(out["input_ids"])


def common_prefix_length(ids: Seq[int], other: Seq[int]) -> int:
    """Number of leading tokens ``ids`` and ``other`` share."""
    n = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        n += 1
    return n


def _split(tokenizer: Any, row: dict, completions: Seq[str]) -> tuple[list[int], list[list[int]]]:
    """``(prompt_ids, [completion_ids...])`` of a row with a ``prompt``: each completion tokenized after the
    prompt, the prompt cut where the tokenized prompt stops being a prefix of every prompt+completion."""
    prompt = row["prompt"]
    if isinstance(prompt, list):
        kw = _template_kwargs(row)
        p0 = _ids(tokenizer, prompt, add_generation_prompt=True, **kw)
        full = [_ids(tokenizer, prompt + row[c], **kw) for c in completions]
    else:
        eos = tokenizer.eos_token
        p0 = _ids(tokenizer, prompt)
        full = [
            _ids(tokenizer, prompt + (row[c] if row[c].endswith(eos) else row[c] + eos)) for c in completions
        ]
    k = min(common_prefix_length(p0, f) for f in full)
    return p0[:k], [f[k:] for f in full]


def tokenize_pair(row: dict, tokenizer: Any) -> PairIds:
    """One valid paired or implicit row (:func:`row_format`) as TRL's ``DPOTrainer`` tokenizes it: the prompt
    extracted when the row has none, EOS appended to text completions that lack it, ids split as the module
    docstring says."""
    if "prompt" not in row:
        row = {**row, **extract_prompt(row)}
    prompt_ids, (chosen_ids, rejected_ids) = _split(tokenizer, row, ("chosen", "rejected"))
    return PairIds(prompt_ids, chosen_ids, rejected_ids)


def tokenize_unpaired(row: dict, tokenizer: Any) -> UnpairedIds:
    """One valid unpaired row as TRL's ``KTOTrainer`` tokenizes it (EOS appended to a text completion)."""
    prompt_ids, (completion_ids,) = _split(tokenizer, row, ("completion",))
    return UnpairedIds(prompt_ids, completion_ids, row["label"])


def unpair_rows(rows: Seq[dict], batch: int = 1000) -> list[dict]:
    """Paired rows as KTO reads them (TRL's ``unpair_preference_dataset``, a ``datasets`` map of ``batch``
    rows at a time): per block of ``batch`` rows, every chosen (``label=True``) then every rejected
    (``label=False``), each with the row's prompt (extracted when implicit) and other keys."""
    out: list[dict] = []
    for start in range(0, len(rows), batch):
        block = [r if "prompt" in r else {**r, **extract_prompt(r)} for r in rows[start : start + batch]]
        for key, label in (("chosen", True), ("rejected", False)):
            for r in block:
                rest = {k: v for k, v in r.items() if k not in ("chosen", "rejected", "prompt")}
                out.append({"prompt": r["prompt"], "completion": r[key], "label": label, **rest})
    return out


# ---------------------------------------------------------------------------------------------
# Sequences and batches
# ---------------------------------------------------------------------------------------------


def _check_cut(max_length: int | None, truncation_mode: str) -> None:
    problems = []
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        problems.append(f"max_length must be a positive integer or None, not {max_length!r}")
    if truncation_mode not in TRUNCATION_MODES:
        problems.append(
            f"truncation_mode must be one of {', '.join(TRUNCATION_MODES)}, not {truncation_mode!r}"
        )
    if problems:
        raise ValueError("; ".join(problems))


def keeps_pair(pair: PairIds, max_length: int | None, truncation_mode: str = "keep_start") -> bool:
    """Whether TRL keeps the row: under ``keep_start`` a prompt of ``>= max_length`` tokens leaves no
    completion token, and TRL drops the row before training."""
    _check_cut(max_length, truncation_mode)
    return max_length is None or truncation_mode != "keep_start" or len(pair.prompt_ids) < max_length


def keeps_unpaired(row: UnpairedIds, max_length: int | None) -> bool:
    """Whether KTO keeps the row (it always keeps the start): ``len(prompt_ids) < max_length``."""
    _check_cut(max_length, "keep_start")
    return max_length is None or len(row.prompt_ids) < max_length


def sequence(
    prompt_ids: Seq[int],
    completion_ids: Seq[int],
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
) -> Sequence:
    """``p + c`` and its completion mask ``[0]*len(p) + [1]*len(c)``, both cut to ``max_length`` as TRL's
    collators cut them: the first ``L`` (``keep_start``) or last ``L`` (``keep_end``) positions."""
    _check_cut(max_length, truncation_mode)
    ids = [*prompt_ids, *completion_ids]
    mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    if max_length is not None:
        cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        ids, mask = ids[cut], mask[cut]
    return Sequence(ids, mask)


def pair_sequences(
    pair: PairIds, max_length: int | None = None, truncation_mode: str = "keep_start"
) -> tuple[Sequence, Sequence]:
    """``(chosen, rejected)``: the prompt followed by each completion (:func:`sequence`)."""
    return (
        sequence(pair.prompt_ids, pair.chosen_ids, max_length, truncation_mode),
        sequence(pair.prompt_ids, pair.rejected_ids, max_length, truncation_mode),
    )


def _padded(rows: list[list[int]], value: int, multiple: int | None) -> list[list[int]]:
    """Right-padded to the longest row, rounded up to ``multiple`` (TRL's ``pad``)."""
    width = max(len(r) for r in rows)
    if multiple is not None and width % multiple:
        width += multiple - width % multiple
    return [[*r, *[value] * (width - len(r))] for r in rows]


def _batch(seqs: list[Sequence], pad_token_id: int, multiple: int | None, prefix: str = "") -> dict[str, Any]:
    return {
        f"{prefix}input_ids": _padded([s.input_ids for s in seqs], pad_token_id, multiple),
        f"{prefix}attention_mask": _padded([[1] * len(s.input_ids) for s in seqs], 0, multiple),
        f"{prefix}completion_mask": _padded([s.completion_mask for s in seqs], 0, multiple),
    }


def collate_pairs(
    pairs: Seq[PairIds],
    pad_token_id: int,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pad_to_multiple_of: int | None = None,
) -> dict[str, list[list[int]]]:
    """TRL's ``DataCollatorForPreference`` on ``B`` pairs, as lists: ``input_ids``, ``attention_mask`` and
    ``completion_mask``, each ``[2B][W]`` with rows ``0..B-1`` the chosen sequences and ``B..2B-1`` the
    rejected ones, right-padded (``pad_token_id``, 0, 0) to ``W`` = the longest, rounded up to
    ``pad_to_multiple_of``."""
    seqs = [pair_sequences(p, max_length, truncation_mode) for p in pairs]
    return _batch([c for c, _ in seqs] + [r for _, r in seqs], pad_token_id, pad_to_multiple_of)


def kl_completion_ids(completion_ids: Seq[list[int]], batch_size: int) -> list[list[int]]:
    """KTO's mismatched completions for its KL estimate: within each block of ``batch_size`` rows (TRL's
    ``per_device_train_batch_size``), completion ``j`` goes to row ``j + 1`` and the last to the first:
    ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``."""
    out: list[list[int]] = []
    for start in range(0, len(completion_ids), batch_size):
        block = list(completion_ids[start : start + batch_size])
        out += [block[-1], *block[:-1]]
    return out


def collate_unpaired(
    rows: Seq[UnpairedIds],
    pad_token_id: int,
    max_length: int | None = None,
    kl_ids: Seq[list[int]] | None = None,
    pad_to_multiple_of: int | None = None,
) -> dict[str, Any]:
    """TRL's ``DataCollatorForUnpairedPreference`` on ``B`` rows, as lists: ``input_ids``,
    ``attention_mask``, ``completion_mask`` ``[B][W]`` (prompt + completion, first ``max_length`` kept), the
    same three under ``KL_`` for ``kl_ids`` (prompt + mismatched completion) when given, and ``label``."""
    out = _batch(
        [sequence(r.prompt_ids, r.completion_ids, max_length) for r in rows], pad_token_id, pad_to_multiple_of
    )
    if kl_ids is not None:
        kl = [sequence(r.prompt_ids, k, max_length) for r, k in zip(rows, kl_ids, strict=True)]
        out.update(_batch(kl, pad_token_id, pad_to_multiple_of, prefix="KL_"))
    out["label"] = [r.label for r in rows]
    return out


# ---------------------------------------------------------------------------------------------
# A tenant's data source
# ---------------------------------------------------------------------------------------------

MAX_PROBLEMS = 20
"""Problems named per source before "... and N more" (as :func:`mlora_lab.data.scan_source`)."""


UNPAIRED_REFUSED = (
    "an unpaired (KTO) row; a preference tenant trains on pairs {'prompt', 'chosen', 'rejected'}"
)


def scan_pairs(source: Any, unpaired: bool = False) -> tuple[list[str], list[dict], str | None]:
    """Every row of a tenant's data source (any :mod:`mlora_lab.sources` reads: a ``.jsonl``/``.json``/
    ``.parquet``/``.csv`` file, a DataFrame, a list of dicts, a ``datasets.Dataset``, a Hub dataset) read as
    preference rows: ``(problems, rows, format)``, the problems naming the source and the row
    (``"pairs.jsonl line 3: missing key 'rejected'"``, at most :data:`MAX_PROBLEMS` and a count), the valid rows
    in order, and their one format (:data:`FORMATS`). Unpaired (KTO) rows are a problem each unless
    ``unpaired``. A table holds every column in every row, so a null value counts as a missing key. Never
    raises."""
    from mlora_lab.sources import SourceError, source_name, source_rows

    where = source_name(source)
    problems: list[str] = []
    total = 0
    rows: list[dict] = []
    first: tuple[str, str] | None = None
    try:
        for r in source_rows(source):
            found = list(r.problems)
            row = r.row
            if not found:
                row = {k: v for k, v in row.items() if v is not None} if isinstance(row, dict) else row
                fmt, found = row_format(row)
                if fmt is not None and fmt.startswith("unpaired") and not unpaired and not found:
                    found = [UNPAIRED_REFUSED]
                elif fmt is not None and not found:
                    if first is None:
                        first = (r.label, fmt)
                    elif fmt != first[1]:
                        found = [f"is {fmt} but {first[0]} is {first[1]}: one format per tenant"]
            total += len(found)
            problems += [f"{where} {r.label}: {p}" for p in found][: max(0, MAX_PROBLEMS - len(problems))]
            if not found:
                rows.append(row)
    except SourceError as e:
        total += 1
        problems.append(f"{where}: {e}")
    except Exception as e:  # "never raises": an unforeseen failure is still a problem
        total += 1
        problems.append(f"{where}: cannot be read ({type(e).__name__}: {e})")
    if not rows and not total:
        total += 1
        problems.append(f"{where}: no rows")
    if total > len(problems):
        problems.append(f"{where}: ... and {total - len(problems)} more problem(s)")
    return problems, rows, first[1] if first else None


def read_pairs(source: Any, tokenizer: Any, seq_len: int) -> list[PairIds]:
    """A preference tenant's data as TRL's ``DPOTrainer`` tokenizes it (:func:`tokenize_pair`), in order, the
    pairs whose prompt alone fills ``seq_len`` dropped (:func:`keeps_pair`, with a ``UserWarning`` saying how
    many). :class:`~mlora_lab.data.DataError` naming every problem of every row, or saying that no pair is
    left; unpaired (KTO) rows are refused here: a preference tenant trains on pairs."""
    import warnings

    from mlora_lab.sources import source_name

    problems, rows, _ = scan_pairs(source)
    where = source_name(source)
    if problems:
        raise DataError(problems, header=f"bad preference data {where}")
    pairs = [tokenize_pair(row, tokenizer) for row in rows]
    kept = [p for p in pairs if keeps_pair(p, seq_len)]
    if len(kept) < len(pairs):
        warnings.warn(
            f"{where}: {len(pairs) - len(kept)} of {len(pairs)} pair(s) dropped: their prompt alone has "
            f">= seq_len={seq_len} tokens (as TRL drops them)",
            stacklevel=2,
        )
    if not kept:
        raise DataError(
            [f"{where}: every pair's prompt has >= seq_len={seq_len} tokens: no completion token is left"],
            header=f"bad preference data {where}",
        )
    return kept


def read_unpaired(source: Any, tokenizer: Any, seq_len: int) -> list[UnpairedIds]:
    """A KTO tenant's data as TRL's ``KTOTrainer`` reads it: unpaired rows ``{"prompt", "completion", "label"}``
    tokenized (:func:`tokenize_unpaired`), or paired rows first unpaired (:func:`unpair_rows`: each block's chosen
    then its rejected, as TRL's ``unpair_preference_dataset``), in order, the rows whose prompt alone fills
    ``seq_len`` dropped (with a ``UserWarning``). :class:`~mlora_lab.data.DataError` naming every problem."""
    import warnings

    from mlora_lab.sources import source_name

    problems, rows, fmt = scan_pairs(source, unpaired=True)
    where = source_name(source)
    if problems:
        raise DataError(problems, header=f"bad preference data {where}")
    if fmt is not None and not fmt.startswith("unpaired"):
        rows = unpair_rows(rows)
    unpaired = [tokenize_unpaired(row, tokenizer) for row in rows]
    kept = [r for r in unpaired if keeps_unpaired(r, seq_len)]
    if len(kept) < len(unpaired):
        warnings.warn(
            f"{where}: {len(unpaired) - len(kept)} of {len(unpaired)} row(s) dropped: their prompt alone has "
            f">= seq_len={seq_len} tokens (as TRL drops them)",
            stacklevel=2,
        )
    if not kept:
        raise DataError(
            [f"{where}: every row's prompt has >= seq_len={seq_len} tokens: no completion token is left"],
            header=f"bad preference data {where}",
        )
    return kept
