"""The prefix cut: where a prefix chain of lookup answers stops being usable.

A prefix Lookup names the blocks of one request in order; a prefix cache can use
them only up to the first one it cannot get, so whatever lies after that key is
neither promoted nor pinned nor held, and answers MISS. Every place that needs
that position asks :func:`prefix_end` (the pool's answers and pins, the tiering's
promotions and holds), so they cannot disagree on where a chain ends.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvtierd.contract import LookupResult

# The answers a prefix chain can wait for: the block is in the primary, or a write
# into it is in flight.
SERVABLE: frozenset[LookupResult] = frozenset({LookupResult.HIT, LookupResult.HIT_PENDING})
# The answers a prefix chain can pin now.
READY: frozenset[LookupResult] = frozenset({LookupResult.HIT})


def prefix_end(answers: Sequence[LookupResult], usable: Container[LookupResult] = SERVABLE) -> int:
    """Position of the first answer not in ``usable``; ``len(answers)`` if there is
    none. ``answers[:end]`` is the usable prefix, ``answers[end]`` the key that
    stops it."""
    return next((i for i, answer in enumerate(answers) if answer not in usable), len(answers))
