"""The fs tier attached to a real daemon: cascade, promotion, restart, corruption,
crash consistency, capacity, promotion failure. Real files, real process, real socket.

Payloads are a function of the key (``payload(key)``), so any byte served for a
key can be checked against what was stored under it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import (
    DaemonProcess,
    Exits,
    daemon_command,
    eventually,
    fs_tiers_config,
    running,
    start_daemon,
)
from engine_harness import (
    FILE_BYTES,
    HIT,
    MISS,
    PENDING,
    Engine,
    block_files,
    block_keys,
    file_of,
    payload,
)

from kvtierd.tiers import blockformat
from kvtierd.tiers.fs import fsformat
from kvtierd_client.client import Client
from kvtierd_client.errors import FailedPrecondition
from kvtierd_client.wire.proto import pb2


@pytest.fixture
def tiered(fs_root: Path) -> Iterator[DaemonProcess]:
    daemon = start_daemon("--memory-budget", "64MiB", config=fs_tiers_config(fs_root))
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_evicted_block_is_promoted_back_bit_exact(tiered, fs_root, pool_name):
    engine = Engine(tiered, pool_name, num_blocks=4)
    first, second = block_keys("a", 4), block_keys("b", 4)
    engine.store(first)
    engine.settle_cascades()
    assert len(block_files(fs_root)) == 4
    engine.store(second)  # evicts `first` from the primary
    engine.settle_cascades()
    engine.session.take_events()

    engine.session.prepare_load(second)  # pin `second`: the promotion must evict nothing
    assert engine.session.lookup(first[:2]) == [MISS, MISS]  # no row free: no room, MISS
    assert engine.tier_stats().promotion_no_room == 2
    engine.session.complete_load(second)

    assert engine.session.lookup(first) == [PENDING] * 4
    assert engine.session.lookup(first) in ([PENDING] * 4, [HIT] * 4)  # no second promotion
    assert engine.wait_settled(first) == [HIT] * 4
    assert engine.load(first) == [payload(k) for k in first]
    stats = engine.tier_stats()
    assert stats.promoted_blocks == 4 and stats.promotion_failures == 0
    assert stats.bytes_out == 4 * FILE_BYTES
    stored = [e for e in engine.session.take_events() if not e.removed]
    assert {k for e in stored for k in e.keys} == set(first)
    engine.close()


def test_restart_on_same_root_serves_blocks_bit_exact(fs_root, pool_name):
    keys = block_keys("warm", 6)
    config = fs_tiers_config(fs_root)
    first = start_daemon(config=config)
    try:
        engine = Engine(first, pool_name)
        engine.store(keys)
        engine.close()
        assert first.stop() == 0, first.log()  # shutdown lets the cascades finish
    finally:
        first.cleanup()
    assert len(block_files(fs_root)) == 6

    second = start_daemon(config=config)
    try:
        engine = Engine(second, pool_name)
        assert engine.wait_settled(keys) == [HIT] * 6
        assert engine.load(keys) == [payload(k) for k in keys]
        assert engine.tier_stats().ready
        engine.close()
        assert second.stop() == 0, second.log()
    finally:
        second.cleanup()


def _flip_payload_byte(path: Path, key: bytes, root: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(blockformat.HEADER_SIZE + 1234)
        byte = f.read(1)
        f.seek(blockformat.HEADER_SIZE + 1234)
        f.write(bytes([byte[0] ^ 0x01]))


def _truncate(path: Path, key: bytes, root: Path) -> None:
    os.truncate(path, FILE_BYTES - 100)


def _other_key(path: Path, key: bytes, root: Path) -> None:
    other = path.parent.parent.parent / fsformat.block_rel_path(b"c-1")
    shutil.copyfile(other, path)  # a valid file, but its header names another key


def _other_pool(path: Path, key: bytes, root: Path) -> None:
    (foreign,) = [p for p in block_files(root) if p.name == path.name and p != path]
    shutil.copyfile(foreign, path)  # same key, same size, another pool's fingerprint


@pytest.mark.parametrize(
    "corrupt",
    [_flip_payload_byte, _truncate, _other_key, _other_pool],
    ids=["flipped-byte", "truncated", "header-names-another-key", "another-pool"],
)
def test_corrupt_block_file_is_a_miss_and_removed(tiered, fs_root, pool_name, corrupt):
    engine = Engine(tiered, pool_name)
    other_pool = Engine(tiered, pool_name + "-other", layout="other-layout")
    keys = block_keys("c", 3)
    engine.store(keys)
    other_pool.store(keys)
    engine.settle_cascades()
    other_pool.settle_cascades()
    client = Client(tiered.address)
    assert client.flush_pool(pool_name) == 3
    victim = keys[0]
    mine = file_of(fs_root, pool_name, victim)
    assert mine.exists()
    corrupt(mine, victim, fs_root)

    assert engine.wait_settled(keys) == [MISS, HIT, HIT]
    assert not mine.exists(), "the corrupt file was not removed"
    stats = engine.tier_stats()
    assert stats.checksum_failures == 1 and stats.promotion_failures == 1
    assert engine.load(keys[1:]) == [payload(k) for k in keys[1:]]
    with pytest.raises(FailedPrecondition):
        engine.session.prepare_load([victim])  # never served
    assert engine.session.lookup([victim]) == [MISS]  # gone from the tier's index too
    assert f"removing corrupt block file {mine}" in tiered.log()
    for e in (engine, other_pool):
        e.close()
    client.close()


def test_deleted_file_promotion_fails_once_and_frees_its_row(tiered, fs_root, pool_name):
    engine = Engine(tiered, pool_name, num_blocks=4)
    keys = block_keys("d", 2)
    engine.store(keys)
    engine.settle_cascades()
    Client(tiered.address).flush_pool(pool_name)
    file_of(fs_root, pool_name, keys[0]).unlink()  # the index still lists it

    assert engine.session.lookup(keys) == [PENDING, PENDING]
    assert engine.wait_settled(keys) == [MISS, HIT]
    for _ in range(5):
        assert engine.session.lookup(keys[:1]) == [MISS]  # no retry loop
    stats = engine.client.get_stats(pool_name).pools[0]
    assert stats.tiers[1].promotion_failures == 1 and stats.tiers[1].promoted_blocks == 1
    assert stats.tiers[0].used_blocks == 1 and stats.tiers[0].pending_blocks == 0  # row freed
    engine.close()


def test_capacity_bounds_bytes_on_disk_least_recently_used_go_first(fs_root, pool_name):
    capacity = 1 << 20  # 15 block files of 68 KiB
    daemon = start_daemon(config=fs_tiers_config(fs_root, capacity="1MiB", admission="always"))
    try:
        engine = Engine(daemon, pool_name, num_blocks=16)  # room to promote all that fit
        keys = block_keys("cap", 40)
        for i in range(0, 40, 4):
            engine.store(keys[i : i + 4])
            engine.settle_cascades()
            on_disk = sum(p.stat().st_size for p in block_files(fs_root))
            assert on_disk <= capacity
        fits = capacity // FILE_BYTES
        assert len(block_files(fs_root)) == fits
        engine.client.flush_pool(pool_name)
        results = engine.wait_settled(keys)
        # the oldest went first (blocks of one job are written in parallel, so the
        # job at the boundary may lose any of its four)
        boundary = (40 - fits) // 4 * 4
        assert results[:boundary] == [MISS] * boundary
        assert results[boundary + 4 :] == [HIT] * (40 - boundary - 4)
        assert results.count(HIT) == fits
        stats = engine.tier_stats()
        assert stats.evictions == 40 - fits and stats.used_bytes <= capacity
        assert stats.capacity_bytes == capacity
        engine.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_tiers_consulted_in_order_and_promotion_fills_earlier_tiers(tmp_path, pool_name):
    near, far = tmp_path / "near", tmp_path / "far"
    near.mkdir()
    far.mkdir()
    config = fs_tiers_config(near, far)
    keys = block_keys("two", 3)
    daemon = start_daemon(config=config)
    try:
        engine = Engine(daemon, pool_name)
        engine.store(keys)
        engine.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
    assert len(block_files(near)) == 3 and len(block_files(far)) == 3
    shutil.rmtree(near)  # the local disk was replaced; the shared filesystem kept them
    near.mkdir()

    daemon = start_daemon(config=config)
    try:
        engine = Engine(daemon, pool_name)
        assert engine.wait_settled(keys) == [HIT] * 3
        assert engine.load(keys) == [payload(k) for k in keys]
        tiers = engine.client.get_stats(pool_name).pools[0].tiers
        assert [t.tier for t in tiers] == ["primary", "fs0", "fs1"]
        assert tiers[1].promoted_blocks == 0 and tiers[2].promoted_blocks == 3
        engine.settle_cascades()
        assert len(block_files(near)) == 3  # promoted from far, cascaded to near
        engine.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def _children(pid: int) -> list[int]:
    """Process ids of ``pid``'s children (every thread's), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return found


