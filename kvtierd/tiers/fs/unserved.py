"""The bytes of a shared root's pool directories that no pool of this daemon serves.

On a shared root (``shared = true``) the capacity bounds every block file under
the root, whichever daemon wrote it and for whichever pool. Each pool's own
directory is accounted by its index (:mod:`~kvtierd.tiers.fs.shared`); the
directories of pools only *other* daemons serve (another model, another block
size) are counted here and charged to the configured tier's
:class:`~kvtierd.tiers.fs.index.DiskBudget` as one figure (``set_unserved``).
This daemon cannot evict them -- the daemons that serve those pools do -- but
its pools make room for them: over the budget, they evict their own least
recently used files.

One :class:`UnservedPools` per configured fs tier, shared by its pools'
shared-root threads: whichever rescans first after ``interval`` recounts (the
others skip), walking every pool directory not served here and ``lstat``-ing
its ``*.kvb`` entries (no link followed; sizes differ by pool), each counted as
the disk bytes it holds (:func:`disk_bytes`: a sparse file planted by anyone who
may create a directory in the root must not make the daemon evict its whole
cache for a terabyte that uses no disk). Directories of another uid are not
counted at all: every daemon of a root runs as one uid (the root lock refuses
another's), so such a directory was planted, not written by a daemon. A directory
becomes served when a pool attaches to it: its count leaves the charge at once,
so the pool's own start-up scan does not count it twice.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

from kvtierd.tiers.fs.fsformat import BLOCK_SUFFIX
from kvtierd.tiers.fs.index import DiskBudget
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry
from kvtierd.util.filekind import REGULAR
from kvtierd.util.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def disk_bytes(st: os.stat_result) -> int:
    """The bytes a file holds on disk, at most its length: its allocated blocks
    (``st_blocks`` counts 512-byte units), so a sparse file counts what it uses."""
    return min(st.st_size, st.st_blocks * 512)


class UnservedPools:
    """Counts and charges the pool directories of ``root`` no pool here serves.

    ``_lock`` guards ``_served``, ``_counts`` and ``_last``; the walk itself runs
    outside it, under ``_recount`` (one recount at a time; others skip)."""

    def __init__(self, tier_name: str, root: str, budget: DiskBudget, interval: float) -> None:
        self.tier_name = tier_name
        self.root = root
        self.interval = interval
        self._budget = budget
        self._faults = RateLimitedLog(log, 10.0)
        self._lock = threading.Lock()
        self._recount = threading.Lock()
        self._served: set[str] = set()  # pool directory names attached here
        self._counts: dict[str, int] = {}  # unserved directory -> bytes, as last counted
        self._last = float("-inf")  # monotonic time of the last recount

    def serve(self, dir_name: str) -> None:
        """A pool attaches to ``dir_name``: its bytes are the pool's own from now on."""
        with self._lock:
            self._served.add(dir_name)
            self._counts.pop(dir_name, None)
            self._budget.set_unserved(sum(self._counts.values()))

    def recount_if_due(self) -> bool:
        """Recounts (on the calling thread) unless a recount ran less than ``interval``
        ago or is running; returns whether it recounted."""
        if not self._recount.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if time.monotonic() - self._last < self.interval * 0.9:
                    return False
                self._last = time.monotonic()
            counts = self._count()
            with self._lock:
                self._counts = {d: n for d, n in counts.items() if d not in self._served}
                self._budget.set_unserved(sum(self._counts.values()))
            return True
        finally:
            self._recount.release()

    def _count(self) -> dict[str, int]:
        """Bytes of ``*.kvb`` regular files per pool directory not served here."""
        try:
            with os.scandir(self.root) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            self._fault("cannot list %s: %s", self.root, exc)
            return dict(self._counts)
        with self._lock:
            names = [name for name in names if name not in self._served]
        counts: dict[str, int] = {}
        for name in sorted(names):
            path = os.path.join(self.root, name)
            total = 0
            try:
                with PoolDir(path) as pool:
                    owner = os.fstat(pool.fd).st_uid
                    if owner != os.geteuid():
                        # every daemon of a root runs as one uid (the root lock refuses
                        # another's): a directory of another user is no daemon's pool
                        self._fault("not counting %s: owned by uid %d, not a daemon", path, owner)
                        continue
                    for entry in pool.walk(
                        lambda p, exc: self._fault("not counting %s: %s", p, exc)
                    ):
                        if entry.kind != REGULAR or not entry.name.endswith(BLOCK_SUFFIX):
                            continue
                        try:
                            st = os.stat(entry.name, dir_fd=entry.dir_fd, follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            total += disk_bytes(st)
            except (OSError, UnexpectedEntry) as exc:
                self._fault("not counting %s: %s", path, exc)
                continue
            counts[name] = total
        return counts

    def _fault(self, msg: str, *args: object) -> None:
        self._faults.log(logging.WARNING, self.tier_name, f"FS tier %s: {msg}", self.tier_name,
                         *args)  # fmt: skip
