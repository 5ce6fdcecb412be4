"""FS-tier block I/O in helper processes, off the daemon's GIL.

An I/O thread of the daemon that runs a group of block reads or writes hands
the file work (checksum, open, pwritev/preadv, rename) to an *I/O worker*: a
child process (``python -m kvtierd.tiers.fs.ioworker DAEMON_PID FD...``) that
maps the pool's shared-memory region itself and runs
:mod:`kvtierd.tiers.fs.blockfile` on its rows. The daemon's event loop and gRPC
threads then no longer compete with the I/O for one interpreter lock; the I/O
thread only sends a request and waits on a socket (GIL released).

Invariants:

* A worker process serves several *channels* (socket pairs), one thread each;
  an I/O thread of the daemon keeps one channel for life and holds the
  channel's lock for its request, so a channel carries one request at a time.
  The reply comes before the I/O thread records the group's outcomes, so no
  worker touches a row after its job's ``on_done`` ran.
* The worker opens the region by path and refuses it unless its
  ``(st_dev, st_ino)`` is the one the daemon sent; it keeps the mapping until
  it exits (pools live as long as the daemon). It holds no lock on the region
  file: the daemon's ``flock`` stays the only liveness marker.
* A worker exits when its sockets reach EOF (the daemon stopped it), and is
  killed by the kernel when the daemon's spawner thread ends, which includes
  the daemon dying: a killed daemon leaves no worker writing behind its back.
  A worker that dies alone fails the requests in flight on it (the daemon
  removes the temp files it named) and is replaced on the next request; a
  failed read never makes a row visible, so no wrong bytes are served.
* A worker that does not answer a request within ``reply_timeout``
  (``io_worker_timeout``; stopped with SIGSTOP, or stuck) is treated as dead:
  it is killed, and the request fails only once the process has exited, so a
  row its blocks named is never handed to anyone else while it could still
  write into it. (One stuck in the kernel, which even SIGKILL cannot end before
  its I/O returns, holds its I/O thread and its rows until it exits.)
* Rows: a worker process hashes, writes and reads rows in its own mapping
  (zero-copy), each row checked against the region file's size first; the
  daemon's own I/O threads (:class:`InlineIo`, ``io_processes = 0``) never
  touch the mapping: rows go through :class:`~kvtierd.primary.rows.RegionRows`
  and a per-thread bounce buffer. A client that truncates the region fails the
  blocks whose rows are gone (EFAULT, logged by the tier); at worst a
  truncation racing a copy kills a worker, never the daemon.
* Requests and replies are ``marshal``-ed tuples of builtins, length-prefixed
  on a Unix stream socket; nothing is unpickled. A tier with integrity keys
  sends them in each request's parameters (:meth:`KeyRing.wire`: a socket pair
  only the daemon and its worker hold); the worker seals and verifies with them
  (:mod:`kvtierd.tiers.integrity`) and keeps no other copy.
* A request names its pool directory and each block file relative to it; the
  worker resolves them with :class:`~kvtierd.tiers.fs.safefs.PoolDir`, so no
  symlink below the pool directory is followed and no open blocks (a FIFO in
  place of a block file is a bad file, not a hang).
"""

from __future__ import annotations

import errno
import itertools
import logging
import marshal
import mmap
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from kvtierd.primary.rows import RegionCutShort, RegionRows, scratch
from kvtierd.tiers.fs import blockfile
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry
from kvtierd.tiers.integrity import KeyRing
from kvtierd.util.workerproc import die_with

log = logging.getLogger("kvtierd.tiers.fs.ioworker")

_LENGTH = struct.Struct("<I")
STOP_WAIT_S = 5.0  # seconds a worker gets to exit after EOF before it is killed
# a worker silent this long on one request is killed (fs option io_worker_timeout)
DEFAULT_REPLY_TIMEOUT_S = 60.0
_KILL_WAIT = 1.0  # seconds to wait for a killed worker to be reaped

