"""gRPC listeners: the KVTier service, the standard health service and reflection.

Unix sockets are created with mode 0660 (umask tightened around the bind, so the
socket is never reachable by others, not even for an instant), in a directory of
the daemon's own: made 0750 if missing (its parent must exist), and refused when
it or a directory above it is another user's or writable by others without the
sticky bit. A leftover socket file from a crashed daemon is removed; a socket
another live daemon is serving is refused, and so is a socket of another user
and anything at the path that is not a socket (a regular file, FIFO, directory,
symlink...), which is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvtierd.api import grpclog, guards
from kvtierd.api.grpc_service import GrpcService
from kvtierd.api.validation import MAX_KEY_BYTES
from kvtierd.config import ConfigError, LimitsConfig
from kvtierd.errors import StartupError
from kvtierd.security.own_dirs import SHARED_MODE, ParentMissing, create_own_dir
from kvtierd.security.state import SecurityState
from kvtierd.security.trusted_dirs import UntrustedPath, owner_name, require_trusted_dir
from kvtierd.util import filekind
from kvtierd.util.sockets import SocketPlacement
from kvtierd_client.wire.proto import pb2, pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["KVTier"].full_name
KEY_WIRE_BYTES = MAX_KEY_BYTES + 3  # a longest key as a repeated bytes field: tag, length
MESSAGE_SLACK_BYTES = 1 << 20  # every other field of a request or response
_GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's message length options are C ints
STALE_PROBE_TIMEOUT = 1.0  # seconds a connect to a leftover socket file may take


class ListenError(StartupError):
    """A listen address cannot be served (in use, no permission, bad directory):
    the operator's to fix, so one line and exit code 2, naming ``server.listen``."""

    def __init__(self, message: str, key: str = "server.listen") -> None:
        super().__init__(key, message)


def max_receive_bytes(limits: LimitsConfig) -> int:
    """The largest request the daemon reads: a Batch carrying two calls of
    ``max_keys_per_call`` keys of the longest allowed length (a client's step: its
    queued CompleteStore plus the PrepareStore that carries it), plus slack.
    gRPC refuses a larger one with RESOURCE_EXHAUSTED before it is parsed
    (default 65,536 keys: ~35 MiB)."""
    return 2 * limits.max_keys_per_call * KEY_WIRE_BYTES + MESSAGE_SLACK_BYTES


def max_send_bytes(limits: LimitsConfig) -> int:
    """The largest answer: a PrepareStore (or Batch) answer names at most twice the
    keys of its request (stored and evicted); a TakeEvents answer at most the
    pool's retained events (their wire size is below what they count)."""
    wanted = max(2 * max_receive_bytes(limits), limits.events_retained_bytes + MESSAGE_SLACK_BYTES)
    return min(wanted, _GRPC_MAX_MESSAGE_BYTES)


def build_server(
    service: GrpcService, limits: LimitsConfig, security: SecurityState | None = None
) -> tuple[TransportServers, health.aio.HealthServicer]:
    """The servers with their three services; call ``add_listeners`` then start them.
    ``security`` decides which calls are refused before their request is read
    (``SecurityState.gate``); None: none are."""
    grpclog.install()
    options = [
        ("grpc.max_receive_message_length", max_receive_bytes(limits)),
        ("grpc.max_send_message_length", max_send_bytes(limits)),
        ("grpc.so_reuseport", 0),
    ]
    servers = TransportServers(lambda: grpc.aio.server(options=options), security)
    generic = _GenericHandlersOnly(servers, maps_errors={SERVICE_NAME})
    pb2_grpc.add_KVTierServicer_to_server(service, generic)
    health_servicer = health.aio.HealthServicer()
    # The stub wants a grpc server; the generated function only calls what _GenericHandlersOnly has.
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, generic)  # type: ignore[arg-type]
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(names), generic
    )
    if generic.services != set(names):
        raise RuntimeError(f"served {sorted(generic.services)}, expected {sorted(names)}")
    return servers, health_servicer


