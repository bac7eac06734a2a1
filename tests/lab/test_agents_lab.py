"""The lab's side of agent tenants (issue 51 §5), on run directories whose rows are written here directly (no job
is launched): the recent samples show each episode whole and folded (a ``<details>`` per episode: its reward,
turns, stop and rubric parts on the summary line; inside, every message with its role, tool calls as
``name(arguments)``, tool results cut, all escaped), and the reward panel splits an agent tenant's reward into
its rubric's parts and draws its turns per episode."""

from __future__ import annotations

import html

import numpy as np
from test_dashboard import T0, dash_of, make_run, steps, write
from test_rl_lab import rl_steps, sampled

from mlora_lab.lab.dashboard.model import MESSAGES_SHOWN, TOOL_CHARS, episode_of, sample_of
from mlora_lab.lab.dashboard.rl import NO_AGENT_PICKED, episode_summary
from mlora_lab.rundir import CompletionRow, EpisodeRecord, TrainRow

HOSTILE = "<script>alert(1)</script>\x1b[31m"
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "what is 2 + 40? " + HOSTILE},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 40}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "42" + " pad" * 200},
    {"role": "assistant", "content": "It is 42 <b>for sure</b>."},
]  # fmt: skip
PARTS = {"correct": (1.0, 1.0), "short": (-0.25, 0.5)}


def agent_steps(tenant: str, first: int, last: int) -> list[TrainRow]:
    """An env tenant's train rows: its env's reward, the two parts of its rubric (``rewards/<part>/mean``, no
    ``/std``) and its episodes' statistics."""
    rows = rl_steps(tenant, first, last)
    for row in rows:
        s = row.step
        row.extra = {
            "rewards/env/mean": 0.1 * s,
            "rewards/env/std": 0.05,
            "rewards/correct/mean": 0.2 * s,
            "rewards/short/mean": -0.1 * s,
            "agent/turns": 1.0 + 0.5 * s,
            "agent/forks": 0.0,
            "agent/cut": 0.0,
        }
    return rows


def agent_sample(tenant: str, step: int, **extra) -> CompletionRow:
    """A completion row as the RL driver writes an agent tenant's episode (``extra``: what its reward functions
    logged with ``log_extra``)."""
    return CompletionRow(
        step=step,
        tenant=tenant,
        tenant_step=step,
        prompt="<|user|>\nwhat is 2 + 40?",
        completion="<tool_call>...</tool_call> It is 42.",
        reward=0.875,
        time=T0 + step,
        extra=extra or None,
        episode=EpisodeRecord(messages=CONVERSATION, turns=2, stop="answered", parts=PARTS),
    )


def test_an_episode_folds_into_one_details_with_every_message_escaped(tmp_path):
    run = make_run(tmp_path / "r", tenants=("agent", "plain", "sft"))
    write(
        run,
        *steps(["sft"], 1, 2),
        *agent_steps("agent", 1, 2),
        *rl_steps("plain", 1, 2),
        agent_sample("agent", 2, checked="yes"),
        *sampled("plain", 2, "a plain completion"),
    )
    dash = dash_of(run.root)
    value = dash.rl_views.samples.widget.value
    assert value.count("<details>") == 1 and value.count("</details>") == 1  # one episode, folded (not open)
    summary = value[value.index("<summary") : value.index("</summary>")]
    assert summary.endswith(">reward 0.875 · 2 turns · answered · correct 1×1 · short -0.25×0.5")
    inside = value[value.index("</summary>") : value.index("</details>")]
    roles = [inside[i + len("font-size:10px'>") :].split("<")[0] for i in range(len(inside)) if inside.startswith("font-size:10px'>", i)]  # fmt: skip
    assert roles == ["system", "user", "assistant", "tool · add", "assistant"]
    # the tool call as name(arguments), the tool's result cut with …, every text escaped
    assert "→ add({&quot;a&quot;: 2, &quot;b&quot;: 40})" in inside
    tool_text = html.unescape(inside.split("tool · add</span><div>")[1].split("</div>")[0])
    assert tool_text == ("42" + " pad" * 200)[:TOOL_CHARS] + "…"
    assert "<script" not in value and "<b>for sure" not in value and "\x1b" not in value
    assert (
        "&lt;script&gt;alert(1)&lt;/script&gt;\\x1b[31m" in inside
        and "It is 42 &lt;b&gt;for sure&lt;/b&gt;." in inside
    )
    # the episode's keys are the episode, not log_extra lines; a column a reward function logged still is one
    assert "checked: yes" in value and "messages:" not in value and "turns: 2" not in value
    # an RL tenant's row without messages shows as before: its completion, no details
    plain = value[value.index("a plain completion") - 200 :]
    assert "<details>" not in plain and "a plain completion" in plain


