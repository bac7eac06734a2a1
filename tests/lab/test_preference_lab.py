"""The lab's side of preference tenants (``Tenant.pref``): ``ml.compare`` of TRL's six DPO metrics,
``ml.summary``'s ``rewards/accuracies`` and ``rewards/margins``, and the dashboard's preference panel (made
only when a run has a preference tenant's rows). Most tests write the metrics rows directly (no job); the
last one reads a run the job trained in this process."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from test_dashboard import T0, dash_of, make_run, steps, write
from test_rl_lab import drawn, rl_steps

import mlora_lab as ml
from mlora_lab.lab.compare.results import SummaryFrame, summary
from mlora_lab.lab.dashboard.preference import NO_PREFERENCE_PICKED
from mlora_lab.lab.plotting import ema
from mlora_lab.lab.records.series import PREFERENCE_METRICS
from mlora_lab.lab.runs.run import Run
from mlora_lab.rundir import TrainRow


def margin(s: int) -> float:
    return 0.05 * s


def accuracy(s: int) -> float:
    return min(1.0, 0.25 * s)


def pref_steps(
    tenant: str, first: int, last: int, t0: float = T0, empty: tuple[int, ...] = ()
) -> list[TrainRow]:
    """A preference tenant's train rows for steps first..last, one per second: TRL's six metrics in ``extra``
    (``rewards/chosen`` ``0.1 s``, ``rewards/rejected`` ``0.1 s - margin(s)``, ...); a step in ``empty``
    logs them as None (a window without a pair)."""
    rows = []
    for s in range(first, last + 1):
        metrics = {
            "rewards/chosen": 0.1 * s,
            "rewards/rejected": 0.1 * s - margin(s),
            "rewards/accuracies": accuracy(s),
            "rewards/margins": margin(s),
            "logps/chosen": -20.0 + s,
            "logps/rejected": -25.0 - s,
        }
        rows.append(
            TrainRow(
                step=s,
                tenant=tenant,
                tenant_step=s,
                loss=0.693 - 0.02 * s,
                tokens=30,
                lr=1e-4,
                grad_norm=0.3,
                rows_seen=2 * s,
                tokens_seen=30 * s,
                time=t0 + s,
                extra=dict.fromkeys(metrics) if s in empty else metrics,
            )
        )
    return rows


def mixed_run(root, last: int = 5):
    """A run of an SFT tenant ``sft`` and a preference tenant ``dpo``, steps 1..last."""
    run = make_run(root, tenants=("sft", "dpo"))
    write(run, *steps(["sft"], 1, last), *pref_steps("dpo", 1, last))
    return run


# -- compare, summary ----------------------------------------------------------------------------------


def test_the_lab_names_the_job_sides_metrics():
    from mlora_lab.rl.preference import METRICS

    assert PREFERENCE_METRICS == METRICS


def test_compare_draws_each_preference_metric_of_each_run_and_tenant_that_has_it(tmp_path):
    one = mixed_run(tmp_path / "one")
    two = make_run(tmp_path / "two", tenants=("dpo", "ipo", "sft"))
    write(two, *pref_steps("dpo", 1, 3), *pref_steps("ipo", 1, 3), *steps(["sft"], 1, 3))
    expected = {
        "rewards/chosen": lambda s: 0.1 * s,
        "rewards/rejected": lambda s: 0.1 * s - margin(s),
        "rewards/accuracies": accuracy,
        "rewards/margins": margin,
        "logps/chosen": lambda s: -20.0 + s,
        "logps/rejected": lambda s: -25.0 - s,
    }
    assert set(expected) == set(PREFERENCE_METRICS)
    for metric, value in expected.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the SFT tenants are simply not drawn: no warning about them
            fig = ml.compare([one.root, two.root], metric=metric)
        lines = drawn(fig)
        assert sorted(lines) == ["one / dpo", "two / dpo", "two / ipo"], metric
        assert lines["one / dpo"].get_xdata().tolist() == [1, 2, 3, 4, 5]
        assert np.allclose(lines["one / dpo"].get_ydata(), [value(s) for s in range(1, 6)]), metric
        assert np.allclose(lines["two / ipo"].get_ydata(), [value(s) for s in range(1, 4)]), metric
        assert fig.axes[0].get_ylabel() == metric
    # the tenant's own colour, as its loss line's; another x axis, and the smoothing over faded raw values
    alone = drawn(ml.compare(one.root, metric="rewards/margins"))["dpo"]
    assert alone.get_color() == drawn(ml.compare(one.root))["dpo"].get_color()
    by_tokens = drawn(ml.compare(one.root, metric="rewards/accuracies", x="tokens"))["dpo"]
    assert by_tokens.get_xdata().tolist() == [30, 60, 90, 120, 150]
    fig = ml.compare(one.root, metric="rewards/margins", smoothing=0.6)
    assert np.allclose(drawn(fig)["dpo"].get_ydata(), ema(np.array([margin(s) for s in range(1, 6)]), 0.6))
    assert len([ln for ln in fig.axes[0].lines if ln.get_label() == "_raw"]) == 1


def test_compare_breaks_a_preference_line_where_a_window_had_no_pair(tmp_path):
    run = make_run(tmp_path / "r", tenants=("dpo",))
    write(run, *pref_steps("dpo", 1, 4, empty=(3,)))
    y = np.asarray(drawn(ml.compare(run.root, metric="rewards/margins"))["dpo"].get_ydata(), dtype=float)
    assert np.isnan(y[2]) and np.allclose(y[[0, 1, 3]], [margin(1), margin(2), margin(4)])


def test_compare_of_a_preference_metric_no_tenant_has_is_one_error_naming_the_metrics(tmp_path):
    sft = make_run(tmp_path / "sft")
    write(sft, *steps(["a", "b"], 1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one error, no warning per run before it
        with pytest.raises(ValueError) as e:
            ml.compare(sft.root, metric="rewards/margins")
    message = str(e.value)
    assert "no 'rewards/margins' values in these runs" in message and "Tenant.pref" in message
    assert "rewards/accuracies" in message  # (what such tenants log)
    assert message.endswith("choose from ['loss', 'lr', 'grad_norm', 'tokens']")
    # an unknown name offers the preference metrics beside the others
    with pytest.raises(ValueError, match=r"unknown metric 'rewards/margin'.*'rewards/margins'"):
        ml.compare(sft.root, metric="rewards/margin")
    # a run with RL tenants only: it offers what it has, and the RL error names the preference metrics it has
    rl = make_run(tmp_path / "rl", tenants=("g",))
    write(rl, *rl_steps("g", 1, 3))
    with pytest.raises(ValueError, match=r"no 'logps/chosen' values.*Tenant\.pref.*'reward'"):
        ml.compare(rl.root, metric="logps/chosen")
    pref = mixed_run(tmp_path / "pref", last=2)
    with pytest.raises(ValueError, match=r"no 'reward' values.*Tenant\.rl.*'rewards/margins'"):
        ml.compare(pref.root, metric="reward")
    # a run with a preference tenant next to one without: drawn, and the other named as for any metric
    with pytest.warns(UserWarning, match=r"no 'rewards/margins' values in run\(s\) sft;"):
        assert list(drawn(ml.compare([pref.root, sft.root], metric="rewards/margins"))) == ["pref / dpo"]


def test_summary_has_each_preference_tenants_last_accuracy_and_margin(tmp_path, monkeypatch):
    # (the CLI's table drops columns to fit the terminal; 80 without one)
    monkeypatch.setenv("COLUMNS", "200")
    run = make_run(tmp_path / "r", tenants=("sft", "dpo", "grpo"))
    # the last window had no pair: the last values are the step before's
    write(run, *steps(["sft"], 1, 4), *pref_steps("dpo", 1, 4, empty=(4,)), *rl_steps("grpo", 1, 4))
    table = summary(Run(run.root))
    assert isinstance(table, SummaryFrame)
    by = table.set_index("tenant")
    assert by.loc["dpo", "rewards/accuracies"] == accuracy(3) and by.loc["dpo", "rewards/margins"] == margin(
        3
    )
    for other in ("sft", "grpo"):
        assert np.isnan(by.loc[other, "rewards/accuracies"]) and np.isnan(by.loc[other, "rewards/margins"])
    assert by.loc["dpo", "final_loss"] == pytest.approx(0.693 - 0.08) and np.isnan(by.loc["dpo", "reward"])
    assert by.loc["dpo", "rows"] == 8
    # shown under TRL's names, after the results; only where some tenant is a preference tenant
    headers = list(table.shown().columns)
    assert (
        headers.index("first loss") < headers.index("rewards/accuracies") < headers.index("rewards/margins")
    )
    assert headers.index("rewards/margins") < headers.index("lr")
    assert table.shown().set_index("tenant").loc["dpo", "rewards/margins"] == "0.1500"
    from mlora_lab.lab.cli import summary_text

    assert "rewards/margins" in summary_text(Run(run.root)).splitlines()[0]
    sft = make_run(tmp_path / "sft", tenants=("a",))
    write(sft, *steps(["a"], 1, 2))
    plain = summary(Run(sft.root))
    assert "rewards/accuracies" in plain.columns and np.isnan(plain["rewards/margins"][0])
    assert "rewards/margins" not in summary_text(Run(sft.root))


# -- the dashboard ----------------------------------------------------------------------------------


def test_dashboard_preference_panel_in_the_loss_figures_colours(tmp_path):
    run = mixed_run(tmp_path / "r", last=6)
    dash = dash_of(run.root, smoothing=0.0)
    views = dash.preference_views
    assert views.shown and views.figure is not None and views.box in dash.widget.children
    fig = views.figure
    dpo, sft = ("r", "dpo"), ("r", "sft")
    margins = fig.sets[fig.margins_ax][(dpo, "main")]
    accuracies = fig.sets[fig.accuracies_ax][(dpo, "main")]
    assert margins.get_visible() and accuracies.get_visible()
    assert margins.get_color() == accuracies.get_color() == dash.colour(dpo)
    assert dash.colour(dpo) == dash.loss.lines[(dpo, "main")].get_color()
    assert margins.get_xdata().tolist() == [1, 2, 3, 4, 5, 6]
    assert np.allclose(margins.get_ydata(), [margin(s) for s in range(1, 7)])
    assert np.allclose(accuracies.get_ydata(), [accuracy(s) for s in range(1, 7)])
    assert (sft, "main") not in fig.sets[fig.margins_ax].lines  # an SFT tenant has none: not drawn
    assert (fig.margins_ax.get_ylabel(), fig.accuracies_ax.get_ylabel()) == (
        "rewards/margins",
        "rewards/accuracies",
    )
    assert fig.accuracies_ax.get_ylim()[0] == 0  # a share: from 0
    assert fig.fig in dash.readouts  # the hover readout names its points too
    assert not dash.rl_views.shown  # (no RL tenant: no reward panel)
    # smoothing as the loss figure: the EMA over the faded raw line
    dash.smoothing.value = 0.6
    lines = fig.sets[fig.margins_ax]
    assert np.allclose(lines[(dpo, "main")].get_ydata(), ema(np.array([margin(s) for s in range(1, 7)]), 0.6))
    assert lines[(dpo, "raw")].get_visible() and lines[(dpo, "raw")].get_alpha() == 0.25
    # the x axis follows the view's
    dash.x_axis.value = "global step"
    assert fig.margins_ax.get_xlabel() == fig.accuracies_ax.get_xlabel() == "global step"
    files = dash.export(tmp_path / "exports", metrics=False)
    assert sorted(p.name.split("-")[-1] for p in files if p.suffix == ".png") == [
        "loss.png",
        "optim.png",
        "preference.png",
        "system.png",
    ]


def test_preference_panel_is_redrawn_only_for_preference_rows_and_says_when_none_is_picked(tmp_path):
    run = mixed_run(tmp_path / "r", last=3)
    dash = dash_of(run.root)
    figure = dash.preference_views.figure
    draws = []
    original = figure.draw
    figure.draw = lambda scene: (draws.append(1), original(scene))
    write(run, *steps(["sft"], 4, 5))  # rows of another tenant leave the panel alone
    dash.refresh()
    assert draws == []
    write(run, *pref_steps("dpo", 4, 4))
    dash.refresh()
    assert draws == [1]
    lines = figure.sets[figure.margins_ax]
    assert lines[(("r", "dpo"), "main")].get_xdata().tolist() == [1, 2, 3, 4]
    dash.tenants.value = [("r", "sft")]
    assert figure.margins_ax._lab_placeholder.get_text() == NO_PREFERENCE_PICKED
    assert figure.accuracies_ax._lab_placeholder.get_visible()
    dash.tenants.value = [("r", "sft"), ("r", "dpo")]
    assert not figure.margins_ax._lab_placeholder.get_visible()


def test_dashboard_of_other_tenants_builds_no_preference_panel(tmp_path):
    run = make_run(tmp_path / "r", tenants=("a", "g"))
    write(run, *steps(["a"], 1, 4), *rl_steps("g", 1, 4))
    dash = dash_of(run.root)
    assert dash.preference_views.figure is None and not dash.preference_views.shown
    assert dash.feeds["r"].preference_version == 0
    assert not any(s.preference for s in dash.feeds["r"].tenants.values())
    # a preference run chosen next to it shows the panel; choosing the other alone hides it again
    other = mixed_run(tmp_path / "p", last=2)
    both = dash_of(run.root, other.root)
    assert both.preference_views.shown
    both.choose(["r"])
    assert not both.preference_views.shown
    both.choose(["r", "p"])
    assert both.preference_views.shown


# -- a run the job trained -------------------------------------------------------------------------


def test_a_trained_preference_tenant_in_compare_summary_and_the_dashboard(
    llama_path, make_data, tmp_path, one_thread
):
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.parts import Preference
    from mlora_lab.spec.tenant import Tenant

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps(
                {"prompt": f"Question {i}:", "chosen": " yes" * (i % 3 + 1), "rejected": " no" * (i % 2 + 1)}
            )
            + "\n"
            for i in range(6)
        )
    )
    common = dict(rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=3, seed=1)
    tenants = [
        Tenant(name="dpo", data=str(pairs), pref=Preference(beta=0.1, loss_type="sigmoid"), **common),
        Tenant(name="sft", data=make_data("reverse"), **common),
    ]
    spec = JobSpec(base_model=llama_path, tenants=tenants, seq_len=64, max_rank=8, dtype="float32")
    trainer = Trainer(spec, run_dir=tmp_path / "run")
    trainer.train()
    trainer.close()
    run = Run(tmp_path / "run")
    lines = drawn(ml.compare(run, metric="rewards/accuracies"))
    assert list(lines) == ["dpo"] and lines["dpo"].get_xdata().tolist() == [1, 2, 3]
    rows = run.metrics()
    rows = rows[(rows["kind"] == "train") & (rows["tenant"] == "dpo")]
    table = summary(run).set_index("tenant")
    for metric in ("rewards/accuracies", "rewards/margins"):
        assert table.loc["dpo", metric] == rows[metric].iloc[-1] and np.isnan(table.loc["sft", metric])
    assert 0.0 <= table.loc["dpo", "rewards/accuracies"] <= 1.0
    dash = dash_of(run.path, smoothing=0.0)
    fig = dash.preference_views.figure
    [key] = [k for k in dash.picked() if k[1] == "dpo"]
    margins = fig.sets[fig.margins_ax][(key, "main")]
    assert np.allclose(margins.get_ydata(), rows["rewards/margins"].to_numpy())
