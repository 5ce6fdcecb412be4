"""RateLimitedLog: one line per key per interval, suppressed lines counted."""

from __future__ import annotations

import logging
import threading

import pytest
from fake_clock import FakeClock

from kvtierd.util.ratelimit import RateLimitedLog


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def limited(clock, caplog) -> RateLimitedLog:
    caplog.set_level(logging.DEBUG, logger="test.ratelimit")
    return RateLimitedLog(logging.getLogger("test.ratelimit"), 10.0, max_keys=3, clock=clock)


def messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_one_line_per_key_per_interval_then_the_suppressed_count(limited, clock, caplog):
    assert limited.warning("k", "disk full on %s", "/a") is True
    for _ in range(5):
        clock.now += 1
        assert limited.warning("k", "disk full on %s", "/a") is False
    clock.now += 10  # 15 s after the first line
    assert limited.warning("k", "disk full on %s", "/b") is True
    clock.now += 10
    assert limited.warning("k", "disk full on %s", "/c") is True
    assert messages(caplog) == [
        "disk full on /a",
        "disk full on /b (5 similar lines suppressed since the previous one)",
        "disk full on /c",
    ]
    assert all(record.levelno == logging.WARNING for record in caplog.records)


def test_keys_are_independent(limited, caplog):
    assert limited.warning("a", "a") and limited.warning("b", "b")
    assert not limited.warning("a", "a")
    assert limited.log(logging.ERROR, ("c", 1), "c") is True
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "ERROR"]


def test_disabled_level_is_neither_logged_nor_counted(limited, clock, caplog):
    caplog.set_level(logging.INFO, logger="test.ratelimit")
    assert limited.log(logging.DEBUG, "k", "x") is False
    assert limited.log(logging.INFO, "k", "y") is True
    assert messages(caplog) == ["y"]


def test_memory_is_bounded_by_max_keys(limited, clock, caplog):
    for key in ("a", "b", "c"):
        limited.warning(key, key)
    assert not limited.warning("a", "a")  # a: 1 suppressed
    limited.warning("d", "d")  # table full: the least recently logged key (a) is forgotten
    assert limited.statistics().keys_tracked == 3
    assert "a" not in limited.statistics().suppressed_by_key
    assert limited.warning("a", "a again") is True  # a new key now: logged, count lost
    assert messages(caplog)[-1] == "a again"


def test_threads_share_one_instance(limited, caplog):
    def hammer() -> None:
        for _ in range(1000):
            limited.warning("k", "x")

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert messages(caplog) == ["x"]
    assert limited.statistics().suppressed_by_key["k"] == 3999


def test_statistics_is_a_frozen_snapshot_of_the_suppressed_counts(limited, clock):
    assert limited.statistics().keys_tracked == 0
    limited.warning("k", "x")
    limited.warning("k", "x")
    before = limited.statistics()
    assert (before.keys_tracked, dict(before.suppressed_by_key)) == (1, {"k": 1})
    limited.warning("k", "x")
    limited.forget("k")
    assert before.suppressed_by_key["k"] == 1  # taken then: later lines do not change it
    assert limited.statistics().keys_tracked == 0
    with pytest.raises(TypeError):
        before.suppressed_by_key["k"] = 0  # type: ignore[index]


def test_rejects_nonsense_settings():
    with pytest.raises(ValueError, match="interval"):
        RateLimitedLog(logging.getLogger("x"), 0)
