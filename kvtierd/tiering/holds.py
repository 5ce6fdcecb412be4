"""Promotion holds: pool-owned pins that keep what a waiting Lookup needs in the
primary until the engine that asked comes back to pin it (issue #15, item 5).

Why: an engine's scheduler looks a waiting request up every step; HIT_PENDING
means "wait", and once every key of its prefix is HIT it pins and loads them.
Without holds, a promotion completed for request A left A's blocks ready and
evictable (ref 0) until A's next step, and the promotions of other waiting
requests evicted them; A then promoted them again, and so on: a primary much
smaller than the blocks waited for read the disk without end.

A *hold* is one pin (ref +1 through ``PrimaryManager.prepare_load``) owned by
the pool, at most one per key, with a deadline:

* placed on the blocks a promotion brought in, when the tier reports them;
* placed on (or renewed for) the ready blocks a prefix Lookup answers HIT in
  front of a key it answers HIT_PENDING: the request waits for the whole run
  and will load it together;
* *claimed* (released) when a session pins the key: PrepareLoad, or a pinning
  Lookup of a request that waits for nothing; the session's pin keeps the row;
* *expired* (released) at its deadline, ``seconds`` after it was placed or last
  renewed: an engine that never comes back (request aborted, engine dead)
  holds nothing for longer than that.

A held block is never evicted (by a promotion, a store or a flush): promotions
and stores are admitted only as far as free or ready, unheld rows can hold
them; a key that finds no room answers MISS and the engine recomputes it.
Holds are bounded by the pool's rows (one per resident key).

Event-loop only; ``clock`` is injectable for tests.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtierd.contract import BlockKey
from kvtierd.primary.manager import PrimaryManager


@dataclass(frozen=True, slots=True)
class HoldStats:
    """A snapshot of a pool's holds; the last three are cumulative."""

    held: int  # blocks held now
    placed: int  # holds placed (renewals not counted)
    claimed: int  # released by a session's pin: the hold did its job
    expired: int  # released by the deadline: nobody came back in time


class HoldTable:
    """The holds of one pool's primary tier.

    Invariants: every held key is in the manager with ref >= 1, one of which is
    its hold; deadlines never decrease along ``_deadline_of`` (each placement or
    renewal moves its key to the end with ``clock() + seconds``), so the expired
    holds are always a prefix of it.
    """

    def __init__(
        self,
        manager: PrimaryManager,
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``seconds`` 0 turns holds off (``hold`` places none)."""
        if seconds < 0:
            raise ValueError(f"hold seconds must be >= 0, got {seconds}")
        self.seconds = seconds
        self._manager = manager
        self._clock = clock
        self._deadline_of: OrderedDict[BlockKey, float] = OrderedDict()
        self._placed = 0
        self._claimed = 0
        self._expired = 0

    def __len__(self) -> int:
        return len(self._deadline_of)

    def __contains__(self, key: object) -> bool:
        return key in self._deadline_of

    def keys(self) -> list[BlockKey]:
        """The held keys, earliest deadline first."""
        return list(self._deadline_of)

    def next_deadline(self) -> float | None:
        """The earliest deadline (``clock`` time), None when nothing is held."""
        return next(iter(self._deadline_of.values()), None)

    def statistics(self) -> HoldStats:
        return HoldStats(len(self._deadline_of), self._placed, self._claimed, self._expired)

    def hold(self, keys: Iterable[BlockKey]) -> int:
        """Holds each of ``keys`` (ready blocks: ref >= 0) until ``clock() + seconds``;
        a key already held gets the new deadline. Returns the holds placed.

        Raises ``NotLoadableError`` before changing anything if a key that is not
        held yet is not HIT.
        """
        if self.seconds <= 0:
            return 0
        deadline_of = self._deadline_of
        keys = list(dict.fromkeys(keys))
        new = [key for key in keys if key not in deadline_of]
        if new:
            self._manager.prepare_load(new)  # hold: ref n -> n + 1, all or nothing
        deadline = self._clock() + self.seconds
        for key in keys:
            deadline_of[key] = deadline
            deadline_of.move_to_end(key)
        self._placed += len(new)
        return len(new)

    def claim(self, keys: Iterable[BlockKey]) -> int:
        """Releases the holds on ``keys`` that a session has just pinned (the
        session's pins keep the rows). Keys not held are ignored; returns how many."""
        deadline_of = self._deadline_of
        if not deadline_of:
            return 0
        claimed = [key for key in dict.fromkeys(keys) if deadline_of.pop(key, None) is not None]
        if claimed:
            self._manager.complete_load(claimed)  # hold: ref n -> n - 1
            self._claimed += len(claimed)
        return len(claimed)

    def expire(self) -> int:
        """Releases every hold whose deadline has passed; returns how many. O(expired)."""
        deadline_of = self._deadline_of
        now = self._clock()
        expired: list[BlockKey] = []
        while deadline_of:
            key, deadline = next(iter(deadline_of.items()))
            if deadline > now:
                break
            deadline_of.popitem(last=False)
            expired.append(key)
        if expired:
            self._manager.complete_load(expired)  # hold: ref n -> n - 1
            self._expired += len(expired)
        return len(expired)

    def release_all(self) -> int:
        """Releases every hold (the pool closes); returns how many."""
        keys = list(self._deadline_of)
        self._deadline_of.clear()
        if keys:
            self._manager.complete_load(keys)
        return len(keys)

    def check_invariants(self) -> None:
        """Verifies the invariants (tests, debugging)."""
        previous = float("-inf")
        for key, deadline in self._deadline_of.items():
            ref = self._manager.ref_count(key)
            assert ref is not None and ref >= 1, f"held key {key!r} has ref {ref}"
            assert deadline >= previous, "hold deadlines out of order"
            previous = deadline
