"""One simulated engine of the routing benchmark: vLLM's behaviour where routing sees it.

No model runs. What a router's choice changes is simulated as vLLM does it:

* a GPU prefix cache of ``gpu_blocks`` blocks, evicting the least recently freed
  first; a request's blocks are freed tail first (vLLM frees in reverse order, so a
  prompt's tail goes before its head). Each request's evictions and new blocks are
  published as one message of ``BlockRemoved`` / ``BlockStored`` events with medium
  ``GPU`` on the engine's own socket (:mod:`benchmarks.routing_publisher`);
* the blocks after the GPU hit are looked up in the node's kvtierd pool (a prefix
  ``Lookup`` through the real client library; while the leading run ends at a
  HIT_PENDING block, asked again a scheduler step later, as vLLM's scheduler does);
  the leading HITs are loaded (``PrepareLoad``), every row compared with its key's
  pattern (:func:`benchmarks.routing_blocks.payload`), then released and touched;
* the loaded blocks are described to the pool (``describe_loads``; see :meth:`_describe`);
* every block of the request not in the pool is stored (``PrepareStore``, the rows
  written, ``CompleteStore`` with one :class:`~kvtierd_client.types.BlockDescription`
  a key: what the daemon needs to publish the key to routers), as vLLM's offloading
  connector offers every block of a request to its manager.

Hits are counted by where they came from: the GPU cache, the pool's primary (HIT
at the first lookup: CPU) or a secondary tier (HIT_PENDING first: promoted from
the shared Redis tier: storage).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from benchmarks.replay import leading_hits
from benchmarks.routing_blocks import Chain, payload
from benchmarks.routing_publisher import GpuEventPublisher, block_removed, block_stored

STEP_S = 0.005  # a scheduler step: how long before a pending lookup is asked again
MAX_STEPS = 400  # ... at most this many times (2 s), then the rest is recomputed


@dataclass
class Served:
    """What one request got on one engine, in blocks."""

    blocks: int
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    wrong_bytes: int = 0  # loaded rows whose bytes were not their key's: must stay 0
    stored: int = 0

    @property
    def hits(self) -> int:
        return self.gpu + self.cpu + self.storage


@dataclass
class EngineTotals:
    requests: int = 0
    blocks: int = 0
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    wrong_bytes: int = 0
    loaded: int = 0
    stored: int = 0
    store_refused: int = 0
    load_races: int = 0
    gave_up: int = 0
    gpu_evicted: int = 0
    lookup_s: list[float] = field(default_factory=list)

    def add(self, served: Served) -> None:
        self.requests += 1
        self.blocks += served.blocks
        self.gpu += served.gpu
        self.cpu += served.cpu
        self.storage += served.storage
        self.wrong_bytes += served.wrong_bytes
        self.loaded += served.cpu + served.storage
        self.stored += served.stored


class GpuPrefixCache:
    """The engine's GPU blocks by hash, least recently freed first.

    Invariant: at most ``capacity`` blocks; a block being served is never evicted
    (``admit`` evicts only blocks outside the request it admits)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> its 64-bit int

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def prefix(self, chain: Chain) -> int:
        """How many leading blocks of ``chain`` the cache holds."""
        count = 0
        for block_hash in chain.hashes:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def admit(self, chain: Chain, start: int) -> list[int]:
        """Caches ``chain``'s blocks from ``start`` on, evicting the least recently freed
        blocks outside ``chain`` to make room, then frees the whole request tail first.
        Returns the evicted blocks' 64-bit hashes."""
        if len(chain) > self.capacity:
            raise ValueError(
                f"a request of {len(chain)} blocks does not fit a GPU cache of "
                f"{self.capacity}; give --gpu-blocks at least the longest request"
            )
        in_use = set(chain.hashes)
        for block_hash in chain.hashes[:start]:  # in use again: out of the free queue
            self._blocks.move_to_end(block_hash)
        evicted: list[int] = []
        need = len(chain) - start
        while len(self._blocks) + need > self.capacity:
            block_hash = next(iter(self._blocks))
            if block_hash in in_use:  # cannot happen: in-use blocks were moved last
                raise AssertionError("a block in use reached the head of the free queue")
            evicted.append(self._blocks.pop(block_hash))
        for index in range(len(chain) - 1, -1, -1):  # freed tail first: head most recent
            block_hash = chain.hashes[index]
            self._blocks[block_hash] = chain.ints[index]
            self._blocks.move_to_end(block_hash)
        return evicted


