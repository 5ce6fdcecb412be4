"""The fleet's own bound on a pool's blocks in the server: one LRU over every daemon.

With ``fleet_capacity`` > 0 the daemons that share a pool's keys keep at most that
many bytes of its values in the server, together, and delete the least recently
used -- by any of them -- first. Why not the server's own eviction: Redis's
``allkeys-lru`` is not an LRU, it compares the idle time of ``maxmemory-samples``
random keys per eviction, and with round-robin routing, where nearly every reuse
crosses nodes and goes through the server, that cost a fifth to a quarter of the
hits an exact LRU of the same size keeps (docs/benchmarks/fleet.md). The server's
``maxmemory`` stays as a backstop above the bound (docs/guides/fleet.md).

The recency lives in the server, next to the values: sorted sets (the *index*)
``<key_prefix>:lru:<pool fingerprint hex>:<buckets>:<bucket>``, member the block
key, score the time in microseconds since the epoch, on the clock of the daemon
that last stored or promoted the block. A block belongs to bucket
``crc32(block key) % buckets``; ``buckets`` (:func:`bucket_count`) grows with the
capacity, one per :data:`BUCKET_BLOCKS` blocks and at most :data:`MAX_BUCKETS`, so
that a large cache's index is spread over a Cluster's masters, each bucket an exact
LRU of its share of the capacity (:func:`bucket_limits`); a small one is a single
exact LRU. The bucket count is part of the index's name: daemons configured with
different capacities keep separate indexes, never one index of two bounds.

Who does what (I/O threads only; the one state that changes is the last score
given, under a lock: a daemon's scores only grow, so its later admission is its
more recent one even within a clock tick):

* :meth:`FleetLru.admit`, after a store job (its written, present and already
  held blocks alike): one script per bucket (:data:`ADMIT_SCRIPT`, atomic on the
  bucket's master) adds the blocks as the most recent -- the job's last block the
  most recent of all, as the exact model puts them -- and pops the least recent
  past the bucket's limit; then the popped blocks' values are deleted. Two daemons
  admitting at once never both evict for the same excess.
  A call pops at most its own blocks plus :data:`EXTRA_POPS` and returns only
  members that can be block keys, so its answer is bounded in bytes whatever
  someone who can write the server planted in the index (junk members make the
  fleet evict early: lost hits, never a wrong byte). Before it counts, the script
  drops the members scored after now + :data:`FUTURE_SKEW_S`: no daemon whose clock
  agrees with this one's within that gave them, and a member scored in the future
  would outrank every block stored until then (at +inf, forever), so each new
  block would be the least recent and evict itself. What a writer of the server
  can still do with scores is bounded by the skew: members just under the horizon
  make new blocks evict themselves until the clock passes their scores (at most
  :data:`FUTURE_SKEW_S`), then go first.
* :meth:`FleetLru.touch`, after a promotion: ``ZADD XX`` (a block popped
  meanwhile is not put back).

What this never decides is what gets served. A block popped while another daemon
promotes it is a missing value at worst (``MISS``); the bytes served are verified
by the header (and MAC) whatever the index says. A value the server lost otherwise
(``maxmemory``, ``ttl``, a bad value deleted) leaves its entry until it is the
least recent; its pop deletes nothing. Skewed clocks between daemons blur recency
by the skew; past :data:`FUTURE_SKEW_S`, a daemon behind the others drops their
entries from the index (their values are then bounded by the server's
``maxmemory`` and ``ttl`` only): keep the fleet's clocks in step (NTP).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey
from kvtierd.tiers.redis.link import Command, RedisLink

BUCKET_BLOCKS = 4096  # a bucket per this many blocks of capacity ...
MAX_BUCKETS = 64  # ... and at most this many
MEMBERS_PER_CALL = 512  # blocks per script call or ZADD (a Lua stack holds ~8,000 arguments)
EXTRA_POPS = 512  # a call pops at most its own members plus this many (an index over its bound)
MAX_MEMBER_BYTES = 256  # the longest block key (the API refuses longer ones)
# An index score (a daemon's wall clock) later than now + this is dropped before an
# admission counts: the fleet's daemons' clocks must agree within it.
FUTURE_SKEW_S = 300.0

# KEYS[1]: a bucket's index; ARGV[1]: the bucket's limit; ARGV[2]: the most this call
# pops; ARGV[3]: the longest member it returns; ARGV[4]: the latest score that counts
# (now + FUTURE_SKEW_S, in microseconds); ARGV[5..]: score, member pairs. Drops the
# members scored after ARGV[4] (from the future: planted, or a clock far ahead), adds
# (or refreshes) the members, then pops what is past the limit, least recent first, and
# returns the popped members that can be block keys (a longer one, planted, is dropped
# from the index and never sent back: the answer stays bounded in bytes).
ADMIT_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. ARGV[4], '+inf')
redis.call('ZADD', KEYS[1], unpack(ARGV, 5))
local over = math.min(redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1]), tonumber(ARGV[2]))
if over <= 0 then
  return {}
end
local popped = redis.call('ZPOPMIN', KEYS[1], over)
local keys = {}
for i = 1, #popped, 2 do
  if string.len(popped[i]) <= tonumber(ARGV[3]) then
    keys[#keys + 1] = popped[i]
  end
end
return keys
"""


