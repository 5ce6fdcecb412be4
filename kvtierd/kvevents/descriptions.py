"""What the daemon knows of each published block: its description (the engine's
hashes, parent, tokens; handed over with ``CompleteStore``) and the tiers that hold
it, so a store and a removal can be published with the same hashes.

:class:`DescriptionTable` holds them for every published pool, bounded in bytes
(:func:`entry_cost`). Invariants:

- first writer wins: a key with a description keeps it until it leaves every tier
  (a later store of the same key cannot change what routers were told);
- ``tiers`` is exactly the set of tiers whose stored event for the key was seen
  and whose removed event was not; the entry goes when it empties after having
  held something;
- ``used_bytes == sum(entry.cost)`` and stays within ``limit_bytes`` after every
  call: past it, the least recently stored entries are taken out and returned, so
  that the caller publishes their removal (a router is never left crediting a
  block the daemon can no longer describe).

Owned by the event loop; no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvtierd.contract import BlockKey

ENTRY_OVERHEAD_BYTES = 360  # the entry, its dict, the table's slot and key tuple (3.11)
BYTES_HEADER = 33  # a bytes object's header
TIER_BYTES = 100  # a tier's slot in an entry's dict


@dataclass(slots=True)
class Described:
    """One key's description as its engine sent it (``raw``: the serialized
    ``BlockDescription``, parsed only on the publisher's thread), and where the key
    is. ``cost`` is kept current by the table."""

    raw: bytes
    tiers: dict[str, str] = field(default_factory=dict)  # tier name -> medium
    cost: int = 0

    def holds(self, medium: str) -> bool:
        """Whether some tier of ``medium`` holds the key."""
        return medium in self.tiers.values()


def entry_cost(key: BlockKey, raw: bytes, tiers: int) -> int:
    """What an entry counts against the table's byte limit: its key and description
    bytes objects, its tiers, and :data:`ENTRY_OVERHEAD_BYTES`."""
    return ENTRY_OVERHEAD_BYTES + 2 * BYTES_HEADER + len(key) + len(raw) + TIER_BYTES * tiers


class DescriptionTable:
    """Every published pool's described keys, least recently stored first."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.dropped = 0  # entries taken out by the byte limit
        self._entries: OrderedDict[tuple[str, BlockKey], Described] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, pool: str, key: BlockKey) -> Described | None:
        return self._entries.get((pool, key))

    def offer(self, pool: str, key: BlockKey, described: Described) -> list[tuple[str, Described]]:
        """Keeps ``described`` for ``key`` unless it has one already. Returns the
        entries the byte limit took out (pool, entry) for the caller to publish as
        removed."""
        slot = (pool, key)
        if slot in self._entries:
            return []
        described.cost = entry_cost(key, described.raw, len(described.tiers))
        self._entries[slot] = described
        self.used_bytes += described.cost
        return self._trim()

    def stored(self, pool: str, key: BlockKey, tier: str, medium: str) -> Described | None:
        """``tier`` now holds ``key``: returns its entry (None when undescribed), made
        the most recently stored."""
        slot = (pool, key)
        entry = self._entries.get(slot)
        if entry is None:
            return None
        if tier not in entry.tiers:
            entry.tiers[tier] = medium
            entry.cost += TIER_BYTES
            self.used_bytes += TIER_BYTES
        self._entries.move_to_end(slot)
        return entry

    def removed(self, pool: str, key: BlockKey, tier: str) -> Described | None:
        """``tier`` no longer holds ``key``: returns its entry when the tier held it
        (the entry is forgotten once no tier does), else None."""
        slot = (pool, key)
        entry = self._entries.get(slot)
        if entry is None or tier not in entry.tiers:
            return None
        del entry.tiers[tier]
        if entry.tiers:
            entry.cost -= TIER_BYTES
            self.used_bytes -= TIER_BYTES
        else:
            self.used_bytes -= entry.cost
            del self._entries[slot]
        return entry

    def forget_all(self) -> None:
        self._entries.clear()
        self.used_bytes = 0

    def entries(self, pool: str) -> list[tuple[BlockKey, Described]]:
        """``pool``'s entries, least recently stored first (a snapshot)."""
        return [(slot[1], entry) for slot, entry in self._entries.items() if slot[0] == pool]

    def _trim(self) -> list[tuple[str, Described]]:
        taken = []
        while self.used_bytes > self.limit_bytes and self._entries:
            (pool, _key), entry = self._entries.popitem(last=False)
            self.used_bytes -= entry.cost
            self.dropped += 1
            if entry.tiers:
                taken.append((pool, entry))
        return taken
