"""Comparing tenants and runs: summary tables, overlay plots, and side-by-side generations.

All of it reads run directories only (metrics.jsonl, job.json, adapters/); generations load the
saved PEFT adapters into one multi-tenant model and decode every adapter's completions in one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from mlora_lab.launch import Run, attach
from mlora_lab.rundir import RowKind

SUMMARY_COLUMNS = [
    "tenant", "rank", "alpha", "lr", "steps", "max_steps", "first_loss", "final_loss", "best_loss",
    "eval_loss", "tokens", "time_s",
]  # fmt: skip
METRICS = {"loss": "train", "eval_loss": "eval", "lr": "train", "grad_norm": "train", "tokens": "train"}
LINESTYLES = ["-", "--", ":", "-."]

RunLike = Run | str | Path


class LabFigure(Figure):
    """A matplotlib Figure that shows itself in notebooks as a PNG without pyplot state (so it is
    displayed once, also in kernels where the inline backend was never activated)."""

    def _repr_png_(self) -> bytes:
        import io

        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90)
        return buf.getvalue()


def _as_runs(runs: RunLike | Sequence[RunLike]) -> list[Run]:
    if isinstance(runs, (Run, str, Path)):
        runs = [runs]
    return [r if isinstance(r, Run) else attach(r) for r in runs]


def summary(runs: RunLike | Sequence[RunLike]) -> pd.DataFrame:
    """One row per tenant (per run): settings, steps, first/final/best train loss, last eval loss,
    target tokens trained on and wall time from its first to its last logged step."""
    runs = _as_runs(runs)
    out = []
    for run in runs:
        df = run.metrics()
        for t in run.spec.tenants:
            train = df[(df["kind"] == RowKind.TRAIN) & (df["tenant"] == t.name)] if len(df) else df
            evals = df[(df["kind"] == RowKind.EVAL) & (df["tenant"] == t.name)] if len(df) else df
            out.append(
                {
                    "run": run.path.name,
                    "tenant": t.name,
                    "rank": t.rank,
                    "alpha": t.alpha,
                    "lr": t.lr,
                    "steps": int(train["tenant_step"].max()) if len(train) else 0,
                    "max_steps": t.max_steps,
                    "first_loss": train["loss"].iloc[0] if len(train) else None,
                    "final_loss": train["loss"].iloc[-1] if len(train) else None,
                    "best_loss": train["loss"].min() if len(train) else None,
                    "eval_loss": evals["loss"].iloc[-1] if len(evals) else None,
                    "tokens": int(train["tokens"].sum()) if len(train) else 0,
                    "time_s": (train["time"].iloc[-1] - train["time"].iloc[0]).total_seconds()
                    if len(train)
                    else 0.0,
                }
            )
    columns = (["run"] if len(runs) > 1 else []) + SUMMARY_COLUMNS
    return pd.DataFrame(out)[columns] if out else pd.DataFrame(columns=columns)


def compare(
    runs: RunLike | Sequence[RunLike],
    metric: str = "loss",
    tenants: Sequence[str] | None = None,
    smoothing: float = 0.0,
    logy: bool = False,
    figsize: tuple[float, float] = (8, 4.5),
) -> Figure:
    """Overlay ``metric`` of tenants across runs against each tenant's own step.

    Colour = tenant (stable across runs), line style = run. ``metric`` is one of ``loss``,
    ``eval_loss``, ``lr``, ``grad_norm``, ``tokens``; ``smoothing`` is an EMA factor in [0, 1).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
    from mlora_lab.dashboard import PALETTE, ema

    runs = _as_runs(runs)
    fig = LabFigure(figsize=figsize)
    ax = fig.add_subplot(1, 1, 1)
    colors: dict[str, str] = {}
    for i, run in enumerate(runs):
        df = run.metrics()
        if not len(df):
            continue
        train = df[df["kind"] == RowKind.TRAIN]
        names = [t.name for t in run.spec.tenants if tenants is None or t.name in tenants]
        for name in names:
            colors.setdefault(name, PALETTE[len(colors) % len(PALETTE)])
            rows = train[train["tenant"] == name]
            if metric == "eval_loss":
                evals = df[(df["kind"] == RowKind.EVAL) & (df["tenant"] == name)]
                if not len(evals):
                    continue
                rows = pd.merge_asof(evals[["step", "loss"]], rows[["step", "tenant_step"]], on="step")
                x, y = rows["tenant_step"].fillna(0), rows["loss"]
            else:
                x, y = rows["tenant_step"], rows[metric]
            if not len(x):
                continue
            label = name if len(runs) == 1 else f"{run.path.name} / {name}"
            style = (
                "o" + LINESTYLES[i % len(LINESTYLES)]
                if metric == "eval_loss"
                else LINESTYLES[i % len(LINESTYLES)]
            )
            ax.plot(x, ema(y.to_numpy(dtype=float), smoothing), style, color=colors[name], label=label,
                    markersize=3)  # fmt: skip
    ax.set_xlabel("tenant step")
    ax.set_ylabel(metric)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    ax.set_title(f"{metric}: " + ", ".join(r.path.name for r in runs), fontsize=10)
    fig.tight_layout()
    return fig


