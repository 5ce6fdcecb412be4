"""Attacks on the fs tier by other local users and writers of its root: files and
locks planted in its root, block files moved between keys."""

from __future__ import annotations

import os
import time

import pytest
from daemon_harness import DaemonProcess, eventually, fs_tiers_config, health_status, start_daemon
from engine_harness import HIT, MISS, Engine, block_files, block_keys, file_of
from local_users import LocalUser

_PLANT_LOCK = """
import os, sys
path = sys.argv[1]
try:
    os.unlink(path)
except FileNotFoundError:
    pass
os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
"""


def _served_or_exited(daemon: DaemonProcess) -> None:
    def settled() -> bool:
        if not daemon.alive():
            return True
        return os.path.exists(daemon.socket_path) and health_status(daemon) == "SERVING"

    eventually(settled, 30.0, lambda: f"the daemon served or exited:\n{daemon.log()}")


def test_a_root_lock_file_planted_by_another_uid_is_refused(
    other_user: LocalUser, sticky_root: str
):
    """In a sticky root another uid may create ``.kvtierd-root.lock`` before the
    daemon. The daemon used to lock that file: its owner can then unlink it (its
    own file, even in a sticky directory) and plant a fresh one, which a second
    non-shared daemon locks too -- two ``shared = false`` daemons on one root, the
    very thing the lock exists to prevent. A lock file the daemon does not own is
    now refused at start (exit 2, naming it), so at most one of them ever runs."""
    lock = os.path.join(sticky_root, ".kvtierd-root.lock")
    planted = other_user.run_python(_PLANT_LOCK, lock)
    assert planted.returncode == 0, planted.stderr
    config = fs_tiers_config(sticky_root)
    first = start_daemon(config=config, wait=False)
    second: DaemonProcess | None = None
    try:
        _served_or_exited(first)
        replanted = other_user.run_python(_PLANT_LOCK, lock)  # its own file: it may
        assert replanted.returncode == 0, replanted.stderr
        second = start_daemon(config=config, wait=False)
        _served_or_exited(second)
        running = [d for d in (first, second) if d.alive()]
        assert len(running) <= 1, "two shared = false daemons run on one root"
        assert first.proc.wait(timeout=30) == 2, first.log()
        assert "kvtierd-root.lock" in first.log() and "another user" in first.log()
    finally:
        for daemon in (first, second):
            if daemon is not None:
                daemon.cleanup()


_PLANT_BLOCK_FILE = """
import os, sys
root, size, sparse = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "sparse"
path = os.path.join(root, "planted-0000000000000000", "00", "00")
os.makedirs(path)
with open(os.path.join(path, "00" * 20 + ".kvb"), "wb") as f:
    if sparse:
        f.truncate(size)  # its length, no disk block
    else:
        f.write(b"x" * size)
"""


@pytest.mark.parametrize(
    ("size", "kind"), [(1 << 40, "sparse"), (4 << 20, "written")], ids=["sparse-1TiB", "4MiB"]
)
def test_a_file_another_user_plants_in_a_shared_root_does_not_evict_the_cache(
    other_user: LocalUser, sticky_root: str, pool_name, size: int, kind: str
):
    """On a shared root the capacity counts the pool directories no pool here serves
    (other daemons' pools), file by file, by ``st_size``: anyone who may create a
    directory in the root (a sticky root is accepted at start) made a 1 TiB *sparse*
    ``*.kvb`` file there -- no disk used -- or a real one over the capacity, and at
    the next rescan the daemon evicted every block it had, and every new one right
    after its store. Files now count as the disk blocks they hold, and directories
    of another uid not at all (every daemon of a root runs as one uid: the root
    lock refuses another's)."""
    config = fs_tiers_config(
        sticky_root, shared=True, capacity=f"{1 << 20}", shared_rescan_interval="0.3s",
        shared_negative_ttl="0.2s",
    )  # fmt: skip
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        engine = Engine(daemon, pool_name)
        eventually(lambda: engine.tier_stats().ready, 30, "the fs tier's index ready")
        keys = block_keys("kept", 4)
        engine.store(keys)
        engine.settle_cascades()
        planted = other_user.run_python(_PLANT_BLOCK_FILE, sticky_root, str(size), kind)
        assert planted.returncode == 0, planted.stderr
        time.sleep(2.0)  # several rescans
        assert engine.client.flush_pool(pool_name) == 4  # loads now come from the fs tier
        assert engine.wait_settled(keys) == [HIT] * 4, "the planted file evicted the cache"
        assert engine.tier_stats().evictions == 0
        assert engine.wait_settled(block_keys("never", 1)) == [MISS]
        engine.close()
    finally:
        daemon.stop()
        daemon.cleanup()


