"""A bounded record of why keys left (or never reached) a tier, for ``Explain``.

Each pool keeps one :class:`RemovalLog`: the last few removals or refusals per
key (evicted from the primary, flushed, cascade dropped by backpressure,
promotion failed), for at most ``max_keys`` keys, oldest forgotten first. Tiers
keep their own (an fs eviction or a failed verification happens on their I/O
threads). Event-loop only; memory is bounded by ``max_keys * per_key``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvtierd.contract import BlockKey

DEFAULT_MAX_KEYS = 65536
DEFAULT_PER_KEY = 4


@dataclass(frozen=True, slots=True)
class KeyRecord:
    unix_time: float
    tier: str
    what: str


class RemovalLog:
    """``key -> last records`` in recency order; bounded in keys and records per key."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, per_key: int = DEFAULT_PER_KEY) -> None:
        self._max_keys = max_keys
        self._per_key = per_key
        self._records: OrderedDict[BlockKey, deque[KeyRecord]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, keys: tuple[BlockKey, ...] | list[BlockKey], tier: str, what: str) -> None:
        now = time.time()
        records = self._records
        for key in keys:
            entry = records.get(key)
            if entry is None:
                entry = records[key] = deque(maxlen=self._per_key)
            else:
                records.move_to_end(key)
            entry.append(KeyRecord(now, tier, what))
        while len(records) > self._max_keys:
            records.popitem(last=False)

    def get(self, key: BlockKey) -> list[KeyRecord]:
        return list(self._records.get(key, ()))
