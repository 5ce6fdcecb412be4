"""The configuration's defaults (kvtierd.config): each written once, in ``OPTIONS``; the
frozen tree of sections (kvtierd.config.sections) declares none of its own, so the two
cannot disagree."""

from __future__ import annotations

import dataclasses
import typing

from kvtierd.config import OPTIONS, SECTIONS, Config, load_config

# section name -> its dataclass (server -> ServerConfig ...), as Config holds them
_SECTION_TYPES = {
    name: cls for name, cls in typing.get_type_hints(Config).items() if name in SECTIONS
}
_SECTION_TYPES.pop("tiers")  # the [[tiers]] tables: the tier types' own options


def test_no_section_field_has_a_default_of_its_own() -> None:
    declared = {(o.section, o.key) for o in OPTIONS}
    for section, cls in _SECTION_TYPES.items():
        for field in dataclasses.fields(cls):
            if (section, field.name) in declared:
                assert field.default is dataclasses.MISSING, f"{section}.{field.name}"
                assert field.default_factory is dataclasses.MISSING, f"{section}.{field.name}"


def test_every_field_of_a_scalar_section_is_an_option() -> None:
    """server, memory, sessions, limits and log hold nothing but their options (the
    [security] section adds its tables of principals), so the loader fills every field."""
    declared = {(o.section, o.key) for o in OPTIONS}
    for section, cls in _SECTION_TYPES.items():
        if section == "security":
            continue
        assert {(section, f.name) for f in dataclasses.fields(cls)} <= declared, section


def test_the_defaults_load_as_declared() -> None:
    config = load_config(env={})
    for option in OPTIONS:
        if option.section != "security":
            value = getattr(getattr(config, option.section), option.key)
            assert value == option.default(), option.dotted
