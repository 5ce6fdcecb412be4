"""TLS and mutual TLS for TCP connections to kvtierd.

A client uses TLS when its address is ``tls://host:port`` or when it is given
``tls=TlsOptions(...)`` with a ``host:port`` address; a plain ``host:port``
without options is plain text (the bearer token travels in clear). Unix
sockets never use TLS: asking for it there is a ``ValueError``.

    from kvtierd_client.client import Client
    from kvtierd_client.tls import TlsOptions

    tls = TlsOptions.from_files(
        ca_file="/etc/kvtierd/ca.pem",          # CAs trusted for the daemon's certificate
        cert_file="/etc/kvtierd/team-a.pem",    # mTLS: this client's certificate ...
        key_file="/etc/kvtierd/team-a.key",     # ... and its key
    )
    client = Client("tls://kvtier.example:7070", tls=tls)

Without ``root_certificates`` the daemon's certificate is checked against the
system's CA roots (gRPC's default roots). The name checked in the daemon's
certificate is the address's host unless ``server_name`` says otherwise (for
a daemon reached by IP address whose certificate names a host).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvtierd_client.wire.address import uses_tls

__all__ = ["TlsOptions", "aio_channel", "resolve_tls", "sync_channel"]


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """What a client needs for TLS: every field optional, PEM bytes."""

    root_certificates: bytes | None = None  # CAs for the daemon's certificate; None: system roots
    certificate_chain: bytes | None = None  # mTLS: this client's certificate chain
    private_key: bytes | None = None  # mTLS: the key of certificate_chain's first certificate
    server_name: str | None = None  # name expected in the daemon's certificate; None: the host

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its private key (and the key its chain)")

    @classmethod
    def from_files(
        cls,
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
    ) -> TlsOptions:
        """Options read from PEM files (``None``: not given). Raises ``OSError``
        for an unreadable file and ``ValueError`` for a certificate without its key."""
        return cls(
            root_certificates=_read(ca_file),
            certificate_chain=_read(cert_file),
            private_key=_read(key_file),
            server_name=server_name or None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def channel_options(self) -> tuple[tuple[str, Any], ...]:
        """gRPC channel arguments these options add (the expected server name)."""
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)


def resolve_tls(address: str, target: str, tls: TlsOptions | None) -> TlsOptions | None:
    """The TLS options a client at ``address`` (gRPC ``target``) connects with:
    ``tls`` when given, default options for a ``tls://`` address, else None
    (plain text). Raises ``ValueError`` for TLS on a Unix socket."""
    if tls is None and uses_tls(address):
        tls = TlsOptions()
    if tls is not None and target.startswith("unix:"):
        raise ValueError(f"TLS is for TCP addresses; {address!r} is a Unix socket")
    return tls


def sync_channel(
    target: str, options: Sequence[tuple[str, Any]], tls: TlsOptions | None
) -> grpc.Channel:
    """A ``grpc`` channel to ``target``: TLS with ``tls``, else plain text."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(
        target, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def aio_channel(
    target: str, options: Sequence[tuple[str, Any]], tls: TlsOptions | None
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target``: TLS with ``tls``, else plain text."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(
        target, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as handle:
        return handle.read()
