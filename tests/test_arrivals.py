"""The batched worker's gathering of request waves (hybrid/server/arrivals.py), on a fake clock."""

from types import SimpleNamespace

import pytest

from hybrid.server.arrivals import MAX_WAIT_S, NEAR_END, RETURN_WINDOW_S, Arrivals, near_end


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make():
    clock = Clock()
    return clock, Arrivals(clock)


def test_lone_client_is_never_held():
    clock, a = make()
    a.gather("first")  # no reply has ended: nothing else is expected
    assert a.wait_s(free=8, near_end=0) == 0
    assert a.release(8) == ["first"]
    a.reply_ended()
    clock.t += 0.003
    a.gather("second")  # the return that was expected
    assert a.wait_s(free=8, near_end=0) == 0


def test_wave_is_held_until_it_fills_or_times_out():
    clock, a = make()
    for _ in range(8):
        a.reply_ended()
    clock.t += 0.002
    a.gather("j0")
    assert a.wait_s(free=8, near_end=0) == pytest.approx(MAX_WAIT_S)
    for i in range(1, 7):
        clock.t += 0.001
        a.gather(f"j{i}")
        assert 0 < a.wait_s(free=8, near_end=0) < MAX_WAIT_S
    clock.t += 0.001
    a.gather("j7")
    assert a.wait_s(free=8, near_end=0) == 0  # eight of eight slots
    assert a.release(8) == [f"j{i}" for i in range(8)]
    assert a.gathered == []

    for _ in range(8):
        a.reply_ended()
    a.gather("k0")
    clock.t += MAX_WAIT_S / 2
    assert a.wait_s(free=8, near_end=0) == pytest.approx(MAX_WAIT_S / 2)
    clock.t += MAX_WAIT_S / 2 + 1e-6  # the other clients did not come: admitted after MAX_WAIT_S
    assert a.wait_s(free=8, near_end=0) == 0


def test_returns_expire_and_near_end_sequences_count():
    clock, a = make()
    a.reply_ended()
    a.reply_ended()
    clock.t += RETURN_WINDOW_S + 0.01  # too long ago: no longer expected
    a.gather("late")
    assert a.wait_s(free=8, near_end=0) == 0
    # one reply ended, seven sequences end within NEAR_END tokens: the early client waits for their returns
    assert a.wait_s(free=1, near_end=7) > 0
    assert a.release(1) == ["late"]

    a.reply_ended()
    a.gather("x")
    assert a.wait_s(free=1, near_end=7) > 0  # 1 gathered, 8 expected to be free soon
    assert a.wait_s(free=8, near_end=0) == 0  # no other return expected, no sequence near its end


def test_release_keeps_what_does_not_fit():
    clock, a = make()
    for _ in range(3):
        a.reply_ended()
    for j in "abc":
        a.gather(j)
    assert a.release(2) == ["a", "b"]
    assert a.gathered == ["c"]


def test_near_end():
    def seq(n_predict, produced, remaining=0):
        return SimpleNamespace(req=SimpleNamespace(n_predict=n_predict), produced=[0] * produced, remaining=remaining)

    assert near_end(seq(128, 128 - NEAR_END))
    assert not near_end(seq(128, 128 - NEAR_END - 1))
    assert not near_end(seq(-1, 1000))  # until the context is full: no known end
    assert not near_end(seq(2, 0, remaining=5))  # still evaluating its prompt


def test_a_wave_that_fills_a_steps_budget_is_admitted_without_the_rest():
    clock, a = make()
    for _ in range(8):
        a.reply_ended()
    for i in range(5):
        a.gather(f"j{i}", tokens=369)
        assert a.wait_s(free=8, near_end=0, budget=2048) > 0  # 1845 tokens: room for more in the step
    a.gather("j5", tokens=369)  # 2214 >= 2048: later arrivals could not join this step
    assert a.wait_s(free=8, near_end=0, budget=2048) == 0
    assert a.wait_s(free=8, near_end=0) > 0  # no budget given: still waiting for the other two
    assert len(a.release(8)) == 6 and a.tokens == []
