"""A bounded record of why keys left (or never reached) a tier, for ``Explain``.

Each pool keeps one :class:`RemovalLog`: the last few removals or refusals per
key (evicted from the primary, flushed, cascade dropped by backpressure,
promotion failed), for at most ``max_keys`` keys and ``max_bytes`` bytes (the
keys' lengths plus :data:`KEY_OVERHEAD_BYTES` per key), oldest forgotten first.
Tiers keep their own (an fs eviction or a failed verification happens on their
I/O threads). Event-loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey

DEFAULT_MAX_KEYS = 65536
DEFAULT_PER_KEY = 4
DEFAULT_MAX_BYTES = 16 << 20
# A remembered key's cost beyond its bytes: the bytes object's header, its
# OrderedDict node and hash slot, and its tuple of up to DEFAULT_PER_KEY records
# (the records themselves are shared by the keys of one call).
KEY_OVERHEAD_BYTES = 200

# Why the primary dropped blocks, as Explain tells it: passed by the call that
# decided the removal (the evicting store or promotion, the flush).
EVICTED_FOR_ROOM = "evicted: least recently used, to make room"
FLUSHED = "flushed (FlushPool)"


@dataclass(frozen=True, slots=True)
class KeyRecord:
    unix_time: float
    tier: str
    what: str


class RemovalLog:
    """``key -> last records`` in recency order; bounded in keys, in bytes and in
    records per key.

    Compact on purpose (it sits on the eviction path and lives as long as the
    pool): one tuple of ``(unix time, tier, what)`` tuples per key; ``tier`` and
    ``what`` are the callers' shared strings. About 230 bytes per remembered
    36-byte key (the default 65,536 keys: ~15 MiB); 256-byte keys reach the
    default ``max_bytes`` (16 MiB) first, at ~36,000 keys.

    Invariant: ``_key_bytes == sum(len(k) for k in _records)``, and after every
    ``record`` ``len(self) <= max_keys`` and ``nbytes <= max_bytes``.
    """

    def __init__(
        self,
        max_keys: int = DEFAULT_MAX_KEYS,
        per_key: int = DEFAULT_PER_KEY,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self._max_keys = max_keys
        self._per_key = per_key
        self._max_bytes = max_bytes
        self._records: OrderedDict[BlockKey, tuple[tuple[float, str, str], ...]] = OrderedDict()
        self._key_bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def nbytes(self) -> int:
        """What the remembered keys count against ``max_bytes``."""
        return self._key_bytes + KEY_OVERHEAD_BYTES * len(self._records)

    def record(self, keys: Sequence[BlockKey], tier: str, what: str) -> None:
        """Appends one record to each key (dropping its oldest beyond ``per_key``) and
        makes the keys the most recent; forgets the least recent keys beyond ``max_keys``
        or ``max_bytes``.

        On the eviction path of every full pool: most keys have no record yet, so that
        case is one ``pop`` and one insertion of a tuple shared by all of them."""
        entry = (time.time(), tier, what)  # one record object shared by the keys
        first = (entry,)
        records = self._records
        pop = records.pop
        keep = self._per_key - 1
        added = 0
        for key in keys:
            old = pop(key, None)
            if old is None:
                records[key] = first
                added += len(key)
            else:
                records[key] = (*old[max(0, len(old) - keep) :], entry)
        self._key_bytes += added
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Pops the least recent keys until both ``max_keys`` and ``max_bytes`` hold."""
        records = self._records
        popitem = records.popitem
        over_keys = len(records) - self._max_keys
        over_bytes = self.nbytes - self._max_bytes
        freed = 0
        while (over_keys > 0 or over_bytes > 0) and records:
            size = len(popitem(last=False)[0])
            freed += size
            over_keys -= 1
            over_bytes -= size + KEY_OVERHEAD_BYTES
        self._key_bytes -= freed

    def get(self, key: BlockKey) -> list[KeyRecord]:
        return [KeyRecord(*entry) for entry in self._records.get(key, ())]
