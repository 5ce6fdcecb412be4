"""Tiering orchestration against a scripted tier: the faults a real disk will not
produce on demand (a transient read error, partial success, a refused write).

The scripted tier is the in-memory reference tier (which runs the tier contract
suite in ``tests/tiers``) with its jobs held until the test finishes them, so the
results the orchestration sees come from a tier that keeps the contract."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest
from fake_clock import FakeClock

from kvtierd.contract import BlockEvent, BlockKey, LookupResult
from kvtierd.primary.manager import PrimaryManager
from kvtierd.tiering.admission import BUDGET, NOT_REUSED, TierAdmission, make_policy
from kvtierd.tiering.manager import Tiering, transient_record
from kvtierd.tiering.retries import PROMOTION_RETRY_AFTER, TRANSIENT_RETRY_AFTER
from kvtierd.tiers.base import JobCallback, JobResult, TierJob
from kvtierd.tiers.budget import WriteBudget
from kvtierd.tiers.memory import MemoryTier, StoreOutcome

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
ROWS = 4  # rows of the primary (the manager fixture) and of the rows its tiers copy
BLOCK = 16


class ScriptedTier(MemoryTier):
    """A memory tier whose jobs wait until the test runs them with :meth:`finish`.

    ``held``: keys the tier holds from the start. ``ready=False``: launched (jobs
    are accepted) but never ready, as an fs tier whose index is still being
    rebuilt. ``accept_writes=False``: every store is refused (backpressure).
    No event loop runs in these tests: :meth:`finish` stands in for it.
    """

    def __init__(
        self,
        name: str,
        rows: memoryview,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        held: Sequence[BlockKey] = (),
        *,
        ready: bool = True,
        accept_writes: bool = True,
    ) -> None:
        super().__init__(
            name, BLOCK, rows, 1 << 20, on_done, loop, max_queue_jobs=1024 if accept_writes else 0
        )
        self.stores: list[TierJob] = []
        self.loads: list[TierJob] = []
        self._failing: frozenset[BlockKey] = frozenset()
        self._transient: frozenset[BlockKey] = frozenset()
        self.pause()
        self.launch()
        if ready:
            self._become_ready()
        for key in held:
            assert self._store_block(key, 0) is StoreOutcome.WRITTEN

    def submit_store(self, job: TierJob) -> bool:
        accepted = super().submit_store(job)
        if accepted:
            self.stores.append(job)
        return accepted

    def submit_load(self, job: TierJob) -> None:
        super().submit_load(job)
        self.loads.append(job)

    def finish(
        self,
        job: TierJob,
        *,
        failing: Sequence[BlockKey] = (),
        transient: Sequence[BlockKey] = (),
    ) -> None:
        """Runs ``job`` now and reports it; the ``failing`` keys fail as an unreadable
        block does (a fault: the tier keeps them), the ``transient`` ones as when the
        I/O could not be done now (an I/O worker timed out: reported as transient,
        with :data:`CAUSE`; the tier keeps them too)."""
        self._failing = frozenset(failing) | frozenset(transient)
        self._transient = frozenset(transient)
        try:
            self._run_now(job.job_id)
        finally:
            self._failing = self._transient = frozenset()

    def _report(self, job: TierJob, result: JobResult) -> None:
        transient = tuple(key for key in job.keys if key in self._transient)
        if transient:
            result = dataclasses.replace(result, transient_keys=transient, transient_cause=CAUSE)
        super()._report(job, result)

    def asked(self) -> int:
        """Keys the tier answered HIT or MISS so far (each time it was consulted)."""
        stats = self.statistics()
        return stats.hits + stats.misses

    def _store_block(self, key: BlockKey, block_id: int) -> StoreOutcome:
        if key in self._failing:
            return StoreOutcome.FAILED
        return super()._store_block(key, block_id)

    def _load_block(self, key: BlockKey, block_id: int) -> bool:
        return key not in self._failing and super()._load_block(key, block_id)


Attach = Callable[..., ScriptedTier]
CAUSE = "the I/O worker did not answer within io_worker_timeout and was killed"


@pytest.fixture
def attach() -> Iterator[Attach]:
    """``attach(tiering, name, held=(), admission=..., write_budget=None, ready=...,
    accept_writes=...)``: a scripted tier reporting to ``tiering``, attached after the
    ones before it. The tiers of one test copy to and from the same rows, as a pool's
    tiers share its region."""
    rows = memoryview(bytearray(ROWS * BLOCK))
    loop = asyncio.new_event_loop()  # never runs: finish() reports instead

    def attach(
        tiering: Tiering,
        name: str,
        held: Sequence[BlockKey] = (),
        *,
        admission: str = "always",
        write_budget: WriteBudget | None = None,
        **kw: bool,
    ) -> ScriptedTier:
        tier = ScriptedTier(name, rows, tiering.on_done, loop, held, **kw)
        capacity_blocks = tier.capacity_bytes // BLOCK
        policy = make_policy(admission, tier.victim, capacity_blocks)
        tiering.attach(tier, TierAdmission(policy, BLOCK), write_budget=write_budget)
        return tier

    yield attach
    loop.close()


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


@pytest.fixture
def manager() -> PrimaryManager:
    return PrimaryManager(ROWS, "lru")


def stored(manager: PrimaryManager, tiering: Tiering, names: list[bytes]) -> None:
    manager.prepare_store(names)
    done = manager.complete_store(names, success=True)
    tiering.cascade(done)


def test_cascade_pins_until_the_tier_reports(manager, attach):
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t")
    stored(manager, tiering, keys("a", "b"))
    assert manager.ref_count(b"a") == 1 and tiering.jobs_in_flight == 1
    assert manager.prepare_store(keys("c", "d", "e")) is None  # a, b cannot be evicted
    (job,) = tier.stores
    tier.finish(job, failing=job.keys)  # failure releases the pins too
    assert manager.ref_count(b"a") == 0 and tiering.jobs_in_flight == 0
    assert tiering.counters(0).cascade_jobs_failed == 1


def test_refused_cascade_is_counted_and_pins_nothing(manager, attach):
    tiering = Tiering("p", manager)
    attach(tiering, "t", accept_writes=False)
    stored(manager, tiering, keys("a", "b"))
    assert manager.ref_count(b"a") == 0
    assert tiering.counters(0).cascade_blocks_dropped == 2


def test_a_cascade_past_the_write_budget_drops_the_rest_at_once(manager, clock, attach):
    """A budget of two blocks a second: of a cascade of three, the first two are
    written; the third is neither queued nor pinned, it is counted (reason budget)
    and Explain's history says why. The first tier's budget leaves the second alone."""
    tiering = Tiering("p", manager)
    first = attach(tiering, "t", write_budget=WriteBudget(2 * BLOCK, clock=clock))
    second = attach(tiering, "u")
    stored(manager, tiering, keys("a", "b", "c"))
    (job,) = first.stores
    assert job.keys == tuple(keys("a", "b"))
    assert [manager.ref_count(k) for k in keys("a", "b", "c")] == [2, 2, 1]  # c: u's pin only
    assert second.stores[0].keys == tuple(keys("a", "b", "c"))
    assert rejected(tiering, 0) == (2, {"not_reused": 0, "infrequent": 0, "budget": 1})
    assert rejected(tiering, 1) == (3, {"not_reused": 0, "infrequent": 0, "budget": 0})
    assert [(r.tier, r.what) for r in tiering.history.get(b"c")] == [("t", BUDGET.record)]
    assert tiering.counters(0).cascade_blocks == 2
    tiering.check_invariants(Counter())


def test_the_write_budget_refills_on_the_clock(manager, clock, attach):
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t", write_budget=WriteBudget(2 * BLOCK, clock=clock))
    stored(manager, tiering, keys("a", "b"))
    stored(manager, tiering, keys("c"))  # the budget is spent: nothing submitted
    assert len(tier.stores) == 1
    clock.advance(0.5)  # one block's worth
    stored(manager, tiering, keys("d"))
    assert [job.keys for job in tier.stores] == [tuple(keys("a", "b")), tuple(keys("d"))]
    assert rejected(tiering, 0)[1]["budget"] == 1


def test_a_block_the_tier_holds_costs_no_budget(manager, clock, attach):
    """Storing a block the tier holds rewrites nothing: it goes through whatever is
    left, and after the budget refused one block, the held ones still go."""
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t", held=keys("h1", "h2"), write_budget=WriteBudget(BLOCK, clock=clock))
    stored(manager, tiering, keys("h1", "a", "b", "h2"))
    assert tier.stores[0].keys == tuple(keys("h1", "a", "h2"))
    assert rejected(tiering, 0)[1]["budget"] == 1


def test_without_a_budget_every_block_is_written_and_none_counted(manager, attach):
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t")
    stored(manager, tiering, keys("a", "b", "c", "d"))
    assert tier.stores[0].keys == tuple(keys("a", "b", "c", "d"))
    assert rejected(tiering, 0)[1]["budget"] == 0


def test_only_what_the_admission_policy_admits_spends_the_budget(manager, clock, attach):
    """``reused`` rejects the stores (not read again yet): the budget of one block is
    untouched, so the first block read again is written; the second finds it spent."""
    tiering = Tiering("p", manager)
    budget = WriteBudget(BLOCK, clock=clock)
    tier = attach(tiering, "t", write_budget=budget, admission="reused")
    stored(manager, tiering, keys("a", "b"))
    assert tier.stores == [] and budget.statistics().passed_bytes == 0
    tiering.read(keys("a", "b"))
    assert [job.keys for job in tier.stores] == [tuple(keys("a"))]
    assert rejected(tiering, 0) == (1, {"not_reused": 2, "infrequent": 0, "budget": 1})


def rejected(tiering: Tiering, index: int) -> tuple[int, dict[str, int]]:
    """Tier ``index``'s admitted blocks and its rejected ones by reason."""
    stats = tiering.admission_statistics(index)
    return stats.admitted_blocks, stats.rejected_blocks


