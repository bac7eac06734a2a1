"""Built-in evaluation metrics, with the signature of TRL's reward functions.

A metric is called as a reward is (:mod:`mlora_lab.rl.rewards`): keyword arguments ``prompts``,
``completions`` (text, or ``[{"role": "assistant", "content": text}]`` for a chat prompt), ``completion_ids``
and every other column of the evaluation rows, one value per completion; it returns one number per
completion, ``None`` for "not scored". So any reward function is a metric, and these are rewards too.

The built-ins compare a completion with the row's reference, the first of the columns :data:`REFERENCE_COLUMNS`
it has (``answer``, as GSM8K's rows name it, then ``reference``, ``solution``, ``target``, ``completion``):

==================  ================================================================================
``exact_match``     1.0 when the completion equals the reference, both stripped of surrounding whitespace
``contains``        1.0 when the completion contains the reference (stripped)
``regex``           1.0 when the completion matches the row's ``pattern`` column (``re.search``); or
                    :class:`Regex` for one pattern for every row
``numeric_match``   1.0 when the completion's final number equals the reference's (GSM8K's ``#### 42``
                    answers: the number after ``####``, else the last number; ``1,234`` and ``$5`` read as
                    numbers), to a relative 1e-6
``rouge``           ROUGE-L F1 through the ``rouge_score`` package (the one ``evaluate``'s ROUGE wraps),
                    when it is installed
==================  ================================================================================

Two ask a model: :class:`Judge` rates each completion on a scale; :class:`WinRate` asks a judge which of two
answers is better, the completion or a baseline's (the base model's, a preference row's ``chosen``), in
both orders, and scores wins, ties and losses as 1, ½ and 0.
"""

from __future__ import annotations

import math
import os
import re
import string
from collections.abc import Sequence
from typing import Any

from mlora_lab.text import brief, error_line, parse_json, show_path

REFERENCE_COLUMNS = ("answer", "reference", "solution", "target", "completion")
"""The columns a built-in metric takes the reference from, the first a row has."""

BUILTINS = ("exact_match", "contains", "regex", "numeric_match", "rouge")
"""The built-in metrics by name: ``metrics=["exact_match", ...]`` means ``"mlora_lab.evals.metrics:<name>"``."""


def builtin_ref(name: str) -> str:
    """The reference (``"module:function"``) of a built-in metric."""
    return f"{__name__}:{name}"


def metric_ref(metric: Any) -> Any:
    """A metric as its worker imports it: a built-in's name as its reference; anything else as it is."""
    return builtin_ref(metric) if isinstance(metric, str) and metric in BUILTINS else metric


def text_of(completion: Any) -> str:
    """A completion's text: the text itself, or a chat completion's last message's ``content``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def references(kwargs: dict[str, Any], metric: str) -> list[str]:
    """Each completion's reference text, from the first of :data:`REFERENCE_COLUMNS` the rows have;
    ``ValueError`` naming them when none is there."""
    for column in REFERENCE_COLUMNS:
        if column in kwargs:
            return [text_of(v) if v is not None else "" for v in kwargs[column]]
    raise ValueError(
        f"{metric} compares each completion with the row's reference: give the rows a column "
        f"{' or '.join(map(repr, REFERENCE_COLUMNS))}"
    )


def exact_match(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion equals the reference, both stripped; else 0.0."""
    refs = references(kwargs, "exact_match")
    return [float(text_of(c).strip() == r.strip()) for c, r in zip(completions, refs, strict=True)]


def contains(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion contains the reference (stripped; an empty reference counts as absent)."""
    refs = references(kwargs, "contains")
    return [
        float(bool(r.strip()) and r.strip() in text_of(c)) for c, r in zip(completions, refs, strict=True)
    ]


def regex(
    prompts: Sequence[Any], completions: Sequence[Any], pattern: Sequence[str], **kwargs: Any
) -> list[float]:
    """1.0 when ``re.search(row's pattern, completion)`` finds a match; else 0.0."""
    return [float(re.search(p, text_of(c)) is not None) for c, p in zip(completions, pattern, strict=True)]


class Regex:
    """A metric scoring 1.0 when the completion matches ``pattern`` (``re.search`` with ``flags``)."""

    def __init__(self, pattern: str, flags: int = 0, name: str = "regex") -> None:
        self.pattern, self.flags = pattern, flags
        self.__name__ = name
        re.compile(pattern, flags)  # (a bad pattern fails here, in the notebook, not in the worker)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        compiled = re.compile(self.pattern, self.flags)
        return [float(compiled.search(text_of(c)) is not None) for c in completions]

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r})"


