"""Where an fs tier's block I/O runs, on the daemon's side (docs/design/tiers.md).

Owns :class:`BlockIo` (what a tier sends its block requests to) and its two
kinds: :class:`InlineIo` runs a request on the calling I/O thread, in the
daemon; :class:`IoWorkers` sends it to an I/O worker process
(:mod:`.ioworker`, the worker's own side) and supervises those processes:
starts them, times out and kills a silent one, replaces a dead one, stops
them all. The messages are :mod:`.iowire`'s.

Invariants:

* An I/O thread keeps one channel (socket) for life and holds the channel's
  lock for its request, so a channel carries one request at a time; the reply
  comes before the I/O thread records the group's outcomes.
* A worker that does not answer within ``reply_timeout`` (``io_worker_timeout``)
  is killed, and its request fails only once the process has exited: a row
  its blocks named is never handed to anyone else while it could still write.
* A broken worker is stopped by the last thread using it (``users``), so no
  socket is closed while a thread still uses it; the next request starts a
  new one.
* Every worker is started by one spawner thread that lives until
  :meth:`IoWorkers.stop`: a worker dies with the thread that started it
  (:func:`kvtierd.util.workerproc.die_with`), which includes the daemon dying.
* Inline I/O (``io_processes = 0``) never touches a region mapping: rows are
  copied through :class:`~kvtierd.primary.rows.RegionRows` and a per-thread
  bounce buffer (:class:`_CopiedRows`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn, Protocol

from kvtierd.primary.rows import RegionRows, scratch
from kvtierd.tiers.failures import IoUnavailable
from kvtierd.tiers.fs.iowire import READY, Reply, receive_message, send_message
from kvtierd.tiers.fs.ioworker import Worker
from kvtierd.util.workerproc import reap

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0  # seconds a worker gets to exit after EOF before it is killed
# a worker silent this long on one request is killed (fs option io_worker_timeout)
DEFAULT_REPLY_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0  # a new worker's interpreter may take this long to say READY
_KILL_WAIT = 1.0  # seconds to wait for a killed worker to be reaped


class WorkerDied(OSError, IoUnavailable):
    """The I/O worker process exited (or its socket broke) during a request. Transient
    (:mod:`kvtierd.tiers.failures`): the request failed as a whole, the blocks it named
    are not in question, and the next request gets a new worker."""

    cause = "the I/O worker process died during the request"


class WorkerStalled(WorkerDied):
    """The I/O worker did not answer within ``io_worker_timeout`` and was killed."""

    cause = "the I/O worker did not answer within io_worker_timeout and was killed"


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
            worker = self._local.worker = Worker(lambda _region: self._rows)
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
        self._started = [False] * channels  # READY read on that channel
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
                if not self._started[channel]:
                    self._await_ready(sock)
                    self._started[channel] = True
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

    def _await_ready(self, sock: socket.socket) -> None:
        """Reads the worker's READY (its interpreter's start is not the request's
        time: on a loaded machine it can take seconds); WorkerDied past
        START_TIMEOUT_S or on anything else."""
        try:
            hello = receive_message(sock, time.monotonic() + START_TIMEOUT_S)
        except TimeoutError:
            self._stalled(f"did not start within {START_TIMEOUT_S:g}s and was killed")
        if tuple(hello) != READY:
            raise ValueError(f"first message {hello!r}, not READY")

    def _stalled(self, why: str = "") -> NoReturn:
        """No answer within ``reply_timeout``: kills the process and waits until it
        has exited (it maps the region: until then it could still write a row the
        failed request named), then raises WorkerStalled."""
        self.broken = True
        why = why or (
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
        raise WorkerStalled(
            errno.ETIMEDOUT, f"I/O worker {self.name} (pid {self.process.pid}) {why}"
        )

    def stop(self, deadline: float | None = None) -> None:
        """Closes the sockets (the worker exits at EOF) and reaps the process; kills
        it if it has not exited by ``deadline`` (monotonic; default: now +
        ``STOP_WAIT_S``). Bounded: a process that does not even die when killed
        (stuck in the kernel) is left behind, with a WARNING."""
        for sock in self.socks:
            sock.close()
        if deadline is None:
            deadline = time.monotonic() + STOP_WAIT_S
        reap(self.process, deadline - time.monotonic(), _KILL_WAIT, log, f"I/O worker {self.name}")


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
                "I/O worker %s (pid %d) %s; its requests failed for now (no block file "
                "removed; their blocks are tried again), the next one starts a new worker",
                worker.name, worker.process.pid,
                worker.why or f"is gone (exit status {worker.process.returncode})",
            )  # fmt: skip
