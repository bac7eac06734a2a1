"""Capture at the endpoint: each trajectory's tokens, exactly as the job sampled them, built turn by turn.

An agent's program sends the whole conversation at every turn (OpenAI's chat API is stateless). Re-rendering
it would re-tokenize the model's earlier answers, whose text may not tokenize back into the ids that were
sampled; the ratio ``π/π_old`` is only meaningful for the exact ids drawn. So each trajectory keeps a **ledger**
and its prompt grows by appending, as TRL 1.16's tool loop does::

    turn 1   x = render(m_1 … m_a, tools, generation prompt)                                   env
    answer   x += s_1                      (the sampled ids, with the sampler's log-probs)        model
    turn 2   the program sends m_1 … m_a, A_1, m_{a+2} … m_b    (A_1: the answer it was given)
             x += bridge(s_1) + suffix(m_{a+2} … m_b)                                           env
    answer   x += s_2                                                                           model

``suffix`` is the template's own rendering of the new messages after an assistant turn, with the generation
prompt (TRL's dummy-diff, :func:`mlora_lab.agents.chat.suffix_ids`); ``bridge`` closes the sampled answer as the
template closes an assistant message (the EOS the sampler drew is already there; a turn cut at ``max_tokens``
or a stop string gets the template's whole closing; :func:`mlora_lab.agents.chat.bridge`).

A request whose messages do not extend the ledger's (the program rewrote the history, or did not send back the
answer it was given) cannot be appended: it is rendered whole and starts a new **branch**. Only the last branch is
trained (the earlier turns then count as context), and the trajectory says how many forks it had: a warning,
never silence.

Comparison is on a canonical form of each message (role, text, tool calls by name and arguments, the tool
call it answers), so a client that echoes the answer with extra null fields (the ``openai`` client's
``model_dump``) still extends its ledger.

Engine room: plain Python, a tokenizer, no HTTP, no processes.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from mlora_lab.agents import chat
from mlora_lab.rl.trajectory import ENV, MODEL, Segment, Trajectory


class CaptureError(ValueError):
    """A turn the endpoint refuses (a 400 to the program): the message says why."""


def _canon(m: dict[str, Any]) -> tuple:
    """A message's identity for "does this conversation extend the ledger's": what a chat template renders."""
    calls = []
    for c in m.get("tool_calls") or []:
        f = c.get("function", c) if isinstance(c, dict) else {}
        args = f.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):
                args = json.loads(args)
        calls.append((f.get("name"), json.dumps(args, sort_keys=True)))
    content = m.get("content")
    return (m.get("role"), content or "", tuple(calls), m.get("tool_call_id"))


@dataclass
class Ledger:
    """One trajectory: its tokens by segment, the conversation so far (the answers it was given included)."""

    segments: list[Segment] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    forks: int = 0
    truncated: bool = False  # the last answer stopped at its max_tokens

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    @property
    def ids(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]


class Capture:
    """Every trajectory's ledger, by id. ``max_tokens``: the most tokens one trajectory may hold (a flood of tool
    output past it is refused: :class:`CaptureError`)."""

    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        self.tokenizer, self.max_tokens = tokenizer, int(max_tokens)
        self.ledgers: dict[str, Ledger] = {}
        self._closing: dict[str, list[int]] = {}

    def closing(self, tools: list[dict] | None) -> list[int]:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._closing:
            self._closing[key] = chat.closing_ids(self.tokenizer, tools=tools)
        return self._closing[key]

    def prompt(self, tid: str, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of trajectory ``tid``'s next turn for ``messages`` (normalized OpenAI messages): the
        ledger's ids with the new messages appended, or, on the first turn or a fork, the whole rendering. The
        ledger holds them once this returns; :class:`CaptureError` when the turn cannot be taken."""
        try:
            messages = chat.normalize_messages(messages)
        except ValueError as e:
            raise CaptureError(str(e)) from None
        if not messages:
            raise CaptureError("messages is empty")
        if messages[-1].get("role") == "assistant":
            raise CaptureError("the last message is the assistant's: there is no turn to answer")
        led = self.ledgers.get(tid)
        known = led.messages if led is not None else []
        extends = (
            led is not None
            and led.turns > 0
            and len(messages) > len(known)
            and [_canon(m) for m in messages[: len(known)]] == [_canon(m) for m in known]
            and (led.tools == tools)
        )
        try:
            if extends:
                last = led.segments[-1].tokens if led.segments and led.segments[-1].source == MODEL else ()
                new = chat.bridge(list(last), self.closing(tools)) + chat.suffix_ids(
                    self.tokenizer, messages[len(known) :], tools=tools
                )
                added = [Segment(ENV, tuple(new))] if new else []
                fresh = None
            else:
                fresh = chat.render(self.tokenizer, messages, tools=tools, add_generation_prompt=True)
                added = [Segment(ENV, tuple(fresh))]
        except Exception as e:  # (a template that cannot render these messages)
            raise CaptureError(f"the chat template cannot render these messages: {e}") from None
        size = sum(len(s.tokens) for s in added) + (led.n_tokens if extends else 0)
        if size > self.max_tokens:
            raise CaptureError(
                f"the trajectory would hold {size} tokens, more than the {self.max_tokens} it may (the context is "
                "full)"
            )
        if led is None:
            led = self.ledgers[tid] = Ledger()
        if not extends:
            led.forks += int(led.turns > 0)
            led.segments = []
        led.segments += added
        led.messages = list(messages)
        led.tools = tools
        return led.ids

    def answer(
        self, tid: str, tokens: list[int], logprobs: list[float], message: dict[str, Any], cut: bool
    ) -> None:
        """Trajectory ``tid``'s turn was answered with sampled ``tokens`` (their sampler ``logprobs``), which
        the program was sent as ``message``; ``cut``: it stopped at its ``max_tokens``."""
        led = self.ledgers[tid]
        if tokens:
            led.segments.append(Segment(MODEL, tuple(tokens), tuple(float(x) for x in logprobs)))
        led.messages.append(message)
        led.turns += 1
        led.truncated = cut

    def take(self, tid: str) -> Ledger | None:
        """Trajectory ``tid``'s ledger, removed (``None``: it never reached the endpoint)."""
        return self.ledgers.pop(tid, None)


def trajectory_of(led: Ledger, seq_len: int, reward: float | None = None, example: Any = None) -> Trajectory:
    """The ledger as a :class:`~mlora_lab.rl.trajectory.Trajectory` cut to ``seq_len`` (``truncated`` when it was,
    or when its last answer stopped at its ``max_tokens``)."""
    t = Trajectory(list(led.segments), reward, example, led.truncated, list(led.messages)).cut(seq_len)
    t.truncated = t.truncated or led.truncated
    return t