def test_an_episode_reads_back_from_the_run_directory_as_written(tmp_path):
    """The row as the driver writes it (``CompletionRow.episode``) reads back through the run directory into the
    same sample as the row itself."""
    row = agent_sample("agent", 1)
    run = make_run(tmp_path / "r", tenants=("agent",))
    write(run, *agent_steps("agent", 1, 1), row)
    dash = dash_of(run.root)
    [(_, [read])] = dash.model.samples(dash.picked())
    assert read == sample_of(row) and read.episode is not None
    ep = read.episode
    assert (ep.turns, ep.stop, ep.parts) == (2, "answered", (("correct", 1.0, 1.0), ("short", -0.25, 0.5)))
    assert [m.role for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert ep.messages[2].calls == ('add({"a": 2, "b": 40})',) and ep.messages[2].content == ""
    assert ep.messages[1].content.endswith(
        "</script>\\x1b[31m"
    )  # hidden characters escaped, markup left to HTML
    assert episode_summary(None, ep).startswith("reward – · 2 turns")
    assert read.extra == ""  # nothing else was logged for it
    assert sample_of(sampled("g", 1, "x")[0]).episode is None


def test_a_long_or_malformed_episode_shows_what_it_can():
    """A run directory is shown, never trusted: messages that are not mappings, a role or tool call of the
    wrong type, a tool call's arguments given as an object, OpenAI content parts; a long episode shows its
    first and last messages and says how many it left out."""
    odd = [
        "a bare string",
        {"role": 7, "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}, 5]},
    ]  # fmt: skip
    ep = episode_of({"messages": odd, "turns": "many", "stop": 3, "parts": {"p": 0.5, "q": ["bad", None]}})
    assert [(m.role, m.content) for m in ep.messages] == [("?", "a bare string"), ("?", "part one, part two"), ("assistant", "x")]  # fmt: skip
    assert ep.messages[2].calls == ('add({"a": 1})', "?()")
    assert (ep.turns, ep.stop, ep.parts) == (None, "", (("p", 0.5, 1.0), ("q", None, None)))
    assert episode_of({"messages": "not json"}) is None and episode_of(None) is None
    many = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(100)]
    ep = episode_of({"messages": many})
    assert len(ep.messages) == MESSAGES_SHOWN and ep.left_out == 100 - MESSAGES_SHOWN
    head = MESSAGES_SHOWN // 4
    assert [m.content for m in ep.messages[head - 1 : head + 1]] == [
        f"m{head - 1}",
        f"m{head + 100 - MESSAGES_SHOWN}",
    ]
    assert ep.messages[-1].content == "m99" and ep.left_at == head
    from mlora_lab.lab.dashboard.rl import episode_html

    shown = episode_html(1.0, ep, "#123456")
    assert f"… {100 - MESSAGES_SHOWN} messages left out …" in shown
    assert shown.index(f">m{head - 1}<") < shown.index("messages left out") < shown.index(f">m{head + 60}<")


def test_the_reward_panel_splits_an_agent_tenants_rubric_and_draws_its_turns(tmp_path):
    run = make_run(tmp_path / "r", tenants=("agent", "plain"))
    write(run, *rl_steps("plain", 1, 4))
    dash = dash_of(run.root, smoothing=0.0)
    views = dash.rl_views
    assert views.figure.turns_ax is None  # no agent tenant yet: three axes, as for any RL view
    assert len(views.figure.fig.axes) == 3
    write(run, *agent_steps("agent", 1, 4))
    dash.refresh()  # an agent tenant shows: the figure is made again, with its turns axes
    fig = views.figure
    assert fig.turns_ax is not None and len(fig.fig.axes) == 4 and fig.fig in dash.readouts
    assert views._figure_box.children[0] is fig.widget
    agent = ("r", "agent")
    lines = fig.sets[fig.ax]
    main = lines[(agent, "main")]
    assert np.allclose(main.get_ydata(), [0.1 * s for s in range(1, 5)])
    correct, short, env = (lines[(agent, f"rewards/{p}/mean")] for p in ("correct", "short", "env"))
    assert correct.get_linestyle() == short.get_linestyle() == "-."  # the rubric's parts (no /std)
    assert env.get_linestyle() == ":"  # the env's own reward column (with its /std), as a reward function's
    assert np.allclose(correct.get_ydata(), [0.2 * s for s in range(1, 5)])
    assert np.allclose(short.get_ydata(), [-0.1 * s for s in range(1, 5)])
    assert correct.get_color() == main.get_color() and correct.get_label().endswith("· correct")
    turns = fig.sets[fig.turns_ax][(agent, "main")]
    assert np.allclose(turns.get_ydata(), [1.5, 2.0, 2.5, 3.0]) and turns.get_color() == main.get_color()
    assert fig.turns_ax.get_ylabel() == "model turns per episode"
    # (a one-turn RL tenant plays no episodes: no turns)
    assert (("r", "plain"), "main") not in fig.sets[fig.turns_ax].lines
    dash.tenants.value = [("r", "plain")]
    assert fig.turns_ax._lab_placeholder.get_visible()
    assert fig.turns_ax._lab_placeholder.get_text() == NO_AGENT_PICKED
    assert fig.sets[fig.ax][(("r", "plain"), "main")].get_visible()  # its reward still drawn
    files = dash.export(tmp_path / "exports", metrics=False)
    assert any(p.name.endswith("reward.png") for p in files)


def test_a_completion_sampled_ahead_says_by_which_adapter_and_how_stale(tmp_path):
    """``rl.max_staleness``: the samples view names the adapter version of a completion sampled ahead and its lag
    (its tenant step's adapter minus the one that sampled it); an on-policy completion (lag 0, or a row of an
    older run without a version) shows its step alone."""
    run = make_run(tmp_path / "r", tenants=("ahead", "now"))
    stale = [r for r in sampled("ahead", 4, "stale one") for r in [_versioned(r, 1)]]
    fresh = [_versioned(r, 2) for r in sampled("now", 3, "fresh one")]
    old = sampled("now", 2, "from an older run")
    write(run, *rl_steps("ahead", 1, 4), *rl_steps("now", 1, 3), *stale, *fresh, *old)
    value = dash_of(run.root).rl_views.samples.widget.value
    assert "v1 · 2 stale" in value and value.count(" stale</div>") == 1
    assert sample_of(stale[0]).lag == 2 and sample_of(fresh[0]).lag == 0 and sample_of(old[0]).version is None


def _versioned(row: CompletionRow, version: int) -> CompletionRow:
    import msgspec

    return msgspec.structs.replace(row, adapter_version=version)
