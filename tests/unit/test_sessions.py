"""SessionTable: leases on an injected clock, stalls credited, quarantined rows."""

from __future__ import annotations

import pytest

from kvtierd.config import load_config
from kvtierd.errors import SessionNotFound
from kvtierd.pool import Pool, PoolSpec
from kvtierd.region import Region
from kvtierd.security.access import AccessDenied
from kvtierd.sessions import SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
    clock = Clock()
    table = SessionTable(2.0, 8, clock=clock, write_quarantine=5.0)
    session = table.open(pool, "c", "unix:")
    clock.now += 1.5
    table.get(session.id)  # a call: renewed until 103.5
    clock.now += 1.9
    assert table.expire() == 0
    clock.now += 0.1
    assert table.expire() == 1
    with pytest.raises(SessionNotFound):
        table.get(session.id)


def test_a_stall_of_the_daemon_is_credited_to_every_lease(pool):
    clock = Clock()
    table = SessionTable(2.0, 8, clock=clock)
    sessions = [table.open(pool, f"c{i}", "unix:") for i in range(3)]
    clock.now += 10.0  # the loop did not run for 10 s
    table.credit_stall(10.0)
    assert table.expire() == 0
    assert table.stalls_credited == 10.0
    clock.now += 2.0
    assert table.expire() == len(sessions)


def test_an_ended_sessions_reservations_are_quarantined_for_write_quarantine(pool):
    clock = Clock()
    table = SessionTable(2.0, 8, clock=clock, write_quarantine=5.0)
    session = table.open(pool, "writer", "unix:")
    pool.prepare_store(session.id, [b"a", b"b"])
    clock.now += 2.0
    assert table.expire() == 1
    stats = pool.manager.statistics()
    assert (stats.pending_blocks, stats.quarantined_blocks) == (0, 2)
    assert pool.release_quarantine(clock.now + 4.9) == 0
    assert pool.release_quarantine(clock.now + 5.0) == 2
    pool.manager.check_invariants()


def test_another_principals_call_on_a_session_is_refused_before_its_lease_moves(pool):
    """Scenario: team-b names team-a's session: KeepAlive-like ``get`` and ``close``
    are PERMISSION_DENIED and change nothing (the lease still runs out on time);
    every open, close and expiry is reported to ``observe_session``."""
    clock = Clock()
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
