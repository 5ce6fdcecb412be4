"""The daemon's configuration: one frozen tree, built once from defaults, a TOML
file, ``KVTIERD_<SECTION>_<KEY>`` environment variables and command-line flags
(later sources win), validated once, then passed down. Nothing else in the
daemon reads the environment.

Every scalar option is declared once in ``OPTIONS`` (section, key, parser, help,
flag); the CLI and the environment names are derived from that table.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.errors import ConfigError as ConfigError
from kvtierd.records.events import KEY_OVERHEAD_BYTES, MAX_EVENT_BYTES
from kvtierd.records.history import KEY_OVERHEAD_BYTES as REMOVAL_OVERHEAD_BYTES
from kvtierd.security import config as security_config
from kvtierd.security.config import SecurityConfig, SecurityOptionError
from kvtierd.tiers import registry
from kvtierd.tiers.configured import TierOptionError, TierSettings
from kvtierd.util.units import (
    format_bytes,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)
from kvtierd_client.wire.address import default_socket_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

LOG_LEVELS = ("debug", "info", "warning", "error")
EVICTION_POLICIES = ("lru", "arc")
MAX_BLOCK_BYTES = 1 << 30
# a Lookup waits at most this long for remote tiers (limits.remote_lookup_wait): longer
# than a scheduler step, an engine would rather recompute
MAX_REMOTE_LOOKUP_WAIT = 1.0


# --------------------------------------------------------------------------- values


def _int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {value!r}") from None
        if not lo <= number <= hi:
            raise ValueError(f"must be in [{lo}, {hi}], got {number}")
        return number

    return parse


class _SizeIn:
    """A size option's parser: bytes in [lo, hi] (``units.parse_size``)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, value: Any) -> int:
        number = parse_size(value)
        if not self.lo <= number <= self.hi:
            raise ValueError(
                f"must be between {format_bytes(self.lo)} and {format_bytes(self.hi)}, "
                f"got {value!r}"
            )
        return number

    @staticmethod
    def show(value: int) -> str:
        return format_size(value)


