"""SessionTable: leases on an injected clock (no sleeps), explicit renewal, stalls
credited, quarantined rows, the session limit and TakeEvents cursors."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from kvtierd.config import load_config
from kvtierd.contract import PoolSpec
from kvtierd.core.pool import Pool
from kvtierd.core.sessions import SessionTable
from kvtierd.errors import ResourceExhausted, SessionNotFound
from kvtierd.primary.region import Region
from kvtierd.records.events import event_bytes
from kvtierd.security.access import AccessDenied


@pytest.fixture
def pool(tmp_path):
    region = Region.create(tmp_path, "p", 4, 4096, prefault=False)
    limits = load_config(env={}).limits  # the defaults
    pool = Pool(PoolSpec("p", 4096, 4, "", "lru"), region, limits)
    try:
        yield pool
    finally:
        pool.close()


def test_a_lease_runs_out_without_calls_and_is_renewed_by_one(pool):
    clock = FakeClock(100.0)
    table = SessionTable(2.0, 8, clock=clock, write_quarantine=5.0)
    session = table.open(pool, "c", "unix:")
    clock.now += 1.5
    table.renew(table.get(session.id))  # a call: renewed until 103.5
    clock.now += 1.9
    assert table.expire() == 0
    clock.now += 0.1
    assert table.expire() == 1
    with pytest.raises(SessionNotFound):
        table.get(session.id)


def test_a_stall_of_the_daemon_is_credited_to_every_lease(pool):
    clock = FakeClock(100.0)
    table = SessionTable(2.0, 8, clock=clock)
    sessions = [table.open(pool, f"c{i}", "unix:") for i in range(3)]
    clock.now += 10.0  # the loop did not run for 10 s
    table.credit_stall(10.0)
    assert table.expire() == 0
    assert table.stalls_credited == 10.0
    clock.now += 2.0
    assert table.expire() == len(sessions)


def test_an_ended_sessions_reservations_are_quarantined_for_write_quarantine(pool):
    clock = FakeClock(100.0)
    table = SessionTable(2.0, 8, clock=clock, write_quarantine=5.0)
    session = table.open(pool, "writer", "unix:")
    pool.prepare_store(session.id, [b"a", b"b"])
    clock.now += 2.0
    assert table.expire() == 1
    stats = pool.statistics().primary
    assert (stats.pending_blocks, stats.quarantined_blocks) == (0, 2)
    assert pool.release_quarantine(clock.now + 4.9) == 0
    assert pool.release_quarantine(clock.now + 5.0) == 2
    pool.check_invariants()


def test_get_finds_a_session_without_renewing_its_lease(pool):
    clock = FakeClock(100.0)
    table = SessionTable(2.0, 8, clock=clock)
    session = table.open(pool, "c", "unix:")
    clock.now += 1.5
    assert table.get(session.id) is session
    assert session.expires_at == 102.0  # still the lease from the open
    table.renew(session)
    assert session.expires_at == 103.5
    clock.now += 2.0
    assert table.expire() == 1


def test_open_refuses_beyond_max_sessions_and_attaches_to_the_pool(pool):
    table = SessionTable(2.0, 2, clock=FakeClock(100.0))
    first = table.open(pool, "a", "unix:")
    table.open(pool, "b", "unix:")
    with pytest.raises(ResourceExhausted, match="2 sessions are open, the limit is 2"):
        table.open(pool, "c", "unix:")
    assert len(table) == 2 and pool.session_count == 2
    table.close(first.id)
    assert len(table) == 1 and pool.session_count == 1
    with pytest.raises(SessionNotFound):
        table.close(first.id)
    with pytest.raises(SessionNotFound):
        table.get(first.id)


def test_closing_a_session_releases_what_it_held_in_its_pool(pool):
    table = SessionTable(2.0, 8, clock=FakeClock(100.0), write_quarantine=5.0)
    owner, reader = table.open(pool, "owner", "unix:"), table.open(pool, "reader", "unix:")
    pool.prepare_store(owner.id, [b"a"])
    pool.complete_store(owner.id, [b"a"], True)
    pool.prepare_load(reader.id, [b"a"])
    pool.prepare_store(reader.id, [b"b"])
    pool.check_invariants()
    table.close(reader.id)
    assert pool.manager.ref_count(b"a") == 0 and pool.manager.ref_count(b"b") is None
    assert pool.statistics().primary.quarantined_blocks == 1
    pool.check_invariants()
    table.close_all("daemon shutdown")
    assert len(table) == 0 and pool.session_count == 0


def test_a_stall_credit_of_zero_or_less_changes_nothing(pool):
    clock = FakeClock(100.0)
    table = SessionTable(2.0, 8, clock=clock)
    session = table.open(pool, "c", "unix:")
    table.credit_stall(0.0)
    table.credit_stall(-1.0)
    assert session.expires_at == 102.0 and table.stalls_credited == 0.0


def test_take_events_moves_only_this_sessions_cursor_page_by_page(pool):
    table = SessionTable(2.0, 8, clock=FakeClock(100.0))
    first, second = table.open(pool, "a", "unix:"), table.open(pool, "b", "unix:")
    names = [f"k{i}".encode() for i in range(4)]
    for name in names:  # four stored events
        pool.prepare_store(first.id, [name])
        pool.complete_store(first.id, [name], True)
    one_event = event_bytes(pool.events.get(1))
    taken = table.take_events(first, max_bytes=one_event * 3)
    assert [seq for seq, _ in taken.events] == [1, 2, 3]
    assert (taken.dropped, taken.more, first.events_cursor) == (0, True, 3)
    taken = table.take_events(first, max_bytes=one_event * 3)
    assert [seq for seq, _ in taken.events] == [4] and not taken.more
    assert table.take_events(first, max_bytes=1).events == []
    assert second.events_cursor == 0  # untouched by the first session's reads
    assert [seq for seq, _ in table.take_events(second, max_bytes=1).events] == [1]


def test_a_session_opened_later_sees_only_later_events(pool):
    table = SessionTable(2.0, 8, clock=FakeClock(100.0))
    early = table.open(pool, "early", "unix:")
    pool.prepare_store(early.id, [b"a"])
    pool.complete_store(early.id, [b"a"], True)
    late = table.open(pool, "late", "unix:")
    assert late.events_cursor == 1
    assert table.take_events(late, max_bytes=1 << 20).events == []


def test_another_principals_call_on_a_session_is_refused_before_its_lease_moves(pool):
    """Scenario: team-b names team-a's session: KeepAlive-like ``get`` and ``close``
    are PERMISSION_DENIED and change nothing (the lease still runs out on time);
    every open, close and expiry is reported to ``observe_session``."""
    clock = FakeClock(100.0)
    table = SessionTable(2.0, 8, clock=clock)
    seen: list[tuple[str, str, str]] = []
    table.observe_session = lambda event, s, reason: seen.append((event, s.principal, reason))
    session = table.open(pool, "engine", "unix uid=1001", principal="team-a")
    clock.now += 1.5
    with pytest.raises(AccessDenied, match="belongs to principal 'team-a'; principal 'team-b'"):
        table.get(session.id, "team-b")
    with pytest.raises(AccessDenied):
        table.close(session.id, principal="team-b")
    clock.now += 0.5  # the lease taken at 100.0 ends now: the refused calls did not renew it
    assert table.expire() == 1
    other = table.open(pool, "engine", "unix uid=1001", principal="team-a")
    assert table.get(other.id, "team-a") is other
    table.close(other.id, principal="team-a")
    assert seen == [
        ("opened", "team-a", ""),
        ("expired", "team-a", "lease expired (2s without a call)"),
        ("opened", "team-a", ""),
        ("closed", "team-a", "closed by client"),
    ]
