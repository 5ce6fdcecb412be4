"""Attacks on the warm restart, each against real daemons and files: an old copier
still loading under the old daemon's lease, a restart with a shorter lease, a restart
that takes a group's access away, a symlink planted in a sticky ``shm_dir``."""

from __future__ import annotations

import grp
import os
import shutil
import signal
import subprocess
import time

import pytest
from daemon_harness import (
    DaemonProcess,
    start_daemon,
)
from local_users import SYSTEM_PYTHON, LocalUser
from shm_leftovers import shm_tempdir
from spawn_harness import as_user
from warm_harness import BLOCK, content, read_row, store, write_rows

from kvtierd_client.client import Client, LookupResult

# -- redis tier ------------------------------------------------------------------------


# -- fs root lock ----------------------------------------------------------------------


# -- warm restart ----------------------------------------------------------------------


# -- fast lane ---------------------------------------------------------------------------


def test_a_restart_with_a_shorter_lease_keeps_the_old_sessions_rows_fenced():
    """Rows an old session was writing when its daemon died are quarantined by the
    adopting daemon for ``lease + write_quarantine`` -- its own settings. The old
    session's copiers trust the lease the *old* daemon granted (their beacon's proof
    runs until send time + that lease; their owner learns the session is gone only
    at its next keepalive, a third of that lease later). Restarted with a shorter
    lease, the daemon handed those rows to new writers while old copies were still
    allowed: a late copy then lands in another key's block, served as HIT. The
    journal now records the old fence and the adoption keeps the longer one."""
    old = start_daemon("--lease", "30s", "--write-quarantine", "10s", config="")
    new: DaemonProcess | None = None
    try:
        with Client(old.address) as client:
            session = client.open_session("fence", block_bytes=BLOCK, num_blocks=2)
            grant = session.prepare_store([b"in-flight-1", b"in-flight-2"])
            assert grant is not None and sorted(grant.block_ids) == [0, 1]
            old.stop(signal.SIGKILL)  # the writer's copies may go on for its 30 s lease
        new = start_daemon("--lease", "1s", "--write-quarantine", "1s", shm_dir=old.shm_dir)
        with Client(new.address) as client:
            session = client.open_session("fence", block_bytes=BLOCK, num_blocks=2)
            deadline = time.monotonic() + 5.0  # far past the new daemon's 2 s fence
            while time.monotonic() < deadline:
                assert session.prepare_store([b"new-1"]) is None, (
                    "a row the old session's writer may still copy into was handed out"
                )
                time.sleep(0.2)
            session.close()
    finally:
        for daemon in (new, old):
            if daemon is not None:
                daemon.stop(signal.SIGKILL)
        old.cleanup()
        if new is not None:
            new.cleanup()


# -- listen paths ----------------------------------------------------------------------


WARM_LEASE_S = 10.0


def test_a_load_under_the_old_daemons_lease_never_reads_a_row_reused_after_a_restart():
    """docs/design/leases.md: *a load that ended before the deadline read rows the
    session still pinned* -- the deadline being the client's proof of its lease
    (``Session.lease_deadline``; vLLM's workers read it from the lease beacon). A
    restart breaks that: the old daemon's pins are not journaled, so the new
    daemon adopts a pinned row as a plain ready block, evicts it at the first
    store into a full pool and hands the row to a writer at once, while a copier of
    the old session -- whose proven lease runs for seconds more -- is still loading
    from it. The load ends before its deadline and holds another key's bytes."""
    daemon = start_daemon("--lease", f"{WARM_LEASE_S:g}s", "--write-quarantine", "1s")
    daemons = [daemon]
    try:
        keys = [b"old-%d" % i for i in range(4)]
        with Client(daemon.address) as client:
            old = client.open_session(
                "w", block_bytes=BLOCK, num_blocks=4, layout="l", keepalive=False
            )
            store(old, keys)
            # a copier of the old session pins the oldest block to load it ...
            (row,) = old.prepare_load(keys[:1])
            deadline = old.lease_deadline
            path = old.region.path
            daemon.stop(signal.SIGTERM)  # ... and the daemon restarts under it
            daemon = daemon.restart()
            daemons.append(daemon)
            with Client(daemon.address) as other_client:
                new = other_client.open_session("w", block_bytes=BLOCK, num_blocks=4, layout="l")
                assert new.lookup(keys) == [LookupResult.HIT] * 4  # adopted
                grant = new.prepare_store([b"new-0"])  # full pool: evicts the oldest
                if grant is not None and grant.block_ids:
                    write_rows(path, {grant.block_ids[0]: content(b"new-0")})
                    new.complete_store([b"new-0"])
            loaded = read_row(path, row)  # the copier's load, still under its lease
            if time.monotonic() >= deadline:
                pytest.skip("the restart outlasted the lease: this run proves nothing")
            assert loaded == content(keys[0]), "a load under its lease read another key's bytes"
    finally:
        for each in daemons:
            each.stop(signal.SIGKILL)
        daemons[-1].cleanup()


