"""Admission to a secondary tier through a real daemon: an fs tier with ``admission =
"reused"`` or ``"tinylfu"``, real block files, a real restart. What is not admitted is
not on disk, and GetStats, ``kvtierctl stats`` and Explain say why."""

from __future__ import annotations

from pathlib import Path

from daemon_harness import ctl, eventually, fs_tiers_config, start_daemon
from engine_harness import Engine, block_files, block_keys, file_of

TIER_BLOCKS = 15  # capacity "1MiB" holds 15 files of 64 KiB + a 4 KiB header


def stored_in_batches(engine: Engine, keys: list[bytes], batch: int = 4) -> None:
    """Stores ``keys`` a primary of 4 rows at a time, each batch's cascades settled."""
    for i in range(0, len(keys), batch):
        engine.store(keys[i : i + batch], retry_for=10.0)
        engine.settle_cascades()


def test_reused_writes_a_block_once_it_is_loaded_again(fs_root, pool_name):
    """Scenario: blocks stored once are not written to the fs tier (no file), counted
    as not_reused, and Explain says so; the one loaded again is written at its load."""
    daemon = start_daemon(config=fs_tiers_config(fs_root, admission="reused"))
    try:
        engine = Engine(daemon, pool_name, num_blocks=8)
        keys = block_keys("r", 4)
        engine.store(keys)
        engine.settle_cascades()
        assert block_files(fs_root) == []
        stats = engine.tier_stats()
        assert stats.admission == "reused"
        assert (stats.admitted_blocks, stats.rejected_not_reused_blocks) == (0, 4)
        explained = engine.client.explain(pool_name, keys[1])
        assert explained.summary.startswith("HIT: readable in the primary tier; tier fs0: ")
        assert "not admitted: not read again from the primary yet" in explained.summary

        engine.load(keys[:1])  # read again: written now
        engine.settle_cascades()
        assert block_files(fs_root) == [file_of(fs_root, pool_name, keys[0])]
        stats = engine.tier_stats()
        assert (stats.admitted_blocks, stats.admitted_bytes) == (1, 65536)
        assert "not admitted" not in engine.client.explain(pool_name, keys[0]).summary

        table = ctl(daemon.address, "stats", "--pool", pool_name)
        assert table.returncode == 0, table.stderr
        header, row = [line.split() for line in table.stdout.splitlines()[-2:]]
        assert header[:5] == ["pool", "tier", "admission", "admitted", "not"], table.stdout
        # every store was a rejection (4), the load an admission (1): decisions counted
        assert row[1:6] == ["fs0", "reused", "1", "4", "0"], table.stdout
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_tinylfu_keeps_what_the_tier_holds_across_a_restart(fs_root, pool_name):
    """Scenario: a full tinylfu fs tier; the daemon restarts (its sketch starts empty,
    from what the tier holds: each held block counts as seen once); a flood of blocks
    stored once each must not push the held blocks out of the tier."""
    config = fs_tiers_config(fs_root, admission="tinylfu", capacity="1MiB")
    working = block_keys("w", TIER_BLOCKS)
    daemon = start_daemon(config=config)
    try:
        engine = Engine(daemon, pool_name, num_blocks=4)
        stored_in_batches(engine, working)  # room: every block admitted
        assert len(block_files(fs_root)) == TIER_BLOCKS
        engine.close()
        assert daemon.stop() == 0, daemon.log()
        daemon = daemon.restart()  # the same sockets, directories and fs root
        engine = Engine(daemon, pool_name, num_blocks=4)
        eventually(lambda: engine.tier_stats().ready, 20.0, "the fs tier's index rebuilt")
        one_shots = block_keys("once", 40)
        stored_in_batches(engine, one_shots)
        on_disk = set(block_files(fs_root))
        assert {file_of(fs_root, pool_name, key) for key in working} == on_disk
        stats = engine.tier_stats()
        assert (stats.admitted_blocks, stats.rejected_infrequent_blocks) == (0, 40)
        assert stats.admission_sketch_bytes == 6 * 64  # 15 blocks: the smallest sketch
        summary = engine.client.explain(pool_name, one_shots[0]).summary
        assert summary.startswith("MISS: last seen leaving tier primary: "), summary
        assert summary.endswith(
            "; tier fs0: not admitted: seen too rarely to displace what the tier holds "
            "(admission = tinylfu)"
        ), summary
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_a_tier_without_the_option_writes_every_block(fs_root: Path, pool_name):
    """The default (``always``): every stored block is written, nothing is rejected."""
    daemon = start_daemon(config=fs_tiers_config(fs_root))
    try:
        engine = Engine(daemon, pool_name, num_blocks=8)
        engine.store(block_keys("a", 3))
        engine.settle_cascades()
        assert len(block_files(fs_root)) == 3
        stats = engine.tier_stats()
        assert (stats.admission, stats.admitted_blocks, stats.rejected_infrequent_blocks) == (
            "always", 3, 0,
        )  # fmt: skip
        table = ctl(daemon.address, "stats", "--pool", pool_name)
        assert "admission" not in table.stdout  # no admission table: nothing selective
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()
