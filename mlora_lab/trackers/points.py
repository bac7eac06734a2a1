"""What a metrics row becomes in a tracker: the one mapping the job's sink and the after-the-fact
mirror share. Pure: no tracker is imported here.

A tracker run is named by a *key*: a tenant's name, or :data:`JOB` for the job's own run. With
``report_group="tenant"`` each tenant has its run, on its own step axis (the tenant step, what
transformers' Trainer calls the global step of one model), and the job's run holds what belongs to no
tenant; with ``"job"`` there is one run, on the job's global step, and each tenant's metrics carry its
name last so that a tracker's sorted list puts the tenants' curves of one metric side by side.

====================  ==============================  ==========================================
row                   report_group="tenant"           report_group="job"
====================  ==============================  ==========================================
train                 tenant run, step = tenant_step  job run, step = global step
                      ``train/loss``,                 ``train/loss/<tenant>``, ...,
                      ``train/learning_rate``,        ``train/tenant_step/<tenant>``
                      ``train/grad_norm``,
                      ``train/tokens``,
                      ``train/rows_seen``,
                      ``train/tokens_seen``,
                      ``train/global_step``
eval                  ``eval/loss`` at the tenant's   ``eval/loss/<tenant>``
                      latest tenant step
tenant                ``tenant/adapter_bytes``,       ``tenant/adapter_bytes/<tenant>``, ...;
                      ``tenant/optimizer_bytes``;     text ``tenant/state/<tenant>``
                      text ``tenant/state``
system                job run, step = global step: ``system/<meter>/rank<R>`` (mem_bytes,
                      peak_mem_bytes, step_time, tokens_per_s, cpu_percent, gpu_util)
event                 job run: text ``events`` (``"resumed: from step_40 on 2 process(es)"``)
completion            text ``completions`` (tenant        text ``completions/<tenant>``
                      run, at its tenant step): a
                      table of the step's sampled
                      completions (reward, prompt,
                      completion), as TRL logs them
====================  ==============================  ==========================================

A value that is missing or not finite (JSON ``null``) is left out. Hyperparameters: a tenant run's
config is the tenant's fields (``lr``, ``rank``, ``target_modules``, ...) and the job's as ``job.<field>``;
the job run's is the job's fields, and in ``"job"`` grouping each tenant's as ``tenants.<name>.<field>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlora_lab.rundir import (
    HELDOUT_KIND,
    CompletionRow,
    EventRow,
    HeldoutRow,
    Row,
    SystemRow,
    TenantRow,
    TrainRow,
)
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.tenant import Tenant

JOB: str | None = None
"""The key of the job's own tracker run."""

TRAIN_NAMES = {"lr": "learning_rate"}
"""Train fields renamed as transformers' Trainer names them."""
NOT_METRICS = frozenset({"kind", "step", "tenant", "tenant_step", "rank", "time"})
"""Fields of a row that say where and when, not what was measured."""
TENANT_METRICS = ("adapter_bytes", "optimizer_bytes")
"""What a tenant row measures (the whole tensors; rank 0's share is not mirrored)."""
REPORTING_FIELDS = frozenset({"report_to", "report_group", "logging_dir", "project", "output_dir", "tenants"})
"""Job fields left out of a tracker run's config: where things go, not how the job trained."""


@dataclass(frozen=True)
class Log:
    """Numbers for tracker run ``key`` at ``step``."""

    key: str | None
    step: int
    values: dict[str, float]


@dataclass(frozen=True)
class Note:
    """A line of text for tracker run ``key`` at ``step``, under ``tag``."""

    key: str | None
    step: int
    tag: str
    text: str


@dataclass
class TrackerRun:
    """One tracker run a mirror opens: its key, its name, the group and kind it is filed under, the
    folder it takes under a tracker's directory (TensorBoard's runs are folders), and its config."""

    key: str | None
    title: str
    group: str | None
    kind: str
    """``"tenant"`` or ``"job"`` (W&B's ``job_type``)."""
    folder: str
    config: dict[str, Any] = field(default_factory=dict)
    since: int = 0
    """The first step this mirror sends new values for: a resumed job's rows after its checkpoint,
    ``0`` for a whole run. What a tracker holds from this step on is replaced (TensorBoard)."""


def numbers(row: Row, names: tuple[str, ...] | None = None) -> dict[str, float]:
    """The row's finite numeric fields (``names``, or every field that is a measurement)."""
    out = {}
    for name in row.__struct_fields__:
        if (names is None and name in NOT_METRICS) or (names is not None and name not in names):
            continue
        v = getattr(row, name)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = v
        elif (
            isinstance(v, dict) and names is None
        ):  # (``extra``: rewards/<fn>/mean, log_metric's, as TRL names them)
            out |= {
                str(k): x
                for k, x in v.items()
                if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            }
    return out