def test_sigkill_during_cascade_storm_leaves_a_clean_root(fs_root, pool_name):
    config = fs_tiers_config(fs_root, write_threads=4)
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    stored: list[bytes] = []
    stop = threading.Event()

    def storm() -> None:
        engine = Engine(daemon, pool_name, num_blocks=64)
        i = 0
        try:
            while not stop.is_set():
                keys = block_keys("storm", i + 8)[i:]
                engine.store(keys, retry_for=10.0)
                stored.extend(keys)
                i += 8
        except Exception:  # the daemon was killed under us
            return

    worker = threading.Thread(target=storm)
    worker.start()
    try:
        eventually(lambda: len(block_files(fs_root)) >= 40, 30, "40 block files written")
        io_workers = _children(daemon.proc.pid)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
    finally:
        stop.set()
        worker.join()
        daemon.cleanup()
    assert len(block_files(fs_root)) >= 40
    # the I/O worker processes die with the daemon: none finishes a write behind
    # the back of the restarted daemon's scan
    assert io_workers, "the storm ran no block I/O in worker processes"
    eventually(
        lambda: not running(io_workers), 30.0, "the I/O workers exit with the daemon",
        wake=Exits(*io_workers),
    )  # fmt: skip

    fsck = subprocess.run(
        daemon_command("fsck", "--quiet", str(fs_root)), capture_output=True, text=True
    )
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    assert "0 bad" in fsck.stdout

    restarted = start_daemon(config=config)
    try:
        engine = Engine(restarted, pool_name, num_blocks=64)
        results = engine.wait_settled(stored[:1])  # waits for the index scan
        assert not list(fs_root.rglob("*" + fsformat.TEMP_SUFFIX)), "temp files survived"
        on_disk = {bytes.fromhex(p.name.split(".")[0]) for p in block_files(fs_root)}
        for key in sorted(on_disk)[:48]:
            results = engine.wait_settled([key])
            assert results == [HIT], key
            assert engine.load([key]) == [payload(key)]
            engine.client.flush_pool(pool_name)
        engine.close()
        assert restarted.stop() == 0
    finally:
        restarted.cleanup()


