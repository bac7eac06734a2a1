"""How sbatch reads the ``#SBATCH`` lines of a batch script: what an option means before it is submitted.

sbatch (Slurm 22.05, ``src/sbatch/opt.c``) reads the script's ``#SBATCH`` lines up to its first command
and cuts each into words (``get_argument``): words are separated by ASCII whitespace; single or double
quotes group characters and are dropped; a backslash keeps the next character as it is; an unquoted
``#`` ends the line (a comment); a word ``hetjob`` (or ``packjob``) is a heterogeneous-job separator and
ends the line's words; a word starting with ``:`` is fatal. The words of *all* lines form one argument
vector, read once by glibc's ``getopt_long`` with sbatch's option table (``src/common/slurm_opt.c``)
and the option string ``"+..."``, so:

- a long option may be abbreviated to any prefix that names one option (``--outp`` is ``--output``);
  an exact name wins over longer ones (``--mem``); a prefix of several is refused as ambiguous;
- its value follows ``=`` or is the next word (``--qos high``), *even a word of the next line*, and
  then whatever that word says (``--output=/x``) is a value, not an option; an option with an
  optional value takes one only after ``=``;
- short options bundle (``-Hk``): a letter that takes a value takes the rest of the word
  (``-o/x``) or the next word (``-o /x``);
- the first word that is not an option ends the options, and sbatch refuses the script.

Later lines override earlier ones (``--output`` given twice: the second wins). :func:`read_line` reads
one line's text as sbatch would, and says what is odd about it (see :class:`LineReading`).
This module imports nothing of mlora_lab: it is a model of sbatch, checked against the installed one
by ``tests/lab/slurm/test_slurm.py`` (every option and abbreviation, and ``sbatch --verbose``'s reading of lines).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

__all__ = [
    "NO_VALUE",
    "OPTIONAL",
    "OPTIONS",
    "REQUIRED",
    "SHORT",
    "LineReading",
    "Option",
    "read_line",
    "resolve",
]

NO_VALUE, REQUIRED, OPTIONAL = "none", "required", "optional"

# sbatch's getopt table in Slurm 22.05 (common_options of src/common/slurm_opt.c that sbatch takes), in
# table order: "--name=" takes a value, "--name[=]" an optional one (only as --name=value), "--name" none;
# "-X" before a name is its short form.
_TABLE = """
-A --account=  --acctg-freq=  -a --array=  --batch=  -b --begin=  --bb=  --bbf=
--cluster-constraint=  -D --chdir=  --cluster=  -M --clusters=  --comment=  --container=
--context=  --contiguous  -C --constraint=  -S --core-spec=  --cores-per-socket=  --cpu-freq=
--cpus-per-gpu=  -c --cpus-per-task=  --deadline=  --delay-boot=  -d --dependency=
-m --distribution=  -e --error=  -x --exclude=  --exclusive[=]  --export=  --export-file=
-B --extra-node-info=  --get-user-env[=]  --gid=  --gpu-bind=  --gpu-freq=  -G --gpus=
--gpus-per-node=  --gpus-per-socket=  --gpus-per-task=  --gres=  --gres-flags=  -h --help  --hint=
-H --hold  --ignore-pbs  -i --input=  -J --job-name=  --kill-on-invalid-dep=  -L --licenses=
--mail-type=  --mail-user=  --mcs-label=  --mem=  --mem-bind=  --mem-per-cpu=  --mem-per-gpu=
--mincpus=  --network=  --nice[=]  -k --no-kill[=]  --no-requeue  -F --nodefile=  -w --nodelist=
-N --nodes=  -n --ntasks=  --ntasks-per-core=  --ntasks-per-gpu=  --ntasks-per-node=
--ntasks-per-socket=  --ntasks-per-tres=  --open-mode=  -o --output=  -O --overcommit
-s --oversubscribe  --parsable  -p --partition=  --power=  --prefer=  --priority=  --profile=
--propagate[=]  -q --qos=  -Q --quiet  --reboot  --requeue  --reservation=  --signal=
--sockets-per-node=  --spread-job  --switches=  --tasks-per-node=  --test-only  --thread-spec=
--threads-per-core=  -t --time=  --time-min=  --tmp=  --uid=  --use-min-nodes  -v --verbose
-V --version  --usage  -W --wait  --wait-all-nodes=  --wckey=  --wrap=
"""
# Two names of one option (the same getopt value): a prefix of both is not ambiguous.
_ALIASES = {"tasks-per-node": "ntasks-per-node"}


@dataclass(frozen=True)
class Option:
    """One option of sbatch's table."""

    name: str
    """Its long name, without dashes (``"output"``)."""
    value: str
    """Whether it takes a value: :data:`NO_VALUE`, :data:`REQUIRED` or :data:`OPTIONAL` (after ``=`` only)."""
    short: str | None = None
    """Its one-letter form (``"o"``), if any."""

    @property
    def canonical(self) -> str:
        """The option this name stands for (``ntasks-per-node`` for its alias ``tasks-per-node``)."""
        return _ALIASES.get(self.name, self.name)