_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_number(text: str) -> float | None:
    """The number a text answers with: the one after GSM8K's ``####`` when there is one, else its last
    number (``1,234`` is 1234, ``$5`` is 5, a trailing ``.`` is punctuation); None when it has none."""
    marked = "####" in text
    found = _NUMBER.findall(text.rsplit("####", 1)[1] if marked else text)
    if not found:
        return None
    raw = (found[0] if marked else found[-1]).replace(",", "").replace("$", "").replace(" ", "")
    try:
        return float(raw)
    except ValueError:
        return None


def numeric_match(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final number equals the reference's (:func:`final_number`), to a relative
    1e-6; 0.0 otherwise, and when the completion has no number. A reference without a number is not
    scored (None)."""
    out: list[float | None] = []
    for c, r in zip(completions, references(kwargs, "numeric_match"), strict=True):
        want, got = final_number(r), final_number(text_of(c))
        if want is None:
            out.append(None)
        else:
            out.append(float(got is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)))
    return out  # type: ignore[return-value]


def rouge(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """ROUGE-L F1 of the completion against the reference, by ``rouge_score`` (with its stemmer off, as
    ``evaluate``'s ROUGE has it by default); ``ImportError`` saying what to install without it."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ImportError(
            "the rouge metric needs the rouge_score package (pip install rouge-score), which is not installed"
        ) from None
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    refs = references(kwargs, "rouge")
    return [scorer.score(r, text_of(c))["rougeL"].fmeasure for c, r in zip(completions, refs, strict=True)]


ENDPOINT_ENV = ("MLORA_OPENAI_BASE_URL", "MLORA_OPENAI_API_KEY")
"""What a served job sets in its environment (its OpenAI endpoint and its owner's key) for the processes it
starts, and what an RL job sets in a reward worker whose judge asks it: a :class:`Judge` inside it (a reward, an
evaluation's metric) finds the job's own models there. (:data:`mlora_lab.rl.rewards.ENDPOINT_ENV`, the same.)"""

DEFAULT_RUBRIC = (
    "Rate the answer to the question from 0 (wrong or useless) to 10 (correct and complete). "
    "Reply with the number only.\n\nQuestion: {prompt}\nReference answer: {reference}\nAnswer: {completion}\n"
)
""":class:`Judge`'s default instruction; ``{prompt}``, ``{completion}`` and ``{reference}`` are filled in."""

RUBRIC_FIELDS = ("prompt", "completion", "reference")
"""The fields a rubric may name."""

RANK_RUBRIC = (
    "Here are {n} answers to the same task. Judge them against each other: give each a score from 0 (wrong or "
    "useless) to 1 (correct, complete, the best of them); a better answer gets a higher score. Reply with one "
    "line per answer, its number, a colon and its score, and nothing else.\n\nTask: {prompt}\n"
    "Reference answer: {reference}\n\n{answers}\n"
)
""":class:`Judge`'s default instruction with ``mode="rank"``; ``{prompt}``, ``{answers}`` (``Answer 1:`` ... each
on its own lines), ``{n}`` and ``{reference}`` are filled in."""

RANK_FIELDS = ("prompt", "answers", "n", "reference")
"""The fields a ``mode="rank"`` rubric may name."""

JUDGE_MODES = ("score", "rank")
""":class:`Judge`'s modes: each completion scored alone, or a group's completions ranked against each other."""

_RANK_LINE = re.compile(
    r"^\W*(?:answer\s*)?(\d+)\s*[:=)\].-]+\s*(-?\d+(?:\.\d+)?|-?\.\d+)", re.IGNORECASE | re.MULTILINE
)


def rank_scores(answer: str, n: int) -> dict[int, float]:
    """A ranking judge's answer as ``{k: score}`` for answers ``1..n`` (lines ``k: s``, ``Answer k = s``,
    ``k) s``; a score clipped to [0, 1]; a number outside ``1..n`` or said twice ignored after its first)."""
    out: dict[int, float] = {}
    for k, s in _RANK_LINE.findall(answer or ""):
        k = int(k)
        if 1 <= k <= n and k not in out:
            out[k] = min(max(float(s), 0.0), 1.0)
    return out


MAX_ANSWER_BYTES = 4 * 2**20
"""The most of a judge server's answer read: a chat completion of a few tokens is a few hundred bytes."""


class JudgeError(RuntimeError):
    """A judge's request failed: one line naming the judge, its model and what its server answered (its
    status and reason, or the answer that is not a chat completion), or why it could not be asked."""


def rubric_problems(rubric: Any, allowed: Sequence[str] = RUBRIC_FIELDS) -> list[str]:
    """Why ``rubric`` is no :class:`Judge` rubric: not a ``str.format`` template (a lone brace), a field
    other than ``allowed`` (:data:`RUBRIC_FIELDS`; ``{answer}``, ``{0}``, ``{prompt.x}``), a field a text
    cannot fill (``{prompt:d}``); empty when it is one."""
    if not isinstance(rubric, str):
        return [f"the rubric must be a str.format template, not {brief(rubric)}"]
    try:
        fields = [(f, c, s) for _, f, s, c in string.Formatter().parse(rubric) if f is not None]
    except ValueError as e:
        return [
            f"the rubric is not a str.format template ({error_line(e)}); a brace meant as text is written "
            "twice ('{' as '{{', '}' as '}}')"
        ]
    unknown, unfilled = [], []
    for field, conversion, spec in fields:
        shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if field not in allowed:
            unknown.append(shown)
            continue
        try:
            shown.format(**{field: "text"})
        except Exception as e:  # (a format spec or conversion a text cannot take)
            unfilled.append(f"{shown} ({error_line(e)})")
    problems = []
    if unknown:
        names = ["{" + f + "}" for f in allowed]
        problems.append(
            f"the rubric names {', '.join(dict.fromkeys(unknown))}; it may name only "
            f"{', '.join(names[:-1])} and {names[-1]} (a brace meant as text is written twice)"
        )
    if unfilled:
        problems.append(f"a text cannot fill {', '.join(unfilled)}")
    return problems


def _said(raw: bytes) -> str:
    """What a server answered, as a message shows it: its text (bytes that are not UTF-8 shown as U+FFFD) as
    a short repr on one line; "nothing" for an empty body."""
    if not raw:
        return "nothing (an empty body)"
    return brief(raw.decode("utf-8", "replace"), 200)


def _refusal(raw: bytes) -> str:
    """The reason in an error answer: OpenAI's ``{"error": {"message"}}`` (or ``{"error": text}``,
    ``{"detail": text}``), else the answer itself."""
    value, _ = parse_json(raw.decode("utf-8", "replace")) if raw else (None, None)
    if isinstance(value, dict):
        error = value.get("error", value.get("detail"))
        reason = error.get("message") if isinstance(error, dict) else error
        if isinstance(reason, str) and reason:
            return brief(reason, 300)
    return _said(raw)


class Judge:
    """An LLM as judge: a metric (or a reward) that asks a model, through an OpenAI-compatible chat endpoint (a
    served job's own by default, ``svc.openai_base_url``, or any other), to rate each completion, and scores the number it answers, divided
    by ``scale`` (``None`` when it answers none). ``rubric`` is a ``str.format`` template of ``{prompt}``,
    ``{completion}`` and ``{reference}`` (the row's reference column, empty without one). Greedy (temperature
    0), so the same completion gets the same score. :meth:`of` aims it at a served run's own endpoint.

    A rubric naming any other field is refused here, in the notebook (``ValueError``); a request that fails
    (the server unreachable, its refusal, an answer that is not a chat completion) raises :class:`JudgeError`,
    one line naming the judge, its model and what the server answered.

    It is a plain object (picklable: it reaches the metrics' worker process as a notebook's function does),
    and it uses only the standard library's HTTP client.

    **``mode="rank"``** (RULER's way, ART's relative judge): the completions of one prompt (a GRPO group: the
    ``G`` completions of a prompt; any completions given with the same prompt) are shown to the judge together,
    and it scores each in [0, 1] against the others (:data:`RANK_RUBRIC`); those are their rewards. A group is
    told apart by its prompt. Its distinct answers are shown in an order fixed by a hash of ``seed``, the prompt
    and each answer, not by the order they came in, so the rewards are **permutation-invariant** (the same
    completions in any order get the same rewards) and **seeded**; they are **cached** by (prompt, reference,
    answers shown), so a group seen again is not asked again. Equal answers get one score; a group whose answers
    are all equal gets ½ each without a request; an answer the judge gave no score is ``None``."""

    def __init__(
        self,
        model: str = "base",
        rubric: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        scale: float = 10.0,
        max_tokens: int = 8,
        timeout_s: float = 120.0,
        name: str = "judge",
        mode: str = "score",
        seed: int = 0,
    ) -> None:
        if mode not in JUDGE_MODES:
            raise ValueError(f"Judge mode must be one of {', '.join(JUDGE_MODES)}, not {brief(mode)}")
        rubric = rubric if rubric is not None else RANK_RUBRIC if mode == "rank" else DEFAULT_RUBRIC
        self.model, self.rubric, self.api_key, self.mode, self.seed = model, rubric, api_key, mode, seed
        self.base_url = base_url.rstrip("/") if base_url else None
        self.scale, self.max_tokens, self.timeout_s = scale, max_tokens, timeout_s
        self.__name__ = name
        self.cache: dict[tuple[str, str, tuple[str, ...]], dict[str, float | None]] = {}
        self.verdicts: dict[tuple[str, str, tuple[str, ...]], str] = {}  # (the cache's requests and answers)
        # (a bad template fails here, in the notebook)
        problems = rubric_problems(rubric, RANK_FIELDS if mode == "rank" else RUBRIC_FIELDS)
        if problems:
            raise ValueError(f"{self._who()}: {'; '.join(problems)}")

    def _who(self) -> str:
        return f"judge {brief(self.__name__)} (model {brief(self.model)})"

    @property
    def asks_the_job(self) -> bool:
        """Whether it asks the job it runs in (no ``base_url`` given): as an RL tenant's reward, the job then
        answers it through its own endpoint, in the same batched generations as the agents' turns, with the base
        (``model="base"``) or any of its tenants as the judge (:mod:`mlora_lab.agents.endpoint`)."""
        return self.base_url is None

    @classmethod
    def of(cls, served: Any, **kwargs: Any) -> Judge:
        """A judge asking a served run (``ml.serve``'s handle) through its OpenAI endpoint, with its owner's key."""
        return cls(base_url=served.openai_base_url, api_key=served.api_key, **kwargs)

    def endpoint(self) -> tuple[str, str]:
        """``(base_url, api_key)``: the ones given, else the served job's own (:data:`ENDPOINT_ENV`, which a
        served job sets for the processes it starts: a judge used as a reward or metric inside it needs
        neither); ``RuntimeError`` saying what to give without them."""
        url = self.base_url or os.environ.get(ENDPOINT_ENV[0])
        key = self.api_key or os.environ.get(ENDPOINT_ENV[1])
        if not url or not key:
            raise RuntimeError(
                "Judge needs an OpenAI-compatible endpoint: give base_url and api_key, use Judge.of(svc) with a "
                "served run, or use it inside a served job (which sets them)"
            )
        return url.rstrip("/"), key

    def ask(self, text: str, max_tokens: int | None = None) -> str:
        """The judge model's greedy answer to ``text`` (one user message, at most ``max_tokens`` tokens,
        ``self.max_tokens`` by default); :class:`JudgeError` when the request fails or the answer is not a chat
        completion."""
        import http.client
        import json
        import urllib.error
        import urllib.request

        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0,
                "max_tokens": max_tokens or self.max_tokens}  # fmt: skip
        url, key = self.endpoint()
        request = urllib.request.Request(
            f"{url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        where = f"{self._who()}: {show_path(url)}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                raw = answer.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as e:  # (before URLError: it is one)
            raise JudgeError(f"{where} answered HTTP {e.code}: {_refusal(_body(e))}") from None
        except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if isinstance(reason, TimeoutError):
                raise JudgeError(f"{where} did not answer within {self.timeout_s:g} s") from None
            why = error_line(reason) if isinstance(reason, BaseException) else brief(reason)
            raise JudgeError(f"{self._who()}: cannot reach {show_path(url)} ({why})") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise JudgeError(f"{where} answered more than {MAX_ANSWER_BYTES // 2**20} MiB: {_said(raw)}")
        if not raw:
            raise JudgeError(f"{where} answered nothing (an empty body)")
        try:
            value, why = parse_json(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            value, why = None, f"bytes that are not UTF-8 text at position {e.start}"
        if why is not None:
            raise JudgeError(f"{where} answered what is not JSON ({why}): {_said(raw)}")
        content = _content(value)
        if content is Ellipsis:
            raise JudgeError(
                f"{where} answered no chat completion (no text at choices[0].message.content): {_said(raw)}"
            )
        return content or ""

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        try:
            refs = references(kwargs, self.__name__)
        except ValueError:  # (no reference column: the rubric's {reference} is left empty)
            refs = [""] * len(completions)
        # per completion: what the judge was asked and what it answered (the samples view)
        verdict_log: list[str] = []
        if self.mode == "rank":
            out = self.rank(prompts, completions, refs, verdict_log)
        else:
            out = []
            for prompt, completion, ref in zip(prompts, completions, refs, strict=True):
                asked = self.rubric.format(
                    prompt=text_of(prompt), completion=text_of(completion), reference=ref
                )
                said = self.ask(asked)
                number = final_number(said)
                out.append(None if number is None else min(max(number, 0.0), self.scale) / self.scale)
                verdict_log.append(judged(asked, said))
        log_extra = kwargs.get("log_extra")
        if callable(log_extra):  # (a reward: its prompts and verdicts go with the sampled completions)
            log_extra(self.__name__, verdict_log)
        return out

    def rank(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        refs: Sequence[str],
        verdict_log: list[str] | None = None,
    ) -> list[float | None]:
        """``mode="rank"``'s rewards (see the class docstring): each group of completions with one prompt (and
        reference) scored together, in the seeded order of its distinct answers, from the cache when it was
        asked before. ``verdict_log`` gets, per completion, its group's request and the judge's answer."""
        import hashlib

        groups: dict[tuple[str, str], list[int]] = {}
        for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
            groups.setdefault((conversation_text(prompt), ref), []).append(i)
        out: list[float | None] = [None] * len(completions)
        said_of: dict[int, str] = {}
        verdicts = self.__dict__.setdefault("verdicts", {})  # (a judge pickled before it kept them has none)
        for (prompt, ref), members in groups.items():
            texts = [text_of(completions[i]) for i in members]

            def shown(text: str, prompt: str = prompt) -> str:
                return hashlib.sha256(f"{self.seed}\0{prompt}\0{text}".encode()).hexdigest()

            distinct = tuple(sorted(set(texts), key=lambda t: (shown(t), t)))
            key = (prompt, ref, distinct)
            if key not in self.cache:
                if len(distinct) == 1:  # (nothing to tell apart: no request)
                    self.cache[key] = {distinct[0]: 0.5}
                    verdicts[key] = "(one distinct answer: ½ each, no request)"
                else:
                    answers = "\n\n".join(f"Answer {k}:\n{t}" for k, t in enumerate(distinct, start=1))
                    asked = self.rubric.format(prompt=prompt, answers=answers, n=len(distinct), reference=ref)
                    answer = self.ask(asked, max(self.max_tokens, 8 * len(distinct) + 16))
                    said = rank_scores(answer, len(distinct))
                    self.cache[key] = {t: said.get(k) for k, t in enumerate(distinct, start=1)}
                    verdicts[key] = judged(asked, answer)
            for i, text in zip(members, texts, strict=True):
                out[i] = self.cache[key][text]
                said_of[i] = verdicts.get(key, "")
        if verdict_log is not None:
            verdict_log.extend(said_of.get(i, "") for i in range(len(completions)))
        return out

    def __repr__(self) -> str:
        mode = "" if self.mode == "score" else f", mode={self.mode!r}"
        return f"Judge(model={self.model!r}, base_url={self.base_url!r}{mode})"


JUDGED_CHARS = 600
"""How much of a judge's request a sample shows (its start and its end), beside the judge's whole answer."""


def judged(asked: str, said: str) -> str:
    """What the samples view shows of one judge call: the request (its start and end past
    :data:`JUDGED_CHARS`) and the answer."""
    if len(asked) > JUDGED_CHARS:
        half = JUDGED_CHARS // 2
        asked = f"{asked[:half]} … {asked[-half:]}"
    return f"asked: {asked}\nanswered: {said}"


PAIRWISE_RUBRIC = (
    "Which of the two answers to the question is better: more correct, more helpful, more complete? "
    "Reply with A, B or tie only.\n\nQuestion: {prompt}\n\nAnswer A: {answer_a}\n\nAnswer B: {answer_b}\n"
)
""":class:`WinRate`'s default instruction; ``{prompt}``, ``{answer_a}``, ``{answer_b}`` and ``{reference}`` are
filled in."""

PAIRWISE_FIELDS = ("prompt", "answer_a", "answer_b", "reference")
"""The fields a :class:`WinRate` rubric may name."""

PEER_COLUMNS = ("eval_model", "eval_completions")
"""What an evaluation passes its metrics besides the rows' columns when a metric compares models
(:func:`mlora_lab.evals.generate.run_eval`'s ``baselines``): per completion, the model that wrote it, and
``{model: text}``, those models' completions of the same example and sample. Evaluation rows may not have
columns of these names."""

_VERDICT = re.compile(
    r"[\s\[\](){}\"'*`]*(?:(?:answer|output|verdict)\s*:?\s*)?(A|B|tie)[\s\[\](){}\"'*`.!]*", re.IGNORECASE
)


def verdict(answer: str) -> str | None:
    """A pairwise judge's answer as ``"A"``, ``"B"`` or ``"tie"`` (case, brackets, quotes, a final full
    stop and a leading ``Answer:`` aside: ``"[[B]]"``, ``"answer: a."``, ``"Tie"``); None when it is anything
    else ("A and B are equal", "I cannot tell", nothing): a judge that answers neither."""
    found = _VERDICT.fullmatch(answer or "")
    if found is None:
        return None
    said = found.group(1)
    return "tie" if said.lower() == "tie" else said.upper()


def conversation_text(prompt: Any) -> str:
    """A prompt as a judge reads it: a text as it is; a chat's single user message as its content, a longer
    chat as ``role: content`` paragraphs (the judge sees the whole conversation being answered)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        if len(prompt) == 1:
            return str(prompt[0].get("content", ""))
        return "\n\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)
    return text_of(prompt)


class WinRate:
    r"""Win rate against a baseline, judged pairwise: a metric that asks ``judge``'s model which of two
    answers to the prompt is better, the evaluated model's completion or the baseline's, in both orders.

    The baseline (``against``) is a model of the evaluation (``"base"``, the default: the base model's own
    completion of the same prompt, its adapter-free answer, as TRL's ``WinRateCallback`` compares a policy
    with its reference; or a tenant's name) or a column of the rows (``"chosen"``: a preference row's
    preferred answer; ``"reference"``). A name that is both is the model.

    For a prompt ``x``, a completion ``y`` and the baseline's ``y₀``, the judge ``J`` is asked twice, with
    the answers swapped, and each verdict gives ``y`` points::

        v₁ = J(x, A = y,  B = y₀)    s₁ = 1 if v₁ = A,  ½ if tie,  0 if v₁ = B
        v₂ = J(x, A = y₀, B = y)     s₂ = 1 if v₂ = B,  ½ if tie,  0 if v₂ = A
        w(y) = (s₁ + s₂) / 2         ∈ {0, ¼, ½, ¾, 1}

    The evaluation's score is the mean of ``w`` over the examples (each example's over its samples first),
    ``W = (wins + ties / 2) / n`` counted in half-comparisons (AlpacaEval's and Chatbot Arena's convention),
    with the evaluation's percentile bootstrap interval over examples (:mod:`mlora_lab.evals.scores`).
    Asking both orders cancels the judge's position bias to first order: if the judge picks position A
    ``δ`` more often than the answers deserve, ``E[s₁] = p + δ`` and ``E[s₂] = p − δ`` for the true
    preference ``p``, so ``E[w] = p``; a judge that always answers A scores every comparison ½, no
    information, rather than a win. ``W = ½`` is parity with the baseline; above it, better.

    Not scored (``None``, left out of the mean): a comparison where the judge answered neither A, B nor tie
    in either order (scoring the other order alone would let its position bias back in), a row without a
    baseline (its column empty), and the baseline model's own completions (a model is not compared with
    itself). Two answers that are the same text (stripped) score ½ without asking: a judge consistent in
    both orders can only tie them.

    Why a metric of its own beside :class:`Judge`: a judge rates one answer on a scale, this compares two,
    with another rubric (``{prompt}``, ``{answer_a}``, ``{answer_b}`` and ``{reference}``, the row's
    reference) and another reading of the answer (:func:`verdict`). It asks through ``judge`` (its model,
    endpoint, key, ``max_tokens`` and time limit), so the same judge serves both. Greedy, as the judge is.
    """

    def __init__(
        self, judge: Judge, against: str = "base", rubric: str = PAIRWISE_RUBRIC, name: str | None = None
    ) -> None:
        if not isinstance(judge, Judge):
            raise TypeError(f"WinRate asks through a Judge (ml.Judge(...)), not {brief(judge)}")
        if not isinstance(against, str) or not against:
            raise ValueError(
                f"WinRate's against is a model's name ('base') or a column ('chosen'), not {brief(against)}"
            )
        default = f"win_rate_vs_{against}"
        self.judge, self.against, self.rubric = judge, against, rubric
        self.__name__ = name or (default if default.isidentifier() else "win_rate")
        problems = rubric_problems(rubric, PAIRWISE_FIELDS)  # (a bad template fails here, in the notebook)
        if problems:
            raise ValueError(f"win rate {brief(self.__name__)} ({judge._who()}): {'; '.join(problems)}")

    def baselines(self, n: int, kwargs: dict[str, Any]) -> list[str | None]:
        """The baseline's answer for each of ``n`` completions: model ``against``'s completion of the same
        example and sample (:data:`PEER_COLUMNS`), else the row's ``against`` column; ``ValueError`` when
        it is neither."""
        peers = kwargs.get(PEER_COLUMNS[1])
        if peers is not None and any(isinstance(p, dict) and self.against in p for p in peers):
            return [
                text_of(p[self.against]) if isinstance(p, dict) and p.get(self.against) is not None else None
                for p in peers
            ]
        if self.against in kwargs:
            return [None if v is None else text_of(v) for v in kwargs[self.against]]
        raise ValueError(
            f"{self.__name__} compares each completion with {self.against!r}'s answer, which is neither a "
            "model of the evaluation nor a column of its rows"
        )

    def points(self, prompt: str, tenant: str, baseline: str, reference: str, first: bool) -> float | None:
        """The completion's points from one order (``first``: it is answer A), None for no verdict."""
        a, b = (tenant, baseline) if first else (baseline, tenant)
        said = verdict(
            self.judge.ask(self.rubric.format(prompt=prompt, answer_a=a, answer_b=b, reference=reference))
        )
        if said is None:
            return None
        return 0.5 if said == "tie" else float(said == ("A" if first else "B"))

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float | None]:
        n = len(completions)
        baselines = self.baselines(n, kwargs)
        try:
            refs = references(kwargs, self.__name__)
        except ValueError:  # (no reference column: the rubric's {reference} is left empty)
            refs = [""] * n
        models = kwargs.get(PEER_COLUMNS[0]) or [None] * n
        out: list[float | None] = []
        for prompt, completion, baseline, ref, model in zip(prompts, completions, baselines, refs, models, strict=True):  # fmt: skip
            text = text_of(completion)
            if baseline is None or model == self.against:
                out.append(None)
            elif text.strip() == baseline.strip():
                out.append(0.5)
            else:
                asked = conversation_text(prompt)
                s1 = self.points(asked, text, baseline, ref, first=True)
                s2 = self.points(asked, text, baseline, ref, first=False)
                out.append(None if s1 is None or s2 is None else (s1 + s2) / 2)
        return out

    def __repr__(self) -> str:
        return f"WinRate({self.judge!r}, against={self.against!r})"


def _content(value: Any) -> Any:
    """A chat completion's ``choices[0].message.content`` (a text, or None: the model said nothing);
    ``...`` when ``value`` is not a chat completion."""
    try:
        content = value["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return ...
    return content if content is None or isinstance(content, str) else ...


def _body(e: Any) -> bytes:
    """An HTTP error's body (at most :data:`MAX_ANSWER_BYTES`), empty when it cannot be read."""
    try:
        return e.read(MAX_ANSWER_BYTES) or b""
    except Exception:
        return b""
