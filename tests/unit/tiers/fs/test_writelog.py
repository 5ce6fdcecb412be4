"""The rate-limited reports of a tier's failed writes (kvtierd.tiers.fs.writelog), on an
injected clock."""

from __future__ import annotations

import errno
import logging

import pytest
from fake_clock import FakeClock

from kvtierd.tiers.fs.writelog import WriteFailureLog


def enospc(path: str = "/fs/p/ab/cd/abcd.kvb") -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", path)


def test_one_line_per_interval_with_the_count_of_suppressed_failures_then_one_recovery_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    reports = WriteFailureLog("nvme", logging.getLogger("test.writelog"), every_s=10, clock=clock)
    caplog.set_level(logging.DEBUG, logger="test.writelog")
    for _ in range(1000):
        reports.failed(enospc(), "/unused")
    clock.now += 10
    reports.failed(OSError(errno.EROFS, "Read-only file system"), "/fs/p/12/34/1234.kvb")
    lines = [r for r in caplog.records if r.name == "test.writelog"]
    assert [r.levelno for r in lines] == [logging.WARNING] * 2
    first = lines[0].getMessage()
    assert first.startswith("tier nvme: block write failed: ENOSPC (No space left on device) at ")
    assert "at /fs/p/ab/cd/abcd.kvb; " in first and "suppressed" not in first
    assert "EROFS (Read-only file system) at /fs/p/12/34/1234.kvb" in lines[1].getMessage()
    assert "(999 similar lines suppressed since the previous one)" in lines[1].getMessage()
    assert reports.failures == 1001

    caplog.clear()
    reports.succeeded()
    reports.succeeded()  # once only
    assert [r.getMessage() for r in caplog.records] == [
        "tier nvme: writes succeed again after 1001 failures"
    ]
    assert reports.failures == 0
    caplog.clear()
    reports.failed(enospc(), "/unused")  # a new episode reports at once
    assert len(caplog.records) == 1 and "suppressed" not in caplog.records[0].getMessage()
