"""The secondary-tier contract as checks, written once against the ABC.

``kvtierd/tiers/base.py`` states the contract; each check here exercises one
part of it, through the public methods of :class:`SecondaryTier` only. A tier
implementation runs them all by supplying a :class:`TierKit` (how to build its
tiers for a pool, hold its I/O, stop it as the daemon does) in
``test_contract.py``: the Redis tier joins with one kit.

The :class:`Rig` checks what every check relies on, for every report: it runs on
the check's event loop, never from inside a call into the tier, exactly once per
accepted job, never for a refused one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtierd.contract import BlockKey, LookupResult
from kvtierd.tiers.base import JobCallback, JobResult, SecondaryTier, TierJob

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
ROWS = 16  # rows of each pool's region
REPORT_TIMEOUT_S = 30.0  # a job not reported by then is a contract violation (never a hang)
LONG_KEY = bytes(range(200))  # longer than a file name may be
BINARY_KEY = b"\x00\x01/../\xff"  # NUL, a path separator, not UTF-8


def key(i: int) -> BlockKey:
    return b"key-%d" % i


class TierKit(abc.ABC):
    """One tier implementation as the contract suite builds, holds and stops it.

    A kit serves one check, on the check's event loop, and owns what its tiers
    share (a root directory, I/O worker processes); :meth:`close` releases it.
    """

    block_bytes: int  # bytes of one primary row
    can_damage = False  # whether damage() can corrupt a stored block

    def __init__(self, root: Path) -> None:
        self.root = root  # a directory of the check's own (pytest's tmp_path)

    @abc.abstractmethod
    def region(self, pool: str) -> memoryview:
        """A fresh zeroed region of :data:`ROWS` rows for ``pool`` (a flat byte view)."""

    @abc.abstractmethod
    def create(
        self,
        pool: str,
        region: memoryview,
        on_done: JobCallback,
        loop: asyncio.AbstractEventLoop,
        *,
        capacity_blocks: int,
        max_queue_jobs: int,
    ) -> SecondaryTier:
        """A tier for ``pool`` over ``region``, not started, with room for exactly
        ``capacity_blocks`` blocks and at most ``max_queue_jobs`` store jobs in
        flight (more are refused)."""

    @abc.abstractmethod
    def stall(self, tier: SecondaryTier) -> contextlib.AbstractAsyncContextManager[None]:
        """Inside: ``tier`` starts none of its jobs (accepted ones wait), as on a
        medium that does not answer. On leaving, the jobs go on."""

    async def stop(self, tier: SecondaryTier) -> None:  # noqa: B027 - nothing shared
        """What the tier's owner stops after ``tier.shutdown()`` (threads shared by
        pools, as the daemon's configured tier does)."""

    def damage(self, tier: SecondaryTier, key: BlockKey) -> None:
        """Corrupts the stored copy of ``key`` (only if :attr:`can_damage`)."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - nothing to release
        """Releases what the kit owns (after every tier was stopped)."""


@dataclass
class Subject:
    """One tier under test, its pool's rows and its jobs."""

    rig: Rig
    pool: str
    tier: SecondaryTier
    rows: memoryview
    block_bytes: int
    stopped: bool = False

    def fill(self, row: int) -> bytes:
        data = os.urandom(self.block_bytes)
        self.rows[row * self.block_bytes : (row + 1) * self.block_bytes] = data
        return data

    def read(self, row: int) -> bytes:
        return bytes(self.rows[row * self.block_bytes : (row + 1) * self.block_bytes])

    def submit_store(self, keys: Sequence[BlockKey], rows: Sequence[int]) -> int | None:
        """The job id, or None when the tier refused the job."""
        job = self.rig.job(keys, rows, promotion=False)
        with self.rig.inside_tier():
            accepted = self.tier.submit_store(job)
        if not accepted:
            self.rig.refused(job.job_id)
            return None
        return job.job_id

    def submit_load(self, keys: Sequence[BlockKey], rows: Sequence[int]) -> int:
        job = self.rig.job(keys, rows, promotion=True)
        with self.rig.inside_tier():
            self.tier.submit_load(job)
        return job.job_id

    async def store(self, keys: Sequence[BlockKey], rows: Sequence[int]) -> JobResult:
        job_id = self.submit_store(keys, rows)
        assert job_id is not None, f"{self.tier.name}: an idle tier refused a store"
        return await self.rig.result(job_id)

    async def load(self, keys: Sequence[BlockKey], rows: Sequence[int]) -> JobResult:
        return await self.rig.result(self.submit_load(keys, rows))

    async def shutdown(self) -> None:
        """``tier.shutdown()`` on the loop, then what its owner stops, as the daemon."""
        if self.stopped:
            return
        self.stopped = True
        with self.rig.inside_tier():
            self.tier.shutdown()
        await self.rig.kit.stop(self.tier)


