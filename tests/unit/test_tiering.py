"""Tiering orchestration against a scripted tier: the faults a real disk will not
produce on demand (a transient read error, partial success, a refused write)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

import pytest

from kvtierd.contract import BlockKey, LookupResult, Medium
from kvtierd.primary import PrimaryManager
from kvtierd.tiering import Tiering
from kvtierd.tiers.base import JobResult, SecondaryTier, TierJob, TierStats

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)


class ScriptedTier(SecondaryTier):
    """Holds a set of keys; jobs wait in lists until the test finishes them."""

    medium = Medium.STORAGE

    def __init__(self, name: str, keys: Sequence[BlockKey] = (), *, accept_writes: bool = True):
        self.name = name
        self.keys = set(keys)
        self.ready = True
        self.accept_writes = accept_writes
        self.stores: list[TierJob] = []
        self.loads: list[TierJob] = []
        self.lookups = 0

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        self.lookups += 1
        if not self.ready:
            return [RETRY] * len(keys)
        return [HIT if key in self.keys else MISS for key in keys]

    def submit_store(self, job: TierJob) -> bool:
        if self.accept_writes:
            self.stores.append(job)
        return self.accept_writes

    def submit_load(self, job: TierJob) -> None:
        self.loads.append(job)

    async def drain(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def statistics(self) -> TierStats:  # pragma: no cover - not used here
        raise NotImplementedError


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


@pytest.fixture
def manager() -> PrimaryManager:
    return PrimaryManager(4, "lru")


def stored(manager: PrimaryManager, tiering: Tiering, names: list[bytes]) -> None:
    manager.prepare_store(names)
    done = manager.complete_store(names, success=True)
    tiering.cascade(done)


def test_cascade_pins_until_the_tier_reports(manager):
    tiering = Tiering("p", manager)
    tier = ScriptedTier("t")
    tiering.attach(tier)
    stored(manager, tiering, keys("a", "b"))
    assert manager.ref_count(b"a") == 1 and tiering.jobs_in_flight == 1
    assert manager.prepare_store(keys("c", "d", "e")) is None  # a, b cannot be evicted
    (job,) = tier.stores
    tiering.on_done(JobResult(job.job_id, success=False))  # failure releases the pins too
    assert manager.ref_count(b"a") == 0 and tiering.jobs_in_flight == 0
    assert tiering.counters(0).cascade_jobs_failed == 1


def test_refused_cascade_is_counted_and_pins_nothing(manager):
    tiering = Tiering("p", manager)
    tiering.attach(ScriptedTier("t", accept_writes=False))
    stored(manager, tiering, keys("a", "b"))
    assert manager.ref_count(b"a") == 0
    assert tiering.counters(0).cascade_blocks_dropped == 2


def test_partial_promotion_keeps_what_arrived_and_does_not_retry_the_rest(manager):
    tiering = Tiering("p", manager)
    tier = ScriptedTier("t", keys("x", "y", "z"))
    tiering.attach(tier)
    ks = keys("x", "y", "z")
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING] * 3
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING] * 3  # no second promotion
    (job,) = tier.loads
    tiering.on_done(JobResult(job.job_id, success=False, successful_keys=(b"x",)))
    assert manager.lookup(ks) == [HIT, MISS, MISS]
    # the tier still lists y and z (a transient error keeps the file): no retry loop
    assert tiering.lookup(ks, manager.lookup(ks)) == [HIT, MISS, MISS]
    assert len(tier.loads) == 1
    counters = tiering.counters(0)
    assert counters.promotion_blocks_loaded == 1 and counters.promotion_blocks_failed == 2


def test_retry_while_a_tier_is_not_ready_unless_a_later_tier_holds_the_key(manager):
    tiering = Tiering("p", manager)
    scanning, far = ScriptedTier("near"), ScriptedTier("far", keys("b"))
    scanning.ready = False
    tiering.attach(scanning)
    tiering.attach(far)
    ks = keys("a", "b")
    assert tiering.lookup(ks, manager.lookup(ks)) == [RETRY, PENDING]
    (job,) = far.loads
    tiering.on_done(JobResult(job.job_id, success=True))
    assert manager.lookup(ks) == [MISS, HIT]
    (cascade,) = scanning.stores  # promoted from the far tier: copied to the near one
    assert cascade.keys == (b"b",) and not far.stores


def test_promotion_never_evicts_a_key_of_the_same_lookup(manager):
    tiering = Tiering("p", manager)
    tier = ScriptedTier("t", keys("x", "y"))
    tiering.attach(tier)
    stored(manager, tiering, keys("a", "b", "c"))
    tiering.on_done(JobResult(tier.stores[0].job_id, success=True))
    ks = keys("a", "b", "c", "x", "y")  # one free row; a, b, c are protected
    assert tiering.lookup(ks, manager.lookup(ks)) == [HIT, HIT, HIT, PENDING, MISS]
    assert tiering.counters(0).promotion_no_room == 1


def test_prefix_lookup_promotes_nothing_after_the_first_unservable_key(manager):
    tiering = Tiering("p", manager)
    tier = ScriptedTier("t", keys("a", "c"))
    tiering.attach(tier)
    ks = keys("a", "b", "c")  # b is nowhere: c would never be loaded by a prefix cache
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, MISS, MISS]
    (job,) = tier.loads
    assert job.keys == (b"a",)
    assert tiering.lookup(keys("c"), manager.lookup(keys("c"))) == [PENDING]  # not prefix


def outcomes(tiering: Tiering, index: int) -> tuple[int, int, int, int]:
    """(hits, misses, retries, promotion_no_room) of tier ``index``."""
    c = tiering.counters(index)
    return c.hits, c.misses, c.retries, c.promotion_no_room


def test_each_key_asked_of_a_tier_is_counted_once_as_what_it_got(manager):
    """Scenario: issue #16. Tier counters are what the pool got from the tier: a
    promoted block is one hit when it arrives (not once per polling Lookup), a
    failed promotion a miss, a rebuilding tier a retry, a hit without a primary row
    no_room, and keys past a prefix Lookup's end are not counted."""
    near, far = ScriptedTier("near"), ScriptedTier("far", keys("x", "y", "z", "w"))
    near.ready = False
    tiering = Tiering("p", manager)
    tiering.attach(near)
    tiering.attach(far)
    ks = keys("x", "y", "q")
    assert tiering.lookup(ks, manager.lookup(ks)) == [PENDING, PENDING, RETRY]
    assert outcomes(tiering, 0) == (0, 0, 3, 0) and outcomes(tiering, 1) == (0, 1, 0, 0)
    for _ in range(3):  # polling while the promotion is in flight asks no tier
        assert tiering.lookup(ks[:2], manager.lookup(ks[:2])) == [PENDING] * 2
    (job,) = far.loads
    tiering.on_done(JobResult(job.job_id, success=False, successful_keys=(b"x",)))
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def holding(manager: PrimaryManager, clock: FakeClock, tier: ScriptedTier) -> Tiering:
    tiering = Tiering("p", manager, hold_seconds=HOLD, clock=clock)
    tiering.attach(tier)
    return tiering


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
        tiering.on_done(JobResult(job.job_id, success=True))


