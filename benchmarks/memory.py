"""Daemon memory per primary block at 1M blocks of 4 KiB (the region excluded:
RssAnon counts private memory only, the region is shared memory)."""

from __future__ import annotations

import gc

from benchmarks.common import BenchDaemon, Row, rss_anon_bytes
from kvtierd_client.client import Client

BLOCKS = 1 << 20
BATCH = 65536


def run() -> list[Row]:
    with BenchDaemon("--memory-budget", "5GiB") as daemon:
        client = Client(daemon.address, timeout=120)
        session = client.open_session("bench/rss", block_bytes=4096, num_blocks=BLOCKS)
        session.lookup([b"warm-up"])
        gc.collect()
        before = rss_anon_bytes(daemon.proc.pid)
        for start in range(0, BLOCKS, BATCH):
            batch = [f"{i:032x}".encode() + b"\0\0\0\0" for i in range(start, start + BATCH)]
            grant = session.prepare_store(batch)
            session.complete_store(grant.keys_to_store)
        after = rss_anon_bytes(daemon.proc.pid)
        session.close()
        client.close()
    per_block = (after - before) / BLOCKS
    return [Row("memory", "daemon RSS per primary block (1M x 4 KiB, 36-byte keys)",
                per_block, "bytes", target="<= 300")]  # fmt: skip
