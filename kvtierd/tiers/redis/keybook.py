"""What one pool's redis tier knows about keys, on the loop: a lookup answers from it.

A lookup never waits on the server for what this module can answer:

* held keys: the keys the tier stored (or found present when storing), in recency
  order, each with the time its value expires on the server (``ttl``). A held key
  is trusted for ``presence_ttl`` after it was stored or last seen present (a probe,
  a load); after that :meth:`KeyBook.presence` calls it unknown, so a Lookup that
  would promote it asks the server first: a block the server evicted answers MISS
  instead of a HIT_PENDING whose promotion fails. A held key past its expiry is
  dropped at its next lookup.
* a short-lived presence cache of probe answers (``presence_ttl``) about keys other
  daemons may have stored. A key it knows nothing about (neither held nor freshly
  answered) is unknown: the tier asks the server through its
  :class:`~kvtierd.tiers.redis.prober.Prober`, whose answers come back to
  :meth:`KeyBook.answered` (a node that failed its probe leaves its keys unknown:
  asked again at their next lookup). A held key a probe found absent is dropped
  only if it was stored before the probe left.
* what left: the keys dropped since the tiering last took them
  and why each of the last :data:`REMOVALS_KEPT` went (for ``kvtierctl explain``):
  :attr:`KeyBook.removals`.
* the tier's own ``capacity``: :meth:`KeyBook.evict_over_capacity` picks the least
  recently used held keys past it (the tier deletes their values off the loop).

It does no I/O and counts nothing the tier reports but its held keys; the tier
(:mod:`.tier`) asks the server, counts hits and evictions, and logs.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvtierd.contract import BlockKey, LookupResult
from kvtierd.tiers.base import Removals

HIT, MISS = LookupResult.HIT, LookupResult.MISS
REMOVALS_KEPT = 1024
PRESENCE_KEPT = 2048  # presence answers kept before the stale ones are swept


class KeyBook:
    """The held keys, the presence cache and the removal history of one pool's tier.

    Invariants (the tier changes it on the event loop only; the I/O threads never
    see it):

    * ``_held``: the keys stored (or loaded) and not dropped or evicted since, least
      recently used first, each with the monotonic time its value expires on the
      server (inf without ``ttl``); ``len(_held) * value_bytes`` is :attr:`used_bytes`.
    * ``_confirmed`` has exactly the held keys: each with the monotonic time it was
      last known present (stored, probed present, loaded).
    * ``_presence`` (key -> (present, until)) has no held key: :meth:`hold` removes
      the key's answer and a probe's answer about a held key only confirms or drops
      it. Once it holds :data:`PRESENCE_KEPT` answers, the stale ones are swept at
      each probe answer.
    * ``_writing``: store jobs in flight per key, positive counts only.
    * a dropped key (:meth:`drop`) answers absent for ``presence_ttl``; one that was
      held leaves ``_held`` and ``_confirmed`` and is dropped in :attr:`removals` (out
      once at its ``take()``; why, for the last :data:`REMOVALS_KEPT` keys). A
      key evicted at capacity leaves the same way but is unknown (no presence
      answer), not absent.
    """

    def __init__(
        self,
        value_bytes: int,
        *,
        ttl_ms: int | None,
        presence_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``ttl_ms``: how long the server keeps a stored value (None: until evicted).
        ``clock``: monotonic seconds (the prober's ``sent_at`` is on the same clock)."""
        self.value_bytes = value_bytes
        self._ttl_s = ttl_ms / 1000 if ttl_ms else float("inf")
        self._presence_ttl_s = presence_ttl_s
        self._clock = clock
        self._held: OrderedDict[BlockKey, float] = OrderedDict()
        self._confirmed: dict[BlockKey, float] = {}
        self._writing: Counter[BlockKey] = Counter()
        self._presence: dict[BlockKey, tuple[bool, float]] = {}
        self.removals = Removals(REMOVALS_KEPT)  # what the tier dropped, and why

    @property
    def blocks(self) -> int:
        return len(self._held)

    @property
    def used_bytes(self) -> int:
        return len(self._held) * self.value_bytes

    def least_recent(self, limit: int) -> Iterator[BlockKey]:
        """At most ``limit`` held keys, least recently used first."""
        return itertools.islice(self._held, limit)

    # -- answers -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> tuple[list[LookupResult], list[BlockKey]]:
        """HIT for a held key (now the most recent) or one a fresh probe saw, else MISS;
        with the keys nothing is known about (to be asked)."""
        now = self._clock()
        results = []
        unknown: list[BlockKey] = []
        for key in keys:
            known = self._knows(key, now)
            if known:
                if key in self._held:
                    self._held.move_to_end(key)
                results.append(HIT)
            else:
                if known is None:
                    unknown.append(key)
                results.append(MISS)
        return results, unknown

    def _knows(self, key: BlockKey, now: float) -> bool | None:
        """True when the key is held or a fresh probe saw it, False when a fresh
        probe found it absent, None when unknown (a held key past its ttl is dropped)."""
        expires = self._held.get(key)
        if expires is not None:
            if expires > now:
                return True
            self.drop(key, "expired: its ttl ran out on the server")
        seen = self._presence.get(key)
        if seen is not None and seen[1] > now:
            return seen[0]
        return None

    def presence(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """Held and seen within ``presence_ttl``, or seen present by a fresh probe:
        True; found absent by a fresh probe (or past its ttl): False; else None
        (a held key not seen lately too: the server may have evicted it)."""
        now = self._clock()
        stale = now - self._presence_ttl_s
        answers: list[bool | None] = []
        for key in keys:
            expires = self._held.get(key)
            if expires is not None:
                answers.append(
                    False if expires <= now else (True if self._confirmed[key] > stale else None)
                )
                continue
            seen = self._presence.get(key)
            answers.append(seen[0] if seen is not None and seen[1] > now else None)
        return answers

    def contains(self, key: BlockKey) -> bool:
        """Held and not expired, or seen present by a fresh probe."""
        now = self._clock()
        if self._held.get(key, 0.0) > now:
            return True
        seen = self._presence.get(key)
        return seen is not None and seen[1] > now and seen[0]

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """The held ones among ``keys`` become the most recent."""
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key)

    # -- probe answers -------------------------------------------------------------------

    def answered(self, answers: Sequence[tuple[BlockKey, bool | None]], sent_at: float) -> None:
        """A probe's answers: kept for a key not held; a held key found present is
        confirmed, found absent dropped only if it was stored before the probe left
        at ``sent_at`` (one stored meanwhile was absent when asked and present now)."""
        now = self._clock()
        until = now + self._presence_ttl_s
        for key, present in answers:
            if present is None:
                continue  # its node failed: unknown, asked again at its next lookup
            confirmed = self._confirmed.get(key)
            if confirmed is None:  # not held
                self._presence[key] = (present, until)
            elif present:
                self._confirmed[key] = now
            elif confirmed < sent_at and not self._writing[key]:
                self.drop(key, "evicted by the server (a probe found it gone)")
        self._expire_presence()

    def _expire_presence(self) -> None:
        if len(self._presence) < PRESENCE_KEPT:
            return
        now = self._clock()
        self._presence = {k: v for k, v in self._presence.items() if v[1] > now}

    # -- stores, loads, removals ---------------------------------------------------------

    def needs_write(self, key: BlockKey) -> bool:
        """Neither held nor being written by a store job (else stored without a rewrite)."""
        return key not in self._held and not self._writing[key]

    def writing(self, keys: Iterable[BlockKey]) -> None:
        """A store job writing ``keys`` was queued."""
        for key in keys:
            self._writing[key] += 1

    def written(self, keys: Iterable[BlockKey]) -> None:
        """The store job writing ``keys`` finished (whatever its outcome)."""
        for key in keys:
            self._writing[key] -= 1
            if self._writing[key] <= 0:
                del self._writing[key]

    def hold(self, key: BlockKey) -> None:
        """Makes ``key`` held and most recent; a key held already keeps its expiry
        (SET NX did not renew it)."""
        now = self._clock()
        if key not in self._held:
            self._held[key] = now + self._ttl_s
        self._held.move_to_end(key)
        self._confirmed[key] = now
        self._presence.pop(key, None)

    def loaded(self, key: BlockKey) -> None:
        """A load found ``key``'s value: a held key is the most recent and confirmed."""
        if key in self._held:
            self._held.move_to_end(key)
            self._confirmed[key] = self._clock()

    def drop(self, key: BlockKey, why: str) -> None:
        """The server holds no value for ``key`` (``why``): absent for ``presence_ttl``."""
        self._presence[key] = (False, self._clock() + self._presence_ttl_s)
        if key in self._held:
            del self._held[key]
            del self._confirmed[key]
            self.removals.drop(key, why)

    def evict_over_capacity(self, capacity_bytes: int, protect: set[BlockKey]) -> list[BlockKey]:
        """The least recently used held keys, no longer held, until within
        ``capacity_bytes`` (the keys in ``protect``, just stored, go last: they are
        the most recent; one is kept when nothing else is left to evict)."""
        victims: list[BlockKey] = []
        while self.used_bytes > capacity_bytes and self._held:
            victim, expires = self._held.popitem(last=False)
            if victim in protect and len(self._held) < len(protect):
                self._held[victim] = expires  # nothing else to evict: keep it
                break
            del self._confirmed[victim]
            victims.append(victim)
            self.removals.drop(victim, "evicted: least recently used at capacity")
        return victims
