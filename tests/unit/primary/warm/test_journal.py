"""The warm-restart journal (kvtierd.primary.warm.journal) on real files: what it records,
that a replay gives back exactly the live state (after compactions too), that
a row handed out again is never recorded ready with an old checksum, that a
record's checksum is bound to its key, row and pool, that damage in the middle
of a journal is told from a last write cut short, and that a failing file or
thread turns the journal off instead of lying or hanging; and
PrimaryManager.adopt."""

from __future__ import annotations

import os
import time

import pytest
from daemon_harness import eventually

from kvtierd.primary.manager import PrimaryManager
from kvtierd.primary.warm import journal as journal_module
from kvtierd.primary.warm.journal import JournalWriter
from kvtierd.primary.warm.journalformat import (
    JournalError,
    JournalHeader,
    bind_checksum,
    encode_freed,
    encode_ready,
    read_journal,
)
from kvtierd.primary.warm.rowsums import checksum_spans, row_checksum

BLOCK = 4096
ROWS = 32


def make_writer(tmp_path, rows: int = ROWS) -> tuple[JournalWriter, bytearray]:
    region = bytearray(rows * BLOCK)
    header = JournalHeader("pool", BLOCK, rows, "layout", 1, 2)
    writer = JournalWriter(str(tmp_path / "pool.journal"), header, memoryview(region))
    return writer, region


def fill(region: bytearray, row: int, value: int) -> None:
    region[row * BLOCK : (row + 1) * BLOCK] = bytes([value]) * BLOCK


def bound(writer: JournalWriter, key: bytes, row: int, value: int) -> int:
    """The checksum a ready record of ``key`` in ``row`` filled with ``value`` holds."""
    content = row_checksum(bytes([value]) * BLOCK)
    return bind_checksum(content, key, row, writer.header.binding_seed())


def test_replay_gives_the_ready_rows_with_their_checksums(tmp_path):
    writer, region = make_writer(tmp_path)
    writer.start([], [])
    writer.rows_reserved([0, 1, 2])
    for row in (0, 1, 2):
        fill(region, row, row + 1)
    writer.rows_ready([b"a", b"b"], [0, 1])  # row 2 stays in flight
    writer.close(drain_seconds=10)
    replay = read_journal(writer.path, 1 << 20)
    assert replay.header == writer.header
    assert replay.ready == {
        0: (b"a", bound(writer, b"a", 0, 1)),
        1: (b"b", bound(writer, b"b", 1, 2)),
    }
    assert replay.freed == {2}
    assert replay.torn_bytes == 0


def test_a_row_handed_out_again_is_never_recorded_with_its_old_key(tmp_path):
    writer, region = make_writer(tmp_path)
    writer.start([], [])
    writer.rows_reserved([5])
    generation = writer._generation[5]
    writer.rows_reserved([5])  # evicted and handed to another writer meanwhile
    writer._pending_jobs += 1
    writer._record_ready([(generation, 5, b"old")], [123])  # the old completion's hash
    writer.close(drain_seconds=10)
    replay = read_journal(writer.path, 1 << 20)
    assert replay.ready == {} and replay.freed == {5}


def test_a_backlog_is_hashed_newest_first_and_rows_handed_out_meanwhile_are_skipped(tmp_path):
    """A backlog of 12 completions, hashed 4 rows at a time: the newest chunk first
    (eviction takes the oldest blocks first), and a row handed out while an earlier
    chunk was hashed is not hashed at all (nor recorded); the records keep the
    completion order, and every completion is accounted for."""
    writer, region = make_writer(tmp_path)
    writer._checksums.rows_per_chunk = 4
    real_compute = writer._checksums.compute
    asked: list[list[int]] = []

    def compute(rows):  # the real hashing, watched; the loop hands row 1 out meanwhile
        asked.append(list(rows))
        if len(asked) == 1:
            writer.rows_reserved([1])
        return real_compute(rows)

    writer._checksums.compute = compute
    writer.rows_reserved(list(range(12)))
    for row in range(12):
        fill(region, row, row + 1)
    writer.start([], [])
    writer.rows_ready([b"k%d" % row for row in range(12)], list(range(12)))
    writer.close(drain_seconds=10)
    assert asked == [[8, 9, 10, 11], [4, 5, 6, 7], [0, 2, 3]]
    replay = read_journal(writer.path, 1 << 20)
    assert list(replay.ready) == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # completion order
    assert replay.ready[2] == (b"k2", bound(writer, b"k2", 2, 3))
    assert replay.freed == {1}
    assert (writer.rows_journaled, writer.hash_jobs_stale) == (11, 1)


