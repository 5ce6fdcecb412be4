"""Least-recently-used eviction (reference §4.1, vLLM's ``LRUCachePolicy``).

Only ready blocks (ref count ``0``) are ordered; pinned and in-flight blocks
are outside the order and re-enter it at the MRU end when they become ready
again. A "use" is: a completed store, the last completed load, or a touch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvtierd.contract import BlockKey
from kvtierd.policies.base import CachePolicy, RefCount


class LRUPolicy(CachePolicy):
    """LRU over the evictable keys.

    Invariant: ``_evictable`` holds exactly the resident keys whose ref count is
    ``0``, least recently used first. Resident keys with another ref count are
    not stored at all (the manager knows them), so a block costs memory here
    only while it is evictable.
    """

    def __init__(self, capacity: int, ref_count: RefCount) -> None:
        super().__init__(capacity, ref_count)
        self._evictable: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        # A new block is a write in flight (ref -1): not evictable yet.
        return

    def remove(self, key: BlockKey) -> None:
        self._evictable.pop(key, None)

    def mark_evictable(self, key: BlockKey) -> None:
        # Precondition (manager): key is not in _evictable; a second call would not
        # move it. Checked by PrimaryManager.check_invariants, not per call.
        self._evictable[key] = None

    def mark_non_evictable(self, key: BlockKey) -> None:
        del self._evictable[key]

    def touch(self, keys: Sequence[BlockKey]) -> None:
        evictable = self._evictable
        move = evictable.move_to_end
        # Reverse order: the first key of the call ends the most recent (prefix
        # heads are worth more than their tails).
        for key in reversed(keys):
            if key in evictable:
                move(key)

    def evict(self, n: int, protected: Collection[BlockKey]) -> list[BlockKey] | None:
        assert n >= 0
        if n == 0:
            return []
        victims: list[BlockKey] = []
        for key in self._evictable:
            if key in protected:
                continue
            victims.append(key)
            if len(victims) == n:
                break
        else:
            return None
        evictable = self._evictable
        for key in victims:
            del evictable[key]
        return victims

    def clear(self) -> None:
        self._evictable.clear()

    # ----------------------------------------------------------------- read-only

    def evictable_order(self) -> list[BlockKey]:
        """The evictable keys, least recently used first (a copy; for tests)."""
        return list(self._evictable)

    def __len__(self) -> int:
        """Number of evictable keys."""
        return len(self._evictable)
