"""The lab's side of RL tenants, on run directories whose metrics rows are written here directly (no job is
launched): ``ml.compare`` of the RL metrics, ``ml.summary``'s reward, ``run.completions()``, and the
dashboard's reward panel and recent samples (shown only when a run has RL rows)."""

from __future__ import annotations

import html
import warnings

import numpy as np
import pytest
from test_dashboard import T0, dash_of, make_run, steps, write

import mlora_lab as ml
from mlora_lab.lab.compare.results import summary
from mlora_lab.lab.plotting import ema
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import CompletionRow, HeldoutRow, TrainRow


def rl_steps(tenant: str, first: int, last: int, reward=lambda s: 0.1 * s, t0: float = T0) -> list[TrainRow]:
    """An RL tenant's train rows for steps first..last, one per second (``reward(s)`` may be None: a
    generation no reward function scored)."""
    return [
        TrainRow(
            step=s,
            tenant=tenant,
            tenant_step=s,
            loss=0.01 * s,
            tokens=40,
            lr=1e-5,
            grad_norm=0.5,
            time=t0 + s,
            reward=reward(s),
            reward_std=0.2,
            completion_len=10.0 + s,
            kl=0.001 * s,
            clip_ratio=0.0,
        )
        for s in range(first, last + 1)
    ]


def sampled(tenant: str, step: int, *completions: str, t0: float = T0) -> list[CompletionRow]:
    """The completion rows of one logged step: prompt ``p<step>``, reward ``step + i / 10``."""
    return [
        CompletionRow(
            step=step,
            tenant=tenant,
            tenant_step=step,
            prompt=f"p{step}",
            completion=c,
            reward=step + i / 10,
            time=t0 + step,
        )
        for i, c in enumerate(completions)
    ]


def mixed_run(root, last: int = 6):
    """A run of an SFT tenant ``sft`` and an RL tenant ``grpo``, steps 1..last, two samples per step."""
    run = make_run(root, tenants=("sft", "grpo"))
    rows = []
    for s in range(1, last + 1):
        rows += steps(["sft"], s, s) + rl_steps("grpo", s, s) + sampled("grpo", s, f"a{s}", f"b{s}")
    write(run, *rows)
    return run


def drawn(fig) -> dict[str, object]:
    """The labelled (main) lines of a compare figure, by label."""
    return {ln.get_label(): ln for ln in fig.axes[0].lines if not ln.get_label().startswith("_")}


# -- compare, summary, the run's tables ----------------------------------------------------------------


