"""A bounded record of why keys left (or never reached) a tier, for ``Explain``.

Each pool keeps one :class:`RemovalLog`: the last few removals or refusals per
key (evicted from the primary, flushed, cascade dropped by backpressure,
promotion failed), for at most ``max_keys`` keys, oldest forgotten first. Tiers
keep their own (an fs eviction or a failed verification happens on their I/O
threads). Event-loop only; memory is bounded by ``max_keys * per_key``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
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
    """``key -> last records`` in recency order; bounded in keys and records per key.

    Compact on purpose (it sits on the eviction path and lives as long as the
    pool): one tuple of ``(unix time, tier, what)`` tuples per key; ``tier`` and
    ``what`` are the callers' shared strings. About 300 bytes per remembered key,
    so ~20 MiB for a full default log.
    """

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, per_key: int = DEFAULT_PER_KEY) -> None:
        self._max_keys = max_keys
        self._per_key = per_key
        self._records: OrderedDict[BlockKey, tuple[tuple[float, str, str], ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, keys: tuple[BlockKey, ...] | list[BlockKey], tier: str, what: str) -> None:
        """Appends one record to each key (dropping its oldest beyond ``per_key``) and
        makes the keys the most recent; forgets the least recent keys beyond ``max_keys``.

        On the eviction path of every full pool: most keys have no record yet, so that
        case is one ``pop`` and one insertion of a tuple shared by all of them."""
        entry = (time.time(), tier, what)  # one record object shared by the keys
        first = (entry,)
        records = self._records
        pop = records.pop
        keep = self._per_key - 1
        for key in keys:
            old = pop(key, None)
            records[key] = first if old is None else (*old[max(0, len(old) - keep) :], entry)
        for _ in range(len(records) - self._max_keys):
            records.popitem(last=False)

    def get(self, key: BlockKey) -> list[KeyRecord]:
        return [KeyRecord(*entry) for entry in self._records.get(key, ())]
