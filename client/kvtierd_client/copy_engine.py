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
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from kvtierd_client.region import AttachedRegion

Direction = Literal["store", "load"]

# CPU: runs of at least this many bytes are one slice copy each; the rows of
# smaller runs are gathered and scattered with index_select / index_copy_.
LARGE_COPY_BYTES = 64 * 1024
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


@dataclass(frozen=True)
class _Plan:
    """A validated job: ``src[k] -> dst[k]`` sorted by destination, cut into runs.

    Run ``j`` is ``counts[j]`` consecutive rows from ``src[starts[j]]`` to
    consecutive rows from ``dst[starts[j]]``. Destinations are distinct.
    """

    src: np.ndarray  # int64
    dst: np.ndarray  # int64
    starts: np.ndarray  # int64, index of each run's first pair
    counts: np.ndarray  # int64, pairs in each run

    def runs(self, mask: np.ndarray | None = None) -> Iterable[tuple[int, int, int]]:
        """(src, dst, count) of every run (or of the runs selected by ``mask``)."""
        starts, counts = self.starts, self.counts
        if mask is not None:
            starts, counts = starts[mask], counts[mask]
        return zip(
            self.src[starts].tolist(), self.dst[starts].tolist(), counts.tolist(), strict=True
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
        self._device = _common_device(kv_tensors)
        engine_views = [_block_view(t, i) for i, t in enumerate(kv_tensors)]
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
        region_views = _split_page(rank_view, [v.shape[1] for v in engine_views])
        views = [_widest_pair(e, r) for e, r in zip(engine_views, region_views, strict=True)]
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
        # the large runs' copies (see _copy_cpu)
        self._engine_arrays = [_numpy_of(e) for e in self._engine_views]
        self._region_arrays = [_numpy_of(r) for r in self._region_views]
        self._bytes_per_block = used_bytes  # bytes one block moves (padding excluded)
        self._staging = _Staging(STAGING_BYTES)
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
        self._staging = _Staging(STAGING_BYTES)  # frees the buffer

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
            plan = _plan(direction, pairs, engine, region)
            sources, destinations = self._engine_views, self._region_views
            arrays = zip(self._engine_arrays, self._region_arrays, strict=True)
        else:
            plan = _plan(direction, pairs, region, engine)
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
                    _copy_cpu(src, dst, plan, self._staging, src_np, dst_np)
            else:
                job.event = self._copy_cuda(sources, destinations, plan)
        self._next_job_id += 1
        if job.event is None:
            self._finish(job)
        else:
            self._pending.append(job)
        return job.job_id

    def _copy_cuda(
        self, sources: list[torch.Tensor], destinations: list[torch.Tensor], plan: _Plan
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
                    _copy_cuda_runs(src, dst, plan)
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


# -- construction helpers ------------------------------------------------------


def _common_device(kv_tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in kv_tensors}
    if len(devices) != 1:
        raise ValueError(f"kv_tensors must all be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv_tensors must be CPU or CUDA tensors, got {device}")
    return device


def _block_view(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """``tensor`` as uint8 (num_engine_blocks, tensor_page_bytes), zero-copy.

    Each block (``tensor[b]``) must be contiguous and blocks must not overlap;
    the stride between blocks may be larger than a block (padding, a slice).
    """
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(f"kv_tensors[{index}] has shape {tuple(tensor.shape)}: no blocks")
    block_shape = tuple(tensor.shape[1:])
    elements = math.prod(block_shape)
    if elements == 0:
        raise ValueError(f"kv_tensors[{index}] has empty blocks (shape {tuple(tensor.shape)})")
    if not _is_contiguous(block_shape, tuple(tensor.stride()[1:])):
        raise ValueError(
            f"kv_tensors[{index}]: each block must be contiguous (shape {tuple(tensor.shape)}, "
            f"strides {tensor.stride()}); pass the tensor with the engine block id as its "
            "first dimension and a contiguous layout within a block"
        )
    if tensor.shape[0] > 1 and tensor.stride(0) < elements:
        raise ValueError(
            f"kv_tensors[{index}]: blocks overlap (stride {tensor.stride(0)} between blocks "
            f"of {elements} elements)"
        )
    flat = tensor.as_strided((tensor.shape[0], elements), (tensor.stride(0), 1))
    return flat.view(torch.uint8)


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _split_page(rank_view: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Tensor i's part of the rank page: columns [offset_i, offset_i + sizes[i])."""
    views, offset = [], 0
    for size in sizes:
        views.append(rank_view[:, offset : offset + size])
        offset += size
    return views


def _widest_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (uint8 row views of one width) reinterpreted as the widest
    integer type both allow. Element-wise kernels (index_copy_) move one element per
    step: int64 moves 8x the bytes of uint8 for the same work (measured 7x faster)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:  # width, stride or offset not a multiple of the size
            continue
    return a, b


# -- validation and planning ---------------------------------------------------


def _plan(
    direction: Direction,
    pairs: Sequence[tuple[int, int]],
    source: tuple[str, int],
    destination: tuple[str, int],
) -> _Plan:
    """Validates ``pairs`` ((name, number of blocks) for each side) and groups
    them into runs of consecutive rows, vectorized (a job may name thousands).

    Raises ValueError naming the first id that is not an integer or is out of
    range, or the first destination named twice (two sources for one
    destination have no defined result).
    """
    ids = _as_id_array(direction, pairs)
    for column, (name, limit) in enumerate((source, destination)):
        bad = (ids[:, column] < 0) | (ids[:, column] >= limit)
        if bad.any():
            value = ids[int(np.argmax(bad)), column]
            raise ValueError(
                f"{direction}: {name} block id {value} is out of range (0..{limit - 1}); "
                "nothing was copied"
            )
    order = np.argsort(ids[:, 1], kind="stable")
    src, dst = ids[order, 0], ids[order, 1]
    repeated = dst[1:] == dst[:-1]
    if repeated.any():
        raise ValueError(
            f"{direction}: {destination[0]} block id {dst[int(np.argmax(repeated))]} is a "
            "destination twice; nothing was copied"
        )
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks))) if len(dst) else np.zeros(0, int)
    counts = np.diff(np.append(starts, len(dst)))
    return _Plan(src=src, dst=dst, starts=starts, counts=counts)


def _as_id_array(direction: Direction, pairs: Sequence[tuple[int, int]]) -> np.ndarray:
    """``pairs`` as an int64 array of shape (n, 2); ValueError unless integers."""
    if len(pairs) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    try:
        ids = np.asarray(pairs)
    except (ValueError, TypeError, OverflowError):  # ragged, or not numbers
        ids = np.asarray([None])
    if ids.ndim != 2 or ids.shape[1] != 2 or ids.dtype.kind not in "iu":
        raise ValueError(_first_malformed(direction, pairs))
    return ids.astype(np.int64, copy=False)


def _first_malformed(direction: Direction, pairs: Sequence[tuple[int, int]]) -> str:
    for pair in pairs:
        try:
            values = tuple(pair)
        except TypeError:
            values = ()
        if len(values) != 2:
            return f"{direction}: expected (source, destination) pairs, got {pair!r}"
        for value in values:
            if isinstance(value, (bool, np.bool_)) or not _is_integer(value):
                return f"{direction}: block id {value!r} is not an integer"
    return f"{direction}: block ids must be integers that fit in int64"


def _is_integer(value: object) -> bool:
    try:
        value.__index__()  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        return False
    return True


# -- CPU copies ----------------------------------------------------------------


def _numpy_of(tensor: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's numpy view (same memory), or None (CUDA, or not viewable)."""
    if tensor.device.type != "cpu":
        return None
    try:
        return tensor.detach().numpy()
    except (RuntimeError, TypeError):
        return None


def _copy_cpu(
    src: torch.Tensor,
    dst: torch.Tensor,
    plan: _Plan,
    staging: _Staging,
    src_np: np.ndarray | None = None,
    dst_np: np.ndarray | None = None,
) -> None:
    """With numpy views of both sides (CPU tensors): one ``numpy.copyto`` per run
    (a memcpy per row, in the calling thread, the interpreter lock released; ~1 us
    of call per run, so no gather pass is needed for small rows). Otherwise large
    runs one slice ``copy_`` each, and the rows of small runs in gather/scatter
    passes through ``staging``: a few calls per job instead of one Python-level
    copy per row.

    Why numpy first: torch's ``copy_`` (and ``index_select``) spreads a copy over
    its intra-op threads, which on a machine whose cores are busy (an engine's
    scheduler, tokenizer, other processes) waits for descheduled workers: measured
    0.1x of numpy's GB/s with the load average at 3x the cores
    (docs/benchmarks/history.md, "SGLang backend").
    """
    if src_np is not None and dst_np is not None:
        for s, d, count in plan.runs():
            np.copyto(dst_np[d : d + count], src_np[s : s + count])
        return
    row_bytes = src.shape[1] * src.element_size()
    large = plan.counts * row_bytes >= LARGE_COPY_BYTES
    for s, d, count in plan.runs(large):
        dst[d : d + count].copy_(src[s : s + count])
    if large.all():
        return
    small = np.repeat(~large, plan.counts)
    src_ids = torch.from_numpy(plan.src[small])
    dst_ids = torch.from_numpy(plan.dst[small])
    if len(dst_ids) == 1:
        dst[int(dst_ids[0])].copy_(src[int(src_ids[0])])
        return
    chunk = staging.rows_for(src)
    for start in range(0, len(dst_ids), chunk.shape[0]):
        end = min(start + chunk.shape[0], len(dst_ids))
        rows = chunk[: end - start]
        torch.index_select(src, 0, src_ids[start:end], out=rows)
        dst.index_copy_(0, dst_ids[start:end], rows)


class _Staging:
    """A reusable, already-faulted CPU buffer for gathered rows.

    Reused because a fresh allocation of this size page-faults on first touch
    (~1 GB/s here), which costs more than the copy itself.
    """

    def __init__(self, size_bytes: int) -> None:
        self._size_bytes = size_bytes
        self._buffer: torch.Tensor | None = None

    def rows_for(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous (rows >= 1, like.shape[1]) tensor of ``like``'s dtype."""
        row_bytes = like.shape[1] * like.element_size()
        if self._buffer is None or self._buffer.numel() < row_bytes:
            size = max(self._size_bytes, row_bytes)
            self._buffer = torch.zeros(size, dtype=torch.uint8)  # zeros: faulted in now
        rows = self._buffer.numel() // row_bytes
        return self._buffer[: rows * row_bytes].view(like.dtype).view(rows, like.shape[1])


# -- CUDA copies ---------------------------------------------------------------


def _copy_cuda_runs(src: torch.Tensor, dst: torch.Tensor, plan: _Plan) -> None:
    """Queues non-blocking copies on the current stream: a run as one copy when both
    sides are contiguous over it (one DMA), else one copy per row (a row is always
    contiguous on both sides). Never through a temporary: a strided host<->device
    copy would stage through pageable memory and synchronize."""
    for s, d, count in plan.runs():
        src_rows = src[s : s + count]
        dst_rows = dst[d : d + count]
        if src_rows.is_contiguous() and dst_rows.is_contiguous():
            dst_rows.copy_(src_rows, non_blocking=True)
            continue
        for i in range(count):
            dst_rows[i].copy_(src_rows[i], non_blocking=True)
