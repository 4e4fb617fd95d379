"""The batched worker's Outbox: the running jobs' events wait there and reach their loop together, in order, at a
flush (one call_soon_threadsafe a loop); a closed loop cancels its jobs."""

from __future__ import annotations

import asyncio

from hybrid.server.schemas import GenRequest
from hybrid.server.slot import Delta, Job, Outbox


def _drain(loop, job: Job) -> list:
    loop.run_until_complete(asyncio.sleep(0))  # the flush's callback runs
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_outbox_holds_events_until_a_flush_then_hands_them_over_in_order():
    loop = asyncio.new_event_loop()
    try:
        box = Outbox()
        a, b = (Job(GenRequest(kind="completion"), [1], loop, outbox=box) for _ in range(2))
        plain = Job(GenRequest(kind="completion"), [1], loop)  # no outbox: handed over at once
        a.post(Delta("x"))
        b.post(Delta("y"))
        a.post(Delta("z"))
        plain.post(Delta("p"))
        assert [e.content for e in _drain(loop, plain)] == ["p"]
        assert _drain(loop, a) == [] and _drain(loop, b) == []
        scheduled = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: scheduled.append(1) or real(*args)
        box.flush()
        assert scheduled == [1]  # one hand-over for the three events
        assert [e.content for e in _drain(loop, a)] == ["x", "z"]
        assert [e.content for e in _drain(loop, b)] == ["y"]
        box.flush()  # nothing left: nothing scheduled
        assert scheduled == [1]
    finally:
        loop.close()


def test_outbox_cancels_the_jobs_of_a_closed_loop():
    loop = asyncio.new_event_loop()
    box = Outbox()
    job = Job(GenRequest(kind="completion"), [1], loop, outbox=box)
    loop.close()
    job.post(Delta("x"))
    box.flush()
    assert job.cancel.is_set()
