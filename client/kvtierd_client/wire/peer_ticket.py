"""Peer tickets: how a local client proves its uid and groups to kvtierd.

gRPC does not tell a server which process is at the other end of a Unix socket
(its ``peer()`` is just ``"unix:"``, its auth context has no credentials). So,
when ``[[security.principals]]`` are configured, the daemon serves a second
socket next to each Unix listener, ``PATH + ".tickets"``. A client connects to
it; the daemon reads the kernel's credentials of that connection (SO_PEERCRED:
uid, gid, pid; SO_PEERGROUPS: supplementary groups), maps them to a principal
and answers one line, then the daemon only waits for the connection to close::

    KVTIER-TICKET/1 OK <ticket> <principal>\\n
    KVTIER-TICKET/1 DENIED <reason>\\n          (and the daemon closes)

The client sends ``<ticket>`` in the metadata ``kvtier-peer-ticket`` of every
gRPC call. A ticket is 256 random bits, valid exactly while its ticket
connection stays open: the daemon forgets it when the connection closes (the
process exited, the client closed), and a restarted daemon knows none. The
client never writes to the ticket socket.

Shared by the daemon and the client: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtierd_client.wire.trust import peer_uid

TICKET_SOCKET_SUFFIX = ".tickets"
METADATA_KEY = "kvtier-peer-ticket"
PROTOCOL = "KVTIER-TICKET/1"
MAX_ANSWER_BYTES = 1024
TICKET_BYTES = 32


class TicketRefused(Exception):
    """The daemon refused this process a ticket; ``reason`` is its message
    (an unknown uid, groups that name two principals, too many ticket holders)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TicketSocketError(Exception):
    """The ticket socket cannot be used (unreadable answer, foreign owner, timeout)."""


def ticket_socket_path(socket_path: str) -> str:
    """The ticket socket served next to the daemon's Unix socket ``socket_path``."""
    return socket_path + TICKET_SOCKET_SUFFIX


def granted_line(ticket: str, principal: str) -> bytes:
    return f"{PROTOCOL} OK {ticket} {principal}\n".encode()


def refused_line(reason: str) -> bytes:
    text = " ".join(reason.split())  # one line, whatever the reason holds
    line = f"{PROTOCOL} DENIED {text}\n".encode()
    if len(line) > MAX_ANSWER_BYTES:
        line = line[: MAX_ANSWER_BYTES - 4] + b"...\n"
    return line


def parse_answer(line: bytes) -> tuple[str, str]:
    """``(ticket, principal)`` from the daemon's answer line; raises
    ``TicketRefused`` for a DENIED line, ``TicketSocketError`` for anything else."""
    try:
        text = line.decode("utf-8").rstrip("\n")
    except UnicodeDecodeError:
        raise TicketSocketError("the ticket socket answered bytes that are not UTF-8") from None
    protocol, _, rest = text.partition(" ")
    verdict, _, detail = rest.partition(" ")
    if protocol != PROTOCOL:
        raise TicketSocketError(f"the ticket socket speaks {protocol[:40]!r}, not {PROTOCOL}")
    if verdict == "DENIED":
        raise TicketRefused(detail)
    ticket, _, principal = detail.partition(" ")
    if verdict != "OK" or len(ticket) != 2 * TICKET_BYTES or not principal:
        raise TicketSocketError(f"unexpected ticket socket answer {text[:80]!r}")
    return ticket, principal


@dataclass
class PeerTicket:
    """A ticket and the connection that keeps it valid. Close it to give it up."""

    connection: socket.socket
    ticket: str
    principal: str  # the principal the daemon mapped this process to

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self.ticket),)

    def alive(self) -> bool:
        """False once the daemon closed the connection (it stopped or restarted)."""
        poller = select.poll()  # not select(): a busy process's fds pass FD_SETSIZE
        try:
            poller.register(self.connection, select.POLLIN)
            events = poller.poll(0)
        except (OSError, ValueError):  # closed
            return False
        return not events  # the daemon never writes after its answer: readable = EOF

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.close()


