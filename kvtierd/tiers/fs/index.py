"""What one pool's fs tier holds, and the bytes it may hold.

:class:`BlockIndex` owns every piece of per-key state of one pool's tier (the
index in LRU order, the writes, reads and evictions in flight, the recent
removals) and the one lock that guards them, plus the tier's counters.
:class:`DiskBudget` is the byte capacity the pools of one configured tier share.

Lock discipline: ``BlockIndex._lock`` is taken by the event loop (every Lookup)
and by the I/O and scan threads, each time only briefly. No file system call
happens under it, with one exception: removing a file that failed verification
(:meth:`BlockIndex.drop_corrupt`, rare), so that a fresh file of the key
written meanwhile is never dropped. An eviction takes its victim out of the
index under the lock, and the file is removed outside it (``remove_evicted``).
Lock order: ``BlockIndex._lock`` then ``DiskBudget._lock``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvtierd.contract import BlockKey, LookupResult
from kvtierd.tiers.base import UNKNOWN_VICTIM, Removals, zero_counters
from kvtierd.tiers.integrity import KeyRing

# Recent removals remembered for Explain, per pool: an entry takes at most ~450
# bytes (a 256-byte key, its (time, why) tuple, the OrderedDict node): ~7 MiB.
REMOVALS_KEPT = 16384
EVICTING_WAIT_S = 0.001  # a writer of a key whose old file is being evicted polls this often


class TierFull(Exception):
    """No file could be evicted to make room for a write."""


class DiskBudget:
    """The byte capacity of one configured FS tier, shared by its pools.

    ``charged`` is the sum of every indexed file, every write in flight and
    every evicted file not yet unlinked, of every pool attached to it, plus (a
    shared root only) the bytes of the root's pool directories no attached pool
    serves, as last counted (:meth:`set_unserved`; no pool here can evict them).
    Thread-safe; held only for arithmetic.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._charged = 0  # _lock; Invariant: >= _unserved >= 0
        self._unserved = 0  # _lock; the part of _charged set by set_unserved

    @property
    def charged(self) -> int:
        with self._lock:
            return self._charged

    def try_charge(self, nbytes: int) -> bool:
        """Charges ``nbytes`` if they fit under the capacity; False (nothing charged) if not."""
        with self._lock:
            if self._charged + nbytes > self.capacity_bytes:
                return False
            self._charged += nbytes
            return True

    def charge(self, nbytes: int) -> None:
        """Charges bytes that exist already (files found by a scan); may overshoot."""
        with self._lock:
            self._charged += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._charged -= nbytes
            if self._charged < self._unserved:
                raise AssertionError("disk budget released more than it charged")

    def set_unserved(self, nbytes: int) -> None:
        """Replaces the charge of the pool directories no attached pool serves."""
        with self._lock:
            self._charged += nbytes - self._unserved
            self._unserved = nbytes

    @property
    def unserved(self) -> int:
        with self._lock:
            return self._unserved

    @property
    def over(self) -> bool:
        with self._lock:
            return self._charged > self.capacity_bytes


@dataclass(frozen=True, slots=True)
class IndexStatistics:
    """A consistent snapshot of one :class:`BlockIndex` (taken under its lock)."""

    blocks: int
    used_bytes: int  # bytes of indexed files
    reserved_bytes: int  # bytes of writes in flight
    writing: int  # keys being written
    reading: int  # keys being read
    evicting: int  # keys whose evicted file is being removed
    counters: dict[str, int]  # every name of kvtierd.tiers.base.COUNTERS


@dataclass(frozen=True, slots=True)
class Doomed:
    """An evicted key whose file is still to be removed, and its charged bytes."""

    key: BlockKey
    nbytes: int


