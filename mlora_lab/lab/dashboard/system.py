"""The dashboard's system tab: memory per rank, CPU/GPU utilisation, throughput, and each tenant's
adapter + optimiser memory."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mlora_lab.lab.dashboard.figures import WAITING, Hover, Panel, Scene, Smoother
from mlora_lab.lab.dashboard.model import Key
from mlora_lab.lab.plotting import (
    MAX_DRAWN,
    PALETTE,
    drawable,
    marker_for,
    placeholder,
    plain,
    series_colour,
    set_x_axis,
    shorten,
    style_axes,
    thin_with_breaks,
)
from mlora_lab.lab.records.series import TIME_AXES, gap_breaks

MAX_BARS = 20
"""The tenant memory panel shows the biggest this many tenants."""


def system_x(x: str) -> str:
    """The x axis of system rows for the dashboard's x axis: the wall clock or the global step when
    that is chosen, else seconds since the run started (a rank has no tenant step or tokens)."""
    return x if x in ("wall time", "global step") else "relative time"


class SystemFigure(Panel):
    """Memory per rank (from 0: a 1 % jitter must not look like a leak), utilisation (GPU solid, CPU
    dashed), tokens/s (smoothed over its faded raw values) and the tenants' memory bars."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        super().__init__((9, 4.8), interactive, lock, hover)
        (self.mem_ax, self.util_ax), (self.tput_ax, self.bars_ax) = self.axes(2, 2)
        self.smoother = smoother
        style_axes(self.mem_ax, title="memory per rank (MiB)")
        style_axes(self.util_ax, title="utilisation: GPU % (solid), CPU % of one core (dashed)")
        style_axes(self.tput_ax, title="tokens / s")
        style_axes(self.bars_ax, title="adapter + optimiser per tenant (MiB)")
        self.bar_keys: list[Key] | None = None
        self.bars: tuple = ()
        """The two bar containers: adapters (solid) and optimisers (hatched), one bar per tenant."""

    def set_x(self, x: str) -> None:
        for ax in (self.mem_ax, self.util_ax, self.tput_ax):
            set_x_axis(ax, system_x(x))

    def draw(self, scene: Scene) -> None:
        x = self.x = system_x(scene.x)
        mem, util, tput = self.sets[self.mem_ax], self.sets[self.util_ax], self.sets[self.tput_ax]
        shown: dict[Any, set] = {self.mem_ax: set(), self.util_ax: set(), self.tput_ax: set()}
        util_points = 0
        mem_range: list[float] = []
        per_line = scene.points(sum(len(scene.feeds[n].system) for n in scene.chosen) * 2)
        for name in scene.chosen:
            feed = scene.feeds[name]
            for rank, columns in sorted(feed.system.items()):
                cols = columns.arrays()
                xs = feed.system_x(cols, x)
                breaks = gap_breaks(cols["time"], feed.resumes) if x in TIME_AXES else None
                label = f"{shorten(feed.title, 24)} / rank {rank}" if scene.several else f"rank {rank}"
                colour = series_colour(feed.title, rank) if scene.several else PALETTE[rank % len(PALETTE)]
                mib = drawable(cols["mem"] / 2**20)
                line = mem.get((name, rank), color=colour, linewidth=1.2, label=plain(label))
                line.set_linestyle(scene.style(name))
                line.set_data(*thin_with_breaks(xs, mib, breaks, per_line))
                line.set_marker(marker_for(len(xs)))
                self.hover.name(line, label)
                shown[self.mem_ax].add((name, rank))
                if np.isfinite(mib).any():
                    mem_range += [float(np.nanmin(mib)), float(np.nanmax(mib))]
                for field, style in (("gpu_util", "-"), ("cpu_percent", "--")):
                    ys = drawable(cols[field])
                    if not np.isfinite(ys).any():
                        continue
                    util_points += int(np.isfinite(ys).sum())
                    what = "GPU" if field == "gpu_util" else "CPU"
                    line = util.get(
                        (name, rank, field),
                        color=colour,
                        linestyle=style,
                        linewidth=1.0,
                        label=plain(f"{label} {what}"),
                    )
                    line.set_data(*thin_with_breaks(xs, ys, breaks, per_line))
                    self.hover.name(line, f"{label} {what} %" + (" of one core" if what == "CPU" else ""))
                    shown[self.util_ax].add((name, rank, field))
                if rank == 0:
                    tps = drawable(cols["tokens_per_s"])
                    tcolour = series_colour(feed.title, 0) if scene.several else "#555555"
                    smooth = self.smoother(
                        feed, (name, "#rank0"), "tokens_per_s", tps, max(scene.smoothing, 0.5)
                    )
                    line = tput.get(
                        (name, "main"),
                        color=tcolour,
                        linewidth=1.4,
                        label=plain(feed.title) if scene.several else "tokens/s",
                    )
                    line.set_linestyle(scene.style(name))
                    line.set_data(*thin_with_breaks(xs, smooth, breaks, per_line))
                    line.set_marker(marker_for(len(xs)))
                    self.hover.name(line, f"{feed.title} tokens/s (smoothed)")
                    raw = tput.get((name, "raw"), color=tcolour, linewidth=0.7, alpha=0.25, label="_raw")
                    raw.set_data(*thin_with_breaks(xs, tps, breaks, per_line))
                    self.hover.name(raw, f"{feed.title} tokens/s (raw)")
                    shown[self.tput_ax] |= {(name, "main"), (name, "raw")}
        for ax, keys in shown.items():
            self.sets[ax].show_only(keys)
        self._finish_memory(shown[self.mem_ax], mem_range)
        self._finish_utilisation(scene, util_points)
        placeholder(self.tput_ax, None if shown[self.tput_ax] else WAITING)
        self.autoscale(self.tput_ax, False, from_zero=True)
        self.draw_bars(scene)

    def _finish_memory(self, shown: set, mem_range: list[float]) -> None:
        placeholder(self.mem_ax, None if shown else WAITING)
        self.autoscale(self.mem_ax, False, from_zero=True)  # from 0: 1 % jitter must not look like a leak
        title = "memory per rank (MiB)"
        if mem_range and max(map(abs, mem_range)) < 1e15:
            title += f" · range {min(mem_range):,.0f}–{max(mem_range):,.0f}"
        self.mem_ax.set_title(title, fontsize=9)
        legend_key = tuple(sorted(map(str, shown)))
        if 0 < len(legend_key) <= 8 and getattr(self.mem_ax, "_lab_legend_key", None) != legend_key:
            self.mem_ax.legend(fontsize=7, loc="lower right")
            self.mem_ax._lab_legend_key = legend_key

    def _finish_utilisation(self, scene: Scene, points: int) -> None:
        if points:
            placeholder(self.util_ax, None)
            self.autoscale(self.util_ax, False, from_zero=True)
            if self.util_ax.get_autoscaley_on():
                self.util_ax.set_ylim(0, max(100.0, self.util_ax.get_ylim()[1]), auto=None)
            return
        logged = any(len(c) for n in scene.chosen for c in scene.feeds[n].system.values())
        why = "utilisation not logged\n(system rows without cpu_percent / gpu_util)" if logged else WAITING
        placeholder(self.util_ax, why)

    def draw_bars(self, scene: Scene) -> None:
        """Each picked tenant's memory, adapter (solid) + optimiser (hatched), from its latest tenant row."""
        ax = self.bars_ax
        sizes = {}
        for key in scene.picked:
            t = scene.feeds[key[0]].tenants[key[1]]
            if t.adapter_bytes or t.optimizer_bytes:
                sizes[key] = tuple(
                    float(np.clip(b / 2**20, 0, MAX_DRAWN)) for b in (t.adapter_bytes, t.optimizer_bytes)
                )
        order = list(sizes)
        keys = sorted(sorted(sizes, key=lambda k: -sum(sizes[k]))[:MAX_BARS], key=order.index)  # the biggest
        if keys != self.bar_keys:  # other tenants: new bars (rare); numeric positions, so no stale labels
            for artist in self.bars:
                artist.remove()
            ys, colours = np.arange(len(keys)), [scene.colour(k) for k in keys]
            adapter = ax.barh(ys, [sizes[k][0] for k in keys], color=colours)
            left = [sizes[k][0] for k in keys]
            optim = ax.barh(ys, [sizes[k][1] for k in keys], left=left, color=colours, alpha=0.4, hatch="//")
            ax.set_yticks(ys, [plain(scene.label(k)) for k in keys])
            if keys:
                ax.set_ylim(len(keys) - 0.5, -0.5)  # the first tenant on top
            self.bars = (adapter, optim)
            self.bar_keys = keys
        else:
            adapter, optim = self.bars
            for k, a, o in zip(keys, adapter, optim):
                a.set_width(sizes[k][0])
                o.set_x(sizes[k][0])
                o.set_width(sizes[k][1])
        title = "adapter + optimiser (hatched) per tenant (MiB)"
        if len(sizes) > MAX_BARS:
            title += f" · top {MAX_BARS} of {len(sizes)}"
        ax.set_title(title, fontsize=9)
        placeholder(ax, None if keys else "no tenant memory logged yet")
        if keys:
            ax.set_xlim(0, max(sum(sizes[k]) for k in keys) * 1.08 or 1.0)