def obtain_ticket(
    socket_path: str, timeout: float, server_uid: int | None = None
) -> PeerTicket | None:
    """A ticket from the daemon serving ``socket_path``, or None when it serves no
    ticket socket there (no principals configured: none is needed).

    The ticket socket must be a socket owned by the owner of ``socket_path``
    (the daemon): one planted by another user is refused, because a ticket it
    handed out would make this process's calls someone else's. Raises
    ``TicketRefused`` (the daemon's reason) and ``TicketSocketError``.

    ``server_uid``: the daemon's uid, verified by the caller
    (``kvtierd_client.wire.trust``): the ticket socket must then be that uid's and be
    served by it (``SO_PEERCRED``), or it is refused before its answer is read.
    """
    path = ticket_socket_path(socket_path)
    try:
        ticket_info = os.lstat(path)
        daemon_info = os.lstat(socket_path)
    except OSError:  # none there, or not ours to see: the gRPC call will say why
        return None
    if not stat.S_ISSOCK(ticket_info.st_mode):
        raise TicketSocketError(f"{path} is not a socket")
    owner = daemon_info.st_uid if server_uid is None else server_uid
    if ticket_info.st_uid != owner or daemon_info.st_uid != owner:
        raise TicketSocketError(
            f"{path} is owned by uid {ticket_info.st_uid}, the daemon's socket {socket_path} "
            f"by uid {daemon_info.st_uid}, the daemon runs as uid {owner}: not using it"
        )
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(timeout)
        connection.connect(path)
        served_by = peer_uid(connection)
        if served_by != owner:
            raise TicketSocketError(
                f"{path} is served by uid {served_by}, not by the daemon's uid {owner}: "
                "not using it"
            )
        ticket, principal = parse_answer(_read_line(connection, path))
        connection.settimeout(None)
    except FileNotFoundError:
        connection.close()
        return None
    except TicketSocketError:
        connection.close()
        raise
    except TimeoutError:
        connection.close()
        raise TicketSocketError(f"{path} did not answer within {timeout:g}s") from None
    except OSError as exc:
        connection.close()
        raise TicketSocketError(f"cannot use {path}: {exc.strerror or exc}") from None
    except BaseException:
        connection.close()
        raise
    return PeerTicket(connection, ticket, principal)


def _read_line(connection: socket.socket, path: str) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(MAX_ANSWER_BYTES - len(data))
        if not chunk:
            raise TicketSocketError(f"{path} closed the connection before answering")
        data += chunk
        if len(data) >= MAX_ANSWER_BYTES and not data.endswith(b"\n"):
            raise TicketSocketError(f"{path} answered more than {MAX_ANSWER_BYTES} bytes")
    return data


class TicketHolder:
    """The ticket of one client (thread-safe): obtained when the client is made
    (never raising: a refusal shows on the first call), obtained again when the
    daemon forgot it (restart). ``metadata`` is what each call sends (empty
    without a ticket)."""

    def __init__(
        self,
        socket_path: str,
        timeout: float,
        server_uid: Callable[[], int | None] | None = None,
    ) -> None:
        """``server_uid``: returns the daemon's verified uid (or raises why the socket
        cannot be trusted), called before each ticket is obtained."""
        self._socket_path = socket_path
        self._timeout = timeout
        self._server_uid = server_uid if server_uid is not None else lambda: None
        self._lock = threading.Lock()
        self._ticket: PeerTicket | None = None
        try:
            self._ticket = self._obtain()
        except Exception:  # noqa: BLE001 - never at creation: the first call says why
            pass  # the first call is refused UNAUTHENTICATED; ``renew`` then raises why

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        ticket = self._ticket
        return () if ticket is None else ticket.metadata

    def renew(self) -> bool:
        """Obtains a new ticket when the current one is gone (or there was none);
        returns whether the metadata changed, i.e. whether a call refused as
        UNAUTHENTICATED is worth sending again."""
        with self._lock:
            current = self._ticket
            if current is not None and current.alive():
                return False
            fresh = self._obtain()
            self._ticket = fresh
            if current is not None:
                current.close()
            return fresh is not None

    def _obtain(self) -> PeerTicket | None:
        return obtain_ticket(self._socket_path, self._timeout, self._server_uid())

    def close(self) -> None:
        with self._lock:
            if self._ticket is not None:
                self._ticket.close()
            self._ticket = None
