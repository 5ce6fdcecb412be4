"""The fleet benchmark's exact model: what a fleet would hit with synchronous remote lookups.

Pure Python, no daemon: N nodes, each an exact LRU primary of ``node_blocks``
blocks, and one shared tier (Redis) that is an exact LRU of ``remote_blocks``
blocks (``None``: unbounded; 0: no shared tier). Requests are replayed one at a
time in trace order, each on the node its routing names, with vLLM's step
pattern and a remote lookup that always sees the shared tier:

1. the request's prefix chain (its blocks, duplicates dropped) is looked up: a
   block in the node's primary is a hit; a block the primary lacks but the shared
   tier holds is a hit too (promoted into the primary; the read makes it the
   shared tier's most recent); the chain's hits end at its first block that
   neither holds;
2. the hit blocks are loaded and touched: the most recent, the chain's first block
   most of all (the daemon's ``Touch``: a prefix's head is worth more than its tail);
3. the rest are computed, stored into the primary (its least recently used blocks
   evicted) and cascaded to the shared tier (a block it holds already is only
   made recent, as ``SET NX`` does).

Primary evictions are the daemon's: a lookup changes no recency, a load's touch
and a store do. The hit rate is hit blocks over blocks looked up, as the replay
counts it (:mod:`benchmarks.fleet`).

The shared tier evicts by exact LRU (:class:`ExactLru`, the ideal), or as the
Redis server does (:class:`RedisEviction`: ``allkeys-lru`` compares the idle time
of ``maxmemory-samples`` random keys per eviction, kept in a pool of the 16 best
candidates, on a clock of one-second resolution; ``allkeys-random``;
``noeviction`` refuses writes when full), given each request's arrival time in
seconds of the replay (the benchmark compresses the trace's time, so one tick of
the server's clock covers ``speedup`` seconds of the trace): the same synchronous
fleet with the server's own eviction, which isolates what asynchrony costs.

Routing (:func:`node_of`): ``rr`` round-robin by trace position;
``conversation`` by the request's first block (in the Mooncake traces every
reused prefix belongs to requests that share their first block: a conversation,
or an agent's fixed prompt).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from benchmarks.replay import Request

ROUTINGS = ("rr", "conversation")


class ExactLru:
    """A set of at most ``capacity`` keys (None: unbounded), least recently used first."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError("capacity must be >= 1 (or None: unbounded)")
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: int) -> None:
        """Makes a held key the most recent (an unknown key is ignored)."""
        if key in self._keys:
            self._keys.move_to_end(key)

    def put(self, key: int) -> None:
        """Holds ``key`` as the most recent, evicting the least recent to make room."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return
        if self.capacity is not None:
            while len(self._keys) >= self.capacity:
                self._keys.popitem(last=False)
        self._keys[key] = None


class RedisEviction:
    """A set of at most ``capacity`` keys evicting as a Redis server does (module doc):
    ``policy`` "allkeys-lru", "allkeys-random" or "noeviction". ``now`` is the time
    in seconds (the server's LRU clock is its integer part). Seeded: deterministic."""

    POOL = 16  # evict.c's EVPOOL_SIZE

    def __init__(self, capacity: int, policy: str, samples: int, seed: int = 1) -> None:
        if policy not in ("allkeys-lru", "allkeys-random", "noeviction"):
            raise ValueError(f"no model of maxmemory-policy {policy!r}")
        self.capacity, self.policy, self.samples = capacity, policy, samples
        self.now = 0.0
        self._clock: dict[int, int] = {}  # key -> the LRU clock of its last access
        self._keys: list[int] = []  # for sampling; _slot[key] is its index
        self._slot: dict[int, int] = {}
        self._pool: list[tuple[int, int]] = []  # (idle, key), ascending idle
        self._random = random.Random(seed)

    def __contains__(self, key: int) -> bool:
        return key in self._clock

    def touch(self, key: int) -> None:
        if key in self._clock:
            self._clock[key] = int(self.now)

    def put(self, key: int) -> None:
        if key in self._clock:
            self._clock[key] = int(self.now)
            return
        while len(self._clock) >= self.capacity:
            if self.policy == "noeviction":
                return  # the write is refused (OOM): the key is not stored
            self._remove(self._victim())
        self._clock[key] = int(self.now)
        self._slot[key] = len(self._keys)
        self._keys.append(key)

    def _victim(self) -> int:
        if self.policy == "allkeys-random":
            return self._keys[self._random.randrange(len(self._keys))]
        clock = int(self.now)
        for _ in range(self.samples):  # evictionPoolPopulate
            key = self._keys[self._random.randrange(len(self._keys))]
            entry = (clock - self._clock[key], key)
            if entry not in self._pool:
                self._pool.append(entry)
        self._pool.sort(key=lambda e: e[0])
        del self._pool[: max(0, len(self._pool) - self.POOL)]
        while self._pool:  # the best candidate that still exists (its idle as sampled)
            _, key = self._pool.pop()
            if key in self._clock:
                return key
        return self._keys[self._random.randrange(len(self._keys))]

    def _remove(self, key: int) -> None:
        del self._clock[key]
        slot = self._slot.pop(key)
        last = self._keys.pop()
        if slot < len(self._keys):
            self._keys[slot] = last
            self._slot[last] = slot


def node_of(request: Request, nodes: int, routing: str) -> int:
    """The node that serves ``request`` (module doc, "Routing")."""
    if routing == "rr" or not request.hash_ids:
        return request.index % nodes
    if routing == "conversation":
        first = request.hash_ids[0].to_bytes(8, "big")
        return int.from_bytes(hashlib.blake2b(first, digest_size=8).digest(), "big") % nodes
    raise ValueError(f"unknown routing {routing!r}; use one of {', '.join(ROUTINGS)}")


@dataclass(frozen=True)
class FleetShape:
    """One configuration: ``nodes`` primaries of ``node_blocks`` and a shared tier
    of ``remote_blocks`` (None: unbounded; 0: none), requests routed by ``routing``."""

    nodes: int
    node_blocks: int
    remote_blocks: int | None
    routing: str = "rr"

    @property
    def shared(self) -> bool:
        return self.remote_blocks != 0


@dataclass(frozen=True)
class ModelResult:
    hits: int
    looked_up: int
    promoted: int  # hits served by the shared tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.looked_up if self.looked_up else 0.0


def chain(request: Request) -> list[int]:
    """The request's blocks in prefix order, each once."""
    return list(dict.fromkeys(request.hash_ids))


def simulate(
    requests: Iterable[Request],
    shape: FleetShape,
    server: tuple[str, int] | None = None,
    speedup: float = 0.0,
) -> ModelResult:
    """The exact hit rate of ``shape`` on ``requests`` (module doc): the shared tier
    an exact LRU, or with ``server`` = (maxmemory-policy, maxmemory-samples) and a
    bounded tier, the server's eviction on the replay's clock (trace time /
    ``speedup``; 0: a request a millisecond)."""
    primaries = [ExactLru(shape.node_blocks) for _ in range(shape.nodes)]
    remote: ExactLru | RedisEviction | None = None
    if shape.shared:
        if server is None or shape.remote_blocks is None:
            remote = ExactLru(shape.remote_blocks)
        else:
            remote = RedisEviction(shape.remote_blocks, *server)
    hits = looked_up = promoted = 0
    origin: float | None = None
    for request in requests:
        if isinstance(remote, RedisEviction):
            origin = request.timestamp if origin is None else origin
            elapsed_ms = request.timestamp - origin
            remote.now = elapsed_ms / 1000 / speedup if speedup else request.index / 1000
        primary = primaries[node_of(request, shape.nodes, shape.routing)]
        keys = chain(request)
        k, fetched = _leading(keys, primary, remote)
        for key in fetched:  # promoted into the primary at the lookup
            primary.put(key)
        for key in reversed(keys[:k]):  # loaded and touched: the first ends most recent
            primary.touch(key)
        for key in keys[k:]:  # computed, stored and cascaded
            primary.put(key)
            if remote is not None:
                remote.put(key)
        hits += k
        promoted += len(fetched)
        looked_up += len(keys)
    return ModelResult(hits, looked_up, promoted)


def _leading(
    keys: Sequence[int], primary: ExactLru, remote: ExactLru | RedisEviction | None
) -> tuple[int, list[int]]:
    """How many leading keys hit, and those of them the shared tier served."""
    fetched: list[int] = []
    for k, key in enumerate(keys):
        if key in primary:
            continue
        if remote is not None and key in remote:
            remote.touch(key)
            fetched.append(key)
            continue
        return k, fetched
    return len(keys), fetched
