"""The settings of one ``type = "fs"`` tier: every option, its default and its help,
declared once in :class:`FsTierSettings`.

Everything else is derived from the dataclass: the option names the parser
accepts, the help text (:func:`option_help`, shown by ``kvtierd --help``), the
README's table of fs options (:func:`options_markdown`; a test compares them),
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
from kvtierd.units import parse_size

O_DIRECT_MODES = ("auto", "on", "off")
MAX_IO_THREADS = 256  # per kind (read, write), and worker processes
MIN_CAPACITY_BYTES = 1 << 20
MIN_QUEUE_BYTES = 4096
MAX_QUEUE_JOBS = 1 << 20
_SIZE_OPTIONS = frozenset({"capacity", "max_queue_bytes"})  # written with a unit ("10GiB")


def _option(default: Any, help: str) -> Any:
    """A settings field: its default and the one line of help an operator reads."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class FsTierSettings:
    """One ``type = "fs"`` tier. ``capacity`` is shared by every pool of the daemon.

    The defaults below are the only place fs defaults are written.
    """

    root: str = field(
        metadata={"help": "directory holding the block files: an absolute path, existing "
                  "and writable unless create_root"}
    )  # fmt: skip
    capacity: int = _option(
        10 << 30, "bytes of block files of all pools together, least recently used go first"
    )
    create_root: bool = _option(False, "create the root directory if it is missing")
    fsync: bool = _option(False, "fdatasync every block file before it becomes visible")
    o_direct: str = _option(
        "auto", "auto, on or off: bypass the page cache, auto where supported and faster"
    )
    read_threads: int = _option(8, "I/O threads that prefer reads (promotions)")
    write_threads: int = _option(8, "I/O threads that prefer writes (cascades)")
    max_queue_bytes: int = _option(
        1 << 30, "cascade bytes queued before new cascade writes are dropped"
    )
    max_queue_jobs: int = _option(1024, "cascade jobs queued before new cascade writes are dropped")
    io_processes: int = _option(
        2,
        "worker processes that do the block file I/O (checksum, write, read) off the "
        "daemon's interpreter lock, 0 for the daemon's own I/O threads",
    )

    def exclusive(self) -> Mapping[str, object]:
        """Options no two configured tiers may share: two tiers on one root would
        count and evict each other's files."""
        return {"root": self.root}

    def describe(self) -> str:
        """One line for the daemon's start log."""
        return f"fs at {self.root}, capacity {self.capacity} bytes"


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
        return f'"{_size_text(value)}"'
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def option_help() -> dict[str, str]:
    """Each option's help with its default (or "required"), in declaration order."""
    helps = {}
    for f in dataclasses.fields(FsTierSettings):
        shown = format_default(f.name)
        helps[f.name] = f"{f.metadata['help']} ({f'default {shown}' if shown else 'required'})"
    return helps


def options_markdown() -> str:
    """The README's table of fs tier options (``| option | default | meaning |``)."""
    lines = ["| option | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(FsTierSettings):
        shown = format_default(f.name)
        lines.append(
            f"| `{f.name}` | {f'`{shown}`' if shown else 'required'} | {f.metadata['help']} |"
        )
    return "\n".join(lines) + "\n"


def _size_text(nbytes: int) -> str:
    """``nbytes`` with the largest binary unit that divides it ("1GiB", "4096")."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


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
        values["capacity"] = _size(options, "capacity", minimum=MIN_CAPACITY_BYTES)
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
        values["max_queue_bytes"] = _size(options, "max_queue_bytes", minimum=MIN_QUEUE_BYTES)
    if "io_processes" in options:
        values["io_processes"] = _int(options, "io_processes", 0, MAX_IO_THREADS)
    if "max_queue_jobs" in options:
        values["max_queue_jobs"] = _int(options, "max_queue_jobs", 1, MAX_QUEUE_JOBS)
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


if __name__ == "__main__":  # prints the README table: python -m kvtierd.tiers.fs.settings
    print(options_markdown(), end="")
