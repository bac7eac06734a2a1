"""The inbox hands a model's requests out in seq_id order, waiting for gaps, and never twice, and wakes the
idle training loop; futures wake their long-polls from another thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlora_lab.service.work import Futures, Inbox, InboxFull, Kind, Refusal, Result, SeqIdPassed, Work


def work(kind: Kind, seq: int | None, model: str = "s:train:0", rid: str | None = None) -> Work:
    return Work(kind, rid or f"{model}/{seq}", owner="k", model_id=model, seq_id=seq)


def test_ordered_requests_come_out_in_seq_order_once_the_gaps_fill():
    inbox = Inbox()
    for seq in (3, 2):  # the chunks of one call: sent together, the first one last
        inbox.put(work(Kind.FORWARD_BACKWARD, seq))
    inbox.put(work(Kind.OPTIM_STEP, 5))
    assert inbox.take() == []  # the model is not started yet
    inbox.start_model("s:train:0")
    assert inbox.take() == []  # seq 1 is missing
    inbox.put(work(Kind.FORWARD_BACKWARD, 1))
    assert [w.seq_id for w in inbox.take()] == [1, 2, 3]
    assert inbox.take() == []  # 4 is missing: 5 waits
    inbox.put(work(Kind.SAVE_WEIGHTS, 4))
    inbox.put(work(Kind.SAMPLE, None, rid="sample-1"))
    assert [(w.kind, w.seq_id) for w in inbox.take()] == [
        (Kind.SAMPLE, None),
        (Kind.SAVE_WEIGHTS, 4),
        (Kind.OPTIM_STEP, 5),
    ]


def test_a_resent_request_gets_the_first_ones_future_and_runs_once():
    inbox = Inbox()
    inbox.start_model("m", 1)
    assert inbox.put(work(Kind.FORWARD_BACKWARD, 1, "m", rid="first")) == "first"
    assert inbox.put(work(Kind.FORWARD_BACKWARD, 1, "m", rid="again")) == "first"
    assert [w.request_id for w in inbox.take()] == ["first"]
    assert inbox.put(work(Kind.FORWARD_BACKWARD, 1, "m", rid="late")) == "first"  # even after it ran
    assert inbox.take() == []


def test_a_full_inbox_refuses_and_a_forgotten_model_gives_its_items_back():
    inbox = Inbox(capacity=2, share=2)
    inbox.put(work(Kind.FORWARD_BACKWARD, 2, "m"))
    inbox.put(work(Kind.FORWARD_BACKWARD, 3, "m"))
    with pytest.raises(InboxFull):
        inbox.put(work(Kind.FORWARD_BACKWARD, 4, "m"))
    assert sorted(w.seq_id for w in inbox.forget_model("m")) == [2, 3] and len(inbox) == 0


def test_a_long_poll_wakes_when_another_thread_settles_and_times_out_otherwise():
    futures = Futures()

    async def main():
        futures.bind(asyncio.get_running_loop())
        rid, other = futures.new(), futures.new()
        threading.Timer(0.05, futures.settle, (rid, Result(json={"ok": 1}))).start()
        got = await futures.wait(rid, timeout=5)
        missing = await futures.wait(other, timeout=0.05)
        return got, missing, futures.known(other), futures.known("nope")

    got, missing, known, unknown = asyncio.run(main())
    assert got.json == {"ok": 1} and got.content_type == "application/json"
    assert missing is None and known and not unknown
    assert Result(proto=b"x").content_type == "application/x-protobuf"


def test_a_seq_id_refused_at_the_door_is_stepped_over():
    """The client spent the seq_id of a request the HTTP side refused (a 4xx): the next ones still run."""
    inbox = Inbox()
    inbox.start_model("m")
    inbox.put(work(Kind.OPTIM_STEP, 3, "m"))
    inbox.skip("m", 2)
    inbox.put(work(Kind.FORWARD_BACKWARD, 1, "m"))
    assert [w.seq_id for w in inbox.take()] == [1, 3] and len(inbox) == 0
    inbox.skip("m", 1)  # (a seq_id already received is not skipped again)
    assert inbox.take() == []


def test_one_source_holds_at_most_its_share_and_the_others_still_find_room():
    """A model whose requests can never run (seq_ids far ahead) or a key flooding samples fills only its own
    share (a quarter of the inbox by default): another model's requests still go in and run."""
    inbox = Inbox(capacity=8)
    inbox.start_model("flood")
    inbox.start_model("honest")
    for seq in (100, 101):  # (never runnable: seq 1 never comes)
        inbox.put(work(Kind.FORWARD_BACKWARD, seq, "flood"))
    with pytest.raises(InboxFull, match="model flood"):
        inbox.put(work(Kind.FORWARD_BACKWARD, 102, "flood"))
    samples = [Work(Kind.SAMPLE, f"s{i}", owner="mallory") for i in range(3)]
    for w in samples[:2]:
        inbox.put(w)
    with pytest.raises(InboxFull, match="key mallory"):
        inbox.put(samples[2])
    inbox.put(work(Kind.FORWARD_BACKWARD, 1, "honest"))
    assert [w.request_id for w in inbox.take()] == ["s0", "s1", "honest/1"] and len(inbox) == 2
    inbox.put(samples[2])  # (its share has room again once its requests were taken)
    assert len(inbox) == 3