class TransportServers:
    """One ``grpc.aio`` server per transport (Unix sockets, TCP) serving the same
    services; stands in for a ``grpc.aio.Server`` (ports, start, stop).

    Why one per transport: a call is admitted or refused before its request is
    read, from its method and metadata only (``kvtierd.security.gate``); grpc
    shows that choice nothing of the connection, so each server's services are
    wrapped for the transport it serves (a Unix peer needs no token, a TCP one
    does). A server is made when its first address is added; with Unix sockets
    only there is one server, as before.
    """

    def __init__(
        self, make_server: Callable[[], grpc.aio.Server], security: SecurityState | None
    ) -> None:
        self._make_server = make_server
        self._security = security
        self._services: dict[str, dict[str, Any]] = {}  # service -> method name -> handler
        self._servers: dict[str, grpc.aio.Server] = {}  # transport -> its server
        self._started: set[str] = set()  # transports whose server was started

    def register(self, service: str, handlers: dict[str, Any]) -> None:
        if self._servers:
            raise RuntimeError(f"service {service} registered after a port was added")
        self._services[service] = handlers

    def add_insecure_port(self, address: str) -> int:
        return self._server_for(address).add_insecure_port(address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._server_for(address).add_secure_port(address, credentials)

    async def start(self) -> None:
        """Starts the servers not started yet (a takeover adds TCP ports later)."""
        for transport, server in self._servers.items():
            if transport not in self._started:
                await server.start()
                self._started.add(transport)

    async def stop(self, grace: float | None) -> None:
        await asyncio.gather(*(server.stop(grace) for server in self._servers.values()))

    def _server_for(self, address: str) -> grpc.aio.Server:
        transport = "unix" if address.startswith("unix:") else "tcp"
        if transport in self._started:
            raise RuntimeError(f"a {transport} address added after its server started")
        server = self._servers.get(transport)
        if server is None:
            server = self._servers[transport] = self._make_server()
            for service, handlers in self._services.items():
                server.add_generic_rpc_handlers((self._generic(transport, service, handlers),))
        return server

    def _generic(
        self, transport: str, service: str, handlers: dict[str, Any]
    ) -> grpc.GenericRpcHandler:
        if self._security is not None:
            gate = self._security.gate(transport, service, handlers)
            if gate is not None:
                return gate
        return grpc.method_handlers_generic_handler(service, handlers)


class _GenericHandlersOnly:
    """What a generated ``add_*Servicer_to_server`` sees of the server: each
    service is served through one generic handler (per transport:
    ``TransportServers``) built from its method handlers, each guarded by
    ``guards.guard`` (unparsable requests are INVALID_ARGUMENT, unimplemented
    methods UNIMPLEMENTED, neither a traceback).

    Why generic only: grpc.aio's server waits for its next call with
    ``asyncio.wait`` over one pending request per registered method plus one for
    generic methods, and re-arms that wait after every call: with the ~25
    methods of these three services that cost about 6 % of the daemon's CPU per
    empty call (measured: docs/benchmarks/history.md, engine steps). Served through the
    generic handler, each call is found by one dict lookup in its service's
    handler instead.

    Generated code (grpcio-tools >= 1.62) passes every service twice: as a
    generic handler, dropped here, and as the dict of its method handlers, which
    is wrapped and served. ``services`` lists the names served, so a service
    that arrived only one way is noticed at start.
    """

    def __init__(self, servers: TransportServers, *, maps_errors: set[str]) -> None:
        self._servers = servers
        self._maps_errors = maps_errors  # services whose handlers map KvtierdError
        self.services: set[str] = set()

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Dropped on purpose: ``add_registered_method_handlers`` serves the same
        methods, guarded."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        maps_errors = service in self._maps_errors
        guarded = {
            name: guards.guard(handler, f"/{service}/{name}", maps_errors=maps_errors)
            for name, handler in handlers.items()
        }
        self._servers.register(service, guarded)
        self.services.add(service)


async def set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


def add_listeners(
    server: TransportServers,
    addresses: tuple[str, ...],
    gid: int | None,
    bound: list[str],
    tls: Callable[[], grpc.ServerCredentials] | None = None,
    placement: SocketPlacement | None = None,
    created_dirs: list[str] | None = None,
) -> None:
    """Binds every address. Unix socket paths this call created are appended to
    ``bound`` as they are made, and recorded in ``placement``, so a failure halfway
    still lets the caller remove exactly its own sockets (never another daemon's);
    socket directories it made, to ``created_dirs`` (``remove_if_empty`` at stop).
    ``tls``: makes the credentials of one TCP listener (``ServerTls.server_credentials``);
    TCP listeners then serve TLS only. Unix sockets never use TLS. ``placement``
    (default: at their paths) says where Unix sockets are bound: the daemon's, at
    temporary names it publishes once it serves (``kvtierd.util.sockets``)."""
    placement = placement if placement is not None else SocketPlacement()
    created = created_dirs if created_dirs is not None else []
    for address in addresses:
        if address.startswith("unix://"):
            path = address[len("unix://") :]
            _add_unix(server, path, gid, placement, created)
            bound.append(path)
        else:
            _add_tcp(server, address, tls)


def refuse_served_sockets(addresses: tuple[str, ...]) -> None:
    """Before anything else of the start is checked or taken (a secondary tier's
    root lock, the metrics port): ListenError when another process of this uid
    serves one of the Unix socket paths of ``addresses``, so a second daemon started
    as the first is told that, not what it would have shared with it. Nothing is
    removed or refused otherwise: binding says the rest (``_remove_stale_socket``)."""
    for address in addresses:
        path = address[len("unix://") :]
        if address.startswith("unix://") and _served_by_own_uid(path):
            raise ListenError(_already_served(path))


def _served_by_own_uid(path: str) -> bool:
    """A process accepts connections at ``path``, a socket file of this uid."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(STALE_PROBE_TIMEOUT)
        try:
            probe.connect(path)
        except OSError:  # refused (stale), full backlog, gone: binding says which
            return False
    return True


def _already_served(path: str) -> str:
    return (
        f"another process is already serving {path}; stop it first, or give this "
        "daemon another listen path"
    )


def _add_tcp(
    server: TransportServers,
    address: str,
    tls: Callable[[], grpc.ServerCredentials] | None,
) -> None:
    """Binds a TCP listener. The address is first bound with a plain socket (closed
    at once): gRPC's refusal says only "Failed to bind" (a RuntimeError, after a
    line of its own on stderr), the probe's errno says why."""
    refusal = tcp_bind_refusal(address)
    if refusal is not None:
        raise ListenError(f"cannot listen on {address}: {refusal}")
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls())
    except RuntimeError:
        port = 0
    if port == 0:  # taken between the probe and now
        refusal = tcp_bind_refusal(address) or "gRPC could not bind it (GRPC_VERBOSITY=debug)"
        raise ListenError(f"cannot listen on {address}: {refusal}")
    log.info("listening on tcp %s (%s)", address, "TLS" if tls else "plain text")


