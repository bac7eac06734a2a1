"""Side-by-side generations: :func:`compare_generations` loads a run's saved PEFT adapters into one
multi-tenant model and decodes every adapter's greedy completions of the same prompts in one batch, each
prompt rendered the way the tenant was trained.

A view over ``ml.evaluate``'s sampler (:func:`mlora_lab.sampling.sample`): the ``C`` columns' renderings of
the ``P`` prompts are ``C·P`` greedy requests of one batch, each row with its column's adapter (the base's
with none), left-padded and decoded there; what is left here is which columns there are, how each renders
a prompt, and the table. Greedy, each completion is what PEFT's ``generate`` gives with that adapter alone.

The only comparison that needs torch and transformers: both are imported when it is called, so that
importing the lab loads neither.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import pandas as pd

from mlora_lab import hub
from mlora_lab.lab.runs.attach import RunLike, as_runs

Prompt = str | Sequence[Mapping[str, str]]
"""A prompt for :func:`compare_generations`: plain text, or a chat as ``[{"role": ..., "content": ...}, ...]``."""


def compare_generations(
    run: RunLike,
    prompts: Sequence[Prompt],
    tenants: Sequence[str] | None = None,
    max_new_tokens: int = 24,
    include_base: bool = True,
    chat: bool | None = None,
) -> pd.DataFrame:
    """Greedy completions of the same prompts by each saved adapter (and the base), in ONE
    mixed-tenant batch of ``ml.evaluate``'s sampler: a row per prompt, a column per adapter. Each
    completion is what PEFT's ``generate`` gives with that adapter alone (it stops at the model's EOS
    or after ``max_new_tokens``), and the base's what the plain model gives.

    Each tenant is fed the prompts the way it was trained (the rendering code is the training data's
    own, :mod:`mlora_lab.data`):

    - a prompt given as a message list (``[{"role": "user", "content": "..."}, ...]``) is rendered
      with the tokenizer's chat template plus the assistant's generation prompt
      (``add_generation_prompt=True``), as a ``messages`` training row is, for every column;
    - a plain string is rendered that way for a **chat tenant**, as ``[{"role": "user", "content":
      prompt}]``, and otherwise fed as it is (tokenized with the tokenizer's BOS, as a ``prompt`` row).
      ``chat=None`` (the default) decides per tenant from its training data: a chat tenant is one
      whose ``data`` file holds only ``messages`` rows (a file that also has ``text`` or
      ``prompt``/``completion`` rows taught plain prompts too; a file that can no longer be read
      counts as plain, with a warning). ``chat=True`` / ``chat=False`` decides for every tenant;
    - the base is fed as the tenants are: if some tenants are chat tenants and others not, there are
      two base columns, ``base`` (plain) and ``base (chat)``.

    Rendering a chat needs the tokenizer's chat template; without one this raises ``ValueError``
    saying so (pass ``chat=False`` to feed plain strings as they are). The exact texts fed are in
    ``result.attrs["inputs"]`` (``{column: [text per prompt]}``) and the rendering used per column in
    ``result.attrs["chat"]``.
    """
    import transformers

    from mlora_lab import data
    from mlora_lab.bases import no_progress_bars, resolve_base
    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.sampling import SampleRequest, sample
    from mlora_lab.spec.job import effective_slot_modules

    if isinstance(prompts, str) or not prompts:
        raise ValueError(
            "compare_generations: prompts must be a non-empty list (of strings or message lists)"
        )
    (run,) = as_runs(run)
    spec = run.spec
    picked = [t for t in spec.tenants if tenants is None or t.name in tenants]
    names = [t.name for t in picked]
    base_path = str(resolve_base(spec.base_model, revision=spec.revision))  # a GGUF base: its converted copy
    tok_path = str(hub.resolve(spec.tokenizer)) if spec.tokenizer else base_path
    tok = transformers.AutoTokenizer.from_pretrained(tok_path)

    def trained_on_chat(t) -> bool:
        report = data.scan_source(t.data)
        if not report.kinds:
            warnings.warn(
                f"compare_generations: cannot tell how tenant {t.name!r} was trained ({'; '.join(report.problems[:1])}); "
                "feeding plain prompts as they are (pass chat=True for chat rendering)",
                stacklevel=3,
            )
        return report.kinds == {"messages"}

    modes: dict[str, bool] = {}
    for t in picked:
        modes[t.name] = trained_on_chat(t) if chat is None else bool(chat)
    columns: list[tuple[str, str | None, bool]] = []  # (column, tenant or None = base, chat rendering)
    if include_base:
        used = sorted(set(modes.values())) or [bool(chat)]
        columns += [("base (chat)" if m and len(used) > 1 else "base", None, m) for m in used]
    columns += [(n, n, modes[n]) for n in names]

    if not getattr(tok, "chat_template", None):
        chatty = [t for _, t, m in columns if m and t is not None]
        if chat or chatty or any(_as_messages(p) is not None for p in prompts):
            if chat:
                why = "chat=True renders every prompt with the chat template"
            elif chatty:
                why = (
                    f"tenant(s) {', '.join(map(repr, chatty))} were trained on 'messages' rows, so prompts "
                    "are rendered for them with the chat template"
                )
            else:
                why = "prompts given as messages are rendered with the chat template"
            raise ValueError(
                f"compare_generations: {why}, but the tokenizer at {tok_path} has no chat template; "
                "give plain-string prompts with chat=False to feed them as they are"
            )

    def fed_as(prompt: Prompt, as_chat: bool) -> tuple[str, list[int]]:
        """``(text, token ids)``: how training tokenizes this prompt for a column (a prompt row's
        rendering, :func:`mlora_lab.data.encode_prompt`: a chat through the template, which brings its
        own BOS; a text with the tokenizer's BOS)."""
        messages = _as_messages(prompt)
        if messages is None and as_chat:
            messages = [{"role": "user", "content": prompt}]
        _, text, ids = data.encode_prompt({"prompt": prompt if messages is None else messages}, tok)
        return text, ids

    fed = {c: [fed_as(p, m) for p in prompts] for c, _, m in columns}

    with no_progress_bars():  # a widget per load in a notebook: noise for a load done on the user's behalf
        base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    # The job's own slots: they cover every adapter it saved (one may target the output layer).
    mm = MultiLoRAModel(
        base,
        max_tenants=max(1, len(names)),
        max_rank=spec.max_rank,
        slot_modules=effective_slot_modules(spec),
    )
    for name in names:
        mm.load_adapter(name, run.adapter_path(name))
    # ml.evaluate's sampler: one batch, each row with its column's adapter (the base's rows with none),
    # greedy, stopping at the model's EOS or after max_new_tokens; requests column by column
    requests = [
        SampleRequest(prompt=ids, tenant=t, max_new_tokens=max_new_tokens, temperature=0.0)
        for c, t, _ in columns
        for _, ids in fed[c]
    ]
    completions = sample(mm, requests, tokenizer=tok)  # one per request, in order
    texts = [tok.decode(c.tokens, skip_special_tokens=True) for c in completions]
    table = {"prompt": list(prompts)}
    for j, (c, _, _) in enumerate(columns):
        table[c] = texts[j * len(prompts) : (j + 1) * len(prompts)]
    result = pd.DataFrame(table)
    result.attrs["inputs"] = {c: [text for text, _ in fed[c]] for c, _, _ in columns}
    result.attrs["chat"] = {c: m for c, _, m in columns}
    return result


def _as_messages(prompt: Prompt) -> list[dict[str, str]] | None:
    """A chat prompt as a list of ``{"role", "content"}`` dicts; ``None`` for a plain string."""
    if isinstance(prompt, str):
        return None
    ok = isinstance(prompt, Sequence) and len(prompt) > 0
    ok = ok and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )
    if not ok:
        raise ValueError(
            "compare_generations: a prompt is a string or a non-empty list of {'role': str, 'content': str} "
            f"messages, got {prompt!r:.80}"
        )
    return [dict(m) for m in prompt]