def test_partial_promotion_keeps_what_arrived_and_does_not_retry_the_rest(manager, attach):
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t", keys("x", "y", "z"))
    ks = keys("x", "y", "z")
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING] * 3
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING] * 3  # no second promotion
    (job,) = tier.loads
    tier.finish(job, failing=keys("y", "z"))
    assert manager.lookup(ks) == [HIT, MISS, MISS]
    # the tier still holds y and z (an unreadable block stays there): no retry loop
    assert tier.contains(b"y") and tier.contains(b"z")
    assert tiering.lookup(ks, manager.lookup(ks)) == [HIT, MISS, MISS]
    assert len(tier.loads) == 1
    counters = tiering.counters(0)
    assert counters.promotion_blocks_loaded == 1 and counters.promotion_blocks_failed == 2


def test_retry_while_a_tier_is_not_ready_unless_a_later_tier_holds_the_key(manager, attach):
    tiering = Tiering("p", manager)
    scanning = attach(tiering, "near", ready=False)
    far = attach(tiering, "far", keys("b"))
    ks = keys("a", "b")
    assert tiering.lookup(ks, manager.lookup(ks)) == [RETRY, PENDING]
    (job,) = far.loads
    far.finish(job)
    assert manager.lookup(ks) == [MISS, HIT]
    (cascade,) = scanning.stores  # promoted from the far tier: copied to the near one
    assert cascade.keys == (b"b",) and not far.stores


