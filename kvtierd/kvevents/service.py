"""The KV-event publisher as the daemon runs it (``[kv_events]``;
docs/design/kv-events.md): which pools are published, what the request path
hands over, and what survives a restart.

Request path: ``CompleteStore`` hands the keys' descriptions over
(:meth:`KvEventsService.describe`), then each of the pool's events
(:meth:`KvEventsService.observe`): one append each, whatever the number of keys.
The publisher's thread applies them to its
:class:`~kvtierd.kvevents.translator.Translator` (the description table,
first writer wins) and sends what changes for routers.

Restart: the publisher's first message is ``AllBlocksCleared``; at stop, once the
thread has ended, the published pools' descriptions are saved
(``<state dir>/kv-events/``); when a pool opens again the keys its tiers still
hold (asked on the loop, once every tier is ready) are handed over as a seed and
re-announced. A hand-over the queue's bound refuses makes the thread send
``AllBlocksCleared`` and drop its table.

Event-loop only, except the publisher's own thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from kvtierd.config.sections import KvEventsConfig
from kvtierd.contract import BlockEvent, BlockKey
from kvtierd.kvevents.publisher import EventPublisher, PublisherStats
from kvtierd.kvevents.translator import Translator
from kvtierd_client.wire.descriptions import description_problem
from kvtierd_client.wire.proto import pb2

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 2  # rows [key, serialized BlockDescription]
MAX_SNAPSHOT_BYTES = 1 << 31
KEY_COST = 320  # what a described key is assumed to take in the hand-over queue


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
    cleared: int


def item_cost(item: tuple[Any, ...]) -> int:
    """What an item is assumed to take in the hand-over queue (no key is looked at)."""
    kind = item[0]
    if kind == "event":
        return 64 + KEY_COST * len(item[2].keys)
    if kind == "describe":
        return 64 + KEY_COST * len(item[2])
    return 64 + KEY_COST * len(item[2])


class KvEventsService:
    """The daemon's publisher: one endpoint, the pools ``config.pools`` names."""

    def __init__(self, config: KvEventsConfig, state_dir: str, socket_gid: int | None) -> None:
        self.config = config
        self._state_dir = os.path.join(state_dir, "kv-events")
        identity = config.identity or socket.gethostname()
        names = config.engines or (identity,)
        self.translator = Translator(config.max_description_bytes)
        self.publisher = EventPublisher(
            config.endpoint,
            config.replay_endpoint,
            [f"kv@{name}@{config.model}".encode() for name in names],
            render=self.translator.apply,
            cost=item_cost,
            on_lost=self.translator.clear,
            connect=config.connect,
            queue_bytes=config.replay_bytes,
            replay_bytes=config.replay_bytes,
            socket_gid=socket_gid,
        )
        self._pools: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def publishes(self, pool_name: str) -> bool:
        return pool_name in self.config.pools

    def start(self) -> None:
        """Starts the thread; its first message says routers must forget this
        publisher's blocks (whatever a previous daemon announced)."""
        self.publisher.lost = True  # the thread's first message: AllBlocksCleared
        self.publisher.start()
        log.info(
            "kv events: publishing pools %s on %s%s (topics %s)",
            ", ".join(self.config.pools), self.config.endpoint,
            f", replays on {self.config.replay_endpoint}" if self.config.replay_endpoint else "",
            ", ".join(t.decode() for t in self.publisher.topics),
        )  # fmt: skip

    # -- the request path: one append per call ---------------------------------------

    def describe(self, pool: str, keys: Sequence[BlockKey], descriptions: Sequence[Any]) -> None:
        """Hands a CompleteStore's descriptions (validated) over, before its events."""
        self.publisher.publish([("describe", pool, keys, descriptions)])

    def observe(self, pool: str, event: BlockEvent) -> None:
        """Hands one of the pool's events over."""
        self.publisher.publish([("event", pool, event)])

    # -- pools opening, the daemon stopping ---------------------------------------------

    def attach(self, pool: PublishedPool) -> None:
        """``pool`` opened: its events are published from now on; the blocks its tiers
        kept from before (a saved snapshot's) are re-announced once they are ready."""
        self._pools.add(pool.name)
        task = asyncio.get_running_loop().create_task(self._reannounce(pool))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reannounce(self, pool: PublishedPool) -> None:
        saved = await off_loop(self._load_snapshot, pool.name)
        if not saved:
            return
        await pool.wait_tiers_ready()
        kept = [(key, raw, holders) for key, raw in saved if (holders := pool.holders(key))]
        log.info("kv events: pool %s: re-announcing %d of %d saved descriptions (still held)",
                 pool.name, len(kept), len(saved))  # fmt: skip
        self.publisher.publish([("seed", pool.name, kept)], bounded=False)

    async def stop(self) -> None:
        """Stops the thread (what is queued is sent), then saves the published pools'
        descriptions."""
        for task in list(self._tasks):
            task.cancel()
        await off_loop(self.publisher.stop)
        table = self.translator.table
        snapshots = {name: [(key, e.raw) for key, e in table.entries(name)] for name in self._pools}
        await off_loop(self._save_snapshots, snapshots)

    def stats(self) -> KvEventsStats:
        table = self.translator.table
        return KvEventsStats(
            self.publisher.stats(),
            len(table),
            table.used_bytes,
            table.dropped,
            self.translator.undescribed_stores,
            self.translator.cleared,
        )

    # -- the snapshot (a worker thread) ------------------------------------------------

    def _snapshot_path(self, pool: str) -> str:
        digest = hashlib.sha256(pool.encode()).hexdigest()[:32]
        return os.path.join(self._state_dir, f"{digest}.msgpack")

    def _save_snapshots(self, snapshots: dict[str, list[tuple[BlockKey, bytes]]]) -> None:
        os.makedirs(self._state_dir, mode=0o700, exist_ok=True)
        for pool, entries in snapshots.items():
            rows = [[key, raw] for key, raw in entries]
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

    def _load_snapshot(self, pool: str) -> list[tuple[BlockKey, bytes]]:
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
