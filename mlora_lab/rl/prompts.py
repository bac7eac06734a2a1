"""An RL tenant's prompt rows, checked as a data file is read: what a row to complete is, and which of its
columns may reach the reward functions.

A row holds ``prompt`` (a text; or a chat, a list of ``{"role", "content"}`` messages, as TRL's conversational
rows have it) or ``messages`` (a chat), completed as the assistant's next turn; every other key is a column
the reward functions take by name, except the names the job gives them itself (:data:`RESERVED_COLUMNS`).
No torch here: :mod:`mlora_lab.data` checks rows with it before any model exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlora_lab.rl.rewards import STANDARD_ARGS
from mlora_lab.text import surrogate_problem

RESERVED_COLUMNS = STANDARD_ARGS
"""Names the job itself gives a reward function (:data:`mlora_lab.rl.rewards.STANDARD_ARGS`): an RL row's
column of one of these names would be passed in their place (a column ``completions`` replaced the sampled
completions, and the tenant trained on nothing), so such a column is refused."""


def chat_prompt(row: dict) -> list | None:
    """An RL row's chat to complete as the assistant's next turn: its ``messages``, or its ``prompt`` when it
    is a list of messages (TRL's conversational format, ``{"prompt": [{"role": "user", ...}]}``); None for a
    text prompt."""
    if row.get("messages") is not None:
        return row["messages"]
    return row["prompt"] if isinstance(row.get("prompt"), list) else None


def as_completion(prompt: object, text: str) -> str | list[dict]:
    """A completion as reward functions get it, in its prompt's shape (TRL's): the text for a text prompt,
    a list of one assistant message for a chat."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


@dataclass(frozen=True)
class PromptRows:
    """What prompt rows are for, as the problems found in them say it."""

    row: str
    """What a row is called: ``"an RL row"``."""
    takers: str
    """What its columns reach: ``"reward function"``."""


RL_ROWS = PromptRows("an RL row", "reward function")
"""An RL tenant's prompt rows: completed, then scored by its reward functions."""
EVAL_ROWS = PromptRows("an evaluation row", "metric function")
"""An evaluation's rows: completed by every model, then scored by its metrics."""


def prompt_row_problems(row: dict, rows: PromptRows = RL_ROWS) -> tuple[str | None, list[str]]:
    """An RL row: ``prompt`` (text to complete, or a list of messages as TRL's conversational rows have
    it) or ``messages`` (a chat, completed as the assistant's next turn), never both; any other key is a
    column the reward functions may take, except the names the job gives them (:data:`RESERVED_COLUMNS`).
    ``rows`` says in messages what the rows are for (:data:`RL_ROWS`, :data:`EVAL_ROWS`)."""
    has_prompt, has_messages = row.get("prompt") is not None, row.get("messages") is not None
    reserved = [k for k in RESERVED_COLUMNS if k in row]
    problems = [
        f"column {k!r} has a name the job itself passes every {rows.takers} ({', '.join(RESERVED_COLUMNS)}): "
        "rename the column"
        for k in reserved
    ]
    if has_prompt == has_messages:
        why = "has both" if has_prompt else "has neither"
        return None, [
            f"{rows.row} needs 'prompt' (a text, or a chat as a list of messages) or 'messages' to complete; "
            f"this one {why}",
            *problems,
        ]
    if has_prompt and not isinstance(row["prompt"], list):
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            return "prompt", [
                "'prompt' must be a non-empty string, or a list of {'role', 'content'} messages"
            ]
        return "prompt", problems + surrogate_problem("'prompt'", row["prompt"])
    key = "messages" if has_messages else "prompt"
    msgs = row[key]
    if not isinstance(msgs, list) or not msgs:
        return "messages", [f"'{key}' must be a non-empty list of {{'role', 'content'}} objects", *problems]
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))):
            problems.append(f"{key}[{i}] needs 'role' and 'content' strings")
            continue
        for part in ("role", "content"):
            problems += surrogate_problem(f"'{key}[{i}].{part}'", m[part])
    return "messages", problems
