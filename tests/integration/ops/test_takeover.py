"""Upgrades without refused connections (issue #33 item 5, docs/operations/upgrades.md):
a daemon started with ``--takeover`` replaces the one serving its sockets; a
client in a tight loop never sees a refused connection, the old daemon exits and
the new one adopts its pools (warm restart). It never signals a process of
another uid nor one reached through a planted link; with nothing to replace it
is an ordinary start."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest
from daemon_harness import eventually, refused_start, start_daemon, write_config
from nonroot import as_user_prefix, require_nonroot_daemon
from shm_leftovers import shm_tempdir
from takeover_harness import CallLoop, plant_for_every_pid, refused_takeover, take_over
from warm_harness import BLOCK, BLOCKS, HIT, store

from kvtierd_client.client import Client
from kvtierd_client.errors import Unavailable


def test_takeover_under_a_tight_call_loop_refuses_no_connection_and_adopts_the_pool():
    """Lookups and KeepAlives as fast as one client can, across the takeover: not one
    connection refused (nor a missing socket file), the old daemon exits, and the
    new one answers HIT for the blocks stored before (adopted, not re-stored)."""
    old = start_daemon("--lease", "10s", "--write-quarantine", "1s")
    daemons = [old]
    try:
        keys = [f"kept-{i}".encode() for i in range(8)]
        with Client(old.address) as client:
            session = client.open_session(
                "warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1", keepalive=False
            )
            store(session, keys)
            loop = CallLoop(old.address, "warm", keys, BLOCK, BLOCKS).start()
            try:
                eventually(lambda: len(loop.successes) > 50, 30.0, "calls before the takeover")
                new = take_over(old)
                daemons.append(new)
                after = time.monotonic()
                eventually(lambda: loop.succeeded_since(after) > 50, 30.0, "calls after it")
            finally:
                loop.stop()
        assert loop.refused == [], (loop.refused[:3], new.log())
        assert old.proc.returncode == 0, old.log()
        assert new.alive()
        assert "took over" in new.log() and "put back" not in new.log()
        assert loop.answers[-1] == [HIT] * len(keys)
        with Client(new.address) as client:
            (stats,) = client.get_stats("warm").pools
            assert stats.warm_adopted_blocks == len(keys)
        # every socket is the new daemon's; its stop removes them all
        assert sorted(n for n in os.listdir(new.workdir) if "sock" in n) == [
            "kvtierd.sock", "kvtierd.sock.lane", "kvtierd.sock.regions",
        ]  # fmt: skip
        assert new.stop() == 0
        assert not [n for n in os.listdir(new.workdir) if "sock" in n]
    finally:
        for daemon in daemons:
            daemon.cleanup()


def test_open_session_waits_for_the_replaced_daemon_a_bounded_time_and_says_why():
    """While the replaced daemon has not exited (here: stopped with SIGSTOP), the new
    one opens no pool: OpenSession answers UNAVAILABLE after 10 s naming it, and
    succeeds once it is gone; calls not needing a pool are answered meanwhile."""
    old = start_daemon("--lease", "10s")
    daemons = [old]
    try:
        os.kill(old.proc.pid, signal.SIGSTOP)
        new = take_over(old, wait=False)
        daemons.append(new)
        eventually(lambda: "kvtierd ready" in new.log(), 60.0, lambda: new.log())
        with Client(new.address) as client:
            client.get_stats()  # answered at once
            began = time.monotonic()
            with pytest.raises(Unavailable, match=f"pid {old.proc.pid}.*has not exited"):
                client.open_session("warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1")
            assert 9.0 <= time.monotonic() - began < 30.0  # bounded (the client waits 120 s)
            os.kill(old.proc.pid, signal.SIGCONT)  # its SIGTERM is delivered now
            assert old.proc.wait(30.0) == 0
            client.open_session("warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1")
        assert new.stop() == 0
    finally:
        if old.alive():
            os.kill(old.proc.pid, signal.SIGCONT)
        for daemon in daemons:
            daemon.cleanup()


def test_takeover_with_nothing_running_is_an_ordinary_start():
    """No socket file, then a stale one (a crashed daemon's): the daemon starts as
    usual and serves."""
    daemon = start_daemon("--takeover")
    try:
        assert "no daemon serves" in daemon.log()
        assert daemon.stop() == 0
        crashed = start_daemon()
        crashed.stop(signal.SIGKILL)  # leaves its socket file, nobody listening
        assert os.path.exists(crashed.socket_path)
        again = take_over(crashed)
        assert "no daemon serves" in again.log()
        with Client(again.address) as client:
            client.get_stats()
        assert again.stop() == 0
        crashed.cleanup()
    finally:
        daemon.cleanup()


def test_takeover_attack_through_a_planted_link_signals_nobody():
    """A symlink planted at the listen path, pointing at a live daemon's socket (same
    uid): connect() would follow it; the takeover refuses and that daemon lives."""
    victim = start_daemon()
    workdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        os.symlink(victim.socket_path, os.path.join(workdir, "kvtierd.sock"))
        config = write_config(workdir, "[server]\ntakeover = true\n")
        line = refused_start(config, workdir)
        assert "is not a socket (a link or another file): not replaced" in line, line
        assert victim.alive() and "SIGTERM" not in victim.log()
        assert os.path.islink(os.path.join(workdir, "kvtierd.sock"))
        assert victim.stop() == 0
    finally:
        victim.cleanup()
        for name in os.listdir(workdir):
            os.unlink(os.path.join(workdir, name))
        os.rmdir(workdir)


def test_takeover_attack_on_a_daemon_of_another_uid_is_refused(accounts):
    """Root's takeover of a socket served by another user's daemon: refused with one
    line naming that uid, nothing signalled, its sockets left in place."""
    require_nonroot_daemon()
    other = accounts.user()
    shm_dir = shm_tempdir()
    os.chmod(shm_dir, 0o1777)  # as /dev/shm: the other user's daemon may use it
    victim = start_daemon(
        shm_dir=shm_dir, command_prefix=as_user_prefix(other), owner=(other.uid, other.gid)
    )  # fmt: skip
    try:
        config = write_config(victim.workdir, "[server]\ntakeover = true\n")
        line = refused_start(config, victim.workdir)
        assert f"belongs to uid {other.uid}" in line, line
        assert "a takeover only replaces a daemon of the same user" in line
        assert victim.alive() and "SIGTERM" not in victim.log()
        assert os.stat(victim.socket_path).st_uid == other.uid
        with Client(victim.address) as client:
            client.get_stats()
        assert victim.stop() == 0
    finally:
        victim.cleanup()


@pytest.mark.parametrize(
    "prefix", [".kvtierd.sock.staged-", ".kvtierd.sock.lane.keep-"], ids=["staged", "keep"]
)
def test_takeover_attack_files_planted_at_every_pids_name_change_nothing(other_user, prefix):
    """Another user plants a regular file, in the sticky socket directory, at the
    name a socket got for every pid (issue #40): at the gRPC socket's staged name the
    bind failed ("Address already in use"); at the lane's keep name the takeover
    failed half-way and took the old daemon's sockets with it. The names are random
    now: the takeover goes through and the planted files stay as they were."""
    old = start_daemon("--lease", "10s")
    daemons = [old]
    try:
        os.chmod(old.workdir, 0o1777)  # as /tmp: any user may create names there
        pids = plant_for_every_pid(other_user, old.workdir, prefix)
        new = take_over(old)
        daemons.append(new)
        assert new.proc.pid in pids  # its names under the old scheme were all taken
        assert old.proc.returncode == 0, old.log()
        with Client(new.address) as client:
            client.open_session("p", block_bytes=BLOCK, num_blocks=BLOCKS, keepalive=False)
        assert new.stop() == 0
        names = os.listdir(old.workdir)
        planted = [name for name in names if name.startswith(prefix)]
        assert len(planted) == len(pids)
        assert {os.lstat(os.path.join(old.workdir, n)).st_uid for n in planted} == {other_user.uid}
        assert [n for n in names if "sock" in n and not n.startswith(prefix)] == []
    finally:
        for daemon in daemons:
            daemon.cleanup()


def _socket_names(directory: str) -> dict[str, int]:
    """Each name in ``directory`` that a socket has or had: its inode."""
    return {
        name: os.lstat(os.path.join(directory, name)).st_ino
        for name in os.listdir(directory)
        if "sock" in name
    }


def test_takeover_attack_a_file_planted_at_a_new_socket_path_refuses_it_whole(other_user):
    """The old daemon serves no fast lane, the new one does; another user plants a
    regular file at the lane's path. The takeover used to rename the gRPC and region
    sockets over the old daemon's, then the lane's over the planted file (root may
    remove another user's file in a sticky directory). Every name is checked before
    the first rename now: the takeover refuses (exit 2, one line naming the path),
    renames and removes nothing, and the old daemon serves on, over the real client."""
    old = start_daemon("--lease", "10s", "--fast-lane", "false")
    try:
        os.chmod(old.workdir, 0o1777)
        lane = old.socket_path + ".lane"
        planted = other_user.run_python("import sys; open(sys.argv[1], 'x').close()", lane)
        assert planted.returncode == 0, planted.stderr
        before = _socket_names(old.workdir)
        _, line = refused_takeover(old, "--fast-lane", "true")
        assert f"{lane} is a regular file" in line and "nothing was replaced" in line, line
        assert _socket_names(old.workdir) == before
        assert os.lstat(lane).st_uid == other_user.uid
        assert old.alive() and "SIGTERM" not in old.log()
        with Client(old.address) as client:
            client.open_session("p", block_bytes=BLOCK, num_blocks=BLOCKS, keepalive=False)
        assert old.stop() == 0
    finally:
        old.cleanup()


def test_a_daemon_still_waiting_for_the_one_it_replaced_refuses_to_be_taken_over():
    """A (stopped with SIGSTOP, holding a pool's region) is taken over by B, which
    waits for A's exit. C's takeover of B used to succeed and leave A holding the
    region with nobody waiting for it: C's OpenSession answered FAILED_PRECONDITION
    "... give this one another memory.shm_dir" for as long as A lived. C refuses
    now (exit 2, naming A's pid); B serves on and opens the pool once A is gone."""
    a = start_daemon("--lease", "10s")
    daemons = [a]
    try:
        keys = [f"chain-{i}".encode() for i in range(4)]
        with Client(a.address) as client:
            session = client.open_session(
                "warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1", keepalive=False
            )
            store(session, keys)
        os.kill(a.proc.pid, signal.SIGSTOP)
        # B waits for A 3 x 20 s + 30 s before it kills it: longer than this test
        b = take_over(a, "--shutdown-grace", "20s", wait=False)
        daemons.append(b)
        eventually(lambda: "kvtierd ready" in b.log(), 60.0, lambda: b.log())
        c, line = refused_takeover(b)
        daemons.append(c)
        assert f"pid {b.proc.pid}" in line and f"pid {a.proc.pid}" in line, line
        assert b.alive()
        with Client(b.address) as client:
            client.get_stats()
            os.kill(a.proc.pid, signal.SIGCONT)  # its SIGTERM is delivered now
            assert a.proc.wait(30.0) == 0
            session = client.open_session(
                "warm", block_bytes=BLOCK, num_blocks=BLOCKS, layout="l1", keepalive=False
            )
            assert session.lookup(keys) == [HIT] * len(keys)
        assert b.stop() == 0
    finally:
        if a.alive():
            os.kill(a.proc.pid, signal.SIGCONT)
        for daemon in daemons:
            daemon.cleanup()
