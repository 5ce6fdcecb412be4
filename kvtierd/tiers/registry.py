"""The tier types this build knows, by the ``type`` of a ``[[tiers]]`` table.

The one place that maps a type name to its settings parser, its table of options
and its :class:`~kvtierd.tiers.configured.ConfiguredTier` class: the configuration
(:mod:`kvtierd.config`), the daemon, the pool table, ``kvtierd --help`` and the docs'
configuration reference (``tools/docs_reference.py``) ask here and name no tier type
themselves. A configured-tier class is imported on first use, so parsing a
configuration does not load a tier's threads and I/O machinery.

Adding a type: one :func:`register` call below (or from a plug-in, before the
configuration is loaded).
"""

from __future__ import annotations

import importlib
import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.tiers.configured import ConfiguredTier, TierSettings
from kvtierd.tiers.fs import settings as fs_settings
from kvtierd.tiers.options import TierOption
from kvtierd.tiers.redis import settings as redis_settings


@dataclass(frozen=True, slots=True)
class TierType:
    """One tier type: how its ``[[tiers]]`` tables are parsed and what runs them."""

    name: str  # the ``type`` of its ``[[tiers]]`` tables
    # options (without ``type`` and ``name``) -> settings; pure, raises TierOptionError
    parse_settings: Callable[[Mapping[str, Any]], TierSettings]
    configured_class: str  # "module:Class" of its ConfiguredTier, imported on first use
    # its options (kvtierd.tiers.options): what --help and the docs' table show
    options: tuple[TierOption, ...]

    def configured(self) -> type[ConfiguredTier]:
        module, _, attribute = self.configured_class.partition(":")
        cls = getattr(importlib.import_module(module), attribute)
        if not (isinstance(cls, type) and issubclass(cls, ConfiguredTier)):
            raise TypeError(f"{self.configured_class} is not a ConfiguredTier")
        return cls


class UnknownTierType(ValueError):
    """A ``type`` this build does not run; the message lists the supported ones."""


_TYPES: dict[str, TierType] = {}


def register(tier_type: TierType) -> None:
    """Makes ``tier_type`` available to ``[[tiers]]`` tables; ValueError if its
    name is taken."""
    if tier_type.name in _TYPES:
        raise ValueError(f"tier type {tier_type.name!r} is registered already")
    _TYPES[tier_type.name] = tier_type


def unregister(name: str) -> None:
    """Forgets the tier type ``name`` (a plug-in unloading, a test cleaning up);
    configured tiers of it keep running."""
    _TYPES.pop(name, None)


def supported() -> tuple[str, ...]:
    """The type names this build runs, in registration order."""
    return tuple(_TYPES)


def lookup(name: str) -> TierType:
    """The tier type called ``name``; UnknownTierType naming the supported ones.

    Refusing other types keeps an operator from believing blocks persist to a
    tier that is not running.
    """
    tier_type = _TYPES.get(name)
    if tier_type is None:
        listed = ", ".join(_TYPES) or "none in this build"
        raise UnknownTierType(f"unsupported tier type {name!r}; supported: {listed}")
    return tier_type


def configure(type_name: str, name: str, settings: TierSettings) -> ConfiguredTier:
    """The configured tier of one parsed ``[[tiers]]`` table (no I/O yet)."""
    return lookup(type_name).configured()(name, settings)


def embedded_default(data_directory: str) -> tuple[str, str, TierSettings]:
    """``(type, name, settings)`` of the tier the daemon runs without ``--config``:
    an fs tier named "fs" in ``<data directory>/fs``, created when missing."""
    root = os.path.join(data_directory, "fs")
    return "fs", "fs", fs_settings.FsTierSettings(root=root, create_root=True)


def help_text(width: int = 79) -> str:
    """Every type's options with their help, for ``kvtierd --help``: a list per
    type, one item per option, wrapped to ``width`` columns."""
    lines = []
    for tier_type in _TYPES.values():
        lines.append(f'  type = "{tier_type.name}":')
        for option in tier_type.options:
            lines += textwrap.wrap(
                f"{option.key}: {option.help_line()}",
                width,
                initial_indent="    - ",
                subsequent_indent="      ",
            )
    return "\n".join(lines)


register(
    TierType(
        "fs",
        fs_settings.parse_fs_settings,
        "kvtierd.tiers.fs.configured:ConfiguredFsTier",
        fs_settings.OPTIONS,
    )
)
register(
    TierType(
        "redis",
        redis_settings.parse_redis_settings,
        "kvtierd.tiers.redis.configured:ConfiguredRedisTier",
        redis_settings.OPTIONS,
    )
)
