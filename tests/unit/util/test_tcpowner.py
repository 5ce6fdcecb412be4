"""Who owns the peer's end of a local TCP connection (``kvtierd.util.tcpowner``), asked
of this host's kernel about real loopback connections. (Another user's connections:
tests/integration/ops/test_metrics_endpoint_attacks.py.)"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from daemon_harness import eventually

from kvtierd.util.tcpowner import TcpOwners, is_loopback


@pytest.fixture
def owners() -> Iterator[TcpOwners]:
    found = TcpOwners()
    if not found.available:
        pytest.skip("no NETLINK_SOCK_DIAG here")
    yield found
    found.close()


def accepted(listener: socket.socket, source: str) -> tuple[socket.socket, socket.socket]:
    """A client bound to ``source`` connected to ``listener``, and the accepted end."""
    client = socket.socket(listener.family)
    client.bind((source, 0))
    client.connect(listener.getsockname()[:2])
    server, _ = listener.accept()
    return client, server


@pytest.mark.parametrize("source", ["127.0.0.1", "127.0.0.77"])
def test_the_owner_of_a_loopback_client_is_its_uid(owners, source):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        assert owners.check(listener)
        client, server = accepted(listener, source)
        with client, server:
            assert owners.owner(server.getsockname(), server.getpeername()) == os.getuid()


def test_ipv6_loopback_and_mapped_ipv4(owners):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        listener = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError as exc:
        pytest.skip(f"no dual-stack listener here: {exc}")
    with listener:
        assert owners.check(listener)
        for source, family in (("::1", socket.AF_INET6), ("127.0.0.1", socket.AF_INET)):
            client = socket.socket(family)
            client.connect((source, listener.getsockname()[1]))
            server, peer = listener.accept()
            with client, server:
                assert owners.owner(server.getsockname()[:2], peer[:2]) == os.getuid(), peer


def test_no_owner_for_a_peer_that_is_not_connected(owners):
    """Nobody on this host at that address; a client that closed (its socket gone
    to TIME_WAIT, which reports uid 0); a port where a listener answers the
    kernel's lookup instead."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        local = listener.getsockname()
        assert owners.owner(local, ("127.0.0.9", 9)) is None
        client, server = accepted(listener, "127.0.0.1")
        peer = server.getpeername()
        client.close()
        server.close()  # the client closed first: its end waits in TIME_WAIT
        eventually(lambda: owners.owner(local, peer) is None, 30, "the client's end to go")
        with socket.create_server(("127.0.0.1", 0)) as other:
            assert owners.owner(local, other.getsockname()) is None


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.200.3.4") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback("::ffff:10.0.0.1")
    assert not is_loopback("fe80::1%eth0") and not is_loopback("not an address")