def test_promotion_never_evicts_a_key_of_the_same_lookup(manager, attach):
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t", keys("x", "y"))
    stored(manager, tiering, keys("a", "b", "c"))
    tier.finish(tier.stores[0])
    ks = keys("a", "b", "c", "x", "y")  # one free row; a, b, c are protected
    assert tiering.lookup(ks, manager.lookup(ks)) == [HIT, HIT, HIT, PENDING, MISS]
    assert tiering.counters(0).promotion_no_room == 1


def test_prefix_lookup_promotes_nothing_after_the_first_unservable_key(manager, attach):
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t", keys("a", "c"))
    ks = keys("a", "b", "c")  # b is nowhere: c would never be loaded by a prefix cache
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, MISS, MISS]
    (job,) = tier.loads
    assert job.keys == (b"a",)
    assert tiering.lookup(keys("c"), manager.lookup(keys("c"))) == [PENDING]  # not prefix


def outcomes(tiering: Tiering, index: int) -> tuple[int, int, int, int]:
    """(hits, misses, retries, promotion_no_room) of tier ``index``."""
    c = tiering.counters(index)
    return c.hits, c.misses, c.retries, c.promotion_no_room


def test_each_key_asked_of_a_tier_is_counted_once_as_what_it_got(manager, attach):
    """Scenario: issue #16. Tier counters are what the pool got from the tier: a
    promoted block is one hit when it arrives (not once per polling Lookup), a
    failed promotion a miss, a rebuilding tier a retry, a hit without a primary row
    no_room, and keys past a prefix Lookup's end are not counted."""
    tiering = Tiering("p", manager)
    attach(tiering, "near", ready=False)
    far = attach(tiering, "far", keys("x", "y", "z", "w"))
    ks = keys("x", "y", "q")
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING, PENDING, RETRY]
    assert outcomes(tiering, 0) == (0, 0, 3, 0) and outcomes(tiering, 1) == (0, 1, 0, 0)
    for _ in range(3):  # polling while the promotion is in flight asks no tier
        assert tiering.lookup(ks[:2], manager.lookup(ks[:2])) == [PENDING] * 2
    (job,) = far.loads
    far.finish(job, failing=keys("y"))
    assert outcomes(tiering, 1) == (1, 2, 0, 0)  # x arrived: a hit; y failed: a miss
    assert tiering.lookup(keys("y"), manager.lookup(keys("y"))) == [RETRY]
    assert outcomes(tiering, 1) == (1, 3, 0, 0)  # failed recently: far cannot serve it
    prefix = keys("q", "z")  # q is nowhere: z, past the prefix's end, is not counted
    assert tiering.lookup(prefix, manager.lookup(prefix), prefix=True) == [RETRY] * 2
    assert not far.loads[1:]  # z was not promoted (the pool answers MISS past the end)
    assert outcomes(tiering, 0) == (0, 0, 5, 0) and outcomes(tiering, 1) == (1, 4, 0, 0)
    stored(manager, tiering, keys("a", "b", "c"))  # x (cascading to near) + a, b, c pinned
    assert tiering.lookup(keys("w"), manager.lookup(keys("w"))) == [RETRY]  # no room
    assert outcomes(tiering, 0) == (0, 0, 6, 0) and outcomes(tiering, 1) == (1, 4, 0, 1)
    assert tiering.counters(1).promotion_blocks_loaded == 1


