"""SIGHUP: re-read the credential files and swap what was built from them.

Each credential (the tokens, the TLS files) registers one ``reload`` callable
that reads its files, builds the new object and swaps it in only when all of
that worked; on failure it raises (``ConfigError`` for a bad file) and leaves
the old object in place. ``CredentialReloader.reload_all`` runs every one of
them, so a bad certificate does not keep new tokens out, and logs each
outcome: INFO for a swap, ERROR with the reason for a file that was refused
("keeping the previous ...").

Sessions and connections are never touched: a call already authorized runs
to its end, a TLS connection keeps the certificate it negotiated, and only
what comes next (a new call's token, a new handshake) meets the new
credentials. Event-loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvtierd.errors import ConfigError
from kvtierd.security.tls import ServerTls
from kvtierd.security.tokens import TokensFileError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    """What one ``reload_all`` did: the credentials swapped and, for each one
    kept as it was, why."""

    reloaded: tuple[str, ...]
    refused: tuple[tuple[str, str], ...]  # (what, why)

    @property
    def ok(self) -> bool:
        return not self.refused


class CredentialReloader:
    """The credentials SIGHUP re-reads, in registration order."""

    def __init__(self) -> None:
        self._parts: list[tuple[str, Callable[[], None]]] = []

    def add(self, what: str, reload: Callable[[], None]) -> None:
        """Registers ``reload`` under ``what`` (a log name: "tokens", "TLS").
        ``reload`` must swap in the new object only if it raises nothing."""
        self._parts.append((what, reload))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(what for what, _ in self._parts)

    def reload_all(self) -> ReloadOutcome:
        """Runs every registered reload, each whatever the others did."""
        reloaded: list[str] = []
        refused: list[tuple[str, str]] = []
        for what, reload in self._parts:
            try:
                reload()
            except ConfigError as exc:  # a bad file: its reason is the whole story
                refused.append((what, str(exc)))
                log.error("SIGHUP: keeping the previous %s: %s", what, exc)
            except Exception as exc:  # a bug: keep serving with what works
                refused.append((what, f"{type(exc).__name__}: {exc}"))
                log.exception("SIGHUP: keeping the previous %s: reloading failed", what)
            else:
                reloaded.append(what)
                log.info("SIGHUP: %s reloaded", what)
        if not self._parts:
            log.info("SIGHUP: no credential files configured; nothing to reload")
        return ReloadOutcome(tuple(reloaded), tuple(refused))


def credential_reloader(
    tokens_file: str,
    reload_tokens: Callable[[], None],
    tls: ServerTls | None,
) -> CredentialReloader:
    """The daemon's reloads: the tokens file (when configured) through
    ``reload_tokens`` (``SecurityState.reload_tokens``: the daemon's one token
    store is its Authorizer, rebuilt whole and swapped in), then the TLS files
    (when TLS is on)."""
    reloader = CredentialReloader()
    if tokens_file:
        reloader.add("tokens", _tokens_reload(reload_tokens))
    if tls is not None:
        reloader.add("TLS certificate, key and client CAs", tls.reload)
    return reloader


def _tokens_reload(reload_tokens: Callable[[], None]) -> Callable[[], None]:
    """``reload_tokens`` with an unusable file reported as the ``ConfigError`` of
    ``security.tokens_file`` (a refused file, not a bug)."""

    def reload() -> None:
        try:
            reload_tokens()
        except TokensFileError as exc:
            raise ConfigError("security.tokens_file", str(exc)) from None

    return reload