def tcp_bind_refusal(address: str) -> str | None:
    """Why ``address`` (HOST:PORT) cannot be bound, with what to do; None when a
    plain socket binds it (and is closed at once)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            probe.bind(sockaddr)
    except socket.gaierror as exc:
        return f"{host} does not resolve ({exc.strerror})"
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (
                "address already in use: another process (another kvtierd?) listens there; "
                "stop it or choose another port"
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this host"
        return exc.strerror or str(exc)
    return None


def _add_unix(
    server: TransportServers,
    path: str,
    gid: int | None,
    placement: SocketPlacement,
    created: list[str],
) -> None:
    _prepare_socket_directory(os.path.dirname(path), gid, created)
    at = _bind_name(path, placement)
    refusal = _unix_bind_refusal(at)
    if refusal is not None:
        raise ListenError(f"cannot listen on unix socket {path}: {refusal}")
    with _umask(0o117):
        try:
            bound = server.add_insecure_port("unix:" + at)
        except RuntimeError:  # taken since the probe
            bound = 0
    if bound == 0:
        raise ListenError(f"cannot listen on unix socket {path}")
    _give_socket_mode(at, gid, path)
    placement.record(path, at)
    log.info("listening on unix socket %s (mode 0660)%s", path, _published_later(at, path))


def _bind_name(path: str, placement: SocketPlacement) -> str:
    """Where the socket of ``path`` is bound: at the path (a stale socket file
    cleared first unless a takeover replaces the daemon serving it), or at the
    temporary name it is published from (``SocketPlacement``)."""
    if not placement.takeover:
        _remove_stale_socket(path)
    try:
        return placement.bind_name(path)
    except ValueError as exc:
        raise ListenError(str(exc)) from None


def _give_socket_mode(at: str, gid: int | None, path: str) -> None:
    try:
        os.chmod(at, 0o660)
        if gid is not None:
            os.chown(at, -1, gid)
    except OSError as exc:
        raise ListenError(
            f"cannot give unix socket {path} mode 0660 and group {gid}: {exc.strerror}"
        ) from None


def _published_later(at: str, path: str) -> str:
    return "" if at == path else f", bound at {at} until published"


def _unix_bind_refusal(path: str) -> str | None:
    """Why a socket cannot be bound at ``path`` (a directory the daemon may not
    write in...), with what to do; None when a plain socket binds there. gRPC's
    refusal says only "Failed to bind" after a line of its own on stderr. The
    probe is bound with the listeners' umask and never listens (a connect is
    refused), then removed."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _umask(0o117):
            probe.bind(path)
    except OSError as exc:
        return (
            f"{exc.strerror}; choose another listen path, or one in a directory the "
            "daemon's user may write"
        )
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return None


