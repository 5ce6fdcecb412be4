"""Presence probes of one configured redis tier: pipelined ``EXISTS``, one in flight per node.

A pool's :class:`~kvtierd.tiers.redis.tier.RedisTier` knows the keys it stored
(its :class:`~kvtierd.tiers.redis.keybook.KeyBook`); about any other key it asks
the server. Every pool of a configured tier asks
through one :class:`Prober`, which keeps, per master:

* the keys waiting for that node's next probe (at most :data:`MAX_WANTED_PER_NODE`;
  past it a key is not queued and stays unknown: MISS until a later lookup asks);
* at most one probe in flight: one pipeline of ``EXISTS`` holding every key that
  was waiting when it left (redis-py's ``per_node``: written whole, then read: one
  round trip).

Lookups share probes: :meth:`Prober.ask` puts the keys with their node's waiting
keys and hands back the future of the probe that will answer each (the one in
flight when it carries the key, else the next), and the probes of the keys asked
during one loop turn leave together at the end of it. A node whose probe is slow
or hung holds only its own keys: the other nodes' probes go on (each probe runs on
its own thread of :data:`PROBE_THREADS`; one per node in flight, so a hung node
takes one thread).

Answers go to the tier that asked (a :class:`ProbeListener`), on the loop, before
the probe's future completes: a Lookup woken by it finds them. A node that fails
its probe leaves its keys unknown (the listener is told once per probe); the
other nodes' answers stand.

Routing: a key's node is read from the client's slot map on the loop (a CRC and
a dictionary read, no I/O; ``RedisLink.route``); before the client is built (the
server was down when the first pool started) keys wait under no node name and
the probe's thread builds the client. A slot that moved meanwhile is followed by
``per_node`` (a redirect), so a probe is never wrong, at worst slower.

Loop state (``_nodes``, every future) is touched on the loop only; the threads
take a probe's keys and give back its answers, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis

from kvtierd.contract import BlockKey
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.util.loopfuture import complete

log = logging.getLogger(__name__)

MAX_WANTED_PER_NODE = 8192  # keys waiting for one node's next probe (~2 MiB at 256 B)
PROBE_THREADS = 4  # probes in flight at once (one per node); a hung node holds one
UNROUTED = ""  # the node name of keys asked before the client knew the slot map


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    """What one probe told one listener: ``answers``, each key asked and whether the
    server holds it (None: its node failed, ``error`` says why); ``sent_at``: when the
    probe left (monotonic)."""

    answers: list[tuple[BlockKey, bool | None]]
    sent_at: float
    error: BaseException | None


class ProbeListener(Protocol):
    """The tier that asked: told each answer of its keys, on the loop."""

    def probe_answered(self, answer: ProbeAnswer) -> None:
        """The answers of one probe about keys this listener asked."""


# a probe's outcome on the thread: each key's EXISTS reply (or its error), nodes failed
Replies = tuple[list[object], int]


@dataclass(slots=True)
class _Node:
    """One node's probes: the keys waiting for the next one, the one in flight."""

    wanted: dict[bytes, tuple[ProbeListener, BlockKey]] = field(default_factory=dict)
    next_future: asyncio.Future[None] | None = None  # completed by the next probe
    flying: dict[bytes, tuple[ProbeListener, BlockKey]] | None = None
    flying_future: asyncio.Future[None] | None = None


