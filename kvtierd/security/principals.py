"""Principals: who calls, which pools they may reach, and how much memory those take.

A principal is configured in ``[[security.principals]]`` (docs/security.md,
"Principals and per-pool authorization"; the keys' table there is ``PRINCIPAL_HELP``)::

    name = "team-a"
    uids = [1001]          # Unix-socket peers with these uids ...
    gids = []              # ... or in one of these groups are this principal
    pools = ["team-a/*"]   # glob patterns of pool names it may open, flush, watch, stat
    memory_quota = "8GiB"  # the regions of the pools its patterns match, together

Parsing is pure (no filesystem, no user database): it runs when the
configuration is loaded, so a bad table stops the daemon with exit code 2
before anything starts. ``Principal`` is immutable; a configuration's
principals never change while the daemon runs (a reload of tokens or
certificates maps callers onto the same principals).

Patterns are ``fnmatch`` globs matched case-sensitively against the whole
pool name; ``*`` also matches ``/`` (``team-a/*`` covers ``team-a/x/y``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtierd.util.units import parse_size

# The keys of one [[security.principals]] table, with the help the docs' table shows.
PRINCIPAL_HELP: dict[str, str] = {
    "name": "the principal's name ([A-Za-z0-9._@:-], at most 128): what a tokens-file line "
    "'TOKEN PRINCIPAL' and a client certificate's CN or DNS SAN name; required",
    "uids": "Unix-socket peers with one of these uids are this principal (default: none)",
    "gids": "... or peers with one of these groups, primary or supplementary (default: none)",
    "pools": "glob patterns of the pool names it may open, flush, watch, explain and stat "
    "('*' also matches '/'); required",
    "memory_quota": "bytes the regions of the pools its patterns match may take together, "
    "0 for the memory budget only (default 0)",
}
PRINCIPAL_KEYS = tuple(PRINCIPAL_HELP)
# A principal's name appears in token files, certificates (CN, DNS SAN), log lines
# and error messages: printable, no spaces, no glob characters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")
MAX_ID = (1 << 32) - 2  # uid_t / gid_t; (uid_t)-1 means "no id"
MAX_PATTERNS = 256


class PrincipalOptionError(ValueError):
    """A bad ``[[security.principals]]`` table; ``key`` is the dotted key below
    ``security`` (``principals[0].uids``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


@dataclass(frozen=True, slots=True)
class Principal:
    """One caller identity and what it may reach.

    ``pools`` are glob patterns; ``memory_quota`` is in bytes, 0 = bounded by the
    global budget only. ``uids`` / ``gids`` name the Unix-socket peers that are
    this principal (empty for principals reached by token or certificate only).
    """

    name: str
    pools: tuple[str, ...]
    memory_quota: int = 0
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    # the patterns as one compiled regex (``fullmatch`` of any pattern)
    _matcher: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alternatives = "|".join(f"(?:{fnmatch.translate(p)})" for p in self.pools) or "(?!)"
        object.__setattr__(self, "_matcher", re.compile(alternatives))

    def may_reach(self, pool: str) -> bool:
        """Whether one of this principal's patterns matches ``pool``."""
        return self._matcher.match(pool) is not None

    def describe_pools(self) -> str:
        return ", ".join(self.pools) or "(none)"


# The principal of a caller that may reach every pool: a Unix-socket peer when no
# principals are configured (the socket's permissions decided), and a bearer token
# listed without a principal ("TOKEN" lines, as before principals existed).
UNRESTRICTED = Principal(name="*", pools=("*",))


def parse_principals(raw: Any) -> tuple[Principal, ...]:
    """The ``[[security.principals]]`` array, validated: names unique, a uid or a
    gid in one principal at most (a peer must never match two principals by the
    same id). Raises ``PrincipalOptionError`` naming the key."""
    if not isinstance(raw, list):
        raise PrincipalOptionError(
            "principals", "must be an array of tables ([[security.principals]])"
        )
    principals: list[Principal] = []
    uid_owner: dict[int, str] = {}
    gid_owner: dict[int, str] = {}
    for index, table in enumerate(raw):
        key = f"principals[{index}]"
        principal = _parse_one(key, table)
        if any(p.name == principal.name for p in principals):
            raise PrincipalOptionError(
                f"{key}.name", f"duplicate principal name {principal.name!r}"
            )
        _claim_ids(f"{key}.uids", "uid", principal, principal.uids, uid_owner)
        _claim_ids(f"{key}.gids", "gid", principal, principal.gids, gid_owner)
        principals.append(principal)
    return tuple(principals)


def _parse_one(key: str, table: Any) -> Principal:
    if not isinstance(table, dict):
        raise PrincipalOptionError(key, "must be a table")
    unknown = sorted(set(table) - set(PRINCIPAL_KEYS))
    if unknown:
        raise PrincipalOptionError(
            f"{key}.{unknown[0]}", f"unknown key; known: {', '.join(PRINCIPAL_KEYS)}"
        )
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise PrincipalOptionError(
            f"{key}.name",
            f"must be 1-128 characters of [A-Za-z0-9._@:-] starting with a letter or digit "
            f"(it is matched against tokens and certificate names), got {name!r}",
        )
    pools = _patterns(f"{key}.pools", table.get("pools"))
    try:
        quota = parse_size(table.get("memory_quota", 0))
    except ValueError as exc:
        raise PrincipalOptionError(f"{key}.memory_quota", str(exc)) from None
    return Principal(
        name=name,
        pools=pools,
        memory_quota=quota,
        uids=_ids(f"{key}.uids", table.get("uids", [])),
        gids=_ids(f"{key}.gids", table.get("gids", [])),
    )


def _patterns(key: str, raw: Any) -> tuple[str, ...]:
    if raw is None:
        raise PrincipalOptionError(
            key, 'missing: the pool name patterns it may reach (["team-a/*"])'
        )
    if not isinstance(raw, list) or len(raw) > MAX_PATTERNS:
        raise PrincipalOptionError(key, f"must be a list of at most {MAX_PATTERNS} glob patterns")
    for pattern in raw:
        if not isinstance(pattern, str) or not pattern or len(pattern.encode()) > 512:
            raise PrincipalOptionError(
                key, f"a pattern must be a non-empty string of at most 512 bytes, got {pattern!r}"
            )
    return tuple(raw)


def _ids(key: str, raw: Any) -> frozenset[int]:
    if not isinstance(raw, list):
        raise PrincipalOptionError(key, f"must be a list of numeric ids, got {raw!r}")
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
            raise PrincipalOptionError(key, f"ids are integers in [0, {MAX_ID}], got {value!r}")
    return frozenset(raw)


def _claim_ids(
    key: str, kind: str, principal: Principal, ids: frozenset[int], owners: dict[int, str]
) -> None:
    for value in sorted(ids):
        owner = owners.setdefault(value, principal.name)
        if owner != principal.name:
            raise PrincipalOptionError(
                key,
                f"{kind} {value} is already principal {owner!r}'s; a {kind} names one principal",
            )


def by_name(principals: Sequence[Principal]) -> Mapping[str, Principal]:
    return {p.name: p for p in principals}