class BlockIndex:
    """The per-key state of one pool's fs tier and the lock guarding it.

    Thread-safe: the event loop, the I/O threads and the scan thread call it.
    ``remove_evicted(key)`` removes an evicted key's file; it is called without
    the lock held and must not raise. ``clock``: unix seconds, the keys' last uses
    and removals; a shared root's rescan takes its start from it too (``since`` of
    :meth:`drop_absent`).
    """

    def __init__(
        self,
        tier_name: str,
        file_bytes: int,
        budget: DiskBudget,
        remove_evicted: Callable[[BlockKey], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.tier_name = tier_name
        self.file_bytes = file_bytes  # every block file has this size
        self.budget = budget
        self._remove_evicted = remove_evicted
        self._lock = threading.Lock()
        # Every field below is guarded by _lock.
        # key -> (file bytes, last use, unix time), least recently used first.
        # Invariant: _used == sum of the sizes in _entries; every byte of _used
        # and of _reserved is charged to the budget.
        self._entries: OrderedDict[BlockKey, tuple[int, float]] = OrderedDict()
        self._used = 0
        # Keys this tier is writing. Invariant: _reserved == len(_writing) * file_bytes.
        self._writing: set[BlockKey] = set()
        self._reserved = 0
        # Keys out of _entries whose file is being renamed aside and unlinked; their
        # bytes stay charged until it is gone. A writer of such a key waits.
        self._evicting: set[BlockKey] = set()
        # Reads in flight per key (values >= 1); eviction spares these keys' files.
        self._reading: dict[BlockKey, int] = {}
        # Keys that left _entries since take_removed(), and why the last REMOVALS_KEPT
        # keys were removed (a key is remembered even if it was not indexed).
        self._removals = Removals(REMOVALS_KEPT, clock)
        # TierStats' counters (the shared-root ones stay 0 unless shared = true); only grow
        self._counters = zero_counters()
        self._scanned = False  # set once, when the start-up scan merged its files

    # -- answers (loop thread) -------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once the start-up scan merged its files (lookups answer HIT/MISS)."""
        with self._lock:
            return self._scanned

    def lookup(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        """HIT (and touched) or MISS per key, counted; all RETRY before the scan ended."""
        with self._lock:
            if not self._scanned:
                return [LookupResult.RETRY] * len(keys)
            now = self.clock()
            results = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    results.append(LookupResult.MISS)
                    continue
                self._entries[key] = (entry[0], now)
                self._entries.move_to_end(key)
                results.append(LookupResult.HIT)
            hits = results.count(LookupResult.HIT)
            self._counters["hits"] += hits
            self._counters["misses"] += len(keys) - hits
            return results

    def touch(self, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            self._touch_locked(keys)

    def contains(self, key: BlockKey) -> bool | None:
        with self._lock:
            return key in self._entries if self._scanned else None

    def victim(self) -> BlockKey | None:
        """The key one more file of this pool would evict now (its least recently used
        not being read), None when one more fits under the budget, UNKNOWN_VICTIM when
        this pool has nothing to evict (the other pools hold the bytes). O(1) but for
        the keys being read, skipped."""
        with self._lock:
            if self.budget.charged + self.file_bytes <= self.budget.capacity_bytes:
                return None
            return next((k for k in self._entries if k not in self._reading), UNKNOWN_VICTIM)

    def removals(self, key: BlockKey) -> list[tuple[float, str]]:
        with self._lock:
            return self._removals.of(key)

    def take_removed(self) -> list[BlockKey]:
        with self._lock:
            return self._removals.take()

    def count(self, counter: str, n: int = 1) -> None:
        """Adds ``n`` to one of :data:`~kvtierd.tiers.base.COUNTERS`."""
        with self._lock:
            self._counters[counter] += n

    def statistics(self) -> IndexStatistics:
        with self._lock:
            return IndexStatistics(
                blocks=len(self._entries),
                used_bytes=self._used,
                reserved_bytes=self._reserved,
                writing=len(self._writing),
                reading=len(self._reading),
                evicting=len(self._evicting),
                counters=dict(self._counters),
            )

    def check_invariants(self) -> None:
        """Raises AssertionError if a documented invariant does not hold (tests)."""
        with self._lock:
            used = sum(size for size, _ in self._entries.values())
            assert self._used == used, f"used {self._used} != indexed {used}"
            assert self._reserved == len(self._writing) * self.file_bytes, (
                f"reserved {self._reserved} for {len(self._writing)} writes"
            )
            assert all(n >= 1 for n in self._reading.values()), "a read count below 1"
            assert len(self._removals) <= REMOVALS_KEPT, "removal history over its bound"

    # -- writes (I/O threads) --------------------------------------------------------

    def reserve_write(self, key: BlockKey) -> bool:
        """Charges one file's bytes for writing ``key`` (evicting this pool's least
        recently used files until they fit) and marks the key as being written;
        False if the key is present or being written already (then it is touched
        instead). Raises TierFull when nothing of this pool can be evicted.

        Victims are taken out of the index under the lock; their files are removed
        after it is released: unlinking a large file can take milliseconds
        (page cache, writeback), and the lock is shared with the event loop.
        """
        while True:
            with self._lock:
                evicting = key in self._evicting
                if not evicting:
                    if key in self._entries or key in self._writing:
                        self._touch_locked((key,))
                        return False
                    if self.budget.try_charge(self.file_bytes):
                        self._writing.add(key)  # writing: absent -> reserved
                        self._reserved += self.file_bytes
                        return True
                    doomed = self._doom_lru_locked(self.file_bytes)
            if evicting:  # its old file is being moved aside: a few ms, I/O thread only
                time.sleep(EVICTING_WAIT_S)
                continue
            self._evict(doomed)

    def end_writes(self, keys: Sequence[BlockKey], written: Sequence[bool]) -> None:
        """Ends the write reservations of ``keys``; those ``written`` are indexed now."""
        now = self.clock()
        with self._lock:
            for key, done in zip(keys, written, strict=True):
                self._end_write_locked(key)
                if done:
                    self._add_locked(key, self.file_bytes, now)
                    self._counters["bytes_written"] += self.file_bytes

    # -- reads (I/O threads) ---------------------------------------------------------

    def begin_reads(self, keys: Sequence[BlockKey]) -> None:
        """Marks ``keys`` as being read: eviction spares their files until :meth:`end_reads`."""
        with self._lock:
            for key in keys:
                self._reading[key] = self._reading.get(key, 0) + 1

    def end_reads(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                left = self._reading[key] - 1
                if left:
                    self._reading[key] = left
                else:
                    del self._reading[key]

    def loaded(self, keys: Sequence[BlockKey]) -> None:
        """Counts and touches the keys a load job read and verified."""
        with self._lock:
            self._counters["bytes_read"] += len(keys) * self.file_bytes
            self._touch_locked(keys)

    def drop_vanished(self, key: BlockKey) -> None:
        """``key``'s file is gone (removed outside the daemon): out of the index."""
        with self._lock:
            if key in self._entries:
                self._counters["shared_files_vanished"] += 1
            self._remove_locked(key, "file vanished (removed outside the daemon)")

    # -- shared roots (the shared-root thread) -------------------------------------------

    def adopt(self, key: BlockKey, size: int) -> bool:
        """Indexes a file another daemon wrote (its header checked by the caller) as
        the most recently used, and charges it to the budget (which may overshoot:
        the file exists; :meth:`evict_to_capacity` follows). False, and nothing
        changes, when the key is indexed, being written or being evicted here."""
        with self._lock:
            if key in self._entries or key in self._writing or key in self._evicting:
                return False
            self._add_locked(key, size, self.clock())
            self._counters["foreign_files_found"] += 1
            return True

    def known_keys(self) -> list[BlockKey]:
        """Every key indexed, being written or being evicted (a rescan's starting point)."""
        with self._lock:
            return [*self._entries, *self._writing, *self._evicting]

    def drop_absent(self, keys: Iterable[BlockKey], since: float) -> int:
        """Drops indexed ``keys`` whose files a rescan that began at unix time ``since``
        did not find, unless used (looked up, written, loaded) since then or being
        read; returns how many left the index. Files written after the rescan
        passed their directory are spared by their last use."""
        dropped = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry[1] >= since or key in self._reading:
                    continue
                self._remove_locked(key, "file removed by another daemon (shared rescan)")
                dropped += 1
            self._counters["shared_files_vanished"] += dropped
        return dropped

    def drop_corrupt(
        self, key: BlockKey, reason: str, replaced: Callable[[], bool], integrity: bool = False
    ) -> None:
        """Counts a file of ``key`` that failed verification (``integrity``: the keyed
        check) and drops the key from the index, unless ``replaced()`` (called under
        the lock: it removes the bad file and says whether a fresh file of the key
        took its path meanwhile)."""
        with self._lock:
            self._counters["integrity_failures" if integrity else "checksum_failures"] += 1
            if replaced():
                return  # a fresh file of the key replaced the bad one: keep it
            self._remove_locked(key, f"file failed verification ({reason}); dropped")

    # -- start-up scan (scan thread) ---------------------------------------------------

    def merge_scanned(self, found: Sequence[tuple[float, BlockKey, int]]) -> int:
        """Indexes the files the scan ``found`` (mtime, key, size), under the blocks
        written meanwhile (more recent), and charges them to the budget; returns
        how many blocks are indexed then."""
        ordered = sorted(found, key=lambda entry: entry[0])
        with self._lock:
            during, self._entries = self._entries, OrderedDict()
            self.budget.release(self._used)
            self._used = 0
            for mtime, key, size in ordered:
                if key not in during:
                    self._add_locked(key, size, mtime)
            for key, (size, last_use) in during.items():
                self._add_locked(key, size, last_use)
            return len(self._entries)

    def evict_to_capacity(self) -> None:
        """Evicts this pool's LRU files until the shared budget is within capacity
        (after the scan charged the files it found); TierFull if it cannot."""
        while True:
            with self._lock:
                if not self.budget.over:
                    return
                doomed = self._doom_lru_locked(0)
            self._evict(doomed)

    def mark_scanned(self) -> None:
        """Lookups answer HIT/MISS from now on."""
        with self._lock:
            self._scanned = True

    # -- helpers (caller holds _lock, unless said otherwise) -----------------------------

    def _touch_locked(self, keys: Iterable[BlockKey]) -> None:
        now = self.clock()
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries[key] = (entry[0], now)
                self._entries.move_to_end(key)

    def _end_write_locked(self, key: BlockKey) -> None:
        self._writing.discard(key)  # writing: reserved -> ended
        self._reserved -= self.file_bytes
        self.budget.release(self.file_bytes)

    def _add_locked(self, key: BlockKey, size: int, last_use: float) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= old[0]
            self.budget.release(old[0])
        self._entries[key] = (size, last_use)
        self._used += size
        self.budget.charge(size)

    def _remove_locked(self, key: BlockKey, why: str) -> None:
        """Drops ``key`` from the index and uncharges its file (which is gone), and
        records why (for Explain; also when the key was not indexed)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._used -= old[0]
            self.budget.release(old[0])
            self._removals.dropped(key)
        self._removals.note(key, why)

    def _doom_lru_locked(self, size: int) -> Doomed:
        """Takes this pool's least recently used file that is not being read out of
        the index and marks it as being evicted; :meth:`_evict` (outside the lock)
        removes the file. Its bytes stay charged to the budget until then, so the
        bytes on disk never exceed the capacity. Raises TierFull when nothing of
        this pool can be evicted (``size``: what the caller wanted room for)."""
        victim = next((k for k in self._entries if k not in self._reading), None)
        if victim is None:
            raise TierFull(
                f"FS tier {self.tier_name}: {size} bytes do not fit in "
                f"{self.budget.capacity_bytes} ({self.budget.charged} used or being written "
                "by the pools of this tier) and nothing of this pool is evictable"
            )
        nbytes, _ = self._entries.pop(victim)
        self._used -= nbytes
        self._removals.drop(victim, "evicted: least recently used at capacity")
        self._counters["evictions"] += 1
        self._evicting.add(victim)  # evicting: indexed -> file being removed
        return Doomed(victim, nbytes)

    def _evict(self, doomed: Doomed) -> None:
        """Removes the victim's file (without the lock), then ends its eviction and
        uncharges it. A crash in between leaves a temp file, removed at the next start."""
        try:
            self._remove_evicted(doomed.key)
        finally:
            with self._lock:
                self._evicting.discard(doomed.key)  # evicting: file gone -> absent
            self.budget.release(doomed.nbytes)


@dataclass(frozen=True, slots=True)
class IndexedPool:
    """One pool's directory and its index, as the threads that read block headers off
    disk and index what they find see it (the start-up scan, a shared root's checks):
    files of ``fingerprint`` and ``block_bytes`` under ``pool_dir``, sealed under
    ``keys`` (the tier's integrity keys; None: unkeyed files only), go into ``index``."""

    tier_name: str
    pool_dir: str
    fingerprint: bytes
    block_bytes: int
    index: BlockIndex
    keys: KeyRing | None = None
