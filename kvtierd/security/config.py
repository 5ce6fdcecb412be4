"""The ``[security]`` section of the configuration: its keys, its frozen
section and its checks, kept here so ``kvtierd.config`` does not grow with them.

``kvtierd.config`` declares every scalar option in its one ``OPTIONS`` table;
the security section's scalar keys (each an absolute file path, or "" for off)
come from ``FILE_OPTIONS`` below. ``[[security.principals]]`` is an array of
tables, parsed by ``kvtierd.security.principals`` (``parse_security_tables``).
``check_security`` runs the checks between keys once the whole configuration is
known. Errors are ``SecurityOptionError`` naming the dotted key at fault;
``kvtierd.config`` turns them into its ``ConfigError`` (exit code 2).

This module must not import ``kvtierd.config`` (that module imports it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtierd.security.principals import Principal, PrincipalOptionError, parse_principals

SECTION = "security"
TABLE_ARRAYS = ("principals",)  # keys of [security] holding arrays of tables


class SecurityOptionError(ValueError):
    """A bad security setting; ``key`` is its full dotted name (``security.tls_key_file``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


@dataclass(frozen=True, slots=True)
class FileOption:
    """One scalar key of ``[security]``: an absolute file path or "" (off)."""

    key: str
    help: str
    flag: str


FILE_OPTIONS: tuple[FileOption, ...] = (
    FileOption(
        "tokens_file",
        "file of bearer tokens that TCP clients must present, one per line: 'TOKEN' "
        "(every pool) or 'TOKEN PRINCIPAL'; required when any listen address is TCP "
        "(unless tls_client_ca_file is set; re-read on SIGHUP)",
        "--tokens-file",
    ),
    FileOption(
        "tls_cert_file",
        "PEM certificate chain TCP listeners present; with tls_key_file, TCP serves TLS only "
        "(re-read on SIGHUP)",
        "--tls-cert-file",
    ),
    FileOption(
        "tls_key_file",
        "PEM private key of tls_cert_file, not readable by others (re-read on SIGHUP)",
        "--tls-key-file",
    ),
    FileOption(
        "tls_client_ca_file",
        "PEM CA certificates: TCP clients must present a certificate one of them signed "
        "(mTLS; its CN or a DNS SAN names the caller, or a principal; re-read on SIGHUP)",
        "--tls-client-ca-file",
    ),
)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    tokens_file: str  # "" = no tokens: TCP needs tls_client_ca_file, or is refused
    tls_cert_file: str  # with tls_key_file: TCP listeners serve TLS only
    tls_key_file: str
    tls_client_ca_file: str  # "" = no client certificates (mTLS off); needs the two above
    # [[security.principals]]; () = no per-pool authorization (socket permissions decide)
    principals: tuple[Principal, ...] = ()


def parse_security_tables(section: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SecurityConfig`` fields read from the arrays of tables of the
    ``[security]`` table ``section`` of the TOML document."""
    try:
        principals = parse_principals(section.get("principals", []))
    except PrincipalOptionError as exc:
        raise SecurityOptionError(f"{SECTION}.{exc.key}", exc.message) from None
    return {"principals": principals}


def check_security(security: SecurityConfig, listen: Sequence[str]) -> None:
    """The checks between keys: TCP listeners need a way to authenticate their
    callers; the certificate and its key go together; client certificates
    need TLS."""
    tcp = [address for address in listen if not address.startswith("unix://")]
    if tcp and not (security.tokens_file or security.tls_client_ca_file):
        raise SecurityOptionError(
            "server.listen",
            f"TCP address {tcp[0]} needs security.tokens_file (bearer tokens for TCP clients) "
            "or security.tls_client_ca_file (client certificates); "
            "or listen on a unix:// socket only",
        )
    if bool(security.tls_cert_file) != bool(security.tls_key_file):
        raise SecurityOptionError(
            "security.tls_cert_file" if not security.tls_cert_file else "security.tls_key_file",
            "security.tls_cert_file and security.tls_key_file are set together (or neither)",
        )
    if security.tls_client_ca_file and not security.tls_cert_file:
        raise SecurityOptionError(
            "security.tls_client_ca_file",
            "client certificates need TLS: set security.tls_cert_file and security.tls_key_file",
        )
