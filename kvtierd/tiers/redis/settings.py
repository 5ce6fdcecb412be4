"""The settings of one ``type = "redis"`` tier, declared once in :class:`RedisTierSettings`.

As for the fs tier (:mod:`kvtierd.tiers.fs.settings`), everything else derives
from the dataclass: the table :data:`OPTIONS` the parser reads with, ``kvtierd
--help``, and the configuration reference's table (docs/reference/configuration.md).
Parsing is pure: no connection is made until a pool's tier runs its first job.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.tiers import options
from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.options import TEXT, AbsolutePath, Choice, Reader, Seconds, Size, Whole, option

CLUSTER_MODES = ("auto", "true", "false")
URL_SCHEMES = ("redis", "rediss")
MAX_THREADS = 256
MAX_KEY_PREFIX = 64
TLS_OPTIONS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
MIN_FLEET_CAPACITY = 1 << 20
_POSITIVE = Seconds(positive=True)


class Urls(Reader):
    """redis:// or rediss:// URLs: a list, or one string."""

    def read(self, value: Any) -> tuple[str, ...]:
        urls = [value] if isinstance(value, str) else value
        if not isinstance(urls, list | tuple) or not urls:
            raise ValueError(f"expected a list of redis:// URLs, got {urls!r}")
        for url in urls:
            _check_url(url)
        return tuple(urls)


class KeyPrefix(Reader):
    """1 to :data:`MAX_KEY_PREFIX` printable characters."""

    def read(self, value: Any) -> str:
        prefix: str = TEXT.read(value)
        if not prefix or len(prefix) > MAX_KEY_PREFIX or not prefix.isprintable():
            raise ValueError(f"expected 1 to {MAX_KEY_PREFIX} printable characters, got {prefix!r}")
        return prefix


_SEALING_KEY_HELP = (  # integrity_key_file
    "file of 32 random bytes (mode 0600) the daemons of a fleet share: every value is "
    "sealed with a MAC under it and a value not sealed under this tier's keys is a MISS; "
    "required unless the server is written by this fleet alone (docs/security.md)"
)


@dataclass(frozen=True, slots=True)
class RedisTierSettings:
    """One ``type = "redis"`` tier. The defaults below are the only place they are written."""

    urls: tuple[str, ...] = option(
        ("redis://127.0.0.1:6379",), "seed nodes, redis:// or rediss:// (TLS) URLs", Urls()
    )
    cluster: str = option(
        "auto",
        "true (a Redis/Valkey Cluster seeded with every URL), false (one standalone "
        'server, the first URL) or "auto" (ask the server: INFO cluster)',
        Choice(CLUSTER_MODES, ("true", "false"), 'true, false or "auto"'),
    )
    username: str = option("", "ACL user name, empty for the default user", TEXT)
    password_file: str = option(
        "",
        "file holding the AUTH / ACL password (not readable by others), empty for none",
        AbsolutePath(),
    )
    tls_ca_file: str = option(
        "",
        "rediss:// only: CA certificates (PEM) that sign the servers' certificates, empty for "
        "the system's; a server's certificate must name the host of its URL (or the address "
        "a Cluster announces)",
        AbsolutePath(),
    )
    tls_cert_file: str = option(
        "",
        "rediss:// only: client certificate (PEM) for a server that asks for one",
        AbsolutePath(),
    )
    tls_key_file: str = option(
        "",
        "rediss:// only: the client certificate's private key (not readable by others)",
        AbsolutePath(),
    )
    key_prefix: str = option("kvtierd", "prefix of every key this tier writes", KeyPrefix())
    ttl: float = option(
        0.0,
        "expiry of every value, 0s for none (the server's maxmemory evicts)",
        Seconds(1e-3, zero_allowed=True),
    )
    capacity: int = option(
        0,
        "bytes of blocks each pool keeps in the server, its least recently used deleted "
        "first; 0 for no limit of its own (the server's maxmemory policy evicts)",
        Size(),
    )
    fleet_capacity: int = option(
        0,
        "bytes of each pool's blocks in the server counted over every daemon that shares "
        "it, the least recently used by any of them deleted first (an exact LRU kept in the "
        "server, docs/guides/fleet.md); every daemon of a fleet sets the same value; 0 for "
        "none (the server's maxmemory policy evicts)",
        Size(minimum=MIN_FLEET_CAPACITY, zero_allowed=True),
    )
    timeout: float = option(2.0, "connect and socket timeout of every Redis call", _POSITIVE)
    presence_ttl: float = option(
        1.0,
        "how long a lookup trusts a batched EXISTS answer about a key it did not store",
        _POSITIVE,
    )
    info_interval: float = option(
        5.0,
        "how often the server's health is checked (nodes, round trips, memory, evictions)",
        _POSITIVE,
    )
    threads: int = option(
        8, "I/O threads (connections) moving blocks and probing keys", Whole(1, MAX_THREADS)
    )
    max_queue_bytes: int = options.queued_bytes_option()
    max_queue_jobs: int = options.queued_jobs_option()
    max_write_bytes_per_s: int = options.write_budget_option()
    integrity_key_file: str = options.sealing_key_option(_SEALING_KEY_HELP)
    integrity_verify_key_file: str = options.verifying_key_option("values")
    admission: str = options.admission_option()

    def exclusive(self) -> Mapping[str, object]:
        """Two configured tiers on one server with one prefix would evict each other's keys."""
        return {"key_prefix": f"{self.key_prefix} on {', '.join(self.urls)}"}

    def describe(self) -> str:
        return f"redis at {', '.join(_redact(u) for u in self.urls)}, prefix {self.key_prefix!r}"


OPTIONS = options.tier_options(RedisTierSettings)
"""The redis tier's options, in declaration order (:class:`~kvtierd.tiers.options.TierOption`)."""
DEFAULTS = RedisTierSettings()


def parse_redis_settings(given: Mapping[str, Any]) -> RedisTierSettings:
    """Validates a redis tier's options; raises TierOptionError naming the option."""
    values = options.read_options(OPTIONS, given, "redis")
    _check_tls(values)
    options.check_key_options(values)
    return RedisTierSettings(**values)


def _redact(url: str) -> str:
    """``url`` without a password in it (for logs)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def _check_tls(values: Mapping[str, Any]) -> None:
    """One scheme for every URL; TLS files only for rediss://; a client certificate
    with its key."""
    schemes = {urllib.parse.urlsplit(url).scheme for url in values.get("urls", DEFAULTS.urls)}
    if len(schemes) > 1:
        raise TierOptionError("urls", "mixes redis:// and rediss://: one scheme for all nodes")
    for name in TLS_OPTIONS:
        if values.get(name) and schemes != {"rediss"}:
            raise TierOptionError(name, "set, but the urls are redis:// (no TLS): use rediss://")
    if bool(values.get("tls_cert_file")) != bool(values.get("tls_key_file")):
        missing = "tls_key_file" if values.get("tls_cert_file") else "tls_cert_file"
        raise TierOptionError(missing, "a client certificate needs both tls_cert_file and "
                              "tls_key_file")  # fmt: skip


def _check_url(url: object) -> None:
    """ValueError unless ``url`` is a redis:// or rediss:// URL with a host."""
    if not isinstance(url, str):
        raise ValueError(f"expected a URL string, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in URL_SCHEMES or not parts.hostname:
        raise ValueError(f"expected redis://host:port or rediss://, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"bad port in {_redact(url)!r}") from None
