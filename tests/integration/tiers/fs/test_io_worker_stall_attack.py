"""Issue #29, finding 6: an fs tier I/O worker process stopped with SIGSTOP (what
anyone with the daemon's uid, a debugger, or a hung file system does to it).

Before: nothing timed it out. Its promotions answered HIT_PENDING for as long as
it stayed stopped (36 s in the report), the cascades waiting on it pinned their
rows, and PrepareStores were refused for want of a free row. Now a worker that
has not answered a request within ``io_worker_timeout`` (here 2 s) is killed and
replaced: the request's blocks fail once it has exited (the promotion answers
MISS, the cascades are dropped, every row is released), nothing is served from
a row it was writing, and the next request gets a new worker.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from daemon_harness import (
    DaemonProcess,
    Exits,
    eventually,
    fs_tiers_config,
    gone,
    start_daemon,
    stopped,
)
from engine_harness import BLOCK, HIT, MISS, PENDING, Engine, block_keys, file_of, payload

from kvtierd.tiering.retries import PROMOTION_RETRY_AFTER

TIMEOUT_S = 2.0


def io_workers(daemon: DaemonProcess) -> list[int]:
    """Process ids of the daemon's fs I/O workers (its children running the module)."""
    pids: list[int] = []
    for task in os.listdir(f"/proc/{daemon.proc.pid}/task"):
        try:
            children = Path(f"/proc/{daemon.proc.pid}/task/{task}/children").read_text()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        for child in map(int, children.split()):
            try:
                if b"kvtierd.tiers.fs.ioworker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids.append(child)
            except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                continue
    return pids


def test_a_stopped_io_worker_is_replaced_and_its_jobs_fail_cleanly(tmp_path, pool_name):
    root = tmp_path / "fs"
    root.mkdir()
    config = fs_tiers_config(root, io_processes=1, io_worker_timeout=f"{TIMEOUT_S}s")
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    engine: Engine | None = None
    try:
        engine = Engine(daemon, pool_name, num_blocks=4)
        first, second = block_keys("a", 4), block_keys("b", 4)
        engine.store(first)
        engine.settle_cascades()
        engine.store(second)  # `first` now only in the fs tier
        engine.settle_cascades()
        (worker,) = io_workers(daemon)

        os.kill(worker, signal.SIGSTOP)
        eventually(lambda: stopped(worker), 30, f"worker {worker} stopped")
        stopped_at = time.monotonic()
        assert engine.session.lookup(first[:1]) == [PENDING]  # a promotion: one row reserved
        engine.store(block_keys("c", 3))  # three cascades: three rows pinned
        assert engine.session.prepare_store([b"refused"]) is None  # no row free

        eventually(
            lambda: gone(worker), 30, lambda: f"the stopped worker killed:\n{daemon.log()}",
            wake=Exits(worker),
        )  # fmt: skip
        assert time.monotonic() - stopped_at >= TIMEOUT_S * 0.9  # not before the bound
        (settled,) = engine.wait_settled(first[:1])  # failed: MISS (or promoted anew)
        assert settled in (MISS, HIT)
        if settled == HIT:  # never bytes the killed worker left half-written
            assert engine.load(first[:1]) == [payload(first[0])]

        def rows_released() -> bool:
            primary = engine.client.get_stats(pool_name).pools[0].tiers[0]
            return (primary.pinned_blocks, primary.pending_blocks) == (0, 0)

        # the cascades' failures reach the loop after the promotion's (other I/O threads)
        eventually(rows_released, 30, lambda: f"every row released:\n{daemon.log()}")
        assert engine.tier_stats().promotion_failures >= 1
        later = block_keys("d", 4)
        engine.store(later, retry_for=10.0)  # every row is free again
        engine.settle_cascades()

        # a new worker serves the next requests: a promotion lands bit-exact
        (replacement,) = eventually(lambda: io_workers(daemon), 30, "a new I/O worker")
        assert replacement != worker
        assert engine.session.lookup(first[1:2]) == [PENDING]
        assert engine.wait_settled(first[1:2]) == [HIT]
        assert engine.load(first[1:2]) == [payload(first[1])]
        stall = "did not answer within 2s"
        stalls = [line for line in daemon.log().splitlines()
                  if "blockio: I/O worker" in line and stall in line]  # fmt: skip
        assert len(stalls) == 1 and " WARNING " in stalls[0], daemon.log()
        assert "Traceback" not in daemon.log()
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        daemon.cleanup()