def _parse_table(text: str) -> dict[str, Option]:
    options, short = {}, None
    for word in text.split():
        if not word.startswith("--"):
            short = word[1]
            continue
        name, kind = word[2:], NO_VALUE
        if name.endswith("[=]"):
            name, kind = name[:-3], OPTIONAL
        elif name.endswith("="):
            name, kind = name[:-1], REQUIRED
        options[name] = Option(name, kind, short)
        short = None
    return options


OPTIONS: dict[str, Option] = _parse_table(_TABLE)
"""sbatch's long options by name, in table order."""
SHORT: dict[str, Option] = {o.short: o for o in OPTIONS.values() if o.short}
"""sbatch's short options by letter."""


def resolve(name: str) -> Option | list[str] | None:
    """What ``--name`` is to sbatch (glibc ``getopt_long``): the option it names exactly or abbreviates,
    the sorted names it could abbreviate when those are several options, or None for no option."""
    if name in OPTIONS:
        return OPTIONS[name]
    found = [o for o in OPTIONS.values() if name and o.name.startswith(name)]
    if len({o.canonical for o in found}) > 1:
        return sorted(o.name for o in found)
    return found[0] if found else None


# sbatch's input variables (read after the script's #SBATCH lines, so they override them; the command
# line overrides both): SBATCH_<NAME> sets --name, but for these.
_VARIABLE_OPTIONS = {
    "ARRAY_INX": "array",
    "BURST_BUFFER": "bb",
    "CPU_FREQ_REQ": "cpu-freq",
    "DEBUG": "verbose",
    "MEM_PER_NODE": "mem",
    "REQ_SWITCH": "switches",
    "TIMELIMIT": "time",
}


def variable_option(variable: str) -> str | None:
    """The option an ``SBATCH_*`` input variable of sbatch sets (``SBATCH_OUTPUT``: ``output``,
    ``SBATCH_TIMELIMIT``: ``time``), None for another variable."""
    if not variable.startswith("SBATCH_"):
        return None
    rest = variable.removeprefix("SBATCH_")
    return _VARIABLE_OPTIONS.get(rest, rest.lower().replace("_", "-"))


@dataclass(frozen=True)
class Given:
    """One option as a line gives it."""

    spelled: str
    """How it is written: ``"--outp"``, ``"-o"`` (the ``-o`` of ``-Ho/x`` too)."""
    option: Option | None
    """The option sbatch reads (None: a long option sbatch 22.05 does not have)."""
    value: str | None = None


@dataclass
class LineReading:
    """What sbatch reads from one ``#SBATCH`` line's text (the words after ``#SBATCH``)."""

    words: list[str] = field(default_factory=list)
    """The line's words, as sbatch cuts them (quotes and backslashes removed)."""
    given: list[Given] = field(default_factory=list)
    """Every option the words give, in order (a value word is part of its option)."""
    problems: list[str] = field(default_factory=list)
    """Why sbatch would refuse the line, or read it otherwise than it looks (each a phrase)."""


_SPACE = " \t\n\v\f\r"  # C's isspace


def _not_ascii(text: str) -> str | None:
    for c in text:
        if not " " <= c <= "~":
            return f"{c!r} (U+{ord(c):04X}, {unicodedata.name(c, 'a control character')})"
    return None


def _separator(text: str, pos: int) -> str | None:
    """The heterogeneous-job separator (``hetjob``, or the older ``packjob``) at ``pos``, if one is."""
    for sep in ("hetjob", "packjob"):
        end = pos + len(sep)
        if text[pos:end].lower() == sep and (end == len(text) or text[end] in _SPACE):
            return text[pos:end]
    return None


def split_words(text: str) -> tuple[list[str], list[str]]:
    """The words sbatch's ``get_argument`` cuts ``text`` into, and what makes it read fewer words than
    the text shows: an unquoted ``#`` (a comment to the end of the line), an empty quoted word (sbatch
    stops reading the line there), a ``hetjob``/``packjob`` separator, a word starting with ``:`` (fatal),
    an unmatched quote (fatal), a trailing backslash. As in sbatch, a backslash keeps the next character
    (a quote, ``#``), but never joins words: ``a\\ b`` is two words."""
    words: list[str] = []
    problems: list[str] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos] in _SPACE:
            pos += 1
        if (sep := _separator(text, pos)) is not None:
            problems.append(
                f"{sep!r} is a heterogeneous-job separator to sbatch: it ends the line's options, and the "
                "script's next #SBATCH lines would be another job's"
            )
            break
        if pos == n:
            break
        if text[pos] == ":":
            problems.append("a word starting with ':' is fatal to sbatch (a heterogeneous-job separator)")
            break
        word: list[str] = []
        quote, escape, start = "", False, pos
        while pos < n and (quote or text[pos] not in _SPACE):
            c = text[pos]
            pos += 1
            if escape:
                escape = False
            elif c == "\\":
                escape = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "\"'":
                quote = c
                continue
            elif c == "#":
                problems.append(
                    f"an unquoted '#' starts a comment in an #SBATCH line: sbatch would drop "
                    f"{text[pos - 1 :].strip()!r} (quote or escape it)"
                )
                pos = n
                break
            word.append(c)
        if quote:
            problems.append(f"it has an unmatched {quote} (fatal to sbatch)")
            break
        if escape:
            problems.append(
                "a backslash before a space does not join words in an #SBATCH line (sbatch drops it and "
                "ends the word there): quote the value instead"
                if pos < n
                else "it ends in a backslash, which sbatch would drop"
            )
        if not word:
            if text[start] in "\"'":
                problems.append(
                    "it holds an empty word ('' or \"\"), at which sbatch stops reading the line: "
                    "the words after it would be dropped"
                )
            break
        words.append("".join(word))
    return words, problems


