"""Two daemons on one fs root with ``shared = true`` (docs/guides/fleet.md, "Shared fs root").

Two "nodes" here are two real kvtierd processes with their own shm dirs, sockets
and pools, pointed at one root directory; the test talks to each over its own
socket and looks at the files under the root. Payloads are a function of the key
(``payload(key)``), so any byte served for a key is checked against what was
stored under it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, eventually, free_port, fs_tiers_config, start_daemon
from engine_harness import (
    BLOCK,
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

LONG = "60s"  # a rescan interval no test waits for: what it checks comes from lookups


def shared_config(root: Path, wait: str = "", **options: object) -> str:
    """A shared root's tier; ``wait``: ``limits.remote_lookup_wait`` ("": its default)."""
    limits = f'[limits]\nremote_lookup_wait = "{wait}"\n' if wait else ""
    return fs_tiers_config(root, shared=True, **options) + limits


@pytest.fixture
def fs_root(tmp_path: Path) -> Path:
    root = tmp_path / "fs"
    root.mkdir()
    return root


class Daemons:
    """Starts daemons and stops every one at the end (exit code 0 each)."""

    def __init__(self) -> None:
        self.started: list[DaemonProcess] = []

    def start(self, config: str, *args: str) -> DaemonProcess:
        daemon = start_daemon("--memory-budget", "64MiB", *args, config=config)
        self.started.append(daemon)
        return daemon

    def stop_all(self) -> None:
        for daemon in self.started:
            try:
                if daemon.alive():
                    assert daemon.stop() == 0, daemon.log()
            finally:
                daemon.cleanup()


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    started = Daemons()
    try:
        yield started
    finally:
        started.stop_all()


def wait_ready(*engines: Engine) -> None:
    """Waits until each engine's fs tier has its index (lookups answer HIT/MISS, not RETRY)."""
    for engine in engines:
        eventually(lambda e=engine: e.tier_stats().ready, 30, "the fs tier's index ready")


def test_a_block_stored_through_a_is_served_by_b_bit_exact(fs_root, daemons, pool_name):
    # a wait for the header checks the machine's load never reaches (it ends with them)
    config = shared_config(fs_root, "1s", shared_negative_ttl="0.2s", shared_rescan_interval=LONG)
    node_a, node_b = daemons.start(config), daemons.start(config)
    writer, reader = Engine(node_a, pool_name), Engine(node_b, pool_name)
    wait_ready(writer, reader)
    keys = block_keys("shared", 6)
    writer.store(keys)
    writer.settle_cascades()
    assert len(block_files(fs_root)) == 6

    # not in B's index: the lookup waits for the header checks, one batch off the loop
    assert reader.session.lookup(keys) == [PENDING] * 6
    assert reader.tier_stats().lookup_waits == 1
    assert reader.wait_settled(keys) == [HIT] * 6
    assert reader.load(keys) == [payload(k) for k in keys]
    stats = reader.tier_stats()
    assert stats.foreign_files_found == 6
    assert stats.promoted_blocks == 6 and stats.promotion_failures == 0
    assert stats.checksum_failures == 0
    assert writer.tier_stats().foreign_files_found == 0  # A wrote them itself
    writer.close()
    reader.close()


def test_the_negative_cache_bounds_how_often_a_missing_key_is_looked_for(
    fs_root, daemons, pool_name
):
    ttl = 3.0
    metrics = f"127.0.0.1:{free_port()}"
    node = daemons.start(shared_config(fs_root, shared_negative_ttl=f"{ttl}s",
                                       shared_rescan_interval=LONG),
                         "--metrics-address", metrics)  # fmt: skip
    engine = Engine(node, pool_name)
    wait_ready(engine)
    absent = block_keys("nowhere", 1)
    start = time.monotonic()
    answers = [engine.session.lookup(absent)[0] for _ in range(30)]
    elapsed = time.monotonic() - start
    assert set(answers) == {MISS}
    checks = eventually(lambda: engine.tier_stats().shared_rechecks, 30, "the key looked for")
    if elapsed < ttl:  # all 30 lookups inside one negative-cache lifetime: one check of disk
        assert checks == 1, f"{checks} checks of disk for 30 lookups in {elapsed:.2f}s"
    time.sleep(ttl + 0.2)  # lets the negative-cache entry expire on purpose
    assert engine.session.lookup(absent) == [MISS]
    eventually(lambda: engine.tier_stats().shared_rechecks == checks + 1, 30,
               "the key looked for again once its negative entry expired")  # fmt: skip
    # the same count on /metrics and in kvtierctl stats
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert f'kvtierd_shared_rechecks_total{{pool="{pool_name}",tier="fs0"}} {checks + 1}.0' in text
    table = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "kvtierctl"), "--address", node.address,
         "stats", "--pool", pool_name],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert table[0].split()[-2:] == ["foreign", "rechecks"], table
    fs_row = next(line.split() for line in table if line.split()[1:2] == ["fs0"])
    assert fs_row[-2:] == ["0", str(checks + 1)], table  # (cells like "0 B" hold spaces)
    engine.close()


