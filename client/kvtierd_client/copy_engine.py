"""Copies blocks between an engine's KV tensors and the rows of a pool's region.

One :class:`CopyEngine` per worker (rank). The worker's KV cache is one or more
tensors whose first dimension is the engine block id; each block of each tensor
is a contiguous *tensor page*. The worker's *rank page* is the concatenation of
its tensor pages, in the order the tensors were given, and rank ``r`` owns bytes
``[r * page_bytes, (r + 1) * page_bytes)`` of every region row::

    row: [ rank 0: t0 | t1 | ... | pad ][ rank 1: t0 | t1 | ... | pad ] ... [ pad ]

So several workers of one engine (tensor-parallel ranks) share a row without
sharing a byte, and a block stored by one engine is loaded by another engine with
the same layout (the pool's ``layout`` string says which).

Ownership: the engine owns neither the region (the caller attached it and closes
it, after closing the engine) nor the KV tensors (the model owns them); it owns
its CUDA stream, its events and a CPU staging buffer. The daemon decides which
region rows a job may write (PrepareStore) or read (PrepareLoad); the engine
only moves bytes.

Completion: on CPU, copies run inside ``submit_*`` and the job has finished when
it returns. On CUDA, copies are queued on the engine's own stream behind
everything already queued on the current (compute) stream, and a CUDA event
marks each job's end; :meth:`CopyEngine.poll` and :meth:`CopyEngine.wait`
observe them. The API is the same on both.

Not thread-safe: one worker thread drives an engine.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtierd_client._shm import copies
from kvtierd_client._shm.copies import (
    Direction,
    Plan,
    Staging,
    block_view,
    common_device,
    copy_cuda_runs,
    numpy_of,
    plan_job,
    split_page,
    widest_pair,
)

if TYPE_CHECKING:
    from kvtierd_client.region import AttachedRegion

STAGING_BYTES = 8 << 20  # a CPU engine's gather/scatter buffer, allocated on first use


@dataclass(frozen=True)
class CopyEngineStatistics:
    """A snapshot of one engine's counters. Blocks and bytes count finished jobs."""

    jobs_submitted: int
    jobs_finished: int
    blocks_stored: int
    blocks_loaded: int
    bytes_stored: int
    bytes_loaded: int

    @property
    def jobs_pending(self) -> int:
        return self.jobs_submitted - self.jobs_finished

    @property
    def bytes_copied(self) -> int:
        return self.bytes_stored + self.bytes_loaded


@dataclass
class _Job:
    job_id: int
    direction: Direction
    num_blocks: int
    num_bytes: int
    event: Any = None  # torch.cuda.Event on CUDA; None on CPU (finished at submit)
    lease_deadline: float | None = None  # the fence (monotonic seconds), if any


class LeaseLostError(RuntimeError):
    """A copy to or from region rows was refused: the lease of the session holding
    them is not proven alive."""


def _check_lease(lease_deadline: float | None, direction: Direction, now: float) -> None:
    if lease_deadline is not None and now >= lease_deadline:
        raise LeaseLostError(
            f"{direction} refused: the lease of the session holding these rows is not "
            "proven alive (no keepalive answered in time); the daemon may have given "
            "the rows to another session"
        )


