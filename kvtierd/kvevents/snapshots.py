"""The published pools' descriptions across a restart: saved by the publisher's
process when it stops (``<state dir>/kv-events/<sha256 of the pool>.msgpack``,
0600 in a 0700 directory, written to a temporary name, fsynced and renamed), read
by the daemon when the pool opens again (without following links; a damaged file
re-announces nothing) and removed once read, so a crash never re-announces a
stale set. Files only: called off the event loop."""

from __future__ import annotations

import hashlib
import logging
import os

import msgpack

from kvtierd.contract import BlockKey
from kvtierd_client.wire.descriptions import description_problem
from kvtierd_client.wire.proto import pb2

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 2  # rows [key, serialized BlockDescription]
MAX_SNAPSHOT_BYTES = 1 << 31


def snapshot_path(state_dir: str, pool: str) -> str:
    digest = hashlib.sha256(pool.encode()).hexdigest()[:32]
    return os.path.join(state_dir, f"{digest}.msgpack")


def save_snapshots(state_dir: str, snapshots: dict[str, list[tuple[BlockKey, bytes]]]) -> None:
    """Writes each pool's (key, serialized description) rows."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    for pool, rows in snapshots.items():
        body = msgpack.packb([SNAPSHOT_VERSION, pool, [list(row) for row in rows]])
        path = snapshot_path(state_dir, pool)
        temporary = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        log.info("kv events: pool %s: saved %d block descriptions", pool, len(rows))


def load_snapshot(state_dir: str, pool: str) -> list[tuple[BlockKey, bytes]]:
    """The saved descriptions of ``pool`` (the file is then removed: it is rewritten
    at the next stop), or [] when none or unreadable (logged)."""
    path = snapshot_path(state_dir, pool)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("kv events: cannot open %s (%s); nothing re-announced", path, exc)
        return []
    try:
        with os.fdopen(fd, "rb") as handle:
            body = handle.read(MAX_SNAPSHOT_BYTES + 1)
        version, name, rows = msgpack.unpackb(body, raw=False, strict_map_key=True)
        if version != SNAPSHOT_VERSION or name != pool or len(body) > MAX_SNAPSHOT_BYTES:
            raise ValueError(f"version {version}, pool {name!r}")
        out = [(bytes(key), _checked(bytes(raw))) for key, raw in rows]
    except Exception as exc:  # noqa: BLE001 - any damage: re-announce nothing
        log.warning("kv events: %s is unreadable (%s); nothing re-announced", path, exc)
        return []
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


def _checked(raw: bytes) -> bytes:
    """A saved description, parsed and checked as one from the wire is (ValueError)."""
    wire = pb2.BlockDescription.FromString(raw)
    parent = wire.parent_block_hash if wire.HasField("parent_block_hash") else None
    problem = description_problem(wire.block_hashes, parent, wire.token_ids, wire.block_size)
    if problem is not None:
        raise ValueError(f"a saved description {problem}")
    return raw
