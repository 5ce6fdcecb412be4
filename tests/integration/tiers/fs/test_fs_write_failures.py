"""A full disk under an fs tier (issue #15, item 6, the tier half): the operator is
told once per interval, with errno and path; the primary tier keeps serving; and
once space returns, one line says the writes work again. A real tmpfs of 8 MiB
(mounting needs root: skipped otherwise), a real daemon, a real socket.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import eventually, fs_tiers_config, start_daemon
from engine_harness import HIT, Engine, block_files, block_keys, file_of, payload

SMALL = "8m"  # ~120 block files of 68 KiB
BIGGER = "64m"


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: the fs tier's root, far smaller than the tier's capacity."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = _mount("-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(mount_point))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def test_a_full_disk_is_reported_once_the_primary_serves_and_recovery_is_reported(
    small_disk, pool_name
):
    daemon = start_daemon(config=fs_tiers_config(small_disk, capacity="1GiB"))
    try:
        engine = Engine(daemon, pool_name, num_blocks=16)
        keys = block_keys("full", 160)  # 160 x 68 KiB: ~10.6 MiB for 8 MiB of disk
        for i in range(0, len(keys), 8):
            engine.store(keys[i : i + 8], retry_for=10.0)
        engine.settle_cascades()
        stats = engine.tier_stats()
        assert stats.failures > 0 and stats.cascade_failures > 0
        assert 0 < stats.used_blocks < len(keys)
        reports = [
            line
            for line in daemon.log().splitlines()
            if "block write failed" in line or "writes succeed again" in line
        ]
        warnings = [line for line in reports if "block write failed" in line]
        # rate-limited: one line per tier per 10 s within an episode of failures; a
        # write that squeezes in between (another one's temp file removed) ends the
        # episode with one recovery line, and the next failure starts a new one
        episodes = 1 + sum("writes succeed again" in line for line in reports)
        assert 1 <= len(warnings) <= episodes, reports
        assert all(
            "writes succeed again" in first
            for first, second in zip(reports, reports[1:], strict=False)
            if "block write failed" in second
        ), reports  # never two failure lines in a row
        assert "WARNING" in warnings[0] and "tier fs0: " in warnings[0]
        assert f"ENOSPC (No space left on device) at {small_disk}/" in warnings[0]

        # the primary tier keeps serving: hits, loads and new stores
        # the last batch stored is in the primary (earlier ones may have been evicted
        # out of order: whichever rows no cascade pinned at that moment)
        recent = keys[-8:]
        assert engine.session.lookup(recent) == [HIT] * 8
        assert engine.load(recent) == [payload(k) for k in recent]
        more = block_keys("more", 8)
        engine.store(more, retry_for=10.0)
        engine.settle_cascades()
        assert engine.session.lookup(more) == [HIT] * 8
        failed = engine.tier_stats().failures

        assert _mount("-o", f"remount,size={BIGGER}", str(small_disk)).returncode == 0
        after = block_keys("after", 8)
        engine.store(after, retry_for=10.0)
        engine.settle_cascades()
        assert all(file_of(small_disk, pool_name, k).is_file() for k in after)
        assert engine.tier_stats().failures == failed  # no new failure

        # every episode of failures is reported when a write succeeds again (the first
        # may end already while the small disk is full: evictions made room), so the
        # recoveries logged account for every failure counted
        def recovered() -> int:
            found = re.findall(r"tier fs0: writes succeed again after (\d+) failures", daemon.log())
            return sum(int(n) for n in found)

        eventually(lambda: recovered() == failed, 30.0, f"recoveries logged for {failed} failures")
        assert len(block_files(small_disk)) == engine.tier_stats().used_blocks
        engine.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()
