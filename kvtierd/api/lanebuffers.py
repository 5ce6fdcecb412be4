"""The bytes the fast lane holds between reads, bounded per owner and in all.

A lane connection (``kvtierd.api.fastlane``) holds bytes between two reads in two
cases only: a frame that did not arrive whole, in one buffer allocated at its
header to the size the header announces (:func:`frame_buffer`), and, while its
client leaves the daemon's answers unread, the rest of the last read it had not
handled yet. Each such buffer is reserved here before it is allocated and
released when it is dropped. A reservation that would take its owner past
``per_owner`` bytes, or all owners together past ``total`` bytes, is refused
(the connection asking is cut), so neither one principal's connections nor all
of them together can make the daemon hold more, whatever the frames announce.

An owner is a string: a principal's name (with ``[[security.principals]]``) or
``uid N`` (without, and for a peer no principal lists).

Invariant: ``held(o)`` is the sum of owner ``o``'s live reservations, ``used``
the sum over every owner; ``held(o) <= per_owner`` and ``used <= total``.
Event-loop only.
"""

from __future__ import annotations

import mmap
from collections import Counter

from kvtierd.util.units import format_bytes

# Frames up to this size get a bytearray (zeroed at once); longer ones an
# anonymous mapping, whose pages are committed only as bytes arrive and go back
# to the kernel when it is dropped (a bytearray's pages may stay in the heap).
MAPPED_FROM_BYTES = 256 << 10


def frame_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer of exactly ``nbytes`` (> 0) for one frame's body."""
    if nbytes < MAPPED_FROM_BYTES:
        return bytearray(nbytes)
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class LaneBuffers:
    """Reservations of buffer bytes, by owner (see the module doc)."""

    def __init__(self, total: int, per_owner: int) -> None:
        self.total = total
        self.per_owner = per_owner
        self.used = 0
        self._held: Counter[str] = Counter()

    def held(self, owner: str) -> int:
        return self._held[owner]

    def reserve(self, owner: str, nbytes: int) -> str | None:
        """Reserves ``nbytes`` for ``owner``: None when granted, else why not (one
        line naming the bound; nothing is reserved then)."""
        held = self._held[owner]
        if held + nbytes > self.per_owner:
            return (
                f"{owner} already holds {format_bytes(held)} of partial fast lane frames, "
                f"at most {format_bytes(self.per_owner)} per principal; send each frame whole"
            )
        if self.used + nbytes > self.total:
            return (
                f"the fast lane holds {format_bytes(self.used)} of partial frames, at most "
                f"{format_bytes(self.total)} in all; retry"
            )
        self._held[owner] = held + nbytes
        self.used += nbytes
        return None

    def release(self, owner: str, nbytes: int) -> None:
        """Gives back ``nbytes`` of ``owner``'s reservations."""
        if nbytes <= 0:
            return
        left = self._held[owner] - nbytes
        if left > 0:
            self._held[owner] = left
        else:
            del self._held[owner]
        self.used -= nbytes
