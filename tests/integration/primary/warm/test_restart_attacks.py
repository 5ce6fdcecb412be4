"""Adversarial review of the wave-3 surfaces (fast lane, warm restart, shared fs
root, redis Cluster tier): each test proves one finding against the real daemon.

A finding fixed here has its test passing; one left open is ``xfail(strict=True)``
with the reason. Payloads are a function of the key (``payload(key)``), as in
the fs tier's tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from daemon_harness import (
    DaemonProcess,
    eventually,
    fs_tiers_config,
    health_status,
    peak_rss_bytes,
    start_daemon,
    write_config,
)
from engine_harness import MISS, Engine, block_keys
from local_users import LocalUser, other_user
from redis_harness import RedisServer, redis_config, redis_key

from kvtierd.primary.manager import PrimaryManager
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import FailedPrecondition

__all__ = ["other_user"]  # a fixture, imported for these tests


# -- redis tier ------------------------------------------------------------------------


PLANTED_BYTES = 160 << 20  # a value planted under a block's key, far over one block


def test_a_huge_value_planted_under_a_blocks_redis_key_is_read_bounded(
    redis_server: RedisServer, daemons: Callable[[str], DaemonProcess], key_prefix: str, pool_name
):
    """Anyone who can write to the redis server can plant a value of up to 512 MB
    under a block's key. A promotion used to ``GET`` it whole into the daemon (one
    per I/O thread at once: GBs) before checking its length; it reads at most one
    value's worth now, answers MISS and deletes the planted value."""
    daemon = daemons(redis_config(redis_server.url, key_prefix))
    keys = block_keys("huge", 2)
    server = redis.Redis.from_url(redis_server.url)
    victim = redis_key(key_prefix, pool_name, keys[0])
    server.set(victim, b"\0" * PLANTED_BYTES)
    engine = Engine(daemon, pool_name)
    before = peak_rss_bytes(daemon.proc.pid)

    def rejected() -> bool:  # a Lookup asks for the promotion (again)
        assert engine.wait_settled(keys[:1]) == [MISS]
        return engine.tier_stats().checksum_failures == 1

    eventually(rejected, 30.0, lambda: f"the value rejected: {engine.tier_stats()}", interval=0.2)
    grown = peak_rss_bytes(daemon.proc.pid) - before
    assert grown < PLANTED_BYTES // 4, f"the daemon's peak RSS grew by {grown >> 20} MiB"
    eventually(lambda: server.exists(victim) == 0, 10.0, "the planted value deleted")
    with pytest.raises(FailedPrecondition):  # never served
        engine.session.prepare_load(keys[:1])
    engine.close()
    server.close()


# -- fs root lock ----------------------------------------------------------------------

_PLANT_LOCK = """
import os, sys
path = sys.argv[1]
try:
    os.unlink(path)
except FileNotFoundError:
    pass
os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
"""


def _served_or_exited(daemon: DaemonProcess) -> None:
    def settled() -> bool:
        if not daemon.alive():
            return True
        return os.path.exists(daemon.socket_path) and health_status(daemon) == "SERVING"

    eventually(settled, 30.0, lambda: f"the daemon served or exited:\n{daemon.log()}")


@pytest.fixture
def sticky_root() -> Iterator[str]:
    """An fs root like /tmp: world-writable with the sticky bit (the start-up root
    check accepts it: others cannot swap the daemon's own entries)."""
    root = tempfile.mkdtemp(prefix="kvt-sticky-", dir="/tmp")
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_root_lock_file_planted_by_another_uid_is_refused(
    other_user: LocalUser, sticky_root: str
):
    """In a sticky root another uid may create ``.kvtierd-root.lock`` before the
    daemon. The daemon used to lock that file: its owner can then unlink it (its
    own file, even in a sticky directory) and plant a fresh one, which a second
    non-shared daemon locks too -- two ``shared = false`` daemons on one root, the
    very thing the lock exists to prevent. A lock file the daemon does not own is
    now refused at start (exit 2, naming it), so at most one of them ever runs."""
    lock = os.path.join(sticky_root, ".kvtierd-root.lock")
    planted = other_user.run_python(_PLANT_LOCK, lock)
    assert planted.returncode == 0, planted.stderr
    config = fs_tiers_config(sticky_root)
    first = start_daemon(config=config, wait=False)
    second: DaemonProcess | None = None
    try:
        _served_or_exited(first)
        replanted = other_user.run_python(_PLANT_LOCK, lock)  # its own file: it may
        assert replanted.returncode == 0, replanted.stderr
        second = start_daemon(config=config, wait=False)
        _served_or_exited(second)
        running = [d for d in (first, second) if d.alive()]
        assert len(running) <= 1, "two shared = false daemons run on one root"
        assert first.proc.wait(timeout=30) == 2, first.log()
        assert "kvtierd-root.lock" in first.log() and "another user" in first.log()
    finally:
        for daemon in (first, second):
            if daemon is not None:
                daemon.cleanup()