# ----------------------------------------------------------------- promotion holds
# A hold is a pool-owned pin on a block promoted for a Lookup (or waited with
# one), kept until a session pins the key or the hold's deadline passes.

HOLD = 2.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


def holding(manager: PrimaryManager, clock: FakeClock) -> Tiering:
    return Tiering("p", manager, hold_seconds=HOLD, clock=clock)


def promote(
    manager: PrimaryManager,
    tiering: Tiering,
    tier: ScriptedTier,
    names: list[bytes],
    **lookup: bool,
) -> None:
    """Looks ``names`` up (promotion starts) and lets the tier deliver them all."""
    before = len(tier.loads)
    tiering.lookup(names, manager.lookup(names), **lookup)
    for job in tier.loads[before:]:
        tier.finish(job)


def pin(manager: PrimaryManager, tiering: Tiering, names: list[bytes], pins: Counter) -> None:
    """What Pool.prepare_load does for a session: pin, then claim the holds."""
    manager.prepare_load(names)
    pins.update(names)
    tiering.claim_holds(names)


def test_a_promoted_block_is_held_until_a_session_pins_it(manager, clock, attach):
    """Scenario: the storm of issue #15. Two requests wait for blocks of the fs tier
    in a 4-row primary; the second one's promotion must not evict what the first
    one's just brought in, and a store cannot either."""
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("a", "b", "c", "x", "y", "z"))
    first, second = keys("a", "b", "c"), keys("x", "y", "z")
    promote(manager, tiering, tier, first, prefix=True)
    assert manager.lookup(first) == [HIT] * 3 and manager.ref_count(b"a") == 1
    tiering.check_invariants(Counter())
    # one free row: x is promoted into it, y and z find no room and answer MISS
    assert tiering.lookup(second, manager.lookup(second), prefix=True) == [PENDING, MISS, MISS]
    assert manager.prepare_store(keys("s")) is None  # held rows are not evicted for a store
    assert tiering.counters(0).promotion_no_room == 2
    pins: Counter[bytes] = Counter()
    pin(manager, tiering, first, pins)  # the first request comes back and loads
    assert tiering.hold_statistics().claimed == 3
    tiering.check_invariants(pins)
    assert [manager.ref_count(k) for k in first] == [1, 1, 1]  # the session's pins only
    manager.complete_load(first)
    tiering.check_invariants(Counter())
    assert manager.prepare_store(keys("s")) is not None  # loaded: evictable again


