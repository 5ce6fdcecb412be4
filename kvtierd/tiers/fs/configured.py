"""A configured fs tier: one ``type = "fs"`` ``[[tiers]]`` entry and what its pools share.

One :class:`ConfiguredFsTier` exists per configured fs tier for the daemon's
whole life. Each pool gets its own :class:`~kvtierd.tiers.fs.tier.FsTier` (its
own directory, index and fingerprint) from :meth:`ConfiguredFsTier.create`; all
of them share the configured tier's I/O threads and I/O worker processes (so
neither multiplies with pools), its write-queue limits and its byte capacity.

Lifecycle (event loop): :meth:`check` at daemon start (refuses an unusable
root, naming it, and takes the root's lock: :mod:`~kvtierd.tiers.fs.rootlock`)
-> :meth:`create` per pool -> :meth:`shutdown` once every pool has drained
(joins the I/O threads, so no thread touches a region afterwards, then drops
the root's lock).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import tempfile

from kvtierd.security.trusted_dirs import UntrustedPath
from kvtierd.tiers.base import JobCallback
from kvtierd.tiers.configured import ConfiguredTier, PoolBinding, TierCheckError
from kvtierd.tiers.fs import permissions
from kvtierd.tiers.fs.blockio import IoWorkers
from kvtierd.tiers.fs.corruptlog import CorruptFileLog
from kvtierd.tiers.fs.index import DiskBudget
from kvtierd.tiers.fs.rootlock import RootGuard, RootInUse
from kvtierd.tiers.fs.settings import FsTierSettings
from kvtierd.tiers.fs.tier import FsTier, SharedParts
from kvtierd.tiers.fs.unserved import UnservedPools
from kvtierd.tiers.fs.writelog import WriteFailureLog
from kvtierd.tiers.integrity import KeyRing
from kvtierd.tiers.keyfiles import integrity_words, load_keyring


class TierRootError(TierCheckError):
    """A configured tier's root directory cannot be used; the message names it."""

    def __init__(self, message: str) -> None:
        super().__init__("root", message)


class ConfiguredFsTier(ConfiguredTier):
    """One configured fs tier: settings, shared capacity and shared I/O threads."""

    type_name = "fs"

    def __init__(self, name: str, settings: FsTierSettings) -> None:
        super().__init__(name, settings)
        self.settings: FsTierSettings = settings
        self.budget = DiskBudget(settings.capacity)
        # one report stream of write failures for all its pools
        self.write_log = WriteFailureLog(name, logging.getLogger(__name__))
        # one rate limit on the lines of files that failed verification, for all its pools
        self.corrupt_log = CorruptFileLog(name)
        self._workers: IoWorkers | None = None  # started with the first pool (if any)
        # exclusive, or shared with other daemons (shared = true); held from check() to shutdown()
        self.root_guard = RootGuard(name, settings.root, shared=settings.shared)
        # shared root: the bytes of pool directories no pool here serves, in the budget
        self.unserved = (
            UnservedPools(name, settings.root, self.budget, settings.shared_rescan_interval)
            if settings.shared
            else None
        )
        self.keys: KeyRing | None = None  # read by check()

    def check(self) -> None:
        """:meth:`check_unlocked`, then :meth:`lock`."""
        self.check_unlocked()
        self.lock()

    def check_unlocked(self) -> None:
        """Reads the integrity keys (TierCheckError naming their option), then raises
        TierRootError unless the root exists (or may be created), is the daemon's own
        with nothing planted below it (``permissions.check_root``) and this process
        can create files in it (a real probe: permission bits lie for root)."""
        self.keys = load_keyring(
            self.settings.integrity_key_file, self.settings.integrity_verify_key_file
        )
        root = self.settings.root
        if not os.path.isdir(root):
            if os.path.exists(root):
                raise TierRootError(f"fs tier {self.name}: root {root} is not a directory")
            if not self.settings.create_root:
                raise TierRootError(
                    f"fs tier {self.name}: root directory {root} does not exist; create it "
                    "(owned by the daemon's user) or set create_root = true"
                )
            try:
                os.makedirs(root, mode=0o750, exist_ok=True)
            except OSError as exc:
                raise TierRootError(
                    f"fs tier {self.name}: cannot create root directory {root}: "
                    f"{exc.strerror or exc}"
                ) from None
        try:
            permissions.check_root(root)  # ours, no symlinked or foreign pool directory
        except UntrustedPath as exc:
            raise TierRootError(f"fs tier {self.name}: {exc}") from None
        except OSError as exc:  # not listable, a mode that cannot be tightened...
            raise TierRootError(
                f"fs tier {self.name}: root directory {root} cannot be checked by this "
                f"process (uid {os.geteuid()}): {exc.strerror or exc}"
            ) from None
        try:
            probe = tempfile.NamedTemporaryFile(dir=root, prefix=".kvtierd-probe-")  # noqa: SIM115
            probe.close()
        except OSError as exc:
            reason = "not writable" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else ""
            raise TierRootError(
                f"fs tier {self.name}: root directory {root} is {reason or 'unusable'} for this "
                f"process (uid {os.geteuid()}): {exc.strerror or exc}"
            ) from None

    def lock(self) -> None:
        """Takes the root's lock (``rootlock``); TierRootError naming who holds it."""
        root = self.settings.root
        try:
            self.root_guard.acquire()
        except RootInUse as exc:
            raise TierRootError(str(exc)) from None
        except OSError as exc:
            raise TierRootError(
                f"fs tier {self.name}: cannot lock root {root}: {exc.strerror or exc}"
            ) from None

    def describe(self) -> str:
        return super().describe() + integrity_words(self.keys, self.settings.shared)

    def create(
        self, pool: PoolBinding, on_done: JobCallback, loop: asyncio.AbstractEventLoop
    ) -> FsTier:
        """An FsTier for one pool, not started (no file touched). On the loop: it
        creates the shared I/O pool and worker processes on first use.

        With ``pool.region_file`` (path, st_dev, st_ino of the pool's region) the
        tier's block I/O runs in I/O worker processes (``io_processes``); without
        it the I/O threads do the file work themselves.
        """
        s = self.settings
        workers = None
        if s.io_processes and pool.region_file is not None:
            if self._workers is None:
                self._workers = IoWorkers(
                    s.io_processes,
                    channels=s.read_threads + s.write_threads,
                    name=f"kvtierd-{self.name}-io",
                    reply_timeout=s.io_worker_timeout,
                )
            workers = self._workers
        io_pool = self.io_pool(
            loop,
            read_threads=s.read_threads,
            write_threads=s.write_threads,
            max_queue_jobs=s.max_queue_jobs,
            max_queue_bytes=s.max_queue_bytes,
        )
        tier = FsTier(
            self.name,
            s,
            pool,
            on_done,
            loop,
            parts=SharedParts(
                io_pool=io_pool,
                budget=self.budget,
                workers=workers,
                write_log=self.write_log,
                unserved=self.unserved,
                integrity=self.keys,
                corrupt_log=self.corrupt_log,
            ),
        )
        if self.unserved is not None:
            self.unserved.serve(os.path.basename(tier.pool_dir))
        return tier

    def shutdown(self) -> None:
        """Fails queued jobs, joins the I/O threads (running ones finish), then stops
        the I/O worker processes (no thread can send them a request anymore). Idempotent."""
        super().shutdown()
        if self._workers is not None:
            self._workers.stop()
        self.root_guard.release()
