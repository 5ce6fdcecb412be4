"""The fast lane (kvtierd.api.fastlane) against the real daemon over real sockets:
the same answers, errors and leases as gRPC, ordering, bad frames cut the
connection and nothing else, the end of a lane closes its session, a stalled
reader is cut, another uid cannot use a session's lane, and the client falls
back to gRPC when the lane is off or unreachable.

Most RPC contract tests elsewhere already run over the lane: the client uses it
by default. Here each behaviour is also compared with a gRPC-only client."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from daemon_harness import DaemonProcess, eventually, eventually_async, start_daemon, stopped
from lane_harness import bound_raw, call_frame, open_raw, read_frame

from kvtierd_client._rpc.codec import LOOKUP
from kvtierd_client.aio import AsyncClient
from kvtierd_client.client import Client, LookupResult
from kvtierd_client.errors import DeadlineExceeded, KvtierError, NotFound
from kvtierd_client.wire.lane_frames import BIND, METHODS, frame
from kvtierd_client.wire.proto import pb2

LEASE = 2.0
KEYS = [b"key-%d" % i for i in range(32)]


@pytest.fixture(scope="module")
def lane_daemon() -> Iterator[DaemonProcess]:
    daemon = start_daemon(
        "--memory-budget", "128MiB", "--lease", f"{LEASE:g}s", "--write-quarantine", "1s",
        "--watch-write-timeout", "1s",
    )  # fmt: skip
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def expired(daemon: DaemonProcess, session_id: str) -> bool:
    """Whether the daemon logged ``session_id``'s lease expiry (a KeepAlive to ask
    would renew the lease it is waiting out)."""
    return any(
        line.find(f"session {session_id} (") >= 0 and "lease expired" in line
        for line in daemon.log().splitlines()
    )


def session_alive(stub, session_id: str) -> bool:
    try:
        stub.KeepAlive(pb2.KeepAliveRequest(session_id=session_id))
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return False
    return True


def primary(client: Client, pool: str):
    return client.get_stats(pool).pools[0].tiers[0]


# -- same answers, same errors -------------------------------------------------------------


def test_session_calls_go_over_the_lane_with_the_grpc_answers(lane_daemon, pool_name):
    with Client(lane_daemon.address) as fast, Client(lane_daemon.address, fast_lane=False) as slow:
        a = fast.open_session(pool_name, block_bytes=4096, num_blocks=64)
        b = slow.open_session(pool_name, block_bytes=4096, num_blocks=64)
        assert a.fast_lane and not b.fast_lane
        grant = a.prepare_store(KEYS[:8])
        assert grant is not None and grant.keys_to_store == KEYS[:8]
        a.complete_store(KEYS[:8])
        assert a.lookup(KEYS) == b.lookup(KEYS)
        assert a.lookup(KEYS)[:9] == [LookupResult.HIT] * 8 + [LookupResult.MISS]
        pinned_a, pinned_b = a.lookup_and_pin(KEYS[:4]), b.lookup_and_pin(KEYS[:4])
        assert pinned_a == pinned_b and pinned_a[1] != [-1] * 4
        a.complete_load(KEYS[:4], unused=True)
        b.complete_load(KEYS[:4], unused=True)
        ids = a.prepare_load(KEYS[:2])
        assert ids == b.prepare_load(KEYS[:2])
        a.complete_load(KEYS[:2])
        b.complete_load(KEYS[:2])
        a.touch(KEYS[:2])
        assert a.keep_alive() == b.keep_alive() == int(LEASE * 1000)
        results = a.batch([("lookup", KEYS[:3], {}), ("prepare_load", [b"absent"], {})])
        assert results[0] == [LookupResult.HIT] * 3 and isinstance(results[1], KvtierError)
        assert a.fast_lane
        a.close()
        assert not session_alive(lane_daemon.stub(), a.session_id)


BAD_CALLS = [
    ("empty key", lambda s: s.lookup([b""])),
    ("duplicate keys", lambda s: s.lookup([b"k", b"k"])),
    ("key too long", lambda s: s.touch([b"x" * 300])),
    ("load a miss", lambda s: s.prepare_load([b"never-stored"])),
    ("complete an unpinned load", lambda s: s.complete_load([b"never-pinned"])),
    ("too many keys", lambda s: s.lookup([b"%d" % i for i in range(70000)])),
]


@pytest.mark.parametrize(("what", "bad_call"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_errors_have_the_grpc_exception_code_and_message(lane_daemon, pool_name, what, bad_call):
    with Client(lane_daemon.address) as fast, Client(lane_daemon.address, fast_lane=False) as slow:
        a = fast.open_session(pool_name, block_bytes=4096, num_blocks=64)
        b = slow.open_session(pool_name, block_bytes=4096, num_blocks=64)
        assert a.fast_lane
        with pytest.raises(KvtierError) as over_lane:
            bad_call(a)
        with pytest.raises(KvtierError) as over_grpc:
            bad_call(b)
        assert type(over_lane.value) is type(over_grpc.value)
        assert over_lane.value.code == over_grpc.value.code
        assert str(over_lane.value).replace(a.session_id, "S") == str(over_grpc.value).replace(
            b.session_id, "S"
        )
        assert a.keep_alive() > 0  # an error changes nothing: the lane still serves


def test_unparsable_request_is_the_grpc_invalid_argument_and_the_lane_stays(lane_daemon, pool_name):
    stub = lane_daemon.stub()
    response, lane = bound_raw(stub, pool_name)
    with lane:
        lane.sendall(frame(METHODS["Lookup"][0], b"\xff\xff\xff"))
        kind, body = read_frame(lane)
        with grpc.insecure_channel(lane_daemon.target) as channel:
            raw = channel.unary_unary("/kvtier.v1.KVTier/Lookup")  # bytes in, bytes out
            with pytest.raises(grpc.RpcError) as over_grpc:
                raw(b"\xff\xff\xff", timeout=10)
        assert kind == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert body.decode() == over_grpc.value.details()
        # the connection survived the bad body: a good call on it answers
        lane.sendall(call_frame("KeepAlive", pb2.KeepAliveRequest(session_id=response.session_id)))
        kind, body = read_frame(lane)
        assert kind == 0 and pb2.KeepAliveResponse.FromString(body).lease_ms > 0


def test_a_call_for_another_session_is_refused_on_a_bound_lane(lane_daemon, pool_name):
    stub = lane_daemon.stub()
    first, lane = bound_raw(stub, pool_name)
    second, other = bound_raw(stub, pool_name)
    with lane, other:
        lane.sendall(call_frame("KeepAlive", pb2.KeepAliveRequest(session_id=second.session_id)))
        kind, body = read_frame(lane)
        assert kind == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "is not the session this fast lane is bound to" in body.decode()


# -- ordering ---------------------------------------------------------------------------------


def test_pipelined_calls_are_applied_and_answered_in_order(lane_daemon, pool_name):
    """Frames sent in one write, without waiting: store, complete, lookup, touch,
    keepalive; each answer follows its call, and each call sees the ones before it."""
    stub = lane_daemon.stub()
    response, lane = bound_raw(stub, pool_name)
    sid = response.session_id
    with lane:
        frames = []
        for i in range(50):
            key = [b"ordered-%d" % i]
            frames.append(
                call_frame("PrepareStore", pb2.PrepareStoreRequest(session_id=sid, keys=key))
            )
            frames.append(
                call_frame(
                    "CompleteStore",
                    pb2.CompleteStoreRequest(session_id=sid, keys=key, success=True),
                )
            )
            frames.append(call_frame("Lookup", pb2.LookupRequest(session_id=sid, keys=key)))
        lane.sendall(b"".join(frames))
        for i in range(50):
            kind, body = read_frame(lane)
            assert kind == 0
            assert list(pb2.PrepareStoreResponse.FromString(body).keys_to_store) == [
                b"ordered-%d" % i
            ]
            assert read_frame(lane)[0] == 0
            kind, body = read_frame(lane)
            assert kind == 0
            assert list(pb2.LookupResponse.FromString(body).results) == [pb2.LOOKUP_RESULT_HIT]


# -- bad frames ---------------------------------------------------------------------------


def _expect_cut(lane: socket.socket, code: grpc.StatusCode, words: str) -> None:
    answer = read_frame(lane)
    assert answer is not None, "no error frame before the cut"
    kind, body = answer
    assert kind == code.value[0], body
    assert words in body.decode()
    assert read_frame(lane) is None  # then the daemon closed the connection


TOO_BIG = grpc.StatusCode.RESOURCE_EXHAUSTED
INVALID = grpc.StatusCode.INVALID_ARGUMENT
SIZE_WORDS = "a frame is 1 to"


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (struct.pack("<IB", 1 << 30, 1), TOO_BIG, SIZE_WORDS),
        (struct.pack("<IB", 0, 1), INVALID, SIZE_WORDS),
        (frame(99, b"junk"), INVALID, "unknown kind 99"),
        (b"GET / HTTP/1.1\r\n\r\n" * 3, TOO_BIG, SIZE_WORDS),
    ],
    ids=["oversize", "zero", "unknown-kind", "garbage"],
)
def test_a_bad_frame_cuts_its_lane_and_nothing_else(lane_daemon, pool_name, data, code, words):
    stub = lane_daemon.stub()
    with Client(lane_daemon.address) as client:
        bystander = client.open_session(pool_name, block_bytes=4096, num_blocks=64)
        assert bystander.fast_lane
        response, lane = bound_raw(stub, pool_name)
        with lane:
            lane.sendall(data)
            _expect_cut(lane, code, words)
        # the cut lane's session ends with its lease; the daemon and the other session serve on
        eventually(lambda: expired(lane_daemon, response.session_id), LEASE + 10.0, "expired")
        assert bystander.lookup([b"x"]) == [LookupResult.MISS]
        assert lane_daemon.alive()


def test_a_request_before_bind_and_a_wrong_token_are_refused(lane_daemon, pool_name):
    stub = lane_daemon.stub()
    response, lane = open_raw(stub, pool_name)
    with lane:
        lane.sendall(call_frame("KeepAlive", pb2.KeepAliveRequest(session_id=response.session_id)))
        _expect_cut(lane, grpc.StatusCode.FAILED_PRECONDITION, "the first frame must be BIND")
    response, lane = open_raw(stub, pool_name)
    with lane:
        lane.sendall(frame(BIND, b"\x00" * 32))
        _expect_cut(lane, grpc.StatusCode.UNAUTHENTICATED, "token is unknown or already used")
    # the token is still good for its own lane: refusals changed nothing
    _, lane = open_raw(stub, pool_name)
    with lane:
        lane.sendall(frame(BIND, response.fast_lane_token))
        assert read_frame(lane) == (0, b"")
        # and used up by it: a second connection cannot bind the session again
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as again:
            again.settimeout(30)
            again.connect(response.fast_lane_path)
            again.sendall(frame(BIND, response.fast_lane_token))
            _expect_cut(again, grpc.StatusCode.UNAUTHENTICATED, "already used")
        assert session_alive(stub, response.session_id)


# -- the end of a lane, leases, stalled readers ---------------------------------------------


def test_the_end_of_a_lane_leaves_its_session_to_its_lease(lane_daemon, pool_name):
    """A lane's end (the client died, or the daemon cut it) does not end its session:
    processes that copy its rows (vLLM's workers) trust its lease, so its pins and
    reservations hold until the lease runs out, then the session expires as a gRPC
    client's does. (Releasing them at the lane's end let a worker still loading
    under the lease read another key's bytes: test_attack_wave3.py.)"""
    with Client(lane_daemon.address, fast_lane=False) as client:
        owner = client.open_session(pool_name, block_bytes=4096, num_blocks=8)
        owner.prepare_store([b"pinned"])
        owner.complete_store([b"pinned"])
        response, lane = bound_raw(lane_daemon.stub(), pool_name)
        sid = response.session_id
        lane.sendall(
            call_frame("PrepareLoad", pb2.PrepareLoadRequest(session_id=sid, keys=[b"pinned"]))
        )
        lane.sendall(
            call_frame("PrepareStore", pb2.PrepareStoreRequest(session_id=sid, keys=[b"half"]))
        )
        assert read_frame(lane)[0] == 0 and read_frame(lane)[0] == 0
        ended = time.monotonic()
        lane.close()  # EOF, as when the client process dies
        time.sleep(LEASE / 4)
        held = primary(client, pool_name)
        if time.monotonic() - ended < LEASE * 0.9:  # (a stalled test machine proves nothing)
            assert (held.pinned_blocks, held.pending_blocks) == (1, 1)

        def released() -> bool:
            now = primary(client, pool_name)
            return now.pinned_blocks == 0 and now.pending_blocks == 0

        eventually(released, LEASE + 10.0, "the lane's pins and reservation released")
        assert time.monotonic() - ended >= LEASE * 0.9, "released before its lease ran out"
        assert expired(lane_daemon, sid)


def test_lane_calls_renew_the_lease(lane_daemon, pool_name):
    with Client(lane_daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=8, keepalive=False)
        assert session.fast_lane
        deadline = time.monotonic() + 2.5 * LEASE
        while time.monotonic() < deadline:
            assert session.lookup([b"k"]) == [LookupResult.MISS]
            time.sleep(LEASE / 5)
        assert session_alive(lane_daemon.stub(), session.session_id)


def test_a_lane_that_stops_reading_is_cut(lane_daemon, pool_name):
    """--watch-write-timeout 1s: answers left unread that long cut the lane."""
    response, lane = bound_raw(lane_daemon.stub(), pool_name)
    sid = response.session_id
    # a Lookup with pin answers ~11 bytes per 1-byte key (a result and a block id
    # of -1): more than it asks, so the daemon's answers pile up
    keys = [bytes([a, b]) for a in range(1, 65) for b in range(1, 65)]
    request = call_frame("Lookup", pb2.LookupRequest(session_id=sid, keys=keys, pin=True))
    lane.setblocking(False)
    sent = 0
    stuck_since = None
    with lane:
        while True:
            try:
                sent += lane.send(request)
                stuck_since = None
            except BlockingIOError:
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since > 1.0:
                    break  # the daemon stopped reading: its answers wait for us
                time.sleep(0.01)
            except (BrokenPipeError, ConnectionResetError):
                break
        assert sent > 64 << 10  # far more than one answer: the daemon stopped reading
        eventually(lambda: "answers unread" in lane_daemon.log(), 30.0, "the stalled lane cut")
        # its session then ends with its lease (its pins held until then)
        eventually(lambda: expired(lane_daemon, sid), LEASE + 30.0, "the session's lease expiry")


# -- another uid ---------------------------------------------------------------------------

OTHER_UID_BIND = """
import socket, struct, sys
path, token = sys.argv[1], bytes.fromhex(sys.argv[2])
lane = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lane.settimeout(30)
try:
    lane.connect(path)
except OSError as err:
    print("connect", err.errno); sys.exit(0)
lane.sendall(struct.pack("<IB", len(token) + 1, 0) + token)
header = lane.recv(5)
length, kind = struct.unpack("<IB", header)
body = b""
while len(body) < length - 1:
    body += lane.recv(length - 1 - len(body))
print("answer", kind, body.decode())
"""


def test_another_uid_cannot_use_a_sessions_lane(other_user, tmp_path):
    """With principals, a peer of another principal is refused PERMISSION_DENIED at BIND,
    even with the token; the session stays usable by its owner."""
    config = (
        '[[security.principals]]\nname = "root"\nuids = [0]\npools = ["*"]\n'
        f'[[security.principals]]\nname = "other"\nuids = [{other_user.uid}]\npools = ["*"]\n'
    )
    daemon = start_daemon("--memory-budget", "64MiB", config=config)
    try:
        os.chmod(daemon.workdir, 0o711)
        with Client(daemon.address, fast_lane=False) as client:
            lane_path = daemon.socket_path + ".lane"
            os.chmod(lane_path, 0o666)  # let the other uid reach it: the principal decides
            response = _reopen_with_token(client, "owned")
            result = other_user.run_python(
                OTHER_UID_BIND, lane_path, response.fast_lane_token.hex()
            )
            assert result.returncode == 0, result.stderr
            code = grpc.StatusCode.PERMISSION_DENIED.value[0]
            assert result.stdout.startswith(f"answer {code} "), result.stdout
            assert "principal" in result.stdout
            # the owner binds its lane with the same token afterwards: nothing was used up
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lane:
                lane.settimeout(30)
                lane.connect(lane_path)
                lane.sendall(frame(BIND, response.fast_lane_token))
                assert read_frame(lane) == (0, b"")
    finally:
        daemon.stop()
        daemon.cleanup()


def _reopen_with_token(client: Client, pool: str) -> pb2.OpenSessionResponse:
    from kvtierd_client._rpc.codec import OPEN_SESSION

    return client._call(OPEN_SESSION, pool, 4096, 8, "", "", "")


# -- fallback ----------------------------------------------------------------------------


def test_a_daemon_without_the_lane_is_served_over_grpc(pool_name):
    daemon = start_daemon("--memory-budget", "64MiB", "--fast-lane", "false")
    try:
        assert not os.path.exists(daemon.socket_path + ".lane")
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=4096, num_blocks=8)
            assert not session.fast_lane and session._lane is None
            assert session.lookup([b"k"]) == [LookupResult.MISS]
    finally:
        daemon.stop()
        daemon.cleanup()


