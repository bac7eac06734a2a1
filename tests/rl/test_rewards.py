"""Reward functions of RL tenants (mlora_lab.rl.rewards): found and checked before launch, called as
TRL 1.16 calls them, and every way one can fail fails only its own call, with the reason."""

from __future__ import annotations

import math
import os
import textwrap
import time

import psutil
import pytest

from mlora_lab.rl.rewards import (
    RewardBatch,
    RewardError,
    RewardSignature,
    RewardWorker,
    inspect_rewards,
    parse_reward,
    shown_reward,
)

REWARDS = """
import asyncio, os, sys, time

def short(completions, **kwargs):
    return [-len(c) / 10 for c in completions]

def uses_answer(prompts, completions, answer, completion_ids, trainer_state, log_metric, log_extra):
    log_metric("hits", sum(a in c for a, c in zip(answer, completions)))
    log_extra("answer", answer)
    return [float(a in c) + trainer_state.global_step for a, c in zip(answer, completions)]

def only_named(prompts, completions):   # no **kwargs: given only what it names
    return [len(p) for p in prompts]

def partial(completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]

def nothing(completions, **kwargs):
    return [None] * len(completions)

def nan_everywhere(completions, **kwargs):
    return [float("nan")] * len(completions)

def raises(completions, **kwargs):
    raise KeyError("no such field")

def exits(completions, **kwargs):
    sys.exit(3)

def crashes(completions, **kwargs):
    os._exit(9)

def hangs(completions, **kwargs):
    time.sleep(600)

def wrong_count(completions, **kwargs):
    return [1.0]

def not_numbers(completions, **kwargs):
    return ["good"] * len(completions)

def chatty(completions, **kwargs):
    print("thinking...")                  # stdout: must not reach the answer channel
    return [0.5] * len(completions)

async def later(completions, **kwargs):
    await asyncio.sleep(0)
    return [2.0] * len(completions)

def needs_column(completions, difficulty, **kwargs):
    return [0.0] * len(completions)

def no_completions(prompts):
    return [0.0] * len(prompts)

NOT_A_FUNCTION = 3
"""


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def batch(n: int = 4, **columns) -> RewardBatch:
    return RewardBatch(
        prompts=[f"prompt {i // 2}" for i in range(n)],
        completions=["ab", "abcd", "x", "the answer is 4"][:n],
        completion_ids=[[1, 2], [1, 2, 3, 4], [5], [6, 7, 8]][:n],
        columns=columns,
        state={"global_step": 7, "max_steps": 10},
    )


def test_references_are_parsed():
    assert str(parse_reward("rewards.py:short")) == "rewards.py:short"
    assert parse_reward("pkg.mod:fn").is_file is False and parse_reward("a/b.py:fn").is_file is True
    for bad, why in [
        ("short", "is not 'module:function'"),
        (":fn", "is not 'module:function'"),
        ("rewards.py:", "is not 'module:function'"),
        ("rewards.py:not-a-name", "is not a function name"),
        ("my module:fn", "neither a module name nor a .py file"),
        (3, "must be a string"),
    ]:
        assert why in parse_reward(bad), bad


def test_inspection_finds_signatures_and_says_what_is_wrong(rewards_file, tmp_path):
    (tmp_path / "loud.py").write_text("print('imported!')\ndef fn(completions, **kw):\n    return []\n")
    (tmp_path / "broken.py").write_text("import no_such_package_here\n")
    refs = [
        f"{rewards_file}:short",
        f"{rewards_file}:needs_column",
        f"{rewards_file}:no_completions",
        f"{rewards_file}:missing",
        f"{rewards_file}:NOT_A_FUNCTION",
        f"{tmp_path / 'nowhere.py'}:fn",
        "no_such_module_anywhere:fn",
        "broken:fn",  # a module in the launch directory, whose own import fails
        "loud:fn",  # prints while imported: the answer channel stays clean
        "json:dumps",
        "bad ref",
    ]
    got = inspect_rewards(refs, cwd=tmp_path)
    short, column, no_completions = got[:3]
    assert isinstance(short, RewardSignature) and short.var_keyword and short.required == ("completions",)
    assert short.problems({"prompt"}) == []
    assert column.problems({"prompt", "difficulty"}) == []
    assert (
        "needs 'difficulty', which no data row has (the rows' columns: prompt)"
        in column.problems({"prompt"})[0]
    )
    assert column.problems(None) == []  # columns not known: only the signature is judged
    assert "does not take completions" in no_completions.problems(set())[0]
    assert "has no 'missing'" in got[3]
    assert "is not a function (int)" in got[4]
    assert "no file" in got[5]
    assert "no module named 'no_such_module_anywhere'" in got[6]
    assert "importing 'broken' raised ModuleNotFoundError: No module named 'no_such_package_here'" in got[7]
    assert isinstance(got[8], RewardSignature)
    assert isinstance(got[9], RewardSignature) and got[9].var_keyword
    assert "is not 'module:function'" in got[10]


