"""The KV-event publisher as the daemon runs it (``[kv_events]``;
docs/design/kv-events.md): which pools are published, how a pool's block events
become vLLM's events, and what survives a restart.

Request path: ``CompleteStore`` hands the keys' descriptions to :meth:`describe`
(kept in the :class:`~kvtierd.kvevents.descriptions.DescriptionTable`, first
writer wins), then the pool's events reach :meth:`observe`, which turns each
into ``BlockStored`` / ``BlockRemoved`` per medium and hands them to the
publisher thread: dictionary work and one append, nothing that waits.

Per medium, not per tier: a key is published ``CPU`` while the primary holds it
and ``STORAGE`` while at least one secondary tier does (stored when the first
takes it, removed when the last drops it), so a router never loses a block one
storage tier still holds. A key without a description is published nowhere.

Restart: the publisher's first message is ``AllBlocksCleared``; the published
pools' descriptions are saved at stop (``<state dir>/kv-events/``) and, when a
pool opens again, the described keys its tiers still hold are re-announced
once every tier is ready. A refused hand-over (the queue's byte bound) is
answered the same way: ``AllBlocksCleared``, then every held block again.

Event-loop only, except the publisher's own thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from kvtierd.config.sections import KvEventsConfig
from kvtierd.contract import BlockEvent, BlockKey, Medium
from kvtierd.kvevents import wireformat
from kvtierd.kvevents.descriptions import Described, DescriptionTable
from kvtierd.kvevents.publisher import EventPublisher, PublisherStats, now

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
MAX_SNAPSHOT_BYTES = 1 << 31


class PublishedPool(Protocol):
    """What the service reads of a pool (kvtierd.core.pool.Pool)."""

    @property
    def name(self) -> str: ...

    def holders(self, key: BlockKey) -> list[tuple[str, int]]:
        """(tier name, Medium) of each tier that holds ``key`` now, primary first."""
        ...

    async def wait_tiers_ready(self) -> None: ...


@dataclass(frozen=True, slots=True)
class KvEventsStats:
    publisher: PublisherStats
    described_keys: int
    description_bytes: int
    dropped_descriptions: int
    undescribed_stores: int


def medium_name(medium: int) -> str:
    return wireformat.MEDIUM_CPU if medium == Medium.CPU else wireformat.MEDIUM_STORAGE


class KvEventsService:
    """The daemon's publisher: one endpoint, the pools ``config.pools`` names."""

    def __init__(self, config: KvEventsConfig, state_dir: str, socket_gid: int | None) -> None:
        self.config = config
        self._state_dir = os.path.join(state_dir, "kv-events")
        identity = config.identity or socket.gethostname()
        names = config.engines or (identity,)
        self.publisher = EventPublisher(
            config.endpoint,
            config.replay_endpoint,
            [wireformat.topic(name, config.model) for name in names],
            connect=config.connect,
            queue_bytes=config.replay_bytes,
            replay_bytes=config.replay_bytes,
            socket_gid=socket_gid,
        )
        self.table = DescriptionTable(config.max_description_bytes)
        self._pools: dict[str, PublishedPool] = {}
        self._undescribed_stores = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def publishes(self, pool_name: str) -> bool:
        return pool_name in self.config.pools

    def start(self) -> None:
        """Starts the thread; the first message says routers must forget this
        publisher's blocks (whatever a previous daemon announced)."""
        self.publisher.start()
        self.publisher.publish([wireformat.ALL_BLOCKS_CLEARED], now())
        log.info(
            "kv events: publishing pools %s on %s%s (topics %s)",
            ", ".join(self.config.pools), self.config.endpoint,
            f", replays on {self.config.replay_endpoint}" if self.config.replay_endpoint else "",
            ", ".join(t.decode() for t in self.publisher.topics),
        )  # fmt: skip

    # -- the request path ---------------------------------------------------------

    def describe(self, pool: str, keys: Sequence[BlockKey], descriptions: Sequence[Any]) -> None:
        """Keeps the descriptions (``pb2.BlockDescription``, co-indexed with ``keys``,
        already validated) of keys that have none."""
        events: list[dict[str, Any]] = []
        for key, wire in zip(keys, descriptions, strict=True):
            if not wire.block_hashes:
                continue
            described = Described(
                tuple(wire.block_hashes),
                wire.parent_block_hash if wire.HasField("parent_block_hash") else None,
                array("I", wire.token_ids),
                wire.block_size,
                wire.lora_name,
                wire.group_idx,
            )
            for _pool, dropped in self.table.offer(pool, key, described):
                events += _removals(dropped, set(dropped.tiers.values()))
        self._hand_over(events)

    def observe(self, pool: str, event: BlockEvent) -> None:
        """Publishes what ``event`` (a pool's stored / removed blocks in one tier)
        changes for routers."""
        medium = medium_name(event.medium)
        events: list[dict[str, Any]] = []
        table = self.table
        if event.removed:
            removed: list[Described] = []
            for key in event.keys:
                entry = table.removed(pool, key, event.tier)
                if entry is not None and not entry.holds(medium):
                    removed.append(entry)
            events = _removals_of(removed, medium)
        else:
            for key in event.keys:
                entry = table.get(pool, key)
                if entry is None:
                    self._undescribed_stores += 1
                    continue
                fresh = not entry.holds(medium)
                table.stored(pool, key, event.tier, medium)
                if fresh:
                    events.append(_stored(entry, medium))
        self._hand_over(events)

    def _hand_over(self, events: list[dict[str, Any]]) -> None:
        if self.publisher.lost:
            self._reannounce_all()
        if events and not self.publisher.publish(events, now()):
            self._reannounce_all()

    def _reannounce_all(self) -> None:
        """After a refused hand-over: clear, then every held described block again
        (one list, bounded by the table's bytes)."""
        self.publisher.lost = False
        events = [wireformat.ALL_BLOCKS_CLEARED]
        for pool in self._pools:
            for _key, entry in self.table.entries(pool):
                events += [_stored(entry, m) for m in sorted(set(entry.tiers.values()))]
        self.publisher.publish_unbounded(events, now())

    # -- pools opening, the daemon stopping ---------------------------------------------

    def attach(self, pool: PublishedPool) -> None:
        """``pool`` opened: its events are published from now on; the blocks its tiers
        kept from before (a saved snapshot's) are re-announced once they are ready."""
        self._pools[pool.name] = pool
        task = asyncio.get_running_loop().create_task(self._reannounce(pool))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reannounce(self, pool: PublishedPool) -> None:
        saved = await off_loop(self._load_snapshot, pool.name)
        if not saved:
            return
        await pool.wait_tiers_ready()
        events: list[dict[str, Any]] = []
        for key, described in saved:
            holders = pool.holders(key)
            if not holders or self.table.get(pool.name, key) is not None:
                continue  # gone, or stored (and described) again since the pool opened
            for _pool, dropped in self.table.offer(pool.name, key, described):
                events += _removals(dropped, set(dropped.tiers.values()))
            for tier, medium in holders:
                self.table.stored(pool.name, key, tier, medium_name(medium))
            events += [_stored(described, m) for m in sorted(set(described.tiers.values()))]
        log.info("kv events: pool %s: re-announced %d described blocks kept from before",
                 pool.name, len(events))  # fmt: skip
        self._hand_over(events)

    async def stop(self) -> None:
        """Saves the published pools' descriptions, then stops the thread."""
        for task in list(self._tasks):
            task.cancel()
        snapshots = {name: self.table.entries(name) for name in self._pools}
        await off_loop(self._save_snapshots, snapshots)
        await off_loop(self.publisher.stop)

    def stats(self) -> KvEventsStats:
        return KvEventsStats(
            self.publisher.stats(),
            len(self.table),
            self.table.used_bytes,
            self.table.dropped,
            self._undescribed_stores,
        )

    # -- the snapshot (a worker thread) ------------------------------------------------

    def _snapshot_path(self, pool: str) -> str:
        digest = hashlib.sha256(pool.encode()).hexdigest()[:32]
        return os.path.join(self._state_dir, f"{digest}.msgpack")

    def _save_snapshots(self, snapshots: dict[str, list[tuple[BlockKey, Described]]]) -> None:
        os.makedirs(self._state_dir, mode=0o700, exist_ok=True)
        for pool, entries in snapshots.items():
            rows = [
                [key, list(d.block_hashes), d.parent_block_hash, d.token_ids.tobytes(),
                 d.block_size, d.lora_name, d.group_idx]
                for key, d in entries
            ]  # fmt: skip
            body = msgpack.packb([SNAPSHOT_VERSION, pool, rows], use_bin_type=True)
            path = self._snapshot_path(pool)
            temporary = f"{path}.{os.getpid()}.tmp"
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
            log.info("kv events: pool %s: saved %d block descriptions", pool, len(rows))

    def _load_snapshot(self, pool: str) -> list[tuple[BlockKey, Described]]:
        """The saved descriptions of ``pool`` (the file is then removed: it is
        rewritten at the next stop), or [] when none or unreadable (logged)."""
        path = self._snapshot_path(pool)
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
            out = [
                (bytes(key), Described(tuple(hashes), parent, _tokens(tokens), size, lora, group))
                for key, hashes, parent, tokens, size, lora, group in rows
            ]
        except Exception as exc:  # noqa: BLE001 - any damage: re-announce nothing
            log.warning("kv events: %s is unreadable (%s); nothing re-announced", path, exc)
            return []
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        return out


