"""The KV-event publisher as the daemon runs it (``[kv_events]``;
docs/design/kv-events.md): which pools are published, what the request path
hands over, and what survives a restart.

The publishing itself runs in a process of its own (:mod:`kvtierd.kvevents.worker`,
its own interpreter: turning events into messages never takes the daemon's
interpreter lock). Request path: ``CompleteStore`` hands its request (keys and
descriptions) over (:meth:`KvEventsService.describe`), then each of the pool's
events (:meth:`KvEventsService.observe`): one msgpack frame written without
blocking to a ``SOCK_SEQPACKET`` socket, whatever the number of keys. The socket's
buffer is the bound: a frame it refuses is dropped and counted, and the worker is
told (``lost``) at the next frame that fits: it clears routers and its table.

Restart: the worker's first message is ``AllBlocksCleared``; at stop it saves the
published pools' descriptions (:mod:`kvtierd.kvevents.snapshots`); when a pool
opens again the keys its tiers still hold (asked on the loop, once every tier is
ready) are handed over as a seed and re-announced. A worker that dies is started
again (a new ``AllBlocksCleared``, an empty table).

Event-loop only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import msgpack

from kvtierd.config.sections import KvEventsConfig
from kvtierd.contract import BlockEvent, BlockKey
from kvtierd.kvevents.publisher import PublisherStats
from kvtierd.kvevents.snapshots import load_snapshot
from kvtierd.kvevents.worker import MAX_FRAME
from kvtierd.util.offloop import off_loop

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0  # seconds a new worker may take to bind and say ready
STOP_TIMEOUT = 30.0  # seconds a stopping worker may take to send and save
RESPAWN_DELAY = 1.0  # seconds before a dead worker is started again
SOCKET_BUFFER = 4 << 20  # asked for; the kernel's limits may give less


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
    dropped_frames: int  # frames the socket's buffer refused (then "lost")
    restarts: int  # workers started again after one died


class KvEventsService:
    """The daemon's publisher: one endpoint, the pools ``config.pools`` names."""

    def __init__(self, config: KvEventsConfig, state_dir: str, socket_gid: int | None) -> None:
        self.config = config
        self._state_dir = os.path.join(state_dir, "kv-events")
        self._socket_gid = socket_gid
        self._identity = config.identity or socket.gethostname()
        self._channel: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._lost = False
        self._pending: list[list[Any]] = []  # frames of this turn of the loop
        self._pending_bytes = 0
        self._dropped_frames = 0
        self._restarts = 0
        self._stopping = False
        self._latest: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def publishes(self, pool_name: str) -> bool:
        return pool_name in self.config.pools

    async def start(self) -> None:
        """Starts the worker and waits until it has bound the endpoint (OSError
        saying why it could not)."""
        channel, process = self._spawn()
        try:
            answer = await off_loop(_answer, channel, START_TIMEOUT)
        except BaseException:
            process.kill()
            channel.close()
            raise
        if answer[0] != "ready":
            process.wait()
            channel.close()
            raise OSError(answer[1] if len(answer) > 1 else f"the publisher said {answer!r}")
        channel.setblocking(False)
        asyncio.get_running_loop().add_reader(channel, self._read)
        self._channel, self._process = channel, process
        log.info(
            "kv events: publishing pools %s on %s%s (topics %s; worker pid %d)",
            ", ".join(self.config.pools), self.config.endpoint,
            f", replays on {self.config.replay_endpoint}" if self.config.replay_endpoint else "",
            ", ".join(f"kv@{n}@{self.config.model}" for n in self.config.engines or
                      (self._identity,)),
            process.pid,
        )  # fmt: skip

    def _spawn(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        """The worker, its channel sent the setup (on the loop: the worker dies with
        the thread that started it, ``PR_SET_PDEATHSIG``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvtierd.kvevents.worker", str(os.getpid()),
                 str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        fields = asdict(self.config) | {"identity": self._identity}
        ours.sendall(msgpack.packb(["setup", fields, self._state_dir, self._socket_gid]))  # alone
        return ours, process

    # -- the request path: one frame per call ------------------------------------------

    def describe(self, pool: str, request: Any) -> None:
        """Hands a CompleteStore's keys and descriptions (validated) over, before its
        events."""
        body = request.SerializeToString()
        if len(body) + 512 <= MAX_FRAME // 2:
            self._send(["d", pool, body])
            return
        keys, descriptions = request.keys, request.descriptions
        per_frame = max(1, len(keys) * (MAX_FRAME // 2 - 512) // len(body))
        for start in range(0, len(keys), per_frame):
            part = type(request)(
                keys=keys[start : start + per_frame],
                descriptions=descriptions[start : start + per_frame],
            )
            self._send(["d", pool, part.SerializeToString()])

    def observe(self, pool: str, event: BlockEvent) -> None:
        """Hands one of the pool's events over."""
        keys = event.keys
        per_frame = max(1, (MAX_FRAME // 2 - 512) // (8 + max(map(len, keys), default=1)))
        for start in range(0, len(keys), per_frame):
            part = list(keys[start : start + per_frame])
            self._send(["e", pool, event.tier, int(event.medium), event.removed, part])

    def _send(self, frame: list[Any]) -> None:
        """Queues ``frame``; the frames of one turn of the loop (a CompleteStore's
        descriptions and its events) leave together, in one write, at its end."""
        if self._channel is None:
            return  # stopped, or a dead worker not started again yet (it starts clear)
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(frame)
        self._pending_bytes += _frame_size(frame)
        if self._pending_bytes > MAX_FRAME // 2:
            self._flush()

    def _flush(self) -> None:
        frames, self._pending, self._pending_bytes = self._pending, [], 0
        channel = self._channel
        if channel is None or not frames:
            return
        try:
            if self._lost:
                channel.send(msgpack.packb([["lost"]]))
                self._lost = False
            channel.send(msgpack.packb(frames))
        except BlockingIOError:
            self._lost = True
            self._dropped_frames += len(frames)
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            self._worker_died()

    # -- what the worker says ----------------------------------------------------------

    def _read(self) -> None:
        channel = self._channel
        if channel is None:
            return
        while True:
            try:
                frame = channel.recv(MAX_FRAME)
            except BlockingIOError:
                return
            except OSError:
                frame = b""
            if not frame:
                self._worker_died()
                return
            kind, *rest = msgpack.unpackb(frame, raw=False)
            if kind == "stats":
                self._latest = rest[0]

    def _worker_died(self) -> None:
        if self._channel is None:
            return
        asyncio.get_running_loop().remove_reader(self._channel)
        self._channel.close()
        self._channel = None
        process, self._process = self._process, None
        if self._stopping:
            return
        code = process.poll() if process is not None else None
        log.error(
            "kv events: the publisher process (pid %s) ended%s; starting another in %gs (it "
            "clears routers first: blocks are announced again as they are stored)",
            process.pid if process else "?", f" with status {code}" if code is not None else "",
            RESPAWN_DELAY,
        )  # fmt: skip
        if process is not None and code is None:
            process.kill()
        self._later(self._respawn())

    async def _respawn(self) -> None:
        await asyncio.sleep(RESPAWN_DELAY)
        if self._stopping:
            return
        try:
            await self.start()
        except OSError as exc:
            log.error("kv events: the publisher could not start again: %s", exc)
            self._later(self._respawn())
            return
        self._restarts += 1

    def _later(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- pools opening, the daemon stopping ---------------------------------------------

    def attach(self, pool: PublishedPool) -> None:
        """``pool`` opened: its events are published from now on; the blocks its tiers
        kept from before (a saved snapshot's) are re-announced once they are ready."""
        self._later(self._reannounce(pool))

    async def _reannounce(self, pool: PublishedPool) -> None:
        saved = await off_loop(load_snapshot, self._state_dir, pool.name)
        if not saved:
            return
        await pool.wait_tiers_ready()
        kept = [[key, raw, holders] for key, raw in saved if (holders := pool.holders(key))]
        log.info("kv events: pool %s: re-announcing %d of %d saved descriptions (still held)",
                 pool.name, len(kept), len(saved))  # fmt: skip
        size = 0
        part: list[Any] = []
        for row in kept:
            part.append(row)
            size += len(row[0]) + len(row[1]) + 64
            if size > MAX_FRAME // 4:
                self._send(["s", pool.name, part])
                part, size = [], 0
        if part:
            self._send(["s", pool.name, part])

    async def stop(self) -> None:
        """Tells the worker to stop (it sends what is queued and saves the published
        pools' descriptions) and waits for it, at most STOP_TIMEOUT seconds."""
        self._flush()
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        channel, process = self._channel, self._process
        if channel is None or process is None:
            return
        asyncio.get_running_loop().remove_reader(channel)
        self._channel = None
        channel.setblocking(True)
        try:
            await off_loop(_stop_worker, channel, process, self._latest)
        finally:
            channel.close()

    def stats(self) -> KvEventsStats:
        latest = self._latest
        return KvEventsStats(
            PublisherStats(
                latest.get("messages", 0), latest.get("events", 0),
                latest.get("refused_items", 0), latest.get("replays", 0),
                latest.get("last_seq", -1),
            ),
            latest.get("described_keys", 0),
            latest.get("description_bytes", 0),
            latest.get("dropped_descriptions", 0),
            latest.get("undescribed_stores", 0),
            latest.get("cleared", 0),
            self._dropped_frames,
            self._restarts,
        )  # fmt: skip


def _frame_size(frame: list[Any]) -> int:
    """About a frame's packed bytes (its payload: bytes or a list of keys)."""
    payload = frame[-1]
    if isinstance(payload, bytes):
        return len(payload) + 64
    if frame[0] == "e":
        return 64 + sum(len(key) + 2 for key in payload)
    return 64 + sum(len(row[0]) + len(row[1]) + 64 for row in payload)


def _answer(channel: socket.socket, timeout: float) -> list[Any]:
    """The worker's first answer (a worker thread: it blocks)."""
    channel.settimeout(timeout)
    try:
        frame = channel.recv(MAX_FRAME)
    except TimeoutError:
        return ["error", f"kv_events: the publisher did not start within {timeout:g}s"]
    if not frame:
        return ["error", "kv_events: the publisher process ended at its start"]
    answer: list[Any] = msgpack.unpackb(frame, raw=False)
    return answer


def _stop_worker(
    channel: socket.socket, process: subprocess.Popen[bytes], latest: dict[str, int]
) -> None:
    """Sends ``stop``, keeps the last stats, waits for ``stopped`` and the exit."""
    channel.settimeout(STOP_TIMEOUT)
    try:
        channel.sendall(msgpack.packb([["stop"]]))
        while True:
            frame = channel.recv(MAX_FRAME)
            if not frame:
                break
            kind, *rest = msgpack.unpackb(frame, raw=False)
            if kind == "stats":
                latest.update(rest[0])
            elif kind == "stopped":
                break
    except OSError as exc:  # a timeout, or the worker gone
        log.warning("kv events: the publisher did not stop cleanly (%s); killing it", exc)
        process.kill()
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