def test_a_hold_nobody_claims_expires_at_its_deadline(manager, clock, attach):
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("a", "b"))
    promote(manager, tiering, tier, keys("a", "b"))
    clock.now += HOLD - 0.001
    tiering.expire_holds()
    assert manager.ref_count(b"a") == 1
    clock.now += 0.001
    assert tiering.lookup(keys("a"), manager.lookup(keys("a"))) == [HIT]  # releases first
    assert manager.ref_count(b"a") == 0 and manager.ref_count(b"b") == 0
    stats = tiering.hold_statistics()
    assert (stats.held, stats.placed, stats.expired, stats.claimed) == (0, 2, 2, 0)
    tiering.check_invariants(Counter())


def test_closing_releases_every_hold(manager, clock, attach):
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("a", "b"))
    promote(manager, tiering, tier, keys("a", "b"))
    tiering.close()
    assert manager.ref_count(b"a") == 0 and manager.statistics().pinned_blocks == 0
    assert tiering.hold_statistics().held == 0


def test_a_failed_promotion_holds_only_what_arrived(manager, clock, attach):
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("x", "y"))
    ks = keys("x", "y")
    tiering.lookup(ks, manager.lookup(ks))
    (job,) = tier.loads
    tier.finish(job, failing=keys("y"))
    assert manager.ref_count(b"x") == 1 and manager.ref_count(b"y") is None
    assert tiering.hold_statistics().held == 1
    tiering.check_invariants(Counter())


def test_a_waiting_prefix_lookup_holds_the_hits_in_front_of_its_pending_key(manager, clock, attach):
    """The ready blocks of a request that waits for a promotion are not evicted
    while it waits (it will load them with the promoted one); the hold is renewed
    by each lookup that still waits, and ends with a pin that loads."""
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("c"))
    stored(manager, tiering, keys("a", "b"))  # ready in the primary (no cascade pin: done)
    tier.finish(tier.stores[0])
    ks = keys("a", "b", "c")
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [HIT, HIT, PENDING]
    assert manager.ref_count(b"a") == 1 and manager.ref_count(b"b") == 1
    tiering.check_invariants(Counter())
    clock.now += HOLD / 2
    tiering.lookup(ks, manager.lookup(ks), prefix=True)  # still waiting: renewed
    clock.now += HOLD / 2 + 0.001
    tiering.expire_holds()
    assert manager.ref_count(b"a") == 1, "a renewed hold expired at its first deadline"
    assert tiering.hold_statistics().placed == 2  # renewals place nothing new
    (job,) = tier.loads
    tier.finish(job)
    pins: Counter[bytes] = Counter()
    pin(manager, tiering, ks, pins)
    tiering.check_invariants(pins)
    assert tiering.hold_statistics().held == 0


