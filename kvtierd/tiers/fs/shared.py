"""A shared fs root (``shared = true``): the files other daemons write and remove.

Several daemons (one host, or hosts over NFS-like shared storage) use one root.
Each keeps its own in-memory index (:class:`~kvtierd.tiers.fs.index.BlockIndex`);
this module keeps it in step with the disk, on one thread per pool's tier
(``kvtierd-fs-shared``), never on the event loop:

* **Local misses.** A lookup that misses the index answers MISS at once; the
  tier hands the missed keys to :meth:`SharedRoot.want`, which queues them
  (at most :data:`MAX_WANTED`; more are not queued and answer MISS until a
  later lookup queues them) unless the negative cache says the key was found
  missing less than ``negative_ttl`` seconds ago. The thread checks queued keys
  in batches: open without following links or blocking, ``fstat``, the one
  header check the start-up scan makes; a file that passes joins the index
  (most recently used) and the next lookup answers HIT. A key found missing
  enters the negative cache (at most :data:`MAX_ABSENT` keys, oldest first out).
  A Lookup may wait for the check of its keys (``limits.remote_lookup_wait``):
  :meth:`SharedRoot.want` takes a callback, called (from the thread) once every
  key it queued, or found queued or being checked, has been checked.
* **Rescans.** Every ``rescan_interval`` seconds the thread walks the pool
  directory (directory entries only: ``d_type``, no ``stat`` of known files):
  indexed files that are gone leave the index (:meth:`BlockIndex.drop_absent`),
  unknown block files are header-checked and adopted, the pool directories no
  pool of this daemon serves are recounted (:mod:`~kvtierd.tiers.fs.unserved`),
  then the index evicts its least recently used files -- whoever wrote them --
  until the budget is within the capacity. The budget thus counts every block
  file under the root, this daemon's writes in flight included.
* **Never read partial files.** Only ``*.kvb`` names are considered; a writer
  publishes a complete file by ``rename`` from a ``*.tmp`` name, and temp
  names are skipped here (the start-up scan of a shared root removes only temp
  files older than :data:`~kvtierd.tiers.fs.scan.SHARED_TEMP_MAX_AGE_S`).
  The payload is verified (xxh3, or the MAC with integrity keys) at every
  promotion, as for any fs tier.
* **Keyed integrity.** Any host that can write the root can write a file with a
  valid header. With ``integrity_key_file`` a file is adopted only if sealed
  under one of the tier's key ids, and served only if its MAC verifies
  (docs/security.md, "Keyed integrity of shared tiers").

A file that fails its header check is removed if the path still names it
(as the start-up scan does), counted in ``checksum_failures`` (or
``integrity_failures``: not sealed under the tier's keys), logged
(rate-limited) and the key negative-cached.

Locking: ``SharedRoot._lock`` guards ``_wanted``, ``_checking``, ``_absent``,
``_waiters`` and ``_stopping``;
it is held only for dictionary work, never across file system calls, and
never together with the index's lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvtierd.contract import BlockKey
from kvtierd.tiers.blockformat import CorruptBlock, check_sealing
from kvtierd.tiers.fs import blockfile, fsformat, safefs
from kvtierd.tiers.fs.fsformat import BLOCK_SUFFIX
from kvtierd.tiers.fs.index import IndexedPool, TierFull
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry
from kvtierd.tiers.fs.settings import FsTierSettings
from kvtierd.tiers.fs.unserved import UnservedPools
from kvtierd.util.filekind import REGULAR
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

PROBE_BATCH = 256  # keys checked per batch (one PoolDir open)
MAX_WANTED = 16384  # keys waiting for a check (~4 MiB at 256-byte keys); more: not queued
MAX_ABSENT = 32768  # negative-cache entries (~10 MiB at 256-byte keys), oldest evicted first
JOIN_S = 2.0  # shutdown waits this long for a thread stuck in the file system
FAULT_LOG_INTERVAL_S = 10.0


class _Waiter:
    """Keys a Lookup waits for and how to tell it (``notify``: any thread)."""

    __slots__ = ("keys", "notify")

    def __init__(self, keys: set[BlockKey], notify: Callable[[], None]) -> None:
        self.keys = keys
        self.notify = notify


class SharedRoot:
    """Keeps one pool's index in step with a root other daemons write to (module
    docstring). :meth:`start` once the start-up scan ended; :meth:`stop` any time.

    ``want`` runs on the event loop; everything else on the thread.
    """

    def __init__(
        self, pool: IndexedPool, settings: FsTierSettings, unserved: UnservedPools | None = None
    ) -> None:
        """``settings``: the tier's (``shared_negative_ttl``, ``shared_rescan_interval``);
        ``unserved``: the root's pool directories no pool of this daemon serves."""
        self.pool = pool
        self.negative_ttl = settings.shared_negative_ttl
        self.rescan_interval = settings.shared_rescan_interval
        self._unserved = unserved
        self._faults = RateLimitedLog(log, FAULT_LOG_INTERVAL_S)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Guarded by _lock. Keys a lookup missed, waiting for a check, oldest first.
        self._wanted: OrderedDict[BlockKey, None] = OrderedDict()
        # Guarded by _lock. Keys of the batch being checked (taken from _wanted, not
        # yet answered into the index or _absent): a lookup meanwhile queues none again.
        self._checking: set[BlockKey] = set()
        # key -> monotonic time until which it answers MISS unchecked; insertion
        # order is expiry order (one ttl for all), so the oldest is first.
        self._absent: OrderedDict[BlockKey, float] = OrderedDict()
        # Guarded by _lock. Lookups waiting for the check of some queued keys: at most
        # one per Lookup that waits (each holds keys of _wanted and _checking only)
        self._waiters: list[_Waiter] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- event loop ------------------------------------------------------------------

    def want(self, keys: Iterable[BlockKey], on_checked: Callable[[], None] | None = None) -> int:
        """Queues keys the index missed for a check of the disk, except those the
        negative cache still holds or already queued; returns how many it queued.
        ``on_checked``: called from the thread once every key queued here, or found
        queued or being checked, was checked (at once here when there is none).
        Never blocks on the file system (a dictionary update under a short lock)."""
        now = time.monotonic()
        queued = 0
        waited: set[BlockKey] = set()
        with self._lock:
            if self._stopping:
                return 0
            for key in keys:
                until = self._absent.get(key)
                if until is not None:
                    if until > now:
                        continue
                    del self._absent[key]
                if key in self._wanted or key in self._checking:
                    waited.add(key)
                    continue
                if len(self._wanted) >= MAX_WANTED:
                    break
                self._wanted[key] = None
                waited.add(key)
                queued += 1
            if queued:
                self._wake.notify()
            if on_checked is not None and waited:
                self._waiters.append(_Waiter(waited, on_checked))
                on_checked = None
        if on_checked is not None:
            on_checked()  # nothing to check: answered already
        return queued

    def unknown(self, key: BlockKey) -> bool:
        """Whether ``key`` (not in the index) may still be on disk: not found missing
        within ``negative_ttl`` (loop; a short lock)."""
        with self._lock:
            until = self._absent.get(key)
        return until is None or until <= time.monotonic()

    def _checked_batch(self, batch: list[BlockKey]) -> None:
        """The keys of ``batch`` are answered: the waiters they complete are told."""
        done: list[_Waiter] = []
        with self._lock:
            self._checking.difference_update(batch)
            if self._waiters:
                for waiter in self._waiters:
                    waiter.keys.difference_update(batch)
                done = [waiter for waiter in self._waiters if not waiter.keys]
                self._waiters = [waiter for waiter in self._waiters if waiter.keys]
        for waiter in done:
            waiter.notify()

    def _release_waiters(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.notify()

    # -- lifecycle (any thread) --------------------------------------------------------

    def start(self) -> None:
        """Starts the thread (once; not after :meth:`stop`)."""
        with self._lock:
            if self._stopping or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="kvtierd-fs-shared", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread after its current file system call (waits at most :data:`JOIN_S`)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._release_waiters()  # they answer from what is known (MISS)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_S)
            if thread.is_alive():
                log.warning("FS tier %s: the shared-root thread of %s did not stop within "
                            "%gs (file system not answering?); leaving it behind",
                            self.pool.tier_name, self.pool.pool_dir, JOIN_S)  # fmt: skip

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        if self._unserved is not None:  # other pools' bytes in the budget from the start
            self._unserved.recount_if_due()
            self._evict_to_capacity()
        next_rescan = time.monotonic() + self.rescan_interval
        while True:
            with self._lock:
                while not self._stopping and not self._wanted:
                    left = next_rescan - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if self._stopping:
                    return
                batch: list[BlockKey] = []
                while self._wanted and len(batch) < PROBE_BATCH:
                    batch.append(self._wanted.popitem(last=False)[0])
                self._checking.update(batch)
            try:
                if batch:
                    try:
                        self._check_keys(batch)
                    finally:
                        self._checked_batch(batch)
                if time.monotonic() >= next_rescan:
                    self.rescan()
                    next_rescan = time.monotonic() + self.rescan_interval
            except Exception as exc:  # keep serving: the next batch or rescan tries again
                self._fault("bug", "shared-root check of %s failed: %r", self.pool.pool_dir, exc)
                next_rescan = time.monotonic() + self.rescan_interval
                time.sleep(min(1.0, self.rescan_interval))

    def _check_keys(self, keys: list[BlockKey]) -> None:
        """Looks for each key's file on disk: adopted when it checks out, negative-cached
        when missing or bad."""
        absent: list[BlockKey] = []
        adopted = 0
        self.pool.index.count("probes")
        try:
            pool = PoolDir(self.pool.pool_dir)
        except (OSError, UnexpectedEntry) as exc:
            self._fault("pool-dir", "cannot open %s: %s", self.pool.pool_dir, exc)
            self._remember_absent(keys)
            return
        with pool:
            for key in keys:
                if self.pool.index.contains(key):  # written here meanwhile
                    continue
                self.pool.index.count("shared_rechecks")
                found = self._checked(pool, fsformat.block_rel_path(key))
                if found is not None and found[0] == key:
                    adopted += self.pool.index.adopt(key, found[1])
                else:
                    absent.append(key)
        self._remember_absent(absent)
        if adopted:
            self._evict_to_capacity()

    def _checked(self, pool: PoolDir, rel: str) -> tuple[BlockKey, int] | None:
        """``(key, file bytes)`` of the block file at ``rel`` if it is a regular file
        whose header checks out; None when missing, bad or unreadable (a bad file
        is removed if the path still names it, counted and logged)."""
        identity: safefs.Identity | None = None
        try:
            fd, st = pool.open_file(rel)
            identity = safefs.identity_of(st)
            try:
                header = blockfile.check_header(
                    fd, st, rel, self.pool.fingerprint, self.pool.block_bytes
                )
                check_sealing(header, self.pool.keys)
            finally:
                os.close(fd)
            return header.key, st.st_size
        except FileNotFoundError:
            return None
        except UnexpectedEntry as exc:
            self._bad(pool, rel, str(exc), exc.identity if exc.removable else None)
        except CorruptBlock as exc:
            self._bad(pool, rel, str(exc), identity, exc.integrity)
        except OSError as exc:  # transient (EIO, ESTALE...): looked for again later
            self._fault("read", "cannot check %s: %s", pool.full(rel), exc)
        return None

    def _bad(
        self, pool: PoolDir, rel: str, reason: str, identity: safefs.Identity | None,
        integrity: bool = False,
    ) -> None:  # fmt: skip
        self.pool.index.count("integrity_failures" if integrity else "checksum_failures")
        action = "removing it" if identity is not None else "leaving it there"
        self._fault("bad", "bad block file %s in a shared root: %s; %s", pool.full(rel), reason,
                    action)  # fmt: skip
        if identity is not None:
            try:
                pool.unlink_if_same(rel, identity)
            except (OSError, UnexpectedEntry) as exc:
                self._fault("remove", "cannot remove %s: %s", pool.full(rel), exc)

    def rescan(self) -> None:
        """Walks the pool directory once: files gone leave the index, files other
        daemons wrote join it, then the index evicts down to the capacity. On the
        thread (tests call it directly)."""
        since = self.pool.index.clock()  # the clock of the last uses it is compared with
        known = {fsformat.block_rel_path(key): key for key in self.pool.index.known_keys()}
        present: set[str] = set()
        unknown: list[str] = []
        try:
            pool = PoolDir(self.pool.pool_dir)
        except (OSError, UnexpectedEntry) as exc:
            self._fault("pool-dir", "cannot open %s: %s", self.pool.pool_dir, exc)
            return
        with pool:
            for entry in pool.walk(self._walk_error):
                if self._stopping:
                    return
                if entry.kind != REGULAR or not entry.name.endswith(BLOCK_SUFFIX):
                    continue  # temp files (writes in flight), pool.json, oddities
                present.add(entry.rel)
                if entry.rel not in known:
                    unknown.append(entry.rel)
            self.pool.index.drop_absent(
                [key for rel, key in known.items() if rel not in present], since
            )
            for rel in unknown:
                if self._stopping:
                    return
                self._adopt_unknown(pool, rel)
        if self._unserved is not None:
            self._unserved.recount_if_due()
        self.pool.index.count("shared_rescans")
        self._evict_to_capacity()

    def _adopt_unknown(self, pool: PoolDir, rel: str) -> None:
        """Header-checks a block file the index does not know and adopts it."""
        found = self._checked(pool, rel)
        if found is not None and self.pool.index.adopt(*found):
            self._forget_absent(found[0])

    # -- helpers ---------------------------------------------------------------------

    def _remember_absent(self, keys: list[BlockKey]) -> None:
        if not keys:
            return
        until = time.monotonic() + self.negative_ttl
        with self._lock:
            for key in keys:
                self._absent.pop(key, None)
                self._absent[key] = until
            while len(self._absent) > MAX_ABSENT:
                self._absent.popitem(last=False)

    def _forget_absent(self, key: BlockKey) -> None:
        with self._lock:
            self._absent.pop(key, None)

    def _evict_to_capacity(self) -> None:
        try:
            self.pool.index.evict_to_capacity()
        except TierFull:
            self._fault("full", "over capacity in a shared root and nothing of this pool "
                        "evictable (reads in flight)")  # fmt: skip

    def _walk_error(self, path: str, exc: BaseException) -> None:
        self._fault("walk", "not rescanning %s: %s", path, exc)

    def _fault(self, kind: str, msg: str, *args: object) -> None:
        self._faults.log(logging.WARNING, (self.pool.tier_name, kind),
                         f"FS tier %s: {msg}", self.pool.tier_name, *args)  # fmt: skip