class SimEngine:
    """An engine: its GPU cache and event socket, and a session on its node's pool."""

    def __init__(
        self,
        engine_id: int,
        node: int,
        session: Any,
        region: Any,
        publisher: GpuEventPublisher,
        gpu_blocks: int,
        block_bytes: int,
        describe_loads: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.node = node
        self.session = session
        self.region = region  # the pool's region as a (rows, block_bytes) uint8 array
        self.publisher = publisher
        self.gpu = GpuPrefixCache(gpu_blocks)
        self.block_bytes = block_bytes
        self.describe_loads = describe_loads
        self.totals = EngineTotals()

    def serve(self, chain: Chain) -> Served:
        """One request, start to end (module doc)."""
        served = Served(blocks=len(chain))
        served.gpu = self.gpu.prefix(chain)
        rest = list(chain.keys[served.gpu :])
        if rest:
            loaded, first_hits = self._load(rest, served)
            if loaded and self.describe_loads:
                self._describe(chain, served.gpu, loaded)
            served.cpu = min(loaded, first_hits)
            served.storage = loaded - served.cpu
        evicted = self.gpu.admit(chain, served.gpu)
        self.totals.gpu_evicted += len(evicted)
        self._publish(chain, served.gpu, evicted)
        served.stored = self._store(chain)
        self.totals.add(served)
        return served

    def store_only(self, chain: Chain) -> None:
        """Stores ``chain``'s blocks in the pool, described, and nothing else (no GPU
        cache, no events, no totals): the fleet's readiness canary."""
        self._store(chain)

    def _publish(self, chain: Chain, start: int, evicted: list[int]) -> None:
        events = [block_removed(evicted)] if evicted else []
        if start < len(chain):
            size = len(chain.tokens[0])
            tokens = [t for block in chain.tokens[start:] for t in block]
            parent = chain.ints[start - 1] if start else None
            events.append(block_stored(chain.ints[start:], parent, tokens, size))
        self.publisher.publish(events)

    def _load(self, keys: list[bytes], served: Served) -> tuple[int, int]:
        """Looks ``keys`` up until their leading run is settled and loads its HITs,
        verifying each row. Returns (blocks loaded, leading HITs of the first lookup)."""
        from kvtierd_client.client import LookupResult
        from kvtierd_client.errors import FailedPrecondition

        hit = LookupResult.HIT
        waiting = (LookupResult.HIT_PENDING, LookupResult.RETRY)
        started = time.perf_counter()
        results = self.session.lookup(keys, prefix=True)
        self.totals.lookup_s.append(time.perf_counter() - started)
        first = k = leading_hits(results, hit)
        steps = 0
        while k < len(keys) and results[k] in waiting:
            if steps >= MAX_STEPS:
                self.totals.gave_up += 1
                break
            time.sleep(STEP_S)  # the scheduler's next step
            steps += 1
            results = self.session.lookup(keys, prefix=True)
            k = leading_hits(results, hit)
        if not k:
            return 0, first
        try:
            rows = self.session.prepare_load(keys[:k])
        except FailedPrecondition:  # evicted since the lookup: recompute them
            self.totals.load_races += 1
            return 0, 0
        served.wrong_bytes += self._verify(keys[:k], rows)
        self.session.complete_load(keys[:k])
        self.session.touch(keys[:k])
        return k, first

    def _describe(self, chain: Chain, start: int, count: int) -> None:
        """Hands the pool the descriptions of the ``count`` blocks it just loaded from
        ``start`` on (``CompleteStore`` of keys this session did not reserve stores
        nothing): a block promoted from a tier another node filled has none on this
        node, and a daemon that publishes a late description of a block it holds makes
        it visible to routers (docs/benchmarks/routing.md)."""
        keys = list(chain.keys[start : start + count])
        descriptions = [chain.description(start + i) for i in range(count)]
        self.session.complete_store(keys, descriptions=descriptions)

    def _verify(self, keys: list[bytes], rows: list[int]) -> int:
        import numpy as np

        wrong = 0
        for key, row in zip(keys, rows, strict=True):
            expected = np.frombuffer(payload(key, self.block_bytes), dtype=np.uint8)
            if not np.array_equal(self.region[row], expected):
                wrong += 1
        return wrong

    def _store(self, chain: Chain) -> int:
        """Stores the request's blocks the pool lacks, described; how many."""
        import numpy as np

        grant = self.session.prepare_store(list(chain.keys))
        if grant is None:
            self.totals.store_refused += 1
            return 0
        if not grant.keys_to_store:
            return 0
        index = {key: i for i, key in enumerate(chain.keys)}
        for key, row in zip(grant.keys_to_store, grant.block_ids, strict=True):
            self.region[row] = np.frombuffer(payload(key, self.block_bytes), dtype=np.uint8)
        descriptions = [chain.description(index[key]) for key in grant.keys_to_store]
        self.session.complete_store(grant.keys_to_store, descriptions=descriptions)
        return len(grant.keys_to_store)

    def close(self) -> None:
        self.publisher.close()
