"""Tiering orchestration against a scripted tier: the faults a real disk will not
produce on demand (a transient read error, partial success, a refused write)."""

from __future__ import annotations

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
    assert tiering.counters(0)["cascade_jobs_failed"] == 1


def test_refused_cascade_is_counted_and_pins_nothing(manager):
    tiering = Tiering("p", manager)
    tiering.attach(ScriptedTier("t", accept_writes=False))
    stored(manager, tiering, keys("a", "b"))
    assert manager.ref_count(b"a") == 0
    assert tiering.counters(0)["cascade_blocks_dropped"] == 2


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
    assert counters["promotion_blocks_loaded"] == 1 and counters["promotion_blocks_failed"] == 2


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
    assert tiering.counters(0)["promotion_no_room"] == 1


def test_prefix_lookup_promotes_nothing_after_the_first_unservable_key(manager):
    tiering = Tiering("p", manager)
    tier = ScriptedTier("t", keys("a", "c"))
    tiering.attach(tier)
    ks = keys("a", "b", "c")  # b is nowhere: c would never be loaded by a prefix cache
    assert tiering.lookup(ks, manager.lookup(ks), prefix=True) == [PENDING, MISS, MISS]
    (job,) = tier.loads
    assert job.keys == (b"a",)
    assert tiering.lookup(keys("c"), manager.lookup(keys("c"))) == [PENDING]  # not prefix