def test_an_unreachable_lane_falls_back_to_grpc(pool_name, caplog):
    daemon = start_daemon("--memory-budget", "64MiB")
    try:
        os.unlink(daemon.socket_path + ".lane")  # offered, but nobody can connect
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=4096, num_blocks=8)
            assert not session.fast_lane
            assert session.lookup([b"k"]) == [LookupResult.MISS]
            assert "no fast lane, using gRPC" in caplog.text
    finally:
        daemon.stop()
        daemon.cleanup()


@pytest.mark.parametrize("restart", [False, True], ids=["stopped", "restarted"])
def test_a_lane_ended_by_the_daemon_is_a_session_gone_not_a_daemon_down(pool_name, restart):
    """The daemon stops (and maybe comes back): the session's next call finds its lane
    closed. The session ended with its lane, so the call raises NotFound and the
    session is gone -- a caller (the vLLM plug-in) reopens at once. Unavailable
    made the plug-in serve misses for retry_interval after every restart."""
    daemon = start_daemon("--memory-budget", "64MiB")
    try:
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=4096, num_blocks=8)
            assert session.fast_lane
            assert daemon.stop() == 0
            if restart:
                daemon = daemon.restart()
            # the lane's end says so; on a busy machine the session's keep-alive may
            # reach the restarted daemon first and learn the session is gone: NotFound too
            with pytest.raises(NotFound, match="fast lane|session expired or closed"):
                session.lookup([b"k"])
            assert session.gone
    finally:
        daemon.stop()
        daemon.cleanup()