_HOLD_MAPPING = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
region = mmap.mmap(fd, 0)
print("mapped", flush=True)
for line in sys.stdin:  # a row number: print that row's bytes, as hex
    row, size = (int(x) for x in line.split())
    print(region[row * size : (row + 1) * size].hex(), flush=True)
"""


def test_a_restart_that_takes_a_groups_access_away_does_not_leave_it_the_adopted_region(
    other_user: LocalUser, pool_name
):
    """An operator revokes a group's access to the cache (``server.socket_group``
    changed; the same holds for principals) and restarts the daemon. Warm restart
    adopted the same region file (same inode) and only re-applied the new group to
    it: every process of the old group that had mapped it -- by path or through a
    descriptor -- kept reading and writing it, so the KV bytes other users store
    after the restart reached the revoked group. A pool whose access changed now
    starts cold: a new region file, the old inode keeps only the old bytes."""
    group = grp.getgrgid(other_user.gid).gr_name
    shm_dir = shm_tempdir()
    os.chown(shm_dir, 0, other_user.gid)
    os.chmod(shm_dir, 0o750)  # the old group may reach the region files by path
    first = start_daemon("--socket-group", group, shm_dir=shm_dir)
    second: DaemonProcess | None = None
    holder: subprocess.Popen[str] | None = None
    try:
        with Client(first.address) as client:
            session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=4, layout="l")
            path = session.region.path
            store(session, [b"before"])
        holder = subprocess.Popen(
            as_user([SYSTEM_PYTHON, "-c", _HOLD_MAPPING, path], other_user.uid, other_user.gid),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "mapped"
        first.stop()
        # the restart takes the group's access away: the socket group is root's now
        second = start_daemon("--socket-group", "root", shm_dir=shm_dir)
        with Client(second.address) as client:
            session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=4, layout="l")
            assert os.stat(session.region.path).st_gid == 0  # by path: refused from now on
            rows = store(session, [b"secret-after-the-revocation"])
        holder.stdin.write(f"{rows[b'secret-after-the-revocation']} {BLOCK}\n")
        holder.stdin.flush()
        seen = bytes.fromhex(holder.stdout.readline().strip())
        assert seen != content(b"secret-after-the-revocation"), (
            "a process of the revoked group read bytes stored after the revocation"
        )
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for daemon in (first, second):
            if daemon is not None:
                daemon.stop(signal.SIGKILL)
        first.cleanup()
        if second is not None:
            second.cleanup()
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_symlink_any_user_plants_in_a_sticky_shm_dir_does_not_keep_the_daemon_down(
    other_user: LocalUser, pool_name
):
    """``memory.shm_dir`` is ``/dev/shm`` by default (the systemd and container
    configurations too): sticky, writable by every local user. A symlink planted
    there at any ``kvtierd-*.region`` name refused the daemon's start (exit 2), so
    any local user could keep kvtierd from starting or restarting -- with warm
    restart, restarts are routine -- until an administrator removed it. In a sticky
    shm_dir it is now a WARNING: nothing follows it, and only the pool whose file it
    would be is refused when created (a private shm_dir still refuses the start)."""
    shm_dir = shm_tempdir()
    os.chmod(shm_dir, 0o1777)
    daemon: DaemonProcess | None = None
    try:
        planted = other_user.run_python(
            "import os, sys; os.symlink('/etc/shadow', "
            "os.path.join(sys.argv[1], 'kvtierd-anything-0123456789ab.region'))",
            shm_dir,
        )
        assert planted.returncode == 0, planted.stderr
        daemon = start_daemon("--memory-budget", "64MiB", shm_dir=shm_dir)
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=4, layout="l")
            rows = store(session, [b"k"])
            assert read_row(session.region.path, rows[b"k"]) == content(b"k")
        assert "kvtierd-anything-0123456789ab.region" in daemon.log()
        assert os.path.islink(os.path.join(shm_dir, "kvtierd-anything-0123456789ab.region"))
    finally:
        if daemon is not None:
            daemon.stop()
            daemon.cleanup()
        shutil.rmtree(shm_dir, ignore_errors=True)
