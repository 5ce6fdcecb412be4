"""The warm-restart journal's row checksums, computed in a helper process.

The journal (:mod:`kvtierd.primary.warm.journal`) records ``xxh3_64`` of each completed
block's covered bytes. Hashing in the daemon cost it twice over on the store
path: the covered bytes had to be *copied* out of the mapping first
(``process_vm_readv``, because a client may truncate the region file and a
mapped page past its end kills the reader with SIGBUS), and the copy plus the
per-row Python work held the interpreter lock the event loop needs. A *hash
worker* (``python -m kvtierd.primary.warm.hashworker ...``, one per journal) instead maps the
region read-only itself and hashes the rows **in place**: no copy, its own
interpreter lock, and a SIGBUS from a truncated file kills the worker, never
the daemon. It runs at the daemon's own scheduling priority: its work is bounded by
the stores (one read of each completed row's covered bytes; about 1% of a core
at 10,000 stores of 4 KiB a second here), and a completion survives a crash only
once hashed. (Niced to 10 it got almost no CPU on a node whose cores were all
busy: the journal fell 2-5 s behind a storm, past ``memory.warm_restart_max_lag``.)

Invariants:

* The checksum of a row is the same value :func:`kvtierd.primary.warm.rowsums.row_checksum`
  and :func:`kvtierd.primary.warm.rowsums.read_row_checksum` give: ``xxh3_64`` of the covered
  spans in order (one streaming state per row, so no copy is needed).
* A worker vouches only for rows that lie inside the region file as it
  ``fstat``-s it when the request arrives; a truncation racing the hashing
  kills it (SIGBUS) and the daemon then vouches for none of that request's
  rows. A reply therefore never carries a checksum of bytes it could not read.
* A worker never holds the region's liveness ``flock``: it gets a descriptor
  of the region file opened anew (``/proc/self/fd``: a new open file
  description, read-only), never a copy of the daemon's, which holds the lock.
  Else a worker outliving a SIGKILLed daemon by a moment (on a busy machine its
  death waits for the CPU) kept the next daemon from adopting or replacing the
  region ("held by another live kvtierd").
* The journal thread that spawned a worker is its only user (one request at a
  time, request then reply, no ids); the worker exits at EOF and is killed by
  the kernel when that thread ends (``PR_SET_PDEATHSIG``), which includes the
  daemon dying.
* Messages are bounded: a request names at most :data:`MAX_ROWS_PER_REQUEST`
  rows (u32 each); a reply is 9 bytes per row. Nothing is unpickled.

Wire (little-endian, one Unix stream socket): once mapped, the worker sends one
byte (:data:`READY`); then request ``u32 n | n x u32 row``, reply ``n x u64
checksum | n x u8 valid`` (0: the row was not inside the file).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
from array import array
from collections.abc import Sequence
from typing import NoReturn

import xxhash

from kvtierd.util.workerproc import die_with, reap

log = logging.getLogger(__name__)

MAX_ROWS_PER_REQUEST = 4096  # the journal's batch cap: requests stay under 16 KiB
REPLY_TIMEOUT_S = 60.0  # a worker silent this long on one request is killed
# the worker maps the region afresh after hashing rows spanning this many bytes:
# its page tables (~2 MiB per GiB of rows touched) stay bounded by ~16 MiB
REMAP_EVERY_BYTES = 8 << 30
_STOP_WAIT_S = 2.0
_COUNT = struct.Struct("<I")
READY = b"R"  # the worker's first byte: mapped, serving


class WorkerDied(OSError):
    """The hash worker exited, stalled or answered out of step during a request."""


# -- the daemon side ------------------------------------------------------------------


class HashWorker:
    """One running hash worker of a journal, and the journal thread's end of its socket.

    Not thread-safe: only the journal thread that created it calls
    :meth:`checksums`; :meth:`interrupt` may be called from any thread to unblock it.
    """

    def __init__(
        self,
        name: str,
        region_fd: int,
        block_bytes: int,
        num_blocks: int,
        spans: Sequence[tuple[int, int]],
    ) -> None:
        """Starts the worker (blocking: fork + exec; its imports run in parallel
        and the first request waits for them). ``region_fd`` is the daemon's
        descriptor of the region file (not owned; the worker gets the file opened
        anew, read-only: see the module docstring). Raises OSError if the process
        cannot be started."""
        worker_fd = _reopen_read_only(region_fd)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spans_arg = ",".join(f"{start}:{end}" for start, end in spans)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvtierd.primary.warm.hashworker", str(os.getpid()),
                 str(theirs.fileno()), str(worker_fd), str(block_bytes), str(num_blocks),
                 spans_arg],
                pass_fds=[theirs.fileno(), worker_fd],
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(worker_fd)
        ours.settimeout(REPLY_TIMEOUT_S)
        self.name = name
        self._sock = ours
        self._num_blocks = num_blocks
        self._ready = False
        self.broken = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self) -> bool:
        """Whether the worker has started and mapped the region (it said so); does
        not block. Until then its user hashes elsewhere: a worker starting slowly
        on a saturated node (its Python start-up) must not hold the journal.
        Raises WorkerDied if it exited or sent anything else."""
        return self._take_ready(socket.MSG_DONTWAIT)

    def _take_ready(self, flags: int) -> bool:
        if not self._ready:
            try:
                first = self._sock.recv(1, flags)
            except BlockingIOError:
                return False
            except OSError as exc:
                self._died(exc)
            if first != READY:
                self._died(EOFError("the worker ended before it was ready"))
            self._ready = True
        return True

    def checksums(self, rows: Sequence[int]) -> list[int | None]:
        """The checksum of each row (None: not inside the region file), at most
        :data:`MAX_ROWS_PER_REQUEST` rows per request. Raises WorkerDied (and marks
        the worker broken) if it is gone, stalled or out of step: then none of
        the rows is vouched for. Waits for the worker to be ready."""
        self._take_ready(0)
        sums: list[int | None] = []
        for first in range(0, len(rows), MAX_ROWS_PER_REQUEST):
            sums.extend(self._request(rows[first : first + MAX_ROWS_PER_REQUEST]))
        return sums

    def _request(self, rows: Sequence[int]) -> list[int | None]:
        count = len(rows)
        try:
            self._sock.sendall(_COUNT.pack(count) + array("I", rows).tobytes())
            reply = _receive_exactly(self._sock, 9 * count)
        except (OSError, EOFError) as exc:
            self._died(exc)
        sums = array("Q")
        sums.frombytes(reply[: 8 * count])
        valid = reply[8 * count :]
        return [checksum if valid[i] == 1 else None for i, checksum in enumerate(sums)]

    def _died(self, exc: BaseException) -> NoReturn:
        self.broken = True
        code = self.process.poll()
        raise WorkerDied(
            errno.EIO,
            f"hash worker {self.name} (pid {self.pid}) "
            f"{'died with exit status ' + str(code) if code is not None else 'stopped'}"
            f": {exc or type(exc).__name__}",
        ) from None

    def interrupt(self) -> None:
        """Wakes a request blocked on the worker (it fails with WorkerDied). Any thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop(self) -> None:
        """Closes the socket (the worker exits at EOF) and reaps it; kills it if it
        does not exit within a short wait. Journal thread, or after it ended."""
        self._sock.close()
        if self.broken:
            self.process.kill()
        reap(self.process, _STOP_WAIT_S, _STOP_WAIT_S, log, f"hash worker {self.name}")