def test_a_worker_calls_functions_as_trl_does(rewards_file):
    refs = [
        f"{rewards_file}:{name}"
        for name in ("short", "uses_answer", "only_named", "partial", "chatty", "later")
    ]
    worker = RewardWorker(refs, timeout_s=30)
    try:
        answer = ["b", "c", "x", "4"]
        out = worker(batch(answer=answer))
        n = 4
        assert len(out.rewards) == n and all(len(r) == len(refs) for r in out.rewards)
        assert [r[0] for r in out.rewards] == [-0.2, -0.4, -0.1, -1.5]
        assert [r[1] for r in out.rewards] == [8.0, 8.0, 8.0, 8.0]  # found + trainer_state.global_step
        assert [r[2] for r in out.rewards] == [8.0, 8.0, 8.0, 8.0]  # len("prompt 0")
        assert [math.isnan(r[3]) for r in out.rewards] == [False, True, False, True]
        assert [r[4] for r in out.rewards] == [0.5] * n and [r[5] for r in out.rewards] == [2.0] * n
        assert out.metrics == {"hits": 4.0} and out.extra == {"answer": answer}
        again = worker(batch(answer=answer))  # the same worker answers the next step
        assert again.rewards == out.rewards or all(
            (a == b) or (math.isnan(a) and math.isnan(b))
            for x, y in zip(again.rewards, out.rewards)
            for a, b in zip(x, y)
        )
    finally:
        worker.close()


@pytest.mark.parametrize(
    "name, message",
    [
        ("raises", "raised KeyError: 'no such field'"),
        ("exits", "raised SystemExit: 3"),
        ("crashes", "the reward worker exited with code 9 while computing the rewards"),
        ("wrong_count", "returned 1 rewards for 4 completions"),
        ("not_numbers", "returned 'good' for completion 0, not a number or None"),
        ("nothing", "gave no reward \\(None or NaN\\) for any of the 4 completions"),
        ("nan_everywhere", "gave no reward"),
        ("missing", "has no 'missing'"),
    ],
)
def test_a_failing_reward_fails_its_call_with_the_reason_and_the_next_call_works(
    rewards_file, tmp_path, name, message
):
    """A failure is the call's alone: the worker (or a new one, when it died) serves the next call."""
    good = tmp_path / "good.py"
    good.write_text("def ok(completions, **kw):\n    return [1.0] * len(completions)\n")
    worker = RewardWorker([f"{rewards_file}:{name}"], timeout_s=30)
    with pytest.raises(RewardError, match=message):
        worker(batch())
    worker.close()
    fine = RewardWorker([f"{good}:ok"], timeout_s=30)
    assert fine(batch()).rewards == [[1.0]] * 4
    fine.close()


def test_a_hanging_reward_is_stopped_at_its_timeout_with_its_children_and_a_new_worker_serves_next(tmp_path):
    path = tmp_path / "hang.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys, time
            def fn(completions, **kw):
                if not os.path.exists(__file__ + ".called"):  # the first call ever (in any worker) hangs
                    open(__file__ + ".called", "w").close()
                    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                    time.sleep(600)
                return [1.0] * len(completions)
            """
        )
    )
    worker = RewardWorker([f"{path}:fn"], timeout_s=3)
    worker.submit(batch())
    pid = worker.pid
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"computing the rewards took more than 3 s \(timeout_s\): stopped"):
        worker.result()
    assert time.monotonic() - t0 < 10
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"] or [])
    ]
    assert worker(batch()).rewards == [[1.0]] * 4  # a fresh worker serves the next call
    worker.close()


def test_workers_of_several_tenants_compute_at_once(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(
        "import time\ndef fn(completions, **kw):\n    time.sleep(1.5)\n    return [1.0] * len(completions)\n"
    )
    workers = [RewardWorker([f"{path}:fn"], timeout_s=30) for _ in range(3)]
    for w in workers:
        w(batch(1))  # started and warm
    t0 = time.monotonic()
    for w in workers:
        w.submit(batch())
    assert all(w.result().rewards == [[1.0]] * 4 for w in workers)
    assert time.monotonic() - t0 < 3 * 1.5  # overlapped, not one after another
    for w in workers:
        w.close()


def test_a_worker_ends_when_its_parent_dies(tmp_path):
    """The job is gone (killed): its reward worker does not outlive it, even inside a hanging function."""
    path = tmp_path / "hang.py"
    path.write_text("import time\ndef fn(completions, **kw):\n    time.sleep(600)\n")
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            from mlora_lab.rl.rewards import RewardBatch, RewardWorker
            w = RewardWorker([{str(path)!r} + ":fn"], timeout_s=600)
            w.submit(RewardBatch(["p"], ["c"], [[1]]))
            print(w.pid, flush=True)
            os._exit(0)
            """
        )
    )
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=os.environ
    )
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the reward worker outlived its parent"
        time.sleep(0.2)


