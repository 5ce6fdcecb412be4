"""A pool: one namespace of blocks with its region, its primary manager, its
event log, and the claims of its sessions (:mod:`kvtierd.core.claims`).

Ownership (docs/design/semantics.md, "The primary tier"):

* a *pin* (ref count +1) taken by ``prepare_load`` belongs to the session that
  asked; only that session's ``complete_load`` releases it, or the pool when the
  session is released (closed / lease expired);
* a *reservation* (ref count -1) made by ``prepare_store`` belongs to the
  session that asked; only that session's ``complete_store`` completes or aborts
  it; keys reserved by another session are left alone; releasing the session
  aborts every reservation it still holds.

Secondary tiers (cascade after CompleteStore, promotion on Lookup) are driven
by :class:`kvtierd.tiering.manager.Tiering`, which owns the pins of its cascade jobs,
the reservations of its promotions and the promotion holds (pins that keep a
promoted block until a session pins it, :mod:`kvtierd.tiering.holds`); sessions never
see or release those. A session's pin *claims* the hold of its key: PrepareLoad
always, a pinning Lookup when its request waits for nothing (no HIT_PENDING).

Invariants (:meth:`Pool.check_invariants`): for every key, the primary's ref
count is the session pins on it + the cascade jobs naming it + 1 if it is held;
no key is reserved by two sessions, every reserved key is pending (ref -1), and
every pending row is a session's reservation or a promotion's.

Every method runs on the daemon's event loop; none blocks. Each mutator
validates everything first and then applies, so a rejected call changes nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.config import LimitsConfig
from kvtierd.contract import (
    PRIMARY_TIER,
    BlockEvent,
    BlockKey,
    LookupResult,
    Medium,
    PoolSpec,
    StoreGrant,
    key_repr,
)
from kvtierd.core.claims import ClaimTable
from kvtierd.core.statistics import PoolStatistics, PrimaryStatistics, SecondaryStatistics
from kvtierd.errors import FailedPrecondition
from kvtierd.kvevents.service import KvEventsService
from kvtierd.prefix import READY, prefix_end
from kvtierd.primary.errors import NotLoadableError
from kvtierd.primary.manager import PrimaryManager
from kvtierd.primary.region import Region
from kvtierd.primary.warm.journal import JournalWriter
from kvtierd.records.events import EventLog
from kvtierd.records.history import EVICTED_FOR_ROOM, FLUSHED, KeyRecord, RemovalLog
from kvtierd.tiering.admission import NOT_ADMITTED
from kvtierd.tiering.manager import Tiering
from kvtierd.tiering.remote import RemoteWait
from kvtierd.tiering.retries import FailedPromotion

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a key is (not) served: its primary state, tier presence, recent removals."""

    primary: LookupResult
    ref_count: int | None
    tiers: list[tuple[str, bool | None]]  # None: the tier cannot tell yet
    history: list[KeyRecord]  # oldest first
    summary: str


def _summary(
    state: LookupResult,
    tiers: list[tuple[str, bool | None]],
    history: list[KeyRecord],
    waits: dict[str, tuple[FailedPromotion, float]],
) -> str:
    """``waits``: per tier name, why the key is not promoted from it yet and for how
    many seconds more (:meth:`Tiering.promotion_wait`)."""
    return _main_summary(state, tiers, history, waits) + _not_admitted(tiers, history)


def _main_summary(
    state: LookupResult,
    tiers: list[tuple[str, bool | None]],
    history: list[KeyRecord],
    waits: dict[str, tuple[FailedPromotion, float]],
) -> str:
    if state is LookupResult.HIT:
        return "HIT: readable in the primary tier"
    if state is LookupResult.HIT_PENDING:
        return "HIT_PENDING: a write (store or promotion) into the primary is in flight"
    holders = [name for name, present in tiers if present]
    if holders:
        return _promotion_summary(holders, waits)
    unknown = [name for name, present in tiers if present is None]
    if unknown:
        return f"not in the primary; tier {unknown[0]} is still rebuilding its index (RETRY)"
    if history:
        last = history[-1]
        if last.what.startswith(NOT_ADMITTED):  # told by _not_admitted
            return "MISS: in no tier"
        return f"MISS: last seen leaving tier {last.tier}: {last.what}"
    return "MISS: never stored, or stored so long ago that its record was forgotten"


