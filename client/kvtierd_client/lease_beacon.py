"""A session's lease proof, published in shared memory for the processes that copy
its rows (docs/design/leases.md).

The process that owns a session (vLLM's scheduler) is not the one that copies
bytes into the rows the session reserved (vLLM's workers). A worker must not
write a row once the daemon may have expired the session and handed the row to
another session; and it must not skip a write the session will still complete
(the row would be served with whatever it held). So the owner publishes, live,
what it knows of its lease, and a worker reads it before each copy:

* ``proven_until`` > now: the lease is proven alive (send time of the newest
  answered call + lease, on ``CLOCK_MONOTONIC``, which every process of a host
  shares): copy.
* ``proven_until`` <= now: unknown (keepalives unanswered: a daemon stall, a
  cut socket, a frozen owner): wait, and copy once it is proven again. Sessions
  never come back, so a proof that resumes means the lease never ran out.
* :data:`DEAD` (the daemon said the session is gone, or its owner closed it):
  the rows are no longer the session's; never copy, and nothing will complete
  the reservation (the daemon ignores completions of a session it forgot).

Layout: one page, the proof as a native ``double`` at offset 0 (one aligned
8-byte store: readers never see half of it). The file is created 0600 with
``O_EXCL`` in a private temp name, flocked before it is sized (a sweep leaves
short files alone) and unlinked by its owner on close; readers
open it with ``O_NOFOLLOW | O_NONBLOCK`` and refuse anything that is not a
regular file of their own user.
"""

from __future__ import annotations

import enum
import fcntl
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
import weakref

DEAD = -1.0
_PREFIX = "kvtierd-lease-"
_PROOF = struct.Struct("=d")
_SIZE = mmap.PAGESIZE
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY


class LeaseState(enum.Enum):
    PROVEN = "proven"  # copy
    UNPROVEN = "unproven"  # wait until proven again (or dead)
    DEAD = "dead"  # never copy


class LeaseBeacon:
    """The owner's side: publishes a session's lease proof. Thread-safe: a session's
    keepalive thread and its caller publish into it concurrently. DEAD is final:
    nothing published after :meth:`declare_dead` (an answer that was in flight
    while the session was closed) can make the session look alive again."""

    def __init__(self, directory: str | None = None) -> None:
        directory = directory or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        )
        sweep_orphans(directory)
        fd, self.path = _create_locked(directory)
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, _SIZE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(self.path)
            raise
        # the file goes with the beacon even if nobody calls close()
        self._unlink = weakref.finalize(self, _release, self.path, fd)
        self._lock = threading.Lock()
        self._dead = False
        self.publish(0.0)

    def publish(self, proven_until: float) -> None:
        """The lease is proven until ``proven_until`` (monotonic seconds); ignored
        once the session was declared dead."""
        with self._lock:
            if self._map is not None and not self._dead:
                _PROOF.pack_into(self._map, 0, proven_until)

    def declare_dead(self) -> None:
        """The session is gone: readers must never copy into its rows again."""
        with self._lock:
            self._dead = True
            if self._map is not None:
                _PROOF.pack_into(self._map, 0, DEAD)

    def close(self) -> None:
        """Declares the session dead and removes the file (mapped readers keep
        reading DEAD). Idempotent."""
        self.declare_dead()
        with self._lock:
            if self._map is None:
                return
            self._map.close()
            self._map = None
        self._unlink()


def _create_locked(directory: str) -> tuple[int, str]:
    """A new beacon file in ``directory``, flocked before it is sized: another
    process's sweep treats a file shorter than a page as one being created (it
    took every unlocked file for an orphan: a sweep between a new file's
    creation and its flock removed a live owner's file)."""
    fd, path = tempfile.mkstemp(prefix=_PREFIX, dir=directory)
    try:
        _lock_and_size(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    return fd, path


def _lock_and_size(fd: int) -> None:
    # held for the beacon's life: the kernel drops it when this process dies
    # however it dies, which tells a later sweep the file is orphaned
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, _SIZE)  # after the lock: a full-size file is a locked one


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _release(path: str, fd: int) -> None:
    _unlink_quietly(path)
    os.close(fd)  # drops the flock


def sweep_orphans(directory: str) -> int:
    """Removes the beacon files of this user whose owner died without closing
    them (nobody holds their flock); returns how many. Files of other users,
    links and anything that is not a regular file are left alone."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, _READ_FLAGS)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if st.st_size < _SIZE:
                continue  # being created (sized only once locked): not an orphan yet
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live owner
            same = os.lstat(path)
            if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                _unlink_quietly(path)
                removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class LeaseBeaconReader:
    """A copying process's view of one beacon."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, _READ_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < _SIZE:
                raise PermissionError(
                    f"{path} is not a lease beacon of this user (uid {os.geteuid()}); "
                    "refusing to trust it"
                )
            self._map: mmap.mmap | None = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path

    def proven_until(self) -> float:
        if self._map is None:
            return DEAD
        return float(_PROOF.unpack_from(self._map, 0)[0])

    def state(self, margin: float = 0.0) -> LeaseState:
        """What a copy may do now; ``margin`` seconds are kept short of the proof."""
        proven = self.proven_until()
        if proven == DEAD:
            return LeaseState.DEAD
        if time.monotonic() < proven - margin:
            return LeaseState.PROVEN
        return LeaseState.UNPROVEN

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