class _DurationIn:
    """A duration option's parser: seconds in [lo, hi] (``units.parse_duration``)."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def __call__(self, value: Any) -> float:
        seconds = parse_duration(value)
        if not self.lo <= seconds <= self.hi:
            raise ValueError(f"must be between {self.lo:g}s and {self.hi:g}s, got {value!r}")
        return seconds

    @staticmethod
    def show(value: float) -> str:
        return format_duration(value)


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return text

    return parse


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _abs_file_or_empty(value: Any) -> str:
    text = _text(value)
    if text and not os.path.isabs(text):
        raise ValueError(f"expected an absolute file path or '', got {value!r}")
    return text


def _directory(value: Any) -> str:
    text = _text(value)
    if not text or not os.path.isabs(text):
        raise ValueError(f"expected an absolute directory path, got {value!r}")
    return text


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


# sockaddr_un.sun_path holds 107 bytes and a NUL; the daemon also binds sockets named
# <path> + ".regions" / ".tickets" / ".lane" (region_access, tickets, fastlane)
_MAX_UNIX_PATH_BYTES = 107 - len(".regions")


def parse_listen_address(value: str) -> str:
    """A normalized listen address: ``unix:///abs/path`` (at most
    :data:`_MAX_UNIX_PATH_BYTES` bytes, so the sockets next to it fit too) or
    ``host:port``."""
    text = _text(value).strip()
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if not os.path.isabs(path):
            raise ValueError(f"a unix socket path must be absolute, got {value!r}")
        if len(os.fsencode(path)) > _MAX_UNIX_PATH_BYTES:
            raise ValueError(
                f"a unix socket path is at most {_MAX_UNIX_PATH_BYTES} bytes (the sockets "
                f"next to it add '.regions' within the kernel's 107), got "
                f"{len(os.fsencode(path))}: {path!r}; use a shorter directory"
            )
        return "unix://" + path
    match = _HOST_PORT.match(text)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"expected 'unix:///abs/path' or 'HOST:PORT', got {value!r}")
    return text


def _listen_list(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError("expected a non-empty list of 'unix:///abs/path' or 'HOST:PORT'")
    return tuple(parse_listen_address(item) for item in items)


def _metrics_address(value: Any) -> str:
    text = _text(value).strip()
    if text and _HOST_PORT.match(text) is None:
        raise ValueError(f"expected 'HOST:PORT' or '' (off), got {value!r}")
    return text


MAX_POOL_LABEL_PATTERNS = 256


def _pool_label_patterns(value: Any) -> tuple[str, ...] | None:
    """``server.metrics_pool_labels``: "auto" (None: decided by whether principals are
    configured), or pool name globs: a TOML list, or a comma-separated string
    (environment, flag; "" shows no pool)."""
    if value == "auto":
        return None
    items = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) > MAX_POOL_LABEL_PATTERNS:
        raise ValueError(
            f'expected "auto" or a list of at most {MAX_POOL_LABEL_PATTERNS} pool name globs '
            f'(["team-a/*"]), got {value!r}'
        )
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= 256:
            raise ValueError(f"expected pool name globs of 1 to 256 characters, got {item!r}")
    return tuple(items)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class Option:
    """One scalar configuration key, declared once."""

    section: str
    key: str
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    help: str
    flag: str | None = None  # command-line flag, when this key has one
    repeatable: bool = False  # flag may be given several times (lists)

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env(self) -> str:
        return f"KVTIERD_{self.section}_{self.key}".upper()

    def default_text(self) -> str:
        """The default as the configuration would write it (``--help``): '1GiB',
        '10s', 'true', '' for an empty string. Computed now: the default socket
        depends on the user and ``$XDG_RUNTIME_DIR``."""
        value = self.default()
        show = getattr(self.parse, "show", None)
        if show is not None:
            return str(show(value))
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, tuple):
            return ", ".join(value)
        return repr(value) if value == "" else str(value)


OPTIONS: tuple[Option, ...] = (
    Option(
        "server",
        "listen",
        _listen_list,
        lambda: ("unix://" + default_socket_path(),),
        "address to serve on: unix:///abs/path or HOST:PORT (TCP needs tokens)",
        flag="--listen",
        repeatable=True,
    ),
    Option(
        "server",
        "metrics_address",
        _metrics_address,
        lambda: "127.0.0.1:9464",
        "Prometheus endpoint HOST:PORT ('' turns it off)",
        flag="--metrics-address",
    ),
    Option(
        "server",
        "metrics_pool_labels",
        _pool_label_patterns,
        lambda: None,
        "pools whose series the metrics endpoint shows (with their names): 'auto' (every "
        "pool, none when [[security.principals]] are configured: the endpoint asks no "
        "identity) or pool name globs, comma-separated on the command line ('' for none)",
        flag="--metrics-pool-labels",
    ),
    Option(
        "server",
        "socket_group",
        _text,
        lambda: "",
        "group owning the Unix socket and region files ('' = the daemon's group)",
        flag="--socket-group",
    ),
    Option(
        "server",
        "shutdown_grace",
        _DurationIn(0.0, 300.0),
        lambda: 5.0,
        "how long in-flight calls may finish after SIGTERM",
        flag="--shutdown-grace",
    ),
    Option(
        "server",
        "fast_lane",
        _bool,
        lambda: True,
        "offer each session opened over a Unix socket a fast lane for its hot calls (Lookup, "
        "Touch, Prepare/Complete Load/Store, Batch, KeepAlive): framed protobuf on the "
        "'<socket>.lane' socket next to it; false: every call goes through gRPC",
        flag="--fast-lane",
    ),
    Option(
        "memory",
        "shm_dir",
        _directory,
        lambda: "/dev/shm",
        "directory of the region files and warm-restart journals (a tmpfs); created, the "
        "daemon's own (0750, or 0700 with principals), when missing: give it a private "
        "directory such as /dev/shm/kvtierd, not a shared one such as /dev/shm itself",
        flag="--shm-dir",
    ),
    Option(
        "memory",
        "budget",
        _SizeIn(4096, 1 << 50),
        lambda: 1 << 30,
        "bytes of shared memory for all pools' regions together",
        flag="--memory-budget",
    ),
    Option(
        "memory",
        "default_pool_blocks",
        _int_in(1, 1 << 31),
        lambda: 1024,
        "pool capacity in blocks when OpenSession asks for 0",
        flag="--default-pool-blocks",
    ),
    Option(
        "memory",
        "prefault",
        _bool,
        lambda: True,
        "populate region pages at creation (no page faults on the copy path)",
        flag="--prefault",
    ),
    Option(
        "memory",
        "warm_restart",
        _bool,
        lambda: True,
        "keep region files and a journal at stop so the next daemon adopts every ready "
        "block (verified by checksum) instead of starting the pool empty",
        flag="--warm-restart",
    ),
    Option(
        "memory",
        "warm_restart_checksum_bytes",
        _SizeIn(0, 1 << 30),
        lambda: 64 << 10,
        "bytes of each completed row the warm-restart checksum covers: the whole row if "
        "it is not larger (0: always the whole row), else evenly spaced 4 KiB pages "
        "including the first and last",
        flag="--warm-restart-checksum-bytes",
    ),
    Option(
        "sessions",
        "lease",
        _DurationIn(0.1, 3600.0),
        lambda: 10.0,
        "a session not kept alive this long is closed and its pins released",
        flag="--lease",
    ),
    Option(
        "sessions",
        "write_quarantine",
        _DurationIn(0.0, 3600.0),
        lambda: 10.0,
        "how long the rows of a store left unfinished by an expired or closed session "
        "stay unused (its writer may still be copying into them)",
        flag="--write-quarantine",
    ),
    Option(
        "sessions",
        "max_sessions",
        _int_in(1, 1 << 20),
        lambda: 4096,
        "open sessions at most",
        flag="--max-sessions",
    ),
    Option(
        "limits",
        "max_keys_per_call",
        _int_in(1, 1 << 20),
        lambda: 65536,
        "keys in one RPC at most",
        flag="--max-keys-per-call",
    ),
    Option(
        "limits", "max_pools", _int_in(1, 4096), lambda: 64, "pools at most", flag="--max-pools"
    ),
    Option(
        "limits",
        "events_retained",
        _int_in(16, 1 << 24),
        lambda: 65536,
        "events each pool keeps for TakeEvents / WatchEvents",
        flag="--events-retained",
    ),
    Option(
        "limits",
        "promotion_hold",
        _DurationIn(0.0, 600.0),
        lambda: 2.0,
        "how long a block promoted from a secondary tier for a Lookup (and the ready "
        "blocks that Lookup waits with) stays pinned for the engine that asked, unless a "
        "session pins it first; held blocks are never evicted ('0s' turns holds off)",
        flag="--promotion-hold",
    ),
    Option(
        "limits",
        "remote_lookup_wait",
        _DurationIn(0.0, MAX_REMOTE_LOOKUP_WAIT),
        lambda: 0.005,
        "how long a Lookup whose keys miss the primary and every local tier may wait for "
        "the remote tiers (redis, a shared fs root) to say whether they hold them: what "
        "they hold answers HIT_PENDING in that Lookup; past the wait it answers MISS and "
        "the probe goes on for the next Lookup ('0s': never wait, always that path)",
        flag="--remote-lookup-wait",
    ),
    Option(
        "limits",
        "events_retained_bytes",
        # at most 1 GiB: one TakeEvents answer may carry them all, and gRPC and
        # protobuf messages stay below 2 GiB
        _SizeIn(MAX_EVENT_BYTES, 1 << 30),
        lambda: 64 << 20,
        "bytes of events each pool keeps for TakeEvents / WatchEvents (keys plus "
        f"{KEY_OVERHEAD_BYTES} bytes per key); the oldest go first, as for events_retained",
        flag="--events-retained-bytes",
    ),
    Option(
        "limits",
        "removals_retained_bytes",
        _SizeIn(64 << 10, 1 << 40),
        lambda: 16 << 20,
        "bytes of recent removals each pool remembers for Explain (keys plus "
        f"{REMOVAL_OVERHEAD_BYTES} bytes per key)",
        flag="--removals-retained-bytes",
    ),
    Option(
        "limits",
        "max_watch_streams",
        _int_in(1, 1 << 16),
        lambda: 64,
        "WatchEvents streams open at once (all pools); more are refused with RESOURCE_EXHAUSTED",
        flag="--max-watch-streams",
    ),
    Option(
        "limits",
        "watch_write_timeout",
        _DurationIn(0.05, 3600.0),
        lambda: 10.0,
        "a WatchEvents stream whose client has not taken an event for this long ends "
        "with OUT_OF_RANGE; a fast lane whose client leaves its answers unread this long, "
        "or takes longer than this to send one frame, is cut (its session is left to its "
        "lease)",
        flag="--watch-write-timeout",
    ),
    *(
        Option(security_config.SECTION, o.key, _abs_file_or_empty, lambda: "", o.help, flag=o.flag)
        for o in security_config.FILE_OPTIONS
    ),
    Option(
        "log",
        "level",
        _choice(*LOG_LEVELS),
        lambda: "info",
        "log level: " + ", ".join(LOG_LEVELS),
        flag="--log-level",
    ),
)

SECTIONS = ("server", "memory", "sessions", "limits", "security", "log", "tiers")


# --------------------------------------------------------------------------- tree


@dataclass(frozen=True, slots=True)
class ServerConfig:
    listen: tuple[str, ...]  # normalized listen addresses
    metrics_address: str  # "" = off
    socket_group: str  # "" = the daemon's own group
    shutdown_grace: float  # seconds
    fast_lane: bool = True  # offer sessions the '<socket>.lane' fast lane (kvtierd.api.fastlane)
    # pool globs whose series /metrics shows; None ("auto"): all, none with principals
    metrics_pool_labels: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    shm_dir: str
    budget: int  # bytes, all regions together
    default_pool_blocks: int
    prefault: bool
    warm_restart: bool  # keep regions + journal at stop; adopt them at the pool's next open
    warm_restart_checksum_bytes: int  # bytes of a row its checksum covers (0: whole rows)


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    lease: float  # seconds
    write_quarantine: float  # seconds
    max_sessions: int


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_keys_per_call: int
    max_pools: int
    events_retained: int  # per pool
    events_retained_bytes: int  # per pool
    removals_retained_bytes: int  # per pool, Explain's history
    max_watch_streams: int  # all pools together
    watch_write_timeout: float  # seconds
    promotion_hold: float  # seconds; 0 = no promotion holds
    remote_lookup_wait: float = 0.005  # seconds a Lookup may wait for remote tiers; 0: never


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One secondary tier: its type, its name (a metrics label) and typed settings
    (the settings dataclass of its type, see :mod:`kvtierd.tiers.registry`)."""

    type: str
    name: str
    settings: TierSettings
    key: str = ""  # where it was configured ("tiers[0]"), for error messages


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig
    memory: MemoryConfig
    sessions: SessionsConfig
    limits: LimitsConfig
    security: SecurityConfig
    log: LogConfig
    tiers: tuple[TierConfig, ...] = ()


