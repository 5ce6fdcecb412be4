"""A restart that does not freeze the cache (issue #33, item 1): what the previous
daemon's clients may still touch stays held, and nothing else. A graceful stop
journals the rows its sessions pinned or reserved, so after a SIGTERM restart of a
full primary the fs tier's blocks are promoted at once; after a SIGKILL the hold
runs from the crash (the journal's lease horizon), not from the restart.

Each test prints the time to the first promoted HIT (issue #33's note)."""

from __future__ import annotations

import signal
import time

from daemon_harness import eventually, fs_tiers_config, start_daemon
from engine_harness import BLOCK, HIT, Engine, block_files, block_keys, payload
from warm_harness import StormWriters, restart


def first_hits(engine: Engine, keys: list[bytes], timeout: float) -> tuple[float, float]:
    """Looks ``keys`` up until all are HIT (each lookup asks for the promotions);
    returns when the first and the last answered HIT (time.monotonic)."""
    first = 0.0

    def all_hit() -> bool:
        nonlocal first
        results = engine.session.lookup(keys)
        if HIT in results and not first:
            first = time.monotonic()
        return results == [HIT] * len(keys)

    eventually(all_hit, timeout, lambda: f"{keys} promoted", interval=0.01)
    return first, time.monotonic()


def test_a_graceful_restart_of_a_full_primary_promotes_from_the_fs_tier_at_once(fs_root, pool_name):
    """24 blocks stored through a primary of 8 with an fs tier, the session closed,
    SIGTERM, restart: the 8 oldest (only on disk now) are promoted into the adopted,
    full primary at once. Every adopted block used to stay pinned for lease +
    write_quarantine (40 s here): those lookups answered MISS (no room) that long."""
    config = fs_tiers_config(fs_root)
    daemon = start_daemon("--lease", "30s", "--write-quarantine", "10s", config=config)
    daemons = [daemon]
    try:
        engine = Engine(daemon, pool_name, num_blocks=8)
        keys = block_keys("full", 24)
        for first in range(0, len(keys), 4):
            engine.store(keys[first : first + 4], retry_for=30)  # rows pinned by cascades
        engine.settle_cascades()
        assert len(block_files(fs_root)) == 24
        engine.close()
        daemon = restart(daemon)
        daemons.append(daemon)
        serving = time.monotonic()
        engine = Engine(daemon, pool_name, num_blocks=8)
        assert engine.client.get_stats(pool_name).pools[0].tiers[0].used_blocks == 8  # full
        first_hit, last_hit = first_hits(engine, keys[:8], timeout=20)  # the fence: 40 s
        print(
            f"\nSIGTERM restart, full primary: first promoted HIT {first_hit - serving:.3f}s "
            f"after the restart served, all 8 {last_hit - serving:.3f}s"
        )
        assert engine.load(keys[:8]) == [payload(key) for key in keys[:8]]
        assert engine.tier_stats().promotion_no_room == 0
        engine.close()
        assert "a graceful stop: 0 rows its clients may still touch" in daemon.log()
    finally:
        for each in daemons:
            each.stop(signal.SIGKILL)
        daemons[-1].cleanup()


LEASE_S, QUARANTINE_S = 6.0, 2.0
FENCE_S = LEASE_S + QUARANTINE_S
RESTART_AFTER_S = 3.0


def test_a_crash_during_a_write_storm_holds_the_rows_from_the_kill_not_the_restart(
    fs_root, pool_name, tmp_path
):
    """8 blocks settle on disk, then writers storm the 16-row primary (which evicts
    them) and the daemon is SIGKILLed mid-storm. Every row may be in an old
    writer's or loader's hands until its lease (6 s) and write_quarantine (2 s) run
    out, counted from its last call: the restarted daemon promotes nothing before
    that, and promotes the 8 blocks as soon as it has passed (it used to wait a
    whole fence from the adoption: seconds later, a restart's time later)."""
    config = fs_tiers_config(fs_root)
    daemon = start_daemon(
        "--lease", f"{LEASE_S:g}s", "--write-quarantine", f"{QUARANTINE_S:g}s", config=config
    )
    daemons = [daemon]
    try:
        engine = Engine(daemon, pool_name, num_blocks=16)
        settled = block_keys("settled", 8)
        engine.store(settled)
        engine.settle_cascades()
        engine.close()
        writers = StormWriters(daemon, pool_name, 16, tmp_path, block=BLOCK, layout="L")
        try:
            eventually(lambda: writers.each_completed(30), 60, "the storm evicted them")
            killed = time.monotonic()
            daemon.stop(signal.SIGKILL)
        finally:
            writers.stop()
        last_call = max(c.sent for c in writers.completed())  # the writers' last lease
        time.sleep(RESTART_AFTER_S)  # as systemd's RestartSec: a while after the crash
        daemon = daemon.restart()
        daemons.append(daemon)
        adopting = time.monotonic()  # the pool's open (its adoption) comes after this
        engine = Engine(daemon, pool_name, num_blocks=16)
        opened = time.monotonic()
        first_hit, last_hit = first_hits(engine, settled, timeout=FENCE_S + 20)
        print(
            f"\nSIGKILL mid-storm: restart served {opened - killed:.3f}s after the kill; "
            f"first promoted HIT {first_hit - killed:.3f}s after it, all 8 "
            f"{last_hit - killed:.3f}s (lease + write_quarantine: {FENCE_S:g}s)"
        )
        # never before the old clients' leases and write fences could have run out ...
        assert first_hit >= last_call + FENCE_S
        # ... and soon after, counted from the kill (or from the pool's open, if later):
        # before a fence counted from the adoption would end, RESTART_AFTER_S + a start
        # later (a bound that grows with a slow restart, not a fixed margin: a loaded
        # machine promotes late, but no later than that)
        assert first_hit < adopting + FENCE_S, (
            f"the first HIT came {first_hit - adopting:.3f}s after the adoption: held a "
            f"whole fence ({FENCE_S:g}s) from it, not from the kill"
        )
        assert engine.load(settled) == [payload(key) for key in settled]
        engine.close()
        assert "a crash: its last lease (+ write_quarantine) ends in" in daemon.log()
    finally:
        for each in daemons:
            each.stop(signal.SIGKILL)
        daemons[-1].cleanup()
