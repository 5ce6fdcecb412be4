"""Fair shares of a bounded pool of places between named holders.

The rule (peer tickets, WatchEvents streams): with ``limit`` places and the
configured names, each name's *share* is ``limit // len(names)`` (at least 1).
A name may always take a place while it holds fewer than its share; it may take
more only while the free places stay more than every other configured name's
unused share. So no holder, however fast, can lock the others out: each can
always get its share, and the places nobody claims are free for anyone.

A name that is not configured (the local caller of a daemon without principals)
has the same share; with no names configured the share is the whole limit.

Not thread-safe: each owner keeps it on one event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class FairShares:
    """Counts the places each name holds, and says who may take one more.

    Invariants: ``_held[n] > 0`` for every key (a name at 0 goes);
    ``sum(_held.values()) == _total <= limit`` when every ``take`` was allowed
    (:meth:`full` false and :meth:`within_share` true just before it).
    """

    def __init__(self, limit: int, names: Iterable[str] = ()) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, not {limit}")
        self.limit = limit
        self.names = tuple(names)
        self.share = max(1, limit // max(1, len(self.names)))
        self._held: Counter[str] = Counter()
        self._total = 0

    def __len__(self) -> int:
        """Places held, by every name together."""
        return self._total

    @property
    def free(self) -> int:
        return self.limit - self._total

    @property
    def full(self) -> bool:
        """Every place is held."""
        return self._total >= self.limit

    def held(self, name: str) -> int:
        return self._held[name]

    def within_share(self, name: str) -> bool:
        """Whether ``name`` may take one more place as far as fairness goes: it holds
        less than its share, or the free places stay more than the other names'
        unused shares. (:meth:`full` is checked apart: its refusal says another thing.)"""
        if self._held[name] < self.share:
            return True
        unused_by_others = sum(
            max(0, self.share - self._held[other]) for other in self.names if other != name
        )
        return self.free > unused_by_others

    def take(self, name: str) -> None:
        """``name`` holds one more place (the caller checked that it may)."""
        self._held[name] += 1
        self._total += 1
        assert self._total <= self.limit, f"{self._total} places held, the limit is {self.limit}"

    def give_back(self, name: str) -> None:
        """``name`` holds one place less; it must hold one."""
        left = self._held[name] - 1
        assert left >= 0, f"{name!r} gave back a place it did not hold"
        if left:
            self._held[name] = left
        else:
            del self._held[name]
        self._total -= 1