def test_trl_reward_functions_work_unchanged():
    """TRL's own reward functions, named as modules, called with TRL's chat completions."""
    pytest.importorskip("trl")
    worker = RewardWorker(["trl.rewards:think_format_reward"], timeout_s=60)
    chat = [
        [{"role": "assistant", "content": "<think>\nhm\n</think>\n4"}],
        [{"role": "assistant", "content": "4"}],
    ]
    out = worker(
        RewardBatch(
            prompts=[[{"role": "user", "content": "2+2?"}]] * 2, completions=chat, completion_ids=[[1], [2]]
        )
    )
    assert out.rewards == [[1.0], [0.0]]
    worker.close()


HOSTILE = """
import os, subprocess, sys, time

def scribbles(completions, **kwargs):          # writes a stray line into every descriptor it has
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2:
            try:
                os.write(fd, b'{"rewards": [[1.0]]}\\n')
            except OSError:
                pass
    return [1.0] * len(completions)

def closes_and_hangs(completions, **kwargs):   # closes what it inherited, then never returns
    os.closerange(0, 4096)
    time.sleep(600)

def detaches(completions, **kwargs):            # a daemon: setsid() and a double fork, then returns
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)  # mlora-detached"])
        os._exit(0)
    time.sleep(0.5)
    return [1.0] * len(completions)

def huge_int(completions, **kwargs):
    return [10**400] * len(completions)

def extra_set(completions, log_extra, **kwargs):
    log_extra("tags", {"a", "b"})
    return [1.0] * len(completions)

def metric_text(completions, log_metric, **kwargs):
    log_metric("m", "high")
    return [1.0] * len(completions)

def logs(completions, log_metric, log_extra, **kwargs):
    log_metric("length", sum(map(len, completions)) / len(completions))
    log_extra("first", [c[:1] for c in completions])
    return [1.0] * len(completions)
"""


@pytest.fixture()
def hostile_file(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(textwrap.dedent(HOSTILE))
    return path


def detached() -> list[psutil.Process]:
    return [
        p for p in psutil.process_iter(["cmdline"]) if "mlora-detached" in " ".join(p.info["cmdline"] or [])
    ]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("scribbles", r"malformed answer .* \(in reward 'scribbles' \(.*/hostile.py\)\)"),
        ("closes_and_hangs", r"closed its answer channel and did not exit .*\(in reward 'closes_and_hangs' \(.*/hostile.py\)\)"),
        ("huge_int", r"reward 'huge_int' \(.*/hostile.py\) returned a 401-digit integer .* past what a float holds"),
        ("extra_set", r"reward 'extra_set' \(.*/hostile.py\) raised TypeError: log_extra\('tags', ...\) takes a list"),
        ("metric_text", r"reward 'metric_text' \(.*/hostile.py\) raised TypeError: log_metric\('m', ...\) takes a finite"),
    ],
)  # fmt: skip
def test_a_hostile_reward_fails_its_call_naming_itself_within_the_timeout(
    hostile_file, tmp_path, name, message
):
    """R26 (a stray line into the answer channel), R27 (it closes its descriptors and hangs: the parent keeps
    the time limit), R11 (10**400), R12 (log_extra with a set): each fails its own call, naming the function
    and its file, never the job; a new worker serves the next call."""
    worker = RewardWorker([f"{hostile_file}:{name}"], timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=message):
        worker(batch())
    assert time.monotonic() - t0 < 15
    worker.close()
    good = tmp_path / "good.py"
    good.write_text("def ok(completions, **kw):\n    return [1.0] * len(completions)\n")
    assert RewardWorker([f"{good}:ok"], timeout_s=30)(batch()).rewards == [[1.0]] * 4