def _not_admitted(tiers: list[tuple[str, bool | None]], history: list[KeyRecord]) -> str:
    """ "; tier T: not admitted: <why>" for each tier that does not hold the key and whose
    last record of it is a refusal of its admission (the key never reached it since)."""
    last: dict[str, str] = {}
    for record in history:  # oldest first: the last record per tier wins
        last[record.tier] = record.what
    return "".join(
        f"; tier {name}: {last[name]}"
        for name, present in tiers
        if present is False and last.get(name, "").startswith(NOT_ADMITTED)
    )


def _promotion_summary(holders: list[str], waits: dict[str, tuple[FailedPromotion, float]]) -> str:
    """A key not in the primary that ``holders`` (tier names, in order) hold: which
    tier the next Lookup promotes it from, or why none does yet."""
    free = [name for name in holders if name not in waits]
    if free:
        return f"not in the primary; held by tier {free[0]}: the next Lookup promotes it"
    name = holders[0]
    failure, left = waits[name]
    if failure.transient:
        return (
            f"not in the primary; held by tier {name}, but its last promotion failed for now "
            f"({failure.cause}; nothing was removed): Lookups answer MISS for {left:.1f}s "
            "more, then the next one promotes it again"
        )
    return (
        f"not in the primary; held by tier {name}, but its promotion failed (unreadable or "
        f"corrupt): Lookups answer MISS for {left:.0f}s more, then the next one tries again"
    )


