"""Warm restart (issue #20): a restarted daemon adopts the ready blocks of the
region file its predecessor left, bit-exact, in the same inode, with no other
tier configured; anything it cannot prove (in-flight writes, modified rows, a
changed pool, a torn or foreign journal) is dropped or starts the pool cold."""

from __future__ import annotations

import os
import signal
import struct
import time
from pathlib import Path

import pytest
from daemon_harness import eventually, start_daemon
from warm_harness import (
    BLOCK,
    BLOCKS,
    HIT,
    MISS,
    StormWriters,
    assert_bit_exact,
    content,
    cpu_hogs,
    journal_of,
    read_row,
    resident_after,
    restart,
    store,
    write_rows,
)

from kvtierd_client.client import Client


def test_sigterm_restart_serves_ready_blocks_bit_exact_from_the_same_inode():
    """A graceful restart adopts every ready block in the same inode, and holds only
    what the old session held at the stop -- the block a copier of it was loading
    and the row a writer of it was filling -- until that session's lease (10 s)
    and write_quarantine (1 s) run out, counted from the stop: every other adopted
    block is evictable at once, and the held ones come back after."""
    daemon = start_daemon("--lease", "10s", "--write-quarantine", "1s")
    daemons = [daemon]
    old = Client(daemon.address)
    try:
        keys = [f"ready-{i}".encode() for i in range(20)]
        session = old.open_session(
            "warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1", keepalive=False
        )
        region = session.region
        rows = store(session, keys)
        (loading,) = session.prepare_load(keys[:1])  # a copier of the old session loads ...
        in_flight = session.prepare_store([b"in-flight"])  # ... and a writer copies
        assert in_flight is not None
        write_rows(region.path, {in_flight.block_ids[0]: content(b"in-flight")})
        inode = os.stat(region.path).st_ino
        assert inode == region.st_ino
        daemon = restart(daemon)  # SIGTERM under both
        daemons.append(daemon)
        assert os.stat(region.path).st_ino == inode  # the file clients mapped is kept
        with Client(daemon.address) as client:
            new = client.open_session("warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1")
            assert new.region.path == region.path
            assert (new.region.st_dev, new.region.st_ino) == (region.st_dev, region.st_ino)
            assert new.lookup(keys) == [HIT] * len(keys)  # no promotion: no other tier
            assert new.lookup([b"in-flight"]) == [MISS]  # its write was never completed
            assert new.prepare_load(keys) == [rows[key] for key in keys]  # same rows
            new.complete_load(keys)
            assert_bit_exact(new, keys)
            (stats,) = client.get_stats("warm").pools
            assert (stats.warm_adopted_blocks, stats.warm_dropped_blocks) == (20, 0)
            assert stats.journal_bytes > 0
            assert (stats.tiers[0].pinned_blocks, stats.tiers[0].quarantined_blocks) == (1, 1)
            # every row but the two held ones: the free rows and 19 adopted blocks
            room = BLOCKS - 2
            assert new.prepare_store([f"new-{i}".encode() for i in range(room + 1)]) is None
            grant = new.prepare_store([f"new-{i}".encode() for i in range(room)])
            assert grant is not None and sorted(grant.evicted_keys) == sorted(keys[1:])
            assert {loading, in_flight.block_ids[0]}.isdisjoint(grant.block_ids)
            new.complete_store(grant.keys_to_store, success=False)
            assert read_row(region.path, loading) == content(keys[0])  # the old copier's row
            # once the old session's lease and write fence have passed, both come back
            eventually(
                lambda: client.get_stats("warm").pools[0].tiers[0].quarantined_blocks == 0,
                30, "the reserved row released",
            )  # fmt: skip
            eventually(
                lambda: client.get_stats("warm").pools[0].tiers[0].pinned_blocks == 0,
                30, "the loaded block's hold released",
            )  # fmt: skip
            grant = new.prepare_store([f"later-{i}".encode() for i in range(BLOCKS)])
            assert grant is not None and in_flight.block_ids[0] in grant.block_ids
        assert "warm restart adopted 20 ready blocks" in daemon.log()
        assert "a graceful stop: 2 rows its clients may still touch" in daemon.log()
    finally:
        old.close()
        for each in daemons:
            each.stop(signal.SIGKILL)
        daemons[-1].cleanup()


