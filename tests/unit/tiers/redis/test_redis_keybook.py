"""What a redis tier knows about keys on the loop (keybook.KeyBook), on a fake clock:
how long a held key is trusted, what a probe's answer does to a held key, the ttl,
the own-capacity LRU choice and what a dropped or evicted key answers after."""

from __future__ import annotations

from fake_clock import FakeClock

from kvtierd.contract import LookupResult
from kvtierd.tiers.redis.keybook import REMOVALS_KEPT, KeyBook

HIT, MISS = LookupResult.HIT, LookupResult.MISS
VALUE = 100
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def book(clock: FakeClock, ttl_ms: int | None = None) -> KeyBook:
    return KeyBook(VALUE, ttl_ms=ttl_ms, presence_ttl_s=1.0, clock=clock)


def test_a_held_key_is_trusted_for_presence_ttl_then_unknown_until_a_probe_sees_it() -> None:
    clock = FakeClock()
    keys = book(clock)
    keys.hold(A)
    assert keys.presence([A]) == [True]
    clock.advance(1.5)
    assert keys.presence([A]) == [None]  # the server may have evicted it: ask first
    assert keys.lookup([A]) == ([HIT], [])  # still held: a lookup answers from memory
    keys.answered([(A, True)], sent_at=clock.now - 0.1)
    assert keys.presence([A]) == [True]


def test_a_probe_that_found_a_held_key_gone_drops_it_only_if_it_was_stored_before() -> None:
    clock = FakeClock()
    keys = book(clock)
    keys.hold(A)
    keys.answered([(A, False)], sent_at=clock.now - 0.5)  # asked before the store
    assert keys.blocks == 1 and keys.removals.take() == []
    keys.writing([A])  # rewritten meanwhile: absent when asked, being stored now
    keys.answered([(A, False)], sent_at=clock.advance(0.5))
    assert keys.blocks == 1
    keys.written([A])
    keys.answered([(A, False)], sent_at=clock.now)
    assert keys.blocks == 0 and keys.used_bytes == 0
    assert keys.removals.take() == [A] and keys.removals.take() == []
    assert keys.removals.of(A)[0][1] == "evicted by the server (a probe found it gone)"
    assert keys.lookup([A]) == ([MISS], [])  # known absent: not asked again
    assert keys.contains(A) is False


def test_a_failed_node_leaves_its_keys_unknown() -> None:
    clock = FakeClock()
    keys = book(clock)
    keys.answered([(A, None), (B, True)], sent_at=clock.now)
    assert keys.presence([A, B]) == [None, True]
    assert keys.lookup([A, B]) == ([MISS, HIT], [A])


def test_a_held_key_past_its_ttl_is_dropped_at_its_lookup() -> None:
    clock = FakeClock()
    keys = book(clock, ttl_ms=2000)
    keys.hold(A)
    clock.advance(1.0)
    keys.hold(A)  # SET NX did not renew it: the expiry stays
    clock.advance(1.5)
    assert keys.presence([A]) == [False] and keys.contains(A) is False
    assert keys.lookup([A]) == ([MISS], [])
    assert keys.removals.take() == [A]
    assert keys.removals.of(A)[0][1] == "expired: its ttl ran out on the server"


def test_storing_a_key_replaces_what_a_probe_said_about_it() -> None:
    clock = FakeClock()
    keys = book(clock)
    keys.answered([(A, False)], sent_at=clock.now)
    assert keys.contains(A) is False and keys.needs_write(A)
    keys.hold(A)
    assert keys.contains(A) is True and not keys.needs_write(A)
    clock.advance(0.5)
    keys.drop(A, "vanished: the server holds no value")
    assert keys.presence([A]) == [False] and keys.blocks == 0
    assert keys.needs_write(A)


def test_eviction_takes_the_least_recent_and_spares_a_store_that_is_all_that_is_left() -> None:
    clock = FakeClock()
    keys = book(clock)
    keys.answered([(B, False)], sent_at=clock.now)  # replaced by the store
    for key in (A, B, C):
        keys.hold(key)
    keys.touch([A])  # recency: B, C, A
    assert keys.evict_over_capacity(2 * VALUE, protect={C}) == [B]
    assert keys.used_bytes == 2 * VALUE and list(keys.least_recent(5)) == [C, A]
    assert keys.removals.take() == [B]
    assert keys.presence([B]) == [None]  # evicted here: unknown, not known absent
    assert keys.evict_over_capacity(0, protect={C, A}) == []
    assert keys.blocks == 2


def test_the_removal_history_keeps_the_latest_removals_only() -> None:
    clock = FakeClock()
    keys = book(clock)
    for n in range(REMOVALS_KEPT + 1):
        key = n.to_bytes(16, "big")
        keys.hold(key)
        keys.drop(key, "gone")
    assert keys.removals.of((0).to_bytes(16, "big")) == []
    assert keys.removals.of(REMOVALS_KEPT.to_bytes(16, "big"))[0][1] == "gone"
    assert len(keys.removals.take()) == REMOVALS_KEPT + 1