def test_compaction_keeps_the_live_state_and_bounds_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "COMPACT_SLACK_BYTES", 2048)
    writer, region = make_writer(tmp_path)
    writer.start([], [])
    expected: dict[int, bytes] = {}
    for round_ in range(60):  # every row is stored again and again
        rows = [(round_ * 7 + i) % ROWS for i in range(5)]
        writer.rows_reserved(rows)
        keys = [f"k{round_}-{i}".encode() for i in range(5)]
        for row in rows:
            fill(region, row, round_ % 251)
        writer.rows_ready(keys, rows)
        expected.update(zip(rows, keys, strict=True))
        with writer._idle:  # let the worker catch up: each round's records land
            writer._idle.wait_for(lambda: writer._pending_jobs == 0, timeout=10)
    writer.close(drain_seconds=10)
    assert writer.compactions >= 2
    replay = read_journal(writer.path, 1 << 20)
    assert {row: key for row, (key, _) in replay.ready.items()} == expected
    assert os.path.getsize(writer.path) <= 2 * 60 * ROWS + 2048 + 4096
    assert [name for name in os.listdir(tmp_path) if ".tmp" in name] == []


def test_a_torn_record_ends_the_replay(tmp_path):
    writer, region = make_writer(tmp_path)
    writer.start([], [])
    writer.rows_reserved([0, 1])
    writer.rows_ready([b"first"], [0])
    writer.close(drain_seconds=10)
    with open(writer.path, "ab") as file:
        file.write(encode_freed(1)[:-3])  # a write cut short by a crash
    replay = read_journal(writer.path, 1 << 20)
    assert set(replay.ready) == {0} and replay.torn_bytes == len(encode_freed(1)) - 3
    assert replay.damaged_at is None  # what a crash leaves: not damage


@pytest.mark.parametrize(
    "damage", ["bad CRC, then more records", "bad CRC at the end", "no record head"]
)
def test_damage_in_the_middle_is_told_from_a_last_write_cut_short(tmp_path, damage):
    """Issue #29, finding 7: a record that is complete but fails its CRC, or bytes
    that are no record, are not what a kill during an append leaves: the replay
    reports where (the adoption then logs a WARNING), and still stops there."""
    writer, region = make_writer(tmp_path)
    writer.start([], [])
    writer.close(drain_seconds=10)
    good = encode_ready(b"key", 0, 7)
    bad = bytearray(encode_ready(b"other", 1, 8))
    bad[-1] ^= 0xFF
    after = {
        "bad CRC, then more records": good + bytes(bad) + good,
        "bad CRC at the end": good + bytes(bad),
        "no record head": good + b"\x09garbage that is no record",
    }[damage]
    start = os.path.getsize(writer.path)
    with open(writer.path, "ab") as file:
        file.write(after)
    replay = read_journal(writer.path, 1 << 20)
    assert replay.ready == {0: (b"key", 7)} and replay.records == 1
    assert replay.damaged_at == start + len(good)


def test_a_failing_file_turns_the_journal_off_and_removes_it(tmp_path, caplog):
    writer, region = make_writer(tmp_path)
    writer.start([], [])
    os.close(writer._fd)  # the next write fails (EBADF), as a full tmpfs would
    writer._fd = os.open(os.devnull, os.O_RDONLY)
    writer.rows_reserved([3])
    assert writer.failed and not os.path.exists(writer.path)
    assert "warm restart is off for pool pool" in caplog.text
    writer.rows_reserved([4])  # nothing more is written, nothing raises
    writer.close(drain_seconds=10)
    with pytest.raises(FileNotFoundError):
        read_journal(writer.path, 1 << 20)