def _tokens(raw: bytes) -> array:
    tokens = array("I")
    tokens.frombytes(raw)
    return tokens


def _stored(entry: Described, medium: str) -> dict[str, Any]:
    return wireformat.block_stored(
        entry.block_hashes,
        entry.parent_block_hash,
        entry.token_ids,
        entry.block_size,
        medium,
        entry.lora_name,
        entry.group_idx,
    )


def _removals_of(entries: list[Described], medium: str) -> list[dict[str, Any]]:
    """One ``BlockRemoved`` per KV cache group for ``entries`` in ``medium``."""
    by_group: dict[int, list[int]] = {}
    for entry in entries:
        by_group.setdefault(entry.group_idx, []).extend(entry.block_hashes)
    return [wireformat.block_removed(h, medium, group) for group, h in by_group.items()]


def _removals(entry: Described, mediums: set[str]) -> list[dict[str, Any]]:
    return [e for medium in sorted(mediums) for e in _removals_of([entry], medium)]


async def off_loop(function: Any, *args: Any) -> Any:
    """``function(*args)`` on a new daemon thread (file I/O of the snapshots), its
    result or error; a daemon thread is never waited for at exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Any, value: Any) -> None:
        if not future.done():
            setter(value)

    def body() -> None:
        try:
            result = function(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=body, name="kvtierd-kv-events-io", daemon=True).start()
    return await future
