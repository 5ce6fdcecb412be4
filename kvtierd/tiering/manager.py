"""Cascades and promotions between one pool's primary tier and its secondary
tiers (docs/design/semantics.md, "Secondary tiers"; vLLM's ``TieringOffloadingManager``).

* Cascade: blocks a session completed are written to every secondary tier.
  Each tier job holds one *pool-owned pin* per block (ref +1 through
  ``PrimaryManager.prepare_load``) from submission until the tier reports the
  job done, success or not; a tier that refuses the job (backpressure) never
  gets the pins. So a row is never evicted or reused while a tier reads it.
* Promotion: a Lookup whose key misses the primary but hits a secondary tier
  reserves a primary row at once (ref -1, owned by this object, never by a
  session), answers HIT_PENDING, and submits one load job per tier per Lookup.
  When the tier reports, the keys that arrived verified become ready
  (``complete_store(success=True)``, a stored event); the others are aborted
  (their rows freed: MISS). A key whose promotion failed is not promoted from
  that tier again until its retry time (:mod:`kvtierd.tiering.retries`: no retry
  loop on a file that keeps failing): ``PROMOTION_RETRY_AFTER`` (30 s) when
  it was unreadable or corrupt (a verification failure removes the file anyway);
  a short, doubling window when it failed transiently (``JobResult.transient_keys``:
  an I/O worker timed out or died, a server did not answer; nothing was removed,
  and the next Lookup after the window promotes it again). A key the tier found
  simply gone (``JobResult.missing_keys``: the server evicted it, another daemon
  removed the file) is a plain MISS instead, promoted again as soon as the tier
  holds it again.
* Remote tiers (:mod:`kvtierd.tiering.remote`): before a Lookup is answered,
  :meth:`remote_wait` asks the remote tiers about the primary misses no tier
  knows, and the request handler waits for their answers (a bound), so that what
  another daemon stored answers HIT_PENDING in this very Lookup.
* Promotion holds (:mod:`kvtierd.tiering.holds`): the blocks a promotion brought in
  stay pinned by the pool (one *hold* each) until a session pins them or
  ``hold_seconds`` pass; so do the ready blocks a prefix Lookup answers HIT in
  front of a key it answers HIT_PENDING (the request loads them together). A
  held block is never evicted, so promotions are admitted only as far as free
  or ready, unheld rows can hold them (a key without room answers MISS), and a
  promoted block is read from the disk once per request that waits for it, not
  once per promotion of another request. A loop timer releases holds at their
  deadlines (and every Lookup first releases the expired ones); closing the
  tiering releases them all.
* Repeated lookups of a key whose promotion is in flight answer HIT_PENDING
  from the primary's table: no tier is consulted, no job started.
* Tiers are consulted in configuration order; a key promoted from tier *i* is
  cascaded to the tiers before *i* (a shared filesystem block lands on the
  local disk too).
* Admission (:mod:`kvtierd.tiering.admission`): each tier's policy picks which
  blocks a cascade writes to it; a rejected block gets no job (and no stored
  event): its history says "not admitted: <why>". Loads of blocks a tier lacks
  (:meth:`read`) are offered to it too, for the policies that write at loads.
* Write budgets (:mod:`kvtierd.tiering.budget`): what a tier admitted then asks the
  configured tier's ``max_write_bytes_per_s``; a block past it gets no job either
  (counted as rejected for reason ``budget``, its history says so).
* Events: a cascade job's stored keys become one stored event of that tier
  (its medium, its name), as vLLM's FS tier reports them; keys a tier dropped
  (evicted, failed verification, vanished) become one removed event, emitted
  when any of its jobs reports and before that job's stored event.

Invariants: for every key, ``manager.ref_count(key)`` = session pins + the
number of in-flight cascade jobs naming it + 1 if it is held; every row
reserved here has exactly one in-flight promotion job (:meth:`check_invariants`).
Event-loop only; tier completions arrive through :meth:`on_done`, which the
tiers schedule on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from kvtierd.contract import PRIMARY_TIER, BlockEvent, BlockKey, LookupResult
from kvtierd.prefix import prefix_end
from kvtierd.primary.manager import PrimaryManager
from kvtierd.records.history import EVICTED_FOR_ROOM, RemovalLog
from kvtierd.tiering.admission import AdmissionStats, AlwaysAdmit, Occasion, TierAdmission
from kvtierd.tiering.budget import BudgetGate
from kvtierd.tiering.holds import HoldStats, HoldTable
from kvtierd.tiering.remote import RemoteWait, known_miss, plan_asks
from kvtierd.tiering.retries import FailedPromotion, FailedPromotions
from kvtierd.tiers.base import JobResult, SecondaryTier, TierJob
from kvtierd.tiers.budget import WriteBudget

log = logging.getLogger(__name__)

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY


@functools.lru_cache(maxsize=64)
def transient_record(cause: str) -> str:
    """What Explain's history says of a promotion that failed transiently for
    ``cause`` (one shared string per cause: the history holds many keys' records)."""
    return f"promotion failed for now ({cause}): nothing removed, promoted again later"


@dataclass(frozen=True, slots=True)
class TierCounters:
    """What went through one secondary tier for this pool (cumulative), plus its
    jobs in flight: a snapshot (:meth:`Tiering.counters`).

    Lookup outcomes. The tiers are asked, in order, about the pool's primary
    misses, each tier only about what the tiers before it could not serve, and a
    prefix Lookup only up to its first key that no tier holds. Each key asked of
    this tier ends as exactly one of: ``hits`` (promoted from this tier: counted
    once, when the verified block arrived in the primary; polling Lookups that
    answer HIT_PENDING meanwhile ask no tier), ``misses`` (not held, or its
    promotion from this tier failed, now or before its retry time: :mod:`.retries`),
    ``retries`` (the tier could not answer yet), ``promotion_no_room``, or a
    promotion still in flight.
    """

    hits: int
    misses: int
    retries: int
    cascade_jobs_started: int
    cascade_jobs_finished: int
    cascade_jobs_failed: int
    cascade_blocks: int
    cascade_blocks_dropped: int  # refused by a tier's backpressure
    promotion_jobs_started: int
    promotion_jobs_finished: int
    promotion_jobs_failed: int
    promotion_blocks: int  # submitted
    promotion_blocks_loaded: int  # == hits
    promotion_blocks_failed: int  # also counted in misses
    promotion_no_room: int  # held by the tier, no primary row to promote into: MISS
    lookup_waits: int  # Lookups that waited for this (remote) tier's answers
    lookup_wait_timeouts: int  # ... of them, those answered before all its answers were in
    jobs_in_flight: int  # a gauge: this pool's jobs on the tier not yet reported


COUNTERS = tuple(f.name for f in fields(TierCounters) if f.name != "jobs_in_flight")


@dataclass(frozen=True, slots=True)
class _InFlight:
    tier_index: int
    job: TierJob


@dataclass(slots=True)
class _Located:
    """Where the tiers found a Lookup's primary misses (positions in its keys)."""

    holders: dict[int, int] = field(default_factory=dict)  # position -> first tier holding it
    retry: set[int] = field(default_factory=set)  # positions some tier could not answer yet
    # per tier: (position, True if RETRY else MISS) of what it was asked and could not serve
    unserved: list[list[tuple[int, bool]]] = field(default_factory=list)


class Tiering:
    """The secondary tiers of one pool and the jobs between them and its primary."""

    def __init__(
        self,
        pool_name: str,
        manager: PrimaryManager,
        history: RemovalLog | None = None,
        on_event: Callable[[BlockEvent], object] | None = None,
        *,
        hold_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``hold_seconds``: how long a promotion hold lasts (0: no holds)."""
        self.pool_name = pool_name
        self._on_event = on_event
        self.history = history if history is not None else RemovalLog()
        self.tiers: list[SecondaryTier] = []
        self.remote = False  # some tier is remote: Lookups may wait for it (remote_wait)
        self._manager = manager
        self._jobs: dict[int, _InFlight] = {}
        self._job_ids = itertools.count(1)
        self._counters: list[Counter[str]] = []
        self._admission: list[TierAdmission] = []  # per tier, co-indexed with tiers
        self._budgets: list[BudgetGate] = []  # per tier: its write budget, after admission
        self._holds = HoldTable(manager, hold_seconds, clock)
        self._clock = clock
        self._failures = FailedPromotions(clock)  # when failed promotions are retried
        # the loop timer of the earliest hold deadline (None: not armed); each firing
        # releases the expired holds and arms the next one
        self._hold_timer: asyncio.TimerHandle | None = None
        self.closed = False
        # (pool, tier name, is_promotion, seconds) per reported job; set by the daemon
        self.observe_job: Callable[[str, str, bool, float], None] | None = None

    def attach(
        self,
        tier: SecondaryTier,
        admission: TierAdmission | None = None,
        *,
        write_budget: WriteBudget | None = None,
    ) -> None:
        """Appends a tier (consulted after the ones attached before it), writing what
        ``admission`` admits (default: every block, ``always``) within ``write_budget``
        (the configured tier's, shared by its pools; None: no budget)."""
        self.tiers.append(tier)
        bytes_per_block = tier.statistics().bytes_per_block
        if admission is None:
            admission = TierAdmission(AlwaysAdmit(), bytes_per_block)
        self._admission.append(admission)
        self._budgets.append(
            BudgetGate(tier, write_budget, admission, self.history, bytes_per_block)
        )
        self.remote = self.remote or tier.remote
        self._counters.append(Counter(dict.fromkeys(COUNTERS, 0)))

    @property
    def jobs_in_flight(self) -> int:
        return len(self._jobs)

    def counters(self, tier_index: int) -> TierCounters:
        """The counters of one tier for this pool, and its jobs in flight."""
        in_flight = sum(1 for job in self._jobs.values() if job.tier_index == tier_index)
        return TierCounters(**self._counters[tier_index], jobs_in_flight=in_flight)

    def admission(self, tier_index: int) -> TierAdmission:
        """The admission of one tier (its policy and counters)."""
        return self._admission[tier_index]

    def admission_statistics(self, tier_index: int) -> AdmissionStats:
        return self._admission[tier_index].statistics()

    # ----------------------------------------------------------------- cascade

    def cascade(self, keys: Sequence[BlockKey], *, before: int | None = None) -> None:
        """Submits one store job per tier (the first ``before`` tiers only, if given:
        keys promoted from tier ``before``) for the ready ``keys`` its admission
        admits; each job pins its rows until the tier reports."""
        if not keys or self.closed:
            return
        occasion = Occasion.STORED if before is None else Occasion.PROMOTED
        for index in range(len(self.tiers))[:before]:
            if occasion is Occasion.STORED:
                self._admission[index].seen(keys)
            self._submit_cascade(index, self._admit(index, keys, occasion))

    def read(self, keys: Sequence[BlockKey]) -> None:
        """A session loaded ready ``keys`` from the primary: offered to each tier that
        lacks them and whose admission writes at loads (``reused``, ``tinylfu``)."""
        if not keys or self.closed:
            return
        keys = list(dict.fromkeys(keys))  # a key loaded twice in one call is one read
        for index, tier in enumerate(self.tiers):
            admission = self._admission[index]
            if not admission.writes_on_read:
                continue
            admission.seen(keys)
            lacking = [key for key in keys if tier.contains(key) is False]
            if lacking:
                self._submit_cascade(index, self._admit(index, lacking, Occasion.READ))

    def _admit(self, index: int, keys: Sequence[BlockKey], occasion: Occasion) -> list[BlockKey]:
        """The keys tier ``index`` admits; records why the others were not."""
        admitted, rejected = self._admission[index].offer(keys, occasion)
        for rejection, those in rejected.items():
            self.history.record(those, self.tiers[index].name, rejection.record)
        return admitted

    def _submit_cascade(self, index: int, keys: Sequence[BlockKey]) -> None:
        """One store job of ready ``keys`` to tier ``index``, pinning their rows: those
        its write budget lets through (:mod:`.budget`: the rest dropped, counted)."""
        keys = self._budgets[index].admit(keys)
        if keys:
            tier = self.tiers[index]
            block_ids = self._manager.prepare_load(keys)  # pool-owned pins, +1 per key
            job = TierJob(next(self._job_ids), tuple(keys), tuple(block_ids), is_promotion=False)
            counters = self._counters[index]
            if tier.submit_store(job):
                self._jobs[job.job_id] = _InFlight(index, job)
                counters["cascade_jobs_started"] += 1
                counters["cascade_blocks"] += len(keys)
            else:
                self._manager.complete_load(keys)  # refused: the pins go at once
                counters["cascade_blocks_dropped"] += len(keys)
                self.history.record(keys, tier.name, "cascade write dropped: queue over its limit")

    # ----------------------------------------------------------------- promotion

    def lookup(
        self, keys: Sequence[BlockKey], results: list[LookupResult], *, prefix: bool = False
    ) -> list[LookupResult]:
        """Completes a primary lookup with the secondary tiers: a primary MISS that a
        tier holds becomes HIT_PENDING (promotion started), or RETRY when a tier
        cannot answer yet and no tier holds it; ``results`` is updated in place.

        ``prefix``: only keys before the first one that no tier can serve are
        promoted (a prefix cache loads nothing after its first miss)."""
        if not self.tiers or self.closed:
            return results
        self.expire_holds()
        if _MISS in results:
            self._promote_misses(keys, results, prefix)
        if prefix:
            self._hold_waited_for(keys, results)
        return results

    def _promote_misses(
        self, keys: Sequence[BlockKey], results: list[LookupResult], prefix: bool
    ) -> None:
        """Starts the promotions of :meth:`lookup`; updates ``results`` in place."""
        waiting = [i for i, result in enumerate(results) if result is _MISS]
        if prefix and self.remote:  # a remote tier asks about what it is asked: not
            now = self._clock()  # past a key every tier knows it lacks
            end = known_miss(
                self.tiers, keys, waiting, lambda t, k: self._failures.waiting(t, k, now)
            )
            if end is not None:
                waiting = [i for i in waiting if i <= end]
        located = self._locate(keys, waiting)
        holders = located.holders
        last_asked = len(keys)  # positions after it were not asked (prefix: past its end)
        if prefix:  # the chain ends at its first key neither the primary nor a tier has
            servable = [_HIT_PENDING if i in holders else r for i, r in enumerate(results)]
            last_asked = prefix_end(servable)
            holders = {i: tier for i, tier in holders.items() if i < last_asked}
        self._count_unserved(located, last_asked)
        protected = set(keys)
        for index in range(len(self.tiers)):
            hits = [i for i, tier in holders.items() if tier == index]
            if not hits:
                continue
            self._promote(index, [keys[i] for i in hits], protected)
            for i in hits:  # promoted -> HIT_PENDING; no room -> stays MISS
                results[i] = self._manager.lookup((keys[i],))[0]
        for i in located.retry:
            if results[i] is _MISS:
                results[i] = _RETRY

    def remote_wait(
        self, keys: Sequence[BlockKey], results: Sequence[LookupResult], *, prefix: bool = False
    ) -> RemoteWait | None:
        """Asks the remote tiers about the keys of a Lookup they may hold and no tier
        is known to (``results``: the primary's answers; module doc of
        :mod:`kvtierd.tiering.remote`); what to wait for before answering it, or None
        when nothing was asked. Changes no primary state and counts no lookup."""
        if not self.remote or self.closed:
            return None
        now = self._clock()
        asks = plan_asks(
            self.tiers, keys, results, prefix, lambda i, key: self._failures.waiting(i, key, now)
        )
        if not asks:
            return None
        wait = RemoteWait()
        for index, asked in asks.items():
            wait.add(index, self.tiers[index].ask(asked))
        return wait if wait.futures else None

    def waited(self, wait: RemoteWait) -> None:
        """Counts a Lookup's wait (now over) for each tier it asked, and the tiers
        whose answers were not all in when it was answered."""
        late = wait.late_tiers()
        for index in set(wait.tiers):
            counters = self._counters[index]
            counters["lookup_waits"] += 1
            if index in late:
                counters["lookup_wait_timeouts"] += 1

    def _hold_waited_for(self, keys: Sequence[BlockKey], results: list[LookupResult]) -> None:
        """A prefix lookup that answers HIT_PENDING waits for that key and will load
        the run in front of it together: holds (or renews) the HITs of that run."""
        waited_for: list[BlockKey] = []  # HITs in front of the last HIT_PENDING
        since_pending: list[BlockKey] = []
        end = prefix_end(results)  # nothing after the chain's end is loaded
        for key, result in zip(keys[:end], results[:end], strict=True):
            if result is _HIT:
                since_pending.append(key)
            else:  # HIT_PENDING
                waited_for += since_pending
                since_pending.clear()
        if waited_for:
            self._holds.hold(waited_for)
            self._arm_hold_timer()

    def _locate(self, keys: Sequence[BlockKey], waiting: list[int]) -> _Located:
        """For primary misses: the first tier holding each (skipping a tier whose
        promotion of it failed recently), and per tier what it could not serve.
        One lookup per tier, in tier order."""
        located = _Located(unserved=[[] for _ in self.tiers])
        now = self._clock()
        for index, tier in enumerate(self.tiers):
            answers = tier.lookup([keys[i] for i in waiting])
            still: list[int] = []
            for i, answer in zip(waiting, answers, strict=True):
                if answer is _HIT and not self._failures.waiting(index, keys[i], now):
                    located.holders[i] = index
                    continue
                if answer is _RETRY:
                    located.retry.add(i)
                located.unserved[index].append((i, answer is _RETRY))
                still.append(i)
            waiting = still
            if not waiting:
                break
        return located

    def _count_unserved(self, located: _Located, last_asked: int) -> None:
        """Counts each tier's misses and retries among positions up to ``last_asked``
        (a prefix Lookup asks nothing past its end; see :class:`TierCounters`)."""
        for counters, unserved in zip(self._counters, located.unserved, strict=True):
            for i, retry in unserved:
                if i <= last_asked:
                    counters["retries" if retry else "misses"] += 1

    def _promote(self, index: int, keys: list[BlockKey], protected: set[BlockKey]) -> None:
        grant = self._manager.prepare_promotion(keys, protected)
        if grant.evicted_keys:
            self.history.record(grant.evicted_keys, PRIMARY_TIER, EVICTED_FOR_ROOM)
        counters = self._counters[index]
        counters["promotion_no_room"] += len(keys) - len(grant.keys_to_store)
        if not grant.keys_to_store:
            return
        job = TierJob(
            next(self._job_ids),
            tuple(grant.keys_to_store),
            tuple(grant.block_ids),
            is_promotion=True,
        )
        self._jobs[job.job_id] = _InFlight(index, job)
        counters["promotion_jobs_started"] += 1
        counters["promotion_blocks"] += len(job.keys)
        self.tiers[index].submit_load(job)

    def _promotion_failed(
        self, index: int, failed: list[BlockKey], result: JobResult, of: int
    ) -> None:
        """Records a promotion's failed keys (of ``of``) as ``result`` sorts them: those
        the tier found gone are a plain MISS (promoted again once it holds them again);
        those that failed transiently are promoted again after a short window; the
        others not for ``PROMOTION_RETRY_AFTER`` seconds (:mod:`.retries`)."""
        tier = self.tiers[index].name
        missing, transient = set(result.missing_keys), set(result.transient_keys)
        gone = [key for key in failed if key in missing]
        for_now = [key for key in failed if key in transient and key not in missing]
        bad = [key for key in failed if key not in missing and key not in transient]
        if gone:  # a cache evicts: nothing to report but the count
            self.history.record(gone, tier, "promotion found it gone (evicted or removed)")
            log.debug(
                "pool %s: %d of %d blocks were gone from tier %s at their promotion; MISS",
                self.pool_name, len(gone), of, tier,
            )  # fmt: skip
        if for_now:  # the I/O could not be done (its cause was logged where it happened)
            cause = result.transient_cause or "the tier's I/O could not be done now"
            window = self._failures.failed_for_now(index, for_now, cause)
            self.history.record(for_now, tier, transient_record(cause))
            log.info(
                "pool %s: promotion of %d of %d blocks from tier %s failed for now (%s); "
                "they answer MISS and are promoted again after %gs",
                self.pool_name, len(for_now), of, tier, cause, window,
            )  # fmt: skip
        if bad:
            self._failures.failed(index, bad)
            self.history.record(bad, tier, "promotion failed (unreadable or corrupt)")
            log.info(
                "pool %s: promotion of %d of %d blocks from tier %s failed; they answer MISS",
                self.pool_name, len(bad), of, tier,
            )  # fmt: skip

    def promotion_wait(
        self, tier_index: int, key: BlockKey
    ) -> tuple[FailedPromotion, float] | None:
        """Why ``key`` is not promoted from tier ``tier_index`` now, and for how many
        seconds more; None when the next Lookup may promote it from there (Explain)."""
        return self._failures.pending(tier_index, key)

    # ----------------------------------------------------------------- completions

    def on_done(self, result: JobResult) -> None:
        """A tier reports a job (on the loop, once per job)."""
        in_flight = self._jobs.pop(result.job_id, None)
        if in_flight is None:
            log.error("pool %s: a tier reported unknown job %d", self.pool_name, result.job_id)
            return
        if self.closed:
            return  # the pool is gone; its tables no longer matter
        if self.observe_job is not None:
            tier_name = self.tiers[in_flight.tier_index].name
            self.observe_job(self.pool_name, tier_name, in_flight.job.is_promotion, result.seconds)
        self._emit_removed(self.tiers[in_flight.tier_index])
        if in_flight.job.is_promotion:
            self._promotion_done(in_flight, result)
        else:
            self._cascade_done(in_flight, result)

    def _emit_removed(self, tier: SecondaryTier) -> None:
        dropped = tier.take_removed()
        if dropped and self._on_event is not None:
            self._on_event(BlockEvent(tuple(dropped), tier.medium, removed=True, tier=tier.name))

    def _cascade_done(self, in_flight: _InFlight, result: JobResult) -> None:
        job = in_flight.job
        self._manager.complete_load(job.keys)  # the job's pins, success or not
        counters = self._counters[in_flight.tier_index]
        counters["cascade_jobs_finished" if result.success else "cascade_jobs_failed"] += 1
        stored = job.keys if result.success else (result.successful_keys or ())
        self._failures.forget(in_flight.tier_index, stored)  # a fresh copy: may retry
        if stored and self._on_event is not None:
            tier = self.tiers[in_flight.tier_index]
            self._on_event(BlockEvent(tuple(stored), tier.medium, removed=False, tier=tier.name))

    def _promotion_done(self, in_flight: _InFlight, result: JobResult) -> None:
        job = in_flight.job
        index = in_flight.tier_index
        if result.success:
            loaded: Sequence[BlockKey] = job.keys
        else:
            loaded = result.successful_keys or ()
        loaded_set = set(loaded)
        failed = [key for key in job.keys if key not in loaded_set]
        done = self._manager.complete_store(loaded, success=True) if loaded else []
        self._failures.forget(index, loaded)  # promoted: earlier failures no longer count
        if failed:
            self._manager.complete_store(failed, success=False)  # rows freed: MISS
            self._promotion_failed(index, failed, result, len(job.keys))
        if done:
            self._holds.hold(done)  # until the engine that asked pins them
            self._arm_hold_timer()
        counters = self._counters[index]
        counters["promotion_jobs_finished" if result.success else "promotion_jobs_failed"] += 1
        counters["promotion_blocks_loaded"] += len(done)
        counters["promotion_blocks_failed"] += len(failed)
        counters["hits"] += len(done)  # promoted from this tier: its hit, once
        counters["misses"] += len(failed)  # this tier could not serve them after all
        if done and index > 0:
            self.cascade(done, before=index)

    # ----------------------------------------------------------------- holds

    def claim_holds(self, keys: Sequence[BlockKey]) -> None:
        """A session has just pinned ``keys`` to load them: their holds end (the
        session's pins keep the rows)."""
        self._holds.claim(keys)

    def expire_holds(self) -> None:
        """Releases the holds whose deadline has passed (their blocks become
        evictable). Called by the hold timer and before anything needs rows."""
        expired = self._holds.expire()
        if expired:
            log.debug("pool %s: %d promotion holds expired unclaimed", self.pool_name, expired)

    def hold_statistics(self) -> HoldStats:
        return self._holds.statistics()

    def _arm_hold_timer(self) -> None:
        """Arms the loop timer for the earliest hold deadline, unless armed. Without a
        running loop (unit tests drive the tiering by hand) holds expire at the next
        :meth:`lookup` or :meth:`expire_holds`."""
        deadline = self._holds.next_deadline()
        if self._hold_timer is not None or deadline is None or self.closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delay = max(0.0, deadline - self._clock())
        self._hold_timer = loop.call_later(delay, self._on_hold_timer)

    def _on_hold_timer(self) -> None:
        self._hold_timer = None
        if self.closed:
            return
        self.expire_holds()
        self._arm_hold_timer()  # the next deadline (renewed holds moved it later)

    def check_invariants(
        self,
        session_pins: Counter[BlockKey],
        session_reserved: Sequence[BlockKey] | None = None,
    ) -> None:
        """Verifies that the primary's ref counts are exactly the pins their owners
        hold: ``session_pins`` (given by the caller) + cascade jobs + holds, and that
        every pending promotion row belongs to one in-flight job (tests, debugging).

        ``session_reserved`` (the pool's sessions' reservations, given by the caller):
        also verifies that no key is reserved twice (by two sessions, or by a
        session and a promotion), that each is pending, and that every pending row
        is one of them or a promotion's."""
        self._holds.check_invariants()
        owned = Counter(session_pins)
        promoting: list[BlockKey] = []
        for in_flight in self._jobs.values():
            if in_flight.job.is_promotion:
                promoting.extend(in_flight.job.keys)
            else:
                owned.update(in_flight.job.keys)
        owned.update(self._holds.keys())
        for key, count in owned.items():
            ref = self._manager.ref_count(key)
            assert ref == count, f"key {key!r}: ref {ref}, owners hold {count} pins"
        assert self._manager.statistics().pinned_blocks == len(+owned), "a pin without owner"
        assert len(set(promoting)) == len(promoting), "a row in two promotion jobs"
        for key in promoting:
            assert self._manager.ref_count(key) == -1, f"promoting {key!r} is not pending"
        if session_reserved is None:
            return
        reserved = [*session_reserved, *promoting]
        assert len(set(reserved)) == len(reserved), "a key reserved by two owners"
        for key in session_reserved:
            assert self._manager.ref_count(key) == -1, f"reserved {key!r} is not pending"
        pending = self._manager.statistics().pending_blocks
        assert pending == len(reserved), f"{pending} pending rows, {len(reserved)} reserved"

    # ----------------------------------------------------------------- lifecycle

    def touch(self, keys: Sequence[BlockKey]) -> None:
        for tier in self.tiers:
            tier.touch(keys)

    async def drain(self) -> None:
        """Returns once every tier reported every job submitted so far."""
        for tier in self.tiers:
            await tier.drain()

    def close(self) -> None:
        """Stops the tiers' own threads (scans) and releases every hold; completions
        after this are ignored."""
        self.closed = True
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        self._holds.release_all()
        for tier in self.tiers:
            try:
                tier.shutdown()
            except Exception:
                log.exception("pool %s: shutting tier %s down failed", self.pool_name, tier.name)