def test_a_file_removed_by_another_daemon_is_a_miss_never_an_error(fs_root, daemons, pool_name):
    # no wait: B's first lookup indexes the files without promoting them
    config = shared_config(fs_root, "0s", shared_negative_ttl="0.2s", shared_rescan_interval=LONG)
    node_a, node_b = daemons.start(config), daemons.start(config)
    writer, reader = Engine(node_a, pool_name), Engine(node_b, pool_name)
    wait_ready(writer, reader)
    keys = block_keys("gone", 4)
    writer.store(keys)
    writer.settle_cascades()
    reader.session.lookup(keys)  # B queues the keys and finds the files (no promotion yet)
    eventually(lambda: reader.tier_stats().foreign_files_found == 4, 20, "B indexed A's files")
    for key in keys:  # what A's eviction does: the path no longer names the file
        file_of(fs_root, pool_name, key).unlink()

    assert reader.wait_settled(keys) == [MISS] * 4  # promotions find nothing: MISS, no error
    stats = reader.tier_stats()
    assert stats.promotion_failures == 4 and stats.promoted_blocks == 0
    assert stats.shared_files_vanished == 4 and stats.used_blocks == 0
    assert reader.session.lookup(keys) == [MISS] * 4
    writer.close()
    reader.close()


def test_a_rescan_drops_files_other_daemons_removed_and_adopts_new_ones(
    fs_root, daemons, pool_name
):
    config = shared_config(fs_root, shared_negative_ttl="0.2s", shared_rescan_interval="0.3s")
    node_a, node_b = daemons.start(config), daemons.start(config)
    writer, reader = Engine(node_a, pool_name), Engine(node_b, pool_name)
    wait_ready(writer, reader)
    keys = block_keys("rescan", 4)
    writer.store(keys)
    writer.settle_cascades()
    # no lookup on B: its rescans alone find the files and count their bytes
    eventually(lambda: reader.tier_stats().used_blocks == 4, 20, "B's rescan indexed A's files")
    assert reader.tier_stats().used_bytes == 4 * FILE_BYTES
    for key in keys[:2]:
        file_of(fs_root, pool_name, key).unlink()
    eventually(lambda: reader.tier_stats().used_blocks == 2, 20, "B's rescan dropped 2 files")
    assert reader.tier_stats().shared_files_vanished == 2
    assert reader.wait_settled(keys[2:]) == [HIT] * 2
    assert reader.load(keys[2:]) == [payload(k) for k in keys[2:]]
    writer.close()
    reader.close()


def test_temp_and_partial_files_are_never_read(fs_root, daemons, pool_name):
    config = shared_config(fs_root, shared_negative_ttl="0.1s", shared_rescan_interval="0.3s")
    node_a = daemons.start(config)
    writer = Engine(node_a, pool_name)
    complete, partial = block_keys("temp", 1)[0], block_keys("partial", 1)[0]
    writer.store([complete, partial])
    writer.settle_cascades()
    writer.close()
    assert node_a.stop() == 0, node_a.log()
    # a complete, valid file under a temp name: a write not yet published by rename
    published = file_of(fs_root, pool_name, complete)
    temp = published.with_name(published.name + ".0123456789ab-7" + fsformat.TEMP_SUFFIX)
    published.rename(temp)
    # a partial file under the final name (what a writer that skipped rename would leave)
    torn = file_of(fs_root, pool_name, partial)
    with open(torn, "r+b") as f:
        f.truncate(blockformat.HEADER_SIZE + BLOCK // 2)

    node_b = daemons.start(config)
    reader = Engine(node_b, pool_name)
    wait_ready(reader)
    deadline = time.monotonic() + 2.0  # several negative-ttl lifetimes and rescans
    while time.monotonic() < deadline:
        assert reader.session.lookup([complete]) == [MISS]
        time.sleep(0.05)  # lets checks and rescans run on purpose
    assert reader.session.lookup([partial]) == [MISS]
    stats = eventually(lambda: (s := reader.tier_stats()).checksum_failures == 1 and s,
                       20, "the torn file judged")  # fmt: skip
    assert stats.foreign_files_found == 0 and stats.used_blocks == 0
    assert reader.wait_settled([partial, complete]) == [MISS, MISS]
    assert temp.exists()  # a young temp file may be another daemon's write: left alone
    assert not torn.exists()  # the torn file failed its header check: removed
    reader.close()


def root_bytes(root: Path) -> int:
    total = 0
    for path in block_files(root):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # evicted meanwhile
            pass
    return total


def test_two_daemons_storing_past_capacity_keep_the_root_within_budget(fs_root, daemons, pool_name):
    capacity = 1 << 20  # 15 files of FILE_BYTES
    interval = 0.3
    config = shared_config(fs_root, capacity=f"{capacity}", shared_negative_ttl="0.2s",
                           shared_rescan_interval=f"{interval}s")  # fmt: skip
    node_a, node_b = daemons.start(config), daemons.start(config)
    engines = [Engine(node_a, pool_name), Engine(node_b, pool_name)]
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, root_bytes(fs_root))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for batch in range(6):  # 6 x 2 x 5 = 60 distinct blocks, 4x the capacity
            for n, engine in enumerate(engines):
                engine.store(block_keys(f"cap-{n}-{batch}", 5), retry_for=20)
            for engine in engines:
                engine.settle_cascades()
        # the same keys through both: one file wins, same bytes, both fine
        same = block_keys("both", 3)
        for engine in engines:
            engine.store(same, retry_for=20)
        for engine in engines:
            engine.settle_cascades()
        # after a rescan each daemon accounts the whole root and evicts down to it
        eventually(
            lambda: root_bytes(fs_root) <= capacity,
            20,
            lambda: f"root within {capacity} bytes; holds {root_bytes(fs_root)}",
        )
        time.sleep(3 * interval)  # a few rescans: it stays within the budget
        assert root_bytes(fs_root) <= capacity
    finally:
        done.set()
        watcher.join()
    # the stated bound: capacity + what the other daemon published since this one's
    # last rescan -- at most one more capacity with two daemons
    assert peak <= 2 * capacity, f"peak {peak} bytes"
    for path in block_files(fs_root):  # every file left is whole and of this pool
        assert path.stat().st_size == FILE_BYTES
    stats = [engine.tier_stats() for engine in engines]
    assert sum(s.evictions for s in stats) > 0
    assert sum(s.foreign_files_found for s in stats) > 0, stats  # (which one: timing)
    assert all(s.failures == 0 and s.checksum_failures == 0 for s in stats), stats
    for engine in engines:
        engine.close()


