"""Who is on the other end of a TCP connection made on this host: the uid that owns
the peer's socket, asked of the kernel's socket table (``NETLINK_SOCK_DIAG``).

A server that limits its peers by address treats every local user as one peer on
127.0.0.1 and lets one user be many (any address of 127.0.0.0/8 may connect). The
peer's socket, when it lives on this host, names its owner: the kernel records
the uid of the process that made it, and nobody but root can make a socket in
another uid's name.

The question is an *exact* lookup (as ``ss`` makes), by the connection's
addresses and ports: one request and one answer, a hash lookup in the kernel, the
same cost with ten sockets on the host or a hundred thousand (reading
``/proc/net/tcp`` would be a scan of every socket, ``TIME_WAIT`` ones included,
per connection). Any user may ask it.

Invariants:

* :meth:`TcpOwners.owner` answers a uid only for a socket whose addresses and ports
  are the peer's end of the connection asked about and that is connected (not a
  listener the kernel's lookup may fall back to, not a ``TIME_WAIT`` remnant,
  which report uid 0): otherwise None.
* It never blocks: the kernel queues the answer while handling the request, so the
  answer is read without waiting; none there is None.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: any socket with these addresses
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states
_PORTS = struct.Struct("!HH")  # inet_diag_sockid: source port, destination port (big-endian)
_TAIL = struct.Struct("=III")  # inet_diag_sockid: interface, cookie (2 x u32)
_MESSAGE = struct.Struct("=BBBB")  # inet_diag_msg: family, state, timer, retransmits
_SOCKID_BYTES = 48
_UID_OFFSET = _HEADER.size + _MESSAGE.size + _SOCKID_BYTES + 12  # after expires, rqueue, wqueue
_ANSWER_BYTES = 1024
# tcp_states.h: the states of a socket that is one end of a connection (ESTABLISHED,
# FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING)
_CONNECTED = frozenset({1, 4, 5, 8, 9, 11})

Address = tuple[str, int]  # (host, port) as ``socket.getsockname`` gives it (v6: first two)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as a socket gives it) is a loopback address:
    127.0.0.0/8, ::1 or 127.x.y.z mapped into IPv6."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class TcpOwners:
    """Asks the kernel who owns the peer's end of local TCP connections.

    ``available`` is False when this host does not answer (no ``AF_NETLINK`` in a
    sandbox, no ``inet_diag`` in the kernel): then :meth:`owner` is always None.
    Not thread-safe: one thread asks."""

    def __init__(self) -> None:
        self._seq = 0
        try:
            self._sock: socket.socket | None = socket.socket(
                socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG
            )
        except (OSError, AttributeError):  # AF_NETLINK refused, or not Linux
            self._sock = None
        self.available = self._sock is not None

    def check(self, listener: socket.socket) -> bool:
        """Whether the kernel answers, asked about ``listener`` itself (a listening
        TCP socket of this process): False turns this object off (``available``)."""
        host, port = _unmapped(listener.getsockname()[0]), listener.getsockname()[1]
        anywhere = "::" if listener.family == socket.AF_INET6 else "0.0.0.0"
        found = self._lookup(listener.family, (host, port), (anywhere, 0), any_state=True)
        self.available = found is not None
        return self.available

    def owner(self, local: Address, peer: Address) -> int | None:
        """The uid owning the peer's socket of the connection from ``peer`` to
        ``local`` (this host's end), or None: the peer is not on this host (or gone),
        or the kernel does not answer."""
        if not self.available:
            return None
        local_host, peer_host = _unmapped(local[0]), _unmapped(peer[0])
        if (":" in local_host) != (":" in peer_host):
            return None
        family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
        return self._lookup(family, (peer_host, peer[1]), (local_host, local[1]))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.available = False

    def _lookup(
        self, family: int, source: Address, destination: Address, any_state: bool = False
    ) -> int | None:
        """The uid of the TCP socket whose own end is ``source`` and whose peer is
        ``destination`` (a connected one unless ``any_state``), or None."""
        if self._sock is None:
            return None
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        try:
            request = (
                _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
                + _PORTS.pack(source[1], destination[1])
                + _packed(family, source[0])
                + _packed(family, destination[0])
                + _TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
            )
            header = _HEADER.pack(
                _HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, self._seq, 0
            )
            self._sock.send(header + request)
            while True:  # an answer to an earlier question that was not read is skipped
                answer = self._sock.recv(_ANSWER_BYTES, socket.MSG_DONTWAIT)
                if len(answer) >= _HEADER.size and _HEADER.unpack_from(answer)[3] == self._seq:
                    break
        except OSError:  # not an address, no answer queued (EAGAIN), or the table refused
            return None
        return _uid_of(answer, source, destination, any_state)


def _uid_of(answer: bytes, source: Address, destination: Address, any_state: bool) -> int | None:
    if len(answer) < _UID_OFFSET + 4 or _HEADER.unpack_from(answer)[1] == _NLMSG_ERROR:
        return None  # ENOENT: no such socket
    _, state, _, _ = _MESSAGE.unpack_from(answer, _HEADER.size)
    ports = _PORTS.unpack_from(answer, _HEADER.size + _MESSAGE.size)
    if not any_state and (state not in _CONNECTED or ports != (source[1], destination[1])):
        return None  # a listener on the peer's port, or a TIME_WAIT remnant (uid 0)
    (uid,) = struct.unpack_from("=I", answer, _UID_OFFSET)
    return int(uid)


def _packed(family: int, host: str) -> bytes:
    return socket.inet_pton(family, host).ljust(16, b"\0")


def _unmapped(host: str) -> str:
    """``host`` without a zone, an IPv4 address mapped into IPv6 as plain IPv4."""
    host = host.split("%", 1)[0]
    if host.startswith("::ffff:") and "." in host:
        return host[len("::ffff:") :]
    return host
