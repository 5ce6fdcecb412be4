"""The ticket office: peer tickets for local clients (daemon side).

Why tickets: grpc (Python, 1.85) does not let a server see the credentials of
a Unix-socket peer: ``context.peer()`` is ``"unix:"``, the auth context of
``local_server_credentials(UDS)`` holds no uid, and a server cannot be handed
an accepted socket. A proxy in front of grpc that reads SO_PEERCRED and
relays every byte would cost each call two more socket hops. Instead each
client proves who it is once, on a separate socket, and carries the proof in
its calls' metadata (``kvtierd_client.wire.peer_ticket`` holds the protocol):

- the daemon accepts on ``PATH.tickets`` (same mode and group as the gRPC
  socket ``PATH``), reads the connection's kernel credentials, maps them to a
  principal with the *current* Authorizer, and answers with a fresh 256-bit
  ticket, or with the reason it refuses one (unknown uid, ambiguous groups,
  too many holders) and closes;
- the ticket stays valid exactly as long as that connection is open; the
  daemon never reads data from it (a peer that sends any is disconnected);
- each call's ticket is looked up in one dict: a call carries the principal
  its process had when it connected (a reload never changes it).

Invariant: ``ticket in self._callers`` iff its connection is open and its
task is waiting for the close; ``len(self._callers) <= max_holders``.
Fair shares between principals (:mod:`kvtierd.util.fairshare`): each may always
hold ``max_holders / principals`` tickets, and more only while the free ones
still cover every other principal's unused share.
Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvtierd.security.access import AccessDenied
from kvtierd.security.identity import Caller, PeerCredentials, peer_credentials
from kvtierd.security.principals import Principal
from kvtierd.util.fairshare import FairShares
from kvtierd_client.wire.peer_ticket import TICKET_BYTES, granted_line, refused_line

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0  # seconds the daemon waits to hand its answer to a slow peer


class TicketOffice:
    """Issues, looks up and revokes peer tickets.

    ``identify``: the principal of a peer's credentials (the current
    Authorizer's ``for_unix_peer``; raises ``AccessDenied``). ``on_refused``:
    called with the peer's description and the reason of each refusal (audit).
    """

    def __init__(
        self,
        identify: Callable[[PeerCredentials], Principal],
        max_holders: int,
        on_refused: Callable[[str, str], None] | None = None,
        principals: Sequence[str] = (),
    ) -> None:
        self._identify = identify
        self._max_holders = max_holders
        self._on_refused = on_refused
        self._callers: dict[str, Caller] = {}  # ticket -> the caller it proves
        # Invariant: _shares.held(p) == number of tickets in _callers whose caller
        # is p; len(_shares) == len(_callers)
        self._shares = FairShares(max_holders, principals)
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._callers)

    def caller(self, ticket: str) -> Caller | None:
        """The caller holding ``ticket``, or None (unknown, or its connection closed)."""
        return self._callers.get(ticket)

    def serve(self, listener: socket.socket) -> None:
        """Accepts ticket connections on ``listener`` (bound, listening) until ``close``."""
        listener.setblocking(False)
        self._listeners.append(listener)
        self._spawn(self._accept_forever(listener), "kvtierd-tickets-accept")

    async def close(self) -> None:
        """Stops accepting, closes every ticket connection (their tickets end)."""
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert not self._callers, "a ticket outlived its connection"

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.ensure_future(coroutine)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: keep serving the others
                log.warning("ticket socket: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._serve_connection(connection), "kvtierd-ticket")

    async def _serve_connection(self, connection: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        connection.setblocking(False)
        ticket = ""
        try:
            peer = peer_credentials(connection)
            try:
                caller = self._admit(peer)
            except AccessDenied as exc:
                if self._on_refused is not None:
                    self._on_refused(peer.describe(), str(exc))
                answer = refused_line(str(exc))
                await asyncio.wait_for(loop.sock_sendall(connection, answer), HANDSHAKE_TIMEOUT)
                return
            ticket = secrets.token_hex(TICKET_BYTES)
            self._callers[ticket] = caller  # holders +1
            self._shares.take(caller.name)
            answer = granted_line(ticket, caller.name)
            await asyncio.wait_for(loop.sock_sendall(connection, answer), HANDSHAKE_TIMEOUT)
            log.debug("peer ticket issued to %s as principal %s", caller.peer, caller.name)
            # The peer never writes: any byte, or the end of the stream, ends the ticket.
            await loop.sock_recv(connection, 1)
        except (OSError, asyncio.TimeoutError) as exc:
            log.debug("ticket connection ended: %s", exc)
        finally:
            if ticket:
                self._shares.give_back(self._callers.pop(ticket).name)  # holders -1
            connection.close()

    def _admit(self, peer: PeerCredentials) -> Caller:
        """The caller ``peer`` is; raises ``AccessDenied`` (unknown or ambiguous
        peer, too many holders)."""
        principal = self._identify(peer)
        if self._shares.full:
            raise AccessDenied(
                f"{len(self._callers)} processes hold peer tickets, the limit is "
                f"{self._max_holders} (sessions.max_sessions); close clients you no longer use",
                principal=principal.name,
            )
        if not self._shares.within_share(principal.name):
            raise AccessDenied(
                f"principal {principal.name!r} holds {self._shares.held(principal.name)} peer "
                f"tickets; the free ones ({self._shares.free}) are kept for the "
                "other principals' shares (sessions.max_sessions / principals); close clients "
                "you no longer use",
                principal=principal.name,
            )
        return Caller(principal, peer.describe(), "peer ticket")
