"""mlora_lab.data: row checks (of JSONL files here; every other source: test_sources.py), label masks,
per-tenant data order, mixed-tenant batches."""

from __future__ import annotations

import json
import os
import random
import re
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch

import mlora_lab.data
from mlora_lab.data import (
    IGNORE_INDEX,
    Batch,
    DataError,
    Example,
    SourceReport,
    TenantStream,
    collate,
    load_examples,
    read_rows,
    scan_source,
    target_problem,
    tokenize_example,
    tokenize_rows,
)
from mlora_lab.rl.prompts import EVAL_ROWS, RL_ROWS
from mlora_lab.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_jsonl(path: Path, lines: list[str | dict]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def targets(ex: Example) -> list[int]:
    """The label tokens that carry loss, in order."""
    return [t for t in ex.labels if t != IGNORE_INDEX]


# --------------------------------------------------------------------------- scan_source


GOOD = {"text": "hello world"}


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('"just a string"', "expected a JSON object"),
        ({"foo": "bar"}, "row has none of 'text', 'prompt'+'completion', 'messages'"),
        ({"text": 3}, "'text' must be a string"),
        ({"text": ""}, "'text' is empty"),
        ({"prompt": "p", "completion": 7}, "'completion' must be a string"),
        ({"prompt": ["p"], "completion": "c"}, "'prompt' must be a string"),
        ({"prompt": "p"}, "'prompt' without 'completion'"),
        ({"completion": "c"}, "'completion' without 'prompt'"),
        ({"text": "t", "messages": [{"role": "assistant", "content": "x"}]}, "use exactly one"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": "hi"}, "'messages' must be a non-empty list"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]},
            "messages[1] needs 'role' and 'content' strings",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}]},
            "messages has no assistant turn (nothing to learn)",
        ),
        # JSON "\ud800" parses into a str with no UTF-8 form: tokenizers raise on it
        ({"text": "a\ud800b"}, "'text' contains a lone surrogate (\\ud800), which is not valid text"),
        ({"prompt": "\udfff", "completion": "c"}, "'prompt' contains a lone surrogate (\\udfff)"),
        ({"prompt": "p", "completion": "x\ud83d"}, "'completion' contains a lone surrogate (\\ud83d)"),
        (
            {"messages": [{"role": "user", "content": "\udc80"}, {"role": "assistant", "content": "a"}]},
            "'messages[0].content' contains a lone surrogate (\\udc80), which is not valid text",
        ),
        (
            {"messages": [{"role": "us\ud800er", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "'messages[0].role' contains a lone surrogate (\\ud800)",
        ),
        ('{"text": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deeply)"),
    ],
)
def test_scan_reports_bad_row_with_line_number(tmp_path, bad_line, message):
    # line 1 good, line 2 blank (skipped but counted in line numbers), line 3 bad, line 4 good
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, "", bad_line, GOOD])
    report = scan_source(path)
    assert isinstance(report, SourceReport)
    assert report.n_rows == 3
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"{path} line 3: ")
    assert message in report.problems[0]
    with pytest.raises(DataError) as err:
        read_rows(path)
    assert err.value.problems == report.problems
    assert "line 3" in str(err.value)
    if isinstance(bad_line, dict) and "must" not in message and "JSON" not in message:
        with pytest.raises(DataError, match=re.escape(message)):  # never a tokenizer's exception
            tokenize_example(bad_line, build_tokenizer(), seq_len=32)


