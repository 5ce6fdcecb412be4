"""A configured tier's write budget (``max_write_bytes_per_s``): a token bucket over
bytes, shared by every pool of the tier (one disk, one server), on an injected clock.

The bucket fills at ``rate`` bytes per second up to ``burst`` bytes and starts full.
A write of ``n`` bytes goes through when ``n`` tokens are there (they are taken) and
is refused otherwise (nothing taken): the caller drops that write, it is never
queued, so a budget never delays a store, an eviction or anything else; it only
decides. Over any span of ``t`` seconds the bytes let through are at most
``burst + rate * t``; at the default burst (one second of the rate) a minute of
writes at ten times the budget lets through at most 61/60 of it.

Invariant: ``tokens <= burst``, and ``tokens >= 0`` except after a write larger than
the burst (it passes from a full bucket and leaves it in debt by the difference, so
the rate holds for writes of any size). A clock that goes back adds nothing (the last
reading stays the reference). O(1) per call, no lock: event loop
only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

WRITE_BUDGET_OPTION = "max_write_bytes_per_s"
"""The option of every tier type that sets its budget (bytes per second, 0: none)."""
BURST_SECONDS = 1.0
"""The default burst: this many seconds of the rate (at least one write's bytes)."""


@dataclass(frozen=True, slots=True)
class BudgetStats:
    """A :class:`WriteBudget` at one instant: its rate and burst, the bytes it let
    through and refused since it was made (cumulative), the tokens left."""

    rate_bytes_per_s: int
    burst_bytes: int
    passed_bytes: int
    refused_bytes: int
    tokens_bytes: float


class WriteBudget:
    """At most ``rate`` bytes per second (plus ``burst``) through :meth:`take`."""

    def __init__(
        self,
        rate_bytes_per_s: int,
        *,
        burst_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``burst_bytes``: the bucket's size (0: :data:`BURST_SECONDS` of the rate).
        ``clock``: monotonic seconds. ValueError for a rate below 1."""
        if rate_bytes_per_s < 1:
            raise ValueError(f"a write budget needs at least 1 byte/s, got {rate_bytes_per_s}")
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes or max(1, int(rate_bytes_per_s * BURST_SECONDS))
        self._clock = clock
        self._tokens = float(self.burst)  # Invariant: _tokens <= burst (module doc)
        self._last = clock()
        self._passed = 0
        self._refused = 0

    def take(self, nbytes: int) -> bool:
        """Takes ``nbytes`` tokens if they are there (True: write them); False leaves
        the bucket as it was (drop the write). A write larger than ``burst`` passes
        from a full bucket and leaves it in debt (see the module's invariant)."""
        self._refill()
        if self._tokens < min(nbytes, self.burst):
            self._refused += nbytes
            return False
        self._tokens -= nbytes
        self._passed += nbytes
        return True

    def _refill(self) -> None:
        now = self._clock()
        if now > self._last:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
            self._last = now

    def statistics(self) -> BudgetStats:
        self._refill()
        return BudgetStats(self.rate, self.burst, self._passed, self._refused, self._tokens)


def write_budget(
    rate_bytes_per_s: int, clock: Callable[[], float] = time.monotonic
) -> WriteBudget | None:
    """The budget of a tier whose ``max_write_bytes_per_s`` is ``rate_bytes_per_s``:
    None for 0 (no budget)."""
    return WriteBudget(rate_bytes_per_s, clock=clock) if rate_bytes_per_s else None
