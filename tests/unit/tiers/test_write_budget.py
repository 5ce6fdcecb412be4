"""A tier's write budget (kvtierd.tiers.budget): the token bucket on a fake clock,
and the ``max_write_bytes_per_s`` option of every tier type."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from kvtierd.tiers import registry
from kvtierd.tiers.budget import WriteBudget, write_budget
from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.fs.settings import parse_fs_settings
from kvtierd.tiers.redis.settings import parse_redis_settings

RATE = 1000  # bytes per second


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_the_bucket_starts_full_with_one_second_of_the_rate(clock):
    budget = WriteBudget(RATE, clock=clock)
    assert [budget.take(250) for _ in range(5)] == [True, True, True, True, False]
    stats = budget.statistics()
    assert (stats.burst_bytes, stats.passed_bytes, stats.refused_bytes) == (1000, 1000, 250)


def test_a_refused_write_takes_nothing(clock):
    budget = WriteBudget(RATE, clock=clock)
    assert budget.take(900)
    assert not budget.take(200)  # 100 left: refused, still 100
    assert budget.take(100)


def test_tokens_come_back_at_the_rate_and_no_more_than_the_burst(clock):
    budget = WriteBudget(RATE, clock=clock)
    assert budget.take(1000)
    clock.advance(0.25)
    assert budget.take(250) and not budget.take(1)
    clock.advance(3600)  # an idle hour refills one burst, not an hour of writes
    assert budget.take(1000) and not budget.take(1)


def test_a_clock_going_back_adds_nothing(clock):
    budget = WriteBudget(RATE, clock=clock)
    assert budget.take(1000)
    clock.advance(-10)
    assert not budget.take(1)
    clock.advance(10.5)  # back to where it was, then half a second on
    assert budget.take(500) and not budget.take(1)


def test_a_write_larger_than_the_burst_passes_from_a_full_bucket_and_owes_the_rest(clock):
    budget = WriteBudget(RATE, clock=clock)
    assert budget.take(3000)  # 2,000 bytes of debt
    clock.advance(2.5)
    assert not budget.take(1000)  # 500 tokens: not a whole burst yet
    clock.advance(0.5)
    assert budget.take(1000)


def test_a_minute_at_ten_times_the_budget_writes_the_budget_within_its_burst(clock):
    """The acceptance in miniature: 60 s of 100-byte writes at 10x a 1,000 B/s budget
    (one write each 10 ms): the bytes let through are the budget's, +- one burst."""
    budget = WriteBudget(RATE, clock=clock)
    passed = 0
    for _ in range(6000):
        passed += 100 * budget.take(100)
        clock.advance(0.01)
    assert 60 * RATE <= passed <= 61 * RATE
    assert budget.statistics().refused_bytes == 6000 * 100 - passed


def test_zero_is_no_budget_and_a_rate_below_one_byte_is_refused(clock):
    assert write_budget(0, clock) is None
    assert isinstance(write_budget(RATE, clock), WriteBudget)
    with pytest.raises(ValueError, match="at least 1 byte/s"):
        WriteBudget(0, clock=clock)


@pytest.mark.parametrize(
    "parse",
    [lambda o: parse_fs_settings({"root": "/x", **o}),
     lambda o: parse_redis_settings({"urls": ["redis://127.0.0.1:1"], **o})],
    ids=["fs", "redis"],
)  # fmt: skip
def test_every_tier_type_reads_max_write_bytes_per_s(parse):
    assert parse({}).max_write_bytes_per_s == 0
    assert parse({"max_write_bytes_per_s": "100MiB"}).max_write_bytes_per_s == 100 << 20
    assert parse({"max_write_bytes_per_s": 0}).max_write_bytes_per_s == 0
    for bad, says in [("1KiB", "must be 0 (none) or at least 4KiB, got '1KiB'"),
                      ("10MB", "sizes are binary, write '10MiB'"),
                      (-1, "")]:  # fmt: skip
        with pytest.raises(TierOptionError) as caught:
            parse({"max_write_bytes_per_s": bad})
        assert caught.value.key == "max_write_bytes_per_s" and says in caught.value.message


def test_the_configured_tier_holds_one_budget_for_its_pools_and_names_it():
    with_budget = parse_fs_settings({"root": "/x", "max_write_bytes_per_s": "20MiB"})
    configured = registry.configure("fs", "fs0", with_budget)
    assert configured.write_budget is not None and configured.write_budget.rate == 20 << 20
    assert configured.describe().endswith(", cascade writes at most 20MiB/s")
    plain = registry.configure("fs", "fs1", parse_fs_settings({"root": "/x"}))
    assert plain.write_budget is None and "at most" not in plain.describe()
