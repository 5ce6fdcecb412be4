from __future__ import annotations

import asyncio

import pytest
from heap_harness import retained_heap

from kvtierd.contract import BlockEvent, Medium
from kvtierd.records.events import (
    EVENT_OVERHEAD_BYTES,
    MAX_EVENT_BYTES,
    EventLog,
    EventLogStats,
    event_bytes,
)
from kvtierd.records.packedkeys import packed_size
from kvtierd.util.heap import allocated_bytes


def event(i: int) -> BlockEvent:
    return BlockEvent((str(i).encode(),), Medium.CPU, removed=bool(i % 2))


def test_sequence_numbers_start_at_one_and_are_consecutive():
    log = EventLog(retained=16, retained_bytes=MAX_EVENT_BYTES)
    assert [log.append(event(i)) for i in range(3)] == [1, 2, 3]
    events, dropped = log.since(0)
    assert [seq for seq, _ in events] == [1, 2, 3] and dropped == 0
    assert [seq for seq, _ in log.since(2)[0]] == [3]
    assert log.since(3) == ([], 0)


def test_overflow_reports_dropped_events():
    log = EventLog(retained=4, retained_bytes=MAX_EVENT_BYTES)
    for i in range(10):
        log.append(event(i))
    assert log.oldest_seq == 7
    events, dropped = log.since(2)
    assert [seq for seq, _ in events] == [7, 8, 9, 10]
    assert dropped == 4  # seqs 3..6 are gone


def test_wait_beyond_wakes_on_append():
    async def scenario() -> list[int]:
        log = EventLog(retained=8, retained_bytes=MAX_EVENT_BYTES)
        woke: list[int] = []

        async def watcher() -> None:
            await log.wait_beyond(0)
            woke.append(log.last_seq)

        task = asyncio.create_task(watcher())
        await asyncio.sleep(0)
        assert not woke
        log.append(event(1))
        await task
        return woke

    assert asyncio.run(scenario()) == [1]


def keys_event(count: int, length: int, *, removed: bool = False) -> BlockEvent:
    keys = tuple(i.to_bytes(4, "big") * (length // 4) for i in range(count))
    return BlockEvent(keys, Medium.STORAGE, removed=removed, tier="fs0")


def test_event_bytes_are_the_packed_keys_as_allocated_plus_a_fixed_cost():
    """Each key packed takes its bytes plus its tag and length (2 bytes below 128
    bytes, 3 from 128); the bytes object holding them counts as allocated (its
    33-byte header, rounded to 16), the event a fixed cost."""
    log = EventLog(retained=16, retained_bytes=MAX_EVENT_BYTES)
    log.append(BlockEvent((b"ab", b"c", b"x" * 200), Medium.CPU, removed=False))
    packed = (2 + 2) + (1 + 2) + (200 + 3)
    assert (33 + packed + 15) // 16 * 16 == 256
    assert event_bytes(log.get(1)) == 256 + EVENT_OVERHEAD_BYTES
    assert log.get(1).keys == (b"ab", b"c", b"x" * 200)


def test_byte_limit_drops_the_oldest_events_like_the_count_limit():
    """Scenario: events of ~10 KB each under a 64 KiB limit and a count limit that
    never binds: the oldest go, readers behind them learn how many they missed."""
    log = EventLog(retained=1000, retained_bytes=MAX_EVENT_BYTES)
    log.append(keys_event(100, 100))
    size = event_bytes(log.get(1))
    assert size > 100 * packed_size(100) + EVENT_OVERHEAD_BYTES
    fits = MAX_EVENT_BYTES // size
    for i in range(1, 10):
        assert log.append(keys_event(100, 100)) == i + 1
        assert log.retained_bytes <= MAX_EVENT_BYTES
    assert log.oldest_seq == 10 - fits + 1
    events, dropped = log.since(0)
    assert [seq for seq, _ in events] == list(range(10 - fits + 1, 11))
    assert dropped == 10 - fits
    assert log.statistics() == EventLogStats(
        last_seq=10, retained_events=fits, retained_bytes=fits * size, dropped_events=10 - fits
    )


def test_a_long_event_is_split_in_key_order_under_consecutive_seqs():
    event = keys_event(1000, 256, removed=True)
    log = EventLog(retained=1000, retained_bytes=8 * MAX_EVENT_BYTES)
    last = log.append(event)
    parts, dropped = log.since(0)
    assert dropped == 0 and last == len(parts) > 1
    assert [seq for seq, _ in parts] == list(range(1, last + 1))
    assert tuple(key for _, part in parts for key in part.keys) == event.keys
    for _, part in parts:
        assert event_bytes(part) <= MAX_EVENT_BYTES
        assert (part.medium, part.removed, part.tier) == (Medium.STORAGE, True, "fs0")
    # each part but the last is full: one more key would not have fitted
    for (_, part), (_, following) in zip(parts, parts[1:], strict=False):
        longer = 33 + len(part.packed_keys) + packed_size(len(following.keys[0]))
        assert allocated_bytes(longer) + EVENT_OVERHEAD_BYTES > MAX_EVENT_BYTES
    assert log.retained_bytes == sum(event_bytes(part) for _, part in parts)


def test_get_answers_retained_events_only():
    log = EventLog(retained=4, retained_bytes=MAX_EVENT_BYTES)
    for i in range(6):
        log.append(event(i))
    assert log.get(2) is None  # dropped by the count limit
    assert log.get(3) is not None and log.get(3).keys == (b"2",)
    assert log.get(6).keys == (b"5",)
    assert log.get(7) is None  # not yet


def test_byte_limit_below_one_event_is_refused():
    with pytest.raises(ValueError, match="retained_bytes"):
        EventLog(retained=16, retained_bytes=MAX_EVENT_BYTES - 1)


@pytest.mark.parametrize(
    ("keys_per_event", "key_bytes"), [(1, 1), (1, 32), (4, 32), (1000, 256), (20000, 32)]
)
def test_what_the_log_counts_covers_the_heap_its_events_take(keys_per_event, key_bytes):
    """Scenario: a log filled to its 1 MiB byte limit with events of each shape;
    the heap the log then holds (tracemalloc, the allocator's rounding included)
    beyond an empty log's is at most what it counts, and at least 60% of it.
    Before: 256-byte keys were counted 296 bytes and took 312 (object and slot)."""

    def fill() -> EventLog:
        log = EventLog(retained=1 << 24, retained_bytes=1 << 20)
        n = 0
        while log.statistics().dropped_events == 0:
            keys = tuple(
                (n + i).to_bytes(8, "big")[-key_bytes:].rjust(key_bytes, b"k")
                for i in range(keys_per_event)
            )
            n += keys_per_event
            log.append(BlockEvent(keys, Medium.CPU, removed=False))
        return log

    _, empty = retained_heap(lambda: EventLog(retained=1 << 24, retained_bytes=1 << 20))
    log, heap = retained_heap(fill)
    assert 0.6 * log.retained_bytes <= heap - empty <= log.retained_bytes
