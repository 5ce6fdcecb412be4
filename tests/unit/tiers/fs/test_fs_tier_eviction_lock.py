"""A finding of attacking the #15 work, now a regression test: the tier's lock,
which the event loop takes on every Lookup, is never held across a file system
call of an eviction (a hung mount stalled every client)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from test_fs_tier import FILE_BYTES, Harness, region, run

from kvtierd.tiers.fs import safefs

__all__ = ["region"]  # the fixture, imported for this test


def test_a_stuck_rename_during_an_eviction_does_not_block_lookups(region, tmp_path, monkeypatch):
    root = tmp_path / "fs"
    root.mkdir()
    real_rename = safefs.PoolDir.rename
    renaming, answer = threading.Event(), threading.Event()

    def stuck_rename(self: safefs.PoolDir, rel: str, new_name: str) -> None:
        renaming.set()
        answer.wait(10)  # the file system does not answer for a while
        real_rename(self, rel, new_name)

    async def body(h: Harness) -> float:
        tier = await h.ready_tier(capacity_bytes=2 * FILE_BYTES, o_direct="off")
        try:
            for row in range(2):
                h.fill(row, row)
                await h.store(tier, [f"k{row}".encode()], [row])
            monkeypatch.setattr(safefs.PoolDir, "rename", stuck_rename)
            h.fill(2, 2)
            job = h.job([b"k2"], [2], False)  # needs room: evicts k0
            assert tier.submit_store(job)
            assert await h.loop.run_in_executor(None, renaming.wait, 10)  # in the rename now
            begin = time.perf_counter()
            tier.lookup([b"k1"])  # what the event loop does for every Lookup
            waited = time.perf_counter() - begin
            assert tier.index.statistics().evicting == 1  # k0's file is still being removed
            answer.set()
            await h.waiters[job.job_id]
            return waited
        finally:
            answer.set()
            tier.shutdown()

    waited = run(region, Path(root), body)
    # a Lookup behind the tier's lock waits out the stuck rename (10 s); a loaded
    # machine's scheduling costs a call far less than half of that
    assert waited < 5.0, f"a Lookup waited {waited:.2f}s for an eviction's rename"
