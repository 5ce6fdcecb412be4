"""What the previous daemon's clients may still touch after a restart
(kvtierd.primary.warm.holds, .clock and the liveness records of .journalformat), on real
journal files: a graceful stop names exactly the rows held and until when, a crash
holds every row the journal names until the last lease horizon, a journal of the
previous format as before; instants read on both clocks, never past what the writer
could promise, nothing from another boot."""

from __future__ import annotations

import struct
import time
import zlib

import pytest
from daemon_harness import eventually
from fake_clock import FakeClock

from kvtierd.primary.warm import clock
from kvtierd.primary.warm import journal as journal_module
from kvtierd.primary.warm.clock import Instant, current_boot_id
from kvtierd.primary.warm.holds import HORIZON_SLACK_SECONDS, old_client_holds
from kvtierd.primary.warm.journal import JournalWriter
from kvtierd.primary.warm.journalformat import (
    KIND_HELD,
    KIND_STOPPED,
    JournalHeader,
    encode_freed,
    encode_instant,
    encode_ready,
    read_journal,
)

BLOCK = 4096
ROWS = 16
FENCE = 3.0  # the writer's lease + write_quarantine


def make_writer(
    tmp_path, boot_id: str | None = None, clock: FakeClock | None = None
) -> JournalWriter:
    header = JournalHeader(
        "pool", BLOCK, ROWS, "layout", 1, 2, fence_seconds=FENCE,
        boot_id=current_boot_id() if boot_id is None else boot_id,
    )  # fmt: skip
    region = memoryview(bytearray(ROWS * BLOCK))
    return JournalWriter(
        str(tmp_path / "pool.journal"), header, region, clock=clock or time.monotonic
    )


def stored(writer: JournalWriter, rows: list[int]) -> None:
    writer.rows_reserved(rows)
    writer.rows_ready([f"k{row}".encode() for row in rows], rows)


def test_a_graceful_stop_holds_only_its_held_rows_each_until_its_own_time(tmp_path):
    writer = make_writer(tmp_path)
    writer.start([], [])
    writer.cover_leases(FENCE)
    stored(writer, [0, 1, 2, 3])
    writer.rows_reserved([4])  # a reservation in flight at the stop
    writer.close(drain_seconds=10, held={1: 2.0, 4: 1.0})
    replay = read_journal(writer.path, 1 << 20)
    assert replay.stopped is not None and set(replay.held) == {1, 4}
    holds = old_client_holds(replay, fallback_seconds=99.0)
    assert set(holds.seconds) == {1, 4}  # rows 0, 2, 3 (ready) are usable at once
    assert 1.5 < holds.seconds[1] <= 2.0 and 0.5 < holds.seconds[4] <= 1.0
    assert "graceful stop" in holds.why


def test_a_crash_holds_every_row_the_journal_names_until_its_last_horizon(tmp_path):
    writer = make_writer(tmp_path)
    writer.start([], [])
    writer.cover_leases(FENCE)
    stored(writer, [0, 1])
    writer.rows_reserved([5])
    writer.close(drain_seconds=10)  # no stop records: what a kill leaves
    replay = read_journal(writer.path, 1 << 20)
    assert replay.stopped is None and replay.horizon is not None
    holds = old_client_holds(replay, fallback_seconds=99.0)
    assert set(holds.seconds) == {0, 1, 5}  # rows never handed out are usable at once
    assert FENCE - 0.5 < holds.longest <= FENCE + HORIZON_SLACK_SECONDS
    assert "a crash" in holds.why


def test_records_after_a_stop_make_it_a_crash(tmp_path):
    """Only a journal whose last valid record is ``stopped`` ended gracefully: a stop
    followed by anything (a daemon that went on, a record appended later) is read as
    a crash, which holds every named row."""
    writer = make_writer(tmp_path)
    writer.start([], [])
    writer.cover_leases(FENCE)
    stored(writer, [0, 1])
    writer.close(drain_seconds=10, held={})
    with open(writer.path, "ab") as file:
        file.write(encode_instant(KIND_HELD, Instant.in_seconds(1.0), 0))
    replay = read_journal(writer.path, 1 << 20)
    assert replay.stopped is None and replay.held == {}
    assert set(old_client_holds(replay, 99.0).seconds) == {0, 1}
    with open(writer.path, "ab") as file:  # and a stop record again: graceful, nothing held
        file.write(encode_instant(KIND_STOPPED, Instant.in_seconds(0.0)))
    replay = read_journal(writer.path, 1 << 20)
    assert replay.stopped is not None and replay.held == {0: replay.held[0]}


