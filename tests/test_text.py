"""mlora_lab.text: showing hostile values in short messages and reading hostile paths and JSON, never
raising and never echoing a value whole."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

from mlora_lab.text import (
    MAX_JSON_BYTES,
    brief,
    brief_list,
    error_line,
    is_finite,
    is_int,
    is_number,
    json_type,
    parse_json,
    path_problem,
    read_json,
    show_path,
    shown_text,
)


def deep_list(depth: int) -> list:
    """``[[[...]]]`` nested ``depth`` levels, built without recursion."""
    root: list = []
    node = root
    for _ in range(depth - 1):
        child: list = []
        node.append(child)
        node = child
    return root


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def test_text_imports_nothing_of_the_package_and_no_torch():
    code = (
        "import sys, mlora_lab.text\n"
        "assert 'torch' not in sys.modules\n"
        "assert {m for m in sys.modules if m.startswith('mlora_lab')} == {'mlora_lab', 'mlora_lab.text'}, "
        "sorted(m for m in sys.modules if m.startswith('mlora_lab'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# brief, brief_list, error_line
# ---------------------------------------------------------------------------------------------


def test_brief_shows_short_values_as_repr():
    assert brief("alice") == "'alice'"
    assert brief(3) == "3" and brief(2e-4) == "0.0002" and brief(None) == "None" and brief(True) == "True"
    assert brief(["q_proj", "v_proj"]) == "['q_proj', 'v_proj']"
    assert brief(float("nan")) == "nan" and brief(float("-inf")) == "-inf"
    assert brief("x" * 80) == repr("x" * 80)  # exactly at the limit: whole


def test_brief_cuts_a_huge_string_without_copying_it():
    huge = "x" * 10_000_000
    tracemalloc.start()
    try:
        shown = brief(huge)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000  # a slice of ~80 characters, never a 10-MB repr
    assert shown == "'" + "x" * 76 + "... (10,000,000 characters)"
    assert len(brief("y" * 81)) < 120 and brief("y" * 81).endswith("(81 characters)")
    assert len(brief("z" * 500, limit=200)) < 240


def test_brief_escapes_control_characters():
    shown = brief("a\nb\rc\x1b[31mred\x00\u202e")
    assert shown.isprintable() and "\n" not in shown and "\x1b" not in shown and "\u202e" not in shown
    assert shown == repr("a\nb\rc\x1b[31mred\x00\u202e")
    # escapes can make the repr longer than the string: still at most about the limit
    assert len(brief("\x00" * 79)) <= 80


def test_shown_text_keeps_lines_escapes_hidden_characters_and_cuts_in_the_middle():
    assert shown_text("line one\n\tline two", 100) == "line one\n\tline two"  # as it is: lines and tabs
    # a terminal escape, a carriage return, NUL, a bidi override, a zero-width space, a lone surrogate
    hostile = "a\x1b[31mb\rc\x00d\u202ee\u200bf\ud800g\x85h"
    shown = shown_text(hostile, 100)
    assert shown == "a\\x1b[31mb\\rc\\x00d\\u202ee\\u200bf\\ud800g\\x85h"
    assert shown.isprintable() and shown.encode("utf-8")  # valid text, nothing hidden
    long = "BEGIN " + "x" * 10_000 + " END"
    cut = shown_text(long, 90)
    assert cut.startswith("BEGIN xxx") and cut.endswith("xx END") and "[10,010 characters]" in cut
    assert len(cut) < 90 + 30
    assert shown_text("", 10) == "" and shown_text("é中文 ok", 10) == "é中文 ok"  # printable: untouched


def test_brief_names_huge_integers_by_their_digits():
    assert brief(10**400) == "a 401-digit integer"
    assert brief(-(10**400)) == "-a 401-digit integer"
    # past Python's 4300-digit limit repr() raises; brief never does
    assert brief(10**5000) == "a 5001-digit integer"
    assert brief(2**63) == str(2**63)  # 64 bits is an ordinary integer


def test_brief_of_bytes_containers_and_deep_nesting():
    shown = brief(b"\xff\x00" * 10_000)
    assert len(shown) <= 80 and shown.startswith("b'\\xff\\x00")
    assert len(brief(list(range(10_000)))) <= 80
    assert len(brief({str(i): i for i in range(10_000)})) <= 80
    shown = brief(deep_list(100_000))  # repr() would raise RecursionError
    assert shown == "[[[...]]]"
    cyclic: list = []
    cyclic.append(cyclic)
    assert len(brief(cyclic)) <= 80


class BadSlice(str):
    def __getitem__(self, key: object) -> str:
        raise RuntimeError("no slicing")


def test_brief_of_a_value_whose_repr_raises():
    assert brief(BadRepr()).startswith("<BadRepr instance at 0x")  # reprlib's own fallback
    assert brief([BadRepr()]).startswith("[<BadRepr instance at 0x")
    assert brief(BadSlice("abc")) == "<BadSlice>"  # anything else that raises: the type's name


def test_brief_list_shortens_each_entry_and_counts_the_rest():
    assert brief_list(["a", "b"]) == "a, b"
    assert brief_list([f"m{i}" for i in range(15)]) == "m0, m1, m2, m3, m4, m5, m6, m7, m8, m9 and 5 more"
    assert brief_list(["a", "b", "c"], n=2) == "a, b and 1 more"
    assert brief_list([]) == ""
    shown = brief_list(["ok", "bad\nline", "x" * 10_000, 10**400, None])
    assert shown.isprintable() and len(shown) < 250
    assert shown.startswith("ok, 'bad\\nline', 'xxx") and shown.endswith(", a 401-digit integer, None")


def test_error_line_is_the_first_line_of_the_message():
    assert error_line(ValueError("first line\nsecond line")) == "first line"
    assert error_line(ValueError("  padded  ")) == "padded"
    assert error_line(ValueError()) == "ValueError"
    assert error_line(KeyError("k")) == "'k'"
    long = error_line(RuntimeError("e" * 10_000))
    assert len(long) == 300 and long.endswith("...")
    assert len(error_line(RuntimeError("e" * 100), limit=50)) == 50
    assert error_line(BadStr()) == "BadStr"


# ---------------------------------------------------------------------------------------------
# What a value is
# ---------------------------------------------------------------------------------------------


def test_value_predicates_refuse_bools_strings_and_non_finite_numbers():
    assert is_int(3) and is_int(10**400) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_number(3) and is_number(2.5) and is_number(math.nan) and not is_number(False)
    assert not is_number("1") and not is_number(None) and not is_number(b"1")
    assert is_finite(1) and is_finite(-2.5) and is_finite(2**1000)
    assert not is_finite(math.nan) and not is_finite(math.inf) and not is_finite(-math.inf)
    assert not is_finite(10**400)  # too large for a float: OverflowError inside, False outside
    assert not is_finite(True) and not is_finite("1") and not is_finite(None)


def test_json_type_names_parsed_values():
    values = {"an object": {}, "an array": [], "a string": "", "true/false": False, "null": None}
    for name, v in values.items():
        assert json_type(v) == name
    assert json_type(1) == json_type(1.5) == json_type(math.nan) == "a number"
    assert json_type(b"x") == "bytes" and json_type((1,)) == "tuple"


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def test_path_problem_names_what_no_file_can_be_called():
    assert path_problem("data/alice.jsonl") is None
    assert path_problem("a\nb") is None  # odd but a valid file name
    assert path_problem("a\0b") == "contains a NUL byte, which no file name can hold"
    assert path_problem("x" * 4097) == "is 4,097 characters long (at most 4096)"
    assert path_problem("x" * 4096) is None
    assert path_problem("bad \ud800 name") == ("contains a lone surrogate (\\ud800), which is not valid text")


def test_show_path_keeps_plain_paths_and_escapes_hostile_ones():
    assert show_path("/data/alice.jsonl") == "/data/alice.jsonl"
    assert show_path(Path("/data/a.jsonl")) == "/data/a.jsonl"
    for hostile in ("a\nforged line", "\x1b[2J", "a\0b", "x\ud800", "p" * 10_000):
        shown = show_path(hostile)
        assert shown.isprintable() and len(shown) <= 120, shown
        shown.encode("utf-8")  # a lone surrogate is escaped, so the message can be printed anywhere
    assert show_path("a\nforged line") == repr("a\nforged line")


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def test_parse_json_gives_a_value_or_a_reason():
    assert parse_json('{"a": [1, 2.5, null]}') == ({"a": [1, 2.5, None]}, None)
    assert parse_json(b'{"a": 1}') == ({"a": 1}, None)
    assert parse_json("null") == (None, None)  # a JSON null is a value, not a failure
    assert parse_json('{\n  "a": 1\n  "b": 2}') == (None, "Expecting ',' delimiter at line 3 column 3")
    assert parse_json("") == (None, "Expecting value at line 1 column 1")
    value, why = parse_json("NaN")  # Python's reader takes it; the validator then says "finite number"
    assert why is None and math.isnan(value)


def test_parse_json_survives_deep_nesting_huge_numbers_and_wrong_types():
    assert parse_json("[" * 100_000 + "]" * 100_000) == (None, "nested too deeply")
    assert parse_json("1" * 5000) == (None, "a number has more than 4300 digits")
    value, why = parse_json(b"\xff\xfe\x00")
    assert value is None and why
    value, why = parse_json(None)  # type: ignore[arg-type]
    assert value is None and "NoneType" in why


def test_read_json_reads_a_file_and_says_why_not(tmp_path):
    good = tmp_path / "job.json"
    good.write_text(json.dumps({"base_model": "m", "tenants": []}))
    assert read_json(str(good), "a job file") == ({"base_model": "m", "tenants": []}, None)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf[1]")
    assert read_json(str(bom), "a job file") == ([1], None)

    def why(path: str | Path) -> str | None:
        value, reason = read_json(str(path), "a job file")
        assert value is None
        return reason

    assert why(tmp_path / "missing.json") == "not found"
    assert why(good / "below_a_file.json") == "not found"
    assert why(tmp_path) == "is a directory, not a job file"
    assert why("a\0b") == "the path contains a NUL byte, which no file name can hold"
    assert why("x\ud800") == "the path contains a lone surrogate (\\ud800), which is not valid text"
    bad_utf8 = tmp_path / "latin1.json"
    bad_utf8.write_bytes(b'{"name": "caf\xe9"}')
    assert why(bad_utf8) == "not UTF-8 text (byte 0xe9 at position 13)"
    broken = tmp_path / "broken.json"
    broken.write_text('{"a": ')
    assert why(broken) == "not valid JSON (Expecting value at line 1 column 7)"
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert why(deep) == "not valid JSON (nested too deeply)"


def test_read_json_opens_nothing_but_a_regular_file_of_sane_size(tmp_path):
    if os.path.exists("/dev/zero"):  # reading it would never end
        assert read_json("/dev/zero", "an adapter config") == (
            None,
            "is not a regular file (a device, pipe or socket), not an adapter config",
        )
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it would block until a writer comes
    assert (
        read_json(str(fifo), "a job file")[1]
        == "is not a regular file (a device, pipe or socket), not a job file"
    )
    sparse = tmp_path / "huge.json"
    with open(sparse, "wb") as fh:
        fh.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used, and never read
    assert read_json(str(sparse), "a job file") == (
        None,
        "is 64 MiB, too large for a job file (at most 64 MiB)",
    )
