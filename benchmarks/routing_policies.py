"""The routers the routing benchmark compares: which engine gets each request.

* ``round_robin``: engine ``i mod N`` for the i-th request;
* ``conversation``: a hash of the request's first ``blocks`` block hashes, mod N (a
  conversation's turns share their first blocks, so they meet their own cache);
* ``kv_aware``: Dynamo's KV router cost, from the real indexer's ``/query``: per engine
  the blocks it would prefill, the blocks it holds counted at weight 1 on its GPU,
  ``host_weight`` in host memory (the node's kvtierd pool) and ``disk_weight`` on disk
  (Dynamo's ``--router-host-cache-hit-weight`` 0.75 and ``--router-disk-cache-hit-weight``
  0.25), plus a load term: ``load_weight`` x the requests routed to it among the last
  ``window`` x the mean request's blocks (a replay runs one request at a time: the
  recent requests stand for the ones in flight, Dynamo's active blocks). Lowest cost
  wins; a tie goes to the least loaded, then to the one that served fewest requests.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from benchmarks.routing_blocks import Chain
from benchmarks.routing_indexer import Holding

POLICIES = ("round_robin", "conversation", "kv_aware")


class Router(Protocol):
    def route(self, chain: Chain) -> int:
        """The engine (0-based) that serves ``chain``."""
        ...


class RoundRobin:
    def __init__(self, engines: int) -> None:
        self.engines = engines
        self._next = 0

    def route(self, chain: Chain) -> int:
        engine = self._next
        self._next = (self._next + 1) % self.engines
        return engine


class Conversation:
    def __init__(self, engines: int, blocks: int = 1) -> None:
        self.engines = engines
        self.blocks = blocks

    def route(self, chain: Chain) -> int:
        digest = hashlib.sha256(b"".join(chain.hashes[: self.blocks])).digest()
        return int.from_bytes(digest[:8], "big") % self.engines


@dataclass(frozen=True)
class KvWeights:
    host_weight: float = 0.75
    disk_weight: float = 0.25
    load_weight: float = 0.25
    window: int = 24


class KvAware:
    """``query(tokens)`` is the indexer's answer: per instance id (engine + 1) its
    :class:`Holding`; the last answer is kept in ``last`` for the view sampling."""

    def __init__(
        self,
        engines: int,
        query: Callable[[list[int]], dict[int, Holding]],
        weights: KvWeights | None = None,
    ) -> None:
        self.engines = engines
        self.query = query
        self.weights = weights or KvWeights()
        self._recent: deque[int] = deque(maxlen=self.weights.window)
        self._blocks = 0
        self._requests = 0
        self._served = [0] * engines
        self.last: dict[int, Holding] = {}

    def credit(self, held: Holding) -> float:
        """The blocks an engine need not prefill, each tier at its weight."""
        w = self.weights
        return (
            held.gpu
            + w.host_weight * (held.cpu - held.gpu)
            + w.disk_weight * (held.disk - held.cpu)
        )

    def costs(self, chain: Chain, holdings: dict[int, Holding]) -> list[float]:
        mean = self._blocks / self._requests if self._requests else float(len(chain))
        load = [0] * self.engines
        for engine in self._recent:
            load[engine] += 1
        return [
            len(chain)
            - self.credit(holdings.get(engine + 1, Holding()))
            + self.weights.load_weight * mean * load[engine]
            for engine in range(self.engines)
        ]

    def route(self, chain: Chain) -> int:
        self.last = self.query(chain.flat_tokens())
        costs = self.costs(chain, self.last)
        load = [0] * self.engines
        for engine in self._recent:
            load[engine] += 1
        engine = min(range(self.engines), key=lambda e: (costs[e], load[e], self._served[e], e))
        self._recent.append(engine)
        self._served[engine] += 1
        self._blocks += len(chain)
        self._requests += 1
        return engine
