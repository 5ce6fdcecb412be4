"""The daemon's security state, and who the caller of each RPC is.

``SecurityState`` owns the current ``Authorizer`` (a reference swapped whole by
``reload_tokens``), the ticket office of the Unix sockets, the pool quotas and
the audit log. The servicer asks it, once per call, for the ``Caller``
(``identify``); the pre-body gates of ``kvtierd.security.gate`` ask it whether a
call's metadata carries an identity at all (``admits_unix`` / ``admits_tcp``).

Who a caller is, decided per call:

- Unix socket, no principals configured: ``LOCAL_CALLER`` (every pool; the
  socket's permissions decided, as before principals existed);
- Unix socket, principals configured: the holder of the call's peer ticket,
  with the principal its process was given when it connected to the ticket
  socket (kept until that connection closes, whatever a reload changes);
- TCP: the verified client certificate's principal when TCP listeners
  require client certificates (mTLS), else the bearer token's principal,
  resolved with the Authorizer current when the call arrives.

Sessions keep the principal that opened them (``Session.principal``): a call
on a session must come from that principal.

Event-loop only (grpc.aio asks the gates for a handler on the loop too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest

from kvtierd.errors import KvtierdError
from kvtierd.security.access import AccessDenied, NotAuthenticated
from kvtierd.security.audit import AuditLog
from kvtierd.security.authorizer import Authorizer, build_authorizer
from kvtierd.security.gate import OPEN_SERVICES, AuthenticationGate, answer_default_request
from kvtierd.security.identity import LOCAL_CALLER, Caller, tls_peer_names
from kvtierd.security.principals import Principal
from kvtierd.security.quotas import PoolQuotas
from kvtierd.security.tickets import TicketOffice
from kvtierd_client.wire.peer_ticket import METADATA_KEY as TICKET_KEY
from kvtierd_client.wire.peer_ticket import TICKET_SOCKET_SUFFIX


class AuditedSession(Protocol):
    """What the audit log reads of a session (``kvtierd.core.sessions.Session``)."""

    id: str
    client_name: str
    peer: str
    principal: str

    @property
    def pool_name(self) -> str: ...


log = logging.getLogger(__name__)

BEARER_PREFIX = "Bearer "
TCP_UNAUTHENTICATED = "TCP calls need metadata 'authorization: Bearer <token>'"
TCP_UNAUTHENTICATED_MTLS = TCP_UNAUTHENTICATED + " or a client certificate with a CN or DNS name"
UNIX_UNAUTHENTICATED = (
    "this daemon has [[security.principals]]: calls over its Unix socket must carry the "
    f"peer ticket of the socket's '{TICKET_SOCKET_SUFFIX}' twin in metadata '{TICKET_KEY}' "
    "(kvtierd_client sends it by itself); the ticket is unknown or missing"
)

Metadata = Iterable[tuple[str, Any]]  # a call's metadata: grpc.aio.Metadata or pairs


def metadata_value(metadata: Metadata | None, key: str) -> str:
    """The first value of ``key`` in a call's metadata ("" when absent)."""
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else ""
    return ""


def bearer_token(metadata: Metadata | None) -> str:
    value = metadata_value(metadata, "authorization")
    return value[len(BEARER_PREFIX) :] if value.startswith(BEARER_PREFIX) else ""