def pin(manager: PrimaryManager, tiering: Tiering, names: list[bytes], pins: Counter) -> None:
    """What Pool.prepare_load does for a session: pin, then claim the holds."""
    manager.prepare_load(names)
    pins.update(names)
    tiering.claim_holds(names)


def test_a_promoted_block_is_held_until_a_session_pins_it(manager, clock):
    """Scenario: the storm of issue #15. Two requests wait for blocks of the fs tier
    in a 4-row primary; the second one's promotion must not evict what the first
    one's just brought in, and a store cannot either."""
    tier = ScriptedTier("t", keys("a", "b", "c", "x", "y", "z"))
    tiering = holding(manager, clock, tier)
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


def test_a_hold_nobody_claims_expires_at_its_deadline(manager, clock):
    tier = ScriptedTier("t", keys("a", "b"))
    tiering = holding(manager, clock, tier)
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


def test_closing_releases_every_hold(manager, clock):
    tier = ScriptedTier("t", keys("a", "b"))
    tiering = holding(manager, clock, tier)
    promote(manager, tiering, tier, keys("a", "b"))
    tiering.close()
    assert manager.ref_count(b"a") == 0 and manager.statistics().pinned_blocks == 0
    assert tiering.hold_statistics().held == 0


def test_a_failed_promotion_holds_only_what_arrived(manager, clock):
    tier = ScriptedTier("t", keys("x", "y"))
    tiering = holding(manager, clock, tier)
    ks = keys("x", "y")
    tiering.lookup(ks, manager.lookup(ks))
    (job,) = tier.loads
    tiering.on_done(JobResult(job.job_id, success=False, successful_keys=(b"x",)))
    assert manager.ref_count(b"x") == 1 and manager.ref_count(b"y") is None
    assert tiering.hold_statistics().held == 1
    tiering.check_invariants(Counter())