MOVED_FILES = 300


def _moved_one_key_along(root, pool: str, keys: list[bytes]) -> None:
    """Each block file now under its neighbour's name (its header names another key),
    as anyone who can write the root could do."""
    paths = [file_of(root, pool, key) for key in keys]
    first = paths[0].read_bytes()
    for source, target in zip(paths[1:], paths, strict=False):
        os.replace(source, target)
    paths[-1].write_bytes(first)


def _corrupt_lines(daemon: DaemonProcess) -> list[str]:
    lines = [line for line in daemon.log().splitlines() if " WARNING " in line]
    # "unreadable": the start-up scan's line before the change
    return [line for line in lines if "corrupt block file" in line or "unreadable" in line]


def test_block_files_moved_between_keys_are_logged_at_a_bounded_rate(fs_root, pool_name):
    """Scenario: a writer of the root moves 300 block files one key along, twice: once
    while the daemon runs (each promotion refuses its file) and once while it is
    stopped (the start-up scan refuses them). Every file is counted in
    ``checksum_failures`` and removed; the log gets at most one such WARNING per
    10 s (CORRUPT_LOG_INTERVAL_S), not one per file. Before: 300 lines each time."""
    config = fs_tiers_config(fs_root)
    keys = block_keys("moved", MOVED_FILES)
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        engine = Engine(daemon, pool_name, num_blocks=MOVED_FILES)
        started = time.monotonic()
        engine.store(keys)
        engine.settle_cascades()
        assert engine.client.flush_pool(pool_name) == MOVED_FILES  # the tier holds them alone
        _moved_one_key_along(fs_root, pool_name, keys)

        def all_refused() -> bool:
            engine.session.lookup(keys)  # asks for the promotions (again)
            return engine.tier_stats().checksum_failures >= MOVED_FILES

        eventually(all_refused, 60.0, lambda: f"every file refused: {engine.tier_stats()}",
                   interval=0.05)  # fmt: skip
        assert engine.wait_settled(keys) == [MISS] * MOVED_FILES
        elapsed = time.monotonic() - started
        lines = _corrupt_lines(daemon)
        assert 1 <= len(lines) <= 1 + elapsed // 10, f"{len(lines)} lines in {elapsed:.1f}s"
        assert not block_files(fs_root), "the refused files were left in the root"
        engine.store(keys)
        engine.close()
        assert daemon.stop() == 0, daemon.log()  # shutdown lets the cascades finish
    finally:
        daemon.cleanup()
    _moved_one_key_along(fs_root, pool_name, keys)
    started = time.monotonic()
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        engine = Engine(daemon, pool_name, num_blocks=MOVED_FILES)
        eventually(lambda: engine.tier_stats().ready, 60, "the fs tier's index ready")
        assert engine.tier_stats().checksum_failures == MOVED_FILES
        elapsed = time.monotonic() - started
        lines = _corrupt_lines(daemon)
        assert 1 <= len(lines) <= 1 + elapsed // 10, f"{len(lines)} lines in {elapsed:.1f}s"
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()