def test_a_forked_child_uses_grpc_not_its_parents_lane(lane_daemon, pool_name):
    with Client(lane_daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=8)
        assert session.fast_lane
        pid = os.fork()
        if pid == 0:  # the child: the lane is the parent's
            os._exit(0 if not session.fast_lane else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert session.lookup([b"k"]) == [LookupResult.MISS]


# -- asyncio client --------------------------------------------------------------------------


def test_the_asyncio_client_uses_the_lane(lane_daemon, pool_name):
    async def scenario() -> None:
        async with AsyncClient(lane_daemon.address) as client:
            session = await client.open_session(pool_name, block_bytes=4096, num_blocks=64)
            assert session.fast_lane
            grants = await asyncio.gather(*(session.prepare_store([b"a%d" % i]) for i in range(20)))
            assert [g.keys_to_store for g in grants] == [[b"a%d" % i] for i in range(20)]
            await session.complete_store([b"a%d" % i for i in range(20)])
            assert await session.lookup([b"a0", b"zz"]) == [LookupResult.HIT, LookupResult.MISS]
            with pytest.raises(KvtierError) as failed:
                await session.prepare_load([b"zz"])
            assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION
            await session.close()
            assert not session_alive(lane_daemon.stub(), session.session_id)
            with pytest.raises(NotFound):
                await session.lookup([b"a0"])

    asyncio.run(scenario())


def test_a_dead_lane_clients_session_ends_with_its_lease(lane_daemon, pool_name):
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import time\nfrom kvtierd_client.client import Client\n"
            f"s = Client({lane_daemon.address!r}).open_session({pool_name!r}, block_bytes=4096)\n"
            "assert s.fast_lane\ns.prepare_store([b'x'])\nprint(s.session_id, flush=True)\n"
            "time.sleep(600)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        sid = child.stdout.readline().strip()
        assert session_alive(lane_daemon.stub(), sid)
    finally:
        child.kill()
        child.wait()
    eventually(lambda: expired(lane_daemon, sid), LEASE + 10.0, "the session's lease expiry")


# -- deadlines -----------------------------------------------------------------------------


def test_a_late_answer_after_a_deadline_is_never_taken_for_the_next_calls(lane_daemon, pool_name):
    """The daemon stopped (SIGSTOP) past a call's deadline: DEADLINE_EXCEEDED; once it
    runs again, the late answer is dropped and each next call gets its own answer."""
    with Client(lane_daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=4096, num_blocks=8, keepalive=False)
        assert session.fast_lane
        session.prepare_store([b"stored"])
        session.complete_store([b"stored"])
        os.kill(lane_daemon.proc.pid, signal.SIGSTOP)
        try:
            # every thread stopped: one still running could answer in time
            eventually(lambda: stopped(lane_daemon.proc.pid), 30, "the daemon stopped")
            with pytest.raises(DeadlineExceeded):
                session._call(LOOKUP, [b"absent"], timeout=0.3)  # answer: MISS, late
        finally:
            os.kill(lane_daemon.proc.pid, signal.SIGCONT)
        assert session.lookup([b"stored"]) == [LookupResult.HIT]  # not the late MISS
        assert session.keep_alive() == int(LEASE * 1000)
        assert session.fast_lane


def test_the_asyncio_lane_drops_a_late_answer_too(lane_daemon, pool_name):
    async def scenario() -> None:
        async with AsyncClient(lane_daemon.address) as client:
            session = await client.open_session(pool_name, block_bytes=4096, num_blocks=8)
            await session.prepare_store([b"stored"])
            await session.complete_store([b"stored"])
            os.kill(lane_daemon.proc.pid, signal.SIGSTOP)
            try:
                await eventually_async(
                    lambda: stopped(lane_daemon.proc.pid), 30, "the daemon stopped"
                )
                with pytest.raises(DeadlineExceeded):
                    await session._call(LOOKUP, [b"absent"], timeout=0.3)
            finally:
                os.kill(lane_daemon.proc.pid, signal.SIGCONT)
            assert await session.lookup([b"stored"]) == [LookupResult.HIT]
            assert session.fast_lane

    asyncio.run(scenario())
