"""How the copy engine moves rows: a job's (source, destination) pairs checked and cut
into runs (:func:`plan_job`), each KV tensor's block viewed as a row of one width
(:func:`block_view`, :func:`widest_pair`), and the copies themselves, on the CPU
(:func:`copy_cpu`: slices for large runs, a gather/scatter through a staging buffer
for small ones) and on CUDA (:func:`copy_cuda_runs`). Private to
:mod:`kvtierd_client.copy_engine`, which owns the engine's state."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Direction = Literal["store", "load"]

# CPU: runs of at least this many bytes are one slice copy each; the rows of
# smaller runs are gathered and scattered with index_select / index_copy_.
LARGE_COPY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Plan:
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


def common_device(kv_tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in kv_tensors}
    if len(devices) != 1:
        raise ValueError(f"kv_tensors must all be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv_tensors must be CPU or CUDA tensors, got {device}")
    return device


def block_view(tensor: torch.Tensor, index: int) -> torch.Tensor:
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


def split_page(rank_view: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Tensor i's part of the rank page: columns [offset_i, offset_i + sizes[i])."""
    views, offset = [], 0
    for size in sizes:
        views.append(rank_view[:, offset : offset + size])
        offset += size
    return views


def widest_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (uint8 row views of one width) reinterpreted as the widest
    integer type both allow. Element-wise kernels (index_copy_) move one element per
    step: int64 moves 8x the bytes of uint8 for the same work (measured 7x faster)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return a.view(dtype), b.view(dtype)
        except RuntimeError:  # width, stride or offset not a multiple of the size
            continue
    return a, b


def plan_job(
    direction: Direction,
    pairs: Sequence[tuple[int, int]],
    source: tuple[str, int],
    destination: tuple[str, int],
) -> Plan:
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
    return Plan(src=src, dst=dst, starts=starts, counts=counts)


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


def numpy_of(tensor: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's numpy view (same memory), or None (CUDA, or not viewable)."""
    if tensor.device.type != "cpu":
        return None
    try:
        return tensor.detach().numpy()
    except (RuntimeError, TypeError):
        return None


def copy_cpu(
    src: torch.Tensor,
    dst: torch.Tensor,
    plan: Plan,
    staging: Staging,
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


class Staging:
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


def copy_cuda_runs(src: torch.Tensor, dst: torch.Tensor, plan: Plan) -> None:
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
