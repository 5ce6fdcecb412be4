"""A bounded record of why keys left (or never reached) a tier, for ``Explain``.

Each pool keeps one :class:`RemovalLog`: the last few removals or refusals per
key (evicted from the primary, flushed, cascade dropped by backpressure,
promotion failed), for at most ``max_keys`` keys and ``max_bytes`` bytes (the
keys' lengths plus :data:`KEY_OVERHEAD_BYTES` per key and :data:`RECORD_BYTES`
per record a key holds), oldest forgotten first.
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
# What a remembered key costs beyond its bytes, measured (64-bit CPython 3.11,
# tests/unit/records/test_history.py holds it): the key's bytes object header
# (33) and its allocator's rounding (up to 15), its OrderedDict entry, node and
# hash slots (up to ~185 just after the table grew fourfold) and its tuple of
# records.
KEY_OVERHEAD_BYTES = 264
# What each record a key holds costs: its (unix time, tier, what) tuple (64) and
# float (32), counted as if no other key shared them (the keys of one call do: a
# churn of large calls of 256-byte keys is then overcounted about 1.5x; keys
# recorded one call each cost what is counted), and its slot in the key's tuple.
RECORD_BYTES = 112

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
    ``what`` are the callers' shared strings. A remembered 36-byte key with one
    record counts 412 bytes (the default 65,536 keys: 26 MiB, so the default
    ``max_bytes``, 16 MiB, binds first at ~40,700); a 256-byte one 632 (~26,500).

    Invariant: ``_key_bytes == sum(len(k) for k in _records)``, ``_held ==
    sum(len(r) for r in _records.values())``, and after every ``record``
    ``len(self) <= max_keys`` and ``nbytes <= max_bytes``.
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
        self._held = 0  # records held, all keys together

    def __len__(self) -> int:
        return len(self._records)

    @property
    def nbytes(self) -> int:
        """What the remembered keys count against ``max_bytes``."""
        return self._key_bytes + KEY_OVERHEAD_BYTES * len(self._records) + RECORD_BYTES * self._held

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
        added = held = 0
        for key in keys:
            old = pop(key, None)
            if old is None:
                records[key] = first
                added += len(key)
                held += 1
            else:
                records[key] = (*old[max(0, len(old) - keep) :], entry)
                held += len(old) <= keep  # else its oldest record went
        self._key_bytes += added
        self._held += held
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Pops the least recent keys until both ``max_keys`` and ``max_bytes`` hold."""
        records = self._records
        popitem = records.popitem
        over_keys = len(records) - self._max_keys
        over_bytes = self.nbytes - self._max_bytes
        freed = released = 0
        while (over_keys > 0 or over_bytes > 0) and records:
            key, held = popitem(last=False)
            freed += len(key)
            released += len(held)
            over_keys -= 1
            over_bytes -= len(key) + KEY_OVERHEAD_BYTES + RECORD_BYTES * len(held)
        self._key_bytes -= freed
        self._held -= released

    def get(self, key: BlockKey) -> list[KeyRecord]:
        return [KeyRecord(*entry) for entry in self._records.get(key, ())]