def test_a_stalled_promotion_is_a_transient_failure_that_keeps_the_files(tmp_path, pool_name):
    """Issue #40, item 5. Scenario: two blocks held by the fs tier only are promoted while
    the I/O worker is stopped; after ``io_worker_timeout`` it is killed and the
    promotion fails. Before: the keys answered MISS for ``PROMOTION_RETRY_AFTER``
    (30 s), and Explain said "promotion failed (unreadable or corrupt)" beside
    ``present: true``. Now the failure is transient: the files stay untouched and
    indexed, Explain says the worker timed out and the key is promoted again, and
    a later Lookup promotes the blocks through the new worker, bit-exact."""
    root = tmp_path / "fs"
    root.mkdir()
    config = fs_tiers_config(root, io_processes=1, io_worker_timeout=f"{TIMEOUT_S}s")
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    engine: Engine | None = None
    try:
        engine = Engine(daemon, pool_name, num_blocks=4)
        first, second = block_keys("a", 4), block_keys("b", 4)
        engine.store(first)
        engine.settle_cascades()
        engine.store(second)  # `first` now only in the fs tier
        engine.settle_cascades()
        stalled = first[:2]
        files = {key: file_of(root, pool_name, key).read_bytes() for key in stalled}
        (worker,) = io_workers(daemon)

        os.kill(worker, signal.SIGSTOP)
        eventually(lambda: stopped(worker), 30, f"worker {worker} stopped")
        assert engine.session.lookup(stalled) == [PENDING, PENDING]
        eventually(
            lambda: gone(worker), 30, lambda: f"the stopped worker killed:\n{daemon.log()}",
            wake=Exits(worker),
        )  # fmt: skip
        engine.wait_settled(stalled)  # failed: MISS (or promoted anew already)

        # nothing removed: the files are whole and the tier still holds the keys
        for key, data in files.items():
            assert file_of(root, pool_name, key).read_bytes() == data
        explained = engine.client.explain(pool_name, stalled[0])
        assert [(t.tier, t.present) for t in explained.tiers] == [("fs0", True)]
        whats = [record.what for record in explained.history]
        assert not any("corrupt" in what for what in whats), whats
        assert whats[-1] == (
            "promotion failed for now (the I/O worker did not answer within io_worker_timeout "
            "and was killed): nothing removed, promoted again later"
        ), whats
        assert "promotes it" in explained.summary, explained  # again: now, or after a second
        assert engine.tier_stats().checksum_failures == 0

        # promoted again through the new worker, long before a corrupt block's ban ends
        def promoted() -> bool:
            return engine.session.lookup(stalled) == [HIT, HIT]

        eventually(promoted, PROMOTION_RETRY_AFTER / 2, lambda: f"promoted again:\n"
                   f"{engine.client.explain(pool_name, stalled[0])}", interval=0.05)  # fmt: skip
        assert engine.load(stalled) == [payload(key) for key in stalled]
        assert "Traceback" not in daemon.log()
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        daemon.cleanup()


def test_files_a_stopped_worker_renamed_before_its_kill_are_kept(tmp_path, pool_name):
    """Issue #40, item 5. Scenario: the I/O worker is stopped in the middle of a
    cascade's group of blocks, after it renamed some of its block files into place
    and before it answered; after ``io_worker_timeout`` it is killed. Before: every
    block file the request named was removed ("whether the worker renamed them is
    unknown"), good ones included: they answered MISS for good. Now the whole files
    it renamed are kept and indexed (a file is renamed only once complete; every
    read verifies it), its temp file is removed, and they are promoted bit-exact."""
    root = tmp_path / "fs"
    root.mkdir()
    # fsync: each block of the group takes a disk flush, so the stop lands inside it
    config = fs_tiers_config(root, io_processes=1, io_worker_timeout=f"{TIMEOUT_S}s",
                             fsync=True)  # fmt: skip
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    engine: Engine | None = None
    try:
        engine = Engine(daemon, pool_name, num_blocks=64)
        engine.store(block_keys("warm", 1))  # the worker starts
        engine.settle_cascades()
        (worker,) = io_workers(daemon)
        keys = block_keys("a", 48)  # 3 MiB: one group, one request

        def on_disk() -> list[bytes]:
            return [key for key in keys if file_of(root, pool_name, key).exists()]

        engine.store(keys)
        eventually(on_disk, 30, "the worker renamed a block file", interval=0.0005)
        os.kill(worker, signal.SIGSTOP)
        eventually(lambda: stopped(worker), 30, f"worker {worker} stopped")
        renamed = on_disk()
        assert 0 < len(renamed) < len(keys), "the stop did not land inside the group"
        eventually(
            lambda: gone(worker), 30, lambda: f"the stopped worker killed:\n{daemon.log()}",
            wake=Exits(worker),
        )  # fmt: skip
        engine.settle_cascades()

        assert on_disk() == renamed  # none of them removed
        assert not list(root.rglob("*.tmp"))  # the temp file of the block in progress is
        for key in renamed:
            assert file_of(root, pool_name, key).read_bytes()[-BLOCK:] == payload(key)
        assert engine.tier_stats().used_blocks == 1 + len(renamed)  # indexed
        engine.store(block_keys("b", 64), retry_for=10.0)  # push `keys` out of the primary
        engine.settle_cascades()
        assert engine.wait_settled(renamed) == [HIT] * len(renamed)  # promoted: bit-exact
        assert engine.load(renamed) == [payload(key) for key in renamed]
        assert "Traceback" not in daemon.log()
    finally:
        if engine is not None:
            engine.close()
        daemon.stop()
        daemon.cleanup()