def test_a_thread_failure_turns_the_journal_off_with_one_line_and_close_stays_prompt(
    tmp_path, caplog
):
    """Anything unforeseen on the journal's thread (here: the hashing raises, a
    fault injected for want of a real one) used to be able to end the thread:
    warm restart was then silently off and the stop waited its 10 s drain. Now
    the journal turns off with one ERROR line, drops its backlog and the thread
    goes on serving the stop."""
    writer, region = make_writer(tmp_path)

    def broken(rows):
        raise RuntimeError("injected")

    writer._checksums.compute = broken
    writer.start([], [])
    writer.rows_reserved([0])
    writer.rows_ready([b"a"], [0])
    eventually(lambda: writer.failed, 10, "the journal turned off")
    assert not os.path.exists(writer.path)
    writer.rows_ready([b"b"], [1])  # nothing queued any more
    started = time.monotonic()
    writer.close(drain_seconds=10)
    assert time.monotonic() - started < 5.0  # not the 10 s drain: nothing is queued
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "injected" in errors[0].getMessage(), caplog.text
    assert "warm restart is off for pool pool" in errors[0].getMessage()


def test_a_record_verifies_only_with_its_own_key_row_and_pool(tmp_path):
    """Issue #29, finding 5: the checksum of a ready record covers the key, the
    row and the pool's fingerprint (it covered the row's bytes alone: swapping two
    records' keys and recomputing their CRCs made each key serve the other's
    bytes)."""
    writer, _ = make_writer(tmp_path)
    header, seed = writer.header, writer.header.binding_seed()
    content = row_checksum(bytes([1]) * BLOCK)
    value = bind_checksum(content, b"a", 0, seed)
    assert value != bind_checksum(content, b"b", 0, seed)
    assert value != bind_checksum(content, b"a", 1, seed)
    for other in (
        JournalHeader("other", BLOCK, ROWS, "layout", 1, 2),
        JournalHeader("pool", BLOCK, ROWS, "layout2", 1, 2),
        JournalHeader("pool", BLOCK, ROWS, "layout", 1, 3),  # another region file
    ):
        assert bind_checksum(content, b"a", 0, other.binding_seed()) != value
    # what is not part of the fingerprint leaves it alone
    same = JournalHeader("pool", BLOCK, ROWS, "layout", 1, 2, fence_seconds=9.0)
    assert same.binding_seed() == header.binding_seed()


def test_another_format_version_is_refused(tmp_path):
    """Version 1 (checksums of the rows' bytes alone) is read as another version:
    the pool starts cold once, with one line."""
    writer, _ = make_writer(tmp_path)
    writer.start([], [])
    writer.close(drain_seconds=10)
    path = tmp_path / "pool.journal"
    data = bytearray(path.read_bytes())
    data[8] = 1
    path.write_bytes(data)
    with pytest.raises(JournalError, match="format version 1; this kvtierd reads versions 2, 3"):
        read_journal(writer.path, 1 << 20)


