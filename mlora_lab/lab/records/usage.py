"""What a served job's clients have cost it: its usage rows (:class:`~mlora_lab.rundir.UsageRow`), per API key
and per tenant, as tables and as the runs table's cell.

A usage row holds totals since the job began, so the latest row of each ``(key, tenant)`` is its usage;
a key's usage is the sum over its tenants (and its samples of the base model, tenant ``None``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pandas as pd

from mlora_lab.rundir import Row, UsageRow

COUNTS = ("tokens_trained", "tokens_forward", "tokens_sampled", "busy_s", "requests")
"""The counts of a usage row, in the order tables show them."""

Key = tuple[str, str | None]


def latest_usage(rows: Iterable[Row]) -> dict[Key, UsageRow]:
    """The latest usage row of each (key, tenant) among ``rows`` (other rows are passed over)."""
    out: dict[Key, UsageRow] = {}
    for r in rows:
        if isinstance(r, UsageRow):
            out[(r.key, r.tenant)] = r
    return out


def usage_table(latest: Mapping[Key, UsageRow], by: str = "tenant") -> pd.DataFrame:
    """One row per (key, tenant) (``by="tenant"``; tenant ``None``: samples of the base model) or per key
    (``by="key"``: the sums over its tenants), with :data:`COUNTS`, most busy first."""
    if by not in ("tenant", "key"):
        raise ValueError(f"by must be 'tenant' or 'key', got {by!r}")
    frame = pd.DataFrame(
        [{"key": k, "tenant": t, **{c: getattr(r, c) for c in COUNTS}} for (k, t), r in latest.items()],
        columns=["key", "tenant", *COUNTS],
    )
    if by == "key":
        frame = frame.drop(columns="tenant").groupby("key", as_index=False).sum()
    return frame.sort_values("busy_s", ascending=False, kind="stable").reset_index(drop=True)


def usage_totals(latest: Mapping[Key, UsageRow]) -> dict[str, float] | None:
    """The run's totals of :data:`COUNTS` (None: it has no usage rows: not a served job, or nothing ran)."""
    if not latest:
        return None
    return {c: sum(getattr(r, c) for r in latest.values()) for c in COUNTS}


def usage_cell(latest: Mapping[Key, UsageRow]) -> tuple[str, str]:
    """The runs table's usage cell: its text (tokens trained and sampled) and its tooltip (per key, with
    busy seconds); ``("–", "")`` for a run with no usage."""
    totals = usage_totals(latest)
    if totals is None:
        return "–", ""
    text = f"{short(totals['tokens_trained'])} trained · {short(totals['tokens_sampled'])} sampled"
    per_key = usage_table(latest, by="key")
    lines = [
        f"{r.key}: {int(r.tokens_trained):,} trained, {int(r.tokens_sampled):,} sampled, "
        f"{int(r.requests):,} requests, {r.busy_s:,.1f} s busy"
        for r in per_key.itertuples()
    ]
    return text, "tokens by API key:\n" + "\n".join(lines)


def short(n: float) -> str:
    """A count in a few characters: ``950``, ``12.3k``, ``4.1M``."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}"
