"""FlushDeadline: the one thread per session that sends queued completions when no
call carries them. Real threads and real clocks; the bounds are generous because
CI machines are loaded, the orderings are exact. The tests wait for the flusher
through its own statistics (its ticks, its thread), never with a fixed sleep."""

from __future__ import annotations

import threading
import time

import pytest
from daemon_harness import eventually

from kvtierd_client._rpc import flusher
from kvtierd_client._rpc.flusher import FlushDeadline


class Recorder:
    """The ``flush`` callable: records when it ran."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.called = threading.Event()

    def __call__(self) -> bool:
        self.times.append(time.monotonic())
        self.called.set()
        return True


def make(after: float) -> tuple[FlushDeadline, Recorder]:
    recorder = Recorder()
    return FlushDeadline(recorder, after, "test-flush"), recorder


def wait_ticks(deadline: FlushDeadline, n: int) -> None:
    """Until the flusher has woken ``n`` more times (by itself or notified)."""
    target = deadline.statistics().ticks + n
    eventually(lambda: deadline.statistics().ticks >= target, 5, f"{n} flusher ticks")


def flusher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-flush"]


def join_flushers(left: float) -> None:
    """Wakes ``eventually`` when the flusher threads exited (or the time left is up)."""
    for thread in flusher_threads():
        thread.join(left)


def test_steady_state_arms_wake_nobody():
    """Each step queues (arm) and the next step's call carries the queue (disarm)
    before the deadline, for many deadlines in a row: the flusher must never be
    signalled (it meets every deadline from its own ticks)."""
    deadline, _ = make(after=0.02)
    try:
        for step in range(100):
            deadline.arm()  # a step queues its completions...
            deadline.disarm()  # ...and the next step's call carries them
            if step % 10 == 9:
                wait_ticks(deadline, 1)  # the next steps arm in another tick
        stats = deadline.statistics()
        assert stats.notifications == 0, f"{stats.notifications} notifications for 100 steps"
        assert stats.flushes == 0 and not stats.armed
    finally:
        deadline.stop()


def test_an_uncarried_queue_is_flushed_once_after_the_deadline():
    deadline, recorder = make(after=0.05)
    try:
        armed = time.monotonic()
        deadline.arm()
        assert recorder.called.wait(5), "the deadline never flushed"
        assert recorder.times[0] - armed >= 0.05
        wait_ticks(deadline, 3)  # ticks go on, but the queue was flushed: nothing more
        assert len(recorder.times) == 1
        assert deadline.statistics().flushes == 1
    finally:
        deadline.stop()


def test_a_queue_armed_while_the_flusher_ticks_is_flushed_on_time():
    """Arm in the middle of a tick: the deadline falls after the tick ends, so the
    flusher meets it without being notified."""
    deadline, recorder = make(after=0.1)
    try:
        deadline.arm()
        deadline.disarm()  # the flusher is now ticking with nothing queued
        wait_ticks(deadline, 1)
        armed = time.monotonic()
        deadline.arm()
        assert recorder.called.wait(5), "the deadline never flushed"
        assert recorder.times[0] - armed >= 0.1
        assert recorder.times[0] - armed < 0.1 + 2.0  # late only by scheduling
        assert deadline.statistics().notifications == 0
    finally:
        deadline.stop()


def test_a_deadline_shorter_than_the_tick_notifies_the_flusher():
    deadline, recorder = make(after=0.0)
    try:
        deadline.arm()
        assert recorder.called.wait(5)
        recorder.called.clear()
        wait_ticks(deadline, 2)  # the flusher sleeps MIN_TICK ticks: past a 0 s deadline
        deadline.arm()
        assert recorder.called.wait(5), "an immediate deadline was not met"
        assert len(recorder.times) == 2
    finally:
        deadline.stop()


def test_idle_flusher_exits_and_the_next_arm_starts_another(monkeypatch):
    monkeypatch.setattr(flusher, "IDLE_EXIT", 0.05)
    deadline, recorder = make(after=0.01)
    try:
        for round_ in range(2):
            deadline.arm()
            assert recorder.called.wait(5)
            recorder.called.clear()
            eventually(
                lambda: not flusher_threads(), 5, f"round {round_}: the idle flusher exits",
                wake=join_flushers,
            )  # fmt: skip
            assert not deadline.statistics().running
        assert len(recorder.times) == 2
    finally:
        deadline.stop()


@pytest.mark.parametrize("queued", [False, True])
def test_stop_ends_the_flusher_at_once_and_flushes_nothing(queued):
    deadline, recorder = make(after=30.0)
    deadline.arm()
    if not queued:
        deadline.disarm()
    assert deadline.statistics().armed is queued
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
    deadline, recorder = make(after=30.0)
    try:
        deadline.arm()
        deadline.disarm()
        eventually(
            lambda: not flusher_threads(), 5, "the idle flusher exits after IDLE_EXIT",
            wake=join_flushers,
        )  # fmt: skip
        assert recorder.times == []
    finally:
        deadline.stop()
