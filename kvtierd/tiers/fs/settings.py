"""The settings of one ``type = "fs"`` tier: every option, its default and its help,
declared once in :class:`FsTierSettings`.

Everything else is derived from the dataclass: the option names the parser
accepts, the help text (:func:`option_help`, shown by ``kvtierd --help``), the
configuration reference's table of fs options (:func:`options_markdown`,
docs/reference/configuration.md),
and the defaults the tier, its I/O pool and the benchmarks use (they take a
settings object, or :func:`default`, never a literal of their own).

Parsing is pure (no filesystem access): it runs when the configuration is
loaded, so a bad value stops the daemon with exit code 2 before anything
starts. Whether a root directory is usable is checked when the daemon starts
(:meth:`kvtierd.tiers.fs.configured.ConfiguredFsTier.check`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.iopool import DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_JOBS
from kvtierd.tiers.options import (
    help_lines,
    markdown_table,
    option,
    parse_key_options,
    read_bool,
    read_int,
    read_size,
    size_text,
)
from kvtierd.util.units import parse_duration

O_DIRECT_MODES = ("auto", "on", "off")
MAX_IO_THREADS = 256  # per kind (read, write), and worker processes
MIN_CAPACITY_BYTES = 1 << 20
MIN_QUEUE_BYTES = 4096
MAX_QUEUE_JOBS = 1 << 20
_SIZE_OPTIONS = frozenset({"capacity", "max_queue_bytes"})  # written with a unit ("10GiB")
_DURATION_OPTIONS = frozenset(  # written with a unit ("1.5s")
    {"shared_negative_ttl", "shared_rescan_interval", "io_worker_timeout"}
)
MAX_SHARED_SECONDS = 3600.0  # upper bound of the durations


@dataclass(frozen=True, slots=True)
class FsTierSettings:
    """One ``type = "fs"`` tier. ``capacity`` is shared by every pool of the daemon.

    The defaults below are the only place fs defaults are written.
    """

    root: str = field(
        metadata={"help": "directory holding the block files: an absolute path, existing "
                  "and writable unless create_root"}
    )  # fmt: skip
    capacity: int = option(
        10 << 30, "bytes of block files of all pools together, least recently used go first"
    )
    create_root: bool = option(False, "create the root directory if it is missing")
    fsync: bool = option(False, "fdatasync every block file before it becomes visible")
    o_direct: str = option(
        "auto", "auto, on or off: bypass the page cache, auto where supported and faster"
    )
    read_threads: int = option(8, "I/O threads that prefer reads (promotions)")
    write_threads: int = option(8, "I/O threads that prefer writes (cascades)")
    max_queue_bytes: int = option(
        DEFAULT_QUEUE_BYTES, "cascade bytes queued before new cascade writes are dropped"
    )
    max_queue_jobs: int = option(
        DEFAULT_QUEUE_JOBS, "cascade jobs queued before new cascade writes are dropped"
    )
    io_processes: int = option(
        2,
        "worker processes that do the block file I/O (checksum, write, read) off the "
        "daemon's interpreter lock, 0 for the daemon's own I/O threads",
    )
    io_worker_timeout: float = option(
        60.0,
        "an I/O worker process that has not answered a request (one group of blocks) "
        "within this long is killed and replaced: the request's blocks fail (a promotion "
        "answers MISS, a cascade is dropped) and their rows are released",
    )
    shared: bool = option(
        False,
        "several daemons (on this host or on hosts sharing the file system) use this root: "
        "lookups find files other daemons wrote, the capacity counts every file under the "
        "pool directories, a shared lock instead of an exclusive one (docs/guides/fleet.md)",
    )
    shared_negative_ttl: float = option(
        1.5,
        "shared root: how long a key found missing on disk answers MISS before it is checked again",
    )
    shared_rescan_interval: float = option(
        10.0,
        "shared root: seconds between rescans of the pool directories (files other daemons "
        "wrote or removed, the bytes under the root)",
    )
    integrity_key_file: str = option(
        "",
        "file of 32 random bytes (mode 0600): every block file is sealed with a MAC under "
        "this key and a file not sealed under this tier's keys is a MISS; required where "
        "another host can write the root (docs/security.md), empty for xxh3 checksums only",
    )
    integrity_verify_key_file: str = option(
        "", "a second key whose files verify too (never used to write): a key rotation"
    )

    def exclusive(self) -> Mapping[str, object]:
        """Options no two configured tiers may share: two tiers on one root would
        count and evict each other's files."""
        return {"root": self.root}

    def describe(self) -> str:
        """One line for the daemon's start log."""
        shared = ", shared with other daemons" if self.shared else ""
        return f"fs at {self.root}, capacity {self.capacity} bytes{shared}"


OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(FsTierSettings))

# Every option at its default, for code that takes the options one by one (FsTier,
# IoPool, the benchmarks). ``root`` has no default: it is "" here.
DEFAULTS = FsTierSettings(root="")


def default(option: str) -> Any:
    """The default of ``option`` (KeyError for ``root``, which has none)."""
    for f in dataclasses.fields(FsTierSettings):
        if f.name == option:
            if f.default is dataclasses.MISSING:
                raise KeyError(f"fs tier option {option!r} has no default")
            return f.default
    raise KeyError(f"no fs tier option {option!r}")


def format_default(option: str) -> str:
    """The default of ``option`` as it is written in a TOML file (``"10GiB"``, ``8``,
    ``false``, ``"auto"``); ``""`` for an option without a default."""
    try:
        value = default(option)
    except KeyError:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if option in _SIZE_OPTIONS:
        return f'"{size_text(value)}"'
    if option in _DURATION_OPTIONS:
        return f'"{value:g}s"'
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def option_help() -> dict[str, str]:
    """Each option's help with its default (or "required"), in declaration order."""
    return help_lines(FsTierSettings, format_default)


def options_markdown() -> str:
    """The docs' table of fs tier options (docs/reference/configuration.md)."""
    return markdown_table(FsTierSettings, format_default)


def parse_fs_settings(options: Mapping[str, Any]) -> FsTierSettings:
    """Validates an fs tier's options; raises TierOptionError naming the option."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TierOptionError(
            unknown[0], f"unknown fs tier option; known: {', '.join(sorted(OPTIONS))}"
        )
    if "root" not in options:
        raise TierOptionError("root", "missing: the directory for the block files")
    root = options["root"]
    if not isinstance(root, str) or not os.path.isabs(root):
        raise TierOptionError("root", f"expected an absolute directory path, got {root!r}")
    values: dict[str, Any] = {"root": os.path.normpath(root)}
    if "capacity" in options:
        values["capacity"] = read_size(options, "capacity", minimum=MIN_CAPACITY_BYTES)
    for key in ("create_root", "fsync", "shared"):
        if key in options:
            values[key] = read_bool(options, key)
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
            values[key] = read_int(options, key, 0, MAX_IO_THREADS)
    if values.get("read_threads", 1) + values.get("write_threads", 1) < 1:
        raise TierOptionError("read_threads", "read_threads + write_threads must be at least 1")
    if "max_queue_bytes" in options:
        values["max_queue_bytes"] = read_size(options, "max_queue_bytes", minimum=MIN_QUEUE_BYTES)
    if "io_processes" in options:
        values["io_processes"] = read_int(options, "io_processes", 0, MAX_IO_THREADS)
    if "max_queue_jobs" in options:
        values["max_queue_jobs"] = read_int(options, "max_queue_jobs", 1, MAX_QUEUE_JOBS)
    for key in sorted(_DURATION_OPTIONS & set(options)):
        values[key] = _duration(options, key)
    values.update(parse_key_options(options))
    return FsTierSettings(**values)


def _duration(options: Mapping[str, Any], key: str) -> float:
    try:
        seconds = parse_duration(options[key])
    except ValueError as exc:
        raise TierOptionError(key, str(exc)) from None
    if not 0.01 <= seconds <= MAX_SHARED_SECONDS:
        raise TierOptionError(key, f"must be 10ms to {MAX_SHARED_SECONDS:g}s, got {options[key]!r}")
    return seconds


if __name__ == "__main__":  # prints the docs table: python -m kvtierd.tiers.fs.settings
    print(options_markdown(), end="")