class Prober:
    """The probes of one configured redis tier (module doc). Loop-side object;
    its threads start at the first probe."""

    def __init__(self, link: RedisLink, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._link = link
        self._loop = loop
        self._name = name
        self._nodes: dict[str, _Node] = {}
        self._start_scheduled = False
        self._work: queue.SimpleQueue[tuple[str, list[bytes], float] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.probes = 0  # probes sent (one per node and round)

    # -- loop ------------------------------------------------------------------------

    def ask(
        self, listener: ProbeListener, keys: Sequence[tuple[bytes, BlockKey]]
    ) -> list[asyncio.Future[None]]:
        """Queues each (Redis key, block key) for its node's probe (or finds it in the
        one in flight); the futures of the probes that will answer them. A key not
        queued (its node's queue full, the prober closed) gets none."""
        if self._closed:
            return []
        futures: dict[int, asyncio.Future[None]] = {}
        for redis_key, key in keys:
            future = self._queue(self._link.route(redis_key) or UNROUTED, redis_key, listener, key)
            if future is not None:
                futures[id(future)] = future
        if futures and not self._start_scheduled:
            self._start_scheduled = True  # this loop turn's asks leave together
            self._loop.call_soon(self._start_all)
        return list(futures.values())

    def _queue(
        self, name: str, redis_key: bytes, listener: ProbeListener, key: BlockKey
    ) -> asyncio.Future[None] | None:
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = _Node()
        if node.flying is not None and redis_key in node.flying:
            return node.flying_future
        if redis_key not in node.wanted:
            if len(node.wanted) >= MAX_WANTED_PER_NODE:
                return None
            node.wanted[redis_key] = (listener, key)
        if node.next_future is None:
            node.next_future = self._loop.create_future()
        return node.next_future

    def _start_all(self) -> None:
        self._start_scheduled = False
        for name in list(self._nodes):
            self._start(name)

    def _start(self, name: str) -> None:
        node = self._nodes[name]
        if node.flying is not None or self._closed:
            return
        if not node.wanted:
            del self._nodes[name]  # nothing waits: forget the node (topology changes)
            return
        node.flying, node.flying_future = node.wanted, node.next_future
        node.wanted, node.next_future = {}, None
        self._ensure_threads()
        self.probes += 1
        self._work.put((name, list(node.flying), time.monotonic()))

    def _answered(self, name: str, sent_at: float, outcome: Replies | BaseException) -> None:
        """Loop: a probe of node ``name`` came back; its keys' listeners are told, then
        its future completes and the node's next probe leaves."""
        node = self._nodes.get(name)
        if node is None or node.flying is None:
            return
        flying, future = node.flying, node.flying_future
        node.flying = node.flying_future = None
        if isinstance(outcome, BaseException):
            replies: list[object] = [outcome] * len(flying)
        else:
            replies = outcome[0]
        by_listener: dict[int, tuple[ProbeListener, list[tuple[BlockKey, bool | None]]]] = {}
        error: BaseException | None = None
        for (listener, key), reply in zip(flying.values(), replies, strict=True):
            if isinstance(reply, BaseException):
                error, present = reply, None
            else:
                present = bool(reply)
            by_listener.setdefault(id(listener), (listener, []))[1].append((key, present))
        for listener, answers in by_listener.values():
            try:
                listener.probe_answered(ProbeAnswer(answers, sent_at, error))
            except Exception:
                log.exception("redis tier %s: a probe's answer could not be taken", self._name)
        if future is not None:
            complete(future)
        self._start(name)

    def close(self) -> None:
        """No more probes; every waiting Lookup is woken (its keys stay unknown).
        Threads busy with a probe finish it (bounded by the link's call deadline)."""
        self._closed = True
        for node in self._nodes.values():
            for future in (node.next_future, node.flying_future):
                if future is not None:
                    complete(future)
        self._nodes.clear()
        for _ in self._threads:
            self._work.put(None)

    # -- threads -----------------------------------------------------------------------

    def _ensure_threads(self) -> None:
        if self._threads:
            return
        for i in range(PROBE_THREADS):
            thread = threading.Thread(
                target=self._run, name=f"kvtierd-{self._name}-probe{i}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            name, redis_keys, sent_at = item
            outcome: Replies | BaseException
            try:
                outcome = self._link.per_node("EXISTS", redis_keys)
            except (redis.RedisError, OSError) as exc:  # no client (server unreachable)
                outcome = exc
            except Exception as exc:  # a bug: the keys stay unknown, the thread lives
                log.exception("redis tier %s: a presence probe failed", self._name)
                outcome = exc
            self._deliver(functools.partial(self._answered, name, sent_at, outcome))

    def _deliver(self, answer: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            self._loop.call_soon_threadsafe(answer)
