"""Per-tenant summaries and loss plots from a run's metrics (no training code, only the run directory)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from mlora_lab.launch import Run

SUMMARY_COLUMNS = [
    "tenant", "rank", "alpha", "lr", "steps", "max_steps", "first_loss", "final_loss", "best_loss",
    "eval_loss", "tokens", "time_s",
]  # fmt: skip


def summary(runs: Run | Sequence[Run]) -> pd.DataFrame:
    """One row per tenant (per run): settings, steps, first/final/best train loss, last eval loss,
    target tokens trained on and wall time from its first to its last logged step."""
    runs = [runs] if isinstance(runs, Run) else list(runs)
    out = []
    for run in runs:
        spec = run.spec
        df = run.metrics()
        for t in spec.tenants:
            train = df[(df["kind"] == "train") & (df["tenant"] == t.name)] if len(df) else df
            evals = df[(df["kind"] == "eval") & (df["tenant"] == t.name)] if len(df) else df
            row = {
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
            out.append(row)
    columns = (["run"] if len(runs) > 1 else []) + SUMMARY_COLUMNS
    return pd.DataFrame(out)[columns] if out else pd.DataFrame(columns=columns)


def plot_losses(run: Run, path: str | Path | None = None, smoothing: float = 0.0):
    """Per-tenant training loss (solid) and eval loss (dots) against the tenant's own step."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    df = run.metrics()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, t in enumerate(run.spec.tenants):
        color = f"C{i % 10}"
        train = df[(df["kind"] == "train") & (df["tenant"] == t.name)] if len(df) else df
        if not len(train):
            continue
        loss = train["loss"].ewm(alpha=1 - smoothing).mean() if smoothing else train["loss"]
        ax.plot(train["tenant_step"], loss, color=color, label=f"{t.name} (r={t.rank}, lr={t.lr:g})")
        evals = df[(df["kind"] == "eval") & (df["tenant"] == t.name)]
        if len(evals):  # eval rows carry the global step; place them at the tenant's step then
            at = pd.merge_asof(evals[["step", "loss"]], train[["step", "tenant_step"]], on="step")
            ax.plot(at["tenant_step"].fillna(0), at["loss"], "o", color=color, markersize=4)
    ax.set_xlabel("tenant step")
    ax.set_ylabel("train loss")
    ax.set_title(f"mlora_lab run {run.path.name}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
