"""The start-up scan: one pool's index rebuilt from its block files' headers.

Runs on its own thread while the tier already takes jobs (lookups answer
RETRY until it ends). Invariants:

* It always ends, and then the index is ready: nothing below the pool
  directory is followed through a symlink or opened in a way that can block,
  and an error ends the scan with a partial index (logged).
* A block file is indexed only if its header passes the one header check
  shared with ``fsck`` (:func:`~kvtierd.tiers.fs.blockfile.check_header`); the
  payload is checked when the block is loaded. A tier with integrity keys
  indexes only files sealed under one of them
  (:func:`~kvtierd.tiers.blockformat.check_sealing`; the MAC is checked at
  load). A file that fails is removed (if the path still names it), counted in
  ``checksum_failures`` (``integrity_failures`` for the keyed check) and logged
  (rate-limited: :mod:`.corruptlog`);
  something other than a regular file is removed too, unless a directory.
* Leftover temp files (a crash mid-write or mid-eviction) are removed; on a
  shared root (``temp_min_age_s`` > 0) only those older than that, since a
  younger one may be another daemon's write in flight.
* Blocks written while it ran are more recent than anything it found.
* Stopping is bounded: a scan stuck in the file system is left behind after
  :data:`SCAN_JOIN_S` (a daemon thread; it touches no region).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtierd.contract import BlockKey
from kvtierd.tiers.blockformat import CorruptBlock, check_sealing
from kvtierd.tiers.fs import blockfile, permissions, safefs
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.corruptlog import CorruptFileLog
from kvtierd.tiers.fs.fsformat import BLOCK_SUFFIX, TEMP_SUFFIX
from kvtierd.tiers.fs.index import IndexedPool, TierFull
from kvtierd.tiers.fs.safefs import DIRECTORY, REGULAR, Entry, PoolDir, UnexpectedEntry

log = logging.getLogger(__name__)

SCAN_JOIN_S = 2.0  # shutdown waits this long for a scan stuck in the file system
SCAN_LOG_EVERY = 10_000  # files between progress lines
# On a shared root, a temp file younger than this may be another daemon's write
# (or eviction) in flight: the start-up scan leaves it alone.
SHARED_TEMP_MAX_AGE_S = 3600.0

Found = tuple[float, BlockKey, int]  # (mtime, key, file bytes) of a file that verified


@dataclass(slots=True)
class ScanReport:
    """What the start-up scan of the pool directory found (final once the index is ready)."""

    files: int = 0
    indexed: int = 0
    removed_corrupt: int = 0
    removed_temp: int = 0
    bad_entries: int = 0  # not regular files where block files belong (kept if directories)
    tightened: int = 0  # block files whose mode gave others access (now 0640 or tighter)
    seconds: float = 0.0


class IndexScan:
    """The scan of one pool directory into its index (``pool``): :meth:`start` once; :meth:`cancel`
    then :meth:`join` any time.

    ``on_ready`` is called on the scan thread once the index is ready (the tier
    hands it to its loop). ``before_scan``, if given, is called on the scan
    thread first (tests hold the scan there, as a slow mount would).
    ``corrupt_log``: where the files it removes are logged (rate-limited; one
    of its own when not given).
    """

    def __init__(
        self,
        pool: IndexedPool,
        on_ready: Callable[[], None],
        before_scan: Callable[[], object] | None = None,
        temp_min_age_s: float = 0.0,
        corrupt_log: CorruptFileLog | None = None,
    ) -> None:
        self.pool = pool
        self._corrupt_log = corrupt_log or CorruptFileLog(pool.tier_name)
        self._temp_min_age_s = temp_min_age_s
        self.report = ScanReport()  # written by the scan thread only
        self._on_ready = on_ready
        self._before_scan = before_scan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtierd-fs-scan", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Asks the scan to stop at its next entry (the index is then partial, and ready)."""
        self._stop.set()

    def join(self) -> None:
        """Waits for the scan thread at most :data:`SCAN_JOIN_S` seconds."""
        if self._thread is None:
            return
        self._thread.join(SCAN_JOIN_S)
        if self._thread.is_alive():
            log.warning(
                "FS tier %s: the index scan of %s did not stop within %gs (file system "
                "not answering?); leaving it behind",
                self.pool.tier_name, self.pool.pool_dir, SCAN_JOIN_S,
            )  # fmt: skip

    # -- the scan thread -----------------------------------------------------------------

    def _run(self) -> None:
        start = time.perf_counter()
        found: list[Found] = []
        try:
            if self._before_scan is not None:
                self._before_scan()
            with PoolDir(self.pool.pool_dir) as pool:
                for entry in pool.walk(self._walk_error):
                    if self._stop.is_set():
                        return
                    verified = self._entry(pool, entry)
                    if verified is not None:
                        found.append(verified)
        except Exception:
            log.exception(
                "FS tier %s: scan of %s failed; index is partial",
                self.pool.tier_name,
                self.pool.pool_dir,
            )
        finally:
            self._finish(found, time.perf_counter() - start)

    def _walk_error(self, path: str, exc: BaseException) -> None:
        log.warning("FS tier %s: not scanning %s: %s", self.pool.tier_name, path, exc)

    def _entry(self, pool: PoolDir, entry: Entry) -> Found | None:
        """What the scan does with one entry below the pool directory."""
        report = self.report
        if entry.name.endswith(TEMP_SUFFIX) and entry.kind != DIRECTORY:
            if self._temp_is_old(entry):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=entry.dir_fd)
                report.removed_temp += 1
            return None
        if entry.name.endswith(BLOCK_SUFFIX):
            report.files += 1
            if report.files % SCAN_LOG_EVERY == 0:
                log.info("FS tier %s: scanned %d files in %s", self.pool.tier_name, report.files,
                         self.pool.pool_dir)  # fmt: skip
            return self._block_file(pool, entry)
        if entry.kind == "symlink":
            log.warning("FS tier %s: %s is a symlink: not followed", self.pool.tier_name,
                        pool.full(entry.rel))  # fmt: skip
        return None

    def _temp_is_old(self, entry: Entry) -> bool:
        """Whether a temp file is a leftover: always on a root of its own; on a shared
        root only if older than ``temp_min_age_s`` (lstat, no link followed)."""
        if self._temp_min_age_s <= 0:
            return True
        try:
            st = os.stat(entry.name, dir_fd=entry.dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return time.time() - st.st_mtime > self._temp_min_age_s

    def _block_file(self, pool: PoolDir, entry: Entry) -> Found | None:
        """The index entry of one ``*.kvb`` file if its header checks out; otherwise
        the file is removed (a directory in its place is left there), counted and
        logged."""
        path = pool.full(entry.rel)
        identity: safefs.Identity | None = None
        try:
            fd, st = safefs.open_regular_entry(entry, path)
            identity = safefs.identity_of(st)
            try:
                self.report.tightened += permissions.tighten(fd, st)  # an older daemon's 0644
                header = blockfile.check_header(
                    fd, st, entry.rel, self.pool.fingerprint, self.pool.block_bytes
                )
                check_sealing(header, self.pool.keys)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except UnexpectedEntry as exc:
            self._drop(entry, blockfile.bad_entry(exc), path)
            return None
        except CorruptBlock as exc:
            self._drop(entry, CorruptFile(exc.reason, identity, integrity=exc.integrity), path)
            return None
        except OSError as exc:
            self._drop(entry, CorruptFile(str(exc), identity), path)
            return None
        return st.st_mtime, header.key, st.st_size

    def _drop(self, entry: Entry, error: CorruptFile, path: str) -> None:
        """Logs (rate-limited), counts and (unless a directory) removes a bad entry
        the scan met."""
        self._corrupt_log.dropped(path, error)
        if error.kind == REGULAR:
            self.report.removed_corrupt += 1
        else:
            self.report.bad_entries += 1
        if error.identity is not None:
            safefs.unlink_if_same(entry.dir_fd, entry.name, error.identity)
        self.pool.index.count("integrity_failures" if error.integrity else "checksum_failures")

    def _finish(self, found: list[Found], seconds: float) -> None:
        """Merges what the scan found into the index, evicts down to the capacity,
        then marks the index ready and reports it."""
        index = self.pool.index
        self.report.indexed = index.merge_scanned(found)
        self.report.seconds = seconds
        try:
            index.evict_to_capacity()
        except TierFull:
            log.warning("FS tier %s: over capacity after the scan", self.pool.tier_name)
        index.mark_scanned()
        stats = index.statistics()
        report = self.report
        log.info(
            "FS tier %s: index of %s ready: %d blocks, %d bytes, %d corrupt and %d temp files "
            "removed, %d bad entries (not regular files), %d modes tightened, %.2fs",
            self.pool.tier_name, self.pool.pool_dir, stats.blocks, stats.used_bytes,
            report.removed_corrupt, report.removed_temp, report.bad_entries, report.tightened,
            seconds,
        )  # fmt: skip
        self._on_ready()
