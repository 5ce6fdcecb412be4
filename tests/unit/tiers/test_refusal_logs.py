"""How both secondary tiers log the values that failed verification (a checksum or
header that does not check out, a value not sealed under the tier's keys): anyone who
can write the tier can make one per key, so each kind is one WARNING per interval,
and the next line says how many were suppressed (docs/security.md)."""

from __future__ import annotations

import logging

import pytest
from fake_clock import FakeClock

from kvtierd.contract import BlockKey
from kvtierd.tiers.fs.blockfile import CorruptFile
from kvtierd.tiers.fs.corruptlog import CORRUPT_LOG_INTERVAL_S, CorruptFileLog
from kvtierd.tiers.redis.blockio import BlockCorrupt
from kvtierd.tiers.redis.faultlog import FAULT_LOG_INTERVAL_S, TierFaultLog
from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.settings import RedisTierSettings
from kvtierd.util.ratelimit import RateLimitedLog


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_redis_refused_values_are_one_line_per_kind_per_interval_with_a_count(caplog):
    clock = FakeClock()
    logger = logging.getLogger("kvtierd.tiers.redis")
    link = RedisLink(RedisTierSettings(urls=("redis://127.0.0.1:9",), cluster="false"), None)
    faults = TierFaultLog(
        "redis", "p", link, RateLimitedLog(logger, FAULT_LOG_INTERVAL_S, clock=clock)
    )
    for i in range(1000):
        faults.refused(BlockKey(b"k%d" % i), BlockCorrupt("header names key 6b30"))
    faults.refused(BlockKey(b"forged"), BlockCorrupt("no MAC", integrity=True))
    clock.advance(FAULT_LOG_INTERVAL_S)
    faults.refused(BlockKey(b"later"), BlockCorrupt("header names key 6b30"))
    assert warnings(caplog) == [
        "redis tier redis: block 6b30 dropped: header names key 6b30 "
        "(counted in checksum_failures)",
        "redis tier redis: value of block 666f72676564 refused and deleted: no MAC "
        "(counted in integrity_failures)",
        "redis tier redis: block 6c61746572 dropped: header names key 6b30 "
        "(counted in checksum_failures) (999 similar lines suppressed since the previous one)",
    ]
    link.close()


def test_fs_refused_files_are_one_line_per_kind_per_interval_with_a_count(caplog):
    clock = FakeClock()
    logger = logging.getLogger("kvtierd.tiers.fs")
    files = CorruptFileLog("fs0", RateLimitedLog(logger, CORRUPT_LOG_INTERVAL_S, clock=clock))
    for i in range(1000):
        files.dropped(f"/root/p/{i}.kvb", CorruptFile("checksum mismatch", (1, i)))
    files.dropped("/root/p/fifo.kvb", CorruptFile("a fifo, not a regular file", (1, 0), "fifo"))
    files.dropped("/root/p/f.kvb", CorruptFile("no MAC", (1, 0), integrity=True))
    clock.advance(CORRUPT_LOG_INTERVAL_S)
    files.dropped("/root/p/later.kvb", CorruptFile("checksum mismatch", None))
    assert warnings(caplog) == [
        "FS tier fs0: removing corrupt block file /root/p/0.kvb: checksum mismatch "
        "(counted in checksum_failures)",
        "FS tier fs0: bad block file /root/p/fifo.kvb: a fifo, not a regular file; removing it",
        "FS tier fs0: removing corrupt block file /root/p/f.kvb: no MAC "
        "(counted in integrity_failures)",
        "FS tier fs0: removing corrupt block file /root/p/later.kvb: checksum mismatch "
        "(counted in checksum_failures) (999 similar lines suppressed since the previous one)",
    ]