def test_resends_are_recognised_for_the_last_seq_ids_and_a_long_gone_one_is_refused():
    inbox = Inbox(remember=4)
    inbox.start_model("m")
    for seq in range(1, 21):
        inbox.put(work(Kind.FORWARD_BACKWARD, seq, "m"))
        assert [w.seq_id for w in inbox.take()] == [seq]
    assert inbox.put(work(Kind.FORWARD_BACKWARD, 20, "m", rid="again")) == "m/20"  # recent: a resend
    with pytest.raises(SeqIdPassed):  # long forgotten: refused, never left waiting for a turn gone by
        inbox.put(work(Kind.FORWARD_BACKWARD, 2, "m", rid="late"))
    assert len(inbox) == 0 and inbox.take() == []


def test_the_inbox_says_how_long_to_wait_for_what_was_sent_together():
    inbox = Inbox()
    assert inbox.gather_wait(quiet_s=10, most_s=20) == 0  # nothing waits
    inbox.put(work(Kind.SAMPLE, None, rid="a"))
    assert 9 < inbox.gather_wait(quiet_s=10, most_s=20) <= 10  # until none came for quiet_s
    assert 4 < inbox.gather_wait(quiet_s=10, most_s=5) <= 5  # ... or the first waited most_s
    assert inbox.gather_wait(quiet_s=0, most_s=20) == 0
    inbox.take()
    assert inbox.gather_wait(quiet_s=10, most_s=20) == 0  # taken: nothing waits


def test_a_put_or_a_skipped_seq_id_wakes_the_idle_loop_a_resend_does_not():
    inbox, wake = Inbox(), threading.Event()
    inbox.arrived = wake  # (as the service driver sets it: the loop's JobParts.wake)
    inbox.start_model("m", 1)
    inbox.put(work(Kind.FORWARD_BACKWARD, 1, "m", rid="first"))
    assert wake.is_set()
    wake.clear()
    inbox.put(work(Kind.FORWARD_BACKWARD, 1, "m", rid="again"))  # a resend: nothing new to take
    assert not wake.is_set()
    inbox.skip("m", 3)  # (a later seq_id may be waiting for it)
    assert wake.is_set()
    wake.clear()
    inbox.put(work(Kind.SAMPLE, None, rid="sample-1"))
    assert wake.is_set()


def test_a_seq_id_refused_at_the_door_answers_its_resends_with_the_same_refusal():
    inbox = Inbox()
    inbox.start_model("m")
    inbox.skip("m", 1, (400, ["path '..' is not a checkpoint name"]))
    with pytest.raises(Refusal) as e:
        inbox.put(Work(Kind.SAVE_WEIGHTS, "r1", "alice", model_id="m", seq_id=1))
    assert (e.value.status, e.value.detail) == (400, ["path '..' is not a checkpoint name"])
    inbox.skip("m", 10**9, (400, "far ahead"))  # (never runnable: not recorded, nothing grows)
    assert 10**9 not in inbox._ordered["m"]
    assert inbox.put(Work(Kind.SAVE_WEIGHTS, "r2", "alice", model_id="m", seq_id=2)) == "r2"
    assert [w.request_id for w in inbox.take()] == ["r2"]