def test_a_lookup_that_waits_for_nothing_holds_nothing(manager, clock, attach):
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("c"))
    stored(manager, tiering, keys("a"))
    tier.finish(tier.stores[0])
    ks = keys("a", "b", "c")  # b is nowhere: c is never loaded by a prefix cache
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [HIT, MISS, MISS]
    assert tiering.lookup(ks, manager.lookup(ks)) == [HIT, MISS, PENDING]  # not prefix
    assert manager.ref_count(b"a") == 0 and tiering.hold_statistics().held == 0


def test_holds_off_with_zero_seconds(manager, attach):
    tiering = Tiering("p", manager, hold_seconds=0)
    tier = attach(tiering, "t", keys("a"))
    promote(manager, tiering, tier, keys("a"))
    assert manager.ref_count(b"a") == 0


def test_repeated_lookups_of_a_pending_key_cost_no_tier_work(manager, clock, attach):
    tiering = holding(manager, clock)
    tier = attach(tiering, "t", keys("a", "b"))
    ks = keys("a", "b")
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, PENDING]
    consulted = tier.asked()
    assert consulted == 2
    for _ in range(5):
        assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, PENDING]
    assert tier.asked() == consulted and len(tier.loads) == 1
    assert tiering.counters(0).promotion_jobs_started == 1


def test_the_hold_timer_releases_expired_holds_on_a_running_loop(manager, attach):
    """In the daemon nothing else may call into the pool after a promotion: the
    loop timer alone must release the hold at its deadline."""
    hold_s = 0.05
    tiering = Tiering("p", manager, hold_seconds=hold_s)
    tier = attach(tiering, "t", keys("a"))

    async def scenario() -> list[int | None]:
        loop = asyncio.get_running_loop()
        promote(manager, tiering, tier, keys("a"))  # places the hold, arms its timer
        assert manager.ref_count(b"a") == 1
        # loop timers run in deadline order: one halfway to the hold's deadline, one
        # armed after the hold's timer with a longer delay, so it runs after it
        halfway: list[int | None] = []
        loop.call_later(hold_s / 2, lambda: halfway.append(manager.ref_count(b"a")))
        past_deadline = asyncio.Event()
        loop.call_later(hold_s * 1.5, past_deadline.set)
        await asyncio.wait_for(past_deadline.wait(), 5.0)
        return halfway

    assert asyncio.run(scenario()) == [1], "the hold was released before its deadline"
    assert manager.ref_count(b"a") == 0, "the hold timer did not release the hold"
    assert tiering.hold_statistics().expired == 1


# ----------------------------------------------------------------- failed promotions
# A key whose promotion failed answers MISS and is not promoted from that tier again
# until its retry time: 30 s when it was unreadable or corrupt, a short doubling window
# when the I/O could not be done now (kvtierd.tiers.failures, kvtierd.tiering.retries).


def failing_once(
    manager: PrimaryManager, tiering: Tiering, tier: ScriptedTier, names: list[bytes], **how: list
) -> None:
    """Looks ``names`` up (a promotion starts) and lets the tier fail it as ``how`` says."""
    assert tiering.lookup(names, manager.lookup(names)) == [PENDING] * len(names)
    tier.finish(tier.loads[-1], **how)
    assert manager.lookup(names) == [MISS] * len(names)