class Pool:
    """One pool. Owned by the PoolTable; its sessions hold references to it."""

    def __init__(self, spec: PoolSpec, region: Region, limits: LimitsConfig) -> None:
        self.spec = spec
        self.region = region
        self.events = EventLog(limits.events_retained, limits.events_retained_bytes)
        self.history = RemovalLog(max_bytes=limits.removals_retained_bytes)
        # set by the daemon when [kv_events] publishes this pool (kvtierd.kvevents)
        self.kv_events: KvEventsService | None = None
        self.manager = PrimaryManager(
            spec.num_blocks, spec.eviction_policy, on_event=self._record_event
        )
        self.tiering = Tiering(
            spec.name,
            self.manager,
            self.history,
            on_event=self._record_event,
            hold_seconds=limits.promotion_hold,
        )
        # Invariant: see the module docstring (checked by check_invariants).
        self._claims = ClaimTable()
        self._lookups = Counter({r: 0 for r in LookupResult})
        self._loads_completed = 0  # pins released by CompleteLoad as loads
        self._unused_pins = 0  # pins released by CompleteLoad(unused=True)
        self._stores_completed = 0
        self._stores_aborted = 0
        self._stores_refused = 0
        self.journal: JournalWriter | None = None  # memory.warm_restart
        self.adopted_blocks = 0  # blocks taken over from the previous daemon
        self.dropped_blocks = 0  # ... and the ones dropped there (checksum mismatch)
        # memory.warm_restart is on but this pool's journal could not be started
        # (its path taken, a failed write): it serves, and its next start is cold
        self.warm_restart_off = False
        # a graceful stop: row -> until (monotonic) for the rows the sessions pinned
        # or reserved as they were closed (hold_for_stop); journaled at close
        self._stop_holds: dict[int, float] = {}

    def attach_journal(self, journal: JournalWriter) -> None:
        """From now on every row handed to a writer and every completed block is
        journaled (``kvtierd.primary.warm.journal``); at close the region file stays."""
        self.journal = journal
        self.manager.on_rows_reserved = journal.rows_reserved
        self.manager.on_rows_ready = journal.rows_ready

    # ----------------------------------------------------------------- sessions

    @property
    def session_count(self) -> int:
        return len(self._claims)

    def attach(self, session_id: str) -> None:
        """Gives a new session an empty claims record (it holds nothing yet)."""
        self._claims.attach(session_id)

    def release_session(self, session_id: str, quarantine_until: float) -> tuple[int, int]:
        """Drops every pin and aborts every reservation of the session.

        The rows of the aborted reservations stay quarantined (neither mapped nor
        free) until :meth:`release_quarantine` is called at or after
        ``quarantine_until``: the session's writer may still be copying into them
        (docs/design/leases.md). Returns (pins released, reservations aborted).
        Called once per session, when it closes or its lease expires.
        """
        claims = self._claims.detach(session_id)
        unpin = claims.pin_list()
        if unpin:
            self.manager.complete_load(unpin)  # pin n -> n-1, per pin held
        if claims.reserved:
            aborted = self.manager.abort_and_quarantine(list(claims.reserved), quarantine_until)
            self._stores_aborted += len(aborted)
        return len(unpin), len(claims.reserved)

    def release_quarantine(self, now: float) -> int:
        """Frees the quarantined rows whose time has come; returns how many."""
        return self.manager.release_quarantine(now)

    def cover_leases(self, seconds: float) -> None:
        """A lease is about to be granted that its client may use for up to
        ``seconds`` from now (lease + write_quarantine): the journal's horizon must
        reach that far first, should the daemon crash (docs/design/journal.md)."""
        if self.journal is not None:
            self.journal.cover_leases(seconds)

    def hold_for_stop(self, session_id: str, until: float) -> None:
        """A graceful stop is closing the session, whose client may touch the rows it
        pins or reserves until ``until`` (its lease as the client proves it, plus
        write_quarantine): recorded for the journal's stop records. Call it before
        :meth:`release_session`."""
        claims = self._claims.of(session_id)
        holds = self._stop_holds
        for key in (*claims.pins, *claims.reserved):
            row = self.manager.block_id(key)
            if row is not None:
                holds[row] = max(until, holds.get(row, until))

    def stop_holds(self, now: float) -> dict[int, float]:
        """row -> seconds from ``now`` a client of this daemon may still touch it:
        the rows of :meth:`hold_for_stop`, the quarantined rows and the adopted
        blocks still held for the previous daemon's clients. The journal's
        ``held`` records of a graceful stop; every other row is free for the
        next daemon at once."""
        holds = dict(self._stop_holds)
        for row, until in self.manager.held_rows().items():
            holds[row] = max(until, holds.get(row, until))
        return {row: until - now for row, until in holds.items() if until > now}

    # ----------------------------------------------------------------- manager ops

    def lookup(self, keys: Sequence[BlockKey], *, prefix: bool = False) -> list[LookupResult]:
        """Primary state per key; a primary miss that a secondary tier holds starts
        a promotion and answers HIT_PENDING (see Tiering.lookup).

        ``prefix``: the keys are a prefix chain; every key after the first one that
        is neither HIT nor HIT_PENDING (:func:`kvtierd.prefix.prefix_end`) answers
        MISS and starts no promotion."""
        results = self.tiering.lookup(keys, self.manager.lookup(keys), prefix=prefix)
        if prefix:
            cut = prefix_end(results)
            results[cut + 1 :] = [LookupResult.MISS] * (len(results) - cut - 1)
        self._lookups.update(results)
        return results

    def remote_wait(self, keys: Sequence[BlockKey], *, prefix: bool = False) -> RemoteWait | None:
        """What a Lookup of ``keys`` waits for before it is answered: the remote tiers'
        answers about its primary misses no tier knows (:mod:`kvtierd.tiering.remote`);
        None when there is nothing to ask. Changes no state a Lookup answers from
        (the tiers only learn), counts nothing."""
        if not self.tiering.remote:
            return None
        return self.tiering.remote_wait(keys, self.manager.lookup(keys), prefix=prefix)

    def lookup_and_pin(
        self, session_id: str, keys: Sequence[BlockKey], *, prefix: bool = False
    ) -> tuple[list[LookupResult], list[int]]:
        """:meth:`lookup`, then pins the keys answered HIT for the session (with
        ``prefix`` the leading HITs only), as ``prepare_load`` would. Returns the
        results and, co-indexed, the pinned rows (-1 where not pinned)."""
        claims = self._claims.of(session_id)
        results = self.lookup(keys, prefix=prefix)
        if prefix:
            chosen = list(range(prefix_end(results, READY)))
        else:
            chosen = [i for i, r in enumerate(results) if r is LookupResult.HIT]
        block_ids = [-1] * len(keys)
        if chosen:
            pinned = [keys[i] for i in chosen]
            for i, row in zip(chosen, self.manager.prepare_load(pinned), strict=True):
                block_ids[i] = row
            claims.pin(pinned)  # owned by the session, as PrepareLoad
            if LookupResult.HIT_PENDING not in results:  # the request can run: it loads
                self.tiering.claim_holds(pinned)
        return results, block_ids

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.manager.touch(keys)
        self.tiering.touch(keys)

    def prepare_load(self, session_id: str, keys: Sequence[BlockKey]) -> list[int]:
        """Pins ``keys`` for the session; every key must be HIT."""
        claims = self._claims.of(session_id)
        try:
            block_ids = self.manager.prepare_load(keys)  # all or nothing
        except NotLoadableError as exc:
            raise FailedPrecondition(
                f"keys: {key_repr(exc.key)} is {exc.state.name}, not HIT; look keys up and "
                "load only those that answered HIT"
            ) from None
        claims.pin(keys)  # pin 0 -> 1 (or n -> n+1), owned by the session
        self.tiering.claim_holds(keys)  # the pins above keep the rows: hold n -> n-1
        return block_ids

    def complete_load(
        self, session_id: str, keys: Sequence[BlockKey], *, unused: bool = False
    ) -> None:
        """Releases the session's pins on ``keys``; the session must hold one pin per
        occurrence of each key (a key named twice releases two). They count as
        loads, or as ``unused_pins`` when ``unused`` (nobody read the rows)."""
        claims = self._claims.of(session_id)
        missing = claims.first_unpinned(keys)
        if missing is not None:
            raise FailedPrecondition(
                f"keys: {key_repr(missing)} is not pinned by this session; CompleteLoad "
                "only keys this session got from PrepareLoad, once per PrepareLoad"
            )
        self.manager.complete_load(keys)  # pin n -> n-1 per occurrence
        claims.unpin(keys)
        if unused:
            self._unused_pins += len(keys)
        else:
            self._loads_completed += len(keys)
            self.tiering.read(keys)  # admission: a tier may take a block at its load

    def prepare_store(self, session_id: str, keys: Sequence[BlockKey]) -> StoreGrant | None:
        """Reserves rows for the keys not present; None when no room (nothing changed).
        Held blocks are not evicted for it (expired holds are released first)."""
        claims = self._claims.of(session_id)
        self.tiering.expire_holds()
        grant = self.manager.prepare_store(keys)
        if grant is None:
            self._stores_refused += 1
            return None
        if grant.evicted_keys:
            self.history.record(grant.evicted_keys, PRIMARY_TIER, EVICTED_FOR_ROOM)
        claims.reserve(grant.keys_to_store)  # ref -1, owned by the session
        return grant

    def complete_store(self, session_id: str, keys: Sequence[BlockKey], success: bool) -> int:
        """Completes (or aborts) the keys this session reserved; returns how many."""
        mine = self._claims.of(session_id).take_reserved(keys)
        if not mine:
            return 0
        done = self.manager.complete_store(mine, success)  # ref -1 -> 0, or row freed
        if success:
            self._stores_completed += len(done)
            self.tiering.cascade(done)
        else:
            self._stores_aborted += len(done)
        return len(done)

    def flush(self) -> int:
        """Evicts every ready, unpinned block (pinned, held and in-flight ones stay;
        expired holds are released first)."""
        self.tiering.expire_holds()
        flushed = self.manager.evict_all_evictable()
        if flushed:
            self.history.record(flushed, PRIMARY_TIER, FLUSHED)
        return len(flushed)

    def _record_event(self, event: BlockEvent) -> None:
        """Every tier's stored / removed blocks: into the event log, and to the
        KV-event publisher when it publishes this pool."""
        self.events.append(event)
        if self.kv_events is not None:
            self.kv_events.observe(self.spec.name, event)

    def describe(self, request: Any) -> None:
        """Hands a CompleteStore (its keys and validated descriptions) to the
        KV-event publisher, before the completion's events; nothing when it does
        not publish this pool."""
        if self.kv_events is not None:
            self.kv_events.describe(self.spec.name, request)

    @property
    def name(self) -> str:
        return self.spec.name

    def holders(self, key: BlockKey) -> list[tuple[str, int]]:
        """(tier name, medium) of each tier holding ``key`` now, the primary first; a
        tier that cannot tell from memory counts as not holding it."""
        held = []
        if self.manager.lookup((key,))[0] is LookupResult.HIT:
            held.append((PRIMARY_TIER, int(Medium.CPU)))
        for tier in self.tiering.tiers:
            if tier.contains(key):
                held.append((tier.name, int(tier.medium)))
        return held

    async def wait_tiers_ready(self) -> None:
        """Returns once every secondary tier answers from what it holds."""
        for tier in self.tiering.tiers:
            await tier.wait_ready()

    def explain(self, key: BlockKey) -> Explanation:
        """Where ``key`` is and what recently removed it; changes nothing."""
        state = self.manager.lookup((key,))[0]
        presence = [(tier.name, tier.contains(key)) for tier in self.tiering.tiers]
        waits = {
            tier.name: wait
            for index, tier in enumerate(self.tiering.tiers)
            if (wait := self.tiering.promotion_wait(index, key)) is not None
        }
        history = self.history.get(key) + [
            KeyRecord(when, tier.name, what)
            for tier in self.tiering.tiers
            for when, what in tier.removals(key)
        ]
        history.sort(key=lambda record: record.unix_time)
        return Explanation(
            primary=state,
            ref_count=self.manager.ref_count(key),
            tiers=presence,
            history=history,
            summary=_summary(state, presence, history, waits),
        )

    # ----------------------------------------------------------------- read-only

    def statistics(self) -> PoolStatistics:
        """The pool's state and counters, primary and secondary, in one snapshot
        (taken on the loop, so nothing changes while it is built)."""
        spec = self.spec
        primary = self.manager.statistics()
        lookups = self._lookups
        tiering = self.tiering
        return PoolStatistics(
            spec=spec,
            sessions=self.session_count,
            region_path=self.region.path,
            region_bytes=self.region.size,
            last_event_seq=self.events.last_seq,
            primary=PrimaryStatistics(
                block_bytes=spec.block_bytes,
                capacity_blocks=spec.num_blocks,
                used_blocks=primary.used_blocks,
                pinned_blocks=primary.pinned_blocks,
                pending_blocks=primary.pending_blocks,
                quarantined_blocks=primary.quarantined_blocks,
                evictions=primary.evictions,
                hits=lookups[LookupResult.HIT],
                hits_pending=lookups[LookupResult.HIT_PENDING],
                misses=lookups[LookupResult.MISS],
                retries=lookups[LookupResult.RETRY],
                loads=self._loads_completed,
                unused_pins=self._unused_pins,
                stores_completed=self._stores_completed,
                stores_aborted=self._stores_aborted,
                stores_refused=self._stores_refused,
            ),
            secondaries=tuple(
                SecondaryStatistics(
                    tier=tier.statistics(),
                    ready=tier.ready,
                    counters=tiering.counters(index),
                    admission=tiering.admission_statistics(index),
                )
                for index, tier in enumerate(tiering.tiers)
            ),
            warm_adopted_blocks=self.adopted_blocks,
            warm_dropped_blocks=self.dropped_blocks,
            journal_bytes=self.journal.file_bytes if self.journal is not None else 0,
            journal_lag_seconds=self.journal.lag_seconds() if self.journal is not None else 0.0,
            warm_restart_off=int(
                self.warm_restart_off or (self.journal is not None and self.journal.failed)
            ),
        )

    def check_invariants(self) -> None:
        """Verifies the pool's invariants across its objects (O(blocks + claims);
        tests call it after every step of a scenario, as ``PrimaryManager``'s):

        * the primary's own table (:meth:`PrimaryManager.check_invariants`);
        * every ref count is exactly the pins its owners hold: the sessions' pins
          + cascade jobs + holds, and no pin is without an owner
          (:meth:`Tiering.check_invariants`);
        * no key is reserved by two sessions; every reserved key is pending (ref
          -1); every pending row is a session's reservation or a promotion's.
        """
        self.manager.check_invariants()
        for session_id, claims in self._claims:
            assert all(count > 0 for count in claims.pins.values()), (
                f"session {session_id}: a pin count <= 0 in {claims.pins}"
            )
        self.tiering.check_invariants(self._claims.pins(), self._claims.reservations())

    def close_tiers(self) -> None:
        """Wakes the event watchers and stops the tiers (on the loop). The caller
        then closes the region (unlinks the file; slow for a big region, so off the
        loop). The caller has joined the tiers' I/O threads first."""
        self.events.wake_all()
        self.tiering.close()

    def close_region(self, held: dict[int, float] | None = None) -> None:
        """Closes the journal (its queued ready records land first; with ``held``, a
        graceful stop's :meth:`stop_holds`, its stop records last) and the region
        (unlinked unless warm restart keeps it). Blocking: off the loop, after
        :meth:`close_tiers`."""
        if self.journal is not None:
            self.journal.close(drain_seconds=_JOURNAL_DRAIN_SECONDS, held=held)
            if self.journal.failed:  # removed: nothing would vouch for a kept region
                self.region.keep_file = False
        self.region.close()

    def close(self) -> None:
        """:meth:`close_tiers`, then :meth:`close_region`. The pool is unusable
        afterwards."""
        self.close_tiers()
        self.close_region()


# how long closing a pool waits for the checksums of its last completed blocks
_JOURNAL_DRAIN_SECONDS = 10.0
