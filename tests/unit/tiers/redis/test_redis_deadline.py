"""The redis tier's call deadline (kvtierd.tiers.redis.deadline) on real sockets: a
watched call whose answer never completes is cut at its deadline; a call that
ended is never touched afterwards (its connection may serve another thread)."""

from __future__ import annotations

import socket
import time

from fake_clock import FakeClock

from kvtierd.tiers.redis.deadline import CallDeadlines


class _Connection:
    """What the watchdog needs of a redis-py connection: its ``_sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


def test_a_call_past_its_deadline_is_cut_and_marked_expired():
    deadlines = CallDeadlines(0.3, "test")
    ours, server = socket.socketpair()
    try:
        ours.settimeout(10)  # the per-recv timeout alone would wait this long
        started = time.monotonic()
        with deadlines.watch(_Connection(ours)) as call:
            server.sendall(b"+")  # a trickle: a first byte, then nothing
            assert ours.recv(1) == b"+"
            assert ours.recv(1) == b""  # shut down by the watchdog
        assert call.expired
        assert 0.25 <= time.monotonic() - started < 5.0
        assert deadlines.expired == 1
    finally:
        deadlines.close()
        ours.close()
        server.close()


def test_a_call_that_ended_in_time_is_never_touched():
    clock = FakeClock()
    deadlines = CallDeadlines(0.2, "test", clock=clock)
    ours, server = socket.socketpair()
    try:
        with deadlines.watch(_Connection(ours)) as call:
            server.sendall(b"+OK\r\n")
            assert ours.recv(5) == b"+OK\r\n"
        clock.advance(0.5)  # past the deadline: the connection is someone else's now
        assert deadlines.cut_overdue() == 0  # a watchdog pass then
        assert not call.expired and deadlines.expired == 0
        server.sendall(b"more")
        ours.settimeout(5)
        assert ours.recv(4) == b"more"  # still open both ways
    finally:
        deadlines.close()
        ours.close()
        server.close()


def test_a_pass_cuts_the_calls_past_their_deadline_only():
    """The watchdog's pass on the fake clock: at the deadline, not a moment before."""
    clock = FakeClock()
    deadlines = CallDeadlines(0.2, "test", clock=clock)
    ours, server = socket.socketpair()
    try:
        with deadlines.watch(_Connection(ours)) as call:
            started = clock.now
            clock.now = started + 0.2 - 0.001
            assert deadlines.cut_overdue() == 0 and not call.expired
            clock.now = started + 0.2
            deadlines.cut_overdue()  # (or the watchdog thread's pass, on the same clock)
            assert call.expired
            ours.settimeout(5)
            assert ours.recv(1) == b""  # shut down
        assert deadlines.expired == 1
    finally:
        deadlines.close()
        ours.close()
        server.close()