def plot_losses(run: RunLike, path: str | Path | None = None, smoothing: float = 0.0) -> Figure:
    """Train loss (lines) and eval loss (markers) of every tenant of a run; saved as PNG if ``path``."""
    fig = compare(run, "loss", smoothing=smoothing, figsize=(8, 4.5))
    ax = fig.axes[0]
    (run,) = _as_runs(run)
    df = run.metrics()
    colors = {line.get_label(): line.get_color() for line in ax.lines}
    for name, color in colors.items():
        evals = df[(df["kind"] == RowKind.EVAL) & (df["tenant"] == name)] if len(df) else df
        if len(evals):
            train = df[(df["kind"] == RowKind.TRAIN) & (df["tenant"] == name)]
            at = pd.merge_asof(evals[["step", "loss"]], train[["step", "tenant_step"]], on="step")
            ax.plot(at["tenant_step"].fillna(0), at["loss"], "o", color=color, markersize=4)
    ax.set_ylabel("loss (lines: train, dots: eval)")
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


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
    mixed-tenant batch: a row per prompt, a column per adapter.

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
    import warnings

    import torch
    import transformers

    from mlora_lab.bases import resolve_base
    from mlora_lab.data import _encode, _render, scan_jsonl
    from mlora_lab.lora import MultiLoRAModel
    from mlora_lab.spec import effective_slot_modules

    if isinstance(prompts, str) or not prompts:
        raise ValueError(
            "compare_generations: prompts must be a non-empty list (of strings or message lists)"
        )
    (run,) = _as_runs(run)
    spec = run.spec
    picked = [t for t in spec.tenants if tenants is None or t.name in tenants]
    names = [t.name for t in picked]
    base_path = str(resolve_base(spec.base_model))  # a GGUF base: its converted copy
    tok_path = spec.tokenizer or base_path
    tok = transformers.AutoTokenizer.from_pretrained(tok_path)
    tok.padding_side = "left"  # generation appends on the right
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def trained_on_chat(t) -> bool:
        report = scan_jsonl(t.data)
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

    def render(prompt: Prompt, as_chat: bool) -> tuple[str, bool]:
        """``(text, add_special_tokens)``: how training would tokenize this prompt for a column."""
        messages = _as_messages(prompt)
        if messages is None and not as_chat:
            return prompt, True  # a prompt/completion row's prompt: with the tokenizer's BOS
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        return _render(tok, messages, add_generation_prompt=True), False  # the template adds BOS itself

    fed = {c: [render(p, m) for p in prompts] for c, _, m in columns}
    rows = [_encode(tok, text, special) for c, _, _ in columns for text, special in fed[c]]
    width = max((len(r) for r in rows), default=0)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1

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
    mm.eval()
    rows_tenants = [t for _, t, _ in columns for _ in prompts]  # column-major: contiguous segments
    with torch.no_grad():
        out = mm.generate(
            input_ids, tenants=rows_tenants, attention_mask=attention_mask,
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
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
