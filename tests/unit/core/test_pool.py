"""Pool: pins and reservations belong to the session that took them, a refused call
changes nothing, and the pool's cross-object invariant (session pins + cascade
pins + holds == the primary's ref count; reservations disjoint and pending) holds
after every step of every scenario (``Checked`` runs ``check_invariants`` after
each call, refused ones included)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvtierd.config import load_config
from kvtierd.contract import BlockKey, LookupResult, Medium, PoolSpec
from kvtierd.core.pool import Pool
from kvtierd.errors import FailedPrecondition
from kvtierd.primary.region import Region
from kvtierd.records.history import EVICTED_FOR_ROOM, FLUSHED
from kvtierd.tiers.base import JobResult, SecondaryTier, TierJob, TierStats

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
A, B = "session-a", "session-b"


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


class Checked:
    """The pool, with ``check_invariants`` after every call: a scenario step."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.pool, name)
        if not callable(attribute):
            return attribute

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return attribute(*args, **kwargs)
            finally:
                self.pool.check_invariants()

        return step


class HandTier(SecondaryTier):
    """A secondary tier whose jobs wait until the test reports them."""

    medium = Medium.STORAGE

    def __init__(self, pool: Pool, held: Sequence[BlockKey] = ()) -> None:
        self.name = "hand"
        self.keys = set(held)
        self.jobs: list[TierJob] = []
        self._pool = pool

    def launch(self) -> None:
        return None

    @property
    def ready(self) -> bool:
        return True  # no index to rebuild: the test holds every key it has

    async def wait_ready(self) -> None:
        return None

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        return [HIT if key in self.keys else MISS for key in keys]

    def contains(self, key: BlockKey) -> bool | None:
        return key in self.keys

    def submit_store(self, job: TierJob) -> bool:
        self.jobs.append(job)
        return True

    def submit_load(self, job: TierJob) -> None:
        self.jobs.append(job)

    def report(self, success: bool = True, transient: str = "") -> TierJob:
        """Reports the oldest job done (a store lands in the tier); failed, a load's
        keys failed transiently for the cause ``transient`` if given."""
        job = self.jobs.pop(0)
        if success and not job.is_promotion:
            self.keys.update(job.keys)
        for_now = job.keys if transient and not success else ()
        self._pool.tiering.on_done(JobResult(job.job_id, success, transient_keys=for_now,
                                             transient_cause=transient))  # fmt: skip
        return job

    async def drain(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def statistics(self) -> TierStats:
        return TierStats(
            self.name, self.medium, 1 << 20, 0, 4096, len(self.keys), 0, 0, 0, 0, 0, 0, 0, 0, 0,
            len(self.jobs), 0,
        )  # fmt: skip


@pytest.fixture
def make_pool(tmp_path) -> Iterator[Callable[..., Checked]]:
    pools: list[Pool] = []

    def make(num_blocks: int = 4, hold_seconds: float = 0.0) -> Checked:
        region = Region.create(tmp_path, f"p{len(pools)}", num_blocks, 4096, prefault=False)
        limits = dataclasses.replace(load_config(env={}).limits, promotion_hold=hold_seconds)
        pool = Pool(PoolSpec(f"p{len(pools)}", 4096, num_blocks, "", "lru"), region, limits)
        pools.append(pool)
        pool.attach(A)
        pool.attach(B)
        return Checked(pool)

    yield make
    for pool in pools:
        pool.close()


def store(pool: Checked, session: str, names: list[bytes]) -> None:
    assert pool.prepare_store(session, names) is not None
    pool.complete_store(session, names, True)


def refs(pool: Checked, names: list[bytes]) -> list[int | None]:
    return [pool.manager.ref_count(key) for key in names]


def test_a_pin_belongs_to_the_session_that_took_it(make_pool):
    pool = make_pool()
    store(pool, A, keys("k"))
    pool.prepare_load(A, keys("k"))
    pool.prepare_load(B, keys("k"))
    assert refs(pool, keys("k")) == [2]
    # A holds one pin: releasing two would release B's
    with pytest.raises(FailedPrecondition, match="not pinned by this session"):
        pool.complete_load(A, keys("k", "k"))
    assert refs(pool, keys("k")) == [2]
    pool.complete_load(B, keys("k"))
    with pytest.raises(FailedPrecondition):
        pool.complete_load(B, keys("k"))  # B's only pin is gone
    pool.complete_load(A, keys("k"), unused=True)
    assert refs(pool, keys("k")) == [0]
    primary = pool.statistics().primary
    assert (primary.loads, primary.unused_pins) == (1, 1)


def test_a_reservation_belongs_to_the_session_that_made_it(make_pool):
    pool = make_pool()
    grant = pool.prepare_store(A, keys("a", "b"))
    assert grant is not None and grant.keys_to_store == keys("a", "b")
    assert pool.complete_store(B, keys("a"), True) == 0  # not B's: left alone
    assert pool.lookup(keys("a")) == [PENDING]
    grant = pool.prepare_store(B, keys("a", "c"))  # a is in flight: only c is new
    assert grant is not None and grant.keys_to_store == keys("c")
    assert pool.complete_store(A, keys("a", "b", "c"), True) == 2
    assert pool.complete_store(B, keys("c"), False) == 1
    assert pool.lookup(keys("a", "b", "c")) == [HIT, HIT, MISS]
    primary = pool.statistics().primary
    assert (primary.stores_completed, primary.stores_aborted) == (2, 1)


def test_releasing_a_session_drops_its_pins_and_quarantines_its_reservations(make_pool):
    pool = make_pool()
    store(pool, A, keys("x", "y"))
    pool.prepare_load(A, keys("x", "x", "y"))
    pool.prepare_load(B, keys("x"))
    pool.prepare_store(A, keys("w"))
    assert pool.release_session(A, quarantine_until=10.0) == (3, 1)
    assert refs(pool, keys("x", "y", "w")) == [1, 0, None]  # B's pin stays
    primary = pool.statistics().primary
    assert (primary.quarantined_blocks, primary.stores_aborted) == (1, 1)
    assert pool.session_count == 1
    assert pool.release_quarantine(9.9) == 0
    assert pool.release_quarantine(10.0) == 1


def test_a_prefix_lookup_answers_miss_after_its_first_unusable_key(make_pool):
    pool = make_pool()
    store(pool, A, keys("a", "c"))
    pool.prepare_store(A, keys("p"))
    assert pool.lookup(keys("a", "p", "b", "c"), prefix=True) == [HIT, PENDING, MISS, MISS]
    assert pool.lookup(keys("a", "p", "b", "c")) == [HIT, PENDING, MISS, HIT]
    primary = pool.statistics().primary
    assert (primary.hits, primary.hits_pending, primary.misses) == (3, 2, 3)


def test_lookup_and_pin_pins_the_leading_hits_of_a_prefix_for_the_session(make_pool):
    pool = make_pool()
    store(pool, A, keys("a", "b", "d"))
    pool.prepare_store(A, keys("p"))
    chain = keys("a", "b", "p", "d")
    results, rows = pool.lookup_and_pin(B, chain, prefix=True)
    assert results == [HIT, HIT, PENDING, HIT]  # the chain goes on past p: it waits for it
    assert rows[:2] == [pool.manager.block_id(k) for k in keys("a", "b")] and rows[2:] == [-1, -1]
    assert refs(pool, keys("a", "b", "d")) == [1, 1, 0]  # the leading HITs only
    results, rows = pool.lookup_and_pin(B, chain)
    assert results == [HIT, HIT, PENDING, HIT] and rows[2] == -1 and rows[3] >= 0
    assert refs(pool, keys("a", "b", "d")) == [2, 2, 1]
    with pytest.raises(FailedPrecondition):
        pool.complete_load(A, keys("a"))  # B's pins
    pool.complete_load(B, keys("a", "a", "b", "b", "d"))
    results, rows = pool.lookup_and_pin(B, keys("a", "zz", "d"), prefix=True)
    assert results == [HIT, MISS, MISS] and rows == [rows[0], -1, -1]
    assert refs(pool, keys("a", "d")) == [1, 0]


def test_explain_names_why_the_primary_dropped_a_key(make_pool):
    pool = make_pool(num_blocks=2)
    store(pool, A, keys("old", "flushed"))
    pool.touch(keys("flushed"))
    store(pool, A, keys("new"))  # evicts "old", the least recently used
    assert pool.flush() == 2
    assert [r.what for r in pool.explain(b"old").history] == [EVICTED_FOR_ROOM]
    assert [r.what for r in pool.explain(b"flushed").history] == [FLUSHED]
    assert [r.what for r in pool.explain(b"new").history] == [FLUSHED]
    store(pool, A, keys("again"))  # room without eviction: no record
    assert pool.explain(b"again").history == []


def observable(pool: Checked, universe: list[bytes]) -> tuple[object, ...]:
    """Everything a refused call must leave as it was (the refusal counter aside)."""
    stats = pool.statistics()
    return (
        dataclasses.replace(stats, primary=dataclasses.replace(stats.primary, stores_refused=0)),
        pool.manager.lookup(universe),
        refs(pool, universe),
        pool.events.last_seq,
        [pool.explain(key).history for key in universe],
    )


def _mixed(pool: Checked) -> None:
    """k1 ready, k2 pinned by A, k3 pinned by B, k4 reserved by A: the pool full."""
    store(pool, A, keys("k1", "k2", "k3"))
    pool.prepare_load(A, keys("k2"))
    pool.prepare_load(B, keys("k3"))
    pool.prepare_store(A, keys("k4"))


REFUSALS: list[tuple[str, Callable[[Checked], object], bool]] = [
    ("load_miss", lambda p: p.prepare_load(A, keys("k1", "zz")), True),
    ("load_pending", lambda p: p.prepare_load(B, keys("k1", "k4")), True),
    ("complete_unpinned", lambda p: p.complete_load(A, keys("k1")), True),
    ("complete_another_sessions_pin", lambda p: p.complete_load(A, keys("k2", "k3")), True),
    ("complete_more_than_held", lambda p: p.complete_load(A, keys("k2", "k2")), True),
    ("store_no_room", lambda p: p.prepare_store(B, keys("n1", "n2")), False),
    ("complete_another_sessions_store", lambda p: p.complete_store(B, keys("k4"), True), False),
]


@pytest.mark.parametrize(
    ("call", "raises"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_a_refused_call_changes_nothing(make_pool, call, raises):
    pool = make_pool(num_blocks=4)
    _mixed(pool)
    universe = keys("k1", "k2", "k3", "k4", "zz", "n1", "n2")
    before = observable(pool, universe)
    if raises:
        with pytest.raises(FailedPrecondition):
            call(pool)
    else:
        assert call(pool) in (None, 0)
    assert observable(pool, universe) == before


def test_a_refused_store_is_counted(make_pool):
    pool = make_pool(num_blocks=4)
    _mixed(pool)
    pool.prepare_load(A, keys("k1"))  # every row pinned or pending
    assert pool.prepare_store(B, keys("n1")) is None
    assert pool.statistics().primary.stores_refused == 1


def test_cascade_pins_and_promotion_holds_count_in_the_ref_counts(make_pool):
    """Scenario: a completed store cascades to the tier (one pool pin per key until
    the tier reports); after a flush a lookup promotes a key (a pool reservation),
    the promoted block is held until B pins it, and B's pin claims the hold."""
    pool = make_pool(num_blocks=4, hold_seconds=60.0)
    tier = HandTier(pool.pool)
    pool.tiering.attach(tier)
    store(pool, A, keys("a", "b"))
    assert refs(pool, keys("a", "b")) == [1, 1]  # the cascade job's pins
    pool.prepare_load(A, keys("a"))
    assert refs(pool, keys("a")) == [2]
    tier.report()
    pool.complete_load(A, keys("a"))
    assert pool.flush() == 2
    assert pool.lookup(keys("a", "b")) == [PENDING, PENDING]
    assert pool.statistics().primary.pending_blocks == 2  # the promotion's, no session's
    tier.report()
    assert refs(pool, keys("a", "b")) == [1, 1]  # held for the request that waits
    pool.prepare_load(B, keys("a"))
    assert refs(pool, keys("a", "b")) == [1, 1]  # B's pin claimed a's hold
    pool.release_session(B, quarantine_until=0.0)
    assert refs(pool, keys("a", "b")) == [0, 1]


def test_check_invariants_catches_a_pin_or_a_reservation_nobody_owns(make_pool):
    pool = make_pool()
    store(pool, A, keys("a"))
    pool.pool.manager.prepare_load(keys("a"))  # a pin behind the pool's back
    with pytest.raises(AssertionError, match="a pin without owner"):
        pool.pool.check_invariants()
    pool.pool.manager.complete_load(keys("a"))
    pool.pool.check_invariants()
    pool.pool.manager.prepare_store(keys("b"))  # a reservation nobody owns
    with pytest.raises(AssertionError, match="pending rows"):
        pool.pool.check_invariants()


def test_explain_tells_why_a_key_the_tier_holds_is_not_promoted_yet(make_pool):
    """Scenario: issue #40, item 5. The tier holds the key; its promotion failed.
    Transiently (an I/O worker timed out): nothing was removed, and Explain says when
    a Lookup promotes it again. Unreadable: Lookups answer MISS for the full window."""
    pool = make_pool(num_blocks=4)
    tier = HandTier(pool.pool, held=keys("t", "u"))
    pool.tiering.attach(tier)
    assert pool.lookup(keys("t")) == [PENDING]
    assert "the next Lookup promotes it" in pool.explain(b"u").summary
    tier.report(success=False, transient="the I/O worker did not answer in time")
    explained = pool.explain(b"t")
    assert explained.tiers == [("hand", True)]
    assert re.fullmatch(
        r"not in the primary; held by tier hand, but its last promotion failed for now \(the "
        r"I/O worker did not answer in time; nothing was removed\): Lookups answer MISS for "
        r"\d\.\ds more, then the next one promotes it again",
        explained.summary,
    ), explained.summary
    assert [r.what for r in explained.history] == [
        "promotion failed for now (the I/O worker did not answer in time): nothing removed, "
        "promoted again later"
    ]
    assert pool.lookup(keys("u")) == [PENDING]
    tier.report(success=False)  # unreadable
    assert re.fullmatch(
        r"not in the primary; held by tier hand, but its promotion failed \(unreadable or "
        r"corrupt\): Lookups answer MISS for (30|29)s more, then the next one tries again",
        pool.explain(b"u").summary,
    ), pool.explain(b"u").summary
