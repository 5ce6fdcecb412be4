"""The daemon's configuration: one frozen tree, built once from defaults, a TOML
file, ``KVTIERD_<SECTION>_<KEY>`` environment variables and command-line flags
(later sources win), validated once, then passed down. Nothing else in the
daemon reads the environment.

- ``options``: every scalar option declared once (section, key, reader, help, flag);
- ``values``: the readers of values (sizes, durations, addresses, choices);
- ``sections``: the frozen tree (:class:`Config` and its sections);
- ``loader``: :func:`load_config`, the ``[[tiers]]`` tables, unknown keys and
  environment variables.

Invariants: every scalar option is declared once, in ``options`` (the ``[security]`` file
keys in ``kvtierd.security.config``): its variable, its flag, ``--help`` and the docs' tables
are made from that declaration. Every value is checked while the tree is built; a bad one
raises ``ConfigError`` naming the option. The tree never changes once built.

May import: ``kvtierd.security`` and ``kvtierd.tiers`` (their sections' own readers),
``kvtierd.records`` (the accounted size of an event), the root vocabulary,
``kvtierd.util`` and ``kvtierd_client.wire`` (the default socket): layers below it.
Never ``kvtierd.core``, ``kvtierd.api`` or ``kvtierd.ops``.
"""

from kvtierd.config.loader import (
    OTHER_PROGRAMS_ENVIRONMENT,
    data_directory,
    default_tiers,
    load_config,
    unknown_environment,
)
from kvtierd.config.options import MAX_BLOCK_BYTES, OPTIONS, SECTIONS, Option
from kvtierd.config.sections import (
    Config,
    LimitsConfig,
    LogConfig,
    MemoryConfig,
    ServerConfig,
    SessionsConfig,
    TierConfig,
)
from kvtierd.config.values import parse_listen_address
from kvtierd.errors import ConfigError

__all__ = [
    "MAX_BLOCK_BYTES",
    "OPTIONS",
    "OTHER_PROGRAMS_ENVIRONMENT",
    "SECTIONS",
    "Config",
    "ConfigError",
    "LimitsConfig",
    "LogConfig",
    "MemoryConfig",
    "Option",
    "ServerConfig",
    "SessionsConfig",
    "TierConfig",
    "data_directory",
    "default_tiers",
    "load_config",
    "parse_listen_address",
    "unknown_environment",
]