def _reopen_read_only(region_fd: int) -> int:
    """The region file ``region_fd`` names, opened anew read-only: a new open file
    description, so not one that holds the daemon's ``flock``. Raises OSError."""
    return os.open(f"/proc/self/fd/{region_fd}", os.O_RDONLY | os.O_CLOEXEC)


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the worker closed its socket")
        got += k
    return bytes(buf)


# -- the worker process ---------------------------------------------------------------


class _RowHasher:
    """Hashes rows of a read-only mapping of the region in place; maps it afresh
    every :data:`REMAP_EVERY_BYTES` of rows touched (bounded page tables)."""

    def __init__(
        self, region_fd: int, block_bytes: int, num_blocks: int, spans: list[tuple[int, int]]
    ) -> None:
        self._fd = region_fd
        self._block_bytes = block_bytes
        self._num_blocks = num_blocks
        self._spans = spans
        self._mapping = mmap.mmap(region_fd, block_bytes * num_blocks, prot=mmap.PROT_READ)
        self._view = memoryview(self._mapping)
        self._state = xxhash.xxh3_64()
        self._touched_bytes = 0  # rows hashed since the mapping was made, in bytes

    def _remap(self) -> None:
        self._view.release()
        self._mapping.close()
        self._mapping = mmap.mmap(
            self._fd, self._block_bytes * self._num_blocks, prot=mmap.PROT_READ
        )
        self._view = memoryview(self._mapping)
        self._touched_bytes = 0

    def reply(self, rows: array[int]) -> bytes:
        """``n x u64 checksum | n x u8 valid`` for ``rows``. Only rows wholly inside
        the file as it is now are touched (a truncation racing this kills us)."""
        if self._touched_bytes >= REMAP_EVERY_BYTES:
            self._remap()
        self._touched_bytes += len(rows) * self._block_bytes
        block, view, state, spans = self._block_bytes, self._view, self._state, self._spans
        inside = min(self._num_blocks, os.fstat(self._fd).st_size // block)
        sums = array("Q", bytes(8 * len(rows)))
        valid = bytearray(len(rows))
        single = len(spans) == 1
        for i, row in enumerate(rows):
            if row >= inside:
                continue
            base = row * block
            if single:
                start, end = spans[0]
                sums[i] = xxhash.xxh3_64_intdigest(view[base + start : base + end])
            else:
                state.reset()
                for start, end in spans:
                    state.update(view[base + start : base + end])
                sums[i] = state.intdigest()
            valid[i] = 1
        return sums.tobytes() + bytes(valid)


def serve(sock: socket.socket, hasher: _RowHasher) -> None:
    """Answers requests until the daemon closes the socket."""
    while True:
        try:
            head = _receive_exactly(sock, _COUNT.size)
        except (EOFError, ConnectionError):
            return
        (count,) = _COUNT.unpack(head)
        if count > MAX_ROWS_PER_REQUEST:
            return  # not the daemon's framing: stop (it sees EOF and vouches for nothing)
        rows = array("I")
        rows.frombytes(_receive_exactly(sock, 4 * count))
        sock.sendall(hasher.reply(rows))


def main(argv: Sequence[str]) -> int:
    """``DAEMON_PID SOCK_FD REGION_FD BLOCK_BYTES NUM_BLOCKS SPANS`` (started by
    kvtierd; SPANS is ``start:end,...``)."""
    try:
        daemon_pid, sock_fd, region_fd, block_bytes, num_blocks = (int(a) for a in argv[:5])
        spans = [(int(a), int(b)) for a, b in (s.split(":") for s in argv[5].split(","))]
    except (ValueError, IndexError):
        print("usage: python -m kvtierd.primary.warm.hashworker DAEMON_PID SOCK_FD REGION_FD "
              "BLOCK_BYTES NUM_BLOCKS SPANS (started by kvtierd)", file=sys.stderr)  # fmt: skip
        return 2
    if not die_with(daemon_pid):
        return 1  # the journal thread that started us is already gone
    sock = socket.socket(fileno=sock_fd)
    try:
        hasher = _RowHasher(region_fd, block_bytes, num_blocks, spans)
        sock.sendall(READY)
        serve(sock, hasher)
    except (BrokenPipeError, ConnectionError):
        pass  # the daemon went away while we answered
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
