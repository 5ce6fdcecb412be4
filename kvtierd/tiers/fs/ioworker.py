"""The fs tier's I/O worker process: its own side (docs/design/tiers.md).

An I/O thread of the daemon that runs a group of block reads or writes hands
the file work (checksum, open, pwritev/preadv, rename) to an *I/O worker*: a
child process (``python -m kvtierd.tiers.fs.ioworker DAEMON_PID FD...``) that
maps the pool's shared-memory region itself and runs
:mod:`kvtierd.tiers.fs.blockfile` on its rows. The daemon's event loop and gRPC
threads then no longer compete with the I/O for one interpreter lock; the I/O
thread only sends a request and waits on a socket (GIL released).

This module is what runs in that process (and :class:`Worker`, which the
daemon's inline I/O reuses); the daemon's side, which starts, times out,
replaces and stops the processes, is :mod:`.blockio`; the messages they
exchange are :mod:`.iowire`'s.

Invariants:

* A worker process serves several *channels* (socket pairs), one thread each,
  one request at a time per channel; it answers every request before reading
  the next, so no worker touches a row after its job's ``on_done`` ran.
* The worker opens the region by path and refuses it unless its
  ``(st_dev, st_ino)`` is the one the daemon sent; it keeps the mapping until
  it exits (pools live as long as the daemon). It holds no lock on the region
  file: the daemon's ``flock`` stays the only liveness marker.
* A worker exits when its sockets reach EOF (the daemon stopped it), and is
  killed by the kernel when the daemon's spawner thread ends, which includes
  the daemon dying (:func:`~kvtierd.util.workerproc.die_with`): a killed daemon
  leaves no worker writing behind its back. A worker that dies alone fails the
  requests in flight on it; a failed read never makes a row visible, so no
  wrong bytes are served.
* Rows: a worker process hashes, writes and reads rows in its own mapping
  (zero-copy), each row checked against the region file's size first. A client
  that truncates the region fails the blocks whose rows are gone (EFAULT,
  logged by the tier); at worst a truncation racing a copy kills a worker,
  never the daemon.
* Nothing is unpickled (:mod:`.iowire`). A tier with integrity keys sends them
  in each request's parameters (:meth:`KeyRing.wire`: a socket pair only the
  daemon and its worker hold); the worker seals and verifies with them
  (:mod:`kvtierd.tiers.integrity`) and keeps no other copy.
* A request names its pool directory and each block file relative to it; the
  worker resolves them with :class:`~kvtierd.tiers.fs.safefs.PoolDir`, so no
  symlink below the pool directory is followed and no open blocks (a FIFO in
  place of a block file is a bad file, not a hang).
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtierd.primary.rows import RegionCutShort
from kvtierd.tiers.fs import blockfile
from kvtierd.tiers.fs.iowire import (
    READY,
    WRITE,
    RegionRef,
    Reply,
    encode_error,
    receive_message,
    send_message,
)
from kvtierd.tiers.fs.safefs import PoolDir, UnexpectedEntry
from kvtierd.tiers.integrity import KeyRing
from kvtierd.util.workerproc import die_with


class RowAccess(Protocol):
    """How a :class:`Worker` reaches the rows of one region."""

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


class Worker:
    """Runs block I/O requests one at a time (one channel of a worker process,
    or one I/O thread of :class:`~kvtierd.tiers.fs.blockio.InlineIo`)."""

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
            error = encode_error(_refused(exc) if isinstance(exc, UnexpectedEntry) else exc)
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
                replies.append(encode_error(exc))
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


def serve(sock: socket.socket, worker: Worker) -> None:
    """Says it is ready (its interpreter started: the daemon's reply timeout counts
    from here), then answers one channel's requests until the daemon closes it."""
    try:
        send_message(sock, READY)
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
        threading.Thread(target=serve, args=(socket.socket(fileno=int(fd)), Worker(regions.rows)))
        for fd in argv[1:]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