def test_a_surrogate_pair_is_one_character_and_fine(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00"}\n')  # JSON escapes of one emoji
    assert scan_source(path).problems == []
    assert read_rows(path) == [{"text": "smile \U0001f600"}]


def test_scan_missing_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert scan_source(missing).problems == [f"{missing}: file not found"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n\n")
    report = scan_source(empty)
    assert report.n_rows == 0
    assert report.problems == [f"{empty}: empty file (no rows)"]
    assert scan_source(tmp_path).problems == [f"{tmp_path}: not a regular file"]


def test_scan_refuses_what_is_not_a_regular_file_or_a_path(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")  # opening it would block: it is never opened
    assert scan_source(tmp_path / "fifo.jsonl").problems == [f"{tmp_path / 'fifo.jsonl'}: not a regular file"]
    assert scan_source("/dev/zero").problems == ["/dev/zero: not a regular file"]
    assert scan_source("a\0b.jsonl").problems == [
        "'a\\x00b.jsonl': the path contains a NUL byte, which no file name can hold"
    ]
    assert scan_source("a\ud800.jsonl").problems == [
        "'a\\ud800.jsonl': the path contains a lone surrogate (\\ud800), which is not valid text"
    ]
    (problem,) = scan_source("d" * 10_000_000).problems
    assert problem.startswith("'dddd") and len(problem) < 200  # the name is shortened, not repeated
    assert problem.endswith(
        "... (10,000,000 characters): the path is 10,000,000 characters long (at most 4096)"
    )
    (problem,) = scan_source(3).problems  # type: ignore[arg-type]
    assert problem.startswith("3: not a data source: it must be a .jsonl, .json, .parquet or .csv file path")
    assert target_problem("/dev/zero", build_tokenizer(), 8) == "/dev/zero: not a regular file"


def test_scan_reads_line_by_line(tmp_path, monkeypatch):
    """A 1.5 MB file is scanned with ~no memory: it is never read whole (nor split into a list)."""
    path = tmp_path / "big.jsonl"
    path.write_text('{"text": "one two three four five six seven eight"}\n' * 30_000)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read the whole file"))
    tracemalloc.start()
    report = scan_source(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert report == SourceReport(n_rows=30_000, kinds={"text"}, problems=[], columns={"text"})
    assert peak < 256 * 2**10, peak  # measured ~7 kB; reading it whole took > 1.5 MB, then a list of lines


def test_scan_bad_utf8_names_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    (problem,) = scan_source(path).problems
    assert problem.startswith(f"{path} line 2: not valid UTF-8")


def test_scan_good_file_kinds_and_read(tmp_path):
    rows = [
        {"text": "a"},
        {"prompt": "p", "completion": "c", "id": 7},  # extra keys are ignored
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    report = scan_source(path)
    assert report == SourceReport(
        n_rows=3,
        kinds={"text", "prompt", "messages"},
        problems=[],
        columns={"text", "prompt", "completion", "id", "messages"},
    )
    assert read_rows(path) == rows


def test_scan_caps_problems(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{bad"] * 50)
    report = scan_source(path)
    assert report.n_rows == 50
    assert len(report.problems) == 21
    assert report.problems[0].startswith(f"{path} line 1: ")
    assert report.problems[-1] == f"{path}: ... and 30 more problem(s)"


# --------------------------------------------------------------------------- tokenization


def test_text_row_loss_on_every_token(tok):
    ex, truncated = tokenize_example({"text": "hello world"}, tok, seq_len=64)
    assert not truncated
    assert ex.input_ids == [*tok("hello world").input_ids, tok.eos_token_id]
    assert ex.input_ids[0] == tok.bos_token_id
    assert ex.labels == ex.input_ids
    assert ex.n_target == len(ex.input_ids) - 1  # position 0 is never predicted


def test_prompt_completion_masks_prompt(tok):
    ex, _ = tokenize_example({"prompt": "what is one and two", "completion": " three"}, tok, seq_len=64)
    p_ids = tok("what is one and two").input_ids
    assert ex.input_ids[: len(p_ids)] == p_ids
    assert ex.labels[: len(p_ids)] == [IGNORE_INDEX] * len(p_ids)
    assert tok.decode(targets(ex)) == " three</s>"
    assert ex.n_target == len(ex.input_ids) - len(p_ids)


def test_messages_loss_on_assistant_turns_only(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "count to three"},
        {"role": "assistant", "content": "one two three"},
    ]
    ex, _ = tokenize_example({"messages": messages}, tok, seq_len=256)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert ex.input_ids == tok(full, add_special_tokens=False).input_ids
    assert ex.input_ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    # Each contiguous run of targets is one assistant turn: its content + EOS, nothing else.
    runs, run = [], []
    for t in [*ex.labels, IGNORE_INDEX]:
        if t == IGNORE_INDEX:
            if run:
                runs.append(tok.decode(run))
            run = []
        else:
            run.append(t)
    assert runs == ["hello world</s>", "one two three</s>"]
    masked = tok.decode([i for i, t in zip(ex.input_ids, ex.labels) if t == IGNORE_INDEX])
    assert "be brief" in masked and "count to three" in masked and "three</s>" not in masked


def test_messages_need_chat_template(tok):
    plain = build_tokenizer()
    plain.chat_template = None
    row = {"messages": [{"role": "assistant", "content": "x"}]}
    with pytest.raises(DataError, match="chat_template"):
        tokenize_example(row, plain, seq_len=32)


def test_messages_template_not_prefix_stable(tok):
    unstable = build_tokenizer()
    # Puts the number of messages up front, so no shorter rendering is a prefix of the full one.
    unstable.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match="not prefix-stable"):
        tokenize_example(row, unstable, seq_len=32)
    with pytest.raises(DataError, match=r"src row 1: .*not prefix-stable"):
        tokenize_rows([row], unstable, seq_len=32, source="src")


def test_no_duplicate_eos(tok):
    ex, _ = tokenize_example({"prompt": "p", "completion": "done</s>"}, tok, seq_len=32)
    assert ex.input_ids[-2:] != [tok.eos_token_id] * 2
    assert ex.input_ids[-1] == tok.eos_token_id


def test_truncation_keeps_start_and_warns_once_with_counts(tok, tmp_path):
    long = "one two three four five six seven eight nine ten " * 4
    rows = [
        {"text": long},
        {"prompt": long, "completion": "yes"},  # truncated inside the prompt: no target left, dropped
        {"text": "hi"},
        {"prompt": "q", "completion": long},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples = load_examples(path, tok, seq_len=16)
    assert len(caught) == 1 and issubclass(caught[0].category, UserWarning)
    msg = str(caught[0].message)
    assert str(path) in msg
    assert "3 of 4 row(s) truncated to seq_len=16" in msg
    assert "1 row(s) have no target token left and are dropped" in msg
    assert [len(e) for e in examples] == [16, len(tok("hi").input_ids) + 1, 16]
    full, _ = tokenize_example(rows[0], tok, seq_len=10_000)
    assert examples[0].input_ids == full.input_ids[:16]
    assert all(e.n_target > 0 for e in examples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenize_rows([{"text": "hi"}], tok, seq_len=16)  # nothing to report: no warning


# --------------------------------------------------------------------------- TenantStream


def make_examples(n: int) -> list[Example]:
    return [Example([1, i + 3], [1, i + 3]) for i in range(n)]


def ids(examples: list[Example]) -> list[int]:
    return [e.input_ids[1] - 3 for e in examples]


def test_stream_deterministic_and_seed_dependent():
    exs = make_examples(20)
    a = ids(TenantStream(exs, seed=1).take(50))
    assert a == ids(TenantStream(exs, seed=1).take(50))
    assert a != ids(TenantStream(exs, seed=2).take(50))


def test_stream_epoch_is_permutation_and_reshuffles():
    exs = make_examples(20)
    s = TenantStream(exs, seed=0)
    e0 = ids(s.take(20))
    assert (s.epoch, s.cursor) == (1, 0)
    e1 = ids(s.take(20))
    assert sorted(e0) == sorted(e1) == list(range(20))
    assert e0 != e1 and e0 != list(range(20))
    # take() crosses epoch boundaries seamlessly
    s2 = TenantStream(exs, seed=0)
    assert ids(s2.take(7) + s2.take(30) + s2.take(3)) == e0 + e1
    assert (s2.epoch, s2.cursor) == (2, 0)


def test_stream_no_shuffle_keeps_file_order():
    s = TenantStream(make_examples(5), seed=3, shuffle=False)
    assert ids(s.take(12)) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert (s.epoch, s.cursor) == (2, 2)


def test_stream_resume_continues_exactly():
    exs = make_examples(13)
    ref = TenantStream(exs, seed=5)
    expected = ids(ref.take(40))
    s = TenantStream(exs, seed=5)
    first = ids(s.take(17))
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON round trip
    resumed = TenantStream(exs, seed=5)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.cursor) == (s.epoch, s.cursor) == (1, 4)
    assert first + ids(resumed.take(23)) == expected
    with pytest.raises(ValueError, match="does not match"):
        TenantStream(make_examples(12), seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="does not match"):
        TenantStream(exs, seed=6).load_state_dict(state)


def test_stream_edge_cases():
    s = TenantStream([], seed=0)
    assert s.take(0) == []
    with pytest.raises(ValueError):
        s.take(1)
    with pytest.raises(ValueError):
        TenantStream(make_examples(2), seed=0).take(-1)


# --------------------------------------------------------------------------- collate


def test_collate_shapes_padding_and_segments():
    a = [Example([1, 5, 6], [-100, 5, 6]), Example([1, 7], [1, 7])]
    b: list[Example] = []
    c = [Example([1, 8, 9, 10, 11], [-100, -100, 9, 10, 11])]
    batch = collate([("alice", a), ("bob", b), ("carol", c)], pad_id=0)
    assert isinstance(batch, Batch)
    assert batch.num_rows == 3
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.labels.shape == (3, 5)
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.labels.dtype == torch.long
    assert batch.segments == [("alice", 0, 2), ("carol", 2, 3)]
    assert batch.input_ids.tolist() == [[1, 5, 6, 0, 0], [1, 7, 0, 0, 0], [1, 8, 9, 10, 11]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.labels.tolist() == [
        [-100, 5, 6, -100, -100],
        [1, 7, -100, -100, -100],
        [-100, -100, 9, 10, 11],
    ]
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.segments == batch.segments


def test_collate_pad_to_multiple_and_real_rows(tok):
    rows = [{"text": "hello"}, {"prompt": "count", "completion": " one two three"}]
    exs = tokenize_rows(rows, tok, seq_len=64)
    batch = collate([(0, exs[:1]), (1, exs[1:])], pad_id=tok.pad_token_id, pad_to_multiple_of=8)
    assert batch.input_ids.shape[1] % 8 == 0 and batch.input_ids.shape[1] >= max(len(e) for e in exs)
    for r, ex in enumerate(exs):
        n = len(ex)
        assert batch.input_ids[r, :n].tolist() == ex.input_ids
        assert (batch.input_ids[r, n:] == tok.pad_token_id).all()
        assert batch.attention_mask[r].sum().item() == n
        assert (batch.labels[r, n:] == IGNORE_INDEX).all()
    assert batch.segments == [(0, 0, 1), (1, 1, 2)]


def test_collate_no_rows():
    batch = collate([("a", [])], pad_id=0)
    assert batch.num_rows == 0 and batch.segments == []


# --------------------------------------------------------------------------- truncate, then tokenize


def reference_example(row: dict, tok, seq_len: int) -> tuple[list[int], list[int], bool]:
    """The tokenization before truncation came first: the whole row, then ``[:seq_len]``."""
    eos = tok.eos_token_id

    def enc(text: str, special: bool) -> list[int]:
        return list(tok(text, add_special_tokens=special)["input_ids"])

    def with_eos(ids: list[int]) -> list[int]:
        return [*ids, eos] if not ids or ids[-1] != eos else ids

    if "text" in row:
        ids = with_eos(enc(row["text"], True))
        labels = list(ids)
    elif "prompt" in row:
        p, c = enc(row["prompt"], True), with_eos(enc(row["completion"], False))
        ids, labels = p + c, [IGNORE_INDEX] * len(p) + c
    else:  # every turn located in the whole rendering, which is tokenized with offsets in one call
        msgs = row["messages"]
        full = tok.apply_chat_template(msgs, tokenize=False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                start = len(tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True))
                end = len(tok.apply_chat_template(msgs[: i + 1], tokenize=False))
                while end > start and full[end - 1].isspace():
                    end -= 1
                spans.append((start, end))
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        labels = [
            t if e > s and any(a <= s and e <= b for a, b in spans) else IGNORE_INDEX
            for t, (s, e) in zip(ids, enc["offset_mapping"])
        ]
    return ids[:seq_len], labels[:seq_len], len(ids) > seq_len


PIECES = [
    "hello",
    "world",
    "the",
    "model",
    "tenant",
    "é",
    "naïve",
    "中文字符",
    "😀",
    "👩\u200d👩\u200d👧",
    "ß",
    "e\u0301",
    "\u200b",
    "ﬁ",
    "</s>",
    "<s>",
    "<|user|>",
    "123456789",
    "!!!???",
    "\t",
    "\n\n",
    "\r\n",
    "'s",
]


def random_text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    while sum(map(len, out)) < n_chars:
        r = rng.random()
        if r < 0.08:
            out.append(rng.choice("abcxyz") * rng.randint(20, 400))  # a long word, no spaces
        elif r < 0.15:
            out.append(rng.choice([" ", "\n", "\t", " \n "]) * rng.randint(2, 60))  # a long whitespace run
        else:
            out.append(rng.choice(PIECES) + rng.choice(["", " ", " ", "  "]))
    return "".join(out)[:n_chars] or "x"


def random_row(rng: random.Random, kind: str, n_chars: int) -> dict:
    if kind == "text":
        return {"text": random_text(rng, n_chars)}
    if kind == "prompt":
        k = rng.randint(0, n_chars)
        return {"prompt": random_text(rng, k), "completion": random_text(rng, n_chars - k + 1)}
    turns = []
    for _ in range(rng.randint(1, 4)):
        turns += [
            {"role": "user", "content": random_text(rng, rng.randint(1, n_chars // 4 + 1))},
            {"role": "assistant", "content": random_text(rng, rng.randint(1, n_chars // 4 + 1))},
        ]
    return {"messages": turns}


@pytest.mark.parametrize("first_prefix", ["default", "one_char"])
def test_truncating_first_gives_exactly_the_whole_tokenization(tok, monkeypatch, first_prefix):
    """Over random rows (multi-byte characters, emoji and ZWJ sequences, long words without spaces,
    long whitespace runs, special-token text) of every kind, and seq_len anywhere including just
    around the row's length: the same ids, labels and truncation flag as tokenizing the whole row.
    ``one_char`` starts every row from a 1-character prefix, so each row goes through many cuts."""
    if first_prefix == "one_char":
        monkeypatch.setattr(mlora_lab.data, "_HEAD_MIN_CHARS", 1)
        monkeypatch.setattr(mlora_lab.data, "_HEAD_CHARS_PER_TOKEN", 1)
    rng = random.Random(0)
    n_cut = 0
    for i in range(240):
        kind = ("text", "prompt", "messages")[i % 3]
        n_chars = rng.choice([rng.randint(1, 300), rng.randint(1000, 6000)])
        row = random_row(rng, kind, n_chars)
        full = len(reference_example(row, tok, 10**9)[0])
        for seq_len in {1, 2, rng.randint(3, 64), max(full - 1, 1), full, full + 1, rng.randint(1, full + 2)}:
            ex, truncated = tokenize_example(row, tok, seq_len)
            assert (ex.input_ids, ex.labels, truncated) == reference_example(row, tok, seq_len), (
                i,
                seq_len,
                row,
            )
            n_cut += truncated
    assert n_cut > 500  # the cut path was taken, not only the whole one


@pytest.mark.parametrize("kind", ["words", "no_spaces", "prompt"])
def test_a_50_mb_row_is_cut_before_it_is_tokenized(tok, kind):
    """One 50 MB line costs milliseconds and ~no memory (tokenizing it whole took ~100 s and 7-9 GB)."""
    big = "word " * 10_000_000 if kind != "no_spaces" else "ab" * 25_000_000
    row = {"prompt": big, "completion": big} if kind == "prompt" else {"text": big}
    tracemalloc.start()
    start = time.perf_counter()
    ex, truncated = tokenize_example(row, tok, seq_len=512)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert truncated and len(ex) == 512
    assert ex.input_ids == tok(big[:20_000]).input_ids[:512]
    assert ex.n_target == (0 if kind == "prompt" else 511)
    assert elapsed < 1.0, elapsed
    assert peak < 20 * 2**20, peak  # measured ~0.2 MB; the limit leaves room for slower machines


def test_a_chat_of_many_turns_renders_only_the_turns_it_keeps(tok):
    """20k turns: the whole conversation is rendered once, then only the turns inside the kept
    tokens (rendering every turn's prefix was quadratic: minutes)."""
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(20_000)]
    start = time.perf_counter()
    ex, truncated = tokenize_example({"messages": turns}, tok, seq_len=64)
    assert time.perf_counter() - start < 3.0
    assert truncated and len(ex) == 64
    assert (ex.input_ids, ex.labels, truncated) == reference_example({"messages": turns[:20]}, tok, 64)


def test_rows_left_without_targets_are_dropped_and_a_file_with_none_is_refused(tok, tmp_path):
    long = "one two three four five six seven eight nine ten"
    cut = {"prompt": long, "completion": " yes"}
    path = write_jsonl(tmp_path / "cut.jsonl", [cut] * 3)
    message = f"{path}: all 3 row(s) lose their target tokens when truncated to seq_len=8; raise seq_len or shorten the prompts"
    with pytest.raises(DataError) as err:
        load_examples(path, tok, seq_len=8)
    assert err.value.problems == [message]
    assert target_problem(path, tok, 8) == message
    assert target_problem(path, tok, 64) is None
    assert len(load_examples(path, tok, seq_len=64)) == 3
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [cut, {"text": "hi"}, cut])
    with pytest.warns(UserWarning, match=r"2 row\(s\) have no target token left and are dropped"):
        (example,) = load_examples(mixed, tok, seq_len=8)
    assert example.n_target > 0
    assert target_problem(mixed, tok, 8) is None
    assert tokenize_rows([], tok, seq_len=8) == []


# --------------------------------------------------------------------------- RL prompts


class Spy:
    """A tokenizer that records the longest text it was asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_rn8_rl_prompts_far_longer_than_their_room_are_cut_first_keeping_their_end_and_warned(tok, tmp_path):
    """RN8: RL prompts longer than ``seq_len - max_new_tokens`` keep their last tokens (the end is where a
    prompt asks), exactly those of the whole tokenization, are cut before they are tokenized whole (a 2-MB
    prompt costs a few kB of tokenizing, as an SFT row does), and one warning counts them, as SFT rows'."""
    from mlora_lab.rl.prompt_tokens import load_prompts

    rng = random.Random(1)
    far = "word " * 400_000 + random_text(rng, 3000)  # (2 MB; the reference below tokenizes it whole)
    chat = [{"role": "user", "content": "word " * 60_000 + random_text(rng, 3000) + " what is 2 + 2?"}]
    rows = [{"prompt": far}, {"prompt": "2 + 2 =", "answer": "4"}, {"messages": chat}, {"prompt": chat}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    spy = Spy(tok)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = load_prompts(path, spy, max_tokens=40)
    assert spy.longest < 50_000, spy.longest
    assert [str(w.message) for w in caught] == [
        f"{path}: 3 of 4 prompt(s) truncated to their last 40 tokens (seq_len - max_new_tokens)"
    ]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    whole = [
        tok(far)["input_ids"],
        tok("2 + 2 =")["input_ids"],
        tok(rendered, add_special_tokens=False)["input_ids"],
        tok(rendered, add_special_tokens=False)["input_ids"],
    ]
    assert [p.ids for p in got] == [w[-40:] for w in whole]
    assert [p.prompt for p in got] == [far, "2 + 2 =", chat, chat]
    assert got[1].columns == {"answer": "4"} and got[0].text == far and got[2].text == rendered


@pytest.mark.parametrize("first_suffix", ["default", "one_char"])
def test_rn8_cutting_a_prompt_first_gives_exactly_the_end_of_its_whole_tokenization(
    tok, monkeypatch, first_suffix
):
    """RN8: over random texts (multi-byte characters, emoji, long words, whitespace runs, special-token
    text) and rooms anywhere, including around the prompt's length: the ids and the cut flag are those of
    tokenizing the whole prompt and keeping its last tokens."""
    from mlora_lab.rl.prompt_tokens import encode_prompt_cut

    if first_suffix == "one_char":
        monkeypatch.setattr(mlora_lab.data, "_HEAD_MIN_CHARS", 1)
        monkeypatch.setattr(mlora_lab.data, "_HEAD_CHARS_PER_TOKEN", 1)
    rng = random.Random(2)
    n_cut = 0
    for i in range(200):
        text = random_text(rng, rng.choice([rng.randint(1, 300), rng.randint(1000, 6000)]))
        row = {"prompt": text} if i % 2 else {"messages": [{"role": "user", "content": text}]}
        chat = "messages" in row
        fed = (
            tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            if chat
            else text
        )
        full = tok(fed, add_special_tokens=not chat)["input_ids"]
        for room in {1, 2, rng.randint(3, 64), max(len(full) - 1, 1), len(full), len(full) + 1}:
            _, shown, ids, cut = encode_prompt_cut(row, tok, max_tokens=room)
            assert (shown, ids, cut) == (fed, full[-room:], len(full) > room), (i, room, row)
            n_cut += cut
    assert n_cut > 300  # the cut path was taken, not only the whole one


def test_ev6_prompt_rows_are_named_for_what_they_are_for():
    """EV6: a prompt row without a prompt is "an RL row" to an RL tenant's reader and "an evaluation row" to
    an evaluation's (``prompts=`` names what the rows are for)."""
    rows = [{"prompt": "ok"}, {"answer": "4"}]
    needs = "needs 'prompt' (a text, or a chat as a list of messages) or 'messages' to complete; this one has neither"
    assert f"row 1: an RL row {needs}" in scan_source(rows, prompts=RL_ROWS).problems[0]
    assert f"row 1: an evaluation row {needs}" in scan_source(rows, prompts=EVAL_ROWS).problems[0]
    with pytest.raises(DataError, match=f"row 1: an evaluation row {re.escape(needs)}"):
        read_rows(rows, prompts=EVAL_ROWS)
    # a column named like an argument the job passes is refused for the functions these rows reach
    named = [{"prompt": "ok", "completions": "x"}]
    assert "every reward function" in scan_source(named, prompts=RL_ROWS).problems[0]
    assert "every metric function" in scan_source(named, prompts=EVAL_ROWS).problems[0]