def bucket_count(capacity_blocks: int) -> int:
    """How many buckets an index of ``capacity_blocks`` has (module doc)."""
    return max(1, min(MAX_BUCKETS, capacity_blocks // BUCKET_BLOCKS))


def bucket_limits(capacity_blocks: int, buckets: int) -> list[int]:
    """Each bucket's share of ``capacity_blocks`` (they add up to it exactly)."""
    share, rest = divmod(capacity_blocks, buckets)
    return [share + (1 if b < rest else 0) for b in range(buckets)]


@dataclass(frozen=True)
class Admitted:
    """What an admit did: the blocks it popped (their values deleted, unless
    ``error`` says a node failed first) and the first error a node gave."""

    popped: list[BlockKey]
    error: BaseException | None = None


class FleetLru:
    """One pool's index in the server (module doc). Thread-safe; every method blocks
    up to the link's timeout."""

    def __init__(
        self,
        link: RedisLink,
        *,
        key_prefix: str,
        fingerprint_hex: str,
        key_space: bytes,
        capacity_blocks: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``key_space``: the prefix of the pool's value keys (a value's key is
        ``key_space + block key``); ``clock``: wall-clock seconds (every daemon's
        scores must be comparable: not a monotonic clock)."""
        if capacity_blocks < 1:
            raise ValueError("a fleet LRU holds at least one block")
        self._link = link
        self._key_space = key_space
        self._clock = clock
        self.capacity_blocks = capacity_blocks
        self.buckets = bucket_count(capacity_blocks)
        self.limits = bucket_limits(capacity_blocks, self.buckets)
        base = f"{key_prefix}:lru:{fingerprint_hex}:{self.buckets}:"
        self.index_names = [f"{base}{b}".encode() for b in range(self.buckets)]
        self._scoring = threading.Lock()
        self._last_score = 0  # the highest score given: the next ones are above it

    def bucket(self, key: BlockKey) -> int:
        return zlib.crc32(key) % self.buckets

    def admit(self, keys: Sequence[BlockKey]) -> Admitted:
        """Makes ``keys`` the most recent (the last the most recent), pops what is
        past each bucket's limit and deletes the popped blocks' values; members
        scored after now + :data:`FUTURE_SKEW_S` are dropped first, never counted."""
        commands: list[Command] = []
        now_us, by_bucket = self._by_bucket(keys)
        horizon_us = now_us + len(keys) + int(FUTURE_SKEW_S * 1e6)
        for bucket, scored in by_bucket:
            name, limit = self.index_names[bucket], self.limits[bucket]
            for start in range(0, len(scored), MEMBERS_PER_CALL):
                chunk = scored[start : start + MEMBERS_PER_CALL]
                most = len(chunk) + EXTRA_POPS
                args = ("EVAL", ADMIT_SCRIPT, 1, name, limit, most, MAX_MEMBER_BYTES)
                commands.append((name, (*args, horizon_us, *_flat(chunk))))
        replies, _ = self._link.pipelined(commands)
        popped: list[BlockKey] = []
        error: BaseException | None = None
        for reply in replies:
            if isinstance(reply, BaseException):
                error = error or reply
                continue
            popped += [BlockKey(member) for member in reply]
        if popped:
            deleted, _ = self._link.per_node("DEL", [self._key_space + k for k in popped])
            error = error or next((r for r in deleted if isinstance(r, BaseException)), None)
        return Admitted(popped, error)

    def touch(self, keys: Sequence[BlockKey]) -> BaseException | None:
        """Makes the indexed ones of ``keys`` the most recent (the last the most
        recent); a key no longer indexed stays out. Returns the first error."""
        commands: list[Command] = []
        for bucket, scored in self._by_bucket(keys)[1]:
            name = self.index_names[bucket]
            for start in range(0, len(scored), MEMBERS_PER_CALL):
                pairs = _flat(scored[start : start + MEMBERS_PER_CALL])
                commands.append((name, ("ZADD", name, "XX", *pairs)))
        replies, _ = self._link.pipelined(commands)
        return next((r for r in replies if isinstance(r, BaseException)), None)

    def _by_bucket(
        self, keys: Sequence[BlockKey]
    ) -> tuple[int, list[tuple[int, list[tuple[int, bytes]]]]]:
        """The time they are scored at, and (bucket, [(score, key)]) of ``keys``, each
        key once (its last place), scored now (or past the last score given) plus its
        place in microseconds: the order of ``keys`` is the recency."""
        place = {key: i for i, key in enumerate(keys)}
        with self._scoring:
            now_us = max(int(self._clock() * 1e6), self._last_score + 1)
            self._last_score = now_us + len(keys)
        buckets: dict[int, list[tuple[int, bytes]]] = {}
        for key, i in place.items():
            buckets.setdefault(self.bucket(key), []).append((now_us + i, bytes(key)))
        return now_us, sorted(buckets.items())


def _flat(scored: Sequence[tuple[int, bytes]]) -> list[int | bytes]:
    return [part for pair in scored for part in pair]