def _take_value(option: Option, spelled: str, words: list[str], i: int, out: LineReading) -> int:
    """The value of a long or short ``option`` that takes one and had none attached: the next word."""
    if i < len(words):
        out.given.append(Given(spelled, option, words[i]))
        return i + 1
    out.given.append(Given(spelled, option))
    out.problems.append(
        f"{spelled} needs a value in the same entry ({spelled}=VALUE): alone, sbatch would take the "
        "first word of the next #SBATCH line as its value"
    )
    return i


def read_line(text: str) -> LineReading:
    """Read ``text`` as sbatch reads an ``#SBATCH`` line holding it: its words, the options they give
    (abbreviations resolved, short options unbundled, values attached or in the next word), and every
    problem: not ASCII, a comment, a quote or separator sbatch treats specially, an ambiguous or
    unknown option, a value missing or given to an option that takes none, a word that is no option."""
    out = LineReading()
    if (bad := _not_ascii(text)) is not None:
        out.problems.append(
            f"it holds {bad}: sbatch reads only ASCII '-' as a dash and ASCII spaces between words; "
            "write the option in ASCII"
        )
        return out
    out.words, out.problems = split_words(text)
    words, i = out.words, 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            out.problems.append(
                "'--' ends sbatch's options: any word after it would make sbatch refuse the script"
            )
            break
        elif word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            found = resolve(name)
            spelled = "--" + name
            if not name:
                out.problems.append(f"{word!r} names no option (sbatch refuses it as ambiguous)")
            elif isinstance(found, list):
                out.problems.append(
                    f"{spelled} is ambiguous to sbatch (it abbreviates --{', --'.join(found)}): write the "
                    "option in full"
                )
            elif found is None:  # not a 22.05 option (a newer Slurm's?): the cluster's sbatch judges it
                out.given.append(Given(spelled, None, value if eq else None))
                if i < len(words):
                    out.problems.append(
                        f"{spelled} is not an option of sbatch 22.05, so whether {words[i]!r} is its value "
                        f"is unknown: write {spelled}=VALUE"
                    )
            elif eq:
                out.given.append(Given(spelled, found, value))
                if found.value == NO_VALUE:
                    out.problems.append(f"--{found.name} takes no value (sbatch refuses {word!r})")
            elif found.value == REQUIRED:
                i = _take_value(found, spelled, words, i, out)
            else:
                out.given.append(Given(spelled, found))
        elif word.startswith("-") and word != "-":
            j = 1
            while j < len(word):
                letter, j = word[j], j + 1
                found = SHORT.get(letter)
                if found is None:
                    out.problems.append(f"sbatch has no option -{letter} (in {word!r})")
                    break
                if found.value == NO_VALUE:
                    out.given.append(Given("-" + letter, found))
                    continue
                if j < len(word):  # -o/x, -kVALUE: the rest of the word is the value
                    out.given.append(Given("-" + letter, found, word[j:]))
                elif found.value == REQUIRED:
                    i = _take_value(found, "-" + letter, words, i, out)
                else:
                    out.given.append(Given("-" + letter, found))
                break
        else:
            out.problems.append(
                f"{word!r} is not an sbatch option (options start with '-'), and sbatch refuses a script "
                "whose #SBATCH lines hold one"
            )
            break  # sbatch stops reading options at the first word that is none
    return out


def script_options(script: str) -> set[str]:
    """The (canonical) names of the options a batch script's ``#SBATCH`` lines give, read as sbatch
    reads them: the lines before its first command."""
    found = set()
    for line in script.splitlines():
        for magic in ("#SBATCH", "#SLURM"):  # (#SLURM: an old spelling sbatch still reads)
            if line.startswith(magic):
                found |= {g.option.canonical for g in read_line(line[len(magic) :]).given if g.option}
                break
        else:
            if line.strip() and not line.strip().startswith("#"):
                break
    return found
