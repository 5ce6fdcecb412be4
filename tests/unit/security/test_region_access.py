"""The default authorization of region descriptors (``may_map``): what the
socket permissions allow, nothing more."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from daemon_harness import eventually

from kvtierd.security.region_access import MAX_CONNECTIONS, RegionFdServer, may_map

NOBODY_UID = 65534  # not the daemon's uid (tests run as root or a normal user)
UNUSED_GID = 64999  # a group nobody here is in


def test_the_daemons_own_uid_and_root_may_map():
    assert may_map(os.geteuid(), UNUSED_GID, "pool")
    assert may_map(0, UNUSED_GID, "pool")


def test_a_member_of_the_socket_group_may_map():
    assert may_map(NOBODY_UID, 4242, "pool", socket_gid=4242)


def test_the_kernels_supplementary_groups_decide():
    """A peer the group database does not know (an engine container's uid, its group
    given by --group-add or a pod's fsGroup) is a member through the supplementary
    groups SO_PEERGROUPS reported; groups the kernel reported without the socket
    group refuse."""
    assert may_map(NOBODY_UID + 1, UNUSED_GID, "pool", socket_gid=4242, peer_groups=(7, 4242))
    assert not may_map(NOBODY_UID + 1, UNUSED_GID, "pool", socket_gid=4242, peer_groups=(7,))


def test_another_uid_outside_the_socket_group_may_not():
    if os.geteuid() == NOBODY_UID:  # pragma: no cover - not how tests run
        return
    assert not may_map(NOBODY_UID, UNUSED_GID, "pool", socket_gid=4242)


# -- RegionFdServer bounds, with a stand-in for the daemon's loop and session table --


@pytest.fixture
def daemon_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on its own thread, standing in for the daemon's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


@pytest.fixture
def path() -> Iterator[str]:
    """Where a test's descriptor socket goes (short: sun_path is 108 bytes)."""
    directory = tempfile.mkdtemp(prefix="kvt-fds-", dir="/tmp")
    yield os.path.join(directory, "k.regions")
    shutil.rmtree(directory, ignore_errors=True)


def serve(path: str, lookup, loop: asyncio.AbstractEventLoop) -> RegionFdServer:
    async def start() -> RegionFdServer:
        server = RegionFdServer(path, lookup, loop, None)
        server.start()
        return server

    return asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=5)


def ask(path: str, request: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(request)
    return sock


def answer_of(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    with sock:
        return sock.recv(256)


def test_with_every_connection_waiting_on_a_lookup_a_new_one_is_refused_busy(daemon_loop, path):
    release = threading.Event()

    def stalled_lookup(session_id: str):  # blocks the "daemon loop": lookups queue up
        release.wait(10)
        return None

    server = serve(path, stalled_lookup, daemon_loop)
    try:
        waiting = [ask(path, b"MAP 00\n") for _ in range(MAX_CONNECTIONS)]
        # every connection accepted and its request read (none is silent, so none can
        # be dropped to make room for the next)
        eventually(
            lambda: len(server._open) == MAX_CONNECTIONS and not server._reading,
            10, "every waiting connection accepted and read",
        )  # fmt: skip
        refused = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        refused.connect(path)  # answered at its accept: a request sent now could meet EPIPE
        assert answer_of(refused).startswith(b"ERR busy"), "past the cap: refused at once"
        release.set()
        for sock in waiting:
            assert answer_of(sock) == b"ERR unknown, closed or expired session\n"
    finally:
        release.set()
        server.close()
    assert not os.path.exists(path)


def test_close_returns_promptly_while_a_lookup_is_stuck(daemon_loop, path):
    release = threading.Event()
    server = serve(path, lambda session_id: release.wait(10) and None, daemon_loop)
    try:
        stuck = ask(path, b"MAP 00\n")
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(path)
        # both accepted; the stuck one's request read (its lookup waits), the silent one's not
        eventually(
            lambda: len(server._open) == 2 and len(server._reading) == 1,
            10, "both connections accepted, one request read",
        )  # fmt: skip
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 5.0  # not the stuck lookup's 10 s
        assert answer_of(stuck) == b"" and answer_of(silent) == b""  # both cut
        assert not os.path.exists(path)
    finally:
        release.set()
        server.close()  # idempotent
