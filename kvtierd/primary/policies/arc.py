"""Adaptive replacement cache (docs/design/semantics.md, "ARC"; vLLM's ``ARCCachePolicy``).

* ``T1``: resident keys seen once; ``T2``: resident keys seen at least twice
  (a touch of a ready T1 key promotes it). Both are ordered LRU first and hold
  every resident key, whatever its ref count.
* ``B1`` / ``B2``: ghost keys recently evicted from T1 / T2 (keys only, no
  rows), each bounded by ``capacity``.
* ``target_t1_size``: a float in ``[0, capacity]`` starting at 0. A touch of a B1
  ghost raises it by ``max(1, |B2| / |B1|)``, a touch of a B2 ghost lowers it by
  ``max(1, |B1| / |B2|)``.

Eviction of ``n`` blocks repeats ``n`` times: while the virtual size of T1 (its
size minus the T1 victims already chosen) is at least ``int(target)``, take the
next ready, unprotected T1 key; otherwise, or if T1 has none left, take the next
ready, unprotected T2 key; if T2 has none left the whole eviction fails. Each
list is scanned once, from its LRU end, by one iterator per call. As upstream,
eviction never falls back to T1 while ``|T1| < int(target)``, so it can fail
although ready T1 keys exist.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from kvtierd.contract import BlockKey
from kvtierd.primary.policies.base import CachePolicy, KeyOf, RefCount, RowOf

ArcList = Literal["t1", "t2", "b1", "b2"]


@dataclass(frozen=True, slots=True)
class ArcStats:
    """A read-only snapshot of the ARC lists' sizes and the adaptive target."""

    t1: int
    t2: int
    b1: int
    b2: int
    target_t1_size: float


class ARCPolicy(CachePolicy):
    """ARC over all resident keys.

    Invariants: T1 and T2 are disjoint and together hold exactly the resident
    keys; B1 and B2 are disjoint, hold no resident key, and each holds at most
    ``capacity`` keys; ``0 <= target_t1_size <= capacity``.
    """

    def __init__(self, capacity: int, ref_count: RefCount, row_of: RowOf, key_of: KeyOf) -> None:
        super().__init__(capacity, ref_count, row_of, key_of)
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._target = 0.0

    # ----------------------------------------------------------------- mutators

    def insert(self, key: BlockKey) -> None:
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def remove(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def mark_evictable(self, key: BlockKey) -> None:
        # ARC orders by use, not by readiness: a completed store or load is no use.
        return

    def mark_non_evictable(self, key: BlockKey) -> None:
        return

    def mark_evictable_rows(self, rows: Iterable[int]) -> None:
        return

    def mark_non_evictable_rows(self, rows: Iterable[int]) -> None:
        return

    def touch(self, keys: Sequence[BlockKey]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in reversed(keys):
            if key in t1:
                if self._ref_count(key) < 0:
                    # Write still in flight: not a second use, just refresh in T1.
                    t1.move_to_end(key)
                else:
                    del t1[key]
                    t2[key] = None
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                delta = max(1.0, len(b2) / len(b1))
                self._target = min(self._target + delta, float(self._capacity))
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1.0, len(b1) / len(b2))
                self._target = max(self._target - delta, 0.0)
                b2.move_to_end(key)

    def evict(self, n: int, protected: Collection[BlockKey]) -> list[BlockKey] | None:
        assert n >= 0
        if n == 0:
            return []
        chosen = self._choose_victims(n, protected)
        if chosen is None:
            return None
        victims: list[BlockKey] = []
        for key, from_t1 in chosen:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
            victims.append(key)
        self._trim_ghosts()
        return victims

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._target = 0.0

    # ----------------------------------------------------------------- helpers

    def _choose_victims(
        self, n: int, protected: Collection[BlockKey]
    ) -> list[tuple[BlockKey, bool]] | None:
        """``n`` victims as ``(key, from_t1)`` in ARC order, or None; changes nothing."""
        chosen: list[tuple[BlockKey, bool]] = []
        virtual_t1 = len(self._t1)
        target = int(self._target)
        t1_scan = iter(self._t1)
        t2_scan = iter(self._t2)
        while len(chosen) < n:
            key = None
            if virtual_t1 >= target:
                key = self._next_ready(t1_scan, protected)
                if key is not None:
                    chosen.append((key, True))
                    virtual_t1 -= 1
                    continue
            key = self._next_ready(t2_scan, protected)
            if key is None:
                return None
            chosen.append((key, False))
        return chosen

    def _next_ready(
        self, scan: Iterator[BlockKey], protected: Collection[BlockKey]
    ) -> BlockKey | None:
        ref_count = self._ref_count
        for key in scan:
            if key not in protected and ref_count(key) == 0:
                return key
        return None

    def _trim_ghosts(self) -> None:
        for ghost in (self._b1, self._b2):
            for _ in range(len(ghost) - self._capacity):
                ghost.popitem(last=False)

    # ----------------------------------------------------------------- read-only

    @property
    def target_t1_size(self) -> float:
        return self._target

    @target_t1_size.setter
    def target_t1_size(self, value: float) -> None:
        """Sets the adaptive target (tests and tuning); must lie in ``[0, capacity]``."""
        if not 0 <= value <= self._capacity:
            raise ValueError(f"target_t1_size must be in [0, {self._capacity}], got {value}")
        self._target = float(value)

    def statistics(self) -> ArcStats:
        return ArcStats(
            t1=len(self._t1),
            t2=len(self._t2),
            b1=len(self._b1),
            b2=len(self._b2),
            target_t1_size=self._target,
        )

    def location(self, key: BlockKey) -> ArcList | None:
        """Which list holds ``key`` (``None``: none of them)."""
        if key in self._t1:
            return "t1"
        if key in self._t2:
            return "t2"
        if key in self._b1:
            return "b1"
        return "b2" if key in self._b2 else None

    def order(self, name: ArcList) -> list[BlockKey]:
        """The keys of one list, least recently used first (a copy; for tests)."""
        lists = {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}
        return list(lists[name])

    def check_invariants(self, resident: Collection[BlockKey], evictable: int) -> None:
        """T1 and T2 hold exactly the resident keys; each ghost list at most
        ``capacity`` keys."""
        assert len(self._t1) + len(self._t2) == len(resident)
        assert all(key in resident for key in (*self._t1, *self._t2))
        assert len(self._b1) <= self._capacity and len(self._b2) <= self._capacity
