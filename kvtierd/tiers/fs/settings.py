"""Typed settings of each secondary-tier type, parsed from a ``[[tiers]]`` table.

Parsing is pure (no filesystem access): it runs when the configuration is
loaded, so a bad value stops the daemon with exit code 2 before anything
starts. Whether a root directory is usable is checked when the daemon starts
(:meth:`kvtierd.tiers.fs.configured.ConfiguredFsTier.check`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.tiers.fs.tier import O_DIRECT_MODES
from kvtierd.units import parse_size

DEFAULT_FS_CAPACITY = 10 << 30
MAX_IO_THREADS = 256
DEFAULT_IO_PROCESSES = 2


class TierOptionError(ValueError):
    """A bad tier option; ``key`` is the option's name inside its ``[[tiers]]`` table."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


@dataclass(frozen=True, slots=True)
class FsTierSettings:
    """One ``type = "fs"`` tier. ``capacity`` is shared by every pool of the daemon."""

    root: str
    capacity: int = DEFAULT_FS_CAPACITY  # bytes of block files, all pools together
    create_root: bool = False  # create a missing root (the embedded default does)
    fsync: bool = False  # fdatasync each block file before the rename
    o_direct: str = "auto"  # auto: use O_DIRECT where the filesystem supports it
    read_threads: int = 8  # I/O threads preferring reads (promotions)
    write_threads: int = 8  # I/O threads preferring writes (cascades)
    max_queue_bytes: int = 1 << 30  # cascade bytes in flight before writes are dropped
    max_queue_jobs: int = 1024  # cascade jobs in flight before writes are dropped
    io_processes: int = DEFAULT_IO_PROCESSES  # block I/O worker processes; 0: in the daemon


FS_OPTION_HELP: Mapping[str, str] = {
    "root": "directory holding the block files (absolute path; must exist and be writable)",
    "capacity": "bytes of block files, all pools together; least recently used files go first",
    "create_root": "create the root directory if it is missing (default false)",
    "fsync": "fdatasync every block file before it becomes visible (default false)",
    "o_direct": "auto | on | off: bypass the page cache (auto: where supported and faster)",
    "read_threads": "I/O threads that prefer reads (promotions); default 8",
    "write_threads": "I/O threads that prefer writes (cascades); default 8",
    "max_queue_bytes": "cascade bytes queued before new cascade writes are dropped; default 1GiB",
    "max_queue_jobs": "cascade jobs queued before new cascade writes are dropped; default 1024",
    "io_processes": (
        "worker processes that do the block file I/O (checksum, write, read) off the daemon's "
        f"interpreter lock; 0 = in the daemon's I/O threads; default {DEFAULT_IO_PROCESSES}"
    ),
}


def parse_fs_settings(options: Mapping[str, Any]) -> FsTierSettings:
    """Validates an fs tier's options; raises TierOptionError naming the option."""
    unknown = sorted(set(options) - set(FS_OPTION_HELP))
    if unknown:
        raise TierOptionError(
            unknown[0], f"unknown fs tier option; known: {', '.join(sorted(FS_OPTION_HELP))}"
        )
    if "root" not in options:
        raise TierOptionError("root", "missing: the directory for the block files")
    root = options["root"]
    if not isinstance(root, str) or not os.path.isabs(root):
        raise TierOptionError("root", f"expected an absolute directory path, got {root!r}")
    values: dict[str, Any] = {"root": os.path.normpath(root)}
    if "capacity" in options:
        values["capacity"] = _size(options, "capacity", minimum=1 << 20)
    for key in ("create_root", "fsync"):
        if key in options:
            values[key] = _bool(options, key)
    if "o_direct" in options:
        mode = options["o_direct"]
        if mode is True or mode is False:
            mode = "on" if mode else "off"
        if mode not in O_DIRECT_MODES:
            raise TierOptionError(
                "o_direct", f"must be one of {', '.join(O_DIRECT_MODES)}; got {mode!r}"
            )
        values["o_direct"] = mode
    for key in ("read_threads", "write_threads"):
        if key in options:
            values[key] = _int(options, key, 0, MAX_IO_THREADS)
    if values.get("read_threads", 1) + values.get("write_threads", 1) < 1:
        raise TierOptionError("read_threads", "read_threads + write_threads must be at least 1")
    if "max_queue_bytes" in options:
        values["max_queue_bytes"] = _size(options, "max_queue_bytes", minimum=4096)
    if "io_processes" in options:
        values["io_processes"] = _int(options, "io_processes", 0, MAX_IO_THREADS)
    if "max_queue_jobs" in options:
        values["max_queue_jobs"] = _int(options, "max_queue_jobs", 1, 1 << 20)
    return FsTierSettings(**values)


def _size(options: Mapping[str, Any], key: str, *, minimum: int) -> int:
    try:
        value = parse_size(options[key])
    except ValueError as exc:
        raise TierOptionError(key, str(exc)) from None
    if value < minimum:
        raise TierOptionError(key, f"must be at least {minimum} bytes, got {options[key]!r}")
    return value


def _bool(options: Mapping[str, Any], key: str) -> bool:
    value = options[key]
    if not isinstance(value, bool):
        raise TierOptionError(key, f"expected true or false, got {value!r}")
    return value


def _int(options: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TierOptionError(key, f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value
