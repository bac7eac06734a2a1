"""The live dashboard: ipywidgets + matplotlib, refreshed from the run directory in a background thread.

    run = ml.launch(spec)
    run.dashboard()            # returns at once; the cell's output keeps updating while the job runs

It only reads the run directory (metrics.jsonl incrementally, status.json, logs/) and writes control
messages (the Stop button), so it works the same for a run launched a minute ago, one attached after a
kernel restart, or one that finished yesterday. Plots are rendered with matplotlib's object API into
PNG images (no pyplot state, no GUI backend), which every frontend shows: JupyterLab, Voila, VS Code.
"""

from __future__ import annotations

import io
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import ipywidgets as W
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from mlora_lab.launch import Run
from mlora_lab.rundir import FINAL_STATES, MetricsReader, RowKind, RunState

# matplotlib's tab10, then ten darker tones: hex, so HTML widgets and plots share one colour per tenant.
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#e6550d", "#756bb1", "#636363",
]  # fmt: skip


STATE_COLOURS = {
    RunState.FAILED: "#c0392b", RunState.LOST: "#c0392b", RunState.FINISHED: "#27ae60", RunState.STOPPED: "#7f8c8d",
}  # fmt: skip


def ema(values: np.ndarray, smoothing: float) -> np.ndarray:
    """Exponential moving average with bias correction (TensorBoard's smoothing; 0 = raw values):
    ``s_i = sum_j w^(i-j) v_j / sum_j w^(i-j)`` with ``w = smoothing``."""
    if smoothing <= 0 or len(values) == 0:
        return values
    return pd.Series(values).ewm(alpha=1 - smoothing, adjust=True).mean().to_numpy()