# A region as a worker sees it: (path, st_dev, st_ino, block_bytes).
RegionRef = tuple[str, int, int, int]
# One block's outcome: None (done), or an error tuple (see _error / error_of).
Reply = tuple[Any, ...] | None

WRITE = "w"
READ = "r"


class WorkerDied(OSError):
    """The I/O worker process exited (or its socket broke) during a request."""


# -- wire ---------------------------------------------------------------------------------


def send_message(sock: socket.socket, obj: tuple[Any, ...] | list[Any]) -> None:
    data = marshal.dumps(obj)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive_message(sock: socket.socket, deadline: float | None = None) -> Any:
    """The next message; EOFError when the peer closed the socket between messages.
    ``deadline`` (monotonic): TimeoutError once it passes without the whole message
    (the socket's timeout is set before each read)."""
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size, True, deadline))
    return marshal.loads(_receive_exactly(sock, length, False, deadline))


def _receive_exactly(
    sock: socket.socket, n: int, at_boundary: bool, deadline: float | None
) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            if at_boundary and got == 0:
                raise EOFError
            raise ConnectionError("socket closed in the middle of a message")
        got += k
    return bytes(buf)


# -- the worker process ---------------------------------------------------------------


class RowAccess(Protocol):
    """How a :class:`_Worker` reaches the rows of one region."""

    def for_write(self, block_id: int) -> memoryview:
        """Row ``block_id``'s bytes, to hash and write to a block file."""
        ...

    def for_read(self, block_id: int) -> memoryview:
        """Where a block file's payload for row ``block_id`` is read and verified."""
        ...

    def commit(self, block_id: int, payload: memoryview) -> None:
        """Row ``block_id`` now holds ``payload`` (verified): puts it there if it
        is not already (``payload`` is what :meth:`for_read` gave)."""
        ...


class _MappedRows:
    """A worker process's own mapping of a region: rows hashed, written and read in
    place (zero-copy). A client that truncates the file cannot kill the daemon
    this way, only this worker (SIGBUS: its requests fail, the daemon starts
    another). So that this takes a race and not just a truncation, each row is
    checked against the file's size first (one ``fstat`` of the descriptor kept
    open for that): a row past the end fails its block with
    :class:`~kvtierd.primary.rows.RegionCutShort`, as in the daemon."""

    def __init__(self, rows: memoryview, block_bytes: int, fd: int, path: str) -> None:
        self._rows = rows
        self._block_bytes = block_bytes
        self._fd = fd  # the region file, open as long as the mapping (the process's life)
        self._path = path

    def for_write(self, block_id: int) -> memoryview:
        row = self._rows[block_id * self._block_bytes : (block_id + 1) * self._block_bytes]
        if block_id < 0 or len(row) != self._block_bytes:  # the daemon checks; so do we
            raise ValueError(f"block id {block_id} is outside the region")
        size = os.fstat(self._fd).st_size
        if size < (block_id + 1) * self._block_bytes:
            raise RegionCutShort(
                f"row {block_id} of region {self._path} is past the end of the file "
                f"({size} bytes): the region file is shorter than the region (a client "
                "truncated it)"
            )
        return row

    for_read = for_write

    def commit(self, block_id: int, payload: memoryview) -> None:
        pass  # read in place


class _CopiedRows:
    """The daemon's I/O threads (``io_processes = 0``): the daemon never touches a
    region mapping (:mod:`kvtierd.primary.rows`), so a row to write is copied into
    this thread's bounce buffer first, and a block read is verified there and
    then copied into its row; a truncated region fails that block."""

    def __init__(self, rows: RegionRows) -> None:
        self._rows = rows

    def for_write(self, block_id: int) -> memoryview:
        payload = scratch(self._rows.block_bytes)
        self._rows.read(block_id, payload)
        return payload

    def for_read(self, block_id: int) -> memoryview:
        if not 0 <= block_id < self._rows.num_rows:
            raise ValueError(f"block id {block_id} is outside the region")
        return scratch(self._rows.block_bytes)

    def commit(self, block_id: int, payload: memoryview) -> None:
        self._rows.write(block_id, payload)


