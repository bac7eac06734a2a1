"""The dashboard's text: a header line per run (state, step, tokens/s, elapsed, ETA, why it waits or
failed) and a progress row per tenant (bar, step, state, loss, an RL tenant's reward, elapsed, ETA, the
reason of a failure)."""

from __future__ import annotations

import html

import ipywidgets as W
import numpy as np

from mlora_lab.lab.dashboard.figures import AMBER, GREEN, GREY, INK, RED
from mlora_lab.lab.dashboard.model import RunView, TenantShown, Unreadable
from mlora_lab.lab.plotting import shorten
from mlora_lab.lab.records.series import TenantSeries
from mlora_lab.rundir import RunState, TenantState

STATE_COLOURS: dict[RunState | TenantState | Unreadable, str] = {
    RunState.FAILED: RED,
    RunState.LOST: RED,
    RunState.FINISHED: GREEN,
    RunState.STOPPED: GREY,
    TenantState.FAILED: RED,
    TenantState.REFUSED: RED,
    TenantState.FINISHED: GREEN,
    TenantState.REMOVED: GREY,
    TenantState.PAUSED: AMBER,
    Unreadable.BROKEN: RED,
}
"""States shown in colour (the others in the text colour)."""


def duration(seconds: float | None) -> str:
    """``42 s``, ``3:05``, ``1:02:03``; ``?`` when unknown."""
    if seconds is None or not np.isfinite(seconds):
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def run_state_html(view: RunView) -> str:
    """The run's state in its colour; a run that ended well with quarantined tenants says so (amber
    if some tenants failed, red if all did): a failure must not hide behind a green "finished"."""
    state = view.state
    failed = view.failed_tenants()
    colour = STATE_COLOURS.get(state, INK) if state is not None else INK
    text = str(state) if state is not None else "?"
    if failed and state not in (RunState.FAILED, RunState.LOST, Unreadable.BROKEN):
        n = len(failed)
        text += f" · {n} tenant{'s' if n > 1 else ''} failed"
        colour = AMBER if n < len(view.series.tenants) else RED
    return f"<span style='color:{colour}'><b>{html.escape(text)}</b></span>"


def header_html(view: RunView) -> str:
    """One run's header line: name, state, step, tokens/s, elapsed, ETA; Slurm's reason while it
    waits; what fails in a run that goes on (saves on a full disk); the error and the log tail of
    the rank that failed."""
    feed = view.series
    name = f"<b>{html.escape(shorten(feed.title, 60))}</b>"
    if feed.title != view.name:  # the run's directory, to find it (and tell re-runs of a notebook apart)
        name += f" <span style='color:{GREY}'>{html.escape(view.name)}</span>"
    text = f"{name} — {run_state_html(view)} · global step {feed.global_step}"
    if feed.tokens_per_s is not None:
        text += f" · {feed.tokens_per_s:,.0f} tokens/s"
    if (elapsed := view.elapsed()) is not None:
        text += f" · {duration(elapsed)}"
    if (eta := view.eta()) is not None:
        text += f" · ETA {duration(eta)}"
    if view.state is RunState.QUEUED and view.waiting:  # Slurm: why it waits (Resources, ...)
        text += f" · {html.escape(view.waiting)}"
    if view.state is RunState.RUNNING and view.error:  # it goes on, but says what fails (saves)
        text += f"<div style='color:{AMBER};white-space:pre-wrap'>{html.escape(view.error)}</div>"
    if view.state in (RunState.FAILED, RunState.LOST):
        text += (
            f"<pre style='color:{RED};white-space:pre-wrap;margin:2px 0'>{html.escape(view.error or '')}\n"
            f"{html.escape(view.failure_log())}</pre>"
        )
    return text


