"""A client that dies holding pins and a reservation leaks nothing: within the
lease its pins are released, its reservation aborted, and its blocks evictable.

These run against the real daemon, so leases run on real time; every wait is an
``eventually`` on what the daemon reports. The lease rules themselves (expiry,
renewal by calls, stall credit) are tested on an injected clock in
``tests/unit/core/test_sessions.py`` and ``tests/unit/api/test_handlers.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from daemon_harness import eventually

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import NotFound

LEASE = 2.0  # the module daemon's --lease
QUARANTINE = 1.0  # and its --write-quarantine


def primary(stats):
    return stats.pools[0].tiers[0]


@pytest.mark.parametrize("fast_lane", [False, True], ids=["grpc", "fast-lane"])
def test_sigkilled_client_releases_pins_and_reservations(daemon, pool_name, fast_lane):
    """The lease releases a dead client's session, over gRPC alone and with the
    fast lane (the client's default): the end of a lane connection does not end
    its session early, since processes copying its rows may trust its lease."""
    released_by = "lease expired"
    with Client(daemon.address) as client:
        owner = client.open_session(pool_name, block_bytes=4096, num_blocks=4)
        owner.prepare_store([b"shared"])
        owner.complete_store([b"shared"])

        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(f"""
                import sys, time
                from kvtierd_client.client import Client
                s = Client({daemon.address!r}, fast_lane={fast_lane!r}).open_session(
                    {pool_name!r}, block_bytes=4096
                )
                assert s.fast_lane is {fast_lane!r}
                s.prepare_load([b"shared"])
                s.prepare_store([b"half-written-1", b"half-written-2"])
                print("ready", flush=True)
                time.sleep(600)
            """)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout.readline().strip() == "ready"
            before = primary(client.get_stats(pool_name))
            assert (before.pinned_blocks, before.pending_blocks) == (1, 2)
            # while the child lives, the pinned block cannot be evicted
            assert owner.prepare_store([b"n1", b"n2", b"n3"]) is None
        finally:
            child.kill()
            child.wait()

        def released() -> bool:
            now = primary(client.get_stats(pool_name))
            return now.pinned_blocks == 0 and now.pending_blocks == 0

        eventually(released, LEASE + 30.0, "the dead client's pins and reservation released")

        assert owner.lookup([b"half-written-1", b"half-written-2", b"shared"]) == [
            LookupResult.MISS, LookupResult.MISS, LookupResult.HIT,
        ]  # fmt: skip
        # the two aborted rows are quarantined (the dead writer might still write
        # them): 4 keys cannot fit into 4 rows yet, even by evicting "shared"
        assert primary(client.get_stats(pool_name)).quarantined_blocks == 2
        assert owner.prepare_store([b"n1", b"n2", b"n3", b"n4"]) is None
        eventually(
            lambda: primary(client.get_stats(pool_name)).quarantined_blocks == 0,
            QUARANTINE + 30.0,
            "the quarantined rows freed",
        )
        grant = owner.prepare_store([b"n1", b"n2", b"n3", b"n4"])  # needs the shared row too
        assert grant is not None and grant.evicted_keys == [b"shared"]
        assert released_by in daemon.log()


def test_keepalive_keeps_an_idle_session(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=2)
        session.prepare_store([b"k"])
        idle_since = time.monotonic()

        def kept_past_its_first_lease() -> bool:
            # idle for 1.5 leases, and the keepalives answered since prove it alive
            now = time.monotonic()
            return now - idle_since > LEASE * 1.5 and session.lease_deadline > now

        eventually(kept_past_its_first_lease, LEASE * 1.5 + 30, "the session kept alive while idle")
        session.complete_store([b"k"])
        assert session.lookup([b"k"]) == [LookupResult.HIT]


def test_session_without_keepalive_expires(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=2,
                                      keepalive=False)  # fmt: skip
        session.prepare_store([b"k"])
        # GetStats is no call on the session: it renews nothing
        eventually(
            lambda: primary(client.get_stats(pool_name)).pending_blocks == 0,
            LEASE + 30.0,
            "the expired session's reservation aborted",
        )
        with pytest.raises(NotFound, match="session"):
            session.lookup([b"k"])
