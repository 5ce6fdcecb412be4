"""Who the client talks to over a Unix socket, and whether what it announces is that
daemon's (the rules: ``kvtierd_client.wire.trust``; docs/security.md, "Who can be the
daemon").

:class:`DaemonCheck` belongs to one client. Before every ``OpenSession`` it finds the
daemon's uid (the owner of its socket, once the socket's path is shown to be placed by
a trusted user); the answer's region file, region descriptor socket and fast lane
socket must then be that uid's. The session keeps the uid (``daemon_uid``): its lane
and its region's descriptor are refused unless that uid serves them (``SO_PEERCRED``),
and a region descriptor unless that uid owns its file. Over TCP nothing is checked
here (tokens and TLS say who the daemon is).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtierd_client.errors import Unavailable, UntrustedAddress
from kvtierd_client.wire import trust


class DaemonCheck:
    """The trust check of one client's Unix socket address (immutable, thread-safe).

    ``socket_path`` None: a TCP address or an injected stub, nothing to check.
    ``daemon_user``: names or uids trusted to run the daemon besides root, this
    process's user and ``$KVTIERD_DAEMON_USER``. Raises ValueError for an unknown
    user name."""

    def __init__(
        self,
        address: str,
        socket_path: str | None,
        daemon_user: Iterable[int | str] | int | str | None = None,
    ) -> None:
        self._address = address
        self.socket_path = socket_path
        self.trusted = trust.trusted_uids(daemon_user)

    def daemon_uid(self) -> int | None:
        """The uid serving the socket (None over TCP). Raises ``UntrustedAddress``
        when the socket could be another user's, ``Unavailable`` when there is none."""
        if self.socket_path is None:
            return None
        try:
            return trust.daemon_uid(self.socket_path, self.trusted)
        except trust.UntrustedDaemon as exc:
            raise UntrustedAddress(str(exc), address=self._address) from None
        except OSError as exc:
            raise Unavailable(
                f"cannot reach kvtierd at {self._address}: {self.socket_path}: "
                f"{exc.strerror or exc} (is the daemon running, and may this user reach "
                "its socket directory?)",
                address=self._address,
            ) from None

    def check_announced(self, response: Any, uid: int | None) -> None:
        """Raises ``UntrustedAddress`` unless every path of the ``OpenSession`` answer
        ``response`` is the daemon's (``uid``; None: nothing to check)."""
        if uid is None:
            return
        try:
            self._check_paths(response, uid)
        except trust.UntrustedDaemon as exc:
            raise UntrustedAddress(str(exc), address=self._address) from None

    def _check_paths(self, response: Any, uid: int) -> None:
        region = response.region
        if region.fd_socket:
            self._owned(region.fd_socket, uid, "the region descriptor socket")
        if response.fast_lane_path:
            self._owned(response.fast_lane_path, uid, "the fast lane socket")
        try:
            trust.require_owned_by(region.path, uid, self.trusted, "the region file")
        except trust.UntrustedDaemon:
            raise
        except OSError as exc:
            # with principals the region's directory is the daemon's alone (0700): the
            # descriptor socket is then the only way in, and its server is checked
            if not region.fd_socket:
                raise trust.UntrustedDaemon(
                    f"the region file {region.path} cannot be checked ({exc.strerror or exc}) "
                    "and the daemon offers no descriptor socket: not mapping it"
                ) from None

    def _owned(self, path: str, uid: int, what: str) -> None:
        """A socket the answer names must be the daemon's; one that is not there is
        not used (a lane falls back to gRPC), and whoever binds it later is refused
        at connect (``SO_PEERCRED``)."""
        try:
            trust.require_owned_by(path, uid, self.trusted, what)
        except trust.UntrustedDaemon:
            raise
        except FileNotFoundError:
            return
        except OSError as exc:
            raise trust.UntrustedDaemon(
                f"{what} {path} cannot be checked: {exc.strerror or exc}"
            ) from None


def socket_path_of(target: str, injected_stub: bool) -> str | None:
    """The Unix socket path of a gRPC ``target`` (None for TCP or an injected stub)."""
    if injected_stub or not target.startswith("unix:"):
        return None
    return target[len("unix:") :]
