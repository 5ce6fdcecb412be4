"""The tests' one wait, ``daemon_harness.eventually``, and its event source for a
pool, ``PoolEvents``: what every other test relies on when it waits."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from daemon_harness import Exits, PoolEvents, eventually

from kvtierd_client.client import Client


def test_returns_the_first_truthy_answer_of_the_condition():
    answers = iter([None, 0, [], "ready", "later"])
    assert eventually(lambda: next(answers), 5, "an answer", interval=0) == "ready"
    assert next(answers) == "later"  # not asked again once it held


def test_names_what_it_waited_for_after_the_timeout_and_looks_once_more_at_the_end():
    looks: list[float] = []
    start = time.monotonic()

    def never() -> bool:
        looks.append(time.monotonic() - start)
        return False

    with pytest.raises(AssertionError, match=r"^not within 0.1s: the thing; looked \d+x$"):
        eventually(never, 0.1, lambda: f"the thing; looked {len(looks)}x", interval=0.06)
    assert len(looks) >= 2 and looks[-1] >= 0.1  # the last look is at the deadline


def test_a_zero_timeout_looks_once():
    looks = []
    with pytest.raises(AssertionError, match="once"):
        eventually(lambda: looks.append(1), 0, "once")
    assert looks == [1]


def test_an_exception_of_the_condition_ends_the_wait_at_once():
    def broken() -> bool:
        raise ValueError("the daemon exited")

    start = time.monotonic()
    with pytest.raises(ValueError, match="exited"):
        eventually(broken, 30, "never reached")
    assert time.monotonic() - start < 1


def test_it_blocks_in_wake_instead_of_polling():
    """The condition is looked at again as soon as ``wake`` returns: here a thread
    sets the event after 50 ms while the poll interval is an hour."""
    changed = threading.Event()
    timer = threading.Timer(0.05, changed.set)
    timer.start()
    start = time.monotonic()
    assert eventually(changed.is_set, 10, "the event", wake=changed.wait, interval=3600)
    assert time.monotonic() - start < 5
    timer.join()


def test_pool_events_wake_at_the_pools_next_event(daemon, pool_name):
    """Scenario: PoolEvents made before a store wakes at its event, even when the
    store happened before the first wait (the stream starts at the pool's last
    event at construction); with nothing happening it waits the time given."""
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=4)
        session.prepare_store([b"before"])
        session.complete_store([b"before"])  # an event before PoolEvents: not reported
        with PoolEvents(client, pool_name) as events:
            session.prepare_store([b"k"])
            session.complete_store([b"k"])
            event = events.wait(10)
            assert event is not None and list(event.keys) == [b"k"] and not event.removed
            start = time.monotonic()
            assert events.wait(0.2) is None
            assert time.monotonic() - start >= 0.2


def test_exits_wakes_a_wait_when_a_process_exits_not_when_the_poll_would():
    """A wait for processes to exit blocks on their pidfds: it returns as one exits,
    long before a poll interval of 10 s would have looked again, and a process that
    exited is not waited on again (the wake does not spin)."""
    quick = subprocess.Popen(["sleep", "0.2"])
    slow = subprocess.Popen(["sleep", "0.6"])
    wakes: list[float] = []
    exits = Exits(quick.pid, slow.pid)

    def wake(left: float) -> None:
        wakes.append(time.monotonic())
        exits(left)

    start = time.monotonic()
    try:
        eventually(
            lambda: quick.poll() is not None and slow.poll() is not None,
            5, "both exited", wake=wake, interval=10,
        )  # fmt: skip
    finally:
        quick.kill()
        slow.kill()
    assert time.monotonic() - start < 4  # woken by the exits, not by a 10 s poll
    assert len(wakes) <= 3  # one wake per exit (and the first look's), no spinning
