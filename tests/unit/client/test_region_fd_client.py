"""The client side of the region-descriptor socket (kvtierd_client._shm.region_fd):
a process that is not the daemon never learns the session id."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator

import pytest

from kvtierd_client._shm.region_fd import RegionSocketImpostor, request_region_fd


@pytest.fixture
def impostor() -> Iterator[tuple[str, list[bytes]]]:
    """A socket served by this process (uid = ours), recording what it receives."""
    directory = tempfile.mkdtemp(prefix="kvt-imp-", dir="/tmp")
    path = os.path.join(directory, "k.regions")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    received: list[bytes] = []

    def serve() -> None:
        try:
            conn, _ = server.accept()
        except OSError:  # the test ended (and closed the socket) before a connection came
            return
        with conn:
            conn.settimeout(2)
            try:
                received.append(conn.recv(256))
                conn.sendall(b"ERR no\n")
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, received
    server.close()
    thread.join(timeout=5)
    os.unlink(path)
    os.rmdir(directory)


def test_a_socket_served_by_another_uid_never_gets_the_session_id(impostor):
    path, received = impostor
    with pytest.raises(RegionSocketImpostor, match=f"served by uid {os.getuid()}"):
        request_region_fd(path, "a" * 32, timeout=2, server_uid=os.getuid() + 4242)
    assert b"a" * 32 not in b"".join(received)


def test_the_daemons_own_uid_is_asked(impostor):
    path, received = impostor
    with pytest.raises(PermissionError):  # the stand-in refuses: ERR no
        request_region_fd(path, "b" * 32, timeout=2, server_uid=os.getuid())
    assert received == [b"MAP " + b"b" * 32 + b"\n"]
