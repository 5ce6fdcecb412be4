"""Building the configuration: defaults < TOML file < ``KVTIERD_<SECTION>_<KEY>``
environment variables < command-line flags (later sources win), validated once.
Nothing else in the daemon reads the environment."""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvtierd.config.options import OPTIONS, SECTIONS, Option
from kvtierd.config.sections import (
    Config,
    KvEventsConfig,
    LimitsConfig,
    LogConfig,
    MemoryConfig,
    ServerConfig,
    SessionsConfig,
    TierConfig,
)
from kvtierd.errors import ConfigError
from kvtierd.security import config as security_config
from kvtierd.security.config import SecurityConfig, SecurityOptionError
from kvtierd.tiers import registry
from kvtierd.tiers.configured import TierOptionError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
_SECTION_TYPES: dict[str, type] = {
    "server": ServerConfig,
    "memory": MemoryConfig,
    "sessions": SessionsConfig,
    "limits": LimitsConfig,
    "security": SecurityConfig,
    "log": LogConfig,
    "kv_events": KvEventsConfig,
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
    "KVTIERD_DAEMON_USER": "kvtierctl and the client: users trusted to run the daemon",
    "KVTIERD_REPLAY_TRACE": "make replay, make bench-vllm: the trace replayed",
    "KVTIERD_BENCH_FS_ROOT": "the fs benchmarks: parent of their fs tier roots",
    "KVTIERD_BENCH_VLLM_PYTHON": "the fs benchmark: the interpreter with vLLM",
    "KVTIERD_BENCH_WARM_GIB": "the warm-restart benchmark: pool sizes",
    "KVTIERD_BENCH_WARM_ROUNDS": "the warm-restart benchmark: rounds",
    "KVTIERD_BENCH_WARM_STORE": "the warm-restart benchmark: cases",
    "KVTIERD_DEPLOY_CACHE": "make test-deploy: the base image cache",
    "KVTIERD_DEPLOY_BASE_IMAGE": "make test-deploy: the base image",
    "KVTIERD_EVENTS": "deploy/kv-events/dynamo-indexer.sh: the daemon's [kv_events] endpoint",
    "KVTIERD_REPLAY": "deploy/kv-events/dynamo-indexer.sh: the daemon's replay endpoint",
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
        close = [o.env for o in OPTIONS if o.key == key] or closest(name, known)
        hint = (
            f"did you mean {close[0]}?"
            if close
            else "the daemon reads KVTIERD_<SECTION>_<KEY> for the keys kvtierd --help lists"
        )
        warnings.append(f"unknown environment variable {name} is ignored; {hint}")
    return warnings


def closest(name: str, known: Iterable[str]) -> list[str]:
    """The known name ``name`` is most likely a misspelling of (at most one; the
    one measure for environment variables, sections and keys)."""
    return difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)


def _unknown_tier_option_hint(option: str, known: Sequence[str]) -> str:
    """ "; did you mean ...?" after a tier type's refusal of an option it does not
    know (the type's message lists the known ones); "" for a known option."""
    close = [] if option in known else closest(option, known)
    return f"; did you mean {close[0]}?" if close else ""


def _unknown_key_hint(section: str, key: str) -> str:
    """ "did you mean ...? " for a key of ``section`` nobody reads: the same key in
    another section (``[memory] lease``), else a close key of this one; or ""."""
    elsewhere = [o.dotted for o in OPTIONS if o.key == key and o.section != section]
    keys = [o.key for o in OPTIONS if o.section == section]
    keys += [name for where, name in _TABLE_ARRAYS if where == section]
    close = closest(key, keys) or elsewhere  # a near miss here before the same key elsewhere
    return f"did you mean {close[0]}? " if close else ""


def _check_cross_field(config: Config) -> None:
    try:
        security_config.check_security(config.security, config.server.listen)
    except SecurityOptionError as exc:
        raise ConfigError(exc.key, exc.message) from None
    _check_kv_events(config.kv_events, config.security)


def _check_kv_events(events: KvEventsConfig, security: SecurityConfig) -> None:
    """An endpoint needs its pools; with principals, every pool it publishes belongs to
    ``kv_events.principal`` alone (one principal's prompts never reach an endpoint
    another principal reads)."""
    if not events.enabled:
        return
    if not events.pools:
        raise ConfigError(
            "kv_events.pools",
            "name the pools to publish (an endpoint publishes no pool by default)",
        )
    if events.replay_endpoint == events.endpoint:
        raise ConfigError("kv_events.replay_endpoint", "must differ from kv_events.endpoint")
    principals = security.principals
    if not principals:
        return
    names = [p.name for p in principals]
    if events.principal not in names:
        raise ConfigError(
            "kv_events.principal",
            f"with [[security.principals]], name the principal the published pools belong "
            f"to (one of {', '.join(names)}); got {events.principal!r}",
        )
    for pool in events.pools:
        owners = [p.name for p in principals if p.may_reach(pool)]
        if owners != [events.principal]:
            raise ConfigError(
                "kv_events.pools",
                f"pool {pool!r} is reachable by {owners or 'no principal'}; every published "
                f"pool must belong to kv_events.principal ({events.principal}) alone",
            )


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
            close = closest(section, SECTIONS)
            hint = f"did you mean [{close[0]}]? " if close else ""
            raise ConfigError(
                section, f"unknown section; {hint}known sections: {', '.join(SECTIONS)}"
            )
        if section == "tiers":
            continue
        if not isinstance(body, dict):
            raise ConfigError(section, "must be a table")
        for key in body:
            if (section, key) not in known and (section, key) not in _TABLE_ARRAYS:
                names = sorted(o.key for o in OPTIONS if o.section == section)
                raise ConfigError(
                    f"{section}.{key}",
                    f"unknown key; {_unknown_key_hint(section, key)}known: {', '.join(names)}",
                )


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
            hint = _unknown_tier_option_hint(exc.key, [option.key for option in tier_type.options])
            raise ConfigError(f"{key}.{exc.key}", exc.message + hint) from None
        for option, value in settings.exclusive().items():
            if any(t.settings.exclusive().get(option) == value for t in tiers):
                raise ConfigError(f"{key}.{option}", f"{value} is already another tier's {option}")
        tiers.append(TierConfig(type=type_name, name=name, settings=settings, key=key))
    return tuple(tiers)
