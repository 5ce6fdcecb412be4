"""The settings of one ``type = "fs"`` tier: every option, its default, its help and
its reader, declared once in :class:`FsTierSettings` (:mod:`kvtierd.tiers.options`).

Everything else is derived from the dataclass: the table :data:`OPTIONS` that the
parser reads with, that ``kvtierd --help`` and the configuration reference's table
of fs options (docs/reference/configuration.md) show; and the defaults the tier,
its I/O pool and the benchmarks use (they take a settings object, or
:data:`DEFAULTS`, never a literal of their own).

Parsing is pure (no filesystem access): it runs when the configuration is
loaded, so a bad value stops the daemon with exit code 2 before anything
starts. Whether a root directory is usable is checked when the daemon starts
(:meth:`kvtierd.tiers.fs.configured.ConfiguredFsTier.check`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.tiers import options
from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.options import FLAG, Choice, Reader, Seconds, Size, Whole, option

O_DIRECT_MODES = ("auto", "on", "off")
MAX_IO_THREADS = 256  # per kind (read, write), and worker processes
MIN_CAPACITY_BYTES = 1 << 20
MAX_SHARED_SECONDS = 3600.0  # upper bound of the durations
_DURATION = Seconds(0.01, MAX_SHARED_SECONDS)
_THREADS = Whole(0, MAX_IO_THREADS)


class RootDirectory(Reader):
    """An absolute directory path, normalized (``/x/`` is ``/x``)."""

    def read(self, value: Any) -> str:
        if not isinstance(value, str) or not os.path.isabs(value):
            raise ValueError(f"expected an absolute directory path, got {value!r}")
        return os.path.normpath(value)


_SEALING_KEY_HELP = (  # integrity_key_file
    "file of 32 random bytes (mode 0600): every block file is sealed with a MAC under "
    "this key and a file not sealed under this tier's keys is a MISS; required where "
    "another host can write the root (docs/security.md), empty for xxh3 checksums only"
)


@dataclass(frozen=True, slots=True)
class FsTierSettings:
    """One ``type = "fs"`` tier. ``capacity`` is shared by every pool of the daemon.

    The defaults below are the only place fs defaults are written.
    """

    root: str = option(
        dataclasses.MISSING,
        "directory holding the block files: an absolute path, existing and writable "
        "unless create_root",
        RootDirectory(),
    )
    capacity: int = option(
        10 << 30,
        "bytes of block files of all pools together, least recently used go first",
        Size(minimum=MIN_CAPACITY_BYTES),
    )
    create_root: bool = option(False, "create the root directory if it is missing", FLAG)
    fsync: bool = option(False, "fdatasync every block file before it becomes visible", FLAG)
    o_direct: str = option(
        "auto",
        "auto, on or off: bypass the page cache, auto where supported and faster",
        Choice(O_DIRECT_MODES, ("on", "off"), "auto, on or off (true: on, false: off)"),
    )
    read_threads: int = option(8, "I/O threads that prefer reads (promotions)", _THREADS)
    write_threads: int = option(8, "I/O threads that prefer writes (cascades)", _THREADS)
    max_queue_bytes: int = options.queued_bytes_option()
    max_queue_jobs: int = options.queued_jobs_option()
    max_write_bytes_per_s: int = options.write_budget_option()
    io_processes: int = option(
        2,
        "worker processes that do the block file I/O (checksum, write, read) off the "
        "daemon's interpreter lock, 0 for the daemon's own I/O threads",
        _THREADS,
    )
    io_worker_timeout: float = option(
        60.0,
        "an I/O worker process that has not answered a request (one group of blocks) "
        "within this long is killed and replaced: the request's blocks fail (a promotion "
        "answers MISS, a cascade is dropped) and their rows are released",
        _DURATION,
    )
    shared: bool = option(
        False,
        "several daemons (on this host or on hosts sharing the file system) use this root: "
        "lookups find files other daemons wrote, the capacity counts every file under the "
        "pool directories, a shared lock instead of an exclusive one (docs/guides/fleet.md)",
        FLAG,
    )
    shared_negative_ttl: float = option(
        1.5,
        "shared root: how long a key found missing on disk answers MISS before it is checked again",
        _DURATION,
    )
    shared_rescan_interval: float = option(
        10.0,
        "shared root: seconds between rescans of the pool directories (files other daemons "
        "wrote or removed, the bytes under the root)",
        _DURATION,
    )
    integrity_key_file: str = options.sealing_key_option(_SEALING_KEY_HELP)
    integrity_verify_key_file: str = options.verifying_key_option("files")
    admission: str = options.admission_option()

    def exclusive(self) -> Mapping[str, object]:
        """Options no two configured tiers may share: two tiers on one root would
        count and evict each other's files."""
        return {"root": self.root}

    def describe(self) -> str:
        """One line for the daemon's start log."""
        shared = ", shared with other daemons" if self.shared else ""
        return f"fs at {self.root}, capacity {self.capacity} bytes{shared}"


OPTIONS = options.tier_options(FsTierSettings)
"""The fs tier's options, in declaration order (:class:`~kvtierd.tiers.options.TierOption`)."""

# Every option at its default, for code that takes the options one by one (FsTier,
# IoPool, the benchmarks). ``root`` has no default: it is "" here.
DEFAULTS = FsTierSettings(root="")


def parse_fs_settings(given: Mapping[str, Any]) -> FsTierSettings:
    """Validates an fs tier's options; raises TierOptionError naming the option."""
    values = options.read_options(OPTIONS, given, "fs")
    if values.get("read_threads", 1) + values.get("write_threads", 1) < 1:
        raise TierOptionError("read_threads", "read_threads + write_threads must be at least 1")
    options.check_key_options(values)
    return FsTierSettings(**values)