def test_no_horizon_means_no_lease_was_granted_and_nothing_is_held(tmp_path):
    writer = make_writer(tmp_path)
    writer.start([], [])
    stored(writer, [0])  # (the daemon grants a lease before any row is handed out)
    writer.close(drain_seconds=10)
    assert old_client_holds(read_journal(writer.path, 1 << 20), 99.0).seconds == {}


def test_a_version_2_journal_holds_every_named_row_for_the_fallback(tmp_path):
    """A journal the previous release wrote (no liveness records) is still adopted:
    every row it names is held for the fallback (lease + write_quarantine, the
    longer of both daemons'), as that release held them."""
    header = JournalHeader("pool", BLOCK, ROWS, "layout", 1, 2, fence_seconds=FENCE)
    head = header.encode()[:-4]
    head = head[:8] + struct.pack("<I", 2) + head[12:]  # version 2
    path = tmp_path / "pool.journal"
    path.write_bytes(
        head + struct.pack("<I", zlib.crc32(head))
        + encode_freed(0) + encode_ready(b"k0", 0, 1234) + encode_freed(3)
    )  # fmt: skip
    replay = read_journal(str(path), 1 << 20)
    assert replay.header.version == 2
    holds = old_client_holds(replay, fallback_seconds=7.0)
    assert holds.seconds == {0: 7.0, 3: 7.0}


def test_the_horizon_is_written_ahead_at_most_once_per_slack_and_survives_compaction(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(journal_module, "COMPACT_SLACK_BYTES", 512)
    clock = FakeClock()
    writer = make_writer(tmp_path, clock=clock)
    writer.start([], [])
    before = writer.records_written
    for _ in range(100):  # renewals in a burst: one record covers them all
        writer.cover_leases(FENCE)
    assert writer.records_written == before + 1
    clock.advance(HORIZON_SLACK_SECONDS * 0.9)  # within the slack: still covered
    writer.cover_leases(FENCE)
    assert writer.records_written == before + 1
    clock.advance(HORIZON_SLACK_SECONDS * 0.2)  # past the slack: the next grant needs another
    writer.cover_leases(FENCE)
    assert writer.records_written == before + 2
    for round_ in range(40):  # rows stored again and again: the file outgrows its state
        stored(writer, list(range(ROWS)))
        # each round's records land before the rows go out again
        eventually(lambda n=(round_ + 1) * ROWS: writer.rows_journaled >= n, 10, "journaled")
    writer.close(drain_seconds=10)
    assert writer.compactions > 0
    replay = read_journal(writer.path, 1 << 20)
    assert replay.horizon is not None  # the compacted file keeps the last horizon
    assert FENCE - 1.5 < old_client_holds(replay, 99.0).longest <= FENCE + HORIZON_SLACK_SECONDS


def test_an_instant_reads_on_the_later_clock_capped_and_from_this_boot_only(monkeypatch):
    soon = Instant.in_seconds(2.0)
    assert 1.5 < soon.seconds_left(True, cap=10.0) <= 2.0
    assert soon.seconds_left(False, cap=10.0) == 0.0  # another boot: nothing survived
    # a wall clock stepped back an hour since: the monotonic reading is the lower one,
    # the later reading wins, but never past what the writer could have promised
    stepped = Instant(soon.monotonic_ns, soon.wall_ns + 3600 * 10**9)
    assert stepped.seconds_left(True, cap=3.1) == 3.1
    # a monotonic clock of another time namespace (offset back): the wall clock holds
    skewed = Instant(soon.monotonic_ns - 3600 * 10**9, soon.wall_ns)
    assert 1.5 < skewed.seconds_left(True, cap=10.0) <= 2.0
    past = Instant.in_seconds(-5.0)
    assert past.seconds_left(True, cap=10.0) == 0.0
    assert Instant.decode(soon.encode()) == soon


def test_another_boots_journal_holds_nothing(tmp_path):
    writer = make_writer(tmp_path, boot_id="an-earlier-boot")
    writer.start([], [])
    writer.cover_leases(FENCE)
    stored(writer, [0, 1])
    writer.close(drain_seconds=10)
    assert old_client_holds(read_journal(writer.path, 1 << 20), 99.0).seconds == {}


@pytest.mark.parametrize(("journal_boot", "same"), [("", True), ("x", False)])
def test_an_unknown_boot_id_counts_as_this_boot(monkeypatch, journal_boot, same):
    assert clock.same_boot(journal_boot) is same
    monkeypatch.setattr(clock, "current_boot_id", lambda: "")
    assert clock.same_boot("x") is True  # cannot tell: the cautious reading
