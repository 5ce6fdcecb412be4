"""What attaching a region to CUDA costs, and what happens when it cannot be.

A worker's ``CopyEngine`` page-locks the whole region once
(``AttachedRegion.register_cuda``: ``cudaHostRegister``) so that copies are DMA
from the shared mapping with no staging. This section measures, per region size:
creating it (the daemon's allocate + prefault), mapping it in the worker with
every page populated, registering it and unregistering it.

A failed registration must be a clear error, not a silent slow path: the section
registers a region's range behind the engine's back first (CUDA then refuses a
second registration of that range) and records what ``CopyEngine`` raises and how
soon. It also measures the path a fallback would take, plain ``copy_`` from the
unregistered (pageable) mapping, so that the choice between failing and falling
back rests on a number.

Without CUDA there is nothing to register: the section says so and measures nothing.
"""

from __future__ import annotations

import os
import random
import time

import torch

from benchmarks.common import Row
from benchmarks.gpu.environment import cuda_device, free_bytes, scratch_directory
from benchmarks.gpu.report import CheckFailed, SectionResult
from kvtierd.primary.region import Region
from kvtierd_client.copy_engine import CopyEngine
from kvtierd_client.region import AttachedRegion

GIB = 1 << 30
ROW_BYTES = 2 << 20
SIZES_GIB = (4, 16, 64)
HEADROOM = 1.05  # the shm directory must hold the region and this much more
FAILURE_REGION_BYTES = 64 << 20
PAGEABLE_BYTES = 512 << 20


def run(shm_dir: str, sizes_gib: tuple[int, ...] = SIZES_GIB) -> SectionResult:
    section = SectionResult("register")
    device = cuda_device()
    if device is None:
        section.notes.append("no CUDA here: cudaHostRegister is not measured")
        return section
    with scratch_directory(shm_dir, "register") as directory:
        for gib in sizes_gib:
            available = free_bytes(directory)
            if available < gib * GIB * HEADROOM:
                section.notes.append(
                    f"{gib} GiB not measured: {shm_dir} has {available / GIB:.1f} GiB free "
                    "(give --shm-dir a larger tmpfs)"
                )
                continue
            section.rows += _measure_registration(directory, gib)
        section.rows += _measure_failure(directory, device)
        section.rows += _measure_pageable(directory, device)
    return section


def _measure_registration(directory: str, gib: int) -> list[Row]:
    blocks = gib * GIB // ROW_BYTES
    started = time.perf_counter()
    region = Region.create(directory, f"register-{gib}", blocks, ROW_BYTES)
    created = time.perf_counter() - started
    try:
        started = time.perf_counter()
        attached = AttachedRegion.attach(region.path, blocks, ROW_BYTES)
        attached_s = time.perf_counter() - started
        try:
            started = time.perf_counter()
            attached.register_cuda()
            registered = time.perf_counter() - started
            started = time.perf_counter()
            attached.unregister_cuda()
            unregistered = time.perf_counter() - started
        finally:
            attached.close()
    finally:
        region.close()
        _unlink(region.path)
    group = f"attach, {gib} GiB region"
    return [
        Row(group, "daemon: create + prefault", created, "s"),
        Row(group, "worker: map, pages populated", attached_s, "s"),
        Row(group, "worker: cudaHostRegister", registered, "s", f"{gib / registered:.1f} GiB/s"),
        Row(group, "worker: cudaHostUnregister", unregistered, "s"),
    ]


def _measure_failure(directory: str, device: torch.device) -> list[Row]:
    """Registers the mapping's range directly, then builds a CopyEngine over it: CUDA
    refuses the second registration and the engine must say so, naming the error."""
    blocks = FAILURE_REGION_BYTES // ROW_BYTES
    region = Region.create(directory, "register-failure", blocks, ROW_BYTES)
    attached = AttachedRegion.attach(region.path, blocks, ROW_BYTES)
    pointer = attached.tensor.data_ptr()
    cudart = torch.cuda.cudart()
    try:
        code = int(cudart.cudaHostRegister(pointer, attached.size, 0))
        if code != 0:
            raise CheckFailed(f"the setup's own cudaHostRegister failed with cudaError {code}")
        kv = [torch.zeros(blocks, ROW_BYTES, dtype=torch.int8, device=device)]
        started = time.perf_counter()
        try:
            CopyEngine(attached, kv).close()
        except RuntimeError as error:
            seconds, message = time.perf_counter() - started, str(error)
        else:
            raise CheckFailed("CopyEngine accepted a region CUDA refused to register")
        finally:
            cudart.cudaHostUnregister(pointer)
    finally:
        attached.close()
        region.close()
        _unlink(region.path)
    if "cudaHostRegister" not in message or "cudaError" not in message:
        raise CheckFailed(f"the registration error does not say what failed: {message!r}")
    return [
        Row(
            "attach, registration refused",
            f"CopyEngine raises RuntimeError: {message[-60:]}",
            seconds * 1e3,
            "ms",
            "",
            None,
            "a clear error",
        )
    ]


def _measure_pageable(directory: str, device: torch.device) -> list[Row]:
    """H2D of shuffled 2 MiB rows from an unregistered mapping vs the same rows of a
    registered one, both with plain per-block ``copy_``: what a fallback would give."""
    blocks = PAGEABLE_BYTES // ROW_BYTES
    region = Region.create(directory, "pageable", blocks, ROW_BYTES)
    attached = AttachedRegion.attach(region.path, blocks, ROW_BYTES)
    try:
        order = list(range(blocks))
        random.Random(7).shuffle(order)
        rows = attached.tensor
        target = torch.empty((blocks, ROW_BYTES), dtype=torch.uint8, device=device)

        def copy_all(non_blocking: bool) -> float:
            best = float("inf")
            for _ in range(4):  # the first is the warm-up
                torch.cuda.synchronize(device)
                started = time.perf_counter()
                for engine_block, row in enumerate(order):
                    target[engine_block].copy_(rows[row], non_blocking=non_blocking)
                torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - started)
            return PAGEABLE_BYTES / best / 1e9

        pageable = copy_all(non_blocking=False)
        attached.register_cuda()
        registered = copy_all(non_blocking=True)
        attached.unregister_cuda()
    finally:
        attached.close()
        region.close()
        _unlink(region.path)
    return [
        Row(
            "attach, registration refused",
            "fallback: H2D copy_ from the pageable mapping",
            pageable,
            "GB/s",
            f"registered {registered:.2f} GB/s",
            pageable / registered,
        )
    ]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