def test_a_transient_failure_is_promoted_again_after_a_short_window(manager, clock, attach):
    """Scenario: issue #40, item 5. An I/O worker timed out under a promotion: the key
    answers MISS for TRANSIENT_RETRY_AFTER (not PROMOTION_RETRY_AFTER), the tier keeps
    it, its history says why, and then a Lookup promotes it again."""
    tiering = Tiering("p", manager, clock=clock)
    tier = attach(tiering, "t", keys("x", "y"))
    ks = keys("x", "y")
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING, PENDING]
    tier.finish(tier.loads[0], transient=keys("x"))
    assert manager.lookup(ks) == [MISS, HIT]
    assert tier.contains(b"x")  # nothing removed
    assert [r.what for r in tiering.history.get(b"x")] == [transient_record(CAUSE)]
    failure, left = tiering.promotion_wait(0, b"x") or (None, 0.0)
    assert failure is not None and failure.transient and failure.cause == CAUSE
    assert left == TRANSIENT_RETRY_AFTER
    clock.advance(TRANSIENT_RETRY_AFTER - 0.001)
    assert tiering.lookup(keys("x"), manager.lookup(keys("x"))) == [MISS]  # within the window
    assert len(tier.loads) == 1
    clock.advance(0.001)
    assert tiering.promotion_wait(0, b"x") is None
    assert tiering.lookup(keys("x"), manager.lookup(keys("x"))) == [PENDING]
    tier.finish(tier.loads[1])
    assert manager.lookup(keys("x")) == [HIT]
    counters = tiering.counters(0)
    assert (counters.promotion_blocks_failed, counters.promotion_blocks_loaded) == (1, 2)


def test_transient_failures_in_a_row_double_the_window_up_to_the_fault_ban(manager, clock, attach):
    """A file system or server that stays down is not asked for a key without end: each
    transient failure in a row doubles the key's window, up to PROMOTION_RETRY_AFTER; a
    promotion that loads it starts over."""
    tiering = Tiering("p", manager, clock=clock)
    tier = attach(tiering, "t", keys("x"))
    windows = []
    for _ in range(7):
        failing_once(manager, tiering, tier, keys("x"), transient=keys("x"))
        _, left = tiering.promotion_wait(0, b"x") or (None, 0.0)
        windows.append(left)
        clock.advance(left)
    doubling = [TRANSIENT_RETRY_AFTER * 2**i for i in range(7)]
    assert windows == [min(w, PROMOTION_RETRY_AFTER) for w in doubling]
    assert windows[-2:] == [PROMOTION_RETRY_AFTER] * 2  # capped
    promote(manager, tiering, tier, keys("x"))
    assert manager.lookup(keys("x")) == [HIT]
    tiering.check_invariants(Counter())


def test_a_loaded_key_starts_its_transient_windows_over(manager, clock, attach):
    tiering = Tiering("p", manager, clock=clock)
    tier = attach(tiering, "t", keys("x", "y", "z", "w", "v"))
    for _ in range(3):  # windows 1, 2, 4
        failing_once(manager, tiering, tier, keys("x"), transient=keys("x"))
        clock.advance((tiering.promotion_wait(0, b"x") or (None, 0.0))[1])
    promote(manager, tiering, tier, keys("x"))
    assert manager.lookup(keys("x")) == [HIT]
    # push x out of the 4-row primary, then fail it once more: the first window again
    promote(manager, tiering, tier, keys("y", "z", "w", "v"))
    assert manager.lookup(keys("x")) == [MISS]
    failing_once(manager, tiering, tier, keys("x"), transient=keys("x"))
    assert (tiering.promotion_wait(0, b"x") or (None, 0.0))[1] == TRANSIENT_RETRY_AFTER


