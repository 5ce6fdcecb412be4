"""What a client's calls carry to prove who they are: a bearer token (TCP) and,
over a Unix socket, the peer ticket of ``kvtierd_client.wire.peer_ticket``.

A client asks for a ticket when it is made, if the daemon serves a ticket
socket next to its Unix socket (it does when principals are configured).
Making a client never fails for the ticket: a daemon that is down, or that
refuses the ticket, shows up on the first call. A call answered UNAUTHENTICATED
over a Unix socket means the daemon does not know the ticket (it restarted,
or there was none): the client asks for a new one and sends the call once
more; the refused call changed nothing (the daemon refuses before reading
it). A refused ticket raises ``PermissionDenied`` with the daemon's reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvtierd_client._rpc.codec import auth_metadata
from kvtierd_client.errors import PermissionDenied, Unavailable
from kvtierd_client.wire.address import to_grpc_target
from kvtierd_client.wire.peer_ticket import TicketHolder, TicketRefused, TicketSocketError

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]


class CallCredentials:
    """The metadata of every call of one client (thread-safe).

    ``token``: sent as ``authorization: Bearer <token>``. ``tickets``: obtain peer
    tickets when ``address`` is a Unix socket (False for injected stubs), from the
    daemon of the uid ``server_uid`` returns (``trusted_daemon.DaemonCheck``).
    """

    def __init__(
        self,
        address: str,
        token: str | None,
        timeout: float,
        tickets: bool,
        server_uid: Callable[[], int | None] | None = None,
    ) -> None:
        self._address = address
        self._token: Metadata = auth_metadata(token) or ()
        target = to_grpc_target(address)
        self._holder: TicketHolder | None = None
        if tickets and target.startswith("unix:"):
            self._holder = TicketHolder(target[len("unix:") :], timeout, server_uid)
        self.metadata: Metadata | None = None  # what calls send; None = nothing
        self._refresh()

    def call(self, method: Callable[..., Any], request: Any, timeout: float) -> Any:
        """``method(request)`` with this client's metadata; once more with a new
        peer ticket when the daemon did not know the one sent."""
        try:
            return method(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            if not self._renew_after(err):
                raise
        return method(request, timeout=timeout, metadata=self.metadata)

    async def call_async(
        self, method: Callable[..., Awaitable[Any]], request: Any, timeout: float
    ) -> Any:
        """``call`` for ``grpc.aio`` stubs (the ticket is renewed off the loop)."""
        try:
            return await method(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            if not await asyncio.to_thread(self._renew_after, err):
                raise
        return await method(request, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        """Gives the ticket up (the daemon forgets it)."""
        if self._holder is not None:
            self._holder.close()

    def _renew_after(self, err: grpc.RpcError) -> bool:
        """Whether a call failing with ``err`` is worth sending again: it was
        UNAUTHENTICATED and a new ticket was obtained. Raises ``PermissionDenied``
        when the daemon refuses this process a ticket."""
        code = err.code() if callable(getattr(err, "code", None)) else None
        if self._holder is None or code is not grpc.StatusCode.UNAUTHENTICATED:
            return False
        try:
            renewed = self._holder.renew()
        except TicketRefused as exc:
            raise PermissionDenied(exc.reason, address=self._address) from None
        except TicketSocketError as exc:
            raise Unavailable(str(exc), address=self._address) from None
        if renewed:
            self._refresh()
            log.debug("new kvtierd peer ticket for %s", self._address)
        return renewed

    def _refresh(self) -> None:
        tickets = self._holder.metadata if self._holder is not None else ()
        self.metadata = (*self._token, *tickets) or None