def thin(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` evenly spaced points, always keeping the last one."""
    if len(x) <= max_points:
        return x, y
    idx = np.unique(np.linspace(0, len(x) - 1, max_points).astype(int))
    return x[idx], y[idx]


class Series:
    """An append-only (x, y) series that hands out numpy arrays without re-converting old points."""

    def __init__(self) -> None:
        self._x: list[float] = []
        self._y: list[float] = []
        self._arrays = (np.empty(0), np.empty(0))

    def append(self, x: float, y: float) -> None:
        self._x.append(x)
        self._y.append(y)

    def __len__(self) -> int:
        return len(self._x) + len(self._arrays[0])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._x:  # fold the new points into the arrays once
            self._arrays = (
                np.concatenate([self._arrays[0], np.asarray(self._x, dtype=float)]),
                np.concatenate([self._arrays[1], np.asarray(self._y, dtype=float)]),
            )
            self._x, self._y = [], []
        return self._arrays


@dataclass
class PlotState:
    """Everything the dashboard draws, accumulated incrementally from metrics rows."""

    train: dict[str, Series] = field(default_factory=lambda: defaultdict(Series))
    evals: dict[str, Series] = field(default_factory=lambda: defaultdict(Series))
    tenant_step: dict[str, int] = field(default_factory=dict)
    tenant_state: dict[str, str] = field(default_factory=dict)
    tenant_reason: dict[str, str | None] = field(default_factory=dict)
    adapter_bytes: dict[str, int] = field(default_factory=dict)
    last_loss: dict[str, float] = field(default_factory=dict)
    memory: dict[int, Series] = field(default_factory=lambda: defaultdict(Series))
    throughput: Series = field(default_factory=Series)
    tokens_per_s: float | None = None
    global_step: int = 0
    t0: float | None = None

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            kind = r.get("kind")
            self.global_step = max(self.global_step, r.get("step", 0))
            if self.t0 is None:
                self.t0 = r.get("time")
            if kind == RowKind.TRAIN:
                self.train[r["tenant"]].append(r["tenant_step"], r["loss"])
                self.tenant_step[r["tenant"]] = r["tenant_step"]
                self.last_loss[r["tenant"]] = r["loss"]
            elif kind == RowKind.EVAL:
                # eval rows carry the global step; place them at the tenant's step at that time
                self.evals[r["tenant"]].append(self.tenant_step.get(r["tenant"], 0), r["loss"])
            elif kind == RowKind.SYSTEM:
                self.memory[r["rank"]].append(r["time"] - (self.t0 or r["time"]), r["mem_bytes"] / 2**20)
                if r["rank"] == 0:
                    self.throughput.append(r["step"], r["tokens_per_s"])
                    self.tokens_per_s = r["tokens_per_s"]
            elif kind == RowKind.TENANT:
                self.tenant_state[r["tenant"]] = r["state"]
                self.tenant_reason[r["tenant"]] = r.get("reason")
                self.adapter_bytes[r["tenant"]] = r.get("adapter_bytes", 0) + r.get("optimizer_bytes", 0)


class Dashboard:
    """Live per-tenant view of one run (see the module docstring); ``refresh()`` draws once."""

    def __init__(self, run: Run, refresh_s: float = 1.0, max_points: int = 1000) -> None:
        self.run = run
        self.refresh_s = refresh_s
        self.max_points = max_points
        self.state = PlotState()
        self._reader = MetricsReader(run.dir.metrics)  # its own offset: it needs every row
        spec = run.spec
        self.max_steps = {t.name: t.max_steps for t in spec.tenants}
        self.colors: dict[str, str] = {}
        for t in spec.tenants:
            self.color(t.name)
        self._build_figures()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

        self.status = W.HTML()
        self.tenants = W.SelectMultiple(
            options=list(self.colors), value=list(self.colors), rows=min(6, max(2, len(self.colors))),
            description="tenants",
        )  # fmt: skip
        self.smoothing = W.FloatSlider(value=0.6, min=0.0, max=0.99, step=0.01, description="smoothing")
        self.logy = W.ToggleButton(value=False, description="log y", icon="line-chart")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop)
        self.loss_plot = W.Image(format="png")
        self.system_plot = W.Image(format="png")
        self.progress = W.VBox()
        self._bars: dict[str, tuple[W.IntProgress, W.HTML]] = {}
        for widget in (self.tenants, self.smoothing, self.logy):
            widget.observe(lambda _: self.redraw(), names="value")
        controls = W.HBox([self.tenants, W.VBox([self.smoothing, W.HBox([self.logy, self.stop_button])])])
        self.widget = W.VBox([self.status, controls, self.progress, self.loss_plot, self.system_plot])

    # -- display and lifecycle -------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def start(self) -> Dashboard:
        """Refresh in a background thread until the run ends (the kernel stays free)."""
        self.refresh()
        if self._thread is None and self.run.status not in FINAL_STATES:
            self._thread = threading.Thread(target=self._loop, name="mlora-dashboard", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing (the run itself is not touched)."""
        self._stop_event.set()

    @property
    def live(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop_event.wait(self.refresh_s):
            if not self.refresh():
                break

    def _on_stop(self, _button: W.Button) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        (self.run.dir.control / "stop").write_text(str(time.time()))  # graceful; the job checkpoints

    # -- drawing ---------------------------------------------------------------------------------
    def color(self, tenant: str) -> str:
        """A colour per tenant, stable for the life of the dashboard (order of first appearance)."""
        if tenant not in self.colors:
            self.colors[tenant] = PALETTE[len(self.colors) % len(PALETTE)]
        return self.colors[tenant]

    def refresh(self) -> bool:
        """Read new metrics rows and redraw; returns False once the run has ended."""
        state = self.run.status
        generation = self._reader.generation
        new = self._reader.poll()
        with self._lock:
            if self._reader.generation != generation:  # metrics.jsonl was rewritten (a resume): start over
                self.state = PlotState()
                new = list(self._reader.rows)
            self.state.add(new)
            for name in list(self.state.train) + list(self.state.tenant_state):
                if name not in self.colors:
                    self.color(name)
                    self.tenants.options = list(self.colors)
                    self.tenants.value = (*self.tenants.value, name)
        self._update_status(state)
        self._update_progress()
        if new or not self.loss_plot.value:
            system_rows = any(r["kind"] in (RowKind.SYSTEM, RowKind.TENANT) for r in new)
            self.redraw(
                system=system_rows and (time.monotonic() - self._system_drawn > 2 or state in FINAL_STATES)
            )
        if state in FINAL_STATES:
            self.stop_button.disabled = True
            self.stop_button.description = state.value
            return False
        return True

    def _update_status(self, state: str) -> None:
        colour = STATE_COLOURS.get(state, "#2c3e50")
        text = f"<b>{self.run.path.name}</b> — <span style='color:{colour}'><b>{state}</b></span>"
        text += f" · step {self.state.global_step}"
        if self.state.tokens_per_s is not None:
            text += f" · {self.state.tokens_per_s:,.0f} tokens/s"
        if state in (RunState.FAILED, RunState.LOST):
            error = self.run.error or ""
            rank = error.split(":")[0].replace("rank", "").strip() if error.startswith("rank") else "0"
            tail = self.run.logs(int(rank) if rank.isdigit() else 0, tail=6)
            text += f"<pre style='color:#c0392b;white-space:pre-wrap'>{_escape(error)}\n{_escape(tail)}</pre>"
        self.status.value = text

    def _update_progress(self) -> None:
        names = list(self.colors)
        for name in names:
            if name not in self._bars:
                bar = W.IntProgress(value=0, min=0, max=max(1, self.max_steps.get(name, 1)),
                                    layout=W.Layout(width="40%"))  # fmt: skip
                bar.style.bar_color = self.colors[name]
                self._bars[name] = (bar, W.HTML())
                self.progress.children = [
                    W.HBox([W.HTML(f"<b style='color:{self.colors[n]}'>{n}</b>", layout=W.Layout(width="120px")),
                            *self._bars[n]])
                    for n in self._bars
                ]  # fmt: skip
            bar, label = self._bars[name]
            step = self.state.tenant_step.get(name, 0)
            bar.value = min(step, bar.max)
            loss = self.state.last_loss.get(name)
            tenant_state = self.state.tenant_state.get(name, "pending")
            reason = self.state.tenant_reason.get(name)
            label.value = (
                f"{step}/{bar.max} · {tenant_state}" + (f" · loss {loss:.4f}" if loss is not None else "")
                + (f" · <span style='color:#c0392b'>{_escape(reason)}</span>" if reason else "")
            )  # fmt: skip

    def redraw(self, system: bool = True) -> None:
        """Render the loss figure (and the system figure) into their image widgets.

        The figures and their lines are built once; a redraw only swaps line data and re-renders,
        so its cost does not grow with the number of refreshes."""
        with self._lock:
            self.loss_plot.value = self._draw_losses()
            if system or not self.system_plot.value:
                self.system_plot.value = self._draw_system()
                self._system_drawn = time.monotonic()

    def _build_figures(self) -> None:
        self._loss_fig = Figure(figsize=(9, 3.4), dpi=80)
        self._loss_fig.subplots_adjust(left=0.07, right=0.99, top=0.97, bottom=0.14)
        self._loss_ax = self._loss_fig.add_subplot(1, 1, 1)
        self._loss_ax.set_xlabel("tenant step")
        self._loss_ax.set_ylabel("loss (lines: train, dots: eval)")
        self._loss_ax.grid(alpha=0.3)
        self._lines: dict[tuple[str, str], object] = {}
        self._legend_key: tuple = ()
        self._sys_fig = Figure(figsize=(9, 2.4), dpi=80)
        self._sys_fig.subplots_adjust(left=0.06, right=0.99, top=0.88, bottom=0.2, wspace=0.35)
        self._mem_ax, self._tput_ax, self._tenant_ax = self._sys_fig.subplots(1, 3)
        for ax, title in ((self._mem_ax, "memory per rank (MiB)"), (self._tput_ax, "tokens / s")):
            ax.set_title(title, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        self._mem_ax.set_xlabel("seconds", fontsize=8)
        self._tput_ax.set_xlabel("step", fontsize=8)
        (self._tput_line,) = self._tput_ax.plot([], [], color="#555")
        self._mem_lines: dict[int, object] = {}
        self._bar_names: list[str] | None = None
        self._bars_artist = None
        self._system_drawn = 0.0

    @staticmethod
    def _png(fig: Figure) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def _line(self, name: str, kind: str):
        key = (name, kind)
        if key not in self._lines:
            style = {
                "train": dict(linewidth=1.4, label=name),
                "eval": dict(marker="o", linestyle="--", markersize=4, linewidth=0.8, label=f"{name} (eval)"),
            }
            (self._lines[key],) = self._loss_ax.plot([], [], color=self.colors[name], **style[kind])  # fmt: skip
        return self._lines[key]

    def _draw_losses(self) -> bytes:
        ax, shown, visible = self._loss_ax, set(self.tenants.value), []
        for name in self.colors:
            for kind, series in (("train", self.state.train.get(name)), ("eval", self.state.evals.get(name))):
                if not series and (name, kind) not in self._lines:
                    continue
                line = self._line(name, kind)
                if name in shown and series:
                    x, y = series.arrays()
                    if kind == "train":
                        x, y = thin(x, ema(y, self.smoothing.value), self.max_points)
                    line.set_data(x, y)
                    line.set_visible(True)
                    visible.append(line)
                else:
                    line.set_visible(False)
        ax.set_yscale("log" if self.logy.value else "linear")
        ax.relim(visible_only=True)
        ax.autoscale_view()
        key = tuple(line.get_label() for line in visible)
        if key != self._legend_key:  # rebuilding a legend is costly: only when the lines change
            if ax.get_legend() is not None:
                ax.get_legend().remove()
            if visible:
                ax.legend(handles=visible, fontsize=8, ncol=2, loc="upper right")
            self._legend_key = key
        return self._png(self._loss_fig)

    def _draw_system(self) -> bytes:
        for rank, series in sorted(self.state.memory.items()):
            if rank not in self._mem_lines:
                (self._mem_lines[rank],) = self._mem_ax.plot([], [], label=f"rank {rank}")
                self._mem_ax.legend(fontsize=7)
            self._mem_lines[rank].set_data(*thin(*series.arrays(), self.max_points))
        if self.state.throughput:
            steps, tput = self.state.throughput.arrays()
            self._tput_line.set_data(*thin(steps, ema(tput, 0.8), self.max_points))
        for ax in (self._mem_ax, self._tput_ax):
            ax.relim()
            ax.autoscale_view()
        names = [n for n in self.colors if n in self.state.adapter_bytes]
        widths = [self.state.adapter_bytes[n] / 2**20 for n in names]
        if names != self._bar_names:  # new tenants: rebuild the bars (rare)
            self._tenant_ax.clear()
            self._bars_artist = self._tenant_ax.barh(names, widths, color=[self.colors[n] for n in names])
            self._tenant_ax.set_title("adapter + optimiser (MiB)", fontsize=9)
            self._tenant_ax.tick_params(labelsize=7)
            self._tenant_ax.grid(alpha=0.3)
            self._bar_names = names
        else:
            for bar, width in zip(self._bars_artist, widths):
                bar.set_width(width)
            self._tenant_ax.relim()
            self._tenant_ax.autoscale_view()
        return self._png(self._sys_fig)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