class _Regions:
    """The regions a worker process has mapped, shared by its channel threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[RegionRef, _MappedRows] = {}  # _lock

    def rows(self, region: RegionRef) -> _MappedRows:
        with self._lock:
            rows = self._mapped.get(region)
            if rows is None:
                fd, mapping = _map_region(region)
                rows = self._mapped[region] = _MappedRows(mapping, region[3], fd, region[0])
            return rows


class _Worker:
    """Runs block I/O requests one at a time (one channel of a worker process,
    or one I/O thread of :class:`InlineIo`)."""

    def __init__(self, rows_of: Callable[[RegionRef], RowAccess]) -> None:
        self._rows_of = rows_of
        self._head = blockfile.header_buffer()

    def handle(self, request: tuple[Any, ...]) -> list[Reply]:
        """Runs one request; one reply per item. The pool directory (the last of
        ``params``) is opened once for the request, without following a symlink
        (created when writing and missing)."""
        op, region, params, items = request
        try:
            rows = self._rows_of(region)
            pool = PoolDir(params[-1], create=op == WRITE)
        except (OSError, ValueError, UnexpectedEntry) as exc:  # ValueError: mmap refused
            error = _error(_refused(exc) if isinstance(exc, UnexpectedEntry) else exc)
            return [error] * len(items)
        with pool:
            return self._run(pool, op, rows, params, items)

    def _run(
        self,
        pool: PoolDir,
        op: str,
        rows: RowAccess,
        params: tuple[Any, ...],
        items: Sequence[tuple[Any, ...]],
    ) -> list[Reply]:
        run = self._write if op == WRITE else self._read
        replies: list[Reply] = []
        for item in items:
            try:
                run(pool, rows, params, item)
                replies.append(None)
            except Exception as exc:  # one block's failure is that block's reply
                replies.append(_error(exc))
        return replies

    def _write(
        self, pool: PoolDir, rows: RowAccess, params: tuple[Any, ...], item: tuple[Any, ...]
    ) -> None:
        fingerprint, o_direct, fsync, keys, _ = params
        block_id, rel, temp_name, key = item
        row = rows.for_write(block_id)
        blockfile.write_block_file(
            pool, rel, temp_name, key, fingerprint, row, self._head, o_direct=o_direct,
            fsync=fsync, keys=KeyRing.from_wire(keys),
        )  # fmt: skip

    def _read(
        self, pool: PoolDir, rows: RowAccess, params: tuple[Any, ...], item: tuple[Any, ...]
    ) -> None:
        fingerprint, o_direct, keys, _ = params
        block_id, rel, key = item
        row = rows.for_read(block_id)
        blockfile.read_block_file(
            pool, rel, key, fingerprint, row, self._head, o_direct=o_direct,
            keys=KeyRing.from_wire(keys),
        )  # fmt: skip
        rows.commit(block_id, row)


def _refused(exc: UnexpectedEntry) -> OSError:
    """A pool directory that is not a directory (a symlink, say): every block fails."""
    code = errno.ELOOP if exc.kind == "symlink" else errno.ENOTDIR
    return OSError(code, f"{exc}: not followed", exc.path)


def _map_region(region: RegionRef) -> tuple[int, memoryview]:
    """The region file's descriptor (kept open: rows are checked against its size)
    and a mapping of it."""
    path, dev, ino, _ = region
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise OSError(errno.ESTALE, f"{path} is no longer the daemon's region file")
        if st.st_size == 0:  # mmap refuses an empty file: every row is past the end
            raise RegionCutShort(
                f"region {path} is 0 bytes: the region file is shorter than the region "
                "(a client truncated it)"
            )
        return fd, memoryview(mmap.mmap(fd, st.st_size))
    except BaseException:
        os.close(fd)
        raise


def _error(exc: BaseException) -> tuple[Any, ...]:
    """An exception as a reply tuple (rebuilt by :func:`error_of` in the daemon)."""
    if isinstance(exc, CorruptFile):
        dev, ino = exc.identity if exc.identity is not None else (-1, -1)
        return ("corrupt", exc.reason, dev, ino, exc.kind, exc.integrity)
    if isinstance(exc, OSError):
        return ("os", exc.errno or 0, exc.strerror or str(exc), exc.filename)
    return ("error", f"{type(exc).__name__}: {exc}")


def error_of(reply: Reply) -> BaseException | None:
    """The exception a block's reply stands for (None: the block is done)."""
    if reply is None:
        return None
    kind = reply[0]
    if kind == "corrupt":
        _, reason, dev, ino, what, integrity = reply
        return CorruptFile(reason, None if ino == -1 else (dev, ino), what, integrity)
    if kind == "os":
        _, code, message, filename = reply
        if code == errno.ENOENT:
            return FileNotFoundError(code, message, filename)
        return OSError(code, message, filename)
    return RuntimeError(f"block I/O: {reply[1]}")


