"""``CopyEngine`` GB/s next to the floors of the same run.

For each row size (64 KiB, 2 MiB, 16 MiB) a region of about ``TOTAL_BYTES`` is
created in the shm directory and moved whole, at shuffled block ids (engine
block ``e`` to region row ``perm[e]``: no two neighbours stay neighbours, as
after a few minutes of serving), in both directions:

* ``CopyEngine`` with one KV tensor (a block is one contiguous page) and with
  vLLM's canonical layout of many layers (a block is ``layers`` pages, each a
  strided column of the region's rows);
* floor "pinned copy_ per block": a page-locked (``pin_memory``) host tensor and a
  device tensor of the same shape, one ``copy_(non_blocking=True)`` per block with
  the same shuffled pairs, then one synchronize;
* floor "one contiguous buffer": the same bytes as one ``copy_``: one
  ``cudaMemcpyAsync``, what the link can do.

Each figure is the best of ``REPEATS`` after a warm-up. On CPU the same runs give
the CPU copy engine's figures against ``copy_`` of plain tensors. A sample of the
moved blocks is compared after the timed runs, so a fast wrong path cannot pass.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from benchmarks.common import Row
from benchmarks.gpu.environment import kv_device, scratch_directory
from benchmarks.gpu.report import CheckFailed, SectionResult
from kvtierd.primary.region import Region
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.region import AttachedRegion

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# (row bytes, layers of the many-layer case: vLLM's canonical pages of Llama-like models)
SIZES = ((64 * KIB, 8), (2 * MIB, 32), (16 * MIB, 32))
TOTAL_BYTES = {"cuda": 1 * GIB, "cpu": 256 * MIB}
QUICK_TOTAL_BYTES = 32 * MIB
REPEATS = 5
TARGET_ROW_BYTES = 2 * MIB
TARGET = ">= 0.9x"
SAMPLE_BLOCKS = 8
LABELS = {
    "cuda": {
        "load": "load H2D",
        "store": "store D2H",
        "per block": "pinned copy_ per block",
        "one buffer": "one contiguous buffer (one cudaMemcpyAsync)",
    },
    "cpu": {
        "load": "load (region -> CPU tensor)",
        "store": "store (CPU tensor -> region)",
        "per block": "copy_ per block",
        "one buffer": "one contiguous copy_",
    },
}


def run(shm_dir: str, quick: bool = False) -> SectionResult:
    section = SectionResult("bandwidth")
    device = kv_device()
    total = QUICK_TOTAL_BYTES if quick else TOTAL_BYTES[device.type]
    with scratch_directory(shm_dir, "bandwidth") as directory:
        for row_bytes, layers in SIZES:
            blocks = max(8, total // row_bytes)
            section.rows += _measure_size(directory, device, row_bytes, blocks, layers, section)
    section.notes.append(
        f"{'GPU' if device.type == 'cuda' else 'CPU'} KV tensors; about "
        f"{total >> 20} MiB moved per direction and size; best of {REPEATS}; shuffled ids"
    )
    return section


def _measure_size(
    directory: str,
    device: torch.device,
    row_bytes: int,
    blocks: int,
    layers: int,
    section: SectionResult,
) -> list[Row]:
    region = Region.create(directory, f"bandwidth-{row_bytes}", blocks, row_bytes)
    attached = AttachedRegion.attach(region.path, blocks, row_bytes)
    try:
        order = list(range(blocks))
        random.Random(row_bytes).shuffle(order)
        store_pairs = list(enumerate(order))  # engine block -> region row
        load_pairs = [(row, engine) for engine, row in store_pairs]
        floors = _floors(device, blocks, row_bytes, load_pairs)
        names = LABELS[device.type]
        rows = []
        for count in (1, layers):
            kv = kv_tensors(device, blocks, row_bytes, count)
            with CopyEngine(attached, kv) as engine:
                timings = {
                    "load": best_seconds(
                        lambda: engine.wait([engine.submit_load(load_pairs)]), device
                    ),
                    "store": best_seconds(
                        lambda: engine.wait([engine.submit_store(store_pairs)]), device
                    ),
                }
                submit = _submit_seconds(engine, load_pairs)
                check_sample(attached, kv, store_pairs)
            del kv
            group = f"copy engine, {size_label(row_bytes)} rows, {count} layer{'s' * (count > 1)}"
            for direction in ("load", "store"):
                floor = floors[f"{direction} per block"]
                gbs = blocks * row_bytes / timings[direction] / 1e9
                target = TARGET if row_bytes == TARGET_ROW_BYTES else ""
                rows.append(
                    Row(
                        group,
                        names[direction],
                        gbs,
                        "GB/s",
                        f"{names['per block']} {floor:.2f}",
                        gbs / floor,
                        target,
                    )
                )
            section.notes.append(
                f"{group}: submit_load of {blocks} blocks returns in {submit * 1e3:.2f} ms "
                f"({submit / blocks / count * 1e6:.2f} us per page copy queued)"
            )
        for direction in ("load", "store"):
            one = floors[f"{direction} one buffer"]
            per_block = floors[f"{direction} per block"]
            rows.append(
                Row(
                    f"floors, {size_label(row_bytes)} rows",
                    f"{names[direction]}: {names['one buffer']}",
                    one,
                    "GB/s",
                    f"{names['per block']} {per_block:.2f}",
                    one / per_block,
                )
            )
        return rows
    finally:
        attached.close()
        region.close()


def kv_tensors(
    device: torch.device, blocks: int, row_bytes: int, layers: int
) -> list[torch.Tensor]:
    """vLLM's canonical KV caches: one int8 (blocks, page) tensor per layer."""
    page = row_bytes // layers
    return [
        torch.randint(-128, 128, (blocks, page), dtype=torch.int8, device=device)
        for _ in range(layers)
    ]