def test_pools_only_other_daemons_serve_count_against_the_capacity(fs_root, daemons, pool_name):
    capacity = 1 << 20  # 15 files of FILE_BYTES
    config = shared_config(fs_root, capacity=f"{capacity}", shared_negative_ttl="0.2s",
                           shared_rescan_interval="0.3s")  # fmt: skip
    node_a, node_b = daemons.start(config), daemons.start(config)
    # two models: each daemon serves one pool (its own directory under the root)
    engines = [Engine(node_a, pool_name + "-a"), Engine(node_b, pool_name + "-b")]
    for batch in range(3):  # 12 files each: either pool alone fits, both together do not
        for n, engine in enumerate(engines):
            engine.store(block_keys(f"pool-{n}-{batch}", 4), retry_for=20)
            engine.settle_cascades()
    eventually(
        lambda: root_bytes(fs_root) <= capacity,
        20,
        lambda: f"root within {capacity} bytes; holds {root_bytes(fs_root)}",
    )
    stats = [engine.tier_stats() for engine in engines]
    assert sum(s.evictions for s in stats) > 0, stats
    assert all(s.foreign_files_found == 0 for s in stats)  # no pool was another's
    for engine in engines:
        engine.close()


def _refused(config: str) -> str:
    """Starts a daemon that must refuse the root: exit code 2; returns its log."""
    daemon = start_daemon(config=config, wait=False)
    try:
        assert daemon.proc.wait(timeout=30) == 2, daemon.log()
        return daemon.log()
    finally:
        daemon.cleanup()


def test_shared_and_non_shared_daemons_never_mix_on_one_root(fs_root, daemons):
    shared = shared_config(fs_root)
    alone = fs_tiers_config(fs_root)
    first = daemons.start(shared)
    daemons.start(shared)  # a second shared daemon is welcome
    log = _refused(alone)
    assert "in use by daemons with shared = true" in log and "set shared = true" in log, log
    assert str(fs_root) in log
    assert first.stop() == 0
    for daemon in daemons.started:
        if daemon.alive():
            assert daemon.stop() == 0

    daemons.start(alone)
    log = _refused(shared)
    assert "in use by a daemon with shared = false" in log, log
    log = _refused(alone)
    assert "in use by another kvtierd" in log and "shared = true on both" in log, log


def test_shared_options_are_checked(fs_root):
    for option, value in (("shared_negative_ttl", "0s"), ("shared_rescan_interval", "2h"),
                          ("shared", "yes")):  # fmt: skip
        log = _refused(fs_tiers_config(fs_root, **{option: value}))
        assert option in log, log


def test_the_root_lock_is_not_followed_through_a_symlink(fs_root, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, fs_root / ".kvtierd-root.lock")
    log = _refused(shared_config(fs_root))
    assert "symlink" in log, log
    assert target.read_text() == ""
