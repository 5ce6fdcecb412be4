"""TLS credentials of the TCP listeners, replaceable while the daemon serves.

With ``security.tls_cert_file`` and ``security.tls_key_file`` set, every TCP
listener serves TLS only (a plain-text client fails its handshake). With
``security.tls_client_ca_file`` set too, a client must present a certificate
signed by one of that file's CAs (mutual TLS); gRPC verifies it during the
handshake, before any request is read, and ``identity.tls_peer_name`` gives
the name it carries.

Rotation without dropping anyone: gRPC's dynamic server credentials ask a
*fetcher* for the certificate configuration at the start of every TLS
handshake. ``ServerTls`` keeps the current configuration; ``reload`` (SIGHUP)
reads every file again and replaces it only when all of them are valid, so a
bad new file keeps the old credentials (the caller logs why). A handshake is
never redone: connections made before a reload keep what they negotiated and
only new connections see the new certificate or CA.

Threads: ``reload`` runs on the event loop; fetchers run on gRPC's handshake
threads. Both touch ``_current`` and ``_generation`` only under ``_lock``.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from kvtierd.errors import ConfigError
from kvtierd.security.config import SecurityConfig

CertificateFetcher = Callable[[], "grpc.ServerCertificateConfiguration | None"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where the TCP listeners' credentials are read from (absolute paths)."""

    cert_file: str  # PEM certificate chain, the server's first
    key_file: str  # PEM private key of the first certificate; not accessible by others
    client_ca_file: str  # PEM CA certificates for client certificates; "" = mTLS off

    @classmethod
    def from_config(cls, security: SecurityConfig) -> TlsFiles | None:
        """The configured files, or None when TLS is off (config.py checked that
        the certificate and the key are set together)."""
        if not security.tls_cert_file:
            return None
        return cls(security.tls_cert_file, security.tls_key_file, security.tls_client_ca_file)


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """The bytes of one consistent read of ``TlsFiles``: the key matches the
    first certificate of the chain, and the client CAs (if any) parse."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None  # None: client certificates are not asked for


def read_tls_material(files: TlsFiles) -> TlsMaterial:
    """Reads and checks ``files`` once. Raises ``ConfigError`` naming the key of
    the offending file: unreadable, a key file accessible by others, a
    certificate chain and key that do not belong together (or do not parse),
    or client CAs that hold no certificate."""
    chain = _read("security.tls_cert_file", files.cert_file)
    key = _read("security.tls_key_file", files.key_file, private=True)
    client_ca = _read("security.tls_client_ca_file", files.client_ca_file) or None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with _memory_file(chain) as chain_path, _memory_file(key) as key_path:
        try:
            context.load_cert_chain(chain_path, key_path, password=_no_password)
        except ssl.SSLError as exc:
            raise ConfigError(
                "security.tls_cert_file",
                f"{files.cert_file} and {files.key_file} are not a PEM certificate chain and "
                f"its unencrypted private key ({exc.reason or exc})",
            ) from None
    if files.client_ca_file:
        try:
            context.load_verify_locations(cadata=(client_ca or b"").decode("ascii"))
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                "security.tls_client_ca_file",
                f"{files.client_ca_file} holds no PEM CA certificate "
                f"({getattr(exc, 'reason', None) or exc})",
            ) from None
    return TlsMaterial(chain, key, client_ca)


class ServerTls:
    """The certificate configuration that new TLS handshakes on TCP get.

    Owned by the daemon. Invariant: ``_current`` was built from a
    ``TlsMaterial`` that passed ``read_tls_material``; only a ``reload`` that
    read every file successfully replaces it, and each replacement adds one to
    ``_generation`` (guarded by ``_lock``, like ``_current``).
    """

    def __init__(self, files: TlsFiles) -> None:
        """Reads ``files``; raises ``ConfigError`` as ``read_tls_material``."""
        self.files = files
        self._lock = threading.Lock()
        self._current = _configuration(read_tls_material(files))  # guarded by _lock
        self._generation = 0  # guarded by _lock: successful reloads so far

    @property
    def requires_client_certificates(self) -> bool:
        """Mutual TLS: every TCP client presents a certificate a client CA signed."""
        return bool(self.files.client_ca_file)

    @property
    def generation(self) -> int:
        """Successful reloads since start."""
        with self._lock:
            return self._generation

    def reload(self) -> None:
        """Reads the files again and serves them to new handshakes. On any error
        raises ``ConfigError`` and changes nothing: the previous credentials stay."""
        configuration = _configuration(read_tls_material(self.files))
        with self._lock:
            self._current = configuration
            self._generation += 1  # generation n -> n + 1: every fetcher hands it out once

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for one listener (call once per listener: each has its own
        fetcher, which knows what its listener already has)."""
        with self._lock:
            initial = self._current
        return grpc.dynamic_ssl_server_credentials(
            initial,
            # The stub wants a fetcher that never returns None; gRPC documents None as
            # "no change" (grpc.dynamic_ssl_server_credentials), which fetcher() relies on.
            self.fetcher(),  # type: ignore[arg-type]
            require_client_authentication=self.requires_client_certificates,
        )

    def fetcher(self) -> CertificateFetcher:
        """A certificate fetcher for one listener: gRPC calls it at every new
        handshake. It returns the current configuration when a reload happened
        since its last answer, else None ("unchanged": gRPC keeps its TLS
        context instead of building a new one per connection)."""
        with self._lock:
            served = self._generation

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            nonlocal served
            with self._lock:
                if self._generation == served:
                    return None
                served = self._generation
                return self._current

        return fetch


def _configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.private_key, material.certificate_chain)],
        root_certificates=material.client_ca,
    )


def _read(key: str, path: str, *, private: bool = False) -> bytes:
    """The bytes of ``path`` ("" reads as b""). A ``private`` file must not be
    accessible by others (as the tokens file)."""
    if not path:
        return b""
    try:
        with open(path, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            data = handle.read()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if private and mode & 0o007:
        raise ConfigError(key, f"{path} is accessible by others; chmod o-rwx")
    if not data.strip():
        raise ConfigError(key, f"{path} is empty")
    return data


def _no_password() -> bytes:
    """An encrypted key fails to load (the daemon cannot ask for a passphrase)."""
    return b""


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path that reads as ``data`` without it touching a disk (``ssl`` loads
    certificates and keys only from paths): a memfd seen through /proc."""
    fd = os.memfd_create("kvtierd-tls", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
