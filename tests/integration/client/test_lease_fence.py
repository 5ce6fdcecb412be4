"""The copier's fence against a real daemon: a session's lease proof, published in
shared memory (LeaseBeacon), read by another client's LeaseFence, which proves the
lease itself with a KeepAlive when the proof lapses (docs/design/leases.md)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from daemon_harness import eventually, start_daemon

from kvtierd_client.client import Client
from kvtierd_client.lease_beacon import LeaseBeaconReader, LeaseState
from kvtierd_client.lease_fence import LeaseFence


def test_the_fence_follows_the_owner_sessions_lease(daemon, pool_name):
    with Client(daemon.address) as owner_client, Client(daemon.address) as copier:
        owner = owner_client.open_session(pool_name, block_bytes=4096, num_blocks=2)
        beacon = owner.lease_beacon()
        fence = LeaseFence(copier, owner.lease_ms)
        assert fence.state(beacon.path, owner.session_id) is LeaseState.PROVEN
        assert LeaseBeaconReader(beacon.path).proven_until() > time.monotonic()
        owner.close()  # the copier must never copy into its rows again
        assert fence.state(beacon.path, owner.session_id) is LeaseState.DEAD
        assert not os.path.exists(beacon.path), "the beacon file outlived its session"
        fence.close()


def test_a_silent_owner_is_proven_alive_by_the_copier_until_it_expires(daemon, pool_name):
    """The owner stops renewing (no keepalive): its beacon lapses, the copier's own
    KeepAlive proves the session alive; once the daemon expired it, DEAD."""
    with Client(daemon.address) as owner_client, Client(daemon.address) as copier:
        owner = owner_client.open_session(
            pool_name, block_bytes=4096, num_blocks=2, keepalive=False
        )
        beacon = owner.lease_beacon()
        fence = LeaseFence(copier, owner.lease_ms)

        def lapsed_while_the_daemon_holds_the_lease() -> bool:
            # The owner's proof lapses a lease after its last call was sent; the
            # daemon expires the session a lease after that call arrived, a few ms
            # and up to one 100 ms tick later: a loaded host missed that window. So
            # the copier renews the lease meanwhile (not through the owner: its
            # proof still lapses), and the fence still has to prove it again below.
            copier.renew_lease(owner.session_id)
            return LeaseBeaconReader(beacon.path).proven_until() < time.monotonic()

        eventually(lapsed_while_the_daemon_holds_the_lease, 30, "the owner's proof lapsed")
        # the copier renews the owner's lease itself (the session id is its capability)
        assert fence.state(beacon.path, owner.session_id) is LeaseState.PROVEN
        assert not owner.closed and owner.lookup([b"k"]) is not None
        # a fence that stops asking lets the lease run out: then the session is gone
        # (watched in GetStats, which renews nothing; a fence's state() would)
        eventually(
            lambda: copier.get_stats(pool_name).pools[0].sessions == 0,
            30, "the daemon expired the silent owner's session",
        )  # fmt: skip
        other = LeaseFence(copier, owner.lease_ms)
        assert other.state(beacon.path, owner.session_id) is LeaseState.DEAD
        fence.close()
        other.close()


def test_an_unreachable_daemon_makes_the_lease_unknown_not_dead():
    """While the daemon's loop does not run, no proof can be had: UNPROVEN (the
    copier waits), and PROVEN again once it answers (the lease never ran out)."""
    daemon = start_daemon("--lease", "1s")
    try:
        with Client(daemon.address) as owner_client, Client(daemon.address) as copier:
            owner = owner_client.open_session("unknown", block_bytes=4096, num_blocks=2)
            beacon = owner.lease_beacon()
            fence = LeaseFence(copier, owner.lease_ms)
            os.kill(daemon.proc.pid, signal.SIGSTOP)
            try:
                eventually(
                    lambda: fence.state(beacon.path, owner.session_id) is LeaseState.UNPROVEN,
                    30, "unknown while the daemon is stopped",
                )  # fmt: skip
            finally:
                os.kill(daemon.proc.pid, signal.SIGCONT)
            eventually(
                lambda: fence.state(beacon.path, owner.session_id) is LeaseState.PROVEN,
                30, "proven again",
            )  # fmt: skip
            fence.close()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_planted_beacon_is_refused(tmp_path):
    path = tmp_path / "beacon"
    os.mkfifo(path)
    with pytest.raises(PermissionError, match="not a lease beacon"):
        LeaseBeaconReader(str(path))


def test_a_sweep_while_a_beacon_is_being_created_keeps_it(tmp_path, monkeypatch):
    """Another process's sweep can run between a new beacon file's creation and its
    flock (an owner descheduled on a loaded host): it must not take the file for
    an orphan. Here the sweep runs in exactly that window."""
    import fcntl

    from kvtierd_client import lease_beacon

    real_flock, sweeping = fcntl.flock, []

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if not sweeping:  # the owner's flock; the sweep's own flock passes through
            sweeping.append(True)
            lease_beacon.sweep_orphans(str(tmp_path))
            sweeping.clear()
        real_flock(fd, operation)

    monkeypatch.setattr(lease_beacon.fcntl, "flock", flock_after_a_sweep)
    beacon = lease_beacon.LeaseBeacon(str(tmp_path))
    monkeypatch.undo()
    try:
        assert os.path.exists(beacon.path), "a beacon being created was swept"
        assert lease_beacon.sweep_orphans(str(tmp_path)) == 0  # locked: a live owner's
    finally:
        beacon.close()


def test_beacons_of_killed_owners_are_swept_live_ones_kept(tmp_path):
    """A beacon's owner holds its flock for life: a SIGKILLed owner's file is
    removed by the next beacon made in that directory; a live owner's is not."""
    import subprocess
    import sys

    from kvtierd_client.lease_beacon import LeaseBeacon

    code = (
        "import sys, time; from kvtierd_client.lease_beacon import LeaseBeacon; "
        f"b = LeaseBeacon({str(tmp_path)!r}); print(b.path, flush=True); time.sleep(60)"
    )
    owners = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        paths = [owner.stdout.readline().strip() for owner in owners]
        owners[0].kill()
        owners[0].wait()
        mine = LeaseBeacon(str(tmp_path))
        assert not os.path.exists(paths[0]), "a dead owner's beacon was left behind"
        assert os.path.exists(paths[1]), "a live owner's beacon was removed"
        mine.close()
        assert not os.path.exists(mine.path)
    finally:
        for owner in owners:
            owner.kill()
            owner.wait()
