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
to a live grant:

- keys the grant reserved (not claimed yet) are claimed: their rows are vLLM's;
- keys the grant skipped (present then) are skipped, unless a store evicted
  them since or a store of them failed (then the daemon is asked, as without
  this module);
- the grant's evicted keys are reported with its first claim;
- keys no grant was offered (a chain longer than one lookup, a key offered
  by none) are asked of the daemon by a ``PrepareStore`` of their own, and the
  answers merged (a refusal refuses the whole call and gives the claimed rows
  back, as the daemon refuses a store all or nothing).

Reserved keys nobody claimed are given back (queued
``CompleteStore(success=false)``) at the end of the step whose ``prepare_store``
calls could claim them: a grant lives through ``lifetime`` step ends
(``on_schedule_end`` calls). vLLM 0.33 calls ``on_schedule_end`` after the
step's ``prepare_store`` calls: a lifetime of 1, the grant ends with its step.
vLLM 0.32 calls it *before* them (``build_connector_meta`` ends the step, then
builds the store jobs): a lifetime of 2, the grant is claimed right after the
first step end and given back at the second
(:class:`~kvtierd_client.vllm.compat.VllmCalls`). Given back at once: all of
them at ``reset_cache``, none when the session is lost (they died with it). A
grant the daemon refused (no room) is not kept: vLLM's ``prepare_store`` then
asks the daemon itself.

What may differ from asking at ``prepare_store`` time (docs/guides/vllm.md, "Round trips"):
rows are reserved, and victims evicted, when the lookup is answered rather than
a moment later in the same step, so another request's lookup in that step no
longer finds a victim; and a lookup of a key a live grant reserved and nobody
claimed yet is answered MISS (what it was before the reservation), not
HIT_PENDING. The replay (``make bench-vllm``) checks the hits request by request.

Owned by one manager, scheduler thread only; no lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["AheadGrant", "Claim", "StoreAhead"]


@dataclass(eq=False)
class AheadGrant:
    """One ``PrepareStore`` asked ahead: the keys offered, the rows of the keys it
    reserved and nobody claimed yet, the victims not reported yet, the keys it
    skipped as present that are absent since (``stale``), and the step ends it
    has seen. Compared by identity (two grants may hold equal values)."""

    offered: frozenset[bytes]
    rows: dict[bytes, int] = field(default_factory=dict)
    evicted: list[bytes] = field(default_factory=list)
    stale: set[bytes] = field(default_factory=set)
    ends: int = 0


@dataclass
class Claim:
    """What the live grants answer of one ``prepare_store`` (``StoreAhead.claim``)."""

    keys_to_store: list[bytes] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # co-indexed with keys_to_store
    evicted: list[bytes] = field(default_factory=list)
    ask: list[bytes] = field(default_factory=list)  # keys no grant answers for


class StoreAhead:
    """The live grants (see the module doc).

    ``lifetime``: step ends a grant lives through (1 for vLLM 0.33's call order,
    2 for 0.32's). Invariants: a key is reserved by at most one grant, and
    ``reserved`` is the union of the grants' ``rows``; every grant has seen fewer
    than ``lifetime`` step ends; a grant's ``stale`` keys are keys it offered.
    """

    def __init__(self, lifetime: int = 1) -> None:
        if lifetime < 1:
            raise ValueError(f"a grant lives through at least one step end, got {lifetime}")
        self.lifetime = lifetime
        self._grants: list[AheadGrant] = []
        self.reserved: set[bytes] = set()

    def add(
        self, offered: Sequence[bytes], keys_to_store: Sequence[bytes], rows: Sequence[int],
        evicted: Sequence[bytes],
    ) -> None:  # fmt: skip
        """Keeps an accepted grant of a ``PrepareStore`` of ``offered``."""
        reserved = dict(zip(keys_to_store, rows, strict=True))
        self.note_absent(evicted)
        self._grants.append(AheadGrant(frozenset(offered), reserved, list(evicted)))
        self.reserved.update(reserved)

    def note_absent(self, keys: Iterable[bytes]) -> None:
        """Keys absent now whatever a live grant saw: evicted by a store (a grant's,
        or a ``PrepareStore`` asked at ``prepare_store`` time), or whose store
        failed. A grant that skipped them as present no longer answers for them."""
        keys = list(keys)
        for grant in self._grants:
            grant.stale.update(k for k in keys if k in grant.offered)

    def claim(self, keys: Sequence[bytes]) -> Claim | None:
        """The part of ``prepare_store(keys)`` (unique keys) the live grants answer:
        the keys they reserved (claimed now, with their rows), the keys they skipped
        as present (and not absent since), the victims not reported yet of the
        grants that answered, and the keys left to ask the daemon about. None when
        no key was offered to a grant: the daemon is asked about all, as without
        them."""
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
                grant = next(
                    (g for g in self._grants if key in g.offered and key not in g.stale), None
                )
                if grant is None:
                    claim.ask.append(key)
                    continue
            if grant not in answering:
                answering.append(grant)
        for grant in answering:
            claim.evicted.extend(grant.evicted)
            grant.evicted = []
        return claim

    def end_step(self) -> list[bytes]:
        """A step ended: the reserved keys nobody claimed of the grants that have now
        lived through ``lifetime`` step ends (to give back); those grants end."""
        for grant in self._grants:
            grant.ends += 1
        done = [g for g in self._grants if g.ends >= self.lifetime]
        self._grants = [g for g in self._grants if g.ends < self.lifetime]
        return self._drop(done)

    def take_unclaimed(self) -> list[bytes]:
        """Ends every grant: the reserved keys nobody claimed (to give back)."""
        done, self._grants = self._grants, []
        return self._drop(done)

    @property
    def live(self) -> int:
        """Grants not ended yet."""
        return len(self._grants)

    def clear(self) -> None:
        """Forgets every grant (their reservations died with the session)."""
        self._grants.clear()
        self.reserved.clear()

    def _drop(self, grants: list[AheadGrant]) -> list[bytes]:
        unclaimed = [k for grant in grants for k in grant.rows]
        self.reserved.difference_update(unclaimed)
        return unclaimed
