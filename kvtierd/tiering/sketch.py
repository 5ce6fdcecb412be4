"""A frequency sketch over block keys, fixed in bytes: TinyLFU's count-min sketch
with a doorkeeper (Einziger, Friedman, Manes: "TinyLFU: A Highly Efficient Cache
Admission Policy", ACM ToS 2017; Caffeine's ``FrequencySketch``).

* The doorkeeper is a Bloom filter (two bits per key, 16 bits per counter of a
  row). A key's first addition only sets its bits; later ones increment the
  counting part. Most keys of a KV-cache
  trace are seen once, so the counters stay free for the keys that come back.
* The counting part is a count-min sketch: :data:`DEPTH` rows of ``width`` one-byte
  counters, each saturating at :data:`COUNTER_MAX`; a key's estimate is its smallest
  counter (+1 if the doorkeeper knows it). It overestimates (collisions), never
  underestimates between two agings.
* Aging: once ``sample_size`` additions were made (10 per block of the tier), or
  ``age_seconds`` passed since the last aging, every counter is halved and the
  doorkeeper cleared, so that what was frequent long ago fades.

Cost: :meth:`add` and :meth:`estimate` hash the key once (xxh3-64, stable across
processes) and touch :data:`DEPTH` counters and two bits: O(1). An aging is one
``bytes.translate`` of the counters (C speed: ~1 ms per MiB) once per
``sample_size`` additions: O(1) amortized. Memory: :attr:`FrequencySketch.nbytes`,
``DEPTH * width`` counter bytes plus ``2 * width`` doorkeeper bytes, allocated at
construction and never grown, whatever the number of distinct keys added. Sized by
:func:`width_for` (4 counters per row per block of the tier): 24 bytes per block,
at most 6 MiB. With 10 additions per block between agings the doorkeeper is at
most ~27 % full (a one-shot key passes it by mistake ~7 % of the time) and the
counters it lets through are a few per counter of a row.

Not thread-safe: one owner (the event loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import xxhash

from kvtierd.contract import BlockKey

DEPTH = 4  # rows of counters (hash functions); add() and estimate() are unrolled for 4
COUNTER_MAX = 15  # a counter saturates here (TinyLFU's 4 bits)
MIN_WIDTH = 64
MAX_WIDTH = 1 << 20  # counters per row: the sketch is at most 6 MiB
COUNTERS_PER_BLOCK = 4  # counters of a row per block of the tier
DOOR_BYTES_PER_COUNTER = 2  # doorkeeper bytes per counter of a row (16 bits)
SAMPLE_FACTOR = 10  # additions between agings, per block of the tier
AGE_SECONDS = 600.0  # the longest time between two agings
_HALVE = bytes(i >> 1 for i in range(256))  # bytes.translate table of one aging
_LOW32 = 0xFFFFFFFF


def width_for(blocks: int) -> int:
    """The counters per row of a sketch for a tier of ``blocks`` blocks: the power of
    two at or above :data:`COUNTERS_PER_BLOCK` x ``blocks``, within
    [:data:`MIN_WIDTH`, :data:`MAX_WIDTH`]."""
    width = MIN_WIDTH
    while width < COUNTERS_PER_BLOCK * blocks and width < MAX_WIDTH:
        width <<= 1
    return width


def sketch_for(blocks: int, clock: Callable[[], float] = time.monotonic) -> FrequencySketch:
    """The sketch of a tier of ``blocks`` blocks: :func:`width_for` counters per row,
    aged every :data:`SAMPLE_FACTOR` additions per block."""
    return FrequencySketch(
        width_for(blocks), sample_size=SAMPLE_FACTOR * max(1, blocks), clock=clock
    )


class FrequencySketch:
    """How often each key was added lately, estimated in a fixed number of bytes.

    Invariants: ``len(self._counters) == DEPTH * width`` and ``len(self._door) ==
    DOOR_BYTES_PER_COUNTER * width`` for the sketch's whole life; every counter is at
    most :data:`COUNTER_MAX`; ``self._additions < sample_size`` between calls.
    """

    def __init__(
        self,
        width: int,
        *,
        sample_size: int = 0,
        age_seconds: float = AGE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``width``: counters per row, a power of two in [MIN_WIDTH, MAX_WIDTH];
        ``sample_size``: additions between agings (0: ``SAMPLE_FACTOR * width /
        COUNTERS_PER_BLOCK``, as :func:`sketch_for` of the blocks it fits)."""
        if width & (width - 1) or not MIN_WIDTH <= width <= MAX_WIDTH:
            raise ValueError(f"width must be a power of two in [{MIN_WIDTH}, {MAX_WIDTH}]")
        self.width = width
        self.sample_size = sample_size or SAMPLE_FACTOR * width // COUNTERS_PER_BLOCK
        self._age_seconds = age_seconds
        self._clock = clock
        self._mask = width - 1
        self._door_mask = DOOR_BYTES_PER_COUNTER * width * 8 - 1  # bits of the doorkeeper
        self._counters = bytearray(DEPTH * width)
        self._door = bytearray(DOOR_BYTES_PER_COUNTER * width)
        self._additions = 0
        self._aged_at = clock()
        self.agings = 0  # how many agings so far (statistics)

    @property
    def nbytes(self) -> int:
        """The bytes of its tables: fixed at construction."""
        return len(self._counters) + len(self._door)

    def add(self, key: BlockKey) -> None:
        """Counts one occurrence of ``key`` (ages the sketch when its time has come)."""
        h = xxhash.xxh3_64_intdigest(key)
        low, high = h & _LOW32, (h >> 32) | 1
        door = self._door
        bit1, bit2 = low & self._door_mask, high & self._door_mask
        if not (door[bit1 >> 3] >> (bit1 & 7)) & 1 or not (door[bit2 >> 3] >> (bit2 & 7)) & 1:
            door[bit1 >> 3] |= 1 << (bit1 & 7)  # first sight: the doorkeeper only
            door[bit2 >> 3] |= 1 << (bit2 & 7)
        else:  # one counter per row (DEPTH == 4), unrolled: this runs per stored block
            counters, mask, width = self._counters, self._mask, self.width
            for i in (
                low & mask,
                width + ((low + high) & mask),
                2 * width + ((low + 2 * high) & mask),
                3 * width + ((low + 3 * high) & mask),
            ):
                if counters[i] < COUNTER_MAX:
                    counters[i] += 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self.age()

    def estimate(self, key: BlockKey) -> int:
        """How often ``key`` was added lately (never less than the truth since the
        last aging; more when other keys share its counters)."""
        h = xxhash.xxh3_64_intdigest(key)
        low, high = h & _LOW32, (h >> 32) | 1
        door = self._door
        bit1, bit2 = low & self._door_mask, high & self._door_mask
        known = (door[bit1 >> 3] >> (bit1 & 7)) & (door[bit2 >> 3] >> (bit2 & 7)) & 1
        counters, mask, width = self._counters, self._mask, self.width
        least = min(
            counters[low & mask],
            counters[width + ((low + high) & mask)],
            counters[2 * width + ((low + 2 * high) & mask)],
            counters[3 * width + ((low + 3 * high) & mask)],
        )
        return least + known

    def age_if_due(self) -> None:
        """Ages the sketch if ``age_seconds`` passed since its last aging (the owner
        calls it once per batch of additions: no clock read per key)."""
        if self._clock() - self._aged_at >= self._age_seconds:
            self.age()

    def age(self) -> None:
        """Halves every counter and clears the doorkeeper."""
        self._counters[:] = self._counters.translate(_HALVE)
        self._door[:] = bytes(len(self._door))
        self._additions = 0
        self._aged_at = self._clock()
        self.agings += 1
