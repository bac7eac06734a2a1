"""The dashboard's views of RL tenants: the reward panel and the recent samples.

- :class:`RewardFigure`: each RL tenant's mean reward per generation (``TrainRow.reward``) against the
  view's x axis, smoothed over its faded raw values like the loss, in the tenant's colour, under it each
  reward function's mean and each part of an env's rubric, and beside it its KL to the reference
  (``beta > 0``) and its clip ratio; with agent tenants, their model turns per episode too;
- :class:`SamplesView`: per tenant its latest sampled completions (step, reward, prompt, completion),
  newest first, as :meth:`~mlora_lab.lab.dashboard.model.ViewModel.samples` gives them; an agent
  tenant's as whole episodes, folded (:func:`episode_html`);
- :class:`RLViews`: both, made when a chosen run first has an RL row, shown only while one has, and
  redrawn only when RL rows arrived or a setting changed. A view of SFT runs never builds them, and
  each refresh asks the model two yes/no questions for them (one flag per run), nothing more.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable, Mapping, Sequence

import ipywidgets as W
import numpy as np

from mlora_lab.lab.dashboard.figures import AMBER, GREY, WAITING, Hover, Panel, Scene, Smoother
from mlora_lab.lab.dashboard.model import Episode, Key, Sample, ViewModel
from mlora_lab.lab.plotting import drawable, placeholder, plain, style_axes, thin_with_breaks

NO_RL_PICKED = "no RL tenant picked"
"""What the reward panel says when the tenants picked are SFT tenants only (the runs have RL tenants)."""


NO_KL = "no KL: beta = 0"
"""What the KL axes say when the picked RL tenants log none (TRL's default ``beta=0`` computes none)."""

NO_AGENT_PICKED = "no agent tenant picked"
"""What the turns axes say when no picked tenant plays episodes."""

TURNS = "agent/turns"
"""An agent tenant's mean model turns per episode of a generation (a train row's named metric): also what
tells an agent tenant's series from another RL tenant's."""


def is_agent(scene: Scene, key: Key) -> bool:
    """Whether a tenant of the scene plays episodes (its train rows carry :data:`TURNS`)."""
    return TURNS in scene.feeds[key[0]].tenants[key[1]].named


class RewardFigure(Panel):
    """The mean reward of every picked RL tenant's generations (SFT tenants have none: not drawn), and beside
    it the two numbers that say how far a GRPO step moved the policy: ``kl`` (to the reference model, when
    ``beta > 0``) and ``clip_ratio`` (the share of tokens whose importance ratio the loss clipped). Made
    with ``agents`` (a view with agent tenants), a fourth axes draws their mean model turns per episode."""

    def __init__(
        self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother, agents: bool = False
    ) -> None:
        super().__init__((12, 2.7), interactive, lock, hover)
        ratios = [2, 1, 1, 1] if agents else [2, 1, 1]
        axes = self.axes(1, len(ratios), gridspec_kw={"width_ratios": ratios})
        self.ax, self.kl_ax, self.clip_ax = axes[:3]
        self.turns_ax = axes[3] if agents else None
        """The agent tenants' turns per episode (None: a figure made for a view without agent tenants)."""
        self.smoother = smoother
        style_axes(self.ax, ylabel="reward (mean per generation)")
        style_axes(self.kl_ax, ylabel="KL to the reference")
        style_axes(self.clip_ax, ylabel="clip ratio")
        if self.turns_ax is not None:
            style_axes(self.turns_ax, ylabel="model turns per episode")

    def draw(self, scene: Scene) -> None:
        self.x = scene.x
        keys = [k for k in scene.picked if scene.feeds[k[0]].tenants[k[1]].rl is not None]
        per_line = scene.points(len(keys) * (2 if scene.smoothing > 0 else 1))
        for ax, metric, empty in (
            (self.ax, "reward", WAITING),
            (self.kl_ax, "kl", NO_KL),
            (self.clip_ax, "clip_ratio", WAITING),
        ):
            shown: set[tuple] = set()
            points = 0
            for key in keys:
                got, _ = self.train_lines(ax, scene, self.smoother, key, metric, smooth=True, points=per_line)
                shown |= got
                # (a value the job did not compute, a KL at beta 0, is NaN: the axes say so rather than stay blank)
                points += int(np.isfinite(scene.feeds[key[0]].xy(key[1], metric, scene.x)[1]).sum())
                if ax is self.ax:
                    shown |= self.function_lines(scene, key, per_line)
            self.sets[ax].show_only(shown)
            placeholder(ax, None if points else NO_RL_PICKED if not keys else empty)
            # (never a log axis: rewards may be negative; the KL and clip ratio start at 0)
            self.autoscale(ax, scene.outliers, from_zero=ax is not self.ax)
        if self.turns_ax is not None:
            self.draw_turns(scene, [k for k in keys if is_agent(scene, k)], per_line)

    def draw_turns(self, scene: Scene, agents: list[Key], per_line: int) -> None:
        """Each picked agent tenant's mean model turns per episode (:data:`TURNS`), smoothed as its reward."""
        shown: set[tuple] = set()
        points = 0
        for key in agents:
            got, n = self.train_lines(
                self.turns_ax, scene, self.smoother, key, TURNS, smooth=True, points=per_line
            )
            shown |= got
            points += n
        self.sets[self.turns_ax].show_only(shown)
        placeholder(self.turns_ax, None if points else NO_AGENT_PICKED if not agents else WAITING)
        self.autoscale(self.turns_ax, scene.outliers, from_zero=True)

    def function_lines(self, scene: Scene, key: Key, points: int) -> set[tuple]:
        """A tenant's reward split: each reward function's mean (``rewards/<fn>/mean``, as TRL logs it, with
        its ``/std``) as a thin dotted line, and each part of its env's rubric (``rewards/<part>/mean``, the
        mean unweighted score; a part has no ``/std``) dash-dotted, both in the tenant's colour, unsmoothed,
        under its combined reward. A tenant's only reward function is its reward: not drawn twice."""
        feed = scene.feeds[key[0]]
        named = feed.tenants[key[1]].named
        means = [m for m in named if m.startswith("rewards/") and m.endswith("/mean")]
        shown: set[tuple] = set()
        if len(means) < 2:
            return shown
        colour, label = scene.colour(key), scene.label(key)
        for metric in means:
            xs, ys, breaks = feed.xy(key[1], metric, scene.x)
            fn = metric.removeprefix("rewards/").removesuffix("/mean")
            part = metric.removesuffix("/mean") + "/std" not in named
            line = self.sets[self.ax].get((key, metric), color=colour, linewidth=0.9, markersize=2)
            line.set_linestyle("-." if part else ":")
            line.set_data(*thin_with_breaks(xs, drawable(ys), breaks, points))
            line.set_label(plain(f"{label} · {fn}"))
            what = "a part of its env's reward: its mean score, unweighted" if part else "its mean reward"
            self.hover.name(line, f"{label} · {fn} ({what})")
            shown.add((key, metric))
        return shown


ROLE_COLOURS = {"assistant": None, "tool": AMBER}
"""The bar left of a message: an assistant's in its tenant's colour (None), a tool's amber, the others
grey (colours that read on the dark and the light theme alike; the text keeps the page's own)."""


def _number(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def episode_summary(reward: float | None, episode: Episode) -> str:
    """An episode's line: ``reward 0.75 · 3 turns · answered · hit 1×1 · length -0.4×0.5`` (its reward, its
    model turns, why it stopped, its rubric's parts as score×weight); plain text."""
    said = [f"reward {_number(reward)}"]
    if episode.turns is not None:
        said.append(f"{episode.turns} turn{'s' * (episode.turns != 1)}")
    if episode.stop:
        said.append(episode.stop)
    said += [f"{name} {_number(score)}×{_number(weight)}" for name, score, weight in episode.parts]
    return " · ".join(said)


def episode_html(reward: float | None, episode: Episode, colour: str) -> str:
    """An episode folded: a ``<details>`` whose summary is :func:`episode_summary`, inside each message with its
    role (a tool's with its tool's name), its text and an assistant's tool calls as ``→ name(arguments)``. Every
    text HTML-escaped here."""
    out = [
        f"<details><summary style='cursor:pointer'>{html.escape(episode_summary(reward, episode))}</summary>"
    ]
    for i, m in enumerate(episode.messages):
        if episode.left_out and i == episode.left_at:
            out.append(
                f"<div style='color:{GREY};margin:2px 0'>… {episode.left_out} messages left out …</div>"
            )
        bar = ROLE_COLOURS.get(m.role, GREY) or colour
        who = m.role + (f" · {m.name}" if m.name else "")
        calls = "".join(f"<div style='color:{AMBER}'>→ {html.escape(c)}</div>" for c in m.calls)
        out.append(
            f"<div style='border-left:3px solid {bar};padding-left:6px;margin:3px 0'>"
            f"<span style='color:{GREY};font-size:10px'>{html.escape(who)}</span>"
            + (f"<div>{html.escape(m.content)}</div>" if m.content else "")
            + calls
            + "</div>"
        )
    out.append("</details>")
    return "".join(out)


def samples_html(
    groups: Sequence[tuple[Key, Sequence[Sample]]],
    label: Callable[[Key], str],
    colour: Callable[[Key], str],
    logged: Mapping[Key, Mapping[str, float | None]] | None = None,
) -> str:
    """The samples view's HTML: per tenant its label in its colour (and what its reward functions logged with
    ``log_metric`` at its latest logged step, ``logged``), then a table of its samples (tenant step, reward,
    prompt, completion, and their ``log_extra`` columns; a completion sampled ahead says by which adapter version
    and how many steps stale), newest first; an agent tenant's completion as its
    whole episode, folded (:func:`episode_html`). Every text is HTML-escaped here (the model already cut it
    and escaped its hidden characters), so a completion cannot inject markup into the page."""
    if not groups:
        return ""
    cell = "padding:2px 6px;vertical-align:top;border-top:1px solid #eee"
    text = f"{cell};white-space:pre-wrap;word-break:break-word;font-family:monospace;font-size:11px"
    parts = [
        f"<div style='font-size:12px'><b>recent samples</b> <span style='color:{GREY}'>(newest first; "
        "<code>run.completions()</code> has them all)</span>"
    ]
    for key, samples in groups:
        c, name = colour(key), html.escape(label(key))
        metrics = (logged or {}).get(key) or {}
        said = " · ".join(f"{k} {'–' if v is None else f'{v:.4g}'}" for k, v in metrics.items())
        parts.append(
            f"<div style='margin-top:6px'><span style='display:inline-block;width:10px;height:10px;"
            f"background:{c};margin-right:4px'></span><b style='color:{c}'>{name}</b>"
            + (f" <span style='color:{GREY}'>logged: {html.escape(said)}</span>" if said else "")
            + "</div>"
            f"<table style='border-collapse:collapse;width:100%;table-layout:fixed'>"
            f"<tr style='color:{GREY};text-align:left'><th style='width:60px'>step</th>"
            "<th style='width:70px'>reward</th><th>prompt</th><th>completion</th></tr>"
        )
        for s in samples:
            reward = "–" if s.reward is None else f"{s.reward:.4g}"
            parts.append(
                f"<tr><td style='{cell}'>{s.tenant_step}"
                # (a completion sampled ahead: by which adapter, how many steps stale)
                + (
                    f"<div style='color:{GREY}' title='sampled by adapter version {s.version}'>"
                    f"v{s.version} · {s.lag} stale</div>"
                    if s.lag
                    else ""
                )
                + f"</td><td style='{cell}'>{reward}</td>"
                f"<td style='{text}'>{html.escape(s.prompt)}</td>"
                f"<td style='{text}'>"
                + (html.escape(s.completion) if s.episode is None else episode_html(s.reward, s.episode, c))
                + (
                    f"<div style='color:{GREY};margin-top:2px'>{html.escape(s.extra)}</div>"
                    if s.extra
                    else ""
                )
                + "</td></tr>"
            )
        parts.append("</table>")
    parts.append("</div>")
    return "".join(parts)


class SamplesView:
    """The recent samples (:func:`samples_html`), in a box that scrolls past a few tenants."""

    def __init__(self) -> None:
        self.widget = W.HTML(layout=W.Layout(max_height="360px", overflow="auto"))

    def update(
        self,
        groups: Sequence[tuple[Key, Sequence[Sample]]],
        label: Callable[[Key], str],
        colour: Callable[[Key], str],
        logged: Mapping[Key, Mapping[str, float | None]] | None = None,
    ) -> None:
        value = samples_html(groups, label, colour, logged)
        if self.widget.value != value:
            self.widget.value = value


class RLViews:
    """The reward panel and the samples view, made on first need (see the module docstring): ``box``
    is what the dashboard places under the loss figure."""

    def __init__(self, interactive: bool, lock: threading.RLock, hover: Hover, smoother: Smoother) -> None:
        self.box = W.VBox(layout=W.Layout(display="none"))
        self.figure: RewardFigure | None = None
        self.samples: SamplesView | None = None
        self._figure_box: W.VBox | None = None
        self._make = (interactive, lock, hover, smoother)
        self._drawn: tuple | None = None

    def panels(self) -> tuple[Panel, ...]:
        """The reward panel once it exists (for the dashboard's x axis, zoom reset, readout, export)."""
        return (self.figure,) if self.figure is not None else ()

    @property
    def shown(self) -> bool:
        return self.box.layout.display != "none"

    def update(self, scene: Scene, model: ViewModel, force: bool = False) -> bool:
        """Show and redraw the views for ``scene``; returns whether they were redrawn. Hidden while no
        chosen run has an RL row (then nothing else is done); redrawn when RL rows arrived, or what is
        picked or a setting changed, or ``force``."""
        rewarded, sampled = model.rewarded(scene.chosen), model.sampled(scene.chosen)
        if not (rewarded or sampled):
            if self.shown:
                self.box.layout.display = "none"
            return False
        settings = (scene.x, scene.smoothing, scene.outliers, tuple(scene.chosen))
        version = (tuple(scene.picked), model.rl_versions(scene.chosen), settings)
        if not force and version == self._drawn and self.shown:
            return False
        agents = any(TURNS in s.named for n in scene.chosen for s in scene.feeds[n].tenants.values())
        if self.figure is None or (agents and self.figure.turns_ax is None):
            self._build(
                scene, agents
            )  # (again when an agent tenant first shows: a fourth axes for its turns)
        assert self.figure is not None and self.samples is not None and self._figure_box is not None
        self._figure_box.layout.display = "" if rewarded else "none"
        if rewarded:
            self.figure.draw(scene)
            self.figure.show()
        groups = model.samples(scene.picked)
        self.samples.update(groups, scene.label, scene.colour, {k: model.logged(k) for k, _ in groups})
        self.box.layout.display = ""
        self._drawn = version
        return True

    def _build(self, scene: Scene, agents: bool) -> None:
        self.figure = RewardFigure(*self._make, agents=agents)
        self.figure.set_x(scene.x)
        self.samples = self.samples or SamplesView()
        if self._figure_box is None:
            self._figure_box = W.VBox()
        self._figure_box.children = (self.figure.widget, self.figure.readout)
        self.box.children = (self._figure_box, self.samples.widget)
