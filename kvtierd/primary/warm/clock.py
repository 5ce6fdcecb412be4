"""Instants the warm-restart journal records, readable by the next daemon
(docs/design/journal.md, "How long an old client may touch a row").

A journal outlives its daemon, so a time it records must mean the same to the
process that reads it. An :class:`Instant` is written on two clocks:

* ``CLOCK_MONOTONIC`` (``time.monotonic_ns``): one clock for every process of a
  boot (in one time namespace), never stepped; meaningless across a reboot;
* ``CLOCK_REALTIME`` (``time.time_ns``): comparable across processes and boots,
  but an operator or NTP may step it.

The journal's header names the boot (:func:`current_boot_id`). Reading an
instant back (:meth:`Instant.seconds_left`): from another boot, no process of the
old one can still touch anything (0 s); from this boot, the *later* of the two
clocks' readings (a step of one clock cannot shorten a hold), capped by what the
writer could legitimately have promised (a wall clock stepped back cannot hold a
row for hours).
"""

from __future__ import annotations

import functools
import struct
import time
from dataclasses import dataclass

_PACKED = struct.Struct("<qq")  # monotonic ns, wall-clock ns
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True, slots=True)
class Instant:
    """A moment, on both clocks (nanoseconds)."""

    monotonic_ns: int
    wall_ns: int

    SIZE = _PACKED.size

    @classmethod
    def in_seconds(cls, seconds: float) -> Instant:
        """The moment ``seconds`` from now."""
        offset = int(seconds * 1e9)
        return cls(time.monotonic_ns() + offset, time.time_ns() + offset)

    @classmethod
    def decode(cls, data: bytes) -> Instant:
        monotonic_ns, wall_ns = _PACKED.unpack(data)
        return cls(monotonic_ns, wall_ns)

    def encode(self) -> bytes:
        return _PACKED.pack(self.monotonic_ns, self.wall_ns)

    def seconds_left(self, same_boot: bool, cap: float) -> float:
        """Seconds from now until this instant, in ``[0, cap]``: 0 for an instant of
        another boot; else the later of the two clocks' readings."""
        if not same_boot:
            return 0.0
        monotonic = (self.monotonic_ns - time.monotonic_ns()) / 1e9
        wall = (self.wall_ns - time.time_ns()) / 1e9
        return min(cap, max(0.0, monotonic, wall))


@functools.lru_cache(maxsize=1)
def current_boot_id() -> str:
    """The kernel's id of this boot ("" where it cannot be read: then every journal
    counts as of this boot, the cautious reading)."""
    try:
        with open(_BOOT_ID, encoding="ascii") as file:
            return file.read(64).strip()
    except OSError:
        return ""


def same_boot(boot_id: str) -> bool:
    """Whether ``boot_id`` (a journal's) is this boot's; True when either is unknown."""
    current = current_boot_id()
    return not boot_id or not current or boot_id == current
