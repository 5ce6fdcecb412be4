"""A Lookup's wait for its remote tiers (``limits.remote_lookup_wait``; docs/design/tiers.md).

A key that misses the primary and every local tier may still be held by a remote
tier (Redis, a shared fs root) that another daemon wrote to. Such a tier knows
what it holds only by asking its medium (:meth:`SecondaryTier.ask
<kvtierd.tiers.base.SecondaryTier.ask>`). Before a Lookup is answered,
:func:`plan_asks` picks the keys worth asking, the tiers ask them (one pipelined
probe per node, shared by every Lookup waiting on that node), and the request
handler awaits the :class:`RemoteWait` for at most ``remote_lookup_wait``; the
Lookup then runs as always and answers from what the tiers learnt: HIT_PENDING
for what a remote tier holds. Past the bound it answers MISS for the keys still
unknown and their probe goes on, for the next Lookup.

Which keys are asked: the primary's misses that no tier holds as far as it knows
and some remote tier does not know about (held: promoted without asking; known
absent everywhere: a MISS without asking). With a prefix Lookup only up to the
first key known absent everywhere: nothing after it could be loaded. A key whose
promotion from a tier failed lately is not asked of that tier.

Everything here runs on the event loop and never blocks; the futures are the
tiers' and shared: a Lookup that stops waiting (its bound, a cancelled call)
never cancels them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtierd.contract import BlockKey, LookupResult
from kvtierd.tiers.base import SecondaryTier

_MISS = LookupResult.MISS

# (tier index, key) -> whether that tier's promotion of the key failed lately
RecentlyFailed = Callable[[int, BlockKey], bool]


@dataclass(slots=True)
class RemoteWait:
    """What one Lookup waits for: the futures of the tiers it asked (co-indexed
    with the tier each belongs to)."""

    futures: list[asyncio.Future[None]] = field(default_factory=list)
    tiers: list[int] = field(default_factory=list)

    def add(self, tier_index: int, futures: Sequence[asyncio.Future[None]]) -> None:
        for future in futures:
            self.futures.append(future)
            self.tiers.append(tier_index)

    async def wait(self, seconds: float) -> bool:
        """Waits until every answer is in or ``seconds`` passed; True when all are in.
        Never cancels the (shared) futures."""
        pending = [future for future in self.futures if not future.done()]
        if pending and seconds > 0:
            await asyncio.wait(pending, timeout=seconds)
        return all(future.done() for future in self.futures)

    def late_tiers(self) -> set[int]:
        """The tiers whose answers are not all in yet."""
        return {t for t, f in zip(self.tiers, self.futures, strict=True) if not f.done()}


def known_miss(
    tiers: Sequence[SecondaryTier],
    keys: Sequence[BlockKey],
    positions: Sequence[int],
    recently_failed: RecentlyFailed,
) -> int | None:
    """The first of ``positions`` (in order) whose key every tier knows it does not
    hold (no medium to ask: a prefix chain ends there), or None. Changes nothing."""
    open_ = list(positions)
    for index, tier in enumerate(tiers):
        answers = tier.presence([keys[i] for i in open_])
        open_ = [
            i
            for i, present in zip(open_, answers, strict=True)
            if present is False or (present and recently_failed(index, keys[i]))
        ]
        if not open_:
            return None
    return open_[0]


def plan_asks(
    tiers: Sequence[SecondaryTier],
    keys: Sequence[BlockKey],
    results: Sequence[LookupResult],
    prefix: bool,
    recently_failed: RecentlyFailed,
) -> dict[int, list[BlockKey]]:
    """Per tier index, the keys of a Lookup to ask that remote tier about (module
    doc); ``results`` are the primary's answers. Changes nothing."""
    open_ = [i for i, result in enumerate(results) if result is _MISS]
    unknown_to: dict[int, list[int]] = {}  # position -> remote tiers that do not know it
    for index, tier in enumerate(tiers):
        if not open_:
            break
        answers = tier.presence([keys[i] for i in open_])
        still: list[int] = []
        for i, present in zip(open_, answers, strict=True):
            if present and not recently_failed(index, keys[i]):
                continue  # this tier holds it: promoted without asking anyone
            if present is None and tier.remote and not recently_failed(index, keys[i]):
                unknown_to.setdefault(i, []).append(index)
            still.append(i)
        open_ = still
    asks: dict[int, list[BlockKey]] = {}
    for i in open_:  # in key order: no tier is known to hold these
        asked = unknown_to.get(i)
        if asked is None:
            if prefix:
                break  # absent everywhere: the chain ends here, nothing after it loads
            continue
        for index in asked:
            asks.setdefault(index, []).append(keys[i])
    return asks
