"""Region descriptors over SCM_RIGHTS to authorized peers only (issue #18, item 2).

The daemon announces its descriptor socket in ``Region.fd_socket``; a peer
asks with its session id and gets the region's descriptor only if its uid/gid
(``SO_PEERCRED``) may map the session's pool. Real daemon, real sockets, a
real second local user (as root; skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from daemon_harness import daemon_command, start_daemon, write_config
from local_users import LocalUser

from kvtierd.security.region_access import (
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_S,
    socket_path_for,
)
from kvtierd_client._shm.region_fd import RegionAccessDenied, request_region_fd
from kvtierd_client.client import Client
from kvtierd_client.region import AttachedRegion, RegionIdentityError, attach_announced

BLOCK = 4096
BLOCKS = 4
# An answer not held up by a silent or flooding peer comes before that peer's deadline
# (REQUEST_TIMEOUT_S): waiting behind even one takes that long. A loaded machine
# answers late, but not that late.
PROMPT_S = REQUEST_TIMEOUT_S * 0.75

# stdlib only: the throw-away user cannot run the test venv
ASK_FOR_FD = """
import array, socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.sendall(("MAP " + sys.argv[2] + "\\n").encode())
msg, anc, _, _ = sock.recvmsg(256, socket.CMSG_SPACE(4))
fds = [fd for level, kind, data in anc for fd in array.array("i", data)]
print(len(fds), msg.decode().strip())
"""


def test_owner_maps_the_region_through_the_descriptor_the_daemon_passes(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        region = session.region
        assert region.fd_socket.endswith(".regions")
        with attach_announced(region, session_id=session.session_id) as by_fd:
            by_fd.numpy()[1][:6] = memoryview(b"fd-way")
            with AttachedRegion.attach(region.path, BLOCKS, BLOCK) as by_path:
                assert bytes(by_path.numpy()[1][:6]) == b"fd-way"  # the very same file
        session.close()


def test_a_swapped_path_does_not_matter_to_the_descriptor_way(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        path = Path(session.region.path)
        aside = path.with_name(path.name + ".aside")
        os.rename(path, aside)
        try:
            path.write_bytes(b"\xee" * (BLOCK * BLOCKS))  # the attacker's file at the path
            with attach_announced(session.region, session_id=session.session_id) as attached:
                assert bytes(attached.numpy()[0][:4]) != b"\xee" * 4
        finally:
            os.replace(aside, path)
        session.close()


def test_without_a_descriptor_socket_the_region_is_attached_by_path(daemon, pool_name):
    """An older daemon announces no fd_socket: the path, checked against the identity."""
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        older = type(session.region)()
        older.CopyFrom(session.region)
        older.fd_socket = ""
        with attach_announced(older, session_id=session.session_id) as attached:
            assert attached.size == BLOCK * BLOCKS
        path = Path(older.path)
        aside = path.with_name(path.name + ".aside")
        os.rename(path, aside)
        try:
            path.write_bytes(b"\xee" * (BLOCK * BLOCKS))
            with pytest.raises(RegionIdentityError):
                attach_announced(older, session_id=session.session_id)
        finally:
            os.replace(aside, path)
        session.close()


def test_unknown_session_gets_no_descriptor(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        with pytest.raises(RegionAccessDenied, match="unknown, closed or expired session"):
            request_region_fd(session.region.fd_socket, "0" * 32)
        session.close()


def test_another_uid_on_the_socket_cannot_map_the_pool(other_user: LocalUser, pool_name):
    daemon = start_daemon()
    try:
        with Client(daemon.address) as client:
            session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
            fd_socket = session.region.fd_socket
            # let the throw-away user reach the socket, as a misconfigured group would
            os.chmod(daemon.workdir, 0o711)
            os.chmod(fd_socket, 0o666)
            result = other_user.run_python(ASK_FOR_FD, fd_socket, session.session_id)
            assert result.returncode == 0, result
            count, _, answer = result.stdout.strip().partition(" ")
            assert count == "0", result.stdout
            assert "permission denied" in answer and f"uid {other_user.uid}" in answer, answer
            assert pool_name in answer
            opened = other_user.run_python(
                "open(__import__('sys').argv[1], 'rb')", session.region.path
            )
            assert "PermissionError" in opened.stderr, opened  # nor by path
            session.close()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.cleanup()


def test_a_symlink_planted_at_the_descriptor_socket_path_refuses_the_start(tmp_path):
    workdir = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")  # short: sun_path is 108 bytes
    try:
        listen = os.path.join(workdir, "k.sock")
        target = tmp_path / "elsewhere"
        target.write_bytes(b"keep")
        os.symlink(target, socket_path_for(listen))
        result = subprocess.run(
            daemon_command("--config", write_config(workdir, ""), "--listen", f"unix://{listen}",
                           "--shm-dir", workdir, "--metrics-address", ""),
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "STATE_DIRECTORY": workdir},
        )  # fmt: skip
        assert result.returncode == 2, result
        assert "server.listen" in result.stderr and "symlink" in result.stderr, result.stderr
        assert target.read_bytes() == b"keep"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def connect_silently(stack: ExitStack, path: str) -> socket.socket:
    """A peer that connects to ``path`` and sends nothing (closed with ``stack``)."""
    sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    sock.connect(path)
    return sock


def read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything ``sock`` receives until the daemon closes it (ECONNRESET: the
    daemon closed with bytes of ours unread; what came before still counts)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_silent_peers_do_not_delay_a_worker_attaching_by_descriptor(daemon, pool_name):
    with Client(daemon.address) as client, ExitStack() as silent:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        fd_socket = session.region.fd_socket
        peers = [connect_silently(silent, fd_socket) for _ in range(20)]
        started = time.monotonic()
        with attach_announced(session.region, session_id=session.session_id) as attached:
            elapsed = time.monotonic() - started
            assert attached.size == BLOCK * BLOCKS
        assert elapsed < PROMPT_S, f"attaching took {elapsed:.2f}s behind 20 silent peers"
        # the silent peers are dropped at their deadline, all of them together (one
        # after another: 20 deadlines)
        started = time.monotonic()
        for peer in peers:
            assert read_all(peer, timeout=REQUEST_TIMEOUT_S + 5) == b""
        assert time.monotonic() - started < 3 * REQUEST_TIMEOUT_S
        session.close()


def test_past_the_connection_cap_the_oldest_silent_peer_makes_room(daemon, pool_name):
    with Client(daemon.address) as client, ExitStack() as silent:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        fd_socket = session.region.fd_socket
        peers = [connect_silently(silent, fd_socket) for _ in range(MAX_CONNECTIONS + 8)]
        started = time.monotonic()
        for _ in range(3):
            os.close(request_region_fd(fd_socket, session.session_id))
        elapsed = time.monotonic() - started
        assert elapsed < PROMPT_S, f"3 requests took {elapsed:.2f}s behind a full table"
        # the oldest silent peer was dropped with a reason, before its deadline
        answer = read_all(peers[0], timeout=REQUEST_TIMEOUT_S / 2)
        assert answer.startswith(b"ERR ") and b"too many" in answer, answer
        session.close()
    assert daemon.alive()


def test_a_request_line_is_cut_at_max_request_bytes(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.connect(session.region.fd_socket)
            peer.sendall(b"MAP " + b"0" * (MAX_REQUEST_BYTES - 4))  # no newline, then silence
            started = time.monotonic()
            answer = read_all(peer, timeout=REQUEST_TIMEOUT_S + 5)
            elapsed = time.monotonic() - started
        assert answer.startswith(b"ERR ") and str(MAX_REQUEST_BYTES).encode() in answer, answer
        assert elapsed < PROMPT_S, f"answered after {elapsed:.2f}s, not at the cut"
        session.close()


def test_an_endless_line_is_cut_and_does_not_delay_others(daemon, pool_name):
    with Client(daemon.address) as client:
        session = client.open_session(pool_name, block_bytes=BLOCK, num_blocks=BLOCKS)
        fd_socket = session.region.fd_socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.connect(fd_socket)
            sent = 0
            failure: list[BaseException] = []

            def flood() -> None:
                nonlocal sent
                peer.settimeout(REQUEST_TIMEOUT_S + 5)
                try:
                    while sent < 64 << 20:  # no newline, ever
                        sent += peer.send(b"A" * 65536)
                except OSError as exc:
                    failure.append(exc)

            writer = threading.Thread(target=flood)
            writer.start()
            started = time.monotonic()
            os.close(request_region_fd(fd_socket, session.session_id))
            assert time.monotonic() - started < PROMPT_S
            writer.join(timeout=REQUEST_TIMEOUT_S + 10)
            assert not writer.is_alive()
            # the daemon hung up on it: what the kernel took was a socket buffer, not 64 MiB
            assert failure and isinstance(failure[0], (BrokenPipeError, ConnectionResetError)), (
                failure,
                sent,
            )
            answer = read_all(peer, timeout=REQUEST_TIMEOUT_S)
        assert answer.startswith(b"ERR ") and str(MAX_REQUEST_BYTES).encode() in answer, answer
        session.close()