def test_sigkill_storm_of_writers_never_serves_a_reservation(warm_daemon, tmp_path):
    """Three client processes store as fast as they can (each block's bytes derived
    from its key) while a busy loop takes every core; each also fills reservations
    with garbage and never completes them (the first few stay reserved, the later
    ones are aborted). SIGKILL mid-storm, restart: every HIT is bit-exact, no
    abandoned reservation is served, and every block completed more than
    memory.warm_restart_max_lag (1 s) before the kill that the storm did not evict
    since is adopted. (With the hash worker niced, a hog on every core left it no
    CPU: the journal fell seconds behind, and a kill adopted 0 of 6,384 stored rows.)"""
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:  # creates the pool before the storm
        session = client.open_session(
            "storm", block_bytes=STORM_BLOCK, num_blocks=STORM_ROWS, layout="s"
        )
        session.close()
    with cpu_hogs():
        writers = StormWriters(daemon, "storm", STORM_ROWS, tmp_path, block=STORM_BLOCK)
        try:
            eventually(lambda: writers.each_completed(50), 60, "the writers got going")
            time.sleep(STORM_SECONDS)  # the storm runs well past the lag bound
            kill = time.monotonic()
            daemon.stop(signal.SIGKILL)
        finally:
            writers.stop()
    completed, abandoned = writers.completed(), writers.abandoned()
    expected = resident_after(completed, STORM_ROWS, kill, age=1.0)
    assert len(expected) >= 100 and abandoned, (len(expected), len(completed))

    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session(
            "storm", block_bytes=STORM_BLOCK, num_blocks=STORM_ROWS, layout="s"
        )
        assert session.lookup(abandoned) == [MISS] * len(abandoned)
        keys = [c.key for c in completed]
        results = session.lookup(keys)
        hits = [key for key, result in zip(keys, results, strict=True) if result is HIT]
        assert_bit_exact(session, hits, STORM_BLOCK)
        adopted = set(hits)
        lost = [key for key in expected if key not in adopted]
        # a completion the kill overtook may be lost (its ready record not yet
        # written), never served wrong; one older than the lag bound is never lost
        assert not lost, (len(lost), len(expected), len(hits), len(completed), lost[:3])


# a pool whose rows outlive the lag bound many times over at the storm's rate
STORM_ROWS = 16384
STORM_BLOCK = 4096
STORM_SECONDS = 3.0


def test_row_modified_while_down_is_dropped(warm_daemon):
    daemon = warm_daemon[0]
    keys = [f"k{i}".encode() for i in range(6)]
    with Client(daemon.address) as client:
        session = client.open_session("mod", block_bytes=BLOCK, num_blocks=BLOCKS)
        rows = store(session, keys)
        path = session.region.path
    daemon.stop()
    with open(path, "r+b") as file:  # one byte of one row changes while nobody runs
        file.seek(rows[b"k3"] * BLOCK + 100)
        file.write(bytes([content(b"k3")[100] ^ 1]))
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("mod", block_bytes=BLOCK, num_blocks=BLOCKS)
        intact = [key for key in keys if key != b"k3"]
        assert session.lookup(keys) == [MISS if key == b"k3" else HIT for key in keys]
        assert_bit_exact(session, intact)
        (stats,) = client.get_stats("mod").pools
        assert (stats.warm_adopted_blocks, stats.warm_dropped_blocks) == (5, 1)
    assert "5 ready blocks" in daemon.log() and "1 dropped: checksum mismatch" in daemon.log()


def test_changed_block_size_starts_cold_with_one_log_line(warm_daemon):
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("resized", block_bytes=BLOCK, num_blocks=BLOCKS)
        store(session, [b"a", b"b"])
        old = session.region
    daemon = restart(daemon)
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("resized", block_bytes=2 * BLOCK, num_blocks=BLOCKS)
        assert session.lookup([b"a", b"b"]) == [MISS, MISS]
        assert session.region.st_ino != old.st_ino  # a new file
        store(session, [b"c"], 2 * BLOCK)
    lines = [line for line in daemon.log().splitlines() if "starting cold" in line]
    assert len(lines) == 1, lines
    assert "block_bytes changed from 8192 to 16384" in lines[0]
    # the next restart adopts the new geometry
    daemon = restart(daemon)
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("resized", block_bytes=2 * BLOCK, num_blocks=BLOCKS)
        assert session.lookup([b"c"]) == [HIT]
        assert_bit_exact(session, [b"c"], 2 * BLOCK)