def test_embedded_default_has_an_fs_tier_under_the_state_directory(pool_name):
    daemon = start_daemon(config=None)  # no --config: the embedded default
    try:
        engine = Engine(daemon, pool_name)
        engine.store(block_keys("default", 2))
        engine.settle_cascades()
        tiers = engine.client.get_stats(pool_name).pools[0].tiers
        assert [t.tier for t in tiers] == ["primary", "fs"]
        assert tiers[1].used_blocks == 2 and tiers[1].capacity_bytes == 10 << 30
        assert len(block_files(Path(daemon.workdir) / "fs")) == 2
        engine.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_fsck_reports_and_removes_bad_files(tiered, fs_root, pool_name):
    engine = Engine(tiered, pool_name)
    keys = block_keys("f", 3)
    engine.store(keys)
    engine.settle_cascades()
    engine.close()
    bad = file_of(fs_root, pool_name, keys[1])
    _flip_payload_byte(bad, keys[1], fs_root)

    def fsck(*args: str) -> subprocess.CompletedProcess[str]:
        command = [str(Path(daemon_command()[0]).parent / "kvtierctl"), "fsck", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    report = fsck(str(fs_root))
    assert report.returncode == 1
    assert f"BAD {bad}: payload checksum mismatch" in report.stdout
    assert "3 block files in 1 pool checked: 1 bad" in report.stdout
    assert bad.exists()
    assert fsck("--remove", str(fs_root)).returncode == 1
    assert not bad.exists()
    clean = fsck(str(fs_root))
    assert clean.returncode == 0 and "2 block files in 1 pool checked: 0 bad" in clean.stdout
    missing = fsck(str(fs_root / "nope"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def test_prefix_lookup_stops_at_the_first_miss(tiered, fs_root, pool_name):
    engine = Engine(tiered, pool_name, num_blocks=8)
    chain = block_keys("chain", 4)
    engine.store(chain)
    engine.settle_cascades()
    engine.client.flush_pool(pool_name)
    missing = block_keys("never", 1)  # the chain breaks at its second block
    results = engine.session.lookup([chain[0], *missing, chain[2], chain[3]], prefix=True)
    assert results == [PENDING, MISS, MISS, MISS]
    engine.settle_cascades()
    stats = engine.tier_stats()
    assert stats.promoted_blocks == 1  # chain[2], chain[3] were not read from disk
    engine.close()


def test_tier_events_report_cascades_evictions_and_bad_files(fs_root, pool_name):
    """A cascade job's keys come out as a stored event of the fs tier (medium
    STORAGE); an eviction as a removed event before the stored event of the job
    that made room; a file failing verification as a removed event."""
    daemon = start_daemon(config=fs_tiers_config(fs_root, capacity="1MiB"))  # 15 files
    try:
        engine = Engine(daemon, pool_name, num_blocks=16)
        first, second = block_keys("ev-a", 14), block_keys("ev-b", 2)
        engine.store(first)
        engine.settle_cascades()
        engine.store(second)
        engine.settle_cascades()
        tier = [e for e in engine.session.take_events() if e.tier == "fs0"]
        assert [(e.removed, len(e.keys)) for e in tier] == [(False, 14), (True, 1), (False, 2)]
        assert all(e.medium == pb2.MEDIUM_STORAGE for e in tier)
        assert set(tier[0].keys) == set(first) and set(tier[2].keys) == set(second)
        evicted = tier[1].keys[0]
        assert evicted in first and not file_of(fs_root, pool_name, evicted).exists()

        kept = next(k for k in first if k != evicted)
        _flip_payload_byte(file_of(fs_root, pool_name, kept), kept, fs_root)
        engine.client.flush_pool(pool_name)
        assert engine.wait_settled([kept]) == [MISS]
        tier = [e for e in engine.session.take_events() if e.tier == "fs0"]
        assert [(e.removed, list(e.keys)) for e in tier] == [(True, [kept])]
        engine.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