class RowMapper:
    """Rows → :class:`Log` and :class:`Note` items for one grouping, in the order rows come. It keeps
    each tenant's latest tenant step: an eval or tenant row carries only the global step."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.tenant_steps: dict[str, int] = {}
        self.pending: list[CompletionRow] = []  # the completions of one tenant's step, sent as one table
        self.seeded: dict[str | None, int] = {}  # each key's last step in the rows before this mirror

    def seed(self, row: Row) -> None:
        """Learn from a row that is not sent (the rows a resumed job already wrote)."""
        self._learn(row)
        step = getattr(row, "step", None)
        if isinstance(step, int):
            self.seeded[JOB] = max(self.seeded.get(JOB, step), step)
        if isinstance(row, TrainRow) and self.group == "tenant":
            self.seeded[row.tenant] = row.tenant_step

    def since(self, key: str | None) -> int:
        """The first step of ``key``'s tracker run that holds new values (see :attr:`TrackerRun.since`)."""
        return self.seeded[key] + 1 if key in self.seeded else 0

    def items(self, row: Row) -> list[Log | Note]:
        """What ``row`` becomes (nothing for a row with nothing to show). A completion row waits for the
        others of its tenant's step: they become one table when a row of anything else comes (or
        :meth:`flush`)."""
        self._learn(row)
        if isinstance(row, CompletionRow):
            first = self.pending[0] if self.pending else None
            out = (
                self.flush()
                if first and (first.tenant, first.tenant_step) != (row.tenant, row.tenant_step)
                else []
            )
            self.pending.append(row)
            return out
        return self.flush() + self._row_items(row)

    def flush(self) -> list[Log | Note]:
        """The waiting completions, as one table (none: nothing)."""
        rows, self.pending = self.pending, []
        if not rows:
            return []
        tenant = rows[0].tenant
        tag = "completions" if self.group == "tenant" else f"completions/{tenant}"
        step = rows[0].tenant_step if self.group == "tenant" else rows[0].step  # (its own, not the latest)
        return [Note(self._key(tenant), step, tag, completions_table(rows))]

    def _row_items(self, row: Row) -> list[Log | Note]:
        if isinstance(row, TrainRow):
            values = {TRAIN_NAMES.get(k, k): v for k, v in numbers(row).items()}
            if self.group == "job":
                values["tenant_step"] = row.tenant_step
            else:
                values["global_step"] = row.step
            return self._tenant(row.tenant, row, "train", values)
        if isinstance(row, HeldoutRow):
            return self._tenant(row.tenant, row, HELDOUT_KIND, numbers(row))  # (eval/loss: the rows' kind)
        if isinstance(row, TenantRow):
            items = self._tenant(row.tenant, row, "tenant", numbers(row, TENANT_METRICS))
            text = f"{row.state.value}: {row.reason}" if row.reason else row.state.value
            tag = "tenant/state" if self.group == "tenant" else f"tenant/state/{row.tenant}"
            return [*items, Note(self._key(row.tenant), self._step(row.tenant, row), tag, text)]
        if isinstance(row, SystemRow):
            values = {f"system/{k}/rank{row.rank}": v for k, v in numbers(row).items()}
            return [Log(JOB, row.step, values)] if values else []
        if isinstance(row, EventRow):
            return [Note(JOB, row.step, "events", f"{row.event.value}: {row.message}")]
        return []

    def _learn(self, row: Row) -> None:
        if isinstance(row, TrainRow):
            self.tenant_steps[row.tenant] = row.tenant_step

    def _key(self, tenant: str) -> str | None:
        return tenant if self.group == "tenant" else JOB

    def _step(self, tenant: str, row: Row) -> int:
        if isinstance(row, TrainRow):
            return row.tenant_step if self.group == "tenant" else row.step
        return self.tenant_steps.get(tenant, 0) if self.group == "tenant" else row.step

    def _tenant(self, tenant: str, row: Row, section: str, values: dict[str, float]) -> list[Log | Note]:
        if not values:
            return []
        if self.group == "job":
            values = {f"{section}/{k}/{tenant}": v for k, v in values.items()}
        else:
            values = {f"{section}/{k}": v for k, v in values.items()}
        return [Log(self._key(tenant), self._step(tenant, row), values)]


def completions_table(rows: list[CompletionRow], most: int = 2000) -> str:
    """Completions as a Markdown table (TensorBoard's text tab renders it): reward, prompt, completion, each
    cell on one line, cut past ``most`` characters."""

    def cell(text: object) -> str:
        text = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ⏎ ")
        return text if len(text) <= most else text[:most] + " …"

    lines = ["| reward | prompt | completion |", "|---|---|---|"]
    for r in rows:
        reward = "–" if r.reward is None else f"{r.reward:.4g}"
        lines.append(f"| {reward} | {cell(r.prompt)} | {cell(r.completion)} |")
    return "\n".join(lines)


# -- names and hyperparameters -----------------------------------------------------------------------


def job_title(spec: JobSpec, run_dir: Path) -> str:
    """The name of a run's tracker runs: the job's name where its spec has one, else its directory's
    (a tenant's run is ``<title>/<tenant>``, grouped under ``<title>``)."""
    return getattr(spec, "name", None) or run_dir.name


def job_config(spec: JobSpec) -> dict[str, Any]:
    """The job's settings as a flat config (``parallel.nproc``, ...), without its tenants and without
    where things go."""
    out: dict[str, Any] = {}
    for name, value in spec.to_dict().items():
        if name in REPORTING_FIELDS:
            continue
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def tenant_config(tenant: Tenant | None, name: str) -> dict[str, Any]:
    """A tenant's hyperparameters, its spec's fields (RL settings as ``rl.<field>``); only the name
    when its spec is not known."""
    if tenant is None:
        return {"name": name}
    out: dict[str, Any] = {}
    for k, v in tenant.to_dict().items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def tenant_run_config(job: dict[str, Any], tenant: dict[str, Any]) -> dict[str, Any]:
    """A tenant run's config (``report_group="tenant"``): the tenant's fields, then the job's as
    ``job.<field>``."""
    return {**tenant, **{f"job.{k}": v for k, v in job.items()}}


def tenants_entries(name: str, tenant: dict[str, Any]) -> dict[str, Any]:
    """A tenant's fields in the job run's config (``report_group="job"``): ``tenants.<name>.<field>``."""
    return {f"tenants.{name}.{k}": v for k, v in tenant.items()}
