"""The Authorizer: maps an identity (Unix peer credentials, a bearer token, a
TLS client certificate) to a principal.

An ``Authorizer`` is immutable, built from the configuration and the contents
of the tokens file (``build_authorizer``). Reloading tokens or certificates
builds a new one and swaps the reference the daemon holds
(``SecurityState.authorizer``); a call in progress keeps the one it started
with. The principals themselves come from the configuration only, so every
Authorizer of one daemon maps onto the same principals.

When no principals are configured (``restricted`` is False) the daemon behaves
as before principals existed: Unix-socket peers are trusted (the socket's
permissions decided), a bearer token or a verified client certificate reaches
every pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtierd.security.access import AccessDenied
from kvtierd.security.identity import PeerCredentials
from kvtierd.security.principals import UNRESTRICTED, Principal, by_name
from kvtierd.security.tokens import read_token_lines, token_digest, token_table


@dataclass(frozen=True)
class Authorizer:
    """Identity -> principal. Immutable; safe to share between calls."""

    principals: tuple[Principal, ...] = ()
    # token digest (SHA-256) -> principal
    tokens: Mapping[bytes, Principal] = field(default_factory=dict)
    # TCP listeners verify client certificates (mTLS): a call that reached a
    # handler over TCP was made by the holder of a certificate the CA signed
    client_certificates: bool = False
    _by_name: Mapping[str, Principal] = field(init=False, repr=False)
    _by_uid: Mapping[int, Principal] = field(init=False, repr=False)
    _by_gid: Mapping[int, Principal] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", by_name(self.principals))
        object.__setattr__(self, "_by_uid", {u: p for p in self.principals for u in p.uids})
        object.__setattr__(self, "_by_gid", {g: p for p in self.principals for g in p.gids})

    @property
    def restricted(self) -> bool:
        """Principals are configured: every caller must be one of them (or hold a
        bare token), and what it may reach is checked."""
        return bool(self.principals)

    def has_tokens(self) -> bool:
        return bool(self.tokens)

    def for_token(self, offered: str) -> Principal | None:
        """The principal of bearer token ``offered``; None for an unknown token."""
        return self.tokens.get(token_digest(offered))

    def for_unix_peer(self, peer: PeerCredentials) -> Principal:
        """The principal of a Unix-socket peer: the one listing its uid, else the
        one listing one of its groups. Raises ``AccessDenied`` for a peer no
        principal lists, and for one whose groups are listed by two principals."""
        if not self.restricted:
            return UNRESTRICTED
        principal = self._by_uid.get(peer.uid)
        if principal is not None:
            return principal
        listed = [self._by_gid[g] for g in peer.all_groups() if g in self._by_gid]
        matches = {principal.name: principal for principal in listed}
        if len(matches) == 1:
            return next(iter(matches.values()))
        who = peer.describe()
        if not matches:
            raise AccessDenied(
                f"unknown unix peer ({who}): no [[security.principals]] entry lists its uid or "
                "one of its groups",
                principal="",
            )
        raise AccessDenied(
            f"ambiguous unix peer ({who}): its groups make it principals "
            f"{', '.join(sorted(matches))}; list its uid in one of them",
            principal="",
        )

    def for_certificate(self, names: Sequence[str]) -> tuple[Principal, str] | None:
        """``(principal, certificate name)`` of a verified client certificate named
        ``names`` (``identity.tls_peer_names``: CN first, then DNS SANs), or None
        when mTLS is off or the connection carries no certificate. With
        principals configured the CN or one of the DNS SANs must name exactly one
        principal (``AccessDenied`` otherwise)."""
        if not self.client_certificates or not names:
            return None
        if not self.restricted:
            return UNRESTRICTED, names[0]
        matches = [self._by_name[n] for n in dict.fromkeys(names) if n in self._by_name]
        if len(matches) == 1:
            return matches[0], matches[0].name
        listed = ", ".join(names)
        if not matches:
            raise AccessDenied(
                f"the client certificate ({listed}) names no [[security.principals]] entry",
                principal="",
            )
        raise AccessDenied(
            f"the client certificate ({listed}) names several principals "
            f"({', '.join(p.name for p in matches)}); issue one naming a single principal",
            principal="",
        )


def build_authorizer(
    principals: tuple[Principal, ...], tokens_file: str, *, client_certificates: bool = False
) -> Authorizer:
    """An Authorizer for ``principals`` and the tokens in ``tokens_file`` ("" =
    none). Reads the file; raises ``TokensFileError``."""
    tokens: Mapping[bytes, Principal] = {}
    if tokens_file:
        lines = read_token_lines(tokens_file)
        tokens = token_table(tokens_file, lines, by_name(principals))
    return Authorizer(principals, tokens, client_certificates)