def test_compare_draws_each_rl_tenants_metric_and_leaves_sft_tenants_out(tmp_path):
    run = make_run(tmp_path / "r", tenants=("sft", "grpo"))
    write(
        run,
        *steps(["sft"], 1, 5),
        *rl_steps("grpo", 1, 5, reward=lambda s: None if s == 3 else 0.1 * s),  # step 3: nothing scored
        HeldoutRow(step=5, tenant="sft", loss=1.0, time=T0 + 5),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the SFT tenant is simply not drawn: no warning about it
        lines = drawn(ml.compare(run.root, metric="reward"))
    assert list(lines) == ["grpo"]
    assert lines["grpo"].get_xdata().tolist() == [1, 2, 3, 4, 5]
    y = np.asarray(lines["grpo"].get_ydata(), dtype=float)
    assert np.isnan(y[2]) and np.allclose(y[[0, 1, 3, 4]], [0.1, 0.2, 0.4, 0.5])  # a gap, not a join
    # the same colour as the tenant's loss line (and the dashboard's)
    assert lines["grpo"].get_color() == drawn(ml.compare(run.root))["grpo"].get_color()
    # every RL metric, against the other x axes
    kl = drawn(ml.compare(run.root, metric="kl", x="global step"))["grpo"]
    assert np.allclose(kl.get_ydata(), [0.001 * s for s in range(1, 6)])
    length = drawn(ml.compare(Run(run.root), metric="completion_len", x="tokens"))["grpo"]
    assert length.get_xdata().tolist() == [40, 80, 120, 160, 200]
    assert length.get_ydata().tolist() == [11.0, 12.0, 13.0, 14.0, 15.0]
    for metric, value in (("reward_std", 0.2), ("clip_ratio", 0.0)):
        assert drawn(ml.compare(run.root, metric=metric))["grpo"].get_ydata().tolist() == [value] * 5
    # smoothing as for the loss: the EMA over the faded raw values
    fig = ml.compare(run.root, metric="reward", smoothing=0.6)
    raw = np.array([0.1, 0.2, np.nan, 0.4, 0.5])
    assert np.allclose(drawn(fig)["grpo"].get_ydata(), ema(raw, 0.6))
    assert len([ln for ln in fig.axes[0].lines if ln.get_label() == "_raw"]) == 1
    assert fig.axes[0].get_ylabel() == "reward"


def test_compare_of_an_rl_metric_without_rl_tenants_is_one_error_naming_the_metrics(tmp_path):
    sft = make_run(tmp_path / "sft")
    write(sft, *steps(["a", "b"], 1, 4), HeldoutRow(step=4, tenant="a", loss=1.5, time=T0 + 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one error, no warning per run before it
        with pytest.raises(ValueError) as e:
            ml.compare(sft.root, metric="reward")
    message = str(e.value)
    assert "no 'reward' values in these runs" in message and "Tenant.rl" in message
    assert message.endswith("choose from ['loss', 'eval_loss', 'lr', 'grad_norm', 'tokens']")
    with pytest.raises(ValueError, match=r"unknown metric 'rewards'.*'reward'"):  # the RL metrics are offered
        ml.compare(sft.root, metric="rewards")
    # a run with RL tenants next to one without: drawn, and the other named as for any metric
    rl = mixed_run(tmp_path / "rl")
    with pytest.warns(UserWarning, match=r"no 'reward' values in run\(s\) sft;"):
        lines = drawn(ml.compare([rl.root, sft.root], metric="reward"))
    assert list(lines) == ["rl / grpo"]
    # kl is logged only with beta > 0: an RL run without it says so the same way, offering what it has
    nokl = make_run(tmp_path / "nokl", tenants=("g",))
    rows = rl_steps("g", 1, 3)
    for r in rows:
        r.kl = None
    write(nokl, *rows)
    with pytest.raises(
        ValueError, match=r"no 'kl' values.*'reward', 'reward_std', 'completion_len', 'clip_ratio'\]$"
    ):
        ml.compare(nokl.root, metric="kl")


def test_summary_has_each_rl_tenants_last_reward(tmp_path):
    run = make_run(tmp_path / "r", tenants=("sft", "grpo"))
    # the last generation was not scored: the last reward is the one before
    write(run, *steps(["sft"], 1, 4), *rl_steps("grpo", 1, 4, reward=lambda s: None if s == 4 else s / 4))
    table = summary(Run(run.root))
    assert (
        " ".join(table.columns[:10])
        == "tenant state steps max_steps final_loss best_smoothed_loss eval_loss best_eval_loss reward first_loss"
    )
    rewards = table.set_index("tenant")["reward"]
    assert rewards["grpo"] == 0.75 and np.isnan(rewards["sft"])
    assert table.set_index("tenant").loc["grpo", "final_loss"] == pytest.approx(0.04)
    # the terminal's table (mlora-lab status) has the column only where some tenant has a reward
    from mlora_lab.lab.cli import summary_text

    assert "reward" in summary_text(Run(run.root)).splitlines()[0]
    sft = make_run(tmp_path / "sft", tenants=("a",))
    write(sft, *steps(["a"], 1, 2))
    assert "reward" not in summary_text(Run(sft.root)) and np.isnan(summary(Run(sft.root))["reward"][0])


def test_run_completions_and_metrics_carry_the_rl_fields(tmp_path):
    run = mixed_run(tmp_path / "r", last=3)
    handle = Run(run.root)
    done = handle.completions()
    assert list(done.columns) == [
        "kind",
        "step",
        "tenant",
        "tenant_step",
        "prompt",
        "completion",
        "reward",
        "time",
        "episode",  # (an agent tenant's whole episode; None here)
        "adapter_version",  # (the adapter version that sampled it; None in rows written before it was kept)
    ]
    assert done["completion"].tolist() == ["a1", "b1", "a2", "b2", "a3", "b3"]
    assert done["reward"].tolist() == [1.0, 1.1, 2.0, 2.1, 3.0, 3.1]
    assert str(done["time"].dtype).startswith("datetime64")
    metrics = handle.metrics()
    assert set(metrics["kind"]) == {"train"}  # completion rows are not metrics rows
    by = metrics.set_index(["tenant", "step"])
    assert by.loc[("grpo", 2), "reward"] == pytest.approx(0.2) and by.loc[("grpo", 3), "kl"] == pytest.approx(
        0.003
    )
    assert np.isnan(by.loc[("sft", 2), "reward"])
    write(run, *sampled("grpo", 4, "c4"))  # read incrementally, as the other tables
    assert handle.completions()["completion"].tolist()[-2:] == ["b3", "c4"]


# -- the dashboard ----------------------------------------------------------------------------------


def test_dashboard_reward_panel_in_the_loss_figures_colours(tmp_path):
    run = mixed_run(tmp_path / "r")
    dash = dash_of(run.root, smoothing=0.0)
    views = dash.rl_views
    assert views.shown and views.figure is not None
    assert dash.rl_views.box in dash.widget.children
    grpo, sft = ("r", "grpo"), ("r", "sft")
    lines = views.figure.sets[views.figure.ax]
    main = lines[(grpo, "main")]
    assert (
        main.get_visible()
        and main.get_color() == dash.colour(grpo) == dash.loss.lines[(grpo, "main")].get_color()
    )
    assert main.get_xdata().tolist() == [1, 2, 3, 4, 5, 6]
    assert np.allclose(main.get_ydata(), [0.1 * s for s in range(1, 7)])
    assert (sft, "main") not in lines.lines  # an SFT tenant has no reward: not drawn
    # beside the reward: the KL to the reference and the clip ratio, in the same colour
    fig = views.figure
    kl, clip = fig.sets[fig.kl_ax][(grpo, "main")], fig.sets[fig.clip_ax][(grpo, "main")]
    assert (
        np.allclose(kl.get_ydata(), [0.001 * s for s in range(1, 7)]) and kl.get_color() == main.get_color()
    )
    assert np.allclose(clip.get_ydata(), 0.0)
    assert (fig.kl_ax.get_ylabel(), fig.clip_ax.get_ylabel()) == ("KL to the reference", "clip ratio")
    assert views.figure.fig in dash.readouts  # the hover readout names its points too
    assert "· reward 0.6 ·" in dash.progress_rows[grpo].info.value  # its latest, in its progress row
    assert "reward" not in dash.progress_rows[sft].info.value
    # smoothing as the loss figure: the EMA over the faded raw line
    dash.smoothing.value = 0.6
    assert np.allclose(lines[(grpo, "main")].get_ydata(), ema(np.array([0.1 * s for s in range(1, 7)]), 0.6))
    assert lines[(grpo, "raw")].get_visible() and lines[(grpo, "raw")].get_alpha() == 0.25
    # the x axis follows the view's
    dash.x_axis.value = "global step"
    assert views.figure.ax.get_xlabel() == "global step"
    files = dash.export(tmp_path / "exports", metrics=False)
    assert sorted(p.name.split("-")[-1] for p in files if p.suffix == ".png") == [
        "loss.png",
        "optim.png",
        "reward.png",
        "system.png",
    ]


def test_dashboard_recent_samples_newest_first_per_tenant_and_refreshed_incrementally(tmp_path):
    run = make_run(tmp_path / "r", tenants=("sft", "g1", "g2"))
    write(
        run,
        *steps(["sft"], 1, 3),
        *rl_steps("g1", 1, 3),
        *rl_steps("g2", 1, 3),
        *[c for s in (1, 2, 3) for c in sampled("g1", s, f"g1-{s}a", f"g1-{s}b")],
        *sampled("g2", 1, "g2-only"),
    )
    dash = dash_of(run.root)
    groups = dash.model.samples(dash.picked())
    assert [key for key, _ in groups] == [("r", "g1"), ("r", "g2")]  # per RL tenant, the SFT one has none
    g1 = groups[0][1]
    assert [(s.tenant_step, s.completion, s.reward) for s in g1] == [
        (3, "g1-3b", 3.1),
        (3, "g1-3a", 3.0),
        (2, "g1-2b", 2.1),
    ]
    assert g1[0].prompt == "p3"
    value = html.unescape(dash.rl_views.samples.widget.value)
    assert value.index("g1-3b") < value.index("g1-3a") < value.index("g1-2b") and "g1-1a" not in value
    assert "g2-only" in value and value.index("g1-2b") < value.index("g2-only")
    # new rows: the refresh reads them (only them) and the newest comes first; rows that are not RL
    # rows leave the RL views alone
    figure = dash.rl_views.figure
    draws = []
    original = figure.draw
    figure.draw = lambda scene: (draws.append(1), original(scene))
    write(run, *steps(["sft"], 4, 5))
    dash.refresh()
    assert draws == []
    write(run, *rl_steps("g1", 4, 4), *sampled("g1", 4, "g1-4a"))
    dash.refresh()
    assert draws == [1]
    assert [s.completion for s in dash.model.samples(dash.picked())[0][1]] == ["g1-4a", "g1-3b", "g1-3a"]
    assert dash.rl_views.figure.sets[figure.ax][(("r", "g1"), "main")].get_xdata().tolist() == [1, 2, 3, 4]
    # a tenant no longer picked: not in the samples either
    dash.tenants.value = [("r", "g2")]
    assert (
        "g1-4a" not in dash.rl_views.samples.widget.value and "g2-only" in dash.rl_views.samples.widget.value
    )


def test_samples_show_hostile_text_escaped_and_cut(tmp_path):
    run = make_run(tmp_path / "r", tenants=("g",))
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>\x1b[31mred\u202eevil\rover\x00"
    long_one = "start " + "word " * 20_000 + " the end"
    write(
        run,
        *rl_steps("g", 1, 2),
        CompletionRow(
            step=1,
            tenant="g",
            tenant_step=1,
            prompt="<b>bold?</b>",
            completion=hostile,
            reward=None,
            time=T0 + 1,
        ),
        CompletionRow(
            step=2,
            tenant="g",
            tenant_step=2,
            prompt="line one\nline two",
            completion=long_one,
            reward=-1.5,
            time=T0 + 2,
        ),
    )
    dash = dash_of(run.root)
    [(key, [newest, older])] = dash.model.samples(dash.picked())
    assert key == ("r", "g")
    assert older.completion == (
        "<script>alert(1)</script><img src=x onerror=alert(2)>\\x1b[31mred\\u202eevil\\rover\\x00"
    )
    assert older.reward is None and newest.reward == -1.5
    assert newest.prompt == "line one\nline two"  # lines kept
    assert newest.completion.startswith("start word") and newest.completion.endswith(" the end")
    assert "[100,014 characters]" in newest.completion and len(newest.completion) < 700
    value = dash.rl_views.samples.widget.value
    assert "<script" not in value and "<img" not in value and "<b>bold?</b>" not in value
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in value and "&lt;b&gt;bold?&lt;/b&gt;" in value
    assert "\x1b" not in value and "\u202e" not in value and "\x00" not in value and "\r" not in value
    assert len(value) < 4000  # a 100-KB completion is not shown whole
    assert (
        "<td style='padding:2px 6px;vertical-align:top;border-top:1px solid #eee'>–</td>" in value
    )  # no reward


def test_sft_only_dashboard_has_no_reward_panel_and_builds_nothing_for_it(tmp_path):
    run = make_run(tmp_path / "r")
    write(run, *steps(["a", "b"], 1, 10))
    dash = dash_of(run.root)
    assert dash.rl_views.box.layout.display == "none" and not dash.rl_views.shown
    assert dash.rl_views.figure is None and dash.rl_views.samples is None
    assert len(dash.readouts) == 3
    assert all(s.rl is None and s.samples is None for s in dash.feeds["r"].tenants.values())
    assert dash.feeds["r"].rl_version == 0 and not dash.feeds["r"].rewarded
    write(run, *steps(["a", "b"], 11, 12))
    dash.refresh()
    assert dash.rl_views.figure is None and not dash.rl_views.shown
    # an RL run chosen next to it shows the panel; choosing the SFT run alone hides it again
    other = mixed_run(tmp_path / "rl", last=2)
    both = dash_of(run.root, other.root)
    assert both.rl_views.shown
    both.choose(["r"])
    assert not both.rl_views.shown
    both.choose(["r", "rl"])
    assert both.rl_views.shown
    # (a run ticked again comes back with none of its tenants picked: the panel says so)
    assert both.picked() == [("r", "a"), ("r", "b")] and both.rl_views.samples.widget.value == ""
    assert both.rl_views.figure.ax._lab_placeholder.get_text() == "no RL tenant picked"
    both.tenants.value = [*both.picked(), ("rl", "grpo")]
    assert not both.rl_views.figure.ax._lab_placeholder.get_visible()
    # rl / grpo's newest three: both of step 2, then step 1's second
    assert both.rl_views.samples.widget.value.count("<tr>") == 3


def test_dashboard_shows_each_reward_functions_mean_logged_columns_warnings_and_a_whole_reason(tmp_path):
    """A tenant with two reward functions has each one's mean drawn (dotted, its colour) under its combined
    reward; what its functions logged with log_extra shows under each sample; a warning row (it trains on
    nothing) shows in amber with the tenant; a quarantine's reason is wrapped in full, never cut."""
    from mlora_lab.rundir import EventRow, TenantRow

    run = make_run(tmp_path / "r", tenants=("grpo", "flat", "bad"))
    rows = []
    for s in range(1, 5):
        [row] = rl_steps("grpo", s, s)
        row.extra = {
            "rewards/fmt/mean": 0.1 * s,
            "rewards/fmt/std": 0.0,
            "rewards/len/mean": 1 - 0.1 * s,
            "hits": s,
        }
        rows += [row, *rl_steps("flat", s, s)]
    [sample] = sampled("grpo", 4, "an answer")
    sample.extra = {"parsed": "42", "ok": True}
    reason = "RewardError: reward 'fmt' (…/tasks/rewards.py) raised KeyError: " + "x" * 300
    write(
        run,
        *rows,
        sample,
        TenantRow(step=0, tenant="flat", state="running"),
        EventRow(step=4, event="warning", message="every group of its last 5 generations scored one reward", tenant="flat"),
        TenantRow(step=2, tenant="bad", state="failed", reason=reason),
    )  # fmt: skip
    dash = dash_of(run.root, smoothing=0.0)
    lines = dash.rl_views.figure.sets[dash.rl_views.figure.ax]
    grpo = ("r", "grpo")
    fmt = lines[(grpo, "rewards/fmt/mean")]
    assert fmt.get_linestyle() == ":" and fmt.get_color() == lines[(grpo, "main")].get_color()
    assert np.allclose(fmt.get_ydata(), [0.1, 0.2, 0.3, 0.4]) and (grpo, "rewards/len/mean") in lines.lines
    assert ("r", "flat", "rewards/fmt/mean") not in lines.lines  # (one function: its reward is the mean)
    assert (
        "parsed: 42" in dash.rl_views.samples.widget.value
        and "ok: True" in dash.rl_views.samples.widget.value
    )
    warned = dash.progress_rows[("r", "flat")].reason
    assert (
        warned.layout.display != "none" and "warning: every group of its last 5 generations" in warned.value
    )
    failed = dash.progress_rows[("r", "bad")].reason.value
    assert html.escape("x" * 300) in failed and "white-space:pre-wrap" in failed and "ellipsis" not in failed