def serve(sock: socket.socket, worker: _Worker) -> None:
    """Answers one channel's requests until the daemon closes it."""
    try:
        while True:
            try:
                request = receive_message(sock)
            except (EOFError, ConnectionError):
                return
            send_message(sock, worker.handle(request))
    except BrokenPipeError:
        pass  # the daemon went away while we answered
    finally:
        sock.close()


def main(argv: Sequence[str]) -> int:
    """Serves each channel socket (inherited file descriptors) on its own thread."""
    if len(argv) < 2 or not all(arg.isdigit() for arg in argv):
        print("usage: python -m kvtierd.tiers.fs.ioworker DAEMON_PID FD... (started by kvtierd)",
              file=sys.stderr)  # fmt: skip
        return 2
    if not die_with(int(argv[0])):
        return 1
    regions = _Regions()
    threads = [
        threading.Thread(target=serve, args=(socket.socket(fileno=int(fd)), _Worker(regions.rows)))
        for fd in argv[1:]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


# -- the daemon side ------------------------------------------------------------------


class BlockIo(Protocol):
    """Where an FS tier's block file I/O runs."""

    def call(self, request: tuple[Any, ...]) -> list[Reply]:
        """Runs one request (op, region, params, items); one reply per item.

        Raises OSError when the request as a whole could not run (a worker died).
        """
        ...


class InlineIo:
    """Block I/O on the calling I/O thread, in the daemon (``io_processes = 0``):
    rows copied through ``rows`` (:class:`_CopiedRows`), never touched in place."""

    def __init__(self, rows: RegionRows) -> None:
        self._rows = _CopiedRows(rows)
        self._local = threading.local()

    def call(self, request: tuple[Any, ...]) -> list[Reply]:
        worker = getattr(self._local, "worker", None)
        if worker is None:
            worker = self._local.worker = _Worker(lambda _region: self._rows)
        return worker.handle(request)


class WorkerProcess:
    """One running worker process and the daemon's ends of its channel sockets.

    ``users`` (guarded by the owning :class:`IoWorkers`' lock for its index)
    counts threads inside :meth:`call`; a broken process is stopped by the
    last of them, so no socket is closed while a thread still uses it.
    """

    def __init__(
        self, name: str, channels: int, reply_timeout: float = DEFAULT_REPLY_TIMEOUT_S
    ) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(channels)]
        theirs = [pair[1] for pair in pairs]
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvtierd.tiers.fs.ioworker", str(os.getpid()),
                 *(str(sock.fileno()) for sock in theirs)],
                pass_fds=[sock.fileno() for sock in theirs],
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for sock in theirs:
                sock.close()
        self.name = name
        self.socks = [pair[0] for pair in pairs]
        self.locks = [threading.Lock() for _ in pairs]
        self.reply_timeout = reply_timeout
        self.broken = False
        self.why = ""  # set when broken: what happened, for the one WARNING line
        self.users = 0

    def call(self, channel: int, request: tuple[Any, ...]) -> list[Reply]:
        """Sends one request on ``channel`` and waits for its replies, at most
        ``reply_timeout`` seconds.

        Raises WorkerDied (and marks the process broken) if the process is gone;
        if it stalled, only once it has been killed and has exited.
        """
        sock = self.socks[channel]
        try:
            with self.locks[channel]:
                deadline = time.monotonic() + self.reply_timeout
                sock.settimeout(self.reply_timeout)
                send_message(sock, request)
                replies: list[Reply] = receive_message(sock, deadline)
        except TimeoutError:
            self._stalled()
        except (OSError, EOFError, ValueError, TypeError) as exc:  # gone, or garbled
            self.broken = True
            code = self.process.poll()
            why = f"died{'' if code is None else f' with exit status {code}'}: {exc}"
            self.why = self.why or why  # the first cause (a stall kills it: EOF for the others)
            raise WorkerDied(
                errno.EIO, f"I/O worker {self.name} (pid {self.process.pid}) {why}"
            ) from None
        if len(replies) != len(request[3]):
            self.broken = True
            raise WorkerDied(errno.EIO, f"I/O worker {self.name} answered out of step")
        return replies

    def _stalled(self) -> NoReturn:
        """No answer within ``reply_timeout``: kills the process and waits until it
        has exited (it maps the region: until then it could still write a row the
        failed request named), then raises WorkerDied."""
        self.broken = True
        why = (
            f"did not answer within {self.reply_timeout:g}s (io_worker_timeout: stopped or "
            "stuck) and was killed"
        )
        self.why = self.why or why
        self.process.kill()
        try:
            self.process.wait(timeout=_KILL_WAIT)
        except subprocess.TimeoutExpired:
            log.warning(
                "I/O worker %s (pid %d) %s but has not exited yet (stuck in the kernel?); "
                "the rows of its request stay held until it does",
                self.name, self.process.pid, why,
            )  # fmt: skip
            self.process.wait()
        raise WorkerDied(errno.ETIMEDOUT, f"I/O worker {self.name} (pid {self.process.pid}) {why}")

    def stop(self, deadline: float | None = None) -> None:
        """Closes the sockets (the worker exits at EOF) and reaps the process; kills
        it if it has not exited by ``deadline`` (monotonic; default: now +
        ``STOP_WAIT_S``). Bounded: a process that does not even die when killed
        (stuck in the kernel) is left behind, with a WARNING."""
        for sock in self.socks:
            sock.close()
        if deadline is None:
            deadline = time.monotonic() + STOP_WAIT_S
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            return
        except subprocess.TimeoutExpired:
            self.process.kill()
        try:
            self.process.wait(timeout=_KILL_WAIT)
        except subprocess.TimeoutExpired:
            log.warning("I/O worker %s (pid %d) does not exit even when killed; leaving it",
                        self.name, self.process.pid)  # fmt: skip