class CopyEngine:
    """Moves blocks of one rank between its KV tensors and its slice of region rows.

    Args:
        region: the attached region (this engine does not close it).
        kv_tensors: the worker's KV cache tensors, first dimension = engine block
            id, each block contiguous; all on one device (CPU or one CUDA device).
        rank: which page of every row is this worker's.
        page_bytes: the rank page's size; default and minimum: the sum of the
            tensor pages. Every rank of a pool must use the same value.
        clock: monotonic seconds, read against ``lease_deadline`` when a job is
            submitted and when it finishes (tests inject one).

    Raises:
        ValueError: a tensor is not per-block contiguous, blocks overlap, tensors
            sit on different devices, ``page_bytes`` is too small, or the rank's
            page does not fit in a row.
        RuntimeError: ``cudaHostRegister`` of the region failed (CUDA tensors).
    """

    def __init__(
        self,
        region: AttachedRegion,
        kv_tensors: Sequence[torch.Tensor],
        *,
        rank: int = 0,
        page_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not kv_tensors:
            raise ValueError("kv_tensors is empty: nothing to copy")
        self._device = common_device(kv_tensors)
        engine_views = [block_view(t, i) for i, t in enumerate(kv_tensors)]
        num_engine_blocks = {v.shape[0] for v in engine_views}
        if len(num_engine_blocks) != 1:
            raise ValueError(
                f"kv_tensors disagree on the number of engine blocks: {sorted(num_engine_blocks)}"
            )
        used_bytes = sum(v.shape[1] for v in engine_views)
        page_bytes = used_bytes if page_bytes is None else page_bytes
        if page_bytes < used_bytes:
            raise ValueError(
                f"page_bytes {page_bytes} is smaller than the {used_bytes} bytes of one block "
                f"of the {len(engine_views)} kv tensors"
            )
        rank_view = region.rank_view(rank, page_bytes)  # ValueError if it does not fit
        region_views = split_page(rank_view, [v.shape[1] for v in engine_views])
        views = [widest_pair(e, r) for e, r in zip(engine_views, region_views, strict=True)]
        self.region = region
        self.rank = rank
        self._clock = clock
        self.page_bytes = page_bytes
        self.num_engine_blocks = num_engine_blocks.pop()
        # Invariant: _engine_views[i] and _region_views[i] have one dtype and one row
        # width: tensor i's page, viewed as uint8, int16, int32 or int64.
        self._engine_views = [e for e, _ in views]
        self._region_views = [r for _, r in views]
        # CPU: the same views as numpy arrays (None where one cannot be made), for
        # the large runs' copies (see copy_cpu)
        self._engine_arrays = [numpy_of(e) for e in self._engine_views]
        self._region_arrays = [numpy_of(r) for r in self._region_views]
        self._bytes_per_block = used_bytes  # bytes one block moves (padding excluded)
        self._staging = Staging(STAGING_BYTES)
        self._stream: Any = None  # torch.cuda.Stream on CUDA, None on CPU
        if self._device.type == "cuda":
            with torch.cuda.device(self._device):
                region.register_cuda()
                self._stream = torch.cuda.Stream(device=self._device)
        self._next_job_id = 1
        # Invariant: ids in _pending and in _unreported ascend, and every pending id is
        # greater than every unreported id (one stream: jobs finish in order).
        self._pending: collections.deque[_Job] = collections.deque()  # CUDA only
        self._unreported: list[int] = []  # finished, not yet returned by poll()
        # finished stores that ended past their write deadline, not yet returned by
        # late_jobs(); a subset of the finished jobs (bounded like _unreported)
        self._late: list[int] = []
        self._closed = False
        self._jobs_finished = 0
        self._blocks = {"store": 0, "load": 0}
        self._bytes = {"store": 0, "load": 0}

    # -- submission -----------------------------------------------------------

    def submit_store(
        self, pairs: Sequence[tuple[int, int]], *, lease_deadline: float | None = None
    ) -> int:
        """Copies engine blocks into region rows: (engine block id, region block id) pairs.

        Every id is checked first: ValueError naming the first bad one, and
        nothing is copied. Region block ids must be distinct. Returns the job id.

        ``lease_deadline`` (monotonic seconds; ``Session.lease_deadline`` of the
        session that reserved the rows) is the fence (docs/design/leases.md):
        past it, :class:`LeaseLostError` is raised and nothing is copied; a job
        that *finishes* past it is reported by :meth:`late_jobs`, and its store
        must be completed with ``success=False``.
        """
        _check_lease(lease_deadline, "store", self._clock())
        return self._submit("store", pairs, lease_deadline)

    def submit_load(
        self, pairs: Sequence[tuple[int, int]], *, lease_deadline: float | None = None
    ) -> int:
        """Copies region rows into engine blocks: (region block id, engine block id) pairs.

        Every id is checked first: ValueError naming the first bad one, and
        nothing is copied. Engine block ids must be distinct. Returns the job id.

        ``lease_deadline``: as for :meth:`submit_store`, for the session that
        pinned the rows; a load reported by :meth:`late_jobs` may hold another
        key's bytes (its pins may have been released and the rows reused): do not
        use it.
        """
        _check_lease(lease_deadline, "load", self._clock())
        return self._submit("load", pairs, lease_deadline)

    # -- completion -----------------------------------------------------------

    def poll(self) -> list[int]:
        """Ids of the jobs that finished since the last poll, in submission order.

        Never blocks. A job that :meth:`wait` saw finish is still reported here, once.
        """
        self._collect(block_until=0)
        finished, self._unreported = self._unreported, []
        return finished

    def wait(self, job_ids: Iterable[int]) -> None:
        """Blocks until every job in ``job_ids`` has finished.

        Jobs that already finished (reported or not) return at once. Raises
        ValueError for an id this engine never returned.
        """
        ids = list(job_ids)
        for job_id in ids:
            if not 1 <= job_id < self._next_job_id:
                raise ValueError(f"job id {job_id} was never submitted to this engine")
        if ids:
            self._collect(block_until=max(ids))

    def late_jobs(self) -> list[int]:
        """Ids of finished jobs that ended after their ``lease_deadline``, each
        reported once: their rows may no longer be theirs, so a store failed
        (``complete_store(success=False)``) and a load's bytes must not be used.
        Call after :meth:`poll` or :meth:`wait`."""
        late, self._late = self._late, []
        return late

    def statistics(self) -> CopyEngineStatistics:
        return CopyEngineStatistics(
            jobs_submitted=self._next_job_id - 1,
            jobs_finished=self._jobs_finished,
            blocks_stored=self._blocks["store"],
            blocks_loaded=self._blocks["load"],
            bytes_stored=self._bytes["store"],
            bytes_loaded=self._bytes["load"],
        )

    def close(self) -> None:
        """Waits for every job, then drops the engine's views of the region and the
        tensors (so that the region can be unmapped) and refuses new jobs.
        Idempotent; the region stays open."""
        if self._closed:
            return
        self._collect(block_until=self._next_job_id - 1)
        self._closed = True
        self._engine_views = []
        self._region_views = []
        self._engine_arrays = []
        self._region_arrays = []
        self._staging = Staging(STAGING_BYTES)  # frees the buffer

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _submit(
        self,
        direction: Direction,
        pairs: Sequence[tuple[int, int]],
        lease_deadline: float | None = None,
    ) -> int:
        if self._closed:
            raise RuntimeError("this copy engine is closed")
        engine = ("engine", self.num_engine_blocks)
        region = ("region", self.region.num_blocks)
        if direction == "store":
            plan = plan_job(direction, pairs, engine, region)
            sources, destinations = self._engine_views, self._region_views
            arrays = zip(self._engine_arrays, self._region_arrays, strict=True)
        else:
            plan = plan_job(direction, pairs, region, engine)
            sources, destinations = self._region_views, self._engine_views
            arrays = zip(self._region_arrays, self._engine_arrays, strict=True)
        job = _Job(
            job_id=self._next_job_id,
            direction=direction,
            num_blocks=len(plan.src),
            num_bytes=len(plan.src) * self._bytes_per_block,
            lease_deadline=lease_deadline,
        )
        # inference_mode: KV caches allocated under it are inference tensors, which
        # refuse in-place writes outside it; ordinary tensors accept them inside.
        with torch.inference_mode():
            if self._stream is None:
                for src, dst, (src_np, dst_np) in zip(sources, destinations, arrays, strict=True):
                    copies.copy_cpu(src, dst, plan, self._staging, src_np, dst_np)
            else:
                job.event = self._copy_cuda(sources, destinations, plan)
        self._next_job_id += 1
        if job.event is None:
            self._finish(job)
        else:
            self._pending.append(job)
        return job.job_id

    def _copy_cuda(
        self, sources: list[torch.Tensor], destinations: list[torch.Tensor], plan: Plan
    ) -> Any:
        """Queues the copies on the engine's stream behind the compute stream; returns
        the event that marks their end."""
        stream = self._stream
        with torch.cuda.device(self._device):
            # Stores must see the model's finished writes; loads must not land
            # before queued compute that still reads or writes those blocks.
            stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                for src, dst in zip(sources, destinations, strict=True):
                    copy_cuda_runs(src, dst, plan)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _collect(self, block_until: int) -> None:
        """Moves finished jobs from pending to unreported, in order; synchronizes on
        the events of jobs with id <= ``block_until`` (0: never blocks)."""
        while self._pending:
            job = self._pending[0]
            if job.job_id <= block_until:
                job.event.synchronize()
            elif not job.event.query():
                break
            self._pending.popleft()
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        if job.lease_deadline is not None and self._clock() >= job.lease_deadline:
            self._late.append(job.job_id)
        self._unreported.append(job.job_id)
        self._jobs_finished += 1
        self._blocks[job.direction] += job.num_blocks
        self._bytes[job.direction] += job.num_bytes


# -- validation and planning ---------------------------------------------------


# -- CPU copies ----------------------------------------------------------------


# -- CUDA copies ---------------------------------------------------------------
