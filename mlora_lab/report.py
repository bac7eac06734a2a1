"""Comparing tenants and runs: summary tables, overlay plots, and side-by-side generations.

All of it reads run directories only (metrics.jsonl, job.json, adapters/); generations load the
saved PEFT adapters into one multi-tenant model and decode every adapter's completions in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def compare_generations(
    run: RunLike,
    prompts: Sequence[str],
    tenants: Sequence[str] | None = None,
    max_new_tokens: int = 24,
    include_base: bool = True,
) -> pd.DataFrame:
    """Greedy completions of the same prompts by each saved adapter (and the base), in ONE
    mixed-tenant batch: a row per prompt, a column per adapter."""
    import torch
    import transformers

    from mlora_lab.lora import MultiLoRAModel

    (run,) = _as_runs(run)
    spec = run.spec
    names = [t.name for t in spec.tenants if tenants is None or t.name in tenants]
    tok = transformers.AutoTokenizer.from_pretrained(spec.tokenizer or spec.base_model)
    tok.padding_side = "left"  # generation appends on the right
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    base = transformers.AutoModelForCausalLM.from_pretrained(spec.base_model)
    mm = MultiLoRAModel(
        base, max_tenants=max(1, len(names)), max_rank=spec.max_rank, slot_modules="all-linear"
    )
    for name in names:
        mm.load_adapter(name, run.adapter_path(name))
    mm.eval()
    columns: list[str | None] = ([None] if include_base else []) + names
    rows_tenants = [c for c in columns for _ in prompts]  # tenant-major: contiguous segments
    enc = tok([p for _ in columns for p in prompts], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = mm.generate(
            enc["input_ids"], tenants=rows_tenants, attention_mask=enc["attention_mask"],
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    table = {"prompt": list(prompts)}
    for j, c in enumerate(columns):
        table["base" if c is None else c] = texts[j * len(prompts) : (j + 1) * len(prompts)]
    return pd.DataFrame(table)