def _floors(
    device: torch.device, blocks: int, row_bytes: int, load_pairs: list[tuple[int, int]]
) -> dict[str, float]:
    """GB/s of plain tensor copies between a page-locked host tensor and a device one."""
    pinned = device.type == "cuda"
    host = torch.zeros((blocks, row_bytes), dtype=torch.int8, pin_memory=pinned)
    target = torch.zeros((blocks, row_bytes), dtype=torch.int8, device=device)

    def per_block(src: torch.Tensor, dst: torch.Tensor, reverse: bool) -> Callable[[], None]:
        def copy() -> None:
            for row, engine in load_pairs:
                s, d = (engine, row) if reverse else (row, engine)
                dst[d].copy_(src[s], non_blocking=pinned)
            _synchronize(device)

        return copy

    def one_buffer(src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None]:
        def copy() -> None:
            dst.copy_(src, non_blocking=pinned)
            _synchronize(device)

        return copy

    size = blocks * row_bytes / 1e9
    floors = {
        "load per block": size / best_seconds(per_block(host, target, False), device),
        "store per block": size / best_seconds(per_block(target, host, True), device),
        "load one buffer": size / best_seconds(one_buffer(host, target), device),
        "store one buffer": size / best_seconds(one_buffer(target, host), device),
    }
    del host, target
    return floors


def best_seconds(copy: Callable[[], None], device: torch.device) -> float:
    copy()  # warm-up: first-touch faults, allocator, stream creation
    seconds = []
    for _ in range(REPEATS):
        _synchronize(device)
        started = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def _submit_seconds(engine: CopyEngine, load_pairs: list[tuple[int, int]]) -> float:
    """How long ``submit_load`` holds the caller (queueing only on CUDA)."""
    started = time.perf_counter()
    job = engine.submit_load(load_pairs)
    seconds = time.perf_counter() - started
    engine.wait([job])
    return seconds


def check_sample(
    attached: AttachedRegion, kv: list[torch.Tensor], store_pairs: list[tuple[int, int]]
) -> None:
    """After the last (store) run, a sample of region rows must equal the engine
    blocks that were stored into them, page by page."""
    rows = attached.tensor
    for engine_block, row in store_pairs[:: max(1, len(store_pairs) // SAMPLE_BLOCKS)]:
        offset = 0
        for layer, tensor in enumerate(kv):
            page = tensor[engine_block].cpu().view(torch.uint8)
            if not torch.equal(rows[row, offset : offset + page.numel()], page):
                raise CheckFailed(
                    f"row {row} layer {layer} differs from engine block {engine_block} "
                    "after a store"
                )
            offset += page.numel()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= MIB else f"{nbytes >> 10} KiB"
