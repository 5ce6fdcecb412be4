"""A pool's bounded, sequenced event log (TakeEvents cursors and WatchEvents streams).

Invariant: the retained entries have consecutive sequence numbers ending at
``last_seq``; the oldest retained one is ``last_seq - len(ring) + 1``. Sequence
numbers start at 1 and never repeat for the lifetime of the pool.
Owned by the event loop; no locks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from kvtierd.contract import BlockEvent


class EventLog:
    def __init__(self, retained: int) -> None:
        self._ring: deque[tuple[int, BlockEvent]] = deque(maxlen=retained)
        self.last_seq = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def oldest_seq(self) -> int:
        """Sequence number of the oldest retained event (``last_seq + 1`` when empty)."""
        return self.last_seq - len(self._ring) + 1

    def append(self, event: BlockEvent) -> int:
        """Records ``event`` under the next sequence number and wakes watchers."""
        self.last_seq += 1
        self._ring.append((self.last_seq, event))
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        return self.last_seq

    def since(self, after_seq: int) -> tuple[list[tuple[int, BlockEvent]], int]:
        """Events with seq > ``after_seq``, and how many of those were already dropped."""
        start = max(after_seq + 1, self.oldest_seq)
        dropped = start - (after_seq + 1)
        skip = start - self.oldest_seq
        return list(itertools.islice(self._ring, skip, None)), dropped

    async def wait_beyond(self, seq: int) -> None:
        """Returns once an event with a sequence number above ``seq`` exists."""
        while self.last_seq <= seq:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def wake_all(self) -> None:
        """Wakes every watcher (used at shutdown so streams can end)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