class TenantProgress:
    """A tenant's progress row: name, bar and numbers on one line of fixed widths, and the reason of a
    failure below it, cut to one line with the whole text in its tooltip (a long reason never
    squeezes the bar)."""

    def __init__(self, label: str, colour: str, max_steps: int | None) -> None:
        self.label: str | None = None
        self.name = W.HTML(layout=W.Layout(width="220px", min_width="220px"))
        self.bar = W.IntProgress(
            value=0, min=0, max=max(1, max_steps or 1), layout=W.Layout(width="200px", min_width="200px")
        )
        self.bar.style.bar_color = colour
        self.info = W.HTML(layout=W.Layout(width="460px", min_width="200px"))
        self.reason = W.HTML(layout=W.Layout(width="880px", max_width="100%", display="none"))
        # never shrunk: in the scrolling list of rows (a max height) flex items shrink by default, and a
        # row shrunk below its text draws over the next one (a trial's bar over a prune reason)
        self.box = W.VBox(
            [W.HBox([self.name, self.bar, self.info]), self.reason], layout=W.Layout(flex="0 0 auto")
        )
        self.rename(label, colour)

    def rename(self, label: str, colour: str) -> None:
        """Show another label (``tenant`` becomes ``run / tenant`` when a second run is chosen)."""
        if label != self.label:
            self.label = label
            swatch = (
                f"<span style='display:inline-block;width:10px;height:10px;background:{colour};"
                "margin-right:4px'></span>"
            )
            self.name.value = (
                f"<div title='{html.escape(label, quote=True)}' style='white-space:nowrap;overflow:hidden;"
                f"text-overflow:ellipsis'>{swatch}<b style='color:{colour}'>{html.escape(label)}</b></div>"
            )

    def update(self, tenant: TenantSeries, state: TenantShown | None, resumes: list[float]) -> None:
        """Show the tenant's step of its max_steps, its state, latest loss, time and ETA, and why it
        failed or was refused."""
        if tenant.max_steps and self.bar.max != tenant.max_steps:
            self.bar.max = tenant.max_steps
        self.bar.value = min(tenant.step, self.bar.max)
        # (a tenant with no goal, a Tinker client's: its steps done, and no bar that would read as done)
        visibility = "visible" if tenant.max_steps else "hidden"
        if self.bar.layout.visibility != visibility:
            self.bar.layout.visibility = visibility
        shown = str(state) if state is not None else "?"
        colour = STATE_COLOURS.get(state) if state is not None else None
        shown = f"<span style='color:{colour}'>{shown}</span>" if colour else shown
        steps = f"{tenant.step}/{tenant.max_steps}" if tenant.max_steps else f"{tenant.step} steps"
        text = f"{steps} · {shown}"
        if tenant.last_loss is not None:
            text += f" · {tenant.loss_shown()}"  # (a Tinker client's: loss:sum, its mean a token beside it)
        if tenant.last_reward is not None:  # an RL tenant: what it is trained to raise
            text += f" · reward {tenant.last_reward:.4g}"
        elapsed, eta = tenant.timing(resumes)
        if elapsed:
            text += f" · {duration(elapsed)}"
        if eta is not None and state is TenantState.RUNNING:
            text += f" · ETA {duration(eta)}"
        if self.info.value != text:
            self.info.value = text
        # why it failed (red) or what it is warned of (amber: it trains on nothing), in full: wrapped, never
        # cut (a quarantine's reason names the reward function, its file and what it did)
        reason = tenant.reason or ""
        warning = tenant.warning if state is TenantState.RUNNING else None
        lines = [(RED, reason)] if reason else []
        lines += [(AMBER, f"warning: {warning}")] if warning else []
        if lines:
            value = "".join(
                f"<div title='{html.escape(text, quote=True)}' style='color:{colour};white-space:pre-wrap;"
                f"overflow-wrap:anywhere;padding-left:226px'>{html.escape(text)}</div>"
                for colour, text in lines
            )
            if self.reason.value != value:
                self.reason.value = value
        self.reason.layout.display = "" if lines else "none"
