"""The fs tier's write budget (``max_write_bytes_per_s``) in a real daemon: blocks past
the budget are not in the tier (no file under the root) and are counted, and Explain
says why; the store that made them is not delayed or refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, fs_tiers_config, start_daemon
from engine_harness import FILE_BYTES, HIT, Engine, block_files, block_keys, file_of

from kvtierd.tiering.admission import BUDGET

BURST_FILES = 4  # the budget: four block files a second (its burst: one second of it)


@pytest.fixture
def budgeted(fs_root: Path) -> Iterator[DaemonProcess]:
    config = fs_tiers_config(fs_root, max_write_bytes_per_s=BURST_FILES * FILE_BYTES)
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_blocks_past_the_budget_are_not_written_and_are_counted(budgeted, fs_root, pool_name):
    """One store of twelve blocks at once, against a full bucket of four files: the
    first four are written (the front of a prefix chain), the other eight dropped at
    once. The store itself completes and all twelve are ready in the primary."""
    engine = Engine(budgeted, pool_name, num_blocks=12)
    keys = block_keys("wear", 12)
    engine.store(keys)
    engine.settle_cascades()
    assert engine.session.lookup(keys) == [HIT] * 12  # the store lost nothing
    written = {file_of(fs_root, pool_name, key) for key in keys[:BURST_FILES]}
    assert set(block_files(fs_root)) == written
    stats = engine.tier_stats()
    assert stats.cascade_blocks == BURST_FILES and stats.bytes_in == BURST_FILES * FILE_BYTES
    assert (stats.admitted_blocks, stats.rejected_budget_blocks) == (BURST_FILES, 8)
    explained = engine.client.explain(pool_name, keys[-1])
    assert [(t.tier, t.present) for t in explained.tiers] == [("fs0", False)]
    assert [(r.tier, r.what) for r in explained.history] == [("fs0", BUDGET.record)]
    engine.close()


def test_the_pools_of_a_tier_share_its_budget(fs_root, pool_name):
    """The budget is the tier's (one disk), not each pool's: what one pool spent, the
    next pool's store finds spent; each pool counts its own drops. The smallest budget,
    4 KiB/s, is less than a file: one passes from the full bucket and leaves it 16 s in
    debt, so the second pool's file finds it spent however slowly the test runs."""
    config = fs_tiers_config(fs_root, max_write_bytes_per_s=4096)
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        first = Engine(daemon, pool_name + "-a", num_blocks=2)
        second = Engine(daemon, pool_name + "-b", num_blocks=2)
        first.store(block_keys("a", 1))
        second.store(block_keys("b", 1))
        for engine in (first, second):
            engine.settle_cascades()
        assert block_files(fs_root) == [file_of(fs_root, pool_name + "-a", b"a-0")]
        assert first.tier_stats().rejected_budget_blocks == 0
        assert second.tier_stats().rejected_budget_blocks == 1
        for engine in (first, second):
            engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()