def test_a_waiting_prefix_lookup_holds_the_hits_in_front_of_its_pending_key(manager, clock):
    """The ready blocks of a request that waits for a promotion are not evicted
    while it waits (it will load them with the promoted one); the hold is renewed
    by each lookup that still waits, and ends with a pin that loads."""
    tier = ScriptedTier("t", keys("c"))
    tiering = holding(manager, clock, tier)
    stored(manager, tiering, keys("a", "b"))  # ready in the primary (no cascade pin: done)
    tiering.on_done(JobResult(tier.stores[0].job_id, success=True))
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
    tiering.on_done(JobResult(job.job_id, success=True))
    pins: Counter[bytes] = Counter()
    pin(manager, tiering, ks, pins)
    tiering.check_invariants(pins)
    assert tiering.hold_statistics().held == 0


def test_a_lookup_that_waits_for_nothing_holds_nothing(manager, clock):
    tier = ScriptedTier("t", keys("c"))
    tiering = holding(manager, clock, tier)
    stored(manager, tiering, keys("a"))
    tiering.on_done(JobResult(tier.stores[0].job_id, success=True))
    ks = keys("a", "b", "c")  # b is nowhere: c is never loaded by a prefix cache
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [HIT, MISS, MISS]
    assert tiering.lookup(ks, manager.lookup(ks)) == [HIT, MISS, PENDING]  # not prefix
    assert manager.ref_count(b"a") == 0 and tiering.hold_statistics().held == 0


def test_holds_off_with_zero_seconds(manager):
    tier = ScriptedTier("t", keys("a"))
    tiering = Tiering("p", manager, hold_seconds=0)
    tiering.attach(tier)
    promote(manager, tiering, tier, keys("a"))
    assert manager.ref_count(b"a") == 0


def test_repeated_lookups_of_a_pending_key_cost_no_tier_work(manager, clock):
    tier = ScriptedTier("t", keys("a", "b"))
    tiering = holding(manager, clock, tier)
    ks = keys("a", "b")
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, PENDING]
    consulted = tier.lookups
    for _ in range(5):
        assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, PENDING]
    assert tier.lookups == consulted and len(tier.loads) == 1
    assert tiering.counters(0).promotion_jobs_started == 1


def test_the_hold_timer_releases_expired_holds_on_a_running_loop(manager):
    """In the daemon nothing else may call into the pool after a promotion: the
    loop timer alone must release the hold at its deadline."""
    tier = ScriptedTier("t", keys("a"))
    tiering = Tiering("p", manager, hold_seconds=0.05)
    tiering.attach(tier)

    async def scenario() -> float:
        promote(manager, tiering, tier, keys("a"))
        start = time.monotonic()
        assert manager.ref_count(b"a") == 1
        while manager.ref_count(b"a") != 0:  # the timer offers no event: poll
            assert time.monotonic() - start < 5.0, "hold never released"
            await asyncio.sleep(0.005)
        return time.monotonic() - start

    assert asyncio.run(scenario()) >= 0.04
    assert tiering.hold_statistics().expired == 1
