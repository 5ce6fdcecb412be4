"""A dual-queue I/O thread pool whose completions land on an asyncio loop: the
threads of the tiers that move blocks off the loop (fs, redis).

Work is submitted in *batches* (one tier job = one batch of tasks; the fs and
redis tiers make one task per group of blocks, about 16 MiB: :func:`group_tasks`,
whose per-group outcomes :func:`flatten` turns back into one per block).
Read-priority threads (``<name>-r<i>``; a configured tier's ``kvtierd-<tier>-r<i>``)
pop the read queue first, write-priority threads (``<name>-w<i>``) the write queue
first; both drain either queue, so no thread idles while work waits.

Invariants:

* every accepted batch's ``on_done`` runs exactly once, on the loop (through
  ``loop.call_soon_threadsafe``), after every task of the batch has an
  :class:`Outcome` — including batches failed by :meth:`IoPool.shutdown`;
* a task's exception is caught and becomes that task's failed outcome;
* writes are bounded: a write batch is refused (nothing queued) if accepting it
  would exceed ``max_queue_jobs`` pending write batches or ``max_queue_bytes``
  pending write bytes (pending = accepted, not yet done). Reads are unbounded.
* the pending counters are guarded by the pool's condition lock; the
  outstanding-batch count used by :meth:`drain` lives on the loop thread only
  (:class:`JobsInFlight`, which the memory tier counts its jobs with too).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.contract import BlockKey
from kvtierd.tiers.failures import IoUnavailable

log = logging.getLogger(__name__)

Task = Callable[[], Any]
JOIN_S = 2.0  # shutdown waits this long in all for the threads to finish their tasks
# the tiers' defaults of max_queue_jobs and max_queue_bytes: cascade writes queued at most
DEFAULT_QUEUE_JOBS = 1024
DEFAULT_QUEUE_BYTES = 1 << 30


class PoolShutDown(IoUnavailable):
    """The pool shut down before the task ran (transient: the block is not in question)."""

    cause = "the tier's I/O threads shut down before the block was read"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one task ended: ``value`` if it returned, ``error`` if it raised."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


BatchCallback = Callable[[list[Outcome]], None]


class JobsInFlight:
    """Jobs (or batches) accepted and not reported yet, and the :meth:`drain` callers
    waiting for none to be left. Loop thread only.

    Invariant: :attr:`count` >= 0; every waiter is woken the moment it reaches 0.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.count = 0
        self._waiters: list[asyncio.Future[None]] = []

    def add(self) -> None:
        """One more accepted (count n -> n+1)."""
        self.count += 1

    def done(self) -> None:
        """One reported (count n -> n-1); at 0 every :meth:`drain` caller returns."""
        self.count -= 1
        assert self.count >= 0, "more jobs reported than accepted"
        if self.count == 0:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def drain(self) -> None:
        """Returns once every job accepted so far has reported."""
        if self.count == 0:
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter


class _Batch:
    """Outcomes of one batch; completed by whichever thread records the last one."""

    __slots__ = ("callback", "nbytes", "outcomes", "remaining", "is_write")

    def __init__(self, n: int, callback: BatchCallback, nbytes: int, is_write: bool) -> None:
        self.callback = callback
        self.nbytes = nbytes
        self.is_write = is_write
        self.outcomes: list[Outcome | None] = [None] * n
        self.remaining = n