class SecurityState:
    """See the module docstring. ``authorizer`` is replaced, never mutated."""

    def __init__(
        self,
        principals: tuple[Principal, ...],
        tokens_file: str,
        *,
        max_ticket_holders: int,
        client_certificates: bool = False,
        unix_only: bool = False,
        audit: AuditLog | None = None,
    ) -> None:
        self._principals = principals
        # every listener is a Unix socket and no principal is configured: every
        # caller is the local caller, known without asking grpc for the peer (a
        # per-call cost on the hot path). Fixed for the daemon's life.
        self._everyone_local = unix_only and not principals
        self._tokens_file = tokens_file
        self._client_certificates = client_certificates
        self.authorizer: Authorizer = build_authorizer(
            principals, tokens_file, client_certificates=client_certificates
        )
        self.audit = audit or AuditLog()
        self.quotas = PoolQuotas(principals)
        self.tickets = TicketOffice(
            lambda peer: self.authorizer.for_unix_peer(peer),
            max_ticket_holders,
            on_refused=self._ticket_refused,
            principals=[principal.name for principal in principals],
        )
        # (method, status code name, seconds) per call a gate refused; set by the daemon
        # (metrics count them with the calls the servicer answers)
        self.observe_refused: Callable[[str, str, float], None] | None = None

    @property
    def restricted(self) -> bool:
        """Principals are configured (fixed for the daemon's life)."""
        return bool(self._principals)

    def reload_tokens(self) -> None:
        """Re-reads the tokens file into a new Authorizer and swaps it in; calls
        already running keep the old one. Raises ``TokensFileError`` and keeps the
        current Authorizer when the file is unusable."""
        self.authorizer = build_authorizer(
            self._principals, self._tokens_file, client_certificates=self._client_certificates
        )
        log.debug("tokens reloaded from %s", self._tokens_file)

    # ----------------------------------------------------------------- per call

    def identify(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of the call ``context`` belongs to; raises ``NotAuthenticated``
        or, for a certificate naming no principal, ``AccessDenied``."""
        if self._everyone_local:
            return LOCAL_CALLER
        peer = context.peer()
        if peer.startswith("unix:"):
            if not self.restricted:
                return LOCAL_CALLER
            ticket = metadata_value(context.invocation_metadata(), TICKET_KEY)
            caller = self.tickets.caller(ticket) if ticket else None
            if caller is None:
                raise NotAuthenticated(UNIX_UNAUTHENTICATED)
            return caller
        authorizer = self.authorizer
        if authorizer.client_certificates:
            certified = authorizer.for_certificate(tls_peer_names(context))
            if certified is not None:
                certified_principal, name = certified
                return Caller(certified_principal, f"{peer} certificate={name}", "certificate")
        token = bearer_token(context.invocation_metadata())
        principal = authorizer.for_token(token) if token else None
        if principal is None:
            raise NotAuthenticated(
                TCP_UNAUTHENTICATED_MTLS if authorizer.client_certificates else TCP_UNAUTHENTICATED
            )
        return Caller(principal, peer, "token")

    def admits_unix(self, metadata: Metadata | None) -> bool:
        """Whether a Unix-socket call with ``metadata`` names a live ticket (the
        gate's check, before the request is read)."""
        ticket = metadata_value(metadata, TICKET_KEY)
        return bool(ticket) and self.tickets.caller(ticket) is not None

    def admits_tcp(self, metadata: Metadata | None) -> bool:
        """Whether a TCP call with ``metadata`` may be read: a known bearer token,
        or any call when the transport verified a client certificate."""
        authorizer = self.authorizer
        if authorizer.client_certificates:
            return True
        token = bearer_token(metadata)
        return bool(token) and authorizer.for_token(token) is not None

    def gate(
        self, transport: str, service: str, handlers: Mapping[str, Any]
    ) -> AuthenticationGate | None:
        """The pre-body gate of ``service`` (``handlers``: method name -> handler) on
        ``transport`` ("unix" or "tcp"), or None where every caller is let in:
        Unix sockets without principals. Health stays open where a transport is
        gated, unread: ``Check`` answers the overall status to anyone (probes),
        ``Watch`` needs an identity (``kvtierd.security.gate``)."""
        if transport == "unix":
            if not self.restricted:
                return None
            admits, message = self.admits_unix, UNIX_UNAUTHENTICATED
        else:
            admits, message = self.admits_tcp, TCP_UNAUTHENTICATED
        paths = {f"/{service}/{name}": handler for name, handler in handlers.items()}
        unread: dict[str, Any] = {}
        if service in OPEN_SERVICES:
            check = f"/{service}/Check"
            unread[check] = answer_default_request(paths[check], HealthCheckRequest)
        return AuthenticationGate(paths, admits, message, self._gate_refused, unread)

    # ----------------------------------------------------------------- audit

    def call_denied(self, method: str, caller: Caller | None, peer: str, exc: KvtierdError) -> None:
        """Audits a call refused with PERMISSION_DENIED or UNAUTHENTICATED."""
        principal = caller.name if caller is not None else ""
        pool = ""
        if isinstance(exc, AccessDenied):
            principal = exc.principal or principal
            pool = exc.pool
        self.audit.denied(
            method, exc.code.name, principal, caller.peer if caller else peer, pool, str(exc)
        )

    def session_event(self, event: str, session: AuditedSession, reason: str) -> None:
        """Audits a session ``opened``, ``closed`` or ``expired`` (``SessionTable``'s hook)."""
        extra = {"client": session.client_name} if event == "opened" else {"reason": reason}
        self.audit.session(
            event, session.id, session.principal, session.peer, session.pool_name, **extra
        )

    def _gate_refused(self, method: str, peer: str, message: str) -> None:
        name = method.rpartition("/")[2]
        self.audit.denied(name, "UNAUTHENTICATED", "", peer, "", message)
        if self.observe_refused is not None:
            self.observe_refused(name, "UNAUTHENTICATED", 0.0)

    def _ticket_refused(self, peer: str, reason: str) -> None:
        self.audit.denied("peer-ticket", "PERMISSION_DENIED", "", peer, "", reason)
