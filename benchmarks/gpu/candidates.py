"""A copy method ``CopyEngine`` does not use yet, measured beside it (CUDA only).

In vLLM's canonical layout a block is ``layers`` pages, each a strided column of
the region's rows, so ``CopyEngine`` queues one ``cudaMemcpyAsync`` per page (per
run of consecutive rows): 32 copies of 64 KiB for a 2 MiB block of a 32-layer
model, each paying the launch cost. The candidate:

* **UVA gather/scatter**: the registered region seen from the GPU through unified
  virtual addressing (``cuMemHostGetDevicePointer``, as vLLM's and SGLang's
  ``get_cuda_view_from_cpu_tensor`` do in C++), then per layer one gather kernel
  (``index_select``) and one scatter kernel (``index_copy_``) that read or write
  host memory over the bus: two launches per layer per job, whatever the number
  of blocks.

Both run on the same region with the same shuffled pairs; the candidate's bytes
are compared after its runs (a sample of blocks, every layer), so a fast wrong
method cannot look good. A candidate that cannot run here says why in a FAILED row.
"""

from __future__ import annotations

import ctypes
import random

import torch

from benchmarks.common import Row
from benchmarks.gpu.bandwidth import REPEATS, best_seconds, check_sample, kv_tensors, size_label
from benchmarks.gpu.environment import cuda_device, scratch_directory
from benchmarks.gpu.report import CheckFailed, SectionResult
from kvtierd.primary.region import Region
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.region import AttachedRegion

MIB = 1 << 20
CASES = ((64 << 10, 8), (2 * MIB, 32))  # (row bytes, layers)
TOTAL_BYTES = 1 << 30
SAMPLE_BLOCKS = 8


def run(shm_dir: str) -> SectionResult:
    section = SectionResult("candidates")
    device = cuda_device()
    if device is None:
        section.notes.append("no CUDA here: the copy-method candidates are not measured")
        return section
    with scratch_directory(shm_dir, "candidates") as directory:
        for row_bytes, layers in CASES:
            section.rows += _compare(directory, device, row_bytes, layers)
    section.notes.append(f"best of {REPEATS}; {TOTAL_BYTES >> 20} MiB per case and direction")
    return section


def _compare(directory: str, device: torch.device, row_bytes: int, layers: int) -> list[Row]:
    blocks = TOTAL_BYTES // row_bytes
    region = Region.create(directory, f"candidates-{row_bytes}", blocks, row_bytes)
    attached = AttachedRegion.attach(region.path, blocks, row_bytes)
    try:
        order = list(range(blocks))
        random.Random(row_bytes + 1).shuffle(order)
        store_pairs = list(enumerate(order))
        load_pairs = [(row, engine) for engine, row in store_pairs]
        kv = kv_tensors(device, blocks, row_bytes, layers)
        with CopyEngine(attached, kv) as engine:  # registers the region
            ours = {
                "load": best_seconds(lambda: engine.wait([engine.submit_load(load_pairs)]), device),
                "store": best_seconds(
                    lambda: engine.wait([engine.submit_store(store_pairs)]), device
                ),
            }
            uva = UvaCopier(attached, kv, device)
            theirs = {
                "load": best_seconds(lambda: uva.copy(load_pairs, load=True), device),
                "store": best_seconds(lambda: uva.copy(store_pairs, load=False), device),
            }
            _check(uva, attached, kv, load_pairs, store_pairs)
        group = f"candidate UVA gather/scatter, {size_label(row_bytes)} rows, {layers} layers"
        size = blocks * row_bytes / 1e9
        return [
            Row(
                group,
                direction,
                size / theirs[direction],
                "GB/s",
                f"CopyEngine {size / ours[direction]:.2f}",
                ours[direction] / theirs[direction],
            )
            for direction in ("load", "store")
        ]
    finally:
        attached.close()
        region.close()


class UvaCopier:
    """Per-layer gather/scatter kernels between ``kv`` and a device view of the
    registered region (the engine registered it and keeps it registered)."""

    def __init__(self, attached: AttachedRegion, kv: list[torch.Tensor], device: torch.device):
        rows = _device_view(attached, device)
        self.kv = [t.view(torch.int64) for t in kv]
        self.pages = []
        offset = 0
        for tensor in kv:
            page = tensor.shape[1] * tensor.elementsize_label()
            self.pages.append(rows[:, offset : offset + page].view(torch.int64))
            offset += page
        self.device = device

    def copy(self, pairs: list[tuple[int, int]], *, load: bool) -> None:
        index = torch.tensor(pairs, dtype=torch.int64).to(self.device, non_blocking=False)
        source, destination = index[:, 0], index[:, 1]
        for engine_pages, region_pages in zip(self.kv, self.pages, strict=True):
            if load:
                engine_pages.index_copy_(0, destination, region_pages.index_select(0, source))
            else:
                region_pages.index_copy_(0, destination, engine_pages.index_select(0, source))
        torch.cuda.synchronize(self.device)


def _device_view(attached: AttachedRegion, device: torch.device) -> torch.Tensor:
    """The registered mapping as a (num_blocks, block_bytes) uint8 CUDA tensor."""
    pointer = ctypes.c_uint64()
    libcuda = ctypes.CDLL("libcuda.so.1")
    host = ctypes.c_void_p(attached.tensor.data_ptr())
    code = libcuda.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), host, 0)
    if code != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUresult {code}")

    class _Interface:
        __cuda_array_interface__ = {
            "shape": (attached.num_blocks, attached.block_bytes),
            "typestr": "|u1",
            "data": (pointer.value, False),
            "version": 3,
        }

    view = torch.as_tensor(_Interface(), device=device)
    if view.data_ptr() != pointer.value:
        raise RuntimeError("torch copied the region instead of viewing it")
    return view


def _check(
    uva: UvaCopier,
    attached: AttachedRegion,
    kv: list[torch.Tensor],
    load_pairs: list[tuple[int, int]],
    store_pairs: list[tuple[int, int]],
) -> None:
    """The candidate's bytes, each direction on its own: the engine blocks zeroed and
    loaded back must equal what they held (the region holds their store), and a
    sample of region rows zeroed and stored again must equal their engine blocks."""
    sample = [engine for engine, _row in store_pairs[:: max(1, len(store_pairs) // SAMPLE_BLOCKS)]]
    index = torch.tensor(sample, device=kv[0].device)
    before = [t.index_select(0, index).cpu() for t in kv]
    for tensor in kv:
        tensor.zero_()
    uva.copy(load_pairs, load=True)
    for layer, tensor in enumerate(kv):
        if not torch.equal(tensor.index_select(0, index).cpu(), before[layer]):
            raise CheckFailed(f"UVA load: layer {layer} of a sampled engine block differs")
    for engine_block, row in store_pairs:
        if engine_block in sample:
            attached.tensor[row].zero_()
    uva.copy(store_pairs, load=False)
    check_sample(attached, kv, store_pairs)