_SECTION_TYPES: dict[str, type] = {
    "server": ServerConfig,
    "memory": MemoryConfig,
    "sessions": SessionsConfig,
    "limits": LimitsConfig,
    "security": SecurityConfig,
    "log": LogConfig,
}


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults < TOML file < environment < ``overrides``.

    ``overrides`` maps dotted keys (``memory.budget``) to raw values, as the CLI
    collects them. Raises ConfigError naming the key for any invalid value.
    """
    document = _read_toml(path) if path else {}
    _reject_unknown(document)
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {section: {} for section in _SECTION_TYPES}
    for option in OPTIONS:
        raw, found = _raw_value(option, document, env, overrides or {})
        try:
            values[option.section][option.key] = option.parse(raw) if found else option.default()
        except ValueError as exc:
            raise ConfigError(option.dotted, str(exc)) from None
    values["security"].update(_security_tables(document))
    sections = {name: cls(**values[name]) for name, cls in _SECTION_TYPES.items()}
    if path:
        tiers = _parse_tiers(document.get("tiers", []))
    else:
        tiers = default_tiers(env)
    config = Config(**sections, tiers=tiers)
    _check_cross_field(config)
    return config


# KVTIERD_* variables other programs of this project read, not the daemon: not
# reported as unknown at start (a test keeps this list complete)
OTHER_PROGRAMS_ENVIRONMENT: dict[str, str] = {
    "KVTIERD_ADDRESS": "kvtierctl, kvtierd-health and the client: the daemon's address",
    "KVTIERD_REPLAY_TRACE": "make replay, make bench-vllm: the trace replayed",
    "KVTIERD_BENCH_FS_ROOT": "the fs benchmarks: parent of their fs tier roots",
    "KVTIERD_BENCH_VLLM_PYTHON": "the fs benchmark: the interpreter with vLLM",
    "KVTIERD_BENCH_WARM_GIB": "the warm-restart benchmark: pool sizes",
    "KVTIERD_BENCH_WARM_ROUNDS": "the warm-restart benchmark: rounds",
    "KVTIERD_BENCH_WARM_STORE": "the warm-restart benchmark: cases",
    "KVTIERD_DEPLOY_CACHE": "make test-deploy: the base image cache",
    "KVTIERD_DEPLOY_BASE_IMAGE": "make test-deploy: the base image",
}
ENV_PREFIX = "KVTIERD_"


def unknown_environment(env: Mapping[str, str] | None = None) -> list[str]:
    """A WARNING line for each ``KVTIERD_*`` variable of ``env`` (default: the
    process's) that neither the daemon (``Option.env``) nor another program of
    this project (``OTHER_PROGRAMS_ENVIRONMENT``) reads, naming the closest
    known name. Such a variable is ignored: a misspelt one would change nothing."""
    env = os.environ if env is None else env
    known = [option.env for option in OPTIONS] + list(OTHER_PROGRAMS_ENVIRONMENT)
    warnings = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        key = name[len(ENV_PREFIX) :].lower()  # a key without its section (LEASE)
        close = [o.env for o in OPTIONS if o.key == key] or difflib.get_close_matches(
            name, known, n=1, cutoff=0.75
        )
        hint = (
            f"did you mean {close[0]}?"
            if close
            else "the daemon reads KVTIERD_<SECTION>_<KEY> for the keys kvtierd --help lists"
        )
        warnings.append(f"unknown environment variable {name} is ignored; {hint}")
    return warnings


def _check_cross_field(config: Config) -> None:
    try:
        security_config.check_security(config.security, config.server.listen)
    except SecurityOptionError as exc:
        raise ConfigError(exc.key, exc.message) from None


def _security_tables(document: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[security]`` fields from arrays of tables (``[[security.principals]]``)."""
    try:
        return security_config.parse_security_tables(document.get("security", {}))
    except SecurityOptionError as exc:
        raise ConfigError(exc.key, exc.message) from None


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError("--config", f"no such file: {path}") from None
    except OSError as exc:  # a directory, no permission...
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None


# keys holding arrays of tables, parsed by their own module
_TABLE_ARRAYS = {(security_config.SECTION, key) for key in security_config.TABLE_ARRAYS}


def _reject_unknown(document: Mapping[str, Any]) -> None:
    known = {(o.section, o.key) for o in OPTIONS}
    for section, body in document.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown section; known sections: {', '.join(SECTIONS)}")
        if section == "tiers":
            continue
        if not isinstance(body, dict):
            raise ConfigError(section, "must be a table")
        for key in body:
            if (section, key) not in known and (section, key) not in _TABLE_ARRAYS:
                names = sorted(o.key for o in OPTIONS if o.section == section)
                raise ConfigError(f"{section}.{key}", f"unknown key; known: {', '.join(names)}")


def _raw_value(
    option: Option,
    document: Mapping[str, Any],
    env: Mapping[str, str],
    overrides: Mapping[str, Any],
) -> tuple[Any, bool]:
    if option.dotted in overrides:
        return overrides[option.dotted], True
    if option.env in env:
        return env[option.env], True
    section = document.get(option.section, {})
    if option.key in section:
        return section[option.key], True
    return None, False


_TIER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


def data_directory(env: Mapping[str, str]) -> str:
    """Where the daemon keeps state: systemd's ``$STATE_DIRECTORY``, else
    /var/lib/kvtierd for root, else ``$XDG_DATA_HOME/kvtierd`` (~/.local/share)."""
    state = env.get("STATE_DIRECTORY", "")
    if state:
        return state.split(":")[0]
    if os.geteuid() == 0:
        return "/var/lib/kvtierd"
    base = env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvtierd")


def default_tiers(env: Mapping[str, str]) -> tuple[TierConfig, ...]:
    """The embedded default (no --config): the registry's default tier under the
    data directory."""
    tier_type, name, settings = registry.embedded_default(data_directory(env))
    return (TierConfig(tier_type, name, settings, key="tiers[default]"),)


def _parse_tiers(raw: Any) -> tuple[TierConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError("tiers", "must be an array of tables ([[tiers]])")
    tiers: list[TierConfig] = []
    for index, body in enumerate(raw):
        key = f"tiers[{index}]"
        if not isinstance(body, dict):
            raise ConfigError(key, "must be a table")
        options = dict(body)
        type_name = options.pop("type", None)
        if not isinstance(type_name, str) or not type_name:
            supported = ", ".join(registry.supported()) or "none in this build"
            raise ConfigError(f"{key}.type", f"missing; supported types: {supported}")
        try:
            tier_type = registry.lookup(type_name)
        except registry.UnknownTierType as exc:
            raise ConfigError(f"{key}.type", str(exc)) from None
        name = options.pop("name", f"{type_name}{index}")
        if not isinstance(name, str) or not _TIER_NAME.match(name) or name == "primary":
            raise ConfigError(f"{key}.name", f"must match [A-Za-z0-9_-]{{1,32}}, got {name!r}")
        if any(t.name == name for t in tiers):
            raise ConfigError(f"{key}.name", f"duplicate tier name {name!r}")
        try:
            settings = tier_type.parse_settings(options)
        except TierOptionError as exc:
            raise ConfigError(f"{key}.{exc.key}", exc.message) from None
        for option, value in settings.exclusive().items():
            if any(t.settings.exclusive().get(option) == value for t in tiers):
                raise ConfigError(f"{key}.{option}", f"{value} is already another tier's {option}")
        tiers.append(TierConfig(type=type_name, name=name, settings=settings, key=key))
    return tuple(tiers)
