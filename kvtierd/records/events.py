"""A pool's bounded, sequenced event log (TakeEvents cursors and WatchEvents streams).

Bounded twice: at most ``retained`` events and at most ``retained_bytes`` bytes
(:func:`event_bytes`: the memory its packed keys hold plus :data:`EVENT_OVERHEAD_BYTES`).
Whatever either limit drops is dropped the same way: the oldest events go first,
and a reader whose cursor falls before the oldest retained event learns how many
it missed.

What is counted is what the event costs the daemon: each retained event is one
:class:`LoggedEvent` holding its keys packed into one ``bytes``
(:mod:`kvtierd.records.packedkeys`: two or three bytes a key beyond the key),
never a Python object per key (a 256-byte key as a ``bytes`` object takes 304
bytes of the heap, and its tuple slot 8 more: the log used to count 296).
``tests/unit/records/test_events.py`` measures the heap a full log takes with
tracemalloc against what it counts.

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

from kvtierd.contract import BlockEvent, BlockKey, Medium
from kvtierd.records.packedkeys import pack, packed_sizes, unpack
from kvtierd.util.heap import PAGE_BYTES, allocated_bytes

# A retained event's cost beyond the bytes object of its packed keys (measured,
# 64-bit CPython 3.11: the LoggedEvent object 72 and the ring's slot 8), with
# room to spare; that object itself is counted as allocated (allocated_bytes).
EVENT_OVERHEAD_BYTES = 112
_BYTES_HEADER = 33  # a bytes object's header (sys.getsizeof(b"") on 64-bit CPython)
MAX_EVENT_BYTES = 64 << 10  # a longer event is split (one WatchEvents message at most)
# packed key bytes of one event: its bytes object fills whole pages when it is
# mapped on its own (15 pages; 49 is the object's and the mapping's headers)
_PACKED_BUDGET = (MAX_EVENT_BYTES - EVENT_OVERHEAD_BYTES) // PAGE_BYTES * PAGE_BYTES - 49
_MAX_PREFIX = 3  # a key's tag and length, packed, for keys below 16 KiB


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """A retained event: a :class:`~kvtierd.contract.BlockEvent` whose keys are
    packed (:mod:`kvtierd.records.packedkeys`, the wire form of ``Event.keys``)."""

    packed_keys: bytes
    medium: Medium
    removed: bool
    tier: str

    @property
    def keys(self) -> tuple[BlockKey, ...]:
        """The keys, unpacked (a Python object each: for tests and rare readers)."""
        return unpack(self.packed_keys)


def event_bytes(event: LoggedEvent) -> int:
    """What ``event`` counts against the byte limit: what its packed keys' bytes
    object holds of memory, plus :data:`EVENT_OVERHEAD_BYTES`."""
    return allocated_bytes(_BYTES_HEADER + len(event.packed_keys)) + EVENT_OVERHEAD_BYTES


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
        # Invariant: _ring[i] has seq oldest_seq + i; _bytes == sum of event_bytes.
        self._ring: deque[LoggedEvent] = deque()
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
        keys = event.keys
        packed = None
        if sum(map(len, keys)) + _MAX_PREFIX * len(keys) <= _PACKED_BUDGET:
            packed = pack(keys)  # the usual case: one part, no size per key computed
        if packed is not None and len(packed) <= _PACKED_BUDGET:
            self._push(LoggedEvent(packed, event.medium, event.removed, event.tier))
        else:
            for part in _split(keys):
                self._push(LoggedEvent(pack(part), event.medium, event.removed, event.tier))
        self._trim()
        if self._waiters:
            self.wake_all()
        return self.last_seq

    def _push(self, event: LoggedEvent) -> None:
        self.last_seq += 1
        self._ring.append(event)
        self._bytes += event_bytes(event)

    def _trim(self) -> None:
        """Drops the oldest events until both limits hold. Every event fits the byte
        limit alone (MAX_EVENT_BYTES <= limit_bytes), so the newest always stays."""
        ring = self._ring
        while len(ring) > self.limit or self._bytes > self.limit_bytes:
            self._bytes -= event_bytes(ring.popleft())
            self._dropped += 1
        assert ring and self._bytes <= self.limit_bytes

    def since(
        self, after_seq: int, max_bytes: int | None = None
    ) -> tuple[list[tuple[int, LoggedEvent]], int]:
        """Events with seq > ``after_seq``, and how many of those were already dropped.

        ``max_bytes``: the oldest of them that fit that many bytes (at least one
        event, so a reader always moves on); the caller continues from the last
        one returned."""
        start = max(after_seq + 1, self.oldest_seq)
        dropped = start - (after_seq + 1)
        retained = enumerate(itertools.islice(self._ring, start - self.oldest_seq, None), start)
        if max_bytes is None:
            return list(retained), dropped
        taken: list[tuple[int, LoggedEvent]] = []
        total = 0
        for entry in retained:
            total += event_bytes(entry[1])
            if taken and total > max_bytes:
                break
            taken.append(entry)
        return taken, dropped

    def get(self, seq: int) -> LoggedEvent | None:
        """The event numbered ``seq``; None when it was dropped or does not exist yet."""
        index = seq - self.oldest_seq
        if index < 0 or seq > self.last_seq:
            return None
        return self._ring[index]

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


def _split(keys: Sequence[BlockKey]) -> list[Sequence[BlockKey]]:
    """``keys`` in order as parts whose packed keys take at most ``_PACKED_BUDGET``
    bytes (at least one key each, so a part is never empty).

    ``ends[i]`` is what keys ``[0, i]`` take packed; a part starting at key
    ``start`` ends before the first key whose ``ends`` exceeds ``ends[start - 1]``
    plus the budget (C-level accumulate and bisect: no Python loop per key)."""
    ends = list(accumulate(packed_sizes(keys)))
    parts: list[Sequence[BlockKey]] = []
    start, base = 0, 0
    while start < len(keys):
        stop = max(start + 1, bisect_right(ends, base + _PACKED_BUDGET, lo=start))
        parts.append(keys[start:stop])
        start, base = stop, ends[stop - 1]
    return parts