def test_processes_a_reward_detaches_do_not_outlive_its_worker(hostile_file):
    """R15: a daemon a reward starts (setsid() and a double fork) is killed with its worker: when the worker
    is closed (a stop, a quarantine), and when the worker ends on its own."""
    worker = RewardWorker([f"{hostile_file}:detaches"], timeout_s=30)
    assert worker(batch()).rewards == [[1.0]] * 4
    assert detached(), "the daemon runs while its worker does"
    worker.close()
    deadline = time.monotonic() + 5
    while detached() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not detached()
    worker = RewardWorker([f"{hostile_file}:detaches"], timeout_s=30)
    worker(batch())
    worker._proc.stdin.close()  # (its input closes: it ends on its own, and takes the daemon with it)
    worker._proc.wait(10)
    deadline = time.monotonic() + 5
    while detached() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not detached()


@pytest.mark.parametrize("code", [7, 0])
def test_an_import_that_exits_names_its_reward(tmp_path, code):
    """RV3: a reward module that calls os._exit while it is imported is named, at inspection and in a worker
    (with exit code 0 too: the worker then ends without an answer, which is no success)."""
    path = tmp_path / "leaves.py"
    path.write_text(
        f"import os\nos._exit({code})\ndef fn(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    [got] = inspect_rewards([f"{path}:fn"])
    assert isinstance(got, str) and "in reward 'fn' (" in got and "leaves.py)" in got, got
    if code == 0:
        return
    with pytest.raises(RewardError, match=r"exited with code 7 .*\(in reward 'fn' \(.*/leaves.py\)\)"):
        RewardWorker([f"{path}:fn"], timeout_s=30)(batch())


def test_logged_metrics_and_extra_columns_come_back(hostile_file):
    got = RewardWorker([f"{hostile_file}:logs"], timeout_s=30)(batch())
    assert got.metrics == {"length": (2 + 4 + 1 + 15) / 4}
    assert got.extra == {"first": ["a", "a", "x", "t"]}


SNOOP = """
import json, os, sys

def _read(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return repr(e)
    try:
        return os.read(fd, 1 << 16).decode("latin-1")
    except OSError as e:
        return repr(e)
    finally:
        os.close(fd)

def seen():
    '''What a reward's process can read of itself without touching its own interpreter's memory: its
    environment (as os.environ has it and as the kernel keeps it), its command line, and every descriptor it
    holds, read without blocking (never 0: the worker's requests).'''
    out = {"environ": dict(os.environ), "proc_environ": _read("/proc/self/environ"),
           "cmdline": _read("/proc/self/cmdline"), "fds": {}}
    for name in os.listdir("/proc/self/fd"):
        if name != "0":
            out["fds"][name] = [os.readlink(f"/proc/self/fd/{name}") if os.path.exists(f"/proc/self/fd/{name}") else "",
                                _read(f"/proc/self/fd/{name}")]
    return out

SEEN_AT_IMPORT = seen()

def snoop(completions, **kwargs):
    with open(os.environ["SNOOP_OUT"], "w") as f:
        json.dump({"import": SEEN_AT_IMPORT, "call": seen()}, f)
    return [1.0] * len(completions)
"""

FORGE = """
import json, os, sys

def forge(completions, **kwargs):
    '''The worker's own say() (which seals frames with its key), dug out of the frame that called this
    function: what no descriptor, environment or command line gives away, a reward's interpreter holds.'''
    f = sys._getframe(1)
    while f is not None and not hasattr(f.f_locals.get("self"), "say"):
        f = f.f_back
    f.f_locals["self"].say(json.loads(os.environ["FORGED"]))
    return [1.0] * len(completions)
"""


def test_rn12_a_reward_finds_no_nonce_in_its_environment_command_line_or_descriptors(tmp_path, monkeypatch):
    """RN12: the answer frames' nonce reaches the worker on an inherited pipe that it reads and closes
    before any reward is imported: neither ``os.environ``, ``/proc/self/environ`` (the environment the
    process started with, which ``os.environ.pop`` does not clear), ``/proc/self/cmdline`` nor any of its
    descriptors gives it away, when the module is imported or when the function is called, in an
    inspection and in a serving worker."""
    from mlora_lab.rl import rewards

    nonces = iter(f"{i:064x}" for i in range(0xA5A5A5, 0xA5A5A5 + 10))
    made = []

    def token_hex(n):
        made.append(next(nonces))
        return made[-1]

    monkeypatch.setattr(rewards.secrets, "token_hex", token_hex)
    path = tmp_path / "snoop.py"
    path.write_text(textwrap.dedent(SNOOP))
    out = tmp_path / "seen.json"
    monkeypatch.setenv("SNOOP_OUT", str(out))
    [sig] = inspect_rewards([f"{path}:snoop"])
    assert isinstance(sig, RewardSignature), sig
    worker = RewardWorker([f"{path}:snoop"], timeout_s=30)
    try:
        assert worker(batch()).rewards == [[1.0]] * 4
        seen = out.read_text()
        assert len(made) == 2  # (an inspection's key, then the serving worker's)
        for nonce in made:
            assert nonce not in seen
        assert '"proc_environ": "' in seen and "SNOOP_OUT" in seen  # (it did read its environment)
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("forged", "message"),
    [
        ('{"rewards": [[1.0], [1.0, 2.0], [1.0], [1.0]]}', r"row 1 has 2 rewards for 1 reward function"),
        ('{"rewards": [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]}', r"row 0 has 2 rewards for 1"),
        ('{"rewards": [[1.0], [1.0], [1.0]]}', r"it answered 3 rows of rewards for 4 completions"),
        ('{"rewards": [1.0, 1.0, 1.0, 1.0]}', r"row 0 is not a list"),
        ('{"rewards": [[true], [1.0], [1.0], [1.0]]}', r"row 0 holds True, not a number or null"),
        ('{"rewards": [[1.0], [1.0], [1.0], [1.0]], "extra": {"x": [{"a": 1}]}}', r"extra column 'x'"),
        ('{"rewards": [[1.0], [1.0], [1.0], [1.0]], "metrics": {"m": "high"}}', r"metric 'm'"),
        ('{"rewards": {"a": 1}}', r"rewards are not a list"),
    ],
)
def test_rn12_a_forged_frame_of_the_wrong_shape_fails_only_its_call(tmp_path, monkeypatch, forged, message):
    """RN12: a reward that digs its worker's sealing out of memory can send a real frame; every answer's
    shape is checked (a row per completion, a reward per function in each, numbers or null; metrics numbers;
    extra columns of texts or numbers, one per completion), so a forged one fails only this call, naming
    itself, and a new worker serves the next."""
    path = tmp_path / "forge.py"
    path.write_text(textwrap.dedent(FORGE))
    monkeypatch.setenv("FORGED", forged)
    worker = RewardWorker([f"{path}:forge"], timeout_s=30)
    with pytest.raises(RewardError, match=f"answer is malformed: .*{message}"):
        worker(batch())
    worker.close()
    good = tmp_path / "good.py"
    good.write_text("def ok(completions, **kw):\n    return [1.0] * len(completions)\n")
    assert RewardWorker([f"{good}:ok"], timeout_s=30)(batch()).rewards == [[1.0]] * 4


