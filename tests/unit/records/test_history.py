"""The removal record behind Explain: bounded in keys and in records per key."""

from __future__ import annotations

import pytest
from heap_harness import retained_heap

from kvtierd.records.history import KEY_OVERHEAD_BYTES, RECORD_BYTES, RemovalLog


def test_keeps_the_last_records_per_key_oldest_first():
    log = RemovalLog(per_key=3)
    for i in range(5):
        log.record([b"k"], "primary", f"r{i}")
    assert [r.what for r in log.get(b"k")] == ["r2", "r3", "r4"]
    assert log.get(b"absent") == []


def test_keeps_every_record_until_per_key_is_reached():
    log = RemovalLog(per_key=4)
    for i in range(3):
        log.record([b"k"], "primary", f"r{i}")
        assert [r.what for r in log.get(b"k")] == [f"r{j}" for j in range(i + 1)]


def test_per_key_one_keeps_only_the_latest():
    log = RemovalLog(per_key=1)
    log.record([b"k"], "primary", "first")
    log.record([b"k"], "fs0", "second")
    assert [(r.tier, r.what) for r in log.get(b"k")] == [("fs0", "second")]


def test_forgets_the_least_recently_recorded_keys_first():
    log = RemovalLog(max_keys=2)
    log.record([b"a", b"b"], "primary", "evicted")
    log.record([b"a"], "fs0", "evicted")  # a is now the most recent
    log.record([b"c"], "primary", "flushed")
    assert len(log) == 2
    assert log.get(b"b") == []
    assert [(r.tier, r.what) for r in log.get(b"a")] == [("primary", "evicted"), ("fs0", "evicted")]
    assert log.get(b"c")[0].unix_time >= log.get(b"a")[0].unix_time


def test_byte_limit_forgets_the_least_recent_keys_first():
    """Scenario: 100-byte keys under a limit of ten of them and a count limit that
    never binds: the five oldest are forgotten, the newest ten kept."""
    per_key = 100 + KEY_OVERHEAD_BYTES + RECORD_BYTES
    log = RemovalLog(max_keys=1000, max_bytes=10 * per_key)
    keys = [b"%0100d" % i for i in range(15)]
    for key in keys:
        log.record([key], "primary", "evicted")
        assert log.nbytes <= 10 * per_key
    assert len(log) == 10 and log.nbytes == 10 * per_key
    assert all(log.get(key) == [] for key in keys[:5])
    assert all(log.get(key) for key in keys[5:])


def test_each_record_a_key_holds_is_counted_until_per_key():
    log = RemovalLog(max_bytes=1 << 20, per_key=2)
    log.record([b"k" * 50], "primary", "evicted")
    assert log.nbytes == 50 + KEY_OVERHEAD_BYTES + RECORD_BYTES
    log.record([b"k" * 50], "fs0", "evicted")
    assert log.nbytes == 50 + KEY_OVERHEAD_BYTES + 2 * RECORD_BYTES
    log.record([b"k" * 50], "fs0", "evicted again")  # the oldest record goes
    assert log.nbytes == 50 + KEY_OVERHEAD_BYTES + 2 * RECORD_BYTES
    assert len(log.get(b"k" * 50)) == 2


def test_forgetting_a_key_gives_back_what_its_records_counted():
    log = RemovalLog(max_keys=1, max_bytes=1 << 20)
    for what in ("a", "b", "c"):
        log.record([b"old"], "primary", what)
    log.record([b"new"], "primary", "evicted")  # max_keys: b"old" is forgotten
    assert log.get(b"old") == [] and log.nbytes == 3 + KEY_OVERHEAD_BYTES + RECORD_BYTES


KEYS = 2750  # just past 2/3 of a 4,096-slot table: the dict has just grown fourfold


def keys_of(length: int) -> list[bytes]:
    return [i.to_bytes(8, "big") * (length // 8) for i in range(KEYS)]


def record_in_calls_of_1024(log: RemovalLog, length: int) -> None:
    keys = keys_of(length)
    for start in range(0, KEYS, 1024):
        log.record(keys[start : start + 1024], "primary", "evicted")


def record_one_key_a_call(log: RemovalLog, length: int) -> None:
    for key in keys_of(length):
        log.record([key], "primary", "evicted")


def record_four_times_one_key_a_call(log: RemovalLog, length: int) -> None:
    keys = keys_of(length)
    for what in ("evicted", "flushed", "dropped", "evicted again"):
        for key in keys:
            log.record([key], "primary", what)


@pytest.mark.parametrize("length", [8, 256])
@pytest.mark.parametrize(
    "fill", [record_in_calls_of_1024, record_one_key_a_call, record_four_times_one_key_a_call]
)
def test_what_the_log_counts_covers_the_heap_it_takes(fill, length):
    """Scenario: 2,750 keys recorded in large calls (records shared), one key a
    call, and four records each; the heap the log then holds (tracemalloc, the
    allocator's rounding included) is at most what it counts. Before: a key
    recorded four times alone took 2.1x what was counted."""

    def build() -> RemovalLog:
        log = RemovalLog(max_keys=1 << 30, max_bytes=1 << 40)
        fill(log, length)
        return log

    log, heap = retained_heap(build)
    per_key = f"{heap / KEYS:.0f} heap bytes a key, {log.nbytes / KEYS:.0f} counted"
    assert heap <= log.nbytes, per_key
