"""Which promotions failed lately, and when each key may be promoted from its tier
again (docs/design/semantics.md, "Secondary tiers"; the kinds of failure are
:mod:`kvtierd.tiers.failures`').

A key whose promotion from a tier failed answers MISS, and is not promoted from
that tier again until its *retry time* (the tiering skips the tier for it: no
retry loop):

* unreadable or corrupt (a fault of the block or of the medium):
  :data:`PROMOTION_RETRY_AFTER` seconds (a corrupt block is gone from the tier
  anyway);
* transient (the I/O could not be done now: an I/O worker that timed out or died,
  a server that did not answer): :data:`TRANSIENT_RETRY_AFTER` after its first
  such failure, doubling with each further transient failure of the key in a row,
  up to :data:`PROMOTION_RETRY_AFTER`. A worker that was replaced serves the key
  a second later; a file system or server that stays down is not asked for it
  more than about once per :data:`PROMOTION_RETRY_AFTER`;
* missing (the tier no longer holds it): not remembered here at all.

A promotion that loads the key, or a fresh copy of it stored in the tier,
forgets its failures. An entry outlives its retry time (so that a key failing
transiently again doubles its window, and ``Explain`` can still tell) until it is
forgotten or pushed out by newer failures: at most :data:`FAILED_PROMOTIONS_KEPT`
entries, the oldest failure first.

Event-loop only; ``clock`` (monotonic seconds) is injectable for tests.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtierd.contract import BlockKey

PROMOTION_RETRY_AFTER = 30.0  # seconds a (tier, key) whose promotion failed is not retried
TRANSIENT_RETRY_AFTER = 1.0  # ... after its first transient failure (then doubling, capped)
# Bound of this memory: an entry takes at most ~650 bytes (a 256-byte key, its
# (tier, key) tuple, the FailedPromotion and its float, the OrderedDict node; the
# cause strings are shared constants), so at most ~10 MiB per pool.
FAILED_PROMOTIONS_KEPT = 16384


@dataclass(frozen=True, slots=True)
class FailedPromotion:
    """The last failed promotion of one key from one tier."""

    retry_at: float  # clock time from which the key is promoted from that tier again
    transient: bool  # the I/O could not be done (kvtierd.tiers.failures); nothing removed
    cause: str = ""  # transient: why, in a few words (a tier's shared constant)
    streak: int = 0  # transient failures in a row, this one included (0: not transient)

    def seconds_left(self, now: float) -> float:
        """Seconds until the key may be promoted from the tier again (0: now)."""
        return max(0.0, self.retry_at - now)


class FailedPromotions:
    """The failed promotions of one pool, per (tier index, key); see the module doc.

    Invariant: ``len(self) <= kept``; entries are in the order of their last
    failure, oldest first.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        kept: int = FAILED_PROMOTIONS_KEPT,
    ) -> None:
        self._clock = clock
        self._kept = kept
        self._entries: OrderedDict[tuple[int, BlockKey], FailedPromotion] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def failed(self, tier: int, keys: Iterable[BlockKey]) -> None:
        """The promotion of ``keys`` from ``tier`` failed (unreadable, corrupt, a
        fault): not retried for :data:`PROMOTION_RETRY_AFTER`."""
        entry = FailedPromotion(self._clock() + PROMOTION_RETRY_AFTER, transient=False)
        for key in keys:
            self._put((tier, key), entry)

    def failed_for_now(self, tier: int, keys: Iterable[BlockKey], cause: str) -> float:
        """The promotion of ``keys`` from ``tier`` failed transiently (``cause``): each
        is retried after its window (module doc). Returns the longest window given."""
        now = self._clock()
        longest = 0.0
        for key in keys:
            last = self._entries.get((tier, key))
            streak = last.streak + 1 if last is not None and last.transient else 1
            window = min(TRANSIENT_RETRY_AFTER * 2 ** (streak - 1), PROMOTION_RETRY_AFTER)
            self._put((tier, key), FailedPromotion(now + window, True, cause, streak))
            longest = max(longest, window)
        return longest

    def waiting(self, tier: int, key: BlockKey, now: float | None = None) -> bool:
        """Whether ``key`` must not be promoted from ``tier`` yet (``now``: the clock's
        time, read once by a caller asking about many keys)."""
        entry = self._entries.get((tier, key))
        if entry is None:
            return False
        return entry.retry_at > (self._clock() if now is None else now)

    def pending(self, tier: int, key: BlockKey) -> tuple[FailedPromotion, float] | None:
        """The last failure of ``key`` from ``tier`` and the seconds until it may be
        promoted from there again, while it may not; None once it may."""
        entry = self._entries.get((tier, key))
        if entry is None:
            return None
        left = entry.seconds_left(self._clock())
        return (entry, left) if left > 0 else None

    def forget(self, tier: int, keys: Iterable[BlockKey]) -> None:
        """``keys`` were loaded from ``tier``, or stored there afresh: no failure counts."""
        if not self._entries:
            return
        for key in keys:
            self._entries.pop((tier, key), None)

    def _put(self, slot: tuple[int, BlockKey], entry: FailedPromotion) -> None:
        self._entries[slot] = entry
        self._entries.move_to_end(slot)
        while len(self._entries) > self._kept:
            self._entries.popitem(last=False)
