"""Stores asked ahead: the ``PrepareStore`` a lookup's round trip carries.

vLLM looks a request's prefix chain up key by key and, when the request is
computed, stores the blocks after its hit prefix (``prepare_store`` of the
chain's tail, usually in the same scheduler step). The manager knows the chain
at the first lookup (vLLM's key positions), so that lookup's ``Batch`` carries a
``PrepareStore`` of the same keys right after the ``Lookup``: one round trip
instead of two. The daemon skips the keys it holds (the hit prefix among them:
the lookup just pinned it), so the grant reserves exactly the keys a
``prepare_store`` of the tail would, with the same victims (keys offered to a
store are never its victims; pinned keys never are). vLLM's ``prepare_store``
is then answered here without a round trip when every key it names was offered
to one grant of this step:

- keys the grant reserved (not claimed yet) are claimed: their rows are vLLM's;
- keys the grant skipped (present then) are skipped, unless a grant of this step
  evicted them since (then the daemon is asked, as without this module);
- the grant's evicted keys are reported with its first claim;
- keys no grant was offered (a chain longer than one lookup, a key offered
  by none) are asked of the daemon by a ``PrepareStore`` of their own, and the
  answers merged (a refusal refuses the whole call and gives the claimed rows
  back, as the daemon refuses a store all or nothing).

Reserved keys nobody claimed by the end of the step are given back (queued
``CompleteStore(success=false)``); so are all of them when the session is lost
(they died with it). A grant the daemon refused (no room) is not kept: vLLM's
``prepare_store`` then asks the daemon itself.

What may differ from asking at ``prepare_store`` time (docs/guides/vllm.md, "Round trips"):
rows are reserved, and victims evicted, when the lookup is answered rather than
a moment later in the same step, so another request's lookup in that step no
longer finds a victim; and a lookup of a key this step's grants reserved and
nobody claimed yet is answered MISS (what it was before the reservation), not
HIT_PENDING. The replay (``make bench-vllm``) checks the hits request by request.

Owned by one manager, scheduler thread only; no lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["AheadGrant", "Claim", "StoreAhead"]


@dataclass
class AheadGrant:
    """One ``PrepareStore`` asked ahead: the keys offered, the rows of the keys it
    reserved and nobody claimed yet, and the victims not reported yet."""

    offered: frozenset[bytes]
    rows: dict[bytes, int] = field(default_factory=dict)
    evicted: list[bytes] = field(default_factory=list)


@dataclass
class Claim:
    """What this step's grants answer of one ``prepare_store`` (``StoreAhead.claim``)."""

    keys_to_store: list[bytes] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # co-indexed with keys_to_store
    evicted: list[bytes] = field(default_factory=list)
    ask: list[bytes] = field(default_factory=list)  # keys no grant answers for


class StoreAhead:
    """This step's grants (see the module doc). Invariant: a key is reserved by at
    most one grant (``reserved``); ``_evicted`` holds every key a grant of this
    step evicted."""

    def __init__(self) -> None:
        self._grants: list[AheadGrant] = []
        self._evicted: set[bytes] = set()
        self.reserved: set[bytes] = set()

    def add(
        self, offered: Sequence[bytes], keys_to_store: Sequence[bytes], rows: Sequence[int],
        evicted: Sequence[bytes],
    ) -> None:  # fmt: skip
        """Keeps an accepted grant of a ``PrepareStore`` of ``offered``."""
        reserved = dict(zip(keys_to_store, rows, strict=True))
        self._grants.append(AheadGrant(frozenset(offered), reserved, list(evicted)))
        self.reserved.update(reserved)
        self.note_evicted(evicted)

    def note_evicted(self, keys: Iterable[bytes]) -> None:
        """Keys a store of this step evicted (a grant's, or a ``PrepareStore`` asked
        at ``prepare_store`` time): they are absent now, whatever a grant saw."""
        self._evicted.update(keys)

    def claim(self, keys: Sequence[bytes]) -> Claim | None:
        """The part of ``prepare_store(keys)`` (unique keys) this step's grants answer:
        the keys they reserved (claimed now, with their rows), the keys they skipped
        as present (not evicted since), the victims not reported yet of the grants
        that answered, and the keys left to ask the daemon about. None when no key
        was offered to a grant: the daemon is asked about all, as without them."""
        if not any(k in grant.offered for grant in self._grants for k in keys):
            return None
        claim = Claim()
        answering: list[AheadGrant] = []
        for key in keys:
            grant = next((g for g in self._grants if key in g.rows), None)
            if grant is not None:
                claim.keys_to_store.append(key)
                claim.rows.append(grant.rows.pop(key))
                self.reserved.discard(key)
            else:
                grant = next((g for g in self._grants if key in g.offered), None)
                if grant is None or key in self._evicted:
                    claim.ask.append(key)
                    continue
            if grant not in answering:
                answering.append(grant)
        for grant in answering:
            claim.evicted.extend(grant.evicted)
            grant.evicted = []
        return claim

    def take_unclaimed(self) -> list[bytes]:
        """Ends the step: the reserved keys nobody claimed (to give back); forgets all."""
        unclaimed = [k for grant in self._grants for k in grant.rows]
        self.clear()
        return unclaimed

    def clear(self) -> None:
        self._grants.clear()
        self._evicted.clear()
        self.reserved.clear()
