"""The secondary-tier contract (docs/design/tiers.md; vLLM's ``tiering/base.py``).

A tier keeps copies of primary blocks somewhere else (files, process memory,
Redis). The pool's :class:`~kvtierd.tiering.manager.Tiering` drives it; the tier never
decides what the primary holds. Every implementation runs the contract suite
(``tests/tiers/``): what is written here is what that suite checks.

Threading
    Every method is called on the daemon's event loop and must not block (no
    file system or network call, no lock held for more than bookkeeping) --
    except :meth:`SecondaryTier.prepare`, which may block and runs off the loop.
    A tier does its I/O on its own threads or processes.

Completions
    A tier reports each job through the ``on_done`` callback it was constructed
    with: exactly once per job it accepted (every :meth:`~SecondaryTier.submit_load`,
    every :meth:`~SecondaryTier.submit_store` that returned True), success or
    not, on the event loop (from threads: ``loop.call_soon_threadsafe``), from a
    loop callback of its own -- never from inside a call into the tier, so a
    caller may register a job after submitting it. A refused store never
    reports. Jobs may report in any order.

What a report may say (:class:`JobResult`)
    ``success`` True: every key of the job made it (``successful_keys`` None or
    all of them). False: ``successful_keys`` lists, in job order, the keys that
    made it; None when none did. A load key *made it* only when the bytes in its
    row were verified to be the bytes stored under that key by this tier
    instance (this pool); an absent, evicted, damaged or unreadable block is a
    failed key, never a success with other bytes. A failed key's row may hold
    anything. A failed load key is classified by :mod:`kvtierd.tiers.failures`
    (missing, corrupt, transient, fault): only a corrupt block is removed from
    the tier for it, and the report names the missing and the transient ones.
    A store key made it when the tier holds the block (storing a key the tier
    holds or is writing already succeeds without rewriting it: keys name
    content). A store that failed transiently never removes a block file either.

Preconditions (guaranteed by the caller)
    A job's keys are distinct and non-empty; ``block_ids`` are rows of the
    pool's region, co-indexed with the keys. From submission until the job's
    ``on_done`` returns, the rows of a store job stay pinned (ref count > 0: the
    tier only reads them) and the rows of a load job stay reserved (ref count
    -1: only the tier writes them). A tier never touches a row after reporting
    its job. No job is submitted after :meth:`~SecondaryTier.shutdown`.

Lifecycle
    construct (no I/O) -> :meth:`~SecondaryTier.prepare` (off the loop: checks,
    probes; raises to refuse the pool) -> :meth:`~SecondaryTier.launch` (on the
    loop: starts the tier's threads and whatever makes it ready) -> jobs ->
    :meth:`~SecondaryTier.drain` (optional) -> :meth:`~SecondaryTier.shutdown`.
    :attr:`~SecondaryTier.ready` is False until the tier can answer from what it
    holds (e.g. an index rebuilt from disk), then True for good; until then
    lookups answer RETRY and :meth:`~SecondaryTier.contains` None. Jobs may be
    submitted once launched, ready or not.

Capacity and eviction
    ``used_bytes`` never exceeds ``capacity_bytes`` once a job has reported.
    To admit a store the tier evicts its least recently used blocks (a HIT
    lookup and :meth:`~SecondaryTier.touch` make a block recent;
    :meth:`~SecondaryTier.contains` does not); a block that finds no room fails.
    Every key the tier drops (evicted, failed verification, vanished) comes out
    of :meth:`~SecondaryTier.take_removed` once.

Remote presence
    A tier whose medium other daemons write (:attr:`SecondaryTier.remote`: the redis
    tier, a shared fs root) knows what it holds only by asking the medium. Its
    :meth:`~SecondaryTier.presence` says, from memory, per key: held, known absent,
    or unknown; :meth:`~SecondaryTier.ask` asks the medium about unknown keys at
    once and hands back futures that complete, on the loop, once the answers are in
    (or the asking failed): after that, :meth:`~SecondaryTier.lookup` answers from
    them. A Lookup waits on those futures for at most ``limits.remote_lookup_wait``
    (:mod:`kvtierd.tiering.remote`); the tier's own I/O never waits on the loop.

Isolation
    One instance serves one pool (its namespace and block size). What one
    instance stores is never found, loaded or evicted through another, even
    when both share a medium (one root directory, one Redis).

What the implementations share lives here too: the counters of :class:`TierStats`
(:data:`COUNTERS`, :func:`zero_counters`, :meth:`SecondaryTier.snapshot`), the
record of dropped keys (:class:`Removals`) and :meth:`SecondaryTier.drain` of a tier
whose jobs run on an :class:`~kvtierd.tiers.iopool.IoPool`.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvtierd.contract import BlockKey, LookupResult, Medium

if TYPE_CHECKING:
    from kvtierd.tiers.iopool import IoPool

_COUNTER = {"counter": True}  # the metadata of a cumulative counter of TierStats


@dataclass(frozen=True, slots=True)
class TierJob:
    """Move ``keys`` between the tier and primary rows ``block_ids`` (co-indexed)."""

    job_id: int
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    is_promotion: bool  # True: tier -> primary (load); False: primary -> tier (store)


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended. For a failed job, ``successful_keys`` lists the keys that
    made it (a promotion: rows filled and verified; a store: the tier holds the
    block now); None: none of them."""

    job_id: int
    success: bool
    successful_keys: tuple[BlockKey, ...] | None = None
    seconds: float = 0.0
    bytes_moved: int = 0
    # Of a promotion's failed keys (kvtierd.tiers.failures: one classification for
    # every tier), those the tier found simply absent (the server evicted the value,
    # another daemon removed the file): a plain MISS, tried again as soon as the tier
    # holds the key again;
    missing_keys: tuple[BlockKey, ...] = ()
    # those whose I/O could not be done now (an I/O worker timed out or died, a server
    # timeout): nothing removed, promoted again after a short retry window, and why
    # (a few words, the first such key's); the others (unreadable, corrupt, a fault)
    # are not promoted from this tier again for a while
    transient_keys: tuple[BlockKey, ...] = ()
    transient_cause: str = ""


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier instance at one instant. Counters are cumulative since construction;
    ``hits``/``misses`` count keys answered by :meth:`SecondaryTier.lookup` (not by
    :meth:`SecondaryTier.contains`, not while not ready)."""

    name: str
    medium: Medium
    capacity_bytes: int
    used_bytes: int  # <= capacity_bytes once a job has reported
    bytes_per_block: int  # what one block occupies on the tier (header included)
    blocks: int
    hits: int = field(metadata=_COUNTER)
    misses: int = field(metadata=_COUNTER)
    bytes_written: int = field(metadata=_COUNTER)
    bytes_read: int = field(metadata=_COUNTER)
    evictions: int = field(metadata=_COUNTER)
    store_failures: int = field(metadata=_COUNTER)  # keys
    load_failures: int = field(metadata=_COUNTER)  # keys
    checksum_failures: int = field(metadata=_COUNTER)
    dropped_writes: int = field(metadata=_COUNTER)  # cascade writes refused by backpressure (jobs)
    queued_jobs: int
    queued_bytes: int
    # A remote tier's server (0 for a tier without one), as of its last health check:
    nodes_known: int = 0  # masters it knows (1 for a standalone server)
    nodes_reachable: int = 0  # of them, those that answered
    round_trip_us: int = 0  # running average of small-command round trips
    server_capacity_bytes: int = 0  # maxmemory summed over masters; 0: unbounded
    server_used_bytes: int = 0  # used_memory summed over the reachable masters
    probe_failures: int = field(default=0, metadata=_COUNTER)  # presence probes (per node)
    # presence round trips made (a remote tier: one pipelined EXISTS per node; a
    # shared fs root: one batch of header checks), whatever asked them
    probes: int = field(default=0, metadata=_COUNTER)
    # a shared fs root (kvtierd.tiers.fs.shared); 0 for other tiers
    # files other daemons wrote, found and indexed
    foreign_files_found: int = field(default=0, metadata=_COUNTER)
    shared_rechecks: int = field(default=0, metadata=_COUNTER)  # keys looked for after a miss
    shared_rescans: int = field(default=0, metadata=_COUNTER)  # periodic rescans finished
    # indexed files someone else removed
    shared_files_vanished: int = field(default=0, metadata=_COUNTER)
    # values not sealed under the tier's integrity keys (kvtierd.tiers.integrity): written
    # without a key, under another key, or forged; refused (MISS) and removed
    integrity_failures: int = field(default=0, metadata=_COUNTER)


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(TierStats) if f.metadata.get("counter"))
"""The cumulative counters of :class:`TierStats`, in declaration order: what a tier
counts (:func:`zero_counters`) and hands whole to :meth:`SecondaryTier.snapshot`."""


def zero_counters() -> Counter[str]:
    """Every name of :data:`COUNTERS` at 0 (a tier counts what it does; the rest stay 0)."""
    return Counter(dict.fromkeys(COUNTERS, 0))


class Removals:
    """The keys a tier dropped (evicted, failed verification, vanished): each handed
    out once (:meth:`take`, what :meth:`SecondaryTier.take_removed` returns) and why the
    last ``kept`` keys were removed, and when (:meth:`of`, for
    :meth:`SecondaryTier.removals`).

    Invariant: at most ``kept`` keys are remembered, the oldest forgotten first; a
    key is remembered once, with its last removal. Not thread-safe: its owner guards
    it (the event loop, or the owner's lock).
    """

    def __init__(self, kept: int, clock: Callable[[], float] = time.time) -> None:
        """``clock``: unix seconds, when a removal is noted (the owner's, if it has one)."""
        self.kept = kept
        self._clock = clock
        self._dropped: list[BlockKey] = []  # since the last take(), oldest first
        self._why: OrderedDict[BlockKey, tuple[float, str]] = OrderedDict()  # oldest first

    def drop(self, key: BlockKey, why: str) -> None:
        """``key`` left the tier (``why``): one removed event owed, and remembered."""
        self._dropped.append(key)
        self.note(key, why)

    def dropped(self, key: BlockKey) -> None:
        """``key`` left the tier: one removed event owed (why: :meth:`note`)."""
        self._dropped.append(key)

    def note(self, key: BlockKey, why: str) -> None:
        """Remembers why ``key`` was removed, now (unix time)."""
        self._why[key] = (self._clock(), why)
        self._why.move_to_end(key)
        if len(self._why) > self.kept:
            self._why.popitem(last=False)

    def take(self) -> list[BlockKey]:
        """The keys dropped since the last call, oldest first."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def of(self, key: BlockKey) -> list[tuple[float, str]]:
        """``[(unix time, why)]`` of ``key``'s last removal, if it is remembered."""
        entry = self._why.get(key)
        return [entry] if entry is not None else []

    def __len__(self) -> int:
        """How many keys are remembered (at most ``kept``)."""
        return len(self._why)


JobCallback = Callable[[JobResult], None]

UNKNOWN_VICTIM = BlockKey(b"")
"""What :meth:`SecondaryTier.victim` answers when the tier cannot tell which block one
more would displace (no key is empty: this is never a block's key)."""


class SecondaryTier(abc.ABC):
    """One secondary tier bound to one pool (its namespace and block size).

    The module docstring is the contract; each method states its part of it.
    """

    name: str
    medium: Medium
    remote: bool = False
    """True when other daemons write the tier's medium (module doc, "Remote presence")."""
    _io: IoPool | None = None
    """The I/O threads the tier's jobs run on, once it has them (None: a tier that runs
    its jobs otherwise overrides :meth:`drain`)."""

    # -- lifecycle -----------------------------------------------------------------

    def prepare(self) -> None:  # noqa: B027 - optional step
        """Blocking set-up before :meth:`launch` (check the medium, probe it), run off
        the loop on any thread. Raises (naming what is wrong) to refuse the pool."""

    @abc.abstractmethod
    def launch(self) -> None:
        """Starts the tier's threads and what makes it :attr:`ready`; jobs may be
        submitted from now on. On the loop, after :meth:`prepare`; never blocks."""

    def start(self) -> None:
        """:meth:`prepare`, then :meth:`launch`, on the calling thread (tests, tools)."""
        self.prepare()
        self.launch()

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """True once the tier answers lookups from what it holds (HIT/MISS, never
        RETRY); False before. Turns True once, after :meth:`launch`, and stays True."""

    @abc.abstractmethod
    async def wait_ready(self) -> None:
        """Returns once :attr:`ready` is True. Only after :meth:`launch`."""

    async def drain(self) -> None:
        """Returns once every job submitted so far has reported (its ``on_done`` ran).
        Default: once the tier's I/O pool (:attr:`_io`) delivered every batch it took,
        those of the other pools sharing it included."""
        if self._io is not None:
            await self._io.drain()

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the tier's own work: a job not started yet reports failed (none of
        its keys made it), a job running may still finish either way; every job
        submitted still reports exactly once, possibly after this returns. Bounded
        (a stuck thread is left behind, never waited for without end); idempotent.
        Threads shared by the pools of one configured tier are stopped by their
        owner, after every pool's tier has shut down."""

    # -- lookups (from memory, never block) ------------------------------------------

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        """Per key: HIT (held; the key becomes most recently used), MISS, or RETRY
        while not :attr:`ready` (every key). Counted in ``hits``/``misses``."""

    def contains(self, key: BlockKey) -> bool | None:
        """Whether the tier holds ``key`` now, without touching it or counting a
        lookup; None while not :attr:`ready` (for ``Explain``)."""
        return None

    def presence(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """Per key, from memory, changing nothing (no recency, no counter, no probe):
        True when a :meth:`lookup` would answer HIT, False when the tier knows it
        does not hold it, None when only asking the medium can tell (or while not
        :attr:`ready`). A local tier knows what it holds: :meth:`contains`."""
        return [self.contains(key) for key in keys]

    def victim(self) -> BlockKey | None:
        """The held key one more block of this pool would displace now, from memory
        and O(1): None when one more fits without an eviction, :data:`UNKNOWN_VICTIM`
        when the tier cannot tell (admission, :mod:`kvtierd.tiering.admission`).
        Changes nothing. Default: cannot tell."""
        return UNKNOWN_VICTIM

    def ask(self, keys: Sequence[BlockKey]) -> list[asyncio.Future[None]]:
        """Asks the medium now about ``keys`` (some :meth:`presence` answered None
        for), joining what is already being asked; returns futures that complete on
        the loop once every key's answer is in, or its asking failed (then the key
        stays unknown: MISS). Never blocks, never raises for a fault of the medium;
        a key the tier cannot ask now (its queue full, shut down) gets no future.
        Only a :attr:`remote` tier asks anything."""
        return []

    def touch(self, keys: Sequence[BlockKey]) -> None:  # noqa: B027 - optional hook
        """Makes the held ``keys`` most recently used, in order (the last one is the
        most recent); unknown keys are ignored."""

    def take_removed(self) -> list[BlockKey]:
        """Keys this tier dropped since the last call (evicted, failed verification,
        vanished), oldest first, each drop once; the caller turns them into removed
        events. Called on the loop after each job report, so a store job's
        evictions come out before that job's stored keys."""
        return []

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        """Recent ``(unix time, why)`` removals of ``key`` from this tier (bounded)."""
        return []

    # -- jobs ----------------------------------------------------------------------

    @abc.abstractmethod
    def submit_store(self, job: TierJob) -> bool:
        """Queues a copy of the job's rows into the tier. False: refused by
        backpressure (nothing queued, counted in ``dropped_writes``, ``on_done``
        will not be called, the caller releases its pins at once)."""

    @abc.abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Queues a copy into the job's rows; each block is verified (key, pool,
        length, content) before it counts as loaded. Never refused."""

    @abc.abstractmethod
    def statistics(self) -> TierStats:
        """A snapshot (:class:`TierStats`)."""

    def snapshot(self, counters: Mapping[str, int], **gauges: Any) -> TierStats:
        """The :class:`TierStats` of this tier: ``counters`` (every name of
        :data:`COUNTERS`) and ``gauges`` (capacity, usage, queues, the server's health);
        a gauge named like a counter replaces it (a count kept elsewhere, such as the
        probes of a prober the pools of a configured tier share)."""
        return TierStats(name=self.name, medium=self.medium, **{**counters, **gauges})
