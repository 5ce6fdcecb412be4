"""A throw-away certificate authority for TLS tests and benchmarks (``cryptography``).

    ca = TestCA("ca-one")
    server = ca.issue("kvtierd", dns_names=("localhost",), ip_addresses=("127.0.0.1",))
    client = ca.issue("team-a", dns_names=("team-a.example",))
    server.write(directory, "server")   # server.pem, server.key (0600)

Keys are P-256; certificates are valid from a day ago for a day ahead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    """A certificate (PEM) and its private key (PEM, unencrypted PKCS#8)."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: str | os.PathLike[str], stem: str) -> tuple[str, str]:
        """Writes ``<stem>.pem`` and ``<stem>.key`` (mode 0600) by rename, as a
        careful operator rotates them; returns both paths."""
        cert_path = os.path.join(directory, f"{stem}.pem")
        key_path = os.path.join(directory, f"{stem}.key")
        write_atomically(cert_path, self.cert_pem, 0o644)
        write_atomically(key_path, self.key_pem, 0o600)
        return cert_path, key_path


class TestCA:
    """A self-signed CA that issues leaf certificates."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = "kvtierd-test-ca") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )  # fmt: skip
            .sign(self._key, hashes.SHA256())
        )

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def write(self, path: str | os.PathLike[str]) -> str:
        """Writes the CA certificate to ``path``; returns it."""
        write_atomically(str(path), self.cert_pem, 0o644)
        return str(path)

    def issue(
        self,
        common_name: str | None,
        *,
        dns_names: tuple[str, ...] = (),
        ip_addresses: tuple[str, ...] = (),
    ) -> Issued:
        """A leaf certificate for both server and client use. ``common_name``
        None: an empty subject (a certificate that names no one but by SAN)."""
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [] if common_name is None else [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name)
        ]  # fmt: skip
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + _DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        alternative: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
        alternative += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if alternative:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(alternative), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(
            cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )


def write_atomically(path: str, data: bytes, mode: int) -> None:
    """``path`` holds ``data`` with ``mode``, replaced in one rename."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as handle:
        handle.write(data)
    os.chmod(temporary, mode)
    os.replace(temporary, path)
