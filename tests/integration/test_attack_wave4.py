"""Adversarial review, wave 4, of the features that landed last: the fast lane
(#21), warm restart (#20), the redis Cluster tier and the shared fs root (#19).

Each test proves one finding against the real daemon over real sockets and
files (earlier waves: ``test_attack_findings.py``, ``test_attack_security.py``,
``test_attack_wave3.py``; their findings are not repeated). A finding fixed here
has its test passing; one left open is ``xfail(strict=True)`` with the reason.
The forged redis value (a valid unkeyed header over a writer's own bytes) was closed
by keyed integrity (issue #32): its test lives with its subject now,
``tests/integration/tiers/redis/test_redis_integrity.py``, with a shared fs twin.
"""

from __future__ import annotations

import grp
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis
from daemon_harness import DaemonProcess, eventually, fs_tiers_config, peak_rss_bytes, start_daemon
from engine_harness import HIT, MISS, Engine, block_keys
from lane_harness import read_frame
from local_users import SYSTEM_PYTHON, LocalUser, other_user
from redis_harness import RedisServer, redis_config, redis_key
from warm_harness import BLOCK, content, read_row, store, write_rows

from kvtierd.api.fastlane import MAX_BIND_FRAME_BYTES
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.wire.lane_frames import BIND, HEADER

__all__ = ["other_user"]  # a fixture, imported for these tests

# -- fast lane -------------------------------------------------------------------------


UNBOUND_PEERS = 6
CLAIMED_FRAME = 30 << 20  # under the default fast_lane_max_frame_bytes (~35 MiB)
SENT_BODY = 24 << 20


def test_an_unbound_lane_connection_cannot_make_the_daemon_hold_a_large_frame():
    """Anyone who can connect to ``<socket>.lane`` (the socket group, no token needed
    yet) could announce a frame of up to ``fast_lane_max_frame_bytes`` (~35 MiB)
    before BIND, and the daemon held it, twice over while joining its chunks, for
    up to ``bind_timeout`` -- on each of up to ``max_sessions + 64`` connections
    (~4,160 by default: far more RAM than the host has). An unbound connection may
    only send BIND now: a longer frame is refused at its header."""
    daemon = start_daemon("--memory-budget", "64MiB")
    lane_path = daemon.socket_path + ".lane"
    peers: list[socket.socket] = []
    try:
        # one peer: refused at the header alone, long before the 5 s bind timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lane:
            lane.settimeout(30)
            lane.connect(lane_path)
            started = time.monotonic()
            lane.sendall(HEADER.pack(CLAIMED_FRAME, BIND))
            answer = read_frame(lane)
            assert answer is not None, "the daemon closed the lane without an error frame"
            kind, body = answer
            assert kind == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], (kind, body)
            assert "before BIND" in body.decode(), body
            assert time.monotonic() - started < 4.0, "refused by the bind timeout, not the bound"
        # several peers pushing their frame's body: the daemon's memory stays flat
        before = peak_rss_bytes(daemon.proc.pid)
        chunk = b"\0" * (1 << 20)
        for _ in range(UNBOUND_PEERS):
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.settimeout(5)
            peer.connect(lane_path)
            peers.append(peer)
        for peer in peers:
            try:
                peer.sendall(HEADER.pack(CLAIMED_FRAME, BIND))
                for _ in range(SENT_BODY // len(chunk)):
                    peer.sendall(chunk)
            except OSError:
                pass  # cut: what the bound is for
        grown = peak_rss_bytes(daemon.proc.pid) - before
        assert grown < 48 << 20, f"the daemon's peak RSS grew by {grown >> 20} MiB"
        # a real client still binds its lane and is served
        with Client(daemon.address) as client:
            session = client.open_session("after", block_bytes=4096, num_blocks=8)
            assert session.fast_lane
            assert session.lookup([b"k"]) == [LookupResult.MISS]
        assert MAX_BIND_FRAME_BYTES >= 1 + 32
        assert daemon.alive()
    finally:
        for peer in peers:
            peer.close()
        daemon.stop()
        daemon.cleanup()


def test_idle_lane_connections_cannot_keep_a_session_off_its_lane():
    """Unbound connections counted against the lane's ``max_sessions + 64`` until
    their 5 s bind timeout: a peer of the socket group holding that many (and
    opening them again as they were cut) kept every new session off its lane -- its
    client fell back to gRPC, ~5x the control-plane cost. A full lane now drops the
    oldest connection that has not bound for a new one, as the region socket does."""
    daemon = start_daemon("--memory-budget", "64MiB", "--max-sessions", "4")
    lane_path = daemon.socket_path + ".lane"
    idle: list[socket.socket] = []
    try:
        for _ in range(4 + 64):  # every slot taken by a connection that never binds
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.settimeout(5)
            peer.connect(lane_path)
            idle.append(peer)
        time.sleep(0.3)  # accepted
        with Client(daemon.address) as client:
            session = client.open_session("idle", block_bytes=4096, num_blocks=8)
            assert session.fast_lane, "the session fell back to gRPC: the lane was full"
            assert session.lookup([b"k"]) == [LookupResult.MISS]
        dropped = read_frame(idle[0])  # the oldest idle connection made room
        assert dropped is not None and dropped[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert daemon.alive()
    finally:
        for peer in idle:
            peer.close()
        daemon.stop()
        daemon.cleanup()


# -- warm restart ----------------------------------------------------------------------

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
    shm_dir = tempfile.mkdtemp(prefix="kvtierd-test-", dir="/dev/shm")
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
            [SYSTEM_PYTHON, "-c", _HOLD_MAPPING, path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            user=other_user.uid, group=other_user.gid, extra_groups=[], cwd="/",
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
    shm_dir = tempfile.mkdtemp(prefix="kvtierd-test-", dir="/dev/shm")
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


# -- redis tier ------------------------------------------------------------------------

STORE_EVERY_S = 0.05
STALLED_FOR_S = 8.0


def _store_for(engine: Engine, seconds: float, prefix: str) -> tuple[int, int]:
    """Stores one new block every STORE_EVERY_S for ``seconds``: (stored, refused)."""
    stored = refused = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        keys = [f"{prefix}-{stored + refused}".encode()]
        grant = engine.session.prepare_store(keys)
        if grant is None or not grant.block_ids:
            refused += 1
        else:
            engine.session.complete_store(keys)
            stored += 1
        time.sleep(STORE_EVERY_S)
    return stored, refused


def test_a_redis_node_that_stops_answering_does_not_shut_the_primary_to_stores(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """Each cascade pins its primary block until the tier reports. A node that stops
    answering (SIGSTOP here: a hung host, a black-holed route; no RST) made every
    block wait ``timeout`` on one of the tier's threads, so the primary's store rate
    fell to ``threads / timeout`` blocks a second: with 2 threads and 1 s, 81 % of
    the stores of an engine storing 20 blocks a second were refused, for as long as
    the node hung (the issue: "the daemon keeps serving the primary"). A node that
    timed out is now skipped, its blocks failing at once, with one trial call at a
    time until it answers again."""
    config = redis_config(redis_server.url, key_prefix, timeout="1s").replace(
        "threads = 4", "threads = 2"
    )
    daemon = daemons(config)
    engine = Engine(daemon, pool_name, num_blocks=16)
    stored, refused = _store_for(engine, 2.0, "healthy")
    assert refused == 0, "a healthy node refused stores"
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        stored, refused = _store_for(engine, STALLED_FOR_S, "stalled")
        assert engine.session.lookup([b"unknown"]) == [LookupResult.MISS]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert refused <= 0.4 * (stored + refused), f"{refused} of {stored + refused} refused"
    # the node answers again: the tier takes it back by itself
    server = redis.Redis.from_url(redis_server.url)
    tries: list[bytes] = []

    def cascaded() -> bool:
        if tries and server.exists(redis_key(key_prefix, pool_name, tries[-1])):
            return True
        tries.append(b"later-%d" % len(tries))
        engine.store(tries[-1:], retry_for=10.0)
        return False

    eventually(cascaded, 30.0, "a block cascaded to the node once it answered", interval=0.5)
    assert daemon.alive()
    server.close()
    engine.close()


def test_an_unreachable_redis_server_never_stalls_the_event_loop_through_getstats(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """Until the tier has reached its server once, each I/O call tries to build the
    client (at most once a second), asking the seeds ``INFO cluster`` -- and the link
    held its lock across that, which the event loop takes to read the tier's health
    for GetStats and /metrics: with a server that accepts but never answers, every
    GetStats (every Prometheus scrape) froze the whole daemon -- every session of
    every pool -- for ``timeout``. The build no longer holds that lock."""
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # connected, never answering
    try:
        daemon = daemons(redis_config(redis_server.url, key_prefix, timeout="5s"))
        with Client(daemon.address, timeout=60) as client:
            session = client.open_session(pool_name, block_bytes=4096, num_blocks=16)
            worst = 0.0
            stop = threading.Event()

            def look_up() -> None:
                nonlocal worst
                n = 0
                while not stop.is_set():
                    started = time.monotonic()
                    session.lookup([b"k-%d" % n])  # each new key asks for a probe (a build)
                    worst = max(worst, time.monotonic() - started)
                    n += 1
                    time.sleep(0.02)

            looker = threading.Thread(target=look_up)
            looker.start()
            try:
                deadline = time.monotonic() + 12.0
                while time.monotonic() < deadline:
                    client.get_stats(pool_name)
                    time.sleep(0.05)
            finally:
                stop.set()
                looker.join()
            assert worst < 2.0, f"a Lookup waited {worst:.2f}s: the event loop stalled"
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


class TrickleProxy:
    """A TCP proxy in front of a real redis-server; once ``slow`` is set, the server's
    answers reach the daemon one byte every ``TRICKLE_S`` (a node or a middlebox that
    keeps the connection alive, so no socket timeout ever fires)."""

    TRICKLE_S = 0.5

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.slow = threading.Event()
        self.closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while not self.closed.is_set():
                data = source.recv(1 << 16)
                if not data:
                    return
                if answers and self.slow.is_set():
                    for i in range(len(data)):
                        sink.sendall(data[i : i + 1])
                        time.sleep(self.TRICKLE_S)
                else:
                    sink.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.closed.set()
        for each in self._sockets:
            each.close()


def test_a_redis_node_that_trickles_its_answers_does_not_shut_the_primary_to_stores(
    redis_server: RedisServer,
    daemons: Callable[[str], DaemonProcess],
    key_prefix: str,
    pool_name,
):
    """The tier's ``timeout`` was redis-py's socket timeout, which bounds each
    ``recv``, not a call: a node (or a middlebox) that answers one byte every half
    second never tripped it, so each call lasted as long as its answer had bytes (a
    SET's ``+OK``: 2.5 s; a block's load or an INFO: minutes) while the cascade held
    its primary pin, and the primary's stores were throttled as by a hung node
    (88 % refused). A whole call, a connection's handshake and a health check now
    have a deadline (2 x ``timeout``, kvtierd.tiers.redis.deadline), after which
    the node is skipped as for any timeout."""
    proxy = TrickleProxy(redis_server.port)
    try:
        config = redis_config(proxy.url, key_prefix, timeout="1s", cluster="false")
        daemon = daemons(config.replace("threads = 4", "threads = 2"))
        engine = Engine(daemon, pool_name, num_blocks=16)
        stored, refused = _store_for(engine, 2.0, "healthy")
        assert refused == 0, "a healthy node refused stores"
        proxy.slow.set()
        stored, refused = _store_for(engine, STALLED_FOR_S, "trickled")
        assert refused <= 0.5 * (stored + refused), f"{refused} of {stored + refused} refused"
        engine.close()
    finally:
        proxy.close()


# -- shared fs root --------------------------------------------------------------------


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


_PLANT_BLOCK_FILE = """
import os, sys
root, size, sparse = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "sparse"
path = os.path.join(root, "planted-0000000000000000", "00", "00")
os.makedirs(path)
with open(os.path.join(path, "00" * 20 + ".kvb"), "wb") as f:
    if sparse:
        f.truncate(size)  # its length, no disk block
    else:
        f.write(b"x" * size)
"""


@pytest.mark.parametrize(
    ("size", "kind"), [(1 << 40, "sparse"), (4 << 20, "written")], ids=["sparse-1TiB", "4MiB"]
)
def test_a_file_another_user_plants_in_a_shared_root_does_not_evict_the_cache(
    other_user: LocalUser, sticky_root: str, pool_name, size: int, kind: str
):
    """On a shared root the capacity counts the pool directories no pool here serves
    (other daemons' pools), file by file, by ``st_size``: anyone who may create a
    directory in the root (a sticky root is accepted at start) made a 1 TiB *sparse*
    ``*.kvb`` file there -- no disk used -- or a real one over the capacity, and at
    the next rescan the daemon evicted every block it had, and every new one right
    after its store. Files now count as the disk blocks they hold, and directories
    of another uid not at all (every daemon of a root runs as one uid: the root
    lock refuses another's)."""
    config = fs_tiers_config(
        sticky_root, shared=True, capacity=f"{1 << 20}", shared_rescan_interval="0.3s",
        shared_negative_ttl="0.2s",
    )  # fmt: skip
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        engine = Engine(daemon, pool_name)
        eventually(lambda: engine.tier_stats().ready, 30, "the fs tier's index ready")
        keys = block_keys("kept", 4)
        engine.store(keys)
        engine.settle_cascades()
        planted = other_user.run_python(_PLANT_BLOCK_FILE, sticky_root, str(size), kind)
        assert planted.returncode == 0, planted.stderr
        time.sleep(2.0)  # several rescans
        assert engine.client.flush_pool(pool_name) == 4  # loads now come from the fs tier
        assert engine.wait_settled(keys) == [HIT] * 4, "the planted file evicted the cache"
        assert engine.tier_stats().evictions == 0
        assert engine.wait_settled(block_keys("never", 1)) == [MISS]
        engine.close()
    finally:
        daemon.stop()
        daemon.cleanup()
