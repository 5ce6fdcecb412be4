"""The settings of one ``type = "redis"`` tier, declared once in :class:`RedisTierSettings`.

As for the fs tier (:mod:`kvtierd.tiers.fs.settings`), everything else derives
from the dataclass: the options the parser accepts, ``kvtierd --help``, and the
configuration reference's table (:func:`options_markdown`,
docs/reference/configuration.md). Parsing is pure: no connection is made until a
pool's tier runs its first job.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.tiers.configured import TierOptionError
from kvtierd.tiers.iopool import DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_JOBS
from kvtierd.tiers.options import (
    help_lines,
    markdown_table,
    option,
    parse_key_options,
    read_int,
    read_size,
    read_str,
    size_text,
)
from kvtierd.util.units import parse_duration

CLUSTER_MODES = ("auto", "true", "false")
URL_SCHEMES = ("redis", "rediss")
MAX_THREADS = 256
MAX_QUEUE_JOBS = 1 << 20
MIN_QUEUE_BYTES = 4096
MAX_KEY_PREFIX = 64
TLS_OPTIONS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
MIN_FLEET_CAPACITY = 1 << 20
_SIZE_OPTIONS = frozenset({"capacity", "fleet_capacity", "max_queue_bytes"})
_DURATION_OPTIONS = frozenset({"ttl", "timeout", "presence_ttl", "info_interval"})


@dataclass(frozen=True, slots=True)
class RedisTierSettings:
    """One ``type = "redis"`` tier. The defaults below are the only place they are written."""

    urls: tuple[str, ...] = option(
        ("redis://127.0.0.1:6379",), "seed nodes, redis:// or rediss:// (TLS) URLs"
    )
    cluster: str = option(
        "auto",
        "true (a Redis/Valkey Cluster seeded with every URL), false (one standalone "
        'server, the first URL) or "auto" (ask the server: INFO cluster)',
    )
    username: str = option("", "ACL user name, empty for the default user")
    password_file: str = option(
        "", "file holding the AUTH / ACL password (not readable by others), empty for none"
    )
    tls_ca_file: str = option(
        "",
        "rediss:// only: CA certificates (PEM) that sign the servers' certificates, empty for "
        "the system's; a server's certificate must name the host of its URL (or the address "
        "a Cluster announces)",
    )
    tls_cert_file: str = option(
        "", "rediss:// only: client certificate (PEM) for a server that asks for one"
    )
    tls_key_file: str = option(
        "", "rediss:// only: the client certificate's private key (not readable by others)"
    )
    key_prefix: str = option("kvtierd", "prefix of every key this tier writes")
    ttl: float = option(0.0, "expiry of every value, 0s for none (the server's maxmemory evicts)")
    capacity: int = option(
        0,
        "bytes of blocks each pool keeps in the server, its least recently used deleted "
        "first; 0 for no limit of its own (the server's maxmemory policy evicts)",
    )
    fleet_capacity: int = option(
        0,
        "bytes of each pool's blocks in the server counted over every daemon that shares "
        "it, the least recently used by any of them deleted first (an exact LRU kept in the "
        "server, docs/guides/fleet.md); every daemon of a fleet sets the same value; 0 for "
        "none (the server's maxmemory policy evicts)",
    )
    timeout: float = option(2.0, "connect and socket timeout of every Redis call")
    presence_ttl: float = option(
        1.0, "how long a lookup trusts a batched EXISTS answer about a key it did not store"
    )
    info_interval: float = option(
        5.0, "how often the server's health is checked (nodes, round trips, memory, evictions)"
    )
    threads: int = option(8, "I/O threads (connections) moving blocks and probing keys")
    max_queue_bytes: int = option(
        DEFAULT_QUEUE_BYTES, "cascade bytes queued before new cascade writes are dropped"
    )
    max_queue_jobs: int = option(
        DEFAULT_QUEUE_JOBS, "cascade jobs queued before new cascade writes are dropped"
    )
    integrity_key_file: str = option(
        "",
        "file of 32 random bytes (mode 0600) the daemons of a fleet share: every value is "
        "sealed with a MAC under it and a value not sealed under this tier's keys is a MISS; "
        "required unless the server is written by this fleet alone (docs/security.md)",
    )
    integrity_verify_key_file: str = option(
        "", "a second key whose values verify too (never used to write): a key rotation"
    )

    def exclusive(self) -> Mapping[str, object]:
        """Two configured tiers on one server with one prefix would evict each other's keys."""
        return {"key_prefix": f"{self.key_prefix} on {', '.join(self.urls)}"}

    def describe(self) -> str:
        return f"redis at {', '.join(_redact(u) for u in self.urls)}, prefix {self.key_prefix!r}"


OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RedisTierSettings))
DEFAULTS = RedisTierSettings()


def default(option: str) -> Any:
    for f in dataclasses.fields(RedisTierSettings):
        if f.name == option:
            return f.default
    raise KeyError(f"no redis tier option {option!r}")


def format_default(option: str) -> str:
    """The default of ``option`` as written in a TOML file."""
    value = default(option)
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    if option in _DURATION_OPTIONS:
        return f'"{value:g}s"'
    if option in _SIZE_OPTIONS:
        return f'"{size_text(value)}"' if value else '"0"'
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def option_help() -> dict[str, str]:
    """Each option's help with its default (or "required"), in declaration order."""
    return help_lines(RedisTierSettings, format_default)


def options_markdown() -> str:
    """The docs' table of redis tier options (docs/reference/configuration.md)."""
    return markdown_table(RedisTierSettings, format_default)


def _redact(url: str) -> str:
    """``url`` without a password in it (for logs)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def parse_redis_settings(options: Mapping[str, Any]) -> RedisTierSettings:
    """Validates a redis tier's options; raises TierOptionError naming the option."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TierOptionError(
            unknown[0], f"unknown redis tier option; known: {', '.join(sorted(OPTIONS))}"
        )
    values: dict[str, Any] = {}
    if "urls" in options:
        urls = options["urls"]
        if isinstance(urls, str):
            urls = [urls]
        if not isinstance(urls, list | tuple) or not urls:
            raise TierOptionError("urls", f"expected a list of redis:// URLs, got {urls!r}")
        for url in urls:
            _check_url(url)
        values["urls"] = tuple(urls)
    if "cluster" in options:
        mode = options["cluster"]
        mode = ("true" if mode else "false") if isinstance(mode, bool) else mode
        if mode not in CLUSTER_MODES:
            raise TierOptionError("cluster", f'expected true, false or "auto", got {mode!r}')
        values["cluster"] = mode
    if "username" in options:
        values["username"] = read_str(options, "username")
    for name in ("password_file", *TLS_OPTIONS):
        if name in options:
            path = read_str(options, name)
            if path and not os.path.isabs(path):
                raise TierOptionError(name, f"expected an absolute path, got {path!r}")
            values[name] = path
    _check_tls(values)
    if "key_prefix" in options:
        prefix = read_str(options, "key_prefix")
        if not prefix or len(prefix) > MAX_KEY_PREFIX or not prefix.isprintable():
            raise TierOptionError(
                "key_prefix", f"expected 1 to {MAX_KEY_PREFIX} printable characters, got {prefix!r}"
            )
        values["key_prefix"] = prefix
    for key in _DURATION_OPTIONS & set(options):
        try:
            seconds = parse_duration(options[key])
        except ValueError as exc:
            raise TierOptionError(key, str(exc)) from None
        if seconds < 0 or (key != "ttl" and seconds <= 0) or (key == "ttl" and 0 < seconds < 1e-3):
            raise TierOptionError(key, f"out of range: {options[key]!r}")
        values[key] = seconds
    if "capacity" in options:
        values["capacity"] = read_size(options, "capacity")
    if "fleet_capacity" in options:
        values["fleet_capacity"] = read_size(
            options, "fleet_capacity", minimum=MIN_FLEET_CAPACITY, zero_allowed=True
        )
    if "max_queue_bytes" in options:
        values["max_queue_bytes"] = read_size(options, "max_queue_bytes", minimum=MIN_QUEUE_BYTES)
    if "threads" in options:
        values["threads"] = read_int(options, "threads", 1, MAX_THREADS)
    if "max_queue_jobs" in options:
        values["max_queue_jobs"] = read_int(options, "max_queue_jobs", 1, MAX_QUEUE_JOBS)
    values.update(parse_key_options(options))
    return RedisTierSettings(**values)


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
    if not isinstance(url, str):
        raise TierOptionError("urls", f"expected a URL string, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in URL_SCHEMES or not parts.hostname:
        raise TierOptionError("urls", f"expected redis://host:port or rediss://, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise TierOptionError("urls", f"bad port in {_redact(url)!r}") from None


if __name__ == "__main__":  # prints the docs table: python -m kvtierd.tiers.redis.settings
    print(options_markdown(), end="")
