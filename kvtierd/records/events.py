"""A pool's bounded, sequenced event log (TakeEvents cursors and WatchEvents streams).

Bounded twice: at most ``retained`` events and at most ``retained_bytes`` bytes
(:func:`event_bytes`: the keys' lengths plus a fixed cost per key and per
event, about what the Python objects take). Whatever either limit drops is
dropped the same way: the oldest events go first, and a reader whose cursor
falls before the oldest retained event learns how many it missed.

Each retained event is at most :data:`MAX_EVENT_BYTES`: a longer one (a
PrepareStore of 65,536 long keys, a flush) is split on append into consecutive
events of the same kind, in key order, each with its own sequence number. So
one WatchEvents message, the unit a stream holds while its client does not
read, stays small, and no single event can exceed the byte limit (it is at
least MAX_EVENT_BYTES): the newest event is always retained.

Invariants: the retained entries have consecutive sequence numbers ending at
``last_seq``; the oldest retained one is ``last_seq - len(ring) + 1``. Sequence
numbers start at 1 and never repeat for the lifetime of the pool.
``retained_bytes == sum(event_bytes(e) for e in ring) <= limit_bytes`` after
every append. Owned by the event loop; no locks.
"""

from __future__ import annotations

import asyncio
import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import add

from kvtierd.contract import BlockEvent, BlockKey

EVENT_OVERHEAD_BYTES = 200  # the BlockEvent, its keys tuple and its ring entry
KEY_OVERHEAD_BYTES = 40  # a bytes object's header and its slot in the keys tuple
MAX_EVENT_BYTES = 64 << 10  # a longer event is split (one WatchEvents message at most)


def event_bytes(event: BlockEvent) -> int:
    """What ``event`` counts against the byte limit."""
    return _keys_bytes(event.keys) + EVENT_OVERHEAD_BYTES


def _keys_bytes(keys: Sequence[BlockKey]) -> int:
    return sum(map(len, keys)) + KEY_OVERHEAD_BYTES * len(keys)


@dataclass(frozen=True, slots=True)
class EventLogStats:
    """A snapshot; ``dropped_events`` counts events either limit dropped, ever."""

    last_seq: int
    retained_events: int
    retained_bytes: int
    dropped_events: int


class EventLog:
    def __init__(self, retained: int, retained_bytes: int) -> None:
        if retained < 1:
            raise ValueError(f"retained must be >= 1, got {retained}")
        if retained_bytes < MAX_EVENT_BYTES:
            raise ValueError(f"retained_bytes must be >= {MAX_EVENT_BYTES}, got {retained_bytes}")
        self.limit = retained
        self.limit_bytes = retained_bytes
        # Invariant: _sizes[i] == event_bytes(_ring[i][1]); _bytes == sum(_sizes).
        self._ring: deque[tuple[int, BlockEvent]] = deque()
        self._sizes: deque[int] = deque()
        self._bytes = 0
        self._dropped = 0
        self.last_seq = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def oldest_seq(self) -> int:
        """Sequence number of the oldest retained event (``last_seq + 1`` when empty)."""
        return self.last_seq - len(self._ring) + 1

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    def statistics(self) -> EventLogStats:
        return EventLogStats(self.last_seq, len(self._ring), self._bytes, self._dropped)

    def append(self, event: BlockEvent) -> int:
        """Records ``event`` (split into parts of at most MAX_EVENT_BYTES) under the
        next sequence numbers, drops the oldest events beyond either limit and wakes
        watchers. Returns the last sequence number used."""
        size = event_bytes(event)
        if size <= MAX_EVENT_BYTES:
            self._push(event, size)
        else:
            for part, part_size in _split(event):
                self._push(part, part_size)
        self._trim()
        if self._waiters:
            self.wake_all()
        return self.last_seq

    def _push(self, event: BlockEvent, size: int) -> None:
        self.last_seq += 1
        self._ring.append((self.last_seq, event))
        self._sizes.append(size)
        self._bytes += size

    def _trim(self) -> None:
        """Drops the oldest events until both limits hold. Every event fits the byte
        limit alone (MAX_EVENT_BYTES <= limit_bytes), so the newest always stays."""
        ring, sizes = self._ring, self._sizes
        while len(ring) > self.limit or self._bytes > self.limit_bytes:
            ring.popleft()
            self._bytes -= sizes.popleft()
            self._dropped += 1
        assert ring and self._bytes <= self.limit_bytes

    def since(
        self, after_seq: int, max_bytes: int | None = None
    ) -> tuple[list[tuple[int, BlockEvent]], int]:
        """Events with seq > ``after_seq``, and how many of those were already dropped.

        ``max_bytes``: the oldest of them that fit that many bytes (at least one
        event, so a reader always moves on); the caller continues from the last
        one returned."""
        start = max(after_seq + 1, self.oldest_seq)
        dropped = start - (after_seq + 1)
        skip = start - self.oldest_seq
        if max_bytes is None:
            return list(itertools.islice(self._ring, skip, None)), dropped
        taken: list[tuple[int, BlockEvent]] = []
        total = 0
        for entry, size in zip(
            itertools.islice(self._ring, skip, None),
            itertools.islice(self._sizes, skip, None),
            strict=True,
        ):
            total += size
            if taken and total > max_bytes:
                break
            taken.append(entry)
        return taken, dropped

    def get(self, seq: int) -> BlockEvent | None:
        """The event numbered ``seq``; None when it was dropped or does not exist yet."""
        index = seq - self.oldest_seq
        if index < 0 or seq > self.last_seq:
            return None
        return self._ring[index][1]

    async def wait_beyond(self, seq: int) -> None:
        """Returns once an event with a sequence number above ``seq`` exists."""
        while self.last_seq <= seq:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def wake_all(self) -> None:
        """Wakes every watcher (after an append; at shutdown so streams can end)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _split(event: BlockEvent) -> list[tuple[BlockEvent, int]]:
    """``event``'s keys in order as events of at most MAX_EVENT_BYTES (at least one
    key each, so a part is never empty), with their sizes.

    ``ends[i]`` is what keys ``[0, i]`` count; a part starting at key ``start``
    ends before the first key whose ``ends`` exceeds ``ends[start - 1]`` plus
    the budget (C-level accumulate and bisect: no Python loop per key)."""
    keys = event.keys
    n = len(keys)
    ends = list(
        map(
            add,
            accumulate(map(len, keys)),
            range(KEY_OVERHEAD_BYTES, KEY_OVERHEAD_BYTES * (n + 1), KEY_OVERHEAD_BYTES),
        )
    )
    budget = MAX_EVENT_BYTES - EVENT_OVERHEAD_BYTES
    parts: list[tuple[BlockEvent, int]] = []
    start, base = 0, 0
    while start < n:
        stop = max(start + 1, bisect_right(ends, base + budget, lo=start))
        part = BlockEvent(keys[start:stop], event.medium, removed=event.removed, tier=event.tier)
        parts.append((part, ends[stop - 1] - base + EVENT_OVERHEAD_BYTES))
        start, base = stop, ends[stop - 1]
    return parts