# -- warm restart ----------------------------------------------------------------------

WARM_BLOCK = 8192


def test_a_client_that_truncates_the_region_cannot_kill_the_daemon():
    """Every client of a pool holds its region file writable (the descriptor the
    daemon passes; group members may also open it), so it can ``ftruncate`` it. The
    warm-restart journal hashed completed rows through the daemon's mapping: a row
    past the new end raised SIGBUS and killed the daemon -- every pool and session of
    every user -- at the next CompleteStore. The journal now reads rows with
    ``preadv`` (a short read: the row is not vouched for, MISS after a restart)."""
    daemon = start_daemon("--lease", "2s", "--write-quarantine", "1s")
    try:
        client = Client(daemon.address)
        attacker = client.open_session("cut", block_bytes=WARM_BLOCK, num_blocks=64, layout="l1")
        bystander = client.open_session("other", block_bytes=WARM_BLOCK, num_blocks=64, layout="l1")
        os.truncate(attacker.region.path, 0)
        keys = [b"k%d" % i for i in range(8)]
        grant = attacker.prepare_store(keys)
        assert grant is not None and len(grant.block_ids) == 8
        attacker.complete_store(keys)  # never written: the rows are past the end
        journal = attacker.region.path[: -len(".region")] + ".journal"
        time.sleep(1.0)  # the journal hashes a completion within ~5 ms (BATCH_DELAY_SECONDS)
        assert daemon.alive(), f"the daemon died ({daemon.proc.returncode}):\n{daemon.log()}"
        assert bystander.lookup([b"x"]) == [LookupResult.MISS]  # everyone else still served
        assert os.path.exists(journal)
        attacker.close()
        bystander.close()
        client.close()
    finally:
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()


def test_a_truncated_region_cannot_kill_the_daemon_through_the_redis_tier(
    redis_server: RedisServer, key_prefix: str, pool_name
):
    """The redis tier's store hashed the row and handed it to the socket through the
    daemon's mapping on an I/O thread: a region its client truncated killed the
    daemon with SIGBUS at the cascade. Rows are now copied out with a system call
    (``kvtierd.primary.rows``): the store of a row past the cut fails, nothing else.
    (``tests/integration/primary/test_truncated_region.py`` covers every other path.)"""
    daemon = start_daemon(
        "--memory-budget", "64MiB", config=redis_config(redis_server.url, key_prefix)
    )
    try:
        engine = Engine(daemon, pool_name)
        os.truncate(engine.session.region.path, 0)
        keys = block_keys("cut", 4)
        engine.session.prepare_store(keys)
        engine.session.complete_store(keys)  # never written: past the end; cascaded to redis
        time.sleep(2.0)  # the cascade runs within milliseconds
        assert daemon.alive(), f"the daemon died ({daemon.proc.returncode})"
        engine.close()
    finally:
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()


# -- fast lane ---------------------------------------------------------------------------

LANE_LEASE_S = 6.0
_LANE_OWNER = """
import sys, time
from kvtierd_client.client import Client
client = Client(sys.argv[1])
session = client.open_session(sys.argv[2], block_bytes=4096, num_blocks=2, layout="l")
assert session._lane is not None, "no fast lane"
grant = session.prepare_store([b"a1", b"a2"])
print(time.monotonic(), *grant.block_ids, flush=True)
time.sleep(600)
"""