PROBED = """
import os, time

def hangs(completions, **kwargs):
    time.sleep(600)

def counts_wrong(completions, **kwargs):
    return [1.0, 2.0]

def leaves(completions, **kwargs):
    os._exit(5)

def fine(completions, **kwargs):
    return [len(c) / 10 for c in completions]
"""


def test_m7_a_probe_call_names_what_would_fail_at_the_first_step_within_its_time(tmp_path):
    """m7: each function called once on a sample row at inspection: a wrong answer or a call that ends the
    worker is its problem; one that outlasts ``probe_timeout_s`` is stopped and not judged (a slow reward is
    no type mismatch), and the others are still called."""
    path = tmp_path / "probed.py"
    path.write_text(textwrap.dedent(PROBED))
    sample = RewardBatch(prompts=["2 + 2 ="], completions=["The answer is 4."], completion_ids=[[1, 2]])
    refs = [f"{path}:{name}" for name in ("hangs", "counts_wrong", "fine", "leaves")]
    t0 = time.monotonic()
    hangs, counts_wrong, fine, leaves = inspect_rewards(
        refs, probes=[(sample, "a text prompt of the data")], probe_timeout_s=1.0
    )
    assert time.monotonic() - t0 < 20
    assert hangs.probe is None and fine.probe is None and fine.problems(set()) == []
    assert counts_wrong.probe == (
        f"reward {shown_reward(refs[1])}, called once on a text prompt of the data with a sample completion, "
        "returned 2 rewards for 1 completions (one per completion)"
    )
    assert counts_wrong.problems(set()) == [counts_wrong.probe]
    assert leaves.probe.startswith(
        f"reward {shown_reward(refs[3])}, called once on a sample row of the data, ended"
    )