class IoPool:
    """Read/write thread pool; see the module docstring for the invariants."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        read_threads: int,
        write_threads: int,
        max_queue_jobs: int = DEFAULT_QUEUE_JOBS,
        max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        name: str = "kvtierd-io",
    ) -> None:
        if read_threads < 0 or write_threads < 0 or read_threads + write_threads < 1:
            raise ValueError(
                f"need at least one I/O thread (read_threads={read_threads}, "
                f"write_threads={write_threads})"
            )
        self._loop = loop
        self.max_queue_jobs = max_queue_jobs
        self.max_queue_bytes = max_queue_bytes
        self._cond = threading.Condition()
        self._reads: deque[tuple[Task, _Batch, int]] = deque()  # guarded by _cond
        self._writes: deque[tuple[Task, _Batch, int]] = deque()  # guarded by _cond
        self._pending_write_jobs = 0  # guarded by _cond
        self._pending_write_bytes = 0  # guarded by _cond
        self._stopping = False  # guarded by _cond
        # batches failed because shutdown came before they ran (any thread reads it
        # after shutdown returned): the jobs a stop dropped
        self.dropped_batches = 0
        self._outstanding = JobsInFlight(loop)  # accepted batches not yet delivered
        self._threads = [
            threading.Thread(target=self._worker, args=(True,), name=f"{name}-r{i}", daemon=True)
            for i in range(read_threads)
        ] + [
            threading.Thread(target=self._worker, args=(False,), name=f"{name}-w{i}", daemon=True)
            for i in range(write_threads)
        ]
        for thread in self._threads:
            thread.start()

    # -- submission (loop thread) ----------------------------------------------

    def submit_read(self, tasks: Sequence[Task], on_done: BatchCallback) -> None:
        """Queues a read batch (never refused, except after shutdown: failed at once)."""
        self._submit(tasks, on_done, 0, is_write=False)

    def submit_write(self, tasks: Sequence[Task], on_done: BatchCallback, nbytes: int) -> bool:
        """Queues a write batch of ``nbytes``; False (nothing queued) when over the limits."""
        with self._cond:
            if not self._stopping and (
                self._pending_write_jobs + 1 > self.max_queue_jobs
                or self._pending_write_bytes + nbytes > self.max_queue_bytes
            ):
                return False
        self._submit(tasks, on_done, nbytes, is_write=True)
        return True

    def _submit(
        self, tasks: Sequence[Task], on_done: BatchCallback, nbytes: int, *, is_write: bool
    ) -> None:
        batch = _Batch(len(tasks), on_done, nbytes, is_write)
        self._outstanding.add()
        if not tasks:
            self._finish(batch)
            return
        with self._cond:
            stopping = self._stopping
            if is_write:
                self._pending_write_jobs += 1
                self._pending_write_bytes += nbytes
            if not stopping:
                queue = self._writes if is_write else self._reads
                queue.extend((task, batch, i) for i, task in enumerate(tasks))
                self._cond.notify(len(tasks))
                return
        for index in range(len(tasks)):
            self._record(batch, index, Outcome(error=PoolShutDown("I/O pool is shut down")))

    # -- state --------------------------------------------------------------------

    @property
    def queued_jobs(self) -> int:
        """Write batches accepted and not yet done (plus queued read tasks)."""
        with self._cond:
            return self._pending_write_jobs + len(self._reads)

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._pending_write_bytes

    async def drain(self) -> None:
        """Returns once every accepted batch's callback has run on the loop."""
        await self._outstanding.drain()

    def shutdown(self, join_s: float | None = None) -> None:
        """Fails every queued task (their batches still report once, counted in
        :attr:`dropped_batches`) and joins the threads.

        Tasks already running finish normally. Bounded: threads still running a
        task after ``join_s`` seconds in all (stuck in the file system) are left
        behind, named in a WARNING; they are daemon threads, so they never hold
        the process up, and their batches report when (if) their tasks end.
        ``join_s`` defaults to :data:`JOIN_S`. Idempotent.
        """
        if join_s is None:
            join_s = JOIN_S
        with self._cond:
            self._stopping = True
            queued = list(self._reads) + list(self._writes)
            self._reads.clear()
            self._writes.clear()
            self._cond.notify_all()
        self.dropped_batches += len({id(batch) for _, batch, _ in queued})
        for _, batch, index in queued:
            self._record(batch, index, Outcome(error=PoolShutDown("I/O pool shut down")))
        current = threading.current_thread()
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t is not current and t.is_alive()]
        if stuck:
            log.warning(
                "I/O threads %s still run a task after %gs (file system not answering?); "
                "leaving them behind", ", ".join(stuck), join_s,
            )  # fmt: skip

    # -- workers --------------------------------------------------------------------

    def _worker(self, read_first: bool) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._reads and not self._writes:
                    self._cond.wait()
                if self._stopping:
                    return
                first, second = (
                    (self._reads, self._writes) if read_first else (self._writes, self._reads)
                )
                task, batch, index = (first or second).popleft()
            self._record(batch, index, _run(task))

    def _record(self, batch: _Batch, index: int, outcome: Outcome) -> None:
        with self._cond:
            batch.outcomes[index] = outcome
            batch.remaining -= 1
            if batch.remaining:
                return
            if batch.is_write:
                self._pending_write_jobs -= 1
                self._pending_write_bytes -= batch.nbytes
        self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.debug("I/O batch finished after its event loop closed")

    def _deliver(self, batch: _Batch) -> None:
        """Runs on the loop: the batch's callback, then drain() waiters if idle."""
        try:
            batch.callback([o for o in batch.outcomes if o is not None])
        except Exception:
            log.exception("I/O batch completion callback failed")
        finally:
            self._outstanding.done()


def _run(task: Task) -> Outcome:
    start = time.perf_counter()
    try:
        value = task()
    except Exception as exc:  # a task failure is an outcome, never a dead thread
        return Outcome(error=exc, seconds=time.perf_counter() - start)
    return Outcome(value=value, seconds=time.perf_counter() - start)


GROUP_BYTES = 16 << 20  # blocks per I/O task: this many bytes (at least one block)

Pairs = list[tuple[BlockKey, int]]  # (key, row) of one group of a job


def group_tasks(
    pairs: Pairs, block_bytes: int, per_group: Callable[[Pairs], list[Outcome]]
) -> tuple[list[Callable[[], list[Outcome]]], list[int]]:
    """A job's (key, row) ``pairs`` in groups of up to :data:`GROUP_BYTES`, and the
    group sizes. A task runs its group in order and returns one
    :class:`Outcome` per block: fewer, longer tasks than one per block mean
    less queue and lock traffic and fewer threads contending for the CPU and
    the GIL, while a large job still spreads over several threads."""
    size = max(1, GROUP_BYTES // block_bytes)
    groups = [pairs[i : i + size] for i in range(0, len(pairs), size)]
    return [functools.partial(per_group, group) for group in groups], [len(g) for g in groups]


def flatten(outcomes: list[Outcome], sizes: list[int]) -> list[Outcome]:
    """Per-block outcomes from per-group ones (a group that failed as a whole, e.g.
    when the pool shut down before running it, fails each of its blocks)."""
    flat: list[Outcome] = []
    for outcome, size in zip(outcomes, sizes, strict=True):
        flat.extend(outcome.value if outcome.ok else [outcome] * size)
    return flat


def each_block(pairs: Pairs, run: Callable[[BlockKey, int], Any]) -> list[Outcome]:
    """One :class:`Outcome` per (key, row) of a group, in order: what ``run(key, row)``
    returned or raised, and how long it took (a failed block does not stop the rest)."""
    return [_run(functools.partial(run, key, row)) for key, row in pairs]