@dataclass
class Rig:
    """Builds subjects from a kit and turns reports into futures, checking each."""

    kit: TierKit
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    reports: Counter[int] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    _futures: dict[int, asyncio.Future[JobResult]] = field(default_factory=dict)
    _refused: set[int] = field(default_factory=set)
    _job_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _inside: int = 0
    _loop_thread: int = field(default_factory=threading.get_ident)
    _subjects: list[Subject] = field(default_factory=list)

    async def subject(
        self,
        pool: str = "pool-a",
        *,
        capacity_blocks: int = 4 * ROWS,
        max_queue_jobs: int = 64,
        start: bool = True,
    ) -> Subject:
        rows = self.kit.region(pool)
        tier = self.kit.create(
            pool,
            rows,
            self.on_done,
            self.loop,
            capacity_blocks=capacity_blocks,
            max_queue_jobs=max_queue_jobs,
        )
        subject = Subject(self, pool, tier, rows, self.kit.block_bytes)
        self._subjects.append(subject)
        if start:
            tier.start()
            await asyncio.wait_for(tier.wait_ready(), REPORT_TIMEOUT_S)
        return subject

    def job(self, keys: Sequence[BlockKey], rows: Sequence[int], *, promotion: bool) -> TierJob:
        job = TierJob(next(self._job_ids), tuple(keys), tuple(rows), promotion)
        self._futures[job.job_id] = self.loop.create_future()
        return job

    def refused(self, job_id: int) -> None:
        del self._futures[job_id]
        self._refused.add(job_id)

    @contextlib.contextmanager
    def inside_tier(self) -> Iterator[None]:
        """Marks a synchronous call into a tier: no report may run meanwhile."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def on_done(self, result: JobResult) -> None:
        job_id = result.job_id
        self.reports[job_id] += 1
        if threading.get_ident() != self._loop_thread:
            self.violations.append(f"job {job_id} reported on {threading.current_thread().name}")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.loop:
            self.violations.append(f"job {job_id} reported outside the event loop")
        if self._inside:
            self.violations.append(f"job {job_id} reported from inside a call into the tier")
        if job_id in self._refused:
            self.violations.append(f"refused job {job_id} reported")
        elif self.reports[job_id] > 1:
            self.violations.append(f"job {job_id} reported {self.reports[job_id]} times")
        elif job_id not in self._futures:
            self.violations.append(f"unknown job {job_id} reported")
        else:
            self._futures[job_id].set_result(result)

    async def result(self, job_id: int) -> JobResult:
        future = self._futures[job_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), REPORT_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"job {job_id} not reported within {REPORT_TIMEOUT_S}s") from None

    def reported(self, job_id: int) -> bool:
        return self.reports[job_id] > 0

    async def close(self) -> None:
        try:
            for subject in self._subjects:
                await subject.shutdown()
        finally:
            self.kit.close()

    def assert_clean(self) -> None:
        assert not self.violations, "contract violations:\n" + "\n".join(self.violations)


Check = Callable[[Rig], Awaitable[None]]


async def run_check(make_kit: Callable[[], TierKit], check: Check) -> None:
    """Runs one check on a fresh kit; stops every tier it made, then checks the
    reports (a job reported twice after its check ended still counts)."""
    rig = Rig(make_kit())
    try:
        await check(rig)
    finally:
        await rig.close()
    await asyncio.sleep(0)  # reports scheduled by the shutdown run now
    rig.assert_clean()


def made_it(result: JobResult, job_keys: Sequence[BlockKey]) -> tuple[BlockKey, ...]:
    """The keys a report says made it, checked against the report rules."""
    if result.success:
        assert result.successful_keys in (None, tuple(job_keys)), result
        return tuple(job_keys)
    assert result.successful_keys is None or result.successful_keys, "empty tuple, not None"
    keys = result.successful_keys or ()
    assert list(keys) == [k for k in job_keys if k in keys], "successful_keys not in job order"
    return tuple(keys)


# -- the checks ----------------------------------------------------------------------------


async def check_ready_turns_true_once_launched_and_stays(rig: Rig) -> None:
    subject = await rig.subject(start=False)
    tier = subject.tier
    assert not tier.ready
    assert tier.lookup([key(0), key(1)]) == [RETRY, RETRY]  # not ready: every key
    assert tier.contains(key(0)) is None
    tier.start()
    await asyncio.wait_for(tier.wait_ready(), REPORT_TIMEOUT_S)
    assert tier.ready
    assert tier.lookup([key(0)]) == [MISS] and tier.contains(key(0)) is False
    subject.fill(0)
    assert (await subject.store([key(0)], [0])).success
    assert tier.ready and tier.lookup([key(0)]) == [HIT]


async def check_store_then_load_returns_the_exact_bytes(rig: Rig) -> None:
    subject = await rig.subject()
    tier = subject.tier
    keys = [key(0), BINARY_KEY, LONG_KEY, key(3)]
    data = [subject.fill(row) for row in range(4)]
    stored = await subject.store(keys, [0, 1, 2, 3])
    assert made_it(stored, keys) == tuple(keys) and stored.seconds >= 0
    assert [subject.read(row) for row in range(4)] == data  # a store only reads its rows
    assert tier.lookup([*keys, key(99)]) == [HIT] * 4 + [MISS]
    assert all(tier.contains(k) for k in keys) and tier.contains(key(99)) is False
    loaded = await subject.load(keys, [4, 5, 6, 7])
    assert made_it(loaded, keys) == tuple(keys)
    assert [subject.read(row) for row in range(4, 8)] == data
    stats = tier.statistics()
    assert stats.blocks == 4 and stats.used_bytes == 4 * stats.bytes_per_block
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.bytes_written == stats.bytes_read == 4 * stats.bytes_per_block
    assert (stats.hits, stats.misses) == (4, 1)  # lookups count, contains() does not
    assert (stats.store_failures, stats.load_failures) == (0, 0)


async def check_storing_a_held_key_succeeds_without_rewriting(rig: Rig) -> None:
    subject = await rig.subject()
    first = subject.fill(0)
    assert (await subject.store([key(0)], [0])).success
    subject.fill(1)  # other bytes under the same key: the key names the content
    again = await subject.store([key(0)], [1])
    assert again.success and again.bytes_moved == 0
    assert (await subject.load([key(0)], [2])).success and subject.read(2) == first
    assert subject.tier.statistics().blocks == 1


async def check_an_absent_key_fails_and_never_carries_other_bytes(rig: Rig) -> None:
    subject = await rig.subject()
    data = subject.fill(0)
    assert (await subject.store([key(0)], [0])).success
    mixed = await subject.load([key(0), key(1)], [5, 6])
    assert not mixed.success and made_it(mixed, [key(0), key(1)]) == (key(0),)
    assert subject.read(5) == data
    absent = await subject.load([key(2)], [7])
    assert not absent.success and absent.successful_keys is None
    assert subject.tier.statistics().load_failures == 2
    assert subject.tier.lookup([key(1), key(2)]) == [MISS, MISS]


async def check_capacity_holds_and_the_least_recently_used_goes_first(rig: Rig) -> None:
    subject = await rig.subject(capacity_blocks=3)
    tier = subject.tier
    a, b, c, d, e, f = (key(i) for i in range(6))
    for row in range(6):
        subject.fill(row)
    assert (await subject.store([a, b, c], [0, 1, 2])).success  # recency: a b c
    assert tier.take_removed() == []
    assert tier.lookup([a]) == [HIT]  # b c a
    tier.touch([b, key(99)])  # c a b; an unknown key is ignored
    assert (await subject.store([d], [3])).success  # evicts c: a b d
    assert [tier.contains(k) for k in (a, b, c, d)] == [True, True, False, True]
    assert tier.take_removed() == [c] and tier.take_removed() == []
    stats = tier.statistics()
    assert stats.evictions == 1 and stats.blocks == 3
    assert stats.used_bytes == 3 * stats.bytes_per_block <= stats.capacity_bytes
    assert (await subject.store([e, f], [4, 5])).success  # evicts a, then b: d e f
    assert tier.take_removed() == [a, b]
    assert tier.lookup([a, b, c, d, e, f]) == [MISS, MISS, MISS, HIT, HIT, HIT]
    assert tier.statistics().used_bytes <= tier.statistics().capacity_bytes


async def check_victim_is_what_one_more_block_would_displace(rig: Rig) -> None:
    """``victim()`` (admission compares against it): None while one more block fits,
    then the least recently used held key; it changes nothing."""
    subject = await rig.subject(capacity_blocks=3)
    tier = subject.tier
    a, b, c, d = (key(i) for i in range(4))
    for row in range(4):
        subject.fill(row)
    assert tier.victim() is None  # empty
    assert (await subject.store([a, b], [0, 1])).success
    assert tier.victim() is None  # room for c
    assert (await subject.store([c], [2])).success  # full: a b c
    assert tier.victim() == a
    tier.touch([a])  # b c a
    assert tier.victim() == b and tier.victim() == b  # asking changes nothing
    assert [tier.contains(k) for k in (a, b, c)] == [True, True, True]
    assert (await subject.store([d], [3])).success  # evicts b, as victim() said
    assert tier.contains(b) is False and tier.victim() == c


async def check_jobs_in_flight_at_shutdown_report_failed_once(rig: Rig) -> None:
    subject = await rig.subject()
    subject.fill(0)
    subject.fill(1)
    assert (await subject.store([key(0)], [0])).success
    async with rig.kit.stall(subject.tier):
        store = subject.submit_store([key(1)], [1])
        load = subject.submit_load([key(0)], [2])
        assert store is not None
        stopping = asyncio.ensure_future(subject.shutdown())
        results = [await rig.result(store), await rig.result(load)]
    await stopping
    for result in results:
        assert not result.success and result.successful_keys is None, result
    await asyncio.wait_for(subject.tier.drain(), REPORT_TIMEOUT_S)
    assert rig.reports[store] == rig.reports[load] == 1


async def check_a_refused_store_never_reports(rig: Rig) -> None:
    subject = await rig.subject(max_queue_jobs=1)
    subject.fill(0)
    subject.fill(1)
    async with rig.kit.stall(subject.tier):
        first = subject.submit_store([key(0)], [0])
        refused = subject.submit_store([key(1)], [1])
        load = subject.submit_load([key(9)], [2])  # loads are never refused
        assert first is not None and refused is None
        stats = subject.tier.statistics()
        assert stats.dropped_writes == 1 and stats.queued_jobs >= 1
        assert not rig.reported(first)
    assert (await rig.result(first)).success
    assert not (await rig.result(load)).success
    await asyncio.wait_for(subject.tier.drain(), REPORT_TIMEOUT_S)
    assert subject.tier.lookup([key(0), key(1)]) == [HIT, MISS]


async def check_drain_returns_once_every_job_reported(rig: Rig) -> None:
    subject = await rig.subject()
    subject.fill(0)
    assert (await subject.store([key(0)], [0])).success
    await asyncio.wait_for(subject.tier.drain(), REPORT_TIMEOUT_S)  # idle: at once
    async with rig.kit.stall(subject.tier):
        jobs = [subject.submit_store([key(1)], [0]), subject.submit_load([key(0)], [1])]
        draining = asyncio.ensure_future(subject.tier.drain())
        for _ in range(10):  # loop turns: whatever the tier could deliver, it has
            await asyncio.sleep(0)
        assert not draining.done(), "drain() returned while jobs were held"
    await asyncio.wait_for(draining, REPORT_TIMEOUT_S)
    assert all(job is not None and rig.reported(job) for job in jobs)


async def check_concurrent_jobs_each_report_once_on_the_loop(rig: Rig) -> None:
    subject = await rig.subject()
    keys = [key(i) for i in range(6)]
    data = [subject.fill(row) for row in range(6)]
    stores = [
        subject.submit_store(keys[0:2], [0, 1]),
        subject.submit_store(keys[2:4], [2, 3]),
        subject.submit_store(keys[4:6], [4, 5]),
        subject.submit_store([keys[1], keys[2]], [1, 2]),  # keys another job is writing
    ]
    await asyncio.wait_for(subject.tier.drain(), REPORT_TIMEOUT_S)
    assert all(job is not None and rig.reported(job) for job in stores), "drain returned early"
    assert all([(await rig.result(job)).success for job in stores if job is not None])
    loads = [
        subject.submit_load(keys[0:3], [6, 7, 8]),
        subject.submit_load(keys[3:6], [9, 10, 11]),
        subject.submit_load([keys[0]], [12]),  # a key another job is reading
    ]
    await asyncio.wait_for(subject.tier.drain(), REPORT_TIMEOUT_S)
    assert all([(await rig.result(job)).success for job in loads])
    assert [subject.read(row) for row in range(6, 12)] == data
    assert subject.read(12) == data[0]


async def check_a_pool_never_sees_another_pools_blocks(rig: Rig) -> None:
    first = await rig.subject("pool-a")
    second = await rig.subject("pool-b")
    ours = first.fill(0)
    assert (await first.store([key(0)], [0])).success
    assert second.tier.lookup([key(0)]) == [MISS] and second.tier.contains(key(0)) is False
    assert not (await second.load([key(0)], [1])).success
    theirs = second.fill(0)
    stored = await second.store([key(0)], [0])
    assert stored.success and stored.bytes_moved > 0  # written: not found in pool-a
    assert (await first.load([key(0)], [2])).success and first.read(2) == ours
    assert (await second.load([key(0)], [2])).success and second.read(2) == theirs
    assert first.tier.statistics().blocks == second.tier.statistics().blocks == 1


async def check_a_damaged_block_fails_and_is_dropped(rig: Rig) -> None:
    """For kits that can damage a stored copy (:attr:`TierKit.can_damage`)."""
    subject = await rig.subject()
    subject.fill(0)
    assert (await subject.store([key(0)], [0])).success
    rig.kit.damage(subject.tier, key(0))
    damaged = await subject.load([key(0)], [1])
    assert not damaged.success and damaged.successful_keys is None
    assert subject.tier.take_removed() == [key(0)]
    assert subject.tier.lookup([key(0)]) == [MISS]


CHECKS: tuple[Check, ...] = (
    check_victim_is_what_one_more_block_would_displace,
    check_ready_turns_true_once_launched_and_stays,
    check_store_then_load_returns_the_exact_bytes,
    check_storing_a_held_key_succeeds_without_rewriting,
    check_an_absent_key_fails_and_never_carries_other_bytes,
    check_capacity_holds_and_the_least_recently_used_goes_first,
    check_jobs_in_flight_at_shutdown_report_failed_once,
    check_a_refused_store_never_reports,
    check_drain_returns_once_every_job_reported,
    check_concurrent_jobs_each_report_once_on_the_loop,
    check_a_pool_never_sees_another_pools_blocks,
)
DAMAGE_CHECKS: tuple[Check, ...] = (check_a_damaged_block_fails_and_is_dropped,)