def test_rows_reserved_by_a_session_whose_lane_ended_stay_out_of_use_for_its_lease(pool_name):
    """A lane's end closes its session at once, before the lease its client (and the
    workers that copy for it, through its lease beacon) still holds as proof: vLLM's
    workers are other processes and go on copying into the session's reserved rows
    until ``send time + lease - margin``. The rows used to be quarantined only
    ``write_quarantine`` from the close, so with a quarantine shorter than the lease
    another session got them while those copies were still allowed: a late copy
    then overwrites a block another engine stored -- served as HIT, wrong bytes.
    They now stay quarantined until the session's lease would have run out, plus
    ``write_quarantine``."""
    daemon = start_daemon("--lease", f"{LANE_LEASE_S:g}s", "--write-quarantine", "0.5s", config="")
    owner = None
    try:
        owner = subprocess.Popen(
            [sys.executable, "-c", _LANE_OWNER, daemon.address, pool_name],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert owner.stdout is not None
        sent, *rows = owner.stdout.readline().split()
        assert sorted(map(int, rows)) == [0, 1]
        # the owner's proof: send time of its last answered call + lease (- a margin)
        proof_until = float(sent) + LANE_LEASE_S - 0.6
        owner.kill()  # its lane ends: EOF; the daemon closes the session at once
        owner.wait()
        with Client(daemon.address) as client:
            other = client.open_session(pool_name, block_bytes=4096, num_blocks=2, layout="l")
            while time.monotonic() < proof_until - 0.2:
                grant = other.prepare_store([b"b1", b"b2"])
                early = proof_until - time.monotonic()
                assert grant is None, f"its rows handed out {early:.1f}s before its proof ran out"
                time.sleep(0.1)
            grant = eventually(
                lambda: other.prepare_store([b"b1", b"b2"]), 20.0, "the rows back after the lease"
            )
            assert sorted(grant.block_ids) == [0, 1]
            other.close()
    finally:
        if owner is not None and owner.poll() is None:
            owner.kill()
            owner.wait()
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()


_LANE_LOADER = """
import sys, time
from kvtierd_client.client import Client
client = Client(sys.argv[1])
session = client.open_session(sys.argv[2], block_bytes=4096, num_blocks=2, layout="l")
assert session._lane is not None, "no fast lane"
rows = session.prepare_load([b"kept"])
print(time.monotonic(), *rows, flush=True)
time.sleep(600)
"""


def test_rows_pinned_by_a_session_whose_lane_ended_are_not_rewritten_within_its_lease(
    pool_name,
):
    daemon = start_daemon("--lease", f"{LANE_LEASE_S:g}s", config="")
    loader = None
    try:
        with Client(daemon.address) as client:
            keeper = client.open_session(pool_name, block_bytes=4096, num_blocks=2, layout="l")
            keeper.prepare_store([b"kept"])
            keeper.complete_store([b"kept"])
            loader = subprocess.Popen(
                [sys.executable, "-c", _LANE_LOADER, daemon.address, pool_name],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert loader.stdout is not None
            sent, row = loader.stdout.readline().split()
            proof_until = float(sent) + LANE_LEASE_S - 0.6
            loader.kill()  # its lane ends; its workers may load from the row until proof_until
            loader.wait()
            time.sleep(0.5)
            grant = keeper.prepare_store([b"new1", b"new2"])  # needs the pinned row too
            rewritten = grant is not None and int(row) in grant.block_ids
            assert not (rewritten and time.monotonic() < proof_until), (
                "the row a live lease still vouches for was handed to another writer"
            )
            keeper.close()
    finally:
        if loader is not None and loader.poll() is None:
            loader.kill()
            loader.wait()
        daemon.stop(signal.SIGKILL)
        daemon.cleanup()


def test_a_later_quarantine_does_not_hold_back_an_earlier_one():
    """A lane-ended session's rows are quarantined through its lease, so quarantines
    no longer arrive in time order: one queued later but due sooner is released at
    its own time, not behind the longer one (the queue is kept sorted)."""
    manager = PrimaryManager(4)
    manager.prepare_store([b"lane", b"expired"])
    manager.abort_and_quarantine([b"lane"], until=20.0)  # through the lease
    manager.abort_and_quarantine([b"expired"], until=5.0)
    assert manager.next_quarantine_release == 5.0
    assert manager.release_quarantine(6.0) == 1
    assert manager.release_quarantine(19.0) == 0
    assert manager.release_quarantine(20.0) == 1
    manager.check_invariants()


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
            session = client.open_session("fence", block_bytes=WARM_BLOCK, num_blocks=2)
            grant = session.prepare_store([b"in-flight-1", b"in-flight-2"])
            assert grant is not None and sorted(grant.block_ids) == [0, 1]
            old.stop(signal.SIGKILL)  # the writer's copies may go on for its 30 s lease
        new = start_daemon("--lease", "1s", "--write-quarantine", "1s", shm_dir=old.shm_dir)
        with Client(new.address) as client:
            session = client.open_session("fence", block_bytes=WARM_BLOCK, num_blocks=2)
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


def test_a_listen_path_too_long_for_the_sockets_next_to_it_is_a_config_error(tmp_path):
    """The daemon binds ``<listen>.regions``, ``.tickets`` and ``.lane`` next to its
    Unix socket; a listen path that fits the kernel's 107 bytes but not with those
    suffixes used to crash the start with a traceback (``AF_UNIX path too long``)
    after the gRPC socket was already bound. It is now refused as a config error
    (exit 2) naming the limit and the path."""
    directory = tempfile.mkdtemp(prefix="kvt-" + "x" * 70, dir="/tmp")
    try:
        path = os.path.join(directory, "k.sock")
        path = path + "s" * (104 - len(path))  # fits sun_path alone, not with ".regions"
        done = subprocess.run(
            [sys.executable, "-m", "kvtierd", "--config", write_config(tmp_path, ""),
             "--listen", "unix://" + path, "--shm-dir", "/dev/shm", "--metrics-address", ""],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "at most 99 bytes" in done.stderr and "Traceback" not in done.stderr
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
