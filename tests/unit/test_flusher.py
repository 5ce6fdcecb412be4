"""FlushDeadline: the one thread per session that sends queued completions when no
call carries them. Real threads and real clocks; the bounds are generous because
CI machines are loaded, the orderings are exact."""

from __future__ import annotations

import threading
import time

import pytest

from kvtierd_client import flusher
from kvtierd_client.flusher import FlushDeadline


class CountingCondition(threading.Condition):
    """A condition that counts notifications: each one wakes the flusher thread,
    which then competes with the caller for the GIL and a core."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


class Recorder:
    """The ``flush`` callable: records when it ran."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.called = threading.Event()

    def __call__(self) -> bool:
        self.times.append(time.monotonic())
        self.called.set()
        return True


def make(after: float) -> tuple[FlushDeadline, Recorder, CountingCondition]:
    recorder = Recorder()
    deadline = FlushDeadline(recorder, after, "test-flush")
    cond = CountingCondition()
    deadline._cond = cond  # before any arm: the flusher thread uses this one
    return deadline, recorder, cond


def flusher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-flush"]


def test_steady_state_arms_wake_nobody():
    """Each step queues (arm) and the next step's call carries the queue (disarm)
    before the deadline, for many deadlines in a row: the flusher must never be
    signalled (it meets every deadline from its own ticks)."""
    deadline, _, cond = make(after=0.02)
    try:
        for _ in range(100):
            deadline.arm()  # a step queues its completions...
            deadline.disarm()  # ...and the next step's call carries them
            time.sleep(0.002)
        assert cond.notified == 0, f"{cond.notified} notifications for 100 steps"
    finally:
        deadline.stop()


def test_an_uncarried_queue_is_flushed_once_after_the_deadline():
    deadline, recorder, _ = make(after=0.05)
    try:
        armed = time.monotonic()
        deadline.arm()
        assert recorder.called.wait(5), "the deadline never flushed"
        assert recorder.times[0] - armed >= 0.05
        time.sleep(0.15)  # ticks go on, but the queue was flushed: nothing more
        assert len(recorder.times) == 1
    finally:
        deadline.stop()


def test_a_queue_armed_while_the_flusher_ticks_is_flushed_on_time():
    """Arm in the middle of a tick: the deadline falls after the tick ends, so the
    flusher meets it without being notified."""
    deadline, recorder, cond = make(after=0.1)
    try:
        deadline.arm()
        deadline.disarm()  # the flusher is now ticking with nothing queued
        time.sleep(0.15)
        armed = time.monotonic()
        deadline.arm()
        assert recorder.called.wait(5), "the deadline never flushed"
        assert recorder.times[0] - armed >= 0.1
        assert recorder.times[0] - armed < 0.1 + 2.0  # late only by scheduling
        assert cond.notified == 0
    finally:
        deadline.stop()


def test_a_deadline_shorter_than_the_tick_notifies_the_flusher():
    deadline, recorder, cond = make(after=0.0)
    try:
        deadline.arm()
        assert recorder.called.wait(5)
        recorder.called.clear()
        time.sleep(0.05)  # the flusher sleeps MIN_TICK ticks: past a 0 s deadline
        deadline.arm()
        assert recorder.called.wait(5), "an immediate deadline was not met"
        assert len(recorder.times) == 2
    finally:
        deadline.stop()


def test_idle_flusher_exits_and_the_next_arm_starts_another(monkeypatch):
    monkeypatch.setattr(flusher, "IDLE_EXIT", 0.05)
    deadline, recorder, _ = make(after=0.01)
    try:
        for round_ in range(2):
            deadline.arm()
            assert recorder.called.wait(5)
            recorder.called.clear()
            end = time.monotonic() + 5
            while flusher_threads():
                assert time.monotonic() < end, f"round {round_}: the idle flusher never exited"
                time.sleep(0.01)
        assert len(recorder.times) == 2
    finally:
        deadline.stop()


@pytest.mark.parametrize("queued", [False, True])
def test_stop_ends_the_flusher_at_once_and_flushes_nothing(queued):
    deadline, recorder, _ = make(after=30.0)
    deadline.arm()
    if not queued:
        deadline.disarm()
    [thread] = flusher_threads()
    deadline.stop()
    thread.join(5)
    assert not thread.is_alive()
    assert recorder.times == []
    deadline.arm()  # after stop: ignored, no new thread
    assert flusher_threads() == []


def test_a_long_deadline_does_not_keep_an_idle_flusher_alive(monkeypatch):
    """The tick is capped at IDLE_EXIT, so a session with a 30 s deadline that stops
    queueing does not keep its thread for 30 s."""
    monkeypatch.setattr(flusher, "IDLE_EXIT", 0.05)
    deadline, recorder, _ = make(after=30.0)
    try:
        deadline.arm()
        deadline.disarm()
        end = time.monotonic() + 5
        while flusher_threads():
            assert time.monotonic() < end, "the idle flusher outlived IDLE_EXIT by seconds"
            time.sleep(0.01)
        assert recorder.times == []
    finally:
        deadline.stop()