class _SpawnRequest:
    """One worker for the spawner thread to start; ``done`` is set when it tried."""

    def __init__(self, name: str, channels: int, reply_timeout: float) -> None:
        self.name = name
        self.channels = channels
        self.reply_timeout = reply_timeout
        self.done = threading.Event()
        self.worker: WorkerProcess | None = None
        self.error: BaseException | None = None


class IoWorkers:
    """``processes`` worker processes with ``channels`` channels (sockets) in all.

    Each calling thread gets a channel for life (the n-th thread to call gets
    channel n, modulo ``channels``), in process ``channel % processes``; with
    ``channels`` at least the number of I/O threads no thread ever waits for
    another's request. A process starts on its channels' first call and is
    replaced after it died; :meth:`stop` ends them all. Thread-safe.
    """

    def __init__(
        self,
        processes: int,
        channels: int,
        name: str = "kvtierd-io",
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT_S,
    ) -> None:
        """``reply_timeout``: how long a worker may take to answer one request
        before it is killed and replaced (its request fails)."""
        if processes < 1 or channels < 1:
            raise ValueError(f"need at least one process and channel, got {processes}, {channels}")
        self.processes = min(processes, channels)
        self.name = name
        self.reply_timeout = reply_timeout
        self._per_process = -(-channels // self.processes)
        self._channels = self._per_process * self.processes
        self._numbering = itertools.count()
        self._local = threading.local()
        self._locks = [threading.Lock() for _ in range(self.processes)]
        self._running: list[WorkerProcess | None] = [None] * self.processes  # _locks[i]
        self._names = itertools.count(1)
        self._stopped = False
        self._spawn_requests: queue.SimpleQueue[_SpawnRequest | None] = queue.SimpleQueue()
        self._spawner: threading.Thread | None = None
        self._spawner_lock = threading.Lock()

    def pids(self) -> list[int]:
        """Process ids of the running workers."""
        return [w.process.pid for w in self._running if w is not None and not w.broken]

    def call(self, request: tuple[Any, ...]) -> list[Reply]:
        """Runs ``request`` in this thread's worker; one reply per item."""
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._local.channel = next(self._numbering) % self._channels
        index, slot = channel % self.processes, channel // self.processes
        worker = self._acquire(index)
        try:
            return worker.call(slot, request)
        finally:
            self._release(index, worker)

    def stop(self) -> None:
        """Stops every worker; call once no I/O thread can send a request anymore."""
        self._stopped = True
        stopping = []
        for index, lock in enumerate(self._locks):
            with lock:
                worker, self._running[index] = self._running[index], None
            if worker is not None:
                stopping.append(worker)
                for sock in worker.socks:
                    sock.close()  # every worker sees EOF at once
        deadline = time.monotonic() + STOP_WAIT_S  # one wait for all of them, not one each
        for worker in stopping:
            worker.stop(deadline)
        with self._spawner_lock:
            if self._spawner is not None:
                self._spawn_requests.put(None)
                self._spawner.join()
                self._spawner = None

    def _spawn(self, name: str) -> WorkerProcess:
        """A new worker, started by the spawner thread: a worker dies with the thread
        that started it (``kvtierd.util.workerproc.die_with``), and I/O threads may end
        before the daemon."""
        with self._spawner_lock:
            if self._spawner is None:
                self._spawner = threading.Thread(
                    target=self._serve_spawns, name=f"{self.name}-spawner", daemon=True
                )
                self._spawner.start()
        request = _SpawnRequest(name, self._per_process, self.reply_timeout)
        self._spawn_requests.put(request)
        request.done.wait()
        if request.error is not None:
            raise request.error
        if request.worker is None:
            raise RuntimeError(f"the spawner gave no worker {name}")
        return request.worker

    def _serve_spawns(self) -> None:
        while (request := self._spawn_requests.get()) is not None:
            try:
                request.worker = WorkerProcess(
                    request.name, request.channels, request.reply_timeout
                )
                log.debug("started I/O worker %s (pid %d, %d channels)", request.name,
                          request.worker.process.pid, request.channels)  # fmt: skip
            except BaseException as exc:  # handed to the waiting I/O thread
                log.error("cannot start I/O worker %s: %s", request.name, exc)
                request.error = exc
            request.done.set()

    def _acquire(self, index: int) -> WorkerProcess:
        with self._locks[index]:
            if self._stopped:
                raise OSError(errno.ESHUTDOWN, "I/O workers stopped")
            worker = self._running[index]
            if worker is None or worker.broken:
                worker = self._spawn(f"{self.name}-{next(self._names)}")
                self._running[index] = worker
            worker.users += 1
            return worker

    def _release(self, index: int, worker: WorkerProcess) -> None:
        with self._locks[index]:
            worker.users -= 1
            done = worker.broken and worker.users == 0
            if done and self._running[index] is worker:
                self._running[index] = None
        if done:
            worker.process.kill()  # it may be alive but out of step
            worker.stop()
            log.warning(
                "I/O worker %s (pid %d) %s; its requests failed (their blocks too), the "
                "next one starts a new worker",
                worker.name, worker.process.pid,
                worker.why or f"is gone (exit status {worker.process.returncode})",
            )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
