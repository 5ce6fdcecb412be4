"""When a failed promotion is tried again (kvtierd.tiering.retries), on a fake clock.
The tiering's use of it, scenario by scenario: tests/unit/tiering/test_tiering.py."""

from __future__ import annotations

from fake_clock import FakeClock

from kvtierd.tiering.retries import (
    PROMOTION_RETRY_AFTER,
    TRANSIENT_RETRY_AFTER,
    FailedPromotion,
    FailedPromotions,
)

CAUSE = "the I/O worker died during the request"


def test_a_transient_window_ends_at_its_retry_time_and_a_fault_s_later() -> None:
    clock = FakeClock(50.0)
    failures = FailedPromotions(clock)
    assert failures.failed_for_now(0, [b"t"], CAUSE) == TRANSIENT_RETRY_AFTER
    failures.failed(0, [b"f"])
    assert failures.waiting(0, b"t") and failures.waiting(0, b"f")
    assert not failures.waiting(1, b"t")  # per tier
    assert failures.pending(0, b"t") == (
        FailedPromotion(50.0 + TRANSIENT_RETRY_AFTER, True, CAUSE, 1),
        TRANSIENT_RETRY_AFTER,
    )
    clock.advance(TRANSIENT_RETRY_AFTER)
    assert not failures.waiting(0, b"t") and failures.pending(0, b"t") is None
    assert failures.waiting(0, b"f")
    clock.advance(PROMOTION_RETRY_AFTER - TRANSIENT_RETRY_AFTER)
    assert not failures.waiting(0, b"f")


def test_a_fault_after_transient_failures_ends_the_streak() -> None:
    clock = FakeClock()
    failures = FailedPromotions(clock)
    failures.failed_for_now(0, [b"k"], CAUSE)
    failures.failed_for_now(0, [b"k"], CAUSE)
    failures.failed(0, [b"k"])
    assert failures.failed_for_now(0, [b"k"], CAUSE) == TRANSIENT_RETRY_AFTER


def test_forgotten_keys_may_be_promoted_at_once() -> None:
    failures = FailedPromotions(FakeClock())
    failures.failed(0, [b"a", b"b"])
    failures.forget(0, [b"a"])
    assert not failures.waiting(0, b"a") and failures.waiting(0, b"b")


def test_the_memory_is_bounded_oldest_failure_first() -> None:
    failures = FailedPromotions(FakeClock(), kept=3)
    failures.failed(0, [b"a", b"b", b"c"])
    failures.failed_for_now(0, [b"d"], CAUSE)
    assert len(failures) == 3
    assert not failures.waiting(0, b"a")  # pushed out: promoted again
    assert all(failures.waiting(0, key) for key in (b"b", b"c", b"d"))
