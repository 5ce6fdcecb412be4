from __future__ import annotations

import asyncio

from kvtierd.contract import BlockEvent, Medium
from kvtierd.events import EventLog


def event(i: int) -> BlockEvent:
    return BlockEvent((str(i).encode(),), Medium.CPU, removed=bool(i % 2))


def test_sequence_numbers_start_at_one_and_are_consecutive():
    log = EventLog(retained=16)
    assert [log.append(event(i)) for i in range(3)] == [1, 2, 3]
    events, dropped = log.since(0)
    assert [seq for seq, _ in events] == [1, 2, 3] and dropped == 0
    assert [seq for seq, _ in log.since(2)[0]] == [3]
    assert log.since(3) == ([], 0)


def test_overflow_reports_dropped_events():
    log = EventLog(retained=4)
    for i in range(10):
        log.append(event(i))
    assert log.oldest_seq == 7
    events, dropped = log.since(2)
    assert [seq for seq, _ in events] == [7, 8, 9, 10]
    assert dropped == 4  # seqs 3..6 are gone


def test_wait_beyond_wakes_on_append():
    async def scenario() -> list[int]:
        log = EventLog(retained=8)
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