def test_an_unreadable_block_is_not_promoted_again_for_the_full_window(manager, clock, attach):
    tiering = Tiering("p", manager, clock=clock)
    tier = attach(tiering, "t", keys("x"))
    failing_once(manager, tiering, tier, keys("x"), failing=keys("x"))
    failure, left = tiering.promotion_wait(0, b"x") or (None, 0.0)
    assert failure is not None and not failure.transient and left == PROMOTION_RETRY_AFTER
    assert [r.what for r in tiering.history.get(b"x")] == [
        "promotion failed (unreadable or corrupt)"
    ]
    clock.advance(PROMOTION_RETRY_AFTER - 0.001)
    assert tiering.lookup(keys("x"), manager.lookup(keys("x"))) == [MISS]
    clock.advance(0.001)
    assert tiering.lookup(keys("x"), manager.lookup(keys("x"))) == [PENDING]
    assert len(tier.loads) == 2


def test_a_tier_waiting_out_a_transient_failure_lets_the_next_tier_serve(manager, clock, attach):
    tiering = Tiering("p", manager, clock=clock)
    near = attach(tiering, "near", keys("x"))
    far = attach(tiering, "far", keys("x"))
    failing_once(manager, tiering, near, keys("x"), transient=keys("x"))
    assert tiering.lookup(keys("x"), manager.lookup(keys("x"))) == [PENDING]
    assert len(far.loads) == 1 and len(near.loads) == 1


# -- admission ---------------------------------------------------------------------------


def test_reused_writes_a_block_at_its_first_load_not_at_its_store(manager, attach):
    """Scenario: tier ``t`` admits ``reused``. A completed store starts no job there,
    makes no stored event of ``t``, and leaves the key's history saying why; once a
    session loads the block from the primary, it is written (one job, one event)."""
    events: list[BlockEvent] = []
    tiering = Tiering("p", manager, on_event=events.append)
    tier = attach(tiering, "t", admission="reused")
    stored(manager, tiering, keys("a", "b"))
    assert tier.stores == [] and events == [] and manager.ref_count(b"a") == 0
    assert [r.what for r in tiering.history.get(b"a")] == [NOT_REUSED.record]
    assert tier.lookup(keys("a")) == [MISS]  # not in that tier: a miss there
    manager.prepare_load(keys("a"))
    manager.complete_load(keys("a"))
    tiering.read(keys("a", "a"))  # a key named twice in one load is one read
    (job,) = tier.stores
    assert job.keys == (b"a",) and manager.ref_count(b"a") == 1  # the job's pin
    tier.finish(job)
    assert events == [BlockEvent((b"a",), tier.medium, removed=False, tier="t")]
    tiering.read(keys("a"))  # held now: nothing more to write
    assert len(tier.stores) == 1
    stats = tiering.admission_statistics(0)
    assert (stats.admitted_blocks, stats.rejected_blocks["not_reused"]) == (1, 2)


def test_always_writes_at_the_store_and_nothing_at_a_load(manager, attach):
    """``always`` (the default) is the cascade as it was: a load writes nothing, even
    of a block the tier does not hold (yet)."""
    tiering = Tiering("p", manager)
    tier = attach(tiering, "t")
    stored(manager, tiering, keys("a"))
    assert len(tier.stores) == 1 and tier.contains(b"a") is False  # written when it runs
    manager.prepare_load(keys("a"))
    manager.complete_load(keys("a"))
    tiering.read(keys("a"))
    assert len(tier.stores) == 1 and tiering.admission_statistics(0).admitted_blocks == 1


def test_a_block_promoted_from_a_later_tier_is_offered_to_the_tiers_before(manager, attach):
    """Promoted blocks are being reused: ``reused`` writes them to the nearer tier."""
    tiering = Tiering("p", manager)
    near = attach(tiering, "near", admission="reused")
    far = attach(tiering, "far", keys("x"))
    assert tiering.lookup(keys("x"), manager.lookup(keys("x"))) == [PENDING]
    (load,) = far.loads
    far.finish(load)
    (cascade,) = near.stores
    assert cascade.keys == (b"x",) and tiering.admission_statistics(0).admitted_blocks == 1
