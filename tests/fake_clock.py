"""The one fake clock of the tests, for every component that takes an injected clock
(``clock=``: monotonic seconds as a callable).

It reads :attr:`FakeClock.now`, which only the test moves (:meth:`advance`, or
assignment), so a test of a timeout or a lease states the time it means instead of
sleeping for it. :meth:`script` queues readings that are returned first, in order: for
code that reads the clock at known points (a check, then the end of a copy).
"""

from __future__ import annotations

from collections import deque


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.scripted: deque[float] = deque()

    def __call__(self) -> float:
        return self.scripted.popleft() if self.scripted else self.now

    def advance(self, seconds: float) -> float:
        """Moves the clock ``seconds`` ahead; returns the new time."""
        self.now += seconds
        return self.now

    def script(self, *readings: float) -> None:
        """The next readings, in order, before ``now`` is read again."""
        self.scripted.extend(readings)
