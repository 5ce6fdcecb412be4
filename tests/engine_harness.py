"""An engine's view of a real daemon for the integration tests: one session and its
attached region that store and load real bytes (``Engine``), payloads that are a
function of the key (``payload``), and where the fs tier keeps a key (``file_of``).

Payloads are a function of the key, so any byte served for a key can be checked
against what was stored under it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from daemon_harness import DaemonProcess, eventually, wait_tier_jobs

from kvtierd.tiers import blockformat
from kvtierd.tiers.fs import fsformat
from kvtierd_client.client import Client, LookupResult, Session
from kvtierd_client.region import AttachedRegion, attach_announced

BLOCK = 65536


FILE_BYTES = blockformat.HEADER_SIZE + BLOCK


HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)


def payload(key: bytes) -> bytes:
    """BLOCK bytes determined by the key."""
    seed = hashlib.sha256(key).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def block_keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


class Engine:
    """One client session plus its attached region: stores and loads real bytes."""

    def __init__(self, daemon: DaemonProcess, pool: str, num_blocks: int = 8, layout: str = "L"):
        self.daemon = daemon
        self.pool = pool
        self.client = Client(daemon.address)
        self.session: Session = self.client.open_session(
            pool, block_bytes=BLOCK, num_blocks=num_blocks, layout=layout
        )
        # through the region descriptor the daemon passes (SCM_RIGHTS), identity checked
        self.region: AttachedRegion = attach_announced(
            self.session.region, session_id=self.session.session_id
        )
        self.stub = daemon.stub()

    def store(self, keys: list[bytes], *, retry_for: float = 0.0) -> None:
        """Stores ``payload(key)`` for each key; retries a refused PrepareStore (rows
        pinned by cascades in flight) for up to ``retry_for`` seconds."""
        grant = eventually(
            lambda: self.session.prepare_store(keys),
            retry_for, "the primary accepted the store", interval=0.002,
        )  # fmt: skip
        rows = self.region.numpy()
        for key, block_id in zip(grant.keys_to_store, grant.block_ids, strict=True):
            rows[block_id][:] = memoryview(payload(key))
        self.session.complete_store(grant.keys_to_store)

    def wait_settled(self, keys: list[bytes], timeout: float = 20.0) -> list[LookupResult]:
        """Looks keys up until none is HIT_PENDING or RETRY (promotions done). Polls:
        a Lookup is how a client asks for a promotion (again, after a RETRY)."""
        results: list[LookupResult] = []

        def settled() -> bool:
            results[:] = self.session.lookup(keys)
            return not any(r in (PENDING, RETRY) for r in results)

        eventually(settled, timeout, lambda: f"lookups settled; still {results}", interval=0.01)
        return results

    def load(self, keys: list[bytes]) -> list[bytes]:
        block_ids = self.session.prepare_load(keys)
        rows = self.region.numpy()
        data = [bytes(rows[block_id]) for block_id in block_ids]
        self.session.complete_load(keys)
        return data

    def tier_stats(self, index: int = 1):
        return self.client.get_stats(self.pool).pools[0].tiers[index]

    def settle_cascades(self) -> None:
        wait_tier_jobs(self.stub, self.pool)

    def close(self) -> None:
        self.region.close()
        self.client.close()


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + fsformat.BLOCK_SUFFIX))


def file_of(root: Path, pool: str, key: bytes, layout: str = "L") -> Path:
    """Where the daemon keeps ``key`` of ``pool`` under ``root``."""
    pool_dir = fsformat.pool_dir_name(blockformat.PoolIdentity(pool, BLOCK, layout))
    return root / pool_dir / fsformat.block_rel_path(key)
