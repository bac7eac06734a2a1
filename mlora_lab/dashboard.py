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
from mlora_lab.rundir import FINAL_STATES, MetricsReader

# matplotlib's tab10, then ten darker tones: hex, so HTML widgets and plots share one colour per tenant.
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#e6550d", "#756bb1", "#636363",
]  # fmt: skip


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


@dataclass
class RunState:
    """Everything the dashboard draws, accumulated incrementally from metrics rows."""

    train: dict[str, tuple[list[int], list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: ([], []))
    )
    evals: dict[str, tuple[list[int], list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: ([], []))
    )
    tenant_step: dict[str, int] = field(default_factory=dict)
    tenant_state: dict[str, str] = field(default_factory=dict)
    tenant_reason: dict[str, str | None] = field(default_factory=dict)
    adapter_bytes: dict[str, int] = field(default_factory=dict)
    last_loss: dict[str, float] = field(default_factory=dict)
    memory: dict[int, tuple[list[float], list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: ([], []))
    )
    throughput: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    global_step: int = 0
    t0: float | None = None

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            kind = r.get("kind")
            self.global_step = max(self.global_step, r.get("step", 0))
            if self.t0 is None:
                self.t0 = r.get("time")
            if kind == "train":
                steps, losses = self.train[r["tenant"]]
                steps.append(r["tenant_step"])
                losses.append(r["loss"])
                self.tenant_step[r["tenant"]] = r["tenant_step"]
                self.last_loss[r["tenant"]] = r["loss"]
            elif kind == "eval":
                # eval rows carry the global step; place them at the tenant's step at that time
                steps, losses = self.evals[r["tenant"]]
                steps.append(self.tenant_step.get(r["tenant"], 0))
                losses.append(r["loss"])
            elif kind == "system":
                times, mem = self.memory[r["rank"]]
                times.append(r["time"] - (self.t0 or r["time"]))
                mem.append(r["mem_bytes"] / 2**20)
                if r["rank"] == 0:
                    self.throughput[0].append(r["step"])
                    self.throughput[1].append(r["tokens_per_s"])
            elif kind == "tenant":
                self.tenant_state[r["tenant"]] = r["state"]
                self.tenant_reason[r["tenant"]] = r.get("reason")
                self.adapter_bytes[r["tenant"]] = r.get("adapter_bytes", 0) + r.get("optimizer_bytes", 0)


class Dashboard:
    """Live per-tenant view of one run (see the module docstring); ``refresh()`` draws once."""

    def __init__(self, run: Run, refresh_s: float = 1.0, max_points: int = 1000) -> None:
        self.run = run
        self.refresh_s = refresh_s
        self.max_points = max_points
        self.state = RunState()
        self._reader = MetricsReader(run.dir.metrics)  # its own offset: it needs every row
        spec = run.spec
        self.max_steps = {t.name: t.max_steps for t in spec.tenants}
        self.colors: dict[str, str] = {}
        for t in spec.tenants:
            self.color(t.name)
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
        new = self._reader.poll()
        with self._lock:
            self.state.add(new)
            for name in list(self.state.train) + list(self.state.tenant_state):
                if name not in self.colors:
                    self.color(name)
                    self.tenants.options = list(self.colors)
                    self.tenants.value = (*self.tenants.value, name)
        self._update_status(state)
        self._update_progress()
        if new or not self.loss_plot.value:
            self.redraw()
        if state in FINAL_STATES:
            self.stop_button.disabled = True
            self.stop_button.description = state
            return False
        return True

    def _update_status(self, state: str) -> None:
        colour = {"failed": "#c0392b", "finished": "#27ae60", "stopped": "#7f8c8d"}.get(state, "#2c3e50")
        text = f"<b>{self.run.path.name}</b> — <span style='color:{colour}'><b>{state}</b></span>"
        text += f" · step {self.state.global_step}"
        if self.state.throughput[1]:
            text += f" · {self.state.throughput[1][-1]:,.0f} tokens/s"
        if state == "failed":
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

    def redraw(self) -> None:
        """Render both figures into their image widgets."""
        with self._lock:
            self.loss_plot.value = self._render(self._draw_losses, (9, 3.6))
            self.system_plot.value = self._render(self._draw_system, (9, 2.6))

    @staticmethod
    def _render(draw, size: tuple[float, float]) -> bytes:
        fig = Figure(figsize=size, dpi=80)
        draw(fig)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def _draw_losses(self, fig: Figure) -> None:
        ax = fig.add_subplot(1, 1, 1)
        for name in self.tenants.value:
            steps, losses = self.state.train.get(name, ([], []))
            if steps:
                x, y = thin(np.asarray(steps), ema(np.asarray(losses, dtype=float), self.smoothing.value),
                            self.max_points)  # fmt: skip
                ax.plot(x, y, color=self.colors[name], label=name, linewidth=1.4)
            esteps, elosses = self.state.evals.get(name, ([], []))
            if esteps:
                ax.plot(esteps, elosses, "o--", color=self.colors[name], markersize=4, linewidth=0.8,
                        label=f"{name} (eval)")  # fmt: skip
        ax.set_xlabel("tenant step")
        ax.set_ylabel("loss")
        if self.logy.value:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, ncol=2, loc="upper right")

    def _draw_system(self, fig: Figure) -> None:
        mem_ax, tput_ax, tenant_ax = fig.subplots(1, 3)
        for rank, (times, mem) in sorted(self.state.memory.items()):
            x, y = thin(np.asarray(times), np.asarray(mem), self.max_points)
            mem_ax.plot(x, y, label=f"rank {rank}")
        mem_ax.set_title("memory per rank (MiB)", fontsize=9)
        mem_ax.set_xlabel("seconds", fontsize=8)
        if self.state.memory:
            mem_ax.legend(fontsize=7)
        steps, tput = self.state.throughput
        if steps:
            x, y = thin(np.asarray(steps), ema(np.asarray(tput, dtype=float), 0.8), self.max_points)
            tput_ax.plot(x, y, color="#555")
        tput_ax.set_title("tokens / s", fontsize=9)
        tput_ax.set_xlabel("step", fontsize=8)
        names = [n for n in self.colors if n in self.state.adapter_bytes]
        tenant_ax.barh(names, [self.state.adapter_bytes[n] / 2**20 for n in names],
                       color=[self.colors[n] for n in names])  # fmt: skip
        tenant_ax.set_title("adapter + optimiser (MiB)", fontsize=9)
        for ax in (mem_ax, tput_ax, tenant_ax):
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