def test_torn_last_record_is_ignored(warm_daemon):
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("torn", block_bytes=BLOCK, num_blocks=BLOCKS)
        store(session, [b"first", b"second"])
        path = session.region.path
    daemon.stop()
    journal = journal_of(path)
    data = journal.read_bytes()
    # ready(second) is the last record before the stop records: cut it in the
    # middle, as a crash during that append would (nothing after it)
    record = 15 + len(b"second") + 4
    start = data.rindex(b"second") - 15
    journal.write_bytes(data[: start + record - record // 2])
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("torn", block_bytes=BLOCK, num_blocks=BLOCKS)
        assert session.lookup([b"first", b"second"]) == [HIT, MISS]
        assert_bit_exact(session, [b"first"])
    assert f"{record - record // 2} torn journal bytes ignored" in daemon.log()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[:8] + struct.pack("<I", 99) + data[12:], "format version 99"),
        (lambda data: data[:20] + bytes([data[20] ^ 1]) + data[21:], "header checksum mismatch"),
    ],
    ids=["other-version", "corrupt-header"],
)
def test_foreign_journal_starts_the_pool_cold(warm_daemon, damage, reason):
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("foreign", block_bytes=BLOCK, num_blocks=BLOCKS)
        store(session, [b"x"])
        path = session.region.path
    daemon.stop()
    journal = journal_of(path)
    journal.write_bytes(damage(journal.read_bytes()))
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("foreign", block_bytes=BLOCK, num_blocks=BLOCKS)
        assert session.lookup([b"x"]) == [MISS]
    lines = [line for line in daemon.log().splitlines() if "starting cold" in line]
    assert len(lines) == 1 and reason in lines[0], lines


def test_region_replaced_while_down_starts_cold(warm_daemon):
    """Same bytes, another file: the journal vouches for the inode it described only."""
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("replaced", block_bytes=BLOCK, num_blocks=BLOCKS)
        store(session, [b"r"])
        path = session.region.path
    daemon.stop()
    copy = path + ".copy"
    with open(path, "rb") as source, open(copy, "wb") as target:
        target.write(source.read())
    os.replace(copy, path)
    daemon = daemon.restart()
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("replaced", block_bytes=BLOCK, num_blocks=BLOCKS)
        assert session.lookup([b"r"]) == [MISS]
    lines = [line for line in daemon.log().splitlines() if "starting cold" in line]
    assert len(lines) == 1 and "it was replaced" in lines[0], lines


def test_warm_restart_off_is_cold_as_before():
    daemon = start_daemon("--warm-restart", "false")
    try:
        with Client(daemon.address) as client:
            session = client.open_session("cold", block_bytes=BLOCK, num_blocks=BLOCKS)
            store(session, [b"gone"])
            path = session.region.path
        daemon.stop()
        assert not os.path.exists(path)  # unlinked at stop, as before
        assert not journal_of(path).exists()
        daemon = daemon.restart()
        with Client(daemon.address) as client:
            session = client.open_session("cold", block_bytes=BLOCK, num_blocks=BLOCKS)
            assert session.lookup([b"gone"]) == [MISS]
    finally:
        daemon.stop()
        daemon.cleanup()


def test_systemd_unit_keeps_the_shm_files_across_a_restart():
    unit = (Path(__file__).resolve().parents[4] / "deploy/systemd/kvtierd.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and line[0] != "#"
    )
    assert settings.get("RemoveIPC") == "no"  # yes would delete /dev/shm files at stop
    assert "DynamicUser" not in settings  # implies RemoveIPC=yes
    assert "/dev/shm" in settings["ReadWritePaths"]


def test_a_flushed_block_does_not_come_back(warm_daemon):
    daemon = warm_daemon[0]
    with Client(daemon.address) as client:
        session = client.open_session("flushed", block_bytes=BLOCK, num_blocks=BLOCKS)
        store(session, [b"f"])
        assert client.flush_pool("flushed") == 1
        store(session, [b"kept"])
    daemon = restart(daemon)
    warm_daemon.append(daemon)
    with Client(daemon.address) as client:
        session = client.open_session("flushed", block_bytes=BLOCK, num_blocks=BLOCKS)
        assert session.lookup([b"f", b"kept"]) == [MISS, HIT]
