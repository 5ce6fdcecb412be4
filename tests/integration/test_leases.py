"""A client that dies holding pins and a reservation leaks nothing: within the
lease its pins are released, its reservation aborted, and its blocks evictable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import NotFound

LEASE = 2.0  # the module daemon's --lease
QUARANTINE = 1.0  # and its --write-quarantine


def primary(stats):
    return stats.pools[0].tiers[0]


def test_sigkilled_client_releases_pins_and_reservations(daemon, pool_name):
    with Client(daemon.address) as client:
        owner = client.open_session(pool_name, block_bytes=4096, num_blocks=4)
        owner.prepare_store([b"shared"])
        owner.complete_store([b"shared"])

        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(f"""
                import sys, time
                from kvtierd_client.client import Client
                s = Client({daemon.address!r}).open_session({pool_name!r}, block_bytes=4096)
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
        killed_at = time.monotonic()

        while True:
            now = primary(client.get_stats(pool_name))
            if now.pinned_blocks == 0 and now.pending_blocks == 0:
                break
            assert time.monotonic() - killed_at < LEASE + 2.0, "pins outlived the lease"
            time.sleep(0.05)
        released_after = time.monotonic() - killed_at
        assert released_after <= LEASE + 2.0

        assert owner.lookup([b"half-written-1", b"half-written-2", b"shared"]) == [
            LookupResult.MISS, LookupResult.MISS, LookupResult.HIT,
        ]  # fmt: skip
        # the two aborted rows are quarantined (the dead writer might still write
        # them): 4 keys cannot fit into 4 rows yet, even by evicting "shared"
        assert primary(client.get_stats(pool_name)).quarantined_blocks == 2
        assert owner.prepare_store([b"n1", b"n2", b"n3", b"n4"]) is None
        while primary(client.get_stats(pool_name)).quarantined_blocks:
            assert time.monotonic() - killed_at < LEASE + QUARANTINE + 2.0, "rows never freed"
            time.sleep(0.05)
        grant = owner.prepare_store([b"n1", b"n2", b"n3", b"n4"])  # needs the shared row too
        assert grant is not None and grant.evicted_keys == [b"shared"]
        assert "lease expired" in daemon.log()


def test_keepalive_keeps_an_idle_session(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=2)
        session.prepare_store([b"k"])
        time.sleep(LEASE * 1.6)  # idle; only the background keepalive talks
        session.complete_store([b"k"])
        assert session.lookup([b"k"]) == [LookupResult.HIT]


def test_session_without_keepalive_expires(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=2,
                                      keepalive=False)  # fmt: skip
        session.prepare_store([b"k"])
        time.sleep(LEASE + 1.2)
        stats = primary(client.get_stats(pool_name))
        assert stats.pending_blocks == 0
        with pytest.raises(NotFound, match="session"):
            session.lookup([b"k"])
