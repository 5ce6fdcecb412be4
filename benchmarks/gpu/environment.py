"""What the check runs on: the facts a reader needs to compare two runs."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator

import torch

from benchmarks.common import machine


def cuda_device() -> torch.device | None:
    """The GPU the check uses (CUDA device 0), or None without CUDA."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


def kv_device() -> torch.device:
    """Where the check's KV tensors live: the GPU, else the CPU."""
    return cuda_device() or torch.device("cpu")


def describe(shm_dir: str) -> list[str]:
    """One line per fact: host, Python and torch, the GPU (or its absence), shm space."""
    facts = [
        f"host: {machine()}, kernel {platform.release()}",
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads",
    ]
    device = cuda_device()
    if device is None:
        facts.append(
            "CUDA: not available here: the CPU parts run (CopyEngine with CPU tensors, "
            "the fs tier); GPU copies and cudaHostRegister are not measured"
        )
    else:
        props = torch.cuda.get_device_properties(device)
        facts.append(
            f"GPU: {props.name}, {props.total_memory / (1 << 30):.0f} GiB, "
            f"{props.multi_processor_count} SMs, compute capability {props.major}.{props.minor}, "
            f"CUDA runtime {torch.version.cuda}, driver API {_driver_version()}"
        )
    try:
        facts.append(f"shm: {shm_dir}, {free_bytes(shm_dir) / (1 << 30):.1f} GiB free")
    except OSError as error:
        facts.append(f"shm: {shm_dir}: {error.strerror} (the sections that need it fail)")
    return facts


@contextlib.contextmanager
def scratch_directory(shm_dir: str, name: str) -> Iterator[str]:
    """A new directory under ``shm_dir`` for a section's regions, removed with them."""
    directory = tempfile.mkdtemp(prefix=f"kvtierd-gpu-{name}-", dir=shm_dir)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _driver_version() -> str:
    try:
        import ctypes

        version = ctypes.c_int()
        libcuda = ctypes.CDLL("libcuda.so.1")
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        pass
    return "unknown"
