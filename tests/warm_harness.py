"""Rows, journals and restarts for the warm-restart integration tests: ``content`` of a
key, rows written and read straight in a region file, a store through a session, and a
daemon restarted on the same state directory."""

from __future__ import annotations

import hashlib
import mmap
import signal
from pathlib import Path

from daemon_harness import DaemonProcess

from kvtierd_client.client import LookupResult

BLOCK = 8192


HIT = LookupResult.HIT


MISS = LookupResult.MISS


def content(key: bytes, block_bytes: int = BLOCK) -> bytes:
    """The bytes a test stores under ``key``: derived from it, so any mix-up shows."""
    seed = hashlib.sha256(key).digest()
    return (seed * (block_bytes // len(seed) + 1))[:block_bytes]


def write_rows(path: str, rows: dict[int, bytes], block_bytes: int = BLOCK) -> None:
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as region:
        for row, data in rows.items():
            region[row * block_bytes : (row + 1) * block_bytes] = data


def read_row(path: str, row: int, block_bytes: int = BLOCK) -> bytes:
    with open(path, "rb") as file:
        file.seek(row * block_bytes)
        return file.read(block_bytes)


def store(session, keys: list[bytes], block_bytes: int = BLOCK) -> dict[bytes, int]:
    grant = session.prepare_store(keys)
    assert grant is not None and grant.keys_to_store == keys
    write_rows(
        session.region.path,
        {row: content(key, block_bytes) for key, row in zip(keys, grant.block_ids, strict=True)},
        block_bytes,
    )
    session.complete_store(keys)
    return dict(zip(keys, grant.block_ids, strict=True))


def assert_bit_exact(session, keys: list[bytes], block_bytes: int = BLOCK) -> None:
    rows = session.prepare_load(keys)
    for key, row in zip(keys, rows, strict=True):
        assert read_row(session.region.path, row, block_bytes) == content(key, block_bytes), key
    session.complete_load(keys)


def journal_of(region_path: str) -> Path:
    return Path(region_path[: -len(".region")] + ".journal")


def restart(daemon: DaemonProcess, sig: int = signal.SIGTERM) -> DaemonProcess:
    daemon.stop(sig)
    return daemon.restart()


BLOCKS = 64
