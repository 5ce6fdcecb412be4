"""The engine side of tests/deploy, run INSIDE an engine-like container (the kvtierd image's
Python, which has kvtierd_client and numpy): it talks to the daemon container over the shared
socket volume and maps the region through the shared /dev/shm, as a vLLM worker would.

    python engine_probe.py store POOL COUNT   # store COUNT blocks, read them back bit-exact
    python engine_probe.py load POOL COUNT    # the same COUNT blocks must be HITs (after a
                                              # daemon restart: adopted from the kept region,
                                              # or promoted from the fs tier)

The bytes of block ``i`` are a function of (pool, i) only, so a later container (or a later
daemon) can check them without sharing state. Prints one JSON line with what it saw; exits 1
with a message on stderr when anything differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.region import attach_announced

BLOCK_BYTES = 65536
NUM_BLOCKS = 64
ADDRESS = os.environ.get("KVTIERD_ADDRESS") or "unix:///run/kvtierd/kvtierd.sock"


def key(pool: str, index: int) -> bytes:
    return f"{pool}/block-{index}".encode()


def payload(pool: str, index: int) -> bytes:
    """BLOCK_BYTES deterministic bytes of block ``index`` (sha256 in counter mode)."""
    seed = key(pool, index)
    chunks = [
        hashlib.sha256(seed + n.to_bytes(4, "big")).digest() for n in range(BLOCK_BYTES // 32)
    ]
    return b"".join(chunks)


def wait_for_hits(session, keys: list[bytes], timeout: float = 60.0) -> list[LookupResult]:
    """Lookups until every key is HIT (HIT_PENDING / RETRY: a promotion is under way)."""
    deadline = time.monotonic() + timeout
    while True:
        results = session.lookup(keys)
        if all(r == LookupResult.HIT for r in results) or time.monotonic() > deadline:
            return results
        if any(r == LookupResult.MISS for r in results):
            return results
        time.sleep(0.05)


def read_back(session, region, pool: str, keys: list[bytes]) -> int:
    """Loads ``keys`` through the region; returns how many rows differ from the payload."""
    rows = region.numpy()
    block_ids = session.prepare_load(keys)
    try:
        return sum(
            bytes(rows[block_id]) != payload(pool, index)
            for index, block_id in enumerate(block_ids)
        )
    finally:
        session.complete_load(keys)


def wait_cascade(client: Client, pool: str, count: int, timeout: float = 60.0) -> int:
    """Waits until the fs tier holds ``count`` blocks of ``pool``; returns what it holds."""
    deadline = time.monotonic() + timeout
    while True:
        tiers = client.get_stats(pool).pools[0].tiers
        held = int(tiers[1].used_blocks) if len(tiers) > 1 else 0
        idle = all(t.jobs_in_flight == 0 for t in tiers[1:])
        if (held >= count and idle) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def store(pool: str, count: int) -> dict[str, object]:
    keys = [key(pool, i) for i in range(count)]
    with Client(ADDRESS) as client:
        session = client.open_session(pool, block_bytes=BLOCK_BYTES, num_blocks=NUM_BLOCKS)
        region = attach_announced(session.region, session_id=session.session_id)
        try:
            grant = session.prepare_store(keys)
            if grant is None or grant.keys_to_store != keys:
                raise SystemExit(f"prepare_store did not grant every key: {grant}")
            for index, block_id in enumerate(grant.block_ids):
                region.numpy()[block_id][:] = memoryview(payload(pool, index))
            session.complete_store(keys)
            # a second engine (another session of the pool, its own mapping of the region,
            # from its own descriptor) reads what the first stored
            reader = client.open_session(pool, block_bytes=BLOCK_BYTES, num_blocks=NUM_BLOCKS)
            reader_region = attach_announced(reader.region, session_id=reader.session_id)
            try:
                results = wait_for_hits(reader, keys)
                mismatched = read_back(reader, reader_region, pool, keys)
            finally:
                reader_region.close()
                reader.close()
            in_fs_tier = wait_cascade(client, pool, count)
        finally:
            region.close()
            session.close()
    return {
        "uid": os.getuid(),
        "groups": sorted(os.getgroups()),
        "region": session.region.path,
        "region_inode": int(session.region.st_ino),
        "results": [r.name for r in results],
        "mismatched": mismatched,
        "in_fs_tier": in_fs_tier,
    }


def load(pool: str, count: int) -> dict[str, object]:
    keys = [key(pool, i) for i in range(count)]
    with Client(ADDRESS) as client:
        session = client.open_session(pool, block_bytes=BLOCK_BYTES, num_blocks=NUM_BLOCKS)
        first = session.lookup(keys)
        results = wait_for_hits(session, keys)
        region = attach_announced(session.region, session_id=session.session_id)
        try:
            all_hits = all(r == LookupResult.HIT for r in results)
            mismatched = read_back(session, region, pool, keys) if all_hits else -1
        finally:
            region.close()
            session.close()
    return {
        "uid": os.getuid(),
        "region": session.region.path,
        "region_inode": int(session.region.st_ino),
        "first": [r.name for r in first],
        "results": [r.name for r in results],
        "mismatched": mismatched,
    }


def main() -> int:
    mode, pool, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    report = store(pool, count) if mode == "store" else load(pool, count)
    print(json.dumps(report))
    ok = report["mismatched"] == 0 and set(report["results"]) == {"HIT"}
    if not ok:
        print(
            f"engine_probe {mode}: not every block came back bit-exact: {report}", file=sys.stderr
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