def test_adopt_pins_held_blocks_until_their_time_and_fences_held_rows():
    """Held adopted blocks are pinned (HIT, not evictable) until their own time, a
    held row without a block is quarantined until its own, and everything else is
    usable at once: an adopted block nobody holds is evicted before a held one."""
    manager = PrimaryManager(8)
    held = {2: 10.0, 3: 12.0}  # b's row until 10, row 3 (a reservation) until 12
    manager.adopt([(b"a", 5), (b"b", 2), (b"z", 6)], held)
    manager.check_invariants()
    assert manager.block_id(b"a") == 5 and manager.ref_count(b"b") == 1  # its adoption pin
    assert manager.ref_count(b"a") == 0 and manager.ref_count(b"z") == 0  # evictable at once
    stats = manager.statistics()
    assert (stats.used_blocks, stats.free_blocks, stats.quarantined_blocks) == (3, 4, 1)
    assert (stats.pinned_blocks, manager.adoption_pins) == (1, 1)
    assert manager.held_rows() == held
    grant = manager.prepare_store([b"c", b"d", b"e", b"f", b"g", b"h"])
    assert grant is not None and sorted(grant.block_ids) == [0, 1, 4, 5, 6, 7]
    assert grant.evicted_keys == [b"a", b"z"]  # the unheld adopted blocks, oldest first
    assert manager.prepare_store([b"i"]) is None  # b is pinned, row 3 fenced
    assert manager.release_quarantine(9.9) == 0
    assert manager.release_quarantine(10.0) == 0  # b's pin goes; row 3 is held longer
    assert manager.adoption_pins == 0 and manager.ref_count(b"b") == 0
    assert manager.held_rows() == {3: 12.0}
    manager.check_invariants()
    assert manager.release_quarantine(12.0) == 1
    manager.check_invariants()
    with pytest.raises(ValueError, match="named twice"):
        PrimaryManager(4).adopt([(b"a", 1), (b"b", 1)], {})
    with pytest.raises(ValueError, match="outside the region"):
        PrimaryManager(4).adopt([(b"a", 1)], {4: 1.0})


def test_checksum_spans_cover_whole_small_rows_and_sample_big_ones():
    assert checksum_spans(8192, 64 << 10) == [(0, 8192)]
    assert checksum_spans(1 << 20, 0) == [(0, 1 << 20)]
    spans = checksum_spans(1 << 20, 64 << 10)  # 16 of 256 pages
    assert len(spans) == 16 and spans[0] == (0, 4096) and spans[-1] == ((1 << 20) - 4096, 1 << 20)
    assert all(end - start == 4096 for start, end in spans)
    row = bytearray(1 << 20)
    before = row_checksum(row, spans)
    row[spans[5][0] + 7] ^= 1  # a sampled page changes: detected
    assert row_checksum(row, spans) != before
    assert row_checksum(bytes(8192), [(0, 8192)]) == row_checksum(bytes(8192))


@pytest.mark.parametrize("path", ["hash-worker", "process_vm_readv", "pread-fallback"])
def test_the_daemon_path_hashes_the_region_file_the_same_way(tmp_path, monkeypatch, path):
    """With the region's descriptor (the daemon), rows are hashed by a hash worker
    process in place from its own mapping; without one, copied out with
    process_vm_readv (never SIGBUS on a truncated file); where a seccomp profile
    refuses that (Docker without CAP_SYS_PTRACE: the container test found every row
    left unjournaled) the writer falls back to one pread per row. All record the
    checksums hashing in place would, and a row past a truncation is not vouched for."""
    import errno
    import mmap

    from kvtierd.primary import safecopy

    if path == "pread-fallback":

        def refuse(base, ranges, into):
            raise OSError(errno.EPERM, "process_vm_readv: Operation not permitted")

        monkeypatch.setattr(safecopy, "gather", refuse)
    region_path = tmp_path / "pool.region"
    with open(region_path, "w+b") as file:
        file.truncate(ROWS * BLOCK)
        mapping = mmap.mmap(file.fileno(), ROWS * BLOCK)
        region = memoryview(mapping)
        header = JournalHeader("pool", BLOCK, ROWS, "layout", 1, 2)
        writer = JournalWriter(
            str(tmp_path / "pool.journal"), header, region, file.fileno(),
            hash_worker=path == "hash-worker",
        )  # fmt: skip
        writer.start([], [])
        writer.rows_reserved([0, 1, 30])
        for row in (0, 1, 30):
            region[row * BLOCK : (row + 1) * BLOCK] = bytes([row + 1]) * BLOCK
        file.truncate(4 * BLOCK)  # a client cuts the file under row 30
        writer.rows_ready([b"a", b"b", b"c"], [0, 1, 30])
        writer.close(drain_seconds=10)
        replay = read_journal(writer.path, 1 << 20)
        assert replay.ready == {
            0: (b"a", bound(writer, b"a", 0, 1)),
            1: (b"b", bound(writer, b"b", 1, 2)),
        }
        assert writer.hash_workers_started == (1 if path == "hash-worker" else 0)
        region.release()
        mapping.close()