def _prepare_socket_directory(directory: str, gid: int | None, created: list[str]) -> None:
    """Makes sure the daemon may serve in ``directory``, the directory of a Unix listen
    socket: anyone who may write there could rename the daemon's socket aside and
    serve a daemon of their own at its name (docs/security.md, "Who can be the
    daemon").

    Made when missing (its parent must exist; appended to ``created``, removed at stop
    when empty), mode 0750 with the sockets' group ``gid``. Then, made or found, it
    and every directory above it must be owned by the daemon's user or root and not
    writable by others unless sticky (``security.trusted_dirs``); in a sticky one a
    socket file another user left refuses the start (``_remove_stale_socket``).
    Raises ListenError naming ``server.listen``."""
    try:
        os.lstat(directory)
    except FileNotFoundError:
        _create_socket_directory(directory, gid, created)
    except OSError as exc:
        raise ListenError(_unreachable(directory, exc.strerror or str(exc))) from None
    try:
        require_trusted_dir(directory)
    except UntrustedPath as exc:
        raise ListenError(f"cannot listen in {directory}: {exc}") from None
    except OSError as exc:
        raise ListenError(_unreachable(directory, exc.strerror or str(exc))) from None
    if not os.path.isdir(directory):
        raise ListenError(
            f"cannot create socket directory {directory}: {directory} exists and is not a "
            "directory; choose another listen path"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ListenError(_unreachable(directory, "no write access"))
    if os.stat(directory).st_mode & stat.S_ISVTX:
        log.warning(
            "server.listen: %s is a directory anyone may create names in (sticky): clients "
            "of other users trust a socket there only when told who runs the daemon "
            "($KVTIERD_DAEMON_USER), and between a stop and the next start anyone may bind "
            "its name. Prefer a directory of the daemon's own (the default one is)",
            directory,
        )


def _create_socket_directory(directory: str, gid: int | None, created: list[str]) -> None:
    try:
        made = create_own_dir(directory, gid, SHARED_MODE)
    except ParentMissing as exc:
        raise ListenError(
            f"cannot create socket directory {directory}: {exc}; create it for the daemon's "
            "user, or choose another listen path"
        ) from None
    except OSError as exc:
        raise ListenError(
            f"cannot create socket directory {directory}: {exc.strerror}; create it for "
            "the daemon's user or choose another listen path"
        ) from None
    if made:
        created.append(directory)
        log.info("socket directory %s created: mode 0750, the daemon's own", directory)


def _unreachable(path: str, why: str) -> str:
    return (
        f"cannot reach {path}: {why} (the daemon runs as "
        f"{owner_name(os.geteuid())}); give that user access to it or choose another "
        "listen path"
    )


def bind_unix_socket(
    path: str,
    gid: int | None,
    what: str = "peer tickets",
    placement: SocketPlacement | None = None,
) -> socket.socket:
    """A listening stream socket at ``path``, mode 0660 and group ``gid`` like the
    gRPC sockets (a stale socket file is cleared as for them; bound where
    ``placement`` says, as they are). For the ticket sockets next to each
    gRPC socket (``kvtierd.security.tickets``) and the fast lane's
    (``kvtierd.api.fastlane``); ``what`` names it in the log line."""
    placement = placement if placement is not None else SocketPlacement()
    at = _bind_name(path, placement)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _umask(0o117):
            listener.bind(at)
        os.chmod(at, 0o660)
        if gid is not None:
            os.chown(at, -1, gid)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise ListenError(f"cannot listen on unix socket {path}: {exc.strerror}") from None
    placement.record(path, at)
    log.info("%s on unix socket %s (mode 0660)%s", what, path, _published_later(at, path))
    return listener


def _remove_stale_socket(path: str) -> None:
    """Clears ``path`` for binding: a socket file nobody answers on (left by a
    crashed daemon) is removed with a WARNING. Anything else refuses the start:
    a socket another process serves (``ListenError``), and any other kind of
    file, a symlink included, never followed (``ConfigError``); both exit code 2;
    those are left untouched."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ListenError(_unreachable(path, exc.strerror or str(exc))) from None
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(
            "server.listen",
            f"{path} is {filekind.describe(path, info.st_mode)}, not a socket; "
            "remove it or choose another listen path",
        )
    if info.st_uid != os.geteuid():
        raise ListenError(
            f"{path} is a socket of {owner_name(info.st_uid)}, not of the daemon's user "
            f"{owner_name(os.geteuid())}: another user put it there (never served over, "
            "never removed); remove it as its owner or root, or choose a directory of the "
            "daemon's own"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(STALE_PROBE_TIMEOUT)  # a full backlog must not hang the start
    try:
        probe.connect(path)
    except (TimeoutError, BlockingIOError):
        raise ListenError(f"socket {path} exists and does not accept; is it in use?") from None
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ListenError(f"socket {path} exists and cannot be probed: {exc}") from None
        log.warning("removing stale socket %s left by a previous daemon", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        raise ListenError(_already_served(path))
    finally:
        probe.close()


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)
