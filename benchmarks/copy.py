"""Copy engine GB/s for 2 MiB blocks next to numpy copying the same bytes, and
region creation seconds per GiB (pre-faulted)."""

from __future__ import annotations

import random
import shutil
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import Row
from kvtierd.primary.region import Region
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.region import AttachedRegion

BLOCK = 2 << 20
BLOCKS = 192
REPEATS = 5


def _best(fn) -> float:  # noqa: ANN001
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run() -> list[Row]:
    rows: list[Row] = []
    directory = tempfile.mkdtemp(prefix="kvtierd-bench-copy-", dir="/dev/shm")
    try:
        t0 = time.perf_counter()
        region = Region.create(directory, "bench/copy", BLOCKS, BLOCK)
        created = time.perf_counter() - t0
        gib = BLOCKS * BLOCK / (1 << 30)
        rows.append(Row("region", "create + prefault", created / gib, "s/GiB"))
        attached = AttachedRegion.attach(region.path, BLOCKS, BLOCK)
        kv = torch.randint(0, 256, (BLOCKS, BLOCK), dtype=torch.uint8)
        engine = CopyEngine(attached, [kv])
        pairs = list(range(BLOCKS))
        random.Random(0).shuffle(pairs)
        store_pairs = list(zip(range(BLOCKS), pairs, strict=True))
        load_pairs = [(dst, src) for src, dst in store_pairs]
        kv_np, region_np = kv.numpy(), attached.numpy()

        def numpy_store() -> None:
            for src, dst in store_pairs:
                np.copyto(region_np[dst], kv_np[src])

        def numpy_load() -> None:
            for src, dst in load_pairs:
                np.copyto(kv_np[dst], region_np[src])

        total = BLOCKS * BLOCK / 1e9
        for name, ours, floor in (
            ("store (KV -> region)", lambda: engine.wait([engine.submit_store(store_pairs)]),
             numpy_store),
            ("load (region -> KV)", lambda: engine.wait([engine.submit_load(load_pairs)]),
             numpy_load),
        ):  # fmt: skip
            floor_gbs = total / _best(floor)
            ours_gbs = total / _best(ours)
            rows.append(Row("copy engine, 2 MiB blocks", name, ours_gbs, "GB/s",
                            f"numpy.copyto {floor_gbs:.2f} GB/s", ours_gbs / floor_gbs,
                            ">= 0.8x"))  # fmt: skip
        engine.close()
        attached.close()
        region.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows
