"""Issue #29, finding 1: fast-lane connections outlived their sessions.

As principal A, repeatedly: OpenSession, connect ``<socket>.lane``, BIND,
CloseSession over gRPC, keep the lane socket open. After ``max_sessions + 64``
such lanes every other principal's new session was refused a lane (its client
fell back to gRPC: the probe's Lookup mean went from 179 to 754 µs), and each of
those lanes still took a partial frame of up to ``fast_lane_max_frame_bytes``
(60 lanes: 67 MiB -> 2,057 MiB of RSS, held as long as the sockets stayed open);
a frame sent in 2-byte pieces was kept as that many objects (19.8 MiB sent,
155 MiB of RSS).

Now a lane ends with its session (a NOT_FOUND frame saying why, then the end of
the stream); a frame that did not arrive whole is held in one buffer sized from
its header, reserved against a per-principal and a global byte bound, and must
arrive within the frame timeout. Each test reproduces the attack against a real
daemon over real sockets (principals: real users) and fails without the fix.
"""

from __future__ import annotations

import fcntl
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import grpc
import pytest
from daemon_harness import DaemonProcess, eventually, peak_rss_bytes, start_daemon
from lane_harness import call_frame, read_frame
from users_harness import ThrowawayAccounts, principals_toml, run_as, start_shared

from kvtierd.api.fastlane import FRAMES_PER_OWNER
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.wire.lane_frames import BIND, HEADER, METHODS
from kvtierd_client.wire.peer_ticket import obtain_ticket
from kvtierd_client.wire.proto import pb2

MIB = 1 << 20
MAX_SESSIONS = 16
LOOKUP = METHODS["Lookup"][0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class Attacker:
    """Raw sessions and lanes of the test process (uid 0): gRPC calls carry its
    peer ticket when the daemon has principals."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.stub = daemon.stub()
        self.ticket = obtain_ticket(daemon.socket_path, timeout=10)
        self.metadata = self.ticket.metadata if self.ticket is not None else None
        self.lanes: list[socket.socket] = []

    def lane(self, pool: str) -> tuple[pb2.OpenSessionResponse, socket.socket]:
        """A new session of ``pool`` and its lane, bound."""
        spec = pb2.PoolSpec(name=pool, block_bytes=4096, num_blocks=16)
        response = self.stub.OpenSession(
            pb2.OpenSessionRequest(pool=spec), metadata=self.metadata, timeout=30
        )
        lane = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lane.settimeout(30)
        lane.connect(response.fast_lane_path)
        self.lanes.append(lane)
        lane.sendall(HEADER.pack(1 + len(response.fast_lane_token), BIND))
        lane.sendall(response.fast_lane_token)
        assert read_frame(lane) == (0, b""), "BIND refused"
        return response, lane

    def close_session(self, session_id: str) -> None:
        request = pb2.CloseSessionRequest(session_id=session_id)
        self.stub.CloseSession(request, metadata=self.metadata, timeout=30)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        if self.ticket is not None:
            self.ticket.close()


@pytest.fixture
def attacked() -> Iterator[tuple[DaemonProcess, Attacker]]:
    """A daemon without principals and the attacker's raw lanes to it."""
    daemon = start_daemon("--max-sessions", str(MAX_SESSIONS), "--memory-budget", "64MiB")
    attacker = Attacker(daemon)
    try:
        yield daemon, attacker
        assert daemon.stop() == 0, daemon.log()
    finally:
        attacker.close()
        daemon.cleanup()


def ends_with_not_found(lane: socket.socket, words: str) -> None:
    """``lane`` is answered NOT_FOUND naming ``words``, then ends (no timeout: the
    daemon must close it, not the test)."""
    answer = read_frame(lane)
    assert answer is not None, "the lane ended without saying why"
    assert answer[0] == NOT_FOUND and words in answer[1].decode(), answer
    assert read_frame(lane) is None, "the lane of an ended session stayed open"


def send_until_cut(lane: socket.socket, data: bytes) -> bool:
    """Sends ``data`` on ``lane``; False when the daemon had closed it."""
    try:
        lane.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


# -- lanes end with their session ----------------------------------------------------------


def test_lanes_of_closed_sessions_end_and_another_principal_still_gets_its_lane(
    accounts: ThrowawayAccounts,
):
    """The attack as the issue ran it: principal team-a (this process, uid 0) makes
    ``max_sessions + 64`` lanes of closed sessions and keeps every socket open;
    principal team-b (a real other user) then opens a session: it gets its lane
    and its Lookup is answered over it. Before the fix team-b's session was
    refused a lane (RESOURCE_EXHAUSTED: 80 fast lane connections are open) and
    fell back to gRPC."""
    group = accounts.group()
    b = accounts.user(group)
    config = principals_toml(
        {"name": "team-a", "uids": [0], "pools": ["team-a/*"]},
        {"name": "team-b", "uids": [b.uid], "pools": ["team-b/*"]},
    )
    daemon = start_shared(config, group, "--max-sessions", str(MAX_SESSIONS))
    attacker = Attacker(daemon)
    try:
        for _ in range(MAX_SESSIONS + 64):
            response, _ = attacker.lane("team-a/x")
            attacker.close_session(response.session_id)  # its lane stays open on this side
        [answer] = run_as(b, daemon.address, [["lane_lookup", "team-b/y"]])
        assert answer == {"ok": {"lane": True, "results": [1]}}, answer  # MISS, on its lane
        for lane in attacker.lanes:
            ends_with_not_found(lane, "closed")
        assert daemon.alive()
        assert daemon.stop() == 0, daemon.log()
    finally:
        attacker.close()
        daemon.cleanup()


def test_a_lane_ends_when_its_session_expires(pool_name):
    """A session left to its lease: when the lease runs out its lane is answered
    NOT_FOUND ("expired") and closed (before the fix it stayed open, bound to a
    session that no longer existed)."""
    daemon = start_daemon("--lease", "1s", "--write-quarantine", "0s")
    attacker = Attacker(daemon)
    try:
        response, lane = attacker.lane(pool_name)
        ends_with_not_found(lane, "expired")
        assert f"session {response.session_id} (" in daemon.log()
    finally:
        attacker.close()
        daemon.cleanup()


def test_partial_frames_on_lanes_of_closed_sessions_are_not_held(attacked, pool_name):
    """8 lanes of closed sessions each send all but the last MiB of a 30 MiB frame,
    then 16 KiB in 2-byte pieces: the daemon closed those lanes with their
    sessions, so nothing is sent at all and its peak RSS stays flat (before the
    fix it took the 240 MiB)."""
    daemon, attacker = attacked
    lanes = []
    for _ in range(8):
        response, lane = attacker.lane(pool_name)
        attacker.close_session(response.session_id)
        lanes.append(lane)
    before = peak_rss_bytes(daemon.proc.pid)
    body = b"\0" * (29 * MIB)
    taken = [send_until_cut(lane, HEADER.pack(30 * MIB, LOOKUP) + body) for lane in lanes]
    for lane in lanes:
        for _ in range(8192):
            if not send_until_cut(lane, b"ab"):
                break
    grown = peak_rss_bytes(daemon.proc.pid) - before
    assert not any(taken), f"{sum(taken)} lanes of closed sessions took a 29 MiB frame"
    assert grown < 16 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB"


# -- what a live lane may hold ---------------------------------------------------------------


def test_a_principal_holds_at_most_its_share_of_partial_frames(
    accounts: ThrowawayAccounts,
):
    """Principal team-a's 8 live lanes each announce a frame of the largest size
    and send 30 MiB of it: two are held (its share: two frames), the others are
    refused RESOURCE_EXHAUSTED naming the per-principal bound, and the daemon's
    RSS grows by those two frames only (before: 240 MiB, for as long as the
    sockets stay open). Principal team-b's lane still answers meanwhile."""
    group = accounts.group()
    b = accounts.user(group)
    config = principals_toml(
        {"name": "team-a", "uids": [0], "pools": ["team-a/*"]},
        {"name": "team-b", "uids": [b.uid], "pools": ["team-b/*"]},
    )
    daemon = start_shared(config, group, "--lease", "60s")
    attacker = Attacker(daemon)
    try:
        opened = [attacker.lane("team-a/x") for _ in range(8)]
        claim = opened[0][0].fast_lane_max_frame_bytes  # length field: kind + body
        before = peak_rss_bytes(daemon.proc.pid)
        body = b"\0" * (30 * MIB)
        held = [send_until_cut(lane, HEADER.pack(claim, LOOKUP) + body) for _, lane in opened]
        grown = peak_rss_bytes(daemon.proc.pid) - before
        assert held == [True] * FRAMES_PER_OWNER + [False] * (8 - FRAMES_PER_OWNER), held
        for _, lane in opened[FRAMES_PER_OWNER:]:
            answer = read_frame(lane)
            assert answer is not None and answer[0] == RESOURCE_EXHAUSTED, answer
            assert "team-a already holds" in answer[1].decode(), answer
            assert "per principal" in answer[1].decode(), answer
        assert grown < (FRAMES_PER_OWNER * 30 + 24) * MIB, f"RSS grew {grown / MIB:.0f} MiB"
        [answer] = run_as(b, daemon.address, [["lane_lookup", "team-b/y"]])
        assert answer == {"ok": {"lane": True, "results": [1]}}, answer
        assert daemon.stop() == 0, daemon.log()
    finally:
        attacker.close()
        daemon.cleanup()


SIOCOUTQ = termios.TIOCOUTQ  # the same request number: bytes the peer has not read yet


def unread(lane: socket.socket) -> int:
    return int(struct.unpack("i", fcntl.ioctl(lane.fileno(), SIOCOUTQ, b"\0" * 4))[0])


def test_a_frame_sent_in_2_byte_pieces_is_held_in_one_buffer(pool_name):
    """16 live lanes each announce a 1 MiB frame and send it 2 bytes at a time, the
    daemon reading every piece before the next (SIOCOUTQ). The daemon's RSS
    grows by about the bytes sent: each frame is one buffer. Before, every piece
    was a bytes object in a list: 640 KiB sent cost ~18 MiB."""
    daemon = start_daemon("--lease", "120s", "--watch-write-timeout", "120s")
    attacker = Attacker(daemon)
    try:
        lanes = [attacker.lane(pool_name)[1] for _ in range(16)]
        for lane in lanes:
            lane.sendall(HEADER.pack(1 << 20, LOOKUP))
        before = peak_rss_bytes(daemon.proc.pid)
        rounds = 20_000
        for _ in range(rounds):
            for lane in lanes:
                lane.sendall(b"ab")
            eventually(lambda: not any(map(unread, lanes)), 30, "the daemon reads", interval=0)
        grown = peak_rss_bytes(daemon.proc.pid) - before
        sent = rounds * 2 * len(lanes)
        assert grown < sent + 4 * MIB, f"{sent / MIB:.2f} MiB sent, RSS grew {grown / MIB:.1f} MiB"
        assert daemon.alive()
    finally:
        attacker.close()
        daemon.cleanup()


def test_a_frame_that_stops_arriving_is_cut_after_the_frame_timeout(pool_name):
    """A frame begun must arrive whole within the lane's frame timeout (the
    ``limits.watch_write_timeout``): a lane whose frame stops halfway is answered
    DEADLINE_EXCEEDED and cut, its buffer given back; its session is left to its
    lease. Before, a bound lane had no timeout at all and held it for ever."""
    daemon = start_daemon("--watch-write-timeout", "1s", "--lease", "60s")
    attacker = Attacker(daemon)
    try:
        response, lane = attacker.lane(pool_name)
        lane.sendall(HEADER.pack(4 * MIB, LOOKUP) + b"\0" * MIB)
        answer = read_frame(lane)
        assert answer is not None and answer[0] == DEADLINE_EXCEEDED, answer
        assert "did not arrive whole within 1s" in answer[1].decode(), answer
        assert read_frame(lane) is None
        keep = pb2.KeepAliveRequest(session_id=response.session_id)
        assert attacker.stub.KeepAlive(keep, timeout=10).lease_ms == 60_000
    finally:
        attacker.close()
        daemon.cleanup()


def test_frames_split_anywhere_and_large_frames_get_their_answers(attacked, pool_name):
    """The lane reads into a shared buffer, a header buffer and one buffer per
    frame that did not arrive whole: frames sent in pieces of 1 to 7 bytes, each
    read by the daemon before the next (headers split too), a frame with an empty
    body, and a Lookup of 20,000 keys (larger than a read) are all answered, in
    order, as gRPC answers them."""
    _, attacker = attacked
    response, lane = attacker.lane(pool_name)
    small = pb2.LookupRequest(session_id=response.session_id, keys=[b"k1", b"k2"])
    keys = [b"key-%08d" % i for i in range(20_000)]
    large = pb2.LookupRequest(session_id=response.session_id, keys=keys)
    trickled = call_frame("Lookup", small) + HEADER.pack(1, LOOKUP) + call_frame("Lookup", small)
    pos, size = 0, 1
    while pos < len(trickled):
        lane.sendall(trickled[pos : pos + size])
        eventually(lambda: unread(lane) == 0, 30, "the daemon reads", interval=0)
        pos, size = pos + size, size % 7 + 1
    lane.sendall(call_frame("Lookup", large) + call_frame("Lookup", small))
    answers = [read_frame(lane) for _ in range(5)]
    miss = [pb2.LOOKUP_RESULT_MISS]
    for index in (0, 2, 4):
        assert answers[index] is not None and answers[index][0] == 0, answers[index]
        assert list(pb2.LookupResponse.FromString(answers[index][1]).results) == miss * 2
    assert answers[1] is not None and answers[1][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"is not the session this fast lane is bound to" in answers[1][1], answers[1]
    assert answers[3] is not None and answers[3][0] == 0, answers[3]
    assert list(pb2.LookupResponse.FromString(answers[3][1]).results) == miss * len(keys)


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
