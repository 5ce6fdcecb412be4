"""The frequency sketch of ``admission = "tinylfu"``: estimates, the doorkeeper,
aging (by additions and on a fake clock), and its fixed size under a flood."""

from __future__ import annotations

import tracemalloc

import pytest
from fake_clock import FakeClock

from kvtierd.tiering.sketch import (
    AGE_SECONDS,
    COUNTER_MAX,
    DEPTH,
    DOOR_BYTES_PER_COUNTER,
    MAX_WIDTH,
    MIN_WIDTH,
    FrequencySketch,
    sketch_for,
    width_for,
)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_estimates_count_additions_the_doorkeeper_first():
    sketch = FrequencySketch(1024, clock=FakeClock())
    assert sketch.estimate(key(1)) == 0
    sketch.add(key(1))  # the doorkeeper only
    assert sketch.estimate(key(1)) == 1
    for expected in range(2, 6):
        sketch.add(key(1))
        assert sketch.estimate(key(1)) == expected
    assert sketch.estimate(key(2)) == 0


def test_a_counter_saturates():
    sketch = FrequencySketch(64, clock=FakeClock())
    for _ in range(100):
        sketch.add(key(7))
    assert sketch.estimate(key(7)) == COUNTER_MAX + 1  # counters + the doorkeeper's one


def test_aging_halves_after_sample_size_additions():
    sketch = FrequencySketch(1024, sample_size=100, clock=FakeClock())
    for _ in range(9):
        sketch.add(key(1))  # doorkeeper + 8 counted
    assert sketch.estimate(key(1)) == 9 and sketch.agings == 0
    for i in range(91):  # the 100th addition ages
        sketch.add(key(1000 + i))
    assert sketch.agings == 1
    assert sketch.estimate(key(1)) == 4  # 8 // 2, doorkeeper cleared


def test_aging_on_the_clock_when_additions_are_few():
    clock = FakeClock()
    sketch = FrequencySketch(1024, clock=clock)
    for _ in range(5):
        sketch.add(key(1))
    sketch.age_if_due()
    assert sketch.agings == 0 and sketch.estimate(key(1)) == 5
    clock.advance(AGE_SECONDS - 1)
    sketch.age_if_due()
    assert sketch.agings == 0
    clock.advance(1)
    sketch.age_if_due()
    assert sketch.agings == 1 and sketch.estimate(key(1)) == 2  # 4 // 2
    sketch.age_if_due()  # the next aging is AGE_SECONDS after this one
    assert sketch.agings == 1


def test_width_follows_the_tier_capacity_within_bounds():
    assert width_for(0) == MIN_WIDTH
    assert width_for(1000) == 4096  # 4 counters per block, a power of two
    assert width_for(1024) == 4096
    assert width_for(1025) == 8192
    assert width_for(10**9) == MAX_WIDTH
    assert sketch_for(1000).nbytes == 6 * 4096  # 24 bytes per block, rounded up
    assert sketch_for(1000).sample_size == 10_000
    with pytest.raises(ValueError, match="power of two"):
        FrequencySketch(1000)


def test_counting_allocates_nothing_per_key():
    """The sketch's size is DEPTH x width + 2 x width bytes, fixed: counting 20,000
    distinct keys grows Python's heap by no more than a few KiB (no per-key state;
    the 1M-key flood of tests/unit/tiering/test_admission.py checks the bytes too)."""
    width = 1 << 14
    sketch = FrequencySketch(width, clock=FakeClock())
    assert sketch.nbytes == DEPTH * width + DOOR_BYTES_PER_COUNTER * width
    sketch.add(key(0))  # the first call's own allocations are not the flood's
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            sketch.add(key(10_000 + i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16 * 1024, f"the heap grew by {grown} bytes"
    assert sketch.nbytes == DEPTH * width + DOOR_BYTES_PER_COUNTER * width
    assert sketch.agings == 0  # 20,001 additions < 10 x width / 4: nothing aged yet
